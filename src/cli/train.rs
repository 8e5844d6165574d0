//! `zeropp train`'s command line: every setting as a flag (each with a
//! TOML twin in `--config`), merged over the config file, a resumed
//! checkpoint's settings or the defaults; then the run itself — one rank
//! under a launcher, else the whole job on this machine, or `--compare`.

use std::path::PathBuf;

use anyhow::{Result, bail};

use crate::train::config::{
    CheckpointArgs, LaunchArgs, OutputArgs, RunArgs, SwitchArgs, TrainConfig,
};
use crate::train::{local, trainer};

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// A TOML file with any of the settings below (flags override it).
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten, next_help_heading = "Switches")]
    pub switches: SwitchArgs,
    #[command(flatten, next_help_heading = "Run")]
    pub run: RunArgs,
    #[command(flatten, next_help_heading = "Model")]
    pub model: ModelArgs,
    #[command(flatten, next_help_heading = "Optimizer")]
    pub optim: OptimArgs,
    #[command(flatten, next_help_heading = "Output")]
    pub output: OutputArgs,
    #[command(flatten, next_help_heading = "Checkpoints")]
    pub checkpoint: CheckpointArgs,
    #[command(flatten, next_help_heading = "Launch")]
    pub launch: LaunchArgs,
    /// Run zero3, then zeropp, with the same seed and data on this machine
    /// and print them side by side (switch overrides apply to zeropp).
    #[arg(long, help_heading = "Comparison")]
    pub compare: bool,
    /// With --compare: measure parity over these seeds (0..5, 0..=4 or
    /// 1,5,9): per seed ZeRO-3, ZeRO-3 with fp32 communication (the noise
    /// floor) and ZeRO++; prints the gaps per seed and as mean and spread
    /// beside the noise floor (--summary-json writes them).
    #[arg(long, requires = "compare", value_parser = crate::train::parity::parse_seeds,
          help_heading = "Comparison")]
    pub seeds: Option<crate::train::parity::Seeds>,
    /// Timeout of every network wait, in seconds (default 60).
    #[arg(long, help_heading = "Launch")]
    pub timeout: Option<f64>,
}

/// The flags of the `[model]` table (its vocabulary is the 256 byte
/// values, not a flag).
#[derive(clap::Args, Debug, Default)]
pub struct ModelArgs {
    /// Model width.
    #[arg(long)]
    pub width: Option<usize>,
    /// Transformer blocks.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Attention heads (they divide the width).
    #[arg(long)]
    pub heads: Option<usize>,
    /// Context length (tokens per sequence).
    #[arg(long)]
    pub context: Option<usize>,
    /// Tie the head's output matrix to the token embedding.
    #[arg(long)]
    pub tied_head: Option<bool>,
}

/// The flags of the `[optim]` table (AdamW's other settings are keys of
/// the table only).
#[derive(clap::Args, Debug, Default)]
pub struct OptimArgs {
    /// Peak learning rate.
    #[arg(long)]
    pub lr: Option<f32>,
    /// Steps of linear warm-up before the cosine decay.
    #[arg(long)]
    pub warmup_steps: Option<usize>,
    /// Skip a step whose loss or gradient is NaN/Inf (no update) instead of
    /// stopping the run.
    #[arg(long)]
    pub skip_nonfinite: Option<bool>,
}

impl TrainArgs {
    /// The run's config: `--config`'s file, else the checkpoint being
    /// resumed, else the defaults; then every flag given.
    pub fn config(&self) -> Result<TrainConfig> {
        let mut c = match (&self.config, &self.checkpoint.resume) {
            (Some(p), _) => TrainConfig::from_toml_file(p)?,
            // Resuming: the checkpoint's settings, flags override them.
            (None, Some(r)) => {
                let dir = crate::train::checkpoint::resolve(r)?;
                let mut c = crate::train::checkpoint::read_manifest(&dir)?.config;
                (c.checkpoint.resume, c.run.stop_after) = (None, None);
                // How ranks talk is this machine's choice, not the checkpoint's.
                c.launch.transport = None;
                c
            }
            (None, None) => TrainConfig::default(),
        };
        self.switches.apply(&mut c.switches);
        self.run.apply(&mut c.run);
        self.output.apply(&mut c.output);
        self.checkpoint.apply(&mut c.checkpoint);
        self.launch.apply(&mut c.launch);
        let (m, o) = (&self.model, &self.optim);
        macro_rules! set {
            ($($flag:expr => $target:expr),* $(,)?) => {
                $(if let Some(v) = $flag { $target = v; })*
            };
        }
        set!(m.width => c.model.width, m.layers => c.model.layers, m.heads => c.model.heads,
             m.context => c.model.context, m.tied_head => c.model.tied_head,
             o.lr => c.optim.lr, o.warmup_steps => c.optim.warmup_steps,
             o.skip_nonfinite => c.optim.skip_nonfinite);
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
