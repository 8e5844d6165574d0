//! What the engine's tests and the tests of the models it shards share: a
//! learnable batch, a whole in-process job of several ranks (threads) run
//! for a few steps, candle's own gradient norm of an unsharded model, and a
//! small model that is not the GPT. For tests: these panic on failure.

use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor};
use zeropp_comm::inproc::InProcess;
use zeropp_zero::layout::Layout;
use zeropp_zero::plan::Switches;
use zeropp_zero::traffic::Traffic;

use crate::model::{Model, Tie, Tied, tensors_from_flat};
use crate::optim::OptimConfig;
use crate::{Engine, EngineConfig};

/// A learnable batch: each sequence counts up from a random start.
pub fn batch(seed: u64, rows: usize, t: usize) -> (Tensor, Tensor) {
    let mut ids = Vec::with_capacity(rows * (t + 1));
    for r in 0..rows {
        let start = (seed as usize * 7 + r * 13) % 200;
        ids.extend((0..=t).map(|i| ((start + i) % 256) as u32));
    }
    let all = Tensor::from_vec(ids, (rows, t + 1), &Device::Cpu).unwrap();
    (all.narrow(1, 0, t).unwrap(), all.narrow(1, 1, t).unwrap())
}

/// One rank's record of a run.
pub struct RunResult {
    pub losses: Vec<f32>,
    pub norms: Vec<f32>,
    pub traffic: Traffic,
}

/// Trains `model` for `steps` steps on `nodes` x `g` in-process ranks with
/// `switches` (seed 3, AdamW at 3e-3 after one warm-up step); rank r's
/// batch is rows `r·rows .. (r+1)·rows` of one global batch.
pub fn run_model(
    model: Arc<dyn Model>,
    nodes: usize,
    g: usize,
    switches: Switches,
    steps: usize,
    rows: usize,
) -> Vec<RunResult> {
    let world = nodes * g;
    let handles: Vec<_> = InProcess::world(world)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let (switches, model) = (switches.clone(), model.clone());
            std::thread::spawn(move || {
                let cfg = EngineConfig {
                    model,
                    switches,
                    optim: OptimConfig {
                        warmup_steps: 1,
                        ..OptimConfig::default()
                    },
                    seed: 3,
                    islands: None,
                };
                let layout = Layout {
                    nodes,
                    ranks_per_node: g,
                    rank,
                };
                let mut e = Engine::new(Box::new(t), layout, cfg, Duration::from_secs(30)).unwrap();
                let mut out = RunResult {
                    losses: vec![],
                    norms: vec![],
                    traffic: Traffic::default(),
                };
                for s in 0..steps {
                    let (x, y) = batch(s as u64, world * rows, 16);
                    let (x, y) = (
                        x.narrow(0, rank * rows, rows).unwrap(),
                        y.narrow(0, rank * rows, rows).unwrap(),
                    );
                    let st = e.train_step(&x, &y, 3e-3).unwrap();
                    out.losses.push(st.loss);
                    out.norms.push(st.grad_norm);
                }
                out.traffic = e.traffic();
                out
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// The gradient norm of the whole model at its initial weights on one
/// batch, computed directly with candle (no engine, no sharding).
pub fn reference_grad_norm(model: &dyn Model, seed: u64, x: &Tensor, y: &Tensor) -> f32 {
    let mut vars = Vec::new();
    let mut h = x.clone();
    let mut tied = Tied::default();
    for u in 0..model.unit_count() {
        let flat = model.init(u, seed);
        let mut params = Vec::new();
        for t in tensors_from_flat(model, u, &flat, &Device::Cpu).unwrap() {
            let v = candle_core::Var::from_tensor(&t).unwrap();
            params.push(v.as_tensor().clone());
            vars.push(v);
        }
        tied.apply(model.tie(), u, &mut params);
        h = model.forward(u, &params, &h).unwrap();
    }
    let grads = model.loss(&h, y).unwrap().backward().unwrap();
    vars.iter()
        .map(|v| {
            let g = grads.get(v.as_tensor()).unwrap();
            g.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        })
        .sum::<f32>()
        .sqrt()
}

/// A model that is not the GPT: a token table, one tanh layer, and an
/// output that reuses the token table (tied) plus its own bias.
#[derive(Debug)]
pub struct TiedMlp {
    pub vocab: usize,
    pub width: usize,
}

impl Model for TiedMlp {
    fn validate(&self) -> std::result::Result<(), crate::model::InvalidModel> {
        Ok(())
    }
    fn unit_count(&self) -> usize {
        3
    }
    fn unit_name(&self, unit: usize) -> String {
        ["table", "layer", "out"][unit].into()
    }
    fn param_shapes(&self, unit: usize) -> Vec<Vec<usize>> {
        let (v, d) = (self.vocab, self.width);
        match unit {
            0 => vec![vec![v, d]],
            1 => vec![vec![d, d], vec![d]],
            _ => vec![vec![v]],
        }
    }
    fn init(&self, unit: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (unit as u64 + 1);
        (0..self.unit_numel(unit))
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
            })
            .collect()
    }
    fn tie(&self) -> Option<Tie> {
        Some(Tie {
            from: 0,
            param: 0,
            to: 2,
        })
    }
    fn forward(&self, unit: usize, p: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
        match unit {
            0 => {
                let (b, t) = x.dims2()?;
                p[0].index_select(&x.flatten_all()?, 0)?
                    .reshape((b, t, self.width))
            }
            1 => x.broadcast_matmul(&p[0])?.broadcast_add(&p[1])?.tanh(),
            _ => x.broadcast_matmul(&p[1].t()?)?.broadcast_add(&p[0]),
        }
    }
    fn loss(&self, logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, v) = logits.dims3()?;
        let logits = logits.reshape((b * t, v))?;
        let targets = targets.reshape((b * t, 1))?;
        let picked = logits.gather(&targets, 1)?;
        let lse = logits.exp()?.sum_keepdim(1)?.log()?;
        (lse - picked)?.mean_all()
    }
}
