// Embedding lookup straight from the table's native block bytes: dequantize only the rows asked for.
//
// strata_embed_<type>(table, ids, out, T, n), type: every type strata.quant reads (f32 f16 bf16
// q4_0 q4_1 q5_0 q5_1 q8_0 q2_k q3_k q4_k q5_k q6_k iq4_nl iq4_xs)
//   out[t, :] = dequantize(row ids[t] of the [rows, n] table), f32
// Layout: table is the flat block bytes of a row-major [rows, n] matrix in ggml's layout for the
// type, 16-byte aligned (row r at r * row_bytes, row_bytes = n / block_size * type_size: a row of
// a 2-byte aligned type such as Q3_K's 110 bytes may start anywhere 2-byte aligned, which the
// decoders of quant_blocks.cuh take, since a block still starts a multiple of its size from the
// table's start); ids [T] int32 in device memory, 0 <= id < rows (the caller checks); out [T, n]
// f32, 16-byte aligned for the block types (n is then a multiple of 32).
// Arithmetic: the block types decode with quant_blocks.cuh's exact decode8 (strata.quant.dequant's
// float32 operations, bit for bit); the float types convert exactly.
//
// Launch: grid = (T, 1, 1), block = (256, 1, 1); one block per token. A float type's thread writes
// the weights j, j + 256, ... of the row; a block type's thread decodes 8 weights c*8 .. c*8+7 for
// c = thread, thread + 256, ... and stores them as two float4 (a warp's stores are 1 KiB
// contiguous). No shared memory.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include "pdl.cuh"
#include "quant_blocks.cuh"

namespace {

using namespace strata_q;

template <class Elem>
__device__ __forceinline__ void embed_elements(const uint8_t* __restrict__ table, const int* __restrict__ ids,
                                               float* __restrict__ out, int T, int n) {
    const int t = blockIdx.x;
    if (t >= T) return;
    const uint8_t* row = table + static_cast<int64_t>(ids[t]) * n * Elem::kBytes;
    float* o = out + static_cast<int64_t>(t) * n;
    for (int j = threadIdx.x; j < n; j += blockDim.x) o[j] = Elem::value(Elem::load(row + j * Elem::kBytes));
}

template <class B>
__device__ __forceinline__ void embed_blocks(const uint8_t* __restrict__ table, const int* __restrict__ ids,
                                             float* __restrict__ out, int T, int n) {
    constexpr int kChunks = B::kWeights / 8;          // 8-weight chunks per block
    const int t = blockIdx.x;
    if (t >= T) return;
    const int num_blocks = n / B::kWeights;
    const uint8_t* row = table + static_cast<int64_t>(ids[t]) * num_blocks * B::kBytes;
    float* o = out + static_cast<int64_t>(t) * n;
    for (int c = threadIdx.x; c < num_blocks * kChunks; c += blockDim.x) {
        float v[8];
        B::decode8(row + (c / kChunks) * B::kBytes, c % kChunks, v);
        float4* dst = reinterpret_cast<float4*>(o + 8 * c);
        dst[0] = make_float4(v[0], v[1], v[2], v[3]);
        dst[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

}  // namespace

#define STRATA_EMBED(NAME, BODY, TYPE)                                                                \
    extern "C" __global__ void __launch_bounds__(256)                                                 \
        strata_embed_##NAME(const uint8_t* table, const int* ids, float* out, int T, int n) {          \
        STRATA_PDL_ENTRY();                                                                            \
        BODY<TYPE>(table, ids, out, T, n);                                                             \
    }
STRATA_EMBED(f32, embed_elements, ElemF32)
STRATA_EMBED(f16, embed_elements, ElemF16)
STRATA_EMBED(bf16, embed_elements, ElemBF16)
STRATA_EMBED(q4_0, embed_blocks, BlockQ4_0)
STRATA_EMBED(q4_1, embed_blocks, BlockQ4_1)
STRATA_EMBED(q5_0, embed_blocks, BlockQ5_0)
STRATA_EMBED(q5_1, embed_blocks, BlockQ5_1)
STRATA_EMBED(q8_0, embed_blocks, BlockQ8_0)
STRATA_EMBED(q2_k, embed_blocks, BlockQ2_K)
STRATA_EMBED(q3_k, embed_blocks, BlockQ3_K)
STRATA_EMBED(q4_k, embed_blocks, BlockQ4_K)
STRATA_EMBED(q5_k, embed_blocks, BlockQ5_K)
STRATA_EMBED(q6_k, embed_blocks, BlockQ6_K)
STRATA_EMBED(iq4_nl, embed_blocks, BlockIQ4_NL)
STRATA_EMBED(iq4_xs, embed_blocks, BlockIQ4_XS)
#undef STRATA_EMBED
