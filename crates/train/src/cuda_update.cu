// The optimiser update of one parameter group on CUDA: the device half of `cuda_update.rs`,
// the twin of `cpu_update.rs` (the same f32 arithmetic, element by element; LAMB's squared
// norms in f64). The group's `[3, rows, numel]` weights, first and second moments are updated
// where they are: for LAMB three launches (the moments with per-block partial norms, each
// row's trust ratio, the weights), for AdamW one, where the composed update made about
// fifteen passes; every parameter is set from its new weights as they are written. And the
// copies around it in one launch each, whatever the number of parameters: every gradient into
// the flat bucket, and its squared norm.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// The step's scalars in f32 (`cpu_update::Constants`), as `cuda_update::Constants`
// (#[repr(C)]).
struct Constants {
    float clip, b1, one_b1, b2, one_b2, inv_bc1, inv_bc2, eps, decay;
    int32_t decayed;
    int32_t trust_ratio;
};

// Elements a block covers in a row.
#define CHUNK 4096
#define THREADS 256

// A tensor on the device as the copies take it (`cuda_update::DeviceTensor`, #[repr(C)]): the
// address of its first element and its element type; address 0 is none (an absent gradient,
// which reads as zeros; a parameter not to set).
struct DeviceTensor {
    uint64_t address;
    int32_t dtype;  // ELEMENT_*
    int32_t unused;
};

// Element types (`cuda_update::Element`).
#define ELEMENT_F32 0
#define ELEMENT_BF16 1
#define ELEMENT_F16 2

__device__ __forceinline__ float load_f32(const DeviceTensor& t, uint64_t j) {
    if (t.address == 0) return 0.0f;
    switch (t.dtype) {
        case ELEMENT_BF16: return __bfloat162float(((const __nv_bfloat16*)t.address)[j]);
        case ELEMENT_F16: return __half2float(((const __half*)t.address)[j]);
        default: return ((const float*)t.address)[j];
    }
}

__device__ __forceinline__ void store_f32(const DeviceTensor& t, uint64_t j, float x) {
    if (t.address == 0) return;
    switch (t.dtype) {
        case ELEMENT_BF16: ((__nv_bfloat16*)t.address)[j] = __float2bfloat16(x); break;
        case ELEMENT_F16: ((__half*)t.address)[j] = __float2half(x); break;
        default: ((float*)t.address)[j] = x;
    }
}

__device__ double block_sum(double v, double* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? scratch[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// This block's share of row `row`'s squared norms, `w2` and `u2` summed over its threads, into
// `norms` (`[rows, gridDim.x, 2]`): what the moments' launches leave for the trust ratio.
__device__ __forceinline__ void store_partial_norms(double w2, double u2, double* scratch,
                                                    double* norms, int row) {
    w2 = block_sum(w2, scratch);
    u2 = block_sum(u2, scratch);
    if (threadIdx.x == 0) {
        double* out = norms + ((size_t)row * gridDim.x + blockIdx.x) * 2;
        out[0] = w2;
        out[1] = u2;
    }
}

// The trust ratio `‖w‖ / ‖u‖` from the squared norms, 1 when either is 0.
__device__ __forceinline__ float trust_ratio_of(double w2, double u2) {
    const double wn = sqrt(w2), un = sqrt(u2);
    return wn > 0.0 && un > 0.0 ? (float)(wn / un) : 1.0f;
}

// Each row's trust ratio `‖w‖ / ‖u‖` (1 when either is 0) from its blocks' partial norms
// (`norms`, `[rows, blocks, 2]`), a block per row summing them in parallel, into `ratios`
// (`[rows]`) for the weights' launch to read: once a row, where each block of the weights'
// launch adding up its row's partials would do it the row's blocks times over (BERT-large's
// word embeddings are one row of 7,630 blocks).
extern "C" __global__ void trust_ratios(const double* norms, int rows, int blocks,
                                        float* ratios) {
    __shared__ double scratch[32];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const double* p = norms + (size_t)row * blocks * 2;
        double w2 = 0.0, u2 = 0.0;
        for (int b = threadIdx.x; b < blocks; b += blockDim.x) {
            w2 += p[2 * b];
            u2 += p[2 * b + 1];
        }
        w2 = block_sum(w2, scratch);
        u2 = block_sum(u2, scratch);
        if (threadIdx.x == 0) ratios[row] = trust_ratio_of(w2, u2);
    }
}

// `state` is the group's `[3, rows, numel]` weights, first and second moments, updated where
// they are (no second state allocated per group per step). The moments' launch writes the
// moments and the per-block norms; the weights' launch recomputes each element's update from
// the new moments and the old weight (the same function, so the same value the first launch
// measured) and writes the weight.

// An element's update `m̂ / (√v̂ + ε) (+ decay · w)` from its new moments.
__device__ __forceinline__ float update_of(float mi, float vi, float wi, const Constants& c) {
    const float denominator = sqrtf(vi * c.inv_bc2) + c.eps;
    float u = (mi * c.inv_bc1) / denominator;
    if (c.decayed) u = u + wi * c.decay;
    return u;
}

// An element's new moments from its gradient `gi` (before clipping) and its old moments.
__device__ __forceinline__ void new_moments(float gi, float& mi, float& vi, const Constants& c) {
    const float clipped = gi * c.clip;
    mi = mi * c.b1 + clipped * c.one_b1;
    vi = vi * c.b2 + clipped * clipped * c.one_b2;
}

// An element's new weight: its update times the row's ratio and the learning rate, taken off.
__device__ __forceinline__ float stepped(float wi, float u, float ratio, float lr) {
    return wi - u * ratio * lr;
}

// Each thread's loads are issued ahead: it reads all of its elements of the block's chunk
// first (`AHEAD` a thread, each array), then computes and stores them in the same order (a
// read, compute and store an element at a time keeps one element's loads in flight a thread:
// the stores may alias the next element's loads as far as the compiler knows). Where the rule
// has no trust ratio (AdamW) the update is one launch: the moments, the update and the weight
// in one pass (30 bytes a parameter moved where two launches move 42).

// Elements of each array a thread holds (a block's chunk over its threads).
#define AHEAD (CHUNK / THREADS)

// The index in a row of thread `threadIdx.x`'s `k`-th element of the chunk at `start`.
__device__ __forceinline__ int ahead_index(int start, int k) {
    return start + threadIdx.x + k * THREADS;
}

// Where the moments' launches read a row's gradients. `BucketGradients`: the group's rows of
// the flat f32 bucket. `HeldGradients` (`cuda_update::update_in_place_held`): each row's
// gradient as the backward made it (f32, bf16 or f16; address 0: none, zeros), times
// `unscale` as it is read: the value `pieces_to_flat` would have put in the bucket, bit for
// bit, without the bucket. `with_row(r, f)` calls `f` with what row `r`'s elements are read
// from (`at(i, j)`: element `j` of the row, at `i` in the group's rows), its element type
// settled once a row (a branch a block, not an element: the loads stay ahead).
struct BucketGradients {
    const float* g;
    template <class F>
    __device__ __forceinline__ void with_row(int, F&& f) const { f(*this); }
    __device__ __forceinline__ float at(size_t i, int) const { return g[i]; }
};

__device__ __forceinline__ float as_f32(float x) { return x; }
__device__ __forceinline__ float as_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float as_f32(__half x) { return __half2float(x); }

template <class T>
struct HeldRow {
    const T* g;
    float unscale;
    __device__ __forceinline__ float at(size_t, int j) const {
        const float x = as_f32(g[j]);
        return unscale == 1.0f ? x : x * unscale;
    }
};

struct AbsentRow {
    __device__ __forceinline__ float at(size_t, int) const { return 0.0f; }
};

struct HeldGradients {
    const DeviceTensor* rows;
    float unscale;
    template <class F>
    __device__ __forceinline__ void with_row(int r, F&& f) const {
        const DeviceTensor t = rows[r];
        if (t.address == 0) {
            f(AbsentRow{});
        } else if (t.dtype == ELEMENT_BF16) {
            f(HeldRow<__nv_bfloat16>{(const __nv_bfloat16*)t.address, unscale});
        } else if (t.dtype == ELEMENT_F16) {
            f(HeldRow<__half>{(const __half*)t.address, unscale});
        } else {
            f(HeldRow<float>{(const float*)t.address, unscale});
        }
    }
};

// The thread's elements of the chunk at `start` of the row at `base` (the row ends at `end`),
// all read before any arithmetic: each one's weight, moments and (`GRADIENT`) gradient, read
// from `g`, a row of a gradients' source above.
template <bool GRADIENT, class Row>
__device__ __forceinline__ void load_ahead(const float* state, const Row& g, size_t base,
                                           size_t total, int start, int end, float (&gs)[AHEAD],
                                           float (&ws)[AHEAD], float (&ms)[AHEAD],
                                           float (&vs)[AHEAD]) {
#pragma unroll
    for (int k = 0; k < AHEAD; ++k) {
        const int j = ahead_index(start, k);
        if (j < end) {
            const size_t i = base + j;
            if (GRADIENT) gs[k] = g.at(i, j);
            ws[k] = state[i];
            ms[k] = state[total + i];
            vs[k] = state[2 * total + i];
        }
    }
}

// The moments' launch over the gradients of `G` (above).
template <class G>
__device__ __forceinline__ void moments_of(float* state, const G& g, double* norms, int rows,
                                           int numel, Constants c) {
    __shared__ double scratch[32];
    const size_t total = (size_t)rows * numel;
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        const size_t base = (size_t)row * numel;
        const int start = blockIdx.x * CHUNK;
        const int end = min(start + CHUNK, numel);
        float gs[AHEAD], ws[AHEAD], ms[AHEAD], vs[AHEAD];
        g.with_row(row, [&](const auto& r) {
            load_ahead<true>(state, r, base, total, start, end, gs, ws, ms, vs);
        });
        double w2 = 0.0, u2 = 0.0;
#pragma unroll
        for (int k = 0; k < AHEAD; ++k) {
            const int j = ahead_index(start, k);
            if (j < end) {
                const size_t i = base + j;
                new_moments(gs[k], ms[k], vs[k], c);
                state[total + i] = ms[k];
                state[2 * total + i] = vs[k];
                if (c.trust_ratio) {
                    const float u = update_of(ms[k], vs[k], ws[k], c);
                    w2 += (double)ws[k] * (double)ws[k];
                    u2 += (double)u * (double)u;
                }
            }
        }
        if (c.trust_ratio) store_partial_norms(w2, u2, scratch, norms, row);
    }
}

// The moments from the flat bucket's rows.
extern "C" __global__ void __launch_bounds__(THREADS)
update_moments(float* state, const float* g, double* norms, int rows, int numel, Constants c) {
    moments_of(state, BucketGradients{g}, norms, rows, numel, c);
}

// The same from each row's gradient as the backward made it (`rows`, `[rows]`), times
// `unscale`: no flat bucket (`cuda_update::update_held`).
// (Two blocks an SM, as the bucket's form has: the element types' loads would take 147
// registers, one block.)
extern "C" __global__ void __launch_bounds__(THREADS, 2)
update_moments_held(float* state, const DeviceTensor* rows_held, float unscale, double* norms,
                    int rows, int numel, Constants c) {
    moments_of(state, HeldGradients{rows_held, unscale}, norms, rows, numel, c);
}

// The new weights `w - (u · ratio) · lr`, the row's trust ratio from `ratios` (`trust_ratios`),
// each row's parameter in `params` (or none: null) set from them.
extern "C" __global__ void __launch_bounds__(THREADS)
update_weights(float* state, int rows, int numel, float lr, Constants c,
               const DeviceTensor* params, const float* ratios) {
    __shared__ float ratio_shared;
    const size_t total = (size_t)rows * numel;
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        if (threadIdx.x == 0) ratio_shared = c.trust_ratio ? ratios[row] : 1.0f;
        const size_t base = (size_t)row * numel;
        const int start = blockIdx.x * CHUNK;
        const int end = min(start + CHUNK, numel);
        float gs[AHEAD], ws[AHEAD], ms[AHEAD], vs[AHEAD];
        load_ahead<false>(state, BucketGradients{nullptr}, base, total, start, end, gs, ws, ms, vs);
        const DeviceTensor param =
            params != nullptr ? params[row] : DeviceTensor{0, ELEMENT_F32, 0};
        __syncthreads();
        const float ratio = ratio_shared;
#pragma unroll
        for (int k = 0; k < AHEAD; ++k) {
            const int j = ahead_index(start, k);
            if (j < end) {
                const float w = stepped(ws[k], update_of(ms[k], vs[k], ws[k], c), ratio, lr);
                state[base + j] = w;
                store_f32(param, j, w);
            }
        }
        __syncthreads();
    }
}

// Without a trust ratio (AdamW): the moments, the update and the weight in one pass, the row's
// parameter set from its new weights; the values `update_moments` and `update_weights` make in
// two.
template <class G>
__device__ __forceinline__ void in_place_one_pass(float* state, const G& g, int rows, int numel,
                                                  float lr, Constants c,
                                                  const DeviceTensor* params) {
    const size_t total = (size_t)rows * numel;
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        const size_t base = (size_t)row * numel;
        const int start = blockIdx.x * CHUNK;
        const int end = min(start + CHUNK, numel);
        float gs[AHEAD], ws[AHEAD], ms[AHEAD], vs[AHEAD];
        g.with_row(row, [&](const auto& r) {
            load_ahead<true>(state, r, base, total, start, end, gs, ws, ms, vs);
        });
        const DeviceTensor param =
            params != nullptr ? params[row] : DeviceTensor{0, ELEMENT_F32, 0};
#pragma unroll
        for (int k = 0; k < AHEAD; ++k) {
            const int j = ahead_index(start, k);
            if (j < end) {
                const size_t i = base + j;
                new_moments(gs[k], ms[k], vs[k], c);
                const float w = stepped(ws[k], update_of(ms[k], vs[k], ws[k], c), 1.0f, lr);
                state[i] = w;
                state[total + i] = ms[k];
                state[2 * total + i] = vs[k];
                store_f32(param, j, w);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
update_one_pass(float* state, const float* g, int rows, int numel, float lr, Constants c,
                const DeviceTensor* params) {
    in_place_one_pass(state, BucketGradients{g}, rows, numel, lr, c, params);
}

// The same from each row's gradient as the backward made it, times `unscale` (as
// `update_moments_held`).
extern "C" __global__ void __launch_bounds__(THREADS)
update_one_pass_held(float* state, const DeviceTensor* rows_held, float unscale, int rows,
                     int numel, float lr, Constants c, const DeviceTensor* params) {
    in_place_one_pass(state, HeldGradients{rows_held, unscale}, rows, numel, lr, c, params);
}

// ---------------------------------------------------------------------------------------------
// The gradient bucket in one launch (`bucket.rs`; its CPU twin is `Gather::cpu` there).

// A tensor's piece of a flat f32 buffer (`cuda_update::Piece`, #[repr(C)]): the `numel`
// elements of `tensor` are the f32s at `flat`; the pieces, in order, tile one index
// `[0, total)` (each starts at `start`, where the one before ends), which the blocks share out.
struct Piece {
    DeviceTensor tensor;
    uint64_t flat;
    uint64_t start;
    uint64_t numel;
};

// Elements of the pieces' index a block copies.
#define PIECES_CHUNK 8192

__device__ __forceinline__ uint64_t smaller(uint64_t a, uint64_t b) { return a < b ? a : b; }
__device__ __forceinline__ uint64_t larger(uint64_t a, uint64_t b) { return a > b ? a : b; }

// The first piece that ends after index `i`.
__device__ int piece_at(const Piece* pieces, int count, uint64_t i) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (pieces[mid].start + pieces[mid].numel <= i) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// Every piece's elements as f32 times `unscale` into (or, `accumulate`, onto) its part of the
// flat buffer (an absent tensor as zeros): the flat gradient bucket made or added to from
// every parameter's gradient at once, where a cast and an addition per parameter took a
// launch each. Each block takes `PIECES_CHUNK` elements of the index at a time, the pieces
// that cross it one after another.
// `f(flat, j, x)` for each of this block's elements of the pieces (`flat`: the piece's part
// of the flat buffer, `j` the element's index in the piece, `x` its value times `unscale` in
// f32): `PIECES_CHUNK` elements of the pieces' index at a time, striding by the grid, the
// pieces that cross a chunk one after another.
template <class F>
__device__ __forceinline__ void each_piece_element(const Piece* pieces, int count,
                                                   uint64_t total, float unscale, F&& f) {
    const uint64_t stride = (uint64_t)gridDim.x * PIECES_CHUNK;
    for (uint64_t begin = (uint64_t)blockIdx.x * PIECES_CHUNK; begin < total; begin += stride) {
        const uint64_t end = smaller(begin + PIECES_CHUNK, total);
        for (int p = piece_at(pieces, count, begin); p < count && pieces[p].start < end; ++p) {
            const Piece piece = pieces[p];
            const uint64_t from = larger(begin, piece.start) - piece.start;
            const uint64_t to = smaller(end, piece.start + piece.numel) - piece.start;
            float* flat = (float*)piece.flat;
            for (uint64_t j = from + threadIdx.x; j < to; j += blockDim.x) {
                const float x = unscale == 1.0f ? load_f32(piece.tensor, j)
                                                : load_f32(piece.tensor, j) * unscale;
                f(flat, j, x);
            }
        }
    }
}

extern "C" __global__ void pieces_to_flat(const Piece* pieces, int count, uint64_t total,
                                          float unscale, int accumulate) {
    each_piece_element(pieces, count, total, unscale, [&](float* flat, uint64_t j, float x) {
        flat[j] = accumulate ? flat[j] + x : x;
    });
}

// ---------------------------------------------------------------------------------------------
// The bucket's squared norm in two launches (`bucket.rs`; its CPU twin is `SquaredNorm::cpu`).

// Each block's share of `Σ x²` over `flat` (`n` f32s) in f64, the blocks' threads striding
// the whole buffer: `partials[blockIdx.x]`. The grid is fixed, so the sums are the same run
// to run.
extern "C" __global__ void squares_partial(const float* flat, uint64_t n, double* partials) {
    __shared__ double scratch[32];
    double s = 0.0;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const double x = flat[i];
        s += x * x;
    }
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// The same over the pieces' elements as `pieces_to_flat` would write them (each times
// `unscale`, in f32), read where the backward left them: the squared norm of the gradients a
// step holds without a flat bucket (`cuda_update::held_squared_norm`; no flat buffer). The
// grid is fixed, so the sums are the same run to run; `partials[blockIdx.x]`.
extern "C" __global__ void pieces_squares_partial(const Piece* pieces, int count, uint64_t total,
                                                  float unscale, double* partials) {
    __shared__ double scratch[32];
    double s = 0.0;
    each_piece_element(pieces, count, total, unscale,
                       [&](float*, uint64_t, float x) { s += (double)x * (double)x; });
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// `out[0] = Σ partials` (one block).
extern "C" __global__ void sum_partials(const double* partials, int count, double* out) {
    __shared__ double scratch[32];
    double s = 0.0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) s += partials[i];
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) out[0] = s;
}
