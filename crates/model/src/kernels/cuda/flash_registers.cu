// The one-pass attention with its scores in registers (`BERTKIT_CUDA_FLASH=registers`,
// `flash.rs`): included by `kernels.cu` after `flash.cu`, whose tiles, grid and arguments it
// shares; `bench/gpu/emulate` compiles it on the CPU against a reference.
//
// The same attention as `flash.cu` (the same grid, the same inputs, outputs and dropout keys,
// each gradient summed by one block in a fixed order), but its products are `mma.sync` tiles of
// known layout (`tensor_core.cuh`) instead of `wmma`'s opaque ones: a product's f32 results
// stay in the registers that computed them, the softmax and the backward's element-wise steps
// work on them there, and they go back into the next product as its left operand, packed to
// bf16, without the round trip through shared memory that `flash.cu` makes for every 16x16
// tile (stored as f32, read back a lane a row). The right operands come from the shared tiles
// through `ldmatrix`, transposed where the product reads a tile by columns; the tiles' rows
// are 144 bytes apart, so a matrix's eight rows fall on different banks. The results go
// through shared memory once at the end, to be written 16 bytes a lane, a row's 128 bytes by
// eight neighbouring lanes.
//
// A warp owns 16 rows of its block's 64 (queries in the forward and the queries' backward, keys
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

// The registers kernels' element-wise code, in two forms. `FR_BRANCHING` (the forms in use):
// the dropout tested at run time at every element (`d.on`), and each probability computed
// behind a test (`live ? expf(x) : 0`), which nvcc compiles as a branch around each
// exponential (with its reconvergence marks: 32 small blocks of a dependent chain a tile, that
// the scheduler can neither interleave nor overlap with the products). `FR_PLAIN` and
// `FR_DROPOUT` (`BERTKIT_CUDA_FLASH_BRANCHES=none`): the dropout fixed at compile time (an entry
// point for each, the launcher choosing by the mask's `on`) and the exponential taken of a
// selected argument (`expf(-inf)` is 0): straight-line code, the same value at every element.
// `| FR_EXP2` (`BERTKIT_CUDA_FLASH_EXP=exp2`, with the straight forms): each exponential one
// `ex2.approx` of one fused multiply-add, `2^(score · scale · log2 e - m · log2 e)`, the scale
// folded in (FlashAttention's way), where `expf` takes ~8 instructions after the scale's own
// multiply; its relative error ~2^-22, far below bf16's 2^-8 that P is rounded to for its
// product. The log-sum-exp stays in natural units: the backward reads the same values.
// `| FR_BITS` (`BERTKIT_CUDA_FLASH_DROPOUT=bits`, with `FR_DROPOUT`): the forward writes each
// lane's keep bits of a tile (the `kept` word the backwards build, one `uint32_t` a lane a
// key tile: `fr_bits_at`) and the backwards read them, where each of the three kernels draws
// every keep from the keys (a splitmix64 a probability, ~23 instructions with its 64-bit
// multiplies: half of the backwards' key-tile loops). The same masks, so the same bits.
enum FrElements { FR_BRANCHING = 0, FR_PLAIN = 1, FR_DROPOUT = 2, FR_EXP2 = 4, FR_BITS = 8 };

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

template <int E>
__device__ __forceinline__ bool fr_dropping(const Dropout& d) {
    return E == FR_BRANCHING ? d.on != 0 : (E & FR_DROPOUT) != 0;
}

// `exp(score · scale - *lse)` where `live`, else 0 (the branching form reads `lse` and
// computes the argument only where live; the straight form always: no test around the read).
template <int E>
__device__ __forceinline__ float fr_probability(bool live, float score, float scale,
                                                const float* lse) {
    if (E == FR_BRANCHING) return live ? expf(score * scale - *lse) : 0.0f;
    if (E & FR_EXP2) {
        const float x = fmaf(score, scale * FR_LOG2E, -*lse * FR_LOG2E);
        return fr_exp2(live ? x : -INFINITY);
    }
    const float x = score * scale - *lse;
    return expf(live ? x : -INFINITY);
}

// Sets bit `bit` of `kept` where the dropout keeps element `j` of `line` (always without it).
// (The branching form's test is written out where it is used: through this function nvcc
// places its keys' arithmetic otherwise.)
template <int E>
__device__ __forceinline__ void fr_mark_kept(uint32_t& kept, const Dropout& d, uint64_t line,
                                             int j, int bit) {
    static_assert(E != FR_BRANCHING, "the branching form tests in place");
    kept |= (E & FR_DROPOUT) ? (uint32_t)(keep_factor(d, line, j) != 0.0f) << bit : 1u << bit;
}

// The first of the keep words of query tile `qt` against key tile 0 (`FR_BITS`): a block's
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

// The dropout's factor of bit `bit` of `kept` (`flash_keep`'s).
template <int E>
__device__ __forceinline__ float fr_keep(const Dropout& d, uint32_t kept, int bit) {
    if (E == FR_BRANCHING) return flash_keep(d, kept, bit);
    if (!(E & FR_DROPOUT)) return 1.0f;
    return (kept >> bit) & 1u ? d.scale : 0.0f;
}

// One key tile of the forward for the warp's 16 queries (`q`, as A fragments): the scores
// against `keys`, the running maxima `m` and sums `l` of this lane's two rows updated, `o`
// rescaled and `dropped P · values` added (`line`: the rows' dropout lines; `k0`: the tile's
// first key). Returns the lane's keep bits of the tile with `FR_BITS` (else 0).
template <int E>
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
            // (With `FR_EXP2` the scale is folded into the exponential: the raw score here,
            // whose maximum is the scaled scores' over the scale, which is positive.)
            if (E & FR_EXP2) {
                s[n][e] = key_valid[j] ? s[n][e] : -INFINITY;
            } else {
                s[n][e] = key_valid[j] ? s[n][e] * scale : -INFINITY;
            }
            tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
        }
    float alpha[2], m_live[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
        if (E & FR_EXP2) tile_max[h] *= scale;
        const float m_new = fmaxf(m[h], tile_max[h]);
        alpha[h] = m[h] == -INFINITY ? 0.0f
                   : (E & FR_EXP2) ? fr_exp2((m[h] - m_new) * FR_LOG2E)
                                   : expf(m[h] - m_new);
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
            const float p = E == FR_BRANCHING
                                ? (s[n][e] == -INFINITY ? 0.0f : expf(s[n][e] - m[e >> 1]))
                            : (E & FR_EXP2) ? fr_exp2(fmaf(s[n][e], scale_log2, shift[e >> 1]))
                                            : expf(s[n][e] - m_live[e >> 1]);
            l[e >> 1] += p;
            s[n][e] = p;
        }
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e >> 1];
    uint32_t kept = 0;  // with `FR_BITS`: bit 4n + e, element (n, e) kept
    // o += dropped P · V, P's 16-key chunks as left operands.
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        uint32_t a[4];
        fr_to_a(a, s, c, [&](int n, int e) {
            const float keep =
                fr_dropping<E>(d) ? keep_factor(d, line[e >> 1], k0 + n * 8 + 2 * t + (e & 1))
                                  : 1.0f;
            if constexpr ((E & FR_BITS) != 0) kept |= (uint32_t)(keep != 0.0f) << (4 * n + e);
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

// The forward: grid (query tiles, heads, batch), as `flash_forward`'s. `Batched`: the tiles'
// loads batched (`flash_load_tiles_batched`, `BERTKIT_CUDA_FLASH_LOADS=batched`); `E`: the
// element-wise code's form (`FrElements`); the entry points are at the end.
template <bool Batched, int E = FR_BRANCHING>
__device__ __forceinline__ void fr_forward(FLASH_FORWARD_ARGS, uint32_t* keep_bits = nullptr) {
    __shared__ __align__(16) bf16 queries[FLASH_TILE * FLASH_LD];
    __shared__ __align__(16) bf16 keys[FLASH_TILE * FLASH_LD];
    __shared__ __align__(16) bf16 values[FLASH_TILE * FLASH_LD];
    __shared__ int key_valid[FLASH_TILE];
    const FlashBlock k = flash_block(scatter, tokens, heads, seq);
    const size_t rows = ((size_t)k.b * heads + k.h) * seq;
    if (flash_padding_tile(k, lse + rows, seq)) return;
    flash_load_one<Batched>(queries, qkv, k.stride, k.column(0), k.places, k.first, seq, tokens,
                            nullptr);
    __syncthreads();
    uint32_t q[4][4];
#pragma unroll
    for (int c = 0; c < 4; ++c) fr_load_a(q[c], queries, k.warp * 16, c * 16);
    FrForwardRows r(k, seq, tokens, d);
    uint32_t* words = nullptr;  // the block's keep words (`FR_BITS`)
    if constexpr ((E & FR_BITS) != 0) {
        const int tiles = (seq + FLASH_TILE - 1) / FLASH_TILE;
        words = keep_bits + fr_bits_at(k.b, k.h, heads, tiles, k.first / FLASH_TILE);
    }
    for (int k0 = 0; k0 < k.end; k0 += FLASH_TILE) {
        flash_load_keys_values<Batched>(keys, values, key_valid, qkv, k, k0, seq, tokens);
        const uint32_t kept = fr_forward_tile<E>(q, keys, values, key_valid, k0, scale, d,
                                                 r.line, r.m, r.l, r.o);
        if constexpr ((E & FR_BITS) != 0) {
            words[(k0 / FLASH_TILE) * FLASH_THREADS + threadIdx.x] = kept;
        }
        // Every warp done with this tile's keys and values before the next overwrites them.
        __syncthreads();
    }
    r.finish(queries, context, lse, rows, k, seq, tokens);
}

// Tiles of `qkv`'s rows `first..first + 64` (columns `col[a]` on), placed as
// `flash_load_tiles_batched` places them, by asynchronous copies (`cp_async_16`): each thread
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

// The forward with its tiles copied asynchronously (`BERTKIT_CUDA_FLASH_COPIES=async`): two
// buffers of keys and values, the next tile's copies in flight while the warps work on this
// one's; the queries and the first two key tiles copied at once at the start. The forms above
// load a tile, wait for it at a barrier, work on it, and only then load the next: one trip to
// memory a tile with nothing else to do (at phase 1's two key tiles a row, three such trips a
// block, counting the queries'). The same grid, arguments, arithmetic and results (the same
// tiles in shared memory, in the same order).
template <int E = FR_BRANCHING>
__device__ __forceinline__ void fr_forward_async(FLASH_FORWARD_ARGS,
                                                 uint32_t* keep_bits = nullptr) {
    __shared__ __align__(16) bf16 queries[FLASH_TILE * FLASH_LD];
    __shared__ __align__(16) bf16 keys[2][FLASH_TILE * FLASH_LD];
    __shared__ __align__(16) bf16 values[2][FLASH_TILE * FLASH_LD];
    __shared__ int key_valid[2][FLASH_TILE];
    const FlashBlock k = flash_block(scatter, tokens, heads, seq);
    const size_t rows = ((size_t)k.b * heads + k.h) * seq;
    if (flash_padding_tile(k, lse + rows, seq)) return;
    const int tiles = (k.end + FLASH_TILE - 1) / FLASH_TILE;
    // Group 0: the queries and key tile 0; group 1: key tile 1 (empty where there is none).
    // Every iteration then closes one group (key tile `tile + 2`, or none), so that key tile
    // `tile` is always the group a wait for all but the newest one retires.
    fr_copy_tiles<1>({queries}, qkv, k.stride, {k.column(0)}, k.places, k.first, seq, tokens,
                     nullptr);
    fr_copy_tiles<2>({keys[0], values[0]}, qkv, k.stride, {k.column(1), k.column(2)}, k.places,
                     0, seq, tokens, key_valid[0]);
    cp_async_commit();
    if (tiles > 1) {
        fr_copy_tiles<2>({keys[1], values[1]}, qkv, k.stride, {k.column(1), k.column(2)},
                         k.places, FLASH_TILE, seq, tokens, key_valid[1]);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    uint32_t q[4][4];
#pragma unroll
    for (int c = 0; c < 4; ++c) fr_load_a(q[c], queries, k.warp * 16, c * 16);

    FrForwardRows r(k, seq, tokens, d);
    uint32_t* words = nullptr;  // the block's keep words (`FR_BITS`)
    if constexpr ((E & FR_BITS) != 0) {
        words = keep_bits + fr_bits_at(k.b, k.h, heads, (seq + FLASH_TILE - 1) / FLASH_TILE,
                                       k.first / FLASH_TILE);
    }
    for (int tile = 0; tile < tiles; ++tile) {
        const int buffer = tile & 1;
        if (tile > 0) {
            cp_async_wait<1>();
            __syncthreads();
        }
        const uint32_t kept =
            fr_forward_tile<E>(q, keys[buffer], values[buffer], key_valid[buffer],
                               tile * FLASH_TILE, scale, d, r.line, r.m, r.l, r.o);
        if constexpr ((E & FR_BITS) != 0) words[tile * FLASH_THREADS + threadIdx.x] = kept;
        // Every warp done with this buffer before its next tile is copied in.
        __syncthreads();
        if (tile + 2 < tiles) {
            fr_copy_tiles<2>({keys[buffer], values[buffer]}, qkv, k.stride,
                             {k.column(1), k.column(2)}, k.places, (tile + 2) * FLASH_TILE, seq,
                             tokens, key_valid[buffer]);
        }
        cp_async_commit();
    }
    cp_async_wait<0>();
    r.finish(queries, context, lse, rows, k, seq, tokens);
}

// The forward with a block for a pair of query tiles (`BERTKIT_CUDA_FLASH_FORWARD=pair`, with
// the straight forms): grid (pairs of query tiles, heads, batch), eight warps, 128 queries. Each
// key and value tile is copied once for both query tiles, where the forms above copy it for
// each (half the loads a query, half the key and value traffic out of L2), and by asynchronous
// copies into two buffers: the second is the queries' tile, free once each warp has its
// queries' fragments in registers (the queries, 18 KB, and two buffers of keys and values
// would not fit a block's 48 KB of static shared memory). The same arithmetic a warp as the
// forms above (`fr_forward_tile`), the same tiles in the same order: the same bits as the
// straight form's.
#define FR_PAIR_WARPS 8
#define FR_PAIR_THREADS (32 * FR_PAIR_WARPS)
#define FR_PAIR_ROWS (16 * FR_PAIR_WARPS)
template <int E>
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
    // The warp's keep words (`FR_BITS`), where its query tile is one of the row's: the second
    // of a pair may lie past the last.
    uint32_t* words = nullptr;
    if constexpr ((E & FR_BITS) != 0) {
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
        const uint32_t kept = fr_forward_tile<E>(q, keys(buffer), values(buffer),
                                                 key_valid[buffer], tile * FLASH_TILE, scale, d,
                                                 r.line, r.m, r.l, r.o);
        if constexpr ((E & FR_BITS) != 0) {
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
// accumulator `x` (columns `8n..8n + 8` of the tile): the probabilities in place of the
// scores, and without `FR_BITS` the dropout's keeps marked in `kept` (bit `4n + e`).
template <int E>
__device__ __forceinline__ void fr_kv_probabilities(float (&x)[4], int n, const bool (&key)[2],
                                                    const int (&j)[2], const int* query_valid,
                                                    const float* tile_lse,
                                                    const uint64_t* tile_line, float scale,
                                                    const Dropout& d, uint32_t& kept) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int qi = n * 8 + 2 * t + (e & 1);
        // (`&`, not `&&`, in the straight form: `query_valid` read with no test.)
        const bool live = E == FR_BRANCHING ? key[e >> 1] && query_valid[qi]
                                            : key[e >> 1] & (query_valid[qi] != 0);
        x[e] = fr_probability<E>(live, x[e], scale, &tile_lse[qi]);
        if constexpr (E != FR_BRANCHING) {
            // (With `FR_BITS` read by the caller.)
            if constexpr ((E & FR_BITS) == 0) {
                fr_mark_kept<E>(kept, d, tile_line[qi], j[e >> 1], 4 * n + e);
            }
        } else if (!d.on || keep_factor(d, tile_line[qi], j[e >> 1]) != 0.0f) {
            kept |= 1u << (4 * n + e);
        }
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
template <int E>
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
            ds[half][e] = p * (dp[half][e] * fr_keep<E>(d, kept, 4 * n + e) - tile_delta[qi]);
        }
    fr_pair_to_a(a, ds, scale);
}

// One query tile of the keys' and values' backward for the warp's 16 keys (see above; with
// `FR_BITS` the forward's keep words of the tile pair, `tile_bits`, the warp's quarter
// `bits_warp`): `dv` and `dk` summed on. The keys' and values' kernel's whole work a tile.
template <int E>
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
    if constexpr ((E & FR_BITS) != 0) kept = fr_kept_transposed(tile_bits, bits_warp, g, t);
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        fr_kv_probabilities<E>(p[n], n, key, j, query_valid, tile_lse, tile_line, scale, d, kept);
    }
    const auto keep = [&](int n, int e) { return fr_keep<E>(d, kept, 4 * n + e); };
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
        fr_kv_ds<E>(a, p[2 * c], p[2 * c + 1], c, values, row0, grads, tile_delta, kept, scale, d);
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
template <int E, int Unroll = 4, typename EachDs>
__device__ __forceinline__ void fr_kv_query_chunks(
    const bf16* keys, const bf16* values, int row0, const bf16* queries, const bf16* grads,
    const int* query_valid, const float* tile_lse, const float* tile_delta,
    const uint64_t* tile_line, const uint32_t* tile_bits, int bits_warp, const bool (&key)[2],
    const int (&j)[2], float scale, const Dropout& d, float (&dk)[8][4], float (&dv)[8][4],
    EachDs each_ds) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    uint32_t kept = 0;  // bit 4n + e: element (n, e) kept by the dropout
    if constexpr ((E & FR_BITS) != 0) kept = fr_kept_transposed(tile_bits, bits_warp, g, t);
#pragma unroll Unroll
    for (int c = 0; c < 4; ++c) {
        // Pᵀ's chunk: the warp's keys against its 16 queries (`fr_scores`' sums for them).
        float p[2][4] = {};
        fr_chunk_product(p, keys, row0, queries, c);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            fr_kv_probabilities<E>(p[half], 2 * c + half, key, j, query_valid, tile_lse,
                                   tile_line, scale, d, kept);
        }
        // dV += dropped Pᵀ · dO (`fr_to_a`'s fragment of the chunk).
        uint32_t a[4];
        fr_pair_to_a(a, p, [&](int half, int e) {
            return fr_keep<E>(d, kept, 4 * (2 * c + half) + e);
        });
        fr_accumulate(dv, a, grads, c * 16);
        fr_kv_ds<E>(a, p[0], p[1], c, values, row0, grads, tile_delta, kept, scale, d);
        fr_accumulate(dk, a, queries, c * 16);
        each_ds(c, a);
    }
}

// The keys' and values' gradients: grid (key tiles, heads, batch); the warp's 16 keys summed
// over every query tile, as `flash_backward_kv`'s. Held to 168 registers a lane, three blocks
// an SM (nvcc's choice, 182, allows two): ptxas spills 36 bytes a lane for it (sm_90).
template <bool Batched, int E = FR_BRANCHING>
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
    // (`FR_BITS`: the forward's keep words of the query tile against this key tile.)
    __shared__ uint32_t tile_bits[(E & FR_BITS) ? FLASH_THREADS : 1];
    const uint32_t* words = nullptr;
    if constexpr ((E & FR_BITS) != 0) {
        const int tiles = (seq + FLASH_TILE - 1) / FLASH_TILE;
        words = keep_bits + fr_bits_at(k.b, k.h, heads, tiles, 0) +
                (size_t)(k.first / FLASH_TILE) * FLASH_THREADS + threadIdx.x;
    }
    flash_load_two<Batched>(keys, qkv, k.stride, k.column(1), values, qkv, k.stride, k.column(2),
                            k.places, k.first, seq, tokens, nullptr);
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
        if constexpr ((E & FR_BITS) != 0) {
            tile_bits[threadIdx.x] =
                words[(size_t)(q0 / FLASH_TILE) * ((seq + FLASH_TILE - 1) / FLASH_TILE) *
                      FLASH_THREADS];
        }
        flash_load_query_tile<Batched>(queries, grads, query_valid, tile_lse, tile_delta,
                                       tile_line, qkv, grad, lse, delta, k, q0, rows, seq, tokens,
                                       d, head_key);
        fr_kv_query_tile<E>(keys, values, k.warp * 16, queries, grads, query_valid, tile_lse,
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
template <bool Batched, int E = FR_BRANCHING>
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
    flash_load_two<Batched>(queries, qkv, k.stride, k.column(0), grads, grad, k.hidden,
                            k.column(0), k.places, k.first, seq, tokens, nullptr);
    __syncthreads();
    uint32_t qf[4][4], gf[4][4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        fr_load_a(qf[c], queries, k.warp * 16, c * 16);
        fr_load_a(gf[c], grads, k.warp * 16, c * 16);
    }
    bool query[2];
    float q_lse[2], q_delta[2];
    uint64_t line[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int i = k.first + k.warp * 16 + g + 8 * h;
        query[h] = i < seq && k.places[i] < (uint32_t)tokens;
        const size_t at = ((size_t)k.b * heads + k.h) * seq + i;
        q_lse[h] = query[h] ? lse[at] : 0.0f;
        q_delta[h] = query[h] ? delta[at] : 0.0f;
        line[h] = d.on ? line_key(line_key(row_key(d, k.b), k.h), i) : 0;
    }
    float dq[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq[n][e] = 0.0f;
    // (`FR_BITS`: the lane's keep words, the forward's lane's: the same warps own the queries.)
    const uint32_t* words = nullptr;
    if constexpr ((E & FR_BITS) != 0) {
        words = keep_bits +
                fr_bits_at(k.b, k.h, heads, (seq + FLASH_TILE - 1) / FLASH_TILE,
                           k.first / FLASH_TILE) +
                threadIdx.x;
    }

    for (int k0 = 0; k0 < k.end; k0 += FLASH_TILE) {
        uint32_t kept = 0;
        if constexpr ((E & FR_BITS) != 0) kept = words[(k0 / FLASH_TILE) * FLASH_THREADS];
        flash_load_keys_values<Batched>(keys, values, key_valid, qkv, k, k0, seq, tokens);
        float p[8][4];
        fr_scores(p, qf, keys);
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = n * 8 + 2 * t + (e & 1);
                const int h = e >> 1;
                const bool live = E == FR_BRANCHING ? query[h] && key_valid[col]
                                                    : query[h] & (key_valid[col] != 0);
                p[n][e] = fr_probability<E>(live, p[n][e], scale, &q_lse[h]);
                if constexpr (E != FR_BRANCHING) {
                    // (With `FR_BITS` read above.)
                    if constexpr ((E & FR_BITS) == 0) {
                        fr_mark_kept<E>(kept, d, line[h], k0 + col, 4 * n + e);
                    }
                } else if (!d.on || keep_factor(d, line[h], k0 + col) != 0.0f) {
                    kept |= 1u << (4 * n + e);
                }
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
                        p[n][e] * (dp[half][e] * fr_keep<E>(d, kept, 4 * n + e) - q_delta[e >> 1]);
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

// The joint backward (`BERTKIT_CUDA_FLASH_BACKWARD=joint`, rows of at most 128 places): one
// block a row's head, eight warps, the three gradients and the delta in one launch, where the
// forms above take three (the delta; the keys' and values' backward; the queries'). At phase
// 1's 128 places the two backwards each compute the row's P and dP (the queries' kernel again
// what the keys' kernel had), read the queries, keys, values and output gradients once per
// tile pair, and the delta kernel reads the context and the gradient once more. Here the whole
// row's queries, keys, values and gradients sit in shared memory once; each warp owns 16 keys
// and goes over both query tiles as the keys' and values' kernel does (`fr_kv_query_chunks`:
// the same products in the same order, the same dK and dV), writing dSᵀ's bf16 fragments (the
// left operand of dK's product, already times the scale) into a shared `[128 keys][136]` tile
// as they are made; after a barrier each warp owns 16 queries and sums dQ = dS · K from that
// tile (read transposed by `ldmatrix`) in the queries' kernel's order of keys: the same bits as
// that kernel's, without computing P and dP again, and no atomics. The delta is computed by
// each warp for 16 queries in the delta kernel's order (`flash_token_delta`) while the tiles'
// copies are in flight. Grid (1, heads, batch); `FrJointShared` of dynamic shared memory (an
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
    uint32_t bits[4 * FLASH_THREADS];   // `FR_BITS`: the forward's words of the four tile pairs
};
// (`flash.rs`'s `JOINT_SHARED_BYTES`, the launch's dynamic shared memory.)
static_assert(sizeof(FrJointShared) == 113152, "flash.rs launches the joint backward with it");

template <int E>
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
    if constexpr ((E & FR_BITS) != 0) {
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
            fr_kv_query_chunks<E>(s.keys, s.values, k.warp * 16, s.queries + q0 * FLASH_LD,
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

// The entry points: `flash_registers_NAME_bf16` with `flash_load_tile`'s loads,
// `flash_registers_batched_NAME_bf16` with them batched (`flash.rs` chooses).
extern "C" __global__ void __launch_bounds__(FLASH_THREADS)
    flash_registers_forward_bf16(FLASH_FORWARD_ARGS) {
    fr_forward<false>(qkv, context, lse, scatter, tokens, batch, heads, seq, scale, d);
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 4)
    flash_registers_batched_forward_bf16(FLASH_FORWARD_ARGS) {
    fr_forward<true>(qkv, context, lse, scatter, tokens, batch, heads, seq, scale, d);
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 4)
    flash_registers_async_forward_bf16(FLASH_FORWARD_ARGS) {
    fr_forward_async(qkv, context, lse, scatter, tokens, batch, heads, seq, scale, d);
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 3)
    flash_registers_backward_kv_bf16(FLASH_BACKWARD_ARGS) {
    fr_backward_kv<false>(qkv, grad, lse, delta, grad_qkv, scatter, tokens, batch, heads, seq,
                          scale, d);
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 3)
    flash_registers_batched_backward_kv_bf16(FLASH_BACKWARD_ARGS) {
    fr_backward_kv<true>(qkv, grad, lse, delta, grad_qkv, scatter, tokens, batch, heads, seq,
                         scale, d);
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS)
    flash_registers_backward_q_bf16(FLASH_BACKWARD_ARGS) {
    fr_backward_q<false>(qkv, grad, lse, delta, grad_qkv, scatter, tokens, batch, heads, seq,
                         scale, d);
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 3)
    flash_registers_batched_backward_q_bf16(FLASH_BACKWARD_ARGS) {
    fr_backward_q<true>(qkv, grad, lse, delta, grad_qkv, scatter, tokens, batch, heads, seq,
                        scale, d);
}

// The straight forms (`FR_PLAIN`, `FR_DROPOUT`; `BERTKIT_CUDA_FLASH_BRANCHES=none`), with their
// tiles' loads batched: `flash_registers_straight_NAME_bf16` without dropout and
// `flash_registers_straight_dropout_NAME_bf16` with it (`flash.rs` chooses by the mask's `on`),
// the launch bounds of the forms they replace.
// `flash_registers_straight_exp2[_dropout]_NAME_bf16`: the same with `FR_EXP2`
// (`BERTKIT_CUDA_FLASH_EXP=exp2`).
#define FR_STRAIGHT_FORWARD(FORM, FLAGS, NAME, BLOCKS, BODY)                                      \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS, BLOCKS)                           \
        flash_registers_##FORM##_##NAME##_bf16(FLASH_FORWARD_ARGS) {                              \
        BODY(FR_PLAIN | FLAGS)(qkv, context, lse, scatter, tokens, batch, heads, seq, scale, d);  \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS, BLOCKS)                           \
        flash_registers_##FORM##_dropout_##NAME##_bf16(FLASH_FORWARD_ARGS) {                      \
        BODY(FR_DROPOUT | FLAGS)(qkv, context, lse, scatter, tokens, batch, heads, seq, scale, d);\
    }
#define FR_STRAIGHT_BACKWARD(FORM, FLAGS, NAME, BODY)                                             \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 3)                                \
        flash_registers_##FORM##_##NAME##_bf16(FLASH_BACKWARD_ARGS) {                             \
        BODY<true, FR_PLAIN | FLAGS>(qkv, grad, lse, delta, grad_qkv, scatter, tokens, batch,     \
                                     heads, seq, scale, d);                                       \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 3)                                \
        flash_registers_##FORM##_dropout_##NAME##_bf16(FLASH_BACKWARD_ARGS) {                     \
        BODY<true, FR_DROPOUT | FLAGS>(qkv, grad, lse, delta, grad_qkv, scatter, tokens, batch,   \
                                       heads, seq, scale, d);                                     \
    }
#define FR_BATCHED_FORWARD(E) fr_forward<true, E>
#define FR_ASYNC_FORWARD(E) fr_forward_async<E>
FR_STRAIGHT_FORWARD(straight, 0, forward, 4, FR_BATCHED_FORWARD)
FR_STRAIGHT_FORWARD(straight, 0, async_forward, 4, FR_ASYNC_FORWARD)
FR_STRAIGHT_BACKWARD(straight, 0, backward_kv, fr_backward_kv)
FR_STRAIGHT_BACKWARD(straight, 0, backward_q, fr_backward_q)
FR_STRAIGHT_FORWARD(straight_exp2, FR_EXP2, forward, 4, FR_BATCHED_FORWARD)
FR_STRAIGHT_FORWARD(straight_exp2, FR_EXP2, async_forward, 4, FR_ASYNC_FORWARD)
FR_STRAIGHT_BACKWARD(straight_exp2, FR_EXP2, backward_kv, fr_backward_kv)
FR_STRAIGHT_BACKWARD(straight_exp2, FR_EXP2, backward_q, fr_backward_q)
// The pair forward (`flash_registers_pair[_exp2][_dropout]_forward_bf16`): 256 threads, two
// blocks an SM by registers.
#define FR_PAIR_FORWARD(FORM, FLAGS)                                                              \
    extern "C" __global__ void __launch_bounds__(FR_PAIR_THREADS, 2)                              \
        flash_registers_##FORM##_forward_bf16(FLASH_FORWARD_ARGS) {                               \
        fr_forward_pair<FR_PLAIN | FLAGS>(qkv, context, lse, scatter, tokens, batch, heads, seq,  \
                                          scale, d);                                              \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FR_PAIR_THREADS, 2)                              \
        flash_registers_##FORM##_dropout_forward_bf16(FLASH_FORWARD_ARGS) {                       \
        fr_forward_pair<FR_DROPOUT | FLAGS>(qkv, context, lse, scatter, tokens, batch, heads,     \
                                            seq, scale, d);                                       \
    }
FR_PAIR_FORWARD(pair, 0)
FR_PAIR_FORWARD(pair_exp2, FR_EXP2)

// The straight forms with their keep bits (`FR_BITS`, `BERTKIT_CUDA_FLASH_DROPOUT=bits`), with
// dropout only: `flash_registers_{straight,straight_exp2}_bits_{forward,async_forward,
// backward_kv,backward_q}_bf16` and `flash_registers_{pair,pair_exp2}_bits_forward_bf16`, each
// taking the keep words last (`[batch, heads, tiles, tiles, 128]`, `fr_bits_at`): the
// forwards write every word of a pair of tiles they cover, the backwards read them.
#define FR_BITS_FORWARD(FORM, FLAGS, NAME, THREADS, BLOCKS, BODY)                                 \
    extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS)                                 \
        flash_registers_##FORM##_bits_##NAME##_bf16(FLASH_FORWARD_ARGS, uint32_t * keep_bits) {   \
        BODY(FR_DROPOUT | FR_BITS | FLAGS)(qkv, context, lse, scatter, tokens, batch, heads, seq, \
                                           scale, d, keep_bits);                                  \
    }
#define FR_BITS_BACKWARD(FORM, FLAGS, NAME, BODY)                                                 \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 3)                                \
        flash_registers_##FORM##_bits_##NAME##_bf16(FLASH_BACKWARD_ARGS,                          \
                                                    const uint32_t* keep_bits) {                  \
        BODY<true, FR_DROPOUT | FR_BITS | FLAGS>(qkv, grad, lse, delta, grad_qkv, scatter,        \
                                                 tokens, batch, heads, seq, scale, d, keep_bits); \
    }
#define FR_PAIR(E) fr_forward_pair<E>
FR_BITS_FORWARD(straight, 0, forward, FLASH_THREADS, 4, FR_BATCHED_FORWARD)
FR_BITS_FORWARD(straight, 0, async_forward, FLASH_THREADS, 4, FR_ASYNC_FORWARD)
FR_BITS_FORWARD(pair, 0, forward, FR_PAIR_THREADS, 2, FR_PAIR)
FR_BITS_BACKWARD(straight, 0, backward_kv, fr_backward_kv)
FR_BITS_BACKWARD(straight, 0, backward_q, fr_backward_q)
FR_BITS_FORWARD(straight_exp2, FR_EXP2, forward, FLASH_THREADS, 4, FR_BATCHED_FORWARD)
FR_BITS_FORWARD(straight_exp2, FR_EXP2, async_forward, FLASH_THREADS, 4, FR_ASYNC_FORWARD)
FR_BITS_FORWARD(pair_exp2, FR_EXP2, forward, FR_PAIR_THREADS, 2, FR_PAIR)
FR_BITS_BACKWARD(straight_exp2, FR_EXP2, backward_kv, fr_backward_kv)
FR_BITS_BACKWARD(straight_exp2, FR_EXP2, backward_q, fr_backward_q)

// The backwards of a block of eight warps, each in three forms: `flash_registers_FORM_NAME`,
// `..._FORM_dropout_NAME` and `..._FORM_bits_NAME` (`_bf16`), the straight forms' element-wise
// code, `BODY` called with the arguments `...` (and the keep words last for `_bits`).
#define FR_EIGHT_WARP_BACKWARD(FORM, NAME, FLAGS, ARGS, BODY, ...)                                \
    extern "C" __global__ void __launch_bounds__(FR_PAIR_THREADS, 2)                              \
        flash_registers_##FORM##_##NAME##_bf16(ARGS) {                                            \
        BODY<FR_PLAIN | FLAGS>(__VA_ARGS__);                                                      \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FR_PAIR_THREADS, 2)                              \
        flash_registers_##FORM##_dropout_##NAME##_bf16(ARGS) {                                    \
        BODY<FR_DROPOUT | FLAGS>(__VA_ARGS__);                                                    \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FR_PAIR_THREADS, 2)                              \
        flash_registers_##FORM##_bits_##NAME##_bf16(ARGS, const uint32_t* keep_bits) {            \
        BODY<FR_DROPOUT | FR_BITS | FLAGS>(__VA_ARGS__, keep_bits);                               \
    }

// The joint backward (`flash_registers_joint[_exp2][_dropout|_bits]_backward_bf16`): the
// context in place of the delta.
#define FLASH_JOINT_ARGS                                                                          \
    const bf16 *qkv, const bf16 *context, const bf16 *grad, const float *lse, bf16 *grad_qkv,     \
        const uint32_t *scatter, int tokens, int batch, int heads, int seq, float scale, Dropout d
#define FR_JOINT_BACKWARD(FORM, FLAGS)                                                            \
    FR_EIGHT_WARP_BACKWARD(FORM, backward, FLAGS, FLASH_JOINT_ARGS, fr_backward_joint, qkv,       \
                           context, grad, lse, grad_qkv, scatter, tokens, batch, heads, seq,      \
                           scale, d)
FR_JOINT_BACKWARD(joint, 0)
FR_JOINT_BACKWARD(joint_exp2, FR_EXP2)

#endif
