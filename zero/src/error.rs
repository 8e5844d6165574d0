//! What can go wrong in a ZeRO++ collective, on any backend: moving bytes
//! (the host transports), the device (CUDA kernels, NCCL), or the numbers
//! themselves (a format or a size the quantizer refuses).

use zeropp_cuda::CudaError;
use zeropp_quant::QuantError;

use zeropp_comm::CommError;

#[derive(Debug, thiserror::Error)]
pub enum ZeroError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Device(#[from] CudaError),
    #[error("{what}: {source}")]
    Quant {
        what: &'static str,
        #[source]
        source: QuantError,
    },
    /// State shared with the communication thread (a qwZ reference, an
    /// error-feedback residual) was left half-written by a panic there:
    /// the job cannot trust it.
    #[error(
        "the {0} was poisoned by an earlier failure; restart the job (from its last checkpoint)"
    )]
    Poisoned(&'static str),
    /// A two-hop collective whose byte mover's groups are not the layout's
    /// node and cross groups.
    #[error(
        "{collective} over {nodes} nodes x {ranks_per_node} ranks was given groups of {node} \
         (node) and {cross} (across nodes)"
    )]
    Hops {
        collective: &'static str,
        nodes: usize,
        ranks_per_node: usize,
        node: usize,
        cross: usize,
    },
    /// A call the collective cannot serve (sizes, shapes); says what to do.
    #[error("invalid call: {0}")]
    Invalid(String),
}

impl ZeroError {
    /// Whether another rank's death, hang or disappearance caused it: the
    /// job cannot go on (the bindings raise `PeerError` for these).
    pub fn is_peer_failure(&self) -> bool {
        match self {
            ZeroError::Comm(e) => e.is_peer_failure(),
            ZeroError::Device(e) => e.is_peer_failure(),
            _ => false,
        }
    }

    /// What happened to the rank that caused it, in a few words.
    pub fn what_happened(&self) -> String {
        match self {
            ZeroError::Comm(e) => e.what_happened(),
            other => other.to_string(),
        }
    }

    /// The rank that died or did not answer, when another rank caused it
    /// (host collectives).
    pub fn failed_peer(&self) -> Option<usize> {
        match self {
            ZeroError::Comm(e) => e.failed_peer(),
            _ => None,
        }
    }

    /// `tell` with the notice rank `me` gives the members of its groups
    /// after this failure of one of its collectives, for jobs that cannot
    /// go on after one (FSDP's collectives, on the host or a device): a
    /// failure of its own (a value that is not finite, bad input) is
    /// `me` giving up; a notice it heard names on the rank that gave up
    /// first (the comm layer's own notices blame no one for a `GaveUp`:
    /// there an island that broke is not a rank's fault); a lost peer is
    /// blamed as this rank blamed it.
    pub fn with_notice<R>(&self, me: usize, tell: impl FnOnce(&CommError) -> R) -> R {
        match self {
            ZeroError::Comm(CommError::GaveUp { by, reason }) if *by != me => {
                tell(&CommError::PeerFailed {
                    peer: *by,
                    reason: reason.clone(),
                })
            }
            ZeroError::Comm(e) => tell(e),
            other => tell(&CommError::GaveUp {
                by: me,
                reason: other.to_string(),
            }),
        }
    }
}

/// `map_err` for a quantizer failure while doing `what`.
pub fn quant_failure(what: &'static str) -> impl Fn(QuantError) -> ZeroError {
    move |source| ZeroError::Quant { what, source }
}
