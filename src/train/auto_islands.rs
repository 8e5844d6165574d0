//! `zeropp train --islands auto`: the islands chosen at join from the
//! links the job measured. The link between each two consecutive nodes
//! (where islands of whole nodes could be cut: [`crate::zero::probe::seams`];
//! on two nodes, the cross link itself), the step's compute estimated from
//! one block and the head timed at join, and the cost model
//! ([`zeropp_zero::cost::PlanInput::choose_islands`]) predicting every
//! count of islands; every rank derives the same choice from the same
//! agreed figures.

use std::time::Instant;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use zeropp_zero::cost::{IslandsCandidate, PlanInput};

use crate::comm::{Communicator, Group};
use crate::train::config::TrainConfig;
use crate::zero::layout::Layout;
use crate::zero::measured::Measured;
use crate::zero::plan::Switches;

/// What `--islands auto` chose, and from what (the summary's
/// `islands_chosen`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IslandsChosen {
    pub islands: usize,
    pub why: String,
    /// Each count of islands the plan weighed and its predicted step.
    pub candidates: Vec<IslandsCandidate>,
    /// The NIC rate of each link between consecutive nodes, Gbit/s.
    pub seams_gbit: Vec<f64>,
    /// The forward and backward of one step, estimated at join.
    pub compute_estimate_s: f64,
}

/// Chooses the islands of an `--islands auto` run: one island where
/// nothing was measured (logical nodes, one rank, ZEROPP_PROBE=0, a mode
/// other than zeropp), else the plan's choice from the seams between
/// consecutive nodes (measured here when there are more than two nodes
/// and `probe_seams`; else each taken as the cross link measured at join),
/// an estimate of the step's compute, and the block sizes the run would
/// use (the cost model predicts each count's fastest configuration).
pub fn choose(
    cfg: &TrainConfig,
    comm: &Communicator,
    world: &Group,
    layout: Layout,
    measured: Option<&Measured>,
    switches: &Switches,
    probe_seams: bool,
) -> Result<IslandsChosen> {
    let one = |why: &str| IslandsChosen {
        islands: 1,
        why: why.to_string(),
        candidates: Vec::new(),
        seams_gbit: Vec::new(),
        compute_estimate_s: 0.0,
    };
    if layout.nodes < 2 {
        return Ok(one("one node: nothing to cut"));
    }
    let Some(measured) = measured else {
        return Ok(one(if !crate::zero::probe::enabled() {
            "ZEROPP_PROBE=0: no links measured at join, one synchronous job"
        } else if cfg.switches.mode != crate::train::config::Mode::Zeropp {
            "--mode zero3 measures no links at join: one synchronous job"
        } else {
            "the nodes are logical nodes of one host (no link between them to measure): one \
             synchronous job"
        }));
    };
    let g = layout.ranks_per_node;
    let seams = if layout.nodes == 2 || !probe_seams {
        let cross = measured.links.cross.into_iter();
        cross.cycle().take(layout.nodes - 1).collect()
    } else {
        crate::zero::probe::seams(comm, world, layout, crate::zero::probe::BUDGET)
            .map_err(|e| anyhow::anyhow!("measuring the links between nodes at join: {e}"))?
    };
    let seams_gbit: Vec<f64> = seams
        .iter()
        .map(|l| crate::zero::planner::nic_gbit(*l, g))
        .collect();
    let units = cfg.model.units();
    let params: usize = units.iter().map(|u| u.numel(&cfg.model)).sum();
    let compute_s = crate::zero::probe::slowest(comm, world, compute_estimate_s(cfg)?)?;
    let base = PlanInput {
        compute_s,
        units: units.len(),
        // The engine gathers the next unit while this one computes.
        overlap: 1.0,
        ..PlanInput::emulated_cluster(1000.0)
    };
    let input =
        crate::zero::planner::input_from(measured, switches, layout.nodes, g, params as f64, &base);
    let c = &cfg.islands;
    let h = c.sync_every.number().unwrap_or(20);
    let choice = input
        .choose_islands(&seams_gbit, h, c.outer_fragments, c.outer_delay)
        .map_err(|e| anyhow::anyhow!("choosing the islands: {e}"))?;
    Ok(IslandsChosen {
        islands: choice.islands,
        why: format!(
            "{} (compute estimated at {compute_s:.4} s a step; links between consecutive \
             nodes {} Gbit/s)",
            choice.why,
            seams_gbit
                .iter()
                .map(|s| format!("{s:.3}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        candidates: choice.candidates,
        seams_gbit,
        compute_estimate_s: compute_s,
    })
}

/// Seconds of one step's forward, recomputed forward and backward on
/// this rank: one block's and the head's forward and backward timed at the
/// run's shapes (best of three, while every rank of the host times its
/// own, as they will compute), the blocks counted
/// `layers` times and the forward once more for the recomputation.
fn compute_estimate_s(cfg: &TrainConfig) -> Result<f64> {
    use crate::train::model::Unit;
    use candle_core::{DType, Device, Tensor, Var};
    let m = &cfg.model;
    let (b, t) = (cfg.run.batch, m.context);
    let x = Tensor::randn(0f32, 1.0, (b, t, m.width), &Device::Cpu)?;
    let timed = |unit: Unit, index: usize| -> Result<(f64, f64)> {
        let values = unit.init(m, cfg.run.seed, index);
        let mut vars = Vec::new();
        let mut at = 0;
        for p in unit.params(m) {
            let n = p.numel();
            let v = Tensor::from_slice(&values[at..at + n], p.shape.as_slice(), &Device::Cpu)?;
            vars.push(Var::from_tensor(&v)?);
            at += n;
        }
        let mut params: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        if matches!(unit, Unit::Head) && m.tied_head {
            params.push(Tensor::randn(0f32, 0.02, (m.vocab, m.width), &Device::Cpu)?);
        }
        let (mut forward, mut backward) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..3 {
            let s = Instant::now();
            let y = unit
                .forward(m, &params, &x)?
                .to_dtype(DType::F32)?
                .sum_all()?;
            let f = s.elapsed().as_secs_f64();
            let s = Instant::now();
            y.backward()?;
            forward = forward.min(f);
            backward = backward.min(s.elapsed().as_secs_f64());
        }
        Ok((forward, backward))
    };
    let (bf, bb) = timed(Unit::Block(0), 1)?;
    let (hf, hb) = timed(Unit::Head, m.layers + 1)?;
    Ok(m.layers as f64 * (2.0 * bf + bb) + 2.0 * hf + hb)
}
