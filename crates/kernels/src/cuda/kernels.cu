// bertkit's fused CUDA kernels: the device half of `kernels::cuda`.
//
// Compiled to PTX by the model crate's build script (nvcc, only with the `cuda` feature) and
// loaded on candle's device, launched on its stream. Every kernel reads f32, bf16 or f16 and
// computes in f32; each has a CPU twin (the `kernels::cpu` op of the same name, or the
// composed ops), and `bertkit check kernels` compares the two on any GPU.
//
// Dropout masks are not stored: a kept element is recomputed from its keys exactly as the CPU
// draws it (`dropout.rs`: splitmix64 of the mask's key, the row's place in its step, the
// element's indices), so the CUDA and CPU kernels drop the same elements.

#include "common.cuh"

#include "norm.cu"

// ---------------------------------------------------------------------------------------------
// A linear layer's end: the bias and the activation (0: none, 1: GELU with erf, 2: GELU's tanh
// form, its gate written as a logistic as on the CPU).

// The most columns one block of `bias_act_backward` sums the bias of (its shared memory, 48
// KiB of f32; `linear.rs`'s BIAS_CHUNK).
#define BIAS_CHUNK 12288

__device__ __forceinline__ float activation(float v, int act) {
    if (act == 1) return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    if (act == 2) {
        const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
        return v / (1.0f + expf(-2.0f * u));
    }
    return v;
}

__device__ __forceinline__ float activation_slope(float v, int act) {
    if (act == 1) {
        const float cdf = 0.5f * (1.0f + erff(v * 0.70710678118654752f));
        const float pdf = 0.3989422804014327f * expf(-0.5f * v * v);
        return cdf + v * pdf;
    }
    if (act == 2) {
        const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
        const float du = 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * v * v);
        const float gate = 1.0f / (1.0f + expf(-2.0f * u));
        return gate + v * 2.0f * gate * (1.0f - gate) * du;
    }
    return 1.0f;
}

// `out = act(y + bias)` over `[rows, cols]` (`bias` may be null); a block per row.
template <typename T>
__device__ void bias_act_forward(const T* y, const T* bias, T* out, int rows, int cols, int act) {
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const size_t at = (size_t)r * cols;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = to_f32(y[at + c]);
            if (bias) v += to_f32(bias[c]);
            out[at + c] = from_f32<T>(activation(v, act));
        }
    }
}

// The backward: `grad_y = grad · act'(y + bias)` (skipped when null: no activation) and the
// bias's gradient as per-block partial column sums (`[gridDim.x, cols]`; skipped when null).
template <typename T>
__device__ void bias_act_backward(const T* y, const T* bias, const T* grad, T* grad_y,
                                  float* partial, int rows, int cols, int act) {
    // The block's columns: all of them, or (rows wider than BIAS_CHUNK, the masked-LM
    // decoder's 30,522) the chunk `blockIdx.y` of BIAS_CHUNK, whose bias sums fit the shared
    // memory.
    DYNAMIC_SHARED(float, grad_bias);
    const int first = blockIdx.y * BIAS_CHUNK, end = min(cols, first + BIAS_CHUNK);
    if (partial)
        for (int c = first + threadIdx.x; c < end; c += blockDim.x) grad_bias[c - first] = 0.0f;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const size_t at = (size_t)r * cols;
        for (int c = first + threadIdx.x; c < end; c += blockDim.x) {
            float g = to_f32(grad[at + c]);
            if (act != 0) {
                float v = to_f32(y[at + c]);
                if (bias) v += to_f32(bias[c]);
                g *= activation_slope(v, act);
                grad_y[at + c] = from_f32<T>(g);
            }
            if (partial) grad_bias[c - first] += g;
        }
    }
    if (partial)
        for (int c = first + threadIdx.x; c < end; c += blockDim.x)
            partial[(size_t)blockIdx.x * cols + c] = grad_bias[c - first];
}

// The same two kernels 16 bytes a thread (`linear.rs`: rows of whole 16-byte pieces, every
// input on a 16-byte boundary), each thread reading and writing 16 bytes of a row at a time
// (8 bf16 or f16, 4 f32). The same arithmetic on each element, and in the backward each
// column's partial sum over the same rows in the same order: the same bits.
//
// The forward: the grid's threads over a row's pieces (`blockIdx.y` a stretch of `blockDim.x`
// of them), each taking its piece at the rows `blockIdx.x`, `+ gridDim.x`, ...: its bias read
// and widened once for all of them. (The pass is issue-bound on `erff`'s ~27 instructions an
// element: what is left around it is what this trims.)
template <typename T>
__device__ void bias_act_rows_forward(const T* y, const T* bias, T* out, int rows, int cols,
                                      int act) {
    constexpr int N = Vec16<T>::N;
    const int pieces = cols / N;
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < pieces; c += gridDim.y * blockDim.x) {
        float b[N];
        if (bias) load_vec16(bias + (size_t)c * N, b);
        for (int r = blockIdx.x; r < rows; r += gridDim.x) {
            const size_t at = (size_t)r * cols + (size_t)c * N;
            float v[N];
            load_vec16(y + at, v);
            if (bias) {
#pragma unroll
                for (int k = 0; k < N; ++k) v[k] += b[k];
            }
#pragma unroll
            for (int k = 0; k < N; ++k) v[k] = activation(v[k], act);
            store_vec16(out + at, v);
        }
    }
}

// The backward: the bias's gradient alone (a linear layer with no activation), its partial
// column sums kept in registers: each thread one 16-byte piece of columns over the block's rows
// `blockIdx.x + k · gridDim.x`, in that order (the same sums as `bias_act_backward`'s to the
// bit), four rows' loads issued before their additions, where adding each element into shared
// memory would wait on each row's loads in turn.
// `Act` (`act` 1 or 2): the activation's backward as well: each row's gradient and product
// (`y`) loaded four rows ahead, `grad · act'(y + bias)` written to `grad_y` and summed into
// `partial` (null: no bias, nothing summed), the bias's piece read once for all of the
// thread's rows. The same arithmetic an element: the same bits.
#define BIAS_SUMS_THREADS 128
template <typename T, bool Act = false>
__device__ void bias_sums_vec(const T* grad, float* partial, int rows, int cols,
                              const T* y = nullptr, const T* bias = nullptr,
                              T* grad_y = nullptr, int act = 0) {
    constexpr int N = Vec16<T>::N, AHEAD = 4;
    const int pieces = cols / N;
    const int step = gridDim.x;
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < pieces; c += gridDim.y * blockDim.x) {
        const T* column = grad + (size_t)c * N;
        float sum[N], b[N];
#pragma unroll
        for (int k = 0; k < N; ++k) sum[k] = b[k] = 0.0f;
        if (Act && bias) load_vec16(bias + (size_t)c * N, b);
        // Row `r`'s gradient `g` through the activation (its product's piece as loaded,
        // `raw_y`), written to `grad_y`.
        const auto through = [&](float (&g)[N], uint4 raw_y, int r) {
            if constexpr (Act) {
                float v[N];
                unpack_vec16<T>(raw_y, v);
                if (bias) {
#pragma unroll
                    for (int k = 0; k < N; ++k) v[k] += b[k];
                }
#pragma unroll
                for (int k = 0; k < N; ++k) g[k] *= activation_slope(v[k], act);
                store_vec16(grad_y + (size_t)r * cols + (size_t)c * N, g);
            }
        };
        int r = blockIdx.x;
        for (; r + (AHEAD - 1) * step < rows; r += AHEAD * step) {
            // The four pieces as loaded (16 registers, 32 with the products; widened one at a
            // time below), so that ptxas keeps all the loads ahead of the first addition.
            uint4 raw[AHEAD], raw_y[AHEAD]{};
#pragma unroll
            for (int a = 0; a < AHEAD; ++a) {
                const size_t at = (size_t)(r + a * step) * cols;
                raw[a] = *reinterpret_cast<const uint4*>(column + at);
                if constexpr (Act) {
                    raw_y[a] = *reinterpret_cast<const uint4*>(y + at + (size_t)c * N);
                }
            }
#pragma unroll
            for (int a = 0; a < AHEAD; ++a) {
                float g[N];
                unpack_vec16<T>(raw[a], g);
                through(g, raw_y[a], r + a * step);
#pragma unroll
                for (int k = 0; k < N; ++k) sum[k] += g[k];
            }
        }
        for (; r < rows; r += step) {
            const size_t at = (size_t)r * cols;
            float g[N];
            load_vec16(column + at, g);
            uint4 raw_y{};
            if constexpr (Act) {
                raw_y = *reinterpret_cast<const uint4*>(y + at + (size_t)c * N);
            }
            through(g, raw_y, r);
#pragma unroll
            for (int k = 0; k < N; ++k) sum[k] += g[k];
        }
        if (partial) {
#pragma unroll
            for (int k = 0; k < N; ++k)
                partial[(size_t)blockIdx.x * cols + (size_t)c * N + k] = sum[k];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Attention within the sequences of a packed batch, its products in cuBLAS.
//
// Tokens `[tokens, parts · hidden]` (hidden = heads · head) go to padded heads
// `[parts, batch, heads, seq, head]` (zeros at padding) and back; the scores `[batch, heads,
// seq, seq]` go through the softmax below. `scatter[b · seq + s]` is the token at a padded place
// (`tokens`: padding), `gather[t]` a token's place.

template <typename T>
__device__ void tokens_to_heads(const T* src, T* dst, const uint32_t* scatter, int tokens,
                                int batch, int seq, int heads, int head, int parts) {
    const int hidden = heads * head;
    for (int place = blockIdx.x; place < batch * seq; place += gridDim.x) {
        const int b = place / seq, s = place % seq;
        const uint32_t t = scatter[place];
        for (int c = threadIdx.x; c < parts * hidden; c += blockDim.x) {
            const int part = c / hidden, hc = c % hidden, h = hc / head, e = hc % head;
            const T v = t < (uint32_t)tokens ? src[(size_t)t * parts * hidden + c] : from_f32<T>(0.0f);
            dst[((((size_t)part * batch + b) * heads + h) * seq + s) * head + e] = v;
        }
    }
}

// The way back, each part from its own tensor `[batch, heads, seq, head]` (`src1`, `src2` unused
// with one part).
template <typename T>
__device__ void heads_to_tokens(const T* src0, const T* src1, const T* src2, T* dst,
                                const uint32_t* gather, int tokens, int seq, int heads, int head,
                                int parts) {
    const int hidden = heads * head;
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
        const uint32_t place = gather[t];
        const int b = place / seq, s = place % seq;
        for (int c = threadIdx.x; c < parts * hidden; c += blockDim.x) {
            const int part = c / hidden, hc = c % hidden, h = hc / head, e = hc % head;
            const T* src = part == 0 ? src0 : (part == 1 ? src1 : src2);
            dst[(size_t)t * parts * hidden + c] = src[(((size_t)b * heads + h) * seq + s) * head + e];
        }
    }
}

// Softmax over each query's keys (`scale · q·k`, padding keys excluded), then dropout of the
// probabilities at (row, head, query column, key column) as the CPU draws it; padding queries
// get zeros. A warp per query, each lane holding up to 16 of its keys (seq <= 512).
#define MAX_KEYS_PER_LANE 16

// The softmax of query `i`'s scaled scores `in` over the row's token keys into `p` (this
// lane's keys `lane + 32 · k`; 0 for padding keys and past `seq`), computed by the whole warp.
template <typename T>
__device__ __forceinline__ void query_probabilities(const T* in, const uint32_t* row_places,
                                                    int tokens, int seq, float scale, int lane,
                                                    float (&p)[MAX_KEYS_PER_LANE]) {
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < MAX_KEYS_PER_LANE; ++k) {
        const int j = lane + 32 * k;
        p[k] = (j < seq && row_places[j] < (uint32_t)tokens) ? to_f32(in[j]) * scale : -INFINITY;
        m = fmaxf(m, p[k]);
    }
    m = warp_max(m);
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < MAX_KEYS_PER_LANE; ++k) {
        p[k] = p[k] == -INFINITY ? 0.0f : expf(p[k] - m);
        s += p[k];
    }
    const float inv = 1.0f / warp_sum(s);
#pragma unroll
    for (int k = 0; k < MAX_KEYS_PER_LANE; ++k) p[k] *= inv;
}

template <typename T>
__device__ void attention_softmax_forward(const T* scores, T* probs, const uint32_t* scatter,
                                          int tokens, int batch, int heads, int seq, float scale,
                                          Dropout d) {
    const int lane = threadIdx.x & 31;
    for_each_query(batch, heads, seq, [&](size_t q, int b, int h, int i) {
        T* out = probs + q * seq;
        const uint32_t* row_places = scatter + (size_t)b * seq;
        if (row_places[i] >= (uint32_t)tokens) {
            for (int j = lane; j < seq; j += 32) out[j] = from_f32<T>(0.0f);
            return;
        }
        float p[MAX_KEYS_PER_LANE];
        query_probabilities(scores + q * seq, row_places, tokens, seq, scale, lane, p);
        const uint64_t line = d.on ? line_key(line_key(row_key(d, b), h), i) : 0;
#pragma unroll
        for (int k = 0; k < MAX_KEYS_PER_LANE; ++k) {
            const int j = lane + 32 * k;
            if (j < seq) out[j] = from_f32<T>(d.on ? p[k] * keep_factor(d, line, j) : p[k]);
        }
    });
}

// The backward from the scores (the probabilities recomputed) and the gradient of the dropped
// probabilities: `scale · p · (g - Σ p·g)` with `g` the gradient through the dropout.
template <typename T>
__device__ void attention_softmax_backward(const T* scores, const T* grad_probs, T* grad_scores,
                                           const uint32_t* scatter, int tokens, int batch,
                                           int heads, int seq, float scale, Dropout d) {
    const int lane = threadIdx.x & 31;
    for_each_query(batch, heads, seq, [&](size_t q, int b, int h, int i) {
        const T* gin = grad_probs + q * seq;
        T* out = grad_scores + q * seq;
        const uint32_t* row_places = scatter + (size_t)b * seq;
        if (row_places[i] >= (uint32_t)tokens) {
            for (int j = lane; j < seq; j += 32) out[j] = from_f32<T>(0.0f);
            return;
        }
        float p[MAX_KEYS_PER_LANE];
        float g[MAX_KEYS_PER_LANE];
        query_probabilities(scores + q * seq, row_places, tokens, seq, scale, lane, p);
        const uint64_t line = d.on ? line_key(line_key(row_key(d, b), h), i) : 0;
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < MAX_KEYS_PER_LANE; ++k) {
            const int j = lane + 32 * k;
            g[k] = 0.0f;
            if (j < seq) {
                g[k] = to_f32(gin[j]);
                if (d.on) g[k] *= keep_factor(d, line, j);
            }
            dot += p[k] * g[k];
        }
        dot = warp_sum(dot);
#pragma unroll
        for (int k = 0; k < MAX_KEYS_PER_LANE; ++k) {
            const int j = lane + 32 * k;
            if (j < seq) out[j] = from_f32<T>(scale * p[k] * (g[k] - dot));
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Embedding lookups: rows of a table gathered per token, and the backward summing each row's
// gradients apart.

template <typename T>
__device__ void gather_rows(const T* table, const uint32_t* rows, T* out, int tokens, int cols) {
    const size_t n = (size_t)tokens * cols;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / cols, c = i % cols;
        out[i] = table[(size_t)rows[t] * cols + c];
    }
}

// The backward in pieces: each row's tokens cut into pieces of at most a fixed count
// (RowGroups' pieces, in token order), a block summing each piece's gradients in f32 into
// `partial`, then a block per row summing its pieces in order, so that a row read by thousands
// of tokens (a token type, [MASK]) is not one block adding them one after the other. These
// sums are f32's, in a fixed order.
template <typename T>
__device__ void gather_rows_backward_pieces(const T* grad, const uint32_t* order,
                                            const uint32_t* piece_starts, float* partial,
                                            int pieces, int cols) {
    for (int k = blockIdx.x; k < pieces; k += gridDim.x) {
        const uint32_t begin = piece_starts[k], end = piece_starts[k + 1];
        float* dst = partial + (size_t)k * cols;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            float sum = 0.0f;
            for (uint32_t i = begin; i < end; ++i) sum += to_f32(grad[(size_t)order[i] * cols + c]);
            dst[c] = sum;
        }
    }
}

template <typename T>
__device__ void gather_rows_backward_rows(const float* partial, const uint32_t* row_pieces,
                                          const uint32_t* distinct, T* grad_table, int groups,
                                          int cols) {
    for (int k = blockIdx.x; k < groups; k += gridDim.x) {
        const uint32_t begin = row_pieces[k], end = row_pieces[k + 1];
        T* dst = grad_table + (size_t)distinct[k] * cols;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            float sum = 0.0f;
            for (uint32_t p = begin; p < end; ++p) sum += partial[(size_t)p * cols + c];
            dst[c] = from_f32<T>(sum);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tensors joined along their rows (`join.rs`): a layer's query, key
// and value weights (and biases) for their one product, a LayerNorm's weight and bias for its
// kernel, at every pass. Their bytes one part after another, 16 a thread, in one launch where
// candle's concatenation makes one a part (`copy2d`, an element a thread). Each part whole 16-byte pieces from a
// 16-byte boundary (the launcher checks); the element type does not matter.

#define JOIN_PARTS 3

// The parts (`JoinParts` in `join.rs`): each one's first piece, and the piece of the output
// each one ends at (its own and those before it).
struct JoinParts {
    const uint4* src[JOIN_PARTS];
    unsigned long long end[JOIN_PARTS];
    int count;
};

__device__ __forceinline__ void join_rows(const JoinParts parts, uint4* dst) {
    // (Every field read at a fixed place: an index into the parameters would copy them to the
    // stack.)
    unsigned long long total = parts.end[0];
#pragma unroll
    for (int k = 1; k < JOIN_PARTS; ++k)
        if (k < parts.count) total = parts.end[k];
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long p = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         p < total; p += stride) {
        // The part holding piece `p`: the first whose end is past it.
        const uint4* src = parts.src[0];
        unsigned long long start = 0;
#pragma unroll
        for (int k = 0; k + 1 < JOIN_PARTS; ++k) {
            if (k + 1 < parts.count && p >= parts.end[k]) {
                src = parts.src[k + 1];
                start = parts.end[k];
            }
        }
        dst[p] = src[p - start];
    }
}

// (One entry point an element type, as every launcher names them; the same bytes moved.)
extern "C" __global__ void join_rows_f32(JoinParts parts, uint4* dst) { join_rows(parts, dst); }
extern "C" __global__ void join_rows_bf16(JoinParts parts, uint4* dst) { join_rows(parts, dst); }
extern "C" __global__ void join_rows_f16(JoinParts parts, uint4* dst) { join_rows(parts, dst); }

// ---------------------------------------------------------------------------------------------
// Two tensors' sum (the tape's gradients where two meet, `add.rs`): 16 bytes of each read at a
// time where all three are 16-byte aligned, each element added in f32 and rounded once, as the
// CPU's bf16 and f16 additions do. candle's addition reads and writes one element a thread.

template <typename T>
__device__ void add_tensors(const T* a, const T* b, T* out, size_t n) {
    grid_pieces<T>(
        n, n, aligned16(a, b, out),
        [&](size_t v) {
            constexpr int per = Vec16<T>::N;
            const uint4 x = reinterpret_cast<const uint4*>(a)[v];
            const uint4 y = reinterpret_cast<const uint4*>(b)[v];
            // The 16 bytes as elements through memcpy (registers on the device; no aliasing).
            // (`load_vec16`/`store_vec16` would do the same arithmetic, but the kernel, in use,
            // then compiles to other SASS: kept as it ran.)
            T xs[per], ys[per], zs[per];
            memcpy(xs, &x, sizeof x);
            memcpy(ys, &y, sizeof y);
#pragma unroll
            for (int k = 0; k < per; ++k) zs[k] = from_f32<T>(to_f32(xs[k]) + to_f32(ys[k]));
            uint4 z;
            memcpy(&z, zs, sizeof z);
            reinterpret_cast<uint4*>(out)[v] = z;
        },
        [&](size_t i) { out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i])); });
}

// ---------------------------------------------------------------------------------------------
// Dropout with the CPU's keyed masks (`keyed_dropout.rs`): the
// embeddings' (a packed `[tokens, width]` tensor, each token's line keyed by its place in the
// padded batch, as `dropout.rs`'s `cpu_token_keep_mask` keys it) and the pooler's (`[rows,
// width]`, row `r`'s line keyed by the row alone, as `cpu_keep_mask` keys two dimensions). A
// block per row, the line's key drawn once. The backward is the same on the gradient.
template <typename T>
__device__ void keyed_dropout(const T* x, T* out, int rows, int width, Dropout d,
                              const uint32_t* places, int seq) {
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        uint64_t line;
        if (places) {
            const uint32_t place = places[r];
            line = line_key(row_key(d, place / seq), place % seq);
        } else {
            line = row_key(d, r);
        }
        const size_t at = (size_t)r * width;
        for (int j = threadIdx.x; j < width; j += blockDim.x) {
            out[at + j] = from_f32<T>(to_f32(x[at + j]) * keep_factor(d, line, j));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The embeddings' end (`embeddings.rs`): each token's word,
// token-type and position rows (f32 tables) summed, LayerNorm, then dropout, in one pass. The
// composed path writes the three rows gathered as three `[tokens, hidden]` f32 tensors, adds them
// in two passes, normalises, casts and drops in passes of their own (candle's additions an
// element a thread). A warp per token: a lane holds the pieces `lane`, `lane + 32`, ... of the
// row, each 16 bytes of the output (8 bf16 or f16, 4 f32) read as whole 16-byte pieces of each
// table; the row's statistics are warp sums. The sum is `(word + type) + position`, the
// composed path's order. The backward recomputes the row from the tables (nothing is kept) and
// writes the sum's gradient in f32, from which the lookup's backward sums each table's rows,
// and per-block partial sums of the weight's and the bias's gradients.

// At most 32 elements of a row a lane: rows of up to 1,024 (the launcher checks).
#define EMBED_LANE_ELEMENTS 32

// Lane's pieces of token `r`'s sum of rows (zeros past the row's end).
template <int N, int P>
__device__ __forceinline__ void embed_row_sum(const float* words, const float* types,
                                              const float* positions, const uint32_t* word_rows,
                                              const uint32_t* type_rows,
                                              const uint32_t* position_rows, int r, int hidden,
                                              float (&v)[P][N]) {
    const int lane = threadIdx.x & 31, pieces = hidden / N;
    const float* w = words + (size_t)word_rows[r] * hidden;
    const float* t = types + (size_t)type_rows[r] * hidden;
    const float* p = positions + (size_t)position_rows[r] * hidden;
#pragma unroll
    for (int i = 0; i < P; ++i) {
        const int q = lane + 32 * i;
#pragma unroll
        for (int h = 0; h < N / 4; ++h) {
            uint4 a = make_uint4(0, 0, 0, 0), b = a, c = a;
            if (q < pieces) {
                const size_t at = (size_t)q * N + 4 * h;
                a = *reinterpret_cast<const uint4*>(w + at);
                b = *reinterpret_cast<const uint4*>(t + at);
                c = *reinterpret_cast<const uint4*>(p + at);
            }
            float fa[4], fb[4], fc[4];
            memcpy(fa, &a, sizeof a);
            memcpy(fb, &b, sizeof b);
            memcpy(fc, &c, sizeof c);
#pragma unroll
            for (int k = 0; k < 4; ++k) v[i][4 * h + k] = (fa[k] + fb[k]) + fc[k];
        }
    }
}


// Token `r`'s sum of rows into `v`, its statistics, and its dropout line (0 without dropout):
// what the forward and the backward both start a row with.
template <int N, int P>
__device__ __forceinline__ uint64_t embed_row(const float* words, const float* types,
                                              const float* positions, const uint32_t* word_rows,
                                              const uint32_t* type_rows,
                                              const uint32_t* position_rows, int r, int hidden,
                                              float eps, const Dropout& d,
                                              const uint32_t* places, int seq, float (&v)[P][N],
                                              float& mean, float& rstd) {
    embed_row_sum<N, P>(words, types, positions, word_rows, type_rows, position_rows, r, hidden,
                        v);
    warp_row_statistics<N, P>(v, hidden, eps, mean, rstd);
    if (!d.on) return 0;
    const uint32_t place = places[r];
    return line_key(row_key(d, place / seq), place % seq);
}

// `y = dropout(norm(words[w] + types[t] + positions[p]) · weight + bias)`; `params` is the
// weight's row, then the bias's (`[2, hidden]`).
template <typename T>
__device__ void embeddings_forward(const float* words, const float* types, const float* positions,
                                   const uint32_t* word_rows, const uint32_t* type_rows,
                                   const uint32_t* position_rows, const T* params, T* y, int rows,
                                   int hidden, float eps, Dropout d, const uint32_t* places,
                                   int seq) {
    constexpr int N = Vec16<T>::N, P = EMBED_LANE_ELEMENTS / N;
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5, pieces = hidden / N;
    for (int r = blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += gridDim.x * warps) {
        float v[P][N], mean, rstd;
        const uint64_t line = embed_row<N, P>(words, types, positions, word_rows, type_rows,
                                              position_rows, r, hidden, eps, d, places, seq, v,
                                              mean, rstd);
        const size_t at = (size_t)r * hidden;
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const int q = lane + 32 * i;
            if (q < pieces) {
                float w[N], b[N], out[N];
                load_vec16(params + q * N, w);
                load_vec16(params + hidden + q * N, b);
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    out[k] = (v[i][k] - mean) * rstd * w[k] + b[k];
                    if (d.on) out[k] *= keep_factor(d, line, q * N + k);
                }
                store_vec16(y + at + q * N, out);
            }
        }
    }
}

// The backward: the sum's gradient (`grad_sum`, f32 `[rows, hidden]`) and the block's partial
// sums of the weight's and the bias's gradients (`partial`, `[gridDim.x, 2, hidden]`, summed by
// `column_sums_lanes`): a lane's columns are the same at every row, so it sums them in registers; the
// block's warps add theirs in warp order (the same bits at every run).
template <typename T>
__device__ void embeddings_backward(const float* words, const float* types,
                                    const float* positions, const uint32_t* word_rows,
                                    const uint32_t* type_rows, const uint32_t* position_rows,
                                    const T* params, const T* grad, float* grad_sum,
                                    float* partial, int rows, int hidden, float eps, Dropout d,
                                    const uint32_t* places, int seq) {
    constexpr int N = Vec16<T>::N, P = EMBED_LANE_ELEMENTS / N;
    __shared__ float sums[2 * 32 * EMBED_LANE_ELEMENTS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int pieces = hidden / N;
    float grad_weight[P][N], grad_bias[P][N];
#pragma unroll
    for (int i = 0; i < P; ++i)
#pragma unroll
        for (int k = 0; k < N; ++k) grad_weight[i][k] = grad_bias[i][k] = 0.0f;
    for (int r = blockIdx.x * warps + warp; r < rows; r += gridDim.x * warps) {
        float v[P][N], mean, rstd;
        const uint64_t line = embed_row<N, P>(words, types, positions, word_rows, type_rows,
                                              position_rows, r, hidden, eps, d, places, seq, v,
                                              mean, rstd);
        const size_t at = (size_t)r * hidden;
        // `v` becomes the normalised row, `g` the gradient through the dropout times the
        // weight (the normalised row's gradient).
        float g[P][N];
        float a = 0.0f, b = 0.0f;
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const int q = lane + 32 * i;
#pragma unroll
            for (int k = 0; k < N; ++k) g[i][k] = 0.0f;
            if (q < pieces) {
                float w[N], gy[N];
                load_vec16(params + q * N, w);
                load_vec16(grad + at + q * N, gy);
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    if (d.on) gy[k] *= keep_factor(d, line, q * N + k);
                    v[i][k] = (v[i][k] - mean) * rstd;
                    grad_weight[i][k] += gy[k] * v[i][k];
                    grad_bias[i][k] += gy[k];
                    g[i][k] = gy[k] * w[k];
                    a += g[i][k];
                    b += g[i][k] * v[i][k];
                }
            }
        }
        a = warp_sum(a) / hidden;
        b = warp_sum(b) / hidden;
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const int q = lane + 32 * i;
            if (q < pieces) {
#pragma unroll
                for (int h = 0; h < N / 4; ++h) {
                    float ds[4];
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        const int e = 4 * h + k;
                        ds[k] = rstd * (g[i][e] - a - v[i][e] * b);
                    }
                    uint4 raw;
                    memcpy(&raw, ds, sizeof raw);
                    *reinterpret_cast<uint4*>(grad_sum + at + (size_t)q * N + 4 * h) = raw;
                }
            }
        }
    }
    // The block's sums: each warp adds its lanes' in turn.
    for (int w = 0; w < warps; ++w) {
        if (warp == w) {
#pragma unroll
            for (int i = 0; i < P; ++i) {
                const int q = lane + 32 * i;
                if (q < pieces) {
#pragma unroll
                    for (int k = 0; k < N; ++k) {
                        const int j = q * N + k;
                        sums[j] = w == 0 ? grad_weight[i][k] : sums[j] + grad_weight[i][k];
                        sums[hidden + j] =
                            w == 0 ? grad_bias[i][k] : sums[hidden + j] + grad_bias[i][k];
                    }
                }
            }
        }
        __syncthreads();
    }
    float* mine = partial + (size_t)blockIdx.x * 2 * hidden;
    for (int j = threadIdx.x; j < 2 * hidden; j += blockDim.x) mine[j] = sums[j];
}

// ---------------------------------------------------------------------------------------------
// Entry points, one per dtype.

// A LayerNorm form's two entry points, `NAME_forward_SUFFIX` and `NAME_backward_SUFFIX`, on
// its bodies `NAME_forward<T>` and `NAME_backward<T>` (the same arguments for every form).
#define NORM_ENTRIES(NAME, T, SUFFIX)                                                           \
    extern "C" __global__ void NAME##_forward_##SUFFIX(                                         \
        const T* x, const T* residual, const T* weight, const T* bias, T* y, int rows,          \
        int hidden, float eps, Dropout d, const uint32_t* places, int seq) {                    \
        NAME##_forward<T>(x, residual, weight, bias, y, rows, hidden, eps, d, places, seq);     \
    }                                                                                           \
    extern "C" __global__ void NAME##_backward_##SUFFIX(                                        \
        const T* x, const T* residual, const T* weight, const T* grad, T* grad_sum, T* grad_x,  \
        float* partial, int rows, int hidden, float eps, Dropout d, const uint32_t* places,     \
        int seq) {                                                                              \
        NAME##_backward<T>(x, residual, weight, grad, grad_sum, grad_x, partial, rows, hidden,  \
                           eps, d, places, seq);                                                \
    }

#define ENTRY_POINTS(T, SUFFIX)                                                                   \
    NORM_ENTRIES(layer_norm, T, SUFFIX)                                                         \
    NORM_ENTRIES(layer_norm_vec, T, SUFFIX)                                                     \
    extern "C" __global__ void __launch_bounds__(256, 3) layer_norm_vec_backward_ahead_##SUFFIX( \
        const T* x, const T* residual, const T* weight, const T* grad, T* grad_sum, T* grad_x,  \
        float* partial, int rows, int hidden, float eps, Dropout d, const uint32_t* places,     \
        int seq) {                                                                              \
        layer_norm_vec_backward<T, true>(x, residual, weight, grad, grad_sum, grad_x, partial,  \
                                         rows, hidden, eps, d, places, seq);                    \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * NORM_WARP_BACKWARD_WARPS, 5)            \
        layer_norm_warp_backward_##SUFFIX(                                                      \
            const T* x, const T* residual, const T* weight, const T* grad, T* grad_sum,         \
            T* grad_x, float* partial, int rows, int hidden, float eps, Dropout d,              \
            const uint32_t* places, int seq) {                                                  \
        layer_norm_warp_backward<T>(x, residual, weight, grad, grad_sum, grad_x, partial, rows, \
                                    hidden, eps, d, places, seq);                               \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * NORM_WARP_BACKWARD_WARPS, 5)            \
        layer_norm_warp_backward_bits_##SUFFIX(                                                 \
            const T* x, const T* residual, const T* weight, const T* grad, T* grad_sum,         \
            T* grad_x, float* partial, int rows, int hidden, float eps, Dropout d,              \
            const uint32_t* places, int seq, const uint8_t* keep) {                             \
        layer_norm_warp_backward<T, true>(x, residual, weight, grad, grad_sum, grad_x, partial, \
                                          rows, hidden, eps, d, places, seq, keep);             \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(128, 6) layer_norm_warp_forward_##SUFFIX(       \
        const T* x, const T* residual, const T* weight, const T* bias, T* y, int rows,          \
        int hidden, float eps, Dropout d, const uint32_t* places, int seq) {                    \
        layer_norm_warp_forward<T>(x, residual, weight, bias, y, rows, hidden, eps, d, places,  \
                                   seq);                                                        \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(128, 6) layer_norm_warp_forward_bits_##SUFFIX( \
        const T* x, const T* residual, const T* weight, const T* bias, T* y, int rows,          \
        int hidden, float eps, Dropout d, const uint32_t* places, int seq, uint8_t* keep) {     \
        layer_norm_warp_forward<T, true>(x, residual, weight, bias, y, rows, hidden, eps, d,    \
                                         places, seq, keep);                                    \
    }                                                                                           \
    extern "C" __global__ void column_sums_lanes_##SUFFIX(const float* partial, T* out,          \
                                                          int parts, int cols) {                \
        column_sums_lanes<T>(partial, out, parts, cols);                                        \
    }                                                                                           \
    extern "C" __global__ void bias_act_forward_##SUFFIX(const T* y, const T* bias, T* out,      \
                                                         int rows, int cols, int act) {         \
        bias_act_forward<T>(y, bias, out, rows, cols, act);                                     \
    }                                                                                           \
    extern "C" __global__ void bias_act_backward_##SUFFIX(const T* y, const T* bias,             \
                                                          const T* grad, T* grad_y,             \
                                                          float* partial, int rows, int cols,   \
                                                          int act) {                            \
        bias_act_backward<T>(y, bias, grad, grad_y, partial, rows, cols, act);                  \
    }                                                                                           \
    extern "C" __global__ void bias_act_rows_forward_##SUFFIX(const T* y, const T* bias, T* out, \
                                                              int rows, int cols, int act) {    \
        bias_act_rows_forward<T>(y, bias, out, rows, cols, act);                                \
    }                                                                                           \
    /* Blocks of BIAS_SUMS_THREADS: bounded, ptxas keeps a thread's four loads ahead (40    \
       registers; unbounded it holds 32 and issues them two by two). */                       \
    extern "C" __global__ void __launch_bounds__(BIAS_SUMS_THREADS)                            \
        bias_sums_vec_##SUFFIX(const T* grad, float* partial, int rows, int cols) {             \
        bias_sums_vec<T>(grad, partial, rows, cols);                                            \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(BIAS_SUMS_THREADS)                            \
        bias_act_sums_vec_##SUFFIX(const T* y, const T* bias, const T* grad, T* grad_y,        \
                                   float* partial, int rows, int cols, int act) {               \
        bias_sums_vec<T, true>(grad, partial, rows, cols, y, bias, grad_y, act);                \
    }                                                                                           \
    extern "C" __global__ void tokens_to_heads_##SUFFIX(const T* src, T* dst,                    \
                                                        const uint32_t* scatter, int tokens,    \
                                                        int batch, int seq, int heads,          \
                                                        int head, int parts) {                  \
        tokens_to_heads<T>(src, dst, scatter, tokens, batch, seq, heads, head, parts);          \
    }                                                                                           \
    extern "C" __global__ void heads_to_tokens_##SUFFIX(                                         \
        const T* src0, const T* src1, const T* src2, T* dst, const uint32_t* gather,            \
        int tokens, int seq, int heads, int head, int parts) {                                  \
        heads_to_tokens<T>(src0, src1, src2, dst, gather, tokens, seq, heads, head, parts);     \
    }                                                                                           \
    extern "C" __global__ void attention_softmax_forward_##SUFFIX(                               \
        const T* scores, T* probs, const uint32_t* scatter, int tokens, int batch, int heads,   \
        int seq, float scale, Dropout d) {                                                      \
        attention_softmax_forward<T>(scores, probs, scatter, tokens, batch, heads, seq, scale,  \
                                     d);                                                        \
    }                                                                                           \
    extern "C" __global__ void gather_rows_##SUFFIX(const T* table, const uint32_t* rows, T* out,  \
                                                    int tokens, int cols) {                     \
        gather_rows<T>(table, rows, out, tokens, cols);                                         \
    }                                                                                           \
    extern "C" __global__ void keyed_dropout_##SUFFIX(const T* x, T* out, int rows, int width,   \
                                                      Dropout d, const uint32_t* places,        \
                                                      int seq) {                                \
        keyed_dropout<T>(x, out, rows, width, d, places, seq);                                  \
    }                                                                                           \
    extern "C" __global__ void embeddings_forward_##SUFFIX(                                      \
        const float* words, const float* types, const float* positions,                        \
        const uint32_t* word_rows, const uint32_t* type_rows, const uint32_t* position_rows,    \
        const T* params, T* y, int rows, int hidden, float eps, Dropout d,                      \
        const uint32_t* places, int seq) {                                                      \
        embeddings_forward<T>(words, types, positions, word_rows, type_rows, position_rows,     \
                              params, y, rows, hidden, eps, d, places, seq);                    \
    }                                                                                           \
    extern "C" __global__ void embeddings_backward_##SUFFIX(                                     \
        const float* words, const float* types, const float* positions,                        \
        const uint32_t* word_rows, const uint32_t* type_rows, const uint32_t* position_rows,    \
        const T* params, const T* grad, float* grad_sum, float* partial, int rows, int hidden,  \
        float eps, Dropout d, const uint32_t* places, int seq) {                                \
        embeddings_backward<T>(words, types, positions, word_rows, type_rows, position_rows,    \
                               params, grad, grad_sum, partial, rows, hidden, eps, d, places,   \
                               seq);                                                            \
    }                                                                                           \
    extern "C" __global__ void add_tensors_##SUFFIX(const T* a, const T* b, T* out, size_t n) {   \
        add_tensors<T>(a, b, out, n);                                                           \
    }                                                                                           \
    extern "C" __global__ void gather_rows_backward_pieces_##SUFFIX(                             \
        const T* grad, const uint32_t* order, const uint32_t* piece_starts, float* partial,     \
        int pieces, int cols) {                                                                 \
        gather_rows_backward_pieces<T>(grad, order, piece_starts, partial, pieces, cols);       \
    }                                                                                           \
    extern "C" __global__ void gather_rows_backward_rows_##SUFFIX(                               \
        const float* partial, const uint32_t* row_pieces, const uint32_t* distinct,             \
        T* grad_table, int groups, int cols) {                                                  \
        gather_rows_backward_rows<T>(partial, row_pieces, distinct, grad_table, groups, cols);  \
    }                                                                                           \
    extern "C" __global__ void attention_softmax_backward_##SUFFIX(                              \
        const T* scores, const T* grad_probs, T* grad_scores, const uint32_t* scatter,          \
        int tokens, int batch, int heads, int seq, float scale, Dropout d) {                    \
        attention_softmax_backward<T>(scores, grad_probs, grad_scores, scatter, tokens, batch,  \
                                      heads, seq, scale, d);                                    \
    }

ENTRY_POINTS(float, f32)
ENTRY_POINTS(bf16, bf16)
// Half precision for GPUs without bf16 (before compute capability 8.0): fp16 runs.
ENTRY_POINTS(f16, f16)

// ---------------------------------------------------------------------------------------------
// Attention in one pass over key tiles (bf16, tensor cores): its own file, the helpers above.

#include "flash.cu"
#include "flash_registers.cu"

// ---------------------------------------------------------------------------------------------
// The masked-LM and classification losses: their own file, the helpers above.

#include "loss.cu"
