//! Inputs and checks shared by the GPU and the emulator tests.

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use zeropp_cuda::GpuElement;
use zeropp_quant::{Bits, QuantizedTensor, Scheme};

pub const FORMATS: [(Bits, Scheme); 6] = [
    (Bits::Eight, Scheme::Symmetric),
    (Bits::Four, Scheme::Symmetric),
    (Bits::Two, Scheme::Symmetric),
    (Bits::Eight, Scheme::Asymmetric),
    (Bits::Four, Scheme::Asymmetric),
    (Bits::Two, Scheme::Asymmetric),
];

/// Values of mixed magnitudes, with an all-zero stretch and a constant stretch.
pub fn values<T: GpuElement>(len: usize, seed: u64) -> Vec<T> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..len)
        .map(|i| {
            let v = match (i / 97) % 5 {
                0 => 0.0,
                1 => 0.75,
                2 => rng.random_range(-1.0f32..1.0) * 1e-3,
                3 => rng.random_range(-1.0f32..1.0) * 40.0,
                _ => rng.random_range(-1.0f32..1.0),
            };
            T::from_f32(v)
        })
        .collect()
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Codes, maxima and minima equal bit for bit.
pub fn assert_same(got: &QuantizedTensor, want: &QuantizedTensor, what: &str) {
    assert_eq!(got.codes, want.codes, "codes differ: {what}");
    assert_eq!(
        bits(&got.block_max),
        bits(&want.block_max),
        "maxima differ: {what}"
    );
    assert_eq!(
        bits(&got.block_min),
        bits(&want.block_min),
        "minima differ: {what}"
    );
}
