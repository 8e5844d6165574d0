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
use crate::collectives::Job;
use crate::device::{Binding, DeviceWork, Memory, device_calls};
use crate::{invalid, to_py};

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

device_calls!(CudaJob {
    /// Opens CUDA device `device` for `job` (compiling or loading zeropp's
    /// kernels for it). The communicators come next, with [`CudaJob::connect`].
    #[new]
    fn new(py: Python<'_>, job: &Job, device: usize) -> PyResult<CudaJob> {
        let (layout, counter, timeout) = (job.layout(), job.counter(), job.timeout());
        let gpu = py.detach(|| Gpu::open_shared(device)).map_err(to_py)?;
        let job = DeviceJob::new(gpu, device, layout, counter, timeout);
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

    /// Joins the communicator of sub-group `ranks` (a run of a mesh
    /// dimension's ranks on this node, this rank among them) from `id`,
    /// made by its first rank.
    fn add_group(&self, py: Python<'_>, ranks: Vec<usize>, id: &[u8]) -> PyResult<()> {
        let id = NcclId::from_bytes(id).map_err(to_py)?;
        py.detach(|| self.job.add_group(ranks, &id)).map_err(to_py)
    }
});

impl Binding for CudaJob {
    type D = Gpu;

    fn job(&self) -> &DeviceJob<Gpu> {
        &self.job
    }

    /// A CUDA tensor's address (its `data_ptr()`): its size is the
    /// caller's to keep.
    fn memory(
        &self,
        obj: &Bound<'_, PyAny>,
        _writable: bool,
        what: &str,
        _numel: usize,
        _dtype: Dtype,
    ) -> PyResult<Memory> {
        let address = obj.extract::<u64>().map_err(|_| {
            invalid(format!(
                "{what}: a CUDA tensor's address (an int, its data_ptr()), not {obj}"
            ))
        })?;
        Ok(Memory {
            address,
            _held: None,
        })
    }

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
