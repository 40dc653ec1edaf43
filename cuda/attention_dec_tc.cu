// Split-K decode attention over an f16 KV cache on the tensor cores: the contract, grid and partials of
// cuda/attention.cu's strata_attention_decode_f16_d<Dh>_g<GP> (its combine reads them), at head dims
// 64 and 128, with cuda/kv_quant.cu's arithmetic (cuda/decode_mma.cuh): Q K^T and P V as
// mma.sync.m16n8k16 with f32 sums, the cache's f16 values exact as B operands, the query and the
// probabilities split into hi + lo f16 halves, so the sums keep f32 accuracy. attention.cu's kernel
// spends 64 FFMA a cell per lane on the two products and is issue-bound (54% of the copy rate at 32K
// cells); here a 16-cell tile is 16 loads of 16 bytes and 32 MMAs a warp.
//
//   strata_attention_decode_tc_f16_d<Dh>_g<GP>(q, k_cache, v_cache, lengths, bases, part_acc, part_ml,
//       H, Hk, max_cells, num_splits, scale, window, ring, k_vram, v_vram, vram_cells, tc_from)
//                                                      grid (splits, Hk, B), block 128, GP 1, 2, 4, 8, 16
//     Every argument as attention.cu's decode kernel (its comment is the contract: lengths and bases,
//     window and ring, --kv-resident's VRAM window); the split sizes are rounded to 16 cells, not to
//     that kernel's tiles, which the combine does not see. tc_from: only rows of lengths[b] >= tc_from
//     are read here (0: every row); attention.cu's kernel takes the shorter ones with the same
//     tc_from, where its fixed cost a block is the smaller (strata.backends.cuda.kernels.TC_DECODE_FROM).
//
// Lane (g = lane / 4, t = lane % 4) of a warp, per 16-cell tile (the tree's kv_quant.cu layout with f16
// planes): K of cells g and 8 + g, dims t Dh/4 .. (t + 1) Dh/4 - 1 (slice j's k positions 2t, 2t + 1,
// 2t + 8, 2t + 9 are dims t Dh/4 + 4j + 0..3, so a lane's K bytes of a cell are contiguous: 4 loads of
// 16 bytes at Dh 128), and V of cells 2t, 2t + 1, 8 + 2t, 9 + 2t, dims g Dh/8 .. (g + 1) Dh/8 - 1
// (n-tile n's column c is dim c Dh/8 + n; 2 loads of 16 bytes a cell). The score layout of the first
// MMA is the row layout of the P operand, so p never leaves its lane.
//
// A plain cache (ring 0, vram_cells 0: every decode step but the drafter's window and --kv-resident's)
// takes a loop whose addresses are one multiply from a base, its cells past the end reading the last
// cell (their scores are -inf, so p = 0 and their P V terms are zeros); otherwise strata_kv places each
// cell and cells past the end read as zeros. Each warp's first tile is loaded before the query is
// prepared, the next tile's K once this tile's scores are made, its V once P V is done.

#include <cuda_fp16.h>

#include <cstdint>
#include "decode_mma.cuh"
#include "kv_codec.cuh"
#include "pdl.cuh"

namespace {

using strata_dec::as_h2;
using strata_dec::load_raw;
using strata_dec::mma16816;
using strata_dec::split_pair;

constexpr unsigned kFull = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kWarps = 4;

template <int DH, int GP>
struct DecodeF16 {
    static constexpr bool STACK = GP <= 8;              // q and p as rows g (hi) and g + 8 (lo) of one MMA
    static constexpr int NPASS = STACK ? 1 : 2;         // else a hi and a lo MMA
    static constexpr int NH = STACK ? 1 : 2;            // heads per lane: g (and g + 8)
    static constexpr int NSLICE = DH / 16;
    static constexpr int NT = DH / 8;                   // V n-tiles
    static constexpr int KQ = DH / 4 / 8;               // a lane's 16-byte loads of a K cell
    static constexpr int VQ = DH / 8 / 8;               // ... of a V cell
    static constexpr int ROW = DH * 2;                  // bytes of a head vector

    struct Smem {
        alignas(16) float acc[kWarps][GP][DH];          // q [GP][DH] first, then the warps' sums
        alignas(16) uint4 qfrag[NSLICE * NPASS][32];
        float ml[kWarps][GP][2];
        int qexp[GP];
    };
    struct TileK { uint4 kw[2][KQ]; };                  // cells g, 8 + g
    struct TileV { uint4 vw[4][VQ]; };                  // cells 2t, 2t + 1, 8 + 2t, 9 + 2t
    struct Args {
        const float* q;
        const __half* k_cache;
        const __half* v_cache;
        const int* bases;
        float* part_acc;
        float* part_ml;
        int H, Hk, max_cells, num_splits;
        float scale;
        int ring;
        const __half* k_vram;
        const __half* v_vram;
        int vram_cells;
    };

    static __device__ __forceinline__ int k_dim(int slice, int t, int e) { return t * (DH / 4) + 4 * slice + e; }
    static __device__ __forceinline__ int v_dim(int n, int c) { return c * (DH / 8) + n; }
    template <int N>   // 32-bit word i of N * 16 bytes
    static __device__ __forceinline__ uint32_t word(const uint4 (&w)[N], int i) {
        const uint4 x = w[i >> 2];
        return (i & 3) == 0 ? x.x : (i & 3) == 1 ? x.y : (i & 3) == 2 ? x.z : x.w;
    }

    template <bool PLAIN>
    static __device__ __forceinline__ void span(const Args& a, Smem& sm, int b, int kvh, int start, int end,
                                                int length, int64_t slot0) {
        constexpr int TILE = 16;
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const int G = a.H / a.Hk, Hk = a.Hk;
        const strata_dec::CellRows rows(a.bases, b, a.max_cells, Hk, kvh, length, a.ring, a.vram_cells);
        const int64_t row0 = rows.row0;
        const uint8_t* k8 = reinterpret_cast<const uint8_t*>(a.k_cache);
        const uint8_t* v8 = reinterpret_cast<const uint8_t*>(a.v_cache);
        const uint8_t* vram_k8 = reinterpret_cast<const uint8_t*>(a.k_vram);
        const uint8_t* vram_v8 = reinterpret_cast<const uint8_t*>(a.v_vram);
        // PLAIN: a lane's bytes of cell c at base + c * stride
        const uint8_t* const k_base = k8 + row0 * ROW + t * (DH / 4) * 2;
        const uint8_t* const v_base = v8 + row0 * ROW + g * (DH / 8) * 2;
        const uint32_t stride = Hk * ROW;
        const uint32_t last = static_cast<uint32_t>(end - 1);

        auto load_k = [&](int c0, TileK& r) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const int cell = c0 + nt * 8 + g;
                if constexpr (PLAIN) {
                    const uint8_t* p = k_base + static_cast<uint64_t>(min(static_cast<uint32_t>(cell), last)) * stride;
#pragma unroll
                    for (int i = 0; i < KQ; ++i) r.kw[nt][i] = load_raw<16>(p + 16 * i, true);
                } else {
                    const bool in_vram = cell < end && rows.vram.holds(cell);
                    const uint8_t* p = (in_vram ? vram_k8 : k8) + rows.at(cell, in_vram) * ROW + t * (DH / 4) * 2;
#pragma unroll
                    for (int i = 0; i < KQ; ++i) r.kw[nt][i] = load_raw<16>(p + 16 * i, cell < end);
                }
            }
        };
        auto load_v = [&](int c0, TileV& r) {
#pragma unroll
            for (int ci = 0; ci < 4; ++ci) {
                const int cell = c0 + (ci >> 1) * 8 + 2 * t + (ci & 1);
                if constexpr (PLAIN) {
                    const uint8_t* p = v_base + static_cast<uint64_t>(min(static_cast<uint32_t>(cell), last)) * stride;
#pragma unroll
                    for (int i = 0; i < VQ; ++i) r.vw[ci][i] = load_raw<16>(p + 16 * i, true);
                } else {
                    const bool in_vram = cell < end && rows.vram.holds(cell);
                    const uint8_t* p = (in_vram ? vram_v8 : v8) + rows.at(cell, in_vram) * ROW + g * (DH / 8) * 2;
#pragma unroll
                    for (int i = 0; i < VQ; ++i) r.vw[ci][i] = load_raw<16>(p + 16 * i, cell < end);
                }
            }
        };

        int c0 = start + warp * TILE;
        TileK tk;
        TileV tv;
        if (c0 < end) load_k(c0, tk), load_v(c0, tv);

        float qinv[NH];
        strata_dec::prepare_query<DH, GP, kWarps>(a.q, b, a.H, kvh, G, a.scale * kLog2e, &sm.acc[0][0][0], sm.qexp,
                                                  sm.qfrag, qinv, [](int slice, int ft, int e) { return k_dim(slice, ft, e); });

        float acc[NT][4] = {};
        float m[NH], l[NH];
#pragma unroll
        for (int h = 0; h < NH; ++h) m[h] = -INFINITY, l[h] = 0.0f;

        for (; c0 < end; c0 += kWarps * TILE) {
            const int next = c0 + kWarps * TILE;
            // scores s[h][ci] of head g + 8h and cell ci (2t, 2t + 1, 8 + 2t, 9 + 2t of the tile)
            float c[2][4] = {};
#pragma unroll
            for (int slice = 0; slice < NSLICE; ++slice) {
#pragma unroll
                for (int pass = 0; pass < NPASS; ++pass) {
                    const uint4 qa = sm.qfrag[slice * NPASS + pass][lane];
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt)
                        mma16816(c[nt], qa.x, qa.y, qa.z, qa.w, word(tk.kw[nt], 2 * slice),
                                 word(tk.kw[nt], 2 * slice + 1));
                }
            }
            float s[NH][4];
#pragma unroll
            for (int ci = 0; ci < 4; ++ci) {
                const int nt = ci >> 1, j = ci & 1;
                const bool valid = c0 + nt * 8 + 2 * t + j < end;
#pragma unroll
                for (int h = 0; h < NH; ++h) {
                    const float x = STACK ? c[nt][j] + c[nt][2 + j] : c[nt][2 * h + j];
                    s[h][ci] = valid ? x * qinv[h] : -INFINITY;
                }
            }
            if (next < end) load_k(next, tk);   // this tile's K is spent

            // online softmax over the tile: the 4 lanes of a group hold the head's 16 cells
            float alpha[NH];
#pragma unroll
            for (int h = 0; h < NH; ++h) {
                float mx = fmaxf(fmaxf(s[h][0], s[h][1]), fmaxf(s[h][2], s[h][3]));
                mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
                const float m_new = fmaxf(m[h], mx);        // finite: the tile's first cell is valid
                alpha[h] = exp2f(m[h] - m_new);             // 0 on the first tile (m = -inf)
                float sum = 0.0f;
#pragma unroll
                for (int ci = 0; ci < 4; ++ci) {
                    const float p = exp2f(s[h][ci] - m_new);   // 0 past the end (s = -inf)
                    s[h][ci] = p;
                    sum += p;
                }
                l[h] = fmaf(l[h], alpha[h], sum);
                m[h] = m_new;
            }
            if (__any_sync(kFull, alpha[0] != 1.0f || alpha[NH - 1] != 1.0f)) {
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    acc[n][0] *= alpha[0], acc[n][1] *= alpha[0];
                    acc[n][2] *= alpha[NH - 1], acc[n][3] *= alpha[NH - 1];
                }
            }

            // P V: p split hi + lo (rows g and g + 8, or a hi and a lo pass), V's f16 values as they are
            uint32_t af[NPASS][4];
            if constexpr (STACK) {
                split_pair(s[0][0], s[0][1], af[0][0], af[0][1]);
                split_pair(s[0][2], s[0][3], af[0][2], af[0][3]);
            } else {
#pragma unroll
                for (int h = 0; h < 2; ++h) {     // row g + 8h: registers 1 and 3 are row g + 8
                    split_pair(s[h][0], s[h][1], af[0][h], af[NPASS - 1][h]);
                    split_pair(s[h][2], s[h][3], af[0][2 + h], af[NPASS - 1][2 + h]);
                }
            }
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const uint32_t sel = (n & 1) ? 0x7632 : 0x5410;   // half n of each cell's words
                const uint32_t b01 = __byte_perm(word(tv.vw[0], n >> 1), word(tv.vw[1], n >> 1), sel);
                const uint32_t b23 = __byte_perm(word(tv.vw[2], n >> 1), word(tv.vw[3], n >> 1), sel);
#pragma unroll
                for (int pass = 0; pass < NPASS; ++pass)
                    mma16816(acc[n], af[pass][0], af[pass][1], af[pass][2], af[pass][3], b01, b23);
            }
            if (next < end) load_v(next, tv);   // this tile's V is spent
        }

        strata_dec::merge_warps<DH, GP, kWarps>(acc, m, l, sm.acc, sm.ml, G, slot0, a.num_splits, a.part_acc,
                                                a.part_ml, [](int n, int col) { return v_dim(n, col); });
    }
};

template <int DH, int GP>
__device__ __forceinline__ void attention_decode_tc(const float* __restrict__ q, const __half* __restrict__ k_cache,
                                                    const __half* __restrict__ v_cache,
                                                    const int* __restrict__ lengths, const int* __restrict__ bases,
                                                    float* __restrict__ part_acc, float* __restrict__ part_ml, int H,
                                                    int Hk, int max_cells, int num_splits, float scale, int window,
                                                    int ring, const __half* __restrict__ k_vram,
                                                    const __half* __restrict__ v_vram, int vram_cells) {
    using D = DecodeF16<DH, GP>;
    __shared__ typename D::Smem sm;

    const int kvh = blockIdx.y, b = blockIdx.z;
    const int G = H / Hk;
    const strata_dec::Span sp = strata_dec::split_span(lengths, window, H, Hk, num_splits);
    const int length = sp.length, start = sp.start, end = sp.end;
    const int64_t slot0 = sp.slot0;                          // head g: + g * num_splits

    if (start >= end) {
        strata_dec::empty_split<DH>(G, slot0, num_splits, part_acc, part_ml);
        return;
    }
    const typename D::Args a{q, k_cache, v_cache, bases, part_acc, part_ml, H, Hk, max_cells, num_splits, scale,
                             ring, k_vram, v_vram, vram_cells};
    if (ring == 0 && vram_cells == 0) D::template span<true>(a, sm, b, kvh, start, end, length, slot0);
    else D::template span<false>(a, sm, b, kvh, start, end, length, slot0);
}

}  // namespace

#define STRATA_DECODE_TC(DH, GP)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) strata_attention_decode_tc_f16_d##DH##_g##GP(              \
        const float* q, const __half* k_cache, const __half* v_cache, const int* lengths, const int* bases,    \
        float* part_acc, float* part_ml, int H, int Hk, int max_cells, int num_splits, float scale, int window, \
        int ring, const __half* k_vram, const __half* v_vram, int vram_cells, int tc_from) {                   \
        STRATA_PDL_ENTRY();                                                                                     \
        if (lengths[blockIdx.z] < tc_from) return;      /* attention.cu's row */                               \
        attention_decode_tc<DH, GP>(q, k_cache, v_cache, lengths, bases, part_acc, part_ml, H, Hk, max_cells,   \
                                    num_splits, scale, window, ring, k_vram, v_vram, vram_cells);              \
    }
STRATA_DECODE_TC(64, 1)
STRATA_DECODE_TC(64, 2)
STRATA_DECODE_TC(64, 4)
STRATA_DECODE_TC(64, 8)
STRATA_DECODE_TC(64, 16)
STRATA_DECODE_TC(128, 1)
STRATA_DECODE_TC(128, 2)
STRATA_DECODE_TC(128, 4)
STRATA_DECODE_TC(128, 8)
STRATA_DECODE_TC(128, 16)
#undef STRATA_DECODE_TC
