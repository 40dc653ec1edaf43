// l2-ahead (#16, on trial): a decode step's weights asked into the L2 a few kernels before the GEMV
// that reads them, while the kernels between (QK-norm, attention, its combine) leave the memory
// system idle. The GEMVs of the 30B shape read their weights from the L2 about 1.6-1.9 us faster
// than from HBM (tools/gemv_rows_ab.py --hot, 23rd session); asking for them inside the GEMV itself,
// before its PDL wait, came too late to gain (docs/PERF.md).
//
// strata_l2_ahead asks for up to six byte ranges by cp.async.bulk.prefetch.L2, `chunk` bytes an
// instruction (chunk 0: each range's whole 128-byte lines by prefetch.global.L2, line i by thread i mod the
// grid's threads), chunk c of all the ranges (in order) by thread c mod the grid's threads, so the first
// range's chunks go out first. It reads and writes nothing else, so it lets its dependents launch at
// once and waits for the previous grid last (pdl.cuh's STRATA_PDL_TRIGGER / STRATA_PDL_WAIT): in a
// chain of programmatic launches it costs a dependency hop, not a kernel's run. A range's bytes past
// its last whole 16 are not asked for (a bulk prefetch moves multiples of 16 from 16-byte addresses;
// an unaligned range start is rounded up). Below sm_90 there is no such instruction: it does nothing.
#include <cstdint>

#include "pdl.cuh"

extern "C" __global__ void strata_l2_ahead(const char* p0, uint64_t n0, const char* p1, uint64_t n1,
                                           const char* p2, uint64_t n2, const char* p3, uint64_t n3,
                                           const char* p4, uint64_t n4, const char* p5, uint64_t n5,
                                           uint32_t chunk) {
    STRATA_PDL_TRIGGER();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const char* base[6] = {p0, p1, p2, p3, p4, p5};
    const uint64_t bytes[6] = {n0, n1, n2, n3, n4, n5};
    const uint64_t t = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t threads = uint64_t(gridDim.x) * blockDim.x;
    uint64_t first = 0;     // the global index of this range's first chunk
    if (chunk == 0) {       // 128-byte lines by prefetch.global.L2: line i of all the ranges by thread i mod threads
        uint64_t first_line = 0;
#pragma unroll
        for (int r = 0; r < 6; ++r) {
            const uint64_t lines = bytes[r] >> 7;
            for (uint64_t i = (t + threads - first_line % threads) % threads; i < lines; i += threads)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(base[r] + (i << 7)));
            first_line += lines;
        }
        STRATA_PDL_WAIT();
        return;
    }
#pragma unroll
    for (int r = 0; r < 6; ++r) {
        const uint64_t skip = (16 - (reinterpret_cast<uintptr_t>(base[r]) & 15)) & 15;
        const uint64_t n = bytes[r] > skip ? (bytes[r] - skip) & ~uint64_t(15) : 0;
        const char* p = base[r] + skip;
        const uint64_t chunks = (n + chunk - 1) / chunk;
        // this thread's chunks of the range: global indices congruent to t
        uint64_t c = (t + threads - first % threads) % threads;
        for (; c < chunks; c += threads) {
            const uint64_t at = c * chunk;
            const uint32_t size = uint32_t(n - at < chunk ? n - at : chunk);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + at), "r"(size) : "memory");
        }
        first += chunks;
    }
#endif
    STRATA_PDL_WAIT();
}
