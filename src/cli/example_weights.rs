//! A synthetic checkpoint in safetensors format, shaped like a small GPT's
//! weights (embeddings, layer norms, attention and MLP matrices, in f32, bf16
//! and f16), so `zeropp quant-error` can be tried with no download.

use std::path::Path;

use anyhow::Result;
use half::{bf16, f16};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use safetensors::{Dtype, tensor::TensorView};

/// One tensor of the example: its name, shape, dtype and values.
struct ExampleTensor {
    name: String,
    shape: Vec<usize>,
    dtype: Dtype,
    values: Vec<f32>,
}

impl ExampleTensor {
    fn bytes(&self) -> Vec<u8> {
        match self.dtype {
            Dtype::BF16 => self
                .values
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect(),
            Dtype::F16 => self
                .values
                .iter()
                .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                .collect(),
            _ => self.values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

/// Normal(0, std) draws by the Box–Muller transform.
fn normal(rng: &mut SmallRng, n: usize, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1: f32 = rng.random_range(f32::EPSILON..1.0);
            let u2: f32 = rng.random_range(0.0..1.0);
            std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
        })
        .collect()
}

/// Writes the example checkpoint: `layers` transformer blocks of width `dim`.
pub fn write(path: &Path, layers: usize, dim: usize, seed: u64) -> Result<usize> {
    // About 12·dim² values a layer, in memory at once: an example, not a
    // model (4 GB at most).
    let values = (layers as u128 + 1) * 12 * (dim as u128) * (dim as u128) + 256 * dim as u128;
    if dim == 0 || layers == 0 || values > 1 << 30 {
        anyhow::bail!(
            "--layers {layers} --dim {dim}: an example checkpoint of at least one layer of width \
             at least 1, and at most 2^30 values (about {values} asked)"
        );
    }
    let mut rng = SmallRng::seed_from_u64(seed);
    let vocab = 256;
    let mut tensors = vec![ExampleTensor {
        name: "embed.tokens".into(),
        shape: vec![vocab, dim],
        dtype: Dtype::F32,
        values: normal(&mut rng, vocab * dim, 0.02),
    }];
    for l in 0..layers {
        // Layer-norm gains start at one and drift: nearly constant blocks.
        let gains = (0..dim)
            .map(|_| 1.0 + rng.random_range(-0.05f32..0.05))
            .collect();
        tensors.push(ExampleTensor {
            name: format!("blocks.{l}.norm.weight"),
            shape: vec![dim],
            dtype: Dtype::F32,
            values: gains,
        });
        tensors.push(ExampleTensor {
            name: format!("blocks.{l}.attn.qkv.weight"),
            shape: vec![3 * dim, dim],
            dtype: Dtype::BF16,
            values: normal(&mut rng, 3 * dim * dim, 0.02),
        });
        // Outliers, as trained attention outputs have them.
        let mut proj = normal(&mut rng, dim * dim, 0.02);
        for _ in 0..dim / 8 {
            let i = rng.random_range(0..proj.len());
            proj[i] *= 20.0;
        }
        tensors.push(ExampleTensor {
            name: format!("blocks.{l}.attn.proj.weight"),
            shape: vec![dim, dim],
            dtype: Dtype::BF16,
            values: proj,
        });
        tensors.push(ExampleTensor {
            name: format!("blocks.{l}.mlp.up.weight"),
            shape: vec![4 * dim, dim],
            dtype: Dtype::F16,
            values: normal(&mut rng, 4 * dim * dim, 0.02),
        });
        tensors.push(ExampleTensor {
            name: format!("blocks.{l}.mlp.up.bias"),
            shape: vec![4 * dim + 3],
            dtype: Dtype::F32,
            values: normal(&mut rng, 4 * dim + 3, 0.001),
        });
    }
    let bytes: Vec<Vec<u8>> = tensors.iter().map(ExampleTensor::bytes).collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| {
            Ok((
                t.name.clone(),
                TensorView::new(t.dtype, t.shape.clone(), b)?,
            ))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    crate::train::checkpoint::write_safetensors_views(views, None, path)?;
    Ok(tensors.len())
}
