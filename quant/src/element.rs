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

    /// `max |x|` of a slice as the f32 bit pattern of the magnitude (an
    /// integer max, so it vectorises); `>= 0x7f80_0000` means a NaN or an
    /// infinity is present. Empty slice → 0.
    #[inline(always)]
    fn max_magnitude_bits(x: &[Self]) -> u32 {
        x.iter()
            .map(|v| v.to_f32().to_bits() & 0x7fff_ffff)
            .fold(0, u32::max)
    }

    /// `out = x` widened to f32, over the shorter of the two.
    #[inline]
    fn widen_slice(x: &[Self], out: &mut [f32]) {
        out.iter_mut().zip(x).for_each(|(o, v)| *o = v.to_f32());
    }

    /// `out = x` narrowed (nearest even), over the shorter of the two.
    #[inline]
    fn narrow_slice(x: &[f32], out: &mut [Self]) {
        out.iter_mut()
            .zip(x)
            .for_each(|(o, v)| *o = Self::from_f32(*v));
    }
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
    // A memcpy: the element loop compiles to 16-byte copies, which showed
    // in a reduce-scatter's profile in the bindings (docs/BENCHMARKS.md).
    fn widen_slice(x: &[f32], out: &mut [f32]) {
        let n = x.len().min(out.len());
        out[..n].copy_from_slice(&x[..n]);
    }
    fn narrow_slice(x: &[f32], out: &mut [f32]) {
        Self::widen_slice(x, out);
    }
}

impl Element for bf16 {
    const NAME: &'static str = "BF16";
    #[inline(always)]
    fn max_magnitude_bits(x: &[Self]) -> u32 {
        // Stay in 16-bit lanes: twice the values per instruction.
        ((x.iter().map(|v| v.to_bits() & 0x7fff).fold(0, u16::max)) as u32) << 16
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // bf16 is the top half of an f32: widening is a shift.
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        // Round to nearest even on the bits, as `half` does, but written so
        // that it vectorises (half's version branches per value).
        let b = v.to_bits();
        let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
        let nan = (b >> 16) | 0x0040;
        bf16::from_bits(if v.is_nan() { nan } else { rounded } as u16)
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

    /// The slice forms are the element forms, value for value, over the
    /// shorter slice (f32's is a copy).
    fn slices_match_elements<T: Element + PartialEq + std::fmt::Debug>() {
        let x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.731).sin() * 3e3).collect();
        let mut narrow = vec![T::from_f32(9.0); 40];
        T::narrow_slice(&x, &mut narrow);
        let want: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
        assert_eq!(&narrow[..37], &want[..], "{}", T::NAME);
        assert_eq!(narrow[37..], [T::from_f32(9.0); 3], "{}", T::NAME);
        let mut wide = vec![0f32; 20];
        T::widen_slice(&want, &mut wide);
        let back: Vec<f32> = want[..20].iter().map(|v| v.to_f32()).collect();
        assert_eq!(wide, back, "{}", T::NAME);
    }

    #[test]
    fn slice_conversions_match_the_element_ones() {
        slices_match_elements::<f32>();
        slices_match_elements::<bf16>();
        slices_match_elements::<f16>();
    }

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

    #[test]
    fn bf16_narrowing_matches_half_on_every_pattern_class() {
        let mut s = 0x1234_5678u32;
        let specials = [
            0u32,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0001,
            0xffbf_ffff,
            0x7f7f_ffff,
            0x0000_8000,
            0x0001_8000,
            0x3f80_8000,
            0x3f81_8000,
        ];
        for bits in specials.into_iter().chain((0..1_000_000).map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s
        })) {
            let v = f32::from_bits(bits);
            let ours: bf16 = Element::from_f32(v);
            assert_eq!(ours.to_bits(), bf16::from_f32(v).to_bits(), "{bits:#x}");
        }
    }
}
