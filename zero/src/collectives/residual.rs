//! qgZ's error-feedback residuals, kept compressed.
//!
//! What a quantization dropped is carried to the next step, so each hop
//! keeps a residual as long as what it quantizes: the first hop the whole
//! unit's gradient (O(Ψ) per rank, where the sharded state is O(Ψ/W)), the
//! second hop the node's partial sums (O(Ψ/G)). As f32 they were most of
//! ZeRO++'s memory above ZeRO-3's (docs/BENCHMARKS.md, memory per rank). A residual is at
//! most half a quantization step of its block, so it is stored as int4
//! blocks of 32 values with one f32 scale each: 0.625 bytes a value instead
//! of 4 (int8 blocks, 1.125, until checkpoint version 5), and its own error
//! — at most 1/14 of the block's largest residual, so under 4% of the
//! gradient's quantization step when it rounds to nearest (under 8% with
//! stochastic rounding, whose residual can reach a whole step) — is second
//! order next to the error it corrects (the loss is measured in docs/TRAINING.md).

use zeropp_quant::{QuantError, QuantFormat, QuantizedChunks, Rounding};

/// Values per block of a stored residual.
pub const BLOCK: usize = 32;

/// `count` chunks of `chunk_len` values (chunks in rank order for the
/// first hop, node order for the second), int4 blocks of [`BLOCK`] within
/// each chunk.
#[derive(Clone, Debug, PartialEq)]
pub struct Residual {
    q: QuantizedChunks,
}

/// The format residuals are kept in, on every backend: int4 blocks of
/// [`BLOCK`] values, rounded to nearest.
pub fn format() -> QuantFormat {
    QuantFormat::int4(BLOCK).expect("int4 blocks of 32 are a valid format")
}

/// The format checkpoints of versions 2 to 4 stored residuals in: int8
/// blocks of [`BLOCK`] values ([`Residual::from_bytes_as`] reads them).
pub fn int8_format() -> QuantFormat {
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
        Residual::stored_bytes_as(format(), chunk_len, count)
    }

    /// Bytes a residual of this shape stored in `f` takes: codes, then one
    /// f32 scale a block.
    pub fn stored_bytes_as(f: QuantFormat, chunk_len: usize, count: usize) -> usize {
        // Saturating: sizes read from a file may be anything.
        count.saturating_mul(f.code_bytes(chunk_len) + 4 * f.num_blocks(chunk_len))
    }

    /// The residual [`Residual::to_bytes`] wrote, of this shape; `None`
    /// when the length is not that shape's or a scale is not finite.
    pub fn from_bytes(chunk_len: usize, count: usize, b: &[u8]) -> Option<Residual> {
        Residual::from_bytes_as(format(), chunk_len, count, b)
    }

    /// A residual stored in `stored` (this build's [`format()`], or an older
    /// checkpoint's [`int8_format`]), of this shape, kept in [`format()`]:
    /// one stored in another format is decoded and stored again (rounded
    /// to nearest). `None` when the length is not that shape's, a scale is
    /// not finite, or `stored` is not symmetric (stored residuals hold one
    /// scale a block, no minimum).
    pub fn from_bytes_as(
        stored: QuantFormat,
        chunk_len: usize,
        count: usize,
        b: &[u8],
    ) -> Option<Residual> {
        let symmetric = stored.scheme == zeropp_quant::Scheme::Symmetric;
        if !symmetric || b.len() != Residual::stored_bytes_as(stored, chunk_len, count) {
            return None;
        }
        let mut q = QuantizedChunks::zeroed(stored, chunk_len, count);
        let (codes, scales) = b.split_at(q.codes.len());
        q.codes.copy_from_slice(codes);
        for (m, s) in q.block_max.iter_mut().zip(scales.chunks_exact(4)) {
            *m = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            if !m.is_finite() || *m < 0.0 {
                return None;
            }
        }
        let read = Residual { q };
        if stored == format() {
            return Some(read);
        }
        Residual::from_f32(chunk_len, count, &read.to_f32()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_residual_keeps_its_values_to_within_a_14th_of_each_block() {
        let (chunk, count) = (100, 3); // chunks that are not whole blocks
        let values: Vec<f32> = (0..chunk * count)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .map(|x| x * 1e-3)
            .collect();
        let r = Residual::from_f32(chunk, count, &values).unwrap();
        assert!(r.bytes() * 6 < values.len() * 4, "{} bytes", r.bytes());
        let back = r.to_f32();
        for p in 0..count {
            for (b, block) in (0..chunk).collect::<Vec<_>>().chunks(BLOCK).enumerate() {
                let span: Vec<usize> = block.iter().map(|i| p * chunk + i).collect();
                let max = span.iter().map(|&i| values[i].abs()).fold(0.0, f32::max);
                for &i in &span {
                    assert!(
                        (back[i] - values[i]).abs() <= max / 14.0 * 1.001,
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

    #[test]
    fn a_residual_an_older_checkpoint_stored_in_int8_is_read_into_int4() {
        let (chunk, count) = (70, 2);
        let values: Vec<f32> = (0..chunk * count)
            .map(|i| (((i * 613) % 200) as f32 - 100.0) * 1e-5)
            .collect();
        // What versions 2 to 4 wrote: int8 blocks of 32, codes then scales.
        let mut old = QuantizedChunks::zeroed(int8_format(), chunk, count);
        for p in 0..count {
            let v = &values[p * chunk..(p + 1) * chunk];
            zeropp_quant::quantize(v, Rounding::NearestEven, old.chunk_mut(p)).unwrap();
        }
        let mut bytes = old.codes.clone();
        old.block_max
            .iter()
            .for_each(|m| bytes.extend_from_slice(&m.to_le_bytes()));
        let read = Residual::from_bytes_as(int8_format(), chunk, count, &bytes).unwrap();
        assert_eq!((read.q.format, read.shape()), (format(), (chunk, count)));
        let mut int8 = vec![0.0; chunk * count];
        Residual { q: old }.add_to(&mut int8).unwrap();
        assert_eq!(read, Residual::from_f32(chunk, count, &int8).unwrap());
        // A length of this build's format is not an int8 one.
        let now = Residual::stored_bytes(chunk, count);
        assert_eq!(
            Residual::from_bytes_as(int8_format(), chunk, count, &bytes[..now]),
            None
        );
        // An asymmetric format (a minimum a block, which is not stored) is
        // refused, not misread.
        let asym = QuantFormat::new(
            zeropp_quant::Bits::Eight,
            zeropp_quant::Scheme::Asymmetric,
            32,
        )
        .unwrap();
        assert_eq!(Residual::from_bytes_as(asym, chunk, count, &bytes), None);
    }
}
