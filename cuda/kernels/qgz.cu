// The fused qgZ step between the two hops of the gradient all-to-all: k
// quantized inputs → dequantize → f32 sum (from +0, in input order, as the CPU
// library adds) → requantize, block by block, without writing the sum to
// memory. The inputs may use different formats (bits, scheme, block).
#include "common.cuh"

namespace zq {

// One quantized input; the launcher writes an array of these (48 bytes each,
// the Rust `QInput` mirrors it).
struct QInput {
    const unsigned char* codes;
    const float* bmax;
    const float* bmin;  // null when symmetric
    u64 len;
    u32 bits;
    u32 asym;
    u32 block;
    u32 reserved;
};

// Value i of input j, or 0 with slot 1 set when its block parameters are corrupt.
__device__ __forceinline__ float decode_input(const QInput& q, u32 j, u64 i, u64* err) {
    const u64 b = i / q.block;
    const float mx = q.bmax[b];
    const float mn = q.asym ? q.bmin[b] : 0.0f;
    const bool ok = q.asym ? params_ok<true>(mx, mn) : params_ok<false>(mx, mn);
    if (!ok) {
        atomicMin(err + 1, ((u64)j << 40) | b);
        return 0.0f;
    }
    switch (q.bits * 2 + q.asym) {
        case 16: return decode<8, false>(q.codes[i], 0, mx, mn);
        case 17: return decode<8, true>(q.codes[i], 0, mx, mn);
        case 8: return decode<4, false>(q.codes[i >> 1], (int)(i & 1), mx, mn);
        case 9: return decode<4, true>(q.codes[i >> 1], (int)(i & 1), mx, mn);
        case 4: return decode<2, false>(q.codes[i >> 2], (int)(i & 3), mx, mn);
        default: return decode<2, true>(q.codes[i >> 2], (int)(i & 3), mx, mn);
    }
}

struct SumSrc {
    const QInput* in;
    u32 k;
    u64 base;
    u64* err;
    __device__ __forceinline__ float operator()(u64 i) const {
        float s = 0.0f;
        for (u32 j = 0; j < k; ++j) s = __fadd_rn(s, decode_input(in[j], j, base + i, err));
        return s;
    }
};

template <int BITS, bool ASYM, bool STOCH>
__device__ __forceinline__ void sum_requantize(const QInput* in, u32 k, u64 len, u32 block,
                                               u64 seed, unsigned char* codes, float* bmax,
                                               float* bmin, u64* err) {
    __shared__ int scratch[THREADS / 32];
    typedef Fmt<BITS, ASYM> F;
    const int team = team_size<BITS>(block);
    const int lane = threadIdx.x % team;
    const u64 nb = (len + block - 1) / block;
    const u64 b = (u64)blockIdx.x * (THREADS / team) + threadIdx.x / team;
    const bool active = b < nb;
    const u64 start = active ? b * block : 0;
    const u64 block_len = active ? min((u64)block, len - start) : 0;
    quantize_block<BITS, ASYM, STOCH>(SumSrc{in, k, start, err}, block_len, active, b, b, seed,
                                      team, lane, scratch, codes + start / F::PER, bmax + b,
                                      ASYM ? bmin + b : nullptr, err);
}

}  // namespace zq

#define ZQ_SUM_REQUANTIZE(NAME, BITS, ASYM, STOCH)                                              \
    extern "C" __global__ void __launch_bounds__(zq::THREADS)                                   \
        NAME(const zq::QInput* in, zq::u32 k, zq::u64 len, zq::u32 block, zq::u64 seed,          \
             unsigned char* codes, float* bmax, float* bmin, zq::u64* err) {                     \
        zq::sum_requantize<BITS, ASYM, STOCH>(in, k, len, block, seed, codes, bmax, bmin, err);  \
    }

ZQ_SUM_REQUANTIZE(zq_sum_requantize_sym8_rn, 8, false, false)
ZQ_SUM_REQUANTIZE(zq_sum_requantize_sym4_rn, 4, false, false)
ZQ_SUM_REQUANTIZE(zq_sum_requantize_sym2_rn, 2, false, false)
ZQ_SUM_REQUANTIZE(zq_sum_requantize_asym8_rn, 8, true, false)
ZQ_SUM_REQUANTIZE(zq_sum_requantize_asym4_rn, 4, true, false)
ZQ_SUM_REQUANTIZE(zq_sum_requantize_asym2_rn, 2, true, false)
ZQ_SUM_REQUANTIZE(zq_sum_requantize_sym8_sr, 8, false, true)
ZQ_SUM_REQUANTIZE(zq_sum_requantize_sym4_sr, 4, false, true)
ZQ_SUM_REQUANTIZE(zq_sum_requantize_sym2_sr, 2, false, true)
ZQ_SUM_REQUANTIZE(zq_sum_requantize_asym8_sr, 8, true, true)
ZQ_SUM_REQUANTIZE(zq_sum_requantize_asym4_sr, 4, true, true)
ZQ_SUM_REQUANTIZE(zq_sum_requantize_asym2_sr, 2, true, true)
