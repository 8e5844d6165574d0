//! The `zeropp` command line: one binary, one subcommand per tool.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use tracing_subscriber::EnvFilter;
use zeropp::cli::{bench_collectives, comm_check, example_weights, quant_error};
use zeropp::launch;
use zeropp::train::config::{Mode, TrainConfig};
use zeropp::train::local;
use zeropp::train::trainer;
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
    Train(Box<TrainArgs>),
    /// What this machine (or a captured one) is made of: NUMA nodes, GPUs
    /// and the PCIe/NVLink path between each pair, NICs with kind, speed
    /// and locality (virtual ones marked and not routed).
    ///
    /// Examples: zeropp topo; zeropp topo --json;
    /// zeropp topo --sysfs-root captured/; zeropp topo --nvidia-smi-topo topo.txt;
    /// zeropp topo --nccl-xml topo.xml
    Topo {
        #[command(subcommand)]
        action: Option<TopoAction>,
        /// Read this captured root (holding sys/ and proc/) instead of /.
        #[arg(long, global = true)]
        sysfs_root: Option<PathBuf>,
        /// Parse the text of `nvidia-smi topo -m` instead.
        #[arg(long, global = true, conflicts_with = "sysfs_root")]
        nvidia_smi_topo: Option<PathBuf>,
        /// Read an NCCL topology dump (NCCL_TOPO_DUMP_FILE) instead.
        #[arg(long, global = true, conflicts_with_all = ["sysfs_root", "nvidia_smi_topo"])]
        nccl_xml: Option<PathBuf>,
        /// Print JSON instead of the human view.
        #[arg(long, global = true)]
        json: bool,
    },
    /// Predict step time and throughput of ZeRO-3 and the ZeRO++ switch
    /// sets (the cost model of `zeropp::planner`), per phase, and recommend one.
    ///
    /// Example (a 7B model on 16 nodes of 8 GPUs with one 100 Gbit/s NIC,
    /// 300 GB/s NVLink, 2 s of compute per step):
    /// zeropp plan --params 7e9 --nodes 16 --ranks-per-node 8
    ///   --intra-gbps 300 --nic-gbit 100 --compute-s 2 --quant-gbps 1000
    Plan(Box<zeropp::cli::plan::PlanArgs>),
    /// Inspect, verify, run or export a checkpoint.
    #[command(subcommand)]
    Ckpt(CkptCommand),
    /// Sample text from a trained checkpoint's model (no Python needed).
    ///
    /// Feeds the prompt's UTF-8 bytes to the model and prints the prompt
    /// followed by the sampled bytes (invalid UTF-8 shown as U+FFFD).
    /// Deterministic for a seed; --temperature 0 takes the most likely
    /// byte each time.
    ///
    /// Example: zeropp generate ckpt/ --prompt "ROMEO:" --max-new-tokens 200
    Generate {
        /// A checkpoint, or a checkpoint directory (its latest).
        dir: PathBuf,
        #[arg(long)]
        prompt: String,
        #[arg(long, default_value_t = 200)]
        max_new_tokens: usize,
        /// Softmax temperature; 0: greedy.
        #[arg(long, default_value_t = 0.8)]
        temperature: f64,
        /// Sample from the K most likely bytes (0: all 256).
        #[arg(long, default_value_t = 40)]
        top_k: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
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

#[derive(clap::Args, Debug)]
struct TrainArgs {
    /// A TOML file with any of the settings below (flags override it).
    #[arg(long)]
    config: Option<PathBuf>,
    /// zero3 (all switches off, bf16 communication) or zeropp (qwZ int4
    /// weight differences + hpZ + qgZ int4 with a rotated hop across
    /// nodes).
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// qwZ: bits of the forward weight gather (8, 4; 0 = off); zeropp's
    /// default: 4 with --qwz-delta, else 8.
    #[arg(long)]
    qwz_bits: Option<u32>,
    /// hpZ: node-local secondary shards for the backward gather.
    #[arg(long)]
    hpz: Option<bool>,
    /// Ranks sharing an hpZ secondary shard, consecutive local ranks of a
    /// node (a divisor of --ranks-per-node). Default: the routing plan's
    /// choice — the node, or an NVLink island on a PCIe box.
    #[arg(long)]
    hpz_group: Option<usize>,
    /// qgZ: two-hop int4 gradient reduce-scatter.
    #[arg(long)]
    qgz: Option<bool>,
    /// Error feedback for qgZ, on both hops (default: on with qgZ).
    #[arg(long)]
    error_feedback: Option<bool>,
    /// qgZ: round gradients stochastically (true) or to nearest (default).
    #[arg(long)]
    qgz_stochastic: Option<bool>,
    /// Values per weight quantization block (qwZ; power of two, 32..65536).
    #[arg(long)]
    block: Option<usize>,
    /// Values per gradient quantization block (qgZ).
    #[arg(long)]
    qgz_block: Option<usize>,
    /// Bits of qgZ's first hop, inside the node (8 or 4; across nodes: 4).
    /// Default: the routing plan's — int8, unless the hop inside the node
    /// is about as slow per rank as the hop across.
    #[arg(long)]
    qgz_intra_bits: Option<u32>,
    /// Unquantized traffic (weights without qwZ, gradients without qgZ) in
    /// fp32 instead of bf16.
    #[arg(long)]
    fp32_comm: Option<bool>,
    /// qwZ sends weight differences across nodes, at --qwz-bits, against a
    /// reference every receiver keeps (docs/TRAINING.md); zeropp's default:
    /// on with qwZ across nodes.
    #[arg(long)]
    qwz_delta: Option<bool>,
    /// Forward gathers of a unit between full refreshes of the qwZ
    /// references (with --qwz-delta).
    #[arg(long)]
    qwz_refresh: Option<usize>,
    /// qgZ's hop across nodes rotates each block (Walsh–Hadamard) before
    /// quantizing, spreading outliers over the block; zeropp's default: on
    /// with qgZ.
    #[arg(long)]
    qgz_hadamard: Option<bool>,
    /// Values per quantization block of qgZ's hop across nodes (default:
    /// 64 in zeropp mode, else --qgz-block).
    #[arg(long)]
    qgz_inter_block: Option<usize>,
    #[arg(long)]
    steps: Option<usize>,
    /// Sequences per rank per step.
    #[arg(long)]
    batch: Option<usize>,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long)]
    lr: Option<f32>,
    #[arg(long)]
    warmup_steps: Option<usize>,
    /// Skip a step whose loss or gradient is NaN/Inf (no update) instead of
    /// stopping the run.
    #[arg(long)]
    skip_nonfinite: Option<bool>,
    /// Model width, layers, heads and context length.
    #[arg(long)]
    width: Option<usize>,
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long)]
    heads: Option<usize>,
    #[arg(long)]
    context: Option<usize>,
    /// Tie the head's output matrix to the token embedding.
    #[arg(long)]
    tied_head: Option<bool>,
    /// Train on this UTF-8 text file instead of the built-in corpus.
    #[arg(long)]
    data: Option<PathBuf>,
    /// ucx or tcp. Unset: ZEROPP_TRANSPORT when set, else UCX when libucp
    /// loads (a note says when it does not and TCP is used).
    #[arg(long, value_name = "ucx|tcp")]
    transport: Option<zeropp::comm::job::TransportKind>,
    /// Logical nodes and ranks per node when launching itself.
    #[arg(long)]
    nodes: Option<usize>,
    #[arg(long)]
    ranks_per_node: Option<usize>,
    /// Print a progress line every N steps.
    #[arg(long)]
    log_every: Option<usize>,
    /// Batches per rank for the validation loss at the end.
    #[arg(long)]
    val_batches: Option<usize>,
    /// Write one JSON object per step here.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Write the end-of-run summary here as JSON (with --compare: both).
    #[arg(long)]
    summary_json: Option<PathBuf>,
    /// Draw the loss curve here as PNG (with --compare: both).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Save sharded checkpoints in this directory (every --save-every steps
    /// and at the end).
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints (0: only at the end).
    #[arg(long)]
    save_every: Option<usize>,
    /// Checkpoints to keep (0: all; default 3).
    #[arg(long)]
    keep: Option<usize>,
    /// Continue from a checkpoint (or the latest in a checkpoint directory),
    /// with its settings unless flags or --config say otherwise. A different
    /// --nodes/--ranks-per-node re-cuts the shards.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Stop after this step (saving a checkpoint when --checkpoint-dir is
    /// set); the learning-rate schedule still spans --steps.
    #[arg(long)]
    stop_after: Option<usize>,
    /// Run zero3, then zeropp, with the same seed and data on this machine
    /// and print them side by side (switch overrides apply to zeropp).
    #[arg(long)]
    compare: bool,
    /// With --compare: measure parity over these seeds (0..5, 0..=4 or
    /// 1,5,9): per seed ZeRO-3, ZeRO-3 with fp32 communication (the noise
    /// floor) and ZeRO++; prints the gaps per seed and as mean and spread
    /// beside the noise floor (--summary-json writes them).
    #[arg(long, requires = "compare", value_parser = zeropp::train::parity::parse_seeds)]
    seeds: Option<zeropp::train::parity::Seeds>,
    /// Timeout of every network wait, in seconds (default 60).
    #[arg(long)]
    timeout: Option<f64>,
}

impl TrainArgs {
    fn config(&self) -> Result<TrainConfig> {
        let mut c = match (&self.config, &self.resume) {
            (Some(p), _) => TrainConfig::from_toml_file(p)?,
            // Resuming: the checkpoint's settings, flags override them.
            (None, Some(r)) => {
                let dir = zeropp::train::checkpoint::resolve(r)?;
                let mut c = zeropp::train::checkpoint::read_manifest(&dir)?.config;
                (c.resume, c.stop_after) = (None, None);
                // How ranks talk is this machine's choice, not the checkpoint's.
                c.transport = None;
                c
            }
            (None, None) => TrainConfig::default(),
        };
        macro_rules! set {
            ($($field:ident => $target:expr),* $(,)?) => {
                $(if let Some(v) = self.$field.clone() { $target = v; })*
            };
        }
        set!(mode => c.mode, block => c.block, steps => c.steps, batch => c.batch, seed => c.seed,
             lr => c.optim.lr, warmup_steps => c.optim.warmup_steps,
             skip_nonfinite => c.optim.skip_nonfinite, width => c.model.width,
             layers => c.model.layers, heads => c.model.heads, context => c.model.context,
             nodes => c.nodes, ranks_per_node => c.ranks_per_node, log_every => c.log_every,
             qgz_stochastic => c.qgz_stochastic,
             qgz_block => c.qgz_block, val_batches => c.val_batches,
             fp32_comm => c.fp32_comm, tied_head => c.model.tied_head,
             qwz_refresh => c.qwz_refresh);
        if self.qgz_hadamard.is_some() {
            c.qgz_hadamard = self.qgz_hadamard;
        }
        if self.qgz_inter_block.is_some() {
            c.qgz_inter_block = self.qgz_inter_block;
        }
        if self.qwz_delta.is_some() {
            c.qwz_delta = self.qwz_delta;
        }
        if self.qwz_bits.is_some() {
            c.qwz_bits = self.qwz_bits;
        }
        if self.hpz.is_some() {
            c.hpz = self.hpz;
        }
        if self.hpz_group.is_some() {
            c.hpz_group = self.hpz_group;
        }
        if self.qgz_intra_bits.is_some() {
            c.qgz_intra_bits = self.qgz_intra_bits;
        }
        if self.qgz.is_some() {
            c.qgz = self.qgz;
        }
        if self.error_feedback.is_some() {
            c.error_feedback = self.error_feedback;
        }
        if self.data.is_some() {
            c.data = self.data.clone();
        }
        if self.metrics.is_some() {
            c.metrics = self.metrics.clone();
        }
        if self.summary_json.is_some() {
            c.summary_json = self.summary_json.clone();
        }
        set!(save_every => c.save_every, keep => c.keep);
        for (flag, field) in [
            (&self.checkpoint_dir, &mut c.checkpoint_dir),
            (&self.resume, &mut c.resume),
        ] {
            if flag.is_some() {
                *field = flag.clone();
            }
        }
        if self.stop_after.is_some() {
            c.stop_after = self.stop_after;
        }
        if self.transport.is_some() {
            c.transport = self.transport;
        }
        if self.plot.is_some() {
            c.plot = self.plot.clone();
        }
        c.validate()?;
        Ok(c)
    }
}

#[derive(Subcommand)]
enum TopoAction {
    /// Write exactly the files detection reads to OUT.tar.zst (attach it
    /// to a bug report; unpack with `tar --zstd -xf OUT.tar.zst -C DIR` and
    /// read it with `zeropp topo --sysfs-root DIR`).
    Capture { out: PathBuf },
    /// The routing plan for N nodes like this one, G ranks each: hop
    /// classes with estimated bandwidth, hpZ group, qgZ bits per hop, each
    /// rank's NIC and the NCCL/UCX environment, with the reason for each.
    Plan {
        #[arg(long)]
        nodes: usize,
        #[arg(long)]
        ranks_per_node: usize,
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
enum CkptCommand {
    /// Print a checkpoint's manifest and verify every shard (size,
    /// checksum, contents). DIR is a checkpoint or a checkpoint directory
    /// (its latest). Exits non-zero naming the bad file.
    Inspect {
        dir: PathBuf,
        /// Print the manifest as JSON instead.
        #[arg(long)]
        json: bool,
    },
    /// Write the checkpoint's full model (fp32).
    ///
    /// --format zeropp (the default): one safetensors file OUT, tensors named
    /// like blocks.0.attn.qkv.weight ([in, out] layout). --format hf: a
    /// directory OUT that Hugging Face transformers loads as a GPT-2
    /// (GPT2LMHeadModel.from_pretrained(OUT), AutoTokenizer.from_pretrained(OUT):
    /// config.json, model.safetensors, a byte-level tokenizer).
    ///
    /// Example: zeropp ckpt export ckpt/ gpt2-out --format hf
    Export {
        dir: PathBuf,
        out: PathBuf,
        #[arg(long, value_enum, default_value_t = ExportFormat::Zeropp)]
        format: ExportFormat,
    },
    /// Run the checkpoint's model on text: the next-byte loss (mean
    /// cross-entropy, each byte predicting the next) and, with --logits,
    /// the logits as a safetensors file (one tensor "logits",
    /// [texts, bytes, vocab]).
    ///
    /// Example: zeropp ckpt eval ckpt/ --text "to be or not" --json
    Eval {
        dir: PathBuf,
        /// Text to run, as UTF-8 bytes; repeat for a batch (same byte length).
        #[arg(long, required = true)]
        text: Vec<String>,
        /// Write the logits here.
        #[arg(long)]
        logits: Option<PathBuf>,
        /// Print JSON ({"loss", "texts", "bytes"}).
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum ExportFormat {
    /// zeropp's own names, one safetensors file.
    Zeropp,
    /// A Hugging Face GPT-2 directory.
    Hf,
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
        Command::Topo { .. } | Command::Ckpt(_) | Command::Generate { .. }
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
        Command::Train(args) => {
            let cfg = args.config()?;
            match zeropp::comm::env::RankFacts::from_env() {
                Err(zeropp::comm::env::EnvError::Missing) if args.compare => match &args.seeds {
                    Some(seeds) => {
                        zeropp::train::parity::measure(&cfg, &seeds.0, args.timeout)?;
                    }
                    None => {
                        local::compare(&cfg, args.timeout)?;
                    }
                },
                // No launcher around us: be one, over this machine.
                Err(zeropp::comm::env::EnvError::Missing) => {
                    local::launch_local(&cfg, args.timeout)?
                }
                Ok(_) if args.compare => bail!(
                    "--compare launches its own runs on this machine; run it outside a launcher"
                ),
                Err(e) => return Err(e.into()),
                Ok(facts) => {
                    // Under another launcher (torchrun, mpirun, srun): this
                    // host's cores shared among its ranks, unless the user
                    // set RAYON_NUM_THREADS (zeropp launch sets it itself).
                    if let Some(n) = zeropp::launch::compute_threads(facts.local_world_size) {
                        // SAFETY: no other thread runs yet to read the
                        // environment concurrently.
                        unsafe { std::env::set_var("RAYON_NUM_THREADS", n.to_string()) };
                    }
                    trainer::run_rank(&cfg)?;
                }
            }
        }
        Command::Topo {
            action: Some(TopoAction::Capture { out }),
            sysfs_root,
            ..
        } => {
            let root = sysfs_root.unwrap_or_else(|| PathBuf::from("/"));
            zeropp_topology::detect::detect(&root)?;
            let entries = zeropp_topology::capture::capture(&root);
            let tar = zeropp_topology::capture::to_tar(&entries).map_err(anyhow::Error::msg)?;
            let packed = zstd::encode_all(&tar[..], 19).context("compressing the capture")?;
            std::fs::write(&out, &packed)
                .with_context(|| format!("cannot write {}", out.display()))?;
            println!(
                "captured {} entries ({} bytes) to {}",
                entries.len(),
                packed.len(),
                out.display()
            );
        }
        Command::Topo {
            action,
            sysfs_root,
            nvidia_smi_topo,
            nccl_xml,
            json,
        } => {
            let read = |f: &PathBuf| {
                std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))
            };
            let topo = match (nvidia_smi_topo, nccl_xml) {
                (Some(f), _) => zeropp_topology::smi::parse(&read(&f)?).with_context(|| {
                    format!("{} is not `nvidia-smi topo -m` output", f.display())
                })?,
                (_, Some(f)) => {
                    let host = f.file_stem().map(|s| s.to_string_lossy().into_owned());
                    zeropp_topology::nccl::parse(&read(&f)?, host.as_deref().unwrap_or("nccl-xml"))
                        .with_context(|| format!("{} is not an NCCL topology dump", f.display()))?
                }
                (None, None) => zeropp_topology::detect::detect(
                    sysfs_root.as_deref().unwrap_or(std::path::Path::new("/")),
                )?,
            };
            match action {
                Some(TopoAction::Plan {
                    nodes,
                    ranks_per_node,
                }) => {
                    let plan = zeropp_topology::plan::plan(&topo, nodes, ranks_per_node)
                        .map_err(anyhow::Error::msg)?;
                    if json {
                        println!("{}", serde_json::to_string_pretty(&plan)?);
                    } else {
                        print!("{}", plan.render());
                    }
                }
                _ if json => println!("{}", serde_json::to_string_pretty(&topo)?),
                _ => print!("{}", topo.render()),
            }
        }
        Command::Plan(a) => zeropp::cli::plan::run(&a)?,
        Command::Ckpt(CkptCommand::Inspect { dir, json }) => {
            let dir = zeropp::train::checkpoint::resolve(&dir)?;
            let m = zeropp::train::checkpoint::read_manifest(&dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&m)?);
            } else {
                print!("{}", zeropp::train::checkpoint::describe(&dir, &m));
            }
            zeropp::train::checkpoint::verify(&dir, &m)?;
            if !json {
                println!("all {} shards verified", m.shards.len());
            }
        }
        Command::Ckpt(CkptCommand::Export {
            dir,
            out,
            format: ExportFormat::Zeropp,
        }) => {
            let dir = zeropp::train::checkpoint::resolve(&dir)?;
            let m = zeropp::train::checkpoint::read_manifest(&dir)?;
            let n = zeropp::train::checkpoint::export(&dir, &m, &out)?;
            println!("wrote {n} tensors of step {} to {}", m.step, out.display());
        }
        Command::Ckpt(CkptCommand::Export {
            dir,
            out,
            format: ExportFormat::Hf,
        }) => {
            let (n, step) = zeropp::train::hf::export_dir(&dir, &out)?;
            println!(
                "wrote a GPT-2 of {n} tensors (step {step}) to {}: \
                 transformers.GPT2LMHeadModel.from_pretrained({:?})",
                out.display(),
                out.display().to_string()
            );
        }
        Command::Ckpt(CkptCommand::Eval {
            dir,
            text,
            logits,
            json,
        }) => {
            let model = zeropp::train::infer::Model::load(&dir)?;
            let batch = zeropp::train::infer::byte_ids(&text);
            let (loss, out) = model.loss(&batch)?;
            if let Some(p) = &logits {
                zeropp::train::infer::write_logits(p, &out)?;
            }
            if json {
                let j = serde_json::json!({
                    "loss": loss, "texts": batch.len(), "bytes": batch[0].len()
                });
                println!("{j}");
            } else {
                println!(
                    "loss {loss:.4} (next-byte cross-entropy over {} text(s) of {} bytes)",
                    batch.len(),
                    batch[0].len()
                );
            }
        }
        Command::Generate {
            dir,
            prompt,
            max_new_tokens,
            temperature,
            top_k,
            seed,
        } => {
            let model = zeropp::train::infer::Model::load(&dir)?;
            let new =
                model.generate(prompt.as_bytes(), max_new_tokens, temperature, top_k, seed)?;
            let mut all = prompt.into_bytes();
            all.extend(new);
            println!("{}", String::from_utf8_lossy(&all));
        }
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
            command,
        } => launch::launch(&launch::LaunchOptions {
            nodes,
            ranks_per_node,
            node_rank,
            master: master_addr,
            timeout_s: timeout,
            grace: std::time::Duration::from_secs_f64(grace.max(0.0)),
            rank0_terminal: false,
            command,
        })?,
        Command::CommCheck {
            sizes,
            loop_seconds,
        } => comm_check::run(&sizes, loop_seconds.map(std::time::Duration::from_secs_f64))?,
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
/// so resident memory barely moves (docs/BENCHMARKS.md); the 3.76M-parameter
/// one-rank step got 18–27% faster. Everything else is the system allocator.
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
/// hold the peak resident set ~15% above what is live (measured on the
/// 25M-parameter model, docs/BENCHMARKS.md). A fixed threshold keeps
/// unit-sized buffers mapped and returns them when freed. It sits at 2 MiB,
/// not lower: below it are the model's activations and their gradients,
/// allocated and freed by every operation, and a mapped buffer faults on
/// every page at its first write — at 256 KiB those faults took half of a
/// small model's step. The trim threshold (16 MiB) lets the heap keep that
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
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
