//! The sharding engine: ZeRO-3 with the ZeRO++ switches (docs/ARCHITECTURE.md,
//! the life of a training step). Each rank owns one chunk of every unit's
//! flat parameter buffer (fp32 master + AdamW state); weights are gathered
//! unit by unit (the next unit's gather runs on the communication thread
//! while this one computes), activations are kept only at unit boundaries
//! and recomputed in backward, and each unit's gradient is reduce-scattered
//! back to the chunk owners.

mod error;
mod island_run;
mod islands;
pub mod model;
pub mod optim;
mod step;
pub mod testing;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use candle_core::{Device, Tensor};
use zeropp_quant::Rounding;

pub use error::{EngineError, IslandsError, Result};
use island_run::IslandRun;
pub use island_run::{AUTO_SYNC_SHARE, IslandConfig, LostIsland};
use model::tensors_from_owned;
pub use model::{InvalidModel, Model, Tie};
use optim::{AdamState, OptimConfig};
use zeropp_comm::collectives::{CommThread, Pending};
use zeropp_comm::{CommError, Communicator, Group, Transport};
use zeropp_zero::fsdp::{self, GradWire, WeightWire};
use zeropp_zero::host::{Host, HostMover};
use zeropp_zero::job::Joined;
use zeropp_zero::layout::Layout;
use zeropp_zero::outer::OuterState;
use zeropp_zero::plan::{Plan, PlanError, Switches};
use zeropp_zero::qgz::Reduction;
use zeropp_zero::residual::Residual;
use zeropp_zero::traffic::{CountingTransport, Phase, Traffic};
use zeropp_zero::{Hop, ZeroError, ZeroGroups, delta, hpz, qgz, scratch};

/// Everything that defines a run's numerics.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// What is sharded: the built-in GPT (`train::model::ModelConfig`) or
    /// any other [`Model`].
    pub model: Arc<dyn Model>,
    pub switches: Switches,
    pub optim: OptimConfig,
    pub seed: u64,
    /// Islands: the job cut into islands that each shard the model over
    /// their own ranks, synced by an outer step every few steps. `None`:
    /// one island, the whole job.
    pub islands: Option<IslandConfig>,
}

/// Gradients of units whose reduce-scatter may be under way at once while
/// the backward pass goes on (each is a whole unit's f32 gradient).
const MAX_GRADS_IN_FLIGHT: usize = 2;

/// One unit's state on this rank.
struct ShardedUnit {
    /// The model's name of the unit.
    name: String,
    /// Values of the unit's parameters (unpadded).
    numel: usize,
    /// Elements of the padded flat buffer, and of each rank's chunk.
    padded: usize,
    chunk: usize,
    /// fp32 master weights of this rank's chunk (shared with the gathers
    /// under way; the optimizer step has them to itself).
    master: Arc<Vec<f32>>,
    adam: AdamState,
    /// Whether weight decay applies to each element of the chunk.
    decay: Vec<bool>,
    /// hpZ: chunks `i·k .. (i+1)·k` of the gathered weights as they
    /// travelled (i: this rank's place in its hpZ group of h, k = W / h;
    /// for the node, i = local rank and k = N), valid from this step's
    /// forward until its optimizer step.
    secondary: Option<Secondary>,
    /// qgZ error feedback: what the first quantization dropped last step
    /// (W chunks, rank order; compressed, see `zero::residual`).
    residual: Residual,
    /// qgZ error feedback of the second hop: what requantizing this rank's
    /// node-level partial sums dropped last step (N chunks). Used on the
    /// communication thread.
    residual_inter: Arc<Mutex<Residual>>,
    /// qwZ on weight differences: this rank's references of its cross
    /// group's shards (`zero::delta`); `None` until the first gather and
    /// after a load. Used on the communication thread.
    reference: Arc<Mutex<Option<delta::ReferenceOf<Host>>>>,
}

impl ShardedUnit {
    /// Unit `i` of the model, initialized from `cfg.seed`, this rank's
    /// shard of it (padded for `plan`'s blocks) with its optimizer state
    /// and, where `plan` keeps error feedback, its residuals.
    fn new(
        cfg: &EngineConfig,
        plan: &Plan,
        layout: Layout,
        i: usize,
        first_hop_feedback: bool,
    ) -> ShardedUnit {
        let model = &cfg.model;
        let numel = model.unit_numel(i);
        let padded = plan.padded_len(numel);
        let chunk = padded / layout.world();
        let mut full = model.init(i, cfg.seed);
        full.resize(padded, 0.0);
        let mine = layout.rank * chunk..(layout.rank + 1) * chunk;
        // Decay matrices, not vectors (biases, norms); padding is inert.
        let mut decay_full = Vec::with_capacity(padded);
        for shape in model.param_shapes(i) {
            let len = shape.iter().product();
            decay_full.extend(std::iter::repeat_n(shape.len() >= 2, len));
        }
        decay_full.resize(padded, false);
        ShardedUnit {
            name: model.unit_name(i),
            numel,
            padded,
            chunk,
            master: Arc::new(full[mine.clone()].to_vec()),
            adam: AdamState::new(chunk),
            decay: decay_full[mine].to_vec(),
            secondary: None,
            residual: if first_hop_feedback {
                Residual::zeros(chunk, layout.world())
            } else {
                Residual::none()
            },
            residual_inter: Arc::new(Mutex::new(if cfg.switches.error_feedback {
                Residual::zeros(chunk, layout.nodes)
            } else {
                Residual::none()
            })),
            reference: Arc::new(Mutex::new(None)),
        }
    }
}

impl ShardedUnit {
    /// The weights jumped (an outer step wrote them): the hpZ secondary
    /// shard is stale and the qwZ references refresh at the next forward
    /// gather.
    fn weights_jumped(&mut self) {
        self.secondary = None;
        if let Ok(mut r) = self.reference.lock() {
            *r = None;
        }
    }
}

/// A unit's weights as a gather delivered them: the full padded weights,
/// and hpZ's secondary shard of them where a forward gather keeps one.
struct Gathered {
    full: Vec<f32>,
    secondary: Option<Secondary>,
}

/// hpZ's secondary shard of a unit (`hpz::Secondary`), shared with the
/// backward gather under way.
type Secondary = Arc<hpz::Secondary<Host>>;

/// Lets go of a secondary shard: its buffers are reused once no gather
/// holds them.
fn recycle(secondary: Secondary) {
    if let Ok(s) = Arc::try_unwrap(secondary) {
        s.recycle(&Host);
    }
}

impl ShardedUnit {
    /// Error feedback starts over (after a skipped step, or a load that
    /// re-cut the shards).
    fn reset_residuals(&mut self) {
        self.residual.reset();
        if let Ok(mut ri) = self.residual_inter.lock() {
            ri.reset();
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
    pub residual: Residual,
    pub residual_inter: Residual,
    /// qwZ on weight differences: this rank's part of its reference (none
    /// before the first gather, without `qwz_delta`, or re-cut).
    pub reference: Option<delta::SavedReference>,
    /// Islands: the shard's outer state (none without islands).
    pub outer: Option<OuterState>,
}

/// Bytes one rank keeps between steps for ZeRO++ (`Engine::kept_bytes`).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KeptBytes {
    /// qwZ on weight differences: the references of the cross group's
    /// shards (1/G of the model; bf16 behind a bf16 hop inside the node,
    /// else f32). With hpZ over the node they are its secondary shard too.
    pub qwz_references: u64,
    /// hpZ's secondary shards, held from each forward gather to the
    /// optimizer step (1/H of the model in the form the weights travelled);
    /// 0 where qwZ's references are the secondary shard.
    #[serde(default)]
    pub hpz_secondary: u64,
    /// qgZ's error feedback (compressed).
    pub qgz_residuals: u64,
    /// Islands: the outer state (anchor, outer momentum, the exchange's
    /// error feedback) of this rank's shard.
    #[serde(default)]
    pub outer_state: u64,
    /// Free buffers the collectives' pools hold for the next call
    /// (`zeropp_comm::scratch`; the process's, so shared by the ranks of an
    /// in-process job).
    #[serde(default)]
    pub scratch: u64,
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
    /// Seconds the step's compute thread waited on communication (gathers,
    /// gradients, the norm's all-reduce): the rest of the step is its own
    /// work (compute, and quantization on that thread).
    pub waited_s: f64,
}

/// One rank's engine.
pub struct Engine {
    cfg: EngineConfig,
    /// How this rank's island is cut (the whole job without islands).
    plan: Plan,
    units: Vec<ShardedUnit>,
    counter: Arc<CountingTransport>,
    /// The job's communication thread.
    thread: Arc<CommThread>,
    /// The groups of this rank's island.
    groups: ZeroGroups,
    /// The whole job: its layout and its world group (metrics, checkpoints).
    job: Layout,
    job_world: Arc<Group>,
    islands: Option<IslandRun>,
    device: Device,
    /// Optimizer steps taken.
    step: usize,
    /// How long a network wait may take.
    timeout: Duration,
    /// Tests: a NaN in the gradient of (step, unit, rank).
    #[cfg(test)]
    pub(crate) inject_nan: Option<(usize, usize, usize)>,
}

impl Engine {
    /// Builds the engine over `transport` (already connected) for `layout`:
    /// a job whose ranks published nothing ([`Joined::unpublished`]).
    pub fn new(
        transport: Box<dyn Transport>,
        layout: Layout,
        cfg: EngineConfig,
        timeout: Duration,
    ) -> Result<Engine> {
        Self::joined(&Joined::unpublished(transport, layout, timeout)?, cfg)
    }

    /// The engine of `job` (joined; the trainer's, whose probe's traffic
    /// stays in the run's totals): its counted transport, its
    /// communication thread, its layout and deadline.
    pub fn joined(joined: &Joined, cfg: EngineConfig) -> Result<Engine> {
        let (counter, layout, timeout) = (joined.counter.clone(), joined.layout, joined.timeout);
        let transport = &counter;
        cfg.model.validate()?;
        scratch::budget_from_env()?;
        if transport.world_size() != layout.world() || transport.rank() != layout.rank {
            return Err(EngineError::Layout {
                transport_rank: transport.rank(),
                transport_world: transport.world_size(),
                rank: layout.rank,
                world: layout.world(),
                nodes: layout.nodes,
                ranks_per_node: layout.ranks_per_node,
            });
        }
        let job = layout;
        let count = cfg.islands.map_or(1, |i| i.count);
        let (island, layout) = job.island(count).map_err(PlanError::from)?;
        let plan = Plan::new(layout, &cfg.switches)?;
        let (comm, thread) = (Arc::new(joined.communicator()), joined.thread.clone());
        let (_, groups, across) = ZeroGroups::island(&job, count, plan.hpz_group)?;
        let job_world = if count == 1 {
            groups.world.clone()
        } else {
            Arc::new(Group::new(
                zeropp_comm::GroupKind::World,
                (0..job.world()).collect(),
            )?)
        };
        // A node of one rank sends nothing inside it: no first hop to keep
        // feedback for (`GradWire::keeps`).
        let first_hop_feedback = plan.grads.keeps(layout.ranks_per_node).0;
        let units = (0..cfg.model.unit_count())
            .map(|i| ShardedUnit::new(&cfg, &plan, layout, i, first_hop_feedback))
            .collect::<Vec<_>>();
        let islands = match cfg.islands {
            Some(c) if c.count > 1 => {
                c.check()?;
                // Another island's death takes it out of the outer sync;
                // only this island's breaks this rank's collectives.
                let first = island * layout.world();
                counter.contain_deaths(first..first + layout.world());
                let masters: Vec<&[f32]> = units.iter().map(|u| &u.master[..]).collect();
                Some(IslandRun::new(
                    c,
                    (island, layout.rank, layout.world()),
                    across,
                    comm,
                    &masters,
                ))
            }
            _ => None,
        };
        Ok(Engine {
            cfg,
            plan,
            units,
            counter,
            thread,
            groups,
            job,
            job_world,
            islands,
            device: Device::Cpu,
            step: 0,
            timeout,
            #[cfg(test)]
            inject_nan: None,
        })
    }

    /// How this rank's island is cut and wired (the whole job without
    /// islands).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The whole job's layout (this rank's global place).
    pub fn job_layout(&self) -> Layout {
        self.job
    }

    /// The islands' settings and this rank's island, when the job has
    /// more than one.
    pub fn islands(&self) -> Option<(IslandConfig, usize)> {
        self.islands.as_ref().map(|r| (r.cfg, r.island))
    }

    /// Islands that left the outer sync, as this rank knows it (empty
    /// without islands).
    pub fn lost_islands(&self) -> Vec<LostIsland> {
        self.islands
            .as_ref()
            .map_or_else(Vec::new, |r| island_run::lock(&r.members).lost.clone())
    }

    /// Islands that rejoined the outer sync (restarted after a loss), with
    /// the step after which they trained with the others again.
    pub fn rejoined_islands(&self) -> Vec<(usize, u64)> {
        self.islands
            .as_ref()
            .map_or_else(Vec::new, |r| island_run::lock(&r.members).rejoined.clone())
    }

    /// The switches this engine runs with (resolved: hpZ group and qgZ bits
    /// as the trainer decided them).
    pub fn switches(&self) -> &Switches {
        &self.cfg.switches
    }

    pub fn traffic(&self) -> Traffic {
        self.counter.traffic()
    }

    pub fn steps_taken(&self) -> usize {
        self.step
    }

    /// What this rank keeps between steps besides its primary shards and
    /// optimizer state: the qwZ references (`zero::delta`) and the qgZ
    /// error-feedback residuals, in bytes.
    pub fn kept_bytes(&self) -> KeptBytes {
        let mut k = KeptBytes::default();
        for su in &self.units {
            if let Ok(r) = su.reference.lock() {
                k.qwz_references += r.as_ref().map_or(0, |r| r.bytes() as u64);
            }
            k.qgz_residuals += su.residual.bytes() as u64;
            if let Ok(r) = su.residual_inter.lock() {
                k.qgz_residuals += r.bytes() as u64;
            }
        }
        if let Some(run) = &self.islands {
            k.outer_state = run.outer_bytes() as u64;
        }
        k.hpz_secondary = self.secondary_bytes();
        k.scratch = scratch::held_bytes();
        k
    }

    /// Bytes of the hpZ secondary shards one step holds (a run of W/H
    /// chunks of every unit, as they travelled).
    fn secondary_bytes(&self) -> u64 {
        let plan = &self.plan;
        let chunk_bytes = |chunk: usize| match plan.weights {
            _ if !plan.hpz => 0,
            WeightWire::Delta(d) if d.hpz => 0,
            WeightWire::Quantized(f) => f.total_bytes(chunk),
            w if w.fp32() => chunk * 4,
            _ => chunk * 2,
        };
        let k = hpz::secondary_chunks(plan.layout.world(), plan.hpz_group);
        self.units
            .iter()
            .map(|su| (k * chunk_bytes(su.chunk)) as u64)
            .sum()
    }

    /// Parameters of the model (unpadded).
    pub fn parameter_count(&self) -> usize {
        self.cfg.model.parameter_count()
    }

    /// The hpZ group whose secondary shard a gather under `phase` keeps:
    /// the forward gather's with hpZ on, unless qwZ's references of weight
    /// differences are that shard (`DeltaWire::hpz`: the backward gather is
    /// served from them).
    fn keeps_secondary(&self, phase: Phase) -> Option<usize> {
        let served = matches!(self.plan.weights, WeightWire::Delta(d) if d.hpz);
        (phase == Phase::ForwardGather && self.plan.hpz && !served).then_some(self.plan.hpz_group)
    }

    /// Starts gathering unit `u`'s weights from the primary shards (qwZ
    /// across nodes then within the node, weight differences, or bf16 / f32
    /// over the world: FSDP2's gather, `fsdp::all_gather_prepared`), decoded into its
    /// full weights on the communication thread, with hpZ's secondary shard
    /// where `phase` keeps one.
    fn start_primary_gather(
        &self,
        u: usize,
        phase: Phase,
    ) -> Result<Pending<Gathered, ZeroError>, ZeroError> {
        let (layout, wire) = (self.plan.layout, self.plan.weights);
        let (counter, groups) = (self.counter.clone(), self.groups.clone());
        let su = &self.units[u];
        let (mine, padded, chunk) = (su.master.clone(), su.padded, su.chunk);
        let reference = su.reference.clone();
        let keep = self.keeps_secondary(phase);
        // qwZ quantizes the shard here, while the communication thread
        // gathers the last unit.
        let prepared = fsdp::prepare_gather(&Host, wire, &mine.as_slice())?;
        Ok(self.thread.submit(move |c: &Communicator| {
            let m = HostMover {
                comm: c,
                counter: &counter,
                groups,
            };
            let mut reference = match wire {
                WeightWire::Delta(_) => Some(
                    reference
                        .lock()
                        .map_err(|_| ZeroError::Poisoned("qwZ reference"))?,
                ),
                _ => None,
            };
            let slot = reference.as_deref_mut().map(delta::Slot::new);
            let mut full = vec![0f32; padded];
            let (ready, out) = ((prepared, &mine.as_slice()), &mut full.as_mut_slice());
            let hop = (Hop::World, phase);
            let secondary =
                fsdp::all_gather_prepared(&Host, &m, layout, hop, wire, slot, ready, keep, out)?;
            // hpZ keeps qwZ's chunks as they came, or its run of the values.
            let secondary = match (secondary, keep) {
                (Some(quantized), _) => Some(quantized),
                (None, Some(h)) => {
                    let fp32 = wire.fp32();
                    Some(hpz::Secondary::of_values(
                        &Host,
                        layout,
                        h,
                        (&full, chunk),
                        fp32,
                    )?)
                }
                (None, None) => None,
            };
            let secondary = secondary.map(Arc::new);
            Ok(Gathered { full, secondary })
        }))
    }

    /// Starts the backward gather of unit `u`: from the hpZ secondary shards
    /// inside the hpZ group, or again from the primaries.
    fn start_backward_gather(&self, u: usize) -> Result<Pending<Gathered, ZeroError>, ZeroError> {
        let Some(secondary) = self.units[u].secondary.clone() else {
            return self.start_primary_gather(u, Phase::BackwardGather);
        };
        let (counter, groups) = (self.counter.clone(), self.groups.clone());
        let (padded, fp32) = (self.units[u].padded, self.plan.weights.fp32());
        Ok(self.thread.submit(move |c: &Communicator| {
            let m = HostMover {
                comm: c,
                counter: &counter,
                groups,
            };
            let mut full = vec![0f32; padded];
            hpz::all_gather_secondary(&Host, &m, &secondary, fp32, &mut full.as_mut_slice())?;
            Ok(Gathered {
                full,
                secondary: None,
            })
        }))
    }

    /// Starts reduce-scattering unit `u`'s flat gradient (FSDP2's
    /// reduce-scatter of a gradient the call takes,
    /// `fsdp::reduce_scatter_prepared`); the result is the mean over all W
    /// ranks of this rank's chunk.
    fn start_gradient(&mut self, u: usize, grad: Vec<f32>) -> Result<Pending<Vec<f32>, ZeroError>> {
        let (layout, wire) = (self.plan.layout, self.plan.grads);
        let (counter, groups) = (self.counter.clone(), self.groups.clone());
        let rounding = match wire {
            GradWire::TwoHop { stochastic, .. } => {
                let (call, seed) = (self.step as u64, self.cfg.seed);
                qgz::rounding(stochastic, seed, call, u, layout.rank)
            }
            GradWire::RingBf16 | GradWire::RingF32 => Rounding::NearestEven,
        };
        let (first_feedback, error_feedback) = wire.keeps(layout.ranks_per_node);
        let su = &mut self.units[u];
        // qgZ quantizes its hop inside the node here, while the
        // communication thread sends the last unit's; the gradient is
        // taken, its error feedback added in place.
        let first = first_feedback.then_some(su.residual.chunks_mut());
        let grad = fsdp::prepare_gradient(&Host, layout, wire, (rounding, first), grad).map_err(
            |source| EngineError::Unit {
                what: "preparing the gradient",
                unit: su.name.clone(),
                source,
            },
        )?;
        let residual_inter = su.residual_inter.clone();
        Ok(self.thread.submit(move |c: &Communicator| {
            let mut residual_inter = residual_inter
                .lock()
                .map_err(|_| ZeroError::Poisoned("error-feedback buffer"))?;
            let m = HostMover {
                comm: c,
                counter: &counter,
                groups,
            };
            let second = error_feedback.then_some(residual_inter.chunks_mut());
            let (how, mean) = ((rounding, second), Reduction::Mean);
            fsdp::reduce_scatter_prepared(&Host, &m, layout, wire, how, mean, grad)
        }))
    }

    /// Waits for unit `u`'s gradient reduce-scatter: this rank's chunk of
    /// the mean.
    fn finish_gradient(&self, u: usize, p: Pending<Vec<f32>, ZeroError>) -> Result<Vec<f32>> {
        p.wait().map_err(|source| EngineError::Unit {
            what: "reduce-scattering the gradient",
            unit: self.units[u].name.clone(),
            source,
        })
    }

    fn full_params(&self, u: usize, full: Vec<f32>) -> Result<Vec<Tensor>> {
        Ok(tensors_from_owned(&*self.cfg.model, u, full, &self.device)?)
    }

    /// Every rank's `mine` (small messages: checkpoint bookkeeping),
    /// with the ranks they came from, in rank order: the job's, or with
    /// islands those of the islands still taking part. Counted as `Other`
    /// traffic.
    pub fn all_gather_bytes(&self, mine: Bytes) -> Result<(Vec<usize>, Vec<Bytes>)> {
        self.on_job(|world| {
            let (counter, mine) = (self.counter.clone(), mine.clone());
            let ranks = world.ranks().to_vec();
            self.thread
                .submit(move |c| {
                    counter.set_phase(Phase::Other, 0.0);
                    c.all_gather_v(&world, mine)
                })
                .wait()
                .map(|parts| (ranks, parts))
        })
    }

    /// This rank's primary shard of every unit: what a checkpoint holds.
    pub fn shard_state(&self) -> Result<Vec<UnitShard>> {
        self.units
            .iter()
            .zip(self.unit_layouts())
            .enumerate()
            .map(|(u, (su, layout))| {
                let residual_inter = su
                    .residual_inter
                    .lock()
                    .map_err(|_| ZeroError::Poisoned("error-feedback buffer"))?
                    .clone();
                let reference = su
                    .reference
                    .lock()
                    .map_err(|_| ZeroError::Poisoned("qwZ reference"))?
                    .as_ref()
                    .map(|r| r.saved(self.plan.layout))
                    .transpose()?;
                Ok(UnitShard {
                    layout,
                    master: su.master.to_vec(),
                    m: su.adam.m.clone(),
                    v: su.adam.v.clone(),
                    residual: su.residual.clone(),
                    residual_inter,
                    reference,
                    outer: self.islands.as_ref().map(|r| r.saved(u)).transpose()?,
                })
            })
            .collect()
    }

    /// Replaces this rank's primary shards (and error-feedback residuals,
    /// when they fit this plan; otherwise they restart from zero) and the
    /// step counter. The hpZ secondary shards are dropped: they are never
    /// reused across a load. With qwZ on weight differences, the members of
    /// each cross group exchange their saved parts and rebuild their
    /// references (a collective: every rank loads); where a part is missing
    /// the references restart with a refresh.
    pub fn load_shard_state(&mut self, mut shards: Vec<UnitShard>, step: usize) -> Result<()> {
        let saved: Vec<_> = shards.iter_mut().map(|s| s.reference.take()).collect();
        let outers: Vec<_> = shards.iter_mut().map(|s| s.outer.take()).collect();
        if shards.len() != self.units.len() {
            return Err(EngineError::Checkpoint(format!(
                "the checkpoint has {} units, this model {}",
                shards.len(),
                self.units.len()
            )));
        }
        for (su, sh) in self.units.iter_mut().zip(shards) {
            let name = su.name.clone();
            if sh.layout.name != name || sh.layout.chunk != su.chunk {
                return Err(EngineError::Checkpoint(format!(
                    "checkpoint unit {:?} ({} values per rank) does not fit unit {name:?} ({} per rank)",
                    sh.layout.name, sh.layout.chunk, su.chunk
                )));
            }
            if sh.m.len() != su.chunk || sh.v.len() != su.chunk || sh.master.len() != su.chunk {
                return Err(EngineError::Checkpoint(format!(
                    "checkpoint unit {name:?}: state of the wrong length"
                )));
            }
            su.master = Arc::new(sh.master);
            su.adam.m = sh.m;
            su.adam.v = sh.v;
            su.secondary = None;
            // A unit that keeps no first-hop residual (nodes of one rank,
            // or no int4 first hop) drops a saved one and keeps the hop
            // across's.
            let keeps_first = !su.residual.is_empty();
            let fits = (!keeps_first || sh.residual.shape() == su.residual.shape())
                && su
                    .residual_inter
                    .lock()
                    .is_ok_and(|ri| ri.shape() == sh.residual_inter.shape());
            if fits {
                if keeps_first {
                    su.residual = sh.residual;
                }
                if let Ok(mut ri) = su.residual_inter.lock() {
                    *ri = sh.residual_inter;
                }
            } else {
                su.reset_residuals();
            }
        }
        if let Some(run) = self.islands.as_mut() {
            // The saved outer state where it is this shard's; a checkpoint
            // without one starts the islands from the weights it holds.
            run.restore(
                self.units
                    .iter()
                    .zip(outers)
                    .map(|(su, o)| match o {
                        Some(o) if o.anchor.len() == su.chunk && o.momentum.len() == su.chunk => o,
                        _ => OuterState::new(&su.master),
                    })
                    .collect(),
            );
        }
        self.restart_references();
        if let WeightWire::Delta(wire) = self.plan.weights {
            let parts = self.gather_saved_references(&saved)?;
            for (su, parts) in self.units.iter().zip(parts) {
                let rebuilt = parts.and_then(|p| delta::Reference::from_saved(&p, wire));
                if let (Some(r), Ok(mut slot)) = (rebuilt, su.reference.lock()) {
                    *slot = Some(r);
                }
            }
        }
        self.step = step;
        Ok(())
    }

    /// Every cross-group member's saved reference part of each unit, in
    /// node order; `None` for a unit where any member has none.
    fn gather_saved_references(
        &self,
        saved: &[Option<delta::SavedReference>],
    ) -> Result<Vec<Option<Vec<delta::SavedReference>>>> {
        let mut mine = Vec::new();
        for s in saved {
            match s {
                None => mine.push(0u8),
                Some(s) => {
                    mine.push(1);
                    mine.extend_from_slice(&s.forwards_since_refresh.to_le_bytes());
                    mine.extend_from_slice(&(s.own.len() as u64).to_le_bytes());
                    mine.extend_from_slice(bytemuck::cast_slice(&s.own));
                }
            }
        }
        let (cross, counter) = (self.groups.cross.clone(), self.counter.clone());
        let all = self
            .thread
            .submit(move |c| {
                counter.set_phase(Phase::Other, 0.0);
                c.all_gather_v(&cross, Bytes::from(mine))
            })
            .wait()?;
        let mut per_unit: Vec<Option<Vec<delta::SavedReference>>> =
            vec![Some(Vec::new()); saved.len()];
        for member in &all {
            let mut at = 0;
            let mut take = |n: usize| -> Result<&[u8]> {
                let b = member.get(at..at + n).ok_or_else(|| {
                    EngineError::Checkpoint("a peer's saved qwZ references are truncated".into())
                })?;
                at += n;
                Ok(b)
            };
            for slot in per_unit.iter_mut() {
                if take(1)?[0] == 0 {
                    *slot = None;
                    continue;
                }
                let forwards = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes"));
                let len = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes")) as usize;
                let own = take(len.saturating_mul(4))?
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                if let Some(parts) = slot {
                    parts.push(delta::SavedReference {
                        own,
                        forwards_since_refresh: forwards,
                    });
                }
            }
        }
        Ok(per_unit)
    }

    /// Drops every qwZ reference (`zero::delta`): each unit's next forward
    /// gather refreshes them. Every rank calls it at the same step
    /// ([`Engine::load_shard_state`] does, before it rebuilds the references
    /// a checkpoint kept).
    fn restart_references(&self) {
        for su in &self.units {
            if let Ok(mut r) = su.reference.lock() {
                *r = None;
            }
        }
    }

    /// How every unit is cut, in unit order.
    pub fn unit_layouts(&self) -> Vec<UnitLayout> {
        self.units
            .iter()
            .map(|su| UnitLayout {
                name: su.name.clone(),
                numel: su.numel,
                padded: su.padded,
                chunk: su.chunk,
            })
            .collect()
    }

    /// Element-wise sum of `values` over all ranks of the job (small
    /// vectors: metrics); with islands, over the islands taking part.
    pub fn sum_over_ranks(&self, values: &[f32]) -> Result<Vec<f32>> {
        self.on_job(|world| self.sum_over_group(world, values))
    }

    /// The ranks of the job's bookkeeping (checkpoints, metrics, the
    /// summary), in order; the first leads. With islands, those of the
    /// islands still taking part, agreed within this rank's island.
    pub fn job_ranks(&self) -> Result<Vec<usize>> {
        Ok(self.job_group()?.ranks().to_vec())
    }

    /// The group of the job's bookkeeping: the job's world, or once an
    /// island is lost the ranks of those left. The ranks of this island
    /// first agree on who is lost (each learns it from its own exchanges).
    fn job_group(&self) -> Result<Arc<Group>> {
        let Some(run) = self.islands.as_ref() else {
            return Ok(self.job_world.clone());
        };
        self.agree_on_members(&[])?;
        let m = island_run::lock(&run.members);
        Ok(m.survivors().unwrap_or_else(|| self.job_world.clone()))
    }

    /// `call` over the job's bookkeeping group. With islands the ranks of
    /// this island then agree on how it went: when a rank of another
    /// island died or did not answer any of them, its island is lost and
    /// every rank of this island runs the call again over the others (so
    /// that they all go on in step).
    fn on_job<T>(
        &self,
        call: impl Fn(Arc<Group>) -> std::result::Result<T, CommError>,
    ) -> Result<T> {
        loop {
            let group = self.job_group()?;
            let result = call(group);
            let Some(run) = self.islands.as_ref() else {
                return Ok(result?);
            };
            let count = run.cfg.count;
            // Per island: a rank of it failed a call here; then a call
            // failed here at all; then per island the failed rank + 1 (so
            // a rank that only hears of it can name the rank when one
            // rank of this island saw it).
            let mut failed = vec![0f32; 2 * count + 1];
            if let Err(e) = &result {
                failed[count] = 1.0;
                if let Some(peer) = e.failed_peer().filter(|&p| p < self.job.world()) {
                    let island = island_run::lock(&run.members).island_of(peer);
                    failed[island] = 1.0;
                    failed[count + 1 + island] = (peer + 1) as f32;
                }
            }
            let agreed = self.sum_over_island(&failed)?;
            if agreed[count] == 0.0 {
                return Ok(result?);
            }
            let mut lost = false;
            let mut m = island_run::lock(&run.members);
            for (i, &n) in agreed[..count].iter().enumerate() {
                if n > 0.0 {
                    let why = match &result {
                        Err(e) => e.what_happened(),
                        Ok(_) if n == 1.0 => format!(
                            "another rank of this island lost it: rank {} failed",
                            agreed[count + 1 + i] as usize - 1
                        ),
                        Ok(_) => "another rank of this island lost it".into(),
                    };
                    lost |= m.lose(i, self.step as u64, why)?;
                }
            }
            if !lost {
                return Err(match result {
                    Err(e) => e.into(),
                    Ok(_) => EngineError::Comm(CommError::PeerFailed {
                        peer: self.job.rank,
                        reason: "another rank of this island failed a job-wide call".into(),
                    }),
                });
            }
        }
    }

    /// Element-wise sum of `values` over the ranks of this rank's island
    /// (the job's without islands): per-step metrics that must not wait
    /// on the other islands.
    pub fn sum_over_island(&self, values: &[f32]) -> Result<Vec<f32>> {
        self.sum_over(self.groups.world.clone(), values)
    }

    fn sum_over(&self, world: Arc<Group>, values: &[f32]) -> Result<Vec<f32>> {
        Ok(self.sum_over_group(world, values)?)
    }

    fn sum_over_group(
        &self,
        world: Arc<Group>,
        values: &[f32],
    ) -> std::result::Result<Vec<f32>, CommError> {
        let counter = self.counter.clone();
        let v = values.to_vec();
        self.thread
            .submit(move |c| {
                counter.set_phase(Phase::Other, 0.0);
                c.all_reduce_f32(&world, &v)
            })
            .wait()
    }
}

#[cfg(test)]
mod counting;
#[cfg(test)]
#[global_allocator]
static COUNTING: counting::Counting = counting::Counting;
#[cfg(test)]
mod tests;
