//! The kernels against the CPU library, on a GPU.
//!
//! Each GPU test is ignored with the reason "needs an NVIDIA GPU" (CI has
//! none); `cuda/check-on-gpu.sh` runs them with `--include-ignored`, and
//! there a missing GPU is a failure, not a skip. `no_gpu_is_a_clear_error`
//! runs everywhere.

mod common;

use common::{FORMATS, assert_same, bits, values};
use half::{bf16, f16};
use zeropp_cuda::device::{device_count, driver_present};
use zeropp_cuda::{CudaError, DeviceQuantized, DeviceQuantizedChunks, Gpu, GpuElement};
use zeropp_quant::{
    Bits, QuantError, QuantFormat, QuantizedChunks, QuantizedTensor, Rounding, Scheme,
    quantize_swizzled, sum_requantize,
};

const BLOCKS: [usize; 5] = [32, 64, 256, 2048, 65536];
const LENGTHS: [usize; 6] = [1, 31, 33, 1000, 4099, 70001];

fn gpu() -> Gpu {
    Gpu::open(0).unwrap_or_else(|e| panic!("these tests need a GPU: {e}"))
}

fn roundtrip_element<T: GpuElement + PartialEq + std::fmt::Debug>(g: &Gpu) {
    for (b, scheme) in FORMATS {
        for block in BLOCKS {
            let f = QuantFormat::new(b, scheme, block).unwrap();
            for (k, len) in LENGTHS.into_iter().enumerate() {
                let what = format!("{} {f} len {len}", T::TAG);
                let x: Vec<T> = values(len, k as u64);
                let cpu = QuantizedTensor::quantize(&x, f, Rounding::NearestEven).unwrap();
                let dx = g.upload(&x).unwrap();
                let mut dq = DeviceQuantized::zeroed(g, f, len).unwrap();
                g.quantize(&dx.as_view(), Rounding::NearestEven, &mut dq)
                    .unwrap();
                assert_same(&dq.to_host(g).unwrap(), &cpu, &what);

                // Dequantize to the same type, and accumulate into f32.
                let want: Vec<T> = cpu.dequantize().unwrap();
                let mut out = g.zeros::<T>(len).unwrap();
                g.dequantize(&dq, &mut out.as_view_mut()).unwrap();
                assert_eq!(
                    g.download(&out.as_view()).unwrap(),
                    want,
                    "dequantize {what}"
                );
                let base: Vec<f32> = values(len, 99);
                let mut acc_cpu = base.clone();
                zeropp_quant::dequantize_accumulate(cpu.as_ref(), &mut acc_cpu).unwrap();
                let mut acc = g.upload(&base).unwrap();
                g.dequantize_accumulate(&dq, &mut acc.as_view_mut())
                    .unwrap();
                let got = g.download(&acc.as_view()).unwrap();
                assert_eq!(bits(&got), bits(&acc_cpu), "accumulate {what}");
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run cuda/check-on-gpu.sh"]
fn quantize_and_dequantize_match_the_cpu_bit_for_bit() {
    let g = gpu();
    roundtrip_element::<f32>(&g);
    roundtrip_element::<bf16>(&g);
    roundtrip_element::<f16>(&g);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run cuda/check-on-gpu.sh"]
fn swizzled_quantize_matches_the_cpu() {
    let g = gpu();
    for (nodes, rpn) in [(1, 1), (2, 2), (3, 2), (2, 4)] {
        for (bits, scheme) in FORMATS {
            let f = QuantFormat::new(bits, scheme, 32).unwrap();
            let world = nodes * rpn;
            let chunk = 1000 + 3; // partial last block in every chunk
            let x: Vec<f32> = values(world * chunk, world as u64);
            let mut cpu = QuantizedChunks::zeroed(f, chunk, world);
            quantize_swizzled(&x, nodes, rpn, Rounding::NearestEven, &mut cpu).unwrap();
            let dx = g.upload(&x).unwrap();
            let mut dq = DeviceQuantizedChunks::zeroed(&g, f, chunk, world).unwrap();
            g.quantize_swizzled(&dx.as_view(), nodes, rpn, Rounding::NearestEven, &mut dq)
                .unwrap();
            assert_eq!(dq.to_host(&g).unwrap(), cpu, "{nodes}x{rpn} {f}");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run cuda/check-on-gpu.sh"]
fn fused_sum_requantize_matches_the_cpu() {
    let g = gpu();
    let len = 5000 + 17;
    // Inputs in different formats, as the CPU library allows.
    let in_formats = [
        QuantFormat::int4(32).unwrap(),
        QuantFormat::int8(256).unwrap(),
        QuantFormat::new(Bits::Four, Scheme::Asymmetric, 64).unwrap(),
    ];
    let inputs: Vec<QuantizedTensor> = in_formats
        .iter()
        .enumerate()
        .map(|(k, f)| {
            QuantizedTensor::quantize(
                &values::<f32>(len, 10 + k as u64),
                *f,
                Rounding::NearestEven,
            )
            .unwrap()
        })
        .collect();
    let dev: Vec<DeviceQuantized> = inputs
        .iter()
        .map(|q| DeviceQuantized::from_host(&g, q).unwrap())
        .collect();
    for (bits, scheme) in FORMATS {
        for block in [32, 2048] {
            let f = QuantFormat::new(bits, scheme, block).unwrap();
            let mut cpu = QuantizedTensor::zeroed(f, len);
            let refs: Vec<_> = inputs.iter().map(|q| q.as_ref()).collect();
            sum_requantize(&refs, Rounding::NearestEven, cpu.as_mut(), &mut Vec::new()).unwrap();
            let mut out = DeviceQuantized::zeroed(&g, f, len).unwrap();
            let drefs: Vec<&DeviceQuantized> = dev.iter().collect();
            g.sum_requantize(&drefs, Rounding::NearestEven, &mut out)
                .unwrap();
            assert_same(&out.to_host(&g).unwrap(), &cpu, &format!("sum into {f}"));
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run cuda/check-on-gpu.sh"]
fn stochastic_codes_are_neighbours_and_unbiased() {
    let g = gpu();
    let f = QuantFormat::int4(256).unwrap();
    let len = 256;
    // One block: absmax 7 makes the scale 1, so x / scale = x.
    let mut x: Vec<f32> = (0..len).map(|i| (i % 13) as f32 * 0.5 - 3.1).collect();
    x[0] = 7.0;
    let dx = g.upload(&x).unwrap();
    let trials = 400;
    let mut mean = vec![0f64; len];
    for t in 0..trials {
        let mut dq = DeviceQuantized::zeroed(&g, f, len).unwrap();
        g.quantize(&dx.as_view(), Rounding::Stochastic { seed: t }, &mut dq)
            .unwrap();
        let back: Vec<f32> = dq.to_host(&g).unwrap().dequantize().unwrap();
        for (i, (&v, &b)) in x.iter().zip(&back).enumerate() {
            assert!(b == v.floor() || b == v.ceil(), "value {v} became {b}");
            mean[i] += f64::from(b) / trials as f64;
        }
    }
    for (i, (&v, m)) in x.iter().zip(&mean).enumerate() {
        // Bernoulli with p <= 1: standard error <= 0.5/sqrt(400) = 0.025.
        assert!(
            (m - f64::from(v)).abs() < 0.1,
            "element {i}: {v} averaged {m}"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run cuda/check-on-gpu.sh"]
fn bad_input_is_the_cpu_librarys_error() {
    let g = gpu();
    let f = QuantFormat::int8(64).unwrap();
    let mut x: Vec<f32> = values(1000, 3);
    x[700] = f32::NAN;
    x[900] = f32::INFINITY;
    let cpu_err = QuantizedTensor::quantize(&x, f, Rounding::NearestEven).unwrap_err();
    let dx = g.upload(&x).unwrap();
    let mut dq = DeviceQuantized::zeroed(&g, f, x.len()).unwrap();
    match g.quantize(&dx.as_view(), Rounding::NearestEven, &mut dq) {
        Err(CudaError::Quant(e)) => assert_eq!(e.to_string(), cpu_err.to_string()),
        other => panic!("expected {cpu_err}, got {other:?}"),
    }

    // Asymmetric range overflow.
    let fa = QuantFormat::new(Bits::Eight, Scheme::Asymmetric, 32).unwrap();
    let mut y = vec![0f32; 64];
    y[40] = f32::MAX;
    y[41] = -f32::MAX;
    let dy = g.upload(&y).unwrap();
    let mut dqa = DeviceQuantized::zeroed(&g, fa, 64).unwrap();
    let e = g
        .quantize(&dy.as_view(), Rounding::NearestEven, &mut dqa)
        .unwrap_err();
    assert!(
        matches!(
            e,
            CudaError::Quant(QuantError::RangeOverflow { block: 1, .. })
        ),
        "{e}"
    );

    // Corrupt block parameters when dequantizing.
    let mut q =
        QuantizedTensor::quantize(&values::<f32>(300, 4), f, Rounding::NearestEven).unwrap();
    q.block_max[3] = -1.0;
    let dq = DeviceQuantized::from_host(&g, &q).unwrap();
    let mut out = g.zeros::<f32>(300).unwrap();
    let e = g.dequantize(&dq, &mut out.as_view_mut()).unwrap_err();
    assert!(
        matches!(
            e,
            CudaError::Quant(QuantError::CorruptParams { block: 3, .. })
        ),
        "{e}"
    );

    // Sizes that do not fit are refused before any launch.
    let mut small = g.zeros::<f32>(10).unwrap();
    assert!(g.dequantize(&dq, &mut small.as_view_mut()).is_err());
}

#[test]
fn no_gpu_is_a_clear_error() {
    if driver_present() && device_count() > 0 {
        // With a GPU, opening works (the ignored tests use it).
        Gpu::open(0).unwrap();
        let e = Gpu::open(device_count()).err().expect("no such device");
        assert!(matches!(e, CudaError::NoDevice { .. }), "{e}");
    } else {
        let e = Gpu::open(0).err().expect("no GPU here");
        let msg = e.to_string();
        assert!(
            msg.contains("libcuda.so.1") || msg.contains("CUDA device"),
            "unclear error: {msg}"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL: run cuda/check-on-gpu.sh"]
fn nccl_collectives_on_one_rank_are_identities() {
    use std::time::Duration;
    use zeropp_cuda::nccl::{NcclComm, NcclId};
    let g = gpu();
    let id = NcclId::new().unwrap_or_else(|e| panic!("{e}"));
    // The id survives the trip through bytes that the rendezvous makes.
    let id = NcclId::from_bytes(&id.to_bytes()).unwrap();
    let comm = NcclComm::init(&g, &id, 0, 1, Duration::from_secs(30)).unwrap();
    let bytes: Vec<u8> = (0..4099u32).map(|i| (i * 7) as u8).collect();
    let src = g.upload(&bytes).unwrap();
    let mut out = g.zeros::<u8>(bytes.len()).unwrap();
    comm.all_gather_bytes(&src.as_view(), &mut out.as_view_mut())
        .unwrap();
    assert_eq!(g.download(&out.as_view()).unwrap(), bytes);
    let mut out = g.zeros::<u8>(bytes.len()).unwrap();
    comm.all_to_all_bytes(&src.as_view(), &mut out.as_view_mut())
        .unwrap();
    assert_eq!(g.download(&out.as_view()).unwrap(), bytes);
    let mut b = g.upload(&bytes).unwrap();
    comm.broadcast_bytes(0, &mut b.as_view_mut()).unwrap();
    assert_eq!(g.download(&b.as_view()).unwrap(), bytes);
    let x: Vec<f32> = values(1000, 1);
    let dx = g.upload(&x).unwrap();
    let mut y = g.zeros::<f32>(1000).unwrap();
    comm.reduce_scatter_sum(&dx.as_view(), &mut y.as_view_mut())
        .unwrap();
    assert_eq!(g.download(&y.as_view()).unwrap(), x);
    // The mean over one rank is the value itself (NCCL's average).
    let mut y = g.zeros::<f32>(1000).unwrap();
    comm.reduce_scatter(&dx.as_view(), &mut y.as_view_mut(), true)
        .unwrap();
    assert_eq!(g.download(&y.as_view()).unwrap(), x);
    let mut z = g.upload(&x).unwrap();
    comm.all_reduce_sum(&mut z.as_view_mut()).unwrap();
    assert_eq!(g.download(&z.as_view()).unwrap(), x);
    // Wrong sizes are refused before NCCL sees them.
    let mut short = g.zeros::<u8>(10).unwrap();
    assert!(
        comm.all_gather_bytes(&src.as_view(), &mut short.as_view_mut())
            .is_err()
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: run cuda/check-on-gpu.sh"]
fn borrowed_memory_and_streams_work_like_owned_ones() {
    // As the Python bindings use them: a buffer allocated elsewhere, seen
    // through `borrow`, on a stream made elsewhere (here: a cudarc one).
    let mut g = Gpu::open_shared(0).unwrap();
    let other = g.context().new_stream().unwrap();
    let x: Vec<f32> = values(4099, 21);
    let owned = other.clone_htod(&x).unwrap();
    let mut dst = other.alloc_zeros::<f32>(4099).unwrap();
    other.synchronize().unwrap();
    // SAFETY: `other` outlives `g`'s use of it below.
    unsafe { g.use_stream(other.cu_stream() as usize) };
    {
        use cudarc::driver::DevicePtr;
        let (src_ptr, _s) = owned.device_ptr(&other);
        let (dst_ptr, _d) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut dst, &other);
        // SAFETY: both live for this block and nothing else writes them.
        let src = unsafe { g.borrow::<f32>(src_ptr, 4099) }.unwrap();
        let mut out = unsafe { g.borrow::<f32>(dst_ptr, 4099) }.unwrap();
        g.copy(&src.view(), &mut out.view_mut()).unwrap();
        g.axpby(&mut out.view_mut(), &src.view(), 1.0, 1.0).unwrap();
        g.synchronize().unwrap();
        // A misaligned address is refused.
        assert!(unsafe { g.borrow::<f32>(src_ptr + 2, 4) }.is_err());
    }
    // Dropping the borrowed buffers freed nothing: both are still readable.
    let want: Vec<f32> = x.iter().map(|v| v + v).collect();
    assert_eq!(bits(&other.clone_dtoh(&dst).unwrap()), bits(&want));
    assert_eq!(bits(&other.clone_dtoh(&owned).unwrap()), bits(&x));
}
