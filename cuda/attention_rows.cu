// Causal attention over an f16 KV cache for any head dim up to 256: the path for shapes the tiled
// kernels of attention.cu do not cover (Dh outside {64, 128, 256}, or more than 16 query heads per
// KV head). Slow and simple: one block per (query, head), no tiling.
//
// strata_attention_rows_f16(q, k_cache, v_cache, positions, out, T, H, Hk, Dh, scale)
//   out[t, h, :] = softmax_c(scale * q[t, h] . k[c, h / G]) v[c, h / G] over cells 0..positions[t]
// q [T, H, Dh] f32; caches [S, Hk, Dh] f16 of one sequence (cell c of KV head k at (c * Hk + k) * Dh),
// already holding cells 0..max(positions); positions [T] int32 in device memory; out [T, H * Dh] f32.
// G = H / Hk; Dh <= 256.
//
// Launch: grid = (H, T, 1), block = (128, 1, 1), no dynamic shared memory. Each of the 4 warps
// takes every 4th cell: lanes hold dims lane, lane + 32, ... of q and of the running output, a cell's
// score is a warp sum, and the warp keeps an online softmax (max m, sum l, expf). The warps' (m, l,
// acc) merge in shared memory at the end.

#include <cuda_fp16.h>
#include <cstdint>

namespace {
constexpr int kWarps = 4, kMaxDims = 8;  // 8 dims per lane: Dh <= 256
}

extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_attention_rows_f16(
    const float* __restrict__ q, const __half* __restrict__ k_cache, const __half* __restrict__ v_cache,
    const int* __restrict__ positions, float* __restrict__ out, int T, int H, int Hk, int Dh, float scale) {
    __shared__ float part_ml[kWarps][2];
    __shared__ float part_acc[kWarps][kMaxDims * 32];
    const int h = blockIdx.x, t = blockIdx.y, kvh = h / (H / Hk);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* qr = q + (static_cast<long long>(t) * H + h) * Dh;
    float qv[kMaxDims], acc[kMaxDims];
#pragma unroll
    for (int i = 0; i < kMaxDims; ++i) {
        const int d = lane + 32 * i;
        qv[i] = d < Dh ? qr[d] * scale : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    const int last = positions[t];
    for (int c = warp; c <= last; c += kWarps) {
        const long long cell = (static_cast<long long>(c) * Hk + kvh) * Dh;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < kMaxDims; ++i) {
            const int d = lane + 32 * i;
            if (d < Dh) s = fmaf(qv[i], __half2float(k_cache[cell + d]), s);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new), p = expf(s - m_new);
        l = l * corr + p;
#pragma unroll
        for (int i = 0; i < kMaxDims; ++i) {
            const int d = lane + 32 * i;
            const float v = d < Dh ? __half2float(v_cache[cell + d]) : 0.0f;
            acc[i] = acc[i] * corr + p * v;
        }
        m = m_new;
    }
    if (lane == 0) part_ml[warp][0] = m, part_ml[warp][1] = l;
#pragma unroll
    for (int i = 0; i < kMaxDims; ++i) part_acc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, part_ml[w][0]);
    float wsum[kWarps], L = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        wsum[w] = part_ml[w][1] > 0.0f ? expf(part_ml[w][0] - M) : 0.0f;  // a warp with no cell adds nothing
        L += wsum[w] * part_ml[w][1];
    }
    float* o = out + (static_cast<long long>(t) * H + h) * Dh;
    for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) v += wsum[w] * part_acc[w][d];
        o[d] = v / L;
    }
}
