// Enough of CUDA to run a kernel file's source on the host, for tests that have no GPU: a block is 256
// std::threads over one set of `static` shared arrays, __syncthreads a barrier of the block, a warp's
// collectives (__shfl_xor_sync, mma.sync m16n8k8 tf32) barriers of its 32 threads over a per-warp
// exchange buffer, the mma fragments placed as the PTX ISA lays them out (a: rows g, g + 8, g, g + 8 and
// columns t, t, t + 4, t + 4; b: rows t, t + 4, column g; c: rows g, g, g + 8, g + 8, columns 2t, 2t + 1;
// g = lane / 4, t = lane % 4). Blocks run one after another. Include it, then the .cu file.
#pragma once

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

using std::max;
using std::min;

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim{256, 1, 1}, gridDim;

namespace shim {
inline std::barrier<>* block_barrier;
inline std::barrier<>* warp_barrier[8];
inline float shfl[8][32];
inline uint32_t frag_a[8][32][4], frag_b[8][32][2];

inline int warp() { return threadIdx.x >> 5; }
inline int lane() { return threadIdx.x & 31; }
inline void warp_sync() { warp_barrier[warp()]->arrive_and_wait(); }

// Run body on every thread of every block of grid, the blocks in order.
inline void launch(dim3 grid, const std::function<void()>& body) {
    gridDim = grid;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                std::barrier<> block(256);
                block_barrier = &block;
                std::vector<std::unique_ptr<std::barrier<>>> owned;
                for (int w = 0; w < 8; ++w) {
                    owned.emplace_back(new std::barrier<>(32));
                    warp_barrier[w] = owned.back().get();
                }
                std::vector<std::thread> threads;
                for (unsigned t = 0; t < 256; ++t)
                    threads.emplace_back([&, t] {
                        threadIdx = {t, 0, 0};
                        blockIdx = {bx, by, bz};
                        body();
                    });
                for (auto& th : threads) th.join();
            }
}
}  // namespace shim

inline void __syncthreads() { shim::block_barrier->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int mask) {
    shim::shfl[shim::warp()][shim::lane()] = v;
    shim::warp_sync();
    const float out = shim::shfl[shim::warp()][shim::lane() ^ mask];
    shim::warp_sync();
    return out;
}

inline float __uint_as_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// cvt.rna.tf32.f32: to 10 mantissa bits, round to nearest, ties away from zero.
inline uint32_t shim_tf32(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return (u + 0x1000u) & ~0x1fffu;
}

inline void gdn_split_tf32(float x, uint32_t& hi, uint32_t& lo) {
    hi = shim_tf32(x);
    lo = shim_tf32(x - __uint_as_float(hi));
}

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, c += a b over the warp.
inline void gdn_mma_tf32(float* c, const uint32_t* a, const uint32_t* b) {
    const int w = shim::warp(), l = shim::lane(), g = l >> 2, t = l & 3;
    std::memcpy(shim::frag_a[w][l], a, 16);
    std::memcpy(shim::frag_b[w][l], b, 8);
    shim::warp_sync();
    auto A = [&](int row, int k) {
        return __uint_as_float(shim::frag_a[w][(row % 8) * 4 + k % 4][row / 8 + 2 * (k / 4)]);
    };
    auto B = [&](int k, int col) { return __uint_as_float(shim::frag_b[w][col * 4 + k % 4][k / 4]); };
    for (int r = 0; r < 4; ++r) {
        const int row = g + 8 * (r >> 1), col = 2 * t + (r & 1);
        float s = c[r];
        for (int k = 0; k < 8; ++k) s += A(row, k) * B(k, col);
        c[r] = s;
    }
    shim::warp_sync();
}
