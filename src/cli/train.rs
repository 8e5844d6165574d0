//! `zeropp train`'s command line: every setting as a flag (each with a
//! TOML twin in `--config`), merged over the config file, a resumed
//! checkpoint's settings or the defaults; then the run itself — one rank
//! under a launcher, else the whole job on this machine, or `--compare`.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

use crate::comm::env::{WAIT_LIMIT, wait_limit};
use crate::engine::optim::OptimArgs;
use crate::train::config::{
    CheckpointArgs, IslandsArgs, LaunchArgs, OutputArgs, RunArgs, SwitchArgs, TrainConfig,
};
use crate::train::model::ModelArgs;
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
    #[command(flatten, next_help_heading = "Islands")]
    pub islands: IslandsArgs,
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
                // Saves go next to the checkpoint resumed from, not to the
                // path its run named (relative to where that run started:
                // a copy's resume would write into the original).
                if c.checkpoint.checkpoint_dir.is_some() {
                    let root = dir.parent().filter(|p| !p.as_os_str().is_empty());
                    c.checkpoint.checkpoint_dir = Some(root.unwrap_or(Path::new(".")).into());
                }
                c
            }
            (None, None) => TrainConfig::default(),
        };
        let data_of_the_checkpoint = c
            .run
            .data
            .clone()
            .filter(|_| self.config.is_none() && self.run.data.is_none());
        self.switches.apply(&mut c.switches);
        self.run.apply(&mut c.run);
        self.output.apply(&mut c.output);
        self.checkpoint.apply(&mut c.checkpoint);
        self.launch.apply(&mut c.launch);
        self.islands.apply(&mut c.islands);
        self.model.apply(&mut c.model);
        self.optim.apply(&mut c.optim);
        if let Some(data) = &c.run.data {
            if !data.exists() && c.run.data == data_of_the_checkpoint {
                bail!(
                    "the checkpoint's run read its training data from {}, which is not there \
                     from here (a path relative to where that run started?): pass --data",
                    data.display()
                );
            }
            // Absolute in the checkpoints this run saves: a resume from
            // another directory reads the same file (by the name given).
            if let Ok(absolute) = std::path::absolute(data) {
                c.run.data = Some(absolute);
            }
        }
        c.validate()?;
        if let Some(r) = &self.checkpoint.resume {
            same_model_as(r, &c.model)?;
        }
        Ok(c)
    }
}

/// `zeropp train`'s command with each flag's default in its help (the
/// defaults of [`TrainConfig`], one place: a flag left out is the config's
/// value).
pub fn with_defaults(mut cmd: clap::Command) -> clap::Command {
    let Ok(serde_json::Value::Object(top)) = serde_json::to_value(TrainConfig::default()) else {
        return cmd;
    };
    // The sections' settings are flat at the top; `model` and `optim` are
    // tables.
    let mut settings = Vec::new();
    for (key, value) in top {
        match value {
            serde_json::Value::Object(table) => settings.extend(table),
            value => settings.push((key, value)),
        }
    }
    for (key, value) in settings {
        let shown = match &value {
            serde_json::Value::Null => continue,
            serde_json::Value::String(s) => s.clone(),
            // f32 settings, shown as written (0.003, not its f64 widening).
            serde_json::Value::Number(n) if n.is_f64() => {
                format!("{}", n.as_f64().unwrap_or(0.0) as f32)
            }
            other => other.to_string(),
        };
        if !cmd.get_arguments().any(|a| a.get_id() == key.as_str()) {
            continue;
        }
        cmd = cmd.mut_arg(key.as_str(), |a| {
            let mut a = a;
            if let Some(h) = a.get_help().map(|h| h.to_string()) {
                a = a.help(format!("{h} [default: {shown}]"));
            }
            if let Some(h) = a.get_long_help().map(|h| h.to_string()) {
                a = a.long_help(format!("{h} [default: {shown}]"));
            }
            a
        });
    }
    cmd
}

/// A resume keeps the checkpoint's model: a shape asked otherwise (a flag,
/// or a config file) is refused naming each setting that differs.
fn same_model_as(resume: &std::path::Path, model: &crate::train::model::ModelConfig) -> Result<()> {
    let dir = crate::train::checkpoint::resolve(resume)?;
    let saved = crate::train::checkpoint::read_manifest(&dir)?.config.model;
    let (theirs, mine) = (serde_json::to_value(&saved)?, serde_json::to_value(model)?);
    let differ: Vec<&str> = crate::train::model::ModelConfig::KEYS
        .iter()
        .copied()
        .filter(|k| theirs[*k] != mine[*k])
        .collect();
    if !differ.is_empty() {
        let said: Vec<String> = differ
            .iter()
            .map(|k| format!("{k} {} (asked: {})", theirs[*k], mine[*k]))
            .collect();
        let flags: Vec<String> = differ.iter().map(|k| k.replace('_', "-")).collect();
        bail!(
            "{} was trained with {}: a resume keeps the checkpoint's model, so drop --{} (or \
             those keys of the config file) or start a new run",
            dir.display(),
            said.join(", "),
            flags.join(", --")
        );
    }
    Ok(())
}

/// Runs `zeropp train`.
pub fn run(args: TrainArgs) -> Result<()> {
    let cfg = args.config()?;
    if let Some(t) = args.timeout.filter(|&t| wait_limit(t).is_none()) {
        bail!("--timeout {t}: {WAIT_LIMIT}");
    }
    let facts = crate::comm::env::RankFacts::from_env();
    if let Err(crate::comm::env::EnvError::Missing) = facts {
        // The whole job is on this machine: its outputs are checked once,
        // before any rank starts.
        trainer::prepare_outputs(&cfg, false)?;
    }
    match facts {
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
            let nodes = facts.world_size / facts.local_world_size.max(1);
            let asked = (args.launch.nodes, args.launch.ranks_per_node);
            if asked.0.is_some_and(|n| n != nodes)
                || asked.1.is_some_and(|g| g != facts.local_world_size)
            {
                eprintln!(
                    "note: --nodes and --ranks-per-node lay out the ranks zeropp train launches \
                     itself; under {} the job is the launcher's: {}",
                    facts.launcher,
                    crate::comm::shape(nodes, facts.local_world_size)
                );
            }
            if let Some(t) = args.timeout {
                // Read with the rank's other facts as it joins.
                // SAFETY: no other thread runs yet to read the
                // environment concurrently.
                unsafe { std::env::set_var("ZEROPP_TIMEOUT_S", t.to_string()) };
            }
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        train: TrainArgs,
    }

    fn config(flags: &[&str]) -> Result<TrainConfig> {
        let argv = std::iter::once("zeropp-train").chain(flags.iter().copied());
        Cli::try_parse_from(argv)?.train.config()
    }

    #[test]
    fn every_model_and_optimizer_setting_is_a_flag_over_the_defaults() {
        let c = config(&[
            "--width",
            "32",
            "--heads",
            "2",
            "--vocab",
            "300",
            "--tied-head",
            "true",
            "--lr",
            "0.01",
            "--weight-decay",
            "0.05",
            "--beta2",
            "0.99",
            "--skip-nonfinite",
            "true",
        ])
        .unwrap();
        assert_eq!((c.model.width, c.model.heads, c.model.vocab), (32, 2, 300));
        assert!(c.model.tied_head && c.optim.skip_nonfinite);
        assert_eq!(
            (c.optim.lr, c.optim.weight_decay, c.optim.beta2),
            (0.01, 0.05, 0.99)
        );
        // What no flag set keeps its declared default.
        let d = TrainConfig::default();
        assert_eq!(
            (c.model.layers, c.optim.beta1),
            (d.model.layers, d.optim.beta1)
        );
        // Each table's keys are its flags' names: one declaration.
        for (keys, table) in [
            (crate::train::model::ModelConfig::KEYS, "model"),
            (crate::engine::optim::OptimConfig::KEYS, "optim"),
        ] {
            let json = serde_json::to_value(&d).unwrap();
            let mut written: Vec<&str> = json[table]
                .as_object()
                .unwrap()
                .keys()
                .map(|k| k.as_str())
                .collect();
            let mut declared = keys.to_vec();
            written.sort_unstable();
            declared.sort_unstable();
            assert_eq!(written, declared, "[{table}]");
            for k in keys {
                let flag = format!("--{}", k.replace('_', "-"));
                let value = match json[table][k].is_boolean() {
                    true => "true",
                    false => "1",
                };
                let argv = ["zeropp-train", &flag, value];
                assert!(Cli::try_parse_from(argv).is_ok(), "{flag} {value}");
            }
        }
    }

    #[test]
    fn optimizer_settings_adamw_cannot_train_with_are_refused_naming_the_flag() {
        for (flag, value, says) in [
            ("--lr", "-1", "--lr"),
            ("--lr", "NaN", "positive and finite"),
            ("--beta1", "2", "in [0, 1)"),
            ("--beta2", "1", "--beta2"),
            ("--eps", "0", "--eps"),
            ("--weight-decay", "-0.5", "--weight-decay"),
            ("--max-grad-norm", "inf", "--max-grad-norm"),
            ("--min-lr-ratio", "1.5", "in [0, 1]"),
        ] {
            let e = config(&[&format!("{flag}={value}")]).unwrap_err();
            assert!(format!("{e:#}").contains(says), "{flag} {value}: {e:#}");
        }
        assert!(config(&["--lr", "0.01", "--max-grad-norm", "0"]).is_ok());
        let e = config(&["--stop-after", "0"]).unwrap_err();
        assert!(format!("{e:#}").contains("at least one step"), "{e:#}");
    }

    #[test]
    fn a_context_whose_attention_cannot_fit_in_memory_is_refused_up_front() {
        // batch 4 x 2 heads x 10^6² scores: 32 TB a layer.
        let e = config(&[
            "--context",
            "1000000",
            "--width",
            "32",
            "--heads",
            "2",
            "--batch",
            "4",
        ])
        .unwrap_err();
        let e = format!("{e:#}");
        assert!(
            e.contains("lower --context or --batch") && e.contains("GB"),
            "{e}"
        );
        assert!(config(&["--context", "1024"]).is_ok());
    }

    #[test]
    fn a_vocabulary_smaller_than_the_bytes_is_refused() {
        let e = config(&["--vocab", "100"]).unwrap_err();
        assert!(format!("{e:#}").contains("at least 256"), "{e:#}");
    }
}
