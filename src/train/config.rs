//! Every setting of `zeropp train`, each declared once with its doc, in a
//! typed tree: the switches, the run, the output, checkpoints, the launch,
//! and the model and optimizer tables. From each declaration come the
//! config's field (a key of `--config`'s TOML file and of a checkpoint's
//! manifest, where the sections sit flat beside `[model]` and `[optim]`),
//! its default, and its command-line flag with the same doc.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::comm::exchange::TransportKind;
use crate::engine::optim::OptimConfig;
use crate::train::model::ModelConfig;
use crate::zero::plan::Switches;
use zeropp_settings::{Asked, Setting, section};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Plain ZeRO-3: bf16 gathers over the world, bf16 reduce-scatter.
    Zero3,
    /// ZeRO++: qwZ int4 weight differences + hpZ + qgZ int4 with a rotated
    /// hop across nodes.
    Zeropp,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Zero3 => "zero3",
            Mode::Zeropp => "zeropp",
        })
    }
}

/// The mode is set by its flag.
impl Setting for Mode {
    type Flag = Mode;
    fn set(&mut self, flag: Mode) {
        *self = flag;
    }
}

/// A number, or `auto`: the plan's to choose.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OrAuto {
    Number(usize),
    Auto(AutoWord),
}

/// How often islands sync: every H steps, or `auto`: the first sync after
/// [`AUTO_FIRST_SYNC`] steps measures an exchange and the inner steps,
/// and the islands agree on the smallest H at which the syncs cost at most
/// [`crate::engine::AUTO_SYNC_SHARE`] of the inner steps (waited for) or
/// hide behind them (streamed).
pub type SyncEvery = OrAuto;

/// How many islands: a divisor of the nodes, or `auto`: the plan's
/// choice from the links measured at join
/// ([`zeropp_zero::cost::PlanInput::choose_islands`]).
pub type IslandCount = OrAuto;

/// The word `auto` in a config file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AutoWord {
    Auto,
}

/// The steps before an automatic H's first sync.
pub const AUTO_FIRST_SYNC: usize = 10;

impl OrAuto {
    pub const AUTO: OrAuto = OrAuto::Auto(AutoWord::Auto);

    /// As a sync_every: the H the run starts with, and whether it is
    /// chosen on the way.
    pub fn start(self) -> (usize, bool) {
        match self {
            OrAuto::Number(h) => (h, false),
            OrAuto::Auto(_) => (AUTO_FIRST_SYNC, true),
        }
    }

    /// The number, unless it is the plan's to choose.
    pub fn number(self) -> Option<usize> {
        match self {
            OrAuto::Number(n) => Some(n),
            OrAuto::Auto(_) => None,
        }
    }
}

impl std::str::FromStr for OrAuto {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s == "auto" {
            return Ok(OrAuto::AUTO);
        }
        s.parse()
            .map(OrAuto::Number)
            .map_err(|_| format!("{s:?}: a number, or auto"))
    }
}

impl std::fmt::Display for OrAuto {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OrAuto::Number(h) => write!(f, "{h}"),
            OrAuto::Auto(_) => f.write_str("auto"),
        }
    }
}

impl Setting for OrAuto {
    type Flag = OrAuto;
    fn set(&mut self, flag: OrAuto) {
        *self = flag;
    }
}

/// `SwitchConfig` and its flags (`SwitchArgs`) from the switches' one
/// declaration (`zeropp_zero::with_switches!`), after the mode.
macro_rules! switch_config {
    (
        $( $(#[doc = $doc:literal])* $field:ident : $resolved:ty as $asked:ty = $default:expr ),*
        $(,)?
    ) => {
        section! {
            /// The mode and the ZeRO++ switches (each unset one is the mode's, or
            /// the routing plan's, to choose).
            SwitchConfig / SwitchArgs {
                /// zero3 (all switches off, bf16 communication) or zeropp (qwZ int4
                /// weight differences + hpZ + qgZ int4 with a rotated hop across
                /// nodes).
                mode: Mode = Mode::Zeropp,
                $( $(#[doc = $doc])* $field: $asked = $default, )*
            }
        }

        impl SwitchConfig {
            /// Sets on `s` each switch this config gives.
            fn give(&self, s: &mut Switches) {
                $(
                    if let Some(v) = Asked::asked(&self.$field) {
                        Setting::set(&mut s.$field, v);
                    }
                )*
            }

            /// The names of the switches this config asks for itself (the
            /// rest are the mode's or the plan's to choose): those set, and
            /// the plain ones that are not their default.
            pub fn asked(&self) -> Vec<&'static str> {
                let mut names = Vec::new();
                $(
                    if Asked::is_asked(&self.$field, &$default) {
                        names.push(stringify!($field));
                    }
                )*
                names
            }
        }
    };
}
crate::zero::with_switches!(switch_config);

section! {
    /// What is trained, for how long, on what.
    RunConfig / RunArgs {
        /// Optimizer steps (the learning-rate schedule spans them).
        steps: usize = 200,
        /// Sequences per rank per step.
        batch: usize = 8,
        /// Seed of the weights, the data order and stochastic rounding.
        seed: u64 = 0,
        /// Train on this UTF-8 text file instead of the built-in corpus.
        data: Option<PathBuf> = None,
        /// Batches per rank for the validation loss at the end.
        val_batches: usize = 4,
        /// Print a progress line every N steps.
        log_every: usize = 10,
        /// Stop after this step (saving a checkpoint when --checkpoint-dir is
        /// set); the learning-rate schedule still spans --steps.
        stop_after: Option<usize> = None,
    }
}

section! {
    /// What the run writes besides its log.
    OutputConfig / OutputArgs {
        /// Write one JSON object per step here.
        metrics: Option<PathBuf> = None,
        /// Write the end-of-run summary here as JSON (with --compare: both).
        summary_json: Option<PathBuf> = None,
        /// Draw the loss curve here as PNG (with --compare: both).
        plot: Option<PathBuf> = None,
    }
}

section! {
    /// Sharded checkpoints: where, how often, how many, and resuming.
    CheckpointConfig / CheckpointArgs {
        /// Save sharded checkpoints in this directory (every --save-every steps
        /// and at the end).
        checkpoint_dir: Option<PathBuf> = None,
        /// Steps between checkpoints (0: only at the end).
        save_every: usize = 0,
        /// Checkpoints to keep (0: all).
        keep: usize = 3,
        /// Continue from a checkpoint (or the latest in a checkpoint directory),
        /// with its settings unless flags or --config say otherwise. A different
        /// --nodes/--ranks-per-node re-cuts the shards.
        resume: Option<PathBuf> = None,
    }
}

section! {
    /// How ranks talk, and the job `zeropp train` starts when no launcher
    /// started it.
    LaunchConfig / LaunchArgs {
        /// ucx or tcp. Unset: ZEROPP_TRANSPORT when set, else UCX when libucp
        /// loads (a note says when it does not and TCP is used).
        transport: Option<TransportKind> = None,
        /// Logical nodes when launching itself.
        nodes: usize = 2,
        /// Ranks per logical node when launching itself.
        ranks_per_node: usize = 2,
    }
}

section! {
    /// Islands: the job cut into islands of whole nodes, each training as a
    /// ZeRO++ job of its own ranks, synced every few steps by an outer step
    /// across them (DiLoCo's, over shards) for links too slow for any
    /// synchronous step.
    IslandsConfig / IslandsArgs {
        /// Islands (a divisor of the nodes; 1: one synchronous job), or
        /// auto: the plan's choice from the links between nodes measured at
        /// join (islands only where they step at least 1.5x faster than
        /// the synchronous job; one island on logical nodes).
        islands: IslandCount = OrAuto::Number(1),
        /// Inner steps between the islands' outer syncs (H), or auto: the
        /// smallest H at which the syncs cost at most 15% of the inner
        /// steps (waited for) or hide behind them (streamed), measured at
        /// the first sync (after 10 steps) and agreed by the islands.
        sync_every: SyncEvery = OrAuto::Number(20),
        /// The outer optimizer's learning rate (Nesterov SGD).
        outer_lr: f32 = 0.3,
        /// The outer optimizer's momentum.
        outer_momentum: f32 = 0.6,
        /// How the outer deltas travel: 4 (int4 blocks of 64, rotated, with
        /// error feedback) or 32 (f32).
        outer_bits: u32 = 4,
        /// Streaming: the model's units in this many fragments whose
        /// exchanges start staggered across the H steps (1: the whole model
        /// at once).
        outer_fragments: usize = 1,
        /// Streaming: inner steps an exchange runs behind before it is
        /// applied (0: the island waits for it; below --sync-every).
        outer_delay: usize = 0,
        /// Self-launched: how many times in all a lost island's ranks are
        /// started again to rejoin the running job (from a live island's
        /// state at its next outer sync; over TCP; with --outer-delay above
        /// 0 none is).
        restarts: usize = 2,
    }
}

/// Every setting of a training run; defaults live in the sections' own
/// declarations and only there.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    #[serde(flatten)]
    pub switches: SwitchConfig,
    #[serde(flatten)]
    pub run: RunConfig,
    #[serde(flatten)]
    pub output: OutputConfig,
    #[serde(flatten)]
    pub checkpoint: CheckpointConfig,
    #[serde(flatten)]
    pub launch: LaunchConfig,
    #[serde(flatten)]
    pub islands: IslandsConfig,
    #[serde(default)]
    pub model: ModelConfig,
    #[serde(default)]
    pub optim: OptimConfig,
}

impl TrainConfig {
    /// Every key of the top level of the TOML file (the sections' settings
    /// flat, then the `model` and `optim` tables).
    pub fn keys() -> Vec<&'static str> {
        [
            SwitchConfig::KEYS,
            RunConfig::KEYS,
            OutputConfig::KEYS,
            CheckpointConfig::KEYS,
            LaunchConfig::KEYS,
            IslandsConfig::KEYS,
            &["model", "optim"],
        ]
        .concat()
    }

    /// Reads a TOML file of the same settings; a key that is not one is an
    /// error naming the keys there are.
    pub fn from_toml_file(path: &Path) -> Result<TrainConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the config {}", path.display()))?;
        Self::from_toml_str(&text).with_context(|| format!("{}", path.display()))
    }

    /// [`TrainConfig::from_toml_file`] on text.
    pub fn from_toml_str(text: &str) -> Result<TrainConfig> {
        let table: toml::Table = toml::from_str(text)?;
        let keys = Self::keys();
        if let Some(bad) = table.keys().find(|k| !keys.contains(&k.as_str())) {
            // A table's key written at the top says where it goes.
            for (name, table_keys) in [
                ("model", crate::train::model::ModelConfig::KEYS),
                ("optim", crate::engine::optim::OptimConfig::KEYS),
            ] {
                if table_keys.contains(&bad.as_str()) {
                    bail!(
                        "setting {bad:?} belongs in the [{name}] table: write it under a \
                         `[{name}]` line (after the top-level settings)"
                    );
                }
            }
            bail!("unknown setting {bad:?}; the settings are {keys:?}");
        }
        table.clone().try_into().map_err(|e| {
            // Flattened sections lose the key in serde's message: find it.
            let bad = table.iter().find_map(|(k, v)| {
                let one = toml::Table::from_iter([(k.to_string(), v.clone())]);
                one.try_into::<TrainConfig>()
                    .err()
                    .map(|e| (k, v, e.to_string()))
            });
            match bad {
                // serde's words for the types behind the settings.
                Some((k, v, said)) if said.contains("untagged enum OrAuto") => {
                    anyhow::anyhow!("setting {k:?} = {v}: a whole number, or \"auto\"")
                }
                Some((k, v, said)) if said.contains("expected struct") => anyhow::anyhow!(
                    "setting {k:?} = {v}: a table of settings ([{k}] and its keys under it)"
                ),
                Some((k, _, said)) => anyhow::anyhow!("setting {k:?}: {said}"),
                None => anyhow::anyhow!("{e}"),
            }
        })
    }

    /// The switches: the mode's, then each one this config gives
    /// (`Switches::settle_overrides`, as `zeropp.torch` reads them).
    pub fn switches(&self) -> Switches {
        let c = &self.switches;
        let mut s = match c.mode {
            Mode::Zero3 => Switches::zero3(c.block),
            Mode::Zeropp => Switches::zeropp(c.block),
        };
        c.give(&mut s);
        s.settle_overrides(&c.asked());
        s
    }

    /// The switches, and the names of those this config asks for itself
    /// (the rest are the mode's or the plan's to choose).
    pub fn wanted_switches(&self) -> (Switches, Vec<&'static str>) {
        (self.switches(), self.switches.asked())
    }

    /// ZeRO-3 as `--compare` and `--mode zero3` runs it: every ZeRO++
    /// override cleared.
    pub fn clear_zeropp_overrides(&mut self) {
        let c = &mut self.switches;
        (c.qwz_bits, c.hpz, c.qgz, c.error_feedback) = (None, None, None, None);
        (c.qwz_delta, c.qgz_hadamard, c.qgz_inter_block) = (None, None, None);
        c.qwz_int8_references = None;
    }

    /// The step this run stops at: --stop-after, within --steps.
    pub fn end_step(&self) -> usize {
        self.run
            .stop_after
            .unwrap_or(self.run.steps)
            .min(self.run.steps)
    }

    pub fn validate(&self) -> Result<()> {
        self.model
            .validate()
            .map_err(|e| anyhow::anyhow!("invalid model: {e}"))?;
        if self.run.steps == 0 || self.run.batch == 0 {
            bail!("steps and batch must be at least 1");
        }
        if self.run.stop_after == Some(0) {
            bail!("--stop-after 0: a run stops after at least one step of its own");
        }
        if self.launch.nodes == 0 || self.launch.ranks_per_node == 0 {
            bail!("nodes and ranks_per_node must be at least 1");
        }
        if self.checkpoint.save_every > 0 && self.checkpoint.checkpoint_dir.is_none() {
            bail!(
                "--save-every {} saves into --checkpoint-dir: give one (or drop --save-every)",
                self.checkpoint.save_every
            );
        }
        self.optim.check().map_err(|e| anyhow::anyhow!("{e}"))?;
        self.check_attention_fits(self.launch.ranks_per_node)?;
        self.island_config()?;
        Ok(())
    }

    /// The attention scores of one layer (batch × heads × context² in f32,
    /// and as many again for their softmax and its gradient) fit in this
    /// machine's memory: a context far too long is refused with what to
    /// lower, not left to fail an allocation mid-step. `ranks_here`: the ranks this machine runs (a node's under a
    /// launcher; every rank of a self-launched job).
    pub fn check_attention_fits(&self, ranks_here: usize) -> Result<()> {
        let m = &self.model;
        let scores = (self.run.batch as u128)
            * (m.heads as u128)
            * (m.context as u128)
            * (m.context as u128)
            * 4;
        let needed = scores * 3 * ranks_here as u128;
        let Some(memory) = memory_available_bytes() else {
            return Ok(());
        };
        if needed > memory as u128 {
            bail!(
                "--context {} with --batch {} and {} heads: one layer's attention scores take \
                 about {:.1} GB a rank ({} ranks on this machine), more than its {:.1} GB of \
                 available memory; lower --context or --batch",
                m.context,
                self.run.batch,
                m.heads,
                (scores * 3) as f64 / 1e9,
                ranks_here,
                memory as f64 / 1e9
            );
        }
        Ok(())
    }

    /// The islands as the engine takes them: `None` for one island (and
    /// for `auto`, until the plan has chosen: [`TrainConfig::with_islands`]);
    /// settings that cannot run are an error that says what to set.
    pub fn island_config(&self) -> Result<Option<crate::engine::IslandConfig>> {
        match self.islands.islands {
            OrAuto::Number(n) => self.island_config_of(n),
            // The outer settings checked as they would run.
            OrAuto::Auto(_) => self.island_config_of(2).map(|_| None),
        }
    }

    /// This config with `count` islands (the plan's choice for `auto`).
    pub fn with_islands(&self, count: usize) -> TrainConfig {
        let mut c = self.clone();
        c.islands.islands = OrAuto::Number(count);
        c
    }

    fn island_config_of(&self, count: usize) -> Result<Option<crate::engine::IslandConfig>> {
        let c = &self.islands;
        if count == 0 {
            bail!("islands = 0: a job is at least one island (1: no islands)");
        }
        if count == 1 {
            return Ok(None);
        }
        if !(c.outer_lr > 0.0 && c.outer_lr.is_finite() && (0.0..1.0).contains(&c.outer_momentum)) {
            bail!(
                "outer_lr = {}, outer_momentum = {}: the outer learning rate must be positive \
                 and the momentum in [0, 1) (default 0.3 and 0.6; DiLoCo's 0.7 and 0.9 suit H in the hundreds)",
                c.outer_lr,
                c.outer_momentum
            );
        }
        let quantized = match c.outer_bits {
            4 => Some(crate::zero::allreduce::QuantizedAllReduce {
                format: zeropp_quant::QuantFormat::int4(64)
                    .map_err(|e| anyhow::anyhow!("the outer format: {e}"))?,
                rounding: zeropp_quant::Rounding::NearestEven,
                hadamard: true,
            }),
            32 => None,
            b => bail!("outer_bits = {b}: the outer deltas travel as int4 (4) or f32 (32)"),
        };
        let (sync_every, auto) = c.sync_every.start();
        let islands = crate::engine::IslandConfig {
            count,
            sync_every,
            auto,
            origin: 0,
            outer: crate::zero::outer::OuterSettings {
                lr: c.outer_lr,
                momentum: c.outer_momentum,
                nesterov: true,
            },
            quantized,
            fragments: c.outer_fragments,
            delay: c.outer_delay,
        };
        islands.check()?;
        Ok(Some(islands))
    }
}

/// This machine's available memory (`MemAvailable` of /proc/meminfo), if
/// it says.
fn memory_available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trainer_and_zeropp_torch_read_overrides_alike() {
        // The same overrides as a config file and as fully_shard's
        // keywords (JSON): the same switches, the same reasons.
        use crate::zero::layout::Layout;
        use crate::zero::plan::{resolve, resolve_mode};
        let layout = Layout {
            nodes: 2,
            ranks_per_node: 2,
            rank: 0,
        };
        let routing = Err(zeropp_zero::routing::RoutingError::Unpublished);
        for (mode, overrides) in [
            ("zeropp", "{}"),
            ("zero3", "{}"),
            ("zeropp", r#"{"qwz_bits": 0}"#),
            ("zeropp", r#"{"qwz_bits": 8, "qwz_delta": false}"#),
            ("zero3", r#"{"qgz": true}"#),
            ("zeropp", r#"{"qgz": false}"#),
            ("zeropp", r#"{"qgz": true, "error_feedback": false}"#),
            ("zero3", r#"{"hpz": true, "hpz_group": 1}"#),
            ("zeropp", r#"{"qgz_intra_bits": 8, "qgz_hadamard": false}"#),
            (
                "zeropp",
                r#"{"qgz_inter_block": 32, "block": 128, "qwz_refresh": 7}"#,
            ),
            (
                "zero3",
                r#"{"qgz": true, "qgz_stochastic": true, "fp32_comm": true}"#,
            ),
        ] {
            let json: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(overrides).unwrap();
            let mut toml = format!("mode = \"{mode}\"\n");
            for (k, v) in &json {
                toml += &format!("{k} = {v}\n");
            }
            let cfg = TrainConfig::from_toml_str(&toml).unwrap();
            let (wanted, asked) = cfg.wanted_switches();
            let native = resolve(wanted, &asked, layout, &routing, None).unwrap();
            let torch = resolve_mode(mode, &json, layout, &routing, None).unwrap();
            assert_eq!(native, torch, "{mode} {overrides}");
        }
    }

    #[test]
    fn the_toml_file_and_the_manifest_keep_their_flat_keys() {
        let c = TrainConfig::from_toml_str(
            "mode = \"zero3\"\nqwz_bits = 4\nsteps = 7\nmetrics = \"m.jsonl\"\nkeep = 1\n\
             nodes = 3\n[model]\nwidth = 32\n[optim]\nlr = 0.01\n",
        )
        .expect("a valid config");
        assert_eq!(c.switches.mode, Mode::Zero3);
        assert_eq!(c.switches.qwz_bits, Some(4));
        assert_eq!((c.run.steps, c.run.batch), (7, 8));
        assert_eq!(c.output.metrics, Some(PathBuf::from("m.jsonl")));
        assert_eq!((c.checkpoint.keep, c.launch.nodes), (1, 3));
        assert_eq!((c.model.width, c.optim.lr), (32, 0.01));
        // The manifest's JSON: flat keys, and it reads back the same.
        let json = serde_json::to_value(&c).expect("serializes");
        assert_eq!(json["qwz_bits"], 4);
        assert_eq!(json["steps"], 7);
        assert_eq!(json["model"]["width"], 32);
        let back: TrainConfig = serde_json::from_value(json).expect("reads back");
        assert_eq!(back, c);
        // And the self-launch's TOML round trip.
        let text = toml::to_string(&c).expect("writes TOML");
        assert_eq!(TrainConfig::from_toml_str(&text).expect("reads TOML"), c);
    }

    #[test]
    fn an_unknown_setting_is_named_with_the_settings_there_are() {
        let e = TrainConfig::from_toml_str("stpes = 3\n").unwrap_err();
        let m = format!("{e:#}");
        assert!(
            m.contains("unknown setting \"stpes\"") && m.contains("\"steps\""),
            "{m}"
        );
        let e = TrainConfig::from_toml_str("[model]\nwidht = 3\n").unwrap_err();
        assert!(format!("{e:#}").contains("widht"), "{e:#}");
        // Where a setting goes, and what it takes, in the user's words.
        for (text, said) in [
            ("lr = 0.1\n", "belongs in the [optim] table"),
            (
                "sync_every = \"sometimes\"\n",
                "a whole number, or \"auto\"",
            ),
            ("model = 3\n", "a table of settings ([model]"),
            ("steps = \"many\"\n", "setting \"steps\": invalid type"),
        ] {
            let e = TrainConfig::from_toml_str(text).unwrap_err();
            assert!(format!("{e:#}").contains(said), "{text}: {e:#}");
        }
    }

    #[test]
    fn a_flag_replaces_a_value_and_sets_an_optional_setting() {
        let mut c = TrainConfig::default();
        let args = SwitchArgs {
            qwz_bits: Some(8),
            block: Some(64),
            ..SwitchArgs::default()
        };
        args.apply(&mut c.switches);
        assert_eq!((c.switches.qwz_bits, c.switches.block), (Some(8), 64));
        assert_eq!(c.switches.hpz, None);
    }
}
