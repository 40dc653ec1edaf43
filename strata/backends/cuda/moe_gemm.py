"""Host side of cuda/moe_gemm.cu: tile tables, launch shape and a numpy-in/out wrapper for tests.

strata_moe_gemm_<q> computes, in one launch, every group's rows of Y = f16(X) f16(W_g)^T; a tile is
at most BM consecutive rows of one group. The engine builds the tile table once per step (tiles_for)
and launches once per weight matrix per layer with grid (ceil(N / BN), n_tiles) and BLOCK threads.
"""

from __future__ import annotations

import numpy as np

import strata.backends.cuda as _cuda     # _runtime() looked up per call, as tests patch it there
from strata.errors import InvalidArgument
from strata.quant import QTYPES, qtype

from .kernels import KERNELS

BM = 128                # token rows per tile (cuda/moe_gemm.cu kBM; a tile of fewer rows skips the idle warps' mma)
BN = 128                # weight rows per CTA (kBN)
BLOCK = KERNELS["moe_gemm"].block   # threads per CTA (kThreads)
SHARED_BYTES = 40960    # static shared memory per CTA; under 48 KiB, so no opt-in, none dynamic
SIGNATURE = KERNELS["moe_gemm"].signature  # ptrs, part_offset, tiles, X, ldx, Y, ldy, N, K
QTYPE_NAMES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
               "Q6_K", "IQ4_NL", "IQ4_XS")


def kernel_name(qtype_name: str) -> str:
    name = qtype(qtype_name).name
    if name not in QTYPE_NAMES:
        raise InvalidArgument(f"moe_gemm: no kernel for weight type {name}")
    return KERNELS["moe_gemm"].name(qtype=name)


def check_k(qtype_name: str, K: int) -> None:
    """K must fill whole blocks, and whole 8-weight loads for the float types."""
    bs = qtype(qtype_name).block_size
    if K <= 0 or K % max(bs, 8):
        raise InvalidArgument(f"moe_gemm: K {K} must be a positive multiple of {max(bs, 8)} for {qtype_name}")


def tiles_for(groups) -> np.ndarray:
    """[n_tiles, 4] int32 (group, s0, rows, 0) cutting each (group, s0, rows) range into BM-row tiles.
    Ranges of 0 rows give no tile."""
    r = np.asarray(groups, np.int64).reshape(-1, 3)
    if (r < 0).any():
        raise InvalidArgument(f"tiles_for: range {tuple(r[(r < 0).any(axis=1)][0])} has a negative field")
    per = -(-r[:, 2] // BM)                                   # tiles of each range
    which = np.repeat(np.arange(len(r)), per)
    k = np.arange(which.size) - np.repeat(np.cumsum(per) - per, per)   # tile index inside its range
    s = r[which, 1] + k * BM
    out = np.stack([r[which, 0], s, np.minimum(BM, r[which, 1] + r[which, 2] - s), np.zeros_like(s)], axis=1)
    return out.astype(np.int32).reshape(-1, 4)


def grid_for(N: int, n_tiles: int) -> tuple[int, int]:
    return -(-N // BN), n_tiles


# cuda/moe_gemm_ws.cu: the same products, warp-specialized and persistent on Hopper's wgmma (sm_90a).
WS_BLOCK = 512              # two consumer warpgroups and two producer ones (kThreads)
WS_SHARED_BYTES = 4 * 32768 + 64    # four 32 KB stages and their eight mbarriers (kSmemBytes): an opt-in size


WS_OPS = ("moe_gemm_ws", "moe_gemm_ws16")     # its two entry families (X as f32, as f16)
# Its TMA build over f16 weights and f16 X (strata_moe_gemm_wst_f16, the dq path's): the same ring in a block
# rounded up to the 128-byte swizzle's 1024-byte atom, and two tensor maps of boxes of 64 halves x TMA_ROWS rows.
WST_SHARED_BYTES = WS_SHARED_BYTES + 1024
TMA_ROWS = 128


def wst_maps(rt, x: int, x_rows: int, ldx: int, w_base: int, w_rows: int, K: int) -> tuple[bytes, bytes]:
    """strata_moe_gemm_wst_f16's tensor maps (its "B" parameters): X's f16 rows [x_rows, K], ldx halves
    apart, and the weights' f16 rows [w_rows, K] from w_base (every group's matrix among them); rows
    past either end read as zeros."""
    return (rt.tensor_map_f16(x, (K, x_rows), (2 * ldx,), (64, TMA_ROWS)),
            rt.tensor_map_f16(w_base, (K, w_rows), (2 * K,), (64, TMA_ROWS)))


def wst_launch_for(rt, N: int, n_tiles: int, num_sms: int, X: int, x_rows: int, ldx: int, w_base: int, w_rows: int,
                   K: int) -> tuple:
    """launch_for of strata_moe_gemm_wst_f16: (grid, the arguments after the contract's nine (the tile
    count, w_base, wst_maps' two maps), dynamic shared bytes)."""
    return (ws_grid(N, n_tiles, num_sms), (n_tiles, w_base, *wst_maps(rt, X, x_rows, ldx, w_base, w_rows, K)),
            WST_SHARED_BYTES)


def wst_takes(X: int, ldx: int, w_base: int, K: int) -> bool:
    """Whether the TMA can read these operands: 16-byte aligned starts and row strides."""
    return X % 16 == 0 and w_base % 16 == 0 and ldx % 8 == 0 and K % 8 == 0


def ws_grid(N: int, n_tiles: int, num_sms: int) -> int:
    """Blocks of a strata_moe_gemm_ws launch: one a multiprocessor, fewer when there are fewer work
    items (ceil(N / BN) x n_tiles); each block strides over the items."""
    return max(1, min(-(-N // BN) * n_tiles, num_sms))


def launch_for(op: str, N: int, n_tiles: int, num_sms: int) -> tuple:
    """(grid, arguments after the contract's nine, dynamic shared bytes) of a launch of kernel op
    (moe_gemm, or one of WS_OPS: persistent blocks, the tile count last, an opt-in shared size)."""
    if op in WS_OPS:
        return ws_grid(N, n_tiles, num_sms), (n_tiles,), WS_SHARED_BYTES
    return grid_for(N, n_tiles), (), 0


def moe_gemm(qtype_name: str, weights, ranges, X: np.ndarray, *, ops=None, offsets=None, part_offset: int = 0,
             tiles: np.ndarray | None = None, op: str = "moe_gemm") -> np.ndarray:
    """Y [S, N] float32 with Y[s] = f16(X[s]) @ f16(W_g)^T for s in each range (g, s0, rows); rows
    outside every range stay NaN (the output is poisoned). weights[g]: raw bytes of an [N, K] matrix,
    or None for a group at address 0, which the kernel skips (its rows stay NaN).

    offsets[g] (a multiple of 16) places group g's bytes that far into its own device buffer, so
    tests can move a weight to another address; part_offset (a multiple of 16) is passed to the
    kernel, with ptrs[g] that much before the bytes; tiles overrides tiles_for(ranges). ops: a CudaOps
    whose device and stream are used (one is made if None). op: the table's "moe_gemm", or
    "moe_gemm_ws" (cuda/moe_gemm_ws.cu: the same products on wgmma, sm_90 only), or "moe_gemm_ws16" (its
    entry points taking X as f16: X is rounded to f16 here, as the kernels round it), or "moe_gemm_wst"
    (its TMA build: F16 weights, X as f16; the groups' matrices then lie in one block, a row apart, which
    the weights' tensor map covers, and offsets are ignored)."""
    from strata.backends.cuda.testing import CudaOps

    if op not in ("moe_gemm", "moe_gemm_wst", *WS_OPS):
        raise InvalidArgument(f"moe_gemm: op {op!r} is not moe_gemm, moe_gemm_wst, {' or '.join(WS_OPS)}")
    if op == "moe_gemm_wst" and qtype(qtype_name).name != "F16":
        raise InvalidArgument(f"moe_gemm: moe_gemm_wst takes F16 weights, not {qtype_name}")
    ops = ops or CudaOps()
    rt = _cuda._runtime()
    X = np.ascontiguousarray(X, np.float32)
    if X.ndim != 2:
        raise InvalidArgument(f"moe_gemm: X {X.shape} must be [S, K]")
    S, K = X.shape
    check_k(qtype_name, K)
    row_bytes = qtype(qtype_name).row_bytes(K)
    sizes = {int(np.asarray(w).nbytes) for w in weights if w is not None}
    if len(sizes) != 1 or next(iter(sizes)) % row_bytes:
        raise InvalidArgument(f"moe_gemm: every weight must hold the same whole number of {row_bytes}-byte rows")
    N = next(iter(sizes)) // row_bytes
    tiles = tiles_for(ranges) if tiles is None else np.ascontiguousarray(tiles, np.int32)
    offsets = offsets or [0] * len(weights)
    bufs, ptrs = [], []
    if op == "moe_gemm_wst":    # one block: group g's rows after g + 1 rows of gap (a row of garbage between)
        block = np.full(len(weights) * (N + 1) * row_bytes, 0x7b, np.uint8)
        for g, w in enumerate(weights):
            if w is not None:
                start = (g * (N + 1) + 1) * row_bytes
                block[start:start + N * row_bytes] = np.ascontiguousarray(w).view(np.uint8).reshape(-1)
        w_buf = rt.DeviceBuffer(ops.device, block.size)
        w_buf.copy_from_host(block, ops.stream)
        bufs.append(w_buf)
        ptrs = [0 if w is None else w_buf.ptr + (g * (N + 1) + 1) * row_bytes - part_offset
                for g, w in enumerate(weights)]
        weights = []
    for w, off in zip(weights, offsets):
        if w is None:
            ptrs.append(0)
            continue
        data = np.ascontiguousarray(w).view(np.uint8).reshape(-1)
        buf = rt.DeviceBuffer(ops.device, off + part_offset + data.size)
        buf.copy_from_host(data, ops.stream, offset=off + part_offset)
        bufs.append(buf)
        ptrs.append(buf.ptr + off)
    Y = np.empty((S, N), np.float32)
    if len(tiles) == 0 or N == 0:
        Y.fill(np.nan)
        return Y
    y_dev = ops._output(Y.nbytes)
    x_dev = ops._upload(X.astype(np.float16) if op in ("moe_gemm_ws16", "moe_gemm_wst") else X)
    args = (ops._upload(np.array(ptrs, np.uint64)), part_offset, ops._upload(tiles), x_dev, K, y_dev, N, N, K)
    num_sms = ops.device.multiprocessor_count
    if op == "moe_gemm_wst":
        grid, tail, shared = wst_launch_for(rt, N, len(tiles), num_sms, x_dev.ptr, S, K, w_buf.ptr,
                                            len(block) // row_bytes, K)
        ops._launch(op, grid, (*args, *tail), shared)
    else:
        grid, tail, shared = launch_for(op, N, len(tiles), num_sms)
        ops._launch(op, grid, (*args, *tail), shared, qtype=qtype_name)
    Y = ops._download(y_dev, Y.shape, np.float32)
    del bufs    # freed only after the download's synchronize
    return Y


assert set(QTYPE_NAMES) <= set(QTYPES)
