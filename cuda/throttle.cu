// --pcie-gbs: caps host->device expert traffic at a given rate, so a host with a fast bus stands in
// for a slower one in measurements (strata/engine/experts/bus_cap.py queues these kernels).
//
// A batch of copies on a stream is bracketed by two one-thread kernels on that same stream:
// strata_bus_stamp records the GPU's global timer before the copies start, strata_bus_wait spins
// (sleeping) until `ns` after that stamp. Stream order makes the batch take at least bytes / rate,
// however fast the copies themselves ran. strata_bus_sleep holds a stream for `ns` from when it
// starts: the delay a capped bus would have added to a decode step's zero-copy reads.
#include <cstdint>

__device__ __forceinline__ uint64_t strata_now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void strata_sleep_until(uint64_t until) {
  while (strata_now_ns() < until) __nanosleep(1000);
}

extern "C" __global__ void strata_bus_stamp(uint64_t* stamp) {
  if (threadIdx.x == 0 && blockIdx.x == 0) *stamp = strata_now_ns();
}

extern "C" __global__ void strata_bus_wait(const uint64_t* stamp, uint64_t ns) {
  if (threadIdx.x == 0 && blockIdx.x == 0) strata_sleep_until(*stamp + ns);
}

extern "C" __global__ void strata_bus_sleep(uint64_t ns) {
  if (threadIdx.x == 0 && blockIdx.x == 0) strata_sleep_until(strata_now_ns() + ns);
}
