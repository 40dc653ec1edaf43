"""The GPU runner: every weight resident in VRAM, one sequence's f16 KV cache, the model on DeviceOps.

Same interface as strata.engine.runner.CpuRunner (reset, reusable_prefix, prefill, decode,
logits_all, status), plus measure_limits() for the bench. Correctness first: each step launches its
kernels one by one from Python and downloads the logits it returns.
"""
from __future__ import annotations

import numpy as np

from ..config import EngineConfig
from ..errors import DeviceError, InvalidArgument
from ..model.qwen3moe import Qwen3Moe

DEFAULT_PREFILL_CHUNK = 512
VRAM_RESERVE_BYTES = 1 << 30        # left free for the driver, other users and the launch overhead


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
        from ..backends.cuda_device_ops import DeviceOps

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

    def _budget(self, config: EngineConfig) -> int:
        free, _ = self.dev.memory_info()
        budget = max(0, free - VRAM_RESERVE_BYTES)
        if config.vram_budget_gib:
            budget = min(budget, int(config.vram_budget_gib * 2**30))
        return budget

    # ---- the runner interface ----------------------------------------------------------------
    def reset(self) -> None:
        self.cached_ids = []        # cells are rewritten before they are read again

    def reusable_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of ids already have K/V here (at least one token is always read)."""
        n = 0
        for a, b in zip(self.cached_ids, ids):
            if a != b:
                break
            n += 1
        return min(n, len(ids) - 1)

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
        logits = self._forward([token], len(self.cached_ids), last_only=False)
        self.cached_ids.append(token)
        return logits[-1]

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
        }

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
