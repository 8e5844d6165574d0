//! `zeropp.torch`'s emulated device (`ZEROPP_DEVICE=emulated`): CPU tensors
//! sent down the device path — torch.py's CUDA branch of FSDP2's all-gather
//! and reduce-scatter, and the ZeRO++ collectives over the CUDA kernels'
//! own source (`zeropp_zero::emulated`) — with the host job's transports as
//! the byte mover and its communication thread as the stream (one ordered
//! queue). A call returns once its work is queued, with an [`Op`] to wait
//! on (the emulated device's event); it gives the host path's results bit
//! for bit, so CI runs the device path's orchestration in real FSDP2 steps
//! without a GPU.

use pyo3::prelude::*;
use zeropp_zero::emulated::Emulated;

use crate::buffers::Dtype;
use crate::collectives::{Job, Op, QgzState, QwzReference};
use crate::invalid;

/// The emulated device of a joined job: the same calls as `CudaJob`, on
/// host buffers.
#[pyclass(frozen)]
pub struct EmulatedJob {
    job: Py<Job>,
}

fn check_numel(what: &str, numel: usize, dtype: Dtype, bytes: usize) -> PyResult<()> {
    if numel * dtype.size() == bytes {
        Ok(())
    } else {
        Err(invalid(format!(
            "{what}: {numel} values of {} bytes where the buffer holds {bytes} bytes",
            dtype.size()
        )))
    }
}

#[pymethods]
impl EmulatedJob {
    #[new]
    fn new(job: Py<Job>) -> EmulatedJob {
        EmulatedJob { job }
    }

    /// Every group of the job has its (host) communicator already.
    fn has_group(&self, _ranks: Vec<usize>) -> bool {
        true
    }

    /// `CudaJob.all_gather` on host buffers, queued on the job's one
    /// queue (`stream` names no other): an [`Op`] to wait on.
    #[pyo3(signature = (out, inp, numel, dtype, ranks, stream, qwz_bits=None, block=256,
                        backward=false, delta=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_gather(
        &self,
        out: &Bound<'_, PyAny>,
        inp: &Bound<'_, PyAny>,
        numel: usize,
        dtype: &str,
        ranks: Vec<usize>,
        stream: usize,
        qwz_bits: Option<u32>,
        block: usize,
        backward: bool,
        delta: Option<Py<QwzReference>>,
    ) -> PyResult<Op> {
        let _ = stream;
        let d = Dtype::parse(dtype)?;
        let job = self.job.get();
        let inp_bytes = crate::buffers::HostBuf::new(inp, false, "input")?.len();
        check_numel("all-gather input", numel, d, inp_bytes)?;
        job.all_gather_on(
            Emulated, out, inp, dtype, ranks, qwz_bits, block, backward, delta,
        )
    }

    /// `CudaJob.reduce_scatter` on host buffers: the sum in `dtype`, or
    /// with `qgz` the sum or (`mean`) the mean over the world; an [`Op`]
    /// to wait on.
    #[pyo3(signature = (out, inp, numel, dtype, stream, mean, qgz=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        out: &Bound<'_, PyAny>,
        inp: &Bound<'_, PyAny>,
        numel: usize,
        dtype: &str,
        stream: usize,
        mean: bool,
        qgz: Option<Py<QgzState>>,
    ) -> PyResult<Op> {
        let _ = stream;
        let d = Dtype::parse(dtype)?;
        let job = self.job.get();
        let inp_bytes = crate::buffers::HostBuf::new(inp, false, "input")?.len();
        check_numel("reduce-scatter input", numel, d, inp_bytes)?;
        let world: Vec<usize> = (0..job.layout().world()).collect();
        job.reduce_scatter_on(Emulated, out, inp, dtype, world, mean, qgz)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<EmulatedJob>()
}
