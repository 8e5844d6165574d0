//! The command-line tools beside training: one file per subcommand.

pub mod bench_collectives;
pub mod ckpt;
pub mod comm_check;
pub mod cuda_cli;
pub mod example_weights;
pub mod generate;
pub mod plan;
pub mod quant_error;
pub mod topo;
pub mod train;
