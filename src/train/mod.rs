//! Training the built-in model: the trainer and its config, the data, the
//! byte-level GPT, and sharded checkpoints. Calls the engine; nothing below
//! it calls back up.

pub mod auto_islands;
pub mod checkpoint;
pub mod config;
pub mod data;
#[cfg(test)]
mod engine_tests;
pub mod hf;
pub mod infer;
pub mod local;
pub mod model;
pub mod ops;
pub mod parity;
pub mod plot;
pub mod summary;
pub mod trainer;
