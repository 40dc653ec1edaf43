// Split-K decode attention on the tensor cores with f32 accuracy, the pieces cuda/kv_quant.cu (int8 and
// q4r K/V) and cuda/attention_dec_tc.cu (f16 K/V) share. Both run Q K^T and P V as mma.sync.m16n8k16
// (f16 operands, f32 sums) with every operand exact or split into hi + lo f16 halves (22 bits): the
// cache's values are exact in f16; the query, scaled per head by a power of two, and the probabilities
// are split. With G <= 8 query heads a KV head, the hi halves are rows g and the lo halves rows g + 8 of
// one MMA (STACK); with 16, a hi and a lo MMA run into one accumulator (NPASS 2).
//
// A block of NWARPS warps serves one (row, KV head, split). prepare_query turns the G query rows into
// the A fragments of every 16-dim slice in shared memory, with the dims of each slice's k positions
// chosen by the caller (KDim: slice, lane % 4, e -> dim, e = 0..3 for k positions 2t, 2t + 1, 2t + 8,
// 2t + 9), so the cache's bytes can be read in whatever order suits the format. merge_warps folds the
// warps' online-softmax states into the partials attention.cu's combine reads: part_acc [B, H, splits,
// DH], part_ml [B, H, splits, 2] (running max in the log2 domain, sum).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include "kv_codec.cuh"

namespace strata_dec {

__device__ __forceinline__ __half2 as_h2(uint32_t u) {
    __half2 h;
    memcpy(&h, &u, 4);
    return h;
}
__device__ __forceinline__ uint32_t as_u32(__half2 h) {
    uint32_t u;
    memcpy(&u, &h, 4);
    return u;
}

// {x0, x1} -> f16 halves hi and lo with hi + lo = x to 22 bits
__device__ __forceinline__ void split_pair(float x0, float x1, uint32_t& hi, uint32_t& lo) {
    const __half2 h = __floats2half2_rn(x0, x1);
    const float2 f = __half22float2(h);
    hi = as_u32(h);
    lo = as_u32(__floats2half2_rn(x0 - f.x, x1 - f.y));
}

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// N raw bytes (2, 4, 8 or 16) from p, or zeros where !valid.
template <int N>
struct RawT;
template <> struct RawT<2> { using T = unsigned short; };
template <> struct RawT<4> { using T = uint32_t; };
template <> struct RawT<8> { using T = uint2; };
template <> struct RawT<16> { using T = uint4; };
template <int N>
__device__ __forceinline__ typename RawT<N>::T load_raw(const void* p, bool valid) {
    using T = typename RawT<N>::T;
    T v;
    memset(&v, 0, sizeof(T));
    if (valid) v = *static_cast<const T*>(p);
    return v;
}

// The block's query fragments: the G heads of KV head kvh of row b (q [B, H, DH] f32), times qscale (the
// softmax scale in the log2 domain) and per head by 2^e (max |q| in [2^13, 2^14), exact), split hi + lo
// into qfrag_s[slice * NPASS + pass][lane] (uint4: the A registers of that slice's MMA); head g (+ 8)'s
// 2^-e into qinv. q_s [GP * DH] is scratch; the block's threads all call it; it ends on a barrier.
template <int DH, int GP, int NWARPS, class KDim>
__device__ __forceinline__ void prepare_query(const float* __restrict__ q, int b, int H, int kvh, int G,
                                              float qscale, float* q_s, int* qexp_s, uint4 (*qfrag_s)[32],
                                              float (&qinv)[GP <= 8 ? 1 : 2], KDim k_dim) {
    constexpr bool STACK = GP <= 8;
    constexpr int NPASS = STACK ? 1 : 2;
    constexpr int NH = STACK ? 1 : 2;
    constexpr int NSLICE = DH / 16;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    for (int j = threadIdx.x; j < GP * DH; j += blockDim.x) {
        const int h = j / DH;
        q_s[j] = h < G ? q[(static_cast<int64_t>(b) * H + kvh * G + h) * DH + j % DH] * qscale : 0.0f;
    }
    __syncthreads();
    for (int h = warp; h < GP; h += NWARPS) {
        float mx = 0.0f;
        for (int d = lane; d < DH; d += 32) mx = fmaxf(mx, fabsf(q_s[h * DH + d]));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        if (lane == 0) {
            int x = 0;
            frexpf(mx, &x);                       // mx = f 2^x, f in [0.5, 1)
            qexp_s[h] = mx > 0.0f ? max(-60, min(60, 14 - x)) : 0;
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < NSLICE * NPASS * 32; j += blockDim.x) {
        const int fl = j & 31, jp = j >> 5, slice = jp / NPASS, pass = jp % NPASS;
        const int fg = fl >> 2, ft = fl & 3;
        uint32_t r[4];
#pragma unroll
        for (int half = 0; half < 2; ++half) {          // k positions 2t + {0, 1}, then 2t + 8 + {0, 1}
#pragma unroll
            for (int row = 0; row < 2; ++row) {          // rows g, g + 8
                const int h = STACK ? fg : fg + 8 * row;
                const int comp = STACK ? row : pass;     // 0 hi, 1 lo
                __half v[2];
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    float x = 0.0f;
                    if (h < GP) x = ldexpf(q_s[h * DH + k_dim(slice, ft, 2 * half + i)], qexp_s[h]);
                    const __half hi = __float2half_rn(x);
                    v[i] = comp == 0 ? hi : __float2half_rn(x - __half2float(hi));
                }
                r[2 * half + row] = as_u32(__halves2half2(v[0], v[1]));
            }
        }
        qfrag_s[jp][fl] = make_uint4(r[0], r[1], r[2], r[3]);
    }
#pragma unroll
    for (int h = 0; h < NH; ++h) qinv[h] = g + 8 * h < GP ? ldexpf(1.0f, -qexp_s[g + 8 * h]) : 1.0f;
    __syncthreads();  // q_s is dead
}

// The split's partials from the warps' states in shared memory (after a barrier): acc_s [NWARPS][GP][DH]
// each warp's P V sums, ml_s [NWARPS][GP][2] its running max and sum; the warps merge in order
// (cuda/attention.cu's CUDA-core decode ends here too).
template <int DH, int GP, int NWARPS>
__device__ __forceinline__ void write_partials(const float (*acc_s)[GP][DH], const float (*ml_s)[GP][2], int G,
                                               int64_t slot0, int num_splits, float* __restrict__ part_acc,
                                               float* __restrict__ part_ml) {
    for (int j = threadIdx.x; j < G * DH; j += blockDim.x) {
        const int hd = j / DH, d = j % DH;
        float mmax = -INFINITY;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) mmax = fmaxf(mmax, ml_s[w][hd][0]);
        float a = 0.0f, lsum = 0.0f;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const float mw = ml_s[w][hd][0];
            const float e = mw == -INFINITY ? 0.0f : exp2f(mw - mmax);
            a = fmaf(acc_s[w][hd][d], e, a);
            lsum = fmaf(ml_s[w][hd][1], e, lsum);
        }
        const int64_t slot = slot0 + static_cast<int64_t>(hd) * num_splits;
        part_acc[slot * DH + d] = a;
        if (d == 0) part_ml[2 * slot] = mmax, part_ml[2 * slot + 1] = lsum;
    }
}

// The warps' states into the split's partials: acc [NT][4] (the P V accumulators: n-tile n, columns 2t,
// 2t + 1 of rows g and g + 8, column c of n-tile n being dim v_dim(n, c)), m and l of head g (+ 8) in
// the lanes of group g. acc_s [NWARPS][GP][DH] and ml_s [NWARPS][GP][2] are shared scratch.
template <int DH, int GP, int NWARPS, int NT, class VDim>
__device__ __forceinline__ void merge_warps(const float (&acc)[NT][4], const float (&m)[GP <= 8 ? 1 : 2],
                                            float (&l)[GP <= 8 ? 1 : 2], float (*acc_s)[GP][DH],
                                            float (*ml_s)[GP][2], int G, int64_t slot0, int num_splits,
                                            float* __restrict__ part_acc, float* __restrict__ part_ml,
                                            VDim v_dim) {
    constexpr bool STACK = GP <= 8;
    constexpr int NH = STACK ? 1 : 2;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < NH; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        const int head = g + 8 * h;
        if (head < GP) {
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    acc_s[warp][head][v_dim(n, 2 * t + j)] = STACK ? acc[n][j] + acc[n][2 + j] : acc[n][2 * h + j];
            if (t == 0) ml_s[warp][head][0] = m[h], ml_s[warp][head][1] = l[h];
        }
    }
    __syncthreads();
    write_partials<DH, GP, NWARPS>(acc_s, ml_s, G, slot0, num_splits, part_acc, part_ml);
}

// The cells of row b = blockIdx.z that split blockIdx.x reads for KV head blockIdx.y: the row's
// positions (its last `window` where window > 0) cut into num_splits spans of whole 16-cell tiles;
// slot0 is the split's partials slot of the KV head's first query head (head g: slot0 + g num_splits).
struct Span {
    int length, start, end;
    int64_t slot0;
};
__device__ __forceinline__ Span split_span(const int* __restrict__ lengths, int window, int H, int Hk,
                                           int num_splits) {
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int G = H / Hk;
    const int length = lengths[b];
    const int lo = strata_kv::window_first(length, window);
    const int per_split = (length - lo + num_splits - 1) / num_splits;
    const int span = (per_split + 15) / 16 * 16;
    const int start = lo + split * span;
    return {length, start, min(length, start + span), (static_cast<int64_t>(b) * H + kvh * G) * num_splits + split};
}

// Where row b's cells of KV head kvh lie: row0 is cell 0's head row in the cache ((first + c) Hk + kvh
// is cell c's in a plain cache); at(cell, in_vram) places any cell through the drafter's ring or, where
// vram.holds(cell), --kv-resident's VRAM window (strata_kv).
struct CellRows {
    int64_t row0, vram_row0;
    strata_kv::VramWindow vram;
    int Hk, ring;
    __device__ __forceinline__ CellRows(const int* __restrict__ bases, int b, int max_cells, int Hk_, int kvh,
                                        int length, int ring_, int vram_cells)
        : vram(length, static_cast<int>(gridDim.z), vram_cells), Hk(Hk_), ring(ring_) {
        const int64_t first = bases ? static_cast<int64_t>(bases[b]) : static_cast<int64_t>(b) * max_cells;
        row0 = first * Hk + kvh;
        vram_row0 = strata_kv::vram_ring_first(bases, first, max_cells, vram_cells) * Hk + kvh;
    }
    __device__ __forceinline__ int64_t at(int cell, bool in_vram) const {
        return in_vram ? vram_row0 + vram.slot(cell) * Hk
                       : row0 + static_cast<int64_t>(strata_kv::ring_cell(cell, ring)) * Hk;
    }
};

// An empty split's partials: zeros, max -inf, sum 0 (the combine gives it no weight).
template <int DH>
__device__ __forceinline__ void empty_split(int G, int64_t slot0, int num_splits, float* __restrict__ part_acc,
                                            float* __restrict__ part_ml) {
    for (int j = threadIdx.x; j < G * DH; j += blockDim.x) {
        const int64_t slot = slot0 + static_cast<int64_t>(j / DH) * num_splits;
        part_acc[slot * DH + j % DH] = 0.0f;
        if (j % DH == 0) part_ml[2 * slot] = -INFINITY, part_ml[2 * slot + 1] = 0.0f;
    }
}

}  // namespace strata_dec
