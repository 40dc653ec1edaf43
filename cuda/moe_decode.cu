// Routed experts of one layer for a few decode tokens in two launches, each expert's blob found
// through a device-side pointer table (a VRAM cache slot or mapped pinned host memory, read with
// plain global loads, so a CUDA graph follows table changes between steps).
//
// strata_moe_gate_up_<qtype>(ptrs, gate_off, up_off, ids, x, h, A, I, D)
//   for token t = blockIdx.y, slot s = t * A + a (a < A), e = ids[s], blob = ptrs[e]:
//     g = gate_e[r] . x[t], u = up_e[r] . x[t]          gate_e row r at blob + gate_off + r * row_bytes(D)
//     h[s * I + r] = g / (1 + expf(-g)) * u               (cuda/swiglu.cu's formula), r < I
// strata_moe_down_<qtype>(ptrs, down_off, ids, h, weights, out, A, D, I)
//   out[t * D + d] = fmaf over a = 0..A-1 in order of weights[s] * (down_e[d] . h[s]), from 0
//   (down_e row d at blob + down_off + d * row_bytes(I)); no atomics, so the result is deterministic.
// strata_moe_gate_up_route_<qtype>(ptrs, gate_off, up_off, ids, x, h, A, I, D, logits, weights, E, norm_topk)
//   the same h, with token t's routing made in each of its blocks: warp 0 picks the top A of logits
//   [T, E] (E <= 512) with cuda/route.cuh's code (strata_moe_route_f32's: the same ids and weights, bit for
//   bit) into shared memory before the body, and block (0, t) writes them to ids [T, A] and weights
//   [T, A] (the down kernel's inputs). A decode step's top-k then costs no launch of its own; every block
//   routes (a warp's few hundred cycles, before its weight addresses are known) while its other warps
//   copy the E table entries to shared memory.
//
// Each row's dot product is strata_moe_gemv_<qtype>'s (cuda/moe_gemv.cu): the same units
// (gemv_units*.cuh), the same lane of the row for each unit (lanes = the power of two >= units per
// row, at most 32; lane l takes units l, l + lanes, ... in order) and the same shuffle tree. So g
// and u are bit for bit that kernel's, h is bit for bit moe_gemv + swiglu, and out is bit for bit
// moe_gemv + moe_combine with a zero residual (but for the sign of a zero sum).
//
// Layout: blob + gate_off, blob + down_off and blob + up_off 16-byte aligned, or up directly after
// gate (up_off = gate_off + I * row_bytes(D), one fused [2I, D] matrix). Rows are ggml block rows
// (n a multiple of the block size; any n for F32/F16/BF16). x [T, D], h [T * A, I], out [T, D]
// f32 row-major, x and h 16-byte aligned; ids [T * A] int32, weights [T * A] f32, ptrs [E] u64.
// 1 <= A <= 8.
//
// Work split: block (bx, t) holds token t's x row (or its A rows of h) in shared memory, staged
// once with coalesced 16-byte loads and laid out unit by unit, padded 16 bytes per unit, so each
// lane's 16-byte reads of its unit's x values are conflict-free. Warp w serves expert a = w % A
// (8 / A warps per expert). A row's lanes form a subgroup (32 / lanes per warp); a row set is one
// subgroup's job rows for each subgroup: kPairs gate/up pairs, or 2 * kPairs down rows. The sets
// of a matrix are cut into gridDim.x chunks; warp part p = w / A takes sets p, p + 8 / A, ... of
// its block's chunk. When a lane's units of a row fit in registers (kHold; always at Qwen3-30B
// sizes) the lane loads its x values once and keeps them for every row; the first set's weight
// loads are issued before the staging barrier, and each next set's right after the current one's
// dot products, so a warp has a set's weights in flight while it computes (a Q4_K gate/up pair: 2.3 KB).
// Down: warps write their A partial results of each set to shared memory, a batch of rounds
// (as many as the block's partial-row buffer holds: 16 for a Q4_K row of 768) without a barrier
// between them; after the batch's barrier the block sums them per row in the fixed order a = 0..A-1.
//
// Launch: block = (256, 1, 1), at most 128 registers a thread (2 blocks per SM); grid = (any gx >= 1, T, 1), every gx is complete and gives the
// same bits; strata/backends/cuda/moe_decode.py picks gx (about 2 blocks per SM). Dynamic shared
// memory: staged_floats * 4 bytes (staged_floats = D for gate_up, A * I for down, each row padded
// 4 floats per unit of 8/32/64 weights; not padded for a float type with n % 8 != 0). With less
// (0), the kernels read x straight from global memory (slower, same bits).

#include <cstdint>

#include "gemv_units.cuh"
#include "gemv_units_k.cuh"
#include "quant_blocks.cuh"
#include "pdl.cuh"
#include "route.cuh"

namespace {

using namespace strata_q;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxActive = 8;   // A <= 8: warp w serves expert w % A
constexpr int kMaxRouted = 512; // E <= 512 where the blocks route (cuda/route.cuh's kMaxPerLane * 32)

__device__ __forceinline__ float sum_lanes(float v, int lanes) {  // within aligned groups of `lanes`
    for (int offset = lanes >> 1; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ int lanes_per_row(int units) {
    return units >= 32 ? 32 : 1 << (32 - __clz(max(units, 1) - 1));
}

__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}

// Per unit type: kPairs gate/up pairs per subgroup job (down: 2 * kPairs rows), kHold units per
// lane kept in registers (0: x is read per unit). Registers per lane: rows * kHold raw units and
// kHold X values; strata/backends/cuda/moe_decode.py mirrors this table (TILES).
template <class U> struct Tile;
#define STRATA_TILE(Unit, pairs, hold)                                                                 \
    template <> struct Tile<Unit> { static constexpr int kPairs = pairs, kHold = hold; };
STRATA_TILE(UnitQ4_0, 1, 2)
STRATA_TILE(UnitQ4_1, 1, 2)
STRATA_TILE(UnitQ5_0, 1, 2)
STRATA_TILE(UnitQ5_1, 1, 2)
STRATA_TILE(UnitQ8_0, 1, 2)
STRATA_TILE(UnitIQ4_NL, 1, 2)
STRATA_TILE(UnitQ2_K, 1, 1)
STRATA_TILE(UnitQ3_K, 1, 1)
STRATA_TILE(UnitQ4_K, 1, 1)
STRATA_TILE(UnitQ5_K, 1, 1)
STRATA_TILE(UnitQ6_K, 1, 1)
STRATA_TILE(UnitIQ4_XS, 1, 1)
STRATA_TILE(UnitFloat8<BlockF32x8>, 1, 4)
STRATA_TILE(UnitFloat8<BlockF16x8>, 1, 4)
STRATA_TILE(UnitFloat8<BlockBF16x8>, 1, 4)
STRATA_TILE(UnitFloat1<ElemF32>, 2, 0)
STRATA_TILE(UnitFloat1<ElemF16>, 2, 0)
STRATA_TILE(UnitFloat1<ElemBF16>, 2, 0)

// Staged x: unit u's kN values (in the order the unit's X holds them) at u * kStride floats.
// pos(j) = where weight j of a block goes, relative to the block's first unit.
template <class U>
struct Stage {
    static constexpr int kN = U::kBlockWeights / U::kUnits, kStride = kN == 1 ? 1 : kN + 4;
    static __device__ __forceinline__ int pos(int j) { return (j / kN) * kStride + j % kN; }
};
// Q2_K / Q3_K unit 2h + s holds x[128h + 32p + 16s + i] at 16p + i (load_x_runs).
__device__ __forceinline__ int runs16_pos(int j) {
    return (2 * (j >> 7) + ((j >> 4) & 1)) * 68 + 16 * ((j >> 5) & 3) + (j & 15);
}
template <> struct Stage<UnitQ2_K> : Stage<UnitQ4_K> {
    static __device__ __forceinline__ int pos(int j) { return runs16_pos(j); }
};
template <> struct Stage<UnitQ3_K> : Stage<UnitQ4_K> {
    static __device__ __forceinline__ int pos(int j) { return runs16_pos(j); }
};
// Q6_K unit 2h + a holds x[128h + 64q + 32a + l] at 32q + l.
template <> struct Stage<UnitQ6_K> : Stage<UnitQ4_K> {
    static __device__ __forceinline__ int pos(int j) {
        return (2 * (j >> 7) + ((j >> 5) & 1)) * 68 + 32 * ((j >> 6) & 1) + (j & 31);
    }
};

template <class U>
__device__ __forceinline__ int staged_floats(int n) {
    return n / U::kBlockWeights * U::kUnits * Stage<U>::kStride;
}

// Rows [0, num_rows) of src (leading dimension n) into xs, staged_floats(n) floats per row.
template <class U>
__device__ void stage_rows(const float* __restrict__ src, int num_rows, int n, float* xs) {
    using S = Stage<U>;
    const int row_floats = staged_floats<U>(n);
    if constexpr (S::kN == 1) {
        for (int i = threadIdx.x; i < num_rows * n; i += kThreads) xs[i] = src[i];
    } else {
        const int quads = n / 4;
        for (int i = threadIdx.x; i < num_rows * quads; i += kThreads) {
            const int row = i / quads, j = 4 * (i - row * quads);
            const int b = j / U::kBlockWeights, jb = j - b * U::kBlockWeights;
            const float4 v = __ldg(reinterpret_cast<const float4*>(src + static_cast<long long>(row) * n + j));
            *reinterpret_cast<float4*>(xs + row * row_floats + b * U::kUnits * S::kStride + S::pos(jb)) = v;
        }
    }
}

// The sums a unit's X carries, computed from its values exactly as its load_x does.
__device__ __forceinline__ void fill_sums(X32& x) { x.sum = sum_floats<32>(x.v); }
__device__ __forceinline__ void fill_sums(X64& x) {
    x.sum[0] = sum_floats<32>(x.v);
    x.sum[1] = sum_floats<32>(x.v + 32);
}
__device__ __forceinline__ void fill_sums(X64Runs& x) {
#pragma unroll
    for (int g = 0; g < 4; ++g) x.sum[g] = sum_floats<16>(x.v + 16 * g);
}
template <class X>
__device__ __forceinline__ void fill_sums(X&) {}

// Unit u's X from the staged row xs, or (staged == false) from the global row xg as U::load_x reads it.
template <class U>
__device__ __forceinline__ void load_unit_x(bool staged, const float* xs, const float* xg, int u, typename U::X& x) {
    using S = Stage<U>;
    if (!staged) {
        const int b = u / U::kUnits;
        U::load_x(xg + static_cast<long long>(b) * U::kBlockWeights, u - b * U::kUnits, x);
        return;
    }
    const float* p = xs + u * S::kStride;
    if constexpr (S::kN == 1) {
        x.v = p[0];
    } else {
#pragma unroll
        for (int k = 0; k < S::kN / 4; ++k) {
            const float4 f = reinterpret_cast<const float4*>(p)[k];
            x.v[4 * k] = f.x, x.v[4 * k + 1] = f.y, x.v[4 * k + 2] = f.z, x.v[4 * k + 3] = f.w;
        }
        fill_sums(x);
    }
}

// One lane's view of the rows it works on: its place in the row, the row length in units.
struct Lane {
    int lanes, sub, sl, units;
    long long row_bytes;
};

template <class U>
__device__ __forceinline__ Lane lane_of(int n) {
    const int num_blocks = n / U::kBlockWeights, units = num_blocks * U::kUnits;
    const int lanes = lanes_per_row(units), lane = threadIdx.x & 31;
    return {lanes, lane / lanes, lane & (lanes - 1), units, static_cast<long long>(num_blocks) * U::kBlockBytes};
}

// Held path: the lane's units sl + j * lanes (j < H) of Q rows, loaded all at once.
template <class U, int Q, int H>
__device__ __forceinline__ void load_held(const uint8_t* const (&row)[Q], const Lane& L, typename U::Raw (&raw)[Q][H]) {
#pragma unroll
    for (int j = 0; j < H; ++j) {
        const int u = L.sl + j * L.lanes;
        if (u < L.units) {
            const int b = u / U::kUnits, c = u - b * U::kUnits;
#pragma unroll
            for (int q = 0; q < Q; ++q) U::load(row[q] + static_cast<long long>(b) * U::kBlockBytes, c, raw[q][j]);
        }
    }
}

template <class U, int H>
__device__ __forceinline__ void load_held_x(bool staged, const float* xs, const float* xg, const Lane& L,
                                            typename U::X (&xv)[H]) {
#pragma unroll
    for (int j = 0; j < H; ++j) {
        const int u = L.sl + j * L.lanes;
        if (u < L.units) load_unit_x<U>(staged, xs, xg, u, xv[j]);
    }
}

// acc[q] = this lane's part of row q's dot product, its units taken in increasing order.
template <class U, int Q, int H>
__device__ __forceinline__ void dot_held(const typename U::Raw (&raw)[Q][H], const typename U::X (&xv)[H],
                                         const Lane& L, const float* table, float (&acc)[Q]) {
#pragma unroll
    for (int q = 0; q < Q; ++q) acc[q] = 0.f;
#pragma unroll
    for (int j = 0; j < H; ++j) {
        const int u = L.sl + j * L.lanes;
        if (u < L.units) {
            const int c = u % U::kUnits;
#pragma unroll
            for (int q = 0; q < Q; ++q) acc[q] += U::dot(raw[q][j], c, xv[j], table);
        }
    }
}

// Streaming path (a row has more units than the lane holds): x values per unit, shared by the Q rows.
template <class U, int Q>
__device__ __forceinline__ void dot_streaming(const uint8_t* const (&row)[Q], bool staged, const float* xs,
                                              const float* xg, const Lane& L, const float* table, float (&acc)[Q]) {
#pragma unroll
    for (int q = 0; q < Q; ++q) acc[q] = 0.f;
    for (int u = L.sl; u < L.units; u += L.lanes) {
        const int b = u / U::kUnits, c = u - b * U::kUnits;
        typename U::Raw raw[Q];
#pragma unroll
        for (int q = 0; q < Q; ++q) U::load(row[q] + static_cast<long long>(b) * U::kBlockBytes, c, raw[q]);
        typename U::X xv;
        load_unit_x<U>(staged, xs, xg, u, xv);
#pragma unroll
        for (int q = 0; q < Q; ++q) acc[q] += U::dot(raw[q], c, xv, table);
    }
}

// The block's chunk of row sets and this warp's expert and share of it.
struct Split {
    int begin, end, parts, part, a;
    bool busy;  // warps past A * (8 / A) serve no expert
};

__device__ __forceinline__ Split split_of(int num_sets, int A) {
    const int chunk = (num_sets + gridDim.x - 1) / gridDim.x, warp = threadIdx.x >> 5;
    const int begin = blockIdx.x * chunk, parts = kWarps / A;
    return {begin, min(begin + chunk, num_sets), parts, warp / A, warp % A, warp / A < parts};
}

// IQ4 codebook (read by the IQ4 units only) and the staged rows; every thread reaches the barrier.
template <class U>
__device__ __forceinline__ void stage_and_sync(float* table, const float* src, int num_rows, int n, float* xs,
                                               bool staged) {
    if (threadIdx.x < 16) table[threadIdx.x] = static_cast<float>(iq4_value(threadIdx.x));
    if (staged) stage_rows<U>(src, num_rows, n, xs);
    __syncthreads();
}

// ---- gate | up | SwiGLU ----------------------------------------------------------------------------

struct GateUp {
    const unsigned long long* ptrs;
    long long gate_off, up_off;
    const int* ids;     // the block's token's A ids (ids + t * A, or the block's own routing in shared memory)
    const float* x;
    float* h;
    int A, I, D;
};

template <int P>
__device__ __forceinline__ void swiglu_rows(const float (&acc)[2 * P], const Lane& L, float* h_row, int r0, int I) {
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const float g = sum_lanes(acc[p], L.lanes), u = sum_lanes(acc[P + p], L.lanes);
        if (L.sl == 0 && r0 + p < I) h_row[r0 + p] = g / (1.0f + expf(-g)) * u;
    }
}

template <class U>
__device__ void gate_up_body(const GateUp& k, float* table, float* xs) {
    constexpr int P = Tile<U>::kPairs, H = Tile<U>::kHold, Q = 2 * P;
    const Lane L = lane_of<U>(k.D);
    const int set_rows = (32 / L.lanes) * P, t = blockIdx.y;
    const Split sp = split_of((k.I + set_rows - 1) / set_rows, k.A);
    const long long s = static_cast<long long>(t) * k.A + sp.a;
    const uint8_t* blob = sp.busy ? reinterpret_cast<const uint8_t*>(k.ptrs[k.ids[sp.a]]) : nullptr;
    const float* xg = k.x + static_cast<long long>(t) * k.D;
    float* h_row = k.h + s * k.I;
    const bool staged = dynamic_smem_bytes() >= 4u * staged_floats<U>(k.D);
    const uint8_t* row[Q];
    auto point = [&](int set) {  // the job's rows; past the end: row I - 1, read but not written
        const int r0 = set * set_rows + L.sub * P;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const long long r = min(r0 + p, k.I - 1);
            row[p] = blob + k.gate_off + r * L.row_bytes;
            row[P + p] = blob + k.up_off + r * L.row_bytes;
        }
        return r0;
    };
    int set = sp.begin + sp.part;
    if constexpr (H > 0) {
        if (L.units <= H * L.lanes) {  // uniform over the block
            typename U::Raw raw[Q][H];
            if (sp.busy && set < sp.end) {
                point(set);
                load_held<U, Q, H>(row, L, raw);
            }
            stage_and_sync<U>(table, xg, 1, k.D, xs, staged);
            if (!sp.busy) return;
            typename U::X xv[H];
            load_held_x<U, H>(staged, xs, xg, L, xv);
            for (; set < sp.end; set += sp.parts) {
                float acc[Q];
                dot_held<U, Q, H>(raw, xv, L, table, acc);
                const int r0 = set * set_rows + L.sub * P;
                if (set + sp.parts < sp.end) {  // the next set's weights travel while this one is written
                    point(set + sp.parts);
                    load_held<U, Q, H>(row, L, raw);
                }
                swiglu_rows<P>(acc, L, h_row, r0, k.I);
            }
            return;
        }
    }
    stage_and_sync<U>(table, xg, 1, k.D, xs, staged);
    if (!sp.busy) return;
    for (; set < sp.end; set += sp.parts) {
        const int r0 = point(set);
        float acc[Q];
        dot_streaming<U, Q>(row, staged, xs, xg, L, table, acc);
        swiglu_rows<P>(acc, L, h_row, r0, k.I);
    }
}

// ---- down | weighted sum over the token's experts ------------------------------------------------

struct Down {
    const unsigned long long* ptrs;
    long long down_off;
    const int* ids;
    const float* h;
    const float* weights;
    float* out;
    int A, D, I;
};

// Rounds per barrier: ys holds the A partial rows of `batch` rounds of sets, round j at
// j * A * parts * set_rows floats (at least 1; for a Q4_K row of I = 768, 16 rounds).
__device__ __forceinline__ int rounds_per_batch(const Split& sp, int A, int set_rows, int capacity) {
    return max(1, capacity / (A * sp.parts * set_rows));
}

// After a batch's barrier: out rows of sets [base, base + parts * batch) from the A partial rows
// each round of the batch left in ys, summed over a = 0..A-1 in order.
__device__ __forceinline__ void combine_batch(const Down& k, const float* ys, int base, int batch, const Split& sp,
                                              int set_rows) {
    const int t = blockIdx.y, width = sp.parts * set_rows;
    const int rows = (min(base + sp.parts * batch, sp.end) - base) * set_rows;
    const float* w = k.weights + static_cast<long long>(t) * k.A;
    for (int i = threadIdx.x; i < rows; i += kThreads) {
        const int d = base * set_rows + i;
        if (d < k.D) {
            const int j = i / width;
            const float* y = ys + j * k.A * width + (i - j * width);
            float acc = 0.f;
            for (int a = 0; a < k.A; ++a) acc = fmaf(w[a], y[a * width], acc);
            k.out[static_cast<long long>(t) * k.D + d] = acc;
        }
    }
}

template <int R>
__device__ __forceinline__ void store_partials(const float (&acc)[R], const Lane& L, float* ys, const Split& sp,
                                               int set_rows, int round, int A) {
    const int width = sp.parts * set_rows;
    float* dst = ys + (round * A + sp.a) * width + sp.part * set_rows + L.sub * R;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float y = sum_lanes(acc[r], L.lanes);
        if (L.sl == 0) dst[r] = y;
    }
}

template <class U>
__device__ void down_body(const Down& k, float* table, float* xs) {
    constexpr int R = 2 * Tile<U>::kPairs, H = Tile<U>::kHold, kCapacity = kWarps * 32 * R;
    __shared__ float ys[kCapacity];  // [batch][A][parts * set_rows], A * parts <= 8, set_rows <= 32 R
    const Lane L = lane_of<U>(k.I);
    const int set_rows = (32 / L.lanes) * R, t = blockIdx.y;
    const Split sp = split_of((k.D + set_rows - 1) / set_rows, k.A);
    const int batch = rounds_per_batch(sp, k.A, set_rows, kCapacity);
    const long long s = static_cast<long long>(t) * k.A + sp.a;
    const uint8_t* base_w = sp.busy ? reinterpret_cast<const uint8_t*>(k.ptrs[k.ids[s]]) + k.down_off : nullptr;
    const float* hg = k.h + s * k.I;
    const int row_floats = staged_floats<U>(k.I);
    const bool staged = dynamic_smem_bytes() >= 4u * k.A * row_floats;
    const float* xs_a = xs + sp.a * row_floats;
    const uint8_t* row[R];
    auto point = [&](int set) {
        const int r0 = set * set_rows + L.sub * R;
#pragma unroll
        for (int r = 0; r < R; ++r) row[r] = base_w + static_cast<long long>(min(r0 + r, k.D - 1)) * L.row_bytes;
    };
    const float* h_t = k.h + static_cast<long long>(t) * k.A * k.I;
    // A warp's sets of a batch go without a barrier between them (its partial rows land in the
    // batch's own rounds of ys); the block meets once a batch to sum them.
    const int step = sp.parts * batch;
    if constexpr (H > 0) {
        if (L.units <= H * L.lanes) {  // uniform over the block
            typename U::Raw raw[R][H];
            int set = sp.begin + sp.part;
            bool mine = sp.busy && set < sp.end;
            if (mine) {
                point(set);
                load_held<U, R, H>(row, L, raw);
            }
            stage_and_sync<U>(table, h_t, k.A, k.I, xs, staged);
            typename U::X xv[H];
            if (sp.busy) load_held_x<U, H>(staged, xs_a, hg, L, xv);
            for (int base = sp.begin; base < sp.end; base += step) {
                for (int j = 0; j < batch && mine && set < base + step; ++j, set += sp.parts) {
                    float acc[R];
                    dot_held<U, R, H>(raw, xv, L, table, acc);
                    mine = set + sp.parts < sp.end;
                    if (mine) {  // the next set's weights travel while this one is stored
                        point(set + sp.parts);
                        load_held<U, R, H>(row, L, raw);
                    }
                    store_partials<R>(acc, L, ys, sp, set_rows, j, k.A);
                }
                __syncthreads();
                combine_batch(k, ys, base, batch, sp, set_rows);
                __syncthreads();
            }
            return;
        }
    }
    stage_and_sync<U>(table, h_t, k.A, k.I, xs, staged);
    for (int base = sp.begin; base < sp.end; base += step) {
        for (int j = 0; j < batch; ++j) {
            const int set = base + j * sp.parts + sp.part;
            if (sp.busy && set < sp.end) {
                point(set);
                float acc[R];
                dot_streaming<U, R>(row, staged, xs_a, hg, L, table, acc);
                store_partials<R>(acc, L, ys, sp, set_rows, j, k.A);
            }
        }
        __syncthreads();
        combine_batch(k, ys, base, batch, sp, set_rows);
        __syncthreads();
    }
}

// ---- the routing in gate|up's blocks (strata_moe_gate_up_route_<qtype>) ---------------------------

// Token t = blockIdx.y's top-A of its E logits by warp 0 (cuda/route.cuh, the code strata_moe_route_f32
// runs: the same ids and weights, bit for bit) into the block's shared ids_s / w_s; block (0, t) also
// writes them to ids / weights [T, A] for the down kernel and the host. Meanwhile the other warps copy the
// layer's E table entries into ptr_s, so no global read waits between the picks and the weights' loads.
// Every thread reaches the barrier.
__device__ __forceinline__ void route_block(const unsigned long long* ptrs, unsigned long long* ptr_s,
                                            const float* logits, int* ids, float* weights, int* ids_s, float* w_s,
                                            int A, int E, int norm_topk) {
    const int t = blockIdx.y, lane = threadIdx.x & 31;
    for (int e = threadIdx.x - 32; e >= 0 && e < E; e += kThreads - 32) ptr_s[e] = ptrs[e];
    if (threadIdx.x < 32) {
        strata_route::route_token<false>(logits + static_cast<long long>(t) * E, ids_s, w_s, 0, E, A, norm_topk);
        if (blockIdx.x == 0 && lane < A) {   // the lane that wrote entry `lane` reads it back
            ids[static_cast<long long>(t) * A + lane] = ids_s[lane];
            weights[static_cast<long long>(t) * A + lane] = w_s[lane];
        }
    }
    __syncthreads();
}

}  // namespace

#define STRATA_GATE_UP_ROUTE_ARGS                                                                      \
    const unsigned long long *ptrs, long long gate_off, long long up_off, int *ids, const float *x, float *h, \
        int A, int I, int D, const float *logits, float *weights, int E, int norm_topk
#define STRATA_GATE_UP_ARGS                                                                            \
    const unsigned long long *ptrs, long long gate_off, long long up_off, const int *ids, const float *x, float *h, \
        int A, int I, int D
#define STRATA_DOWN_ARGS                                                                               \
    const unsigned long long *ptrs, long long down_off, const int *ids, const float *h, const float *weights, \
        float *out, int A, int D, int I

#define STRATA_MOE_DECODE(name, GateUpUnit, DownUnit)                                                  \
    extern "C" __global__ void __launch_bounds__(kThreads, 2) strata_moe_gate_up_##name(STRATA_GATE_UP_ARGS) { \
        STRATA_PDL_ENTRY();                                                                            \
        __shared__ float table[16];                                                                    \
        extern __shared__ float4 staged_x[];                                                           \
        const GateUp k{ptrs, gate_off, up_off, ids + static_cast<long long>(blockIdx.y) * A, x, h, A, I, D}; \
        GateUpUnit;                                                                                    \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kThreads, 2)                                         \
        strata_moe_gate_up_route_##name(STRATA_GATE_UP_ROUTE_ARGS) {                                   \
        STRATA_PDL_ENTRY();                                                                            \
        __shared__ float table[16];                                                                    \
        __shared__ int ids_s[kMaxActive];                                                              \
        __shared__ float w_s[kMaxActive];                                                              \
        __shared__ unsigned long long ptr_s[kMaxRouted];                                               \
        extern __shared__ float4 staged_x[];                                                           \
        route_block(ptrs, ptr_s, logits, ids, weights, ids_s, w_s, A, E, norm_topk);                   \
        const GateUp k{ptr_s, gate_off, up_off, ids_s, x, h, A, I, D};                                 \
        GateUpUnit;                                                                                    \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kThreads, 2) strata_moe_down_##name(STRATA_DOWN_ARGS) {  \
        STRATA_PDL_ENTRY();                                                                            \
        __shared__ float table[16];                                                                    \
        extern __shared__ float4 staged_x[];                                                           \
        const Down k{ptrs, down_off, ids, h, weights, out, A, D, I};                                   \
        DownUnit;                                                                                      \
    }

#define STRATA_MOE_DECODE_QUANT(name, Unit)                                                            \
    STRATA_MOE_DECODE(name, gate_up_body<Unit>(k, table, reinterpret_cast<float*>(staged_x)),          \
                      down_body<Unit>(k, table, reinterpret_cast<float*>(staged_x)))

STRATA_MOE_DECODE_QUANT(q4_0, UnitQ4_0)
STRATA_MOE_DECODE_QUANT(q4_1, UnitQ4_1)
STRATA_MOE_DECODE_QUANT(q5_0, UnitQ5_0)
STRATA_MOE_DECODE_QUANT(q5_1, UnitQ5_1)
STRATA_MOE_DECODE_QUANT(q8_0, UnitQ8_0)
STRATA_MOE_DECODE_QUANT(iq4_nl, UnitIQ4_NL)
STRATA_MOE_DECODE_QUANT(q2_k, UnitQ2_K)
STRATA_MOE_DECODE_QUANT(q3_k, UnitQ3_K)
STRATA_MOE_DECODE_QUANT(q4_k, UnitQ4_K)
STRATA_MOE_DECODE_QUANT(q5_k, UnitQ5_K)
STRATA_MOE_DECODE_QUANT(q6_k, UnitQ6_K)
STRATA_MOE_DECODE_QUANT(iq4_xs, UnitIQ4_XS)

// Float types: 8-weight units when the row length (D for gate_up, I for down) is a multiple of 8,
// else single weights, as strata_moe_gemv_<float type>; the branch is uniform.
#define STRATA_MOE_DECODE_FLOAT(name, Block, Elem)                                                     \
    STRATA_MOE_DECODE(name,                                                                            \
                      if (D % 8 == 0) gate_up_body<UnitFloat8<Block>>(k, table, reinterpret_cast<float*>(staged_x)); \
                      else gate_up_body<UnitFloat1<Elem>>(k, table, reinterpret_cast<float*>(staged_x)),          \
                      if (I % 8 == 0) down_body<UnitFloat8<Block>>(k, table, reinterpret_cast<float*>(staged_x)); \
                      else down_body<UnitFloat1<Elem>>(k, table, reinterpret_cast<float*>(staged_x)))

STRATA_MOE_DECODE_FLOAT(f32, BlockF32x8, ElemF32)
STRATA_MOE_DECODE_FLOAT(f16, BlockF16x8, ElemF16)
STRATA_MOE_DECODE_FLOAT(bf16, BlockBF16x8, ElemBF16)
