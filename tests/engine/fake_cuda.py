"""A numpy stand-in for strata._ext.runtime, to test the GPU engine's host logic without a GPU.

Device memory is numpy arrays at fake addresses; each kernel the GPU engine launches is emulated
from its contract in cuda/*.cu (the docstrings), in float32 numpy, and checks what the real launch
would need: the signature (strata.backends.cuda.kernels.KERNELS', as the runtime checks it against
the kernel's parameters), the table's block, pointer alignment, and the grid covering the work
where that depends on the caller. It says nothing about
the kernels themselves (tests/kernels does, on a GPU): it catches wrong addresses, strides, shapes,
grouping and launch arguments in strata/backends/cuda/*.py and strata/engine/cuda_runner.py.

    monkeypatch.setattr(strata.backends.cuda, "_runtime", lambda: fake_cuda)
    monkeypatch.setattr(strata.backends.cuda, "_graphs", lambda: fake_cuda)

It also stands in for strata._ext.graphs: a stream in capture records its launches and memsets
instead of running them, and a GraphExec's launch runs them again (reading device memory as it is
then, as a replay does). As in the driver's thread-local capture mode, an allocation, a host copy or
a synchronize while capturing raises; freed buffers are unmapped, so a graph (or anything) that
reads memory after it was freed fails loudly.

lagging() makes the device lag the host as far as it can: work queued on a stream (launches,
copies, memsets, graph launches) runs only when the host waits for it (a stream's synchronize, a
copy to pageable host memory, a free: everything queued; an event's synchronize or query: what was
queued before the event's record), in the order it was queued. A copy from page-locked
memory (a HostBuffer) reads the host bytes when it runs, as the copy engine does; one from pageable
memory reads them when queued, as the driver stages those. So a host that rewrites a pinned buffer
before the copy from it has run, which the immediate emulation cannot show, sends the new bytes.
Likewise a copy to page-locked memory writes it when it runs (the host sees the bytes only after
waiting for it, and a later copy to the same bytes overwrites them whether or not the host has read
them), while one to pageable memory returns only once done, as the driver's does. Kernels reading
mapped host memory (the expert arena, --kv-resident's planes, --cpu-experts' output) read it when
they run, like every queued launch.
"""
from __future__ import annotations

import bisect
import math
import re
import struct
import threading
import weakref

import numpy as np

from strata.backends import rope
from strata.backends.cuda.kernels import KERNELS, PDL_LIBRARIES, TMA_ATTENTION_CELLS
from strata.backends.cpu import causal_attention, moe_route, rms_norm, swiglu
from strata.errors import DeviceError, InvalidArgument
from strata.quant import QTensor, qtype

_bases: list[int] = []
_arrays: list = []              # np.ndarray (device memory), or a weakref to a HostBuffer (_array)
_next = [1 << 32]
launches: list[str] = []        # names of the kernels launched from Python, in order
graph_launches: list[int] = []  # nodes of each graph launched, in order
_capturing: list = []           # streams in capture
_lag = [False]                  # lagging(): stream work waits for the host to wait for it
_pending: list = []             # that work, in queue order (callables)
_counts = [0, 0]                # pieces of work queued, and run, so far (an Event's record marks the first)
_apart: list = []               # lagging(apart=True): the streams with work of their own queue, oldest first
_oldest_first = [False]         # lagging(apart="oldest"): the oldest stream runs its work as it is queued
_others_first = [False]         # lagging(apart="others"): every stream but the oldest does
_device = threading.RLock()     # one thread runs queued work at a time (staging helpers wait on events)
_running = [0]                  # queued work running now (depth): a buffer freed meanwhile is forgotten after
_forgotten: list[int] = []      # those buffers


class lagging:
    """with lagging(): the device lags the host (module doc); the work still queued runs at exit.

    apart=True: each stream's work waits in a queue of its own, as on a GPU whose streams run
    independently. Only the host waiting (a stream's or an event's synchronize, a pageable copy: that
    stream's work) or a stream's wait_event (the other stream's work up to the event's record) runs
    it, and when the host waits for everything (a free, the exit) the newest stream runs first. So
    work on one stream that reads what another wrote, with no event between, reads it before it is
    written here, where one queue would have hidden the race (a layer split's hand-offs).
    apart="oldest": the oldest stream (the first to queue work: a runner's, or a layer split's first
    card's) runs its work as soon as it is queued, the others still lagging; that shows the other
    race, a stream rewriting memory that a lagging one has yet to read. apart="others": the other way
    round, every stream but the oldest runs its work as it is queued (a copy stream filling memory
    that the lagging compute stream's queued work has yet to read: the expert cache's admissions
    behind a step queued early)."""

    def __init__(self, apart: bool | str = False):
        self.apart = apart

    def __enter__(self):
        _drain()
        self._was = _lag[0]
        _lag[0] = "apart" if self.apart else (_lag[0] or True)
        _oldest_first[0] = self.apart == "oldest"
        _others_first[0] = self.apart == "others"
        return self

    def __exit__(self, *exc):
        _drain()
        if self.apart:
            _apart.clear()
        _lag[0] = self._was         # nested (STRATA_FAKE_LAG=1: every test lags): still lagging


def _queue(stream, work) -> bool:
    """Queue work() behind the stream's earlier work when the device lags (-> True), else False:
    the caller runs it now."""
    if not _lag[0] or stream is None:
        return False
    with _device:
        if _lag[0] == "apart":
            if stream not in _apart:
                _apart.append(stream)
            stream._queue.append(work)
            stream._queued += 1
            first = stream is _apart[0]
            if (_oldest_first[0] and first or _others_first[0] and not first) and not _running[0]:
                _run_stream(stream)         # runs ahead of the lagging streams (lagging's doc)
        else:
            _pending.append(work)
            _counts[0] += 1
    return True


def _run_stream(stream, upto: int | None = None) -> None:
    """lagging(apart=True): run stream's queued work in order, all of it or until the first `upto`
    pieces it ever queued have run (an event's mark); a wait_event among them runs the other stream
    first, up to that event."""
    with _device:
        _running[0] += 1
        try:
            while stream._queue and (upto is None or stream._ran < upto):
                stream._ran += 1
                stream._queue.pop(0)()
        finally:
            _running[0] -= 1
        while _forgotten and not _running[0]:
            _forget(_forgotten.pop())


def _waiting() -> bool:
    return bool(_pending) or any(s._queue for s in _apart)


def _drain(upto: int | None = None) -> None:
    """Run queued work in order (the host waits for the device): all of it, or until the first
    `upto` pieces ever queued have run (an event's mark)."""
    if upto is None:
        for stream in reversed(list(_apart)):      # the newest stream first (lagging's doc)
            _run_stream(stream)
    with _device:
        _running[0] += 1
        try:
            while _pending and (upto is None or _counts[1] < upto):
                _counts[1] += 1
                _pending.pop(0)()
        finally:
            _running[0] -= 1
        while _forgotten and not _running[0]:
            _forget(_forgotten.pop())


def _pinned(src) -> bool:
    """Whether the buffer src (a numpy array, a memoryview, a HostBuffer) is page-locked memory."""
    while src is not None:
        if isinstance(src, HostBuffer):
            return True
        src = src.obj if isinstance(src, memoryview) else getattr(src, "base", None)
    return False


def _array(a) -> np.ndarray:
    """A registered buffer's bytes (its _arrays entry): a HostBuffer is held weakly (a view of it
    kept here would keep the host memory, experts' arenas among it, alive for the whole test run)."""
    if isinstance(a, weakref.ref):
        host = a()
        return np.zeros(0, np.uint8) if host is None or not len(host) else np.frombuffer(host, np.uint8)
    return a


def _forget(ptr: int) -> None:
    """A freed buffer leaves the map once the queued work has run (cudaFree waits for the device);
    freed while work runs (a collection inside an emulated kernel), after that work, not inside it."""
    if _running[0]:
        _forgotten.append(ptr)
        return
    if _waiting():
        _drain()
    i = bisect.bisect_left(_bases, ptr)
    if i < len(_bases) and _bases[i] == ptr:
        del _bases[i], _arrays[i]


def _resolve(ptr: int, nbytes: int) -> np.ndarray:
    i = bisect.bisect_right(_bases, ptr) - 1
    # the base and its entry are read together, before anything allocates: an allocation may run a
    # garbage collection whose finalizers forget other buffers (_forget), shifting both lists
    base, entry = (_bases[i], _arrays[i]) if i >= 0 else (0, None)
    arr = _array(entry) if i >= 0 else None
    if i < 0 or ptr + nbytes > base + arr.size or arr.size == 0:
        raise AssertionError(f"fake_cuda: {nbytes} bytes at 0x{ptr:x} are outside every buffer")
    off = ptr - base
    return arr[off:off + nbytes]


def view(ptr: int, count: int, dtype=np.float32) -> np.ndarray:
    dtype = np.dtype(dtype)
    return _resolve(ptr, count * dtype.itemsize).view(dtype)


def _aligned(what: str, *ptrs: int) -> None:
    for p in ptrs:
        assert p % 16 == 0, f"fake_cuda: {what} needs 16-byte aligned pointers, got 0x{p:x}"


def init():
    pass


def device_count() -> int:
    return 1


def driver_version() -> int:
    return 13000


class Device:
    def __init__(self, ordinal: int = 0):
        if ordinal != 0:
            raise DeviceError(f"CUDA device {ordinal}: not found (1 visible)")
        self.ordinal, self.name, self.multiprocessor_count = ordinal, "Fake GPU", 8
        self.compute_capability = (9, 0)

    def memory_info(self):
        return 8 << 30, 16 << 30

    def enable_peer_access(self, peer) -> bool:
        return True

    def synchronize(self):
        _drain()


def _no_capture(call: str, stream=None) -> None:
    """The driver refuses these while this thread captures (thread-local mode), or on a capturing stream."""
    if (stream is None and _capturing) or (stream is not None and stream.capture is not None):
        for s in ([stream] if stream is not None else _capturing):
            s.invalidated = True    # as the driver does: end_capture then fails too
        raise DeviceError(f"{call}: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (operation not permitted when "
                          f"stream is capturing)")


class Stream:
    def __init__(self, device, priority: int = 0):
        self.device = device
        self.capture = None         # the recorded nodes while capturing
        self.invalidated = False
        self._queue, self._queued, self._ran = [], 0, 0     # lagging(apart=True): its work, queued and run

    def synchronize(self):
        _no_capture("cuStreamSynchronize", self)
        if _lag[0] == "apart":
            _run_stream(self)
            return
        _drain()

    def wait_event(self, event):
        src, mark = event._stream, event._mark
        if src is not None and src is not self:     # lagging(apart=True): the other stream's work first
            _queue(self, lambda: _run_stream(src, mark))


class Event:
    """Marks the work queued before its record (lagging): waiting for it runs that work, no more."""

    def __init__(self, device, timing: bool = False):
        self.device = device
        self._mark = 0
        self._stream = None         # lagging(apart=True): the stream its record marks a point of

    def record(self, stream=None):
        with _device:
            if _lag[0] == "apart" and stream is not None:
                self._stream, self._mark = stream, stream._queued
            else:
                self._stream, self._mark = None, _counts[0]

    def synchronize(self):
        if self._stream is not None:
            _run_stream(self._stream, self._mark)
            return
        _drain(self._mark)

    def query(self):
        self.synchronize()
        return True

    def elapsed_ms(self, end):
        return 1.0


class DeviceBuffer:
    def __init__(self, device, nbytes: int):
        _no_capture("cuMemAlloc")
        self.device, self.nbytes = device, nbytes
        self.ptr = _next[0]
        _next[0] += -(-max(nbytes, 1) // 4096) * 4096 + 4096
        _bases.append(self.ptr)
        # poisoned, as fresh memory may be: read as float32 every word is a NaN, as int32 it is -128
        # (an out-of-range index for numpy too, where -1 would quietly wrap)
        _arrays.append(np.full(-(-nbytes // 4), 0xFFFFFF80, np.uint32).view(np.uint8)[:nbytes])

    def _range(self, offset: int, n: int) -> np.ndarray:
        if offset + n > self.nbytes:
            raise InvalidArgument(f"DeviceBuffer: {n} bytes at offset {offset} exceed the buffer's {self.nbytes}")
        return _arrays[_bases.index(self.ptr)][offset:offset + n]

    def copy_from_host(self, src, stream=None, offset: int = 0):
        _no_capture("cuMemcpyHtoDAsync", stream)
        data = np.frombuffer(memoryview(src).cast("B"), np.uint8)
        if not _pinned(src):
            data = data.copy()          # pageable: staged now
        if not _queue(stream, lambda: self._write(offset, data)):
            self._write(offset, data)

    def _write(self, offset: int, data: np.ndarray) -> None:
        self._range(offset, data.size)[:] = data

    def copy_to_host(self, dst, stream=None, offset: int = 0):
        _no_capture("cuMemcpyDtoHAsync", stream)
        out = np.frombuffer(memoryview(dst).cast("B"), np.uint8)
        if _pinned(dst) and _queue(stream, lambda: self._read(offset, out)):
            return                      # pinned: lands when the copy runs
        if _lag[0] == "apart" and stream is not None:
            _run_stream(stream)         # pageable: the driver returns once the stream reached the copy
        else:
            _drain()                    # pageable: the driver returns once the copy is done
        self._read(offset, out)

    def _read(self, offset: int, out: np.ndarray) -> None:
        out[:] = self._range(offset, out.size)

    def fill_bytes(self, value: int, stream=None):
        if stream is not None and stream.capture is not None:
            stream.capture.append(("memset", self, value))
            return
        if not _queue(stream, lambda: self.fill_bytes(value)):
            self._range(0, self.nbytes)[:] = value

    def free(self):
        if _waiting():
            _drain()
        if self.ptr in _bases:      # later reads of this memory find no buffer
            i = _bases.index(self.ptr)
            del _bases[i], _arrays[i]

    def __del__(self):
        try:
            self.free()
        except Exception:           # interpreter shutdown
            pass


class HostBuffer(bytearray):
    """Pinned memory: also at a fake address of its own (ptr, device_ptr), so copies by address and
    kernels reading it zero-copy (mapped=True) resolve it like device memory."""

    def __init__(self, device, nbytes: int, mapped: bool = False):
        super().__init__(nbytes)
        self.device, self.nbytes, self.mapped = device, nbytes, mapped
        self.ptr = _next[0]
        _next[0] += -(-max(nbytes, 1) // 4096) * 4096 + 4096
        _bases.append(self.ptr)
        _arrays.append(weakref.ref(self))
        weakref.finalize(self, _forget, self.ptr)

    @property
    def device_ptr(self) -> int:
        assert self.mapped, "fake_cuda: device_ptr of a HostBuffer allocated without mapped=True"
        return self.ptr


def _copy(dst: int, src: int, nbytes: int) -> None:
    if nbytes:
        _resolve(dst, nbytes)[:] = _resolve(src, nbytes)


def copy_h2d(dst: int, src: int, nbytes: int, stream) -> None:
    _no_capture("cuMemcpyHtoDAsync", stream)          # src: pinned memory, read when the copy runs
    if not _queue(stream, lambda: _copy(dst, src, nbytes)):
        _copy(dst, src, nbytes)


def copy_peer(dst: int, dst_device, src: int, src_device, nbytes: int, stream) -> None:
    copy_d2d(dst, src, nbytes, stream)      # one address space here, as under unified addressing


def copy_d2d(dst: int, src: int, nbytes: int, stream) -> None:
    if stream is not None and stream.capture is not None:
        stream.capture.append(("memcpy", dst, src, nbytes))
        return
    if not _queue(stream, lambda: _copy(dst, src, nbytes)):
        _copy(dst, src, nbytes)


_TENSOR_MAP = struct.Struct("<Q3Q2Q3Q")
_TENSOR_MAP_2D = struct.Struct("<Q2QQ2Q")


def tensor_map_f16(address: int, dims, strides, box) -> bytes:
    """The runtime's CUtensorMap bytes: here the address, dims, strides and box a 3-D (or 2-D) map holds."""
    assert len(dims) in (2, 3) and len(strides) == len(dims) - 1 and len(box) == len(dims) and address % 16 == 0
    assert all(s % 16 == 0 for s in strides) and box[0] == 64, "the TMA's 16-byte strides, 128-byte swizzle's rows"
    pack = _TENSOR_MAP if len(dims) == 3 else _TENSOR_MAP_2D
    return pack.pack(address, *dims, *strides, *box).ljust(128, b"\0")


def copy_h2d_batch(dst, src, nbytes, stream) -> None:
    assert len(dst) == len(src) == len(nbytes)
    for d, s_, n in zip(dst, src, nbytes):
        copy_h2d(int(d), int(s_), int(n), stream)


class Library:
    def __init__(self, name: str, image: bytes | None = None):
        self.name, self.image = name, image      # image: a variant's fatbin (DeviceOps.swap_library); not read

    def kernel(self, device, name: str, signature: str):
        k = Kernel(self.name, name, signature)
        k.image = self.image
        return k


pdl_launches: list = []     # names of kernels launched as programmatic dependent launches


def load_library(name: str) -> Library:
    return Library(name)


# Every entry point of the table, by (library, name): a launch of anything else is a bug in the host.
_TABLE = {(k.library, name): k for k in KERNELS.values() for name in k.names()}


def _dims(v) -> tuple:
    v = (v,) if isinstance(v, int) else tuple(v)
    return v + (1,) * (3 - len(v))


class Kernel:
    """The signature is checked against kernels.KERNELS (tests/kernels/test_kernel_table.py checks
    the table against cuda/*.cu, as the runtime checks a launch against the kernel's parameters),
    and each launch's block against the table's."""

    def __init__(self, library: str, name: str, signature: str):
        entry = _TABLE.get((library, name))
        assert entry is not None, f"fake_cuda: kernels.KERNELS has no {name} in cuda/{library}.cu"
        assert signature == entry.signature, f"fake_cuda: {name} takes {entry.signature!r}, launched as {signature!r}"
        self.library, self.name, self.signature, self.block = library, name, signature, entry.block

    def allow_wide_clusters(self):
        assert _TABLE[(self.library, self.name)].cluster > 8, f"fake_cuda: {self.name} has no cluster past 8 blocks"
        self.wide_clusters = True

    def launch(self, grid, block, args, shared_bytes: int = 0, stream=None, pdl: bool = False):
        assert len(args) == len(self.signature), f"{self.name}: {len(args)} args for {self.signature!r}"
        cluster = _TABLE[(self.library, self.name)].cluster
        assert not cluster or (_dims(grid)[0] % cluster == 0 and (cluster <= 8 or getattr(self, "wide_clusters", False))), \
            f"fake_cuda: {self.name}'s clusters of {cluster} blocks need a grid of them (past 8: allow_wide_clusters)"
        assert _dims(block) == (self.block, 1, 1), f"fake_cuda: {self.name} takes {self.block} threads, got {block}"
        if pdl:
            assert self.library in PDL_LIBRARIES, f"fake_cuda: {self.name} launched as PDL, {self.library} is not"
            pdl_launches.append(self.name)
        args = [a.ptr if hasattr(a, "ptr") else a for a in args]     # values, as cuLaunchKernel copies them
        if stream is not None and stream.capture is not None:
            stream.capture.append(("kernel", self, grid, args))
            return
        launches.append(self.name)
        if not _queue(stream, lambda: self.run(grid, args)):
            self.run(grid, args)

    def run(self, grid, args):
        base = self.name.removeprefix("strata_")
        for prefix in ("gemv_rows_split", "gemv_rows", "gemv3_rows", "gemv_batch", "gemv_split", "gemv_one", "gemv3_one",
                       "gemv", "gemv3", "moe_gemv", "moe_gate_up_route", "moe_gate_up", "moe_down", "moe_gemm_wst", "moe_gemm_ws16", "moe_gemm_ws", "moe_gemm", "dequant_h_groups", "dequant_h",
                       "dequant",
                       "embed"):                                             # per quant type
            if base.startswith(prefix + "_"):
                return _EMULATE[prefix](base[len(prefix) + 1:].upper(), _dims(grid), *args)
        m = re.search(r"_d(\d+)(_g\d+)?$", base)                              # per head dim
        if m:
            return _EMULATE[base[:m.start()]](_dims(grid), *args, dh=int(m.group(1)))
        return _EMULATE[base](_dims(grid), *args)


def _weights(q: str, ptr: int, rows: int, n: int) -> np.ndarray:
    qt = qtype(q)
    nbytes = rows * qt.row_bytes(n)
    return QTensor(q, (rows, n), _resolve(ptr, nbytes).copy()).dequantize().reshape(rows, n)


def _strided(ptr: int, rows: int, n: int, ld: int) -> np.ndarray:
    flat = view(ptr, (rows - 1) * ld + n) if rows else view(ptr, 0)
    return np.lib.stride_tricks.as_strided(flat, (rows, n), (ld * 4, 4)) if rows else flat.reshape(0, n)


def _gemv(q, grid, W, x, y, rows, n):
    _aligned("gemv", W, x, y)
    y_ = view(y, rows)
    y_[:] = _weights(q, W, rows, n) @ view(x, n)


def _gemv_batch(q, grid, W, x, y, rows, n, batch):
    _aligned("gemv_batch", W, x, y)
    assert 1 <= batch <= 8 and n % 8 == 0
    view(y, batch * rows).reshape(batch, rows)[:] = view(x, batch * n).reshape(batch, n) @ _weights(q, W, rows, n).T


def _gemv_rows(q, grid, W, x, y, rows, n, batch):
    """strata_gemv_rows_* (and _split_): each row the one-token product (_gemv's), any n the type takes."""
    _aligned("gemv_rows", W, x, y)
    assert 1 <= batch <= 8
    w = _weights(q, W, rows, n)
    for b in range(batch):          # _gemv's product on each row: bit for bit, as on the device
        view(y + b * rows * 4, rows)[:] = w @ view(x + b * n * 4, n)


def _moe_gemv(q, grid, ptrs, part_offset, ids, x, x_div, y, rows, n):
    slots = grid[1]
    for s in range(slots):
        e = int(view(ids, slots, np.int32)[s])
        W = int(view(ptrs + 8 * e, 1, np.uint64)[0]) + part_offset
        _aligned("moe_gemv", W, x, y)
        xs = view(x + (s // x_div) * n * 4, n)
        view(y + s * rows * 4, rows)[:] = _weights(q, W, rows, n) @ xs


def _dequant(q, grid, blocks, out, n_blocks, dtype=np.float32):
    """strata_dequant_<q> (dtype f16: strata_dequant_h_<q>, the weights rounded to f16)."""
    _aligned("dequant", blocks, out)
    qt = qtype(q)
    n = n_blocks * qt.block_size
    view(out, n, dtype)[:] = QTensor(q, (n,), _resolve(blocks, n_blocks * qt.type_size).copy()).dequantize().reshape(-1)


def _dequant_h(q, grid, blocks, out, n_blocks):
    _dequant(q, grid, blocks, out, n_blocks, np.float16)


def _dequant_h_groups(q, grid, ptrs, part_offset, n_blocks, out, out_stride):
    """strata_dequant_h_groups_<q>: grid (x, G); group g's matrix at ptrs[g] + part_offset to out +
    g * out_stride halves, groups of address 0 skipped."""
    G = grid[1]
    _aligned("dequant_h_groups", ptrs, out)
    assert out_stride % 8 == 0 and out_stride >= n_blocks * qtype(q).block_size
    for g, addr in enumerate(view(ptrs, G, np.uint64).tolist()):
        if addr:
            _dequant_h(q, grid, int(addr) + part_offset, out + 2 * g * out_stride, n_blocks)


def _embed(q, grid, table, ids, out, T, n):
    """cuda/embed.cu: rows of any type; the table 16-byte aligned, and out too for a block type."""
    from strata.backends.cuda.kernels import EMBED_QTYPES
    assert q in EMBED_QTYPES and grid[0] >= T, f"fake_cuda: embed {q} over grid {grid} for {T} tokens"
    _aligned("embed", table, *([out] if qtype(q).block_size > 1 else []))
    row_bytes = qtype(q).row_bytes(n)
    for t, r in enumerate(view(ids, T, np.int32)):
        view(out + t * n * 4, n)[:] = _weights(q, table + int(r) * row_bytes, 1, n)[0]


def _rms_norm(grid, x, w, y, rows, n, eps):
    assert grid[0] >= rows
    view(y, rows * n).reshape(rows, n)[:] = rms_norm(view(x, rows * n).reshape(rows, n), view(w, n), eps)


def _gather_rows(grid, src, rows, dst, R, n, src_ld, dst_ld):
    idx = view(rows, R, np.int32).copy() if rows else np.arange(R)
    for i, r in enumerate(idx):
        view(dst + i * dst_ld * 4, n)[:] = view(src + int(r) * src_ld * 4, n)


def _add(grid, x, y, out, n):
    view(out, n)[:] = view(x, n) + view(y, n)


def _gemm(grid, A, B, C, M, N, K, lda, ldb, ldc):
    assert grid[0] * 64 >= N and grid[1] * 64 >= M
    a, bt = _strided(A, M, K, lda), np.ascontiguousarray(_strided(B, N, K, ldb).T)
    for m in range(M):      # a row at a time: a BLAS's [M, K] product can round a row by where it sits in M
        view(C + m * ldc * 4, N)[:] = a[m] @ bt


def _rope(grid, x, pos, inv, T, heads, dh, scale):
    assert grid[0] >= T
    xs = view(x, T * heads * dh).reshape(T, heads, dh)
    cos, sin = rope.cos_sin(view(pos, T, np.int32).astype(np.int64), view(inv, dh // 2), scale)
    xs[:] = rope.apply(xs.copy(), cos, sin)


def _kv_append(grid, k, v, cells, kc, vc, T, row):
    for t, c in enumerate(view(cells, T, np.int32)):
        view(kc + int(c) * row * 2, row, np.float16)[:] = view(k + t * row * 4, row)
        view(vc + int(c) * row * 2, row, np.float16)[:] = view(v + t * row * 4, row)


def _attention_prefill(grid, q, kc, vc, pos, out, T, H, Hk, scale, dh):
    p = view(pos, T, np.int32).astype(np.int64)
    S = int(p.max()) + 1
    keys = view(kc, S * Hk * dh, np.float16).reshape(S, Hk, dh).astype(np.float32)
    vals = view(vc, S * Hk * dh, np.float16).reshape(S, Hk, dh).astype(np.float32)
    qs = view(q, T * H * dh).reshape(T, H, dh) * np.float32(scale * math.sqrt(dh))  # causal_attention scales
    view(out, T * H * dh)[:] = causal_attention(qs, keys, vals, p).reshape(-1)


def _attention_prefill_wst(grid, q, kc, vc, pos, out, T, H, Hk, scale, kmap, vmap, dh):
    """attention_ws.cu's TMA build: K and V as its tensor maps give them (cells past the maps' end as
    zeros), so a map over the wrong cache or too few cells shows in the result."""
    p = view(pos, T, np.int32).astype(np.int64)
    S = int(p.max()) + 1
    planes = []
    for m in (kmap, vmap):
        address, d0, heads, cells, s1, s2, b0, b1, b2 = _TENSOR_MAP.unpack(m[:_TENSOR_MAP.size])
        assert (d0, heads, s1, s2, b0, b1, b2) == (dh, Hk, dh * 2, Hk * dh * 2, 64, 1, TMA_ATTENTION_CELLS[dh]), \
            "a map of another shape"
        plane = np.zeros((max(S, cells), Hk, dh), np.float16)
        plane[:cells] = view(address, cells * Hk * dh, np.float16).reshape(cells, Hk, dh)
        if not np.isfinite(plane[S:]).all():    # a tile past the last position reads them: 0 x NaN in P V
            view(out, T * H * dh)[:] = np.nan
            return
        planes.append(plane[:S].astype(np.float32))
    qs = view(q, T * H * dh).reshape(T, H, dh) * np.float32(scale * math.sqrt(dh))
    view(out, T * H * dh)[:] = causal_attention(qs, planes[0], planes[1], p).reshape(-1)


def _attention_rows(grid, q, kc, vc, pos, out, T, H, Hk, dh, scale):
    """One block per (query, head) on the device: each row alone, so a row's bits do not depend on
    the step's other rows."""
    assert grid[:2] == (H, T)
    for t in range(T):
        _attention_prefill(grid, q + t * H * dh * 4, kc, vc, pos + 4 * t, out + t * H * dh * 4, 1, H, Hk, scale, dh)


def _row_bases(bases, B: int, S: int) -> list[int]:
    """The first cell of each row's sequence: bases[b] (parallel slots' rows in one cache), else b * S."""
    return [int(c) for c in view(bases, B, np.int32)] if bases else [b * S for b in range(B)]


def _window_cells(n: int, window: int, ring: int) -> np.ndarray:
    """The cells (from the sequence's first) a decode row of length n reads: positions
    max(0, n - window)..n-1 (all of 0..n-1 without a window), position p in cell p % ring (p without)."""
    pos = np.arange(max(0, n - window) if window > 0 else 0, n)
    assert ring == 0 or window <= ring, "a window wider than its ring"
    return pos % ring if ring > 0 else pos


def _read_cells(cache: int, vram: int, first: int, n: int, window: int, ring: int, rows: int, vram_cells: int,
                cell_bytes: int) -> np.ndarray:
    """The bytes [cells, cell_bytes] of one plane a decode row of length n reads, as the split-K
    kernels do: _window_cells's cells from the cache at cell `first` on, except positions from
    max(0, n + rows - 1 - (vram_cells - KV_VRAM_SLACK)) on, read from --kv-resident's VRAM ring at
    p % vram_cells (cuda/kv_codec.cuh VramWindow; vram_cells 0: none)."""
    from strata.backends.cuda.memory import KV_VRAM_SLACK
    cells = _window_cells(n, window, ring)
    positions = np.arange(n - len(cells), n)
    assert not vram_cells or vram_cells > KV_VRAM_SLACK, "a VRAM ring no wider than its slack"
    near = positions >= (max(0, n + rows - 1 - (vram_cells - KV_VRAM_SLACK)) if vram_cells else n)
    parts = []
    if (~near).any():
        span = int(cells[~near].max()) + 1
        parts.append(_resolve(cache + first * cell_bytes, span * cell_bytes).reshape(span, cell_bytes)[cells[~near]])
    if near.any():
        ring_bytes = _resolve(vram, vram_cells * cell_bytes).reshape(vram_cells, cell_bytes)
        parts.append(ring_bytes[positions[near] % vram_cells])
    return np.concatenate(parts)


def _kv_ring_append(grid, cells, s0, s1, s2, s3, d0, d1, d2, d3, T, ring_cells, b0, b1, b2, b3, max_cells):
    """strata_kv_ring_append: rows t >= T - ring_cells, each plane's cell c = cells[t] to its sequence's
    ring (c // max_cells: parallel slots) at slot c % max_cells % ring_cells."""
    planes = [(s, d, b) for s, d, b in ((s0, d0, b0), (s1, d1, b1), (s2, d2, b2), (s3, d3, b3)) if b]
    assert grid[:2] == (T, len(planes)) and ring_cells > 0 and max_cells > 0 and all(b % 2 == 0 for _, _, b in planes)
    for t, c in enumerate(view(cells, T, np.int32)):
        if t >= T - ring_cells:
            slot = int(c) // max_cells * ring_cells + int(c) % max_cells % ring_cells
            for src, dst, n in planes:
                _resolve(dst + slot * n, n)[:] = _resolve(src + int(c) * n, n)


def _vram_ring(vram: int, bases, first: int, S: int, vram_cells: int, cell_bytes: int) -> int:
    """The address of a decode row's sequence's VRAM ring (cuda/kv_codec.cuh vram_ring_first): with
    bases, the ring of the row's slot, first // S; else the one ring at vram."""
    return vram + (first // S * vram_cells * cell_bytes if bases and vram_cells and S else 0)


def _attention_decode(grid, q, kc, vc, lengths, bases, part_acc, part_ml, H, Hk, S, splits, scale, window, ring,
                      k_vram, v_vram, vram_cells, tc_from, dh, tc=False):
    """B = grid.z query rows; row b reads cells 0..lengths[b]-1 of the cache from cell bases[b], or
    b * S without bases (S 0: the rows of one sequence's verify window share it); window > 0: only
    its last window positions, ring > 0: position p in cell p % ring (the drafter's K/V ring);
    vram_cells > 0: the newest from --kv-resident's VRAM window (_read_cells). Rows of lengths[b] >=
    tc_from are the tensor-core kernel's (tc), the others attention.cu's: each writes only its own."""
    B = grid[2]
    assert grid == (splits, Hk, B) and 1 <= B <= 8 and (B == 1 or S == 0 or ring
                                                        or S >= int(view(lengths, B, np.int32).max()))
    firsts = _row_bases(bases, B, S)
    assert not vram_cells or (k_vram and v_vram and not ring)
    G = H // Hk
    for b, first in enumerate(firsts):
        n = int(view(lengths + 4 * b, 1, np.int32)[0])
        if (n >= tc_from) != tc:
            continue
        cell = Hk * dh * 2
        keys, vals = (_read_cells(c, _vram_ring(r, bases, first, S, vram_cells, cell), first, n, window, ring, B,
                                  vram_cells, cell).view(np.float16).reshape(-1, Hk, dh).astype(np.float32)
                      for c, r in ((kc, k_vram), (vc, v_vram)))
        _decode_partials(q + 4 * b * H * dh, keys, vals, part_acc + 4 * b * H * splits * dh,
                         part_ml + 8 * b * H * splits, H, G, splits, scale, dh)


def _attention_decode_cl(grid, q, kc, vc, lengths, bases, out, H, Hk, S, scale, window, ring, k_vram, v_vram,
                         vram_cells, below, dh):
    """strata_attention_decode_cl_*: rows of lengths[b] < below attend straight into out (the split-K and its
    combine in one launch); the others are left alone."""
    B = grid[2]
    assert grid == (16, Hk, B) and 1 <= B <= 8
    G = H // Hk
    for b, first in enumerate(_row_bases(bases, B, S)):
        n = int(view(lengths + 4 * b, 1, np.int32)[0])
        if n >= below:
            continue
        cell = Hk * dh * 2
        keys, vals = (_read_cells(c, _vram_ring(r, bases, first, S, vram_cells, cell), first, n, window, ring, B,
                                  vram_cells, cell).view(np.float16).reshape(-1, Hk, dh).astype(np.float32)
                      for c, r in ((kc, k_vram), (vc, v_vram)))
        qs, o = view(q + 4 * b * H * dh, H * dh).reshape(H, dh), view(out + 4 * b * H * dh, H * dh).reshape(H, dh)
        for h in range(H):
            s = keys[:, h // G] @ qs[h] * np.float32(scale * math.log2(math.e))
            p = np.exp2(s - s.max())
            o[h] = p @ vals[:, h // G] / p.sum()


def _decode_partials(q, keys, vals, part_acc, part_ml, H, G, splits, scale, dh):
    qs = view(q, H * dh).reshape(H, dh)
    acc = view(part_acc, H * splits * dh).reshape(H, splits, dh)
    ml = view(part_ml, H * splits * 2).reshape(H, splits, 2)
    acc[:], ml[:, :, 0], ml[:, :, 1] = 0, -np.inf, 0
    for h in range(H):
        s = keys[:, h // G] @ qs[h] * np.float32(scale * math.log2(math.e))
        m = s.max()
        p = np.exp2(s - m)
        acc[h, 0], ml[h, 0] = p @ vals[:, h // G], (m, p.sum())


def _attention_decode_combine(grid, part_acc, part_ml, out, H, dh, splits):
    B = grid[1]
    acc = view(part_acc, B * H * splits * dh).reshape(B * H, splits, dh)
    ml = view(part_ml, B * H * splits * 2).reshape(B * H, splits, 2)
    M = ml[:, :, 0].max(axis=1, keepdims=True)
    w = np.exp2(ml[:, :, 0] - M)
    view(out, B * H * dh).reshape(B * H, dh)[:] = (w[:, :, None] * acc).sum(1) / (w * ml[:, :, 1]).sum(1, keepdims=True)


def _moe_route(grid, logits, ids, weights, T, E, A, norm):
    assert grid[0] * 4 >= T
    i, w = moe_route(view(logits, T * E).reshape(T, E), A, bool(norm))
    view(ids, T * A, np.int32)[:] = i.reshape(-1)
    view(weights, T * A)[:] = w.reshape(-1)


def _router(grid, W, x, y, rows, n, *rest):
    """strata_router_split_f32 / strata_router_rows_split_f32: gemv_split's logits (_gemv_rows: bit for
    bit the one-token product a row), then moe_route's picks; the block counter must be 0 (the last
    block resets it)."""
    batch, (ids, weights, counter, A, norm) = (rest[0], rest[1:]) if len(rest) == 6 else (1, rest)
    assert view(counter, 1, np.int32)[0] == 0, "router: the block counter was not reset"
    _gemv_rows("F32", grid, W, x, y, rows, n, batch)
    _moe_route(((batch + 3) // 4,), y, ids, weights, batch, rows, A, norm)


def _swiglu(grid, gate, up, out, T, I, gate_ld, up_ld, out_ld, dtype=np.float32):
    assert grid[0] * 256 >= I
    g, u = _strided(gate, T, I, gate_ld), _strided(up, T, I, up_ld)
    r = swiglu(g, u)
    size = np.dtype(dtype).itemsize
    for t in range(T):
        view(out + t * out_ld * size, I, dtype)[:] = r[t]


def _moe_combine(grid, residual, expert_out, rows, weights, out, T, A, D):
    assert grid[0] * 256 >= D
    r = view(rows, T * A, np.int32).reshape(T, A) if rows else np.arange(T * A).reshape(T, A)
    y = view(expert_out, (int(r.max()) + 1) * D).reshape(-1, D)
    w = view(weights, T * A).reshape(T, A)
    view(out, T * D).reshape(T, D)[:] = view(residual, T * D).reshape(T, D) + np.einsum("ta,tad->td", w, y[r])


# ---- cuda/kv_quant.cu: strata.quant.kv's codecs over the emulated planes ------------------------------

def _plane_views(codec, vals, scales, rows: int, Hk: int, dh: int):
    values, sc = codec.empty((rows, Hk), dh)
    return (view(vals, values.size, values.dtype).reshape(values.shape),
            view(scales, sc.size, np.float16).reshape(sc.shape))


def _kv_append_q(codec_name, grid, x, cells, vals, scales, T, Hk, dh, rot=None):
    from strata.quant import kv as kvq
    assert grid[:2] == (T, Hk) and dh in (64, 128, 256)
    codec = kvq.CODECS[codec_name]
    if rot is not None:
        assert np.float32(rot) == np.float32(1 / np.sqrt(dh))
    c = view(cells, T, np.int32)
    values, sc = _plane_views(codec, vals, scales, int(c.max()) + 1, Hk, dh)
    qv, qs = codec.encode(view(x, T * Hk * dh).reshape(T, Hk, dh))
    values[c], sc[c] = qv, qs


def _hadamard(grid, x, rows, dh, rot):
    from strata.quant import kv as kvq
    assert grid[0] >= rows and np.float32(rot) == np.float32(1 / np.sqrt(dh))
    xs = view(x, rows * dh).reshape(rows, dh)
    xs[:] = kvq.rotate(xs.copy())


def _attention_decode_q(fmt, grid, q, kv_, ks, vv, vs, lengths, bases, part_acc, part_ml, H, Hk, S, splits, scale,
                        window, ring, rkv, rks, rvv, rvs, vram_cells, dh):
    from strata.quant import kv as kvq
    B = grid[2]
    assert grid == (splits, Hk, B) and 1 <= B <= 8
    lens = view(lengths, B, np.int32).astype(int)
    firsts = _row_bases(bases, B, S)       # S 0: the rows of one window share one sequence's planes
    assert not vram_cells or (rkv and rks and rvv and rvs and not ring)
    kc, vc = kvq.codecs(fmt)

    def cells(codec, vals, scales, rvals, rscales, first, n):     # the row's cells of the codec's planes
        values, sc = codec.empty((1, Hk), dh)
        got = [_read_cells(p, _vram_ring(r, bases, first, S, vram_cells, a.nbytes), first, n, window, ring, B,
                           vram_cells, a.nbytes).view(a.dtype).reshape((-1, Hk) + a.shape[2:])
               for p, r, a in ((vals, rvals, values), (scales, rscales, sc))]
        return codec.decode(*got)
    for b, first in enumerate(firsts):
        n = int(lens[b])
        _decode_partials(q + 4 * b * H * dh, cells(kc, kv_, ks, rkv, rks, first, n),
                         cells(vc, vv, vs, rvv, rvs, first, n), part_acc + 4 * b * H * splits * dh,
                         part_ml + 8 * b * H * splits, H, H // Hk, splits, scale, dh)


def _kv_dequant_f16(codec_name, grid, vals, scales, out, rows, Hk, dh):
    from strata.quant import kv as kvq
    assert grid[:2] == (rows, Hk) and dh in (64, 128, 256)
    codec = kvq.CODECS[codec_name]
    x = codec.decode(*_plane_views(codec, vals, scales, rows, Hk, dh))
    view(out, rows * Hk * dh, np.float16)[:] = x.reshape(-1)


_EMULATE = {
    "kv_dequant_int8_f16": lambda grid, *a: _kv_dequant_f16("int8", grid, *a),
    "kv_dequant_q4r_f16": lambda grid, *a: _kv_dequant_f16("q4r", grid, *a),
    "kv_append_int8": lambda grid, *a: _kv_append_q("int8", grid, *a),
    "kv_append_q4r": lambda grid, *a: _kv_append_q("q4r", grid, *a), "hadamard_f32": _hadamard,
    "attention_decode_int8": lambda grid, *a, dh: _attention_decode_q("int8", grid, *a, dh=dh),
    "attention_decode_q4_0": lambda grid, *a, dh: _attention_decode_q("q4_0", grid, *a, dh=dh),
    "attention_decode_k8v4": lambda grid, *a, dh: _attention_decode_q("k8v4", grid, *a, dh=dh),
    "gemv": _gemv, "gemv_split": _gemv, "gemv_batch": _gemv_batch, "gemv_rows": _gemv_rows,
    "gemv_rows_split": _gemv_rows, "moe_gemv": _moe_gemv, "dequant": _dequant, "dequant_h": _dequant_h, "dequant_h_groups": _dequant_h_groups, "embed": _embed,
    "rms_norm_f32": _rms_norm, "gather_rows_f32": _gather_rows, "add_f32": _add, "gemm_f32_nt": _gemm,
    "rope_f32": _rope, "kv_append_f16": _kv_append, "kv_ring_append": _kv_ring_append, "attention_prefill_f16": _attention_prefill, "attention_prefill_tc_f16": _attention_prefill,
    "attention_prefill_wg_f16": _attention_prefill, "attention_prefill_ws128_f16": _attention_prefill,
    "attention_prefill_ws64_f16": _attention_prefill, "attention_prefill_wst128_f16": _attention_prefill_wst,
    "attention_prefill_wst64_f16": _attention_prefill_wst,
    "attention_rows_f16": _attention_rows, "attention_decode_f16": _attention_decode,
    "attention_decode_tc_f16": lambda *a, **k: _attention_decode(*a, **k, tc=True),
    "attention_decode_cl_f16": _attention_decode_cl,
    "attention_decode_combine_f32": _attention_decode_combine, "moe_route_f32": _moe_route,
    "swiglu_f32": _swiglu, "moe_combine_f32": _moe_combine,
    "router_split_f32": _router, "router_rows_split_f32": _router,
    "add_norm_router_f32": lambda grid, *a: _add_norm_router(grid, *a),
}


def _add_norm_router(grid, x, y, x_out, w, normed, W, logits, rows, n, batch, eps):
    """strata_add_norm_router_f32: strata_add_rms_norm_f32's outputs, then gemv_split's logits over the normed
    rows (each row the one-token product, as _gemv_rows); x_out and normed must not overlap x or y (every
    block reads those while block 0 writes)."""
    assert 1 <= batch <= 8 and n % 8 == 0
    _aligned("add_norm_router", x, y, x_out, w, normed)
    span = batch * n * 4
    for out in (x_out, normed):
        assert all(out + span <= a or a + span <= out for a in (x, y)), "add_norm_router: an output overlaps x or y"
    _add_rms_norm((batch,), x, y, x_out, w, normed, batch, n, eps)
    _gemv_rows("F32", grid, W, normed, logits, rows, n, batch)


# ---- cuda/decode_fused.cu ---------------------------------------------------------------------------

def _add_rms_norm(grid, x, y, x_out, w, out, rows, n, eps):
    assert grid[0] >= rows
    s = (view(x, rows * n) + view(y, rows * n)).reshape(rows, n)
    view(x_out, rows * n)[:] = s.reshape(-1)
    view(out, rows * n).reshape(rows, n)[:] = rms_norm(s, view(w, n), eps)


def _qk_norm_rope_kv(grid, q, k, v, q_w, k_w, pos, cells, inv, q_out, kc, vc, T, H, Hk, dh, eps, scale):
    assert grid[0] >= T and dh % 2 == 0 and dh // 2 <= 512
    p = view(pos, T, np.int32).astype(np.int64)
    where = view(cells, T, np.int32).astype(np.int64) if cells else p
    cos, sin = rope.cos_sin(p, view(inv, dh // 2), scale)

    def norm_rope(ptr, heads, w):
        return rope.apply(rms_norm(view(ptr, T * heads * dh).reshape(T, heads, dh), view(w, dh), eps),
                          cos, sin).astype(np.float32)
    qs, ks = norm_rope(q, H, q_w), norm_rope(k, Hk, k_w).reshape(T, Hk * dh)
    vs = view(v, T * Hk * dh).reshape(T, Hk * dh).copy()
    view(q_out, T * H * dh)[:] = qs.reshape(-1)
    for t, c in enumerate(where):
        view(kc + int(c) * Hk * dh * 2, Hk * dh, np.float16)[:] = ks[t]
        view(vc + int(c) * Hk * dh * 2, Hk * dh, np.float16)[:] = vs[t]


def _gemv3(q, grid, W0, W1, W2, x, y0, y1, y2, rows0, rows1, rows2, n, batch):
    from strata.backends.cuda.testing import CudaOps
    assert 1 <= batch <= 8 and (batch == 1 or n % 8 == 0)
    per_set = 4 if batch > 1 else CudaOps.gemv_rows_per_block(CudaOps, q, n) // 4
    assert grid[0] * 4 * per_set >= sum(-(-r // per_set) * per_set for r in (rows0, rows1, rows2))
    xs = view(x, batch * n).reshape(batch, n)
    for W, y, rows in ((W0, y0, rows0), (W1, y1, rows1), (W2, y2, rows2)):
        _aligned("gemv3", W, x, y)
        view(y, batch * rows).reshape(batch, rows)[:] = xs @ _weights(q, W, rows, n).T


def _gemv3_one(q, grid, W0, W1, W2, x, y0, y1, y2, rows0, rows1, rows2, n, batch):
    """strata_gemv3_one_*: batch 1's product, one row a warp; warps stride, so any grid."""
    from strata.backends.cuda.kernels import ONE_ROW_QTYPES
    assert batch == 1 and q in ONE_ROW_QTYPES and grid[0] >= 1
    for W, y, rows in ((W0, y0, rows0), (W1, y1, rows1), (W2, y2, rows2)):
        _aligned("gemv3_one", W, x, y)
        view(y, rows)[:] = view(x, n) @ _weights(q, W, rows, n).T


def _gemv_one(q, grid, W, x, y, rows, n):
    """strata_gemv_one_*: _gemv's product (the same bits on the device), one row a warp."""
    from strata.backends.cuda.kernels import ONE_ROW_QTYPES
    assert q in ONE_ROW_QTYPES
    _gemv(q, grid, W, x, y, rows, n)


def _gemv3_rows(q, grid, W0, W1, W2, x, y0, y1, y2, rows0, rows1, rows2, n, batch):
    """strata_gemv3_rows_*: each token's rows those of batch 1, on batch 1's grid."""
    from strata.backends.cuda.testing import CudaOps
    assert 1 <= batch <= 8
    per_set = CudaOps.gemv_rows_per_block(CudaOps, q, n) // 4
    assert grid[0] * 4 * per_set >= sum(-(-r // per_set) * per_set for r in (rows0, rows1, rows2))
    xs = view(x, batch * n).reshape(batch, n)
    for W, y, rows in ((W0, y0, rows0), (W1, y1, rows1), (W2, y2, rows2)):
        _aligned("gemv3_rows", W, x, y)
        w = _weights(q, W, rows, n).T
        for b in range(batch):      # gemv3's batch-1 product on each row: bit for bit, as on the device
            view(y + b * rows * 4, rows)[:] = (xs[b:b + 1] @ w)[0]


def _qk_norm_rope_kv_quant(fmt, grid, q, k, v, q_w, k_w, pos, cells, inv, q_out, kv_, ks, vv, vs, T, H, Hk, dh, eps,
                           scale, rot):
    """strata_qk_norm_rope_kv_<fmt>: the unfused chain's emulations in order (rms_norm over rows of Dh,
    rope, the rotation of q where K is rotated, the format's appends), so eager equals it bitwise here too."""
    from strata.quant import kv as kvq
    assert grid[0] >= T and grid[1] * 4 >= H + 2 * Hk and dh in (64, 128, 256)
    assert np.float32(rot) == np.float32(1 / np.sqrt(dh))
    _aligned("qk_norm_rope_kv_quant", q, k)
    p = view(pos, T, np.int32).astype(np.int64)
    where = view(cells, T, np.int32) if cells else p.astype(np.int32)
    cos, sin = rope.cos_sin(p, view(inv, dh // 2), scale)

    def norm_rope(ptr, heads, w):
        x = rms_norm(view(ptr, T * heads * dh).reshape(T * heads, dh), view(w, dh), eps).reshape(T, heads, dh)
        return rope.apply(x.astype(np.float32), cos, sin).astype(np.float32)
    kc, vc = kvq.codecs(fmt)
    qs = norm_rope(q, H, q_w)
    ks_ = norm_rope(k, Hk, k_w)
    vs_ = view(v, T * Hk * dh).reshape(T, Hk, dh).copy()
    view(q_out, T * H * dh)[:] = (kvq.rotate(qs) if kc.rotated else qs).reshape(-1)
    rows = int(where.max()) + 1
    for codec, x, vals, scales in ((kc, ks_, kv_, ks), (vc, vs_, vv, vs)):
        values, sc = _plane_views(codec, vals, scales, rows, Hk, dh)
        values[where], sc[where] = codec.encode(x)


def _attention_decode_combine_rot(grid, part_acc, part_ml, out, H, dh, splits, rot):
    """The combine, then each head's output rotated (strata_hadamard_f32's emulation)."""
    _attention_decode_combine(grid, part_acc, part_ml, out, H, dh, splits)
    _hadamard((grid[0] * grid[1],), out, grid[0] * grid[1], dh, rot)


_EMULATE.update({f"qk_norm_rope_kv_{fmt}": (lambda fmt: lambda grid, *a: _qk_norm_rope_kv_quant(fmt, grid, *a))(fmt)
                 for fmt in ("int8", "q4_0", "k8v4")})
_EMULATE["attention_decode_combine_rot_f32"] = _attention_decode_combine_rot
_EMULATE.update({"add_rms_norm_f32": _add_rms_norm, "qk_norm_rope_kv_f32": _qk_norm_rope_kv, "gemv3": _gemv3,
                 "gemv3_rows": _gemv3_rows, "gemv3_one": _gemv3_one, "gemv_one": _gemv_one})


def read_manifest(directory=None) -> dict:
    """An sm_90 build's: the arch-specific libraries are there (DeviceOps asks for them by name)."""
    return {"format": 1, "kernels": {"attention": {"archs": ["sm_80", "sm_90", "compute_80"]},
                                     **{lib: {"archs": ["sm_90a"], "optional": True}
                                        for lib in ("moe_gemm_ws", "attention_wg", "attention_ws")}}}


# ---- strata._ext.graphs ----------------------------------------------------------------------------

def begin_capture(stream):
    assert stream.capture is None, "fake_cuda: the stream is already capturing"
    stream.capture = []
    _capturing.append(stream)


def end_capture(stream):
    if stream.capture is None:
        raise DeviceError("cuStreamEndCapture: CUDA_ERROR_ILLEGAL_STATE (stream is not capturing)")
    nodes, stream.capture = stream.capture, None
    _capturing.remove(stream)
    if stream.invalidated:
        stream.invalidated = False
        raise DeviceError("cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (operation failed due to a "
                          "previous error during capture)")
    return Graph(nodes)


def is_capturing(stream) -> bool:
    return stream.capture is not None


class Graph:
    def __init__(self, nodes: list):
        self.nodes = nodes

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def instantiate(self):
        return GraphExec(list(self.nodes))

    def destroy(self):
        self.nodes = None


class GraphExec:
    def __init__(self, nodes: list):
        self.nodes = nodes

    def upload(self, stream):
        pass

    def launch(self, stream):
        assert self.nodes is not None, "fake_cuda: launch of a destroyed graph"
        _no_capture("cuGraphLaunch", stream)
        graph_launches.append(len(self.nodes))
        if not _queue(stream, lambda: self._run(list(self.nodes))):
            self._run(self.nodes)

    @staticmethod
    def _run(nodes: list) -> None:
        for node in nodes:
            if node[0] == "kernel":
                node[1].run(node[2], node[3])
            elif node[0] == "memcpy":
                copy_d2d(*node[1:], None)
            else:
                node[1].fill_bytes(node[2])

    def destroy(self):
        self.nodes = None


def _lazy_emulation(module: str, name: str):
    def run(*args):
        import importlib                                 # they import this module: resolved at the first launch
        return getattr(importlib.import_module(f"tests.engine.{module}"), name)(*args)
    return run


_EMULATE.update({"moe_gate_up": _lazy_emulation("fake_moe_decode", "emulate_moe_gate_up"),
                 "moe_gate_up_route": _lazy_emulation("fake_moe_decode", "emulate_moe_gate_up_route"),
                 "moe_down": _lazy_emulation("fake_moe_decode", "emulate_moe_down"),
                 "moe_gemm": _lazy_emulation("fake_moe_gemm", "emulate_moe_gemm"),
                 "moe_gemm_ws": _lazy_emulation("fake_moe_gemm", "emulate_moe_gemm_ws"),
                 "moe_gemm_ws16": _lazy_emulation("fake_moe_gemm", "emulate_moe_gemm_ws16"),
                 "moe_gemm_wst": _lazy_emulation("fake_moe_gemm", "emulate_moe_gemm_wst"),
                 "sample_f32": _lazy_emulation("fake_sample", "emulate_sample"),
                 "gdn_conv1d_step_f32": _lazy_emulation("fake_gated_delta", "emulate_conv1d_step"),
                 "gdn_conv1d_rows_f32": _lazy_emulation("fake_gated_delta", "emulate_conv1d_rows"),
                 "gdn_conv1d_f32": _lazy_emulation("fake_gated_delta", "emulate_conv1d"),
                 "gdn_step_f32": _lazy_emulation("fake_gated_delta", "emulate_gdn_step"),
                 "gdn_step_rows_f32": _lazy_emulation("fake_gated_delta", "emulate_gdn_step_rows"),
                 "gdn_prompt_f32": _lazy_emulation("fake_gated_delta", "emulate_gdn_prompt"),
                 "gdn_chunk_prep_f32": _lazy_emulation("fake_gated_delta", "emulate_gdn_chunk_prep"),
                 "gdn_chunk_scan_f32": _lazy_emulation("fake_gated_delta", "emulate_gdn_chunk_scan"),
                 "gdn_gates_f32": _lazy_emulation("fake_gated_delta", "emulate_gdn_gates"),
                 "sigmoid_mul_f32": _lazy_emulation("fake_gated_delta", "emulate_sigmoid_mul"),
                 "rope_partial_f32": _lazy_emulation("fake_gated_delta", "emulate_rope_partial"),
                 "mask_logits_f32": _lazy_emulation("fake_sample", "emulate_mask_logits")})


def _argmax(grid, logits, out, V):
    """out[b] = numpy's argmax of row b (the first NaN, else the lowest id of the max)."""
    B = grid[0]
    view(out, B, np.int32)[:] = np.argmax(view(logits, B * V).reshape(B, V), axis=1)


_EMULATE["argmax_f32"] = _argmax


def _moe_group(grid, ids, S, A, E, tokens, rows, starts_out, tiles, max_tiles, bm):
    """cuda/moe_group.cu's tables from a stable numpy sort; the tile layout from its header's rule."""
    assert grid == (E + 1, 1, 1), f"fake_cuda: moe_group grid {grid} must be (E + 1, 1, 1)"
    assert max_tiles >= E + S // bm, f"fake_cuda: moe_group max_tiles {max_tiles} < E + S // bm"
    assert tiles % 16 == 0, "fake_cuda: moe_group tiles must be 16-byte aligned"
    from strata.backends.cuda.moe import group_by_expert
    flat = view(ids, S, np.int32)
    assert flat.min() >= 0 and flat.max() < E, f"fake_cuda: moe_group ids outside [0, {E})"
    order, _, _, _, sorted_rows = group_by_expert(flat.reshape(-1, A))
    view(tokens, S, np.int32)[:] = order // A
    view(rows, S, np.int32)[:] = sorted_rows
    counts = np.bincount(flat, minlength=E)
    starts = np.cumsum(counts) - counts
    view(starts_out, E + 1, np.int32)[:] = np.r_[starts, S]
    out = view(tiles, 4 * max_tiles, np.int32).reshape(max_tiles, 4)
    out[:] = 0
    for e in range(E):
        for j in range(-(-int(counts[e]) // bm)):
            out[e + starts[e] // bm + j] = (e, starts[e] + j * bm, min(bm, counts[e] - j * bm), 0)


_EMULATE["moe_group"] = _moe_group


def _swiglu_rows(grid, gate, up, out, bounds, lo, hi, I, gate_ld, up_ld, out_ld, dtype=np.float32):
    """cuda/swiglu.cu strata_swiglu_rows_f32 (_f16: out as f16): rows [bounds[lo], bounds[hi]) only."""
    r0, r1 = (int(r) for r in view(bounds, hi + 1, np.int32)[[lo, hi]])
    if r1 > r0:
        size = np.dtype(dtype).itemsize
        _swiglu(grid, gate + r0 * gate_ld * 4, up + r0 * up_ld * 4, out + r0 * out_ld * size, r1 - r0, I,
                gate_ld, up_ld, out_ld, dtype)


def _gather_rows_f16(grid, src, rows, dst, R, n, src_ld, dst_ld):
    """cuda/gather_rows.cu strata_gather_rows_f16: the gather, rounded to f16."""
    idx = view(rows, R, np.int32).copy() if rows else np.arange(R)
    for i, r in enumerate(idx):
        view(dst + i * dst_ld * 2, n, np.float16)[:] = view(src + int(r) * src_ld * 4, n)


_EMULATE["swiglu_rows_f32"] = _swiglu_rows
_EMULATE["swiglu_rows_f16"] = lambda *a: _swiglu_rows(*a, dtype=np.float16)
_EMULATE["swiglu_f16"] = lambda *a: _swiglu(*a, dtype=np.float16)
_EMULATE["gather_rows_f16"] = _gather_rows_f16


# cuda/throttle.cu (--pcie-gbs): the fake has no clock; it keeps what the store asked for.
bus_calls: list = []
_EMULATE.update({"bus_stamp": lambda grid, stamp: bus_calls.append(("stamp", stamp)),
                 "bus_wait": lambda grid, stamp, ns: bus_calls.append(("wait", stamp, ns)),
                 "bus_sleep": lambda grid, ns: bus_calls.append(("sleep", ns))})
