//! The block-wise Walsh–Hadamard rotation that smooths values before a
//! low-bit quantization (SDP4Bit, NeurIPS 2024): each block of `block`
//! values (a power of two) is multiplied by the orthonormal Hadamard matrix
//! H/√block, in O(n log block). An outlier is spread over its block, so
//! the block's scale follows the block's energy rather than its largest
//! value. The rotation is its own inverse (up to f32 rounding) and linear:
//! rotated values can be summed before rotating back.
//!
//! Every build computes the same butterflies in the same order — stage
//! h = 1, 2, 4, … of the fast transform, `u + v` and `u - v`, then the
//! scale — so the result is the same bit for bit on every instruction set
//! and in the CUDA kernel (`zeropp_cuda::kernels`): only how many lanes do
//! it at once differs.

use crate::{Isa, QuantError};

/// Rotates every whole block of `block` values of `x` in place (`block` a
/// power of two); a shorter tail is left as it is (its own quantization
/// block, unrotated, on both sides of a hop).
pub fn rotate_blocks(x: &mut [f32], block: usize) -> Result<(), QuantError> {
    rotate_blocks_on(Isa::detect(), x, block)
}

/// [`rotate_blocks`] with the chosen instruction set.
pub fn rotate_blocks_on(isa: Isa, x: &mut [f32], block: usize) -> Result<(), QuantError> {
    if !block.is_power_of_two() {
        return Err(QuantError::InvalidFormat(format!(
            "a Hadamard rotation over blocks of {block} values: use a power of two"
        )));
    }
    match isa {
        Isa::Portable => rotate(x, block),
        // SAFETY: `Isa::Avx2` is only ever produced where the CPU has AVX2
        // (`Isa::detect`/`Isa::available`).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::rotate(x, block) },
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    #[target_feature(enable = "avx2")]
    pub(super) fn rotate(x: &mut [f32], block: usize) {
        super::rotate(x, block)
    }
}

/// The butterflies of stages h = 1, 2 and 4 on eight values, written out
/// so that they stay in registers.
#[inline(always)]
fn first_three_stages(e: &mut [f32; 8]) {
    for i in [0, 2, 4, 6] {
        let (u, v) = (e[i], e[i + 1]);
        e[i] = u + v;
        e[i + 1] = u - v;
    }
    for i in [0, 1, 4, 5] {
        let (u, v) = (e[i], e[i + 2]);
        e[i] = u + v;
        e[i + 2] = u - v;
    }
    for i in 0..4 {
        let (u, v) = (e[i], e[i + 4]);
        e[i] = u + v;
        e[i + 4] = u - v;
    }
}

/// One butterfly stage of half-width `h` over `b`, scaled by `scale` when
/// it is the last one (`Some`).
#[inline(always)]
fn stage(b: &mut [f32], h: usize, scale: Option<f32>) {
    for pair in b.chunks_exact_mut(2 * h) {
        let (lo, hi) = pair.split_at_mut(h);
        match scale {
            None => lo.iter_mut().zip(hi.iter_mut()).for_each(|(p, q)| {
                let (u, v) = (*p, *q);
                *p = u + v;
                *q = u - v;
            }),
            Some(s) => lo.iter_mut().zip(hi.iter_mut()).for_each(|(p, q)| {
                let (u, v) = (*p, *q);
                *p = (u + v) * s;
                *q = (u - v) * s;
            }),
        }
    }
}

#[inline(always)]
fn rotate(x: &mut [f32], block: usize) {
    let scale = 1.0 / (block as f32).sqrt();
    for b in x.chunks_exact_mut(block) {
        if block < 8 {
            let mut h = 1;
            while h < block {
                stage(b, h, None);
                h *= 2;
            }
        } else {
            for e in b.chunks_exact_mut(8) {
                first_three_stages(e.try_into().expect("chunks of 8"));
            }
            let mut h = 8;
            while 2 * h < block {
                stage(b, h, None);
                h *= 2;
            }
            if h < block {
                stage(b, h, Some(scale));
                continue;
            }
        }
        b.iter_mut().for_each(|v| *v *= scale);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotating_twice_gives_the_values_back_and_keeps_their_energy() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01)
            .collect();
        let mut y = x.clone();
        rotate_blocks(&mut y, 64).unwrap();
        let energy = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((energy(&y) - energy(&x)).abs() < 1e-4 * energy(&x));
        rotate_blocks(&mut y, 64).unwrap();
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 1e-6, "{a} {b}");
        }
    }

    /// The transform as written in the papers, one butterfly at a time.
    fn reference(x: &mut [f32], block: usize) {
        let scale = 1.0 / (block as f32).sqrt();
        for b in x.chunks_exact_mut(block) {
            let mut h = 1;
            while h < block {
                for i in (0..block).step_by(2 * h) {
                    for j in i..i + h {
                        let (u, v) = (b[j], b[j + h]);
                        b[j] = u + v;
                        b[j + h] = u - v;
                    }
                }
                h *= 2;
            }
            b.iter_mut().for_each(|v| *v *= scale);
        }
    }

    #[test]
    fn every_instruction_set_gives_the_butterflies_result_bit_for_bit() {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let x: Vec<f32> = (0..4096 + 40)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / 16_777_216.0 - 0.5) * 3.0
            })
            .collect();
        for block in [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096] {
            let mut want = x.clone();
            reference(&mut want, block);
            for isa in Isa::available() {
                let mut got = x.clone();
                rotate_blocks_on(isa, &mut got, block).unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{isa:?}, blocks of {block}");
            }
        }
    }

    #[test]
    fn an_outlier_is_spread_over_its_block() {
        let mut x = vec![0.0f32; 32];
        x[5] = 8.0;
        rotate_blocks(&mut x, 32).unwrap();
        let m = 8.0 / (32f32).sqrt();
        assert!(x.iter().all(|v| (v.abs() - m).abs() < 1e-6), "{x:?}");
    }

    #[test]
    fn blocks_that_are_not_powers_of_two_are_errors_and_a_tail_stays() {
        assert!(rotate_blocks(&mut [0.0; 48], 48).is_err());
        let mut x: Vec<f32> = (0..40).map(|i| i as f32).collect();
        rotate_blocks(&mut x, 32).unwrap();
        assert_eq!(
            &x[32..],
            &(32..40).map(|i| i as f32).collect::<Vec<_>>()[..]
        );
        assert_ne!(x[0], 0.0);
    }
}
