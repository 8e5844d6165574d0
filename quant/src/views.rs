//! Borrowed views of quantized tensors (`QuantizedRef`, `QuantizedMut`):
//! what the kernels take. A leaf of the crate: the owning
//! `QuantizedTensor` (`super::tensor`) is built on the kernels.

use crate::QuantError;
use crate::format::QuantFormat;

/// `found` values (or bytes) of `what` where `expected` were due.
pub fn check_size(what: &'static str, expected: usize, found: usize) -> Result<(), QuantError> {
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

/// Buffers of (code bytes, block maxima, block minima) against the sizes
/// `format` gives for `len` values.
pub fn check_sizes(
    format: &QuantFormat,
    len: usize,
    (codes, maxima, minima): (usize, usize, usize),
) -> Result<(), QuantError> {
    check_size("code bytes", format.code_bytes(len), codes)?;
    check_size("block maxima", format.num_blocks(len), maxima)?;
    check_size("block minima", format.num_block_mins(len), minima)
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
        check_sizes(
            &format,
            len,
            (codes.len(), block_max.len(), block_min.len()),
        )?;
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
        check_sizes(
            &format,
            len,
            (codes.len(), block_max.len(), block_min.len()),
        )?;
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
}
