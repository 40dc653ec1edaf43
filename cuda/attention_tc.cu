// Causal prompt attention on tensor cores (FlashAttention-2 with mma.sync), over an f16 KV cache.
// Same contract as strata_attention_prefill_f16_d<Dh> in attention.cu, so it can replace it.
//
// strata_attention_prefill_tc_f16_d<DH>(q, k_cache, v_cache, positions, out, T, H, Hk, scale), DH 64, 128 or 256
//   out[t, h, :] = softmax_c(scale * q[t, h] . k[c, h / G]) v[c, h / G] over cells c <= positions[t]
// q [T, H, DH] f32; caches [S, Hk, DH] f16 of one sequence (cell s of KV head k at (s * Hk + k) * DH),
// already holding cells 0..max(positions); positions [T] int32 in device memory, any values (a chunk
// sits at lo..lo+T-1 after earlier chunks' cells); out [T, H * DH] f32. G = H / Hk, 1..16 (any G
// with H % Hk == 0 works). Cells past max(positions) are never read (they may hold NaN).
//
// Launch: grid = (ceil(T * G / 64), Hk, 1), block = (128, 1, 1) at DH 64 and 128, (256, 1, 1) at DH
// 256, no dynamic shared memory; static shared memory 2 * 64 * (DH + 8) * 2 bytes (34816 at DH 128,
// 18432 at DH 64; 42048 at DH 256, see attention_prefill_tc_pairs), so no launch attribute is
// needed. DH 64 and 128 are built for 2 blocks per multiprocessor (195 registers at DH 128, sm_90): on
// an H200 that beat 3 blocks at 168 registers (which spills) by ~5%. DH 256 runs 1 block of 8 warps
// per multiprocessor (222 registers, no spills, sm_90 with nvcc 13.0 -O3): the same 8 warps an SM.
//
// Measured (H200, H 32 / Hk 4 / Dh 128, f16 K/V): 285 TFLOP/s of causal work for 4096 queries
// after 12288 cells (3.38 ms), 253 for 4096 at 0, 259 for 2048 after 2048, 77 for 512 at 0
// (0.028 ms: too few blocks to fill the GPU). A 16K-token prompt's 48 layers: ~0.37 s.
// DH 256 (Qwen3-Next-80B: H 16 / Hk 2) is not yet measured; tools/attention_tc_bench.py --shape 80b
// times it. Expected: below DH 128's rate (one block an SM, 32-cell tiles, so twice the barriers a
// cell), but ~10x the CUDA-core kernel's 18.9 TFLOP/s it replaces.
//
// Algorithm. A block owns 64 query rows of one KV head, taken from the flattened (token, head in
// group) list, so the G heads sharing a KV head share every K/V tile and the causal diagonal of a
// block is only 64 / G tokens wide. Each of the 4 warps owns 16 rows. Q is scaled by
// scale * log2(e), rounded to f16 and held as mma A fragments in registers for the whole block.
// K/V stream through shared memory in tiles of 64 cells (cp.async, rows padded by 8 halves so the
// ldmatrix reads are bank-conflict free); the V load of tile j overlaps S = Q K^T of tile j and the
// K load of tile j + 1 overlaps O += P V of tile j (FA2's interleave: one K and one V buffer). Per
// tile: S = Q K^T by mma.sync m16n8k16 (f16 in, f32 accumulate, K by ldmatrix), the causal mask by
// positions (only on tiles that reach past the smallest position of the block), the online softmax
// in f32 with ex2.approx.ftz (row max by quad shuffles, the row sum kept per thread and reduced once
// at the end), P rounded to f16 straight from the S accumulators into A fragments, and O += P V by mma.sync
// (V by ldmatrix.trans), O in f32 registers. Tiles past the block's largest position are skipped.
// Blocks run heaviest first (the last rows, which see the most cells, get the lowest block ids).
// Fixed summation order, no atomics: the result is deterministic. DH 256 splits each warp's work in
// two (attention_prefill_tc_pairs, below), with the same roundings and summation order per element.
//
// Precision, against a float64 softmax over the same f16 K/V, per (token, head): max|out - ref| <=
// 2e-3 * max|ref| for unit-variance q and k (scores of std ~1.4 in log2 units; ~7e-4 is typical),
// 6e-3 for 4x sharper scores (~3e-3 typical). The two f16 roundings dominate: q * scale * log2 e to
// f16 moves each score by ~2^-12 of |q . k| terms, i.e. each weight by ~3e-4 relative at unit
// variance and proportionally more for sharper scores; P to f16 moves each weight by <= 2^-11
// relative. Both average out over the cells; the f32 accumulations add ~1e-6. Inputs must keep
// |q * scale * log2 e| within f16 range (65504). The same bounds hold at every DH: a score's error
// from q's rounding grows as sqrt(DH) terms while scale = 1 / sqrt(DH) keeps the scores' spread, so
// relative to it the error is the same at DH 64, 128 and 256 (DH 256: to be confirmed by
// tests/kernels/test_attention_tc_gpu.py on the H200).

#include <cuda_fp16.h>

#include <cstdint>

namespace {

#include "attention_tc.cuh"

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// d += a b: m16n8k16, f16 inputs, f32 accumulators.
__device__ __forceinline__ void mma_f16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Tiles of CELLS cells of one KV head's cache rows (row_stride halves apart) into a shared tile of
// KS-half rows, by cp.async 16 bytes at a time: each thread copies one fixed 16-byte column of every
// (THREADS / CHUNKS)-th cell; cells at or past num_cells are zero-filled, never read.
template <int CELLS, int THREADS, int CHUNKS, int KS>
struct TileLoader {
    int64_t row_stride;
    int num_cells, c_first, part;
    __device__ __forceinline__ TileLoader(int64_t stride, int cells)
        : row_stride(stride), num_cells(cells), c_first(threadIdx.x / CHUNKS), part((threadIdx.x % CHUNKS) * 8) {}
    __device__ __forceinline__ void operator()(unsigned base, const __half* src, int cell0) const {
        constexpr int kStep = THREADS / CHUNKS;
        const __half* p = src + (cell0 + c_first) * row_stride + part;
        const unsigned dst = base + (c_first * KS + part) * 2;
#pragma unroll
        for (int it = 0; it < CELLS / kStep; ++it) {
            const bool valid = cell0 + c_first + it * kStep < num_cells;
            cp_async16(dst + it * kStep * KS * 2, valid ? p + it * kStep * row_stride : src, valid);
        }
        cp_async_commit();
    }
};

}  // namespace

template <int DH>
__device__ __forceinline__ void attention_prefill_tc(const float* __restrict__ q, const __half* __restrict__ k_cache,
                                                     const __half* __restrict__ v_cache,
                                                     const int* __restrict__ positions, float* __restrict__ out,
                                                     int T, int H, int Hk, float scale) {
    constexpr int KS = DH + 8;            // padded smem row, halves: 8 ldmatrix rows hit 8 distinct bank groups
    constexpr int KSTEPS = DH / 16;       // k-steps of Q K^T
    constexpr int DTILES = DH / 8;        // n-tiles of O
    constexpr int CTILES = kCells / 8;    // n-tiles of S
    constexpr int CHUNKS = DH / 8;        // 16-byte chunks per cache row
    __shared__ alignas(16) __half k_s[kCells][KS];
    __shared__ alignas(16) __half v_s[kCells][KS];
    __shared__ int pos_s[kWarps][2];

    const int kvh = blockIdx.y, G = H / Hk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gq = lane >> 2, tq = lane & 3;  // mma fragment row group and column pair
    const int64_t num_rows = static_cast<int64_t>(T) * G;
    const int64_t row0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kRows;  // heaviest first

    block_positions(positions, row0, num_rows, G, warp, lane, pos_s);   // no atomics: shuffles, then warps
    // this thread's two rows (gq and gq + 8 of its warp's 16): position (-1: past the end) and Q fragments
    int row_pos[2];
    unsigned qa[KSTEPS][4];
    const RowPlace rows{row0 + warp * 16 + gq, num_rows, G, H, kvh, DH};
    load_rows_q(q, positions, rows, tq, scale * kLog2e, row_pos, qa);
    __syncthreads();
    const Span span = block_span<kWarps>(pos_s);
    const int min_pos = span.min_pos, num_cells = span.num_cells;
    const int num_tiles = (num_cells + kCells - 1) / kCells;

    const int64_t row_stride = static_cast<int64_t>(Hk) * DH;
    const __half* kb = k_cache + static_cast<int64_t>(kvh) * DH;
    const __half* vb = v_cache + static_cast<int64_t>(kvh) * DH;
    const unsigned k_base = static_cast<unsigned>(__cvta_generic_to_shared(&k_s[0][0]));
    const unsigned v_base = static_cast<unsigned>(__cvta_generic_to_shared(&v_s[0][0]));
    const TileLoader<kCells, kThreads, CHUNKS, KS> load_tile{row_stride, num_cells};
    // ldmatrix lane addresses. K (non-trans): matrices (cells +0..7, dims +0..7), (+0..7, +8..15),
    // (+8..15, +0..7), (+8..15, +8..15) = b0, b1 of two cell n-tiles. V (trans): (cells +0..7, dims
    // +0..7), (+8..15, +0..7), (+0..7, +8..15), (+8..15, +8..15) = b0, b1 of two dim n-tiles.
    const unsigned k_lane = k_base + (((lane & 7) + ((lane >> 4) << 3)) * KS + ((lane >> 3) & 1) * 8) * 2;
    const unsigned v_lane = v_base + (((lane & 7) + ((lane >> 3) & 1) * 8) * KS + (lane >> 4) * 8) * 2;

    float o[DTILES][4];
#pragma unroll
    for (int n = 0; n < DTILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    load_tile(k_base, kb, 0);
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int cell0 = tile * kCells;
        cp_async_wait_all();
        __syncthreads();  // K(tile) landed; every warp is done with V(tile - 1)
        load_tile(v_base, vb, cell0);

        float s[CTILES][4];
#pragma unroll
        for (int n = 0; n < CTILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
            for (int np = 0; np < CTILES / 2; ++np) {
                unsigned b[4];
                ldmatrix_x4(b, k_lane + (np * 16 * KS + ks * 16) * 2);
                mma_f16(s[2 * np], qa[ks], b[0], b[1]);
                mma_f16(s[2 * np + 1], qa[ks], b[2], b[3]);
            }
        }

        float alpha[2];
        mask_and_softmax(s, m, l, alpha, cell0, min_pos, row_pos, tq);
#pragma unroll
        for (int n = 0; n < DTILES; ++n) o[n][0] *= alpha[0], o[n][1] *= alpha[0], o[n][2] *= alpha[1], o[n][3] *= alpha[1];

        cp_async_wait_all();
        __syncthreads();  // V(tile) landed; every warp is done with K(tile)
        if (tile + 1 < num_tiles) load_tile(k_base, kb, cell0 + kCells);

#pragma unroll
        for (int ks = 0; ks < kCells / 16; ++ks) {
            // the S accumulators of cell n-tiles 2ks, 2ks+1 are exactly the A fragment of k-step ks
            const unsigned pa[4] = {pack_half2(s[2 * ks][0], s[2 * ks][1]), pack_half2(s[2 * ks][2], s[2 * ks][3]),
                                    pack_half2(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                                    pack_half2(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
            for (int dp = 0; dp < DTILES / 2; ++dp) {
                unsigned b[4];
                ldmatrix_x4_trans(b, v_lane + (ks * 16 * KS + dp * 16) * 2);
                mma_f16(o[2 * dp], pa, b[0], b[1]);
                mma_f16(o[2 * dp + 1], pa, b[2], b[3]);
            }
        }
    }

    store_rows(o, l, row_pos, rows, tq, out);
}

// Head dim 256: the DH-128 layout would hold 128 f32 of O and 64 registers of Q fragments a thread,
// which spills. Instead each 16 rows are owned by a pair of warps (warp w and w + 4 of 8) that split
// both products: in a tile of 32 cells, warp half h computes S for cells 16h..16h+15 over all of DH
// (Q fragments of all 256 dims in registers: 64), the two warps swap their halves of S through
// shared memory (a named barrier per pair), each runs the same online softmax on the whole S (so
// both hold the same m, l and P bits) and computes O for its own 128 columns (64 registers). Same
// mma count as one warp doing all of it; the softmax runs on both warps of a pair. The K/V tiles
// are 32 cells so shared memory stays static (2 * 32 * (DH + 8) * 2 + 8 KB of exchanged S).
template <int DH>
__device__ __forceinline__ void attention_prefill_tc_pairs(const float* __restrict__ q,
                                                           const __half* __restrict__ k_cache,
                                                           const __half* __restrict__ v_cache,
                                                           const int* __restrict__ positions,
                                                           float* __restrict__ out, int T, int H, int Hk,
                                                           float scale) {
    constexpr int KS = DH + 8;              // padded smem row, halves (as above)
    constexpr int KSTEPS = DH / 16;         // k-steps of Q K^T, over all of DH
    constexpr int HALF = DH / 2;            // O columns a warp owns
    constexpr int DTILES = HALF / 8;        // n-tiles of a warp's O
    constexpr int CTILES = kPairCells / 8;  // n-tiles of S: 2 of each warp of the pair
    constexpr int CHUNKS = DH / 8;          // 16-byte chunks per cache row
    __shared__ alignas(16) __half k_s[kPairCells][KS];
    __shared__ alignas(16) __half v_s[kPairCells][KS];
    __shared__ float4 s_x[kPairWarps][2][32];  // each warp's two S n-tiles, by lane: the partner's lane reads it
    __shared__ int pos_s[kPairWarps][2];

    const int kvh = blockIdx.y, G = H / Hk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rg = warp & 3, half = warp >> 2;  // 16-row group; half of S's cells and of O's columns
    const int gq = lane >> 2, tq = lane & 3;
    const int64_t num_rows = static_cast<int64_t>(T) * G;
    const int64_t row0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kRows;  // heaviest first

    block_positions(positions, row0, num_rows, G, warp, lane, pos_s);
    int row_pos[2];
    unsigned qa[KSTEPS][4];
    const RowPlace rows{row0 + rg * 16 + gq, num_rows, G, H, kvh, DH};
    load_rows_q(q, positions, rows, tq, scale * kLog2e, row_pos, qa);
    __syncthreads();
    const Span span = block_span<kPairWarps>(pos_s);
    const int min_pos = span.min_pos, num_cells = span.num_cells;
    const int num_tiles = (num_cells + kPairCells - 1) / kPairCells;

    const int64_t row_stride = static_cast<int64_t>(Hk) * DH;
    const __half* kb = k_cache + static_cast<int64_t>(kvh) * DH;
    const __half* vb = v_cache + static_cast<int64_t>(kvh) * DH;
    const unsigned k_base = static_cast<unsigned>(__cvta_generic_to_shared(&k_s[0][0]));
    const unsigned v_base = static_cast<unsigned>(__cvta_generic_to_shared(&v_s[0][0]));
    const TileLoader<kPairCells, kPairThreads, CHUNKS, KS> load_tile{row_stride, num_cells};
    // ldmatrix lane addresses as above, moved to this warp's 16 cells of K and 128 columns of V
    const unsigned k_lane =
        k_base + ((half * 16 + (lane & 7) + ((lane >> 4) << 3)) * KS + ((lane >> 3) & 1) * 8) * 2;
    const unsigned v_lane = v_base + (((lane & 7) + ((lane >> 3) & 1) * 8) * KS + half * HALF + (lane >> 4) * 8) * 2;
    const unsigned bar_id = 1 + rg;  // named barrier of the pair (0 is __syncthreads')

    float o[DTILES][4];
#pragma unroll
    for (int n = 0; n < DTILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    load_tile(k_base, kb, 0);
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int cell0 = tile * kPairCells;
        cp_async_wait_all();
        __syncthreads();  // K(tile) landed; every warp is done with V(tile - 1) and the partner's S(tile - 1)
        load_tile(v_base, vb, cell0);

        float mine[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            unsigned b[4];
            ldmatrix_x4(b, k_lane + ks * 16 * 2);
            mma_f16(mine[0], qa[ks], b[0], b[1]);
            mma_f16(mine[1], qa[ks], b[2], b[3]);
        }
        s_x[warp][0][lane] = make_float4(mine[0][0], mine[0][1], mine[0][2], mine[0][3]);
        s_x[warp][1][lane] = make_float4(mine[1][0], mine[1][1], mine[1][2], mine[1][3]);
        asm volatile("bar.sync %0, 64;\n" ::"r"(bar_id) : "memory");  // the pair's halves of S are in
        const float4 x0 = s_x[warp ^ 4][0][lane], x1 = s_x[warp ^ 4][1][lane];
        const float theirs[2][4] = {{x0.x, x0.y, x0.z, x0.w}, {x1.x, x1.y, x1.z, x1.w}};
        float s[CTILES][4];  // the whole tile's S, cells in order: both warps of the pair hold the same bits
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                s[n][j] = half ? theirs[n][j] : mine[n][j];
                s[2 + n][j] = half ? mine[n][j] : theirs[n][j];
            }

        float alpha[2];
        mask_and_softmax(s, m, l, alpha, cell0, min_pos, row_pos, tq);
#pragma unroll
        for (int n = 0; n < DTILES; ++n) o[n][0] *= alpha[0], o[n][1] *= alpha[0], o[n][2] *= alpha[1], o[n][3] *= alpha[1];

        cp_async_wait_all();
        __syncthreads();  // V(tile) landed; every warp is done with K(tile)
        if (tile + 1 < num_tiles) load_tile(k_base, kb, cell0 + kPairCells);

#pragma unroll
        for (int ks = 0; ks < kPairCells / 16; ++ks) {
            const unsigned pa[4] = {pack_half2(s[2 * ks][0], s[2 * ks][1]), pack_half2(s[2 * ks][2], s[2 * ks][3]),
                                    pack_half2(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                                    pack_half2(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
            for (int dp = 0; dp < DTILES / 2; ++dp) {
                unsigned b[4];
                ldmatrix_x4_trans(b, v_lane + (ks * 16 * KS + dp * 16) * 2);
                mma_f16(o[2 * dp], pa, b[0], b[1]);
                mma_f16(o[2 * dp + 1], pa, b[2], b[3]);
            }
        }
    }

    store_rows(o, l, row_pos, rows, tq, out + half * HALF);    // this warp's half of the columns
}

#define STRATA_PREFILL_TC(DH)                                                                                 \
    extern "C" __global__ void __launch_bounds__(kThreads, 2) strata_attention_prefill_tc_f16_d##DH(             \
        const float* q, const __half* k_cache, const __half* v_cache, const int* positions, float* out, int T, \
        int H, int Hk, float scale) {                                                                         \
        attention_prefill_tc<DH>(q, k_cache, v_cache, positions, out, T, H, Hk, scale);                       \
    }
STRATA_PREFILL_TC(64)
STRATA_PREFILL_TC(128)
#undef STRATA_PREFILL_TC

extern "C" __global__ void __launch_bounds__(kPairThreads, 1) strata_attention_prefill_tc_f16_d256(
    const float* q, const __half* k_cache, const __half* v_cache, const int* positions, float* out, int T, int H,
    int Hk, float scale) {
    attention_prefill_tc_pairs<256>(q, k_cache, v_cache, positions, out, T, H, Hk, scale);
}
