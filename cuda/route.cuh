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

__device__ __forceinline__ float p_nan() { return __int_as_float(0x7fffffff); }

// Token t's A picks from its E <= 32 kPer logits x (the whole warp calls it): ids[t * A + a],
// weights[t * A + a]. kCoherent: read x past L1 (ld.global.cg), for logits that other blocks of the
// same grid wrote. route_token below picks kPer from E (the same picks and bits whatever kPer: the
// entries past E are never read and never win).
template <bool kCoherent, int kPer>
__device__ __forceinline__ void route_token_per(const float* __restrict__ x, int* __restrict__ ids,
                                                float* __restrict__ weights, int t, int E, int A, int norm_topk) {
    const int lane = threadIdx.x & 31;
    float p[kPer];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
        const int e = i * 32 + lane;
        p[i] = e < E ? (kCoherent ? __ldcg(x + e) : x[e]) : -INFINITY;
        mx = fmaxf(mx, p[i]);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
        p[i] = i * 32 + lane < E ? expf(p[i] - mx) : 0.0f;
        sum += p[i];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < kPer; ++i) p[i] = i * 32 + lane < E ? p[i] / sum : kTaken;

    // Each round's argmax in two warp reductions (redux.sync, sm_80+): the largest key, then the lowest
    // id among the lanes holding it. key = p's bits + 2 for p >= 0 (a non-negative float's bits order as
    // its value), 1 for NaN (after every number, lowest id first, as the reference's stable argsort of
    // -p puts them), 0 for a taken entry or one past E, which never wins (A <= E leaves one each round).
    int my_id = 0;
    float my_p = 0.0f;
    for (int a = 0; a < A; ++a) {
        unsigned key = 0, id = 0x7fffffffu;
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
            const unsigned k = p[i] >= 0.0f ? __float_as_uint(p[i]) + 2u : (p[i] == kTaken ? 0u : 1u);
            if (k > key) key = k, id = i * 32 + lane;  // ascending ids: strict > keeps the lower
        }
        const unsigned top = __reduce_max_sync(kFull, key);
        const int best_id = static_cast<int>(__reduce_min_sync(kFull, key == top ? id : 0x7fffffffu));
        const float best = top > 1u ? __uint_as_float(top - 2u) : (top ? p_nan() : kTaken - 1.0f);
        if (top && (best_id & 31) == lane) {
#pragma unroll
            for (int i = 0; i < kPer; ++i)
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

template <bool kCoherent>
__device__ __forceinline__ void route_token(const float* __restrict__ x, int* __restrict__ ids,
                                            float* __restrict__ weights, int t, int E, int A, int norm_topk) {
    if (E <= 128)
        route_token_per<kCoherent, 4>(x, ids, weights, t, E, A, norm_topk);
    else if (E <= 256)
        route_token_per<kCoherent, 8>(x, ids, weights, t, E, A, norm_topk);
    else
        route_token_per<kCoherent, kMaxPerLane>(x, ids, weights, t, E, A, norm_topk);
}

}  // namespace strata_route
