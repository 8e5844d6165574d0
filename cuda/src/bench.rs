//! The GPU benchmark: GB/s of each kernel on a large input and its ratio to a
//! device-to-device copy of the same bytes measured in the same run (bytes
//! moved = bytes read + bytes written, for the copy as for the kernels).

use cudarc::driver::CudaSlice;
use cudarc::driver::sys::CUevent_flags;
use half::bf16;
use zeropp_quant::{Bits, QuantFormat, Rounding, Scheme};

use crate::device::{DeviceQuantized, DeviceQuantizedChunks, Gpu};
use crate::{CudaError, DriverContext};

/// One measured kernel.
#[derive(Clone, Debug)]
pub struct BenchRow {
    pub kernel: String,
    /// Bytes read plus bytes written per run.
    pub bytes_moved: u64,
    /// Median seconds per run.
    pub seconds: f64,
    pub gbps: f64,
    /// `gbps` over the copy's GB/s in this run.
    pub ratio_to_copy: f64,
}

/// Median seconds of `reps` timed runs of `f` (after one warm-up), timed by
/// CUDA events on the GPU's stream.
fn time(
    gpu: &Gpu,
    reps: usize,
    mut f: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    f()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let s = gpu.stream();
        let start = s
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .during(|| "recording an event".into())?;
        f()?;
        let end = s
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .during(|| "recording an event".into())?;
        end.synchronize().during(|| "waiting for an event".into())?;
        let ms = start
            .elapsed_ms(&end)
            .during(|| "reading an event".into())?;
        times.push(f64::from(ms) / 1e3);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}

/// Runs the benchmark on `mib` MiB of f32 input (the bf16 rows use half the
/// bytes for the same number of values).
pub fn run(gpu: &Gpu, mib: usize, reps: usize) -> Result<Vec<BenchRow>, CudaError> {
    let n = mib * (1 << 20) / 4;
    let x: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.618_034).sin()).collect();
    let dx = gpu.upload(&x)?;
    drop(x);
    let mut copy_dst = gpu.zeros::<f32>(n)?;
    let copy_s = time(gpu, reps, || {
        gpu.stream()
            .memcpy_dtod(&dx, &mut copy_dst)
            .during(|| "device-to-device copy".into())
    })?;
    drop(copy_dst);
    let copy_bytes = 2 * 4 * n as u64;
    let mut rows = Rows {
        copy_gbps: copy_bytes as f64 / copy_s / 1e9,
        rows: Vec::new(),
    };
    rows.push("copy f32 (device to device)".into(), copy_bytes, copy_s);
    let x = (gpu, &dx, n, reps);
    f32_formats(x, &mut rows)?;
    bf16_weights(x, &mut rows)?;
    qgz_steps(x, &mut rows)?;
    Ok(rows.rows)
}

/// What each bench reads: the device, the f32 input, its length and the
/// repetitions.
type Input<'a> = (&'a Gpu, &'a CudaSlice<f32>, usize, usize);

/// The measured rows, each with its ratio to the copy's GB/s.
struct Rows {
    copy_gbps: f64,
    rows: Vec<BenchRow>,
}

impl Rows {
    fn push(&mut self, kernel: String, bytes: u64, s: f64) {
        let gbps = bytes as f64 / s / 1e9;
        self.rows.push(BenchRow {
            kernel,
            bytes_moved: bytes,
            seconds: s,
            gbps,
            ratio_to_copy: gbps / self.copy_gbps,
        });
    }
}

/// Quantize, dequantize and dequantize-accumulate of f32 in int8 and
/// int4, and int4 with stochastic rounding.
fn f32_formats((gpu, dx, n, reps): Input<'_>, rows: &mut Rows) -> Result<(), CudaError> {
    let int8 = QuantFormat::int8(256)?;
    let int4 = QuantFormat::int4(256)?;
    let rn = Rounding::NearestEven;
    for f in [int8, int4] {
        let mut q = DeviceQuantized::zeroed(gpu, f, n)?;
        let s = time(gpu, reps, || gpu.quantize(&dx.as_view(), rn, &mut q))?;
        rows.push(
            format!("quantize f32 -> {f}"),
            (4 * n + q.bytes()) as u64,
            s,
        );
        let mut out = gpu.zeros::<f32>(n)?;
        let s = time(gpu, reps, || gpu.dequantize(&q, &mut out.as_view_mut()))?;
        rows.push(
            format!("dequantize {f} -> f32"),
            (4 * n + q.bytes()) as u64,
            s,
        );
        let s = time(gpu, reps, || {
            gpu.dequantize_accumulate(&q, &mut out.as_view_mut())
        })?;
        rows.push(
            format!("dequantize-accumulate {f} -> f32"),
            (8 * n + q.bytes()) as u64,
            s,
        );
    }
    let mut q4 = DeviceQuantized::zeroed(gpu, int4, n)?;
    let s = time(gpu, reps, || {
        gpu.quantize(&dx.as_view(), Rounding::Stochastic { seed: 1 }, &mut q4)
    })?;
    rows.push(
        format!("quantize f32 -> {int4} stochastic"),
        (4 * n + q4.bytes()) as u64,
        s,
    );
    Ok(())
}

/// bf16 weights (the qwZ case): int8 quantize and dequantize.
fn bf16_weights((gpu, dx, n, reps): Input<'_>, rows: &mut Rows) -> Result<(), CudaError> {
    let int8 = QuantFormat::int8(256)?;
    let rn = Rounding::NearestEven;
    let xb: Vec<bf16> = gpu
        .download(&dx.as_view())?
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let dxb = gpu.upload(&xb)?;
    drop(xb);
    let mut q8 = DeviceQuantized::zeroed(gpu, int8, n)?;
    let s = time(gpu, reps, || gpu.quantize(&dxb.as_view(), rn, &mut q8))?;
    rows.push(
        format!("quantize bf16 -> {int8}"),
        (2 * n + q8.bytes()) as u64,
        s,
    );
    let mut outb = gpu.zeros::<bf16>(n)?;
    let s = time(gpu, reps, || gpu.dequantize(&q8, &mut outb.as_view_mut()))?;
    rows.push(
        format!("dequantize {int8} -> bf16"),
        (2 * n + q8.bytes()) as u64,
        s,
    );
    Ok(())
}

/// qgZ: swizzled int4 quantize of a gradient for 2 nodes x 4 ranks, then
/// the fused step summing 4 received chunks.
fn qgz_steps((gpu, dx, n, reps): Input<'_>, rows: &mut Rows) -> Result<(), CudaError> {
    let rn = Rounding::NearestEven;
    let g32 = QuantFormat::new(Bits::Four, Scheme::Symmetric, 32)?;
    let mut sw = DeviceQuantizedChunks::zeroed(gpu, g32, n / 8, 8)?;
    let s = time(gpu, reps, || {
        gpu.quantize_swizzled(&dx.as_view(), 2, 4, rn, &mut sw)
    })?;
    rows.push(
        format!("swizzled quantize f32 -> {g32} (2x4)"),
        (4 * n + g32.total_bytes(n)) as u64,
        s,
    );
    drop(sw);
    let k = 4;
    let part = n / k;
    let parts: Vec<DeviceQuantized> = (0..k)
        .map(|i| {
            let mut q = DeviceQuantized::zeroed(gpu, g32, part)?;
            gpu.quantize(&dx.slice(i * part..(i + 1) * part), rn, &mut q)?;
            Ok(q)
        })
        .collect::<Result<_, CudaError>>()?;
    let refs: Vec<&DeviceQuantized> = parts.iter().collect();
    let mut fused = DeviceQuantized::zeroed(gpu, g32, part)?;
    let s = time(gpu, reps, || gpu.sum_requantize(&refs, rn, &mut fused))?;
    rows.push(
        format!("fused sum-requantize {k} x {g32} -> {g32}"),
        ((k + 1) * g32.total_bytes(part)) as u64,
        s,
    );
    Ok(())
}

/// The rows as a table.
pub fn render(rows: &[BenchRow], mib: usize, device: &str) -> String {
    let mut s =
        format!("GPU kernels on {device}, {mib} MiB of f32 input (bf16 rows: same values)\n");
    s.push_str(&format!(
        "{:<48} {:>10} {:>10} {:>8}\n",
        "kernel", "ms", "GB/s", "x copy"
    ));
    for r in rows {
        s.push_str(&format!(
            "{:<48} {:>10.3} {:>10.1} {:>8.2}\n",
            r.kernel,
            r.seconds * 1e3,
            r.gbps,
            r.ratio_to_copy
        ));
    }
    s
}
