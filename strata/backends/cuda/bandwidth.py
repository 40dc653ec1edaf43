"""The two copy rates every speed is measured against: pinned host -> device (what streamed experts
ride on) and device -> device (bytes read + written: the ceiling of a bandwidth-bound decode step).

One measurement for the planner (`python -m strata plan`, the runner's plan at load) and the bench's
limits: event-timed, the median of `repeats` after `warm` unmeasured runs.
"""
from __future__ import annotations

import numpy as np

from .kernels import KERNELS, load_kernel


def copy_rates(rt, dev, stream, nbytes: int, repeats: int = 5, warm: int = 1) -> tuple[float, float]:
    """(pinned host -> device GB/s, device copy GB/s) over buffers of nbytes (a multiple of 4096)."""
    host, src, dst = rt.HostBuffer(dev, nbytes), rt.DeviceBuffer(dev, nbytes), rt.DeviceBuffer(dev, nbytes)
    np.frombuffer(host, np.uint8)[:] = 0x3C
    src.fill_bytes(0x3C, stream)
    kernel = load_kernel(rt, dev, "gather_rows")
    n = nbytes // 4
    grid = (max(1, min(-(-n // 1024), 8 * dev.multiprocessor_count)), 1)

    def h2d():
        rt.copy_h2d(dst.ptr, host.ptr, nbytes, stream)

    def d2d():
        kernel.launch(grid, KERNELS["gather_rows"].block, (src.ptr, 0, dst.ptr, 1, n, 0, 0), stream=stream)

    start, end = rt.Event(dev, timing=True), rt.Event(dev, timing=True)
    rates = []
    for op, moved in ((h2d, nbytes), (d2d, 2 * nbytes)):
        times = []
        for i in range(warm + repeats):
            start.record(stream)
            op()
            end.record(stream)
            end.synchronize()
            if i >= warm:
                times.append(start.elapsed_ms(end))
        rates.append(moved / (float(np.median(times)) * 1e-3) / 1e9)
    return rates[0], rates[1]
