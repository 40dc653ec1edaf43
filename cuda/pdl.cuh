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
// Nothing happens before the wait, so each kernel reads and writes exactly as if serialized; the
// overlap is launch latency and block scheduling only. tests/kernels/test_build.py checks that
// every kernel of those libraries begins with it. Below sm_90 it is empty (no such launches there).
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define STRATA_PDL_ENTRY() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define STRATA_PDL_ENTRY() \
    do {                   \
    } while (0)
#endif

// STRATA_PDL_EARLY(call): STRATA_PDL_ENTRY() with `call` before the wait, in a build that defines
// STRATA_EARLY_WEIGHTS (a variant, tools/variants/make_early_weights.sh; #16's trial of the one-row GEMVs
// asking for their first weights while the kernel before them still runs); the plain entry otherwise.
// `call` may read weights only (nothing another kernel writes): tests/kernels/test_build.py allows it
// where the call is one of gemv_rows.cuh's early_* functions.
#if defined(STRATA_EARLY_WEIGHTS)
#define STRATA_PDL_EARLY(call) \
    do {                       \
        call;                  \
        STRATA_PDL_ENTRY();    \
    } while (0)
#else
#define STRATA_PDL_EARLY(call) STRATA_PDL_ENTRY()
#endif
