//! hpZ: after the forward gather each rank keeps the payloads of a
//! contiguous run of chunks (its secondary shard); the backward gather
//! collects the runs of its hpZ group only, so it never leaves the node.

use bytes::Bytes;

use crate::comm::{CommError, Communicator, Group};

use super::qwz::{concat, split_bundle};

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
