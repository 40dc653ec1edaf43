// f32 GEMM against a weight matrix stored row by row: the prompt path's projections, run on a
// weight dequantized (bit-exact) into scratch.
//
// strata_gemm_f32_nt(A, B, C, M, N, K, lda, ldb, ldc)
//   C[m * ldc + j] = sum_k A[m * lda + k] * B[j * ldb + k]     m < M (tokens), j < N (weight rows)
// i.e. C = A B^T with A [M, K] activations and B [N, K] a weight in numpy order (n innermost).
// f32 FMAs, k ascending within each 16-wide tile; C must not overlap A or B. Any M, N, K >= 1.
//
// Launch: grid = (ceil(N / 64), ceil(M / 64), 1), block = (256, 1, 1), no dynamic shared memory.
// A block computes a 64 x 64 tile of C. Per step of 16 k, each thread stages 4 values of A and 4 of
// B (transposed, so compute reads are conflict-free) into shared memory, then accumulates a 4 x 4
// register tile: rows ty + 16 i, columns tx + 16 j. Plain FP32 FFMA, roughly a sixth of the chip's
// FP32 peak; the tensor-core version (f16/bf16 or int8 operands) is the next step for long prompts.

#include <cstdint>

namespace {
constexpr int kBM = 64, kBN = 64, kBK = 16;
}

extern "C" __global__ void __launch_bounds__(256) strata_gemm_f32_nt(
    const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K,
    long long lda, long long ldb, long long ldc) {
    __shared__ float As[kBK][kBM + 4];
    __shared__ float Bs[kBK][kBN + 4];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN;
    const int load_row = tid >> 2, load_k = (tid & 3) * 4;   // 64 rows x 16 k, 4 per thread
    const float* a_row = A + static_cast<long long>(m0 + load_row) * lda;
    const float* b_row = B + static_cast<long long>(n0 + load_row) * ldb;
    const bool a_ok = m0 + load_row < M, b_ok = n0 + load_row < N;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < K; k0 += kBK) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int k = k0 + load_k + i;
            As[load_k + i][load_row] = a_ok && k < K ? a_row[k] : 0.0f;
            Bs[load_k + i][load_row] = b_ok && k < K ? b_row[k] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < kBK; ++k) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = As[k][ty + 16 * i], b[i] = Bs[k][tx + 16 * i];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int m = m0 + ty + 16 * i;
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = n0 + tx + 16 * j;
            if (n < N) C[static_cast<long long>(m) * ldc + n] = acc[i][j];
        }
    }
}
