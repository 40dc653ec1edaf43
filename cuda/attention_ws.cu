// Causal prompt attention on Hopper, warp-specialized (wgmma, sm_90a only): a producer warp streams
// K/V tiles into a ring of shared-memory stages by cp.async while two consumer warpgroups run
// FlashAttention-2's loop on warpgroup MMAs, so no consumer ever waits on its own loads.
//
// strata_attention_prefill_ws<CELLS>_f16_d128, CELLS 128 or 64 (the K/V tile's cells)
//   (q, k_cache, v_cache, positions, out, T, H, Hk, scale):
//   strata_attention_prefill_tc_f16_d128's contract and precision bounds (cuda/attention_tc.cu):
//   out[t, h, :] = softmax_c(scale * q[t, h] . k[c, h / G]) v[c, h / G] over cells c <= positions[t].
// Launch: grid (ceil(T * G / 128), Hk), block 384 threads, dynamic shared memory WsShape::SMEM_BYTES
// (163,904 bytes with 128-cell tiles, 163,968 with 64: strata.backends.cuda.kernels.attention_ws_shared),
// which needs the launch attribute for more than 48 KB. One block a multiprocessor.
//
// Why. cuda/attention_wg.cu put both products on wgmma but kept attention_tc.cu's block: every warp
// loads, waits for its own tile, and meets the others at four barriers a tile, so the tensor cores
// idle through every load and every softmax (an H100: 149 TFLOP/s against mma.sync's 272). Here:
// - Warpgroup 2 is the producer (its registers given back to the consumers by setmaxnreg). It copies
//   each tile's K, then its V, into stage tile % STAGES (cp.async, 16 bytes a lane, whole 32-byte
//   sectors a quarter-warp: ws_produce), and signals the stage's full barrier by
//   cp.async.mbarrier.arrive.noinc when its copies land. It waits on the stage's empty barrier before
//   refilling it: STAGES - 1 tiles of K and of V run ahead of the consumers.
// - Warpgroups 0 and 1 each own 64 query rows. Q (scaled by scale * log2 e and rounded to f16 as
//   attention_tc.cu's fragments) goes once into shared memory in core-matrix layout. A tile: wait for
//   K, S = Q K^T (wgmma SS), wait for S and for the previous tile's P V, free K's stage and the previous
//   V's, the mask and online softmax (attention_tc.cuh, unchanged), then wait for V and issue O += P V
//   (wgmma RS: P from registers) without waiting for it: it runs while the next tile's K is awaited and
//   its S issued. The two warpgroups drift apart, so one's softmax runs beside the other's MMAs.
// - Barriers: full and empty mbarriers per stage for K and for V (full: the producer's 32 lanes;
//   empty: the 8 consumer warps, lane 0 of each after its wgmma wait), no block-wide barrier after
//   the prologue.
// With 64-cell tiles a row's softmax runs over the same tiles in the same order as attention_tc.cu, so
// the result is the same bits (wgmma's sums were measured to round as mma.sync's); 128-cell tiles take
// the running max over twice the cells, which moves the roundings but not the bounds.
//
// The TMA build (strata_attention_prefill_wst128_f16_d128: two tensor maps follow the contract's
// arguments): Nsight Compute found the cp.async build's L2 at 94% of its throughput with twice the
// sectors the tiles hold (the same count whatever the lanes' order, so the 16-byte requests, not their
// addresses), and the build without S, without the softmax or without P V no faster: the loads bound
// it. Here one producer thread moves each tile by cp.async.bulk.tensor as boxes of 64 dims x 128 cells
// (128-byte rows, 128-byte swizzle: chunk c of row r at c ^ (r % 8)), completing on the full barrier by
// transaction bytes; the consumers read K as K-major and V as N-major swizzled operands (descriptor
// layout type 1: K's k-steps 32 bytes apart within a row, V's 8-cell atoms 1024 bytes apart and its
// two 64-dim boxes a box apart). The maps end at the chunk's last position + 1, so the cells past it
// arrive as zeros, as the cp.async build zero-fills them; the host builds them per launch
// (strata.backends.cuda.kernels.attention_tensor_maps) where it knows that position.
//
// Built for sm_90a only (setup.py's ARCH_SPECIFIC); the host launches it for head dim 128 under
// --kernels-on wgmma-attention on an sm_90 GPU whose build has it (WS_ATTENTION_CELLS picks the tile).
// tools/attention_wg_ab.py checks and times it against attention_tc.cu without a package build
// (tools/nobuild_ab.sh attention). Compiled for any arch but sm_90a the entry points trap (wgmma.cuh).

#include <cuda_fp16.h>

#include <cstdint>

namespace {

#include "attention_tc.cuh"
#include "wgmma.cuh"
#include "wgmma_attention.cuh"
#include "mbarrier.cuh"

constexpr int kWsGroups = 2;                    // consumer warpgroups, 64 query rows each
constexpr int kWsRows = 64 * kWsGroups;         // query rows a block
constexpr int kWsConsumers = 128 * kWsGroups;   // consumer threads
constexpr int kWsProducers = 128;               // the producer warpgroup
constexpr int kWsThreads = kWsConsumers + kWsProducers;  // 384: the host launches blocks of this many
constexpr int kWsWarps = kWsThreads / 32;
// Registers: the block starts with 65536 / 384 = 168 a thread (__launch_bounds__(384, 1)); the producers
// give theirs back down to kWsProducerRegs and the consumers take kWsConsumerRegs (setmaxnreg).
constexpr int kWsProducerRegs = 40, kWsConsumerRegs = 232;
static_assert(kWsProducers * kWsProducerRegs + kWsConsumers * kWsConsumerRegs <= 65536, "the register file");
#ifndef STRATA_WS_RING_KB
#define STRATA_WS_RING_KB 128                   // a build may try another depth (tools/variants/attention_ws_diag.py)
#endif
constexpr int kWsRingBytes = STRATA_WS_RING_KB * 1024;  // K and V stages together

template <int DH, int CELLS>
struct WsShape {
    static constexpr int CHUNKS = DH / 8;                          // 16-byte chunks a row
    static constexpr int TILE_BYTES = CELLS * DH * 2;
    static constexpr int STAGES = kWsRingBytes / (2 * TILE_BYTES);
    static constexpr int Q_BYTES = kWsRows * DH * 2;
    static constexpr int BAR_OFFSET = Q_BYTES + 2 * STAGES * TILE_BYTES;  // full K, full V, empty K, empty V
    // The shared address of stage st's full (the tile landed) or empty (the consumers are done with it)
    // mbarrier, of K (which 0) or V (which 1), in the barrier block at bars.
    __device__ static unsigned full(unsigned bars, int which, int st) { return bars + (which * STAGES + st) * 8; }
    __device__ static unsigned empty(unsigned bars, int which, int st) { return full(bars, 2 + which, st); }
    static constexpr int SMEM_BYTES = BAR_OFFSET + 4 * STAGES * 8;  // the launch's dynamic shared memory
    static constexpr int BOX_BYTES = CELLS * 128;                  // a TMA box: CELLS cells x 64 dims
    // The TMA build rounds the block's base up to 1024 bytes (the 128-byte swizzle's atom) itself.
    static constexpr int SMEM_BYTES_TMA = SMEM_BYTES + 1024;
    static_assert(SMEM_BYTES_TMA <= 227 * 1024, "a multiprocessor's shared memory, with the alignment");
    static_assert(STAGES >= 2, "a stage to fill while one is read");
    static_assert(SMEM_BYTES <= 227 * 1024, "a multiprocessor's shared memory");
};

__device__ __forceinline__ void named_sync(unsigned id, unsigned threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The producer warpgroup: every tile's K then V into its stage, each stage refilled once the consumers
// free it. A warp's copy instruction covers 8 cells x 4 chunks (64 bytes of each cell): lane bit 0 is
// the chunk's low bit, bits 1-3 the cell, bit 4 the chunk's high bit. So the 8 lanes the memory system
// takes together (16-byte accesses go a quarter-warp at a time) read 4 cells' 32 aligned bytes, whole
// sectors (with 8 cells' 16 bytes each, as first built, every sector came over twice: the L2 ran at
// 94% for half the work), and write 4 rows of 2 core matrices, two 16-byte stores to a bank group.
// Warp w takes the cell groups g = w (mod 4).
template <int DH, int CELLS>
__device__ __forceinline__ void ws_produce(const __half* __restrict__ kb, const __half* __restrict__ vb,
                                           int64_t row_stride, int num_cells, int num_tiles, unsigned k_base,
                                           unsigned v_base, unsigned bars, int p) {
    using S = WsShape<DH, CELLS>;
    const int cl = (p >> 1) & 7, cs = (p & 1) | ((p >> 3) & 2), g0 = p >> 5;  // cell within 8, chunk within 4
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int st = tile % S::STAGES, use = tile / S::STAGES, cell0 = tile * CELLS;
#pragma unroll
        for (int which = 0; which < 2; ++which) {
            if (use > 0) mbar_wait(S::empty(bars, which, st), (use - 1) & 1);
            const __half* src = which ? vb : kb;
            const unsigned base = (which ? v_base : k_base) + st * S::TILE_BYTES;
#pragma unroll 2
            for (int g = g0; g < CELLS / 8; g += kWsProducers / 32) {
                const int cell = g * 8 + cl;
                const bool valid = cell0 + cell < num_cells;
                const __half* row = src + (cell0 + cell) * row_stride;
#pragma unroll
                for (int qd = 0; qd < S::CHUNKS / 4; ++qd) {
                    const int chunk = qd * 4 + cs;
                    cp_async16(base + core_chunk<S::CHUNKS>(cell, chunk) * 16, valid ? row + chunk * 8 : src, valid);
                }
            }
            cp_async_arrive_noinc(S::full(bars, which, st));
        }
    }
    cp_async_wait_all();
}

// The TMA producer (one thread): each tile's K, then its V, as DH / 64 boxes of CELLS cells x 64 dims
// (cells past the map's end arrive as zeros), 128-byte swizzled, on the stage's full barrier.
template <int DH, int CELLS>
__device__ __forceinline__ void ws_produce_tma(const TensorMap* tk, const TensorMap* tv, int kvh, int num_tiles,
                                               unsigned k_base, unsigned v_base, unsigned bars) {
    using S = WsShape<DH, CELLS>;
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int st = tile % S::STAGES, use = tile / S::STAGES;
#pragma unroll
        for (int which = 0; which < 2; ++which) {
            if (use > 0) mbar_wait(S::empty(bars, which, st), (use - 1) & 1);
            const unsigned full = S::full(bars, which, st), dst = (which ? v_base : k_base) + st * S::TILE_BYTES;
            mbar_arrive_expect_tx(full, S::TILE_BYTES);
#pragma unroll
            for (int h = 0; h < DH / 64; ++h)
                tma_load_3d(dst + h * S::BOX_BYTES, which ? tv : tk, h * 64, kvh, tile * CELLS, full);
        }
    }
}

// A consumer warpgroup: its 64 rows' Q into shared memory, then the tile loop (see the header).
template <int DH, int CELLS, bool TMA>
__device__ __forceinline__ void ws_consume(const float* __restrict__ q, const int* __restrict__ positions,
                                           float* __restrict__ out, int H, int Hk, float scale, int64_t row0,
                                           int64_t num_rows, int min_pos, int num_tiles, unsigned* q_words,
                                           unsigned k_base, unsigned v_base, unsigned bars) {
#ifndef STRATA_WG_TRAP
    using S = WsShape<DH, CELLS>;
    constexpr int KSTEPS = DH / 16, DTILES = DH / 8, CTILES = CELLS / 8, CHUNKS = S::CHUNKS;
    constexpr unsigned kDimStep = 128, kCellStep = CHUNKS * 128;  // core-matrix bytes along dims, along rows
    const int kvh = blockIdx.y, G = H / Hk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    const int wg = warp >> 2, gq = lane >> 2, tq = lane & 3;
    int row_pos[2];
    const RowPlace rows{row0 + warp * 16 + gq, num_rows, G, H, kvh, DH};
    {   // Q into shared memory once
        unsigned qa[KSTEPS][4];
        load_rows_q(q, positions, rows, tq, scale * kLog2e, row_pos, qa);
        store_q_core(q_words, qa, warp * 16 + gq, tq);
    }
    fence_proxy_async();
    named_sync(1 + wg, 128);  // this warpgroup's Q is in shared memory, visible to wgmma
    const unsigned q_wg = smem_addr(q_words) + wg * 8 * kCellStep;  // its 64 rows: 8 core-matrix rows

    float o[DTILES][4];
#pragma unroll
    for (int n = 0; n < DTILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    for (int tile = 0; tile < num_tiles; ++tile) {
        const int st = tile % S::STAGES, cell0 = tile * CELLS;
        const unsigned parity = (tile / S::STAGES) & 1;
        const unsigned k_tile = k_base + st * S::TILE_BYTES, v_tile = v_base + st * S::TILE_BYTES;
        mbar_wait(S::full(bars, 0, st), parity);  // K(tile) landed
        fence_proxy_async();

        float s[CTILES][4];  // written by the first k-step (accumulate 0): no register of it touched while P V runs
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {  // dims 16 ks .. + 15: core matrices 2 ks, 2 ks + 1 along dims
            const uint64_t qd = smem_desc(q_wg + 2 * ks * kDimStep, kDimStep, kCellStep);
            // K: core matrices 2 ks, 2 ks + 1 along dims; swizzled, box ks / 4 at byte 32 (ks % 4) of its rows
            const uint64_t kd = TMA ? smem_desc_sw128(k_tile + (ks >> 2) * S::BOX_BYTES + (ks & 3) * 32, 16, 1024)
                                    : smem_desc(k_tile + 2 * ks * kDimStep, kDimStep, kCellStep);
            if constexpr (CELLS == 128)
                wgmma_ss_n128(s, qd, kd, ks > 0);
            else
                wgmma_ss_n64(s, qd, kd, ks > 0);
        }
        wgmma_commit();
        wgmma_wait_all();  // S(tile), and O += P V of tile - 1
        if (lane == 0) {
            mbar_arrive(S::empty(bars, 0, st));  // K(tile)'s stage is free
            if (tile > 0) mbar_arrive(S::empty(bars, 1, (tile - 1) % S::STAGES));  // and V(tile - 1)'s
        }

        unsigned pa[CELLS / 16][4];
        softmax_to_p(s, o, m, l, pa, cell0, min_pos, row_pos, tq);

        mbar_wait(S::full(bars, 1, st), parity);  // V(tile) landed
        fence_proxy_async();
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < CELLS / 16; ++ks) {  // cells 16 ks .. + 15: core matrices 2 ks, 2 ks + 1 (N-major V)
            if constexpr (!TMA) {
                wgmma_rs_n128(o, pa[ks], smem_desc(v_tile + 2 * ks * kCellStep, kCellStep, kDimStep));
            } else {
                // swizzled: two 8-cell atoms from 2048 ks; the next 64 dims a box on (LBO), the next 8
                // cells 1024 on (SBO); at Dh 256 two m64n128 MMAs, dims 0-127 and 128-255 (boxes 2 h, 2 h + 1)
#pragma unroll
                for (int h = 0; h < DH / 128; ++h)
                    wgmma_rs_n128(*reinterpret_cast<float(*)[16][4]>(&o[16 * h][0]), pa[ks],
                                  smem_desc_sw128(v_tile + 2 * h * S::BOX_BYTES + ks * 2048, S::BOX_BYTES, 1024));
            }
        }
        wgmma_commit();  // not waited for here: it runs while the next K is awaited and its S issued
    }
    wgmma_wait_all();

    store_rows(o, l, row_pos, rows, tq, out);
#endif
}

template <int DH, int CELLS, bool TMA>
__device__ __forceinline__ void attention_prefill_ws(const float* __restrict__ q, const __half* __restrict__ k_cache,
                                                     const __half* __restrict__ v_cache,
                                                     const int* __restrict__ positions, float* __restrict__ out,
                                                     int T, int H, int Hk, float scale, const TensorMap* tk,
                                                     const TensorMap* tv) {
#ifdef STRATA_WG_TRAP
    __trap();
#else
    using S = WsShape<DH, CELLS>;
    static_assert(DH == 128 || (TMA && DH == 256), "O += P V is one m64n128 MMA a k-step, two for the TMA build's Dh 256");
    extern __shared__ __align__(128) unsigned char ws_smem[];
    __shared__ int pos_s[kWsWarps][2];

    const int kvh = blockIdx.y, G = H / Hk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t num_rows = static_cast<int64_t>(T) * G;
    const int64_t row0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kWsRows;  // heaviest first
    const unsigned raw = smem_addr(ws_smem), q_base = TMA ? (raw + 1023) & ~1023u : raw;
    const unsigned k_base = q_base + S::Q_BYTES;
    const unsigned v_base = k_base + S::STAGES * S::TILE_BYTES, bars = q_base + S::BAR_OFFSET;

    block_positions<kWsRows>(positions, row0, num_rows, G, warp, lane, pos_s);
    if (threadIdx.x == 0) {
        for (int st = 0; st < S::STAGES; ++st)
            for (int which = 0; which < 2; ++which) {
                // full: the producers' cp.async arrivals, or the TMA thread's one with its bytes
                mbar_init(S::full(bars, which, st), TMA ? 1 : kWsProducers);
                mbar_init(S::empty(bars, which, st), kWsConsumers / 32);   // a consumer warp's each
            }
        if (TMA) asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const Span span = block_span<kWsWarps>(pos_s);
    const int min_pos = span.min_pos, num_cells = span.num_cells;
    const int num_tiles = (num_cells + CELLS - 1) / CELLS;
    const int64_t row_stride = static_cast<int64_t>(Hk) * DH;

    if (threadIdx.x >= kWsConsumers) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWsProducerRegs));
        if constexpr (TMA) {
            if (threadIdx.x == kWsConsumers) ws_produce_tma<DH, CELLS>(tk, tv, kvh, num_tiles, k_base, v_base, bars);
        } else {
            ws_produce<DH, CELLS>(k_cache + static_cast<int64_t>(kvh) * DH, v_cache + static_cast<int64_t>(kvh) * DH,
                                  row_stride, num_cells, num_tiles, k_base, v_base, bars, threadIdx.x - kWsConsumers);
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kWsConsumerRegs));
        ws_consume<DH, CELLS, TMA>(q, positions, out, H, Hk, scale, row0, num_rows, min_pos, num_tiles,
                                   reinterpret_cast<unsigned*>(ws_smem + (q_base - raw)), k_base, v_base, bars);
    }
#endif
}

}  // namespace

#define STRATA_PREFILL_WS(NAME, DH, CELLS)                                                                    \
    extern "C" __global__ void __launch_bounds__(kWsThreads, 1)                                              \
        NAME(const float* q, const __half* k_cache, const __half* v_cache, const int* positions, float* out, \
             int T, int H, int Hk, float scale) {                                                             \
        attention_prefill_ws<DH, CELLS, false>(q, k_cache, v_cache, positions, out, T, H, Hk, scale, nullptr,  \
                                               nullptr);                                                      \
    }

STRATA_PREFILL_WS(strata_attention_prefill_ws128_f16_d128, 128, 128)
STRATA_PREFILL_WS(strata_attention_prefill_ws64_f16_d128, 128, 64)

// The TMA build: K and V through tensor maps of the caches (host: strata.backends.cuda.kernels
// attention_tensor_maps), dims (Dh, Hk, cells) with cells the chunk's last position + 1, boxes
// (64, 1, 128), 128-byte swizzle, zeros past the end; k_cache and v_cache unused (the contract kept).
#define STRATA_PREFILL_WST(NAME, DH, CELLS)                                                                   \
    extern "C" __global__ void __launch_bounds__(kWsThreads, 1)                                              \
        NAME(const float* q, const __half* k_cache, const __half* v_cache, const int* positions, float* out, \
             int T, int H, int Hk, float scale, const __grid_constant__ TensorMap tk,                        \
             const __grid_constant__ TensorMap tv) {                                                          \
        attention_prefill_ws<DH, CELLS, true>(q, k_cache, v_cache, positions, out, T, H, Hk, scale, &tk, &tv); \
    }

STRATA_PREFILL_WST(strata_attention_prefill_wst128_f16_d128, 128, 128)
// Dh 256 (Qwen3-Next's attention layers) on 64-cell tiles: O's 128 accumulators a thread beside S's 32
// fit the consumers' 232 registers, and Q (64 KB) with two stages of 32 KB K and V tiles fits shared
// memory (197,696 bytes). Not yet run on a GPU: tools/attention_wg_ab.py --shape 80b checks and times it;
// the engine does not launch it yet.
STRATA_PREFILL_WST(strata_attention_prefill_wst64_f16_d256, 256, 64)
