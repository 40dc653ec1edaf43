"""The CPU/GPU split of a layer's missed experts (#18 item 3): of the experts a prompt chunk (or a
decode step) routes to that are not in VRAM, which go over the bus (copied, then computed by the
GPU) and which the host's cores compute where they lie in the pinned arena (strata._ext.cpu_experts).

Per layer, from measured rates (never touches a device, so it is tested on the CPU):
- the bus: each missed expert the GPU takes costs blob_bytes / h2d (the copies queue back to back;
  the GPU's GEMMs over a few rows hide behind them, at the device copy rate);
- the host: a fixed cost for each layer it takes part in (the routing and the layer's rows to the
  host, the combine waiting for its result), then per expert expert_s + row_s * rows (one pass
  unpacking the weights, then each token row), scaled by blob bytes, with the whole thread pool.
Both start once the routing is known and run at once, so the missed experts take max(bus, host).
The host takes the k experts with the fewest rows (its cheapest; the bus cost does not depend on
rows) for the k that minimises that max. With equal rows that is the share g / (c + g) of the seeds'
engine (g: an expert's bus time, c: its host time). k = 0 wherever the host's fixed cost or its
time per expert eats the gain, or auto's gain is under MIN_GAIN: many rows per expert (long chunks)
give the host nothing. A chunk routed on the device pays STREAM_ALL_SYNC_S more a layer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from ..errors import InvalidArgument
from .memory_model import stream_all_tokens

HOST_LAYER_S = 60e-6        # a layer the host takes part in: routing + rows down, a sync, the result read
# a chunk that streams every non-cached expert groups its routing on the device and the host queues
# layers ahead; a layer with host experts brings the routing down, so the GPU drains that queue
STREAM_ALL_SYNC_S = 300e-6
MIN_GAIN = 0.03             # auto splits a layer only when that saves at least this share of its time
RATE_UPDATE = 0.2           # weight of each new measurement in the running host rate
CPU_EXPERT_QTYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")     # what strata._ext.cpu_experts reads


@dataclass(frozen=True)
class HostRates:
    """The host's expert FFN time: expert_s + row_s * rows for an expert of blob_bytes (others scale
    by their bytes), plus layer_s once per layer it takes part in."""
    expert_s: float
    row_s: float
    blob_bytes: int
    source: str
    layer_s: float = HOST_LAYER_S

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
# (docs/PERF.md, "Experts on the host's cores"); used where nothing was measured (plan without a pack)
DEFAULT_HOST_RATES = HostRates(expert_s=0.29e-3 - 0.48e-3 / 7, row_s=0.48e-3 / 7, blob_bytes=3_060_000,
                               source="the H200 machine's 16 cores recorded in docs/PERF.md (not measured here)")


@dataclass(frozen=True)
class LayerSplit:
    """One layer's missed experts: `host` of them on the host (the indices into the rows given,
    `chosen`), the rest over the bus; predicted seconds with the split and all over the bus."""
    host: int
    bus: int
    seconds: float
    bus_seconds: float
    chosen: tuple = ()

    @property
    def speedup(self) -> float:
        return self.bus_seconds / self.seconds if self.seconds > 0 else 1.0


def split_layer(rows, blob_bytes: int, h2d_gb_s: float, host: HostRates, share: float | None = None) -> LayerSplit:
    """The split of one layer's missed experts with rows[i] token rows each (module doc). share:
    a forced host share of the experts (0..1; --cpu-experts SHARE), else the cheapest max."""
    rows = np.asarray(rows, np.int64)
    m = len(rows)
    bus_s = blob_bytes / (h2d_gb_s * 1e9)
    order = np.argsort(rows, kind="stable")
    prefix = np.concatenate([[0.0], np.cumsum(host.seconds(rows[order], blob_bytes))])
    k_all = np.arange(m + 1)
    cost = np.maximum((m - k_all) * bus_s, prefix + np.where(k_all > 0, host.layer_s, 0.0))
    if share is not None:
        k = min(m, int(round(share * m)))
    else:
        k = int(np.argmin(cost))            # the first minimum: ties keep the bus
        if cost[k] > (1.0 - MIN_GAIN) * cost[0]:
            k = 0                           # a gain inside the model's error is not worth the risk
    return LayerSplit(k, m - k, float(cost[k]), float(m * bus_s), tuple(sorted(order[:k].tolist())))


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
        host = replace(host, layer_s=host.layer_s + STREAM_ALL_SYNC_S)
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


def measure_host_rates(cpu_experts, parts: dict, blob: np.ndarray, D: int, I: int, repeats: int = 3) -> HostRates:
    """Time cpu_experts.expert_ffn on a real blob (its parts' offsets and types, pack.json's) for 1 and
    8 rows, the best of `repeats` each: a few ms on the H200's cores."""
    def views(p):
        return blob[parts[p]["offset"]:parts[p]["offset"] + parts[p]["nbytes"]]
    g, u, d = views("gate"), views("up"), views("down")
    rng = np.random.default_rng(0)
    best = {}
    for rows in (1, 8):
        x = rng.standard_normal((rows, D)).astype(np.float32)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            cpu_experts.expert_ffn(parts["gate"]["qtype"], g, parts["up"]["qtype"], u, parts["down"]["qtype"], d,
                                   D, I, x)
            times.append(time.perf_counter() - t0)
        best[rows] = min(times)
    row_s = max(0.0, (best[8] - best[1]) / 7)
    return HostRates(expert_s=max(1e-7, best[1] - row_s), row_s=max(1e-8, row_s), blob_bytes=int(blob.size),
                     source=f"measured at load ({cpu_experts.threads()} threads, {cpu_experts.simd()})")


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


def random_blob_rates(cpu_experts, layer: dict, D: int, repeats: int = 3) -> HostRates:
    """measure_host_rates on a blob of random valid blocks of a layer's types and shapes (`plan`
    has sizes, not weights)."""
    from ..quant.random import random_qtensor_bytes
    rng = np.random.default_rng(0)
    parts, pieces, at = {}, [], 0
    for name in ("gate", "up", "down"):
        p = layer["parts"][name]
        b = np.frombuffer(random_qtensor_bytes(p["qtype"], tuple(p["shape"]), rng), np.uint8)
        parts[name] = {"qtype": p["qtype"], "offset": at, "nbytes": b.size}
        pieces.append(b)
        at += b.size
    rates = measure_host_rates(cpu_experts, parts, np.concatenate(pieces), D,
                               int(layer["parts"]["gate"]["shape"][0]), repeats)
    return replace(rates, blob_bytes=int(layer["blob_bytes"]),
                   source=rates.source.replace("at load", "now on random blocks"))
