"""The CPU/GPU split of a layer's missed experts (#18 item 3): of the experts a prompt chunk (or a
decode step) routes to that are not in VRAM, which go over the bus (copied, then computed by the
GPU) and which the host's cores compute where they lie in the pinned arena (strata._ext.cpu_experts).

Per layer, from measured rates (never touches a device, so it is tested on the CPU):
- the bus: each missed expert the GPU takes costs blob_bytes / h2d (the copies queue back to back;
  the GPU's GEMMs over a few rows hide behind them, at the device copy rate);
- the host: per expert expert_s + row_s * rows (a pass unpacking the weights, then each token row),
  scaled by blob bytes, with the whole thread pool; the rates are those of the real path (the
  engine's worker thread, experts not in the host's caches, the pool woken from idle: HostRates);
- the fixed costs of a layer the host takes part in (HostRates.fixed_s), each on the critical path:
  sync_s, the device->host reads the split adds (the layer's input rows and routing weights; a
  routed-only chunk reads its routing anyway); choose_s, the split's own Python (which experts,
  their rows); layer_s, the host job's round trip (the worker thread and its pool woken, the result
  seen by the engine's thread); resume_s, the GPU idle after the host's result (the combine and the
  next layer's launches are queued only once the engine's thread stops waiting; without a split it
  had them queued behind the copies). A chunk routed on the device pays STREAM_ALL_SYNC_S more.
Both sides start once the routing is known and the split chosen, so a split layer takes
sync_s + choose_s + max(bus, layer_s + host) + resume_s against all over the bus. The host takes the
k experts with the fewest rows (its cheapest; the bus cost does not depend on rows) for the k that
minimises that. With equal rows and no fixed costs that is the share g / (c + g) of the seeds' engine
(g: an expert's bus time, c: its host time). auto splits only when the net gain clears the fixed
costs again (FIXED_MARGIN of them: they are the least known part) and MIN_GAIN of the layer; many
rows per expert (long chunks) give the host nothing.

A decode step (split_decode) prices the same split with zero-copy as the alternative: each layer
misses `missed` experts of the token (A x the decode miss rate the runner measured, or the cache's
uncached share), each read in place by the fused decode kernels at in_place_gb_s (IN_PLACE_SHARE of
the pinned copy rate: docs/PERF.md's estimate, nothing in the engine measures it; under --pcie-gbs
plus the cap's sleep), against the host's expert at one row and the layer's fixed costs. A split
step also loses its CUDA graph (reading the routing on the host cannot be captured): its launches are
queued from Python between the layers' syncs, nothing queued ahead to hide them, so it pays eager_s,
the eager step's host time (measured by the runner, else EAGER_LAYER_S a layer). Step time:
layers x (sync_s + choose_s + max(bus, layer_s + host) + resume_s) + eager_s against layers x bus;
auto takes it when that saves the same margins over the step's fixed costs (the layers' and
eager_s). On the H200's full bus it refuses: a host expert of one row (~0.38 ms on 16 cores through
the engine's path) costs more than reading it in place (~0.11 ms); on a slow bus with a fast host it
takes decode. A share forces it. Not measured on a GPU yet.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..errors import InvalidArgument
from .memory_model import stream_all_tokens

# The fixed costs of a layer the host takes part in where nothing measured them (`plan` without a
# device; the runner measures sync_s, choose_s and layer_s at load): estimates for the H200 machine's
# host (Python 3.11, PCIe 5.0). tools/cpu_split_costs.py on a 2-core host: choose 0.04-0.08 ms, the
# worker's round trip after 1 ms idle 0.03-0.05 ms and a job's first expert 0.1-0.35 ms over the next
SYNC_S = 40e-6              # two device->host reads of a short chunk's rows and weights, each a stream sync
CHOOSE_S = 60e-6            # np.unique / isin / the split at the layer (HostExperts.choose)
HOST_LAYER_S = 100e-6       # the host job's round trip: submit, the worker and its pool woken, the result seen
RESUME_S = 50e-6            # the combine and the next layer's ~10 launches, queued only after the wait
# a chunk that streams every non-cached expert groups its routing on the device and the host queues
# layers ahead; a layer with host experts brings the routing down, so the GPU drains that queue
STREAM_ALL_SYNC_S = 300e-6
MIN_GAIN = 0.03             # auto splits a layer only when that saves at least this share of its time
FIXED_MARGIN = 1.0          # ... and at least this many times the fixed costs it paid (net of them)
RATE_UPDATE = 0.2           # weight of each new measurement in the running host rate
CPU_EXPERT_QTYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")     # what strata._ext.cpu_experts reads


@dataclass(frozen=True)
class HostRates:
    """The host's expert FFN time: expert_s + row_s * rows for an expert of blob_bytes (others scale
    by their bytes), and the fixed costs of a layer the host takes part in (module doc): sync_s,
    choose_s, layer_s, resume_s, whose origin fixed_source names."""
    expert_s: float
    row_s: float
    blob_bytes: int
    source: str
    layer_s: float = HOST_LAYER_S
    sync_s: float = SYNC_S
    choose_s: float = CHOOSE_S
    resume_s: float = RESUME_S
    fixed_source: str = "estimates for the H200 machine (expert_split's defaults)"

    @property
    def fixed_s(self) -> float:
        """What a layer with host experts pays besides the larger of its two sides' work."""
        return self.sync_s + self.choose_s + self.layer_s + self.resume_s

    def fixed_parts(self) -> dict:
        return {"sync": self.sync_s, "choose": self.choose_s, "host_round_trip": self.layer_s,
                "gpu_resume": self.resume_s}

    def seconds(self, rows, blob_bytes: int):
        return (self.expert_s + self.row_s * np.asarray(rows, np.float64)) * (blob_bytes / self.blob_bytes)

    def updated(self, rows: int, experts: int, blob_bytes: int, seconds: float) -> "HostRates":
        """A measured host job (experts experts of `rows` rows in all) moves the rates towards it."""
        predicted = float(self.expert_s * experts + self.row_s * rows) * (blob_bytes / self.blob_bytes)
        if predicted <= 0 or seconds <= 0:
            return self
        f = 1.0 + RATE_UPDATE * (min(4.0, max(0.25, seconds / predicted)) - 1.0)
        return replace(self, expert_s=self.expert_s * f, row_s=self.row_s * f)


# the H200 machine's 16 cores, AVX2, a 3.06 MB Q4_K/Q6_K expert: 0.29 ms for 1 row, 0.77 ms for 8
# (docs/PERF.md, "Experts on the host's cores": eight experts cycled back to back from the calling
# thread, so warm in the host's caches and the pool never idle: the bench's rates, not the engine's)
BENCH_HOST_RATES = HostRates(expert_s=0.29e-3 - 0.48e-3 / 7, row_s=0.48e-3 / 7, blob_bytes=3_060_000,
                             source="the H200 machine's 16 cores, tools/cpu_expert_bench.py (docs/PERF.md)")
# what the engine's path pays against that bench (the worker thread, experts out of the caches after an
# idle gap, the per-expert Python, the engine's thread busy beside): tools/cpu_split_costs.py on a 2-core
# host measured x1.0-1.6 an expert and x1.1-1.8 a row
PATH_EXPERT_FACTOR, PATH_ROW_FACTOR = 1.3, 1.5
DEFAULT_HOST_RATES = replace(BENCH_HOST_RATES, expert_s=BENCH_HOST_RATES.expert_s * PATH_EXPERT_FACTOR,
                             row_s=BENCH_HOST_RATES.row_s * PATH_ROW_FACTOR,
                             source="the H200 machine's bench rates x the engine path's factors (not measured here)")


@dataclass(frozen=True)
class LayerSplit:
    """One layer's missed experts: `host` of them on the host (the indices into the rows given,
    `chosen`), the rest over the bus; predicted seconds with the split and all over the bus.
    fixed_seconds: the fixed costs a split of this layer pays (counted in `seconds` when host > 0);
    best_host / best_seconds: the cheapest split the model found, taken or not (auto refuses one
    whose gain does not clear the fixed costs with the margin)."""
    host: int
    bus: int
    seconds: float
    bus_seconds: float
    chosen: tuple = ()
    fixed_seconds: float = 0.0
    best_host: int = 0
    best_seconds: float = 0.0

    @property
    def speedup(self) -> float:
        return self.bus_seconds / self.seconds if self.seconds > 0 else 1.0

    def why(self) -> str:
        """Why auto took the split it did (plan's text)."""
        if self.host:
            return (f"saves {(self.bus_seconds - self.seconds) * 1e3:.3f} ms a layer net of "
                    f"{self.fixed_seconds * 1e3:.3f} ms fixed")
        if not self.best_host:
            return "nothing missed"
        if self.best_seconds >= self.bus_seconds:
            return (f"the host never beats the bus (its best share, {self.best_host} of {self.host + self.bus}, "
                    f"costs {(self.best_seconds - self.bus_seconds) * 1e3:.3f} ms more a layer)")
        return (f"refused: {self.best_host} on the host would save {(self.bus_seconds - self.best_seconds) * 1e3:.3f} "
                f"ms a layer net of {self.fixed_seconds * 1e3:.3f} ms fixed, under the margin "
                f"({gain_needed(self.bus_seconds, self.fixed_seconds) * 1e3:.3f} ms)")


def gain_needed(bus_seconds: float, fixed_seconds: float) -> float:
    """The net gain (after the fixed costs) auto needs to split a layer of bus_seconds."""
    return max(MIN_GAIN * bus_seconds, FIXED_MARGIN * fixed_seconds)


def split_layer(rows, blob_bytes: int, h2d_gb_s: float, host: HostRates, share: float | None = None,
                needed: float | None = None) -> LayerSplit:
    """The split of one layer's missed experts with rows[i] token rows each (module doc). share:
    a forced host share of the experts (0..1; --cpu-experts SHARE), else the cheapest split when
    its net gain clears `needed` seconds (None: gain_needed; a decode step's layer passes 0, the
    step's margin having been cleared for the whole step, split_decode), else none."""
    rows = np.asarray(rows, np.int64)
    m = len(rows)
    bus_s = blob_bytes / (h2d_gb_s * 1e9)
    order = np.argsort(rows, kind="stable")
    prefix = np.concatenate([[0.0], np.cumsum(host.seconds(rows[order], blob_bytes))])
    k_all = np.arange(m + 1)
    fixed = host.fixed_s
    cost = np.where(k_all > 0, host.sync_s + host.choose_s + host.resume_s
                    + np.maximum((m - k_all) * bus_s, prefix + host.layer_s), m * bus_s)
    best = int(np.argmin(cost[1:])) + 1 if m else 0      # the first minimum among real splits
    if share is not None:
        k = min(m, int(round(share * m)))
    else:
        need = gain_needed(cost[0], fixed) if needed is None else needed
        k = best if m and cost[best] < cost[0] and cost[0] - cost[best] >= need else 0
    return LayerSplit(k, m - k, float(cost[k]), float(m * bus_s), tuple(sorted(order[:k].tolist())), fixed,
                      best, float(cost[best]))


def expected_rows(T: int, num_experts: int, top_k: int) -> tuple[float, float]:
    """Under uniform routing, a chunk of T tokens: (experts a layer touches, rows of each touched)."""
    touched = num_experts * (1.0 - (1.0 - top_k / num_experts) ** T)
    return touched, T * top_k / max(touched, 1e-9)


def split_chunk(T: int, num_experts: int, top_k: int, cached_share: float, blob_bytes: int, h2d_gb_s: float,
                host: HostRates, share: float | None = None, stream_all_tokens: int = 0) -> LayerSplit:
    """A layer's split for a chunk of T tokens under uniform routing, cached_share of the layer's experts
    in VRAM (the plan's view: a decode step is T = 1); chunks of stream_all_tokens or more (when
    given) pay the sync of a chunk routed on the device."""
    if stream_all_tokens and T >= stream_all_tokens:
        host = replace(host, sync_s=host.sync_s + STREAM_ALL_SYNC_S)
    touched, rows = expected_rows(T, num_experts, top_k)
    missed = int(round(touched * (1.0 - cached_share)))
    return split_layer(np.full(missed, max(1, int(round(rows)))), blob_bytes, h2d_gb_s, host, share)


# A decode step's misses are read in place by the GPU's kernels (zero-copy), not copied: docs/PERF.md
# measured them at about 27 GB/s on the H200 (the 80B at 12 GiB: 373 missed experts a token, 660 MB, at
# 42 tok/s) against 55.4 GB/s of pinned copies; the engine measures no in-place rate of its own
IN_PLACE_SHARE = 0.5
# A split decode step runs eagerly (its per-layer reads of the routing cannot be captured), so it loses
# the graph: its launches are queued from Python between the layers' syncs, with no GPU work queued
# ahead to hide them. docs/PERF.md (2026-11-30, tools/decode_graph_ab.py, Qwen3-30B-A3B's 48 layers):
# 14.6-21.1 ms of host time to queue an eager step against 0.03-0.04 ms to launch its graph, before the
# fused decode kernels cut the launches a layer: per layer an upper estimate where the runner measured none
EAGER_LAYER_S = 14.6e-3 / 48


def in_place_gb_s(bus_gb_s: float, cap_gb_s: float = 0.0) -> float:
    """The rate decode misses are read in place at: IN_PLACE_SHARE of the pinned copy rate bus_gb_s,
    and under --pcie-gbs cap_gb_s the sleep strata.engine.experts.bus_cap adds after each step
    (missed bytes x (1/cap - 1/bus))."""
    per_gb = 1.0 / (IN_PLACE_SHARE * bus_gb_s)
    if cap_gb_s and cap_gb_s < bus_gb_s:
        per_gb += 1.0 / cap_gb_s - 1.0 / bus_gb_s
    return 1.0 / per_gb


@dataclass(frozen=True)
class DecodeSplit:
    """A decode step's split (split_decode): each of `layers` layers misses `missed` experts of the
    token on average, `layer` the split of one such layer (its bus side read in place); step seconds
    of those misses all over the bus and with the split (the layers' splits, their fixed costs and
    the eager step's eager_s); `taken`: whether decode steps split."""
    layers: int
    missed: float
    layer: LayerSplit
    bus_seconds: float
    seconds: float
    eager_s: float
    fixed_seconds: float
    in_place_gb_s: float
    taken: bool
    forced: bool = False

    @property
    def speedup(self) -> float:
        return self.bus_seconds / self.seconds if self.seconds > 0 else 1.0

    def why(self) -> str:
        s = self.layer
        if self.forced:
            return (f"forced: {s.host} of {s.host + s.bus} missed a layer on the host, predicted "
                    f"{self.bus_seconds * 1e3:.2f} -> {self.seconds * 1e3:.2f} ms a step of misses")
        if not s.best_host:
            return "nothing missed"
        if self.taken:
            return (f"saves {(self.bus_seconds - self.seconds) * 1e3:.2f} ms a step net of "
                    f"{self.fixed_seconds * 1e3:.2f} ms fixed (the eager step's {self.eager_s * 1e3:.2f} ms included)")
        if s.best_seconds >= s.bus_seconds:
            return (f"the host never beats the bus at one row an expert (its best share, {s.best_host} of "
                    f"{s.host + s.bus}, costs {(s.best_seconds - s.bus_seconds) * 1e3:.3f} ms more a layer)")
        return (f"refused: {s.best_host} of {s.host + s.bus} missed a layer on the host would take the step's "
                f"misses {self.bus_seconds * 1e3:.2f} -> {self.seconds * 1e3:.2f} ms, "
                f"{self.fixed_seconds * 1e3:.2f} ms of it fixed (the eager step's {self.eager_s * 1e3:.2f} ms "
                f"included): a gain under the margin "
                f"({gain_needed(self.bus_seconds, self.fixed_seconds) * 1e3:.2f} ms)")

    def to_dict(self) -> dict:
        s = self.layer
        return {"taken": self.taken, "forced": self.forced, "missed_a_layer": round(self.missed, 3),
                "host_a_layer": s.host if (self.taken or self.forced) else s.best_host,
                "bus_ms": round(self.bus_seconds * 1e3, 4), "split_ms": round(self.seconds * 1e3, 4),
                "eager_ms": round(self.eager_s * 1e3, 4), "fixed_ms": round(self.fixed_seconds * 1e3, 4),
                "in_place_gb_s": round(self.in_place_gb_s, 2), "why": self.why()}


def split_decode(missed: float, layers: int, blob_bytes: int, in_place_gb_s_: float, host: HostRates,
                 eager_s: float, share: float | None = None) -> DecodeSplit:
    """Whether one-token decode steps split (module doc): each layer misses `missed` experts of the
    token (expected), one row each, read in place at in_place_gb_s_ without the split; a split step
    pays each layer's split with its fixed costs, plus eager_s for running without its graph. share:
    forced (--cpu-experts SHARE, taken whatever the price); None (auto): the layer's cheapest split,
    taken when the step's net gain clears the prompt split's margins over the step's fixed costs
    (the layers' and eager_s)."""
    m = max(0, int(round(missed)))
    # auto: the layer's cheapest split whenever it beats the bus (needed 0); the margins are the step's
    layer = split_layer(np.ones(m, np.int64), blob_bytes, in_place_gb_s_, host, share, needed=0.0)
    bus = layers * layer.bus_seconds
    fixed = layers * host.fixed_s + eager_s
    with_split = layers * (layer.seconds if layer.host else layer.best_seconds) + eager_s if m else bus
    taken = layer.host > 0 and (share is not None or bus - with_split >= gain_needed(bus, fixed))
    if not taken:       # what the split would cost (why() shows it); the step reads its misses in place
        layer = replace(layer, host=0, bus=m, seconds=layer.bus_seconds, chosen=())
    return DecodeSplit(layers, float(missed), layer, bus, with_split, eager_s, fixed, in_place_gb_s_, taken,
                       share is not None)


def parse_mode(text: str) -> float | None | str:
    """--cpu-experts: 'off', 'auto' or a share of the missed experts in (0, 1] -> 'off', None (auto)
    or the share."""
    text = str(text).strip().lower()
    if text == "off":
        return "off"
    if text == "auto":
        return None
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if not 0.0 < share <= 1.0:
        raise InvalidArgument(f"cpu_experts must be off, auto or a share of the missed experts in (0, 1], got {text!r}")
    return share


def host_computable(layers_meta) -> str | None:
    """Why cpu_experts cannot compute this pack's experts, or None when it can."""
    for lay in layers_meta:
        for name, p in lay["parts"].items():
            if p["qtype"] not in CPU_EXPERT_QTYPES:
                return f"layer {lay['layer']}'s {name} is {p['qtype']} (the host's kernels read {', '.join(CPU_EXPERT_QTYPES)})"
            if p["shape"][-1] % (256 if p["qtype"].endswith("_K") else 32):
                return f"layer {lay['layer']}'s {name} rows of {p['shape'][-1]} are not whole {p['qtype']} blocks"
    return None


PLAN_CASES = (("a 19-token turn", 19), ("a 512-token chunk", 512), ("a decode step", 1))


@dataclass(frozen=True)
class PlanCase:
    """What `plan` shows for one case: a layer's split and the bus-bound speeds without and with it
    (decode: the step's split, split_decode, with its eager step)."""
    name: str
    tokens: int
    split: LayerSplit
    bus_tok_s: float
    split_tok_s: float
    decode: DecodeSplit | None = None


def plan_cases(args, blob_bytes: int, num_layers: int, prompt_cached: float, decode_cached: float,
               h2d_gb_s: float, host: HostRates, share: float | None = None,
               in_place: float | None = None) -> list[PlanCase]:
    """The split of PLAN_CASES at the plan's cached shares (the prompt's kept slots, the decode
    cache), with tok/s ceilings from the missed experts alone (uniform routing, compute not modelled).
    A decode step's misses are read in place at in_place GB/s (None: in_place_gb_s(h2d_gb_s)), its
    split priced by split_decode with EAGER_LAYER_S a layer for the graph it loses."""
    out = []
    speed = (lambda T, sec: T / sec if sec > 0 else float("inf"))
    for name, T in PLAN_CASES:
        if T == 1:
            d = split_decode(args.num_experts_per_tok * (1.0 - decode_cached), num_layers, blob_bytes,
                             in_place_gb_s(h2d_gb_s) if in_place is None else in_place, host,
                             EAGER_LAYER_S * num_layers, share)
            out.append(PlanCase(name, T, d.layer, speed(1, d.bus_seconds),
                                speed(1, d.seconds if d.taken else d.bus_seconds), d))
            continue
        s = split_chunk(T, args.num_experts, args.num_experts_per_tok, prompt_cached,
                        blob_bytes, h2d_gb_s, host, share, stream_all_tokens(args))
        out.append(PlanCase(name, T, s, speed(T, num_layers * s.bus_seconds), speed(T, num_layers * s.seconds)))
    return out


def random_blob_rates(cpu_experts, layer: dict, D: int, top_k: int = 8) -> HostRates:
    """The host's rates through the engine's path (host_compute.measure_path) on an arena of random
    valid blocks of a layer's types and shapes (`plan` has sizes, not weights): a few distinct blobs
    repeated, each job's experts at their own addresses, the arena larger than the host's caches.
    The fixed costs the runner measures on its device (sync_s) and the GPU's resume stay estimates."""
    from concurrent.futures import ThreadPoolExecutor

    from ..quant.random import random_qtensor_bytes
    from .experts.host_compute import MEASURE_EXPERTS, MEASURE_REPEATS, ffn_sum, host_threads, measure_path
    rng = np.random.default_rng(0)
    parts, pieces, at = {}, [], 0
    for name in ("gate", "up", "down"):
        p = layer["parts"][name]
        b = np.frombuffer(random_qtensor_bytes(p["qtype"], tuple(p["shape"]), rng), np.uint8)
        parts[name] = {"qtype": p["qtype"], "shape": p["shape"], "offset": at, "nbytes": b.size}
        pieces.append(b)
        at += b.size
    blob = np.concatenate(pieces)
    n = MEASURE_EXPERTS * MEASURE_REPEATS       # every job's experts distinct: ~170 MB on the 30B shape
    arena = np.tile(blob, n)
    base = np.arange(n, dtype=np.int64) * blob.size
    if cpu_experts.threads() != host_threads():
        cpu_experts.set_threads(host_threads())
    picks = [(0, [r * MEASURE_EXPERTS + i for i in range(MEASURE_EXPERTS)]) for r in range(MEASURE_REPEATS)]
    with ThreadPoolExecutor(1) as worker:
        rates = measure_path(lambda layer, experts, x, ids, w, out: ffn_sum(cpu_experts.expert_ffn, arena, parts, base,
                                                                          D, experts, x, ids, w, out),
                             worker, picks, D, int(layer["blob_bytes"]),
                             f"measured now through the engine's path on random blocks ({cpu_experts.threads()} "
                             f"threads, {cpu_experts.simd()})")
    return replace(rates, fixed_source="the host round trip measured now; the device reads, choosing and "
                                       "the GPU's resume as estimated for the H200 machine")
