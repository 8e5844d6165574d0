//! The emulated device's kernels: zeropp's CUDA kernels, their own source,
//! run on host buffers by `zeropp-cuda-emu`, launched with the names, grids
//! and parameters the CUDA launchers use (zeropp-cuda's `kernels`), grids
//! checked against CUDA's limits as the device's launcher checks them. On
//! host memory ([`HostKernels`]) and with the host transports as its byte
//! mover, it runs the device path's collectives on a machine without a GPU,
//! and must give the host library's results bit for bit (round to
//! nearest).

use zeropp_cuda::GpuElement;
use zeropp_cuda::kernels::{
    self, Fault, THREADS, decode_corrupt_input, decode_fault, dequantize_grid, dequantize_kernel,
    quantize_grid, quantize_kernel, sum_requantize_kernel,
};
use zeropp_cuda_emu as emu;
use zeropp_quant::{QuantError, QuantizedChunks, QuantizedMut, QuantizedRef, Rounding, Scheme};

use std::sync::Arc;
use std::time::{Duration, Instant};

use zeropp_comm::collectives::CommThread;
use zeropp_comm::{CommError, Communicator, Group};

use crate::ZeroGroups;
use crate::devices::{Comms, Device};
use crate::error::{ZeroError, quant_failure};
use crate::host::{Host, HostKernels, HostMover};
use crate::traffic::CountingTransport;
use crate::work::{Outcome, Queue};

/// The CUDA kernels on host memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct Emulated;

/// A launch's grid, checked as the device's launcher checks it.
fn grid(blocks: u64, name: &str) -> Result<u32, ZeroError> {
    Ok(kernels::launch_grid(blocks, name)?)
}

/// A grid-stride launch over `n` values.
fn stride_grid(n: usize, name: &str) -> Result<u32, ZeroError> {
    grid(
        (n as u64)
            .div_ceil(u64::from(THREADS))
            .min(kernels::MAX_STRIDE_GRID),
        name,
    )
}

/// Quantizes `count` chunks of `x` (swizzled over `nodes` × `rpn` when
/// `count` > 1) into `out`'s parts; a fault reported in slot 0 becomes the
/// CPU library's error.
fn quantize_parts<T: GpuElement>(
    x: &[T],
    (count, nodes, rpn): (usize, usize, usize),
    rounding: Rounding,
    out: QuantizedMut<'_>,
) -> Result<(), ZeroError> {
    let (format, chunk_len) = (out.format, out.len / count.max(1));
    let blocks = (format.num_blocks(chunk_len) * count) as u64;
    if blocks == 0 {
        return Ok(());
    }
    let (name, seed) = quantize_kernel(T::TAG, &format, rounding);
    let [key, _] = emu::quantize(
        &name,
        grid(quantize_grid(&format, blocks), &name)?,
        x,
        emu::QuantizeParams {
            chunk_len: chunk_len as u64,
            count: count as u32,
            nodes: nodes as u32,
            rpn: rpn as u32,
            block: format.block as u32,
            seed,
            part_seeds: count > 1,
        },
        out.codes,
        out.block_max,
        out.block_min,
    );
    let Some(fault) = decode_fault(key) else {
        return Ok(());
    };
    let nb = format.num_blocks(chunk_len) as u64;
    let gb = match fault {
        Fault::NonFinite { block, .. } | Fault::RangeOverflow { block } => block,
    };
    let (p, block) = ((gb / nb) as usize, (gb % nb) as usize);
    let rank = zeropp_quant::swizzled_rank(p, nodes, rpn);
    let chunk = &x[rank * chunk_len..(rank + 1) * chunk_len];
    let values = &chunk[block * format.block..((block + 1) * format.block).min(chunk_len)];
    let e = match fault {
        Fault::RangeOverflow { .. } => QuantError::RangeOverflow {
            block,
            min: values.iter().map(|v| v.to_f32()).fold(f32::MAX, f32::min),
            max: values.iter().map(|v| v.to_f32()).fold(f32::MIN, f32::max),
        },
        Fault::NonFinite { offset, .. } => QuantError::NonFinite {
            block,
            index: block * format.block + offset as usize,
            value: values[offset as usize].to_f32(),
        },
    };
    Err(quant_failure("quantizing on the emulated device")(e))
}

/// Corrupt block parameters reported by a dequantizing kernel.
fn corrupt(q: &QuantizedRef<'_>, block: usize) -> ZeroError {
    let min = if q.format.scheme == Scheme::Asymmetric {
        q.block_min[block]
    } else {
        0.0
    };
    quant_failure("dequantizing on the emulated device")(QuantError::CorruptParams {
        block,
        min,
        max: q.block_max[block],
    })
}

/// Dequantizes `q` into `out` as `T`, or adds it in f32 (`element` None).
fn dequantize_with<T: Copy>(
    q: QuantizedRef<'_>,
    out: &mut [T],
    element: Option<&str>,
) -> Result<(), ZeroError> {
    if q.len == 0 {
        return Ok(());
    }
    if out.len() != q.len {
        return Err(quant_failure("dequantizing on the emulated device")(
            QuantError::SizeMismatch {
                what: "output values",
                expected: q.len,
                found: out.len(),
            },
        ));
    }
    let name = dequantize_kernel(&q.format, element);
    let [_, bad] = emu::dequantize(
        &name,
        grid(dequantize_grid(&q.format, q.len), &name)?,
        q.codes,
        q.block_max,
        q.block_min,
        q.format.block as u32,
        out,
    );
    if bad != u64::MAX {
        return Err(corrupt(&q, bad as usize));
    }
    Ok(())
}

impl HostKernels for Emulated {
    fn quantize<T: GpuElement>(
        &self,
        x: &[T],
        rounding: Rounding,
        out: QuantizedMut<'_>,
    ) -> Result<(), ZeroError> {
        if x.len() != out.len {
            return Err(ZeroError::Invalid(format!(
                "quantizing {} values into a tensor of {}",
                x.len(),
                out.len
            )));
        }
        quantize_parts(x, (1, 1, 1), rounding, out)
    }

    fn quantize_swizzled<T: GpuElement>(
        &self,
        x: &[T],
        nodes: usize,
        ranks_per_node: usize,
        rounding: Rounding,
        out: &mut QuantizedChunks,
    ) -> Result<(), ZeroError> {
        let world = nodes * ranks_per_node;
        let chunk_len = zeropp_quant::swizzled_chunk_len(x.len(), nodes, ranks_per_node)
            .map_err(quant_failure("quantizing chunks"))?;
        if out.count != world || out.chunk_len != chunk_len {
            return Err(ZeroError::Invalid(format!(
                "swizzled chunks: {world} chunks of {chunk_len} values into {} of {}",
                out.count, out.chunk_len
            )));
        }
        let all = QuantizedMut {
            format: out.format,
            len: world * chunk_len,
            codes: &mut out.codes,
            block_max: &mut out.block_max,
            block_min: &mut out.block_min,
        };
        quantize_parts(x, (world, nodes, ranks_per_node), rounding, all)
    }

    fn dequantize<T: GpuElement>(
        &self,
        q: QuantizedRef<'_>,
        out: &mut [T],
    ) -> Result<(), ZeroError> {
        dequantize_with(q, out, Some(T::TAG))
    }

    fn dequantize_accumulate(&self, q: QuantizedRef<'_>, out: &mut [f32]) -> Result<(), ZeroError> {
        dequantize_with(q, out, None)
    }

    fn sum_requantize(
        &self,
        inputs: &[QuantizedRef<'_>],
        rounding: Rounding,
        out: QuantizedMut<'_>,
    ) -> Result<(), ZeroError> {
        let f = out.format;
        if let Some(q) = inputs.iter().find(|q| q.len != out.len) {
            return Err(ZeroError::Invalid(format!(
                "summing chunks of {} values into a chunk of {}",
                q.len, out.len
            )));
        }
        let blocks = f.num_blocks(out.len) as u64;
        if blocks == 0 {
            return Ok(());
        }
        let descs: Vec<emu::QInput> = inputs.iter().map(emu::QInput::of).collect();
        let (name, seed) = sum_requantize_kernel(&f, rounding);
        let [key, bad] = emu::sum_requantize(
            &name,
            grid(quantize_grid(&f, blocks), &name)?,
            &descs,
            out.len as u64,
            f.block as u32,
            seed,
            out.codes,
            out.block_max,
            out.block_min,
        );
        if let Some((j, block)) = decode_corrupt_input(bad) {
            return Err(corrupt(&inputs[j], block));
        }
        if decode_fault(key).is_some() {
            // The sum is never stored: the CPU library says what was wrong.
            let mut scratch = QuantizedChunks::zeroed(f, out.len, 1);
            return HostKernels::sum_requantize(&Host, inputs, rounding, scratch.chunk_mut(0));
        }
        Ok(())
    }

    fn dropped(&self, x: &mut [f32], y: &[f32]) -> Result<(), ZeroError> {
        if !x.is_empty() {
            emu::axpby_f32(stride_grid(x.len(), "zq_axpby_f32")?, x, y, -1.0, 1.0);
        }
        Ok(())
    }

    fn divide(&self, x: &mut [f32], d: f32) -> Result<(), ZeroError> {
        if !x.is_empty() {
            emu::div_f32(stride_grid(x.len(), "zq_div_f32")?, x, d);
        }
        Ok(())
    }

    fn widen<T: GpuElement>(&self, x: &[T], y: &mut [f32]) -> Result<(), ZeroError> {
        cast(&format!("zq_to_f32_{}", T::TAG), x, y)
    }

    fn narrow<T: GpuElement>(&self, x: &[f32], y: &mut [T]) -> Result<(), ZeroError> {
        cast(&format!("zq_from_f32_{}", T::TAG), x, y)
    }

    fn rotate(&self, x: &mut [f32], block: usize) -> Result<(), ZeroError> {
        if !block.is_power_of_two() {
            return Err(ZeroError::Invalid(format!(
                "a Hadamard rotation over blocks of {block} values: use a power of two"
            )));
        }
        let whole = x.len() / block * block;
        if whole == 0 {
            return Ok(());
        }
        let name = "zq_hadamard_stage_f32";
        let g = grid(kernels::stride_grid(whole as u64 / 2), name)?;
        for (h, scale) in kernels::hadamard_stages(block) {
            emu::hadamard_stage_f32(g, &mut x[..whole], block as u64, h, scale);
        }
        Ok(())
    }
}

/// Launches the cast kernel `name` (`zq_to_f32_E` or `zq_from_f32_E`) of
/// `x` into `y`, as many values.
fn cast<A: GpuElement, B: GpuElement>(name: &str, x: &[A], y: &mut [B]) -> Result<(), ZeroError> {
    if x.len() != y.len() {
        return Err(ZeroError::Invalid(format!(
            "{name}: {} values into {}",
            x.len(),
            y.len()
        )));
    }
    if !x.is_empty() {
        // SAFETY: `x` holds x.len() values of A, `y` as many of B, the
        // kernel's input and output types.
        unsafe {
            emu::cast(
                name,
                stride_grid(x.len(), name)?,
                x.as_ptr().cast(),
                y.as_mut_ptr().cast(),
                x.len() as u64,
            )
        };
    }
    Ok(())
}

/// The emulated device of a device job ([`crate::devices::Device`]):
/// "device" memory is host memory, the kernels are [`Emulated`], a
/// communicator is one of the host job's groups, moved by its transports
/// (the ids: the groups themselves). Its stream is one ordered queue, a
/// thread (`zeropp.torch`: the host job's communication thread): every
/// stream the caller names is that one.
pub struct EmulatedDevice {
    pub comm: Arc<Communicator>,
    pub stream: Arc<CommThread>,
}

/// The emulated device's order of work ([`Queue`]): its one thread runs
/// the calls in order; a call's event is its own outcome, set by that
/// thread when the call ends (a marker in the queue). Its caller computes
/// on its own thread, so a wait is that thread waiting for the marker.
pub struct EmulatedQueue {
    thread: Arc<CommThread>,
}

impl Queue for EmulatedQueue {
    type Event = Arc<Outcome>;

    unsafe fn launch(
        &self,
        _stream: usize,
        outcome: &Arc<Outcome>,
        call: Box<dyn FnOnce() + Send>,
    ) -> Result<Arc<Outcome>, ZeroError> {
        // The thread's own result channel carries nothing: the outcome does.
        drop(self.thread.submit(move |_: &Communicator| {
            call();
            Ok::<(), ZeroError>(())
        }));
        Ok(outcome.clone())
    }

    fn query(&self, e: &Arc<Outcome>) -> Result<bool, ZeroError> {
        Ok(e.is_settled())
    }

    unsafe fn wait_event(
        &self,
        _stream: usize,
        e: &Arc<Outcome>,
        deadline: Instant,
    ) -> Result<bool, ZeroError> {
        Ok(e.wait_until(deadline))
    }
}

impl Device for EmulatedDevice {
    type Kernels = Emulated;
    type Comm = Arc<Group>;
    type Id = Arc<Group>;
    type Mover<'a> = HostMover<'a>;
    type Queue = EmulatedQueue;

    fn kernels(&self) -> &Emulated {
        &Emulated
    }

    fn queue(&self) -> EmulatedQueue {
        EmulatedQueue {
            thread: self.stream.clone(),
        }
    }

    fn join(
        &self,
        id: &Arc<Group>,
        rank: usize,
        size: usize,
        _timeout: Duration,
    ) -> Result<Arc<Group>, ZeroError> {
        if id.size() != size || rank >= size {
            return Err(ZeroError::Invalid(format!(
                "joining member {rank} of a {size}-rank communicator with a group of ranks {:?}",
                id.ranks()
            )));
        }
        Ok(id.clone())
    }

    /// The host transports end a collective with a dead peer themselves
    /// (their deadline); nothing holds a stream.
    fn abort(_comm: &Arc<Group>) {}

    /// The host path's notice, in the group's next call
    /// ([`Communicator::give_up_next`]).
    fn give_up(&self, comm: &Arc<Group>, e: &CommError) {
        self.comm.give_up_next(comm, e);
    }

    unsafe fn use_stream(&mut self, _stream: usize, _comms: &Comms<Arc<Group>>) {}

    fn mover<'a>(
        &'a self,
        comms: &'a Comms<Arc<Group>>,
        _rank: usize,
        counter: &'a CountingTransport,
        (hpz, _): (&'a Arc<Group>, &'a [usize]),
    ) -> HostMover<'a> {
        HostMover {
            comm: &self.comm,
            counter,
            groups: ZeroGroups {
                world: comms.world.clone(),
                node: comms.node.clone(),
                cross: comms.cross.clone(),
                hpz: hpz.clone(),
            },
        }
    }

    unsafe fn with_tensors<T: GpuElement>(
        &self,
        (inp, n_in): (u64, usize),
        (out, n_out): (u64, usize),
        f: impl FnOnce(&&[T], &mut &mut [T]) -> Result<(), ZeroError>,
    ) -> Result<(), ZeroError> {
        let size = std::mem::size_of::<T>() as u64;
        check_host_address::<T>(inp, n_in)?;
        check_host_address::<T>(out, n_out)?;
        // FSDP2 gathers in place: its input is this rank's run of the
        // output. Read from a copy then, so the two never alias.
        let overlaps = n_in > 0
            && n_out > 0
            && inp < out + n_out as u64 * size
            && out < inp + n_in as u64 * size;
        // SAFETY (both): the caller's promise; the addresses were checked
        // non-null and aligned above.
        let x: &[T] = match n_in {
            0 => &[],
            _ => unsafe { std::slice::from_raw_parts(inp as *const T, n_in) },
        };
        let copy = overlaps.then(|| x.to_vec());
        let x = copy.as_deref().unwrap_or(x);
        let mut o: &mut [T] = match n_out {
            0 => &mut [],
            _ => unsafe { std::slice::from_raw_parts_mut(out as *mut T, n_out) },
        };
        f(&x, &mut o)
    }
}

/// Refuses an address that cannot hold `len` values of `T` (null, or not
/// aligned to them).
fn check_host_address<T>(ptr: u64, len: usize) -> Result<(), ZeroError> {
    let size = std::mem::size_of::<T>() as u64;
    if len > 0 && (ptr == 0 || !ptr.is_multiple_of(size)) {
        return Err(ZeroError::Invalid(format!(
            "address {ptr:#x} does not hold aligned {size}-byte values; pass a contiguous tensor \
             of that type"
        )));
    }
    Ok(())
}
