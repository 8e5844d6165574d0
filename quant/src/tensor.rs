//! The owning `QuantizedTensor`, which allocates its buffers, and the
//! conveniences of the views (`super::views`) built on the kernels.

use crate::QuantError;
use crate::element::Element;
use crate::format::{QuantFormat, Rounding};
use crate::kernels;
use crate::views::{QuantizedMut, QuantizedRef};

impl QuantizedRef<'_> {
    /// Dequantizes into a new vector.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, QuantError> {
        let mut out = vec![T::from_f32(0.0); self.len];
        kernels::dequantize(*self, &mut out)?;
        Ok(out)
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
