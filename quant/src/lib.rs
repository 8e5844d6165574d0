//! # zeropp-quant — block quantization formats and CPU kernels
//!
//! The formats that zeropp puts on the wire for qwZ (weights) and qgZ
//! (gradients). The CUDA kernels in `cuda/` reproduce them **bit for bit**
//! for round-to-nearest, so this page is their specification.
//!
//! ## Blocks
//! A tensor of `len` values is cut into blocks of `B` consecutive values, `B`
//! a power of two from 32 to 65536; the last block holds `len mod B` values
//! when that is not zero (a partial block is quantized like any other, from
//! its own values only). Every block stores one f32 `max`; the asymmetric
//! scheme adds one f32 `min`. Arithmetic is IEEE-754 f32, round-to-nearest,
//! every operation rounded on its own (no fused multiply-add; in CUDA
//! `__fdiv_rn`, `__fmul_rn`, `__fadd_rn`, `__fsub_rn`).
//!
//! ## Symmetric b-bit (b = 8, 4, 2)
//! `qmax = 2^(b−1) − 1` (127, 7, 1).
//! - stored: `max = absmax = max |x|` over the block;
//! - `scale = absmax / qmax`;
//! - `q = clamp(round_half_to_even(x / scale), −qmax, qmax)`;
//! - `scale == 0` (an all-zero block, or `absmax / qmax` underflowing) →
//!   every code is 0;
//! - dequantized: `x̂ = (q / qmax) · absmax`.
//!
//! ## Asymmetric b-bit
//! `L = 2^b − 1` (255, 15, 3).
//! - stored: `min` and `max` over the block (the zero point is `min`);
//! - `scale = (max − min) / L`;
//! - `q = clamp(round_half_to_even((x − min) / scale), 0, L)`;
//! - `scale == 0` (all values equal) → every code is 0;
//! - dequantized: `x̂ = (1 − r) · min + r · max` with `r = q / L`.
//!
//! A block whose `max − min` overflows f32 is an error
//! ([`QuantError::RangeOverflow`]).
//!
//! ### Why the block stores `absmax` (or `min`, `max`), not `scale`
//! Mathematically `(q / qmax) · absmax = q · scale`. In f32 the stored-scale
//! form `q · fl(absmax / qmax)` misses `absmax` itself by one ulp for about 2%
//! of mantissas at `qmax = 127` (32% at `qmax = 7`), and no f32 scale can fix
//! all of them. With the stored extremes the code `±qmax` (or `0` and `L`)
//! reproduces the extreme exactly, so
//! - a block whose values are all `v` round-trips to `v` exactly;
//! - quantizing the dequantized tensor gives back the same codes and the same
//!   block parameters (idempotence), because the extremes survive unchanged.
//!
//! ## Codes and packing
//! Symmetric codes are two's complement in `b` bits; asymmetric codes are
//! unsigned. Codes are packed little-end first: with `k = 8 / b` codes per
//! byte, element `i` lives in byte `i / k` at bits `b·(i mod k) ..
//! b·(i mod k) + b`. For int4, element `2i` is the **low nibble** of byte `i`
//! and element `2i + 1` the high nibble. Because `B ≥ 32`, every block starts
//! on a byte boundary; the unused high bits of a tensor's last byte are 0.
//! A tensor of `len` values occupies `ceil(len·b/8)` code bytes plus
//! `4·ceil(len/B)` bytes of block maxima (and as many again of minima when
//! asymmetric).
//!
//! ## Rounding
//! - [`Rounding::NearestEven`]: ties to even (`rintf` in CUDA).
//! - [`Rounding::Stochastic`]: `q = floor(v + u)` with `u` uniform in
//!   `[0, 1)` and 24 bits: for the values `2j` and `2j + 1` of a block, bits
//!   63..40 and 31..8 of the `j`-th `u64` of a [`rand::rngs::SmallRng`]
//!   seeded per block with `seed_from_u64(seed ^ (block · 0x9E3779B97F4A7C15))`,
//!   times `2^−24`; unbiased, and reproducible for a seed whatever order the
//!   blocks are processed in.
//!
//! ## Error contract
//! With `u = 2^−24`, for round-to-nearest and a block whose scale is a normal
//! f32 (symmetric: `absmax ≥ qmax · 2^−126`):
//! - symmetric: `|x − x̂| ≤ scale/2 + 4u·absmax`;
//! - asymmetric: `|x − x̂| ≤ scale/2 + 8u·max(|min|, |max|)`.
//!
//! The slack covers the rounding of the division and of the dequantizing
//! multiply and add; `tests/properties.rs` proves these bounds on random
//! inputs. Stochastic rounding moves a value by less than one `scale` plus the
//! same slack, and is unbiased. Idempotence holds for every symmetric block
//! with a normal scale, and for asymmetric blocks whose `scale` is not lost in
//! the rounding of `min` (`scale > 16u·max(|min|, |max|)`).
//!
//! ## Inputs
//! f32, bf16 and f16 ([`Element`]); arithmetic is in f32 after widening. A
//! NaN or infinity is an error naming its block and index
//! ([`QuantError::NonFinite`]), never silently encoded.

pub mod element;
pub mod format;
pub mod fused;
pub mod hadamard;
pub mod isa;
pub mod kernels;
pub mod stats;
pub mod tensor;
pub mod views;

pub use element::Element;
pub use format::{Bits, MAX_BLOCK, MIN_BLOCK, QuantFormat, Rounding, Scheme};
pub use fused::{
    QuantizedChunks, quantize_swizzled, quantize_with_feedback, quantize_with_feedback_on,
    sum_requantize, sum_requantize_on, swizzled_chunk_len, swizzled_rank,
};
pub use isa::Isa;
pub use kernels::{
    dequantize, dequantize_accumulate, dequantize_accumulate_on, dequantize_on, quantize,
    quantize_on,
};
pub use stats::{ErrorStats, Figures};
pub use tensor::QuantizedTensor;
pub use views::{QuantizedMut, QuantizedRef};

/// What can go wrong in quantization.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum QuantError {
    #[error("invalid quantization format: {0}")]
    InvalidFormat(String),
    #[error(
        "value {value} at index {index} (block {block}) is not finite; \
         quantization needs finite inputs — find where the NaN/Inf came from \
         (a diverging loss, an uninitialised buffer) and fix it upstream"
    )]
    NonFinite {
        block: usize,
        index: usize,
        value: f32,
    },
    #[error(
        "block {block} spans [{min:e}, {max:e}], a range that overflows f32; \
         use the symmetric scheme for this tensor"
    )]
    RangeOverflow { block: usize, min: f32, max: f32 },
    #[error("wrong buffer size for {what}: expected {expected}, found {found}")]
    SizeMismatch {
        what: &'static str,
        expected: usize,
        found: usize,
    },
    #[error(
        "block {block} has minimum {min} and maximum {max}; they must be finite with \
         min <= max (and max >= 0 when symmetric) — the quantized data is corrupt"
    )]
    CorruptParams { block: usize, min: f32, max: f32 },
}
