//! AdamW on a primary shard, and the learning-rate schedule (linear warm-up,
//! cosine decay to a floor).

zeropp_settings::section! {
    /// AdamW and its schedule (the `[optim]` table of a config; unset keys
    /// take the defaults).
    OptimConfig / OptimArgs [deny_unknown_fields] {
        /// Peak learning rate.
        lr: f32 = 3e-3,
        /// Fraction of the peak learning rate the cosine decays to.
        min_lr_ratio: f32 = 0.1,
        /// Steps of linear warm-up before the cosine decay.
        warmup_steps: usize = 20,
        /// AdamW's decay of the gradient's running mean.
        beta1: f32 = 0.9,
        /// AdamW's decay of the squared gradient's running mean.
        beta2: f32 = 0.95,
        /// AdamW's epsilon.
        eps: f32 = 1e-8,
        /// AdamW's decoupled weight decay.
        weight_decay: f32 = 0.1,
        /// Clip the global gradient norm to this (0 = no clipping).
        max_grad_norm: f32 = 1.0,
        /// Skip a step whose loss or gradient is NaN/Inf (no update) instead
        /// of stopping the run.
        skip_nonfinite: bool = false,
    }
}

impl OptimConfig {
    /// Settings AdamW cannot train with, named with the flag to change.
    pub fn check(&self) -> Result<(), String> {
        let c = self;
        let bad = |key: &str, v: f32, want: &str| {
            let flag = key.replace('_', "-");
            format!("{key} = {v}: must be {want} (--{flag}, or `{key}` in a config's [optim])")
        };
        if !(c.lr.is_finite() && c.lr > 0.0) {
            return Err(bad("lr", c.lr, "positive and finite (default 3e-3)"));
        }
        if !(0.0..=1.0).contains(&c.min_lr_ratio) {
            return Err(bad(
                "min_lr_ratio",
                c.min_lr_ratio,
                "in [0, 1] (default 0.1)",
            ));
        }
        for (flag, v, default) in [("beta1", c.beta1, "0.9"), ("beta2", c.beta2, "0.95")] {
            if !(0.0..1.0).contains(&v) {
                return Err(bad(flag, v, &format!("in [0, 1) (default {default})")));
            }
        }
        if !(c.eps.is_finite() && c.eps > 0.0) {
            return Err(bad("eps", c.eps, "positive and finite (default 1e-8)"));
        }
        if !(c.weight_decay.is_finite() && c.weight_decay >= 0.0) {
            return Err(bad(
                "weight_decay",
                c.weight_decay,
                "at least 0 and finite (default 0.1)",
            ));
        }
        if !(c.max_grad_norm.is_finite() && c.max_grad_norm >= 0.0) {
            return Err(bad(
                "max_grad_norm",
                c.max_grad_norm,
                "at least 0 (0: no clipping) and finite",
            ));
        }
        Ok(())
    }

    /// Learning rate at `step` (0-based) of `total`.
    pub fn lr_at(&self, step: usize, total: usize) -> f32 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f32 / self.warmup_steps as f32;
        }
        let span = total.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step - self.warmup_steps) as f32 / span as f32).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f32::consts::PI * progress).cos());
        self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)
    }
}

/// AdamW state of one primary shard.
#[derive(Clone, Debug, Default)]
pub struct AdamState {
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

impl AdamState {
    pub fn new(len: usize) -> Self {
        AdamState {
            m: vec![0.0; len],
            v: vec![0.0; len],
        }
    }

    /// One update of `w` with gradient `g` (already clipped and averaged).
    /// `decay[i]` says whether weight decay applies to element `i`; `t` is
    /// the 1-based step number.
    pub fn update(
        &mut self,
        c: &OptimConfig,
        lr: f32,
        t: usize,
        w: &mut [f32],
        g: &[f32],
        decay: &[bool],
    ) {
        let b1t = 1.0 - c.beta1.powi(t as i32);
        let b2t = 1.0 - c.beta2.powi(t as i32);
        let n = w.len();
        assert!(g.len() == n && decay.len() == n && self.m.len() == n && self.v.len() == n);
        // Zipped, with the decay as a select: no bounds checks or branches,
        // so it vectorises; the same operations in the same order.
        let lr_decay = lr * c.weight_decay;
        for ((((w, &gi), &d), m), v) in w
            .iter_mut()
            .zip(g)
            .zip(decay)
            .zip(self.m.iter_mut())
            .zip(self.v.iter_mut())
        {
            *m = c.beta1 * *m + (1.0 - c.beta1) * gi;
            *v = c.beta2 * *v + (1.0 - c.beta2) * gi * gi;
            let mhat = *m / b1t;
            let vhat = *v / b2t;
            let decayed = *w - lr_decay * *w;
            *w = if d { decayed } else { *w };
            *w -= lr * mhat / (vhat.sqrt() + c.eps);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        let c = OptimConfig::default();
        assert!(c.lr_at(0, 100) < c.lr_at(10, 100));
        assert!((c.lr_at(19, 100) - c.lr).abs() < 1e-9);
        assert!(c.lr_at(60, 100) < c.lr);
        assert!((c.lr_at(100, 100) - c.lr * c.min_lr_ratio).abs() < 1e-6);
    }

    #[test]
    fn adamw_moves_against_the_gradient() {
        let c = OptimConfig::default();
        let mut s = AdamState::new(2);
        let mut w = vec![1.0, -1.0];
        s.update(&c, 0.1, 1, &mut w, &[1.0, -1.0], &[false, false]);
        assert!(w[0] < 1.0 && w[1] > -1.0);
    }
}
