//! # zeropp-cuda — the quantization kernels on NVIDIA GPUs
//!
//! CUDA C sources live in `cuda/kernels/` (one `.cu` file per family, a
//! shared `common.cuh`), are compiled at run time by NVRTC for the device's
//! architecture and cached on disk by source hash ([`compile`]), and are
//! launched by the wrappers in [`device`], which take and return device
//! buffers and turn every CUDA error — and every bad input the kernels find —
//! into a [`CudaError`].
//!
//! The formats are zeropp-quant's, and for round-to-nearest the codes and
//! block parameters equal the CPU library's **bit for bit** (the kernels
//! round every operation on its own, as `quant/src/lib.rs` specifies).
//! Stochastic rounding draws from a counter-based stream (any thread can draw
//! any value), so stochastic codes are unbiased but differ from the CPU's.
//!
//! Nothing here needs a GPU or CUDA to build. NVRTC and the CUDA headers are
//! found at run time ([`toolkit`]); with no driver or no device the device
//! path returns [`CudaError::NoDriver`] / [`CudaError::NoDevice`] — cudarc
//! panics on a missing library, so every entry point checks first.

pub mod bench;
pub mod compile;
pub mod device;
pub mod kernels;
pub mod nccl;
pub mod toolkit;

/// The CUDA bindings zeropp-cuda is built on, for callers that name its
/// buffer types.
pub use cudarc;

pub use compile::{Arch, CompiledFamily, KernelResources, compile_family};
pub use device::{
    Borrowed, DeviceQuantized, DeviceQuantizedChunks, Gpu, GpuElement, QuantView, QuantViewMut,
};
pub use kernels::{FAMILIES, Family};
pub use toolkit::Toolkit;

/// What can go wrong on the GPU path.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "NVRTC (libnvrtc.so) was not found; looked in: {searched}. Install it with \
         `python3 -m pip install 'nvidia-cuda-nvrtc==13.*' 'nvidia-cuda-runtime==13.*'`, or \
         install the CUDA toolkit and set CUDA_HOME (or ZEROPP_NVRTC to the library file)"
    )]
    NoNvrtc { searched: String },
    #[error(
        "the CUDA headers (cuda_fp16.h, cuda_bf16.h) were not found; looked in: {searched}. \
         Install them with `python3 -m pip install 'nvidia-cuda-runtime==13.*'`, or install the \
         CUDA toolkit and set CUDA_HOME (or ZEROPP_CUDA_INCLUDE to the include directory)"
    )]
    NoHeaders { searched: String },
    #[error("NVRTC could not load from {path}: {reason}")]
    NvrtcLoad { path: String, reason: String },
    #[error("compiling {file} for {arch} failed:\n{log}")]
    Compile {
        file: &'static str,
        arch: String,
        log: String,
    },
    #[error(
        "no NVIDIA driver: libcuda.so.1 could not be loaded. The GPU path needs an NVIDIA GPU \
         with its driver installed; on a machine without one, use the CPU library (zeropp-quant)"
    )]
    NoDriver,
    #[error("no CUDA device {ordinal}: {reason}")]
    NoDevice { ordinal: usize, reason: String },
    #[error("CUDA error in {what}: {source}")]
    Driver {
        what: String,
        #[source]
        source: cudarc::driver::DriverError,
    },
    #[error(transparent)]
    Quant(#[from] zeropp_quant::QuantError),
    /// The CUDA toolkit's libraries or headers could not be found or
    /// loaded: the search's error (what was looked for, where), made once
    /// per process and shared by every caller.
    #[error(transparent)]
    Toolkit(std::sync::Arc<CudaError>),
    /// An NVRTC call failed.
    #[error("NVRTC {what} failed: {status}")]
    Nvrtc { what: String, status: String },
    /// NCCL (libnccl.so.2) could not be loaded or lacks what zeropp calls.
    #[error(transparent)]
    NcclLibrary(#[from] NcclNotLoaded),
    /// An NCCL call, or the CUDA work around it, failed on this rank.
    #[error("{what}: {detail}")]
    Nccl { what: String, detail: String },
    /// A call's arguments do not fit together (sizes, ranks, grids).
    #[error("{0}")]
    Invalid(String),
    /// Another rank died, hung or became unreachable (an NCCL timeout or
    /// remote error); the message says which communicator.
    #[error("{0}")]
    Peer(String),
}

/// Why NCCL cannot be used here, and what to do.
#[derive(Clone, Debug, thiserror::Error)]
pub enum NcclNotLoaded {
    #[error(
        "NCCL (libnccl.so.2) was not found; looked for {tried}. Install it with `python3 -m pip \
         install nvidia-nccl-cu13` or `apt-get install libnccl2`, or set ZEROPP_NCCL to the \
         library file"
    )]
    Missing { tried: String },
    #[error("libnccl lacks {symbol}: {why}; zeropp needs NCCL 2.17 or newer")]
    Old { symbol: String, why: String },
}

impl CudaError {
    /// Whether another rank's failure caused it (the job cannot go on).
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, CudaError::Peer(_))
    }
}

/// Attaches what was being done to a driver error.
pub(crate) trait DriverContext<T> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T, CudaError>;
}

impl<T> DriverContext<T> for Result<T, cudarc::driver::DriverError> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T, CudaError> {
        self.map_err(|source| CudaError::Driver {
            what: what(),
            source,
        })
    }
}
