//! Engine tests on in-process worlds (ranks are threads) with a model of
//! their own (`testing::TiedMlp`): any model with a tie trains sharded as
//! on one rank, a layout that does not fit the transport is refused, and a
//! NaN gradient stops or skips a step on every rank. The tests over the
//! built-in GPT (every switch, hpZ, the mean over W, the byte counters) are
//! in the application crate (`src/train/engine_tests.rs`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use super::testing::{TiedMlp, batch, reference_grad_norm, run_model};
use super::*;
use zeropp_comm::inproc::InProcess;
use zeropp_comm::{CommError, GroupKind};
use zeropp_zero::layout::Layout;
use zeropp_zero::outer::OuterSettings;
use zeropp_zero::plan::Switches;

fn mlp() -> TiedMlp {
    TiedMlp {
        vocab: 256,
        width: 24,
    }
}

#[test]
fn the_engine_shards_any_model_with_a_tie() {
    // A model other than the GPT, tied: sharded over 2 x 2 with fp32 on
    // the wire it must take the steps one rank takes on the whole batch,
    // and its first gradient norm is candle's own on the unsharded model
    // (both uses of the tied table counted).
    let model = Arc::new(mlp());
    let fp32 = Switches {
        fp32_comm: true,
        ..Switches::zero3(32)
    };
    let one = run_model(model.clone(), 1, 1, fp32.clone(), 20, 8);
    let four = run_model(model.clone(), 2, 2, fp32, 20, 2);
    for (a, b) in one[0].losses.iter().zip(&four[0].losses) {
        assert!(
            ((a - b) / a).abs() <= 1e-5,
            "{:?} vs {:?}",
            one[0].losses,
            four[0].losses
        );
    }
    let (x, y) = batch(0, 8, 16);
    let want = reference_grad_norm(&*model, 3, &x, &y);
    let got = four[0].norms[0];
    assert!(
        ((got - want) / want).abs() < 1e-4,
        "engine {got} vs reference {want}"
    );
    let l = &four[0].losses;
    assert!(l[19] < l[0] - 0.3, "losses {l:?}");
    // Under ZeRO++ it trains too.
    let zpp = run_model(model, 2, 2, Switches::zeropp(32), 20, 2);
    let l = &zpp[0].losses;
    assert!(l[19] < l[0] - 0.3, "losses {l:?}");
}

#[test]
fn a_layout_that_does_not_match_the_transport_is_an_error() {
    let t = InProcess::world(2).into_iter().next().unwrap();
    let cfg = EngineConfig {
        model: Arc::new(mlp()),
        switches: Switches::zero3(32),
        optim: OptimConfig::default(),
        seed: 0,
        islands: None,
    };
    let layout = Layout {
        nodes: 2,
        ranks_per_node: 2,
        rank: 0,
    };
    let err = Engine::new(Box::new(t), layout, cfg, Duration::from_secs(1))
        .err()
        .unwrap();
    assert!(
        matches!(
            err,
            EngineError::Layout {
                transport_world: 2,
                world: 4,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("rank 0 of 2"), "{err}");
}

/// Runs 5 steps of zeropp on 2 x 2 in-process ranks with a NaN put into
/// rank 2's gradient chunk of unit 1 on step 3; returns each rank's
/// per-step results and its master weights before and after step 3.
#[allow(clippy::type_complexity)]
fn run_with_nan(skip: bool) -> Vec<(Vec<Result<StepStats, String>>, Vec<f32>, Vec<f32>)> {
    let handles: Vec<_> = InProcess::world(4)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            std::thread::spawn(move || {
                let cfg = EngineConfig {
                    model: Arc::new(mlp()),
                    switches: Switches::zeropp(32),
                    optim: OptimConfig {
                        warmup_steps: 1,
                        skip_nonfinite: skip,
                        ..OptimConfig::default()
                    },
                    seed: 3,
                    islands: None,
                };
                let layout = Layout {
                    nodes: 2,
                    ranks_per_node: 2,
                    rank,
                };
                let mut e = Engine::new(Box::new(t), layout, cfg, Duration::from_secs(30)).unwrap();
                e.inject_nan = Some((3, 1, 2));
                let master = |e: &Engine| e.shard_state().unwrap()[1].master.clone();
                let (mut results, mut before, mut after) = (vec![], vec![], vec![]);
                for s in 0..5 {
                    let (x, y) = batch(s as u64, 8, 16);
                    let (x, y) = (
                        x.narrow(0, rank * 2, 2).unwrap(),
                        y.narrow(0, rank * 2, 2).unwrap(),
                    );
                    if s == 2 {
                        before = master(&e);
                    }
                    let r = e.train_step(&x, &y, 3e-3).map_err(|e| format!("{e:#}"));
                    let failed = r.is_err();
                    results.push(r);
                    if s == 2 {
                        after = master(&e);
                    }
                    if failed {
                        break;
                    }
                }
                (results, before, after)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn a_nan_gradient_stops_every_rank_naming_the_step_and_unit() {
    for (results, ..) in run_with_nan(false) {
        assert_eq!(results.len(), 3);
        assert!(results[..2].iter().all(Result::is_ok));
        let err = results[2].as_ref().unwrap_err();
        assert!(err.contains("step 3") && err.contains("layer"), "{err}");
    }
}

#[test]
fn a_nan_gradient_step_can_be_skipped_without_touching_the_weights() {
    for (results, before, after) in run_with_nan(true) {
        assert_eq!(results.len(), 5);
        let stats: Vec<&StepStats> = results.iter().map(|r| r.as_ref().unwrap()).collect();
        assert_eq!(stats[2].skipped, Some(vec!["layer".to_string()]));
        assert_eq!(before, after, "a skipped step changed the weights");
        for s in [&stats[3], &stats[4]] {
            assert!(s.skipped.is_none() && s.loss.is_finite() && s.grad_norm.is_finite());
        }
        assert!(stats[4].loss < stats[0].loss);
    }
}

/// `f` on each rank's engine of a 2 x 2 in-process job of the tied MLP
/// under `switches` (seed 3), in rank order.
fn on_four_engines<R: Send + 'static>(
    switches: &Switches,
    nodes: usize,
    f: impl Fn(&mut Engine, usize) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = Arc::new(f);
    let handles: Vec<_> = InProcess::world(4)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let (switches, f) = (switches.clone(), f.clone());
            std::thread::spawn(move || {
                let cfg = EngineConfig {
                    model: Arc::new(mlp()),
                    switches,
                    optim: OptimConfig::default(),
                    seed: 3,
                    islands: None,
                };
                let layout = Layout {
                    nodes,
                    ranks_per_node: 4 / nodes,
                    rank,
                };
                let t = Box::new(t);
                let mut e = Engine::new(t, layout, cfg, Duration::from_secs(30)).unwrap();
                f(&mut e, rank)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// One rank's outputs of every collective the engine runs on unit `u`
/// (two forward gathers, two gradient reduce-scatters), first through the
/// engine, then through `zero::fsdp` — FSDP2's calls, which the host
/// bindings and the device job run — on the same inputs and groups.
fn both_ways(e: &mut Engine, u: usize, rank: usize) -> [Vec<Vec<u32>>; 2] {
    use half::bf16;
    use zeropp_zero::fsdp::{self, GradWire};
    use zeropp_zero::host::HostKernels;
    use zeropp_zero::{Hop, qgz::Feedback};

    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    let (padded, layout, plan) = (e.units[u].padded, e.plan.layout, e.plan.clone());
    let grad: Vec<f32> = (0..padded)
        .map(|i| ((i * 7 + rank * 3) as f32 * 0.37).sin() * 0.01)
        .collect();
    let mut engine = Vec::new();
    for _ in 0..2 {
        let p = e.start_primary_gather(u, Phase::ForwardGather).unwrap();
        engine.push(bits(&p.wait().unwrap().full));
    }
    for _ in 0..2 {
        let p = e.start_gradient(u, grad.clone()).unwrap();
        engine.push(bits(&e.finish_gradient(u, p).unwrap()));
    }
    let (master, counter, groups) = (
        e.units[u].master.clone(),
        e.counter.clone(),
        e.groups.clone(),
    );
    let fsdp = e
        .thread
        .submit(
            move |c: &Communicator| -> Result<Vec<Vec<u32>>, ZeroError> {
                let m = HostMover {
                    comm: c,
                    counter: &counter,
                    groups,
                };
                let (world, mut outs) = (layout.world(), Vec::new());
                let phase = Phase::ForwardGather;
                let mut reference = None;
                for _ in 0..2 {
                    let mut full = vec![0f32; master.len() * world];
                    let how = plan.weights;
                    let r = matches!(how, WeightWire::Delta(_))
                        .then(|| zeropp_zero::delta::Slot::new(&mut reference));
                    if plan.weights == WeightWire::Bf16 {
                        // FSDP2 gathers the bf16 parameters.
                        let mut shard = vec![bf16::ZERO; master.len()];
                        Host.narrow(&master, &mut shard)?;
                        let mut all = vec![bf16::ZERO; full.len()];
                        let (x, mut o) = (&shard[..], &mut all[..]);
                        fsdp::all_gather(&Host, &m, layout, Hop::World, how, phase, r, &x, &mut o)?;
                        Host.widen(&all, &mut full)?;
                    } else {
                        let (x, mut o) = (&master[..], &mut full[..]);
                        fsdp::all_gather(&Host, &m, layout, Hop::World, how, phase, r, &x, &mut o)?;
                    }
                    outs.push(bits(&full));
                }
                let (mut r1, mut r2) = (Residual::none(), Residual::none());
                for _ in 0..2 {
                    let mut out = vec![0f32; grad.len() / world];
                    let (x, mut o) = (&grad[..], &mut out[..]);
                    let (wire, nearest) = (plan.grads, zeropp_quant::Rounding::NearestEven);
                    if let GradWire::TwoHop { stochastic, .. } = wire {
                        assert!(!stochastic, "round to nearest, as both sides do");
                    }
                    let fb = Feedback::kept(
                        wire.keeps(layout.ranks_per_node),
                        r1.chunks_mut(),
                        r2.chunks_mut(),
                    );
                    if wire == GradWire::RingBf16 {
                        // FSDP2's bf16 sum, divided by W in f32 (as the
                        // engine averages).
                        let mut g16 = vec![bf16::ZERO; grad.len()];
                        Host.narrow(&grad, &mut g16)?;
                        let mut sum = vec![bf16::ZERO; out.len()];
                        let (x, mut o) = (&g16[..], &mut sum[..]);
                        let sum_ = Reduction::Sum;
                        fsdp::reduce_scatter(
                            &Host,
                            &m,
                            layout,
                            wire,
                            (nearest, fb),
                            sum_,
                            &x,
                            &mut o,
                        )?;
                        Host.widen(&sum, &mut out)?;
                        HostKernels::divide(&Host, &mut out, world as f32)?;
                    } else {
                        let mean = Reduction::Mean;
                        fsdp::reduce_scatter(
                            &Host,
                            &m,
                            layout,
                            wire,
                            (nearest, fb),
                            mean,
                            &x,
                            &mut o,
                        )?;
                    }
                    outs.push(bits(&out));
                }
                Ok(outs)
            },
        )
        .wait()
        .unwrap();
    [engine, fsdp]
}

#[test]
fn the_engine_and_fsdp2s_calls_agree_per_collective() {
    // Every wire the engine runs: bf16 and fp32 rings (ZeRO-3), qwZ int8
    // with int8 qgZ, weight differences with int4 qgZ and both
    // error-feedback hops, and with qgZ's hop inside in bf16; each call twice (references and residuals carry
    // over). Bit for bit, on 2 x 2 ranks; and on nodes of one rank (4 x
    // 1), where qgZ has no hop inside the node to quantize.
    let cases = [
        (2, Switches::zero3(32)),
        (
            2,
            Switches {
                fp32_comm: true,
                ..Switches::zero3(32)
            },
        ),
        (
            2,
            Switches {
                qwz_bits: Some(8),
                qwz_delta: false,
                qwz_int8_references: false,
                hpz: false,
                qgz_intra_bits: 8,
                ..Switches::zeropp(32)
            },
        ),
        (
            2,
            Switches {
                hpz: false,
                ..Switches::zeropp(32)
            },
        ),
        // The gradient in bf16 inside the node (qgZ's first hop not
        // quantized, the hop across with its feedback).
        (
            2,
            Switches {
                hpz: false,
                qgz_intra_bits: 16,
                ..Switches::zeropp(32)
            },
        ),
        (
            4,
            Switches {
                hpz: false,
                qgz_intra_bits: 4,
                ..Switches::zeropp(32)
            },
        ),
    ];
    for (nodes, switches) in cases {
        let both = |e: &mut Engine, rank| (both_ways(e, 1, rank), e.plan.clone());
        let got = on_four_engines(&switches, nodes, both);
        for (rank, ([engine, fsdp], plan)) in got.into_iter().enumerate() {
            assert_eq!((engine.len(), fsdp.len()), (4, 4));
            for (call, (a, b)) in engine.iter().zip(&fsdp).enumerate() {
                assert!(a == b, "{plan:?}: rank {rank}, call {call} differs");
            }
        }
    }
}

#[test]
fn on_nodes_of_one_rank_no_first_hop_residual_is_kept_and_a_saved_one_leaves_the_hop_across_s() {
    // 4 x 1 with int4 inside and error feedback: qgZ sends nothing inside
    // a node of one rank, so nothing is kept for that hop; a checkpoint of
    // a build that kept one (shaped W chunks) still restores the residual
    // of the hop across, which is not reset with it.
    let switches = Switches {
        qgz_intra_bits: 4,
        ..Switches::zeropp(32)
    };
    let got = on_four_engines(&switches, 4, |e, rank| {
        for s in 0..2 {
            let (x, y) = batch(s as u64, 8, 16);
            let (x, y) = (
                x.narrow(0, rank * 2, 2).unwrap(),
                y.narrow(0, rank * 2, 2).unwrap(),
            );
            e.train_step(&x, &y, 3e-3).unwrap();
        }
        let mut shards = e.shard_state().unwrap();
        let kept_first: Vec<bool> = shards.iter().map(|s| !s.residual.is_empty()).collect();
        let across: Vec<Residual> = shards.iter().map(|s| s.residual_inter.clone()).collect();
        for sh in &mut shards {
            sh.residual = Residual::zeros(sh.layout.chunk, 4);
        }
        e.load_shard_state(shards, 2).unwrap();
        let after = e.shard_state().unwrap();
        let restored = after
            .iter()
            .zip(&across)
            .all(|(a, b)| a.residual_inter == *b);
        let nonzero = across.iter().any(|r| r.bytes() > 0 && !r.is_empty());
        (
            kept_first,
            restored,
            nonzero,
            after.iter().all(|a| a.residual.is_empty()),
        )
    });
    for (rank, (kept_first, restored, nonzero, none_after)) in got.into_iter().enumerate() {
        assert!(
            kept_first.iter().all(|k| !k),
            "rank {rank} keeps a first-hop residual"
        );
        assert!(nonzero, "rank {rank}: the hop across keeps a residual");
        assert!(restored, "rank {rank}: the hop across's residual was reset");
        assert!(
            none_after,
            "rank {rank}: the saved first-hop residual was taken"
        );
    }
}

#[test]
fn an_hpz_secondary_of_values_gives_the_backward_gather_the_forward_weights_inside_the_node() {
    // hpZ keeps the forward gather's run of chunks as values — bf16 or f32
    // as the plain wire sent them, or the full weights of a difference
    // gather when the hpZ group is smaller than the node — and the
    // backward gather rebuilds the unit from its group's runs: the
    // forward's weights bit for bit, no byte across nodes.
    let plain = Switches {
        qwz_bits: None,
        qwz_delta: false,
        qwz_int8_references: false,
        hpz_group: Some(2),
        ..Switches::zeropp(32)
    };
    let cases = [
        plain.clone(),
        Switches {
            fp32_comm: true,
            ..plain
        },
        // References in values, as `plan::resolve` keeps them for an hpZ
        // group smaller than the node.
        Switches {
            hpz_group: Some(1),
            qwz_int8_references: false,
            ..Switches::zeropp(32)
        },
    ];
    for switches in cases {
        let got = on_four_engines(&switches, 2, |e, _| {
            let u = 1;
            let forward = e.start_primary_gather(u, Phase::ForwardGather).unwrap();
            let forward = forward.wait().unwrap();
            assert!(forward.secondary.is_some(), "hpZ kept no secondary shard");
            e.units[u].secondary = forward.secondary;
            let before = e.traffic();
            let backward = e.start_backward_gather(u).unwrap().wait().unwrap();
            let sent = e.traffic().since(&before).backward_gather.total;
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            (bits(&forward.full) == bits(&backward.full), sent)
        });
        for (rank, (same, sent)) in got.into_iter().enumerate() {
            assert!(same, "{switches:?}: rank {rank}'s backward weights differ");
            assert_eq!(sent.inter_node, 0, "{switches:?}: rank {rank}");
        }
    }
}

/// Every rank's master shard of every unit after `steps` steps of a job of
/// `nodes` x `g` ranks cut into `islands` islands (count, sync every,
/// fragments, delay) with f32 outer deltas, and `outer_finish` at the end
/// (`islands: None`: a job of its own). Rank r of a job that starts at
/// global rank `first` of `total` trains on global rank `first + r`'s rows.
fn islands_run(
    nodes: usize,
    g: usize,
    islands: Option<(usize, usize, usize, usize)>,
    switches: &Switches,
    steps: usize,
    first: usize,
    total: usize,
) -> Vec<Vec<Vec<f32>>> {
    islands_dying(
        nodes,
        g,
        islands,
        switches,
        steps,
        (first, total),
        None,
        None,
    )
    .into_iter()
    .map(|(masters, _)| masters)
    .collect()
}

/// How a rank's transport is rigged: its receives over the islands'
/// first cross-island group fail, from step `from` on, as if a rank of its
/// own island (`blames`) had died; it counts what it sends over that group
/// after the first such failure.
struct Rig {
    from: usize,
    blames: usize,
    across: u32,
    armed: AtomicBool,
    failed: AtomicBool,
    sent_after: AtomicUsize,
}

struct Rigged {
    inner: InProcess,
    rig: Arc<Rig>,
}

impl Rigged {
    fn over_across(&self, tag: zeropp_comm::Tag) -> bool {
        (tag >> 40) as u32 == self.rig.across
    }
}

impl zeropp_comm::Transport for Rigged {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn send(
        &self,
        peer: usize,
        tag: zeropp_comm::Tag,
        data: bytes::Bytes,
    ) -> std::result::Result<zeropp_comm::SendHandle, CommError> {
        if self.rig.failed.load(Ordering::SeqCst) && self.over_across(tag) {
            self.rig.sent_after.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.send(peer, tag, data)
    }
    fn recv(
        &self,
        peer: usize,
        tag: zeropp_comm::Tag,
        timeout: Duration,
    ) -> std::result::Result<bytes::Bytes, CommError> {
        if self.rig.armed.load(Ordering::SeqCst) && self.over_across(tag) {
            self.rig.failed.store(true, Ordering::SeqCst);
            return Err(CommError::PeerFailed {
                peer: self.rig.blames,
                reason: "rigged: it died".into(),
            });
        }
        self.inner.recv(peer, tag, timeout)
    }
    fn probe(&self, peer: usize, tag: zeropp_comm::Tag) -> bool {
        self.inner.probe(peer, tag)
    }
    fn name(&self) -> &'static str {
        "rigged"
    }
}

/// [`islands_run`] in which rank `dies.0`'s thread ends after step
/// `dies.1` (the ranks of its island return nothing once a collective
/// names it), and rank `rig.0`'s transport is rigged by `rig.1`: every rank's
/// masters and the islands it saw lost.
#[allow(clippy::too_many_arguments)]
fn islands_dying(
    nodes: usize,
    g: usize,
    islands: Option<(usize, usize, usize, usize)>,
    switches: &Switches,
    steps: usize,
    (first, total): (usize, usize),
    dies: Option<(usize, usize)>,
    rig: Option<(usize, Arc<Rig>)>,
) -> Vec<(Vec<Vec<f32>>, Vec<crate::LostIsland>)> {
    let rows = 2;
    let per_island = nodes * g / islands.map_or(1, |i| i.0);
    let transports: Vec<Box<dyn zeropp_comm::Transport>> = InProcess::world(nodes * g)
        .into_iter()
        .map(|t| match &rig {
            Some((r, rig)) if *r == t.rank() => Box::new(Rigged {
                inner: t,
                rig: rig.clone(),
            }) as _,
            _ => Box::new(t) as _,
        })
        .collect();
    let handles: Vec<_> = transports
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let switches = switches.clone();
            let rig = rig.clone().filter(|(r, _)| *r == rank).map(|(_, x)| x);
            std::thread::spawn(move || {
                let cfg = EngineConfig {
                    model: Arc::new(mlp()),
                    switches,
                    optim: OptimConfig {
                        warmup_steps: 1,
                        ..OptimConfig::default()
                    },
                    seed: 3,
                    islands: islands.map(|(count, sync_every, fragments, delay)| IslandConfig {
                        count,
                        sync_every,
                        auto: false,
                        origin: 0,
                        outer: OuterSettings::default(),
                        quantized: None,
                        fragments,
                        delay,
                    }),
                };
                let layout = Layout {
                    nodes,
                    ranks_per_node: g,
                    rank,
                };
                let mut e = Engine::new(t, layout, cfg, Duration::from_secs(30)).unwrap();
                let global = first + rank;
                let doomed = dies.is_some_and(|(r, _)| r / per_island == rank / per_island);
                for s in 0..steps {
                    if dies == Some((rank, s)) {
                        return (Vec::new(), Vec::new());
                    }
                    if let Some(r) = rig.as_ref().filter(|r| r.from == s) {
                        r.armed.store(true, Ordering::SeqCst);
                    }
                    let (x, y) = batch(s as u64, total * rows, 16);
                    let (x, y) = (
                        x.narrow(0, global * rows, rows).unwrap(),
                        y.narrow(0, global * rows, rows).unwrap(),
                    );
                    let stepped = e
                        .train_step(&x, &y, 3e-3)
                        .and_then(|_| e.outer_after_step());
                    match stepped {
                        Ok(()) => {}
                        Err(err) if doomed && err.is_peer_failure() => {
                            return (Vec::new(), Vec::new());
                        }
                        Err(err) => panic!("rank {rank} step {s}: {err}"),
                    }
                }
                if islands.is_some_and(|i| i.3 > 0) {
                    e.outer_finish().unwrap();
                }
                let kept = e.kept_bytes().outer_state;
                let chunk: usize = e.unit_layouts().iter().map(|u| u.chunk).sum();
                assert_eq!(kept > 0, islands.is_some_and(|i| i.0 > 1));
                assert!(kept as usize >= 8 * chunk || islands.is_none());
                let masters = e
                    .shard_state()
                    .unwrap()
                    .into_iter()
                    .map(|u| u.master)
                    .collect();
                (masters, e.lost_islands())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn islands_train_as_jobs_of_their_own_ranks_and_the_outer_step_is_diloco_s() {
    // 2 islands of one node x 2 ranks (zero3 inside), and of 2 nodes x 1
    // rank (ZeRO++ inside: qwZ, qgZ across the island's nodes, hpZ).
    for (nodes, g, switches) in [(2, 2, Switches::zero3(32)), (4, 1, Switches::zeropp(32))] {
        let (world, per) = (nodes * g, nodes * g / 2);
        // Before any sync: each island is bit for bit a job of its own.
        let before = islands_run(nodes, g, Some((2, 3, 1, 0)), &switches, 2, 0, world);
        let alone: Vec<_> = (0..2)
            .flat_map(|i| islands_run(nodes / 2, g, None, &switches, 2, i * per, world))
            .collect();
        assert_eq!(before, alone, "{nodes} x {g}: an island is not its own job");
        // After the sync at step 3: DiLoCo's Nesterov step on the mean of
        // the two islands' deltas from the initial weights, the same on
        // both islands.
        let after = islands_run(nodes, g, Some((2, 3, 1, 0)), &switches, 3, 0, world);
        let inner: Vec<_> = (0..2)
            .flat_map(|i| islands_run(nodes / 2, g, None, &switches, 3, i * per, world))
            .collect();
        let init = islands_run(nodes / 2, g, None, &switches, 0, 0, world);
        let s = OuterSettings::default();
        for p in 0..per {
            for u in 0..init[p].len() {
                let expected: Vec<f32> = (0..init[p][u].len())
                    .map(|j| {
                        let a = init[p][u][j];
                        let g = ((a - inner[p][u][j]) + (a - inner[per + p][u][j])) / 2.0;
                        let buf = g;
                        a - s.lr * (g + s.momentum * buf)
                    })
                    .collect();
                assert_eq!(after[p][u], expected, "{nodes} x {g}: place {p} unit {u}");
                assert_eq!(after[per + p][u], expected, "{nodes} x {g}: island 1");
            }
        }
    }
}

#[test]
fn streamed_islands_end_on_one_model_and_stay_near_the_blocking_sync() {
    // 3 fragments (the MLP's 3 units), each exchange landing 2 steps after
    // it started, against the blocking sync: after outer_finish every
    // island holds the same weights, near the blocking run's.
    let z3 = Switches::zero3(32);
    let streamed = islands_run(2, 2, Some((2, 6, 3, 2)), &z3, 12, 0, 4);
    let blocking = islands_run(2, 2, Some((2, 6, 1, 0)), &z3, 12, 0, 4);
    let start = islands_run(1, 2, None, &z3, 0, 0, 4);
    for p in 0..2 {
        assert_eq!(
            streamed[p],
            streamed[2 + p],
            "place {p}: the islands differ"
        );
        let (mut off, mut moved) = (0f64, 0f64);
        for u in 0..start[p].len() {
            for j in 0..start[p][u].len() {
                off += f64::from(streamed[p][u][j] - blocking[p][u][j]).powi(2);
                moved += f64::from(blocking[p][u][j] - start[p][u][j]).powi(2);
            }
        }
        assert!(off > 0.0, "streaming changed nothing");
        assert!(
            off.sqrt() < 0.5 * moved.sqrt(),
            "{} off of {} moved",
            off.sqrt(),
            moved.sqrt()
        );
    }
}

#[test]
fn a_dead_island_leaves_the_outer_sync_and_the_others_train_on_without_it() {
    // 2 islands of 2 nodes x 1 rank, ZeRO++ inside, syncing every 4 steps;
    // rank 3 (island 1) dies after step 5 or 6: island 0 finds it gone at
    // the sync of step 8 and goes on alone, the same either way, and
    // unlike a run where nobody died.
    let zpp = Switches::zeropp(32);
    let run = |dies| islands_dying(4, 1, Some((2, 4, 1, 0)), &zpp, 14, (0, 4), dies, None);
    let (at5, at6, alive) = (run(Some((3, 5))), run(Some((3, 6))), run(None));
    for r in 0..2 {
        assert_eq!(at5[r].0, at6[r].0, "rank {r}: when island 1 died mattered");
        assert_ne!(at5[r].0, alive[r].0, "rank {r}: the death changed nothing");
        let lost = &at5[r].1;
        assert_eq!(lost.len(), 1, "rank {r}: {lost:?}");
        assert_eq!((lost[0].island, lost[0].step), (1, 8), "rank {r}: {lost:?}");
        assert!(lost[0].why.contains("rank 3") || lost[0].why.contains("rank 2"));
        assert!(at5[r].0.iter().flatten().all(|w| w.is_finite()));
    }
    assert!(alive.iter().all(|(_, lost)| lost.is_empty()));
    // Streamed (2 fragments, landing a step later): the exchanges under
    // way on the islands' thread find it gone too, and the survivors end
    // on one model.
    let streamed = islands_dying(
        4,
        1,
        Some((2, 4, 2, 1)),
        &zpp,
        14,
        (0, 4),
        Some((2, 5)),
        None,
    );
    assert_eq!(streamed[0].1.len(), 1, "{:?}", streamed[0].1);
    assert_eq!(streamed[0].1[0].island, 1);
    assert!(streamed[3].0.is_empty());
}

#[test]
fn a_rank_whose_island_broke_mid_sync_sends_nothing_more_to_the_other_islands() {
    // Rank 3's wait in its first exchange of the sync after step 8 fails
    // as if rank 2 (its own island) had died there: it must not start the
    // exchanges queued behind it (each would send a part the rank across,
    // rank 1, reads as the next message of the exchange it is in: a
    // malformed message or, for units of one size, a wrong average), so
    // rank 1 finds rank 3 gone and island 0 trains on alone.
    let zpp = Switches::zeropp(32);
    let across = GroupKind::Across {
        place: Some(1),
        members: 0,
    };
    let rig = Arc::new(Rig {
        from: 7,
        blames: 2,
        across: across.id().unwrap(),
        armed: AtomicBool::new(false),
        failed: AtomicBool::new(false),
        sent_after: AtomicUsize::new(0),
    });
    let islands = Some((2, 4, 1, 0));
    let dies = Some((3, usize::MAX));
    let out = islands_dying(
        4,
        1,
        islands,
        &zpp,
        14,
        (0, 4),
        dies,
        Some((3, rig.clone())),
    );
    assert!(rig.failed.load(Ordering::SeqCst), "the rig never fired");
    assert_eq!(rig.sent_after.load(Ordering::SeqCst), 0);
    for (r, (masters, lost)) in out.iter().enumerate().take(2) {
        assert_eq!(lost.len(), 1, "rank {r}: {lost:?}");
        assert_eq!(lost[0].island, 1, "rank {r}: {lost:?}");
        assert!(masters.iter().flatten().all(|w| w.is_finite()));
    }
    assert_eq!(out[1].1[0].step, 8);
    assert!(out[1].1[0].why.contains("rank 3"), "{:?}", out[1].1);
}

#[test]
fn island_settings_that_cannot_run_are_refused_with_what_to_set() {
    let c = IslandConfig {
        count: 2,
        sync_every: 4,
        auto: false,
        origin: 0,
        outer: OuterSettings::default(),
        quantized: None,
        fragments: 1,
        delay: 4,
    };
    assert!(
        c.check()
            .unwrap_err()
            .to_string()
            .contains("delay below sync_every")
    );
    let c = IslandConfig {
        delay: 0,
        sync_every: 0,
        ..c
    };
    assert!(c.check().unwrap_err().to_string().contains("at least 1"));
}

/// Buffers of 1 KiB or more the communication thread of rank 0 allocated
/// in each of `steps` steps of a 2 x 2 job under `switches`, and the
/// lengths in bytes of the units' full weights.
fn comm_thread_buffers(switches: Switches, steps: usize) -> (Vec<Vec<u64>>, Vec<u64>) {
    // A width no other test uses: the pools are shared by the process.
    let model: Arc<dyn Model> = Arc::new(TiedMlp {
        vocab: 256,
        width: 200,
    });
    let world = 4;
    let handles: Vec<_> = InProcess::world(world)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let (model, switches) = (model.clone(), switches.clone());
            std::thread::spawn(move || {
                let cfg = EngineConfig {
                    model,
                    switches,
                    optim: OptimConfig::default(),
                    seed: 3,
                    islands: None,
                };
                let layout = Layout {
                    nodes: 2,
                    ranks_per_node: 2,
                    rank,
                };
                let mut e = Engine::new(Box::new(t), layout, cfg, Duration::from_secs(30)).unwrap();
                let counted = |e: &Engine| {
                    e.thread
                        .submit(|_| Ok::<_, ZeroError>(super::counting::counted()))
                        .wait()
                        .unwrap()
                };
                let mut per_step = Vec::new();
                for s in 0..steps {
                    let (x, y) = batch(s as u64, world * 2, 16);
                    let (x, y) = (
                        x.narrow(0, rank * 2, 2).unwrap(),
                        y.narrow(0, rank * 2, 2).unwrap(),
                    );
                    let before = counted(&e);
                    e.train_step(&x, &y, 3e-3).unwrap();
                    let after = counted(&e);
                    per_step.push(after.sizes_since(&before));
                }
                let outputs = e.units.iter().map(|u| 4 * u.padded as u64).collect();
                (per_step, outputs)
            })
        })
        .collect();
    let mut results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    results.swap_remove(0)
}

#[test]
fn after_the_first_steps_gathers_and_reduce_scatters_allocate_no_buffer() {
    // ZeRO-3, ZeRO++ as published (int8 weights, hpZ's secondary, qgZ)
    // and zeropp's default (int4 weight differences, int8 references
    // inside the node, the rotated qgZ hop): the collectives' temporaries, quantized
    // chunks, messages and partial sums come from `zeropp_comm::scratch`,
    // so the communication thread allocates nothing but the full weights
    // it hands to compute. Before the pools the default allocated 70
    // buffers every step. Ranks are threads of one process here, so a
    // buffer a peer still holds when it is wanted again makes the pool
    // grow by one, once: an allocation made per call shows in every step,
    // such a miss in few (measured: 0-2 of 40 steps).
    for (name, switches) in [
        ("zero3", Switches::zero3(256)),
        ("published", Switches::zeropp_published(256)),
        ("default", Switches::zeropp(256)),
        (
            "bf16 references",
            Switches {
                qwz_bf16_references: true,
                qwz_int8_references: false,
                ..Switches::zeropp(256)
            },
        ),
        (
            "f32 references",
            Switches {
                qwz_int8_references: false,
                ..Switches::zeropp(256)
            },
        ),
        (
            "bf16 inside (the default without GPUs)",
            Switches {
                qgz_intra_bits: 16,
                ..Switches::zeropp(256)
            },
        ),
        (
            "hpZ on a plain wire",
            Switches {
                qwz_bits: None,
                qwz_delta: false,
                qwz_int8_references: false,
                ..Switches::zeropp(256)
            },
        ),
        (
            "fp32 ZeRO-3",
            Switches {
                fp32_comm: true,
                ..Switches::zero3(256)
            },
        ),
    ] {
        let (per_step, outputs) = comm_thread_buffers(switches, 14);
        assert!(
            !per_step[0].is_empty(),
            "{name}: the first step fills the pools"
        );
        let others: Vec<Vec<u64>> = per_step[2..]
            .iter()
            .map(|step| {
                step.iter()
                    .copied()
                    .filter(|b| !outputs.contains(b))
                    .collect()
            })
            .collect();
        let allocating = others.iter().filter(|o| !o.is_empty()).count();
        assert!(
            allocating <= others.len() / 2,
            "{name}: buffers other than the full weights allocated in steps 3-14: {others:?}"
        );
    }
}
