// LayerNorm and a sublayer's end on CUDA (`norm.rs`), and the 16-byte helpers the other
// kernels share: included by `kernels.cu` in its place (after `common.cuh`).

// ---------------------------------------------------------------------------------------------
// LayerNorm, with an optional residual and dropout before it (a sublayer's end).
//
// A block per row (rows strided over the grid); the row's input, `dropout(x) + residual`, is
// kept in shared memory as f32, so the mean and the (biased) variance are two passes over it.

// The row's input into `row` (shared), from `x`, `residual` (or null) and the dropout of the
// token `r` whose place in the padded batch is `places[r]` (`row · seq + column`).
template <typename T>
__device__ void load_sum_row(const T* x, const T* residual, int r, int hidden, const Dropout& d,
                             const uint32_t* places, int seq, float* row) {
    const size_t at = (size_t)r * hidden;
    uint64_t line = 0;
    if (d.on) {
        const uint32_t place = places[r];
        line = line_key(row_key(d, place / seq), place % seq);
    }
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
        float v = to_f32(x[at + j]);
        if (d.on) v *= keep_factor(d, line, j);
        if (residual) v += to_f32(residual[at + j]);
        row[j] = v;
    }
}

template <typename T>
__device__ void layer_norm_forward(const T* x, const T* residual, const T* weight, const T* bias,
                                   T* y, int rows, int hidden, float eps, Dropout d,
                                   const uint32_t* places, int seq) {
    DYNAMIC_SHARED(float, shared);
    float* row = shared;
    float* scratch = shared + hidden;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        load_sum_row(x, residual, r, hidden, d, places, seq, row);
        float s = 0.0f;
        for (int j = threadIdx.x; j < hidden; j += blockDim.x) s += row[j];
        const float mean = block_sum(s, scratch) / hidden;
        float q = 0.0f;
        for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
            const float c = row[j] - mean;
            q += c * c;
        }
        const float rstd = rsqrtf(block_sum(q, scratch) / hidden + eps);
        const size_t at = (size_t)r * hidden;
        for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
            y[at + j] = from_f32<T>((row[j] - mean) * rstd * to_f32(weight[j]) + to_f32(bias[j]));
        }
    }
}

// The backward: the gradient of the sum (`grad_sum`: the residual's, and `x`'s without
// dropout), `x`'s through the dropout (`grad_x`, or null), and per-block partial sums of the
// weight's and the bias's gradients (`partial`, `[gridDim.x, 2, hidden]`, summed by
// `column_sums_lanes`). The row's statistics are recomputed, not stored.
template <typename T>
__device__ void layer_norm_backward(const T* x, const T* residual, const T* weight, const T* grad,
                                    T* grad_sum, T* grad_x, float* partial, int rows, int hidden,
                                    float eps, Dropout d, const uint32_t* places, int seq) {
    DYNAMIC_SHARED(float, shared);
    float* row = shared;
    float* grad_weight = shared + hidden;
    float* grad_bias = shared + 2 * hidden;
    float* scratch = shared + 3 * hidden;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
        grad_weight[j] = 0.0f;
        grad_bias[j] = 0.0f;
    }
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        load_sum_row(x, residual, r, hidden, d, places, seq, row);
        float s = 0.0f;
        for (int j = threadIdx.x; j < hidden; j += blockDim.x) s += row[j];
        const float mean = block_sum(s, scratch) / hidden;
        float q = 0.0f;
        for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
            const float c = row[j] - mean;
            q += c * c;
        }
        const float rstd = rsqrtf(block_sum(q, scratch) / hidden + eps);
        const size_t at = (size_t)r * hidden;
        float a = 0.0f, b = 0.0f;
        for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
            const float normed = (row[j] - mean) * rstd;
            const float g = to_f32(grad[at + j]);
            const float dn = g * to_f32(weight[j]);
            a += dn;
            b += dn * normed;
            grad_weight[j] += g * normed;
            grad_bias[j] += g;
        }
        a = block_sum(a, scratch) / hidden;
        b = block_sum(b, scratch) / hidden;
        uint64_t line = 0;
        if (grad_x && d.on) {
            const uint32_t place = places[r];
            line = line_key(row_key(d, place / seq), place % seq);
        }
        for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
            const float normed = (row[j] - mean) * rstd;
            const float dn = to_f32(grad[at + j]) * to_f32(weight[j]);
            const float ds = rstd * (dn - a - normed * b);
            grad_sum[at + j] = from_f32<T>(ds);
            if (grad_x) grad_x[at + j] = from_f32<T>(d.on ? ds * keep_factor(d, line, j) : ds);
        }
    }
    float* mine = partial + (size_t)blockIdx.x * 2 * hidden;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
        mine[j] = grad_weight[j];
        mine[hidden + j] = grad_bias[j];
    }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm 16 bytes a thread (`norm.rs`): the same sums as above,
// a block per row still, but each thread holds 16 bytes of the row (8 bf16 or f16, 4 f32) in
// registers, read and written with one 16-byte access each, where the kernels above read and
// write an element at a time and keep the row in shared memory. Rows of `hidden` a multiple of
// the thread's elements, at most 1,024 threads (the launcher checks, and the alignment of every
// row). The backward sums its `a` and `b` in one block-wide pass, reuses the forward's dropout
// keeps (drawn once a row, not twice), and keeps the weight's and bias's partial sums in
// registers.

// Elements of 16 bytes.
template <typename T>
struct Vec16 {
    static constexpr int N = 16 / (int)sizeof(T);
};

// A 16-byte piece as loaded, widened to f32.
template <typename T>
__device__ __forceinline__ void unpack_vec16(uint4 raw, float (&v)[Vec16<T>::N]) {
    T e[Vec16<T>::N];
    memcpy(e, &raw, sizeof raw);
#pragma unroll
    for (int k = 0; k < Vec16<T>::N; ++k) v[k] = to_f32(e[k]);
}

template <typename T>
__device__ __forceinline__ void load_vec16(const T* p, float (&v)[Vec16<T>::N]) {
    unpack_vec16<T>(*reinterpret_cast<const uint4*>(p), v);
}

template <typename T>
__device__ __forceinline__ void store_vec16(T* p, const float (&v)[Vec16<T>::N]) {
    T e[Vec16<T>::N];
#pragma unroll
    for (int k = 0; k < Vec16<T>::N; ++k) e[k] = from_f32<T>(v[k]);
    uint4 raw;
    memcpy(&raw, e, sizeof raw);
    *reinterpret_cast<uint4*>(p) = raw;
}

// Whether every pointer starts on a 16-byte boundary.
template <typename... P>
__device__ __forceinline__ bool aligned16(const P*... p) {
    return ((reinterpret_cast<uintptr_t>(p) | ...) & 15) == 0;
}

// The grid's threads strided over `n` elements of `T` 16 bytes at a time where `aligned`
// (`piece(v)` for each whole piece `v`, `Vec16<T>::N` elements), then an element at a time
// (`element(i)`) from the first no piece covered up to `end` (`n`, or beyond it for what a
// kernel writes past its input).
template <typename T, typename Piece, typename Element>
__device__ __forceinline__ void grid_pieces(size_t n, size_t end, bool aligned, Piece piece,
                                            Element element) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t pieces = aligned ? n / Vec16<T>::N : 0;
    for (size_t v = first; v < pieces; v += stride) piece(v);
    for (size_t i = pieces * Vec16<T>::N + first; i < end; i += stride) element(i);
}

// Two sums over the block at once, returned to every thread; `scratch` holds 64 floats.
__device__ __forceinline__ void block_sum2(float& a, float& b, float* scratch) {
    a = warp_sum(a);
    b = warp_sum(b);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = a;
        scratch[32 + warp] = b;
    }
    __syncthreads();
    a = warp_sum(lane < warps ? scratch[lane] : 0.0f);
    b = warp_sum(lane < warps ? scratch[32 + lane] : 0.0f);
}

// The dropout of this thread's elements of row `r` (`v`, from element `j0`) in place; bit k of
// the result which it kept.
template <int N>
__device__ __forceinline__ uint32_t drop_vec(float (&v)[N], int r, int j0, const Dropout& d,
                                             const uint32_t* places, int seq) {
    uint32_t kept = (1u << N) - 1;
    if (d.on) {
        const uint32_t place = places[r];
        const uint64_t line = line_key(row_key(d, place / seq), place % seq);
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const float f = keep_factor(d, line, j0 + k);
            if (f == 0.0f) kept &= ~(1u << k);
            v[k] *= f;
        }
    }
    return kept;
}

// This thread's elements of row `r`'s input, `dropout(x) + residual`, and (bit k of the result)
// which the dropout kept. Threads past the row's end hold zeros.
template <typename T>
__device__ __forceinline__ uint32_t load_sum_vec(const T* x, const T* residual, int r, int hidden,
                                                 const Dropout& d, const uint32_t* places,
                                                 int seq, float (&v)[Vec16<T>::N]) {
    constexpr int N = Vec16<T>::N;
    const int j0 = threadIdx.x * N;
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = 0.0f;
    if (j0 >= hidden) return (1u << N) - 1;
    const size_t at = (size_t)r * hidden + j0;
    load_vec16(x + at, v);
    const uint32_t kept = drop_vec(v, r, j0, d, places, seq);
    if (residual) {
        float rv[N];
        load_vec16(residual + at, rv);
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] += rv[k];
    }
    return kept;
}

// The row's mean and 1 / sqrt(variance + eps) from each thread's elements (two passes).
template <int N>
__device__ __forceinline__ void row_statistics(const float (&v)[N], int hidden, float eps,
                                               bool active, float* scratch, float& mean,
                                               float& rstd) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) s += v[k];
    mean = block_sum(s, scratch) / hidden;
    float q = 0.0f;
    if (active) {
#pragma unroll
        for (int k = 0; k < N; ++k) q += (v[k] - mean) * (v[k] - mean);
    }
    rstd = rsqrtf(block_sum(q, scratch) / hidden + eps);
}

template <typename T>
__device__ void layer_norm_vec_forward(const T* x, const T* residual, const T* weight,
                                       const T* bias, T* y, int rows, int hidden, float eps,
                                       Dropout d, const uint32_t* places, int seq) {
    constexpr int N = Vec16<T>::N;
    __shared__ float scratch[64];
    const int j0 = threadIdx.x * N;
    const bool active = j0 < hidden;
    float w[N], b[N];
    if (active) {
        load_vec16(weight + j0, w);
        load_vec16(bias + j0, b);
    }
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        float v[N];
        load_sum_vec(x, residual, r, hidden, d, places, seq, v);
        float mean, rstd;
        row_statistics(v, hidden, eps, active, scratch, mean, rstd);
        if (active) {
            float out[N];
#pragma unroll
            for (int k = 0; k < N; ++k) out[k] = (v[k] - mean) * rstd * w[k] + b[k];
            store_vec16(y + (size_t)r * hidden + j0, out);
        }
    }
}

// The forward a warp per row (`norm.rs`, rows of up to WARP_ROW_PIECES pieces a lane): a lane
// holds up to WARP_ROW_PIECES 16-byte pieces of the row (lane, lane + 32, ...: each of its
// loads of `x` and `residual` in flight at once), the row's statistics are warp sums
// (shuffles, no block-wide barrier), and the weight and bias are read where a piece needs them
// (from the cache) rather than held, where a block a row waits on its loads, then on four
// barriers, once a row. The same sums in another order (the mean, then the squares about it).
#define WARP_ROW_PIECES 4

// A row's mean and 1 / sqrt(variance + eps) over the warp whose lanes hold its pieces `lane`,
// `lane + 32`, ... as `v` (zeros past the row's end): the mean, then the squares about it.
template <int N, int P>
__device__ __forceinline__ void warp_row_statistics(const float (&v)[P][N], int hidden,
                                                    float eps, float& mean, float& rstd) {
    const int lane = threadIdx.x & 31, pieces = hidden / N;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < P; ++i)
#pragma unroll
        for (int k = 0; k < N; ++k) s += v[i][k];
    mean = warp_sum(s) / hidden;
    float sq = 0.0f;
#pragma unroll
    for (int i = 0; i < P; ++i) {
        if (lane + 32 * i < pieces) {
#pragma unroll
            for (int k = 0; k < N; ++k) sq += (v[i][k] - mean) * (v[i][k] - mean);
        }
    }
    rstd = rsqrtf(warp_sum(sq) / hidden + eps);
}

// `Bits` (with dropout): each piece's keeps written to
// `keep` as a byte, `[rows, pieces]` (bit k: the piece's element k kept), for the backward to
// read where it would draw them again.
template <typename T, bool Bits = false>
__device__ void layer_norm_warp_forward(const T* x, const T* residual, const T* weight,
                                        const T* bias, T* y, int rows, int hidden, float eps,
                                        Dropout d, const uint32_t* places, int seq,
                                        uint8_t* keep = nullptr) {
    constexpr int N = Vec16<T>::N, P = WARP_ROW_PIECES;
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int pieces = hidden / N;
    for (int r = blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += gridDim.x * warps) {
        const size_t at = (size_t)r * hidden;
        // Every load of the row first (16 bytes each, as they are), then each piece's elements
        // with the dropout and the residual.
        uint4 xs[P], rs[P];
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const int q = lane + 32 * i;
            xs[i] = rs[i] = make_uint4(0, 0, 0, 0);
            if (q < pieces) {
                xs[i] = *reinterpret_cast<const uint4*>(x + at + q * N);
                if (residual) rs[i] = *reinterpret_cast<const uint4*>(residual + at + q * N);
            }
        }
        uint64_t line = 0;
        if (d.on) {
            const uint32_t place = places[r];
            line = line_key(row_key(d, place / seq), place % seq);
        }
        float v[P][N];
#pragma unroll
        for (int i = 0; i < P; ++i) {
            T xe[N], re[N];
            memcpy(xe, &xs[i], sizeof xe);
            memcpy(re, &rs[i], sizeof re);
            const int q = lane + 32 * i;
            uint32_t kept = 0;
#pragma unroll
            for (int k = 0; k < N; ++k) {
                v[i][k] = to_f32(xe[k]);
                if (d.on && q < pieces) {
                    const float f = keep_factor(d, line, q * N + k);
                    if constexpr (Bits) kept |= (uint32_t)(f != 0.0f) << k;
                    v[i][k] *= f;
                }
                v[i][k] += to_f32(re[k]);
            }
            if constexpr (Bits) {
                if (d.on && q < pieces) keep[(size_t)r * pieces + q] = (uint8_t)kept;
            }
        }
        float mean, rstd;
        warp_row_statistics<N, P>(v, hidden, eps, mean, rstd);
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const int q = lane + 32 * i;
            if (q < pieces) {
                float w[N], b[N], out[N];
                load_vec16(weight + q * N, w);
                load_vec16(bias + q * N, b);
#pragma unroll
                for (int k = 0; k < N; ++k) out[k] = (v[i][k] - mean) * rstd * w[k] + b[k];
                store_vec16(y + at + q * N, out);
            }
        }
    }
}

// A thread's 16-byte pieces of a row's input, residual and output gradient, as loaded: the
// backward ahead loads all three at the row's start and
// widens the gradient only where it is used, after the statistics.
struct NormPieces {
    uint4 x, residual, grad;
};

// This thread's pieces of row `r` (nothing past the row's end; no residual without one).
template <typename T>
__device__ __forceinline__ void load_norm_pieces(NormPieces& p, const T* x, const T* residual,
                                                 const T* grad, int r, int hidden) {
    const int j0 = threadIdx.x * Vec16<T>::N;
    if (j0 >= hidden) return;
    const size_t at = (size_t)r * hidden + j0;
    p.x = *reinterpret_cast<const uint4*>(x + at);
    if (residual) p.residual = *reinterpret_cast<const uint4*>(residual + at);
    p.grad = *reinterpret_cast<const uint4*>(grad + at);
}

// The backward, as `layer_norm_backward`'s outputs: `partial` is `[gridDim.x, 2, hidden]`.
// `Ahead` (rows of up to 256 pieces, the launch bounds' threads): each row's input, residual
// and gradient loaded at once at the row's start, where without it the input and residual are
// loaded there and the gradient only after the two statistics' block-wide sums: one trip to
// memory a row, not two that nothing overlaps. (Loading the next row's during this one's
// needed 99 registers, or spilled the pieces under the launch bounds.) The same arithmetic in
// the same order: the same bits.
template <typename T, bool Ahead = false>
__device__ void layer_norm_vec_backward(const T* x, const T* residual, const T* weight,
                                        const T* grad, T* grad_sum, T* grad_x, float* partial,
                                        int rows, int hidden, float eps, Dropout d,
                                        const uint32_t* places, int seq) {
    constexpr int N = Vec16<T>::N;
    __shared__ float scratch[64];
    const int j0 = threadIdx.x * N;
    const bool active = j0 < hidden;
    float w[N], grad_weight[N], grad_bias[N];
#pragma unroll
    for (int k = 0; k < N; ++k) grad_weight[k] = grad_bias[k] = 0.0f;
    if (active) load_vec16(weight + j0, w);
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        float v[N];
        uint32_t kept;
        NormPieces now{};  // (zeros where a thread past the row's end loads nothing)
        if constexpr (Ahead) {
            load_norm_pieces(now, x, residual, grad, r, hidden);
            // (As `load_sum_vec`: zeros and every bit kept past the row's end.)
#pragma unroll
            for (int k = 0; k < N; ++k) v[k] = 0.0f;
            kept = (1u << N) - 1;
            if (active) {
                unpack_vec16<T>(now.x, v);
                kept = drop_vec(v, r, j0, d, places, seq);
                if (residual) {
                    float rv[N];
                    unpack_vec16<T>(now.residual, rv);
#pragma unroll
                    for (int k = 0; k < N; ++k) v[k] += rv[k];
                }
            }
        } else {
            kept = load_sum_vec(x, residual, r, hidden, d, places, seq, v);
        }
        float mean, rstd;
        row_statistics(v, hidden, eps, active, scratch, mean, rstd);
        const size_t at = (size_t)r * hidden + j0;
        float g[N], normed[N], dn[N];
        float a = 0.0f, b = 0.0f;
        if (active) {
            if constexpr (Ahead) {
                unpack_vec16<T>(now.grad, g);
            } else {
                load_vec16(grad + at, g);
            }
#pragma unroll
            for (int k = 0; k < N; ++k) {
                normed[k] = (v[k] - mean) * rstd;
                dn[k] = g[k] * w[k];
                a += dn[k];
                b += dn[k] * normed[k];
                grad_weight[k] += g[k] * normed[k];
                grad_bias[k] += g[k];
            }
        }
        block_sum2(a, b, scratch);
        a /= hidden;
        b /= hidden;
        if (active) {
            float ds[N];
#pragma unroll
            for (int k = 0; k < N; ++k) ds[k] = rstd * (dn[k] - a - normed[k] * b);
            store_vec16(grad_sum + at, ds);
            if (grad_x) {
                if (d.on) {
#pragma unroll
                    for (int k = 0; k < N; ++k) ds[k] *= (kept >> k) & 1u ? d.scale : 0.0f;
                }
                store_vec16(grad_x + at, ds);
            }
        }
    }
    if (active) {
        float* mine = partial + (size_t)blockIdx.x * 2 * hidden;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            mine[j0 + k] = grad_weight[k];
            mine[hidden + j0 + k] = grad_bias[k];
        }
    }
}

// The backward a warp per row (`norm.rs`), the forward a warp per row's twin: a lane loads its
// pieces `lane`, `lane + 32`, ... of the row's input, residual and output gradient at once, the
// four sums a row (the statistics, then `a` and `b`) are warp sums, and each warp adds its
// rows' parts of the weight's and bias's gradients into its own slice of the block's shared
// memory, which the block adds in warp order into `partial` (`[gridDim.x, 2, hidden]`, as
// `layer_norm_vec_backward`'s), where a block a row makes four block-wide sums a row (two
// barriers each) between its loads and its stores. (Held in registers, a lane's parameter sums
// took 64 of them: 165 in all, three blocks an SM; in shared memory, laid out lane by lane in
// 16-byte pieces, they cost a load and a store of 16 bytes each a piece of a row.) The same
// arithmetic by element; the row's sums and the parameters' in another order. `Bits`: the
// forward's keep bytes, as `layer_norm_vec_backward`'s.
#define NORM_WARP_BACKWARD_WARPS 4

// The place of element `k` of piece `i` of lane `lane` in a warp's slice of parameter sums
// (`[2][P][N / 4][32 lanes][4]`: a lane's 16-byte accesses side by side, no bank conflicts),
// for the weight's (`which` 0) or the bias's (1).
template <int N, int P>
__device__ __forceinline__ int norm_sums_place(int which, int i, int k, int lane) {
    return ((which * P + i) * (N / 4) + k / 4) * 128 + lane * 4 + (k & 3);
}

template <typename T, bool Bits = false>
__device__ void layer_norm_warp_backward(const T* x, const T* residual, const T* weight,
                                         const T* grad, T* grad_sum, T* grad_x, float* partial,
                                         int rows, int hidden, float eps, Dropout d,
                                         const uint32_t* places, int seq,
                                         const uint8_t* keep = nullptr) {
    constexpr int N = Vec16<T>::N, P = WARP_ROW_PIECES, W = NORM_WARP_BACKWARD_WARPS;
    constexpr int SLICE = 2 * P * 32 * N;
    __shared__ __align__(16) float warp_sums[W * SLICE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int pieces = hidden / N;
    float* mine = warp_sums + warp * SLICE;
    for (int j = lane; j < SLICE; j += 32) mine[j] = 0.0f;
    __syncwarp();
    for (int r = blockIdx.x * W + warp; r < rows; r += gridDim.x * W) {
        const size_t at = (size_t)r * hidden;
        uint4 xs[P], rs[P], gs[P];
        uint32_t kept[P];
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const int q = lane + 32 * i;
            xs[i] = rs[i] = gs[i] = make_uint4(0, 0, 0, 0);
            kept[i] = (1u << N) - 1;
            if (q < pieces) {
                xs[i] = *reinterpret_cast<const uint4*>(x + at + q * N);
                if (residual) rs[i] = *reinterpret_cast<const uint4*>(residual + at + q * N);
                gs[i] = *reinterpret_cast<const uint4*>(grad + at + q * N);
                if constexpr (Bits) {
                    if (d.on) kept[i] = keep[(size_t)r * pieces + q];
                }
            }
        }
        uint64_t line = 0;
        if (!Bits && d.on) {
            const uint32_t place = places[r];
            line = line_key(row_key(d, place / seq), place % seq);
        }
        // The row's input, `dropout(x) + residual` (zeros past the row's end), then in place
        // its normalised values.
        float v[P][N];
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const int q = lane + 32 * i;
            float xe[N], re[N];
            unpack_vec16<T>(xs[i], xe);
            unpack_vec16<T>(rs[i], re);
#pragma unroll
            for (int k = 0; k < N; ++k) {
                v[i][k] = xe[k];
                if (d.on && q < pieces) {
                    if constexpr (Bits) {
                        v[i][k] *= (kept[i] >> k) & 1u ? d.scale : 0.0f;
                    } else {
                        const float f = keep_factor(d, line, q * N + k);
                        if (f == 0.0f) kept[i] &= ~(1u << k);
                        v[i][k] *= f;
                    }
                }
                v[i][k] += re[k];
            }
        }
        float mean, rstd;
        warp_row_statistics<N, P>(v, hidden, eps, mean, rstd);
        float a = 0.0f, b = 0.0f;
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const int q = lane + 32 * i;
            if (q < pieces) {
                float g[N], w[N];
                unpack_vec16<T>(gs[i], g);
                load_vec16(weight + q * N, w);
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    v[i][k] = (v[i][k] - mean) * rstd;
                    const float dn = g[k] * w[k];
                    a += dn;
                    b += dn * v[i][k];
                }
#pragma unroll
                for (int c = 0; c < N; c += 4) {
                    float4* gw =
                        reinterpret_cast<float4*>(mine + norm_sums_place<N, P>(0, i, c, lane));
                    float4* gb =
                        reinterpret_cast<float4*>(mine + norm_sums_place<N, P>(1, i, c, lane));
                    float4 sw = *gw, sb = *gb;
                    sw.x += g[c] * v[i][c];
                    sw.y += g[c + 1] * v[i][c + 1];
                    sw.z += g[c + 2] * v[i][c + 2];
                    sw.w += g[c + 3] * v[i][c + 3];
                    sb.x += g[c];
                    sb.y += g[c + 1];
                    sb.z += g[c + 2];
                    sb.w += g[c + 3];
                    *gw = sw;
                    *gb = sb;
                }
            }
        }
        a = warp_sum(a) / hidden;
        b = warp_sum(b) / hidden;
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const int q = lane + 32 * i;
            if (q < pieces) {
                float g[N], w[N], ds[N];
                unpack_vec16<T>(gs[i], g);
                load_vec16(weight + q * N, w);
#pragma unroll
                for (int k = 0; k < N; ++k) ds[k] = rstd * (g[k] * w[k] - a - v[i][k] * b);
                store_vec16(grad_sum + at + q * N, ds);
                if (grad_x) {
                    if (d.on) {
#pragma unroll
                        for (int k = 0; k < N; ++k) ds[k] *= (kept[i] >> k) & 1u ? d.scale : 0.0f;
                    }
                    store_vec16(grad_x + at + q * N, ds);
                }
            }
        }
    }
    // The block's sums: every column's warp sums added in warp order.
    __syncthreads();
    float* out = partial + (size_t)blockIdx.x * 2 * hidden;
    for (int j = threadIdx.x; j < 2 * hidden; j += blockDim.x) {
        const int which = j < hidden ? 0 : 1, col = j - which * hidden;
        const int q = col / N;
        const int place = norm_sums_place<N, P>(which, q / 32, col % N, q % 32);
        float s = 0.0f;
        for (int w = 0; w < W; ++w) s += warp_sums[w * SLICE + place];
        out[j] = s;
    }
}
