// Programmatic dependent launch (sm_90 and later): a kernel of the decode path may be launched
// while the kernel before it in the stream is still running (the runtime sets the launch
// attribute CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION for the libraries listed in
// strata/backends/cuda/ops.py PDL_LIBRARIES), so its blocks are scheduled and set up during
// that kernel's tail instead of after it: a decode step is ~530 short kernels, and the gap between
// two of them is a large share of each.
//
// STRATA_PDL_ENTRY() is the first statement of every kernel of such a library:
//   griddepcontrol.wait             blocks until the previous grid has completed and its memory
//                                   writes are visible (a no-op when launched without the attribute)
//   griddepcontrol.launch_dependents lets the next kernel launch once every block of this one
//                                   has passed here, i.e. once this kernel is itself running
// Nothing but an L2 prefetch of weights (STRATA_PDL_ENTRY_PREFETCH, below) happens before the wait, so
// each kernel reads and writes exactly as if serialized; the overlap is launch latency, block
// scheduling and the weights' fetch. tests/kernels/test_build.py checks that
// every kernel of those libraries begins with it. Below sm_90 it is empty (no such launches there).
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define STRATA_PDL_ENTRY() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define STRATA_PDL_ENTRY() \
    do {                   \
    } while (0)
#endif

// ---- L2 prefetch of weights (sm_90's bulk prefetch) -------------------------------------------------
//
// A decode step's GEMVs and expert kernels each read a few MB once, too little for their own loads to
// reach the copy rate before they end. prefetch_l2_share asks the L2 for a whole range at once
// (cp.async.bulk.prefetch.L2: the copy engine fetches it while the threads go on), so a kernel's
// reads find their lines in L2 or already in flight. Weights are never written during a step, so a
// kernel may ask for its own weights BEFORE griddepcontrol.wait: with a programmatic dependent launch
// its blocks are resident while the kernel before it runs, and the fetch overlaps that kernel.
// A hint only: the values read are the same whether or not it is issued (tests check the bits).
//
// Share `part` of `parts` of [p, p + bytes) (trimmed to the whole 16-byte chunks inside it, as the
// instruction needs), issued by the block's threads in pieces of at most 32 KiB. Below sm_90: nothing.
__device__ __forceinline__ void prefetch_l2_share(const void* p, long long bytes, long long part, long long parts) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr unsigned long long kPieceChunks = 2048;  // 32 KiB
    const unsigned long long a = reinterpret_cast<unsigned long long>(p);
    if (bytes <= 0 || parts <= 0) return;
    const unsigned long long lo = (a + 15) & ~15ull, hi = (a + static_cast<unsigned long long>(bytes)) & ~15ull;
    if (hi <= lo) return;
    const unsigned long long chunks = (hi - lo) >> 4, per = (chunks + parts - 1) / parts;
    const unsigned long long c0 = per * static_cast<unsigned long long>(part);
    const unsigned long long c1 = c0 + per < chunks ? c0 + per : chunks;
    const unsigned long long threads = blockDim.x * blockDim.y * blockDim.z;
    const unsigned long long tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    for (unsigned long long c = c0 + tid * kPieceChunks; c < c1; c += threads * kPieceChunks) {
        const unsigned n = static_cast<unsigned>((c1 - c < kPieceChunks ? c1 - c : kPieceChunks) << 4);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(lo + (c << 4)), "r"(n) : "memory");
    }
#endif
}

// [p, p + bytes) (whole 16-byte chunks inside it) asked of the L2 by the calling thread alone.
__device__ __forceinline__ void prefetch_l2_range(const void* p, long long bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned long long a = reinterpret_cast<unsigned long long>(p);
    if (bytes <= 0) return;
    const unsigned long long lo = (a + 15) & ~15ull, hi = (a + static_cast<unsigned long long>(bytes)) & ~15ull;
    for (unsigned long long c = lo; c < hi; c += 32768) {
        const unsigned n = static_cast<unsigned>(hi - c < 32768 ? hi - c : 32768);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(c), "r"(n) : "memory");
    }
#endif
}

// The dynamic shared memory size of this launch. Kernels that use none take a non-zero size as "prefetch
// my weights" (DenseOps launches them with 16 bytes where KernelPaths.l2_prefetch is on), so the
// switch is per launch and needs no parameter.
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}

// STRATA_PDL_ENTRY() after this block's share of W's `bytes` is asked of the L2, when the launch has
// dynamic shared memory (see above). tests/kernels/test_build.py accepts it as a kernel's first statement.
#define STRATA_PDL_ENTRY_PREFETCH(W, bytes)                                                          \
    do {                                                                                             \
        if (dynamic_smem_bytes() != 0) prefetch_l2_share((W), (bytes), blockIdx.x, gridDim.x);       \
        STRATA_PDL_ENTRY();                                                                          \
    } while (0)
