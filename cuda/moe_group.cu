// Grouping of a prompt chunk's (token, expert) slots by expert, on the device: the tables the
// grouped expert GEMMs (cuda/moe_gemm.cu) and the combine (cuda/moe_combine.cu) read, so a resident
// layer's experts run without the routing coming to the host.
//
// strata_moe_group(ids, S, A, E, tokens, rows, starts, tiles, max_tiles, bm)  signature "PiiiPPPPii"
//   ids [S] int32, slot s = t * A + a holds token t's a-th expert, every id in [0, E).
//   Sorted order: the slots by expert, ascending, and by slot inside an expert (a stable sort).
//   tokens [S] int32: tokens[r] = the token (s / A) of the slot at sorted row r.
//   rows [S] int32:   rows[s] = the sorted row of slot s (moe_combine's `rows`).
//   starts [E + 1] int32: expert e's sorted rows are [starts[e], starts[e + 1]) (starts[E] = S).
//   tiles [max_tiles] int4 (g, s0, m, 0): expert e's rows [start_e, start_e + count_e) cut into
//     bm-row tiles at tile indices e + floor(start_e / bm) + j, j < ceil(count_e / bm); every
//     other index below max_tiles is (0, 0, 0, 0), a tile moe_gemm skips (m = 0). The indices of
//     expert e end at or below e + 1 + floor((start_e + count_e) / bm), where e + 1's begin, so
//     no two experts meet and E + floor(S / bm) <= max_tiles indices suffice (the grid of the
//     GEMMs is that worst case: no count comes back to the host).
//
// Launch: grid = (E + 1, 1, 1), block = (kThreads, 1, 1). Block e < E counts the ids below e and
// equal to e (its start and count: no atomics, so the tables are the same every run), then walks
// the slots in order, kThreads at a time, placing its expert's slots with a ballot prefix; it
// writes its tile range. Block E clears the tiles past the last expert's range. Each block reads
// ids twice (L2-resident after the first block): 2 S x 4 bytes per block, ~5 us a layer at S = 32768.

#include <cstdint>

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ int warp_sum(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    return v;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads) strata_moe_group(const int* __restrict__ ids, int S, int A,
                                                                        int E, int* __restrict__ tokens,
                                                                        int* __restrict__ rows, int* __restrict__ starts,
                                                                        int4* __restrict__ tiles, int max_tiles, int bm) {
    __shared__ int part[2][kWarps];
    __shared__ int warp_hits[kWarps];
    const int e = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (e == E) {
        if (tid == 0) starts[E] = S;
        for (int i = E + S / bm + tid; i < max_tiles; i += kThreads) tiles[i] = make_int4(0, 0, 0, 0);
        return;
    }
    int below = 0, mine = 0;
    for (int s = tid; s < S; s += kThreads) {
        const int v = __ldg(ids + s);
        below += v < e;
        mine += v == e;
    }
    below = warp_sum(below);
    mine = warp_sum(mine);
    if (lane == 0) part[0][warp] = below, part[1][warp] = mine;
    __syncthreads();
    int start = 0, count = 0;
    for (int w = 0; w < kWarps; ++w) start += part[0][w], count += part[1][w];
    if (tid == 0) starts[e] = start;

    int placed = 0;
    for (int s0 = 0; s0 < S && placed < count; s0 += kThreads) {   // placed and count: block-uniform
        const int s = s0 + tid;
        const bool hit = s < S && __ldg(ids + s) == e;
        const unsigned ballot = __ballot_sync(kFull, hit);
        if (lane == 0) warp_hits[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, round = 0;
        for (int w = 0; w < kWarps; ++w) {
            before += w < warp ? warp_hits[w] : 0;
            round += warp_hits[w];
        }
        if (hit) {
            const int r = start + placed + before + __popc(ballot & ((1u << lane) - 1u));
            tokens[r] = s / A;
            rows[s] = r;
        }
        placed += round;
        __syncthreads();   // warp_hits is rewritten next round
    }

    const int t0 = e + start / bm, t1 = e + 1 + (start + count) / bm;
    for (int i = t0 + tid; i < t1; i += kThreads) {
        const int j = (i - t0) * bm;
        tiles[i] = j < count ? make_int4(e, start + j, min(bm, count - j), 0) : make_int4(0, 0, 0, 0);
    }
}
