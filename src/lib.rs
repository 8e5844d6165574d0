//! zeropp: fully sharded data-parallel training (ZeRO-3) with ZeRO++
//! communication for clusters with slow links between nodes.
//!
//! This crate holds the engine, collectives, transports and the command-line
//! tools; the quantization formats live in `zeropp-quant`.

pub mod bench_collectives;
pub mod checkpoint;
pub mod comm;
pub mod comm_check;
pub mod cuda_cli;
pub mod data;
pub mod engine;
pub mod example_weights;
pub mod launch;
pub mod model;
pub mod planner;
pub mod plot;
pub mod quant_error;
pub mod trainer;
