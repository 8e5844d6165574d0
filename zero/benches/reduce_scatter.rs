//! The host path's gradient reduce-scatter on one machine: qgZ (int8
//! blocks of 32 inside the node, or the gradient in bf16 there; int4 blocks
//! of 64 across, Hadamard-rotated, error feedback) against ZeRO-3's plain
//! bf16 ring —
//! what FSDP2's own reduce-scatter moves — measured in the same run, on a
//! bf16 gradient of the 3.76M-parameter GPT of docs/BENCHMARKS.md over 2
//! logical nodes of 2 ranks (threads over in-process transports). On a
//! machine with fewer cores than ranks the CPU seconds per call are the
//! figure that transfers; the wall time includes waiting for the others.
//!
//! Run: `cargo bench -p zeropp-zero --features testing --bench reduce_scatter`

use std::time::{Duration, Instant};

use half::bf16;
use zeropp_quant::{QuantFormat, Rounding};
use zeropp_zero::backend::Quantizer;
use zeropp_zero::fsdp::{GradWire, reduce_scatter};
use zeropp_zero::host::Host;
use zeropp_zero::qgz::{Feedback, FirstHop, Reduction};
use zeropp_zero::testing::{bf16s, gradient, on_world};

const VALUES: usize = 3_758_592;
const CALLS: usize = 20;

/// This thread's CPU seconds so far.
fn thread_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    match (ticks(11), ticks(12)) {
        (Some(user), Some(system)) => (user + system) / 100.0,
        _ => f64::NAN,
    }
}

/// (best wall seconds, CPU seconds per call) of every rank: qgZ with
/// `intra` inside the node, or the plain ring.
fn run(intra: Option<FirstHop>) -> Vec<(f64, f64)> {
    on_world(2, 2, Duration::from_secs(60), move |r| {
        let (layout, m) = (r.layout, r.mover());
        let grad = bf16s(&gradient(layout.rank, VALUES));
        let mut out = vec![bf16::ZERO; VALUES / layout.world()];
        let mut residual = Host.chunks(zeropp_zero::residual::format(), 32, 1).unwrap();
        let (mut best, mut cpu) = (f64::MAX, 0.0);
        for call in 0..CALLS + 2 {
            let (wire, feedback) = match intra {
                None => (GradWire::RingBf16, Feedback::none()),
                Some(intra) => (
                    GradWire::TwoHop {
                        intra,
                        inter: QuantFormat::int4(64).unwrap(),
                        error_feedback: true,
                        stochastic: false,
                        hadamard: true,
                    },
                    Feedback {
                        first: None,
                        second: Some(&mut residual),
                    },
                ),
            };
            let how = (Rounding::NearestEven, feedback);
            let (t, c) = (Instant::now(), thread_cpu());
            let (x, mut o) = (&grad[..], &mut out[..]);
            reduce_scatter(&Host, &m, layout, wire, how, Reduction::Mean, &x, &mut o).unwrap();
            if call >= 2 {
                // The first two fill the buffer pools.
                best = best.min(t.elapsed().as_secs_f64());
                cpu += thread_cpu() - c;
            }
        }
        (best, cpu / CALLS as f64)
    })
}

fn main() {
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut rows = Vec::new();
    let int8 = FirstHop::Quantized(QuantFormat::int8(32).unwrap());
    for (name, intra) in [
        ("plain bf16 ring (ZeRO-3)", None),
        ("qgZ, int8 inside", Some(int8)),
        ("qgZ, bf16 inside", Some(FirstHop::Bf16)),
    ] {
        let r = run(intra);
        let wall = r.iter().map(|x| x.0).fold(0.0, f64::max);
        let cpu = median(r.iter().map(|x| x.1).collect());
        rows.push((name, wall, cpu));
    }
    println!(
        "reduce-scatter of {VALUES} bf16 values, 2 nodes x 2 ranks in one process, {CALLS} calls"
    );
    println!(
        "{:<28} {:>12} {:>16} {:>12}",
        "", "best wall ms", "CPU ms per rank", "CPU vs ring"
    );
    let ring = rows[0].2;
    for (name, wall, cpu) in rows {
        println!(
            "{name:<28} {:>12.2} {:>16.2} {:>11.2}x",
            wall * 1e3,
            cpu * 1e3,
            cpu / ring
        );
    }
}
