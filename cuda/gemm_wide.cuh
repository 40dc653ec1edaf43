// The prompt GEMMs' weight decoders (cuda/moe_gemm.cu, cuda/moe_gemm_ws.cu): 16 consecutive weights
// of a row as 16 f16, each f16(the exact float32 weight of quant_blocks.cuh's decode8), bit for bit,
// and 4 values of an f32 activation row as 4 f16. Include inside an anonymous namespace after
// quant_blocks.cuh and `using namespace strata_q`.

#pragma once

__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ uint4 halves8(const float* v) {
    return make_uint4(half2_bits(v[0], v[1]), half2_bits(v[2], v[3]), half2_bits(v[4], v[5]), half2_bits(v[6], v[7]));
}

// ---- 16-weight decoders: weights k .. k + 15 of a row (k a multiple of 16) as 16 f16 ---------------
// Each is f16(the exact float32 weight of quant_blocks.cuh's decode8), bit for bit: the same
// products and differences in the same order; only the loads are wider (one 16-byte load where
// decode8 made several small ones, the L1 limit of the first version) and the byte -> float
// conversion works on four bytes of a word at a time.

// The 16 bytes at the 2-byte aligned p, from the one or two aligned 16-byte chunks holding them.
// The second chunk is read only when needed; it holds p + 15, so it never crosses into a page the
// tensor does not touch (it may read up to 14 bytes past the tensor's end inside that chunk).
__device__ __forceinline__ void ld128_a2(const uint8_t* p, uint32_t (&out)[4]) {
    const uint32_t sh = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p)) & 15u;
    const uint8_t* base = p - sh;
    const uint4 lo = ld128(base);
    const uint4 hi = sh ? ld128(base + 16) : lo;
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    uint32_t v[6], u[5];
#pragma unroll
    for (int i = 0; i < 6; ++i) v[i] = (sh & 8u) ? w[i + 2] : w[i];
#pragma unroll
    for (int i = 0; i < 5; ++i) u[i] = (sh & 4u) ? v[i + 1] : v[i];
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __funnelshift_r(u[i], u[i + 1], 8u * (sh & 3u));
}

// Byte i (0..3) of w as the float 2^23 + byte: exact, one byte_perm; subtract 2^23 + bias after.
__device__ __forceinline__ float biased_byte(uint32_t w, int i) {
    return __int_as_float(static_cast<int>(__byte_perm(w, 0x4B000000u, 0x7440u | static_cast<uint32_t>(i))));
}

// out[0..7] = 16 halves of f(q) for the 16 bytes q of words w (each byte an unsigned quant):
// f(q) = ((q - bias) * mul) - sub, with exactly decode8's roundings.
// A file that defines STRATA_K4_FMA before including this one (cuda/moe_gemm_ws.cu) rounds kSub's
// products with one fma instead of a subtraction and a multiply: the same values, and the same bits
// but for the zero of a negative scale at quant 0 (+0 for -0). kSub (Q4_K, Q5_K) takes bias = 2^23
// only, and -mul * 2^23 is then exact (a power-of-two scaling).
template <bool kSub>
__device__ __forceinline__ void scale16(const uint32_t (&w)[4], float bias, float mul, float sub, uint4 (&out)[2]) {
    uint32_t h[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float v[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
#ifdef STRATA_K4_FMA
            if constexpr (kSub) {
                // bias is 2^23 here (the K-quants' unsigned nibbles): for a finite mul, mul * (2^23 + q) - mul * 2^23
                // is exactly mul * q, so one fma rounds it as __fmul_rn(mul, q) would, without q's subtraction,
                // but for a zero's sign: a negative mul at q = 0 gives +0 where the multiply gives -0
                // (tests/kernels/test_gemm_wide_host.py checks this over every f16 scale and 5-bit quant)
                v[b] = __fsub_rn(__fmaf_rn(mul, biased_byte(w[i], b), -__fmul_rn(mul, bias)), sub);
                continue;
            }
#endif
            const float q = __fsub_rn(biased_byte(w[i], b), bias);
            v[b] = kSub ? __fsub_rn(__fmul_rn(mul, q), sub) : __fmul_rn(mul, q);
        }
        h[2 * i] = half2_bits(v[0], v[1]);
        h[2 * i + 1] = half2_bits(v[2], v[3]);
    }
    out[0] = make_uint4(h[0], h[1], h[2], h[3]);
    out[1] = make_uint4(h[4], h[5], h[6], h[7]);
}

constexpr float kTwo23 = 8388608.0f;

// Default: two decode8 calls (the types without a wide decoder).
template <class B>
struct Wide {
    static __device__ __forceinline__ void decode16(const uint8_t* row, int k, int, uint4 (&out)[2]) {
        const uint8_t* blk = row + static_cast<long long>(k / B::kWeights) * B::kBytes;
        float v[8];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            B::decode8(blk, (k % B::kWeights) / 8 + h, v);
            out[h] = halves8(v);
        }
    }
};

// Q4_K / Q5_K (16-byte aligned blocks): header (d, dmin, 12 scale bytes) and 16 quant bytes, one
// load each (Q5_K: and 16 bytes of qh). Sub-block s = kb / 32, nibble (kb / 32) % 2 of qs[32c + l].
template <bool kFifthBit>
struct Wide<BlockK4<kFifthBit>> {
    static __device__ __forceinline__ void decode16(const uint8_t* row, int k, int, uint4 (&out)[2]) {
        using B = BlockK4<kFifthBit>;
        const uint8_t* blk = row + static_cast<long long>(k / 256) * B::kBytes;
        const int kb = k % 256, c = kb >> 6, s = kb >> 5, l0 = kb & 31;
        constexpr int kQs = kFifthBit ? 48 : 16;
        const uint4 head = ld128(blk), q16 = ld128(blk + kQs + 32 * c + l0);
        // six-bit scale and min of sub-block s from scales bytes S[j], S[j + 4], S[j + 8], j = s % 4
        const uint32_t j = static_cast<uint32_t>(s & 3);
        const int b1 = static_cast<int>(byte_at(head.y, j)), b2 = static_cast<int>(byte_at(head.z, j));
        const int b3 = static_cast<int>(byte_at(head.w, j));
        const int sc = s < 4 ? (b1 & 63) : ((b3 & 15) | ((b1 >> 6) << 4));
        const int m = s < 4 ? (b2 & 63) : ((b3 >> 4) | ((b2 >> 6) << 4));
        const float dl = __fmul_rn(f16_bits(head.x), exact_float(sc));
        const float ml = __fmul_rn(f16_bits(head.x >> 16), exact_float(m));
        const uint32_t qw[4] = {q16.x, q16.y, q16.z, q16.w};
        uint32_t w[4];
        const int shift = 4 * (s & 1);
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = (qw[i] >> shift) & 0x0F0F0F0Fu;
        if (kFifthBit) {
            const uint4 h16 = ld128(blk + 16 + l0);
            const uint32_t hw[4] = {h16.x, h16.y, h16.z, h16.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) w[i] |= ((hw[i] >> s) & 0x01010101u) << 4;
        }
        scale16<true>(w, kTwo23, dl, ml, out);
    }
};

// Q6_K (2-byte aligned): 16 weights share one int8 scale; ql and qh 16 bytes each.
template <>
struct Wide<BlockQ6_K> {
    static __device__ __forceinline__ void decode16(const uint8_t* row, int k, int, uint4 (&out)[2]) {
        const uint8_t* blk = row + static_cast<long long>(k / 256) * BlockQ6_K::kBytes;
        const int kb = k % 256, h = kb >> 7, p = (kb >> 5) & 3, l0 = kb & 31;
        uint32_t ql[4], qh[4], w[4];
        ld128_a2(blk + 64 * h + 32 * (p & 1) + l0, ql);
        ld128_a2(blk + 128 + 32 * h + l0, qh);
        const int sc = static_cast<int8_t>(ld8(blk + 192 + (kb >> 4)));
        const float dl = __fmul_rn(ld_f16(blk + 208), exact_float(sc));
#pragma unroll
        for (int i = 0; i < 4; ++i)
            w[i] = ((ql[i] >> (4 * (p >> 1))) & 0x0F0F0F0Fu) | (((qh[i] >> (2 * p)) & 0x03030303u) << 4);
        scale16<false>(w, kTwo23 + 32.0f, dl, 0.f, out);
    }
};

// Q8_0 (2-byte aligned): half a block; int8 quants made unsigned by flipping the sign bit.
template <>
struct Wide<BlockQ8_0> {
    static __device__ __forceinline__ void decode16(const uint8_t* row, int k, int, uint4 (&out)[2]) {
        const uint8_t* blk = row + static_cast<long long>(k / 32) * BlockQ8_0::kBytes;
        uint32_t w[4];
        ld128_a2(blk + 2 + 16 * ((k >> 4) & 1), w);
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] ^= 0x80808080u;
        scale16<false>(w, kTwo23 + 128.0f, ld_f16(blk), 0.f, out);
    }
};

// Q4_0 (2-byte aligned): nibble (k / 16) % 2 of the block's 16 quant bytes.
template <>
struct Wide<BlockQ4_0> {
    static __device__ __forceinline__ void decode16(const uint8_t* row, int k, int, uint4 (&out)[2]) {
        const uint8_t* blk = row + static_cast<long long>(k / 32) * BlockQ4_0::kBytes;
        uint32_t w[4];
        ld128_a2(blk + 2, w);
        const int shift = 4 * ((k >> 4) & 1);
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = (w[i] >> shift) & 0x0F0F0F0Fu;
        scale16<false>(w, kTwo23 + 8.0f, ld_f16(blk), 0.f, out);
    }
};

// Float types (rows of a multiple of 8 weights): two 8-weight loads; k past K reads the row's last
// 8 weights and zeros them, without a branch.
template <class B>
struct WideFloat {
    static __device__ __forceinline__ void decode16(const uint8_t* row, int k, int K, uint4 (&out)[2]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int kk = k + 8 * h;
            float v[8];
            B::decode8(row + static_cast<long long>(min(kk, K - 8) / 8) * B::kBytes, 0, v);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = kk < K ? v[i] : 0.f;
            out[h] = halves8(v);
        }
    }
};
template <>
struct Wide<BlockF32x8> : WideFloat<BlockF32x8> {};
template <>
struct Wide<BlockBF16x8> : WideFloat<BlockBF16x8> {};

// F16 weights are their own f16 rounding: the bits pass through.
template <>
struct Wide<BlockF16x8> {
    static __device__ __forceinline__ void decode16(const uint8_t* row, int k, int K, uint4 (&out)[2]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int kk = k + 8 * h;
            const uint4 w = ld128(row + static_cast<long long>(min(kk, K - 8)) * 2);
            out[h] = kk < K ? w : make_uint4(0u, 0u, 0u, 0u);
        }
    }
};

// X values k .. k + 3 of a row as 4 f16 (k past K or a row past m: zeros, nothing read).
__device__ __forceinline__ uint2 load_x4(const float* row, int k, int K, bool valid) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (valid && k < K) v = __ldg(reinterpret_cast<const float4*>(row + k));
    return make_uint2(half2_bits(v.x, v.y), half2_bits(v.z, v.w));
}
