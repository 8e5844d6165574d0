// The kernels of cuda/kernels/, compiled for the host with emu.h, and C
// entry points that launch them by name (the names the Rust launchers use).
#include "emu.h"
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>

thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace zq_emu {
Block* current = nullptr;
std::mutex atomic_lock;

// Fibers: each CUDA thread of a block runs on its own stack; the launch
// switches into them in turn and each switches back when it waits at a
// barrier or ends. The switch saves only the callee-saved registers (the
// System V x86-64 ABI), so it is a handful of instructions and no system
// call.
#if !defined(__x86_64__)
#error "the emulator's fibers switch x86-64 registers; port zq_emu_switch to this machine"
#endif
extern "C" void zq_emu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl zq_emu_switch
    .type zq_emu_switch, @function
zq_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size zq_emu_switch, .-zq_emu_switch
)");

namespace {
constexpr size_t STACK = 256 * 1024;

struct Launch {
    const std::function<void()>* body = nullptr;
    void* scheduler_sp = nullptr;
    std::vector<void*> sp;
    std::vector<char> done;
    unsigned running = 0;
};
Launch* launch_now = nullptr;
// Stacks are kept between launches (launches run one at a time).
std::vector<std::unique_ptr<char[]>> stacks;

void fiber_entry() {
    Launch* l = launch_now;
    (*l->body)();
    l->done[l->running] = 1;
    void* dead = nullptr;
    zq_emu_switch(&dead, l->scheduler_sp);  // never resumed
    __builtin_unreachable();
}

// A fresh stack for fiber `t` that starts in fiber_entry: six zeroed
// callee-saved registers, then fiber_entry as the return address, placed so
// that fiber_entry starts with the stack aligned as a called function's is.
void* fresh_stack(unsigned t) {
    char* top = stacks[t].get() + STACK;
    auto* sp = reinterpret_cast<void**>(reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15));
    *--sp = nullptr;  // fiber_entry's "return address" slot: keeps alignment
    *--sp = reinterpret_cast<void*>(&fiber_entry);
    for (int r = 0; r < 6; ++r) *--sp = nullptr;
    return sp;
}
}  // namespace

void yield() {
    Launch* l = launch_now;
    zq_emu_switch(&l->sp[l->running], l->scheduler_sp);
}

// CUDA blocks run in turn; inside one, its threads' fibers run round-robin
// until every one has ended. Launches from different host threads
// (parallel tests) run one at a time: `current`, the fibers' stacks and the
// __shared__ statics belong to the running launch.
void launch(unsigned grid, unsigned threads, const std::function<void()>& body) {
    static std::mutex one_launch;
    std::lock_guard<std::mutex> serial(one_launch);
    while (stacks.size() < threads) stacks.emplace_back(new char[STACK]);
    Block b(threads);
    current = &b;
    Launch l;
    l.body = &body;
    l.sp.resize(threads);
    l.done.resize(threads);
    launch_now = &l;
    blockDim.x = threads;
    gridDim.x = grid;
    for (unsigned g = 0; g < grid; ++g) {
        blockIdx.x = g;
        for (unsigned t = 0; t < threads; ++t) {
            l.sp[t] = fresh_stack(t);
            l.done[t] = 0;
        }
        unsigned left = threads;
        while (left > 0) {
            for (unsigned t = 0; t < threads; ++t) {
                if (l.done[t]) continue;
                l.running = t;
                threadIdx.x = t;
                zq_emu_switch(&l.scheduler_sp, l.sp[t]);
                if (l.done[t]) --left;
            }
        }
    }
    launch_now = nullptr;
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

typedef void (*CastFn)(const void*, void*, u64);
static std::map<std::string, CastFn>& cast_table() { static std::map<std::string, CastFn> m; return m; }
#define REG_C(NAME) static bool reg_##NAME = (cast_table()[#NAME] = (CastFn)(void*)&NAME, true);
REG_C(zq_to_f32_f32) REG_C(zq_to_f32_bf16) REG_C(zq_to_f32_f16)
REG_C(zq_from_f32_f32) REG_C(zq_from_f32_bf16) REG_C(zq_from_f32_f16)

extern "C" int zq_emu_cast(const char* name, unsigned grid, const void* x, void* y, u64 n) {
    auto it = cast_table().find(name);
    if (it == cast_table().end()) return -1;
    auto f = it->second;
    zq_emu::launch(grid, zq::THREADS, [=] { f(x, y, n); });
    return 0;
}

extern "C" void zq_emu_hadamard_stage_f32(unsigned grid, float* x, u64 n, u64 block, u64 h, float scale) {
    zq_emu::launch(grid, zq::THREADS, [=] { zq_hadamard_stage_f32(x, n, block, h, scale); });
}

extern "C" unsigned zq_emu_qinput_size() { return sizeof(zq::QInput); }
