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
use crate::collectives::{AllReduceState, Job, Plan, QgzState, QwzReference};
use crate::device::{self, AllReduceCall, DeviceWork, GatherCall, ScatterCall};
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

#[pymethods]
impl EmulatedJob {
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

    /// Whether group `ranks` has a communicator (a mesh dimension, its
    /// node, or an added sub-group).
    fn has_group(&self, ranks: Vec<usize>) -> PyResult<bool> {
        self.job.has_group(&ranks).map_err(to_py)
    }

    /// Whether the mesh dimension over `ranks` is joined (`connect_dim`).
    fn has_dim(&self, ranks: Vec<usize>) -> PyResult<bool> {
        self.job.has_dim(&ranks).map_err(to_py)
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

    /// `CudaJob.all_reduce` on a host buffer, queued on the device's one
    /// queue: a [`DeviceWork`] to wait on.
    #[allow(clippy::too_many_arguments)]
    fn all_reduce(
        &self,
        buf: &Bound<'_, PyAny>,
        numel: usize,
        dtype: &str,
        ranks: Vec<usize>,
        stream: usize,
        mean: bool,
        state: Py<AllReduceState>,
    ) -> PyResult<DeviceWork> {
        let d = Dtype::parse(dtype)?;
        let buf = buffer(buf, true, "all-reduce buffer", numel, d)?;
        let call = AllReduceCall {
            buf: buf.address(),
            numel,
            dtype: d,
            ranks,
            stream,
            mean,
        };
        self.launch(stream, move |job| {
            let _held = &buf;
            // SAFETY: `buf` is a live host buffer of this size, held by
            // this closure; Python hands it to this call alone until its
            // Work is waited for.
            unsafe { device::all_reduce(job, &call, state.get()) }
        })
    }

    /// `CudaJob.all_gather` on host buffers, queued on the device's one
    /// queue (`stream` names no other): a [`DeviceWork`] to wait on.
    #[pyo3(signature = (out, inp, numel, dtype, ranks, stream, plan, backward=false,
                        delta=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_gather(
        &self,
        out: &Bound<'_, PyAny>,
        inp: &Bound<'_, PyAny>,
        numel: usize,
        dtype: &str,
        ranks: Vec<usize>,
        stream: usize,
        plan: PyRef<'_, Plan>,
        backward: bool,
        delta: Option<Py<QwzReference>>,
    ) -> PyResult<DeviceWork> {
        let d = Dtype::parse(dtype)?;
        if !self.job.has_group(&ranks).map_err(to_py)? {
            return Err(invalid(format!(
                "all-gather over ranks {ranks:?}: no communicator for them; zeropp gathers over \
                 the world or over consecutive ranks of one node, joined with add_group first"
            )));
        }
        let size = ranks.len();
        let inp = buffer(inp, false, "all-gather input", numel, d)?;
        let out = buffer(out, true, "all-gather output", numel * size, d)?;
        let call = GatherCall::new(
            &self.job,
            (out.address(), inp.address(), numel),
            d,
            ranks,
            stream,
            &plan,
            backward,
            delta.as_ref().map(|d| d.get()),
        )
        .map_err(to_py)?;
        self.launch(stream, move |job| {
            let _held = (&inp, &out);
            // SAFETY: `inp` and `out` are live host buffers of these sizes,
            // held by this closure; Python hands them to this call alone
            // until its Work is waited for.
            unsafe { device::all_gather(job, &call, delta.as_ref().map(|d| d.get())) }
        })
    }

    /// `CudaJob.reduce_scatter` on host buffers: the sum in `dtype`, or
    /// with `qgz` the sum or (`mean`) the mean over the world; a
    /// [`DeviceWork`] to wait on.
    #[pyo3(signature = (out, inp, numel, dtype, ranks, stream, mean, qgz=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        out: &Bound<'_, PyAny>,
        inp: &Bound<'_, PyAny>,
        numel: usize,
        dtype: &str,
        ranks: Vec<usize>,
        stream: usize,
        mean: bool,
        qgz: Option<Py<QgzState>>,
    ) -> PyResult<DeviceWork> {
        let d = Dtype::parse(dtype)?;
        let w = ranks.len().max(1);
        let inp = buffer(inp, false, "reduce-scatter input", numel, d)?;
        let out = buffer(out, true, "reduce-scatter output", numel / w, d)?;
        let call = ScatterCall {
            out: out.address(),
            inp: inp.address(),
            numel,
            dtype: d,
            ranks,
            stream,
            mean,
        };
        self.launch(stream, move |job| {
            let _held = (&inp, &out);
            // SAFETY: as in `all_gather`.
            unsafe { device::reduce_scatter(job, &call, qgz.as_ref().map(|q| q.get())) }
        })
    }
}

impl EmulatedJob {
    /// Launches `call` on the device's queue (`DeviceJob::launch`).
    fn launch(
        &self,
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
