"""The GPU runner's side of MTP speculation (strata.engine.speculate): verify windows, the draft
layer and rollback, for the CudaRunner mixin Speculating drives.

A verify window of N + 1 <= 8 tokens is a decode step of N + 1 rows, one CUDA graph per row count.
Every op of a step of up to 8 rows is row-invariant on the GPU (the GEMVs' strata_gemv_rows_*,
gemv3_rows, split-K decode attention over one sequence's cells, moe_decode, per-row norms and
routing), so each row's logits are bit for bit those of the one-token step that would compute them
alone, and greedy decoding with speculation emits exactly the tokens of greedy decoding without.

Greedy windows run as one CUDA graph per draft count (spec_window, strata.engine.cuda_window): the
draft layer over the pending rows, the chained drafts, the verify window and every row's argmax on
the device, one staging copy in, the ids and hidden rows back. Where that does not apply (the first
window after more pending rows than the window has) greedy windows take verify_next / mtp_next:
each row's argmax is taken on the device and only the token ids come back, and a chained draft's
hidden state stays on the device. Sampled windows take the draft layer's logits and the window's
logits to the host (mtp / verify), where the acceptance rule needs the distributions.
Rejected cells need no rollback on the device: a cell past the sequence's length is never read (the
split-K kernels read lengths from the positions) and is written again before it is.

Under a VRAM budget the draft layer's experts stay cached for good (ExpertStore's fixed layers,
the plan's "mtp" bytes); a verify window's routing goes to the cache's admissions like a decode
step's (its N + 1 rows). The draft layer's prompt cells (and a long catch-up's) take mtp_cells: its
K/V alone, no attention, routed expert or head, so a prompt reads none of its experts. Every KV
format works: the quantized split-K decode attention and appends are row-invariant too.
Refused at load in one line: staged decode misses (no graphs).

Qwen3-Next: a window's DeltaNet states cannot be rewound like cells, so the cache keeps them
(DeviceHybridCache.keep_rows, [1 + rows, states bytes]): verify copies the states before the window
into row 0, the ops copy each layer's states after row t into row 1 + t as the window's rows run
through the one-token DeltaNet kernels (ops_next), and forget copies the last accepted row's back
(one device copy of the states). Its windows run eagerly (verify_next / mtp_next) or as the T-row
decode step's graph; spec_window's one-graph windows stay qwen3moe's.
"""
from __future__ import annotations

import numpy as np

from ..backends.cuda.memory import DeviceTensor, StepRows
from ..errors import InvalidArgument
from .cuda_decode import row_lengths
from .memory_model import STEP_MAX_TOKENS, stream_all_tokens


def check_spec(config, store, args) -> None:
    """InvalidArgument where the GPU's speculation is not built yet."""
    if args.architecture not in ("qwen3moe", "qwen3next"):
        raise InvalidArgument(f"--spec: speculation on {args.architecture} is not built yet")
    if args.architecture == "qwen3next" and config.draft_window:
        raise InvalidArgument(f"--draft-window {config.draft_window}: the draft layer's K/V ring of qwen3next on the "
                              "GPU is not built yet (its attention cells are DeviceHybridCache's; 0 runs it)")
    if store.staged_decode:
        raise InvalidArgument("--spec on the GPU needs decode misses read in place (zero-copy): staged misses "
                              "(--decode-misses staged, or part of experts.bin unpinned) read each layer's "
                              "routing on the host, so a verify window could not be one graph")


class CudaSpeculation:
    """verify / mtp / forget for strata.engine.speculate, and the hidden states the drafter reads."""

    def verify(self, ids: list[int], start: int):
        """The main model over ids at start.. as one step of len(ids) rows -> (logits [T, V],
        hidden [T, D]) on the host."""
        if start + len(ids) > self.max_context:
            raise InvalidArgument(f"positions up to {start + len(ids) - 1} do not fit the context of {self.max_context}")
        self._window_begin(start)
        out, self._last = self.steps.step(list(ids), start, self.kv, download=True)
        return out, self.ops.to_host(self.steps.hidden)

    def mtp(self, hidden, next_ids, positions, logits_rows=slice(None)):
        """The draft layer over main hidden states [T, D] at positions with the tokens after them
        -> (logits [rows, V] or None, the layer's output [T, D]) on the host."""
        ops = self.ops
        T = len(next_ids)
        h = ops.upload(np.ascontiguousarray(hidden, np.float32))
        pos = self._draft_rows(positions)
        with self.steps.rows_of(row_lengths(positions)):
            logits, out = self.model.mtp_step(h, np.asarray(next_ids, np.int64), pos, self.kv,
                                              logits_rows=logits_rows, plan=self._mtp_plan(T))
        return (None if logits is None else ops.to_host(logits)), ops.to_host(out)

    def mtp_cells(self, hidden, next_ids, positions) -> None:
        """The draft layer's K/V cells of these rows (a prompt chunk's, a long catch-up's), bit for bit
        mtp()'s, without its attention, routed experts or head: no expert plan, no ring, and inside a
        prompt's loan less memory than the main chunk took. Outside a loan with experts streaming, in
        pieces of a step's rows (the decode pool is priced for steps)."""
        ops = self.ops
        T = len(next_ids)
        piece = STEP_MAX_TOKENS if not (self.store.resident or self.store.lent) else max(T, 1)
        for lo in range(0, T, piece):
            hi = min(T, lo + piece)
            self.model.mtp_cells(ops.upload(np.ascontiguousarray(hidden[lo:hi], np.float32)),
                                 np.asarray(next_ids[lo:hi], np.int64), self._draft_rows(positions[lo:hi]), self.kv)

    def _draft_rows(self, positions):
        """The draft layer's rows at these positions on the device: the positions as every op takes
        them (upload_positions), or with a K/V ring (--draft-window) a StepRows whose cells are the
        positions modulo the ring (lengths position + 1, the sequence's first cell 0)."""
        p = np.asarray(positions, np.int64).reshape(-1)
        if not self.draft_slots:
            return self.ops.upload_positions(p)
        from .cuda_decode import stage_rows
        T = len(p)
        host = np.empty(4 * T + 1, np.int32)
        stage_rows(host, 0, T + 1, 2 * T + 1, 3 * T + 1, p, 0, self.draft_slots)
        t = self.ops.upload(host)
        at = t.buf.ptr + t.offset
        return StepRows(t.buf, t.offset, T, t.keep, at + 4 * (T + 1), at + 4 * (2 * T + 1), at + 4 * (3 * T + 1), 1)

    def _mtp_plan(self, T: int):
        """The draft layer's plan over T rows: a step's, or a chunk plan of that layer alone (inside a
        prompt's loan when experts stream: its experts are cached for good, so nothing streams)."""
        if T <= STEP_MAX_TOKENS:
            return self.steps.plan
        L = self.args.num_hidden_layers
        return self.store.chunk_plan(T, stream_all_tokens(self.args), range(L, L + self.args.num_mtp_layers))

    def verify_next(self, ids: list[int], start: int):
        """verify() for greedy windows -> (each row's argmax [T] ints, hidden [T, D] on the host):
        the argmaxes taken on the device, the logits left there."""
        from .cuda_decode import last_row_of
        T = len(ids)
        if start + T > self.max_context:
            raise InvalidArgument(f"positions up to {start + T - 1} do not fit the context of {self.max_context}")
        kv = self.kv
        self._window_begin(start)
        _, logits = self.steps.step_rows(list(ids), list(range(start, start + T)), [kv.base] * T, kv.whole,
                                         download=False)
        self._last = last_row_of(logits)
        picks = self._argmax_rows(logits)
        self.steps.picked()                 # the stream is synchronized: the step's routing to the cache
        return picks, self.ops.to_host(self.steps.hidden)

    def mtp_next(self, hidden, next_ids, positions):
        """The draft layer as mtp(), greedy -> (the argmax of its last row, the layer's output of that
        row [1, D] on the device: the next chained draft's input). hidden: host [T, D] or a device
        tensor (a chained draft's)."""
        ops = self.ops
        T = len(next_ids)
        h = hidden if isinstance(hidden, DeviceTensor) else ops.upload(np.ascontiguousarray(hidden, np.float32))
        pos = self._draft_rows(positions)
        with self.steps.rows_of(row_lengths(positions)):
            logits, out = self.model.mtp_step(h, np.asarray(next_ids, np.int64), pos, self.kv,
                                              logits_rows=slice(-1, None), plan=self._mtp_plan(T))
        D = out.shape[1]
        last = DeviceTensor(out.buf, out.offset + (T - 1) * D * 4, (1, D), np.float32, out)
        return int(self._argmax_rows(logits)[0]), last

    def spec_window(self, drafter, token: int, n: int):
        """A greedy window of n drafts after token as one CUDA graph (strata.engine.cuda_window) ->
        (drafts, the verify rows' argmaxes, their hidden states on the host), or None where that
        path does not apply (the drafter's pending rows are more than n + 1: the eager way)."""
        if self.hybrid:         # the window graphs are qwen3moe's: a hybrid's windows run eagerly
            return None
        P = 0 if drafter.pending is None else drafter.pending.shape[0]
        if getattr(self, "_windows", None) is None:
            from .cuda_window import SpecWindows
            self._windows = SpecWindows(self)
        if not self._windows.applies(P, n):
            return None
        return self._windows.run(drafter, token, n)

    @property
    def device_windows(self) -> int:
        """Greedy windows that ran as the device's window launches (graph or its first eager run)."""
        return self._windows.windows if getattr(self, "_windows", None) is not None else 0

    def _argmax_rows(self, logits) -> list[int]:
        """Each row's argmax of device logits [T, V], taken on the device (cuda/argmax.cu) -> T ints."""
        T, V = logits.shape
        if getattr(self, "_picks_dev", None) is None:
            self._picks_dev = self.rt.DeviceBuffer(self.dev, 4 * STEP_MAX_TOKENS)
            self._picks_host = np.frombuffer(self.rt.HostBuffer(self.dev, 4 * STEP_MAX_TOKENS), np.int32)
        for t in range(T):
            self.ops.launch("argmax", 1, (logits.ptr + t * V * 4, self._picks_dev.ptr + 4 * t, V))
        self._picks_dev.copy_to_host(self._picks_host[:T], self.stream)
        self.stream.synchronize()
        return [int(x) for x in self._picks_host[:T]]

    def forget(self, layers, start: int, stop: int) -> None:
        """Cells start..stop-1 of these layers are past the sequence: nothing reads them before they
        are written again, so the device keeps them as they are. A hybrid's DeltaNet states become
        those after `start` tokens, which the last verify window kept (DeviceHybridCache.roll_back)."""
        if self.hybrid and stop > start and any(l < self.args.num_hidden_layers and not self.args.is_full_attention(l)
                                                for l in layers):
            self.kv.roll_back(start)

    def _window_begin(self, start: int) -> None:
        """A hybrid's verify window: the states before it kept, as its rows' will be (ops_next)."""
        if self.hybrid:
            self.kv.window_begin(start)

    def _drafter_steps(self, hidden) -> None:
        """A decode step's or prompt chunk's main hidden states (device) for the drafter."""
        if self.drafter is not None:
            self.drafter.extend(self.ops.to_host(hidden))
