//! qwZ on weight differences: across nodes each rank sends only what its
//! shard changed since the last gather, quantized (int4 or int8), and every
//! receiver adds it to the reference it keeps of that shard. The sender's
//! own copy of the reference is computed from the very chunk it sent, so a
//! difference is always taken against what the receivers hold: the
//! quantization error of one gather is carried into the next difference
//! and never accumulates. Inside the node the references travel as the
//! plain wire (bf16, or f32): each rank holds the references of the N
//! shards of its cross group (1/G of the unit, the size of hpZ's secondary
//! shard), and the node gathers them into the full weights. A full refresh
//! (the weights themselves, in the plain wire) starts the reference, and
//! repeats every `refresh_every` forward gathers to bound any drift.
//!
//! Written once over a [`Quantizer`] and a [`ByteMover`], for host and
//! device alike (SDP4Bit, NeurIPS 2024, quantizes weight differences the
//! same way).

use std::ops::Range;

use zeropp_cuda::GpuElement;
use zeropp_quant::{QuantFormat, Rounding};

use crate::backend::{ByteMover, Hop, Quantizer, check_hops};
use crate::error::ZeroError;
use crate::host::{Host, Kept};
use crate::layout::Layout;
use crate::traffic::Phase;
use zeropp_quant::QuantizedChunks;

/// How a unit's weights cross nodes as differences.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeltaWire {
    /// Format of a difference.
    pub delta: QuantFormat,
    /// Forward gathers between full refreshes (≥ 1).
    pub refresh_every: u64,
    /// A refresh across nodes, and the hop inside the node, in f32 instead
    /// of bf16.
    pub fp32: bool,
    /// hpZ over the whole node: a backward gather is served from the
    /// references inside the node, which are then
    /// hpZ's secondary shard — one copy of what the receivers hold.
    pub hpz: bool,
    /// The references kept in bf16 where the hop inside the node is bf16
    /// (half the memory of f32).
    pub bf16_references: bool,
    /// The references kept in int8 blocks of this format (about a quarter
    /// of f32's memory): every holder rounds a shard to int8 after each
    /// update alike, the forward weights are those blocks (as ZeRO++'s
    /// int8 weights), and the node gathers them as they are kept.
    pub int8_references: Option<QuantFormat>,
}

/// What one rank keeps of one unit between gathers: its references of the
/// N shards of its cross group (node order), this rank's own at its node's
/// place, identical on every rank that holds it. Kept in bf16 where the hop
/// inside the node moves bf16 (what every consumer of the references sees
/// then), in f32 otherwise, or in int8 blocks when asked
/// ([`DeltaWire::int8_references`]; `K`: the backend's kept values, `C`:
/// its quantized chunks). With hpZ over the whole node they are also
/// hpZ's secondary shard: [`gather`] serves the backward gather from
/// them.
pub struct Reference<K, C> {
    held: Held<K, C>,
    /// Kept in host memory ([`Slot::on_host`]).
    on_host: bool,
    nodes: usize,
    chunk: usize,
    forwards_since_refresh: u64,
}

/// A [`Reference`] of a quantizer's own kinds of memory.
pub type ReferenceOf<Q> = Reference<<Q as Quantizer>::Kept, <Q as Quantizer>::Chunks>;

/// What the references are kept in.
enum Held<K, C> {
    /// Values: bf16 or f32 (`bf16`).
    Values { kept: K, bf16: bool },
    /// N chunks of int8 blocks.
    Int8 { chunks: C, format: QuantFormat },
}

/// What a [`DeltaWire`] keeps its references in: f32, bf16 or int8 blocks.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Precision {
    F32,
    Bf16,
    Int8(QuantFormat),
}

impl<K, C> Reference<K, C> {
    /// Bytes it keeps: N shards of a chunk (1/G of the unit), 2 bytes a
    /// value in bf16, 4 in f32, 1 in int8 with a 4-byte scale a block.
    pub fn bytes(&self) -> usize {
        let values = self.nodes * self.chunk;
        match &self.held {
            Held::Values { bf16: true, .. } => values * 2,
            Held::Values { bf16: false, .. } => values * 4,
            Held::Int8 { format, .. } => {
                values + self.nodes * self.chunk.div_ceil(format.block) * 4
            }
        }
    }

    /// The values it keeps them in (None in int8 blocks).
    pub fn kept(&self) -> Option<&K> {
        match &self.held {
            Held::Values { kept, .. } => Some(kept),
            Held::Int8 { .. } => None,
        }
    }

    fn precision(&self) -> Precision {
        match &self.held {
            Held::Values { bf16: true, .. } => Precision::Bf16,
            Held::Values { bf16: false, .. } => Precision::F32,
            Held::Int8 { format, .. } => Precision::Int8(*format),
        }
    }
}

/// A parameter group's place in a delta gather: its references (`None` at
/// first, after a load or a resize), and the ranges of each shard that hold
/// frozen parameters, as the caller reads them before every gather (the
/// same on every rank: FSDP2 lays every rank's shard out alike; sorted,
/// apart, inside the shard). A forward gather checks, with a byte from
/// each member of the cross group, that no frozen range changed, then
/// sends only the rest — frozen weights cross the nodes once; where one
/// did change (a load, an unfrozen weight) the cross group refreshes. The
/// bytes that carry frozen ranges, or check them, count as
/// [`Phase::Frozen`]. With `on_host` the references are kept in host
/// memory ([`Quantizer::kept_on_host`]: `frozen_cache="host"`, the
/// device's memory then stays at ZeRO-3's).
pub struct Slot<'a, K, C> {
    pub reference: &'a mut Option<Reference<K, C>>,
    pub frozen: &'a [Range<usize>],
    pub on_host: bool,
}

impl<'a, K, C> Slot<'a, K, C> {
    /// A group with nothing frozen, its references where the quantizer
    /// keeps values.
    pub fn new(reference: &'a mut Option<Reference<K, C>>) -> Self {
        Slot {
            reference,
            frozen: &[],
            on_host: false,
        }
    }
}

/// Whether `frozen` lies sorted and apart inside a shard of `chunk`.
fn check_frozen(frozen: &[Range<usize>], chunk: usize) -> Result<(), ZeroError> {
    let mut end = 0;
    for r in frozen {
        if r.start < end || r.end > chunk || r.start >= r.end {
            return Err(ZeroError::Invalid(format!(
                "frozen ranges {frozen:?} do not lie sorted and apart inside a shard of {chunk} \
                 values"
            )));
        }
        end = r.end;
    }
    Ok(())
}

/// What a checkpoint keeps of a rank's [`Reference`]: the receivers' view
/// of this rank's own shard (every member of the cross group holds the same
/// values of it) and the forward gathers since the last refresh.
#[derive(Clone, Debug, PartialEq)]
pub struct SavedReference {
    pub own: Vec<f32>,
    pub forwards_since_refresh: u64,
}

impl Reference<Kept, QuantizedChunks> {
    /// This rank's part, at `layout`'s node.
    pub fn saved(&self, layout: Layout) -> Result<SavedReference, ZeroError> {
        let own = match &self.held {
            Held::Values { kept, .. } => kept.to_f32(layout.node() * self.chunk, self.chunk)?,
            Held::Int8 { chunks, .. } => {
                let mut own = vec![0f32; self.chunk];
                Host.dequantize(chunks, layout.node(), &mut own, 0)?;
                own
            }
        };
        Ok(SavedReference {
            own,
            forwards_since_refresh: self.forwards_since_refresh,
        })
    }

    /// Rebuilt from the parts of every member of the cross group, in node
    /// order: the reference each of them held when they were saved, kept
    /// as `wire` keeps it. `None` when the parts do not make one reference
    /// (lengths or counts differ).
    pub fn from_saved(parts: &[SavedReference], wire: DeltaWire) -> Option<Self> {
        let first = parts.first()?;
        let chunk = first.own.len();
        let same = parts.iter().all(|p| {
            p.own.len() == chunk && p.forwards_since_refresh == first.forwards_since_refresh
        });
        let values: Vec<f32> = parts.iter().flat_map(|p| p.own.iter().copied()).collect();
        if !same || chunk == 0 {
            return None;
        }
        let held = match wire.precision() {
            Precision::Int8(format) => {
                // Saved from int8 blocks, they come back to the same ones.
                let mut chunks = Host.chunks(format, chunk, parts.len()).ok()?;
                for n in 0..parts.len() {
                    let near = Rounding::NearestEven;
                    Host.quantize_chunk(&values, n * chunk, near, &mut chunks, n)
                        .ok()?;
                }
                Held::Int8 { chunks, format }
            }
            p => Held::Values {
                kept: Kept::from_f32(&values, p == Precision::Bf16),
                bf16: p == Precision::Bf16,
            },
        };
        Some(Reference {
            held,
            on_host: false,
            nodes: parts.len(),
            chunk,
            forwards_since_refresh: first.forwards_since_refresh,
        })
    }
}

impl DeltaWire {
    /// Whether the references are kept in bf16: asked, and the hop inside
    /// the node moves them in bf16.
    pub fn keeps_bf16(&self) -> bool {
        self.bf16_references && !self.fp32
    }

    /// What the references are kept in.
    fn precision(&self) -> Precision {
        match self.int8_references {
            Some(format) => Precision::Int8(format),
            None => self.values_precision(),
        }
    }

    /// What the references are kept in where they are values.
    fn values_precision(&self) -> Precision {
        match self.keeps_bf16() {
            true => Precision::Bf16,
            false => Precision::F32,
        }
    }
}

/// The delta gather: every rank's `shard` (rank order, equal lengths) into
/// `out` (W · chunk values), through this rank's references of the unit in
/// `slot` (`None` at first, after a load or a resize: the gather is then a
/// full refresh, and every rank of the job must pass `None` alike). On an
/// error the reference is dropped (the job cannot go on from it).
///
/// With hpZ over the node a backward gather is served from the references
/// inside the node. With frozen ranges ([`Slot`]) a forward gather sends
/// them across only at a refresh they need (the first, or one of them
/// changed), else only the other ranges.
#[allow(clippy::too_many_arguments)]
pub fn gather<Q: Quantizer, M: ByteMover<Q>, T: GpuElement>(
    q: &Q,
    m: &M,
    layout: Layout,
    wire: DeltaWire,
    slot: Slot<'_, Q::Kept, Q::Chunks>,
    shard: &Q::Tensor<'_, T>,
    out: &mut Q::TensorMut<'_, T>,
    phase: Phase,
) -> Result<(), ZeroError> {
    let nodes = layout.nodes;
    check_hops(m, layout, "qwZ")?;
    let chunk = q.tensor_len(shard);
    let (reference, on_host) = (slot.reference, slot.on_host);
    // int8 blocks hold every weight of a block alike: a group with frozen
    // weights (kept apart, checked range by range) or references in host
    // memory keeps them in values.
    let precision = match wire.precision() {
        Precision::Int8(_) if !slot.frozen.is_empty() || on_host => wire.values_precision(),
        p => p,
    };
    let bf16 = precision == Precision::Bf16;
    let kept = reference.take().filter(|r| {
        let held = (r.chunk, r.precision(), r.on_host, r.nodes);
        held == (chunk, precision, on_host, nodes)
    });
    if let Some(r) = &kept
        && wire.hpz
        && phase == Phase::BackwardGather
    {
        inside_node(q, m, layout, r, wire.fp32, out, phase)?;
        *reference = kept;
        return Ok(());
    }
    // Frozen ranges count on forward gathers (a backward gather without
    // hpZ sends the whole shard's differences).
    let frozen: &[Range<usize>] = match phase {
        Phase::ForwardGather => slot.frozen,
        _ => &[],
    };
    check_frozen(frozen, chunk)?;
    // The shard as the plain wire carries it: rounded to bf16 behind a
    // bf16 hop. Kept in bf16, the references take differences against it,
    // so they converge to it exactly and the rounding of a block's large
    // weights never sets the block's scale.
    let mut loaded = q.values(chunk)?;
    q.load_tensor(shard, &mut loaded, 0)?;
    let check = kept.is_some() && !frozen.is_empty();
    let rounded = if !wire.fp32 && (bf16 || check) {
        let mut rounded = q.values_for_overwrite(chunk)?;
        q.copy(&loaded, 0, &mut rounded, 0, chunk)?;
        q.round_bf16(&mut rounded)?;
        Some(rounded)
    } else {
        None
    };
    let on_wire = rounded.as_ref().unwrap_or(&loaded);
    // Whether the frozen ranges cross with this gather's refresh.
    let (mut r, refresh, send_frozen) = match kept {
        None => {
            let held = match (precision, on_host) {
                (Precision::Int8(format), _) => Held::Int8 {
                    chunks: q.chunks(format, chunk, nodes)?,
                    format,
                },
                (_, true) => Held::Values {
                    kept: q.kept_on_host(nodes * chunk, bf16)?,
                    bf16,
                },
                (_, false) => Held::Values {
                    kept: q.kept(nodes * chunk, bf16)?,
                    bf16,
                },
            };
            let r = Reference {
                held,
                on_host,
                nodes,
                chunk,
                forwards_since_refresh: 0,
            };
            (r, true, true)
        }
        Some(r) => {
            let changed = check && !frozen_unchanged(q, m, layout, &r, frozen, on_wire)?;
            let due =
                phase == Phase::ForwardGather && r.forwards_since_refresh >= wire.refresh_every;
            (r, changed || due, changed)
        }
    };
    let mine = if bf16 { on_wire } else { &loaded };
    if send_frozen && !frozen.is_empty() {
        let phase = Phase::Frozen;
        exchange(q, m, layout, wire, &mut r, mine, frozen, true, phase)?;
    }
    let ranges = trainable(frozen, chunk);
    exchange(q, m, layout, wire, &mut r, mine, &ranges, refresh, phase)?;
    inside_node(q, m, layout, &r, wire.fp32, out, phase)?;
    q.recycle(loaded);
    if let Some(rounded) = rounded {
        q.recycle(rounded);
    }
    if refresh {
        r.forwards_since_refresh = 0;
    }
    if phase == Phase::ForwardGather {
        r.forwards_since_refresh += 1;
    }
    *reference = Some(r);
    Ok(())
}

/// Whether every member of the cross group found its `frozen` ranges as
/// the receivers hold them (`on_wire`: this rank's shard as a refresh
/// would send it now): a byte from each.
fn frozen_unchanged<Q: Quantizer, M: ByteMover<Q>>(
    q: &Q,
    m: &M,
    layout: Layout,
    r: &ReferenceOf<Q>,
    frozen: &[Range<usize>],
    on_wire: &Q::Values,
) -> Result<bool, ZeroError> {
    let chunk = r.chunk;
    let mut held = q.values(chunk)?;
    let Held::Values { kept, .. } = &r.held else {
        return Err(ZeroError::Invalid(
            "frozen ranges checked against references in int8 blocks".into(),
        ));
    };
    q.load_kept(kept, layout.node() * chunk, &mut held, 0, chunk)?;
    let mut unchanged = true;
    for f in frozen {
        unchanged &= q.same(&held, f.start, on_wire, f.start, f.len())?;
    }
    q.recycle(held);
    m.all_agree(Hop::Cross, Phase::Frozen, unchanged)
}

/// The ranges of a shard of `chunk` values between the `frozen` ones.
fn trainable(frozen: &[Range<usize>], chunk: usize) -> Vec<Range<usize>> {
    let mut ranges = Vec::new();
    let mut at = 0;
    for f in frozen.iter().chain(std::iter::once(&(chunk..chunk))) {
        if f.start > at {
            ranges.push(at..f.start);
        }
        at = f.end;
    }
    ranges
}

/// Across nodes: the `ranges` of this rank's shard (`mine`, the whole
/// shard) into the references of every member of the cross group — the
/// values themselves in the plain wire (`refresh`), or their quantized
/// differences from what the receivers hold. Ranges other than the whole
/// shard travel packed one after the other.
#[allow(clippy::too_many_arguments)]
fn exchange<Q: Quantizer, M: ByteMover<Q>>(
    q: &Q,
    m: &M,
    layout: Layout,
    wire: DeltaWire,
    r: &mut ReferenceOf<Q>,
    mine: &Q::Values,
    ranges: &[Range<usize>],
    refresh: bool,
    phase: Phase,
) -> Result<(), ZeroError> {
    let (nodes, chunk) = (r.nodes, r.chunk);
    let len: usize = ranges.iter().map(|t| t.len()).sum();
    if len == 0 {
        return Ok(());
    }
    match (refresh && len == chunk, &mut r.held) {
        (true, Held::Values { kept, .. }) => {
            // Every reference starts again from what ZeRO-3 would gather.
            return m.all_gather_values_kept(q, Hop::Cross, phase, mine, kept, wire.fp32);
        }
        (true, Held::Int8 { chunks, format }) => {
            // The shard's own int8 blocks, which every holder keeps as
            // they came: a byte a value on the wire, not bf16's two.
            let mut sent = q.chunks(*format, len, 1)?;
            q.quantize_chunk(mine, 0, Rounding::NearestEven, &mut sent, 0)?;
            m.all_gather(q, Hop::Cross, phase, &sent, chunks)?;
            q.recycle_chunks(sent);
            return Ok(());
        }
        _ => {}
    }
    let held = &mut r.held;
    let packed = match len == chunk {
        true => None,
        false => {
            let mut p = q.values(len)?;
            let mut at = 0;
            for t in ranges {
                q.copy(mine, t.start, &mut p, at, t.len())?;
                at += t.len();
            }
            Some(p)
        }
    };
    let now = packed.as_ref().unwrap_or(mine);
    if refresh {
        let mut all = q.values(nodes * len)?;
        m.all_gather_values(q, Hop::Cross, phase, now, &mut all, wire.fp32)?;
        for n in 0..nodes {
            store_held(q, &all, n * len, held, (n, chunk), ranges)?;
        }
        q.recycle(all);
        if let Some(packed) = packed {
            q.recycle(packed);
        }
        return Ok(());
    }
    // One node's shard at a time in f32, updated in place (bf16 rounds as
    // the hop inside the node does: every holder keeps the same values).
    let mut delta = q.values(len)?;
    load_held(q, held, (layout.node(), chunk), ranges, &mut delta)?;
    q.dropped(&mut delta, 0, now, 0, len)?;
    let mut sent = q.chunks(wire.delta, len, 1)?;
    q.quantize_chunk(&delta, 0, Rounding::NearestEven, &mut sent, 0)?;
    let mut across = q.chunks(wire.delta, len, nodes)?;
    m.all_gather(q, Hop::Cross, phase, &sent, &mut across)?;
    let mut shard = delta;
    for n in 0..nodes {
        load_held(q, held, (n, chunk), ranges, &mut shard)?;
        q.dequantize_accumulate(&across, n, &mut shard, 0)?;
        store_held(q, &shard, 0, held, (n, chunk), ranges)?;
    }
    q.recycle(shard);
    q.recycle_chunks(sent);
    q.recycle_chunks(across);
    if let Some(packed) = packed {
        q.recycle(packed);
    }
    Ok(())
}

/// The `ranges` of node `n`'s shard of `held` (shards of `chunk`), packed
/// into `into` in f32: values as kept, int8 blocks dequantized (whole
/// shards only: a group with frozen ranges keeps values).
fn load_held<Q: Quantizer>(
    q: &Q,
    held: &Held<Q::Kept, Q::Chunks>,
    (n, chunk): (usize, usize),
    ranges: &[Range<usize>],
    into: &mut Q::Values,
) -> Result<(), ZeroError> {
    match held {
        Held::Values { kept, .. } => load_ranges(q, kept, n * chunk, ranges, into),
        Held::Int8 { chunks, .. } => q.dequantize(chunks, n, into, 0),
    }
}

/// Packed values of `x` from `at` on into the `ranges` of node `n`'s shard
/// of `held`: values stored as kept (bf16 rounds as the hop inside the
/// node does), int8 blocks rounded to nearest — alike on every holder.
fn store_held<Q: Quantizer>(
    q: &Q,
    x: &Q::Values,
    at: usize,
    held: &mut Held<Q::Kept, Q::Chunks>,
    (n, chunk): (usize, usize),
    ranges: &[Range<usize>],
) -> Result<(), ZeroError> {
    match held {
        Held::Values { kept, .. } => store_ranges(q, x, at, kept, n * chunk, ranges),
        Held::Int8 { chunks, .. } => q.quantize_chunk(x, at, Rounding::NearestEven, chunks, n),
    }
}

/// The `ranges` of `kept` from `base` on, packed into `into`.
fn load_ranges<Q: Quantizer>(
    q: &Q,
    kept: &Q::Kept,
    base: usize,
    ranges: &[Range<usize>],
    into: &mut Q::Values,
) -> Result<(), ZeroError> {
    let mut at = 0;
    for t in ranges {
        q.load_kept(kept, base + t.start, into, at, t.len())?;
        at += t.len();
    }
    Ok(())
}

/// Packed values of `x` from `at` on, into the `ranges` of `kept` from
/// `base` on.
fn store_ranges<Q: Quantizer>(
    q: &Q,
    x: &Q::Values,
    mut at: usize,
    kept: &mut Q::Kept,
    base: usize,
    ranges: &[Range<usize>],
) -> Result<(), ZeroError> {
    for t in ranges {
        q.store_kept(x, at, kept, base + t.start, t.len())?;
        at += t.len();
    }
    Ok(())
}

/// Inside the node: every local rank's references (N shards), local rank
/// l's run of N shards at l·N, shard n of it rank n·G + l's, into `out` in
/// rank order.
fn inside_node<Q: Quantizer, M: ByteMover<Q>, T: GpuElement>(
    q: &Q,
    m: &M,
    layout: Layout,
    r: &ReferenceOf<Q>,
    fp32: bool,
    out: &mut Q::TensorMut<'_, T>,
    phase: Phase,
) -> Result<(), ZeroError> {
    let (g, chunk, nodes) = (layout.ranks_per_node, r.chunk, r.nodes);
    match &r.held {
        Held::Values { kept, .. } => {
            let place = move |l: usize, n: usize| (n * g + l) * chunk;
            let kept = (kept, nodes * chunk, fp32);
            m.all_gather_kept_placed(q, Hop::Node, phase, kept, (nodes, &place), out)
        }
        Held::Int8 { chunks, .. } => {
            // Local rank l's chunk n is rank n·G + l's.
            let place = move |l: usize, n: usize| n * g + l;
            m.all_gather_dequantized(q, (Hop::Node, phase), chunks, &place, out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::Host;
    use crate::testing::on_ranks;

    const CHUNK: usize = 256;

    fn wire(delta_bits: u32, every: u64) -> DeltaWire {
        DeltaWire {
            delta: crate::plan::weight_format(delta_bits, 64).unwrap(),
            refresh_every: every,
            fp32: true,
            hpz: false,
            bf16_references: false,
            int8_references: None,
        }
    }

    fn truth(rank: usize, step: usize, drift: f32) -> Vec<f32> {
        (0..CHUNK)
            .map(|i| {
                let x = (rank * CHUNK + i) as f32;
                (x * 0.37).sin() * 0.05 + step as f32 * drift * (x * 0.11).cos()
            })
            .collect()
    }

    /// Runs `steps` forward gathers on 2 nodes x 2 ranks of shards that
    /// move by `drift` (at most) a gather; every rank's output at each
    /// step, the true weights, and the bytes rank 0 sent across nodes.
    /// Each rank's outputs step by step, the true weights, rank 0's bytes.
    type Run = (Vec<Vec<Vec<f32>>>, Vec<Vec<f32>>, u64);

    fn run(steps: usize, w: DeltaWire, drift: f32) -> Run {
        let world = 4;
        let results = on_ranks(2, 2, move |layout, mover| {
            let mut reference = None;
            let mut outs = Vec::new();
            for step in 0..steps {
                let shard = truth(layout.rank, step, drift);
                let mut out = vec![0f32; world * CHUNK];
                gather(
                    &Host,
                    mover,
                    layout,
                    w,
                    Slot::new(&mut reference),
                    &shard.as_slice(),
                    &mut out.as_mut_slice(),
                    Phase::ForwardGather,
                )
                .unwrap();
                outs.push(out);
            }
            outs
        });
        let truths = (0..steps)
            .map(|s| (0..world).flat_map(|r| truth(r, s, drift)).collect())
            .collect();
        let cross = results[0].1;
        (results.into_iter().map(|r| r.0).collect(), truths, cross)
    }

    fn max_err(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// What one int8 quantization of the weights (today's qwZ) is off by.
    fn int8_error(x: &[f32]) -> f32 {
        let format = crate::plan::weight_format(8, 64).unwrap();
        let q = zeropp_quant::QuantizedTensor::quantize(x, format, Rounding::NearestEven).unwrap();
        max_err(&q.dequantize::<f32>().unwrap(), x)
    }

    #[test]
    fn every_rank_gets_the_same_weights_closer_than_int8_weights() {
        let (outs, truths, _) = run(12, wire(4, 1000), 1e-3);
        for (rank, o) in outs.iter().enumerate() {
            assert_eq!(o, &outs[0], "rank {rank}");
        }
        // The first gather is a refresh in the plain wire (f32 here).
        assert_eq!(outs[0][0], truths[0]);
        // Then each int4 difference carries what the last one dropped: the
        // error is int4's of one step's change (1e-3 / 15), well under
        // int8's of the weights (0.05 / 255), and does not grow.
        let int8 = int8_error(&truths[11]);
        for step in 1..12 {
            let e = max_err(&outs[0][step], &truths[step]);
            assert!(e < 1e-4 && e < int8 / 2.0, "step {step}: {e} (int8 {int8})");
        }
    }

    #[test]
    fn references_behind_a_bf16_hop_are_kept_in_bf16_and_stay_as_close() {
        let bf16_hop = DeltaWire {
            fp32: false,
            bf16_references: true,
            ..wire(4, 1000)
        };
        let (outs, truths, _) = run(12, bf16_hop, 1e-3);
        for (rank, o) in outs.iter().enumerate() {
            assert_eq!(o, &outs[0], "rank {rank}");
        }
        // What the node's bf16 hop delivers: within half a bf16 step of
        // the weights (|w| < 0.06: 2^-10) plus int4's of one step's change.
        for step in 0..12 {
            let e = max_err(&outs[0][step], &truths[step]);
            assert!(e < 2f32.powi(-10) + 1e-4, "step {step}: {e}");
        }
        // Weights that stop moving arrive exactly as the bf16 hop rounds
        // them, small ones beside large ones in a block included.
        let settled = on_ranks(2, 2, move |layout, mover| {
            let mut reference = None;
            let mut out = vec![0f32; 4 * CHUNK];
            for step in 0..12 {
                // Moving for 4 gathers (int4 differences), then still.
                let shard = truth(layout.rank, step.min(4), 1e-3);
                let (x, mut o) = (&shard[..], &mut out[..]);
                let p = Phase::ForwardGather;
                gather(
                    &Host,
                    mover,
                    layout,
                    bf16_hop,
                    Slot::new(&mut reference),
                    &x,
                    &mut o,
                    p,
                )
                .unwrap();
            }
            out
        });
        let rounded: Vec<f32> = (0..4)
            .flat_map(|r| truth(r, 4, 1e-3))
            .map(|v| half::bf16::from_f32(v).to_f32())
            .collect();
        assert_eq!(settled[0].0, rounded);
        let bytes = on_ranks(2, 2, move |layout, mover| {
            let mut reference = None;
            let shard = truth(layout.rank, 0, 0.0);
            let mut out = vec![0f32; 4 * CHUNK];
            let (x, mut o) = (&shard[..], &mut out[..]);
            let p = Phase::ForwardGather;
            gather(
                &Host,
                mover,
                layout,
                bf16_hop,
                Slot::new(&mut reference),
                &x,
                &mut o,
                p,
            )
            .unwrap();
            reference.map(|r| r.bytes())
        });
        for (b, _) in bytes {
            assert_eq!(
                b,
                Some(2 * CHUNK * 2),
                "2 shards of the cross group, in bf16"
            );
        }
    }

    #[test]
    fn frozen_weights_cross_once_and_a_changed_shard_is_sent_again() {
        // With int8 references asked too: a group with frozen weights
        // keeps its references in values, where the frozen ranges are
        // kept apart (int8 blocks would mix them with the moving weights).
        let int8 = DeltaWire {
            int8_references: Some(crate::plan::weight_format(8, 64).unwrap()),
            ..wire(4, 1000)
        };
        for frozen in [wire(4, 1000), int8] {
            frozen_weights_cross_once(frozen);
        }
    }

    fn frozen_weights_cross_once(frozen: DeltaWire) {
        let got = on_ranks(2, 2, move |layout, mover| {
            let mut reference: Option<ReferenceOf<Host>> = None;
            let mut outs = Vec::new();
            let mut crossed = Vec::new();
            let (mut frozen_bytes, frozen_ranges) =
                (Vec::new(), std::iter::once(0..CHUNK).collect::<Vec<_>>());
            for call in 0..6 {
                // Rank 1's shard is loaded anew before gather 3.
                let step = usize::from(layout.rank == 1 && call >= 3);
                let shard = truth(layout.rank, step, 1e-2);
                let mut out = vec![0f32; 4 * CHUNK];
                let before = mover.counter.traffic();
                let (x, mut o) = (&shard[..], &mut out[..]);
                let p = Phase::ForwardGather;
                let slot = Slot {
                    reference: &mut reference,
                    frozen: &frozen_ranges,
                    on_host: false,
                };
                gather(&Host, mover, layout, frozen, slot, &x, &mut o, p).unwrap();
                let sent = mover.counter.traffic().since(&before);
                crossed.push(sent.total().inter_node);
                frozen_bytes.push(sent.frozen.total.inter_node);
                outs.push(out);
            }
            assert_eq!(frozen_bytes, crossed, "all of it frozen weights");
            (outs, crossed)
        });
        let truths = |step: usize| -> Vec<f32> {
            (0..4)
                .flat_map(|r| truth(r, usize::from(r == 1) * step, 1e-2))
                .collect()
        };
        for (rank, ((outs, crossed), _)) in got.iter().enumerate() {
            // The first gather sends the weights (f32 here: a message of
            // the frozen range, one of the empty rest); the next two
            // only a byte to the peer across; gather 3 refreshes rank 1's
            // cross group (0 and 2 agree that nothing changed: a byte);
            // then a byte again.
            assert_eq!(crossed[0], (CHUNK * 4) as u64, "rank {rank}: {crossed:?}");
            assert_eq!(&crossed[1..3], &[1, 1], "rank {rank}");
            if rank % 2 == 1 {
                assert_eq!(
                    crossed[3],
                    1 + (CHUNK * 4) as u64,
                    "rank {rank}: {crossed:?}"
                );
            } else {
                assert_eq!(crossed[3], 1, "rank {rank}: {crossed:?}");
            }
            assert_eq!(&crossed[4..], &[1, 1], "rank {rank}");
            for (call, out) in outs.iter().enumerate() {
                let want = truths(usize::from(call >= 3));
                assert_eq!(out, &want, "rank {rank}, gather {call}: never stale");
            }
        }
    }

    #[test]
    fn int8_references_give_every_rank_the_same_weights_within_int8s_error() {
        let int8 = DeltaWire {
            int8_references: Some(crate::plan::weight_format(8, 64).unwrap()),
            ..wire(4, 1000)
        };
        let (outs, truths, bytes) = run(12, int8, 1e-3);
        for (rank, o) in outs.iter().enumerate() {
            assert_eq!(o, &outs[0], "rank {rank}");
        }
        // The first gather (a refresh, f32 here) is the weights' int8
        // blocks of 64, exactly (references in values would be exact).
        assert_eq!(max_err(&outs[0][0], &truths[0]), int8_error(&truths[0]));
        // The weights are the references' int8 blocks: within int8's error
        // of them (and what one int4 difference of a step drops), at every
        // step: a difference is taken against what the receivers hold, so
        // the error does not grow.
        for step in 0..12 {
            let e = max_err(&outs[0][step], &truths[step]);
            let int8 = int8_error(&truths[step]);
            assert!(
                e > 0.0 && e < 2.0 * int8 + 1e-4,
                "step {step}: {e} (int8 {int8})"
            );
        }
        // The same bytes across nodes as references in values, but for
        // the refresh: the shard's int8 blocks (a byte a value and 4 bytes
        // a block) instead of its f32 values.
        let (_, _, f32_bytes) = run(12, wire(4, 1000), 1e-3);
        let int8_refresh = CHUNK + 4 * CHUNK.div_ceil(64);
        assert_eq!(f32_bytes - bytes, (4 * CHUNK - int8_refresh) as u64);
    }

    #[test]
    fn only_the_trainable_part_of_a_mixed_shard_crosses_nodes() {
        // The first half of every shard frozen, the second half moving.
        let half = CHUNK / 2;
        let int4 = crate::plan::weight_format(4, 64).unwrap();
        let got = on_ranks(2, 2, move |layout, mover| {
            let mut reference: Option<ReferenceOf<Host>> = None;
            let (mut outs, mut crossed) = (Vec::new(), Vec::new());
            let (mut frozen_bytes, frozen) =
                (Vec::new(), std::iter::once(0..half).collect::<Vec<_>>());
            for step in 0..5 {
                let mut shard = truth(layout.rank, 0, 0.0);
                shard[half..].copy_from_slice(&truth(layout.rank, step, 1e-3)[half..]);
                let mut out = vec![0f32; 4 * CHUNK];
                let before = mover.counter.traffic();
                let (x, mut o) = (&shard[..], &mut out[..]);
                let p = Phase::ForwardGather;
                let slot = Slot {
                    reference: &mut reference,
                    frozen: &frozen,
                    on_host: false,
                };
                gather(&Host, mover, layout, wire(4, 1000), slot, &x, &mut o, p).unwrap();
                let sent = mover.counter.traffic().since(&before);
                crossed.push(sent.total().inter_node);
                frozen_bytes.push(sent.frozen.total.inter_node);
                outs.push((out, shard));
            }
            // The frozen half crosses once (f32 here), then a byte a gather.
            assert_eq!(frozen_bytes, [(half * 4) as u64, 1, 1, 1, 1]);
            assert_eq!(crossed[0], (CHUNK * 4) as u64, "and the rest beside it");
            (outs, crossed)
        });
        for (rank, ((outs, crossed), _)) in got.iter().enumerate() {
            // After the first gather: a byte, then int4 differences of the
            // trainable half only.
            let each = 1 + int4.total_bytes(half) as u64;
            assert_eq!(&crossed[1..], &[each; 4], "rank {rank}");
            for (step, (out, _)) in outs.iter().enumerate() {
                assert_eq!(out, &got[0].0.0[step].0, "rank {rank} at step {step}");
            }
        }
        // Every rank's output: the frozen halves exact, the trainable ones
        // within int4 of one step's change.
        let (outs, _) = &got[0].0;
        for (step, (out, _)) in outs.iter().enumerate() {
            for r in 0..4 {
                let mut want = truth(r, 0, 0.0);
                want[half..].copy_from_slice(&truth(r, step, 1e-3)[half..]);
                let at = r * CHUNK;
                assert_eq!(&out[at..at + half], &want[..half], "step {step} rank {r}");
                let e = max_err(&out[at + half..at + CHUNK], &want[half..]);
                assert!(e < 1e-4, "step {step} rank {r}: {e}");
            }
        }
    }

    #[test]
    fn weights_that_stop_moving_are_gathered_exactly() {
        let (outs, truths, _) = run(6, wire(4, 1000), 1e-3);
        let moving = max_err(&outs[0][1], &truths[1]);
        let (still, still_truths, _) = run(6, wire(4, 1000), 0.0);
        assert!(moving > 0.0);
        assert_eq!(still[0][5], still_truths[5]);
    }

    #[test]
    fn a_refresh_then_int4_differences_cross_nodes_and_nothing_else() {
        let int4 = crate::plan::weight_format(4, 64).unwrap();
        let (_, _, bytes) = run(6, wire(4, 1000), 1e-3);
        // Rank 0 sends to its one peer on the other node: the weights in
        // f32 once, then five int4 differences (scales counted).
        assert_eq!(bytes, (CHUNK * 4 + 5 * int4.total_bytes(CHUNK)) as u64);
        // Refreshes every 2 forward gathers: at 0, 2 and 4.
        let (_, _, every2) = run(6, wire(4, 2), 1e-3);
        assert_eq!(every2, (3 * CHUNK * 4 + 3 * int4.total_bytes(CHUNK)) as u64);
    }
}
