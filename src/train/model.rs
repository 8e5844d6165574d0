//! A byte-level GPT as a list of *units* — token+position embedding, pre-norm
//! transformer blocks, final norm + head — each a pure function of its
//! parameters and its input. The model knows nothing of sharding: the engine
//! hands a unit its full parameters (as tensors) and calls `forward`.

use crate::engine::InvalidModel;
use candle_core::{DType, Result, Tensor};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

zeropp_settings::section! {
    /// Shape of the model (the `[model]` table of a config; unset keys take
    /// the defaults).
    ModelConfig / ModelArgs [deny_unknown_fields] {
        /// Token ids: tokens are bytes, so at least 256 (more leaves rows
        /// of the embedding unused).
        vocab: usize = 256,
        /// Context length (tokens per sequence).
        context: usize = 64,
        /// Model width.
        width: usize = 64,
        /// Transformer blocks.
        layers: usize = 2,
        /// Attention heads (they divide the width).
        heads: usize = 4,
        /// Tie the head's output matrix to the token embedding, transposed
        /// (GPT-2 style): vocab × width fewer parameters.
        tied_head: bool = false,
    }
}

impl ModelConfig {
    pub fn validate(&self) -> std::result::Result<(), InvalidModel> {
        let bad = |setting, why: String| Err(InvalidModel { setting, why });
        if self.width == 0 || self.heads == 0 || !self.width.is_multiple_of(self.heads) {
            let why = format!(
                "{} must be a positive multiple of heads {}",
                self.width, self.heads
            );
            return bad("width", why);
        }
        if self.context == 0 {
            return bad("context", "must be positive".into());
        }
        if self.vocab < 256 {
            let why = format!(
                "{} is too small: tokens are bytes, so it must be at least 256",
                self.vocab
            );
            return bad("vocab", why);
        }
        Ok(())
    }

    /// The units in forward order.
    pub fn units(&self) -> Vec<Unit> {
        let mut units = vec![Unit::Embedding];
        units.extend((0..self.layers).map(Unit::Block));
        units.push(Unit::Head);
        units
    }
}

/// One parameter tensor of a unit.
#[derive(Clone, Debug)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

#[derive(Clone, Copy, Debug)]
pub enum Init {
    Zeros,
    Ones,
    Normal(f32),
}

/// The granularity of gather and release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Embedding,
    Block(usize),
    Head,
}

fn spec(name: impl Into<String>, shape: &[usize], init: Init) -> ParamSpec {
    ParamSpec {
        name: name.into(),
        shape: shape.to_vec(),
        init,
    }
}

impl Unit {
    pub fn name(&self) -> String {
        match self {
            Unit::Embedding => "embed".into(),
            Unit::Block(i) => format!("blocks.{i}"),
            Unit::Head => "head".into(),
        }
    }

    /// The unit's parameters, in the order of its flat buffer.
    pub fn params(&self, c: &ModelConfig) -> Vec<ParamSpec> {
        let (d, v, t) = (c.width, c.vocab, c.context);
        let std = 0.02;
        // GPT-2: residual projections scaled down with depth.
        let proj_std = std / (2.0 * c.layers.max(1) as f32).sqrt();
        match self {
            Unit::Embedding => vec![
                spec("tokens", &[v, d], Init::Normal(std)),
                spec("positions", &[t, d], Init::Normal(std / 2.0)),
            ],
            Unit::Block(_) => vec![
                spec("ln1.weight", &[d], Init::Ones),
                spec("ln1.bias", &[d], Init::Zeros),
                spec("attn.qkv.weight", &[d, 3 * d], Init::Normal(std)),
                spec("attn.qkv.bias", &[3 * d], Init::Zeros),
                spec("attn.proj.weight", &[d, d], Init::Normal(proj_std)),
                spec("attn.proj.bias", &[d], Init::Zeros),
                spec("ln2.weight", &[d], Init::Ones),
                spec("ln2.bias", &[d], Init::Zeros),
                spec("mlp.up.weight", &[d, 4 * d], Init::Normal(std)),
                spec("mlp.up.bias", &[4 * d], Init::Zeros),
                spec("mlp.down.weight", &[4 * d, d], Init::Normal(proj_std)),
                spec("mlp.down.bias", &[d], Init::Zeros),
            ],
            Unit::Head if c.tied_head => vec![
                spec("ln.weight", &[d], Init::Ones),
                spec("ln.bias", &[d], Init::Zeros),
            ],
            Unit::Head => vec![
                spec("ln.weight", &[d], Init::Ones),
                spec("ln.bias", &[d], Init::Zeros),
                spec("out.weight", &[d, v], Init::Normal(std)),
            ],
        }
    }

    /// Number of parameters (before padding).
    pub fn numel(&self, c: &ModelConfig) -> usize {
        self.params(c).iter().map(ParamSpec::numel).sum()
    }

    /// Initial values of the flat buffer, deterministic for `seed`.
    pub fn init(&self, c: &ModelConfig, seed: u64, unit_index: usize) -> Vec<f32> {
        let mut rng = SmallRng::seed_from_u64(
            seed ^ (unit_index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        let mut out = Vec::with_capacity(self.numel(c));
        for p in self.params(c) {
            match p.init {
                Init::Zeros => out.extend(std::iter::repeat_n(0.0, p.numel())),
                Init::Ones => out.extend(std::iter::repeat_n(1.0, p.numel())),
                Init::Normal(std) => out.extend((0..p.numel()).map(|_| {
                    // Box–Muller
                    let u1: f32 = rng.random_range(f32::EPSILON..1.0);
                    let u2: f32 = rng.random_range(0.0..1.0);
                    std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
                })),
            }
        }
        out
    }

    /// Runs the unit. `params` are this unit's tensors in `params()` order;
    /// `input` is token ids (u32, `[batch, time]`) for the embedding and
    /// activations (`[batch, time, width]`) otherwise. The head returns
    /// logits `[batch, time, vocab]`; a tied head takes the embedding's
    /// token matrix (`[vocab, width]`) after its own parameters.
    pub fn forward(&self, c: &ModelConfig, params: &[Tensor], input: &Tensor) -> Result<Tensor> {
        match self {
            Unit::Embedding => {
                let (b, t) = input.dims2()?;
                if t > c.context {
                    candle_core::bail!("sequence of {t} tokens exceeds the context {}", c.context);
                }
                let tok = params[0]
                    .embedding(&input.flatten_all()?)?
                    .reshape((b, t, c.width))?;
                let pos = params[1].narrow(0, 0, t)?;
                super::ops::add_rows(&tok, &pos)
            }
            Unit::Block(_) => block_forward(c, params, input),
            Unit::Head => {
                let x = super::ops::layer_norm(input, &params[0], &params[1], 1e-5)?;
                if c.tied_head {
                    linear(&x, &params[2].t()?)
                } else {
                    linear(&x, &params[2])
                }
            }
        }
    }
}

/// `x [b, t, d] · w [d, k]` as one `[b·t, d] · [d, k]` product: a batched
/// product would copy `w` once per sequence (`broadcast_matmul` makes the
/// broadcast contiguous), and its gradient again.
fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (b, t, d) = x.dims3()?;
    let k = w.dim(1)?;
    x.reshape((b * t, d))?.matmul(w)?.reshape((b, t, k))
}

fn block_forward(c: &ModelConfig, p: &[Tensor], x: &Tensor) -> Result<Tensor> {
    let (b, t, d) = x.dims3()?;
    let h = c.heads;
    let hd = d / h;
    // Attention.
    let a = super::ops::layer_norm(x, &p[0], &p[1], 1e-5)?;
    let qkv = super::ops::add_rows(&linear(&a, &p[2])?, &p[3])?;
    let qkv = qkv.reshape((b, t, 3, h, hd))?.permute((2, 0, 3, 1, 4))?;
    let q = qkv.get(0)?.contiguous()?;
    let k = qkv.get(1)?.contiguous()?;
    let v = qkv.get(2)?.contiguous()?;
    let scores = q.matmul(&k.t()?.contiguous()?)?;
    let att = super::ops::causal_softmax(&scores, 1.0 / (hd as f64).sqrt())?;
    let y = att
        .matmul(&v)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((b, t, d))?;
    let y = super::ops::add_rows(&linear(&y, &p[4])?, &p[5])?;
    let x = (x + y)?;
    // MLP.
    let m = super::ops::layer_norm(&x, &p[6], &p[7], 1e-5)?;
    let m = super::ops::add_rows(&linear(&m, &p[8])?, &p[9])?;
    let m = super::ops::gelu(&m)?;
    let m = super::ops::add_rows(&linear(&m, &p[10])?, &p[11])?;
    x + m
}

/// The built-in GPT as the engine shards it: `units()` in order, the
/// embedding's token matrix tied to the head when `tied_head` is set.
impl crate::engine::Model for ModelConfig {
    fn validate(&self) -> std::result::Result<(), InvalidModel> {
        ModelConfig::validate(self)
    }

    fn unit_count(&self) -> usize {
        self.layers + 2
    }

    fn unit_name(&self, unit: usize) -> String {
        self.units()[unit].name()
    }

    fn param_shapes(&self, unit: usize) -> Vec<Vec<usize>> {
        self.units()[unit]
            .params(self)
            .into_iter()
            .map(|p| p.shape)
            .collect()
    }

    fn init(&self, unit: usize, seed: u64) -> Vec<f32> {
        self.units()[unit].init(self, seed, unit)
    }

    fn tie(&self) -> Option<crate::engine::Tie> {
        self.tied_head.then(|| crate::engine::Tie {
            from: 0,
            param: 0,
            to: self.layers + 1,
        })
    }

    fn forward(&self, unit: usize, params: &[Tensor], input: &Tensor) -> Result<Tensor> {
        self.units()[unit].forward(self, params, input)
    }

    fn loss(&self, output: &Tensor, targets: &Tensor) -> Result<Tensor> {
        loss(output, targets)
    }
}

/// Mean cross-entropy of logits `[b, t, v]` against targets `[b, t]`.
pub fn loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    super::ops::cross_entropy(
        &logits.reshape((b * t, v))?,
        &targets.reshape(b * t)?.to_dtype(DType::U32)?,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::model::{Model, Tied, tensors_from_flat};
    use candle_core::Device;

    #[test]
    fn a_forward_pass_through_all_units_gives_a_loss_near_log_vocab() {
        for tied_head in [false, true] {
            let c = ModelConfig {
                tied_head,
                ..ModelConfig::default()
            };
            let dev = Device::Cpu;
            let ids: Vec<u32> = (0..2 * 16).map(|i| (i * 37 % 256) as u32).collect();
            let ids = Tensor::from_vec(ids, (2, 16), &dev).unwrap();
            let mut x = ids.clone();
            let mut tied = Tied::default();
            for u in 0..c.unit_count() {
                let flat = Model::init(&c, u, 1);
                assert_eq!(flat.len(), c.units()[u].numel(&c));
                let mut params = tensors_from_flat(&c, u, &flat, &dev).unwrap();
                tied.apply(c.tie(), u, &mut params);
                x = Model::forward(&c, u, &params, &x).unwrap();
            }
            // Targets other than the inputs: a tied head starts out
            // favouring the input token itself.
            let next: Vec<u32> = (0..2 * 16).map(|i| (i * 37 % 256 + 101) % 256).collect();
            let next = Tensor::from_vec(next, (2, 16), &dev).unwrap();
            let l = loss(&x, &next).unwrap().to_scalar::<f32>().unwrap();
            assert!((l - (256f32).ln()).abs() < 0.3, "initial loss {l}");
        }
        let untied = ModelConfig::default();
        let tied = ModelConfig {
            tied_head: true,
            ..ModelConfig::default()
        };
        assert_eq!(
            untied.parameter_count() - tied.parameter_count(),
            untied.vocab * untied.width
        );
    }
}
