//! What a device job ([`crate::device_job`]) runs on, written by each
//! device: the [`Device`] trait (zeropp's kernels on the device's memory,
//! a communicator per group, the caller's pointers and stream), the
//! communicators of one mesh dimension ([`Comms`]), and the names of a
//! device's buffers. The CUDA device ([`crate::device`]) and the emulated
//! device ([`crate::emulated`]) implement it beside their kernels; the job
//! above them calls the collectives.

use std::time::Duration;

use zeropp_comm::CommError;
use zeropp_cuda::GpuElement;

use crate::error::ZeroError;
use crate::layout::Layout;
use crate::traffic::CountingTransport;
use crate::work::Queue;
use crate::{ByteMover, Hop, Quantizer};

/// A caller's tensor of `T` on device `D`, to read.
pub type TensorOf<'a, D, T> = <<D as Device>::Kernels as Quantizer>::Tensor<'a, T>;
/// A caller's tensor of `T` on device `D`, to write.
pub type TensorMutOf<'a, D, T> = <<D as Device>::Kernels as Quantizer>::TensorMut<'a, T>;
/// f32 values on device `D`.
pub type ValuesOf<D> = <<D as Device>::Kernels as Quantizer>::Values;
/// A device's kept values (`Quantizer::Kept`).
pub type KeptOf<D> = <<D as Device>::Kernels as Quantizer>::Kept;
/// Quantized chunks on device `D`.
pub type ChunksOf<D> = <<D as Device>::Kernels as Quantizer>::Chunks;

/// What a device job runs on: zeropp's kernels on the device's memory, a
/// communicator per group, and the caller's pointers and stream.
pub trait Device {
    /// The kernels, on this device's memory.
    type Kernels: Quantizer;
    /// A communicator: one group's members, joined.
    type Comm;
    /// What a communicator's members share to join it (made by its first
    /// member).
    type Id: ?Sized;
    /// The byte mover of one call.
    type Mover<'a>: ByteMover<Self::Kernels>
    where
        Self: 'a;
    /// The order of the device's work: where a call runs and what marks
    /// its end ([`Queue`]).
    type Queue: Queue;

    fn kernels(&self) -> &Self::Kernels;

    /// This device's queue.
    fn queue(&self) -> Self::Queue;

    /// Joins the communicator `id` as member `rank` of `size`.
    fn join(
        &self,
        id: &Self::Id,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<Self::Comm, ZeroError>;

    /// Ends `comm` after a failure: its work stops holding the stream and
    /// none waits for the dead at exit.
    fn abort(comm: &Self::Comm);

    /// Tells the other members of `comm` that this rank gives up its next
    /// call there after `e` (a failure of its own, or one it heard of),
    /// so that one waiting on it fails at once instead of at its deadline
    /// ([`ZeroError::with_notice`] makes `e`).
    fn give_up(&self, comm: &Self::Comm, e: &CommError);

    /// The device and `comms` queue their work on `stream` from now on.
    ///
    /// # Safety
    /// `stream` is a live stream of this device (the caller's current
    /// one), live for the call it is passed to.
    unsafe fn use_stream(&mut self, stream: usize, comms: &Comms<Self::Comm>);

    /// The byte mover of a call over `comms` (one mesh dimension's, laid
    /// out as `comms.layout`), with hpZ's group `hpz` (its communicator and
    /// global ranks); `rank` is this rank in the whole job.
    fn mover<'a>(
        &'a self,
        comms: &'a Comms<Self::Comm>,
        rank: usize,
        counter: &'a CountingTransport,
        hpz: (&'a Self::Comm, &'a [usize]),
    ) -> Self::Mover<'a>;

    /// `f` on the caller's tensors: `inp.1` values of `T` at address
    /// `inp.0`, `out.1` at `out.0`.
    ///
    /// # Safety
    /// Both addresses hold that many values of `T` in this device's memory,
    /// `out` not overlapping `inp`, untouched by anything else until the
    /// call returns.
    unsafe fn with_tensors<T: GpuElement>(
        &self,
        inp: (u64, usize),
        out: (u64, usize),
        f: impl FnOnce(&TensorOf<'_, Self, T>, &mut TensorMutOf<'_, Self, T>) -> Result<(), ZeroError>,
    ) -> Result<(), ZeroError>;
}

/// The communicators of one mesh dimension's groups (the whole job's
/// first): its world, this rank's node and cross groups in it, and hpZ
/// groups smaller than its node.
pub struct Comms<C> {
    pub world: C,
    pub node: C,
    pub cross: C,
    /// The global ranks of `world`, `node` and `cross`, in member order.
    pub ranks: [Vec<usize>; 3],
    /// The dimension's layout (this rank's position in it).
    pub layout: Layout,
    /// hpZ groups smaller than the node, by their global ranks.
    pub subgroups: Vec<(Vec<usize>, C)>,
}

impl<C> Comms<C> {
    pub fn all(&self) -> impl Iterator<Item = &C> {
        let subgroups = self.subgroups.iter().map(|(_, c)| c);
        [&self.world, &self.node, &self.cross]
            .into_iter()
            .chain(subgroups)
    }

    /// The communicator of group `ranks` in this dimension and the hop it
    /// plays: the dimension itself (the world), or its node or a sub-group
    /// of it (hpZ's group, which a gather over it runs as).
    pub(crate) fn of(&self, ranks: &[usize]) -> Option<(Hop, &C)> {
        if ranks == self.ranks[0] {
            return Some((Hop::World, &self.world));
        }
        if ranks == self.ranks[1] {
            return Some((Hop::Hpz, &self.node));
        }
        self.subgroups
            .iter()
            .find(|(r, _)| r == ranks)
            .map(|(_, c)| (Hop::Hpz, c))
    }

    /// Whether `ranks` is a run of this dimension's node that includes
    /// `rank` (an hpZ group smaller than the node).
    pub(crate) fn has_run(&self, ranks: &[usize], rank: usize) -> bool {
        let node = &self.ranks[1];
        let start = ranks.first().and_then(|f| node.iter().position(|r| r == f));
        matches!(start, Some(p) if node.get(p..p + ranks.len()) == Some(ranks))
            && ranks.contains(&rank)
    }
}
