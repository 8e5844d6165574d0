//! zeropp: fully sharded data-parallel training (ZeRO-3) with ZeRO++
//! communication for clusters with slow links between nodes.
//!
//! Layers, one way down: `cli` and `train` → `engine` → `zero` → `comm`.
//! This crate holds the top three; `zero` (the ZeRO++ collectives over flat
//! buffers: qwZ, hpZ, qgZ, which the native engine and the Python bindings
//! both call) and `comm` are the crates `zeropp-zero` and `zeropp-comm`,
//! re-exported here; the quantization formats live in `zeropp-quant`
//! (docs/ARCHITECTURE.md).

pub mod cli;
pub mod train;

/// The communication layer (crate `zeropp-comm`).
pub use zeropp_comm as comm;
/// `zeropp launch` (in `zeropp-comm`, with the rest of joining a job).
pub use zeropp_comm::launch;
/// The sharding engine (crate `zeropp-engine`).
pub use zeropp_engine as engine;
/// The ZeRO++ collectives (crate `zeropp-zero`).
pub use zeropp_zero as zero;
/// `zeropp plan`'s cost model (in `zeropp-zero`, beside the switches it
/// prices).
pub use zeropp_zero::planner;
