// Argmax over the rows of a logits matrix: the greedy sampler's pick.
//
// strata_argmax_f32(logits, out, V)
//   out[b] = the lowest index of the largest value of logits[b, :] (numpy's argmax: a NaN counts
//   as the largest, so the first NaN wins).
// Layout: logits [B, V] row-major f32, out [B] int32.
//
// Launch: grid = (B, 1, 1), block = (1024, 1, 1) (any multiple of 32 up to 1024 is correct). Each
// thread scans a strided slice (16-byte loads when V % 4 == 0 and the pointer is 16-byte aligned)
// keeping its first best, then a warp-shuffle and a shared-memory round pick the block's best with
// ties to the lower index. One row is 0.6 MB at V = 151936: one block moves it in a few us.

#include <cstdint>
#include "pdl.cuh"

namespace {

constexpr unsigned kFull = 0xffffffffu;

// (a, ia) beats (b, ib): NaN first, then the larger value, then the lower index.
__device__ __forceinline__ bool beats(float a, int ia, float b, int ib) {
    const bool na = isnan(a), nb = isnan(b);
    if (na != nb) return na;
    if (!na && a != b) return a > b;
    return ia < ib;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(1024) strata_argmax_f32(const float* __restrict__ logits,
                                                                     int* __restrict__ out, int V) {
    STRATA_PDL_ENTRY();
    __shared__ float best_s[32];
    __shared__ int idx_s[32];
    const float* x = logits + static_cast<int64_t>(blockIdx.x) * V;
    // start below every entry: -inf at index INT_MAX loses to any real entry, -inf included
    float best = -INFINITY;
    int best_i = 0x7fffffff;
    auto take = [&](float v, int i) {
        if (beats(v, i, best, best_i)) best = v, best_i = i;
    };
    if (V % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(x);
        for (int j = threadIdx.x; j < V / 4; j += blockDim.x) {
            const float4 v = x4[j];
            take(v.x, 4 * j), take(v.y, 4 * j + 1), take(v.z, 4 * j + 2), take(v.w, 4 * j + 3);
        }
    } else {
        for (int i = threadIdx.x; i < V; i += blockDim.x) take(x[i], i);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(kFull, best, o);
        const int oi = __shfl_xor_sync(kFull, best_i, o);
        if (beats(ob, oi, best, best_i)) best = ob, best_i = oi;
    }
    if (lane == 0) best_s[warp] = best, idx_s[warp] = best_i;
    __syncthreads();
    if (warp == 0) {
        const int num_warps = blockDim.x >> 5;
        best = lane < num_warps ? best_s[lane] : -INFINITY;
        best_i = lane < num_warps ? idx_s[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(kFull, best, o);
            const int oi = __shfl_xor_sync(kFull, best_i, o);
            if (beats(ob, oi, best, best_i)) best = ob, best_i = oi;
        }
        if (lane == 0) out[blockIdx.x] = best_i;
    }
}
