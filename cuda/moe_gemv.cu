// Decode GEMV over routed experts, the expert picked by ids in DEVICE memory: routing never waits
// for the host, so one launch shape serves every step (and a CUDA graph can replay it).
//
// strata_moe_gemv_<qtype>(ptrs, part_offset, ids, x, x_div, y, rows, n)
//   for slot s = blockIdx.y (one per (token, active expert) pair, s = t * A + a):
//     W_s = ptrs[ids[s]] + part_offset             the expert's [rows, n] matrix in block bytes
//     y[s * rows + r] = sum_k W_s[r, k] * x[(s / x_div) * n + k]
//   ptrs is the layer's row of the expert table in DEVICE memory: each expert's blob, in VRAM (a
//   cache slot) or in mapped pinned host memory (read over the bus, zero-copy); the engine changes
//   entries between steps and a captured graph follows. part_offset places the part in a blob, so
//   gate and up (x_div = A: every slot of token t reads x row t) and down (x_div = 1: slot s reads
//   the SwiGLU row s) are the same kernel. With gate and up stored back to back in one type, rows
//   = 2I computes both at once.
// Layout: as strata_gemv_<qtype> (cuda/gemv.cu): W rows of n / block_size blocks, 16-byte aligned
// (blob addresses and the part offset are multiples of 16); x [*, n] and y [slots, rows] f32,
// 16-byte aligned; n a multiple of the block size. ids [slots] int32 < the layer's expert count.
//
// Algorithm: gemv.cu's single-token body, the same code (gemv_rows.cuh, gemv_units*.cuh): a lane
// owns units (32 or 64 weights of a quant type, 8 of a float type) of kRows rows at once and reuses
// its x values for all of them; `lanes` lanes share one row set, partial sums meet through shuffles.
// Launch: grid = (row-set groups, slots, 1), block = (128, 1, 1); the warps of a slot stride over
// row sets, so any grid.x is complete. strata/backends/cuda/memory.py sizes grid.x to one row set
// per warp.

#include <cstdint>

#include "gemv_rows.cuh"
#include "gemv_units.cuh"
#include "gemv_units_k.cuh"
#include "quant_blocks.cuh"

namespace {

using namespace strata_q;
using namespace strata_gemv;

constexpr int kWarps = 4;

// The slot's expert matrix, input row and output row.
struct Slot {
    const uint8_t* W;
    const float* x;
    float* y;
};

__device__ __forceinline__ Slot slot_of(const unsigned long long* ptrs, long long part_offset, const int* ids,
                                        const float* x, int x_div, float* y, int rows, int n) {
    const int s = blockIdx.y;
    const uint8_t* blob = reinterpret_cast<const uint8_t*>(ptrs[ids[s]]);
    return {blob + part_offset, x + static_cast<long long>(s / x_div) * n,
            y + static_cast<long long>(s) * rows};
}

}  // namespace

#define STRATA_MOE_GEMV_ARGS                                                                           \
    const unsigned long long *ptrs, long long part_offset, const int *ids, const float *x, int x_div, float *y, \
        int rows, int n

#define STRATA_MOE_GEMV(name, Unit)                                                                    \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_moe_gemv_##name(STRATA_MOE_GEMV_ARGS) { \
        const Slot s = slot_of(ptrs, part_offset, ids, x, x_div, y, rows, n);                          \
        gemv_body<kWarps, Unit>(s.W, s.x, s.y, rows, n, nullptr);                                      \
    }

STRATA_MOE_GEMV(q4_0, UnitQ4_0)
STRATA_MOE_GEMV(q4_1, UnitQ4_1)
STRATA_MOE_GEMV(q5_0, UnitQ5_0)
STRATA_MOE_GEMV(q5_1, UnitQ5_1)
STRATA_MOE_GEMV(q8_0, UnitQ8_0)
STRATA_MOE_GEMV(q2_k, UnitQ2_K)
STRATA_MOE_GEMV(q3_k, UnitQ3_K)
STRATA_MOE_GEMV(q4_k, UnitQ4_K)
STRATA_MOE_GEMV(q5_k, UnitQ5_K)
STRATA_MOE_GEMV(q6_k, UnitQ6_K)

// IQ4 types read their 16-value codebook from shared memory; every thread reaches the barrier.
#define STRATA_MOE_GEMV_IQ4(name, Unit)                                                                \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_moe_gemv_##name(STRATA_MOE_GEMV_ARGS) { \
        __shared__ float table[16];                                                                    \
        fill_iq4_table(table);                                                                         \
        const Slot s = slot_of(ptrs, part_offset, ids, x, x_div, y, rows, n);                          \
        gemv_body<kWarps, Unit>(s.W, s.x, s.y, rows, n, table);                                        \
    }

STRATA_MOE_GEMV_IQ4(iq4_nl, UnitIQ4_NL)
STRATA_MOE_GEMV_IQ4(iq4_xs, UnitIQ4_XS)

// Float types: 8 weights per unit when n % 8 == 0, else one; the branch is uniform.
#define STRATA_MOE_GEMV_FLOAT(name, Block, Elem)                                                       \
    extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_moe_gemv_##name(STRATA_MOE_GEMV_ARGS) { \
        const Slot s = slot_of(ptrs, part_offset, ids, x, x_div, y, rows, n);                          \
        if (n % 8 == 0)                                                                                \
            gemv_body<kWarps, UnitFloat8<Block>>(s.W, s.x, s.y, rows, n, nullptr);                     \
        else                                                                                           \
            gemv_body<kWarps, UnitFloat1<Elem>>(s.W, s.x, s.y, rows, n, nullptr);                      \
    }

STRATA_MOE_GEMV_FLOAT(f32, BlockF32x8, ElemF32)
STRATA_MOE_GEMV_FLOAT(f16, BlockF16x8, ElemF16)
STRATA_MOE_GEMV_FLOAT(bf16, BlockBF16x8, ElemBF16)
