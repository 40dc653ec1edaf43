// Dequantization: ggml block bytes -> float32, bit-exact with strata.quant.dequant.dequantize.
//
// strata_dequant_<qtype>(blocks, out, n_blocks)
//   blocks: n_blocks blocks of the type, contiguous, 16-byte aligned (the tensor's native bytes)
//   out:    n_blocks * block_size float32, 16-byte aligned; weight k of block b at out[b * block_size + k]
//   For F32, F16 and BF16 a block is one element, and the alignment needs are only natural ones.
//
// Algorithm: one thread per 8 consecutive weights (block types) or per element (float types),
// decoded by quant_blocks.cuh's exact decoders: the same float32 operations, in the same order,
// as the numpy reference (scale products such as d * sc rounded before they multiply the quant;
// no FMA contraction; f16 -> f32 exact). Each thread writes two float4, so a warp's stores are
// 1 KiB contiguous.
//
// strata_dequant_h_<qtype>(blocks, out, n_blocks): the same, each weight rounded to f16 (round to
//   nearest even; out of __half, 16-byte aligned): the prompt GEMM's operand (cuda/moe_gemm_ws.cu's
//   strata_moe_gemm_ws16_f16 over a chunk's dequantized weights), the very f16 values that
//   gemm_wide.cuh's decoders give the fused GEMMs.
//
// strata_dequant_h_groups_<qtype>(ptrs, part_offset, n_blocks, out, out_stride)
//   The f16 rows of one matrix in each of many blobs (a layer's experts): matrix g starts at
//   ptrs[g] + part_offset (n_blocks blocks, 16-byte aligned) and goes to out + g * out_stride
//   halves (16-byte aligned); a group whose ptrs[g] is 0 is skipped (its rows keep what they held).
//   Grid (x, groups): x blocks stride over each group's weights. Block types only.
//
// Launch: block = (256, 1, 1) is what the binding uses (any multiple of 32 is correct), grid =
// any size: threads stride over the work, so a grid capped below n_blocks * block_size / 8 / 256
// is still complete. No shared memory.

#include <cuda_fp16.h>

#include <cstdint>

#include "quant_blocks.cuh"

namespace {

using namespace strata_q;

// Eight weights to out (f32: two float4; f16: one 16-byte store of eight halves).
__device__ __forceinline__ void store8(float* out, const float* v) {
    float4* o = reinterpret_cast<float4*>(out);
    o[0] = make_float4(v[0], v[1], v[2], v[3]);
    o[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store8(__half* out, const float* v) {
    uint32_t h[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __half2 p = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
        h[i] = *reinterpret_cast<const uint32_t*>(&p);
    }
    *reinterpret_cast<uint4*>(out) = make_uint4(h[0], h[1], h[2], h[3]);
}
__device__ __forceinline__ void store1(float* out, float v) { *out = v; }
__device__ __forceinline__ void store1(__half* out, float v) { *out = __float2half_rn(v); }

template <class B, class TOut>
__device__ __forceinline__ void dequant_blocks(const uint8_t* __restrict__ blocks, TOut* __restrict__ out,
                                               long long n_blocks) {
    constexpr int kChunks = B::kWeights / 8;
    const long long total = n_blocks * kChunks;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += stride) {
        const long long b = t / kChunks;
        const int j = static_cast<int>(t - b * kChunks);
        float v[8];
        B::decode8(blocks + b * B::kBytes, j, v);
        store8(out + t * 8, v);
    }
}

template <class B>
__device__ __forceinline__ void dequant_h_groups(const unsigned long long* __restrict__ ptrs, long long part_offset,
                                                 long long n_blocks, __half* __restrict__ out, long long out_stride) {
    const unsigned long long base = ptrs[blockIdx.y];
    if (base == 0) return;
    const uint8_t* blocks = reinterpret_cast<const uint8_t*>(base + part_offset);
    dequant_blocks<B>(blocks, out + blockIdx.y * out_stride, n_blocks);
}

// Float types element by element: every shape works, whatever its alignment beyond the natural.
template <class Elem, class TOut>
__device__ __forceinline__ void dequant_elements(const uint8_t* __restrict__ data, TOut* __restrict__ out,
                                                 long long n) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
        store1(out + i, Elem::value(Elem::load(data + i * Elem::kBytes)));
}

}  // namespace

#define STRATA_DEQUANT(name, Block)                                                                    \
    extern "C" __global__ void strata_dequant_##name(const uint8_t* blocks, float* out, long long n_blocks) { \
        dequant_blocks<Block>(blocks, out, n_blocks);                                                  \
    }                                                                                                  \
    extern "C" __global__ void strata_dequant_h_##name(const uint8_t* blocks, __half* out, long long n_blocks) { \
        dequant_blocks<Block>(blocks, out, n_blocks);                                                  \
    }                                                                                                  \
    extern "C" __global__ void strata_dequant_h_groups_##name(const unsigned long long* ptrs, long long part_offset, \
                                                              long long n_blocks, __half* out, long long out_stride) { \
        dequant_h_groups<Block>(ptrs, part_offset, n_blocks, out, out_stride);                         \
    }

STRATA_DEQUANT(q4_0, BlockQ4_0)
STRATA_DEQUANT(q4_1, BlockQ4_1)
STRATA_DEQUANT(q5_0, BlockQ5_0)
STRATA_DEQUANT(q5_1, BlockQ5_1)
STRATA_DEQUANT(q8_0, BlockQ8_0)
STRATA_DEQUANT(q2_k, BlockQ2_K)
STRATA_DEQUANT(q3_k, BlockQ3_K)
STRATA_DEQUANT(q4_k, BlockQ4_K)
STRATA_DEQUANT(q5_k, BlockQ5_K)
STRATA_DEQUANT(q6_k, BlockQ6_K)
STRATA_DEQUANT(iq4_nl, BlockIQ4_NL)
STRATA_DEQUANT(iq4_xs, BlockIQ4_XS)

#define STRATA_DEQUANT_FLOAT(name, Elem)                                                               \
    extern "C" __global__ void strata_dequant_##name(const uint8_t* blocks, float* out, long long n_blocks) { \
        dequant_elements<Elem>(blocks, out, n_blocks);                                                 \
    }                                                                                                  \
    extern "C" __global__ void strata_dequant_h_##name(const uint8_t* blocks, __half* out, long long n_blocks) { \
        dequant_elements<Elem>(blocks, out, n_blocks);                                                 \
    }

STRATA_DEQUANT_FLOAT(f32, ElemF32)
STRATA_DEQUANT_FLOAT(f16, ElemF16)
STRATA_DEQUANT_FLOAT(bf16, ElemBF16)
