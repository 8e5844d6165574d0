//! hpZ: after the forward gather each rank keeps a contiguous run of
//! chunks (its secondary shard); the backward gather collects the runs of
//! its hpZ group only, so it never leaves the node. Quantized shards are
//! kept and gathered here over a [`Quantizer`] and a [`ByteMover`] (host
//! and device alike); unquantized ones are kept values in the dtype they
//! travelled in, gathered by the mover (`ByteMover::all_gather_kept_placed`).

use zeropp_cuda::GpuElement;

use crate::backend::{ByteMover, Hop, Quantizer};
use crate::error::ZeroError;
use crate::layout::Layout;
use crate::qwz::gathered_position;
use crate::traffic::Phase;

/// hpZ's secondary shard of a parameter group: member `i` of a group of
/// `h` keeps chunks `i·k .. (i+1)·k` (k = W / h) of its forward gather as
/// they travelled — values in the wire's dtype (bf16, or f32), or qwZ's
/// quantized chunks — gathered again inside the group in backward
/// ([`all_gather_secondary`]).
pub enum Secondary<Q: Quantizer> {
    Values(Q::Kept),
    Quantized(Q::Chunks),
}

impl<Q: Quantizer> Secondary<Q> {
    /// This rank's run of `full` (the forward gather's values, `chunk` a
    /// rank), kept in bf16 unless `fp32` (as a plain wire sends them).
    pub fn of_values(
        q: &Q,
        layout: Layout,
        hpz_group: usize,
        (full, chunk): (&Q::Values, usize),
        fp32: bool,
    ) -> Result<Secondary<Q>, ZeroError> {
        let k = secondary_chunks(layout.world(), hpz_group);
        let first = (layout.local() % hpz_group) * k;
        let mut kept = q.kept(k * chunk, !fp32)?;
        q.store_kept(full, first * chunk, &mut kept, 0, k * chunk)?;
        Ok(Secondary::Values(kept))
    }

    /// This rank's chunks of a qwZ gather ([`keep_quantized`]).
    pub fn of_quantized(
        q: &Q,
        layout: Layout,
        hpz_group: usize,
        all: &Q::Chunks,
    ) -> Result<Secondary<Q>, ZeroError> {
        keep_quantized(q, layout, all, hpz_group).map(Secondary::Quantized)
    }

    /// Gives the shard's buffers back to `q`'s pools.
    pub fn recycle(self, q: &Q) {
        match self {
            Secondary::Values(k) => q.recycle_kept(k),
            Secondary::Quantized(c) => q.recycle_chunks(c),
        }
    }
}

/// The backward gather from secondary shards: every member's of this
/// rank's hpZ group into `out` (the group's full weights, rank order,
/// rounded to `T`); kept values travel as they were kept (bf16 unless
/// `fp32`), quantized chunks as they are, dequantized here.
pub fn all_gather_secondary<Q: Quantizer, M: ByteMover<Q>, T: GpuElement>(
    q: &Q,
    m: &M,
    secondary: &Secondary<Q>,
    fp32: bool,
    out: &mut Q::TensorMut<'_, T>,
) -> Result<(), ZeroError> {
    match secondary {
        Secondary::Values(kept) => {
            // Member j's run is chunks j·k .. (j+1)·k of the group.
            let len = q.kept_len(kept);
            let place = |j: usize, _| j * len;
            let phase = Phase::BackwardGather;
            m.all_gather_kept_placed(q, Hop::Hpz, phase, (kept, len, fp32), (1, &place), out)
        }
        Secondary::Quantized(secondary) => {
            // Member j's k chunks are the group's chunks j·k .. (j+1)·k.
            let k = q.shape(secondary).2;
            let place = move |j: usize, i: usize| j * k + i;
            let phase = Phase::BackwardGather;
            m.all_gather_dequantized(q, (Hop::Hpz, phase), secondary, &place, out)
        }
    }
}

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
