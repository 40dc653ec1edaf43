// The warpgroup MMAs the Hopper prompt attention kernels issue (cuda/attention_wg.cu, cuda/attention_ws.cu),
// with accumulators and register A fragments in mma.m16n8k16's per-warp layout (d[n] the n-th 8
// columns of this warp's 16 rows), and the no-swizzle core-matrix placement of their shared tiles.
// Include inside an anonymous namespace, after attention_tc.cuh and wgmma.cuh.

#pragma once

// The accumulator operands of an m64n64 (8 n-tiles, 32 registers) and an m64n128 (16, 64) wgmma, and their
// places in the instruction's text.
#define STRATA_WG_D32(d) \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
    "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
    "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
    "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
    "+f"(d[7][2]), "+f"(d[7][3])
#define STRATA_WG_D64(d) \
    STRATA_WG_D32(d), \
    "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), \
    "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), \
    "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), \
    "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
    "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), \
    "+f"(d[15][2]), "+f"(d[15][3])
#define STRATA_WG_R32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define STRATA_WG_R64 \
    STRATA_WG_R32 ", " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// d += A (64 x 16: this warp's 16 rows as an m16n8k16 A fragment in a) * B (16 x 64, desc_b, stored
// N-major: P V's V), f16 in, f32 accumulators in m16n8 layout.
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[8][4], const unsigned (&a)[4], uint64_t desc_b) {
#ifndef STRATA_WG_TRAP
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" STRATA_WG_R32 "}, "
                 "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n"
                 "}\n"
                 : STRATA_WG_D32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
#endif
}

// d += A (64 x 16, desc_a, K-major) * B (16 x 64, desc_b, B^T stored K-major), f16 in, f32 accumulators
// in m16n8 layout (d = A B, its old values not read, with accumulate 0).
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, int accumulate = 1) {
#ifndef STRATA_WG_TRAP
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" STRATA_WG_R32 "}, "
                 "%32, %33, p, 1, 1, 0, 0;\n"
                 "}\n"
                 : STRATA_WG_D32(d)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#endif
}

// d += A (64 x 16, desc_a, K-major) * B (16 x 128, desc_b, B^T stored K-major), f16 in, f32 accumulators
// in m16n8 layout (d = A B with accumulate 0).
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, int accumulate = 1) {
#ifndef STRATA_WG_TRAP
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" STRATA_WG_R64 "}, "
                 "%64, %65, p, 1, 1, 0, 0;\n"
                 "}\n"
                 : STRATA_WG_D64(d)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#endif
}

// d += A (64 x 16: this warp's 16 rows as an m16n8k16 A fragment in a) * B (16 x 128, desc_b, stored
// N-major: P V's V), f16 in, f32 accumulators in m16n8 layout.
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[16][4], const unsigned (&a)[4], uint64_t desc_b) {
#ifndef STRATA_WG_TRAP
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" STRATA_WG_R64 "}, "
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
                 "}\n"
                 : STRATA_WG_D64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
#endif
}

// The 16-byte chunk `chunk` of row r (a cell, or a query row) in a no-swizzle core-matrix tile of CHUNKS
// chunks a row: core matrix (r / 8, chunk), row r % 8 within it (cuda/attention_wg.cu's header draws
// it), in 16-byte units.
template <int CHUNKS>
__device__ __forceinline__ int core_chunk(int r, int chunk) { return (((r >> 3) * CHUNKS + chunk) << 3) + (r & 7); }

// Q's A fragments (attention_tc.cuh's load_rows_q: a[i + 2h] holds row `row` + 8i, dims 16 ks + 8h + 2tq,
// +1, that is chunk 2 ks + h, bytes 4 tq) stored into a core-matrix tile of Q's rows at q_words.
template <int KSTEPS>
__device__ __forceinline__ void store_q_core(unsigned* q_words, const unsigned (&qa)[KSTEPS][4], int row, int tq) {
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            q_words[core_chunk<2 * KSTEPS>(row + 8 * (j & 1), 2 * ks + (j >> 1)) * 4 + tq] = qa[ks][j];
}

// A tile's S accumulators through the mask and online softmax (attention_tc.cuh), O rescaled by the
// rows' alpha, and P rounded to f16 as P V's register A fragments (k-step ks: cell n-tiles 2 ks, 2 ks + 1).
template <int CTILES, int DTILES>
__device__ __forceinline__ void softmax_to_p(float (&s)[CTILES][4], float (&o)[DTILES][4], float (&m)[2],
                                             float (&l)[2], unsigned (&pa)[CTILES / 2][4], int cell0, int min_pos,
                                             const int (&row_pos)[2], int tq) {
    float alpha[2];
    mask_and_softmax(s, m, l, alpha, cell0, min_pos, row_pos, tq);
#pragma unroll
    for (int n = 0; n < DTILES; ++n)
        o[n][0] *= alpha[0], o[n][1] *= alpha[0], o[n][2] *= alpha[1], o[n][3] *= alpha[1];
#pragma unroll
    for (int ks = 0; ks < CTILES / 2; ++ks) {
        pa[ks][0] = pack_half2(s[2 * ks][0], s[2 * ks][1]);
        pa[ks][1] = pack_half2(s[2 * ks][2], s[2 * ks][3]);
        pa[ks][2] = pack_half2(s[2 * ks + 1][0], s[2 * ks + 1][1]);
        pa[ks][3] = pack_half2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
    }
}
