//! The ZeRO++ collectives over flat buffers — qwZ (quantized, hierarchical
//! weight gather), hpZ (secondary shards gathered inside their group) and
//! qgZ (two-hop quantized gradient reduce-scatter with f32 sums and error
//! feedback) — with the plan that turns switches into wire formats, the
//! payload codecs, the standard groups and the byte counters. The native
//! engine and the Python bindings both call this module; neither has a
//! copy of it.

pub mod groups;
pub mod hpz;
pub mod payload;
pub mod plan;
pub mod qgz;
pub mod qwz;
pub mod residual;
pub mod traffic;

pub use groups::ZeroGroups;
