//! Floating-point element types the kernels read and write: f32, bf16 and f16.
//! All arithmetic happens in f32; these are the loads and stores.

use half::{bf16, f16};

/// A floating-point type a tensor may hold.
pub trait Element: Copy + Send + Sync + 'static {
    /// The dtype's name as safetensors spells it (`F32`, `BF16`, `F16`).
    const NAME: &'static str;
    /// Exact widening to f32.
    fn to_f32(self) -> f32;
    /// Narrowing from f32, rounding to nearest even.
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    const NAME: &'static str = "F32";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for bf16 {
    const NAME: &'static str = "BF16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // bf16 is the top half of an f32: widening is a shift.
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl Element for f16 {
    const NAME: &'static str = "F16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_widening_matches_half() {
        for v in [
            0.0f32,
            -0.0,
            1.0,
            -3.5,
            1e-30,
            6.5e4,
            f32::MAX,
            f32::MIN_POSITIVE,
        ] {
            let b = bf16::from_f32(v);
            assert_eq!(Element::to_f32(b).to_bits(), b.to_f32().to_bits());
        }
    }
}
