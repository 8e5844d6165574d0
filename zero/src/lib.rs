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

mod backends;
mod base;
mod collectives;
pub mod error;
mod jobs;
mod policy;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

// The folders show the layers (base, backends, collectives, policy, jobs); each
// module keeps its path at the crate's root.
pub use backends::{backend, device, devices, emulated, host, work};
pub use base::{groups, layout, measured, payload, traffic};
pub use collectives::{allreduce, delta, fsdp, hpz, islands, outer, qgz, qwz, residual};
pub use jobs::device_job;
pub use policy::{cost, job, plan, planner, probe, routing};

pub use backend::{ByteMover, Hop, Quantizer};
pub use error::ZeroError;
pub use groups::ZeroGroups;
pub use zeropp_comm::scratch;
