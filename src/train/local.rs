//! The whole job on this machine: `zeropp train` without a launcher starts
//! `nodes` × `ranks_per_node` local ranks of itself, and `--compare` runs
//! ZeRO-3 and ZeRO++ one after the other.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::comm::exchange::TransportKind;
use crate::train::config::{Mode, TrainConfig};
use crate::train::plot::{self, Series};
use crate::train::summary::{Summary, comparison_table, step_points};

/// Runs the whole job on this machine as `nodes` × `ranks_per_node` local
/// ranks: what `zeropp train` does when no launcher started it. The ranks
/// read `cfg` from a temporary TOML file. When our stderr is a terminal,
/// rank 0 gets it directly so its progress bar can draw.
pub fn launch_local(cfg: &TrainConfig, timeout_s: Option<f64>) -> Result<()> {
    use std::io::IsTerminal;
    use std::sync::atomic::{AtomicUsize, Ordering};
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    // The ranks on this machine, and the islands (`auto`'s are chosen at
    // join: the launcher keeps one failure domain).
    let world = cfg.launch.nodes * cfg.launch.ranks_per_node;
    let islands = cfg.islands.islands.number().unwrap_or(1).max(1);
    // What every rank would refuse, checked once before any rank starts
    // (else every rank says the same error): the data, the switches, the
    // attention's memory, the checkpoint resumed.
    if let Some(path) = cfg.run.data.as_deref() {
        crate::train::data::Dataset::load(Some(path), cfg.run.seed)?
            .check(world, cfg.model.context)?;
    }
    check_switches(cfg)?;
    cfg.check_attention_fits(world)?;
    if let Some(path) = &cfg.checkpoint.resume {
        crate::train::checkpoint::check_resume(path, cfg.end_step(), (world, islands))?;
    }
    let exe = std::env::current_exe().context("locating the zeropp binary")?;
    let file = std::env::temp_dir().join(format!(
        "zeropp-train-{}-{}.toml",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    // Restarts rejoin islands: a job of one failure domain has none, and a
    // streamed island is not taken back (a rejoin waits for an outer
    // sync's exchanges).
    let restarts = if islands > 1 && cfg.islands.outer_delay == 0 {
        cfg.islands.restarts
    } else {
        0
    };
    let mut cfg = cfg.clone();
    let (kind, note) = TransportKind::choose(cfg.launch.transport, islands > 1 && restarts > 0)?;
    if let Some(why) = note {
        eprintln!("note: using TCP between ranks: {why}");
    }
    cfg.launch.transport = Some(kind);
    let text = toml::to_string(&cfg).context("writing the run's config")?;
    std::fs::write(&file, text).with_context(|| format!("cannot write {}", file.display()))?;
    let result = crate::launch::launch(&crate::launch::LaunchOptions {
        nodes: cfg.launch.nodes,
        ranks_per_node: cfg.launch.ranks_per_node,
        node_rank: None,
        master: None,
        timeout_s,
        grace: std::time::Duration::from_secs(3),
        rank0_terminal: std::io::stderr().is_terminal(),
        islands,
        restarts,
        command: vec![
            exe.display().to_string(),
            "train".into(),
            "--config".into(),
            file.display().to_string(),
        ],
    });
    let _ = std::fs::remove_file(&file);
    Ok(result?)
}

/// The switches resolved as each rank will resolve them, checked once
/// before any rank starts (else every rank says the same error): the
/// logical nodes are this machine, so the routing plan is its topology's
/// and no link is measured. `auto` islands are chosen at join: checked
/// there.
fn check_switches(cfg: &TrainConfig) -> Result<()> {
    let Some(islands) = cfg.islands.islands.number() else {
        return Ok(());
    };
    let layout = crate::zero::layout::Layout {
        nodes: cfg.launch.nodes,
        ranks_per_node: cfg.launch.ranks_per_node,
        rank: 0,
    };
    let routing = match zeropp_topology::detect::detect(Path::new("/")) {
        Ok(topo) => crate::zero::routing::cluster(&vec![topo; layout.nodes], layout.ranks_per_node),
        Err(_) => Err(crate::zero::routing::RoutingError::Unpublished),
    };
    crate::train::trainer::resolve_switches(cfg, (layout, islands), &routing, None).map(|_| ())
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
    c.switches.mode = mode;
    if mode == Mode::Zero3 {
        c.clear_zeropp_overrides();
    }
    tweak(&mut c);
    let metrics = match &cfg.output.metrics {
        Some(p) => per_mode_path(p, name),
        None => dir.join(format!("{name}.jsonl")),
    };
    c.output.metrics = Some(metrics.clone());
    c.output.summary_json = Some(dir.join(format!("{name}.json")));
    // Each run checkpoints (and resumes) in its own directory.
    c.checkpoint.checkpoint_dir = cfg.checkpoint.checkpoint_dir.as_ref().map(|d| d.join(name));
    c.checkpoint.resume = cfg.checkpoint.resume.as_ref().map(|d| d.join(name));
    c.output.plot = None;
    println!("== {name} ==");
    launch_local(&c, timeout_s).with_context(|| format!("the {name} run failed"))?;
    let summary: Summary = serde_json::from_slice(
        &std::fs::read(c.output.summary_json.as_ref().expect("set above"))
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
        let name = mode.to_string();
        runs.push(run_mode(cfg, mode, &name, &dir, timeout_s, &|_| {})?);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let (z3, zpp) = (&runs[0].0, &runs[1].0);
    print!("{}", comparison_table(z3, zpp));
    if let Some(p) = &cfg.output.summary_json {
        let both = serde_json::json!({ "zero3": z3, "zeropp": zpp });
        std::fs::write(p, serde_json::to_vec_pretty(&both)?)
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    if let Some(p) = &cfg.output.plot {
        let series: Vec<Series> = runs
            .iter()
            .map(|(s, losses)| Series {
                name: format!("{} (validation {:.3})", s.mode, s.val_loss),
                points: step_points(losses),
            })
            .collect();
        let title = format!(
            "ZeRO-3 vs ZeRO++, {}",
            crate::comm::shape(z3.nodes, z3.world_size / z3.nodes.max(1))
        );
        plot::loss_curves(p, &title, &series)?;
    }
    Ok((runs[0].0.clone(), runs[1].0.clone()))
}
