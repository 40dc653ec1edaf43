// Row copy with an optional gather: the data movement of concat, row slices and grouping tokens by
// expert, and the kernel the device copy rate is measured with.
//
// strata_gather_rows_f32(src, rows, dst, R, n, src_ld, dst_ld)
//   dst[i * dst_ld + c] = src[r(i) * src_ld + c]   for i < R, c < n
//   r(i) = rows[i] when rows is not null (int32 in device memory), else i.
// Layout: row-major f32 with leading dimensions in elements; src and dst must not overlap.
//
// Launch: grid = (any, min(R, 65535), 1), block = (256, 1, 1); blocks stride over the columns
// (x) and the rows (y), so any grid is complete. When n, both leading dimensions and both pointers
// are multiples of 4 floats (16 bytes) the copy moves float4s: a large copy (R = 1) runs at the
// device's copy rate, which strata.engine.cuda_runner.measure_limits reports.
//
// strata_gather_rows_f16(src, rows, dst, R, n, src_ld, dst_ld): the same gather into f16 rows, each value
//   rounded to nearest even (dst_ld in halves): the prompt GEMMs' X, rounded once where
//   cuda/moe_gemm_ws.cu's f16-X entry points read it (the trial path wgmma-gemm-f16x). With n and both
//   leading dimensions multiples of 4 and 16-byte aligned src, 8-byte aligned dst, it moves 4 values a thread.

#include <cuda_fp16.h>

#include <cstdint>

namespace {

// Four values of a row, moved or rounded to f16.
__device__ __forceinline__ void put4(float* d, long long c, float4 v) { reinterpret_cast<float4*>(d)[c] = v; }
__device__ __forceinline__ void put4(__half* d, long long c, float4 v) {
    const __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
    reinterpret_cast<uint2*>(d)[c] = make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}
__device__ __forceinline__ void put(float* d, long long c, float v) { d[c] = v; }
__device__ __forceinline__ void put(__half* d, long long c, float v) { d[c] = __float2half_rn(v); }

// vec: n, both leading dimensions multiples of 4, src 16-byte and dst 4 * sizeof(Out)-byte aligned.
template <class Out>
__device__ __forceinline__ void gather_rows(const float* __restrict__ src, const int* __restrict__ rows, Out* __restrict__ dst,
                                            int R, long long n, long long src_ld, long long dst_ld) {
    const bool vec = n % 4 == 0 && src_ld % 4 == 0 && dst_ld % 4 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0 &&
                     (reinterpret_cast<uintptr_t>(dst) & (4 * sizeof(Out) - 1)) == 0;
    const long long col0 = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long col_step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (int i = blockIdx.y; i < R; i += gridDim.y) {
        const long long r = rows ? rows[i] : i;
        const float* s = src + r * src_ld;
        Out* d = dst + static_cast<long long>(i) * dst_ld;
        if (vec) {
            for (long long c = col0; c < n / 4; c += col_step) put4(d, c, reinterpret_cast<const float4*>(s)[c]);
        } else {
            for (long long c = col0; c < n; c += col_step) put(d, c, s[c]);
        }
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256) strata_gather_rows_f32(
    const float* __restrict__ src, const int* __restrict__ rows, float* __restrict__ dst, int R, long long n,
    long long src_ld, long long dst_ld) {
    gather_rows(src, rows, dst, R, n, src_ld, dst_ld);
}

extern "C" __global__ void __launch_bounds__(256) strata_gather_rows_f16(
    const float* __restrict__ src, const int* __restrict__ rows, __half* __restrict__ dst, int R, long long n,
    long long src_ld, long long dst_ld) {
    gather_rows(src, rows, dst, R, n, src_ld, dst_ld);
}
