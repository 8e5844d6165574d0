//! The two small interfaces every ZeRO++ collective is written over, so that
//! each collective is written once for host and device memory:
//!
//! - a [`Quantizer`]: zeropp-quant's formats, bit for bit, on one kind of
//!   memory (the CPU library on host buffers; the CUDA kernels on device
//!   buffers; the same kernels' source, emulated, on host buffers);
//! - a [`ByteMover`]: quantized chunks moved within one of this rank's
//!   groups ([`Hop`]), counting what it sends (zeropp's host transports;
//!   NCCL on the caller's stream).
//!
//! Buffers are named by the backend ([`Quantizer::Values`],
//! [`Quantizer::Chunks`]) and addressed by offsets, so the collectives never
//! see whether they live on the host or the device.

use zeropp_cuda::GpuElement;
use zeropp_quant::{QuantFormat, Rounding};

use crate::error::ZeroError;
use crate::traffic::Phase;

/// Quantizing on one kind of memory.
pub trait Quantizer {
    /// f32 values.
    type Values;
    /// `count` quantized chunks of `chunk_len` values each, in
    /// `zeropp_quant::QuantizedChunks`' layout: every chunk's codes, then
    /// every chunk's block maxima, then minima (a run of chunks is
    /// contiguous in each part).
    type Chunks;

    /// A caller's tensor of `T` values (f32, bf16, f16), to read: a host
    /// slice, or a device view.
    type Tensor<'a, T: GpuElement + 'a>;
    /// A caller's tensor, to write.
    type TensorMut<'a, T: GpuElement + 'a>;

    /// `len` zeros.
    fn values(&self, len: usize) -> Result<Self::Values, ZeroError>;

    /// `len` values the caller overwrites before reading any (zeros where a
    /// backend has nothing cheaper).
    fn values_for_overwrite(&self, len: usize) -> Result<Self::Values, ZeroError> {
        self.values(len)
    }

    /// Values kept from one call to the next (qwZ's references): in f32,
    /// or in bf16 where everything they feed travels in bf16 (half the
    /// bytes, and nothing the receivers see changes).
    type Kept;

    /// `len` zeros to keep, in bf16 (`bf16`) or f32.
    fn kept(&self, len: usize, bf16: bool) -> Result<Self::Kept, ZeroError>;

    /// [`Quantizer::kept`] whose contents the caller overwrites whole
    /// before reading: by default zeros too; the host skips the zeroing.
    fn kept_for_overwrite(&self, len: usize, bf16: bool) -> Result<Self::Kept, ZeroError> {
        self.kept(len, bf16)
    }

    /// [`Quantizer::kept`] in host memory: the device copies them in and
    /// out as they are used (`frozen_cache="host"`); the host's own are
    /// host memory already.
    fn kept_on_host(&self, len: usize, bf16: bool) -> Result<Self::Kept, ZeroError> {
        self.kept(len, bf16)
    }

    /// Values in kept storage.
    fn kept_len(&self, k: &Self::Kept) -> usize;

    /// `k[at_k..at_k + len]` in f32 into `out[at..]`. Checked here; the
    /// backend loads ([`Quantizer::load_kept_unchecked`]).
    fn load_kept(
        &self,
        k: &Self::Kept,
        at_k: usize,
        out: &mut Self::Values,
        at: usize,
        len: usize,
    ) -> Result<(), ZeroError> {
        check_span(self.kept_len(k), at_k, len, "loading kept values")?;
        check_span(self.len(out), at, len, "loading kept values")?;
        self.load_kept_unchecked(k, at_k, out, at, len)
    }

    /// [`Quantizer::load_kept`] once both ranges were checked.
    fn load_kept_unchecked(
        &self,
        k: &Self::Kept,
        at_k: usize,
        out: &mut Self::Values,
        at: usize,
        len: usize,
    ) -> Result<(), ZeroError>;

    /// `x[at..at + len]` into `k[at_k..]` (rounded to nearest even where
    /// `k` is bf16). Checked here; the backend stores
    /// ([`Quantizer::store_kept_unchecked`]).
    fn store_kept(
        &self,
        x: &Self::Values,
        at: usize,
        k: &mut Self::Kept,
        at_k: usize,
        len: usize,
    ) -> Result<(), ZeroError> {
        check_span(self.len(x), at, len, "keeping values")?;
        check_span(self.kept_len(k), at_k, len, "keeping values")?;
        self.store_kept_unchecked(x, at, k, at_k, len)
    }

    /// [`Quantizer::store_kept`] once both ranges were checked.
    fn store_kept_unchecked(
        &self,
        x: &Self::Values,
        at: usize,
        k: &mut Self::Kept,
        at_k: usize,
        len: usize,
    ) -> Result<(), ZeroError>;

    /// Values in a caller's tensor.
    fn tensor_len<T: GpuElement>(&self, x: &Self::Tensor<'_, T>) -> usize;

    /// Values in a caller's tensor, to write.
    fn tensor_mut_len<T: GpuElement>(&self, x: &Self::TensorMut<'_, T>) -> usize;

    /// `x` (one chunk's values) quantized into chunk `i` of `out`. Checked
    /// here; the backend quantizes ([`Quantizer::quantize_tensor_unchecked`]).
    fn quantize_tensor<T: GpuElement>(
        &self,
        x: &Self::Tensor<'_, T>,
        rounding: Rounding,
        out: &mut Self::Chunks,
        i: usize,
    ) -> Result<(), ZeroError> {
        let shape = self.shape(out);
        check_chunk(shape, i, "quantizing a tensor")?;
        let n = self.tensor_len(x);
        if n != shape.1 {
            return Err(ZeroError::Invalid(format!(
                "quantizing a tensor of {n} values into chunks of {}",
                shape.1
            )));
        }
        self.quantize_tensor_unchecked(x, rounding, out, i)
    }

    /// [`Quantizer::quantize_tensor`] once checked: the chunk exists and
    /// `x` is one chunk long.
    fn quantize_tensor_unchecked<T: GpuElement>(
        &self,
        x: &Self::Tensor<'_, T>,
        rounding: Rounding,
        out: &mut Self::Chunks,
        i: usize,
    ) -> Result<(), ZeroError>;

    /// Chunk `i` of `q` dequantized into `out[at..at + chunk_len]`. Checked
    /// here; the backend dequantizes
    /// ([`Quantizer::dequantize_tensor_unchecked`]).
    fn dequantize_tensor<T: GpuElement>(
        &self,
        q: &Self::Chunks,
        i: usize,
        out: &mut Self::TensorMut<'_, T>,
        at: usize,
    ) -> Result<(), ZeroError> {
        let shape = self.shape(q);
        check_chunk(shape, i, "dequantizing a chunk")?;
        check_span(
            self.tensor_mut_len(out),
            at,
            shape.1,
            "dequantizing a chunk",
        )?;
        self.dequantize_tensor_unchecked(q, i, out, at)
    }

    /// [`Quantizer::dequantize_tensor`] once checked.
    fn dequantize_tensor_unchecked<T: GpuElement>(
        &self,
        q: &Self::Chunks,
        i: usize,
        out: &mut Self::TensorMut<'_, T>,
        at: usize,
    ) -> Result<(), ZeroError>;

    /// `x` converted to f32 into `out[at..at + len(x)]`. Checked here; the
    /// backend converts ([`Quantizer::load_tensor_unchecked`]).
    fn load_tensor<T: GpuElement>(
        &self,
        x: &Self::Tensor<'_, T>,
        out: &mut Self::Values,
        at: usize,
    ) -> Result<(), ZeroError> {
        check_span(self.len(out), at, self.tensor_len(x), "loading a tensor")?;
        self.load_tensor_unchecked(x, out, at)
    }

    /// [`Quantizer::load_tensor`] once checked.
    fn load_tensor_unchecked<T: GpuElement>(
        &self,
        x: &Self::Tensor<'_, T>,
        out: &mut Self::Values,
        at: usize,
    ) -> Result<(), ZeroError>;

    /// `x[at_x..at_x + len]` converted to `T` (rounded to nearest even)
    /// into `out[at_out..]`. Checked here; the backend converts
    /// ([`Quantizer::store_values_unchecked`]).
    fn store_values<T: GpuElement>(
        &self,
        x: &Self::Values,
        at_x: usize,
        out: &mut Self::TensorMut<'_, T>,
        at_out: usize,
        len: usize,
    ) -> Result<(), ZeroError> {
        check_span(self.len(x), at_x, len, "storing values")?;
        check_span(self.tensor_mut_len(out), at_out, len, "storing values")?;
        self.store_values_unchecked(x, at_x, out, at_out, len)
    }

    /// [`Quantizer::store_values`] once both ranges were checked.
    fn store_values_unchecked<T: GpuElement>(
        &self,
        x: &Self::Values,
        at_x: usize,
        out: &mut Self::TensorMut<'_, T>,
        at_out: usize,
        len: usize,
    ) -> Result<(), ZeroError>;

    /// Chunk `i` of `src` into chunk `j` of `dst` (the same format and
    /// chunk length). Checked here; the backend copies
    /// ([`Quantizer::copy_chunk_unchecked`]).
    fn copy_chunk(
        &self,
        src: &Self::Chunks,
        i: usize,
        dst: &mut Self::Chunks,
        j: usize,
    ) -> Result<(), ZeroError> {
        check_copy_chunk(self.shape(src), i, self.shape(dst), j)?;
        self.copy_chunk_unchecked(src, i, dst, j)
    }

    /// [`Quantizer::copy_chunk`] once checked: both chunks exist, of one
    /// format and length.
    fn copy_chunk_unchecked(
        &self,
        src: &Self::Chunks,
        i: usize,
        dst: &mut Self::Chunks,
        j: usize,
    ) -> Result<(), ZeroError>;

    /// `x` rounded to bf16 (nearest even), kept in f32, as storing it in
    /// bf16 [`Quantizer::Kept`] values and loading them back gives. By
    /// default through such kept values; the host rounds in place through
    /// a reused buffer.
    fn round_bf16(&self, x: &mut Self::Values) -> Result<(), ZeroError> {
        let len = self.len(x);
        let mut kept = self.kept(len, true)?;
        self.store_kept(x, 0, &mut kept, 0, len)?;
        self.load_kept(&kept, 0, x, 0, len)
    }

    /// Values in a buffer.
    fn len(&self, x: &Self::Values) -> usize;

    /// Zeroed storage for `count` chunks of `chunk_len` values.
    fn chunks(
        &self,
        format: QuantFormat,
        chunk_len: usize,
        count: usize,
    ) -> Result<Self::Chunks, ZeroError>;

    /// Gives a temporary back for reuse (the host's [`crate::scratch`];
    /// the device's allocations already come from CUDA's memory pool).
    fn recycle(&self, _x: Self::Values) {}

    /// Gives temporary chunks back for reuse, as [`Quantizer::recycle`].
    fn recycle_chunks(&self, _q: Self::Chunks) {}

    /// Gives kept values back for reuse (hpZ's secondary once the backward
    /// gather has read it), as [`Quantizer::recycle`].
    fn recycle_kept(&self, _k: Self::Kept) {}

    /// `x` as a caller's f32 tensor: the same memory, read.
    fn values_as_tensor<'a>(&self, x: &'a Self::Values) -> Self::Tensor<'a, f32>;

    /// `x` as a caller's f32 tensor: the same memory, written.
    fn values_as_tensor_mut<'a>(&self, x: &'a mut Self::Values) -> Self::TensorMut<'a, f32>;

    /// Values kept in bf16 as a caller's bf16 tensor: the same memory,
    /// read. Values kept otherwise (f32, or in host memory beside a device)
    /// are refused.
    fn kept_as_bf16_tensor<'a>(
        &self,
        k: &'a Self::Kept,
    ) -> Result<Self::Tensor<'a, half::bf16>, ZeroError>;

    /// `(format, chunk_len, count)` of a chunked buffer.
    fn shape(&self, q: &Self::Chunks) -> (QuantFormat, usize, usize);

    /// `y[at_y..at_y + len]` into `x[at_x..]`. Checked here; the backend
    /// copies ([`Quantizer::copy_unchecked`]).
    fn copy(
        &self,
        y: &Self::Values,
        at_y: usize,
        x: &mut Self::Values,
        at_x: usize,
        len: usize,
    ) -> Result<(), ZeroError> {
        check_span(self.len(y), at_y, len, "copy")?;
        check_span(self.len(x), at_x, len, "copy")?;
        self.copy_unchecked(y, at_y, x, at_x, len)
    }

    /// [`Quantizer::copy`] once both ranges are checked.
    fn copy_unchecked(
        &self,
        y: &Self::Values,
        at_y: usize,
        x: &mut Self::Values,
        at_x: usize,
        len: usize,
    ) -> Result<(), ZeroError>;

    /// `x` (count · chunk_len values, chunk r for rank r of `nodes` ×
    /// `ranks_per_node`) into `out` in swizzled order
    /// (`zeropp_quant::quantize_swizzled`: chunk r at position g·N + n,
    /// rounded with `rounding.for_part(r)`).
    fn quantize_swizzled(
        &self,
        x: &Self::Values,
        nodes: usize,
        ranks_per_node: usize,
        rounding: Rounding,
        out: &mut Self::Chunks,
    ) -> Result<(), ZeroError>;

    /// [`Quantizer::quantize_swizzled`] of a caller's tensor, as its values
    /// converted to f32 would be (bit for bit): straight from the tensor
    /// where a backend can, else through f32 values.
    fn quantize_tensor_swizzled<T: GpuElement>(
        &self,
        x: &Self::Tensor<'_, T>,
        nodes: usize,
        ranks_per_node: usize,
        rounding: Rounding,
        out: &mut Self::Chunks,
    ) -> Result<(), ZeroError> {
        let mut values = self.values_for_overwrite(self.tensor_len(x))?;
        self.load_tensor(x, &mut values, 0)?;
        self.quantize_swizzled(&values, nodes, ranks_per_node, rounding, out)?;
        self.recycle(values);
        Ok(())
    }

    /// Error feedback around [`Quantizer::quantize_swizzled`]: `residual`
    /// (one chunk per rank, in rank order; the caller gives it its shape)
    /// added to `x`, `x` quantized into `out` as `quantize_swizzled` does,
    /// and `residual` replaced by what that dropped, rounded to nearest. By
    /// default [`swizzled_kept_composed`]; a backend may fuse it, bit for
    /// bit the same.
    fn quantize_swizzled_kept(
        &self,
        x: &mut Self::Values,
        nodes: usize,
        ranks_per_node: usize,
        rounding: Rounding,
        out: &mut Self::Chunks,
        residual: &mut Self::Chunks,
    ) -> Result<(), ZeroError> {
        swizzled_kept_composed(self, x, (nodes, ranks_per_node), rounding, out, residual)
    }

    /// `x[at..at + chunk_len]` quantized into chunk `i` of `out`. Checked
    /// here; the backend quantizes ([`Quantizer::quantize_chunk_unchecked`]).
    fn quantize_chunk(
        &self,
        x: &Self::Values,
        at: usize,
        rounding: Rounding,
        out: &mut Self::Chunks,
        i: usize,
    ) -> Result<(), ZeroError> {
        let shape = self.shape(out);
        check_chunk(shape, i, "quantizing a chunk")?;
        check_span(self.len(x), at, shape.1, "quantizing a chunk")?;
        self.quantize_chunk_unchecked(x, at, rounding, out, i)
    }

    /// [`Quantizer::quantize_chunk`] once checked: chunk `i` exists and `x`
    /// holds its values at `at`.
    fn quantize_chunk_unchecked(
        &self,
        x: &Self::Values,
        at: usize,
        rounding: Rounding,
        out: &mut Self::Chunks,
        i: usize,
    ) -> Result<(), ZeroError>;

    /// Chunk `i` of `q` dequantized into `out[at..at + chunk_len]`. Checked here; the backend
    /// dequantizes ([`Quantizer::dequantize_unchecked`]).
    fn dequantize(
        &self,
        q: &Self::Chunks,
        i: usize,
        out: &mut Self::Values,
        at: usize,
    ) -> Result<(), ZeroError> {
        let shape = self.shape(q);
        check_chunk(shape, i, "dequantizing a chunk")?;
        check_span(self.len(out), at, shape.1, "dequantizing a chunk")?;
        self.dequantize_unchecked(q, i, out, at)
    }

    /// [`Quantizer::dequantize`] once checked.
    fn dequantize_unchecked(
        &self,
        q: &Self::Chunks,
        i: usize,
        out: &mut Self::Values,
        at: usize,
    ) -> Result<(), ZeroError>;

    /// Chunk `i` of `q` dequantized and added into `out[at..]` (f32).
    /// Checked here; the backend sums
    /// ([`Quantizer::dequantize_accumulate_unchecked`]).
    fn dequantize_accumulate(
        &self,
        q: &Self::Chunks,
        i: usize,
        out: &mut Self::Values,
        at: usize,
    ) -> Result<(), ZeroError> {
        let shape = self.shape(q);
        check_chunk(shape, i, "summing a chunk")?;
        check_span(self.len(out), at, shape.1, "summing a chunk")?;
        self.dequantize_accumulate_unchecked(q, i, out, at)
    }

    /// [`Quantizer::dequantize_accumulate`] once checked: chunk `i` exists
    /// and `out` holds its length at `at`.
    fn dequantize_accumulate_unchecked(
        &self,
        q: &Self::Chunks,
        i: usize,
        out: &mut Self::Values,
        at: usize,
    ) -> Result<(), ZeroError>;

    /// Chunks `inputs` of `q` dequantized, summed in f32 in that order
    /// (from +0) and requantized into chunk `o` of `out`, in one pass
    /// (`zeropp_quant::sum_requantize`). Checked here; the backend sums
    /// ([`Quantizer::sum_requantize_unchecked`]).
    fn sum_requantize(
        &self,
        q: &Self::Chunks,
        inputs: &[usize],
        rounding: Rounding,
        out: &mut Self::Chunks,
        o: usize,
    ) -> Result<(), ZeroError> {
        let shape = self.shape(q);
        for &i in inputs {
            check_chunk(shape, i, "summing chunks")?;
        }
        check_chunk(self.shape(out), o, "requantizing a sum")?;
        self.sum_requantize_unchecked(q, inputs, rounding, out, o)
    }

    /// [`Quantizer::sum_requantize`] once checked: every input chunk and
    /// chunk `o` exist.
    fn sum_requantize_unchecked(
        &self,
        q: &Self::Chunks,
        inputs: &[usize],
        rounding: Rounding,
        out: &mut Self::Chunks,
        o: usize,
    ) -> Result<(), ZeroError>;

    /// Whether `x[at_x..at_x + len]` and `y[at_y..]` hold the same values,
    /// bit for bit (an answer on the host: the device's stream is waited
    /// for).
    fn same(
        &self,
        x: &Self::Values,
        at_x: usize,
        y: &Self::Values,
        at_y: usize,
        len: usize,
    ) -> Result<bool, ZeroError> {
        check_span(self.len(x), at_x, len, "comparing")?;
        check_span(self.len(y), at_y, len, "comparing")?;
        self.same_unchecked(x, at_x, y, at_y, len)
    }

    /// [`Quantizer::same`] once both ranges are checked.
    fn same_unchecked(
        &self,
        x: &Self::Values,
        at_x: usize,
        y: &Self::Values,
        at_y: usize,
        len: usize,
    ) -> Result<bool, ZeroError>;

    /// `x[at_x..at_x + len] = y[at_y..at_y + len] − x[at_x..]`: what a
    /// quantization dropped, from what it kept (`x`) and what it was given
    /// (`y`).
    fn dropped(
        &self,
        x: &mut Self::Values,
        at_x: usize,
        y: &Self::Values,
        at_y: usize,
        len: usize,
    ) -> Result<(), ZeroError> {
        check_span(self.len(y), at_y, len, "error feedback")?;
        check_span(self.len(x), at_x, len, "error feedback")?;
        self.dropped_unchecked(x, at_x, y, at_y, len)
    }

    /// [`Quantizer::dropped`] once both ranges are checked.
    fn dropped_unchecked(
        &self,
        x: &mut Self::Values,
        at_x: usize,
        y: &Self::Values,
        at_y: usize,
        len: usize,
    ) -> Result<(), ZeroError>;

    /// Every whole block of `block` values of `x[at..at + len]` rotated by
    /// the orthonormal Walsh–Hadamard matrix (`zeropp_quant::hadamard`;
    /// its own inverse), a shorter tail left as it is.
    fn rotate(
        &self,
        x: &mut Self::Values,
        at: usize,
        len: usize,
        block: usize,
    ) -> Result<(), ZeroError> {
        check_span(self.len(x), at, len, "a Hadamard rotation")?;
        self.rotate_unchecked(x, at, len, block)
    }

    /// [`Quantizer::rotate`] once the range is checked.
    fn rotate_unchecked(
        &self,
        x: &mut Self::Values,
        at: usize,
        len: usize,
        block: usize,
    ) -> Result<(), ZeroError>;

    /// `x /= d`, element by element (the mean over the world).
    fn divide(&self, x: &mut Self::Values, d: f32) -> Result<(), ZeroError>;
}

/// One of this rank's groups, which every collective names by its role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hop {
    /// Every rank.
    World,
    /// This rank's node, in local-rank order.
    Node,
    /// The ranks with this local rank, one per node, in node order.
    Cross,
    /// The ranks sharing this rank's hpZ secondary shard (the node, or a
    /// run of its ranks), in rank order.
    Hpz,
}

/// Moving quantized chunks within one of this rank's groups. Every member
/// calls the same collectives in the same order; each counts the bytes it
/// sends under `phase`, block scales apart.
pub trait ByteMover<Q: Quantizer> {
    /// Members of `hop`.
    fn size(&self, hop: Hop) -> usize;

    /// Member j receives chunks `j·k .. (j+1)·k` of `send` (`k` =
    /// `send`'s count / the group's size); `recv` (the same shape) gets
    /// member j's run for this rank at `j·k`. Checked here
    /// ([`check_all_to_all`]); the backend moves
    /// ([`ByteMover::all_to_all_unchecked`]).
    fn all_to_all(
        &self,
        q: &Q,
        hop: Hop,
        phase: Phase,
        send: &Q::Chunks,
        recv: &mut Q::Chunks,
    ) -> Result<(), ZeroError> {
        let k = check_all_to_all(q.shape(send), q.shape(recv), self.size(hop))?;
        self.all_to_all_unchecked(hop, phase, (send, k), recv)
    }

    /// [`ByteMover::all_to_all`] once checked: `k` chunks for each member.
    fn all_to_all_unchecked(
        &self,
        hop: Hop,
        phase: Phase,
        send: (&Q::Chunks, usize),
        recv: &mut Q::Chunks,
    ) -> Result<(), ZeroError>;

    /// qgZ's hop inside the node in bf16 ([`crate::qgz::FirstHop::Bf16`]):
    /// `x` holds `nodes` · the group's size equal chunks in rank order
    /// (chunk n · size + j is for member j of node n); member j is sent
    /// chunks n · size + j for every n, in bf16 on the wire (rounded to
    /// nearest even where `T` is wider), and `sum` (`nodes` chunks) gets at
    /// chunk n the f32 sum, in member order, of what each member sent this
    /// rank for n. No partial sum is rounded on the way. Checked here
    /// ([`check_swizzled`]); the backend moves and sums
    /// ([`ByteMover::sum_swizzled_unchecked`]).
    fn sum_swizzled<T: GpuElement>(
        &self,
        q: &Q,
        hop: Hop,
        phase: Phase,
        x: &Q::Tensor<'_, T>,
        nodes: usize,
        sum: &mut Q::Values,
    ) -> Result<(), ZeroError> {
        let members = self.size(hop);
        let chunk = check_swizzled(q.tensor_len(x), q.len(sum), nodes, members)?;
        self.sum_swizzled_unchecked(q, hop, phase, x, (nodes, chunk), sum)
    }

    /// qgZ's hop inside the node in bf16 from runs the caller's thread made
    /// ([`crate::qgz::bf16_runs`]: `runs`, kept in bf16, member j's run at
    /// j · the length of `sum`): `sum` gets the f32 sum, in member order,
    /// of the run each member sent this rank — [`ByteMover::sum_swizzled`]
    /// of one node's chunks, and by default through it. The runs are taken
    /// and given back for reuse; the host sends each member a slice of
    /// their own buffer, with no copy.
    fn sum_runs_taking(
        &self,
        q: &Q,
        hop: Hop,
        phase: Phase,
        runs: Q::Kept,
        sum: &mut Q::Values,
    ) -> Result<(), ZeroError> {
        self.sum_swizzled(q, hop, phase, &q.kept_as_bf16_tensor(&runs)?, 1, sum)?;
        q.recycle_kept(runs);
        Ok(())
    }

    /// [`ByteMover::sum_swizzled`] once checked: chunks of `chunk` values.
    fn sum_swizzled_unchecked<T: GpuElement>(
        &self,
        q: &Q,
        hop: Hop,
        phase: Phase,
        x: &Q::Tensor<'_, T>,
        nodes_chunk: (usize, usize),
        sum: &mut Q::Values,
    ) -> Result<(), ZeroError>;

    /// Every member's chunks (`mine`, `k` of them) into `all` (`k` · the
    /// group's size chunks, member j's at `j·k`). Checked here
    /// ([`check_all_gather`]); the backend moves
    /// ([`ByteMover::all_gather_unchecked`]).
    fn all_gather(
        &self,
        q: &Q,
        hop: Hop,
        phase: Phase,
        mine: &Q::Chunks,
        all: &mut Q::Chunks,
    ) -> Result<(), ZeroError> {
        let k = check_all_gather(q.shape(mine), q.shape(all), self.size(hop))?;
        self.all_gather_unchecked(hop, phase, (mine, k), all)
    }

    /// Every member's chunks (`mine`, `k` of them) gathered and dequantized
    /// into `out`: chunk i of member j at chunk position `place(j, i)` of
    /// `out` (the group's size · `k` chunks) — [`ByteMover::all_gather`]
    /// then [`Quantizer::dequantize_tensor`] of each, and by default
    /// through them. The host dequantizes each message where it arrived,
    /// with no buffer of every member's chunks.
    fn all_gather_dequantized<T: GpuElement>(
        &self,
        q: &Q,
        (hop, phase): (Hop, Phase),
        mine: &Q::Chunks,
        place: &dyn Fn(usize, usize) -> usize,
        out: &mut Q::TensorMut<'_, T>,
    ) -> Result<(), ZeroError> {
        let (format, chunk, k) = q.shape(mine);
        let members = self.size(hop);
        check_gather_len(k * chunk, q.tensor_mut_len(out), members)?;
        let mut all = q.chunks(format, chunk, k * members)?;
        self.all_gather(q, hop, phase, mine, &mut all)?;
        for j in 0..members {
            for i in 0..k {
                q.dequantize_tensor(&all, j * k + i, out, place(j, i) * chunk)?;
            }
        }
        q.recycle_chunks(all);
        Ok(())
    }

    /// [`ByteMover::all_gather`] once checked: `k` chunks a member.
    fn all_gather_unchecked(
        &self,
        hop: Hop,
        phase: Phase,
        mine: (&Q::Chunks, usize),
        all: &mut Q::Chunks,
    ) -> Result<(), ZeroError>;

    /// Whether every member's `mine` is true (each member learns the same
    /// answer): a byte from each across the group.
    fn all_agree(&self, hop: Hop, phase: Phase, mine: bool) -> Result<bool, ZeroError>;

    /// Every member's values (`mine`) into `all` (the group's size times
    /// as many, member j's at `j · len(mine)`), on the wire in bf16 (round
    /// to nearest even), or in f32 with `fp32`. Checked here
    /// ([`check_gather_len`]); the backend moves
    /// ([`ByteMover::all_gather_values_unchecked`]).
    fn all_gather_values(
        &self,
        q: &Q,
        hop: Hop,
        phase: Phase,
        mine: &Q::Values,
        all: &mut Q::Values,
        fp32: bool,
    ) -> Result<(), ZeroError> {
        check_gather_len(q.len(mine), q.len(all), self.size(hop))?;
        self.all_gather_values_unchecked(hop, phase, mine, all, fp32)
    }

    /// [`ByteMover::all_gather_values`] once checked.
    fn all_gather_values_unchecked(
        &self,
        hop: Hop,
        phase: Phase,
        mine: &Q::Values,
        all: &mut Q::Values,
        fp32: bool,
    ) -> Result<(), ZeroError>;

    /// Every member's `len` kept values (`kept`; on the wire in bf16,
    /// rounded to nearest even, or in f32 with `fp32`) stored straight
    /// into a caller's tensor: member j's values
    /// are `pieces` equal pieces, piece p going to `out[place(j, p)..]`
    /// (rounded to `T`). By default through gathered f32 values and `q`;
    /// the host sends and decodes the kept values in place.
    #[allow(clippy::too_many_arguments)]
    fn all_gather_kept_placed<T: GpuElement>(
        &self,
        q: &Q,
        hop: Hop,
        phase: Phase,
        (kept, len, fp32): (&Q::Kept, usize, bool),
        (pieces, place): (usize, &dyn Fn(usize, usize) -> usize),
        out: &mut Q::TensorMut<'_, T>,
    ) -> Result<(), ZeroError> {
        let members = self.size(hop);
        let piece = check_pieces(len, pieces)?;
        let mut mine = q.values(len)?;
        q.load_kept(kept, 0, &mut mine, 0, len)?;
        let mut all = q.values(members * len)?;
        self.all_gather_values(q, hop, phase, &mine, &mut all, fp32)?;
        for j in 0..members {
            for p in 0..pieces {
                q.store_values(&all, (j * pieces + p) * piece, out, place(j, p), piece)?;
            }
        }
        q.recycle(mine);
        q.recycle(all);
        Ok(())
    }

    /// [`ByteMover::all_gather_values`] into kept values (`kept`: the
    /// group's size times `mine`'s length, member j's at `j · len(mine)`;
    /// bf16 on the wire unless `fp32`, kept as `kept` keeps values). By
    /// default through gathered f32 values; the host decodes in place.
    /// Checked here ([`check_gather_len`]), then
    /// [`ByteMover::all_gather_values_kept_unchecked`].
    fn all_gather_values_kept(
        &self,
        q: &Q,
        hop: Hop,
        phase: Phase,
        mine: &Q::Values,
        kept: &mut Q::Kept,
        fp32: bool,
    ) -> Result<(), ZeroError> {
        check_gather_len(q.len(mine), q.kept_len(kept), self.size(hop))?;
        self.all_gather_values_kept_unchecked(q, hop, phase, mine, kept, fp32)
    }

    /// [`ByteMover::all_gather_values_kept`] once checked.
    fn all_gather_values_kept_unchecked(
        &self,
        q: &Q,
        hop: Hop,
        phase: Phase,
        mine: &Q::Values,
        kept: &mut Q::Kept,
        fp32: bool,
    ) -> Result<(), ZeroError> {
        let len = q.len(mine) * self.size(hop);
        let mut all = q.values(len)?;
        self.all_gather_values(q, hop, phase, mine, &mut all, fp32)?;
        q.store_kept(&all, 0, kept, 0, len)?;
        q.recycle(all);
        Ok(())
    }

    /// ZeRO-3's gather: every member's `mine` (a caller's tensor) into
    /// `all` (the group's size times as long, member j's at
    /// `j · len(mine)`), the bytes as they are. Checked here
    /// ([`check_gather_len`]); the backend moves
    /// ([`ByteMover::all_gather_tensor_unchecked`]).
    fn all_gather_tensor<T: GpuElement>(
        &self,
        q: &Q,
        hop: Hop,
        phase: Phase,
        mine: &Q::Tensor<'_, T>,
        all: &mut Q::TensorMut<'_, T>,
    ) -> Result<(), ZeroError> {
        check_gather_len(q.tensor_len(mine), q.tensor_mut_len(all), self.size(hop))?;
        self.all_gather_tensor_unchecked(hop, phase, mine, all)
    }

    /// [`ByteMover::all_gather_tensor`] once checked.
    fn all_gather_tensor_unchecked<T: GpuElement>(
        &self,
        hop: Hop,
        phase: Phase,
        mine: &Q::Tensor<'_, T>,
        all: &mut Q::TensorMut<'_, T>,
    ) -> Result<(), ZeroError>;

    /// [`ByteMover::all_gather_tensor`] with bf16 on the wire: `mine`'s
    /// values rounded to nearest even, and widened back to `T` in `all`.
    /// By default through gathered f32 values and `q`
    /// ([`all_gather_tensor_bf16_by_values`]); the host encodes and decodes
    /// in place. Checked here ([`check_gather_len`]), then
    /// [`ByteMover::all_gather_tensor_bf16_unchecked`].
    fn all_gather_tensor_bf16<T: GpuElement>(
        &self,
        q: &Q,
        hop: Hop,
        phase: Phase,
        mine: &Q::Tensor<'_, T>,
        all: &mut Q::TensorMut<'_, T>,
    ) -> Result<(), ZeroError>
    where
        Self: Sized,
    {
        check_gather_len(q.tensor_len(mine), q.tensor_mut_len(all), self.size(hop))?;
        self.all_gather_tensor_bf16_unchecked(q, hop, phase, mine, all)
    }

    /// [`ByteMover::all_gather_tensor_bf16`] once checked.
    fn all_gather_tensor_bf16_unchecked<T: GpuElement>(
        &self,
        q: &Q,
        hop: Hop,
        phase: Phase,
        mine: &Q::Tensor<'_, T>,
        all: &mut Q::TensorMut<'_, T>,
    ) -> Result<(), ZeroError>
    where
        Self: Sized,
    {
        all_gather_tensor_bf16_by_values(self, q, (hop, phase), mine, all)
    }

    /// ZeRO-3's reduce-scatter of f32 values the call takes (and gives
    /// back to the pools once sent): `grad` (the group's size equal
    /// chunks, member order) summed over the members in f32; this member's
    /// chunk of the sum (with `mean`, divided by the group's size), as the
    /// native engine keeps it. By default through
    /// [`ByteMover::reduce_scatter_tensor`]; the host's ring sends from the
    /// values' own buffer.
    fn reduce_scatter_taking(
        &self,
        q: &Q,
        (hop, phase): (Hop, Phase),
        grad: Q::Values,
        mean: bool,
    ) -> Result<Q::Values, ZeroError> {
        let (len, members) = (q.len(&grad), self.size(hop));
        check_scatter_len(len, len / members.max(1), members)?;
        let mut out = q.values_for_overwrite(len / members)?;
        {
            let (x, mut o) = (q.values_as_tensor(&grad), q.values_as_tensor_mut(&mut out));
            self.reduce_scatter_tensor(q, hop, phase, &x, &mut o, mean)?;
        }
        q.recycle(grad);
        Ok(out)
    }

    /// [`ByteMover::reduce_scatter_taking`] of kept values: on the host
    /// summed in the dtype they were kept in (bf16 ones in a bf16 ring,
    /// each partial sum rounded to bf16), sent from their own buffer; by
    /// default widened to f32 values and summed in f32.
    fn reduce_scatter_kept(
        &self,
        q: &Q,
        (hop, phase): (Hop, Phase),
        grad: Q::Kept,
        mean: bool,
    ) -> Result<Q::Values, ZeroError> {
        let len = q.kept_len(&grad);
        let mut values = q.values_for_overwrite(len)?;
        q.load_kept(&grad, 0, &mut values, 0, len)?;
        q.recycle_kept(grad);
        self.reduce_scatter_taking(q, (hop, phase), values, mean)
    }

    /// ZeRO-3's reduce-scatter: `x` (the group's size equal chunks, member
    /// order) summed over the members, this member's chunk into `out`; with
    /// `mean`, divided by the group's size (by `q`, or inside the reduction
    /// where the transport offers an average). The host sums bf16 tensors
    /// in a bf16 ring and others in f32; NCCL sums in `T`. Checked here
    /// ([`check_scatter_len`]); the backend sums
    /// ([`ByteMover::reduce_scatter_tensor_unchecked`]).
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_tensor<T: GpuElement>(
        &self,
        q: &Q,
        hop: Hop,
        phase: Phase,
        x: &Q::Tensor<'_, T>,
        out: &mut Q::TensorMut<'_, T>,
        mean: bool,
    ) -> Result<(), ZeroError> {
        check_scatter_len(q.tensor_len(x), q.tensor_mut_len(out), self.size(hop))?;
        self.reduce_scatter_tensor_unchecked(q, hop, phase, x, out, mean)
    }

    /// [`ByteMover::reduce_scatter_tensor`] once checked.
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_tensor_unchecked<T: GpuElement>(
        &self,
        q: &Q,
        hop: Hop,
        phase: Phase,
        x: &Q::Tensor<'_, T>,
        out: &mut Q::TensorMut<'_, T>,
        mean: bool,
    ) -> Result<(), ZeroError>;
}

/// [`ByteMover::all_gather_tensor_bf16`] through `q`'s f32 values: `mine`
/// loaded, gathered with [`ByteMover::all_gather_values`] (bf16 on the
/// wire), stored into `all`.
pub fn all_gather_tensor_bf16_by_values<Q: Quantizer, M: ByteMover<Q>, T: GpuElement>(
    m: &M,
    q: &Q,
    (hop, phase): (Hop, Phase),
    mine: &Q::Tensor<'_, T>,
    all: &mut Q::TensorMut<'_, T>,
) -> Result<(), ZeroError> {
    let (len, members) = (q.tensor_len(mine), m.size(hop));
    check_gather_len(len, q.tensor_mut_len(all), members)?;
    let mut values = q.values_for_overwrite(len)?;
    q.load_tensor(mine, &mut values, 0)?;
    let mut gathered = q.values_for_overwrite(members * len)?;
    m.all_gather_values(q, hop, phase, &values, &mut gathered, false)?;
    q.store_values(&gathered, 0, all, 0, members * len)?;
    q.recycle(values);
    q.recycle(gathered);
    Ok(())
}

/// Checks a plain gather of `mine` values into `all` over `members` ranks.
pub fn check_gather_len(mine: usize, all: usize, members: usize) -> Result<(), ZeroError> {
    if all == mine * members {
        return Ok(());
    }
    Err(ZeroError::Invalid(format!(
        "an all-gather of {mine} values over {members} ranks does not fill {all} values"
    )))
}

/// Checks [`ByteMover::sum_swizzled`]'s lengths: `x` of `nodes` ·
/// `members` equal chunks, `sum` of `nodes` of them; the chunk's length.
pub fn check_swizzled(
    x: usize,
    sum: usize,
    nodes: usize,
    members: usize,
) -> Result<usize, ZeroError> {
    if nodes > 0 && sum.is_multiple_of(nodes) && x == sum * members {
        return Ok(sum / nodes);
    }
    Err(ZeroError::Invalid(format!(
        "a swizzled reduce-scatter of {x} values over {nodes} nodes x {members} ranks does not \
         fill {sum} values"
    )))
}

/// A gradient value qgZ's bf16 hop inside the node refuses to send (`at`:
/// where it is).
pub fn not_finite_gradient(at: &str, value: f32) -> ZeroError {
    ZeroError::Invalid(format!(
        "the gradient's value {value} at {at} is not finite; qgZ sends it inside the node in \
         bf16 and sums it in f32 — find where the NaN/Inf came from (a diverging loss, an \
         uninitialised buffer) and fix it upstream"
    ))
}

/// Kept values that should have been kept in bf16 (a caller's bf16
/// tensor of them was asked for).
pub fn not_bf16() -> ZeroError {
    ZeroError::Invalid(
        "values kept in f32 (or in host memory beside a device) were read as a bf16 tensor: \
         keep them in bf16 (Quantizer::kept with bf16) on the device that reads them"
            .into(),
    )
}

/// Checks that `len` values split into `pieces` equal pieces; their length.
pub fn check_pieces(len: usize, pieces: usize) -> Result<usize, ZeroError> {
    if pieces > 0 && len.is_multiple_of(pieces) {
        return Ok(len / pieces);
    }
    Err(ZeroError::Invalid(format!(
        "{len} values do not split into {pieces} equal pieces"
    )))
}

/// Checks a plain reduce-scatter of `x` values into `out` over `members`
/// ranks (`members` equal chunks).
pub fn check_scatter_len(x: usize, out: usize, members: usize) -> Result<(), ZeroError> {
    if x == out * members {
        return Ok(());
    }
    Err(ZeroError::Invalid(format!(
        "a reduce-scatter of {x} values over {members} ranks needs an output of {} values, \
         not {out}",
        x / members.max(1)
    )))
}

/// A chunked buffer's `(format, chunk_len, count)`, as
/// [`Quantizer::shape`] gives it.
pub type Shape = (QuantFormat, usize, usize);

fn same_chunks(what: &str, a: Shape, b: Shape) -> Result<(), ZeroError> {
    if (a.0, a.1) == (b.0, b.1) {
        Ok(())
    } else {
        Err(ZeroError::Invalid(format!(
            "{what}: chunks of {} values in {} into chunks of {} in {}",
            a.1, a.0, b.1, b.0
        )))
    }
}

/// Checks that values `at..at + len` lie in a buffer of `have` values
/// (`what`: the operation, in the error).
pub fn check_span(have: usize, at: usize, len: usize, what: &str) -> Result<(), ZeroError> {
    match at.checked_add(len) {
        Some(end) if end <= have => Ok(()),
        _ => Err(ZeroError::Invalid(format!(
            "{what}: values {at}..{} of a buffer of {have}",
            at.saturating_add(len)
        ))),
    }
}

/// Checks that chunk `i` exists in a buffer of `shape`.
pub fn check_chunk(shape: Shape, i: usize, what: &str) -> Result<(), ZeroError> {
    if i < shape.2 {
        Ok(())
    } else {
        Err(ZeroError::Invalid(format!(
            "{what}: chunk {i} of {} chunks",
            shape.2
        )))
    }
}

/// Checks a copy of chunk `i` of `src` into chunk `j` of `dst`.
pub fn check_copy_chunk(src: Shape, i: usize, dst: Shape, j: usize) -> Result<(), ZeroError> {
    check_chunk(src, i, "copying a chunk")?;
    check_chunk(dst, j, "copying a chunk")?;
    same_chunks("copying a chunk", src, dst)
}

/// Checks that `m`'s node and cross groups are `layout`'s, for
/// `collective` (its name in the error).
pub fn check_hops<Q: Quantizer>(
    m: &impl ByteMover<Q>,
    layout: crate::layout::Layout,
    collective: &'static str,
) -> Result<(), ZeroError> {
    let (node, cross) = (m.size(Hop::Node), m.size(Hop::Cross));
    if node == layout.ranks_per_node && cross == layout.nodes {
        return Ok(());
    }
    Err(ZeroError::Hops {
        collective,
        nodes: layout.nodes,
        ranks_per_node: layout.ranks_per_node,
        node,
        cross,
    })
}

/// Checks an all-to-all of `send` into `recv` over `members` ranks (the
/// same chunks, as many of them, a whole number per member); the chunks
/// each member gets.
pub fn check_all_to_all(send: Shape, recv: Shape, members: usize) -> Result<usize, ZeroError> {
    same_chunks("all-to-all", send, recv)?;
    if send.2 != recv.2 || members == 0 || !send.2.is_multiple_of(members) {
        return Err(ZeroError::Invalid(format!(
            "all-to-all of {} chunks into {} over {members} ranks",
            send.2, recv.2
        )));
    }
    Ok(send.2 / members)
}

/// Checks an all-gather of `mine` into `all` over `members` ranks (the
/// same chunks, `members` times as many); the chunks each member sends.
pub fn check_all_gather(mine: Shape, all: Shape, members: usize) -> Result<usize, ZeroError> {
    same_chunks("all-gather", mine, all)?;
    if all.2 != mine.2 * members {
        return Err(ZeroError::Invalid(format!(
            "all-gather of {} chunks over {members} ranks into {} chunks",
            mine.2, all.2
        )));
    }
    Ok(mine.2)
}

/// The share of a quantized chunk's bytes that are block scales: what the
/// byte counters report apart.
pub fn scale_fraction(format: QuantFormat, chunk_len: usize) -> f64 {
    format.param_bytes(chunk_len) as f64 / format.total_bytes(chunk_len).max(1) as f64
}

/// [`Quantizer::quantize_swizzled_kept`] as the kernels one after another:
/// every residual chunk added to `x`, the swizzled quantization, then per
/// chunk what it dropped (dequantized, subtracted, quantized again).
pub fn swizzled_kept_composed<Q: Quantizer + ?Sized>(
    q: &Q,
    x: &mut Q::Values,
    (nodes, ranks_per_node): (usize, usize),
    rounding: Rounding,
    out: &mut Q::Chunks,
    residual: &mut Q::Chunks,
) -> Result<(), ZeroError> {
    let (_, chunk, count) = q.shape(residual);
    for r in 0..count {
        q.dequantize_accumulate(residual, r, x, r * chunk)?;
    }
    q.quantize_swizzled(x, nodes, ranks_per_node, rounding, out)?;
    let mut lost = q.values_for_overwrite(chunk)?;
    for p in 0..count {
        let r = zeropp_quant::swizzled_rank(p, nodes, ranks_per_node);
        q.dequantize(out, p, &mut lost, 0)?;
        q.dropped(&mut lost, 0, x, r * chunk, chunk)?;
        q.quantize_chunk(&lost, 0, Rounding::NearestEven, residual, r)?;
    }
    q.recycle(lost);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emulated::Emulated;
    use crate::host::Host;
    use zeropp_quant::{QuantFormat, Rounding};

    /// The front door's refusals, the same for every backend: they are
    /// the trait's, not each backend's.
    fn refusals<Q>(q: &Q) -> Vec<String>
    where
        Q: for<'a> Quantizer<
                Values = Vec<f32>,
                Tensor<'a, f32> = &'a [f32],
                TensorMut<'a, f32> = &'a mut [f32],
            >,
    {
        let format = QuantFormat::int4(32).unwrap();
        let mut out = q.chunks(format, 32, 2).unwrap();
        let other = q.chunks(QuantFormat::int4(64).unwrap(), 32, 2).unwrap();
        let x = vec![0.5f32; 40];
        let mut sum = vec![0f32; 40];
        let mut tensor = [0f32; 40];
        let mut kept = q.kept(40, false).unwrap();
        let r = Rounding::NearestEven;
        let errors = [
            q.quantize_chunk(&x, 0, r, &mut out, 2),
            q.quantize_chunk(&x, 16, r, &mut out, 1),
            q.dequantize_accumulate(&out, 0, &mut sum, 9),
            q.sum_requantize(&other, &[0, 5], r, &mut out, 0),
            q.sum_requantize(&other, &[0, 1], r, &mut out, 2),
            q.copy_chunk(&other, 0, &mut out, 1),
            q.copy(&x, 30, &mut sum, 0, 16),
            q.same(&x, 0, &sum, 39, 2).map(|_| ()),
            q.dropped(&mut sum, 35, &x, 0, 8),
            q.rotate(&mut sum, 8, 64, 32),
            q.load_kept(&kept, 30, &mut sum, 0, 16),
            q.store_kept(&x, 0, &mut kept, 35, 8),
            q.quantize_tensor::<f32>(&&x[..31], r, &mut out, 0),
            q.dequantize_tensor::<f32>(&out, 0, &mut &mut tensor[..], 20),
            q.load_tensor::<f32>(&&x[..], &mut sum, 1),
            q.store_values::<f32>(&x, 0, &mut &mut tensor[..], 38, 4),
            q.dequantize(&out, 1, &mut sum, 9),
        ];
        // In range, the same calls work.
        q.quantize_chunk(&x, 8, r, &mut out, 1).unwrap();
        q.dequantize_accumulate(&out, 1, &mut sum, 8).unwrap();
        assert!(sum[8..].iter().all(|v| (v - 0.5).abs() < 0.1), "{sum:?}");
        errors
            .into_iter()
            .map(|e| e.unwrap_err().to_string())
            .collect()
    }

    /// `round_bf16` as the default does it: through bf16 kept values.
    fn through_kept<Q: Quantizer<Values = Vec<f32>>>(q: &Q, x: &[f32]) -> Vec<u32> {
        let mut kept = q.kept(x.len(), true).unwrap();
        let mut out = x.to_vec();
        q.store_kept(&out, 0, &mut kept, 0, x.len()).unwrap();
        q.load_kept(&kept, 0, &mut out, 0, x.len()).unwrap();
        out.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn rounding_to_bf16_in_place_is_what_bf16_kept_values_give() {
        // Ties, subnormals, infinities, the largest finite values and a
        // long run (the pooled buffer), on both host backends.
        let mut x: Vec<f32> = vec![
            1.0 + f32::EPSILON * 64.0,
            f32::from_bits(0x4040_8000),
            f32::from_bits(0xC041_8000),
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            -0.0,
        ];
        x.extend((0..5000).map(|i| ((i as f32) * 0.731).sin() * 1e3));
        for rounded in [
            {
                let mut y = x.clone();
                Host.round_bf16(&mut y).unwrap();
                y
            },
            {
                let mut y = x.clone();
                Emulated.round_bf16(&mut y).unwrap();
                y
            },
        ] {
            let bits: Vec<u32> = rounded.iter().map(|v| v.to_bits()).collect();
            assert_eq!(bits, through_kept(&Host, &x));
        }
    }

    /// A mover whose moving parts must never run: every call that reaches
    /// one was let through the trait's front door.
    struct Unreachable;

    impl ByteMover<Host> for Unreachable {
        fn size(&self, _: Hop) -> usize {
            2
        }
        fn all_to_all_unchecked(
            &self,
            _: Hop,
            _: Phase,
            _: (&zeropp_quant::QuantizedChunks, usize),
            _: &mut zeropp_quant::QuantizedChunks,
        ) -> Result<(), ZeroError> {
            unreachable!("all_to_all let through")
        }
        fn sum_swizzled_unchecked<T: GpuElement>(
            &self,
            _: &Host,
            _: Hop,
            _: Phase,
            _: &&[T],
            _: (usize, usize),
            _: &mut Vec<f32>,
        ) -> Result<(), ZeroError> {
            unreachable!("sum_swizzled let through")
        }
        fn all_gather_unchecked(
            &self,
            _: Hop,
            _: Phase,
            _: (&zeropp_quant::QuantizedChunks, usize),
            _: &mut zeropp_quant::QuantizedChunks,
        ) -> Result<(), ZeroError> {
            unreachable!("all_gather let through")
        }
        fn all_agree(&self, _: Hop, _: Phase, _: bool) -> Result<bool, ZeroError> {
            unreachable!("all_agree")
        }
        fn all_gather_values_unchecked(
            &self,
            _: Hop,
            _: Phase,
            _: &Vec<f32>,
            _: &mut Vec<f32>,
            _: bool,
        ) -> Result<(), ZeroError> {
            unreachable!("all_gather_values let through")
        }
        fn all_gather_tensor_unchecked<T: GpuElement>(
            &self,
            _: Hop,
            _: Phase,
            _: &&[T],
            _: &mut &mut [T],
        ) -> Result<(), ZeroError> {
            unreachable!("all_gather_tensor let through")
        }
        fn reduce_scatter_tensor_unchecked<T: GpuElement>(
            &self,
            _: &Host,
            _: Hop,
            _: Phase,
            _: &&[T],
            _: &mut &mut [T],
            _: bool,
        ) -> Result<(), ZeroError> {
            unreachable!("reduce_scatter_tensor let through")
        }
    }

    #[test]
    fn a_movers_calls_are_checked_at_the_front_door() {
        let (m, q, (h, p)) = (Unreachable, Host, (Hop::World, Phase::Other));
        let f = QuantFormat::int4(32).unwrap();
        let three = q.chunks(f, 32, 3).unwrap();
        let (mut two, mut five) = (q.chunks(f, 32, 2).unwrap(), q.chunks(f, 32, 5).unwrap());
        let (x, mut y) = (vec![1f32; 10], vec![0f32; 19]);
        let (mut odd, mut kept) = (vec![0f32; 7], q.kept(19, true).unwrap());
        let got = [
            m.all_to_all(&q, h, p, &three, &mut five).unwrap_err(),
            m.all_gather(&q, h, p, &three, &mut two).unwrap_err(),
            m.all_gather_values(&q, h, p, &x, &mut y, false)
                .unwrap_err(),
            m.all_gather_values_kept(&q, h, p, &x, &mut kept, false)
                .unwrap_err(),
            m.all_gather_tensor(&q, h, p, &&x[..], &mut &mut y[..])
                .unwrap_err(),
            m.all_gather_tensor_bf16(&q, h, p, &&x[..], &mut &mut y[..])
                .unwrap_err(),
            m.reduce_scatter_tensor(&q, h, p, &&x[..], &mut &mut odd[..], true)
                .unwrap_err(),
            m.sum_swizzled(&q, h, p, &&x[..], 2, &mut odd).unwrap_err(),
        ];
        for e in &got {
            assert!(e.to_string().starts_with("invalid call: "), "{e}");
        }
    }

    #[test]
    fn calls_are_checked_once_at_the_front_door_for_every_backend() {
        let host = refusals(&Host);
        assert_eq!(host, refusals(&Emulated));
        assert_eq!(
            host,
            [
                "invalid call: quantizing a chunk: chunk 2 of 2 chunks",
                "invalid call: quantizing a chunk: values 16..48 of a buffer of 40",
                "invalid call: summing a chunk: values 9..41 of a buffer of 40",
                "invalid call: summing chunks: chunk 5 of 2 chunks",
                "invalid call: requantizing a sum: chunk 2 of 2 chunks",
                "invalid call: copying a chunk: chunks of 32 values in int4-sym-b64 into chunks of 32 \
                 in int4-sym-b32",
                "invalid call: copy: values 30..46 of a buffer of 40",
                "invalid call: comparing: values 39..41 of a buffer of 40",
                "invalid call: error feedback: values 35..43 of a buffer of 40",
                "invalid call: a Hadamard rotation: values 8..72 of a buffer of 40",
                "invalid call: loading kept values: values 30..46 of a buffer of 40",
                "invalid call: keeping values: values 35..43 of a buffer of 40",
                "invalid call: quantizing a tensor of 31 values into chunks of 32",
                "invalid call: dequantizing a chunk: values 20..52 of a buffer of 40",
                "invalid call: loading a tensor: values 1..41 of a buffer of 40",
                "invalid call: storing values: values 38..42 of a buffer of 40",
                "invalid call: dequantizing a chunk: values 9..41 of a buffer of 40",
            ]
        );
    }
}
