// What the Hopper warpgroup-MMA kernels share (cuda/moe_gemm_wg.cu, cuda/attention_wg.cu): the trap
// switch for archs without wgmma, the descriptor of a no-swizzle shared-memory operand, and the
// fence / commit / wait instructions. Include inside an anonymous namespace.
//
// Built for anything but sm_90a (setup.py builds these libraries for sm_90a only) STRATA_WG_TRAP is
// set, every instruction here compiles to nothing, and the kernels trap instead of running.
// STRATA_WG_SWAP_LBO=1 / STRATA_WG_SWAP_MN=1 exchange the leading and stride byte offsets of the
// K-major / N-major operands' descriptors (tools/variants/make_wgmma.sh builds those variants), for
// the case the hardware reads the no-swizzle layouts' offsets the other way round from the PTX
// manual's reading: leading = between core matrices adjacent along k, stride = along m or n. (The
// manual: K-major without swizzle, the leading offset joins the two columns of the 8x2 tile of
// 16-byte elements, the stride offset the groups of 8 rows; MN-major interleaved, the leading
// offset joins groups of 8 k-lines, the stride offset groups of 8 m or n columns.)

#pragma once

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define STRATA_WG_TRAP 1
#endif
#ifndef STRATA_WG_SWAP_LBO
#define STRATA_WG_SWAP_LBO 0
#endif
#ifndef STRATA_WG_SWAP_MN
#define STRATA_WG_SWAP_MN 0
#endif

// The descriptor of a no-swizzle operand at shared address addr: start address, leading and stride
// byte offsets (each in 16-byte units), base offset 0, layout type 0. k_major picks the swap macro.
__device__ __forceinline__ uint64_t smem_desc(unsigned addr, unsigned k_step, unsigned mn_step, bool k_major = true) {
    const bool swap = k_major ? STRATA_WG_SWAP_LBO : STRATA_WG_SWAP_MN;
    const unsigned lbo = swap ? mn_step : k_step, sbo = swap ? k_step : mn_step;
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
           (static_cast<uint64_t>(sbo >> 4) << 32);
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void wgmma_fence() {
#ifndef STRATA_WG_TRAP
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifndef STRATA_WG_TRAP
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_wait_all() {
#ifndef STRATA_WG_TRAP
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
// Generic-proxy writes to shared memory (stores, cp.async) made visible to wgmma's operand reads.
__device__ __forceinline__ void fence_proxy_async() {
#ifndef STRATA_WG_TRAP
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
