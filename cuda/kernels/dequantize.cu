// Dequantize int8 / int4 / int2 blocks (symmetric or asymmetric) to f32,
// bf16 or f16, and dequantize-and-accumulate into f32 (`acc += x̂`).
#include "common.cuh"

namespace zq {

// One thread per code byte (grid-stride). Corrupt block parameters are
// reported in error slot 1 as the smallest bad block.
template <int BITS, bool ASYM, typename T, bool ACC>
__device__ __forceinline__ void dequantize_all(const unsigned char* codes, const float* bmax,
                                               const float* bmin, u64 len, u32 block, T* out,
                                               u64* err) {
    typedef Fmt<BITS, ASYM> F;
    const u64 groups = (len + F::PER - 1) / F::PER;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {
        const u64 i0 = g * F::PER;
        const u64 b = i0 / block;
        const float mx = bmax[b];
        const float mn = ASYM ? bmin[b] : 0.0f;
        if (!params_ok<ASYM>(mx, mn)) {
            atomicMin(err + 1, b);
            continue;
        }
        const u32 byte = codes[g];
#pragma unroll
        for (int k = 0; k < F::PER; ++k) {
            const u64 i = i0 + k;
            if (i < len) {
                const float v = decode<BITS, ASYM>(byte, k, mx, mn);
                if (ACC) {
                    store(out, i, __fadd_rn(load(out, i), v));
                } else {
                    store(out, i, v);
                }
            }
        }
    }
}

}  // namespace zq

#define ZQ_DEQUANTIZE(NAME, BITS, ASYM, T, ACC)                                                  \
    extern "C" __global__ void __launch_bounds__(zq::THREADS)                                    \
        NAME(const unsigned char* codes, const float* bmax, const float* bmin, zq::u64 len,       \
             zq::u32 block, T* out, zq::u64* err) {                                               \
        zq::dequantize_all<BITS, ASYM, T, ACC>(codes, bmax, bmin, len, block, out, err);          \
    }

#define ZQ_DEQUANTIZE_TO(E, T)                                                \
    ZQ_DEQUANTIZE(zq_dequantize_sym8_##E, 8, false, T, false)                 \
    ZQ_DEQUANTIZE(zq_dequantize_sym4_##E, 4, false, T, false)                 \
    ZQ_DEQUANTIZE(zq_dequantize_sym2_##E, 2, false, T, false)                 \
    ZQ_DEQUANTIZE(zq_dequantize_asym8_##E, 8, true, T, false)                 \
    ZQ_DEQUANTIZE(zq_dequantize_asym4_##E, 4, true, T, false)                 \
    ZQ_DEQUANTIZE(zq_dequantize_asym2_##E, 2, true, T, false)

ZQ_DEQUANTIZE_TO(f32, float)
ZQ_DEQUANTIZE_TO(bf16, __nv_bfloat16)
ZQ_DEQUANTIZE_TO(f16, __half)

ZQ_DEQUANTIZE(zq_dequantize_acc_sym8, 8, false, float, true)
ZQ_DEQUANTIZE(zq_dequantize_acc_sym4, 4, false, float, true)
ZQ_DEQUANTIZE(zq_dequantize_acc_sym2, 2, false, float, true)
ZQ_DEQUANTIZE(zq_dequantize_acc_asym8, 8, true, float, true)
ZQ_DEQUANTIZE(zq_dequantize_acc_asym4, 4, true, float, true)
ZQ_DEQUANTIZE(zq_dequantize_acc_asym2, 2, true, float, true)

// x /= d (the qgZ mean: the sum over all W ranks divided by W, as the CPU
// divides).
extern "C" __global__ void __launch_bounds__(zq::THREADS) zq_div_f32(float* x, zq::u64 n, float d) {
    const zq::u64 stride = (zq::u64)gridDim.x * blockDim.x;
    for (zq::u64 i = (zq::u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        x[i] = __fdiv_rn(x[i], d);
    }
}

// x = a·x + b·y (qgZ's error feedback: a = b = 1 adds the residual to the
// gradient; a = -1, b = 1 turns x̂ into what quantization dropped, y - x̂).
// Each product and the sum are rounded on their own, so ±1 factors are exact.
extern "C" __global__ void __launch_bounds__(zq::THREADS)
    zq_axpby_f32(float* x, const float* y, zq::u64 n, float a, float b) {
    const zq::u64 stride = (zq::u64)gridDim.x * blockDim.x;
    for (zq::u64 i = (zq::u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        x[i] = __fadd_rn(__fmul_rn(a, x[i]), __fmul_rn(b, y[i]));
    }
}

// y = x widened to f32 / narrowed from f32 (rounded to nearest even): qwZ on
// weight differences reads the caller's tensor and writes the gathered
// weights back into it.
#define ZQ_CAST(E, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(zq::THREADS)                                  \
        zq_to_f32_##E(const T* x, float* y, zq::u64 n) {                                      \
        const zq::u64 stride = (zq::u64)gridDim.x * blockDim.x;                                \
        for (zq::u64 i = (zq::u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) { \
            y[i] = zq::load(x, i);                                                             \
        }                                                                                      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(zq::THREADS)                                  \
        zq_from_f32_##E(const float* x, T* y, zq::u64 n) {                                    \
        const zq::u64 stride = (zq::u64)gridDim.x * blockDim.x;                                \
        for (zq::u64 i = (zq::u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) { \
            zq::store(y, i, x[i]);                                                             \
        }                                                                                      \
    }

ZQ_CAST(f32, float)
ZQ_CAST(bf16, __nv_bfloat16)
ZQ_CAST(f16, __half)

// One butterfly stage (distance h) of the Walsh–Hadamard rotation of every
// block of `block` values in x[0..n) (n a multiple of block): pair p of
// the stage joins x[i] and x[i + h]. The last stage multiplies by
// 1/sqrt(block) (`scale`; 1 before it), so the rounding is the CPU's: the
// sums of every stage, then one product.
extern "C" __global__ void __launch_bounds__(zq::THREADS)
    zq_hadamard_stage_f32(float* x, zq::u64 n, zq::u64 block, zq::u64 h, float scale) {
    const zq::u64 stride = (zq::u64)gridDim.x * blockDim.x;
    const zq::u64 half = block / 2;
    for (zq::u64 p = (zq::u64)blockIdx.x * blockDim.x + threadIdx.x; p < n / 2; p += stride) {
        const zq::u64 w = p % half;
        const zq::u64 i = (p / half) * block + (w / h) * 2 * h + w % h;
        const float u = x[i], v = x[i + h];
        x[i] = __fmul_rn(__fadd_rn(u, v), scale);
        x[i + h] = __fmul_rn(__fsub_rn(u, v), scale);
    }
}
