"""numpy ops whose every row computes exactly what a one-row call computes: the CPU's decode steps
and verify windows.

A BLAS matmul of T rows does not promise the bits of T one-row matmuls (blocking and threading
change the order of each dot product), and numpy's reductions over a [T, n] array may reorder
small inner sums. RowOps therefore splits every op whose arithmetic could mix rows (projections,
norms, RoPE, attention, routing, experts) into calls on [1, ...] slices of the same C-contiguous
array, each the call a one-row step makes. A verify window of N + 1 rows is thus N + 1 one-row
steps' arithmetic, so greedy decoding with speculation emits the tokens of greedy decoding without
(tests/engine/test_speculate.py checks both properties bitwise). One-row calls go straight to
CpuOps, so a plain decode step is unchanged. The prompt path keeps the batched CpuOps.
"""
from __future__ import annotations

import numpy as np

from .cpu import CpuOps, KVCache, causal_attention


class RowOps(CpuOps):
    """CpuOps over the same weights and dequantization cache, computed row by row."""

    def __init__(self, base: CpuOps):
        self.__dict__.update(base.__dict__)     # pack, args, the shared DequantCache, the RoPE tables

    def _rows(self, op, x: np.ndarray, *rest):
        if x.shape[0] == 1:
            return op(self, x, *rest)
        return np.concatenate([op(self, x[i:i + 1], *rest) for i in range(x.shape[0])])

    def linear(self, x, name):
        return self._rows(CpuOps.linear, x, name)

    def rms_norm(self, x, name, eps):
        return self._rows(CpuOps.rms_norm, x, name, eps)

    def rope(self, x, positions):
        if x.shape[0] == 1:
            return CpuOps.rope(self, x, positions)
        return np.concatenate([CpuOps.rope(self, x[i:i + 1], positions[i:i + 1]) for i in range(x.shape[0])])

    def attention(self, q, k, v, layer: int, kv: KVCache, positions: np.ndarray) -> np.ndarray:
        """Every row's K/V is written first; row i then attends over exactly cells 0..positions[i],
        as the one-row step at that position does (cells past it are never read)."""
        if q.shape[0] == 1:
            return CpuOps.attention(self, q, k, v, layer, kv, positions)
        kv.write(layer, positions, k, v)
        out = []
        for i, p in enumerate(positions.tolist()):
            keys, values = kv.read(layer, p + 1)
            out.append(causal_attention(q[i:i + 1], keys, values, positions[i:i + 1]))
        return np.concatenate(out)

    def moe_route(self, router_logits, top_k, norm_topk):
        if router_logits.shape[0] == 1:
            return CpuOps.moe_route(router_logits, top_k, norm_topk)
        parts = [CpuOps.moe_route(router_logits[i:i + 1], top_k, norm_topk) for i in range(router_logits.shape[0])]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def moe(self, x, layer, expert_ids, expert_weights, plan=None):
        if x.shape[0] == 1:
            return CpuOps.moe(self, x, layer, expert_ids, expert_weights)
        return np.concatenate([CpuOps.moe(self, x[i:i + 1], layer, expert_ids[i:i + 1], expert_weights[i:i + 1])
                               for i in range(x.shape[0])])
