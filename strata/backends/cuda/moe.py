"""Routed SwiGLU experts on the GPU: the decode path and the prompt path.

Every expert is reached through the layer's row of the expert table (strata.engine.experts.store):
its blob is a resident copy, a VRAM cache slot, a prompt ring slot or (decode only) the pinned host
arena read in place. Decode (a few tokens): cuda/moe_decode.cu, two launches (gate|up with SwiGLU,
down with the weighted sum), each slot reading its expert's address from the table at its
device-side id, so routing never waits for the host. Prompt chunks get their experts from the
chunk's MoePlan (strata.backends.cuda.moe_plan), which the runner builds and the model passes
down. Where the plan hands out experts without needing the routing (all resident, or a chunk that
streams every non-cached expert): the routing is grouped on the device (cuda/moe_group.cu), the
rows gathered into expert order, and each of the plan's batches is one tensor-core launch per
matrix over a worst-case tile grid (experts outside the batch have address 0 and are skipped),
SwiGLU over the batch's rows, then one weighted combine puts the rows back into token order. Smaller streamed chunks stage only the
experts they route to: their ids come to the host, are grouped with numpy, and the batches get
tables uploaded per batch. Slot s = t * A + a is token t's a-th expert everywhere.
"""
from __future__ import annotations

import numpy as np

from ...errors import InvalidArgument
from ...quant import qtype as qtype_of
from .kernels import DQ_GROUP_QTYPES, KERNELS, dequant_grid
from .memory import DeviceTensor, ExpertLayer, Weight, gemv_grid
from .moe_gemm import BM as GEMM_BM
from .moe_gemm import QTYPE_NAMES as GEMM_QTYPES
from .moe_gemm import launch_for, tiles_for, wst_launch_for, wst_takes
from .moe_decode import MAX_ACTIVE, down_launch, gate_up_launch, gate_up_route_launch
from .moe_plan import MoePlan

GROUP_SIGNATURE = KERNELS["moe_group"].signature


def tensor_core_gemm(qtype: str, K: int, on: bool = True) -> bool:
    """Whether cuda/moe_gemm.cu takes a weight of this type with rows of K values (`on`: the
    tensor-core-prompt path, KernelPaths). F32 weights keep the f32 GEMM (they are test models'
    and exact there)."""
    return (on and qtype != "F32" and qtype in GEMM_QTYPES
            and K > 0 and K % max(qtype_of(qtype).block_size, 8) == 0)


class GroupTable:
    """A device block for cuda/moe_gemm.cu's launches: G blob addresses (uint64) then tiles
    ([n, 4] int32), sized once for the worst case (max_groups groups over max_rows rows) so the
    pool sees the same block whatever the routing; refilled per batch (the stream orders each
    refill after the launches that read the last one)."""

    def __init__(self, ops, max_groups: int, max_rows: int):
        self.ops = ops
        self.max_groups = -(-max_groups // 2) * 2            # the tiles start 16-byte aligned (int4 loads)
        self.max_tiles = -(-max_rows // GEMM_BM) + max_groups
        self.t = ops.alloc((8 * self.max_groups + 16 * self.max_tiles,), np.uint8)
        self.tiles_ptr = self.t.ptr + 8 * self.max_groups

    def fill(self, ptrs: list, ranges: list) -> int:
        """Upload blob addresses and the tiles of ranges [(group, s0, rows)]; -> number of tiles."""
        tiles = tiles_for(ranges)
        assert len(ptrs) <= self.max_groups and len(tiles) <= self.max_tiles
        addrs = np.zeros(self.max_groups, np.uint64)
        addrs[:len(ptrs)] = ptrs
        data = np.concatenate([addrs.view(np.uint8), tiles.reshape(-1).view(np.uint8)])
        self.t.buf.copy_from_host(data, self.ops.stream, self.t.offset)
        self.ops.bytes_h2d += data.nbytes
        return len(tiles)


def grouped_gemm(ops, ptrs: int, tiles: int, n_tiles: int, w: Weight, X: int, ldx: int, Y: int, ldy: int,
                 N: int, tma: tuple | None = None, x16: bool | None = None) -> None:
    """Y rows of every tile = X rows @ (group's matrix at ptrs[group] + w.ptr)^T, one launch; ptrs
    and tiles are device addresses ([G] uint64 blob addresses, [n_tiles, 4] int32 tiles). X is f16
    (ldx in halves) where x16 (default ops.gemm_x16), else f32. tma: (w_base, w_rows, x_rows) where every
    group's f16 matrix lies in one block of f16 rows from w_base (tma-gemm's scratch) and X (f16) has x_rows
    rows: strata_moe_gemm_wst_f16 moves both operands by the TMA (where its alignment holds; else the
    f16-X GEMM that copies them, moe_gemm_ws16)."""
    if not n_tiles:
        return
    x16 = ops.gemm_x16 if x16 is None else x16
    if tma is not None and w.qtype == "F16" and wst_takes(X, ldx, tma[0], w.shape[-1]):
        w_base, w_rows, x_rows = tma
        grid, tail, shared = wst_launch_for(ops.rt, N, n_tiles, ops.num_sms, X, x_rows, ldx, w_base, w_rows, w.shape[-1])
        ops.launch("moe_gemm_wst", grid, (ptrs, w.ptr, tiles, X, ldx, Y, ldy, N, w.shape[-1], *tail), shared)
        return
    op = ops.gemm_op if x16 == ops.gemm_x16 else "moe_gemm_ws16"    # f16 X on tma-gemm's path: the wgmma build reads it
    grid, tail, shared = launch_for(op, N, n_tiles, ops.num_sms)
    ops.launch(op, grid, (ptrs, w.ptr, tiles, X, ldx, Y, ldy, N, w.shape[-1], *tail), shared, qtype=w.qtype)


def group_on_device(ops, ids: DeviceTensor, E: int):
    """ids [T, A] (ids in [0, E)) -> (index [2S + E + 1] int32: the token of each sorted row | the
    sorted row of each slot | each expert's first sorted row (and S), tiles [n, 4] int32, n) with
    n = E + S // BM, the worst case (cuda/moe_group.cu); the order is group_by_expert's."""
    S, A = ids.size, ids.shape[1]
    n = E + S // GEMM_BM
    index, tiles = ops.alloc((2 * S + E + 1,), np.int32), ops.alloc((n, 4), np.int32)
    ops.launch("moe_group", E + 1,
               (ids.ptr, S, A, E, index.ptr, index.ptr + 4 * S, index.ptr + 8 * S, tiles.ptr, n, GEMM_BM))
    return index, tiles, n


def _moe_gemv(ops, lay: ExpertLayer, part: str, ids: DeviceTensor, x: int, x_div: int, y: int, rows: int) -> None:
    """y [S, rows] = part of expert ids[s] (rows x n at table[ids[s]] + offset) times x row s // x_div."""
    w = lay.parts[part]
    n = w.shape[-1]
    ops.launch("moe_gemv", (gemv_grid(w.qtype, rows, n), ids.size), (lay.table, w.ptr, ids.ptr, x, x_div, y, rows, n),
               qtype=w.qtype)


def _swiglu(ops, gate: int, up: int, out: int, rows: int, I: int, ld: int, f16: bool = False) -> None:
    """out [rows, I] = silu(gate) * up; f16: out as f16 (the f16-X prompt GEMMs' input)."""
    ops.launch("swiglu_f16" if f16 else "swiglu", (-(-I // 256), min(rows, 65535)),
               (gate, up, out, rows, I, ld, ld, I))


def _combine(ops, y: DeviceTensor, rows: int, weights: DeviceTensor, T: int, A: int, D: int,
             residual: int = 0) -> DeviceTensor:
    """out [T, D] = residual + sum_a weights[t, a] * y row (t, a); rows: int32 device pointer, or 0 for
    t * A + a; residual: a device address of [T, D] f32 (the host's experts), 0 for none (zeros)."""
    out = ops.alloc((T, D))
    ops.launch("moe_combine", (-(-D // 256), min(T, 65535)),
               (residual or ops._zeros_ptr(T * D * 4), y.ptr, rows, weights.ptr, out.ptr, T, A, D))
    return out


def _host_share(ops, x: DeviceTensor, layer: int, ids: np.ndarray, weights: DeviceTensor, plan: MoePlan):
    """The host's experts of this layer (plan.host chooses them from the routing ids) started on its
    worker -> (their ids, wait() giving the device address of their weighted sum), or ((), None)."""
    experts = plan.host.choose(layer, ids)
    if not experts:
        return (), None
    return experts, plan.host.start(layer, experts, ops.to_host(x), ids, ops.to_host(weights))


def _zero_rows(ops, y: DeviceTensor, ids: np.ndarray, experts) -> None:
    """The sorted output rows (group_by_expert's order) of experts the GPU skipped are zeros, so the
    combine's weighted sum over them adds nothing."""
    _, ex, starts, counts, _ = group_by_expert(ids)
    D = y.shape[1]
    for e, s0, c in zip(ex.tolist(), starts.tolist(), counts.tolist()):
        if e in experts:
            ops.rt.copy_d2d(y.ptr + s0 * D * 4, ops._zeros_ptr(c * D * 4), c * D * 4, ops.stream)


def fused_decode_takes(ops, lay: ExpertLayer, T: int, A: int) -> bool:
    """Whether moe_decode runs cuda/moe_decode.cu's two launches (else the GEMV path)."""
    gate, up = lay.parts["gate"], lay.parts["up"]
    return ops.paths.fused_decode and gate.qtype == up.qtype and A <= MAX_ACTIVE and T <= 65535


def moe_decode(ops, x: DeviceTensor, lay: ExpertLayer, ids: DeviceTensor, weights: DeviceTensor,
               route: tuple | None = None) -> DeviceTensor:
    """x [T, D] -> [T, D] for small T: gate|up with SwiGLU, then down with the weighted sum over a
    token's experts (cuda/moe_decode.cu, two launches); the GEMV path where those kernels do not apply.
    route = (logits [T, E], norm_topk): ids and weights are not yet written, and the gate|up launch routes
    each token itself (strata_moe_gate_up_route_*, the top-k of strata_moe_route_f32 bit for bit) and
    writes them; only where fused_decode_takes."""
    x = ops._aligned(x)
    T, D = x.shape
    A = ids.shape[1]
    gate, up, down = lay.parts["gate"], lay.parts["up"], lay.parts["down"]
    I = gate.rows
    fused = fused_decode_takes(ops, lay, T, A)
    if route is not None and not fused:
        raise InvalidArgument(f"moe_decode: the routing in gate|up needs its fused kernels ({gate.qtype} gate, "
                              f"{up.qtype} up, {T} tokens top-{A})")
    if fused:
        h = ops.alloc((T * A, I))
        if route is None:
            spec = gate_up_launch(gate.qtype, T, A, I, D, ops.num_sms)
            ops.launch("moe_gate_up", spec.grid, (lay.table, gate.ptr, up.ptr, ids.ptr, x.ptr, h.ptr, A, I, D),
                       spec.shared_bytes, qtype=gate.qtype)
        else:
            logits, norm_topk = route
            spec = gate_up_route_launch(gate.qtype, T, A, I, D, ops.num_sms)
            ops.launch("moe_gate_up_route", spec.grid,
                       (lay.table, gate.ptr, up.ptr, ids.ptr, x.ptr, h.ptr, A, I, D, logits.ptr, weights.ptr,
                        logits.shape[-1], int(bool(norm_topk))), spec.shared_bytes, qtype=gate.qtype)
        out = ops.alloc((T, D))
        spec = down_launch(down.qtype, T, A, D, I, ops.num_sms)
        ops.launch("moe_down", spec.grid, (lay.table, down.ptr, ids.ptr, h.ptr, weights.ptr, out.ptr, A, D, I),
                   spec.shared_bytes, qtype=down.qtype)
        return out
    return _moe_decode_gemv(ops, x, lay, ids, weights)


def gpu_slots(ids: np.ndarray, weights: np.ndarray, experts, stand_in: int) -> tuple[np.ndarray, np.ndarray]:
    """The routing the GPU runs when the host computes `experts`: their slots read expert stand_in
    (cached in VRAM) with weight 0, the other slots as routed."""
    mine = np.isin(ids, experts)
    return (np.where(mine, stand_in, ids).astype(ids.dtype), np.where(mine, 0.0, weights).astype(weights.dtype))


def moe_decode_split(ops, x: DeviceTensor, lay: ExpertLayer, ids: DeviceTensor, weights: DeviceTensor,
                     host) -> DeviceTensor:
    """moe_decode with the host's share of the step's misses (--cpu-experts; host: MoePlan.host of a
    split decode step, DecodeStepSplit): the routing, its weights and x come to the host (one stream
    sync), host.choose picks the host's experts and a cached expert of the layer, the host starts on
    its experts, and the GPU runs moe_decode over the routing with the host's slots pointed at that
    cached expert with weight 0 (read from VRAM, not the bus; fmaf(0, finite, acc) leaves the sum as
    it was); then out += the host's weighted sum (mapped pinned memory, read once the host is done)."""
    ids_h, w_h, x_h = (np.empty(t.shape, t.dtype) for t in (ids, weights, x))
    for t, h in ((ids, ids_h), (weights, w_h), (x, x_h)):
        t.buf.copy_to_host(h, ops.stream, t.offset)
    ops.stream.synchronize()
    experts, stand_in = host.choose(lay.layer, ids_h)
    if not experts:
        return moe_decode(ops, x, lay, ids, weights)
    wait = host.start(lay.layer, experts, x_h, ids_h, w_h)
    gpu_ids, gpu_w = gpu_slots(ids_h, w_h, experts, stand_in)
    gpu = moe_decode(ops, x, lay, ops.upload(gpu_ids), ops.upload(gpu_w))
    out = ops.alloc(gpu.shape)
    ops.launch("add", max(1, min(-(-gpu.size // 1024), 8 * ops.num_sms)), (gpu.ptr, wait(), out.ptr, gpu.size))
    return out


def _moe_decode_gemv(ops, x: DeviceTensor, lay: ExpertLayer, ids: DeviceTensor, weights: DeviceTensor) -> DeviceTensor:
    """The GEMV path: three GEMV launches (two when gate|up are one matrix), SwiGLU, combine."""
    T, D = x.shape
    A = ids.shape[1]
    S = T * A
    I = lay.parts["gate"].rows
    h = ops.alloc((S, I))
    if lay.contiguous_gate_up:
        gu = ops.alloc((S, 2 * I))
        _moe_gemv(ops, lay, "gate", ids, x.ptr, A, gu.ptr, 2 * I)
        _swiglu(ops, gu.ptr, gu.ptr + I * 4, h.ptr, S, I, 2 * I)
    else:
        g, u = ops.alloc((S, I)), ops.alloc((S, I))
        _moe_gemv(ops, lay, "gate", ids, x.ptr, A, g.ptr, I)
        _moe_gemv(ops, lay, "up", ids, x.ptr, A, u.ptr, I)
        _swiglu(ops, g.ptr, u.ptr, h.ptr, S, I, I)
    y = ops.alloc((S, D))
    _moe_gemv(ops, lay, "down", ids, h.ptr, 1, y.ptr, D)
    return _combine(ops, y, 0, weights, T, A, D)


def group_by_expert(ids: np.ndarray):
    """ids [T, A] -> (order: slots sorted by expert (stable), experts, starts, counts, rows) where
    rows[s] is the sorted position of slot s (moe_combine's row of (t, a))."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]]) if flat.size else np.zeros(0, np.int64)
    experts, counts = ordered[starts], np.diff(np.r_[starts, flat.size])
    rows = np.empty(flat.size, np.int32)
    rows[order] = np.arange(flat.size, dtype=np.int32)
    return order, experts, starts, counts, rows


def _at(blob: int, w: Weight, rows: int | None = None) -> Weight:
    """Part w of the expert whose blob is at address blob."""
    return Weight(blob + w.ptr, w.qtype, (rows or w.rows, w.shape[-1]))


def _expert_rows(ops, x: DeviceTensor, index: int, S: int, I: int, fused: bool, f16: bool = False, dq=None):
    """The prompt path's buffers: xs [S, D] (row r = x row index[r], rows in expert order), then h
    [S, I] (SwiGLU out), the gate|up outputs (gu [S, 2I] when fused, else g and u [S, I]), y [S, D].
    f16: xs and h as f16, the f16-X prompt GEMMs' inputs (ops.gemm_x16), xs rounded by the gather.
    dq: a function called once the buffers are taken and before the gather, whose truth makes xs and h f16
    after all (tma-gemm's scratch taken); they are then blocks of the f32 size, as the memory plan prices.
    -> (xs, h, gu, g, u, y, dq's answer)."""
    D = x.shape[1]
    dtype = np.float16 if f16 else np.float32
    xs, h = ops.alloc((S, D), dtype), ops.alloc((S, I), dtype)
    gu = ops.alloc((S, 2 * I)) if fused else None
    g, u = (None, None) if fused else (ops.alloc((S, I)), ops.alloc((S, I)))
    y = ops.alloc((S, D))
    taken = dq() if dq is not None else None
    if taken and not f16:
        f16 = True
        xs, h = (DeviceTensor(t.buf, t.offset, t.shape, np.float16, t.keep) for t in (xs, h))
    ops._copy_rows(x.ptr, index, xs.ptr, S, D, D, D, f16)
    return xs, h, gu, g, u, y, taken


def _swiglu_in(gu, g, u, I: int) -> tuple[int, int, int]:
    """(gate address, up address, row stride) of the gate|up outputs, fused or not."""
    return (gu.ptr, gu.ptr + I * 4, 2 * I) if gu is not None else (g.ptr, u.ptr, I)


def _gate_up_tc(ops, ptrs: int, tiles: int, n: int, lay: ExpertLayer, xs, gu, g, u) -> None:
    """gate and up of every tile's expert on tensor cores: one launch for the fused [2I, D] matrix."""
    gate, up = lay.parts["gate"], lay.parts["up"]
    I, D = gate.rows, gate.shape[-1]
    if gu is not None:
        grouped_gemm(ops, ptrs, tiles, n, Weight(gate.ptr, gate.qtype, (2 * I, D)), xs.ptr, D, gu.ptr, 2 * I, 2 * I)
    else:
        grouped_gemm(ops, ptrs, tiles, n, gate, xs.ptr, D, g.ptr, I, I)
        grouped_gemm(ops, ptrs, tiles, n, up, xs.ptr, D, u.ptr, I, I)


def moe_grouped(ops, x: DeviceTensor, lay: ExpertLayer, ids: DeviceTensor, weights: DeviceTensor,
                plan: MoePlan) -> DeviceTensor:
    """x [T, D] -> [T, D] for a prompt chunk: the active experts' GEMMs over their rows only, batch
    by batch as the chunk's plan makes the experts readable (one tensor-core launch per matrix and
    batch where cuda/moe_gemm.cu takes the types, else per expert over dequantized matrices)."""
    T, D = x.shape
    A = ids.shape[1]
    S = T * A
    gate, up, down = lay.parts["gate"], lay.parts["up"], lay.parts["down"]
    tc = all(tensor_core_gemm(p.qtype, p.shape[-1], ops.paths.tensor_core_prompt) for p in (gate, up, down))
    if plan.batches is None:
        raise InvalidArgument(f"moe: a prompt chunk of {T} tokens needs a plan with its batches (MoePlan.batches)")
    ids_host, on_host, wait = None, (), None
    if plan.host is not None and plan.host.may_take(lay.layer):    # the host's share of the misses (--cpu-experts)
        ids_host = ops.to_host(ids)
        on_host, wait = _host_share(ops, x, lay.layer, ids_host, weights, plan)
    if ops.paths.group_on_device and tc and plan.routing_free:
        return _moe_grouped_on_device(ops, x, lay, ids, weights, plan, ids_host, on_host, wait)
    order, experts, starts, counts, rows = group_by_expert(ids_host if ids_host is not None else ops.to_host(ids))
    index = ops.upload(np.concatenate([(order // A).astype(np.int32), rows]))   # token of each sorted row | rows
    I = gate.rows
    fused = lay.contiguous_gate_up
    f16 = tc and ops.gemm_x16               # the GEMMs read xs and h as f16 (no per-expert fallback then)
    xs, h, gu, g, u, y, _ = _expert_rows(ops, x, index.ptr, S, I, fused, f16)
    h_size = h.dtype.itemsize
    gate_in, up_in, ld = _swiglu_in(gu, g, u, I)
    table = GroupTable(ops, min(ops.args.num_experts, S), S) if tc else None
    where = {e: (s0, c) for e, s0, c in zip(experts.tolist(), starts.tolist(), counts.tolist())}
    for batch, blobs in plan.batches(lay.layer, [e for e in where if e not in on_host]):
        if not batch:                           # every expert of the layer on the host
            continue
        r0 = where[batch[0]][0]
        r1 = where[batch[-1]][0] + where[batch[-1]][1]
        if tc:
            n = table.fill(blobs, [(i, *where[e]) for i, e in enumerate(batch)])
            _gate_up_tc(ops, table.t.ptr, table.tiles_ptr, n, lay, xs, gu, g, u)
        else:
            for e, blob in zip(batch, blobs):
                s0, c = where[e]
                if fused:
                    ops._gemm_weight(_at(blob, gate, 2 * I), xs.ptr + s0 * D * 4, gu.ptr + s0 * 2 * I * 4, c, 2 * I)
                else:
                    ops._gemm_weight(_at(blob, gate), xs.ptr + s0 * D * 4, g.ptr + s0 * I * 4, c, I)
                    ops._gemm_weight(_at(blob, up), xs.ptr + s0 * D * 4, u.ptr + s0 * I * 4, c, I)
        _swiglu(ops, gate_in + r0 * ld * 4, up_in + r0 * ld * 4, h.ptr + r0 * I * h_size, r1 - r0, I, ld, f16)
        if tc:
            grouped_gemm(ops, table.t.ptr, table.tiles_ptr, n, down, h.ptr, I, y.ptr, D, D)
        else:
            for e, blob in zip(batch, blobs):
                s0, c = where[e]
                ops._gemm_weight(_at(blob, down), h.ptr + s0 * I * 4, y.ptr + s0 * D * 4, c, D)
    if wait is None:
        return _combine(ops, y, index.ptr + S * 4, weights, T, A, D)
    _zero_rows(ops, y, ids_host, on_host)
    return _combine(ops, y, index.ptr + S * 4, weights, T, A, D, wait())


# tma-gemm: a layer's experts are dequantized to f16 rows once per chunk where the chunk gives them
# DQ_MIN_ROWS rows each on average, and a dense projection where the chunk has DQ_MIN_ROWS tokens. On an
# H100 (thirty-first session, docs/PERF.md) a layer's gate|up of the 30B (128 experts, Q4_K) dequantizes
# in 0.43 ms and its down in 0.21 ms, 5.0 us an expert, and the TMA f16 GEMM runs at 355-390 TFLOP/s
# against the decoding mma.sync GEMM's 141-159: a row saves 9.4 MFLOP x (1/159 - 1/370) TFLOP/s = 34 ns,
# so the dequantization pays from about 150 rows an expert; below, a chunk loses little (a GEMM that
# little, and the threshold an average over the layer's experts).
DQ_MIN_ROWS = 128
# The f16 weights of one group of a batch's experts, at most (the 30B: 54 experts of 9.4 MB; a batch of
# more experts is dequantized and multiplied group by group, so the scratch stays this size).
DQ_SCRATCH_BYTES = 512 << 20
DQ_MIN_GROUP = 4        # fewer experts a group than this where the pool is short: the decoding GEMMs instead
DQ_SPARE_BYTES = 1 << 20    # free in the pool after the scratch, or no scratch (the blocks taken while it is held)


def dq_rows_enough(S: int, E: int) -> bool:
    """Whether a chunk's S routed rows give a layer's E experts rows enough for tma-gemm (DQ_MIN_ROWS each
    on average); the prompt cost model prices chunks by the same rule."""
    return S >= DQ_MIN_ROWS * E


def dq_experts(ops, lay: ExpertLayer, S: int, E: int) -> bool:
    """Whether this chunk's expert GEMMs may take the dequantize-then-f16 path (tma-gemm):
    gate|up contiguous, block types, dq_rows_enough."""
    parts = [lay.parts[n] for n in ("gate", "up", "down")]
    return (ops.gemm_dq and lay.contiguous_gate_up and dq_rows_enough(S, E)
            and all(p.qtype in DQ_GROUP_QTYPES for p in parts))


class DqScratch:
    """tma-gemm's scratch for one chunk's layer: the f16 gate|up and down of `group` experts, and the
    small tables their launches read (blob addresses, and each expert's f16 rows, 0 outside the group).
    All of it is taken where the pool has room (a reserved pool is sized for the decoding path, which
    the memory plan prices), with DQ_SPARE_BYTES still free after it for the chunk's small blocks that
    follow while it is held."""

    def __init__(self, gu16: DeviceTensor, d16: DeviceTensor, src: DeviceTensor, table: DeviceTensor):
        self.gu16, self.d16, self.src, self.table = gu16, d16, src, table
        self.group = gu16.shape[0]

    @classmethod
    def take(cls, ops, lay: ExpertLayer, E: int) -> "DqScratch | None":
        """The largest group (up to E experts, DQ_SCRATCH_BYTES) the pool has room for, down to
        DQ_MIN_GROUP; None where it has none (the decoding GEMMs then)."""
        gate = lay.parts["gate"]
        I, D = gate.rows, gate.shape[-1]
        gu_halves, d_halves = 2 * I * D, D * I
        group = max(1, min(E, DQ_SCRATCH_BYTES // (2 * (gu_halves + d_halves))))
        while True:
            parts = [ops.try_alloc(shape, dtype) for shape, dtype in (
                ((2 * E,), np.uint64), ((group,), np.uint64), ((group, gu_halves), np.float16),
                ((group, d_halves), np.float16), ((DQ_SPARE_BYTES,), np.uint8))]
            if all(p is not None for p in parts):
                table, src, gu16, d16, _ = parts     # the spare goes back at once
                return cls(gu16, d16, src, table)
            del parts
            if group <= min(DQ_MIN_GROUP, E):
                return None
            group = max(group // 2, min(DQ_MIN_GROUP, E))


def _moe_dq_batch(ops, lay: ExpertLayer, scratch: DqScratch, batch: list, blobs: list, tiles: int, n: int, E: int,
                  xs, gu, h, y, starts: int, gate_in: int, up_in: int, ld: int) -> None:
    """A batch's experts (ids `batch`, blob addresses `blobs`) through the f16 path: group by group of
    scratch.group, each group's gate|up and down dequantized into the scratch (one strata_dequant_h_groups
    launch a matrix over the group's blob addresses), then gate|up, SwiGLU and down over every tile, with
    an address table that names only the group's experts (the other tiles are skipped)."""
    gate, down = lay.parts["gate"], lay.parts["down"]
    I, D = gate.rows, gate.shape[-1]
    gu_halves, d_halves = 2 * I * D, D * I
    gu16, d16, group = scratch.gu16, scratch.d16, scratch.group
    w_gu, w_down = Weight(0, "F16", (2 * I, D)), Weight(0, "F16", (D, I))
    addrs = np.zeros(2 * E, np.uint64)
    for i0 in range(0, len(batch), group):
        experts = batch[i0:i0 + group]
        slots = np.arange(len(experts), dtype=np.uint64)
        # the stream orders each refill after the launches that read the last one
        scratch.src.buf.copy_from_host(np.asarray(blobs[i0:i0 + group], np.uint64), ops.stream, scratch.src.offset)
        for part, halves, out in ((gate, gu_halves, gu16), (down, d_halves, d16)):
            bs = qtype_of(part.qtype).block_size
            grid = (dequant_grid(bs, halves, ops.num_sms, per_sm=4), len(experts))     # x blocks a group
            n_blocks = halves // bs
            ops.launch("dequant_h_groups", grid, (scratch.src.ptr, part.ptr, n_blocks, out.ptr, halves),
                       qtype=part.qtype)
        addrs[:] = 0            # expert -> its f16 rows (gate|up, then down), 0 outside the group
        addrs[experts] = np.uint64(gu16.ptr) + slots * np.uint64(2 * gu_halves)
        addrs[E + np.asarray(experts)] = np.uint64(d16.ptr) + slots * np.uint64(2 * d_halves)
        scratch.table.buf.copy_from_host(addrs, ops.stream, scratch.table.offset)
        ops.bytes_h2d += 8 * (len(experts) + 2 * E)
        table = scratch.table.ptr
        grouped_gemm(ops, table, tiles, n, w_gu, xs.ptr, D, gu.ptr, 2 * I, 2 * I,
                     tma=(gu16.ptr, group * 2 * I, xs.shape[0]), x16=True)
        _swiglu_rows(ops, gate_in, up_in, h.ptr, starts, experts[0], experts[-1] + 1, I, ld, True)
        grouped_gemm(ops, table + 8 * E, tiles, n, w_down, h.ptr, I, y.ptr, D, D, tma=(d16.ptr, group * D, h.shape[0]),
                     x16=True)


def _moe_grouped_on_device(ops, x: DeviceTensor, lay: ExpertLayer, ids: DeviceTensor,
                           weights: DeviceTensor, plan: MoePlan, ids_host: np.ndarray | None = None,
                           on_host=(), wait=None) -> DeviceTensor:
    """moe_grouped with the routing grouped on the device (nothing read back), for a layer whose
    every expert the store hands out without the routing: all resident (one batch, the layer's
    table row as the addresses), or a chunk that streams every non-cached expert (the store's
    batches in expert order; each batch's launches see an address table with zeros for the other
    experts, whose tiles moe_gemm skips, and SwiGLU takes the batch's rows from the device). Where
    tma-gemm takes the chunk (dq_experts) and its scratch is had, every batch goes through the f16 path.
    on_host: experts the host computes (never in a batch: address 0, skipped), wait() the device
    address of their sum, added by the combine (ids_host: the routing, read back for them)."""
    T, D = x.shape
    S, E = ids.size, ops.args.num_experts
    index, tiles, n = group_on_device(ops, ids, E)
    starts = index.ptr + 8 * S
    I = lay.parts["gate"].rows
    take = (lambda: DqScratch.take(ops, lay, E)) if dq_experts(ops, lay, S, E) else None
    xs, h, gu, g, u, y, scratch = _expert_rows(ops, x, index.ptr, S, I, lay.contiguous_gate_up, ops.gemm_x16, take)
    gate_in, up_in, ld = _swiglu_in(gu, g, u, I)
    table = ops.alloc((E,), np.uint64)          # the batch's blob addresses, 0 for the other experts
    addrs = np.zeros(E, np.uint64)
    for batch, blobs in plan.batches(lay.layer, [e for e in range(E) if e not in on_host]):
        if not batch:                           # every expert of the layer on the host
            continue
        if scratch is not None:     # the batch's weights as f16 rows first, then the GEMMs over them
            _moe_dq_batch(ops, lay, scratch, batch, blobs, tiles.ptr, n, E, xs, gu, h, y, starts, gate_in, up_in, ld)
            continue
        if plan.resident:                       # one batch: the layer's row of the expert table
            ops.rt.copy_d2d(table.ptr, lay.table, 8 * E, ops.stream)
        else:
            addrs[:] = 0
            addrs[batch] = blobs
            table.buf.copy_from_host(addrs, ops.stream, table.offset)    # ordered after the last batch's launches
            ops.bytes_h2d += addrs.nbytes
        _gate_up_tc(ops, table.ptr, tiles.ptr, n, lay, xs, gu, g, u)
        _swiglu_rows(ops, gate_in, up_in, h.ptr, starts, batch[0], batch[-1] + 1, I, ld, ops.gemm_x16)
        grouped_gemm(ops, table.ptr, tiles.ptr, n, lay.parts["down"], h.ptr, I, y.ptr, D, D)
    del scratch             # back to the pool before the combine takes its output
    if wait is None:
        return _combine(ops, y, index.ptr + S * 4, weights, T, ids.shape[1], D)
    _zero_rows(ops, y, ids_host, on_host)
    return _combine(ops, y, index.ptr + S * 4, weights, T, ids.shape[1], D, wait())


def _swiglu_rows(ops, gate: int, up: int, out: int, starts: int, lo: int, hi: int, I: int, ld: int,
                 f16: bool = False) -> None:
    """SwiGLU over the sorted rows of experts lo..hi-1, whose bounds only the device knows (f16: out as f16)."""
    ops.launch("swiglu_rows_f16" if f16 else "swiglu_rows", (-(-I // 256), 2 * ops.num_sms),
               (gate, up, out, starts, lo, hi, I, ld, ld, I))
