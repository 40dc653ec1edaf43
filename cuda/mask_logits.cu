// Token mask for constrained decoding (structured output, forced tool calls): the tokens a grammar
// does not allow next get -inf logits, before argmax or sampling reads the row.
//
// strata_mask_logits_f32(logits, mask, V)
//   logits[b, i] = -inf where bit (i % 32) of mask[b, i / 32] is 0; allowed entries are untouched.
// Layout: logits [B, V] row-major f32, modified in place; mask [B, W] uint32 with W = ceil(V / 32)
//   (llguidance's bitmask: bit i of word i / 32 allows token i; bits past V are ignored).
// Launch: grid = (ceil(V / 256), B, 1), block = (256, 1, 1): one thread per logit, each reading
//   its word (a warp shares one word, so the mask is read once per warp). V < 2^31.

#include <cstdint>
#include <math_constants.h>

extern "C" __global__ void __launch_bounds__(256) strata_mask_logits_f32(float* __restrict__ logits,
                                                                        const uint32_t* __restrict__ mask,
                                                                        int V) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= V) return;
    const int64_t b = blockIdx.y;
    const int W = (V + 31) / 32;
    const uint32_t word = mask[b * W + (i >> 5)];
    if (!((word >> (i & 31)) & 1u)) logits[b * V + i] = -CUDART_INF_F;
}
