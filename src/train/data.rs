//! Training data: any text file, or a built-in deterministic corpus (no
//! download). Bytes are tokens. The last tenth is held out for validation;
//! the rest is cut into one part per rank, and each rank samples its batches
//! from its own part with a generator seeded by (seed, rank, step).

use std::path::Path;

use anyhow::{Context, Result, bail};
use candle_core::{Device, Tensor};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

pub use zeropp_corpus::builtin_corpus;

/// A corpus cut into training parts and a validation tail.
pub struct Dataset {
    bytes: Vec<u8>,
    train_end: usize,
}

impl Dataset {
    /// Reads `path`, or builds the built-in corpus.
    pub fn load(path: Option<&Path>, seed: u64) -> Result<Dataset> {
        let bytes = match path {
            Some(p) => {
                let b = std::fs::read(p)
                    .with_context(|| format!("cannot read the training data {}", p.display()))?;
                if std::str::from_utf8(&b).is_err() {
                    bail!(
                        "{} is not UTF-8 text; zeropp trains on text files",
                        p.display()
                    );
                }
                b
            }
            None => builtin_corpus(2 << 20, seed),
        };
        let train_end = bytes.len() - bytes.len() / 10;
        Ok(Dataset { bytes, train_end })
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Checks that every rank's part and the validation tail hold at least
    /// one sequence of `context + 1` bytes.
    pub fn check(&self, world: usize, context: usize) -> Result<()> {
        let need = context + 2;
        let part = self.train_end / world.max(1);
        let val = self.bytes.len() - self.train_end;
        if part < need || val < need {
            bail!(
                "the data has {} bytes: too little for {world} ranks with context {context} \
                 (each rank's part needs at least {need} bytes, as does the held-out tenth); \
                 use a larger file or a shorter --context",
                self.bytes.len()
            );
        }
        Ok(())
    }

    fn sample(
        &self,
        range: std::ops::Range<usize>,
        rows: usize,
        context: usize,
        rng: &mut SmallRng,
    ) -> Result<(Tensor, Tensor)> {
        let mut ids = Vec::with_capacity(rows * (context + 1));
        for _ in 0..rows {
            let start = rng.random_range(range.start..=range.end - (context + 1));
            ids.extend(
                self.bytes[start..start + context + 1]
                    .iter()
                    .map(|&b| b as u32),
            );
        }
        let all = Tensor::from_vec(ids, (rows, context + 1), &Device::Cpu)?;
        Ok((all.narrow(1, 0, context)?, all.narrow(1, 1, context)?))
    }

    /// Rank `rank`'s training batch for `step`: inputs and next-byte targets.
    pub fn train_batch(
        &self,
        rank: usize,
        world: usize,
        step: usize,
        seed: u64,
        rows: usize,
        context: usize,
    ) -> Result<(Tensor, Tensor)> {
        let part = self.train_end / world;
        let mut rng = SmallRng::seed_from_u64(
            seed ^ ((rank as u64) << 40) ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        self.sample(rank * part..(rank + 1) * part, rows, context, &mut rng)
    }

    /// Rank `rank`'s validation batch number `i` (the same for every run).
    pub fn val_batch(
        &self,
        rank: usize,
        i: usize,
        rows: usize,
        context: usize,
    ) -> Result<(Tensor, Tensor)> {
        let mut rng = SmallRng::seed_from_u64(0x5eed ^ ((rank as u64) << 32) ^ i as u64);
        self.sample(self.train_end..self.bytes.len(), rows, context, &mut rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_corpus_is_deterministic_text() {
        let a = builtin_corpus(10_000, 1);
        assert_eq!(a, builtin_corpus(10_000, 1));
        assert_ne!(a, builtin_corpus(10_000, 2));
        assert!(std::str::from_utf8(&a).unwrap().contains(" the "));
    }

    #[test]
    fn batches_are_shifted_by_one_and_ranks_differ() {
        let d = Dataset::load(None, 0).unwrap();
        d.check(4, 32).unwrap();
        let (x, y) = d.train_batch(0, 4, 5, 9, 3, 32).unwrap();
        let (x1, _) = d.train_batch(1, 4, 5, 9, 3, 32).unwrap();
        let xv = x.to_vec2::<u32>().unwrap();
        let yv = y.to_vec2::<u32>().unwrap();
        assert_eq!(xv[0][1..], yv[0][..31]);
        assert_ne!(xv, x1.to_vec2::<u32>().unwrap());
        let tiny = Dataset {
            bytes: vec![b'a'; 50],
            train_end: 45,
        };
        assert!(tiny.check(4, 32).is_err());
    }
}
