// The negative log-likelihood of rows of logits and its backward (`loss.rs`), the twin of the
// CPU's `NegativeLogLikelihood`: included by `kernels.cu`; `bench/gpu/emulate` also compiles
// it on the CPU against a reference.
//
// A block per row (rows strided over the grid), logits in f32 or bf16 read as they are (no f32
// copy of the `[slots, vocabulary]` logits), sums in f32. The forward keeps each row's
// log-sum-exp (`[rows]` f32) for the backward, which writes `g · (softmax(x) - onehot(label))`
// in the logits' dtype in one pass.

#include "common.cuh"

template <typename T>
__device__ void nll_forward(const T* logits, const uint32_t* labels, float* nll, float* lse,
                            int rows, int classes) {
    __shared__ float scratch[32];
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* x = logits + (size_t)r * classes;
        float m = -INFINITY;
        for (int c = threadIdx.x; c < classes; c += blockDim.x) m = fmaxf(m, to_f32(x[c]));
        m = block_max(m, scratch);
        float s = 0.0f;
        for (int c = threadIdx.x; c < classes; c += blockDim.x) s += expf(to_f32(x[c]) - m);
        s = block_sum(s, scratch);
        if (threadIdx.x == 0) {
            const float l = m + logf(s);
            lse[r] = l;
            nll[r] = l - to_f32(x[labels[r]]);
        }
    }
}

template <typename T>
__device__ void nll_backward(const T* logits, const uint32_t* labels, const float* lse,
                             const float* grad, T* grad_logits, int rows, int classes) {
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const size_t at = (size_t)r * classes;
        const float g = grad[r], l = lse[r];
        const int label = (int)labels[r];
        for (int c = threadIdx.x; c < classes; c += blockDim.x) {
            float v = g * expf(to_f32(logits[at + c]) - l);
            if (c == label) v -= g;
            grad_logits[at + c] = from_f32<T>(v);
        }
    }
}

#define NLL_ENTRY_POINTS(T, SUFFIX)                                                              \
    extern "C" __global__ void nll_forward_##SUFFIX(const T* logits, const uint32_t* labels,   \
                                                    float* nll, float* lse, int rows,          \
                                                    int classes) {                             \
        nll_forward<T>(logits, labels, nll, lse, rows, classes);                               \
    }                                                                                          \
    extern "C" __global__ void nll_backward_##SUFFIX(const T* logits, const uint32_t* labels,  \
                                                     const float* lse, const float* grad,      \
                                                     T* grad_logits, int rows, int classes) {  \
        nll_backward<T>(logits, labels, lse, grad, grad_logits, rows, classes);                \
    }

NLL_ENTRY_POINTS(float, f32)
NLL_ENTRY_POINTS(bf16, bf16)
NLL_ENTRY_POINTS(f16, f16)
