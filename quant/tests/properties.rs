//! Property tests of the error contract in the crate docs: error bounds,
//! idempotence, sign symmetry, exact blocks, unbiased stochastic rounding,
//! packing, and the fused and swizzled kernels against their compositions.

use half::{bf16, f16};
use proptest::prelude::*;
use zeropp_quant::*;

const U: f32 = 1.0 / 16_777_216.0;

fn formats() -> impl Strategy<Value = QuantFormat> {
    (
        prop_oneof![Just(Bits::Eight), Just(Bits::Four), Just(Bits::Two)],
        prop_oneof![Just(Scheme::Symmetric), Just(Scheme::Asymmetric)],
        5u32..=10,
    )
        .prop_map(|(bits, scheme, log_block)| {
            QuantFormat::new(bits, scheme, 1 << log_block).unwrap()
        })
}

/// Tensors like real weights and gradients: a random magnitude, an optional
/// offset, some exact zeros and repeated values, odd lengths.
fn tensors() -> impl Strategy<Value = Vec<f32>> {
    (0usize..2500, -30i32..30, any::<bool>(), any::<u64>()).prop_map(|(len, exp, offset, seed)| {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let mag = 2f32.powi(exp);
        let shift = if offset {
            mag * rng.random_range(-4.0f32..4.0)
        } else {
            0.0
        };
        (0..len)
            .map(|i| match i % 17 {
                0 => 0.0,
                5 => mag * 0.5,
                _ => shift + mag * rng.random_range(-1.0f32..1.0),
            })
            .collect()
    })
}

/// Block `b`'s slack-inclusive error bound for round-to-nearest.
fn bound(format: &QuantFormat, block: &[f32]) -> f32 {
    let qmax = format.qmax();
    match format.scheme {
        Scheme::Symmetric => {
            let absmax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            absmax / qmax / 2.0 + 4.0 * U * absmax
        }
        Scheme::Asymmetric => {
            let min = block.iter().copied().fold(f32::INFINITY, f32::min);
            let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            (max - min) / qmax / 2.0 + 8.0 * U * min.abs().max(max.abs())
        }
    }
}

fn check_bound(format: &QuantFormat, x: &[f32], y: &[f32], bound_of: impl Fn(&[f32]) -> f32) {
    for (b, (xb, yb)) in x
        .chunks(format.block)
        .zip(y.chunks(format.block))
        .enumerate()
    {
        let limit = bound_of(xb);
        for (i, (a, c)) in xb.iter().zip(yb).enumerate() {
            assert!(
                (a - c).abs() <= limit,
                "{format} block {b} elem {i}: x={a} x̂={c} err={} > bound {limit}",
                (a - c).abs()
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn round_to_nearest_error_is_within_half_a_scale(format in formats(), x in tensors()) {
        let q = QuantizedTensor::quantize(&x, format, Rounding::NearestEven).unwrap();
        let y: Vec<f32> = q.dequantize().unwrap();
        check_bound(&format, &x, &y, |b| bound(&format, b));
    }

    #[test]
    fn bf16_and_f16_inputs_obey_the_same_bound(format in formats(), x in tensors()) {
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let wide: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
        let q = QuantizedTensor::quantize(&xb, format, Rounding::NearestEven).unwrap();
        // Same codes as quantizing the widened values: arithmetic is f32.
        prop_assert_eq!(&q, &QuantizedTensor::quantize(&wide, format, Rounding::NearestEven).unwrap());
        let y: Vec<f32> = q.dequantize().unwrap();
        check_bound(&format, &wide, &y, |b| bound(&format, b));

        // f16 has a narrow range: scale the values into it.
        let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32((v * 1e-3).clamp(-6e4, 6e4))).collect();
        let wide: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
        let q = QuantizedTensor::quantize(&xh, format, Rounding::NearestEven).unwrap();
        let y: Vec<f32> = q.dequantize().unwrap();
        check_bound(&format, &wide, &y, |b| bound(&format, b));
        // Dequantizing to f16 is the f32 value rounded once.
        let yh: Vec<f16> = q.dequantize().unwrap();
        for (a, b) in yh.iter().zip(&y) {
            prop_assert_eq!(a.to_bits(), f16::from_f32(*b).to_bits());
        }
    }

    #[test]
    fn quantizing_the_dequantized_tensor_is_idempotent(format in formats(), x in tensors()) {
        let q = QuantizedTensor::quantize(&x, format, Rounding::NearestEven).unwrap();
        let y: Vec<f32> = q.dequantize().unwrap();
        let q2 = QuantizedTensor::quantize(&y, format, Rounding::NearestEven).unwrap();
        prop_assert_eq!(q, q2);
    }

    #[test]
    fn symmetric_codes_are_sign_symmetric(format in formats(), x in tensors()) {
        let format = QuantFormat { scheme: Scheme::Symmetric, ..format };
        let neg: Vec<f32> = x.iter().map(|v| -v).collect();
        let q = QuantizedTensor::quantize(&x, format, Rounding::NearestEven).unwrap();
        let qn = QuantizedTensor::quantize(&neg, format, Rounding::NearestEven).unwrap();
        prop_assert_eq!(&q.block_max, &qn.block_max);
        let y: Vec<f32> = q.dequantize().unwrap();
        let yn: Vec<f32> = qn.dequantize().unwrap();
        for (a, b) in y.iter().zip(&yn) {
            prop_assert_eq!(*a, -*b);
        }
    }

    #[test]
    fn single_value_blocks_are_exact(format in formats(), v in -1e30f32..1e30, len in 1usize..700) {
        let x = vec![v; len];
        let q = QuantizedTensor::quantize(&x, format, Rounding::NearestEven).unwrap();
        prop_assert_eq!(q.dequantize::<f32>().unwrap(), x);
        let zeros = vec![0.0f32; len];
        let q = QuantizedTensor::quantize(&zeros, format, Rounding::NearestEven).unwrap();
        prop_assert!(q.codes.iter().all(|&c| c == 0));
        prop_assert_eq!(q.dequantize::<f32>().unwrap(), zeros);
    }

    #[test]
    fn integer_codes_round_trip_through_packing(format in formats(), seed in any::<u64>(), len in 0usize..1500) {
        // With the block extremes at ±qmax (or 0 and L) the scale is 1, every
        // integer in range is its own code, and the round trip is exact.
        use rand::{RngExt, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let qmax = format.qmax() as i32;
        let lo = match format.scheme { Scheme::Symmetric => -qmax, Scheme::Asymmetric => 0 };
        let mut x: Vec<f32> = (0..len).map(|_| rng.random_range(lo..=qmax) as f32).collect();
        for b in x.chunks_mut(format.block) {
            b[0] = qmax as f32;
            if b.len() > 1 { b[1] = lo as f32; }
        }
        let q = QuantizedTensor::quantize(&x, format, Rounding::NearestEven).unwrap();
        prop_assert_eq!(q.codes.len(), format.code_bytes(len));
        prop_assert_eq!(q.dequantize::<f32>().unwrap(), x);
    }

    #[test]
    fn stochastic_rounding_stays_within_one_scale(format in formats(), x in tensors(), seed in any::<u64>()) {
        let q = QuantizedTensor::quantize(&x, format, Rounding::Stochastic { seed }).unwrap();
        let y: Vec<f32> = q.dequantize().unwrap();
        // One full scale instead of half, plus the same slack.
        check_bound(&format, &x, &y, |b| 2.0 * bound(&format, b));
        let again = QuantizedTensor::quantize(&x, format, Rounding::Stochastic { seed }).unwrap();
        prop_assert_eq!(q, again);
    }

    #[test]
    fn fused_sum_requantize_equals_its_composition(
        format in formats(), out_format in formats(), k in 1usize..5, seed in any::<u64>(), stochastic in any::<bool>(),
        x in tensors(),
    ) {
        let len = x.len();
        let inputs: Vec<QuantizedTensor> = (0..k)
            .map(|i| {
                let xi: Vec<f32> = x.iter().enumerate().map(|(j, v)| v * (1.0 + (i * 7 + j % 5) as f32 * 0.1)).collect();
                QuantizedTensor::quantize(&xi, format, Rounding::NearestEven).unwrap()
            })
            .collect();
        let rounding = if stochastic { Rounding::Stochastic { seed } } else { Rounding::NearestEven };
        let mut fused = QuantizedTensor::zeroed(out_format, len);
        let refs: Vec<QuantizedRef> = inputs.iter().map(|t| t.as_ref()).collect();
        sum_requantize(&refs, rounding, fused.as_mut(), &mut Vec::new()).unwrap();

        let mut sum = vec![0.0f32; len];
        for t in &inputs {
            dequantize_accumulate(t.as_ref(), &mut sum).unwrap();
        }
        let composed = QuantizedTensor::quantize(&sum, out_format, rounding).unwrap();
        prop_assert_eq!(fused, composed);
    }

    #[test]
    fn fused_error_feedback_equals_its_composition(
        format in formats(), residual_format in formats(), seed in any::<u64>(), stochastic in any::<bool>(),
        x in tensors(), large_blocks in any::<bool>(),
    ) {
        // Large blocks (beyond the fused kernel's span) take the composed path.
        let format = if large_blocks { QuantFormat::new(format.bits, format.scheme, 4096).unwrap() } else { format };
        let len = x.len();
        let rounding = if stochastic { Rounding::Stochastic { seed } } else { Rounding::NearestEven };
        let last: Vec<f32> = x.iter().enumerate().map(|(j, v)| v * 0.01 * ((j % 7) as f32 - 3.0)).collect();
        let kept = QuantizedTensor::quantize(&last, residual_format, Rounding::NearestEven).unwrap();

        let mut sum = x.clone();
        dequantize_accumulate(kept.as_ref(), &mut sum).unwrap();
        let sent = QuantizedTensor::quantize(&sum, format, rounding).unwrap();
        let mut lost: Vec<f32> = sent.dequantize().unwrap();
        lost.iter_mut().zip(&sum).for_each(|(d, s)| *d = s - *d);
        let dropped = QuantizedTensor::quantize(&lost, residual_format, Rounding::NearestEven).unwrap();

        for isa in Isa::available() {
            let mut y = x.clone();
            let mut out = QuantizedTensor::zeroed(format, len);
            let mut now = QuantizedTensor::zeroed(residual_format, len);
            quantize_with_feedback_on(isa, &mut y, rounding, out.as_mut(), kept.as_ref(), now.as_mut()).unwrap();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&y), bits(&sum));
            prop_assert_eq!(&out, &sent);
            prop_assert_eq!(&now, &dropped);
        }
    }

    #[test]
    fn swizzled_quantize_equals_quantizing_each_chunk(
        format in formats(), nodes in 1usize..5, ranks_per_node in 1usize..5, chunk in 0usize..300,
        seed in any::<u64>(), stochastic in any::<bool>(),
    ) {
        let world = nodes * ranks_per_node;
        let x: Vec<f32> = (0..world * chunk).map(|i| ((i * 2654435761) % 1000) as f32 - 500.0).collect();
        let rounding = if stochastic { Rounding::Stochastic { seed } } else { Rounding::NearestEven };
        let mut out = QuantizedChunks::zeroed(format, chunk, world);
        quantize_swizzled(&x, nodes, ranks_per_node, rounding, &mut out).unwrap();
        for position in 0..world {
            let rank = swizzled_rank(position, nodes, ranks_per_node);
            // Order by (destination local rank, destination node).
            prop_assert_eq!(rank % ranks_per_node, position / nodes);
            prop_assert_eq!(rank / ranks_per_node, position % nodes);
            let alone = QuantizedTensor::quantize(&x[rank * chunk..][..chunk], format, rounding.for_part(rank)).unwrap();
            let got = out.chunk(position);
            prop_assert_eq!(got.codes, &alone.codes[..]);
            prop_assert_eq!(got.block_max, &alone.block_max[..]);
            prop_assert_eq!(got.block_min, &alone.block_min[..]);
        }
    }

    #[test]
    fn a_16_bit_tensor_quantizes_as_its_f32_widening(format in formats(), x in tensors(), seed in any::<u64>(), stochastic in any::<bool>()) {
        // What qgZ relies on when it quantizes a bf16 gradient straight
        // from the caller's tensor.
        let rounding = if stochastic { Rounding::Stochastic { seed } } else { Rounding::NearestEven };
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let wide_b: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
        let wide_h: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
        for isa in Isa::available() {
            let mut a = QuantizedTensor::zeroed(format, x.len());
            let mut b = QuantizedTensor::zeroed(format, x.len());
            quantize_on(isa, &xb, rounding, a.as_mut()).unwrap();
            quantize_on(isa, &wide_b, rounding, b.as_mut()).unwrap();
            prop_assert_eq!(&a, &b);
            if wide_h.iter().all(|v| v.is_finite()) {
                quantize_on(isa, &xh, rounding, a.as_mut()).unwrap();
                quantize_on(isa, &wide_h, rounding, b.as_mut()).unwrap();
                prop_assert_eq!(&a, &b);
            }
        }
    }

    #[test]
    fn every_instruction_set_gives_identical_results(format in formats(), x in tensors(), seed in any::<u64>()) {
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let results: Vec<_> = Isa::available()
            .into_iter()
            .map(|isa| {
                let mut q = QuantizedTensor::zeroed(format, x.len());
                quantize_on(isa, &x, Rounding::NearestEven, q.as_mut()).unwrap();
                let mut qs = QuantizedTensor::zeroed(format, x.len());
                quantize_on(isa, &xb, Rounding::Stochastic { seed }, qs.as_mut()).unwrap();
                let mut y = vec![bf16::ZERO; x.len()];
                dequantize_on(isa, qs.as_ref(), &mut y).unwrap();
                let mut acc = x.clone();
                dequantize_accumulate_on(isa, q.as_ref(), &mut acc).unwrap();
                let mut fused = QuantizedTensor::zeroed(format, x.len());
                sum_requantize_on(isa, &[q.as_ref(), qs.as_ref()], Rounding::NearestEven, fused.as_mut(), &mut Vec::new()).unwrap();
                (q, qs, y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), acc.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), fused)
            })
            .collect();
        for r in &results[1..] {
            prop_assert_eq!(r, &results[0]);
        }
    }

    #[test]
    fn a_non_finite_value_is_named(format in formats(), len in 1usize..2000, pos_seed in any::<usize>(), which in 0usize..3) {
        let mut x: Vec<f32> = (0..len).map(|i| (i as f32).sin()).collect();
        let pos = pos_seed % len;
        x[pos] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][which];
        let err = QuantizedTensor::quantize(&x, format, Rounding::NearestEven).unwrap_err();
        match err {
            QuantError::NonFinite { block, index, .. } => {
                prop_assert_eq!(index, pos);
                prop_assert_eq!(block, pos / format.block);
            }
            other => prop_assert!(false, "unexpected error {other}"),
        }
    }
}

#[test]
fn stochastic_rounding_is_unbiased() {
    // A symmetric int4 block whose absmax is 7 has scale 1: every other value
    // sits between two codes, and its mean over many seeds must approach it.
    let format = QuantFormat::int4(32).unwrap();
    let mut x = vec![0.0f32; 32];
    x[0] = 7.0;
    let probes = [0.3f32, 2.71, -1.45, 6.5, -0.05, 3.999];
    x[1..=probes.len()].copy_from_slice(&probes);
    let draws = 20_000;
    let mut sums = [0f64; 6];
    let mut ups = [0usize; 6];
    for seed in 0..draws {
        let q = QuantizedTensor::quantize(&x, format, Rounding::Stochastic { seed }).unwrap();
        let y: Vec<f32> = q.dequantize().unwrap();
        for (i, p) in probes.iter().enumerate() {
            sums[i] += y[i + 1] as f64;
            ups[i] += (y[i + 1] > *p) as usize;
        }
    }
    for (i, p) in probes.iter().enumerate() {
        let mean = sums[i] / draws as f64;
        // Each draw has variance f(1-f) <= 1/4: five standard errors.
        let tolerance = 5.0 * 0.5 / (draws as f64).sqrt();
        assert!(
            (mean - *p as f64).abs() < tolerance,
            "probe {p}: mean {mean}"
        );
        // It really is random: both neighbours occur (unless p is an integer).
        let frac = p - p.floor();
        let expect_up = frac as f64 * draws as f64;
        assert!(
            (ups[i] as f64 - expect_up).abs() < 5.0 * (draws as f64 / 4.0).sqrt(),
            "probe {p}: {} ups",
            ups[i]
        );
    }
}

#[test]
fn int4_packs_the_even_element_in_the_low_nibble() {
    let format = QuantFormat::int4(32).unwrap();
    let mut x = vec![0.0f32; 33];
    x[0] = 7.0;
    x[1] = -1.0;
    x[2] = 3.0;
    x[32] = -5.0; // a partial last block of one value
    let q = QuantizedTensor::quantize(&x, format, Rounding::NearestEven).unwrap();
    assert_eq!(q.codes[0], 0x7 | (0xF << 4)); // 7, then -1 as 0xF
    assert_eq!(q.codes[1], 0x3);
    assert_eq!(q.codes.len(), 17);
    assert_eq!(q.codes[16], 0x9); // -7 (block of one: -5 is its absmax)
    assert_eq!(q.block_max, vec![7.0, 5.0]);
}

#[test]
fn empty_and_single_value_tensors_work() {
    for format in [
        QuantFormat::int8(32).unwrap(),
        QuantFormat::new(Bits::Two, Scheme::Asymmetric, 64).unwrap(),
    ] {
        let q = QuantizedTensor::quantize::<f32>(&[], format, Rounding::NearestEven).unwrap();
        assert_eq!(q.bytes(), 0);
        assert!(q.dequantize::<f32>().unwrap().is_empty());
        let q = QuantizedTensor::quantize(&[-2.5f32], format, Rounding::NearestEven).unwrap();
        assert_eq!(q.dequantize::<f32>().unwrap(), vec![-2.5]);
    }
}

#[test]
fn tiny_blocks_do_not_break_the_kernels() {
    // absmax / qmax underflows to a subnormal or zero scale: still finite,
    // error no larger than the block's own magnitude.
    let x = [1e-44f32, -3e-45, 0.0, 5e-45];
    for format in [
        QuantFormat::int8(32).unwrap(),
        QuantFormat::int4(32).unwrap(),
    ] {
        let q = QuantizedTensor::quantize(&x, format, Rounding::NearestEven).unwrap();
        let y: Vec<f32> = q.dequantize().unwrap();
        for (a, b) in x.iter().zip(&y) {
            assert!(b.is_finite() && (a - b).abs() <= 1e-44, "{a} -> {b}");
        }
    }
}

#[test]
fn corrupt_or_mis_sized_buffers_are_errors() {
    let format = QuantFormat::int8(32).unwrap();
    let x: Vec<f32> = (0..100).map(|i| i as f32).collect();
    let mut q = QuantizedTensor::quantize(&x, format, Rounding::NearestEven).unwrap();
    let short = QuantizedRef::new(format, 100, &q.codes[..99], &q.block_max, &[]);
    assert!(matches!(short, Err(QuantError::SizeMismatch { .. })));
    let mut out = vec![0.0f32; 99];
    assert!(dequantize(q.as_ref(), &mut out).is_err());
    q.block_max[2] = f32::NAN;
    let err = q.dequantize::<f32>().unwrap_err();
    assert!(
        matches!(err, QuantError::CorruptParams { block: 2, .. }),
        "{err}"
    );
    let asym = QuantFormat::new(Bits::Four, Scheme::Asymmetric, 32).unwrap();
    let mut q = QuantizedTensor::quantize(&x, asym, Rounding::NearestEven).unwrap();
    q.block_min[1] = q.block_max[1] + 1.0;
    assert!(matches!(
        q.dequantize::<f32>(),
        Err(QuantError::CorruptParams { block: 1, .. })
    ));
    let wide = [-3e38f32, 3e38];
    assert!(matches!(
        QuantizedTensor::quantize(&wide, asym, Rounding::NearestEven),
        Err(QuantError::RangeOverflow { block: 0, .. })
    ));
    assert!(
        quantize_swizzled(
            &x[..99],
            2,
            2,
            Rounding::NearestEven,
            &mut QuantizedChunks::zeroed(format, 25, 4)
        )
        .is_err()
    );
}
