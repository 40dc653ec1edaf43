// The quantized KV codecs' per-head arithmetic, one copy for cuda/kv_quant.cu (the append kernels, the
// rotation) and the fused kernels (cuda/decode_fused.cu's QK-norm + RoPE + quantized append,
// cuda/attention.cu's combine with the un-rotation): sharing the code, not a copy of it, keeps the fused
// results bit for bit those of the separate launches. The rules are strata/quant/kv.py's (cuda/kv_quant.cu's
// header restates them). A head vector of Dh = 32 * PER values lies over one warp, PER consecutive values a
// lane (lane l holds dims l * PER .. l * PER + PER - 1). Also the decode kernels' rules for which cells a
// row reads and where they lie (window_first, ring_cell, VramWindow).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace strata_kv {

constexpr unsigned kFullMask = 0xffffffffu;

// A decode row's cell span and where a cell lies, for the split-K decode kernels (cuda/attention.cu,
// cuda/kv_quant.cu). window > 0: the row reads its last `window` positions only, length - window ..
// length - 1 (the MTP drafter under --draft-window); ring > 0: position p lies in cell p % ring of its
// sequence (the draft layer's K/V ring). 0 and 0: positions 0..length-1 in cells 0..length-1, the
// kernels' integer arithmetic exactly as before (no float operation depends on either).
__device__ __forceinline__ int window_first(int length, int window) {
    return window > 0 ? max(0, length - window) : 0;
}

__device__ __forceinline__ int ring_cell(int position, int ring) {
    return ring > 0 ? position % ring : position;
}

// y = H x over one head vector spread over the warp, PER = Dh / 32 consecutive values per lane.
// Stage h pairs (i, i + h) of every 2h-block into (a + b, a - b): inside a lane for h < PER, with
// lane ^ (h / PER) for larger h.
template <int PER>
__device__ __forceinline__ void hadamard_warp(float (&v)[PER], int lane, float rot_scale) {
#pragma unroll
    for (int h = 1; h < PER; h <<= 1) {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            if (!(i & h)) {
                const float a = v[i], b = v[i + h];
                v[i] = a + b;
                v[i + h] = a - b;
            }
        }
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const bool upper = lane & o;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const float other = __shfl_xor_sync(kFullMask, v[i], o);
            v[i] = upper ? other - v[i] : v[i] + other;
        }
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) v[i] *= rot_scale;
}

template <int PER>
__device__ __forceinline__ void load_row(const float* p, float (&v)[PER]) {
#pragma unroll
    for (int i = 0; i < PER; ++i) v[i] = p[i];
}

// int8: one head vector (v, lane's PER values) -> values [Dh] int8 and scales [Dh / 64] f16 of its row.
template <int PER>
__device__ __forceinline__ void quantize_int8(const float (&v)[PER], int lane, int8_t* values, __half* scales) {
    constexpr int LANES = 64 / PER;                             // lanes per 64-value block
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = 1; o < LANES; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o));
    const __half d = __float2half_rn(amax / 127.0f);
    const float df = __half2float(d);
    int8_t* out = values + lane * PER;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int q = df > 0.0f ? __float2int_rn(v[i] / df) : 0;
        out[i] = static_cast<int8_t>(max(-127, min(127, q)));
    }
    if (lane % LANES == 0) scales[lane / LANES] = d;
}

// Where q4r's logical value byte p of a head vector (values 2p, 2p + 1; block p / 16) is stored among
// its nb * 16 bytes: piece t = (p % 16) / 4 of block b = p / 16 at (t nb + b) * 4, bytes in order, so
// the decode's quad lane t reads its 4 bytes of every block as one run (strata/quant/kv.py q4_byte_pos).
__host__ __device__ constexpr int q4_byte_pos(int p, int nb) {
    return ((((p & 15) >> 2) * nb + (p >> 4)) << 2) + (p & 3);
}

// q4r: one head vector already rotated (v = H x) -> values [Dh / 2] uint8 (q4_byte_pos's order) and
// scales [Dh / 32] f16.
template <int PER>
__device__ __forceinline__ void quantize_q4r(const float (&v)[PER], int lane, uint8_t* values, __half* scales) {
    constexpr int LANES = 32 / PER;                             // lanes per 32-value block
    // the value of largest magnitude, the first (lowest index) on ties
    float best = v[0];
    int best_i = lane * PER;
#pragma unroll
    for (int i = 1; i < PER; ++i)
        if (fabsf(v[i]) > fabsf(best)) best = v[i], best_i = lane * PER + i;
#pragma unroll
    for (int o = 1; o < LANES; o <<= 1) {
        const float ob = __shfl_xor_sync(kFullMask, best, o);
        const int oi = __shfl_xor_sync(kFullMask, best_i, o);
        if (fabsf(ob) > fabsf(best) || (fabsf(ob) == fabsf(best) && oi < best_i)) best = ob, best_i = oi;
    }
    const __half d = __float2half_rn(best / -8.0f);
    const float df = __half2float(d);
    int q[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) q[i] = df != 0.0f ? min(15, static_cast<int>(floorf(v[i] / df + 8.5f))) : 8;
#pragma unroll
    for (int i = 0; i < PER / 2; ++i)     // nb = Dh / 32 = PER blocks
        values[q4_byte_pos(lane * (PER / 2) + i, PER)] = static_cast<uint8_t>(q[2 * i] | (q[2 * i + 1] << 4));
    if (lane % LANES == 0) scales[lane / LANES] = d;
}

// Row `row` (cell * Hk + head) of a codec's planes: int8 (Q4 false) or q4r (Q4 true, v rotated in place
// first), from the lane's PER values v.
template <bool Q4, int PER>
__device__ __forceinline__ void append_head(float (&v)[PER], int lane, int64_t row, void* values, __half* scales,
                                            float rot_scale) {
    constexpr int DH = 32 * PER;
    if constexpr (Q4) {
        hadamard_warp<PER>(v, lane, rot_scale);
        quantize_q4r<PER>(v, lane, static_cast<uint8_t*>(values) + row * (DH / 2), scales + row * (DH / 32));
    } else {
        quantize_int8<PER>(v, lane, static_cast<int8_t*>(values) + row * DH, scales + row * (DH / 64));
    }
}

// Where a decode row's cells live under --kv-resident's VRAM window: the sequence's newest cells are
// also in a VRAM ring of vram_cells cells, position p at p % vram_cells, and the newest
// vram_cells - kVramSlack of them, from `from` on, are read there, older ones from the caches (mapped
// host memory); vram_cells 0: every cell in the caches. B rows of one sequence at consecutive
// positions: the newest row's length is at most length + B - 1, so from = length + B - 1 - (vram_cells
// - kVramSlack) is safe for every row. The slack: a speculation window appends up to 8 rows past the
// sequence's length and most may be rejected; their slots are those of positions kVramSlack or more
// cells older than anything read later, so the rejected cells never clobber a cell a later row reads
// from the ring (strata/backends/cuda/memory.py DeviceKV has the argument). The split-K decode kernels
// of cuda/attention.cu and cuda/kv_quant.cu share it; only addresses depend on it, never the float
// arithmetic.
constexpr int kVramSlack = 16;      // strata.backends.cuda.memory.KV_VRAM_SLACK

// The first cell of a decode row's sequence's VRAM ring within the rings (--kv-resident with
// parallel slots: one ring of vram_cells cells per slot of max_cells cells, the slot that of the
// row's first cache cell); 0 without bases (the rows read one ring) or without a window.
__device__ __forceinline__ int64_t vram_ring_first(const int* bases, int64_t first, int max_cells, int vram_cells) {
    return bases && vram_cells > 0 && max_cells > 0 ? first / max_cells * vram_cells : 0;
}

struct VramWindow {
    int from, first_slot, cells;
    __device__ VramWindow(int length, int rows, int vram_cells)
        : from(vram_cells > 0 ? max(0, length + rows - 1 - (vram_cells - kVramSlack)) : length),
          first_slot(vram_cells > 0 ? from % vram_cells : 0), cells(vram_cells) {}
    __device__ bool holds(int position) const { return position >= from; }
    // position % cells for positions in from..from + cells - 1 (every position a row reads there)
    __device__ int64_t slot(int position) const {
        const int s = first_slot + (position - from);
        return s >= cells ? s - cells : s;
    }
};

}  // namespace strata_kv
