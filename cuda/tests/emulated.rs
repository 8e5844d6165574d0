//! The CUDA kernels, run on the CPU by `zeropp-cuda-emu` (one fiber per
//! CUDA thread, the kernels' own source), against zeropp-quant: codes and
//! block parameters bit for bit for round-to-nearest, over every element
//! type, format, block size from 32 to 65536 and odd lengths; the swizzled
//! and fused kernels against the CPU compositions; stochastic codes as
//! neighbours; bad input reported in the error slots as the CPU reports it.
//! Kernel names, grids and error decoding are the launchers' own functions.

mod common;

use common::{FORMATS, assert_same, bits, values};
use half::{bf16, f16};
use zeropp_cuda::GpuElement;
use zeropp_cuda::kernels::{
    Fault, decode_corrupt_input, decode_fault, dequantize_grid, dequantize_kernel, quantize_grid,
    quantize_kernel, sum_requantize_kernel,
};
use zeropp_cuda_emu as emu;
use zeropp_quant::{
    Bits, QuantError, QuantFormat, QuantizedChunks, QuantizedTensor, Rounding, Scheme,
    quantize_swizzled, sum_requantize,
};

/// Quantizes `count` chunks as the launcher does; returns the tensor-shaped
/// buffers of all chunks and the error slots.
fn emu_quantize<T: GpuElement>(
    x: &[T],
    f: QuantFormat,
    rounding: Rounding,
    (nodes, rpn): (usize, usize),
    part_seeds: bool,
) -> (QuantizedChunks, emu::ErrSlots) {
    let count = nodes * rpn;
    let chunk_len = x.len() / count;
    let mut out = QuantizedChunks::zeroed(f, chunk_len, count);
    let (name, seed) = quantize_kernel(T::TAG, &f, rounding);
    let blocks = (f.num_blocks(chunk_len) * count) as u64;
    let err = emu::quantize(
        &name,
        quantize_grid(&f, blocks) as u32,
        x,
        emu::QuantizeParams {
            chunk_len: chunk_len as u64,
            count: count as u32,
            nodes: nodes as u32,
            rpn: rpn as u32,
            block: f.block as u32,
            seed,
            part_seeds,
        },
        &mut out.codes,
        &mut out.block_max,
        &mut out.block_min,
    );
    (out, err)
}

fn as_tensor(c: QuantizedChunks) -> QuantizedTensor {
    assert_eq!(c.count, 1);
    QuantizedTensor {
        format: c.format,
        len: c.chunk_len,
        codes: c.codes,
        block_max: c.block_max,
        block_min: c.block_min,
    }
}

fn emu_dequantize<T: GpuElement>(
    q: &QuantizedTensor,
    out: &mut [T],
    accumulate: bool,
) -> emu::ErrSlots {
    let name = dequantize_kernel(&q.format, (!accumulate).then_some(T::TAG));
    emu::dequantize(
        &name,
        dequantize_grid(&q.format, q.len) as u32,
        &q.codes,
        &q.block_max,
        &q.block_min,
        q.format.block as u32,
        out,
    )
}

fn check_element<T: GpuElement + PartialEq + std::fmt::Debug>(blocks: &[usize], lengths: &[usize]) {
    for (bits_, scheme) in FORMATS {
        for &block in blocks {
            let f = QuantFormat::new(bits_, scheme, block).unwrap();
            for (k, &len) in lengths.iter().enumerate() {
                let what = format!("{} {f} len {len}", T::TAG);
                let x: Vec<T> = values(len, k as u64 + block as u64);
                let cpu = QuantizedTensor::quantize(&x, f, Rounding::NearestEven).unwrap();
                let (got, err) = emu_quantize(&x, f, Rounding::NearestEven, (1, 1), false);
                assert_eq!(err, [u64::MAX; 2], "{what}");
                let got = as_tensor(got);
                assert_same(&got, &cpu, &what);

                let want: Vec<T> = cpu.dequantize().unwrap();
                let mut out = vec![T::from_f32(0.0); len];
                assert_eq!(emu_dequantize(&cpu, &mut out, false), [u64::MAX; 2]);
                assert_eq!(out, want, "dequantize {what}");

                let base: Vec<f32> = values(len, 99);
                let mut acc_cpu = base.clone();
                zeropp_quant::dequantize_accumulate(cpu.as_ref(), &mut acc_cpu).unwrap();
                let mut acc = base;
                assert_eq!(emu_dequantize(&cpu, &mut acc, true), [u64::MAX; 2]);
                assert_eq!(bits(&acc), bits(&acc_cpu), "accumulate {what}");
            }
        }
    }
}

#[test]
fn quantize_and_dequantize_match_the_cpu_bit_for_bit() {
    // Small blocks pack several teams into a CUDA block; 2048 and 65536 need
    // teams of 256 threads that reduce through shared memory and loop.
    check_element::<f32>(&[32, 64, 256, 2048], &[1, 31, 33, 1000, 4099]);
    check_element::<bf16>(&[32, 256, 2048], &[33, 1000, 4099]);
    check_element::<f16>(&[32, 256, 2048], &[33, 1000, 4099]);
    check_element::<f32>(&[65536], &[70001]);
}

#[test]
fn swizzled_quantize_matches_the_cpu() {
    for (nodes, rpn) in [(1, 1), (2, 2), (3, 2), (2, 4)] {
        for (bits_, scheme) in FORMATS {
            let f = QuantFormat::new(bits_, scheme, 32).unwrap();
            let world = nodes * rpn;
            let chunk = 200 + 3;
            let x: Vec<f32> = values(world * chunk, world as u64);
            for rounding in [Rounding::NearestEven, Rounding::Stochastic { seed: 5 }] {
                let mut cpu = QuantizedChunks::zeroed(f, chunk, world);
                quantize_swizzled(&x, nodes, rpn, rounding, &mut cpu).unwrap();
                let (got, err) = emu_quantize(&x, f, rounding, (nodes, rpn), true);
                assert_eq!(err, [u64::MAX; 2]);
                if rounding == Rounding::NearestEven {
                    assert_eq!(got, cpu, "{nodes}x{rpn} {f}");
                } else {
                    // Same ranges in the same places; codes from another stream.
                    assert_eq!(
                        bits(&got.block_max),
                        bits(&cpu.block_max),
                        "{nodes}x{rpn} {f}"
                    );
                    assert_eq!(
                        bits(&got.block_min),
                        bits(&cpu.block_min),
                        "{nodes}x{rpn} {f}"
                    );
                }
            }
        }
    }
}

fn emu_sum(
    inputs: &[QuantizedTensor],
    f: QuantFormat,
    rounding: Rounding,
) -> (QuantizedTensor, emu::ErrSlots) {
    let len = inputs[0].len;
    let mut out = QuantizedTensor::zeroed(f, len);
    let (name, seed) = sum_requantize_kernel(&f, rounding);
    let descs: Vec<emu::QInput> = inputs
        .iter()
        .map(|q| emu::QInput::of(&q.as_ref()))
        .collect();
    let err = emu::sum_requantize(
        &name,
        quantize_grid(&f, f.num_blocks(len) as u64) as u32,
        &descs,
        len as u64,
        f.block as u32,
        seed,
        &mut out.codes,
        &mut out.block_max,
        &mut out.block_min,
    );
    (out, err)
}

#[test]
fn fused_sum_requantize_matches_the_cpu() {
    let len = 3000 + 17;
    let in_formats = [
        QuantFormat::int4(32).unwrap(),
        QuantFormat::int8(256).unwrap(),
        QuantFormat::new(Bits::Four, Scheme::Asymmetric, 64).unwrap(),
        QuantFormat::new(Bits::Two, Scheme::Symmetric, 2048).unwrap(),
    ];
    let inputs: Vec<QuantizedTensor> = in_formats
        .iter()
        .enumerate()
        .map(|(k, f)| {
            QuantizedTensor::quantize(
                &values::<f32>(len, 10 + k as u64),
                *f,
                Rounding::NearestEven,
            )
            .unwrap()
        })
        .collect();
    for (bits_, scheme) in FORMATS {
        for block in [32, 2048] {
            let f = QuantFormat::new(bits_, scheme, block).unwrap();
            let mut cpu = QuantizedTensor::zeroed(f, len);
            let refs: Vec<_> = inputs.iter().map(|q| q.as_ref()).collect();
            sum_requantize(&refs, Rounding::NearestEven, cpu.as_mut(), &mut Vec::new()).unwrap();
            let (got, err) = emu_sum(&inputs, f, Rounding::NearestEven);
            assert_eq!(err, [u64::MAX; 2]);
            assert_same(&got, &cpu, &format!("sum into {f}"));
        }
    }
}

#[test]
fn stochastic_codes_are_neighbours_and_unbiased() {
    let f = QuantFormat::int4(256).unwrap();
    let len = 256;
    // absmax 7 makes the scale 1, so x / scale = x.
    let mut x: Vec<f32> = (0..len).map(|i| (i % 13) as f32 * 0.5 - 3.1).collect();
    x[0] = 7.0;
    let trials = 200;
    let mut mean = vec![0f64; len];
    for t in 0..trials {
        let (q, err) = emu_quantize(&x, f, Rounding::Stochastic { seed: t }, (1, 1), false);
        assert_eq!(err, [u64::MAX; 2]);
        let back: Vec<f32> = as_tensor(q).dequantize().unwrap();
        for (i, (&v, &b)) in x.iter().zip(&back).enumerate() {
            assert!(b == v.floor() || b == v.ceil(), "value {v} became {b}");
            mean[i] += f64::from(b) / trials as f64;
        }
    }
    for (i, (&v, m)) in x.iter().zip(&mean).enumerate() {
        // Bernoulli steps: standard error <= 0.5/sqrt(200) ~ 0.035.
        assert!(
            (m - f64::from(v)).abs() < 0.15,
            "element {i}: {v} averaged {m}"
        );
    }
}

#[test]
fn bad_input_is_reported_as_the_cpu_reports_it() {
    // The first non-finite value in block order, whatever thread saw it.
    for block in [32, 2048] {
        let f = QuantFormat::int8(block).unwrap();
        let mut x: Vec<f32> = values(5000, 3);
        x[4000] = f32::NEG_INFINITY;
        x[2100] = f32::NAN;
        x[2101] = f32::INFINITY;
        let Err(QuantError::NonFinite {
            block: b, index, ..
        }) = QuantizedTensor::quantize(&x, f, Rounding::NearestEven)
        else {
            panic!("the CPU accepted a NaN")
        };
        let (_, err) = emu_quantize(&x, f, Rounding::NearestEven, (1, 1), false);
        let Some(Fault::NonFinite { block: gb, offset }) = decode_fault(err[0]) else {
            panic!("no fault: {err:?}")
        };
        assert_eq!(
            (gb as usize, gb as usize * block + offset as usize),
            (b, index)
        );
    }

    // An asymmetric block whose range overflows f32.
    let fa = QuantFormat::new(Bits::Eight, Scheme::Asymmetric, 32).unwrap();
    let mut y = vec![0f32; 96];
    y[40] = f32::MAX;
    y[41] = -f32::MAX;
    let (_, err) = emu_quantize(&y, fa, Rounding::NearestEven, (1, 1), false);
    assert_eq!(
        decode_fault(err[0]),
        Some(Fault::RangeOverflow { block: 1 })
    );

    // Corrupt block parameters: dequantize names the block, the fused kernel
    // the input and the block.
    let f = QuantFormat::int8(64).unwrap();
    let mut q =
        QuantizedTensor::quantize(&values::<f32>(300, 4), f, Rounding::NearestEven).unwrap();
    q.block_max[3] = -1.0;
    let mut out = vec![0f32; 300];
    assert_eq!(emu_dequantize(&q, &mut out, false)[1], 3);
    let good = QuantizedTensor::quantize(&values::<f32>(300, 5), f, Rounding::NearestEven).unwrap();
    let (_, err) = emu_sum(
        &[good, q],
        QuantFormat::int4(32).unwrap(),
        Rounding::NearestEven,
    );
    assert_eq!(decode_corrupt_input(err[1]), Some((1, 3)));

    // A sum that overflows to infinity is a non-finite value of the sum.
    let big = QuantizedTensor::quantize(&vec![f32::MAX; 64], f, Rounding::NearestEven).unwrap();
    let (_, err) = emu_sum(&[big.clone(), big], f, Rounding::NearestEven);
    assert_eq!(
        decode_fault(err[0]),
        Some(Fault::NonFinite {
            block: 0,
            offset: 0
        })
    );
}

#[test]
fn the_kernel_descriptor_matches_the_launcher_layout() {
    assert_eq!(emu::qinput_size(), 48);
}

#[test]
fn the_mean_kernel_divides_every_value_as_the_cpu_does() {
    // By 6: a quotient the reciprocal's product would miss in the last bit.
    let mut x: Vec<f32> = values(70_001, 8);
    let want: Vec<f32> = x.iter().map(|v| v / 6.0).collect();
    emu::div_f32(64, &mut x, 6.0);
    assert_eq!(bits(&x), bits(&want));
}

#[test]
fn the_feedback_kernel_adds_and_takes_what_quantization_dropped() {
    let y: Vec<f32> = values(70_001, 9);
    let mut x: Vec<f32> = values(70_001, 10);
    let sum: Vec<f32> = x.iter().zip(&y).map(|(x, y)| x + y).collect();
    emu::axpby_f32(64, &mut x, &y, 1.0, 1.0);
    assert_eq!(bits(&x), bits(&sum));
    // y - x̂, as the CPU's residual `corrected - sent` computes it.
    let mut xhat: Vec<f32> = values(70_001, 11);
    let dropped: Vec<f32> = y.iter().zip(&xhat).map(|(y, x)| y - x).collect();
    emu::axpby_f32(7, &mut xhat, &y, -1.0, 1.0);
    assert_eq!(bits(&xhat), bits(&dropped));
}
