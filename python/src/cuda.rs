//! `zeropp.torch`'s CUDA path: FSDP2's all-gather and reduce-scatter on
//! CUDA tensors as zeropp's CUDA kernels (`zeropp-cuda`) over NCCL
//! communicators, launched on the caller's current stream. The job's
//! layout, switches and byte counters are the host job's ([`Job`]); the
//! NCCL ids travel through the torch store (Python does the exchange).
//!
//! Each call returns, with the GIL released meanwhile, once its kernels
//! have reported bad input and its NCCL collectives have finished within
//! the job's deadline; what follows the last of them (a scaling kernel, the
//! frees) is left queued on the stream, where FSDP2's next use of the
//! output waits for it.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use half::{bf16, f16};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use zeropp_comm::Transport;
use zeropp_cuda::device::DeviceQuantizedChunks;
use zeropp_cuda::nccl::{NcclComm, NcclId};
use zeropp_cuda::{CudaError, Gpu, GpuElement};
use zeropp_zero::ZeroError;
use zeropp_zero::device::{DeviceValues, NcclMover};
use zeropp_zero::fsdp::{self, Gather, Scatter};
use zeropp_zero::plan::Layout;
use zeropp_zero::qgz::{self, Reduction};
use zeropp_zero::traffic::{CountingTransport, Phase};
use zeropp_zero::{ByteMover, Hop, delta};

use crate::buffers::Dtype;
use crate::collectives::{Job, QgzState, QwzReference};
use crate::{invalid, peer_failed, to_py};

/// A collective's error as the device path reports it (a peer's failure
/// stays one).
fn zero_to_cuda(e: ZeroError) -> CudaError {
    match e {
        ZeroError::Device(e) => e,
        e if e.is_peer_failure() => CudaError::Peer(e.to_string()),
        e => CudaError::Invalid(e.to_string()),
    }
}

/// How long a failed NCCL call waits for the host transport to see which
/// rank died (its connections close with the process).
const NAME_THE_DEAD: Duration = Duration::from_secs(3);

/// A fresh NCCL id (128 bytes): made by one member of a communicator and
/// handed to the others through the store.
#[pyfunction]
pub fn nccl_unique_id<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
    let id = NcclId::new().map_err(to_py)?;
    Ok(PyBytes::new(py, &id.to_bytes()))
}

/// What this machine offers the CUDA path, as JSON: the driver, the
/// devices, NCCL's version or why it cannot be loaded.
#[pyfunction]
pub fn cuda_status() -> String {
    let nccl = zeropp_cuda::nccl::version();
    serde_json::json!({
        "driver": zeropp_cuda::device::driver_present(),
        "devices": zeropp_cuda::device::device_count(),
        "nccl": nccl.as_ref().ok(),
        "nccl_error": nccl.as_ref().err().map(|e| e.to_string()),
    })
    .to_string()
}

struct Comms {
    world: NcclComm,
    node: NcclComm,
    cross: NcclComm,
    /// hpZ groups smaller than the node, by their ranks.
    subgroups: Vec<(Vec<usize>, NcclComm)>,
}

struct Side {
    gpu: Gpu,
    comms: Option<Comms>,
}

impl Side {
    /// The device and the job's communicators, all queuing their work on
    /// `stream` (the caller's current CUDA stream) from now on.
    fn on_stream(&mut self, stream: usize) -> PyResult<(&Gpu, &Comms)> {
        let comms = self
            .comms
            .as_ref()
            .ok_or_else(|| invalid("connect the job's communicators first"))?;
        // SAFETY: Python passes torch.cuda.current_stream(), live for the
        // call it is passed to.
        unsafe { self.gpu.use_stream(stream) };
        let subgroups = comms.subgroups.iter().map(|(_, c)| c);
        for c in [&comms.world, &comms.node, &comms.cross]
            .into_iter()
            .chain(subgroups)
        {
            c.use_stream(self.gpu.stream());
        }
        Ok((&self.gpu, comms))
    }
}

/// The CUDA half of a joined job: one device, its kernels, and the NCCL
/// communicators of the job's groups (the world, this node, the ranks of
/// this local rank across nodes, hpZ sub-groups).
#[pyclass(frozen)]
pub struct CudaJob {
    side: Mutex<Side>,
    /// Set by the first peer failure: every communicator is aborted then.
    dead: std::sync::atomic::AtomicBool,
    device: usize,
    layout: Layout,
    counter: Arc<CountingTransport>,
    timeout: Duration,
}

/// The communicator of group `ranks`.
fn comm_of<'a>(comms: &'a Comms, layout: Layout, ranks: &[usize]) -> PyResult<&'a NcclComm> {
    let (w, g) = (layout.world(), layout.ranks_per_node);
    let node_first = layout.rank / g * g;
    if ranks.len() == w && ranks.iter().enumerate().all(|(i, &r)| i == r) {
        return Ok(&comms.world);
    }
    if ranks.len() == g && ranks.iter().enumerate().all(|(i, &r)| r == node_first + i) {
        return Ok(&comms.node);
    }
    comms
        .subgroups
        .iter()
        .find(|(r, _)| r == ranks)
        .map(|(_, c)| c)
        .ok_or_else(|| {
            invalid(format!(
                "no NCCL communicator for ranks {ranks:?}: zeropp gathers over the world or \
                 over consecutive ranks of one node (FSDP2's reshard_after_forward=<int> \
                 groups), made with add_group first"
            ))
        })
}

impl CudaJob {
    /// `e` as a Python exception. On a peer failure every communicator of
    /// the job is aborted (their kernels stop holding the stream, and none
    /// waits for the dead at exit), and the error names the rank that died
    /// when the host job's connections saw it (NCCL itself cannot say).
    fn error(&self, comms: Option<&Comms>, e: CudaError) -> PyErr {
        let m = match e {
            CudaError::Peer(m) => m,
            e => {
                // Another failure may still be a peer's death in disguise.
                return match self.counter.first_death() {
                    Some((rank, why)) => {
                        peer_failed(format!("rank {rank} failed: {why}; here: {e}"))
                    }
                    None => to_py(e),
                };
            }
        };
        self.dead.store(true, Ordering::Relaxed);
        if let Some(c) = comms {
            for comm in [&c.world, &c.node, &c.cross] {
                comm.abort();
            }
            c.subgroups.iter().for_each(|(_, comm)| comm.abort());
        }
        let deadline = std::time::Instant::now() + NAME_THE_DEAD;
        loop {
            if let Some((rank, why)) = self.counter.first_death() {
                return peer_failed(format!("rank {rank} failed: {why}; {m}"));
            }
            if std::time::Instant::now() >= deadline {
                return peer_failed(m);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs `f` on the device side without the GIL (the side's lock is
    /// taken there, so no thread waits for it holding the GIL).
    fn on_side<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Side) -> PyResult<R> + Send,
    ) -> PyResult<R> {
        py.detach(|| {
            if self.dead.load(Ordering::Relaxed) {
                return Err(peer_failed(
                    "an earlier NCCL failure (a rank died or hung) ended this job's \
                     communicators; the job cannot continue",
                ));
            }
            let mut side = self
                .side
                .lock()
                .map_err(|_| to_py(ZeroError::Poisoned("state of this device job")))?;
            f(&mut side)
        })
    }
}

#[pymethods]
impl CudaJob {
    /// Opens CUDA device `device` for `job` (compiling or loading zeropp's
    /// kernels for it). The communicators come next, with [`CudaJob::connect`].
    #[new]
    fn new(py: Python<'_>, job: &Job, device: usize) -> PyResult<CudaJob> {
        let gpu = py.detach(|| Gpu::open_shared(device)).map_err(to_py)?;
        Ok(CudaJob {
            side: Mutex::new(Side { gpu, comms: None }),
            dead: Default::default(),
            device,
            layout: job.layout(),
            counter: job.counter(),
            timeout: job.timeout(),
        })
    }

    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    /// Joins the job's three NCCL communicators: the world (`world_id`,
    /// made by rank 0), this node's ranks (`node_id`, made by the node's
    /// first rank) and this local rank's ranks across nodes (`cross_id`,
    /// made by that rank on node 0). Every rank calls it in the same order.
    fn connect(
        &self,
        py: Python<'_>,
        world_id: &[u8],
        node_id: &[u8],
        cross_id: &[u8],
    ) -> PyResult<()> {
        let l = self.layout;
        let g = l.ranks_per_node;
        let ids = [world_id, node_id, cross_id]
            .map(NcclId::from_bytes)
            .into_iter()
            .collect::<Result<Vec<_>, _>>()
            .map_err(to_py)?;
        let timeout = self.timeout;
        self.on_side(py, |side| {
            if side.comms.is_some() {
                return Err(invalid(
                    "the NCCL communicators of this job are already joined",
                ));
            }
            let gpu = &side.gpu;
            let comms = (|| -> Result<Comms, CudaError> {
                Ok(Comms {
                    world: NcclComm::init(gpu, &ids[0], l.rank, l.world(), timeout)?,
                    node: NcclComm::init(gpu, &ids[1], l.rank % g, g, timeout)?,
                    cross: NcclComm::init(gpu, &ids[2], l.rank / g, l.nodes, timeout)?,
                    subgroups: Vec::new(),
                })
            })()
            .map_err(|e| self.error(None, e))?;
            side.comms = Some(comms);
            Ok(())
        })
    }

    /// Whether group `ranks` has a communicator (the world, this node, or
    /// an added sub-group).
    fn has_group(&self, py: Python<'_>, ranks: Vec<usize>) -> PyResult<bool> {
        self.on_side(py, |side| {
            let comms = side
                .comms
                .as_ref()
                .ok_or_else(|| invalid("connect the job's communicators first"))?;
            Ok(comm_of(comms, self.layout, &ranks).is_ok())
        })
    }

    /// Joins the communicator of sub-group `ranks` (consecutive ranks of
    /// this node, this rank among them) from `id`, made by its first rank.
    fn add_group(&self, py: Python<'_>, ranks: Vec<usize>, id: &[u8]) -> PyResult<()> {
        let (l, g) = (self.layout, self.layout.ranks_per_node);
        let consecutive = ranks.windows(2).all(|p| p[1] == p[0] + 1);
        let one_node = matches!((ranks.first(), ranks.last()), (Some(f), Some(z)) if f / g == z / g && *z < l.world());
        let Some(me) = ranks.iter().position(|&r| r == l.rank) else {
            return Err(invalid(format!(
                "ranks {ranks:?} do not include this rank {}",
                l.rank
            )));
        };
        if !consecutive || !one_node {
            return Err(invalid(format!(
                "ranks {ranks:?}: zeropp's sub-groups are consecutive ranks of one node"
            )));
        }
        let id = NcclId::from_bytes(id).map_err(to_py)?;
        let timeout = self.timeout;
        self.on_side(py, |side| {
            let Side { gpu, comms } = side;
            let comms = comms
                .as_mut()
                .ok_or_else(|| invalid("connect the job's communicators first"))?;
            let comm = NcclComm::init(gpu, &id, me, ranks.len(), timeout)
                .map_err(|e| self.error(Some(comms), e))?;
            comms.subgroups.push((ranks, comm));
            Ok(())
        })
    }

    /// FSDP2's all-gather on the device: `numel` values of `dtype` at
    /// `inp` (this rank's shard) into `out` (every member's, group order),
    /// on CUDA stream `stream`: `zero::fsdp::all_gather`, as on the host.
    /// Over the world with `qwz_bits`: qwZ (quantize, NCCL all-gather of
    /// codes and scales, dequantize into place); otherwise NCCL's
    /// all-gather of the caller's bytes.
    /// `backward` counts the bytes as the backward gather's.
    #[pyo3(signature = (out, inp, numel, dtype, ranks, stream, qwz_bits=None, block=256,
                        backward=false, delta=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_gather(
        &self,
        py: Python<'_>,
        out: u64,
        inp: u64,
        numel: usize,
        dtype: &str,
        ranks: Vec<usize>,
        stream: usize,
        qwz_bits: Option<u32>,
        block: usize,
        backward: bool,
        delta: Option<Py<QwzReference>>,
    ) -> PyResult<()> {
        let dtype = Dtype::parse(dtype)?;
        let layout = self.layout;
        let over_world = ranks.len() == layout.world();
        let settings = delta.as_ref().map(|d| d.get().settings);
        let how = Gather::choose(qwz_bits, block, over_world, settings, dtype == Dtype::Bf16)
            .map_err(to_py)?;
        let phase = Phase::gather(backward);
        let counter = self.counter.clone();
        self.on_side(py, |side| {
            let (gpu, comms) = side.on_stream(stream)?;
            let group = comm_of(comms, layout, &ranks)?;
            let (hop, hpz) = match over_world {
                true => (Hop::World, None),
                // A sub-group's gather runs over it as hpZ's group.
                false => (Hop::Hpz, Some((group, ranks[0]))),
            };
            let mut reference = match (&delta, how) {
                (Some(state), Gather::Delta(_)) => {
                    Some(state.get().device.lock().map_err(|_| {
                        self.error(
                            Some(comms),
                            CudaError::Invalid(ZeroError::Poisoned("qwZ reference").to_string()),
                        )
                    })?)
                }
                _ => None,
            };
            let call = GatherCall {
                gpu,
                mover: mover(gpu, comms, layout, &counter, hpz),
                hop,
                how,
                phase,
                reference: reference.as_deref_mut(),
                inp,
                out,
                numel,
            };
            with_gpu_dtype(dtype, call).map_err(|e| self.error(Some(comms), e))
        })
    }

    /// FSDP2's gradient reduce-scatter over the world on the device:
    /// `numel` values of `dtype` at `inp` (W equal chunks) into `out` (this
    /// rank's chunk), on CUDA stream `stream`. Without `qgz`: NCCL's sum in
    /// `dtype`, or (`mean`) its average. With `qgz`: the two-hop quantized
    /// reduce-scatter of `zero::qgz` (f32 sums, rounded to `dtype` once),
    /// the sum or (`mean`) the mean over all W ranks, with that state's
    /// error feedback (kept compressed on the device, as the host keeps
    /// it). Both are `zero::fsdp::reduce_scatter`, as on the host.
    #[pyo3(signature = (out, inp, numel, dtype, stream, mean, qgz=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        out: u64,
        inp: u64,
        numel: usize,
        dtype: &str,
        stream: usize,
        mean: bool,
        qgz: Option<Py<QgzState>>,
    ) -> PyResult<()> {
        let dtype = Dtype::parse(dtype)?;
        let l = self.layout;
        let w = l.world();
        if !numel.is_multiple_of(w) {
            return Err(invalid(format!(
                "reduce-scatter of {numel} values over {w} ranks: not W equal chunks"
            )));
        }
        let me = l.rank;
        let state = qgz.as_ref().map(|q| q.get());
        let reduction = Reduction::mean_if(mean);
        let counter = self.counter.clone();
        self.on_side(py, |side| {
            let (gpu, comms) = side.on_stream(stream)?;
            let mut fb = state
                .map(|s| s.device_feedback.lock())
                .transpose()
                .map_err(|_| {
                    let e = ZeroError::Poisoned("error-feedback buffer").to_string();
                    self.error(Some(comms), CudaError::Invalid(e))
                })?;
            let call = ScatterCall {
                gpu,
                mover: mover(gpu, comms, l, &counter, None),
                qgz: state.zip(fb.as_deref_mut()),
                me,
                reduction,
                inp,
                out,
                numel,
            };
            with_gpu_dtype(dtype, call).map_err(|e| self.error(Some(comms), e))
        })
    }
}

/// qgZ's error feedback on the device for one parameter group: each hop's
/// residual, compressed as on the host (`zero::residual`'s format), made
/// on first use.
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
}

/// The residual in `slot`, made empty on first use (`zero::qgz` gives it
/// its shape, from zeros).
fn residual_slot<'a>(
    gpu: &Gpu,
    slot: &'a mut Option<DeviceQuantizedChunks>,
) -> Result<&'a mut DeviceQuantizedChunks, ZeroError> {
    if slot.is_none() {
        let format = zeropp_zero::residual::format();
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

/// One generic step over the element type of a call.
trait OnDtype {
    fn run<T: GpuElement>(self) -> Result<(), CudaError>;
}

fn with_gpu_dtype(dtype: Dtype, job: impl OnDtype) -> Result<(), CudaError> {
    match dtype {
        Dtype::F32 => job.run::<f32>(),
        Dtype::Bf16 => job.run::<bf16>(),
        Dtype::F16 => job.run::<f16>(),
    }
}

/// `fsdp::all_gather` on the caller's device pointers.
struct GatherCall<'a> {
    gpu: &'a Gpu,
    mover: NcclMover<'a>,
    hop: Hop,
    how: Gather,
    phase: Phase,
    reference: Option<&'a mut Option<delta::Reference<DeviceValues>>>,
    inp: u64,
    out: u64,
    numel: usize,
}

impl OnDtype for GatherCall<'_> {
    fn run<T: GpuElement>(self) -> Result<(), CudaError> {
        let size = self.mover.size(self.hop);
        // SAFETY: the caller's tensors hold these values on this device and
        // are not touched until the call returns.
        let shard = unsafe { self.gpu.borrow::<T>(self.inp, self.numel) }?;
        let mut out = unsafe { self.gpu.borrow::<T>(self.out, self.numel * size) }?;
        let (gpu, m, layout) = (self.gpu, &self.mover, self.mover.layout);
        let (hop, how, phase) = (self.hop, self.how, self.phase);
        fsdp::all_gather(
            gpu,
            m,
            layout,
            hop,
            how,
            phase,
            self.reference,
            &shard.view(),
            &mut out.view_mut(),
        )
        .map_err(zero_to_cuda)
    }
}

/// `fsdp::reduce_scatter` on the caller's device pointers, with a qgZ
/// state and its feedback on this device, or plain.
struct ScatterCall<'a> {
    gpu: &'a Gpu,
    mover: NcclMover<'a>,
    qgz: Option<(&'a QgzState, &'a mut DeviceFeedback)>,
    me: usize,
    reduction: Reduction,
    inp: u64,
    out: u64,
    numel: usize,
}

impl OnDtype for ScatterCall<'_> {
    fn run<T: GpuElement>(self) -> Result<(), CudaError> {
        let (gpu, m, layout) = (self.gpu, &self.mover, self.mover.layout);
        // SAFETY: as in `GatherCall::run`.
        let grad = unsafe { gpu.borrow::<T>(self.inp, self.numel) }?;
        let mut out = unsafe { gpu.borrow::<T>(self.out, self.numel / layout.world()) }?;
        (|| -> Result<(), ZeroError> {
            let how = match self.qgz {
                Some((s, DeviceFeedback { first, second })) => Scatter::Qgz(
                    s.settings(self.me, self.reduction),
                    qgz::Feedback {
                        first: match s.first_hop_feedback() {
                            true => Some(residual_slot(gpu, first)?),
                            false => None,
                        },
                        second: match s.error_feedback {
                            true => Some(residual_slot(gpu, second)?),
                            false => None,
                        },
                    },
                ),
                None => Scatter::Plain,
            };
            let (x, mut o) = (grad.view(), out.view_mut());
            fsdp::reduce_scatter(gpu, m, layout, how, self.reduction, &x, &mut o)
        })()
        .map_err(zero_to_cuda)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CudaJob>()?;
    m.add_function(wrap_pyfunction!(nccl_unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    Ok(())
}
