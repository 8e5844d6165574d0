//! `zeropp.torch`'s CUDA path: the bindings of `zeropp_zero::device_job`
//! (FSDP2's all-gather and reduce-scatter on CUDA tensors as zeropp's CUDA
//! kernels over NCCL communicators, on the caller's current stream). The
//! job's layout, switches and byte counters are the host job's ([`Job`]);
//! the NCCL ids travel through the torch store (Python does the exchange).
//! Each call releases the GIL while its host side runs and returns a
//! [`DeviceWork`] (the device job's `Work`: a CUDA event after the call's
//! kernels and NCCL calls, which the caller's stream waits on). The calls
//! themselves are the device path's, written once for every device
//! ([`crate::device`]).

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use zeropp_cuda::Gpu;
use zeropp_cuda::nccl::NcclId;
use zeropp_zero::device_job::DeviceJob;
use zeropp_zero::layout::Layout;

use crate::buffers::Dtype;
use crate::collectives::{AllReduceState, Job, Plan, QgzState, QwzReference};
use crate::device::{self, AllReduceCall, DeviceWork, GatherCall, ScatterCall};
use crate::to_py;

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

/// The CUDA half of a joined job (`zeropp_zero::device_job::DeviceJob`).
#[pyclass(frozen)]
pub struct CudaJob {
    job: Arc<DeviceJob<Gpu>>,
}

#[pymethods]
impl CudaJob {
    /// Opens CUDA device `device` for `job` (compiling or loading zeropp's
    /// kernels for it). The communicators come next, with [`CudaJob::connect`].
    #[new]
    fn new(py: Python<'_>, job: &Job, device: usize) -> PyResult<CudaJob> {
        let (layout, counter, timeout) = (job.layout(), job.counter(), job.timeout());
        let job = py
            .detach(|| DeviceJob::open(device, layout, counter, timeout))
            .map_err(to_py)?;
        Ok(CudaJob { job: Arc::new(job) })
    }

    #[getter]
    fn device(&self) -> usize {
        self.job.device()
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
        let [w, n, c] = [world_id, node_id, cross_id].map(NcclId::from_bytes);
        let (w, n, c) = (w.map_err(to_py)?, n.map_err(to_py)?, c.map_err(to_py)?);
        py.detach(|| self.job.connect(&w, &n, &c)).map_err(to_py)
    }

    /// Joins the NCCL communicators of the mesh dimension over `ranks`
    /// (registered with the host job's `add_mesh_dim`, whose `layout` it
    /// returned: nodes, ranks per node, this rank's position): its world, this
    /// rank's node in it and its cross group, from the ids their first
    /// members made. Every member calls it in the same order.
    #[allow(clippy::too_many_arguments)]
    fn connect_dim(
        &self,
        py: Python<'_>,
        ranks: Vec<usize>,
        layout: (usize, usize, usize),
        world_id: &[u8],
        node_id: &[u8],
        cross_id: &[u8],
    ) -> PyResult<()> {
        let [w, n, c] = [world_id, node_id, cross_id].map(NcclId::from_bytes);
        let (w, n, c) = (w.map_err(to_py)?, n.map_err(to_py)?, c.map_err(to_py)?);
        let (nodes, ranks_per_node, rank) = layout;
        let layout = Layout {
            nodes,
            ranks_per_node,
            rank,
        };
        py.detach(|| self.job.connect_dim(ranks, layout, &w, &n, &c))
            .map_err(to_py)
    }

    /// Whether group `ranks` has a communicator (a mesh dimension, its
    /// node, or an added sub-group).
    fn has_group(&self, py: Python<'_>, ranks: Vec<usize>) -> PyResult<bool> {
        py.detach(|| self.job.has_group(&ranks)).map_err(to_py)
    }

    /// Whether the mesh dimension over `ranks` is joined (`connect_dim`).
    fn has_dim(&self, py: Python<'_>, ranks: Vec<usize>) -> PyResult<bool> {
        py.detach(|| self.job.has_dim(&ranks)).map_err(to_py)
    }

    /// Joins the communicator of sub-group `ranks` (a run of a mesh
    /// dimension's ranks on this node, this rank among them) from `id`,
    /// made by its first rank.
    fn add_group(&self, py: Python<'_>, ranks: Vec<usize>, id: &[u8]) -> PyResult<()> {
        let id = NcclId::from_bytes(id).map_err(to_py)?;
        py.detach(|| self.job.add_group(ranks, &id)).map_err(to_py)
    }

    /// FSDP2's all-gather on the device: `numel` values of `dtype` at
    /// `inp` (this rank's shard) into `out` (every member's, group order),
    /// on CUDA stream `stream`: `zero::fsdp::all_gather`, as on the host.
    /// Over the world with `qwz_bits`: qwZ (quantize, NCCL all-gather of
    /// codes and scales, dequantize into place); otherwise NCCL's
    /// all-gather of the caller's bytes. `backward` counts the bytes as the
    /// backward gather's.
    #[pyo3(signature = (out, inp, numel, dtype, ranks, stream, plan, backward=false,
                        delta=None))]
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
        plan: PyRef<'_, Plan>,
        backward: bool,
        delta: Option<Py<QwzReference>>,
    ) -> PyResult<DeviceWork> {
        let call = GatherCall::new(
            &self.job,
            (out, inp, numel),
            Dtype::parse(dtype)?,
            ranks,
            stream,
            &plan,
            backward,
            delta.as_ref().map(|d| d.get()),
        )
        .map_err(to_py)?;
        // SAFETY: zeropp.torch passes the data pointers of live CUDA
        // tensors on this job's device holding these sizes (FSDP2's
        // buffers, kept until the Work is waited for) and
        // torch.cuda.current_stream().
        self.launch(py, stream, move |job| unsafe {
            device::all_gather(job, &call, delta.as_ref().map(|d| d.get()))
        })
    }

    /// FSDP2's gradient reduce-scatter over the mesh dimension `ranks` on
    /// the device: `numel` values of `dtype` at `inp` (one equal chunk per
    /// member) into `out` (this rank's chunk), on CUDA stream `stream`. Without `qgz`: NCCL's sum in
    /// `dtype`, or (`mean`) its average. With `qgz`: the two-hop quantized
    /// reduce-scatter of `zero::qgz` (f32 sums, rounded to `dtype` once),
    /// the sum or (`mean`) the mean over all W ranks, with that state's
    /// error feedback (kept compressed on the device, as the host keeps
    /// it). Both are `zero::fsdp::reduce_scatter`, as on the host.
    #[pyo3(signature = (out, inp, numel, dtype, ranks, stream, mean, qgz=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        out: u64,
        inp: u64,
        numel: usize,
        dtype: &str,
        ranks: Vec<usize>,
        stream: usize,
        mean: bool,
        qgz: Option<Py<QgzState>>,
    ) -> PyResult<DeviceWork> {
        let call = ScatterCall {
            out,
            inp,
            numel,
            dtype: Dtype::parse(dtype)?,
            ranks,
            stream,
            mean,
        };
        // SAFETY: as in `all_gather`.
        self.launch(py, stream, move |job| unsafe {
            device::reduce_scatter(job, &call, qgz.as_ref().map(|q| q.get()))
        })
    }

    /// HSDP's all-reduce across the mesh dimension `ranks` (its replicate
    /// one, joined with `connect_dim`) on the device, quantized with
    /// `state` (int4 blocks, f32 sums, error feedback kept on the device):
    /// `numel` values of `dtype` at `buf`, in place, on CUDA stream
    /// `stream`; the sum or (`mean`) the mean, the same on every member.
    #[allow(clippy::too_many_arguments)]
    fn all_reduce(
        &self,
        py: Python<'_>,
        buf: u64,
        numel: usize,
        dtype: &str,
        ranks: Vec<usize>,
        stream: usize,
        mean: bool,
        state: Py<AllReduceState>,
    ) -> PyResult<DeviceWork> {
        let call = AllReduceCall {
            buf,
            numel,
            dtype: Dtype::parse(dtype)?,
            ranks,
            stream,
            mean,
        };
        // SAFETY: zeropp.torch passes the data pointer of a live CUDA
        // tensor on this job's device holding `numel` values (FSDP2's
        // reduce-scatter output, kept until the Work is waited for) and
        // torch.cuda.current_stream().
        self.launch(py, stream, move |job| unsafe {
            device::all_reduce(job, &call, state.get())
        })
    }
}

impl CudaJob {
    /// Launches `call` in the order of the caller's `stream`
    /// (`DeviceJob::launch`: its host side runs here, the GIL released).
    fn launch(
        &self,
        py: Python<'_>,
        stream: usize,
        call: impl FnOnce(&DeviceJob<Gpu>) -> Result<(), zeropp_zero::ZeroError> + Send + 'static,
    ) -> PyResult<DeviceWork> {
        // SAFETY: zeropp.torch passes torch.cuda.current_stream() of this
        // job's device; the buffers are the caller's, kept by zeropp.torch
        // until the Work is waited for.
        let work = py
            .detach(|| unsafe { self.job.launch(stream, call) })
            .map_err(to_py)?;
        Ok(DeviceWork::new(self.job.layout().rank, work))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CudaJob>()?;
    m.add_function(wrap_pyfunction!(nccl_unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    Ok(())
}
