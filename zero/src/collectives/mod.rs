//! The collectives, each written once over a [`crate::Quantizer`] and a
//! [`crate::ByteMover`]: qwZ's weight gather ([`qwz`]) and its weight
//! differences ([`delta`]), hpZ's gather inside the node ([`hpz`]), qgZ's
//! two-hop reduce-scatter ([`qgz`]) with its error feedback
//! ([`residual`]), the quantized all-reduce ([`allreduce`]) and the
//! islands' outer sync ([`outer`]) over the islands taking part
//! ([`islands`]) and FSDP2's two calls over them ([`fsdp`]).

pub mod allreduce;
pub mod delta;
pub mod fsdp;
pub mod hpz;
pub mod islands;
pub mod outer;
pub mod qgz;
pub mod qwz;
pub mod residual;
