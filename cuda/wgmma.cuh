// What the Hopper warpgroup-MMA kernels share (cuda/moe_gemm_ws.cu, cuda/attention_wg.cu,
// cuda/attention_ws.cu): the trap switch for archs without wgmma, the descriptors of a no-swizzle and a
// 128-byte swizzled shared-memory operand, the fence / commit / wait instructions, the m64n128k16 MMA
// with both operands in shared memory, and the TMA's tensor maps and box copies. Include inside an
// anonymous namespace.
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

// A wgmma shared-memory descriptor of a tile in the 128-byte swizzle (layout type 1): rows of 128 bytes,
// 16-byte chunk c of row r at chunk c ^ (r % 8), in 1024-byte atoms of 8 rows (as the TMA writes them).
__device__ __forceinline__ uint64_t smem_desc_sw128(unsigned addr, unsigned lbo, unsigned sbo) {
    return smem_desc(addr, lbo, sbo) | (1ull << 62);
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

// Until at most N of this warpgroup's committed wgmma groups are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifndef STRATA_WG_TRAP
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// d[64] += A (64 x 16, desc_a) * B (16 x 128, desc_b), both K-major f16; d in the accumulator
// layout: d[4 j + e] at row 16 (warp % 4) + lane / 4 + 8 (e / 2), column 8 j + 2 (lane % 4) + e % 2.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
#ifndef STRATA_WG_TRAP
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(1));
#endif
}

// A CUtensorMap as the host encoded it (cuTensorMapEncodeTiled), passed by value as a __grid_constant__
// parameter: the TMA reads it from the parameter space.
struct alignas(64) TensorMap {
    unsigned long long bits[16];
};
// This thread's arrival on the barrier, which also expects `bytes` more bytes of asynchronous copies.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// The box at (c0, c1) of a 2-d tensor map, or (c0, c1, c2) of a 3-d one, into shared memory at dst;
// its bytes complete on bar.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TensorMap* map, int c0, int c1, unsigned bar) {
#ifndef STRATA_WG_TRAP
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
#endif
}
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TensorMap* map, int c0, int c1, int c2, unsigned bar) {
#ifndef STRATA_WG_TRAP
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
#endif
}
