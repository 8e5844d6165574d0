//! The `zeropp` command line: one binary, one subcommand per tool.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand, ValueEnum};
use tracing_subscriber::EnvFilter;
use zeropp::{example_weights, quant_error};
use zeropp_quant::{Bits, QuantFormat, Rounding, Scheme};

/// zeropp: ZeRO-3 sharded training with ZeRO++ communication (quantized
/// weight gathers, node-local secondary shards, quantized two-hop gradient
/// reduce-scatter) for clusters with slow links between nodes.
///
/// Logs go to stderr; set RUST_LOG=debug for more.
#[derive(Parser)]
#[command(name = "zeropp", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Measure the error block quantization would put on your weights.
    ///
    /// Reads every f32/bf16/f16 tensor of a safetensors file, quantizes it in
    /// the chosen format, dequantizes it and prints per tensor: elements,
    /// absmax, RMSE, max absolute error, relative L2 error, SNR in dB, and
    /// bytes before and after (block parameters included).
    ///
    /// Example: zeropp quant-error model.safetensors --bits 4 --block 256
    QuantError {
        /// The safetensors file to measure.
        file: PathBuf,
        /// Bits per value: 8, 4 or 2.
        #[arg(long, default_value_t = 8)]
        bits: u32,
        /// Values per block (one scale each): a power of two, 32 to 65536.
        #[arg(long, default_value_t = 256)]
        block: usize,
        /// Use min/max (asymmetric) blocks instead of absmax (symmetric).
        #[arg(long)]
        asymmetric: bool,
        /// How values pick their codes.
        #[arg(long, value_enum, default_value_t = RoundingArg::Nearest)]
        rounding: RoundingArg,
        /// Seed of the stochastic rounding.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Write a synthetic GPT-shaped checkpoint to try quant-error on.
    ///
    /// Embeddings, layer norms, attention (with outliers) and MLP matrices in
    /// f32, bf16 and f16; deterministic for a seed. No download needed.
    ExampleWeights {
        /// Where to write the .safetensors file.
        out: PathBuf,
        /// Transformer blocks.
        #[arg(long, default_value_t = 4)]
        layers: usize,
        /// Model width.
        #[arg(long, default_value_t = 256)]
        dim: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum RoundingArg {
    /// Round half to even (deterministic; what weights use).
    Nearest,
    /// Stochastic rounding (unbiased; what gradients use).
    Stochastic,
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::QuantError {
            file,
            bits,
            block,
            asymmetric,
            rounding,
            seed,
            json,
        } => {
            let scheme = if asymmetric {
                Scheme::Asymmetric
            } else {
                Scheme::Symmetric
            };
            let format = QuantFormat::new(Bits::from_u32(bits)?, scheme, block)?;
            let rounding = match rounding {
                RoundingArg::Nearest => Rounding::NearestEven,
                RoundingArg::Stochastic => Rounding::Stochastic { seed },
            };
            let report = quant_error::analyze(&file, format, rounding)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", quant_error::render_table(&report));
            }
        }
        Command::ExampleWeights {
            out,
            layers,
            dim,
            seed,
        } => {
            let n = example_weights::write(&out, layers, dim, seed)?;
            tracing::info!("wrote {n} tensors to {}", out.display());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
