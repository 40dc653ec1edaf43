"""--pcie-gbs: host->device expert traffic capped at a rate, so the H200's PCIe 5.0 host can stand in
for a consumer PCIe 4.0 bus (about 25 GB/s) in measurements.

Copies: each batch the store queues (ring batches, admissions, staged misses) is bracketed on its
stream by cuda/throttle.cu's stamp and wait kernels, so it takes at least bytes / rate; that is
exact for the copies. Zero-copy decode reads (kernels reading the mapped arena) cannot be slowed
per read: after each step the store queues a sleep of missed bytes x (1/rate - 1/measured bus
rate) on the compute stream, which delays the next step by what the slower bus would have added.
That is an approximation, and status says the cap is on.
"""
from __future__ import annotations

from ...backends.cuda.kernels import load_kernel
from ...errors import InvalidArgument


class BusCap:
    """Paces one GPU's host->device traffic at `gbs` GB/s (bytes per ns); `bus_gbs` is the pinned
    copy rate measured on this machine (what zero-copy reads ran at)."""

    def __init__(self, rt, device, gbs: float, bus_gbs: float):
        if not gbs > 0:
            raise InvalidArgument(f"pcie_gbs must be > 0 to cap the bus, got {gbs}")
        self.rt, self.device, self.gbs, self.bus_gbs = rt, device, float(gbs), float(bus_gbs)
        self._stamp = load_kernel(rt, device, "bus_stamp")
        self._wait = load_kernel(rt, device, "bus_wait")
        self._sleep = load_kernel(rt, device, "bus_sleep")
        self._stamps: dict = {}          # id(stream) -> (stream, 8-byte device buffer)
        self.paced_bytes = 0             # bytes whose copies were paced
        self.zero_copy_delay_ns = 0      # sleep queued for zero-copy reads

    def _stamp_of(self, stream):
        entry = self._stamps.get(id(stream))
        if entry is None:
            entry = self._stamps[id(stream)] = (stream, self.rt.DeviceBuffer(self.device, 8))
        return entry[1]

    def before(self, stream) -> None:
        """Mark the start of a batch of copies on stream."""
        self._stamp.launch((1, 1), 1, (self._stamp_of(stream).ptr,), stream=stream)

    def after(self, stream, nbytes: int) -> None:
        """Hold stream until nbytes / rate after the mark of before()."""
        ns = int(nbytes / self.gbs)
        self.paced_bytes += int(nbytes)
        self._wait.launch((1, 1), 1, (self._stamp_of(stream).ptr, ns), stream=stream)

    def zero_copy(self, stream, nbytes: int) -> None:
        """Delay stream by what nbytes of zero-copy reads would have taken longer at the capped rate."""
        ns = int(nbytes / self.gbs - nbytes / self.bus_gbs) if self.bus_gbs > self.gbs else 0
        if ns > 0:
            self.zero_copy_delay_ns += ns
            self._sleep.launch((1, 1), 1, (ns,), stream=stream)

    def status(self) -> dict:
        return {"pcie_gbs": self.gbs, "measured_gbs": round(self.bus_gbs, 1), "paced_bytes": self.paced_bytes,
                "zero_copy_delay_ms": round(self.zero_copy_delay_ns / 1e6, 3)}
