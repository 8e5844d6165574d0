//! Quantization formats: bit width, scheme and block size, and the sizes of the
//! buffers a quantized tensor of a given length occupies.

use crate::QuantError;

/// Smallest block size a format accepts.
pub const MIN_BLOCK: usize = 32;
/// Largest block size a format accepts.
pub const MAX_BLOCK: usize = 65536;

/// Bits per code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bits {
    /// One code per byte.
    Eight,
    /// Two codes per byte, element `2i` in the low nibble.
    Four,
    /// Four codes per byte, element `4i + k` in bits `2k..2k+2`.
    Two,
}

impl Bits {
    /// Parses 8, 4 or 2.
    pub fn from_u32(bits: u32) -> Result<Self, QuantError> {
        match bits {
            8 => Ok(Bits::Eight),
            4 => Ok(Bits::Four),
            2 => Ok(Bits::Two),
            other => Err(QuantError::InvalidFormat(format!(
                "{other} bits per code is not supported; use 8, 4 or 2"
            ))),
        }
    }

    /// The number of bits, 8, 4 or 2.
    pub fn count(self) -> u32 {
        match self {
            Bits::Eight => 8,
            Bits::Four => 4,
            Bits::Two => 2,
        }
    }

    /// Codes that share one byte.
    pub fn codes_per_byte(self) -> usize {
        (8 / self.count()) as usize
    }
}

/// How a block's real range maps to codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// `x̂ = q · scale`, codes in `[-qmax, qmax]`, `qmax = 2^(b-1) - 1`.
    Symmetric,
    /// `x̂ = min + q · scale`, codes in `[0, 2^b - 1]`.
    Asymmetric,
}

/// How a real value picks its code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// Round half to even: deterministic, bit-exact with the CUDA kernels.
    NearestEven,
    /// `floor(v + u)`, `u` uniform in `[0, 1)` drawn from a `rand` generator
    /// seeded with `(seed, block index)`: unbiased, reproducible for a seed.
    Stochastic { seed: u64 },
}

impl Rounding {
    /// The rounding for one part of a larger job (a chunk of a swizzled
    /// tensor, a unit of a model): the same mode with a seed derived from
    /// `part`, so that parts draw independent noise.
    pub fn for_part(self, part: usize) -> Rounding {
        match self {
            Rounding::NearestEven => Rounding::NearestEven,
            Rounding::Stochastic { seed } => Rounding::Stochastic {
                seed: splitmix64(seed ^ (part as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)),
            },
        }
    }
}

/// SplitMix64's output function: a bijective 64-bit mixer.
pub(crate) fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A complete quantization format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuantFormat {
    pub bits: Bits,
    pub scheme: Scheme,
    /// Values that share one scale; a power of two from 32 to 65536.
    pub block: usize,
}

impl QuantFormat {
    /// Builds a format, checking that the block size is a power of two in
    /// `[MIN_BLOCK, MAX_BLOCK]`.
    pub fn new(bits: Bits, scheme: Scheme, block: usize) -> Result<Self, QuantError> {
        if !block.is_power_of_two() || !(MIN_BLOCK..=MAX_BLOCK).contains(&block) {
            return Err(QuantError::InvalidFormat(format!(
                "block size {block} is not a power of two between {MIN_BLOCK} and {MAX_BLOCK}; \
                 pick one such as 256"
            )));
        }
        Ok(QuantFormat {
            bits,
            scheme,
            block,
        })
    }

    /// Symmetric int8 with the given block.
    pub fn int8(block: usize) -> Result<Self, QuantError> {
        Self::new(Bits::Eight, Scheme::Symmetric, block)
    }

    /// Symmetric int4 with the given block.
    pub fn int4(block: usize) -> Result<Self, QuantError> {
        Self::new(Bits::Four, Scheme::Symmetric, block)
    }

    /// Largest code magnitude of the symmetric scheme (127, 7 or 1), or the
    /// largest code of the asymmetric one (255, 15 or 3).
    pub fn qmax(&self) -> f32 {
        let b = self.bits.count();
        match self.scheme {
            Scheme::Symmetric => ((1u32 << (b - 1)) - 1) as f32,
            Scheme::Asymmetric => ((1u32 << b) - 1) as f32,
        }
    }

    /// Number of blocks (one `block_max` each) for `len` values; the last may be partial.
    pub fn num_blocks(&self, len: usize) -> usize {
        len.div_ceil(self.block)
    }

    /// Bytes of packed codes for `len` values.
    pub fn code_bytes(&self, len: usize) -> usize {
        len.div_ceil(self.bits.codes_per_byte())
    }

    /// Number of f32 block minima (zero points) for `len` values: one per
    /// block for the asymmetric scheme, none for the symmetric one.
    pub fn num_block_mins(&self, len: usize) -> usize {
        match self.scheme {
            Scheme::Symmetric => 0,
            Scheme::Asymmetric => self.num_blocks(len),
        }
    }

    /// Bytes of per-block parameters (block maxima and minima, f32 each).
    pub fn param_bytes(&self, len: usize) -> usize {
        4 * (self.num_blocks(len) + self.num_block_mins(len))
    }

    /// Total bytes a quantized tensor of `len` values occupies.
    pub fn total_bytes(&self, len: usize) -> usize {
        self.code_bytes(len) + self.param_bytes(len)
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = match self.scheme {
            Scheme::Symmetric => "sym",
            Scheme::Asymmetric => "asym",
        };
        write!(f, "int{}-{}-b{}", self.bits.count(), scheme, self.block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_blocks_that_are_not_powers_of_two_in_range() {
        for block in [0, 1, 16, 31, 48, 100, 131072] {
            assert!(QuantFormat::int8(block).is_err(), "block {block}");
        }
        for block in [32, 64, 256, 65536] {
            assert!(QuantFormat::int4(block).is_ok(), "block {block}");
        }
    }

    #[test]
    fn sizes_count_partial_blocks_and_parameters() {
        let f = QuantFormat::int4(256).unwrap();
        assert_eq!(f.num_blocks(0), 0);
        assert_eq!(f.num_blocks(257), 2);
        assert_eq!(f.code_bytes(257), 129);
        assert_eq!(f.total_bytes(512), 256 + 8);
        let a = QuantFormat::new(Bits::Two, Scheme::Asymmetric, 32).unwrap();
        assert_eq!(a.code_bytes(33), 9);
        assert_eq!(a.param_bytes(33), 16);
        assert_eq!(a.qmax(), 3.0);
        assert_eq!(QuantFormat::int8(32).unwrap().qmax(), 127.0);
    }
}
