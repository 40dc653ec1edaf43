// Grouped GEMM on tensor cores for prompt chunks, dequantizing the weights on the fly: every
// expert's (group's) token rows against that expert's quantized weight matrix, in one launch.
//
// strata_moe_gemm_<q>(ptrs, part_offset, tiles, X, ldx, Y, ldy, N, K)       signature "PqPPqPqii"
//   W_g = the [N, K] matrix at ptrs[g] + part_offset: ggml rows of the type's blocks, row n at
//         n * row_bytes(K); groups live anywhere (device or host-mapped memory), one pointer each.
//   tiles [n_tiles, 4] int32: (g, s0, m, unused), 0 <= m <= kBM (m = 0: the CTA returns at once,
//   as it does for a group whose address ptrs[g] is 0: an expert another launch computes)
//   Y[s0 + i, n] = sum_k f16(X[s0 + i, k]) * f16(W_g[n, k])      i < m, n < N
//   X [S, K] f32 (row stride ldx floats), Y [S, N] f32 (row stride ldy); rows of Y outside every
//   tile are not touched. <q>: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q2_k q3_k q4_k q5_k q6_k
//   iq4_nl iq4_xs.
//
// Requirements: ptrs[g] + part_offset 16-byte aligned (a row is then as aligned as its block size
// allows, see quant_blocks.cuh); K a multiple of the block size, and of 8 for the float types;
// X 16-byte aligned with ldx % 4 == 0; Y 4-byte aligned; |X| and |W| below 65504 (f16 range).
// Reads stay inside the aligned 16-byte chunks that hold the weights' bytes (up to 14 bytes past
// a 2-byte aligned type's last row, never into another page).
//
// Launch: grid = (ceil(N / kBN), n_tiles), block = (kThreads, 1, 1), no dynamic shared memory
// (kSmemBytes = 40960 static, under the 48 KiB default: no opt-in attribute needed).
//
// Algorithm: a CTA computes a kBM x kBN (128 x 128) tile of Y (m token rows x kBN weight rows)
// over K in steps of kBK = 32. Per step two threads share a weight row, each decoding 16
// consecutive weights with a wide decoder (Wide<B>::decode16: one 16-byte load per field, e.g.
// Q4_K's header and quant bytes; fields of 2-byte aligned blocks come from the one or two aligned
// 16-byte chunks holding them; types without one fall back to two exact decode8 calls), rounds
// them to f16 and stores them in shared memory; X is read as float4 by 8 threads per row (one
// cache line a row), rounded to f16 once per tile and stored likewise. Shared memory is
// double-buffered: the next step's weights and X are loaded and decoded into registers while the
// tensor cores work on the current buffers, then stored into the other buffer; one barrier per
// step. 8 warps, 4 (M) x 2 (N), each a 32 x 64 sub-tile: 2 x 8 mma.sync m16n8k16 (f16 x f16 ->
// f32) per 16 k, operands from ldmatrix; a warp whose 32 rows all lie past m skips its mma (a
// group's last, short tile costs its decode, not idle tensor work). Rows of shared memory are
// padded to 40 halves (80 bytes) so ldmatrix's 8 row addresses hit distinct banks. Rows past m
// read zeros (X is not read there), weight rows past N re-read row N - 1; neither is stored.
//
// Measured (H200, tools/moe_gemm_bench.py, 4096-token prompt, TFLOP/s; the first version, BM = 64
// with 8 weights a thread through decode8's 3-5 small __ldg and L1/TEX ~96% busy, in brackets):
// experts gate|up Q4_K 159 (81), down Q4_K 148 (87), down Q6_K 120 (70), dense q Q8_0 165, o 173
// (101-104), k/v 99 (128 CTAs: under one wave), head Q8_0 (16 rows) 892 GB/s of weights (840).
// Next step: cp.async staging of raw block bytes into shared memory (more than the 8 KiB left
// under 48 KiB at this tile size, i.e. an opt-in dynamic size), then ncu to see what binds now.
//
// Precision: inputs are f16(X) and f16(W) (round to nearest even; W decoded exactly in f32 first),
// their products are exact in f32, and the sum runs in the tensor cores' f32 accumulator. With
// P = sum_k |x_k w_k|:
//   |Y - sum_k x_k w_k| <= (2^-10 + K * 2^-22) * P + 2^-25 * (sum_k |x_k| + sum_k |w_k|)
// (2^-11 relative per f16 rounding, 2^-25 absolute where a value is f16-subnormal, below 6.1e-5;
// K * 2^-22 P is a loose bound on the f32 accumulation, whose error is typically ~1e-7 P).
// Deterministic: each output's K order is fixed (16-wide mma steps, ascending k), and an mma's
// result for an element depends only on that element's row and column operands, so Y is
// bit-identical whatever the weights' address, the tile a row falls in, n_tiles or S.

#include <cuda_fp16.h>

#include <cstdint>

#include "quant_blocks.cuh"

namespace {

using namespace strata_q;

#include "gemm_wide.cuh"

constexpr int kBM = 128, kBN = 128, kBK = 32, kThreads = 256;
constexpr int kLds = kBK + 8;  // padded row of a shared tile, in halves
constexpr int kWarpM = 32, kWarpN = 64, kWarpsN = kBN / kWarpN;
constexpr int kFragM = kWarpM / 16, kFragN = kWarpN / 8;
constexpr int kSmemBytes = 2 * (kBM + kBN) * kLds * 2;
static_assert(kThreads == 2 * kBN && kBK == 32, "W staging: two threads per weight row, 16 k each");
static_assert(kThreads * 16 == kBM * kBK, "X staging: four float4 per thread");
static_assert((kBM / kWarpM) * kWarpsN * 32 == kThreads, "warp grid covers the tile");
static_assert(kSmemBytes <= 48 * 1024, "static shared memory stays under the default limit");

struct alignas(16) Smem {
    __half a[2][kBM][kLds];  // f16(X): token rows x k
    __half b[2][kBN][kLds];  // f16(W): weight rows x k (the mma's column-major B operand)
};

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __half* p) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One kBK step of the warp's kWarpM x kWarpN sub-tile from shared tiles a [kBM][kLds], b [kBN][kLds].
__device__ __forceinline__ void mma_step(const __half (*a)[kLds], const __half (*b)[kLds], int wm, int wn,
                                         int lane, float (&acc)[kFragM][kFragN][4]) {
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
        uint32_t af[kFragM][4], bf[kFragN / 2][4];
#pragma unroll
        for (int i = 0; i < kFragM; ++i)  // matrices: rows 0-7 / 8-15 x k 0-7, then k 8-15
            ldmatrix_x4(af[i], &a[wm + 16 * i + (lane & 15)][kk + 8 * (lane >> 4)]);
#pragma unroll
        for (int j = 0; j < kFragN / 2; ++j)  // matrices: n 0-7 x k 0-7, k 8-15, then n 8-15
            ldmatrix_x4(bf[j], &b[wn + 16 * j + (lane & 7) + 8 * (lane >> 4)][kk + 8 * ((lane >> 3) & 1)]);
#pragma unroll
        for (int i = 0; i < kFragM; ++i)
#pragma unroll
            for (int j = 0; j < kFragN; ++j) mma_16816(acc[i][j], af[i], bf[j / 2][2 * (j & 1)], bf[j / 2][2 * (j & 1) + 1]);
    }
}

constexpr int kXPerThread = kBM * kBK / 4 / kThreads;  // float4 loads of X per thread and step
constexpr int kXRowsPerPass = kThreads / (kBK / 4);

template <class B>
__device__ __forceinline__ void moe_gemm_body(const unsigned long long* __restrict__ ptrs, long long part_offset,
                                              const int* __restrict__ tiles, const float* __restrict__ X,
                                              long long ldx, float* __restrict__ Y, long long ldy, int N, int K) {
    __shared__ Smem sm;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int4 tile = __ldg(reinterpret_cast<const int4*>(tiles) + blockIdx.y);
    const int s0 = tile.y, m = tile.z;
    if (m <= 0) return;  // an empty tile of a worst-case grid (cuda/moe_group.cu leaves the unused ones so)
    if (ptrs[tile.x] == 0) return;  // a group outside this launch's batch of experts (null blob address)
    const int n0 = blockIdx.x * kBN;

    // W staging: two threads per weight row (16 weights each: one decoder call, wide loads);
    // X staging: 8 threads per row (one 128-byte line), rows xr + kXRowsPerPass * i.
    const int wr = tid >> 1, wk = 16 * (tid & 1);
    const long long row_bytes = static_cast<long long>(K / B::kWeights) * B::kBytes;
    const uint8_t* w_row = reinterpret_cast<const uint8_t*>(ptrs[tile.x] + part_offset) +
                           static_cast<long long>(min(n0 + wr, N - 1)) * row_bytes;
    const int xr = tid >> 3, xk = 4 * (tid & 7);
    const float* x_row = X + static_cast<long long>(s0 + min(xr, m - 1)) * ldx;
    const long long x_pass = kXRowsPerPass * ldx;  // rows past m are never read: their pointers do not matter

    // 4 (M) x 2 (N) warps; a warp whose rows all lie past m skips the tensor-core work
    const int wm = kWarpM * (warp / kWarpsN), wn = kWarpN * (warp % kWarpsN);
    const bool busy = wm < m;
    float acc[kFragM][kFragN][4] = {};

    uint4 w_next[2];
    uint2 x_next[kXPerThread];
    Wide<B>::decode16(w_row, wk, K, w_next);
#pragma unroll
    for (int i = 0; i < kXPerThread; ++i) x_next[i] = load_x4(x_row + i * x_pass, xk, K, xr + kXRowsPerPass * i < m);
#pragma unroll
    for (int h = 0; h < 2; ++h) *reinterpret_cast<uint4*>(&sm.b[0][wr][wk + 8 * h]) = w_next[h];
#pragma unroll
    for (int i = 0; i < kXPerThread; ++i) *reinterpret_cast<uint2*>(&sm.a[0][xr + kXRowsPerPass * i][xk]) = x_next[i];
    __syncthreads();

    // The last step decodes its own tile again into the idle buffer (read by nobody).
    const int steps = (K + kBK - 1) / kBK;
    for (int step = 0; step < steps; ++step) {
        const int cur = step & 1;
        const int k_next = min(step + 1, steps - 1) * kBK;
        Wide<B>::decode16(w_row, k_next + wk, K, w_next);
#pragma unroll
        for (int i = 0; i < kXPerThread; ++i)
            x_next[i] = load_x4(x_row + i * x_pass, k_next + xk, K, xr + kXRowsPerPass * i < m);
        if (busy) mma_step(sm.a[cur], sm.b[cur], wm, wn, lane, acc);
#pragma unroll
        for (int h = 0; h < 2; ++h) *reinterpret_cast<uint4*>(&sm.b[cur ^ 1][wr][wk + 8 * h]) = w_next[h];
#pragma unroll
        for (int i = 0; i < kXPerThread; ++i)
            *reinterpret_cast<uint2*>(&sm.a[cur ^ 1][xr + kXRowsPerPass * i][xk]) = x_next[i];
        __syncthreads();
    }

    // accumulator fragment: c0, c1 at (row g, cols 2t, 2t + 1), c2, c3 at row g + 8
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < kFragM; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = wm + 16 * i + g + 8 * h;
            if (row >= m) continue;
            float* y_row = Y + static_cast<long long>(s0 + row) * ldy;
#pragma unroll
            for (int j = 0; j < kFragN; ++j) {
                const int n = n0 + wn + 8 * j + 2 * t;
                if (n < N) y_row[n] = acc[i][j][2 * h];
                if (n + 1 < N) y_row[n + 1] = acc[i][j][2 * h + 1];
            }
        }
    }
}

}  // namespace

#define STRATA_MOE_GEMM(name, Block)                                                                   \
    extern "C" __global__ void __launch_bounds__(kThreads, 2) strata_moe_gemm_##name(                  \
        const unsigned long long* ptrs, long long part_offset, const int* tiles, const float* X,      \
        long long ldx, float* Y, long long ldy, int N, int K) {                                        \
        moe_gemm_body<Block>(ptrs, part_offset, tiles, X, ldx, Y, ldy, N, K);                          \
    }

STRATA_MOE_GEMM(f32, BlockF32x8)
STRATA_MOE_GEMM(f16, BlockF16x8)
STRATA_MOE_GEMM(bf16, BlockBF16x8)
STRATA_MOE_GEMM(q8_0, BlockQ8_0)
STRATA_MOE_GEMM(q4_0, BlockQ4_0)
STRATA_MOE_GEMM(q4_1, BlockQ4_1)
STRATA_MOE_GEMM(q5_0, BlockQ5_0)
STRATA_MOE_GEMM(q5_1, BlockQ5_1)
STRATA_MOE_GEMM(q2_k, BlockQ2_K)
STRATA_MOE_GEMM(q3_k, BlockQ3_K)
STRATA_MOE_GEMM(q4_k, BlockQ4_K)
STRATA_MOE_GEMM(q5_k, BlockQ5_K)
STRATA_MOE_GEMM(q6_k, BlockQ6_K)
STRATA_MOE_GEMM(iq4_nl, BlockIQ4_NL)
STRATA_MOE_GEMM(iq4_xs, BlockIQ4_XS)
