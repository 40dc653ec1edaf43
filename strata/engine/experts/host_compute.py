"""The host's share of a prompt chunk's or a decode step's missed experts (--cpu-experts; the split
is strata.engine.expert_split's): computed by strata._ext.cpu_experts from their blobs in the pinned
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

Decode steps (DecodeStepSplit, the MoePlan.host of strata.engine.cuda_decode's split steps): a step
that splits (forced by a share, or priced faster by price_decode: expert_split.split_decode) runs
eagerly; at each layer the routing, its weights and the token's input come to the host (one stream
sync), choose_decode takes the host's experts among the misses at the in-place rate, and names a
cached expert of the layer that the GPU reads in the host's slots, with weight 0
(strata.backends.cuda.moe.moe_decode_split); a layer with no cached expert does not split. The host's
sum goes through the same mapped buffer, added to the GPU's output once the worker is done; the next
layer's host job starts after its own routing's stream sync, so the add has read the buffer by then.
The host's (layer, expert) keys go with the step's routing to the cache's admissions: missed all the
same (admitted as any miss), but not read over the bus (StoreStats.bytes_in_place).

The rates the split is priced with are measured at load through this same path (measure_path): jobs
submitted to the worker thread, experts of layers not touched before (not in the host's caches),
after an idle gap (the pool's threads asleep, as between layers), while the submitting thread keeps
busy the way the engine's thread does queueing the GPU's share. The pool leaves one core to the
engine's own thread (host_threads).
"""
from __future__ import annotations

import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from ..expert_split import (STREAM_ALL_SYNC_S, DecodeSplit, HostRates, expected_rows, in_place_gb_s, split_decode,
                            split_layer)

MEASURE_REPEATS = 5         # jobs of each kind measure_path times (the median counts)
MEASURE_GAP_S = 1e-3        # idle before each job: the pool's threads asleep, as while the GPU runs a layer
MEASURE_BUSY_S = 150e-6     # the submitting thread's Python after a submit (the engine queueing the bus's share)
MEASURE_EXPERTS = 11        # distinct experts a repetition touches: 1, then 5 at 1 row, then 5 at 8 rows


def host_threads() -> int:
    """The pool's threads while the host takes experts: the cores this process may use, up to 16, less
    one for the engine's own thread (which queues the GPU's share and waits on the device meanwhile)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:          # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(16, cores) - 1)


def ffn_sum(ffn, arena: np.ndarray, parts: dict, base, D: int, experts, x: np.ndarray, ids: np.ndarray,
            weights: np.ndarray, out: np.ndarray) -> int:
    """out [T, D] = sum over experts e of weights(t, e) x FFN_e(x[t]) for the tokens t routed to e
    (ids [T, A]); e's blob at arena[base[e]:], its gate/up/down at parts' offsets -> rows computed."""
    I = int(parts["gate"]["shape"][0])
    out[:] = 0.0
    rows = 0
    for e in experts:
        tok, slot = np.nonzero(ids == e)          # a token routes to an expert at most once
        b = int(base[e])

        def view(p):
            o = b + int(parts[p]["offset"])
            return arena[o:o + int(parts[p]["nbytes"])]
        y = ffn(parts["gate"]["qtype"], view("gate"), parts["up"]["qtype"], view("up"),
                parts["down"]["qtype"], view("down"), D, I, x[tok])
        out[tok] += weights[tok, slot][:, None] * y
        rows += len(tok)
    return rows


def _busy(seconds: float) -> None:
    """The engine's thread after a submit: Python with the GIL let go often (its launches do)."""
    a = np.zeros(16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        np.add(a, 1.0, out=a)
        os.sched_yield()


def measure_path(run, worker, picks, D: int, blob_bytes: int, source: str, out: np.ndarray | None = None,
                 repeats: int = MEASURE_REPEATS, gap_s: float = MEASURE_GAP_S, busy_s: float = MEASURE_BUSY_S,
                 seed: int = 0) -> HostRates:
    """The host's rates as the engine pays them: run(layer, experts, x, ids, weights, out) -> rows (the
    path's own FFN sum) submitted to worker (its executor) and timed from submit to the result on
    this thread, which stays busy busy_s meanwhile; each job after gap_s idle. picks[r]: (layer,
    MEASURE_EXPERTS expert ids) of repetition r, experts no job touched before where the pack has
    enough. Jobs: none (the bare round trip), 1 expert of 1 row, 5 of 1 row, 5 of 8 rows each; their
    medians over repetitions give expert_s and row_s, and layer_s (the round trip with the pool's
    first wake: the larger of the bare one and what the 1-expert job leaves over its expert)."""
    rng = np.random.default_rng(seed)
    out = np.zeros((8, D), np.float32) if out is None else out

    def job(layer, experts, T):
        x = rng.standard_normal((T, D)).astype(np.float32)
        ids = np.full((T, max(1, len(experts))), -1, np.int64)
        ids[:, :len(experts)] = experts
        w = np.full(ids.shape, 0.125, np.float32)
        time.sleep(gap_s)
        t0 = time.perf_counter()
        f = worker.submit(run, layer, experts, x, ids, w, out[:T])
        if experts:             # the empty job is the bare round trip: nothing to run beside
            _busy(busy_s)
        f.result()
        return time.perf_counter() - t0

    times = {"none": [], "1x1": [], "5x1": [], "5x8": []}
    for r in range(repeats):
        layer, e = picks[r % len(picks)]
        times["none"].append(job(layer, [], 1))
        times["1x1"].append(job(layer, e[:1], 1))
        times["5x1"].append(job(layer, e[1:6], 1))
        times["5x8"].append(job(layer, e[6:11], 8))
    med = {k: float(np.median(v)) for k, v in times.items()}
    per_expert = max(1e-7, (med["5x1"] - med["1x1"]) / 4)
    row_s = max(1e-8, (med["5x8"] - med["5x1"]) / 35)
    return HostRates(expert_s=max(1e-7, per_expert - row_s), row_s=row_s, blob_bytes=int(blob_bytes),
                     source=source, layer_s=max(med["none"], med["1x1"] - per_expert))


def measure_picks(layers, num_experts: int, repeats: int = MEASURE_REPEATS) -> list:
    """(layer, MEASURE_EXPERTS ids) per repetition: a different layer each where there are enough,
    distinct experts within it (ids wrap on a pack of fewer experts)."""
    layers = list(layers)
    return [(layers[r * max(1, len(layers) // repeats) % len(layers)],
             [(r * MEASURE_EXPERTS + i) % num_experts for i in range(MEASURE_EXPERTS)]) for r in range(repeats)]


@dataclass
class HostStats:
    experts: int = 0             # expert FFNs the host computed (one per layer and expert)
    rows: int = 0                # token rows through them
    bytes: int = 0               # blob bytes the host read for them (bytes that did not cross the bus)
    layers: int = 0              # layers the host took part in
    seconds: float = 0.0         # the worker's time
    decode_steps: int = 0        # decode steps that split (the host took an expert of some layer)
    decode_experts: int = 0      # of `experts`, those of decode steps


class HostExperts:
    """The host's expert work of one store (module doc). share: --cpu-experts SHARE (the host's share
    of each layer's missed experts), or None for auto (the cost model's split)."""

    def __init__(self, rt, device, store, args, rates: HostRates | None, h2d_gb_s: float, share: float | None):
        from ..._ext import cpu_experts
        self.rt, self.device, self.store = rt, device, store
        self.ffn = cpu_experts.expert_ffn
        if cpu_experts.threads() != host_threads():
            cpu_experts.set_threads(host_threads())
        self.D, self.A = int(args.hidden_size), int(args.num_experts_per_tok)
        self.h2d_gb_s, self.share = h2d_gb_s, share
        self.in_place_gb_s = in_place_gb_s(h2d_gb_s)    # decode misses' rate (the runner sets it: --pcie-gbs)
        self.decode: DecodeSplit | None = None          # the decode split's last pricing (DecodeSteps)
        self.stats = HostStats()
        self._arena = np.frombuffer(store.arena, np.uint8)
        self._out, self._out_view = None, None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="strata-cpu-experts")
        weakref.finalize(self, self._worker.shutdown, False)
        self.rates = rates if rates is not None else self.measure()

    def measure(self) -> HostRates:
        """The host's rates through this path (measure_path) on the arena's own experts, and what
        choosing a split costs (choose_s: choose() over a 19-token routing); the device reads
        (sync_s) are the runner's to measure (cuda_load.host_experts)."""
        from ..._ext import cpu_experts
        s = self.store
        pinned = [l for l in range(len(s.layers_meta)) if s.pinned[l, :MEASURE_EXPERTS].all()]
        lay = max(pinned or [0], key=self._blob)
        picks = measure_picks([l for l in pinned if self._blob(l) == self._blob(lay)] or [lay], s.num_experts)
        run = (lambda layer, experts, x, ids, w, out:
               ffn_sum(self.ffn, self._arena, s.layers_meta[layer]["parts"], s._offsets[layer], self.D, experts,
                       x, ids, w, out))
        rates = measure_path(run, self._worker, picks, self.D, self._blob(lay),
                             f"measured at load through the engine's path ({cpu_experts.threads()} threads, "
                             f"{cpu_experts.simd()})")
        self.rates = rates              # choose() prices with them
        rng = np.random.default_rng(1)
        times = []
        for _ in range(MEASURE_REPEATS):
            ids = rng.integers(0, s.num_experts, (19, self.A))
            t0 = time.perf_counter()
            self.choose(lay, ids, None)
            times.append(time.perf_counter() - t0)
        return replace(rates, choose_s=float(np.median(times)),
                       fixed_source="the host round trip and choosing measured at load; the device reads and "
                                    "the GPU's resume as estimated for the H200 machine")

    def status(self) -> dict:
        s, r = self.stats, self.rates
        return {"mode": "auto" if self.share is None else self.share, "experts": s.experts, "rows": s.rows,
                "bytes": s.bytes, "layers": s.layers, "seconds": round(s.seconds, 6),
                "decode_steps": s.decode_steps, "decode_experts": s.decode_experts,
                "decode": None if self.decode is None else self.decode.to_dict(),
                "rates": {"expert_ms": r.expert_s * 1e3, "row_ms": r.row_s * 1e3, "blob_bytes": r.blob_bytes,
                          "source": r.source,
                          "fixed_ms": {k: v * 1e3 for k, v in r.fixed_parts().items()},
                          "fixed_source": r.fixed_source}}

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
        is chosen now, the last experts by id of the expected count (ChunkSplit.sets). Otherwise each
        layer chooses from its routing, but only the layers whose expected split (uniform routing)
        gives the host any: choosing costs a read of the routing and the split's Python a layer, which
        made a 19-token prompt at 8 GiB 30% slower on the H200 when auto then chose nothing."""
        E = self.store.num_experts
        touched, rows = expected_rows(T, E, self.A)
        rates = replace(self.rates, sync_s=self.rates.sync_s + STREAM_ALL_SYNC_S) if stream_all else self.rates
        taking, sets = [], {}
        for l in (range(layers) if isinstance(layers, int) else layers):
            missing = self._missed(l, np.arange(E))
            m = int(round(len(missing) * touched / E))
            split = split_layer(np.full(m, max(1, int(round(rows)))), self._blob(l), self.h2d_gb_s, rates, self.share)
            if not split.host:
                continue
            taking.append(l)
            if stream_all:      # the share of all missing ones: an untouched one costs neither the bus nor the host
                k = min(len(missing), int(round(split.host * len(missing) / max(1, m))))
                sets[l] = frozenset(missing[len(missing) - k:].tolist())
        if not taking:
            return None
        return ChunkSplit(self, sets) if stream_all else ChunkSplit(self, None, frozenset(taking))

    def choose(self, layer: int, ids: np.ndarray, sets: dict | None) -> list[int]:
        """The experts of layer the host computes for routing ids [T, A] (ascending)."""
        if sets is not None:
            mine = sets.get(layer, frozenset())
            return [e for e in np.unique(ids).tolist() if e in mine]
        return self._split_missed(layer, ids, self.h2d_gb_s)

    def _split_missed(self, layer: int, ids: np.ndarray, gb_s: float, needed: float | None = None) -> list[int]:
        """Of the experts routing ids [T, A] names at layer, the missed ones (_missed) split_layer gives
        the host, each with its rows, against the bus at gb_s (ascending; [] where nothing is missed)."""
        active, counts = np.unique(ids, return_counts=True)
        keep = np.isin(active, self._missed(layer, active))
        missed, rows = active[keep], counts[keep]
        if not len(missed):
            return []
        split = split_layer(rows, self._blob(layer), gb_s, self.rates, self.share, needed=needed)
        return sorted(missed[list(split.chosen)].tolist())

    def price_decode(self, missed: float, layers: int, eager_s: float) -> DecodeSplit:
        """Whether one-token decode steps split now (expert_split.split_decode at this store's largest
        blob, the in-place rate and the rates as measured): kept as `decode` for status."""
        blob = max(self._blob(l) for l in range(len(self.store.layers_meta)))
        self.decode = split_decode(missed, layers, blob, self.in_place_gb_s, self.rates, eager_s, self.share)
        return self.decode

    def choose_decode(self, layer: int, ids: np.ndarray) -> tuple[list[int], int]:
        """A split decode step's layer: (the experts the host computes for routing ids [T, A],
        ascending; an expert of layer cached in VRAM the GPU reads in their slots instead), or
        ([], -1): nothing missed that the host may take, the split declines them, or no expert of
        the layer is cached (the GPU's stand-in would be read over the bus). Priced per layer at the
        in-place rate; auto takes the layer's cheapest split that beats the bus, the step's margins
        having been cleared by price_decode."""
        cached = np.flatnonzero(self.store.slot_of[layer] >= 0)
        if not cached.size:
            return [], -1
        experts = self._split_missed(layer, ids, self.in_place_gb_s, needed=0.0)
        return (experts, int(cached[0])) if experts else ([], -1)

    def _out_buffer(self, T: int) -> np.ndarray:
        need = T * self.D * 4
        if self._out is None or self._out.nbytes < need:
            self._out = self.rt.HostBuffer(self.device, max(need, 1 << 16), mapped=True)
            self._out_view = np.frombuffer(self._out, np.float32)
        return self._out_view[:T * self.D].reshape(T, self.D)

    def start(self, layer: int, experts: list, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
              count_misses: bool = True):
        """Start the host's experts of layer on the worker -> wait(): blocks until the sum
        [T, D] is in the mapped buffer, returns its device address (moe_combine's residual).
        count_misses: count them as the cache's misses (a decode step's are counted with its
        routing, Admissions.after_step)."""
        out = self._out_buffer(x.shape[0])
        if count_misses:
            self.store.stats.misses += len(experts)      # missed by the cache all the same (hit rates compare)
        future = self._worker.submit(self._compute, layer, experts, x, ids, weights, out)
        return lambda: (future.result(), self._out.device_ptr)[1]

    def _compute(self, layer: int, experts: list, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                 out: np.ndarray) -> None:
        t0 = time.perf_counter()
        s, blob = self.store, self._blob(layer)
        rows = ffn_sum(self.ffn, self._arena, s.layers_meta[layer]["parts"], s._offsets[layer], self.D, experts,
                       x, ids, weights, out)
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
    layers: frozenset | None = None     # sets None: the layers that choose from their routing (None: all)

    def skipped(self, layer: int) -> frozenset:
        """The experts of layer the ring must not queue (chosen at the start)."""
        return self.sets.get(layer, frozenset()) if self.sets is not None else frozenset()

    def may_take(self, layer: int) -> bool:
        """Whether the host may take any of layer's experts (a layer without any keeps its routing
        on the device)."""
        if self.sets is None:
            return self.layers is None or layer in self.layers
        return layer in self.sets

    def choose(self, layer: int, ids: np.ndarray) -> list[int]:
        return self.host.choose(layer, ids, self.sets)

    def start(self, layer: int, experts: list, x: np.ndarray, ids: np.ndarray, weights: np.ndarray):
        return self.host.start(layer, experts, x, ids, weights)


class DecodeStepSplit:
    """The host's share of split decode steps (MoePlan.host of DecodeSteps' split plan, read by
    strata.backends.cuda.moe.moe_decode_split): per layer, choose() the host's experts among the
    step's misses and the cached expert the GPU reads in their slots, start() them; the (layer,
    expert) keys the host took since end_step(), which the step's routing log does not tell apart
    from misses read in place."""

    def __init__(self, host: HostExperts):
        self.host = host
        self._taken: list = []

    def choose(self, layer: int, ids: np.ndarray) -> tuple[list[int], int]:
        return self.host.choose_decode(layer, ids)

    def start(self, layer: int, experts: list, x: np.ndarray, ids: np.ndarray, weights: np.ndarray):
        self.host.stats.decode_experts += len(experts)
        self._taken.extend(layer * self.host.store.num_experts + e for e in experts)
        return self.host.start(layer, experts, x, ids, weights, count_misses=False)

    def end_step(self) -> np.ndarray:
        """The keys (layer * E + expert) the host took in the step now done; counts the step."""
        keys, self._taken = np.asarray(self._taken, np.int64), []
        if keys.size:
            self.host.stats.decode_steps += 1
        return keys
