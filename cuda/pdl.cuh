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
