// Next-token sampling on the device: temperature, top-k, top-p and one draw per row from a given u.
//
// strata_sample_f32(logits, temperature, top_k, top_p, u, token, prob, V)
//   logits [B, V] f32 row-major; temperature [B] f32, top_k [B] i32, top_p [B] f32, u [B] f64 in
//   [0, 1) (the host or a graph supplies the randomness: same inputs, same token); token [B] i32;
//   prob [B] f32 or null (the drawn token's probability in the final, renormalized distribution).
//
// Semantics (strata/engine/sampler.py's order and draw rule; numpy reference:
// strata/backends/cuda/sample.py sample_reference):
//   x = logits with NaN -> -inf and -0.0 -> +0.0 (the order is by value; ties go to the lower id).
//   temperature <= 0 (or NaN): greedy, token = lowest id of max x, prob = 1.
//   top-k: for 0 < k < V keep C = {i : x_i >= the k-th largest x} (every tie of the k-th value is
//     kept, as the sampler's `z < kth -> -inf`); k <= 0 or k >= V keeps all V. Any k works; the
//     kept set stays in shared memory when it holds <= kCap entries (else the row is re-read).
//   mass: m_i = rint(e_i * 2^40) as uint64 for i in C, e_i = 1 if x_i == max x else
//     expf((x_i - max x) / T) (f32 ops). Integer masses make every sum exact and order-free, so
//     the result is deterministic whatever the launch shape. An entry under 2^-41 of the max has
//     mass 0 and is never drawn (the sampler gives it < 5e-13). A row whose max is +-inf: the
//     maximal entries share the mass equally.
//   top-p (only when p < 1, as the sampler): order C by x descending, id ascending; keep the
//     shortest prefix whose mass reaches target = min(S, max(1, ceil(double(p) * double(S)))),
//     S = sum of m over C (the sampler's searchsorted(cumsum(probs), p)); p <= 0 keeps one entry.
//   draw: N = the kept set, S_N its mass; thr = min(floor(u * double(S_N)), S_N - 1); token =
//     the lowest id i with sum_{j in N, j <= i} m_j > thr (numpy's choice: searchsorted(cdf, u,
//     'right') over ids in order); prob = m_token / S_N.
//
// Launch: grid = (B, 1, 1), block = (1024, 1, 1) exactly (kThreads), static shared ~41 KB. One
// block per row: 11/11/10-bit radix selects (integer histograms in shared memory) find the top-k
// threshold, then the top-p threshold; a hierarchical prefix search in id order finds the draw.
// Typical k (<= ~1000, few ties): 2-4 passes over the row in global memory (0.6 MB at V = 151936,
// L2-resident after the first), the rest in shared memory. k = 0 with p < 1 reads the row ~6 times.

#include <cstdint>
#include "pdl.cuh"

namespace {

constexpr int kThreads = 1024;
constexpr int kBins = 2048;       // histogram bins of the widest radix digit (11 bits)
constexpr int kCap = 2048;        // kept-set entries held in shared memory
constexpr unsigned kFull = 0xffffffffu;
constexpr unsigned long long kOne = 1ull << 40;  // fixed-point mass of the max entry

typedef unsigned long long u64;

// Order-preserving float -> uint32 (NaN as -inf, -0 as +0, so equal values have equal keys).
__device__ __forceinline__ uint32_t key_of(float v) {
    if (isnan(v)) v = -INFINITY;
    if (v == 0.0f) v = 0.0f;
    const uint32_t b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float val_of(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

struct Mass {
    float vmax, T;
    __device__ u64 operator()(uint32_t k) const {
        const float v = val_of(k);
        if (v == vmax) return kOne;
        const float e = expf(__fdiv_rn(__fsub_rn(v, vmax), T));
        return __float2ull_rn(e * 1099511627776.0f);   // * 2^40: exact in f32
    }
};

struct Sel {              // a radix select's state: the digits found so far and what lies above
    uint32_t prefix;
    u64 w_above, w_bin;
    uint32_t c_above, c_bin;
};

struct Smem {
    u64 hw[kBins];
    uint32_t hc[kBins];
    uint32_t ck[kCap];
    int ci[kCap];
    u64 s64[32];
    uint32_t s32[32];
    Sel sel;
    u64 rem;
    int lo, hi, n_cand, found;
};

// The row in global memory, index = token id (16-byte loads when aligned and V % 4 == 0).
struct GlobalSrc {
    const float* x;
    int n;
    __device__ uint32_t key(int j) const { return key_of(x[j]); }
    __device__ int id(int j) const { return j; }
    template <class F> __device__ void each(F f) const {
        int start = 0;
        if (n % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
            const float4* x4 = reinterpret_cast<const float4*>(x);
            const int n4 = n / 4;
            int j = threadIdx.x;
            for (; j + 3 * kThreads < n4; j += 4 * kThreads) {   // 4 loads in flight per thread
                float4 v[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) v[r] = x4[j + r * kThreads];
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int i = 4 * (j + r * kThreads);
                    f(key_of(v[r].x), i), f(key_of(v[r].y), i + 1), f(key_of(v[r].z), i + 2), f(key_of(v[r].w), i + 3);
                }
            }
            for (; j < n4; j += kThreads) {
                const float4 v = x4[j];
                f(key_of(v.x), 4 * j), f(key_of(v.y), 4 * j + 1), f(key_of(v.z), 4 * j + 2), f(key_of(v.w), 4 * j + 3);
            }
            start = 4 * n4;
        }
        for (int i = start + threadIdx.x; i < n; i += kThreads) f(key_of(x[i]), i);
    }
};

// The kept set compacted into shared memory, sorted by id.
struct SmemSrc {
    const uint32_t* k;
    const int* ids;
    int n;
    __device__ uint32_t key(int j) const { return k[j]; }
    __device__ int id(int j) const { return ids[j]; }
    template <class F> __device__ void each(F f) const {
        for (int j = threadIdx.x; j < n; j += kThreads) f(k[j], ids[j]);
    }
};

template <class T> __device__ __forceinline__ T warp_incl_scan(T v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T t = __shfl_up_sync(kFull, v, o);
        if (lane >= o) v += t;
    }
    return v;
}

// Inclusive scan over the block in thread order; *total gets the block's sum. Fixed order.
template <class T> __device__ T block_incl_scan(T v, T* scratch, T* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_incl_scan(v);
    if (lane == 31) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) scratch[lane] = warp_incl_scan(scratch[lane]);
    __syncthreads();
    if (warp > 0) v += scratch[warp - 1];
    *total = scratch[31];
    __syncthreads();
    return v;
}

template <class T> __device__ T block_sum(T v, T* scratch) {
    T total;
    block_incl_scan(v, scratch, &total);
    return total;
}

__device__ uint32_t block_max(uint32_t v, uint32_t* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFull, v, o));
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = scratch[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFull, v, o));
    __syncthreads();
    return v;
}

__device__ __forceinline__ int digit_shift(int pass) { return pass == 0 ? 21 : (pass == 1 ? 10 : 0); }

// One radix digit of a descending weighted select over {key >= lo}: afterwards sh.sel.prefix has
// this digit of the key T with W(key > T) < target <= W(key >= T) (weights: 1, or the mass).
// kMass with pass 0 and p_target >= 0 sets target from the total mass S (returned in *S).
template <bool kMass, class Src>
__device__ void select_pass(const Src& src, int pass, uint32_t lo, u64& target, Mass mass, float p_target,
                            u64* S, Smem& sh) {
    const int shift = digit_shift(pass);
    const uint32_t dmask = pass == 2 ? 0x3ffu : 0x7ffu;
    const int hs = pass == 0 ? 0 : digit_shift(pass - 1);
    const Sel sel = sh.sel;
    for (int b = threadIdx.x; b < kBins; b += kThreads) sh.hw[b] = 0, sh.hc[b] = 0;
    __syncthreads();
    src.each([&](uint32_t k, int) {
        const bool in = k >= lo && (pass == 0 || (k >> hs) == (sel.prefix >> hs));
        const uint32_t bin = (k >> shift) & dmask;
        if (kMass) {
            if (!in) return;
            const u64 m = mass(k);
            if (m == 0) return;
            atomicAdd(&sh.hw[bin], m);
            atomicAdd(&sh.hc[bin], 1u);
        } else {   // counts: one atomic per distinct bin in the warp
            const unsigned peers = __match_any_sync(__activemask(), in ? bin : 0xffffffffu);
            if (in && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&sh.hc[bin], __popc(peers));
        }
    });
    __syncthreads();
    const int t = threadIdx.x;
    const uint32_t c0 = sh.hc[2 * t], c1 = sh.hc[2 * t + 1];
    const u64 w0 = kMass ? sh.hw[2 * t] : c0, w1 = kMass ? sh.hw[2 * t + 1] : c1;
    u64 wtot;
    uint32_t ctot;
    const u64 winc = block_incl_scan<u64>(w0 + w1, sh.s64, &wtot);
    const uint32_t cinc = block_incl_scan<uint32_t>(c0 + c1, sh.s32, &ctot);
    if (kMass && pass == 0 && p_target >= 0.0f) {
        *S = wtot;
        const double want = ceil(static_cast<double>(p_target) * static_cast<double>(wtot));
        target = want >= static_cast<double>(wtot) ? wtot : static_cast<u64>(want);
        target = target < 1 ? 1 : target;
    }
    const u64 a = sel.w_above + (wtot - winc);   // weight above bin 2t+1
    const uint32_t ca = sel.c_above + (ctot - cinc);
    Sel out = sel;
    bool hit = false;
    if (a < target && a + w1 >= target) {
        hit = true, out.w_above = a, out.c_above = ca, out.w_bin = w1, out.c_bin = c1;
        out.prefix |= static_cast<uint32_t>(2 * t + 1) << shift;
    } else if (a + w1 < target && a + w1 + w0 >= target) {
        hit = true, out.w_above = a + w1, out.c_above = ca + c1, out.w_bin = w0, out.c_bin = c0;
        out.prefix |= static_cast<uint32_t>(2 * t) << shift;
    }
    if (hit) sh.sel = out;
    __syncthreads();
}

template <bool kMass, class Src>
__device__ void select_all(const Src& src, uint32_t lo, u64& target, Mass mass, float p_target, u64* S,
                           Smem& sh, int first_pass = 0) {
    for (int pass = first_pass; pass < 3; ++pass) select_pass<kMass>(src, pass, lo, target, mass, p_target, S, sh);
}

// Index j (in src order = id order) of the first entry where the running sum of w(key, j) exceeds
// thr; -1 when the total does not. Narrows [lo, hi) by 32 warp chunks a round, then one warp scans.
template <class Src, class W>
__device__ int prefix_find(const Src& src, W w, u64 thr, Smem& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int lo = 0, hi = src.n;
    u64 rem = thr;
    while (hi - lo > 32) {
        const int c = (hi - lo + 31) / 32;
        const int wlo = lo + warp * c, whi = min(wlo + c, hi);
        u64 s = 0;
#pragma unroll 4
        for (int j = wlo + lane; j < whi; j += 32) s += w(src.key(j), j);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
        if (lane == 0) sh.s64[warp] = s;
        __syncthreads();
        if (threadIdx.x == 0) {
            int found = -1;
            for (int q = 0; q < 32; ++q) {
                if (rem < sh.s64[q]) { found = q; break; }
                rem -= sh.s64[q];
            }
            sh.found = found, sh.rem = rem;
            sh.lo = found < 0 ? hi : lo + found * c;
            sh.hi = found < 0 ? hi : min(lo + (found + 1) * c, hi);
        }
        __syncthreads();
        lo = sh.lo, hi = sh.hi, rem = sh.rem;
        if (sh.found < 0) return -1;
    }
    if (warp == 0) {
        const int j = lo + lane;
        const u64 v = warp_incl_scan<u64>(j < hi ? w(src.key(j), j) : 0);
        const unsigned over = __ballot_sync(kFull, j < hi && v > rem);
        if (lane == 0) sh.found = over ? lo + __ffs(over) - 1 : -1;
    }
    __syncthreads();
    const int r = sh.found;
    __syncthreads();
    return r;
}

// Entries of the global row with key >= lo -> sh.ck / sh.ci, sorted by id (bitonic, padded).
__device__ int compact(const GlobalSrc& g, uint32_t lo, Smem& sh) {
    if (threadIdx.x == 0) sh.n_cand = 0;
    __syncthreads();
    g.each([&](uint32_t k, int i) {
        if (k >= lo) {
            const int s = atomicAdd(&sh.n_cand, 1);
            sh.ck[s] = k, sh.ci[s] = i;
        }
    });
    __syncthreads();
    const int n = sh.n_cand;
    int n2 = 1;
    while (n2 < n) n2 <<= 1;
    for (int j = n + threadIdx.x; j < n2; j += kThreads) sh.ck[j] = 0, sh.ci[j] = 0x7fffffff;
    __syncthreads();
    for (int size = 2; size <= n2; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int t = threadIdx.x; t < n2 / 2; t += kThreads) {
                const int i = 2 * stride * (t / stride) + t % stride, j = i + stride;
                const bool up = (i & size) == 0;
                if ((sh.ci[i] > sh.ci[j]) == up) {
                    const int ti = sh.ci[i]; sh.ci[i] = sh.ci[j]; sh.ci[j] = ti;
                    const uint32_t tk = sh.ck[i]; sh.ck[i] = sh.ck[j]; sh.ck[j] = tk;
                }
            }
            __syncthreads();
        }
    }
    return n;
}

__device__ void greedy(const GlobalSrc& g, int* token, float* prob, Smem& sh) {
    uint32_t best = 0;
    g.each([&](uint32_t k, int) { best = max(best, k); });
    best = block_max(best, sh.s32);
    const int j = prefix_find(g, [&](uint32_t k, int) -> u64 { return k == best; }, 0, sh);
    if (threadIdx.x == 0) {
        token[blockIdx.x] = j;
        if (prob) prob[blockIdx.x] = 1.0f;
    }
}

// top-p, then the draw, over the kept set {key >= K} of src (global row or shared memory).
template <class Src>
__device__ void nucleus_draw(const Src& src, uint32_t K, float T, float p, double u, int* token, float* prob,
                             Smem& sh) {
    uint32_t kmax = 0;
    src.each([&](uint32_t k, int) { if (k >= K) kmax = max(kmax, k); });
    const Mass mass{val_of(block_max(kmax, sh.s32)), T};
    uint32_t P = K;            // nucleus: key > P, or key == P and id <= pid
    int pid = 0x7fffffff;
    u64 SN;
    if (p < 1.0f) {
        if (threadIdx.x == 0) sh.sel = Sel{0, 0, 0, 0, 0};
        __syncthreads();
        u64 S = 0, target = 0;   // set by the first pass from S
        select_all<true>(src, K, target, mass, fmaxf(p, 0.0f), &S, sh);
        const Sel sel = sh.sel;
        P = sel.prefix;
        const u64 mP = mass(P);
        const u64 r = (target - sel.w_above + mP - 1) / mP;   // ties of P needed, in id order
        SN = sel.w_above + r * mP;
        if (r < sel.c_bin) {
            const int j = prefix_find(src, [&](uint32_t k, int) -> u64 { return k == P; }, r - 1, sh);
            pid = src.id(j);
        }
    } else {
        u64 s = 0;
        src.each([&](uint32_t k, int) { if (k >= K) s += mass(k); });
        SN = block_sum<u64>(s, sh.s64);
    }
    auto w = [&](uint32_t k, int j) -> u64 {
        return (k >= K && (k > P || (k == P && src.id(j) <= pid))) ? mass(k) : 0;
    };
    const double f = floor(u * static_cast<double>(SN));
    const u64 thr = f >= static_cast<double>(SN - 1) ? SN - 1 : static_cast<u64>(f > 0.0 ? f : 0.0);
    const int j = prefix_find(src, w, thr, sh);   // found: thr < SN, the mass of the kept set
    if (threadIdx.x == 0 && j >= 0) {
        token[blockIdx.x] = src.id(j);
        if (prob) prob[blockIdx.x] = static_cast<float>(static_cast<double>(mass(src.key(j))) / static_cast<double>(SN));
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads)
strata_sample_f32(const float* __restrict__ logits, const float* __restrict__ temperature,
                  const int* __restrict__ top_k, const float* __restrict__ top_p, const double* __restrict__ u,
                  int* __restrict__ token, float* __restrict__ prob, int V) {
    STRATA_PDL_ENTRY();
    __shared__ Smem sh;
    const int b = blockIdx.x;
    const GlobalSrc g{logits + static_cast<int64_t>(b) * V, V};
    const float T = temperature[b], p = top_p[b];
    const int k = top_k[b];
    if (!(T > 0.0f)) return greedy(g, token, prob, sh);
    uint32_t K = 0;
    if (k > 0 && k < V) {     // the k-th largest key, in up to 3 passes; compact as soon as it fits
        if (threadIdx.x == 0) sh.sel = Sel{0, 0, 0, 0, 0};
        __syncthreads();
        const Mass none{0.0f, 1.0f};
        u64 target = static_cast<u64>(k);
        for (int pass = 0; pass < 3; ++pass) {
            select_pass<false>(g, pass, 0, target, none, -1.0f, nullptr, sh);
            const Sel sel = sh.sel;
            if (sel.c_above + sel.c_bin <= static_cast<uint32_t>(kCap)) {
                const int n = compact(g, sel.prefix, sh);   // key >= the bin's lowest key
                const SmemSrc s{sh.ck, sh.ci, n};
                select_all<false>(s, 0, target, none, -1.0f, nullptr, sh, pass + 1);
                return nucleus_draw(s, sh.sel.prefix, T, p, u[b], token, prob, sh);
            }
        }
        K = sh.sel.prefix;   // more than kCap kept (many ties): work on the row in global memory
    }
    nucleus_draw(g, K, T, p, u[b], token, prob, sh);
}
