// MoE router: softmax over the experts, top-k, optional renormalization.
//
// strata_moe_route_f32(logits, ids, weights, T, E, A, norm_topk)
//   p = softmax(logits[t, :]) in f32 (x - max, expf, divided by the sum);
//   ids[t, :]  = the A experts of highest p, highest first, ties to the lower id (the order of
//                numpy's stable argsort of -p, which strata.backends.cpu.moe_route uses);
//   weights[t, :] = their p, divided by the sum of the A of them when norm_topk != 0.
// Ranking uses the same rounded p as the reference, so a tie made by rounding breaks the same way.
//
// Layout: logits [T, E] f32; ids [T, A] int32; weights [T, A] f32. E <= 512, 1 <= A <= min(E, 32).
//
// Launch: grid = (ceil(T / 4), 1, 1), block = (128, 1, 1): one warp per token, no shared memory.
// Each lane holds experts lane, lane + 32, ... in registers (E / 32 <= 16); top-k is A rounds of a
// warp-wide (p desc, id asc) argmax, the winner's lane striking it out. Lane a keeps pick a.

#include <cstdint>
#include "pdl.cuh"

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxPerLane = 16;  // E <= 512
constexpr float kTaken = -1.0f;  // below every probability

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    return v;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(128) strata_moe_route_f32(const float* __restrict__ logits,
                                                                       int* __restrict__ ids,
                                                                       float* __restrict__ weights, int T, int E,
                                                                       int A, int norm_topk) {
    STRATA_PDL_ENTRY();
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= T) return;  // the whole warp leaves together
    const float* x = logits + static_cast<int64_t>(t) * E;

    float p[kMaxPerLane];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int e = i * 32 + lane;
        p[i] = e < E ? x[e] : -INFINITY;
        mx = fmaxf(mx, p[i]);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        p[i] = i * 32 + lane < E ? expf(p[i] - mx) : 0.0f;
        sum += p[i];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) p[i] = i * 32 + lane < E ? p[i] / sum : kTaken;

    int my_id = 0;
    float my_p = 0.0f;
    for (int a = 0; a < A; ++a) {
        float best = kTaken - 1.0f;
        int best_id = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i)
            if (p[i] > best) best = p[i], best_id = i * 32 + lane;  // ascending ids: strict > keeps the lower
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(kFull, best, o);
            const int oid = __shfl_xor_sync(kFull, best_id, o);
            if (ob > best || (ob == best && oid < best_id)) best = ob, best_id = oid;
        }
        if ((best_id & 31) == lane) {
#pragma unroll
            for (int i = 0; i < kMaxPerLane; ++i)
                if (i == (best_id >> 5)) p[i] = kTaken;
        }
        if (lane == a) my_id = best_id, my_p = best;
    }
    const float total = warp_sum(lane < A ? my_p : 0.0f);
    if (lane < A) {
        ids[static_cast<int64_t>(t) * A + lane] = my_id;
        weights[static_cast<int64_t>(t) * A + lane] = norm_topk ? my_p / total : my_p;
    }
}
