// A CPU emulator for zeropp's CUDA kernels, for tests on machines without a
// GPU: every CUDA thread of a block is a fiber (its own stack, switched
// cooperatively on one OS thread), __syncthreads is a block barrier, warp
// shuffles exchange through memory between warp barriers, and CUDA blocks
// run one after another (so __shared__ can be a static). A fiber gives way
// only at a barrier, so a launch costs a few context switches per barrier,
// not OS threads. Float operations are IEEE single on the host with
// contraction off (-ffp-contract=off), which is what the kernels' __f*_rn
// intrinsics are.
#pragma once
#include <math.h>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static

struct dim3 { unsigned x = 1, y = 1, z = 1; };
extern thread_local dim3 threadIdx, blockIdx;
extern thread_local dim3 blockDim, gridDim;

namespace zq_emu {
// Gives way to the next fiber of the launch (called while waiting at a barrier).
void yield();

// A barrier of `expected` fibers: the last to arrive releases the others.
struct Barrier {
    unsigned expected, arrived = 0;
    unsigned long generation = 0;
    explicit Barrier(unsigned n) : expected(n) {}
    void arrive_and_wait() {
        const unsigned long g = generation;
        if (++arrived == expected) {
            arrived = 0;
            ++generation;
            return;
        }
        while (generation == g) yield();
    }
};

struct Block {
    Barrier block;
    std::vector<Barrier> warps;
    std::vector<int> lanes;
    explicit Block(unsigned threads) : block(threads), lanes(threads) {
        for (unsigned w = 0; w < threads / 32; ++w) warps.emplace_back(32);
    }
};
extern Block* current;
extern std::mutex atomic_lock;
void launch(unsigned grid, unsigned threads, const std::function<void()>& body);
}  // namespace zq_emu

inline void __syncthreads() { zq_emu::current->block.arrive_and_wait(); }
inline int __shfl_xor_sync(unsigned, int v, int off) {
    auto* b = zq_emu::current;
    unsigned t = threadIdx.x;
    auto& bar = b->warps[t / 32];
    b->lanes[t] = v;
    bar.arrive_and_wait();
    int got = b->lanes[(t & ~31u) | ((t & 31u) ^ (unsigned)off)];
    bar.arrive_and_wait();
    return got;
}
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
    std::lock_guard<std::mutex> g(zq_emu::atomic_lock);
    unsigned long long old = *p;
    if (v < old) *p = v;
    return old;
}
template <typename T> inline T min(T a, T b) { return b < a ? b : a; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
