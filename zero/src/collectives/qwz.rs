//! qwZ: the forward weight gather. Each rank's chunk travels quantized
//! (int8 or int4 blocks) across nodes among equal local ranks, then inside
//! the node as one run of N chunks per rank, and is dequantized into the
//! full buffer: written once over a [`Quantizer`] and a [`ByteMover`], for
//! host and device alike. Unquantized chunks go round the world in one
//! ring (moved as the caller's bytes).

use zeropp_cuda::GpuElement;
use zeropp_quant::{QuantFormat, Rounding};

use crate::backend::{ByteMover, Hop, Quantizer, check_hops};
use crate::error::ZeroError;
use crate::layout::Layout;
use crate::traffic::Phase;

/// Where rank `r`'s chunk sits in what [`gather_quantized`] returns: the
/// runs of N chunks arrive in local-rank order, each in node order, so
/// rank n·G + l is at l·N + n.
pub fn gathered_position(layout: Layout, rank: usize) -> usize {
    let (node, local) = (rank / layout.ranks_per_node, rank % layout.ranks_per_node);
    local * layout.nodes + node
}

/// qwZ: this rank's `shard` quantized in `format` (round to nearest),
/// gathered across nodes among equal local ranks (N−1 copies of it cross
/// node boundaries), then those N chunks inside the node: every rank's
/// chunk, rank r's at [`gathered_position`]`(r)`.
pub fn gather_quantized<Q: Quantizer, M: ByteMover<Q>, T: GpuElement>(
    q: &Q,
    m: &M,
    layout: Layout,
    shard: &Q::Tensor<'_, T>,
    format: QuantFormat,
    phase: Phase,
) -> Result<Q::Chunks, ZeroError> {
    let mine = quantize_shard(q, shard, format)?;
    let all = gather_chunks(q, m, layout, &mine, phase)?;
    q.recycle_chunks(mine);
    Ok(all)
}

/// This rank's shard as qwZ sends it: one chunk, rounded to nearest.
pub fn quantize_shard<Q: Quantizer, T: GpuElement>(
    q: &Q,
    shard: &Q::Tensor<'_, T>,
    format: QuantFormat,
) -> Result<Q::Chunks, ZeroError> {
    let mut mine = q.chunks(format, q.tensor_len(shard), 1)?;
    q.quantize_tensor(shard, Rounding::NearestEven, &mut mine, 0)?;
    Ok(mine)
}

/// The gather of [`gather_quantized`], of an already quantized shard.
pub fn gather_chunks<Q: Quantizer, M: ByteMover<Q>>(
    q: &Q,
    m: &M,
    layout: Layout,
    mine: &Q::Chunks,
    phase: Phase,
) -> Result<Q::Chunks, ZeroError> {
    let (nodes, g) = (layout.nodes, layout.ranks_per_node);
    check_hops(m, layout, "qwZ")?;
    let (format, len, count) = q.shape(mine);
    if count != 1 {
        return Err(ZeroError::Invalid(format!(
            "qwZ gathers one chunk a rank, not {count}"
        )));
    }
    let mut across = q.chunks(format, len, nodes)?;
    m.all_gather(q, Hop::Cross, phase, mine, &mut across)?;
    let mut all = q.chunks(format, len, nodes * g)?;
    m.all_gather(q, Hop::Node, phase, &across, &mut all)?;
    q.recycle_chunks(across);
    Ok(all)
}

/// Every rank's chunk of `all` (chunk `position(r)` for rank r)
/// dequantized into its place in `out` (`W · chunk` values).
pub fn dequantize_all<Q: Quantizer, T: GpuElement>(
    q: &Q,
    all: &Q::Chunks,
    position: impl Fn(usize) -> usize,
    out: &mut Q::TensorMut<'_, T>,
) -> Result<(), ZeroError> {
    let (_, chunk, count) = q.shape(all);
    for rank in 0..count {
        q.dequantize_tensor(all, position(rank), out, rank * chunk)?;
    }
    Ok(())
}
