//! The trained model on one process: a checkpoint's full weights run
//! through the model's own units (the same forward pass training uses), for
//! `zeropp ckpt eval` (loss and logits on given text) and `zeropp generate`
//! (sampling).

use std::path::Path;

use anyhow::{Result, bail};
use candle_core::{D, Device, Tensor};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

use crate::engine::model::{Model as _, Tied, tensors_from_flat};
use crate::train::checkpoint;
use crate::train::model::{self, ModelConfig};

/// A checkpoint's model with its full weights, ready to run.
pub struct Model {
    pub config: ModelConfig,
    /// Each unit's parameter tensors (`Unit::params` order), in unit order.
    units: Vec<Vec<Tensor>>,
    device: Device,
}

impl Model {
    /// Loads checkpoint `dir` (a checkpoint, or a checkpoint root's latest).
    pub fn load(dir: &Path) -> Result<Model> {
        let dir = checkpoint::resolve(dir)?;
        let m = checkpoint::read_manifest(&dir)?;
        let device = Device::Cpu;
        let c = m.config.model.clone();
        let units = checkpoint::unit_weights(&dir, &m)?
            .into_iter()
            .enumerate()
            .map(|(i, (_, flat))| Ok(tensors_from_flat(&c, i, &flat, &device)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Model {
            config: c,
            units,
            device,
        })
    }

    /// Logits `[batch, time, vocab]` of token ids `[batch][time]` (all
    /// sequences of one length, at most the context).
    pub fn logits(&self, batch: &[Vec<u32>]) -> Result<Tensor> {
        let t = batch.first().map_or(0, Vec::len);
        if t == 0 || batch.iter().any(|s| s.len() != t) {
            let lens: Vec<usize> = batch.iter().map(Vec::len).collect();
            bail!(
                "give one or more sequences of the same, non-zero length (their lengths: {lens:?})"
            );
        }
        if t > self.config.context {
            bail!(
                "a sequence of {t} tokens is longer than the model's context of {}",
                self.config.context
            );
        }
        if let Some(bad) = batch
            .iter()
            .flatten()
            .find(|&&id| id as usize >= self.config.vocab)
        {
            bail!(
                "token id {bad} is outside the vocabulary of {}",
                self.config.vocab
            );
        }
        let ids: Vec<u32> = batch.iter().flatten().copied().collect();
        let mut x = Tensor::from_vec(ids, (batch.len(), t), &self.device)?;
        let mut tied = Tied::default();
        for (u, params) in self.units.iter().enumerate() {
            let mut params = params.clone();
            tied.apply(self.config.tie(), u, &mut params);
            x = self.config.forward(u, &params, &x)?;
        }
        Ok(x)
    }

    /// Mean next-token cross-entropy of `batch` (each position predicts
    /// the next; the last has nothing to predict) and the logits.
    pub fn loss(&self, batch: &[Vec<u32>]) -> Result<(f32, Tensor)> {
        let logits = self.logits(batch)?;
        let t = batch[0].len();
        if t < 2 {
            bail!("the loss needs sequences of at least 2 tokens");
        }
        let inputs = logits.narrow(1, 0, t - 1)?.contiguous()?;
        let next: Vec<u32> = batch.iter().flat_map(|s| s[1..].to_vec()).collect();
        let next = Tensor::from_vec(next, (batch.len(), t - 1), &self.device)?;
        let l = model::loss(&inputs, &next)?.to_scalar::<f32>()?;
        Ok((l, logits))
    }

    /// `new_tokens` bytes after `prompt`: sampled at `temperature` from the
    /// `top_k` most likely (0: all), or the most likely one when the
    /// temperature is 0; deterministic for `seed`. The model sees the last
    /// `context` tokens.
    pub fn generate(
        &self,
        prompt: &[u8],
        new_tokens: usize,
        temperature: f64,
        top_k: usize,
        seed: u64,
    ) -> Result<Vec<u8>> {
        self.generate_each(prompt, new_tokens, (temperature, top_k, seed), &mut |_| {
            Ok(())
        })
    }

    /// [`Model::generate`], handing each byte to `each` as it is sampled
    /// (a caller that prints them shows the text as it grows; an error
    /// from `each` stops the generation). The model sees the last
    /// `context` bytes of the prompt and what followed.
    pub fn generate_each(
        &self,
        prompt: &[u8],
        new_tokens: usize,
        (temperature, top_k, seed): (f64, usize, u64),
        each: &mut dyn FnMut(u8) -> Result<()>,
    ) -> Result<Vec<u8>> {
        if prompt.is_empty() {
            bail!("the prompt is empty: give at least one byte of text");
        }
        if !(temperature.is_finite() && temperature >= 0.0) {
            bail!("the temperature must be 0 (greedy) or positive, not {temperature}");
        }
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut ids: Vec<u32> = prompt.iter().map(|&b| b as u32).collect();
        for _ in 0..new_tokens {
            let start = ids.len().saturating_sub(self.config.context);
            let window = ids[start..].to_vec();
            let logits = self.logits(&[window])?;
            let last = logits.get(0)?.get(logits.dim(1)? - 1)?;
            let next = if temperature == 0.0 {
                last.argmax(D::Minus1)?.to_scalar::<u32>()?
            } else {
                sample(&last.to_vec1::<f32>()?, temperature, top_k, &mut rng)
            };
            ids.push(next);
            each(next as u8)?;
        }
        Ok(ids[prompt.len()..].iter().map(|&i| i as u8).collect())
    }
}

/// One draw from softmax(logits / temperature) over the `top_k` largest.
fn sample(logits: &[f32], temperature: f64, top_k: usize, rng: &mut SmallRng) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if top_k > 0 {
        order.truncate(top_k);
    }
    let top = logits[order[0]] as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - top) / temperature).exp())
        .collect();
    let mut r = rng.random_range(0.0..weights.iter().sum::<f64>());
    for (w, &i) in weights.iter().zip(&order) {
        if r < *w {
            return i as u32;
        }
        r -= w;
    }
    order[order.len() - 1] as u32
}

/// Reads `--text` arguments as token ids (their UTF-8 bytes).
pub fn byte_ids(texts: &[String]) -> Vec<Vec<u32>> {
    texts
        .iter()
        .map(|t| t.bytes().map(u32::from).collect())
        .collect()
}

/// Writes `logits` to `path` as a safetensors file holding one f32 tensor
/// named `logits`.
pub fn write_logits(path: &Path, logits: &Tensor) -> Result<()> {
    let values = logits.flatten_all()?.to_vec1::<f32>()?;
    let t = [("logits".to_string(), logits.dims().to_vec(), values)];
    checkpoint::write_safetensors(path, &t, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_follows_temperature_and_top_k() {
        let logits = [0.0f32, 5.0, 4.0, -3.0];
        let mut rng = SmallRng::seed_from_u64(1);
        // top-1 is the argmax whatever the temperature.
        assert!((0..50).all(|_| sample(&logits, 2.0, 1, &mut rng) == 1));
        // top-2 draws only the two largest, the larger more often.
        let draws: Vec<u32> = (0..2000)
            .map(|_| sample(&logits, 1.0, 2, &mut rng))
            .collect();
        assert!(draws.iter().all(|&d| d == 1 || d == 2));
        let ones = draws.iter().filter(|&&d| d == 1).count() as f64 / 2000.0;
        let expect = 1.0 / (1.0 + (-1.0f64).exp()); // 0.731
        assert!((ones - expect).abs() < 0.04, "{ones} vs {expect}");
    }
}
