// Warp-level tensor-core primitives with the fragment layouts the PTX ISA documents (sm_80 and
// later): `mma.sync.m16n8k16` (bf16 in, f32 sums) and `ldmatrix` (four 8x8 matrices of 16-bit
// elements from shared memory, as they are or transposed). Where `wmma`'s fragments are opaque
// (a kernel can only load, multiply and store them, through memory), these layouts are known,
// so a product's f32 results can be worked on in registers and fed straight back in as the
// next product's left operand (`flash_registers.cu`).
//
// The layouts, for a lane `l`, `g = l / 4`, `t = l % 4` (each 32-bit register holds two bf16,
// the lower-indexed element in its low half):
// - A, 16x16 row-major: `a[0]` row g, columns 2t and 2t+1; `a[1]` row g+8, the same columns;
//   `a[2]` row g, columns 2t+8 and 2t+9; `a[3]` row g+8, those columns.
// - B, 16x8 (k x n): `b[0]` rows (k) 2t and 2t+1 of column (n) g; `b[1]` rows 2t+8 and 2t+9.
// - C and D, 16x8 f32: `c[0]`, `c[1]` row g, columns 2t and 2t+1; `c[2]`, `c[3]` row g+8.
// - `ldmatrix` x4: lanes 8i..8i+7 give the addresses of matrix i's eight rows (16 bytes each);
//   register i of lane l gets row g of matrix i, its elements 2t and 2t+1, or, transposed
//   (`.trans`), the elements in column g of its rows 2t and 2t+1.
//
// The CPU emulation (`bench/gpu/emulate`, which defines `BERTKIT_EMULATION`) defines these
// functions itself from the same layouts, through a warp's exchange of registers (and the
// asynchronous copies as copies made when their group is waited for).

#pragma once

#include "common.cuh"

#ifndef BERTKIT_EMULATION

// `d += a · b` for one 16x8x16 tile of the warp.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4],
                                         uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 matrices from shared memory, this lane's row address `row` (see above).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* row) {
    const unsigned at = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}

// The same, each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16* row) {
    const unsigned at = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}

// `cp.async` (sm_80 on): 16 bytes from global memory to shared memory without passing through
// registers, zeros where `valid` is false (a source size of 0: `src` is not read); in flight
// until a `cp_async_wait` retires the group `cp_async_commit` closed around it. A thread sees
// its own copies after the wait; the block's, after a barrier too.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    const unsigned at = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(at), "l"(src),
                 "r"(valid ? 16 : 0));
}

// Closes the thread's current group of copies.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most `N` of the thread's closed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Two f32 as two bf16 in a register (`lo` in the low half), rounded to nearest even.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

#endif
