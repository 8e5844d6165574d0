//! How a chunk of weights or gradients is laid out in a message: bf16 values,
//! or a quantized tensor as codes, then block maxima, then block minima (f32,
//! little-endian). Decoding checks the length against the plan, so a
//! truncated or foreign message is an error naming what was expected.

use bytes::Bytes;
use half::bf16;
use zeropp_quant::{Element, QuantFormat, QuantizedChunks, QuantizedRef};

use zeropp_comm::CommError;

use zeropp_comm::scratch::{self, Returned};

fn malformed(what: &str, expected: usize, found: usize) -> CommError {
    CommError::Malformed(format!(
        "{what}: expected {expected} bytes, found {found}; the ranks disagree on the model \
         or the plan (run every rank with the same flags and build), or called different \
         collectives (a parameter that got a gradient on some ranks only, a module run on \
         some ranks only: every rank runs the same modules each step)"
    ))
}

/// Values (any element type, widened to f32) → bf16 bytes, round to
/// nearest even, little-endian (`to_le` is a no-op on little-endian hosts).
/// Written as one pass over the values, a word each (appending two bytes
/// at a time was a tenth of a one-rank step of the 3.76M model). The bytes
/// are a reused buffer ([`scratch`]) until the transport lets go of them.
pub fn encode_bf16<T: Element>(x: &[T]) -> Bytes {
    let mut words = scratch::take_for_overwrite::<u16>(x.len());
    for (w, v) in words.iter_mut().zip(x) {
        *w = <bf16 as Element>::from_f32(v.to_f32()).to_bits().to_le();
    }
    Bytes::from_owner(Returned(words))
}

/// Chunks `chunks` of `x` (each `chunk` values long), one after another,
/// as [`encode_bf16`] encodes them: one message. A bf16 tensor's own bytes
/// are copied as they are (the same words). A value that is not finite is
/// refused, with its index in `x` and its value: nothing quantizes what
/// travels so, which would have found it.
pub fn encode_bf16_chunks<T: Element + bytemuck::Pod>(
    x: &[T],
    chunk: usize,
    chunks: impl Iterator<Item = usize> + Clone,
) -> Result<Bytes, (usize, f32)> {
    let count = chunks.clone().count();
    let mut words = scratch::take_for_overwrite::<u16>(count * chunk);
    let raw = std::mem::size_of::<T>() == 2 && T::NAME == "BF16";
    for (out, c) in words.chunks_exact_mut(chunk.max(1)).zip(chunks) {
        let from = &x[c * chunk..(c + 1) * chunk];
        if let Some((i, value)) = first_non_finite(from) {
            scratch::give(words);
            return Err((c * chunk + i, value));
        }
        if raw && cfg!(target_endian = "little") {
            out.copy_from_slice(bytemuck::cast_slice(from));
        } else {
            for (w, v) in out.iter_mut().zip(from) {
                *w = <bf16 as Element>::from_f32(v.to_f32()).to_bits().to_le();
            }
        }
    }
    Ok(Bytes::from_owner(Returned(words)))
}

/// The first value of `x` that is not finite (a NaN or an infinity), with
/// its index: read on each word's exponent bits, a run at a time (a pass
/// the compiler vectorises), then the run that has one searched.
pub fn first_non_finite<T: Element + bytemuck::Pod>(x: &[T]) -> Option<(usize, f32)> {
    fn find<W: Copy + std::ops::BitAnd<Output = W> + PartialEq>(
        words: &[W],
        exponent: W,
    ) -> Option<usize> {
        const RUN: usize = 256;
        let bad = |w: W| w & exponent == exponent;
        words.chunks(RUN).enumerate().find_map(|(r, run)| {
            run.iter()
                .fold(false, |any, &w| any | bad(w))
                .then(|| r * RUN + run.iter().position(|&w| bad(w)).unwrap_or(0))
        })
    }
    let at = match (std::mem::size_of::<T>(), T::NAME) {
        (4, "F32") => find::<u32>(bytemuck::cast_slice(x), 0x7f80_0000),
        (2, "BF16") => find::<u16>(bytemuck::cast_slice(x), 0x7f80),
        (2, "F16") => find::<u16>(bytemuck::cast_slice(x), 0x7c00),
        _ => x.iter().position(|v| !v.to_f32().is_finite()),
    };
    at.map(|i| (i, x[i].to_f32()))
}

/// Little-endian bf16 bytes widened and added to `out` (f32).
pub fn add_bf16(b: &[u8], out: &mut [f32]) -> Result<(), CommError> {
    widen_bf16(b, out, |o, v| *o += v)
}

/// Values (any element type) → little-endian f32 bytes.
pub fn encode_f32<T: Element>(x: &[T]) -> Bytes {
    let mut words = scratch::take_for_overwrite::<u32>(x.len());
    for (w, v) in words.iter_mut().zip(x) {
        *w = v.to_f32().to_bits().to_le();
    }
    Bytes::from_owner(Returned(words))
}

/// bf16 bytes → f32, written into `out`.
pub fn decode_bf16(b: &[u8], out: &mut [f32]) -> Result<(), CommError> {
    widen_bf16(b, out, |o, v| *o = v)
}

/// Each little-endian bf16 of `b` widened to f32 and put into its place of
/// `out` by `put`.
fn widen_bf16(b: &[u8], out: &mut [f32], put: impl Fn(&mut f32, f32)) -> Result<(), CommError> {
    if b.len() != out.len() * 2 {
        return Err(malformed("bf16 chunk", out.len() * 2, b.len()));
    }
    for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
        put(
            o,
            f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16),
        );
    }
    Ok(())
}

/// Little-endian f32 bytes → f32, written into `out`.
pub fn decode_f32(b: &[u8], out: &mut [f32]) -> Result<(), CommError> {
    if b.len() != out.len() * 4 {
        return Err(malformed("f32 chunk", out.len() * 4, b.len()));
    }
    for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    Ok(())
}

/// Chunks `range` of `q` as one message: their codes, then their block
/// maxima, then their minima (each part of a run of chunks is contiguous in
/// `q`, whatever the chunk length).
pub fn encode_chunks(q: &QuantizedChunks, range: std::ops::Range<usize>) -> Bytes {
    let (c, s, m) = q.strides();
    let parts: [&[u8]; 3] = [
        &q.codes[range.start * c..range.end * c],
        bytemuck::cast_slice(&q.block_max[range.start * s..range.end * s]),
        bytemuck::cast_slice(&q.block_min[range.start * m..range.end * m]),
    ];
    let mut b = scratch::take_for_overwrite::<u8>(parts.iter().map(|p| p.len()).sum());
    let mut at = 0;
    for p in parts {
        b[at..at + p.len()].copy_from_slice(p);
        at += p.len();
    }
    Bytes::from_owner(Returned(b))
}

/// A message of [`encode_chunks`] read where it lies: its codes, and its
/// scales as f32 (borrowed from the message where its bytes are aligned
/// for them on a little-endian host, else decoded into a reused buffer).
pub struct ChunksMessage<'a> {
    format: QuantFormat,
    chunk_len: usize,
    /// Bytes of codes, scales and minima a chunk.
    strides: (usize, usize, usize),
    codes: &'a [u8],
    block_max: Scales<'a>,
    block_min: Scales<'a>,
}

enum Scales<'a> {
    Borrowed(&'a [f32]),
    Decoded(Returned<f32>),
}

impl Scales<'_> {
    fn as_slice(&self) -> &[f32] {
        match self {
            Scales::Borrowed(s) => s,
            Scales::Decoded(v) => &v.0,
        }
    }
}

impl<'a> ChunksMessage<'a> {
    /// Message `b`, which must hold `count` chunks of `chunk_len` values in
    /// `format`: a message of another length is an error naming both.
    pub fn read(
        b: &'a [u8],
        format: QuantFormat,
        chunk_len: usize,
        count: usize,
    ) -> Result<Self, CommError> {
        let (c, s, m) = (
            format.code_bytes(chunk_len),
            format.num_blocks(chunk_len),
            format.num_block_mins(chunk_len),
        );
        let expected = count * (c + 4 * (s + m));
        if b.len() != expected {
            return Err(malformed("quantized chunks", expected, b.len()));
        }
        let (codes, scales) = b.split_at(count * c);
        let (max, min) = scales.split_at(count * s * 4);
        let f32s = |x: &'a [u8]| match bytemuck::try_cast_slice::<u8, f32>(x) {
            Ok(v) if cfg!(target_endian = "little") => Scales::Borrowed(v),
            _ => {
                let mut v = scratch::take_for_overwrite::<f32>(x.len() / 4);
                read_f32s(x, &mut v);
                Scales::Decoded(Returned(v))
            }
        };
        Ok(ChunksMessage {
            format,
            chunk_len,
            strides: (c, s, m),
            codes,
            block_max: f32s(max),
            block_min: f32s(min),
        })
    }

    /// Chunk `i` of the message.
    pub fn chunk(&self, i: usize) -> QuantizedRef<'_> {
        let (c, s, m) = self.strides;
        QuantizedRef {
            format: self.format,
            len: self.chunk_len,
            codes: &self.codes[i * c..][..c],
            block_max: &self.block_max.as_slice()[i * s..][..s],
            block_min: &self.block_min.as_slice()[i * m..][..m],
        }
    }
}

fn read_f32s(b: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

/// The inverse of [`encode_chunks`]: message `b` written into chunks
/// `range` of `out` (whose format and chunk length say what the message
/// must hold). A message of another length is an error naming both.
pub fn decode_chunks_into(
    b: &[u8],
    out: &mut QuantizedChunks,
    range: std::ops::Range<usize>,
) -> Result<(), CommError> {
    if range.end > out.count {
        let expected = range.len() * out.format.total_bytes(out.chunk_len);
        return Err(malformed("quantized chunks", expected, b.len()));
    }
    let message = ChunksMessage::read(b, out.format, out.chunk_len, range.len())?;
    for (i, to) in range.enumerate() {
        let (from, into) = (message.chunk(i), out.chunk_mut(to));
        into.codes.copy_from_slice(from.codes);
        into.block_max.copy_from_slice(from.block_max);
        into.block_min.copy_from_slice(from.block_min);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use zeropp_quant::{QuantFormat, Rounding};

    #[test]
    fn the_first_value_that_is_not_finite_is_found_in_every_element_type() {
        fn check<T: Element + bytemuck::Pod>() {
            let x: Vec<T> = (0..1000)
                .map(|i| T::from_f32(i as f32 * 0.5 - 7.0))
                .collect();
            assert_eq!(first_non_finite(&x), None, "{}", T::NAME);
            for (at, bad) in [
                (0, f32::NAN),
                (255, f32::INFINITY),
                (256, f32::NEG_INFINITY),
                (999, f32::NAN),
            ] {
                let mut y = x.clone();
                y[at] = T::from_f32(bad);
                y[(at + 300) % 1000] = T::from_f32(f32::NAN);
                let first = at.min((at + 300) % 1000);
                let (i, v) = first_non_finite(&y).expect("a value that is not finite");
                assert_eq!(i, first, "{}", T::NAME);
                assert!(!v.is_finite(), "{}", T::NAME);
            }
            // The largest finite values are finite.
            let big = vec![T::from_f32(6e4); 300];
            assert_eq!(first_non_finite(&big), None, "{}", T::NAME);
        }
        check::<f32>();
        check::<half::bf16>();
        check::<half::f16>();
    }

    #[test]
    fn messages_round_trip_and_wrong_lengths_are_errors() {
        let x: Vec<f32> = (0..3 * 300).map(|i| (i as f32 * 0.37).sin()).collect();
        // Chunks of 300 values: not whole blocks of 256.
        let f = QuantFormat::int4(256).unwrap();
        let mut q = QuantizedChunks::zeroed(f, 300, 3);
        zeropp_quant::quantize_swizzled(&x, 3, 1, Rounding::NearestEven, &mut q).unwrap();
        let m = encode_chunks(&q, 1..3);
        assert_eq!(m.len(), 2 * f.total_bytes(300));
        let mut back = QuantizedChunks::zeroed(f, 300, 3);
        decode_chunks_into(&m, &mut back, 1..3).unwrap();
        assert_eq!(
            (&back.codes[150..], &back.block_max[2..]),
            (&q.codes[150..], &q.block_max[2..])
        );
        assert!(
            back.codes[..150].iter().all(|&c| c == 0),
            "chunk 0 untouched"
        );
        assert!(decode_chunks_into(&m[..m.len() - 1], &mut back, 1..3).is_err());
        assert!(decode_chunks_into(&m, &mut back, 2..4).is_err());
        // Read where it lies, at an aligned and an unaligned address: the
        // chunks as they were encoded.
        let mut shifted = vec![0u8; m.len() + 1];
        shifted[1..].copy_from_slice(&m);
        for b in [&m[..], &shifted[1..]] {
            let read = ChunksMessage::read(b, f, 300, 2).unwrap();
            for i in 0..2 {
                let (got, sent) = (read.chunk(i), q.chunk(i + 1));
                assert_eq!(
                    (got.codes, got.block_max, got.block_min),
                    (sent.codes, sent.block_max, sent.block_min)
                );
            }
        }
        let e = ChunksMessage::read(&m[..m.len() - 1], f, 300, 2)
            .err()
            .unwrap();
        assert!(e.to_string().contains("quantized chunks: expected"), "{e}");
        let x: Vec<f32> = x[..512].to_vec();
        let b = encode_bf16(&x);
        let mut back = vec![0.0; 512];
        decode_bf16(&b, &mut back).unwrap();
        assert!(x.iter().zip(&back).all(|(a, b)| (a - b).abs() < 0.01));
        assert!(decode_bf16(&b[1..], &mut back).is_err());
    }

    #[test]
    fn bf16_bytes_are_halfs_rounding_in_little_endian() {
        let mut x = vec![
            0.0,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x3f80_8000), // a tie: rounds to even (down)
            f32::from_bits(0x3f81_8000), // a tie: rounds to even (up)
        ];
        x.extend((0..5000).map(|i| (i as f32 * 0.731).sin() * 10f32.powi(i % 9 - 4)));
        let b = encode_bf16(&x);
        assert_eq!(b.len(), 2 * x.len());
        for (v, c) in x.iter().zip(b.chunks_exact(2)) {
            let want = bf16::from_f32(*v).to_bits().to_le_bytes();
            if v.is_nan() {
                assert!(bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).is_nan());
            } else {
                assert_eq!(c, want, "{v:e}");
            }
        }
    }
}
