//! The CPU kernels: quantize, dequantize and dequantize-and-accumulate over
//! slices. Each works block by block in two passes (range, then codes) and
//! allocates nothing.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::QuantError;
use crate::element::Element;
use crate::format::{Bits, QuantFormat, Rounding, Scheme};
use crate::tensor::{QuantizedMut, QuantizedRef};

/// Adding then subtracting 1.5·2^23 rounds an f32 of magnitude below 2^22 to
/// the nearest integer, ties to even, under the default rounding mode. It is
/// exactly `rintf` on that range and vectorises without SSE4.1.
const ROUND_MAGIC: f32 = 12_582_912.0;

#[inline(always)]
fn round_half_even(v: f32) -> f32 {
    (v + ROUND_MAGIC) - ROUND_MAGIC
}

/// `floor(v + u)` for `u` in `[0, 1)`, written with compare and select.
#[inline(always)]
fn round_stochastic(v: f32, u: f32) -> f32 {
    let t = v + u;
    let r = round_half_even(t);
    if r > t { r - 1.0 } else { r }
}

/// A uniform draw in `[0, 1)` with 24 random bits (exact in f32).
#[inline(always)]
fn uniform(rng: &mut SmallRng) -> f32 {
    (rng.next_u32() >> 8) as f32 * (1.0 / 16_777_216.0)
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

const LANES: usize = 8;

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
fn block_absmax<T: Element>(x: &[T], block: usize, block_start: usize) -> Result<f32, QuantError> {
    // Magnitude bits compare like the magnitudes; NaN and inf sit at the top.
    let mut lanes = [0u32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for k in 0..LANES {
            lanes[k] = lanes[k].max(c[k].to_f32().to_bits() & 0x7fff_ffff);
        }
    }
    let mut m = lanes.into_iter().max().unwrap_or(0);
    for v in chunks.remainder() {
        m = m.max(v.to_f32().to_bits() & 0x7fff_ffff);
    }
    if m >= 0x7f80_0000 {
        return Err(first_non_finite(x, block, block_start));
    }
    Ok(f32::from_bits(m))
}

/// `(min, max)` of a block, or the first non-finite value as an error.
fn block_min_max<T: Element>(
    x: &[T],
    block: usize,
    block_start: usize,
) -> Result<(f32, f32), QuantError> {
    let mut lo = [i32::MAX; LANES];
    let mut hi = [i32::MIN; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for k in 0..LANES {
            let key = order_key(c[k].to_f32());
            lo[k] = lo[k].min(key);
            hi[k] = hi[k].max(key);
        }
    }
    let mut min_key = lo.into_iter().min().unwrap_or(i32::MAX);
    let mut max_key = hi.into_iter().max().unwrap_or(i32::MIN);
    for v in chunks.remainder() {
        let key = order_key(v.to_f32());
        min_key = min_key.min(key);
        max_key = max_key.max(key);
    }
    if max_key >= order_key(f32::INFINITY) || min_key <= order_key(f32::NEG_INFINITY) {
        return Err(first_non_finite(x, block, block_start));
    }
    Ok((from_order_key(min_key), from_order_key(max_key)))
}

/// Writes the codes of one block, `PER` codes per byte, low bits first.
/// `code` maps a value (and its index in the block) to its integer code.
#[inline(always)]
fn write_codes<T: Element, const PER: usize>(
    x: &[T],
    out: &mut [u8],
    mut code: impl FnMut(f32) -> i32,
) {
    let bits = 8 / PER;
    let mask = (1u32 << bits) - 1;
    let mut chunks = x.chunks_exact(PER);
    let mut out_iter = out.iter_mut();
    for (c, o) in (&mut chunks).zip(&mut out_iter) {
        let mut byte = 0u32;
        for (k, v) in c.iter().enumerate() {
            byte |= ((code(v.to_f32()) as u32) & mask) << (k * bits);
        }
        *o = byte as u8;
    }
    let rem = chunks.remainder();
    if !rem.is_empty() {
        let mut byte = 0u32;
        for (k, v) in rem.iter().enumerate() {
            byte |= ((code(v.to_f32()) as u32) & mask) << (k * bits);
        }
        if let Some(o) = out_iter.next() {
            *o = byte as u8;
        }
    }
}

fn write_block_codes<T: Element>(
    bits: Bits,
    x: &[T],
    out: &mut [u8],
    code: impl FnMut(f32) -> i32,
) {
    match bits {
        Bits::Eight => write_codes::<T, 1>(x, out, code),
        Bits::Four => write_codes::<T, 2>(x, out, code),
        Bits::Two => write_codes::<T, 4>(x, out, code),
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
    out.check_len(input.len())?;
    let QuantizedMut {
        format,
        codes,
        block_max,
        block_min,
        ..
    } = out;
    let per_block_bytes = format.code_bytes(format.block);
    for (b, x) in input.chunks(format.block).enumerate() {
        let start = b * format.block;
        let code_out = &mut codes[b * per_block_bytes..][..format.code_bytes(x.len())];
        quantize_block(
            x,
            &format,
            rounding,
            b,
            start,
            code_out,
            &mut block_max[b],
            block_min.get_mut(b),
        )?;
    }
    Ok(())
}

/// Quantizes one block; `min_out` is `None` for the symmetric scheme.
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantize_block<T: Element>(
    x: &[T],
    format: &QuantFormat,
    rounding: Rounding,
    block: usize,
    block_start: usize,
    codes: &mut [u8],
    max_out: &mut f32,
    min_out: Option<&mut f32>,
) -> Result<(), QuantError> {
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
                Rounding::NearestEven => write_block_codes(format.bits, x, codes, |v| {
                    round_half_even(v / scale).clamp(-qmax, qmax) as i32
                }),
                Rounding::Stochastic { seed } => {
                    let mut rng = block_rng(seed, block);
                    write_block_codes(format.bits, x, codes, |v| {
                        round_stochastic(v / scale, uniform(&mut rng)).clamp(-qmax, qmax) as i32
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
                Rounding::NearestEven => write_block_codes(format.bits, x, codes, |v| {
                    round_half_even((v - min) / scale).clamp(0.0, qmax) as i32
                }),
                Rounding::Stochastic { seed } => {
                    let mut rng = block_rng(seed, block);
                    write_block_codes(format.bits, x, codes, |v| {
                        round_stochastic((v - min) / scale, uniform(&mut rng)).clamp(0.0, qmax)
                            as i32
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
pub(crate) fn dequantize_range<O>(
    q: &QuantizedRef<'_>,
    start: usize,
    out: &mut [O],
    put: impl FnMut(&mut O, f32) + Copy,
) -> Result<(), QuantError> {
    let format = q.format;
    let qmax = format.qmax();
    let per_byte = format.bits.codes_per_byte();
    debug_assert_eq!(start % per_byte, 0);
    let end = start + out.len();
    let mut pos = start;
    while pos < end {
        let b = pos / format.block;
        let block_end = ((b + 1) * format.block).min(end);
        let max = q.block_max[b];
        let (min, valid) = match format.scheme {
            Scheme::Symmetric => (0.0, max.is_finite() && max >= 0.0),
            Scheme::Asymmetric => {
                let min = q.block_min[b];
                (min, min.is_finite() && max.is_finite() && min <= max)
            }
        };
        if !valid {
            return Err(QuantError::CorruptParams { block: b, min, max });
        }
        let codes = &q.codes[pos / per_byte..block_end.div_ceil(per_byte)];
        let o = &mut out[pos - start..block_end - start];
        match (format.bits, format.scheme) {
            (Bits::Eight, Scheme::Symmetric) => {
                read_codes::<O, 1, true>(codes, o, qmax, min, max, put)
            }
            (Bits::Four, Scheme::Symmetric) => {
                read_codes::<O, 2, true>(codes, o, qmax, min, max, put)
            }
            (Bits::Two, Scheme::Symmetric) => {
                read_codes::<O, 4, true>(codes, o, qmax, min, max, put)
            }
            (Bits::Eight, Scheme::Asymmetric) => {
                read_codes::<O, 1, false>(codes, o, qmax, min, max, put)
            }
            (Bits::Four, Scheme::Asymmetric) => {
                read_codes::<O, 2, false>(codes, o, qmax, min, max, put)
            }
            (Bits::Two, Scheme::Asymmetric) => {
                read_codes::<O, 4, false>(codes, o, qmax, min, max, put)
            }
        }
        pos = block_end;
    }
    Ok(())
}

/// Dequantizes all of `q` into `out` (`out.len()` must equal `q.len`).
pub fn dequantize<T: Element>(q: QuantizedRef<'_>, out: &mut [T]) -> Result<(), QuantError> {
    q.check_out_len(out.len())?;
    dequantize_range(&q, 0, out, |o, v| *o = T::from_f32(v))
}

/// Adds the dequantized values of `q` to `acc` (in f32).
pub fn dequantize_accumulate(q: QuantizedRef<'_>, acc: &mut [f32]) -> Result<(), QuantError> {
    q.check_out_len(acc.len())?;
    dequantize_range(&q, 0, acc, |o, v| *o += v)
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
