// A question for #16, asked outside the engine: does a decode GEMV get nearer the copy rate when its
// block moves its share of W into shared memory BEFORE griddepcontrol.wait, while the kernel before it
// still runs? (The 23rd session's L2 prefetch before the wait lost: the engine's kernels fill the
// register file at 2 blocks an SM, so a dependent block cannot be resident until the previous
// kernel's blocks leave, too late for a prefetch to lead anything.) Here each block takes at most half
// an SM (<= 128 registers x 256 threads, <= ~100 KB of shared memory), so the next kernel's block fits
// beside it, and asks for its weights with cp.async.bulk on mbarriers as soon as it is resident.
//
// Kernels (Q8_0 rows, the engine's UnitQ8_0 arithmetic: lane l takes blocks l, l + 32, ... of a row,
// then the warp's shuffle tree; so every kernel here gives the same bits):
//   bench_plain_q8(W, x, y, rows, n)           the engine's shape: wait, launch dependents, x staged in
//                                              shared memory, a warp 4 rows at once from global memory
//   bench_plain1_q8(W, x, y, rows, n)          the same, a warp 1 row at a time
//   bench_stage_q8(W, x, y, rows, n, rpb, early) block b takes rows [b * rpb, +rpb) whole into shared
//                                              memory in 4 chunks (one mbarrier each); early = 1: the
//                                              copies are asked before griddepcontrol.wait (and the
//                                              dependents launched first), 0: after it
//   bench_plain1s_q8(W, x, y, rows, n, seg_rows)  bench_plain1_q8 over segments: row r reads x + (r / seg_rows)
//                                              * n (the MoE down projection's 8 experts, each its own x)
//   bench_small(x, y, n)                       a latency-bound step between GEMVs (y = x * 1.0001), as
//                                              the decode step's norms and ropes are
//   bench_small_early(x, y, n)                 the same, launch_dependents before its wait
//   bench_persist_q8(phases, nphases, bar, early, err)
//                                              the whole chain in ONE launch (the persistent decode
//                                              kernel's question, 37th session): every block resident
//                                              (grid = SMs x blocks an SM), the phases (GEMVs one row a
//                                              warp as bench_plain1_q8, small steps as bench_small)
//                                              separated by a grid barrier on a counter; early = 1: a
//                                              warp asks for its next GEMV's first row of W into
//                                              registers BEFORE it arrives at the barrier (past small
//                                              steps between), so those bytes stream while the phase
//                                              ends; 0: after it
// Dynamic shared memory: plain n / 32 * 36 * 4; stage 64 + n / 32 * 36 * 4 + rpb * n / 32 * 34.
// Driven by tools/pdl_chain_bench.py.
#include <cstdint>

#include "gemv_units.cuh"
#include "quant_blocks.cuh"

using namespace strata_q;

namespace {

constexpr int kThreads = 256, kWarps = 8, kChunks = 4, kXStride = 36;

__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// x [n] into xs, 32 values a Q8_0 block padded to 36 (lanes' float4 reads meet no bank twice). kL2: x was
// written earlier in this launch (the persistent chain), so read through the L2, not the read-only path.
template <bool kL2 = false>
__device__ __forceinline__ void stage_x(const float* __restrict__ x, int n, float* xs) {
    for (int i = threadIdx.x; i < n / 4; i += kThreads) {
        const int j = 4 * i, b = j / 32;
        const float4* p = reinterpret_cast<const float4*>(x) + i;
        *reinterpret_cast<float4*>(xs + b * kXStride + (j - 32 * b)) = kL2 ? __ldcg(p) : __ldg(p);
    }
}

__device__ __forceinline__ void x_of(const float* xs, int b, UnitQ8_0::X& xv) {
    const float4* p = reinterpret_cast<const float4*>(xs + b * kXStride);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float4 f = p[k];
        xv.v[4 * k] = f.x, xv.v[4 * k + 1] = f.y, xv.v[4 * k + 2] = f.z, xv.v[4 * k + 3] = f.w;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// UnitQ8_0::load's Raw from shared memory (its loads go through the read-only global path).
__device__ __forceinline__ void load_q8_shared(const uint8_t* blk, UnitQ8_0::Raw& r) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(blk);  // 2-byte aligned: 34-byte blocks
    r.d = h[0];
#pragma unroll
    for (int k = 0; k < 8; ++k) r.q[k] = static_cast<uint32_t>(h[1 + 2 * k]) | static_cast<uint32_t>(h[2 + 2 * k]) << 16;
}

// Rows [r, r + R) of a row-major Q8_0 matrix at W (row_bytes a row), x staged at xs: y[r + i].
template <int R, bool Shared>
__device__ __forceinline__ void rows_dot(const uint8_t* W, long long row_bytes, int nb, const float* xs, int nrows,
                                         float (&acc)[R]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.f;
    for (int b = lane; b < nb; b += 32) {
        UnitQ8_0::Raw raw[R];
#pragma unroll
        for (int i = 0; i < R; ++i)
            if (i < nrows) {
                if constexpr (Shared)
                    load_q8_shared(W + i * row_bytes + 34LL * b, raw[i]);
                else
                    UnitQ8_0::load(W + i * row_bytes + 34LL * b, 0, raw[i]);
            }
        UnitQ8_0::X xv;
        x_of(xs, b, xv);
#pragma unroll
        for (int i = 0; i < R; ++i)
            if (i < nrows) acc[i] += UnitQ8_0::dot(raw[i], 0, xv, nullptr);
    }
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = warp_sum(acc[i]);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ bool bar_ready(uint32_t bar) {
    uint32_t ok;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(bar)
        : "memory");
    return ok != 0;
}

}  // namespace

template <int R>
__device__ __forceinline__ void plain_body(const uint8_t* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,
                                           int rows, int n) {
    pdl_wait();
    pdl_launch();
    extern __shared__ float xs[];
    stage_x(x, n, xs);
    __syncthreads();
    const int nb = n / 32, warp = blockIdx.x * kWarps + (threadIdx.x >> 5), warps = gridDim.x * kWarps;
    const long long row_bytes = 34LL * nb;
    for (int r = R * warp; r < rows; r += R * warps) {
        float acc[R];
        const int nr = min(R, rows - r);
        rows_dot<R, false>(W + r * row_bytes, row_bytes, nb, xs, nr, acc);
        if ((threadIdx.x & 31) == 0)
            for (int i = 0; i < nr; ++i) y[r + i] = acc[i];
    }
}

extern "C" __global__ void __launch_bounds__(kThreads, 2)
    bench_plain_q8(const uint8_t* __restrict__ W, const float* __restrict__ x, float* __restrict__ y, int rows, int n) {
    plain_body<4>(W, x, y, rows, n);
}
extern "C" __global__ void __launch_bounds__(kThreads, 2)
    bench_plain1_q8(const uint8_t* __restrict__ W, const float* __restrict__ x, float* __restrict__ y, int rows, int n) {
    plain_body<1>(W, x, y, rows, n);
}

// bench_plain1_q8 over segments (the MoE down projection's shape: 8 experts' rows, each expert reading its
// own x): row r reads x + (r / seg_rows) * n. A block's 8 rows lie in one segment (seg_rows % 8 == 0).
extern "C" __global__ void __launch_bounds__(kThreads, 2)
    bench_plain1s_q8(const uint8_t* __restrict__ W, const float* __restrict__ x, float* __restrict__ y, int rows, int n,
                     int seg_rows) {
    pdl_wait();
    pdl_launch();
    extern __shared__ float seg_xs[];   // (not xs: a C-linkage declaration of that name would clash with plain_body's)
    stage_x(x + static_cast<long long>(blockIdx.x * kWarps / seg_rows) * n, n, seg_xs);
    __syncthreads();
    const int nb = n / 32, r = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (r < rows) {
        float acc[1];
        rows_dot<1, false>(W + r * 34LL * nb, 34LL * nb, nb, seg_xs, 1, acc);
        if ((threadIdx.x & 31) == 0) y[r] = acc[0];
    }
}

extern "C" __global__ void __launch_bounds__(kThreads, 2)
    bench_stage_q8(const uint8_t* __restrict__ W, const float* __restrict__ x, float* __restrict__ y, int rows, int n,
                   int rpb, int early) {
    extern __shared__ __align__(128) uint8_t smem[];
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem);
    const int nb = n / 32;
    float* xs = reinterpret_cast<float*>(smem + 64);
    uint8_t* ws = smem + 64 + nb * kXStride * 4;
    const long long row_bytes = 34LL * nb;
    const int r0 = blockIdx.x * rpb, nr = max(0, min(rpb, rows - r0)), per = (nr + kChunks - 1) / kChunks;
    if (early) {
        pdl_launch();
    } else {
        pdl_wait();
        pdl_launch();
    }
    if (threadIdx.x == 0) {
        for (int c = 0; c < kChunks; ++c)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bars + c)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        for (int c = 0; c < kChunks; ++c) {
            const int a = min(nr, c * per), b = min(nr, a + per);
            const uint32_t bytes = static_cast<uint32_t>((b - a) * row_bytes), bar = smem_addr(bars + c);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
            if (bytes)
                asm volatile(
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                        smem_addr(ws + a * row_bytes)),
                    "l"(W + (r0 + a) * row_bytes), "r"(bytes), "r"(bar)
                    : "memory");
        }
    }
    if (early) pdl_wait();
    stage_x(x, n, xs);
    __syncthreads();  // x staged, barriers initialized
    const int warp = threadIdx.x >> 5;
    for (int i = 4 * warp; i < nr; i += 4 * kWarps) {
        const int cnt = min(4, nr - i);
        for (int c = i / per; c <= (i + cnt - 1) / per; ++c)
            while (!bar_ready(smem_addr(bars + c))) {
            }
        float acc[4];
        rows_dot<4, true>(ws + i * row_bytes, row_bytes, nb, xs, cnt, acc);
        if ((threadIdx.x & 31) == 0)
            for (int k = 0; k < cnt; ++k) y[r0 + i + k] = acc[k];
    }
}

extern "C" __global__ void __launch_bounds__(kThreads) bench_small(const float* __restrict__ x, float* __restrict__ y, int n) {
    pdl_wait();
    pdl_launch();
    for (int i = blockIdx.x * kThreads + threadIdx.x; i < n; i += gridDim.x * kThreads) y[i] = x[i] * 1.0001f;
}
// The same, letting its dependents launch before its own wait: the next kernel's blocks become resident
// (and may start their copies) as soon as this one's are, not once the kernel before this one is done.
extern "C" __global__ void __launch_bounds__(kThreads) bench_small_early(const float* __restrict__ x, float* __restrict__ y, int n) {
    pdl_launch();
    pdl_wait();
    for (int i = blockIdx.x * kThreads + threadIdx.x; i < n; i += gridDim.x * kThreads) y[i] = x[i] * 1.0001f;
}

// ---- the chain in one launch ------------------------------------------------------------------------
// A phase: long long [6] = {W (0: a small step), src, dst, rows (GEMV) or n (small), n, seg_rows (0: one x;
// else bench_plain1s_q8's segments, rows % 8 == 0 and seg_rows % 8 == 0)}. src was written
// by an earlier phase of this launch, so it is read through the L2 (ld.global.cg), never the read-only
// path; W is never written, so its loads keep __ldg.
namespace {

constexpr int kMaxLaneBlocks = 4;       // n <= 32 * 32 * 4 = 4096
constexpr int kPhase = 6;               // a phase's fields

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Sense by generation: a block reads the generation, arrives; the last arrival resets the count and
// publishes the next generation. bar[0] the count, bar[32] the generation (another 128-byte line).
__device__ __forceinline__ void grid_barrier(unsigned* bar, unsigned blocks, int* err) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned* count = bar;
        unsigned* gen = bar + 32;
        const unsigned g = ld_acquire(gen);
        __threadfence();
        if (atomicAdd(count, 1u) == blocks - 1) {
            atomicExch(count, 0u);
            __threadfence();
            asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(gen), "r"(g + 1) : "memory");
        } else {
            long long spins = 0;
            while (ld_acquire(gen) == g) {
                if (++spins > (1LL << 26)) {        // not every block resident: say so, do not hang
                    atomicExch(err, 1);
                    break;
                }
            }
        }
    }
    __syncthreads();
}

struct LaneRow {
    UnitQ8_0::Raw raw[kMaxLaneBlocks];
};

__device__ __forceinline__ void load_lane_row(const uint8_t* row, int nb, LaneRow& r) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < kMaxLaneBlocks; ++i)
        if (lane + 32 * i < nb) UnitQ8_0::load(row + 34LL * (lane + 32 * i), 0, r.raw[i]);
}

// rows_dot<1>'s sums in its order: acc += dot over blocks lane, lane + 32, ..., then the shuffle tree
__device__ __forceinline__ float lane_row_dot(const LaneRow& r, int nb, const float* xs) {
    const int lane = threadIdx.x & 31;
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxLaneBlocks; ++i)
        if (lane + 32 * i < nb) {       // UnitQ8_0::dot's two chains, x read from shared memory in place
            const float* xb = xs + (lane + 32 * i) * kXStride;
            float even = 0.f, odd = 0.f;
#pragma unroll
            for (int k = 0; k < 8; k += 2) {
                even = dot4_int8(r.raw[i].q[k], xb + 4 * k, even);
                odd = dot4_int8(r.raw[i].q[k + 1], xb + 4 * k + 4, odd);
            }
            acc += f16_bits(r.raw[i].d) * (even + odd);
        }
    return warp_sum(acc);
}


__device__ __forceinline__ void persist_body(const long long* __restrict__ phases, int nphases, unsigned* bar,
                                             int early, int* err) {
    extern __shared__ float xs[];
    const int warp = blockIdx.x * kWarps + (threadIdx.x >> 5), warps = gridDim.x * kWarps;
    LaneRow next;
    int ahead = -1;                          // the GEMV phase whose first row of this warp `next` holds
    for (int p = 0; p < nphases; ++p) {
        const long long* ph = phases + kPhase * p;
        const uint8_t* W = reinterpret_cast<const uint8_t*>(ph[0]);
        const float* src = reinterpret_cast<const float*>(ph[1]);
        float* dst = reinterpret_cast<float*>(ph[2]);
        const int rows = static_cast<int>(ph[3]), n = static_cast<int>(ph[4]), nb = n / 32;
        const int seg_rows = static_cast<int>(ph[5]);
        if (W == nullptr) {                  // a small step: bench_small's arithmetic
            for (int i = blockIdx.x * kThreads + threadIdx.x; i < rows; i += gridDim.x * kThreads)
                dst[i] = __ldcg(src + i) * 1.0001f;
        } else {                             // a GEMV: bench_plain1_q8's rows, or bench_plain1s_q8's
            const long long row_bytes = 34LL * nb;
            for (int r0 = blockIdx.x * kWarps; r0 < rows; r0 += warps) {    // the same trips for a whole block
                if (r0 == blockIdx.x * kWarps || seg_rows > 0) {           // x once, or each pass's segment
                    if (seg_rows > 0) __syncthreads();                     // the last pass's readers are done
                    stage_x<true>(src + (seg_rows > 0 ? static_cast<long long>(r0 / seg_rows) * n : 0LL), n, xs);
                    __syncthreads();
                }
                const int r = r0 + (threadIdx.x >> 5);
                if (r < rows) {
                    if (!(ahead == p && r == warp)) load_lane_row(W + r * row_bytes, nb, next);
                    const float y = lane_row_dot(next, nb, xs);
                    if ((threadIdx.x & 31) == 0) dst[r] = y;
                }
            }
            if (ahead == p) ahead = -1;
        }
        if (p + 1 == nphases) break;
        if (early && ahead < 0) {            // the next GEMV's first row of this warp (past any small steps
            int q = p + 1;                   // between), asked for before the barrier
            while (q < nphases && phases[kPhase * q] == 0) ++q;
            const long long* nx = phases + kPhase * q;
            if (q < nphases && warp < static_cast<int>(nx[3])) {
                load_lane_row(reinterpret_cast<const uint8_t*>(nx[0]) + warp * 34LL * (nx[4] / 32),
                              static_cast<int>(nx[4] / 32), next);
                ahead = q;
            }
        }
        grid_barrier(bar, gridDim.x, err);
    }
}

}  // namespace

// 4 blocks an SM (64 registers: a few bytes spill) and 3 (no spill; fewer warps than q|k|v has rows)
extern "C" __global__ void __launch_bounds__(kThreads, 4)
    bench_persist_q8(const long long* __restrict__ phases, int nphases, unsigned* bar, int early, int* err) {
    persist_body(phases, nphases, bar, early, err);
}
extern "C" __global__ void __launch_bounds__(kThreads, 3)
    bench_persist3_q8(const long long* __restrict__ phases, int nphases, unsigned* bar, int early, int* err) {
    persist_body(phases, nphases, bar, early, err);
}
