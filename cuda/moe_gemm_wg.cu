// The prompt chunks' grouped GEMM of cuda/moe_gemm.cu on Hopper's warpgroup MMA (wgmma, sm_90a only):
// the same entry contract, grid, block and results' bounds, with the tensor-core work issued
// asynchronously so it overlaps the decoding of the next k step's weights.
//
// strata_moe_gemm_wg_<q>(ptrs, part_offset, tiles, X, ldx, Y, ldy, N, K)    signature "PqPPqPqii"
//   exactly strata_moe_gemm_<q>'s parameters, requirements, grid (ceil(N / 128), n_tiles) and block
//   (256 threads); Y[s0 + i, n] = sum_k f16(X[s0 + i, k]) * f16(W_g[n, k]) for i < m, n < N.
//   <q>: the same types.
//
// Built for sm_90a only (setup.py: the `_wg` libraries); the host launches it only on a device of
// compute capability 9.0 whose build has it, and falls back to cuda/moe_gemm.cu elsewhere. Compiled
// for any other arch the entry points trap.
//
// Algorithm: a CTA computes a 128 x 128 tile of Y over K in steps of kBK = 32. Two warpgroups each
// own 64 token rows and issue wgmma.m64n128k16 (f16 x f16 -> f32, both operands from shared memory)
// twice a step. Shared tiles are stored in wgmma's canonical K-major layout without swizzle: "core
// matrices" of 8 rows x 8 halves (128 contiguous bytes, row r at 16 r); core matrices adjacent in k
// lie 128 bytes apart (the descriptors' leading byte offset), those adjacent in rows kBK * 16 = 512
// bytes apart (the stride byte offset). Each thread writes whole 16-byte core-matrix rows, and the 8
// threads of a store phase write the 8 rows of one core matrix: no bank conflicts, no padding.
// A step: issue the wgmmas on the current buffers and commit; decode the next step's weights and
// round its X to f16 into registers (wide loads as in moe_gemm.cu, gemm_wide.cuh) and store them
// into the other buffers, then make those generic-proxy writes visible to the async proxy
// (fence.proxy.async); wait for the wgmmas; one barrier. The other buffer was last read by the
// previous step's wgmmas, which every warpgroup waited for before that step's barrier. Both
// warpgroups issue their wgmmas even when all 64 of one's rows lie past m (zeros there): under a
// condition ptxas serializes every wgmma of the kernel (its C7518 note), which costs more than a
// short tile's idle half.
//
// Precision and determinism: as cuda/moe_gemm.cu's (f16 operands rounded to nearest even, exact
// products, f32 accumulation in a fixed k order; each output depends only on its row of X and its
// weight row), so Y is bit-identical whatever the tile a row falls in, n_tiles or S. It need not be
// bit-identical to moe_gemm.cu's mma.sync sums: the two instructions' f32 accumulations may round
// differently inside a 16-wide k step (tools/moe_gemm_wg_ab.py measures the difference).
//
// tools/moe_gemm_wg_ab.py checks it against the numpy oracle and moe_gemm.cu, and times both, from
// fatbins and without a package build.

#include <cuda_fp16.h>

#include <cstdint>

#include "quant_blocks.cuh"

namespace {

using namespace strata_q;

#include "gemm_wide.cuh"
#include "wgmma.cuh"

constexpr int kBM = 128, kBN = 128, kBK = 32, kThreads = 256;
constexpr int kKChunks = kBK / 8;                  // 16-byte core-matrix rows along k in a step
constexpr int kChunksPerBuf = kBM * kBK / 8;       // 16-byte chunks in one tile of one buffer
constexpr unsigned kLbo = 128, kSbo = kKChunks * 128;  // bytes between core matrices along k / rows
static_assert(kBM == kBN, "one chunk layout for both tiles");
static_assert(kThreads == 2 * kBN && kBK == 32, "W staging: two threads a weight row, 16 k each");
static_assert(kThreads * 2 == kBM * kKChunks, "X staging: two 8-value chunks a thread");

struct alignas(128) Smem {
    uint4 a[2][kChunksPerBuf];  // f16(X) token rows, canonical K-major layout
    uint4 b[2][kChunksPerBuf];  // f16(W) weight rows, the same
};
static_assert(sizeof(Smem) <= 48 * 1024, "static shared memory stays under the default limit");

// The chunk (16 bytes: halves 8 kc .. 8 kc + 7 of row r) of a tile.
__device__ __forceinline__ int chunk(int r, int kc) { return ((r >> 3) * kKChunks + kc) * 8 + (r & 7); }

// The descriptor of a tile's chunks from p on (K-major: core matrices 128 bytes apart along k, kBK * 16 along rows).
__device__ __forceinline__ uint64_t tile_desc(const uint4* p) { return smem_desc(smem_addr(p), kLbo, kSbo); }

// d[64] += A (64 x 16, desc_a) * B (16 x 128, desc_b), both K-major f16; d in the accumulator
// layout: d[4 j + e] at row 16 (warp % 4) + lane / 4 + 8 (e / 2), column 8 j + 2 (lane % 4) + e % 2.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
#ifndef STRATA_WG_TRAP
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(1));
#endif
}

// One step's staging: weights k0 + 16 kh .. + 15 of weight row wr (two chunks), and two 8-value
// chunks of X (rows xr and xr + 64, values k0 + 8 xc .. + 7; zeros past m or K).
template <class B>
__device__ __forceinline__ void stage(const uint8_t* w_row, int k0, int kh, int K, const float* x_lo,
                                      const float* x_hi, int xc, bool lo_valid, bool hi_valid, uint4 (&w)[2],
                                      uint4 (&x)[2]) {
    Wide<B>::decode16(w_row, k0 + 16 * kh, K, w);
    const int xk = k0 + 8 * xc;
    const uint2 a0 = load_x4(x_lo, xk, K, lo_valid), a1 = load_x4(x_lo, xk + 4, K, lo_valid);
    const uint2 b0 = load_x4(x_hi, xk, K, hi_valid), b1 = load_x4(x_hi, xk + 4, K, hi_valid);
    x[0] = make_uint4(a0.x, a0.y, a1.x, a1.y);
    x[1] = make_uint4(b0.x, b0.y, b1.x, b1.y);
}

template <class B>
__device__ __forceinline__ void moe_gemm_wg_body(const unsigned long long* __restrict__ ptrs, long long part_offset,
                                                 const int* __restrict__ tiles, const float* __restrict__ X,
                                                 long long ldx, float* __restrict__ Y, long long ldy, int N, int K) {
#ifdef STRATA_WG_TRAP
    __trap();
#else
    __shared__ Smem sm;
    const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, warp_in_wg = (tid >> 5) & 3;
    const int4 tile = __ldg(reinterpret_cast<const int4*>(tiles) + blockIdx.y);
    const int s0 = tile.y, m = tile.z;
    if (m <= 0) return;               // an empty tile of a worst-case grid
    if (ptrs[tile.x] == 0) return;    // a group outside this launch's batch of experts
    const int n0 = blockIdx.x * kBN;

    // W: weight row wr = 8 (tid / 16) + tid % 8, k half kh = (tid / 8) % 2 of each step
    const int wr = 8 * (tid >> 4) + (tid & 7), kh = (tid >> 3) & 1;
    const long long row_bytes = static_cast<long long>(K / B::kWeights) * B::kBytes;
    const uint8_t* w_row = reinterpret_cast<const uint8_t*>(ptrs[tile.x] + part_offset) +
                           static_cast<long long>(min(n0 + wr, N - 1)) * row_bytes;
    // X: rows xr and xr + 64, xr = 8 (tid / 32) + tid % 8, chunk xc = (tid / 8) % 4 of each step
    const int xr = 8 * (tid >> 5) + (tid & 7), xc = (tid >> 3) & 3;
    const bool lo_valid = xr < m, hi_valid = xr + 64 < m;
    const float* x_lo = X + static_cast<long long>(s0 + min(xr, m - 1)) * ldx;
    const float* x_hi = X + static_cast<long long>(s0 + min(xr + 64, m - 1)) * ldx;
    const int w_chunk0 = chunk(wr, 2 * kh), w_chunk1 = chunk(wr, 2 * kh + 1);
    const int x_chunk0 = chunk(xr, xc), x_chunk1 = chunk(xr + 64, xc);

    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;

    uint4 w[2], x[2];
    stage<B>(w_row, 0, kh, K, x_lo, x_hi, xc, lo_valid, hi_valid, w, x);
    sm.b[0][w_chunk0] = w[0];
    sm.b[0][w_chunk1] = w[1];
    sm.a[0][x_chunk0] = x[0];
    sm.a[0][x_chunk1] = x[1];
    fence_proxy_async();
    __syncthreads();

    const int steps = (K + kBK - 1) / kBK;
    for (int step = 0; step < steps; ++step) {
        const int cur = step & 1;
        wgmma_fence();
#pragma unroll
        for (int k16 = 0; k16 < kBK / 16; ++k16)
            wgmma_m64n128k16(acc, tile_desc(&sm.a[cur][chunk(64 * wg, 2 * k16)]), tile_desc(&sm.b[cur][chunk(0, 2 * k16)]));
        wgmma_commit();
        if (step + 1 < steps) {  // uniform: the next step's operands into the other buffers
            stage<B>(w_row, (step + 1) * kBK, kh, K, x_lo, x_hi, xc, lo_valid, hi_valid, w, x);
            sm.b[cur ^ 1][w_chunk0] = w[0];
            sm.b[cur ^ 1][w_chunk1] = w[1];
            sm.a[cur ^ 1][x_chunk0] = x[0];
            sm.a[cur ^ 1][x_chunk1] = x[1];
            fence_proxy_async();
        }
        wgmma_wait_all();
        __syncthreads();
    }

    // accumulator layout (wgmma_m64n128k16): rows 64 wg + 16 warp + lane / 4 (+ 8), columns 8 j + 2 (lane % 4)
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = 64 * wg + 16 * warp_in_wg + g + 8 * h;
        if (row >= m) continue;
        float* y_row = Y + static_cast<long long>(s0 + row) * ldy;
#pragma unroll
        for (int j = 0; j < kBN / 8; ++j) {
            const int n = n0 + 8 * j + 2 * t;
            if (n < N) y_row[n] = acc[4 * j + 2 * h];
            if (n + 1 < N) y_row[n + 1] = acc[4 * j + 2 * h + 1];
        }
    }
#endif
}

}  // namespace

#define STRATA_MOE_GEMM_WG(name, Block)                                                                \
    extern "C" __global__ void __launch_bounds__(kThreads, 2) strata_moe_gemm_wg_##name(               \
        const unsigned long long* ptrs, long long part_offset, const int* tiles, const float* X,      \
        long long ldx, float* Y, long long ldy, int N, int K) {                                        \
        moe_gemm_wg_body<Block>(ptrs, part_offset, tiles, X, ldx, Y, ldy, N, K);                       \
    }

STRATA_MOE_GEMM_WG(f32, BlockF32x8)
STRATA_MOE_GEMM_WG(f16, BlockF16x8)
STRATA_MOE_GEMM_WG(bf16, BlockBF16x8)
STRATA_MOE_GEMM_WG(q8_0, BlockQ8_0)
STRATA_MOE_GEMM_WG(q4_0, BlockQ4_0)
STRATA_MOE_GEMM_WG(q4_1, BlockQ4_1)
STRATA_MOE_GEMM_WG(q5_0, BlockQ5_0)
STRATA_MOE_GEMM_WG(q5_1, BlockQ5_1)
STRATA_MOE_GEMM_WG(q2_k, BlockQ2_K)
STRATA_MOE_GEMM_WG(q3_k, BlockQ3_K)
STRATA_MOE_GEMM_WG(q4_k, BlockQ4_K)
STRATA_MOE_GEMM_WG(q5_k, BlockQ5_K)
STRATA_MOE_GEMM_WG(q6_k, BlockQ6_K)
STRATA_MOE_GEMM_WG(iq4_nl, BlockIQ4_NL)
STRATA_MOE_GEMM_WG(iq4_xs, BlockIQ4_XS)
