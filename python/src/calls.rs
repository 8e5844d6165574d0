//! zeropp.torch's three collectives described once for every job class
//! (the host `Job`, `CudaJob`, `EmulatedJob`): what FSDP2 or HSDP asks
//! (the dtype, the group, the reduction) and how the call moves (its
//! plan's wire for this call, its state's rounding and references),
//! decided and checked when it is called. Each class adds only where the
//! call's memory is (host buffers; device addresses and a stream) and
//! where its state is held.

use std::sync::{Mutex, MutexGuard};

use zeropp_quant::Rounding;
use zeropp_zero::ZeroError;
use zeropp_zero::delta::Reference;
use zeropp_zero::fsdp::{GradWire, WeightWire};
use zeropp_zero::qgz::Reduction;
use zeropp_zero::traffic::Phase;

use crate::buffers::Dtype;
use crate::state::{Plan, QgzState};

/// A parameter group's qwZ references where its job keeps them (none
/// before the first gather).
type Held<K, C> = Option<Reference<K, C>>;

/// FSDP2's all-gather: shards of `dtype` over the group `ranks` (a mesh
/// dimension, or hpZ's sub-group inside a node), moved as the parameter
/// group's plan says for this call, counted as `phase`.
pub(crate) struct Gather {
    pub dtype: Dtype,
    pub ranks: Vec<usize>,
    pub how: WeightWire,
    pub phase: Phase,
}

impl Gather {
    /// The gather `plan` makes of a call over a mesh dimension
    /// (`over_world`) or a sub-group; `with_references`: the caller passed
    /// the group's qwZ references (a plan of weight differences needs
    /// them); `backward`: the backward gather's.
    pub(crate) fn new(
        dtype: Dtype,
        ranks: Vec<usize>,
        over_world: bool,
        plan: &Plan,
        (backward, with_references): (bool, bool),
    ) -> Result<Gather, ZeroError> {
        let how = plan.gather(over_world, dtype == Dtype::Bf16, with_references)?;
        Ok(Gather {
            dtype,
            ranks,
            how,
            phase: Phase::gather(backward),
        })
    }

    /// The group's references in `held` (where the caller's job keeps
    /// them), locked, where this call gathers weight differences against
    /// them.
    pub(crate) fn reference<'a, K, C>(
        &self,
        held: Option<&'a Mutex<Held<K, C>>>,
    ) -> Result<Option<MutexGuard<'a, Held<K, C>>>, ZeroError> {
        match (held, self.how) {
            (Some(r), WeightWire::Delta(_)) => r
                .lock()
                .map(Some)
                .map_err(|_| ZeroError::Poisoned("qwZ reference")),
            _ => Ok(None),
        }
    }
}

/// FSDP2's reduce-scatter: a gradient of `dtype` over the mesh dimension
/// `ranks` (one equal chunk per member), summed or averaged.
pub(crate) struct Scatter {
    pub dtype: Dtype,
    pub ranks: Vec<usize>,
    pub reduction: Reduction,
}

impl Scatter {
    pub(crate) fn new(dtype: Dtype, ranks: Vec<usize>, mean: bool) -> Scatter {
        Scatter {
            dtype,
            ranks,
            reduction: Reduction::mean_if(mean),
        }
    }

    /// This call's wire: qgZ's, as the parameter group's state holds it,
    /// or a ring in the tensor's dtype (`GradWire::for_call`).
    pub(crate) fn wire(&self, qgz: Option<&QgzState>) -> GradWire {
        let ring = GradWire::RingF32.for_call(self.dtype == Dtype::Bf16);
        qgz.map_or(ring, QgzState::wire)
    }

    /// This call's rounding on `rank`: qgZ's group's next
    /// (`QgzState::rounding`, counted per call: ask once per call, when
    /// it runs), or to nearest on a ring.
    pub(crate) fn rounding(qgz: Option<&QgzState>, rank: usize) -> Rounding {
        qgz.map_or(Rounding::NearestEven, |s| s.rounding(rank))
    }
}

/// HSDP's all-reduce across its replicate dimension `ranks`: a buffer of
/// `dtype`, in place, summed or averaged.
pub(crate) struct AllReduce {
    pub dtype: Dtype,
    pub ranks: Vec<usize>,
    pub reduction: Reduction,
}

impl AllReduce {
    pub(crate) fn new(dtype: Dtype, ranks: Vec<usize>, mean: bool) -> AllReduce {
        AllReduce {
            dtype,
            ranks,
            reduction: Reduction::mean_if(mean),
        }
    }
}
