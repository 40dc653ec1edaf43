// Decode GEMV with the dequantization fused in: y = W x for one token, or for a few tokens at once.
//
// strata_gemv_<qtype>(W, x, y, rows, n)
//   y[r] = sum_k W[r, k] * x[k], float32 accumulation.
// strata_gemv_batch_<qtype>(W, x, y, rows, n, batch)
//   y[b, r] = sum_k W[r, k] * x[b, k] for b < batch <= 8 (a prompt's few tokens; its own sum order).
// strata_gemv_rows_<qtype>, strata_gemv_rows_split_<qtype>(W, x, y, rows, n, batch)
//   the same y, row-invariant: row b is bit for bit strata_gemv_<qtype> (strata_gemv_split_<qtype>)
//   on x[b] (gemv_rows.cuh's multi bodies), for a speculative verify window or parallel slots;
//   kRowsGroup (4) tokens a pass over W.
//
// Layout: W is [rows, n] in the type's native block bytes (row r at r * (n / block_size) * type_size),
// 16-byte aligned; x is [n] (or [batch, n]) float32, 16-byte aligned (4 for a float type with n % 8
// != 0); y is [rows] (or [batch, rows]) float32, 4-byte aligned. n is a multiple of the block size;
// for F32, F16 and BF16 any n works, and the batched kernel needs n % 8 == 0.
//
// The row bodies live in gemv_rows.cuh, one copy shared with strata_moe_gemv_* and strata_gemv3_*.
//
// Single token (gemv_body): a row is cut into units (gemv_units*.cuh: 32 or 64 weights of a quant
// type, 8 of a float type); `lanes` = the power of two >= units per row, at most 32, lanes work on
// one row set, so short rows share a warp. Each lane loads the x values of its unit once and uses
// them for kRows rows (2 or 4) whose bytes it loads first, all at once: x is read from L1 kRows
// times less often, and several independent loads are in flight per lane. Lane sums are reduced
// with shuffles. The types of one 32-weight block per unit (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL)
// read x from a padded tile in shared memory instead (gemv_rows.cuh's staged x; not the split
// kernels); the others read it from global memory.
//
// Split (strata_gemv_split_<qtype>, same arguments): for matrices of few rows, a block covers one
// warp's row set and its kWarps warps split the units of those rows (gemv_split_body); grid =
// ceil(rows / ((32 / lanes) * kRows)), any grid correct. Sums in another order than the unsplit
// kernel (a row's units go to 4 warps, then warp order), so it is not bitwise equal to it.
//
// Router with its routing (strata_router_split_f32(W, x, y, rows, n, ids, weights, counter, A, norm_topk),
// strata_router_rows_split_f32(W, x, y, rows, n, batch, ids, weights, counter, A, norm_topk)): y as
// strata_gemv_split_f32 (strata_gemv_rows_split_f32), then the last block to finish (counted on
// *counter, an int the caller zeroes once; that block puts it back to 0) routes each token's `rows`
// logits as strata_moe_route_f32 does (cuda/route.cuh: the same code, so the same ids and weights)
// into ids [batch, A] and weights [batch, A]: a decode step's top-k without a launch of its own.
// One row a lane (RouterUnit8): grid = rows / (32 / lanes), any grid correct.
//
// One row a warp (strata_gemv_one_<qtype>, same arguments; Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL): the
// single-token body with kRows = 1, so four times the warps read the same rows, each row's sum the
// same bits as strata_gemv_<qtype>'s. Grid: ceil(rows / 4) (one row a warp), capped as gemv_whole_grid.
//
// Batched (gemv_batch_rows): each lane decodes 8 weights of each of 4 rows with the exact decoders
// and multiplies them with the same 8 x values of every token; a warp covers 32 chunks of 8.
//
// Launch: block = (128, 1, 1) (kWarps warps); any grid is correct, since warps stride over row
// sets. strata/backends/cuda/memory.py (gemv_grid) sizes the grid to one row set per warp from the units' kUnits and
// kRows (mirrored there as GEMV_UNITS), capped at 4 blocks a multiprocessor where a staged body keeps
// x in one tile for all its rounds (gemv_whole_grid); the batched kernel takes 4 rows per warp.
//
// Measured (H200, tools/quant_kernel_report.py, launches back to back; device copy 4250 GB/s read +
// write): at 151936 x 2048 F16 / BF16 read W at 4320 GB/s, Q5_1 2390, Q8_0 2210, Q4_K 1350, Q6_K
// 1140, Q2_K 1140, IQ4_XS 1030; at 4096 x 2048 every type takes 7-10 us, at 768 x 2048 5-8 us (the
// per-launch floor); batched B = 8 at 4096 x 2048 23-28 us. Likely limit of the quant types (from
// the access pattern; not yet checked with ncu): a 32- or 64-weight unit puts neighbouring lanes'
// x runs 128-256 bytes apart, so each 16-byte x load touches 32 L1 lines, where the float types'
// 8-weight units touch 4. Staging x in shared memory (gemv_rows.cuh) took the Q8_0 head from 154 to
// 140 us at one token and from 433 to 329 at four (H100).

#include <cstdint>

#include "gemv_rows.cuh"
#include "gemv_units.cuh"
#include "gemv_units_k.cuh"
#include "quant_blocks.cuh"
#include "norm_rope.cuh"
#include "pdl.cuh"
#include "route.cuh"

namespace {

using namespace strata_q;
using namespace strata_gemv;

constexpr int kWarps = 4;

template <class B>
__device__ __forceinline__ void gemv_batch_body(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                                float* __restrict__ y, int rows, int n, int batch) {
    const ChunkLanes<B> L(n);
    const long long warp = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    const long long num_warps = static_cast<long long>(gridDim.x) * kWarps;
    for (long long base = warp * kBatchRows; base < rows; base += num_warps * kBatchRows)
        gemv_batch_rows<B>(W, x, y, rows, n, batch, static_cast<int>(base), L);
}

}  // namespace

#define STRATA_GEMV_BATCH(name, Block)                                                                 \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_batch_##name(const uint8_t* W, const float* x, float* y, int rows, int n, int batch) { \
        STRATA_PDL_ENTRY();                                                                            \
        gemv_batch_body<Block>(W, x, y, rows, n, batch);                                               \
    }

#define STRATA_GEMV(name, Unit, Block)                                                                 \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_##name(const uint8_t* W, const float* x, float* y, int rows, int n) {              \
        STRATA_PDL_ENTRY();                                                                            \
        gemv_body<kWarps, Unit>(W, x, y, rows, n, nullptr);                                            \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_split_##name(const uint8_t* W, const float* x, float* y, int rows, int n) {        \
        STRATA_PDL_ENTRY();                                                                            \
        gemv_split_body<kWarps, Unit>(W, x, y, rows, n, nullptr);                                      \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_rows_##name(const uint8_t* W, const float* x, float* y, int rows, int n, int batch) { \
        STRATA_PDL_ENTRY();                                                                            \
        gemv_multi_body<kWarps, Unit>(W, x, y, rows, n, nullptr, batch);                               \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_rows_split_##name(const uint8_t* W, const float* x, float* y, int rows, int n, int batch) { \
        STRATA_PDL_ENTRY();                                                                            \
        gemv_split_multi_body<kWarps, Unit>(W, x, y, rows, n, nullptr, batch);                         \
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
        STRATA_PDL_ENTRY();                                                                            \
        __shared__ float table[16];                                                                    \
        fill_iq4_table(table);                                                                         \
        gemv_body<kWarps, Unit>(W, x, y, rows, n, table);                                              \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_split_##name(const uint8_t* W, const float* x, float* y, int rows, int n) {        \
        STRATA_PDL_ENTRY();                                                                            \
        __shared__ float table[16];                                                                    \
        fill_iq4_table(table);                                                                         \
        gemv_split_body<kWarps, Unit>(W, x, y, rows, n, table);                                        \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_rows_##name(const uint8_t* W, const float* x, float* y, int rows, int n, int batch) { \
        STRATA_PDL_ENTRY();                                                                            \
        __shared__ float table[16];                                                                    \
        fill_iq4_table(table);                                                                         \
        gemv_multi_body<kWarps, Unit>(W, x, y, rows, n, table, batch);                                 \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_rows_split_##name(const uint8_t* W, const float* x, float* y, int rows, int n, int batch) { \
        STRATA_PDL_ENTRY();                                                                            \
        __shared__ float table[16];                                                                    \
        fill_iq4_table(table);                                                                         \
        gemv_split_multi_body<kWarps, Unit>(W, x, y, rows, n, table, batch);                           \
    }                                                                                                  \
    STRATA_GEMV_BATCH(name, Block)

STRATA_GEMV_IQ4(iq4_nl, UnitIQ4_NL, BlockIQ4_NL)
STRATA_GEMV_IQ4(iq4_xs, UnitIQ4_XS, BlockIQ4_XS)

// One row a warp (gemv_rows.cuh's OneRow), the staged types only: y as strata_gemv_<qtype>, bit for
// bit (the kernel path one-row-gemv). Grid as gemv_whole_grid's with one row a lane.
#define STRATA_GEMV_ONE(name, Unit)                                                                    \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_one_##name(const uint8_t* W, const float* x, float* y, int rows, int n) {          \
        STRATA_PDL_ENTRY();                                                                            \
        gemv_body<kWarps, OneRow<Unit>>(W, x, y, rows, n, nullptr);                                    \
    }

STRATA_GEMV_ONE(q4_0, UnitQ4_0)
STRATA_GEMV_ONE(q4_1, UnitQ4_1)
STRATA_GEMV_ONE(q5_0, UnitQ5_0)
STRATA_GEMV_ONE(q5_1, UnitQ5_1)
STRATA_GEMV_ONE(q8_0, UnitQ8_0)

extern "C" __global__ void __launch_bounds__(kWarps * 32)
    strata_gemv_one_iq4_nl(const uint8_t* W, const float* x, float* y, int rows, int n) {
    STRATA_PDL_ENTRY();
    __shared__ float table[16];
    fill_iq4_table(table);
    gemv_body<kWarps, OneRow<UnitIQ4_NL>>(W, x, y, rows, n, table);
}

// Float types: 8 weights per unit (16-byte loads) when n % 8 == 0, else one; the branch is uniform.
#define STRATA_GEMV_FLOAT(name, Block, Elem)                                                           \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_##name(const uint8_t* W, const float* x, float* y, int rows, int n) {              \
        STRATA_PDL_ENTRY();                                                                            \
        if (n % 8 == 0)                                                                                \
            gemv_body<kWarps, UnitFloat8<Block>>(W, x, y, rows, n, nullptr);                           \
        else                                                                                           \
            gemv_body<kWarps, UnitFloat1<Elem>>(W, x, y, rows, n, nullptr);                            \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_split_##name(const uint8_t* W, const float* x, float* y, int rows, int n) {        \
        STRATA_PDL_ENTRY();                                                                            \
        if (n % 8 == 0)                                                                                \
            gemv_split_body<kWarps, UnitFloat8<Block>>(W, x, y, rows, n, nullptr);                     \
        else                                                                                           \
            gemv_split_body<kWarps, UnitFloat1<Elem>>(W, x, y, rows, n, nullptr);                      \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_rows_##name(const uint8_t* W, const float* x, float* y, int rows, int n, int batch) { \
        STRATA_PDL_ENTRY();                                                                            \
        if (n % 8 == 0)                                                                                \
            gemv_multi_body<kWarps, UnitFloat8<Block>>(W, x, y, rows, n, nullptr, batch);              \
        else                                                                                           \
            gemv_multi_body<kWarps, UnitFloat1<Elem>>(W, x, y, rows, n, nullptr, batch);               \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kWarps * 32)                                         \
        strata_gemv_rows_split_##name(const uint8_t* W, const float* x, float* y, int rows, int n, int batch) { \
        STRATA_PDL_ENTRY();                                                                            \
        if (n % 8 == 0)                                                                                \
            gemv_split_multi_body<kWarps, UnitFloat8<Block>>(W, x, y, rows, n, nullptr, batch);        \
        else                                                                                           \
            gemv_split_multi_body<kWarps, UnitFloat1<Elem>>(W, x, y, rows, n, nullptr, batch);         \
    }                                                                                                  \
    STRATA_GEMV_BATCH(name, Block)

STRATA_GEMV_FLOAT(f32, BlockF32x8, ElemF32)

namespace {

// The router's F32 units, one row a lane: a split block covers (32 / lanes) rows instead of twice
// that, so a 128 x 2048 router takes 128 blocks, not 64. A row's sums do not depend on how many rows
// a lane holds (gemv_rows_acc: each row its own chain over the lane's units), so the logits are
// strata_gemv_split_f32's bit for bit.
struct RouterUnit8 : UnitFloat8<BlockF32x8> {
    static constexpr int kRows = 1;
};

// After the whole body of a block (its y rows written): the grid's last block routes every token.
__device__ __forceinline__ void route_in_last_block(const float* y, int rows, int batch, int* ids, float* weights,
                                                    int* counter, int A, int norm_topk) {
    __shared__ bool last;
    __threadfence();  // this block's rows of y before its count
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1) == static_cast<int>(gridDim.x) - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int t = threadIdx.x >> 5; t < batch; t += kWarps)
        strata_route::route_token<true>(y + static_cast<long long>(t) * rows, ids, weights, t, rows, A, norm_topk);
    if (threadIdx.x == 0) *counter = 0;  // every block has counted: ready for the next launch
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kWarps * 32)
    strata_router_split_f32(const uint8_t* W, const float* x, float* y, int rows, int n, int* ids, float* weights,
                            int* counter, int A, int norm_topk) {
    STRATA_PDL_ENTRY();
    if (n % 8 == 0)
        gemv_split_body<kWarps, RouterUnit8>(W, x, y, rows, n, nullptr);
    else
        gemv_split_body<kWarps, UnitFloat1<ElemF32>>(W, x, y, rows, n, nullptr);
    route_in_last_block(y, rows, 1, ids, weights, counter, A, norm_topk);
}

extern "C" __global__ void __launch_bounds__(kWarps * 32)
    strata_router_rows_split_f32(const uint8_t* W, const float* x, float* y, int rows, int n, int batch, int* ids,
                                 float* weights, int* counter, int A, int norm_topk) {
    STRATA_PDL_ENTRY();
    if (n % 8 == 0)
        gemv_split_multi_body<kWarps, RouterUnit8>(W, x, y, rows, n, nullptr, batch);
    else
        gemv_split_multi_body<kWarps, UnitFloat1<ElemF32>>(W, x, y, rows, n, nullptr, batch);
    route_in_last_block(y, rows, batch, ids, weights, counter, A, norm_topk);
}
namespace {

// The router's F32 units with x read from shared memory (the block's normed rows): UnitFloat8's dot, so
// a row's sums are strata_gemv_split_f32's bit for bit.
struct RouterUnitShared : UnitFloat8<BlockF32x8> {
    static __device__ __forceinline__ void load_x(const float* xb, int, X& x) {
        const float4 a = reinterpret_cast<const float4*>(xb)[0], b = reinterpret_cast<const float4*>(xb)[1];
        x.v[0] = a.x, x.v[1] = a.y, x.v[2] = a.z, x.v[3] = a.w, x.v[4] = b.x, x.v[5] = b.y, x.v[6] = b.z, x.v[7] = b.w;
    }
};

constexpr int kNormThreads = 256;   // strata_add_rms_norm_f32's block, whose sum order these blocks replay

// strata_norm::block_sum over kNormThreads virtual threads, run by this block's 128: thread i holds the
// partials of virtual threads i (p0) and i + 128 (p1), virtual warps w and w + 4 of real warp w.
__device__ __forceinline__ float block_sum_virtual(float p0, float p1) {
    __shared__ float warp_sums[kNormThreads / 32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    p0 = strata_norm::warp_sum(p0);
    p1 = strata_norm::warp_sum(p1);
    if (lane == 0) warp_sums[warp] = p0, warp_sums[warp + kWarps] = p1;
    __syncthreads();
    if (warp == 0) {
        float v = lane < kNormThreads / 32 ? warp_sums[lane] : 0.0f;
        v = strata_norm::warp_sum(v);
        if (lane == 0) total = v;
    }
    __syncthreads();
    return total;
}

// Row t of strata_add_rms_norm_f32 (its vec path, a block of 256) in this block: a = x + y, the sum of
// squares in that kernel's order, then a * scale * w into xs (shared memory); block 0 also writes a to
// x_out and the normed row to normed. x, y, w 16-byte aligned, n % 4 == 0.
__device__ __forceinline__ void add_norm_row(const float* x, const float* y, float* x_out, const float* __restrict__ w,
                                             float* normed, float* xs, int n, float eps) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* y4 = reinterpret_cast<const float4*>(y);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    const int quads = n / 4;
    float part[2] = {0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {              // virtual thread v = threadIdx.x + 128 h: quads v, v + 256, ...
        for (int i = threadIdx.x + kWarps * 32 * h; i < quads; i += kNormThreads) {
            const float4 a = x4[i], b = y4[i];
            const float4 v = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
            reinterpret_cast<float4*>(xs)[i] = v;
            part[h] += strata_norm::sum_sq4(v);
        }
    }
    const float scale = strata_norm::rms_scale(block_sum_virtual(part[0], part[1]), n, eps);
    const bool first = blockIdx.x == 0;
    for (int i = threadIdx.x; i < quads; i += kWarps * 32) {   // each thread rescales only its own quads
        const float4 v = reinterpret_cast<const float4*>(xs)[i], g = w4[i];
        const float4 o = make_float4(strata_norm::rms_apply(v.x, scale, g.x), strata_norm::rms_apply(v.y, scale, g.y),
                                     strata_norm::rms_apply(v.z, scale, g.z), strata_norm::rms_apply(v.w, scale, g.w));
        reinterpret_cast<float4*>(xs)[i] = o;
        if (first) reinterpret_cast<float4*>(x_out)[i] = v, reinterpret_cast<float4*>(normed)[i] = o;
    }
}

}  // namespace

// strata_add_norm_router_f32(x, y, x_out, norm_w, normed, W, logits, rows, n, batch, eps)
//   The post-attention residual add and RMSNorm of `batch` tokens (strata_add_rms_norm_f32: x_out = x + y,
//   normed = rms_norm(x_out) * norm_w, bit for bit) and the F32 router over the normed rows (logits
//   [batch, rows] = W normed, strata_gemv_split_f32 / strata_gemv_rows_split_f32's sums bit for bit), in one
//   launch: every block normalizes the rows itself into shared memory (block 0 writes x_out and normed)
//   while its share of W streams into the L2, so the norm costs no launch of its own.
//   Layout: x, y, x_out, normed [batch, n] f32, norm_w [n] f32, all 16-byte aligned, n % 8 == 0; W [rows, n]
//   F32. Launch: as strata_gemv_split_f32's (any grid), block 128, dynamic shared memory batch * n * 4.
extern "C" __global__ void __launch_bounds__(kWarps * 32)
    strata_add_norm_router_f32(const float* x, const float* y, float* x_out, const float* __restrict__ norm_w,
                               float* normed, const uint8_t* W, float* logits, int rows, int n, int batch, float eps) {
    STRATA_PDL_ENTRY();
    extern __shared__ float4 xs4[];
    float* xs = reinterpret_cast<float*>(xs4);
    {   // the block's first row set of W into the L2 while the norm is made (UnitFloat8's R rows a block)
        const long long row_bytes = 4LL * n, base = static_cast<long long>(blockIdx.x) * RouterUnitShared::kRows;
        const long long lines = (min(static_cast<long long>(RouterUnitShared::kRows), rows - base) * row_bytes) >> 7;
        for (long long i = threadIdx.x; i < lines; i += kWarps * 32)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(W + base * row_bytes + (i << 7)));
    }
    for (int t = 0; t < batch; ++t) {
        const long long off = static_cast<long long>(t) * n;
        add_norm_row(x + off, y + off, x_out + off, norm_w, normed + off, xs + off, n, eps);
    }
    __syncthreads();
    if (batch == 1)
        gemv_split_body<kWarps, RouterUnitShared>(W, xs, logits, rows, n, nullptr);
    else
        gemv_split_multi_body<kWarps, RouterUnitShared>(W, xs, logits, rows, n, nullptr, batch);
}

STRATA_GEMV_FLOAT(f16, BlockF16x8, ElemF16)
STRATA_GEMV_FLOAT(bf16, BlockBF16x8, ElemBF16)
