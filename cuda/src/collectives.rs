//! The engine's quantized collectives on device buffers: the kernels of this
//! crate over NCCL communicators.
//!
//! - qwZ: quantize this rank's shard, all-gather the codes and block
//!   parameters (a quantized tensor's parts are all-gathered separately, so
//!   the received buffers are already in `QuantizedChunks` layout: chunk r
//!   from rank r), dequantize every chunk into place.
//! - hpZ: the same gather of an already quantized (secondary) shard over the
//!   node's communicator.
//! - qgZ: swizzled int4 quantize of the gradient, all-to-all inside the node,
//!   fused dequantize–sum–requantize per destination node, all-to-all across
//!   nodes among equal local ranks, dequantize-accumulate in f32, times 1/W
//!   (the mean over **all** ranks).
//!
//! Every step checks sizes first and every NCCL wait has the communicator's
//! deadline. Error feedback ([`QgzFeedback`]) is the CPU's (`zeropp::zero::qgz`):
//! the same corrections in the same order, kept in f32 buffers the caller
//! owns (the CPU keeps them compressed).

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use zeropp_quant::{QuantError, QuantFormat, Rounding};

use crate::device::{
    DeviceQuantized, DeviceQuantizedChunks, Gpu, GpuElement, QuantView, QuantViewMut,
};
use crate::nccl::NcclComm;
use crate::{CudaError, DriverContext};

fn bytes_of<'a>(v: &CudaView<'a, f32>) -> CudaView<'a, u8> {
    // SAFETY: any f32 bit pattern is a valid run of bytes.
    unsafe { v.transmute::<u8>(v.len() * 4) }.expect("an f32 buffer holds 4 bytes a value")
}

fn bytes_of_mut(s: &mut CudaSlice<f32>) -> CudaViewMut<'_, u8> {
    let n = s.len() * 4;
    // SAFETY: the bytes written are f32 bit patterns sent by a peer.
    unsafe { s.transmute_mut::<u8>(n) }.expect("an f32 buffer holds 4 bytes a value")
}

/// Chunk `i` of a chunked quantized buffer, as a view.
fn chunk_view(c: &DeviceQuantizedChunks, i: usize) -> QuantView<'_> {
    let (cb, nb, nm) = (
        c.format.code_bytes(c.chunk_len),
        c.format.num_blocks(c.chunk_len),
        c.format.num_block_mins(c.chunk_len),
    );
    QuantView {
        format: c.format,
        len: c.chunk_len,
        codes: c.codes.slice(i * cb..(i + 1) * cb),
        block_max: c.block_max.slice(i * nb..(i + 1) * nb),
        block_min: c.block_min.slice(i * nm..(i + 1) * nm),
    }
}

fn chunk_view_mut(c: &mut DeviceQuantizedChunks, i: usize) -> QuantViewMut<'_> {
    let (cb, nb, nm) = (
        c.format.code_bytes(c.chunk_len),
        c.format.num_blocks(c.chunk_len),
        c.format.num_block_mins(c.chunk_len),
    );
    QuantViewMut {
        format: c.format,
        len: c.chunk_len,
        codes: c.codes.slice_mut(i * cb..(i + 1) * cb),
        block_max: c.block_max.slice_mut(i * nb..(i + 1) * nb),
        block_min: c.block_min.slice_mut(i * nm..(i + 1) * nm),
    }
}

/// All-gathers a quantized tensor: chunk r of the result is rank r's.
pub fn all_gather_quantized(
    gpu: &Gpu,
    comm: &NcclComm,
    mine: &DeviceQuantized,
) -> Result<DeviceQuantizedChunks, CudaError> {
    let mut all = DeviceQuantizedChunks::zeroed(gpu, mine.format, mine.len, comm.size())?;
    if mine.len == 0 {
        return Ok(all);
    }
    gather_parts(comm, &mine.view(), &mut all)?;
    Ok(all)
}

/// All-gathers every rank's `mine.count` chunks: rank r's chunk i becomes
/// chunk r·count + i of the result.
pub fn all_gather_chunks(
    gpu: &Gpu,
    comm: &NcclComm,
    mine: &DeviceQuantizedChunks,
) -> Result<DeviceQuantizedChunks, CudaError> {
    let (f, len, count) = (mine.format, mine.chunk_len, mine.count);
    let mut all = DeviceQuantizedChunks::zeroed(gpu, f, len, count * comm.size())?;
    if len == 0 || count == 0 {
        return Ok(all);
    }
    let parts = QuantView {
        format: f,
        len: len * count,
        codes: mine.codes.as_view(),
        block_max: mine.block_max.as_view(),
        block_min: mine.block_min.as_view(),
    };
    gather_parts(comm, &parts, &mut all)?;
    Ok(all)
}

/// The three parts of `mine` (codes, maxima, minima: each gathered on its
/// own, so the received buffers are in `QuantizedChunks` layout) into `all`.
fn gather_parts(
    comm: &NcclComm,
    mine: &QuantView<'_>,
    all: &mut DeviceQuantizedChunks,
) -> Result<(), CudaError> {
    comm.all_gather_bytes(&mine.codes, &mut all.codes.as_view_mut())?;
    comm.all_gather_bytes(
        &bytes_of(&mine.block_max),
        &mut bytes_of_mut(&mut all.block_max),
    )?;
    if !mine.block_min.is_empty() {
        comm.all_gather_bytes(
            &bytes_of(&mine.block_min),
            &mut bytes_of_mut(&mut all.block_min),
        )?;
    }
    Ok(())
}

/// Dequantizes chunk r of `all` into `out[r·len .. (r+1)·len]`.
pub fn dequantize_chunks<T: GpuElement>(
    gpu: &Gpu,
    all: &DeviceQuantizedChunks,
    out: &mut CudaViewMut<'_, T>,
) -> Result<(), CudaError> {
    let n = all.chunk_len;
    if out.len() != n * all.count {
        return Err(QuantError::SizeMismatch {
            what: "gathered values",
            expected: n * all.count,
            found: out.len(),
        }
        .into());
    }
    for r in 0..all.count {
        gpu.dequantize_view(&chunk_view(all, r), &mut out.slice_mut(r * n..(r + 1) * n))?;
    }
    Ok(())
}

/// qwZ over one communicator: every rank's `shard` (equal lengths), quantized
/// in `format`, gathered and dequantized into `out` in rank order.
pub fn qwz_all_gather<T: GpuElement>(
    gpu: &Gpu,
    comm: &NcclComm,
    shard: &CudaView<'_, T>,
    format: QuantFormat,
    rounding: Rounding,
    out: &mut CudaViewMut<'_, T>,
) -> Result<(), CudaError> {
    let mut mine = DeviceQuantized::zeroed(gpu, format, shard.len())?;
    gpu.quantize(shard, rounding, &mut mine)?;
    let all = all_gather_quantized(gpu, comm, &mine)?;
    dequantize_chunks(gpu, &all, out)
}

/// qwZ across nodes, then inside: the shard (quantized in `format`) is
/// gathered among the ranks of this local rank (`cross`, one per node),
/// then those N chunks inside the node (`node`), and each of the W chunks
/// is dequantized into its rank's place in `out`. Only N−1 copies of the
/// shard cross node boundaries, as the CPU path's gather
/// (`zeropp::zero::qwz::gather`) sends them.
pub fn qwz_all_gather_hierarchical<T: GpuElement>(
    gpu: &Gpu,
    cross: &NcclComm,
    node: &NcclComm,
    shard: &CudaView<'_, T>,
    format: QuantFormat,
    rounding: Rounding,
    out: &mut CudaViewMut<'_, T>,
) -> Result<(), CudaError> {
    let (n, g, len) = (cross.size(), node.size(), shard.len());
    if out.len() != len * n * g {
        return Err(QuantError::SizeMismatch {
            what: "gathered values",
            expected: len * n * g,
            found: out.len(),
        }
        .into());
    }
    let mut mine = DeviceQuantized::zeroed(gpu, format, len)?;
    gpu.quantize(shard, rounding, &mut mine)?;
    // Chunk k of `across` is node k's (rank k·G + g); chunk g'·N + k of
    // `all` is rank k·G + g''s.
    let across = all_gather_quantized(gpu, cross, &mine)?;
    drop(mine);
    let all = all_gather_chunks(gpu, node, &across)?;
    drop(across);
    for local in 0..g {
        for k in 0..n {
            let rank = k * g + local;
            gpu.dequantize_view(
                &chunk_view(&all, local * n + k),
                &mut out.slice_mut(rank * len..(rank + 1) * len),
            )?;
        }
    }
    Ok(())
}

/// The two groups of the qgZ reduce-scatter, and its formats.
pub struct QgzGroups<'a> {
    /// This node's ranks, in local-rank order (size G).
    pub node: &'a NcclComm,
    /// The ranks with this local rank, one per node, in node order (size N).
    pub cross: &'a NcclComm,
    /// Format of the hop inside the node, and of the hop across.
    pub intra: QuantFormat,
    pub inter: QuantFormat,
    pub rounding: Rounding,
}

/// qgZ's error feedback: what each hop's quantization dropped on the last
/// call, added back before it quantizes again, then replaced by what it
/// drops now. Buffers start zeroed; `None` keeps no feedback at that hop.
#[derive(Default)]
pub struct QgzFeedback<'a> {
    /// Hop 1: the whole gradient's (W chunks, rank order).
    pub first: Option<CudaViewMut<'a, f32>>,
    /// Hop 2: the node's partial sums (N chunks, one per destination node).
    pub second: Option<CudaViewMut<'a, f32>>,
}

/// qgZ: the mean over all W = N·G ranks of `grad` (each rank's full
/// gradient), this rank's chunk (`grad.len() / W` values) into `out`, with
/// the error feedback in `feedback`.
pub fn qgz_reduce_scatter(
    gpu: &Gpu,
    groups: &QgzGroups<'_>,
    grad: &CudaView<'_, f32>,
    out: &mut CudaViewMut<'_, f32>,
    feedback: QgzFeedback<'_>,
) -> Result<(), CudaError> {
    let (g, n) = (groups.node.size(), groups.cross.size());
    let w = n * g;
    if !grad.len().is_multiple_of(w) || out.len() * w != grad.len() {
        return Err(CudaError::Invalid(format!(
            "qgZ: a gradient of {} values over {n} nodes x {g} ranks needs an output of {} \
             values, not {} (pad the gradient to a multiple of the world size)",
            grad.len(),
            grad.len() / w.max(1),
            out.len()
        )));
    }
    let chunk = out.len();
    let QgzFeedback { first, second } = feedback;
    for (what, buf, len) in [("first", &first, w * chunk), ("second", &second, n * chunk)] {
        if let Some(b) = buf
            && b.len() != len
        {
            return Err(CudaError::Invalid(format!(
                "qgZ's {what}-hop error feedback holds {} values where {len} are needed",
                b.len()
            )));
        }
    }
    // 1. Swizzled quantize: position g'·N + n' holds rank n'·G + g''s chunk,
    //    so local rank g' receives N contiguous chunks.
    let mut sw = DeviceQuantizedChunks::zeroed(gpu, groups.intra, chunk, w)?;
    match first {
        None => gpu.quantize_swizzled(grad, n, g, groups.rounding, &mut sw)?,
        Some(mut residual) => {
            // corrected = grad + residual; quantize; residual = corrected − x̂.
            let mut corrected = gpu.zeros::<f32>(grad.len())?;
            gpu.copy(grad, &mut corrected.as_view_mut())?;
            gpu.axpby(&mut corrected.as_view_mut(), &residual.as_view(), 1.0, 1.0)?;
            gpu.quantize_swizzled(&corrected.as_view(), n, g, groups.rounding, &mut sw)?;
            for p in 0..w {
                let r = zeropp_quant::swizzled_rank(p, n, g);
                let mut part = residual.slice_mut(r * chunk..(r + 1) * chunk);
                gpu.dequantize_view(&chunk_view(&sw, p), &mut part)?;
                gpu.axpby(
                    &mut part,
                    &corrected.slice(r * chunk..(r + 1) * chunk),
                    -1.0,
                    1.0,
                )?;
            }
        }
    }
    // 2. All-to-all inside the node, each part separately.
    let mut got = DeviceQuantizedChunks::zeroed(gpu, groups.intra, chunk, w)?;
    groups
        .node
        .all_to_all_bytes(&sw.codes.as_view(), &mut got.codes.as_view_mut())?;
    groups.node.all_to_all_bytes(
        &bytes_of(&sw.block_max.as_view()),
        &mut bytes_of_mut(&mut got.block_max),
    )?;
    if !sw.block_min.is_empty() {
        groups.node.all_to_all_bytes(
            &bytes_of(&sw.block_min.as_view()),
            &mut bytes_of_mut(&mut got.block_min),
        )?;
    }
    drop(sw);
    // 3. Per destination node n': the G received chunks (from local rank g
    //    at position g·N + n'), summed in f32 and requantized.
    let mut partial = DeviceQuantizedChunks::zeroed(gpu, groups.inter, chunk, n)?;
    match second {
        None => {
            for dest in 0..n {
                let inputs: Vec<QuantView<'_>> =
                    (0..g).map(|src| chunk_view(&got, src * n + dest)).collect();
                // As the CPU: hop 2 draws from `rounding.for_part(1)`, part by part.
                let rounding = groups.rounding.for_part(1).for_part(dest);
                gpu.sum_requantize_views(
                    &inputs,
                    rounding,
                    &mut chunk_view_mut(&mut partial, dest),
                )?;
            }
        }
        Some(mut residual) => {
            // sum = residual + Σ x̂ (in source order, as the CPU sums), then
            // requantize, and keep sum − what the wire carries.
            let mut sum = gpu.zeros::<f32>(n * chunk)?;
            gpu.copy(&residual.as_view(), &mut sum.as_view_mut())?;
            for src in 0..g {
                for dest in 0..n {
                    gpu.dequantize_accumulate_view(
                        &chunk_view(&got, src * n + dest),
                        &mut sum.slice_mut(dest * chunk..(dest + 1) * chunk),
                    )?;
                }
            }
            gpu.quantize_swizzled(
                &sum.as_view(),
                n,
                1,
                groups.rounding.for_part(1),
                &mut partial,
            )?;
            for dest in 0..n {
                let mut part = residual.slice_mut(dest * chunk..(dest + 1) * chunk);
                gpu.dequantize_view(&chunk_view(&partial, dest), &mut part)?;
                gpu.axpby(
                    &mut part,
                    &sum.slice(dest * chunk..(dest + 1) * chunk),
                    -1.0,
                    1.0,
                )?;
            }
        }
    }
    drop(got);
    // 4. All-to-all across nodes among equal local ranks.
    let mut theirs = DeviceQuantizedChunks::zeroed(gpu, groups.inter, chunk, n)?;
    groups
        .cross
        .all_to_all_bytes(&partial.codes.as_view(), &mut theirs.codes.as_view_mut())?;
    groups.cross.all_to_all_bytes(
        &bytes_of(&partial.block_max.as_view()),
        &mut bytes_of_mut(&mut theirs.block_max),
    )?;
    if !partial.block_min.is_empty() {
        groups.cross.all_to_all_bytes(
            &bytes_of(&partial.block_min.as_view()),
            &mut bytes_of_mut(&mut theirs.block_min),
        )?;
    }
    // 5. f32 sum of the N node-level partials, then the mean over all W.
    gpu.stream()
        .memset_zeros(out)
        .during(|| "zeroing the qgZ output".into())?;
    for src in 0..n {
        gpu.dequantize_accumulate_view(&chunk_view(&theirs, src), out)?;
    }
    gpu.scale(out, 1.0 / w as f32)
}
