// The one-pass attention's kernels (`flash.rs`): included by `kernels.cu` after `flash.cu`,
// whose tiles, grid and arguments they share; `bench/gpu/emulate` compiles them on the CPU
// against a reference.
//
// The products are `mma.sync` tiles of known layout (`tensor_core.cuh`): a product's f32
// results stay in the registers that computed them, the softmax and the backward's element-wise
// steps work on them there, and they go back into the next product as its left operand, packed
// to bf16, with no round trip through shared memory for every 16x16 tile. The right operands
// come from the shared tiles through `ldmatrix`, transposed where the product reads a tile by
// columns; the tiles' rows are 144 bytes apart, so a matrix's eight rows fall on different
// banks. The results go through shared memory once at the end, to be written 16 bytes a lane,
// a row's 128 bytes by eight neighbouring lanes.
//
// A warp owns 16 rows of its block's (queries in the forward and the queries' backward, keys
// in the keys' and values' backward); a lane holds its rows g and g+8 (`g = lane / 4`) at two
// columns of every 8 (`2t`, `2t+1`, `t = lane % 4`), so a row's sums and maxima are over the
// four lanes of a quad.

#include "tensor_core.cuh"

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

// The A fragment of rows `row0..row0 + 16`, columns `col0..col0 + 16` of a shared tile
// (`[64][FLASH_LD]`).
__device__ __forceinline__ void fr_load_a(uint32_t (&a)[4], const bf16* tile, int row0, int col0) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4(a, tile + (row0 + (lane & 15)) * FLASH_LD + col0 + (lane >> 4) * 8);
}

// The B fragments of two 8-column tiles of the product `· tileᵀ` (the tile read by rows: B's
// column n is the tile's row n): tile rows `row0..row0 + 16`, tile columns (B's k)
// `col0..col0 + 16`. `b[0]`, `b[1]`: the first 8 rows; `b[2]`, `b[3]`: the next 8.
__device__ __forceinline__ void fr_load_bt(uint32_t (&b)[4], const bf16* tile, int row0, int col0) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4(b, tile + (row0 + (lane & 7) + ((lane >> 4) << 3)) * FLASH_LD + col0 +
                       ((lane >> 3) & 1) * 8);
}

// The B fragments of two 8-column tiles of the product `· tile` (the tile's rows are B's k):
// tile rows `row0..row0 + 16`, tile columns (B's n) `col0..col0 + 16`. `b[0]`, `b[1]`: columns
// `col0..col0 + 8`; `b[2]`, `b[3]`: the next 8.
__device__ __forceinline__ void fr_load_b(uint32_t (&b)[4], const bf16* tile, int row0, int col0) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4_trans(b, tile + (row0 + (lane & 15)) * FLASH_LD + col0 + (lane >> 4) * 8);
}

// `acc += a · tile[row0..row0 + 16, 0..64]`: the warp's `[16, 16]` left operand `a` times
// sixteen rows of `tile` read as `[k, n]`, into the `[16, 64]` result's eight 8-column
// accumulators.
__device__ __forceinline__ void fr_accumulate(float (&acc)[8][4], const uint32_t (&a)[4],
                                              const bf16* tile, int row0) {
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        uint32_t b[4];
        fr_load_b(b, tile, row0, n * 16);
        mma_bf16(acc[2 * n], a, b[0], b[1]);
        mma_bf16(acc[2 * n + 1], a, b[2], b[3]);
    }
}

// `s = a · tileᵀ` for the warp's 16 rows against the tile's 64 rows (each 64 columns): `a` the
// warp's rows as four 16-column fragments.
__device__ __forceinline__ void fr_scores(float (&s)[8][4], const uint32_t (&a)[4][4],
                                          const bf16* tile) {
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            uint32_t b[4];
            fr_load_bt(b, tile, n * 16, c * 16);
            mma_bf16(s[2 * n], a[c], b[0], b[1]);
            mma_bf16(s[2 * n + 1], a[c], b[2], b[3]);
        }
}

// The A fragment of columns `16c..16c + 16` of a `[16, 64]` f32 result held as eight 8-column
// accumulators, each element times `f(n, e)` (its tile and place), packed to bf16.
template <typename F>
__device__ __forceinline__ void fr_to_a(uint32_t (&a)[4], const float (&x)[8][4], int c, F f) {
    a[0] = pack_bf16(x[2 * c][0] * f(2 * c, 0), x[2 * c][1] * f(2 * c, 1));
    a[1] = pack_bf16(x[2 * c][2] * f(2 * c, 2), x[2 * c][3] * f(2 * c, 3));
    a[2] = pack_bf16(x[2 * c + 1][0] * f(2 * c + 1, 0), x[2 * c + 1][1] * f(2 * c + 1, 1));
    a[3] = pack_bf16(x[2 * c + 1][2] * f(2 * c + 1, 2), x[2 * c + 1][3] * f(2 * c + 1, 3));
}

// The A fragment of two 8-column accumulators (`x[0]` the first 8 columns), each element times
// `f(half, e)` (its accumulator and place): `fr_to_a`'s fragment of a chunk held on its own.
template <typename F>
__device__ __forceinline__ void fr_pair_to_a(uint32_t (&a)[4], const float (&x)[2][4], F f) {
    a[0] = pack_bf16(x[0][0] * f(0, 0), x[0][1] * f(0, 1));
    a[1] = pack_bf16(x[0][2] * f(0, 2), x[0][3] * f(0, 3));
    a[2] = pack_bf16(x[1][0] * f(1, 0), x[1][1] * f(1, 1));
    a[3] = pack_bf16(x[1][2] * f(1, 2), x[1][3] * f(1, 3));
}

// The same, every element times `scale`.
__device__ __forceinline__ void fr_pair_to_a(uint32_t (&a)[4], const float (&x)[2][4],
                                             float scale) {
    fr_pair_to_a(a, x, [scale](int, int) { return scale; });
}

// The warp's `[16, 64]` accumulators, row r times `scale[r / 8]`, to 64 columns from `col` of
// the tokens' rows (`[tokens, stride]`): staged as bf16 in the warp's 16 rows of a shared tile
// (`stage`, rows `16 · warp` on, no longer read by any other warp), then 16 bytes a lane. Row
// `first + r` is the padded place; padding is not written.
__device__ __forceinline__ void fr_store_rows(const float (&acc)[8][4], const float (&scale)[2],
                                              bf16* stage, bf16* dst, size_t stride, int col,
                                              const uint32_t* places, int first, int seq,
                                              int tokens) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    bf16* rows = stage + (threadIdx.x >> 5) * 16 * FLASH_LD;
    __syncwarp();
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            *reinterpret_cast<uint32_t*>(rows + (g + 8 * h) * FLASH_LD + n * 8 + 2 * t) =
                pack_bf16(acc[n][2 * h] * scale[h], acc[n][2 * h + 1] * scale[h]);
        }
    __syncwarp();
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const int v = lane + 32 * q, r = v >> 3, part = v & 7;
        const int i = first + r;
        const uint32_t tok = i < seq ? places[i] : (uint32_t)tokens;
        if (tok < (uint32_t)tokens) {
            *reinterpret_cast<uint4*>(dst + (size_t)tok * stride + col + part * 8) =
                *reinterpret_cast<const uint4*>(rows + r * FLASH_LD + part * 8);
        }
    }
    __syncwarp();
}

// The element-wise code is straight-line: the dropout fixed at compile time (`Drops`: an entry
// point with it and one without, the launcher choosing by the mask's `on`) and each exponential
// taken of a selected argument (`ex2` of -inf is 0), where a test at every element
// (`live ? exp(x) : 0`) compiles to a branch around each exponential that the scheduler can
// neither interleave nor overlap with the products. Each exponential is one `ex2.approx` of one
// fused multiply-add, `2^(score · scale · log2 e - m · log2 e)`, the scale folded in, its
// relative error ~2^-22, far below bf16's 2^-8 that P is rounded to for its product; the
// log-sum-exp stays in natural units. Where it drops, the forward writes each lane's keep bits
// of a tile (the `kept` word the backwards build, one `uint32_t` a lane a key tile:
// `fr_bits_at`) and the backwards read them rather than draw every keep from the keys again
// (a splitmix64 a probability): the same masks, so the same bits.

#define FR_LOG2E 1.4426950408889634f

// `2^x` by the special function unit (`ex2.approx.ftz`: 0 at -inf); exact `exp2f` elsewhere
// (the CPU emulation).
__device__ __forceinline__ float fr_exp2(float x) {
#if defined(__CUDA_ARCH__)
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2f(x);
#endif
}

// `exp(score · scale - *lse)` where `live`, else 0 (`lse` read with no test around it).
__device__ __forceinline__ float fr_probability(bool live, float score, float scale,
                                                const float* lse) {
    const float x = fmaf(score, scale * FR_LOG2E, -*lse * FR_LOG2E);
    return fr_exp2(live ? x : -INFINITY);
}

// The first of the keep words of query tile `qt` against key tile 0 (where it drops): a block's
// words for a pair of tiles are one a thread (its warp's 16 queries, the lane's two rows at
// its columns, bit `4n + e` its element `(n, e)`), the pairs of a row and head in order of
// query tile, then key tile (`tiles` of each), a head's after its row's.
__device__ __forceinline__ size_t fr_bits_at(int b, int h, int heads, int tiles, int qt) {
    return (((size_t)b * heads + h) * tiles + qt) * tiles * FLASH_THREADS;
}

// The keys' and values' backward's `kept` (bit `4n + e`: key `16 · warp + g + 8 · (e / 2)`,
// query `8n + 2t + e % 2` of the tiles) from the forward's words of the tile pair (`words`, a
// thread's each: the forward's warps own queries). Query `8n + 2t + el` is row `g' = 2t + el`,
// half `n % 2` of the forward's warp `n / 2`; key `k` its element `(n', e')` with
// `n' = k / 8 = 2 · warp + e / 2` and lane `4g' + (k % 8) / 2 = 4g' + g / 2`, `e' % 2 = g % 2`:
// each of a lane's 32 bits is in one of 8 words (warp `n / 2`, `el`), four to a word at bits
// `8 · warp + g % 2 + {0, 2, 4, 6}` (`n % 2` at 2, `e / 2` at 4), which go to bits
// `8 · (n / 2) + el + {0, 4, 2, 6}`.
__device__ __forceinline__ uint32_t fr_kept_transposed(const uint32_t* words, int warp, int g,
                                                       int t) {
    const int shift = 8 * warp + (g & 1);
    uint32_t kept = 0;
#pragma unroll
    for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int el = 0; el < 2; ++el) {
            uint32_t x = (words[w * 32 + (2 * t + el) * 4 + (g >> 1)] >> shift) & 0x55u;
            x = (x & 0x41u) | ((x & 0x04u) << 2) | ((x & 0x10u) >> 2);
            kept |= x << (8 * w + el);
        }
    return kept;
}

// The dropout's factor of bit `bit` of `kept`: the kept elements' scale, or 0 (1 without it).
template <bool Drops>
__device__ __forceinline__ float fr_keep(const Dropout& d, uint32_t kept, int bit) {
    if constexpr (!Drops) return 1.0f;
    return (kept >> bit) & 1u ? d.scale : 0.0f;
}

// One key tile of the forward for the warp's 16 queries (`q`, as A fragments): the scores
// against `keys`, the running maxima `m` and sums `l` of this lane's two rows updated, `o`
// rescaled and `dropped P · values` added (`line`: the rows' dropout lines; `k0`: the tile's
// first key). Returns the lane's keep bits of the tile where it drops (else 0).
template <bool Drops>
__device__ __forceinline__ uint32_t fr_forward_tile(const uint32_t (&q)[4][4], const bf16* keys,
                                                const bf16* values, const int* key_valid, int k0,
                                                float scale, const Dropout& d,
                                                const uint64_t (&line)[2], float (&m)[2],
                                                float (&l)[2], float (&o)[8][4]) {
    const int t = threadIdx.x & 3;
    float s[8][4];
    fr_scores(s, q, keys);
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = n * 8 + 2 * t + (e & 1);
            // (The scale is folded into the exponential: the raw score here, whose maximum
            // is the scaled scores' over the scale, which is positive.)
            s[n][e] = key_valid[j] ? s[n][e] : -INFINITY;
            tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
        }
    float alpha[2], m_live[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
        tile_max[h] *= scale;
        const float m_new = fmaxf(m[h], tile_max[h]);
        alpha[h] = m[h] == -INFINITY ? 0.0f : fr_exp2((m[h] - m_new) * FR_LOG2E);
        m[h] = m_new;
        l[h] *= alpha[h];
        // (A row with no key yet has every score at -inf: 0 keeps `s - m` at -inf, not NaN.)
        m_live[h] = m_new == -INFINITY ? 0.0f : m_new;
    }
    const float scale_log2 = scale * FR_LOG2E;
    const float shift[2] = {-m_live[0] * FR_LOG2E, -m_live[1] * FR_LOG2E};
    // The probabilities (unnormalised) in place of the scores; the row sums before dropout.
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float p = fr_exp2(fmaf(s[n][e], scale_log2, shift[e >> 1]));
            l[e >> 1] += p;
            s[n][e] = p;
        }
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e >> 1];
    uint32_t kept = 0;  // where it drops: bit 4n + e, element (n, e) kept
    // o += dropped P · V, P's 16-key chunks as left operands.
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        uint32_t a[4];
        fr_to_a(a, s, c, [&](int n, int e) {
            const float keep =
                Drops ? keep_factor(d, line[e >> 1], k0 + n * 8 + 2 * t + (e & 1)) : 1.0f;
            if constexpr (Drops) kept |= (uint32_t)(keep != 0.0f) << (4 * n + e);
            return keep;
        });
        fr_accumulate(o, a, values, c * 16);
    }
    return kept;
}

// A lane's part of the forward: its two query rows (g, g + 8 of the warp's 16: place, whether
// a token, dropout line), their running maxima and sums, and its share of their context.
struct FrForwardRows {
    int i[2];
    bool query[2];
    uint64_t line[2];
    float m[2], l[2];
    float o[8][4];

    __device__ __forceinline__ FrForwardRows(const FlashBlock& k, int seq, int tokens,
                                             const Dropout& d) {
        const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            i[h] = k.first + k.warp * 16 + g + 8 * h;
            query[h] = i[h] < seq && k.places[i[h]] < (uint32_t)tokens;
            line[h] = d.on ? line_key(line_key(row_key(d, k.b), k.h), i[h]) : 0;
            m[h] = -INFINITY;
            l[h] = 0.0f;
        }
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;
    }

    // After the last key tile: the context, normalised, to the tokens' rows (staged in
    // `stage`), and every place's log-sum-exp (padding's 0: the backward reads a whole tile's).
    __device__ __forceinline__ void finish(bf16* stage, bf16* context, float* lse, size_t rows,
                                           const FlashBlock& k, int seq, int tokens) {
        float inv[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
            inv[h] = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        }
        fr_store_rows(o, inv, stage, context, k.hidden, k.column(0), k.places,
                      k.first + k.warp * 16, seq, tokens);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if ((threadIdx.x & 3) == 0 && i[h] < seq) {
                lse[rows + i[h]] = query[h] ? m[h] + logf(l[h]) : 0.0f;
            }
        }
    }
};

// Tiles of `qkv`'s rows `first..first + 64` (columns `col[a]` on), placed as
// `flash_load_tiles` places them, by asynchronous copies (`cp_async_16`): each thread
// reads its rows' tokens, then issues its copies and goes on; `valid` (or null) gets which
// rows are tokens. The caller closes the group and waits for it.
template <int Tiles, int Rows = FLASH_TILE, int Threads = FLASH_THREADS>
__device__ __forceinline__ void fr_copy_tiles(bf16* const (&tile)[Tiles], const bf16* qkv,
                                              size_t stride, const int (&col)[Tiles],
                                              const uint32_t* places, int first, int seq,
                                              int tokens, int* valid) {
    const FlashRowsOf<Rows, Threads> r(places, first, seq, tokens);
#pragma unroll
    for (int a = 0; a < Tiles; ++a)
#pragma unroll
        for (int j = 0; j < FlashRowsOf<Rows, Threads>::PER; ++j) {
            const bool ok = r.token[j] < (uint32_t)tokens;
            // (Where the row is padding nothing is read: a source size of 0.)
            const bf16* from = qkv + (ok ? (size_t)r.token[j] * stride + col[a] + r.part * 8 : 0);
            cp_async_16(tile[a] + r.row(j) * FLASH_LD + r.part * 8, from, ok);
        }
    r.mark(valid, tokens);
}

// The forward: grid (pairs of query tiles, heads, batch), eight warps, 128 queries. Each key
// and value tile is copied once for both query tiles (half the loads a query that a block a
// tile would make), by asynchronous copies into two buffers: the second is the queries' tile,
// free once each warp has its queries' fragments in registers (the queries, 18 KB, and two
// buffers of keys and values would not fit a block's 48 KB of static shared memory).
#define FR_PAIR_WARPS 8
#define FR_PAIR_THREADS (32 * FR_PAIR_WARPS)
#define FR_PAIR_ROWS (16 * FR_PAIR_WARPS)
template <bool Drops>
__device__ __forceinline__ void fr_forward_pair(FLASH_FORWARD_ARGS,
                                                uint32_t* keep_bits = nullptr) {
    static_assert(FR_PAIR_ROWS == 2 * FLASH_TILE, "the second buffer is the queries' tile");
    __shared__ __align__(16) bf16 queries[FR_PAIR_ROWS * FLASH_LD];
    __shared__ __align__(16) bf16 tiles[2 * FLASH_TILE * FLASH_LD];
    __shared__ int key_valid[2][FLASH_TILE];
    // Buffer 0: `tiles` (keys, then values); buffer 1: the queries' tile, once read. (Chosen
    // by a select: an array of the pointers indexed by the buffer would live in local memory.)
    const auto keys = [&](int buffer) { return buffer ? queries : tiles; };
    const auto values = [&](int buffer) { return keys(buffer) + FLASH_TILE * FLASH_LD; };
    const FlashBlock k = flash_block<FR_PAIR_WARPS>(scatter, tokens, heads, seq);
    const size_t rows = ((size_t)k.b * heads + k.h) * seq;
    if (flash_padding_tile<FR_PAIR_ROWS>(k, lse + rows, seq)) return;
    const int key_tiles = (k.end + FLASH_TILE - 1) / FLASH_TILE;
    // The queries and key tile 0, one group.
    fr_copy_tiles<1, FR_PAIR_ROWS, FR_PAIR_THREADS>({queries}, qkv, k.stride, {k.column(0)},
                                                    k.places, k.first, seq, tokens, nullptr);
    fr_copy_tiles<2, FLASH_TILE, FR_PAIR_THREADS>({keys(0), values(0)}, qkv, k.stride,
                                                  {k.column(1), k.column(2)}, k.places, 0, seq,
                                                  tokens, key_valid[0]);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    uint32_t q[4][4];
#pragma unroll
    for (int c = 0; c < 4; ++c) fr_load_a(q[c], queries, k.warp * 16, c * 16);
    // Every warp has its queries: their tile is the second buffer from here.
    __syncthreads();
    FrForwardRows r(k, seq, tokens, d);
    // The warp's keep words (where it drops), where its query tile is one of the row's: the second
    // of a pair may lie past the last.
    uint32_t* words = nullptr;
    if constexpr (Drops) {
        const int tiles = (seq + FLASH_TILE - 1) / FLASH_TILE;
        const int query_tile = (k.first + k.warp * 16) / FLASH_TILE;
        if (query_tile < tiles) {
            words = keep_bits + fr_bits_at(k.b, k.h, heads, tiles, query_tile) +
                    threadIdx.x % FLASH_THREADS;
        }
    }
    for (int tile = 0; tile < key_tiles; ++tile) {
        const int buffer = tile & 1;
        // The next tile's copies, into the buffer the last iteration finished with.
        if (tile + 1 < key_tiles) {
            fr_copy_tiles<2, FLASH_TILE, FR_PAIR_THREADS>(
                {keys(buffer ^ 1), values(buffer ^ 1)}, qkv, k.stride,
                {k.column(1), k.column(2)}, k.places, (tile + 1) * FLASH_TILE, seq, tokens,
                key_valid[buffer ^ 1]);
        }
        cp_async_commit();
        const uint32_t kept = fr_forward_tile<Drops>(q, keys(buffer), values(buffer),
                                                 key_valid[buffer], tile * FLASH_TILE, scale, d,
                                                 r.line, r.m, r.l, r.o);
        if constexpr (Drops) {
            if (words) words[tile * FLASH_THREADS] = kept;
        }
        // This buffer free for the tile after next, the next one landed for every warp.
        cp_async_wait<0>();
        __syncthreads();
    }
    // The queries' tile stages the results (every warp past the loop's last barrier).
    r.finish(queries, context, lse, rows, k, seq, tokens);
}

// The lane's two keys of a warp's 16 from place `first` (rows `g` and `g + 8`): their places
// `j` and whether each is a token (`key`); and the warp's gradients of its keys and values
// (`dk`, `dv`: the 16 keys by the head's 64 columns) zeroed.
__device__ __forceinline__ void fr_warp_keys(int (&j)[2], bool (&key)[2], float (&dk)[8][4],
                                             float (&dv)[8][4], const uint32_t* places, int first,
                                             int seq, int tokens) {
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        j[h] = first + g + 8 * h;
        key[h] = j[h] < seq && places[j[h]] < (uint32_t)tokens;
    }
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;
}

// The keys' and values' backward's steps for the warp's 16 keys (rows `row0..row0 + 16` of the
// shared `keys` and `values`; `key`, `j`: whether each of the lane's two is a token, and its
// place) against a tile of 64 queries and their output gradients (`queries`, `grads`, with
// each query's `query_valid`, `tile_lse`, `tile_delta` and dropout `tile_line`). Pᵀ's 8-query
// accumulator `x` (columns `8n..8n + 8` of the tile): the probabilities in place of the scores.
__device__ __forceinline__ void fr_kv_probabilities(float (&x)[4], int n, const bool (&key)[2],
                                                    const int* query_valid, const float* tile_lse,
                                                    float scale) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int qi = n * 8 + 2 * t + (e & 1);
        // (`&`, not `&&`: `query_valid` read with no test.)
        const bool live = key[e >> 1] & (query_valid[qi] != 0);
        x[e] = fr_probability(live, x[e], scale, &tile_lse[qi]);
    }
}

// `acc += rows · tile[16c..16c + 16]ᵀ` over the 64 columns of both (16 at a time in order):
// the warp's 16 rows of `rows` (from `row0`) against a chunk of 16 rows of `tile`.
__device__ __forceinline__ void fr_chunk_product(float (&acc)[2][4], const bf16* rows, int row0,
                                                 const bf16* tile, int c) {
#pragma unroll
    for (int e16 = 0; e16 < 4; ++e16) {
        uint32_t a[4], b[4];
        fr_load_a(a, rows, row0, e16 * 16);
        fr_load_bt(b, tile, c * 16, e16 * 16);
        mma_bf16(acc[0], a, b[0], b[1]);
        mma_bf16(acc[1], a, b[2], b[3]);
    }
}

// Chunk `c` (16 queries) of dSᵀ = Pᵀ ⊙ (dPᵀ ⊙ kept − delta), its probabilities `p0`, `p1` (the
// chunk's two 8-query accumulators), as dK's bf16 left operand `a` times the scale; dPᵀ (of the
// dropped probabilities) = V · dOᵀ computed here.
template <bool Drops>
__device__ __forceinline__ void fr_kv_ds(uint32_t (&a)[4], const float (&p0)[4],
                                         const float (&p1)[4], int c, const bf16* values,
                                         int row0, const bf16* grads, const float* tile_delta,
                                         uint32_t kept, float scale, const Dropout& d) {
    const int t = threadIdx.x & 3;
    float dp[2][4] = {};
    fr_chunk_product(dp, values, row0, grads, c);
    float ds[2][4];
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int n = 2 * c + half, qi = n * 8 + 2 * t + (e & 1);
            const float p = half ? p1[e] : p0[e];
            ds[half][e] = p * (dp[half][e] * fr_keep<Drops>(d, kept, 4 * n + e) - tile_delta[qi]);
        }
    fr_pair_to_a(a, ds, scale);
}

// One query tile of the keys' and values' backward for the warp's 16 keys (see above; where it
// drops, the forward's keep words of the tile pair, `tile_bits`, the warp's quarter
// `bits_warp`): `dv` and `dk` summed on. The keys' and values' kernel's whole work a tile.
template <bool Drops>
__device__ __forceinline__ void fr_kv_query_tile(const bf16* keys, const bf16* values, int row0,
                                                 const bf16* queries, const bf16* grads,
                                                 const int* query_valid, const float* tile_lse,
                                                 const float* tile_delta,
                                                 const uint64_t* tile_line,
                                                 const uint32_t* tile_bits, int bits_warp,
                                                 const bool (&key)[2], const int (&j)[2],
                                                 float scale, const Dropout& d,
                                                 float (&dk)[8][4], float (&dv)[8][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // Pᵀ: the warp's keys against the tile's queries, then the probabilities in place.
    float p[8][4];
    {
        uint32_t kf[4][4];
#pragma unroll
        for (int c = 0; c < 4; ++c) fr_load_a(kf[c], keys, row0, c * 16);
        fr_scores(p, kf, queries);
    }
    uint32_t kept = 0;  // bit 4n + e: element (n, e) kept by the dropout
    if constexpr (Drops) kept = fr_kept_transposed(tile_bits, bits_warp, g, t);
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        fr_kv_probabilities(p[n], n, key, query_valid, tile_lse, scale);
    }
    const auto keep = [&](int n, int e) { return fr_keep<Drops>(d, kept, 4 * n + e); };
    // dV += dropped Pᵀ · dO, Pᵀ's 16-query chunks as left operands.
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        uint32_t a[4];
        fr_to_a(a, p, c, keep);
        fr_accumulate(dv, a, grads, c * 16);
    }
    // A chunk of 16 queries at a time: dSᵀ, then dK += dSᵀ · Q.
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        uint32_t a[4];
        fr_kv_ds<Drops>(a, p[2 * c], p[2 * c + 1], c, values, row0, grads, tile_delta, kept, scale, d);
        fr_accumulate(dk, a, queries, c * 16);
    }
}

// The same tile's work a chunk of 16 queries at a time from the scores on, for a kernel that
// makes the queries' gradient from dSᵀ too (`fr_backward_joint`): `each_ds(c, a)` sees each
// chunk's dSᵀ fragment (dK's left operand). The same products in the same order into each
// accumulator, so the same `dk` and `dv`; a chunk's 8 probabilities live at a time, where the
// tile's form holds the tile's 32 (the joint kernel fits two blocks an SM by it). `Unroll`:
// the chunks' loop unrolled that many times (1: a loop), which decides what ptxas may schedule
// across chunks (below).
template <bool Drops, int Unroll = 4, typename EachDs>
__device__ __forceinline__ void fr_kv_query_chunks(
    const bf16* keys, const bf16* values, int row0, const bf16* queries, const bf16* grads,
    const int* query_valid, const float* tile_lse, const float* tile_delta,
    const uint64_t* tile_line, const uint32_t* tile_bits, int bits_warp, const bool (&key)[2],
    const int (&j)[2], float scale, const Dropout& d, float (&dk)[8][4], float (&dv)[8][4],
    EachDs each_ds) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    uint32_t kept = 0;  // bit 4n + e: element (n, e) kept by the dropout
    if constexpr (Drops) kept = fr_kept_transposed(tile_bits, bits_warp, g, t);
#pragma unroll Unroll
    for (int c = 0; c < 4; ++c) {
        // Pᵀ's chunk: the warp's keys against its 16 queries (`fr_scores`' sums for them).
        float p[2][4] = {};
        fr_chunk_product(p, keys, row0, queries, c);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            fr_kv_probabilities(p[half], 2 * c + half, key, query_valid, tile_lse, scale);
        }
        // dV += dropped Pᵀ · dO (`fr_to_a`'s fragment of the chunk).
        uint32_t a[4];
        fr_pair_to_a(a, p, [&](int half, int e) {
            return fr_keep<Drops>(d, kept, 4 * (2 * c + half) + e);
        });
        fr_accumulate(dv, a, grads, c * 16);
        fr_kv_ds<Drops>(a, p[0], p[1], c, values, row0, grads, tile_delta, kept, scale, d);
        fr_accumulate(dk, a, queries, c * 16);
        each_ds(c, a);
    }
}

// The keys' and values' gradients: grid (key tiles, heads, batch); the warp's 16 keys summed
// over every query tile, as `flash_backward_kv`'s. Held to 168 registers a lane, three blocks
// an SM (nvcc's choice, 182, allows two): ptxas spills 36 bytes a lane for it (sm_90).
template <bool Drops>
__device__ __forceinline__ void fr_backward_kv(FLASH_BACKWARD_ARGS,
                                               const uint32_t* keep_bits = nullptr) {
    __shared__ __align__(16) bf16 keys[FLASH_TILE * FLASH_LD];
    __shared__ __align__(16) bf16 values[FLASH_TILE * FLASH_LD];
    __shared__ __align__(16) bf16 queries[FLASH_TILE * FLASH_LD];
    __shared__ __align__(16) bf16 grads[FLASH_TILE * FLASH_LD];
    __shared__ float tile_lse[FLASH_TILE], tile_delta[FLASH_TILE];
    __shared__ uint64_t tile_line[FLASH_TILE];  // each query's dropout line, drawn once a tile
    __shared__ int query_valid[FLASH_TILE];
    const FlashBlock k = flash_block(scatter, tokens, heads, seq);
    if (k.first >= k.end) return;  // padding keys only: no gradient to write
    const int g = (threadIdx.x & 31) >> 2;
    const size_t rows = ((size_t)k.b * heads + k.h) * seq;
    // (Where it drops: the forward's keep words of the query tile against this key tile.)
    __shared__ uint32_t tile_bits[Drops ? FLASH_THREADS : 1];
    const uint32_t* words = nullptr;
    if constexpr (Drops) {
        const int tiles = (seq + FLASH_TILE - 1) / FLASH_TILE;
        words = keep_bits + fr_bits_at(k.b, k.h, heads, tiles, 0) +
                (size_t)(k.first / FLASH_TILE) * FLASH_THREADS + threadIdx.x;
    }
    flash_load_two(keys, qkv, k.stride, k.column(1), values, qkv, k.stride, k.column(2), k.places,
                   k.first, seq, tokens, nullptr);
    // These two tiles stay for the whole block (the loop's first barrier covers their loads);
    // the warp's key and value fragments are read from them where each product needs them, not
    // held in registers across the loop (32 registers a lane fewer).
    int j[2];
    bool key[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        j[h] = k.first + k.warp * 16 + g + 8 * h;
        key[h] = j[h] < seq && k.places[j[h]] < (uint32_t)tokens;
    }
    const uint64_t head_key = d.on ? line_key(row_key(d, k.b), k.h) : 0;
    float dk[8][4], dv[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;

    for (int q0 = 0; q0 < k.end; q0 += FLASH_TILE) {
        // (The barrier closing the last iteration keeps the last tile's words until read.)
        if constexpr (Drops) {
            tile_bits[threadIdx.x] =
                words[(size_t)(q0 / FLASH_TILE) * ((seq + FLASH_TILE - 1) / FLASH_TILE) *
                      FLASH_THREADS];
        }
        flash_load_query_tile(queries, grads, query_valid, tile_lse, tile_delta, tile_line, qkv,
                              grad, lse, delta, k, q0, rows, seq, tokens, d, head_key);
        fr_kv_query_tile<Drops>(keys, values, k.warp * 16, queries, grads, query_valid, tile_lse,
                            tile_delta, tile_line, tile_bits, k.warp, key, j, scale, d, dk, dv);
        __syncthreads();
    }
    const float one[2] = {1.0f, 1.0f};
    const int first = k.first + k.warp * 16;
    fr_store_rows(dk, one, queries, grad_qkv, k.stride, k.column(1), k.places, first, seq, tokens);
    fr_store_rows(dv, one, grads, grad_qkv, k.stride, k.column(2), k.places, first, seq, tokens);
}

// The queries' gradient: grid (query tiles, heads, batch); the warp's 16 queries summed over
// every key tile, as `flash_backward_q`'s.
template <bool Drops>
__device__ __forceinline__ void fr_backward_q(FLASH_BACKWARD_ARGS,
                                              const uint32_t* keep_bits = nullptr) {
    __shared__ __align__(16) bf16 queries[FLASH_TILE * FLASH_LD];
    __shared__ __align__(16) bf16 grads[FLASH_TILE * FLASH_LD];
    __shared__ __align__(16) bf16 keys[FLASH_TILE * FLASH_LD];
    __shared__ __align__(16) bf16 values[FLASH_TILE * FLASH_LD];
    __shared__ int key_valid[FLASH_TILE];
    const FlashBlock k = flash_block(scatter, tokens, heads, seq);
    if (k.first >= k.end) return;  // padding queries only: no gradient to write
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    flash_load_two(queries, qkv, k.stride, k.column(0), grads, grad, k.hidden, k.column(0),
                   k.places, k.first, seq, tokens, nullptr);
    __syncthreads();
    uint32_t qf[4][4], gf[4][4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        fr_load_a(qf[c], queries, k.warp * 16, c * 16);
        fr_load_a(gf[c], grads, k.warp * 16, c * 16);
    }
    bool query[2];
    float q_lse[2], q_delta[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int i = k.first + k.warp * 16 + g + 8 * h;
        query[h] = i < seq && k.places[i] < (uint32_t)tokens;
        const size_t at = ((size_t)k.b * heads + k.h) * seq + i;
        q_lse[h] = query[h] ? lse[at] : 0.0f;
        q_delta[h] = query[h] ? delta[at] : 0.0f;
    }
    float dq[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq[n][e] = 0.0f;
    // (Where it drops: the lane's keep words, the forward's lane's: the same warps own the queries.)
    const uint32_t* words = nullptr;
    if constexpr (Drops) {
        words = keep_bits +
                fr_bits_at(k.b, k.h, heads, (seq + FLASH_TILE - 1) / FLASH_TILE,
                           k.first / FLASH_TILE) +
                threadIdx.x;
    }

    for (int k0 = 0; k0 < k.end; k0 += FLASH_TILE) {
        uint32_t kept = 0;
        if constexpr (Drops) kept = words[(k0 / FLASH_TILE) * FLASH_THREADS];
        flash_load_keys_values(keys, values, key_valid, qkv, k, k0, seq, tokens);
        float p[8][4];
        fr_scores(p, qf, keys);
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = n * 8 + 2 * t + (e & 1);
                const int h = e >> 1;
                const bool live = query[h] & (key_valid[col] != 0);
                p[n][e] = fr_probability(live, p[n][e], scale, &q_lse[h]);
            }
        // A chunk of 16 keys at a time: dP (of the dropped probabilities) = dO · Vᵀ,
        // dS = P ⊙ (dP ⊙ kept − delta), dQ += dS · K.
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float dp[2][4] = {};
#pragma unroll
            for (int e16 = 0; e16 < 4; ++e16) {
                uint32_t b[4];
                fr_load_bt(b, values, c * 16, e16 * 16);
                mma_bf16(dp[0], gf[e16], b[0], b[1]);
                mma_bf16(dp[1], gf[e16], b[2], b[3]);
            }
            float ds[2][4];
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int n = 2 * c + half;
                    ds[half][e] =
                        p[n][e] * (dp[half][e] * fr_keep<Drops>(d, kept, 4 * n + e) - q_delta[e >> 1]);
                }
            uint32_t a[4];
            fr_pair_to_a(a, ds, scale);
            fr_accumulate(dq, a, keys, c * 16);
        }
        __syncthreads();
    }
    const float one[2] = {1.0f, 1.0f};
    fr_store_rows(dq, one, queries, grad_qkv, k.stride, k.column(0), k.places,
                  k.first + k.warp * 16, seq, tokens);
}

// The A fragment of rows `col0..col0 + 16`, columns `row0..row0 + 16` of a matrix held
// transposed in a shared tile whose rows are `ld` elements apart (the tile's rows are the
// matrix's columns): `ldmatrix`'s transposed loads, its matrix `i` the tile's rows
// `row0 + 8 · (i / 2)` on, columns `col0 + 8 · (i % 2)` on (A's `a[i]`, see
// `tensor_core.cuh`).
__device__ __forceinline__ void fr_load_a_transposed(uint32_t (&a)[4], const bf16* tile, int ld,
                                                     int row0, int col0) {
    const int lane = threadIdx.x & 31, m = lane >> 3;
    ldmatrix_x4_trans(a, tile + (row0 + (m >> 1) * 8 + (lane & 7)) * ld + col0 + (m & 1) * 8);
}

// The joint backward (rows of at most 128 places): one
// block a row's head, eight warps, the three gradients and the delta in one launch, where the
// kernels above take three (the delta; the keys' and values' backward; the queries'). At phase
// 1's 128 places the two backwards each compute the row's P and dP (the queries' kernel again
// what the keys' kernel had), read the queries, keys, values and output gradients once per
// tile pair, and the delta kernel reads the context and the gradient once more. Here the whole
// row's queries, keys, values and gradients sit in shared memory once; each warp owns 16 keys
// and goes over both query tiles as the keys' and values' kernel does (`fr_kv_query_chunks`:
// the same products in the same order, the same dK and dV), writing dSᵀ's bf16 fragments (the
// left operand of dK's product, already times the scale) into a shared `[128 keys][136]` tile
// as they are made; after a barrier each warp owns 16 queries and sums dQ = dS · K from that
// tile (read transposed by `ldmatrix`) in the queries' kernel's order of keys: without
// computing P and dP again, and no atomics. The delta is computed by each warp for 16 queries
// (`flash_token_delta`) while the tiles' copies are in flight. Grid (1, heads, batch); `FrJointShared` of dynamic shared memory (an
// opt-in above 48 KB: `flash.rs` sets it); two blocks an SM on sm_90 (128 registers: at most
// 16 bytes spilled; 2 x 113 KB of the SM's 228 KB of shared memory).
// dSᵀ's row length in elements: the row's 128 queries and 8 more (rows 272 bytes apart: a
// warp's 4-byte stores and each `ldmatrix` matrix's eight rows on distinct banks).
#define FR_JOINT_LD (FR_PAIR_ROWS + 8)
struct FrJointShared {
    bf16 queries[FR_PAIR_ROWS * FLASH_LD];
    bf16 grads[FR_PAIR_ROWS * FLASH_LD];
    bf16 keys[FR_PAIR_ROWS * FLASH_LD];
    bf16 values[FR_PAIR_ROWS * FLASH_LD];
    bf16 ds[FR_PAIR_ROWS * FR_JOINT_LD];  // dSᵀ: a key a row
    uint64_t line[FR_PAIR_ROWS];  // each query's dropout line
    float lse[FR_PAIR_ROWS], delta[FR_PAIR_ROWS];
    int valid[FR_PAIR_ROWS];            // which places are tokens
    uint32_t bits[4 * FLASH_THREADS];   // where it drops: the forward's words of the four tile pairs
};
// (`flash.rs`'s `JOINT_SHARED_BYTES`, the launch's dynamic shared memory.)
static_assert(sizeof(FrJointShared) == 113152, "flash.rs launches the joint backward with it");

template <bool Drops>
__device__ __forceinline__ void fr_backward_joint(const bf16* qkv, const bf16* context,
                                                  const bf16* grad, const float* lse,
                                                  bf16* grad_qkv, const uint32_t* scatter,
                                                  int tokens, int batch, int heads, int seq,
                                                  float scale, Dropout d,
                                                  const uint32_t* keep_bits = nullptr) {
    DYNAMIC_SHARED(uint4, joint_shared);
    FrJointShared& s = *reinterpret_cast<FrJointShared*>(joint_shared);
    const FlashBlock k = flash_block<FR_PAIR_WARPS>(scatter, tokens, heads, seq);
    if (k.end == 0) return;  // a row of padding: no gradient to write
    const int g = (threadIdx.x & 31) >> 2;
    const size_t rows = ((size_t)k.b * heads + k.h) * seq;
    const int tiles = (k.end + FLASH_TILE - 1) / FLASH_TILE;  // those holding a token: 1 or 2
    // The row's keys and values and the first query tile's queries and output gradients, one
    // group of copies; the second tile's, another (empty where there is none), in flight while
    // the warps work on the first.
    fr_copy_tiles<2, FR_PAIR_ROWS, FR_PAIR_THREADS>({s.keys, s.values}, qkv, k.stride,
                                                    {k.column(1), k.column(2)}, k.places, 0, seq,
                                                    tokens, s.valid);
    for (int qt = 0; qt < 2; ++qt) {
        if (qt < tiles) {
            const int q0 = qt * FLASH_TILE;
            fr_copy_tiles<1, FLASH_TILE, FR_PAIR_THREADS>({s.queries + q0 * FLASH_LD}, qkv,
                                                          k.stride, {k.column(0)}, k.places, q0,
                                                          seq, tokens, nullptr);
            fr_copy_tiles<1, FLASH_TILE, FR_PAIR_THREADS>({s.grads + q0 * FLASH_LD}, grad,
                                                          k.hidden, {k.column(0)}, k.places, q0,
                                                          seq, tokens, nullptr);
        }
        cp_async_commit();
    }
    // While they land: each query's log-sum-exp and dropout line (as `flash_load_query_tile`
    // reads them), the keep words, and the delta, a warp's 16 queries.
    const uint64_t head_key = d.on ? line_key(row_key(d, k.b), k.h) : 0;
    if (threadIdx.x < FR_PAIR_ROWS) {
        const int i = threadIdx.x;
        s.lse[i] = i < seq ? lse[rows + i] : 0.0f;
        s.line[i] = d.on ? line_key(head_key, i) : 0;
    }
    if constexpr (Drops) {
        const int all = (seq + FLASH_TILE - 1) / FLASH_TILE;  // the words' layout's tiles
        for (int w = threadIdx.x; w < 4 * FLASH_THREADS; w += FR_PAIR_THREADS) {
            const int pair = w / FLASH_THREADS, qt = pair >> 1, kt = pair & 1;
            if (qt < tiles && kt < tiles) {
                s.bits[w] = keep_bits[fr_bits_at(k.b, k.h, heads, all, qt) +
                                      (size_t)kt * FLASH_THREADS + w % FLASH_THREADS];
            }
        }
    }
#pragma unroll 4
    for (int r = 0; r < 16; ++r) {
        const int i = k.warp * 16 + r;
        const uint32_t t = i < seq ? k.places[i] : (uint32_t)tokens;
        const float delta = flash_token_delta(context, grad, t, tokens, k.hidden, k.h);
        if ((threadIdx.x & 31) == 0) s.delta[i] = delta;
    }

    // The warp's 16 keys (those of a tile holding no token have nothing to compute: their
    // rows of dSᵀ are never read, their gradients are padding's).
    const bool live_keys = k.warp * 16 < tiles * FLASH_TILE;
    int j[2];
    bool key[2];
    float dk[8][4], dv[8][4];
    fr_warp_keys(j, key, dk, dv, k.places, k.warp * 16, seq, tokens);
    const int t = threadIdx.x & 3;
    for (int qt = 0; qt < tiles; ++qt) {
        // This tile's copies landed for every warp (and the first time, every place's values).
        if (qt == 0) {
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (live_keys) {
            const int q0 = qt * FLASH_TILE;
            bf16* ds = s.ds + (k.warp * 16 + g) * FR_JOINT_LD + q0 + 2 * t;
            fr_kv_query_chunks<Drops>(s.keys, s.values, k.warp * 16, s.queries + q0 * FLASH_LD,
                                s.grads + q0 * FLASH_LD, s.valid + q0, s.lse + q0, s.delta + q0,
                                s.line + q0, s.bits + (qt * 2 + (k.warp >> 2)) * FLASH_THREADS,
                                k.warp & 3, key, j, scale, d, dk, dv,
                                [&](int c, const uint32_t (&a)[4]) {
                                    // A's layout: rows g and g + 8, columns 2t and 8 + 2t.
                                    uint32_t* at = reinterpret_cast<uint32_t*>(ds + c * 16);
                                    at[0] = a[0];
                                    at[4] = a[2];
                                    at[8 * FR_JOINT_LD / 2] = a[1];
                                    at[8 * FR_JOINT_LD / 2 + 4] = a[3];
                                });
        }
    }
    // Every warp done with the queries, the gradients and the values; dSᵀ whole.
    __syncthreads();
    const float one[2] = {1.0f, 1.0f};
    if (live_keys) {
        // (Staged in the warp's own rows of the queries' and gradients' tiles.)
        fr_store_rows(dk, one, s.queries, grad_qkv, k.stride, k.column(1), k.places, k.warp * 16,
                      seq, tokens);
        fr_store_rows(dv, one, s.grads, grad_qkv, k.stride, k.column(2), k.places, k.warp * 16,
                      seq, tokens);
    }
    // dQ = dS · K for the warp's 16 queries, 16 keys at a time in order.
    if (k.warp * 16 < k.end) {
        float dq[8][4];
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dq[n][e] = 0.0f;
        for (int c = 0; c < 4 * tiles; ++c) {
            uint32_t a[4];
            fr_load_a_transposed(a, s.ds, FR_JOINT_LD, c * 16, k.warp * 16);
            fr_accumulate(dq, a, s.keys, c * 16);
        }
        fr_store_rows(dq, one, s.values, grad_qkv, k.stride, k.column(0), k.places, k.warp * 16,
                      seq, tokens);
    }
}

// The entry points `flash.rs` launches, each in two forms: `flash_NAME_bf16` without dropout,
// and `flash_NAME_bits_bf16` with it, taking the keep words last (`[batch, heads, tiles, tiles,
// 128]`, `fr_bits_at`): the forward writes every word of a pair of tiles it covers, the
// backwards read them. The forward: 256 threads, two blocks an SM by registers; the delta and
// two backwards: 128 threads, three blocks an SM; the joint backward: 256 threads and its
// dynamic shared memory (`FrJointShared`).
extern "C" __global__ void __launch_bounds__(FR_PAIR_THREADS, 2)
    flash_forward_bf16(FLASH_FORWARD_ARGS) {
    fr_forward_pair<false>(qkv, context, lse, scatter, tokens, batch, heads, seq, scale,
                                      d);
}
extern "C" __global__ void __launch_bounds__(FR_PAIR_THREADS, 2)
    flash_forward_bits_bf16(FLASH_FORWARD_ARGS, uint32_t* keep_bits) {
    fr_forward_pair<true>(qkv, context, lse, scatter, tokens, batch, heads, seq,
                                           scale, d, keep_bits);
}
#define FR_BACKWARD(NAME, BODY)                                                                   \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 3)                                \
        flash_##NAME##_bf16(FLASH_BACKWARD_ARGS) {                                                \
        BODY<false>(qkv, grad, lse, delta, grad_qkv, scatter, tokens, batch, heads,    \
                               seq, scale, d);                                                    \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 3)                                \
        flash_##NAME##_bits_bf16(FLASH_BACKWARD_ARGS, const uint32_t* keep_bits) {                \
        BODY<true>(qkv, grad, lse, delta, grad_qkv, scatter, tokens, batch,      \
                                    heads, seq, scale, d, keep_bits);                             \
    }
FR_BACKWARD(backward_kv, fr_backward_kv)
FR_BACKWARD(backward_q, fr_backward_q)

// The joint backward: the context in place of the delta.
#define FLASH_JOINT_ARGS                                                                          \
    const bf16 *qkv, const bf16 *context, const bf16 *grad, const float *lse, bf16 *grad_qkv,     \
        const uint32_t *scatter, int tokens, int batch, int heads, int seq, float scale, Dropout d
extern "C" __global__ void __launch_bounds__(FR_PAIR_THREADS, 2)
    flash_backward_joint_bf16(FLASH_JOINT_ARGS) {
    fr_backward_joint<false>(qkv, context, grad, lse, grad_qkv, scatter, tokens, batch,
                                        heads, seq, scale, d);
}
extern "C" __global__ void __launch_bounds__(FR_PAIR_THREADS, 2)
    flash_backward_joint_bits_bf16(FLASH_JOINT_ARGS, const uint32_t* keep_bits) {
    fr_backward_joint<true>(qkv, context, grad, lse, grad_qkv, scatter, tokens,
                                             batch, heads, seq, scale, d, keep_bits);
}

#endif
