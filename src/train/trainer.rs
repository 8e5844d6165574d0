//! `zeropp train` on one rank: a [`Trainer`] joins the job, resolves the
//! switches, builds the engine (resuming a checkpoint when asked), and runs
//! a short loop that hands each step to its collaborators — `Records`
//! (metrics file, progress, totals), `Checkpointer` and `Validator` —
//! then writes the summary. Without rank facts in the environment the
//! command launches itself instead (`train::local`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use bytes::Bytes;

use crate::comm::env::RankFacts;
use crate::comm::exchange::TransportKind;
use crate::comm::job::Job;
use crate::engine::{Engine, EngineConfig, StepStats};
use crate::train::auto_islands::IslandsChosen;
use crate::train::checkpoint;
use crate::train::config::{Mode, TrainConfig};
use crate::train::data::Dataset;
use crate::train::plot::{self, Series};
use crate::train::summary::{
    BytesPerStep, ChosenSyncEvery, IslandsSummary, LostIslandSummary, RejoinedIsland, StepMetrics,
    Summary, median, peak_rss_bytes, step_points,
};
use crate::zero::layout::Layout;
use crate::zero::measured::Measured;
use crate::zero::plan::Resolved;
use crate::zero::traffic::Traffic;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// `skip_nonfinite` gives up after this many skipped steps in a row.
const MAX_CONSECUTIVE_SKIPS: usize = 10;

/// Runs this rank's part of the job described by the environment: the
/// summary on rank 0, `None` on the others.
pub fn run_rank(cfg: &TrainConfig) -> Result<Option<Summary>> {
    Trainer::join(cfg)?.train()
}

/// One rank's training run.
pub struct Trainer {
    /// The run's settings (with the islands an `auto` run chose).
    cfg: TrainConfig,
    facts: RankFacts,
    layout: Layout,
    data: Dataset,
    engine: Engine,
    /// The switches the engine runs with, and where each came from.
    resolved: Resolved,
    /// What the job measured at join (default mode on hosts).
    measured: Option<Measured>,
    /// `--islands auto`'s choice.
    islands_chosen: Option<crate::train::auto_islands::IslandsChosen>,
    /// The first step to run and the step to stop after.
    start: usize,
    end: usize,
    records: Records,
    checkpointer: Option<Checkpointer>,
    validator: Validator,
}

impl Trainer {
    /// Joins the job the environment describes: rank facts, data, the
    /// connections (publishing this node's topology facts), the routing
    /// plan and the switches it leads to, the engine, and a checkpoint's
    /// state when `resume` is set.
    pub fn join(asked: &TrainConfig) -> Result<Trainer> {
        asked.validate()?;
        let mut facts = RankFacts::from_env()?;
        let layout = rank_layout(&facts)?;
        facts.islands = islands_of(asked, &facts)?;
        if facts.rejoin && !crate::comm::rendezvous::job_is_running(&facts)? {
            // Its first start failed before any island joined: nobody has
            // trained, so it starts with the others.
            eprintln!(
                "rank {}: restarted before the islands met: starting with them from step 0",
                facts.rank
            );
            facts.rejoin = false;
        }
        let data = Dataset::load(asked.run.data.as_deref(), asked.run.seed)?;
        data.check(layout.world(), asked.model.context)?;
        let Connected {
            job,
            resolved,
            islands,
            chosen,
        } = connect(asked, &facts, layout)?;
        let measured = job.measured_so_far();
        let cfg = asked.with_islands(islands);
        let islands = cfg.island_config()?;
        let lead = facts.rank == 0;
        if lead {
            prepare_outputs(&cfg, facts.rejoin)?;
        }
        let transport_name = crate::comm::Transport::name(&*job.counter);
        let engine_cfg = EngineConfig {
            model: std::sync::Arc::new(cfg.model.clone()),
            switches: resolved.switches.clone(),
            optim: cfg.optim.clone(),
            seed: cfg.run.seed,
            islands,
        };
        let mut engine = Engine::joined(&job, engine_cfg)?;
        let start = start_step(&mut engine, &cfg, &facts)?;
        let end = cfg.end_step();
        checkpoint::steps_left(start, end)?;
        let tokens_per_step = (layout.world() * cfg.run.batch * cfg.model.context) as f64;
        if lead {
            print_start(&engine, &cfg, &resolved, transport_name, tokens_per_step)?;
        }
        let header = metrics_header(
            &cfg,
            (&resolved, &measured, &chosen),
            layout,
            (engine.parameter_count(), transport_name, start),
        );
        // A resumed run, or a restarted rank 0 (its island rejoined), goes
        // on with the run's file: a second header, then the steps after
        // the one it started from.
        let records = Records::open(
            &cfg,
            lead,
            &header,
            (start, end, facts.rejoin || start > 0),
            tokens_per_step,
        )?;
        let checkpointer = cfg
            .checkpoint
            .checkpoint_dir
            .clone()
            .map(|root| Checkpointer {
                root,
                every: cfg.checkpoint.save_every,
                saved_at: None,
            });
        let validator = Validator {
            batches: cfg.run.val_batches.max(1),
        };
        Ok(Trainer {
            cfg,
            facts,
            layout,
            data,
            engine,
            resolved,
            measured,
            islands_chosen: chosen,
            start,
            end,
            records,
            checkpointer,
            validator,
        })
    }

    /// The training loop, the final checkpoint, validation and the summary
    /// (on rank 0; `None` on the others).
    pub fn train(mut self) -> Result<Option<Summary>> {
        let mut skips = SkipGuard::default();
        let islands = self.engine.islands().map_or(1, |(c, _)| c.count);
        for step in self.start..self.end {
            let (stats, lr, seconds) = self.step(step)?;
            skips.check(step, &stats, &self.records)?;
            // Every rank of the island takes part: the job's bytes of the
            // step (the islands' are alike: the same collectives of the
            // same sizes), so that no step waits on another island.
            let mine = stats.traffic.total();
            let island = self
                .engine
                .sum_over_island(&[mine.intra_node as f32, mine.inter_node as f32])?;
            let job = [island[0] * islands as f32, island[1] * islands as f32];
            self.records.record(step, lr, seconds, &stats, job)?;
            if let Some(c) = self.checkpointer.as_mut() {
                c.after_step(&mut self.engine, &self.cfg, step + 1, &self.records)?;
            }
        }
        if self.end == self.cfg.run.steps {
            // The last outer step of every unit not synced at this step,
            // so that every island holds the one model the run trained.
            self.engine.outer_finish()?;
        }
        if let Some(c) = self.checkpointer.as_mut() {
            c.at_end(&mut self.engine, &self.cfg, self.end, &self.records)?;
        }
        self.records.finish()?;
        let val_loss =
            self.validator
                .loss(&mut self.engine, &self.data, &self.cfg, self.facts.rank)?;
        self.summary(val_loss)
    }

    /// Step `step` (0-based) on this rank's batch: its stats, learning
    /// rate and seconds.
    fn step(&mut self, step: usize) -> Result<(StepStats, f32, f64)> {
        let cfg = &self.cfg;
        let (x, y) = self.data.train_batch(
            self.facts.rank,
            self.layout.world(),
            step,
            cfg.run.seed,
            cfg.run.batch,
            cfg.model.context,
        )?;
        let lr = cfg.optim.lr_at(step, cfg.run.steps);
        let t = Instant::now();
        let before = self.engine.traffic();
        let mut stats = self.engine.train_step(&x, &y, lr)?;
        if self.engine.islands().is_some() {
            // The islands' exchanges that land or start after the step
            // are the step's: their time and bytes.
            self.engine.outer_after_step()?;
            stats.traffic = self.engine.traffic().since(&before);
        }
        Ok((stats, lr, t.elapsed().as_secs_f64()))
    }

    /// The end-of-run summary from every rank's totals; rank 0 prints it,
    /// draws the loss curve and writes `--summary-json`.
    fn summary(self, val_loss: f32) -> Result<Option<Summary>> {
        let (engine, r, cfg, layout) = (&self.engine, &self.records, &self.cfg, self.layout);
        let traffic = engine.traffic();
        let (all, msgs) = (traffic.total(), traffic.messages);
        let run = engine.sum_over_ranks(&[
            all.intra_node as f32,
            all.inter_node as f32,
            msgs.intra_node as f32,
            msgs.inter_node as f32,
        ])?;
        let (first, peak_rss_bytes) = ranks_peak_rss(engine)?;
        let lead = self.facts.rank == first;
        let tail: Vec<f32> = r.losses[r.losses.len().saturating_sub(10)..]
            .iter()
            .map(|&(_, l)| l)
            .collect();
        let steps_run = (self.end - self.start) as f64;
        let islands = islands_summary(engine, cfg, &traffic, &r.times)?;
        let summary = Summary {
            mode: format!("{:?}", cfg.switches.mode).to_lowercase(),
            switches: engine.switches().clone(),
            why: self.resolved.why.clone(),
            measured: self.measured.clone(),
            world_size: layout.world(),
            nodes: layout.nodes,
            params: engine.parameter_count(),
            steps: self.end,
            initial_loss: r.losses.first().map_or(f32::NAN, |&(_, l)| l),
            final_loss: tail.iter().sum::<f32>() / tail.len() as f32,
            final_steps: tail.len(),
            val_loss,
            tokens_per_s: r.tokens_per_step / median(&r.times),
            median_step_time_s: median(&r.times),
            mean_step_time_s: r.times.iter().sum::<f64>() / r.times.len().max(1) as f64,
            median_compute_s: median(&r.computes),
            bytes_per_step: BytesPerStep {
                intra_node: r.sum_intra / steps_run,
                inter_node: r.sum_inter / steps_run,
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
            islands,
            islands_chosen: self.islands_chosen.clone(),
        };
        if !lead {
            return Ok(None);
        }
        println!("{}", summary.done_line());
        write_outputs(&summary, cfg, &r.losses, layout)?;
        Ok(Some(summary))
    }
}

/// The step a rank starts from: a restarted rank of a lost island takes
/// the state of a live island's rank at its place, at their next outer
/// sync; `--resume` loads a checkpoint; else 0.
fn start_step(engine: &mut Engine, cfg: &TrainConfig, facts: &RankFacts) -> Result<usize> {
    if facts.rejoin {
        eprintln!(
            "rank {}: rejoining the running job (waiting for the islands' next outer sync)",
            facts.rank
        );
        let step = engine.rejoin()?;
        eprintln!("rank {}: rejoined after step {step}", facts.rank);
        return Ok(step);
    }
    match &cfg.checkpoint.resume {
        None => Ok(0),
        Some(path) => resume(engine, path, facts.rank == 0),
    }
}

/// Rank 0's first lines: what trains, over what, with which switches and
/// islands.
fn print_start(
    engine: &Engine,
    cfg: &TrainConfig,
    resolved: &Resolved,
    transport_name: &str,
    tokens_per_step: f64,
) -> Result<()> {
    let layout = engine.job_layout();
    println!(
        "training {} parameters, {} over {}, mode {}, {} steps of {} tokens",
        engine.parameter_count(),
        crate::comm::shape(layout.nodes, layout.ranks_per_node),
        transport_name.to_uppercase(),
        cfg.switches.mode,
        cfg.run.steps,
        tokens_per_step
    );
    println!("switches: {}", serde_json::to_string(&resolved.switches)?);
    if cfg.optim.warmup_steps > cfg.run.steps {
        println!(
            "note: --warmup-steps {} is more than --steps {}: the learning rate never reaches its \
             peak (--lr {}); lower --warmup-steps for a short run",
            cfg.optim.warmup_steps, cfg.run.steps, cfg.optim.lr
        );
    }
    if let Some((c, _)) = engine.islands() {
        let every = if c.auto && engine.island_schedule().is_some_and(|s| s.2.is_none()) {
            format!("{} steps, then the H measured there (auto)", c.sync_every)
        } else {
            format!("{} steps", c.sync_every)
        };
        println!(
            "islands: {} of {}, each sharding over its own; outer sync every {every} ({}, \
             Nesterov lr {} momentum {})",
            c.count,
            crate::comm::count(engine.plan().layout.world(), "rank"),
            if c.quantized.is_some() {
                "int4 with error feedback"
            } else {
                "f32"
            },
            c.outer.lr,
            c.outer.momentum
        );
    }
    Ok(())
}

/// The first rank of the job (with islands, of those still taking part)
/// and every rank's peak RSS (a collective).
fn ranks_peak_rss(engine: &Engine) -> Result<(usize, Vec<u64>)> {
    let (ranks, peaks) = engine.all_gather_bytes(Bytes::copy_from_slice(
        &peak_rss_bytes().unwrap_or(0).to_le_bytes(),
    ))?;
    let peaks = peaks
        .iter()
        .map(|b| {
            let a: [u8; 8] = b[..].try_into().map_err(|_| {
                anyhow::anyhow!("a rank's peak memory arrived as {} bytes, not 8", b.len())
            })?;
            Ok(u64::from_le_bytes(a))
        })
        .collect::<Result<Vec<u64>>>()?;
    Ok((ranks[0], peaks))
}

/// The islands' part of the summary (a collective: the outer bytes summed
/// over the ranks); none without islands. `traffic`: the run's, `times`:
/// its step times.
fn islands_summary(
    engine: &Engine,
    cfg: &TrainConfig,
    traffic: &Traffic,
    times: &[f64],
) -> Result<Option<IslandsSummary>> {
    let Some((c, _)) = engine.islands() else {
        return Ok(None);
    };
    let (outer, all) = (traffic.outer.total, traffic.total());
    let job = engine.sum_over_ranks(&[outer.inter_node as f32, all.inter_node as f32])?;
    let (exchanges, waited_s, _) = engine.outer_exchanges();
    let fragments = c.fragments_of(engine.unit_layouts().len());
    // One whole model's exchange, against the inner step (the median:
    // steps without a sync).
    let whole_s = engine.whole_exchange_s();
    let inner_s = median(times);
    let hides = zeropp_zero::cost::hiding_sync_every(whole_s, inner_s);
    Ok(Some(IslandsSummary {
        sync_every_chosen: engine.island_schedule().and_then(|(h, origin, why)| {
            why.map(|why| ChosenSyncEvery {
                sync_every: h,
                from_step: origin,
                why,
            })
        }),
        count: c.count,
        ranks_per_island: engine.plan().layout.world(),
        sync_every: c.sync_every,
        fragments,
        delay: c.delay,
        exchanges,
        waited_s,
        exchange_s: whole_s,
        hiding_sync_every: hides,
        why: format!(
            "an exchange of the whole model took {whole_s:.3} s on rank 0 and an inner step \
             {inner_s:.3} s: H >= {hides} hides the exchange behind the inner steps (this run: \
             H = {}, {}, landing {} steps later)",
            c.sync_every,
            crate::comm::count(fragments, "fragment"),
            c.delay
        ),
        outer_bits: cfg.islands.outer_bits,
        outer_bytes: job[0] as f64,
        inner_inter_node_bytes: (job[1] - job[0]) as f64,
        lost: engine
            .lost_islands()
            .into_iter()
            .map(|l| LostIslandSummary {
                island: l.island,
                after_step: l.step,
                why: l.why,
            })
            .collect(),
        rejoined: engine
            .rejoined_islands()
            .into_iter()
            .map(|(island, after_step)| RejoinedIsland { island, after_step })
            .collect(),
    }))
}

/// Checks before training that every output file can be written where
/// asked (its directory made if missing, the plot named `.png`), and that a
/// run starting afresh (not a resume, nor a restarted island rejoining:
/// `rejoin`) has a checkpoint directory of its own: a bad path is said at
/// once, not after the run.
pub(crate) fn prepare_outputs(cfg: &TrainConfig, rejoin: bool) -> Result<()> {
    let ck = &cfg.checkpoint;
    if let (Some(dir), None, false) = (&ck.checkpoint_dir, &ck.resume, rejoin) {
        crate::train::checkpoint::check_fresh_dir(dir)?;
    }
    let o = &cfg.output;
    if let Some(p) = &o.plot {
        let png = p.extension().is_some_and(|e| e.eq_ignore_ascii_case("png"));
        if !png {
            bail!(
                "--plot {}: the plot is drawn as PNG: name it *.png",
                p.display()
            );
        }
    }
    let files = [
        ("--metrics", &o.metrics),
        ("--summary-json", &o.summary_json),
        ("--plot", &o.plot),
    ];
    for (flag, path) in files {
        let Some(p) = path else { continue };
        if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| {
                format!("{flag} {}: cannot make {}", p.display(), dir.display())
            })?;
        }
        let existed = p.exists();
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(p)
            .with_context(|| format!("{flag} {}: cannot write there", p.display()))?;
        if !existed {
            let _ = std::fs::remove_file(p);
        }
    }
    Ok(())
}

/// The summary's JSON and the loss plot, where asked for (the summary
/// first: a plot that fails loses nothing else).
fn write_outputs(
    summary: &Summary,
    cfg: &TrainConfig,
    losses: &[(usize, f32)],
    layout: Layout,
) -> Result<()> {
    if let Some(p) = &cfg.output.summary_json {
        std::fs::write(p, serde_json::to_vec_pretty(summary)?)
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    if let Some(p) = &cfg.output.plot {
        let series = Series {
            name: format!("{} (validation {:.3})", summary.mode, summary.val_loss),
            points: step_points(losses),
        };
        let title = format!(
            "training loss, {}",
            crate::comm::shape(layout.nodes, layout.ranks_per_node)
        );
        plot::loss_curves(p, &title, &[series])?;
    }
    Ok(())
}

/// The islands the run trains in: the run's `--islands N`, else the
/// launcher's (a count other than the launcher's, or `--islands auto`,
/// under a launcher that cut the job is refused: the two would disagree).
fn islands_of(asked: &TrainConfig, facts: &RankFacts) -> Result<usize> {
    match asked.islands.islands.number() {
        Some(n) if facts.islands > 1 && n != facts.islands => bail!(
            "the launcher cuts the job into {} islands (ZEROPP_ISLANDS / zeropp launch \
             --islands), its failure domains, and the run asks for {n}{}: give the run \
             --islands {}, or launch without --islands",
            facts.islands,
            if n == 1 {
                " (one synchronous job: the default)"
            } else {
                ""
            },
            facts.islands
        ),
        Some(n) => Ok(n.max(1)),
        None if facts.islands > 1 => bail!(
            "the launcher cuts the job into {} islands (ZEROPP_ISLANDS / zeropp launch \
             --islands) and the run asks for --islands auto: give the run the launcher's \
             count, or launch without --islands",
            facts.islands
        ),
        None => Ok(facts.islands),
    }
}

/// The metrics file's first line, what ran: the same resolved switches as
/// the summary and the manifest, and where each chosen value came from.
fn metrics_header(
    cfg: &TrainConfig,
    (resolved, measured, chosen): (&Resolved, &Option<Measured>, &Option<IslandsChosen>),
    layout: Layout,
    (params, transport, start): (usize, &str, usize),
) -> serde_json::Value {
    serde_json::json!({ "header": {
        "mode": format!("{:?}", cfg.switches.mode).to_lowercase(),
        "switches": &resolved.switches,
        "why": &resolved.why,
        "measured": measured,
        "world_size": layout.world(),
        "nodes": layout.nodes,
        "ranks_per_node": layout.ranks_per_node,
        "islands": cfg.islands.islands,
        "islands_chosen": chosen,
        "sync_every": cfg.islands.sync_every,
        "params": params,
        "transport": transport,
        "seed": cfg.run.seed,
        "steps": cfg.run.steps,
        "start_step": start,
    }})
}

/// This rank's place in the job: nodes of the launcher's
/// `LOCAL_WORLD_SIZE` ranks, numbered node by node.
fn rank_layout(facts: &RankFacts) -> Result<Layout> {
    if facts.node_rank * facts.local_world_size + facts.local_rank != facts.rank {
        bail!(
            "rank {} is local rank {} of node {}: zeropp needs ranks numbered node by node \
             (rank = node x ranks-per-node + local rank); use block distribution in your launcher",
            facts.rank,
            facts.local_rank,
            facts.node_rank
        );
    }
    Ok(Layout {
        nodes: facts.nodes(),
        ranks_per_node: facts.local_world_size,
        rank: facts.rank,
    })
}

/// A joined job with its switches chosen.
struct Connected {
    /// The joined job (its counted transport: the probe's traffic
    /// included).
    job: crate::zero::job::Joined,
    resolved: Resolved,
    /// The islands the run trains as: the asked count, or `auto`'s choice.
    islands: usize,
    chosen: Option<crate::train::auto_islands::IslandsChosen>,
}

/// Joins the job through zeropp's rendezvous, then builds it as
/// zeropp.torch's bindings do (`zero::job`: each rank publishing what its
/// machine is made of, the routing plan from the nodes' facts, the links
/// measured where the nodes are hosts and the mode is zeropp), chooses the
/// islands where the run asks for `auto`, and resolves the switches; rank 0
/// prints the plan and the choices.
/// With islands the switches are resolved for an island's layout (each
/// shards over its own ranks); the links are measured over the job.
fn connect(cfg: &TrainConfig, facts: &RankFacts, layout: Layout) -> Result<Connected> {
    let asked_islands = cfg.islands.islands.number();
    let island_of = |n: usize| {
        layout
            .island(n)
            .map(|(_, l)| l)
            .map_err(|e| anyhow::anyhow!("--islands: {e}"))
    };
    // `auto` measures the whole job's links before it chooses.
    let island = island_of(asked_islands.unwrap_or(1))?;
    let published = crate::zero::job::facts_to_publish();
    let (transport, table) = match cfg.launch.transport {
        Some(kind) => {
            let (kind, _) = TransportKind::choose(Some(kind), facts.islands_restart())?;
            Job::connect_over(kind, facts, published)?
        }
        None => Job::connect(facts, published)?,
    };
    let peers: Vec<crate::comm::exchange::Peer> = table.into_iter().map(peer_of).collect();
    // Every rank derives the same plan from the same published facts; the
    // engine takes its hpZ group from it unless --hpz-group says otherwise.
    let job =
        crate::zero::job::Joined::new(transport, &peers, layout, facts.timeout, facts.rejoin)?;
    let (routing, counter) = (&job.routing, job.counter.clone());
    let (wanted, asked) = cfg.wanted_switches();
    let timed = crate::zero::plan::as_they_would_run(wanted.clone(), &asked, island);
    // The job's rule: measured for zeroPP's switches where the nodes are
    // hosts, not by a rejoining rank (the others train), nor for islands
    // of one node (`Joined::measures`).
    let zeropp = (
        cfg.switches.mode == Mode::Zeropp,
        asked_islands.unwrap_or(1),
    );
    let largest = cfg.model.units().iter().map(|u| u.numel(&cfg.model)).max();
    let measured = job
        .measured(zeropp, &timed, largest)
        .map_err(|e| anyhow::anyhow!("measuring the links at join: {e}"))?;
    let plan_islands = |probe_seams: bool| {
        let comm = job.communicator();
        let world =
            crate::comm::Group::new(crate::comm::GroupKind::World, (0..layout.world()).collect())?;
        let (measured, timed) = (measured.as_ref(), &timed);
        counter.pinned(crate::zero::traffic::Phase::Other, || {
            let choose = crate::train::auto_islands::choose;
            choose(cfg, &comm, &world, layout, measured, timed, probe_seams)
        })
    };
    let proposes = measured.is_some() && layout.nodes > 1;
    let (islands, chosen, proposed) = decide_islands(asked_islands, proposes, plan_islands)?;
    let mut resolved = resolve_switches(cfg, (layout, islands), routing, measured.as_ref())?;
    if let Some(p) = proposed {
        resolved.why.insert("islands".into(), proposal(&p));
    }
    if facts.rank == 0 {
        print_plan(routing, &resolved, measured.is_some());
        if let Some(c) = &chosen {
            println!("islands (auto): {}", c.why);
        }
        if let Some(why) = resolved.why.get("islands") {
            println!("islands: {why}");
        }
    }
    Ok(Connected {
        job,
        resolved,
        islands,
        chosen,
    })
}

/// A rank of the rendezvous' table as the job's peers name it.
fn peer_of(p: crate::comm::rendezvous::PeerInfo) -> crate::comm::exchange::Peer {
    crate::comm::exchange::Peer {
        rank: p.rank,
        hostname: p.host,
        host_id: p.host_id,
        facts: p.facts,
    }
}

/// Why the run has one island, the plan proposing more.
fn proposal(p: &IslandsChosen) -> String {
    format!(
        "1 (asked); the plan proposes {}: {} — --islands auto (or --islands {}) trains so, with \
         H steps of staleness between the islands (docs/TRAINING.md, \"Islands\")",
        p.islands, p.why, p.islands
    )
}

/// The run's switches resolved for an island of `layout` split in
/// `islands` (each shards over its own ranks; islands of one node keep
/// their collectives plain), from the routing plan and the links
/// `measured` at join (none for islands of one node).
pub(crate) fn resolve_switches(
    cfg: &TrainConfig,
    (layout, islands): (Layout, usize),
    routing: &Result<crate::zero::routing::ClusterView, crate::zero::routing::RoutingError>,
    measured: Option<&Measured>,
) -> Result<Resolved> {
    let island = layout
        .island(islands)
        .map(|(_, l)| l)
        .map_err(|e| anyhow::anyhow!("--islands: {e}"))?;
    let (mut wanted, asked) = cfg.wanted_switches();
    let mut inside = std::collections::BTreeMap::new();
    let one_node = layout.islands_of_one_node(islands);
    if one_node {
        crate::zero::plan::inside_one_node(&mut wanted, &asked, &mut inside);
    }
    let measured = measured.filter(|_| !one_node);
    let mut resolved = crate::zero::plan::resolve(wanted, &asked, island, routing, measured)
        .map_err(|e| anyhow::anyhow!("invalid switches: {e}"))?;
    resolved.why.extend(inside);
    Ok(resolved)
}

/// How many islands the run trains as: `asked` (None: `auto`, the plan's
/// choice, `plan(true)` probing the seams), and the `auto` choice and a
/// proposal where one job was asked on measured links across nodes
/// (`proposes`; from the link measured at join, no more probing) — only a
/// proposal: where the plan cannot make one, the run goes on as asked.
fn decide_islands(
    asked: Option<usize>,
    proposes: bool,
    plan: impl Fn(bool) -> Result<IslandsChosen>,
) -> Result<(usize, Option<IslandsChosen>, Option<IslandsChosen>)> {
    Ok(match asked {
        Some(1) if proposes => {
            let proposed = match plan(false) {
                Ok(c) => Some(c).filter(|c| c.islands > 1),
                Err(e) => {
                    tracing::debug!("no islands proposal: {e}");
                    None
                }
            };
            (1, None, proposed)
        }
        Some(n) => (n, None, None),
        None => {
            let c = plan(true)?;
            (c.islands, Some(c), None)
        }
    })
}

/// What rank 0 prints about the plan before training: the routing report
/// and the switches the plan chose, with the reasons.
fn print_plan(
    routing: &Result<zeropp_zero::routing::ClusterView, zeropp_zero::routing::RoutingError>,
    resolved: &Resolved,
    measured: bool,
) {
    let switches = &resolved.switches;
    println!("{}", routing_report(routing));
    if let (true, Some(h)) = (switches.hpz, switches.hpz_group) {
        println!(
            "engine: hpZ secondary shards over groups of {} ({})",
            crate::comm::count(h, "rank"),
            resolved.why["hpz_group"]
        );
    }
    if switches.qgz {
        let inside = match switches.qgz_intra_bits {
            16 => "bf16".to_string(),
            b => format!("int{b}"),
        };
        println!(
            "engine: qgZ {inside} inside the node, int4 across ({})",
            resolved.why["qgz_intra_bits"]
        );
    }
    if measured {
        for name in ["qwz_bits", "qgz", "hpz"] {
            if let Some(why) = resolved.why.get(name).filter(|w| *w != "asked") {
                println!("engine: {name} {why}");
            }
        }
    }
}

/// Loads the checkpoint at `path` (or the latest under it) into `engine`,
/// re-cut for this layout: the step it was saved at.
fn resume(engine: &mut Engine, path: &Path, lead: bool) -> Result<usize> {
    let dir = checkpoint::resolve(path)?;
    let m = checkpoint::read_manifest(&dir)?;
    let (layout, place) = (engine.job_layout(), engine.plan().layout.rank);
    let islands = engine.islands().map_or(1, |(c, _)| c.count);
    let state = checkpoint::state_for(&dir, &m, &engine.unit_layouts(), layout, islands, place)?;
    engine.load_shard_state(state, m.step)?;
    // An automatic H chosen before the save goes on as it was.
    if let (Some(s), Some(_)) = (m.islands_schedule, engine.islands()) {
        engine.set_island_schedule(s.sync_every, s.origin)?;
    }
    if lead {
        println!(
            "resumed from {} at step {} (saved on {}, running on {})",
            dir.display(),
            m.step,
            crate::comm::count(m.world_size, "rank"),
            layout.world()
        );
    }
    Ok(m.step)
}

/// What the run records as it goes: every rank's totals for the summary,
/// and on rank 0 the `--metrics` file and the progress (a bar where its
/// stderr is a terminal, progress lines otherwise).
struct Records {
    lead: bool,
    file: Option<std::io::BufWriter<std::fs::File>>,
    bar: ProgressBar,
    tokens_per_step: f64,
    steps: usize,
    start: usize,
    end: usize,
    log_every: usize,
    /// `(step, loss)` of the finite steps.
    losses: Vec<(usize, f32)>,
    /// Each step's seconds, and the compute thread's own part of them.
    times: Vec<f64>,
    computes: Vec<f64>,
    /// The job's bytes over the steps, inside and across nodes.
    sum_intra: f64,
    sum_inter: f64,
}

impl Records {
    fn open(
        cfg: &TrainConfig,
        lead: bool,
        header: &serde_json::Value,
        (start, end, append): (usize, usize, bool),
        tokens_per_step: f64,
    ) -> Result<Records> {
        let mut file = match (&cfg.output.metrics, lead) {
            (Some(p), true) => {
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .append(append)
                    .truncate(!append)
                    .open(p)
                    .with_context(|| format!("cannot create {}", p.display()))?;
                if append {
                    // The killed rank's half-written last line goes.
                    let text =
                        std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?;
                    let whole = text.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
                    f.set_len(whole as u64)?;
                }
                Some(std::io::BufWriter::new(f))
            }
            _ => None,
        };
        if let Some(m) = file.as_mut() {
            writeln!(m, "{header}")?;
        }
        // `zeropp train` hands rank 0 the terminal when it launches itself.
        let bar = if lead {
            ProgressBar::with_draw_target(Some(cfg.run.steps as u64), ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30} step {pos}/{len} {msg} [{elapsed_precise}<{eta}]",
            )
            .expect("a valid template"),
        );
        bar.set_position(start as u64);
        Ok(Records {
            lead,
            file,
            bar,
            tokens_per_step,
            steps: cfg.run.steps,
            start,
            end,
            log_every: cfg.run.log_every.max(1),
            losses: Vec::new(),
            times: Vec::new(),
            computes: Vec::new(),
            sum_intra: 0.0,
            sum_inter: 0.0,
        })
    }

    /// A line from rank 0: above the progress bar when it draws, on stdout
    /// otherwise.
    fn say(&self, line: String) {
        if !self.lead {
            return;
        }
        if self.bar.is_hidden() {
            println!("{line}");
        } else {
            self.bar.println(line);
        }
    }

    /// Step `step` (0-based) took `seconds` at `lr`; the job sent `job`
    /// bytes (inside, across nodes).
    fn record(
        &mut self,
        step: usize,
        lr: f32,
        seconds: f64,
        stats: &StepStats,
        job: [f32; 2],
    ) -> Result<()> {
        self.sum_intra += job[0] as f64;
        self.sum_inter += job[1] as f64;
        if stats.loss.is_finite() {
            self.losses.push((step + 1, stats.loss));
        }
        self.times.push(seconds);
        let compute = (seconds - stats.waited_s).max(0.0);
        self.computes.push(compute);
        if !self.lead {
            return Ok(());
        }
        let tokens_per_s = self.tokens_per_step / seconds;
        if let Some(m) = self.file.as_mut() {
            let line = StepMetrics {
                step: step + 1,
                loss: stats.loss,
                grad_norm: stats.grad_norm,
                lr,
                step_time_s: seconds,
                compute_s: compute,
                tokens_per_s,
                bytes_intra_node: job[0] as f64,
                bytes_inter_node: job[1] as f64,
                rank0_traffic: &stats.traffic,
            };
            serde_json::to_writer(&mut *m, &line)?;
            m.write_all(b"\n")?;
        }
        self.bar.set_message(format!(
            "loss {:.4} | {:.0} tok/s | {:.3} MB across nodes/step",
            stats.loss,
            tokens_per_s,
            job[1] as f64 / 1e6
        ));
        self.bar.inc(1);
        let due =
            (step + 1).is_multiple_of(self.log_every) || step == self.start || step + 1 == self.end;
        if due && self.bar.is_hidden() {
            println!(
                "step {:>5}/{} loss {:.4} lr {:.2e} {:>8.0} tok/s {:>8.3} MB across nodes/step \
                 peak RSS {:.0} MB",
                step + 1,
                self.steps,
                stats.loss,
                lr,
                tokens_per_s,
                job[1] as f64 / 1e6,
                peak_rss_bytes().unwrap_or(0) as f64 / 1e6
            );
        }
        Ok(())
    }

    /// The loop is over: the bar goes, the metrics file is flushed.
    fn finish(&mut self) -> Result<()> {
        self.bar.finish_and_clear();
        if let Some(m) = self.file.as_mut() {
            m.flush()?;
        }
        Ok(())
    }
}

/// Skipped non-finite steps in a row (`skip_nonfinite`): reported, and
/// fatal after [`MAX_CONSECUTIVE_SKIPS`].
#[derive(Default)]
struct SkipGuard {
    in_a_row: usize,
}

impl SkipGuard {
    fn check(&mut self, step: usize, stats: &StepStats, records: &Records) -> Result<()> {
        self.in_a_row = if stats.skipped.is_some() {
            self.in_a_row + 1
        } else {
            0
        };
        if self.in_a_row >= MAX_CONSECUTIVE_SKIPS {
            bail!(
                "steps {} to {} were all non-finite and skipped: the model itself has diverged; \
                 resume from an earlier checkpoint with a lower learning rate",
                step + 2 - self.in_a_row,
                step + 1
            );
        }
        if let Some(units) = &stats.skipped {
            records.say(format!(
                "step {} skipped: non-finite loss ({}) or gradient in units {units:?}",
                step + 1,
                stats.loss
            ));
        }
        Ok(())
    }
}

/// Sharded checkpoints under `root`: every `every` steps (0: none on the
/// way) and at the end, unless the last step was just saved.
struct Checkpointer {
    root: PathBuf,
    every: usize,
    saved_at: Option<usize>,
}

impl Checkpointer {
    fn after_step(
        &mut self,
        engine: &mut Engine,
        cfg: &TrainConfig,
        step: usize,
        records: &Records,
    ) -> Result<()> {
        if self.every > 0 && step.is_multiple_of(self.every) {
            self.save(engine, cfg, step, records)?;
        }
        Ok(())
    }

    fn at_end(
        &mut self,
        engine: &mut Engine,
        cfg: &TrainConfig,
        end: usize,
        records: &Records,
    ) -> Result<()> {
        if self.saved_at != Some(end) {
            self.save(engine, cfg, end, records)?;
        }
        Ok(())
    }

    fn save(
        &mut self,
        engine: &mut Engine,
        cfg: &TrainConfig,
        step: usize,
        records: &Records,
    ) -> Result<()> {
        let t = Instant::now();
        let rank = engine.job_layout().rank;
        // Exchanges under way finish (not applied: they land at their
        // step) so that the checkpoint holds them.
        engine.settle_outer()?;
        let dir = checkpoint::save(engine, cfg, &self.root, step, rank, cfg.checkpoint.keep)?;
        records.say(format!(
            "saved checkpoint {} ({:.2} s)",
            dir.display(),
            t.elapsed().as_secs_f64()
        ));
        self.saved_at = Some(step);
        Ok(())
    }
}

/// The validation loss at the end: the mean over `batches` held-out
/// batches per rank.
struct Validator {
    batches: usize,
}

impl Validator {
    fn loss(
        &self,
        engine: &mut Engine,
        data: &Dataset,
        cfg: &TrainConfig,
        rank: usize,
    ) -> Result<f32> {
        let mut val = 0.0;
        for i in 0..self.batches {
            let (x, y) = data.val_batch(rank, i, cfg.run.batch, cfg.model.context)?;
            val += engine.evaluate(&x, &y)?;
        }
        let val = val / self.batches as f32;
        if engine.islands().is_none() {
            return Ok(val);
        }
        // Each island's mean, averaged over the ranks of the islands
        // still taking part.
        let sum = engine.sum_over_ranks(&[val, 1.0])?;
        Ok(sum[0] / sum[1])
    }
}

/// What rank 0 prints about the cluster: the nodes, how they differ, and
/// the routing plan.
fn routing_report(
    routing: &Result<zeropp_zero::routing::ClusterView, zeropp_zero::routing::RoutingError>,
) -> String {
    match routing {
        Ok(view) => {
            let mut s = format!(
                "topology: {} on {}",
                crate::comm::count(view.hosts.len(), "node"),
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
