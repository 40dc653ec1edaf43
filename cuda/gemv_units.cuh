// Per-type pieces of the decode GEMV (cuda/gemv.cu): how one lane reads one "unit" of a row (the
// quants of 32 or 64 weights, or 8 for float types), which x values go with it, and its dot product.
//
// A unit type U gives: kBlockWeights / kBlockBytes (its quant block), kUnits (units per block),
// kRows (rows one lane works on at once, sharing the x values it holds in registers), X (x values
// and sums for one unit), Raw (one row's bytes for one unit), load_x, load and dot. Consecutive
// lanes take consecutive units, so a warp's loads of one row are contiguous.
//
// Low-bit quants are not converted to floats one by one (a conversion instruction runs at a quarter
// of the FMA rate): a byte 0x80 | q << (7 - b) placed under 0x3F by one byte_perm IS the float
// 1 + q / 2^b. A unit sums acc = sum x * (1 + q / 2^b) per scale group, and with S = sum x of the
// group, sum x * q = 2^b * (acc - S). S is computed once per unit and shared by the kRows rows.
// This costs a few ulp of acc (acc and S are of the same size), far inside the 1e-5 tolerance.
#pragma once

#include "quant_blocks.cuh"

namespace strata_q {

// 1 + q / 2^b from byte K of `packed`, which holds 0x80 | q << (7 - b).
template <int K>
__device__ __forceinline__ float frac_at(uint32_t packed) {
    return __uint_as_float(__byte_perm(packed, 0x3F000000u, 0x7044u | (K << 8)));
}

// acc + sum over the 4 bytes of packed of v[i] * (1 + q_i / 2^b)
__device__ __forceinline__ float dot4_frac(uint32_t packed, const float* v, float acc) {
    acc = fmaf(v[0], frac_at<0>(packed), acc);
    acc = fmaf(v[1], frac_at<1>(packed), acc);
    acc = fmaf(v[2], frac_at<2>(packed), acc);
    return fmaf(v[3], frac_at<3>(packed), acc);
}

// 2^23 + byte K of w, exactly.
template <int K>
__device__ __forceinline__ float magic_byte(uint32_t w) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | K));
}

// Byte k (run-time) of w as a float.
__device__ __forceinline__ float byte_float(uint32_t w, uint32_t k) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | k)) - 8388608.0f;
}

// v < 2^23 as a float.
__device__ __forceinline__ float small_float(uint32_t v) { return __uint_as_float(0x4B000000u | v) - 8388608.0f; }

__device__ __forceinline__ uint32_t rotl(uint32_t w, int s) { return __funnelshift_l(w, w, s); }

// Per byte: 0x80 | (low or high nibble) << 3, the 1 + q / 16 pattern.
__device__ __forceinline__ uint32_t nib4_lo(uint32_t w) { return ((w << 3) & 0x78787878u) | 0x80808080u; }
__device__ __forceinline__ uint32_t nib4_hi(uint32_t w) { return ((w >> 1) & 0x78787878u) | 0x80808080u; }
// Per byte: 0x80 | nibble << 2; the fifth bit goes to bit 6 (1 + q / 32).
__device__ __forceinline__ uint32_t nib5_lo(uint32_t w) { return ((w << 2) & 0x3C3C3C3Cu) | 0x80808080u; }
__device__ __forceinline__ uint32_t nib5_hi(uint32_t w) { return ((w >> 2) & 0x3C3C3C3Cu) | 0x80808080u; }
// Bits 0..3 of b to bit 6 of bytes 0..3 (the four shifted copies of b do not overlap).
__device__ __forceinline__ uint32_t spread4(uint32_t b) { return (b * 0x08102040u) & 0x40404040u; }

template <int N>
__device__ __forceinline__ void load_floats(const float* p, float* v) {
#pragma unroll
    for (int k = 0; k < N / 4; ++k) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(p) + k);
        v[4 * k] = f.x, v[4 * k + 1] = f.y, v[4 * k + 2] = f.z, v[4 * k + 3] = f.w;
    }
}

template <int N>
__device__ __forceinline__ float sum_floats(const float* v) {
    float a = 0.f, b = 0.f;
#pragma unroll
    for (int i = 0; i < N; i += 2) a += v[i], b += v[i + 1];
    return a + b;
}

// Codebook value of the index whose byte offset (4 * q) is byte K of idx, from the shared table.
template <int K>
__device__ __forceinline__ float table_at(const float* table, uint32_t idx) {
    return *reinterpret_cast<const float*>(reinterpret_cast<const char*>(table) + __byte_perm(idx, 0u, 0x4440u | K));
}

// ---- 32-weight blocks: one block per unit --------------------------------------------------------

struct X32 {
    float v[32];
    float sum;
};

__device__ __forceinline__ void load_x32(const float* xb, X32& x) {
    load_floats<32>(xb, x.v);
    x.sum = sum_floats<32>(x.v);
}

// sum over a block's 16 quant bytes (weight l low nibble, 16 + l high) of x * (1 + q / 16)
__device__ __forceinline__ float dot_nib4(const uint32_t* q, const float* v) {
    float lo = 0.f, hi = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        lo = dot4_frac(nib4_lo(q[k]), v + 4 * k, lo);
        hi = dot4_frac(nib4_hi(q[k]), v + 16 + 4 * k, hi);
    }
    return lo + hi;
}

// as dot_nib4 with the fifth bit of weight j at bit j of qh: x * (1 + q / 32)
__device__ __forceinline__ float dot_nib5(const uint32_t* q, uint32_t qh, const float* v) {
    float lo = 0.f, hi = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        lo = dot4_frac(nib5_lo(q[k]) | spread4((qh >> (4 * k)) & 15u), v + 4 * k, lo);
        hi = dot4_frac(nib5_hi(q[k]) | spread4((qh >> (16 + 4 * k)) & 15u), v + 16 + 4 * k, hi);
    }
    return lo + hi;
}

struct UnitQ4_0 {
    static constexpr int kBlockWeights = 32, kBlockBytes = 18, kUnits = 1, kRows = 4;
    using X = X32;
    struct Raw { uint32_t d, q[4]; };
    static __device__ __forceinline__ void load_x(const float* xb, int, X& x) { load_x32(xb, x); }
    static __device__ __forceinline__ void load(const uint8_t* blk, int, Raw& r) {
        r.d = ld16(blk);
        load_words_a2<4>(blk + 2, r.q);
    }
    static __device__ __forceinline__ float dot(const Raw& r, int, const X& x, const float*) {
        // sum x * (q - 8) = 16 * (acc - S) - 8 * S
        return f16_bits(r.d) * (16.f * dot_nib4(r.q, x.v) - 24.f * x.sum);
    }
};

struct UnitQ4_1 {
    static constexpr int kBlockWeights = 32, kBlockBytes = 20, kUnits = 1, kRows = 4;
    using X = X32;
    struct Raw { uint32_t dm, q[4]; };
    static __device__ __forceinline__ void load_x(const float* xb, int, X& x) { load_x32(xb, x); }
    static __device__ __forceinline__ void load(const uint8_t* blk, int, Raw& r) {
        r.dm = ld32(blk);
#pragma unroll
        for (int k = 0; k < 4; ++k) r.q[k] = ld32(blk + 4 + 4 * k);
    }
    static __device__ __forceinline__ float dot(const Raw& r, int, const X& x, const float*) {
        const float t = 16.f * (dot_nib4(r.q, x.v) - x.sum);
        return f16_bits(r.dm) * t + f16_bits(r.dm >> 16) * x.sum;
    }
};

struct UnitQ5_0 {
    static constexpr int kBlockWeights = 32, kBlockBytes = 22, kUnits = 1, kRows = 4;
    using X = X32;
    struct Raw { uint32_t d, w[5]; };  // w[0] = qh, w[1..4] = qs
    static __device__ __forceinline__ void load_x(const float* xb, int, X& x) { load_x32(xb, x); }
    static __device__ __forceinline__ void load(const uint8_t* blk, int, Raw& r) {
        r.d = ld16(blk);
        load_words_a2<5>(blk + 2, r.w);
    }
    static __device__ __forceinline__ float dot(const Raw& r, int, const X& x, const float*) {
        // sum x * (q - 16) = 32 * (acc - S) - 16 * S
        return f16_bits(r.d) * (32.f * dot_nib5(r.w + 1, r.w[0], x.v) - 48.f * x.sum);
    }
};

struct UnitQ5_1 {
    static constexpr int kBlockWeights = 32, kBlockBytes = 24, kUnits = 1, kRows = 4;
    using X = X32;
    struct Raw { uint2 head, q0, q1; };  // head = d | m << 16, qh
    static __device__ __forceinline__ void load_x(const float* xb, int, X& x) { load_x32(xb, x); }
    static __device__ __forceinline__ void load(const uint8_t* blk, int, Raw& r) {
        r.head = ld64(blk);
        r.q0 = ld64(blk + 8);
        r.q1 = ld64(blk + 16);
    }
    static __device__ __forceinline__ float dot(const Raw& r, int, const X& x, const float*) {
        const uint32_t q[4] = {r.q0.x, r.q0.y, r.q1.x, r.q1.y};
        const float t = 32.f * (dot_nib5(q, r.head.y, x.v) - x.sum);
        return f16_bits(r.head.x) * t + f16_bits(r.head.x >> 16) * x.sum;
    }
};

// acc + sum over the 4 int8 bytes of w of v[i] * q_i: q + 128 under 0x4B000000 is the float 2^23 + q + 128.
__device__ __forceinline__ float dot4_int8(uint32_t w, const float* v, float acc) {
    const uint32_t u = w ^ 0x80808080u;
    acc = fmaf(v[0], magic_byte<0>(u) - 8388736.0f, acc);
    acc = fmaf(v[1], magic_byte<1>(u) - 8388736.0f, acc);
    acc = fmaf(v[2], magic_byte<2>(u) - 8388736.0f, acc);
    return fmaf(v[3], magic_byte<3>(u) - 8388736.0f, acc);
}

struct UnitQ8_0 {
    static constexpr int kBlockWeights = 32, kBlockBytes = 34, kUnits = 1, kRows = 4;
    struct X { float v[32]; };
    struct Raw { uint32_t d, q[8]; };
    static __device__ __forceinline__ void load_x(const float* xb, int, X& x) { load_floats<32>(xb, x.v); }
    static __device__ __forceinline__ void load(const uint8_t* blk, int, Raw& r) {
        r.d = ld16(blk);
        load_words_a2<8>(blk + 2, r.q);
    }
    static __device__ __forceinline__ float dot(const Raw& r, int, const X& x, const float*) {
        float even = 0.f, odd = 0.f;  // two chains: more independent FMAs in flight
#pragma unroll
        for (int k = 0; k < 8; k += 2) {
            even = dot4_int8(r.q[k], x.v + 4 * k, even);
            odd = dot4_int8(r.q[k + 1], x.v + 4 * k + 4, odd);
        }
        return f16_bits(r.d) * (even + odd);
    }
};

// IQ4_NL: codebook values come from a 16-float table in shared memory (16 banks: never a conflict).
__device__ __forceinline__ float dot_iq4(const uint32_t* q, const float* v, const float* table) {
    float lo = 0.f, hi = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const uint32_t il = (q[k] << 2) & 0x3C3C3C3Cu, ih = (q[k] >> 2) & 0x3C3C3C3Cu;  // 4 * q per byte
        lo = fmaf(v[4 * k], table_at<0>(table, il), lo);
        lo = fmaf(v[4 * k + 1], table_at<1>(table, il), lo);
        lo = fmaf(v[4 * k + 2], table_at<2>(table, il), lo);
        lo = fmaf(v[4 * k + 3], table_at<3>(table, il), lo);
        hi = fmaf(v[16 + 4 * k], table_at<0>(table, ih), hi);
        hi = fmaf(v[16 + 4 * k + 1], table_at<1>(table, ih), hi);
        hi = fmaf(v[16 + 4 * k + 2], table_at<2>(table, ih), hi);
        hi = fmaf(v[16 + 4 * k + 3], table_at<3>(table, ih), hi);
    }
    return lo + hi;
}

struct UnitIQ4_NL {
    static constexpr int kBlockWeights = 32, kBlockBytes = 18, kUnits = 1, kRows = 4;
    struct X { float v[32]; };
    struct Raw { uint32_t d, q[4]; };
    static __device__ __forceinline__ void load_x(const float* xb, int, X& x) { load_floats<32>(xb, x.v); }
    static __device__ __forceinline__ void load(const uint8_t* blk, int, Raw& r) {
        r.d = ld16(blk);
        load_words_a2<4>(blk + 2, r.q);
    }
    static __device__ __forceinline__ float dot(const Raw& r, int, const X& x, const float* table) {
        return f16_bits(r.d) * dot_iq4(r.q, x.v, table);
    }
};

}  // namespace strata_q
