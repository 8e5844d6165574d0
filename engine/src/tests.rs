//! Engine tests on in-process worlds (ranks are threads) with a model of
//! their own (`testing::TiedMlp`): any model with a tie trains sharded as
//! on one rank, a layout that does not fit the transport is refused, and a
//! NaN gradient stops or skips a step on every rank. The tests over the
//! built-in GPT (every switch, hpZ, the mean over W, the byte counters) are
//! in the application crate (`src/train/engine_tests.rs`).

use std::time::Duration;

use super::testing::{TiedMlp, batch, reference_grad_norm, run_model};
use super::*;
use zeropp_comm::inproc::InProcess;
use zeropp_zero::plan::{Layout, Switches};

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
