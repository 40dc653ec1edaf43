// Rotary position embedding, NEOX style, in place.
//
// strata_rope_f32(x, positions, inv_freq, T, heads, head_dim, scale)
//   for token t at position p = positions[t], pair i < Dh/2 of every head:
//     a = f32(p) * inv_freq[i];  c = cos(a) * scale;  s = sin(a) * scale
//     x[t, h, i]        <- x[t, h, i] * c - x[t, h, i + Dh/2] * s
//     x[t, h, i + Dh/2] <- x[t, h, i + Dh/2] * c + x[t, h, i] * s
//   `scale` is the attention factor YaRN folds into cos/sin (1 otherwise); inv_freq [Dh/2] f32 is
//   strata.model.rope.inv_freq's table rounded to f32, so the angle is the reference's f32 product.
//
// Layout: x [T, heads, Dh] row-major f32, positions [T] int32 in device memory (a CUDA graph
// replays one launch for every step), inv_freq [Dh/2] f32. Dh even, Dh/2 <= kMaxPairs.
//
// Launch: grid = (T, 1, 1), one block per token; block = (128, 1, 1) (any multiple of 32 up to
// 1024 is correct); no dynamic shared memory. The block computes the token's Dh/2 (cos, sin)
// pairs once into shared memory (accurate sincosf: angles reach max_position radians), then
// rotates all heads' pairs. Products and the sum are rounded separately (no FMA contraction), as
// numpy computes them, so only sin/cos rounding differs from the reference (~1 ulp). The table and
// the rotation are cuda/norm_rope.cuh's, shared with strata_qk_norm_rope_kv_f32.
//
// strata_rope_partial_f32(x, positions, inv_freq, T, heads, head_dim, rot_dim, scale)
//   Partial RoPE (Qwen3-Next's gated attention): the same rotation over the first rot_dim dims of
//   every head only, pairs (i, i + rot_dim/2) for i < rot_dim/2; dims rot_dim.. are left as they are.
//   inv_freq [rot_dim/2]; rot_dim even, rot_dim <= head_dim, rot_dim/2 <= kMaxPairs. With rot_dim ==
//   head_dim it is strata_rope_f32 bit for bit. Launch as strata_rope_f32.

#include <cstdint>

#include "norm_rope.cuh"

using namespace strata_norm;

// The first rot_dim dims of each head rotate (NEOX halves of rot_dim); the rest stay as they are.
__device__ __forceinline__ void rope_rows(float* x, const int* __restrict__ positions,
                                          const float* __restrict__ inv_freq, int T, int heads, int head_dim,
                                          int rot_dim, float scale) {
    __shared__ float cos_s[kMaxPairs], sin_s[kMaxPairs];
    const int t = blockIdx.x;
    if (t >= T) return;
    const int half = rot_dim / 2;
    rope_table(cos_s, sin_s, static_cast<float>(positions[t]), inv_freq, half, scale);
    float* xt = x + static_cast<int64_t>(t) * heads * head_dim;
    for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
        const int h = j / half, i = j - h * half;
        float* xh = xt + static_cast<int64_t>(h) * head_dim;
        const float a = xh[i], b = xh[i + half];
        rope_rotate(a, b, cos_s[i], sin_s[i], xh[i], xh[i + half]);
    }
}

extern "C" __global__ void strata_rope_f32(float* x, const int* __restrict__ positions,
                                           const float* __restrict__ inv_freq, int T, int heads,
                                           int head_dim, float scale) {
    rope_rows(x, positions, inv_freq, T, heads, head_dim, head_dim, scale);
}

extern "C" __global__ void strata_rope_partial_f32(float* x, const int* __restrict__ positions,
                                                   const float* __restrict__ inv_freq, int T, int heads,
                                                   int head_dim, int rot_dim, float scale) {
    rope_rows(x, positions, inv_freq, T, heads, head_dim, rot_dim, scale);
}
