// What the Hopper warpgroup-MMA kernels share (cuda/moe_gemm_wg.cu, cuda/attention_wg.cu): the trap
// switch for archs without wgmma, the descriptor of a no-swizzle shared-memory operand, and the
// fence / commit / wait instructions. Include inside an anonymous namespace.
//
// Built for anything but sm_90a (setup.py builds these libraries for sm_90a only) STRATA_WG_TRAP is
// set, every instruction here compiles to nothing, and the kernels trap instead of running.
// The descriptors read the PTX manual's way: without swizzle, the leading byte offset joins core
// matrices adjacent along k, the stride byte offset those adjacent along m or n, for K-major and
// N-major operands alike (on an H100, builds with the two exchanged failed every check).

#pragma once

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define STRATA_WG_TRAP 1
#endif

// The descriptor of a no-swizzle operand at shared address addr: start address, leading and stride
// byte offsets (each in 16-byte units: k_step between core matrices along k, mn_step along m or n),
// base offset 0, layout type 0.
__device__ __forceinline__ uint64_t smem_desc(unsigned addr, unsigned k_step, unsigned mn_step) {
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(k_step >> 4) << 16) |
           (static_cast<uint64_t>(mn_step >> 4) << 32);
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
