// Attention over an f16 KV cache: the append kernel, split-K decode (flash-decoding) and its
// combine, and flash-style causal prompt attention. f32 queries and outputs, f32 arithmetic.
//
// Cache layout (one sequence): K and V are separate [S, Hk, Dh] row-major f16 arrays, cell s of
// KV head k at (s * Hk + k) * Dh. Decode reads B sequences stored back to back, sequence b at
// b * max_cells * Hk * Dh. Query head h reads KV head h / (H / Hk) (GQA). Scores are kept in the
// log2 domain: q is pre-multiplied by scale * log2(e), so softmax uses exp2f.
//
// Entry points (Dh in {64, 128, 256}; G = H / Hk):
//   strata_kv_append_f16                         f32 K/V rows -> f16 cache cells (from device memory)
//   strata_kv_ring_append                        appended cells (any format's planes) -> the VRAM window
//   strata_attention_decode_f16_d<Dh>_g<GP>      split-K partials; GP = G rounded up to 1,2,4,8,16
//                                                (Dh 256: GP <= 8); a sliding window over a ring of
//                                                cells where asked (the MTP drafter's K/V ring)
//   strata_attention_decode_combine_f32          partials -> out [B, H * Dh]
//   strata_attention_decode_combine_rot_f32      the same, each head's output then Hadamard-rotated
//   strata_attention_decode_cl_f16_d<Dh>_g<GP>   short rows' split-K and combine in one launch (a cluster
//                                                a KV head, sm_90+): out [B, H * Dh]
//   strata_attention_prefill_f16_d<Dh>           causal attention of T queries -> out [T, H * Dh]

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>
#include "decode_mma.cuh"
#include "kv_codec.cuh"
#include "pdl.cuh"

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kDecodeWarps = 4;
constexpr int kMaxSplits = 1024;

__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    // src-size 0 zero-fills the 16 bytes: cells past the end read as 0, never as stale data
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// N consecutive halves (N = 2, 4 or 8: one 4-, 8- or 16-byte load) -> f32.
template <int N>
__device__ __forceinline__ void load_halves(const __half* p, float (&out)[N]) {
    if constexpr (N == 2) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(p));
        out[0] = f.x, out[1] = f.y;
    } else {
        using Vec = typename std::conditional<N == 4, uint2, uint4>::type;
        const Vec raw = *reinterpret_cast<const Vec*>(p);
        const __half2* h2 = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const float2 f = __half22float2(h2[i]);
            out[2 * i] = f.x, out[2 * i + 1] = f.y;
        }
    }
}

// Reduce-scatter of N per-lane partial sums over the warp. Afterwards lane l holds R = max(N/32, 1)
// full sums in v[0..R): v[i] is value hi(l) * R + i, where hi(l) takes lane bits 16, 8, 4, ...
// (16 most significant) for the first min(5, log2 N) halvings. N/2 + N/4 + ... shuffles instead of
// 5 per value.
template <int N>
__device__ __forceinline__ void warp_reduce_scatter(float (&v)[N], int lane) {
    int n = N;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        if (n > 1) {
            const bool upper = lane & o;
#pragma unroll
            for (int i = 0; i < N / 2; ++i) {
                if (i < n / 2) {
                    const float send = upper ? v[i] : v[i + n / 2];
                    const float keep = upper ? v[i + n / 2] : v[i];
                    v[i] = keep + __shfl_xor_sync(kFull, send, o);
                }
            }
            n /= 2;
        } else {
            v[0] += __shfl_xor_sync(kFull, v[0], o);
        }
    }
}

template <int N>
__host__ __device__ constexpr int log2_int() { return N <= 1 ? 0 : 1 + log2_int<N / 2>(); }

// The value index warp_reduce_scatter<N> leaves in lane `lane`, slot 0.
template <int N>
__device__ __forceinline__ int reduce_scatter_index(int lane) {
    constexpr int steps = cmin(5, log2_int<N>());
    constexpr int r = N >> steps;
    int hi = 0;
#pragma unroll
    for (int j = 0; j < steps; ++j) hi = (hi << 1) | ((lane >> (4 - j)) & 1);
    return hi * r;
}

}  // namespace

// ---- KV append ---------------------------------------------------------------------------------
//
// strata_kv_append_f16(k, v, cells, k_cache, v_cache, T, row_elems)
//   k_cache[cells[t], :] = f16(k[t, :]), same for v; row_elems = Hk * Dh, even.
// k, v: [T, Hk, Dh] f32; cells [T] int32 in device memory (a row of the caches, which may hold
// several sequences back to back). Round to nearest even, as numpy's astype(float16).
// Launch: grid = (T, 1, 1), block = (128, 1, 1); each thread converts pairs with half2 stores.
extern "C" __global__ void strata_kv_append_f16(const float* __restrict__ k, const float* __restrict__ v,
                                                const int* __restrict__ cells, __half* __restrict__ k_cache,
                                                __half* __restrict__ v_cache, int T, int row_elems) {
    STRATA_PDL_ENTRY();
    const int t = blockIdx.x;
    if (t >= T) return;
    const int64_t dst = static_cast<int64_t>(cells[t]) * row_elems;
    const int64_t src = static_cast<int64_t>(t) * row_elems;
    const float2* k2 = reinterpret_cast<const float2*>(k + src);
    const float2* v2 = reinterpret_cast<const float2*>(v + src);
    __half2* kc = reinterpret_cast<__half2*>(k_cache + dst);
    __half2* vc = reinterpret_cast<__half2*>(v_cache + dst);
    for (int i = threadIdx.x; i < row_elems / 2; i += blockDim.x) {
        kc[i] = __float22half2_rn(k2[i]);
        vc[i] = __float22half2_rn(v2[i]);
    }
}

// strata_kv_ring_append(cells, src0..src3, dst0..dst3, T, ring_cells, bytes0..bytes3, max_cells)
//   the VRAM window of --kv-resident: for each plane p < gridDim.y (f16 K and V; a quantized format's
//   K values, K scales, V values, V scales) the bytes[p] bytes of cell c = cells[t] of src[p] (the
//   authoritative cells, just appended) are copied to dst[p]'s ring of that cell's sequence, c /
//   max_cells (parallel slots of max_cells cells each), at its slot c % max_cells % ring_cells. Rows
//   of one sequence are at consecutive cells, so rows t < T - ring_cells are skipped: a newer row of
//   the batch takes their slot (blocks run in no order, and only the newest may win); a batch of
//   several slots' rows has T <= 8 < ring_cells. bytes[p] even.
// Launch: grid = (T, planes, 1), block = (128, 1, 1); 2-byte loads, a block per (row, plane).
extern "C" __global__ void strata_kv_ring_append(const int* __restrict__ cells, const void* src0, const void* src1,
                                                 const void* src2, const void* src3, void* dst0, void* dst1,
                                                 void* dst2, void* dst3, int T, int ring_cells, int bytes0,
                                                 int bytes1, int bytes2, int bytes3, int max_cells) {
    STRATA_PDL_ENTRY();
    const int t = blockIdx.x, p = blockIdx.y;
    if (t >= T || t < T - ring_cells) return;
    const void* const srcs[4] = {src0, src1, src2, src3};
    void* const dsts[4] = {dst0, dst1, dst2, dst3};
    const int sizes[4] = {bytes0, bytes1, bytes2, bytes3};
    const int64_t cell = cells[t], n = sizes[p] / 2;
    const uint16_t* s = static_cast<const uint16_t*>(srcs[p]) + cell * n;
    const int64_t slot = cell / max_cells * ring_cells + cell % max_cells % ring_cells;
    uint16_t* d = static_cast<uint16_t*>(dsts[p]) + slot * n;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}

// ---- decode: split-K partials ------------------------------------------------------------------
//
// strata_attention_decode_f16_d<DH>_g<GP>(q, k_cache, v_cache, lengths, bases, part_acc, part_ml,
//                                          H, Hk, max_cells, num_splits, scale, window, ring, k_vram,
//                                          v_vram, vram_cells, tc_from)
// q [B, H, DH] f32 (one query per row); caches [B, max_cells, Hk, DH] f16; lengths [B] int32 in
// device memory: row b attends to cells 0..lengths[b]-1 (>= 1) of its sequence, whose cell 0 is
// cache cell bases[b] (bases [B] int32 in device memory: rows of several sequences in one cache,
// as parallel slots' batched steps are), or b * max_cells when bases is null. Outputs per (b, h, split):
// part_acc [B, H, num_splits, DH] = sum_c 2^(s_c - m) v_c and part_ml [B, H, num_splits, 2] = (m, l),
// l = sum_c 2^(s_c - m); an empty split writes (-inf, 0) and zeros. window > 0: row b reads only
// positions lengths[b] - window .. lengths[b] - 1 (clamped at 0), the splits dividing those; ring > 0:
// position p is cell p % ring of the sequence (strata_kv::window_first / ring_cell). 0, 0: as before,
// bit for bit (the window and ring change which cells are read, never the float arithmetic).
// vram_cells > 0 (--kv-resident N, the caches then in mapped host memory): k_vram / v_vram
// [slots, vram_cells, Hk, DH] hold each sequence's newest cells, position p at p % vram_cells of its
// sequence's ring: with bases, row b's is ring bases[b] / max_cells (parallel slots, max_cells cells
// each; max_cells is then that stride), without bases ring 0. Row b reads positions from
// strata_kv::VramWindow's `from` (lengths[b] + B - 1 - (vram_cells - 16)) on there, older ones in
// place over the bus; only the addresses change, so the output is bit for bit that of vram_cells 0
// (ring 0 with it). tc_from: rows of lengths[b] >= tc_from are left alone (nothing of theirs is
// written): cuda/attention_dec_tc.cu's kernel of the same contract takes them, as each row's own
// length decides, so a row's result is the same in any batch (INT_MAX: every row is this kernel's).
//
// Launch: grid = (num_splits, Hk, B), block = (128, 1, 1), no dynamic shared memory. The split
// size is ceil(length / num_splits) rounded up to a tile, computed on the device from lengths[b],
// so one launch shape (one CUDA graph) serves every length; pick num_splits for the largest length
// (about 2 blocks per multiprocessor). One block serves all G query heads of its KV head, so each
// K/V byte is read once. Tiles of kTile cells (16 KB of K + V) stream through shared memory with
// cp.async, double-buffered. Each warp takes a quarter of every tile: per step of NC cells every
// lane dots its Dh/32 dims of each cell against the GP query heads (held in registers), the
// GP * NC partial sums are reduce-scattered across the warp, one lane per head updates the online
// softmax, and every lane accumulates P * V for its dims of all heads. Warps merge at the end.
// Measured (H200, H 32 / Hk 4, Dh 128, 2 blocks per SM, launches back to back): 9.8 us for 8.4 MB of
// K/V at 4096 cells, 21.2 us for 33.6 MB at 16384 (1.6 TB/s, 37% of the 4.2 TB/s copy rate). The
// kernel is issue-bound, not memory-bound: 64 FFMA per cell per lane (Q K and P V) plus the
// reduce-scatter and f16 converts leave no issue slots to spare. Next: mma.sync on split-f16
// operands (hi + lo halves keep f32 accuracy) for both products, and the combine fused in.
template <int DH, int GP>
__device__ __forceinline__ void attention_decode(const float* __restrict__ q, const __half* __restrict__ k_cache,
                                                 const __half* __restrict__ v_cache, const int* __restrict__ lengths,
                                                 const int* __restrict__ bases, float* __restrict__ part_acc,
                                                 float* __restrict__ part_ml, int H, int Hk, int max_cells,
                                                 int num_splits, float scale, int window, int ring,
                                                 const __half* __restrict__ k_vram, const __half* __restrict__ v_vram,
                                                 int vram_cells, int split, int kvh, int b, int64_t slot0,
                                                 int slot_stride) {
    constexpr int kTile = 4096 / DH;                 // cells per stage
    constexpr int kCellsPerWarp = kTile / kDecodeWarps;
    constexpr int NC = cmin(cmin(8, kCellsPerWarp), 64 / GP);
    constexpr int kSteps = kCellsPerWarp / NC;
    constexpr int DPL = DH / 32;                     // dims per lane
    constexpr int NV = GP * NC;                      // partial sums per step
    constexpr int R = NV >= 32 ? NV / 32 : 1;
    constexpr int kChunks = DH / 8;                  // 16-byte chunks per row
    static_assert(kDecodeWarps * GP * DH * 4 <= 2 * 2 * kTile * DH * 2, "warp merge must fit the tiles");

    __shared__ alignas(16) __half tiles[2][2][kTile][DH];   // [stage][K, V][cell][dim]
    __shared__ float score_s[kDecodeWarps][NV];
    __shared__ alignas(16) float p_s[kDecodeWarps][NC][GP];
    __shared__ float alpha_s[kDecodeWarps][GP];
    __shared__ float ml_s[kDecodeWarps][GP][2];

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int G = H / Hk;
    const int length = lengths[b];
    const int lo = strata_kv::window_first(length, window);
    const int per_split = (length - lo + num_splits - 1) / num_splits;
    const int span = (per_split + kTile - 1) / kTile * kTile;
    const int start = lo + split * span, end = min(length, start + span);

    if (start >= end) {
        strata_dec::empty_split<DH>(G, slot0, slot_stride, part_acc, part_ml);
        return;
    }

    const int64_t row_stride = static_cast<int64_t>(Hk) * DH;
    const int64_t first = bases ? static_cast<int64_t>(bases[b]) : static_cast<int64_t>(b) * max_cells;
    const int64_t seq_base = first * row_stride + static_cast<int64_t>(kvh) * DH;
    const __half* kb = k_cache + seq_base;
    const __half* vb = v_cache + seq_base;
    const strata_kv::VramWindow vram(length, static_cast<int>(gridDim.z), vram_cells);
    const int64_t vram_seq = strata_kv::vram_ring_first(bases, first, max_cells, vram_cells) * row_stride;
    const __half* kv_ = k_vram + vram_seq + static_cast<int64_t>(kvh) * DH;
    const __half* vv_ = v_vram + vram_seq + static_cast<int64_t>(kvh) * DH;
    auto load_tile = [&](int stage, int cell0) {
        for (int i = threadIdx.x; i < kTile * kChunks; i += blockDim.x) {
            const int c = i / kChunks, part = (i % kChunks) * 8, cell = cell0 + c;
            const bool valid = cell < end, in_vram = valid && vram.holds(cell);
            const int64_t off =
                valid ? (in_vram ? vram.slot(cell) : strata_kv::ring_cell(cell, ring)) * row_stride + part : 0;
            cp_async16(&tiles[stage][0][c][part], (in_vram ? kv_ : kb) + off, valid);
            cp_async16(&tiles[stage][1][c][part], (in_vram ? vv_ : vb) + off, valid);
        }
        cp_async_commit();
    };
    load_tile(0, start);

    float qv[GP][DPL];
    const float qscale = scale * kLog2e;
#pragma unroll
    for (int g = 0; g < GP; ++g) {
        const float* qh = q + (static_cast<int64_t>(b) * H + kvh * G + g) * DH + lane * DPL;
#pragma unroll
        for (int i = 0; i < DPL; ++i) qv[g][i] = 0.0f;
        if (g < G) {
#pragma unroll
            for (int i = 0; i < DPL; ++i) qv[g][i] = qh[i] * qscale;
        }
    }
    float acc[GP][DPL] = {};
    float m = -INFINITY, l = 0.0f;                   // head `lane`'s running max and sum (lane < GP)
    const int head_of_slot = reduce_scatter_index<NV>(lane);

    const int num_tiles = (end - start + kTile - 1) / kTile;
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int stage = tile & 1;
        if (tile + 1 < num_tiles) {
            load_tile(stage ^ 1, start + (tile + 1) * kTile);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int tile_cell0 = start + tile * kTile;
#pragma unroll 1
        for (int step = 0; step < kSteps; ++step) {
            const int c0 = warp * kCellsPerWarp + step * NC;
            float part[NV];
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                float kf[DPL];
                load_halves<DPL>(&tiles[stage][0][c0 + c][lane * DPL], kf);
#pragma unroll
                for (int g = 0; g < GP; ++g) {
                    float s = 0.0f;
#pragma unroll
                    for (int i = 0; i < DPL; ++i) s = fmaf(qv[g][i], kf[i], s);
                    part[g * NC + c] = s;
                }
            }
            warp_reduce_scatter<NV>(part, lane);
#pragma unroll
            for (int i = 0; i < R; ++i) score_s[warp][head_of_slot + i] = part[i];
            __syncwarp();
            if (lane < GP) {
                float mx = -INFINITY;
#pragma unroll
                for (int c = 0; c < NC; ++c)
                    if (tile_cell0 + c0 + c < end) mx = fmaxf(mx, score_s[warp][lane * NC + c]);
                const float m_new = fmaxf(m, mx);
                const float alpha = m_new == -INFINITY ? 1.0f : exp2f(m - m_new);
                float sum = 0.0f;
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    const bool valid = tile_cell0 + c0 + c < end;
                    const float p = valid ? exp2f(score_s[warp][lane * NC + c] - m_new) : 0.0f;
                    p_s[warp][c][lane] = p;
                    sum += p;
                }
                l = l * alpha + sum;
                m = m_new;
                alpha_s[warp][lane] = alpha;
            }
            __syncwarp();
#pragma unroll
            for (int g = 0; g < GP; ++g) {
                const float a = alpha_s[warp][g];
#pragma unroll
                for (int i = 0; i < DPL; ++i) acc[g][i] *= a;
            }
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                float vf[DPL];
                load_halves<DPL>(&tiles[stage][1][c0 + c][lane * DPL], vf);
#pragma unroll
                for (int g = 0; g < GP; ++g) {
                    const float p = p_s[warp][c][g];
#pragma unroll
                    for (int i = 0; i < DPL; ++i) acc[g][i] = fmaf(p, vf[i], acc[g][i]);
                }
            }
            __syncwarp();
        }
        __syncthreads();  // the stage is reloaded next iteration
    }

    // merge the warps: their accumulators go where the tiles were
    float* acc_s = reinterpret_cast<float*>(&tiles[0][0][0][0]);
#pragma unroll
    for (int g = 0; g < GP; ++g)
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc_s[(warp * GP + g) * DH + lane * DPL + i] = acc[g][i];
    if (lane < GP) ml_s[warp][lane][0] = m, ml_s[warp][lane][1] = l;
    __syncthreads();
    strata_dec::write_partials<DH, GP, kDecodeWarps>(reinterpret_cast<const float(*)[GP][DH]>(acc_s), ml_s, G, slot0,
                                                     slot_stride, part_acc, part_ml);
}

#define STRATA_DECODE(DH, GP)                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) strata_attention_decode_f16_d##DH##_g##GP(               \
        const float* q, const __half* k_cache, const __half* v_cache, const int* lengths, const int* bases,    \
        float* part_acc, float* part_ml, int H, int Hk, int max_cells, int num_splits, float scale,            \
        int window, int ring, const __half* k_vram, const __half* v_vram, int vram_cells, int tc_from) {       \
        STRATA_PDL_ENTRY();                                                                                     \
        if (lengths[blockIdx.z] >= tc_from) return;     /* attention_dec_tc.cu's row */                        \
        const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;                                        \
        attention_decode<DH, GP>(q, k_cache, v_cache, lengths, bases, part_acc, part_ml, H, Hk, max_cells,      \
                                 num_splits, scale, window, ring, k_vram, v_vram, vram_cells, split, kvh, b,   \
                                 (static_cast<int64_t>(b) * H + kvh * (H / Hk)) * num_splits + split,          \
                                 num_splits); /* head g's slot: + g * num_splits */                            \
    }
STRATA_DECODE(64, 1) STRATA_DECODE(64, 2) STRATA_DECODE(64, 4) STRATA_DECODE(64, 8) STRATA_DECODE(64, 16)
STRATA_DECODE(128, 1) STRATA_DECODE(128, 2) STRATA_DECODE(128, 4) STRATA_DECODE(128, 8) STRATA_DECODE(128, 16)
STRATA_DECODE(256, 1) STRATA_DECODE(256, 2) STRATA_DECODE(256, 4) STRATA_DECODE(256, 8)
#undef STRATA_DECODE

// ---- decode: combine ---------------------------------------------------------------------------
//
// strata_attention_decode_combine_f32(part_acc, part_ml, out, H, head_dim, num_splits)
//   out[b, h, :] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,  M = max_s m_s
// Layout: the partials of strata_attention_decode_*; out [B, H * head_dim] f32.
// Launch: grid = (H, B, 1), block = (128, 1, 1); num_splits <= 1024. The block finds M and the
// split weights once (shared memory), then each thread sums its dims over the splits.
//
// strata_attention_decode_combine_rot_f32(part_acc, part_ml, out, H, head_dim, num_splits, rot_scale)
//   The same out[b, h, :], then H out[b, h, :] (strata_hadamard_f32's rotation, cuda/kv_codec.cuh): a V
//   stored rotated (cuda/kv_quant.cu's q4r) leaves the weighted sum rotated, and this un-rotates it in
//   the same launch, bit for bit combine + strata_hadamard_f32. head_dim in {64, 128, 256}.
//   Launch: as the combine's. The combined head goes to shared memory, then warp 0 rotates it.
namespace {

// The partials of one (row, head) where the split kernels wrote them: m(s), l(s) and at(s, d), acc[s][d].
struct GlobalParts {
    const float* __restrict__ ml;
    const float* __restrict__ acc;
    int head_dim;
    __device__ __forceinline__ float m(int s) const { return ml[2 * s]; }
    __device__ __forceinline__ float l(int s) const { return ml[2 * s + 1]; }
    __device__ __forceinline__ float at(int s, int d) const { return acc[static_cast<int64_t>(s) * head_dim + d]; }
};

// One (row, head) of the combine into dst[0..head_dim) (global or shared memory) from num_splits partials
// read through parts (m(s), l(s), at(s, d): GlobalParts, or ClusterParts in a cluster's shared memory);
// every thread of the 128-thread block must call it. The arithmetic is the same whatever parts reads from.
template <class Parts>
__device__ __forceinline__ void combine_parts(const Parts& parts, float* dst, int head_dim, int num_splits) {
    __shared__ float weight_s[kMaxSplits];
    __shared__ float red_s[4];
    __shared__ int last_s[4];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    float mmax = -INFINITY;
    for (int s = threadIdx.x; s < num_splits; s += blockDim.x) mmax = fmaxf(mmax, parts.m(s));
    for (int o = 16; o > 0; o >>= 1) mmax = fmaxf(mmax, __shfl_xor_sync(kFull, mmax, o));
    if (lane == 0) red_s[warp] = mmax;
    __syncthreads();
    mmax = fmaxf(fmaxf(red_s[0], red_s[1]), fmaxf(red_s[2], red_s[3]));
    __syncthreads();

    float lsum = 0.0f;
    for (int s = threadIdx.x; s < num_splits; s += blockDim.x) {
        const float ms = parts.m(s);
        const float w = ms == -INFINITY ? 0.0f : exp2f(ms - mmax);
        weight_s[s] = w;
        lsum = fmaf(w, parts.l(s), lsum);
    }
    for (int o = 16; o > 0; o >>= 1) lsum += __shfl_xor_sync(kFull, lsum, o);
    if (lane == 0) red_s[warp] = lsum;
    // The splits past the last one that read cells: an empty one ((m, l) = (-inf, 0), acc zeros: every
    // decode kernel's empty_split) adds fmaf(0, 0, a) = a (a is never -0: it starts at +0 and a sum only
    // gives -0 from two -0s), so leaving the trailing ones out changes no bit; a cache sized past the row
    // (splits for max_cells) has many. A split of NaN scores (m -inf, l NaN) is not empty. (The 32nd
    // session's list of every used split, read through shared memory eight loads ahead, made decode after
    // 16,384 cells 17% slower on an H100: 229-230 against 277 tok/s; this keeps the plain chain.)
    int last = -1;
    for (int s = threadIdx.x; s < num_splits; s += blockDim.x)
        if (!(parts.m(s) == -INFINITY && parts.l(s) == 0.0f)) last = s;
    for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(kFull, last, o));
    if (lane == 0) last_s[warp] = last;
    __syncthreads();
    lsum = (red_s[0] + red_s[1]) + (red_s[2] + red_s[3]);
    const int used = max(max(last_s[0], last_s[1]), max(last_s[2], last_s[3])) + 1;

    // a chunk's loads before its FMAs (a valid split's address for each, so no load waits on a guard),
    // then the same chain of fmaf in split order, so the same bits as one load and FMA a split: the
    // loads of a chunk are in flight together (the plain loop's SASS waited on the L2 after every three
    // loads). 36th session, H100: decode after 16,384 cells 289.4 / 287.2 against 284.3 / 284.2 tok/s,
    // the tensor cores' attention step 24.3 against 25.7 us a layer.
    constexpr int kChunk = 16;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (int s0 = 0; s0 < used; s0 += kChunk) {
            float v[kChunk];
#pragma unroll
            for (int i = 0; i < kChunk; ++i) v[i] = parts.at(min(s0 + i, used - 1), d);
#pragma unroll
            for (int i = 0; i < kChunk; ++i)
                if (s0 + i < used) a = fmaf(weight_s[s0 + i], v[i], a);
        }
        dst[d] = lsum > 0.0f ? a / lsum : 0.0f;
    }
}

// One (row, head) of the combine from the split kernels' partials (head h = blockIdx.x of row b = blockIdx.y).
__device__ __forceinline__ void combine_head(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                             float* dst, int H, int head_dim, int num_splits) {
    const int64_t slot0 = (static_cast<int64_t>(blockIdx.y) * H + blockIdx.x) * num_splits;
    combine_parts(GlobalParts{part_ml + 2 * slot0, part_acc + slot0 * head_dim, head_dim}, dst, head_dim, num_splits);
}

template <int PER>
__device__ __forceinline__ void rotate_head(const float* src, float* dst, float rot_scale) {
    const int lane = threadIdx.x;
    float v[PER];
    strata_kv::load_row<PER>(src + lane * PER, v);
    strata_kv::hadamard_warp<PER>(v, lane, rot_scale);
#pragma unroll
    for (int i = 0; i < PER; ++i) dst[lane * PER + i] = v[i];
}

}  // namespace

extern "C" __global__ void __launch_bounds__(128) strata_attention_decode_combine_f32(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, float* __restrict__ out, int H,
    int head_dim, int num_splits) {
    STRATA_PDL_ENTRY();
    combine_head(part_acc, part_ml, out + (static_cast<int64_t>(blockIdx.y) * H + blockIdx.x) * head_dim, H,
                 head_dim, num_splits);
}

extern "C" __global__ void __launch_bounds__(128) strata_attention_decode_combine_rot_f32(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, float* __restrict__ out, int H,
    int head_dim, int num_splits, float rot_scale) {
    STRATA_PDL_ENTRY();
    __shared__ float o_s[256];
    combine_head(part_acc, part_ml, o_s, H, head_dim, num_splits);
    __syncthreads();
    if (threadIdx.x >= 32) return;
    float* o = out + (static_cast<int64_t>(blockIdx.y) * H + blockIdx.x) * head_dim;
    if (head_dim == 64) rotate_head<2>(o_s, o, rot_scale);
    else if (head_dim == 128) rotate_head<4>(o_s, o, rot_scale);
    else if (head_dim == 256) rotate_head<8>(o_s, o, rot_scale);
}

// ---- decode of short rows: the split-K and its combine in one launch, a cluster a KV head ------------
//
// strata_attention_decode_cl_f16_d<DH>_g<GP>(q, k_cache, v_cache, lengths, bases, out, H, Hk, max_cells,
//     scale, window, ring, k_vram, v_vram, vram_cells, below)
//   out [B, H * DH] f32 for the rows of lengths[b] < below, bit for bit strata_attention_decode_f16 with
//   num_splits = kClusterSplits followed by strata_attention_decode_combine_f32 (the same spans, the same
//   split arithmetic and warp merge, the same combine); rows of `below` cells or more are left alone
//   (nothing of theirs is written: the split-K kernels and their combine take them, launched before this).
//   The other arguments are attention_decode's.
// Launch: grid = (kClusterSplits, Hk, B), block = (128, 1, 1), a cluster of kClusterSplits blocks along x
// (compiled in: sm_90 and later only; the host never launches it on older GPUs; 16 blocks is past the
// portable cluster size, so the host sets CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED first). At
// 16 splits a row of 512 cells gives each block one 32-cell tile, as the split-K kernel's 66 splits of a
// cache sized for a longer context do. Block j of a cluster
// reads split j's cells into its partials in its own shared memory; after the cluster's barrier, block
// g of the cluster combines query head g of the KV head (g, g + kClusterSplits, ...) from every block's
// shared memory, and a second barrier keeps each block's shared memory alive until its peers have read
// it. So a short row's attention costs one launch instead of two, the partials never leave the chip,
// and no empty split of a cache sized for a longer context is launched.
constexpr int kClusterSplits = 16;   // past the portable 8: the host allows it (Function.allow_wide_clusters)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define STRATA_DECODE_CLUSTER __cluster_dims__(kClusterSplits, 1, 1)
#else
#define STRATA_DECODE_CLUSTER
#endif
// Code for an arch without clusters (the PTX of an older arch JIT-compiled for a newer GPU) would combine each
// block's partials alone: it traps instead (the host refuses such an install first: kernels.cluster_unavailable).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define STRATA_NO_CLUSTER_TRAP() __trap()
#else
#define STRATA_NO_CLUSTER_TRAP() \
    do {                         \
    } while (0)
#endif

namespace {

__device__ __forceinline__ void cluster_sync() {     // every thread of every block of the cluster
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// this block's shared-memory address p as the same address in block `rank` of its cluster
template <class T>
__device__ __forceinline__ const T* cluster_peer(const T* p, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint64_t out;
    asm("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(reinterpret_cast<uint64_t>(p)), "r"(rank));
    return reinterpret_cast<const T*>(out);
#else
    return p;
#endif
}

// A query head's partials in the cluster's blocks' shared memory: split s's in block s.
template <int DH, int GP>
struct ClusterParts {
    const float (*acc)[GP][DH];     // this block's part_s, mapped to each peer's
    const float (*ml)[GP][2];
    int g;
    __device__ __forceinline__ float m(int s) const { return (*cluster_peer(ml, s))[g][0]; }
    __device__ __forceinline__ float l(int s) const { return (*cluster_peer(ml, s))[g][1]; }
    __device__ __forceinline__ float at(int s, int d) const { return (*cluster_peer(acc, s))[g][d]; }
};

}  // namespace

#define STRATA_DECODE_CL(DH, GP)                                                                               \
    extern "C" __global__ void STRATA_DECODE_CLUSTER __launch_bounds__(128) strata_attention_decode_cl_f16_d##DH##_g##GP( \
        const float* q, const __half* k_cache, const __half* v_cache, const int* lengths, const int* bases,    \
        float* out, int H, int Hk, int max_cells, float scale, int window, int ring, const __half* k_vram,     \
        const __half* v_vram, int vram_cells, int below) {                                                     \
        STRATA_PDL_ENTRY();                                                                                     \
        STRATA_NO_CLUSTER_TRAP();                                                                               \
        __shared__ alignas(16) float part_s[GP][DH];                                                           \
        __shared__ float pml_s[GP][2];                                                                          \
        const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, G = H / Hk;                            \
        if (lengths[b] >= below) return;   /* the whole cluster: the row is the split-K kernels' */            \
        attention_decode<DH, GP>(q, k_cache, v_cache, lengths, bases, &part_s[0][0], &pml_s[0][0], H, Hk,     \
                                 max_cells, kClusterSplits, scale, window, ring, k_vram, v_vram, vram_cells,   \
                                 split, kvh, b, 0, 1);                                                          \
        cluster_sync();                                                                                         \
        for (int g = split; g < G; g += kClusterSplits)                                                        \
            combine_parts(ClusterParts<DH, GP>{&part_s, &pml_s, g},                                            \
                          out + (static_cast<int64_t>(b) * H + kvh * G + g) * DH, DH, kClusterSplits);         \
        cluster_sync();                                                                                         \
    }
STRATA_DECODE_CL(64, 1) STRATA_DECODE_CL(64, 2) STRATA_DECODE_CL(64, 4) STRATA_DECODE_CL(64, 8)
STRATA_DECODE_CL(64, 16) STRATA_DECODE_CL(128, 1) STRATA_DECODE_CL(128, 2) STRATA_DECODE_CL(128, 4)
STRATA_DECODE_CL(128, 8) STRATA_DECODE_CL(128, 16) STRATA_DECODE_CL(256, 1) STRATA_DECODE_CL(256, 2)
STRATA_DECODE_CL(256, 4) STRATA_DECODE_CL(256, 8)
#undef STRATA_DECODE_CL

// ---- prompt: causal flash attention ------------------------------------------------------------
//
// strata_attention_prefill_f16_d<DH>(q, k_cache, v_cache, positions, out, T, H, Hk, scale)
//   out[t, h, :] = softmax_c(scale * q[t, h] . k[c, h / G]) v[c, h / G] over cells c <= positions[t]
// q [T, H, DH] f32; caches [S, Hk, DH] f16 of one sequence, already holding cells
// 0..max(positions) (kv_append first); positions [T] int32 in device memory; out [T, H * DH] f32.
//
// Launch: grid = (ceil(T * G / ROWS), Hk, 1), block = (128, 1, 1), no dynamic shared memory. A
// block owns ROWS query rows of one KV head, taken from the flattened (token, head-in-group) list,
// so all G heads of a token share every K/V tile load. Per tile of CELLS cells: the K/V tile comes
// to shared memory (cp.async), S = Q K^T on a 16 x 8 thread grid (each thread ROWS/16 rows x CELLS/8
// cells, cells interleaved and rows padded so the reads are bank-conflict free), the causal mask,
// an online-softmax update per row (8 lanes per row, shuffles), P to shared memory, and O += P V
// with each thread holding ROWS/16 rows x DH/8 dims in registers. FFMA only: tensor cores
// (mma.sync / wgmma on f16 Q, K, V) would move this from the ~60 TFLOP/s FP32 ceiling to the
// ~990 TFLOP/s f16 one, at the cost of rounding Q and P to f16.
template <int DH, int ROWS, int CELLS>
__device__ __forceinline__ void attention_prefill(const float* __restrict__ q, const __half* __restrict__ k_cache,
                                                  const __half* __restrict__ v_cache,
                                                  const int* __restrict__ positions, float* __restrict__ out, int T,
                                                  int H, int Hk, float scale) {
    constexpr int RPT = ROWS / 16, CPT = CELLS / 8, DCH = DH / 32;  // rows, cells, 4-dim chunks per thread
    constexpr int QS = DH + 4, KS = DH + 8, PS = CELLS + 1;          // padded row strides
    __shared__ alignas(16) float q_s[ROWS][QS];
    __shared__ alignas(16) __half k_s[CELLS][KS];
    __shared__ alignas(16) __half v_s[CELLS][KS];
    __shared__ float p_s[ROWS][PS];
    __shared__ int max_pos_s;

    const int kvh = blockIdx.y, G = H / Hk;
    const int ty = threadIdx.x >> 3, tx = threadIdx.x & 7;
    const int64_t row0 = static_cast<int64_t>(blockIdx.x) * ROWS;
    const int64_t num_rows = static_cast<int64_t>(T) * G;
    const float qscale = scale * kLog2e;

    if (threadIdx.x == 0) max_pos_s = -1;
    __syncthreads();
    for (int r = threadIdx.x / (DH / 4); r < ROWS; r += blockDim.x / (DH / 4)) {
        const int d = (threadIdx.x % (DH / 4)) * 4;
        const int64_t f = row0 + r;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (f < num_rows) {
            const int64_t t = f / G, h = kvh * G + f % G;
            v = *reinterpret_cast<const float4*>(q + (t * H + h) * DH + d);
            v.x *= qscale, v.y *= qscale, v.z *= qscale, v.w *= qscale;
            if (d == 0) atomicMax(&max_pos_s, positions[t]);
        }
        *reinterpret_cast<float4*>(&q_s[r][d]) = v;
    }
    int row_pos[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
        const int64_t f = row0 + ty * RPT + r;
        row_pos[r] = f < num_rows ? positions[f / G] : -1;
    }
    __syncthreads();
    const int num_cells = max_pos_s + 1;

    const int64_t row_stride = static_cast<int64_t>(Hk) * DH;
    const __half* kb = k_cache + static_cast<int64_t>(kvh) * DH;
    const __half* vb = v_cache + static_cast<int64_t>(kvh) * DH;
    float acc[RPT][DCH][4] = {};
    float m[RPT], l[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) m[r] = -INFINITY, l[r] = 0.0f;

    for (int cell0 = 0; cell0 < num_cells; cell0 += CELLS) {
        for (int i = threadIdx.x; i < CELLS * (DH / 8); i += blockDim.x) {
            const int c = i / (DH / 8), part = (i % (DH / 8)) * 8, cell = cell0 + c;
            const bool valid = cell < num_cells;
            const int64_t off = valid ? cell * row_stride + part : 0;
            cp_async16(&k_s[c][part], kb + off, valid);
            cp_async16(&v_s[c][part], vb + off, valid);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        float s[RPT][CPT] = {};
#pragma unroll 4
        for (int d = 0; d < DH; d += 4) {
            float4 qr[RPT];
#pragma unroll
            for (int r = 0; r < RPT; ++r) qr[r] = *reinterpret_cast<const float4*>(&q_s[ty * RPT + r][d]);
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                float kf[4];
                load_halves<4>(&k_s[tx + 8 * j][d], kf);
#pragma unroll
                for (int r = 0; r < RPT; ++r)
                    s[r][j] = fmaf(qr[r].w, kf[3], fmaf(qr[r].z, kf[2], fmaf(qr[r].y, kf[1], fmaf(qr[r].x, kf[0], s[r][j]))));
            }
        }
        float alpha[RPT];
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                if (cell0 + tx + 8 * j > row_pos[r]) s[r][j] = -INFINITY;
                mx = fmaxf(mx, s[r][j]);
            }
            for (int o = 1; o < 8; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
            const float m_new = fmaxf(m[r], mx);
            alpha[r] = m_new == -INFINITY ? 1.0f : exp2f(m[r] - m_new);
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                const float p = s[r][j] == -INFINITY ? 0.0f : exp2f(s[r][j] - m_new);
                p_s[ty * RPT + r][tx + 8 * j] = p;
                sum += p;
            }
            for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(kFull, sum, o);
            l[r] = l[r] * alpha[r] + sum;
            m[r] = m_new;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < RPT; ++r)
#pragma unroll
            for (int k = 0; k < DCH; ++k)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[r][k][i] *= alpha[r];
#pragma unroll 4
        for (int c = 0; c < CELLS; ++c) {
            float p[RPT];
#pragma unroll
            for (int r = 0; r < RPT; ++r) p[r] = p_s[ty * RPT + r][c];
#pragma unroll
            for (int k = 0; k < DCH; ++k) {
                float vf[4];
                load_halves<4>(&v_s[c][4 * tx + 32 * k], vf);
#pragma unroll
                for (int r = 0; r < RPT; ++r)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[r][k][i] = fmaf(p[r], vf[i], acc[r][k][i]);
            }
        }
        __syncthreads();  // k_s, v_s and p_s are rewritten by the next tile
    }

#pragma unroll
    for (int r = 0; r < RPT; ++r) {
        const int64_t f = row0 + ty * RPT + r;
        if (f >= num_rows) continue;
        const int64_t t = f / G, h = kvh * G + f % G;
        float* o = out + (t * H + h) * DH;
#pragma unroll
        for (int k = 0; k < DCH; ++k) {
            const float4 v = make_float4(acc[r][k][0] / l[r], acc[r][k][1] / l[r], acc[r][k][2] / l[r], acc[r][k][3] / l[r]);
            *reinterpret_cast<float4*>(o + 4 * tx + 32 * k) = v;
        }
    }
}

#define STRATA_PREFILL(DH, ROWS, CELLS)                                                                       \
    extern "C" __global__ void __launch_bounds__(128) strata_attention_prefill_f16_d##DH(                     \
        const float* q, const __half* k_cache, const __half* v_cache, const int* positions, float* out, int T, \
        int H, int Hk, float scale) {                                                                         \
        STRATA_PDL_ENTRY();                                                                                   \
        attention_prefill<DH, ROWS, CELLS>(q, k_cache, v_cache, positions, out, T, H, Hk, scale);             \
    }
STRATA_PREFILL(64, 32, 32)
STRATA_PREFILL(128, 32, 32)
STRATA_PREFILL(256, 16, 16)
#undef STRATA_PREFILL
