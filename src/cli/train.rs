//! `zeropp train`'s command line: every setting as a flag (each with a
//! TOML twin in `--config`), merged over the config file, a resumed
//! checkpoint's settings or the defaults; then the run itself — one rank
//! under a launcher, else the whole job on this machine, or `--compare`.

use std::path::PathBuf;

use anyhow::{Result, bail};

use crate::train::config::{Mode, TrainConfig};
use crate::train::{local, trainer};

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// A TOML file with any of the settings below (flags override it).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// zero3 (all switches off, bf16 communication) or zeropp (qwZ int4
    /// weight differences + hpZ + qgZ int4 with a rotated hop across
    /// nodes).
    #[arg(long, value_enum)]
    pub mode: Option<Mode>,
    /// qwZ: bits of the forward weight gather (8, 4; 0 = off); zeropp's
    /// default: 4 with --qwz-delta, else 8.
    #[arg(long)]
    pub qwz_bits: Option<u32>,
    /// hpZ: node-local secondary shards for the backward gather.
    #[arg(long)]
    pub hpz: Option<bool>,
    /// Ranks sharing an hpZ secondary shard, consecutive local ranks of a
    /// node (a divisor of --ranks-per-node). Default: the routing plan's
    /// choice — the node, or an NVLink island on a PCIe box.
    #[arg(long)]
    pub hpz_group: Option<usize>,
    /// qgZ: two-hop int4 gradient reduce-scatter.
    #[arg(long)]
    pub qgz: Option<bool>,
    /// Error feedback for qgZ, on both hops (default: on with qgZ).
    #[arg(long)]
    pub error_feedback: Option<bool>,
    /// qgZ: round gradients stochastically (true) or to nearest (default).
    #[arg(long)]
    pub qgz_stochastic: Option<bool>,
    /// Values per weight quantization block (qwZ; power of two, 32..65536).
    #[arg(long)]
    pub block: Option<usize>,
    /// Values per gradient quantization block (qgZ).
    #[arg(long)]
    pub qgz_block: Option<usize>,
    /// Bits of qgZ's first hop, inside the node (8 or 4; across nodes: 4).
    /// Default: the routing plan's — int8, unless the hop inside the node
    /// is about as slow per rank as the hop across.
    #[arg(long)]
    pub qgz_intra_bits: Option<u32>,
    /// Unquantized traffic (weights without qwZ, gradients without qgZ) in
    /// fp32 instead of bf16.
    #[arg(long)]
    fp32_comm: Option<bool>,
    /// qwZ sends weight differences across nodes, at --qwz-bits, against a
    /// reference every receiver keeps (docs/TRAINING.md); zeropp's default:
    /// on with qwZ across nodes.
    #[arg(long)]
    pub qwz_delta: Option<bool>,
    /// Forward gathers of a unit between full refreshes of the qwZ
    /// references (with --qwz-delta).
    #[arg(long)]
    pub qwz_refresh: Option<usize>,
    /// qgZ's hop across nodes rotates each block (Walsh–Hadamard) before
    /// quantizing, spreading outliers over the block; zeropp's default: on
    /// with qgZ.
    #[arg(long)]
    pub qgz_hadamard: Option<bool>,
    /// Values per quantization block of qgZ's hop across nodes (default:
    /// 64 in zeropp mode, else --qgz-block).
    #[arg(long)]
    pub qgz_inter_block: Option<usize>,
    #[arg(long)]
    pub steps: Option<usize>,
    /// Sequences per rank per step.
    #[arg(long)]
    pub batch: Option<usize>,
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long)]
    pub lr: Option<f32>,
    #[arg(long)]
    pub warmup_steps: Option<usize>,
    /// Skip a step whose loss or gradient is NaN/Inf (no update) instead of
    /// stopping the run.
    #[arg(long)]
    pub skip_nonfinite: Option<bool>,
    /// Model width, layers, heads and context length.
    #[arg(long)]
    pub width: Option<usize>,
    #[arg(long)]
    pub layers: Option<usize>,
    #[arg(long)]
    pub heads: Option<usize>,
    #[arg(long)]
    pub context: Option<usize>,
    /// Tie the head's output matrix to the token embedding.
    #[arg(long)]
    pub tied_head: Option<bool>,
    /// Train on this UTF-8 text file instead of the built-in corpus.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// ucx or tcp. Unset: ZEROPP_TRANSPORT when set, else UCX when libucp
    /// loads (a note says when it does not and TCP is used).
    #[arg(long, value_name = "ucx|tcp")]
    pub transport: Option<crate::comm::job::TransportKind>,
    /// Logical nodes and ranks per node when launching itself.
    #[arg(long)]
    pub nodes: Option<usize>,
    #[arg(long)]
    pub ranks_per_node: Option<usize>,
    /// Print a progress line every N steps.
    #[arg(long)]
    pub log_every: Option<usize>,
    /// Batches per rank for the validation loss at the end.
    #[arg(long)]
    pub val_batches: Option<usize>,
    /// Write one JSON object per step here.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Write the end-of-run summary here as JSON (with --compare: both).
    #[arg(long)]
    pub summary_json: Option<PathBuf>,
    /// Draw the loss curve here as PNG (with --compare: both).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Save sharded checkpoints in this directory (every --save-every steps
    /// and at the end).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints (0: only at the end).
    #[arg(long)]
    pub save_every: Option<usize>,
    /// Checkpoints to keep (0: all; default 3).
    #[arg(long)]
    pub keep: Option<usize>,
    /// Continue from a checkpoint (or the latest in a checkpoint directory),
    /// with its settings unless flags or --config say otherwise. A different
    /// --nodes/--ranks-per-node re-cuts the shards.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Stop after this step (saving a checkpoint when --checkpoint-dir is
    /// set); the learning-rate schedule still spans --steps.
    #[arg(long)]
    pub stop_after: Option<usize>,
    /// Run zero3, then zeropp, with the same seed and data on this machine
    /// and print them side by side (switch overrides apply to zeropp).
    #[arg(long)]
    pub compare: bool,
    /// With --compare: measure parity over these seeds (0..5, 0..=4 or
    /// 1,5,9): per seed ZeRO-3, ZeRO-3 with fp32 communication (the noise
    /// floor) and ZeRO++; prints the gaps per seed and as mean and spread
    /// beside the noise floor (--summary-json writes them).
    #[arg(long, requires = "compare", value_parser = crate::train::parity::parse_seeds)]
    pub seeds: Option<crate::train::parity::Seeds>,
    /// Timeout of every network wait, in seconds (default 60).
    #[arg(long)]
    pub timeout: Option<f64>,
}

impl TrainArgs {
    /// The run's config: `--config`'s file, else the checkpoint being
    /// resumed, else the defaults; then every flag given.
    pub fn config(&self) -> Result<TrainConfig> {
        let mut c = match (&self.config, &self.resume) {
            (Some(p), _) => TrainConfig::from_toml_file(p)?,
            // Resuming: the checkpoint's settings, flags override them.
            (None, Some(r)) => {
                let dir = crate::train::checkpoint::resolve(r)?;
                let mut c = crate::train::checkpoint::read_manifest(&dir)?.config;
                (c.resume, c.stop_after) = (None, None);
                // How ranks talk is this machine's choice, not the checkpoint's.
                c.transport = None;
                c
            }
            (None, None) => TrainConfig::default(),
        };
        // A flag given replaces the value; for the settings that are
        // themselves optional (the plan's to choose when unset), it sets
        // them.
        macro_rules! set {
            ($($field:ident => $target:expr),* $(,)?) => {
                $(if let Some(v) = self.$field.clone() { $target = v; })*
            };
        }
        macro_rules! set_some {
            ($($field:ident => $target:expr),* $(,)?) => {
                $(if let Some(v) = self.$field.clone() { $target = Some(v); })*
            };
        }
        set!(mode => c.mode, block => c.block, steps => c.steps, batch => c.batch, seed => c.seed,
             lr => c.optim.lr, warmup_steps => c.optim.warmup_steps,
             skip_nonfinite => c.optim.skip_nonfinite, width => c.model.width,
             layers => c.model.layers, heads => c.model.heads, context => c.model.context,
             nodes => c.nodes, ranks_per_node => c.ranks_per_node, log_every => c.log_every,
             qgz_stochastic => c.qgz_stochastic, qgz_block => c.qgz_block,
             val_batches => c.val_batches, fp32_comm => c.fp32_comm,
             tied_head => c.model.tied_head, qwz_refresh => c.qwz_refresh,
             save_every => c.save_every, keep => c.keep);
        set_some!(qgz_hadamard => c.qgz_hadamard, qgz_inter_block => c.qgz_inter_block,
                  qwz_delta => c.qwz_delta, qwz_bits => c.qwz_bits, hpz => c.hpz,
                  hpz_group => c.hpz_group, qgz_intra_bits => c.qgz_intra_bits, qgz => c.qgz,
                  error_feedback => c.error_feedback, data => c.data, metrics => c.metrics,
                  summary_json => c.summary_json, checkpoint_dir => c.checkpoint_dir,
                  resume => c.resume, stop_after => c.stop_after, transport => c.transport,
                  plot => c.plot);
        c.validate()?;
        Ok(c)
    }
}

/// Runs `zeropp train`.
pub fn run(args: TrainArgs) -> Result<()> {
    let cfg = args.config()?;
    match crate::comm::env::RankFacts::from_env() {
        Err(crate::comm::env::EnvError::Missing) if args.compare => match &args.seeds {
            Some(seeds) => {
                crate::train::parity::measure(&cfg, &seeds.0, args.timeout)?;
            }
            None => {
                local::compare(&cfg, args.timeout)?;
            }
        },
        // No launcher around us: be one, over this machine.
        Err(crate::comm::env::EnvError::Missing) => local::launch_local(&cfg, args.timeout)?,
        Ok(_) if args.compare => {
            bail!("--compare launches its own runs on this machine; run it outside a launcher")
        }
        Err(e) => return Err(e.into()),
        Ok(facts) => {
            // Under another launcher (torchrun, mpirun, srun): this
            // host's cores shared among its ranks, unless the user
            // set RAYON_NUM_THREADS (zeropp launch sets it itself).
            if let Some(n) = crate::launch::compute_threads(facts.local_world_size) {
                // SAFETY: no other thread runs yet to read the
                // environment concurrently.
                unsafe { std::env::set_var("RAYON_NUM_THREADS", n.to_string()) };
            }
            trainer::run_rank(&cfg)?;
        }
    }
    Ok(())
}
