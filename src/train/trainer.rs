//! `zeropp train`: one config (flags, or a TOML file with the same names),
//! the training loop on each rank, per-step metrics and the end-of-run
//! summary. Without rank facts in the environment the command launches
//! itself as `nodes` × `ranks_per_node` local ranks.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::comm::env::RankFacts;
use crate::comm::job::{Job, TransportKind};
use crate::engine::optim::OptimConfig;
use crate::engine::{Engine, EngineConfig};
use crate::train::checkpoint;
use crate::train::data::Dataset;
use crate::train::model::ModelConfig;
use crate::train::plot::{self, Series};
use crate::zero::plan::{Layout, Switches};
use crate::zero::traffic::Traffic;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

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

/// One line of `--metrics`.
#[derive(Serialize)]
struct StepMetrics<'a> {
    step: usize,
    loss: f32,
    grad_norm: f32,
    lr: f32,
    step_time_s: f64,
    /// Rank 0's own work in the step: its time less its waits on
    /// communication.
    compute_s: f64,
    tokens_per_s: f64,
    /// Bytes the whole job sent this step.
    bytes_intra_node: f64,
    bytes_inter_node: f64,
    /// Rank 0's own counters by phase, payload and scales.
    rank0_traffic: &'a Traffic,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct BytesPerStep {
    pub intra_node: f64,
    pub inter_node: f64,
}

/// The end-of-run summary (`--summary-json`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Summary {
    pub mode: String,
    /// The switches the engine ran with, resolved from the flags and the
    /// routing plan (what rank 0 prints at start).
    pub switches: Switches,
    pub world_size: usize,
    pub nodes: usize,
    pub params: usize,
    pub steps: usize,
    pub initial_loss: f32,
    /// Mean of the last 10 steps' losses.
    pub final_loss: f32,
    pub val_loss: f32,
    pub tokens_per_s: f64,
    pub median_step_time_s: f64,
    /// Rank 0's own work per step (compute, and the quantization on its
    /// compute thread): the step less its waits on communication, median.
    /// What `zeropp plan --measured` takes as the compute.
    #[serde(default)]
    pub median_compute_s: f64,
    /// Job-wide bytes per step, averaged over the training steps.
    pub bytes_per_step: BytesPerStep,
    /// Job-wide bytes over the whole run (training and validation), and the
    /// number of messages that carried them (each adds a 40-byte frame
    /// header on the wire); rendezvous and connection set-up not included.
    pub run_bytes: BytesPerStep,
    pub run_messages: BytesPerStep,
    /// Each rank's peak resident memory (`VmHWM`) over the run, in rank
    /// order; 0 where the kernel does not say.
    #[serde(default)]
    pub peak_rss_bytes: Vec<u64>,
    /// Where each chosen switch came from (asked, the routing plan, or the
    /// routes timed at join).
    #[serde(default)]
    pub why: std::collections::BTreeMap<String, String>,
    /// What the job measured at join (default mode on nodes that are
    /// hosts), `null` otherwise.
    #[serde(default)]
    pub measured: Option<crate::zero::probe::Measured>,
    /// What rank 0 kept between steps for ZeRO++ at the end (qwZ
    /// references, qgZ residuals), in bytes.
    #[serde(default)]
    pub kept_bytes: crate::engine::KeptBytes,
}

/// This process's peak resident set (`VmHWM` of `/proc/self/status`), in
/// bytes; `None` off Linux.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// A line from rank 0: above the progress bar when it draws, on stdout
/// otherwise.
fn say(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        println!("{line}");
    } else {
        bar.println(line);
    }
}

/// `skip_nonfinite` gives up after this many skipped steps in a row.
const MAX_CONSECUTIVE_SKIPS: usize = 10;

fn save_checkpoint(
    engine: &Engine,
    cfg: &TrainConfig,
    root: &Path,
    step: usize,
    rank: usize,
    bar: &ProgressBar,
) -> Result<()> {
    let t = Instant::now();
    let dir = checkpoint::save(engine, cfg, root, step, rank, cfg.keep)?;
    if rank == 0 {
        say(
            bar,
            format!(
                "saved checkpoint {} ({:.2} s)",
                dir.display(),
                t.elapsed().as_secs_f64()
            ),
        );
    }
    Ok(())
}

/// `(step, loss)` pairs as plot points.
fn step_points(losses: &[(usize, f32)]) -> Vec<(f64, f64)> {
    losses.iter().map(|&(s, l)| (s as f64, l as f64)).collect()
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(0.0)
}

/// In the default mode, on nodes that are hosts (not logical nodes of one
/// machine, whose links are not the cluster's being emulated): the job's
/// links and each collective's routes measured at join
/// ([`crate::zero::probe`]), which the plan chooses the switches by. The
/// counter (which counted the probe) is the engine's.
fn measure_links(
    counter: &std::sync::Arc<crate::zero::traffic::CountingTransport>,
    table: &[crate::comm::rendezvous::PeerInfo],
    layout: Layout,
    cfg: &TrainConfig,
    wanted: &crate::zero::plan::Switches,
    facts: &RankFacts,
) -> Result<Option<crate::zero::probe::Measured>> {
    let hosts: std::collections::BTreeSet<(&str, &str)> = table
        .iter()
        .map(|p| (p.host.as_str(), p.host_id.as_str()))
        .collect();
    let probe = cfg.mode == Mode::Zeropp
        && layout.world() > 1
        && hosts.len() == layout.nodes
        && crate::zero::probe::enabled();
    if !probe {
        return Ok(None);
    }
    let g = layout.ranks_per_node;
    let comm = crate::comm::Communicator::new(counter.clone(), facts.timeout);
    let groups = crate::zero::ZeroGroups::new(&layout, g)?;
    counter.set_phase(crate::zero::traffic::Phase::Other, 0.0);
    let m = crate::zero::probe::measure_all(
        &comm,
        counter,
        &groups,
        layout,
        wanted,
        crate::zero::probe::BUDGET,
        cfg.model.units().iter().map(|u| u.numel(&cfg.model)).max(),
    )
    .map_err(|e| anyhow::anyhow!("measuring the links at join: {e}"))?;
    Ok(Some(m))
}

/// Runs this rank's part of the job described by the environment.
pub fn run_rank(cfg: &TrainConfig) -> Result<Option<Summary>> {
    cfg.validate()?;
    let facts = RankFacts::from_env()?;
    let layout = Layout {
        nodes: facts.nodes(),
        ranks_per_node: facts.local_world_size,
        rank: facts.rank,
    };
    if facts.node_rank * facts.local_world_size + facts.local_rank != facts.rank {
        bail!(
            "rank {} is local rank {} of node {}: zeropp needs ranks numbered node by node \
             (rank = node x ranks-per-node + local rank); use block distribution in your launcher",
            facts.rank,
            facts.local_rank,
            facts.node_rank
        );
    }
    let data = Dataset::load(cfg.data.as_deref(), cfg.seed)?;
    data.check(layout.world(), cfg.model.context)?;
    // Each node's first rank publishes what the machine is made of; rank 0
    // merges the nodes' facts and prints the routing plan they lead to.
    let published = if facts.local_rank == 0 {
        match zeropp_topology::detect::detect(Path::new("/")) {
            Ok(t) => serde_json::json!({ "topology": t }),
            Err(e) => {
                tracing::debug!("no topology facts: {e}");
                serde_json::Value::Null
            }
        }
    } else {
        serde_json::Value::Null
    };
    let (transport, table) = match cfg.transport {
        Some(kind) => Job::connect_over(kind, &facts, published)?,
        None => Job::connect(&facts, published)?,
    };
    // Every rank derives the same plan from the same published facts; the
    // engine takes its hpZ group from it unless --hpz-group says otherwise.
    let routing = cluster_plan(&table, layout.nodes, layout.ranks_per_node);
    let mut asked = Vec::new();
    let mut wanted = cfg.switches();
    if let Some(h) = cfg.hpz_group {
        wanted.hpz_group = Some(h);
        asked.push("hpz_group");
    }
    if cfg.qgz_intra_bits.is_some() {
        asked.push("qgz_intra_bits");
    }
    for (name, set) in [
        ("qwz_bits", cfg.qwz_bits.is_some()),
        ("hpz", cfg.hpz.is_some()),
        ("qgz", cfg.qgz.is_some()),
        ("error_feedback", cfg.error_feedback.is_some()),
        ("qwz_delta", cfg.qwz_delta.is_some()),
        ("qgz_hadamard", cfg.qgz_hadamard.is_some()),
    ] {
        if set {
            asked.push(name);
        }
    }
    let counter = std::sync::Arc::new(crate::zero::traffic::CountingTransport::new(
        transport,
        layout.ranks_per_node,
    ));
    let timed = crate::zero::plan::as_they_would_run(wanted.clone(), &asked, layout);
    let measured = measure_links(&counter, &table, layout, cfg, &timed, &facts)?;
    let resolved = crate::zero::plan::resolve(wanted, &asked, layout, &routing, measured.as_ref())
        .map_err(|e| anyhow::anyhow!("invalid switches: {e}"))?;
    let switches = resolved.switches.clone();
    if facts.rank == 0 {
        println!("{}", routing_report(&routing));
        if let (true, Some(h)) = (switches.hpz, switches.hpz_group) {
            println!(
                "engine: hpZ secondary shards over groups of {h} ranks ({})",
                resolved.why["hpz_group"]
            );
        }
        if switches.qgz {
            println!(
                "engine: qgZ int{} inside the node, int4 across ({})",
                switches.qgz_intra_bits, resolved.why["qgz_intra_bits"]
            );
        }
        if measured.is_some() {
            for name in ["qwz_bits", "qgz", "hpz"] {
                if let Some(why) = resolved.why.get(name).filter(|w| *w != "asked") {
                    println!("engine: {name} {why}");
                }
            }
        }
    }
    let transport_name = crate::comm::Transport::name(&*counter);
    let engine_cfg = EngineConfig {
        model: std::sync::Arc::new(cfg.model.clone()),
        switches: switches.clone(),
        optim: cfg.optim.clone(),
        seed: cfg.seed,
    };
    let mut engine = Engine::counted(counter, layout, engine_cfg, facts.timeout)?;
    let lead = facts.rank == 0;
    let world = layout.world();
    let start = match &cfg.resume {
        None => 0,
        Some(path) => {
            let dir = checkpoint::resolve(path)?;
            let m = checkpoint::read_manifest(&dir)?;
            let state = checkpoint::state_for(&dir, &m, &engine.unit_layouts(), layout.rank)?;
            engine.load_shard_state(state, m.step)?;
            if lead {
                println!(
                    "resumed from {} at step {} (saved on {} ranks, running on {world})",
                    dir.display(),
                    m.step,
                    m.world_size
                );
            }
            m.step
        }
    };
    let end = cfg.stop_after.unwrap_or(cfg.steps).min(cfg.steps);
    if start >= end {
        bail!(
            "the checkpoint is at step {start} and this run would stop at step {end}: raise --steps \
             (or --stop-after) to train further"
        );
    }
    let mut saved_at = None;
    let mut consecutive_skips = 0;
    let tokens_per_step = (world * cfg.batch * cfg.model.context) as f64;
    let mut metrics = match (&cfg.metrics, lead) {
        (Some(p), true) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
        )),
        _ => None,
    };
    if lead {
        println!(
            "training {} parameters, {} nodes x {} ranks over {}, mode {:?}, {} steps of {} tokens",
            engine.parameter_count(),
            layout.nodes,
            layout.ranks_per_node,
            transport_name.to_uppercase(),
            cfg.mode,
            cfg.steps,
            tokens_per_step
        );
        println!("switches: {}", serde_json::to_string(&switches)?);
    }
    // The metrics file opens with what ran: the same resolved switches as
    // the summary and the manifest, and where each chosen value came from.
    if let Some(m) = metrics.as_mut() {
        let header = serde_json::json!({ "header": {
            "mode": format!("{:?}", cfg.mode).to_lowercase(),
            "switches": &switches,
            "why": &resolved.why,
            "measured": &measured,
            "world_size": world,
            "nodes": layout.nodes,
            "ranks_per_node": layout.ranks_per_node,
            "params": engine.parameter_count(),
            "transport": transport_name,
            "seed": cfg.seed,
            "steps": cfg.steps,
            "start_step": start,
        }});
        writeln!(m, "{header}")?;
    }
    // A bar where rank 0's stderr is a terminal (`zeropp train` hands it
    // the terminal when it launches itself); progress lines otherwise.
    let bar = if lead {
        ProgressBar::with_draw_target(Some(cfg.steps as u64), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg} [{elapsed_precise}<{eta}]")
            .expect("a valid template"),
    );
    let (mut losses, mut times, mut computes) = (Vec::new(), Vec::new(), Vec::new());
    let (mut sum_intra, mut sum_inter) = (0f64, 0f64);
    bar.set_position(start as u64);
    for step in start..end {
        let (x, y) = data.train_batch(
            facts.rank,
            world,
            step,
            cfg.seed,
            cfg.batch,
            cfg.model.context,
        )?;
        let lr = cfg.optim.lr_at(step, cfg.steps);
        let t = Instant::now();
        let stats = engine.train_step(&x, &y, lr)?;
        let dt = t.elapsed().as_secs_f64();
        consecutive_skips = if stats.skipped.is_some() {
            consecutive_skips + 1
        } else {
            0
        };
        if consecutive_skips >= MAX_CONSECUTIVE_SKIPS {
            bail!(
                "steps {} to {} were all non-finite and skipped: the model itself has diverged; \
                 resume from an earlier checkpoint with a lower learning rate",
                step + 2 - consecutive_skips,
                step + 1
            );
        }
        if let (Some(units), true) = (&stats.skipped, lead) {
            say(
                &bar,
                format!(
                    "step {} skipped: non-finite loss ({}) or gradient in units {units:?}",
                    step + 1,
                    stats.loss
                ),
            );
        }
        let mine = stats.traffic.total();
        let job = engine.sum_over_ranks(&[mine.intra_node as f32, mine.inter_node as f32])?;
        sum_intra += job[0] as f64;
        sum_inter += job[1] as f64;
        if stats.loss.is_finite() {
            losses.push((step + 1, stats.loss));
        }
        times.push(dt);
        let compute = (dt - stats.waited_s).max(0.0);
        computes.push(compute);
        if lead {
            if let Some(m) = metrics.as_mut() {
                let line = StepMetrics {
                    step: step + 1,
                    loss: stats.loss,
                    grad_norm: stats.grad_norm,
                    lr,
                    step_time_s: dt,
                    compute_s: compute,
                    tokens_per_s: tokens_per_step / dt,
                    bytes_intra_node: job[0] as f64,
                    bytes_inter_node: job[1] as f64,
                    rank0_traffic: &stats.traffic,
                };
                serde_json::to_writer(&mut *m, &line)?;
                m.write_all(b"\n")?;
            }
            bar.set_message(format!(
                "loss {:.4} | {:.0} tok/s | {:.3} MB across nodes/step",
                stats.loss,
                tokens_per_step / dt,
                job[1] as f64 / 1e6
            ));
            bar.inc(1);
            let due = (step + 1) % cfg.log_every.max(1) == 0 || step == start || step + 1 == end;
            if due && bar.is_hidden() {
                println!(
                    "step {:>5}/{} loss {:.4} lr {:.2e} {:>8.0} tok/s {:>8.3} MB across nodes/step \
                     peak RSS {:.0} MB",
                    step + 1,
                    cfg.steps,
                    stats.loss,
                    lr,
                    tokens_per_step / dt,
                    job[1] as f64 / 1e6,
                    peak_rss_bytes().unwrap_or(0) as f64 / 1e6
                );
            }
        }
        if let Some(root) = &cfg.checkpoint_dir
            && cfg.save_every > 0
            && (step + 1) % cfg.save_every == 0
        {
            save_checkpoint(&engine, cfg, root, step + 1, layout.rank, &bar)?;
            saved_at = Some(step + 1);
        }
    }
    if let Some(root) = &cfg.checkpoint_dir
        && saved_at != Some(end)
    {
        save_checkpoint(&engine, cfg, root, end, layout.rank, &bar)?;
    }
    bar.finish_and_clear();
    if let Some(m) = metrics.as_mut() {
        m.flush()?;
    }
    let mut val = 0.0;
    for i in 0..cfg.val_batches.max(1) {
        let (x, y) = data.val_batch(facts.rank, i, cfg.batch, cfg.model.context)?;
        val += engine.evaluate(&x, &y)?;
    }
    let val_loss = val / cfg.val_batches.max(1) as f32;
    let traffic = engine.traffic();
    let (all, msgs) = (traffic.total(), traffic.messages);
    let run = engine.sum_over_ranks(&[
        all.intra_node as f32,
        all.inter_node as f32,
        msgs.intra_node as f32,
        msgs.inter_node as f32,
    ])?;
    let peaks = engine.all_gather_bytes(Bytes::copy_from_slice(
        &peak_rss_bytes().unwrap_or(0).to_le_bytes(),
    ))?;
    let peak_rss_bytes = peaks
        .iter()
        .map(|b| {
            let a: [u8; 8] = b[..].try_into().map_err(|_| {
                anyhow::anyhow!("a rank's peak memory arrived as {} bytes, not 8", b.len())
            })?;
            Ok(u64::from_le_bytes(a))
        })
        .collect::<Result<Vec<u64>>>()?;
    let tail: Vec<f32> = losses[losses.len().saturating_sub(10)..]
        .iter()
        .map(|&(_, l)| l)
        .collect();
    let summary = Summary {
        mode: format!("{:?}", cfg.mode).to_lowercase(),
        switches: engine.switches().clone(),
        why: resolved.why.clone(),
        measured: measured.clone(),
        world_size: world,
        nodes: layout.nodes,
        params: engine.parameter_count(),
        steps: end,
        initial_loss: losses.first().map_or(f32::NAN, |&(_, l)| l),
        final_loss: tail.iter().sum::<f32>() / tail.len() as f32,
        val_loss,
        tokens_per_s: tokens_per_step / median(&times),
        median_step_time_s: median(&times),
        median_compute_s: median(&computes),
        bytes_per_step: BytesPerStep {
            intra_node: sum_intra / (end - start) as f64,
            inter_node: sum_inter / (end - start) as f64,
        },
        run_bytes: BytesPerStep {
            intra_node: run[0] as f64,
            inter_node: run[1] as f64,
        },
        run_messages: BytesPerStep {
            intra_node: run[2] as f64,
            inter_node: run[3] as f64,
        },
        peak_rss_bytes,
        kept_bytes: engine.kept_bytes(),
    };
    if !lead {
        return Ok(None);
    }
    println!(
        "done: loss {:.4} -> {:.4} (last 10 steps), validation {:.4}; {:.0} tokens/s; {:.3} MB across \
         nodes and {:.3} MB inside nodes per step; peak RSS per rank {:.0}-{:.0} MB; kept for ZeRO++ \
         {:.3} MB (qwZ references {:.3}, qgZ residuals {:.3})",
        summary.initial_loss,
        summary.final_loss,
        summary.val_loss,
        summary.tokens_per_s,
        summary.bytes_per_step.inter_node / 1e6,
        summary.bytes_per_step.intra_node / 1e6,
        summary.peak_rss_bytes.iter().min().copied().unwrap_or(0) as f64 / 1e6,
        summary.peak_rss_bytes.iter().max().copied().unwrap_or(0) as f64 / 1e6,
        (summary.kept_bytes.qwz_references + summary.kept_bytes.qgz_residuals) as f64 / 1e6,
        summary.kept_bytes.qwz_references as f64 / 1e6,
        summary.kept_bytes.qgz_residuals as f64 / 1e6,
    );
    if let Some(p) = &cfg.plot {
        let series = Series {
            name: format!("{} (validation {:.3})", summary.mode, summary.val_loss),
            points: step_points(&losses),
        };
        let title = format!(
            "training loss, {} nodes x {} ranks",
            layout.nodes, layout.ranks_per_node
        );
        plot::loss_curves(p, &title, &[series])?;
    }
    if let Some(p) = &cfg.summary_json {
        std::fs::write(p, serde_json::to_vec_pretty(&summary)?)
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(Some(summary))
}

/// Runs the whole job on this machine as `nodes` × `ranks_per_node` local
/// ranks: what `zeropp train` does when no launcher started it. The ranks
/// read `cfg` from a temporary TOML file. When our stderr is a terminal,
/// rank 0 gets it directly so its progress bar can draw.
pub fn launch_local(cfg: &TrainConfig, timeout_s: Option<f64>) -> Result<()> {
    use std::io::IsTerminal;
    use std::sync::atomic::{AtomicUsize, Ordering};
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let exe = std::env::current_exe().context("locating the zeropp binary")?;
    let file = std::env::temp_dir().join(format!(
        "zeropp-train-{}-{}.toml",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    let mut cfg = cfg.clone();
    cfg.transport = default_transport(cfg.transport);
    let text = toml::to_string(&cfg).context("writing the run's config")?;
    std::fs::write(&file, text).with_context(|| format!("cannot write {}", file.display()))?;
    let result = crate::launch::launch(&crate::launch::LaunchOptions {
        nodes: cfg.nodes,
        ranks_per_node: cfg.ranks_per_node,
        node_rank: None,
        master: None,
        timeout_s,
        grace: std::time::Duration::from_secs(3),
        rank0_terminal: std::io::stderr().is_terminal(),
        command: vec![
            exe.display().to_string(),
            "train".into(),
            "--config".into(),
            file.display().to_string(),
        ],
    });
    let _ = std::fs::remove_file(&file);
    result
}

/// The cluster view and routing plan (for the weakest node, as `zeropp topo
/// plan` for a whole job) from the topology facts each node's first rank
/// published, or why there is none.
fn cluster_plan(
    table: &[crate::comm::rendezvous::PeerInfo],
    nodes: usize,
    ranks_per_node: usize,
) -> Result<zeropp_topology::plan::ClusterView, String> {
    let tops: Option<Vec<zeropp_topology::Topology>> = (0..nodes)
        .map(|n| {
            let p = table
                .iter()
                .find(|p| p.node_rank == n && p.local_rank == 0)?;
            serde_json::from_value(p.facts.get("topology")?.clone()).ok()
        })
        .collect();
    let tops = tops.ok_or("not every node published its facts")?;
    zeropp_topology::plan::cluster(&tops, ranks_per_node)
}

/// What rank 0 prints about the cluster: the nodes, how they differ, and
/// the routing plan.
fn routing_report(routing: &Result<zeropp_topology::plan::ClusterView, String>) -> String {
    match routing {
        Ok(view) => {
            let mut s = format!(
                "topology: {} node(s) on {}",
                view.hosts.len(),
                view.hosts.join(", ")
            );
            if !view.differences.is_empty() {
                s += &format!(
                    "; they differ, so the plan is for node {}:",
                    view.planned_for
                );
                for d in &view.differences {
                    s += &format!("\n  {d}");
                }
            }
            s += "\nrouting plan: ";
            s += view.plan.render().trim_end();
            s
        }
        Err(e) => format!("topology: no routing plan ({e})"),
    }
}

/// The transport of a self-launched run: the one asked for (`--transport`,
/// or `ZEROPP_TRANSPORT`, which the ranks read), else UCX (shared memory
/// between the ranks of a node, TCP between nodes) when libucp loads, else
/// TCP with a note saying how to get UCX.
fn default_transport(asked: Option<TransportKind>) -> Option<TransportKind> {
    if asked.is_some() || std::env::var_os("ZEROPP_TRANSPORT").is_some() {
        return asked;
    }
    let (kind, why_not_ucx) = TransportKind::default_here();
    if let Some(why) = why_not_ucx {
        eprintln!("note: using TCP between ranks: {why}");
    }
    Some(kind)
}

/// `--metrics FILE` of one mode of a comparison: FILE with the mode before
/// its extension (`m.jsonl` → `m.zero3.jsonl`).
pub fn per_mode_path(path: &Path, mode: &str) -> PathBuf {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("jsonl");
    path.with_extension(format!("{mode}.{ext}"))
}

/// `(step, loss)` of every line of a `--metrics` file.
fn read_losses(path: &Path) -> Result<Vec<(usize, f32)>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut out = Vec::new();
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l)?;
        if v.get("header").is_some() {
            continue;
        }
        let Some(step) = v["step"].as_u64() else {
            bail!("{}: a line without a step", path.display());
        };
        // A skipped non-finite step's loss is null: no point to draw.
        if let Some(loss) = v["loss"].as_f64() {
            out.push((step as usize, loss as f32));
        }
    }
    Ok(out)
}

/// One run of a comparison on this machine: `cfg` in `mode` (ZeRO-3 with
/// every ZeRO++ override cleared), then `tweak`, named `name` (its metrics
/// next to `--metrics` with the name before the extension, or in `dir`).
/// Returns its summary and `(step, loss)` points.
pub fn run_mode(
    cfg: &TrainConfig,
    mode: Mode,
    name: &str,
    dir: &Path,
    timeout_s: Option<f64>,
    tweak: &dyn Fn(&mut TrainConfig),
) -> Result<(Summary, Vec<(usize, f32)>)> {
    let mut c = cfg.clone();
    c.mode = mode;
    if mode == Mode::Zero3 {
        (c.qwz_bits, c.hpz, c.qgz, c.error_feedback) = (None, None, None, None);
        (c.qwz_delta, c.qgz_hadamard, c.qgz_inter_block) = (None, None, None);
    }
    tweak(&mut c);
    let metrics = match &cfg.metrics {
        Some(p) => per_mode_path(p, name),
        None => dir.join(format!("{name}.jsonl")),
    };
    c.metrics = Some(metrics.clone());
    c.summary_json = Some(dir.join(format!("{name}.json")));
    // Each run checkpoints (and resumes) in its own directory.
    c.checkpoint_dir = cfg.checkpoint_dir.as_ref().map(|d| d.join(name));
    c.resume = cfg.resume.as_ref().map(|d| d.join(name));
    c.plot = None;
    println!("== {name} ==");
    launch_local(&c, timeout_s).with_context(|| format!("the {name} run failed"))?;
    let summary: Summary = serde_json::from_slice(
        &std::fs::read(c.summary_json.as_ref().expect("set above"))
            .context("reading the run's summary")?,
    )?;
    Ok((summary, read_losses(&metrics)?))
}

/// `zeropp train --compare`: the same seed, data and model under plain
/// ZeRO-3 and under ZeRO++ (with any switch overrides), one after the
/// other, then both side by side. The switch overrides apply to the ZeRO++
/// run only.
pub fn compare(cfg: &TrainConfig, timeout_s: Option<f64>) -> Result<(Summary, Summary)> {
    let dir = std::env::temp_dir().join(format!("zeropp-compare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut runs = Vec::new();
    for mode in [Mode::Zero3, Mode::Zeropp] {
        let name = format!("{mode:?}").to_lowercase();
        runs.push(run_mode(cfg, mode, &name, &dir, timeout_s, &|_| {})?);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let (z3, zpp) = (&runs[0].0, &runs[1].0);
    print!("{}", comparison_table(z3, zpp));
    if let Some(p) = &cfg.summary_json {
        let both = serde_json::json!({ "zero3": z3, "zeropp": zpp });
        std::fs::write(p, serde_json::to_vec_pretty(&both)?)
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    if let Some(p) = &cfg.plot {
        let series: Vec<Series> = runs
            .iter()
            .map(|(s, losses)| Series {
                name: format!("{} (validation {:.3})", s.mode, s.val_loss),
                points: step_points(losses),
            })
            .collect();
        let title = format!(
            "ZeRO-3 vs ZeRO++, {} nodes x {} ranks",
            z3.nodes,
            z3.world_size / z3.nodes.max(1)
        );
        plot::loss_curves(p, &title, &series)?;
    }
    Ok((runs[0].0.clone(), runs[1].0.clone()))
}

/// The side-by-side table `--compare` prints.
pub fn comparison_table(z3: &Summary, zpp: &Summary) -> String {
    let rows: [(&str, f64, f64); 6] = [
        (
            "final loss (last 10 steps)",
            z3.final_loss as f64,
            zpp.final_loss as f64,
        ),
        ("validation loss", z3.val_loss as f64, zpp.val_loss as f64),
        (
            "median step time (s)",
            z3.median_step_time_s,
            zpp.median_step_time_s,
        ),
        ("tokens/s", z3.tokens_per_s, zpp.tokens_per_s),
        (
            "MB across nodes per step",
            z3.bytes_per_step.inter_node / 1e6,
            zpp.bytes_per_step.inter_node / 1e6,
        ),
        (
            "MB inside nodes per step",
            z3.bytes_per_step.intra_node / 1e6,
            zpp.bytes_per_step.intra_node / 1e6,
        ),
    ];
    let mut out = format!(
        "\n{:<28} {:>12} {:>12} {:>14}\n",
        "", "zero3", "zeropp", "zeropp/zero3"
    );
    for (name, a, b) in rows {
        let ratio = if a != 0.0 { b / a } else { f64::NAN };
        out += &format!("{name:<28} {a:>12.4} {b:>12.4} {ratio:>14.3}\n");
    }
    out
}
