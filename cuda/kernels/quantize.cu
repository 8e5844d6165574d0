// Quantize: f32 / bf16 / f16 → int8 / int4 / int2 blocks, symmetric or
// asymmetric, round-to-nearest or stochastic; and the swizzled quantize of
// qgZ (W chunks reordered by destination (local rank, node)), which is the
// same kernel with count = W.
#include "common.cuh"

namespace zq {

template <typename T>
struct LoadSrc {
    const T* x;
    __device__ __forceinline__ float operator()(u64 i) const { return load(x, i); }
};

// `count` chunks of `chunk_len` values; output position p takes the chunk of
// rank (p % nodes) * rpn + p / nodes (`swizzled_rank`); with count = 1 and
// nodes = rpn = 1 this is a plain quantize. Chunk p's codes, maxima and minima
// start at p times their per-chunk sizes. `part_seeds` = 1 derives each
// chunk's stochastic seed from its rank as `Rounding::for_part` does.
template <typename T, int BITS, bool ASYM, bool STOCH>
__device__ __forceinline__ void quantize_chunks(const T* in, u64 chunk_len, u32 count, u32 nodes,
                                                u32 rpn, u32 block, u64 seed, u32 part_seeds,
                                                unsigned char* codes, float* bmax, float* bmin,
                                                u64* err) {
    __shared__ int scratch[THREADS / 32];
    typedef Fmt<BITS, ASYM> F;
    const int team = team_size<BITS>(block);
    const int lane = threadIdx.x % team;
    const u64 nb = (chunk_len + block - 1) / block;
    const u64 gb = (u64)blockIdx.x * (THREADS / team) + threadIdx.x / team;
    const bool active = gb < nb * count;
    const u64 p = active ? gb / nb : 0;
    const u64 b = active ? gb % nb : 0;
    const u64 rank = (p % nodes) * rpn + p / nodes;
    const u64 start = b * block;
    const u64 block_len = active ? min((u64)block, chunk_len - start) : 0;
    const u64 chunk_code_bytes = (chunk_len + F::PER - 1) / F::PER;
    const u64 s = STOCH ? (part_seeds ? part_seed(seed, rank) : seed) : 0;
    quantize_block<BITS, ASYM, STOCH>(LoadSrc<T>{in + rank * chunk_len + start}, block_len, active,
                                      gb, b, s, team, lane, scratch,
                                      codes + p * chunk_code_bytes + start / F::PER,
                                      bmax + p * nb + b, ASYM ? bmin + p * nb + b : nullptr, err);
}

}  // namespace zq

#define ZQ_QUANTIZE(NAME, T, BITS, ASYM, STOCH)                                                  \
    extern "C" __global__ void __launch_bounds__(zq::THREADS)                                    \
        NAME(const T* in, zq::u64 chunk_len, zq::u32 count, zq::u32 nodes, zq::u32 rpn,           \
             zq::u32 block, zq::u64 seed, zq::u32 part_seeds, unsigned char* codes, float* bmax,  \
             float* bmin, zq::u64* err) {                                                         \
        zq::quantize_chunks<T, BITS, ASYM, STOCH>(in, chunk_len, count, nodes, rpn, block, seed,  \
                                                  part_seeds, codes, bmax, bmin, err);            \
    }

#define ZQ_QUANTIZE_FORMATS(E, T)                                   \
    ZQ_QUANTIZE(zq_quantize_##E##_sym8_rn, T, 8, false, false)      \
    ZQ_QUANTIZE(zq_quantize_##E##_sym4_rn, T, 4, false, false)      \
    ZQ_QUANTIZE(zq_quantize_##E##_sym2_rn, T, 2, false, false)      \
    ZQ_QUANTIZE(zq_quantize_##E##_asym8_rn, T, 8, true, false)      \
    ZQ_QUANTIZE(zq_quantize_##E##_asym4_rn, T, 4, true, false)      \
    ZQ_QUANTIZE(zq_quantize_##E##_asym2_rn, T, 2, true, false)      \
    ZQ_QUANTIZE(zq_quantize_##E##_sym8_sr, T, 8, false, true)       \
    ZQ_QUANTIZE(zq_quantize_##E##_sym4_sr, T, 4, false, true)       \
    ZQ_QUANTIZE(zq_quantize_##E##_sym2_sr, T, 2, false, true)       \
    ZQ_QUANTIZE(zq_quantize_##E##_asym8_sr, T, 8, true, true)       \
    ZQ_QUANTIZE(zq_quantize_##E##_asym4_sr, T, 4, true, true)       \
    ZQ_QUANTIZE(zq_quantize_##E##_asym2_sr, T, 2, true, true)

ZQ_QUANTIZE_FORMATS(f32, float)
ZQ_QUANTIZE_FORMATS(bf16, __nv_bfloat16)
ZQ_QUANTIZE_FORMATS(f16, __half)
