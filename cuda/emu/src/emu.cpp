// The kernels of cuda/kernels/, compiled for the host with emu.h, and C
// entry points that launch them by name (the names the Rust launchers use).
#include "emu.h"
#include <cstdio>
#include <map>
#include <string>

thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace zq_emu {
Block* current = nullptr;
std::mutex atomic_lock;

// One OS thread per CUDA thread, alive for the whole launch; CUDA blocks run
// in turn, with a block barrier between them. Launches from different host
// threads (parallel tests) run one at a time: `current` and the __shared__
// statics belong to the running launch.
void launch(unsigned grid, unsigned threads, const std::function<void()>& body) {
    static std::mutex one_launch;
    std::lock_guard<std::mutex> serial(one_launch);
    Block b(threads);
    current = &b;
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t) {
        ts.emplace_back([&, t] {
            threadIdx.x = t;
            blockDim.x = threads;
            gridDim.x = grid;
            for (unsigned g = 0; g < grid; ++g) {
                blockIdx.x = g;
                body();
                b.block.arrive_and_wait();
            }
        });
    }
    for (auto& t : ts) t.join();
    current = nullptr;
}
}  // namespace zq_emu

#include "../../kernels/quantize.cu"
#include "../../kernels/dequantize.cu"
#include "../../kernels/qgz.cu"

using zq::u32;
using zq::u64;

typedef void (*QuantizeFn)(const void*, u64, u32, u32, u32, u32, u64, u32, unsigned char*, float*, float*, u64*);
typedef void (*DequantizeFn)(const unsigned char*, const float*, const float*, u64, u32, void*, u64*);
typedef void (*SumFn)(const zq::QInput*, u32, u64, u32, u64, unsigned char*, float*, float*, u64*);

static std::map<std::string, QuantizeFn>& quantize_table() { static std::map<std::string, QuantizeFn> m; return m; }
static std::map<std::string, DequantizeFn>& dequantize_table() { static std::map<std::string, DequantizeFn> m; return m; }
static std::map<std::string, SumFn>& sum_table() { static std::map<std::string, SumFn> m; return m; }

#define REG_Q(NAME) static bool reg_##NAME = (quantize_table()[#NAME] = (QuantizeFn)(void*)&NAME, true);
#define REG_D(NAME) static bool reg_##NAME = (dequantize_table()[#NAME] = (DequantizeFn)(void*)&NAME, true);
#define REG_S(NAME) static bool reg_##NAME = (sum_table()[#NAME] = (SumFn)(void*)&NAME, true);

#define REG_Q_E(E) \
    REG_Q(zq_quantize_##E##_sym8_rn) REG_Q(zq_quantize_##E##_sym4_rn) REG_Q(zq_quantize_##E##_sym2_rn) \
    REG_Q(zq_quantize_##E##_asym8_rn) REG_Q(zq_quantize_##E##_asym4_rn) REG_Q(zq_quantize_##E##_asym2_rn) \
    REG_Q(zq_quantize_##E##_sym8_sr) REG_Q(zq_quantize_##E##_sym4_sr) REG_Q(zq_quantize_##E##_sym2_sr) \
    REG_Q(zq_quantize_##E##_asym8_sr) REG_Q(zq_quantize_##E##_asym4_sr) REG_Q(zq_quantize_##E##_asym2_sr)
REG_Q_E(f32) REG_Q_E(bf16) REG_Q_E(f16)

#define REG_D_E(E) \
    REG_D(zq_dequantize_sym8_##E) REG_D(zq_dequantize_sym4_##E) REG_D(zq_dequantize_sym2_##E) \
    REG_D(zq_dequantize_asym8_##E) REG_D(zq_dequantize_asym4_##E) REG_D(zq_dequantize_asym2_##E)
REG_D_E(f32) REG_D_E(bf16) REG_D_E(f16)
REG_D(zq_dequantize_acc_sym8) REG_D(zq_dequantize_acc_sym4) REG_D(zq_dequantize_acc_sym2)
REG_D(zq_dequantize_acc_asym8) REG_D(zq_dequantize_acc_asym4) REG_D(zq_dequantize_acc_asym2)

REG_S(zq_sum_requantize_sym8_rn) REG_S(zq_sum_requantize_sym4_rn) REG_S(zq_sum_requantize_sym2_rn)
REG_S(zq_sum_requantize_asym8_rn) REG_S(zq_sum_requantize_asym4_rn) REG_S(zq_sum_requantize_asym2_rn)
REG_S(zq_sum_requantize_sym8_sr) REG_S(zq_sum_requantize_sym4_sr) REG_S(zq_sum_requantize_sym2_sr)
REG_S(zq_sum_requantize_asym8_sr) REG_S(zq_sum_requantize_asym4_sr) REG_S(zq_sum_requantize_asym2_sr)

// Each returns 0, or -1 when no kernel has that name.
extern "C" int zq_emu_quantize(const char* name, unsigned grid, const void* in, u64 chunk_len, u32 count,
                               u32 nodes, u32 rpn, u32 block, u64 seed, u32 part_seeds,
                               unsigned char* codes, float* bmax, float* bmin, u64* err) {
    auto it = quantize_table().find(name);
    if (it == quantize_table().end()) return -1;
    auto f = it->second;
    zq_emu::launch(grid, zq::THREADS, [=] { f(in, chunk_len, count, nodes, rpn, block, seed, part_seeds, codes, bmax, bmin, err); });
    return 0;
}

extern "C" int zq_emu_dequantize(const char* name, unsigned grid, const unsigned char* codes,
                                 const float* bmax, const float* bmin, u64 len, u32 block, void* out,
                                 u64* err) {
    auto it = dequantize_table().find(name);
    if (it == dequantize_table().end()) return -1;
    auto f = it->second;
    zq_emu::launch(grid, zq::THREADS, [=] { f(codes, bmax, bmin, len, block, out, err); });
    return 0;
}

extern "C" int zq_emu_sum_requantize(const char* name, unsigned grid, const void* inputs, u32 k, u64 len,
                                     u32 block, u64 seed, unsigned char* codes, float* bmax,
                                     float* bmin, u64* err) {
    auto it = sum_table().find(name);
    if (it == sum_table().end()) return -1;
    auto f = it->second;
    auto in = (const zq::QInput*)inputs;
    zq_emu::launch(grid, zq::THREADS, [=] { f(in, k, len, block, seed, codes, bmax, bmin, err); });
    return 0;
}

extern "C" void zq_emu_div_f32(unsigned grid, float* x, u64 n, float d) {
    zq_emu::launch(grid, zq::THREADS, [=] { zq_div_f32(x, n, d); });
}

extern "C" void zq_emu_axpby_f32(unsigned grid, float* x, const float* y, u64 n, float a, float b) {
    zq_emu::launch(grid, zq::THREADS, [=] { zq_axpby_f32(x, y, n, a, b); });
}

extern "C" unsigned zq_emu_qinput_size() { return sizeof(zq::QInput); }
