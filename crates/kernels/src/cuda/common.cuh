// The helpers every bertkit CUDA kernel shares (`kernels.cu` and the `flash.cu` it includes):
// element types (f32, bf16, f16), the dropout's keys, warp and block reductions. A header of
// its own so that `bench/gpu/emulate` can compile the kernels that need no more than this on
// the CPU.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;
typedef __half f16;

// A kernel's dynamic shared memory (the launch's `shared_mem_bytes`) as `T name[]`; the CPU
// emulation (`bench/gpu/emulate`) defines its own.
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(f16 x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ f16 from_f32<f16>(float x) { return __float2half(x); }

// ---------------------------------------------------------------------------------------------
// Dropout keys (dropout.rs).

// bertkit_rng::splitmix64.
__device__ __forceinline__ uint64_t splitmix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// A mask's keys, as `kernels::cuda::DeviceDropout` (#[repr(C)]): `on` 0 means no dropout.
struct Dropout {
    uint64_t key;
    uint64_t first_row;
    uint64_t threshold;
    float scale;
    int32_t on;
};

// dropout.rs `row_key`: row `row` of a batch whose first row is `first_row` of its step.
__device__ __forceinline__ uint64_t row_key(const Dropout& d, uint64_t row) {
    return splitmix(d.key ^ splitmix(d.first_row + row));
}

// dropout.rs `line_key` for one index.
__device__ __forceinline__ uint64_t line_key(uint64_t key, uint64_t index) {
    return splitmix(key ^ splitmix(index + 1));
}

// dropout.rs `keeps`: the factor of element `j` of the line keyed `line`: `scale` or 0.
__device__ __forceinline__ float keep_factor(const Dropout& d, uint64_t line, uint64_t j) {
    return (splitmix(line + j) >> 40) >= d.threshold ? d.scale : 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Reductions.

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// A reduction over the block (a multiple of 32 threads) by a warp's `Reduce`, returned to every
// thread; `scratch` holds 32 floats, `none` is the reduction's identity.
template <float (*Reduce)(float)>
__device__ float block_reduce(float v, float* scratch, float none) {
    v = Reduce(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? scratch[lane] : none;
    return Reduce(v);
}

// The sum over the block, returned to every thread; `scratch` holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
    return block_reduce<warp_sum>(v, scratch, 0.0f);
}

// The maximum over the block, returned to every thread; `scratch` holds 32 floats.
__device__ float block_max(float v, float* scratch) {
    return block_reduce<warp_max>(v, scratch, -INFINITY);
}

// Sums of per-block partial column sums, `out[c] = sum_p partial[p * cols + c]`: a block
// (1,024 threads) per 32 columns, lane `l` of a column summing its parts `l`, `l + 32`, ... in
// order, then the column's 32 lane sums added in lane order (a fixed order: a run repeats its
// bits), so that LayerNorm's 512 partial rows of 2,048 columns take 64 blocks, not the eight a
// thread a column would.
template <typename T>
__device__ void column_sums_lanes(const float* partial, T* out, int parts, int cols) {
    __shared__ float lanes[32][33];
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    for (int c0 = blockIdx.x * 32; c0 < cols; c0 += gridDim.x * 32) {
        const int c = c0 + tx;
        float s = 0.0f;
        if (c < cols) {
            for (int p = ty; p < parts; p += 32) s += partial[(size_t)p * cols + c];
        }
        lanes[ty][tx] = s;
        __syncthreads();
        if (ty == 0 && c < cols) {
            float t = 0.0f;
            for (int l = 0; l < 32; ++l) t += lanes[l][tx];
            out[c] = from_f32<T>(t);
        }
        __syncthreads();
    }
}

// The query rows of a `[batch, heads, seq, seq]` tensor a warp visits: `visit(q, b, h, i)` for
// each, the grid's warps strided over them.
template <typename Visit>
__device__ __forceinline__ void for_each_query(int batch, int heads, int seq, Visit visit) {
    const int warps = blockDim.x >> 5;
    const size_t queries = (size_t)batch * heads * seq;
    for (size_t q = (size_t)blockIdx.x * warps + (threadIdx.x >> 5); q < queries;
         q += (size_t)gridDim.x * warps) {
        visit(q, (int)(q / ((size_t)seq * heads)), (int)((q / seq) % heads), (int)(q % seq));
    }
}
