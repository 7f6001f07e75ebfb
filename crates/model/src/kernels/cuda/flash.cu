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
        if (t < (uint32_t)tokens) {
            value = *(const uint4*)(src + (size_t)t * stride + col + part * 8);
        }
        *(uint4*)(tile + row * FLASH_LD + part * 8) = value;
        if (valid && part == 0) valid[row] = t < (uint32_t)tokens;
    }
}

// A thread's rows of a tile from `first` in the batched and asynchronous loads (the rows and
// 16-byte parts `flash_load_tile`'s loop gives it: rows `row0 + j · ROWS`, `j < PER`, part
// `part` of each) and their tokens (`tokens` for padding), read once for all of the tile pair.
// `Rows` rows by `Threads` threads (a tile by a block of four warps, unless said).
template <int Rows = FLASH_TILE, int Threads = FLASH_THREADS>
struct FlashRowsOf {
    static constexpr int PER = Rows * 8 / Threads, ROWS = Threads / 8;
    static_assert(Rows * 8 % Threads == 0, "whole loads a thread");
    int part, row0;
    uint32_t token[PER];

    __device__ __forceinline__ FlashRowsOf(const uint32_t* places, int first, int seq,
                                           int tokens)
        : part(threadIdx.x & 7), row0(threadIdx.x >> 3) {
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = first + row0 + j * ROWS;
            token[j] = i < seq ? places[i] : (uint32_t)tokens;
        }
    }

    __device__ __forceinline__ int row(int j) const { return row0 + j * ROWS; }

    // Which of the rows are tokens, into `valid` (64 flags; nothing where null).
    __device__ __forceinline__ void mark(int* valid, int tokens) const {
        if (valid && part == 0) {
#pragma unroll
            for (int j = 0; j < PER; ++j) valid[row(j)] = token[j] < (uint32_t)tokens;
        }
    }
};
typedef FlashRowsOf<> FlashThreadRows;

// `Tiles` tiles as `flash_load_tile` loads each, from the same rows of their own matrices, for
// the kernels with their loads batched (`BERTKIT_CUDA_FLASH_LOADS=batched`): each thread reads
// its rows' tokens once for all the tiles, then issues every one of its 16-byte loads before
// storing any (4 a tile at 128 threads), where `flash_load_tile`'s loop waits for each load
// (and the token it follows) before the next. The same rows and parts as `flash_load_tile`'s
// threads, the same values in shared memory; `valid` (or null) as there, for the rows.
template <int Tiles>
__device__ __forceinline__ void flash_load_tiles_batched(bf16* const (&tile)[Tiles],
                                                         const bf16* const (&src)[Tiles],
                                                         const size_t (&stride)[Tiles],
                                                         const int (&col)[Tiles],
                                                         const uint32_t* places, int first,
                                                         int seq, int tokens, int* valid) {
    const FlashThreadRows r(places, first, seq, tokens);
    uint4 value[Tiles][FlashThreadRows::PER];
#pragma unroll
    for (int a = 0; a < Tiles; ++a)
#pragma unroll
        for (int j = 0; j < FlashThreadRows::PER; ++j) {
            value[a][j] = make_uint4(0, 0, 0, 0);
            if (r.token[j] < (uint32_t)tokens) {
                value[a][j] =
                    *(const uint4*)(src[a] + (size_t)r.token[j] * stride[a] + col[a] + r.part * 8);
            }
        }
#pragma unroll
    for (int a = 0; a < Tiles; ++a)
#pragma unroll
        for (int j = 0; j < FlashThreadRows::PER; ++j)
            *(uint4*)(tile[a] + r.row(j) * FLASH_LD + r.part * 8) = value[a][j];
    r.mark(valid, tokens);
}

// One tile, `flash_load_tile`'s way or batched (`Batched`).
template <bool Batched>
__device__ __forceinline__ void flash_load_one(bf16* tile, const bf16* src, size_t stride,
                                               int col, const uint32_t* places, int first,
                                               int seq, int tokens, int* valid) {
    if (Batched) {
        flash_load_tiles_batched<1>({tile}, {src}, {stride}, {col}, places, first, seq, tokens,
                                    valid);
    } else {
        flash_load_tile(tile, src, stride, col, places, first, seq, tokens, valid);
    }
}

// Two tiles of the same rows (`valid` for the first's), one after the other or batched.
template <bool Batched>
__device__ __forceinline__ void flash_load_two(bf16* a, const bf16* src_a, size_t stride_a,
                                               int col_a, bf16* b, const bf16* src_b,
                                               size_t stride_b, int col_b,
                                               const uint32_t* places, int first, int seq,
                                               int tokens, int* valid) {
    if (Batched) {
        flash_load_tiles_batched<2>({a, b}, {src_a, src_b}, {stride_a, stride_b}, {col_a, col_b},
                                    places, first, seq, tokens, valid);
    } else {
        flash_load_tile(a, src_a, stride_a, col_a, places, first, seq, tokens, valid);
        flash_load_tile(b, src_b, stride_b, col_b, places, first, seq, tokens, nullptr);
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

// A lane's 32 values (`from[k] · scale`) as bf16 at `to`: one 2-byte store each, or (`Vec`,
// `to` 16-byte aligned, as every row's head of 64 is) four 16-byte stores, so that a warp's
// store touches a quarter of the cache sectors (each lane writes its own row).
template <bool Vec, typename Values>
__device__ __forceinline__ void flash_store_32(bf16* to, const Values& from, float scale) {
    if (Vec) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            bf16 pack[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) pack[k] = __float2bfloat16(from[q * 8 + k] * scale);
            uint4 v;
            memcpy(&v, pack, sizeof v);
            reinterpret_cast<uint4*>(to)[q] = v;
        }
    } else {
#pragma unroll
        for (int k = 0; k < 32; ++k) to[k] = __float2bfloat16(from[k] * scale);
    }
}

// The warp's `[16, 64]` accumulators written to 64 columns from `col` of the tokens' rows
// (`[tokens, stride]`), row `first + r` the padded place; through the warp's f32 scratch.
template <bool Vec>
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
        flash_store_32<Vec>(dst + (size_t)t * stride + col + half * 32, from, 1.0f);
    }
    __syncwarp();
}

// One past the last token place of a row (0 for a row of padding only), from its places, for
// the whole block: the tiles past it hold no token, as queries or as keys, and are skipped
// (a batch is as long as its longest row; the others end sooner).
template <int Warps = FLASH_WARPS>
__device__ int flash_row_end(const uint32_t* places, int seq, int tokens) {
    __shared__ int ends[Warps];
    int end = 0;
    for (int i = threadIdx.x; i < seq; i += blockDim.x) {
        if (places[i] < (uint32_t)tokens) end = i + 1;
    }
    for (int o = 16; o > 0; o >>= 1) end = max(end, __shfl_xor_sync(0xffffffffu, end, o));
    if ((threadIdx.x & 31) == 0) ends[threadIdx.x >> 5] = end;
    __syncthreads();
    end = 0;
    for (int w = 0; w < Warps; ++w) end = max(end, ends[w]);
    return end;
}

// Where a block works: the first place of its tile (`first`: of queries, or of keys), its head
// and row, the warp, the lane's row of the warp's 16 (`r`) and half of that row (`half`), the
// row's places and where its tokens end.
struct FlashBlock {
    int first, h, b, warp, r, half, hidden, end;
    size_t stride;  // of `qkv`'s rows: 3 · hidden
    const uint32_t* places;

    // The column of this head's part (0: queries, 1: keys, 2: values) in `qkv`.
    __device__ int column(int part) const { return part * hidden + h * FLASH_HEAD; }
};

// (`Warps` warps a block, each 16 of its rows: a tile's 64 by four, unless said.)
template <int Warps = FLASH_WARPS>
__device__ FlashBlock flash_block(const uint32_t* scatter, int tokens, int heads, int seq) {
    FlashBlock k;
    k.first = blockIdx.x * 16 * Warps;
    k.h = blockIdx.y;
    k.b = blockIdx.z;
    k.warp = threadIdx.x >> 5;
    k.r = (threadIdx.x & 31) >> 1;
    k.half = threadIdx.x & 1;
    k.hidden = heads * FLASH_HEAD;
    k.stride = 3 * (size_t)k.hidden;
    k.places = scatter + (size_t)k.b * seq;
    k.end = flash_row_end<Warps>(k.places, seq, tokens);
    return k;
}

// The warp's 16 rows of the block's tile of a `[tokens, stride]` matrix (64 columns from `col`)
// into fragments, through the shared `tile`; the whole block.
__device__ void flash_stage(FragA (&f)[4], bf16* tile, const bf16* src, size_t stride, int col,
                            const FlashBlock& k, int seq, int tokens) {
    flash_load_tile(tile, src, stride, col, k.places, k.first, seq, tokens, nullptr);
    __syncthreads();
    flash_fragments(f, tile, k.warp);
    __syncthreads();
}

// The row's keys and values of the tile from `k0` into `keys` and `values` (and which are
// tokens into `key_valid`); the whole block, synchronised after. `Batched`: their loads
// batched (`flash_load_tiles_batched`).
template <bool Batched = false>
__device__ void flash_load_keys_values(bf16* keys, bf16* values, int* key_valid, const bf16* qkv,
                                       const FlashBlock& k, int k0, int seq, int tokens) {
    flash_load_two<Batched>(keys, qkv, k.stride, k.column(1), values, qkv, k.stride, k.column(2),
                            k.places, k0, seq, tokens, key_valid);
    __syncthreads();
}

// Whether the forward's query tile holds padding only (no context to write), its places'
// log-sum-exp (`head_lse`, the head's `[seq]`) then set to 0, which the backward reads for a
// whole tile.
// (`Rows` queries a block: a tile's, unless said.)
template <int Rows = FLASH_TILE>
__device__ bool flash_padding_tile(const FlashBlock& k, float* head_lse, int seq) {
    if (k.first < k.end) return false;
    for (int i = k.first + threadIdx.x; i < min(k.first + Rows, seq); i += blockDim.x) {
        head_lse[i] = 0.0f;
    }
    return true;
}

// The forward: grid (query tiles, heads, batch). Writes the context `[tokens, hidden]` and each
// query's log-sum-exp of its scaled scores (`lse`, `[batch, heads, seq]`).
template <bool Vec>
__device__ __forceinline__ void flash_forward(const bf16* qkv, bf16* context, float* lse,
                                              const uint32_t* scatter, int tokens, int batch,
                                              int heads, int seq, float scale, Dropout d) {
    __shared__ __align__(32) bf16 keys[FLASH_TILE * FLASH_LD];
    __shared__ __align__(32) bf16 values[FLASH_TILE * FLASH_LD];
    __shared__ __align__(32) float scratch[FLASH_WARPS][16 * FLASH_LDF];
    __shared__ __align__(32) bf16 probs[FLASH_WARPS][16 * FLASH_LD];
    __shared__ int key_valid[FLASH_TILE];
    const FlashBlock k = flash_block(scatter, tokens, heads, seq);
    const size_t rows = ((size_t)k.b * heads + k.h) * seq;
    if (flash_padding_tile(k, lse + rows, seq)) return;
    FragA q[4];
    flash_stage(q, keys, qkv, k.stride, k.column(0), k, seq, tokens);

    const int i = k.first + k.warp * 16 + k.r;
    const bool query = i < seq && k.places[i] < (uint32_t)tokens;
    const uint64_t line = d.on ? line_key(line_key(row_key(d, k.b), k.h), i) : 0;
    float* mine = scratch[k.warp];
    const float* s_row = mine + k.r * FLASH_LDF + k.half * 32;
    bf16* p_row = probs[k.warp] + k.r * FLASH_LD + k.half * 32;
    float o[32];
#pragma unroll
    for (int c = 0; c < 32; ++c) o[c] = 0.0f;
    float m = -INFINITY, l = 0.0f;

    for (int k0 = 0; k0 < k.end; k0 += FLASH_TILE) {
        flash_load_keys_values(keys, values, key_valid, qkv, k, k0, seq, tokens);
        flash_product<true>(q, keys, mine);
        __syncwarp();
        float s[32];
        float tile_max = -INFINITY;
#pragma unroll
        for (int c = 0; c < 32; ++c) {
            s[c] = key_valid[k.half * 32 + c] ? s_row[c] * scale : -INFINITY;
            tile_max = fmaxf(tile_max, s[c]);
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        const float m_new = fmaxf(m, tile_max);
        const float alpha = m == -INFINITY ? 0.0f : expf(m - m_new);
        float sum = 0.0f;
#pragma unroll
        for (int c = 0; c < 32; ++c) {
            const float p = s[c] == -INFINITY ? 0.0f : expf(s[c] - m_new);
            sum += p;
            const float kept = d.on ? p * keep_factor(d, line, k0 + k.half * 32 + c) : p;
            p_row[c] = __float2bfloat16(kept);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * alpha + sum;
        m = m_new;
        __syncwarp();
        FragC pv[4];
#pragma unroll
        for (int n = 0; n < 4; ++n) wmma::fill_fragment(pv[n], 0.0f);
        flash_accumulate(pv, probs[k.warp], values);
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            wmma::store_matrix_sync(mine + n * 16, pv[n], FLASH_LDF, wmma::mem_row_major);
        }
        __syncwarp();
#pragma unroll
        for (int c = 0; c < 32; ++c) o[c] = o[c] * alpha + s_row[c];
        // Every warp done with this tile's keys and values before the next overwrites them.
        __syncthreads();
    }
    if (query) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        flash_store_32<Vec>(context + (size_t)k.places[i] * k.hidden + k.column(0) + k.half * 32,
                            o, inv);
    }
    // Every place's, padding's 0 (the backward reads a whole tile's).
    if (k.half == 0 && i < seq) lse[rows + i] = query ? m + logf(l) : 0.0f;
}

// `Σ dO·O` over head `h`'s columns of token `t` (0 for padding, `t` = `tokens`), the whole
// warp's sum in every lane: two bytes of each a lane, then a five-step warp sum. The delta
// kernel's and the joint backward's (`fr_backward_joint`), so that both give the same bits.
__device__ __forceinline__ float flash_token_delta(const bf16* context, const bf16* grad,
                                                   uint32_t t, int tokens, int hidden, int h) {
    const int lane = threadIdx.x & 31;
    float s = 0.0f;
    if (t < (uint32_t)tokens) {
        const size_t at = (size_t)t * hidden + h * FLASH_HEAD;
        for (int e = lane; e < FLASH_HEAD; e += 32) {
            s += __bfloat162float(context[at + e]) * __bfloat162float(grad[at + e]);
        }
    }
    return warp_sum(s);
}

// `delta[b, h, i] = Σ dO·O` over the head's columns of query `i` (0 for padding): a warp a
// query, `[batch, heads, seq]` f32.
extern "C" __global__ void flash_attention_delta_bf16(const bf16* context, const bf16* grad,
                                                      float* delta, const uint32_t* scatter,
                                                      int tokens, int batch, int heads,
                                                      int seq) {
    const int hidden = heads * FLASH_HEAD, lane = threadIdx.x & 31;
    for_each_query(batch, heads, seq, [&](size_t q, int b, int h, int i) {
        const float s =
            flash_token_delta(context, grad, scatter[(size_t)b * seq + i], tokens, hidden, h);
        if (lane == 0) delta[q] = s;
    });
}

// The same delta 16 bytes a thread (`crate::kernels::set_cuda_flash_delta_vector`): eight
// threads a query's head, each one load of its 8 columns of the context and of the gradient,
// its 8 products summed in order, then the eight threads' sums by three shuffles; a warp the
// heads 4h..4h+3 of one token (512 bytes in a row of each), where the kernel above gives a
// head's 64 columns a warp, two bytes a lane, and a five-step warp sum (30 µs a BERT-large
// layer at phase 1 on an H200, ~1.1 TB/s). `delta` in the same `[batch, heads, seq]` order.
extern "C" __global__ void flash_attention_delta_vec_bf16(const bf16* context, const bf16* grad,
                                                          float* delta, const uint32_t* scatter,
                                                          int tokens, int batch, int heads,
                                                          int seq) {
    constexpr int PER = 8, THREADS = FLASH_HEAD / PER;
    const int hidden = heads * FLASH_HEAD, sub = threadIdx.x % THREADS;
    const size_t total = (size_t)batch * seq * heads * THREADS;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    // A warp's lanes run the loop together (its first index the same in each lane), so that
    // every shuffle has all 32.
    for (size_t warp = (size_t)blockIdx.x * blockDim.x + (threadIdx.x & ~31u); warp < total;
         warp += stride) {
        const size_t at_thread = warp + (threadIdx.x & 31);
        // Heads fastest: `(b · seq + i) · heads + h`, then the thread's 8 columns (32-bit
        // divisions: the launcher holds `total` under 2^32).
        const unsigned place_head = (unsigned)(at_thread / THREADS);
        const int h = (int)(place_head % (unsigned)heads);
        const unsigned place = place_head / (unsigned)heads;
        float s = 0.0f;
        if (at_thread < total) {
            const uint32_t t = scatter[place];
            if (t < (uint32_t)tokens) {
                const size_t at = (size_t)t * hidden + h * FLASH_HEAD + sub * PER;
                const uint4 c = *reinterpret_cast<const uint4*>(context + at);
                const uint4 g = *reinterpret_cast<const uint4*>(grad + at);
                bf16 cs[PER], gs[PER];
                memcpy(cs, &c, sizeof c);
                memcpy(gs, &g, sizeof g);
#pragma unroll
                for (int k = 0; k < PER; ++k) s += __bfloat162float(cs[k]) * __bfloat162float(gs[k]);
            }
        }
#pragma unroll
        for (int width = 1; width < THREADS; width <<= 1) s += __shfl_xor_sync(0xffffffffu, s, width);
        if (at_thread < total && sub == 0) {
            const unsigned b = place / (unsigned)seq, i = place % (unsigned)seq;
            delta[((size_t)b * heads + h) * seq + i] = s;
        }
    }
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

// What the keys' and values' backward reads of the query tile from `q0`: the queries and
// their output gradients (`[64][FLASH_LD]` each), which are tokens, and each query's
// log-sum-exp, delta and dropout line (`rows`: the head's first place in `lse` and `delta`);
// the whole block, synchronised after.
template <bool Batched = false>
__device__ void flash_load_query_tile(bf16* queries, bf16* grads, int* query_valid,
                                      float* tile_lse, float* tile_delta, uint64_t* tile_line,
                                      const bf16* qkv, const bf16* grad, const float* lse,
                                      const float* delta, const FlashBlock& k, int q0,
                                      size_t rows, int seq, int tokens, const Dropout& d,
                                      uint64_t head_key) {
    flash_load_two<Batched>(queries, qkv, k.stride, k.column(0), grads, grad, k.hidden,
                            k.column(0), k.places, q0, seq, tokens, query_valid);
    if (threadIdx.x < FLASH_TILE) {
        const int i = q0 + threadIdx.x;
        tile_lse[threadIdx.x] = i < seq ? lse[rows + i] : 0.0f;
        tile_delta[threadIdx.x] = i < seq ? delta[rows + i] : 0.0f;
        tile_line[threadIdx.x] = d.on ? line_key(head_key, i) : 0;
    }
    __syncthreads();
}

// The keys' and values' gradients: grid (key tiles, heads, batch); each warp's 16 keys summed
// over every query tile, written to the key and value columns of `grad_qkv` (`[tokens, 3 ·
// hidden]`).
template <bool Vec>
__device__ __forceinline__ void flash_backward_kv(const bf16* qkv, const bf16* grad,
                                                  const float* lse, const float* delta,
                                                  bf16* grad_qkv, const uint32_t* scatter,
                                                  int tokens, int batch, int heads, int seq,
                                                  float scale, Dropout d) {
    __shared__ __align__(32) bf16 queries[FLASH_TILE * FLASH_LD];
    __shared__ __align__(32) bf16 grads[FLASH_TILE * FLASH_LD];
    __shared__ __align__(32) float scratch[FLASH_WARPS][16 * FLASH_LDF];
    __shared__ __align__(32) bf16 part[FLASH_WARPS][16 * FLASH_LD];
    __shared__ float tile_lse[FLASH_TILE], tile_delta[FLASH_TILE];
    __shared__ uint64_t tile_line[FLASH_TILE];  // each query's dropout line, drawn once a tile
    __shared__ int query_valid[FLASH_TILE];
    const FlashBlock k = flash_block(scatter, tokens, heads, seq);
    if (k.first >= k.end) return;  // padding keys only: no gradient to write
    const size_t rows = ((size_t)k.b * heads + k.h) * seq;
    FragA k_frag[4], v_frag[4];
    flash_stage(k_frag, queries, qkv, k.stride, k.column(1), k, seq, tokens);
    flash_stage(v_frag, grads, qkv, k.stride, k.column(2), k, seq, tokens);

    const int j = k.first + k.warp * 16 + k.r;
    const bool key = j < seq && k.places[j] < (uint32_t)tokens;
    const uint64_t head_key = d.on ? line_key(row_key(d, k.b), k.h) : 0;
    float* mine = scratch[k.warp];
    const float* s_row = mine + k.r * FLASH_LDF + k.half * 32;
    bf16* p_row = part[k.warp] + k.r * FLASH_LD + k.half * 32;
    FragC dk[4], dv[4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        wmma::fill_fragment(dk[n], 0.0f);
        wmma::fill_fragment(dv[n], 0.0f);
    }

    for (int q0 = 0; q0 < k.end; q0 += FLASH_TILE) {
        flash_load_query_tile(queries, grads, query_valid, tile_lse, tile_delta, tile_line, qkv,
                              grad, lse, delta, k, q0, rows, seq, tokens, d, head_key);
        // Sᵀ: the warp's keys against the tile's queries.
        flash_product<true>(k_frag, queries, mine);
        __syncwarp();
        float p[32];
        uint32_t kept = 0;
#pragma unroll
        for (int c = 0; c < 32; ++c) {
            const int q = k.half * 32 + c;
            p[c] = flash_probability(s_row[c] * scale, tile_lse[q], key && query_valid[q], d,
                                     tile_line[q], j, c, kept);
            p_row[c] = __float2bfloat16(p[c] * flash_keep(d, kept, c));
        }
        __syncwarp();
        // dV += dropped Pᵀ · dO.
        flash_accumulate(dv, part[k.warp], grads);
        __syncwarp();
        // dPᵀ (of the dropped probabilities): the warp's values against the tile's dO.
        flash_product<true>(v_frag, grads, mine);
        __syncwarp();
#pragma unroll
        for (int c = 0; c < 32; ++c) {
            const float dp = s_row[c] * flash_keep(d, kept, c);
            const float ds = p[c] * (dp - tile_delta[k.half * 32 + c]);
            p_row[c] = __float2bfloat16(scale * ds);
        }
        __syncwarp();
        // dK += dSᵀ · Q.
        flash_accumulate(dk, part[k.warp], queries);
        __syncthreads();
    }
    const int first = k.first + k.warp * 16;
    flash_store_rows<Vec>(dk, mine, grad_qkv, k.stride, k.column(1), k.places, first, seq,
                          tokens);
    flash_store_rows<Vec>(dv, mine, grad_qkv, k.stride, k.column(2), k.places, first, seq,
                          tokens);
}

// The queries' gradient: grid (query tiles, heads, batch); each warp's 16 queries summed over
// every key tile, written to the query columns of `grad_qkv`.
template <bool Vec>
__device__ __forceinline__ void flash_backward_q(const bf16* qkv, const bf16* grad,
                                                 const float* lse, const float* delta,
                                                 bf16* grad_qkv, const uint32_t* scatter,
                                                 int tokens, int batch, int heads, int seq,
                                                 float scale, Dropout d) {
    __shared__ __align__(32) bf16 keys[FLASH_TILE * FLASH_LD];
    __shared__ __align__(32) bf16 values[FLASH_TILE * FLASH_LD];
    __shared__ __align__(32) float scratch[FLASH_WARPS][16 * FLASH_LDF];
    __shared__ __align__(32) bf16 part[FLASH_WARPS][16 * FLASH_LD];
    __shared__ int key_valid[FLASH_TILE];
    const FlashBlock k = flash_block(scatter, tokens, heads, seq);
    if (k.first >= k.end) return;  // padding queries only: no gradient to write
    FragA q_frag[4], g_frag[4];
    flash_stage(q_frag, keys, qkv, k.stride, k.column(0), k, seq, tokens);
    flash_stage(g_frag, values, grad, k.hidden, k.column(0), k, seq, tokens);

    const int i = k.first + k.warp * 16 + k.r;
    const bool query = i < seq && k.places[i] < (uint32_t)tokens;
    const size_t at = ((size_t)k.b * heads + k.h) * seq + i;
    const float q_lse = query ? lse[at] : 0.0f, q_delta = query ? delta[at] : 0.0f;
    const uint64_t line = d.on ? line_key(line_key(row_key(d, k.b), k.h), i) : 0;
    float* mine = scratch[k.warp];
    const float* s_row = mine + k.r * FLASH_LDF + k.half * 32;
    bf16* p_row = part[k.warp] + k.r * FLASH_LD + k.half * 32;
    FragC dq[4];
#pragma unroll
    for (int n = 0; n < 4; ++n) wmma::fill_fragment(dq[n], 0.0f);

    for (int k0 = 0; k0 < k.end; k0 += FLASH_TILE) {
        flash_load_keys_values(keys, values, key_valid, qkv, k, k0, seq, tokens);
        flash_product<true>(q_frag, keys, mine);
        __syncwarp();
        float p[32];
        uint32_t kept = 0;
#pragma unroll
        for (int c = 0; c < 32; ++c) {
            const int col = k.half * 32 + c;
            p[c] = flash_probability(s_row[c] * scale, q_lse, query && key_valid[col], d, line,
                                     k0 + col, c, kept);
        }
        __syncwarp();
        // dP (of the dropped probabilities): the warp's dO against the tile's values.
        flash_product<true>(g_frag, values, mine);
        __syncwarp();
#pragma unroll
        for (int c = 0; c < 32; ++c) {
            const float ds = p[c] * (s_row[c] * flash_keep(d, kept, c) - q_delta);
            p_row[c] = __float2bfloat16(scale * ds);
        }
        __syncwarp();
        // dQ += dS · K.
        flash_accumulate(dq, part[k.warp], keys);
        __syncthreads();
    }
    flash_store_rows<Vec>(dq, mine, grad_qkv, k.stride, k.column(0), k.places,
                          k.first + k.warp * 16, seq, tokens);
}

// The entry points: each body with its results stored two bytes at a time, and (`_vec`) 16
// bytes at a time (`crate::kernels::set_cuda_flash_vector_stores`).
#define FLASH_FORWARD_ARGS                                                                      \
    const bf16 *qkv, bf16 *context, float *lse, const uint32_t *scatter, int tokens, int batch, \
        int heads, int seq, float scale, Dropout d
#define FLASH_BACKWARD_ARGS                                                                     \
    const bf16 *qkv, const bf16 *grad, const float *lse, const float *delta, bf16 *grad_qkv,    \
        const uint32_t *scatter, int tokens, int batch, int heads, int seq, float scale,        \
        Dropout d
// `NAME_bf16` and `NAME_vec_bf16`, running `BODY<false>` and `BODY<true>` on the arguments
// `ARGS` declares (passed on as `...`).
#define FLASH_ENTRIES(NAME, BODY, ARGS, ...)                                                    \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS) NAME##_bf16(ARGS) {             \
        BODY<false>(__VA_ARGS__);                                                               \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS) NAME##_vec_bf16(ARGS) {         \
        BODY<true>(__VA_ARGS__);                                                                \
    }
FLASH_ENTRIES(flash_attention_forward, flash_forward, FLASH_FORWARD_ARGS, qkv, context, lse,
              scatter, tokens, batch, heads, seq, scale, d)
FLASH_ENTRIES(flash_attention_backward_kv, flash_backward_kv, FLASH_BACKWARD_ARGS, qkv, grad, lse,
              delta, grad_qkv, scatter, tokens, batch, heads, seq, scale, d)
FLASH_ENTRIES(flash_attention_backward_q, flash_backward_q, FLASH_BACKWARD_ARGS, qkv, grad, lse,
              delta, grad_qkv, scatter, tokens, batch, heads, seq, scale, d)

#endif
