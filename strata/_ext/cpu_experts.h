// Expert FFNs on the host's cores, straight from the quantized blobs of the pinned arena (#18 item 2):
// y[t] = down · (silu(gate · x[t]) * (up · x[t])) for a few rows t, with the activations quantized to
// 8 bits in blocks of 32 (a float scale and the block's integer sum per block) and integer dot products
// against the weights' own quants, the way ggml's CPU backend multiplies quantized matrices.
//
// Weight types: Q8_0, Q4_0, Q4_K, Q5_K, Q6_K (strata/quant/dequant.py documents each byte layout).
// Each row of n weights is n / 32 activation blocks; a K-quant superblock of 256 weights spans 8 of them.
//   Q8_0, Q4_0: w = d * q (Q4_0's q = nibble - 8), one d per 32.
//   Q4_K, Q5_K: w = d * sc_j * q - dmin * m_j over sub-blocks j of 32; the m_j term against a block of
//               quantized x is dmin * m_j * xs_j * sum(xq_j), so each x block carries its integer sum.
//   Q6_K:       w = d * sc_k * (q - 32) over sub-blocks k of 16 (int8 scales).
// The inner 32-element integer dot is AVX2 (maddubs on |w| and x with w's sign) where the CPU has it,
// chosen at run time, else plain C++ that the compiler vectorizes. Results: the float sum of
// (weight scale * activation scale * exact integer dot) per block, so against a float64 product of the
// dequantized weights and the dequantized activations the error is f32 rounding only.
//
// Threads: a pool of workers (created on first use, sized by set_threads) takes output rows in chunks;
// the Cython caller releases the GIL around each call.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define STRATA_X86 1
#else
#define STRATA_X86 0
#endif

namespace strata_cpu {

enum QKind { K_Q8_0 = 0, K_Q4_0 = 1, K_Q4_K = 2, K_Q5_K = 3, K_Q6_K = 4 };

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {                      // subnormal: normalize
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// ---- 32-element integer dots ---------------------------------------------------------------------

// sum of w[i] * x[i] over 32 int8 pairs; also the two halves of 16 (for Q6_K's scales)
static inline void dot32_scalar(const int8_t* w, const int8_t* x, int32_t* lo, int32_t* hi) {
    int32_t a = 0, b = 0;
    for (int i = 0; i < 16; i++) a += (int32_t)w[i] * x[i];
    for (int i = 16; i < 32; i++) b += (int32_t)w[i] * x[i];
    *lo = a;
    *hi = b;
}

// ---- quantized activations -----------------------------------------------------------------------

struct QRow {                  // one row of n activations as n / 32 blocks
    const int8_t* q;
    const float* scale;
    const int32_t* sum;
    const float* ssum;         // scale * sum, the K-quants' min term's factor
};

// x [n] -> q [n], scale [n/32], sum [n/32]: scale = amax / 127, q = round(x / scale)
static inline void quantize_row(const float* x, int n, int8_t* q, float* scale, int32_t* sum) {
    for (int b = 0; b < n / 32; b++) {
        const float* xb = x + 32 * b;
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(xb[i]));
        float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t s = 0;
        for (int i = 0; i < 32; i++) {
            int v = (int)std::nearbyint(xb[i] * inv);
            v = std::min(127, std::max(-127, v));
            q[32 * b + i] = (int8_t)v;
            s += v;
        }
        scale[b] = d;
        sum[b] = s;
    }
}

// ---- weight groups unpacked once, dotted against every activation row -----------------------------

// A group: 256 weights of a K-quant superblock, or 32 of a Q8_0/Q4_0 block. q holds the signed quants,
// s16 the float scale of each 16 (d * sc), m32 the float min of each 32 (dmin * m; zero without mins).
struct Group {
    alignas(32) int8_t q[256];
    float s16[16];
    float m32[8];
    int subs;                  // sub-blocks of 32 in the group
    bool mins;
};

static inline const float* f16_table() {
    static const std::vector<float> table = [] {
        std::vector<float> t(65536);
        for (uint32_t h = 0; h < 65536; h++) t[h] = f16_to_f32((uint16_t)h);
        return t;
    }();
    return table.data();
}

static inline void unpack_k4_scales(const uint8_t* p, uint8_t* sc, uint8_t* m) {
    for (int j = 0; j < 4; j++) {
        sc[j] = p[j] & 0x3F;
        m[j] = p[4 + j] & 0x3F;
        sc[4 + j] = (p[8 + j] & 0x0F) | ((p[j] >> 6) << 4);
        m[4 + j] = (p[8 + j] >> 4) | ((p[4 + j] >> 6) << 4);
    }
}

static inline int group_weights(int kind) { return kind == K_Q8_0 || kind == K_Q4_0 ? 32 : 256; }

static inline size_t group_bytes(int kind) {
    switch (kind) {
        case K_Q8_0: return 34;
        case K_Q4_0: return 18;
        case K_Q4_K: return 144;
        case K_Q5_K: return 176;
        case K_Q6_K: return 210;
    }
    return 0;
}

static inline size_t row_bytes(int kind, int n) { return (size_t)n / group_weights(kind) * group_bytes(kind); }

// the scales of a group (the same in both paths); the quants are unpacked by the path's own code
static inline void group_scales(int kind, const uint8_t* w, const float* f16, Group& g) {
    g.mins = kind == K_Q4_K || kind == K_Q5_K;
    if (kind == K_Q8_0 || kind == K_Q4_0) {
        g.subs = 1;
        g.s16[0] = g.s16[1] = f16[rd16(w)];
    } else if (kind == K_Q6_K) {
        g.subs = 8;
        float d = f16[rd16(w + 208)];
        const int8_t* sc = (const int8_t*)(w + 192);
        for (int k = 0; k < 16; k++) g.s16[k] = d * sc[k];
    } else {
        g.subs = 8;
        float d = f16[rd16(w)], dmin = f16[rd16(w + 2)];
        uint8_t sc[8], m[8];
        unpack_k4_scales(w + 4, sc, m);
        for (int j = 0; j < 8; j++) {
            g.s16[2 * j] = g.s16[2 * j + 1] = d * sc[j];
            g.m32[j] = dmin * m[j];
        }
    }
}

static inline void unpack_scalar(int kind, const uint8_t* w, Group& g) {
    int8_t* q = g.q;
    switch (kind) {
        case K_Q8_0:
            std::memcpy(q, w + 2, 32);
            break;
        case K_Q4_0:
            for (int i = 0; i < 16; i++) {
                q[i] = (int8_t)((w[2 + i] & 0x0F) - 8);
                q[16 + i] = (int8_t)((w[2 + i] >> 4) - 8);
            }
            break;
        case K_Q4_K:
        case K_Q5_K: {
            const bool five = kind == K_Q5_K;
            const uint8_t* qh = w + 16;
            const uint8_t* qs = w + (five ? 48 : 16);
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++) {
                    q[64 * c + l] = (int8_t)(qs[32 * c + l] & 0x0F);
                    q[64 * c + 32 + l] = (int8_t)(qs[32 * c + l] >> 4);
                }
            if (five)
                for (int j = 0; j < 8; j++)
                    for (int l = 0; l < 32; l++) q[32 * j + l] |= (int8_t)(((qh[l] >> j) & 1) << 4);
            break;
        }
        case K_Q6_K:
            for (int h = 0; h < 2; h++)
                for (int p = 0; p < 4; p++)
                    for (int l = 0; l < 32; l++) {
                        uint8_t b = w[64 * h + 32 * (p & 1) + l];
                        int low = p < 2 ? (b & 0x0F) : (b >> 4);
                        int top = (w[128 + 32 * h + l] >> (2 * p)) & 3;
                        q[128 * h + 32 * p + l] = (int8_t)((low | (top << 4)) - 32);
                    }
            break;
    }
}

// out[t * stride] += the group's dot with activation row t, for every t
static inline void group_dot_scalar(const Group& g, const QRow* xs, int T, int b0, float* out, size_t stride) {
    for (int t = 0; t < T; t++) {
        float acc = 0.f;
        for (int k = 0; k < g.subs; k++) {
            int b = b0 + k;
            int32_t lo = 0, hi = 0;
            dot32_scalar(g.q + 32 * k, xs[t].q + 32 * b, &lo, &hi);
            acc += xs[t].scale[b] * (g.s16[2 * k] * (float)lo + g.s16[2 * k + 1] * (float)hi);
            if (g.mins) acc -= g.m32[k] * xs[t].ssum[b];
        }
        out[t * stride] += acc;
    }
}

// out[t * stride] = row w (n weights of `kind`) · activation row t, for t < T: each group's scales,
// its weights unpacked, then their dots with the rows (UNPACK and DOT: the scalar or AVX2 pair)
#define STRATA_ROW_DOTS(NAME, ATTR, UNPACK, DOT)                                                   \
    ATTR static void NAME(int kind, const uint8_t* w, const QRow* xs, int T, int n, float* out,      \
                          size_t stride) {                                                          \
        const float* f16 = f16_table();                                                             \
        const int gw = group_weights(kind);                                                         \
        const size_t gb = group_bytes(kind);                                                        \
        Group g;                                                                                    \
        for (int t = 0; t < T; t++) out[t * stride] = 0.f;                                          \
        for (int i = 0; i < n / gw; i++, w += gb) {                                                 \
            group_scales(kind, w, f16, g);                                                          \
            UNPACK(kind, w, g);                                                                     \
            DOT(g, xs, T, i * gw / 32, out, stride);                                                \
        }                                                                                           \
    }

#if STRATA_X86
__attribute__((target("avx2"))) static inline void unpack_avx2(int kind, const uint8_t* w, Group& g) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    int8_t* q = g.q;
    switch (kind) {
        case K_Q8_0:
            _mm256_store_si256((__m256i*)q, _mm256_loadu_si256((const __m256i*)(w + 2)));
            break;
        case K_Q4_0: {
            __m128i v = _mm_loadu_si128((const __m128i*)(w + 2));
            __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
            _mm256_store_si256((__m256i*)q, _mm256_sub_epi8(_mm256_and_si256(both, lo4), _mm256_set1_epi8(8)));
            break;
        }
        case K_Q4_K:
        case K_Q5_K: {
            const bool five = kind == K_Q5_K;
            const uint8_t* qs = w + (five ? 48 : 16);
            __m256i qh = five ? _mm256_loadu_si256((const __m256i*)(w + 16)) : _mm256_setzero_si256();
            const __m256i one = _mm256_set1_epi8(1);
            for (int c = 0; c < 4; c++) {
                __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
                __m256i a = _mm256_and_si256(v, lo4), b = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
                if (five) {
                    __m256i ha = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one);
                    __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one);
                    a = _mm256_or_si256(a, _mm256_slli_epi16(ha, 4));
                    b = _mm256_or_si256(b, _mm256_slli_epi16(hb, 4));
                }
                _mm256_store_si256((__m256i*)(q + 64 * c), a);
                _mm256_store_si256((__m256i*)(q + 64 * c + 32), b);
            }
            break;
        }
        case K_Q6_K: {
            const __m256i three = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
            for (int h = 0; h < 2; h++) {
                __m256i l0 = _mm256_loadu_si256((const __m256i*)(w + 64 * h));
                __m256i l1 = _mm256_loadu_si256((const __m256i*)(w + 64 * h + 32));
                __m256i qh = _mm256_loadu_si256((const __m256i*)(w + 128 + 32 * h));
                __m256i low[4] = {_mm256_and_si256(l0, lo4), _mm256_and_si256(l1, lo4),
                                  _mm256_and_si256(_mm256_srli_epi16(l0, 4), lo4),
                                  _mm256_and_si256(_mm256_srli_epi16(l1, 4), lo4)};
                for (int p = 0; p < 4; p++) {
                    __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), three);
                    __m256i v = _mm256_or_si256(low[p], _mm256_slli_epi16(top, 4));
                    _mm256_store_si256((__m256i*)(q + 128 * h + 32 * p), _mm256_sub_epi8(v, off));
                }
            }
            break;
        }
    }
}

// the products of one sub-block: |w| * (x with w's sign), or w * x directly where every w >= 0
// (Q4_K, Q5_K: maddubs reads w as unsigned); exact while |x| <= 127
__attribute__((target("avx2"))) static inline __m256i sub_dot_avx2(__m256i w, __m256i x, bool unsigned_w) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p16 = unsigned_w ? _mm256_maddubs_epi16(w, x) : _mm256_maddubs_epi16(_mm256_sign_epi8(w, w),
                                                                                   _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(p16, ones);
}

__attribute__((target("avx2,fma"))) static inline float hsum_avx2(__m256 acc) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) static inline void group_dot_avx2(const Group& g, const QRow* xs, int T,
                                                                       int b0, float* out, size_t stride) {
    const bool uw = g.mins;
    for (int t = 0; t < T; t++) {
        const QRow& xr = xs[t];
        __m256 acc = _mm256_setzero_ps();
        float mins = 0.f;
        for (int k = 0; k < g.subs; k++) {
            const int b = b0 + k;
            const __m256i w = _mm256_load_si256((const __m256i*)(g.q + 32 * k));
            const __m256i x = _mm256_loadu_si256((const __m256i*)(xr.q + 32 * b));
            const float xsb = xr.scale[b];
            const __m256 sv = _mm256_set_m128(_mm_set1_ps(g.s16[2 * k + 1] * xsb), _mm_set1_ps(g.s16[2 * k] * xsb));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sub_dot_avx2(w, x, uw)), sv, acc);
            if (uw) mins += g.m32[k] * xr.ssum[b];
        }
        out[t * stride] += hsum_avx2(acc) - mins;
    }
}

STRATA_ROW_DOTS(row_dots_avx2, __attribute__((target("avx2,fma"))), unpack_avx2, group_dot_avx2)
#endif

STRATA_ROW_DOTS(row_dots_scalar, , unpack_scalar, group_dot_scalar)
#undef STRATA_ROW_DOTS

// out[t * stride] = row w (n weights of `kind`) · activation row t, for t < T
typedef void (*RowDots)(int, const uint8_t*, const QRow*, int, int, float*, size_t);

static inline RowDots pick_row_dots(bool allow_simd) {
#if STRATA_X86
    if (allow_simd && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return row_dots_avx2;
#endif
    (void)allow_simd;
    return row_dots_scalar;
}

// ---- a pool of workers ---------------------------------------------------------------------------

class Pool {
  public:
    static Pool& get() {
        static Pool pool;
        return pool;
    }
    int threads() const { return (int)workers_.size() + 1; }
    void resize(int n) {
        stop();
        stopping_ = false;
        for (int i = 1; i < std::max(1, n); i++) workers_.emplace_back([this] { loop(); });
    }
    // fn(i) for i in [0, n), chunks taken by the caller and every worker
    void run(int n, int chunk, const std::function<void(int, int)>& fn) {
        if (workers_.empty() || n <= chunk) {
            fn(0, n);
            return;
        }
        std::unique_lock<std::mutex> lock(mu_);
        job_ = &fn;
        n_ = n;
        chunk_ = chunk;
        next_.store(0);
        active_ = (int)workers_.size();
        generation_++;
        lock.unlock();
        cv_.notify_all();
        work();
        lock.lock();
        done_cv_.wait(lock, [this] { return active_ == 0; });
        job_ = nullptr;
    }
    ~Pool() { stop(); }

  private:
    Pool() { resize((int)std::min(16u, std::max(1u, std::thread::hardware_concurrency()))); }
    void work() {
        for (;;) {
            int lo = next_.fetch_add(chunk_);
            if (lo >= n_) return;
            (*job_)(lo, std::min(n_, lo + chunk_));
        }
    }
    void loop() {
        uint64_t seen = 0;
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
            cv_.wait(lock, [&] { return stopping_ || generation_ != seen; });
            if (stopping_) return;
            seen = generation_;
            lock.unlock();
            work();
            lock.lock();
            if (--active_ == 0) done_cv_.notify_one();
        }
    }
    void stop() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stopping_ = true;
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
        workers_.clear();
    }
    std::vector<std::thread> workers_;
    std::mutex mu_;
    std::condition_variable cv_, done_cv_;
    const std::function<void(int, int)>* job_ = nullptr;
    std::atomic<int> next_{0};
    int n_ = 0, chunk_ = 1, active_ = 0;
    uint64_t generation_ = 0;
    bool stopping_ = false;
};

// ---- matrix products and the expert FFN ----------------------------------------------------------

// y[t, r] = W[r] · x[t] for rows r of W [R, n] (type kind), activations x already quantized
static inline void matmul_q(int kind, const uint8_t* W, int R, int n, const std::vector<QRow>& xs, float* y,
                            RowDots dots) {
    const size_t rb = row_bytes(kind, n);
    const int T = (int)xs.size();
    Pool::get().run(R, 16, [&](int lo, int hi) {
        for (int r = lo; r < hi; r++) dots(kind, W + rb * r, xs.data(), T, n, y + r, (size_t)R);
    });
}

struct QBuf {                  // T rows of n quantized activations
    std::vector<int8_t> q;
    std::vector<float> scale, ssum;
    std::vector<int32_t> sum;
    std::vector<QRow> rows;
    void fill(const float* x, int T, int n) {
        q.resize((size_t)T * n);
        scale.resize((size_t)T * n / 32);
        sum.resize((size_t)T * n / 32);
        ssum.resize((size_t)T * n / 32);
        rows.resize(T);
        for (int t = 0; t < T; t++) {
            quantize_row(x + (size_t)t * n, n, q.data() + (size_t)t * n, scale.data() + (size_t)t * n / 32,
                         sum.data() + (size_t)t * n / 32);
            const size_t o = (size_t)t * n / 32;
            for (int b = 0; b < n / 32; b++) ssum[o + b] = scale[o + b] * (float)sum[o + b];
            rows[t] = QRow{q.data() + (size_t)t * n, scale.data() + o, sum.data() + o, ssum.data() + o};
        }
    }
};

// out [T, D] = down · (silu(gate · x) * (up · x)); gate, up [I, D], down [D, I]
static inline void expert_ffn(int kg, const uint8_t* gate, int ku, const uint8_t* up, int kd, const uint8_t* down,
                              int D, int I, const float* x, int T, float* out, bool simd) {
    RowDots dot = pick_row_dots(simd);
    QBuf qx, qh;
    qx.fill(x, T, D);
    std::vector<float> g((size_t)T * I), u((size_t)T * I);
    matmul_q(kg, gate, I, D, qx.rows, g.data(), dot);
    matmul_q(ku, up, I, D, qx.rows, u.data(), dot);
    for (size_t i = 0; i < g.size(); i++) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    qh.fill(g.data(), T, I);
    matmul_q(kd, down, D, I, qh.rows, out, dot);
}

}  // namespace strata_cpu
