"""The GPU runner: every weight resident in VRAM, one sequence's f16 KV cache, the model on DeviceOps.

Same interface as strata.engine.runner.CpuRunner (reset, reusable_prefix, prefill, decode,
logits_all, status), plus measure_limits() for the bench. Prompt chunks launch their kernels one by
one from Python. Decode steps read the token, position and KV length from a fixed device buffer
(one small host->device copy per step); with EngineConfig.cuda_graphs the first step of a shape
runs eagerly (loading kernels, growing the pool, measuring the step's memory), the second is
captured into a CUDA graph (strata.engine.cuda_graph) and every later step is one graph launch.
"""
from __future__ import annotations

import sys
import time
from collections import deque

import numpy as np

from ..backends.cuda_device import DeviceTensor
from ..config import EngineConfig
from ..errors import DeviceError, InvalidArgument
from ..model.qwen3moe import Qwen3Moe
from .runner import reusable_prefix

DEFAULT_PREFILL_CHUNK = 512
VRAM_RESERVE_BYTES = 1 << 30        # left free for the driver, other users and the launch overhead
STEP_MAX_TOKENS = 8                 # tokens of a decode step (the GEMV path's limit)
STEP_TIMES_KEPT = 4096              # decode steps whose host times status() summarizes


def prefill_chunk_of(setting: str) -> int:
    """EngineConfig.prefill -> tokens per prompt chunk ("auto" is 512 until the planner lands)."""
    if setting.isdigit():
        if int(setting) <= 0:
            raise InvalidArgument(f"prefill must be a positive number of tokens, got {setting!r}")
        return int(setting)
    if setting.startswith("auto:"):
        return max(1, min(DEFAULT_PREFILL_CHUNK, int(setting[5:])))
    return DEFAULT_PREFILL_CHUNK


class CudaRunner:
    device = "cuda"

    def __init__(self, pack, max_context: int, config: EngineConfig | None = None):
        from ..backends.cuda import _runtime
        from ..backends.cuda_device import DeviceKV, DeviceWeights
        from ..backends.cuda_device_ops import EMBED_QTYPES, DeviceOps

        config = config or EngineConfig(device="cuda")
        rt = self.rt = _runtime()
        self.args = a = pack.args
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk_of(config.prefill)
        self.dev = rt.Device(int(config.gpus.split(",")[0]))
        self.stream = rt.Stream(self.dev)
        self.vram_budget_bytes = self._budget(config)
        num_layers = a.num_hidden_layers + a.num_mtp_layers
        kv_bytes = 2 * num_layers * max_context * a.num_key_value_heads * a.head_dim * 2
        need = sum(int(pack.meta["files"][n]["bytes"]) for n in ("dense.bin", "experts.bin")) + kv_bytes
        if need > self.vram_budget_bytes:
            raise DeviceError(f"{pack.path}: every weight plus the KV cache needs {need / 2**30:.2f} GiB of VRAM, "
                              f"the budget is {self.vram_budget_bytes / 2**30:.2f} GiB (expert streaming is not "
                              f"built yet; lower max_context or use device='cpu')")
        self.weights = DeviceWeights(rt, self.dev, self.stream, pack)
        self.kv = DeviceKV(rt, self.dev, self.stream, num_layers, max_context, a.num_key_value_heads, a.head_dim)
        self.ops = DeviceOps(rt, self.dev, self.stream, self.weights, a)
        self.model = Qwen3Moe(a, self.ops)
        self.cached_ids: list[int] = []      # tokens whose K/V the cache holds, from position 0
        self.total_experts = num_layers * a.num_experts
        # Decode steps: [ids T | positions T | length] int32 on the device, staged in pinned memory.
        self.step_in = rt.DeviceBuffer(self.dev, 4 * (2 * STEP_MAX_TOKENS + 1))
        self._step_host = np.frombuffer(rt.HostBuffer(self.dev, self.step_in.nbytes), np.int32)
        self._logits_host = np.frombuffer(rt.HostBuffer(self.dev, 4 * STEP_MAX_TOKENS * a.vocab_size), np.float32)
        self.use_graphs = config.cuda_graphs
        self.graphs: dict = {}               # T -> DecodeGraph
        self.graph_error: str | None = None  # why graphs were turned off in this runner
        embd = self.weights.tensor("token_embd.weight").qtype
        self._ids_on_device = embd in EMBED_QTYPES      # else the embedding needs the ids on the host
        if not self._ids_on_device:
            self.use_graphs = False
            self.graph_error = f"token_embd.weight is {embd}: no embed kernel reads device-side ids"
        self._step_bytes: dict[int, int] = {}   # T -> pool bytes the eager step allocated (a graph's reserve)
        self.step_times = {m: deque(maxlen=STEP_TIMES_KEPT) for m in ("eager", "capture", "graph")}

    def _budget(self, config: EngineConfig) -> int:
        free, _ = self.dev.memory_info()
        budget = max(0, free - VRAM_RESERVE_BYTES)
        if config.vram_budget_gib:
            budget = min(budget, int(config.vram_budget_gib * 2**30))
        return budget

    # ---- the runner interface ----------------------------------------------------------------
    def reset(self) -> None:
        self.cached_ids = []        # cells are rewritten before they are read again; no address moves,
                                    # so captured graphs stay valid

    def drop_graphs(self) -> None:
        """Forget every captured decode graph (the next steps run eagerly, then capture again)."""
        self.stream.synchronize()   # no replay may still read the memory the graphs hold
        for graph in self.graphs.values():
            graph.destroy()
        self.graphs.clear()

    def reusable_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of ids already have K/V here (at least one token is always read)."""
        return reusable_prefix(self.cached_ids, ids)

    def _forward(self, ids: list[int], lo: int, last_only: bool) -> np.ndarray:
        """Logits of ids read at positions lo.. ([1, V] for the last token only, else [T, V])."""
        if lo + len(ids) > self.max_context:
            raise InvalidArgument(f"positions up to {lo + len(ids) - 1} do not fit the context of {self.max_context}")
        positions = np.arange(lo, lo + len(ids))
        rows = slice(-1, None) if last_only else None
        logits, _ = self.model.forward(np.asarray(ids, dtype=np.int64), positions, self.kv, logits_rows=rows)
        return self.ops.to_host(logits)

    def prefill(self, ids: list[int], start: int, on_progress=None) -> np.ndarray:
        """Read ids[start:] at positions start.. (K/V of ids[:start] must be cached); -> last logits [V]."""
        self.cached_ids = self.cached_ids[:start]
        logits = None
        for lo in range(start, len(ids), self.prefill_chunk):
            hi = min(len(ids), lo + self.prefill_chunk)
            logits = self._forward(ids[lo:hi], lo, last_only=True)
            self.cached_ids.extend(ids[lo:hi])
            if on_progress is not None:
                on_progress(hi - start, len(ids) - start)
        return logits[-1]

    def decode(self, token: int) -> np.ndarray:
        """Append one token at the next position; -> its logits [V]."""
        logits = self._decode_step([token], len(self.cached_ids))
        self.cached_ids.append(token)
        return logits[-1]

    def _decode_step(self, ids: list[int], lo: int) -> np.ndarray:
        """Logits [T, V] of ids at positions lo.. (T <= STEP_MAX_TOKENS): a graph replay where one is
        captured for T, else the model's launches from Python (capturing them on the second step)."""
        T = len(ids)
        if not self._ids_on_device:
            return self._forward(ids, lo, last_only=False)
        if lo + T > self.max_context:
            raise InvalidArgument(f"positions up to {lo + T - 1} do not fit the context of {self.max_context}")
        t0 = time.perf_counter()
        ids_dev, pos_dev = self._stage(ids, lo)
        graph = self._graph(T, ids_dev, pos_dev)
        mode = "eager" if graph is None else "graph" if graph.launches else "capture"
        if graph is not None:
            graph.launch(self.stream)
            if mode == "graph":         # a capture counted its step while the model ran
                self.ops.expert_uses += graph.expert_uses
            logits = graph.logits
        else:
            before = self.ops.pool.allocated_bytes
            logits, _ = self.model.forward(ids_dev, pos_dev, self.kv)
            self._step_bytes[T] = self.ops.pool.allocated_bytes - before
        t1 = time.perf_counter()
        out = self._download(logits)
        self.step_times[mode].append((t1 - t0, time.perf_counter() - t0))
        return out

    def _stage(self, ids: list[int], lo: int):
        """One host->device copy of [ids | positions | length] into step_in; -> (ids [T], positions [T + 1])."""
        T = len(ids)
        if not 1 <= T <= STEP_MAX_TOKENS:
            raise InvalidArgument(f"a decode step takes 1 to {STEP_MAX_TOKENS} tokens, got {T}")
        host = self._step_host[:2 * T + 1]
        host[:T] = ids
        host[T:] = range(lo, lo + T + 1)
        self.step_in.copy_from_host(host, self.stream)
        self.ops.bytes_h2d += host.nbytes
        buf = self.step_in
        return DeviceTensor(buf, 0, (T,), np.int32, buf), DeviceTensor(buf, 4 * T, (T + 1,), np.int32, buf)

    def _graph(self, T: int, ids_dev, pos_dev):
        """The graph to replay for a step of T tokens: captured now on the second step of that shape;
        None for an eager step (graphs off, first step, or a failed capture)."""
        if not self.use_graphs:
            return None
        graph = self.graphs.get(T)
        if graph is not None and not graph.valid_for(self.kv):
            self.drop_graphs()
            graph = None
        if graph is None and T in self._step_bytes:
            from ..backends.cuda import _graphs
            from .cuda_graph import capture_step
            try:
                graph = self.graphs[T] = capture_step(_graphs(), self, T, ids_dev, pos_dev, self._step_bytes[T])
            except (DeviceError, ImportError) as exc:
                self._graphs_off(f"{type(exc).__name__}: {exc}")
        return graph

    def _graphs_off(self, why: str) -> None:
        self.use_graphs, self.graph_error = False, why
        sys.stderr.write(f"strata: CUDA graph capture failed ({why}); decoding without graphs\n")

    def _download(self, logits) -> np.ndarray:
        """logits [T, V] through the pinned buffer, after the stream is done with them."""
        host = self._logits_host[:logits.size]
        logits.buf.copy_to_host(host, self.stream, logits.offset)
        self.stream.synchronize()
        return host.reshape(logits.shape).copy()

    def logits_all(self, ids: list[int]) -> np.ndarray:
        """Logits at every position of one prompt, read from position 0 [T, V]."""
        self.reset()
        out = []
        for lo in range(0, len(ids), self.prefill_chunk):
            hi = min(len(ids), lo + self.prefill_chunk)
            out.append(self._forward(ids[lo:hi], lo, last_only=False))
            self.cached_ids.extend(ids[lo:hi])
        return np.concatenate(out).astype(np.float32)

    def status(self) -> dict:
        w, ops = self.weights, self.ops
        dense, experts, prompt = w.dense.nbytes, w.experts.nbytes, ops.pool.capacity_bytes
        uses = ops.expert_uses
        return {
            "device": "cuda",
            "gpu": {"name": self.dev.name, "vram_budget_bytes": self.vram_budget_bytes,
                    "vram_used_bytes": dense + experts + self.kv.nbytes + prompt, "dense_bytes": dense,
                    "expert_cache_bytes": experts, "kv_bytes": self.kv.nbytes, "prompt_bytes": prompt},
            "prefill_chunk": self.prefill_chunk,
            "prefill_ring": 0,
            "expert_cache": {"slots": self.total_experts, "resident": self.total_experts,
                             "total_experts": self.total_experts, "hits": uses, "misses": 0,
                             "hit_rate": 1.0 if uses else 0.0},
            "bytes_h2d": w.bytes_h2d + ops.bytes_h2d,
            "decode": self.decode_status(),
        }

    def decode_status(self) -> dict:
        """Graphs on or off (and why), the graphs held, and host time per decode step by mode:
        submit = staging copy + launches queued; step = until the logits are on the host."""
        times = {}
        for mode, steps in self.step_times.items():
            if steps:
                a = np.asarray(steps) * 1e3
                times[mode] = {"steps": len(a), "host_submit_ms": float(np.median(a[:, 0])),
                               "host_step_ms": float(np.median(a[:, 1]))}
        return {"cuda_graphs": self.use_graphs, "graph_error": self.graph_error,
                "graphs": {T: {"nodes": g.num_nodes, "capture_ms": g.capture_ms, "pool_bytes": g.keep[0].capacity_bytes}
                           for T, g in self.graphs.items()},
                "host_ms": times}

    def measure_limits(self, nbytes: int = 1 << 30, repeats: int = 10) -> dict:
        """{"device_copy_gb_s": bytes read + written per second of a large device-to-device copy},
        timed with events (median of `repeats` after a warm-up), the ceiling resident decode is
        measured against."""
        free, _ = self.dev.memory_info()
        nbytes = max(1 << 24, min(nbytes, (free - VRAM_RESERVE_BYTES) // 2) // 4096 * 4096)
        src, dst = self.rt.DeviceBuffer(self.dev, nbytes), self.rt.DeviceBuffer(self.dev, nbytes)
        src.fill_bytes(0x3C, self.stream)
        start, end = self.rt.Event(self.dev, timing=True), self.rt.Event(self.dev, timing=True)
        times = []
        for i in range(repeats + 2):
            start.record(self.stream)
            self.ops._copy_rows(src.ptr, 0, dst.ptr, 1, nbytes // 4, 0, 0)
            end.record(self.stream)
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_ms(end))
        return {"device_copy_gb_s": 2 * nbytes / (float(np.median(times)) * 1e-3) / 1e9}
