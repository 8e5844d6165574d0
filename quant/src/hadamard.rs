//! The block-wise Walsh–Hadamard rotation that smooths values before a
//! low-bit quantization (SDP4Bit, NeurIPS 2024): each block of `block`
//! values (a power of two) is multiplied by the orthonormal Hadamard matrix
//! H/√block, in O(n log block). An outlier is spread over its block, so
//! the block's scale follows the block's energy rather than its largest
//! value. The rotation is its own inverse (up to f32 rounding) and linear:
//! rotated values can be summed before rotating back.

use crate::QuantError;

/// Rotates every whole block of `block` values of `x` in place (`block` a
/// power of two); a shorter tail is left as it is (its own quantization
/// block, unrotated, on both sides of a hop).
pub fn rotate_blocks(x: &mut [f32], block: usize) -> Result<(), QuantError> {
    if !block.is_power_of_two() {
        return Err(QuantError::InvalidFormat(format!(
            "a Hadamard rotation over blocks of {block} values: use a power of two"
        )));
    }
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
    Ok(())
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
