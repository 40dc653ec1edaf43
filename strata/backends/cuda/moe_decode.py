"""Launch shapes of cuda/moe_decode.cu (routed experts of one layer for a few decode tokens, each
expert's blob found through a device pointer table), and numpy-in/out wrappers that test them.

    strata_moe_gate_up_<q>(ptrs, gate_off, up_off, ids, x, h, A, I, D)        (kernels.KERNELS["moe_gate_up"])
    strata_moe_down_<q>(ptrs, down_off, ids, h, weights, out, A, D, I)         (kernels.KERNELS["moe_down"])
    strata_moe_gate_up_route_<q>(ptrs, gate_off, up_off, ids, x, h, A, I, D, logits, weights, E, norm_topk)
        gate|up over each token's own routing of logits [T, E], ids and weights written  ("moe_gate_up_route")

gate_up_launch / down_launch give (table op, quant type, grid, block, dynamic shared bytes) from
the sizes alone; grid = (gx, T, 1) with gx about blocks_per_sm * num_sms / T blocks (any gx >= 1
is complete and gives the same bits, so the choice is speed only). Slot s = t * A + a everywhere.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from strata.errors import InvalidArgument
from strata.quant import qtype

from .kernels import KERNELS

LIBRARY = KERNELS["moe_gate_up"].library
THREADS = KERNELS["moe_gate_up"].block   # cuda/moe_decode.cu kThreads
MAX_ACTIVE = 8                 # A per token: warp w of a block serves expert w % A
MAX_SHARED_BYTES = 48 << 10    # dynamic shared memory a launch gets without opting in
# static shared memory of strata_moe_gate_up_route_* (the layer's 512 table entries, the picks; ptxas: 4,160
# bytes at sm_90), rounded up: its staged x must fit beside it
ROUTE_STATIC_BYTES = 5 << 10
NUM_SMS = 132                  # an H200; pass the device's count where it is known
GATE_UP_SIGNATURE = KERNELS["moe_gate_up"].signature
DOWN_SIGNATURE = KERNELS["moe_down"].signature

# (weights per block, units per block, gate/up pairs per job, units a lane holds) of each type's
# unit, mirroring Tile<> in cuda/moe_decode.cu; a float type with n % 8 != 0 takes FLOAT1. Only
# the grid depends on them (gx), so a stale entry costs speed, never correctness.
TILES = {"Q4_0": (32, 1, 1, 2), "Q4_1": (32, 1, 1, 2), "Q5_0": (32, 1, 1, 2), "Q5_1": (32, 1, 1, 2),
         "Q8_0": (32, 1, 1, 2), "IQ4_NL": (32, 1, 1, 2), "Q2_K": (256, 4, 1, 1), "Q3_K": (256, 4, 1, 1),
         "Q4_K": (256, 4, 1, 1), "Q5_K": (256, 4, 1, 1), "Q6_K": (256, 4, 1, 1), "IQ4_XS": (256, 4, 1, 1),
         "F32": (8, 1, 1, 4), "F16": (8, 1, 1, 4), "BF16": (8, 1, 1, 4)}
FLOAT1 = (1, 1, 2, 0)


class Launch(NamedTuple):
    op: str                  # a kernels.KERNELS key
    qtype: str
    grid: tuple
    block: int
    shared_bytes: int

    @property
    def name(self) -> str:
        return KERNELS[self.op].name(qtype=self.qtype)

    @property
    def signature(self) -> str:
        return KERNELS[self.op].signature


def _tile(q: str, n: int) -> tuple:
    tile = TILES[q]
    return FLOAT1 if tile[0] == 8 and n % 8 else tile


def _lanes(units: int) -> int:
    """Lanes per row: the power of two >= units, at most 32 (moe_gemv's unit-to-lane map)."""
    return min(32, 1 << max(units - 1, 0).bit_length())


def staged_floats(q: str, n: int) -> int:
    """Floats one x row of n weights takes in shared memory: 4 pad floats per unit (none for FLOAT1)."""
    block, units_per_block, _, _ = _tile(q, n)
    per_unit = block // units_per_block
    return n // block * units_per_block * (per_unit + 4 if per_unit > 1 else 1)


def _launch(op: str, q: str, T: int, rows: int, n: int, rows_per_job: int, staged_rows: int,
            num_sms: int, blocks_per_sm: int) -> Launch:
    block, units_per_block, _, _ = _tile(q, n)
    set_rows = 32 // _lanes(n // block * units_per_block) * rows_per_job
    num_sets = -(-rows // set_rows)
    gx = max(1, min(num_sets, -(-num_sms * blocks_per_sm // T)))
    shared = 4 * staged_rows * staged_floats(q, n)
    return Launch(op, q, (gx, T, 1), KERNELS[op].block, shared if shared <= MAX_SHARED_BYTES else 0)


def gate_up_launch(q: str, T: int, A: int, I: int, D: int, num_sms: int = NUM_SMS, blocks_per_sm: int = 2) -> Launch:
    """strata_moe_gate_up_<q> for T tokens: row sets of (32 / lanes) gate/up pairs, x row staged (D floats + pad)."""
    q = qtype(q).name
    return _launch("moe_gate_up", q, T, I, D, _tile(q, D)[2], 1, num_sms, blocks_per_sm)


def gate_up_route_launch(q: str, T: int, A: int, I: int, D: int, num_sms: int = NUM_SMS,
                         blocks_per_sm: int = 2) -> Launch:
    """strata_moe_gate_up_route_<q>: gate_up_launch's grid, x staged only where it fits beside the kernel's
    static shared memory (ROUTE_STATIC_BYTES; else read from global memory, the same bits)."""
    spec = gate_up_launch(q, T, A, I, D, num_sms, blocks_per_sm)
    shared = spec.shared_bytes if spec.shared_bytes + ROUTE_STATIC_BYTES <= MAX_SHARED_BYTES else 0
    return spec._replace(op="moe_gate_up_route", shared_bytes=shared)


def down_launch(q: str, T: int, A: int, D: int, I: int, num_sms: int = NUM_SMS, blocks_per_sm: int = 2) -> Launch:
    """strata_moe_down_<q> for T tokens: row sets of (32 / lanes) * 2 * pairs rows, A rows of h staged."""
    q = qtype(q).name
    return _launch("moe_down", q, T, D, I, 2 * _tile(q, I)[2], A, num_sms, blocks_per_sm)


def check_sizes(op: str, q: str, T: int, A: int, I: int, D: int) -> None:
    """InvalidArgument unless the kernels take these sizes (n a multiple of the block, A <= 8)."""
    bs = qtype(q).block_size
    if not (1 <= A <= MAX_ACTIVE and 1 <= T <= 65535 and 0 < I < 2**31 and 0 < D < 2**31
            and I % bs == 0 and D % bs == 0):
        raise InvalidArgument(f"{op} {q}: T {T}, A {A}, I {I}, D {D}: needs 1 <= A <= {MAX_ACTIVE}, "
                              f"1 <= T <= 65535 and I, D multiples of {bs}")


def check_offsets(op: str, q: str, I: int, D: int, gate_off: int, up_off: int, down_off: int) -> None:
    """Matrix starts 16-byte aligned in the blob, or up directly after gate (one fused [2I, D] matrix)."""
    fused = up_off == gate_off + I * qtype(q).row_bytes(D)
    if gate_off % 16 or down_off % 16 or (up_off % 16 and not fused) or min(gate_off, up_off, down_off) < 0:
        raise InvalidArgument(f"{op} {q}: offsets gate {gate_off}, up {up_off}, down {down_off} must be "
                              f"multiples of 16 (up may also follow gate directly)")


class MoeDecodeOps:
    """numpy in, numpy out: each expert blob in its own device allocation (or pinned host memory,
    read by the kernel over the bus), the pointer table, ids and inputs uploaded, one launch, the
    output downloaded. Outputs are poisoned with NaN first, so an element the kernel skips shows."""

    def __init__(self, ops=None, device: int = 0):
        from .testing import CudaOps

        self.ops = ops or CudaOps(device)
        self.rt, self.device, self.stream = self.ops._rt, self.ops.device, self.ops.stream
        self.num_sms = self.device.multiprocessor_count
        self._keep = []                    # buffers the last launch reads

    def _place_blobs(self, blobs, host: frozenset, pads) -> np.ndarray:
        """Copy each blob to a fresh allocation, at pads[e] bytes (a multiple of 16) into it; the table."""
        ptrs = np.empty(len(blobs), np.uint64)
        for e, blob in enumerate(blobs):
            blob = np.ascontiguousarray(blob, dtype=np.uint8).reshape(-1)
            pad = int(pads[e]) if pads is not None else 0
            if e in host:
                buf = self.rt.HostBuffer(self.device, blob.size + pad)
                np.frombuffer(buf, np.uint8)[pad:] = blob
            else:
                buf = self.rt.DeviceBuffer(self.device, blob.size + pad)
                buf.copy_from_host(blob, self.stream, offset=pad)
            self._keep.append(buf)
            ptrs[e] = buf.ptr + pad
        return ptrs

    def _run(self, spec: Launch, args_head, out_shape) -> np.ndarray:
        out = self.ops._output(int(np.prod(out_shape)) * 4)
        self.ops._launch(spec.op, spec.grid, (*args_head[:-3], out, *args_head[-3:]), spec.shared_bytes,
                         stream=self.stream, qtype=spec.qtype)
        result = self.ops._download(out, out_shape, np.float32)
        self._keep.clear()
        return result

    def moe_gate_up(self, q: str, blobs, gate_off: int, up_off: int, ids, x, A: int, I: int, D: int, *,
                    host=(), pads=None, gx: int | None = None) -> np.ndarray:
        """h [T * A, I] = silu(gate_e . x[t]) * (up_e . x[t]) for slot s = t * A + a, e = ids[s];
        blobs[e] holds expert e's matrices at the offsets; host: experts kept in pinned host memory."""
        q = qtype(q).name
        ids = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)
        x = np.ascontiguousarray(x, dtype=np.float32)
        T = x.shape[0] if x.ndim == 2 else 0
        check_sizes("moe_gate_up", q, T, A, I, D)
        check_offsets("moe_gate_up", q, I, D, gate_off, up_off, 0)
        if x.shape != (T, D) or ids.shape != (T * A,) or ids.min() < 0 or ids.max() >= len(blobs):
            raise InvalidArgument(f"moe_gate_up: x {x.shape} must be [T, {D}] and ids [T * {A}] < {len(blobs)}")
        spec = gate_up_launch(q, T, A, I, D, self.num_sms)
        spec = spec._replace(grid=(gx, T, 1)) if gx else spec
        ptrs = self._place_blobs(blobs, frozenset(host), pads)
        args = (self.ops._upload(ptrs), gate_off, up_off, self.ops._upload(ids), self.ops._upload(x), A, I, D)
        return self._run(spec, args, (T * A, I))

    def moe_gate_up_route(self, q: str, blobs, gate_off: int, up_off: int, logits, x, A: int, I: int, D: int,
                          norm_topk: bool = True, *, host=(), pads=None, gx: int | None = None):
        """strata_moe_gate_up_route_<q>: each token's top-A of logits [T, E] (strata_moe_route_f32's picks)
        and moe_gate_up over them -> (h [T * A, I], ids [T, A] int32, weights [T, A] f32)."""
        q = qtype(q).name
        logits = np.ascontiguousarray(logits, dtype=np.float32)
        x = np.ascontiguousarray(x, dtype=np.float32)
        T = x.shape[0] if x.ndim == 2 else 0
        check_sizes("moe_gate_up_route", q, T, A, I, D)
        check_offsets("moe_gate_up_route", q, I, D, gate_off, up_off, 0)
        E = logits.shape[-1] if logits.ndim == 2 else 0
        if x.shape != (T, D) or logits.shape != (T, E) or not A <= E <= min(512, len(blobs)):
            raise InvalidArgument(f"moe_gate_up_route: x {x.shape} must be [T, {D}] and logits {logits.shape} "
                                  f"[T, E] with {A} <= E <= min(512, {len(blobs)} experts)")
        spec = gate_up_route_launch(q, T, A, I, D, self.num_sms)
        spec = spec._replace(grid=(gx, T, 1)) if gx else spec
        ptrs = self._place_blobs(blobs, frozenset(host), pads)
        h, ids, w = (self.ops._output(n * 4) for n in (T * A * I, T * A, T * A))
        self.ops._launch(spec.op, spec.grid, (self.ops._upload(ptrs), gate_off, up_off, ids, self.ops._upload(x), h,
                                              A, I, D, self.ops._upload(logits), w, E, int(bool(norm_topk))),
                         spec.shared_bytes, stream=self.stream, qtype=spec.qtype)
        out = (self.ops._download(h, (T * A, I), np.float32), self.ops._download(ids, (T, A), np.int32),
               self.ops._download(w, (T, A), np.float32))
        self._keep.clear()
        return out

    def moe_down(self, q: str, blobs, down_off: int, ids, h, weights, A: int, D: int, I: int, *,
                 host=(), pads=None, gx: int | None = None) -> np.ndarray:
        """out [T, D] = sum over a in order of weights[s] * (down_e . h[s]), s = t * A + a, e = ids[s]."""
        q = qtype(q).name
        ids = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)
        h = np.ascontiguousarray(h, dtype=np.float32)
        w = np.ascontiguousarray(weights, dtype=np.float32).reshape(-1)
        T = h.shape[0] // A if h.ndim == 2 and A > 0 else 0
        check_sizes("moe_down", q, T, A, I, D)
        check_offsets("moe_down", q, I, D, 0, 0, down_off)
        if h.shape != (T * A, I) or w.shape != (T * A,) or ids.shape != (T * A,) or ids.min() < 0 or ids.max() >= len(blobs):
            raise InvalidArgument(f"moe_down: h {h.shape} must be [T * {A}, {I}], weights and ids [T * {A}], "
                                  f"ids < {len(blobs)}")
        spec = down_launch(q, T, A, D, I, self.num_sms)
        spec = spec._replace(grid=(gx, T, 1)) if gx else spec
        ptrs = self._place_blobs(blobs, frozenset(host), pads)
        args = (self.ops._upload(ptrs), down_off, self.ops._upload(ids), self.ops._upload(h), self.ops._upload(w),
                A, D, I)
        return self._run(spec, args, (T, D))
