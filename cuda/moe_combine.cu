// MoE combine: the weighted sum of the active experts' outputs plus the residual.
//
// strata_moe_combine_f32(residual, expert_out, rows, weights, out, T, A, D)
//   out[t, d] = residual[t, d] + sum_{a < A} weights[t, a] * expert_out[row(t, a), d]
//   row(t, a) = rows[t * A + a] when rows is not null (expert outputs grouped by expert, as the
//   prompt path's grouped GEMMs leave them), else t * A + a (decode: [T, A, D]).
// Layout: residual, out [T, D]; expert_out [*, D]; weights [T, A]; rows [T * A] int32; all
// row-major f32 except rows. out may alias residual (the same thread reads, then writes).
// The sum runs over a in order with FMAs, then adds the residual.
//
// Launch: grid = (ceil(D / 256), min(T, 65535), 1), block = (256, 1, 1); blocks stride over tokens.
// Memory-bound: reads A + 1 rows and writes one per token, coalesced.

#include <cstdint>

extern "C" __global__ void __launch_bounds__(256) strata_moe_combine_f32(const float* residual,
                                                                         const float* __restrict__ expert_out,
                                                                         const int* __restrict__ rows,
                                                                         const float* __restrict__ weights, float* out,
                                                                         int T, int A, int D) {
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
        float acc = 0.0f;
        for (int a = 0; a < A; ++a) {
            const int64_t k = t * A + a;
            const int64_t row = rows != nullptr ? rows[k] : k;
            acc = fmaf(weights[k], expert_out[row * D + d], acc);
        }
        out[t * D + d] = residual[t * D + d] + acc;
    }
}
