// The CPU emulation's `cuda_fp16.h` (see emulation.h): f16 as the compiler's `_Float16`
// (IEEE binary16; conversions from f32 round to nearest even, as the GPU's `__float2half`).
#pragma once

struct __half {
    _Float16 value;
};

inline float __half2float(__half x) { return (float)x.value; }
inline __half __float2half(float f) { return {(_Float16)f}; }
