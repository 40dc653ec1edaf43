"""The host's share of a prompt chunk's missed experts (--cpu-experts; the split is
strata.engine.expert_split's): computed by strata._ext.cpu_experts from their blobs in the pinned
arena, on a worker thread, while the GPU computes the layer's other experts.

At a layer the ops (strata.backends.cuda.moe) bring the routing, the layer's input rows and the
routing weights to the host (one stream sync), ask the chunk's split which experts the host takes
and start it here; the GPU skips those experts (the ring never copies them) and zeroes their output
rows; the worker writes sum over its experts of weight x FFN(row) per token into a mapped pinned
buffer [T, D], which moe_combine reads as its residual once the ops have waited for the worker.
The buffer is reused layer after layer: a layer's host work starts only after the stream sync that
brought its routing down, so the last layer's combine has read the buffer by then.

Chunks of a size that streams every non-cached expert (the ring queues them before the routing is
known) take a host set chosen per layer at the chunk's start, from the expected rows per expert;
smaller chunks choose per layer from the routing's own row counts. Unpinned experts stay on the bus.
"""
from __future__ import annotations

import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from ..expert_split import STREAM_ALL_SYNC_S, HostRates, expected_rows, split_layer


@dataclass
class HostStats:
    experts: int = 0             # expert FFNs the host computed (one per layer and expert)
    rows: int = 0                # token rows through them
    bytes: int = 0               # blob bytes the host read for them (bytes that did not cross the bus)
    layers: int = 0              # layers the host took part in
    seconds: float = 0.0         # the worker's time


class HostExperts:
    """The host's expert work of one store (module doc). share: --cpu-experts SHARE (the host's share
    of each layer's missed experts), or None for auto (the cost model's split)."""

    def __init__(self, rt, device, store, args, rates: HostRates, h2d_gb_s: float, share: float | None):
        from ..._ext import cpu_experts
        self.rt, self.device, self.store = rt, device, store
        self.ffn = cpu_experts.expert_ffn
        self.D, self.A = int(args.hidden_size), int(args.num_experts_per_tok)
        self.rates, self.h2d_gb_s, self.share = rates, h2d_gb_s, share
        self.stats = HostStats()
        self._arena = np.frombuffer(store.arena, np.uint8)
        self._out, self._out_view = None, None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="strata-cpu-experts")
        weakref.finalize(self, self._worker.shutdown, False)

    def status(self) -> dict:
        s, r = self.stats, self.rates
        return {"mode": "auto" if self.share is None else self.share, "experts": s.experts, "rows": s.rows,
                "bytes": s.bytes, "layers": s.layers, "seconds": round(s.seconds, 6),
                "rates": {"expert_ms": r.expert_s * 1e3, "row_ms": r.row_s * 1e3, "blob_bytes": r.blob_bytes,
                          "source": r.source}}

    def _blob(self, layer: int) -> int:
        return int(self.store.layers_meta[layer]["blob_bytes"])

    def _missed(self, layer: int, experts) -> np.ndarray:
        """Of experts (ids at layer), those neither in VRAM nor unpinned: what the host may take."""
        s = self.store
        experts = np.asarray(experts, np.int64)
        return experts[(s.slot_of[layer, experts] < 0) & s.pinned[layer, experts]]

    def chunk(self, T: int, stream_all: bool, layers) -> "ChunkSplit | None":
        """The split of a chunk of T tokens (its MoePlan's host), None when the host takes nothing.
        stream_all: the ring queues every non-cached expert at the start, so each layer's host set
        is chosen now, the last experts by id of the expected count (ChunkSplit.sets)."""
        if not stream_all:
            return ChunkSplit(self, None)
        E = self.store.num_experts
        touched, rows = expected_rows(T, E, self.A)
        rates = replace(self.rates, layer_s=self.rates.layer_s + STREAM_ALL_SYNC_S)
        sets = {}
        for l in (range(layers) if isinstance(layers, int) else layers):
            missing = self._missed(l, np.arange(E))
            m = int(round(len(missing) * touched / E))
            split = split_layer(np.full(m, max(1, int(round(rows)))), self._blob(l), self.h2d_gb_s, rates, self.share)
            if split.host:
                # the share of all missing ones: an untouched one costs neither the bus nor the host
                k = min(len(missing), int(round(split.host * len(missing) / max(1, m))))
                sets[l] = frozenset(missing[len(missing) - k:].tolist())
        return ChunkSplit(self, sets) if sets else None

    def choose(self, layer: int, ids: np.ndarray, sets: dict | None) -> list[int]:
        """The experts of layer the host computes for routing ids [T, A] (ascending)."""
        active, counts = np.unique(ids, return_counts=True)
        if sets is not None:
            mine = sets.get(layer, frozenset())
            return [e for e in active.tolist() if e in mine]
        keep = np.isin(active, self._missed(layer, active))
        missed, rows = active[keep], counts[keep]
        if not len(missed):
            return []
        split = split_layer(rows, self._blob(layer), self.h2d_gb_s, self.rates, self.share)
        return sorted(missed[list(split.chosen)].tolist())

    def _out_buffer(self, T: int) -> np.ndarray:
        need = T * self.D * 4
        if self._out is None or self._out.nbytes < need:
            self._out = self.rt.HostBuffer(self.device, max(need, 1 << 16), mapped=True)
            self._out_view = np.frombuffer(self._out, np.float32)
        return self._out_view[:T * self.D].reshape(T, self.D)

    def start(self, layer: int, experts: list, x: np.ndarray, ids: np.ndarray, weights: np.ndarray):
        """Start the host's experts of layer on the worker -> wait(): blocks until the sum
        [T, D] is in the mapped buffer, returns its device address (moe_combine's residual)."""
        out = self._out_buffer(x.shape[0])
        self.store.stats.misses += len(experts)      # missed by the cache all the same (hit rates compare)
        future = self._worker.submit(self._compute, layer, experts, x, ids, weights, out)
        return lambda: (future.result(), self._out.device_ptr)[1]

    def _compute(self, layer: int, experts: list, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                 out: np.ndarray) -> None:
        t0 = time.perf_counter()
        s, lay = self.store, self.store.layers_meta[layer]
        parts, blob = lay["parts"], self._blob(layer)
        D, I = self.D, int(parts["gate"]["shape"][0])
        out[:] = 0.0
        rows = 0
        for e in experts:
            tok, slot = np.nonzero(ids == e)          # a token routes to an expert at most once
            base = int(s._offsets[layer, e])

            def view(p):
                o = base + int(parts[p]["offset"])
                return self._arena[o:o + int(parts[p]["nbytes"])]
            y = self.ffn(parts["gate"]["qtype"], view("gate"), parts["up"]["qtype"], view("up"),
                         parts["down"]["qtype"], view("down"), D, I, x[tok])
            out[tok] += weights[tok, slot][:, None] * y
            rows += len(tok)
        seconds = time.perf_counter() - t0
        st = self.stats
        st.experts += len(experts)
        st.rows += rows
        st.bytes += len(experts) * blob
        st.layers += 1
        st.seconds += seconds
        self.rates = self.rates.updated(rows, len(experts), blob, seconds)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


@dataclass(frozen=True)
class ChunkSplit:
    """One chunk's host share (MoePlan.host): sets, the host's experts per layer chosen at the chunk's
    start (a chunk streaming every non-cached expert), or None to choose per layer from the routing."""
    host: HostExperts
    sets: dict | None

    def skipped(self, layer: int) -> frozenset:
        """The experts of layer the ring must not queue (chosen at the start)."""
        return self.sets.get(layer, frozenset()) if self.sets is not None else frozenset()

    def may_take(self, layer: int) -> bool:
        """Whether the host may take any of layer's experts (a layer without any keeps its routing
        on the device)."""
        return self.sets is None or layer in self.sets

    def choose(self, layer: int, ids: np.ndarray) -> list[int]:
        return self.host.choose(layer, ids, self.sets)

    def start(self, layer: int, experts: list, x: np.ndarray, ids: np.ndarray, weights: np.ndarray):
        return self.host.start(layer, experts, x, ids, weights)
