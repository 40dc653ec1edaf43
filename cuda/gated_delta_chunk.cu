// The gated delta rule over a prompt in chunks of 64 tokens (the WY / UT form), f32: the same inputs and
// outputs as cuda/gated_delta.cu strata_gdn_prompt_f32 (the token loop), in two launches. The numpy
// reference is strata/backends/cpu_linear_attn.py gated_delta_chunked; tests/engine/fake_gated_delta.py
// emulates the two kernels' arithmetic over their scratch layout, and tests/kernels/
// test_gated_delta_chunk_host.py runs this file's own source on the host (tests/kernels/cuda_host_shim.h).
//
// Per value head h and chunk of n <= 64 tokens, with c the inclusive cumulative sum of g over the chunk
// (c_last = c[n-1]), qn and kn the L2-normalized q and k of h's key head (qn also times q_scale):
//   A    = strictly_lower(beta_i (kn_i . kn_j) e^{c_i - c_j})             [64, 64]
//   M    = (I + A)^-1 diag(beta)            (forward substitution, row by row)
//   P    = lower(qn_i . kn_j e^{c_i - c_j}) (diagonal included)
//   V'   = M (V - diag(e^c) Kn S)           (= U - W S of the WY form, W never formed)
//   O    = diag(e^c) Qn S + P V'
//   S   <- e^{c_last} S + Kn^T diag(e^{c_last - c}) V'
// Rows and columns past n are zeros in M, P and the row scales, so a short last chunk needs no masks.
//
// strata_gdn_chunk_prep_f32(q, k, g, beta, scratch, T, Hv, Hg, Dk, q_scale, qk_ld)
//   Per (chunk, h), independent of the state: writes GDN_CHUNK_SCRATCH floats at
//   scratch + (chunk * Hv + h) * GDN_CHUNK_SCRATCH: M [64][64] row-major at 0, P [64][64] at 4096, the
//   row scales qs_i = qinv_i e^{c_i} at 8192, ka_i = kinv_i e^{c_i} at 8256, kb_i = kinv_i e^{c_last - c_i}
//   at 8320 (zero for i >= n), e^{c_last} at 8384. q, k [T, Hg, Dk] with row stride qk_ld; g, beta [T, Hv].
//   1 <= Dk (any size: it is read in slices of 32). Launch: grid = (ceil(T / 64), Hv, 1), block = (256, 1, 1).
//
// strata_gdn_chunk_scan_f32(q, k, v, scratch, state, out, T, Hv, Hg, Dk, Dv, qk_ld, v_ld)
//   The chunks in order, per (h, 16 columns of S): the state tile [Dk, 16] stays in shared memory, every
//   product is a [64, 16] += [64, 64] x [64, 16] over a staged [64, 64] slice of its left factor (K or Q
//   rows times their row scale, M, P; K^T for the state update), on the tensor cores: each of the 8 warps
//   owns one 16 x 8 tile, mma.sync m16n8k8 tf32 with f32 accumulation, each operand split x = hi + lo into
//   two tf32 and the product taken as lo hi + hi lo + hi hi (3xTF32: f32's accuracy to ~2^-22, the lo lo
//   term dropped). Each stage's slice is fetched into registers while the stage before computes (its
//   loads overlap the products), then scaled into shared memory; 2 blocks a multiprocessor (128 registers).
//   v [T, Hv, Dv] with row stride v_ld, state [Hv, Dk, Dv] updated in place,
//   out [T, Hv, Dv]. 1 <= Dk <= GDN_CHUNK_MAX_DK. Launch: grid = (ceil(Dv / 16), Hv, 1), block = (256, 1, 1),
//   after the prep launch on the same stream (sm_80+: mma.sync tf32).

#include <cstdint>

#define GDN_CHUNK 64
#define GDN_CHUNK_MAX_DK 128          // the scan's state tile [Dk][16] in shared memory, in slices of 64
#define GDN_CHUNK_SCRATCH 8448        // floats per (chunk, h): M, P, 3 x 64 row scales, e^{c_last}, padding
#define GDN_SCALES 8192
#define GDN_SLICE 64                  // columns of a left factor staged at a time
#define GDN_XS_PITCH (GDN_SLICE + 4)  // the staged slice's row pitch: a fragment's 32 reads hit 32 banks
#define GDN_SCAN_COLS 16              // state columns per scan block: Hv * Dv / 16 blocks to hide latency
#define GDN_Y_PITCH (GDN_SCAN_COLS + 8)                  // S and V' rows: b fragments hit 32 banks
static_assert(GDN_CHUNK_MAX_DK % GDN_SLICE == 0 && GDN_SLICE == GDN_CHUNK, "whole slices; M and P in one");
static_assert(GDN_SCAN_COLS == 16, "8 warps, each one 16 x 8 tile of a [64, 16] product");

// The warp's sum of v, returned to every lane.
__device__ __forceinline__ float gdn_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void __launch_bounds__(256) strata_gdn_chunk_prep_f32(const float* __restrict__ q,
                                                                            const float* __restrict__ k,
                                                                            const float* __restrict__ g,
                                                                            const float* __restrict__ beta,
                                                                            float* __restrict__ scratch, int T,
                                                                            int Hv, int Hg, int Dk, float q_scale,
                                                                            int64_t qk_ld) {
    __shared__ float As[GDN_CHUNK][GDN_CHUNK + 1];
    __shared__ float buf[2 * GDN_CHUNK * 33];       // k and q slices [64][33] each, then (I + A)^-1 [64][65]
    __shared__ float c[GDN_CHUNK], b[GDN_CHUNK], qinv[GDN_CHUNK], kinv[GDN_CHUNK];
    const int chunk = blockIdx.x, h = blockIdx.y, kh = h / (Hv / Hg);
    const int t0 = chunk * GDN_CHUNK, n = min(GDN_CHUNK, T - t0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* qc = q + (int64_t)t0 * qk_ld + (int64_t)kh * Dk;
    const float* kc = k + (int64_t)t0 * qk_ld + (int64_t)kh * Dk;
    if (tid < GDN_CHUNK) {
        b[tid] = tid < n ? beta[(int64_t)(t0 + tid) * Hv + h] : 0.0f;
        c[tid] = tid < n ? g[(int64_t)(t0 + tid) * Hv + h] : 0.0f;
    }
    for (int i = warp; i < GDN_CHUNK; i += 8) {     // a warp per row: the L2 norms, as gdn_load_qk takes them
        float q2 = 0.0f, k2 = 0.0f;
        for (int d = lane; i < n && d < Dk; d += 32) {
            const float x = qc[i * qk_ld + d], y = kc[i * qk_ld + d];
            q2 += x * x;
            k2 += y * y;
        }
        q2 = gdn_warp_sum(q2);
        k2 = gdn_warp_sum(k2);
        if (lane == 0) {
            qinv[i] = q_scale / sqrtf(q2 + 1e-6f);
            kinv[i] = 1.0f / sqrtf(k2 + 1e-6f);
        }
    }
    __syncthreads();
    if (tid == 0)
        for (int i = 1; i < GDN_CHUNK; ++i) c[i] += c[i - 1];   // numpy's cumsum order; past n it stays c_last

    // the raw Gram products k_i . k_j and q_i . k_j: thread (ti, tj) owns rows ti + 16a, columns tj + 16b
    const int ti = tid >> 4, tj = tid & 15;
    float kk[4][4], qk[4][4];
    for (int a = 0; a < 4; ++a)
        for (int e = 0; e < 4; ++e) kk[a][e] = qk[a][e] = 0.0f;
    float* ks = buf;
    float* qs = buf + GDN_CHUNK * 33;
    for (int d0 = 0; d0 < Dk; d0 += 32) {
        __syncthreads();
        for (int e = tid; e < GDN_CHUNK * 32; e += 256) {
            const int r = e >> 5, cc = e & 31;
            const bool ok = r < n && d0 + cc < Dk;
            ks[r * 33 + cc] = ok ? kc[r * qk_ld + d0 + cc] : 0.0f;
            qs[r * 33 + cc] = ok ? qc[r * qk_ld + d0 + cc] : 0.0f;
        }
        __syncthreads();
        for (int cc = 0; cc < 32; ++cc) {
            float ki[4], qi[4], kj[4];
            for (int a = 0; a < 4; ++a) {
                ki[a] = ks[(ti + 16 * a) * 33 + cc];
                qi[a] = qs[(ti + 16 * a) * 33 + cc];
                kj[a] = ks[(tj + 16 * a) * 33 + cc];
            }
            for (int a = 0; a < 4; ++a)
                for (int e = 0; e < 4; ++e) {
                    kk[a][e] += ki[a] * kj[e];
                    qk[a][e] += qi[a] * kj[e];
                }
        }
    }
    float* out = scratch + ((int64_t)chunk * Hv + h) * GDN_CHUNK_SCRATCH;
    for (int a = 0; a < 4; ++a)
        for (int e = 0; e < 4; ++e) {
            const int i = ti + 16 * a, j = tj + 16 * e;
            const float dec = (j <= i && i < n) ? expf(c[i] - c[j]) : 0.0f;
            As[i][j] = j < i ? b[i] * kk[a][e] * kinv[i] * kinv[j] * dec : 0.0f;
            out[4096 + i * GDN_CHUNK + j] = qk[a][e] * qinv[i] * kinv[j] * dec;
        }
    __syncthreads();                                  // the slices are read; buf becomes the inverse

    // (I + A)^-1 row by row: row i = e_i - sum_{j < i} A[i][j] row j (unit lower triangular); a thread per
    // column, its sum over j (from the column on: inv is 0 above the diagonal) in 4 chains for latency
    float* inv = buf;
    for (int i = 0; i < GDN_CHUNK; ++i) {
        if (tid < GDN_CHUNK) {
            float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            int j = tid;
            for (; j + 3 < i; j += 4)
                for (int u = 0; u < 4; ++u) s[u] += As[i][j + u] * inv[(j + u) * 65 + tid];
            for (; j < i; ++j) s[0] += As[i][j] * inv[j * 65 + tid];
            inv[i * 65 + tid] = tid == i ? 1.0f : (tid < i ? -((s[0] + s[1]) + (s[2] + s[3])) : 0.0f);
        }
        __syncthreads();
    }
    for (int e = tid; e < GDN_CHUNK * GDN_CHUNK; e += 256) {
        const int i = e >> 6, j = e & 63;
        out[e] = inv[i * 65 + j] * b[j];
    }
    if (tid < GDN_CHUNK) {
        const int i = tid;
        const float cl = c[n - 1];
        out[GDN_SCALES + i] = i < n ? qinv[i] * expf(c[i]) : 0.0f;
        out[GDN_SCALES + 64 + i] = i < n ? kinv[i] * expf(c[i]) : 0.0f;
        out[GDN_SCALES + 128 + i] = i < n ? kinv[i] * expf(cl - c[i]) : 0.0f;
        if (i == 0) out[GDN_SCALES + 192] = expf(cl);
    }
}

// A [64, 64] slice of a left factor in flight: thread tid holds elements tid + 256 u (row e / 64, column
// e % 64) in registers, fetched a stage ahead so the loads overlap the stage before's products.
#define GDN_FETCH (GDN_CHUNK * GDN_SLICE / 256)

struct GdnSlice {
    const float* src;      // row 0, column 0 of the slice; null: nothing to fetch
    int64_t ld;            // row stride
    int rows, cols;        // valid extent; zeros elsewhere
};

__device__ __forceinline__ void gdn_fetch(float* pre, GdnSlice sl) {
#pragma unroll
    for (int u = 0; u < GDN_FETCH; ++u) {
        const int e = threadIdx.x + 256 * u, r = e / GDN_SLICE, cc = e % GDN_SLICE;
        pre[u] = (sl.src && r < sl.rows && cc < sl.cols) ? sl.src[r * sl.ld + cc] : 0.0f;
    }
}

// xs <- the fetched slice, row r times scale[r] (scale may be null).
__device__ __forceinline__ void gdn_put(float (*xs)[GDN_XS_PITCH], const float* pre, const float* scale) {
#pragma unroll
    for (int u = 0; u < GDN_FETCH; ++u) {
        const int e = threadIdx.x + 256 * u, r = e / GDN_SLICE, cc = e % GDN_SLICE;
        xs[r][cc] = scale ? pre[u] * scale[r] : pre[u];
    }
}

// A chunk's stages in order, nd = ceil(Dk / 64) slices of K or Q each: K (for Kn e^c S), M, Q, P, K (for
// the state update). Stage s of chunk `chunk`'s left factor, unscaled.
__device__ GdnSlice gdn_slice(int chunk, int s, int nd, const float* q, const float* k, const float* scratch, int T,
                              int Hv, int h, int kh, int Dk, int64_t qk_ld) {
    const int t0 = chunk * GDN_CHUNK, n = min(GDN_CHUNK, T - t0);
    const float* sc = scratch + ((int64_t)chunk * Hv + h) * GDN_CHUNK_SCRATCH;
    const int64_t row0 = (int64_t)t0 * qk_ld + (int64_t)kh * Dk;
    if (s == nd) return {sc, GDN_CHUNK, GDN_CHUNK, GDN_CHUNK};
    if (s == 2 * nd + 1) return {sc + 4096, GDN_CHUNK, GDN_CHUNK, GDN_CHUNK};
    const bool is_q = s > nd && s < 2 * nd + 1;
    const int d0 = GDN_SLICE * (s < nd ? s : (is_q ? s - nd - 1 : s - 2 * nd - 2));
    return {(is_q ? q : k) + row0 + d0, qk_ld, n, Dk - d0};
}

#ifdef __CUDACC__  // tests/kernels/cuda_host_shim.h compiles this file for the host with its own two helpers
// x = hi + lo, hi and lo tf32 (lo the rounding residue): three tf32 products keep f32's accuracy.
__device__ __forceinline__ void gdn_split_tf32(float x, uint32_t& hi, uint32_t& lo) {
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(hi) : "f"(x));
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(lo) : "f"(x - __uint_as_float(hi)));
}

__device__ __forceinline__ void gdn_mma_tf32(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// The warp's 16 x 8 tile (rows 16 mt.., columns 8 nt..) c += X Y over k < GDN_SLICE: X (row, k) at
// x[row * xr + k * xk] (xr = 1 reads a staged slice transposed), Y (k, col) at y[k * GDN_Y_PITCH + col].
// Fragments of mma.m16n8k8 (g = lane / 4, t = lane % 4): a = X(g, t), X(g + 8, t), X(g, t + 4),
// X(g + 8, t + 4); b = Y(t, g), Y(t + 4, g); c = (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
__device__ __forceinline__ void gdn_mma_tile(float* c, const float* x, int xr, int xk, const float* y, int mt, int nt,
                                             int g, int t) {
    const float* xa = x + (16 * mt + g) * xr;
    const float* yb = y + 8 * nt + g;
#pragma unroll 2
    for (int k0 = 0; k0 < GDN_SLICE; k0 += 8) {
        const float af[4] = {xa[(k0 + t) * xk], xa[8 * xr + (k0 + t) * xk], xa[(k0 + t + 4) * xk],
                             xa[8 * xr + (k0 + t + 4) * xk]};
        const float bf[2] = {yb[(k0 + t) * GDN_Y_PITCH], yb[(k0 + t + 4) * GDN_Y_PITCH]};
        uint32_t ah[4], al[4], bh[2], bl[2];
        for (int r = 0; r < 4; ++r) gdn_split_tf32(af[r], ah[r], al[r]);
        for (int r = 0; r < 2; ++r) gdn_split_tf32(bf[r], bh[r], bl[r]);
        gdn_mma_tf32(c, al, bh);
        gdn_mma_tf32(c, ah, bl);
        gdn_mma_tf32(c, ah, bh);
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) strata_gdn_chunk_scan_f32(const float* __restrict__ q,
                                                                            const float* __restrict__ k,
                                                                            const float* __restrict__ v,
                                                                            const float* __restrict__ scratch,
                                                                            float* state, float* __restrict__ out,
                                                                            int T, int Hv, int Hg, int Dk, int Dv,
                                                                            int64_t qk_ld, int64_t v_ld) {
    __shared__ float S[GDN_CHUNK_MAX_DK][GDN_Y_PITCH];     // the state tile: rows d, columns j0 + 0..15
    __shared__ float xs[GDN_CHUNK][GDN_XS_PITCH];          // the stage's slice of its left factor
    __shared__ float vs[GDN_CHUNK][GDN_Y_PITCH];           // R = V - diag(e^c) Kn S, then V'
    __shared__ float scales[3 * GDN_CHUNK + 1];            // qs, ka, kb, e^{c_last}
    const int h = blockIdx.y, kh = h / (Hv / Hg), j0 = blockIdx.x * GDN_SCAN_COLS;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int mt = warp >> 1, nt = warp & 1;               // the warp's 16 x 8 tile of every [64, 16] product
    int rows[4], cols[4];                                  // where the tile's accumulators sit
    for (int r = 0; r < 4; ++r) {
        rows[r] = 16 * mt + g + 8 * (r >> 1);
        cols[r] = 8 * nt + 2 * t + (r & 1);
    }
    float* Sg = state + (int64_t)h * Dk * Dv + j0;
    for (int e = tid; e < GDN_CHUNK_MAX_DK * GDN_SCAN_COLS; e += 256) {
        const int d = e / GDN_SCAN_COLS, jj = e % GDN_SCAN_COLS;
        S[d][jj] = (d < Dk && j0 + jj < Dv) ? Sg[(int64_t)d * Dv + jj] : 0.0f;
    }
    const int num_chunks = (T + GDN_CHUNK - 1) / GDN_CHUNK, nd = (Dk + GDN_SLICE - 1) / GDN_SLICE;
    const int num_stages = 3 * nd + 2;
    float pre[GDN_FETCH], acc[4];
    gdn_fetch(pre, gdn_slice(0, 0, nd, q, k, scratch, T, Hv, h, kh, Dk, qk_ld));
    for (int chunk = 0; chunk < num_chunks; ++chunk) {
        const int t0 = chunk * GDN_CHUNK, n = min(GDN_CHUNK, T - t0);
        __syncthreads();                              // the last chunk's reads of scales, xs and vs are done
        const float* sc = scratch + ((int64_t)chunk * Hv + h) * GDN_CHUNK_SCRATCH;
        if (tid < 3 * GDN_CHUNK + 1) scales[tid] = sc[GDN_SCALES + tid];
        __syncthreads();
        for (int s = 0; s < num_stages; ++s) {
            // stage kinds: [0, nd) K for Kn e^c S, nd M, (nd, 2nd] Q, 2nd + 1 P, (2nd + 1, 3nd + 2) K for the update
            const bool k_first = s < nd, m = s == nd, q_stage = s > nd && s <= 2 * nd, p = s == 2 * nd + 1;
            const int d0 = GDN_SLICE * (k_first ? s : (q_stage ? s - nd - 1 : s - 2 * nd - 2));
            const float* row_scale = k_first ? scales + GDN_CHUNK : (q_stage ? scales : scales + 2 * GDN_CHUNK);
            gdn_put(xs, pre, m || p ? nullptr : row_scale);
            __syncthreads();
            const bool last = s + 1 == num_stages;
            if (!last || chunk + 1 < num_chunks)
                gdn_fetch(pre, gdn_slice(last ? chunk + 1 : chunk, last ? 0 : s + 1, nd, q, k, scratch, T, Hv, h, kh,
                                         Dk, qk_ld));
            if (k_first) {                            // R = V - Kn e^c S
                if (s == 0)
                    for (int r = 0; r < 4; ++r) acc[r] = 0.0f;
                gdn_mma_tile(acc, &xs[0][0], GDN_XS_PITCH, 1, &S[d0][0], mt, nt, g, t);
                if (s == nd - 1)
                    for (int r = 0; r < 4; ++r) {
                        const int i = rows[r], j = j0 + cols[r];
                        vs[i][cols[r]] = (i < n && j < Dv) ? v[(int64_t)(t0 + i) * v_ld + (int64_t)h * Dv + j] - acc[r]
                                                           : 0.0f;
                    }
            } else if (m) {                           // V' = M R
                for (int r = 0; r < 4; ++r) acc[r] = 0.0f;
                gdn_mma_tile(acc, &xs[0][0], GDN_XS_PITCH, 1, &vs[0][0], mt, nt, g, t);
                __syncthreads();                      // every read of R is done
                for (int r = 0; r < 4; ++r) vs[rows[r]][cols[r]] = acc[r];
            } else if (q_stage) {                     // O = Qn e^c S + ...
                if (s == nd + 1)
                    for (int r = 0; r < 4; ++r) acc[r] = 0.0f;
                gdn_mma_tile(acc, &xs[0][0], GDN_XS_PITCH, 1, &S[d0][0], mt, nt, g, t);
            } else if (p) {                           // ... + P V'
                gdn_mma_tile(acc, &xs[0][0], GDN_XS_PITCH, 1, &vs[0][0], mt, nt, g, t);
                for (int r = 0; r < 4; ++r) {
                    const int i = rows[r], j = j0 + cols[r];
                    if (i < n && j < Dv) out[((int64_t)(t0 + i) * Hv + h) * Dv + j] = acc[r];
                }
            } else {                                  // S <- e^{c_last} S + (Kn e^{c_last - c})^T V' (K transposed)
                for (int r = 0; r < 4; ++r) acc[r] = S[d0 + rows[r]][cols[r]] * scales[3 * GDN_CHUNK];
                gdn_mma_tile(acc, &xs[0][0], 1, GDN_XS_PITCH, &vs[0][0], mt, nt, g, t);
                for (int r = 0; r < 4; ++r) S[d0 + rows[r]][cols[r]] = acc[r];
            }
            __syncthreads();                          // xs is read (and vs and S written) before the next put
        }
    }
    for (int e = tid; e < Dk * GDN_SCAN_COLS; e += 256) {
        const int d = e / GDN_SCAN_COLS, jj = e % GDN_SCAN_COLS;
        if (j0 + jj < Dv) Sg[(int64_t)d * Dv + jj] = S[d][jj];
    }
}
