// Elementwise sum of two f32 tensors: the residual adds of a decoder layer.
//
// strata_add_f32(x, y, out, n)
//   out[i] = x[i] + y[i], i < n. out may alias x or y (each element is read, then written, by the
//   same thread).
// Launch: block = (256, 1, 1), any grid (threads stride over the elements). float4 accesses when
// n % 4 == 0 and the three pointers are 16-byte aligned; memory-bound (12 bytes per element).

#include <cstdint>

extern "C" __global__ void __launch_bounds__(256) strata_add_f32(const float* x, const float* y, float* out,
                                                                 long long n) {
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    const long long i0 = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const bool vec = n % 4 == 0 && ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y) |
                                     reinterpret_cast<uintptr_t>(out)) & 15) == 0;
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(x);
        const float4* y4 = reinterpret_cast<const float4*>(y);
        float4* o4 = reinterpret_cast<float4*>(out);
        for (long long i = i0; i < n / 4; i += step) {
            const float4 a = x4[i], b = y4[i];
            o4[i] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
        }
    } else {
        for (long long i = i0; i < n; i += step) out[i] = x[i] + y[i];
    }
}
