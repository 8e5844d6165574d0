//! Islands' outer sync for `zeropp.torch`: one parameter shard's outer
//! state (anchor, outer momentum, error feedback) and its outer step across
//! the islands (`zeropp_zero::outer` on host buffers, on the job's
//! communication thread).

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use zeropp_quant::{QuantFormat, Rounding};
use zeropp_zero::allreduce::QuantizedAllReduce;
use zeropp_zero::outer::{self, OuterSettings};
use zeropp_zero::{Hop, ZeroError};

use crate::buffers::HostBuf;
use crate::collectives::{Job, Op};
use crate::invalid;

/// The outer state of one parameter shard.
#[pyclass(frozen)]
pub struct OuterState {
    settings: OuterSettings,
    /// The exchange's format (int4 blocks, error feedback), or None: f32.
    quantized: Option<QuantizedAllReduce>,
    state: Arc<Mutex<outer::OuterState>>,
}

#[pymethods]
impl OuterState {
    /// The state of a shard whose weights are `weights` now (a float32
    /// host buffer: the anchor the island starts from). `bits=4` sends
    /// the outer deltas as int4 blocks of `block` values (rotated with
    /// `hadamard`) with error feedback; `bits=None` in f32.
    #[new]
    #[pyo3(signature = (weights, lr=0.7, momentum=0.9, nesterov=true, bits=Some(4), block=64,
                        hadamard=true))]
    fn new(
        weights: &Bound<'_, PyAny>,
        lr: f32,
        momentum: f32,
        nesterov: bool,
        bits: Option<u32>,
        block: usize,
        hadamard: bool,
    ) -> PyResult<OuterState> {
        if !(lr > 0.0 && lr.is_finite() && (0.0..1.0).contains(&momentum)) {
            return Err(invalid(format!(
                "outer lr={lr}, momentum={momentum}: the learning rate must be positive and the \
                 momentum in [0, 1)"
            )));
        }
        let quantized = match bits {
            None => None,
            Some(4) => Some(QuantizedAllReduce {
                format: QuantFormat::int4(block).map_err(|e| invalid(e.to_string()))?,
                rounding: Rounding::NearestEven,
                hadamard,
            }),
            Some(other) => {
                return Err(invalid(format!(
                    "outer bits={other}: the outer deltas travel as int4 (4) or f32 (None)"
                )));
            }
        };
        let buf = HostBuf::new(weights, false, "weights")?;
        let w = buf.typed::<f32>("weights (float32)").map_err(invalid)?;
        Ok(OuterState {
            settings: OuterSettings {
                lr,
                momentum,
                nesterov,
            },
            quantized,
            state: Arc::new(Mutex::new(outer::OuterState::new(w))),
        })
    }

    /// Bytes of outer state held (anchor, momentum, residuals).
    fn bytes(&self) -> usize {
        self.state.lock().map(|s| s.bytes()).unwrap_or(0)
    }

    /// The outer step of `weights` (this rank's shard, float32, in place)
    /// across the islands: the mesh dimension `ranks` of `job` (the ranks
    /// of every island holding this shard, registered with
    /// `add_mesh_dim`). The weights become the new anchor, the same on
    /// every island. An [`Op`] to wait on.
    fn step(&self, job: &Job, weights: &Bound<'_, PyAny>, ranks: Vec<usize>) -> PyResult<Op> {
        let (_, groups) = job.dim_groups(&ranks)?;
        let buf = HostBuf::new(weights, true, "weights")?;
        buf.typed::<f32>("weights (float32)").map_err(invalid)?;
        let (settings, quantized, state) = (self.settings, self.quantized, self.state.clone());
        Ok(job.submit(groups, move |mover| {
            let w = buf
                .typed_mut::<f32>("weights")
                .map_err(ZeroError::Invalid)?;
            let mut state = state
                .lock()
                .map_err(|_| ZeroError::Poisoned("outer state"))?;
            outer::outer_step(mover, Hop::World, settings, quantized, &mut state, w)
        }))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<OuterState>()
}
