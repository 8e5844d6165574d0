//! hpZ: after the forward gather each rank keeps the payloads of a
//! contiguous run of chunks (its secondary shard); the backward gather
//! collects the runs of its hpZ group only, so it never leaves the node.
//! Quantized shards are kept and gathered over a [`Quantizer`] and a
//! [`ByteMover`] (host and device alike); unquantized ones as the bytes
//! they travelled as.

use bytes::Bytes;

use zeropp_comm::{CommError, Communicator, Group};

use crate::backend::{ByteMover, Hop, Quantizer};
use crate::error::ZeroError;
use crate::layout::Layout;
use crate::qwz::{concat, gathered_position, split_bundle};
use crate::traffic::Phase;

/// Chunks one secondary shard holds: W / the hpZ group size.
pub fn secondary_chunks(world: usize, hpz_group: usize) -> usize {
    world / hpz_group
}

/// This rank's secondary shard out of a forward gather (`payloads` in rank
/// order): member `i` of a group of `hpz_group` keeps chunks `i·k .. (i+1)·k`,
/// copied so that the gathered buffers can be freed.
pub fn keep_secondary(payloads: &[Bytes], hpz_group: usize, local_rank: usize) -> Vec<Bytes> {
    let k = secondary_chunks(payloads.len(), hpz_group);
    let member = local_rank % hpz_group;
    payloads[member * k..(member + 1) * k]
        .iter()
        .map(|p| Bytes::copy_from_slice(p))
        .collect()
}

/// Gathers the secondary shards of `hpz` (each `secondary.len()` chunks)
/// back into every rank's chunk, in rank order.
pub fn gather(c: &Communicator, hpz: &Group, secondary: &[Bytes]) -> Result<Vec<Bytes>, CommError> {
    let n = secondary.len();
    let bundles = c.all_gather_v(hpz, concat(secondary))?;
    let mut by_rank = Vec::with_capacity(bundles.len() * n);
    for bundle in &bundles {
        by_rank.extend(split_bundle(bundle, n)?);
    }
    Ok(by_rank)
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
