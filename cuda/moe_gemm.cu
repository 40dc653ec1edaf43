// Grouped GEMM on tensor cores for prompt chunks, dequantizing the weights on the fly: every
// expert's (group's) token rows against that expert's quantized weight matrix, in one launch.
//
// strata_moe_gemm_<q>(ptrs, part_offset, tiles, X, ldx, Y, ldy, N, K)       signature "PqPPqPqii"
//   W_g = the [N, K] matrix at ptrs[g] + part_offset: ggml rows of the type's blocks, row n at
//         n * row_bytes(K); groups live anywhere (device or host-mapped memory), one pointer each.
//   tiles [n_tiles, 4] int32: (g, s0, m, unused), 1 <= m <= kBM
//   Y[s0 + i, n] = sum_k f16(X[s0 + i, k]) * f16(W_g[n, k])      i < m, n < N
//   X [S, K] f32 (row stride ldx floats), Y [S, N] f32 (row stride ldy); rows of Y outside every
//   tile are not touched. <q>: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q2_k q3_k q4_k q5_k q6_k
//   iq4_nl iq4_xs.
//
// Requirements: ptrs[g] + part_offset 16-byte aligned (a row is then as aligned as its block size
// allows, see quant_blocks.cuh); K a multiple of the block size, and of 8 for the float types;
// X 16-byte aligned with ldx % 4 == 0; Y 4-byte aligned; |X| and |W| below 65504 (f16 range).
//
// Launch: grid = (ceil(N / kBN), n_tiles), block = (kThreads, 1, 1), no dynamic shared memory
// (kSmemBytes = 30720 static, under the 48 KiB default: no opt-in attribute needed).
//
// Algorithm: a CTA computes a kBM x kBN tile of Y (m token rows x kBN weight rows) over K in steps
// of kBK = 32. Per step every thread decodes 8 consecutive weights of each of two weight rows with
// the exact decoders of quant_blocks.cuh (decode8: bit-identical to strata.quant's float32
// dequantization), rounds them to f16 and stores them in shared memory, and rounds 8 values of X to
// f16 likewise. Four threads share a row, so one warp-wide load touches 8 rows' cache lines.
//
// Measured (H200, tools/moe_gemm_bench.py, 4096-token prompt): 81 TFLOP/s experts gate|up Q4_K,
// 87 down Q4_K, 70 down Q6_K, 101-104 dense Q8_0, head Q8_0 (16 rows) 840 GB/s of weights. ncu:
// L1/TEX ~96% busy, tensor pipes and issue slots mostly idle: the limit is the scattered weight
// loads (every decode8 is 3-5 small __ldg, 8 rows a warp) and X's f32 loads, all through L1.
// Next step: stage raw block bytes and X with coalesced 16-byte cp.async into shared memory and
// decode from there (decoders reading shared memory), and a BM = 128 variant for big groups.
// Shared memory is double-buffered: the next step's weights and X are loaded and decoded into
// registers while the tensor cores work on the current buffers, then stored into the other buffer;
// one barrier per step. 8 warps, 2 (M) x 4 (N), each a 32 x 32 sub-tile: 2 x 4 mma.sync
// m16n8k16 (f16 x f16 -> f32) per 16 k, operands from ldmatrix. Rows of shared memory are padded
// to 40 halves (80 bytes) so ldmatrix's 8 row addresses hit distinct banks. Rows past m read zeros,
// weight rows past N re-read row N - 1; neither is stored.
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

constexpr int kBM = 64, kBN = 128, kBK = 32, kThreads = 256;
constexpr int kLds = kBK + 8;  // padded row of a shared tile, in halves
constexpr int kWarpM = 32, kWarpN = 32, kWarpsN = kBN / kWarpN;
constexpr int kFragM = kWarpM / 16, kFragN = kWarpN / 8;
constexpr int kSmemBytes = 2 * (kBM + kBN) * kLds * 2;
static_assert(2 * kThreads == 4 * kBN && kThreads == 4 * kBM && kBK == 32, "the staging map below");
static_assert((kBM / kWarpM) * kWarpsN * 32 == kThreads, "warp grid covers the tile");
static_assert(kSmemBytes <= 48 * 1024, "static shared memory stays under the default limit");

struct alignas(16) Smem {
    __half a[2][kBM][kLds];  // f16(X): token rows x k
    __half b[2][kBN][kLds];  // f16(W): weight rows x k (the mma's column-major B operand)
};

__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ uint4 halves8(const float* v) {
    return make_uint4(half2_bits(v[0], v[1]), half2_bits(v[2], v[3]), half2_bits(v[4], v[5]), half2_bits(v[6], v[7]));
}

// Weights k .. k + 7 of one row as 8 f16. k past K (the float types' tail) reads the row's last 8
// weights and zeros them: no branch, so the whole k-step stays one basic block and the scheduler
// overlaps these loads with the tensor-core work.
template <class B>
__device__ __forceinline__ uint4 decode_w(const uint8_t* row, int k, int K) {
    const int kc = B::kWeights >= kBK ? k : min(k, K - 8);
    float v[8];
    B::decode8(row + static_cast<long long>(kc / B::kWeights) * B::kBytes, (kc % B::kWeights) / 8, v);
    if (B::kWeights < kBK && k >= K)
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = 0.f;
    return halves8(v);
}

// X values k .. k + 7 of a row as 8 f16; invalid (a row past m, k past K) reads in bounds, gives zeros.
__device__ __forceinline__ uint4 load_x(const float* row, int k, int K, bool valid) {
    const float4* p = reinterpret_cast<const float4*>(row + min(k, K - 8));
    const float4 lo = __ldg(p), hi = __ldg(p + 1);
    const float z = 0.f;
    const float v[8] = {valid ? lo.x : z, valid ? lo.y : z, valid ? lo.z : z, valid ? lo.w : z,
                        valid ? hi.x : z, valid ? hi.y : z, valid ? hi.z : z, valid ? hi.w : z};
    return halves8(v);
}

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

// One kBK step of the warp's 32 x 32 sub-tile from shared tiles a [kBM][kLds], b [kBN][kLds].
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

template <class B>
__device__ __forceinline__ void moe_gemm_body(const unsigned long long* __restrict__ ptrs, long long part_offset,
                                              const int* __restrict__ tiles, const float* __restrict__ X,
                                              long long ldx, float* __restrict__ Y, long long ldy, int N, int K) {
    __shared__ Smem sm;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int4 tile = __ldg(reinterpret_cast<const int4*>(tiles) + blockIdx.y);
    const int s0 = tile.y, m = tile.z;
    const int n0 = blockIdx.x * kBN;

    // staging map: 4 threads per row, 8 k each (a warp's load touches 8 rows: L1 traffic, not
    // arithmetic, bounds this kernel); weight rows n0 + r and n0 + r + kBN / 2, X row s0 + r
    const int r = tid >> 2, ck = 8 * (tid & 3);
    const long long row_bytes = static_cast<long long>(K / B::kWeights) * B::kBytes;
    const uint8_t* w_base = reinterpret_cast<const uint8_t*>(ptrs[tile.x] + part_offset);
    const uint8_t* w_row[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) w_row[h] = w_base + static_cast<long long>(min(n0 + r + h * kBN / 2, N - 1)) * row_bytes;
    const float* x_row = X + static_cast<long long>(s0 + min(r, m - 1)) * ldx;
    const bool x_ok = r < m;

    const int wm = kWarpM * (warp / kWarpsN), wn = kWarpN * (warp % kWarpsN);
    float acc[kFragM][kFragN][4] = {};

    uint4 w_next[2], x_next;
#pragma unroll
    for (int h = 0; h < 2; ++h) w_next[h] = decode_w<B>(w_row[h], ck, K);
    x_next = load_x(x_row, ck, K, x_ok && ck < K);
#pragma unroll
    for (int h = 0; h < 2; ++h) *reinterpret_cast<uint4*>(&sm.b[0][r + h * kBN / 2][ck]) = w_next[h];
    *reinterpret_cast<uint4*>(&sm.a[0][r][ck]) = x_next;
    __syncthreads();

    // The last step decodes its own tile again into the idle buffer (read by nobody): no branch.
    const int steps = (K + kBK - 1) / kBK;
    for (int step = 0; step < steps; ++step) {
        const int cur = step & 1;
        const int k_next = min(step + 1, steps - 1) * kBK;
#pragma unroll
        for (int h = 0; h < 2; ++h) w_next[h] = decode_w<B>(w_row[h], k_next + ck, K);
        x_next = load_x(x_row, k_next + ck, K, x_ok && k_next + ck < K);
        mma_step(sm.a[cur], sm.b[cur], wm, wn, lane, acc);
#pragma unroll
        for (int h = 0; h < 2; ++h) *reinterpret_cast<uint4*>(&sm.b[cur ^ 1][r + h * kBN / 2][ck]) = w_next[h];
        *reinterpret_cast<uint4*>(&sm.a[cur ^ 1][r][ck]) = x_next;
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
