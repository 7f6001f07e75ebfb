// The CPU emulation's `mma.sync` and `ldmatrix` (see emulation.h and the kernels'
// `tensor_core.cuh`, which leaves these to the emulation): each lane hands its registers or its
// row address to the warp through the block's exchange slots, and takes back what the PTX ISA's
// fragment layouts give it. Products are summed in f32 in k order.
#pragma once
#include <cuda_bf16.h>

#include <cstring>

#define BERTKIT_EMULATION 1

// This warp's 32 lanes' exchange words (`words` a lane) and addresses.
inline uint32_t* emulated_words(int words) {
    return emulated_block->words.data() + (size_t)(threadIdx.x >> 5) * 32 * words;
}

inline uint16_t emulated_half(uint32_t reg, int which) { return (uint16_t)(reg >> (16 * which)); }

inline float emulated_bf16(uint16_t bits) {
    __nv_bfloat16 b{bits};
    return __bfloat162float(b);
}

inline uint32_t pack_bf16(float lo, float hi) {
    return (uint32_t)__float2bfloat16(lo).bits | ((uint32_t)__float2bfloat16(hi).bits << 16);
}

// `d += a · b` for one m16n8k16 tile, every lane of the warp calling.
inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    const int lane = threadIdx.x & 31;
    uint32_t* slots = emulated_words(6);
    uint32_t* mine = slots + lane * 6;
    for (int r = 0; r < 4; ++r) mine[r] = a[r];
    mine[4] = b0;
    mine[5] = b1;
    __syncwarp();
    // A(row, k): lane (row % 8) * 4 + (k % 8) / 2, register (row >= 8) + 2 (k >= 8), half k % 2.
    const auto A = [&](int row, int k) {
        const uint32_t reg = slots[((row % 8) * 4 + (k % 8) / 2) * 6 + (row >= 8) + 2 * (k >= 8)];
        return emulated_bf16(emulated_half(reg, k % 2));
    };
    // B(k, n): lane n * 4 + (k % 8) / 2, register 4 + (k >= 8), half k % 2.
    const auto B = [&](int k, int n) {
        const uint32_t reg = slots[(n * 4 + (k % 8) / 2) * 6 + 4 + (k >= 8)];
        return emulated_bf16(emulated_half(reg, k % 2));
    };
    const int g = lane >> 2, t = lane & 3;
    float out[4];
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float s = d[e];
        for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);
        out[e] = s;
    }
    __syncwarp();
    for (int e = 0; e < 4; ++e) d[e] = out[e];
}

// `ldmatrix.x4` (transposed where `trans`): matrix i's rows at the addresses of lanes 8i..8i+7.
inline void emulated_ldmatrix(uint32_t (&r)[4], const __nv_bfloat16* row, bool trans) {
    const int lane = threadIdx.x & 31;
    auto& rows = emulated_block->addresses;
    const __nv_bfloat16** mine = rows.data() + (threadIdx.x >> 5) * 32;
    mine[lane] = row;
    __syncwarp();
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) {
        uint16_t lo, hi;
        if (trans) {
            lo = mine[8 * i + 2 * t][g].bits;
            hi = mine[8 * i + 2 * t + 1][g].bits;
        } else {
            lo = mine[8 * i + g][2 * t].bits;
            hi = mine[8 * i + g][2 * t + 1].bits;
        }
        r[i] = (uint32_t)lo | ((uint32_t)hi << 16);
    }
    __syncwarp();
}

inline void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* row) {
    emulated_ldmatrix(r, row, false);
}

inline void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* row) {
    emulated_ldmatrix(r, row, true);
}

// `cp.async`: on a GPU a copy lands some time between its issue and the wait that retires its
// group. In the blocks whose threads run up (see emulation.h) each thread's copies are queued
// in groups and made when a wait retires their group, the latest they may land, so that a read
// before its wait (or, from another thread, before the barrier after it) finds what was there
// before; in the blocks whose threads run down each copy is made when it is issued, the
// earliest, so that a copy into shared memory that other threads still read (with no barrier
// between their reads and its issue) overwrites what they read.
// (The thread's groups, `emulated_copies()`, oldest first, the last one still open;
// `emulate_launch` clears them at each block's start.)

inline void emulated_copy_16(void* dst, const void* src, bool valid) {
    if (valid) {
        std::memcpy(dst, src, 16);
    } else {
        std::memset(dst, 0, 16);
    }
}

inline void cp_async_16(void* dst, const void* src, bool valid) {
    if (emulated_scheduler->downwards) {
        emulated_copy_16(dst, src, valid);
    } else {
        emulated_copies().back().push_back({dst, src, valid});
    }
}

inline void cp_async_commit() { emulated_copies().emplace_back(); }

template <int N>
inline void cp_async_wait() {
    while ((int)emulated_copies().size() - 1 > N) {
        for (const auto& c : emulated_copies().front()) emulated_copy_16(c.dst, c.src, c.valid);
        emulated_copies().erase(emulated_copies().begin());
    }
}
