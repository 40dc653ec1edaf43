// Quantized KV cells: the append kernels that quantize K/V rows on write, the Hadamard rotation of
// head vectors, and split-K decode attention reading the quantized planes directly. The formats are
// strata/quant/kv.py's (its module doc is the exact rule; these kernels match it bit for bit):
//
//   int8  values int8 [rows, Hk, Dh], scales f16 [rows, Hk, Dh / 64]: d = f16(amax / 127) per 64
//         values, q = clamp(rint(x / d), -127, 127) (0 where d = 0); x ~ q d.
//   q4r   the head vector rotated, y = H x (normalized Walsh-Hadamard, butterflies in a fixed order
//         in f32, then one multiply by rot_scale = f32(1 / sqrt(Dh))); per 32 values m = the y of
//         largest |y| (the first on ties), d = f16(m / -8), q = min(15, floor(y / d + 8.5)) (8 where
//         d = 0); values uint8 [rows, Hk, Dh / 2], value 2i in the low nibble of byte i; scales f16
//         [rows, Hk, Dh / 32]; y ~ (q - 8) d.
//
// A rotated K is read with a rotated query (q . k = Hq . Hk): strata_hadamard_f32 rotates q first. A
// rotated V leaves the weighted sum rotated: strata_hadamard_f32 un-rotates the combined output (H is
// its own inverse). Dequantized values q d are exact in f32 (at most 7 + 11 significant bits), so the
// decode's only rounding is its f32 arithmetic, as the f16 kernel's.
//
// Entry points (Dh in {64, 128, 256}):
//   strata_kv_append_int8(x, cells, values, scales, T, Hk, Dh)             grid (T, Hk), block 32
//   strata_kv_append_q4r(x, cells, values, scales, T, Hk, Dh, rot_scale)    grid (T, Hk), block 32
//   strata_hadamard_f32(x, rows, Dh, rot_scale)                            grid (rows), block 32; in place
//   strata_kv_dequant_int8_f16(values, scales, out, rows, Hk, Dh)          grid (rows, Hk), block 32
//   strata_kv_dequant_q4r_f16(values, scales, out, rows, Hk, Dh)           grid (rows, Hk), block 32
//     cells 0..rows-1 as f16 [rows, Hk, Dh] (q4r: still rotated), for the f16 prompt attention
//   strata_attention_decode_<fmt>_d<Dh>_g<GP>(q, k_values, k_scales, v_values, v_scales, lengths,
//       bases, part_acc, part_ml, H, Hk, max_cells, num_splits, scale)     grid (splits, Hk, B), block 128
//     row b reads cells 0..lengths[b]-1 of its sequence, from cell bases[b] (b * max_cells if null)
//     fmt: int8 (int8 K and V), q4_0 (q4r K and V), k8v4 (int8 K, q4r V); GP = G = H / Hk rounded up
//     to 1, 2, 4, 8, 16 (Dh 256: <= 8). The partials are attention.cu's (its combine reads them):
//     part_acc [B, H, splits, Dh], part_ml [B, H, splits, 2] (running max in the log2 domain, sum).
//
// One warp owns a head vector: lane l holds dims [l * Dh/32, (l + 1) * Dh/32). The decode's four
// warps take cells round-robin within the block's split; each cell's G scores are warp all-reduces,
// then an online softmax per head; the warps merge in shared memory. Correct first: no cp.async
// staging or cell batching yet (docs/DESIGN.md, KV formats).

#include <cuda_fp16.h>

#include <cstdint>
#include "pdl.cuh"

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kWarps = 4;

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
            const float other = __shfl_xor_sync(kFull, v[i], o);
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

template <int PER>
__device__ __forceinline__ void append_int8(const float* x, const int* cells, int8_t* values, __half* scales,
                                            int Hk) {
    constexpr int DH = 32 * PER, LANES = 64 / PER;              // lanes per 64-value block
    const int t = blockIdx.x, kvh = blockIdx.y, lane = threadIdx.x;
    float v[PER];
    load_row<PER>(x + (static_cast<int64_t>(t) * Hk + kvh) * DH + lane * PER, v);
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = 1; o < LANES; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
    const __half d = __float2half_rn(amax / 127.0f);
    const float df = __half2float(d);
    const int64_t row = static_cast<int64_t>(cells[t]) * Hk + kvh;
    int8_t* out = values + row * DH + lane * PER;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int q = df > 0.0f ? __float2int_rn(v[i] / df) : 0;
        out[i] = static_cast<int8_t>(max(-127, min(127, q)));
    }
    if (lane % LANES == 0) scales[row * (DH / 64) + lane / LANES] = d;
}

template <int PER>
__device__ __forceinline__ void append_q4r(const float* x, const int* cells, uint8_t* values, __half* scales, int Hk,
                                           float rot_scale) {
    constexpr int DH = 32 * PER, LANES = 32 / PER;              // lanes per 32-value block
    const int t = blockIdx.x, kvh = blockIdx.y, lane = threadIdx.x;
    float v[PER];
    load_row<PER>(x + (static_cast<int64_t>(t) * Hk + kvh) * DH + lane * PER, v);
    hadamard_warp<PER>(v, lane, rot_scale);
    // the value of largest magnitude, the first (lowest index) on ties
    float best = v[0];
    int best_i = lane * PER;
#pragma unroll
    for (int i = 1; i < PER; ++i)
        if (fabsf(v[i]) > fabsf(best)) best = v[i], best_i = lane * PER + i;
#pragma unroll
    for (int o = 1; o < LANES; o <<= 1) {
        const float ob = __shfl_xor_sync(kFull, best, o);
        const int oi = __shfl_xor_sync(kFull, best_i, o);
        if (fabsf(ob) > fabsf(best) || (fabsf(ob) == fabsf(best) && oi < best_i)) best = ob, best_i = oi;
    }
    const __half d = __float2half_rn(best / -8.0f);
    const float df = __half2float(d);
    int q[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) q[i] = df != 0.0f ? min(15, static_cast<int>(floorf(v[i] / df + 8.5f))) : 8;
    const int64_t row = static_cast<int64_t>(cells[t]) * Hk + kvh;
    uint8_t* out = values + row * (DH / 2) + lane * (PER / 2);
#pragma unroll
    for (int i = 0; i < PER / 2; ++i) out[i] = static_cast<uint8_t>(q[2 * i] | (q[2 * i + 1] << 4));
    if (lane % LANES == 0) scales[row * (DH / 32) + lane / LANES] = d;
}

// PER values of one cell's row starting at dim lane * PER, dequantized (int8 or q4r planes).
template <bool Q4, int PER>
__device__ __forceinline__ void load_cell(const void* values, const __half* scales, int64_t row, int lane,
                                          float (&out)[PER]) {
    constexpr int DH = 32 * PER;
    if constexpr (Q4) {
        const float d = __half2float(scales[row * (DH / 32) + lane * PER / 32]);
        const uint8_t* p = static_cast<const uint8_t*>(values) + row * (DH / 2) + lane * (PER / 2);
#pragma unroll
        for (int i = 0; i < PER / 2; ++i) {
            const int b = p[i];
            out[2 * i] = static_cast<float>((b & 0xF) - 8) * d;
            out[2 * i + 1] = static_cast<float>((b >> 4) - 8) * d;
        }
    } else {
        const float d = __half2float(scales[row * (DH / 64) + lane * PER / 64]);
        const int8_t* p = static_cast<const int8_t*>(values) + row * DH + lane * PER;
#pragma unroll
        for (int i = 0; i < PER; ++i) out[i] = static_cast<float>(p[i]) * d;
    }
}

template <bool KQ4, bool VQ4, int DH, int GP>
__device__ __forceinline__ void attention_decode_q(const float* __restrict__ q, const void* __restrict__ k_values,
                                                   const __half* __restrict__ k_scales,
                                                   const void* __restrict__ v_values,
                                                   const __half* __restrict__ v_scales,
                                                   const int* __restrict__ lengths, const int* __restrict__ bases,
                                                   float* __restrict__ part_acc, float* __restrict__ part_ml, int H,
                                                   int Hk, int max_cells, int num_splits, float scale) {
    constexpr int PER = DH / 32;
    __shared__ float acc_s[kWarps][GP][DH];
    __shared__ float ml_s[kWarps][GP][2];
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int G = H / Hk;
    const int length = lengths[b];
    const int per_split = (length + num_splits - 1) / num_splits;
    const int start = split * per_split, end = min(length, start + per_split);
    const int64_t slot0 = (static_cast<int64_t>(b) * H + kvh * G) * num_splits + split;  // head g: + g * num_splits

    float qv[GP][PER];
    const float qscale = scale * kLog2e;
#pragma unroll
    for (int g = 0; g < GP; ++g) {
        const float* qh = q + (static_cast<int64_t>(b) * H + kvh * G + min(g, G - 1)) * DH + lane * PER;
#pragma unroll
        for (int i = 0; i < PER; ++i) qv[g][i] = g < G ? qh[i] * qscale : 0.0f;
    }
    float acc[GP][PER] = {};
    float m[GP], l[GP];
#pragma unroll
    for (int g = 0; g < GP; ++g) m[g] = -INFINITY, l[g] = 0.0f;

    const int64_t first = bases ? static_cast<int64_t>(bases[b]) : static_cast<int64_t>(b) * max_cells;
    const int64_t row0 = first * Hk + kvh;
    for (int c = start + warp; c < end; c += kWarps) {
        const int64_t row = row0 + static_cast<int64_t>(c) * Hk;
        float kf[PER], vf[PER];
        load_cell<KQ4, PER>(k_values, k_scales, row, lane, kf);
        load_cell<VQ4, PER>(v_values, v_scales, row, lane, vf);
#pragma unroll
        for (int g = 0; g < GP; ++g) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < PER; ++i) s = fmaf(qv[g][i], kf[i], s);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
            const float m_new = fmaxf(m[g], s);
            const float alpha = exp2f(m[g] - m_new);        // 0 on the first cell (m = -inf)
            const float p = exp2f(s - m_new);
            l[g] = fmaf(l[g], alpha, p);
            m[g] = m_new;
#pragma unroll
            for (int i = 0; i < PER; ++i) acc[g][i] = fmaf(acc[g][i], alpha, p * vf[i]);
        }
    }
#pragma unroll
    for (int g = 0; g < GP; ++g) {
#pragma unroll
        for (int i = 0; i < PER; ++i) acc_s[warp][g][lane * PER + i] = acc[g][i];
        if (lane == 0) ml_s[warp][g][0] = m[g], ml_s[warp][g][1] = l[g];
    }
    __syncthreads();
    for (int j = threadIdx.x; j < G * DH; j += blockDim.x) {
        const int g = j / DH, d = j % DH;
        float mmax = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) mmax = fmaxf(mmax, ml_s[w][g][0]);
        float a = 0.0f, lsum = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float mw = ml_s[w][g][0];
            const float e = mw == -INFINITY ? 0.0f : exp2f(mw - mmax);
            a = fmaf(acc_s[w][g][d], e, a);
            lsum = fmaf(ml_s[w][g][1], e, lsum);
        }
        const int64_t slot = slot0 + static_cast<int64_t>(g) * num_splits;
        part_acc[slot * DH + d] = a;
        if (d == 0) part_ml[2 * slot] = mmax, part_ml[2 * slot + 1] = lsum;
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(32) strata_kv_append_int8(const float* x, const int* cells,
                                                                        int8_t* values, __half* scales, int T,
                                                                        int Hk, int Dh) {
    STRATA_PDL_ENTRY();
    if (blockIdx.x >= T || blockIdx.y >= Hk) return;
    if (Dh == 64) append_int8<2>(x, cells, values, scales, Hk);
    else if (Dh == 128) append_int8<4>(x, cells, values, scales, Hk);
    else if (Dh == 256) append_int8<8>(x, cells, values, scales, Hk);
}

extern "C" __global__ void __launch_bounds__(32) strata_kv_append_q4r(const float* x, const int* cells,
                                                                       uint8_t* values, __half* scales, int T,
                                                                       int Hk, int Dh, float rot_scale) {
    STRATA_PDL_ENTRY();
    if (blockIdx.x >= T || blockIdx.y >= Hk) return;
    if (Dh == 64) append_q4r<2>(x, cells, values, scales, Hk, rot_scale);
    else if (Dh == 128) append_q4r<4>(x, cells, values, scales, Hk, rot_scale);
    else if (Dh == 256) append_q4r<8>(x, cells, values, scales, Hk, rot_scale);
}

template <int PER>
__device__ __forceinline__ void hadamard_row(float* x, float rot_scale) {
    float* p = x + static_cast<int64_t>(blockIdx.x) * 32 * PER + threadIdx.x * PER;
    float v[PER];
    load_row<PER>(p, v);
    hadamard_warp<PER>(v, threadIdx.x, rot_scale);
#pragma unroll
    for (int i = 0; i < PER; ++i) p[i] = v[i];
}

extern "C" __global__ void __launch_bounds__(32) strata_hadamard_f32(float* x, int rows, int Dh, float rot_scale) {
    STRATA_PDL_ENTRY();
    if (blockIdx.x >= rows) return;
    if (Dh == 64) hadamard_row<2>(x, rot_scale);
    else if (Dh == 128) hadamard_row<4>(x, rot_scale);
    else if (Dh == 256) hadamard_row<8>(x, rot_scale);
}

template <bool Q4, int PER>
__device__ __forceinline__ void dequant_row(const void* values, const __half* scales, __half* out, int Hk) {
    const int64_t row = static_cast<int64_t>(blockIdx.x) * Hk + blockIdx.y;
    float v[PER];
    load_cell<Q4, PER>(values, scales, row, threadIdx.x, v);
    __half* p = out + row * 32 * PER + threadIdx.x * PER;
#pragma unroll
    for (int i = 0; i < PER; ++i) p[i] = __float2half_rn(v[i]);
}

#define STRATA_KV_DEQUANT(NAME, Q4)                                                                             \
    extern "C" __global__ void __launch_bounds__(32) NAME(const void* values, const __half* scales, __half* out, \
                                                           int rows, int Hk, int Dh) {                          \
        STRATA_PDL_ENTRY();                                                                                     \
        if (blockIdx.x >= rows || blockIdx.y >= Hk) return;                                                     \
        if (Dh == 64) dequant_row<Q4, 2>(values, scales, out, Hk);                                              \
        else if (Dh == 128) dequant_row<Q4, 4>(values, scales, out, Hk);                                        \
        else if (Dh == 256) dequant_row<Q4, 8>(values, scales, out, Hk);                                        \
    }
STRATA_KV_DEQUANT(strata_kv_dequant_int8_f16, false)
STRATA_KV_DEQUANT(strata_kv_dequant_q4r_f16, true)
#undef STRATA_KV_DEQUANT

#define STRATA_DECODE_Q(FMT, KQ4, VQ4, DH, GP)                                                                   \
    extern "C" __global__ void __launch_bounds__(128) strata_attention_decode_##FMT##_d##DH##_g##GP(              \
        const float* q, const void* k_values, const __half* k_scales, const void* v_values,                    \
        const __half* v_scales, const int* lengths, const int* bases, float* part_acc, float* part_ml, int H,  \
        int Hk, int max_cells, int num_splits, float scale) {                                                  \
        STRATA_PDL_ENTRY();                                                                                     \
        attention_decode_q<KQ4, VQ4, DH, GP>(q, k_values, k_scales, v_values, v_scales, lengths, bases,        \
                                             part_acc, part_ml, H, Hk, max_cells, num_splits, scale);          \
    }
#define STRATA_DECODE_Q_ALL(FMT, KQ4, VQ4)                                                                       \
    STRATA_DECODE_Q(FMT, KQ4, VQ4, 64, 1) STRATA_DECODE_Q(FMT, KQ4, VQ4, 64, 2)                                 \
    STRATA_DECODE_Q(FMT, KQ4, VQ4, 64, 4) STRATA_DECODE_Q(FMT, KQ4, VQ4, 64, 8)                                 \
    STRATA_DECODE_Q(FMT, KQ4, VQ4, 64, 16) STRATA_DECODE_Q(FMT, KQ4, VQ4, 128, 1)                               \
    STRATA_DECODE_Q(FMT, KQ4, VQ4, 128, 2) STRATA_DECODE_Q(FMT, KQ4, VQ4, 128, 4)                               \
    STRATA_DECODE_Q(FMT, KQ4, VQ4, 128, 8) STRATA_DECODE_Q(FMT, KQ4, VQ4, 128, 16)                              \
    STRATA_DECODE_Q(FMT, KQ4, VQ4, 256, 1) STRATA_DECODE_Q(FMT, KQ4, VQ4, 256, 2)                               \
    STRATA_DECODE_Q(FMT, KQ4, VQ4, 256, 4) STRATA_DECODE_Q(FMT, KQ4, VQ4, 256, 8)
STRATA_DECODE_Q_ALL(int8, false, false)
STRATA_DECODE_Q_ALL(q4_0, true, true)
STRATA_DECODE_Q_ALL(k8v4, false, true)
#undef STRATA_DECODE_Q_ALL
#undef STRATA_DECODE_Q
