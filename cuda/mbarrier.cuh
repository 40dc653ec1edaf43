// The shared-memory mbarriers of the warp-specialized Hopper kernels (cuda/attention_ws.cu,
// cuda/moe_gemm_ws.cu): a producer fills a ring of stages and signals each stage's "full" barrier; the
// consumers wait on it, read the stage, and signal its "empty" barrier, on which the producer waits
// before refilling it. A barrier's phase completes when its arrival count is reached; waiters name
// the phase by its parity. Include inside an anonymous namespace.

#pragma once

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// An arrival on the barrier once every cp.async this thread issued before it has landed.
__device__ __forceinline__ void cp_async_arrive_noinc(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
