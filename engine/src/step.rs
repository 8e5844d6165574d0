//! One training step as its named phases (docs/ARCHITECTURE.md, the life of
//! a training step): the forward pass unit by unit, the backward pass in
//! reverse unit order with each unit's gradient reduce-scattered, one
//! all-reduce for the global norm, the loss and the non-finite flags, and
//! the optimizer step. Evaluation is the forward pass alone.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use super::model::{Tied, extend_with, param_offset, vars_from_flat};
use super::{Engine, EngineError, MAX_GRADS_IN_FLIGHT, Result, StepStats};
use zeropp_comm::collectives::Pending;
use zeropp_zero::traffic::Phase;
use zeropp_zero::{ZeroError, scratch};

/// Seconds the compute thread spent waiting on communication.
#[derive(Default)]
struct Waited(f64);

impl Waited {
    /// Runs `f` (a wait on communication), counting its time.
    fn time<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let t = std::time::Instant::now();
        let r = f();
        self.0 += t.elapsed().as_secs_f64();
        r
    }
}

/// What the forward pass keeps for the backward pass.
struct Forward {
    /// Each unit's input (the activation checkpoints).
    saved: Vec<Tensor>,
    /// The tied parameter, until its `to` unit's backward.
    tied: Tied,
}

/// What the backward pass leaves for the optimizer.
struct Backward {
    /// This rank's loss on its batch.
    loss: f32,
    /// Each unit's gradient: this rank's chunk of the mean over all ranks.
    chunk_grads: Vec<Vec<f32>>,
    /// Units whose local gradient held a NaN or an infinity (sent as
    /// zeros).
    nonfinite: Vec<bool>,
}

/// The step's one all-reduce, read back.
struct GlobalNorm {
    grad_norm: f32,
    mean_loss: f32,
    /// Names of the units with a non-finite gradient on some rank.
    bad_units: Vec<String>,
}

impl GlobalNorm {
    fn finite(&self) -> bool {
        self.grad_norm.is_finite() && self.mean_loss.is_finite() && self.bad_units.is_empty()
    }
}

impl Engine {
    /// Forward only (no state change): the mean loss over all ranks of the
    /// given batches. Counted as `Other` traffic.
    pub fn evaluate(&mut self, inputs: &Tensor, targets: &Tensor) -> Result<f32> {
        let (model, tie) = (self.cfg.model.clone(), self.cfg.model.tie());
        let mut x = inputs.clone();
        let mut tied = Tied::default();
        for u in 0..self.units.len() {
            let full = self.start_primary_gather(u, Phase::Other)?.wait()?.full;
            let mut params = self.full_params(u, full)?;
            tied.apply(tie, u, &mut params);
            x = model.forward(u, &params, &x)?;
        }
        let l = model.loss(&x, targets)?.to_scalar::<f32>()?;
        let world = self.groups.world.clone();
        let counter = self.counter.clone();
        let w = self.plan.layout.world() as f32;
        let sum = self.thread.submit(move |c| {
            counter.set_phase(Phase::Other, 0.0);
            c.all_reduce_f32(&world, &[l])
        });
        Ok(sum.wait()?[0] / w)
    }

    /// One training step on this rank's batch: forward, backward with the
    /// gradient reduce-scatter, global norm, clipping, AdamW at `lr`.
    pub fn train_step(&mut self, inputs: &Tensor, targets: &Tensor, lr: f32) -> Result<StepStats> {
        let started = std::time::Instant::now();
        let before = self.traffic();
        let mut waited = Waited::default();
        let forward = self.forward_pass(inputs, &mut waited)?;
        let backward = self.backward_pass(forward, targets, &mut waited)?;
        let norm = self.global_norm(&backward, &mut waited)?;
        let skipped = if norm.finite() {
            self.optimizer_step(backward.chunk_grads, norm.grad_norm, lr);
            None
        } else {
            Some(self.skip_step(&norm)?)
        };
        if let Some(run) = self.islands.as_mut()
            && run.cfg.auto
            && run.chosen.is_none()
        {
            run.step_times.push(started.elapsed().as_secs_f64());
        }
        Ok(StepStats {
            loss: norm.mean_loss,
            grad_norm: norm.grad_norm,
            traffic: self.traffic().since(&before),
            skipped,
            waited_s: waited.0,
        })
    }

    /// Forward, unit by unit (the next unit's gather under way while this
    /// one computes), keeping each unit's input, hpZ's secondary shards and
    /// the tied parameter.
    fn forward_pass(&mut self, inputs: &Tensor, waited: &mut Waited) -> Result<Forward> {
        let (model, tie) = (self.cfg.model.clone(), self.cfg.model.tie());
        let n = self.units.len();
        let mut tied = Tied::default();
        let mut saved = Vec::with_capacity(n);
        let mut x = inputs.clone();
        let mut pending = Some(self.start_primary_gather(0, Phase::ForwardGather)?);
        for u in 0..n {
            let gathered = waited.time(|| pending.take().expect("started").wait())?;
            if u + 1 < n {
                pending = Some(self.start_primary_gather(u + 1, Phase::ForwardGather)?);
            }
            let full = gathered.full;
            if let Some(old) = std::mem::replace(&mut self.units[u].secondary, gathered.secondary) {
                crate::recycle(old);
            }
            let mut params = self.full_params(u, full)?;
            tied.apply(tie, u, &mut params);
            saved.push(x.clone());
            x = model.forward(u, &params, &x)?;
        }
        Ok(Forward { saved, tied })
    }

    /// Backward, in reverse unit order: each unit gathered again (inside
    /// the hpZ group when it has a secondary shard), recomputed from its
    /// saved input and differentiated; its gradient's reduce-scatter starts
    /// at once, with at most `MAX_GRADS_IN_FLIGHT` under way.
    fn backward_pass(
        &mut self,
        forward: Forward,
        targets: &Tensor,
        waited: &mut Waited,
    ) -> Result<Backward> {
        let Forward { saved, tied } = forward;
        let (model, tie) = (self.cfg.model.clone(), self.cfg.model.tie());
        let n = self.units.len();
        let mut upstream: Option<Tensor> = None;
        let mut grads_pending: Vec<(usize, Pending<Vec<f32>, ZeroError>)> = Vec::with_capacity(n);
        let mut pending = Some(self.start_backward_gather(n - 1)?);
        let mut step_loss = f32::NAN;
        let mut tied_grad: Option<Vec<f32>> = None;
        let mut nonfinite = vec![false; n];
        let mut chunk_grads: Vec<Vec<f32>> = vec![Vec::new(); n];
        for u in (0..n).rev() {
            let full = waited
                .time(|| pending.take().expect("started").wait())?
                .full;
            if u > 0 {
                pending = Some(self.start_backward_gather(u - 1)?);
            }
            let vars = vars_from_flat(&*model, u, &full, &self.device)?;
            // The variables hold their own copy.
            drop(full);
            let mut tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            // A tie's `to` unit differentiates the tied parameter too; that
            // gradient joins the `from` unit's own in its backward.
            let tied_var = match (tie, tied.value()) {
                (Some(t), Some(value)) if t.to == u => Some(Var::from_tensor(value)?),
                _ => None,
            };
            if let Some(tv) = &tied_var {
                tensors.push(tv.as_tensor().clone());
            }
            let input_var = if u > 0 {
                Some(Var::from_tensor(&saved[u])?)
            } else {
                None
            };
            let input = input_var
                .as_ref()
                .map(|v| v.as_tensor().clone())
                .unwrap_or_else(|| saved[u].clone());
            let out = model.forward(u, &tensors, &input)?;
            let objective = match &upstream {
                None => {
                    let l = model.loss(&out, targets)?;
                    step_loss = l.to_scalar::<f32>()?;
                    l
                }
                Some(up) => (out * up)?.sum_all()?,
            };
            let grads = objective.backward()?;
            let tied_var = tied_var.as_ref();
            let mut flat = self.flat_gradient(u, &grads, &vars, (tied_var, &mut tied_grad))?;
            upstream = match &input_var {
                Some(iv) => Some(grads.get(iv.as_tensor()).cloned().ok_or_else(|| {
                    EngineError::NoGradient {
                        unit: self.units[u].name.clone(),
                    }
                })?),
                None => None,
            };
            // A NaN/Inf must not reach the quantizers or the sums: this
            // rank sends zeros instead and raises the unit's flag in the
            // step's all-reduce, so every rank stops (or skips) together.
            if flat.iter().any(|v| !v.is_finite()) {
                flat.iter_mut().for_each(|v| *v = 0.0);
                nonfinite[u] = true;
            }
            drop((grads, vars, tensors));
            // At most MAX_GRADS_IN_FLIGHT gradients wait for their
            // reduce-scatter: a slow link must not queue the whole model's
            // gradients (O(Ψ) per rank) behind it.
            if grads_pending.len() >= MAX_GRADS_IN_FLIGHT {
                let (v, p) = grads_pending.remove(0);
                chunk_grads[v] = waited.time(|| self.finish_gradient(v, p))?;
            }
            grads_pending.push((u, self.start_gradient(u, flat)?));
        }
        for (u, p) in grads_pending {
            chunk_grads[u] = waited.time(|| self.finish_gradient(u, p))?;
        }
        #[cfg(test)]
        self.inject_nan(&mut chunk_grads);
        Ok(Backward {
            loss: step_loss,
            chunk_grads,
            nonfinite,
        })
    }

    /// Unit `u`'s gradient as one flat buffer (padded; a reused buffer the
    /// reduce-scatter gives back): its variables' gradients in order, with
    /// a tie's gradient, kept from the unit that differentiated the tied
    /// parameter (`tied_var`), added where the parameter lives.
    fn flat_gradient(
        &self,
        u: usize,
        grads: &GradStore,
        vars: &[Var],
        (tied_var, tied_grad): (Option<&Var>, &mut Option<Vec<f32>>),
    ) -> Result<Vec<f32>> {
        let (model, tie) = (&*self.cfg.model, self.cfg.model.tie());
        let mut flat = scratch::take_for_overwrite(self.units[u].padded);
        flat.clear();
        for v in vars {
            match grads.get(v.as_tensor()) {
                Some(gt) => extend_with(&mut flat, gt)?,
                None => flat.extend(std::iter::repeat_n(0.0, v.as_tensor().elem_count())),
            }
        }
        flat.resize(self.units[u].padded, 0.0);
        if let Some(gt) = tied_var.and_then(|tv| grads.get(tv.as_tensor())) {
            *tied_grad = Some(gt.flatten_all()?.to_vec1::<f32>()?);
        }
        if let Some(t) = tie.filter(|t| t.from == u)
            && let Some(tg) = tied_grad.take()
        {
            let at = param_offset(model, u, t.param);
            flat[at..].iter_mut().zip(&tg).for_each(|(f, t)| *f += t);
        }
        Ok(flat)
    }

    /// The global gradient norm, the mean loss and one non-finite flag per
    /// unit in one all-reduce: a NaN or Inf anywhere is seen by every rank
    /// on the step it appears, with the units it is in.
    fn global_norm(&self, backward: &Backward, waited: &mut Waited) -> Result<GlobalNorm> {
        let n = self.units.len();
        // One pass: the squared norm in rank-chunk order, and each chunk's
        // own sum of squares, non-finite exactly when the chunk holds a NaN
        // or Inf (or overflows).
        let mut total = 0f32;
        let unit_sumsq: Vec<f32> = backward
            .chunk_grads
            .iter()
            .map(|gr| {
                let mut unit = 0f32;
                for v in gr {
                    total += v * v;
                    unit += v * v;
                }
                unit
            })
            .collect();
        let mut local: Vec<f32> = Vec::with_capacity(2 + n);
        local.push(total);
        local.push(backward.loss);
        local.extend(
            unit_sumsq
                .iter()
                .zip(&backward.nonfinite)
                .map(|(sq, &bad)| f32::from(bad || !sq.is_finite())),
        );
        let world = self.groups.world.clone();
        let counter = self.counter.clone();
        let reduced = waited.time(|| {
            self.thread
                .submit(move |c| {
                    counter.set_phase(Phase::Other, 0.0);
                    c.all_reduce_f32(&world, &local)
                })
                .wait()
        })?;
        let w = self.plan.layout.world() as f32;
        Ok(GlobalNorm {
            grad_norm: reduced[0].sqrt(),
            mean_loss: reduced[1] / w,
            bad_units: (0..n)
                .filter(|&u| reduced[2 + u] != 0.0)
                .map(|u| self.units[u].name.clone())
                .collect(),
        })
    }

    /// Tests: a NaN in the chunk gradient of the step, unit and rank that
    /// `inject_nan` names (once).
    #[cfg(test)]
    fn inject_nan(&mut self, chunk_grads: &mut [Vec<f32>]) {
        if let Some((step, unit, rank)) = self.inject_nan
            && step == self.step + 1
        {
            self.inject_nan = None;
            if rank == self.plan.layout.rank {
                chunk_grads[unit][0] = f32::NAN;
            }
        }
    }

    /// A step with a non-finite loss or gradient: an error naming the step
    /// and the units, or with `skip_nonfinite` no update, residuals that may
    /// hold the NaN restarted from zero, and the gathered weights dropped as
    /// after any step. Gives the units' names.
    fn skip_step(&mut self, norm: &GlobalNorm) -> Result<Vec<String>> {
        let GlobalNorm {
            grad_norm,
            mean_loss,
            bad_units,
        } = norm;
        if !self.cfg.optim.skip_nonfinite {
            return Err(EngineError::NonFinite {
                step: self.step + 1,
                loss: *mean_loss,
                grad_norm: *grad_norm,
                units: bad_units.clone(),
            });
        }
        for su in &mut self.units {
            su.reset_residuals();
            su.secondary = None;
        }
        Ok(bad_units.clone())
    }

    /// Clipping to `max_grad_norm`, then AdamW at `lr` on every master
    /// chunk; the gathered weights (hpZ's secondary shards) are stale then.
    fn optimizer_step(&mut self, chunk_grads: Vec<Vec<f32>>, grad_norm: f32, lr: f32) {
        let max = self.cfg.optim.max_grad_norm;
        let clip = if max > 0.0 && grad_norm > max {
            max / (grad_norm + 1e-6)
        } else {
            1.0
        };
        self.step += 1;
        for (su, mut gr) in self.units.iter_mut().zip(chunk_grads) {
            gr.iter_mut().for_each(|v| *v *= clip);
            su.adam.update(
                &self.cfg.optim,
                lr,
                self.step,
                std::sync::Arc::make_mut(&mut su.master).as_mut_slice(),
                &gr,
                &su.decay,
            );
            scratch::give(gr);
            if let Some(s) = su.secondary.take() {
                crate::recycle(s);
            }
        }
    }
}
