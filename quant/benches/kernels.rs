//! Throughput of the quantization kernels on 64 MiB of input, one thread,
//! against a plain memcpy of the same input measured in the same run.
//!
//! Run: `cargo bench -p zeropp-quant --bench kernels` (add `-- --quick` for
//! fewer repetitions). GB/s counts the bytes of the full-precision tensor
//! (read by quantize, written by dequantize); `vs memcpy` is memcpy's time
//! for those bytes divided by the kernel's time (1.0 = as fast as memcpy).

use std::hint::black_box;
use std::time::{Duration, Instant};

use half::bf16;
use zeropp_quant::*;

const BYTES: usize = 64 << 20;

fn best_of(reps: usize, mut f: impl FnMut()) -> Duration {
    f(); // warm caches, page in buffers
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap()
}

fn data<T: Element>(n: usize) -> Vec<T> {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            T::from_f32(((s >> 40) as f32 / 16_777_216.0 - 0.5) * 0.04)
        })
        .collect()
}

struct Row {
    name: String,
    secs: f64,
    memcpy: f64,
}

fn bench_type<T: Element>(reps: usize, rows: &mut Vec<Row>) {
    let n = BYTES / std::mem::size_of::<T>();
    let x: Vec<T> = data(n);
    let mut copy = vec![T::from_f32(0.0); n];
    let memcpy = best_of(reps, || copy.copy_from_slice(black_box(&x))).as_secs_f64();
    rows.push(Row {
        name: format!("memcpy {}", T::NAME),
        secs: memcpy,
        memcpy,
    });
    for (label, format) in [
        ("int8", QuantFormat::int8(256).unwrap()),
        ("int8 (blocks of 32)", QuantFormat::int8(32).unwrap()),
        ("int4", QuantFormat::int4(256).unwrap()),
        (
            "int4 asym",
            QuantFormat::new(Bits::Four, Scheme::Asymmetric, 256).unwrap(),
        ),
    ] {
        let mut q = QuantizedTensor::zeroed(format, n);
        let t = best_of(reps, || {
            quantize(black_box(&x), Rounding::NearestEven, q.as_mut()).unwrap()
        });
        rows.push(Row {
            name: format!("quantize {} -> {label}", T::NAME),
            secs: t.as_secs_f64(),
            memcpy,
        });
        if label == "int4" {
            let t = best_of(reps, || {
                quantize(black_box(&x), Rounding::Stochastic { seed: 1 }, q.as_mut()).unwrap()
            });
            rows.push(Row {
                name: format!("quantize {} -> {label} stochastic", T::NAME),
                secs: t.as_secs_f64(),
                memcpy,
            });
        }
        let t = best_of(reps, || {
            dequantize(q.as_ref(), black_box(&mut copy)).unwrap()
        });
        rows.push(Row {
            name: format!("dequantize {label} -> {}", T::NAME),
            secs: t.as_secs_f64(),
            memcpy,
        });
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let reps = if quick { 2 } else { 5 };
    let mut rows = Vec::new();
    bench_type::<f32>(reps, &mut rows);
    bench_type::<bf16>(reps, &mut rows);

    // f32-side kernels of qgZ on 64 MiB of f32 gradient.
    let n = BYTES / 4;
    let x: Vec<f32> = data(n);
    let mut acc = vec![0.0f32; n];
    let memcpy = best_of(reps, || acc.copy_from_slice(black_box(&x))).as_secs_f64();
    let format = QuantFormat::int4(256).unwrap();
    let q = QuantizedTensor::quantize(&x, format, Rounding::NearestEven).unwrap();
    let t = best_of(reps, || {
        dequantize_accumulate(q.as_ref(), black_box(&mut acc)).unwrap()
    });
    rows.push(Row {
        name: "dequantize-accumulate int4 -> f32".into(),
        secs: t.as_secs_f64(),
        memcpy,
    });
    let inputs = [q.as_ref(), q.as_ref(), q.as_ref(), q.as_ref()];
    let mut out = QuantizedTensor::zeroed(format, n);
    let mut scratch = Vec::new();
    let t = best_of(reps, || {
        sum_requantize(&inputs, Rounding::NearestEven, out.as_mut(), &mut scratch).unwrap()
    });
    rows.push(Row {
        name: "fused sum-requantize 4 x int4 -> int4".into(),
        secs: t.as_secs_f64(),
        memcpy,
    });
    let mut chunks = QuantizedChunks::zeroed(format, n / 8, 8);
    let t = best_of(reps, || {
        quantize_swizzled(black_box(&x), 2, 4, Rounding::NearestEven, &mut chunks).unwrap()
    });
    rows.push(Row {
        name: "swizzled quantize f32 -> int4 (2x4)".into(),
        secs: t.as_secs_f64(),
        memcpy,
    });
    // qgZ's hop across nodes: int4 blocks of 64 with error feedback kept in
    // int4 blocks of 32 (`zero::residual`), one fused pass, against its
    // kernels in turn.
    let int4 = QuantFormat::int4(64).unwrap();
    let residual = QuantFormat::int4(32).unwrap();
    let kept = QuantizedTensor::quantize(&x, residual, Rounding::NearestEven).unwrap();
    let mut sent = QuantizedTensor::zeroed(int4, n);
    let mut now = QuantizedTensor::zeroed(residual, n);
    let t = best_of(reps, || {
        acc.copy_from_slice(&x);
        quantize_with_feedback(
            &mut acc,
            Rounding::NearestEven,
            sent.as_mut(),
            kept.as_ref(),
            now.as_mut(),
        )
        .unwrap()
    });
    rows.push(Row {
        name: "error feedback int4/64 + int4/32, fused".into(),
        secs: t.as_secs_f64(),
        memcpy,
    });
    let mut lost = vec![0f32; n];
    let t = best_of(reps, || {
        acc.copy_from_slice(&x);
        dequantize_accumulate(kept.as_ref(), &mut acc).unwrap();
        quantize(&acc, Rounding::NearestEven, sent.as_mut()).unwrap();
        dequantize(sent.as_ref(), &mut lost).unwrap();
        lost.iter_mut().zip(&acc).for_each(|(d, a)| *d = a - *d);
        quantize(&lost, Rounding::NearestEven, now.as_mut()).unwrap();
    });
    rows.push(Row {
        name: "error feedback, the kernels in turn".into(),
        secs: t.as_secs_f64(),
        memcpy,
    });
    for block in [64, 256] {
        for isa in Isa::available() {
            acc.copy_from_slice(&x);
            let t = best_of(reps, || {
                hadamard::rotate_blocks_on(isa, black_box(&mut acc), block).unwrap()
            });
            rows.push(Row {
                name: format!("Hadamard rotation, blocks of {block} ({isa:?})"),
                secs: t.as_secs_f64(),
                memcpy,
            });
        }
    }

    println!(
        "{:<42} {:>9} {:>10}",
        "kernel (64 MiB input, 1 thread)", "GB/s", "vs memcpy"
    );
    for r in rows {
        println!(
            "{:<42} {:>9.2} {:>9.2}x",
            r.name,
            BYTES as f64 / r.secs / 1e9,
            r.memcpy / r.secs
        );
    }
}
