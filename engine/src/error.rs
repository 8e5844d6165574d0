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
    Model(#[from] crate::model::InvalidModel),
    /// The model's forward does not connect a unit's input to its output.
    #[error("invalid model: no gradient reached the input of {unit}")]
    NoGradient { unit: String },
    /// The islands' settings cannot run (or a rejoin asked of a job that
    /// cannot take it).
    #[error("invalid switches: {0}")]
    Islands(#[from] IslandsError),
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
    /// A collective of one unit failed (`what`: "preparing the gradient",
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

/// Why the islands' settings cannot run.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum IslandsError {
    #[error("islands that sync every 0 steps: sync_every must be at least 1")]
    SyncEveryZero,
    #[error("0 fragments: the model is at least one fragment (1: no streaming)")]
    NoFragments,
    #[error(
        "an outer delay of {delay} steps with a sync every {sync_every}: an exchange must land \
         before its fragment's next one starts (delay below sync_every)"
    )]
    DelayTooLong { delay: usize, sync_every: usize },
    #[error("only a job of islands can be rejoined (ZEROPP_REJOIN is set)")]
    NotIslands,
    #[error(
        "a restarted island rejoins only islands with --outer-delay 0; resume the whole job from \
         its last checkpoint instead"
    )]
    RejoinWithDelay,
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
