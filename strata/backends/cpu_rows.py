"""numpy ops whose every row computes exactly what a one-row call computes: the CPU's decode steps
and verify windows.

A BLAS matmul of T rows does not promise the bits of T one-row matmuls (blocking and threading
change the order of each dot product), and numpy's reductions over a [T, n] array may reorder
small inner sums. RowOps therefore splits every op whose arithmetic could mix rows (projections,
norms, RoPE, attention, routing, experts) into calls on [1, ...] slices of the same C-contiguous
array, each the call a one-row step makes. A verify window of N + 1 rows is thus N + 1 one-row
steps' arithmetic, so greedy decoding with speculation emits the tokens of greedy decoding without
(tests/engine/test_speculate.py checks both properties bitwise). One-row calls go straight to the
base ops, so a plain decode step is unchanged. The prompt path keeps the batched ops.

RowOps(base) is an instance of a subclass of base's own class (CpuOps, or a test's subclass of it
such as the f16-KV oracle's), so each row runs the base class's methods, overrides included.
"""
from __future__ import annotations

import numpy as np

from .cpu import CpuOps, KVCache


class _Rows:
    """The row-by-row methods, mixed in before the base ops' class (RowOps)."""

    def _rows(self, op, x: np.ndarray, *rest):
        if x.shape[0] == 1:
            return op(x, *rest)
        return np.concatenate([op(x[i:i + 1], *rest) for i in range(x.shape[0])])

    def linear(self, x, name):
        return self._rows(super().linear, x, name)

    def rms_norm(self, x, name, eps):
        return self._rows(super().rms_norm, x, name, eps)

    def rope(self, x, positions):
        if x.shape[0] == 1:
            return super().rope(x, positions)
        return np.concatenate([super(_Rows, self).rope(x[i:i + 1], positions[i:i + 1]) for i in range(x.shape[0])])

    def attention(self, q, k, v, layer: int, kv: KVCache, positions: np.ndarray) -> np.ndarray:
        """Row i attends over exactly cells 0..positions[i], as the one-row step at that position
        does: the rows go one by one through the base's attention (which writes the row's K/V and
        reads the cells up to it), in order, so later rows see the earlier rows' cells."""
        if q.shape[0] == 1:
            return super().attention(q, k, v, layer, kv, positions)
        return np.concatenate([super(_Rows, self).attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], layer, kv,
                                                            positions[i:i + 1]) for i in range(q.shape[0])])

    def moe_route(self, router_logits, top_k, norm_topk):
        if router_logits.shape[0] == 1:
            return super().moe_route(router_logits, top_k, norm_topk)
        parts = [super(_Rows, self).moe_route(router_logits[i:i + 1], top_k, norm_topk)
                 for i in range(router_logits.shape[0])]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def moe(self, x, layer, expert_ids, expert_weights, plan=None):
        if x.shape[0] == 1:
            return super().moe(x, layer, expert_ids, expert_weights)
        return np.concatenate([super(_Rows, self).moe(x[i:i + 1], layer, expert_ids[i:i + 1], expert_weights[i:i + 1])
                               for i in range(x.shape[0])])


_CLASSES: dict = {}


def RowOps(base: CpuOps) -> CpuOps:
    """base's ops over the same weights and dequantization cache, computed row by row."""
    cls = _CLASSES.get(type(base))
    if cls is None:
        cls = _CLASSES[type(base)] = type(f"Row{type(base).__name__}", (_Rows, type(base)),
                                          {"__doc__": f"{type(base).__name__}, row by row (strata.backends.cpu_rows)."})
    ops = cls.__new__(cls)
    ops.__dict__ = base.__dict__     # one state: pack, args, the DequantCache, RoPE tables, a test's counters
    return ops
