// RMSNorm and NEOX RoPE arithmetic, one copy for the standalone kernels (cuda/rms_norm.cu,
// cuda/rope.cu) and the fused ones (cuda/decode_fused.cu): sharing the code, not a copy of it,
// keeps the fused results bit-identical to the separate launches.
#pragma once

#include <cstdint>

namespace strata_norm {

constexpr int kMaxWarps = 32;   // block_sum's blocks: up to 1024 threads
constexpr int kMaxPairs = 512;  // rope_table's pairs: Dh up to 1024

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Sum of `v` over the block; every thread gets the result. Warp shuffles, then one shared-memory
// pass over the warps' sums; every thread of the block must call it (two barriers).
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float warp_sums[kMaxWarps];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int num_warps = blockDim.x >> 5;
        float s = lane < num_warps ? warp_sums[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// The FMA chain spelled out (what nvcc 13.0 contracted the plain sum to), so every kernel that sums a
// row through it (strata_rms_norm_f32, strata_add_rms_norm_f32, strata_qk_norm_rope_kv_<fmt>) gets the
// same bits whatever the compiler's contraction in its context.
__device__ __forceinline__ float sum_sq4(float4 v) { return fmaf(v.w, v.w, fmaf(v.z, v.z, fmaf(v.x, v.x, v.y * v.y))); }

// 1 / rms of n values whose squares sum to sum_sq.
__device__ __forceinline__ float rms_scale(float sum_sq, int n, float eps) {
    return rsqrtf(sum_sq / static_cast<float>(n) + eps);
}

__device__ __forceinline__ float rms_apply(float x, float scale, float w) { return x * scale * w; }

// yr[i] = rms_apply(xr[i], scale, w[i]) over one row of n, the block's threads strided (16-byte
// accesses when vec). yr may alias xr: each thread reads only the elements it writes.
__device__ __forceinline__ void rms_apply_row(const float* xr, const float* __restrict__ w, float* yr, int n,
                                              float scale, bool vec) {
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        float4* y4 = reinterpret_cast<float4*>(yr);
        for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
            const float4 v = x4[i], g = w4[i];
            y4[i] = make_float4(rms_apply(v.x, scale, g.x), rms_apply(v.y, scale, g.y), rms_apply(v.z, scale, g.z),
                                rms_apply(v.w, scale, g.w));
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = rms_apply(xr[i], scale, w[i]);
    }
}

// The (cos, sin) of one position's `half` pairs into shared memory: the angle pos * inv_freq[i] in
// f32, accurate sincosf (angles reach max_position radians), both times `scale` (YaRN's attention
// factor, 1 otherwise). Every thread of the block must call it (one barrier).
__device__ __forceinline__ void rope_table(float* cos_s, float* sin_s, float pos, const float* __restrict__ inv_freq,
                                           int half, float scale) {
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(__fmul_rn(pos, inv_freq[i]), &s, &c);
        cos_s[i] = __fmul_rn(c, scale);
        sin_s[i] = __fmul_rn(s, scale);
    }
    __syncthreads();
}

// NEOX rotation of the pair (a, b) = (x[i], x[i + Dh/2]); products and sums rounded separately (no
// FMA contraction), as numpy computes them.
__device__ __forceinline__ void rope_rotate(float a, float b, float c, float s, float& lo, float& hi) {
    lo = __fadd_rn(__fmul_rn(a, c), -__fmul_rn(b, s));
    hi = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

}  // namespace strata_norm
