//! What the engine needs of a model: a list of *units* (the granularity of
//! gather and release), each a flat parameter buffer cut into tensors of
//! known shapes, and each a pure function of its parameters and its input.
//! The model knows nothing of sharding; the built-in GPT
//! (`train::model::ModelConfig`) is one implementation.

use candle_core::{Device, Result, Tensor, Var};

/// A parameter that a later unit uses too (a GPT head tied to the token
/// embedding): unit `to` takes parameter `param` of unit `from` after its
/// own parameters, and the gradient it gets there joins `from`'s own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tie {
    pub from: usize,
    pub param: usize,
    pub to: usize,
}

/// A model's setting that does not fit: which, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{setting} {why}")]
pub struct InvalidModel {
    pub setting: &'static str,
    pub why: String,
}

/// A model the engine can shard: units in forward order, the shapes of
/// each unit's parameters (in the order of its flat buffer), their initial
/// values, each unit's forward and the loss on the last unit's output.
pub trait Model: Send + Sync + std::fmt::Debug {
    /// The model's own settings, checked: what is wrong, else `Ok`.
    fn validate(&self) -> std::result::Result<(), InvalidModel>;
    /// Units, in forward order.
    fn unit_count(&self) -> usize;
    /// A unit's name (in errors, checkpoints and summaries).
    fn unit_name(&self, unit: usize) -> String;
    /// The shapes of a unit's parameters, in the order of its flat buffer.
    fn param_shapes(&self, unit: usize) -> Vec<Vec<usize>>;
    /// A unit's initial flat buffer, deterministic for `seed`.
    fn init(&self, unit: usize, seed: u64) -> Vec<f32>;
    /// At most one tied parameter.
    fn tie(&self) -> Option<Tie>;
    /// Runs a unit: `params` in `param_shapes` order (then a tied
    /// parameter, if this unit is a tie's `to`); `input` is the batch's
    /// inputs for the first unit and the previous unit's output otherwise.
    fn forward(&self, unit: usize, params: &[Tensor], input: &Tensor) -> Result<Tensor>;
    /// The scalar loss of the last unit's output against the targets.
    fn loss(&self, output: &Tensor, targets: &Tensor) -> Result<Tensor>;

    /// Values in a unit's flat buffer (unpadded).
    fn unit_numel(&self, unit: usize) -> usize {
        self.param_shapes(unit)
            .iter()
            .map(|s| s.iter().product::<usize>())
            .sum()
    }

    /// Parameters of the whole model.
    fn parameter_count(&self) -> usize {
        (0..self.unit_count()).map(|u| self.unit_numel(u)).sum()
    }
}

/// Each parameter's range in the flat buffer, with its shape.
fn param_ranges(shapes: Vec<Vec<usize>>) -> Vec<(std::ops::Range<usize>, Vec<usize>)> {
    let mut off = 0;
    shapes
        .into_iter()
        .map(|shape| {
            let range = off..off + shape.iter().product::<usize>();
            off = range.end;
            (range, shape)
        })
        .collect()
}

/// Where parameter `param` of `unit` starts in its flat buffer.
pub fn param_offset(model: &dyn Model, unit: usize, param: usize) -> usize {
    model.param_shapes(unit)[..param]
        .iter()
        .map(|s| s.iter().product::<usize>())
        .sum()
}

/// Cuts a flat buffer into the unit's parameter tensors (copies).
pub fn tensors_from_flat(
    model: &dyn Model,
    unit: usize,
    flat: &[f32],
    device: &Device,
) -> Result<Vec<Tensor>> {
    param_ranges(model.param_shapes(unit))
        .into_iter()
        .map(|(r, shape)| Tensor::from_slice(&flat[r], shape, device))
        .collect()
}

/// Like [`tensors_from_flat`], but without a copy: the buffer becomes one
/// tensor and each parameter a view of it (for the forward pass, where
/// nothing is differentiated).
pub fn tensors_from_owned(
    model: &dyn Model,
    unit: usize,
    flat: Vec<f32>,
    device: &Device,
) -> Result<Vec<Tensor>> {
    let len = flat.len();
    let all = Tensor::from_vec(flat, len, device)?;
    param_ranges(model.param_shapes(unit))
        .into_iter()
        .map(|(r, shape)| all.narrow(0, r.start, r.len())?.reshape(shape))
        .collect()
}

/// Like [`tensors_from_flat`], but as variables to differentiate (one copy
/// of the buffer: a tensor turned into a `Var` would be copied again).
pub fn vars_from_flat(
    model: &dyn Model,
    unit: usize,
    flat: &[f32],
    device: &Device,
) -> Result<Vec<Var>> {
    param_ranges(model.param_shapes(unit))
        .into_iter()
        .map(|(r, shape)| Var::from_slice(&flat[r], shape, device))
        .collect()
}

/// Appends an f32 tensor's values to `out`: read straight from its storage
/// when it is contiguous on the CPU, else through a copy.
pub fn extend_with(out: &mut Vec<f32>, t: &Tensor) -> Result<()> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(data)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            out.extend_from_slice(&data[a..b]);
            return Ok(());
        }
    }
    out.extend(t.flatten_all()?.to_vec1::<f32>()?);
    Ok(())
}

/// The tied parameter as units run in order: kept when its unit runs, and
/// handed to the tie's `to` unit after that unit's own parameters.
#[derive(Default)]
pub struct Tied {
    value: Option<Tensor>,
}

impl Tied {
    /// Adds to `params` (unit `unit`'s, just gathered) what the tie asks.
    pub fn apply(&mut self, tie: Option<Tie>, unit: usize, params: &mut Vec<Tensor>) {
        let Some(t) = tie else { return };
        if unit == t.from {
            self.value = params.get(t.param).cloned();
        }
        if unit == t.to {
            params.extend(self.value.clone());
        }
    }

    /// The tied parameter, once its unit has run.
    pub fn value(&self) -> Option<&Tensor> {
        self.value.as_ref()
    }
}
