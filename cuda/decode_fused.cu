// Fused kernels for the non-MoE work of a decoder layer: fewer launches per decode step (a CUDA
// graph's time is bounded by its node count long before the GEMVs' weight reads).
//
// strata_add_rms_norm_f32(x, y, x_out, w, out, rows, n, eps)
//   x_out[r, i] = x[r, i] + y[r, i]
//   out[r, i]   = x_out[r, i] * rsqrt(mean_i(x_out[r, :]^2) + eps) * w[i]
//   A residual add and the RMSNorm after it (strata_add_f32 + strata_rms_norm_f32 in one launch,
//   with the same thread mapping and reduction, so the results are bit-identical to that pair).
//   Layout: x, y, x_out, out [rows, n] row-major f32, w [n] f32. x_out may alias x or y, and out
//   may alias any of them: every element is read and written by one thread, the norm's reads of a
//   row finish (block barrier) before the first write of out.
//   Launch: grid = (rows, 1, 1), block = (256, 1, 1) (any multiple of 32 up to 1024).
//
// strata_qk_norm_rope_kv_f32(q, k, v, q_w, k_w, positions, inv_freq, q_out, k_cache, v_cache,
//                            T, H, Hk, head_dim, eps, scale)
//   For token t at position p = positions[t], every head of q [T, H, Dh] and k [T, Hk, Dh]:
//     RMSNorm over the head's Dh values with q_w / k_w [Dh], then NEOX RoPE as cuda/rope.cu (the
//     angle f32(p) * inv_freq[i] in f32, accurate sincosf, cos and sin times `scale`, products and
//     sums rounded separately); q -> q_out [T, H, Dh] f32; k -> k_cache row p as f16; v [T, Hk, Dh]
//     -> v_cache row p as f16 (round to nearest even, as strata_kv_append_f16). A row of the
//     caches holds Hk * Dh halves. Replaces 2 rms_norm + 2 copies + 2 rope + kv_append.
//   q_out may alias q. positions [T] int32 in device memory (a CUDA graph replays one launch).
//   Dh even, Dh / 2 <= kMaxPairs.
//   Launch: grid = (T, any, 1), block = (128, 1, 1); warp w of block (t, b) takes heads
//   b * 4 + w, then strides by gridDim.y * 4 over the H + 2 * Hk heads (q heads, k heads, v heads),
//   so any grid.y is complete; ceil((H + 2 * Hk) / 4) gives one head per warp. A warp holds one
//   head: lane j owns the RoPE pairs (j, j + Dh/2), (j + 32, ...), reduces the sum of squares with
//   shuffles, then normalizes and rotates its pairs in registers. The block computes its token's
//   Dh/2 (cos, sin) once into shared memory.
//
// strata_gemv3_<qtype>(W0, W1, W2, x, y0, y1, y2, rows0, rows1, rows2, n, batch)
//   y_i[b, r] = sum_k W_i[r, k] * x[b, k] for the three matrices W_i [rows_i, n] (one quant type,
//   one n) and b < batch <= 8: the q, k and v projections in one launch. batch == 1 runs
//   cuda/gemv.cu's single-token row body (strata_gemv_<qtype>), batch > 1 its batched body
//   (strata_gemv_batch_<qtype>, n % 8 == 0); each row's arithmetic is that kernel's, so the
//   outputs equal the three separate launches. Layout and alignment as cuda/gemv.cu.
//   Launch: block = (128, 1, 1), any grid: warps stride over the row sets of the concatenated
//   rows (a row set = gemv.cu's rows per warp, of one matrix); one set per warp is
//   ceil(sum_i ceil(rows_i / rows_per_warp) / 4) blocks, rows_per_warp = 4 for batch > 1.

#include <cuda_fp16.h>

#include <cstdint>

#include "gemv_units.cuh"
#include "gemv_units_k.cuh"
#include "quant_blocks.cuh"

namespace {

using namespace strata_q;

constexpr int kMaxWarps = 32;
constexpr int kMaxPairs = 512;  // Dh up to 1024
constexpr int kWarps = 4;       // GEMV and QK-norm blocks: 128 threads
constexpr int kMaxBatch = 8;
constexpr int kBatchRows = 4;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Sum of `v` over the block; every thread gets the result (cuda/rms_norm.cu's reduction).
__device__ float block_sum(float v) {
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

}  // namespace

// ---- residual add + RMSNorm ----------------------------------------------------------------------

extern "C" __global__ void strata_add_rms_norm_f32(const float* x, const float* y, float* x_out,
                                                   const float* __restrict__ w, float* out, int rows, int n,
                                                   float eps) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const int64_t off = static_cast<int64_t>(row) * n;
    const bool vec = (n % 4 == 0) &&
                     ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y) |
                       reinterpret_cast<uintptr_t>(x_out) | reinterpret_cast<uintptr_t>(w) |
                       reinterpret_cast<uintptr_t>(out)) % 16 == 0);
    float sum_sq = 0.0f;
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(x + off);
        const float4* y4 = reinterpret_cast<const float4*>(y + off);
        float4* s4 = reinterpret_cast<float4*>(x_out + off);
        for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
            const float4 a = x4[i], b = y4[i];
            const float4 v = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
            s4[i] = v;
            sum_sq += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float v = x[off + i] + y[off + i];
            x_out[off + i] = v;
            sum_sq += v * v;
        }
    }
    const float scale = rsqrtf(block_sum(sum_sq) / static_cast<float>(n) + eps);
    // Each thread reads back only the x_out elements it wrote itself.
    if (vec) {
        const float4* s4 = reinterpret_cast<const float4*>(x_out + off);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        float4* o4 = reinterpret_cast<float4*>(out + off);
        for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
            const float4 v = s4[i], g = w4[i];
            o4[i] = make_float4(v.x * scale * g.x, v.y * scale * g.y, v.z * scale * g.z, v.w * scale * g.w);
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) out[off + i] = x_out[off + i] * scale * w[i];
    }
}

// ---- QK-norm + RoPE + K/V append -----------------------------------------------------------------

namespace {

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
    const float scale = rsqrtf(warp_sum(sum_sq) / static_cast<float>(2 * half) + eps);
    for (int j = lane; j < half; j += 32) {
        const float a = src[j] * scale * w[j], b = src[j + half] * scale * w[j + half];
        const float c = cos_s[j], s = sin_s[j];
        const float lo = __fadd_rn(__fmul_rn(a, c), -__fmul_rn(b, s));
        const float hi = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
        if constexpr (sizeof(Out) == 2) {
            dst[j] = __float2half_rn(lo);
            dst[j + half] = __float2half_rn(hi);
        } else {
            dst[j] = lo;
            dst[j + half] = hi;
        }
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kWarps * 32)
    strata_qk_norm_rope_kv_f32(const float* q, const float* __restrict__ k, const float* __restrict__ v,
                               const float* __restrict__ q_w, const float* __restrict__ k_w,
                               const int* __restrict__ positions, const float* __restrict__ inv_freq, float* q_out,
                               __half* __restrict__ k_cache, __half* __restrict__ v_cache, int T, int H, int Hk,
                               int head_dim, float eps, float scale) {
    __shared__ float cos_s[kMaxPairs], sin_s[kMaxPairs];
    const int t = blockIdx.x;
    if (t >= T) return;
    const int half = head_dim / 2;
    const int p = positions[t];
    const float pos = static_cast<float>(p);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(__fmul_rn(pos, inv_freq[i]), &s, &c);
        cos_s[i] = __fmul_rn(c, scale);
        sin_s[i] = __fmul_rn(s, scale);
    }
    __syncthreads();
    const int64_t kv_row = static_cast<int64_t>(Hk) * head_dim;
    const int num_heads = H + 2 * Hk;
    for (int g = blockIdx.y * kWarps + (threadIdx.x >> 5); g < num_heads; g += gridDim.y * kWarps) {
        if (g < H) {
            const int64_t off = (static_cast<int64_t>(t) * H + g) * head_dim;
            norm_rope_head(q + off, q_w, q_out + off, half, eps, cos_s, sin_s);
        } else if (g < H + Hk) {
            const int h = g - H;
            norm_rope_head(k + t * kv_row + h * head_dim, k_w, k_cache + p * kv_row + h * head_dim, half, eps,
                           cos_s, sin_s);
        } else {
            const int h = g - H - Hk;
            const float* src = v + t * kv_row + h * head_dim;
            __half* dst = v_cache + p * kv_row + h * head_dim;
            for (int i = threadIdx.x & 31; i < head_dim; i += 32) dst[i] = __float2half_rn(src[i]);
        }
    }
}

// ---- three GEMVs over one input ------------------------------------------------------------------

namespace {

__device__ __forceinline__ float sum_lanes(float v, int lanes) {  // within aligned groups of `lanes`
    for (int offset = lanes >> 1; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ int lanes_per_row(int units) {
    return units >= 32 ? 32 : 1 << (32 - __clz(max(units, 1) - 1));
}

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

// cuda/gemv.cu's gemv_body for the one row set starting at `base` (rows base .. base + per_set - 1).
template <class U>
__device__ __forceinline__ void gemv_set(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                         float* __restrict__ y, int rows, int n, int base, const float* table) {
    constexpr int R = U::kRows;
    const int num_blocks = n / U::kBlockWeights;
    const int units = num_blocks * U::kUnits;
    const int lanes = lanes_per_row(units);
    const int lane = threadIdx.x & 31, sub = lane / lanes, sl = lane & (lanes - 1);
    const long long row_bytes = static_cast<long long>(num_blocks) * U::kBlockBytes;
    const int row0 = base + sub * R;  // past the end: reads row rows - 1, writes nothing
    const uint8_t* row_ptr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) row_ptr[r] = W + static_cast<long long>(min(row0 + r, rows - 1)) * row_bytes;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    for (int u = sl; u < units; u += lanes) {
        const int b = u / U::kUnits, c = u - b * U::kUnits;
        typename U::Raw raw[R];
#pragma unroll
        for (int r = 0; r < R; ++r) U::load(row_ptr[r] + static_cast<long long>(b) * U::kBlockBytes, c, raw[r]);
        typename U::X xv;
        U::load_x(x + static_cast<long long>(b) * U::kBlockWeights, c, xv);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] += U::dot(raw[r], c, xv, table);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float v = sum_lanes(acc[r], lanes);
        if (sl == 0 && row0 + r < rows) y[row0 + r] = v;
    }
}

template <class U>
__device__ __forceinline__ void gemv3_body(const Three& m, const float* __restrict__ x, int n, const float* table) {
    const int units = n / U::kBlockWeights * U::kUnits;
    const int per_set = (32 / lanes_per_row(units)) * U::kRows;
    const long long warp = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    const long long num_warps = static_cast<long long>(gridDim.x) * kWarps;
    const uint8_t* W;
    float* y;
    int rows, base;
    for (long long g = warp; m.find(g, per_set, W, y, rows, base); g += num_warps)
        gemv_set<U>(W, x, y, rows, n, base, table);
}

// cuda/gemv.cu's gemv_batch_body for the kBatchRows rows from `base`.
template <class B>
__device__ __forceinline__ void gemv_batch_set(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                               float* __restrict__ y, int rows, int n, int batch, int base) {
    constexpr int R = kBatchRows, kChunks = B::kWeights / 8;
    const int chunks = n / 8, lane = threadIdx.x & 31;
    const long long row_bytes = static_cast<long long>(n / B::kWeights) * B::kBytes;
    const int row0 = base;
    const uint8_t* row_ptr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) row_ptr[r] = W + static_cast<long long>(min(row0 + r, rows - 1)) * row_bytes;
    float acc[kMaxBatch][R];
#pragma unroll
    for (int t = 0; t < kMaxBatch; ++t)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[t][r] = 0.f;
    for (int ch = lane; ch < chunks; ch += 32) {
        const int b = ch / kChunks, j = ch - b * kChunks;
        float w[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) B::decode8(row_ptr[r] + static_cast<long long>(b) * B::kBytes, j, w[r]);
#pragma unroll
        for (int t = 0; t < kMaxBatch; ++t) {
            if (t < batch) {
                const float4* xp = reinterpret_cast<const float4*>(x + static_cast<long long>(t) * n + 8LL * ch);
                const float4 x0 = __ldg(xp), x1 = __ldg(xp + 1);
                const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[t][r] = fmaf(xv[i], w[r][i], acc[t][r]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < kMaxBatch; ++t) {
        if (t < batch) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float v = sum_lanes(acc[t][r], 32);
                if (lane == 0 && row0 + r < rows) y[static_cast<long long>(t) * rows + row0 + r] = v;
            }
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
        gemv_batch_set<B>(W, x, y, rows, n, batch, base);
}

}  // namespace

#define STRATA_GEMV3_ARGS                                                                              \
    const uint8_t *W0, const uint8_t *W1, const uint8_t *W2, const float *x, float *y0, float *y1, float *y2, \
        int rows0, int rows1, int rows2, int n, int batch
#define STRATA_GEMV3_THREE Three{W0, W1, W2, y0, y1, y2, rows0, rows1, rows2}

#define STRATA_GEMV3(name, Unit, Block)                                                                \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_gemv3_##name(STRATA_GEMV3_ARGS) { \
        if (batch == 1)                                                                                \
            gemv3_body<Unit>(STRATA_GEMV3_THREE, x, n, nullptr);                                       \
        else                                                                                           \
            gemv3_batch_body<Block>(STRATA_GEMV3_THREE, x, n, batch);                                  \
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
        __shared__ float table[16];                                                                    \
        if (threadIdx.x < 16) table[threadIdx.x] = static_cast<float>(iq4_value(threadIdx.x));         \
        __syncthreads();                                                                               \
        if (batch == 1)                                                                                \
            gemv3_body<Unit>(STRATA_GEMV3_THREE, x, n, table);                                         \
        else                                                                                           \
            gemv3_batch_body<Block>(STRATA_GEMV3_THREE, x, n, batch);                                  \
    }

STRATA_GEMV3_IQ4(iq4_nl, UnitIQ4_NL, BlockIQ4_NL)
STRATA_GEMV3_IQ4(iq4_xs, UnitIQ4_XS, BlockIQ4_XS)

// Float types, one token: 8 weights per unit when n % 8 == 0, else one (as strata_gemv_<type>).
#define STRATA_GEMV3_FLOAT(name, Block, Elem)                                                          \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_gemv3_##name(STRATA_GEMV3_ARGS) { \
        if (batch > 1)                                                                                 \
            gemv3_batch_body<Block>(STRATA_GEMV3_THREE, x, n, batch);                                  \
        else if (n % 8 == 0)                                                                           \
            gemv3_body<UnitFloat8<Block>>(STRATA_GEMV3_THREE, x, n, nullptr);                          \
        else                                                                                           \
            gemv3_body<UnitFloat1<Elem>>(STRATA_GEMV3_THREE, x, n, nullptr);                           \
    }

STRATA_GEMV3_FLOAT(f32, BlockF32x8, ElemF32)
STRATA_GEMV3_FLOAT(f16, BlockF16x8, ElemF16)
STRATA_GEMV3_FLOAT(bf16, BlockBF16x8, ElemBF16)
