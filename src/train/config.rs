//! Every setting of `zeropp train` in one typed struct, its defaults, and
//! the switches it asks for: read from flags, a TOML file with the same
//! names, or a checkpoint's manifest (which embeds it).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::comm::job::TransportKind;
use crate::engine::optim::OptimConfig;
use crate::train::model::ModelConfig;
use crate::zero::plan::Switches;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Plain ZeRO-3: bf16 gathers over the world, bf16 reduce-scatter.
    Zero3,
    /// ZeRO++: qwZ int8 + hpZ + qgZ int4.
    Zeropp,
}

/// Every setting of a training run; defaults live here and only here.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    pub mode: Mode,
    /// Override qwZ bits (0 = off, 8, 4).
    pub qwz_bits: Option<u32>,
    pub hpz: Option<bool>,
    /// Ranks sharing an hpZ secondary shard (divides ranks_per_node); unset:
    /// the routing plan's choice (the node, or an NVLink island).
    pub hpz_group: Option<usize>,
    pub qgz: Option<bool>,
    /// Error feedback for qgZ (default: on whenever qgZ is).
    pub error_feedback: Option<bool>,
    /// qgZ: stochastic rounding of gradients instead of round-to-nearest.
    pub qgz_stochastic: bool,
    /// Values per quantization block of the weights (qwZ).
    pub block: usize,
    /// Values per quantization block of the gradients (qgZ).
    pub qgz_block: usize,
    /// Bits of qgZ's first hop, inside the node (8 or 4); unset: the routing
    /// plan's choice (int8 unless the hop inside is about as slow as the
    /// hop across).
    pub qgz_intra_bits: Option<u32>,
    /// Unquantized traffic in fp32 instead of bf16.
    pub fp32_comm: bool,
    /// qwZ sends weight differences across nodes (at qwZ's bits); unset:
    /// the mode's default.
    pub qwz_delta: Option<bool>,
    /// Forward gathers of a unit between full refreshes of the qwZ
    /// references.
    pub qwz_refresh: usize,
    /// qgZ's hop across nodes rotated (Walsh–Hadamard) before quantizing;
    /// unset: the mode's default.
    pub qgz_hadamard: Option<bool>,
    /// Values per quantization block of qgZ's hop across nodes; unset: the
    /// mode's default (64 for zeropp, `qgz_block` for zero3).
    pub qgz_inter_block: Option<usize>,
    pub steps: usize,
    /// Sequences per rank per step.
    pub batch: usize,
    pub seed: u64,
    pub model: ModelConfig,
    pub optim: OptimConfig,
    /// A UTF-8 text file; the built-in corpus when absent.
    pub data: Option<PathBuf>,
    /// tcp or ucx; unset: ZEROPP_TRANSPORT, else tcp.
    pub transport: Option<TransportKind>,
    /// Logical nodes and ranks per node when `zeropp train` launches itself.
    pub nodes: usize,
    pub ranks_per_node: usize,
    /// Batches per rank for the validation loss at the end.
    pub val_batches: usize,
    /// Print a progress line every this many steps.
    pub log_every: usize,
    pub metrics: Option<PathBuf>,
    pub summary_json: Option<PathBuf>,
    /// Write the loss curve here as PNG.
    pub plot: Option<PathBuf>,
    /// Save sharded checkpoints here (every `save_every` steps and at the
    /// end), keeping the newest `keep` (0 = all).
    pub checkpoint_dir: Option<PathBuf>,
    pub save_every: usize,
    pub keep: usize,
    /// Continue from this checkpoint (or the latest under this directory).
    pub resume: Option<PathBuf>,
    /// Stop (and save, with a checkpoint directory) after this step, as if
    /// the run were preempted; the schedule still spans `steps`.
    pub stop_after: Option<usize>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            mode: Mode::Zeropp,
            qwz_bits: None,
            hpz: None,
            hpz_group: None,
            qgz: None,
            error_feedback: None,
            qgz_stochastic: false,
            block: 256,
            qgz_block: 32,
            qgz_intra_bits: None,
            fp32_comm: false,
            qwz_delta: None,
            qwz_refresh: crate::zero::plan::DEFAULT_QWZ_REFRESH,
            qgz_hadamard: None,
            qgz_inter_block: None,
            steps: 200,
            batch: 8,
            seed: 0,
            model: ModelConfig::default(),
            optim: OptimConfig::default(),
            data: None,
            transport: None,
            nodes: 2,
            ranks_per_node: 2,
            val_batches: 4,
            log_every: 10,
            metrics: None,
            summary_json: None,
            plot: None,
            checkpoint_dir: None,
            save_every: 0,
            keep: 3,
            resume: None,
            stop_after: None,
        }
    }
}

impl TrainConfig {
    /// Reads a TOML file of the same settings.
    pub fn from_toml_file(path: &Path) -> Result<TrainConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the config {}", path.display()))?;
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }

    /// The switches: the mode's, then each override.
    pub fn switches(&self) -> Switches {
        let mut s = match self.mode {
            Mode::Zero3 => Switches::zero3(self.block),
            Mode::Zeropp => Switches::zeropp(self.block),
        };
        if let Some(b) = self.qwz_bits {
            s.qwz_bits = (b != 0).then_some(b);
        }
        if let Some(h) = self.hpz {
            s.hpz = h;
        }
        if let Some(q) = self.qgz {
            s.qgz = q;
        }
        s.error_feedback = self.error_feedback.unwrap_or(s.qgz);
        s.qgz_stochastic = self.qgz_stochastic;
        s.qgz_block = self.qgz_block;
        if let Some(b) = self.qgz_intra_bits {
            s.qgz_intra_bits = b;
        }
        s.fp32_comm = self.fp32_comm;
        if let Some(d) = self.qwz_delta {
            s.qwz_delta = d;
        }
        s.qwz_refresh = self.qwz_refresh;
        if let Some(h) = self.qgz_hadamard {
            s.qgz_hadamard = h;
        }
        if let Some(b) = self.qgz_inter_block {
            s.qgz_inter_block = Some(b);
        }
        s
    }

    /// The switches this config sets itself (the rest are the mode's or
    /// the plan's to choose), and the switches with `hpz_group` applied.
    pub fn wanted_switches(&self) -> (Switches, Vec<&'static str>) {
        let mut asked = Vec::new();
        let mut wanted = self.switches();
        if let Some(h) = self.hpz_group {
            wanted.hpz_group = Some(h);
            asked.push("hpz_group");
        }
        if self.qgz_intra_bits.is_some() {
            asked.push("qgz_intra_bits");
        }
        for (name, set) in [
            ("qwz_bits", self.qwz_bits.is_some()),
            ("hpz", self.hpz.is_some()),
            ("qgz", self.qgz.is_some()),
            ("error_feedback", self.error_feedback.is_some()),
            ("qwz_delta", self.qwz_delta.is_some()),
            ("qgz_hadamard", self.qgz_hadamard.is_some()),
        ] {
            if set {
                asked.push(name);
            }
        }
        (wanted, asked)
    }

    pub fn validate(&self) -> Result<()> {
        self.model
            .validate()
            .map_err(|e| anyhow::anyhow!("invalid model: {e}"))?;
        if self.steps == 0 || self.batch == 0 {
            bail!("steps and batch must be at least 1");
        }
        if self.nodes == 0 || self.ranks_per_node == 0 {
            bail!("nodes and ranks_per_node must be at least 1");
        }
        Ok(())
    }
}
