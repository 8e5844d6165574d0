//! Runs zeropp's CUDA kernels (`cuda/kernels/*.cu`) on the CPU, for tests on
//! machines without a GPU: the sources are compiled for the host with a small
//! CUDA stand-in (`src/emu.h`: one fiber per CUDA thread, switched
//! cooperatively at the barriers of `__syncthreads` and warp shuffles). It checks the kernels' logic —
//! indexing, teams, reductions, packing, error keys, rounding — with the same
//! IEEE single arithmetic; it says nothing about speed, and a GPU run
//! (`cuda/check-on-gpu.sh`) remains the final word.
//!
//! Entry points take the kernel's name (as the Rust launchers build it), the
//! grid, and host buffers, and return the kernel's two error slots.

use std::ffi::{CString, c_char, c_void};

unsafe extern "C" {
    fn zq_emu_quantize(
        name: *const c_char,
        grid: u32,
        input: *const c_void,
        chunk_len: u64,
        count: u32,
        nodes: u32,
        rpn: u32,
        block: u32,
        seed: u64,
        part_seeds: u32,
        codes: *mut u8,
        bmax: *mut f32,
        bmin: *mut f32,
        err: *mut u64,
    ) -> i32;
    fn zq_emu_dequantize(
        name: *const c_char,
        grid: u32,
        codes: *const u8,
        bmax: *const f32,
        bmin: *const f32,
        len: u64,
        block: u32,
        out: *mut c_void,
        err: *mut u64,
    ) -> i32;
    fn zq_emu_sum_requantize(
        name: *const c_char,
        grid: u32,
        inputs: *const c_void,
        k: u32,
        len: u64,
        block: u32,
        seed: u64,
        codes: *mut u8,
        bmax: *mut f32,
        bmin: *mut f32,
        err: *mut u64,
    ) -> i32;
    fn zq_emu_qinput_size() -> u32;
    fn zq_emu_div_f32(grid: u32, x: *mut f32, n: u64, d: f32);
    fn zq_emu_axpby_f32(grid: u32, x: *mut f32, y: *const f32, n: u64, a: f32, b: f32);
    fn zq_emu_cast(name: *const c_char, grid: u32, x: *const c_void, y: *mut c_void, n: u64)
    -> i32;
    fn zq_emu_hadamard_stage_f32(grid: u32, x: *mut f32, n: u64, block: u64, h: u64, scale: f32);
}

/// Launches the cast kernel `name` (`zq_to_f32_E`: `x` of element E into
/// f32 `y`; `zq_from_f32_E`: the other way), `n` values.
///
/// # Safety
/// `x` and `y` must hold `n` values of the kernel's input and output types.
pub unsafe fn cast(name: &str, grid: u32, x: *const c_void, y: *mut c_void, n: u64) {
    let c = c_name(name);
    // SAFETY: the caller's promise on the buffers; the name is NUL-terminated.
    checked(unsafe { zq_emu_cast(c.as_ptr(), grid, x, y, n) }, name);
}

/// Launches one stage of `zq_hadamard_stage_f32` over `x` (whole blocks).
pub fn hadamard_stage_f32(grid: u32, x: &mut [f32], block: u64, h: u64, scale: f32) {
    assert!(
        (x.len() as u64).is_multiple_of(block),
        "a Hadamard stage over part of a block"
    );
    // SAFETY: the buffer lives across the call and holds `x.len()` values.
    unsafe { zq_emu_hadamard_stage_f32(grid, x.as_mut_ptr(), x.len() as u64, block, h, scale) }
}

/// Launches `zq_div_f32` (x /= d).
pub fn div_f32(grid: u32, x: &mut [f32], d: f32) {
    // SAFETY: the buffer lives across the call and holds `x.len()` values.
    unsafe { zq_emu_div_f32(grid, x.as_mut_ptr(), x.len() as u64, d) }
}

/// Launches `zq_axpby_f32` (x = a·x + b·y).
pub fn axpby_f32(grid: u32, x: &mut [f32], y: &[f32], a: f32, b: f32) {
    assert_eq!(x.len(), y.len(), "axpby of buffers of different lengths");
    // SAFETY: both buffers live across the call and hold `x.len()` values.
    unsafe { zq_emu_axpby_f32(grid, x.as_mut_ptr(), y.as_ptr(), x.len() as u64, a, b) }
}

/// The kernels' error slots after a launch (`u64::MAX` = nothing reported).
pub type ErrSlots = [u64; 2];

fn c_name(name: &str) -> CString {
    CString::new(name).expect("kernel names hold no NUL")
}

fn checked(rc: i32, name: &str) {
    assert_eq!(rc, 0, "the emulator has no kernel named {name}");
}

/// What `quantize.cu`'s kernels take besides the buffers.
#[derive(Clone, Copy, Debug)]
pub struct QuantizeParams {
    pub chunk_len: u64,
    pub count: u32,
    pub nodes: u32,
    pub rpn: u32,
    pub block: u32,
    pub seed: u64,
    pub part_seeds: bool,
}

/// Launches a quantize kernel over host buffers. The caller sizes the
/// buffers as the launcher would (the kernel trusts them).
#[allow(clippy::too_many_arguments)]
pub fn quantize<T: Copy>(
    name: &str,
    grid: u32,
    input: &[T],
    p: QuantizeParams,
    codes: &mut [u8],
    bmax: &mut [f32],
    bmin: &mut [f32],
) -> ErrSlots {
    assert_eq!(input.len() as u64, p.chunk_len * u64::from(p.count));
    let mut err = [u64::MAX; 2];
    let n = c_name(name);
    // SAFETY: buffers live across the call; sizes are the caller's contract,
    // as they are for the GPU launch.
    let rc = unsafe {
        zq_emu_quantize(
            n.as_ptr(),
            grid,
            input.as_ptr().cast(),
            p.chunk_len,
            p.count,
            p.nodes,
            p.rpn,
            p.block,
            p.seed,
            u32::from(p.part_seeds),
            codes.as_mut_ptr(),
            bmax.as_mut_ptr(),
            bmin.as_mut_ptr(),
            err.as_mut_ptr(),
        )
    };
    checked(rc, name);
    err
}

/// Launches a dequantize (or dequantize-accumulate) kernel.
#[allow(clippy::too_many_arguments)]
pub fn dequantize<T: Copy>(
    name: &str,
    grid: u32,
    codes: &[u8],
    bmax: &[f32],
    bmin: &[f32],
    block: u32,
    out: &mut [T],
) -> ErrSlots {
    let mut err = [u64::MAX; 2];
    let n = c_name(name);
    // SAFETY: as in `quantize`.
    let rc = unsafe {
        zq_emu_dequantize(
            n.as_ptr(),
            grid,
            codes.as_ptr(),
            bmax.as_ptr(),
            bmin.as_ptr(),
            out.len() as u64,
            block,
            out.as_mut_ptr().cast(),
            err.as_mut_ptr(),
        )
    };
    checked(rc, name);
    err
}

/// One input of the fused kernel (`zq::QInput`), over host buffers.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct QInput {
    pub codes: *const u8,
    pub bmax: *const f32,
    pub bmin: *const f32,
    pub len: u64,
    pub bits: u32,
    pub asym: u32,
    pub block: u32,
    pub reserved: u32,
}

impl QInput {
    /// The descriptor of a quantized tensor on the host (its buffers must
    /// outlive the launch that reads it).
    pub fn of(q: &zeropp_quant::QuantizedRef<'_>) -> QInput {
        QInput {
            codes: q.codes.as_ptr(),
            bmax: q.block_max.as_ptr(),
            bmin: if q.block_min.is_empty() {
                std::ptr::null()
            } else {
                q.block_min.as_ptr()
            },
            len: q.len as u64,
            bits: q.format.bits.count(),
            asym: u32::from(q.format.scheme == zeropp_quant::Scheme::Asymmetric),
            block: q.format.block as u32,
            reserved: 0,
        }
    }
}

/// Size of `zq::QInput` as the kernels' compiler lays it out.
pub fn qinput_size() -> usize {
    // SAFETY: returns a constant.
    unsafe { zq_emu_qinput_size() as usize }
}

/// Launches a fused sum-requantize kernel.
#[allow(clippy::too_many_arguments)]
pub fn sum_requantize(
    name: &str,
    grid: u32,
    inputs: &[QInput],
    len: u64,
    block: u32,
    seed: u64,
    codes: &mut [u8],
    bmax: &mut [f32],
    bmin: &mut [f32],
) -> ErrSlots {
    assert_eq!(std::mem::size_of::<QInput>(), qinput_size());
    let mut err = [u64::MAX; 2];
    let n = c_name(name);
    // SAFETY: as in `quantize`; the descriptors point at live host buffers.
    let rc = unsafe {
        zq_emu_sum_requantize(
            n.as_ptr(),
            grid,
            inputs.as_ptr().cast(),
            inputs.len() as u32,
            len,
            block,
            seed,
            codes.as_mut_ptr(),
            bmax.as_mut_ptr(),
            bmin.as_mut_ptr(),
            err.as_mut_ptr(),
        )
    };
    checked(rc, name);
    err
}
