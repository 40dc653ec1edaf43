// Gated DeltaNet decode step (Qwen3-Next's linear-attention layers), f32: the causal depthwise conv1d
// step and the gated delta rule step, each updating its per-sequence state in place in VRAM.
// The numpy references are strata/backends/cpu_linear_attn.py causal_conv1d and gated_delta_recurrent.
//
// strata_gdn_conv1d_step_f32(x, state, w, out, C, K)
//   One token: x [C], state [K-1, C] (the last K-1 inputs, oldest first), w [C, K] (row-major taps).
//   acc[c] = sum_{j<K-1} w[c, j] * state[j, c] + w[c, K-1] * x[c], summed in that order with
//   separate roundings (no FMA, as numpy adds the products); out[c] = acc / (1 + expf(-acc)) (SiLU);
//   then state shifts one row up and its last row becomes x. out may alias x (each thread reads its
//   x[c] first). Launch: grid = (ceil(C / 256), 1, 1), block = (256, 1, 1); one thread per channel.
//
// strata_gdn_conv1d_rows_f32(x, row_states, state_off, w, out, C, K)
//   One token of each of `rows` distinct sequences (a batched decode step of parallel slots): row r's
//   x [C] at x + r * C, out at out + r * C, its state at the device address row_states[r] + state_off
//   bytes (row_states [rows], in device memory, so a CUDA graph captured once reads whatever
//   sequences a later step's rows are). Each row is strata_gdn_conv1d_step_f32 bit for bit (the same
//   device function); the rows' states must not overlap. Launch: grid = (ceil(C / 256), rows, 1).
//
// strata_gdn_conv1d_f32(x, state, w, out, T, C, K, x_ld)
//   The same over a prompt of T tokens: x [T, C] with row stride x_ld (the conv input may be the first
//   C columns of a wider projection), out [T, C] contiguous; token t's window is the K-1 inputs before
//   it (from state for t < K-1), so T steps of strata_gdn_conv1d_step_f32 give the same out and state
//   bit for bit. 1 <= K <= GDN_MAX_K; the window sits in registers. out must not alias x.
//   Launch: grid = (ceil(C / 256), 1, 1), block = (256, 1, 1); one thread per channel walks the tokens.
//
// strata_gdn_step_f32(q, k, v, g, beta, state, out, Hv, Hg, Dk, Dv, q_scale)
//   One token: q, k [Hg, Dk] (the conv output, not yet normalized), v [Hv, Dv], g and beta [Hv] (the
//   log decay and the write strength), state S [Hv, Dk, Dv], out [Hv, Dv]. Value head h reads key head
//   h / (Hv / Hg). q and k are L2-normalized (x / sqrtf(sum x^2 + 1e-6)), q then scaled by q_scale
//   (1 / sqrt(Dk)); then per column j of S[h]:
//     S[:, j] *= expf(g[h]);  d = beta[h] * (v[h, j] - k . S[:, j]);  S[:, j] += k * d;  out[h, j] = q . S[:, j]
//   Launch: grid = (ceil(Dv / 32), Hv, 1), block = (256, 1, 1); 1 <= Dk <= 256 (q and k of the key head
//   sit in shared memory). A block owns 32 columns of one head: lane l of warp w holds column
//   32 * blockIdx.x + l at rows w, w + 8, w + 16, ... in registers (one coalesced read and one write of
//   the state, 128 bytes a warp a row). Each dot product over the rows is 8 partial sums (a warp's rows
//   in order), added in warp order through shared memory: a fixed order, so the step is deterministic.
//   The earlier form (one thread a column, 128-thread blocks: 32 blocks at the 80B's shape, two passes
//   over the state) ran at 5% of the copy rate on the H200 (24 us for 4.2 MB a layer).
//
// strata_gdn_step_rows_f32(q, k, v, g, beta, row_states, state_off, out, Hv, Hg, Dk, Dv, q_scale)
//   One token of each of `rows` distinct sequences: row r's q, k at q + r * Hg * Dk, k + r * Hg * Dk,
//   v and out at + r * Hv * Dv, g and beta at + r * Hv (rows contiguous), its state S at the device
//   address row_states[r] + state_off bytes (as strata_gdn_conv1d_rows_f32's). Each row is
//   strata_gdn_step_f32 bit for bit (the same device function); the rows' states must not overlap.
//   Launch: grid = (ceil(Dv / 32), Hv, rows), block = (256, 1, 1).
//
// strata_gdn_prompt_f32(q, k, v, g, beta, state, out, T, Hv, Hg, Dk, Dv, q_scale, qk_ld, v_ld)
//   The same rule over a prompt of T tokens in one launch, token by token (the recurrent form: the
//   oracle for a chunked WY-form kernel, and T times fewer launches than T steps): q and k of token t
//   at q + t * qk_ld, k + t * qk_ld ([Hg, Dk] each), v at v + t * v_ld ([Hv, Dv]), g and beta [T, Hv],
//   out [T, Hv, Dv]. Same arithmetic in the same order as strata_gdn_step_f32 (the state stays in
//   registers between tokens, which holds the same f32 values), so equal to T steps bit for bit.
//   Launch as strata_gdn_step_f32.
//
// strata_gdn_gates_f32(ba, a, dt_bias, g, beta, T, Hg, r)
//   The decay and write strength of a DeltaNet layer from its ssm_ba projection: ba [T, Hg, 2r] holds,
//   per key head kh, its r value heads' b then their alpha; a [Hv] (ssm_a = -exp(A_log)) and dt_bias
//   [Hv], Hv = Hg * r. For value head h = kh * r + i:
//     g[t, h] = a[h] * softplus(alpha + dt_bias[h]),  softplus(y) = max(y, 0) + log1p(exp(-|y|))
//     beta[t, h] = 1 / (1 + exp(-b))
//   as strata/backends/cpu_linear_attn.py's gdn_gates computes them (numpy's logaddexp form).
//   Launch: grid = (ceil(T * Hv / 256), 1, 1), block = (256, 1, 1); one thread per (t, h).
//
// strata_sigmoid_mul_f32(x, gate, out, rows, n, gate_ld, gate_step)
//   out[r, c] = x[r, c] * (1 / (1 + exp(-gate[r * gate_ld + c * gate_step]))): the sigmoid output gate
//   of the gated attention (gate_step 1, a gate per channel) and of the shared expert (gate_step 0, one
//   gate per row). x and out [rows, n] contiguous; out may alias x.
//   Launch: grid = (ceil(n / 256), min(rows, 65535), 1), block = (256, 1, 1); the blocks stride rows.

#include <cstdint>

#define GDN_MAX_DK 256
#define GDN_MAX_K 8

// One channel's conv step (strata_gdn_conv1d_step_f32's contract): the one-row kernel and the rows
// kernel run this same code, so a row of a batched step is the one-row step bit for bit.
__device__ __forceinline__ void gdn_conv1d_channel(const float* x, float* state, const float* __restrict__ w,
                                                   float* out, int C, int K, int c) {
    const float xc = x[c];
    const float* wc = w + (int64_t)c * K;
    float acc = 0.0f;
    for (int j = 0; j < K - 1; ++j) acc = __fadd_rn(acc, __fmul_rn(wc[j], state[(int64_t)j * C + c]));
    acc = __fadd_rn(acc, __fmul_rn(wc[K - 1], xc));
    for (int j = 0; j + 1 < K - 1; ++j) state[(int64_t)j * C + c] = state[(int64_t)(j + 1) * C + c];
    if (K > 1) state[(int64_t)(K - 2) * C + c] = xc;
    out[c] = acc / (1.0f + expf(-acc));
}

extern "C" __global__ void __launch_bounds__(256) strata_gdn_conv1d_step_f32(const float* x, float* state,
                                                                             const float* __restrict__ w, float* out,
                                                                             int C, int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    gdn_conv1d_channel(x, state, w, out, C, K, c);
}

extern "C" __global__ void __launch_bounds__(256) strata_gdn_conv1d_rows_f32(
        const float* x, const unsigned long long* __restrict__ row_states, int64_t state_off,
        const float* __restrict__ w, float* out, int C, int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int r = blockIdx.y;
    float* state = reinterpret_cast<float*>(row_states[r] + (unsigned long long)state_off);
    gdn_conv1d_channel(x + (int64_t)r * C, state, w, out + (int64_t)r * C, C, K, c);
}

extern "C" __global__ void __launch_bounds__(256) strata_gdn_conv1d_f32(const float* __restrict__ x, float* state,
                                                                        const float* __restrict__ w,
                                                                        float* __restrict__ out, int T, int C, int K,
                                                                        int64_t x_ld) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float win[GDN_MAX_K], taps[GDN_MAX_K];
    for (int j = 0; j < K; ++j) taps[j] = w[(int64_t)c * K + j];
    for (int j = 0; j < K - 1; ++j) win[j] = state[(int64_t)j * C + c];
    for (int t = 0; t < T; ++t) {
        const float xc = x[(int64_t)t * x_ld + c];
        float acc = 0.0f;
        for (int j = 0; j < K - 1; ++j) acc = __fadd_rn(acc, __fmul_rn(taps[j], win[j]));
        acc = __fadd_rn(acc, __fmul_rn(taps[K - 1], xc));
        for (int j = 0; j + 1 < K - 1; ++j) win[j] = win[j + 1];
        if (K > 1) win[K - 2] = xc;
        out[(int64_t)t * C + c] = acc / (1.0f + expf(-acc));
    }
    for (int j = 0; j < K - 1; ++j) state[(int64_t)j * C + c] = win[j];
}

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
__device__ float gdn_block_sum(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();                     // scratch may still be read from an earlier call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) s += scratch[i];
    return s;
}

// q and k of key head kh into shared memory, L2-normalized, q scaled: the same for a step and a prompt.
__device__ void gdn_load_qk(const float* q, const float* k, int Dk, float q_scale, float* qs, float* ks,
                            float* scratch) {
    float q2 = 0.0f, k2 = 0.0f;
    for (int i = threadIdx.x; i < Dk; i += blockDim.x) {
        const float a = q[i], b = k[i];
        qs[i] = a;
        ks[i] = b;
        q2 += a * a;
        k2 += b * b;
    }
    const float q_inv = q_scale / sqrtf(gdn_block_sum(q2, scratch) + 1e-6f);
    const float k_inv = 1.0f / sqrtf(gdn_block_sum(k2, scratch) + 1e-6f);
    __syncthreads();
    for (int i = threadIdx.x; i < Dk; i += blockDim.x) {
        qs[i] *= q_inv;
        ks[i] *= k_inv;
    }
    __syncthreads();
}

constexpr int GDN_COLS = 32;                               // columns of S a block owns: one a lane
constexpr int GDN_ROW_GROUPS = 8;                          // warps; warp w owns rows w, w + 8, ...
constexpr int GDN_ROWS = GDN_MAX_DK / GDN_ROW_GROUPS;      // rows a thread holds at most
constexpr int GDN_THREADS = GDN_COLS * GDN_ROW_GROUPS;

// Column j's rows of one head (stride Dv) held by this thread: s[m] = S[w + 8 m, j], 0 past Dk or Dv.
__device__ __forceinline__ void gdn_load_rows(float (&s)[GDN_ROWS], const float* S, int Dk, int Dv, int w,
                                              bool col) {
#pragma unroll
    for (int m = 0; m < GDN_ROWS; ++m) {
        const int i = w + GDN_ROW_GROUPS * m;
        s[m] = (col && i < Dk) ? S[(int64_t)i * Dv] : 0.0f;
    }
}

__device__ __forceinline__ void gdn_store_rows(const float (&s)[GDN_ROWS], float* S, int Dk, int Dv, int w,
                                               bool col) {
    if (!col) return;
#pragma unroll
    for (int m = 0; m < GDN_ROWS; ++m) {
        const int i = w + GDN_ROW_GROUPS * m;
        if (i < Dk) S[(int64_t)i * Dv] = s[m];
    }
}

// The 8 warps' partial sums of each lane's column, added in warp order (every thread of the column
// gets the same value). part is [GDN_ROW_GROUPS][GDN_COLS] in shared memory; the caller separates two
// uses of one part by a __syncthreads.
__device__ __forceinline__ float gdn_column_sum(float v, float* part, int w, int lane) {
    part[w * GDN_COLS + lane] = v;
    __syncthreads();
    float sum = 0.0f;
#pragma unroll
    for (int r = 0; r < GDN_ROW_GROUPS; ++r) sum += part[r * GDN_COLS + lane];
    return sum;
}

// One token's update of this thread's rows of column j -> out[j] (every thread of the column gets it):
// decay, predict, correct, read. pred and outp are two [8][32] shared arrays, so a token needs two
// block barriers and the next token's pred write cannot race this token's outp reads.
__device__ __forceinline__ float gdn_column(float (&s)[GDN_ROWS], const float* qs, const float* ks, int Dk,
                                            float decay, float b, float vj, float* pred, float* outp, int w,
                                            int lane) {
    float p = 0.0f;
#pragma unroll
    for (int m = 0; m < GDN_ROWS; ++m) {
        const int i = w + GDN_ROW_GROUPS * m;
        if (i < Dk) p += s[m] * decay * ks[i];
    }
    const float d = b * (vj - gdn_column_sum(p, pred, w, lane));
    float o = 0.0f;
#pragma unroll
    for (int m = 0; m < GDN_ROWS; ++m) {
        const int i = w + GDN_ROW_GROUPS * m;
        if (i < Dk) {
            s[m] = s[m] * decay + ks[i] * d;
            o += s[m] * qs[i];
        }
    }
    return gdn_column_sum(o, outp, w, lane);
}

// One token of one sequence (strata_gdn_step_f32's contract), this block's 32 columns of head
// blockIdx.y: the one-row kernel and the rows kernel run this same code, so a row of a batched step is
// the one-row step bit for bit.
__device__ __forceinline__ void gdn_step_block(const float* __restrict__ q, const float* __restrict__ k,
                                               const float* __restrict__ v, const float* __restrict__ g,
                                               const float* __restrict__ beta, float* state, float* out, int Hv,
                                               int Hg, int Dk, int Dv, float q_scale) {
    __shared__ float qs[GDN_MAX_DK], ks[GDN_MAX_DK], scratch[32];
    __shared__ float pred[GDN_THREADS], outp[GDN_THREADS];
    const int h = blockIdx.y, kh = h / (Hv / Hg);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int j = blockIdx.x * GDN_COLS + lane;
    const bool col = j < Dv;
    float* S = state + (int64_t)h * Dk * Dv + j;
    float s[GDN_ROWS];
    gdn_load_rows(s, S, Dk, Dv, w, col);           // in flight while q and k are normalized
    gdn_load_qk(q + (int64_t)kh * Dk, k + (int64_t)kh * Dk, Dk, q_scale, qs, ks, scratch);
    const float o = gdn_column(s, qs, ks, Dk, expf(g[h]), beta[h], col ? v[(int64_t)h * Dv + j] : 0.0f, pred,
                               outp, w, lane);
    gdn_store_rows(s, S, Dk, Dv, w, col);
    if (col && w == 0) out[(int64_t)h * Dv + j] = o;
}

extern "C" __global__ void __launch_bounds__(GDN_THREADS) strata_gdn_step_f32(const float* __restrict__ q,
                                                                              const float* __restrict__ k,
                                                                              const float* __restrict__ v,
                                                                              const float* __restrict__ g,
                                                                              const float* __restrict__ beta,
                                                                              float* state, float* out, int Hv,
                                                                              int Hg, int Dk, int Dv, float q_scale) {
    gdn_step_block(q, k, v, g, beta, state, out, Hv, Hg, Dk, Dv, q_scale);
}

extern "C" __global__ void __launch_bounds__(GDN_THREADS) strata_gdn_step_rows_f32(
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
        const float* __restrict__ g, const float* __restrict__ beta, const unsigned long long* __restrict__ row_states,
        int64_t state_off, float* out, int Hv, int Hg, int Dk, int Dv, float q_scale) {
    const int64_t r = blockIdx.z, qk = (int64_t)Hg * Dk, vo = (int64_t)Hv * Dv;
    float* state = reinterpret_cast<float*>(row_states[r] + (unsigned long long)state_off);
    gdn_step_block(q + r * qk, k + r * qk, v + r * vo, g + r * Hv, beta + r * Hv, state, out + r * vo, Hv, Hg, Dk,
                   Dv, q_scale);
}

extern "C" __global__ void __launch_bounds__(GDN_THREADS) strata_gdn_prompt_f32(const float* __restrict__ q,
                                                                                const float* __restrict__ k,
                                                                                const float* __restrict__ v,
                                                                                const float* __restrict__ g,
                                                                                const float* __restrict__ beta,
                                                                                float* state, float* out, int T,
                                                                                int Hv, int Hg, int Dk, int Dv,
                                                                                float q_scale, int64_t qk_ld,
                                                                                int64_t v_ld) {
    __shared__ float qs[GDN_MAX_DK], ks[GDN_MAX_DK], scratch[32];
    __shared__ float pred[GDN_THREADS], outp[GDN_THREADS];
    const int h = blockIdx.y, kh = h / (Hv / Hg);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int j = blockIdx.x * GDN_COLS + lane;
    const bool col = j < Dv;
    float* S = state + (int64_t)h * Dk * Dv + j;
    float s[GDN_ROWS];
    gdn_load_rows(s, S, Dk, Dv, w, col);
    for (int t = 0; t < T; ++t) {
        gdn_load_qk(q + t * qk_ld + (int64_t)kh * Dk, k + t * qk_ld + (int64_t)kh * Dk, Dk, q_scale, qs, ks, scratch);
        const float o = gdn_column(s, qs, ks, Dk, expf(g[(int64_t)t * Hv + h]), beta[(int64_t)t * Hv + h],
                                   col ? v[t * v_ld + (int64_t)h * Dv + j] : 0.0f, pred, outp, w, lane);
        if (col && w == 0) out[((int64_t)t * Hv + h) * Dv + j] = o;
        __syncthreads();                 // qs and ks are reloaded for the next token
    }
    gdn_store_rows(s, S, Dk, Dv, w, col);
}

extern "C" __global__ void __launch_bounds__(256) strata_gdn_gates_f32(const float* __restrict__ ba,
                                                                       const float* __restrict__ a,
                                                                       const float* __restrict__ dt_bias,
                                                                       float* __restrict__ g,
                                                                       float* __restrict__ beta, int T, int Hg,
                                                                       int r) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int Hv = Hg * r;
    if (i >= (int64_t)T * Hv) return;
    const int t = (int)(i / Hv), h = (int)(i - (int64_t)t * Hv), kh = h / r, j = h - kh * r;
    const float* row = ba + ((int64_t)t * Hg + kh) * 2 * r;
    const float y = __fadd_rn(row[r + j], dt_bias[h]);
    const float sp = __fadd_rn(fmaxf(y, 0.0f), log1pf(expf(-fabsf(y))));
    g[i] = __fmul_rn(a[h], sp);
    beta[i] = 1.0f / (1.0f + expf(-row[j]));
}

extern "C" __global__ void __launch_bounds__(256) strata_sigmoid_mul_f32(const float* x, const float* __restrict__ gate,
                                                                         float* out, int rows, int n,
                                                                         int64_t gate_ld, int gate_step) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const float s = 1.0f / (1.0f + expf(-gate[(int64_t)r * gate_ld + (int64_t)c * gate_step]));
        out[(int64_t)r * n + c] = __fmul_rn(x[(int64_t)r * n + c], s);
    }
}
