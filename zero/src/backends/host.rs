//! The host backend. Host memory is one implementation of the buffers
//! (`Vec<f32>`, `QuantizedChunks`, slices) for any set of [`HostKernels`]:
//! [`Host`] (zeropp-quant, the CPU library) or the emulated device's CUDA
//! kernels (`crate::emulated::Emulated`). [`HostMover`] moves chunks
//! through zeropp's transports (UCX, TCP, in process) and counts them in
//! the job's [`CountingTransport`], for both.

use zeropp_cuda::GpuElement;
use zeropp_quant::{Element, QuantFormat, QuantizedChunks, QuantizedMut, QuantizedRef, Rounding};

use zeropp_comm::{Communicator, Group};

use bytes::Bytes;
use zeropp_comm::CommError;
use zeropp_comm::collectives::{Reduce, balanced_bounds};

use crate::backend::{
    ByteMover, Hop, Quantizer, check_gather_len, check_pieces, check_swizzled, not_bf16,
    not_finite_gradient, scale_fraction, swizzled_kept_composed,
};
use crate::error::{ZeroError, quant_failure};
use crate::groups::ZeroGroups;
use crate::payload;
use crate::traffic::{CountingTransport, Phase};
use zeropp_comm::scratch;

/// `zeropp_quant::quantize_with_feedback`'s signature.
pub type FusedFeedback = fn(
    &mut [f32],
    Rounding,
    QuantizedMut<'_>,
    QuantizedRef<'_>,
    QuantizedMut<'_>,
) -> Result<(), zeropp_quant::QuantError>;

/// The kernels of a backend whose buffers live in host memory, on slices
/// already checked to fit: [`Quantizer`] follows for every such set.
pub trait HostKernels {
    /// `x` quantized into `out` (as long as `x`).
    fn quantize<T: GpuElement>(
        &self,
        x: &[T],
        rounding: Rounding,
        out: QuantizedMut<'_>,
    ) -> Result<(), ZeroError>;

    /// `zeropp_quant::quantize_swizzled`.
    fn quantize_swizzled<T: GpuElement>(
        &self,
        x: &[T],
        nodes: usize,
        ranks_per_node: usize,
        rounding: Rounding,
        out: &mut QuantizedChunks,
    ) -> Result<(), ZeroError>;

    /// `q` dequantized into `out` (as long as `q`), or added to it in f32.
    fn dequantize<T: GpuElement>(
        &self,
        q: QuantizedRef<'_>,
        out: &mut [T],
    ) -> Result<(), ZeroError>;
    fn dequantize_accumulate(&self, q: QuantizedRef<'_>, out: &mut [f32]) -> Result<(), ZeroError>;

    /// `zeropp_quant::sum_requantize`.
    fn sum_requantize(
        &self,
        inputs: &[QuantizedRef<'_>],
        rounding: Rounding,
        out: QuantizedMut<'_>,
    ) -> Result<(), ZeroError>;

    /// `zeropp_quant::quantize_with_feedback` on one chunk where the
    /// backend has it fused; `None`: its [`Quantizer`] composes the kernels
    /// (`swizzled_kept_composed`).
    fn fused_feedback(&self) -> Option<FusedFeedback> {
        None
    }

    /// `x = y − x` (equal lengths).
    fn dropped(&self, x: &mut [f32], y: &[f32]) -> Result<(), ZeroError>;

    /// `x /= d`.
    fn divide(&self, x: &mut [f32], d: f32) -> Result<(), ZeroError>;

    /// `y = x` in f32 (equal lengths).
    fn widen<T: GpuElement>(&self, x: &[T], y: &mut [f32]) -> Result<(), ZeroError>;

    /// `y = x` in `T`, rounded to nearest even (equal lengths).
    fn narrow<T: GpuElement>(&self, x: &[f32], y: &mut [T]) -> Result<(), ZeroError>;

    /// `zeropp_quant::hadamard::rotate_blocks`.
    fn rotate(&self, x: &mut [f32], block: usize) -> Result<(), ZeroError>;
}

/// zeropp-quant, the CPU library, on host memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct Host;

impl HostKernels for Host {
    fn quantize<T: GpuElement>(
        &self,
        x: &[T],
        rounding: Rounding,
        out: QuantizedMut<'_>,
    ) -> Result<(), ZeroError> {
        zeropp_quant::quantize(x, rounding, out).map_err(quant_failure("quantizing"))
    }

    fn quantize_swizzled<T: GpuElement>(
        &self,
        x: &[T],
        nodes: usize,
        ranks_per_node: usize,
        rounding: Rounding,
        out: &mut QuantizedChunks,
    ) -> Result<(), ZeroError> {
        zeropp_quant::quantize_swizzled(x, nodes, ranks_per_node, rounding, out)
            .map_err(quant_failure("quantizing chunks"))
    }

    fn dequantize<T: GpuElement>(
        &self,
        q: QuantizedRef<'_>,
        out: &mut [T],
    ) -> Result<(), ZeroError> {
        zeropp_quant::dequantize(q, out).map_err(quant_failure("dequantizing"))
    }

    fn dequantize_accumulate(&self, q: QuantizedRef<'_>, out: &mut [f32]) -> Result<(), ZeroError> {
        zeropp_quant::dequantize_accumulate(q, out).map_err(quant_failure("summing"))
    }

    fn sum_requantize(
        &self,
        inputs: &[QuantizedRef<'_>],
        rounding: Rounding,
        out: QuantizedMut<'_>,
    ) -> Result<(), ZeroError> {
        zeropp_quant::sum_requantize(inputs, rounding, out, &mut Vec::new())
            .map_err(quant_failure("summing and requantizing"))
    }

    fn fused_feedback(&self) -> Option<FusedFeedback> {
        Some(zeropp_quant::quantize_with_feedback)
    }

    fn dropped(&self, x: &mut [f32], y: &[f32]) -> Result<(), ZeroError> {
        x.iter_mut().zip(y).for_each(|(x, y)| *x = y - *x);
        Ok(())
    }

    fn divide(&self, x: &mut [f32], d: f32) -> Result<(), ZeroError> {
        x.iter_mut().for_each(|v| *v /= d);
        Ok(())
    }

    fn widen<T: GpuElement>(&self, x: &[T], y: &mut [f32]) -> Result<(), ZeroError> {
        T::widen_slice(x, y);
        Ok(())
    }

    fn narrow<T: GpuElement>(&self, x: &[f32], y: &mut [T]) -> Result<(), ZeroError> {
        T::narrow_slice(x, y);
        Ok(())
    }

    fn rotate(&self, x: &mut [f32], block: usize) -> Result<(), ZeroError> {
        zeropp_quant::hadamard::rotate_blocks(x, block)
            .map_err(|e| ZeroError::Invalid(e.to_string()))
    }
}

fn span<'a, T>(x: &'a [T], at: usize, len: usize, what: &str) -> Result<&'a [T], ZeroError> {
    crate::backend::check_span(x.len(), at, len, what)?;
    Ok(&x[at..at + len])
}

fn span_mut<'a, T>(
    x: &'a mut [T],
    at: usize,
    len: usize,
    what: &str,
) -> Result<&'a mut [T], ZeroError> {
    crate::backend::check_span(x.len(), at, len, what)?;
    Ok(&mut x[at..at + len])
}

/// `b` (values in the plain wire: bf16, or f32 with `fp32`) into `out`.
fn decode_plain(b: &[u8], fp32: bool, out: &mut [f32]) -> Result<(), CommError> {
    if fp32 {
        payload::decode_f32(b, out)
    } else {
        payload::decode_bf16(b, out)
    }
}

/// Checks that a member's gathered run holds the `due` bytes.
fn check_run(b: &[u8], due: usize) -> Result<(), ZeroError> {
    if b.len() == due {
        return Ok(());
    }
    Err(CommError::Malformed(format!(
        "a gathered run of {} bytes where {due} were due",
        b.len()
    ))
    .into())
}

/// Values kept on the host between calls ([`Quantizer::Kept`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Kept {
    F32(Vec<f32>),
    Bf16(Vec<half::bf16>),
}

impl Kept {
    pub fn len(&self) -> usize {
        match self {
            Kept::F32(v) => v.len(),
            Kept::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values `at..at + len` in f32.
    pub fn to_f32(&self, at: usize, len: usize) -> Result<Vec<f32>, ZeroError> {
        let mut out = vec![0f32; len];
        match self {
            Kept::F32(v) => out.copy_from_slice(span(v, at, len, "reading kept values")?),
            Kept::Bf16(v) => <half::bf16 as Element>::widen_slice(
                span(v, at, len, "reading kept values")?,
                &mut out,
            ),
        }
        Ok(out)
    }

    /// `values` kept as they are (f32) or rounded to bf16.
    pub fn from_f32(values: &[f32], bf16: bool) -> Kept {
        if bf16 {
            let mut v = vec![half::bf16::ZERO; values.len()];
            <half::bf16 as Element>::narrow_slice(values, &mut v);
            Kept::Bf16(v)
        } else {
            Kept::F32(values.to_vec())
        }
    }
}

impl<K: HostKernels> Quantizer for K {
    type Values = Vec<f32>;
    type Chunks = QuantizedChunks;
    type Tensor<'a, T: GpuElement + 'a> = &'a [T];
    type TensorMut<'a, T: GpuElement + 'a> = &'a mut [T];
    type Kept = Kept;

    fn values(&self, len: usize) -> Result<Vec<f32>, ZeroError> {
        Ok(scratch::take(len))
    }

    fn values_for_overwrite(&self, len: usize) -> Result<Vec<f32>, ZeroError> {
        Ok(scratch::take_for_overwrite(len))
    }

    fn recycle(&self, x: Vec<f32>) {
        scratch::give(x);
    }

    fn recycle_chunks(&self, q: QuantizedChunks) {
        give_chunks(q);
    }

    fn same_unchecked(
        &self,
        x: &Vec<f32>,
        at_x: usize,
        y: &Vec<f32>,
        at_y: usize,
        len: usize,
    ) -> Result<bool, ZeroError> {
        let (x, y) = (&x[at_x..at_x + len], &y[at_y..at_y + len]);
        Ok(x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits()))
    }

    fn kept(&self, len: usize, bf16: bool) -> Result<Kept, ZeroError> {
        Ok(if bf16 {
            // bf16 zeros are u16 zeros: the u16 pool's buffers, as bf16.
            Kept::Bf16(bytemuck::allocation::cast_vec(scratch::take::<u16>(len)))
        } else {
            Kept::F32(scratch::take(len))
        })
    }

    fn kept_for_overwrite(&self, len: usize, bf16: bool) -> Result<Kept, ZeroError> {
        Ok(if bf16 {
            let words = scratch::take_for_overwrite::<u16>(len);
            Kept::Bf16(bytemuck::allocation::cast_vec(words))
        } else {
            Kept::F32(scratch::take_for_overwrite(len))
        })
    }

    fn recycle_kept(&self, k: Kept) {
        match k {
            Kept::F32(v) => scratch::give(v),
            Kept::Bf16(v) => scratch::give(bytemuck::allocation::cast_vec::<half::bf16, u16>(v)),
        }
    }

    fn kept_len(&self, k: &Kept) -> usize {
        k.len()
    }

    fn load_kept_unchecked(
        &self,
        k: &Kept,
        at_k: usize,
        out: &mut Vec<f32>,
        at: usize,
        len: usize,
    ) -> Result<(), ZeroError> {
        let out = &mut out[at..at + len];
        match k {
            Kept::F32(v) => out.copy_from_slice(&v[at_k..at_k + len]),
            Kept::Bf16(v) => HostKernels::widen(self, &v[at_k..at_k + len], out)?,
        }
        Ok(())
    }

    fn store_kept_unchecked(
        &self,
        x: &Vec<f32>,
        at: usize,
        k: &mut Kept,
        at_k: usize,
        len: usize,
    ) -> Result<(), ZeroError> {
        let x = &x[at..at + len];
        match k {
            Kept::F32(v) => v[at_k..at_k + len].copy_from_slice(x),
            Kept::Bf16(v) => HostKernels::narrow(self, x, &mut v[at_k..at_k + len])?,
        }
        Ok(())
    }

    fn len(&self, x: &Vec<f32>) -> usize {
        x.len()
    }

    fn values_as_tensor<'a>(&self, x: &'a Vec<f32>) -> &'a [f32] {
        x
    }

    fn values_as_tensor_mut<'a>(&self, x: &'a mut Vec<f32>) -> &'a mut [f32] {
        x
    }

    fn kept_as_bf16_tensor<'a>(&self, k: &'a Kept) -> Result<&'a [half::bf16], ZeroError> {
        match k {
            Kept::Bf16(v) => Ok(v),
            Kept::F32(_) => Err(not_bf16()),
        }
    }

    fn round_bf16(&self, x: &mut Vec<f32>) -> Result<(), ZeroError> {
        let mut halves: Vec<u16> = scratch::take_for_overwrite(x.len());
        let h: &mut [half::bf16] = bytemuck::cast_slice_mut(&mut halves);
        let rounded = HostKernels::narrow(self, x, h).and_then(|()| HostKernels::widen(self, h, x));
        scratch::give(halves);
        rounded
    }

    fn tensor_len<T: GpuElement>(&self, x: &&[T]) -> usize {
        x.len()
    }

    fn tensor_mut_len<T: GpuElement>(&self, x: &&mut [T]) -> usize {
        x.len()
    }

    fn chunks(
        &self,
        format: QuantFormat,
        chunk_len: usize,
        count: usize,
    ) -> Result<QuantizedChunks, ZeroError> {
        Ok(pooled_chunks(format, chunk_len, count))
    }

    fn shape(&self, q: &QuantizedChunks) -> (QuantFormat, usize, usize) {
        (q.format, q.chunk_len, q.count)
    }

    fn copy_unchecked(
        &self,
        y: &Vec<f32>,
        at_y: usize,
        x: &mut Vec<f32>,
        at_x: usize,
        len: usize,
    ) -> Result<(), ZeroError> {
        x[at_x..at_x + len].copy_from_slice(&y[at_y..at_y + len]);
        Ok(())
    }

    fn copy_chunk_unchecked(
        &self,
        src: &QuantizedChunks,
        i: usize,
        dst: &mut QuantizedChunks,
        j: usize,
    ) -> Result<(), ZeroError> {
        let (from, to) = (src.chunk(i), dst.chunk_mut(j));
        to.codes.copy_from_slice(from.codes);
        to.block_max.copy_from_slice(from.block_max);
        to.block_min.copy_from_slice(from.block_min);
        Ok(())
    }

    fn quantize_tensor_unchecked<T: GpuElement>(
        &self,
        x: &&[T],
        rounding: Rounding,
        out: &mut QuantizedChunks,
        i: usize,
    ) -> Result<(), ZeroError> {
        HostKernels::quantize(self, x, rounding, out.chunk_mut(i))
    }

    fn dequantize_tensor_unchecked<T: GpuElement>(
        &self,
        q: &QuantizedChunks,
        i: usize,
        out: &mut &mut [T],
        at: usize,
    ) -> Result<(), ZeroError> {
        HostKernels::dequantize(self, q.chunk(i), &mut out[at..at + q.chunk_len])
    }

    fn load_tensor_unchecked<T: GpuElement>(
        &self,
        x: &&[T],
        out: &mut Vec<f32>,
        at: usize,
    ) -> Result<(), ZeroError> {
        HostKernels::widen(self, x, &mut out[at..at + x.len()])
    }

    fn store_values_unchecked<T: GpuElement>(
        &self,
        x: &Vec<f32>,
        at_x: usize,
        out: &mut &mut [T],
        at_out: usize,
        len: usize,
    ) -> Result<(), ZeroError> {
        HostKernels::narrow(self, &x[at_x..at_x + len], &mut out[at_out..at_out + len])
    }

    fn quantize_swizzled(
        &self,
        x: &Vec<f32>,
        nodes: usize,
        ranks_per_node: usize,
        rounding: Rounding,
        out: &mut QuantizedChunks,
    ) -> Result<(), ZeroError> {
        HostKernels::quantize_swizzled(self, x, nodes, ranks_per_node, rounding, out)
    }

    fn quantize_swizzled_kept(
        &self,
        x: &mut Vec<f32>,
        nodes: usize,
        ranks_per_node: usize,
        rounding: Rounding,
        out: &mut QuantizedChunks,
        residual: &mut QuantizedChunks,
    ) -> Result<(), ZeroError> {
        let Some(fused) = self.fused_feedback() else {
            let shape = (nodes, ranks_per_node);
            return swizzled_kept_composed(self, x, shape, rounding, out, residual);
        };
        let (chunk, count) = (residual.chunk_len, residual.count);
        if (out.chunk_len, out.count) != (chunk, count) || x.len() != chunk * count {
            return Err(ZeroError::Invalid(format!(
                "error feedback of {} values through {} chunks of {} and a residual of {count} \
                 chunks of {chunk}",
                x.len(),
                out.count,
                out.chunk_len
            )));
        }
        // The new residual goes into fresh chunks (every byte written): an
        // error leaves the old.
        let mut fresh = pooled_chunks_for_overwrite(residual.format, chunk, count);
        for p in 0..count {
            let r = zeropp_quant::swizzled_rank(p, nodes, ranks_per_node);
            let x = &mut x[r * chunk..][..chunk];
            let done = fused(
                x,
                rounding.for_part(r),
                out.chunk_mut(p),
                residual.chunk(r),
                fresh.chunk_mut(r),
            );
            if let Err(e) = done {
                give_chunks(fresh);
                return Err(quant_failure("quantizing with error feedback")(e));
            }
        }
        std::mem::swap(residual, &mut fresh);
        give_chunks(fresh);
        Ok(())
    }

    fn quantize_tensor_swizzled<T: GpuElement>(
        &self,
        x: &&[T],
        nodes: usize,
        ranks_per_node: usize,
        rounding: Rounding,
        out: &mut QuantizedChunks,
    ) -> Result<(), ZeroError> {
        HostKernels::quantize_swizzled(self, x, nodes, ranks_per_node, rounding, out)
    }

    fn quantize_chunk_unchecked(
        &self,
        x: &Vec<f32>,
        at: usize,
        rounding: Rounding,
        out: &mut QuantizedChunks,
        i: usize,
    ) -> Result<(), ZeroError> {
        let x = &x[at..at + out.chunk_len];
        HostKernels::quantize(self, x, rounding, out.chunk_mut(i))
    }

    fn dequantize_unchecked(
        &self,
        q: &QuantizedChunks,
        i: usize,
        out: &mut Vec<f32>,
        at: usize,
    ) -> Result<(), ZeroError> {
        self.dequantize_tensor_unchecked(q, i, &mut out.as_mut_slice(), at)
    }

    fn dequantize_accumulate_unchecked(
        &self,
        q: &QuantizedChunks,
        i: usize,
        out: &mut Vec<f32>,
        at: usize,
    ) -> Result<(), ZeroError> {
        let out = &mut out[at..at + q.chunk_len];
        HostKernels::dequantize_accumulate(self, q.chunk(i), out)
    }

    fn sum_requantize_unchecked(
        &self,
        q: &QuantizedChunks,
        inputs: &[usize],
        rounding: Rounding,
        out: &mut QuantizedChunks,
        o: usize,
    ) -> Result<(), ZeroError> {
        let views: Vec<_> = inputs.iter().map(|&i| q.chunk(i)).collect();
        HostKernels::sum_requantize(self, &views, rounding, out.chunk_mut(o))
    }

    fn dropped_unchecked(
        &self,
        x: &mut Vec<f32>,
        at_x: usize,
        y: &Vec<f32>,
        at_y: usize,
        len: usize,
    ) -> Result<(), ZeroError> {
        HostKernels::dropped(self, &mut x[at_x..at_x + len], &y[at_y..at_y + len])
    }

    fn divide(&self, x: &mut Vec<f32>, d: f32) -> Result<(), ZeroError> {
        HostKernels::divide(self, x, d)
    }

    fn rotate_unchecked(
        &self,
        x: &mut Vec<f32>,
        at: usize,
        len: usize,
        block: usize,
    ) -> Result<(), ZeroError> {
        HostKernels::rotate(self, &mut x[at..at + len], block)
    }
}

/// Moves chunks through zeropp's host transports, within this rank's
/// [`ZeroGroups`], and counts them (set as each call's phase).
pub struct HostMover<'a> {
    pub comm: &'a Communicator,
    pub counter: &'a CountingTransport,
    pub groups: ZeroGroups,
}

impl HostMover<'_> {
    fn group(&self, hop: Hop) -> &Group {
        match hop {
            Hop::World => &self.groups.world,
            Hop::Node => &self.groups.node,
            Hop::Cross => &self.groups.cross,
            Hop::Hpz => &self.groups.hpz,
        }
    }

    /// qgZ's bf16 hop inside the node once its messages are made
    /// (`to_each`: member j's): `sum` gets the f32 sum, in member order, of
    /// what each sent this rank.
    fn sum_each(
        &self,
        hop: Hop,
        phase: Phase,
        to_each: Vec<Bytes>,
        sum: &mut [f32],
    ) -> Result<(), ZeroError> {
        self.counter.set_phase(phase, 0.0);
        let from_each = self.comm.all_to_all_v(self.group(hop), to_each)?;
        for (j, b) in from_each.iter().enumerate() {
            if j == 0 {
                payload::decode_bf16(b, sum)?;
            } else {
                payload::add_bf16(b, sum)?;
            }
        }
        Ok(())
    }

    /// Every member's `values` as the plain wire carries them (bf16,
    /// rounded to nearest even, or f32 with `fp32`), counted under `phase`.
    fn gather_plain<E: Element>(
        &self,
        hop: Hop,
        phase: Phase,
        values: &[E],
        fp32: bool,
    ) -> Result<Vec<Bytes>, ZeroError> {
        self.counter.set_phase(phase, 0.0);
        let wire = if fp32 {
            payload::encode_f32(values)
        } else {
            payload::encode_bf16(values)
        };
        Ok(self.comm.all_gather_v(self.group(hop), wire)?)
    }

    /// ZeRO-3's all-reduce over `hop`, in place: `x` (padded with zeros
    /// to a multiple of the members) reduce-scattered as
    /// [`ByteMover::reduce_scatter_tensor`] does (a bf16 ring for bf16
    /// tensors, f32 otherwise), then every member's part gathered back into
    /// `x` in `T`: the same on every member.
    pub fn all_reduce_tensor<K: HostKernels, T: GpuElement>(
        &self,
        q: &K,
        (hop, phase): (Hop, Phase),
        x: &mut [T],
        mean: bool,
    ) -> Result<(), ZeroError> {
        let (members, len) = (self.group(hop).size(), x.len());
        let padded = len.div_ceil(members) * members;
        let mut input = vec![T::default(); padded];
        input[..len].copy_from_slice(x);
        let (mut part, mut all) = (
            vec![T::default(); padded / members],
            vec![T::default(); padded],
        );
        ByteMover::<K>::reduce_scatter_tensor(
            self,
            q,
            hop,
            phase,
            &&input[..],
            &mut &mut part[..],
            mean,
        )?;
        ByteMover::<K>::all_gather_tensor(self, q, hop, phase, &&part[..], &mut &mut all[..])?;
        x.copy_from_slice(&all[..len]);
        Ok(())
    }
}

/// Zeroed quantized chunks (as `QuantizedChunks::zeroed`) in reused
/// buffers ([`scratch`]).
fn pooled_chunks(format: QuantFormat, chunk_len: usize, count: usize) -> QuantizedChunks {
    let mut q = pooled_chunks_for_overwrite(format, chunk_len, count);
    q.codes.fill(0);
    q.block_max.fill(0.0);
    q.block_min.fill(0.0);
    q
}

/// [`pooled_chunks`] whose every byte the caller writes before reading.
fn pooled_chunks_for_overwrite(
    format: QuantFormat,
    chunk_len: usize,
    count: usize,
) -> QuantizedChunks {
    QuantizedChunks {
        format,
        chunk_len,
        count,
        codes: scratch::take_for_overwrite(count * format.code_bytes(chunk_len)),
        block_max: scratch::take_for_overwrite(count * format.num_blocks(chunk_len)),
        block_min: scratch::take_for_overwrite(count * format.num_block_mins(chunk_len)),
    }
}

/// Gives quantized chunks' buffers back.
fn give_chunks(q: QuantizedChunks) {
    scratch::give(q.codes);
    scratch::give(q.block_max);
    scratch::give(q.block_min);
}

/// `bytes` as a message, in a reused buffer.
fn pooled_copy(bytes: &[u8]) -> Bytes {
    Bytes::from_owner(scratch::copied(bytes))
}

impl<K: HostKernels> ByteMover<K> for HostMover<'_> {
    fn size(&self, hop: Hop) -> usize {
        self.group(hop).size()
    }

    fn all_to_all_unchecked(
        &self,
        hop: Hop,
        phase: Phase,
        (send, k): (&QuantizedChunks, usize),
        recv: &mut QuantizedChunks,
    ) -> Result<(), ZeroError> {
        let group = self.group(hop);
        self.counter
            .set_phase(phase, scale_fraction(send.format, send.chunk_len));
        let to_each = (0..group.size())
            .map(|j| payload::encode_chunks(send, j * k..(j + 1) * k))
            .collect();
        let from_each = self.comm.all_to_all_v(group, to_each)?;
        for (j, b) in from_each.iter().enumerate() {
            payload::decode_chunks_into(b, recv, j * k..(j + 1) * k)?;
        }
        Ok(())
    }

    fn sum_swizzled_unchecked<T: GpuElement>(
        &self,
        _q: &K,
        hop: Hop,
        phase: Phase,
        x: &&[T],
        (nodes, chunk): (usize, usize),
        sum: &mut Vec<f32>,
    ) -> Result<(), ZeroError> {
        let group = self.group(hop);
        let members = group.size();
        // Every message is made before any is sent: a value that is not
        // finite is refused on every rank that has one, with nothing sent.
        let to_each = (0..members)
            .map(|j| payload::encode_bf16_chunks(x, chunk, (0..nodes).map(|n| n * members + j)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|(index, value)| not_finite_gradient(&format!("index {index}"), value))?;
        self.sum_each(hop, phase, to_each, sum)
    }

    fn sum_runs_taking(
        &self,
        _q: &K,
        hop: Hop,
        phase: Phase,
        runs: Kept,
        sum: &mut Vec<f32>,
    ) -> Result<(), ZeroError> {
        let Kept::Bf16(runs) = runs else {
            return Err(not_bf16());
        };
        let mut words: Vec<u16> = bytemuck::allocation::cast_vec(runs);
        let members = self.group(hop).size();
        let run = check_swizzled(words.len(), sum.len(), 1, members)?;
        // Nothing is sent where a value is not finite (every rank that has
        // one refuses).
        let not_finite = payload::first_non_finite(bytemuck::cast_slice::<u16, half::bf16>(&words));
        if let Some((index, value)) = not_finite {
            scratch::give(words);
            let at = format!("index {} of local rank {}'s run", index % run, index / run);
            return Err(not_finite_gradient(&at, value));
        }
        words.iter_mut().for_each(|w| *w = w.to_le());
        let all = Bytes::from_owner(scratch::Returned(words));
        let to_each = (0..members).map(|j| all.slice(j * run * 2..(j + 1) * run * 2));
        self.sum_each(hop, phase, to_each.collect(), sum)
    }

    fn all_gather_dequantized<T: GpuElement>(
        &self,
        q: &K,
        (hop, phase): (Hop, Phase),
        mine: &QuantizedChunks,
        place: &dyn Fn(usize, usize) -> usize,
        out: &mut &mut [T],
    ) -> Result<(), ZeroError> {
        let (format, chunk, k) = (mine.format, mine.chunk_len, mine.count);
        let group = self.group(hop);
        check_gather_len(k * chunk, out.len(), group.size())?;
        self.counter.set_phase(phase, scale_fraction(format, chunk));
        let from_each = self
            .comm
            .all_gather_v(group, payload::encode_chunks(mine, 0..k))?;
        for (j, b) in from_each.iter().enumerate() {
            let message = payload::ChunksMessage::read(b, format, chunk, k)?;
            for i in 0..k {
                let at = place(j, i) * chunk;
                let to = out.get_mut(at..at + chunk).ok_or_else(|| {
                    ZeroError::Invalid(format!(
                        "chunk {i} of member {j} placed at {at}, past the {} values gathered",
                        k * chunk * from_each.len()
                    ))
                })?;
                HostKernels::dequantize(q, message.chunk(i), to)?;
            }
        }
        Ok(())
    }

    fn all_gather_unchecked(
        &self,
        hop: Hop,
        phase: Phase,
        (mine, k): (&QuantizedChunks, usize),
        all: &mut QuantizedChunks,
    ) -> Result<(), ZeroError> {
        let group = self.group(hop);
        self.counter
            .set_phase(phase, scale_fraction(mine.format, mine.chunk_len));
        let from_each = self
            .comm
            .all_gather_v(group, payload::encode_chunks(mine, 0..k))?;
        for (j, b) in from_each.iter().enumerate() {
            payload::decode_chunks_into(b, all, j * k..(j + 1) * k)?;
        }
        Ok(())
    }
    fn all_gather_values_unchecked(
        &self,
        hop: Hop,
        phase: Phase,
        mine: &Vec<f32>,
        all: &mut Vec<f32>,
        fp32: bool,
    ) -> Result<(), ZeroError> {
        let len = mine.len();
        for (j, b) in self
            .gather_plain(hop, phase, mine, fp32)?
            .iter()
            .enumerate()
        {
            decode_plain(b, fp32, &mut all[j * len..(j + 1) * len])?;
        }
        Ok(())
    }

    fn all_agree(&self, hop: Hop, phase: Phase, mine: bool) -> Result<bool, ZeroError> {
        let group = self.group(hop);
        self.counter.set_phase(phase, 0.0);
        let each = self
            .comm
            .all_gather_v(group, Bytes::from(vec![u8::from(mine)]))?;
        for b in &each {
            check_run(b, 1)?;
        }
        Ok(each.iter().all(|b| b[0] == 1))
    }

    fn all_gather_kept_placed<T: GpuElement>(
        &self,
        _q: &K,
        hop: Hop,
        phase: Phase,
        (kept, len, fp32): (&Kept, usize, bool),
        (pieces, place): (usize, &dyn Fn(usize, usize) -> usize),
        out: &mut &mut [T],
    ) -> Result<(), ZeroError> {
        let piece = check_pieces(len, pieces)?;
        if kept.len() != len {
            return Err(ZeroError::Invalid(format!(
                "gathering {len} kept values from a buffer of {}",
                kept.len()
            )));
        }
        let from_each = match kept {
            Kept::F32(v) => self.gather_plain(hop, phase, v, fp32)?,
            Kept::Bf16(v) => self.gather_plain(hop, phase, v, fp32)?,
        };
        let width = if fp32 { 4 } else { 2 };
        let mut values = scratch::take_for_overwrite::<f32>(piece);
        for (j, b) in from_each.iter().enumerate() {
            check_run(b, len * width)?;
            for p in 0..pieces {
                let bytes = &b[p * piece * width..(p + 1) * piece * width];
                decode_plain(bytes, fp32, &mut values)?;
                T::narrow_slice(
                    &values,
                    span_mut(out, place(j, p), piece, "a gathered piece")?,
                );
            }
        }
        scratch::give(values);
        Ok(())
    }

    fn all_gather_values_kept_unchecked(
        &self,
        q: &K,
        hop: Hop,
        phase: Phase,
        mine: &Vec<f32>,
        kept: &mut Kept,
        fp32: bool,
    ) -> Result<(), ZeroError> {
        let len = mine.len();
        let mut values = scratch::take_for_overwrite::<f32>(len);
        for (j, b) in self
            .gather_plain(hop, phase, mine, fp32)?
            .iter()
            .enumerate()
        {
            decode_plain(b, fp32, &mut values)?;
            q.store_kept(&values, 0, kept, j * len, len)?;
        }
        scratch::give(values);
        Ok(())
    }

    fn all_gather_tensor_unchecked<T: GpuElement>(
        &self,
        hop: Hop,
        phase: Phase,
        mine: &&[T],
        all: &mut &mut [T],
    ) -> Result<(), ZeroError> {
        let group = self.group(hop);
        self.counter.set_phase(phase, 0.0);
        let mine: &[u8] = bytemuck::cast_slice(mine);
        let parts = self.comm.all_gather_v(group, pooled_copy(mine))?;
        let all: &mut [u8] = bytemuck::cast_slice_mut(all);
        for (j, part) in parts.iter().enumerate() {
            if part.len() != mine.len() {
                return Err(ZeroError::Comm(CommError::Malformed(format!(
                    "an all-gather of {} bytes got {} from member {j}",
                    mine.len(),
                    part.len()
                ))));
            }
            all[j * mine.len()..(j + 1) * mine.len()].copy_from_slice(part);
        }
        Ok(())
    }

    fn all_gather_tensor_bf16_unchecked<T: GpuElement>(
        &self,
        _q: &K,
        hop: Hop,
        phase: Phase,
        mine: &&[T],
        all: &mut &mut [T],
    ) -> Result<(), ZeroError> {
        let len = mine.len();
        for (j, b) in self
            .gather_plain(hop, phase, mine, false)?
            .iter()
            .enumerate()
        {
            let out = &mut all[j * len..(j + 1) * len];
            if T::TAG == "f32" {
                // f32: decoded in place, as the engine's masters were.
                payload::decode_bf16(b, bytemuck::cast_slice_mut(out))?;
            } else {
                let mut wide = scratch::take_for_overwrite::<f32>(len);
                payload::decode_bf16(b, &mut wide)?;
                T::narrow_slice(&wide, out);
                scratch::give(wide);
            }
        }
        Ok(())
    }

    fn reduce_scatter_taking(
        &self,
        q: &K,
        (hop, phase): (Hop, Phase),
        grad: Vec<f32>,
        mean: bool,
    ) -> Result<Vec<f32>, ZeroError> {
        self.ring_taking(q, hop, phase, Kept::F32(grad), mean)
    }

    fn reduce_scatter_kept(
        &self,
        q: &K,
        (hop, phase): (Hop, Phase),
        grad: Kept,
        mean: bool,
    ) -> Result<Vec<f32>, ZeroError> {
        self.ring_taking(q, hop, phase, grad, mean)
    }

    fn reduce_scatter_tensor_unchecked<T: GpuElement>(
        &self,
        q: &K,
        hop: Hop,
        phase: Phase,
        x: &&[T],
        out: &mut &mut [T],
        mean: bool,
    ) -> Result<(), ZeroError> {
        let sum = self.reduce_scatter_f32(q, hop, phase, x, mean)?;
        HostKernels::narrow(q, &sum, out)?;
        scratch::give(sum);
        Ok(())
    }
}

impl HostMover<'_> {
    /// ZeRO-3's reduce-scatter over `hop`: `x` (the group's size equal
    /// chunks, member order) summed in a bf16 ring when `T` is bf16, else
    /// in f32; this member's chunk of the sum in f32 (with `mean`, divided
    /// by the group's size) before any rounding to `T` — what
    /// [`ByteMover::reduce_scatter_tensor`] rounds into the caller's
    /// tensor, and what the native engine keeps.
    pub fn reduce_scatter_f32<K: HostKernels, T: GpuElement>(
        &self,
        q: &K,
        hop: Hop,
        phase: Phase,
        x: &[T],
        mean: bool,
    ) -> Result<Vec<f32>, ZeroError> {
        let grad = if std::any::TypeId::of::<T>() == std::any::TypeId::of::<half::bf16>() {
            let mut words = scratch::take_for_overwrite::<u16>(x.len());
            words.copy_from_slice(bytemuck::cast_slice(x));
            Kept::Bf16(bytemuck::allocation::cast_vec(words))
        } else {
            let mut wide = scratch::take_for_overwrite::<f32>(x.len());
            HostKernels::widen(q, x, &mut wide)?;
            Kept::F32(wide)
        };
        self.ring_taking(q, hop, phase, grad, mean)
    }

    /// [`HostMover::reduce_scatter_f32`] of a gradient the call takes, in
    /// a bf16 ring for bf16 values and an f32 ring for f32 ones: the ring
    /// sends from its buffer (given back to the pools once sent), not from
    /// a copy.
    fn ring_taking<K: HostKernels>(
        &self,
        q: &K,
        hop: Hop,
        phase: Phase,
        grad: Kept,
        mean: bool,
    ) -> Result<Vec<f32>, ZeroError> {
        let group = self.group(hop);
        let members = group.size();
        let len = grad.len();
        if !len.is_multiple_of(members) {
            return Err(ZeroError::Invalid(format!(
                "a reduce-scatter of {len} values does not split into {members} equal chunks"
            )));
        }
        self.counter.set_phase(phase, 0.0);
        let mut sum = match grad {
            Kept::Bf16(values) => {
                let words: Vec<u16> = bytemuck::allocation::cast_vec(values);
                let bytes = Bytes::from_owner(scratch::Returned(words));
                let mine = ring_bf16(self.comm, group, bytes)?;
                let mut v = scratch::take_for_overwrite::<f32>(mine.len() / 2);
                payload::decode_bf16(&mine, &mut v)?;
                scratch::give(mine);
                v
            }
            Kept::F32(values) => ring_f32(self.comm, group, values)?,
        };
        if mean {
            HostKernels::divide(q, &mut sum, members as f32)?;
        }
        Ok(sum)
    }
}

// ZeRO-3's plain rings on the host (the reduce-scatter qgZ replaces).

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
