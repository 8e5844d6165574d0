//! qgZ: the gradient reduce-scatter, written once over a [`Quantizer`] and
//! a [`ByteMover`] (host and device alike). The W chunks of a flat gradient
//! are swizzled so that the chunks bound for one local rank are contiguous,
//! quantized (or sent as they are, in bf16: [`FirstHop::Bf16`]), exchanged
//! all-to-all inside the node, summed in f32, requantized, exchanged
//! all-to-all across nodes among equal local ranks and summed in f32
//! again: each rank ends with the sum over the world of its own chunk,
//! divided by W for the mean. Error feedback keeps what each
//! quantization dropped (compressed: [`crate::residual`]) and adds it back
//! on the next call. ZeRO-3's plain rings live with the host backend
//! (`crate::host::ring_bf16`, `ring_f32`).

use zeropp_quant::{QuantFormat, Rounding};

use zeropp_cuda::GpuElement;

use crate::backend::{ByteMover, Hop, Quantizer, check_hops};
use crate::error::ZeroError;
use crate::layout::Layout;
use crate::residual;
use crate::traffic::Phase;

/// qgZ's hop inside the node: the gradient quantized, or sent as it is in
/// bf16, rounded to nearest even whatever the rounding of the hop across
/// (`qgz_intra_bits=16`: nothing dropped, and no quantization, which on
/// the host path costs more CPU than the node's shared-memory bytes it
/// saves: docs/BENCHMARKS.md).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FirstHop {
    Quantized(QuantFormat),
    Bf16,
}

/// Whether qgZ's first hop (quantizing to `intra`) keeps error feedback
/// when the switch is on, on nodes of `ranks_per_node` ranks: only at int4
/// (bf16 drops nothing to keep), and only where there is a hop inside the
/// node (a node of one rank sends nothing inside it). Its
/// residual is as long as the whole gradient (O(Ψ) per rank, where the sharded state is O(Ψ/W)); an
/// int8 hop drops 16 times less than int4, too little to pay that for
/// (measured: docs/TRAINING.md, "Loss parity"). The hop across nodes,
/// always int4, keeps its O(Ψ/G) residual.
pub fn first_hop_feedback(error_feedback: bool, intra: FirstHop, ranks_per_node: usize) -> bool {
    let int4 = matches!(intra, FirstHop::Quantized(f) if f.bits == zeropp_quant::Bits::Four);
    error_feedback && int4 && ranks_per_node > 1
}

/// The rounding of qgZ call `call` on gradient buffer `buffer` of `rank`
/// (the engine: the step and the unit; the bindings: the parameter group's
/// own call count, buffer 0): a fresh stochastic stream per call, buffer
/// and rank from `seed`, or round-to-nearest. The one policy of the engine
/// and the bindings.
pub fn rounding(stochastic: bool, seed: u64, call: u64, buffer: usize, rank: usize) -> Rounding {
    if stochastic {
        Rounding::Stochastic {
            seed: seed ^ (call << 32) ^ ((buffer as u64) << 16) ^ rank as u64,
        }
    } else {
        Rounding::NearestEven
    }
}

/// What a reduce-scatter hands back: the sum over the world, or the mean
/// (the sum divided by W, every rank of the world: not the nodes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    Sum,
    Mean,
}

impl Reduction {
    /// The mean when `mean`, else the sum.
    pub fn mean_if(mean: bool) -> Reduction {
        match mean {
            true => Reduction::Mean,
            false => Reduction::Sum,
        }
    }

    /// `sum` turned into what was asked for, on `q`'s memory.
    pub fn apply<Q: Quantizer>(
        self,
        q: &Q,
        sum: &mut Q::Values,
        layout: Layout,
    ) -> Result<(), ZeroError> {
        match self {
            Reduction::Sum => Ok(()),
            Reduction::Mean => q.divide(sum, layout.world() as f32),
        }
    }
}

/// Makes `r` a zeroed residual of `count` chunks of `chunk_len` values
/// unless it already is that shape (a residual of another shape cannot be
/// carried over).
fn ensure_residual<Q: Quantizer>(
    q: &Q,
    r: &mut Q::Chunks,
    chunk_len: usize,
    count: usize,
) -> Result<(), ZeroError> {
    let format = residual::format();
    if q.shape(r) != (format, chunk_len, count) {
        *r = q.chunks(format, chunk_len, count)?;
    }
    Ok(())
}

/// `x` (`count` equal chunks) quantized into `out`, chunk r rounded with
/// `rounding.for_part(r)`; with `residual`, what it kept from the last
/// call is added to `x` first and it is replaced by what this
/// quantization drops (error feedback).
pub(crate) fn quantize_kept<Q: Quantizer>(
    q: &Q,
    x: &mut Q::Values,
    count: usize,
    rounding: Rounding,
    out: &mut Q::Chunks,
    residual: Option<&mut Q::Chunks>,
) -> Result<(), ZeroError> {
    let Some(residual) = residual else {
        return q.quantize_swizzled(x, count, 1, rounding, out);
    };
    ensure_residual(q, residual, q.len(x) / count, count)?;
    q.quantize_swizzled_kept(x, count, 1, rounding, out, residual)
}

/// The length of each of `layout`'s W chunks of a gradient of `len`
/// values, which must split evenly.
fn chunk_len(len: usize, layout: Layout) -> Result<usize, ZeroError> {
    let world = layout.world();
    if !len.is_multiple_of(world) {
        return Err(ZeroError::Invalid(format!(
            "a gradient of {len} values does not split into {world} equal chunks; pad it to a \
             multiple of the world size"
        )));
    }
    Ok(len / world)
}

/// Hop 1's input: `grad` (W chunks in rank order, plus the residual of the
/// last call when `residual` is given) quantized in `format` at the
/// swizzled positions. With a residual, it is replaced by what this
/// quantization dropped. The gradient is taken (and given back for reuse):
/// the residual is added into it in place, with no copy.
pub fn quantize_first_hop<Q: Quantizer>(
    q: &Q,
    mut grad: Q::Values,
    layout: Layout,
    format: QuantFormat,
    rounding: Rounding,
    residual: Option<&mut Q::Chunks>,
) -> Result<Q::Chunks, ZeroError> {
    let (nodes, g, world) = (layout.nodes, layout.ranks_per_node, layout.world());
    let quantize = || {
        let chunk = chunk_len(q.len(&grad), layout)?;
        let mut out = q.chunks(format, chunk, world)?;
        match residual {
            None => q.quantize_swizzled(&grad, nodes, g, rounding, &mut out)?,
            Some(residual) => {
                ensure_residual(q, residual, chunk, world)?;
                q.quantize_swizzled_kept(&mut grad, nodes, g, rounding, &mut out, residual)?;
            }
        }
        Ok(out)
    };
    let out = quantize();
    q.recycle(grad);
    out
}

/// How the node's partial sums are requantized for the hop across nodes.
pub struct SecondHop<'a, Q: Quantizer> {
    pub format: QuantFormat,
    /// The call's rounding (hop 2 draws from its part 1).
    pub rounding: Rounding,
    /// Error feedback of this quantization (N chunks; of another shape it
    /// starts from zero), kept in the rotated values with `hadamard`.
    pub residual: Option<&'a mut Q::Chunks>,
    /// Rotate each block of `format.block` values (Walsh–Hadamard) before
    /// quantizing; the receiver sums the rotated values and rotates back.
    pub hadamard: bool,
}

impl<'a, Q: Quantizer> SecondHop<'a, Q> {
    /// The hop across nodes of the qgZ call `s`, with `residual`.
    pub fn of(s: Qgz, residual: Option<&'a mut Q::Chunks>) -> Self {
        SecondHop {
            format: s.inter,
            rounding: s.rounding,
            residual,
            hadamard: s.hadamard,
        }
    }
}

/// Hops 1 and 2 of `first` (from [`quantize_first_hop`]): this rank's
/// chunk of the sum over every rank, in f32, as `reduction` asks.
pub fn exchange<Q: Quantizer, M: ByteMover<Q>>(
    q: &Q,
    m: &M,
    layout: Layout,
    first: Q::Chunks,
    second: SecondHop<'_, Q>,
    reduction: Reduction,
) -> Result<Q::Values, ZeroError> {
    let (nodes, g) = (layout.nodes, layout.ranks_per_node);
    let (intra, chunk, count) = q.shape(&first);
    check_hops(m, layout, "qgZ")?;
    if count != nodes * g {
        return Err(ZeroError::Invalid(format!(
            "qgZ over {nodes} nodes x {g} ranks was given {count} chunks, not one per rank"
        )));
    }
    // Hop 1, inside the node: local rank g' gets positions g'·N..(g'+1)·N,
    // so position src·N + n of what arrives is local rank src's chunk for
    // node n.
    let mut got = q.chunks(intra, chunk, count)?;
    m.all_to_all(q, Hop::Node, Phase::Gradient, &first, &mut got)?;
    q.recycle_chunks(first);
    if nodes > 1 && !second.hadamard && second.residual.is_none() {
        // Sum and requantize in one pass.
        let part_rounding = second.rounding.for_part(1);
        let mut partial = q.chunks(second.format, chunk, nodes)?;
        for n in 0..nodes {
            let inputs: Vec<usize> = (0..g).map(|src| src * nodes + n).collect();
            q.sum_requantize(&got, &inputs, part_rounding.for_part(n), &mut partial, n)?;
        }
        q.recycle_chunks(got);
        return hop_two(q, m, layout, partial, &second, reduction);
    }
    let mut sum = q.values_for_overwrite(nodes * chunk)?;
    for n in 0..nodes {
        sum_chunks(
            q,
            &got,
            (0..g).map(|src| src * nodes + n),
            &mut sum,
            n * chunk,
        )?;
    }
    q.recycle_chunks(got);
    across_nodes(q, m, layout, sum, second, reduction)
}

/// What follows hop 1: `sum`, the node's f32 partial sums of the N
/// chunks bound for this rank's equal local ranks, requantized and
/// exchanged across nodes ([`hop_two`]); on one node they are the world's
/// sums already, with no hop across to quantize them for a second time.
fn across_nodes<Q: Quantizer, M: ByteMover<Q>>(
    q: &Q,
    m: &M,
    layout: Layout,
    mut sum: Q::Values,
    mut second: SecondHop<'_, Q>,
    reduction: Reduction,
) -> Result<Q::Values, ZeroError> {
    if layout.nodes == 1 {
        reduction.apply(q, &mut sum, layout)?;
        return Ok(sum);
    }
    let partial = requantize_partial(q, layout, sum, &mut second)?;
    hop_two(q, m, layout, partial, &second, reduction)
}

/// Hop 1 in bf16 ([`FirstHop::Bf16`]) from the caller's tensor: each local
/// rank's chunks sent as they are (rounded to bf16 where `T` is wider),
/// summed in f32 by the receiver in local-rank order, then across nodes.
fn bf16_first_hop<Q: Quantizer, M: ByteMover<Q>, T: GpuElement>(
    q: &Q,
    m: &M,
    layout: Layout,
    grad: &Q::Tensor<'_, T>,
    second: SecondHop<'_, Q>,
    reduction: Reduction,
) -> Result<Q::Values, ZeroError> {
    let sum = bf16_node_sum(q, m, layout, grad)?;
    across_nodes(q, m, layout, sum, second, reduction)
}

/// Hop 1 in bf16 alone, from `x` (the gradient's W chunks in rank order):
/// the f32 sums, in local-rank order, of what each local rank sent this
/// one: the node's N partial sums.
fn bf16_node_sum<Q: Quantizer, M: ByteMover<Q>, T: GpuElement>(
    q: &Q,
    m: &M,
    layout: Layout,
    x: &Q::Tensor<'_, T>,
) -> Result<Q::Values, ZeroError> {
    check_hops(m, layout, "qgZ")?;
    let chunk = chunk_len(q.tensor_len(x), layout)?;
    let mut sum = q.values_for_overwrite(layout.nodes * chunk)?;
    m.sum_swizzled(q, Hop::Node, Phase::Gradient, x, layout.nodes, &mut sum)?;
    Ok(sum)
}

/// A gradient for a bf16 hop inside the node ([`FirstHop::Bf16`], nodes of
/// more than one rank), made ready on the caller's thread: rounded to bf16
/// (nearest even, as the hop rounds it), local rank j's chunks (n · G + j
/// for every node n) one contiguous run at j · N · chunk. The gradient is
/// taken and its f32 buffer given back at once, so a call in flight holds
/// half its bytes ([`exchange_bf16`] sends it: the same sums bit for bit).
pub fn bf16_runs<Q: Quantizer>(
    q: &Q,
    grad: Q::Values,
    layout: Layout,
) -> Result<Q::Kept, ZeroError> {
    let len = q.len(&grad);
    let chunk = chunk_len(len, layout)?;
    let (nodes, g) = (layout.nodes, layout.ranks_per_node);
    let mut runs = q.kept_for_overwrite(len, true)?;
    for j in 0..g {
        for n in 0..nodes {
            let (from, to) = ((n * g + j) * chunk, (j * nodes + n) * chunk);
            q.store_kept(&grad, from, &mut runs, to, chunk)?;
        }
    }
    q.recycle(grad);
    Ok(runs)
}

/// Hops 1 and 2 of `runs` (from [`bf16_runs`]): this rank's chunk of the
/// sum over every rank, in f32, as `reduction` asks; the runs go back for
/// reuse once the node has summed them.
pub fn exchange_bf16<Q: Quantizer, M: ByteMover<Q>>(
    q: &Q,
    m: &M,
    layout: Layout,
    runs: Q::Kept,
    second: SecondHop<'_, Q>,
    reduction: Reduction,
) -> Result<Q::Values, ZeroError> {
    check_hops(m, layout, "qgZ")?;
    let chunk = chunk_len(q.kept_len(&runs), layout)?;
    let mut sum = q.values_for_overwrite(layout.nodes * chunk)?;
    m.sum_runs_taking(q, Hop::Node, Phase::Gradient, runs, &mut sum)?;
    across_nodes(q, m, layout, sum, second, reduction)
}

/// The f32 sum of chunks `sources` of `from`, in that order, into
/// `sum[at..at + chunk_len]`, which need not be zeroed: the first is
/// written, the rest added. Bit for bit what adding each to zeros gives:
/// qgZ's formats are symmetric (`plan::gradient_formats`), whose values
/// are never −0 (a zero code is +0, and a block of scale 0 has only zero
/// codes).
fn sum_chunks<Q: Quantizer>(
    q: &Q,
    from: &Q::Chunks,
    mut sources: impl Iterator<Item = usize>,
    sum: &mut Q::Values,
    at: usize,
) -> Result<(), ZeroError> {
    let (format, ..) = q.shape(from);
    let first = sources.next();
    let (Some(first), zeropp_quant::Scheme::Symmetric) = (first, format.scheme) else {
        return Err(ZeroError::Invalid(format!(
            "qgZ sums chunks of a symmetric format, at least one: not {format:?}"
        )));
    };
    q.dequantize(from, first, sum, at)?;
    for src in sources {
        q.dequantize_accumulate(from, src, sum, at)?;
    }
    Ok(())
}

/// The node's partial sums (`sum`: N chunks, f32) requantized for the hop
/// across nodes: rotated with `second.hadamard` (chunk by chunk: each is
/// one receiver's, rotated back alone), what this hop dropped last call
/// added back, and what it drops now kept.
fn requantize_partial<Q: Quantizer>(
    q: &Q,
    layout: Layout,
    mut sum: Q::Values,
    second: &mut SecondHop<'_, Q>,
) -> Result<Q::Chunks, ZeroError> {
    let nodes = layout.nodes;
    let chunk = q.len(&sum) / nodes;
    let mut partial = q.chunks(second.format, chunk, nodes)?;
    if second.hadamard {
        for n in 0..nodes {
            q.rotate(&mut sum, n * chunk, chunk, second.format.block)?;
        }
    }
    let (rounding, residual) = (second.rounding.for_part(1), second.residual.as_deref_mut());
    quantize_kept(q, &mut sum, nodes, rounding, &mut partial, residual)?;
    q.recycle(sum);
    Ok(partial)
}

/// Hop 2, across nodes: node n' gets chunk n' of every node's `partial`,
/// sums it in f32 (rotated back with `second.hadamard`), as `reduction`
/// asks.
fn hop_two<Q: Quantizer, M: ByteMover<Q>>(
    q: &Q,
    m: &M,
    layout: Layout,
    partial: Q::Chunks,
    second: &SecondHop<'_, Q>,
    reduction: Reduction,
) -> Result<Q::Values, ZeroError> {
    let (_, chunk, nodes) = q.shape(&partial);
    let block = second.format.block;
    let mut theirs = q.chunks(second.format, chunk, nodes)?;
    m.all_to_all(q, Hop::Cross, Phase::Gradient, &partial, &mut theirs)?;
    q.recycle_chunks(partial);
    let mut sum = q.values_for_overwrite(chunk)?;
    sum_chunks(q, &theirs, 0..nodes, &mut sum, 0)?;
    q.recycle_chunks(theirs);
    if second.hadamard {
        q.rotate(&mut sum, 0, chunk, block)?;
    }
    reduction.apply(q, &mut sum, layout)?;
    Ok(sum)
}

/// The settings of one qgZ reduce-scatter.
#[derive(Clone, Copy, Debug)]
pub struct Qgz {
    /// The hop inside the node and the format of the hop across nodes.
    pub intra: FirstHop,
    pub inter: QuantFormat,
    pub rounding: Rounding,
    /// The hop across nodes rotated block by block (Walsh–Hadamard).
    pub hadamard: bool,
}

/// Error feedback of one gradient buffer: what each hop dropped last call
/// (`None`: no feedback at that hop).
pub struct Feedback<'a, Q: Quantizer> {
    pub first: Option<&'a mut Q::Chunks>,
    pub second: Option<&'a mut Q::Chunks>,
}

impl<'a, Q: Quantizer> Feedback<'a, Q> {
    /// No residual at either hop.
    pub fn none() -> Self {
        Feedback {
            first: None,
            second: None,
        }
    }

    /// The residuals of the hops that keep feedback (`keeps`: inside the
    /// node, across nodes).
    pub fn kept(keeps: (bool, bool), first: &'a mut Q::Chunks, second: &'a mut Q::Chunks) -> Self {
        Feedback {
            first: keeps.0.then_some(first),
            second: keeps.1.then_some(second),
        }
    }
}

/// The whole qgZ reduce-scatter of `grad` (every rank's full gradient, W
/// equal chunks): this rank's chunk of the sum or mean (`reduction`) over
/// the world. A copy of `grad` goes through [`reduce_scatter_taking`].
pub fn reduce_scatter<Q: Quantizer, M: ByteMover<Q>>(
    q: &Q,
    m: &M,
    layout: Layout,
    how: (Qgz, Reduction),
    grad: &Q::Values,
    feedback: Feedback<'_, Q>,
) -> Result<Q::Values, ZeroError> {
    let len = q.len(grad);
    let mut owned = q.values_for_overwrite(len)?;
    q.copy(grad, 0, &mut owned, 0, len)?;
    reduce_scatter_taking(q, m, layout, how, owned, feedback)
}

/// [`reduce_scatter`] of a gradient the call takes (and gives back for
/// reuse): a node of one rank requantizes it, and the first hop adds its
/// error feedback into it, in place — no copy of the gradient.
pub fn reduce_scatter_taking<Q: Quantizer, M: ByteMover<Q>>(
    q: &Q,
    m: &M,
    layout: Layout,
    (s, reduction): (Qgz, Reduction),
    grad: Q::Values,
    feedback: Feedback<'_, Q>,
) -> Result<Q::Values, ZeroError> {
    if s.intra == FirstHop::Bf16 || layout.ranks_per_node == 1 {
        no_first_feedback(&feedback.first)?;
    }
    let mut second = SecondHop::of(s, feedback.second);
    if layout.ranks_per_node == 1 {
        // A node of one rank: nothing to exchange inside it, so its
        // partial sum is its own gradient, not quantized a first time.
        check_hops(m, layout, "qgZ")?;
        chunk_len(q.len(&grad), layout)?;
        let partial = requantize_partial(q, layout, grad, &mut second)?;
        return hop_two(q, m, layout, partial, &second, reduction);
    }
    match s.intra {
        FirstHop::Quantized(intra) => {
            let first = quantize_first_hop(q, grad, layout, intra, s.rounding, feedback.first)?;
            exchange(q, m, layout, first, second, reduction)
        }
        FirstHop::Bf16 => {
            // The gradient goes back before the hop across nodes.
            let sum = bf16_node_sum(q, m, layout, &q.values_as_tensor(&grad))?;
            q.recycle(grad);
            across_nodes(q, m, layout, sum, second, reduction)
        }
    }
}

/// Refuses a first-hop residual where there is nothing to keep: a bf16
/// hop inside the node (it drops nothing), or no hop inside the node at
/// all (nodes of one rank).
pub(crate) fn no_first_feedback<C>(first: &Option<&mut C>) -> Result<(), ZeroError> {
    match first {
        None => Ok(()),
        Some(_) => Err(ZeroError::Invalid(
            "qgZ keeps no error feedback inside the node on this wire (a bf16 hop drops \
             nothing; a node of one rank has no hop inside it): pass no first-hop residual \
             (GradWire::keeps says which hops keep one)"
                .into(),
        )),
    }
}

/// [`reduce_scatter`] of a caller's tensor (any [`GpuElement`]), the same
/// bit for bit: where nothing is added to the gradient before the first
/// hop (no error feedback inside the node) it is quantized (or, in bf16,
/// sent) straight from the tensor, without a copy in f32 first.
pub fn reduce_scatter_tensor<Q: Quantizer, M: ByteMover<Q>, T: GpuElement>(
    q: &Q,
    m: &M,
    layout: Layout,
    (s, reduction): (Qgz, Reduction),
    grad: &Q::Tensor<'_, T>,
    feedback: Feedback<'_, Q>,
) -> Result<Q::Values, ZeroError> {
    let len = q.tensor_len(grad);
    let intra = match s.intra {
        FirstHop::Quantized(f) if feedback.first.is_none() && layout.ranks_per_node > 1 => f,
        FirstHop::Bf16 if layout.ranks_per_node > 1 => {
            no_first_feedback(&feedback.first)?;
            let second = SecondHop::of(s, feedback.second);
            return bf16_first_hop(q, m, layout, grad, second, reduction);
        }
        _ => {
            let mut values = q.values_for_overwrite(len)?;
            q.load_tensor(grad, &mut values, 0)?;
            return reduce_scatter_taking(q, m, layout, (s, reduction), values, feedback);
        }
    };
    let chunk = chunk_len(len, layout)?;
    let mut first = q.chunks(intra, chunk, layout.world())?;
    let (nodes, g) = (layout.nodes, layout.ranks_per_node);
    q.quantize_tensor_swizzled(grad, nodes, g, s.rounding, &mut first)?;
    exchange(
        q,
        m,
        layout,
        first,
        SecondHop::of(s, feedback.second),
        reduction,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{Host, HostMover};
    use crate::plan::gradient_formats;
    use crate::testing::on_ranks;

    /// qgZ with `intra_bits` inside the node (16: bf16), int4 across in
    /// blocks of `inter_block`, round to nearest.
    fn nearest(intra_bits: u32, inter_block: Option<usize>, hadamard: bool) -> Qgz {
        let (intra, inter) = gradient_formats(intra_bits, 32, inter_block).unwrap();
        Qgz {
            intra,
            inter,
            rounding: Rounding::NearestEven,
            hadamard,
        }
    }

    /// No error feedback on either hop.
    fn no_feedback<'a>() -> Feedback<'a, Host> {
        Feedback {
            first: None,
            second: None,
        }
    }

    /// Rank r's gradient: small values with one large outlier every 97.
    fn gradient(rank: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let x = ((i * 31 + rank * 17) as f32 * 0.7).sin() * 1e-3;
                if (i + rank * 13).is_multiple_of(97) {
                    x + 0.05
                } else {
                    x
                }
            })
            .collect()
    }

    /// Each rank's chunk of the mean over 2 x 2 ranks through qgZ (int8
    /// inside, an int4 hop across in blocks of `inter_block`), and the
    /// exact mean's chunk.
    fn mean_chunks(hadamard: bool, inter_block: usize, len: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
        mean_chunks_with(8, hadamard, inter_block, len)
    }

    /// [`mean_chunks`] with `intra_bits` inside the node (16: bf16).
    fn mean_chunks_with(
        intra_bits: u32,
        hadamard: bool,
        inter_block: usize,
        len: usize,
    ) -> Vec<(Vec<f32>, Vec<f32>)> {
        on_ranks(2, 2, move |layout, mover| {
            let (intra, inter) = gradient_formats(intra_bits, 32, Some(inter_block)).unwrap();
            let s = Qgz {
                intra,
                inter,
                rounding: Rounding::NearestEven,
                hadamard,
            };
            let none = Feedback {
                first: None,
                second: None,
            };
            let grad = gradient(layout.rank, len);
            let s = (s, Reduction::Mean);
            let got = reduce_scatter(&Host, mover, layout, s, &grad, none).unwrap();
            let chunk = len / 4;
            let at = layout.rank * chunk;
            let exact: Vec<f32> = (at..at + chunk)
                .map(|i| (0..4).map(|r| gradient(r, len)[i]).sum::<f32>() / 4.0)
                .collect();
            (got, exact)
        })
        .into_iter()
        .map(|(r, _)| r)
        .collect()
    }

    #[test]
    fn a_tensor_quantized_straight_gives_what_its_f32_copy_gives_bit_for_bit() {
        // bf16 and f32 gradients, with and without the first hop's
        // feedback (which takes the f32 copy), three calls each (the
        // residuals carried), on the host and the emulated device.
        fn calls<K: crate::host::HostKernels + Sync>(
            k: &K,
            layout: Layout,
            m: &HostMover<'_>,
        ) -> Vec<u32> {
            let mut bits = Vec::new();
            for (intra_bits, bf16) in [(8, true), (4, true), (8, false)] {
                let (intra, inter) = gradient_formats(intra_bits, 32, Some(64)).unwrap();
                let s = Qgz {
                    intra,
                    inter,
                    rounding: Rounding::NearestEven,
                    hadamard: true,
                };
                let keeps = first_hop_feedback(true, intra, layout.ranks_per_node);
                let empty = || k.chunks(crate::residual::format(), 32, 1).unwrap();
                let mut kept = [(empty(), empty()), (empty(), empty())];
                for call in 0..3 {
                    let grad: Vec<f32> = gradient(layout.rank + call, 4 * 640)
                        .iter()
                        .map(|&v| {
                            if bf16 {
                                half::bf16::from_f32(v).to_f32()
                            } else {
                                v
                            }
                        })
                        .collect();
                    let halves: Vec<half::bf16> =
                        grad.iter().map(|&v| half::bf16::from_f32(v)).collect();
                    let [a, b] = &mut kept;
                    let fa = Feedback::kept((keeps, true), &mut a.0, &mut a.1);
                    let want =
                        reduce_scatter(k, m, layout, (s, Reduction::Mean), &grad, fa).unwrap();
                    let fb = Feedback::kept((keeps, true), &mut b.0, &mut b.1);
                    let got = if bf16 {
                        reduce_scatter_tensor(k, m, layout, (s, Reduction::Mean), &&halves[..], fb)
                    } else {
                        reduce_scatter_tensor(k, m, layout, (s, Reduction::Mean), &&grad[..], fb)
                    }
                    .unwrap();
                    assert_eq!(
                        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "int{intra_bits} inside, bf16 {bf16}, call {call}"
                    );
                    bits.extend(got.iter().map(|v| v.to_bits()));
                }
            }
            bits
        }
        let host = on_ranks(2, 2, |layout, m| calls(&Host, layout, m));
        let emulated = on_ranks(2, 2, |layout, m| {
            calls(&crate::emulated::Emulated, layout, m)
        });
        assert_eq!(host, emulated);
    }

    /// Root-mean-square error over every rank's chunk, relative to the
    /// exact mean's.
    fn relative_rms(r: &[(Vec<f32>, Vec<f32>)]) -> f64 {
        let (mut err, mut norm) = (0f64, 0f64);
        for (got, exact) in r {
            for (g, e) in got.iter().zip(exact) {
                err += f64::from(g - e).powi(2);
                norm += f64::from(*e).powi(2);
            }
        }
        (err / norm).sqrt()
    }

    /// Chunk `rank` of the sum over 4 ranks of each rank's gradient of
    /// `len`, each quantized once in `format` (rounded to nearest) and
    /// summed in f32 in rank order.
    fn quantized_once(format: QuantFormat, rank: usize, len: usize) -> Vec<f32> {
        let chunk = len / 4;
        let mut sum = vec![0f32; chunk];
        for src in 0..4 {
            let x = gradient(src, len)[rank * chunk..(rank + 1) * chunk].to_vec();
            let mut q = Host.chunks(format, chunk, 1).unwrap();
            Host.quantize_chunk(&x, 0, Rounding::NearestEven, &mut q, 0)
                .unwrap();
            Host.dequantize_accumulate(&q, 0, &mut sum, 0).unwrap();
        }
        sum
    }

    #[test]
    fn a_node_of_one_rank_quantizes_its_gradient_once() {
        // Nodes of one rank (the dp dimension next to tensor parallelism):
        // nothing moves inside a node, and what arrives is each rank's own
        // chunk quantized once at int4, summed in f32 in rank order.
        let len = 4 * 256;
        let (_, inter) = gradient_formats(8, 32, Some(64)).unwrap();
        let got = on_ranks(4, 1, move |layout, mover| {
            let s = nearest(8, Some(64), false);
            let none = no_feedback();
            let grad = gradient(layout.rank, len);
            let got = reduce_scatter(&Host, mover, layout, (s, Reduction::Sum), &grad, none);
            (got.unwrap(), mover.counter.traffic().total().intra_node)
        });
        for (rank, ((sum, inside), _)) in got.iter().enumerate() {
            assert_eq!(*inside, 0, "rank {rank} sent inside its node");
            assert_eq!(sum, &quantized_once(inter, rank, len), "rank {rank}");
        }
    }

    #[test]
    fn on_one_node_the_gradient_is_quantized_once() {
        // One node (HSDP's shard dimension): after the hop inside it the
        // sums are the world's; nothing crosses nodes, nothing is
        // quantized again.
        let len = 4 * 256;
        let intra = QuantFormat::int8(32).unwrap();
        let got = on_ranks(1, 4, move |layout, mover| {
            let s = nearest(8, Some(64), true);
            let none = no_feedback();
            let grad = gradient(layout.rank, len);
            reduce_scatter(&Host, mover, layout, (s, Reduction::Sum), &grad, none).unwrap()
        });
        for (rank, (sum, across)) in got.iter().enumerate() {
            assert_eq!(*across, 0, "rank {rank} sent across nodes");
            assert_eq!(sum, &quantized_once(intra, rank, len), "rank {rank}");
        }
    }

    #[test]
    fn a_hadamard_rotated_hop_across_nodes_loses_less_to_outliers() {
        // Chunks of whole blocks (the engine pads to them) and chunks that
        // end in a part of one (FSDP2's shards).
        for len in [4 * 1024, 4 * 1000] {
            let plain = relative_rms(&mean_chunks(false, 128, len));
            let rotated = relative_rms(&mean_chunks(true, 128, len));
            // An outlier sets its whole block's int4 scale; rotated, it is
            // spread over the block and the small values keep their bits.
            assert!(
                rotated < 0.7 * plain,
                "{len}: rotated {rotated:.4} against plain {plain:.4}"
            );
            assert!(rotated < 0.2, "{len}: rotated {rotated:.4}");
        }
    }

    #[test]
    fn on_one_node_a_bf16_hop_gives_the_f32_sum_of_the_bf16_gradients() {
        // One node of three: the hop inside is the whole reduce-scatter.
        // Each rank ends with its chunk of the f32 sum, in rank order, of
        // every rank's gradient rounded to bf16 once: from f32 values and
        // from a bf16 tensor alike, nothing quantized.
        let len = 3 * 200;
        let got = on_ranks(1, 3, move |layout, mover| {
            let (intra, inter) = gradient_formats(16, 32, Some(64)).unwrap();
            assert_eq!(intra, FirstHop::Bf16);
            let s = Qgz {
                intra,
                inter,
                rounding: Rounding::NearestEven,
                hadamard: true,
            };
            let none = || Feedback {
                first: None,
                second: None,
            };
            let grad = gradient(layout.rank, len);
            let halves: Vec<half::bf16> = grad.iter().map(|&v| half::bf16::from_f32(v)).collect();
            let s = (s, Reduction::Sum);
            let from_values = reduce_scatter(&Host, mover, layout, s, &grad, none()).unwrap();
            let from_tensor =
                reduce_scatter_tensor(&Host, mover, layout, s, &&halves[..], none()).unwrap();
            (from_values, from_tensor)
        });
        for (rank, ((from_values, from_tensor), _)) in got.iter().enumerate() {
            let want: Vec<f32> = (rank * 200..(rank + 1) * 200)
                .map(|i| {
                    let each = (0..3).map(|r| half::bf16::from_f32(gradient(r, len)[i]).to_f32());
                    each.reduce(|a, b| a + b).unwrap()
                })
                .collect();
            assert_eq!(from_values, &want, "rank {rank}, from f32 values");
            assert_eq!(from_tensor, &want, "rank {rank}, from a bf16 tensor");
        }
    }

    #[test]
    fn a_bf16_hop_inside_loses_less_than_an_int8_one_and_sends_two_bytes_a_value() {
        let len = 4 * 1024;
        let int8 = relative_rms(&mean_chunks_with(8, true, 64, len));
        let bf16 = relative_rms(&mean_chunks_with(16, true, 64, len));
        assert!(bf16 < int8, "bf16 inside {bf16:.5} against int8 {int8:.5}");
        // What each rank sends inside its node: its 2 chunks for the other
        // local rank, in bf16; across: the int4 hop, as with int8 inside.
        let sent = on_ranks(2, 2, move |layout, mover| {
            let s = nearest(16, Some(64), false);
            let none = no_feedback();
            let grad = gradient(layout.rank, len);
            reduce_scatter(&Host, mover, layout, (s, Reduction::Mean), &grad, none).unwrap();
            mover.counter.traffic().total().intra_node
        });
        for (rank, (inside, _)) in sent.iter().enumerate() {
            assert_eq!(*inside, 2 * 2 * (len / 4) as u64, "rank {rank}");
        }
    }

    #[test]
    fn a_bf16_hop_inside_refuses_a_gradient_that_is_not_finite_on_every_rank_that_has_one() {
        // Nothing quantizes this hop: every rank checks what it would send
        // (the int8 hop's quantization finds it on every rank alike). A NaN
        // in chunk 0 only, bound for one local rank of each node.
        let got = on_ranks(2, 2, |layout, mover| {
            let s = nearest(16, Some(64), true);
            let none = no_feedback();
            let mut grad = gradient(layout.rank, 4 * 256);
            grad[7] = f32::NAN;
            let g16: Vec<half::bf16> = grad.iter().map(|&v| half::bf16::from_f32(v)).collect();
            let how = (s, Reduction::Mean);
            reduce_scatter_tensor(&Host, mover, layout, how, &&g16[..], none)
                .unwrap_err()
                .to_string()
        });
        for (rank, (msg, _)) in got.iter().enumerate() {
            assert!(
                msg.contains("at index 7 is not finite"),
                "rank {rank}: {msg}"
            );
        }
    }

    #[test]
    fn a_hop_inside_with_nothing_to_keep_refuses_a_residual_for_itself() {
        // A bf16 hop inside the node drops nothing; a node of one rank
        // has no hop inside it (an int4 first hop would otherwise keep one).
        for (nodes, g, intra_bits) in [(1, 2, 16), (2, 1, 4)] {
            let got = on_ranks(nodes, g, move |layout, mover| {
                let (intra, inter) = gradient_formats(intra_bits, 32, None).unwrap();
                assert!(!first_hop_feedback(true, intra, layout.ranks_per_node));
                let s = Qgz {
                    intra,
                    inter,
                    rounding: Rounding::NearestEven,
                    hadamard: false,
                };
                let mut r = Host.chunks(crate::residual::format(), 32, 1).unwrap();
                let feedback = Feedback {
                    first: Some(&mut r),
                    second: None,
                };
                let grad = gradient(layout.rank, 64);
                reduce_scatter(&Host, mover, layout, (s, Reduction::Mean), &grad, feedback)
                    .unwrap_err()
                    .to_string()
            });
            for (msg, _) in got {
                assert!(msg.contains("keeps no error feedback"), "{msg}");
            }
        }
        let (int4, _) = gradient_formats(4, 32, None).unwrap();
        assert!(first_hop_feedback(true, int4, 2));
    }
}
