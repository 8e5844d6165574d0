//! The `zeropp` command line: one binary, one subcommand per tool.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use tracing_subscriber::EnvFilter;
use zeropp::cli::{bench_collectives, comm_check, example_weights, quant_error};
use zeropp::launch;
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
    /// Train the built-in byte-level GPT with ZeRO-3 or ZeRO++ sharding.
    ///
    /// Run as is, it launches itself as 2 logical nodes x 2 ranks on this
    /// machine (UCX between ranks: shared memory inside a node, TCP across;
    /// TCP when UCX is not installed) in ZeRO++ mode on a built-in corpus. Under
    /// a launcher (zeropp launch, torchrun-style variables, srun, mpirun) it
    /// runs as one rank of that job. Every flag has a TOML twin in --config
    /// (flags win); the same seed and data give the same losses on every run.
    ///
    /// Example: zeropp train --mode zero3 --steps 100 --summary-json out.json
    Train(Box<zeropp::cli::train::TrainArgs>),
    /// What this machine (or a captured one) is made of: NUMA nodes, GPUs
    /// and the PCIe/NVLink path between each pair, NICs with kind, speed
    /// and locality (virtual ones marked and not routed).
    ///
    /// Examples: zeropp topo; zeropp topo --json;
    /// zeropp topo --sysfs-root captured/; zeropp topo --nvidia-smi-topo topo.txt;
    /// zeropp topo --nccl-xml topo.xml
    Topo(zeropp::cli::topo::TopoArgs),
    /// Predict step time and throughput of ZeRO-3 and the ZeRO++ switch
    /// sets (the cost model of `zeropp_zero::cost`), per phase, and recommend one.
    ///
    /// Example (a 7B model on 16 nodes of 8 GPUs with one 100 Gbit/s NIC,
    /// 300 GB/s NVLink, 2 s of compute per step):
    /// zeropp plan --params 7e9 --nodes 16 --ranks-per-node 8
    ///   --intra-gbps 300 --nic-gbit 100 --compute-s 2 --quant-gbps 1000
    Plan(Box<zeropp::cli::plan::PlanArgs>),
    /// Inspect, verify, run or export a checkpoint.
    #[command(subcommand)]
    Ckpt(zeropp::cli::ckpt::CkptCommand),
    /// Sample text from a trained checkpoint's model (no Python needed).
    ///
    /// Feeds the prompt's UTF-8 bytes to the model and prints the prompt
    /// followed by the sampled bytes (invalid UTF-8 shown as U+FFFD, control
    /// characters but newline and tab as their pictures: ␛ for ESC).
    /// Deterministic for a seed; --temperature 0 takes the most likely
    /// byte each time.
    ///
    /// Example: zeropp generate ckpt/ --prompt "ROMEO:" --max-new-tokens 200
    Generate(zeropp::cli::generate::GenerateArgs),
    /// The CUDA kernels: compile-check them (no GPU needed), benchmark them.
    #[command(subcommand)]
    Cuda(CudaCommand),
    /// Measure the error block quantization would put on your weights.
    ///
    /// Reads every f32/bf16/f16 tensor of a safetensors file, quantizes it in
    /// the chosen format, dequantizes it and prints per tensor: elements,
    /// absmax, RMSE, max absolute error, relative L2 error, SNR in dB, and
    /// bytes before and after (block parameters included).
    ///
    /// Example: zeropp quant-error model.safetensors --bits 4 --block 256
    QuantError {
        /// The safetensors file to measure, or a directory of them (a sharded
        /// checkpoint: every *.safetensors in it, measured together).
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
    /// Start the ranks of a job on this machine.
    ///
    /// Without --node-rank, starts all NODES x RANKS_PER_NODE ranks here as
    /// logical nodes (for development: hierarchical groups work on one
    /// machine). With --node-rank K and --master-addr, starts node K's ranks
    /// of a multi-host job; run it once per host with the same ZEROPP_TOKEN.
    /// Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    /// NODE_RANK, MASTER_ADDR, MASTER_PORT and ZEROPP_TOKEN; its output lines
    /// are prefixed with `[rank R]`. When a rank fails the others are stopped
    /// and the launcher exits non-zero naming it.
    ///
    /// Example: zeropp launch --nodes 2 --ranks-per-node 2 -- zeropp comm-check
    Launch {
        #[arg(long, default_value_t = 1)]
        nodes: usize,
        #[arg(long, default_value_t = 1)]
        ranks_per_node: usize,
        /// Start only this node's ranks (multi-host).
        #[arg(long)]
        node_rank: Option<usize>,
        /// HOST[:PORT] of rank 0's rendezvous (multi-host; default port 29500).
        #[arg(long)]
        master_addr: Option<String>,
        /// Timeout of every network wait, in seconds (default 60).
        #[arg(long)]
        timeout: Option<f64>,
        /// Seconds the other ranks get to report and exit after one fails.
        #[arg(long, default_value_t = 3.0)]
        grace: f64,
        /// The job's islands (as `zeropp train --islands`): a failed rank
        /// stops only its island's ranks and the others train on; the
        /// launch fails when every island has.
        #[arg(long, default_value_t = 1)]
        islands: usize,
        /// With --islands: how many times in all a failed island's ranks
        /// are started again (ZEROPP_REJOIN=1, ZEROPP_ATTEMPT=N: its
        /// island's Nth restart) to rejoin the running job (any island:
        /// the launcher holds the job's store, ZEROPP_STORE).
        #[arg(long, default_value_t = 0)]
        restarts: usize,
        /// The command every rank runs.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Check every collective on this job's network (run under a launcher).
    ///
    /// Runs all-gather, reduce-scatter, all-reduce, all-to-all, broadcast and
    /// barrier on the world, node and cross-node groups at several sizes
    /// (including zero) against a reference, and prints one line per rank.
    CommCheck {
        /// Sizes in bytes to check.
        #[arg(long, value_delimiter = ',', default_value = "0,1,13,4099,1048576")]
        sizes: Vec<usize>,
        /// Afterwards, keep all-gathering 5 MiB blocks for this many seconds.
        #[arg(long)]
        loop_seconds: Option<f64>,
    },
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
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

#[derive(Subcommand)]
enum CudaCommand {
    /// Compile every kernel with NVRTC for each architecture and print
    /// registers, shared memory, stack and spills per kernel (ptxas'
    /// report). Any error or warning fails. Finds NVRTC and the CUDA headers
    /// in ZEROPP_NVRTC / ZEROPP_CUDA_INCLUDE, CUDA_HOME, /usr/local/cuda, the
    /// system library path or the nvidia wheels of python3; no GPU needed.
    ///
    /// Example: zeropp cuda compile-check --arch sm_80 --arch sm_90
    CompileCheck {
        /// Target architectures (sm_80, sm_90, ...).
        #[arg(long = "arch", default_values_t = ["sm_80".to_string(), "sm_90".to_string()])]
        archs: Vec<String>,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// GB/s of every kernel on a large input and the ratio to a device-to-
    /// device copy of the same bytes, measured in the same run. Needs a GPU.
    Bench {
        /// MiB of f32 input.
        #[arg(long, default_value_t = 1024)]
        mib: usize,
        /// Timed runs per kernel (the median is shown).
        #[arg(long, default_value_t = 10)]
        reps: usize,
        /// CUDA device number.
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Bandwidth of every collective against the transport's raw bandwidth.
    ///
    /// Run it under a launcher, e.g.
    /// `zeropp launch --nodes 2 --ranks-per-node 2 -- zeropp bench collectives`.
    /// Rank 0 prints one row per size: the raw point-to-point bandwidth with
    /// every rank sending to its ring successor, and for all-gather,
    /// reduce-scatter, all-reduce and all-to-all the bus bandwidth and its
    /// ratio to the raw figure.
    Collectives {
        /// Sizes of one rank's full buffer, e.g. 4K,64K,1M,16M.
        #[arg(long, value_delimiter = ',', value_parser = bench_collectives::parse_size,
              default_value = "4K,64K,1M,16M,64M,256M")]
        sizes: Vec<usize>,
        /// Timed repetitions per size (after one warm-up).
        #[arg(long, default_value_t = 5)]
        iters: usize,
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
    if matches!(
        cli.command,
        Command::Topo(_)
            | Command::Ckpt(_)
            | Command::Generate(_)
            | Command::Plan(_)
            | Command::QuantError { .. }
            | Command::Cuda(_)
            | Command::ExampleWeights { .. }
    ) {
        // Report-only commands: a closed pipe (`| head`) ends them quietly,
        // as it does any Unix tool. (Commands that talk to peers keep Rust's
        // default, where a closed socket is an error to handle.)
        // SAFETY: setting a signal disposition before any threads start.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match cli.command {
        Command::Train(args) => zeropp::cli::train::run(*args)?,
        Command::Topo(a) => zeropp::cli::topo::run(a)?,
        Command::Plan(a) => zeropp::cli::plan::run(&a)?,
        Command::Ckpt(c) => zeropp::cli::ckpt::run(c)?,
        Command::Generate(a) => zeropp::cli::generate::run(a)?,
        Command::Cuda(CudaCommand::CompileCheck { archs, json }) => {
            zeropp::cli::cuda_cli::compile_check(&archs, json)?;
        }
        Command::Cuda(CudaCommand::Bench { mib, reps, device }) => {
            zeropp::cli::cuda_cli::bench(device, mib, reps)?;
        }
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
        Command::Launch {
            nodes,
            ranks_per_node,
            node_rank,
            master_addr,
            timeout,
            grace,
            islands,
            restarts,
            command,
        } => launch::launch(&launch::LaunchOptions {
            nodes,
            ranks_per_node,
            node_rank,
            master: master_addr,
            timeout_s: timeout,
            grace: zeropp::comm::env::seconds(grace)
                .ok_or_else(|| anyhow::anyhow!("--grace {grace}: a number of seconds, 0 to 1e9"))?,
            rank0_terminal: false,
            islands,
            restarts,
            command,
        })?,
        Command::CommCheck {
            sizes,
            loop_seconds,
        } => {
            let limit = loop_seconds
                .map(|s| {
                    zeropp::comm::env::wait_limit(s).ok_or_else(|| {
                        anyhow::anyhow!("--loop-seconds {s}: {}", zeropp::comm::env::WAIT_LIMIT)
                    })
                })
                .transpose()?;
            comm_check::run(&sizes, limit)?
        }
        Command::Bench(BenchCommand::Collectives { sizes, iters }) => {
            bench_collectives::run(&sizes, iters.max(1))?
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

/// Large buffers on transparent huge pages. A buffer of 2 MiB or more is
/// a fresh mapping (the mmap threshold below); asking the kernel for huge
/// pages on it (`madvise(MADV_HUGEPAGE)`, honoured when
/// `/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` or `always`)
/// turns 512 page faults per 2 MiB into one. The unit-sized buffers of
/// every step (decoded weights, gradients, payloads) are written whole,
/// so resident memory barely moves and small models' steps get faster
/// (docs/BENCHMARKS.md has both). Everything else is the system allocator.
struct HugePageAlloc;

const HUGE_PAGE: usize = 2 << 20;

fn advise_huge(p: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    if len >= HUGE_PAGE && !p.is_null() {
        let start = (p as usize).next_multiple_of(HUGE_PAGE);
        let end = (p as usize + len) / HUGE_PAGE * HUGE_PAGE;
        if end > start {
            // SAFETY: [start, end) lies inside the allocation just made;
            // MADV_HUGEPAGE only changes how its pages are backed.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// advice does not touch the memory's contents or its ownership.
unsafe impl std::alloc::GlobalAlloc for HugePageAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let p = unsafe { std::alloc::System.alloc(layout) };
        advise_huge(p, layout.size());
        p
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        let p = unsafe { std::alloc::System.alloc_zeroed(layout) };
        advise_huge(p, layout.size());
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(p, layout) }
    }

    unsafe fn realloc(&self, p: *mut u8, layout: std::alloc::Layout, size: usize) -> *mut u8 {
        let q = unsafe { std::alloc::System.realloc(p, layout, size) };
        advise_huge(q, size);
        q
    }
}

#[global_allocator]
static ALLOCATOR: HugePageAlloc = HugePageAlloc;

/// glibc's malloc raises its mmap threshold to the size of every large
/// buffer freed, after which such buffers come from the heap and their
/// memory stays with the process: a training step's per-unit buffers then
/// hold the peak resident set well above what is live (docs/BENCHMARKS.md). A fixed threshold keeps
/// unit-sized buffers mapped and returns them when freed. It sits at 2 MiB,
/// not lower: below it are the model's activations and their gradients,
/// allocated and freed by every operation, and a mapped buffer faults on
/// every page at its first write, and at lower thresholds those faults
/// dominated a small model's step. The trim threshold (16 MiB) lets the heap keep that
/// much free memory at its top instead of returning and refaulting it at
/// every operation. MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ set by
/// the user win.
fn fix_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    for (var, param, value) in [
        ("MALLOC_MMAP_THRESHOLD_", libc::M_MMAP_THRESHOLD, 2 << 20),
        ("MALLOC_TRIM_THRESHOLD_", libc::M_TRIM_THRESHOLD, 16 << 20),
    ] {
        if std::env::var_os(var).is_none() {
            // SAFETY: mallopt only sets an allocator parameter; no thread
            // allocates concurrently this early.
            unsafe {
                libc::mallopt(param, value);
            }
        }
    }
}

fn main() -> ExitCode {
    fix_mmap_threshold();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour only for a terminal: a log file or a launcher's pipe gets
        // plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cmd = Cli::command().mut_subcommand("train", zeropp::cli::train::with_defaults);
    let cli = match Cli::from_arg_matches(&cmd.get_matches()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            // Stopped by a signal: the shell's convention, 128 + its number.
            let signal = e.chain().find_map(|c| match c.downcast_ref() {
                Some(launch::LaunchError::Interrupted { signal }) => Some(*signal),
                _ => None,
            });
            signal.map_or(ExitCode::FAILURE, |s| ExitCode::from(128 + s as u8))
        }
    }
}

/// An error and its causes, each joined with ": " as anyhow's `{:#}` does,
/// but a cause the message before it already ends with is said once
/// (errors that name their source in their own message).
fn error_chain(e: &anyhow::Error) -> String {
    let mut said = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if said.ends_with(&text) {
            continue;
        }
        if !said.is_empty() {
            said.push_str(": ");
        }
        said.push_str(&text);
    }
    said
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[test]
    fn a_cause_its_error_already_names_is_said_once_and_context_is_kept() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let spawn = zeropp::comm::launch::LaunchError::Spawn {
            program: "x".into(),
            rank: 0,
            source: io(),
        };
        let e = anyhow::Error::from(spawn);
        assert_eq!(
            error_chain(&e),
            "cannot start \"x\" for rank 0: no such file"
        );
        let e = anyhow::Error::from(io()).context("reading the data");
        assert_eq!(error_chain(&e), "reading the data: no such file");
    }
}
