//! A parameter group's plan and state as zeropp.torch holds them: the
//! mesh dimension's `Plan` (how its collectives move data, decided once)
//! and what each parameter group keeps for them — qgZ's error feedback
//! (`QgzState`), the replicate all-reduce's (`AllReduceState`), and qwZ's
//! references of weight differences (`QwzReference`) — on the host and on
//! each device.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use pyo3::prelude::*;
use zeropp_cuda::device::DeviceQuantizedChunks;
use zeropp_quant::{QuantFormat, QuantizedChunks, Rounding};
use zeropp_zero::device_job::DeviceFeedback;
use zeropp_zero::fsdp::{GradWire, WeightWire};
use zeropp_zero::layout::Layout;
use zeropp_zero::plan;
use zeropp_zero::residual::Residual;
use zeropp_zero::{ZeroError, allreduce, delta, qgz};

use crate::to_py;

fn poisoned() -> ZeroError {
    ZeroError::Poisoned("error-feedback buffer")
}

/// How one mesh dimension's collectives move data (`zeropp_zero::plan::Plan`,
/// decided once from its resolved switches by `Job.plan`), and the maker of
/// the state each parameter group keeps for them. Every call of a group
/// passes its plan; nothing is re-decided per call.
#[pyclass(frozen)]
pub struct Plan {
    pub(crate) plan: plan::Plan,
    switches: plan::Switches,
}

impl Plan {
    /// The plan of resolved `switches` on `layout` (a mesh dimension's).
    pub(crate) fn new(layout: Layout, switches: plan::Switches) -> Result<Plan, ZeroError> {
        let plan = plan::Plan::new(layout, &switches)?;
        Ok(Plan { plan, switches })
    }

    /// The gather of a group over the world (`over_world`) or a sub-group,
    /// of bf16 tensors or others; `with_references`: the caller passes the
    /// group's references (qwZ on weight differences needs them).
    pub(crate) fn gather(
        &self,
        over_world: bool,
        bf16: bool,
        with_references: bool,
    ) -> Result<WeightWire, ZeroError> {
        let how = self.plan.weights.for_call(over_world, bf16);
        if matches!(how, WeightWire::Delta(_)) && !with_references {
            return Err(ZeroError::Invalid(
                "this plan gathers weight differences: pass the group's references \
                 (delta=plan.qwz_reference(), made once per parameter group)"
                    .into(),
            ));
        }
        Ok(how)
    }
}

#[pymethods]
impl Plan {
    /// hpZ over the whole node with qwZ on weight differences: the
    /// references are the secondary shard and serve the backward gather
    /// inside the node (FSDP2 keeps no second copy after forward).
    #[getter]
    fn references_serve_backward(&self) -> bool {
        matches!(self.plan.weights, WeightWire::Delta(d) if d.hpz)
    }

    /// qwZ's references of weight differences for one parameter group
    /// (its cross-node peers' shards, 1/G of the group; f32, or bf16 with
    /// qwz_bf16_references; in host memory with qwz_host_references), or
    /// None where this plan sends no differences.
    fn qwz_reference(&self) -> Option<QwzReference> {
        matches!(self.plan.weights, WeightWire::Delta(_)).then(|| QwzReference {
            frozen: Mutex::new(Vec::new()),
            host_references: self.switches.qwz_host_references,
            reference: Mutex::new(None),
            device: Mutex::new(None),
        })
    }

    /// qgZ's state for one parameter group (its rounding seeded by `seed`,
    /// its error feedback), or None where this plan reduce-scatters plainly.
    #[pyo3(signature = (seed=0))]
    fn qgz_state(&self, seed: u64) -> Option<QgzState> {
        match self.plan.grads {
            wire @ GradWire::TwoHop { .. } => Some(QgzState {
                wire,
                keeps: wire.keeps(self.plan.layout.ranks_per_node),
                seed,
                calls: AtomicU64::new(0),
                feedback: Default::default(),
            }),
            GradWire::RingBf16 | GradWire::RingF32 => None,
        }
    }

    /// The quantized all-reduce's state for one parameter group across
    /// HSDP's replicate dimension, where this plan (resolved on that
    /// dimension) keeps qgZ: int4 blocks of qgZ's hop across nodes, rotated
    /// with `qgz_hadamard`, error feedback with `error_feedback`; else None
    /// (ZeRO-3's reduce-scatter and all-gather).
    #[pyo3(signature = (seed=0))]
    fn all_reduce_state(&self, seed: u64) -> Option<AllReduceState> {
        match self.plan.grads {
            GradWire::TwoHop {
                inter,
                error_feedback,
                stochastic,
                hadamard,
                ..
            } => Some(AllReduceState::of(
                inter,
                (error_feedback, stochastic, hadamard),
                seed,
            )),
            GradWire::RingBf16 | GradWire::RingF32 => None,
        }
    }
}

/// The qgZ settings and error-feedback state of one FSDP parameter group:
/// what each quantization dropped, added back on the next reduce-scatter.
#[pyclass(frozen)]
pub struct QgzState {
    /// The plan's wire (`GradWire::TwoHop`).
    wire: GradWire,
    /// Whether each hop keeps error feedback on the plan's layout: (inside
    /// the node, across).
    keeps: (bool, bool),
    seed: u64,
    calls: AtomicU64,
    /// The residuals of the hop inside the node and of the hop across.
    pub(crate) feedback: HeldFeedback,
}

/// The error feedback of one parameter group's collective: what each of
/// its two quantizations dropped last call, on the host and the same on
/// the CUDA device and on the emulated device (made on first use).
#[derive(Default)]
pub(crate) struct HeldFeedback {
    pub(crate) host: [Mutex<Residual>; 2],
    pub(crate) device: Mutex<DeviceFeedback<DeviceQuantizedChunks>>,
    pub(crate) emulated: Mutex<DeviceFeedback<QuantizedChunks>>,
}

impl HeldFeedback {
    /// Values held on the host.
    fn len(&self) -> usize {
        let len = |r: &Mutex<Residual>| r.lock().map(|r| r.len()).unwrap_or(0);
        self.host.iter().map(len).sum()
    }

    /// Bytes held everywhere (compressed: about 0.625 a value).
    fn bytes(&self) -> usize {
        let host = |r: &Mutex<Residual>| r.lock().map(|r| r.bytes()).unwrap_or(0);
        self.host.iter().map(host).sum::<usize>()
            + self.device.lock().map(|f| f.bytes()).unwrap_or(0)
            + self.emulated.lock().map(|f| f.bytes()).unwrap_or(0)
    }

    /// Everything held starts over.
    fn reset(&self) {
        for r in &self.host {
            if let Ok(mut r) = r.lock() {
                *r = Residual::none();
            }
        }
        if let Ok(mut f) = self.device.lock() {
            f.reset();
        }
        if let Ok(mut f) = self.emulated.lock() {
            f.reset();
        }
    }
}

impl QgzState {
    /// This group's wire (the plan's).
    pub(crate) fn wire(&self) -> GradWire {
        self.wire
    }

    /// The rounding of this group's next reduce-scatter on `rank` (call
    /// numbers counted per group, `qgz::rounding`).
    pub(crate) fn rounding(&self, rank: usize) -> Rounding {
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        let stochastic = matches!(
            self.wire,
            GradWire::TwoHop {
                stochastic: true,
                ..
            }
        );
        qgz::rounding(stochastic, self.seed, call, 0, rank)
    }

    /// Whether each hop keeps error feedback: (inside the node, across).
    pub(crate) fn keeps(&self) -> (bool, bool) {
        self.keeps
    }
}

#[pymethods]
impl QgzState {
    /// Whether the hop across nodes keeps error feedback.
    #[getter]
    fn error_feedback(&self) -> bool {
        self.keeps.1
    }

    /// Whether the hop inside the node keeps error feedback too (only at
    /// int4, on nodes of more than one rank:
    /// `zeropp_zero::qgz::first_hop_feedback`).
    #[getter]
    fn first_hop_feedback(&self) -> bool {
        self.keeps.0
    }

    /// Values of error-feedback state held (both hops).
    fn residual_len(&self) -> usize {
        self.feedback.len()
    }

    /// Bytes of error-feedback state held (both hops, host and device;
    /// compressed: about 0.625 a value).
    fn residual_bytes(&self) -> usize {
        self.feedback.bytes()
    }

    /// Error feedback starts over (after a checkpoint load).
    fn reset(&self) {
        self.feedback.reset()
    }
}

/// The quantized all-reduce of one FSDP parameter group across HSDP's
/// replicate dimension: its format and what each of its two quantizations
/// dropped last step (error feedback).
#[pyclass(frozen)]
pub struct AllReduceState {
    format: QuantFormat,
    hadamard: bool,
    /// Both quantizations keep error feedback.
    pub(crate) error_feedback: bool,
    stochastic: bool,
    seed: u64,
    calls: AtomicU64,
    /// The residuals of what it sent and of its own part of the result
    /// (on a device: `first` and `second`).
    pub(crate) feedback: HeldFeedback,
}

impl AllReduceState {
    /// int4 blocks of `format`, rotated first with `hadamard`, error
    /// feedback on both quantizations with `error_feedback`.
    fn of(
        format: QuantFormat,
        (error_feedback, stochastic, hadamard): (bool, bool, bool),
        seed: u64,
    ) -> AllReduceState {
        AllReduceState {
            format,
            hadamard,
            error_feedback,
            stochastic,
            seed,
            calls: AtomicU64::new(0),
            feedback: Default::default(),
        }
    }

    /// This group's next all-reduce on `rank` (call numbers counted per
    /// group, `qgz::rounding`).
    pub(crate) fn settings(&self, rank: usize) -> allreduce::QuantizedAllReduce {
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        allreduce::QuantizedAllReduce {
            format: self.format,
            rounding: qgz::rounding(self.stochastic, self.seed, call, 1, rank),
            hadamard: self.hadamard,
        }
    }
}

#[pymethods]
impl AllReduceState {
    #[getter]
    fn error_feedback(&self) -> bool {
        self.error_feedback
    }

    /// Bytes of error-feedback state held (host and device; compressed:
    /// about 0.625 a value).
    fn residual_bytes(&self) -> usize {
        self.feedback.bytes()
    }

    /// Error feedback starts over (after a checkpoint load).
    fn reset(&self) {
        self.feedback.reset()
    }
}

/// qwZ on weight differences for one FSDP parameter group: this rank's
/// references of its cross group's shards (`zeropp_zero::delta`).
#[pyclass(frozen)]
pub struct QwzReference {
    /// The ranges of this rank's shard (start, length) that hold frozen
    /// parameters, as zeropp.torch sets them before each gather
    /// (`delta::Slot`).
    frozen: Mutex<Vec<(usize, usize)>>,
    /// CUDA tensors' references kept in host memory (`qwz_host_references`).
    pub(crate) host_references: bool,
    pub(crate) reference: Mutex<Option<delta::ReferenceOf<zeropp_zero::host::Host>>>,
    /// The same references for CUDA tensors, on their device.
    pub(crate) device: Mutex<Option<delta::ReferenceOf<zeropp_cuda::Gpu>>>,
}

impl QwzReference {
    /// The frozen ranges of the next gather's shard.
    pub(crate) fn frozen_ranges(&self) -> Vec<std::ops::Range<usize>> {
        self.frozen
            .lock()
            .map(|f| f.iter().map(|&(at, len)| at..at + len).collect())
            .unwrap_or_default()
    }
}

#[pymethods]
impl QwzReference {
    /// Bytes of references held (bf16 where the hop inside the node is
    /// bf16, else f32).
    fn reference_bytes(&self) -> usize {
        let host = self
            .reference
            .lock()
            .ok()
            .and_then(|r| r.as_ref().map(|r| r.bytes()));
        let device = self
            .device
            .lock()
            .ok()
            .and_then(|r| r.as_ref().map(|r| r.bytes()));
        host.unwrap_or(0) + device.unwrap_or(0)
    }

    /// The ranges (start, length, in values) of this rank's shard that
    /// hold frozen parameters: forward gathers then send across nodes only
    /// the rest, while no frozen range changed.
    #[getter]
    fn get_frozen(&self) -> Vec<(usize, usize)> {
        self.frozen.lock().map(|f| f.clone()).unwrap_or_default()
    }

    #[setter]
    fn set_frozen(&self, frozen: Vec<(usize, usize)>) -> PyResult<()> {
        *self.frozen.lock().map_err(|_| to_py(poisoned()))? = frozen;
        Ok(())
    }

    /// The next gather is a full refresh (after a checkpoint load: every
    /// rank must call it alike).
    fn reset(&self) {
        if let Ok(mut r) = self.reference.lock() {
            *r = None;
        }
        if let Ok(mut r) = self.device.lock() {
            *r = None;
        }
    }
}
