// Decode GEMV with the dequantization fused in: y = W x for one token, or for a few tokens at once.
//
// strata_gemv_<qtype>(W, x, y, rows, n)
//   y[r] = sum_k W[r, k] * x[k], float32 accumulation.
// strata_gemv_batch_<qtype>(W, x, y, rows, n, batch)
//   y[b, r] = sum_k W[r, k] * x[b, k] for b < batch <= 8 (the tokens of a speculative verify window).
//
// Layout: W is [rows, n] in the type's native block bytes (row r at r * (n / block_size) * type_size),
// 16-byte aligned; x is [n] (or [batch, n]) float32, 16-byte aligned (4 for a float type with n % 8
// != 0); y is [rows] (or [batch, rows]) float32, 4-byte aligned. n is a multiple of the block size;
// for F32, F16 and BF16 any n works, and the batched kernel needs n % 8 == 0.
//
// Single token (gemv_body): a row is cut into units (gemv_units*.cuh: 32 or 64 weights of a quant
// type, 8 of a float type); `lanes` = the power of two >= units per row, at most 32, lanes work on
// one row set, so short rows share a warp. Each lane loads the x values of its unit once and uses
// them for kRows rows (2 or 4) whose bytes it loads first, all at once: x is read from L1 kRows
// times less often, and several independent loads are in flight per lane. Lane sums are reduced
// with shuffles. Nothing is staged in shared memory except IQ4's 16-float codebook.
//
// Batched (gemv_batch_body): each lane decodes 8 weights of each of 4 rows with the exact decoders
// and multiplies them with the same 8 x values of every token; a warp covers 32 chunks of 8.
//
// Launch: block = (128, 1, 1) (kWarps warps); any grid is correct, since warps stride over row
// sets. strata/backends/cuda.py sizes the grid to one row set per warp from the units' kUnits and
// kRows (mirrored there as GEMV_UNITS); the batched kernel takes 4 rows per warp.
//
// Measured (H200, tools/quant_kernel_report.py, launches back to back; device copy 4250 GB/s read +
// write): at 151936 x 2048 F16 / BF16 read W at 4320 GB/s, Q5_1 2390, Q8_0 2210, Q4_K 1350, Q6_K
// 1140, Q2_K 1140, IQ4_XS 1030; at 4096 x 2048 every type takes 7-10 us, at 768 x 2048 5-8 us (the
// per-launch floor); batched B = 8 at 4096 x 2048 23-28 us. Likely limit of the quant types (from
// the access pattern; not yet checked with ncu): a 32- or 64-weight unit puts neighbouring lanes'
// x runs 128-256 bytes apart, so each 16-byte x load touches 32 L1 lines, where the float types'
// 8-weight units touch 4. Next step: stage x once per block in shared memory, padded 16 bytes per
// unit so the 16-byte reads are conflict-free.

#include <cstdint>

#include "gemv_units.cuh"
#include "gemv_units_k.cuh"
#include "quant_blocks.cuh"

namespace {

using namespace strata_q;

constexpr int kWarps = 4;
constexpr int kMaxBatch = 8;
constexpr int kBatchRows = 4;

__device__ __forceinline__ float sum_lanes(float v, int lanes) {  // within aligned groups of `lanes`
    for (int offset = lanes >> 1; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ int lanes_per_row(int units) {
    return units >= 32 ? 32 : 1 << (32 - __clz(max(units, 1) - 1));
}

template <class U>
__device__ __forceinline__ void gemv_body(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                          float* __restrict__ y, int rows, int n, const float* table) {
    constexpr int R = U::kRows;
    const int num_blocks = n / U::kBlockWeights;
    const int units = num_blocks * U::kUnits;
    const int lanes = lanes_per_row(units);
    const int lane = threadIdx.x & 31, sub = lane / lanes, sl = lane & (lanes - 1);
    const long long rows_per_warp = (32 / lanes) * R;
    const long long row_bytes = static_cast<long long>(num_blocks) * U::kBlockBytes;
    const long long warp = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    const long long num_warps = static_cast<long long>(gridDim.x) * kWarps;
    for (long long base = warp * rows_per_warp; base < rows; base += num_warps * rows_per_warp) {
        const int row0 = static_cast<int>(base) + sub * R;  // past the end: reads row rows - 1, writes nothing
        const uint8_t* row_ptr[R];
#pragma unroll
        for (int r = 0; r < R; ++r) row_ptr[r] = W + static_cast<long long>(min(row0 + r, rows - 1)) * row_bytes;
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.f;
        for (int u = sl; u < units; u += lanes) {
            const int b = u / U::kUnits, c = u - b * U::kUnits;
            typename U::Raw raw[R];
#pragma unroll
            for (int r = 0; r < R; ++r) U::load(row_ptr[r] + static_cast<long long>(b) * U::kBlockBytes, c, raw[r]);
            typename U::X xv;
            U::load_x(x + static_cast<long long>(b) * U::kBlockWeights, c, xv);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] += U::dot(raw[r], c, xv, table);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float v = sum_lanes(acc[r], lanes);
            if (sl == 0 && row0 + r < rows) y[row0 + r] = v;
        }
    }
}

template <class B>
__device__ __forceinline__ void gemv_batch_body(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                                float* __restrict__ y, int rows, int n, int batch) {
    constexpr int R = kBatchRows, kChunks = B::kWeights / 8;
    const int chunks = n / 8, lane = threadIdx.x & 31;
    const long long row_bytes = static_cast<long long>(n / B::kWeights) * B::kBytes;
    const long long warp = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    const long long num_warps = static_cast<long long>(gridDim.x) * kWarps;
    for (long long base = warp * R; base < rows; base += num_warps * R) {
        const int row0 = static_cast<int>(base);
        const uint8_t* row_ptr[R];
#pragma unroll
        for (int r = 0; r < R; ++r) row_ptr[r] = W + static_cast<long long>(min(row0 + r, rows - 1)) * row_bytes;
        float acc[kMaxBatch][R];
#pragma unroll
        for (int t = 0; t < kMaxBatch; ++t)
#pragma unroll
            for (int r = 0; r < R; ++r) acc[t][r] = 0.f;
        for (int ch = lane; ch < chunks; ch += 32) {
            const int b = ch / kChunks, j = ch - b * kChunks;
            float w[R][8];
#pragma unroll
            for (int r = 0; r < R; ++r) B::decode8(row_ptr[r] + static_cast<long long>(b) * B::kBytes, j, w[r]);
#pragma unroll
            for (int t = 0; t < kMaxBatch; ++t) {
                if (t < batch) {
                    const float4* xp = reinterpret_cast<const float4*>(x + static_cast<long long>(t) * n + 8LL * ch);
                    const float4 x0 = __ldg(xp), x1 = __ldg(xp + 1);
                    const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                    for (int r = 0; r < R; ++r)
#pragma unroll
                        for (int i = 0; i < 8; ++i) acc[t][r] = fmaf(xv[i], w[r][i], acc[t][r]);
                }
            }
        }
#pragma unroll
        for (int t = 0; t < kMaxBatch; ++t) {
            if (t < batch) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const float v = sum_lanes(acc[t][r], 32);
                    if (lane == 0 && row0 + r < rows) y[static_cast<long long>(t) * rows + row0 + r] = v;
                }
            }
        }
    }
}

// IQ4's codebook as floats in shared memory; every thread of the block reaches the barrier.
__device__ __forceinline__ void fill_iq4_table(float* table) {
    if (threadIdx.x < 16) table[threadIdx.x] = static_cast<float>(iq4_value(threadIdx.x));
    __syncthreads();
}

}  // namespace

#define STRATA_GEMV_BATCH(name, Block)                                                                 \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_batch_##name(const uint8_t* W, const float* x, float* y, int rows, int n, int batch) { \
        gemv_batch_body<Block>(W, x, y, rows, n, batch);                                               \
    }

#define STRATA_GEMV(name, Unit, Block)                                                                 \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_##name(const uint8_t* W, const float* x, float* y, int rows, int n) {              \
        gemv_body<Unit>(W, x, y, rows, n, nullptr);                                                    \
    }                                                                                                  \
    STRATA_GEMV_BATCH(name, Block)

STRATA_GEMV(q4_0, UnitQ4_0, BlockQ4_0)
STRATA_GEMV(q4_1, UnitQ4_1, BlockQ4_1)
STRATA_GEMV(q5_0, UnitQ5_0, BlockQ5_0)
STRATA_GEMV(q5_1, UnitQ5_1, BlockQ5_1)
STRATA_GEMV(q8_0, UnitQ8_0, BlockQ8_0)
STRATA_GEMV(q2_k, UnitQ2_K, BlockQ2_K)
STRATA_GEMV(q3_k, UnitQ3_K, BlockQ3_K)
STRATA_GEMV(q4_k, UnitQ4_K, BlockQ4_K)
STRATA_GEMV(q5_k, UnitQ5_K, BlockQ5_K)
STRATA_GEMV(q6_k, UnitQ6_K, BlockQ6_K)

#define STRATA_GEMV_IQ4(name, Unit, Block)                                                             \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_##name(const uint8_t* W, const float* x, float* y, int rows, int n) {              \
        __shared__ float table[16];                                                                    \
        fill_iq4_table(table);                                                                         \
        gemv_body<Unit>(W, x, y, rows, n, table);                                                      \
    }                                                                                                  \
    STRATA_GEMV_BATCH(name, Block)

STRATA_GEMV_IQ4(iq4_nl, UnitIQ4_NL, BlockIQ4_NL)
STRATA_GEMV_IQ4(iq4_xs, UnitIQ4_XS, BlockIQ4_XS)

// Float types: 8 weights per unit (16-byte loads) when n % 8 == 0, else one; the branch is uniform.
#define STRATA_GEMV_FLOAT(name, Block, Elem)                                                           \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_##name(const uint8_t* W, const float* x, float* y, int rows, int n) {              \
        if (n % 8 == 0)                                                                                \
            gemv_body<UnitFloat8<Block>>(W, x, y, rows, n, nullptr);                                   \
        else                                                                                           \
            gemv_body<UnitFloat1<Elem>>(W, x, y, rows, n, nullptr);                                    \
    }                                                                                                  \
    STRATA_GEMV_BATCH(name, Block)

STRATA_GEMV_FLOAT(f32, BlockF32x8, ElemF32)
STRATA_GEMV_FLOAT(f16, BlockF16x8, ElemF16)
STRATA_GEMV_FLOAT(bf16, BlockBF16x8, ElemBF16)
