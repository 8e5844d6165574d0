//! How a chunk of weights or gradients is laid out in a message: bf16 values,
//! or a quantized tensor as codes, then block maxima, then block minima (f32,
//! little-endian). Decoding checks the length against the plan, so a
//! truncated or foreign message is an error naming what was expected.

use bytes::{Bytes, BytesMut};
use half::bf16;
use zeropp_quant::{
    Element, QuantFormat, QuantizedChunks, QuantizedRef, QuantizedTensor, Rounding,
};

use crate::comm::CommError;

fn malformed(what: &str, expected: usize, found: usize) -> CommError {
    CommError::Malformed(format!(
        "{what}: expected {expected} bytes, found {found}; the ranks disagree on the model \
         or the plan (run every rank with the same flags and build)"
    ))
}

/// Values whose bytes are the message, without a copy into a byte buffer.
struct Words<T>(Vec<T>);

impl<T: bytemuck::Pod> AsRef<[u8]> for Words<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// Values (any element type, widened to f32) → bf16 bytes, round to
/// nearest even, little-endian (`to_le` is a no-op on little-endian hosts).
/// Written as one map over the values so that it vectorises (appending two
/// bytes at a time did not: it was a tenth of a one-rank step of the 3.76M
/// model).
pub fn encode_bf16<T: Element>(x: &[T]) -> Bytes {
    let words: Vec<u16> = x
        .iter()
        .map(|v| <bf16 as Element>::from_f32(v.to_f32()).to_bits().to_le())
        .collect();
    Bytes::from_owner(Words(words))
}

/// Values (any element type) → little-endian f32 bytes.
pub fn encode_f32<T: Element>(x: &[T]) -> Bytes {
    let words: Vec<u32> = x.iter().map(|v| v.to_f32().to_bits().to_le()).collect();
    Bytes::from_owner(Words(words))
}

/// bf16 bytes → f32, written into `out`.
pub fn decode_bf16(b: &[u8], out: &mut [f32]) -> Result<(), CommError> {
    if b.len() != out.len() * 2 {
        return Err(malformed("bf16 chunk", out.len() * 2, b.len()));
    }
    for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
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

fn put_params(b: &mut BytesMut, codes: &[u8], max: &[f32], min: &[f32]) {
    b.extend_from_slice(codes);
    b.extend_from_slice(bytemuck::cast_slice(max));
    b.extend_from_slice(bytemuck::cast_slice(min));
}

/// A quantized tensor as one message.
pub fn encode_quantized(q: &QuantizedTensor) -> Bytes {
    let mut b = BytesMut::with_capacity(q.bytes());
    put_params(&mut b, &q.codes, &q.block_max, &q.block_min);
    b.freeze()
}

/// Positions `range` of swizzled chunks as one message (codes of every chunk,
/// then their maxima, then their minima: the layout of one tensor when chunks
/// are whole blocks).
pub fn encode_chunks(q: &QuantizedChunks, range: std::ops::Range<usize>) -> Bytes {
    let (c, s, m) = q.strides();
    let mut b = BytesMut::with_capacity(range.len() * (c + 4 * (s + m)));
    put_params(
        &mut b,
        &q.codes[range.start * c..range.end * c],
        &q.block_max[range.start * s..range.end * s],
        &q.block_min[range.start * m..range.end * m],
    );
    b.freeze()
}

/// A decoded quantized message: owns the f32 parameters (copied out for
/// alignment) and borrows the codes.
pub struct Decoded<'a> {
    format: QuantFormat,
    len: usize,
    codes: &'a [u8],
    block_max: Vec<f32>,
    block_min: Vec<f32>,
}

impl<'a> Decoded<'a> {
    /// Cuts a message of `count` equal chunks, each whole blocks and whole
    /// code bytes, into its chunks.
    pub fn split(self, count: usize) -> Result<Vec<Decoded<'a>>, CommError> {
        let len = self.len / count.max(1);
        let (c, s, m) = (
            self.format.code_bytes(len),
            self.format.num_blocks(len),
            self.format.num_block_mins(len),
        );
        if count == 0 || len * count != self.len || c * count != self.codes.len() {
            return Err(CommError::Malformed(format!(
                "a quantized message of {} values does not split into {count} whole chunks",
                self.len
            )));
        }
        let codes = self.codes;
        Ok((0..count)
            .map(|i| Decoded {
                format: self.format,
                len,
                codes: &codes[i * c..(i + 1) * c],
                block_max: self.block_max[i * s..(i + 1) * s].to_vec(),
                block_min: self.block_min[i * m..(i + 1) * m].to_vec(),
            })
            .collect())
    }

    pub fn view(&self) -> QuantizedRef<'_> {
        QuantizedRef {
            format: self.format,
            len: self.len,
            codes: self.codes,
            block_max: &self.block_max,
            block_min: &self.block_min,
        }
    }
}

/// Reads a message holding `len` values quantized in `format`.
pub fn decode_quantized<'a>(
    b: &'a [u8],
    format: QuantFormat,
    len: usize,
) -> Result<Decoded<'a>, CommError> {
    let expected = format.total_bytes(len);
    if b.len() != expected {
        return Err(malformed("quantized chunk", expected, b.len()));
    }
    let nc = format.code_bytes(len);
    let ns = format.num_blocks(len) * 4;
    let to_f32 = |s: &[u8]| -> Vec<f32> {
        s.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    Ok(Decoded {
        format,
        len,
        codes: &b[..nc],
        block_max: to_f32(&b[nc..nc + ns]),
        block_min: to_f32(&b[nc + ns..]),
    })
}

/// Quantizes `x` (round to nearest) into one message.
pub fn quantize_message<T: Element>(x: &[T], format: QuantFormat) -> Result<Bytes, CommError> {
    let q = QuantizedTensor::quantize(x, format, Rounding::NearestEven)
        .map_err(|e| CommError::Invalid(e.to_string()))?;
    Ok(encode_quantized(&q))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_wrong_lengths_are_errors() {
        let x: Vec<f32> = (0..512).map(|i| (i as f32 * 0.37).sin()).collect();
        let f = QuantFormat::int8(256).unwrap();
        let m = quantize_message(&x, f).unwrap();
        assert_eq!(m.len(), 512 + 8);
        let d = decode_quantized(&m, f, 512).unwrap();
        let y: Vec<f32> = d.view().to_vec().unwrap();
        assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() < 0.01));
        assert!(decode_quantized(&m[..m.len() - 1], f, 512).is_err());
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
