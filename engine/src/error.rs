//! What can go wrong in the engine: a model or switches it cannot run, a
//! transport that does not match the layout, a non-finite step, a
//! checkpoint's state that does not fit, or a failure below it (the ZeRO++
//! collectives, the transports, candle), with the unit it happened in.

use zeropp_comm::CommError;
use zeropp_zero::ZeroError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model's own check failed.
    #[error("invalid model: {0}")]
    Model(String),
    /// The switches cannot run on this layout.
    #[error("invalid switches: {0}")]
    Switches(String),
    /// The switches or the job's shape make no plan (the switch at fault
    /// is in the error).
    #[error("invalid switches: {0}")]
    Plan(#[from] zeropp_zero::plan::PlanError),
    #[error(
        "the transport is rank {transport_rank} of {transport_world}, the layout says rank \
         {rank} of {world} ({nodes} nodes x {ranks_per_node})"
    )]
    Layout {
        transport_rank: usize,
        transport_world: usize,
        rank: usize,
        world: usize,
        nodes: usize,
        ranks_per_node: usize,
    },
    /// A NaN or an infinity in the loss or a gradient, on some rank.
    #[error(
        "step {step}: non-finite loss ({loss}) or gradient (norm {grad_norm}; units {units:?}) \
         — lower the learning rate or check the data; --skip-nonfinite true skips such steps"
    )]
    NonFinite {
        step: usize,
        loss: f32,
        grad_norm: f32,
        units: Vec<String>,
    },
    /// A collective of one unit failed (`what`: "quantizing the gradient",
    /// "reduce-scattering the gradient").
    #[error("{what} of {unit}")]
    Unit {
        what: &'static str,
        unit: String,
        #[source]
        source: ZeroError,
    },
    /// A checkpoint's state does not fit this engine's units.
    #[error("{0}")]
    Checkpoint(String),
    #[error(transparent)]
    Zero(#[from] ZeroError),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error("the model's compute failed: {0}")]
    Compute(#[from] candle_core::Error),
}

impl EngineError {
    /// Whether another rank's failure caused it.
    pub fn is_peer_failure(&self) -> bool {
        match self {
            EngineError::Unit { source, .. } | EngineError::Zero(source) => {
                source.is_peer_failure()
            }
            EngineError::Comm(e) => e.is_peer_failure(),
            _ => false,
        }
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
