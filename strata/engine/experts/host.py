"""The host side of streamed experts: the pinned arena and, where pinning is refused or limited,
the staging ring that feeds the unpinned rest.

- `pin_arena`: pins as much of experts.bin as the system (and --pin-limit-gib) allows, always a
  prefix of whole layers: the whole file first; on a refusal the largest layer boundary at most
  half the refused size, down to nothing. The pinned prefix is read into mapped pinned memory,
  which kernels read in place (zero-copy) and the copy engine copies from.
- `StagingRing`: experts past the pinned prefix are read from a read-only memmap of experts.bin.
  Helper threads copy each blob into one of a few pinned staging buffers ahead of use, in the order
  the store announced (`expect`); the H2D copy then reads the staging buffer, and a buffer is
  filled again only after an event says the copy that read it has finished.
"""
from __future__ import annotations

import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ...errors import DeviceError, PackError
from ...pack.source import FileSlice

READ_BYTES = 64 << 20             # arena fill: bytes per read() call
PROGRESS_MIN_BYTES = 1 << 30      # an arena at least this big prints a progress line
STAGING_BUFFERS = 8               # pinned staging buffers of slot_bytes each
STAGING_THREADS = 2               # helper threads filling them


def pin_arena(rt, device, path, boundaries: list[int], file_bytes: int, limit_bytes: int = 0,
              progress: bool = True):
    """-> (arena HostBuffer or None, pinned bytes, why less than the file was pinned or None).
    boundaries: byte offsets where a prefix of whole layers ends (file_bytes among them)."""
    cands = sorted({b for b in boundaries if 0 < b <= file_bytes})
    allowed = [b for b in cands if not limit_bytes or b <= limit_bytes]
    size = allowed[-1] if allowed else 0
    why = f"pin_limit_gib caps it at {limit_bytes / 2**30:.3f} GiB" if size < file_bytes else None
    arena = None
    while size > 0:
        try:
            arena = rt.HostBuffer(device, size, mapped=True)
            break
        except DeviceError as exc:      # the system refuses this much: try half
            why = f"pinning {size / 2**30:.3f} GiB was refused ({exc})"
            size = max((b for b in cands if b <= size // 2), default=0)
    if arena is not None:
        _read_prefix(path, arena, size, progress)
    if size < file_bytes:
        sys.stderr.write(f"strata: {path}: pinned {size / 2**30:.3f} of {file_bytes / 2**30:.3f} GiB "
                         f"({why}); the rest is staged through pinned buffers, decode misses staged, no CUDA graphs\n")
    return arena, size, why


def _read_prefix(path, arena, nbytes: int, progress: bool) -> None:
    """The first nbytes of path into arena. A read error or a short file is a PackError naming the
    file: nothing computes from a partly filled arena."""
    view = memoryview(np.frombuffer(arena, np.uint8))
    show = progress and nbytes >= PROGRESS_MIN_BYTES
    t0 = last = time.perf_counter()
    try:
        whole, start = (path.path, path.start) if isinstance(path, FileSlice) else (path, 0)
        with open(whole, "rb", buffering=0) as f:
            f.seek(start)                   # a FileSlice (a layer split's card) reads its own bytes
            off = 0
            while off < nbytes:
                n = f.readinto(view[off:min(nbytes, off + READ_BYTES)])
                if not n:
                    raise PackError(f"{path}: ends at byte {off}, pack.json says at least {nbytes}")
                off += n
                now = time.perf_counter()
                if show and (now - last > 1.0 or off == nbytes):
                    last = now
                    sys.stderr.write(f"strata: pinning experts.bin: {off / 1e9:.1f} / {nbytes / 1e9:.1f} "
                                     f"GB ({off / 1e9 / max(now - t0, 1e-9):.1f} GB/s)\n")
    except OSError as exc:
        raise PackError(f"{path}: cannot read experts ({exc.strerror or exc})") from None
    finally:
        view.release()


class StagingRing:
    """Pinned staging buffers between the memmap of experts.bin and the copy engine (module doc).
    Only the caller's thread touches the bookkeeping; helpers fill one buffer each per job."""

    def __init__(self, rt, device, source: np.ndarray, offsets: np.ndarray, blob: np.ndarray, slot_bytes: int,
                 num_buffers: int = STAGING_BUFFERS, threads: int = STAGING_THREADS):
        self.rt, self.device, self.source = rt, device, source
        self.offsets, self.blob = offsets, blob
        try:
            self.buffers = [rt.HostBuffer(device, slot_bytes) for _ in range(num_buffers)]
        except DeviceError as exc:
            raise DeviceError(f"could not pin {num_buffers} staging buffers of {slot_bytes} bytes for the unpinned "
                              f"experts ({exc})") from None
        self._views = [np.frombuffer(b, np.uint8) for b in self.buffers]
        self._read_done = [rt.Event(device) for _ in range(num_buffers)]    # the last H2D copy out of each
        self._recorded = [False] * num_buffers
        self._free = deque(range(num_buffers))
        self._pending: deque = deque()      # keys (l, e) announced, no buffer yet, in order of use
        self._ready: deque = deque()        # (key, buffer, future): filled or filling, in order of use
        # A helper waits on events: memory_info makes the device's context current in its thread.
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="strata-staging",
                                        initializer=device.memory_info)
        self.staged_blobs = 0
        self.late_fills = 0                 # blobs filled on the caller's thread: unannounced or out of order
        self.wait_seconds = 0.0             # caller's time waiting for fills (the memmap read not hidden)

    def expect(self, keys) -> None:
        """Announce keys (l, e) that copy() will be asked for next, in this order: fills start now."""
        self._pending.extend(keys)
        self._refill()

    def copy(self, dst, ls, es, stream, expected: bool = False) -> None:
        """Blob (ls[i], es[i]) to device address dst[i] on stream, each through a staging buffer."""
        keys = list(zip(np.asarray(ls).tolist(), np.asarray(es).tolist()))
        if not expected:
            self.expect(keys)
        for d, key in zip(np.asarray(dst).tolist(), keys):
            b = self._take(key)
            self.rt.copy_h2d(int(d), self.buffers[b].ptr, int(self.blob[key[0]]), stream)
            self._read_done[b].record(stream)
            self._recorded[b] = True
            self._free.append(b)
            self._refill()
        self.staged_blobs += len(keys)

    def _refill(self) -> None:
        while self._free and self._pending:
            key, b = self._pending.popleft(), self._free.popleft()
            self._ready.append((key, b, self._pool.submit(self._fill, b, key)))

    def _fill(self, b: int, key) -> None:
        if self._recorded[b]:
            self._read_done[b].synchronize()        # the copy that last read this buffer has landed
        l, e = key
        off, n = int(self.offsets[l, e]), int(self.blob[l])
        self._views[b][:n] = self.source[off:off + n]

    def _take(self, key) -> int:
        """The buffer holding key, filled: the announced one, else one filled now on this thread."""
        t0 = time.perf_counter()
        try:
            for i, (k, b, future) in enumerate(self._ready):
                if k == key:
                    del self._ready[i]
                    future.result()
                    return b
            if key in self._pending:
                self._pending.remove(key)
            if not self._free:              # the latest announcement gives its buffer up, refilled later
                k, b, future = self._ready.pop()
                future.result()
                self._pending.appendleft(k)
                self._free.appendleft(b)
            b = self._free.popleft()
            self._fill(b, key)
            self.late_fills += 1
            return b
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def close(self) -> None:
        self._pool.shutdown(wait=True)
