//! The engine's tests over the built-in GPT, on in-process worlds (ranks
//! are threads): data-parallel correctness, every switch, the mean over W,
//! hpZ, and the byte counters. The engine's own tests, over a model of
//! their own, are in `engine/src/tests.rs`.

use std::sync::Arc;

use zeropp_engine::testing::{RunResult, batch, reference_grad_norm, run_model};
use zeropp_zero::layout::Layout;
use zeropp_zero::plan::{Plan, Switches};

use crate::train::model::ModelConfig;

fn tiny_model() -> ModelConfig {
    ModelConfig {
        vocab: 256,
        context: 16,
        width: 32,
        layers: 1,
        heads: 2,
        tied_head: false,
    }
}

/// Trains `steps` steps on `nodes` x `g` in-process ranks; rank r's batch is
/// rows `r·rows .. (r+1)·rows` of one global batch.
fn run(nodes: usize, g: usize, switches: Switches, steps: usize, rows: usize) -> Vec<RunResult> {
    run_model(Arc::new(tiny_model()), nodes, g, switches, steps, rows)
}

#[test]
fn every_rank_sees_the_same_mean_loss_and_it_falls() {
    let r = run(2, 2, Switches::zeropp(32), 12, 2);
    for other in &r[1..] {
        assert_eq!(other.losses, r[0].losses);
    }
    let l = &r[0].losses;
    assert!(l[l.len() - 1] < l[0] - 0.5, "losses {l:?}");
}

#[test]
fn sharded_zero3_matches_one_rank_on_the_whole_batch() {
    // Data parallelism must not change the math: 4 ranks with 2 rows each
    // against 1 rank with all 8 rows. bf16 communication is the only
    // difference.
    let one = run(1, 1, Switches::zero3(32), 5, 8);
    let four = run(2, 2, Switches::zero3(32), 5, 2);
    for (a, b) in one[0].losses.iter().zip(&four[0].losses) {
        assert!(
            (a - b).abs() < 0.02,
            "{:?} vs {:?}",
            one[0].losses,
            four[0].losses
        );
    }
    for (a, b) in one[0].norms.iter().zip(&four[0].norms) {
        assert!(
            (a - b).abs() / a < 0.05,
            "norms {:?} vs {:?}",
            one[0].norms,
            four[0].norms
        );
    }
}

#[test]
fn sharded_zero3_with_fp32_communication_matches_one_rank_step_for_step() {
    // With fp32 on the wire, sharding must not change the math beyond the
    // order of float additions: 20 steps, relative loss difference ≤ 1e-5.
    let fp32 = Switches {
        fp32_comm: true,
        ..Switches::zero3(32)
    };
    let one = run(1, 1, fp32.clone(), 20, 8);
    let four = run(2, 2, fp32, 20, 2);
    let worst = one[0]
        .losses
        .iter()
        .zip(&four[0].losses)
        .map(|(a, b)| ((a - b) / a).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= 1e-5,
        "max relative difference {worst}: {:?} vs {:?}",
        one[0].losses,
        four[0].losses
    );
    let l = &one[0].losses;
    assert!(l[19] < l[0] - 0.5, "it must also learn: {l:?}");
}

#[test]
fn a_tied_head_gets_the_gradient_of_both_its_uses_and_trains_sharded() {
    let tied = ModelConfig {
        tied_head: true,
        ..tiny_model()
    };
    let fp32 = Switches {
        fp32_comm: true,
        ..Switches::zero3(32)
    };
    // Step 1's gradient norm is that of the initial weights on the whole
    // batch: it must equal candle's own on the unsharded model, which
    // counts the token matrix's gradient from the embedding and the head.
    let four = run_model(Arc::new(tied.clone()), 2, 2, fp32, 20, 2);
    let (x, y) = batch(0, 8, 16);
    let want = reference_grad_norm(&tied, 3, &x, &y);
    let got = four[0].norms[0];
    assert!(
        ((got - want) / want).abs() < 1e-4,
        "engine {got} vs reference {want}"
    );
    let untied_norm = reference_grad_norm(&tiny_model(), 3, &x, &y);
    assert!((untied_norm - want).abs() / want > 1e-3);
    let l = &four[0].losses;
    assert!(l[19] < l[0] - 0.5, "losses {l:?}");
    // And under ZeRO++ (quantized gathers, hpZ, qgZ) it trains too.
    let zpp = run_model(Arc::new(tied), 2, 2, Switches::zeropp(32), 20, 2);
    let l = &zpp[0].losses;
    assert!(l[19] < l[0] - 0.5, "losses {l:?}");
}

#[test]
fn qgz_averages_over_all_ranks_not_over_nodes() {
    // With only qgZ on, the gradient norm must match ZeRO-3's up to int4
    // noise; dividing by the number of nodes would double it on 2x2.
    let base = run(2, 2, Switches::zero3(32), 1, 2);
    let qgz = run(
        2,
        2,
        Switches {
            qgz: true,
            ..Switches::zero3(32)
        },
        1,
        2,
    );
    let (a, b) = (base[0].norms[0], qgz[0].norms[0]);
    assert!((a - b).abs() / a < 0.15, "zero3 norm {a}, qgZ norm {b}");
    let ef = run(
        2,
        2,
        Switches {
            qgz: true,
            error_feedback: true,
            ..Switches::zero3(32)
        },
        3,
        2,
    );
    assert!(ef[0].losses.iter().all(|l| l.is_finite()));
}

#[test]
fn hpz_gives_identical_numbers_and_keeps_the_backward_gather_inside_the_node() {
    let qwz = Switches {
        qwz_bits: Some(8),
        ..Switches::zero3(32)
    };
    let plain = run(2, 2, qwz.clone(), 2, 2);
    let hpz = run(2, 2, Switches { hpz: true, ..qwz }, 2, 2);
    assert_eq!(plain[0].losses, hpz[0].losses);
    assert_eq!(plain[0].norms, hpz[0].norms);
    assert!(plain[0].traffic.backward_gather.total.inter_node > 0);
    assert_eq!(hpz[0].traffic.backward_gather.total.inter_node, 0);
    assert!(hpz[0].traffic.backward_gather.total.intra_node > 0);
}

/// hpZ over groups smaller than the node (NVLink islands on a PCIe box):
/// the same numbers, the backward gather confined to the group — none at
/// all for groups of one, half the node's bytes for groups of two of four.
/// References in values (smaller groups keep them so: `plan::resolve`;
/// int8 blocks are other forward weights).
#[test]
fn hpz_groups_smaller_than_the_node_give_identical_numbers() {
    let with_group = |h: Option<usize>| Switches {
        hpz_group: h,
        qwz_int8_references: false,
        ..Switches::zeropp(32)
    };
    let node = run(2, 4, with_group(None), 2, 1);
    let pairs = run(2, 4, with_group(Some(2)), 2, 1);
    let alone = run(2, 4, with_group(Some(1)), 2, 1);
    let backward = |rs: &[RunResult]| -> u64 {
        rs.iter()
            .map(|r| r.traffic.backward_gather.total.intra_node)
            .sum()
    };
    for (name, other) in [("pairs", &pairs), ("alone", &alone)] {
        for (a, b) in node.iter().zip(other.iter()) {
            assert_eq!(a.losses, b.losses, "{name}");
            assert_eq!(a.norms, b.norms, "{name}");
            assert_eq!(b.traffic.backward_gather.total.inter_node, 0, "{name}");
        }
    }
    assert_eq!(backward(&alone), 0);
    // Each member receives (h-1)/h of the unit per gather: 1/2 against 3/4.
    let ratio = backward(&pairs) as f64 / backward(&node) as f64;
    assert!(
        (ratio - 2.0 / 3.0).abs() < 0.02,
        "pairs/node backward bytes {ratio}"
    );
}

#[test]
fn an_hpz_group_that_does_not_divide_the_node_is_an_error() {
    let s = Switches {
        hpz_group: Some(3),
        ..Switches::zeropp(32)
    };
    let layout = Layout {
        nodes: 2,
        ranks_per_node: 4,
        rank: 0,
    };
    let err = Plan::new(layout, &s).unwrap_err();
    assert_eq!(switch_of(&err), "hpz_group", "{err}");
    assert!(
        err.to_string().contains("does not divide the 4 ranks"),
        "{err}"
    );
}

#[test]
fn zeropp_sends_far_fewer_bytes_across_nodes_than_zero3() {
    let z3 = run(2, 2, Switches::zero3(256), 1, 1);
    let zpp = run(2, 2, Switches::zeropp_published(256), 1, 1);
    // Summed over ranks: in a ring some ranks only ever talk inside the node.
    let inter = |rs: &[RunResult]| {
        rs.iter()
            .map(|r| r.traffic.total().inter_node as f64)
            .sum::<f64>()
    };
    let ratio = inter(&zpp) / inter(&z3);
    // bf16 forward + backward + gradient vs int8 forward + nothing + int4.
    assert!(ratio < 0.45, "zeropp/zero3 inter-node bytes {ratio}");
    assert!(zpp[0].traffic.forward_gather.scales.inter_node > 0);
    assert_eq!(z3[0].traffic.forward_gather.scales.inter_node, 0);
}

#[test]
fn weight_differences_train_as_zeropp_does_on_fewer_bytes_across_nodes() {
    // zeropp's default (int4 differences, a rotated gradient hop) against
    // DeepSpeed's ZeRO++.
    let (zpp, dz) = (
        run(2, 2, Switches::zeropp_published(64), 12, 2),
        run(2, 2, Switches::zeropp(64), 12, 2),
    );
    for other in &dz[1..] {
        assert_eq!(other.losses, dz[0].losses);
    }
    let (a, b) = (&zpp[0].losses, &dz[0].losses);
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() / x < 0.02, "zeropp {a:?}\ndelta {b:?}");
    }
    // After the first gather (a bf16 refresh), int4 differences against int8
    // weights: about half the forward gather's bytes across nodes.
    let fwd = |r: &[RunResult]| r[0].traffic.forward_gather.total.inter_node as f64;
    let ratio = fwd(&dz) / fwd(&zpp);
    assert!((0.5..0.75).contains(&ratio), "forward gather bytes {ratio}");
    // hpZ keeps the backward gather inside the node with differences too.
    assert_eq!(dz[0].traffic.backward_gather.total.inter_node, 0);
}

#[test]
fn weight_differences_without_qwz_bits_are_an_error() {
    let s = Switches {
        qwz_delta: true,
        ..Switches::zero3(64)
    };
    let e = Plan::new(
        Layout {
            nodes: 2,
            ranks_per_node: 2,
            rank: 0,
        },
        &s,
    )
    .unwrap_err();
    assert_eq!(switch_of(&e), "qwz_delta", "{e}");
    assert!(e.to_string().contains("set qwz_bits"), "{e}");
}

#[test]
fn a_hadamard_hop_without_qgz_is_an_error() {
    let s = Switches {
        qgz_hadamard: true,
        ..Switches::zero3(64)
    };
    let layout = Layout {
        nodes: 2,
        ranks_per_node: 2,
        rank: 0,
    };
    let e = Plan::new(layout, &s).unwrap_err();
    assert_eq!(switch_of(&e), "qgz_hadamard", "{e}");
    assert!(e.to_string().contains("turn qgz on"), "{e}");
}

/// The switch a plan error names (the test fails on a layout error).
fn switch_of(e: &crate::zero::plan::PlanError) -> &str {
    match e {
        crate::zero::plan::PlanError::Switch { switch, .. } => switch,
        other => panic!("a layout error where a switch was expected: {other}"),
    }
}

#[test]
fn int4_weights_and_single_switches_train() {
    for s in [
        Switches {
            qwz_bits: Some(4),
            ..Switches::zero3(64)
        },
        Switches {
            hpz: true,
            ..Switches::zero3(64)
        },
        Switches {
            qgz: true,
            ..Switches::zero3(64)
        },
        Switches {
            qgz: true,
            qgz_intra_bits: 8,
            ..Switches::zero3(64)
        },
        Switches {
            qgz: true,
            qgz_hadamard: true,
            qgz_inter_block: Some(64),
            error_feedback: true,
            ..Switches::zero3(64)
        },
    ] {
        let r = run(1, 2, s.clone(), 6, 2);
        let l = &r[0].losses;
        assert!(
            l.iter().all(|v| v.is_finite()) && l[5] < l[0],
            "{s:?}: {l:?}"
        );
    }
}
