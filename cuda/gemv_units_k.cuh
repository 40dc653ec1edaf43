// GEMV units of the 256-weight K-quant super-blocks and of the float types; see gemv_units.cuh for
// what a unit is and for the 1 + q / 2^b trick. A K-quant unit is 64 weights: 4 units per block.
#pragma once

#include "gemv_units.cuh"

namespace strata_q {

// Q2_K / Q3_K unit c (h = c / 2, s = c % 2): quant bytes 32h + 16s .. +16, whose bit planes p = 0..3
// hold weights 128h + 32p + 16s + i, i < 16: four runs of 16 x values, one sub-block (group) each.
struct X64Runs {
    float v[64];
    float sum[4];
};

__device__ __forceinline__ void load_x_runs(const float* xb, int c, X64Runs& x) {
    const float* base = xb + 128 * (c >> 1) + 16 * (c & 1);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        load_floats<16>(base + 32 * p, x.v + 16 * p);
        x.sum[p] = sum_floats<16>(x.v + 16 * p);
    }
}

struct UnitQ2_K {
    static constexpr int kBlockWeights = 256, kBlockBytes = 84, kUnits = 4, kRows = 4;
    using X = X64Runs;
    struct Raw { uint32_t sc[2], q[4], dm; };
    static __device__ __forceinline__ void load_x(const float* xb, int c, X& x) { load_x_runs(xb, c, x); }
    static __device__ __forceinline__ void load(const uint8_t* blk, int c, Raw& r) {
        const int h = c >> 1, s = c & 1;  // 84 = 4 * 21: every field is 4-byte aligned
        r.sc[0] = ld32(blk + 8 * h);
        r.sc[1] = ld32(blk + 8 * h + 4);
#pragma unroll
        for (int k = 0; k < 4; ++k) r.q[k] = ld32(blk + 16 + 32 * h + 16 * s + 4 * k);
        r.dm = ld32(blk + 80);
    }
    static __device__ __forceinline__ float dot(const Raw& r, int c, const X& x, const float*) {
        float tot_d = 0.f, tot_m = 0.f;
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            float acc = 0.f;
#pragma unroll
            for (int k = 0; k < 4; ++k)  // bits 2p..2p+1 to bits 5..6: 1 + q / 4
                acc = dot4_frac((rotl(r.q[k], (5 - 2 * p) & 31) & 0x60606060u) | 0x80808080u, x.v + 16 * p + 4 * k, acc);
            const uint32_t b = byte_at(r.sc[p >> 1], 2 * (p & 1) + (c & 1));  // scales[8h + 2p + s]
            tot_d = fmaf(small_float(b & 15u), 4.f * (acc - x.sum[p]), tot_d);
            tot_m = fmaf(small_float(b >> 4), x.sum[p], tot_m);
        }
        return f16_bits(r.dm) * tot_d - f16_bits(r.dm >> 16) * tot_m;
    }
};

struct UnitQ3_K {
    static constexpr int kBlockWeights = 256, kBlockBytes = 110, kUnits = 4, kRows = 4;
    using X = X64Runs;
    struct Raw { uint32_t q[4], hm[4], sc[3], d; };
    static __device__ __forceinline__ void load_x(const float* xb, int c, X& x) { load_x_runs(xb, c, x); }
    static __device__ __forceinline__ void load(const uint8_t* blk, int c, Raw& r) {
        const int h = c >> 1, s = c & 1;
        load_words_a2<4>(blk + 32 + 32 * h + 16 * s, r.q);
        load_words_a2<4>(blk + 16 * s, r.hm);
        load_words_a2<3>(blk + 96, r.sc);
        r.d = ld16(blk + 108);
    }
    static __device__ __forceinline__ float dot(const Raw& r, int c, const X& x, const float*) {
        const int h = c >> 1, s = c & 1;
        float tot = 0.f;
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const int hrot = (6 - 4 * h - p) & 31;  // hmask bit 4h + p to bit 6
            float acc = 0.f;
#pragma unroll
            for (int k = 0; k < 4; ++k) {  // q = low2 | hbit << 2 at bits 4..6: 1 + q / 8
                const uint32_t packed = (rotl(r.q[k], (4 - 2 * p) & 31) & 0x30303030u) |
                                        (rotl(r.hm[k], hrot) & 0x40404040u) | 0x80808080u;
                acc = dot4_frac(packed, x.v + 16 * p + 4 * k, acc);
            }
            // sub-block 8h + 2p + s: low nibble h of scales[2p + s], top bits 4h + 2(p / 2) of scales[8 + 2(p % 2) + s]
            const uint32_t bsel = 2 * (p & 1) + s;
            const uint32_t lo4 = (byte_at(r.sc[p >> 1], bsel) >> (4 * h)) & 15u;
            const uint32_t hi2 = (byte_at(r.sc[2], bsel) >> (4 * h + 2 * (p >> 1))) & 3u;
            // sum x * (q - 4) = 8 * (acc - S) - 4 * S
            tot = fmaf(exact_float(static_cast<int>(lo4 | (hi2 << 4)) - 32), 8.f * acc - 12.f * x.sum[p], tot);
        }
        return f16_bits(r.d) * tot;
    }
};

// Q4_K / Q5_K / IQ4_XS unit c: 64 contiguous weights 64c .. 64c + 63 (two 32-weight sub-blocks).
struct X64 {
    float v[64];
    float sum[2];
};

__device__ __forceinline__ void load_x64(const float* xb, int c, X64& x) {
    load_floats<64>(xb + 64 * c, x.v);
    x.sum[0] = sum_floats<32>(x.v);
    x.sum[1] = sum_floats<32>(x.v + 32);
}

// Scales and mins (as floats) of sub-blocks 2c and 2c + 1 from the 12 packed bytes in words h1..h3.
__device__ __forceinline__ void k4_pair(uint32_t h1, uint32_t h2, uint32_t h3, int c, float* sc, float* m) {
    const bool first = c < 2;  // sub-blocks 0..3 keep six bits in place, 4..7 are split
    const uint32_t scw = first ? (h1 & 0x3F3F3F3Fu) : ((h3 & 0x0F0F0F0Fu) | ((h1 >> 2) & 0x30303030u));
    const uint32_t mw = first ? (h2 & 0x3F3F3F3Fu) : (((h3 >> 4) & 0x0F0F0F0Fu) | ((h2 >> 2) & 0x30303030u));
    const uint32_t b0 = 2 * (c & 1);
    sc[0] = byte_float(scw, b0), sc[1] = byte_float(scw, b0 + 1);
    m[0] = byte_float(mw, b0), m[1] = byte_float(mw, b0 + 1);
}

struct UnitQ4_K {
    static constexpr int kBlockWeights = 256, kBlockBytes = 144, kUnits = 4, kRows = 4;
    using X = X64;
    struct Raw { uint4 head, q0, q1; };  // 144 = 9 * 16: 16-byte loads
    static __device__ __forceinline__ void load_x(const float* xb, int c, X& x) { load_x64(xb, c, x); }
    static __device__ __forceinline__ void load(const uint8_t* blk, int c, Raw& r) {
        r.head = ld128(blk);
        r.q0 = ld128(blk + 16 + 32 * c);
        r.q1 = ld128(blk + 32 + 32 * c);
    }
    static __device__ __forceinline__ float dot(const Raw& r, int c, const X& x, const float*) {
        const uint32_t q[8] = {r.q0.x, r.q0.y, r.q0.z, r.q0.w, r.q1.x, r.q1.y, r.q1.z, r.q1.w};
        float lo = 0.f, hi = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            lo = dot4_frac(nib4_lo(q[k]), x.v + 4 * k, lo);
            hi = dot4_frac(nib4_hi(q[k]), x.v + 32 + 4 * k, hi);
        }
        float sc[2], m[2];
        k4_pair(r.head.y, r.head.z, r.head.w, c, sc, m);
        const float t = sc[0] * (16.f * (lo - x.sum[0])) + sc[1] * (16.f * (hi - x.sum[1]));
        return f16_bits(r.head.x) * t - f16_bits(r.head.x >> 16) * (m[0] * x.sum[0] + m[1] * x.sum[1]);
    }
};

struct UnitQ5_K {
    static constexpr int kBlockWeights = 256, kBlockBytes = 176, kUnits = 4, kRows = 2;
    using X = X64;
    struct Raw { uint4 head, qh0, qh1, q0, q1; };  // 176 = 11 * 16: 16-byte loads
    static __device__ __forceinline__ void load_x(const float* xb, int c, X& x) { load_x64(xb, c, x); }
    static __device__ __forceinline__ void load(const uint8_t* blk, int c, Raw& r) {
        r.head = ld128(blk);
        r.qh0 = ld128(blk + 16);
        r.qh1 = ld128(blk + 32);
        r.q0 = ld128(blk + 48 + 32 * c);
        r.q1 = ld128(blk + 64 + 32 * c);
    }
    static __device__ __forceinline__ float dot(const Raw& r, int c, const X& x, const float*) {
        const uint32_t q[8] = {r.q0.x, r.q0.y, r.q0.z, r.q0.w, r.q1.x, r.q1.y, r.q1.z, r.q1.w};
        const uint32_t qh[8] = {r.qh0.x, r.qh0.y, r.qh0.z, r.qh0.w, r.qh1.x, r.qh1.y, r.qh1.z, r.qh1.w};
        const int rot_lo = (6 - 2 * c) & 31, rot_hi = (5 - 2 * c) & 31;  // qh bit 2c (2c + 1) to bit 6
        float lo = 0.f, hi = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            lo = dot4_frac(nib5_lo(q[k]) | (rotl(qh[k], rot_lo) & 0x40404040u), x.v + 4 * k, lo);
            hi = dot4_frac(nib5_hi(q[k]) | (rotl(qh[k], rot_hi) & 0x40404040u), x.v + 32 + 4 * k, hi);
        }
        float sc[2], m[2];
        k4_pair(r.head.y, r.head.z, r.head.w, c, sc, m);
        const float t = sc[0] * (32.f * (lo - x.sum[0])) + sc[1] * (32.f * (hi - x.sum[1]));
        return f16_bits(r.head.x) * t - f16_bits(r.head.x >> 16) * (m[0] * x.sum[0] + m[1] * x.sum[1]);
    }
};

// Q6_K unit c (h = c / 2, a = c % 2): ql bytes 64h + 32a .. +32; low nibbles are weights
// 128h + 32a + l, high nibbles 128h + 64 + 32a + l (l < 32); groups of 16 are sub-blocks.
struct UnitQ6_K {
    static constexpr int kBlockWeights = 256, kBlockBytes = 210, kUnits = 4, kRows = 2;
    using X = X64Runs;  // runs: v[0..31] at 128h + 32a, v[32..63] at 128h + 64 + 32a; sums per 16
    struct Raw { uint32_t ql[8], qh[8], sc[2], d; };
    static __device__ __forceinline__ void load_x(const float* xb, int c, X& x) {
        const float* base = xb + 128 * (c >> 1) + 32 * (c & 1);
        load_floats<32>(base, x.v);
        load_floats<32>(base + 64, x.v + 32);
#pragma unroll
        for (int g = 0; g < 4; ++g) x.sum[g] = sum_floats<16>(x.v + 16 * g);
    }
    static __device__ __forceinline__ void load(const uint8_t* blk, int c, Raw& r) {
        const int h = c >> 1, a = c & 1;
        load_words_a2<8>(blk + 64 * h + 32 * a, r.ql);
        load_words_a2<8>(blk + 128 + 32 * h, r.qh);
        load_words_a2<2>(blk + 192 + 8 * h, r.sc);
        r.d = ld16(blk + 208);
    }
    static __device__ __forceinline__ float dot(const Raw& r, int c, const X& x, const float*) {
        const int a = c & 1;
        const int rot_lo = (5 - 2 * a) & 31, rot_hi = (1 - 2 * a) & 31;  // qh bits 2p.. to bits 5..6, p = a, a + 2
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int k = 0; k < 8; ++k) {  // q = nibble | top << 4 at bits 1..6: 1 + q / 64
            const uint32_t lo = ((r.ql[k] << 1) & 0x1E1E1E1Eu) | (rotl(r.qh[k], rot_lo) & 0x60606060u) | 0x80808080u;
            const uint32_t hi = ((r.ql[k] >> 3) & 0x1E1E1E1Eu) | (rotl(r.qh[k], rot_hi) & 0x60606060u) | 0x80808080u;
            acc[k >> 2] = dot4_frac(lo, x.v + 4 * k, acc[k >> 2]);
            acc[2 + (k >> 2)] = dot4_frac(hi, x.v + 32 + 4 * k, acc[2 + (k >> 2)]);
        }
        float tot = 0.f;
#pragma unroll
        for (int g = 0; g < 4; ++g) {  // group g: p = a + 2 (g / 2), sub-block 8h + 2p + g % 2
            const int sc = static_cast<int8_t>(byte_at(r.sc[g >> 1], 2 * a + (g & 1)));
            // sum x * (q - 32) = 64 * (acc - S) - 32 * S
            tot = fmaf(exact_float(sc), 64.f * acc[g] - 96.f * x.sum[g], tot);
        }
        return f16_bits(r.d) * tot;
    }
};

struct UnitIQ4_XS {
    static constexpr int kBlockWeights = 256, kBlockBytes = 136, kUnits = 4, kRows = 4;
    struct X { float v[64]; };
    struct Raw { uint2 head, q[4]; };  // 136 = 17 * 8: 8-byte loads
    static __device__ __forceinline__ void load_x(const float* xb, int c, X& x) { load_floats<64>(xb + 64 * c, x.v); }
    static __device__ __forceinline__ void load(const uint8_t* blk, int c, Raw& r) {
        r.head = ld64(blk);
#pragma unroll
        for (int t = 0; t < 4; ++t) r.q[t] = ld64(blk + 8 + 32 * c + 8 * t);
    }
    static __device__ __forceinline__ float dot(const Raw& r, int c, const X& x, const float* table) {
        float tot = 0.f;
#pragma unroll
        for (int t = 0; t < 2; ++t) {  // sub-block 2c + t
            const uint32_t q[4] = {r.q[2 * t].x, r.q[2 * t].y, r.q[2 * t + 1].x, r.q[2 * t + 1].y};
            const uint32_t lo4 = (r.head.y >> (8 * c + 4 * t)) & 15u;
            const uint32_t hi2 = (r.head.x >> (16 + 4 * c + 2 * t)) & 3u;
            tot = fmaf(exact_float(static_cast<int>(lo4 | (hi2 << 4)) - 32), dot_iq4(q, x.v + 32 * t, table), tot);
        }
        return f16_bits(r.head.x) * tot;
    }
};

// ---- float types: 8 weights per unit when rows are a multiple of 8, else one -------------------------

template <class Block>  // BlockF32x8, BlockF16x8, BlockBF16x8
struct UnitFloat8 {
    static constexpr int kBlockWeights = 8, kBlockBytes = Block::kBytes, kUnits = 1, kRows = 2;
    struct X { float v[8]; };
    struct Raw { uint4 w[Block::kBytes / 16]; };
    static __device__ __forceinline__ void load_x(const float* xb, int, X& x) { load_floats<8>(xb, x.v); }
    static __device__ __forceinline__ void load(const uint8_t* blk, int, Raw& r) {
#pragma unroll
        for (int k = 0; k < Block::kBytes / 16; ++k) r.w[k] = ld128(blk + 16 * k);
    }
    static __device__ __forceinline__ float dot(const Raw& r, int, const X& x, const float*) {
        float w[8];
        Block::convert(r.w, w);
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc = fmaf(x.v[i], w[i], acc);
        return acc;
    }
};

template <class Elem>  // ElemF32, ElemF16, ElemBF16
struct UnitFloat1 {
    static constexpr int kBlockWeights = 1, kBlockBytes = Elem::kBytes, kUnits = 1, kRows = 1;
    struct X { float v; };
    struct Raw { uint32_t bits; };
    static __device__ __forceinline__ void load_x(const float* xb, int, X& x) { x.v = __ldg(xb); }
    static __device__ __forceinline__ void load(const uint8_t* blk, int, Raw& r) { r.bits = Elem::load(blk); }
    static __device__ __forceinline__ float dot(const Raw& r, int, const X& x, const float*) {
        return x.v * Elem::value(r.bits);
    }
};

}  // namespace strata_q
