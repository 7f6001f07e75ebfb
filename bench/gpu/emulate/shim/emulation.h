// Compiling bertkit's CUDA kernels on the CPU (`-include emulation.h`, with this folder on the
// include path for `cuda_bf16.h` and `mma.h`): each block's threads are real threads, so that
// `__syncthreads`, `__syncwarp` and the warp shuffles synchronise as on a GPU, and `__shared__`
// arrays are function statics shared by the block's threads (blocks run one after another).
// Enough for the kernels whose code is plain C++ over these primitives; it checks their
// indexing, tiling and synchronisation, not the GPU's speed or its rounding of `expf`.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <thread>
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

inline thread_local EmulatedDim threadIdx, blockIdx;
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

// The block's barriers, the warps' exchange slots and its dynamic shared memory, set up by
// `emulate_launch`.
struct EmulatedBlock {
    std::barrier<>* block;
    std::vector<std::barrier<>*> warps;
    std::vector<double> slots;
    std::vector<double> dynamic_shared;
    // `tensor_core.h`'s exchange: six 32-bit registers and a row address a thread.
    std::vector<uint32_t> words;
    std::vector<const __nv_bfloat16*> addresses;
};
inline EmulatedBlock* emulated_block = nullptr;

inline int emulated_lane() { return threadIdx.x & 31; }

// `extern __shared__ T name[]` (common.cuh's DYNAMIC_SHARED): the block's buffer.
#define DYNAMIC_SHARED(T, name) T* name = (T*)emulated_block->dynamic_shared.data()

inline void __syncthreads() { emulated_block->block->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) {
    emulated_block->warps[threadIdx.x >> 5]->arrive_and_wait();
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
// real threads (a whole number of warps) and `shared_bytes` of dynamic shared memory. The
// threads are made once a launch and go through the blocks together, each block starting from
// fresh state (its exchange slots and dynamic shared memory zeroed, no copies in flight), as
// if each block had threads of its own (made a block at a time, they cost the whole emulation
// ~17% more; most of the system's time left is the barriers').
inline void emulate_launch(EmulatedDim grid, unsigned threads, const std::function<void()>& kernel,
                           size_t shared_bytes = 0);

#include "tensor_core.h"

inline void emulate_launch(EmulatedDim grid, unsigned threads, const std::function<void()>& kernel,
                           size_t shared_bytes) {
    gridDim = grid;
    blockDim = {threads, 1, 1};
    std::barrier<> block((std::ptrdiff_t)threads);
    EmulatedBlock state{&block,
                        {},
                        std::vector<double>(threads),
                        std::vector<double>((shared_bytes + 7) / 8),
                        std::vector<uint32_t>(threads * 6),
                        std::vector<const __nv_bfloat16*>(threads)};
    std::vector<std::unique_ptr<std::barrier<>>> owned;
    for (unsigned w = 0; w < threads / 32; ++w) {
        owned.push_back(std::make_unique<std::barrier<>>(32));
        state.warps.push_back(owned.back().get());
    }
    emulated_block = &state;
    const size_t blocks = (size_t)grid.x * grid.y * grid.z;
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
            for (size_t n = 0; n < blocks; ++n) {
                threadIdx = {t, 0, 0};
                blockIdx = {(unsigned)(n % grid.x), (unsigned)(n / grid.x % grid.y),
                            (unsigned)(n / ((size_t)grid.x * grid.y))};
                emulated_copies.assign(1, {});
                kernel();
                // Every thread done with the block before its state is cleared for the next.
                block.arrive_and_wait();
                if (t == 0) {
                    std::fill(state.slots.begin(), state.slots.end(), 0.0);
                    std::fill(state.dynamic_shared.begin(), state.dynamic_shared.end(), 0.0);
                    std::fill(state.words.begin(), state.words.end(), 0u);
                    std::fill(state.addresses.begin(), state.addresses.end(), nullptr);
                }
                block.arrive_and_wait();
            }
        });
    }
    for (auto& th : pool) th.join();
    emulated_block = nullptr;
}

