//! The CUDA backend: [`Gpu`] quantizes with zeropp-cuda's kernels on device
//! buffers, [`NcclMover`] moves chunks with NCCL on the same stream and
//! counts them in the host job's [`CountingTransport`]. The collectives
//! (`zero::qgz`, ...) run on it as they run on the host, and the device
//! job ([`crate::device_job`]) on `Gpu` as its [`Device`], with
//! [`CudaQueue`] as its order of work. On CUDA a launched call's host side
//! returns once its kernels have reported bad input and its NCCL
//! collectives have finished within the job's deadline; what follows the
//! last of them (a scaling kernel, the frees) stays queued on the stream,
//! behind the event its Work's wait makes the caller's stream wait on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use zeropp_comm::CommError;
use zeropp_cuda::cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, DriverError, sys,
};
use zeropp_cuda::device::{DeviceQuantizedChunks, QuantView, QuantViewMut};
use zeropp_cuda::nccl::{NcclComm, NcclId};
use zeropp_cuda::{Borrowed, CudaError, Gpu, GpuElement};
use zeropp_quant::{QuantFormat, Rounding};

use crate::backend::{ByteMover, Hop, Quantizer, not_bf16, scale_fraction};
use crate::devices::{Comms, Device, TensorMutOf, TensorOf};
use crate::error::ZeroError;
use crate::host::{Host, Kept};
use crate::layout::Layout;
use crate::traffic::{CountingTransport, Phase};
use crate::work::{Outcome, Queue};

/// f32 values on the device: a buffer of zeropp's, or a caller's tensor
/// borrowed for the call.
pub enum DeviceValues {
    Owned(CudaSlice<f32>),
    Borrowed(Borrowed<f32>),
}

impl DeviceValues {
    pub fn len(&self) -> usize {
        match self {
            DeviceValues::Owned(s) => s.len(),
            DeviceValues::Borrowed(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn view(&self) -> CudaView<'_, f32> {
        match self {
            DeviceValues::Owned(s) => s.as_view(),
            DeviceValues::Borrowed(b) => b.view(),
        }
    }

    pub fn view_mut(&mut self) -> CudaViewMut<'_, f32> {
        match self {
            DeviceValues::Owned(s) => s.as_view_mut(),
            DeviceValues::Borrowed(b) => b.view_mut(),
        }
    }
}

/// Code bytes, block maxima and minima per chunk.
fn strides(c: &DeviceQuantizedChunks) -> (usize, usize, usize) {
    (
        c.format.code_bytes(c.chunk_len),
        c.format.num_blocks(c.chunk_len),
        c.format.num_block_mins(c.chunk_len),
    )
}

/// Chunk `i` of a chunked quantized buffer, as a view.
fn chunk_view(c: &DeviceQuantizedChunks, i: usize) -> QuantView<'_> {
    let (cb, nb, nm) = strides(c);
    QuantView {
        format: c.format,
        len: c.chunk_len,
        codes: c.codes.slice(i * cb..(i + 1) * cb),
        block_max: c.block_max.slice(i * nb..(i + 1) * nb),
        block_min: c.block_min.slice(i * nm..(i + 1) * nm),
    }
}

fn chunk_view_mut(c: &mut DeviceQuantizedChunks, i: usize) -> QuantViewMut<'_> {
    let (cb, nb, nm) = strides(c);
    QuantViewMut {
        format: c.format,
        len: c.chunk_len,
        codes: c.codes.slice_mut(i * cb..(i + 1) * cb),
        block_max: c.block_max.slice_mut(i * nb..(i + 1) * nb),
        block_min: c.block_min.slice_mut(i * nm..(i + 1) * nm),
    }
}

/// Values kept between calls ([`Quantizer::Kept`]): on the device, or in
/// host memory ([`Quantizer::kept_on_host`]), copied to and from the
/// device as they are loaded and stored (kept alike: the host rounds to
/// bf16 as the device does, to nearest even).
pub enum DeviceKept {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<half::bf16>),
    Host(Kept),
}

impl DeviceKept {
    pub fn len(&self) -> usize {
        match self {
            DeviceKept::F32(s) => s.len(),
            DeviceKept::Bf16(s) => s.len(),
            DeviceKept::Host(k) => k.len(),
        }
    }

    /// Whether they are kept in host memory.
    pub fn on_host(&self) -> bool {
        matches!(self, DeviceKept::Host(_))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Quantizer for Gpu {
    type Values = DeviceValues;
    type Chunks = DeviceQuantizedChunks;
    type Tensor<'a, T: GpuElement + 'a> = CudaView<'a, T>;
    type TensorMut<'a, T: GpuElement + 'a> = CudaViewMut<'a, T>;
    type Kept = DeviceKept;

    fn same_unchecked(
        &self,
        x: &DeviceValues,
        at_x: usize,
        y: &DeviceValues,
        at_y: usize,
        len: usize,
    ) -> Result<bool, ZeroError> {
        let (xv, yv) = (x.view(), y.view());
        let a = self.download(&xv.slice(at_x..at_x + len))?;
        let b = self.download(&yv.slice(at_y..at_y + len))?;
        Ok(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()))
    }

    fn kept(&self, len: usize, bf16: bool) -> Result<DeviceKept, ZeroError> {
        Ok(if bf16 {
            DeviceKept::Bf16(self.zeros::<half::bf16>(len)?)
        } else {
            DeviceKept::F32(self.zeros::<f32>(len)?)
        })
    }

    fn kept_on_host(&self, len: usize, bf16: bool) -> Result<DeviceKept, ZeroError> {
        Ok(DeviceKept::Host(Host.kept(len, bf16)?))
    }

    fn kept_len(&self, k: &DeviceKept) -> usize {
        k.len()
    }

    fn load_kept_unchecked(
        &self,
        k: &DeviceKept,
        at_k: usize,
        out: &mut DeviceValues,
        at: usize,
        len: usize,
    ) -> Result<(), ZeroError> {
        let mut o = out.view_mut();
        let mut o = o.slice_mut(at..at + len);
        match k {
            DeviceKept::F32(s) => Gpu::copy(self, &s.slice(at_k..at_k + len), &mut o)?,
            DeviceKept::Bf16(s) => self.widen(&s.slice(at_k..at_k + len), &mut o)?,
            DeviceKept::Host(k) => {
                let up = self.upload(&k.to_f32(at_k, len)?)?;
                Gpu::copy(self, &up.slice(0..len), &mut o)?
            }
        }
        Ok(())
    }

    fn store_kept_unchecked(
        &self,
        x: &DeviceValues,
        at: usize,
        k: &mut DeviceKept,
        at_k: usize,
        len: usize,
    ) -> Result<(), ZeroError> {
        let src = x.view();
        let src = src.slice(at..at + len);
        match k {
            DeviceKept::F32(s) => Gpu::copy(self, &src, &mut s.slice_mut(at_k..at_k + len))?,
            DeviceKept::Bf16(s) => self.narrow(&src, &mut s.slice_mut(at_k..at_k + len))?,
            DeviceKept::Host(k) => {
                let values = self.download(&src)?;
                Host.store_kept(&values, 0, k, at_k, len)?
            }
        }
        Ok(())
    }

    fn tensor_len<T: GpuElement>(&self, x: &CudaView<'_, T>) -> usize {
        x.len()
    }

    fn tensor_mut_len<T: GpuElement>(&self, x: &CudaViewMut<'_, T>) -> usize {
        x.len()
    }

    fn load_tensor_unchecked<T: GpuElement>(
        &self,
        x: &CudaView<'_, T>,
        out: &mut DeviceValues,
        at: usize,
    ) -> Result<(), ZeroError> {
        let mut o = out.view_mut();
        Ok(self.widen(x, &mut o.slice_mut(at..at + x.len()))?)
    }

    fn store_values_unchecked<T: GpuElement>(
        &self,
        x: &DeviceValues,
        at_x: usize,
        out: &mut CudaViewMut<'_, T>,
        at_out: usize,
        len: usize,
    ) -> Result<(), ZeroError> {
        let src = x.view();
        Ok(self.narrow(
            &src.slice(at_x..at_x + len),
            &mut out.slice_mut(at_out..at_out + len),
        )?)
    }

    fn quantize_tensor_unchecked<T: GpuElement>(
        &self,
        x: &CudaView<'_, T>,
        rounding: Rounding,
        out: &mut DeviceQuantizedChunks,
        i: usize,
    ) -> Result<(), ZeroError> {
        Ok(self.quantize_view(x, rounding, &mut chunk_view_mut(out, i))?)
    }

    fn dequantize_tensor_unchecked<T: GpuElement>(
        &self,
        q: &DeviceQuantizedChunks,
        i: usize,
        out: &mut CudaViewMut<'_, T>,
        at: usize,
    ) -> Result<(), ZeroError> {
        let len = q.chunk_len;
        Ok(self.dequantize_view(&chunk_view(q, i), &mut out.slice_mut(at..at + len))?)
    }

    fn copy_chunk_unchecked(
        &self,
        src: &DeviceQuantizedChunks,
        i: usize,
        dst: &mut DeviceQuantizedChunks,
        j: usize,
    ) -> Result<(), ZeroError> {
        let (from, mut to) = (chunk_view(src, i), chunk_view_mut(dst, j));
        Gpu::copy(self, &from.codes, &mut to.codes)?;
        Gpu::copy(self, &from.block_max, &mut to.block_max)?;
        Gpu::copy(self, &from.block_min, &mut to.block_min)?;
        Ok(())
    }

    fn values(&self, len: usize) -> Result<DeviceValues, ZeroError> {
        Ok(DeviceValues::Owned(self.zeros::<f32>(len)?))
    }

    fn len(&self, x: &DeviceValues) -> usize {
        x.len()
    }

    fn values_as_tensor<'a>(&self, x: &'a DeviceValues) -> CudaView<'a, f32> {
        x.view()
    }

    fn values_as_tensor_mut<'a>(&self, x: &'a mut DeviceValues) -> CudaViewMut<'a, f32> {
        x.view_mut()
    }

    fn kept_as_bf16_tensor<'a>(
        &self,
        k: &'a DeviceKept,
    ) -> Result<CudaView<'a, half::bf16>, ZeroError> {
        match k {
            DeviceKept::Bf16(s) => Ok(s.as_view()),
            DeviceKept::F32(_) | DeviceKept::Host(_) => Err(not_bf16()),
        }
    }

    fn chunks(
        &self,
        format: QuantFormat,
        chunk_len: usize,
        count: usize,
    ) -> Result<DeviceQuantizedChunks, ZeroError> {
        Ok(DeviceQuantizedChunks::zeroed(
            self, format, chunk_len, count,
        )?)
    }

    fn shape(&self, q: &DeviceQuantizedChunks) -> (QuantFormat, usize, usize) {
        (q.format, q.chunk_len, q.count)
    }

    fn copy_unchecked(
        &self,
        y: &DeviceValues,
        at_y: usize,
        x: &mut DeviceValues,
        at_x: usize,
        len: usize,
    ) -> Result<(), ZeroError> {
        let src = y.view();
        let mut dst = x.view_mut();
        Ok(Gpu::copy(
            self,
            &src.slice(at_y..at_y + len),
            &mut dst.slice_mut(at_x..at_x + len),
        )?)
    }

    fn quantize_swizzled(
        &self,
        x: &DeviceValues,
        nodes: usize,
        ranks_per_node: usize,
        rounding: Rounding,
        out: &mut DeviceQuantizedChunks,
    ) -> Result<(), ZeroError> {
        Ok(Gpu::quantize_swizzled(
            self,
            &x.view(),
            nodes,
            ranks_per_node,
            rounding,
            out,
        )?)
    }

    fn quantize_chunk_unchecked(
        &self,
        x: &DeviceValues,
        at: usize,
        rounding: Rounding,
        out: &mut DeviceQuantizedChunks,
        i: usize,
    ) -> Result<(), ZeroError> {
        let len = out.chunk_len;
        let src = x.view();
        Ok(self.quantize_view(
            &src.slice(at..at + len),
            rounding,
            &mut chunk_view_mut(out, i),
        )?)
    }

    fn dequantize_unchecked(
        &self,
        q: &DeviceQuantizedChunks,
        i: usize,
        out: &mut DeviceValues,
        at: usize,
    ) -> Result<(), ZeroError> {
        let mut dst = out.view_mut();
        Ok(self.dequantize_view(&chunk_view(q, i), &mut dst.slice_mut(at..at + q.chunk_len))?)
    }

    fn dequantize_accumulate_unchecked(
        &self,
        q: &DeviceQuantizedChunks,
        i: usize,
        out: &mut DeviceValues,
        at: usize,
    ) -> Result<(), ZeroError> {
        let mut dst = out.view_mut();
        Ok(self.dequantize_accumulate_view(
            &chunk_view(q, i),
            &mut dst.slice_mut(at..at + q.chunk_len),
        )?)
    }

    fn sum_requantize_unchecked(
        &self,
        q: &DeviceQuantizedChunks,
        inputs: &[usize],
        rounding: Rounding,
        out: &mut DeviceQuantizedChunks,
        o: usize,
    ) -> Result<(), ZeroError> {
        let views: Vec<QuantView<'_>> = inputs.iter().map(|&i| chunk_view(q, i)).collect();
        Ok(self.sum_requantize_views(&views, rounding, &mut chunk_view_mut(out, o))?)
    }

    fn dropped_unchecked(
        &self,
        x: &mut DeviceValues,
        at_x: usize,
        y: &DeviceValues,
        at_y: usize,
        len: usize,
    ) -> Result<(), ZeroError> {
        let src = y.view();
        let mut dst = x.view_mut();
        // −1·x + 1·y: each product exact, one rounding, as the CPU's y − x.
        Ok(self.axpby(
            &mut dst.slice_mut(at_x..at_x + len),
            &src.slice(at_y..at_y + len),
            -1.0,
            1.0,
        )?)
    }

    fn rotate_unchecked(
        &self,
        x: &mut DeviceValues,
        at: usize,
        len: usize,
        block: usize,
    ) -> Result<(), ZeroError> {
        let mut v = x.view_mut();
        Ok(self.hadamard(&mut v.slice_mut(at..at + len), block)?)
    }

    fn divide(&self, x: &mut DeviceValues, d: f32) -> Result<(), ZeroError> {
        Ok(Gpu::divide(self, &mut x.view_mut(), d)?)
    }
}

/// Moves chunks with NCCL on the device's stream, within this rank's
/// groups (the world, its node, its ranks across nodes), and counts what
/// it sends in the host job's counters, as the host transports count.
pub struct NcclMover<'a> {
    pub world: &'a NcclComm,
    pub node: &'a NcclComm,
    pub cross: &'a NcclComm,
    /// This rank's hpZ group: the node's communicator or a sub-group's.
    pub hpz: &'a NcclComm,
    /// The global ranks of the world, node, cross and hpZ groups, in
    /// member order (whom each hop's bytes are counted to).
    pub members: [&'a [usize]; 4],
    /// This rank in the whole job.
    pub rank: usize,
    /// The layout of the mesh dimension these groups are (this rank's
    /// position in it).
    pub layout: Layout,
    pub counter: &'a CountingTransport,
    /// The device whose stream the communicators use (for the casts of a
    /// bf16 wire).
    pub gpu: &'a Gpu,
}

fn view_bytes_mut<'a>(v: &'a mut CudaViewMut<'_, f32>) -> CudaViewMut<'a, u8> {
    let n = v.len() * 4;
    // SAFETY: the bytes written are f32 bit patterns sent by a peer.
    unsafe { v.transmute_mut::<u8>(n) }.expect("an f32 buffer holds 4 bytes a value")
}

fn bf16_bytes<'a>(v: CudaView<'a, half::bf16>) -> CudaView<'a, u8> {
    let n = v.len() * 2;
    // SAFETY: any bf16 bit pattern is a valid run of bytes.
    unsafe { v.transmute::<u8>(n) }.expect("a bf16 buffer holds 2 bytes a value")
}

fn bf16_bytes_mut(s: &mut CudaSlice<half::bf16>) -> CudaViewMut<'_, u8> {
    let n = s.len() * 2;
    // SAFETY: the bytes written are bf16 bit patterns sent by a peer.
    unsafe { s.transmute_mut::<u8>(n) }.expect("a bf16 buffer holds 2 bytes a value")
}

fn bytes_of<'a>(v: CudaView<'a, f32>) -> CudaView<'a, u8> {
    let n = v.len() * 4;
    // SAFETY: any f32 bit pattern is a valid run of bytes.
    unsafe { v.transmute::<u8>(n) }.expect("an f32 buffer holds 4 bytes a value")
}

fn bytes_of_mut(s: &mut CudaSlice<f32>) -> CudaViewMut<'_, u8> {
    let n = s.len() * 4;
    // SAFETY: the bytes written are f32 bit patterns sent by a peer.
    unsafe { s.transmute_mut::<u8>(n) }.expect("an f32 buffer holds 4 bytes a value")
}

/// `op` on each part of `send` (codes, maxima, minima) into the same part
/// of `recv`: each on its own, so what arrives is in the chunks' layout.
fn each_part(
    send: &DeviceQuantizedChunks,
    recv: &mut DeviceQuantizedChunks,
    op: impl Fn(&CudaView<'_, u8>, &mut CudaViewMut<'_, u8>) -> Result<(), CudaError>,
) -> Result<(), ZeroError> {
    op(&send.codes.as_view(), &mut recv.codes.as_view_mut())?;
    op(
        &bytes_of(send.block_max.as_view()),
        &mut bytes_of_mut(&mut recv.block_max),
    )?;
    if !send.block_min.is_empty() {
        op(
            &bytes_of(send.block_min.as_view()),
            &mut bytes_of_mut(&mut recv.block_min),
        )?;
    }
    Ok(())
}

impl NcclMover<'_> {
    fn comm(&self, hop: Hop) -> &NcclComm {
        match hop {
            Hop::World => self.world,
            Hop::Node => self.node,
            Hop::Cross => self.cross,
            Hop::Hpz => self.hpz,
        }
    }

    /// The global ranks of `hop`'s members.
    fn members(&self, hop: Hop) -> &[usize] {
        match hop {
            Hop::World => self.members[0],
            Hop::Node => self.members[1],
            Hop::Cross => self.members[2],
            Hop::Hpz => self.members[3],
        }
    }

    /// Counts `each` bytes of plain values sent to every other member of
    /// `hop`.
    fn count_plain(&self, hop: Hop, phase: Phase, each: u64) {
        for &peer in self.members(hop) {
            if peer != self.rank {
                self.counter.count_outside(phase, 0.0, peer, each);
            }
        }
    }

    /// Counts `bytes` of `format` chunks of `chunk_len` values sent to each
    /// of `peers`.
    fn count(&self, phase: Phase, q: &DeviceQuantizedChunks, peers: &[(usize, u64)]) {
        let frac = scale_fraction(q.format, q.chunk_len);
        for &(peer, bytes) in peers {
            if peer != self.rank {
                self.counter.count_outside(phase, frac, peer, bytes);
            }
        }
    }
}

impl ByteMover<Gpu> for NcclMover<'_> {
    fn size(&self, hop: Hop) -> usize {
        self.comm(hop).size()
    }

    fn all_agree(&self, hop: Hop, phase: Phase, mine: bool) -> Result<bool, ZeroError> {
        let comm = self.comm(hop);
        let gpu = self.gpu;
        let flag = gpu.upload(&[u8::from(mine)])?;
        let mut all = gpu.zeros::<u8>(comm.size())?;
        comm.all_gather_bytes(&flag.as_view(), &mut all.as_view_mut())?;
        self.count_plain(hop, phase, 1);
        Ok(gpu.download(&all.as_view())?.iter().all(|&b| b == 1))
    }

    fn all_gather_values_unchecked(
        &self,
        hop: Hop,
        phase: Phase,
        mine: &DeviceValues,
        all: &mut DeviceValues,
        fp32: bool,
    ) -> Result<(), ZeroError> {
        let comm = self.comm(hop);
        let len = mine.len();
        let each = if fp32 {
            let mut out = all.view_mut();
            comm.all_gather_bytes(&bytes_of(mine.view()), &mut view_bytes_mut(&mut out))?;
            len as u64 * 4
        } else {
            // bf16 on the wire, rounded to nearest even, widened on arrival.
            let gpu = self.gpu;
            let mut wire = gpu.zeros::<half::bf16>(len)?;
            gpu.narrow(&mine.view(), &mut wire.as_view_mut())?;
            let mut got = gpu.zeros::<half::bf16>(len * comm.size())?;
            comm.all_gather_bytes(&bf16_bytes(wire.as_view()), &mut bf16_bytes_mut(&mut got))?;
            gpu.widen(&got.as_view(), &mut all.view_mut())?;
            len as u64 * 2
        };
        self.count_plain(hop, phase, each);
        Ok(())
    }

    fn sum_swizzled_unchecked<T: GpuElement>(
        &self,
        _q: &Gpu,
        hop: Hop,
        phase: Phase,
        x: &CudaView<'_, T>,
        (nodes, chunk): (usize, usize),
        sum: &mut DeviceValues,
    ) -> Result<(), ZeroError> {
        let comm = self.comm(hop);
        let members = comm.size();
        if chunk == 0 {
            return Ok(());
        }
        // Member j's run (chunks n · members + j for every n) made
        // contiguous in bf16: each chunk widened to f32, then narrowed.
        let gpu = self.gpu;
        let mut wide = gpu.zeros::<f32>(chunk)?;
        let mut wire = gpu.zeros::<half::bf16>(x.len())?;
        for j in 0..members {
            for n in 0..nodes {
                let from = (n * members + j) * chunk;
                let to = (j * nodes + n) * chunk;
                gpu.widen(&x.slice(from..from + chunk), &mut wide.as_view_mut())?;
                gpu.narrow(&wide.as_view(), &mut wire.slice_mut(to..to + chunk))?;
            }
        }
        let mut got = gpu.zeros::<half::bf16>(x.len())?;
        comm.all_to_all_bytes(&bf16_bytes(wire.as_view()), &mut bf16_bytes_mut(&mut got))?;
        let run = nodes * chunk;
        let mut each = gpu.zeros::<f32>(run)?;
        gpu.widen(&got.slice(0..run), &mut sum.view_mut())?;
        for j in 1..members {
            gpu.widen(&got.slice(j * run..(j + 1) * run), &mut each.as_view_mut())?;
            gpu.axpby(&mut sum.view_mut(), &each.as_view(), 1.0, 1.0)?;
        }
        self.count_plain(hop, phase, run as u64 * 2);
        Ok(())
    }

    fn all_gather_tensor_unchecked<T: GpuElement>(
        &self,
        hop: Hop,
        phase: Phase,
        mine: &CudaView<'_, T>,
        all: &mut CudaViewMut<'_, T>,
    ) -> Result<(), ZeroError> {
        let comm = self.comm(hop);
        let bytes = mine.len() * std::mem::size_of::<T>();
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: f32, bf16 and f16 (GpuElement: Pod) are plain bytes, and
        // the bytes written are such values sent by a peer.
        let src = unsafe { mine.transmute::<u8>(bytes) }.expect("a tensor holds its bytes");
        // SAFETY: as above.
        let mut dst = unsafe { all.transmute_mut::<u8>(bytes * comm.size()) }
            .expect("a tensor holds its bytes");
        comm.all_gather_bytes(&src, &mut dst)?;
        // NCCL's own gather: what each peer must receive (its rings may
        // route it through neighbours).
        self.count_plain(hop, phase, bytes as u64);
        Ok(())
    }

    fn reduce_scatter_tensor_unchecked<T: GpuElement>(
        &self,
        _: &Gpu,
        hop: Hop,
        phase: Phase,
        x: &CudaView<'_, T>,
        out: &mut CudaViewMut<'_, T>,
        mean: bool,
    ) -> Result<(), ZeroError> {
        let comm = self.comm(hop);
        if x.is_empty() {
            return Ok(());
        }
        comm.reduce_scatter(x, out, mean)?;
        self.count_plain(hop, phase, (out.len() * std::mem::size_of::<T>()) as u64);
        Ok(())
    }

    fn all_to_all_unchecked(
        &self,
        hop: Hop,
        phase: Phase,
        (send, k): (&DeviceQuantizedChunks, usize),
        recv: &mut DeviceQuantizedChunks,
    ) -> Result<(), ZeroError> {
        let comm = self.comm(hop);
        each_part(send, recv, |s, r| comm.all_to_all_bytes(s, r))?;
        let each = send.format.total_bytes(send.chunk_len) as u64 * k as u64;
        let peers: Vec<_> = self.members(hop).iter().map(|&p| (p, each)).collect();
        self.count(phase, send, &peers);
        Ok(())
    }

    fn all_gather_unchecked(
        &self,
        hop: Hop,
        phase: Phase,
        (mine, _): (&DeviceQuantizedChunks, usize),
        all: &mut DeviceQuantizedChunks,
    ) -> Result<(), ZeroError> {
        let comm = self.comm(hop);
        each_part(mine, all, |s, r| comm.all_gather_bytes(s, r))?;
        let each = mine.format.total_bytes(mine.chunk_len) as u64 * mine.count as u64;
        let peers: Vec<_> = self.members(hop).iter().map(|&p| (p, each)).collect();
        self.count(phase, mine, &peers);
        Ok(())
    }
}

/// The CUDA device's order of work ([`Queue`]): a call's host side runs
/// where it is launched, queueing its kernels and NCCL calls on the
/// caller's stream, and a CUDA event recorded after them marks its end;
/// a wait is the caller's stream waiting on that event.
pub struct CudaQueue {
    pub ctx: Arc<CudaContext>,
}

impl CudaQueue {
    /// The caller's stream `raw`, borrowed.
    ///
    /// # Safety
    /// `raw` is a live stream of this context.
    unsafe fn stream(&self, raw: usize) -> Arc<CudaStream> {
        // SAFETY: the caller's promise.
        unsafe { self.ctx.wrap_borrowed_stream(raw as sys::CUstream) }
    }
}

fn event_error(what: &str, source: DriverError) -> ZeroError {
    ZeroError::Device(CudaError::Driver {
        what: what.into(),
        source,
    })
}

impl Queue for CudaQueue {
    type Event = CudaEvent;

    unsafe fn launch(
        &self,
        stream: usize,
        _outcome: &Arc<Outcome>,
        call: Box<dyn FnOnce() + Send>,
    ) -> Result<CudaEvent, ZeroError> {
        call();
        // SAFETY: the caller's promise.
        let s = unsafe { self.stream(stream) };
        s.record_event(None)
            .map_err(|e| event_error("recording the event after a collective", e))
    }

    fn query(&self, e: &CudaEvent) -> Result<bool, ZeroError> {
        e.try_is_complete()
            .map_err(|e| event_error("querying a collective's event", e))
    }

    unsafe fn wait_event(
        &self,
        stream: usize,
        e: &CudaEvent,
        _deadline: Instant,
    ) -> Result<bool, ZeroError> {
        // SAFETY: the caller's promise.
        let s = unsafe { self.stream(stream) };
        s.wait(e)
            .map_err(|e| event_error("making the stream wait for a collective", e))?;
        Ok(true)
    }
}

/// The CUDA device: zeropp's CUDA kernels, NCCL communicators.
impl Device for Gpu {
    type Kernels = Gpu;
    type Comm = NcclComm;
    type Id = NcclId;
    type Mover<'a> = NcclMover<'a>;
    type Queue = CudaQueue;

    fn kernels(&self) -> &Gpu {
        self
    }

    fn queue(&self) -> CudaQueue {
        CudaQueue {
            ctx: self.context().clone(),
        }
    }

    fn join(
        &self,
        id: &NcclId,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<NcclComm, ZeroError> {
        Ok(NcclComm::init(self, id, rank, size, timeout)?)
    }

    fn abort(comm: &NcclComm) {
        comm.abort();
    }

    /// NCCL carries no notice: a peer waiting in a kernel on this rank is
    /// ended by its own watchdog at the job's deadline.
    fn give_up(&self, _comm: &NcclComm, _e: &CommError) {}

    unsafe fn use_stream(&mut self, stream: usize, comms: &Comms<NcclComm>) {
        // SAFETY: the caller's promise.
        unsafe { Gpu::use_stream(self, stream) };
        comms.all().for_each(|c| c.use_stream(self.stream()));
    }

    fn mover<'a>(
        &'a self,
        comms: &'a Comms<NcclComm>,
        rank: usize,
        counter: &'a CountingTransport,
        (hpz, hpz_ranks): (&'a NcclComm, &'a [usize]),
    ) -> NcclMover<'a> {
        NcclMover {
            world: &comms.world,
            node: &comms.node,
            cross: &comms.cross,
            hpz,
            members: [&comms.ranks[0], &comms.ranks[1], &comms.ranks[2], hpz_ranks],
            rank,
            layout: comms.layout,
            counter,
            gpu: self,
        }
    }

    unsafe fn with_tensors<T: GpuElement>(
        &self,
        (inp, n_in): (u64, usize),
        (out, n_out): (u64, usize),
        f: impl FnOnce(&TensorOf<'_, Self, T>, &mut TensorMutOf<'_, Self, T>) -> Result<(), ZeroError>,
    ) -> Result<(), ZeroError> {
        // SAFETY: the caller's promise.
        let x = unsafe { self.borrow::<T>(inp, n_in) }?;
        let mut o = unsafe { self.borrow::<T>(out, n_out) }?;
        f(&x.view(), &mut o.view_mut())
    }
}
