// What the tensor-core prompt attention kernels share (cuda/attention_tc.cu on mma.sync,
// cuda/attention_wg.cu on wgmma): the block's shape (4 warps, 64 query rows, 64-cell K/V tiles),
// cp.async, the rows' places and positions, Q as f16 A fragments, and the causal mask with the online
// softmax over S accumulators in the m16n8 accumulator layout (which wgmma's m64nN accumulators keep
// per warp). Include inside an anonymous namespace.

#pragma once

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kWarps = 4;
constexpr int kRows = 16 * kWarps;  // query rows per block
constexpr int kCells = 64;          // cells per K/V tile
constexpr int kThreads = 32 * kWarps;
constexpr int kPairWarps = 8;       // head dim 256: two warps per 16 rows (attention_prefill_tc_pairs)
constexpr int kPairThreads = 32 * kPairWarps;
constexpr int kPairCells = 32;      // cells per K/V tile at head dim 256

__device__ __forceinline__ void cp_async16(unsigned dst, const void* gmem, bool valid) {
    // src-size 0 zero-fills: cells past the block's last position read as 0, never as NaN garbage
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

// 2^x on the MUFU unit, subnormal results flushed to 0 (they only ever weigh a V row by < 2^-126)
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// The causal mask (only on a tile that reaches past the smallest position of the block) and the
// online softmax of one tile's S accumulators in place, for this thread's two rows: the running max
// m and per-thread partial sum l updated, alpha the factor the rows' O accumulators take.
template <int CTILES>
__device__ __forceinline__ void mask_and_softmax(float (&s)[CTILES][4], float (&m)[2], float (&l)[2],
                                                 float (&alpha)[2], int cell0, int min_pos,
                                                 const int (&row_pos)[2], int tq) {
    if (cell0 + CTILES * 8 - 1 > min_pos) {  // the tile reaches past some row's position
#pragma unroll
        for (int n = 0; n < CTILES; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (cell0 + n * 8 + 2 * tq + (j & 1) > row_pos[j >> 1]) s[n][j] = -INFINITY;
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float mx = m[i];
#pragma unroll
        for (int n = 0; n < CTILES; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * i], s[n][2 * i + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_use = mx == -INFINITY ? 0.0f : mx;  // a row with nothing visible yet stays at 0
        alpha[i] = ex2(m[i] - m_use);
        m[i] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < CTILES; ++n) {
            s[n][2 * i] = ex2(s[n][2 * i] - m_use);
            s[n][2 * i + 1] = ex2(s[n][2 * i + 1] - m_use);
            sum += s[n][2 * i] + s[n][2 * i + 1];
        }
        l[i] = l[i] * alpha[i] + sum;
    }
}


// The prologue both kernels share. A block's rows are the flattened (token, head in group) list;
// this thread holds two of them, `first` and first + 8 (gq and gq + 8 of its 16-row group).
struct RowPlace {
    int64_t first, num_rows;
    int G, H, kvh, DH;
    __device__ __forceinline__ int64_t flat(int i) const { return first + 8 * i; }
    __device__ __forceinline__ int64_t offset(int i) const {  // element offset of row i in q and out
        const int64_t f = flat(i);
        return (f / G * H + kvh * G + f % G) * DH;
    }
};

// The smallest and largest position of the block's tokens (at most ROWS of them, no more than the
// block's threads): per warp by shuffles into pos_s[warp]; block_span reduces the warps after a
// barrier. No atomics.
template <int ROWS = kRows>
__device__ __forceinline__ void block_positions(const int* __restrict__ positions, int64_t row0, int64_t num_rows,
                                                int G, int warp, int lane, int (*pos_s)[2]) {
    const int64_t t_first = row0 / G, t_last = (min(row0 + ROWS, num_rows) - 1) / G;
    const int64_t t = t_first + threadIdx.x;
    const bool valid = t <= t_last;
    int lo = valid ? positions[t] : INT32_MAX, hi = valid ? positions[t] : -1;
    for (int o = 16; o > 0; o >>= 1) {
        lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
    if (lane == 0) pos_s[warp][0] = lo, pos_s[warp][1] = hi;
}

struct Span {
    int min_pos, num_cells;  // cells 0..num_cells-1 are the most any row of the block reads
};

template <int WARPS>
__device__ __forceinline__ Span block_span(const int (*pos_s)[2]) {
    int min_pos = pos_s[0][0], max_pos = pos_s[0][1];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) min_pos = min(min_pos, pos_s[w][0]), max_pos = max(max_pos, pos_s[w][1]);
    return {min_pos, max_pos + 1};
}

// This thread's two rows: their positions (-1: past the end) and their Q as mma A fragments over
// KSTEPS k-steps of 16 dims, scaled by qscale and rounded to f16 (zeros for a row past the end).
template <int KSTEPS>
__device__ __forceinline__ void load_rows_q(const float* __restrict__ q, const int* __restrict__ positions,
                                            const RowPlace& rows, int tq, float qscale, int (&row_pos)[2],
                                            unsigned (&qa)[KSTEPS][4]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int64_t f = rows.flat(i);
        row_pos[i] = f < rows.num_rows ? positions[f / rows.G] : -1;
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float* qrow = q + (row_pos[i] >= 0 ? rows.offset(i) : 0);
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // a[i + 2h]: row gq + 8i, cols ks*16 + 2tq + 8h, +1
                float2 v = make_float2(0.0f, 0.0f);
                if (row_pos[i] >= 0) v = *reinterpret_cast<const float2*>(qrow + ks * 16 + 2 * tq + 8 * h);
                qa[ks][i + 2 * h] = pack_half2(v.x * qscale, v.y * qscale);
            }
        }
    }
}

// The epilogue: this thread's two rows of O divided by their softmax sums (the per-thread partial
// sums reduced over the quad first) into out; rows past the end (position -1) are not written.
template <int DTILES>
__device__ __forceinline__ void store_rows(const float (&o)[DTILES][4], float (&l)[2], const int (&row_pos)[2],
                                           const RowPlace& rows, int tq, float* __restrict__ out) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        if (row_pos[i] < 0) continue;
        const float inv = 1.0f / l[i];
        float* dst = out + rows.offset(i) + 2 * tq;
#pragma unroll
        for (int n = 0; n < DTILES; ++n)
            *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
    }
}
