"""numpy emulations of cuda/moe_decode.cu for tests/engine/fake_cuda.py (the fake runtime).

From the kernels' contract, in float32 numpy: they check what a real launch needs (grid = (gx, T, 1)
with gx >= 1, the matrix starts' alignment) and fail loudly on a bad pointer, a short table or an
expert id outside it, as fake_cuda's view() does. Wiring, in fake_cuda.py:

    Kernel.run prefixes: "moe_gate_up" -> emulate_moe_gate_up, "moe_gate_up_route" ->
    emulate_moe_gate_up_route, "moe_down" -> emulate_moe_down
"""
from __future__ import annotations

import numpy as np

from strata.backends.cpu import moe_route, swiglu
from strata.quant import qtype
from tests.engine import fake_cuda


def _blob(ptrs: int, e: int) -> int:
    return int(fake_cuda.view(ptrs + 8 * e, 1, np.uint64)[0])


def _check_grid(op: str, grid: tuple, A: int) -> int:
    assert grid[0] >= 1 and grid[1] >= 1 and grid[2] == 1, f"fake_cuda: {op} grid {grid} must be (gx, T, 1)"
    assert 1 <= A <= 8, f"fake_cuda: {op} takes 1 <= A <= 8, got {A}"
    return grid[1]


def _check_start(op: str, q: str, ptr: int, fused_after: int | None = None) -> None:
    """A matrix starts 16-byte aligned, or right after the gate matrix (fused gate|up)."""
    assert ptr % 16 == 0 or ptr == fused_after, f"fake_cuda: {op} {q} matrix at 0x{ptr:x} is not 16-byte aligned"


def emulate_moe_gate_up(q, grid, ptrs, gate_off, up_off, ids, x, h, A, I, D):
    """h [T * A, I] = silu(gate_e @ x[t]) * (up_e @ x[t]), e = ids[t * A + a]."""
    T = _check_grid("moe_gate_up", grid, A)
    fake_cuda._aligned("moe_gate_up", x)
    row_bytes = qtype(q).row_bytes(D)
    expert = fake_cuda.view(ids, T * A, np.int32).copy()
    xs = fake_cuda.view(x, T * D).reshape(T, D)
    out = fake_cuda.view(h, T * A * I).reshape(T * A, I)
    for s, e in enumerate(expert):
        blob = _blob(ptrs, int(e))
        _check_start("moe_gate_up", q, blob + gate_off)
        _check_start("moe_gate_up", q, blob + up_off, blob + gate_off + I * row_bytes)
        gate = fake_cuda._weights(q, blob + gate_off, I, D) @ xs[s // A]
        up = fake_cuda._weights(q, blob + up_off, I, D) @ xs[s // A]
        out[s] = swiglu(gate, up)


def emulate_moe_gate_up_route(q, grid, ptrs, gate_off, up_off, ids, x, h, A, I, D, logits, weights, E, norm):
    """strata_moe_gate_up_route_<q>: each token's top-A of logits [T, E] as strata_moe_route_f32 picks them
    (the numpy reference's) into ids and weights [T, A], then emulate_moe_gate_up over them."""
    T = _check_grid("moe_gate_up_route", grid, A)
    assert 1 <= A <= E <= 512, f"fake_cuda: moe_gate_up_route takes A <= E <= 512, got {A}, {E}"
    picks, w = moe_route(fake_cuda.view(logits, T * E).reshape(T, E), A, bool(norm))
    fake_cuda.view(ids, T * A, np.int32)[:] = picks.reshape(-1)
    fake_cuda.view(weights, T * A)[:] = w.reshape(-1)
    emulate_moe_gate_up(q, grid, ptrs, gate_off, up_off, ids, x, h, A, I, D)


def emulate_moe_down(q, grid, ptrs, down_off, ids, h, weights, out, A, D, I):
    """out [T, D] = sum over a in order of weights[s] * (down_e @ h[s]), s = t * A + a."""
    T = _check_grid("moe_down", grid, A)
    fake_cuda._aligned("moe_down", h)
    expert = fake_cuda.view(ids, T * A, np.int32).copy()
    hs = fake_cuda.view(h, T * A * I).reshape(T * A, I)
    w = fake_cuda.view(weights, T * A)
    result = np.zeros((T, D), np.float32)
    for s, e in enumerate(expert):
        blob = _blob(ptrs, int(e))
        _check_start("moe_down", q, blob + down_off)
        result[s // A] += w[s] * (fake_cuda._weights(q, blob + down_off, D, I) @ hs[s])
    fake_cuda.view(out, T * D).reshape(T, D)[:] = result
