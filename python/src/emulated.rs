//! `zeropp.torch`'s emulated device (`ZEROPP_DEVICE=emulated`): CPU tensors
//! sent down the device path — torch.py's CUDA branch of FSDP2's all-gather
//! and reduce-scatter, and the device job itself
//! (`zeropp_zero::device_job::DeviceJob`, its communicators, group lookup,
//! state on the device and failure handling) on
//! `zeropp_zero::emulated::EmulatedDevice`: the CUDA kernels' own source on
//! host memory, the host job's groups as communicators and its
//! communication thread as the stream (one ordered queue). A call returns
//! once its work is queued, with a [`DeviceWork`] to wait on (the device
//! job's `Work`, as on CUDA); it gives the host path's results bit for bit,
//! so CI runs the device path's orchestration in real FSDP2 steps without
//! a GPU.

use std::sync::Arc;

use pyo3::prelude::*;
use zeropp_zero::device_job::DeviceJob;
use zeropp_zero::emulated::EmulatedDevice;

use crate::buffers::{Dtype, HostBuf};
use crate::collectives::Job;
use crate::device::{Binding, DeviceWork, Memory, device_calls};
use crate::{invalid, to_py};

/// The emulated device of a joined job: the same calls as `CudaJob`, on
/// host buffers.
#[pyclass(frozen)]
pub struct EmulatedJob {
    host: Py<Job>,
    job: Arc<DeviceJob<EmulatedDevice>>,
}

/// `obj`'s buffer, holding `numel` values of `dtype`.
fn buffer(
    obj: &Bound<'_, PyAny>,
    writable: bool,
    what: &str,
    numel: usize,
    dtype: Dtype,
) -> PyResult<HostBuf> {
    let buf = HostBuf::new(obj, writable, what)?;
    if numel * dtype.size() != buf.len() {
        return Err(invalid(format!(
            "{what}: {numel} values of {} bytes where the buffer holds {} bytes",
            dtype.size(),
            buf.len()
        )));
    }
    Ok(buf)
}

device_calls!(EmulatedJob {
    /// The emulated device of `job`, its communicators joined at once
    /// (the host job's world, node and cross-node groups).
    #[new]
    fn new(host: Py<Job>) -> PyResult<EmulatedJob> {
        let h = host.get();
        let device = EmulatedDevice {
            comm: h.communicator(),
            stream: h.comm_thread(),
        };
        let job = DeviceJob::new(device, 0, h.layout(), h.counter(), h.timeout());
        let g = h.groups();
        job.connect(&g.world, &g.node, &g.cross).map_err(to_py)?;
        Ok(EmulatedJob {
            host,
            job: Arc::new(job),
        })
    }

    /// Joins the communicators of the mesh dimension over `ranks`
    /// (registered with the host job's `add_mesh_dim`): the host job's
    /// groups of it.
    fn connect_dim(&self, ranks: Vec<usize>) -> PyResult<()> {
        let (layout, g) = self.host.get().dim_groups(&ranks)?;
        self.job
            .connect_dim(ranks, layout, &g.world, &g.node, &g.cross)
            .map_err(to_py)
    }

    /// Joins the communicator of sub-group `ranks` (a run of a mesh
    /// dimension's ranks on this node, this rank among them): the host
    /// job's group of them.
    fn add_group(&self, ranks: Vec<usize>) -> PyResult<()> {
        let group = self.host.get().known_group(&ranks)?;
        self.job.add_group(ranks, &group).map_err(to_py)
    }
});

impl Binding for EmulatedJob {
    type D = EmulatedDevice;

    fn job(&self) -> &DeviceJob<EmulatedDevice> {
        &self.job
    }

    /// A host buffer holding `numel` values of `dtype`, held by the call.
    fn memory(
        &self,
        obj: &Bound<'_, PyAny>,
        writable: bool,
        what: &str,
        numel: usize,
        dtype: Dtype,
    ) -> PyResult<Memory> {
        let buf = buffer(obj, writable, what, numel, dtype)?;
        Ok(Memory {
            address: buf.address(),
            _held: Some(buf),
        })
    }

    /// Launches `call` on the device's queue (`DeviceJob::launch`).
    fn launch(
        &self,
        _py: Python<'_>,
        stream: usize,
        call: impl FnOnce(&DeviceJob<EmulatedDevice>) -> Result<(), zeropp_zero::ZeroError>
        + Send
        + 'static,
    ) -> PyResult<DeviceWork> {
        // SAFETY: every stream of the emulated device is its queue; the
        // buffers are held by `call` itself.
        let work = unsafe { self.job.launch(stream, call) }.map_err(to_py)?;
        Ok(DeviceWork::new(self.job.layout().rank, work))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<EmulatedJob>()?;
    m.add_class::<DeviceWork>()
}
