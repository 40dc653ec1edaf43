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
#include <type_traits>

#include "gemv_units.cuh"
#include "quant_blocks.cuh"

namespace strata_gemv {

constexpr int kMaxBatch = 8;   // tokens of the batched body (a speculative verify window)
constexpr int kBatchRows = 4;  // rows per warp of the batched body
#ifndef STRATA_ROWS_GROUP
#define STRATA_ROWS_GROUP 4
#endif
// Tokens a row-invariant body holds sums for at once (kRowsGroup x kRows accumulators a lane); a
// larger batch goes through in groups of them, each a pass of its own over the weights. A token's
// sums are the same operations in the same order whatever the group, so the bits do not depend on it.
// Measured on an H100 (tools/gemv_rows_ab.py, the 30B shape's Q8_0, us a launch at 2 / 4 / 8 tokens,
// groups of 8 -> 4): the attention output 17.2 / 25.7 / 42.3 -> 13.0 / 17.8 / 30.3, the head
// 208 / 343 / 600 -> 174 / 284 / 555, the fused q|k|v unchanged (18.1 at 4); groups of 2 lost at 4 and 8.
// Fewer accumulators, fewer registers (Q8_0 rows_split 160 -> 128): more blocks a multiprocessor.
// The four parallel slots' step went 6.23 -> 5.79 ms. STRATA_ROWS_GROUP exists for such A/Bs
// (tools/variants); the package builds with the default.
constexpr int kRowsGroup = STRATA_ROWS_GROUP;
static_assert(kRowsGroup >= 1 && kRowsGroup <= kMaxBatch, "kRowsGroup");

// f(t0, g) for the groups [t0, t0 + g) of `batch` tokens, kRowsGroup at a time.
template <class F>
__device__ __forceinline__ void for_groups(int batch, F f) {
#pragma unroll 1
    for (int t0 = 0; t0 < batch; t0 += kRowsGroup) f(t0, min(kRowsGroup, batch - t0));
}

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

// y[t, row0 + r] for t < batch, r < U::kRows: the lane sums of acc, written by each row set's first lane
// (every row-invariant body ends its row set so).
template <class U, int B>
__device__ __forceinline__ void store_rows(const float (&acc)[B][U::kRows], const UnitLanes<U>& L, float* y, int rows,
                                           int row0, int batch) {
#pragma unroll
    for (int t = 0; t < B; ++t) {
        if (t < batch) {
#pragma unroll
            for (int r = 0; r < U::kRows; ++r) {
                const float v = sum_lanes(acc[t][r], L.lanes);
                if (L.sl == 0 && row0 + r < rows) y[static_cast<long long>(t) * rows + row0 + r] = v;
            }
        }
    }
}

// ---- staged x --------------------------------------------------------------------------------
// The decode GEMVs' x rows in shared memory, a tile of quant blocks at a time, each 32-weight block's
// values padded to kStride floats: a lane's 16-byte reads of its unit then touch distinct banks within
// each quarter warp, where from global memory each of a warp's x loads touched 32 cache lines (a
// lane's unit is 128 bytes of x, apart from its neighbours'), once per token. Only where x comes from
// changes; the arithmetic and its order are the global path's, so the bits are too. Taken by the
// whole-matrix bodies (gemv_body, gemv3_body: B = 1; gemv_multi_body, gemv3_rows_body: B = kRowsGroup)
// of the unit types of one 32-weight block per unit (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL). Measured
// on an H100 (tools/gemv_rows_ab.py, the 30B shape's Q8_0, us a launch, global -> staged): the head
// 151936 x 2048 at 1 / 2 / 4 / 8 tokens 154 / 248 / 433 / 817 -> 140 / 200 / 329 / 583; the fused
// q|k|v 10.7 / 15.8 / 23.5 / 38.1 -> 10.5 / 12.8 / 18.3 / 32.1. Not the split bodies: the attention
// output 2048 x 4096 went 9.6 / 17.3 / 26.4 / 43.8 -> 10.0 / 16.3 / 32.1 / 66.2 (a block covers one
// row set there, so each block stages all of x for a few rows' work).
constexpr int kStageFloats = 9216;   // 36 KB: 4 tokens of a 2048-weight row in one tile
constexpr int kStride = 36;

template <class U>
struct Stageable : std::bool_constant<U::kUnits == 1 && U::kBlockWeights == 32> {};

// U with one row a lane: the one-token kernels strata_gemv_one_<q> and strata_gemv3_one_<q> (#16). A
// row's sum is the same operations in the same order whatever kRows is (a lane's units, U::dot, the
// shuffle tree), so these give the bits of the kRows bodies and of their row-invariant batches. Four
// times the warps for the same rows: measured on an H100 (tools/pdl_chain_bench.py, the 30B shape's
// Q8_0 in chains from a graph), q|k|v 9.01 -> 6.40 us and the attention output 12.19 -> 5.73; in the
// decode step's graph (H100), where small kernels come between, 8.29 -> 7.94 and 7.62 (split-K) -> 6.67.
template <class U>
struct OneRow : U {
    static constexpr int kRows = 1;
};

template <class X>
__device__ __forceinline__ auto fill_sum(X& x, int) -> decltype(x.sum = 0.f, void()) {
    x.sum = strata_q::sum_floats<32>(x.v);   // as load_x32
}
template <class X>
__device__ __forceinline__ void fill_sum(X&, long) {}

template <class U>
__device__ __forceinline__ void load_staged_x(const float* p, typename U::X& x) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float4 f = reinterpret_cast<const float4*>(p)[k];
        x.v[4 * k] = f.x, x.v[4 * k + 1] = f.y, x.v[4 * k + 2] = f.z, x.v[4 * k + 3] = f.w;
    }
    fill_sum(x, 0);
}

// Blocks [b0, b0 + nb) of x rows t < batch into xs ([t][block][kStride]); every thread of the block
// takes part (the caller puts the barriers around it).
template <int kThreads>
__device__ __forceinline__ void stage_x_tile(const float* __restrict__ x, int n, int batch, int b0, int nb,
                                             float* xs) {
    const int quads = nb * 8, total = batch * quads;
    for (int i = threadIdx.x; i < total; i += kThreads) {
        const int t = i / quads, q = i - t * quads, b = q >> 3, j = (q & 7) * 4;
        const float4 v = __ldg(reinterpret_cast<const float4*>(x + static_cast<long long>(t) * n + 32LL * (b0 + b)) + (q & 7));
        *reinterpret_cast<float4*>(xs + (t * nb + b) * kStride + j) = v;
    }
}

// The first unit >= u0 of the sequence u_first, u_first + u_step, ...
__device__ __forceinline__ int first_from(int u_first, int u_step, int u0) {
    return u_first >= u0 ? u_first : u_first + (u0 - u_first + u_step - 1) / u_step * u_step;
}

// gemv_rows_acc_multi over the tile [u0, u1) of units, x from the staged tile (nb blocks a token).
template <class U, int B>
__device__ __forceinline__ void acc_multi_tile(const uint8_t* const (&row_ptr)[U::kRows], const float* xs, int nb,
                                               int u0, int u1, const float* table, int u_first, int u_step,
                                               int batch, float (&acc)[B][U::kRows]) {
    constexpr int R = U::kRows;
    for (int u = first_from(u_first, u_step, u0); u < u1; u += u_step) {
        typename U::Raw raw[R];
#pragma unroll
        for (int r = 0; r < R; ++r) U::load(row_ptr[r] + static_cast<long long>(u) * U::kBlockBytes, 0, raw[r]);
#pragma unroll
        for (int t = 0; t < B; ++t) {
            if (t < batch) {
                typename U::X xv;
                load_staged_x<U>(xs + (t * nb + (u - u0)) * kStride, xv);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[t][r] += U::dot(raw[r], 0, xv, table);
            }
        }
    }
}

// A block-uniform loop over row groups: each round, every warp may take a row set (valid) or not;
// x is staged tile by tile for all of them, and acc of the valid ones collected. emit(acc) writes.
// Returns after the last round any warp of the block had work in. kOnce: x staged once for all rounds
// where it fits one tile (staged_gemv, whose grid the host caps; not staged_three, one round a block).
template <int kWarps, class U, int B, bool kOnce, class Find, class Emit>
__device__ __forceinline__ void staged_rounds(const float* __restrict__ x, int n, int batch, const float* table,
                                              Find find, Emit emit, int u_first, int u_step) {
    constexpr int R = U::kRows;
    constexpr int kFloats = B == 1 ? kStageFloats / 2 : kStageFloats;   // one token: a 4096-weight row, 18 KB
    __shared__ __align__(16) float xs[kFloats];
    const int num_blocks = n / 32;
    const int nb = max(1, min(num_blocks, kFloats / (batch * kStride)));
    // x in one tile (the 30B shape's rows of 2048 and 4096 weights at one token, of 2048 at up to four):
    // staged once for all the block's rounds, so a grid of a few blocks a multiprocessor reads x once
    // a block instead of once a row set.
    const bool whole = kOnce && num_blocks <= nb;
    if (whole) stage_x_tile<kWarps * 32>(x, n, batch, 0, num_blocks, xs);     // the first round's barrier orders it
    for (int round = 0;; ++round) {
        const uint8_t* row_ptr[R];
        const bool valid = find(round, row_ptr);
        if (!__syncthreads_or(valid)) return;
        float acc[B][R];
#pragma unroll
        for (int t = 0; t < B; ++t)
#pragma unroll
            for (int r = 0; r < R; ++r) acc[t][r] = 0.f;
        if (whole) {
            if (valid) acc_multi_tile<U, B>(row_ptr, xs, num_blocks, 0, num_blocks, table, u_first, u_step, batch, acc);
        } else {
            for (int b0 = 0; b0 < num_blocks; b0 += nb) {
                const int cnt = min(nb, num_blocks - b0);
                __syncthreads();                  // the last tile's readers are done
                stage_x_tile<kWarps * 32>(x, n, batch, b0, cnt, xs);
                __syncthreads();
                if (valid) acc_multi_tile<U, B>(row_ptr, xs, cnt, b0, b0 + cnt, table, u_first, u_step, batch, acc);
            }
        }
        emit(valid, acc);
    }
}

// y = W x for batch <= B tokens, x staged (Stageable U): warp w of the block takes row set
// blockIdx.x * kWarps + w, then that plus gridDim.x * kWarps, ...: any grid is complete. B = 1: the
// one-token kernel (gemv_body), B = kRowsGroup: the row-invariant batches (gemv_multi_body), a group of tokens a call.
template <int kWarps, class U, int B>
__device__ __forceinline__ void staged_gemv(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                            float* __restrict__ y, int rows, int n, const float* table, int batch) {
    constexpr int R = U::kRows;
    const UnitLanes<U> L(n);
    const long long rows_per_warp = (32 / L.lanes) * R;
    const long long warp = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    const long long stride = static_cast<long long>(gridDim.x) * kWarps * rows_per_warp;
    int row0 = 0;
    auto find = [&](int round, const uint8_t* (&row_ptr)[R]) {
        const long long base = warp * rows_per_warp + round * stride;
        row0 = static_cast<int>(min(base, static_cast<long long>(rows))) + L.sub * R;
#pragma unroll
        for (int r = 0; r < R; ++r) row_ptr[r] = W + static_cast<long long>(min(row0 + r, rows - 1)) * L.row_bytes;
        return base < rows;
    };
    auto emit = [&](bool valid, const float (&acc)[B][R]) {
        if (valid) store_rows<U, B>(acc, L, y, rows, row0, batch);
    };
    staged_rounds<kWarps, U, B, true>(x, n, batch, table, find, emit, L.sl, L.lanes);
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
    if constexpr (Stageable<U>::value) {
        staged_gemv<kWarps, U, 1>(W, x, y, rows, n, table, 1);
    } else {
        const UnitLanes<U> L(n);
        const long long rows_per_warp = (32 / L.lanes) * U::kRows;
        const long long warp = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
        const long long num_warps = static_cast<long long>(gridDim.x) * kWarps;
        for (long long base = warp * rows_per_warp; base < rows; base += num_warps * rows_per_warp)
            gemv_rows<U>(W, x, y, rows, static_cast<int>(base) + L.sub * U::kRows, L, table);
    }
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
template <class U, int B>
__device__ __forceinline__ void gemv_rows_acc_multi(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                                    int n, int rows, int row0, const UnitLanes<U>& L,
                                                    const float* table, int u_first, int u_step, int batch,
                                                    float (&acc)[B][U::kRows]) {
    constexpr int R = U::kRows;
    const uint8_t* row_ptr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) row_ptr[r] = W + static_cast<long long>(min(row0 + r, rows - 1)) * L.row_bytes;
#pragma unroll
    for (int t = 0; t < B; ++t)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[t][r] = 0.f;
    for (int u = u_first; u < L.units; u += u_step) {
        const int b = u / U::kUnits, c = u - b * U::kUnits;
        typename U::Raw raw[R];
#pragma unroll
        for (int r = 0; r < R; ++r) U::load(row_ptr[r] + static_cast<long long>(b) * U::kBlockBytes, c, raw[r]);
#pragma unroll
        for (int t = 0; t < B; ++t) {
            if (t < batch) {
                typename U::X xv;
                U::load_x(x + static_cast<long long>(t) * n + static_cast<long long>(b) * U::kBlockWeights, c, xv);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[t][r] += U::dot(raw[r], c, xv, table);
            }
        }
    }
}

// batch <= kMaxBatch tokens, kRowsGroup at a time.
template <class U>
__device__ __forceinline__ void gemv_rows_multi(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                                float* __restrict__ y, int rows, int n, int row0,
                                                const UnitLanes<U>& L, const float* table, int batch) {
    constexpr int R = U::kRows;
    for_groups(batch, [&](int t0, int g) {
        float acc[kRowsGroup][R];
        gemv_rows_acc_multi<U, kRowsGroup>(W, x + static_cast<long long>(t0) * n, n, rows, row0, L, table, L.sl,
                                           L.lanes, g, acc);
        store_rows<U, kRowsGroup>(acc, L, y + static_cast<long long>(t0) * rows, rows, row0, g);
    });
}

template <int kWarps, class U>
__device__ __forceinline__ void gemv_multi_body(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                                float* __restrict__ y, int rows, int n, const float* table,
                                                int batch) {
    if constexpr (Stageable<U>::value) {
        for_groups(batch, [&](int t0, int g) {
            staged_gemv<kWarps, U, kRowsGroup>(W, x + static_cast<long long>(t0) * n,
                                               y + static_cast<long long>(t0) * rows, rows, n, table, g);
        });
    } else {
        const UnitLanes<U> L(n);
        const long long rows_per_warp = (32 / L.lanes) * U::kRows;
        const long long warp = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
        const long long num_warps = static_cast<long long>(gridDim.x) * kWarps;
        for (long long base = warp * rows_per_warp; base < rows; base += num_warps * rows_per_warp)
            gemv_rows_multi<U>(W, x, y, rows, n, static_cast<int>(base) + L.sub * U::kRows, L, table, batch);
    }
}

// gemv_split_body for batch <= B tokens: every token's lane sums go to shared memory at once, and after
// one barrier the block's threads each finish a (token, row) pair, adding the warps' partials in
// warp order as the one-token kernel does (one barrier a row set, where a barrier pair a token was).
// Not inlined: inlined into for_groups' loop, ptxas gave the Q8_0 kernel 255 registers (128 alone).
template <int kWarps, class U, int B>
__device__ __noinline__ void gemv_split_group(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                                 float* __restrict__ y, int rows, int n, const float* table,
                                                 int batch) {
    constexpr int R = U::kRows;
    __shared__ float part[kWarps][B][32 * R];
    const UnitLanes<U> L(n);
    const int warp = threadIdx.x >> 5;
    const int rows_per_block = (32 / L.lanes) * R;
    for (long long base = blockIdx.x * rows_per_block; base < rows; base += gridDim.x * rows_per_block) {
        const int row0 = static_cast<int>(base) + L.sub * R;
        float acc[B][R];
        gemv_rows_acc_multi<U, B>(W, x, n, rows, row0, L, table, L.sl + warp * L.lanes, L.lanes * kWarps, batch, acc);
#pragma unroll
        for (int t = 0; t < B; ++t) {
            if (t < batch) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const float v = sum_lanes(acc[t][r], L.lanes);
                    if (L.sl == 0) part[warp][t][L.sub * R + r] = v;
                }
            }
        }
        __syncthreads();
        for (int i = threadIdx.x; i < batch * rows_per_block; i += kWarps * 32) {
            const int t = i / rows_per_block, q = i - t * rows_per_block;
            float v = part[0][t][q];
            for (int w = 1; w < kWarps; ++w) v += part[w][t][q];
            if (base + q < rows) y[static_cast<long long>(t) * rows + base + q] = v;
        }
        __syncthreads();
    }
}

template <int kWarps, class U>
__device__ __forceinline__ void gemv_split_multi_body(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                                      float* __restrict__ y, int rows, int n, const float* table,
                                                      int batch) {
    for_groups(batch, [&](int t0, int g) {
        gemv_split_group<kWarps, U, kRowsGroup>(W, x + static_cast<long long>(t0) * n,
                                                y + static_cast<long long>(t0) * rows, rows, n, table, g);
    });
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
