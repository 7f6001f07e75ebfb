// The CPU emulation's `mma.h` (see emulation.h): the `nvcuda::wmma` 16x16x16 fragments the
// kernels use. Each emulated thread holds the whole tile (the real element-to-lane mapping is
// opaque to the kernels, which only load, multiply, fill and store fragments); loads read the
// whole tile, products are computed in f32 as the tensor cores accumulate, and a store is
// written by lane 0 (the kernels synchronise the warp before reading what a store wrote).
#pragma once
#include <cuda_bf16.h>
#include <type_traits>

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
    float x[16 * 16];
};

template <typename Use, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) {
            // matrix_a: (row r, column c); matrix_b: (k = r, n = c).
            const T v = std::is_same<Layout, col_major>::value ? p[c * ldm + r] : p[r * ldm + c];
            f.x[r * 16 + c] = __bfloat162float(v);
        }
}

template <typename T>
inline void fill_fragment(fragment<accumulator, 16, 16, 16, T>& f, float v) {
    for (float& x : f.x) x = v;
}

template <typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                     const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c) {
    float out[256];
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) {
            float s = c.x[i * 16 + j];
            for (int k = 0; k < 16; ++k) s += a.x[i * 16 + k] * b.x[k * 16 + j];
            out[i * 16 + j] = s;
        }
    for (int i = 0; i < 256; ++i) d.x[i] = out[i];
}


inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout) {
    if (::emulated_lane() == 0)
        for (int r = 0; r < 16; ++r)
            for (int c = 0; c < 16; ++c)
                (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[r * 16 + c];
}

}  // namespace wmma
}  // namespace nvcuda
