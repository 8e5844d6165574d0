//! qgZ: the gradient reduce-scatter. The W chunks of a flat gradient are
//! swizzled so that the chunks bound for one local rank are contiguous,
//! quantized, exchanged all-to-all inside the node, summed in f32,
//! requantized, exchanged all-to-all across nodes among equal local ranks
//! and summed in f32 again: each rank ends with the sum over the world of
//! its own chunk. Error feedback keeps what each quantization dropped and
//! adds it back on the next call. The plain reduce-scatters of ZeRO-3
//! (bf16 or f32 rings) live here too.

use std::sync::Mutex;

use bytes::Bytes;
use zeropp_quant::{
    Element, QuantFormat, QuantizedChunks, Rounding, quantize_swizzled, sum_requantize,
};

use crate::comm::collectives::{Reduce, balanced_bounds};
use crate::comm::{CommError, Communicator, Group};

use super::groups::ZeroGroups;
use super::payload;
use super::plan::Layout;
use super::residual::Residual;
use super::traffic::{CountingTransport, Phase};

fn quant_failure(what: &str) -> impl Fn(zeropp_quant::QuantError) -> CommError + '_ {
    move |e| CommError::Malformed(format!("{what}: {e}"))
}

/// Whether qgZ's first hop (quantizing to `intra`) keeps error feedback
/// when the switch is on: only at int4. Its residual is as long as the
/// whole gradient (O(Ψ) per rank, where the sharded state is O(Ψ/W)); an
/// int8 hop drops 16 times less than int4, too little to pay that for
/// (measured: docs/TRAINING.md, "Loss parity"). The hop across nodes,
/// always int4, keeps its O(Ψ/G) residual.
pub fn first_hop_feedback(error_feedback: bool, intra: QuantFormat) -> bool {
    error_feedback && intra.bits == zeropp_quant::Bits::Four
}

/// Hop 1's input: `grad` (W chunks in rank order, plus the residual of the
/// last call when `residual` is given) quantized in `format` at the
/// swizzled positions. With a residual, it is replaced by what this
/// quantization dropped (a residual of another shape starts from zero).
pub fn quantize_first_hop<T: Element>(
    grad: &[T],
    layout: Layout,
    format: QuantFormat,
    rounding: Rounding,
    residual: Option<&mut Residual>,
) -> Result<QuantizedChunks, CommError> {
    let (nodes, g, world) = (layout.nodes, layout.ranks_per_node, layout.world());
    if !grad.len().is_multiple_of(world) {
        return Err(CommError::Invalid(format!(
            "a gradient of {} values does not split into {world} equal chunks",
            grad.len()
        )));
    }
    let chunk = grad.len() / world;
    let mut q = QuantizedChunks::zeroed(format, chunk, world);
    let quantizing = quant_failure("quantizing the gradient");
    let Some(residual) = residual else {
        quantize_swizzled(grad, nodes, g, rounding, &mut q).map_err(quantizing)?;
        return Ok(q);
    };
    residual.ensure_shape(chunk, world);
    let mut corrected: Vec<f32> = grad.iter().map(|g| g.to_f32()).collect();
    residual.add_to(&mut corrected).map_err(&quantizing)?;
    quantize_swizzled(&corrected, nodes, g, rounding, &mut q).map_err(&quantizing)?;
    // What the wire will carry, back in rank order: keep the rest.
    let mut sent = vec![0f32; chunk];
    for p in 0..world {
        let r = zeropp_quant::swizzled_rank(p, nodes, g);
        zeropp_quant::dequantize(q.chunk(p), &mut sent).map_err(&quantizing)?;
        let span = r * chunk..(r + 1) * chunk;
        sent.iter_mut()
            .zip(&corrected[span])
            .for_each(|(s, c)| *s = c - *s);
        residual.store_chunk(r, &sent).map_err(&quantizing)?;
    }
    Ok(q)
}

/// How the node's partial sums are requantized for the hop across nodes.
pub struct SecondHop<'a> {
    pub format: QuantFormat,
    pub rounding: Rounding,
    /// Error feedback of this quantization (N chunks; of another shape it
    /// starts from zero).
    pub residual: Option<&'a Mutex<Residual>>,
}

/// Hops 1 and 2 of `first` (from [`quantize_first_hop`]): the sum over
/// every rank of this rank's chunk, in f32.
pub fn exchange(
    c: &Communicator,
    counter: &CountingTransport,
    groups: &ZeroGroups,
    layout: Layout,
    first: QuantizedChunks,
    second: SecondHop<'_>,
) -> Result<Vec<f32>, CommError> {
    let SecondHop {
        format: inter,
        rounding,
        residual: residual_inter,
    } = second;
    let (nodes, g, chunk) = (layout.nodes, layout.ranks_per_node, first.chunk_len);
    let intra = first.format;
    let frac = |f: QuantFormat| f.param_bytes(chunk) as f64 / f.total_bytes(chunk) as f64;
    counter.set_phase(Phase::Gradient, frac(intra));
    // Hop 1, inside the node: local rank g' gets positions g'·N..(g'+1)·N.
    let to_local = (0..g)
        .map(|dst| encode_run(&first, dst * nodes..(dst + 1) * nodes))
        .collect();
    drop(first);
    let from_locals = c.all_to_all_v(&groups.node, to_local)?;
    let decoded = from_locals
        .iter()
        .map(|b| decode_run(b, intra, chunk, nodes))
        .collect::<Result<Vec<_>, _>>()?;
    let summing = quant_failure("summing the node's gradients");
    let mut partial = QuantizedChunks::zeroed(inter, chunk, nodes);
    let part_rounding = rounding.for_part(1);
    match residual_inter {
        Some(residual) => {
            // Sum in f32, add back what this hop dropped last call,
            // requantize, and keep what it drops now.
            let mut residual = residual
                .lock()
                .map_err(|_| CommError::Invalid("the error-feedback buffer was poisoned".into()))?;
            residual.ensure_shape(chunk, nodes);
            let mut sum = vec![0f32; nodes * chunk];
            residual.add_to(&mut sum).map_err(&summing)?;
            for runs in &decoded {
                for (n, d) in runs.iter().enumerate() {
                    let acc = &mut sum[n * chunk..(n + 1) * chunk];
                    zeropp_quant::dequantize_accumulate(d.view(), acc).map_err(&summing)?;
                }
            }
            quantize_swizzled(&sum, nodes, 1, part_rounding, &mut partial).map_err(&summing)?;
            let mut sent = vec![0f32; chunk];
            for n in 0..nodes {
                zeropp_quant::dequantize(partial.chunk(n), &mut sent).map_err(&summing)?;
                sent.iter_mut()
                    .zip(&sum[n * chunk..(n + 1) * chunk])
                    .for_each(|(s, x)| *s = x - *s);
                residual.store_chunk(n, &sent).map_err(&summing)?;
            }
        }
        None => {
            let mut scratch = Vec::new();
            for n in 0..nodes {
                let views: Vec<_> = decoded.iter().map(|runs| runs[n].view()).collect();
                sum_requantize(
                    &views,
                    part_rounding.for_part(n),
                    partial.chunk_mut(n),
                    &mut scratch,
                )
                .map_err(&summing)?;
            }
        }
    }
    // Hop 2, across nodes: node n' gets chunk n'.
    counter.set_phase(Phase::Gradient, frac(inter));
    let to_nodes = (0..nodes).map(|n| encode_run(&partial, n..n + 1)).collect();
    let from_nodes = c.all_to_all_v(&groups.cross, to_nodes)?;
    let mut sum = vec![0f32; chunk];
    for b in &from_nodes {
        let d = payload::decode_quantized(b, inter, chunk)?;
        zeropp_quant::dequantize_accumulate(d.view(), &mut sum)
            .map_err(|e| CommError::Malformed(e.to_string()))?;
    }
    Ok(sum)
}

/// Whether chunks of `chunk` values are whole blocks and whole code bytes:
/// then a run of them has the layout of one tensor.
fn whole_blocks(format: QuantFormat, chunk: usize) -> bool {
    chunk.is_multiple_of(format.block)
        && format.code_bytes(chunk) * format.bits.codes_per_byte() == chunk
}

/// Chunks `range` of `q` as one message: each chunk's own encoding, back to
/// back (chunks need not be whole blocks).
fn encode_run(q: &QuantizedChunks, range: std::ops::Range<usize>) -> Bytes {
    let (c, s, m) = q.strides();
    if whole_blocks(q.format, q.chunk_len) {
        // Whole blocks and whole code bytes: the run is one tensor's layout.
        return payload::encode_chunks(q, range);
    }
    let mut parts = Vec::with_capacity(range.len());
    for p in range {
        let one = QuantizedChunks {
            format: q.format,
            chunk_len: q.chunk_len,
            count: 1,
            codes: q.codes[p * c..(p + 1) * c].to_vec(),
            block_max: q.block_max[p * s..(p + 1) * s].to_vec(),
            block_min: q.block_min[p * m..(p + 1) * m].to_vec(),
        };
        parts.push(payload::encode_chunks(&one, 0..1));
    }
    super::qwz::concat(&parts)
}

/// The inverse of [`encode_run`]: `count` chunks of `chunk` values.
fn decode_run(
    b: &Bytes,
    format: QuantFormat,
    chunk: usize,
    count: usize,
) -> Result<Vec<payload::Decoded<'_>>, CommError> {
    if whole_blocks(format, chunk) {
        // One tensor's layout: codes of every chunk, then every maximum.
        let d = payload::decode_quantized(b, format, chunk * count)?;
        return d.split(count);
    }
    let one = format.total_bytes(chunk);
    if b.len() != one * count {
        return Err(CommError::Malformed(format!(
            "a run of {count} quantized chunks: expected {} bytes, found {}; the ranks \
             disagree on the model or the plan",
            one * count,
            b.len()
        )));
    }
    (0..count)
        .map(|i| payload::decode_quantized(&b[i * one..(i + 1) * one], format, chunk))
        .collect()
}

/// Element-wise sum of bf16 buffers, accumulated in f32 and rounded once.
pub struct SumBf16;

impl Reduce for SumBf16 {
    fn granule(&self) -> usize {
        2
    }

    fn reduce(&self, acc: &mut [u8], mine: &[u8]) -> Result<(), CommError> {
        if acc.len() != mine.len() || !acc.len().is_multiple_of(2) {
            return Err(CommError::Malformed(format!(
                "bf16 sum of {} and {} bytes",
                acc.len(),
                mine.len()
            )));
        }
        for (a, b) in acc.chunks_exact_mut(2).zip(mine.chunks_exact(2)) {
            let x = f32::from_bits((u16::from_le_bytes([a[0], a[1]]) as u32) << 16);
            let y = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            let s: half::bf16 = zeropp_quant::Element::from_f32(x + y);
            a.copy_from_slice(&s.to_bits().to_le_bytes());
        }
        Ok(())
    }
}

/// ZeRO-3's reduce-scatter of bf16 values (`bf16` little-endian bytes, W
/// equal chunks): this rank's chunk of the sum, as bf16 bytes.
pub fn ring_bf16(c: &Communicator, world: &Group, bf16: Bytes) -> Result<Vec<u8>, CommError> {
    let values = bf16.len() / 2;
    let bounds: Vec<_> = balanced_bounds(values, world.size())
        .into_iter()
        .map(|r| r.start * 2..r.end * 2)
        .collect();
    c.reduce_scatter_bytes(world, bf16, &bounds, &SumBf16)
}

/// ZeRO-3's reduce-scatter in f32: this rank's chunk of the sum.
pub fn ring_f32(c: &Communicator, world: &Group, grad: Vec<f32>) -> Result<Vec<f32>, CommError> {
    c.reduce_scatter_f32_vec(world, grad)
}
