"""Device tensors for the GPU engine: activation memory, resident weights and the f16 KV cache.

- `Pool`: activation memory. A tensor's block returns to the pool when its last Python reference
  goes (every kernel runs on one stream, so a later kernel that reuses the block is ordered after
  the earlier readers). Blocks are first-fit ranges of a few large segments; once the largest step
  shape has run, forwards allocate nothing from the driver. A CUDA graph's step gets a pool of its
  own, reserved up front and frozen (see strata.engine.graphs).
- `DeviceTensor`: a typed, shaped view of device memory (a pool block, or a weight).
- `DeviceWeights`: dense.bin uploaded as it is, so every tensor keeps its native block bytes at the
  pack's own offsets (tensor = dense base + offset); the routed experts are reached through the
  expert table of strata.engine.experts.store (expert (l, e) part p = table[l][e] + part offset).
- `DeviceKV`: one sequence's K and V cells in a KV format (strata.quant.kv): f16 [layers, max_cells,
  Hk, Dh] each, or a quantized format's values and scales planes, [layers, max_cells, Hk, ...] each.
"""
from __future__ import annotations

import bisect
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from ...config import KV_VRAM_SLACK
from ...errors import DeviceError, InvalidArgument, PackError, UnsupportedError
from ...pack.source import FileSlice, memmap

ALIGN_BYTES = 256               # pool blocks start on this, as cuMemAlloc's own buffers do
SEGMENT_BYTES = 64 << 20        # smallest pool segment
STAGE_BYTES = 64 << 20          # pinned staging buffer for the weight upload (two of them)
PROGRESS_MIN_BYTES = 1 << 30    # files at least this big print an upload progress line


def gemv_grid(qtype: str, rows: int, n: int, one_row: bool = False) -> int:
    """Blocks of strata_gemv_<qtype> / strata_moe_gemv_<qtype> (same unit scheme) for a [rows, n]
    matrix: one row set per warp, from the unit table strata.backends.cuda.testing.CudaOps keeps;
    one_row: strata_gemv_one_<qtype>'s, a row set of one row a lane."""
    from .testing import CudaOps
    return max(1, -(-rows // CudaOps.gemv_rows_per_block(CudaOps, qtype, n, one_row)))


def split_grid(qtype: str, rows: int, n: int) -> int:
    """Blocks of the split-K one-token GEMVs (strata_gemv_split_<qtype>, strata_gemv_rows_split_<qtype>, and
    strata_add_norm_router_f32, launched as they are): a block per row set of one warp, so four times
    gemv_grid's blocks of four warps' sets. Any grid gives the same bits."""
    return gemv_grid(qtype, rows, n) * 4


def router_grid(rows: int, n: int) -> int:
    """Blocks of strata_router_split_f32 / strata_router_rows_split_f32 (cuda/gemv.cu): one row a lane,
    so a block covers 32 / lanes rows (lanes = the power of two >= the row's units, at most 32: units
    of 8 weights, or of one where n % 8 != 0). Any grid gives the same bits."""
    units = n // 8 if n % 8 == 0 else n
    lanes = min(32, 1 << max(units - 1, 0).bit_length())
    return max(1, -(-rows // (32 // lanes)))


# cuda/gemv_rows.cuh's staged x: the types of one 32-weight block a unit read x from a shared tile of
# STAGE_FLOATS floats (one token: half), each block's 32 padded to STAGE_STRIDE, ROWS_GROUP tokens a
# pass. Where a pass's x fits one tile, a block stages it once for all its row sets, so a grid of a few
# blocks a multiprocessor reads x a few hundred times instead of once a row set (the 30B head at 4
# tokens: 284 -> 248 us on an H100). STAGED_BLOCKS_PER_SM: what the 128-register bodies keep resident.
STAGE_FLOATS, STAGE_STRIDE, ROWS_GROUP, STAGED_BLOCKS_PER_SM = 9216, 36, 4, 4
# The one-row-a-warp kernels (strata_gemv_one_*, strata_gemv3_one_*: 48 registers a thread, 18 KB of x)
# keep more blocks resident; their grids are capped at this many a multiprocessor (read at each launch,
# so tools/decode_variants.py --one-row can A/B it: any grid gives the same bits).
ONE_ROW_BLOCKS_PER_SM = 8


def gemv_whole_grid(qtype: str, rows: int, n: int, T: int, num_sms: int, one_row: bool = False) -> int:
    """Blocks of the whole-matrix strata_gemv_<qtype> (T == 1) or strata_gemv_rows_<qtype> (T tokens),
    or with one_row strata_gemv_one_<qtype> (T == 1): gemv_grid's, capped at STAGED_BLOCKS_PER_SM
    (ONE_ROW_BLOCKS_PER_SM) a multiprocessor where the kernel stages x once a block. Any grid gives
    the same bits (warps stride over row sets)."""
    from .testing import CudaOps
    grid = gemv_grid(qtype, rows, n, one_row)
    block, units, _ = CudaOps.GEMV_UNITS.get(qtype, (0, 0, 0))
    floats = STAGE_FLOATS // 2 if T == 1 else STAGE_FLOATS
    if block != 32 or units != 1 or min(T, ROWS_GROUP) * (n // 32) * STAGE_STRIDE > floats:
        return grid
    return min(grid, (ONE_ROW_BLOCKS_PER_SM if one_row else STAGED_BLOCKS_PER_SM) * num_sms)


class _Block:
    """A range of a pool segment; handed back to the pool when collected."""

    __slots__ = ("pool", "seg", "offset", "size", "__weakref__")

    def __init__(self, pool, seg: int, offset: int, size: int):
        self.pool, self.seg, self.offset, self.size = pool, seg, offset, size

    def __del__(self):
        try:
            self.pool._release(self.seg, self.offset, self.size)
        except Exception:       # interpreter shutdown: the pool may already be gone
            pass


class Pool:
    """First-fit device memory for activations over segments that only grow (see the module doc)."""

    def __init__(self, rt, device, reserve_bytes: int = 0):
        """reserve_bytes > 0: one segment of that size now, and the pool never grows (a graph's pool:
        a growth would be a driver allocation inside a capture)."""
        self.rt, self.device = rt, device
        self.segments: list = []                     # DeviceBuffer
        self.free: list[list[list[int]]] = []        # per segment: sorted [offset, size] ranges
        self.used_bytes = 0
        self.peak_bytes = 0
        self.allocated_bytes = 0                     # every block ever handed out, summed
        self.frozen = reserve_bytes > 0
        if self.frozen:
            self._grow(self.block_bytes(reserve_bytes))

    @staticmethod
    def block_bytes(nbytes: int) -> int:
        """What a request of nbytes takes from a segment."""
        return max(ALIGN_BYTES, -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)

    def _grow(self, seg_bytes: int) -> None:
        self.segments.append(self.rt.DeviceBuffer(self.device, seg_bytes))
        self.free.append([[0, seg_bytes]])

    @property
    def capacity_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def alloc(self, nbytes: int) -> tuple[_Block, object]:
        """A block of at least nbytes and the segment's DeviceBuffer."""
        size = self.block_bytes(nbytes)
        for _ in range(2):
            for seg, ranges in enumerate(self.free):
                for i, (off, free) in enumerate(ranges):
                    if free >= size:
                        if free == size:
                            del ranges[i]
                        else:
                            ranges[i] = [off + size, free - size]
                        return self._take(seg, off, size)
            if self.frozen:
                raise DeviceError(f"device pool: {size} bytes do not fit the {self.capacity_bytes} reserved for "
                                  f"a CUDA graph or a prompt's loan ({self.used_bytes} in use); it may not grow")
            self._grow(max(size, SEGMENT_BYTES))
        raise AssertionError("unreachable: a fresh segment holds the block")

    def _take(self, seg: int, off: int, size: int):
        self.used_bytes += size
        self.allocated_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return _Block(self, seg, off, size), self.segments[seg]

    def _release(self, seg: int, off: int, size: int) -> None:
        self.used_bytes -= size
        ranges = self.free[seg]
        i = bisect.bisect_left(ranges, [off, 0])
        ranges.insert(i, [off, size])
        if i + 1 < len(ranges) and off + size == ranges[i + 1][0]:       # merge with the next range
            ranges[i][1] += ranges.pop(i + 1)[1]
        if i > 0 and ranges[i - 1][0] + ranges[i - 1][1] == off:          # and with the previous one
            ranges[i - 1][1] += ranges.pop(i)[1]


class DeviceTensor:
    """A C-contiguous tensor in device memory: buffer + byte offset, shape, dtype. `keep` holds the
    pool block (or weight buffer) alive for as long as any view of it exists."""

    __slots__ = ("buf", "offset", "shape", "dtype", "keep")

    def __init__(self, buf, offset: int, shape: tuple, dtype, keep):
        self.buf, self.offset, self.shape, self.dtype, self.keep = buf, offset, tuple(shape), np.dtype(dtype), keep

    @property
    def ptr(self) -> int:
        return self.buf.ptr + self.offset

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, shape) -> "DeviceTensor":
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) != self.size:
            raise InvalidArgument(f"reshape: {self.shape} has {self.size} elements, {shape} needs {math.prod(shape)}")
        return DeviceTensor(self.buf, self.offset, shape, self.dtype, self.keep)

    def __getitem__(self, key) -> "DeviceTensor":
        """Rows of axis 0 (a slice with step 1): a view, no copy."""
        if not isinstance(key, slice):
            raise InvalidArgument(f"DeviceTensor: only slices of the first axis are supported, got {key!r}")
        lo, hi, step = key.indices(self.shape[0])
        if step != 1:
            raise InvalidArgument("DeviceTensor: slices with a step are not supported")
        hi = max(hi, lo)
        row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        return DeviceTensor(self.buf, self.offset + lo * row_bytes, (hi - lo, *self.shape[1:]), self.dtype, self.keep)

    def __repr__(self):
        return f"DeviceTensor({self.shape}, {self.dtype}, ptr=0x{self.ptr:x})"


@dataclass(frozen=True)
class Weight:
    """One tensor in native block bytes on the device. shape is numpy order [rows, n]."""
    ptr: int
    qtype: str
    shape: tuple

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])


@dataclass(frozen=True)
class ExpertLayer:
    """One layer's routed experts: the device address of its [E] row of the expert table (each
    expert's blob, wherever it lives now) and each part's offset inside a blob. parts[p].ptr is that
    offset (a Weight for its type and shape)."""
    layer: int
    table: int
    parts: dict             # part -> Weight(ptr = offset in the blob, qtype, shape)
    contiguous_gate_up: bool  # gate and up rows back to back in one type: one [2I, D] matrix

    @classmethod
    def from_meta(cls, layer: int, lay: dict, table: int) -> "ExpertLayer":
        parts = {p: Weight(int(v["offset"]), v["qtype"], tuple(v["shape"])) for p, v in lay["parts"].items()}
        g, u = lay["parts"]["gate"], lay["parts"]["up"]
        fused = g["qtype"] == u["qtype"] and u["offset"] == g["offset"] + g["nbytes"] and g["shape"] == u["shape"]
        return cls(layer, table, parts, fused)


def upload_file(rt, device, stream, path, dst, progress: bool = True, dst_offset: int = 0) -> None:
    """Copy a whole file (or a pack.source.FileSlice) into the device buffer dst from byte dst_offset
    (the rest of dst, at most) through two pinned staging buffers: filling one from the memory map
    overlaps the DMA of the other. A file shorter than that is a PackError naming it."""
    src = memmap(path)
    size = path.nbytes if isinstance(path, FileSlice) else dst.nbytes - dst_offset
    if size <= 0:
        return
    if src.size < size:
        raise PackError(f"{path}: ends at byte {src.size}, pack.json says at least {size}")
    if dst_offset + size > dst.nbytes:
        raise InvalidArgument(f"upload_file: {size} bytes at offset {dst_offset} exceed the buffer's {dst.nbytes}")
    chunk = min(STAGE_BYTES, size)
    stages = [rt.HostBuffer(device, chunk) for _ in range(2)]
    views = [np.frombuffer(s, np.uint8) for s in stages]
    done = [rt.Event(device) for _ in range(2)]
    show = progress and size >= PROGRESS_MIN_BYTES
    t0 = last = time.perf_counter()
    for i, off in enumerate(range(0, size, chunk)):
        j, n = i % 2, min(chunk, size - off)
        if i >= 2:
            done[j].synchronize()
        views[j][:n] = src[off:off + n]
        dst.copy_from_host(views[j][:n], stream, dst_offset + off)
        done[j].record(stream)
        now = time.perf_counter()
        if show and (now - last > 1.0 or off + n == size):
            last = now
            sys.stderr.write(f"strata: uploading {path.name}: {(off + n) / 1e9:.1f} / {size / 1e9:.1f} GB "
                             f"({(off + n) / 1e9 / max(now - t0, 1e-9):.1f} GB/s)\n")
    stream.synchronize()


class DeviceWeights:
    """The dense weights resident on one GPU, and the expert layers whose table rows `experts`
    gives (an ExpertStore: table_row(layer) -> device address; not kept, so the ops that read
    these weights hold no store)."""

    def __init__(self, rt, device, stream, pack, experts, progress: bool = True):
        self.pack = pack
        self._check_alignment(pack)
        self.dense = rt.DeviceBuffer(device, int(pack.meta["files"]["dense.bin"]["bytes"]))
        pieces = getattr(pack, "dense_pieces", None)
        if pieces is None:
            upload_file(rt, device, stream, pack.path / "dense.bin", self.dense, progress)
        else:   # a layer split's stage (strata.engine.layer_split.StagePack): its tensors, packed anew
            for src, n, dst in pieces:
                upload_file(rt, device, stream, src, self.dense, progress, dst_offset=dst)
        self.bytes_h2d = self.dense.nbytes
        self.layers = [ExpertLayer.from_meta(l, lay, experts.table_row(l))
                       for l, lay in enumerate(pack.meta["experts"]["layers"])]

    @staticmethod
    def _check_alignment(pack) -> None:
        # The GEMV and dequant kernels read 16-byte words from a tensor's start.
        for lay in pack.meta["experts"]["layers"]:
            for part, p in lay["parts"].items():
                if (lay["offset"] + p["offset"]) % 16 or lay["stride"] % 16:
                    raise UnsupportedError(f"{pack.path}: expert part {part} of layer {lay['layer']} is not "
                                           f"16-byte aligned in experts.bin; the GPU engine needs it")

    def tensor(self, name: str) -> Weight:
        t = self.pack.meta["dense"].get(name)
        if t is None:
            raise InvalidArgument(f"{self.pack.path}: no dense tensor {name!r}")
        return Weight(self.dense.ptr + t["offset"], t["qtype"], tuple(t["shape"]))

    def has(self, name: str) -> bool:
        return name in self.pack.meta["dense"]


class HandOff(NamedTuple):
    """A prompt chunk's rows from a layer split's card to the next (strata.engine.cuda_split), passed
    through model.forward in place of the token ids: the card's normed and x [T, D] on its device,
    and copy(dst, src, nbytes), which queues a copy of them on the next card's stream."""
    normed: DeviceTensor
    x: DeviceTensor
    copy: Callable


class Positions(DeviceTensor):
    """A forward's positions [T + 1] int32 on the device (DeviceOps.upload_positions: the positions,
    then max + 1) with num_cells = max + 1 kept on the host: a prompt chunk's attention reads cells
    0..num_cells-1 only, so the copy of a layer it reads (staged from the host, or dequantized) needs
    no more."""

    __slots__ = ("num_cells",)

    def __init__(self, t: DeviceTensor, num_cells: int):
        super().__init__(t.buf, t.offset, t.shape, t.dtype, t.keep)
        self.num_cells = num_cells


class StepRows(DeviceTensor):
    """The positions of a decode step's rows [T + 1] int32 on the device (the positions, then
    max + 1), with three more int32 arrays [T] beside them in device memory: each row's attention
    length, the cache cell its K/V goes to, and the first cell of its sequence. Rows of one
    sequence (a step, a verify window) and rows of several parallel slots in one DeviceKV take the
    same form, so one CUDA graph serves both. num_slots: the slots of the cache the rows may come
    from (a graph replays the rows of any of them)."""

    __slots__ = ("lengths", "cells", "bases", "num_slots")

    def __init__(self, buf, offset: int, T: int, keep, lengths: int, cells: int, bases: int, num_slots: int):
        super().__init__(buf, offset, (T + 1,), np.int32, keep)
        self.lengths, self.cells, self.bases, self.num_slots = lengths, cells, bases, num_slots


class PromptSegments(StepRows):
    """The rows of several parallel slots' prompts read in one forward (CudaRunner.prefill_batch):
    StepRows over every row (each row's position and the cache cell its K/V goes to, so one append
    launch writes every slot's cells), and `parts`: for each prompt, (r0, r1, kv, positions), its rows
    r0..r1 - 1, its slot's view of the cache and its own positions as upload_positions gives them alone,
    so its attention is the launch that prompt read alone makes (ops_attention._attend_cells)."""

    __slots__ = ("parts",)

    def __init__(self, rows: StepRows, parts: tuple):
        super().__init__(rows.buf, rows.offset, rows.shape[0] - 1, rows.keep, rows.lengths, rows.cells, rows.bases,
                         rows.num_slots)
        self.parts = parts


class HostPlane:
    """A KV plane in mapped pinned host memory (--kv-resident): kernels read and write it in place
    over the bus at `ptr` (the mapping's device address), as decode reads experts from the pinned
    arena; copies by address (copy_d2d) take it like device memory. The host side of its copies
    synchronizes the stream first, as the kernels queued on it may still write the plane."""

    def __init__(self, rt, device, nbytes: int):
        self.host = rt.HostBuffer(device, nbytes, mapped=True)
        self.nbytes = nbytes
        self.ptr = self.host.device_ptr if nbytes else 0

    def _bytes(self) -> np.ndarray:
        return np.frombuffer(self.host, np.uint8)

    def fill_bytes(self, value: int, stream=None) -> None:
        if stream is not None:
            stream.synchronize()
        if hasattr(self.host, "fill_bytes"):        # the planner's dry run: no memory behind it
            self.host.fill_bytes(value)
            return
        self._bytes()[:] = value

    def copy_to_host(self, dst, stream=None, offset: int = 0) -> None:
        if stream is not None:
            stream.synchronize()
        flat = np.asarray(dst).reshape(-1).view(np.uint8)
        flat[:] = self._bytes()[offset:offset + flat.nbytes]

    def copy_from_host(self, src, stream=None, offset: int = 0) -> None:
        if stream is not None:
            stream.synchronize()
        flat = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        self._bytes()[offset:offset + flat.nbytes] = flat


class DeviceKV:
    """K and V cells of num_slots sequences of max_cells cells each, in KV format fmt, zero-filled
    (the tiled attention kernels may load cells past a sequence's length; zeros keep them finite, and
    zero planes decode to zeros). Slot s holds cells s * max_cells .. (s + 1) * max_cells - 1 of every
    layer; view(s) is that slot as a one-sequence cache (a prompt reads into it), and a decode step's
    rows name their cells and bases (StepRows) over the whole cache.

    f16: buffers k and v, [num_layers, num_slots * max_cells, Hk, Dh] f16 each (layer() gives their
    addresses). int8, q4_0, k8v4: per codec of K and V (strata.quant.kv.codecs) a values and a scales
    buffer, [num_layers, num_slots * max_cells, Hk, width] each as the codec lays them out (planes()
    gives them), so nbytes is strata.engine.planner.kv_bytes of the format for all the cells.

    on_host (--kv-resident below the context): every buffer is a HostPlane, mapped pinned host
    memory at the same layout, the authoritative cells; the kernels append to it and a prompt chunk's
    attention reads a copy of the layer staged in VRAM (DeviceOps). vram_window > 0 keeps each
    slot's newest cells in VRAM too: per buffer a ring of vram_ring_cells = vram_window + KV_VRAM_SLACK
    cells a layer and slot, [num_layers, num_slots, vram_ring_cells, Hk, ...] (vram_planes()), a
    slot's position p at p % vram_ring_cells of its ring. Every append is copied into its slot's ring
    (strata_kv_ring_append), and a decode step reads each row's sequence's newest vram_window cells
    from its ring and the older ones in place over the bus (cuda/kv_codec.cuh VramWindow). It is
    never read before it is written, so it is not zeroed.

    The slack keeps speculation's rejected cells harmless: a verify window (and the drafter) writes
    positions p < n + KV_VRAM_SLACK for a sequence of n cells (at most 8 rows past it), into the slot
    of position p - vram_ring_cells < n - vram_window, older than every position a later row reads from
    the ring (a sequence never shrinks except by a rewind, after which vram_refill rewrites the
    window). So the ring needs no repair after a rejection: the next window's appends rewrite those
    positions, host and ring alike.

    ring = (window, slots) (--draft-window): the last layer (the MTP draft layer) holds `slots` cells
    only, after the other layers' in every buffer, position p in cell p % slots, and the decode
    attention reads its last `window` positions (ring(layer)); one slot of sequences only."""

    def __init__(self, rt, device, stream, num_layers: int, max_cells: int, num_kv_heads: int, head_dim: int,
                 fmt: str = "f16", num_slots: int = 1, on_host: bool = False, ring: tuple[int, int] | None = None,
                 vram_window: int = 0):
        from ...quant import kv as kv_formats
        if fmt not in kv_formats.KV_FORMATS:
            raise InvalidArgument(f"DeviceKV: KV format must be one of {', '.join(kv_formats.KV_FORMATS)}, got {fmt!r}")
        if num_slots < 1:
            raise InvalidArgument(f"DeviceKV: num_slots must be >= 1, got {num_slots}")
        self.num_layers, self.max_cells, self.num_slots = num_layers, max_cells, num_slots
        self.layer_cells = num_slots * max_cells
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.fmt = fmt
        self.base = 0                   # the first cell of the sequence layer() and planes() start at
        self.whole = self               # the cache of every slot (a view's parent)
        self.codecs = kv_formats.codecs(fmt)
        self.on_host = on_host
        self.ring_window, self.ring_cells = ring or (0, 0)
        if self.ring_cells and (num_slots > 1 or on_host or not 0 < self.ring_window < self.ring_cells):
            raise InvalidArgument(f"DeviceKV: a ring of {self.ring_cells} cells (window {self.ring_window}) takes one "
                                  f"slot in VRAM and a window below its cells")
        # cells of each buffer: every layer's layer_cells, the last one's ring_cells where it is a ring
        cells = num_layers * self.layer_cells - (self.layer_cells - self.ring_cells if self.ring_cells else 0)

        def buffer(nbytes: int):
            return HostPlane(rt, device, nbytes) if on_host else rt.DeviceBuffer(device, nbytes)
        if fmt == "f16":
            self.layer_bytes = self.layer_cells * num_kv_heads * head_dim * 2
            self.k = buffer(cells * num_kv_heads * head_dim * 2)
            self.v = buffer(cells * num_kv_heads * head_dim * 2)
            self.buffers = [(self.k, num_kv_heads * head_dim * 2), (self.v, num_kv_heads * head_dim * 2)]
        else:
            self.buffers = []           # (buffer, bytes per cell): K values, K scales, V values, V scales
            for codec in self.codecs:
                codec.check(head_dim)
                values, scales = codec.empty((num_kv_heads,), head_dim)
                for plane in (values, scales):
                    self.buffers.append((buffer(cells * plane.nbytes),
                                         plane.nbytes))
        for buf, _ in self.buffers:       # on the engine's stream: a non-blocking stream would not
            buf.fill_bytes(0, stream)     # wait for a memset on the legacy one
        if vram_window and not (on_host and not self.ring_cells and 0 < vram_window < max_cells):
            raise InvalidArgument(f"DeviceKV: a VRAM window of {vram_window} cells needs the cells on the host, "
                                  f"no ring, and 0 < window < max_cells ({max_cells})")
        self.vram_window = vram_window
        self.vram_ring_cells = vram_window + KV_VRAM_SLACK if vram_window else 0
        self.vram_rings = [rt.DeviceBuffer(device, num_layers * num_slots * self.vram_ring_cells * cell)
                           for _, cell in self.buffers] if vram_window else []

    @property
    def quantized(self) -> bool:
        return self.fmt != "f16"

    @property
    def nbytes(self) -> int:
        return sum(buf.nbytes for buf, _ in self.buffers)

    @property
    def vram_bytes(self) -> int:
        """Bytes of the cells in VRAM: every cell, or on the host only the VRAM window's."""
        return sum(r.nbytes for r in self.vram_rings) if self.on_host else self.nbytes

    @property
    def host_bytes(self) -> int:
        """Bytes of the cells in pinned host memory."""
        return self.nbytes if self.on_host else 0

    @property
    def cell_bytes(self) -> int:
        """Bytes of one cell of one layer, every plane."""
        return sum(cell for _, cell in self.buffers)

    def ring(self, layer: int) -> tuple[int, int]:
        """(window, cells) of layer's ring, (0, 0) where the layer keeps every position's cell."""
        return (self.ring_window, self.ring_cells) if self.ring_cells and layer == self.num_layers - 1 else (0, 0)

    def layer_size(self, layer: int) -> int:
        """Cells layer holds for this cache's sequences (its ring's, or max_cells per slot)."""
        return self.ring(layer)[1] or self.layer_cells

    def _check(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise InvalidArgument(f"KV layer {layer} out of range 0..{self.num_layers - 1}")

    def layer(self, layer: int) -> tuple[int, int]:
        """Device addresses of layer's f16 K and V cells [max_cells, Hk, Dh]."""
        self._check(layer)
        if self.quantized:
            raise InvalidArgument(f"DeviceKV.layer: the cells are {self.fmt}, read them with planes()")
        off = layer * self.layer_bytes + self.base * self.num_kv_heads * self.head_dim * 2
        return self.k.ptr + off, self.v.ptr + off

    def planes(self, layer: int) -> tuple[int, int, int, int]:
        """Device addresses of layer's K values, K scales, V values, V scales (a quantized format)."""
        self._check(layer)
        if not self.quantized:
            raise InvalidArgument("DeviceKV.planes: the cells are f16, read them with layer()")
        return tuple(buf.ptr + (layer * self.layer_cells + self.base) * cell for buf, cell in self.buffers)

    def cell_ranges(self, layer: int) -> list[tuple[int, int]]:
        """(address of cell 0, bytes per cell) of each of layer's buffers: cells c0..c1-1 of a buffer
        are the bytes [addr + c0 * cell, addr + c1 * cell)."""
        self._check(layer)
        return [(buf.ptr + (layer * self.layer_cells + self.base) * cell, cell) for buf, cell in self.buffers]

    def vram_planes(self, layer: int) -> list[int]:
        """Device addresses of layer's VRAM ring of this cache's first slot (a view's: its slot's),
        one per buffer (as cell_ranges orders them), or zeros without one (the decode kernels' null
        window). A layer's rings are its slots' one after another, so a kernel given the first
        slot's finds slot s's s * vram_ring_cells cells on (cuda/kv_codec.cuh vram_ring_first)."""
        self._check(layer)
        if not self.vram_window:
            return [0] * len(self.buffers)
        ring = (layer * self.num_slots + self.base // self.max_cells) * self.vram_ring_cells
        return [r.ptr + ring * cell for r, (_, cell) in zip(self.vram_rings, self.buffers)]

    def vram_from(self, length: int) -> int:
        """The first of a sequence's `length` cells the VRAM window holds (VramWindow's rule, one row)."""
        return max(0, length - self.vram_window) if self.vram_window else length

    def vram_refill(self, length: int) -> list[tuple[int, int, int]]:
        """(destination, source, bytes) of the copies that make the VRAM window hold the newest of a
        sequence's `length` cells from the host cells (at most two ranges a plane and layer, the ring
        wrapping): a prompt that reuses a prefix runs them, since the window may hold a longer earlier
        sequence's cells, or cells a warm-up or a kept conversation's copy put back on the host only."""
        lo, w = self.vram_from(length), self.vram_ring_cells
        out = []
        for layer in range(self.num_layers if w else 0):
            for (src, cell), dst in zip(self.cell_ranges(layer), self.vram_planes(layer)):
                c = lo
                while c < length:
                    n = min(length - c, w - c % w)
                    out.append((dst + c % w * cell, src + c * cell, n * cell))
                    c += n
        return out

    def view(self, slot: int) -> "DeviceKV":
        """Slot `slot` as a one-sequence cache over the same buffers: its layer(), planes() and
        cell_ranges() start at the slot's first cell (slot 0 of a one-slot cache is the cache)."""
        if not 0 <= slot < self.num_slots:
            raise InvalidArgument(f"KV slot {slot} out of range 0..{self.num_slots - 1}")
        if slot == 0 and self.num_slots == 1:
            return self
        v = object.__new__(DeviceKV)
        v.__dict__.update(self.__dict__)
        v.base, v.whole = slot * self.max_cells, self
        return v
