// What one multiprocessor's warpgroup MMAs reach from shared memory, by operand layout (#17): the
// ceiling the prompt kernels on wgmma (cuda/attention_ws.cu, cuda/moe_gemm_ws.cu) can be held against.
// Not part of the package: tools/wgmma_rate.py runs tools/variants/make_wgmma.sh's .whl/wgmma_rate.fatbin.
//
// strata_wgmma_rate_<name>(out, iters, wait_every): one block a multiprocessor of 128 or 256 threads (one
// or two warpgroups), each warpgroup issuing `iters` rounds of 8 k-steps
// (K 128) of m64nNk16 f16 -> f32 on operands that stay in shared memory, waiting for its MMAs every
// `wait_every` rounds (1: as the attention waits for S). The operands' values are 1.0; out gets a sum so
// nothing is optimized away. Names:
//   ss64, ss128      A and B from shared memory, no swizzle (the core-matrix layout the kernels use)
//   ss128sw          the same with the 128-byte swizzle (descriptor layout 1: 8 rows of 128 bytes a
//                    1 KB atom, k-steps 32 bytes apart within it)
//   rs128            A from registers, B (N-major, P V's V) from shared memory, no swizzle

#include <cuda_fp16.h>

#include <cstdint>

namespace {
#include "wgmma.cuh"
#include "wgmma_attention.cuh"

__device__ __forceinline__ uint64_t desc_sw128(unsigned addr) {  // layout type 1 (128B), SBO 1024, LBO 16
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
           (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

template <int MODE>  // 0 ss64, 1 ss128, 2 ss128sw, 3 rs128
__device__ __forceinline__ void rate(float* out, int iters, int wait_every) {
#ifdef STRATA_WG_TRAP
    __trap();
#else
    extern __shared__ __align__(1024) uint4 rate_smem[];
    for (int i = threadIdx.x; i < 64 * 1024 / 16; i += blockDim.x)
        rate_smem[i] = make_uint4(0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u);
    fence_proxy_async();
    __syncthreads();
    const unsigned base = smem_addr(rate_smem), wg = threadIdx.x / 128;
    const unsigned a_base = base + wg * 16384, b_base = base + 32768;  // A 64 x 128 a warpgroup, B 128 x 128
    float d[16][4];
#pragma unroll
    for (int n = 0; n < 16; ++n) d[n][0] = d[n][1] = d[n][2] = d[n][3] = 0.0f;
    float d64[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) d64[n][0] = d64[n][1] = d64[n][2] = d64[n][3] = 0.0f;
    const unsigned one[4] = {0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u};
    for (int it = 0; it < iters; ++it) {
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
            if constexpr (MODE == 0)
                wgmma_ss_n64(d64, smem_desc(a_base + 2 * ks * 128, 128, 2048),
                             smem_desc(b_base + 2 * ks * 128, 128, 2048));
            else if constexpr (MODE == 1)
                wgmma_ss_n128(d, smem_desc(a_base + 2 * ks * 128, 128, 2048),
                              smem_desc(b_base + 2 * ks * 128, 128, 2048));
            else if constexpr (MODE == 2)
                wgmma_ss_n128(d, desc_sw128(a_base + (ks & 3) * 32 + (ks >> 2) * 8192),
                              desc_sw128(b_base + (ks & 3) * 32 + (ks >> 2) * 16384));
            else
                wgmma_rs_n128(d, one, smem_desc(b_base + 2 * ks * 2048, 2048, 128));
        }
        wgmma_commit();
        if ((it + 1) % wait_every == 0) wgmma_wait_all();
    }
    wgmma_wait_all();
    float sum = 0.0f;
#pragma unroll
    for (int n = 0; n < 16; ++n) sum += d[n][0] + d[n][3];
#pragma unroll
    for (int n = 0; n < 8; ++n) sum += d64[n][0] + d64[n][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
#endif
}
}  // namespace

#define RATE(NAME, MODE)                                                                             \
    extern "C" __global__ void __launch_bounds__(256, 1) strata_wgmma_rate_##NAME(float* out, int iters, \
                                                                                    int wait_every) { \
        rate<MODE>(out, iters, wait_every);                                                          \
    }
RATE(ss64, 0)
RATE(ss128, 1)
RATE(ss128sw, 2)
RATE(rs128, 3)
