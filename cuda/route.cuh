// The MoE router's softmax and top-k for one token, by one warp: cuda/moe_route.cu's kernel and the
// router GEMV that routes in its last block (cuda/gemv.cu's strata_router_*) run this same code, so
// their ids and weights are the same bits. The contract is moe_route.cu's header.
#pragma once

#include <cstdint>

namespace strata_route {

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

// Token t's A picks from its E logits x (the whole warp calls it): ids[t * A + a], weights[t * A + a].
// kCoherent: read x past L1 (ld.global.cg), for logits that other blocks of the same grid wrote.
template <bool kCoherent>
__device__ __forceinline__ void route_token(const float* __restrict__ x, int* __restrict__ ids,
                                            float* __restrict__ weights, int t, int E, int A, int norm_topk) {
    const int lane = threadIdx.x & 31;
    float p[kMaxPerLane];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int e = i * 32 + lane;
        p[i] = e < E ? (kCoherent ? __ldcg(x + e) : x[e]) : -INFINITY;
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

}  // namespace strata_route
