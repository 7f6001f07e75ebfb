// Compiling bertkit's CUDA kernels on the CPU (`-include emulation.h`, with this folder on the
// include path for `cuda_bf16.h` and `mma.h`): each block's threads are fibers (contexts of
// their own, one OS thread running them in turn), so that `__syncthreads`, `__syncwarp` and the
// warp shuffles synchronise as on a GPU, and `__shared__` arrays are function statics shared by
// the block's threads (blocks run one after another). Enough for the kernels whose code is
// plain C++ over these primitives; it checks their indexing, tiling and synchronisation, not
// the GPU's speed or its rounding of `expf`.
//
// A thread runs until it waits at a barrier (or ends); then the first of the block's threads in
// order that can run does: by their index, up in even blocks and down in odd ones. So between
// two barriers a block's threads, and its warps, run one after another, from the first to the
// last in one block and from the last to the first in the next: of two threads that touch the
// same shared memory between two barriers each goes first in some block (a grid of one block
// sees the first order only), and a missing barrier shows as a stale read, as it may on a GPU,
// every run the same. A barrier that some threads never reach stops the emulation with a
// message, where real threads would hang.
#pragma once
#include <ucontext.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <vector>

#include <cuda_bf16.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct EmulatedDim {
    unsigned x = 1, y = 1, z = 1;
};

// The running thread's indices (each fiber's own, put here when it runs).
inline EmulatedDim threadIdx, blockIdx;
inline EmulatedDim blockDim, gridDim;

struct uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct alignas(16) float4 {
    float x, y, z, w;
};

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::max;
using std::min;

// A barrier of `expected` threads: the last to arrive opens it (a new generation) and goes on;
// the others wait until it has opened.
struct EmulatedBarrier {
    unsigned expected = 0, arrived = 0;
    uint64_t generation = 0;
    void arrive_and_wait();
};

// A `cp.async` copy queued by a thread (`tensor_core.h`).
struct EmulatedCopy {
    void* dst;
    const void* src;
    bool valid;
};

// Switching from one thread's context to another's. On x86-64 by the few instructions below:
// the callee-saved registers and the floating-point control words pushed on the stack being
// left, the stack pointer saved, the other's loaded, and popped from it. Elsewhere by
// `swapcontext`, which also saves and restores the signal mask, a system call at each switch
// (on x86-64 it made the whole emulation take 3:02 where this takes 0:46, 75 s of it in the
// system; `-DEMULATION_UCONTEXT` picks it).
#if defined(__x86_64__) && !defined(EMULATION_UCONTEXT)
#define EMULATION_OWN_SWITCH 1
extern "C" void emulated_jump(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl emulated_jump
    .type emulated_jump, @function
emulated_jump:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emulated_jump, .-emulated_jump
)");
struct EmulatedContext {
    void* sp = nullptr;
};
inline void emulated_swap(EmulatedContext& from, EmulatedContext& to) {
    emulated_jump(&from.sp, to.sp);
}
#else
struct EmulatedContext {
    ucontext_t context;
};
inline void emulated_swap(EmulatedContext& from, EmulatedContext& to) {
    swapcontext(&from.context, &to.context);
}
#endif

// One emulated thread: its context and stack, its indices, its queued copies, and the barrier
// it waits at (with the generation that must pass), if any.
struct EmulatedFiber {
    EmulatedContext context;
    EmulatedDim thread, block;
    // The thread's copy groups, oldest first; the last one still open.
    std::vector<std::vector<EmulatedCopy>> copies{1};
    const EmulatedBarrier* waiting = nullptr;
    uint64_t waiting_for = 0;
    bool done = false;
};

// The block's barriers, the warps' exchange slots and its dynamic shared memory, set up by
// `emulate_launch`.
struct EmulatedBlock {
    EmulatedBarrier block;
    std::vector<EmulatedBarrier> warps;
    std::vector<double> slots;
    std::vector<double> dynamic_shared;
    // `tensor_core.h`'s exchange: six 32-bit registers and a row address a thread.
    std::vector<uint32_t> words;
    std::vector<const __nv_bfloat16*> addresses;
};
inline EmulatedBlock* emulated_block = nullptr;

// The launch's threads, the one running, and the way the next is chosen (see the top).
struct EmulatedScheduler {
    std::vector<EmulatedFiber> fibers;
    size_t running = 0;
    // The order (down: by index from the last), and the next block's, taken at the first
    // barrier opened after it is set: the search from the first in order is the only one
    // that does not assume the order it started in.
    bool downwards = false, next_downwards = false;
    EmulatedContext launcher;
};
inline EmulatedScheduler* emulated_scheduler = nullptr;

inline std::vector<std::vector<EmulatedCopy>>& emulated_copies() {
    return emulated_scheduler->fibers[emulated_scheduler->running].copies;
}

inline bool emulated_can_run(const EmulatedFiber& f) {
    return !f.done && (f.waiting == nullptr || f.waiting->generation != f.waiting_for);
}

// Hands the CPU to the first thread in the block's order (up or down) that can run: the running
// one again if it comes first, else the next, or, when every thread is done, back to the
// launch. Every thread waiting with none to open its barrier is a kernel whose threads do not
// all reach a barrier: the emulation stops. The threads before the running one in order are
// all waiting (or done) until it opens a barrier: the search starts after it (`opened` false)
// or, where it has just opened one, from the first.
inline void emulated_switch(bool opened) {
    EmulatedScheduler& s = *emulated_scheduler;
    const size_t n = s.fibers.size(), from = s.running;
    EmulatedFiber& current = s.fibers[from];
    current.thread = threadIdx;
    current.block = blockIdx;
    size_t next = n;
    if (opened) s.downwards = s.next_downwards;
    const size_t place = s.downwards ? n - 1 - from : from;
    for (size_t k = opened ? 0 : place + 1; k < n; ++k) {
        const size_t i = s.downwards ? n - 1 - k : k;
        if (emulated_can_run(s.fibers[i])) {
            next = i;
            break;
        }
    }
    if (next == from) return;
    if (next == n) {
        if (std::all_of(s.fibers.begin(), s.fibers.end(), [](const auto& f) { return f.done; })) {
            emulated_swap(current.context, s.launcher);
            return;
        }
        std::fprintf(stderr,
                     "emulation: every thread of block (%u, %u, %u) waits at a barrier that "
                     "no thread left can open (a barrier some threads do not reach)\n",
                     blockIdx.x, blockIdx.y, blockIdx.z);
        std::abort();
    }
    s.running = next;
    threadIdx = s.fibers[next].thread;
    blockIdx = s.fibers[next].block;
    emulated_swap(current.context, s.fibers[next].context);
    // Running again (another thread switched back here).
    threadIdx = current.thread;
    blockIdx = current.block;
}

// The last thread to arrive opens the barrier and hands over to the first in order, as the
// others do when they wait: between two barriers the threads run one after another in order.
inline void EmulatedBarrier::arrive_and_wait() {
    if (++arrived == expected) {
        arrived = 0;
        ++generation;
        emulated_switch(true);
        return;
    }
    EmulatedFiber& me = emulated_scheduler->fibers[emulated_scheduler->running];
    me.waiting = this;
    me.waiting_for = generation;
    while (generation == me.waiting_for) emulated_switch(false);
    me.waiting = nullptr;
}

inline int emulated_lane() { return threadIdx.x & 31; }

// `extern __shared__ T name[]` (common.cuh's DYNAMIC_SHARED): the block's buffer.
#define DYNAMIC_SHARED(T, name) T* name = (T*)emulated_block->dynamic_shared.data()

inline void __syncthreads() { emulated_block->block.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) {
    emulated_block->warps[threadIdx.x >> 5].arrive_and_wait();
}

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    double* slots = emulated_block->slots.data() + warp * 32;
    slots[lane] = (double)v;
    __syncwarp();
    const T other = (T)slots[lane ^ mask];
    __syncwarp();
    return other;
}

// Runs `kernel` over the grid, a block at a time (x fastest, then y, then z), with `threads`
// threads (a whole number of warps) and `shared_bytes` of dynamic shared memory. The threads
// are made once a launch and go through the blocks together, each block starting from fresh
// state (its exchange slots and dynamic shared memory zeroed, no copies in flight), as if each
// block had threads of its own.
inline void emulate_launch(EmulatedDim grid, unsigned threads, const std::function<void()>& kernel,
                           size_t shared_bytes = 0);

#include "tensor_core.h"

// A thread's stack: the kernels' arrays and the emulation's own frames (1 MiB, of which only
// what is touched takes memory), with its lowest page left unmapped so that an overflow stops
// the emulation where it would write past the stack.
constexpr size_t EMULATED_STACK_BYTES = size_t(1) << 20;

struct EmulatedStack {
    void* base = nullptr;
    EmulatedStack() {
        base = mmap(nullptr, EMULATED_STACK_BYTES, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (base == MAP_FAILED) {
            std::perror("emulation: a thread's stack");
            std::abort();
        }
        mprotect(base, 4096, PROT_NONE);
    }
    ~EmulatedStack() { munmap(base, EMULATED_STACK_BYTES); }
    EmulatedStack(const EmulatedStack&) = delete;
    EmulatedStack& operator=(const EmulatedStack&) = delete;
};

// What each thread runs: the grid's blocks in turn (see `emulate_launch`).
struct EmulatedLaunch {
    EmulatedDim grid;
    const std::function<void()>* kernel;
};
inline EmulatedLaunch emulated_launch;

inline void emulated_thread_body() {
    EmulatedScheduler& s = *emulated_scheduler;
    EmulatedBlock& state = *emulated_block;
    const unsigned t = (unsigned)s.running;
    const EmulatedDim grid = emulated_launch.grid;
    const size_t blocks = (size_t)grid.x * grid.y * grid.z;
    for (size_t n = 0; n < blocks; ++n) {
        threadIdx = {t, 0, 0};
        blockIdx = {(unsigned)(n % grid.x), (unsigned)(n / grid.x % grid.y),
                    (unsigned)(n / ((size_t)grid.x * grid.y))};
        emulated_copies().assign(1, {});
        (*emulated_launch.kernel)();
        // Every thread done with the block before its state is cleared for the next.
        state.block.arrive_and_wait();
        if (t == 0) {
            std::fill(state.slots.begin(), state.slots.end(), 0.0);
            std::fill(state.dynamic_shared.begin(), state.dynamic_shared.end(), 0.0);
            std::fill(state.words.begin(), state.words.end(), 0u);
            std::fill(state.addresses.begin(), state.addresses.end(), nullptr);
            s.next_downwards = (n + 1) % 2 == 1;
        }
        state.block.arrive_and_wait();
    }
    s.fibers[t].done = true;
    emulated_switch(false);
}

// A context that starts in `emulated_thread_body` on `stack`. Our own switch's first switch to
// it pops what it would have pushed (the control words as they are now, zeros for the
// registers) and returns into the body, the stack then aligned as after a call.
inline void emulated_make_context(EmulatedContext& c, EmulatedStack& stack) {
#ifdef EMULATION_OWN_SWITCH
    auto* top = (uint64_t*)((char*)stack.base + EMULATED_STACK_BYTES);
    uint64_t* sp = top - 9;
    uint32_t mxcsr;
    uint16_t fpu;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpu));
    sp[0] = (uint64_t)mxcsr | ((uint64_t)fpu << 32);
    for (int r = 1; r <= 6; ++r) sp[r] = 0;
    sp[7] = (uint64_t)&emulated_thread_body;
    sp[8] = 0;  // the body's return address: it never returns
    c.sp = sp;
#else
    getcontext(&c.context);
    c.context.uc_stack.ss_sp = stack.base;
    c.context.uc_stack.ss_size = EMULATED_STACK_BYTES;
    c.context.uc_link = nullptr;
    makecontext(&c.context, emulated_thread_body, 0);
#endif
}

inline void emulate_launch(EmulatedDim grid, unsigned threads, const std::function<void()>& kernel,
                           size_t shared_bytes) {
    gridDim = grid;
    blockDim = {threads, 1, 1};
    EmulatedBlock state{{threads},
                        std::vector<EmulatedBarrier>(threads / 32, EmulatedBarrier{32}),
                        std::vector<double>(threads),
                        std::vector<double>((shared_bytes + 7) / 8),
                        std::vector<uint32_t>(threads * 6),
                        std::vector<const __nv_bfloat16*>(threads)};
    EmulatedScheduler scheduler;
    scheduler.fibers.resize(threads);
    std::vector<std::unique_ptr<EmulatedStack>> stacks;
    for (unsigned t = 0; t < threads; ++t) {
        stacks.push_back(std::make_unique<EmulatedStack>());
        emulated_make_context(scheduler.fibers[t].context, *stacks.back());
        scheduler.fibers[t].thread = {t, 0, 0};
    }
    emulated_block = &state;
    emulated_scheduler = &scheduler;
    emulated_launch = {grid, &kernel};
    threadIdx = {0, 0, 0};
    emulated_swap(scheduler.launcher, scheduler.fibers[0].context);
    emulated_scheduler = nullptr;
    emulated_block = nullptr;
}
