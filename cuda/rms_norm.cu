// RMSNorm over the rows of a row-major f32 matrix.
//
// strata_rms_norm_f32(x, w, y, rows, n, eps)
//   y[r, i] = x[r, i] * rsqrt(mean_i(x[r, :]^2) + eps) * w[i]
//
// Layout: x and y are [rows, n] row-major f32 (row r starts at r * n), w is [n] f32.
// y may alias x (each element is read before it is written, by the same thread).
//
// Launch: grid = (rows, 1, 1), one block per row; block = (256, 1, 1) is what the
// binding uses, and any multiple of 32 up to 1024 is correct; no dynamic shared memory.
//
// Algorithm: each thread sums the squares of a strided slice of its row in f32 (16-byte loads
// when n % 4 == 0 and all three pointers are 16-byte aligned), the block reduces those sums with
// warp shuffles and one shared-memory pass, then every thread scales its slice. The second read of
// the row hits L1/L2 for n up to tens of thousands, so the kernel moves about 2 * rows * n * 4
// bytes through device memory. The arithmetic is cuda/norm_rope.cuh's, shared with the fused
// strata_add_rms_norm_f32 (cuda/decode_fused.cu).

#include <cstdint>

#include "norm_rope.cuh"
#include "pdl.cuh"

using namespace strata_norm;

extern "C" __global__ void strata_rms_norm_f32(const float* x, const float* __restrict__ w,
                                               float* y, int rows, int n, float eps) {
    STRATA_PDL_ENTRY();
    const int row = blockIdx.x;
    if (row >= rows) return;
    const float* xr = x + static_cast<int64_t>(row) * n;
    float* yr = y + static_cast<int64_t>(row) * n;
    // The whole block takes the same branch: the condition depends on launch arguments only.
    const bool vec = (n % 4 == 0) &&
                     ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w) |
                       reinterpret_cast<uintptr_t>(y)) % 16 == 0);

    float sum_sq = 0.0f;
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        for (int i = threadIdx.x; i < n / 4; i += blockDim.x) sum_sq += sum_sq4(x4[i]);
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) sum_sq += xr[i] * xr[i];
    }
    rms_apply_row(xr, w, yr, n, rms_scale(block_sum(sum_sq), n, eps), vec);
}
