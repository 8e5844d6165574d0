//! The device path's calls, written once for every device
//! (`zeropp_zero::device_job::DeviceJob` on CUDA, `CudaJob`, or on the
//! emulated device, `EmulatedJob`): FSDP2's all-gather and reduce-scatter,
//! and HSDP's all-reduce across the replicate dimension, on the caller's
//! device addresses, with the parameter group's state (qwZ references, qgZ
//! and the all-reduce's error feedback) held on that device.

use std::sync::Mutex;

use pyo3::prelude::*;
use zeropp_cuda::Gpu;
use zeropp_quant::QuantizedChunks;
use zeropp_zero::Hop;
use zeropp_zero::ZeroError;
use zeropp_zero::delta::{ReferenceOf, Slot};
use zeropp_zero::device_job::{
    ChunksOf, Device, DeviceAllReduce, DeviceFeedback, DeviceGather, DeviceJob, DeviceScatter,
};
use zeropp_zero::emulated::EmulatedDevice;
use zeropp_zero::work::{Queue, Work};

use crate::buffers::{Dtype, HostBuf, with_dtype};
use crate::calls::{AllReduce, Gather, Scatter};
use crate::state::{AllReduceState, Plan, QgzState, QwzReference};
use crate::{Raised, invalid, to_py};

/// Where a device keeps a parameter group's state.
pub(crate) trait DeviceState: Device + Sized {
    /// qgZ's error feedback on this device.
    fn feedback(s: &QgzState) -> &Mutex<DeviceFeedback<ChunksOf<Self>>>;
    /// qwZ's references on this device.
    fn reference(r: &QwzReference) -> &Mutex<Option<ReferenceOf<Self::Kernels>>>;
    /// The replicate all-reduce's error feedback on this device.
    fn replica_feedback(s: &AllReduceState) -> &Mutex<DeviceFeedback<ChunksOf<Self>>>;
}

impl DeviceState for Gpu {
    fn feedback(
        s: &QgzState,
    ) -> &Mutex<DeviceFeedback<zeropp_cuda::device::DeviceQuantizedChunks>> {
        &s.feedback.device
    }

    fn reference(r: &QwzReference) -> &Mutex<Option<ReferenceOf<Gpu>>> {
        &r.device
    }

    fn replica_feedback(
        s: &AllReduceState,
    ) -> &Mutex<DeviceFeedback<zeropp_cuda::device::DeviceQuantizedChunks>> {
        &s.feedback.device
    }
}

impl DeviceState for EmulatedDevice {
    fn feedback(s: &QgzState) -> &Mutex<DeviceFeedback<QuantizedChunks>> {
        &s.feedback.emulated
    }

    /// The emulated device's memory is the host's: the host path's
    /// references (one process sends CPU tensors down one path).
    fn reference(r: &QwzReference) -> &Mutex<Option<ReferenceOf<zeropp_zero::host::Host>>> {
        &r.reference
    }

    fn replica_feedback(s: &AllReduceState) -> &Mutex<DeviceFeedback<QuantizedChunks>> {
        &s.feedback.emulated
    }
}

/// Where a call's memory is on the device: `numel` values at `inp` into
/// `out` (the same address for an all-reduce, in place; `numel` is the
/// input's count), in the order of the caller's stream `stream`.
pub(crate) struct At {
    pub out: u64,
    pub inp: u64,
    pub numel: usize,
    pub stream: usize,
}

/// FSDP2's all-gather on `job`'s device, with `delta`'s references there.
///
/// # Safety
/// `at.inp` holds `at.numel` values of `c.dtype` and `at.out` the group's
/// size times as many, in the device's memory, untouched by anything else
/// until the call returns; `at.stream` is a live stream of the device.
pub(crate) unsafe fn all_gather<D: DeviceState>(
    job: &DeviceJob<D>,
    (c, at): (&Gather, &At),
    delta: Option<&QwzReference>,
) -> Result<(), ZeroError> {
    let mut reference = c.reference(delta.map(D::reference))?;
    let frozen = delta.map(|d| d.frozen_ranges()).unwrap_or_default();
    let on_host = delta.is_some_and(|d| d.host_references);
    let call = DeviceGather {
        out: at.out,
        inp: at.inp,
        numel: at.numel,
        ranks: &c.ranks,
        stream: at.stream,
        how: c.how,
        phase: c.phase,
        slot: reference.as_deref_mut().map(|reference| Slot {
            reference,
            frozen: &frozen,
            on_host,
        }),
    };
    // SAFETY: the caller's promise.
    unsafe { with_dtype!(c.dtype, T => job.all_gather::<T>(call)) }
}

/// FSDP2's reduce-scatter over the world on `job`'s device: the
/// communicator's own, or qgZ with `qgz`'s settings and its error feedback
/// there.
///
/// # Safety
/// As [`all_gather`]: `at.inp` holds `at.numel` values, `at.out` a W-th.
pub(crate) unsafe fn reduce_scatter<D: DeviceState>(
    job: &DeviceJob<D>,
    (c, at): (&Scatter, &At),
    qgz: Option<&QgzState>,
) -> Result<(), ZeroError> {
    let rank = job.layout().rank;
    let mut feedback = qgz
        .map(|s| D::feedback(s).lock())
        .transpose()
        .map_err(|_| ZeroError::Poisoned("error-feedback buffer"))?;
    let call = DeviceScatter {
        out: at.out,
        inp: at.inp,
        numel: at.numel,
        ranks: &c.ranks,
        stream: at.stream,
        reduction: c.reduction,
        wire: c.wire(qgz),
        rounding: Scatter::rounding(qgz, rank),
        feedback: feedback.as_deref_mut(),
    };
    // SAFETY: the caller's promise.
    unsafe { with_dtype!(c.dtype, T => job.reduce_scatter::<T>(call)) }
}

/// HSDP's quantized all-reduce across the replicate dimension on `job`'s
/// device, with `state`'s settings and its error feedback there.
///
/// # Safety
/// `at.out` (= `at.inp`) holds `at.numel` values of `c.dtype` in the
/// device's memory, untouched by anything else until the call returns;
/// `at.stream` is a live stream of the device.
pub(crate) unsafe fn all_reduce<D: DeviceState>(
    job: &DeviceJob<D>,
    (c, at): (&AllReduce, &At),
    state: &AllReduceState,
) -> Result<(), ZeroError> {
    let mut feedback = D::replica_feedback(state)
        .lock()
        .map_err(|_| ZeroError::Poisoned("error-feedback buffer"))?;
    let settings = state.settings(job.layout().rank);
    let call = DeviceAllReduce {
        buf: at.out,
        numel: at.numel,
        ranks: &c.ranks,
        stream: at.stream,
        reduction: c.reduction,
        quantized: (settings, state.error_feedback, &mut feedback),
    };
    // SAFETY: the caller's promise.
    unsafe { with_dtype!(c.dtype, T => job.all_reduce::<T>(call)) }
}

/// A caller's memory as a device call takes it: its address on the device,
/// and on the emulated device the host buffer holding it, which the call
/// keeps until its work is done.
pub(crate) struct Memory {
    pub address: u64,
    pub _held: Option<HostBuf>,
}

/// What a device's Python class adds to the calls written once below: how
/// a caller's memory arrives (a CUDA address; a host buffer) and how a call
/// is launched in the order of the caller's stream.
pub(crate) trait Binding {
    type D: DeviceState;

    fn job(&self) -> &DeviceJob<Self::D>;

    /// `obj` (what zeropp.torch passes for a tensor) as memory holding
    /// `numel` values of `dtype`.
    fn memory(
        &self,
        obj: &Bound<'_, PyAny>,
        writable: bool,
        what: &str,
        numel: usize,
        dtype: Dtype,
    ) -> PyResult<Memory>;

    /// Launches `call` in the order of `stream` (`DeviceJob::launch`).
    fn launch(
        &self,
        py: Python<'_>,
        stream: usize,
        call: impl FnOnce(&DeviceJob<Self::D>) -> Result<(), ZeroError> + Send + 'static,
    ) -> PyResult<DeviceWork>;
}

/// Where a `what` call's `(out, inp)` are, as `b`'s device takes them:
/// `sizes` (input, output) values of `dtype`, on `stream`; and the memory
/// the call holds until its work is done.
fn at<B: Binding>(
    b: &B,
    (out, inp): (&Bound<'_, PyAny>, &Bound<'_, PyAny>),
    (numel, out_numel): (usize, usize),
    (dtype, stream): (Dtype, usize),
    what: &str,
) -> PyResult<(At, [Memory; 2])> {
    let inp = b.memory(inp, false, &format!("{what} input"), numel, dtype)?;
    let out = b.memory(out, true, &format!("{what} output"), out_numel, dtype)?;
    let at = At {
        out: out.address,
        inp: inp.address,
        numel,
        stream,
    };
    Ok((at, [inp, out]))
}

/// FSDP2's all-gather through a device's class (`device_calls!`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn all_gather_call<B: Binding>(
    b: &B,
    py: Python<'_>,
    (out, inp): (&Bound<'_, PyAny>, &Bound<'_, PyAny>),
    numel: usize,
    dtype: &str,
    ranks: Vec<usize>,
    stream: usize,
    plan: &Plan,
    backward: bool,
    delta: Option<Py<QwzReference>>,
) -> PyResult<DeviceWork>
where
    DeviceJob<B::D>: Sync,
{
    let d = Dtype::parse(dtype)?;
    let job = b.job();
    if !py.detach(|| job.has_group(&ranks)).map_err(to_py)? {
        return Err(invalid(format!(
            "all-gather over ranks {ranks:?}: no communicator for them; zeropp gathers over \
             the world or over consecutive ranks of one node, joined with add_group first"
        )));
    }
    let over_world = py.detach(|| job.hop_of(&ranks)).map_err(to_py)? == Some(Hop::World);
    let size = ranks.len();
    let with = (backward, delta.is_some());
    let call = Gather::new(d, ranks, over_world, plan, with).map_err(to_py)?;
    let sizes = (numel, numel * size);
    let (at, held) = at(b, (out, inp), sizes, (d, stream), "all-gather")?;
    b.launch(py, stream, move |job| {
        let _held = &held;
        // SAFETY: `inp` and `out` hold these sizes in the device's memory
        // (zeropp.torch passes FSDP2's live buffers, kept until the Work
        // is waited for; host buffers are held by this closure) and
        // `stream` is the caller's current stream of the device.
        unsafe { all_gather(job, (&call, &at), delta.as_ref().map(|d| d.get())) }
    })
}

/// FSDP2's reduce-scatter through a device's class (`device_calls!`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn reduce_scatter_call<B: Binding>(
    b: &B,
    py: Python<'_>,
    (out, inp): (&Bound<'_, PyAny>, &Bound<'_, PyAny>),
    numel: usize,
    dtype: &str,
    ranks: Vec<usize>,
    stream: usize,
    mean: bool,
    qgz: Option<Py<QgzState>>,
) -> PyResult<DeviceWork> {
    let call = Scatter::new(Dtype::parse(dtype)?, ranks, mean);
    let sizes = (numel, numel / call.ranks.len().max(1));
    let (at, held) = at(b, (out, inp), sizes, (call.dtype, stream), "reduce-scatter")?;
    b.launch(py, stream, move |job| {
        let _held = &held;
        // SAFETY: as in `all_gather_call`.
        unsafe { reduce_scatter(job, (&call, &at), qgz.as_ref().map(|q| q.get())) }
    })
}

/// HSDP's all-reduce through a device's class (`device_calls!`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn all_reduce_call<B: Binding>(
    b: &B,
    py: Python<'_>,
    buf: &Bound<'_, PyAny>,
    numel: usize,
    dtype: &str,
    ranks: Vec<usize>,
    stream: usize,
    mean: bool,
    state: Py<AllReduceState>,
) -> PyResult<DeviceWork> {
    let call = AllReduce::new(Dtype::parse(dtype)?, ranks, mean);
    let buf = b.memory(buf, true, "all-reduce buffer", numel, call.dtype)?;
    let at = At {
        out: buf.address,
        inp: buf.address,
        numel,
        stream,
    };
    b.launch(py, stream, move |job| {
        let _held = &buf;
        // SAFETY: as in `all_gather_call`, for the one buffer.
        unsafe { all_reduce(job, (&call, &at), state.get()) }
    })
}

/// The calls both device classes (`CudaJob`, `EmulatedJob`) declare, one
/// signature each, around the class's own methods (`$own`): what they do
/// is written once above, over the class's [`Binding`]. zeropp.torch
/// passes a tensor as its CUDA address (`data_ptr()`) or, on the emulated
/// device, as a host buffer.
macro_rules! device_calls {
    ($ty:ident { $($own:tt)* }) => {
        #[pymethods]
        impl $ty {
            $($own)*

            /// Whether group `ranks` has a communicator (a mesh dimension,
            /// its node, or an added sub-group).
            fn has_group(&self, py: Python<'_>, ranks: Vec<usize>) -> PyResult<bool> {
                use $crate::device::Binding;
                py.detach(|| self.job().has_group(&ranks)).map_err($crate::to_py)
            }

            /// Whether the mesh dimension over `ranks` is joined
            /// (`connect_dim`).
            fn has_dim(&self, py: Python<'_>, ranks: Vec<usize>) -> PyResult<bool> {
                use $crate::device::Binding;
                py.detach(|| self.job().has_dim(&ranks)).map_err($crate::to_py)
            }

            /// FSDP2's all-gather on the device: `numel` values of `dtype`
            /// at `inp` (this rank's shard) into `out` (every member's,
            /// group order) over `ranks`, on stream `stream`, moved as the
            /// group's `plan` says (`zero::fsdp::all_gather`, as on the
            /// host); `delta`: the group's qwZ references. `backward`
            /// counts the bytes as the backward gather's.
            #[pyo3(signature = (out, inp, numel, dtype, ranks, stream, plan, backward=false,
                                delta=None))]
            #[allow(clippy::too_many_arguments)]
            fn all_gather(
                &self,
                py: Python<'_>,
                out: &Bound<'_, PyAny>,
                inp: &Bound<'_, PyAny>,
                numel: usize,
                dtype: &str,
                ranks: Vec<usize>,
                stream: usize,
                plan: PyRef<'_, $crate::state::Plan>,
                backward: bool,
                delta: Option<Py<$crate::state::QwzReference>>,
            ) -> PyResult<$crate::device::DeviceWork> {
                $crate::device::all_gather_call(
                    self, py, (out, inp), numel, dtype, ranks, stream, &plan, backward, delta,
                )
            }

            /// FSDP2's gradient reduce-scatter over the mesh dimension
            /// `ranks` on the device: `numel` values of `dtype` at `inp`
            /// (one equal chunk per member) into `out` (this rank's
            /// chunk), on stream `stream`. Without `qgz` the
            /// communicator's sum in `dtype`, or (`mean`) its average;
            /// with `qgz` the two-hop quantized reduce-scatter (f32 sums,
            /// rounded to `dtype` once) with that state's error feedback.
            /// Both are `zero::fsdp::reduce_scatter`, as on the host.
            #[pyo3(signature = (out, inp, numel, dtype, ranks, stream, mean, qgz=None))]
            #[allow(clippy::too_many_arguments)]
            fn reduce_scatter(
                &self,
                py: Python<'_>,
                out: &Bound<'_, PyAny>,
                inp: &Bound<'_, PyAny>,
                numel: usize,
                dtype: &str,
                ranks: Vec<usize>,
                stream: usize,
                mean: bool,
                qgz: Option<Py<$crate::state::QgzState>>,
            ) -> PyResult<$crate::device::DeviceWork> {
                $crate::device::reduce_scatter_call(
                    self, py, (out, inp), numel, dtype, ranks, stream, mean, qgz,
                )
            }

            /// HSDP's all-reduce across the mesh dimension `ranks` (its
            /// replicate one) on the device, quantized with `state` (int4
            /// blocks, f32 sums, error feedback kept on the device):
            /// `numel` values of `dtype` at `buf`, in place, on stream
            /// `stream`; the sum or (`mean`) the mean, the same on every
            /// member.
            #[allow(clippy::too_many_arguments)]
            fn all_reduce(
                &self,
                py: Python<'_>,
                buf: &Bound<'_, PyAny>,
                numel: usize,
                dtype: &str,
                ranks: Vec<usize>,
                stream: usize,
                mean: bool,
                state: Py<$crate::state::AllReduceState>,
            ) -> PyResult<$crate::device::DeviceWork> {
                $crate::device::all_reduce_call(
                    self, py, buf, numel, dtype, ranks, stream, mean, state,
                )
            }
        }
    };
}
pub(crate) use device_calls;

/// A collective in flight on a device, whichever device
/// (`zeropp_zero::work::Work` over its queue).
trait InFlight: Send + Sync {
    fn is_completed(&self) -> Result<bool, ZeroError>;

    /// # Safety
    /// `stream` is a live stream of the device.
    unsafe fn wait(&self, stream: usize) -> Result<(), ZeroError>;
}

impl<Q: Queue> InFlight for Work<Q> {
    fn is_completed(&self) -> Result<bool, ZeroError> {
        Work::is_completed(self)
    }

    unsafe fn wait(&self, stream: usize) -> Result<(), ZeroError> {
        // SAFETY: the caller's promise.
        unsafe { Work::wait(self, stream) }
    }
}

/// A collective launched on a device (CUDA or the emulated one), returned
/// at once: `wait(stream)` makes the caller's stream wait for it (on CUDA
/// a stream wait, the host goes on; on the emulated device the caller's
/// thread waits) and raises its error; `is_completed()` polls.
#[pyclass(frozen)]
pub struct DeviceWork {
    /// This rank (named in the collective's own errors).
    rank: usize,
    work: Box<dyn InFlight>,
    /// The error the first wait raised, raised again by later waits.
    raised: Mutex<Option<Raised>>,
}

impl DeviceWork {
    pub(crate) fn new<Q: Queue>(rank: usize, work: Work<Q>) -> DeviceWork {
        DeviceWork {
            rank,
            work: Box::new(work),
            raised: Mutex::new(None),
        }
    }

    /// A failure, as the host path's `Op` raises it: a peer's names the
    /// peer, any other this rank.
    fn raised(&self, e: ZeroError) -> Raised {
        let peer = e.is_peer_failure();
        Raised {
            peer,
            message: match peer {
                true => e.to_string(),
                false => format!("rank {}: {e}", self.rank),
            },
        }
    }
}

#[pymethods]
impl DeviceWork {
    /// Makes `stream` (the caller's current one; 0 on the emulated device)
    /// wait for the collective, and raises its error.
    fn wait(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        let mut raised = self
            .raised
            .lock()
            .map_err(|_| to_py(ZeroError::Poisoned("state of this collective")))?;
        if let Some(r) = raised.as_ref() {
            return Err(to_py(r.clone()));
        }
        // SAFETY: zeropp.torch passes the caller's current stream of the
        // device (torch.cuda.current_stream().cuda_stream), or 0 on the
        // emulated device, whose stream is its queue.
        match py.detach(|| unsafe { self.work.wait(stream) }) {
            Ok(()) => Ok(()),
            Err(e) => {
                let r = self.raised(e);
                *raised = Some(r.clone());
                Err(to_py(r))
            }
        }
    }

    /// Whether the collective is done (its error, if any, is raised by
    /// `wait`).
    fn is_completed(&self) -> PyResult<bool> {
        self.work.is_completed().map_err(to_py)
    }
}
