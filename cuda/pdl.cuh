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

// A kernel that reads nothing another kernel writes before its wait (cuda/l2_ahead.cu: it only asks
// for weights, which no kernel writes) may let its dependents launch first and wait last:
//   STRATA_PDL_TRIGGER()  griddepcontrol.launch_dependents, the kernel's first statement
//   STRATA_PDL_WAIT()     griddepcontrol.wait, its last: the grid completes only after the previous one
//                         did, so a dependent's wait still orders it after every kernel before this one
// tests/kernels/test_build.py checks the libraries of kernels.PDL_AHEAD_LIBRARIES for this shape.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define STRATA_PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#define STRATA_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define STRATA_PDL_TRIGGER() \
    do {                     \
    } while (0)
#define STRATA_PDL_WAIT() \
    do {                  \
    } while (0)
#endif
