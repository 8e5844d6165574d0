//! The qgZ kernels: the fused dequantize–sum–requantize step between the two
//! hops of the gradient all-to-all, and the swizzled quantize that orders the
//! W chunks of a gradient by destination (local rank, node) so each hop sends
//! contiguous bytes.

use crate::QuantError;
use crate::element::Element;
use crate::format::{QuantFormat, Rounding};
use crate::isa::Isa;
use crate::kernels::{
    BlockOut, dequantize_range, dequantize_range_on, quantize_block_on, quantize_span,
};
use crate::views::{QuantizedMut, QuantizedRef};

/// Dequantizes `k` inputs of the same length, sums them in f32 and quantizes
/// the sum into `out`, block by block in one pass (each block of the sum lives
/// only in `scratch`, which grows once to the output block size).
///
/// The sum of an element starts at +0 and adds the inputs in slice order; the
/// CUDA kernel adds in the same order. Inputs may use different formats; the
/// output format is `out`'s.
pub fn sum_requantize(
    inputs: &[QuantizedRef<'_>],
    rounding: Rounding,
    out: QuantizedMut<'_>,
    scratch: &mut Vec<f32>,
) -> Result<(), QuantError> {
    sum_requantize_on(Isa::detect(), inputs, rounding, out, scratch)
}

/// [`sum_requantize`] with a chosen instruction set.
pub fn sum_requantize_on(
    isa: Isa,
    inputs: &[QuantizedRef<'_>],
    rounding: Rounding,
    out: QuantizedMut<'_>,
    scratch: &mut Vec<f32>,
) -> Result<(), QuantError> {
    for q in inputs {
        out.check_len(q.len)?;
    }
    let QuantizedMut {
        format,
        len,
        codes,
        block_max,
        block_min,
    } = out;
    if scratch.len() < format.block.min(len) {
        scratch.resize(format.block.min(len), 0.0);
    }
    let per_block_bytes = format.code_bytes(format.block);
    for (b, max_out) in block_max.iter_mut().enumerate() {
        let start = b * format.block;
        let block_len = format.block.min(len - start);
        let sum = &mut scratch[..block_len];
        sum.fill(0.0);
        for q in inputs {
            dequantize_range_on(isa, q, start, sum, |o, v| *o += v)?;
        }
        let code_out = &mut codes[b * per_block_bytes..][..format.code_bytes(block_len)];
        let block = BlockOut {
            index: b,
            start,
            codes: code_out,
            max: max_out,
            min: block_min.get_mut(b),
        };
        quantize_block_on(isa, sum, &format, rounding, block)?;
    }
    Ok(())
}

/// Error feedback around one quantization, in one pass: `x += kept`'s
/// values, `x` quantized into `out` with `rounding`, and `dropped` becomes
/// what that quantization lost (`x` minus `out`'s values, quantized in
/// `dropped`'s format, rounded to nearest). The same IEEE operations in the
/// same order as [`dequantize_accumulate`](crate::dequantize_accumulate),
/// [`quantize`](crate::quantize), [`dequantize`](crate::dequantize) and
/// `quantize` again one after another — bit for bit — but a span of a few
/// blocks at a time, so `x` is read from memory once. `kept` and `dropped`
/// may share a format, not storage (the caller keeps the old residual until
/// the call succeeds: an error leaves it as it was).
pub fn quantize_with_feedback(
    x: &mut [f32],
    rounding: Rounding,
    out: QuantizedMut<'_>,
    kept: QuantizedRef<'_>,
    dropped: QuantizedMut<'_>,
) -> Result<(), QuantError> {
    quantize_with_feedback_on(Isa::detect(), x, rounding, out, kept, dropped)
}

/// The largest span the fused kernel keeps on the stack (the span is the
/// largest of the three formats' blocks: powers of two, so every format's
/// blocks tile it).
const FEEDBACK_SPAN: usize = 1024;

/// [`quantize_with_feedback`] with a chosen instruction set.
pub fn quantize_with_feedback_on(
    isa: Isa,
    x: &mut [f32],
    rounding: Rounding,
    out: QuantizedMut<'_>,
    kept: QuantizedRef<'_>,
    dropped: QuantizedMut<'_>,
) -> Result<(), QuantError> {
    let len = x.len();
    out.check_len(len)?;
    dropped.check_len(len)?;
    kept.check_out_len(len)?;
    let span = out
        .format
        .block
        .max(dropped.format.block)
        .max(kept.format.block);
    // What a span dropped, before it is quantized: on the stack, but for
    // blocks larger than it holds.
    let (mut stack, mut heap) = ([0f32; FEEDBACK_SPAN], Vec::new());
    let lost = if span <= FEEDBACK_SPAN {
        &mut stack[..span]
    } else {
        heap.resize(span, 0.0);
        &mut heap[..]
    };
    let views = (out, kept, dropped);
    match isa {
        Isa::Portable => feedback_spans(x, lost, rounding, views),
        // SAFETY: `Isa::Avx2` is only ever produced where the CPU has AVX2.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::feedback_spans(x, lost, rounding, views) },
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;

    #[target_feature(enable = "avx2")]
    pub(super) fn feedback_spans(
        x: &mut [f32],
        lost: &mut [f32],
        rounding: Rounding,
        views: FeedbackViews<'_, '_, '_>,
    ) -> Result<(), QuantError> {
        super::feedback_spans(x, lost, rounding, views)
    }
}

/// What [`quantize_with_feedback`] quantizes into, reads and keeps.
type FeedbackViews<'a, 'b, 'c> = (QuantizedMut<'a>, QuantizedRef<'b>, QuantizedMut<'c>);

/// [`quantize_with_feedback`]'s spans of `lost.len()` values (a whole
/// number of every format's blocks), in one function (every kernel inlined
/// into it) so that a short block costs no call.
#[inline(always)]
fn feedback_spans(
    x: &mut [f32],
    lost: &mut [f32],
    rounding: Rounding,
    (mut out, kept, mut dropped): FeedbackViews<'_, '_, '_>,
) -> Result<(), QuantError> {
    let span = lost.len();
    let mut start = 0;
    while start < x.len() {
        let end = (start + span).min(x.len());
        let xs = &mut x[start..end];
        dequantize_range(&kept, start, xs, |o, v| *o += v)?;
        quantize_span(xs, start, rounding, &mut out)?;
        let lost = &mut lost[..end - start];
        dequantize_range(&out.as_ref(), start, lost, |o, v| *o = v)?;
        lost.iter_mut()
            .zip(xs.iter())
            .for_each(|(d, x)| *d = x - *d);
        quantize_span(lost, start, Rounding::NearestEven, &mut dropped)?;
        start = end;
    }
    Ok(())
}

/// Which rank's chunk sits at `position` of the swizzled order: positions are
/// ordered by (destination local rank g, destination node n), so position
/// `g·N + n` holds the chunk of rank `n·G + g`.
pub fn swizzled_rank(position: usize, nodes: usize, ranks_per_node: usize) -> usize {
    let (g, n) = (position / nodes, position % nodes);
    n * ranks_per_node + g
}

/// W = N·G quantized chunks of equal length, stored back to back: chunk `p`'s
/// codes, block maxima and minima are contiguous, and so is any run of chunks.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedChunks {
    pub format: QuantFormat,
    pub chunk_len: usize,
    pub count: usize,
    pub codes: Vec<u8>,
    pub block_max: Vec<f32>,
    pub block_min: Vec<f32>,
}

impl QuantizedChunks {
    /// Zeroed storage for `count` chunks of `chunk_len` values each.
    pub fn zeroed(format: QuantFormat, chunk_len: usize, count: usize) -> Self {
        QuantizedChunks {
            format,
            chunk_len,
            count,
            codes: vec![0; count * format.code_bytes(chunk_len)],
            block_max: vec![0.0; count * format.num_blocks(chunk_len)],
            block_min: vec![0.0; count * format.num_block_mins(chunk_len)],
        }
    }

    /// The chunk at `position`.
    pub fn chunk(&self, position: usize) -> QuantizedRef<'_> {
        let (c, s, m) = self.strides();
        QuantizedRef {
            format: self.format,
            len: self.chunk_len,
            codes: &self.codes[position * c..][..c],
            block_max: &self.block_max[position * s..][..s],
            block_min: &self.block_min[position * m..][..m],
        }
    }

    /// The chunk at `position`, to write into.
    pub fn chunk_mut(&mut self, position: usize) -> QuantizedMut<'_> {
        let (c, s, m) = self.strides();
        QuantizedMut {
            format: self.format,
            len: self.chunk_len,
            codes: &mut self.codes[position * c..][..c],
            block_max: &mut self.block_max[position * s..][..s],
            block_min: &mut self.block_min[position * m..][..m],
        }
    }

    /// Code bytes, block maxima and minima per chunk.
    pub fn strides(&self) -> (usize, usize, usize) {
        (
            self.format.code_bytes(self.chunk_len),
            self.format.num_blocks(self.chunk_len),
            self.format.num_block_mins(self.chunk_len),
        )
    }
}

/// The length of each of the W = `nodes`·`ranks_per_node` equal chunks of
/// a tensor of `len` values, or why it does not split.
pub fn swizzled_chunk_len(
    len: usize,
    nodes: usize,
    ranks_per_node: usize,
) -> Result<usize, QuantError> {
    let world = nodes * ranks_per_node;
    if world == 0 || !len.is_multiple_of(world) {
        return Err(QuantError::InvalidFormat(format!(
            "cannot split {len} values into {nodes} nodes x {ranks_per_node} ranks of equal \
             chunks; pad the tensor to a multiple of the world size"
        )));
    }
    Ok(len / world)
}

/// Splits `input` into W = `nodes`·`ranks_per_node` equal chunks (chunk r for
/// rank r) and quantizes each into `out` at its swizzled position (see
/// [`swizzled_rank`]). Each chunk is quantized as a tensor of its own, with
/// the rounding [`Rounding::for_part`] of its rank.
pub fn quantize_swizzled<T: Element>(
    input: &[T],
    nodes: usize,
    ranks_per_node: usize,
    rounding: Rounding,
    out: &mut QuantizedChunks,
) -> Result<(), QuantError> {
    let world = nodes * ranks_per_node;
    let chunk_len = swizzled_chunk_len(input.len(), nodes, ranks_per_node)?;
    if out.count != world || out.chunk_len != chunk_len {
        return Err(QuantError::SizeMismatch {
            what: "swizzled chunks (count x length)",
            expected: world * chunk_len,
            found: out.count * out.chunk_len,
        });
    }
    for position in 0..world {
        let rank = swizzled_rank(position, nodes, ranks_per_node);
        let chunk = &input[rank * chunk_len..][..chunk_len];
        crate::kernels::quantize(chunk, rounding.for_part(rank), out.chunk_mut(position))?;
    }
    Ok(())
}
