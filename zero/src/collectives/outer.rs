//! The outer step of islands (DiLoCo's, over shards): every H inner steps
//! each rank's outer delta — its shard of the anchor minus its shard of the
//! weights — is averaged over the ranks of the other islands that hold the
//! same shard (plain in f32, or quantized with error feedback:
//! [`crate::allreduce`]), Nesterov SGD turns the averaged delta into the
//! new anchor, and the island continues from it. The state (anchor,
//! momentum) is per shard: O(Ψ/W_island) per rank.

use crate::allreduce::{self, QuantizedAllReduce, ReplicaFeedback};
use crate::backend::Hop;
use crate::error::ZeroError;
use crate::host::{Host, HostMover};
use crate::qgz::Reduction;
use crate::residual::Residual;
use crate::traffic::Phase;

/// The outer optimizer: SGD with Nesterov momentum on the averaged outer
/// delta. Default lr 0.3, momentum 0.6: measured best at H = 20 on runs
/// of hundreds of steps over 6 seeds (docs/TRAINING.md, "Islands");
/// DiLoCo's 0.7 and 0.9, tuned for H = 500 over tens of thousands of
/// steps, overshoot there.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OuterSettings {
    pub lr: f32,
    pub momentum: f32,
    pub nesterov: bool,
}

impl Default for OuterSettings {
    fn default() -> Self {
        OuterSettings {
            lr: 0.3,
            momentum: 0.6,
            nesterov: true,
        }
    }
}

impl OuterSettings {
    /// The outer optimizer on one value: from momentum `m` and averaged
    /// delta `g`, the new momentum and the step the anchor moves against
    /// (scaled by `lr`).
    pub fn update(self, m: f32, g: f32) -> (f32, f32) {
        let buf = self.momentum * m + g;
        let update = if self.nesterov {
            g + self.momentum * buf
        } else {
            buf
        };
        (buf, update)
    }
}

/// One shard's outer state on the host: the anchor the island started its
/// H inner steps from, the outer momentum, and (quantized) what the two
/// quantizations of the exchange dropped last time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OuterState {
    pub anchor: Vec<f32>,
    pub momentum: Vec<f32>,
    /// Error feedback of the exchange's two quantizations: this member's
    /// contributions, and its own part of the result (empty until the
    /// first quantized step; of another shape they start over).
    pub sent: Residual,
    pub owned: Residual,
    /// An exchange that has finished but is not applied yet (streaming:
    /// it lands at a later step).
    pub flight: Option<Flight>,
}

/// A finished exchange of a shard waiting for its step: the weights when
/// the delta was taken, and the delta averaged over the islands.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Flight {
    /// The optimizer step after which it is applied.
    pub due: u64,
    pub then: Vec<f32>,
    pub averaged: Vec<f32>,
}

impl OuterState {
    /// The state of a shard whose weights are `weights` now (the anchor is
    /// where the island starts; no momentum yet).
    pub fn new(weights: &[f32]) -> OuterState {
        OuterState {
            anchor: weights.to_vec(),
            momentum: vec![0.0; weights.len()],
            ..OuterState::default()
        }
    }

    /// Bytes held (anchor, momentum, residuals).
    pub fn bytes(&self) -> usize {
        let flight = self
            .flight
            .as_ref()
            .map_or(0, |f| 4 * (f.then.len() + f.averaged.len()));
        4 * (self.anchor.len() + self.momentum.len())
            + self.sent.bytes()
            + self.owned.bytes()
            + flight
    }
}

/// The outer step of one shard: `weights` (this rank's shard after the
/// inner steps) become the new anchor, the same on every member of `hop`
/// (the ranks of the other islands holding this shard). With `quantized`
/// the deltas travel as its format with error feedback kept in `state`;
/// without, in f32. [`local_delta`], [`exchange`] and [`apply`] in a row,
/// with nothing trained between the first and the last.
pub fn outer_step(
    m: &HostMover<'_>,
    hop: Hop,
    s: OuterSettings,
    quantized: Option<QuantizedAllReduce>,
    state: &mut OuterState,
    weights: &mut [f32],
) -> Result<(), ZeroError> {
    outer_step_with(s, state, weights, |state, mut delta| {
        let residuals = (&mut state.sent, &mut state.owned);
        exchange(m, hop, quantized, residuals, &mut delta)?;
        Ok(delta)
    })
}

/// [`outer_step`] with the exchange `averaged` makes of this island's
/// delta (with the error feedback `state` keeps): over one group, or over
/// the islands taking part (`zero::islands::Across`).
pub fn outer_step_with(
    s: OuterSettings,
    state: &mut OuterState,
    weights: &mut [f32],
    averaged: impl FnOnce(&mut OuterState, Vec<f32>) -> Result<Vec<f32>, ZeroError>,
) -> Result<(), ZeroError> {
    let mine = local_delta(state, weights)?;
    let averaged = averaged(state, mine)?;
    let then = weights.to_vec();
    apply(s, state, &then, &averaged, weights)
}

/// This island's outer delta of a shard: its anchor minus its weights.
pub fn local_delta(state: &OuterState, weights: &[f32]) -> Result<Vec<f32>, ZeroError> {
    let len = weights.len();
    if state.anchor.len() != len || state.momentum.len() != len {
        return Err(ZeroError::Invalid(format!(
            "an outer step of a shard of {len} values with an anchor of {} and momentum of {}: \
             the state belongs to another shard",
            state.anchor.len(),
            state.momentum.len()
        )));
    }
    Ok(state
        .anchor
        .iter()
        .zip(weights)
        .map(|(a, w)| a - w)
        .collect())
}

/// Averages `delta` over the members of `hop`, in place: plain in f32, or
/// quantized with error feedback in `residuals` (what this member's
/// contributions and its own part of the result dropped last time). The
/// only part of an outer step that talks: it may run on a thread of its
/// own while the island trains on.
pub fn exchange(
    m: &HostMover<'_>,
    hop: Hop,
    quantized: Option<QuantizedAllReduce>,
    residuals: (&mut Residual, &mut Residual),
    delta: &mut Vec<f32>,
) -> Result<(), ZeroError> {
    match quantized {
        Some(q) => {
            let feedback = ReplicaFeedback::<Host> {
                sent: Some(residuals.0.chunks_mut()),
                owned: Some(residuals.1.chunks_mut()),
            };
            let hop = (hop, Phase::Outer);
            allreduce::all_reduce_quantized(&Host, m, hop, q, Reduction::Mean, delta, feedback)
        }
        None => m.all_reduce_tensor(&Host, (hop, Phase::Outer), delta, true),
    }
}

/// The outer optimizer on the `averaged` delta: the anchor moves (Nesterov
/// SGD), and `weights` become the new anchor plus what the island trained
/// since its weights were `then` (when it took its delta): nothing when
/// the exchange overlapped no inner step, and the weights are exactly the
/// new anchor, the same on every island.
pub fn apply(
    s: OuterSettings,
    state: &mut OuterState,
    then: &[f32],
    averaged: &[f32],
    weights: &mut [f32],
) -> Result<(), ZeroError> {
    let len = weights.len();
    if [
        state.anchor.len(),
        state.momentum.len(),
        then.len(),
        averaged.len(),
    ] != [len; 4]
    {
        return Err(ZeroError::Invalid(format!(
            "an outer step of a shard of {len} values with an anchor of {}, momentum of {}, \
             weights then of {} and an averaged delta of {}: they belong to another shard",
            state.anchor.len(),
            state.momentum.len(),
            then.len(),
            averaged.len()
        )));
    }
    let outer = state.anchor.iter_mut().zip(state.momentum.iter_mut());
    let moved = then.iter().zip(averaged).zip(weights.iter_mut());
    for ((anchor, momentum), ((&then, &g), w)) in outer.zip(moved) {
        let (buf, update) = s.update(*momentum, g);
        *momentum = buf;
        // The island's progress since it took its delta.
        let since = *w - then;
        *anchor -= s.lr * update;
        *w = *anchor + since;
    }
    Ok(())
}

/// Where the outer step on this island's own `delta` alone would put the
/// anchor (Nesterov SGD from the state's momentum; nothing is updated):
/// the point a streamed exchange's island trains on from while the
/// averaged delta travels (an eager update), so that at landing
/// ([`apply`] with `then` this point) it moves only by the difference the
/// other islands make.
pub fn eager(s: OuterSettings, state: &OuterState, delta: &[f32]) -> Vec<f32> {
    state
        .anchor
        .iter()
        .zip(&state.momentum)
        .zip(delta)
        .map(|((a, &m), &g)| a - s.lr * s.update(m, g).1)
        .collect()
}

#[cfg(test)]
mod tests {
    use zeropp_quant::{QuantFormat, Rounding};

    use super::*;
    use crate::testing::{gradient, on_ranks};

    /// Island `i`'s weights after its inner steps: the anchor moved by a
    /// per-island drift.
    fn drifted(anchor: &[f32], island: usize, step: usize) -> Vec<f32> {
        let d = gradient(island * 7 + step, anchor.len());
        anchor.iter().zip(&d).map(|(a, d)| a - d).collect()
    }

    /// The outer steps as DiLoCo writes them, on the average of every
    /// island's exact delta (f32, island order).
    fn reference(anchor: &[f32], islands: usize, steps: usize, s: OuterSettings) -> Vec<f32> {
        let (mut a, mut buf) = (anchor.to_vec(), vec![0f32; anchor.len()]);
        for step in 0..steps {
            let deltas: Vec<Vec<f32>> = (0..islands)
                .map(|i| {
                    let w = drifted(&a, i, step);
                    a.iter().zip(&w).map(|(a, w)| a - w).collect()
                })
                .collect();
            for j in 0..a.len() {
                let g = deltas.iter().map(|d| d[j]).sum::<f32>() / islands as f32;
                buf[j] = s.momentum * buf[j] + g;
                let update = if s.nesterov {
                    g + s.momentum * buf[j]
                } else {
                    buf[j]
                };
                a[j] -= s.lr * update;
            }
        }
        a
    }

    /// `steps` outer steps of 2 islands (nodes of one rank: the cross
    /// group holds the same shard on the other island); every rank's
    /// final weights.
    fn run(steps: usize, quantized: Option<QuantizedAllReduce>) -> Vec<Vec<f32>> {
        let len = 300;
        on_ranks(2, 1, move |layout, m| {
            let anchor = gradient(100, len);
            let mut state = OuterState::new(&anchor);
            let mut weights = anchor.clone();
            for step in 0..steps {
                weights = drifted(&weights, layout.rank, step);
                let s = OuterSettings::default();
                outer_step(m, Hop::Cross, s, quantized, &mut state, &mut weights).unwrap();
            }
            weights
        })
        .into_iter()
        .map(|(w, _)| w)
        .collect()
    }

    fn int4() -> QuantizedAllReduce {
        QuantizedAllReduce {
            format: QuantFormat::int4(64).unwrap(),
            rounding: Rounding::NearestEven,
            hadamard: true,
        }
    }

    #[test]
    fn the_plain_outer_step_is_diloco_s_nesterov_step_on_the_averaged_delta() {
        let got = run(5, None);
        let expected = reference(&gradient(100, 300), 2, 5, OuterSettings::default());
        for (rank, w) in got.iter().enumerate() {
            assert_eq!(w, &expected, "rank {rank}");
        }
    }

    #[test]
    fn the_quantized_outer_step_keeps_the_islands_identical_and_near_the_exact_one() {
        // (error, distance moved) of the quantized anchor after `steps`.
        let off = |steps| {
            let got = run(steps, Some(int4()));
            assert_eq!(got[0], got[1], "the islands' anchors differ");
            let exact = reference(&gradient(100, 300), 2, steps, OuterSettings::default());
            let start = gradient(100, 300);
            let (mut err, mut moved) = (0f64, 0f64);
            for ((g, e), s) in got[0].iter().zip(&exact).zip(&start) {
                err += f64::from(g - e).powi(2);
                moved += f64::from(e - s).powi(2);
            }
            (err.sqrt(), moved.sqrt())
        };
        let (early, _) = off(2);
        let (late, moved) = off(8);
        // About one int4 quantization's error of the way moved, and error
        // feedback keeps it from adding up step after step.
        assert!(late < 0.15 * moved, "off by {late:.4} of {moved:.4} moved");
        assert!(
            late < 2.0 * early,
            "off by {early:.4} after 2 steps, {late:.4} after 8"
        );
    }

    #[test]
    fn an_eager_step_is_where_the_island_s_own_outer_step_lands_and_landing_adds_the_others() {
        let s = OuterSettings::default();
        let n = 300;
        let mut state = OuterState::new(&gradient(100, n));
        state.momentum = gradient(7, n);
        let w: Vec<f32> = drifted(&state.anchor, 0, 0);
        let own = local_delta(&state, &w).unwrap();
        let eager = super::eager(s, &state, &own);
        // The island's own outer step, blocking (weights then = now).
        let (mut alone, mut blocked) = (state.clone(), w.clone());
        apply(s, &mut alone, &w, &own, &mut blocked).unwrap();
        assert_eq!(
            eager, blocked,
            "the eager point is the island's own outer step"
        );
        // Streamed: the island trains on from the eager point; the average
        // lands with its own delta in it: the new anchor plus the progress.
        let progress = gradient(11, n);
        let mut now: Vec<f32> = eager.iter().zip(&progress).map(|(e, p)| e - p).collect();
        let averaged: Vec<f32> = own
            .iter()
            .zip(gradient(13, n))
            .map(|(a, b)| (a + b) / 2.0)
            .collect();
        let mut landed = state.clone();
        apply(s, &mut landed, &eager, &averaged, &mut now).unwrap();
        for ((w, a), p) in now.iter().zip(&landed.anchor).zip(&progress) {
            assert!((w - (a - p)).abs() <= 1e-5, "{w} against {a} - {p}");
        }
        assert!(
            landed.anchor != alone.anchor,
            "the others' deltas moved the anchor"
        );
    }

    #[test]
    fn a_state_of_another_shard_is_refused() {
        let got = on_ranks(1, 1, |_, m| {
            let mut state = OuterState::new(&[0.0; 4]);
            let mut w = vec![0f32; 5];
            let s = OuterSettings::default();
            outer_step(m, Hop::Cross, s, None, &mut state, &mut w)
                .unwrap_err()
                .to_string()
        });
        assert!(got[0].0.contains("another shard"), "{}", got[0].0);
    }
}
