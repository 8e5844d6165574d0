// Shared by every zeropp kernel: element loads and stores, the block formats
// of zeropp-quant (quant/src/lib.rs is the specification), team reductions
// and the error slots through which a kernel reports bad input.
//
// Arithmetic follows the CPU library operation for operation, each rounded on
// its own (__fdiv_rn, __fmul_rn, __fadd_rn, __fsub_rn; the build also passes
// --fmad=false), so round-to-nearest codes and block parameters are equal to
// the CPU's bit for bit.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace zq {

typedef unsigned long long u64;
typedef unsigned int u32;

// Threads per CUDA block for every kernel (the launchers use the same number).
constexpr int THREADS = 256;

// Error slot 0 holds the smallest `key` any thread reported, or all ones.
// A key names a quantization block `gb` (global over chunks) and what went
// wrong: `gb * KEY_SPAN + i` a non-finite value at offset i of the block,
// `gb * KEY_SPAN + KEY_OVERFLOW` an asymmetric range overflowing f32. The
// smallest key is the first error in block order, as the CPU reports it.
// Slot 1 names corrupt block parameters of an input: `input << 40 | block`.
constexpr u64 KEY_SPAN = 131072;
constexpr u64 KEY_OVERFLOW = 65536;

__device__ __forceinline__ float load(const float* p, u64 i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, u64 i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float load(const __half* p, u64 i) { return __half2float(p[i]); }
__device__ __forceinline__ void store(float* p, u64 i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, u64 i, float v) { p[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half* p, u64 i, float v) { p[i] = __float2half_rn(v); }

// Sorts like the float it came from (-0 < +0); the CPU's `order_key`.
__device__ __forceinline__ int order_key(float x) {
    int s = __float_as_int(x);
    return s ^ (int)(((unsigned)(s >> 31)) >> 1);
}
__device__ __forceinline__ float from_order_key(int k) {
    return __int_as_float(k ^ (int)(((unsigned)(k >> 31)) >> 1));
}

// Bits per code and whether codes are unsigned (asymmetric).
template <int BITS, bool ASYM>
struct Fmt {
    static constexpr int PER = 8 / BITS;  // codes per byte
    static constexpr u32 MASK = (1u << BITS) - 1u;
    static constexpr int QMAX = ASYM ? (1 << BITS) - 1 : (1 << (BITS - 1)) - 1;
};

// One code of a byte, dequantized: symmetric x = (q / qmax) * max, asymmetric
// x = (1 - r) * min + r * max with r = q / qmax.
template <int BITS, bool ASYM>
__device__ __forceinline__ float decode(u32 byte, int k, float mx, float mn) {
    const float qmax = (float)Fmt<BITS, ASYM>::QMAX;
    if (ASYM) {
        int q = (int)((byte >> (BITS * k)) & Fmt<BITS, ASYM>::MASK);
        float r = __fdiv_rn((float)q, qmax);
        return __fadd_rn(__fmul_rn(__fsub_rn(1.0f, r), mn), __fmul_rn(r, mx));
    } else {
        int q = ((int)(byte << (32 - BITS * (k + 1)))) >> (32 - BITS);
        return __fmul_rn(__fdiv_rn((float)q, qmax), mx);
    }
}

// Block parameters a decoder may trust: finite, min <= max, max >= 0 when
// symmetric (the CPU's CorruptParams check).
template <bool ASYM>
__device__ __forceinline__ bool params_ok(float mx, float mn) {
    return ASYM ? (isfinite(mn) && isfinite(mx) && mn <= mx) : (isfinite(mx) && mx >= 0.0f);
}

struct MaxOp { __device__ __forceinline__ int operator()(int a, int b) const { return a > b ? a : b; } };
struct MinOp { __device__ __forceinline__ int operator()(int a, int b) const { return a < b ? a : b; } };

// Reduces `v` over a team of `team` consecutive threads (a power of two from
// 8 to THREADS). Every thread of the CUDA block must call it, in step.
template <typename Op>
__device__ __forceinline__ int team_reduce(int v, int team, int* scratch, Op op) {
    const int width = team < 32 ? team : 32;
    for (int off = width / 2; off > 0; off >>= 1) {
        v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
    }
    if (team > 32) {
        __syncthreads();  // the scratch may still be read by a previous reduction
        if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
        __syncthreads();
        const int warps = team >> 5;
        const int first = (threadIdx.x / team) * warps;
        v = scratch[first];
        for (int w = 1; w < warps; ++w) v = op(v, scratch[first + w]);
    }
    return v;
}

// SplitMix64's output function, as `Rounding::for_part` uses it.
__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The seed of one part (chunk) of a job: `Rounding::for_part`.
__device__ __forceinline__ u64 part_seed(u64 seed, u64 part) {
    return splitmix64(seed ^ (part * 0xD1B54A32D192ED03ull));
}

// Uniform in [0, 1) with 24 random bits, from (seed, block, index) alone: a
// counter-based stream, so any thread can draw any value. (The CPU library
// draws from a per-block SmallRng instead; stochastic codes are unbiased on
// both but not equal.)
__device__ __forceinline__ float uniform24(u64 seed, u64 block, u64 i) {
    u64 r = splitmix64(seed ^ splitmix64(block * 0x9E3779B97F4A7C15ull + i));
    return (float)(r >> 40) * (1.0f / 16777216.0f);
}

// Quantizes one block with a team of threads. `src(i)` gives the block's
// i-th value in f32 (it is read twice: once for the range, once for the
// codes, and must give the same value both times). Inactive teams (past the
// last block) still take part in the reductions.
template <int BITS, bool ASYM, bool STOCH, typename Src>
__device__ __forceinline__ void quantize_block(const Src& src, u64 block_len, bool active,
                                               u64 gb, u64 rng_block, u64 seed, int team, int lane,
                                               int* scratch, unsigned char* codes, float* max_out,
                                               float* min_out, u64* err) {
    typedef Fmt<BITS, ASYM> F;
    int hi = ASYM ? (int)0x80000000 : 0;
    int lo = 0x7fffffff;
    bool reported = false;
    for (u64 i = lane; i < block_len; i += team) {
        const float v = src(i);
        if (!isfinite(v) && !reported) {
            atomicMin(err, gb * KEY_SPAN + i);
            reported = true;
        }
        if (ASYM) {
            const int k = order_key(v);
            hi = k > hi ? k : hi;
            lo = k < lo ? k : lo;
        } else {
            const int m = (int)(__float_as_uint(v) & 0x7fffffffu);
            hi = m > hi ? m : hi;
        }
    }
    hi = team_reduce(hi, team, scratch, MaxOp());
    if (ASYM) lo = team_reduce(lo, team, scratch, MinOp());
    if (!active) return;

    const float qmax = (float)F::QMAX;
    float mx, mn = 0.0f, scale;
    if (ASYM) {
        mn = from_order_key(lo);
        mx = from_order_key(hi);
        scale = __fdiv_rn(__fsub_rn(mx, mn), qmax);
        if (!isfinite(scale)) {
            if (lane == 0) atomicMin(err, gb * KEY_SPAN + KEY_OVERFLOW);
            return;
        }
    } else {
        mx = __uint_as_float((u32)hi);
        scale = __fdiv_rn(mx, qmax);
    }
    if (lane == 0) {
        *max_out = mx;
        if (ASYM) *min_out = mn;
    }
    const float lo_code = ASYM ? 0.0f : -qmax;
    const u64 groups = (block_len + F::PER - 1) / F::PER;
    for (u64 g = lane; g < groups; g += team) {
        u32 byte = 0;
        if (scale != 0.0f) {
#pragma unroll
            for (int k = 0; k < F::PER; ++k) {
                const u64 i = g * F::PER + k;
                if (i < block_len) {
                    const float v = src(i);
                    float t = ASYM ? __fdiv_rn(__fsub_rn(v, mn), scale) : __fdiv_rn(v, scale);
                    if (STOCH) t = floorf(__fadd_rn(t, uniform24(seed, rng_block, i)));
                    t = fminf(fmaxf(t, lo_code), qmax);
                    byte |= ((u32)(int)rintf(t) & F::MASK) << (BITS * k);
                }
            }
        }
        codes[g] = (unsigned char)byte;
    }
}

// Teams of a CUDA block for a quantization block of `block` values: one
// thread per code byte, at most THREADS.
template <int BITS>
__device__ __forceinline__ int team_size(u32 block) {
    const u32 groups = block / (8 / BITS);
    return groups < (u32)THREADS ? (int)groups : THREADS;
}

}  // namespace zq
