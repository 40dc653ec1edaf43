// The prompt chunks' grouped GEMM (cuda/moe_gemm.cu's contract) on Hopper's warpgroup MMA, warp-
// specialized and persistent (sm_90a only): producer warps decode weights and round X to f16 into a
// ring of shared-memory stages while two consumer warpgroups keep the tensor cores fed from it.
//
// strata_moe_gemm_ws_<q>(ptrs, part_offset, tiles, X, ldx, Y, ldy, N, K, n_tiles)  signature "PqPPqPqiii"
//   strata_moe_gemm_<q>'s parameters, requirements and results, with the tile count (moe_gemm.cu takes
//   it from the grid): Y[s0 + i, n] = sum_k f16(X[s0 + i, k]) * f16(W_g[n, k]) for every tile (g, s0, m)
//   of tiles[0 .. n_tiles), i < m, n < N. <q>: the same fifteen types.
// Launch: grid (any number of blocks: each takes work items blockIdx.x, + gridDim.x, ... of the
// ceil(N / 128) x n_tiles items, so the host launches min(items, multiprocessors)), block kThreads
// (512: two consumer warpgroups, two producer ones), dynamic shared memory kSmemBytes (131,136 bytes: the
// launch attribute past 48 KB). One block a multiprocessor. (strata.backends.cuda.moe_gemm: WS_BLOCK,
// WS_SHARED_BYTES, ws_grid.)
//
// Why. moe_gemm.cu's 8 warps each decode weights, round X, load fragments by ldmatrix and issue
// mma.sync, one barrier a 32-wide k step: they spend their issue slots on everything at once and the
// tensor cores run at 15-20% of their peak (148-165 TFLOP/s on the 30B's expert shapes). cuda/
// moe_gemm_wg.cu put the products on wgmma in that same block and lost (103-110): a warpgroup waited
// on its own stores every step. Here the roles are split, as in cuda/attention_ws.cu:
// - Warpgroups 2 and 3, the producers: thread p owns tile row p % 128 and half q = p / 128 of its
//   stage. Per 64-wide k step it decodes that weight row's 32 weights of half q (gemm_wide.cuh's
//   decode16, bit for bit decode8's, rounded to f16) and rounds X row p % 128's 32 values of half q to
//   f16, all into registers first (their loads in flight together), then waits for the stage to be
//   free, stores both as 8 chunks of 16 bytes in wgmma's no-swizzle K-major layout (core matrices of
//   8 rows x 16 bytes; a quarter-warp's 8 lanes write the 8 rows of one: no bank conflicts), fences
//   them for the async proxy and arrives on the stage's full barrier. (The first build had one
//   producer warpgroup, each thread a whole row: on an H100 it ran 97 TFLOP/s against moe_gemm.cu's
//   158 on the 30B's gate|up; STRATA_WS_GEMM_PRODUCERS=1 builds it again.)
// - Warpgroups 0 and 1 each own 64 of the tile's 128 token rows: per stage, wait for it, four
//   wgmma.m64n128k16 (both operands from shared memory), commit, and once the previous stage's group
//   has finished (wait_group 1) free that stage; after a tile's last stage, Y from the accumulators.
// - Persistent: the ring runs on across a block's work items, so the producers decode the next item's
//   first stages while the consumers store the last one's Y. Items go n-block fastest, so the blocks
//   running together share each tile's X rows and each expert's weights in L2.
// - kStages (4) stages of 32 KB: 16 KB of f16(X) and 16 KB of f16(W).
// Both consumer warpgroups issue their wgmmas whether or not their rows hold tokens (a short tile's
// idle half costs tensor time, not decode time, and a conditional wgmma makes ptxas serialize them all).
//
// Precision and determinism: as moe_gemm.cu's (f16 operands rounded to nearest even, exact products,
// f32 accumulation in ascending 16-wide k steps; an output depends only on its row of X and its
// weight row), so Y is bit-identical whatever the tile a row falls in, the grid, n_tiles or S. wgmma's
// sums were measured bit-equal to mma.sync's (the first wgmma GEMM, the eighteenth session), and this
// kernel's first build matched moe_gemm.cu's on all fifteen types. Its Q4_K / Q5_K weights come from one
// fma a product (STRATA_K4_FMA, gemm_wide.cuh): the same values, but +0 for the -0 of a negative scale's
// quant 0, so an output may differ from moe_gemm.cu's in the sign of an exact zero.
//
// strata_moe_gemm_ws16_<q> takes X as f16 (ldx in halves; 16-byte aligned rows) and copies its chunks
// straight into the stage by cp.async (zeros past m and K), so the producers only decode weights.
// strata_moe_gemm_ws16_f16 (f16 X and f16 W, tma-gemm's fallback over weights dequantized first) copies both
// operands by cp.async: its producers decode nothing.
// Trial builds (tools/variants/gemm_ws_ab.sh times them): STRATA_WS_GEMM_PREFETCH prefetches each row's
// next-stage lines into L1; STRATA_WS_GEMM_STAGES deepens the ring; STRATA_WS_GEMM_PRODUCERS=1 is the
// first build. STRATA_WS_GEMM_BN=256 (with one producer warpgroup: 384 threads, 196,672 bytes of shared
// memory) makes a work item 256 weight rows: a producer thread fills two, a consumer warpgroup issues
// two m64n128k16 a k step into two accumulator sets (128 registers), and a stage's 48 KB carry 4.2
// MFLOP instead of 32 KB for 2.1, for where the operands' L2 traffic, not the decode, is the bound (the
// f16 path: at the tensor cores' rate a 128 x 128 tile asks about 15 TB/s of the H100's L2).
//
// strata_moe_gemm_wst_f16(ptrs, part_offset, tiles, X, ldx, Y, ldy, N, K, n_tiles, w_base, tx, tw)
//   strata_moe_gemm_ws16_f16's products with both operands moved by the TMA (the attention's lesson: its
//   cp.async build ran the L2 at 94% on 16-byte requests, 250 TFLOP/s; its TMA build 500-650). tx: a
//   tensor map of X's f16 rows [rows, K] (ldx halves apart), tw: one of the weights' f16 rows [rows, K]
//   starting at w_base, every group's matrix among them (ptrs[g] + part_offset - w_base a multiple of its
//   2K-byte rows); boxes of 64 halves x 128 rows, 128-byte swizzle, zeros past either end
//   (strata.backends.cuda.moe_gemm.wst_maps). One producer thread asks for a stage's two (or, 256-row
//   build, three) boxes on its full barrier by transaction bytes; the consumers read them as 128-byte
//   swizzled K-major operands. A tile's rows past m read other groups' rows (or zeros) and are not
//   stored. Dynamic shared memory kSmemBytes + 1024 (the block rounds its base up to the swizzle's
//   1024-byte atom). K a multiple of 8.
//
// tools/moe_gemm_ab.py checks it against the float64 product and moe_gemm.cu and times both from
// fatbins (tools/variants/make_wgmma.sh), without a package build. Compiled for any arch but sm_90a the
// entry points trap (wgmma.cuh).

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "quant_blocks.cuh"

namespace {

using namespace strata_q;

#define STRATA_K4_FMA 1   // Q4_K / Q5_K products by one fma (gemm_wide.cuh): the producers' instructions are the bound
#include "gemm_wide.cuh"
#include "mbarrier.cuh"
#include "wgmma.cuh"

#ifndef STRATA_WS_GEMM_BN
#define STRATA_WS_GEMM_BN 128      // weight rows of a work item: 256 (a trial build, one producer warpgroup) loads
                                   // half the X bytes a product and gives each consumer two m64n128 MMAs a k step
#endif
constexpr int kBM = 128, kBN = STRATA_WS_GEMM_BN, kBK = 64;   // token rows, weight rows, k of a stage
constexpr int kWRows = kBN / kBM;                      // weight rows a producer thread fills (1 or 2)
#ifndef STRATA_WS_GEMM_PRODUCERS
#define STRATA_WS_GEMM_PRODUCERS 2     // producer warpgroups, 1 or 2 (four would cap every thread at 80 registers,
                                       // under what ptxas needs for a consumer's 64 accumulators and wgmma)
#endif
constexpr int kProducerGroups = STRATA_WS_GEMM_PRODUCERS;
constexpr int kConsumers = 256, kProducers = 128 * kProducerGroups, kThreads = kConsumers + kProducers;
#ifndef STRATA_WS_GEMM_STAGES
#define STRATA_WS_GEMM_STAGES 4
#endif
constexpr int kStages = STRATA_WS_GEMM_STAGES;
constexpr int kKChunks = kBK / 8;                      // 16-byte chunks of a row in a stage
constexpr int kTileBytes = kBM * kBK * 2;              // X's stage: 16 KB (W's: kWRows of them)
constexpr int kStageBytes = (1 + kWRows) * kTileBytes; // A (f16 X) then B (f16 W)
constexpr unsigned kLbo = 128, kSbo = kKChunks * 128;  // bytes between core matrices along k / along rows
constexpr int kBarOffset = kStages * kStageBytes;      // full[kStages], empty[kStages]
constexpr int kSmemBytes = kBarOffset + 2 * kStages * 8;
constexpr int kDecodes = 4 / kProducerGroups;          // 16-weight decodes of a producer thread a stage
constexpr int kXChunks = kKChunks / kProducerGroups;   // and 8-value chunks of X (as many as weight chunks)
static_assert(kBN == kBM || (kBN == 2 * kBM && kProducerGroups == 1),
              "a producer thread's row is a token row of X and one (or, one producer warpgroup, two) weight rows");
static_assert(kKChunks == 8 && (kProducerGroups == 1 || kProducerGroups == 2), "a stage row's four 16-weight decodes split evenly");
static_assert(kSmemBytes <= 227 * 1024, "a multiprocessor's shared memory");

// 16 bytes at src into shared memory at dst by cp.async, or 16 zeros (nothing read) where !valid.
__device__ __forceinline__ void copy16_async(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void copies_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// The 16-byte chunk (halves 8 kc .. 8 kc + 7 of row r) of a stage's operand, in 16-byte units.
__device__ __forceinline__ int chunk(int r, int kc) { return ((r >> 3) * kKChunks + kc) * 8 + (r & 7); }

__device__ __forceinline__ unsigned full_bar(unsigned bars, int st) { return bars + st * 8; }
__device__ __forceinline__ unsigned empty_bar(unsigned bars, int st) { return bars + (kStages + st) * 8; }

// A work item: tile `tile` of the table, weight rows n0 .. n0 + 127.
struct Item {
    int4 t;      // (g, s0, m, unused)
    int n0;
    bool live;   // rows to compute and a group this launch holds
};

__device__ __forceinline__ Item item_at(const unsigned long long* __restrict__ ptrs, const int* __restrict__ tiles,
                                        int w, int n_blocks) {
    Item it;
    it.t = __ldg(reinterpret_cast<const int4*>(tiles) + w / n_blocks);
    it.n0 = (w % n_blocks) * kBN;
    it.live = it.t.z > 0 && ptrs[it.t.x] != 0;
    return it;
}

// X given as f16 (strata_moe_gemm_ws16_<q>, ldx in halves): copied, not rounded.
template <class TX>
constexpr bool kX16 = sizeof(TX) == 2;
// And f16 weights beside f16 X (strata_moe_gemm_ws16_f16): both operands copied by cp.async, nothing
// decoded (the weights of a prompt chunk dequantized once into f16 rows, then multiplied at the rate
// the tensor cores and cp.async allow).
template <class B, class TX>
constexpr bool kWCopy = kX16<TX> && std::is_same_v<B, BlockF16x8>;

// Producer thread p of kProducers: tile row p % 128, part q = p / 128 of each stage's row (weights
// 16 kDecodes q .. + 16 kDecodes - 1 and X chunks kXChunks q .. + kXChunks - 1). Every live item's
// stages, in order, into the ring.

template <class B, class TX>
__device__ __forceinline__ void produce(const unsigned long long* __restrict__ ptrs, long long part_offset,
                                        const int* __restrict__ tiles, const TX* __restrict__ X, long long ldx,
                                        int N, int K, int items, int n_blocks, unsigned base, unsigned bars, int p) {
    const long long row_bytes = static_cast<long long>(K / B::kWeights) * B::kBytes;
    const int steps = (K + kBK - 1) / kBK;
    const int r = p % kBM, q = p / kBM;
    int ring = 0;  // stages filled so far, over all items
    for (int w = blockIdx.x; w < items; w += gridDim.x) {
        const Item it = item_at(ptrs, tiles, w, n_blocks);
        if (!it.live) continue;
        const uint8_t* w_rows[kWRows];  // this thread's weight rows: r, and r + 128 in a 256-row build
#pragma unroll
        for (int h = 0; h < kWRows; ++h)
            w_rows[h] = reinterpret_cast<const uint8_t*>(ptrs[it.t.x] + part_offset) +
                        static_cast<long long>(min(it.n0 + r + kBM * h, N - 1)) * row_bytes;
        const bool x_valid = r < it.t.z;
        const TX* x_row = X + static_cast<long long>(it.t.y + min(r, it.t.z - 1)) * ldx;
        for (int step = 0; step < steps; ++step, ++ring) {
            const int k0 = step * kBK;
            const int st = ring % kStages, use = ring / kStages;
#ifdef STRATA_WS_GEMM_PREFETCH
            if (step + 1 < steps) {   // a trial: the next stage's lines of this row into L1 (the weights' by proportion)
                const long long kn = k0 + kBK + 16 * kDecodes * q;
                asm volatile("prefetch.global.L1 [%0];\n" ::"l"(w_rows[0] + kn * B::kBytes / B::kWeights));
                asm volatile("prefetch.global.L1 [%0];\n" ::"l"(x_row + min(kn, static_cast<long long>(K) - 1)));
            }
#endif
            const unsigned a_base = base + st * kStageBytes, b_base = a_base + kTileBytes;
            if constexpr (kX16<TX>) {   // f16 X: its chunks straight into the stage once it is free (zeros past m, K)
                if (use > 0) mbar_wait(empty_bar(bars, st), (use - 1) & 1);
#pragma unroll
                for (int c = 0; c < kXChunks; ++c) {
                    const int k = k0 + 8 * (kXChunks * q + c);
                    copy16_async(a_base + static_cast<unsigned>(chunk(r, kXChunks * q + c)) * 16u, x_row + min(k, K - 8),
                               x_valid && k < K);
                }
                if constexpr (kWCopy<B, TX>) {   // f16 weight rows (16-byte aligned, K a multiple of 8)
#pragma unroll
                    for (int h = 0; h < kWRows; ++h) {
#pragma unroll
                        for (int c = 0; c < kXChunks; ++c) {
                            const int kc = kXChunks * q + c, k = k0 + 8 * kc;
                            copy16_async(b_base + static_cast<unsigned>(chunk(r + kBM * h, kc)) * 16u,
                                         w_rows[h] + 2ll * min(k, K - 8), k < K);
                        }
                    }
                }
                cp_async_arrive_noinc(full_bar(bars, st));
            }
#pragma unroll
            for (int h = 0; h < (kWCopy<B, TX> ? 0 : kWRows); ++h) {   // each weight row: decode, then store
                uint4 wv[2 * kDecodes], xv[kXChunks];
#pragma unroll
                for (int j = 0; j < kDecodes; ++j) {
                    const int k = k0 + 16 * (kDecodes * q + j);
                    uint4 two[2];
                    if (k < K) {
                        Wide<B>::decode16(w_rows[h], k, K, two);
                    } else {
                        two[0] = two[1] = make_uint4(0u, 0u, 0u, 0u);
                    }
                    wv[2 * j] = two[0];
                    wv[2 * j + 1] = two[1];
                }
                if constexpr (!kX16<TX>) {
                    if (h == 0) {     // X's values with the first row's loads in flight, then the stage once free
#pragma unroll
                        for (int c = 0; c < kXChunks; ++c) {
                            const int k = k0 + 8 * (kXChunks * q + c);
                            const uint2 a = load_x4(x_row, k, K, x_valid), b = load_x4(x_row, k + 4, K, x_valid);
                            xv[c] = make_uint4(a.x, a.y, b.x, b.y);
                        }
                        if (use > 0) mbar_wait(empty_bar(bars, st), (use - 1) & 1);
                    }
                }
#pragma unroll
                for (int c = 0; c < kXChunks; ++c) {
                    if constexpr (!kX16<TX>) {
                        if (h == 0) {
                            const unsigned off = static_cast<unsigned>(chunk(r, kXChunks * q + c)) * 16u;
                            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(a_base + off), "r"(xv[c].x),
                                         "r"(xv[c].y), "r"(xv[c].z), "r"(xv[c].w)
                                         : "memory");
                        }
                    }
                    const unsigned woff = static_cast<unsigned>(chunk(r + kBM * h, 2 * kDecodes * q + c)) * 16u;
                    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(b_base + woff), "r"(wv[c].x),
                                 "r"(wv[c].y), "r"(wv[c].z), "r"(wv[c].w)
                                 : "memory");
                }
            }
            if constexpr (!kWCopy<B, TX>) fence_proxy_async();   // the stores, for wgmma's reads
            mbar_arrive(full_bar(bars, st));
        }
    }
    if constexpr (kX16<TX>) copies_wait_all();
}

// The TMA producer (one thread): each live item's stages, X's box (k0, s0) and the weights' box(es) (k0,
// the group's first row + n0 [+ 128]), on the stage's full barrier.
__device__ __forceinline__ void produce_tma(const unsigned long long* __restrict__ ptrs, long long part_offset,
                                            const int* __restrict__ tiles, int K, int items, int n_blocks,
                                            unsigned long long w_base, const TensorMap* tx, const TensorMap* tw,
                                            unsigned base, unsigned bars) {
    const int steps = (K + kBK - 1) / kBK;
    const unsigned long long row_bytes = 2ull * K;
    int ring = 0;
    for (int w = blockIdx.x; w < items; w += gridDim.x) {
        const Item it = item_at(ptrs, tiles, w, n_blocks);
        if (!it.live) continue;
        const int w_row = static_cast<int>((ptrs[it.t.x] + part_offset - w_base) / row_bytes) + it.n0;
        for (int step = 0; step < steps; ++step, ++ring) {
            const int st = ring % kStages, use = ring / kStages, k0 = step * kBK;
            if (use > 0) mbar_wait(empty_bar(bars, st), (use - 1) & 1);
            const unsigned a_base = base + st * kStageBytes, full = full_bar(bars, st);
            mbar_arrive_expect_tx(full, kStageBytes);
            tma_load_2d(a_base, tx, k0, it.t.y, full);
#pragma unroll
            for (int h = 0; h < kWRows; ++h) tma_load_2d(a_base + (1 + h) * kTileBytes, tw, k0, w_row + kBM * h, full);
        }
    }
}

// A consumer warpgroup (wg 0 or 1: tile rows 64 wg .. 64 wg + 63): every live item's stages through
// wgmma, then its rows of Y. kTma: the stages are the TMA's 128-byte swizzled boxes (rows of 128 bytes,
// 8-row atoms 1024 bytes apart, a 16-wide k step 32 bytes along the row); else the no-swizzle layout.
template <bool X16, bool kTma = false>
__device__ __forceinline__ void consume(const unsigned long long* __restrict__ ptrs, const int* __restrict__ tiles,
                                        float* __restrict__ Y, long long ldy, int N, int K, int items, int n_blocks,
                                        unsigned base, unsigned bars, int wg, int warp_in_wg, int lane) {
    const int steps = (K + kBK - 1) / kBK;
    const int g = lane >> 2, t = lane & 3;
    int ring = 0;
    for (int w = blockIdx.x; w < items; w += gridDim.x) {
        const Item it = item_at(ptrs, tiles, w, n_blocks);
        if (!it.live) continue;
        float acc[kWRows][64];    // weight rows 128 b .. 128 b + 127 of the item in acc[b]
#pragma unroll
        for (int b = 0; b < kWRows; ++b)
#pragma unroll
            for (int i = 0; i < 64; ++i) acc[b][i] = 0.f;
        for (int step = 0; step < steps; ++step, ++ring) {
            const int st = ring % kStages;
            mbar_wait(full_bar(bars, st), (ring / kStages) & 1);
            if constexpr (X16 && !kTma) fence_proxy_async();   // the cp.async writes of X, for wgmma's reads
            const unsigned a_base = base + st * kStageBytes, b_base = a_base + kTileBytes;
            wgmma_fence();
#pragma unroll
            for (int k16 = 0; k16 < kBK / 16; ++k16)
#pragma unroll
                for (int b = 0; b < kWRows; ++b) {
                    if constexpr (kTma)
                        wgmma_m64n128k16(acc[b], smem_desc_sw128(a_base + 64 * wg * 128 + 32 * k16, 16, 1024),
                                         smem_desc_sw128(b_base + kTileBytes * b + 32 * k16, 16, 1024));
                    else
                        wgmma_m64n128k16(acc[b], smem_desc(a_base + chunk(64 * wg, 2 * k16) * 16, kLbo, kSbo),
                                         smem_desc(b_base + chunk(kBM * b, 2 * k16) * 16, kLbo, kSbo));
                }
            wgmma_commit();
            wgmma_wait<1>();  // the previous stage's group is done: free its stage
            if (step > 0 && lane == 0) mbar_arrive(empty_bar(bars, (ring - 1) % kStages));
        }
        wgmma_wait<0>();
        if (lane == 0) mbar_arrive(empty_bar(bars, (ring - 1) % kStages));

        // accumulators (wgmma_m64n128k16): rows 64 wg + 16 warp + lane / 4 (+ 8), columns 8 j + 2 (lane % 4)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 64 * wg + 16 * warp_in_wg + g + 8 * h;
            if (row >= it.t.z) continue;
            float* y_row = Y + static_cast<long long>(it.t.y + row) * ldy;
            const bool pairs = (reinterpret_cast<uintptr_t>(y_row) & 7) == 0;  // n is even: 8-byte stores where Y allows
#pragma unroll
            for (int b = 0; b < kWRows; ++b) {
#pragma unroll
                for (int j = 0; j < 128 / 8; ++j) {
                    const int n = it.n0 + kBM * b + 8 * j + 2 * t;
                    const float v0 = acc[b][4 * j + 2 * h], v1 = acc[b][4 * j + 2 * h + 1];
                    if (n + 1 < N && pairs) {
                        *reinterpret_cast<float2*>(y_row + n) = make_float2(v0, v1);
                    } else if (n + 1 < N) {
                        y_row[n] = v0;
                        y_row[n + 1] = v1;
                    } else if (n < N) {
                        y_row[n] = v0;
                    }
                }
            }
        }
    }
}

// The ring, its barriers and the roles. kTma (strata_moe_gemm_wst_f16): the block's base rounded up to
// the 128-byte swizzle's 1024-byte atom, and one producer thread's TMA copies fill it (each full barrier:
// that thread's arrival and the stage's bytes), X and the weights read through tx and tw from w_base.
template <class B, class TX, bool kTma = false>
__device__ __forceinline__ void moe_gemm_ws_body(const unsigned long long* __restrict__ ptrs, long long part_offset,
                                                 const int* __restrict__ tiles, int n_tiles, const TX* __restrict__ X,
                                                 long long ldx, float* __restrict__ Y, long long ldy, int N, int K,
                                                 unsigned long long w_base = 0, const TensorMap* tx = nullptr,
                                                 const TensorMap* tw = nullptr) {
#ifdef STRATA_WG_TRAP
    __trap();
#else
    extern __shared__ __align__(128) unsigned char ws_smem[];
    const unsigned raw = smem_addr(ws_smem), base = kTma ? (raw + 1023) & ~1023u : raw, bars = base + kBarOffset;
    if (threadIdx.x == 0) {
        for (int st = 0; st < kStages; ++st) {
            // each producer's (and its cp.async's) arrival, or the TMA thread's one with its bytes
            mbar_init(full_bar(bars, st), kTma ? 1 : kX16<TX> ? 2 * kProducers : kProducers);
            mbar_init(empty_bar(bars, st), kConsumers / 32);  // lane 0 of each consumer warp
        }
        if constexpr (kTma) asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int n_blocks = (N + kBN - 1) / kBN, items = n_blocks * n_tiles;
    if (threadIdx.x >= kConsumers) {
        if constexpr (kTma) {
            if (threadIdx.x == kConsumers) produce_tma(ptrs, part_offset, tiles, K, items, n_blocks, w_base, tx, tw, base, bars);
        } else {
            produce<B, TX>(ptrs, part_offset, tiles, X, ldx, N, K, items, n_blocks, base, bars, threadIdx.x - kConsumers);
        }
    } else {
        const int warp = threadIdx.x >> 5;
        consume<kX16<TX>, kTma>(ptrs, tiles, Y, ldy, N, K, items, n_blocks, base, bars, warp >> 2, warp & 3,
                                threadIdx.x & 31);
    }
#endif
}

}  // namespace

// The TMA build over f16 weights and f16 X (X and the contract's part of ptrs read through tx and tw; X
// and ldx kept for the contract's order, unused).
extern "C" __global__ void __launch_bounds__(kThreads, 1) strata_moe_gemm_wst_f16(
    const unsigned long long* ptrs, long long part_offset, const int* tiles, const __half* X, long long ldx, float* Y,
    long long ldy, int N, int K, int n_tiles, unsigned long long w_base, const __grid_constant__ TensorMap tx,
    const __grid_constant__ TensorMap tw) {
    moe_gemm_ws_body<BlockF16x8, __half, true>(ptrs, part_offset, tiles, n_tiles, X, ldx, Y, ldy, N, K, w_base, &tx,
                                               &tw);
}

// Both entry families: X as f32 (strata_moe_gemm_ws_<q>) and as f16 (strata_moe_gemm_ws16_<q>).
#define STRATA_MOE_GEMM_WS_X(name, Block, prefix, XT)                                                  \
    extern "C" __global__ void __launch_bounds__(kThreads, 1) prefix##name(                            \
        const unsigned long long* ptrs, long long part_offset, const int* tiles, const XT* X,         \
        long long ldx, float* Y, long long ldy, int N, int K, int n_tiles) {                           \
        moe_gemm_ws_body<Block, XT>(ptrs, part_offset, tiles, n_tiles, X, ldx, Y, ldy, N, K);          \
    }
#define STRATA_MOE_GEMM_WS(name, Block)                                                                \
    STRATA_MOE_GEMM_WS_X(name, Block, strata_moe_gemm_ws_, float)                                     \
    STRATA_MOE_GEMM_WS_X(name, Block, strata_moe_gemm_ws16_, __half)

STRATA_MOE_GEMM_WS(f32, BlockF32x8)
STRATA_MOE_GEMM_WS(f16, BlockF16x8)
STRATA_MOE_GEMM_WS(bf16, BlockBF16x8)
STRATA_MOE_GEMM_WS(q8_0, BlockQ8_0)
STRATA_MOE_GEMM_WS(q4_0, BlockQ4_0)
STRATA_MOE_GEMM_WS(q4_1, BlockQ4_1)
STRATA_MOE_GEMM_WS(q5_0, BlockQ5_0)
STRATA_MOE_GEMM_WS(q5_1, BlockQ5_1)
STRATA_MOE_GEMM_WS(q2_k, BlockQ2_K)
STRATA_MOE_GEMM_WS(q3_k, BlockQ3_K)
STRATA_MOE_GEMM_WS(q4_k, BlockQ4_K)
STRATA_MOE_GEMM_WS(q5_k, BlockQ5_K)
STRATA_MOE_GEMM_WS(q6_k, BlockQ6_K)
STRATA_MOE_GEMM_WS(iq4_nl, BlockIQ4_NL)
STRATA_MOE_GEMM_WS(iq4_xs, BlockIQ4_XS)
