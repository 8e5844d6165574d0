//! The command-line tools beside training: one file per subcommand.

pub mod bench_collectives;
pub mod comm_check;
pub mod cuda_cli;
pub mod example_weights;
pub mod plan;
pub mod quant_error;
