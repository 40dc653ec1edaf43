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
// warp-wide (p desc, id asc) argmax, the winner's lane striking it out. Lane a keeps pick a. The
// warp's code is cuda/route.cuh's, which the router GEMV that routes in its last block shares
// (cuda/gemv.cu's strata_router_*).

#include <cstdint>
#include "pdl.cuh"
#include "route.cuh"

extern "C" __global__ void __launch_bounds__(128) strata_moe_route_f32(const float* __restrict__ logits,
                                                                       int* __restrict__ ids,
                                                                       float* __restrict__ weights, int T, int E,
                                                                       int A, int norm_topk) {
    STRATA_PDL_ENTRY();
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= T) return;  // the whole warp leaves together
    strata_route::route_token<false>(logits + static_cast<int64_t>(t) * E, ids, weights, t, E, A, norm_topk);
}
