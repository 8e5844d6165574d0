//! The CUDA half of a joined job: one device, its kernels, and the NCCL
//! communicators of the job's groups (the world, this node, this local
//! rank's ranks across nodes, hpZ sub-groups), with FSDP2's two calls
//! ([`super::fsdp`]) on the caller's stream and what a failure does
//! (every communicator aborted, the dead rank named). The layout, the
//! byte counters and the deadline are the host job's; the NCCL ids travel
//! however the caller exchanges them (`zeropp.torch`: the torch store).
//!
//! Each call returns once its kernels have reported bad input and its
//! NCCL collectives have finished within the job's deadline; what follows
//! the last of them (a scaling kernel, the frees) is left queued on the
//! stream, where the caller's next use of the output waits for it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use zeropp_comm::Transport;
use zeropp_cuda::device::DeviceQuantizedChunks;
use zeropp_cuda::nccl::{NcclComm, NcclId};
use zeropp_cuda::{CudaError, Gpu, GpuElement};

use super::delta::Reference;
use super::device::{DeviceValues, NcclMover};
use super::error::ZeroError;
use super::fsdp::{self, Gather, Scatter};
use super::plan::Layout;
use super::qgz::{self, Reduction};
use super::traffic::{CountingTransport, Phase};
use super::{ByteMover, Hop};

/// How long a failed NCCL call waits for the host transport to see which
/// rank died (its connections close with the process).
const NAME_THE_DEAD: Duration = Duration::from_secs(3);

struct Comms {
    world: NcclComm,
    node: NcclComm,
    cross: NcclComm,
    /// hpZ groups smaller than the node, by their ranks.
    subgroups: Vec<(Vec<usize>, NcclComm)>,
}

impl Comms {
    fn all(&self) -> impl Iterator<Item = &NcclComm> {
        let subgroups = self.subgroups.iter().map(|(_, c)| c);
        [&self.world, &self.node, &self.cross]
            .into_iter()
            .chain(subgroups)
    }

    /// The communicator of group `ranks`: the world, this node, or an
    /// added sub-group.
    fn of(&self, layout: Layout, ranks: &[usize]) -> Result<&NcclComm, ZeroError> {
        let g = layout.ranks_per_node;
        let node_first = layout.node() * g;
        if layout.is_world(ranks) {
            return Ok(&self.world);
        }
        if ranks.iter().copied().eq(node_first..node_first + g) {
            return Ok(&self.node);
        }
        self.subgroups
            .iter()
            .find(|(r, _)| r == ranks)
            .map(|(_, c)| c)
            .ok_or_else(|| {
                ZeroError::Invalid(format!(
                    "no NCCL communicator for ranks {ranks:?}: zeropp gathers over the world or \
                     over consecutive ranks of one node (FSDP2's reshard_after_forward=<int> \
                     groups), made with add_group first"
                ))
            })
    }
}

struct Side {
    gpu: Gpu,
    comms: Option<Comms>,
}

impl Side {
    /// The device and the job's communicators, all queuing their work on
    /// `stream` from now on.
    ///
    /// # Safety
    /// `stream` is a live CUDA stream of this device (the caller's current
    /// one), live for the call it is passed to.
    unsafe fn on_stream(&mut self, stream: usize) -> Result<(&Gpu, &Comms), ZeroError> {
        let comms = self.comms.as_ref().ok_or_else(not_connected)?;
        // SAFETY: the caller's promise.
        unsafe { self.gpu.use_stream(stream) };
        comms.all().for_each(|c| c.use_stream(self.gpu.stream()));
        Ok((&self.gpu, comms))
    }
}

fn not_connected() -> ZeroError {
    ZeroError::Invalid("connect the job's communicators first".into())
}

/// The CUDA half of a joined job (module docs).
pub struct DeviceJob {
    side: Mutex<Side>,
    /// Set by the first peer failure: every communicator is aborted then.
    dead: AtomicBool,
    device: usize,
    layout: Layout,
    counter: Arc<CountingTransport>,
    timeout: Duration,
}

/// One all-gather on the caller's device pointers: `numel` values at `inp`
/// (this rank's shard) into `out` (every member's, group order).
pub struct DeviceGather<'a> {
    pub out: u64,
    pub inp: u64,
    pub numel: usize,
    /// The group's ranks (the world, or a sub-group made with
    /// [`DeviceJob::add_group`]).
    pub ranks: &'a [usize],
    /// The caller's current CUDA stream.
    pub stream: usize,
    pub how: Gather,
    pub phase: Phase,
    /// The parameter group's references on this device, for
    /// [`Gather::Delta`].
    pub reference: Option<&'a mut Option<Reference<DeviceValues>>>,
}

/// One reduce-scatter over the world on the caller's device pointers:
/// `numel` values at `inp` (W equal chunks) into `out` (this rank's).
pub struct DeviceScatter<'a> {
    pub out: u64,
    pub inp: u64,
    pub numel: usize,
    pub stream: usize,
    pub reduction: Reduction,
    /// qgZ's settings for this call, which hops keep error feedback
    /// (inside the node, across), and the group's residuals on this
    /// device; None: NCCL's own reduce-scatter.
    pub qgz: Option<(qgz::Qgz, (bool, bool), &'a mut DeviceFeedback)>,
}

/// qgZ's error feedback on the device for one parameter group: each hop's
/// residual, compressed as on the host (`zero::residual`'s format), made on
/// first use.
#[derive(Default)]
pub struct DeviceFeedback {
    first: Option<DeviceQuantizedChunks>,
    second: Option<DeviceQuantizedChunks>,
}

impl DeviceFeedback {
    /// Bytes held on the device.
    pub fn bytes(&self) -> usize {
        [&self.first, &self.second]
            .into_iter()
            .flatten()
            .map(|c| c.codes.len() + 4 * (c.block_max.len() + c.block_min.len()))
            .sum()
    }

    /// The feedback starts over.
    pub fn reset(&mut self) {
        (self.first, self.second) = (None, None);
    }

    /// The residuals of the hops that keep feedback (`keeps`: inside the
    /// node, across nodes).
    fn feedback<'a>(
        &'a mut self,
        gpu: &Gpu,
        keeps: (bool, bool),
    ) -> Result<qgz::Feedback<'a, Gpu>, ZeroError> {
        let first = residual_slot(gpu, &mut self.first)?;
        let second = residual_slot(gpu, &mut self.second)?;
        Ok(qgz::Feedback::kept(keeps, first, second))
    }
}

/// The residual in `slot`, made empty on first use (`zero::qgz` gives it
/// its shape, from zeros).
fn residual_slot<'a>(
    gpu: &Gpu,
    slot: &'a mut Option<DeviceQuantizedChunks>,
) -> Result<&'a mut DeviceQuantizedChunks, ZeroError> {
    if slot.is_none() {
        let format = super::residual::format();
        *slot = Some(DeviceQuantizedChunks::zeroed(gpu, format, 0, 0)?);
    }
    Ok(slot.as_mut().expect("filled above"))
}

/// The byte mover of a call: the job's communicators, with hpZ's group the
/// node's or `hpz` (a sub-group's communicator and its first rank).
fn mover<'a>(
    gpu: &'a Gpu,
    comms: &'a Comms,
    layout: Layout,
    counter: &'a CountingTransport,
    hpz: Option<(&'a NcclComm, usize)>,
) -> NcclMover<'a> {
    let node_first = layout.node() * layout.ranks_per_node;
    let (hpz, hpz_first) = hpz.unwrap_or((&comms.node, node_first));
    NcclMover {
        world: &comms.world,
        node: &comms.node,
        cross: &comms.cross,
        hpz,
        hpz_first,
        layout,
        counter,
        gpu,
    }
}

impl DeviceJob {
    /// Opens CUDA device `device` (compiling or loading zeropp's kernels
    /// for it) for a job of `layout` counting in `counter`; the
    /// communicators come next, with [`DeviceJob::connect`].
    pub fn open(
        device: usize,
        layout: Layout,
        counter: Arc<CountingTransport>,
        timeout: Duration,
    ) -> Result<DeviceJob, ZeroError> {
        let gpu = Gpu::open_shared(device)?;
        Ok(DeviceJob {
            side: Mutex::new(Side { gpu, comms: None }),
            dead: AtomicBool::new(false),
            device,
            layout,
            counter,
            timeout,
        })
    }

    pub fn device(&self) -> usize {
        self.device
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Joins the job's three NCCL communicators: the world (`world`, made
    /// by rank 0), this node's ranks (`node`, made by the node's first
    /// rank) and this local rank's ranks across nodes (`cross`, made by
    /// that rank on node 0). Every rank calls it in the same order.
    pub fn connect(&self, world: &NcclId, node: &NcclId, cross: &NcclId) -> Result<(), ZeroError> {
        let (l, timeout) = (self.layout, self.timeout);
        let g = l.ranks_per_node;
        self.on_side(|side| {
            if side.comms.is_some() {
                return Err(ZeroError::Invalid(
                    "the NCCL communicators of this job are already joined".into(),
                ));
            }
            let gpu = &side.gpu;
            let comms = (|| -> Result<Comms, CudaError> {
                Ok(Comms {
                    world: NcclComm::init(gpu, world, l.rank, l.world(), timeout)?,
                    node: NcclComm::init(gpu, node, l.local(), g, timeout)?,
                    cross: NcclComm::init(gpu, cross, l.node(), l.nodes, timeout)?,
                    subgroups: Vec::new(),
                })
            })()
            .map_err(|e| self.failed(None, e))?;
            side.comms = Some(comms);
            Ok(())
        })
    }

    /// Whether group `ranks` has a communicator (the world, this node, or
    /// an added sub-group).
    pub fn has_group(&self, ranks: &[usize]) -> Result<bool, ZeroError> {
        let layout = self.layout;
        self.on_side(|side| {
            let comms = side.comms.as_ref().ok_or_else(not_connected)?;
            Ok(comms.of(layout, ranks).is_ok())
        })
    }

    /// Joins the communicator of sub-group `ranks` (consecutive ranks of
    /// this node, this rank among them) from `id`, made by its first rank.
    pub fn add_group(&self, ranks: Vec<usize>, id: &NcclId) -> Result<(), ZeroError> {
        let l = self.layout;
        l.check_subgroup(&ranks).map_err(ZeroError::Invalid)?;
        let me = ranks
            .iter()
            .position(|&r| r == l.rank)
            .expect("checked above");
        let timeout = self.timeout;
        self.on_side(|side| {
            let Side { gpu, comms } = side;
            let comms = comms.as_mut().ok_or_else(not_connected)?;
            let comm = NcclComm::init(gpu, id, me, ranks.len(), timeout)
                .map_err(|e| self.failed(Some(comms), e))?;
            comms.subgroups.push((ranks, comm));
            Ok(())
        })
    }

    /// FSDP2's all-gather on the device: `fsdp::all_gather` on the
    /// caller's pointers, over NCCL on the caller's stream.
    ///
    /// # Safety
    /// `c.inp` holds `c.numel` values of `T` and `c.out` the group's size
    /// times as many, on this device, untouched by anything else until
    /// the call returns; `c.stream` is a live stream of this device.
    pub unsafe fn all_gather<T: GpuElement>(&self, c: DeviceGather<'_>) -> Result<(), ZeroError> {
        let (layout, counter) = (self.layout, &*self.counter);
        let over_world = c.ranks.len() == layout.world();
        self.on_side(|side| {
            // SAFETY: the caller's promise.
            let (gpu, comms) = unsafe { side.on_stream(c.stream) }?;
            let result = (|| {
                let group = comms.of(layout, c.ranks)?;
                let (hop, hpz) = match over_world {
                    true => (Hop::World, None),
                    // A sub-group's gather runs over it as hpZ's group.
                    false => (Hop::Hpz, Some((group, c.ranks[0]))),
                };
                let m = mover(gpu, comms, layout, counter, hpz);
                // SAFETY: the caller's promise.
                let shard = unsafe { gpu.borrow::<T>(c.inp, c.numel) }?;
                let mut out = unsafe { gpu.borrow::<T>(c.out, c.numel * m.size(hop)) }?;
                let (x, mut o) = (shard.view(), out.view_mut());
                fsdp::all_gather(
                    gpu,
                    &m,
                    layout,
                    hop,
                    c.how,
                    c.phase,
                    c.reference,
                    &x,
                    &mut o,
                )
            })();
            result.map_err(|e| self.failed_zero(comms, e))
        })
    }

    /// FSDP2's reduce-scatter over the world on the device:
    /// `fsdp::reduce_scatter` on the caller's pointers (qgZ, or NCCL's own
    /// sum or average in `T`).
    ///
    /// # Safety
    /// As [`DeviceJob::all_gather`]: `c.inp` holds `c.numel` values of `T`,
    /// `c.out` a W-th of them.
    pub unsafe fn reduce_scatter<T: GpuElement>(
        &self,
        c: DeviceScatter<'_>,
    ) -> Result<(), ZeroError> {
        let (layout, counter) = (self.layout, &*self.counter);
        let w = layout.world();
        if !c.numel.is_multiple_of(w) {
            return Err(ZeroError::Invalid(format!(
                "reduce-scatter of {} values over {w} ranks: not W equal chunks",
                c.numel
            )));
        }
        self.on_side(|side| {
            // SAFETY: the caller's promise.
            let (gpu, comms) = unsafe { side.on_stream(c.stream) }?;
            let result = (|| {
                let m = mover(gpu, comms, layout, counter, None);
                // SAFETY: the caller's promise.
                let grad = unsafe { gpu.borrow::<T>(c.inp, c.numel) }?;
                let mut out = unsafe { gpu.borrow::<T>(c.out, c.numel / w) }?;
                let how = match c.qgz {
                    Some((settings, keeps, fb)) => Scatter::Qgz(settings, fb.feedback(gpu, keeps)?),
                    None => Scatter::Plain,
                };
                let (x, mut o) = (grad.view(), out.view_mut());
                fsdp::reduce_scatter(gpu, &m, layout, how, c.reduction, &x, &mut o)
            })();
            result.map_err(|e| self.failed_zero(comms, e))
        })
    }

    /// Runs `f` on the device side, refusing once a peer failed.
    fn on_side<R>(
        &self,
        f: impl FnOnce(&mut Side) -> Result<R, ZeroError>,
    ) -> Result<R, ZeroError> {
        if self.dead.load(Ordering::Relaxed) {
            return Err(ZeroError::Device(CudaError::Peer(
                "an earlier NCCL failure (a rank died or hung) ended this job's communicators; \
                 the job cannot continue"
                    .into(),
            )));
        }
        let mut side = self
            .side
            .lock()
            .map_err(|_| ZeroError::Poisoned("state of this device job"))?;
        f(&mut side)
    }

    /// A collective's failure: a device failure goes through
    /// [`DeviceJob::failed`]; bad input stays what it is.
    fn failed_zero(&self, comms: &Comms, e: ZeroError) -> ZeroError {
        match e {
            ZeroError::Device(e) => self.failed(Some(comms), e),
            e if e.is_peer_failure() => self.failed(Some(comms), CudaError::Peer(e.to_string())),
            e => e,
        }
    }

    /// A device failure. On a peer's failure every communicator of the job
    /// is aborted (their kernels stop holding the stream, and none waits
    /// for the dead at exit), and the error names the rank that died when
    /// the host job's connections saw it (NCCL itself cannot say).
    fn failed(&self, comms: Option<&Comms>, e: CudaError) -> ZeroError {
        let m = match e {
            CudaError::Peer(m) => m,
            e => {
                // Another failure may still be a peer's death in disguise.
                return match self.counter.first_death() {
                    Some((rank, why)) => ZeroError::Device(CudaError::Peer(format!(
                        "rank {rank} failed: {why}; here: {e}"
                    ))),
                    None => ZeroError::Device(e),
                };
            }
        };
        self.dead.store(true, Ordering::Relaxed);
        if let Some(c) = comms {
            c.all().for_each(NcclComm::abort);
        }
        let deadline = Instant::now() + NAME_THE_DEAD;
        let m = loop {
            if let Some((rank, why)) = self.counter.first_death() {
                break format!("rank {rank} failed: {why}; {m}");
            }
            if Instant::now() >= deadline {
                break m;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        ZeroError::Device(CudaError::Peer(m))
    }
}
