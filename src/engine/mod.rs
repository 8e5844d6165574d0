//! The sharding engine: ZeRO-3 with the ZeRO++ switches, as DESIGN.md §2
//! specifies. Each rank owns one chunk of every unit's flat parameter buffer
//! (fp32 master + AdamW state); weights are gathered unit by unit (the next
//! unit's gather runs on the communication thread while this one computes),
//! activations are kept only at unit boundaries and recomputed in backward,
//! and each unit's gradient is reduce-scattered back to the chunk owners.

pub mod optim;
pub mod payload;
pub mod plan;
pub mod traffic;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use bytes::{Bytes, BytesMut};
use candle_core::{Device, Tensor, Var};
use zeropp_quant::{QuantizedChunks, QuantizedTensor, Rounding, quantize_swizzled, sum_requantize};

use crate::comm::collectives::{CommThread, Pending, Reduce, balanced_bounds};
use crate::comm::{CommError, Communicator, Group, Transport};
use crate::model::{ModelConfig, Unit, loss, tensors_from_flat};
use optim::{AdamState, OptimConfig};
use plan::{GradWire, Layout, Plan, Switches, WeightWire};
use traffic::{CountingTransport, Phase, Traffic};

/// Everything that defines a run's numerics.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub model: ModelConfig,
    pub switches: Switches,
    pub optim: OptimConfig,
    pub seed: u64,
}

/// One unit's state on this rank.
struct ShardedUnit {
    unit: Unit,
    /// Elements of the padded flat buffer, and of each rank's chunk.
    padded: usize,
    chunk: usize,
    /// fp32 master weights of this rank's chunk.
    master: Vec<f32>,
    adam: AdamState,
    /// Whether weight decay applies to each element of the chunk.
    decay: Vec<bool>,
    /// hpZ: the wire payloads of chunks `i·k .. (i+1)·k` of the gathered
    /// weights (i: this rank's place in its hpZ group of h, k = W / h; for
    /// the node, i = local rank and k = N), valid from this step's forward
    /// until its optimizer step.
    secondary: Option<Vec<Bytes>>,
    /// qgZ error feedback: what the first quantization dropped last step
    /// (padded length, rank order).
    residual: Vec<f32>,
    /// qgZ error feedback of the second hop: what requantizing this rank's
    /// node-level partial sums dropped last step (N chunks). Used on the
    /// communication thread.
    residual_inter: Arc<Mutex<Vec<f32>>>,
}

impl ShardedUnit {
    /// Error feedback starts over (after a skipped step, or a load that
    /// re-cut the shards).
    fn reset_residuals(&mut self) {
        self.residual.iter_mut().for_each(|r| *r = 0.0);
        if let Ok(mut ri) = self.residual_inter.lock() {
            ri.iter_mut().for_each(|r| *r = 0.0);
        }
    }
}

/// How one unit is cut: its parameters (unpadded), the elements of its
/// padded flat buffer, and of one rank's chunk.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct UnitLayout {
    pub name: String,
    pub numel: usize,
    pub padded: usize,
    pub chunk: usize,
}

/// One unit's primary shard on one rank, as a checkpoint stores it.
#[derive(Clone, Debug, PartialEq)]
pub struct UnitShard {
    pub layout: UnitLayout,
    /// fp32 master weights and AdamW moments of the chunk.
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// qgZ error-feedback residuals (empty without error feedback).
    pub residual: Vec<f32>,
    pub residual_inter: Vec<f32>,
}

/// What one step did.
#[derive(Clone, Debug)]
pub struct StepStats {
    /// Mean loss over all ranks' batches.
    pub loss: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// Bytes this rank sent during the step.
    pub traffic: Traffic,
    /// `Some(units)`: the step saw a non-finite loss or gradient (in these
    /// units) and was skipped (`skip_nonfinite`).
    pub skipped: Option<Vec<String>>,
}

/// Element-wise sum of bf16 buffers, accumulated in f32 and rounded once.
struct SumBf16;

impl Reduce for SumBf16 {
    fn granule(&self) -> usize {
        2
    }

    fn reduce(&self, acc: &mut [u8], mine: &[u8]) -> Result<(), CommError> {
        if acc.len() != mine.len() || !acc.len().is_multiple_of(2) {
            return Err(CommError::Malformed(format!(
                "bf16 sum of {} and {} bytes",
                acc.len(),
                mine.len()
            )));
        }
        for (a, b) in acc.chunks_exact_mut(2).zip(mine.chunks_exact(2)) {
            let x = f32::from_bits((u16::from_le_bytes([a[0], a[1]]) as u32) << 16);
            let y = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            let s: half::bf16 = zeropp_quant::Element::from_f32(x + y);
            a.copy_from_slice(&s.to_bits().to_le_bytes());
        }
        Ok(())
    }
}

/// The groups every rank builds the same way from the layout.
struct Groups {
    world: Arc<Group>,
    node: Arc<Group>,
    cross: Arc<Group>,
    /// The ranks sharing this rank's hpZ secondary shard (the node, or a
    /// run of its local ranks).
    hpz: Arc<Group>,
}

impl Groups {
    fn new(l: &Layout, hpz_group: usize) -> Result<Groups, CommError> {
        let g = l.ranks_per_node;
        let first = l.rank / hpz_group * hpz_group;
        Ok(Groups {
            hpz: Arc::new(Group::new(
                0x2000 + (l.rank / hpz_group) as u16,
                (first..first + hpz_group).collect(),
            )?),
            world: Arc::new(Group::new(0, (0..l.world()).collect())?),
            node: Arc::new(Group::new(
                0x100 + l.node() as u16,
                (l.node() * g..(l.node() + 1) * g).collect(),
            )?),
            cross: Arc::new(Group::new(
                0x4000 + l.local() as u16,
                (0..l.nodes).map(|n| n * g + l.local()).collect(),
            )?),
        })
    }
}

/// One rank's engine.
pub struct Engine {
    cfg: EngineConfig,
    plan: Plan,
    units: Vec<ShardedUnit>,
    counter: Arc<CountingTransport>,
    thread: CommThread,
    groups: Groups,
    device: Device,
    /// Optimizer steps taken.
    step: usize,
    /// Tests: a NaN in the gradient of (step, unit, rank).
    #[cfg(test)]
    pub(crate) inject_nan: Option<(usize, usize, usize)>,
}

fn scale_fraction(plan_weights: WeightWire, chunk: usize) -> f64 {
    match plan_weights {
        WeightWire::Bf16 | WeightWire::F32 => 0.0,
        WeightWire::Quantized(f) => f.param_bytes(chunk) as f64 / f.total_bytes(chunk) as f64,
    }
}

/// Splits the concatenated payloads of a bundle into equal parts.
fn split_bundle(bundle: &Bytes, parts: usize) -> Result<Vec<Bytes>, CommError> {
    if parts == 0 || !bundle.len().is_multiple_of(parts) {
        return Err(CommError::Malformed(format!(
            "a bundle of {} bytes does not split into {parts} chunks",
            bundle.len()
        )));
    }
    let len = bundle.len() / parts;
    Ok((0..parts)
        .map(|i| bundle.slice(i * len..(i + 1) * len))
        .collect())
}

fn concat(parts: &[Bytes]) -> Bytes {
    let mut b = BytesMut::with_capacity(parts.iter().map(Bytes::len).sum());
    for p in parts {
        b.extend_from_slice(p);
    }
    b.freeze()
}

impl Engine {
    /// Builds the engine over `transport` (already connected) for `layout`.
    pub fn new(
        transport: Box<dyn Transport>,
        layout: Layout,
        cfg: EngineConfig,
        timeout: Duration,
    ) -> Result<Engine> {
        cfg.model
            .validate()
            .map_err(|e| anyhow!("invalid model: {e}"))?;
        if transport.world_size() != layout.world() || transport.rank() != layout.rank {
            bail!(
                "the transport is rank {} of {}, the layout says rank {} of {} ({} nodes x {})",
                transport.rank(),
                transport.world_size(),
                layout.rank,
                layout.world(),
                layout.nodes,
                layout.ranks_per_node
            );
        }
        let plan =
            Plan::new(layout, &cfg.switches).map_err(|e| anyhow!("invalid switches: {e}"))?;
        let counter = Arc::new(CountingTransport::new(transport, layout.ranks_per_node));
        let comm = Arc::new(Communicator::new(counter.clone(), timeout));
        let thread = CommThread::new(comm);
        let groups = Groups::new(&layout, plan.hpz_group)?;
        let units = cfg
            .model
            .units()
            .into_iter()
            .enumerate()
            .map(|(i, unit)| {
                let numel = unit.numel(&cfg.model);
                let padded = plan.padded_len(numel);
                let chunk = padded / layout.world();
                let mut full = unit.init(&cfg.model, cfg.seed, i);
                full.resize(padded, 0.0);
                let mine = layout.rank * chunk..(layout.rank + 1) * chunk;
                // Decay matrices, not vectors (biases, norms); padding is inert.
                let mut decay_full = Vec::with_capacity(padded);
                for p in unit.params(&cfg.model) {
                    decay_full.extend(std::iter::repeat_n(p.shape.len() >= 2, p.numel()));
                }
                decay_full.resize(padded, false);
                ShardedUnit {
                    unit,
                    padded,
                    chunk,
                    master: full[mine.clone()].to_vec(),
                    adam: AdamState::new(chunk),
                    decay: decay_full[mine].to_vec(),
                    secondary: None,
                    residual: if cfg.switches.error_feedback {
                        vec![0.0; padded]
                    } else {
                        Vec::new()
                    },
                    residual_inter: Arc::new(Mutex::new(if cfg.switches.error_feedback {
                        vec![0.0; layout.nodes * chunk]
                    } else {
                        Vec::new()
                    })),
                }
            })
            .collect();
        Ok(Engine {
            cfg,
            plan,
            units,
            counter,
            thread,
            groups,
            device: Device::Cpu,
            step: 0,
            #[cfg(test)]
            inject_nan: None,
        })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn traffic(&self) -> Traffic {
        self.counter.traffic()
    }

    pub fn steps_taken(&self) -> usize {
        self.step
    }

    /// Parameters of the model (unpadded).
    pub fn parameter_count(&self) -> usize {
        self.cfg.model.parameter_count()
    }

    /// This rank's chunk of unit `u`, as it goes on the wire.
    fn encode_own_chunk(&self, u: usize) -> Result<Bytes, CommError> {
        let su = &self.units[u];
        match self.plan.weights {
            WeightWire::Bf16 => Ok(payload::encode_bf16(&su.master)),
            WeightWire::F32 => Ok(Bytes::copy_from_slice(bytemuck::cast_slice(&su.master))),
            WeightWire::Quantized(f) => payload::quantize_message(&su.master, f),
        }
    }

    /// Starts gathering unit `u`'s weights from the primary shards: qwZ
    /// across nodes then within the node, or bf16 over the world.
    fn start_primary_gather(
        &self,
        u: usize,
        phase: Phase,
    ) -> Result<Pending<Vec<Bytes>>, CommError> {
        let mine = self.encode_own_chunk(u)?;
        let counter = self.counter.clone();
        let frac = scale_fraction(self.plan.weights, self.units[u].chunk);
        let (world, node, cross) = (
            self.groups.world.clone(),
            self.groups.node.clone(),
            self.groups.cross.clone(),
        );
        let quantized = matches!(self.plan.weights, WeightWire::Quantized(_));
        let (nodes, g) = (self.plan.layout.nodes, self.plan.layout.ranks_per_node);
        Ok(self.thread.submit(move |c: &Communicator| {
            counter.set_phase(phase, frac);
            if !quantized {
                return c.all_gather_v(&world, mine);
            }
            // Across nodes among equal local ranks, then within the node.
            let across = c.all_gather_v(&cross, mine)?; // node order
            let bundles = c.all_gather_v(&node, concat(&across))?; // local order
            let mut by_rank = vec![Bytes::new(); nodes * g];
            for (local, bundle) in bundles.iter().enumerate() {
                for (n, p) in split_bundle(bundle, nodes)?.into_iter().enumerate() {
                    by_rank[n * g + local] = p;
                }
            }
            Ok(by_rank)
        }))
    }

    /// Starts the backward gather of unit `u`: from the hpZ secondary shards
    /// inside the hpZ group, or again from the primaries.
    fn start_backward_gather(&self, u: usize) -> Result<Pending<Vec<Bytes>>, CommError> {
        let Some(secondary) = self.units[u].secondary.clone() else {
            return self.start_primary_gather(u, Phase::BackwardGather);
        };
        let counter = self.counter.clone();
        let frac = scale_fraction(self.plan.weights, self.units[u].chunk);
        let hpz = self.groups.hpz.clone();
        let n = self.secondary_chunks();
        Ok(self.thread.submit(move |c: &Communicator| {
            counter.set_phase(Phase::BackwardGather, frac);
            // Member i of the hpZ group holds the chunks of ranks i·n .. (i+1)·n.
            let bundles = c.all_gather_v(&hpz, concat(&secondary))?;
            let mut by_rank = Vec::with_capacity(bundles.len() * n);
            for bundle in &bundles {
                by_rank.extend(split_bundle(bundle, n)?);
            }
            Ok(by_rank)
        }))
    }

    /// Chunks of each unit one hpZ secondary shard holds: W / the group size.
    fn secondary_chunks(&self) -> usize {
        self.plan.layout.world() / self.plan.hpz_group
    }

    /// Decodes gathered payloads (rank order) into unit `u`'s full weights.
    fn decode_full(&self, u: usize, payloads: &[Bytes]) -> Result<Vec<f32>, CommError> {
        let su = &self.units[u];
        let mut full = vec![0f32; su.padded];
        for (r, p) in payloads.iter().enumerate() {
            let out = &mut full[r * su.chunk..(r + 1) * su.chunk];
            match self.plan.weights {
                WeightWire::Bf16 => payload::decode_bf16(p, out)?,
                WeightWire::F32 => payload::decode_f32(p, out)?,
                WeightWire::Quantized(f) => {
                    let d = payload::decode_quantized(p, f, su.chunk)?;
                    zeropp_quant::dequantize(d.view(), out)
                        .map_err(|e| CommError::Malformed(format!("rank {r}'s chunk: {e}")))?;
                }
            }
        }
        Ok(full)
    }

    /// Starts reduce-scattering unit `u`'s flat gradient; the result is the
    /// mean over all W ranks of this rank's chunk.
    fn start_gradient(&mut self, u: usize, mut grad: Vec<f32>) -> Result<Pending<Vec<f32>>> {
        let layout = self.plan.layout;
        let (world_n, chunk) = (layout.world(), self.units[u].chunk);
        let counter = self.counter.clone();
        let (world, node, cross) = (
            self.groups.world.clone(),
            self.groups.node.clone(),
            self.groups.cross.clone(),
        );
        match self.plan.grads {
            GradWire::RingBf16 => Ok(self.thread.submit(move |c: &Communicator| {
                counter.set_phase(Phase::Gradient, 0.0);
                let bytes = payload::encode_bf16(&grad);
                let bounds: Vec<_> = balanced_bounds(grad.len(), world_n)
                    .into_iter()
                    .map(|r| r.start * 2..r.end * 2)
                    .collect();
                let mine = c.reduce_scatter_bytes(&world, bytes, &bounds, &SumBf16)?;
                let mut out = vec![0f32; chunk];
                payload::decode_bf16(&mine, &mut out)?;
                out.iter_mut().for_each(|v| *v /= world_n as f32);
                Ok(out)
            })),
            GradWire::RingF32 => Ok(self.thread.submit(move |c: &Communicator| {
                counter.set_phase(Phase::Gradient, 0.0);
                let mut out = c.reduce_scatter_f32_vec(&world, grad)?;
                out.iter_mut().for_each(|v| *v /= world_n as f32);
                Ok(out)
            })),
            GradWire::TwoHop {
                intra,
                inter,
                error_feedback,
                stochastic,
            } => {
                let (nodes, g) = (layout.nodes, layout.ranks_per_node);
                // Stochastic rounding, seeded by (seed, step, unit, rank).
                let seed = self.cfg.seed
                    ^ ((self.step as u64) << 32)
                    ^ ((u as u64) << 16)
                    ^ layout.rank as u64;
                let rounding = if stochastic {
                    Rounding::Stochastic { seed }
                } else {
                    Rounding::NearestEven
                };
                let mut q = QuantizedChunks::zeroed(intra, chunk, world_n);
                if error_feedback {
                    let residual = &mut self.units[u].residual;
                    grad.iter_mut()
                        .zip(residual.iter())
                        .for_each(|(g, r)| *g += r);
                }
                quantize_swizzled(&grad, nodes, g, rounding, &mut q).with_context(|| {
                    format!("quantizing the gradient of {}", self.units[u].unit.name())
                })?;
                if error_feedback {
                    // What the wire will carry, back in rank order: keep the rest.
                    let residual = &mut self.units[u].residual;
                    for p in 0..world_n {
                        let r = zeropp_quant::swizzled_rank(p, nodes, g);
                        let sent: Vec<f32> = q.chunk(p).to_vec()?;
                        for (i, s) in sent.iter().enumerate() {
                            residual[r * chunk + i] = grad[r * chunk + i] - s;
                        }
                    }
                }
                let frac = |f: zeropp_quant::QuantFormat| {
                    f.param_bytes(chunk) as f64 / f.total_bytes(chunk) as f64
                };
                let (intra_frac, inter_frac) = (frac(intra), frac(inter));
                let residual_inter = self.units[u].residual_inter.clone();
                Ok(self.thread.submit(move |c: &Communicator| {
                    counter.set_phase(Phase::Gradient, intra_frac);
                    // Hop 1, inside the node: local rank g' gets positions g'·N..(g'+1)·N.
                    let to_local = (0..g)
                        .map(|dst| payload::encode_chunks(&q, dst * nodes..(dst + 1) * nodes))
                        .collect();
                    let from_locals = c.all_to_all_v(&node, to_local)?;
                    let decoded = from_locals
                        .iter()
                        .map(|b| payload::decode_quantized(b, intra, nodes * chunk))
                        .collect::<Result<Vec<_>, _>>()?;
                    let views: Vec<_> = decoded.iter().map(|d| d.view()).collect();
                    let summing = |e: zeropp_quant::QuantError| {
                        CommError::Malformed(format!("summing the node's gradients: {e}"))
                    };
                    let partial = if error_feedback {
                        // Sum in f32, add back what this hop dropped last
                        // step, requantize, and keep what it drops now.
                        let mut residual = residual_inter.lock().map_err(|_| {
                            CommError::Invalid("the error-feedback buffer was poisoned".into())
                        })?;
                        let mut sum = std::mem::take(&mut *residual);
                        for v in &views {
                            zeropp_quant::dequantize_accumulate(*v, &mut sum).map_err(summing)?;
                        }
                        let q = QuantizedTensor::quantize(&sum, inter, rounding.for_part(1))
                            .map_err(summing)?;
                        let sent: Vec<f32> = q.dequantize().map_err(summing)?;
                        sum.iter_mut().zip(&sent).for_each(|(r, s)| *r -= s);
                        *residual = sum;
                        q
                    } else {
                        let mut partial = QuantizedTensor::zeroed(inter, nodes * chunk);
                        sum_requantize(
                            &views,
                            rounding.for_part(1),
                            partial.as_mut(),
                            &mut Vec::new(),
                        )
                        .map_err(summing)?;
                        partial
                    };
                    // Hop 2, across nodes: node n' gets chunk n'.
                    counter.set_phase(Phase::Gradient, inter_frac);
                    let partial = QuantizedChunks {
                        format: inter,
                        chunk_len: chunk,
                        count: nodes,
                        codes: partial.codes,
                        block_max: partial.block_max,
                        block_min: partial.block_min,
                    };
                    let to_nodes = (0..nodes)
                        .map(|n| payload::encode_chunks(&partial, n..n + 1))
                        .collect();
                    let from_nodes = c.all_to_all_v(&cross, to_nodes)?;
                    let mut sum = vec![0f32; chunk];
                    for b in &from_nodes {
                        let d = payload::decode_quantized(b, inter, chunk)?;
                        zeropp_quant::dequantize_accumulate(d.view(), &mut sum)
                            .map_err(|e| CommError::Malformed(e.to_string()))?;
                    }
                    // The mean over every rank of the world, not over nodes.
                    sum.iter_mut().for_each(|v| *v /= world_n as f32);
                    Ok(sum)
                }))
            }
        }
    }

    fn full_params(&self, u: usize, full: &[f32]) -> Result<Vec<Tensor>> {
        Ok(tensors_from_flat(
            &self.units[u].unit,
            &self.cfg.model,
            full,
            &self.device,
        )?)
    }

    /// With a tied head: remembers the embedding's token matrix when unit
    /// `u` is the embedding, and hands it to the head after its own
    /// parameters.
    fn tie(&self, u: usize, params: &mut Vec<Tensor>, tokens: &mut Option<Tensor>) {
        if !self.cfg.model.tied_head {
            return;
        }
        match self.units[u].unit {
            Unit::Embedding => *tokens = params.first().cloned(),
            Unit::Head => params.extend(tokens.clone()),
            Unit::Block(_) => {}
        }
    }

    /// Every rank's `mine`, in rank order (small messages: checkpoint
    /// bookkeeping). Counted as `Other` traffic.
    pub fn all_gather_bytes(&self, mine: Bytes) -> Result<Vec<Bytes>> {
        let world = self.groups.world.clone();
        let counter = self.counter.clone();
        Ok(self
            .thread
            .submit(move |c| {
                counter.set_phase(Phase::Other, 0.0);
                c.all_gather_v(&world, mine)
            })
            .wait()?)
    }

    /// This rank's primary shard of every unit: what a checkpoint holds.
    pub fn shard_state(&self) -> Result<Vec<UnitShard>> {
        self.units
            .iter()
            .zip(self.unit_layouts())
            .map(|(su, layout)| {
                let residual_inter = su
                    .residual_inter
                    .lock()
                    .map_err(|_| anyhow!("the error-feedback buffer was poisoned"))?
                    .clone();
                Ok(UnitShard {
                    layout,
                    master: su.master.clone(),
                    m: su.adam.m.clone(),
                    v: su.adam.v.clone(),
                    residual: su.residual.clone(),
                    residual_inter,
                })
            })
            .collect()
    }

    /// Replaces this rank's primary shards (and error-feedback residuals,
    /// when they fit this plan; otherwise they restart from zero) and the
    /// step counter. The hpZ secondary shards are dropped: they are never
    /// reused across a load.
    pub fn load_shard_state(&mut self, shards: Vec<UnitShard>, step: usize) -> Result<()> {
        if shards.len() != self.units.len() {
            bail!(
                "the checkpoint has {} units, this model {}",
                shards.len(),
                self.units.len()
            );
        }
        for (su, sh) in self.units.iter_mut().zip(shards) {
            let name = su.unit.name();
            if sh.layout.name != name || sh.layout.chunk != su.chunk {
                bail!(
                    "checkpoint unit {:?} ({} values per rank) does not fit unit {name:?} ({} per rank)",
                    sh.layout.name,
                    sh.layout.chunk,
                    su.chunk
                );
            }
            if sh.m.len() != su.chunk || sh.v.len() != su.chunk || sh.master.len() != su.chunk {
                bail!("checkpoint unit {name:?}: state of the wrong length");
            }
            su.master = sh.master;
            su.adam.m = sh.m;
            su.adam.v = sh.v;
            su.secondary = None;
            let fits = sh.residual.len() == su.residual.len()
                && su
                    .residual_inter
                    .lock()
                    .is_ok_and(|ri| ri.len() == sh.residual_inter.len());
            if fits {
                su.residual = sh.residual;
                if let Ok(mut ri) = su.residual_inter.lock() {
                    *ri = sh.residual_inter;
                }
            } else {
                su.reset_residuals();
            }
        }
        self.step = step;
        Ok(())
    }

    /// How every unit is cut, in unit order.
    pub fn unit_layouts(&self) -> Vec<UnitLayout> {
        self.units
            .iter()
            .map(|su| UnitLayout {
                name: su.unit.name(),
                numel: su.unit.numel(&self.cfg.model),
                padded: su.padded,
                chunk: su.chunk,
            })
            .collect()
    }

    /// Element-wise sum of `values` over all ranks (small vectors: metrics).
    pub fn sum_over_ranks(&self, values: &[f32]) -> Result<Vec<f32>> {
        let world = self.groups.world.clone();
        let counter = self.counter.clone();
        let v = values.to_vec();
        Ok(self
            .thread
            .submit(move |c| {
                counter.set_phase(Phase::Other, 0.0);
                c.all_reduce_f32(&world, &v)
            })
            .wait()?)
    }

    /// Forward only (no state change): the mean loss over all ranks of the
    /// given batches. Counted as `Other` traffic.
    pub fn evaluate(&mut self, inputs: &Tensor, targets: &Tensor) -> Result<f32> {
        let n = self.units.len();
        let mut x = inputs.clone();
        let mut tied_tokens = None;
        for u in 0..n {
            let payloads = self.start_primary_gather(u, Phase::Other)?.wait()?;
            let full = self.decode_full(u, &payloads)?;
            let mut params = self.full_params(u, &full)?;
            self.tie(u, &mut params, &mut tied_tokens);
            x = self.units[u].unit.forward(&self.cfg.model, &params, &x)?;
        }
        let l = loss(&x, targets)?.to_scalar::<f32>()?;
        let world = self.groups.world.clone();
        let counter = self.counter.clone();
        let w = self.plan.layout.world() as f32;
        let sum = self.thread.submit(move |c| {
            counter.set_phase(Phase::Other, 0.0);
            c.all_reduce_f32(&world, &[l])
        });
        Ok(sum.wait()?[0] / w)
    }

    /// One training step on this rank's batch: forward, backward, gradient
    /// reduce-scatter, global norm, clipping, AdamW at `lr`.
    pub fn train_step(&mut self, inputs: &Tensor, targets: &Tensor, lr: f32) -> Result<StepStats> {
        let before = self.traffic();
        let n = self.units.len();
        let g = self.plan.layout.local();

        // Forward, keeping each unit's input (and, for a tied head, the
        // embedding's token matrix until the head's backward).
        let mut tied_tokens: Option<Tensor> = None;
        let mut saved = Vec::with_capacity(n);
        let mut x = inputs.clone();
        let mut pending = Some(self.start_primary_gather(0, Phase::ForwardGather)?);
        for u in 0..n {
            let payloads = pending.take().expect("started").wait()?;
            if u + 1 < n {
                pending = Some(self.start_primary_gather(u + 1, Phase::ForwardGather)?);
            }
            if self.plan.hpz {
                // Copies: the gathered buffers themselves are freed below.
                let (k, member) = (self.secondary_chunks(), g % self.plan.hpz_group);
                let part = &payloads[member * k..(member + 1) * k];
                self.units[u].secondary =
                    Some(part.iter().map(|p| Bytes::copy_from_slice(p)).collect());
            }
            let full = self.decode_full(u, &payloads)?;
            let mut params = self.full_params(u, &full)?;
            self.tie(u, &mut params, &mut tied_tokens);
            saved.push(x.clone());
            x = self.units[u].unit.forward(&self.cfg.model, &params, &x)?;
        }

        // Backward, recomputing each unit from its saved input.
        let mut upstream: Option<Tensor> = None;
        let mut grads_pending: Vec<(usize, Pending<Vec<f32>>)> = Vec::with_capacity(n);
        let mut pending = Some(self.start_backward_gather(n - 1)?);
        let mut step_loss = f32::NAN;
        let mut tied_grad: Option<Vec<f32>> = None;
        let mut local_nonfinite = vec![false; n];
        for u in (0..n).rev() {
            let payloads = pending.take().expect("started").wait()?;
            if u > 0 {
                pending = Some(self.start_backward_gather(u - 1)?);
            }
            let full = self.decode_full(u, &payloads)?;
            let vars = self
                .full_params(u, &full)?
                .into_iter()
                .map(|t| Var::from_tensor(&t))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let mut tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            // A tied head differentiates the embedding's token matrix too;
            // that gradient joins the embedding's own in its backward.
            let tied_var = match (&tied_tokens, self.units[u].unit) {
                (Some(t), Unit::Head) => Some(Var::from_tensor(t)?),
                _ => None,
            };
            if let Some(tv) = &tied_var {
                tensors.push(tv.as_tensor().clone());
            }
            let input_var = if u > 0 {
                Some(Var::from_tensor(&saved[u])?)
            } else {
                None
            };
            let input = input_var
                .as_ref()
                .map(|v| v.as_tensor().clone())
                .unwrap_or_else(|| saved[u].clone());
            let out = self.units[u]
                .unit
                .forward(&self.cfg.model, &tensors, &input)?;
            let objective = match &upstream {
                None => {
                    let l = loss(&out, targets)?;
                    step_loss = l.to_scalar::<f32>()?;
                    l
                }
                Some(up) => (out * up)?.sum_all()?,
            };
            let grads = objective.backward()?;
            let mut flat = Vec::with_capacity(self.units[u].padded);
            for v in &vars {
                match grads.get(v.as_tensor()) {
                    Some(gt) => flat.extend(gt.flatten_all()?.to_vec1::<f32>()?),
                    None => flat.extend(std::iter::repeat_n(0.0, v.as_tensor().elem_count())),
                }
            }
            flat.resize(self.units[u].padded, 0.0);
            if let Some(gt) = tied_var.as_ref().and_then(|tv| grads.get(tv.as_tensor())) {
                tied_grad = Some(gt.flatten_all()?.to_vec1::<f32>()?);
            }
            if self.units[u].unit == Unit::Embedding
                && let Some(tg) = tied_grad.take()
            {
                flat.iter_mut().zip(&tg).for_each(|(f, t)| *f += t);
            }
            upstream = match &input_var {
                Some(iv) => Some(grads.get(iv.as_tensor()).cloned().ok_or_else(|| {
                    anyhow!(
                        "no gradient reached the input of {}",
                        self.units[u].unit.name()
                    )
                })?),
                None => None,
            };
            // A NaN/Inf must not reach the quantizers or the sums: this
            // rank sends zeros instead and raises the unit's flag in the
            // step's all-reduce, so every rank stops (or skips) together.
            if flat.iter().any(|v| !v.is_finite()) {
                flat.iter_mut().for_each(|v| *v = 0.0);
                local_nonfinite[u] = true;
            }
            grads_pending.push((u, self.start_gradient(u, flat)?));
        }
        let mut chunk_grads: Vec<Vec<f32>> = vec![Vec::new(); n];
        for (u, p) in grads_pending {
            chunk_grads[u] = p.wait().with_context(|| {
                format!(
                    "reduce-scattering the gradient of {}",
                    self.units[u].unit.name()
                )
            })?;
        }

        // Global norm, mean loss and one non-finite flag per unit in one
        // all-reduce: a NaN or Inf anywhere is seen by every rank on the
        // step it appears, with the units it is in.
        #[cfg(test)]
        if let Some((step, unit, rank)) = self.inject_nan
            && step == self.step + 1
        {
            self.inject_nan = None;
            if rank == self.plan.layout.rank {
                chunk_grads[unit][0] = f32::NAN;
            }
        }
        // One pass: the squared norm in rank-chunk order, and each chunk's
        // own sum of squares, non-finite exactly when the chunk holds a NaN
        // or Inf (or overflows).
        let mut total = 0f32;
        let unit_sumsq: Vec<f32> = chunk_grads
            .iter()
            .map(|gr| {
                let mut unit = 0f32;
                for v in gr {
                    total += v * v;
                    unit += v * v;
                }
                unit
            })
            .collect();
        let mut local: Vec<f32> = Vec::with_capacity(2 + n);
        local.push(total);
        local.push(step_loss);
        local.extend(
            unit_sumsq
                .iter()
                .zip(&local_nonfinite)
                .map(|(sq, &bad)| f32::from(bad || !sq.is_finite())),
        );
        let world = self.groups.world.clone();
        let counter = self.counter.clone();
        let reduced = self
            .thread
            .submit(move |c| {
                counter.set_phase(Phase::Other, 0.0);
                c.all_reduce_f32(&world, &local)
            })
            .wait()?;
        let w = self.plan.layout.world() as f32;
        let (grad_norm, mean_loss) = (reduced[0].sqrt(), reduced[1] / w);
        let bad: Vec<String> = (0..n)
            .filter(|&u| reduced[2 + u] != 0.0)
            .map(|u| self.units[u].unit.name())
            .collect();
        if !grad_norm.is_finite() || !mean_loss.is_finite() || !bad.is_empty() {
            if !self.cfg.optim.skip_nonfinite {
                bail!(
                    "step {}: non-finite loss ({mean_loss}) or gradient (norm {grad_norm}; units {bad:?}) \
                     — lower the learning rate or check the data; --skip-nonfinite true skips such steps",
                    self.step + 1
                );
            }
            // Skip: no update; residuals that may hold the NaN restart from
            // zero; the gathered weights are dropped as after any step.
            for su in &mut self.units {
                su.reset_residuals();
                su.secondary = None;
            }
            return Ok(StepStats {
                loss: mean_loss,
                grad_norm,
                traffic: self.traffic().since(&before),
                skipped: Some(bad),
            });
        }
        let clip = if self.cfg.optim.max_grad_norm > 0.0 && grad_norm > self.cfg.optim.max_grad_norm
        {
            self.cfg.optim.max_grad_norm / (grad_norm + 1e-6)
        } else {
            1.0
        };
        self.step += 1;
        for (su, mut gr) in self.units.iter_mut().zip(chunk_grads) {
            gr.iter_mut().for_each(|v| *v *= clip);
            su.adam.update(
                &self.cfg.optim,
                lr,
                self.step,
                &mut su.master,
                &gr,
                &su.decay,
            );
            // The gathered weights are stale now.
            su.secondary = None;
        }
        Ok(StepStats {
            loss: mean_loss,
            grad_norm,
            traffic: self.traffic().since(&before),
            skipped: None,
        })
    }
}

#[cfg(test)]
mod tests;
