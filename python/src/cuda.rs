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
use zeropp::comm::Transport;
use zeropp::zero::plan::Layout;
use zeropp::zero::traffic::{CountingTransport, Phase};
use zeropp_cuda::collectives::{
    QgzFeedback, QgzGroups, qgz_reduce_scatter, qwz_all_gather_hierarchical,
};
use zeropp_cuda::nccl::{NcclComm, NcclId};
use zeropp_cuda::{CudaError, Gpu, GpuElement};
use zeropp_quant::{Bits, QuantFormat, Rounding, Scheme};

use crate::buffers::Dtype;
use crate::collectives::{Job, QgzState};
use crate::invalid;

/// A CUDA error as the Python exception that fits it.
fn to_py(e: CudaError) -> PyErr {
    match e {
        CudaError::Peer(m) => crate::PeerError::new_err(m),
        e => crate::ZeroppError::new_err(e.to_string()),
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

fn format(bits: u32, block: usize) -> PyResult<QuantFormat> {
    QuantFormat::new(
        Bits::from_u32(bits).map_err(|e| invalid(e.to_string()))?,
        Scheme::Symmetric,
        block,
    )
    .map_err(|e| invalid(e.to_string()))
}

fn peers(ranks: &[usize], me: usize) -> impl Iterator<Item = usize> + '_ {
    ranks.iter().copied().filter(move |&r| r != me)
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
                        crate::PeerError::new_err(format!("rank {rank} failed: {why}; here: {e}"))
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
                return crate::PeerError::new_err(format!("rank {rank} failed: {why}; {m}"));
            }
            if std::time::Instant::now() >= deadline {
                return crate::PeerError::new_err(m);
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
                return Err(crate::PeerError::new_err(
                    "an earlier NCCL failure (a rank died or hung) ended this job's \
                     communicators; the job cannot continue",
                ));
            }
            let mut side = self.side.lock().map_err(|_| invalid("poisoned"))?;
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
    /// on CUDA stream `stream`. Over the world with `qwz_bits`: qwZ
    /// (quantize, NCCL all-gather of codes and scales, dequantize into
    /// place); otherwise NCCL's all-gather of the caller's bytes.
    /// `backward` counts the bytes as the backward gather's.
    #[pyo3(signature = (out, inp, numel, dtype, ranks, stream, qwz_bits=None, block=256,
                        backward=false))]
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
    ) -> PyResult<()> {
        let dtype = Dtype::parse(dtype)?;
        let wire = qwz_bits.map(|b| format(b, block)).transpose()?;
        let phase = if backward {
            Phase::BackwardGather
        } else {
            Phase::ForwardGather
        };
        let layout = self.layout;
        let (wire, sent, frac) = self.on_side(py, |side| {
            let (gpu, comms) = side.on_stream(stream)?;
            let comm = comm_of(comms, layout, &ranks)?;
            let size = comm.size();
            // qwZ over the world only; a sub-group gathers the bytes as
            // they are.
            let wire = wire.filter(|_| size == layout.world());
            let result = match wire {
                Some(f) => with_gpu_dtype(
                    dtype,
                    GatherQuantized {
                        gpu,
                        cross: &comms.cross,
                        node: &comms.node,
                        inp,
                        out,
                        numel,
                        format: f,
                    },
                ),
                None => (|| {
                    let bytes = numel * dtype.size();
                    // SAFETY: the caller's tensors hold these bytes on this
                    // device and are not touched until the call returns.
                    let src = unsafe { gpu.borrow::<u8>(inp, bytes) }?;
                    let mut dst = unsafe { gpu.borrow::<u8>(out, bytes * size) }?;
                    if bytes == 0 {
                        return Ok(());
                    }
                    comm.all_gather_bytes(&src.view(), &mut dst.view_mut())
                })(),
            };
            result.map_err(|e| self.error(Some(comms), e))?;
            Ok(match wire {
                Some(f) => (
                    true,
                    f.total_bytes(numel) as u64,
                    f.param_bytes(numel) as f64 / f.total_bytes(numel).max(1) as f64,
                ),
                None => (false, (numel * dtype.size()) as u64, 0.0),
            })
        })?;
        let (me, g, n) = (layout.rank, layout.ranks_per_node, layout.nodes);
        if wire {
            // Across nodes to this local rank's peers, then N shards to
            // each local peer.
            for p in (0..n).map(|k| k * g + me % g) {
                self.counter.count_outside(phase, frac, p, sent);
            }
            for p in (me / g * g..me / g * g + g).filter(|&p| p != me) {
                self.counter.count_outside(phase, frac, p, sent * n as u64);
            }
        } else {
            for p in peers(&ranks, me) {
                self.counter.count_outside(phase, frac, p, sent);
            }
        }
        Ok(())
    }

    /// FSDP2's gradient reduce-scatter over the world on the device:
    /// `numel` values of `dtype` at `inp` (W equal chunks) into `out` (this
    /// rank's chunk), on CUDA stream `stream`. Without `qgz`: NCCL's sum in
    /// `dtype` (the caller divides for a mean). With `qgz` (f32 only): the
    /// two-hop quantized reduce-scatter, giving the **mean** over all W
    /// ranks, with error feedback in the f32 buffers at `first` (numel
    /// values) and `second` (numel / G values) when given.
    #[pyo3(signature = (out, inp, numel, dtype, stream, qgz=None, first=None, second=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        out: u64,
        inp: u64,
        numel: usize,
        dtype: &str,
        stream: usize,
        qgz: Option<Py<QgzState>>,
        first: Option<u64>,
        second: Option<u64>,
    ) -> PyResult<()> {
        let dtype = Dtype::parse(dtype)?;
        let l = self.layout;
        let (w, g, n) = (l.world(), l.ranks_per_node, l.nodes);
        if !numel.is_multiple_of(w) {
            return Err(invalid(format!(
                "reduce-scatter of {numel} values over {w} ranks: not W equal chunks"
            )));
        }
        let chunk = numel / w;
        if qgz.is_some() && dtype != Dtype::F32 {
            return Err(invalid(
                "qgZ on the device reduces float32 gradients; cast the input (zeropp.torch does)",
            ));
        }
        let me = l.rank;
        let state = qgz.as_ref().map(|q| q.get());
        let rounding = state.map(|s| s.next_rounding(me));
        self.on_side(py, |side| {
            let (gpu, comms) = side.on_stream(stream)?;
            let result = match state.zip(rounding) {
                Some((s, rounding)) => (|| {
                    let groups = QgzGroups {
                        node: &comms.node,
                        cross: &comms.cross,
                        intra: s.intra,
                        inter: s.inter,
                        rounding,
                    };
                    // SAFETY: the caller's tensors hold these values on
                    // this device and are not touched until the call
                    // returns.
                    let grad = unsafe { gpu.borrow::<f32>(inp, numel) }?;
                    let mut o = unsafe { gpu.borrow::<f32>(out, chunk) }?;
                    let mut r1 = first
                        .map(|p| unsafe { gpu.borrow::<f32>(p, numel) })
                        .transpose()?;
                    let mut r2 = second
                        .map(|p| unsafe { gpu.borrow::<f32>(p, n * chunk) })
                        .transpose()?;
                    let feedback = QgzFeedback {
                        first: r1.as_mut().map(|b| b.view_mut()),
                        second: r2.as_mut().map(|b| b.view_mut()),
                    };
                    qgz_reduce_scatter(gpu, &groups, &grad.view(), &mut o.view_mut(), feedback)
                })(),
                None => with_gpu_dtype(
                    dtype,
                    SumScatter {
                        gpu,
                        comm: &comms.world,
                        inp,
                        out,
                        numel,
                    },
                ),
            };
            result.map_err(|e| self.error(Some(comms), e))
        })?;
        match state {
            None => {
                let bytes = (chunk * dtype.size()) as u64;
                for p in (0..w).filter(|&p| p != me) {
                    self.counter.count_outside(Phase::Gradient, 0.0, p, bytes);
                }
            }
            Some(s) => {
                let frac = |f: QuantFormat| {
                    f.param_bytes(chunk) as f64 / f.total_bytes(chunk).max(1) as f64
                };
                let node_first = me / g * g;
                let hop1 = (n * s.intra.total_bytes(chunk)) as u64;
                for p in (node_first..node_first + g).filter(|&p| p != me) {
                    self.counter
                        .count_outside(Phase::Gradient, frac(s.intra), p, hop1);
                }
                let hop2 = s.inter.total_bytes(chunk) as u64;
                for p in (0..n).map(|k| k * g + me % g).filter(|&p| p != me) {
                    self.counter
                        .count_outside(Phase::Gradient, frac(s.inter), p, hop2);
                }
            }
        }
        Ok(())
    }
}

/// One generic step over the element type of a call.
trait OnDtype {
    fn run<T: GpuElement + zeropp_cuda::nccl::NcclElement>(self) -> Result<(), CudaError>;
}

fn with_gpu_dtype(dtype: Dtype, job: impl OnDtype) -> Result<(), CudaError> {
    match dtype {
        Dtype::F32 => job.run::<f32>(),
        Dtype::Bf16 => job.run::<bf16>(),
        Dtype::F16 => job.run::<f16>(),
    }
}

struct GatherQuantized<'a> {
    gpu: &'a Gpu,
    cross: &'a NcclComm,
    node: &'a NcclComm,
    inp: u64,
    out: u64,
    numel: usize,
    format: QuantFormat,
}

impl OnDtype for GatherQuantized<'_> {
    fn run<T: GpuElement + zeropp_cuda::nccl::NcclElement>(self) -> Result<(), CudaError> {
        let size = self.cross.size() * self.node.size();
        // SAFETY: the caller's tensors hold these values on this device and
        // are not touched until the call returns.
        let shard = unsafe { self.gpu.borrow::<T>(self.inp, self.numel) }?;
        let mut out = unsafe { self.gpu.borrow::<T>(self.out, self.numel * size) }?;
        if self.numel == 0 {
            return Ok(());
        }
        qwz_all_gather_hierarchical(
            self.gpu,
            self.cross,
            self.node,
            &shard.view(),
            self.format,
            Rounding::NearestEven,
            &mut out.view_mut(),
        )
    }
}

struct SumScatter<'a> {
    gpu: &'a Gpu,
    comm: &'a NcclComm,
    inp: u64,
    out: u64,
    numel: usize,
}

impl OnDtype for SumScatter<'_> {
    fn run<T: GpuElement + zeropp_cuda::nccl::NcclElement>(self) -> Result<(), CudaError> {
        let w = self.comm.size();
        // SAFETY: as in `GatherQuantized::run`.
        let inp = unsafe { self.gpu.borrow::<T>(self.inp, self.numel) }?;
        let mut out = unsafe { self.gpu.borrow::<T>(self.out, self.numel / w) }?;
        if self.numel == 0 {
            return Ok(());
        }
        self.comm
            .reduce_scatter_sum(&inp.view(), &mut out.view_mut())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CudaJob>()?;
    m.add_function(wrap_pyfunction!(nccl_unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    Ok(())
}
