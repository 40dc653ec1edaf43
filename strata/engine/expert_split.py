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


def split_layer(rows, blob_bytes: int, h2d_gb_s: float, host: HostRates, share: float | None = None) -> LayerSplit:
    """The split of one layer's missed experts with rows[i] token rows each (module doc). share:
    a forced host share of the experts (0..1; --cpu-experts SHARE), else the cheapest split when
    its net gain clears gain_needed, else none."""
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
        k = best if m and cost[0] - cost[best] >= gain_needed(cost[0], fixed) else 0
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
    """What `plan` shows for one case: a layer's split and the bus-bound speeds without and with it."""
    name: str
    tokens: int
    split: LayerSplit
    bus_tok_s: float
    split_tok_s: float


def plan_cases(args, blob_bytes: int, num_layers: int, prompt_cached: float, decode_cached: float,
               h2d_gb_s: float, host: HostRates, share: float | None = None) -> list[PlanCase]:
    """The split of PLAN_CASES at the plan's cached shares (the prompt's kept slots, the decode
    cache), with tok/s ceilings from the missed experts alone (uniform routing, compute not modelled)."""
    out = []
    for name, T in PLAN_CASES:
        s = split_chunk(T, args.num_experts, args.num_experts_per_tok, decode_cached if T == 1 else prompt_cached,
                        blob_bytes, h2d_gb_s, host, share, stream_all_tokens(args))
        speed = (lambda sec: T / (num_layers * sec) if sec > 0 else float("inf"))
        out.append(PlanCase(name, T, s, speed(s.bus_seconds), speed(s.seconds)))
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
