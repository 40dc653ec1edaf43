// ggml quant blocks on the device: loads, conversions and exact per-type decoders.
//
// Byte layouts are those of strata/quant/dequant.py (each type's docstring there); multi-byte
// fields are little-endian. A block of type T starts at a multiple of T::kBytes from the tensor's
// start, which the callers require to be 16-byte aligned, so a block is only as aligned as its size
// allows (2 bytes for Q4_0, Q5_0, Q8_0, Q3_K, Q6_K, IQ4_NL). Loads never touch a byte outside the
// tensor: unaligned fields are read as aligned words inside their block (or the one before it)
// and realigned with byte_perm.
//
// Decoders are exact: each `decode8` returns the float32 weights numpy (and so ggml) computes,
// bit for bit. Integers become floats through exact_float (no conversion instruction), products
// and sums use __fmul_rn / __fadd_rn / __fsub_rn so no FMA contraction can change a rounding.
#pragma once

#include <cstdint>
#include <cuda_fp16.h>

namespace strata_q {

// ---- loads through the read-only path (weights never change while a kernel reads them) ----------

__device__ __forceinline__ uint32_t ld8(const uint8_t* p) { return __ldg(p); }
__device__ __forceinline__ uint32_t ld16(const uint8_t* p) {
    return __ldg(reinterpret_cast<const unsigned short*>(p));
}
__device__ __forceinline__ uint32_t ld32(const uint8_t* p) {
    return __ldg(reinterpret_cast<const unsigned int*>(p));
}
__device__ __forceinline__ uint2 ld64(const uint8_t* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }
__device__ __forceinline__ uint4 ld128(const uint8_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// NW little-endian words starting at the 2-byte aligned p. An address 2 past a word boundary reads
// the aligned words from p - 2 (bytes of the same or the previous block) and a final 16-bit half,
// so nothing past p + 4 * NW is read.
template <int NW>
__device__ __forceinline__ void load_words_a2(const uint8_t* p, uint32_t* out) {
    const uint32_t shift = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p)) & 2u;
    const uint8_t* base = p - shift;
    uint32_t w[NW + 1];
#pragma unroll
    for (int k = 0; k < NW; ++k) w[k] = ld32(base + 4 * k);
    w[NW] = shift ? ld16(p + 4 * NW - 2) : 0u;
    const uint32_t sel = shift ? 0x5432u : 0x3210u;
#pragma unroll
    for (int k = 0; k < NW; ++k) out[k] = __byte_perm(w[k], w[k + 1], sel);
}

// Byte k (0..3) of w, zero-extended; k may be a run-time value.
__device__ __forceinline__ uint32_t byte_at(uint32_t w, uint32_t k) { return __byte_perm(w, 0u, 0x4440u | k); }

// ---- conversions ---------------------------------------------------------------------------------

__device__ __forceinline__ float f16_bits(uint32_t bits) {  // exact: every f16 is a float32
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits & 0xFFFFu)));
}
__device__ __forceinline__ float ld_f16(const uint8_t* p) { return f16_bits(ld16(p)); }

// v as float32, exactly, for |v| < 2^22: v added to the integer bits of 1.5 * 2^23 stays in that
// binade, whose float spacing is 1; one integer add and one float subtract, at full rate.
__device__ __forceinline__ float exact_float(int v) {
    return __fsub_rn(__int_as_float(0x4B400000 + v), 12582912.0f);
}

// IQ4_NL / IQ4_XS codebook (strata.quant.dequant.IQ4_NL_VALUES) as int8 bytes, 4 per word.
constexpr uint32_t kIq4W0 = 0xBFAD9881u, kIq4W1 = 0xF6EADDCFu, kIq4W2 = 0x26190D01u, kIq4W3 = 0x71594535u;

// Codebook value of the 4-bit index q, looked up in registers with byte_perm.
__device__ __forceinline__ int iq4_value(uint32_t q) {
    const uint32_t lo = __byte_perm(kIq4W0, kIq4W1, q & 7u);
    const uint32_t hi = __byte_perm(kIq4W2, kIq4W3, q & 7u);
    return static_cast<int8_t>((q & 8u ? hi : lo) & 0xFFu);
}

// Bytes [p, p + 8) of a 2-byte aligned field as two words; byte i is (w[i / 4] >> 8 * (i % 4)).
__device__ __forceinline__ uint32_t byte_of(const uint32_t* w, int i) { return (w[i >> 2] >> (8 * (i & 3))) & 0xFFu; }

// Q4_K / Q5_K six-bit scale and min of sub-block j (0..7) from the 12 packed bytes at s.
__device__ __forceinline__ void k4_scale_min(const uint8_t* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = ld8(s + j) & 63;
        m = ld8(s + j + 4) & 63;
    } else {
        sc = (ld8(s + j + 4) & 0xF) | ((ld8(s + j - 4) >> 6) << 4);
        m = (ld8(s + j + 4) >> 4) | ((ld8(s + j) >> 6) << 4);
    }
}

// ---- exact decoders: weights 8j .. 8j+7 of one block ------------------------------------------------

struct BlockQ4_0 {
    static constexpr int kWeights = 32, kBytes = 18;
    // d f16 | qs[16]; weight l < 16 = low nibble of qs[l], 16 + l = high nibble; w = d * (q - 8)
    static __device__ __forceinline__ void decode8(const uint8_t* blk, int j, float* out) {
        uint32_t w[2];
        load_words_a2<2>(blk + 2 + 8 * (j & 1), w);
        const float d = ld_f16(blk);
        const int shift = 4 * (j >> 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = __fmul_rn(d, exact_float(static_cast<int>((byte_of(w, i) >> shift) & 15u) - 8));
    }
};

struct BlockIQ4_NL {
    static constexpr int kWeights = 32, kBytes = 18;
    // d f16 | qs[16] (nibbles as Q4_0); w = d * IQ4_NL_VALUES[q]
    static __device__ __forceinline__ void decode8(const uint8_t* blk, int j, float* out) {
        uint32_t w[2];
        load_words_a2<2>(blk + 2 + 8 * (j & 1), w);
        const float d = ld_f16(blk);
        const int shift = 4 * (j >> 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = __fmul_rn(d, exact_float(iq4_value((byte_of(w, i) >> shift) & 15u)));
    }
};

struct BlockQ4_1 {
    static constexpr int kWeights = 32, kBytes = 20;
    // d f16 | m f16 | qs[16] (nibbles as Q4_0); w = d * q + m
    static __device__ __forceinline__ void decode8(const uint8_t* blk, int j, float* out) {
        const uint32_t dm = ld32(blk);
        const uint32_t w[2] = {ld32(blk + 4 + 8 * (j & 1)), ld32(blk + 8 + 8 * (j & 1))};
        const float d = f16_bits(dm), m = f16_bits(dm >> 16);
        const int shift = 4 * (j >> 1);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            out[i] = __fadd_rn(__fmul_rn(d, exact_float(static_cast<int>((byte_of(w, i) >> shift) & 15u))), m);
    }
};

// Q5_0 / Q5_1 quant of weight 8j + i: the nibble as Q4_0, and bit 8j + i of qh (byte j, bit i).
__device__ __forceinline__ int q5_quant(const uint32_t* w, uint32_t qh_byte, int shift, int i) {
    return static_cast<int>(((byte_of(w, i) >> shift) & 15u) | (((qh_byte >> i) & 1u) << 4));
}

struct BlockQ5_0 {
    static constexpr int kWeights = 32, kBytes = 22;
    // d f16 | qh u32 | qs[16]; w = d * (q - 16)
    static __device__ __forceinline__ void decode8(const uint8_t* blk, int j, float* out) {
        uint32_t w[2];
        load_words_a2<2>(blk + 6 + 8 * (j & 1), w);
        const float d = ld_f16(blk);
        const uint32_t qh = ld8(blk + 2 + j);
        const int shift = 4 * (j >> 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = __fmul_rn(d, exact_float(q5_quant(w, qh, shift, i) - 16));
    }
};

struct BlockQ5_1 {
    static constexpr int kWeights = 32, kBytes = 24;
    // d f16 | m f16 | qh u32 | qs[16]; w = d * q + m
    static __device__ __forceinline__ void decode8(const uint8_t* blk, int j, float* out) {
        const uint32_t dm = ld32(blk);
        const uint32_t w[2] = {ld32(blk + 8 + 8 * (j & 1)), ld32(blk + 12 + 8 * (j & 1))};
        const float d = f16_bits(dm), m = f16_bits(dm >> 16);
        const uint32_t qh = ld8(blk + 4 + j);
        const int shift = 4 * (j >> 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = __fadd_rn(__fmul_rn(d, exact_float(q5_quant(w, qh, shift, i))), m);
    }
};

struct BlockQ8_0 {
    static constexpr int kWeights = 32, kBytes = 34;
    // d f16 | qs int8[32]; w = d * q
    static __device__ __forceinline__ void decode8(const uint8_t* blk, int j, float* out) {
        uint32_t w[2];
        load_words_a2<2>(blk + 2 + 8 * j, w);
        const float d = ld_f16(blk);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = __fmul_rn(d, exact_float(static_cast<int8_t>(byte_of(w, i))));
    }
};

struct BlockQ2_K {
    static constexpr int kWeights = 256, kBytes = 84;
    // scales[16] | qs[64] | d f16 | dmin f16. Weight 128h + 32p + l = bits 2p.. of qs[32h + l];
    // sub-block (16 weights) s: sc = scales[s] & 15, m = scales[s] >> 4; w = (d * sc) * q - dmin * m
    static __device__ __forceinline__ void decode8(const uint8_t* blk, int j, float* out) {
        const int h = j >> 4, p = (j >> 2) & 3, l0 = 8 * (j & 3);
        uint32_t w[2] = {ld32(blk + 16 + 32 * h + l0), ld32(blk + 20 + 32 * h + l0)};
        const uint32_t s = ld8(blk + (j >> 1));
        const uint32_t dm = ld32(blk + 80);
        const float dl = __fmul_rn(f16_bits(dm), exact_float(s & 15u));
        const float ml = __fmul_rn(f16_bits(dm >> 16), exact_float(s >> 4));
#pragma unroll
        for (int i = 0; i < 8; ++i)
            out[i] = __fsub_rn(__fmul_rn(dl, exact_float((byte_of(w, i) >> (2 * p)) & 3u)), ml);
    }
};

struct BlockQ3_K {
    static constexpr int kWeights = 256, kBytes = 110;
    // hmask[32] | qs[64] | scales[12] | d f16. Low 2 bits as Q2_K; bit 4h + p of hmask[l] clear
    // subtracts 4. Sub-block s (16 weights): six-bit sc, low nibble from scales[s % 8] (high nibble
    // for s >= 8), top bits 2(s / 4).. of scales[8 + s % 4]; w = (d * (sc - 32)) * q
    static __device__ __forceinline__ void decode8(const uint8_t* blk, int j, float* out) {
        const int h = j >> 4, p = (j >> 2) & 3, l0 = 8 * (j & 3), s = j >> 1;
        uint32_t q[2], hm[2];
        load_words_a2<2>(blk + 32 + 32 * h + l0, q);
        load_words_a2<2>(blk + l0, hm);
        const uint32_t lo4 = (ld8(blk + 96 + (s & 7)) >> (4 * (s >> 3))) & 15u;
        const uint32_t hi2 = (ld8(blk + 104 + (s & 3)) >> (2 * (s >> 2))) & 3u;
        const float dl = __fmul_rn(ld_f16(blk + 108), exact_float(static_cast<int>(lo4 | (hi2 << 4)) - 32));
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int low = static_cast<int>((byte_of(q, i) >> (2 * p)) & 3u);
            const int hbit = static_cast<int>((byte_of(hm, i) >> (4 * h + p)) & 1u);
            out[i] = __fmul_rn(dl, exact_float(low - (hbit ? 0 : 4)));
        }
    }
};

// Q4_K / Q5_K: weight 64c + 32k + l is nibble k of qs[32c + l], sub-block 2c + k.
template <bool kFifthBit>
struct BlockK4 {
    static constexpr int kWeights = 256, kBytes = kFifthBit ? 176 : 144;
    // d f16 | dmin f16 | scales[12] | (Q5_K: qh[32]) | qs[128]; w = (d * sc) * q - dmin * m
    static __device__ __forceinline__ void decode8(const uint8_t* blk, int j, float* out) {
        const int c = j >> 3, k = (j >> 2) & 1, l0 = 8 * (j & 3), s = j >> 2;
        constexpr int kQs = kFifthBit ? 48 : 16;
        const uint4 q16 = ld128(blk + kQs + 32 * c + (l0 & 16));  // 16-byte aligned: 144 = 9 * 16, 176 = 11 * 16
        const uint32_t w[2] = {(l0 & 8) ? q16.z : q16.x, (l0 & 8) ? q16.w : q16.y};
        int sc, m;
        k4_scale_min(blk + 4, s, sc, m);
        const uint32_t dm = ld32(blk);
        const float dl = __fmul_rn(f16_bits(dm), exact_float(sc));
        const float ml = __fmul_rn(f16_bits(dm >> 16), exact_float(m));
        uint32_t qh[2] = {0u, 0u};
        if (kFifthBit) {
            qh[0] = ld32(blk + 16 + l0);
            qh[1] = ld32(blk + 20 + l0);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            uint32_t q = (byte_of(w, i) >> (4 * k)) & 15u;
            if (kFifthBit) q |= ((byte_of(qh, i) >> s) & 1u) << 4;
            out[i] = __fsub_rn(__fmul_rn(dl, exact_float(static_cast<int>(q))), ml);
        }
    }
};
using BlockQ4_K = BlockK4<false>;
using BlockQ5_K = BlockK4<true>;

struct BlockQ6_K {
    static constexpr int kWeights = 256, kBytes = 210;
    // ql[128] | qh[64] | scales int8[16] | d f16. Weight 128h + 32p + l: low 4 bits = nibble p / 2 of
    // ql[64h + 32(p % 2) + l], top 2 bits = bits 2p.. of qh[32h + l]; w = (d * sc) * (q - 32)
    static __device__ __forceinline__ void decode8(const uint8_t* blk, int j, float* out) {
        const int h = j >> 4, p = (j >> 2) & 3, l0 = 8 * (j & 3);
        uint32_t ql[2], qh[2];
        load_words_a2<2>(blk + 64 * h + 32 * (p & 1) + l0, ql);
        load_words_a2<2>(blk + 128 + 32 * h + l0, qh);
        const int sc = static_cast<int8_t>(ld8(blk + 192 + (j >> 1)));
        const float dl = __fmul_rn(ld_f16(blk + 208), exact_float(sc));
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint32_t q = ((byte_of(ql, i) >> (4 * (p >> 1))) & 15u) | (((byte_of(qh, i) >> (2 * p)) & 3u) << 4);
            out[i] = __fmul_rn(dl, exact_float(static_cast<int>(q) - 32));
        }
    }
};

struct BlockIQ4_XS {
    static constexpr int kWeights = 256, kBytes = 136;
    // d f16 | scales_h u16 | scales_l[4] | qs[128]. Sub-block s (32 weights): sc = nibble s % 2 of
    // scales_l[s / 2] | bits 2s.. of scales_h << 4; weight t < 16 = low nibble of qs[16s + t],
    // 16 + t = high nibble; w = (d * (sc - 32)) * IQ4_NL_VALUES[q]
    static __device__ __forceinline__ void decode8(const uint8_t* blk, int j, float* out) {
        const int s = j >> 2;
        const uint2 w2 = ld64(blk + 8 + 16 * s + 8 * (j & 1));  // 136 = 17 * 8: 8-byte aligned
        const uint32_t w[2] = {w2.x, w2.y};
        const uint32_t head = ld32(blk);
        const uint32_t lo4 = (ld8(blk + 4 + (s >> 1)) >> (4 * (s & 1))) & 15u;
        const uint32_t hi2 = (head >> (16 + 2 * s)) & 3u;
        const float dl = __fmul_rn(f16_bits(head), exact_float(static_cast<int>(lo4 | (hi2 << 4)) - 32));
        const int shift = 4 * ((j >> 1) & 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = __fmul_rn(dl, exact_float(iq4_value((byte_of(w, i) >> shift) & 15u)));
    }
};

// Float types as blocks of 8 weights (rows of a multiple of 8 weights, 16-byte aligned), and as
// single elements (any row).
struct BlockF32x8 {
    static constexpr int kWeights = 8, kBytes = 32;
    static __device__ __forceinline__ void convert(const uint4* w, float* out) {
        const uint32_t u[8] = {w[0].x, w[0].y, w[0].z, w[0].w, w[1].x, w[1].y, w[1].z, w[1].w};
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = __uint_as_float(u[i]);
    }
    static __device__ __forceinline__ void decode8(const uint8_t* blk, int, float* out) {
        const uint4 w[2] = {ld128(blk), ld128(blk + 16)};
        convert(w, out);
    }
};

struct BlockF16x8 {
    static constexpr int kWeights = 8, kBytes = 16;
    static __device__ __forceinline__ void convert(const uint4* w, float* out) {
        const uint32_t u[4] = {w[0].x, w[0].y, w[0].z, w[0].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) out[2 * i] = f16_bits(u[i]), out[2 * i + 1] = f16_bits(u[i] >> 16);
    }
    static __device__ __forceinline__ void decode8(const uint8_t* blk, int, float* out) {
        const uint4 w = ld128(blk);
        convert(&w, out);
    }
};

struct BlockBF16x8 {
    static constexpr int kWeights = 8, kBytes = 16;
    static __device__ __forceinline__ void convert(const uint4* w, float* out) {
        const uint32_t u[4] = {w[0].x, w[0].y, w[0].z, w[0].w};
#pragma unroll
        for (int i = 0; i < 4; ++i)  // bfloat16 is the top half of a float32
            out[2 * i] = __uint_as_float(u[i] << 16), out[2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
    }
    static __device__ __forceinline__ void decode8(const uint8_t* blk, int, float* out) {
        const uint4 w = ld128(blk);
        convert(&w, out);
    }
};

struct ElemF32 {
    static constexpr int kBytes = 4;
    static __device__ __forceinline__ uint32_t load(const uint8_t* p) { return ld32(p); }
    static __device__ __forceinline__ float value(uint32_t bits) { return __uint_as_float(bits); }
};

struct ElemF16 {
    static constexpr int kBytes = 2;
    static __device__ __forceinline__ uint32_t load(const uint8_t* p) { return ld16(p); }
    static __device__ __forceinline__ float value(uint32_t bits) { return f16_bits(bits); }
};

struct ElemBF16 {
    static constexpr int kBytes = 2;
    static __device__ __forceinline__ uint32_t load(const uint8_t* p) { return ld16(p); }
    static __device__ __forceinline__ float value(uint32_t bits) { return __uint_as_float(bits << 16); }
};

}  // namespace strata_q
