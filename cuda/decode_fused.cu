// Fused kernels for the non-MoE work of a decoder layer: fewer launches per decode step (a CUDA
// graph's time is bounded by its node count long before the GEMVs' weight reads).
//
// strata_add_rms_norm_f32(x, y, x_out, w, out, rows, n, eps)
//   x_out[r, i] = x[r, i] + y[r, i]
//   out[r, i]   = x_out[r, i] * rsqrt(mean_i(x_out[r, :]^2) + eps) * w[i]
//   A residual add and the RMSNorm after it (strata_add_f32 + strata_rms_norm_f32 in one launch,
//   with the same thread mapping and the same code, cuda/norm_rope.cuh, so the results are
//   bit-identical to that pair).
//   Layout: x, y, x_out, out [rows, n] row-major f32, w [n] f32. x_out may alias x or y, and out
//   may alias any of them: every element is read and written by one thread, the norm's reads of a
//   row finish (block barrier) before the first write of out.
//   Launch: grid = (rows, 1, 1), block = (256, 1, 1) (any multiple of 32 up to 1024).
//
// strata_qk_norm_rope_kv_f32(q, k, v, q_w, k_w, positions, cells, inv_freq, q_out, k_cache, v_cache,
//                            T, H, Hk, head_dim, eps, scale)
//   For token t at position p = positions[t], every head of q [T, H, Dh] and k [T, Hk, Dh]:
//     RMSNorm over the head's Dh values with q_w / k_w [Dh], then NEOX RoPE as cuda/rope.cu, the
//     same code (cuda/norm_rope.cuh: the angle f32(p) * inv_freq[i] in f32, accurate sincosf, cos
//     and sin times `scale`, products and sums rounded separately); q -> q_out [T, H, Dh] f32;
//     k -> k_cache row c as f16; v [T, Hk, Dh] -> v_cache row c as f16 (round to nearest even, as
//     strata_kv_append_f16), c = cells[t] (the token's row of caches that may hold several
//     sequences back to back), or p where cells is null. A row of the caches holds Hk * Dh halves. Replaces 2 rms_norm +
//     2 copies + 2 rope + kv_append.
//   q_out may alias q. positions [T] int32 in device memory (a CUDA graph replays one launch).
//   Dh even, Dh / 2 <= kMaxPairs.
//   Launch: grid = (T, any, 1), block = (128, 1, 1); warp w of block (t, b) takes heads
//   b * 4 + w, then strides by gridDim.y * 4 over the H + 2 * Hk heads (q heads, k heads, v heads),
//   so any grid.y is complete; ceil((H + 2 * Hk) / 4) gives one head per warp. A warp holds one
//   head: lane j owns the RoPE pairs (j, j + Dh/2), (j + 32, ...), reduces the sum of squares with
//   shuffles, then normalizes and rotates its pairs in registers. The block computes its token's
//   Dh/2 (cos, sin) once into shared memory.
//
// strata_qk_norm_rope_kv_<fmt>(q, k, v, q_w, k_w, positions, cells, inv_freq, q_out, k_values, k_scales,
//                             v_values, v_scales, T, H, Hk, head_dim, eps, scale, rot_scale)
//   The same QK-norm and RoPE into a quantized cache (cuda/kv_quant.cu's planes, fmt int8: int8 K and V;
//   q4_0: q4r K and V; k8v4: int8 K, q4r V), bit for bit the unfused chain the cache ran before:
//   strata_rms_norm_f32 on q and k (its sum order on the 16-byte path, 256 threads: QuantHead::rms),
//   strata_rope_f32, then strata_kv_append_int8 / _q4r of k and of v (cuda/kv_codec.cuh, the same code:
//   q4r rotates the head first) into row cells[t] (positions[t] where cells is null) of the planes, and
//   q -> q_out, rotated (strata_hadamard_f32) where K is q4r. Each row's outputs depend on that row only.
//   head_dim in {64, 128, 256}; q and k 16-byte aligned (as the unfused chain's 16-byte path needs);
//   q_out may alias q. rot_scale = f32(1 / sqrt(head_dim)).
//   Launch: as strata_qk_norm_rope_kv_f32's: grid (T, any), block 128, a warp per head (q, k, v heads).//
// strata_gemv3_<qtype>(W0, W1, W2, x, y0, y1, y2, rows0, rows1, rows2, n, batch)
//   y_i[b, r] = sum_k W_i[r, k] * x[b, k] for the three matrices W_i [rows_i, n] (one quant type,
//   one n) and b < batch <= 8: the q, k and v projections in one launch. batch == 1 runs the
//   single-token row body of strata_gemv_<qtype>, batch > 1 the batched body of
//   strata_gemv_batch_<qtype> (n % 8 == 0); both are cuda/gemv_rows.cuh, shared with cuda/gemv.cu,
//   so the outputs equal the three separate launches. Layout and alignment as cuda/gemv.cu.
// strata_gemv3_rows_<qtype>(same arguments)
//   The same y_i, row-invariant: row b is bit for bit what batch == 1 computes on x[b] (the
//   single-token body for every token, cuda/gemv_rows.cuh's gemv_rows_multi), for a speculative
//   verify window or parallel slots. Grid as for batch == 1.
//   Launch: block = (128, 1, 1), any grid: warps stride over the row sets of the concatenated
//   rows (a row set = gemv.cu's rows per warp, of one matrix); one set per warp is
//   ceil(sum_i ceil(rows_i / rows_per_warp) / 4) blocks, rows_per_warp = 4 for batch > 1.
// strata_gemv3_one_<qtype>(same arguments, batch 1; Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL)
//   batch == 1's y_i with one row a warp (a row set of one row), bit for bit; a block stages x once
//   for all its rounds, so the grid is ceil(sum_i rows_i / 4), capped as strata_gemv_one_<qtype>'s
//   (memory.gemv_whole_grid: ONE_ROW_BLOCKS_PER_SM blocks a multiprocessor).

#include <cuda_fp16.h>

#include <cstdint>

#include "gemv_rows.cuh"
#include "gemv_units.cuh"
#include "gemv_units_k.cuh"
#include "kv_codec.cuh"
#include "norm_rope.cuh"
#include "quant_blocks.cuh"
#include "pdl.cuh"

namespace {

using namespace strata_q;
using namespace strata_gemv;
using namespace strata_norm;

constexpr int kWarps = 4;  // GEMV and QK-norm blocks: 128 threads
constexpr int kNormHeld = 4;   // float4s of a row strata_add_rms_norm_f32 holds a thread (4096 floats at 256 threads)

}  // namespace

// ---- residual add + RMSNorm ----------------------------------------------------------------------

extern "C" __global__ void strata_add_rms_norm_f32(const float* x, const float* y, float* x_out,
                                                   const float* __restrict__ w, float* out, int rows, int n,
                                                   float eps) {
    STRATA_PDL_ENTRY();
    const int row = blockIdx.x;
    if (row >= rows) return;
    const int64_t off = static_cast<int64_t>(row) * n;
    const bool vec = (n % 4 == 0) &&
                     ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y) |
                       reinterpret_cast<uintptr_t>(x_out) | reinterpret_cast<uintptr_t>(w) |
                       reinterpret_cast<uintptr_t>(out)) % 16 == 0);
    float sum_sq = 0.0f;
    if (vec && n / 4 <= kNormHeld * static_cast<int>(blockDim.x)) {
        // The row held in registers: x, y and w all asked for at once, then the sums, so the norm's
        // second pass neither reads x_out back nor waits for w (one memory round trip, not two). The
        // same operations in the same order as the loop below, so the same bits.
        const float4* x4 = reinterpret_cast<const float4*>(x + off);
        const float4* y4 = reinterpret_cast<const float4*>(y + off);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        float4 a[kNormHeld], b[kNormHeld], g[kNormHeld];
#pragma unroll
        for (int k = 0; k < kNormHeld; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < n / 4) a[k] = x4[i], b[k] = y4[i], g[k] = w4[i];
        }
        float4* s4 = reinterpret_cast<float4*>(x_out + off);
#pragma unroll
        for (int k = 0; k < kNormHeld; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < n / 4) {
                a[k] = make_float4(a[k].x + b[k].x, a[k].y + b[k].y, a[k].z + b[k].z, a[k].w + b[k].w);
                s4[i] = a[k];
                sum_sq += sum_sq4(a[k]);
            }
        }
        const float scale = rms_scale(block_sum(sum_sq), n, eps);
        float4* o4 = reinterpret_cast<float4*>(out + off);
#pragma unroll
        for (int k = 0; k < kNormHeld; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < n / 4)
                o4[i] = make_float4(rms_apply(a[k].x, scale, g[k].x), rms_apply(a[k].y, scale, g[k].y),
                                    rms_apply(a[k].z, scale, g[k].z), rms_apply(a[k].w, scale, g[k].w));
        }
        return;
    }
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(x + off);
        const float4* y4 = reinterpret_cast<const float4*>(y + off);
        float4* s4 = reinterpret_cast<float4*>(x_out + off);
        for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
            const float4 a = x4[i], b = y4[i];
            const float4 v = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
            s4[i] = v;
            sum_sq += sum_sq4(v);
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float v = x[off + i] + y[off + i];
            x_out[off + i] = v;
            sum_sq += v * v;
        }
    }
    // Each thread reads back only the x_out elements it wrote itself.
    rms_apply_row(x_out + off, w, out + off, n, rms_scale(block_sum(sum_sq), n, eps), vec);
}

// ---- QK-norm + RoPE + K/V append -----------------------------------------------------------------

namespace {

// Pair j of a head (dst[j], dst[j + half]) = (lo, hi), as f32 (q) or f16 (k).
template <typename Out>
__device__ __forceinline__ void store_pair(Out* dst, int j, int half, float lo, float hi) {
    if constexpr (sizeof(Out) == 2) {
        dst[j] = __float2half_rn(lo);
        dst[j + half] = __float2half_rn(hi);
    } else {
        dst[j] = lo;
        dst[j + half] = hi;
    }
}

// One head of Dh = 2 * half values at src: RMSNorm with w, then the rotation by the block's
// (cos, sin) table; the results go to dst as f32 (q) or f16 (k). One warp.
template <typename Out>
__device__ __forceinline__ void norm_rope_head(const float* src, const float* __restrict__ w, Out* dst, int half,
                                               float eps, const float* cos_s, const float* sin_s) {
    const int lane = threadIdx.x & 31;
    float sum_sq = 0.0f;
    for (int j = lane; j < half; j += 32) {
        const float a = src[j], b = src[j + half];
        sum_sq += a * a + b * b;
    }
    const float scale = rms_scale(warp_sum(sum_sq), 2 * half, eps);
    for (int j = lane; j < half; j += 32) {
        const float a = rms_apply(src[j], scale, w[j]), b = rms_apply(src[j + half], scale, w[j + half]);
        float lo, hi;
        rope_rotate(a, b, cos_s[j], sin_s[j], lo, hi);
        store_pair(dst, j, half, lo, hi);
    }
}

constexpr int kHeldPairs = 4;   // RoPE pairs a lane holds of its warp's first head (Dh <= 256)

// A head's pairs (j, j + half) for j = lane + 32 k, k < kHeldPairs, with their norm weights, asked for
// at once; and their sum of squares in norm_rope_head's order.
struct HeldHead {
    float a[kHeldPairs], b[kHeldPairs], wa[kHeldPairs], wb[kHeldPairs];

    __device__ __forceinline__ void load(const float* src, const float* __restrict__ w, int half, int lane) {
#pragma unroll
        for (int k = 0; k < kHeldPairs; ++k) {
            const int j = lane + 32 * k;
            if (j < half) a[k] = src[j], b[k] = src[j + half], wa[k] = w[j], wb[k] = w[j + half];
        }
    }

    __device__ __forceinline__ float sum_sq(int half, int lane) const {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < kHeldPairs; ++k)
            if (lane + 32 * k < half) s += a[k] * a[k] + b[k] * b[k];
        return s;
    }

    // norm_rope_head's second pass on the held values
    template <typename Out>
    __device__ __forceinline__ void store(Out* dst, int half, int lane, float scale, const float* cos_s,
                                          const float* sin_s) const {
#pragma unroll
        for (int k = 0; k < kHeldPairs; ++k) {
            const int j = lane + 32 * k;
            if (j >= half) continue;
            float lo, hi;
            rope_rotate(rms_apply(a[k], scale, wa[k]), rms_apply(b[k], scale, wb[k]), cos_s[j], sin_s[j], lo, hi);
            store_pair(dst, j, half, lo, hi);
        }
    }
};

}  // namespace

extern "C" __global__ void __launch_bounds__(kWarps * 32)
    strata_qk_norm_rope_kv_f32(const float* q, const float* __restrict__ k, const float* __restrict__ v,
                               const float* __restrict__ q_w, const float* __restrict__ k_w,
                               const int* __restrict__ positions, const int* __restrict__ cells,
                               const float* __restrict__ inv_freq, float* q_out,
                               __half* __restrict__ k_cache, __half* __restrict__ v_cache, int T, int H, int Hk,
                               int head_dim, float eps, float scale) {
    STRATA_PDL_ENTRY();
    __shared__ float cos_s[kMaxPairs], sin_s[kMaxPairs];
    const int t = blockIdx.x;
    if (t >= T) return;
    const int half = head_dim / 2;
    const int64_t kv_row = static_cast<int64_t>(Hk) * head_dim;
    const int num_heads = H + 2 * Hk;
    const int g0 = blockIdx.y * kWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    // The warp's first q or k head and its norm weights are asked for before the position and the RoPE
    // table, and summed while the table is made: their loads overlap the table's instead of following it.
    HeldHead held;
    const bool hold = half <= 32 * kHeldPairs && g0 < H + Hk;
    float held_sum = 0.0f;
    if (hold) {
        const float* src = g0 < H ? q + (static_cast<int64_t>(t) * H + g0) * head_dim
                                  : k + t * kv_row + (g0 - H) * head_dim;
        held.load(src, g0 < H ? q_w : k_w, half, lane);
        held_sum = held.sum_sq(half, lane);
    }
    const int p = positions[t];
    const int64_t c = cells ? cells[t] : p;
    rope_table(cos_s, sin_s, static_cast<float>(p), inv_freq, half, scale);
    if (hold) {
        const float s = rms_scale(warp_sum(held_sum), head_dim, eps);
        if (g0 < H)
            held.store(q_out + (static_cast<int64_t>(t) * H + g0) * head_dim, half, lane, s, cos_s, sin_s);
        else
            held.store(k_cache + c * kv_row + (g0 - H) * head_dim, half, lane, s, cos_s, sin_s);
    }
    for (int g = g0 + (hold ? gridDim.y * kWarps : 0); g < num_heads; g += gridDim.y * kWarps) {
        if (g < H) {
            const int64_t off = (static_cast<int64_t>(t) * H + g) * head_dim;
            norm_rope_head(q + off, q_w, q_out + off, half, eps, cos_s, sin_s);
        } else if (g < H + Hk) {
            const int h = g - H;
            norm_rope_head(k + t * kv_row + h * head_dim, k_w, k_cache + c * kv_row + h * head_dim, half, eps,
                           cos_s, sin_s);
        } else {
            const int h = g - H - Hk;
            const float* src = v + t * kv_row + h * head_dim;
            __half* dst = v_cache + c * kv_row + h * head_dim;
            for (int i = threadIdx.x & 31; i < head_dim; i += 32) dst[i] = __float2half_rn(src[i]);
        }
    }
}

// ---- QK-norm + RoPE + quantized K/V append --------------------------------------------------------

namespace {

constexpr int kQuantMaxPairs = 128;  // Dh <= 256

// One q or k head of DH = 32 * PER values at src (16-byte aligned) and its norm weights, asked for at once
// (qk_norm_rope_kv_quant asks for the warp's first head before the position and the RoPE table); then
// RMSNorm's 1 / rms summed exactly as strata_rms_norm_f32 sums a row of DH on its 16-byte path with 256
// threads: thread i takes the float4 i, each warp sums its threads' (warp_sum), then warp 0 sums the
// warps' sums; the warps past the first two hold zeros, which add exactly, so that pass is w0 (+ w1 at
// Dh 256).
template <int PER>
struct QuantHead {
    static constexpr int N4 = 8 * PER, HALF = 16 * PER;
    float4 s0, s1;       // the float4s lane and 32 + lane, for the sum
    HeldHead pairs;      // the RoPE pairs (j, j + HALF), j = lane + 32 k, and their weights

    __device__ __forceinline__ void load(const float* src, const float* __restrict__ w, int lane) {
        const float4* x4 = reinterpret_cast<const float4*>(src);
        if (lane < N4) s0 = x4[lane];
        if constexpr (N4 > 32) s1 = x4[32 + lane];
        pairs.load(src, w, HALF, lane);
    }

    __device__ __forceinline__ float rms(int lane, float eps) const {
        float w0 = 0.0f;
        if (lane < N4) w0 += sum_sq4(s0);
        w0 = warp_sum(w0);
        if constexpr (N4 > 32) {
            float w1 = 0.0f;
            w1 += sum_sq4(s1);
            w0 = w0 + warp_sum(w1);
        }
        return rms_scale(w0, 32 * PER, eps);
    }

    // RMSNorm, NEOX RoPE with the block's table (rope_rotate, as strata_rope_f32), then the lane's PER
    // consecutive values into v (through the warp's buf of DH floats). One warp.
    __device__ __forceinline__ void norm_rope(float eps, const float* cos_s, const float* sin_s, float* buf,
                                              int lane, float (&v)[PER]) const {
        pairs.store(buf, HALF, lane, rms(lane, eps), cos_s, sin_s);
        __syncwarp();
        strata_kv::load_row<PER>(buf + lane * PER, v);
        __syncwarp();                               // buf is the warp's next head's
    }
};

template <bool KQ4, bool VQ4, int PER>
__device__ __forceinline__ void qk_norm_rope_kv_quant(const float* q, const float* __restrict__ k,
                                                      const float* __restrict__ v, const float* __restrict__ q_w,
                                                      const float* __restrict__ k_w, const int* __restrict__ positions,
                                                      const int* __restrict__ cells,
                                                      const float* __restrict__ inv_freq, float* q_out,
                                                      void* k_values, __half* k_scales, void* v_values,
                                                      __half* v_scales, int H, int Hk, float eps, float scale,
                                                      float rot_scale) {
    constexpr int DH = 32 * PER;
    __shared__ float cos_s[kQuantMaxPairs], sin_s[kQuantMaxPairs];
    __shared__ float buf_s[kWarps][DH];
    const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int num_heads = H + 2 * Hk, g0 = blockIdx.y * kWarps + warp;
    auto head = [&](int g) {                        // head g < H + Hk's values and norm weights
        return g < H ? q + (static_cast<int64_t>(t) * H + g) * DH : k + (static_cast<int64_t>(t) * Hk + g - H) * DH;
    };
    // The warp's first q or k head is asked for before the position and the RoPE table, so its loads
    // overlap the table's (as strata_qk_norm_rope_kv_f32's); the sums wait for the table.
    QuantHead<PER> held;
    if (g0 < H + Hk) held.load(head(g0), g0 < H ? q_w : k_w, lane);
    const int p = positions[t];
    const int64_t c = cells ? cells[t] : p;
    rope_table(cos_s, sin_s, static_cast<float>(p), inv_freq, DH / 2, scale);
    float* buf = buf_s[warp];
    for (int g = g0; g < num_heads; g += gridDim.y * kWarps) {
        float x[PER];
        if (g < H) {
            if (g != g0) held.load(head(g), q_w, lane);
            held.norm_rope(eps, cos_s, sin_s, buf, lane, x);
            if constexpr (KQ4) strata_kv::hadamard_warp<PER>(x, lane, rot_scale);   // q . k = Hq . Hk
            const int64_t off = (static_cast<int64_t>(t) * H + g) * DH;
#pragma unroll
            for (int i = 0; i < PER; ++i) q_out[off + lane * PER + i] = x[i];
        } else if (g < H + Hk) {
            if (g != g0) held.load(head(g), k_w, lane);
            held.norm_rope(eps, cos_s, sin_s, buf, lane, x);
            strata_kv::append_head<KQ4, PER>(x, lane, c * Hk + g - H, k_values, k_scales, rot_scale);
        } else {
            const int h = g - H - Hk;
            strata_kv::load_row<PER>(v + (static_cast<int64_t>(t) * Hk + h) * DH + lane * PER, x);
            strata_kv::append_head<VQ4, PER>(x, lane, c * Hk + h, v_values, v_scales, rot_scale);
        }
    }
}

}  // namespace

#define STRATA_QK_NORM_ROPE_KV_Q(FMT, KQ4, VQ4)                                                                  \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_qk_norm_rope_kv_##FMT(                     \
        const float* q, const float* __restrict__ k, const float* __restrict__ v, const float* __restrict__ q_w, \
        const float* __restrict__ k_w, const int* __restrict__ positions, const int* __restrict__ cells,        \
        const float* __restrict__ inv_freq, float* q_out, void* k_values, __half* k_scales, void* v_values,     \
        __half* v_scales, int T, int H, int Hk, int head_dim, float eps, float scale, float rot_scale) {         \
        STRATA_PDL_ENTRY();                                                                                     \
        if (blockIdx.x >= T) return;                                                                            \
        if (head_dim == 64)                                                                                     \
            qk_norm_rope_kv_quant<KQ4, VQ4, 2>(q, k, v, q_w, k_w, positions, cells, inv_freq, q_out, k_values,  \
                                               k_scales, v_values, v_scales, H, Hk, eps, scale, rot_scale);     \
        else if (head_dim == 128)                                                                               \
            qk_norm_rope_kv_quant<KQ4, VQ4, 4>(q, k, v, q_w, k_w, positions, cells, inv_freq, q_out, k_values,  \
                                               k_scales, v_values, v_scales, H, Hk, eps, scale, rot_scale);     \
        else if (head_dim == 256)                                                                               \
            qk_norm_rope_kv_quant<KQ4, VQ4, 8>(q, k, v, q_w, k_w, positions, cells, inv_freq, q_out, k_values,  \
                                               k_scales, v_values, v_scales, H, Hk, eps, scale, rot_scale);     \
    }
STRATA_QK_NORM_ROPE_KV_Q(int8, false, false)
STRATA_QK_NORM_ROPE_KV_Q(q4_0, true, true)
STRATA_QK_NORM_ROPE_KV_Q(k8v4, false, true)
#undef STRATA_QK_NORM_ROPE_KV_Q

// ---- three GEMVs over one input ------------------------------------------------------------------

namespace {

// The three matrices; a warp-uniform index picks one (selects, not a local-memory array).
struct Three {
    const uint8_t *W0, *W1, *W2;
    float *y0, *y1, *y2;
    int rows0, rows1, rows2;

    // Row set g of the concatenated sets (sets_i = ceil(rows_i / per_set)) -> matrix and first row.
    __device__ __forceinline__ bool find(long long g, int per_set, const uint8_t*& W, float*& y, int& rows,
                                         int& base) const {
        const long long s0 = (rows0 + per_set - 1) / per_set, s1 = (rows1 + per_set - 1) / per_set;
        const long long s2 = (rows2 + per_set - 1) / per_set;
        if (g < s0) {
            W = W0, y = y0, rows = rows0, base = static_cast<int>(g * per_set);
        } else if (g < s0 + s1) {
            W = W1, y = y1, rows = rows1, base = static_cast<int>((g - s0) * per_set);
        } else if (g < s0 + s1 + s2) {
            W = W2, y = y2, rows = rows2, base = static_cast<int>((g - s0 - s1) * per_set);
        } else {
            return false;
        }
        return true;
    }
};

// gemv3_body / gemv3_rows_body with x staged (gemv_rows.cuh's staged_rounds): the same row sets of the
// three matrices, warp w of the block taking set blockIdx.x * kWarps + w, then that plus the grid's warps.
template <class U, int B, bool kOnce = false>
__device__ __forceinline__ void staged_three(const Three& m, const float* __restrict__ x, int n, const float* table,
                                             int batch) {
    const int per_set = (32 / lanes_per_row(n / U::kBlockWeights * U::kUnits)) * U::kRows;
    const long long warp = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    const long long num_warps = static_cast<long long>(gridDim.x) * kWarps;
    constexpr int R = U::kRows;
    const UnitLanes<U> L(n);
    const uint8_t* W = nullptr;
    float* y = nullptr;
    int rows = 0, base = 0, row0 = 0;
    auto find = [&](int round, const uint8_t* (&row_ptr)[R]) {
        const bool valid = m.find(warp + static_cast<long long>(round) * num_warps, per_set, W, y, rows, base);
        row0 = base + L.sub * R;
#pragma unroll
        for (int r = 0; r < R; ++r)
            row_ptr[r] = valid ? W + static_cast<long long>(min(row0 + r, rows - 1)) * L.row_bytes : m.W0;
        return valid;
    };
    auto emit = [&](bool valid, const float (&acc)[B][R]) {
        if (valid) store_rows<U, B>(acc, L, y, rows, row0, batch);
    };
    staged_rounds<kWarps, U, B, kOnce>(x, n, batch, table, find, emit, L.sl, L.lanes);
}

template <class U>
__device__ __forceinline__ void gemv3_body(const Three& m, const float* __restrict__ x, int n, const float* table) {
    if constexpr (Stageable<U>::value) {
        staged_three<U, 1>(m, x, n, table, 1);
    } else {
        const int per_set = (32 / lanes_per_row(n / U::kBlockWeights * U::kUnits)) * U::kRows;
        const long long warp = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
        const long long num_warps = static_cast<long long>(gridDim.x) * kWarps;
        const uint8_t* W;
        float* y;
        int rows, base;
        for (long long g = warp; m.find(g, per_set, W, y, rows, base); g += num_warps) {
            // Built per set, as before the row body moved to gemv_rows.cuh: hoisted, ptxas allocated
            // 158 registers instead of 128 for Q2_K.
            const UnitLanes<U> L(n);
            gemv_rows<U>(W, x, y, rows, base + L.sub * U::kRows, L, table);
        }
    }
}

template <class U>
__device__ __forceinline__ void gemv3_rows_body(const Three& m, const float* __restrict__ x, int n, const float* table,
                                                int batch) {
    const int per_set = (32 / lanes_per_row(n / U::kBlockWeights * U::kUnits)) * U::kRows;
    const long long warp = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    const long long num_warps = static_cast<long long>(gridDim.x) * kWarps;
    if constexpr (Stageable<U>::value) {
        for_groups(batch, [&](int t0, int g) {
            const Three mg{m.W0, m.W1, m.W2, m.y0 + static_cast<long long>(t0) * m.rows0,
                           m.y1 + static_cast<long long>(t0) * m.rows1, m.y2 + static_cast<long long>(t0) * m.rows2,
                           m.rows0, m.rows1, m.rows2};
            staged_three<U, kRowsGroup>(mg, x + static_cast<long long>(t0) * n, n, table, g);
        });
    } else {
        const uint8_t* W;
        float* y;
        int rows, base;
        for (long long g = warp; m.find(g, per_set, W, y, rows, base); g += num_warps) {
            const UnitLanes<U> L(n);
            gemv_rows_multi<U>(W, x, y, rows, n, base + L.sub * U::kRows, L, table, batch);
        }
    }
}

template <class B>
__device__ __forceinline__ void gemv3_batch_body(const Three& m, const float* __restrict__ x, int n, int batch) {
    const long long warp = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    const long long num_warps = static_cast<long long>(gridDim.x) * kWarps;
    const uint8_t* W;
    float* y;
    int rows, base;
    for (long long g = warp; m.find(g, kBatchRows, W, y, rows, base); g += num_warps)
        gemv_batch_rows<B>(W, x, y, rows, n, batch, base, ChunkLanes<B>(n));
}

}  // namespace

#define STRATA_GEMV3_ARGS                                                                              \
    const uint8_t *W0, const uint8_t *W1, const uint8_t *W2, const float *x, float *y0, float *y1, float *y2, \
        int rows0, int rows1, int rows2, int n, int batch
#define STRATA_GEMV3_THREE Three{W0, W1, W2, y0, y1, y2, rows0, rows1, rows2}

#define STRATA_GEMV3(name, Unit, Block)                                                                \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_gemv3_##name(STRATA_GEMV3_ARGS) { \
        STRATA_PDL_ENTRY();                                                                            \
        if (batch == 1)                                                                                \
            gemv3_body<Unit>(STRATA_GEMV3_THREE, x, n, nullptr);                                       \
        else                                                                                           \
            gemv3_batch_body<Block>(STRATA_GEMV3_THREE, x, n, batch);                                  \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_gemv3_rows_##name(STRATA_GEMV3_ARGS) { \
        STRATA_PDL_ENTRY();                                                                            \
        gemv3_rows_body<Unit>(STRATA_GEMV3_THREE, x, n, nullptr, batch);                               \
    }

STRATA_GEMV3(q4_0, UnitQ4_0, BlockQ4_0)
STRATA_GEMV3(q4_1, UnitQ4_1, BlockQ4_1)
STRATA_GEMV3(q5_0, UnitQ5_0, BlockQ5_0)
STRATA_GEMV3(q5_1, UnitQ5_1, BlockQ5_1)
STRATA_GEMV3(q8_0, UnitQ8_0, BlockQ8_0)
STRATA_GEMV3(q2_k, UnitQ2_K, BlockQ2_K)
STRATA_GEMV3(q3_k, UnitQ3_K, BlockQ3_K)
STRATA_GEMV3(q4_k, UnitQ4_K, BlockQ4_K)
STRATA_GEMV3(q5_k, UnitQ5_K, BlockQ5_K)
STRATA_GEMV3(q6_k, UnitQ6_K, BlockQ6_K)

// IQ4 types: the 16-value codebook in shared memory; every thread reaches the barrier.
#define STRATA_GEMV3_IQ4(name, Unit, Block)                                                            \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_gemv3_##name(STRATA_GEMV3_ARGS) { \
        STRATA_PDL_ENTRY();                                                                            \
        __shared__ float table[16];                                                                    \
        fill_iq4_table(table);                                                                         \
        if (batch == 1)                                                                                \
            gemv3_body<Unit>(STRATA_GEMV3_THREE, x, n, table);                                         \
        else                                                                                           \
            gemv3_batch_body<Block>(STRATA_GEMV3_THREE, x, n, batch);                                  \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_gemv3_rows_##name(STRATA_GEMV3_ARGS) { \
        STRATA_PDL_ENTRY();                                                                            \
        __shared__ float table[16];                                                                    \
        fill_iq4_table(table);                                                                         \
        gemv3_rows_body<Unit>(STRATA_GEMV3_THREE, x, n, table, batch);                                 \
    }

STRATA_GEMV3_IQ4(iq4_nl, UnitIQ4_NL, BlockIQ4_NL)
STRATA_GEMV3_IQ4(iq4_xs, UnitIQ4_XS, BlockIQ4_XS)

// One token, one row a warp (gemv_rows.cuh's OneRow), the staged types only; x staged once a block for
// all its rounds, so the host caps the grid (the kernel path one-row-gemv).
#define STRATA_GEMV3_ONE(name, Unit)                                                                   \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_gemv3_one_##name(STRATA_GEMV3_ARGS) { \
        STRATA_PDL_ENTRY();                                                                            \
        staged_three<OneRow<Unit>, 1, true>(STRATA_GEMV3_THREE, x, n, nullptr, 1);                     \
    }

STRATA_GEMV3_ONE(q4_0, UnitQ4_0)
STRATA_GEMV3_ONE(q4_1, UnitQ4_1)
STRATA_GEMV3_ONE(q5_0, UnitQ5_0)
STRATA_GEMV3_ONE(q5_1, UnitQ5_1)
STRATA_GEMV3_ONE(q8_0, UnitQ8_0)

extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_gemv3_one_iq4_nl(STRATA_GEMV3_ARGS) {
    STRATA_PDL_ENTRY();
    __shared__ float table[16];
    fill_iq4_table(table);
    staged_three<OneRow<UnitIQ4_NL>, 1, true>(STRATA_GEMV3_THREE, x, n, table, 1);
}

// Float types, one token: 8 weights per unit when n % 8 == 0, else one (as strata_gemv_<type>).
#define STRATA_GEMV3_FLOAT(name, Block, Elem)                                                          \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_gemv3_##name(STRATA_GEMV3_ARGS) { \
        STRATA_PDL_ENTRY();                                                                            \
        if (batch > 1)                                                                                 \
            gemv3_batch_body<Block>(STRATA_GEMV3_THREE, x, n, batch);                                  \
        else if (n % 8 == 0)                                                                           \
            gemv3_body<UnitFloat8<Block>>(STRATA_GEMV3_THREE, x, n, nullptr);                          \
        else                                                                                           \
            gemv3_body<UnitFloat1<Elem>>(STRATA_GEMV3_THREE, x, n, nullptr);                           \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_gemv3_rows_##name(STRATA_GEMV3_ARGS) { \
        STRATA_PDL_ENTRY();                                                                            \
        if (n % 8 == 0)                                                                                \
            gemv3_rows_body<UnitFloat8<Block>>(STRATA_GEMV3_THREE, x, n, nullptr, batch);              \
        else                                                                                           \
            gemv3_rows_body<UnitFloat1<Elem>>(STRATA_GEMV3_THREE, x, n, nullptr, batch);               \
    }

STRATA_GEMV3_FLOAT(f32, BlockF32x8, ElemF32)
STRATA_GEMV3_FLOAT(f16, BlockF16x8, ElemF16)
STRATA_GEMV3_FLOAT(bf16, BlockBF16x8, ElemBF16)
