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
// Launch: block = (256, 1, 1) is what the binding uses (any multiple of 32 is correct), grid =
// any size: threads stride over the work, so a grid capped below n_blocks * block_size / 8 / 256
// is still complete. No shared memory.

#include <cstdint>

#include "quant_blocks.cuh"

namespace {

using namespace strata_q;

template <class B>
__device__ __forceinline__ void dequant_blocks(const uint8_t* __restrict__ blocks, float* __restrict__ out,
                                               long long n_blocks) {
    constexpr int kChunks = B::kWeights / 8;
    const long long total = n_blocks * kChunks;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += stride) {
        const long long b = t / kChunks;
        const int j = static_cast<int>(t - b * kChunks);
        float v[8];
        B::decode8(blocks + b * B::kBytes, j, v);
        float4* o = reinterpret_cast<float4*>(out + t * 8);
        o[0] = make_float4(v[0], v[1], v[2], v[3]);
        o[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

// Float types element by element: every shape works, whatever its alignment beyond the natural.
template <class Elem>
__device__ __forceinline__ void dequant_elements(const uint8_t* __restrict__ data, float* __restrict__ out,
                                                 long long n) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = Elem::value(Elem::load(data + i * Elem::kBytes));
}

}  // namespace

#define STRATA_DEQUANT(name, Block)                                                                    \
    extern "C" __global__ void strata_dequant_##name(const uint8_t* blocks, float* out, long long n_blocks) { \
        dequant_blocks<Block>(blocks, out, n_blocks);                                                  \
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
    }

STRATA_DEQUANT_FLOAT(f32, ElemF32)
STRATA_DEQUANT_FLOAT(f16, ElemF16)
STRATA_DEQUANT_FLOAT(bf16, ElemBF16)
