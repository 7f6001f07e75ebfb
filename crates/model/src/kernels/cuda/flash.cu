// Attention in one pass over key tiles, bf16 on tensor cores (`flash.rs`): included by
// `kernels.cu`; `bench/gpu/emulate` also compiles it on the CPU against a reference.
//
// The same attention as `attention_softmax_*` and cuBLAS's products around them (each query's
// softmax over its row's token keys, scaled, the probabilities dropped as the CPU draws them),
// computed without the `[batch, heads, seq, seq]` scores: a block holds 64 queries of one head
// of one row, walks the row's keys 64 at a time, and keeps each query's running maximum and sum
// (the softmax rescaled as larger scores arrive). The queries, keys and values are read straight
// from the tokens' `[tokens, 3 · hidden]` (no padded copy) and the context is written to the
// tokens' `[tokens, hidden]`.
//
// The backward recomputes the probabilities from each query's log-sum-exp (kept by the
// forward, `[batch, heads, seq]` f32) and `delta = Σ dO·O` per query: one kernel per key tile
// sums the keys' and values' gradients over the query tiles, another per query tile the
// queries' gradient over the key tiles. No atomics: each gradient is summed by one block in a
// fixed order, so a run repeats its bits.
//
// Heads of 64 only, rows up to `MAX_SEQ` (the softmax of the dispatching code), bf16 in and
// out, f32 sums. The products are `wmma` 16×16×16 tiles (sm_80 and later); each warp owns 16
// rows of its block's tile, and a lane two halves of a row for the element-wise steps (row `lane
// / 2`, columns `32 · (lane % 2)` on).

#include <mma.h>

#include "common.cuh"

#define FLASH_HEAD 64
#define FLASH_TILE 64
#define FLASH_WARPS 4
#define FLASH_THREADS (32 * FLASH_WARPS)
// Row strides of the shared tiles: bf16 rows padded by 8 (16 bytes), f32 rows by 4, so that
// `wmma`'s 32-byte alignment holds and rows start on different banks.
#define FLASH_LD 72
#define FLASH_LDF 68

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

using namespace nvcuda;

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> FragB;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> FragBt;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;

// Rows `first..first + 64` of one head's 64 columns starting at column `col` of a `[tokens,
// stride]` bf16 matrix, padded row `i`'s token `places[i]`, into `tile` (`[64][FLASH_LD]`),
// zeros where the row is padding or past `seq`; `valid` (64 flags, or null) gets whether each
// row is a token. The whole block, 16 bytes a load.
__device__ __forceinline__ void flash_load_tile(bf16* tile, const bf16* src, size_t stride,
                                                int col, const uint32_t* places, int first,
                                                int seq, int tokens, int* valid) {
    for (int v = threadIdx.x; v < FLASH_TILE * 8; v += blockDim.x) {
        const int row = v >> 3, part = v & 7;
        const int i = first + row;
        const uint32_t t = i < seq ? places[i] : (uint32_t)tokens;
        uint4 value = make_uint4(0, 0, 0, 0);
        if (t < (uint32_t)tokens) value = *(const uint4*)(src + (size_t)t * stride + col + part * 8);
        *(uint4*)(tile + row * FLASH_LD + part * 8) = value;
        if (valid && part == 0) valid[row] = t < (uint32_t)tokens;
    }
}

// A warp's `[16, 64]` product into its f32 scratch (`[16][FLASH_LDF]`): `a` (the warp's 16
// rows, four 16-column fragments) times `b`'s 64 columns, `b` read from a shared tile either as
// `[k, n]` rows (`Transposed` false) or as the transpose of `[n, k]` rows.
template <bool Transposed>
__device__ __forceinline__ void flash_product(const FragA (&a)[4], const bf16* b, float* out) {
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        FragC c;
        wmma::fill_fragment(c, 0.0f);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (Transposed) {
                FragBt f;
                wmma::load_matrix_sync(f, b + n * 16 * FLASH_LD + k * 16, FLASH_LD);
                wmma::mma_sync(c, a[k], f, c);
            } else {
                FragB f;
                wmma::load_matrix_sync(f, b + k * 16 * FLASH_LD + n * 16, FLASH_LD);
                wmma::mma_sync(c, a[k], f, c);
            }
        }
        wmma::store_matrix_sync(out + n * 16, c, FLASH_LDF, wmma::mem_row_major);
    }
}

// `acc[n] += a · b[:, 16n..16n+16]`, `a` the warp's `[16, 64]` bf16 scratch (`[16][FLASH_LD]`),
// `b` a `[64, 64]` shared tile read as `[k, n]` rows.
__device__ __forceinline__ void flash_accumulate(FragC (&acc)[4], const bf16* a, const bf16* b) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        FragA f;
        wmma::load_matrix_sync(f, a + k * 16, FLASH_LD);
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            FragB g;
            wmma::load_matrix_sync(g, b + k * 16 * FLASH_LD + n * 16, FLASH_LD);
            wmma::mma_sync(acc[n], f, g, acc[n]);
        }
    }
}

// The warp's 16 rows of a shared tile as four fragments.
__device__ __forceinline__ void flash_fragments(FragA (&a)[4], const bf16* tile, int warp) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        wmma::load_matrix_sync(a[k], tile + warp * 16 * FLASH_LD + k * 16, FLASH_LD);
    }
}

// The warp's `[16, 64]` accumulators written to 64 columns from `col` of the tokens' rows
// (`[tokens, stride]`), row `first + r` the padded place; through the warp's f32 scratch.
__device__ __forceinline__ void flash_store_rows(FragC (&acc)[4], float* scratch, bf16* dst,
                                                 size_t stride, int col, const uint32_t* places,
                                                 int first, int seq, int tokens) {
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        wmma::store_matrix_sync(scratch + n * 16, acc[n], FLASH_LDF, wmma::mem_row_major);
    }
    __syncwarp();
    const int lane = threadIdx.x & 31, r = lane >> 1, half = lane & 1;
    const int i = first + r;
    const uint32_t t = i < seq ? places[i] : (uint32_t)tokens;
    if (t < (uint32_t)tokens) {
        const float* from = scratch + r * FLASH_LDF + half * 32;
        bf16* to = dst + (size_t)t * stride + col + half * 32;
#pragma unroll
        for (int k = 0; k < 32; ++k) to[k] = __float2bfloat16(from[k]);
    }
    __syncwarp();
}

// One past the last token place of a row (0 for a row of padding only), from its places, for
// the whole block: the tiles past it hold no token, as queries or as keys, and are skipped
// (a batch is as long as its longest row; the others end sooner).
__device__ int flash_row_end(const uint32_t* places, int seq, int tokens) {
    __shared__ int ends[FLASH_WARPS];
    int end = 0;
    for (int i = threadIdx.x; i < seq; i += blockDim.x) {
        if (places[i] < (uint32_t)tokens) end = i + 1;
    }
    for (int o = 16; o > 0; o >>= 1) end = max(end, __shfl_xor_sync(0xffffffffu, end, o));
    if ((threadIdx.x & 31) == 0) ends[threadIdx.x >> 5] = end;
    __syncthreads();
    end = 0;
    for (int w = 0; w < FLASH_WARPS; ++w) end = max(end, ends[w]);
    return end;
}

// The forward: grid (query tiles, heads, batch). Writes the context `[tokens, hidden]` and each
// query's log-sum-exp of its scaled scores (`lse`, `[batch, heads, seq]`).
extern "C" __global__ void __launch_bounds__(FLASH_THREADS)
    flash_attention_forward_bf16(const bf16* qkv, bf16* context, float* lse,
                                 const uint32_t* scatter, int tokens, int batch, int heads,
                                 int seq, float scale, Dropout d) {
    __shared__ __align__(32) bf16 keys[FLASH_TILE * FLASH_LD];
    __shared__ __align__(32) bf16 values[FLASH_TILE * FLASH_LD];
    __shared__ __align__(32) float scratch[FLASH_WARPS][16 * FLASH_LDF];
    __shared__ __align__(32) bf16 probs[FLASH_WARPS][16 * FLASH_LD];
    __shared__ int key_valid[FLASH_TILE];
    const int q0 = blockIdx.x * FLASH_TILE, h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 1, half = lane & 1;
    const int hidden = heads * FLASH_HEAD;
    const size_t stride = 3 * (size_t)hidden;
    const uint32_t* places = scatter + (size_t)b * seq;
    const int end = flash_row_end(places, seq, tokens);
    if (q0 >= end) {
        // Padding only: no context; the log-sum-exp the backward reads for a whole tile.
        for (int i = q0 + threadIdx.x; i < min(q0 + FLASH_TILE, seq); i += blockDim.x) {
            lse[((size_t)b * heads + h) * seq + i] = 0.0f;
        }
        return;
    }

    // The queries, through the keys' tile, into registers.
    flash_load_tile(keys, qkv, stride, h * FLASH_HEAD, places, q0, seq, tokens, nullptr);
    __syncthreads();
    FragA q[4];
    flash_fragments(q, keys, warp);
    __syncthreads();

    const int i = q0 + warp * 16 + r;
    const bool query = i < seq && places[i] < (uint32_t)tokens;
    const uint64_t line = d.on ? line_key(line_key(row_key(d, b), h), i) : 0;
    float* mine = scratch[warp];
    bf16* p_row = probs[warp] + r * FLASH_LD + half * 32;
    float o[32];
#pragma unroll
    for (int k = 0; k < 32; ++k) o[k] = 0.0f;
    float m = -INFINITY, l = 0.0f;

    for (int k0 = 0; k0 < end; k0 += FLASH_TILE) {
        flash_load_tile(keys, qkv, stride, hidden + h * FLASH_HEAD, places, k0, seq, tokens,
                        key_valid);
        flash_load_tile(values, qkv, stride, 2 * hidden + h * FLASH_HEAD, places, k0, seq,
                        tokens, nullptr);
        __syncthreads();
        flash_product<true>(q, keys, mine);
        __syncwarp();
        float s[32];
        float tile_max = -INFINITY;
        const float* s_row = mine + r * FLASH_LDF + half * 32;
#pragma unroll
        for (int k = 0; k < 32; ++k) {
            s[k] = key_valid[half * 32 + k] ? s_row[k] * scale : -INFINITY;
            tile_max = fmaxf(tile_max, s[k]);
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        const float m_new = fmaxf(m, tile_max);
        const float alpha = m == -INFINITY ? 0.0f : expf(m - m_new);
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < 32; ++k) {
            const float p = s[k] == -INFINITY ? 0.0f : expf(s[k] - m_new);
            sum += p;
            const float kept = d.on ? p * keep_factor(d, line, k0 + half * 32 + k) : p;
            p_row[k] = __float2bfloat16(kept);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * alpha + sum;
        m = m_new;
        __syncwarp();
        FragC pv[4];
#pragma unroll
        for (int n = 0; n < 4; ++n) wmma::fill_fragment(pv[n], 0.0f);
        flash_accumulate(pv, probs[warp], values);
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            wmma::store_matrix_sync(mine + n * 16, pv[n], FLASH_LDF, wmma::mem_row_major);
        }
        __syncwarp();
#pragma unroll
        for (int k = 0; k < 32; ++k) o[k] = o[k] * alpha + s_row[k];
        // Every warp done with this tile's keys and values before the next overwrites them.
        __syncthreads();
    }
    if (query) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        bf16* out = context + (size_t)places[i] * hidden + h * FLASH_HEAD + half * 32;
#pragma unroll
        for (int k = 0; k < 32; ++k) out[k] = __float2bfloat16(o[k] * inv);
    }
    // Every place's, padding's 0 (the backward reads a whole tile's).
    if (half == 0 && i < seq) lse[((size_t)b * heads + h) * seq + i] = query ? m + logf(l) : 0.0f;
}

// `delta[b, h, i] = Σ dO·O` over the head's columns of query `i` (0 for padding): a warp a
// query, `[batch, heads, seq]` f32.
extern "C" __global__ void flash_attention_delta_bf16(const bf16* context, const bf16* grad,
                                                      float* delta, const uint32_t* scatter,
                                                      int tokens, int batch, int heads,
                                                      int seq) {
    const int hidden = heads * FLASH_HEAD, lane = threadIdx.x & 31;
    for_each_query(batch, heads, seq, [&](size_t q, int b, int h, int i) {
        const uint32_t t = scatter[(size_t)b * seq + i];
        float s = 0.0f;
        if (t < (uint32_t)tokens) {
            const size_t at = (size_t)t * hidden + h * FLASH_HEAD;
            for (int e = lane; e < FLASH_HEAD; e += 32) {
                s += __bfloat162float(context[at + e]) * __bfloat162float(grad[at + e]);
            }
        }
        s = warp_sum(s);
        if (lane == 0) delta[q] = s;
    });
}

// The probability of (query, key `j`) from the scaled score and the query's log-sum-exp (0
// where either is padding), its dropout keep set as bit `k` of `kept` (always, without dropout).
__device__ __forceinline__ float flash_probability(float score, float lse, bool live,
                                                   const Dropout& d, uint64_t line, int j, int k,
                                                   uint32_t& kept) {
    if (!d.on || keep_factor(d, line, j) != 0.0f) kept |= 1u << k;
    return live ? expf(score - lse) : 0.0f;
}

// The dropout's factor of bit `k` of `kept`: the kept elements' scale (1 without dropout), or 0.
__device__ __forceinline__ float flash_keep(const Dropout& d, uint32_t kept, int k) {
    return (kept >> k) & 1u ? (d.on ? d.scale : 1.0f) : 0.0f;
}

// The keys' and values' gradients: grid (key tiles, heads, batch); each warp's 16 keys summed
// over every query tile, written to the key and value columns of `grad_qkv` (`[tokens, 3 ·
// hidden]`).
extern "C" __global__ void __launch_bounds__(FLASH_THREADS)
    flash_attention_backward_kv_bf16(const bf16* qkv, const bf16* grad, const float* lse,
                                     const float* delta, bf16* grad_qkv,
                                     const uint32_t* scatter, int tokens, int batch, int heads,
                                     int seq, float scale, Dropout d) {
    __shared__ __align__(32) bf16 queries[FLASH_TILE * FLASH_LD];
    __shared__ __align__(32) bf16 grads[FLASH_TILE * FLASH_LD];
    __shared__ __align__(32) float scratch[FLASH_WARPS][16 * FLASH_LDF];
    __shared__ __align__(32) bf16 part[FLASH_WARPS][16 * FLASH_LD];
    __shared__ float tile_lse[FLASH_TILE], tile_delta[FLASH_TILE];
    __shared__ uint64_t tile_line[FLASH_TILE];  // each query's dropout line, drawn once a tile
    __shared__ int query_valid[FLASH_TILE];
    const int k0 = blockIdx.x * FLASH_TILE, h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 1, half = lane & 1;
    const int hidden = heads * FLASH_HEAD;
    const size_t stride = 3 * (size_t)hidden;
    const uint32_t* places = scatter + (size_t)b * seq;
    const size_t rows = ((size_t)b * heads + h) * seq;
    const int end = flash_row_end(places, seq, tokens);
    if (k0 >= end) return;  // padding keys only: no gradient to write

    // The warp's keys and values into registers, through the shared tiles.
    flash_load_tile(queries, qkv, stride, hidden + h * FLASH_HEAD, places, k0, seq, tokens,
                    nullptr);
    flash_load_tile(grads, qkv, stride, 2 * hidden + h * FLASH_HEAD, places, k0, seq, tokens,
                    nullptr);
    __syncthreads();
    FragA k_frag[4], v_frag[4];
    flash_fragments(k_frag, queries, warp);
    flash_fragments(v_frag, grads, warp);
    __syncthreads();

    const int j = k0 + warp * 16 + r;
    const bool key = j < seq && places[j] < (uint32_t)tokens;
    const uint64_t head_key = d.on ? line_key(row_key(d, b), h) : 0;
    float* mine = scratch[warp];
    bf16* mine_bf = part[warp];
    const float* s_row = mine + r * FLASH_LDF + half * 32;
    bf16* p_row = mine_bf + r * FLASH_LD + half * 32;
    FragC dk[4], dv[4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        wmma::fill_fragment(dk[n], 0.0f);
        wmma::fill_fragment(dv[n], 0.0f);
    }

    for (int q0 = 0; q0 < end; q0 += FLASH_TILE) {
        flash_load_tile(queries, qkv, stride, h * FLASH_HEAD, places, q0, seq, tokens,
                        query_valid);
        flash_load_tile(grads, grad, hidden, h * FLASH_HEAD, places, q0, seq, tokens, nullptr);
        if (threadIdx.x < FLASH_TILE) {
            const int i = q0 + threadIdx.x;
            tile_lse[threadIdx.x] = i < seq ? lse[rows + i] : 0.0f;
            tile_delta[threadIdx.x] = i < seq ? delta[rows + i] : 0.0f;
            tile_line[threadIdx.x] = d.on ? line_key(head_key, i) : 0;
        }
        __syncthreads();
        // Sᵀ: the warp's keys against the tile's queries.
        flash_product<true>(k_frag, queries, mine);
        __syncwarp();
        float p[32];
        uint32_t kept = 0;
#pragma unroll
        for (int k = 0; k < 32; ++k) {
            const int c = half * 32 + k;
            p[k] = flash_probability(s_row[k] * scale, tile_lse[c], key && query_valid[c], d,
                                     tile_line[c], j, k, kept);
            p_row[k] = __float2bfloat16(p[k] * flash_keep(d, kept, k));
        }
        __syncwarp();
        // dV += dropped Pᵀ · dO.
        flash_accumulate(dv, mine_bf, grads);
        __syncwarp();
        // dPᵀ (of the dropped probabilities): the warp's values against the tile's dO.
        flash_product<true>(v_frag, grads, mine);
        __syncwarp();
#pragma unroll
        for (int k = 0; k < 32; ++k) {
            const int c = half * 32 + k;
            const float ds = p[k] * (s_row[k] * flash_keep(d, kept, k) - tile_delta[c]);
            p_row[k] = __float2bfloat16(scale * ds);
        }
        __syncwarp();
        // dK += dSᵀ · Q.
        flash_accumulate(dk, mine_bf, queries);
        __syncthreads();
    }
    flash_store_rows(dk, mine, grad_qkv, stride, hidden + h * FLASH_HEAD, places,
                     k0 + warp * 16, seq, tokens);
    flash_store_rows(dv, mine, grad_qkv, stride, 2 * hidden + h * FLASH_HEAD, places,
                     k0 + warp * 16, seq, tokens);
}

// The queries' gradient: grid (query tiles, heads, batch); each warp's 16 queries summed over
// every key tile, written to the query columns of `grad_qkv`.
extern "C" __global__ void __launch_bounds__(FLASH_THREADS)
    flash_attention_backward_q_bf16(const bf16* qkv, const bf16* grad, const float* lse,
                                    const float* delta, bf16* grad_qkv,
                                    const uint32_t* scatter, int tokens, int batch, int heads,
                                    int seq, float scale, Dropout d) {
    __shared__ __align__(32) bf16 keys[FLASH_TILE * FLASH_LD];
    __shared__ __align__(32) bf16 values[FLASH_TILE * FLASH_LD];
    __shared__ __align__(32) float scratch[FLASH_WARPS][16 * FLASH_LDF];
    __shared__ __align__(32) bf16 part[FLASH_WARPS][16 * FLASH_LD];
    __shared__ int key_valid[FLASH_TILE];
    const int q0 = blockIdx.x * FLASH_TILE, h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 1, half = lane & 1;
    const int hidden = heads * FLASH_HEAD;
    const size_t stride = 3 * (size_t)hidden;
    const uint32_t* places = scatter + (size_t)b * seq;
    const int end = flash_row_end(places, seq, tokens);
    if (q0 >= end) return;  // padding queries only: no gradient to write

    // The warp's queries and their dO into registers, through the shared tiles.
    flash_load_tile(keys, qkv, stride, h * FLASH_HEAD, places, q0, seq, tokens, nullptr);
    flash_load_tile(values, grad, hidden, h * FLASH_HEAD, places, q0, seq, tokens, nullptr);
    __syncthreads();
    FragA q_frag[4], g_frag[4];
    flash_fragments(q_frag, keys, warp);
    flash_fragments(g_frag, values, warp);
    __syncthreads();

    const int i = q0 + warp * 16 + r;
    const bool query = i < seq && places[i] < (uint32_t)tokens;
    const size_t at = ((size_t)b * heads + h) * seq + i;
    const float q_lse = query ? lse[at] : 0.0f, q_delta = query ? delta[at] : 0.0f;
    const uint64_t line = d.on ? line_key(line_key(row_key(d, b), h), i) : 0;
    float* mine = scratch[warp];
    bf16* mine_bf = part[warp];
    const float* s_row = mine + r * FLASH_LDF + half * 32;
    bf16* p_row = mine_bf + r * FLASH_LD + half * 32;
    FragC dq[4];
#pragma unroll
    for (int n = 0; n < 4; ++n) wmma::fill_fragment(dq[n], 0.0f);

    for (int k0 = 0; k0 < end; k0 += FLASH_TILE) {
        flash_load_tile(keys, qkv, stride, hidden + h * FLASH_HEAD, places, k0, seq, tokens,
                        key_valid);
        flash_load_tile(values, qkv, stride, 2 * hidden + h * FLASH_HEAD, places, k0, seq,
                        tokens, nullptr);
        __syncthreads();
        flash_product<true>(q_frag, keys, mine);
        __syncwarp();
        float p[32];
        uint32_t kept = 0;
#pragma unroll
        for (int k = 0; k < 32; ++k) {
            const int c = half * 32 + k;
            p[k] = flash_probability(s_row[k] * scale, q_lse, query && key_valid[c], d, line,
                                     k0 + c, k, kept);
        }
        __syncwarp();
        // dP (of the dropped probabilities): the warp's dO against the tile's values.
        flash_product<true>(g_frag, values, mine);
        __syncwarp();
#pragma unroll
        for (int k = 0; k < 32; ++k) {
            const float ds = p[k] * (s_row[k] * flash_keep(d, kept, k) - q_delta);
            p_row[k] = __float2bfloat16(scale * ds);
        }
        __syncwarp();
        // dQ += dS · K.
        flash_accumulate(dq, mine_bf, keys);
        __syncthreads();
    }
    flash_store_rows(dq, mine, grad_qkv, stride, h * FLASH_HEAD, places, q0 + warp * 16, seq,
                     tokens);
}

#endif
