//! The GPU: a context and stream on one device, the kernel families compiled
//! for its architecture, device buffers in zeropp-quant's formats, and the
//! launchers. Every launcher checks sizes before launching, launches, then
//! reads the kernel's error slots (which synchronizes the stream) and returns
//! the first bad input the kernel saw as the same error the CPU library gives.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use half::{bf16, f16};
use zeropp_quant::{Element, QuantError, QuantFormat, QuantizedChunks, QuantizedTensor, Rounding};

use crate::compile::{Arch, cubin_cached};
use crate::kernels::{
    FAMILIES, Fault, THREADS, decode_corrupt_input, decode_fault, dequantize_grid,
    dequantize_kernel, quantize_grid, quantize_kernel, sum_requantize_kernel,
};
use crate::toolkit::Toolkit;
use crate::{CudaError, DriverContext};

/// Launches kernel `$name` of module `$family` on `$gpu`'s stream over a
/// grid of `$grid` blocks (checked against CUDA's limits), with `$args` in
/// the order the kernel declares them; an error names the kernel. The one
/// launch sequence of every kernel below; written as `launch!(unsafe ...)`
/// because the arguments' match with the kernel's signature is the caller's
/// to promise (each call site says why, as SAFETY). A macro rather than a
/// function: the arguments borrow for as long as the launch builder, which
/// borrows the kernel's function from here.
macro_rules! launch {
    (unsafe $gpu:expr, $family:expr, $name:expr, $grid:expr, [$($arg:expr),+ $(,)?]) => {{
        let name: &str = $name;
        let func = $gpu.function($family, name)?;
        let cfg = grid_config($grid, name)?;
        let mut l = $gpu.stream.launch_builder(&func);
        $( l.arg($arg); )+
        // SAFETY: promised by the caller (its SAFETY comment).
        unsafe { l.launch(cfg) }.during(|| format!("launching {name}"))
    }};
}

/// A value type NCCL reduces: its `ncclDataType_t`.
pub trait NcclElement: DeviceRepr {
    const TYPE: std::ffi::c_int;
}
impl NcclElement for f32 {
    const TYPE: std::ffi::c_int = 7;
}
impl NcclElement for half::f16 {
    const TYPE: std::ffi::c_int = 6;
}
impl NcclElement for half::bf16 {
    const TYPE: std::ffi::c_int = 9;
}

/// An element type the kernels read and write on the device.
pub trait GpuElement:
    Element + DeviceRepr + ValidAsZeroBits + Default + bytemuck::Pod + NcclElement
{
    /// As kernel names spell it.
    const TAG: &'static str;
}
impl GpuElement for f32 {
    const TAG: &'static str = "f32";
}
impl GpuElement for bf16 {
    const TAG: &'static str = "bf16";
}
impl GpuElement for f16 {
    const TAG: &'static str = "f16";
}

/// Whether this machine can load the NVIDIA driver library at all.
pub fn driver_present() -> bool {
    // SAFETY: probes for the library; loads nothing else.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Number of CUDA devices (0 with no driver or no device; never panics).
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .unwrap_or(0)
}

/// Lets the device's default memory pool (where the stream-ordered
/// temporaries of every call come from) keep up to 1/64 of the device's
/// memory when freed, instead of returning all of it to the driver at each
/// synchronization, its default: each call would map its temporaries
/// afresh. The rest goes back: PyTorch's allocator cannot reclaim what
/// this pool keeps. A device without memory pools has nothing to set.
fn keep_pool_memory(ctx: &CudaContext) {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut total = 0usize;
    // SAFETY: plain out-parameters and an attribute value of the documented
    // type (cuuint64_t for the release threshold); failures change nothing.
    unsafe {
        if sys::cuDeviceTotalMem_v2(&mut total, ctx.cu_device()) != sys::CUresult::CUDA_SUCCESS
            || sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
                != sys::CUresult::CUDA_SUCCESS
        {
            return;
        }
        let mut keep = total as u64 / 64;
        // Where it fails, temporaries are merely mapped afresh.
        let _ = sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep as *mut u64).cast(),
        );
    }
}

/// One device, its stream and its kernels.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: Arch,
    modules: HashMap<&'static str, Arc<CudaModule>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    /// Two error slots (see common.cuh), reset before each checked launch.
    err: Mutex<CudaSlice<u64>>,
}

impl Gpu {
    /// Opens device `ordinal`, compiles (or loads from the cache) every
    /// kernel family for its architecture and loads them.
    pub fn open(ordinal: usize) -> Result<Gpu, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let count = CudaContext::device_count().during(|| "counting devices".into())?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaError::NoDevice {
                ordinal,
                reason: format!("this machine has {count} CUDA device(s)"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::NoDevice {
            ordinal,
            reason: e.to_string(),
        })?;
        let (major, minor) = ctx
            .compute_capability()
            .during(|| "reading the compute capability".into())?;
        let arch = Arch::from_capability(major, minor);
        let toolkit = Toolkit::find()?;
        let mut modules = HashMap::new();
        for family in &FAMILIES {
            let cubin = cubin_cached(&toolkit, family, arch)?;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                .during(|| format!("loading {} for {arch}", family.file))?;
            modules.insert(family.name, module);
        }
        let stream = ctx.default_stream();
        let err = stream
            .alloc_zeros::<u64>(2)
            .during(|| "allocating the error slots".into())?;
        Ok(Gpu {
            ctx,
            stream,
            arch,
            modules,
            functions: Mutex::new(HashMap::new()),
            err: Mutex::new(err),
        })
    }

    /// [`Gpu::open`] for a process where another library (PyTorch) owns
    /// the streams and the memory: the caller orders all work through the
    /// stream it hands to [`Gpu::use_stream`], so cudarc's own event
    /// tracking is off.
    pub fn open_shared(ordinal: usize) -> Result<Gpu, CudaError> {
        let gpu = Gpu::open(ordinal)?;
        // SAFETY: every buffer of this Gpu is used on the one stream in use
        // at the time (the caller's), which orders the work; the error slots
        // are allocated above and synchronized here before any other use.
        unsafe { gpu.ctx.disable_event_tracking() };
        gpu.ctx
            .synchronize()
            .during(|| "synchronizing after opening the device".into())?;
        keep_pool_memory(&gpu.ctx);
        Ok(gpu)
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Queues this GPU's work from now on on `raw`, a stream another
    /// library owns (`torch.cuda.current_stream().cuda_stream`), so the
    /// kernels and copies run in order with the caller's work on it.
    ///
    /// # Safety
    /// `raw` must be a live stream of this device's primary context (or 0,
    /// the legacy default stream), kept alive by its owner while this Gpu,
    /// or a buffer allocated while it is in use, may still work on it.
    pub unsafe fn use_stream(&mut self, raw: usize) {
        // SAFETY: as the caller promises.
        self.stream = unsafe {
            self.ctx
                .wrap_borrowed_stream(raw as cudarc::driver::sys::CUstream)
        };
    }

    /// `len` values of `T` at device address `ptr`, memory another library
    /// owns (a PyTorch tensor's), as a buffer for the kernels; dropping it
    /// leaves the memory alone.
    ///
    /// # Safety
    /// `ptr` must address `len` values of `T` on this device, alive and not
    /// written by anyone else while the returned buffer is in use.
    pub unsafe fn borrow<T: DeviceRepr>(
        &self,
        ptr: u64,
        len: usize,
    ) -> Result<Borrowed<T>, CudaError> {
        let size = std::mem::size_of::<T>() as u64;
        if len > 0 && (ptr == 0 || !ptr.is_multiple_of(size)) {
            return Err(CudaError::Invalid(format!(
                "device address {ptr:#x} does not hold aligned {size}-byte values; pass a \
                 contiguous tensor of that type"
            )));
        }
        // SAFETY: as the caller promises; the slice is leaked, never freed.
        let slice = unsafe { self.stream.upgrade_device_ptr::<T>(ptr, len) };
        Ok(Borrowed {
            slice: std::mem::ManuallyDrop::new(slice),
        })
    }

    /// Copies `src` into `dst` (equal lengths) on the device.
    pub fn copy<T: DeviceRepr>(
        &self,
        src: &CudaView<'_, T>,
        dst: &mut CudaViewMut<'_, T>,
    ) -> Result<(), CudaError> {
        size_check("copied values", src.len(), dst.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.stream
            .memcpy_dtod(src, dst)
            .during(|| format!("copying {} values on the device", src.len()))
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// The device's name.
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown device".into())
    }

    /// Copies host values to a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        if host.is_empty() {
            return self.empty();
        }
        self.stream
            .clone_htod(host)
            .during(|| format!("copying {} values to the device", host.len()))
    }

    /// Copies a device buffer back to the host.
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaView<'_, T>,
    ) -> Result<Vec<T>, CudaError> {
        if dev.is_empty() {
            return Ok(Vec::new());
        }
        self.to_host(dev, || format!("copying {} values to the host", dev.len()))
    }

    /// `dev`'s values once the stream has reached them (a copy into pageable
    /// memory is not promised to wait for the device: this one does).
    fn to_host<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaView<'_, T>,
        what: impl Fn() -> String,
    ) -> Result<Vec<T>, CudaError> {
        let host = self.stream.clone_dtoh(dev).during(&what)?;
        self.stream.synchronize().during(what)?;
        Ok(host)
    }

    /// A zeroed device buffer of `len` values.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        if len == 0 {
            return self.empty();
        }
        self.stream
            .alloc_zeros::<T>(len)
            .during(|| format!("allocating {len} values"))
    }

    /// A buffer of no values. Where the device has no memory pools
    /// `cuMemAlloc` refuses 0 bytes, and the buffer owns one byte instead.
    fn empty<T>(&self) -> Result<CudaSlice<T>, CudaError> {
        if self.ctx.has_async_alloc() {
            return self
                .stream
                .null::<T>()
                .during(|| "allocating an empty buffer".into());
        }
        // SAFETY: the byte is never read; it only gives the slice an address.
        let byte =
            unsafe { self.stream.alloc::<u8>(1) }.during(|| "allocating an empty buffer".into())?;
        let ptr = byte.leak();
        // SAFETY: `ptr` is a live allocation of this stream's context, now
        // owned by the returned slice alone, which frees it as it was made.
        Ok(unsafe { self.stream.upgrade_device_ptr::<T>(ptr, 0) })
    }

    fn function(&self, family: &'static str, name: &str) -> Result<CudaFunction, CudaError> {
        let mut cache = self.functions.lock().expect("function cache poisoned");
        if let Some(f) = cache.get(name) {
            return Ok(f.clone());
        }
        let module = &self.modules[family];
        let f = module
            .load_function(name)
            .during(|| format!("looking up kernel {name}"))?;
        cache.insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// Sets both error slots to "no error" (all ones) on the stream, with
    /// no host memory involved.
    fn reset_err(&self, err: &mut CudaSlice<u64>) -> Result<(), CudaError> {
        let what = || "resetting the error slots".to_string();
        self.ctx.bind_to_thread().during(what)?;
        let bytes = err.len() * std::mem::size_of::<u64>();
        let (ptr, _record) = err.device_ptr_mut(&self.stream);
        // SAFETY: `bytes` bytes of a live device buffer, set on the stream
        // that orders every use of it.
        unsafe {
            cudarc::driver::result::memset_d8_async(ptr, 0xFF, bytes, self.stream.cu_stream())
        }
        .during(what)
    }

    fn read_err(&self, err: &CudaSlice<u64>) -> Result<[u64; 2], CudaError> {
        let v = self.to_host(&err.as_view(), || {
            "reading the error slots (the kernel may have faulted)".into()
        })?;
        Ok([v[0], v[1]])
    }

    /// Quantizes `input` into `out` (whose format and length say how).
    pub fn quantize<T: GpuElement>(
        &self,
        input: &CudaView<'_, T>,
        rounding: Rounding,
        out: &mut DeviceQuantized,
    ) -> Result<(), CudaError> {
        size_check("input values", out.len, input.len())?;
        let format = out.format;
        self.quantize_chunks(
            input,
            QuantizeLaunch {
                format,
                chunk_len: out.len,
                count: 1,
                nodes: 1,
                rpn: 1,
                rounding,
                part_seeds: false,
            },
            &mut out.codes.as_view_mut(),
            &mut out.block_max.as_view_mut(),
            &mut out.block_min.as_view_mut(),
        )
    }

    /// [`Gpu::quantize`] into borrowed buffers (parts of a larger one).
    pub fn quantize_view<T: GpuElement>(
        &self,
        input: &CudaView<'_, T>,
        rounding: Rounding,
        out: &mut QuantViewMut<'_>,
    ) -> Result<(), CudaError> {
        out.check()?;
        size_check("input values", out.len, input.len())?;
        let launch = QuantizeLaunch {
            format: out.format,
            chunk_len: out.len,
            count: 1,
            nodes: 1,
            rpn: 1,
            rounding,
            part_seeds: false,
        };
        self.quantize_chunks(
            input,
            launch,
            &mut out.codes,
            &mut out.block_max,
            &mut out.block_min,
        )
    }

    /// Splits `input` into `nodes`·`ranks_per_node` equal chunks and quantizes
    /// chunk r at its swizzled position (`zeropp_quant::quantize_swizzled`).
    pub fn quantize_swizzled<T: GpuElement>(
        &self,
        input: &CudaView<'_, T>,
        nodes: usize,
        ranks_per_node: usize,
        rounding: Rounding,
        out: &mut DeviceQuantizedChunks,
    ) -> Result<(), CudaError> {
        let world = nodes * ranks_per_node;
        let chunk_len = zeropp_quant::swizzled_chunk_len(input.len(), nodes, ranks_per_node)?;
        if out.count != world || out.chunk_len != chunk_len {
            return Err(QuantError::SizeMismatch {
                what: "swizzled chunks (count x length)",
                expected: world * chunk_len,
                found: out.count * out.chunk_len,
            }
            .into());
        }
        self.quantize_chunks(
            input,
            QuantizeLaunch {
                format: out.format,
                chunk_len,
                count: world,
                nodes,
                rpn: ranks_per_node,
                rounding,
                part_seeds: true,
            },
            &mut out.codes.as_view_mut(),
            &mut out.block_max.as_view_mut(),
            &mut out.block_min.as_view_mut(),
        )
    }

    fn quantize_chunks<T: GpuElement>(
        &self,
        input: &CudaView<'_, T>,
        launch: QuantizeLaunch,
        codes: &mut CudaViewMut<'_, u8>,
        bmax: &mut CudaViewMut<'_, f32>,
        bmin: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        let f = launch.format;
        let blocks = (f.num_blocks(launch.chunk_len) * launch.count) as u64;
        if blocks == 0 {
            return Ok(());
        }
        let (name, seed) = quantize_kernel(T::TAG, &f, launch.rounding);
        let mut err = self.err.lock().expect("error slots poisoned");
        self.reset_err(&mut err)?;
        let (chunk_len, count, nodes, rpn, block, part) = (
            launch.chunk_len as u64,
            launch.count as u32,
            launch.nodes as u32,
            launch.rpn as u32,
            f.block as u32,
            u32::from(launch.part_seeds),
        );
        // SAFETY: the arguments match the kernel's signature (quantize.cu) in
        // order and type; every buffer was checked to hold what the kernel
        // writes or reads for these sizes.
        launch!(
            unsafe self,
            "quantize",
            &name,
            quantize_grid(&f, blocks),
            [
                input,
                &chunk_len,
                &count,
                &nodes,
                &rpn,
                &block,
                &seed,
                &part,
                codes,
                bmax,
                bmin,
                &mut *err
            ]
        )?;
        let [key, _] = self.read_err(&err)?;
        let Some(fault) = decode_fault(key) else {
            return Ok(());
        };
        let nb = f.num_blocks(launch.chunk_len) as u64;
        let gb = match fault {
            Fault::NonFinite { block, .. } | Fault::RangeOverflow { block } => block,
        };
        let (p, block) = ((gb / nb) as usize, (gb % nb) as usize);
        let rank = (p % launch.nodes) * launch.rpn + p / launch.nodes;
        let e = match fault {
            Fault::RangeOverflow { .. } => {
                let (min, max) = self.block_range(input, rank * launch.chunk_len, block, f)?;
                QuantError::RangeOverflow { block, min, max }
            }
            Fault::NonFinite { offset, .. } => {
                let index = block * f.block + offset as usize;
                let at = rank * launch.chunk_len + index;
                let value = self.download(&input.slice(at..at + 1))?[0].to_f32();
                QuantError::NonFinite {
                    block,
                    index,
                    value,
                }
            }
        };
        Err(if launch.count == 1 {
            e.into()
        } else {
            CudaError::Invalid(format!("chunk at swizzled position {p}: {e}"))
        })
    }

    /// The min and max of one block (for a range-overflow message).
    fn block_range<T: GpuElement>(
        &self,
        input: &CudaView<'_, T>,
        chunk_start: usize,
        block: usize,
        f: QuantFormat,
    ) -> Result<(f32, f32), CudaError> {
        let start = chunk_start + block * f.block;
        let end = (start + f.block).min(input.len());
        let vals = self.download(&input.slice(start..end))?;
        Ok(vals
            .iter()
            .map(|v| v.to_f32())
            .fold((f32::MAX, f32::MIN), |(lo, hi), v| (lo.min(v), hi.max(v))))
    }

    /// Dequantizes `q` into `out` (f32, bf16 or f16).
    pub fn dequantize<T: GpuElement>(
        &self,
        q: &DeviceQuantized,
        out: &mut CudaViewMut<'_, T>,
    ) -> Result<(), CudaError> {
        self.dequantize_view(&q.view(), out)
    }

    /// [`Gpu::dequantize`] from borrowed buffers.
    pub fn dequantize_view<T: GpuElement>(
        &self,
        q: &QuantView<'_>,
        out: &mut CudaViewMut<'_, T>,
    ) -> Result<(), CudaError> {
        self.dequantize_with(q, out, &dequantize_kernel(&q.format, Some(T::TAG)))
    }

    /// Adds the dequantized values of `q` to `acc`, in f32.
    pub fn dequantize_accumulate(
        &self,
        q: &DeviceQuantized,
        acc: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        self.dequantize_accumulate_view(&q.view(), acc)
    }

    /// [`Gpu::dequantize_accumulate`] from borrowed buffers.
    pub fn dequantize_accumulate_view(
        &self,
        q: &QuantView<'_>,
        acc: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        self.dequantize_with(q, acc, &dequantize_kernel(&q.format, None))
    }

    /// `x /= d` on the device (each quotient rounded, as the CPU divides).
    pub fn divide(&self, x: &mut CudaViewMut<'_, f32>, d: f32) -> Result<(), CudaError> {
        if x.is_empty() {
            return Ok(());
        }
        let n = x.len() as u64;
        let grid = n
            .div_ceil(u64::from(THREADS))
            .min(crate::kernels::MAX_STRIDE_GRID);
        // SAFETY: (float*, u64, float) as dequantize.cu declares it.
        launch!(unsafe self, "dequantize", "zq_div_f32", grid, [x, &n, &d])?;
        Ok(())
    }

    /// `y = x` widened to f32 (`zq_to_f32_E`, equal lengths).
    pub fn widen<T: GpuElement>(
        &self,
        x: &CudaView<'_, T>,
        y: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        self.cast(&format!("zq_to_f32_{}", T::TAG), x, y)
    }

    /// `y = x` narrowed from f32, rounded to nearest even
    /// (`zq_from_f32_E`, equal lengths).
    pub fn narrow<T: GpuElement>(
        &self,
        x: &CudaView<'_, f32>,
        y: &mut CudaViewMut<'_, T>,
    ) -> Result<(), CudaError> {
        self.cast(&format!("zq_from_f32_{}", T::TAG), x, y)
    }

    /// Launches the cast kernel `name` of `x` into `y` (equal lengths).
    fn cast<A: GpuElement, B: GpuElement>(
        &self,
        name: &str,
        x: &CudaView<'_, A>,
        y: &mut CudaViewMut<'_, B>,
    ) -> Result<(), CudaError> {
        size_check("values of a cast", x.len(), y.len())?;
        if x.is_empty() {
            return Ok(());
        }
        let n = x.len() as u64;
        let grid = crate::kernels::stride_grid(n);
        // SAFETY: (const A*, B*, u64) as dequantize.cu declares the kernel
        // `name` (zq_to_f32_E: A = E, B = f32; zq_from_f32_E: the other way);
        // both buffers hold `n` values.
        launch!(unsafe self, "dequantize", name, grid, [x, y, &n])?;
        Ok(())
    }

    /// Every whole block of `block` values of `x` rotated by the
    /// orthonormal Walsh–Hadamard matrix, a shorter tail left as it is
    /// (`zeropp_quant::hadamard::rotate_blocks`, bit for bit).
    pub fn hadamard(&self, x: &mut CudaViewMut<'_, f32>, block: usize) -> Result<(), CudaError> {
        if !block.is_power_of_two() {
            return Err(QuantError::InvalidFormat(format!(
                "a Hadamard rotation over blocks of {block} values: use a power of two"
            ))
            .into());
        }
        let whole = (x.len() / block * block) as u64;
        if whole == 0 {
            return Ok(());
        }
        let name = "zq_hadamard_stage_f32";
        let grid = crate::kernels::stride_grid(whole / 2);
        let mut x = x.slice_mut(..whole as usize);
        let b = block as u64;
        for (h, scale) in crate::kernels::hadamard_stages(block) {
            // SAFETY: (float*, u64, u64, u64, float) as dequantize.cu
            // declares it; `x` holds `whole` values, whole blocks of them.
            launch!(unsafe self, "dequantize", name, grid, [&mut x, &whole, &b, &h, &scale])?;
        }
        Ok(())
    }

    /// `x = a·x + b·y` on the device (equal lengths); with ±1 factors it
    /// is exactly `x + y` or `y - x`, as the CPU computes them.
    pub fn axpby(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        y: &CudaView<'_, f32>,
        a: f32,
        b: f32,
    ) -> Result<(), CudaError> {
        size_check("values of y", x.len(), y.len())?;
        if x.is_empty() {
            return Ok(());
        }
        let n = x.len() as u64;
        let grid = n
            .div_ceil(u64::from(THREADS))
            .min(crate::kernels::MAX_STRIDE_GRID);
        // SAFETY: (float*, const float*, u64, float, float) as dequantize.cu
        // declares it; both buffers hold `n` values.
        launch!(unsafe self, "dequantize", "zq_axpby_f32", grid, [x, y, &n, &a, &b])?;
        Ok(())
    }

    fn dequantize_with<T: GpuElement>(
        &self,
        q: &QuantView<'_>,
        out: &mut CudaViewMut<'_, T>,
        name: &str,
    ) -> Result<(), CudaError> {
        q.check()?;
        size_check("output values", q.len, out.len())?;
        if q.len == 0 {
            return Ok(());
        }
        let mut err = self.err.lock().expect("error slots poisoned");
        self.reset_err(&mut err)?;
        let (len, block) = (q.len as u64, q.format.block as u32);
        let grid = dequantize_grid(&q.format, q.len);
        // SAFETY: as in `quantize_chunks` (dequantize.cu's signature).
        launch!(
            unsafe self,
            "dequantize",
            name,
            grid,
            [&q.codes, &q.block_max, &q.block_min, &len, &block, out, &mut *err]
        )?;
        let [_, bad] = self.read_err(&err)?;
        if bad != u64::MAX {
            return Err(self.corrupt_params(q, bad as usize)?.into());
        }
        Ok(())
    }

    fn corrupt_params(&self, q: &QuantView<'_>, block: usize) -> Result<QuantError, CudaError> {
        let max = self.download(&q.block_max.slice(block..block + 1))?[0];
        let min = if q.block_min.is_empty() {
            0.0
        } else {
            self.download(&q.block_min.slice(block..block + 1))?[0]
        };
        Ok(QuantError::CorruptParams { block, min, max })
    }

    /// Dequantizes every input, sums in f32 (from +0, in input order) and
    /// quantizes the sum into `out`: the fused qgZ step. Inputs may differ in
    /// format; all must hold `out.len` values.
    pub fn sum_requantize(
        &self,
        inputs: &[&DeviceQuantized],
        rounding: Rounding,
        out: &mut DeviceQuantized,
    ) -> Result<(), CudaError> {
        let views: Vec<QuantView<'_>> = inputs.iter().map(|q| q.view()).collect();
        self.sum_requantize_views(&views, rounding, &mut out.view_mut())
    }

    /// [`Gpu::sum_requantize`] over borrowed buffers.
    pub fn sum_requantize_views(
        &self,
        inputs: &[QuantView<'_>],
        rounding: Rounding,
        out: &mut QuantViewMut<'_>,
    ) -> Result<(), CudaError> {
        out.check()?;
        for q in inputs {
            q.check()?;
            size_check("input values", out.len, q.len)?;
        }
        let f = out.format;
        let blocks = f.num_blocks(out.len) as u64;
        if blocks == 0 {
            return Ok(());
        }
        let descs: Vec<QInput> = inputs.iter().map(|q| QInput::of(q, &self.stream)).collect();
        let descs_dev = self.upload(&descs)?;
        let (name, seed) = sum_requantize_kernel(&f, rounding);
        let mut err = self.err.lock().expect("error slots poisoned");
        self.reset_err(&mut err)?;
        let (k, len, block) = (inputs.len() as u32, out.len as u64, f.block as u32);
        // SAFETY: as in `quantize_chunks` (qgz.cu's signature); the input
        // descriptors point into buffers borrowed for the whole call.
        launch!(
            unsafe self,
            "qgz",
            &name,
            quantize_grid(&f, blocks),
            [
                &descs_dev,
                &k,
                &len,
                &block,
                &seed,
                &mut out.codes,
                &mut out.block_max,
                &mut out.block_min,
                &mut *err
            ]
        )?;
        let [key, bad] = self.read_err(&err)?;
        drop(err);
        if let Some((j, block)) = decode_corrupt_input(bad) {
            return Err(self.corrupt_params(&inputs[j], block)?.into());
        }
        if let Some(fault) = decode_fault(key) {
            let (block, offset) = match fault {
                Fault::NonFinite { block, offset } => (block as usize, Some(offset as usize)),
                Fault::RangeOverflow { block } => (block as usize, None),
            };
            // The sum is never stored: recompute the offending values on the host.
            let host: Vec<QuantizedTensor> = inputs
                .iter()
                .map(|q| q.to_host(self))
                .collect::<Result<_, _>>()?;
            let start = block * f.block;
            let end = (start + f.block).min(out.len);
            let mut sum = vec![0f32; end - start];
            for h in &host {
                let v = h.dequantize::<f32>()?;
                for (s, x) in sum.iter_mut().zip(&v[start..end]) {
                    *s += x;
                }
            }
            let Some(offset) = offset else {
                let (min, max) = sum
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
                return Err(QuantError::RangeOverflow { block, min, max }.into());
            };
            return Err(QuantError::NonFinite {
                block,
                index: start + offset,
                value: sum[offset],
            }
            .into());
        }
        Ok(())
    }

    /// Waits for all work queued on the stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().during(|| "synchronizing".into())
    }
}

/// One quantize kernel's launch: its format, chunks and rounding.
struct QuantizeLaunch {
    format: QuantFormat,
    chunk_len: usize,
    count: usize,
    nodes: usize,
    rpn: usize,
    rounding: Rounding,
    part_seeds: bool,
}

fn size_check(what: &'static str, expected: usize, found: usize) -> Result<(), CudaError> {
    Ok(zeropp_quant::views::check_size(what, expected, found)?)
}

fn grid_config(grid: u64, name: &str) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (crate::kernels::launch_grid(grid, name)?, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// `zq::QInput` of qgz.cu: one input of the fused kernel.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct QInput {
    codes: u64,
    bmax: u64,
    bmin: u64,
    len: u64,
    bits: u32,
    asym: u32,
    block: u32,
    reserved: u32,
}
// SAFETY: plain old data of integers, laid out as the kernel's struct.
unsafe impl DeviceRepr for QInput {}
const _: () = assert!(std::mem::size_of::<QInput>() == 48);

impl QInput {
    fn of(q: &QuantView<'_>, stream: &Arc<CudaStream>) -> QInput {
        let ptr = |s: &CudaView<'_, u8>| s.device_ptr(stream).0;
        let ptr_f = |s: &CudaView<'_, f32>| {
            if s.is_empty() {
                0
            } else {
                s.device_ptr(stream).0
            }
        };
        QInput {
            codes: ptr(&q.codes),
            bmax: ptr_f(&q.block_max),
            bmin: ptr_f(&q.block_min),
            len: q.len as u64,
            bits: q.format.bits.count(),
            asym: u32::from(q.format.scheme == zeropp_quant::Scheme::Asymmetric),
            block: q.format.block as u32,
            reserved: 0,
        }
    }
}

/// Device memory another library owns, borrowed for one call
/// ([`Gpu::borrow`]): views like any device buffer, never freed here.
pub struct Borrowed<T> {
    slice: std::mem::ManuallyDrop<CudaSlice<T>>,
}

impl<T> Borrowed<T> {
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slice.is_empty()
    }

    pub fn view(&self) -> CudaView<'_, T> {
        self.slice.as_view()
    }

    pub fn view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice.as_view_mut()
    }
}

impl<T> Drop for Borrowed<T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here; `leak` gives the memory back to its
        // owner instead of freeing it.
        let slice = unsafe { std::mem::ManuallyDrop::take(&mut self.slice) };
        slice.leak();
    }
}

/// A quantized tensor in device memory (the layout of `QuantizedTensor`).
pub struct DeviceQuantized {
    pub format: QuantFormat,
    pub len: usize,
    pub codes: CudaSlice<u8>,
    pub block_max: CudaSlice<f32>,
    /// Empty for the symmetric scheme.
    pub block_min: CudaSlice<f32>,
}

impl DeviceQuantized {
    /// Zeroed buffers for `len` values.
    pub fn zeroed(gpu: &Gpu, format: QuantFormat, len: usize) -> Result<Self, CudaError> {
        Ok(DeviceQuantized {
            format,
            len,
            codes: gpu.zeros(format.code_bytes(len))?,
            block_max: gpu.zeros(format.num_blocks(len))?,
            block_min: gpu.zeros(format.num_block_mins(len))?,
        })
    }

    /// Copies a host tensor to the device.
    pub fn from_host(gpu: &Gpu, q: &QuantizedTensor) -> Result<Self, CudaError> {
        Ok(DeviceQuantized {
            format: q.format,
            len: q.len,
            codes: gpu.upload(&q.codes)?,
            block_max: gpu.upload(&q.block_max)?,
            block_min: gpu.upload(&q.block_min)?,
        })
    }

    /// Copies the tensor back to the host.
    pub fn to_host(&self, gpu: &Gpu) -> Result<QuantizedTensor, CudaError> {
        self.view().to_host(gpu)
    }

    /// Bytes on the wire (codes and block parameters).
    pub fn bytes(&self) -> usize {
        self.format.total_bytes(self.len)
    }

    pub fn view(&self) -> QuantView<'_> {
        QuantView {
            format: self.format,
            len: self.len,
            codes: self.codes.as_view(),
            block_max: self.block_max.as_view(),
            block_min: self.block_min.as_view(),
        }
    }

    pub fn view_mut(&mut self) -> QuantViewMut<'_> {
        QuantViewMut {
            format: self.format,
            len: self.len,
            codes: self.codes.as_view_mut(),
            block_max: self.block_max.as_view_mut(),
            block_min: self.block_min.as_view_mut(),
        }
    }
}

/// Borrowed device buffers of a quantized tensor: parts of a larger buffer
/// (a received all-gather, a packed message) work as well as owned ones.
pub struct QuantView<'a> {
    pub format: QuantFormat,
    pub len: usize,
    pub codes: CudaView<'a, u8>,
    pub block_max: CudaView<'a, f32>,
    /// Empty for the symmetric scheme.
    pub block_min: CudaView<'a, f32>,
}

/// Writable [`QuantView`].
pub struct QuantViewMut<'a> {
    pub format: QuantFormat,
    pub len: usize,
    pub codes: CudaViewMut<'a, u8>,
    pub block_max: CudaViewMut<'a, f32>,
    pub block_min: CudaViewMut<'a, f32>,
}

fn check_parts(
    f: &QuantFormat,
    len: usize,
    [codes, maxima, minima]: [usize; 3],
) -> Result<(), CudaError> {
    Ok(zeropp_quant::views::check_sizes(
        f,
        len,
        (codes, maxima, minima),
    )?)
}

impl QuantView<'_> {
    /// The buffers have exactly the sizes the format gives for `len`.
    pub fn check(&self) -> Result<(), CudaError> {
        check_parts(
            &self.format,
            self.len,
            [self.codes.len(), self.block_max.len(), self.block_min.len()],
        )
    }

    /// Copies the tensor to the host.
    pub fn to_host(&self, gpu: &Gpu) -> Result<QuantizedTensor, CudaError> {
        Ok(QuantizedTensor {
            format: self.format,
            len: self.len,
            codes: gpu.download(&self.codes)?,
            block_max: gpu.download(&self.block_max)?,
            block_min: gpu.download(&self.block_min)?,
        })
    }
}

impl QuantViewMut<'_> {
    pub fn check(&self) -> Result<(), CudaError> {
        check_parts(
            &self.format,
            self.len,
            [self.codes.len(), self.block_max.len(), self.block_min.len()],
        )
    }
}

/// W quantized chunks back to back (the layout of `QuantizedChunks`).
pub struct DeviceQuantizedChunks {
    pub format: QuantFormat,
    pub chunk_len: usize,
    pub count: usize,
    pub codes: CudaSlice<u8>,
    pub block_max: CudaSlice<f32>,
    pub block_min: CudaSlice<f32>,
}

impl DeviceQuantizedChunks {
    pub fn zeroed(
        gpu: &Gpu,
        format: QuantFormat,
        chunk_len: usize,
        count: usize,
    ) -> Result<Self, CudaError> {
        Ok(DeviceQuantizedChunks {
            format,
            chunk_len,
            count,
            codes: gpu.zeros(count * format.code_bytes(chunk_len))?,
            block_max: gpu.zeros(count * format.num_blocks(chunk_len))?,
            block_min: gpu.zeros(count * format.num_block_mins(chunk_len))?,
        })
    }

    pub fn to_host(&self, gpu: &Gpu) -> Result<QuantizedChunks, CudaError> {
        Ok(QuantizedChunks {
            format: self.format,
            chunk_len: self.chunk_len,
            count: self.count,
            codes: gpu.download(&self.codes.as_view())?,
            block_max: gpu.download(&self.block_max.as_view())?,
            block_min: gpu.download(&self.block_min.as_view())?,
        })
    }
}
