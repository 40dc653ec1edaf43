"""Greedy speculation windows on the GPU, each one CUDA graph: draft, chain, verify and every argmax
on the device, one staging copy in and one small copy out per window.

A window of N drafts after the emitted token x_m (m = the sequence's length), with P pending main
hidden states (positions m - P .. m - 1, strata.engine.speculate.MtpDrafter) whose next tokens are
known, runs as one graph of N (the first window after a prompt, a plain step or a longer pending
run goes the eager way, speculate.MtpDrafter.draft):

1. the draft layer over R = N + 1 rows at positions m - P .. m - P + N: rows 0..P-1 are the pending
   states with their next tokens (their cells become final), rows P..N are padding (zero states,
   token 0) whose cells at m .. m + N - P are written again by the chain below or by the next
   window before anything reads them: a row reads only cells at or before its own position, all
   written by earlier rows of the same launch or final already;
2. row P - 1 (its index staged on the device) gives draft d_1 through the head and an argmax, and
   its output state feeds the chain: draft k (2..N) is the draft layer over d_{k-1} at m + k - 2;
3. the verify window: the main model over [x_m, d_1..d_N] at m..m+N, every row's argmax (row-
   invariant kernels: each row's logits are bit for bit a one-row step's, so the greedy tokens are
   plain greedy's).

One graph per N serves every window: padding rows make the first launch's shape independent of P.
The window graphs of every N share one pool's memory (they never run at once, and each window's
outputs are read before the next starts), so --spec auto's four graphs take one window's VRAM.
When experts stream, the window carries the decode steps' plan: misses read in place, every layer's
routing written to the routing log, of which the verify rows' go to the cache's admissions after
the window (the draft layer's experts are cached for good: ExpertStore's fixed layers).
The drafts are written by the argmaxes straight into the verify window's ids, so nothing waits for
the host between the draft and the verify. Back come the window's ids and picks (2R ints) and the
verify rows' hidden states (the next window's pending rows).

Staging buffer (int32 unless said), one host->device copy of INTS ints and R rows of hidden:
  MTP_IDS [8] | MTP rows: positions [9] (then max + 1), lengths [8], cells [8], bases [8] | SEL |
  chain k = 2..8: [position, max + 1, length, cell, base] | V_IDS [8] | PICKS [8] |
  verify rows: positions [9], lengths [8], cells [8], bases [8] | (byte HIDDEN) hidden f32 [8, D]
"""
from __future__ import annotations

import numpy as np

from ..backends.cuda.memory import DeviceTensor, StepRows
from ..model.qwen3moe import draft_layer
from .cuda_decode import stage_rows
from .memory_model import STEP_MAX_TOKENS

R_MAX = STEP_MAX_TOKENS
MTP_IDS, MTP_POS, MTP_LEN, MTP_CELL, MTP_BASE = 0, 8, 17, 25, 33
SEL = 41
CHAIN = 42                       # draft k = 2..8 at CHAIN + 5 (k - 2)
V_IDS, PICKS = 80, 88
V_POS, V_LEN, V_CELL, V_BASE = 96, 105, 113, 121
INTS = 256
HIDDEN = 4 * INTS                # byte offset of the hidden rows


class SpecWindows:
    """The greedy windows of one CudaRunner (its ops, model, decode steps and KV cache)."""

    def __init__(self, runner):
        self.r = runner
        rt, dev = runner.rt, runner.dev
        D = runner.args.hidden_size
        self.D = D
        self.buf = rt.DeviceBuffer(dev, HIDDEN + 4 * R_MAX * D)
        # pinned both ways: run() synchronizes the stream before it returns, so a window's copies in
        # and out are done before the next window writes (or reads) these
        self.host = rt.HostBuffer(dev, self.buf.nbytes)
        self.ints = np.frombuffer(self.host, np.int32, INTS)
        self.hid = np.frombuffer(self.host, np.float32, R_MAX * D, HIDDEN).reshape(R_MAX, D)
        self.back = rt.HostBuffer(dev, 4 * 2 * R_MAX + 4 * R_MAX * D)      # ids, picks, hidden rows
        self.back_ints = np.frombuffer(self.back, np.int32, 2 * R_MAX)
        self.back_hid = np.frombuffer(self.back, np.float32, R_MAX * D, 8 * R_MAX).reshape(R_MAX, D)
        self.windows = 0            # windows run through here (graph or eager)
        self.region = None          # the memory the window graphs share (_pool)

    def applies(self, pending: int, n: int) -> bool:
        """Whether a window of n drafts after `pending` pending rows runs here."""
        r = self.r
        return 1 <= n < R_MAX and 1 <= pending <= n + 1 and not r.store.staged_decode

    def run(self, drafter, token: int, n: int):
        """One window of n drafts after `token` -> (drafts [n], picks [n + 1], hidden [n + 1, D] on the
        host); the drafter's pending rows become final cells (as MtpDrafter.draft leaves them)."""
        r = self.r
        kv = r.kv
        R = n + 1
        m = len(r.cached_ids)
        P = drafter.pending.shape[0]
        start = drafter.done
        assert start + P == m, "the drafter's pending states must reach the sequence's end"
        h, base = self.ints, kv.base
        h[:] = 0
        h[MTP_IDS:MTP_IDS + P] = r.cached_ids[start + 1:] + [token]
        ring = r.draft_slots             # the draft layer's rows land in its K/V ring (--draft-window)
        stage_rows(h, MTP_POS, MTP_LEN, MTP_CELL, MTP_BASE, np.arange(start, start + R), base, ring)
        h[SEL] = P - 1
        for k in range(2, n + 1):
            c = CHAIN + 5 * (k - 2)
            stage_rows(h, c, c + 2, c + 3, c + 4, np.asarray([m + k - 2]), base, ring)
        h[V_IDS] = token
        stage_rows(h, V_POS, V_LEN, V_CELL, V_BASE, np.arange(m, m + R), base)
        self.hid[:P] = drafter.pending
        self.hid[P:R] = 0.0
        stream = r.stream
        self.buf.copy_from_host(np.frombuffer(self.host, np.uint8, HIDDEN + 4 * R * self.D), stream)
        r.ops.bytes_h2d += HIDDEN + 4 * R * self.D
        logits, hidden = self._launch(n, (start + 1, m + R))     # from the draft layer's rows to the last verify row
        self.buf.copy_to_host(self.back_ints, stream, 4 * V_IDS)
        hidden.buf.copy_to_host(self.back_hid[:R], stream, hidden.offset)
        r.steps._route_copy(R)             # experts streaming: the verify rows' routing, for the cache
        stream.synchronize()
        r.steps._after_route()
        drafter.done, drafter.pending = m, None
        r._last = DeviceTensor(logits.buf, logits.offset + (R - 1) * logits.shape[1] * 4, (1, logits.shape[1]),
                               np.float32, logits)
        self.windows += 1
        ids, picks = self.back_ints[:R], self.back_ints[R_MAX:R_MAX + R]
        return [int(x) for x in ids[1:]], [int(x) for x in picks], self.back_hid[:R].copy()

    def _launch(self, n: int, lengths: tuple[int, int]):
        """The window's launches: a graph replay, its capture (second window of n), or eager (first);
        lengths: (shortest, longest) of its rows' (DecodeSteps.launch)."""
        r = self.r
        logits, hidden, _ = r.steps.launch(f"spec{n}", lambda: self._window(n), r.kv_all, (self.buf, r.weights),
                                           self._pool, lengths)
        return logits, hidden

    def _pool(self, need: int):
        """A frozen pool over the memory every window graph shares (windows never run at once, and a
        window's outputs are read before the next one starts), sized at the first capture for the
        largest window the runner may run (the plan's price, planner.spec_window_bytes, which bounds
        a window's allocations from above); None (a pool of the graph's own) for a window past it."""
        from ..backends.cuda.memory import Pool
        from ..config import spec_max_drafts
        from .planner import spec_window_bytes
        r = self.r
        if self.region is None:
            n = min(spec_max_drafts(r.spec), R_MAX - 1)
            priced = spec_window_bytes(r.prompts._sizes, n, r.max_context, r.ops.num_sms, r.kv_format)
            self.region = r.rt.DeviceBuffer(r.dev, Pool.block_bytes(max(priced, need)))
        if Pool.block_bytes(need) > self.region.nbytes:
            return None
        pool = Pool(r.rt, r.dev)
        pool.segments.append(self.region)
        pool.free.append([[0, self.region.nbytes]])
        pool.frozen = True
        return pool

    def _window(self, n: int):
        """The window's launches in order (module doc) -> (verify logits [R, V], hidden [R, D])."""
        r = self.r
        ops, model, kv, plan = r.ops, r.model, r.kv_all, r.steps.plan
        buf, p, D, V = self.buf, self.buf.ptr, self.D, r.args.vocab_size
        R = n + 1
        i32 = np.int32

        def step_rows(pos: int, T: int, length: int, cell: int, base: int) -> StepRows:
            return StepRows(buf, 4 * pos, T, buf, p + 4 * length, p + 4 * cell, p + 4 * base, kv.num_slots)

        def draft(x, normed, k: int):       # head + argmax of a [1, D] state: draft k into the window's ids
            logits = ops.linear(normed, model.head)
            ops.launch("argmax", 1, (logits.ptr, p + 4 * (V_IDS + k), V))
            return x

        out, normed = draft_layer(model, DeviceTensor(buf, HIDDEN, (R, D), np.float32, buf),
                                  DeviceTensor(buf, 4 * MTP_IDS, (R,), i32, buf),
                                  step_rows(MTP_POS, R, MTP_LEN, MTP_CELL, MTP_BASE), kv, plan=plan)
        x, xn = ops.alloc((1, D)), ops.alloc((1, D))
        ops._copy_rows(out.ptr, p + 4 * SEL, x.ptr, 1, D, D, D)
        ops._copy_rows(normed.ptr, p + 4 * SEL, xn.ptr, 1, D, D, D)
        del out, normed
        x = draft(x, xn, 1)
        for k in range(2, n + 1):
            c = CHAIN + 5 * (k - 2)
            x, xn = draft_layer(model, x, DeviceTensor(buf, 4 * (V_IDS + k - 1), (1,), i32, buf),
                                step_rows(c, 1, c + 2, c + 3, c + 4), kv, plan=plan)
            x = draft(x, xn, k)
        del x, xn
        logits, hidden = model.forward(DeviceTensor(buf, 4 * V_IDS, (R,), i32, buf),
                                       step_rows(V_POS, R, V_LEN, V_CELL, V_BASE), kv, plan=plan)
        for t in range(R):
            ops.launch("argmax", 1, (logits.ptr + t * V * 4, p + 4 * (PICKS + t), V))
        return logits, hidden
