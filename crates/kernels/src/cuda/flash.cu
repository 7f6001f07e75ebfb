// Attention in one pass over key tiles, bf16 on tensor cores (`flash.rs`): what the kernels of
// `flash_registers.cu` share, and the delta of their backward. Included by `kernels.cu`;
// `bench/gpu/emulate` also compiles it on the CPU against a reference.
//
// The same attention as `attention_softmax_*` and cuBLAS's products around them (each query's
// softmax over its row's token keys, scaled, the probabilities dropped as the CPU draws them),
// computed without the `[batch, heads, seq, seq]` scores: a block holds the queries of one head
// of one row, walks the row's keys 64 at a time, and keeps each query's running maximum and sum
// (the softmax rescaled as larger scores arrive). The queries, keys and values are read straight
// from the tokens' `[tokens, 3 · hidden]` (no padded copy) and the context is written to the
// tokens' `[tokens, hidden]`.
//
// The backward recomputes the probabilities from each query's log-sum-exp (kept by the
// forward, `[batch, heads, seq]` f32) and `delta = Σ dO·O` per query. No atomics: each gradient
// is summed by one block in a fixed order, so a run repeats its bits.
//
// Heads of 64 only, rows up to `MAX_SEQ` (the softmax of the dispatching code), bf16 in and
// out, f32 sums.

#include "common.cuh"

#define FLASH_HEAD 64
#define FLASH_TILE 64
#define FLASH_WARPS 4
#define FLASH_THREADS (32 * FLASH_WARPS)
// The row stride of the shared tiles: bf16 rows padded by 8 (16 bytes), so that rows start on
// different banks.
#define FLASH_LD 72

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

// A thread's rows of a tile from `first` in the loads and asynchronous copies (rows
// `row0 + j · ROWS`, `j < PER`, 16-byte part `part` of each) and their tokens (`tokens` for
// padding), read once for all the tiles of those rows.
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

// `Tiles` tiles from the same rows `first..first + 64` of their own `[tokens, stride]` bf16
// matrices (64 columns from `col`, padded row `i`'s token `places[i]`) into shared tiles
// (`[64][FLASH_LD]`), zeros where the row is padding or past `seq`: each thread reads its rows'
// tokens once for all the tiles, then issues every one of its 16-byte loads before storing any
// (4 a tile at 128 threads), so that they are in flight together. `valid` (64 flags, or null)
// gets whether each row is a token. The whole block.
template <int Tiles>
__device__ __forceinline__ void flash_load_tiles(bf16* const (&tile)[Tiles],
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

// Two tiles of the same rows (`valid` for the first's).
__device__ __forceinline__ void flash_load_two(bf16* a, const bf16* src_a, size_t stride_a,
                                               int col_a, bf16* b, const bf16* src_b,
                                               size_t stride_b, int col_b,
                                               const uint32_t* places, int first, int seq,
                                               int tokens, int* valid) {
    flash_load_tiles<2>({a, b}, {src_a, src_b}, {stride_a, stride_b}, {col_a, col_b}, places,
                        first, seq, tokens, valid);
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

// The row's keys and values of the tile from `k0` into `keys` and `values` (and which are
// tokens into `key_valid`); the whole block, synchronised after.
__device__ void flash_load_keys_values(bf16* keys, bf16* values, int* key_valid, const bf16* qkv,
                                       const FlashBlock& k, int k0, int seq, int tokens) {
    flash_load_two(keys, qkv, k.stride, k.column(1), values, qkv, k.stride, k.column(2), k.places,
                   k0, seq, tokens, key_valid);
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

// What the keys' and values' backward reads of the query tile from `q0`: the queries and
// their output gradients (`[64][FLASH_LD]` each), which are tokens, and each query's
// log-sum-exp, delta and dropout line (`rows`: the head's first place in `lse` and `delta`);
// the whole block, synchronised after.
__device__ void flash_load_query_tile(bf16* queries, bf16* grads, int* query_valid,
                                      float* tile_lse, float* tile_delta, uint64_t* tile_line,
                                      const bf16* qkv, const bf16* grad, const float* lse,
                                      const float* delta, const FlashBlock& k, int q0,
                                      size_t rows, int seq, int tokens, const Dropout& d,
                                      uint64_t head_key) {
    flash_load_two(queries, qkv, k.stride, k.column(0), grads, grad, k.hidden, k.column(0),
                   k.places, q0, seq, tokens, query_valid);
    if (threadIdx.x < FLASH_TILE) {
        const int i = q0 + threadIdx.x;
        tile_lse[threadIdx.x] = i < seq ? lse[rows + i] : 0.0f;
        tile_delta[threadIdx.x] = i < seq ? delta[rows + i] : 0.0f;
        tile_line[threadIdx.x] = d.on ? line_key(head_key, i) : 0;
    }
    __syncthreads();
}

// `Σ dO·O` over head `h`'s columns of token `t` (0 for padding, `t` = `tokens`), the whole
// warp's sum in every lane: two bytes of each a lane, then a five-step warp sum (the joint
// backward's, `fr_backward_joint`, a warp a query).
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

// `delta[b, h, i] = Σ dO·O` over the head's columns of query `i` (0 for padding), `[batch,
// heads, seq]` f32, for the two backwards: eight threads a query's head, each one 16-byte load
// of its 8 columns of the context and of the gradient, its 8 products summed in order, then
// the eight threads' sums by three shuffles; a warp the heads 4h..4h+3 of one token (512 bytes
// in a row of each), where a warp a head would read two bytes a lane.
extern "C" __global__ void flash_delta_bf16(const bf16* context, const bf16* grad,
                                            float* delta, const uint32_t* scatter, int tokens,
                                            int batch, int heads, int seq) {
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

// The kernels' arguments.
#define FLASH_FORWARD_ARGS                                                                      \
    const bf16 *qkv, bf16 *context, float *lse, const uint32_t *scatter, int tokens, int batch, \
        int heads, int seq, float scale, Dropout d
#define FLASH_BACKWARD_ARGS                                                                     \
    const bf16 *qkv, const bf16 *grad, const float *lse, const float *delta, bf16 *grad_qkv,    \
        const uint32_t *scatter, int tokens, int batch, int heads, int seq, float scale,        \
        Dropout d

#endif
