//! The ZeRO++ collectives over flat buffers — qwZ (quantized, hierarchical
//! weight gather), hpZ (secondary shards gathered inside their group) and
//! qgZ (two-hop quantized gradient reduce-scatter with f32 sums and error
//! feedback) — with the plan that turns switches into wire formats, the
//! payload codecs, the standard groups and the byte counters. The native
//! engine and the Python bindings both call this crate; neither has a
//! copy of it.
//!
//! qgZ is written once over two interfaces ([`backend`]): a [`Quantizer`]
//! and a [`ByteMover`], with three backends — the host ([`host`]:
//! zeropp-quant and zeropp's transports), the GPU ([`device`]: the CUDA
//! kernels and NCCL) and the emulated device ([`emulated`]: the CUDA
//! kernels' source on host buffers, moved by the host transports).

pub mod allreduce;
pub mod backend;
pub mod cost;
pub mod delta;
pub mod device;
pub mod device_job;
pub mod emulated;
pub mod error;
pub mod fsdp;
pub mod groups;
pub mod host;
pub mod hpz;
pub mod job;
pub mod layout;
pub mod measured;
pub mod outer;
pub mod payload;
pub mod plan;
pub mod planner;
pub mod probe;
pub mod qgz;
pub mod qwz;
pub mod residual;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod traffic;
pub mod work;

pub use backend::{ByteMover, Hop, Quantizer};
pub use error::ZeroError;
pub use groups::ZeroGroups;
pub use zeropp_comm::scratch;
