// Causal prompt attention on Hopper's warpgroup MMA (wgmma, sm_90a only): cuda/attention_tc.cu's
// FlashAttention-2 kernel with both products on wgmma, for head dims 64 and 128.
//
// strata_attention_prefill_wg_f16_d<DH>(q, k_cache, v_cache, positions, out, T, H, Hk, scale), DH 64, 128
//   exactly strata_attention_prefill_tc_f16_d<DH>'s contract, grid (ceil(T * G / 64), Hk) and block
//   (128 threads), and the same precision bounds: out[t, h, :] = softmax_c(scale * q[t, h] . k[c, h / G])
//   v[c, h / G] over cells c <= positions[t].
//
// Built for sm_90a only (setup.py's ARCH_SPECIFIC); the host launches it under --kernels-on
// wgmma-attention on an sm_90 GPU whose build has it. Compiled for any other arch the entry points trap.
//
// Algorithm: attention_tc.cu's block (one warpgroup: 4 warps, 64 query rows of one KV head; Q
// scaled by scale * log2 e, rounded to f16 and held in registers as A fragments; 64-cell K/V tiles
// by cp.async, heaviest blocks first; the causal mask, the online softmax and the epilogue shared
// through attention_tc.cuh), with two changes:
// - S = Q K^T is wgmma.m64n64k16 with both operands in shared memory: Q (scaled and rounded to f16
//   as attention_tc.cu's fragments, then stored once in the K tile's core-matrix layout) and the K
//   tile; O += P V is wgmma.m64n<DH>k16 with A the P fragments in registers, made from S's
//   accumulators (whose per-warp layout is mma.m16n8k16's), and B the V tile, read N-major
//   (imm-trans-b 1).
// - Why Q is not a register operand too: so built (nvcc 13.0), ptxas gave the Dh-64 kernel's Q
//   fragments and P fragments the same registers, R88-R103, while Q was still live across the tile
//   loop, so every tile after the first multiplied K by the last tile's P (measured on an H100:
//   Dh 64 wrong, Dh 128 right; the SASS shows it). Q in shared memory leaves no register operand
//   live across the loop.
// - K/V tiles are stored as wgmma's no-swizzle core matrices (8 cells x 8 dims, 128 contiguous bytes:
//   cell c, 16-byte chunk dc of its row at chunk ((c / 8) * DH / 8 + dc) * 8 + c % 8); the 8 threads of a
//   cp.async phase copy 8 consecutive cells of one chunk, so stores hit distinct banks. For K (B of
//   S, K-major: k = dims) core matrices adjacent in dims lie 128 bytes apart (leading byte offset) and
//   those adjacent in cells DH * 16 bytes apart (stride byte offset); for V (B of P V, N-major: k =
//   cells) the same bytes give a leading offset of DH * 16 and a stride offset of 128.
// cp.async groups go K(0), V(0), then per tile K(j + 1) after S and V(j + 1) after P V (empty groups
// at the end), so "all but the newest group" is always the tile being read; the writes are fenced to
// the async proxy (fence.proxy.async) before the barrier that precedes each wgmma.
//
// tools/attention_wg_ab.py checks it against a float64 reference and attention_tc.cu and times both,
// from fatbins without a package build.

#include <cuda_fp16.h>

#include <cstdint>

namespace {

#include "attention_tc.cuh"
#include "wgmma.cuh"
#include "wgmma_attention.cuh"

__device__ __forceinline__ void cp_async_wait_but_newest() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }


// One 64-cell tile of a KV head's cache rows into core-matrix layout by cp.async (one commit group):
// a pass of the 128 threads copies PASS = 128 / CHUNKS cells, thread t the 16-byte chunk (t / 8) % CHUNKS
// of cell t % 8 + 8 (t / (8 CHUNKS)) of the pass; cells at or past num_cells are zero-filled, never read.
template <int DH>
struct CoreTileLoader {
    static constexpr int CHUNKS = DH / 8, PASS = kThreads / CHUNKS;  // cells a pass of the block copies
    int64_t row_stride;
    int num_cells, cell, part;
    __device__ __forceinline__ CoreTileLoader(int64_t stride, int cells)
        : row_stride(stride), num_cells(cells),
          cell((threadIdx.x & 7) + 8 * (threadIdx.x / (8 * CHUNKS))), part((threadIdx.x >> 3) % CHUNKS) {}
    __device__ __forceinline__ void operator()(unsigned base, const __half* src, int cell0) const {
#pragma unroll
        for (int it = 0; it < kCells / PASS; ++it) {
            const int c = cell + it * PASS;
            const bool valid = cell0 + c < num_cells;
            const unsigned dst = base + core_chunk<CHUNKS>(c, part) * 16;
            cp_async16(dst, valid ? src + (cell0 + c) * row_stride + part * 8 : src, valid);
        }
        cp_async_commit();
    }
};
static_assert(kThreads == 128 && kRows == 64 && kCells == 64, "one warpgroup, m64 wgmma tiles");

template <int DH>
__device__ __forceinline__ void attention_prefill_wg(const float* __restrict__ q, const __half* __restrict__ k_cache,
                                                     const __half* __restrict__ v_cache,
                                                     const int* __restrict__ positions, float* __restrict__ out,
                                                     int T, int H, int Hk, float scale) {
#ifdef STRATA_WG_TRAP
    __trap();
#else
    constexpr int KSTEPS = DH / 16, DTILES = DH / 8, CTILES = kCells / 8, CHUNKS = DH / 8;
    // core-matrix bytes: along dims 128, along cells CHUNKS * 128 (see the header)
    constexpr unsigned kDimStep = 128, kCellStep = CHUNKS * 128;
    __shared__ alignas(128) uint4 k_s[kCells * CHUNKS];
    __shared__ alignas(128) uint4 v_s[kCells * CHUNKS];
    __shared__ alignas(128) uint4 q_s[kRows * CHUNKS];  // Q in the K tile's layout (48 KB in all at Dh 128)
    int (*pos_s)[2] = reinterpret_cast<int (*)[2]>(&q_s[0]);  // the prologue's, before Q is stored there

    const int kvh = blockIdx.y, G = H / Hk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gq = lane >> 2, tq = lane & 3;
    const int64_t num_rows = static_cast<int64_t>(T) * G;
    const int64_t row0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kRows;  // heaviest first

    block_positions(positions, row0, num_rows, G, warp, lane, pos_s);
    int row_pos[2];
    unsigned qa[KSTEPS][4];
    const RowPlace rows{row0 + warp * 16 + gq, num_rows, G, H, kvh, DH};
    load_rows_q(q, positions, rows, tq, scale * kLog2e, row_pos, qa);
    __syncthreads();
    const Span span = block_span<kWarps>(pos_s);
    const int min_pos = span.min_pos, num_cells = span.num_cells;
    __syncthreads();  // every thread has read pos_s before Q overwrites it
    store_q_core(reinterpret_cast<unsigned*>(&q_s[0]), qa, warp * 16 + gq, tq);
    // made visible to wgmma by the first tile's fence and barrier
    const int num_tiles = (num_cells + kCells - 1) / kCells;

    const int64_t row_stride = static_cast<int64_t>(Hk) * DH;
    const __half* kb = k_cache + static_cast<int64_t>(kvh) * DH;
    const __half* vb = v_cache + static_cast<int64_t>(kvh) * DH;
    const unsigned k_base = smem_addr(&k_s[0]), v_base = smem_addr(&v_s[0]), q_base = smem_addr(&q_s[0]);
    const CoreTileLoader<DH> load_tile{row_stride, num_cells};

    float o[DTILES][4];
#pragma unroll
    for (int n = 0; n < DTILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    load_tile(k_base, kb, 0);
    load_tile(v_base, vb, 0);
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int cell0 = tile * kCells;
        cp_async_wait_but_newest();  // K(tile) landed (V(tile) may still be in flight)
        fence_proxy_async();
        __syncthreads();

        float s[CTILES][4];
#pragma unroll
        for (int n = 0; n < CTILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks)  // dims 16 ks .. + 15: core matrices 2 ks, 2 ks + 1 along dims
            wgmma_ss_n64(s, smem_desc(q_base + 2 * ks * kDimStep, kDimStep, kCellStep),
                         smem_desc(k_base + 2 * ks * kDimStep, kDimStep, kCellStep));
        wgmma_commit();
        wgmma_wait_all();
        __syncthreads();  // the K buffer is free
        if (tile + 1 < num_tiles) load_tile(k_base, kb, cell0 + kCells);
        else cp_async_commit();  // an empty group keeps "all but the newest" meaning V(tile) below

        unsigned pa[kCells / 16][4];
        softmax_to_p(s, o, m, l, pa, cell0, min_pos, row_pos, tq);

        cp_async_wait_but_newest();  // V(tile) landed (K(tile + 1) may still be in flight)
        fence_proxy_async();
        __syncthreads();
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kCells / 16; ++ks) {  // cells 16 ks .. + 15: core matrices 2 ks, 2 ks + 1
            const uint64_t desc = smem_desc(v_base + 2 * ks * kCellStep, kCellStep, kDimStep);  // N-major
            if constexpr (DH == 128)
                wgmma_rs_n128(o, pa[ks], desc);
            else
                wgmma_rs_n64(o, pa[ks], desc);
        }
        wgmma_commit();
        wgmma_wait_all();
        __syncthreads();  // the V buffer is free
        if (tile + 1 < num_tiles) load_tile(v_base, vb, cell0 + kCells);
        else cp_async_commit();
    }
    cp_async_wait_all();

    store_rows(o, l, row_pos, rows, tq, out);
#endif
}

}  // namespace

#define STRATA_PREFILL_WG(DH)                                                                                 \
    extern "C" __global__ void __launch_bounds__(kThreads, 2) strata_attention_prefill_wg_f16_d##DH(             \
        const float* q, const __half* k_cache, const __half* v_cache, const int* positions, float* out, int T, \
        int H, int Hk, float scale) {                                                                          \
        attention_prefill_wg<DH>(q, k_cache, v_cache, positions, out, T, H, Hk, scale);                        \
    }

STRATA_PREFILL_WG(64)
STRATA_PREFILL_WG(128)
