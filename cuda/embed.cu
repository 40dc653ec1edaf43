// Embedding lookup straight from the table's native block bytes: dequantize only the rows asked for.
//
// strata_embed_<type>(table, ids, out, T, n), type in f32, f16, bf16, q8_0, q6_k
//   out[t, :] = dequantize(row ids[t] of the [rows, n] table), f32
// Layout: table is the flat block bytes of a row-major [rows, n] matrix in ggml's layout for the
// type (row r at r * row_bytes; row_bytes = n * 4, n * 2, n / 32 * 34, n / 256 * 210); ids [T]
// int32 in device memory, 0 <= id < rows (the caller checks); out [T, n] f32.
// Arithmetic is strata.quant.dequant's, product by product in f32, so results are bit-identical:
//   Q8_0 (34 B / 32): d f16 | qs int8[32];            w = d * q
//   Q6_K (210 B / 256): ql[128] | qh[64] | sc int8[16] | d f16; q = low4 | top2 << 4, w = (d * sc) * (q - 32)
// Fields are read bytewise: blocks of 34 and 210 bytes leave 16-bit fields only 2-byte aligned.
//
// Launch: grid = (T, 1, 1), block = (256, 1, 1); one block per token, each thread writes the
// weights j, j + 256, ... of the row (coalesced stores). No shared memory.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include "pdl.cuh"

namespace {

__device__ __forceinline__ float f16_at(const uint8_t* p) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(p[0] | (p[1] << 8))));
}

__device__ __forceinline__ float q8_0_weight(const uint8_t* row, int j) {
    const uint8_t* block = row + (j / 32) * 34;
    return __fmul_rn(f16_at(block), static_cast<float>(static_cast<int8_t>(block[2 + j % 32])));
}

__device__ __forceinline__ float q6_k_weight(const uint8_t* row, int j) {
    const uint8_t* block = row + (j / 256) * 210;
    const int w = j % 256, half = w / 128, k = w % 128;        // k: weight within its half
    const uint8_t* ql = block + 64 * half;
    const uint8_t* qh = block + 128 + 32 * half;
    const int low = k < 64 ? (ql[k] & 0x0F) : (ql[k - 64] >> 4);
    const int top = (qh[k % 32] >> (2 * (k / 32))) & 0x3;
    const float sc = static_cast<float>(static_cast<int8_t>(block[192 + w / 16]));
    const float dl = __fmul_rn(f16_at(block + 208), sc);
    return __fmul_rn(dl, static_cast<float>((low | (top << 4)) - 32));
}

struct F32 {
    __device__ static constexpr int64_t row_bytes(int n) { return int64_t{4} * n; }
    __device__ static float weight(const uint8_t* row, int j) { return reinterpret_cast<const float*>(row)[j]; }
};
struct F16 {
    __device__ static constexpr int64_t row_bytes(int n) { return int64_t{2} * n; }
    __device__ static float weight(const uint8_t* row, int j) {
        return __half2float(reinterpret_cast<const __half*>(row)[j]);
    }
};
struct BF16 {
    __device__ static constexpr int64_t row_bytes(int n) { return int64_t{2} * n; }
    __device__ static float weight(const uint8_t* row, int j) {
        return __uint_as_float(static_cast<unsigned>(reinterpret_cast<const unsigned short*>(row)[j]) << 16);
    }
};
struct Q8_0 {
    __device__ static constexpr int64_t row_bytes(int n) { return int64_t{n / 32} * 34; }
    __device__ static float weight(const uint8_t* row, int j) { return q8_0_weight(row, j); }
};
struct Q6_K {
    __device__ static constexpr int64_t row_bytes(int n) { return int64_t{n / 256} * 210; }
    __device__ static float weight(const uint8_t* row, int j) { return q6_k_weight(row, j); }
};

template <class Type>
__device__ __forceinline__ void embed_rows(const uint8_t* __restrict__ table, const int* __restrict__ ids,
                                           float* __restrict__ out, int T, int n) {
    const int t = blockIdx.x;
    if (t >= T) return;
    const uint8_t* row = table + ids[t] * Type::row_bytes(n);
    float* o = out + static_cast<int64_t>(t) * n;
    for (int j = threadIdx.x; j < n; j += blockDim.x) o[j] = Type::weight(row, j);
}

}  // namespace

#define STRATA_EMBED(NAME, TYPE)                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                 \
        strata_embed_##NAME(const uint8_t* table, const int* ids, float* out, int T, int n) {          \
        STRATA_PDL_ENTRY();                                                                            \
        embed_rows<TYPE>(table, ids, out, T, n);                                                       \
    }
STRATA_EMBED(f32, F32)
STRATA_EMBED(f16, F16)
STRATA_EMBED(bf16, BF16)
STRATA_EMBED(q8_0, Q8_0)
STRATA_EMBED(q6_k, Q6_K)
#undef STRATA_EMBED
