//! qgZ's error-feedback residuals, kept compressed.
//!
//! What a quantization dropped is carried to the next step, so each hop
//! keeps a residual as long as what it quantizes: the first hop the whole
//! unit's gradient (O(Ψ) per rank, where the sharded state is O(Ψ/W)), the
//! second hop the node's partial sums (O(Ψ/G)). As f32 they were most of
//! ZeRO++'s memory above ZeRO-3's (docs/BENCHMARKS.md, memory per rank). A residual is at
//! most half a quantization step of its block, so it is stored as int8
//! blocks of 32 values with one f32 scale each: 1.125 bytes a value instead
//! of 4, and its own error — at most 1/254 of the block's largest residual —
//! is second order next to the gradient's quantization error it corrects.

use zeropp_quant::{QuantError, QuantFormat, QuantizedChunks, Rounding};

/// Values per block of a stored residual.
pub const BLOCK: usize = 32;

/// `count` chunks of `chunk_len` values (chunks in rank order for the
/// first hop, node order for the second), int8 blocks within each chunk.
#[derive(Clone, Debug, PartialEq)]
pub struct Residual {
    q: QuantizedChunks,
}

/// The format residuals are kept in, on every backend: int8 blocks of
/// [`BLOCK`] values, rounded to nearest.
pub fn format() -> QuantFormat {
    QuantFormat::int8(BLOCK).expect("int8 blocks of 32 are a valid format")
}

impl Default for Residual {
    fn default() -> Residual {
        Residual::none()
    }
}

impl Residual {
    /// Zeros for `count` chunks of `chunk_len` values.
    pub fn zeros(chunk_len: usize, count: usize) -> Residual {
        Residual {
            q: QuantizedChunks::zeroed(format(), chunk_len, count),
        }
    }

    /// No residual (error feedback off).
    pub fn none() -> Residual {
        Residual::zeros(0, 0)
    }

    /// Values held (0 without error feedback).
    pub fn len(&self) -> usize {
        self.q.chunk_len * self.q.count
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape: `(chunk_len, count)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.q.chunk_len, self.q.count)
    }

    /// Bytes held: codes and block scales.
    pub fn bytes(&self) -> usize {
        self.q.codes.len() + 4 * (self.q.block_max.len() + self.q.block_min.len())
    }

    /// The stored chunks, for the collectives that add and replace them
    /// (`zero::qgz`); of another shape they start over from zeros there.
    pub fn chunks_mut(&mut self) -> &mut QuantizedChunks {
        &mut self.q
    }

    /// Back to zeros (after a skipped step, whose residual may hold a NaN).
    pub fn reset(&mut self) {
        self.q.codes.iter_mut().for_each(|c| *c = 0);
        self.q.block_max.iter_mut().for_each(|m| *m = 0.0);
    }

    /// `out += chunk p`.
    pub fn add_chunk_to(&self, p: usize, out: &mut [f32]) -> Result<(), QuantError> {
        zeropp_quant::dequantize_accumulate(self.q.chunk(p), out)
    }

    /// `out += every chunk`, back to back.
    pub fn add_to(&self, out: &mut [f32]) -> Result<(), QuantError> {
        let n = self.q.chunk_len;
        for p in 0..self.q.count {
            self.add_chunk_to(p, &mut out[p * n..(p + 1) * n])?;
        }
        Ok(())
    }

    /// Chunk `p` becomes `values` (rounded to nearest).
    pub fn store_chunk(&mut self, p: usize, values: &[f32]) -> Result<(), QuantError> {
        zeropp_quant::quantize(values, Rounding::NearestEven, self.q.chunk_mut(p))
    }

    /// The residual as f32 values (chunks back to back).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.add_to(&mut out)
            .expect("a residual's own chunks dequantize into their own lengths");
        out
    }

    /// A residual holding `values`, `count` chunks of `chunk_len` (from a
    /// checkpoint that stored them as f32).
    pub fn from_f32(
        chunk_len: usize,
        count: usize,
        values: &[f32],
    ) -> Result<Residual, QuantError> {
        let mut r = Residual::zeros(chunk_len, count);
        if values.len() != r.len() {
            return Err(QuantError::SizeMismatch {
                what: "residual",
                expected: r.len(),
                found: values.len(),
            });
        }
        for p in 0..count {
            r.store_chunk(p, &values[p * chunk_len..(p + 1) * chunk_len])?;
        }
        Ok(r)
    }

    /// Raw storage for checkpoints: codes, then block scales (f32 LE).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = self.q.codes.clone();
        for m in &self.q.block_max {
            out.extend_from_slice(&m.to_le_bytes());
        }
        out
    }

    /// Bytes [`Residual::to_bytes`] writes for this shape.
    pub fn stored_bytes(chunk_len: usize, count: usize) -> usize {
        let f = format();
        count * (f.code_bytes(chunk_len) + 4 * f.num_blocks(chunk_len))
    }

    /// The residual [`Residual::to_bytes`] wrote, of this shape; `None`
    /// when the length is not that shape's or a scale is not finite.
    pub fn from_bytes(chunk_len: usize, count: usize, b: &[u8]) -> Option<Residual> {
        if b.len() != Residual::stored_bytes(chunk_len, count) {
            return None;
        }
        let mut r = Residual::zeros(chunk_len, count);
        let (codes, scales) = b.split_at(r.q.codes.len());
        r.q.codes.copy_from_slice(codes);
        for (m, s) in r.q.block_max.iter_mut().zip(scales.chunks_exact(4)) {
            *m = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            if !m.is_finite() || *m < 0.0 {
                return None;
            }
        }
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_residual_keeps_its_values_to_within_a_254th_of_each_block() {
        let (chunk, count) = (100, 3); // chunks that are not whole blocks
        let values: Vec<f32> = (0..chunk * count)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .map(|x| x * 1e-3)
            .collect();
        let r = Residual::from_f32(chunk, count, &values).unwrap();
        assert!(r.bytes() * 3 < values.len() * 4, "{} bytes", r.bytes());
        let back = r.to_f32();
        for p in 0..count {
            for (b, block) in (0..chunk).collect::<Vec<_>>().chunks(BLOCK).enumerate() {
                let span: Vec<usize> = block.iter().map(|i| p * chunk + i).collect();
                let max = span.iter().map(|&i| values[i].abs()).fold(0.0, f32::max);
                for &i in &span {
                    assert!(
                        (back[i] - values[i]).abs() <= max / 254.0 * 1.001,
                        "chunk {p} block {b}: {} vs {}",
                        back[i],
                        values[i]
                    );
                }
            }
        }
        // Stored and read back bit for bit; a wrong length or a bad scale
        // is refused.
        let bytes = r.to_bytes();
        assert_eq!(Residual::from_bytes(chunk, count, &bytes), Some(r.clone()));
        assert_eq!(Residual::from_bytes(chunk, count, &bytes[1..]), None);
        let mut bad = bytes.clone();
        let at = bad.len() - 4;
        bad[at..].copy_from_slice(&f32::NAN.to_le_bytes());
        assert_eq!(Residual::from_bytes(chunk, count, &bad), None);
        // add_to accumulates; reset zeroes.
        let mut acc = vec![0.25; chunk * count];
        r.add_to(&mut acc).unwrap();
        assert!((acc[5] - 0.25 - back[5]).abs() < 1e-7);
        let mut z = r;
        z.reset();
        assert!(z.to_f32().iter().all(|&x| x == 0.0));
    }
}
