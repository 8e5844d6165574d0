//! Quantized tensors: borrowed views (`QuantizedRef`, `QuantizedMut`) that the
//! kernels take, and an owning `QuantizedTensor` that allocates the buffers.

use crate::QuantError;
use crate::element::Element;
use crate::format::{QuantFormat, Rounding};
use crate::kernels;

fn check_size(what: &'static str, expected: usize, found: usize) -> Result<(), QuantError> {
    if expected == found {
        Ok(())
    } else {
        Err(QuantError::SizeMismatch {
            what,
            expected,
            found,
        })
    }
}

/// A read-only quantized tensor of `len` values: packed codes, one f32
/// maximum per block (`max |x|` when symmetric, `max x` when asymmetric) and,
/// for the asymmetric scheme, one f32 minimum per block.
#[derive(Clone, Copy, Debug)]
pub struct QuantizedRef<'a> {
    pub format: QuantFormat,
    pub len: usize,
    pub codes: &'a [u8],
    pub block_max: &'a [f32],
    pub block_min: &'a [f32],
}

impl<'a> QuantizedRef<'a> {
    /// A view over buffers that must have exactly the sizes `format` gives for
    /// `len` values (a truncated buffer is an error, not a short read).
    pub fn new(
        format: QuantFormat,
        len: usize,
        codes: &'a [u8],
        block_max: &'a [f32],
        block_min: &'a [f32],
    ) -> Result<Self, QuantError> {
        check_size("code bytes", format.code_bytes(len), codes.len())?;
        check_size("block maxima", format.num_blocks(len), block_max.len())?;
        check_size("block minima", format.num_block_mins(len), block_min.len())?;
        Ok(QuantizedRef {
            format,
            len,
            codes,
            block_max,
            block_min,
        })
    }

    pub(crate) fn check_out_len(&self, out_len: usize) -> Result<(), QuantError> {
        check_size("output values", self.len, out_len)
    }

    /// Dequantizes into a new vector.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, QuantError> {
        let mut out = vec![T::from_f32(0.0); self.len];
        kernels::dequantize(*self, &mut out)?;
        Ok(out)
    }
}

/// Writable buffers for a quantized tensor of `len` values.
#[derive(Debug)]
pub struct QuantizedMut<'a> {
    pub format: QuantFormat,
    pub len: usize,
    pub codes: &'a mut [u8],
    pub block_max: &'a mut [f32],
    pub block_min: &'a mut [f32],
}

impl<'a> QuantizedMut<'a> {
    /// Buffers that must have exactly the sizes `format` gives for `len`.
    pub fn new(
        format: QuantFormat,
        len: usize,
        codes: &'a mut [u8],
        block_max: &'a mut [f32],
        block_min: &'a mut [f32],
    ) -> Result<Self, QuantError> {
        check_size("code bytes", format.code_bytes(len), codes.len())?;
        check_size("block maxima", format.num_blocks(len), block_max.len())?;
        check_size("block minima", format.num_block_mins(len), block_min.len())?;
        Ok(QuantizedMut {
            format,
            len,
            codes,
            block_max,
            block_min,
        })
    }

    pub(crate) fn check_len(&self, input_len: usize) -> Result<(), QuantError> {
        check_size("input values", self.len, input_len)
    }

    /// A read-only view of the same buffers.
    pub fn as_ref(&self) -> QuantizedRef<'_> {
        QuantizedRef {
            format: self.format,
            len: self.len,
            codes: self.codes,
            block_max: self.block_max,
            block_min: self.block_min,
        }
    }

    /// The same buffers, borrowed for a shorter while.
    pub fn reborrow(&mut self) -> QuantizedMut<'_> {
        QuantizedMut {
            format: self.format,
            len: self.len,
            codes: self.codes,
            block_max: self.block_max,
            block_min: self.block_min,
        }
    }
}

/// An owned quantized tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedTensor {
    pub format: QuantFormat,
    pub len: usize,
    pub codes: Vec<u8>,
    pub block_max: Vec<f32>,
    pub block_min: Vec<f32>,
}

impl QuantizedTensor {
    /// Zeroed buffers for `len` values (dequantizes to zeros).
    pub fn zeroed(format: QuantFormat, len: usize) -> Self {
        QuantizedTensor {
            format,
            len,
            codes: vec![0; format.code_bytes(len)],
            block_max: vec![0.0; format.num_blocks(len)],
            block_min: vec![0.0; format.num_block_mins(len)],
        }
    }

    /// Quantizes `input` into a new tensor.
    pub fn quantize<T: Element>(
        input: &[T],
        format: QuantFormat,
        rounding: Rounding,
    ) -> Result<Self, QuantError> {
        let mut t = Self::zeroed(format, input.len());
        kernels::quantize(input, rounding, t.as_mut())?;
        Ok(t)
    }

    pub fn as_ref(&self) -> QuantizedRef<'_> {
        QuantizedRef {
            format: self.format,
            len: self.len,
            codes: &self.codes,
            block_max: &self.block_max,
            block_min: &self.block_min,
        }
    }

    pub fn as_mut(&mut self) -> QuantizedMut<'_> {
        QuantizedMut {
            format: self.format,
            len: self.len,
            codes: &mut self.codes,
            block_max: &mut self.block_max,
            block_min: &mut self.block_min,
        }
    }

    /// Dequantizes into a new vector.
    pub fn dequantize<T: Element>(&self) -> Result<Vec<T>, QuantError> {
        self.as_ref().to_vec()
    }

    /// Bytes this tensor occupies: codes plus per-block parameters.
    pub fn bytes(&self) -> usize {
        self.format.total_bytes(self.len)
    }
}
