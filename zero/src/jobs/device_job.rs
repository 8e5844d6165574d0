//! The device half of a joined job, written once for every device: one
//! device with zeropp's kernels, the communicators of the job's groups
//! (the world, this node, this local rank's ranks across nodes, hpZ
//! sub-groups), FSDP2's two calls ([`crate::fsdp`]) on the caller's
//! pointers and stream, and what a failure does (every communicator
//! aborted, the dead rank named), and every call launched the same way
//! ([`DeviceJob::launch`]: a [`Work`] returned at once, its outcome read
//! by the job's watchdog). A [`Device`] says what differs: the CUDA device
//! with NCCL (`zeropp_cuda::Gpu`, in [`crate::device`]), or the emulated
//! device ([`crate::emulated::EmulatedDevice`]: the CUDA kernels' source on
//! host memory, the host transports as communicators, one thread as its
//! stream). The layout, the byte counters and the deadline are the host
//! job's; the communicators' ids travel however the caller exchanges them
//! (`zeropp.torch`: the torch store).

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use zeropp_comm::{CommError, Transport};
use zeropp_cuda::device::DeviceQuantizedChunks;
use zeropp_cuda::{CudaError, GpuElement};
use zeropp_quant::{QuantizedChunks, Rounding};

use crate::allreduce;
use crate::delta::Slot;
use crate::error::ZeroError;
use crate::fsdp::{self, GradWire, WeightWire};
use crate::layout::Layout;
use crate::qgz::{self, Reduction};
use crate::traffic::{CountingTransport, Phase};
use crate::work::{Fail, Watchdog, Work};

pub use crate::devices::{ChunksOf, Comms, Device, KeptOf, TensorMutOf, TensorOf, ValuesOf};
use crate::{ByteMover, Hop, Quantizer};

/// How long a failed collective waits for the host transport to see which
/// rank died (its connections close with the process).
const NAME_THE_DEAD: Duration = Duration::from_secs(3);

/// The communicator of `ranks` among `dims`: which dimension, the hop it
/// plays there, the communicator.
fn find<'a, C>(
    dims: &'a [Comms<C>],
    ranks: &[usize],
) -> Result<(&'a Comms<C>, Hop, &'a C), ZeroError> {
    // A dimension's node may be another's world: the world wins.
    let world = dims.iter().find(|d| d.ranks[0] == ranks);
    world
        .map(|d| (d, Hop::World, &d.world))
        .or_else(|| {
            dims.iter()
                .find_map(|d| d.of(ranks).map(|(hop, c)| (d, hop, c)))
        })
        .ok_or_else(|| {
            ZeroError::Invalid(format!(
                "no communicator for ranks {ranks:?}: zeropp runs over a mesh dimension it was \
                 given (the whole job, or one joined with connect_dim) or over a run of its \
                 ranks inside a node (FSDP2's reshard_after_forward=<int> groups), joined with \
                 add_group first"
            ))
        })
}

/// The groups a device job has joined, by their ranks, with the hop each
/// plays.
type Joined = Vec<(Vec<usize>, Hop)>;

/// The device and the communicators of every mesh dimension.
type OnStream<'a, D> = (&'a D, &'a [Comms<<D as Device>::Comm>]);

/// The mesh dimension over exactly `ranks` among `dims`, for `what` (its
/// name in the error).
fn whole_dim<'a, C>(
    dims: &'a [Comms<C>],
    ranks: &[usize],
    what: &str,
) -> Result<&'a Comms<C>, ZeroError> {
    match find(dims, ranks)? {
        (comms, Hop::World, _) => Ok(comms),
        _ => Err(ZeroError::Invalid(format!(
            "{what} over ranks {ranks:?}: zeropp runs it over a whole mesh dimension, not a \
             group inside one"
        ))),
    }
}

struct Side<D: Device> {
    device: D,
    /// The communicators of each mesh dimension, the whole job's first
    /// (empty before `connect`).
    dims: Vec<Comms<D::Comm>>,
}

impl<D: Device> Side<D> {
    /// The device and the communicators of every dimension, all queuing
    /// their work on `stream` from now on.
    ///
    /// # Safety
    /// As [`Device::use_stream`].
    unsafe fn on_stream(&mut self, stream: usize) -> Result<OnStream<'_, D>, ZeroError> {
        if self.dims.is_empty() {
            return Err(not_connected());
        }
        for comms in &self.dims {
            // SAFETY: the caller's promise.
            unsafe { self.device.use_stream(stream, comms) };
        }
        Ok((&self.device, &self.dims))
    }
}

fn not_connected() -> ZeroError {
    ZeroError::Invalid("connect the job's communicators first".into())
}

/// The device half of a joined job (module docs).
pub struct DeviceJob<D: Device> {
    side: Mutex<Side<D>>,
    /// The groups joined so far, by their ranks, and the hop each plays
    /// (a dimension's world, or an hpZ group; None before `connect`): what
    /// `has_group` reads without waiting for a collective that holds the
    /// device.
    joined: Mutex<Option<Joined>>,
    /// The first peer failure, once one happened: every communicator is
    /// aborted then, and every later call refuses naming it.
    dead: Mutex<Option<String>>,
    index: usize,
    layout: Layout,
    counter: Arc<CountingTransport>,
    timeout: Duration,
    /// Where calls run in the order of the caller's stream.
    queue: Arc<D::Queue>,
    /// Started with the first launched call.
    watchdog: OnceLock<Watchdog>,
}

/// One all-gather on the caller's device pointers: `numel` values at `inp`
/// (this rank's shard) into `out` (every member's, group order).
pub struct DeviceGather<'a, V, C> {
    pub out: u64,
    pub inp: u64,
    pub numel: usize,
    /// The group's ranks (the world, or a sub-group made with
    /// [`DeviceJob::add_group`]).
    pub ranks: &'a [usize],
    /// The caller's current stream.
    pub stream: usize,
    pub how: WeightWire,
    pub phase: Phase,
    /// The parameter group's references on this device (`V`: its kept
    /// values, `C`: its quantized chunks) and its frozen ranges, for
    /// [`WeightWire::Delta`].
    pub slot: Option<Slot<'a, V, C>>,
}

/// One reduce-scatter over a mesh dimension on the caller's device
/// pointers: `numel` values at `inp` (one equal chunk per member) into
/// `out` (this rank's).
pub struct DeviceScatter<'a, C> {
    pub out: u64,
    pub inp: u64,
    pub numel: usize,
    /// The dimension's ranks (the whole job's, or one joined with
    /// [`DeviceJob::connect_dim`]).
    pub ranks: &'a [usize],
    pub stream: usize,
    pub reduction: Reduction,
    /// How the call sums (`GradWire::for_call`: a ring is the
    /// communicator's own reduce-scatter in `T`) and qgZ's rounding.
    pub wire: GradWire,
    pub rounding: Rounding,
    /// The group's residuals on this device (`C`: its quantized chunks),
    /// for the hops where `wire` keeps error feedback.
    pub feedback: Option<&'a mut DeviceFeedback<C>>,
}

/// One quantized all-reduce across a mesh dimension on the caller's device
/// buffer: `numel` values at `buf`, in place.
pub struct DeviceAllReduce<'a, C> {
    pub buf: u64,
    pub numel: usize,
    /// The dimension's ranks (joined with [`DeviceJob::connect_dim`]).
    pub ranks: &'a [usize],
    pub stream: usize,
    pub reduction: Reduction,
    /// Its settings, whether it keeps error feedback, and the residuals of
    /// its two quantizations on this device (`first`: what it sent,
    /// `second`: its own part of the result).
    pub quantized: (
        allreduce::QuantizedAllReduce,
        bool,
        &'a mut DeviceFeedback<C>,
    ),
}

/// Bytes a buffer of quantized chunks holds.
pub trait HeldBytes {
    fn held_bytes(&self) -> usize;
}

impl HeldBytes for DeviceQuantizedChunks {
    fn held_bytes(&self) -> usize {
        self.format.total_bytes(self.chunk_len) * self.count
    }
}

impl HeldBytes for QuantizedChunks {
    fn held_bytes(&self) -> usize {
        self.format.total_bytes(self.chunk_len) * self.count
    }
}

/// qgZ's error feedback on a device for one parameter group: each hop's
/// residual, compressed as on the host (`zero::residual`'s format), made on
/// first use.
pub struct DeviceFeedback<C> {
    first: Option<C>,
    second: Option<C>,
}

impl<C> Default for DeviceFeedback<C> {
    fn default() -> Self {
        DeviceFeedback {
            first: None,
            second: None,
        }
    }
}

impl<C: HeldBytes> DeviceFeedback<C> {
    /// Bytes held on the device.
    pub fn bytes(&self) -> usize {
        [&self.first, &self.second]
            .into_iter()
            .flatten()
            .map(HeldBytes::held_bytes)
            .sum()
    }
}

impl<C> DeviceFeedback<C> {
    /// The feedback starts over.
    pub fn reset(&mut self) {
        (self.first, self.second) = (None, None);
    }

    /// The residuals of the hops that keep feedback (`keeps`: inside the
    /// node, across nodes).
    fn feedback<'a, Q: Quantizer<Chunks = C>>(
        &'a mut self,
        q: &Q,
        keeps: (bool, bool),
    ) -> Result<qgz::Feedback<'a, Q>, ZeroError> {
        let first = residual_slot(q, &mut self.first)?;
        let second = residual_slot(q, &mut self.second)?;
        Ok(qgz::Feedback::kept(keeps, first, second))
    }
}

/// The residual in `slot`, made empty on first use (`zero::qgz` gives it
/// its shape, from zeros).
fn residual_slot<'a, Q: Quantizer>(
    q: &Q,
    slot: &'a mut Option<Q::Chunks>,
) -> Result<&'a mut Q::Chunks, ZeroError> {
    if slot.is_none() {
        *slot = Some(q.chunks(crate::residual::format(), 0, 0)?);
    }
    Ok(slot.as_mut().expect("filled above"))
}

impl<D: Device> DeviceJob<D> {
    /// The job's half on `device` (number `index`), for a job of `layout`
    /// counting in `counter`; the communicators come next, with
    /// [`DeviceJob::connect`].
    pub fn new(
        device: D,
        index: usize,
        layout: Layout,
        counter: Arc<CountingTransport>,
        timeout: Duration,
    ) -> DeviceJob<D> {
        DeviceJob {
            queue: Arc::new(device.queue()),
            watchdog: OnceLock::new(),
            side: Mutex::new(Side {
                device,
                dims: Vec::new(),
            }),
            joined: Mutex::new(None),
            dead: Mutex::new(None),
            index,
            layout,
            counter,
            timeout,
        }
    }

    /// The device's number.
    pub fn device(&self) -> usize {
        self.index
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Joins the job's three communicators: the world (`world`, made by
    /// rank 0), this node's ranks (`node`, made by the node's first rank)
    /// and this local rank's ranks across nodes (`cross`, made by that
    /// rank on node 0). Every rank calls it in the same order.
    pub fn connect(&self, world: &D::Id, node: &D::Id, cross: &D::Id) -> Result<(), ZeroError> {
        let l = self.layout;
        if self.joined()?.is_some() {
            return Err(ZeroError::Invalid(
                "the communicators of this job are already joined".into(),
            ));
        }
        self.join_dim((0..l.world()).collect(), l, [world, node, cross])
    }

    /// Joins the communicators of the mesh dimension over `ranks` (global
    /// ranks laid out as `layout`: `Layout::of_ranks`): its world, this
    /// rank's node in it and its cross group, from the ids their first
    /// members made. Every member calls it in the same order, after
    /// [`DeviceJob::connect`].
    pub fn connect_dim(
        &self,
        ranks: Vec<usize>,
        layout: Layout,
        world: &D::Id,
        node: &D::Id,
        cross: &D::Id,
    ) -> Result<(), ZeroError> {
        if self.joined()?.is_none() {
            return Err(not_connected());
        }
        if ranks.len() != layout.world() || ranks.get(layout.rank) != Some(&self.layout.rank) {
            return Err(ZeroError::Invalid(format!(
                "a mesh dimension over ranks {ranks:?} laid out as {layout:?}, which does not \
                 place this rank {} at its position",
                self.layout.rank
            )));
        }
        if self.has_dim(&ranks)? {
            return Ok(());
        }
        self.join_dim(ranks, layout, [world, node, cross])
    }

    /// Joins one dimension's world, node and cross communicators.
    fn join_dim(
        &self,
        ranks: Vec<usize>,
        l: Layout,
        [world, node, cross]: [&D::Id; 3],
    ) -> Result<(), ZeroError> {
        let (g, timeout) = (l.ranks_per_node, self.timeout);
        let (node_ranks, cross_ranks) = l.node_and_cross(&ranks);
        self.on_side(|side| {
            let d = &side.device;
            let comms = (|| -> Result<Comms<D::Comm>, ZeroError> {
                Ok(Comms {
                    world: d.join(world, l.rank, l.world(), timeout)?,
                    node: d.join(node, l.local(), g, timeout)?,
                    cross: d.join(cross, l.node(), l.nodes, timeout)?,
                    ranks: [ranks, node_ranks, cross_ranks],
                    layout: l,
                    subgroups: Vec::new(),
                })
            })()
            .map_err(|e| self.failed(Some(&side.dims), e))?;
            let mut joined = self.joined()?;
            let joined = joined.get_or_insert_with(Vec::new);
            joined.push((comms.ranks[0].clone(), Hop::World));
            joined.push((comms.ranks[1].clone(), Hop::Hpz));
            side.dims.push(comms);
            Ok(())
        })
    }

    /// Whether group `ranks` has a communicator (a mesh dimension, its
    /// node, or an added sub-group).
    pub fn has_group(&self, ranks: &[usize]) -> Result<bool, ZeroError> {
        Ok(self.hop_of(ranks)?.is_some())
    }

    /// Whether the mesh dimension over `ranks` is joined (`connect` or
    /// `connect_dim`).
    pub fn has_dim(&self, ranks: &[usize]) -> Result<bool, ZeroError> {
        Ok(self.hop_of(ranks)? == Some(Hop::World))
    }

    /// What a call over `ranks` runs as: a mesh dimension (`Hop::World`),
    /// hpZ's group inside one (`Hop::Hpz`), or None (not joined).
    pub fn hop_of(&self, ranks: &[usize]) -> Result<Option<Hop>, ZeroError> {
        let joined = self.joined()?;
        let groups = joined.as_ref().ok_or_else(not_connected)?;
        // A dimension's node may be another's world: the world wins.
        let hops = groups.iter().filter(|(r, _)| r == ranks).map(|(_, h)| *h);
        Ok(hops.min_by_key(|h| *h != Hop::World))
    }

    fn joined(&self) -> Result<std::sync::MutexGuard<'_, Option<Joined>>, ZeroError> {
        self.joined
            .lock()
            .map_err(|_| ZeroError::Poisoned("groups of this device job"))
    }

    /// Joins the communicator of sub-group `ranks` (a run of a mesh
    /// dimension's ranks on this node, this rank among them: consecutive
    /// ranks of this node for the whole job) from `id`, made by its first
    /// rank.
    pub fn add_group(&self, ranks: Vec<usize>, id: &D::Id) -> Result<(), ZeroError> {
        let rank = self.layout.rank;
        let me = ranks.iter().position(|&r| r == rank);
        let timeout = self.timeout;
        self.on_side(|side| {
            let Side { device, dims } = side;
            let at = dims.iter().position(|d| d.has_run(&ranks, rank));
            let (Some(at), Some(me)) = (at, me) else {
                return Err(ZeroError::Invalid(format!(
                    "a sub-group of ranks {ranks:?}: zeropp's sub-groups are runs of a mesh \
                     dimension's ranks on one node that include this rank {rank} (FSDP2's \
                     reshard_after_forward=<int> groups)"
                )));
            };
            let comm = device
                .join(id, me, ranks.len(), timeout)
                .map_err(|e| self.failed(Some(dims), e))?;
            self.joined()?
                .get_or_insert_with(Vec::new)
                .push((ranks.clone(), Hop::Hpz));
            dims[at].subgroups.push((ranks, comm));
            Ok(())
        })
    }

    /// FSDP2's all-gather on the device: `fsdp::all_gather` on the
    /// caller's pointers, over the group's communicator on the caller's
    /// stream.
    ///
    /// # Safety
    /// `c.inp` holds `c.numel` values of `T` and `c.out` the group's size
    /// times as many, in this device's memory, untouched by anything else
    /// until the call returns; `c.stream` is a live stream of this device.
    pub unsafe fn all_gather<T: GpuElement>(
        &self,
        c: DeviceGather<'_, KeptOf<D>, ChunksOf<D>>,
    ) -> Result<(), ZeroError> {
        let (rank, counter) = (self.layout.rank, &*self.counter);
        let call = |device: &D, dims: &[Comms<D::Comm>]| {
            let (comms, hop, group) = find(dims, c.ranks)?;
            let layout = comms.layout;
            let hpz = match hop {
                Hop::World => (&comms.node, &comms.ranks[1][..]),
                // A sub-group's gather runs over it as hpZ's group.
                _ => (group, c.ranks),
            };
            let m = device.mover(comms, rank, counter, hpz);
            let size = m.size(hop);
            let (q, how, phase, slot) = (device.kernels(), c.how, c.phase, c.slot);
            let run = |x: &TensorOf<'_, D, T>, o: &mut TensorMutOf<'_, D, T>| {
                fsdp::all_gather(q, &m, layout, hop, how, phase, slot, x, o)
            };
            // SAFETY: the caller's promise.
            unsafe { device.with_tensors((c.inp, c.numel), (c.out, c.numel * size), run) }
        };
        // SAFETY: the caller's promise.
        unsafe { self.on_device(c.stream, call) }
    }

    /// FSDP2's reduce-scatter over the world on the device:
    /// `fsdp::reduce_scatter` on the caller's pointers (qgZ, or the
    /// communicator's own sum or average in `T`).
    ///
    /// # Safety
    /// As [`DeviceJob::all_gather`]: `c.inp` holds `c.numel` values of `T`,
    /// `c.out` a W-th of them.
    pub unsafe fn reduce_scatter<T: GpuElement>(
        &self,
        c: DeviceScatter<'_, ChunksOf<D>>,
    ) -> Result<(), ZeroError> {
        let (rank, counter) = (self.layout.rank, &*self.counter);
        let w = c.ranks.len();
        if w == 0 || !c.numel.is_multiple_of(w) {
            return Err(ZeroError::Invalid(format!(
                "reduce-scatter of {} values over {w} ranks: not one equal chunk per rank",
                c.numel
            )));
        }
        let call = |device: &D, dims: &[Comms<D::Comm>]| {
            let comms = whole_dim(dims, c.ranks, "a reduce-scatter")?;
            let layout = comms.layout;
            let m = device.mover(comms, rank, counter, (&comms.node, &comms.ranks[1]));
            let q = device.kernels();
            let feedback = match c.feedback {
                Some(fb) => fb.feedback(q, c.wire.keeps(layout.ranks_per_node))?,
                None => qgz::Feedback::none(),
            };
            let (wire, call, reduction) = (c.wire, (c.rounding, feedback), c.reduction);
            let run = |x: &TensorOf<'_, D, T>, o: &mut TensorMutOf<'_, D, T>| {
                fsdp::reduce_scatter(q, &m, layout, wire, call, reduction, x, o)
            };
            // SAFETY: the caller's promise.
            unsafe { device.with_tensors((c.inp, c.numel), (c.out, c.numel / w), run) }
        };
        // SAFETY: the caller's promise.
        unsafe { self.on_device(c.stream, call) }
    }

    /// HSDP's all-reduce across a mesh dimension (its replicate one) on
    /// the device, quantized: `allreduce::all_reduce` on the caller's
    /// buffer, in place, over that dimension's communicator.
    ///
    /// # Safety
    /// `c.buf` holds `c.numel` values of `T` in this device's memory,
    /// untouched by anything else until the call returns (it is read whole
    /// into f32 values before it is written); `c.stream` is a live stream
    /// of this device.
    pub unsafe fn all_reduce<T: GpuElement>(
        &self,
        c: DeviceAllReduce<'_, ChunksOf<D>>,
    ) -> Result<(), ZeroError> {
        let (rank, counter) = (self.layout.rank, &*self.counter);
        let call = |device: &D, dims: &[Comms<D::Comm>]| {
            let comms = whole_dim(dims, c.ranks, "an all-reduce")?;
            let m = device.mover(comms, rank, counter, (&comms.node, &comms.ranks[1]));
            let q = device.kernels();
            let (s, keeps, fb) = c.quantized;
            let f = fb.feedback(q, (keeps, keeps))?;
            let feedback = allreduce::ReplicaFeedback {
                sent: f.first,
                owned: f.second,
            };
            let hop = (Hop::World, Phase::Replicate);
            let run = |x: &TensorOf<'_, D, T>, o: &mut TensorMutOf<'_, D, T>| {
                allreduce::all_reduce(q, &m, hop, s, c.reduction, feedback, x, o)
            };
            // SAFETY: the caller's promise.
            unsafe { device.with_tensors((c.buf, c.numel), (c.buf, c.numel), run) }
        };
        // SAFETY: the caller's promise.
        unsafe { self.on_device(c.stream, call) }
    }

    /// Launches `call` (one of this job's collectives on the caller's
    /// pointers: [`DeviceJob::all_gather`], ...) in the order of the work
    /// on the caller's `stream`, and returns at once with its [`Work`]
    /// (on CUDA once its host side queued its kernels and NCCL calls; on
    /// the emulated device once it is queued). The job's watchdog reads
    /// its outcome.
    ///
    /// # Safety
    /// `stream` is a live stream of this device, and the buffers `call`
    /// uses stay live and untouched by anything else until the Work is
    /// waited for.
    pub unsafe fn launch(
        self: &Arc<Self>,
        stream: usize,
        call: impl FnOnce(&DeviceJob<D>) -> Result<(), ZeroError> + Send + 'static,
    ) -> Result<Work<D::Queue>, ZeroError>
    where
        D: Send + 'static,
        D::Comm: Send + Sync,
    {
        self.refuse_if_dead()?;
        let watchdog = self
            .watchdog
            .get_or_init(|| Watchdog::start(Arc::downgrade(self), self.timeout));
        let job = self.clone();
        // SAFETY: the caller's promise.
        unsafe { Work::launch(&self.queue, stream, watchdog, move || call(&job)) }
    }

    /// Runs `f` on the device side, refusing once a peer failed.
    fn on_side<R>(
        &self,
        f: impl FnOnce(&mut Side<D>) -> Result<R, ZeroError>,
    ) -> Result<R, ZeroError> {
        self.refuse_if_dead()?;
        let mut side = self
            .side
            .lock()
            .map_err(|_| ZeroError::Poisoned("state of this device job"))?;
        f(&mut side)
    }

    /// `call` on the device and every dimension's communicators, all on
    /// the caller's `stream`; on its failure the members of every group
    /// this rank has joined hear that it gave up its next call there (the
    /// ranks waiting on it fail at once, as on the host path), and the job
    /// ends as [`DeviceJob::failed`] says (communicators aborted where a
    /// peer is at fault).
    ///
    /// # Safety
    /// As [`Device::use_stream`].
    unsafe fn on_device<R>(
        &self,
        stream: usize,
        call: impl FnOnce(&D, &[Comms<D::Comm>]) -> Result<R, ZeroError>,
    ) -> Result<R, ZeroError> {
        self.on_side(|side| {
            // SAFETY: the caller's promise.
            let (device, dims) = unsafe { side.on_stream(stream) }?;
            call(device, dims).map_err(|e| {
                e.with_notice(self.layout.rank, |notice| {
                    for c in dims {
                        c.all().for_each(|comm| device.give_up(comm, notice));
                    }
                });
                self.failed(Some(dims), e)
            })
        })
    }

    /// The failure that ended this job, if one did.
    fn refuse_if_dead(&self) -> Result<(), ZeroError> {
        match self.dead.lock().ok().and_then(|d| d.clone()) {
            Some(why) => Err(ZeroError::Device(CudaError::Peer(format!(
                "{why} — that failure ended this job's communicators; the job cannot continue"
            )))),
            None => Ok(()),
        }
    }

    /// A collective's failure. Bad input stays what it is. On a peer's
    /// failure every communicator of the job is aborted (their work stops
    /// holding the stream, and none waits for the dead at exit), and the
    /// error names the rank that died when the host job's connections saw
    /// it (NCCL itself cannot say). Another device failure may still be a
    /// peer's death in disguise: it names the dead when one is known.
    fn failed(&self, dims: Option<&[Comms<D::Comm>]>, e: ZeroError) -> ZeroError {
        // A peer known to have failed or given up is named already; a
        // lost connection or a timeout may be a third rank's death.
        let (m, named) = match e {
            ZeroError::Device(CudaError::Peer(m)) => (m, false),
            ZeroError::Comm(CommError::PeerFailed { .. } | CommError::GaveUp { .. }) => {
                (e.to_string(), true)
            }
            e if e.is_peer_failure() => (e.to_string(), false),
            ZeroError::Device(e) => {
                return match self.counter.first_death() {
                    Some((rank, why)) => ZeroError::Device(CudaError::Peer(format!(
                        "rank {rank} failed: {why}; here: {e}"
                    ))),
                    None => ZeroError::Device(e),
                };
            }
            e => return e,
        };
        for c in dims.into_iter().flatten() {
            c.all().for_each(D::abort);
        }
        let deadline = Instant::now() + NAME_THE_DEAD;
        let m = loop {
            if named {
                break m;
            }
            match self.counter.first_death() {
                Some((rank, _)) if m.contains(&format!("rank {rank} failed")) => break m,
                Some((rank, why)) => break format!("rank {rank} failed: {why}; {m}"),
                None if Instant::now() >= deadline => break m,
                None => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        if let Ok(mut dead) = self.dead.lock() {
            dead.get_or_insert_with(|| m.clone());
        }
        ZeroError::Device(CudaError::Peer(m))
    }
}

/// The watchdog's verdict on a call that ran past the deadline: the job
/// ends as on a peer's failure (communicators aborted where no call holds
/// them), naming the dead rank when the host job's connections saw one.
impl<D: Device + Send + 'static> Fail for DeviceJob<D>
where
    D::Comm: Send + Sync,
{
    fn fail_stuck(&self, limit: Duration) -> String {
        let m = format!(
            "rank {}: a collective ran longer than the job's deadline ({:.0} s with the time to \
             name a stuck peer) and was ended by the job's watchdog",
            self.layout.rank,
            limit.as_secs_f64()
        );
        let m = match self.counter.first_death() {
            Some((rank, why)) => format!("rank {rank} failed: {why}; {m}"),
            None => m,
        };
        if let Ok(side) = self.side.try_lock() {
            side.dims.iter().for_each(|c| c.all().for_each(D::abort));
        }
        if let Ok(mut dead) = self.dead.lock() {
            dead.get_or_insert_with(|| m.clone());
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::ZeroGroups;
    use crate::emulated::EmulatedDevice;
    use crate::host::{Host, HostMover};
    use crate::plan;
    use crate::testing::{Rank, bf16s, gradient as values, on_world};
    use zeropp_comm::collectives::CommThread;

    fn bits(x: &[bf16]) -> Vec<u32> {
        x.iter().map(|v| u32::from(v.to_bits())).collect()
    }

    fn f32_bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// Rank `r`'s device job on the emulated device, connected over the
    /// standard groups.
    fn emulated_job(r: &Rank) -> DeviceJob<EmulatedDevice> {
        emulated_job_within(r, Duration::from_secs(30))
    }

    fn emulated_job_within(r: &Rank, timeout: Duration) -> DeviceJob<EmulatedDevice> {
        let device = EmulatedDevice {
            comm: r.comm.clone(),
            stream: Arc::new(CommThread::new(r.comm.clone())),
        };
        let job = DeviceJob::new(device, 0, r.layout, r.counter.clone(), timeout);
        let g = &r.groups;
        job.connect(&g.world, &g.node, &g.cross).unwrap();
        job
    }

    /// qgZ at int4 inside the node (both hops keep error feedback).
    fn qgz_wire() -> GradWire {
        let (intra, inter) = plan::gradient_formats(4, 32, Some(128)).unwrap();
        let wire = GradWire::TwoHop {
            intra,
            inter,
            error_feedback: true,
            stochastic: false,
            hadamard: true,
        };
        assert_eq!(wire.keeps(2), (true, true));
        assert_eq!(
            wire.keeps(1),
            (false, true),
            "no hop inside a node of one rank"
        );
        wire
    }

    /// A call's rounding, and no residuals.
    fn plain_call<'a>() -> (Rounding, qgz::Feedback<'a, Host>) {
        (Rounding::NearestEven, qgz::Feedback::none())
    }

    const LEN: usize = 8 * 96;

    /// The hpZ sub-group of this rank: two consecutive ranks of its node.
    fn pair(l: Layout) -> Vec<usize> {
        let first = l.rank / 2 * 2;
        vec![first, first + 1]
    }

    /// Every kind of FSDP2 call through the host library: the outputs' bits.
    fn on_host(r: &Rank) -> Vec<Vec<u32>> {
        let (l, m) = (r.layout, r.mover());
        let shard = bf16s(&values(l.rank + 10, LEN / 8));
        let mut outs = Vec::new();
        let mut reference = None;
        for (wire, calls) in crate::testing::every_weight_wire(4, 256)
            .into_iter()
            .zip([1, 1, 2])
        {
            let how = wire.for_call(true, true);
            for _ in 0..calls {
                let mut out = vec![bf16::ZERO; LEN];
                let (x, mut o) = (&shard[..], &mut out[..]);
                let phase = Phase::ForwardGather;
                let r = Some(Slot::new(&mut reference));
                fsdp::all_gather(&Host, &m, l, Hop::World, how, phase, r, &x, &mut o).unwrap();
                outs.push(bits(&out));
            }
        }
        // hpZ's gather inside a pair of the node's ranks.
        let ranks = pair(l);
        let hpz = ZeroGroups::run_or_node(&r.groups.node, ranks[0], 2).unwrap();
        let m2 = HostMover {
            groups: ZeroGroups {
                hpz,
                ..r.groups.clone()
            },
            ..r.mover()
        };
        let mut out = vec![bf16::ZERO; 2 * shard.len()];
        let (x, mut o) = (&shard[..], &mut out[..]);
        let phase = Phase::BackwardGather;
        fsdp::all_gather(
            &Host,
            &m2,
            l,
            Hop::Hpz,
            WeightWire::F32,
            phase,
            None,
            &x,
            &mut o,
        )
        .unwrap();
        outs.push(bits(&out));
        let grad = values(l.rank, LEN);
        for reduction in [Reduction::Sum, Reduction::Mean] {
            let mut out = vec![0f32; LEN / 8];
            let (x, mut o) = (&grad[..], &mut out[..]);
            let ring = GradWire::RingF32;
            fsdp::reduce_scatter(&Host, &m, l, ring, plain_call(), reduction, &x, &mut o).unwrap();
            outs.push(f32_bits(&out));
        }
        let mut fb = DeviceFeedback::<QuantizedChunks>::default();
        let wire = qgz_wire();
        for _ in 0..2 {
            let mut out = vec![0f32; LEN / 8];
            let (x, mut o) = (&grad[..], &mut out[..]);
            let call = (
                Rounding::NearestEven,
                fb.feedback(&Host, wire.keeps(l.ranks_per_node)).unwrap(),
            );
            fsdp::reduce_scatter(&Host, &m, l, wire, call, Reduction::Mean, &x, &mut o).unwrap();
            outs.push(f32_bits(&out));
        }
        outs
    }

    type Job = DeviceJob<EmulatedDevice>;

    /// FSDP2's gather in place: `shard` copied into run `at` of `out`, then
    /// gathered from there.
    fn gather(
        job: &Job,
        shard: &[bf16],
        (out, at): (&mut [bf16], usize),
        ranks: &[usize],
        how: WeightWire,
        phase: Phase,
        slot: Option<Slot<'_, crate::host::Kept, zeropp_quant::QuantizedChunks>>,
    ) {
        let n = shard.len();
        out[at * n..(at + 1) * n].copy_from_slice(shard);
        let c = DeviceGather {
            out: out.as_mut_ptr() as u64,
            inp: out[at * n..].as_ptr() as u64,
            numel: n,
            ranks,
            stream: 0,
            how,
            phase,
            slot,
        };
        // SAFETY: `out` holds the group's size times `n` values, the
        // input is its run `at`.
        unsafe { job.all_gather::<bf16>(c) }.unwrap();
    }

    fn scatter(
        job: &Job,
        grad: &[f32],
        qgz: Option<(GradWire, &mut DeviceFeedback<QuantizedChunks>)>,
        reduction: Reduction,
    ) -> Vec<u32> {
        let (wire, feedback) = match qgz {
            Some((wire, fb)) => (wire, Some(fb)),
            None => (GradWire::RingF32, None),
        };
        let mut out = vec![0f32; grad.len() / job.layout().world()];
        let world: Vec<usize> = (0..job.layout().world()).collect();
        let c = DeviceScatter {
            out: out.as_mut_ptr() as u64,
            inp: grad.as_ptr() as u64,
            numel: grad.len(),
            ranks: &world,
            stream: 0,
            reduction,
            wire,
            rounding: Rounding::NearestEven,
            feedback,
        };
        // SAFETY: `grad` holds `numel` values, `out` a W-th of them.
        unsafe { job.reduce_scatter::<f32>(c) }.unwrap();
        f32_bits(&out)
    }

    /// The same calls through the device job on the emulated device, on
    /// "device" addresses; the gathers in place as FSDP2 runs them (the
    /// input is this rank's run of the output).
    fn on_emulated(r: &Rank) -> Vec<Vec<u32>> {
        let l = r.layout;
        let job = emulated_job(r);
        let shard = bf16s(&values(l.rank + 10, LEN / 8));
        let n = shard.len();
        let mut outs = Vec::new();
        let mut reference = None;
        let world: Vec<usize> = (0..l.world()).collect();
        for (wire, calls) in crate::testing::every_weight_wire(4, 256)
            .into_iter()
            .zip([1, 1, 2])
        {
            let how = wire.for_call(true, true);
            for _ in 0..calls {
                let mut out = vec![bf16::ZERO; LEN];
                let phase = Phase::ForwardGather;
                gather(
                    &job,
                    &shard,
                    (&mut out, l.rank),
                    &world,
                    how,
                    phase,
                    Some(Slot::new(&mut reference)),
                );
                outs.push(bits(&out));
            }
        }
        let ranks = pair(l);
        assert!(!job.has_group(&ranks).unwrap());
        let group = ZeroGroups::run_or_node(&r.groups.node, ranks[0], 2).unwrap();
        job.add_group(ranks.clone(), &group).unwrap();
        assert!(job.has_group(&ranks).unwrap());
        let mut out = vec![bf16::ZERO; 2 * n];
        let phase = Phase::BackwardGather;
        gather(
            &job,
            &shard,
            (&mut out, l.rank % 2),
            &ranks,
            WeightWire::F32,
            phase,
            None,
        );
        outs.push(bits(&out));
        let grad = values(l.rank, LEN);
        for reduction in [Reduction::Sum, Reduction::Mean] {
            outs.push(scatter(&job, &grad, None, reduction));
        }
        let mut fb = DeviceFeedback::<QuantizedChunks>::default();
        for _ in 0..2 {
            outs.push(scatter(
                &job,
                &grad,
                Some((qgz_wire(), &mut fb)),
                Reduction::Mean,
            ));
        }
        assert!(fb.bytes() > 0, "both hops keep their residuals");
        outs
    }

    #[test]
    fn the_device_job_on_the_emulated_device_gives_the_hosts_results_bit_for_bit() {
        let timeout = Duration::from_secs(30);
        let host = on_world(2, 4, timeout, |r| on_host(&r));
        let emulated = on_world(2, 4, timeout, |r| on_emulated(&r));
        assert_eq!(host.len(), 8);
        for (rank, (h, e)) in host.iter().zip(&emulated).enumerate() {
            assert_eq!(h.len(), e.len());
            for (call, (a, b)) in h.iter().zip(e).enumerate() {
                assert_eq!(a, b, "rank {rank}, call {call}");
            }
        }
        // The plain gather is exact: every rank's shard in rank order.
        let expect: Vec<u32> = (0..8)
            .flat_map(|r| bits(&bf16s(&values(r + 10, LEN / 8))))
            .collect();
        assert_eq!(emulated[3][0], expect);
    }

    #[test]
    fn the_device_job_refuses_bad_calls_with_what_to_do() {
        let timeout = Duration::from_secs(30);
        let errors = on_world(1, 4, timeout, move |r| {
            let device = EmulatedDevice {
                comm: r.comm.clone(),
                stream: Arc::new(CommThread::new(r.comm.clone())),
            };
            let job = DeviceJob::new(device, 0, r.layout, r.counter.clone(), timeout);
            let not_connected = job.has_group(&[0, 1]).unwrap_err().to_string();
            let g = &r.groups;
            job.connect(&g.world, &g.node, &g.cross).unwrap();
            let twice = job.connect(&g.world, &g.node, &g.cross).unwrap_err();
            let (x, mut out) = ([1f32; 4], [0f32; 8]);
            let ranks = [0, 1];
            let mut gather = |inp: u64, ranks: &[usize]| {
                let c = DeviceGather {
                    out: out.as_mut_ptr() as u64,
                    inp,
                    numel: 4,
                    ranks,
                    stream: 0,
                    how: WeightWire::F32,
                    phase: Phase::ForwardGather,
                    slot: None,
                };
                // SAFETY: refused before anything is read (no such group;
                // a misaligned address).
                unsafe { job.all_gather::<f32>(c) }.unwrap_err().to_string()
            };
            let no_group = gather(x.as_ptr() as u64, &ranks);
            let world: Vec<usize> = (0..4).collect();
            let c = DeviceScatter {
                out: out.as_mut_ptr() as u64,
                inp: x.as_ptr() as u64,
                numel: 6,
                ranks: &world,
                stream: 0,
                reduction: Reduction::Sum,
                wire: GradWire::RingF32,
                rounding: Rounding::NearestEven,
                feedback: None,
            };
            // SAFETY: refused before anything is read.
            let uneven = unsafe { job.reduce_scatter::<f32>(c) }.unwrap_err();
            let bad_sub = job.add_group(vec![1, 3], &g.node).unwrap_err();
            [
                not_connected,
                twice.to_string(),
                no_group,
                uneven.to_string(),
                bad_sub.to_string(),
            ]
        });
        let [not_connected, twice, no_group, uneven, bad_sub] = &errors[0];
        assert!(not_connected.contains("connect"), "{not_connected}");
        assert!(twice.contains("already joined"), "{twice}");
        assert!(no_group.contains("add_group"), "{no_group}");
        assert!(uneven.contains("not one equal chunk per rank"), "{uneven}");
        assert!(bad_sub.contains("runs of a mesh dimension"), "{bad_sub}");
    }

    #[test]
    fn on_a_mesh_dimension_the_device_job_gives_the_host_librarys_outputs() {
        // The dp dimension of a (dp, 2) mesh on 2 nodes x 2: ranks of one
        // local rank, one per node (nodes 2 x 1), and HSDP's replicate
        // dimension is the same set. Host first, then the device job.
        let got = on_world(2, 2, Duration::from_secs(30), |r| {
            let ranks: Vec<usize> = vec![r.layout.local(), 2 + r.layout.local()];
            let l = r.layout.of_ranks(&ranks).unwrap();
            let mut made: Vec<(Vec<usize>, Arc<zeropp_comm::Group>)> = Vec::new();
            let groups = ZeroGroups::of_ranks(&l, &ranks, |set| {
                if let Some((_, g)) = made.iter().find(|(s, _)| *s == set) {
                    return Ok(g.clone());
                }
                let kind = zeropp_comm::GroupKind::Agreed(set[0] * 10 + set.len());
                let g = Arc::new(zeropp_comm::Group::new(kind, set.clone())?);
                made.push((set, g.clone()));
                Ok(g)
            })
            .unwrap();
            let shard = bf16s(&values(r.layout.rank + 3, 96));
            let grad = values(r.layout.rank, 2 * 96);
            let q = |hadamard| allreduce::QuantizedAllReduce {
                format: zeropp_quant::QuantFormat::int4(64).unwrap(),
                rounding: Rounding::NearestEven,
                hadamard,
            };
            let qwz = crate::testing::every_weight_wire(8, 64)[1].for_call(true, true);
            let mut outs = Vec::new();
            let m = HostMover {
                groups: groups.clone(),
                ..r.mover()
            };
            for how in [WeightWire::F32, qwz] {
                let mut out = vec![bf16::ZERO; 2 * 96];
                let (x, mut o) = (&shard[..], &mut out[..]);
                let p = Phase::ForwardGather;
                fsdp::all_gather(&Host, &m, l, Hop::World, how, p, None, &x, &mut o).unwrap();
                outs.push(bits(&out));
            }
            let mut out = vec![0f32; 96];
            let (x, mut o) = (&grad[..], &mut out[..]);
            let (ring, call) = (GradWire::RingF32, plain_call());
            fsdp::reduce_scatter(&Host, &m, l, ring, call, Reduction::Mean, &x, &mut o).unwrap();
            outs.push(f32_bits(&out));
            let mut fb = DeviceFeedback::<QuantizedChunks>::default();
            for _ in 0..2 {
                let mut buf = grad.clone();
                let f = fb.feedback(&Host, (true, true)).unwrap();
                let f = allreduce::ReplicaFeedback {
                    sent: f.first,
                    owned: f.second,
                };
                let hop = (Hop::World, Phase::Replicate);
                let (x, mut o) = (&grad[..], &mut buf[..]);
                allreduce::all_reduce(&Host, &m, hop, q(true), Reduction::Mean, f, &x, &mut o)
                    .unwrap();
                outs.push(f32_bits(&buf));
            }
            let host = outs;

            let job = emulated_job(&r);
            let g = &groups;
            job.connect_dim(ranks.clone(), l, &g.world, &g.node, &g.cross)
                .unwrap();
            assert!(job.has_group(&ranks).unwrap());
            let mut outs = Vec::new();
            for how in [WeightWire::F32, qwz] {
                let mut out = vec![bf16::ZERO; 2 * 96];
                let p = Phase::ForwardGather;
                gather(&job, &shard, (&mut out, l.rank), &ranks, how, p, None);
                outs.push(bits(&out));
            }
            let mut out = vec![0f32; 96];
            let c = DeviceScatter {
                out: out.as_mut_ptr() as u64,
                inp: grad.as_ptr() as u64,
                numel: grad.len(),
                ranks: &ranks,
                stream: 0,
                reduction: Reduction::Mean,
                wire: GradWire::RingF32,
                rounding: Rounding::NearestEven,
                feedback: None,
            };
            // SAFETY: `grad` holds `numel` values, `out` a half of them.
            unsafe { job.reduce_scatter::<f32>(c) }.unwrap();
            outs.push(f32_bits(&out));
            let mut fb = DeviceFeedback::<QuantizedChunks>::default();
            for _ in 0..2 {
                let mut buf = grad.clone();
                let c = DeviceAllReduce {
                    buf: buf.as_mut_ptr() as u64,
                    numel: buf.len(),
                    ranks: &ranks,
                    stream: 0,
                    reduction: Reduction::Mean,
                    quantized: (q(true), true, &mut fb),
                };
                // SAFETY: `buf` holds `numel` values, this call's alone.
                unsafe { job.all_reduce::<f32>(c) }.unwrap();
                outs.push(f32_bits(&buf));
            }
            (host, outs)
        });
        for (rank, (host, device)) in got.iter().enumerate() {
            assert_eq!(host.len(), device.len());
            for (i, (h, d)) in host.iter().zip(device).enumerate() {
                assert_eq!(
                    h, d,
                    "rank {rank}, call {i}: the device job differs from the host"
                );
            }
        }
        // The replicas of the all-reduce agree: ranks 0 and 2, 1 and 3.
        assert_eq!(got[0].1[3], got[2].1[3]);
        assert_eq!(got[1].1[4], got[3].1[4]);
    }

    #[test]
    fn a_dead_rank_is_named_and_the_job_refuses_to_go_on() {
        let timeout = Duration::from_secs(10);
        let started = Instant::now();
        let got = on_world(2, 1, timeout, |r| {
            let job = emulated_job(&r);
            if r.layout.rank == 1 {
                // Rank 1 dies: its transport closes with its thread.
                return None;
            }
            let x = [1f32; 4];
            let mut out = [0f32; 8];
            let ranks = [0, 1];
            let mut gather = || {
                let c = DeviceGather {
                    out: out.as_mut_ptr() as u64,
                    inp: x.as_ptr() as u64,
                    numel: 4,
                    ranks: &ranks,
                    stream: 0,
                    how: WeightWire::F32,
                    phase: Phase::ForwardGather,
                    slot: None,
                };
                // SAFETY: `x` holds 4 values, `out` 8.
                unsafe { job.all_gather::<f32>(c) }.unwrap_err()
            };
            let first = gather();
            let next = gather();
            Some((first.is_peer_failure(), first.to_string(), next.to_string()))
        });
        let (peer, first, next) = got[0].clone().unwrap();
        assert!(peer, "{first}");
        assert!(first.contains("rank 1"), "{first}");
        assert!(
            next.contains("rank 1") && next.contains("cannot continue"),
            "{next}"
        );
        assert!(started.elapsed() < timeout, "named within the deadline");
    }

    type EmulatedWork = Work<crate::emulated::EmulatedQueue>;

    /// A plain gather of `x` over the world into `out`, launched on the
    /// job's queue (the buffers live in the call until it ran).
    fn launch_gather(
        job: &Arc<DeviceJob<EmulatedDevice>>,
        x: Arc<Vec<f32>>,
        out: Arc<Mutex<Vec<f32>>>,
    ) -> EmulatedWork {
        let ranks: Vec<usize> = (0..job.layout().world()).collect();
        let call = move |job: &DeviceJob<EmulatedDevice>| {
            let mut o = out.lock().unwrap();
            let c = DeviceGather {
                out: o.as_mut_ptr() as u64,
                inp: x.as_ptr() as u64,
                numel: x.len(),
                ranks: &ranks,
                stream: 0,
                how: WeightWire::F32,
                phase: Phase::ForwardGather,
                slot: None,
            };
            // SAFETY: `x` holds `numel` values, `out` the world's times.
            unsafe { job.all_gather::<f32>(c) }
        };
        // SAFETY: the buffers live in the call.
        unsafe { job.launch(0, call) }.unwrap()
    }

    #[test]
    fn a_launched_collective_returns_before_it_completes_and_its_wait_orders_it() {
        let got = on_world(2, 1, Duration::from_secs(10), |r| {
            let job = Arc::new(emulated_job(&r));
            let rank = r.layout.rank;
            if rank == 1 {
                // Rank 0's calls cannot finish before rank 1 joins them.
                std::thread::sleep(Duration::from_millis(600));
            }
            let x = Arc::new(vec![rank as f32 + 1.0; 4]);
            let outs: Vec<_> = (0..2)
                .map(|_| Arc::new(Mutex::new(vec![0f32; 8])))
                .collect();
            let started = Instant::now();
            let first = launch_gather(&job, x.clone(), outs[0].clone());
            let second = launch_gather(&job, x, outs[1].clone());
            let returned = started.elapsed();
            let both_pending = !first.is_completed().unwrap() && !second.is_completed().unwrap();
            // The caller's thread goes on while they run.
            let mut polls = 0;
            while !first.is_completed().unwrap() {
                polls += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            // SAFETY: the emulated device's stream is its queue.
            unsafe { first.wait(0) }.unwrap();
            unsafe { second.wait(0) }.unwrap();
            let outs: Vec<Vec<f32>> = outs.iter().map(|o| o.lock().unwrap().clone()).collect();
            (returned, both_pending, polls, outs)
        });
        let (returned, both_pending, polls, _) = &got[0];
        assert!(*returned < Duration::from_millis(300), "{returned:?}");
        assert!(*both_pending, "two gathers in flight at once");
        assert!(*polls > 10, "{polls}");
        let expect = [1f32, 1., 1., 1., 2., 2., 2., 2.];
        for (_, _, _, outs) in &got {
            assert!(outs.iter().all(|o| o[..] == expect), "{outs:?}");
        }
    }

    /// A qgZ reduce-scatter of `grad` over the world, launched on the
    /// job's queue (a value that is not finite is found there, after the
    /// launch returned).
    fn launch_qgz_scatter(job: &Arc<DeviceJob<EmulatedDevice>>, grad: Vec<f32>) -> EmulatedWork {
        let world: Vec<usize> = (0..job.layout().world()).collect();
        let mut feedback = DeviceFeedback::default();
        let call = move |job: &DeviceJob<EmulatedDevice>| {
            let mut out = vec![0f32; grad.len() / world.len()];
            let c = DeviceScatter {
                out: out.as_mut_ptr() as u64,
                inp: grad.as_ptr() as u64,
                numel: grad.len(),
                ranks: &world,
                stream: 0,
                reduction: Reduction::Mean,
                wire: qgz_wire(),
                rounding: Rounding::NearestEven,
                feedback: Some(&mut feedback),
            };
            // SAFETY: `grad` holds `numel` values, `out` a W-th.
            unsafe { job.reduce_scatter::<f32>(c) }
        };
        // SAFETY: the buffers live in the call.
        unsafe { job.launch(0, call) }.expect("launched: a NaN is not seen yet")
    }

    #[test]
    fn an_error_found_after_the_call_returned_surfaces_at_wait() {
        let got = on_world(2, 2, Duration::from_secs(10), |r| {
            let job = Arc::new(emulated_job(&r));
            let mut grad = values(r.layout.rank, LEN);
            grad[7] = f32::NAN;
            let work = launch_qgz_scatter(&job, grad);
            unsafe { work.wait(0) }.unwrap_err().to_string()
        });
        for e in &got {
            assert!(e.contains("finite"), "{e}");
        }
    }

    #[test]
    fn a_nan_on_one_rank_is_named_by_every_other_rank_at_once() {
        // Rank 3's gradient holds a NaN: its qgZ reduce-scatter fails
        // before it sends anything, and it lingers (as an `except` that
        // saves a checkpoint would). The others, waiting on it, hear why
        // at once instead of at their deadline.
        let timeout = Duration::from_secs(20);
        let got = on_world(2, 2, timeout, move |r| {
            let job = Arc::new(emulated_job_within(&r, timeout));
            let rank = r.layout.rank;
            let mut grad = values(rank, LEN);
            if rank == 3 {
                grad[7] = f32::NAN;
            }
            let started = Instant::now();
            let work = launch_qgz_scatter(&job, grad);
            let e = unsafe { work.wait(0) }.unwrap_err();
            let took = started.elapsed();
            if rank == 3 {
                std::thread::sleep(Duration::from_secs(6));
            }
            (e.is_peer_failure(), e.to_string(), took)
        });
        let (peer, own, _) = &got[3];
        assert!(!peer && own.contains("finite"), "{own}");
        for (peer, e, took) in &got[..3] {
            assert!(*peer && e.contains("rank 3") && e.contains("finite"), "{e}");
            assert!(*took < Duration::from_secs(2), "waited {took:?}: {e}");
        }
    }

    #[test]
    fn a_call_stuck_past_the_deadline_is_ended_by_the_watchdog_and_the_job_refuses_the_next() {
        let timeout = Duration::from_secs(1);
        let got = on_world(1, 2, Duration::from_secs(10), move |r| {
            let job = Arc::new(emulated_job_within(&r, timeout));
            let stuck = |_: &DeviceJob<EmulatedDevice>| {
                std::thread::sleep(Duration::from_secs(3));
                Ok(())
            };
            let started = Instant::now();
            // SAFETY: the call touches no buffer.
            let work = unsafe { job.launch(0, stuck) }.unwrap();
            let e = unsafe { work.wait(0) }.unwrap_err();
            let ended = started.elapsed();
            let next = unsafe { job.launch(0, |_| Ok(())) }
                .err()
                .map(|e| e.to_string());
            (e.is_peer_failure(), e.to_string(), ended, next)
        });
        for (peer, e, ended, next) in got {
            assert!(peer && e.contains("watchdog"), "{e}");
            // The deadline and 1 s to name the stuck peer, not the call's 3 s.
            assert!(ended < Duration::from_millis(2700), "{ended:?}");
            let next = next.expect("the next call is refused");
            assert!(
                next.contains("watchdog") && next.contains("cannot continue"),
                "{next}"
            );
        }
    }
}
