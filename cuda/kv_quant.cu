// Quantized KV cells: the append kernels that quantize K/V rows on write, the Hadamard rotation of
// head vectors, and split-K decode attention reading the quantized planes directly. The formats are
// strata/quant/kv.py's (its module doc is the exact rule; these kernels match it bit for bit):
//
//   int8  values int8 [rows, Hk, Dh], scales f16 [rows, Hk, Dh / 64]: d = f16(amax / 127) per 64
//         values, q = clamp(rint(x / d), -127, 127) (0 where d = 0); x ~ q d.
//   q4r   the head vector rotated, y = H x (normalized Walsh-Hadamard, butterflies in a fixed order
//         in f32, then one multiply by rot_scale = f32(1 / sqrt(Dh))); per 32 values m = the y of
//         largest |y| (the first on ties), d = f16(m / -8), q = min(15, floor(y / d + 8.5)) (8 where
//         d = 0); values uint8 [rows, Hk, Dh / 2], value 2i in the low nibble of logical byte i, the
//         bytes of a head vector stored in the decode's lane order (cuda/kv_codec.cuh's q4_byte_pos: a
//         quad lane's 4 bytes of every block in one run); scales f16 [rows, Hk, Dh / 32]; y ~ (q - 8) d.
//
// A rotated K is read with a rotated query (q . k = Hq . Hk): strata_hadamard_f32 rotates q first. A
// rotated V leaves the weighted sum rotated: strata_hadamard_f32 un-rotates the combined output (H is
// its own inverse). A decode step fuses both: cuda/decode_fused.cu's strata_qk_norm_rope_kv_<fmt> does
// QK-norm, RoPE, q's rotation and these appends in one launch, and cuda/attention.cu's
// strata_attention_decode_combine_rot_f32 un-rotates in the combine; the codecs' arithmetic is
// cuda/kv_codec.cuh's, shared, so the fused kernels match these bit for bit. Dequantized values q d are exact in f32 (at most 7 + 11 significant bits), so the
// decode's only rounding is its f32 arithmetic, as the f16 kernel's.
//
// Entry points (Dh in {64, 128, 256}):
//   strata_kv_append_int8(x, cells, values, scales, T, Hk, Dh)             grid (T, Hk), block 32
//   strata_kv_append_q4r(x, cells, values, scales, T, Hk, Dh, rot_scale)    grid (T, Hk), block 32
//   strata_hadamard_f32(x, rows, Dh, rot_scale)                            grid (rows), block 32; in place
//   strata_kv_dequant_int8_f16(values, scales, out, rows, Hk, Dh)          grid (rows, Hk), block 32
//   strata_kv_dequant_q4r_f16(values, scales, out, rows, Hk, Dh)           grid (rows, Hk), block 32
//     cells 0..rows-1 as f16 [rows, Hk, Dh] (q4r: still rotated), for the f16 prompt attention
//   strata_attention_decode_<fmt>_d<Dh>_g<GP>(q, k_values, k_scales, v_values, v_scales, lengths,
//       bases, part_acc, part_ml, H, Hk, max_cells, num_splits, scale, window, ring, vram_k_values,
//       vram_k_scales, vram_v_values, vram_v_scales, vram_cells)
//                                                                          grid (splits, Hk, B), block 128,
//       dynamic shared memory: strata.backends.cuda.kernels.decode_quant_shared's (the cp.async ring at Dh
//       128, which the host gives on sm_90 and sm_100; splits of DecodeQ::RING_FROM cells and more use it)
//       or 0 (a tile a warp in registers; the same bits)
//     row b reads cells 0..lengths[b]-1 of its sequence, from cell bases[b] (b * max_cells if null);
//     window > 0: only its last `window` positions; ring > 0: position p in cell p % ring (the MTP
//     drafter's K/V ring; attention.cu's decode header); 0, 0: bit for bit as without them;
//     vram_cells > 0 (--kv-resident's VRAM window): the vram planes [slots, vram_cells, Hk, ...] hold
//     each sequence's newest cells at p % vram_cells of its ring (with bases, ring bases[b] / max_cells:
//     strata_kv::vram_ring_first), the newest vram_cells - 16 (kVramSlack) of them read
//     from strata_kv::VramWindow's `from` on (the older ones in place over the bus), bit for bit the
//     same sums: only the addresses change
//     fmt: int8 (int8 K and V), q4_0 (q4r K and V), k8v4 (int8 K, q4r V); GP = G = H / Hk rounded up
//     to 1, 2, 4, 8, 16 (Dh 256: <= 8). The partials are attention.cu's (its combine reads them):
//     part_acc [B, H, splits, Dh], part_ml [B, H, splits, 2] (running max in the log2 domain, sum).
//
// The decode runs both products on the tensor cores (mma.sync m16n8k16, f16 operands, f32 sums) with
// operands that are exact (the codes, V's codes times a power of two) or split into hi + lo halves (the
// query, the probabilities times V's scale mantissas), so it keeps f32 accuracy; see "decode on the
// tensor cores" below. Each lane reads its own bytes of each cell straight from global memory (int8 K:
// 16 bytes a block), no cell needs a warp reduction, and the warps merge in shared memory at the end.

#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include "decode_mma.cuh"
#include "kv_codec.cuh"
#include "pdl.cuh"

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kWarps = 4;

using strata_dec::as_h2;
using strata_dec::as_u32;
using strata_dec::load_raw;
using strata_dec::mma16816;
using strata_dec::RawT;
using strata_dec::split_pair;
using strata_kv::hadamard_warp;
using strata_kv::load_row;

template <bool Q4, int PER>
__device__ __forceinline__ void append_row(const float* x, const int* cells, void* values, __half* scales, int Hk,
                                           float rot_scale) {
    const int t = blockIdx.x, kvh = blockIdx.y, lane = threadIdx.x;
    float v[PER];
    load_row<PER>(x + (static_cast<int64_t>(t) * Hk + kvh) * 32 * PER + lane * PER, v);
    strata_kv::append_head<Q4, PER>(v, lane, static_cast<int64_t>(cells[t]) * Hk + kvh, values, scales, rot_scale);
}

// PER values of one cell's row starting at dim lane * PER, dequantized (int8 or q4r planes).
template <bool Q4, int PER>
__device__ __forceinline__ void load_cell(const void* values, const __half* scales, int64_t row, int lane,
                                          float (&out)[PER]) {
    constexpr int DH = 32 * PER;
    if constexpr (Q4) {
        const float d = __half2float(scales[row * (DH / 32) + lane * PER / 32]);
        const uint8_t* p = static_cast<const uint8_t*>(values) + row * (DH / 2);
#pragma unroll
        for (int i = 0; i < PER / 2; ++i) {
            const int b = p[strata_kv::q4_byte_pos(lane * (PER / 2) + i, PER)];
            out[2 * i] = static_cast<float>((b & 0xF) - 8) * d;
            out[2 * i + 1] = static_cast<float>((b >> 4) - 8) * d;
        }
    } else {
        const float d = __half2float(scales[row * (DH / 64) + lane * PER / 64]);
        const int8_t* p = static_cast<const int8_t*>(values) + row * DH + lane * PER;
#pragma unroll
        for (int i = 0; i < PER; ++i) out[i] = static_cast<float>(p[i]) * d;
    }
}

// ---- decode on the tensor cores --------------------------------------------------------------------
//
// Both products run as mma.sync.m16n8k16 (f16 inputs, f32 accumulation) with every operand exact or
// split so that the f32 result keeps f32 accuracy:
//   scores  S [16 rows x 8 cells] = Q [16 rows x 16 dims] K^T, one K scale block per 16-dim slice,
//           an accumulator per block, s = sum_b dK[cell, b] C_b. K's codes are exact in f16. The
//           query of each head is scaled by 2^e (max |q| in [2^13, 2^14), exact) and split into
//           hi + lo f16 halves (22 bits); GP <= 8 stacks them as rows g (hi) and g + 8 (lo) of one
//           MMA, GP = 16 runs a hi and a lo MMA into one accumulator.
//   values  O [16 rows x 8 dims] += P' [16 rows x 16 cells] V, one V scale block per 8-dim n-tile.
//           dV = mant * 2^k: the power of two goes into V's codes (code * 2^k is exact in f16), the
//           mantissa (|mant| < 128) into P' = p * mant, split into hi + lo halves as the query is.
// A warp takes tiles of NSUB * 16 cells; lane (g = lane / 4, t = lane % 4) loads K of cells g and
// 8 + g of each 16 (the B operand: 4 dims of each 16-dim slice, its own 16 or 8 consecutive dims of
// each K block), and V and both scales of cells 2t, 2t + 1, 2t + 8, 2t + 9 (V's B operand: dim g of
// each 8-dim n-tile, 8 or 4 consecutive dims of each V block), all straight from global memory, so
// no cell needs a warp reduction. The score layout of the first MMA is the row layout of the P'
// operand, so p never leaves its lane; the online softmax (max over the tile: 2 shuffles) rescales
// the accumulator once per tile. The warps merge in shared memory at the end.

// bytes x.b[i], x.b[i + 1] of biased int8 codes (code ^ 0x80) -> {code, code} as f16, exact
// (sel 0x4140: bytes 0, 1; 0x4342: bytes 2, 3): 0x64XX is 1024 + XX, less 1152 = 1024 + 128.
__device__ __forceinline__ uint32_t i8_pair(uint32_t x, uint32_t sel) {
    return as_u32(__hsub2(as_h2(__byte_perm(x, 0x64646464u, sel)), as_h2(0x64806480u)));
}
// (a & b) | c in one instruction (the compiler makes two of it when b and c are both constants)
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// nibbles at bits [shift, shift + 4) and [16 + shift, 20 + shift) of w -> {code - 8, code - 8}, exact
__device__ __forceinline__ uint32_t q4_pair(uint32_t w, int shift) {
    return as_u32(__hsub2(as_h2(and_or(w >> shift, 0x000F000Fu, 0x64006400u)), as_h2(0x64086408u)));
}
// the same from bits [4, 8) and [20, 24) of w with no shift: {16 (code - 8), 16 (code - 8)}, exact
// (0x6400 | code << 4 is 1024 + 16 code)
__device__ __forceinline__ uint32_t q4_pair16(uint32_t w) {
    return as_u32(__hsub2(as_h2(and_or(w, 0x00F000F0u, 0x64006400u)), as_h2(0x64806480u)));
}
// NW consecutive words at p into w (16-byte runs as uint4, 8 bytes as uint2), zeros where !valid.
template <int NW>
__device__ __forceinline__ void load_run(const uint8_t* p, bool valid, uint32_t* w) {
    if constexpr (NW % 4 == 0) {
#pragma unroll
        for (int i = 0; i < NW / 4; ++i) {
            const uint4 v = load_raw<16>(p + 16 * i, valid);
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
    } else if constexpr (NW == 2) {
        const uint2 v = load_raw<8>(p, valid);
        w[0] = v.x, w[1] = v.y;
    } else {
        static_assert(NW == 1, "runs of 1, 2 or a multiple of 4 words");
        w[0] = load_raw<4>(p, valid);
    }
}

template <bool Q4, int DH>
struct Plane {
    static constexpr int BS = Q4 ? 32 : 64;      // values per scale
    static constexpr int NB = DH / BS;           // scale blocks per head vector
    static constexpr int ROW = Q4 ? DH / 2 : DH; // value bytes per head vector
};

// K (the scores' B operand): the dim of slice j's k position 2t + {0, 1} (e = 0, 1) and 2t + 8 + {0, 1}
// (e = 2, 3) for lane t of its group. Lane t's dims in K block b are b BS + t BS/4 + [0, BS/4): int8 16
// consecutive codes a block (word jj of the 16 bytes is slice jj), q4 8 (4 bytes; q4_pair's order).
template <bool Q4>
__device__ __forceinline__ int k_dim(int j, int t, int e) {
    if constexpr (Q4) {
        const int jj = j & 1;
        return (j >> 1) * 32 + t * 8 + 2 * jj + (e >> 1) + 4 * (e & 1);
    } else {
        return (j >> 2) * 64 + t * 16 + (j & 3) * 4 + e;
    }
}
// V (the values' B operand): the dim of n-tile (block bv, ii)'s column n. Lane g holds column g.
template <bool Q4>
__device__ __forceinline__ int v_dim(int bv, int ii, int n) {
    return Q4 ? bv * 32 + n * 4 + ii : bv * 64 + n * 8 + ii;
}

// A lane's raw 16-bit half `i` of a plane's scales (RawT: 2, 4, 8 or 16 bytes), as the low bits of a word.
__device__ __forceinline__ uint32_t raw_word(unsigned short r, int) { return r; }
__device__ __forceinline__ uint32_t raw_word(uint32_t r, int) { return r; }
__device__ __forceinline__ uint32_t raw_word(uint2 r, int w) { return w ? r.y : r.x; }
__device__ __forceinline__ uint32_t raw_word(uint4 r, int w) { return w == 0 ? r.x : w == 1 ? r.y : w == 2 ? r.z : r.w; }
// {scale i of cell a, scale i of cell b} as an f16 pair
template <typename T>
__device__ __forceinline__ uint32_t scale_pair(const T& a, const T& b, int i) {
    return __byte_perm(raw_word(a, i >> 1), raw_word(b, i >> 1), (i & 1) ? 0x7632 : 0x5410);
}
// V's scales dV of two cells (an f16 pair) as mant 2^k: pw = {2^k0, 2^k1} (f16, for the codes) and the
// mantissas in f32, k = the f16 exponent clamped to [1, KMAX] less 15. mant = dV 2^-k is an f16 product
// by a power of two that stays in range (|mant| in [1, 2) for normal dV, below 1 for subnormal or zero
// ones, at most 2^(30 - KMAX) when clamped), so it is exact, the f32 product dV * 2^-k itself.
template <int KMAX>
__device__ __forceinline__ void scale_split(uint32_t d2, uint32_t& pw, float& m0, float& m1) {
    uint32_t e = (d2 >> 10) & 0x001F001Fu;
    e = __vminu2(__vmaxu2(e, 0x00010001u), static_cast<uint32_t>(KMAX) * 0x00010001u);
    pw = e << 10;
    const float2 m = __half22float2(__hmul2(as_h2(d2), as_h2(0x78007800u - pw)));   // 2^(15 - e): (30 - e) << 10
    m0 = m.x, m1 = m.y;
}

// cp.async: N (4, 8 or 16) bytes from global src to shared dst, in the group the next commit closes
template <int N>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    if constexpr (N == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
    else asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(d), "l"(src), "n"(N));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
    uint32_t n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

template <bool KQ4, bool VQ4, int DH, int GP>
struct DecodeQ {
    using KP = Plane<KQ4, DH>;
    using VP = Plane<VQ4, DH>;
    static constexpr bool STACK = GP <= 8;              // q and p as rows g (hi) and g + 8 (lo) of one MMA
    static constexpr int NPASS = STACK ? 1 : 2;         // else a hi and a lo MMA
    static constexpr int NH = STACK ? 1 : 2;            // heads per lane: g (and g + 8)
    static constexpr int NSLICE = DH / 16;
    static constexpr int SPB = KP::BS / 16;             // K slices per K block
    static constexpr int NTB = VP::BS / 8;              // V n-tiles per V block
    static constexpr int NT = DH / 8;                   // V n-tiles
    static constexpr int NSUB = DH <= 128 ? 2 : 1;      // 16-cell sub-tiles a warp loads at once
    static constexpr int TILE = 16 * NSUB;
    static constexpr int KBYTES = KP::ROW / KP::NB / 4; // a lane's K bytes per block (16 or 4)
    static constexpr int VBYTES = VP::ROW / VP::NB / 8; // a lane's V bytes per block (8 or 2)
    // q4 planes in q4_byte_pos's order: quad lane t's 4 bytes of every block are one run of NB words
    // at t NB words; V's lane g takes the halves (g & 1) of run g / 2 (its 2 bytes a block)
    // int8 V's codes can be at most 127 * 2^9 in f16 (dV < 1024), q4's 8 * 2^12 (|dV| < 8192)
    static constexpr int KMAX = VQ4 ? 27 : 24;
    // STAGED (PLAIN spans at Dh 128 given the dynamic shared memory): a ring of NST tiles a warp, each
    // tile's planes copied whole by cp.async (K codes [TILE][ROW], K scales [TILE][2 NB], V codes, V
    // scales) NST - 1 tiles ahead of the one read, so a warp has up to NST tiles of bytes in flight
    // where registers hold one. 16-byte chunks of a cell's codes are placed XOR-swizzled (k_chunk,
    // v_chunk) so the lanes' reads of a tile (cells g, 8 + g for K; 2t, 2t + 1, ... for V) meet no
    // bank twice in a phase. NST keeps a block under 100 KB (two a multiprocessor of 228 KB).
    static constexpr int KS = 2 * KP::NB, VS = 2 * VP::NB;          // scale bytes a cell
    static constexpr int ST_KS = TILE * KP::ROW, ST_VW = ST_KS + TILE * KS, ST_VS = ST_VW + TILE * VP::ROW;
    static constexpr int STAGE = ST_VS + TILE * VS;                   // bytes a tile
    static constexpr int NST = (KQ4 && VQ4) ? 4 : (!KQ4 && !VQ4) ? 2 : 3;
    static constexpr uint32_t RING_BYTES = static_cast<uint32_t>(kWarps) * NST * STAGE;
    static constexpr bool CAN_STAGE = DH == 128 && KS >= 4 && VS >= 4;
    // spans of fewer cells keep a tile a warp in registers: with a few tiles a warp the ring's first
    // tile waits behind the whole ring's copies (H100, cold cells: q4_0 at 32K cells, 496 a split, 19.4
    // us with the ring against 16.7 without; at 131K, 1,986 a split, 45.6 against 48.5)
    static constexpr int RING_FROM = 8 * kWarps * TILE;
    static __device__ __forceinline__ int k_chunk(int cell, int ch) { return KQ4 ? ch : ch ^ ((cell & 1) * 4); }
    static __device__ __forceinline__ int v_chunk(int cell, int ch) {
        return VQ4 ? ch ^ ((cell >> 1) & 3) : ch ^ (2 * ((cell >> 1) & 3));
    }

    struct Smem {
        alignas(16) float acc[kWarps][GP][DH];          // q [GP][DH] first, then the warps' sums
        alignas(16) uint4 qfrag[NSLICE * NPASS][32];
        float ml[kWarps][GP][2];
        int qexp[GP];
    };
    // A lane's bytes of one warp tile: K's codes of cells g and 8 + g of each 16 (the scores' B operand)
    // with K's scales of cells 2t, 2t + 1, 8 + 2t, 9 + 2t (the score layout), and V's codes and scales of
    // those four cells. The K half is dead once the scores are made, so the next tile's is loaded then.
    struct TileK {
        typename RawT<KBYTES>::T kw[NSUB][2][KP::NB];
        typename RawT<2 * KP::NB>::T ks[NSUB][4];
    };
    struct TileV {
        typename RawT<VQ4 ? 4 : VBYTES>::T vw[NSUB][4][VP::NB];
        typename RawT<2 * VP::NB>::T vs[NSUB][4];
    };
    struct Args {
        const float* q;
        const void* k_values;
        const __half* k_scales;
        const void* v_values;
        const __half* v_scales;
        const int* bases;
        float* part_acc;
        float* part_ml;
        int H, Hk, max_cells, num_splits;
        float scale;
        int ring;
        const void* vram_k_values;
        const __half* vram_k_scales;
        const void* vram_v_values;
        const __half* vram_v_scales;
        int vram_cells;
    };

    // The cells start..end-1 of row b's KV head kvh into split `split`'s partials. PLAIN (no ring, no
    // VRAM window: ring and vram_cells 0): cell c's planes lie at row (first + c) Hk + kvh, each lane's
    // addresses one multiply from a base, and a cell past the end reads cell end - 1 instead of zeros (its
    // score is -inf, so its p is 0 and its P' V terms are zeros: the sums are bit for bit those of zeros).
    // Else the ring and the VRAM window place each cell (strata_kv), and cells past the end read as zeros.
    template <bool PLAIN, bool STAGED = false>
    static __device__ __forceinline__ void span(const Args& a, Smem& sm, int b, int kvh, int start, int end,
                                                int length, int64_t slot0, uint8_t* ring_smem = nullptr) {
        static_assert(!STAGED || (PLAIN && CAN_STAGE), "the ring serves PLAIN spans at Dh 128");
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const uint32_t v_half = (g & 1) ? 0x7632u : 0x5410u;   // q4 V: this lane's halves of two cells' words
        const int G = a.H / a.Hk, Hk = a.Hk;
        const strata_dec::CellRows rows(a.bases, b, a.max_cells, Hk, kvh, length, a.ring, a.vram_cells);
        const int64_t row0 = rows.row0;
        const uint8_t* kv8 = static_cast<const uint8_t*>(a.k_values);
        const uint8_t* vv8 = static_cast<const uint8_t*>(a.v_values);
        const uint8_t* ks8 = reinterpret_cast<const uint8_t*>(a.k_scales);
        const uint8_t* vs8 = reinterpret_cast<const uint8_t*>(a.v_scales);
        const uint8_t* vram_kv8 = static_cast<const uint8_t*>(a.vram_k_values);
        const uint8_t* vram_vv8 = static_cast<const uint8_t*>(a.vram_v_values);
        // PLAIN: each plane's bytes of cell c at base + c * stride (the lane's offset in the base)
        const int k_lane = KQ4 ? t * 4 * KP::NB : t * KBYTES;          // the lane's first byte of a cell's K
        const int v_lane = VQ4 ? (g >> 1) * 4 * VP::NB : g * VBYTES;   // ... of its V
        const uint8_t* const kw_base = kv8 + row0 * KP::ROW + k_lane;
        const uint8_t* const ks_base = ks8 + row0 * (2 * KP::NB);
        const uint8_t* const vw_base = vv8 + row0 * VP::ROW + v_lane;
        const uint8_t* const vs_base = vs8 + row0 * (2 * VP::NB);
        const uint32_t kw_stride = Hk * KP::ROW, ks_stride = Hk * 2 * KP::NB;
        const uint32_t vw_stride = Hk * VP::ROW, vs_stride = Hk * 2 * VP::NB;
        const uint32_t last = static_cast<uint32_t>(end - 1);
        auto at = [&](const uint8_t* base, uint32_t stride, int cell) {
            return base + static_cast<uint64_t>(min(static_cast<uint32_t>(cell), last)) * stride;
        };

        auto load_k = [&](int c0, TileK& r) {
#pragma unroll
            for (int sub = 0; sub < NSUB; ++sub) {
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    const int cell = c0 + sub * 16 + nt * 8 + g;
                    const bool valid = PLAIN || cell < end;
                    const uint8_t* kp;
                    if constexpr (PLAIN) {
                        kp = at(kw_base, kw_stride, cell);
                    } else {
                        const bool in_vram = cell < end && rows.vram.holds(cell);
                        kp = (in_vram ? vram_kv8 : kv8) + rows.at(cell, in_vram) * KP::ROW + k_lane;
                    }
                    if constexpr (KQ4) {
                        load_run<KP::NB>(kp, valid, r.kw[sub][nt]);
                    } else {
#pragma unroll
                        for (int kb = 0; kb < KP::NB; ++kb)
                            r.kw[sub][nt][kb] = load_raw<KBYTES>(kp + kb * (KP::ROW / KP::NB), valid);
                    }
                }
#pragma unroll
                for (int ci = 0; ci < 4; ++ci) {
                    const int cell = c0 + sub * 16 + (ci >> 1) * 8 + 2 * t + (ci & 1);
                    if constexpr (PLAIN) {
                        r.ks[sub][ci] = load_raw<2 * KP::NB>(at(ks_base, ks_stride, cell), true);
                    } else {
                        const bool in_vram = cell < end && rows.vram.holds(cell);
                        r.ks[sub][ci] = load_raw<2 * KP::NB>(
                            (in_vram ? a.vram_k_scales : a.k_scales) + rows.at(cell, in_vram) * KP::NB, cell < end);
                    }
                }
            }
        };
        auto load_v = [&](int c0, TileV& r) {
#pragma unroll
            for (int sub = 0; sub < NSUB; ++sub) {
#pragma unroll
                for (int ci = 0; ci < 4; ++ci) {
                    const int cell = c0 + sub * 16 + (ci >> 1) * 8 + 2 * t + (ci & 1);
                    const bool valid = PLAIN || cell < end;
                    const uint8_t* vp;
                    if constexpr (PLAIN) {
                        vp = at(vw_base, vw_stride, cell);
                        r.vs[sub][ci] = load_raw<2 * VP::NB>(at(vs_base, vs_stride, cell), true);
                    } else {
                        const bool in_vram = cell < end && rows.vram.holds(cell);
                        const int64_t row = rows.at(cell, in_vram);
                        vp = (in_vram ? vram_vv8 : vv8) + row * VP::ROW + v_lane;
                        r.vs[sub][ci] = load_raw<2 * VP::NB>(
                            (in_vram ? a.vram_v_scales : a.v_scales) + row * VP::NB, cell < end);
                    }
                    if constexpr (VQ4) {
                        load_run<VP::NB>(vp, valid, r.vw[sub][ci]);
                    } else {
#pragma unroll
                        for (int vb = 0; vb < VP::NB; ++vb)
                            r.vw[sub][ci][vb] = load_raw<VBYTES>(vp + vb * (VP::ROW / VP::NB), valid);
                    }
                }
            }
        };

        // STAGED: the warp's ring; tile cf's planes into slot `slot` (cells past the end: cell end - 1, as
        // PLAIN's loads), one commit group a tile, empty past the span so the groups count tiles
        uint8_t* const ring = ring_smem + static_cast<uint32_t>(warp) * NST * STAGE;
        const uint8_t* const kw0 = kv8 + row0 * KP::ROW;
        const uint8_t* const vw0 = vv8 + row0 * VP::ROW;
        auto issue = [&](int cf, int slot) {
            if (cf < end) {
                uint8_t* st = ring + slot * STAGE;
                constexpr int KCH = KP::ROW / 16, VCH = VP::ROW / 16;
#pragma unroll
                for (int j = lane; j < TILE * KCH; j += 32) {
                    const int c = j / KCH, ch = j % KCH;
                    cp_async<16>(st + c * KP::ROW + k_chunk(c, ch) * 16, at(kw0, kw_stride, cf + c) + ch * 16);
                }
#pragma unroll
                for (int j = lane; j < TILE * VCH; j += 32) {
                    const int c = j / VCH, ch = j % VCH;
                    cp_async<16>(st + ST_VW + c * VP::ROW + v_chunk(c, ch) * 16, at(vw0, vw_stride, cf + c) + ch * 16);
                }
                if (lane < TILE) {
                    cp_async<KS>(st + ST_KS + lane * KS, at(ks_base, ks_stride, cf + lane));
                    cp_async<VS>(st + ST_VS + lane * VS, at(vs_base, vs_stride, cf + lane));
                }
            }
            cp_async_commit();
        };
        // a lane's registers of the tile in slot `slot`: the bytes load_k / load_v read from global memory
        auto stage_k = [&](int slot, TileK& r) {
            const uint8_t* st = ring + slot * STAGE;
#pragma unroll
            for (int sub = 0; sub < NSUB; ++sub) {
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    const int c = sub * 16 + nt * 8 + g;
                    if constexpr (KQ4) {
                        const uint4 v = *reinterpret_cast<const uint4*>(st + c * KP::ROW + k_chunk(c, t) * 16);
                        r.kw[sub][nt][0] = v.x, r.kw[sub][nt][1] = v.y, r.kw[sub][nt][2] = v.z, r.kw[sub][nt][3] = v.w;
                    } else {
#pragma unroll
                        for (int kb = 0; kb < KP::NB; ++kb)
                            r.kw[sub][nt][kb] = *reinterpret_cast<const uint4*>(st + c * KP::ROW + k_chunk(c, t + 4 * kb) * 16);
                    }
                }
#pragma unroll
                for (int ci = 0; ci < 4; ++ci) {
                    const int c = sub * 16 + (ci >> 1) * 8 + 2 * t + (ci & 1);
                    r.ks[sub][ci] = *reinterpret_cast<const typename RawT<KS>::T*>(st + ST_KS + c * KS);
                }
            }
        };
        auto stage_v = [&](int slot, TileV& r) {
            const uint8_t* st = ring + slot * STAGE;
#pragma unroll
            for (int sub = 0; sub < NSUB; ++sub) {
#pragma unroll
                for (int ci = 0; ci < 4; ++ci) {
                    const int c = sub * 16 + (ci >> 1) * 8 + 2 * t + (ci & 1);
                    r.vs[sub][ci] = *reinterpret_cast<const typename RawT<VS>::T*>(st + ST_VS + c * VS);
                    if constexpr (VQ4) {
                        const uint4 v = *reinterpret_cast<const uint4*>(st + ST_VW + c * VP::ROW + v_chunk(c, g >> 1) * 16);
                        r.vw[sub][ci][0] = v.x, r.vw[sub][ci][1] = v.y, r.vw[sub][ci][2] = v.z, r.vw[sub][ci][3] = v.w;
                    } else {
#pragma unroll
                        for (int vb = 0; vb < VP::NB; ++vb) {
                            const int o = g * VBYTES + vb * (VP::ROW / VP::NB);     // the lane's bytes of block vb
                            r.vw[sub][ci][vb] = *reinterpret_cast<const uint2*>(
                                st + ST_VW + c * VP::ROW + v_chunk(c, o / 16) * 16 + o % 16);
                        }
                    }
                }
            }
        };

        // the warp's first tile (STAGED: its first NST) is on its way while the query is prepared
        int c0 = start + warp * TILE;
        TileK tk;
        TileV tv;
        if constexpr (STAGED) {
#pragma unroll
            for (int i = 0; i < NST; ++i) issue(c0 + i * kWarps * TILE, i);
        } else {
            if (c0 < end) load_k(c0, tk), load_v(c0, tv);
        }

        // the query: scaled to the log2 domain, then per head by 2^e, split into the A fragments
        float qinv[NH];
        strata_dec::prepare_query<DH, GP, kWarps>(a.q, b, a.H, kvh, G, a.scale * kLog2e, &sm.acc[0][0][0], sm.qexp,
                                                  sm.qfrag, qinv,
                                                  [](int slice, int ft, int e) { return k_dim<KQ4>(slice, ft, e); });
        // sm.acc is the warps' sums from here

        float acc[NT][4] = {};
        float m[NH], l[NH];
#pragma unroll
        for (int h = 0; h < NH; ++h) m[h] = -INFINITY, l[h] = 0.0f;

        for (int slot = 0; c0 < end; c0 += kWarps * TILE, slot = slot + 1 == NST ? 0 : slot + 1) {
            const int next = c0 + kWarps * TILE;
            if constexpr (STAGED) {      // this tile's group has landed (NST - 1 later ones may be in flight)
                cp_async_wait<NST - 1>();
                __syncwarp();
                stage_k(slot, tk);
            }
            // scores s[sub][h][ci] of head g + 8h and cell ci (2t, 2t + 1, 8 + 2t, 9 + 2t of the sub-tile)
            float s[NSUB][NH][4];
#pragma unroll
            for (int sub = 0; sub < NSUB; ++sub) {
                float sacc[NH][4] = {};
#pragma unroll
                for (int kb = 0; kb < KP::NB; ++kb) {
                    float c[2][4] = {};
#pragma unroll
                    for (int jj = 0; jj < SPB; ++jj) {
                        const int slice = kb * SPB + jj;
                        uint32_t bf[2][2];
#pragma unroll
                        for (int nt = 0; nt < 2; ++nt) {
                            if constexpr (KQ4) {
                                const uint32_t w = tk.kw[sub][nt][kb];
                                bf[nt][0] = q4_pair(w, jj ? 8 : 0);
                                bf[nt][1] = q4_pair(w, jj ? 12 : 4);
                            } else {
                                const uint4 v4 = tk.kw[sub][nt][kb];
                                const uint32_t w =
                                    (jj == 0 ? v4.x : jj == 1 ? v4.y : jj == 2 ? v4.z : v4.w) ^ 0x80808080u;
                                bf[nt][0] = i8_pair(w, 0x4140);
                                bf[nt][1] = i8_pair(w, 0x4342);
                            }
                        }
#pragma unroll
                        for (int pass = 0; pass < NPASS; ++pass) {
                            const uint4 q4 = sm.qfrag[slice * NPASS + pass][lane];
#pragma unroll
                            for (int nt = 0; nt < 2; ++nt)
                                mma16816(c[nt], q4.x, q4.y, q4.z, q4.w, bf[nt][0], bf[nt][1]);
                        }
                    }
#pragma unroll
                    for (int ci = 0; ci < 4; ++ci) {
                        const int nt = ci >> 1, j = ci & 1;
                        const __half* kd = reinterpret_cast<const __half*>(&tk.ks[sub][ci]);
                        const float d = __half2float(kd[kb]);
                        if constexpr (STACK) {
                            sacc[0][ci] = fmaf(d, c[nt][j] + c[nt][2 + j], sacc[0][ci]);
                        } else {
#pragma unroll
                            for (int h = 0; h < NH; ++h) sacc[h][ci] = fmaf(d, c[nt][2 * h + j], sacc[h][ci]);
                        }
                    }
                }
#pragma unroll
                for (int h = 0; h < NH; ++h)
#pragma unroll
                    for (int ci = 0; ci < 4; ++ci) {
                        const int cell = c0 + sub * 16 + (ci >> 1) * 8 + 2 * t + (ci & 1);
                        s[sub][h][ci] = cell < end ? sacc[h][ci] * qinv[h] : -INFINITY;
                    }
            }
            if (!STAGED && next < end) load_k(next, tk);   // this tile's K is spent

            // online softmax over the tile: the 4 lanes of a group hold the head's 4 * NSUB cells each
            float alpha[NH];
#pragma unroll
            for (int h = 0; h < NH; ++h) {
                float mx = -INFINITY;
#pragma unroll
                for (int sub = 0; sub < NSUB; ++sub)
#pragma unroll
                    for (int ci = 0; ci < 4; ++ci) mx = fmaxf(mx, s[sub][h][ci]);
                mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
                const float m_new = fmaxf(m[h], mx);        // finite: the tile's first cell is valid
                alpha[h] = exp2f(m[h] - m_new);             // 0 on the first tile (m = -inf)
                float sum = 0.0f;
#pragma unroll
                for (int sub = 0; sub < NSUB; ++sub)
#pragma unroll
                    for (int ci = 0; ci < 4; ++ci) {
                        const float p = exp2f(s[sub][h][ci] - m_new);   // 0 past the end (s = -inf)
                        s[sub][h][ci] = p;
                        sum += p;
                    }
                l[h] = fmaf(l[h], alpha[h], sum);
                m[h] = m_new;
            }
            // the running max seldom moves after the first tiles: alpha 1 leaves acc as it is
            if (__any_sync(kFull, alpha[0] != 1.0f || alpha[NH - 1] != 1.0f)) {
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    acc[n][0] *= alpha[0], acc[n][1] *= alpha[0];
                    acc[n][2] *= alpha[NH - 1], acc[n][3] *= alpha[NH - 1];
                }
            }

            // P' V
            if constexpr (STAGED) stage_v(slot, tv);
#pragma unroll
            for (int sub = 0; sub < NSUB; ++sub) {
#pragma unroll
                for (int vb = 0; vb < VP::NB; ++vb) {
                    // dV = mant 2^k per cell: 2^k (f16) for the codes, mant for p
                    float mant[4];
                    uint32_t pw01, pw23;
                    scale_split<KMAX>(scale_pair(tv.vs[sub][0], tv.vs[sub][1], vb), pw01, mant[0], mant[1]);
                    scale_split<KMAX>(scale_pair(tv.vs[sub][2], tv.vs[sub][3], vb), pw23, mant[2], mant[3]);
                    const __half2 pow01 = as_h2(pw01), pow23 = as_h2(pw23);
                    uint32_t af[NPASS][4];
                    if constexpr (STACK) {
                        split_pair(s[sub][0][0] * mant[0], s[sub][0][1] * mant[1], af[0][0], af[0][1]);
                        split_pair(s[sub][0][2] * mant[2], s[sub][0][3] * mant[3], af[0][2], af[0][3]);
                    } else {
#pragma unroll
                        for (int h = 0; h < 2; ++h) {     // row g + 8h: registers 1 and 3 are row g + 8
                            split_pair(s[sub][h][0] * mant[0], s[sub][h][1] * mant[1], af[0][h],
                                       af[NPASS - 1][h]);
                            split_pair(s[sub][h][2] * mant[2], s[sub][h][3] * mant[3], af[0][2 + h],
                                       af[NPASS - 1][2 + h]);
                        }
                    }
                    // V's codes of cells (c0, c1) and (c2, c3) as f16 pairs, times 2^k
                    uint32_t vb01[NTB], vb23[NTB];
#pragma unroll
                    for (int pr = 0; pr < 2; ++pr) {
                        uint32_t* out = pr ? vb23 : vb01;
                        const __half2 pw = pr ? pow23 : pow01;
                        if constexpr (VQ4) {
                            const uint32_t w = __byte_perm(tv.vw[sub][2 * pr][vb], tv.vw[sub][2 * pr + 1][vb], v_half);
                            // nibble ii of each byte pair: 16 (code - 8) times 2^k / 16 for the odd ones (one
                            // shift a word, not three; 2^k / 16 >= 2^-18 is exact, so are both products)
                            const __half2 pw16 = __hmul2(pw, as_h2(0x2C002C00u));
                            const uint32_t w8 = w >> 8;
                            out[0] = as_u32(__hmul2(as_h2(q4_pair(w, 0)), pw));
                            out[1] = as_u32(__hmul2(as_h2(q4_pair16(w)), pw16));
                            out[2] = as_u32(__hmul2(as_h2(q4_pair(w8, 0)), pw));
                            out[3] = as_u32(__hmul2(as_h2(q4_pair16(w8)), pw16));
                        } else {
                            const uint2 x = tv.vw[sub][2 * pr][vb], y = tv.vw[sub][2 * pr + 1][vb];
#pragma unroll
                            for (int wi = 0; wi < 2; ++wi) {
                                const uint32_t wa = (wi ? x.y : x.x) ^ 0x80808080u, wc = (wi ? y.y : y.x) ^ 0x80808080u;
                                const uint32_t lo = __byte_perm(wa, wc, 0x5140), hi = __byte_perm(wa, wc, 0x7362);
                                out[4 * wi + 0] = as_u32(__hmul2(as_h2(i8_pair(lo, 0x4140)), pw));
                                out[4 * wi + 1] = as_u32(__hmul2(as_h2(i8_pair(lo, 0x4342)), pw));
                                out[4 * wi + 2] = as_u32(__hmul2(as_h2(i8_pair(hi, 0x4140)), pw));
                                out[4 * wi + 3] = as_u32(__hmul2(as_h2(i8_pair(hi, 0x4342)), pw));
                            }
                        }
                    }
#pragma unroll
                    for (int ii = 0; ii < NTB; ++ii)
#pragma unroll
                        for (int pass = 0; pass < NPASS; ++pass)
                            mma16816(acc[vb * NTB + ii], af[pass][0], af[pass][1], af[pass][2], af[pass][3],
                                     vb01[ii], vb23[ii]);
                }
            }
            if constexpr (STAGED) {      // the slot is read: the tile NST on takes it
                __syncwarp();
                issue(c0 + NST * kWarps * TILE, slot);
            } else if (next < end) {
                load_v(next, tv);        // this tile's V is spent
            }
        }
        if constexpr (STAGED) cp_async_wait<0>();     // no copy outlives the block (the tail's are empty)

        // the warp's sums: head g (+ 8), dims of n-tile (vb, ii) columns 2t, 2t + 1
        strata_dec::merge_warps<DH, GP, kWarps>(acc, m, l, sm.acc, sm.ml, G, slot0, a.num_splits, a.part_acc,
                                                a.part_ml, [](int n, int c) { return v_dim<VQ4>(n / NTB, n % NTB, c); });
    }
};

template <bool KQ4, bool VQ4, int DH, int GP>
__device__ __forceinline__ void attention_decode_q(const float* __restrict__ q, const void* __restrict__ k_values,
                                                   const __half* __restrict__ k_scales,
                                                   const void* __restrict__ v_values,
                                                   const __half* __restrict__ v_scales,
                                                   const int* __restrict__ lengths, const int* __restrict__ bases,
                                                   float* __restrict__ part_acc, float* __restrict__ part_ml, int H,
                                                   int Hk, int max_cells, int num_splits, float scale, int window,
                                                   int ring, const void* __restrict__ vram_k_values,
                                                   const __half* __restrict__ vram_k_scales,
                                                   const void* __restrict__ vram_v_values,
                                                   const __half* __restrict__ vram_v_scales, int vram_cells) {
    using D = DecodeQ<KQ4, VQ4, DH, GP>;
    __shared__ typename D::Smem sm;

    const int kvh = blockIdx.y, b = blockIdx.z;
    const int G = H / Hk;
    const strata_dec::Span sp = strata_dec::split_span(lengths, window, H, Hk, num_splits);
    const int length = sp.length, start = sp.start, end = sp.end;
    const int64_t slot0 = sp.slot0;                          // head g: + g * num_splits

    if (start >= end) {
        strata_dec::empty_split<DH>(G, slot0, num_splits, part_acc, part_ml);
        return;
    }
    const typename D::Args a{q, k_values, k_scales, v_values, v_scales, bases, part_acc, part_ml, H, Hk, max_cells,
                             num_splits, scale, ring, vram_k_values, vram_k_scales, vram_v_values, vram_v_scales,
                             vram_cells};
    if (ring == 0 && vram_cells == 0) {
        // the launch gave the ring its bytes, and the span is long enough to fill it
        if (D::CAN_STAGE && end - start >= D::RING_FROM && dynamic_smem_bytes() >= D::RING_BYTES) {
            if constexpr (D::CAN_STAGE) {
                extern __shared__ uint4 kv_ring[];
                D::template span<true, true>(a, sm, b, kvh, start, end, length, slot0,
                                             reinterpret_cast<uint8_t*>(kv_ring));
                return;
            }
        }
        D::template span<true>(a, sm, b, kvh, start, end, length, slot0);
    } else {
        D::template span<false>(a, sm, b, kvh, start, end, length, slot0);
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(32) strata_kv_append_int8(const float* x, const int* cells,
                                                                        int8_t* values, __half* scales, int T,
                                                                        int Hk, int Dh) {
    STRATA_PDL_ENTRY();
    if (blockIdx.x >= T || blockIdx.y >= Hk) return;
    if (Dh == 64) append_row<false, 2>(x, cells, values, scales, Hk, 1.0f);
    else if (Dh == 128) append_row<false, 4>(x, cells, values, scales, Hk, 1.0f);
    else if (Dh == 256) append_row<false, 8>(x, cells, values, scales, Hk, 1.0f);
}

extern "C" __global__ void __launch_bounds__(32) strata_kv_append_q4r(const float* x, const int* cells,
                                                                       uint8_t* values, __half* scales, int T,
                                                                       int Hk, int Dh, float rot_scale) {
    STRATA_PDL_ENTRY();
    if (blockIdx.x >= T || blockIdx.y >= Hk) return;
    if (Dh == 64) append_row<true, 2>(x, cells, values, scales, Hk, rot_scale);
    else if (Dh == 128) append_row<true, 4>(x, cells, values, scales, Hk, rot_scale);
    else if (Dh == 256) append_row<true, 8>(x, cells, values, scales, Hk, rot_scale);
}

template <int PER>
__device__ __forceinline__ void hadamard_row(float* x, float rot_scale) {
    float* p = x + static_cast<int64_t>(blockIdx.x) * 32 * PER + threadIdx.x * PER;
    float v[PER];
    load_row<PER>(p, v);
    hadamard_warp<PER>(v, threadIdx.x, rot_scale);
#pragma unroll
    for (int i = 0; i < PER; ++i) p[i] = v[i];
}

extern "C" __global__ void __launch_bounds__(32) strata_hadamard_f32(float* x, int rows, int Dh, float rot_scale) {
    STRATA_PDL_ENTRY();
    if (blockIdx.x >= rows) return;
    if (Dh == 64) hadamard_row<2>(x, rot_scale);
    else if (Dh == 128) hadamard_row<4>(x, rot_scale);
    else if (Dh == 256) hadamard_row<8>(x, rot_scale);
}

template <bool Q4, int PER>
__device__ __forceinline__ void dequant_row(const void* values, const __half* scales, __half* out, int Hk) {
    const int64_t row = static_cast<int64_t>(blockIdx.x) * Hk + blockIdx.y;
    float v[PER];
    load_cell<Q4, PER>(values, scales, row, threadIdx.x, v);
    __half* p = out + row * 32 * PER + threadIdx.x * PER;
#pragma unroll
    for (int i = 0; i < PER; ++i) p[i] = __float2half_rn(v[i]);
}

#define STRATA_KV_DEQUANT(NAME, Q4)                                                                             \
    extern "C" __global__ void __launch_bounds__(32) NAME(const void* values, const __half* scales, __half* out, \
                                                           int rows, int Hk, int Dh) {                          \
        STRATA_PDL_ENTRY();                                                                                     \
        if (blockIdx.x >= rows || blockIdx.y >= Hk) return;                                                     \
        if (Dh == 64) dequant_row<Q4, 2>(values, scales, out, Hk);                                              \
        else if (Dh == 128) dequant_row<Q4, 4>(values, scales, out, Hk);                                        \
        else if (Dh == 256) dequant_row<Q4, 8>(values, scales, out, Hk);                                        \
    }
STRATA_KV_DEQUANT(strata_kv_dequant_int8_f16, false)
STRATA_KV_DEQUANT(strata_kv_dequant_q4r_f16, true)
#undef STRATA_KV_DEQUANT

#define STRATA_DECODE_Q(FMT, KQ4, VQ4, DH, GP)                                                                   \
    extern "C" __global__ void __launch_bounds__(128) strata_attention_decode_##FMT##_d##DH##_g##GP(              \
        const float* q, const void* k_values, const __half* k_scales, const void* v_values,                    \
        const __half* v_scales, const int* lengths, const int* bases, float* part_acc, float* part_ml, int H,  \
        int Hk, int max_cells, int num_splits, float scale, int window, int ring, const void* vram_k_values,   \
        const __half* vram_k_scales, const void* vram_v_values, const __half* vram_v_scales, int vram_cells) { \
        STRATA_PDL_ENTRY();                                                                                     \
        attention_decode_q<KQ4, VQ4, DH, GP>(q, k_values, k_scales, v_values, v_scales, lengths, bases,        \
                                             part_acc, part_ml, H, Hk, max_cells, num_splits, scale, window,   \
                                             ring, vram_k_values, vram_k_scales, vram_v_values, vram_v_scales, \
                                             vram_cells);                                                      \
    }
#define STRATA_DECODE_Q_ALL(FMT, KQ4, VQ4)                                                                       \
    STRATA_DECODE_Q(FMT, KQ4, VQ4, 64, 1) STRATA_DECODE_Q(FMT, KQ4, VQ4, 64, 2)                                 \
    STRATA_DECODE_Q(FMT, KQ4, VQ4, 64, 4) STRATA_DECODE_Q(FMT, KQ4, VQ4, 64, 8)                                 \
    STRATA_DECODE_Q(FMT, KQ4, VQ4, 64, 16) STRATA_DECODE_Q(FMT, KQ4, VQ4, 128, 1)                               \
    STRATA_DECODE_Q(FMT, KQ4, VQ4, 128, 2) STRATA_DECODE_Q(FMT, KQ4, VQ4, 128, 4)                               \
    STRATA_DECODE_Q(FMT, KQ4, VQ4, 128, 8) STRATA_DECODE_Q(FMT, KQ4, VQ4, 128, 16)                              \
    STRATA_DECODE_Q(FMT, KQ4, VQ4, 256, 1) STRATA_DECODE_Q(FMT, KQ4, VQ4, 256, 2)                               \
    STRATA_DECODE_Q(FMT, KQ4, VQ4, 256, 4) STRATA_DECODE_Q(FMT, KQ4, VQ4, 256, 8)
STRATA_DECODE_Q_ALL(int8, false, false)
STRATA_DECODE_Q_ALL(q4_0, true, true)
STRATA_DECODE_Q_ALL(k8v4, false, true)
#undef STRATA_DECODE_Q_ALL
#undef STRATA_DECODE_Q
