//! Fused CPU kernels for the model's row-wise and element-wise layers, each
//! with its backward as one more fused pass. Composed from candle's tensor
//! operations, a layer norm is ten operations (and twenty in backward), the
//! tanh GELU's backward a dozen with two `powf`s, and the causal softmax a
//! mask tensor, a scale, a broadcast add and five more; every one of them
//! allocates its result and walks memory again. These compute the same
//! functions in one pass over each row: the same formulas, summed in f32 in
//! a different order (results agree with the composed forms to rounding;
//! the tests below check values and gradients against them).
//!
//! f32 tensors on the CPU only (the model's); anything else is an error.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Rows handed to one rayon task at least: below this the split costs more
/// than it saves.
const MIN_ELEMS_PER_TASK: usize = 1 << 14;

fn rows_per_task(row_len: usize) -> usize {
    (MIN_ELEMS_PER_TASK / row_len.max(1)).max(1)
}

/// Whether `elems` values of work go to rayon's threads: only when there
/// are several and the work is large enough. A pool of one thread takes
/// each job from this thread and hands it back, two thread switches per
/// operation (a tenth of a small model's step).
fn parallel(elems: usize) -> bool {
    elems >= 2 * MIN_ELEMS_PER_TASK && rayon::current_num_threads() > 1
}

/// Calls `f(i, row)` for row `i` of `out` (rows of `row_len` values).
fn for_rows(out: &mut [f32], row_len: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    if parallel(out.len()) {
        out.par_chunks_mut(row_len)
            .enumerate()
            .with_min_len(rows_per_task(row_len))
            .for_each(|(i, o)| f(i, o));
    } else {
        out.chunks_mut(row_len)
            .enumerate()
            .for_each(|(i, o)| f(i, o));
    }
}

/// Like [`for_rows`], and `f` also adds into an accumulator of `width`
/// values. The rows are cut into fixed chunks, each summed on its own and
/// the chunks' sums added in order, so the result does not depend on the
/// number of threads or on how rayon schedules them (runs stay
/// reproducible).
fn for_rows_fold(
    out: &mut [f32],
    row_len: usize,
    width: usize,
    f: impl Fn(usize, &mut [f32], &mut [f32]) + Sync + Send,
) -> Vec<f32> {
    let per = rows_per_task(row_len);
    let chunk = |(c, rows): (usize, &mut [f32])| {
        let mut acc = vec![0f32; width];
        for (k, o) in rows.chunks_mut(row_len).enumerate() {
            f(c * per + k, o, &mut acc);
        }
        acc
    };
    let partial: Vec<Vec<f32>> = if parallel(out.len()) {
        out.par_chunks_mut(per * row_len)
            .enumerate()
            .map(chunk)
            .collect()
    } else {
        out.chunks_mut(per * row_len)
            .enumerate()
            .map(chunk)
            .collect()
    };
    add_partials(partial, width)
}

/// `f(i, acc)` for rows `0..rows` of `row_len` values each, summed into an
/// accumulator of `width` values in the fixed chunks of [`for_rows_fold`].
fn fold_rows(
    rows: usize,
    row_len: usize,
    width: usize,
    f: impl Fn(usize, &mut [f32]) + Sync + Send,
) -> Vec<f32> {
    let per = rows_per_task(row_len);
    let chunk = |c: usize| {
        let mut acc = vec![0f32; width];
        for i in c * per..((c + 1) * per).min(rows) {
            f(i, &mut acc);
        }
        acc
    };
    let chunks = rows.div_ceil(per);
    let partial: Vec<Vec<f32>> = if parallel(rows * row_len) {
        (0..chunks).into_par_iter().map(chunk).collect()
    } else {
        (0..chunks).map(chunk).collect()
    };
    add_partials(partial, width)
}

fn add_partials(partial: Vec<Vec<f32>>, width: usize) -> Vec<f32> {
    let mut out = vec![0f32; width];
    for p in partial {
        for (a, v) in out.iter_mut().zip(p) {
            *a += v;
        }
    }
    out
}

/// Elements per row when an element-wise operation is cut into rows.
const ELEMENTWISE_ROW: usize = 4096;

/// The f32 slice a contiguous storage holds for `layout`.
fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(data) = s else {
        candle_core::bail!("{what} supports f32 tensors only, got {:?}", s.dtype());
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{what} needs a contiguous tensor"),
    }
}

fn last_dim(l: &Layout) -> Result<usize> {
    l.shape()
        .dims()
        .last()
        .copied()
        .ok_or_else(|| candle_core::Error::Msg("a scalar has no rows".into()))
}

// ----- layer norm -----------------------------------------------------------

/// `(x - mean) / sqrt(var + eps) * w + b` over the last dimension, as
/// `candle_nn::ops::layer_norm_slow` computes it (biased variance).
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?
        .apply_op3(w, b, LayerNorm { eps: eps as f32 })
}

struct LayerNorm {
    eps: f32,
}

/// Mean and 1/std of one row.
fn moments(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = row.iter().sum::<f32>() / n;
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "zeropp-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "layer norm")?;
        let w = f32_slice(s2, l2, "layer norm")?;
        let b = f32_slice(s3, l3, "layer norm")?;
        let d = last_dim(l1)?;
        if w.len() != d || b.len() != d {
            candle_core::bail!("layer norm over {d} values with {} weights", w.len());
        }
        let mut out = vec![0f32; x.len()];
        for_rows(&mut out, d, |r, o| {
            let row = &x[r * d..(r + 1) * d];
            let (mean, rstd) = moments(row, self.eps);
            for i in 0..d {
                o[i] = (row[i] - mean) * rstd * w[i] + b[i];
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = x.dim(candle_core::D::Minus1)?;
        let n = x.elem_count() / d;
        // One pass: rows 0..n are dx, row n is dw, row n + 1 is db.
        let all = x.apply_op3_no_bwd(w, &grad.contiguous()?, &LayerNormGrad { eps: self.eps })?;
        let dx = all.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = all.narrow(0, n, 1)?.reshape(d)?;
        let db = all.narrow(0, n + 1, 1)?.reshape(d)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

struct LayerNormGrad {
    eps: f32,
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "zeropp-layer-norm-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "layer norm")?;
        let w = f32_slice(s2, l2, "layer norm")?;
        let g = f32_slice(s3, l3, "layer norm")?;
        let d = last_dim(l1)?;
        let n = x.len() / d;
        let mut out = vec![0f32; (n + 2) * d];
        let (dx, dwb) = out.split_at_mut(n * d);
        // dx per row; dw, db as per-task partial sums, added at the end.
        let sums = for_rows_fold(dx, d, 2 * d, |r, o, acc| {
            let (row, gr) = (&x[r * d..(r + 1) * d], &g[r * d..(r + 1) * d]);
            let (mean, rstd) = moments(row, self.eps);
            let (mut sum_gw, mut sum_gw_xhat) = (0f32, 0f32);
            for i in 0..d {
                let xhat = (row[i] - mean) * rstd;
                let gw = gr[i] * w[i];
                sum_gw += gw;
                sum_gw_xhat += gw * xhat;
                acc[i] += gr[i] * xhat;
                acc[d + i] += gr[i];
            }
            let (m1, m2) = (sum_gw / d as f32, sum_gw_xhat / d as f32);
            for i in 0..d {
                let xhat = (row[i] - mean) * rstd;
                o[i] = rstd * (gr[i] * w[i] - m1 - xhat * m2);
            }
        });
        dwb.copy_from_slice(&sums);
        Ok((CpuStorage::F32(out), Shape::from((n + 2, d))))
    }
}

// ----- GELU (tanh approximation, GPT-2's gelu_new) --------------------------

/// tanh through `exp`: `1 − 2 / (e^(2x) + 1)`, inputs clamped to ±9.02
/// where f32's tanh is ±1 (so the GELU's 1 − tanh² vanishes there). Its
/// absolute error is a few 1e-7; its relative error is poor near 0, which
/// the GELU never sees (it uses 1 + tanh). libm's `tanhf` per element was a
/// large share of a small model's step; `expf` costs a fraction of it.
/// Eigen's rational tanh was as fast but moved ZeRO++'s 400-step loss on
/// every seed (docs/BENCHMARKS.md), this one not.
#[inline]
fn tanh_fast(x: f32) -> f32 {
    let x = x.clamp(-9.02, 9.02);
    1.0 - 2.0 / ((2.0 * x).exp() + 1.0)
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, as candle's `gelu`.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Gelu)
}

struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "zeropp-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s, l, "gelu")?;
        let mut out = vec![0f32; x.len()];
        for_rows(&mut out, ELEMENTWISE_ROW, |r, o| {
            let x = &x[r * ELEMENTWISE_ROW..r * ELEMENTWISE_ROW + o.len()];
            for (o, &v) in o.iter_mut().zip(x) {
                *o = 0.5 * v * (1.0 + tanh_fast(SQRT_2_OVER_PI * v * (1.0 + GELU_C * v * v)));
            }
        });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&grad.contiguous()?, &GeluGrad)?))
    }
}

struct GeluGrad;

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "zeropp-gelu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "gelu")?;
        let g = f32_slice(s2, l2, "gelu")?;
        let mut out = vec![0f32; x.len()];
        for_rows(&mut out, ELEMENTWISE_ROW, |r, o| {
            let at = r * ELEMENTWISE_ROW..r * ELEMENTWISE_ROW + o.len();
            for ((o, &v), &gr) in o.iter_mut().zip(&x[at.clone()]).zip(&g[at]) {
                let t = tanh_fast(SQRT_2_OVER_PI * v * (1.0 + GELU_C * v * v));
                let dinner = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * v * v);
                *o = gr * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * dinner);
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

// ----- causal softmax ---------------------------------------------------------

/// Softmax over the last dimension of attention scores `[..., t, t]`
/// scaled by `scale`, with the causal mask: query `i` sees keys `0..=i`
/// (masked entries are exactly 0, as with a −1e9 mask added before).
pub fn causal_softmax(scores: &Tensor, scale: f64) -> Result<Tensor> {
    let dims = scores.dims();
    if dims.len() < 2 || dims[dims.len() - 1] != dims[dims.len() - 2] {
        candle_core::bail!("causal softmax needs square [.., t, t] scores, got {dims:?}");
    }
    scores.contiguous()?.apply_op1(CausalSoftmax {
        scale: scale as f32,
    })
}

struct CausalSoftmax {
    scale: f32,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "zeropp-causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s, l, "causal softmax")?;
        let t = last_dim(l)?;
        let mut out = vec![0f32; x.len()];
        for_rows(&mut out, t, |r, o| {
            let row = &x[r * t..(r + 1) * t];
            let seen = r % t + 1;
            let max = row[..seen]
                .iter()
                .fold(f32::NEG_INFINITY, |m, &v| m.max(v * self.scale));
            let mut sum = 0f32;
            for j in 0..seen {
                let e = (row[j] * self.scale - max).exp();
                o[j] = e;
                sum += e;
            }
            let inv = 1.0 / sum;
            for v in &mut o[..seen] {
                *v *= inv;
            }
        });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let g = grad.contiguous()?;
        Ok(Some(res.apply_op2_no_bwd(
            &g,
            &SoftmaxGrad { scale: self.scale },
        )?))
    }
}

struct SoftmaxGrad {
    scale: f32,
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "zeropp-causal-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = f32_slice(s1, l1, "causal softmax")?;
        let g = f32_slice(s2, l2, "causal softmax")?;
        let t = last_dim(l1)?;
        let mut out = vec![0f32; y.len()];
        for_rows(&mut out, t, |r, o| {
            let (yr, gr) = (&y[r * t..(r + 1) * t], &g[r * t..(r + 1) * t]);
            let seen = r % t + 1;
            let dot: f32 = (0..seen).map(|j| yr[j] * gr[j]).sum();
            for j in 0..seen {
                o[j] = self.scale * yr[j] * (gr[j] - dot);
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

// ----- bias and position adds ----------------------------------------------

/// `y + b` with `b` repeated over `y`'s leading rows (`y`'s element count a
/// multiple of `b`'s): a bias over `[.., k]`, or positions `[t, d]` over a
/// batch `[b, t, d]`. Backward sums the gradient's rows in one pass
/// (candle's broadcast add reduces over the broadcast dimensions with a
/// strided walk per element).
pub fn add_rows(y: &Tensor, b: &Tensor) -> Result<Tensor> {
    y.contiguous()?.apply_op2(&b.contiguous()?, AddRows)
}

struct AddRows;

impl CustomOp2 for AddRows {
    fn name(&self) -> &'static str {
        "zeropp-add-rows"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = f32_slice(s1, l1, "add rows")?;
        let b = f32_slice(s2, l2, "add rows")?;
        let m = b.len();
        if m == 0 || !y.len().is_multiple_of(m) {
            candle_core::bail!("cannot repeat {m} values over {} values", y.len());
        }
        let mut out = vec![0f32; y.len()];
        for_rows(&mut out, m, |r, o| {
            for ((o, &v), &bias) in o.iter_mut().zip(&y[r * m..(r + 1) * m]).zip(b) {
                *o = v + bias;
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _y: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.contiguous()?;
        let db = g
            .apply_op1_no_bwd(&SumRows { m: b.elem_count() })?
            .reshape(b.shape())?;
        Ok((Some(g), Some(db)))
    }
}

/// Sums consecutive rows of `m` values into one row.
struct SumRows {
    m: usize,
}

impl CustomOp1 for SumRows {
    fn name(&self) -> &'static str {
        "zeropp-sum-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = f32_slice(s, l, "add rows")?;
        let m = self.m;
        let out = fold_rows(g.len() / m, m, m, |r, acc| {
            for (a, &v) in acc.iter_mut().zip(&g[r * m..(r + 1) * m]) {
                *a += v;
            }
        });
        Ok((CpuStorage::F32(out), Shape::from(m)))
    }
}

// ----- cross-entropy -----------------------------------------------------------

/// Mean cross-entropy of `logits [n, v]` against `targets [n]` (u32), as
/// `candle_nn::loss::cross_entropy` computes it (log-softmax, then the
/// negative log-likelihood of each target), in one pass; its backward is
/// (softmax − one-hot) / n in one more.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, CrossEntropy)
}

fn targets_slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [u32]> {
    let CpuStorage::U32(data) = s else {
        candle_core::bail!("cross-entropy targets must be u32, got {:?}", s.dtype());
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("cross-entropy needs contiguous targets"),
    }
}

/// Checks shapes and targets; returns the vocabulary size.
fn check_logits(logits: &[f32], l: &Layout, targets: &[u32]) -> Result<usize> {
    let v = last_dim(l)?;
    if v == 0 || logits.len() != targets.len() * v {
        candle_core::bail!(
            "cross-entropy of {} logits against {} targets",
            logits.len(),
            targets.len()
        );
    }
    if let Some(&t) = targets.iter().find(|&&t| t as usize >= v) {
        candle_core::bail!("target {t} is outside the vocabulary of {v}");
    }
    Ok(v)
}

/// log Σ exp over a row, stably.
fn log_sum_exp(row: &[f32]) -> f32 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    max + row.iter().map(|&v| (v - max).exp()).sum::<f32>().ln()
}

struct CrossEntropy;

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "zeropp-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "cross-entropy")?;
        let t = targets_slice(s2, l2)?;
        let v = check_logits(x, l1, t)?;
        let total = fold_rows(t.len(), v, 1, |r, acc| {
            let row = &x[r * v..(r + 1) * v];
            acc[0] += log_sum_exp(row) - row[t[r] as usize];
        })[0];
        Ok((
            CpuStorage::F32(vec![total / t.len() as f32]),
            Shape::from(()),
        ))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let d = logits.apply_op3_no_bwd(targets, &grad.contiguous()?, &CrossEntropyGrad)?;
        Ok((Some(d), None))
    }
}

struct CrossEntropyGrad;

impl CustomOp3 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "zeropp-cross-entropy-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "cross-entropy")?;
        let t = targets_slice(s2, l2)?;
        let g = f32_slice(s3, l3, "cross-entropy")?;
        let v = check_logits(x, l1, t)?;
        let Some(&g) = g.first() else {
            candle_core::bail!("cross-entropy's gradient is a scalar");
        };
        let scale = g / t.len() as f32;
        let mut out = vec![0f32; x.len()];
        for_rows(&mut out, v, |r, o| {
            let row = &x[r * v..(r + 1) * v];
            let lse = log_sum_exp(row);
            for (o, &xv) in o.iter_mut().zip(row) {
                *o = (xv - lse).exp() * scale;
            }
            o[t[r] as usize] -= scale;
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{D, Device, Var};

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Value and input gradients of `f` and `reference` under the same
    /// random upstream gradient agree to `tol`.
    fn check(
        inputs: &[Tensor],
        f: impl Fn(&[Tensor]) -> Tensor,
        reference: impl Fn(&[Tensor]) -> Tensor,
        tol: f32,
    ) {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(t).unwrap())
            .collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let (ours, theirs) = (f(&ts), reference(&ts));
        assert!(
            max_diff(&ours, &theirs) <= tol,
            "values differ by {}",
            max_diff(&ours, &theirs)
        );
        let up = randn(ours.dims(), 99);
        let g1 = (&ours * &up)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g2 = (&theirs * &up)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (i, t) in ts.iter().enumerate() {
            let (a, b) = (g1.get(t).unwrap(), g2.get(t).unwrap());
            let d = max_diff(a, b);
            let scale = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
            let scale = scale.to_scalar::<f32>().unwrap().max(1.0);
            assert!(
                d <= tol * scale,
                "gradient of input {i} differs by {d} (scale {scale})"
            );
        }
    }

    #[test]
    fn layer_norm_matches_the_composed_one_in_value_and_gradients() {
        // Rows of 64 and 384 (the model's widths); many rows exercise the
        // parallel partial sums of dw and db.
        for (shape, d) in [(vec![3, 5, 64], 64), (vec![2, 700, 384], 384)] {
            let x = randn(&shape, 1);
            let w = (randn(&[d], 2) + 1.0).unwrap();
            let b = randn(&[d], 3);
            check(
                &[x, w, b],
                |t| layer_norm(&t[0], &t[1], &t[2], 1e-5).unwrap(),
                |t| candle_nn::ops::layer_norm_slow(&t[0], &t[1], &t[2], 1e-5).unwrap(),
                2e-5,
            );
        }
    }

    #[test]
    fn fast_tanh_is_within_a_few_1e7_of_libm_and_saturates_exactly() {
        let mut worst = 0f32;
        for i in -200_000..=200_000 {
            let x = i as f32 * 1e-4; // -20 .. 20
            let (a, b) = (tanh_fast(x), x.tanh());
            worst = worst.max((a - b).abs());
            assert!(a.abs() <= 1.0, "tanh({x}) = {a}");
        }
        assert!(worst <= 4.0 * f32::EPSILON, "absolute error {worst}");
        assert_eq!(tanh_fast(0.0), 0.0);
        for x in [9.02f32, 20.0, 1e30, f32::INFINITY] {
            assert_eq!(tanh_fast(x), 1.0);
            assert_eq!(tanh_fast(-x), -1.0);
        }
    }

    #[test]
    fn gelu_matches_candles_in_value_and_gradient() {
        let x = randn(&[4, 33, 256], 4);
        check(
            &[x],
            |t| gelu(&t[0]).unwrap(),
            |t| t[0].gelu().unwrap(),
            2e-5,
        );
    }

    #[test]
    fn causal_softmax_matches_mask_scale_and_softmax() {
        let (b, h, t) = (2, 3, 17);
        let scale = 0.125;
        let mask: Vec<f32> = (0..t * t)
            .map(|i| if i % t > i / t { -1e9 } else { 0.0 })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap();
        let s = randn(&[b, h, t, t], 5);
        check(
            &[s],
            |x| causal_softmax(&x[0], scale).unwrap(),
            |x| {
                let z = (&x[0] * scale).unwrap().broadcast_add(&mask).unwrap();
                candle_nn::ops::softmax(&z, D::Minus1).unwrap()
            },
            2e-6,
        );
    }

    #[test]
    fn add_rows_matches_a_broadcast_add_for_biases_and_positions() {
        let y = randn(&[3, 7, 16], 7);
        check(
            &[y.clone(), randn(&[16], 8)],
            |t| add_rows(&t[0], &t[1]).unwrap(),
            |t| t[0].broadcast_add(&t[1]).unwrap(),
            1e-6,
        );
        check(
            &[y, randn(&[7, 16], 9)],
            |t| add_rows(&t[0], &t[1]).unwrap(),
            |t| t[0].broadcast_add(&t[1]).unwrap(),
            1e-6,
        );
    }

    #[test]
    fn cross_entropy_matches_candles_in_value_and_gradient() {
        let (n, v) = (300, 256);
        let logits = (randn(&[n, v], 10) * 3.0).unwrap();
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 11) % v as u32).collect();
        let targets = Tensor::from_vec(ids, n, &Device::Cpu).unwrap();
        let (tt, tt2) = (targets.clone(), targets.clone());
        check(
            &[logits],
            move |t| cross_entropy(&t[0], &tt).unwrap(),
            move |t| candle_nn::loss::cross_entropy(&t[0], &tt2).unwrap(),
            2e-6,
        );
        let bad = Tensor::from_vec(vec![0u32, 256], 2, &Device::Cpu).unwrap();
        let x = randn(&[2, 256], 11);
        let err = cross_entropy(&x, &bad).unwrap_err().to_string();
        assert!(
            err.contains("target 256 is outside the vocabulary of 256"),
            "{err}"
        );
    }

    #[test]
    fn reductions_do_not_depend_on_the_number_of_threads() {
        let x = randn(&[3, 900, 64], 12);
        let w = randn(&[64], 13);
        let g = randn(&[3, 900, 64], 14);
        let grads = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let all = x
                    .apply_op3_no_bwd(&w, &g, &LayerNormGrad { eps: 1e-5 })
                    .unwrap();
                let db = g.apply_op1_no_bwd(&SumRows { m: 64 }).unwrap();
                (
                    all.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    db.to_vec1::<f32>().unwrap(),
                )
            })
        };
        let one = grads(1);
        assert_eq!(one, grads(2), "bit-identical with 1 and 2 threads");
        assert_eq!(one, grads(3));
    }

    #[test]
    fn wrong_inputs_are_errors_not_panics() {
        let x = randn(&[2, 8], 6);
        let half = x.to_dtype(candle_core::DType::F16).unwrap();
        assert!(gelu(&half).unwrap_err().to_string().contains("f32"));
        let w = Tensor::ones(5, candle_core::DType::F32, &Device::Cpu).unwrap();
        let err = layer_norm(&x, &w, &w, 1e-5).unwrap_err().to_string();
        assert!(err.contains("8 values with 5 weights"), "{err}");
        assert!(
            causal_softmax(&x, 1.0)
                .unwrap_err()
                .to_string()
                .contains("square")
        );
    }
}
