//! What a training run reports: one line of `--metrics` per step, the
//! end-of-run summary (`--summary-json`), and `--compare`'s table.

use serde::{Deserialize, Serialize};

use crate::zero::plan::Switches;
use crate::zero::traffic::Traffic;

/// One line of `--metrics`.
#[derive(Serialize)]
pub(crate) struct StepMetrics<'a> {
    pub(crate) step: usize,
    pub(crate) loss: f32,
    pub(crate) grad_norm: f32,
    pub(crate) lr: f32,
    pub(crate) step_time_s: f64,
    /// Rank 0's own work in the step: its time less its waits on
    /// communication.
    pub(crate) compute_s: f64,
    pub(crate) tokens_per_s: f64,
    /// Bytes the whole job sent this step.
    pub(crate) bytes_intra_node: f64,
    pub(crate) bytes_inter_node: f64,
    /// Rank 0's own counters by phase, payload and scales.
    pub(crate) rank0_traffic: &'a Traffic,
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
    /// Mean of the last 10 steps' losses (of `final_steps`, where the
    /// rank ran fewer).
    pub final_loss: f32,
    /// How many steps `final_loss` averages: 10, or fewer on a short run.
    pub final_steps: usize,
    pub val_loss: f32,
    pub tokens_per_s: f64,
    pub median_step_time_s: f64,
    /// Wall time per step over the run's steps (total / steps): with
    /// islands, the outer syncs included.
    #[serde(default)]
    pub mean_step_time_s: f64,
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
    pub measured: Option<crate::zero::measured::Measured>,
    /// What rank 0 kept between steps for ZeRO++ at the end (qwZ
    /// references, qgZ residuals), in bytes.
    #[serde(default)]
    pub kept_bytes: crate::engine::KeptBytes,
    /// Islands: how the job was cut and synced; `null` for one island.
    #[serde(default)]
    pub islands: Option<IslandsSummary>,
    /// `--islands auto`: the count the plan chose and why; `null` when the
    /// count was given.
    #[serde(default)]
    pub islands_chosen: Option<crate::train::auto_islands::IslandsChosen>,
}

/// What the islands did (`--islands`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct IslandsSummary {
    /// Islands, and ranks in each.
    pub count: usize,
    pub ranks_per_island: usize,
    /// Inner steps between a fragment's exchanges, the fragments (units
    /// in consecutive runs, staggered across the H steps) and the steps an
    /// exchange runs behind before it lands.
    pub sync_every: usize,
    pub fragments: usize,
    pub delay: usize,
    /// Exchanges of fragments this run started (those at the end
    /// included), and seconds rank 0's compute thread waited for them.
    pub exchanges: usize,
    pub waited_s: f64,
    /// Seconds one exchange of the whole model took on rank 0's islands'
    /// thread (mean), the smallest H whose inner steps it hides behind
    /// (at this run's inner step), and that said in words.
    pub exchange_s: f64,
    pub hiding_sync_every: usize,
    pub why: String,
    /// How the outer deltas travelled (4: int4 with error feedback, 32:
    /// f32).
    pub outer_bits: u32,
    /// Job-wide bytes of the outer syncs over the run, and of everything
    /// else between nodes (inside the islands).
    pub outer_bytes: f64,
    pub inner_inter_node_bytes: f64,
    /// Islands that left the outer sync (a rank died or did not answer):
    /// each with the step after which the others went on without it. The
    /// islands at the end are the others (`count` minus these).
    #[serde(default)]
    pub lost: Vec<LostIslandSummary>,
    /// Lost islands whose restarted ranks rejoined: each with the step
    /// after which it trained with the others again.
    #[serde(default)]
    pub rejoined: Vec<RejoinedIsland>,
    /// `--sync-every auto`: the H chosen, the step it counts from, and
    /// why (`sync_every` is then that H); `null` otherwise or before the
    /// first sync.
    #[serde(default)]
    pub sync_every_chosen: Option<ChosenSyncEvery>,
}

/// An automatic H as the summary says it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ChosenSyncEvery {
    pub sync_every: usize,
    pub from_step: usize,
    pub why: String,
}

/// A lost island back in the outer sync.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RejoinedIsland {
    pub island: usize,
    pub after_step: u64,
}

/// An island that left the outer sync, as the summary says it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct LostIslandSummary {
    pub island: usize,
    pub after_step: u64,
    pub why: String,
}

impl Summary {
    /// What rank 0 prints at the end of a run.
    pub fn done_line(&self) -> String {
        let last = match self.final_steps {
            // Restarted and taken back after the last step.
            0 => "no step of this rank's own".to_string(),
            1 => "last step".to_string(),
            n => format!("last {n} steps"),
        };
        let mut line = format!(
            "done: loss {:.4} -> {:.4} ({last}), validation {:.4}; {:.0} tokens/s; {:.3} MB \
             across nodes and {:.3} MB inside nodes per step; peak RSS per rank {:.0}-{:.0} MB; \
             kept for ZeRO++ {:.3} MB (qwZ references {:.3}, qgZ residuals {:.3}, hpZ secondary \
             shards {:.3}); reused buffers held {:.3} MB",
            self.initial_loss,
            self.final_loss,
            self.val_loss,
            self.tokens_per_s,
            self.bytes_per_step.inter_node / 1e6,
            self.bytes_per_step.intra_node / 1e6,
            self.peak_rss_bytes.iter().min().copied().unwrap_or(0) as f64 / 1e6,
            self.peak_rss_bytes.iter().max().copied().unwrap_or(0) as f64 / 1e6,
            (self.kept_bytes.qwz_references
                + self.kept_bytes.qgz_residuals
                + self.kept_bytes.hpz_secondary) as f64
                / 1e6,
            self.kept_bytes.qwz_references as f64 / 1e6,
            self.kept_bytes.qgz_residuals as f64 / 1e6,
            self.kept_bytes.hpz_secondary as f64 / 1e6,
            self.kept_bytes.scratch as f64 / 1e6,
        );
        if let Some(i) = &self.islands {
            line += &format!(
                "; islands: {} of {}, {} exchanges of {} (every {} steps, landing {} steps \
                 later; {:.2} s waited), {:.3} MB across islands in all, outer state {:.3} MB \
                 per rank; {:.3} s per step with the syncs",
                i.count,
                crate::comm::count(i.ranks_per_island, "rank"),
                i.exchanges,
                crate::comm::count(i.fragments, "fragment"),
                i.sync_every,
                i.delay,
                i.waited_s,
                i.outer_bytes / 1e6,
                self.kept_bytes.outer_state as f64 / 1e6,
                self.mean_step_time_s,
            );
            for l in &i.lost {
                line += &format!(
                    "; island {} lost after step {} ({}), the others went on",
                    l.island, l.after_step, l.why
                );
            }
            if let Some(c) = &i.sync_every_chosen {
                line += &format!(
                    "; H = {} chosen at step {} ({})",
                    c.sync_every, c.from_step, c.why
                );
            }
            for r in &i.rejoined {
                line += &format!("; island {} rejoined after step {}", r.island, r.after_step);
            }
        }
        line
    }
}

/// This process's peak resident set (`VmHWM` of `/proc/self/status`), in
/// bytes; `None` off Linux.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// `(step, loss)` pairs as plot points.
pub(crate) fn step_points(losses: &[(usize, f32)]) -> Vec<(f64, f64)> {
    losses.iter().map(|&(s, l)| (s as f64, l as f64)).collect()
}

pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(0.0)
}

/// The side-by-side table `--compare` prints.
pub fn comparison_table(z3: &Summary, zpp: &Summary) -> String {
    let last = match z3.final_steps.min(zpp.final_steps) {
        1 => "final loss (last step)".to_string(),
        n => format!("final loss (last {n} steps)"),
    };
    let rows: [(&str, f64, f64); 6] = [
        (last.as_str(), z3.final_loss as f64, zpp.final_loss as f64),
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
