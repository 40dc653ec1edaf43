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
import dataclasses
import weakref
from pathlib import Path

import numpy as np

from ..config import EngineConfig
from ..errors import InvalidArgument
from ..backends.cuda.memory import DeviceTensor
from ..model import build
from . import cuda_load
from .cuda_decode import DecodeSteps
from .cuda_prompt import PromptChunks
from .cuda_spec import CudaSpeculation, check_spec
from .memory_model import STEP_MAX_TOKENS, VRAM_RESERVE_BYTES
from .sampler import pick_host
from .slots import Slots, keep_bytes, reusable_prefix
from .speculate import Speculating

WARM_PROMPT_TOKENS = 19     # the warm-up's prompt: a short first chat turn


class CudaRunner(Speculating, CudaSpeculation, Slots):
    device = "cuda"

    def __init__(self, pack, max_context: int, config: EngineConfig | None = None,
                 stage: tuple[bool, bool] = (True, True)):
        """stage: (first, last) of a layer split's card (strata.engine.cuda_split): pack is then its
        StagePack, and the model takes its rows from the card before (first False) or hands them
        to the next (last False)."""
        from ..backends.cuda import _runtime
        from ..backends.cuda.kernels import KernelPaths
        from ..backends.cuda.memory import DeviceKV, DeviceWeights
        from ..backends.cuda.ops import DeviceOps
        from ..backends.cuda.ops_next import DeviceHybridCache, Qwen3NextDeviceOps

        config = config or EngineConfig(device="cuda")
        cuda_load.check_config(pack, config)
        paths = KernelPaths.without(config.kernels_off, config.kernels_on)
        cuda_load.check_trial_paths(paths, pack.args, pack.meta.get("dense"))
        self.hybrid = hybrid = pack.args.architecture == "qwen3next"
        rt = self.rt = _runtime()
        self.args = a = pack.args
        self.max_context = max_context
        self.dev = rt.Device(int(config.gpus.split(",")[0]))
        self.stream = rt.Stream(self.dev)
        self.vram_budget_bytes = cuda_load.vram_budget(self.dev, config)
        vram = cuda_load.vram_plan(rt, self.dev, self.stream, pack, config, self.vram_budget_bytes, max_context)
        self.plan, self.plan_bandwidths = vram.plan, vram.bandwidths
        self.prefill_chunk = self.plan.prefill_chunk
        num_layers = a.num_hidden_layers + a.num_mtp_layers
        self.profile_path = Path(config.expert_profile) if config.expert_profile else None
        self._profile = cuda_load.load_profile(self.profile_path, num_layers, a.num_experts)
        from .planner import kv_key, kv_on_host
        self.kv_on_host = kv_on_host(dataclasses.replace(config, max_context=max_context))
        self.kv_resident = config.kv_resident if self.kv_on_host else 0
        # the host KV is pinned before the expert arena, which takes what pinning is left
        kv_all = self._host_kv(rt, a, num_layers, max_context, config) if self.kv_on_host else None
        self.store = cuda_load.open_store(rt, self.dev, self.stream, pack, vram, config, self._profile)
        if self.profile_path is not None:     # at exit, or when the runner goes; holds no reference to it
            weakref.finalize(self, cuda_load.write_profile, self.profile_path, self.store.uses, self._profile)
        self.weights = DeviceWeights(rt, self.dev, self.stream, pack, self.store)
        self.kv_format = config.kv
        cuda_load.check_parallel(config, a)
        # every slot's cells in one cache (slot s from cell s * max_context): a batched step's rows name theirs
        if hybrid:      # K/V of the attention layers and the DeltaNet states (backends.cuda.ops_next)
            self.kv_all = DeviceHybridCache(rt, self.dev, self.stream, a, num_layers, max_context, config.kv,
                                            num_slots=config.parallel)
        else:
            ring = cuda_load.draft_ring(config, a, max_context)     # --draft-window: the draft layer's K/V ring
            self.kv_all = kv_all or DeviceKV(rt, self.dev, self.stream, num_layers, max_context,
                                             a.num_key_value_heads, a.head_dim, config.kv, num_slots=config.parallel,
                                             ring=ring)
        self.kv = self.kv_all.view(0)
        self.ops = (Qwen3NextDeviceOps if hybrid else DeviceOps)(rt, self.dev, self.stream, self.weights, a, paths)
        self.stage = stage
        self.model = build(a, self.ops, *stage)
        self.ops.preload_tma_gemm(self.weights.layers)
        if not stage[0]:        # a later card: a decode step's rows from the card before (ops.hand_in)
            self.ops.hand_buf = rt.DeviceBuffer(self.dev, 2 * STEP_MAX_TOKENS * a.hidden_size * 4)
        self.cached_ids: list[int] = []      # tokens whose K/V the cache holds, from position 0
        self.prompt_batches = self.batched_prompts = 0      # prefill_batch's forwards, and their prompts
        self.total_experts = num_layers * a.num_experts
        self.decode_misses, graph_error = cuda_load.decode_misses(self.store, config)
        self.store.host_experts = cuda_load.host_experts(rt, self.dev, self.stream, self.store, a, config, vram.bandwidths)
        self.steps = DecodeSteps(self.ops, self.model, self.store, self.weights, a,
                                 config.cuda_graphs and graph_error is None, graph_error)
        self.prompts = PromptChunks(self.ops, self.model, self.store, a, self.steps.plan, vram,
                                    kv_key(dataclasses.replace(config, max_context=max_context)), max_context)
        asked = config.spec if config.mtp else "0"
        # a layer split's cards before the last have no draft layer: the last one drafts (their plans
        # still price the verify windows' step graphs, from the config, and they verify too)
        spec = asked if stage[1] else "0"
        if spec != "0":
            check_spec(config, self.store, a)
        self._init_spec(spec, config.draft_window, config.draft_prompt)
        if hybrid and asked != "0":     # the DeltaNet states after each row of a verify window (rollback)
            from ..config import spec_max_drafts
            self.kv_all.keep_rows(spec_max_drafts(asked) + 1)
        self.mtp_room_min = config.mtp_room_min
        self.room_lent = False           # whether the last prompt borrowed the draft layer's experts
        # pick(): [T f32 | k i32 | p f32 | pad | u f64 | token i32], pinned; pick() waits for the
        # token's copy before it returns (the stream, or with a step behind it an event after that
        # copy), so its copies in and out are done before the next one writes
        self._pick_io = rt.DeviceBuffer(self.dev, 32)
        self._pick_host = np.frombuffer(rt.HostBuffer(self.dev, 32), np.uint8)
        # pick(step=True): recorded after the token's copy to the host, which the host waits for
        # instead of the stream (the step queued behind it runs on); steps_ahead counts those steps
        self._picked = rt.Event(self.dev)
        self.steps_ahead = 0
        self._last = None            # device logits [1, V] pick() reads, or None
        # strata.engine.slots; conversations kept in host RAM (a hybrid's with its DeltaNet states)
        self._init_slots(config.parallel, self.kv_all.view, keep_bytes(config))

    # the decode path's state, as the runner's (status, tests and tools read these)
    @property
    def graphs(self) -> dict:
        return self.steps.graphs

    @property
    def use_graphs(self) -> bool:
        return self.steps.use_graphs

    @use_graphs.setter
    def use_graphs(self, on: bool) -> None:      # off: captured graphs are kept, not launched
        self.steps.use_graphs = on

    @property
    def graph_error(self) -> str | None:
        return self.steps.graph_error

    @property
    def _step_bytes(self) -> dict:
        return self.steps.step_bytes

    def drop_graphs(self) -> None:
        """Forget every captured decode graph (the next steps run eagerly, then capture again)."""
        self.steps.drop_graphs()

    def save_profile(self) -> None:
        """Write the routing counts to --expert-profile (atomically), for a warm start next time."""
        if self.profile_path is not None:
            cuda_load.write_profile(self.profile_path, self.store.uses, self._profile)

    # ---- the runner interface ----------------------------------------------------------------
    def reset(self) -> None:
        self.cached_ids = []        # cells are rewritten before they are read again; no address moves,
                                    # so captured graphs stay valid
        if self.hybrid:             # the DeltaNet states are read as they are: zeroed, in place
            self.kv.reset_states()
            self.kv.snapshots = []
        if self.drafter:
            self.drafter.reset()

    @property
    def warm_prompt_tokens(self) -> int:
        """The warm-up prompt's tokens: a short chat turn's, or where tma-gemm runs the DQ_MIN_ROWS a
        dense projection needs to take it (its first launches and the pool's growth for its f16
        weights otherwise fall on the first such prompt: an H100 read a first 512-token prompt at
        7,654-7,966 tok/s, later ones at 13,193-14,054)."""
        from ..backends.cuda.moe import DQ_MIN_ROWS
        return max(WARM_PROMPT_TOKENS, DQ_MIN_ROWS) if self.ops.gemm_dq else WARM_PROMPT_TOKENS

    def warm_up(self, num_tokens: int | None = None, steps: int = 3) -> None:
        """Run what a first short chat turn runs, so that the first request pays none of its one-time
        costs: a prompt of num_tokens (default warm_prompt_tokens) through the prompt path (its kernels'
        first loads and launches, the pool it grows, the expert ring), `steps` decode steps (the eager one that measures the
        step, the CUDA graph's capture, a replay) and pick()'s sampling and greedy kernels; with
        experts streaming, the loan's size of every prompt length class is computed too.

        Nothing a request can observe stays: the KV cells it wrote get their bytes back, no prefix is
        cached, pick() has no logits, the expert cache holds the experts it held before (the slots
        the prompt lent and any admission are copied back: ExpertStore.restore), and the cache's
        counters, the routing profile, the policy's scores, the host->device byte counters and the
        decode timings read as they did. What stays is memory it allocated for good: the grown
        activation pool and the captured graph (status() lists both, as after any request)."""
        from ..config import SamplingParams
        self.warm_loans()
        n = max(1, min(num_tokens or self.warm_prompt_tokens, self.max_context - steps))
        short = WARM_PROMPT_TOKENS
        if not num_tokens and n > short and len(self._warm_drafts(n + steps)) < len(self._warm_drafts(short + steps)):
            n = short   # a context too short for both: the speculation windows' graphs first
        steps = max(0, min(steps, self.max_context - n))
        drafts = self._warm_drafts(n + steps)
        params = (SamplingParams(temperature=0.8, top_p=0.9, top_k=40), SamplingParams())
        with self.scratch(n + steps + _window_cells(drafts), drafts):
            self.prefill([t % self.args.vocab_size for t in range(n)], 0, logits=False)
            token = self.pick(params[0], 0.5)
            for i in range(steps):
                self.decode(token, logits=False)
                token = self.pick(params[(i + 1) % 2], 0.5)
            if drafts:
                self._warm_windows(token, drafts)

    def warm_loans(self) -> None:
        """The loan of every size class of a prompt, computed now (a host replay, memoized)."""
        for k in range(4, max(4, (self.prefill_chunk - 1).bit_length()) + 1):
            self.prompts.loan_pool_bytes(1 << k, self.prefill_chunk)

    @contextlib.contextmanager
    def scratch(self, cells: int, drafts: list[int] = ()):
        """Work inside leaves nothing a request can observe (warm_up's contract): the first `cells`
        KV cells get their bytes back, and the cached prefix, pick()'s logits, the expert cache and
        its counters, the routing profile, the byte counters, the decode timings, a hybrid's states
        and the drafter's state read as they did before."""
        saved_spec = ((self.drafter.done, self.drafter.pending, self.drafter.first_held, self.device_windows)
                      if drafts else None)
        saved_cells = self._save_cells(min(self.max_context, cells))
        ops, store = self.ops, self.store
        step_times = self.steps.step_times
        saved = (self.cached_ids, self._last, ops.expert_uses, ops.bytes_h2d,
                 {mode: list(times) for mode, times in step_times.items()}, store.snapshot())
        saved_states = ((self.kv.read_states(), list(self.kv.snapshots), dict(self.snapshot_rows)) if self.hybrid
                        else None)
        # the draft layer's prompt counters (status "draft") read as before
        saved_draft = (self.spec_stats.prompt_cells, self.spec_stats.prompt_ms, self.draft_chunks) if self.spec else None
        try:
            self.cached_ids = []
            yield
        finally:
            if drafts:
                self._restore_spec(*saved_spec)
            self.stream.synchronize()
            self._restore_cells(saved_cells)
            self.cached_ids, self._last, ops.expert_uses, ops.bytes_h2d, times, snapshot = saved
            for mode, steps_kept in step_times.items():
                steps_kept.clear()
                steps_kept.extend(times[mode])
            self.steps.forget_pending()
            store.restore(snapshot)
            if saved_states is not None:
                self.kv.write_states(saved_states[0])
                self.kv.snapshots, self.snapshot_rows = saved_states[1], saved_states[2]
            if saved_draft is not None:
                self.spec_stats.prompt_cells, self.spec_stats.prompt_ms, self.draft_chunks = saved_draft
            self.stream.synchronize()

    def _warm_drafts(self, length: int) -> list[int]:
        """The draft counts whose greedy window graphs warm_up captures (strata.engine.cuda_window):
        --spec N's, or every N --spec auto may choose, as far as the context holds three windows
        of each after `length` tokens (none without graphs: staged decode misses, or graphs off)."""
        if not self.spec or not self.steps.use_graphs:
            return []
        from ..config import spec_max_drafts
        out = []
        for d in range(1 if self.spec == "auto" else self.spec, spec_max_drafts(self.spec) + 1):
            if length + _window_cells(out + [d]) + 1 > self.max_context:
                break
            out.append(d)
        return out

    def _warm_windows(self, token: int, drafts: list[int]) -> None:
        """Greedy windows of each draft count until its graph is captured (the first may take the eager
        draft, the next runs eagerly through the window launches, the third captures)."""
        from ..config import SamplingParams
        from .speculate import SpecStats, speculative_step
        d = self.drafter
        greedy = SamplingParams()
        for n in drafts:
            for _ in range(3):
                if self.steps.captured(f"spec{n}"):
                    break
                token = speculative_step(self, d, SpecStats(), token, n, greedy, lambda: 0.5)[-1]

    def _restore_spec(self, done: int, pending, first_held: int, windows: int) -> None:
        """The drafter's state and the window counter as before the warm-up."""
        self.drafter.done, self.drafter.pending = done, pending
        self.drafter.first_held = first_held
        if getattr(self, "_windows", None) is not None:
            self._windows.windows = windows

    def _host_kv(self, rt, a, num_layers: int, max_context: int, config):
        """The KV in mapped pinned host memory (--kv-resident below the context), or a DeviceError
        saying how much could not be pinned."""
        from ..backends.cuda.memory import DeviceKV
        from ..errors import DeviceError
        try:
            return DeviceKV(rt, self.dev, self.stream, num_layers, max_context, a.num_key_value_heads, a.head_dim,
                            config.kv, num_slots=config.parallel, on_host=True,
                            vram_window=config.kv_resident)
        except DeviceError as exc:
            raise DeviceError(f"--kv-resident {config.kv_resident}: pinning the KV of {max_context} cells in host "
                              f"memory was refused ({exc}); a smaller --max-context or --kv format needs less") from None

    def _save_cells(self, cells: int):
        """(a device copy of cells 0..cells-1 of every layer's KV buffers (K and V, or the format's
        values and scales planes), [(address, bytes)] of each range), the copies queued on the
        stream; _restore_cells copies them back."""
        kv = self.kv
        ranges = [(ptr, min(cells, kv.layer_size(layer)) * cell) for layer in range(kv.num_layers)
                  for ptr, cell in kv.cell_ranges(layer)]
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

    def reusable_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of ids already have K/V here (at least one token is always read);
        a hybrid model resumes its DeltaNet states only from the live state or a snapshot taken at the
        end of a prompt (DeviceHybridCache, as the CPU's HybridCache)."""
        n = reusable_prefix(self.cached_ids, ids)
        if not self.hybrid:
            return self.drafter.reusable(self.cached_ids, ids, n) if self.drafter else self._bring_back(ids, n)
        n = self.kv.resumable(n, len(self.cached_ids))
        return self._hybrid_reusable(ids, n) if self.drafter else self._bring_back(ids, n)

    def _kv_ranges(self, n: int):
        """(buffer, byte offset, bytes) of cells 0..n-1 of this slot, per layer and plane."""
        kv = self.kv
        return [(buf, (layer * kv.layer_cells + kv.base) * cell, n * cell)
                for layer in range(kv.num_layers) for buf, cell in kv.buffers]

    def _cells_out(self, n: int):
        """(host copies of cells 0..n-1 of this slot's KV, their bytes) for a kept conversation; a
        hybrid's payload is (cells, the DeltaNet states now, the snapshots)."""
        out = []
        for buf, off, nbytes in self._kv_ranges(n):
            host = np.empty(nbytes, np.uint8)
            buf.copy_to_host(host, self.stream, off)
            out.append(host)
        self.stream.synchronize()
        nbytes = sum(h.nbytes for h in out)
        if not self.hybrid:
            return out, nbytes
        states, snapshots = self.kv.read_states(), list(self.kv.snapshots)   # never changed in place
        return (out, states, snapshots), nbytes + states.nbytes * (1 + len(snapshots))

    def _cells_in(self, payload, n: int) -> None:
        cells = payload[0] if self.hybrid else payload
        for (buf, off, _), host in zip(self._kv_ranges(n), cells):
            buf.copy_from_host(host, self.stream, off)
        if self.hybrid:
            self.kv.write_states(payload[1])
            self.kv.snapshots = list(payload[2])

    def _copy_cells(self, slot: int, n: int) -> None:
        """Cells 0..n-1 of every layer of slot `slot` copied into the slot in use, on the stream (a
        later step or chunk of this slot is queued behind the copies)."""
        src, dst = self.kv_all.view(slot), self.kv
        for layer in range(dst.num_layers):
            for (a, cell), (b, _) in zip(src.cell_ranges(layer), dst.cell_ranges(layer)):
                self.rt.copy_d2d(b, a, min(n, dst.layer_size(layer)) * cell, self.stream)

    def _kept_resumable(self, payload, kept_len: int, n: int) -> int:
        if not self.hybrid or n >= kept_len:
            return n
        return max([m for m, _ in payload[2] if m <= n], default=0)

    @property
    def interleaves(self) -> bool:
        """Whether a prompt read under one loan may pause between chunks while other slots decode:
        only with every expert resident (a streamed one lends cache slots and the pool, which their
        steps need). Streamed, prefill_steps pauses too where other slots may run: it then takes a
        loan per chunk and gives it back before each pause."""
        return self.store.resident

    def prefill(self, ids: list[int], start: int, on_progress=None, logits: bool = True) -> np.ndarray | None:
        """Read ids[start:] at positions start.. (K/V of ids[:start] must be cached); -> last logits [V]
        (None without `logits`: they stay on the device for pick())."""
        steps = self.prefill_steps(ids, start, on_progress, logits)
        for _ in steps:
            pass
        return steps.out[-1] if logits else None

    def prefill_steps(self, ids: list[int], start: int, on_progress=None, logits: bool = False):
        """prefill() as an iterator that pauses between chunks where `interleaves`, or streamed with
        more than one slot (each chunk then under its own loan, not while seed 001's room is lent);
        else it reads the whole prompt at its first next(). Meanwhile the caller may step other
        slots, then use() this slot again; the last logits stay on the device for pick(). The host
        logits of the last chunk (logits=True) are .out of the iterator once it ends."""
        return _PrefillSteps(self._prefill_chunks(ids, start, on_progress, logits))

    def _prefill_chunks(self, ids: list[int], start: int, on_progress, logits: bool):
        self._keep_tail(start)                               # (a hybrid's live states with it)
        if self.hybrid:
            self.kv.rewind(start, len(self.cached_ids))      # start came from reusable_prefix
        self.cached_ids = self.cached_ids[:start]
        if start and getattr(self.kv, "vram_window", 0):    # the reused cells' newest into the VRAM window
            for dst, src, nbytes in self.kv.vram_refill(start):
                self.rt.copy_d2d(dst, src, nbytes, self.stream)
        if self.drafter:
            self._truncate_drafter(start)
            self.draft_chunks = []
        out = None
        # seed 001: a request reading at least --mtp-room-min tokens lends the draft layer's cached
        # experts to the prompt's ring (its prompt pass writes the draft layer's K/V alone)
        # (not with --draft-prompt own: the drafter's own pass reads those experts during the prompt)
        room = self.room_lent = (self.drafter is not None and self.draft_prompt != "own"
                                 and 0 <= self.mtp_room_min <= len(ids) - start
                                 and self.store.open_room())
        # Streamed, with other slots to serve, each chunk takes its own loan and gives it back before
        # the pause, so their decode steps run on the whole cache and pool meanwhile; not with the
        # room lent (their drafters read the draft layer's experts).
        pause = self.interleaves or (self.num_slots > 1 and not room)
        per_chunk = pause and not self.store.resident
        tokens = len(ids) - start
        try:
            with contextlib.nullcontext() if per_chunk else self.prompts.loan(tokens, self.prefill_chunk):
                for lo in range(start, len(ids), self.prefill_chunk):
                    hi = min(len(ids), lo + self.prefill_chunk)
                    with self.prompts.loan(tokens, self.prefill_chunk) if per_chunk else contextlib.nullcontext():
                        out = self.prompts.forward(ids[lo:hi], lo, self.kv, last_only=True,
                                                   download=logits or hi < len(ids), hidden=self.drafter is not None)
                        self._last = self.prompts.last_row
                        self.cached_ids.extend(ids[lo:hi])
                        if self.drafter:             # the draft layer's K/V of this chunk, batched
                            self.drafter.extend(self.prompts.hidden)
                            self.prompts.hidden = None
                            self._flush_drafter()
                    if on_progress is not None:
                        on_progress(hi - start, len(ids) - start)
                    if pause and hi < len(ids):
                        yield None
        finally:
            if room:
                self.store.close_room()         # back before the first decode step reads them
        if self.hybrid:
            self.kv.snapshot(len(ids))                      # a follow-up turn resumes from here
            if self.drafter:
                self._snapshot_row(len(ids))
        return out

    def prompt_batchable(self, ids: list[int], start: int) -> bool:
        """Whether this prompt (ids[start:] to read) may be read in one forward with other slots'
        (prefill_batch): more than a decode step's tokens and at most prompt_batch_tokens, the cache
        in VRAM (any --kv format), a whole model on this card, no host share of the missed experts
        (--cpu-experts: its GEMMs' sums depend on the rows beside), and no draft layer or DeltaNet
        states (whose prompt passes are their own). Streamed experts are read once for the whole
        forward, under one loan."""
        return (self.num_slots > 1 and STEP_MAX_TOKENS < len(ids) - start <= self.prompt_batch_tokens
                and self.store.host_experts is None and not self.hybrid and self.drafter is None
                and not self.kv_on_host and self.stage == (True, True))

    @property
    def prompt_batch_tokens(self) -> int:
        """The most tokens prefill_batch reads in one forward: a prompt chunk's, streamed half of it
        (its loan is sized for twice the tokens)."""
        return self.prefill_chunk if self.store.resident else self.prefill_chunk // 2

    def prefill_batch(self, jobs: list[tuple[int, list[int], int]]) -> None:
        """Several slots' prompts in one forward: jobs [(slot, ids, start)], each slot's ids[start:] read
        at positions start.. (its cells of ids[:start] cached, as its reusable_prefix left them), each
        weight and expert read once for all of them; each slot's last logits stay on the device for its
        pick(). A prompt's cells and logits are those prefill() gives it alone: every op of the forward
        is row-invariant, each prompt attends in the launch it makes alone (memory.PromptSegments), and
        its last row takes the head's row-invariant GEMV."""
        slots = [slot for slot, _, _ in jobs]
        if len(set(slots)) != len(slots):
            raise InvalidArgument(f"prefill_batch: slots {slots} repeat")
        for slot, ids, start in jobs:           # every refusal before any slot changes
            if not self.prompt_batchable(ids, start):
                raise InvalidArgument(f"prefill_batch: slot {slot}'s prompt of {len(ids) - start} tokens to read "
                                      f"is not one this runner reads with others (prompt_batchable)")
        tokens = sum(len(ids) - start for _, ids, start in jobs)
        if tokens > self.prompt_batch_tokens:
            raise InvalidArgument(f"prefill_batch: {tokens} tokens in one forward; it takes {self.prompt_batch_tokens}")
        segments = []
        for slot, ids, start in jobs:
            self.use(slot)
            self._keep_tail(start)
            self.cached_ids = self.cached_ids[:start]
            segments.append((ids[start:], start, slot * self.max_context, self.kv))
        V = self.args.vocab_size
        rows = self._slot_logits()
        # streamed, the loan's pool is sized for twice the tokens: the forward's inputs name each row's
        # cell and each prompt's positions too (a few bytes a token the one-prompt pool has no room for)
        with self.prompts.loan(tokens if self.store.resident else 2 * tokens, self.prefill_chunk):
            logits = self.prompts.forward_segments(segments, self.kv_all)
            for row, slot in enumerate(slots):       # out of the loan's memory before it goes back
                self.rt.copy_d2d(rows.ptr + slot * V * 4, logits.ptr + row * V * 4, V * 4, self.stream)
        for slot, ids, start in jobs:
            self.use(slot)
            self.cached_ids.extend(ids[start:])
            self._last = DeviceTensor(rows, slot * V * 4, (1, V), np.float32, None)
        self.prompt_batches += 1
        self.batched_prompts += len(jobs)

    def decode(self, token: int, logits: bool = True) -> np.ndarray | None:
        """Append one token at the next position; -> its logits [V] (None without `logits`: they
        stay on the device for pick())."""
        lo = len(self.cached_ids)
        if lo + 1 > self.max_context:
            raise InvalidArgument(f"positions up to {lo} do not fit the context of {self.max_context}")
        out, self._last = self.steps.step([token], lo, self.kv, download=logits)
        self.cached_ids.append(token)
        self._drafter_steps(self.steps.hidden)
        return out[-1] if logits else None

    def use(self, slot: int) -> None:
        """Slots.use; a hybrid model's DeltaNet states follow the slot (DeviceHybridCache.swap)."""
        if self.hybrid and slot != self.slot and 0 <= slot < self.num_slots:
            self.kv_all.swap(self.slot, slot)
        super().use(slot)

    def decode_batch(self, slots: list[int], tokens: list[int]) -> None:
        """One batched decode step: token i appended to slot slots[i]'s sequence, every row in one
        launch of each kernel (a graph per row count) over the whole cache, each row naming its
        slot's cells (memory.StepRows); row i's logits stay on the device for that slot's pick().
        Each row computes what that slot's own one-row step does (row-invariant kernels).

        A hybrid model's rows also name their slots' DeltaNet states: row i's states address (the
        states buffer for the slot in use, its home for any other: DeviceHybridCache.slot_states_ptr)
        goes with the step's inputs, and the DeltaNet layers launch the row kernels over them
        (ops_next.HybridRows), each row the one-row kernels' arithmetic. No states move, and the slot
        in use stays in use (no swap). Where that path is off (_rows_batched), the slots step in turn."""
        if len(set(slots)) != len(slots):
            raise InvalidArgument(f"decode_batch: slots {slots} repeat")
        if self.hybrid and not self._rows_batched():
            self._decode_in_turn(slots, tokens)
            return
        positions = [len(self.slot_ids(s)) for s in slots]
        if max(positions) + 1 > self.max_context:
            raise InvalidArgument(f"positions up to {max(positions)} do not fit the context of {self.max_context}")
        logits = self.batch_rows(slots, tokens, positions)
        V = self.args.vocab_size
        for row, (slot, token) in enumerate(zip(slots, tokens)):
            last = DeviceTensor(logits.buf, logits.offset + row * V * 4, (1, V), np.float32, logits)
            if self.hybrid:         # no use(): that would move states the rows left where they are
                self._append_to(slot, token, last)
                continue
            self.use(slot)
            self.cached_ids.append(token)
            self._last = last
        if self.drafter is not None:     # drafting slots' plain steps (a constrained request's, say)
            self._extend_drafters(slots, self.ops.to_host(self.steps.hidden))

    def batch_rows(self, slots: list[int], tokens: list[int], positions: list[int]):
        """decode_batch's step: row i is token i at positions[i] of slot slots[i]'s cells (and, in
        a hybrid, its states) -> the rows' logits [T, V] on the device (a layer split's card before
        the last: its normed rows; steps.hidden has the rows' output). Nobody's state changes here."""
        bases = [s * self.max_context for s in slots]
        if self.hybrid:
            if getattr(self, "_rows_kv", None) is None:      # one object: the rows graphs are valid for it
                self._rows_kv = self.kv_all.rows_view(self.steps.row_states_ptr)
            states = [self.kv_all.slot_states_ptr(s, self.slot) for s in slots]
            return self.steps.step_rows(list(tokens), positions, bases, self._rows_kv, download=False,
                                        row_states=states)[1]
        return self.steps.step_rows(list(tokens), positions, bases, self.kv_all, download=False)[1]

    def _rows_batched(self) -> bool:
        """Whether a hybrid model's slots step as one batched step (decode_batch): not with
        speculation (its verify windows keep one sequence's states row by row), a draft layer, or
        the KV on the host (--kv-resident), which step the slots in turn."""
        return self.num_slots > 1 and not self.spec and self.drafter is None and not self.kv_on_host

    def _decode_in_turn(self, slots: list[int], tokens: list[int]) -> None:
        """decode_batch of a hybrid model where _rows_batched says no: one step per slot, each slot's
        logits copied aside (the next slot's step writes the same output), so every slot's pick()
        reads its own."""
        V = self.args.vocab_size
        rows = self._slot_logits()
        for slot, token in zip(slots, tokens):
            self.use(slot)
            self.decode(token, logits=False)
            self.rt.copy_d2d(rows.ptr + slot * V * 4, self._last.ptr, V * 4, self.stream)
            self._last = DeviceTensor(rows, slot * V * 4, (1, V), np.float32, None)

    def _slot_logits(self):
        """A logits row per slot, for the slots' picks after steps that leave their logits elsewhere
        (a hybrid's slots in turn, prompts read together)."""
        if getattr(self, "_turn_logits", None) is None:
            self._turn_logits = self.rt.DeviceBuffer(self.dev, self.num_slots * self.args.vocab_size * 4)
        return self._turn_logits

    def pick(self, params, u: float, mask=None, host=None, step: bool = False, feed: int | None = None) -> int:
        """The next token from the last prefill's or decode's logits, chosen on the device (greedy:
        cuda/argmax.cu; else cuda/sample.cu with the draw u): 4 bytes come back, not the logits.
        mask: an allowed-token bitmask (strata.engine.grammar), uploaded and applied to the device
        logits first (cuda/mask_logits.cu). host: row -> row, a request's adjustment of the logits
        (strata.engine.logits): the row then comes to the host and is picked there.

        step: then decode the token too, as decode(token, logits=False) right after would (the same
        cells, the same logits for the next pick). Where the runner can (_steps_ahead), that step is
        queued behind the pick before the host has the token, its id copied on the device from the
        pick's output, so the device computes it while the host takes the token and goes round its
        loop; else the step follows the pick as decode() would run it. feed: the id that step decodes
        instead of the picked one (a random-weight model's bench feeds random ids)."""
        from ..backends.cuda.sample import launch_shape
        if self._last is None:
            raise InvalidArgument("pick() needs the logits of a prefill or decode first")
        if host is not None:
            last = self._last if isinstance(self._last, DeviceTensor) else \
                DeviceTensor(self._last, 0, (self.args.vocab_size,), np.float32, None)   # a prompt's last_row
            row = host(self.ops.to_host(last).reshape(-1))            # to_host waits for the stream
            token = pick_host(row, params, u, mask)
            self.steps.picked()
            if step:
                self.decode(token if feed is None else feed, logits=False)
            return token
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
        if step and self._steps_ahead():
            self._picked.record(self.stream)
            timing = self.steps.take_timing()
            _, self._last = self.steps.step([0 if feed is None else feed], len(self.cached_ids), self.kv,
                                            download=False, ids_from=io.ptr + 24 if feed is None else None)
            self._picked.synchronize()          # the token is on the host; the step it feeds runs on
            self.steps.end_timing(timing)
            token = int(self._pick_host[24:28].view(np.int32)[0])
            self.cached_ids.append(token if feed is None else feed)
            self.steps_ahead += 1
            return token
        self.stream.synchronize()
        self.steps.picked()
        token = int(self._pick_host[24:28].view(np.int32)[0])
        if step:
            self.decode(token if feed is None else feed, logits=False)
        return token

    def _steps_ahead(self) -> bool:
        """Whether pick(step=True) may queue the step before the host has the token: nothing the host
        does between a pick and the next step may depend on the token or see a step it did not ask
        for. So: one slot (no other sequence's step can come between and take the step's logits
        buffer), no staged decode (its steps read each layer's routing on the host), no host split of
        the experts, no drafter (it takes each step's hidden rows on the host), no DeltaNet states
        (changed in place), no K/V window in VRAM (a ring whose refills the host drives), and a position
        left in the context. Streamed experts may: the step's routing log is read when the step after
        it is queued (DecodeSteps._route_copy, as for steps queued without a pick between), and its
        admissions are queued behind that step, so the copy stream fills a victim's slot only once
        the step queued before has run (experts/admissions.py's `ready` event); each admission lands
        a step later than in order."""
        return (self.num_slots == 1 and not self.store.staged_decode and self.steps.split_plan is None
                and self.drafter is None and not self.hybrid and not getattr(self.kv, "vram_window", 0)
                and len(self.cached_ids) < self.max_context)

    def _mask_logits(self, ptr: int, mask) -> None:
        """Set the logits row at ptr to -inf where the bitmask [ceil(V / 32)] int32 is 0, in place (the
        row is the last step's output, rewritten by the next one)."""
        V = self.args.vocab_size
        words = (V + 31) // 32
        mask = np.asarray(mask)
        if mask.shape != (words,) or mask.dtype.itemsize != 4:
            raise InvalidArgument(f"pick(): the token mask must be {words} 32-bit words for V = {V}, got "
                                  f"{mask.shape} {mask.dtype}")
        # pinned, rewritten by the next pick only: this one synchronizes once the mask has been read
        if getattr(self, "_mask_dev", None) is None:      # the first constrained pick: 4 bytes per 32 tokens
            self._mask_dev = self.rt.DeviceBuffer(self.dev, 4 * words)
            self._mask_host = np.frombuffer(self.rt.HostBuffer(self.dev, 4 * words), np.int32)
        self._mask_host[:] = mask.view(np.int32)
        self._mask_dev.copy_from_host(self._mask_host, self.stream)
        self.ops.launch("mask_logits", ((V + 255) // 256, 1, 1), (ptr, self._mask_dev.ptr, V))

    def logits_all(self, ids: list[int]) -> np.ndarray:
        """Logits at every position of one prompt, read from position 0 [T, V]."""
        return np.concatenate([logits for _, logits in self.logits_chunks(ids)]).astype(np.float32)

    def logits_chunks(self, ids: list[int], chunk: int | None = None):
        """(lo, logits [T, V] of ids[lo:lo + T]) for one prompt read from position 0 in chunks of
        `chunk` tokens (default the prefill chunk), each chunk's logits downloaded; the last row
        stays for pick()."""
        self.reset()
        chunk = min(chunk or self.prefill_chunk, self.prefill_chunk)
        with self.prompts.loan(len(ids), chunk, pool=False):
            for lo in range(0, len(ids), chunk):
                hi = min(len(ids), lo + chunk)
                logits = self.prompts.forward(ids[lo:hi], lo, self.kv, last_only=False)
                self._last = self.prompts.last_row
                self.cached_ids.extend(ids[lo:hi])
                yield lo, logits

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
                    "vram_used_bytes": dense + cache + ring + self.kv.vram_bytes + prompt, "dense_bytes": dense,
                    "expert_cache_bytes": cache, "ring_bytes": ring, "kv_bytes": self.kv.vram_bytes,
                    "prompt_bytes": prompt},
            "prefill_chunk": self.prefill_chunk,
            "prefill_ring": store.ring_slots,
            "prefill_kept": self.plan.prompt_cache_slots,
            "prefill_rule": self.plan.prefill_rule,
            "expert_cache": cache_status,
            "bytes_h2d": w.bytes_h2d + ops.bytes_h2d + store.upload_bytes + store.stats.bytes_h2d,
            "decode": self.decode_status(),
            "kv": self.kv_status(),
            "parallel": self.num_slots, "kept_conversations": self.kept.status(),
            "prompt_batches": {"forwards": self.prompt_batches, "prompts": self.batched_prompts},
            "spec": self.spec,
            "speculation": ({**self.spec_stats.to_dict(), "auto": self.spec_auto.to_dict() if self.spec_auto else None,
                             "device_windows": self.device_windows, "room_lent": self.room_lent,
                             "room_lends": store.stats.room_lends}
                            if self.spec else None),
            # the drafter's K/V: --draft-window's ring (window 0: the whole context) and prompt pass
            "draft": {**self.draft_status(), "kv_bytes": self.kv_all.layer_size(self.kv_all.num_layers - 1)
                      * self.kv_all.cell_bytes} if self.spec and not self.hybrid else None,
        }

    def kv_status(self) -> dict:
        """The KV format, cells a layer keeps in VRAM and on the host (every slot's), and the KV bytes
        the next decoded token reads over the bus: with --kv-resident every cell is on the host and
        the newest N also in the VRAM window, so decode reads the cells older than the window in
        place: (length + 1 - N, at least 0) x bytes per cell x layers."""
        kv = self.kv_all
        if not self.kv_on_host:
            return {"format": self.kv_format, "cells_vram": self.max_context * self.num_slots, "cells_host": 0,
                    "bus_bytes_per_token": 0}
        cells = min(len(self.cached_ids) + 1, self.max_context)
        return {"format": self.kv_format, "cells_vram": kv.vram_window * self.num_slots,
                "cells_host": self.max_context * self.num_slots,
                "bus_bytes_per_token": kv.vram_from(cells) * kv.cell_bytes * kv.num_layers,
                "resident_limit": self.kv_resident, "vram_bytes": kv.vram_bytes, "host_bytes": kv.host_bytes,
                "staged_bytes": self.ops.bytes_staged_kv}

    def decode_status(self) -> dict:
        """Graphs on or off (and why), the graphs held, and host time per decode step by mode:
        submit = staging copy + launches queued; step = until the logits (or, for a step that
        keeps them on the device, pick()'s token) are on the host; steps_ahead: the steps queued behind
        their picks (pick(step=True))."""
        return {**self.steps.status(), "steps_ahead": self.steps_ahead}

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


def _window_cells(drafts: list[int]) -> int:
    """Cells the warm-up's windows may write past its prompt and steps: three windows of d + 1 rows
    for each draft count d (CudaRunner._warm_windows)."""
    return sum(3 * (d + 1) for d in drafts)


class _PrefillSteps:
    """The iterator of CudaRunner.prefill_steps: the chunks' steps, then .out (the last chunk's host
    logits, or None)."""

    def __init__(self, chunks):
        self._chunks, self.out = chunks, None

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._chunks)
        except StopIteration as end:
            self.out = end.value
            raise
