//! Error statistics of a quantization round trip, as `zeropp quant-error`
//! reports them. Accumulated in f64 so that large tensors stay accurate.

/// What quantization did to one tensor.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ErrorStats {
    pub elements: usize,
    /// `max |x|`.
    pub absmax: f64,
    /// `Σ (x - x̂)²`.
    pub sum_sq_error: f64,
    /// `Σ x²`.
    pub sum_sq_signal: f64,
    /// `max |x - x̂|`.
    pub max_abs_error: f64,
}

impl ErrorStats {
    /// Compares `original` with its round trip `restored` (same length).
    pub fn measure(original: &[f32], restored: &[f32]) -> Self {
        assert_eq!(
            original.len(),
            restored.len(),
            "round trip changed the length"
        );
        let mut s = ErrorStats {
            elements: original.len(),
            ..Default::default()
        };
        for (&x, &y) in original.iter().zip(restored) {
            let (x, y) = (x as f64, y as f64);
            let e = (x - y).abs();
            s.absmax = s.absmax.max(x.abs());
            s.sum_sq_error += e * e;
            s.sum_sq_signal += x * x;
            s.max_abs_error = s.max_abs_error.max(e);
        }
        s
    }

    /// Folds another tensor's statistics into these.
    pub fn merge(&mut self, other: &ErrorStats) {
        self.elements += other.elements;
        self.absmax = self.absmax.max(other.absmax);
        self.sum_sq_error += other.sum_sq_error;
        self.sum_sq_signal += other.sum_sq_signal;
        self.max_abs_error = self.max_abs_error.max(other.max_abs_error);
    }

    /// Root mean square error (0 for an empty tensor).
    pub fn rmse(&self) -> f64 {
        if self.elements == 0 {
            0.0
        } else {
            (self.sum_sq_error / self.elements as f64).sqrt()
        }
    }

    /// `‖x − x̂‖ / ‖x‖` (0 when both are zero, infinite when only x is).
    pub fn rel_l2_error(&self) -> f64 {
        if self.sum_sq_error == 0.0 {
            0.0
        } else {
            (self.sum_sq_error / self.sum_sq_signal).sqrt()
        }
    }

    /// Signal-to-noise ratio in dB, `10·log10(‖x‖² / ‖x − x̂‖²)`; infinite
    /// for an exact round trip.
    pub fn snr_db(&self) -> f64 {
        if self.sum_sq_error == 0.0 {
            f64::INFINITY
        } else {
            10.0 * (self.sum_sq_signal / self.sum_sq_error).log10()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics_of_a_known_error() {
        let s = ErrorStats::measure(&[3.0, 4.0], &[3.0, 4.5]);
        assert_eq!(s.max_abs_error, 0.5);
        assert!((s.rmse() - (0.125f64).sqrt()).abs() < 1e-12);
        assert!((s.rel_l2_error() - 0.1).abs() < 1e-12);
        assert!((s.snr_db() - 20.0).abs() < 1e-9);
        let exact = ErrorStats::measure(&[1.0], &[1.0]);
        assert_eq!(exact.snr_db(), f64::INFINITY);
        assert_eq!(exact.rel_l2_error(), 0.0);
    }
}

/// Error figures of one tensor, or of all of them together, as `zeropp
/// quant-error` and `zeropp.quant.error` report them.
#[derive(Clone, Debug, serde::Serialize, PartialEq)]
pub struct Figures {
    pub elements: usize,
    pub absmax: f64,
    pub rmse: f64,
    pub max_abs_error: f64,
    pub rel_l2_error: f64,
    /// `null` in JSON when the round trip is exact (infinite SNR).
    pub snr_db: Option<f64>,
    pub bytes_in: usize,
    pub bytes_out: usize,
}

impl Figures {
    pub fn new(stats: &ErrorStats, bytes_in: usize, bytes_out: usize) -> Self {
        let snr = stats.snr_db();
        Figures {
            elements: stats.elements,
            absmax: stats.absmax,
            rmse: stats.rmse(),
            max_abs_error: stats.max_abs_error,
            rel_l2_error: stats.rel_l2_error(),
            snr_db: snr.is_finite().then_some(snr),
            bytes_in,
            bytes_out,
        }
    }
}
