//! hpZ: after the forward gather each rank keeps a contiguous run of
//! chunks (its secondary shard); the backward gather collects the runs of
//! its hpZ group only, so it never leaves the node. Quantized shards are
//! kept and gathered here over a [`Quantizer`] and a [`ByteMover`] (host
//! and device alike); unquantized ones are kept values in the dtype they
//! travelled in, gathered by the mover (`ByteMover::all_gather_kept_placed`).

use crate::backend::{ByteMover, Hop, Quantizer};
use crate::error::ZeroError;
use crate::layout::Layout;
use crate::qwz::gathered_position;
use crate::traffic::Phase;

/// Chunks one secondary shard holds: W / the hpZ group size.
pub fn secondary_chunks(world: usize, hpz_group: usize) -> usize {
    world / hpz_group
}

/// This rank's secondary shard out of a qwZ gather ([`crate::qwz::gather_quantized`]):
/// member `i` of a group of `hpz_group` keeps the chunks of ranks
/// `i·k .. (i+1)·k` (k = W / `hpz_group`), in rank order.
pub fn keep_quantized<Q: Quantizer>(
    q: &Q,
    layout: Layout,
    all: &Q::Chunks,
    hpz_group: usize,
) -> Result<Q::Chunks, ZeroError> {
    let (format, chunk, count) = q.shape(all);
    let k = secondary_chunks(count, hpz_group);
    let member = layout.local() % hpz_group;
    let mut secondary = q.chunks(format, chunk, k)?;
    for j in 0..k {
        let rank = member * k + j;
        q.copy_chunk(all, gathered_position(layout, rank), &mut secondary, j)?;
    }
    Ok(secondary)
}

/// The backward gather: the secondary shards of this rank's hpZ group,
/// every rank's chunk in rank order.
pub fn gather_quantized<Q: Quantizer, M: ByteMover<Q>>(
    q: &Q,
    m: &M,
    secondary: &Q::Chunks,
) -> Result<Q::Chunks, ZeroError> {
    let (format, chunk, k) = q.shape(secondary);
    let mut all = q.chunks(format, chunk, k * m.size(Hop::Hpz))?;
    m.all_gather(Hop::Hpz, Phase::BackwardGather, secondary, &mut all)?;
    Ok(all)
}
