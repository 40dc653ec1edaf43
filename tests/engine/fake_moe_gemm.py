"""numpy emulation of strata_moe_gemm_<q> (cuda/moe_gemm.cu) on fake_cuda's memory, for the GPU
engine's host tests. To wire it in fake_cuda (the signature comes from kernels.KERNELS):
"moe_gemm" among Kernel.run's per-quant-type prefixes, and _EMULATE["moe_gemm"] = emulate_moe_gemm.

It checks what the real launch needs (grid, tile fields, alignment, K) and computes like the kernel:
f16-rounded X and weights, float32 products and sums (numpy's order, not the tensor cores', so
results agree to the kernel's stated bound, not bit for bit).
"""
from __future__ import annotations

import numpy as np

from strata.quant import qtype
from tests.engine.fake_cuda import _aligned, _weights, view

BM, BN = 128, 128   # cuda/moe_gemm.cu kBM, kBN (strata.backends.cuda.moe_gemm mirrors them)


def emulate_moe_gemm_ws(q, grid, ptrs, part_offset, tiles, X, ldx, Y, ldy, N, K, n_tiles, x_dtype=np.float32):
    """strata_moe_gemm_ws_<q> (cuda/moe_gemm_ws.cu; ws16: X as f16): moe_gemm's products, persistent
    blocks over the ceil(N / BN) x n_tiles work items, the tile count as its last argument."""
    assert grid[1] == grid[2] == 1 and 1 <= grid[0] <= max(1, -(-N // BN) * n_tiles), f"moe_gemm_ws: grid {grid}"
    emulate_moe_gemm(q, (-(-N // BN), n_tiles, 1), ptrs, part_offset, tiles, X, ldx, Y, ldy, N, K, x_dtype)


def emulate_moe_gemm_ws16(*args):
    emulate_moe_gemm_ws(*args, x_dtype=np.float16)


def emulate_moe_gemm_wst(q, grid, ptrs, part_offset, tiles, X, ldx, Y, ldy, N, K, n_tiles, w_base, tx, tw):
    """strata_moe_gemm_wst_f16: moe_gemm_ws16's products with X and the weights read through its tensor
    maps (rows past a map's end as zeros), so a map over the wrong block, rows or stride shows: each
    group's first row is (ptrs[g] + part_offset - w_base) / 2K of tw's rows."""
    from tests.engine.fake_cuda import _TENSOR_MAP_2D
    assert q == "F16" and grid[1] == grid[2] == 1 and 1 <= grid[0] <= max(1, -(-N // BN) * n_tiles)
    (xa, xk, x_rows, x_stride, *xbox), (wa, wk, w_rows, w_stride, *wbox) = (
        _TENSOR_MAP_2D.unpack(m[:_TENSOR_MAP_2D.size]) for m in (tx, tw))
    assert xk == wk == K and xbox == wbox == [64, BM] and wa == w_base and w_stride == 2 * K, "a map of another shape"
    table = view(tiles, 4 * n_tiles, np.int32).reshape(n_tiles, 4)
    groups = int(table[:, 0].max()) + 1 if n_tiles else 0
    addrs = view(ptrs, groups, np.uint64) if groups else np.zeros(0, np.uint64)

    def rows(address, stride, count, first, n):     # rows first .. first + n - 1 of a map, zeros past its end
        out = np.zeros((n, K), np.float32)
        for i in range(max(0, min(n, count - first))):
            out[i] = view(address + (first + i) * stride, K, np.float16)
        return out
    for g, s0, m, _ in table.tolist():
        if m == 0 or int(addrs[g]) == 0:
            continue
        offset = int(addrs[g]) + part_offset - w_base
        assert offset >= 0 and offset % (2 * K) == 0, f"moe_gemm_wst: group {g} is not on a row of the weights' map"
        w = rows(wa, w_stride, w_rows, offset // (2 * K), N)
        x = rows(xa, x_stride, x_rows, s0, m)
        for i in range(m):
            view(Y + (s0 + i) * ldy * 4, N)[:] = w @ x[i]


def emulate_moe_gemm(q, grid, ptrs, part_offset, tiles, X, ldx, Y, ldy, N, K, x_dtype=np.float32):
    n_tiles = grid[1]
    assert grid[0] * BN >= N > 0, f"moe_gemm: grid {grid} does not cover N {N} in tiles of {BN}"
    assert K > 0 and K % max(qtype(q).block_size, 8) == 0, f"moe_gemm: K {K} for {q}"
    assert X % 16 == 0 and ldx % 4 == 0 and Y % 4 == 0, f"moe_gemm: X 0x{X:x} ldx {ldx} Y 0x{Y:x}"
    _aligned("moe_gemm tiles", tiles, ptrs)
    table = view(tiles, 4 * n_tiles, np.int32).reshape(n_tiles, 4)
    groups = int(table[:, 0].max()) + 1 if n_tiles else 0
    addrs = view(ptrs, groups, np.uint64) if groups else np.zeros(0, np.uint64)
    cache: dict[int, np.ndarray] = {}
    for g, s0, m, _ in table.tolist():
        assert 0 <= m <= BM and s0 >= 0 and g >= 0, f"moe_gemm: tile {(g, s0, m)}"
        if m == 0 or int(addrs[g]) == 0:              # an empty tile, or an expert outside the batch: skipped
            continue
        if g not in cache:
            w = int(addrs[g]) + part_offset
            _aligned("moe_gemm", w)
            cache[g] = _weights(q, w, N, K).astype(np.float16).astype(np.float32)
        for i in range(m):
            x = view(X + (s0 + i) * ldx * np.dtype(x_dtype).itemsize, K, x_dtype).astype(np.float16).astype(np.float32)
            view(Y + (s0 + i) * ldy * 4, N)[:] = cache[g] @ x
