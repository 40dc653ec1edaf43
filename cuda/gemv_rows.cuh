// The decode GEMV's row bodies, one copy for every kernel that computes GEMV rows: strata_gemv_*
// and strata_gemv_batch_* (cuda/gemv.cu, which describes the scheme), strata_moe_gemv_*
// (cuda/moe_gemv.cu) and strata_gemv3_* (cuda/decode_fused.cu). Sharing the code, not a copy of
// it, keeps those kernels' outputs for the same row bit-identical.
//
// Single token (gemv_rows): a row is cut into units of U (gemv_units*.cuh); `lanes` lanes share a
// row set of U::kRows rows, each lane loads its units' bytes of all the set's rows, reuses its x
// values for them, and the lane sums meet through shuffles. Batched (gemv_batch_rows): each lane
// decodes 8 weights of each of kBatchRows rows and multiplies them with the same 8 x values of
// every token. Rows past the end read row rows - 1 and write nothing.
#pragma once

#include <cstdint>

#include "quant_blocks.cuh"

namespace strata_gemv {

constexpr int kMaxBatch = 8;   // tokens of the batched body (a speculative verify window)
constexpr int kBatchRows = 4;  // rows per warp of the batched body

__device__ __forceinline__ float sum_lanes(float v, int lanes) {  // within aligned groups of `lanes`
    for (int offset = lanes >> 1; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ int lanes_per_row(int units) {
    return units >= 32 ? 32 : 1 << (32 - __clz(max(units, 1) - 1));
}

// IQ4's codebook as floats in shared memory; every thread of the block reaches the barrier.
__device__ __forceinline__ void fill_iq4_table(float* table) {
    if (threadIdx.x < 16) table[threadIdx.x] = static_cast<float>(strata_q::iq4_value(threadIdx.x));
    __syncthreads();
}

// How this lane works on rows of n weights cut into units of U: lane `sl` of the `lanes` lanes of
// row set `sub` of its warp.
template <class U>
struct UnitLanes {
    int units, lanes, sub, sl;
    long long row_bytes;

    __device__ __forceinline__ explicit UnitLanes(int n) {
        const int num_blocks = n / U::kBlockWeights;
        units = num_blocks * U::kUnits;
        lanes = lanes_per_row(units);
        const int lane = threadIdx.x & 31;
        sub = lane / lanes, sl = lane & (lanes - 1);
        row_bytes = static_cast<long long>(num_blocks) * U::kBlockBytes;
    }
};

// This lane's partial sums acc[r] of W[row0 + r, :] . x for r < U::kRows over the units u_first,
// u_first + u_step, ... (gemv_rows: the lane's own units; the split kernel: a warp's share of them).
template <class U>
__device__ __forceinline__ void gemv_rows_acc(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                              int rows, int row0, const UnitLanes<U>& L, const float* table,
                                              int u_first, int u_step, float (&acc)[U::kRows]) {
    constexpr int R = U::kRows;
    const uint8_t* row_ptr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) row_ptr[r] = W + static_cast<long long>(min(row0 + r, rows - 1)) * L.row_bytes;
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    for (int u = u_first; u < L.units; u += u_step) {
        const int b = u / U::kUnits, c = u - b * U::kUnits;
        typename U::Raw raw[R];
#pragma unroll
        for (int r = 0; r < R; ++r) U::load(row_ptr[r] + static_cast<long long>(b) * U::kBlockBytes, c, raw[r]);
        typename U::X xv;
        U::load_x(x + static_cast<long long>(b) * U::kBlockWeights, c, xv);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] += U::dot(raw[r], c, xv, table);
    }
}

// y[row0 + r] = W[row0 + r, :] . x for r < U::kRows: this lane's share of one row set.
template <class U>
__device__ __forceinline__ void gemv_rows(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                          float* __restrict__ y, int rows, int row0, const UnitLanes<U>& L,
                                          const float* table) {
    constexpr int R = U::kRows;
    float acc[R];
    gemv_rows_acc<U>(W, x, rows, row0, L, table, L.sl, L.lanes, acc);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float v = sum_lanes(acc[r], L.lanes);
        if (L.sl == 0 && row0 + r < rows) y[row0 + r] = v;
    }
}

// y = W x for one token over the whole matrix: the block's kWarps warps stride over row sets, so
// any grid is complete.
template <int kWarps, class U>
__device__ __forceinline__ void gemv_body(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                          float* __restrict__ y, int rows, int n, const float* table) {
    const UnitLanes<U> L(n);
    const long long rows_per_warp = (32 / L.lanes) * U::kRows;
    const long long warp = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    const long long num_warps = static_cast<long long>(gridDim.x) * kWarps;
    for (long long base = warp * rows_per_warp; base < rows; base += num_warps * rows_per_warp)
        gemv_rows<U>(W, x, y, rows, static_cast<int>(base) + L.sub * U::kRows, L, table);
}

// y = W x for one token, K split over the block's kWarps warps: for matrices with too few rows to
// give every SM a few blocks (an attention output projection, a router), a block covers only the
// (32 / lanes) * kRows rows of one warp's row set, each warp sums every kWarps-th unit run of
// them, and the warps' partials meet in shared memory in warp order (deterministic).
template <int kWarps, class U>
__device__ __forceinline__ void gemv_split_body(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                                float* __restrict__ y, int rows, int n, const float* table) {
    constexpr int R = U::kRows;
    __shared__ float part[kWarps][32 * R];
    const UnitLanes<U> L(n);
    const int warp = threadIdx.x >> 5;
    const long long rows_per_block = (32 / L.lanes) * R;
    for (long long base = blockIdx.x * rows_per_block; base < rows; base += gridDim.x * rows_per_block) {
        const int row0 = static_cast<int>(base) + L.sub * R;
        float acc[R];
        gemv_rows_acc<U>(W, x, rows, row0, L, table, L.sl + warp * L.lanes, L.lanes * kWarps, acc);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float v = sum_lanes(acc[r], L.lanes);
            if (L.sl == 0) part[warp][L.sub * R + r] = v;
        }
        __syncthreads();
        if (warp == 0 && L.sl == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float v = part[0][L.sub * R + r];
                for (int w = 1; w < kWarps; ++w) v += part[w][L.sub * R + r];
                if (row0 + r < rows) y[row0 + r] = v;
            }
        }
        __syncthreads();
    }
}

// Row-invariant batches (gemv_rows_multi, gemv_multi_body, gemv_split_multi_body): the one-token
// bodies above for each of `batch` <= kMaxBatch tokens, the weights loaded once per unit. Token t's
// sums are the same operations in the same order as a one-token launch on x[t] (the same units, the
// same lanes, the same U::dot and shuffle tree; the split body's warp partials meet in the same
// order), so row t of a speculative verify window or of parallel slots is bit for bit the one-token
// result, whatever the batch. x [batch, n], y [batch, rows]; batch is uniform over the grid.
template <class U>
__device__ __forceinline__ void gemv_rows_acc_multi(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                                    int n, int rows, int row0, const UnitLanes<U>& L,
                                                    const float* table, int u_first, int u_step, int batch,
                                                    float (&acc)[kMaxBatch][U::kRows]) {
    constexpr int R = U::kRows;
    const uint8_t* row_ptr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) row_ptr[r] = W + static_cast<long long>(min(row0 + r, rows - 1)) * L.row_bytes;
#pragma unroll
    for (int t = 0; t < kMaxBatch; ++t)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[t][r] = 0.f;
    for (int u = u_first; u < L.units; u += u_step) {
        const int b = u / U::kUnits, c = u - b * U::kUnits;
        typename U::Raw raw[R];
#pragma unroll
        for (int r = 0; r < R; ++r) U::load(row_ptr[r] + static_cast<long long>(b) * U::kBlockBytes, c, raw[r]);
#pragma unroll
        for (int t = 0; t < kMaxBatch; ++t) {
            if (t < batch) {
                typename U::X xv;
                U::load_x(x + static_cast<long long>(t) * n + static_cast<long long>(b) * U::kBlockWeights, c, xv);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[t][r] += U::dot(raw[r], c, xv, table);
            }
        }
    }
}

template <class U>
__device__ __forceinline__ void gemv_rows_multi(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                                float* __restrict__ y, int rows, int n, int row0,
                                                const UnitLanes<U>& L, const float* table, int batch) {
    constexpr int R = U::kRows;
    float acc[kMaxBatch][R];
    gemv_rows_acc_multi<U>(W, x, n, rows, row0, L, table, L.sl, L.lanes, batch, acc);
#pragma unroll
    for (int t = 0; t < kMaxBatch; ++t) {
        if (t < batch) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float v = sum_lanes(acc[t][r], L.lanes);
                if (L.sl == 0 && row0 + r < rows) y[static_cast<long long>(t) * rows + row0 + r] = v;
            }
        }
    }
}

template <int kWarps, class U>
__device__ __forceinline__ void gemv_multi_body(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                                float* __restrict__ y, int rows, int n, const float* table,
                                                int batch) {
    const UnitLanes<U> L(n);
    const long long rows_per_warp = (32 / L.lanes) * U::kRows;
    const long long warp = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    const long long num_warps = static_cast<long long>(gridDim.x) * kWarps;
    for (long long base = warp * rows_per_warp; base < rows; base += num_warps * rows_per_warp)
        gemv_rows_multi<U>(W, x, y, rows, n, static_cast<int>(base) + L.sub * U::kRows, L, table, batch);
}

template <int kWarps, class U>
__device__ __forceinline__ void gemv_split_multi_body(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                                      float* __restrict__ y, int rows, int n, const float* table,
                                                      int batch) {
    constexpr int R = U::kRows;
    __shared__ float part[kWarps][32 * R];
    const UnitLanes<U> L(n);
    const int warp = threadIdx.x >> 5;
    const long long rows_per_block = (32 / L.lanes) * R;
    for (long long base = blockIdx.x * rows_per_block; base < rows; base += gridDim.x * rows_per_block) {
        const int row0 = static_cast<int>(base) + L.sub * R;
        float acc[kMaxBatch][R];
        gemv_rows_acc_multi<U>(W, x, n, rows, row0, L, table, L.sl + warp * L.lanes, L.lanes * kWarps, batch, acc);
#pragma unroll
        for (int t = 0; t < kMaxBatch; ++t) {
            if (t < batch) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const float v = sum_lanes(acc[t][r], L.lanes);
                    if (L.sl == 0) part[warp][L.sub * R + r] = v;
                }
                __syncthreads();
                if (warp == 0 && L.sl == 0) {
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        float v = part[0][L.sub * R + r];
                        for (int w = 1; w < kWarps; ++w) v += part[w][L.sub * R + r];
                        if (row0 + r < rows) y[static_cast<long long>(t) * rows + row0 + r] = v;
                    }
                }
                __syncthreads();
            }
        }
    }
}

// How this lane works on rows of n weights (n % 8 == 0) in blocks of B: chunks of 8 weights. The
// caller builds it where it builds the loop (gemv.cu: once per kernel), as before the body moved
// here: computed inside gemv_batch_rows, ptxas gave strata_gemv_batch_f16 two more registers.
template <class B>
struct ChunkLanes {
    int chunks, lane;
    long long row_bytes;

    __device__ __forceinline__ explicit ChunkLanes(int n)
        : chunks(n / 8), lane(threadIdx.x & 31), row_bytes(static_cast<long long>(n / B::kWeights) * B::kBytes) {}
};

// y[t, row0 + r] = W[row0 + r, :] . x[t, :] for t < batch <= kMaxBatch, r < kBatchRows: one warp.
// x 16-byte aligned.
template <class B>
__device__ __forceinline__ void gemv_batch_rows(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                                float* __restrict__ y, int rows, int n, int batch, int row0,
                                                const ChunkLanes<B>& L) {
    constexpr int R = kBatchRows, kChunks = B::kWeights / 8;
    const int chunks = L.chunks, lane = L.lane;
    const long long row_bytes = L.row_bytes;
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

}  // namespace strata_gemv
