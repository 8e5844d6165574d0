//! What can go wrong in a ZeRO++ collective, on any backend: moving bytes
//! (the host transports), the device (CUDA kernels, NCCL), or the numbers
//! themselves (a format or a size the quantizer refuses).

use zeropp_cuda::CudaError;
use zeropp_quant::QuantError;

use crate::comm::CommError;

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
    /// A call the collective cannot serve (sizes, shapes); says what to do.
    #[error("invalid call: {0}")]
    Invalid(String),
}

impl ZeroError {
    /// Whether another rank's death, hang or disappearance caused it: the
    /// job cannot go on (the bindings raise `PeerError` for these).
    pub fn is_peer_failure(&self) -> bool {
        matches!(
            self,
            ZeroError::Comm(
                CommError::PeerFailed { .. } | CommError::Timeout { .. } | CommError::Closed
            ) | ZeroError::Device(CudaError::Peer(_))
        )
    }
}

/// `map_err` for a quantizer failure while doing `what`.
pub fn quant_failure(what: &'static str) -> impl Fn(QuantError) -> ZeroError {
    move |source| ZeroError::Quant { what, source }
}
