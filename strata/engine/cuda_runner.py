"""The GPU runner: the dense weights and one sequence's KV cache (in the --kv format) in VRAM, the
routed experts where the VRAM plan puts them, the model on DeviceOps.

Same interface as strata.engine.runner.CpuRunner (reset, reusable_prefix, prefill, decode, pick,
logits_all, status, warm_up), plus measure_limits() for the bench. pick() chooses the next token
on the device from logits that stayed there (prefill/decode with logits=False): 4 bytes come back.
The plan (strata.engine.planner) comes from the pack's sizes and the VRAM budget: when every expert fits, experts.bin is uploaded whole;
otherwise the experts stay in pinned host memory with a VRAM cache of the plan's slots and a
streamed prompt ring (strata.engine.experts.store), and prompts are read in the plan's chunks.
Where the system refuses or EngineConfig.pin_limit_gib limits pinning, part of experts.bin stays
unpinned: decode misses are then staged (routing read on the host per layer) and graphs are off.
Prompt chunks launch their kernels one by one from Python. Decode steps read the token, position
and KV length from a fixed device buffer (one small host->device copy per step); with
EngineConfig.cuda_graphs the first step of a shape runs eagerly (loading kernels, growing the pool,
measuring the step's memory), the second is captured into a CUDA graph (strata.engine.graphs)
and every later step is one graph launch. warm_up() (the server calls it at start) runs a short
prompt and those first steps on scratch state, so the first request finds the kernels loaded and
the graph captured. When experts stream, a step also writes its routing to a fixed log that comes
back with the logits, for the cache's admissions.
"""
from __future__ import annotations

import contextlib
import sys
import time
import weakref
from collections import deque
from pathlib import Path

import numpy as np

from ..backends.cuda.memory import DeviceTensor
from ..config import EngineConfig
from ..errors import DeviceError, InvalidArgument, UnsupportedError
from ..model.qwen3moe import Qwen3Moe
from . import memory_model
from .memory_model import STEP_MAX_TOKENS, VRAM_RESERVE_BYTES
from .kv_choice import GPU_KV_FORMATS
from .runner import reusable_prefix

STEP_TIMES_KEPT = 4096              # decode steps whose host times status() summarizes


def _last_row_of(logits: DeviceTensor) -> DeviceTensor:
    """The last row [1, V] of device logits [T, V], a view that keeps their memory alive."""
    T, V = logits.shape
    return DeviceTensor(logits.buf, logits.offset + (T - 1) * V * 4, (1, V), np.float32, logits)


PLAN_MEASURE_BYTES = 32 << 20      # the copy rates the plan's predicted speeds use, measured at load (a few ms)


def _write_profile(path: Path, uses: np.ndarray, base: np.ndarray | None) -> None:
    """Routing counts since load (plus the profile the run started from) to path, atomically."""
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, uses + (0 if base is None else base))
    tmp.replace(path)


class CudaRunner:
    device = "cuda"

    def __init__(self, pack, max_context: int, config: EngineConfig | None = None):
        if pack.args.architecture != "qwen3moe":
            raise UnsupportedError(f"{pack.args.architecture} runs on the CPU backend only so far (--device cpu)")
        from ..backends.cuda import _runtime
        from ..backends.cuda.kernels import KernelPaths
        from ..backends.cuda.memory import DeviceKV, DeviceWeights
        from ..backends.cuda.ops import GEMV_MAX_T, DeviceOps
        from .experts.bus_cap import BusCap
        from .experts.store import ExpertStore

        config = config or EngineConfig(device="cuda")
        if config.kv not in GPU_KV_FORMATS:
            raise InvalidArgument(f"--kv {config.kv}: the GPU runs {', '.join(GPU_KV_FORMATS)}")
        if config.kv != "f16":              # cuda/kv_quant.cu's kernels and the format's blocks
            from ..backends.cuda.kernels import ATTENTION_HEAD_DIMS
            from ..quant import kv as kv_formats
            if pack.args.head_dim not in ATTENTION_HEAD_DIMS:
                raise UnsupportedError(f"--kv {config.kv}: the GPU's quantized KV kernels take head dims "
                                       f"{ATTENTION_HEAD_DIMS}, this model's is {pack.args.head_dim} (--kv f16 runs it)")
            for codec in kv_formats.codecs(config.kv):
                codec.check(pack.args.head_dim)
        if config.spec != "0":
            raise InvalidArgument(f"--spec {config.spec}: speculative decoding runs on the CPU only so far "
                                  f"(--device cpu); the GPU's verify window is not built")
        rt = self.rt = _runtime()
        self.args = a = pack.args
        self.max_context = max_context
        self.dev = rt.Device(int(config.gpus.split(",")[0]))
        self.stream = rt.Stream(self.dev)
        self.vram_budget_bytes = self._budget(config)
        self.plan = self._plan(pack, config, max_context)
        self.prefill_chunk = self.plan.prefill_chunk
        num_layers = a.num_hidden_layers + a.num_mtp_layers
        resident = self.plan.cache_slots >= self.plan.total_experts and self.plan.prefill_ring == 0
        self.profile_path = Path(config.expert_profile) if config.expert_profile else None
        profile = self._profile = self._load_profile(num_layers, a.num_experts)
        self.store = ExpertStore(rt, self.dev, self.stream, pack,
                                 cache_slots=None if resident else self.plan.cache_slots,
                                 ring_slots=0 if resident else self.plan.prefill_ring,
                                 policy=config.expert_policy, profile=profile,
                                 kept_slots=None if resident else self.plan.prompt_cache_slots,
                                 pool_bytes=self.plan.bytes_needed,
                                 pin_limit_bytes=int(config.pin_limit_gib * 2**30),
                                 bus_cap=None if resident or not config.pcie_gbs else
                                 BusCap(rt, self.dev, config.pcie_gbs, self._measured_h2d_gb_s))
        if self.profile_path is not None:     # at exit, or when the runner goes; holds no reference to it
            weakref.finalize(self, _write_profile, self.profile_path, self.store.uses, self._profile)
        self.weights = DeviceWeights(rt, self.dev, self.stream, pack, self.store)
        self.kv_format = config.kv
        self.kv = DeviceKV(rt, self.dev, self.stream, num_layers, max_context, a.num_key_value_heads, a.head_dim,
                           config.kv)
        self.ops = DeviceOps(rt, self.dev, self.stream, self.weights, a, KernelPaths.without(config.kernels_off))
        if not self.store.resident:
            # one row per main layer: a decode step runs those (an MTP layer only under speculation,
            # which reads no row here; the rows past them would be whatever the memory held)
            self.route_log = rt.DeviceBuffer(self.dev, num_layers * GEMV_MAX_T * a.num_experts_per_tok * 4)
            self.route_log.fill_bytes(0, self.stream)
            self._route_host = np.frombuffer(rt.HostBuffer(self.dev, self.route_log.nbytes), np.int32).reshape(
                num_layers, GEMV_MAX_T * a.num_experts_per_tok)
            self.ops.route_log = self.route_log
        self.model = Qwen3Moe(a, self.ops)
        self.cached_ids: list[int] = []      # tokens whose K/V the cache holds, from position 0
        self.total_experts = num_layers * a.num_experts
        # Decode steps: [ids T | positions T | length] int32 on the device, staged in pinned memory.
        self.step_in = rt.DeviceBuffer(self.dev, 4 * (2 * STEP_MAX_TOKENS + 1))
        self._step_host = np.frombuffer(rt.HostBuffer(self.dev, self.step_in.nbytes), np.int32)
        self._logits_host = np.frombuffer(rt.HostBuffer(self.dev, 4 * STEP_MAX_TOKENS * a.vocab_size), np.float32)
        # pick(): the last logits row a prefill left, and [T f32 | k i32 | p f32 | pad | u f64 | token i32]
        self._last_row = rt.DeviceBuffer(self.dev, 4 * a.vocab_size)
        self._pick_io = rt.DeviceBuffer(self.dev, 32)
        self._pick_host = np.frombuffer(rt.HostBuffer(self.dev, 32), np.uint8)
        self._last = None            # device logits [1, V] pick() reads, or None
        self._route_pending = 0      # tokens of a step whose routing log is on its way to the host
        self._step_timing = None     # (mode, start, submit seconds) of a step whose pick() is to come
        self.use_graphs = config.cuda_graphs
        self.graphs: dict = {}               # T -> DecodeGraph
        self.graph_error: str | None = None  # why graphs were turned off in this runner
        if config.decode_misses == "staged" and not self.store.resident:
            self.store.staged_decode = True
            self.use_graphs = False
            self.graph_error = "--decode-misses staged reads each layer's routing on the host"
        elif not self.store.pinned.all():     # unpinned experts cannot be read in place: stage them
            self.store.staged_decode, self.store.stage_pinned_misses = True, False
            self.use_graphs = False
            self.graph_error = (f"{self.store.pinned_bytes / self.store.file_bytes:.0%} of experts.bin is pinned "
                                f"({self.store.pin_reason}): decode misses of the rest are staged, each "
                                f"layer's routing read on the host")
        staged = self.store.staged_decode
        self.decode_misses = "resident" if self.store.resident else "staged" if staged else config.decode_misses
        self._step_bytes: dict[int, int] = {}   # T -> pool bytes the eager step allocated (a graph's reserve)
        self.step_times = {m: deque(maxlen=STEP_TIMES_KEPT) for m in ("eager", "capture", "graph")}

    def _plan(self, pack, config: EngineConfig, max_context: int):
        """The VRAM plan for this pack and budget (InvalidArgument naming the bytes needed when the
        budget is too small)."""
        import dataclasses

        from ..backends.cuda.bandwidth import copy_rates
        from .planner import Bandwidths, PackSizes, kv_cells, make_plan
        sizes = PackSizes.from_meta(pack.meta, int(pack.meta["files"]["dense.bin"]["bytes"]))
        cfg = dataclasses.replace(config, max_context=max_context)
        self._sizes, self._cells = sizes, kv_cells(cfg)      # for the loan of each prompt (_loan_pool_bytes)
        h2d, d2d = copy_rates(self.rt, self.dev, self.stream, PLAN_MEASURE_BYTES, repeats=3)
        self._measured_h2d_gb_s = h2d
        if config.pcie_gbs:
            h2d = min(h2d, config.pcie_gbs)          # what the plan's predicted speeds see
        self.plan_bandwidths = Bandwidths(h2d, d2d, f"measured at load on {self.dev.name}")
        return make_plan(sizes, cfg, self.vram_budget_bytes, "runner", self.plan_bandwidths,
                         self.dev.multiprocessor_count)

    def _load_profile(self, num_layers: int, num_experts: int):
        path = self.profile_path
        if path is None or not path.exists():
            return None
        try:
            profile = np.load(path)
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"{path}: not a routing profile ({exc})") from None
        if profile.shape != (num_layers, num_experts):
            raise InvalidArgument(f"{path}: routing profile of shape {profile.shape}, this model has "
                                  f"{(num_layers, num_experts)} (layers, experts)")
        return profile

    def save_profile(self) -> None:
        """Write the routing counts to --expert-profile (atomically), for a warm start next time."""
        if self.profile_path is not None:
            _write_profile(self.profile_path, self.store.uses, self._profile)

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

    def warm_up(self, num_tokens: int = 19, steps: int = 3) -> None:
        """Run what a first short chat turn runs, so that the first request pays none of its one-time
        costs: a prompt of num_tokens through the prompt path (its kernels' first loads and launches,
        the pool it grows, the expert ring), `steps` decode steps (the eager one that measures the
        step, the CUDA graph's capture, a replay) and pick()'s sampling and greedy kernels; with
        experts streaming, the loan's size of every prompt length class is computed too.

        Nothing a request can observe stays: the KV cells it wrote get their bytes back, no prefix is
        cached, pick() has no logits, the expert cache holds the experts it held before (the slots
        the prompt lent and any admission are copied back: ExpertStore.restore), and the cache's
        counters, the routing profile, the policy's scores, the host->device byte counters and the
        decode timings read as they did. What stays is memory it allocated for good: the grown
        activation pool and the captured graph (status() lists both, as after any request)."""
        from ..config import SamplingParams
        for k in range(4, max(4, (self.prefill_chunk - 1).bit_length()) + 1):
            self._loan_pool_bytes(1 << k)       # every size class of a prompt's loan (a host replay, memoized)
        n = max(1, min(num_tokens, self.max_context - steps))
        steps = max(0, min(steps, self.max_context - n))
        saved_cells = self._save_cells(n + steps)
        ops, store = self.ops, self.store
        saved = (self.cached_ids, self._last, ops.expert_uses, ops.bytes_h2d,
                 {mode: list(times) for mode, times in self.step_times.items()}, store.snapshot())
        params = (SamplingParams(temperature=0.8, top_p=0.9, top_k=40), SamplingParams())
        try:
            self.cached_ids = []
            self.prefill([t % self.args.vocab_size for t in range(n)], 0, logits=False)
            token = self.pick(params[0], 0.5)
            for i in range(steps):
                self.decode(token, logits=False)
                token = self.pick(params[(i + 1) % 2], 0.5)
        finally:
            self.stream.synchronize()
            self._restore_cells(saved_cells)
            self.cached_ids, self._last, ops.expert_uses, ops.bytes_h2d, times, snapshot = saved
            for mode, steps_kept in self.step_times.items():
                steps_kept.clear()
                steps_kept.extend(times[mode])
            self._route_pending, self._step_timing = 0, None
            store.restore(snapshot)
            self.stream.synchronize()

    def _save_cells(self, cells: int):
        """(a device copy of cells 0..cells-1 of every layer's KV buffers (K and V, or the format's
        values and scales planes), [(address, bytes)] of each range), the copies queued on the
        stream; _restore_cells copies them back."""
        ranges = [(ptr, cells * cell) for layer in range(self.kv.num_layers) for ptr, cell in self.kv.cell_ranges(layer)]
        copy = self.rt.DeviceBuffer(self.dev, sum(n for _, n in ranges))
        off = 0
        for ptr, n in ranges:
            self.rt.copy_d2d(copy.ptr + off, ptr, n, self.stream)
            off += n
        return copy, ranges

    def _restore_cells(self, saved) -> None:
        copy, ranges = saved
        off = 0
        for ptr, n in ranges:
            self.rt.copy_d2d(ptr, copy.ptr + off, n, self.stream)
            off += n

    def drop_graphs(self) -> None:
        """Forget every captured decode graph (the next steps run eagerly, then capture again)."""
        self.stream.synchronize()   # no replay may still read the memory the graphs hold
        for graph in self.graphs.values():
            graph.destroy()
        self.graphs.clear()

    def reusable_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of ids already have K/V here (at least one token is always read)."""
        return reusable_prefix(self.cached_ids, ids)

    def _forward(self, ids: list[int], lo: int, last_only: bool, download: bool = True) -> np.ndarray | None:
        """Logits of ids read at positions lo.. ([1, V] for the last token only, else [T, V]); without
        `download` the last row is copied to the runner's own buffer for pick() instead."""
        if lo + len(ids) > self.max_context:
            raise InvalidArgument(f"positions up to {lo + len(ids) - 1} do not fit the context of {self.max_context}")
        positions = np.arange(lo, lo + len(ids))
        rows = slice(-1, None) if last_only else None
        if len(ids) > STEP_MAX_TOKENS:
            self.store.prompt_begin(len(ids), memory_model.stream_all_tokens(self.args), self.args.num_hidden_layers)
        logits, _ = self.model.forward(np.asarray(ids, dtype=np.int64), positions, self.kv, logits_rows=rows)
        # pick() reads the last row from the runner's own buffer: a chunk's memory may be lent back
        # to the expert cache before then
        V = self.args.vocab_size
        self.ops._copy_rows(logits.ptr + (logits.shape[0] - 1) * V * 4, 0, self._last_row.ptr, 1, V, 0, 0)
        self._last = self._last_row
        return self.ops.to_host(logits) if download else None

    def prefill(self, ids: list[int], start: int, on_progress=None, logits: bool = True) -> np.ndarray | None:
        """Read ids[start:] at positions start.. (K/V of ids[:start] must be cached); -> last logits [V]
        (None without `logits`: they stay on the device for pick())."""
        self.cached_ids = self.cached_ids[:start]
        out = None
        with self._loan(len(ids) - start):
            for lo in range(start, len(ids), self.prefill_chunk):
                hi = min(len(ids), lo + self.prefill_chunk)
                out = self._forward(ids[lo:hi], lo, last_only=True, download=logits or hi < len(ids))
                self.cached_ids.extend(ids[lo:hi])
                if on_progress is not None:
                    on_progress(hi - start, len(ids) - start)
        return out[-1] if logits else None

    @contextlib.contextmanager
    def _loan(self, tokens: int, pool: bool = True):
        """While a prompt of more than a decode step's tokens runs, the cache's tail slots are lent
        to the ring and (pool) the activation pool (ExpertStore.lend), and given back after it.
        logits_all keeps its own pool: every row's logits are more than the plan's loan holds."""
        from ..backends.cuda.memory import Pool
        region = self.store.lend(self._loan_pool_bytes(tokens) if pool else 0) if tokens > STEP_MAX_TOKENS else None
        saved = self.ops.pool
        if region is not None and pool:
            pool = Pool(self.rt, self.dev)
            pool.segments.append(region)
            pool.free.append([[0, region.nbytes]])
            pool.frozen = True
            self.ops.pool = pool
        try:
            yield
        finally:
            self.ops.pool = saved
            self.ops._pos_host = self.ops._pos_dev = None    # it lived in the loan
            if self.store.lent:
                self.store.give_back()

    def _loan_pool_bytes(self, tokens: int) -> int:
        """The pool a prompt of `tokens` tokens needs: bytes_needed of its largest chunk (the plan's
        chunk, or the prompt rounded up to a power of two, so few sizes are ever computed;
        bytes_needed is monotone), so a short prompt leaves more of the cache in place."""
        from .planner import bytes_needed
        if self.store.resident:
            return 0
        T = min(self.prefill_chunk, 1 << max(4, (tokens - 1).bit_length()))
        return bytes_needed(self._sizes, T, self._cells, self.dev.multiprocessor_count, self.kv_format)

    def decode(self, token: int, logits: bool = True) -> np.ndarray | None:
        """Append one token at the next position; -> its logits [V] (None without `logits`: they
        stay on the device for pick())."""
        out = self._decode_step([token], len(self.cached_ids), download=logits)
        self.cached_ids.append(token)
        return out[-1] if logits else None

    def pick(self, params, u: float, mask=None) -> int:
        """The next token from the last prefill's or decode's logits, chosen on the device (greedy:
        cuda/argmax.cu; else cuda/sample.cu with the draw u): 4 bytes come back, not the logits.
        mask: an allowed-token bitmask (strata.engine.grammar), uploaded and applied to the device
        logits first (cuda/mask_logits.cu)."""
        from ..backends.cuda.sample import launch_shape
        if self._last is None:
            raise InvalidArgument("pick() needs the logits of a prefill or decode first")
        V, ptr, io = self.args.vocab_size, self._last.ptr, self._pick_io
        if mask is not None:
            self._mask_logits(ptr, mask)
        if params.temperature == 0.0:
            self.ops.launch("argmax", 1, (ptr, io.ptr + 24, V))
        else:
            h = self._pick_host
            h[:4].view(np.float32)[0], h[4:8].view(np.int32)[0] = params.temperature, params.top_k
            h[8:12].view(np.float32)[0], h[16:24].view(np.float64)[0] = params.top_p, u
            io.copy_from_host(h[:24], self.stream)
            self.ops.launch("sample", launch_shape(1)[0],
                            (ptr, io.ptr, io.ptr + 4, io.ptr + 8, io.ptr + 16, io.ptr + 24, 0, V))
        io.copy_to_host(self._pick_host[24:28], self.stream, 24)
        self.stream.synchronize()
        if self._step_timing is not None:
            mode, t0, submit = self._step_timing
            self.step_times[mode].append((submit, time.perf_counter() - t0))
            self._step_timing = None
        self._after_route()
        return int(self._pick_host[24:28].view(np.int32)[0])

    def _mask_logits(self, ptr: int, mask) -> None:
        """Set the logits row at ptr to -inf where the bitmask [ceil(V / 32)] int32 is 0, in place (the
        row is the last step's output, rewritten by the next one)."""
        V = self.args.vocab_size
        words = (V + 31) // 32
        mask = np.asarray(mask)
        if mask.shape != (words,) or mask.dtype.itemsize != 4:
            raise InvalidArgument(f"pick(): the token mask must be {words} 32-bit words for V = {V}, got "
                                  f"{mask.shape} {mask.dtype}")
        if getattr(self, "_mask_dev", None) is None:      # the first constrained pick: 4 bytes per 32 tokens
            self._mask_dev = self.rt.DeviceBuffer(self.dev, 4 * words)
            self._mask_host = np.frombuffer(self.rt.HostBuffer(self.dev, 4 * words), np.int32)
        self._mask_host[:] = mask.view(np.int32)
        self._mask_dev.copy_from_host(self._mask_host, self.stream)
        self.ops.launch("mask_logits", ((V + 255) // 256, 1, 1), (ptr, self._mask_dev.ptr, V))

    def _decode_step(self, ids: list[int], lo: int, download: bool = True) -> np.ndarray | None:
        """Logits [T, V] of ids at positions lo.. (T <= STEP_MAX_TOKENS): a graph replay where one is
        captured for T, else the model's launches from Python (capturing them on the second step).
        Without `download` they stay on the device (the last row for pick())."""
        T = len(ids)
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
        if download:
            out = self._download(logits)
            self.step_times[mode].append((t1 - t0, time.perf_counter() - t0))
        else:                   # the step's host time ends when pick() has the token
            out, self._last = None, _last_row_of(logits)
            self._route_copy(T)
            self._step_timing = (mode, t0, t1 - t0)
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
            from .graphs import capture_step
            try:
                graph = self.graphs[T] = capture_step(_graphs(), self, T, ids_dev, pos_dev, self._step_bytes[T])
            except (DeviceError, ImportError) as exc:
                self._graphs_off(f"{type(exc).__name__}: {exc}")
        return graph

    def _graphs_off(self, why: str) -> None:
        self.use_graphs, self.graph_error = False, why
        sys.stderr.write(f"strata: CUDA graph capture failed ({why}); decoding without graphs\n")

    def _download(self, logits) -> np.ndarray:
        """logits [T, V] through the pinned buffer, after the stream is done with them; with experts
        streaming, the step's routing comes along for the cache."""
        host = self._logits_host[:logits.size]
        logits.buf.copy_to_host(host, self.stream, logits.offset)
        self._route_copy(logits.shape[0])
        self.stream.synchronize()
        self._after_route()
        self._last = _last_row_of(logits)
        return host.reshape(logits.shape).copy()

    def _route_copy(self, T: int) -> None:
        """Queue the step's routing log to the host (experts streaming); _after_route() reads it
        once the stream has been synchronized."""
        if self.ops.route_log is not None:
            self.route_log.copy_to_host(self._route_host, self.stream)
            self._route_pending = T

    def _after_route(self) -> None:
        if self._route_pending:
            self.store.after_step(self._route_host[:self.args.num_hidden_layers,
                                                   :self._route_pending * self.args.num_experts_per_tok])
            self._route_pending = 0

    def logits_all(self, ids: list[int]) -> np.ndarray:
        """Logits at every position of one prompt, read from position 0 [T, V]."""
        self.reset()
        out = []
        with self._loan(len(ids), pool=False):
            for lo in range(0, len(ids), self.prefill_chunk):
                hi = min(len(ids), lo + self.prefill_chunk)
                out.append(self._forward(ids[lo:hi], lo, last_only=False))
                self.cached_ids.extend(ids[lo:hi])
        return np.concatenate(out).astype(np.float32)

    def status(self) -> dict:
        w, ops, store = self.weights, self.ops, self.store
        dense, prompt = w.dense.nbytes, ops.pool.capacity_bytes
        cache = store.resident_buf.nbytes if store.resident else store.slots.nbytes
        ring = 0 if store.resident else store.ring.nbytes
        cache_status = store.status()
        if store.resident:      # every routed expert is a hit; the ops count them, graphs included
            cache_status.update(hits=ops.expert_uses, misses=0, hit_rate=1.0 if ops.expert_uses else 0.0)
        return {
            "device": "cuda",
            "gpu": {"name": self.dev.name, "vram_budget_bytes": self.vram_budget_bytes,
                    "vram_used_bytes": dense + cache + ring + self.kv.nbytes + prompt, "dense_bytes": dense,
                    "expert_cache_bytes": cache, "ring_bytes": ring, "kv_bytes": self.kv.nbytes,
                    "prompt_bytes": prompt},
            "prefill_chunk": self.prefill_chunk,
            "prefill_ring": store.ring_slots,
            "expert_cache": cache_status,
            "bytes_h2d": w.bytes_h2d + ops.bytes_h2d + store.upload_bytes + store.stats.bytes_h2d,
            "decode": self.decode_status(),
            # every cell in VRAM for the whole context (no --kv-resident yet): none on the host or the bus
            "kv": {"format": self.kv_format, "cells_vram": self.max_context, "cells_host": 0, "bus_bytes_per_token": 0},
        }

    def decode_status(self) -> dict:
        """Graphs on or off (and why), the graphs held, and host time per decode step by mode:
        submit = staging copy + launches queued; step = until the logits (or, for a step that
        keeps them on the device, pick()'s token) are on the host."""
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
        """{"device_copy_gb_s": bytes read + written per second of a large device-to-device copy (the
        ceiling resident decode is measured against), "h2d_gb_s": pinned host -> device copy (what
        streamed experts are measured against)}: strata.backends.cuda.bandwidth, over buffers as
        large as the free VRAM allows up to nbytes."""
        from ..backends.cuda.bandwidth import copy_rates
        free, _ = self.dev.memory_info()
        nbytes = max(1 << 24, min(nbytes, (free - VRAM_RESERVE_BYTES) // 2) // 4096 * 4096)
        h2d, d2d = copy_rates(self.rt, self.dev, self.stream, nbytes, repeats, warm=2)
        return {"device_copy_gb_s": d2d, "h2d_gb_s": h2d}

    def vram_used_bytes(self) -> int:
        """VRAM in use on the device now (every process), for the bench's peak."""
        free, total = self.dev.memory_info()
        return total - free
