// SwiGLU: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)), f32.
//
// strata_swiglu_<out>(gate, up, out, T, I, gate_ld, up_ld, out_ld), <out> f32 or f16 (below)
//   out[t * out_ld + i] = silu(gate[t * gate_ld + i]) * up[t * up_ld + i],  i < I
// Layout: row-major with leading dimensions (elements), so gate and up may be the two halves of
// one fused [T, 2I] projection (gate = buf, up = buf + I, both ld 2I) or two [T, I] buffers. out
// may alias gate or up (each element is read before the same thread writes it). The formula is
// strata.backends.cpu.silu's, in f32 with expf and an IEEE division.
//
// Launch: grid = (ceil(I / 256), min(T, 65535), 1), block = (256, 1, 1); blocks stride over rows
// when T > 65535. Memory-bound: one coalesced read of gate and up, one write of out.

#include <cuda_fp16.h>

#include <cstdint>

namespace {

__device__ __forceinline__ void put(float* out, int64_t i, float v) { out[i] = v; }
__device__ __forceinline__ void put(__half* out, int64_t i, float v) { out[i] = __float2half_rn(v); }

// Rows t0, t0 + step, ... below end of out = silu(gate) * up, element i of each.
template <class Out>
__device__ __forceinline__ void swiglu_rows_of(const float* gate, const float* up, Out* out, int64_t t0, int64_t end,
                                               int64_t step, int i, int64_t gate_ld, int64_t up_ld, int64_t out_ld) {
    for (int64_t t = t0; t < end; t += step) {
        const float g = gate[t * gate_ld + i], u = up[t * up_ld + i];
        put(out, t * out_ld + i, g / (1.0f + expf(-g)) * u);
    }
}

}  // namespace

// strata_swiglu_rows_<out>(gate, up, out, bounds, lo, hi, I, gate_ld, up_ld, out_ld)
//   the same for the rows t in [bounds[lo], bounds[hi]) only: bounds is a device int32 array (the
//   expert offsets cuda/moe_group.cu writes), so the rows of a batch of experts grouped on the
//   device are known to the kernel, not the host. Launch: grid = (ceil(I / 256), any G, 1),
//   block = (256, 1, 1); the G row blocks stride over the range.
// <out> f32, or f16: out written as f16 (round to nearest even; out_ld in halves), the down projection's X
// where cuda/moe_gemm_ws.cu's f16-X entry points read it (the trial path wgmma-gemm-f16x; out must not
// alias gate or up there).
#define STRATA_SWIGLU(suffix, Out)                                                                             \
    extern "C" __global__ void __launch_bounds__(256) strata_swiglu_##suffix(                                 \
        const float* gate, const float* up, Out* out, int T, int I, int64_t gate_ld, int64_t up_ld,             \
        int64_t out_ld) {                                                                                      \
        const int i = blockIdx.x * blockDim.x + threadIdx.x;                                                   \
        if (i >= I) return;                                                                                    \
        swiglu_rows_of(gate, up, out, blockIdx.y, T, gridDim.y, i, gate_ld, up_ld, out_ld);                    \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) strata_swiglu_rows_##suffix(                            \
        const float* gate, const float* up, Out* out, const int* __restrict__ bounds, int lo, int hi, int I,    \
        int64_t gate_ld, int64_t up_ld, int64_t out_ld) {                                                      \
        const int i = blockIdx.x * blockDim.x + threadIdx.x;                                                   \
        if (i >= I) return;                                                                                    \
        swiglu_rows_of(gate, up, out, bounds[lo] + blockIdx.y, bounds[hi], gridDim.y, i, gate_ld, up_ld,       \
                       out_ld);                                                                                \
    }

STRATA_SWIGLU(f32, float)
STRATA_SWIGLU(f16, __half)
