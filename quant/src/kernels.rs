//! The CPU kernels: quantize, dequantize and dequantize-and-accumulate over
//! slices. Each works block by block in two passes (range, then codes) and
//! allocates nothing.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::QuantError;
use crate::element::Element;
use crate::format::{Bits, QuantFormat, Rounding, Scheme};
use crate::isa::Isa;
use crate::views::{QuantizedMut, QuantizedRef};

/// Adding then subtracting 1.5·2^23 rounds an f32 of magnitude below 2^22 to
/// the nearest integer, ties to even, under the default rounding mode. It is
/// exactly `rintf` on that range and vectorises without SSE4.1.
const ROUND_MAGIC: f32 = 12_582_912.0;

#[inline(always)]
fn round_half_even(v: f32) -> f32 {
    (v + ROUND_MAGIC) - ROUND_MAGIC
}

/// The integer nearest to `v` (ties to even), for `|v| < 2^22`: after adding
/// the magic number the integer sits in the low mantissa bits. Plain float
/// add and integer subtract, so the code loops vectorise (a float-to-int
/// conversion with Rust's saturating semantics does not).
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    ((v + ROUND_MAGIC).to_bits() as i32).wrapping_sub(ROUND_MAGIC.to_bits() as i32)
}

/// `floor(v + u)` for `u` in `[0, 1)`, written with compare and select.
#[inline(always)]
fn round_stochastic(v: f32, u: f32) -> f32 {
    let t = v + u;
    let r = round_half_even(t);
    if r > t { r - 1.0 } else { r }
}

/// Fills `draws` with uniform values in `[0, 1)` of 24 random bits each
/// (exact in f32): two per `u64` of the generator, from bits 63..40 and
/// 31..8, in element order.
#[inline(always)]
fn fill_uniform(rng: &mut SmallRng, draws: &mut [f32]) {
    const SCALE: f32 = 1.0 / 16_777_216.0;
    for pair in draws.chunks_mut(2) {
        let r = rng.next_u64();
        pair[0] = (r >> 40) as f32 * SCALE;
        if let Some(second) = pair.get_mut(1) {
            *second = ((r >> 8) & 0x00ff_ffff) as f32 * SCALE;
        }
    }
}

/// The generator for one block of a stochastic rounding: seeded from the
/// user's seed and the block index, so blocks can be done in any order.
fn block_rng(seed: u64, block: usize) -> SmallRng {
    SmallRng::seed_from_u64(seed ^ (block as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// Sorts like the float it came from: `key(a) < key(b)` iff `a < b` for
/// non-NaN floats (with -0 < +0); NaN sorts beyond ±inf.
#[inline(always)]
fn order_key(x: f32) -> i32 {
    let s = x.to_bits() as i32;
    s ^ (((s >> 31) as u32) >> 1) as i32
}

#[inline(always)]
fn from_order_key(k: i32) -> f32 {
    f32::from_bits((k ^ (((k >> 31) as u32) >> 1) as i32) as u32)
}

fn first_non_finite<T: Element>(x: &[T], block: usize, block_start: usize) -> QuantError {
    let (offset, value) = x
        .iter()
        .map(|v| v.to_f32())
        .enumerate()
        .find(|(_, v)| !v.is_finite())
        .expect("caller saw a non-finite value in this block");
    QuantError::NonFinite {
        block,
        index: block_start + offset,
        value,
    }
}

/// `max |x|` of a block, or the first non-finite value as an error.
#[inline(always)]
fn block_absmax<T: Element>(x: &[T], block: usize, block_start: usize) -> Result<f32, QuantError> {
    // Magnitude bits compare like the magnitudes, with inf and NaN on top; an
    // integer max is associative, so the compiler vectorises the reduction.
    let m = T::max_magnitude_bits(x);
    if m >= 0x7f80_0000 {
        return Err(first_non_finite(x, block, block_start));
    }
    Ok(f32::from_bits(m))
}

/// `(min, max)` of a block, or the first non-finite value as an error.
#[inline(always)]
fn block_min_max<T: Element>(
    x: &[T],
    block: usize,
    block_start: usize,
) -> Result<(f32, f32), QuantError> {
    let (min_key, max_key) = x
        .iter()
        .map(|v| order_key(v.to_f32()))
        .fold((i32::MAX, i32::MIN), |(lo, hi), k| (lo.min(k), hi.max(k)));
    if max_key >= order_key(f32::INFINITY) || min_key <= order_key(f32::NEG_INFINITY) {
        return Err(first_non_finite(x, block, block_start));
    }
    Ok((from_order_key(min_key), from_order_key(max_key)))
}

/// Writes the codes of one block, `PER` codes per byte, low bits first.
/// `code` maps a value and its companion from `extra` (a uniform draw for
/// stochastic rounding, `()` otherwise) to its integer code.
#[inline(always)]
fn write_codes<T: Element, U: Copy, const PER: usize>(
    x: &[T],
    extra: &[U],
    out: &mut [u8],
    mut code: impl FnMut(f32, U) -> i32,
) {
    debug_assert_eq!(x.len(), extra.len());
    let bits = 8 / PER;
    let mask = (1u32 << bits) - 1;
    let mut chunks = x.chunks_exact(PER);
    let mut extra_chunks = extra.chunks_exact(PER);
    let mut out_iter = out.iter_mut();
    for ((c, e), o) in (&mut chunks).zip(&mut extra_chunks).zip(&mut out_iter) {
        let mut byte = 0u32;
        for (k, (v, u)) in c.iter().zip(e).enumerate() {
            byte |= ((code(v.to_f32(), *u) as u32) & mask) << (k * bits);
        }
        *o = byte as u8;
    }
    let rem = chunks.remainder();
    if !rem.is_empty() {
        let mut byte = 0u32;
        for (k, (v, u)) in rem.iter().zip(extra_chunks.remainder()).enumerate() {
            byte |= ((code(v.to_f32(), *u) as u32) & mask) << (k * bits);
        }
        if let Some(o) = out_iter.next() {
            *o = byte as u8;
        }
    }
}

#[inline(always)]
fn write_block_codes<T: Element, U: Copy>(
    bits: Bits,
    x: &[T],
    extra: &[U],
    out: &mut [u8],
    code: impl FnMut(f32, U) -> i32,
) {
    match bits {
        Bits::Eight => write_codes::<T, U, 1>(x, extra, out, code),
        Bits::Four => write_codes::<T, U, 2>(x, extra, out, code),
        Bits::Two => write_codes::<T, U, 4>(x, extra, out, code),
    }
}

/// Values whose uniform draws are made ahead of their codes, so that the
/// code loop vectorises (a multiple of every codes-per-byte).
const NOISE_CHUNK: usize = 128;

/// Writes a block's codes with round-to-nearest (`code` gets no draw) or
/// stochastic rounding (`code` gets `u`, drawn in element order from `rng`).
#[inline(always)]
fn write_rounded_codes<T: Element>(
    bits: Bits,
    x: &[T],
    out: &mut [u8],
    rng: Option<&mut SmallRng>,
    code: impl Fn(f32, f32) -> i32 + Copy,
) {
    static NO_DRAWS: [(); crate::format::MAX_BLOCK] = [(); crate::format::MAX_BLOCK];
    match rng {
        None => write_block_codes(bits, x, &NO_DRAWS[..x.len()], out, |v, ()| code(v, 0.0)),
        Some(rng) => {
            let mut noise = [0f32; NOISE_CHUNK];
            let bytes_per_chunk = NOISE_CHUNK / bits.codes_per_byte();
            for (xc, oc) in x.chunks(NOISE_CHUNK).zip(out.chunks_mut(bytes_per_chunk)) {
                let draws = &mut noise[..xc.len()];
                fill_uniform(rng, draws);
                write_block_codes(bits, xc, draws, oc, code);
            }
        }
    }
}

/// Quantizes `input` into `out` in the format `out` was made for.
///
/// Errors: a non-finite input value (named by block and index), a block whose
/// range overflows f32 (asymmetric only), or buffers of the wrong size.
pub fn quantize<T: Element>(
    input: &[T],
    rounding: Rounding,
    out: QuantizedMut<'_>,
) -> Result<(), QuantError> {
    quantize_on(Isa::detect(), input, rounding, out)
}

/// [`quantize`] with a chosen instruction set (same results on every one).
pub fn quantize_on<T: Element>(
    isa: Isa,
    input: &[T],
    rounding: Rounding,
    out: QuantizedMut<'_>,
) -> Result<(), QuantError> {
    out.check_len(input.len())?;
    match isa {
        Isa::Portable => quantize_blocks(input, rounding, out),
        // SAFETY: as in `quantize_block_on`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::quantize_blocks(input, rounding, out) },
    }
}

/// Every block of `input` quantized into `out` (checked to fit), in one
/// function so that short blocks cost no call each.
#[inline(always)]
fn quantize_blocks<T: Element>(
    input: &[T],
    rounding: Rounding,
    mut out: QuantizedMut<'_>,
) -> Result<(), QuantError> {
    quantize_span(input, 0, rounding, &mut out)
}

/// `x` (values `start..start + x.len()` of `out`'s tensor: whole blocks,
/// but for the tensor's last) quantized into their blocks of `out`.
#[inline(always)]
pub(crate) fn quantize_span<T: Element>(
    x: &[T],
    start: usize,
    rounding: Rounding,
    out: &mut QuantizedMut<'_>,
) -> Result<(), QuantError> {
    let format = out.format;
    let per_block_bytes = format.code_bytes(format.block);
    for (i, xb) in x.chunks(format.block).enumerate() {
        let b = start / format.block + i;
        let block = BlockOut {
            index: b,
            start: b * format.block,
            codes: &mut out.codes[b * per_block_bytes..][..format.code_bytes(xb.len())],
            max: &mut out.block_max[b],
            min: out.block_min.get_mut(b),
        };
        quantize_block(xb, &format, rounding, block)?;
    }
    Ok(())
}

/// Where one block's quantization goes.
pub(crate) struct BlockOut<'a> {
    /// Block number within its tensor (names errors, seeds stochastic rounding).
    pub index: usize,
    /// Index of the block's first value within its tensor.
    pub start: usize,
    pub codes: &'a mut [u8],
    pub max: &'a mut f32,
    /// `None` for the symmetric scheme.
    pub min: Option<&'a mut f32>,
}

/// Quantizes one block with the chosen instruction set.
pub(crate) fn quantize_block_on<T: Element>(
    isa: Isa,
    x: &[T],
    format: &QuantFormat,
    rounding: Rounding,
    out: BlockOut<'_>,
) -> Result<(), QuantError> {
    match isa {
        Isa::Portable => quantize_block(x, format, rounding, out),
        // SAFETY: `Isa::Avx2` is only ever produced where the CPU has AVX2
        // (`Isa::detect`/`Isa::available`).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::quantize_block(x, format, rounding, out) },
    }
}

/// Dequantizes a range (see [`dequantize_range`]) with the chosen
/// instruction set.
pub(crate) fn dequantize_range_on<O>(
    isa: Isa,
    q: &QuantizedRef<'_>,
    start: usize,
    out: &mut [O],
    put: impl FnMut(&mut O, f32) + Copy,
) -> Result<(), QuantError> {
    match isa {
        Isa::Portable => dequantize_range(q, start, out, put),
        // SAFETY: as in `quantize_block_on`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::dequantize_range(q, start, out, put) },
    }
}

/// The kernels compiled with AVX2 enabled: the same generic code, inlined
/// into functions that carry the target feature.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;

    #[target_feature(enable = "avx2")]
    pub(super) fn quantize_block<T: Element>(
        x: &[T],
        format: &QuantFormat,
        rounding: Rounding,
        out: BlockOut<'_>,
    ) -> Result<(), QuantError> {
        super::quantize_block(x, format, rounding, out)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn quantize_blocks<T: Element>(
        input: &[T],
        rounding: Rounding,
        out: QuantizedMut<'_>,
    ) -> Result<(), QuantError> {
        super::quantize_blocks(input, rounding, out)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn dequantize_range<O>(
        q: &QuantizedRef<'_>,
        start: usize,
        out: &mut [O],
        put: impl FnMut(&mut O, f32) + Copy,
    ) -> Result<(), QuantError> {
        super::dequantize_range(q, start, out, put)
    }
}

/// Blocks of bf16 or f16 up to this long are widened to f32 on the stack
/// first: the code loop over a short block of 16-bit values ran scalar
/// (the results are the same, widening being exact).
const WIDENED_BLOCK: usize = 64;

/// Quantizes one block.
#[inline(always)]
pub(crate) fn quantize_block<T: Element>(
    x: &[T],
    format: &QuantFormat,
    rounding: Rounding,
    out: BlockOut<'_>,
) -> Result<(), QuantError> {
    if size_of::<T>() < size_of::<f32>() && x.len() <= WIDENED_BLOCK {
        let mut wide = [0f32; WIDENED_BLOCK];
        let wide = &mut wide[..x.len()];
        T::widen_slice(x, wide);
        return quantize_wide_block(wide, format, rounding, out);
    }
    quantize_wide_block(x, format, rounding, out)
}

/// [`quantize_block`] once the block is as wide as it will be.
#[inline(always)]
fn quantize_wide_block<T: Element>(
    x: &[T],
    format: &QuantFormat,
    rounding: Rounding,
    out: BlockOut<'_>,
) -> Result<(), QuantError> {
    let BlockOut {
        index: block,
        start: block_start,
        codes,
        max: max_out,
        min: min_out,
    } = out;
    let qmax = format.qmax();
    match format.scheme {
        Scheme::Symmetric => {
            let absmax = block_absmax(x, block, block_start)?;
            *max_out = absmax;
            let scale = absmax / qmax;
            if scale == 0.0 {
                codes.fill(0);
                return Ok(());
            }
            match rounding {
                Rounding::NearestEven => {
                    write_rounded_codes(format.bits, x, codes, None, |v, _| {
                        // Clamping to integer bounds commutes with rounding.
                        nearest_int((v / scale).clamp(-qmax, qmax))
                    })
                }
                Rounding::Stochastic { seed } => {
                    let mut rng = block_rng(seed, block);
                    write_rounded_codes(format.bits, x, codes, Some(&mut rng), |v, u| {
                        nearest_int(round_stochastic(v / scale, u).clamp(-qmax, qmax))
                    })
                }
            }
        }
        Scheme::Asymmetric => {
            let (min, max) = block_min_max(x, block, block_start)?;
            let scale = (max - min) / qmax;
            if !scale.is_finite() {
                return Err(QuantError::RangeOverflow { block, min, max });
            }
            *max_out = max;
            if let Some(m) = min_out {
                *m = min;
            }
            if scale == 0.0 {
                codes.fill(0);
                return Ok(());
            }
            match rounding {
                Rounding::NearestEven => {
                    write_rounded_codes(format.bits, x, codes, None, |v, _| {
                        nearest_int(((v - min) / scale).clamp(0.0, qmax))
                    })
                }
                Rounding::Stochastic { seed } => {
                    let mut rng = block_rng(seed, block);
                    write_rounded_codes(format.bits, x, codes, Some(&mut rng), |v, u| {
                        nearest_int(round_stochastic((v - min) / scale, u).clamp(0.0, qmax))
                    })
                }
            }
        }
    }
    Ok(())
}

/// Reads the codes of `out.len()` values starting at a byte boundary and
/// hands each dequantized value to `put`. Symmetric codes are signed and
/// `x̂ = (q / qmax) · max`; asymmetric codes are unsigned and
/// `x̂ = (1 − r) · min + r · max` with `r = q / qmax`. Every operation is one
/// correctly rounded f32 operation (never fused), as in the CUDA kernels.
#[inline(always)]
fn read_codes<O, const PER: usize, const SIGNED: bool>(
    codes: &[u8],
    out: &mut [O],
    qmax: f32,
    min: f32,
    max: f32,
    mut put: impl FnMut(&mut O, f32),
) {
    let bits = 8 / PER;
    let value = |byte: u8, k: usize| -> f32 {
        if SIGNED {
            let q = (((byte as u32) << (32 - bits * (k + 1))) as i32) >> (32 - bits);
            (q as f32 / qmax) * max
        } else {
            let q = ((byte as u32 >> (bits * k)) & ((1 << bits) - 1)) as i32;
            let r = q as f32 / qmax;
            (1.0 - r) * min + r * max
        }
    };
    let mut chunks = out.chunks_exact_mut(PER);
    let mut code_iter = codes.iter();
    for (o, &byte) in (&mut chunks).zip(&mut code_iter) {
        for (k, slot) in o.iter_mut().enumerate() {
            put(slot, value(byte, k));
        }
    }
    let rem = chunks.into_remainder();
    if let (false, Some(&byte)) = (rem.is_empty(), code_iter.next()) {
        for (k, o) in rem.iter_mut().enumerate() {
            put(o, value(byte, k));
        }
    }
}

/// Dequantizes the values `[start, start + out.len())` of `q` through `put`.
/// `start` must be a multiple of the format's codes per byte (every block
/// boundary is).
#[inline(always)]
pub(crate) fn dequantize_range<O>(
    q: &QuantizedRef<'_>,
    start: usize,
    out: &mut [O],
    put: impl FnMut(&mut O, f32) + Copy,
) -> Result<(), QuantError> {
    debug_assert_eq!(start % q.format.bits.codes_per_byte(), 0);
    // One loop per format, so that codes per byte are constants.
    match (q.format.bits, q.format.scheme) {
        (Bits::Eight, Scheme::Symmetric) => dequantize_blocks::<O, 1, true>(q, start, out, put),
        (Bits::Four, Scheme::Symmetric) => dequantize_blocks::<O, 2, true>(q, start, out, put),
        (Bits::Two, Scheme::Symmetric) => dequantize_blocks::<O, 4, true>(q, start, out, put),
        (Bits::Eight, Scheme::Asymmetric) => dequantize_blocks::<O, 1, false>(q, start, out, put),
        (Bits::Four, Scheme::Asymmetric) => dequantize_blocks::<O, 2, false>(q, start, out, put),
        (Bits::Two, Scheme::Asymmetric) => dequantize_blocks::<O, 4, false>(q, start, out, put),
    }
}

/// [`dequantize_range`] for one format (`PER` codes per byte, symmetric
/// when `SIGNED`), block by block.
#[inline(always)]
fn dequantize_blocks<O, const PER: usize, const SIGNED: bool>(
    q: &QuantizedRef<'_>,
    start: usize,
    out: &mut [O],
    put: impl FnMut(&mut O, f32) + Copy,
) -> Result<(), QuantError> {
    let format = q.format;
    let qmax = format.qmax();
    let end = start + out.len();
    let mut pos = start;
    while pos < end {
        let b = pos / format.block;
        let block_end = ((b + 1) * format.block).min(end);
        let max = q.block_max[b];
        let (min, valid) = if SIGNED {
            (0.0, max.is_finite() && max >= 0.0)
        } else {
            let min = q.block_min[b];
            (min, min.is_finite() && max.is_finite() && min <= max)
        };
        if !valid {
            return Err(QuantError::CorruptParams { block: b, min, max });
        }
        let codes = &q.codes[pos / PER..block_end.div_ceil(PER)];
        let o = &mut out[pos - start..block_end - start];
        read_codes::<O, PER, SIGNED>(codes, o, qmax, min, max, put);
        pos = block_end;
    }
    Ok(())
}

/// Dequantizes all of `q` into `out` (`out.len()` must equal `q.len`).
pub fn dequantize<T: Element>(q: QuantizedRef<'_>, out: &mut [T]) -> Result<(), QuantError> {
    dequantize_on(Isa::detect(), q, out)
}

/// [`dequantize`] with a chosen instruction set.
pub fn dequantize_on<T: Element>(
    isa: Isa,
    q: QuantizedRef<'_>,
    out: &mut [T],
) -> Result<(), QuantError> {
    q.check_out_len(out.len())?;
    dequantize_range_on(isa, &q, 0, out, |o, v| *o = T::from_f32(v))
}

/// Adds the dequantized values of `q` to `acc` (in f32).
pub fn dequantize_accumulate(q: QuantizedRef<'_>, acc: &mut [f32]) -> Result<(), QuantError> {
    dequantize_accumulate_on(Isa::detect(), q, acc)
}

/// [`dequantize_accumulate`] with a chosen instruction set.
pub fn dequantize_accumulate_on(
    isa: Isa,
    q: QuantizedRef<'_>,
    acc: &mut [f32],
) -> Result<(), QuantError> {
    q.check_out_len(acc.len())?;
    dequantize_range_on(isa, &q, 0, acc, |o, v| *o += v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magic_rounding_is_round_half_even() {
        for i in -40_000..40_000 {
            let v = i as f32 * 0.25 - 0.125 * (i % 3) as f32;
            assert_eq!(round_half_even(v), v.round_ties_even(), "{v}");
        }
        for v in [0.5f32, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.49999] {
            assert_eq!(round_half_even(v), v.round_ties_even(), "{v}");
        }
    }

    #[test]
    fn nearest_int_matches_rint() {
        for i in -4_000_000..4_000_000 {
            let v = i as f32 * 0.0625 + 0.03125 * (i % 2) as f32;
            assert_eq!(nearest_int(v), v.round_ties_even() as i32, "{v}");
        }
    }

    #[test]
    fn order_key_round_trips_and_sorts() {
        let vals = [
            f32::NEG_INFINITY,
            -3.0,
            -1e-40,
            -0.0,
            0.0,
            1e-40,
            2.0,
            f32::INFINITY,
        ];
        for w in vals.windows(2) {
            assert!(order_key(w[0]) < order_key(w[1]), "{} < {}", w[0], w[1]);
        }
        for v in vals {
            assert_eq!(from_order_key(order_key(v)).to_bits(), v.to_bits());
        }
    }

    #[test]
    fn stochastic_rounding_picks_a_neighbour() {
        for (v, u, want) in [
            (1.25f32, 0.0, 1.0),
            (1.25, 0.74, 1.0),
            (1.25, 0.75, 2.0),
            (-1.25, 0.2, -2.0),
            (-1.25, 0.3, -1.0),
            (3.0, 0.999, 3.0),
        ] {
            assert_eq!(round_stochastic(v, u), want, "v={v} u={u}");
        }
    }
}
