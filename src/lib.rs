//! zeropp: fully sharded data-parallel training (ZeRO-3) with ZeRO++
//! communication for clusters with slow links between nodes.
//!
//! Layers, one way down: `cli` and `train` → `engine` → `zero` → `comm`.
//! `zero` holds the ZeRO++ collectives over flat buffers (qwZ, hpZ, qgZ),
//! which the native engine and the Python bindings (`python/`) both call;
//! the quantization formats live in `zeropp-quant`.

pub mod cli;
pub mod comm;
pub mod engine;
pub mod launch;
pub mod planner;
pub mod train;
pub mod zero;
