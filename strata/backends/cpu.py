"""numpy ops: the CPU backend and the oracle for the GPU path.

Weights stay in their native block bytes in the pack and are dequantized to float32 on use, with a
byte-bounded cache so small models dequantize once and big ones still run. Activations are float32.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..config import ModelArgs
from ..quant import kv as kv_formats
from . import rope


class DequantCache:
    """Least-recently-used float32 copies of dequantized weights, bounded in bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict = OrderedDict()

    def get(self, key, make):
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = make()
        if value.nbytes <= self.max_bytes:
            self._items[key] = value
            self.bytes += value.nbytes
            while self.bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.bytes -= old.nbytes
        return value


class KVCache:
    """Per-layer K/V of one sequence, [S, Hk, Dh] cells in a KV format's planes (strata.quant.kv: f32,
    the exact default; f16, int8, q4_0, k8v4); grows on demand up to max_len cells. read() decodes;
    a rotated codec's cells stay rotated, and query()/output() move attention into and out of that
    domain."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, fmt: str = "f32",
                 rings: dict | None = None):
        """rings: layer -> (window W, slots S): that layer (the MTP draft layer under --draft-window)
        keeps position p in cell p % S, and its attention reads the last W positions only
        (read_window); which position each cell holds is kept, so a read of one the ring no longer
        holds shows as NaN."""
        self.max_len = max_len
        self.rings = dict(rings or {})
        self.held = {layer: np.full(slots, -1, np.int64) for layer, (_, slots) in self.rings.items()}
        self.fmt = fmt
        self.codecs = kv_formats.codecs(fmt)
        for c in self.codecs:
            c.check(head_dim)
        self.shape = (num_kv_heads, head_dim)
        # per layer: [(K values, K scales), (V values, V scales)], None until written
        self.planes: list[list | None] = [None] * num_layers
        self.cells = [0] * num_layers

    def write(self, layer: int, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        need = int(positions.max()) + 1
        if need > self.max_len:
            raise IndexError(f"KV position {need - 1} is past the cache's {self.max_len} cells")
        cap = self.max_len
        if layer in self.rings:
            cap = self.rings[layer][1]
            cells = np.asarray(positions, np.int64) % cap
            if np.unique(cells).size != cells.size:
                raise IndexError(f"KV ring of layer {layer}: a batch of {cells.size} rows shares a slot of the "
                                 f"{cap}-cell ring")
            self.held[layer][cells] = positions
            positions, need = cells, int(cells.max()) + 1
        cur = self.cells[layer]
        if cur < need:
            size = cap if layer in self.rings else min(cap, max(need, 2 * cur, 64))
            grown = [c.empty((size, self.shape[0]), self.shape[1]) for c in self.codecs]
            for old, new in zip(self.planes[layer] or (), grown):
                for a, b in zip(old, new):
                    if a is not None:
                        b[:cur] = a
            self.planes[layer], self.cells[layer] = grown, size
        for (values, scales), codec, x in zip(self.planes[layer], self.codecs, (k, v)):
            qv, qs = codec.encode(x)
            values[positions] = qv
            if scales is not None:
                scales[positions] = qs

    def read(self, layer: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) float32 [length, Hk, Dh] as stored: in the rotated domain for a rotated codec."""
        return tuple(c.decode(vals[:length], None if sc is None else sc[:length])
                     for (vals, sc), c in zip(self.planes[layer], self.codecs))

    def window(self, layer: int) -> int:
        """The attention window of a ring layer, 0 for a layer that keeps the whole context."""
        return self.rings[layer][0] if layer in self.rings else 0

    def read_window(self, layer: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A ring layer's cells for rows at these positions -> (keys, values [S', Hk, Dh], their
        positions [S']): positions max(0, min - W + 1)..max, each from cell p % slots, NaN where the
        ring no longer (or not yet) holds that position."""
        window, slots = self.rings[layer]
        lo, hi = max(0, int(positions.min()) - window + 1), int(positions.max()) + 1
        key_pos = np.arange(lo, hi)
        cells = key_pos % slots
        keys, values = (c.decode(vals[cells], None if sc is None else sc[cells])
                        for (vals, sc), c in zip(self.planes[layer], self.codecs))
        stale = self.held[layer][cells] != key_pos
        keys[stale] = np.nan
        values[stale] = np.nan
        return keys, values, key_pos

    def query(self, q: np.ndarray) -> np.ndarray:
        """q [T, H, Dh] in the keys' domain (rotated when K is stored rotated)."""
        return kv_formats.rotate(q) if self.codecs[0].rotated else q

    def output(self, out: np.ndarray) -> np.ndarray:
        """Attention output [T, H * Dh] back from the values' domain (un-rotated when V is stored rotated)."""
        if not self.codecs[1].rotated:
            return out
        return kv_formats.rotate(out.reshape(out.shape[0], -1, self.shape[1])).reshape(out.shape)

    def forget(self, layer: int, start: int, stop: int) -> None:
        """Cells start..stop-1 no longer hold K/V (a rejected draft's): NaN, so a read of one shows
        (in the scales of a quantized plane, whose values are integers)."""
        if self.planes[layer] is None:
            return
        cells = slice(start, stop)
        if layer in self.rings:            # the ring's cells that still hold those positions
            slots = self.rings[layer][1]
            pos = np.arange(start, stop)
            cells = pos[self.held[layer][pos % slots] == pos] % slots
            self.held[layer][cells] = -1
        for values, scales in self.planes[layer]:
            (values if scales is None else scales)[cells] = np.nan


class CpuOps:
    """The ops interface of strata.model over numpy, reading weights from a pack."""

    name = "cpu"

    def __init__(self, pack, args: ModelArgs, cache_bytes: int = 2 << 30):
        self.pack = pack
        self.args = args
        self.cache = DequantCache(cache_bytes)
        self.inv_freq, self.rope_scale = rope.inv_freq(args.head_dim, args.rope_theta, args.rope_scaling,
                                                       args.max_position_embeddings)

    # weights ---------------------------------------------------------------------------------
    def weight(self, name: str) -> np.ndarray:
        return self.cache.get(name, lambda: self.pack.dense(name).dequantize())

    def has_weight(self, name: str) -> bool:
        return self.pack.has_dense(name)

    def expert_weights(self, layer: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        def make():
            parts = self.pack.expert(layer, e)
            return np.stack([parts["gate"].dequantize(), parts["up"].dequantize()]), parts["down"].dequantize()
        gate_up, down = self.cache.get(("expert", layer, e), lambda: _Pair(*make()))
        return gate_up[0], gate_up[1], down

    # elementwise and shape ---------------------------------------------------------------------
    @staticmethod
    def reshape(x, shape):
        return x.reshape(shape)

    @staticmethod
    def add(x, y):
        return x + y

    @staticmethod
    def concat(xs, axis=-1):
        return np.concatenate(xs, axis=axis)

    # ops -------------------------------------------------------------------------------------
    def embed(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self.weight(name)[np.asarray(ids, dtype=np.int64)]

    def rms_norm(self, x: np.ndarray, name: str, eps: float) -> np.ndarray:
        return rms_norm(x, self.weight(name), eps)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        return x @ self.weight(name).T

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        cos, sin = rope.cos_sin(positions, self.inv_freq, self.rope_scale)
        return rope.apply(x, cos, sin).astype(np.float32)

    def attention(self, q, k, v, layer: int, kv: KVCache, positions: np.ndarray) -> np.ndarray:
        kv.write(layer, positions, k, v)
        window = kv.window(layer) if hasattr(kv, "window") else 0
        if window:          # a ring layer (the draft layer under --draft-window): the last W positions
            keys, values, key_pos = kv.read_window(layer, positions)
            return kv.output(window_attention(kv.query(q), keys, values, key_pos, positions, window))
        keys, values = kv.read(layer, int(positions.max()) + 1)
        return kv.output(causal_attention(kv.query(q), keys, values, positions))

    @staticmethod
    def take_rows(x: np.ndarray, rows) -> np.ndarray:
        return x[list(rows)]

    # composites: a GPU backend fuses each into fewer launches; here the plain sequence -------------
    def add_rms_norm(self, x: np.ndarray, y: np.ndarray, name: str, eps: float):
        """A residual add and the norm after it -> (x + y, rms_norm(x + y))."""
        x = self.add(x, y)
        return x, self.rms_norm(x, name, eps)

    def moe_router(self, x: np.ndarray, name: str, top_k: int, norm_topk: bool):
        """The router of x and its routing -> (logits [T, E], expert ids [T, top_k], weights [T, top_k])."""
        logits = self.linear(x, name)
        return (logits, *self.moe_route(logits, top_k, norm_topk))

    def add_rms_norm_router(self, x: np.ndarray, y: np.ndarray, name: str, eps: float, router: str):
        """add_rms_norm and the router's logits over the normed rows, or None where routed_moe makes them
        -> (x + y, normed, None) here (a GPU backend may make the norm inside the router's GEMV)."""
        return (*self.add_rms_norm(x, y, name, eps), None)

    def routed_moe(self, x: np.ndarray, layer: int, router: str, top_k: int, norm_topk: bool, plan=None,
                   logits=None):
        """The router, its routing and the routed experts of `layer` -> (logits [T, E], ids [T, top_k],
        weights [T, top_k], out [T, D]): moe_router, then moe; logits: the router's, made already (a GPU
        backend may route inside its expert kernels)."""
        if logits is None:
            logits, ids, weights = self.moe_router(x, router, top_k, norm_topk)
        else:
            ids, weights = self.moe_route(logits, top_k, norm_topk)
        return logits, ids, weights, self.moe(x, layer, ids, weights, plan)

    def qkv(self, x: np.ndarray, prefix: str):
        """The attention projections of x -> (q [T, H*Dh], k [T, Hk*Dh], v [T, Hk*Dh])."""
        return tuple(self.linear(x, f"{prefix}attn_{p}.weight") for p in "qkv")

    def qk_norm_rope_attention(self, q, k, v, q_norm: str, k_norm: str, eps: float, layer: int, kv,
                               positions: np.ndarray) -> np.ndarray:
        """Per-head RMSNorm and RoPE of q [T, H, Dh] and k [T, Hk, Dh], then attention -> [T, H*Dh]."""
        q = self.rope(self.rms_norm(q, q_norm, eps), positions)
        k = self.rope(self.rms_norm(k, k_norm, eps), positions)
        return self.attention(q, k, v, layer, kv, positions)

    def qk_norm_rope_append(self, q, k, v, q_norm: str, k_norm: str, eps: float, layer: int, kv,
                            positions: np.ndarray) -> None:
        """The K/V cells qk_norm_rope_attention writes (the draft layer's prompt cells); here the
        whole op, whose attention output goes unread: its cells are then exactly the full path's,
        whatever an oracle subclass does in attention()."""
        self.qk_norm_rope_attention(q, k, v, q_norm, k_norm, eps, layer, kv, positions)

    @staticmethod
    def moe_route(router_logits: np.ndarray, top_k: int, norm_topk: bool):
        return moe_route(router_logits, top_k, norm_topk)

    def moe(self, x: np.ndarray, layer: int, expert_ids: np.ndarray, expert_weights: np.ndarray,
            plan=None) -> np.ndarray:
        """Loop over experts: the readable reference MoE. Each expert runs on the tokens routed to it
        (every expert is read from the pack: no plan is needed)."""
        out = np.zeros_like(x)
        for e in np.unique(expert_ids):
            rows, slot = np.nonzero(expert_ids == e)
            gate, up, down = self.expert_weights(layer, int(e))
            h = x[rows]
            y = swiglu(h @ gate.T, h @ up.T) @ down.T
            np.add.at(out, rows, y * expert_weights[rows, slot][:, None])
        return out


class _Pair(tuple):
    """(gate_up [2, I, D], down [D, I]) with an nbytes the cache can count."""

    def __new__(cls, gate_up, down):
        return super().__new__(cls, (gate_up, down))

    @property
    def nbytes(self) -> int:
        return self[0].nbytes + self[1].nbytes


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [..., n] * rsqrt(mean(x^2) + eps) * w, in float32."""
    x = x.astype(np.float32, copy=False)
    var = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(var + np.float32(eps))) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return silu(gate) * up


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(x)
    return e / np.sum(e, axis=axis, keepdims=True)


def moe_route(router_logits: np.ndarray, top_k: int, norm_topk: bool):
    """Softmax over experts, top-k (highest first, ties to the lower id), renormalized if asked.

    -> expert_ids [T, A] int32, expert_weights [T, A] float32.
    """
    probs = softmax(router_logits.astype(np.float32))
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if norm_topk:
        weights = weights / np.sum(weights, axis=-1, keepdims=True)
    return ids.astype(np.int32), weights.astype(np.float32)


def causal_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """q [T, H, Dh] at positions; keys/values [S, Hk, Dh] for cells 0..S-1 -> [T, H*Dh].

    Query at position p sees cells 0..p; query head h reads KV head h // (H / Hk).
    """
    S = keys.shape[0]
    return window_attention(q, keys, values, np.arange(S), positions, np.iinfo(np.int64).max)


def window_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, key_positions: np.ndarray,
                     positions: np.ndarray, window: int) -> np.ndarray:
    """Sliding-window causal attention: q [T, H, Dh] at positions over keys/values [S, Hk, Dh] at
    key_positions -> [T, H*Dh]; the query at p sees the keys at p - window + 1 .. p."""
    T, H, Dh = q.shape
    S, Hk, _ = keys.shape
    group = H // Hk
    qg = q.reshape(T, Hk, group, Dh).transpose(1, 2, 0, 3)               # [Hk, group, T, Dh]
    kt = keys.transpose(1, 2, 0)                                        # [Hk, Dh, S]
    scores = (qg @ kt[:, None]) * np.float32(1.0 / np.sqrt(Dh))         # [Hk, group, T, S]
    ahead = key_positions[None, :] - positions[:, None]                # [T, S]
    scores = np.where((ahead > 0) | (ahead <= -window), np.float32(-np.inf), scores)
    probs = softmax(scores)
    out = probs @ values.transpose(1, 0, 2)[:, None]                    # [Hk, group, T, Dh]
    return out.transpose(2, 0, 1, 3).reshape(T, H * Dh).astype(np.float32)
