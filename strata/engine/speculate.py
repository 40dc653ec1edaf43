"""MTP speculative decoding: the draft layer proposes N tokens, the main model verifies them in one
window of N + 1 rows, the longest agreeing prefix is kept plus the target's own next token, and the
K/V of the rejected positions is rolled back.

Positions. The sequence's tokens x_0..x_{n-1} have main K/V (cells 0..n-1); the token x_n about to
be verified sits at position n. The MTP layer's cell t holds the draft layer applied to the main
model's hidden state h_t and the token x_{t+1}; it is final once both are known. The drafter keeps
the main hidden states whose next token it has not read yet ("pending", positions done..n-1).

One step (speculative_step): the draft layer reads the pending rows with their next tokens (the
last of which is x_n), writing their final cells; its last row's logits give draft d_1 and its
output hidden state chains on: d_k's state and d_k give d_{k+1} (cells n..n+N-2, provisional).
The verify window runs the main model over [x_n, d_1..d_N] at n..n+N with row-invariant ops, so
each row's logits are bitwise what a one-row step there would give. Acceptance keeps d_1..d_a
and emits the target's token at row a. The main cells past n+a and the provisional draft cells
are then rolled back (forgotten: the CPU cache writes NaN there, so a stale read would show), and
the window's hidden states h_n..h_{n+a} become the next step's pending rows.

Sampling keeps the target's distribution exactly: draft d_k is drawn from the drafter's q_k,
accepted with probability min(1, p_k(d_k) / q_k(d_k)), and at the first rejection the emitted
token is drawn from max(0, p_k - q_k) renormalized; when all N are accepted, the last row's p
gives the extra token. p and q are the request's temperature/top-k/top-p distributions
(strata.engine.sampler.probs_host); every draw comes from the request's seeded generator, in a
fixed order, so a seed reproduces the tokens. Greedy compares argmaxes.

A target (the runner) provides: cached_ids (tokens with main K/V), verify(ids, start) -> (logits
[T, V], hidden [T, D]) over row-invariant ops, mtp(hidden, next_ids, positions, logits_rows) ->
(logits of those rows or None, hidden), forget(layers, start, stop) (roll K/V cells back) and args.

Host loop. What runs every window besides the model (acceptance, the --spec auto rule, the drafter's
rows) comes from strata._ext.spec_host, typed Cython, when that extension is built: accept,
greedy_accept, AutoDrafts and DrafterRows (MtpDrafter's base) are then its versions. Without it
they are the Python ones here, accept_py, greedy_accept_py, AutoDraftsPy and DrafterRowsPy, which
stay the oracle either way (tests/engine/test_spec_host.py: the same tokens for the same draws, the
same choices window by window). SPEC_HOST names which is in use. SpecStats.host_ms counts the
window's time outside the model calls (bench reports it per verify pass).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from ..config import SamplingParams
from ..errors import InvalidArgument
from .sampler import choose, probs_host

DRAFT_ROWS_MAX = 8          # pending rows a first draft step reads whole (a decode step's rows); more
                            # get their cells written apart first (MtpDrafter.draft)

try:
    from .._ext import spec_host as _spec_host
except ImportError:     # built without the extensions: the Python versions below run
    _spec_host = None
SPEC_HOST = "cython" if _spec_host is not None else "python"


@dataclass
class SpecStats:
    """Cumulative counters of one runner's speculation (status() reports them)."""
    verify_passes: int = 0
    draft_n: int = 0                # drafts proposed
    draft_n_accepted: int = 0       # drafts the target agreed with
    tokens: int = 0                 # tokens emitted by verify passes (accepted + the target's own)
    host_ms: float = 0.0            # host time of the speculation's own bookkeeping (not the model)
    prompt_cells: int = 0           # draft-layer cells prompts wrote (MtpDrafter.flush)
    prompt_ms: float = 0.0          # their time, where timed (Speculating.draft_timing)

    def to_dict(self) -> dict:
        return {"verify_passes": self.verify_passes, "draft_n": self.draft_n,
                "draft_n_accepted": self.draft_n_accepted,
                "acceptance": self.draft_n_accepted / self.draft_n if self.draft_n else None,
                "tokens_per_verify": self.tokens / self.verify_passes if self.verify_passes else None,
                "host_ms_per_verify": self.host_ms / self.verify_passes if self.verify_passes else None}


class AutoDraftsPy:
    """--spec auto: the drafts per window that maximize measured tokens per second, 0 (drafting off)
    where no N beats a plain step.

    Per N it keeps the mean wall time of a window of N drafts (drafting, verify, acceptance: all of
    it) and one acceptance rate alpha (the share of drafts the target agreed with, counting a
    draft as tried only if every draft before it was kept; a Laplace prior). A window of N drafts
    then yields (1 - alpha^(N+1)) / (1 - alpha) tokens. First N = 0, 1, 2, ... are measured
    twice each for as long as each N beats every one before it (once per runner: on a CPU, whose
    windows cost a step per row, that is four windows); then a probe window runs the neighbour of
    the choice measured longest ago, so costs that move (a cache warming, a longer context) are
    followed. Probes come `probe` windows apart, twice as far after each probe that left the
    choice as it was (up to max_probe), `probe` again after one that changed it: all other windows
    run the best N, so a settled choice pays about one window in max_probe for its probes. Probes
    stay `probe` apart until `settle` drafts have been judged: two unlucky drafts in the climb could
    otherwise leave alpha low and drafting off, with probes too rare to correct it (the simulation in
    test_speculate failed about one run in 12 so).
    A mean is math.fsum's (correctly rounded: the same on every Python, and in spec_host's twin).
    """

    def __init__(self, max_n: int, probe: int = 32, max_probe: int = 1024, keep: int = 16, settle: int = 64):
        self.max_n, self.probe, self.max_probe, self.keep = max_n, probe, max_probe, keep
        self.settle = settle
        self.gap, self.next_probe = probe, probe
        self.probing = False
        self.climbing = True
        self.window_ms: dict[int, list[float]] = {}      # N -> recent window times
        self.seen: dict[int, int] = {}                   # N -> window count when last measured
        self.kept = self.tried = 0
        self.windows = 0
        self.n = max_n

    @property
    def alpha(self) -> float:
        return (self.kept + 1) / (self.tried + 2)

    def tokens_per_ms(self, n: int) -> float:
        a = self.alpha
        tokens = n + 1 if a >= 1 else (1 - a ** (n + 1)) / (1 - a)
        times = self.window_ms[n]
        return tokens / (math.fsum(times) / len(times))

    def choose(self) -> int:
        if self.climbing:                # N = 0, 1, ... twice each, while each N beats the one before
            n = len(self.window_ms) - 1
            if len(self.window_ms.get(max(n, 0), ())) < 2:
                return max(n, 0)
            if n < self.max_n and max(self.window_ms, key=self.tokens_per_ms) == n:
                return n + 1
            self.climbing = False
        best = max(self.window_ms, key=self.tokens_per_ms)
        if self.probing:                 # the last window was a probe: did it move the choice?
            self.probing = False
            self.gap = (self.probe if best != self.n or self.tried < self.settle
                        else min(2 * self.gap, self.max_probe))
            self.next_probe = self.windows + self.gap
        self.n = best
        if self.windows >= self.next_probe:
            self.probing = True
            near = [n for n in (best - 1, best + 1) if 0 <= n <= self.max_n]
            return min(near, key=lambda n: self.seen.get(n, -1))
        return best

    def observe(self, n: int, accepted: int, ms: float) -> None:
        times = self.window_ms.setdefault(n, [])
        times.append(ms)
        del times[:-self.keep]
        self.seen[n] = self.windows
        self.windows += 1
        self.kept += accepted
        self.tried += accepted + (1 if accepted < n else 0)

    def to_dict(self) -> dict:
        return {"n": self.n, "alpha": self.alpha,
                "window_ms": {n: math.fsum(t) / len(t) for n, t in sorted(self.window_ms.items())}}


class DrafterRowsPy:
    """The MTP layer's bookkeeping for one sequence: which of its cells are final, and the main
    hidden states still waiting for their next token."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.done = 0                               # cells 0..done-1 are final
        self._pending: list[np.ndarray] = []        # main hidden rows of positions done.., in pieces

    @property
    def pending(self) -> np.ndarray | None:
        """Main hidden [P, D] of positions done..done+P-1 (None: P = 0); the pieces are joined when
        read, so steps that draft nothing append in O(1)."""
        if len(self._pending) > 1:
            self._pending = [np.concatenate(self._pending)]
        return self._pending[0] if self._pending else None

    @pending.setter
    def pending(self, rows: np.ndarray | None) -> None:
        self._pending = [] if rows is None or rows.shape[0] == 0 else [rows]

    @property
    def covered(self) -> int:
        """Tokens from position 0 for which the drafter can go on (final cells + pending states)."""
        return self.done + sum(p.shape[0] for p in self._pending)

    def reusable(self, cached_ids: list[int], ids: list[int], n: int) -> int:
        """The reusable prefix n of ids over cached_ids, cut where the drafter could not go on: past
        its covered tokens, and by one where cell n-1 is final but was written with a next token
        other than ids[n] (re-reading token n-1 recomputes it)."""
        n = min(n, self.covered)
        if 0 < n <= self.done and (n >= len(cached_ids) or cached_ids[n] != ids[n]):
            n -= 1
        return n

    def truncate(self, length: int) -> None:
        """The sequence is cut back to `length` tokens (a prompt read from there)."""
        if length <= self.done:
            self.done, self.pending = length, None
        elif self.pending is not None:
            self.pending = self.pending[:length - self.done]

    def extend(self, hidden: np.ndarray) -> None:
        """Main hidden states [T, D] of the next T positions after covered."""
        self._pending.append(hidden.copy())


AutoDrafts = _spec_host.AutoDrafts if _spec_host is not None else AutoDraftsPy
DrafterRows = _spec_host.DrafterRows if _spec_host is not None else DrafterRowsPy


def _rows_base(drafter):
    """The DrafterRows class under a drafter (the Cython one, or DrafterRowsPy where a test rebuilds
    MtpDrafter's methods over the Python twin), whose methods MtpDrafter's extend."""
    return next(c for c in type(drafter).__mro__ if c in (DrafterRows, DrafterRowsPy))


class MtpDrafter(DrafterRows):
    """The MTP layer's bookkeeping for one sequence (DrafterRows: done, pending, covered, reusable,
    truncate, extend) and its model calls: the prompt's draft-layer K/V, the chained drafts.

    window > 0 (--draft-window): the draft layer attends over its last `window` positions, its
    cells a ring of `slots` (position p in cell p % slots; config.draft_ring_cells). A prompt then
    writes only the cells the window can still reach, in batches of at most slots - one page rows
    (no two cells of a batch share a slot), and a reused prefix must still find its window's cells
    in the ring. prompt_mode "own" writes a prompt's cells with the whole layer a step's rows at a
    time (the drafter's own pass) instead of the batched K/V-only pass, for the A/B."""

    def __init__(self, window: int = 0, slots: int = 0, prompt_mode: str = "batched"):
        from ..config import DRAFT_RING_PAGE_CELLS
        self.window, self.slots, self.prompt_mode = window, slots, prompt_mode
        self.batch_max = slots - DRAFT_RING_PAGE_CELLS if window else 0     # rows of one ring batch at most
        self.reset()

    def reset(self) -> None:
        _rows_base(self).reset(self)
        self.first_held = 0         # the ring holds no final cell below this position (flush skipped them)

    def reusable(self, cached_ids: list[int], ids: list[int], n: int) -> int:
        """DrafterRows.reusable, and with a window 0 where a rewind into the final cells would need
        cells the ring no longer holds (skipped by a prompt, or overwritten: a window's rows reach at
        most DRAFT_ROWS_MAX positions past done)."""
        n = _rows_base(self).reusable(self, cached_ids, ids, n)
        if self.window and 0 < n <= self.done:
            lowest = max(self.first_held, self.done + DRAFT_ROWS_MAX - self.slots)
            if max(0, n - self.window + 1) < lowest:
                return 0
        return n

    def truncate(self, length: int) -> None:
        if self.window and length <= self.done:     # cells past length stay in the ring until rewritten
            self.first_held = 0 if length == 0 else max(self.first_held, self.done + DRAFT_ROWS_MAX - self.slots)
        _rows_base(self).truncate(self, length)

    def flush(self, target, ids: list[int]) -> int:
        """Write the final cells of every pending row whose next token ids holds (all but the
        sequence's last): a prompt chunk's draft-layer K/V, batched -> the cells written. With a
        window only the last window + 1 of them (the next query reaches window - 1 back; one more
        lets a re-read of the last token rewrite its cell)."""
        P = 0 if self.pending is None else self.pending.shape[0]
        n = min(P, len(ids) - 1 - self.done)
        if n <= 0:
            return 0
        start, end = self.done, self.done + n
        first = max(start, end - self.window) if self.window else start
        if first > start:
            self.first_held = first
        piece = n
        if self.prompt_mode == "own":
            piece = DRAFT_ROWS_MAX
        elif self.window:
            piece = self.batch_max
        hidden, nxt = self.pending, np.asarray(ids[start + 1:end + 1], np.int64)
        for lo in range(first, end, piece):
            hi = min(end, lo + piece)
            rows = slice(lo - start, hi - start)
            if self.prompt_mode == "own":
                target.mtp(hidden[rows], nxt[rows], np.arange(lo, hi), logits_rows=None)
            else:
                self._cells(target, hidden[rows], nxt[rows], np.arange(lo, hi))
        self.done = end
        self.pending = self.pending[n:]
        return end - first

    @staticmethod
    def _cells(target, hidden, next_ids, positions) -> None:
        """The draft layer's final cells of these rows: only its K/V (target.mtp_cells: no
        attention, routed experts or head), or the whole layer where the target has no such pass."""
        if hasattr(target, "mtp_cells"):
            target.mtp_cells(hidden, next_ids, positions)
        else:
            target.mtp(hidden, next_ids, positions, logits_rows=None)

    def draft(self, target, token: int, n: int, params: SamplingParams, draw) -> tuple[list[int], list]:
        """Drafts d_1..d_n after `token` (at position len(target.cached_ids)) -> (drafts, q): q[k] the
        distribution d_k was drawn from (None when greedy)."""
        ids, start = target.cached_ids, self.done
        P = self.pending.shape[0]
        assert start + P == len(ids), "the drafter's pending states must reach the sequence's end"
        nxt = np.asarray(ids[start + 1:] + [token], np.int64)
        if P > DRAFT_ROWS_MAX and hasattr(target, "mtp_cells"):   # a long catch-up (after plain steps):
            k = P - 1                                           # its cells alone, then the last row drafts
            step = self.batch_max or k                          # a ring's batches share no slot
            for lo in range(0, k, step):
                hi = min(k, lo + step)
                self._cells(target, self.pending[lo:hi], nxt[lo:hi], np.arange(start + lo, start + hi))
            self.done, self.pending = start + k, self.pending[k:]
            start, P, nxt = start + k, 1, nxt[k:]
        if params.temperature == 0.0 and hasattr(target, "mtp_next"):     # greedy, argmax on the target
            d, h = target.mtp_next(self.pending, nxt, np.arange(start, start + P))
            self.done, self.pending = start + P, None
            drafts = [d]
            for k in range(1, n):
                d, h = target.mtp_next(h, np.asarray([d], np.int64), np.asarray([start + P - 1 + k]))
                drafts.append(d)
            return drafts, [None] * n
        logits, hid = target.mtp(self.pending, nxt, np.arange(start, start + P), logits_rows=slice(-1, None))
        self.done, self.pending = start + P, None
        drafts, qs = [], []
        pos = start + P - 1
        row, h = logits[-1], hid[-1:]
        for k in range(n):
            if params.temperature == 0.0:
                d, q = int(np.argmax(row)), None
            else:
                q = probs_host(row, params)
                d = choose(q, draw())
            drafts.append(d)
            qs.append(q)
            if k + 1 < n:
                pos += 1
                logits, h = target.mtp(h, np.asarray([d], np.int64), np.asarray([pos]))
                row = logits[-1]
        return drafts, qs


def greedy_accept_py(drafts: list[int], picks: list[int]) -> tuple[int, int]:
    """Drafts [N] against the target's picks [N+1] (each row's argmax) -> (a, picks[a])."""
    a = next((j for j, (d, t) in enumerate(zip(drafts, picks)) if d != t), len(drafts))
    return a, picks[a]


def accept_py(logits: np.ndarray, drafts: list[int], qs: list, params: SamplingParams, draw) -> tuple[int, int]:
    """Verify rows logits [N+1, V] against drafts -> (a, token): the first a drafts are kept and
    `token` is the target's own at row a (a correction, or the extra token when a == N)."""
    if params.temperature == 0.0:
        for j, d in enumerate(drafts):
            t = int(np.argmax(logits[j]))
            if t != d:
                return j, t
        return len(drafts), int(np.argmax(logits[len(drafts)]))
    for j, (d, q) in enumerate(zip(drafts, qs)):
        p = probs_host(logits[j], params)
        if draw() * q[d] < p[d]:          # u < p/q, without dividing (q[d] > 0: d was drawn from q)
            continue
        residual = np.maximum(p - q, 0.0)
        return j, choose(residual if residual.sum() > 0 else p, draw())
    return len(drafts), choose(probs_host(logits[len(drafts)], params), draw())


def _accept_cython(logits: np.ndarray, drafts: list[int], qs: list, params: SamplingParams, draw) -> tuple[int, int]:
    """accept_py by strata._ext.spec_host: the same (a, token) for the same draws."""
    if params.temperature == 0.0:
        return _spec_host.greedy_accept_rows(logits, drafts)
    return _spec_host.accept_sampled(logits, drafts, qs, params, draw, probs_host)


accept = _accept_cython if _spec_host is not None else accept_py
greedy_accept = _spec_host.greedy_accept if _spec_host is not None else greedy_accept_py


def time_windows(target, max_rows: int, repeats: int = 3) -> dict:
    """Best-of-`repeats` milliseconds of a verify window of T = 1..max_rows rows after the sequence
    and of one chained draft step (the draft layer over one row); everything written is forgotten
    after, so the sequence is as before. -> {"verify_ms": {T: ms}, "draft_step_ms": ms}."""
    start, L = len(target.cached_ids), target.args.num_hidden_layers
    ids = list(target.cached_ids[-max_rows:]) or [0]
    ids = (ids * max_rows)[:max_rows]
    out = {}
    for T in range(1, max_rows + 1):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            _, hidden = target.verify(ids[:T], start)
            best = min(best, time.perf_counter() - t0)
            target.forget(range(L), start, start + T)      # (a hybrid's DeltaNet states back to start's)
        out[T] = best * 1e3
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        target.mtp(hidden[:1], np.asarray(ids[:1], np.int64), np.asarray([start]))
        best = min(best, time.perf_counter() - t0)
    target.forget([L], start, start + 1)
    return {"verify_ms": out, "draft_step_ms": best * 1e3}


def speculative_step(target, drafter: MtpDrafter, stats: SpecStats, token: int, n: int,
                     params: SamplingParams, draw, auto: AutoDrafts | None = None) -> list[int]:
    """One draft-verify-accept pass after `token` (already emitted, not yet in the K/V) with n drafts
    (0: a plain step) -> the tokens it emits after `token`: the accepted drafts, then the target's own."""
    t0 = time.perf_counter()
    model_s = 0.0
    start = len(target.cached_ids)
    greedy = params.temperature == 0.0
    window = None
    if n > 0 and greedy and hasattr(target, "spec_window"):
        m0 = time.perf_counter()
        window = target.spec_window(drafter, token, n)
        model_s += time.perf_counter() - m0
    if window is not None:          # the GPU's greedy window: draft, chain and verify in one graph
        drafts, picks, hidden = window
        a, nxt = greedy_accept(drafts, picks)
    else:
        drafts, qs = [], []
        m0 = time.perf_counter()
        if n > 0:
            drafts, qs = drafter.draft(target, token, n, params, draw)
        if greedy and hasattr(target, "verify_next"):       # each row's argmax only
            picks, hidden = target.verify_next([token] + drafts, start)
            a, nxt = greedy_accept(drafts, picks)
        else:
            logits, hidden = target.verify([token] + drafts, start)        # main K/V at start..start+n
            a, nxt = accept(logits, drafts, qs, params, draw)
        model_s += time.perf_counter() - m0
    # rollback: main cells past the accepted prefix, and the chain's provisional draft-layer cells
    # (the next draft rewrites cells start..start+a from the verified states before reading them)
    L = target.args.num_hidden_layers
    target.forget(range(L), start + a + 1, start + n + 1)
    if n > 1:
        target.forget([L], start, start + n - 1)
    target.cached_ids.extend([token] + drafts[:a])
    drafter.extend(hidden[:a + 1])
    stats.verify_passes += 1
    stats.draft_n += n
    stats.draft_n_accepted += a
    stats.tokens += a + 1
    stats.host_ms += (time.perf_counter() - t0 - model_s) * 1e3
    if auto is not None:
        auto.observe(n, a, (time.perf_counter() - t0) * 1e3)
    return drafts[:a] + [nxt]


class Speculating:
    """What both runners share of speculation (a mixin): the drafter's state and one verify window
    per call. The runner gives verify, mtp, forget, decode, pick, cached_ids, max_context and args."""

    def _init_spec(self, spec, draft_window: int = 0, draft_prompt: str = "batched") -> None:
        """draft_window: --draft-window (0: the whole context; also where the ring would not be
        smaller than the context); draft_prompt: --draft-prompt."""
        from ..config import draft_ring, spec_max_drafts
        spec = spec if spec == "auto" else int(spec)
        if spec and not self.args.num_mtp_layers:
            raise InvalidArgument("--mtp: this model has no MTP layer to draft with")
        self.spec = spec                     # drafts per verify window, "auto" or 0 (plain decoding)
        draft_window, slots = draft_ring(draft_window, self.max_context) if spec else (0, 0)
        self.draft_window, self.draft_slots = draft_window, slots
        self.draft_prompt = draft_prompt
        self.drafter = MtpDrafter(draft_window, slots, draft_prompt) if spec else None
        self.spec_stats = SpecStats()
        self.spec_auto = AutoDrafts(spec_max_drafts(spec)) if spec == "auto" else None
        self.draft_timing = False            # time each prompt chunk's draft-layer pass (synced; bench)
        self.draft_chunks: list[tuple[int, float]] = []     # the last prompt's (cells, ms) per chunk
        self.snapshot_rows: dict[int, np.ndarray] = {}      # a hybrid's snapshot length -> main hidden [1, D]

    # a hybrid's (Qwen3-Next's) DeltaNet states resume only from the live state or a prompt-end snapshot;
    # where the draft layer's cell before a snapshot was written with another next token, the main hidden
    # state of the snapshot's last token, kept beside it, lets the drafter redo that cell
    def _snapshot_row(self, length: int) -> None:
        """A prompt of `length` tokens ended with a snapshot: keep the drafter's pending row (its last
        token's main hidden state) for it (not with a draft ring, whose cells reusable() judges)."""
        kept = {s[0] for s in self.kv.snapshots}
        self.snapshot_rows = {n: r for n, r in self.snapshot_rows.items() if n in kept}
        d = self.drafter
        if not d.window and d.pending is not None and d.covered == length:
            self.snapshot_rows[length] = d.pending[-1:].copy()

    def _hybrid_reusable(self, ids: list[int], n: int) -> int:
        """drafter.reusable over a hybrid's resumable prefix n: a cut of one token (the draft layer's
        cell n - 1 holds another next token) resumes at n where the snapshot's row is kept, else from
        a snapshot at or below the cut."""
        cut = self.drafter.reusable(self.cached_ids, ids, n)
        if cut == n or (cut == n - 1 and n in self.snapshot_rows and n in {s[0] for s in self.kv.snapshots}):
            return n
        return self.kv.resumable(cut, len(self.cached_ids))

    def _truncate_drafter(self, start: int) -> None:
        """The drafter cut back to a prompt's start; where that is a snapshot whose cell before it is
        final, its kept row becomes pending again, so the prompt's flush rewrites that cell."""
        done = self.drafter.done
        self.drafter.truncate(start)
        row = self.snapshot_rows.get(start)
        if row is not None and 0 < start <= done and start in {s[0] for s in getattr(self.kv, "snapshots", ())}:
            self.drafter.truncate(start - 1)
            self.drafter.extend(row)

    def _flush_drafter(self) -> None:
        """A prompt chunk's draft-layer cells (MtpDrafter.flush), counted, and timed with draft_timing
        (the device synchronized before and after, so the time is the pass's alone)."""
        if not self.draft_timing:
            self.spec_stats.prompt_cells += self.drafter.flush(self, self.cached_ids)
            return
        self._sync()
        t0 = time.perf_counter()
        cells = self.drafter.flush(self, self.cached_ids)
        self._sync()
        ms = (time.perf_counter() - t0) * 1e3
        self.spec_stats.prompt_cells += cells
        self.spec_stats.prompt_ms += ms
        self.draft_chunks.append((cells, ms))

    def _sync(self) -> None:
        """Wait for the device's queued work (none on the CPU)."""
        stream = getattr(self, "stream", None)
        if stream is not None:
            stream.synchronize()

    def draft_status(self) -> dict:
        """The drafter's K/V: its window (0: the whole context), ring slots, prompt mode, and the
        prompt cells written (with their time where timed)."""
        return {"window": self.draft_window, "ring_cells": self.draft_slots, "prompt": self.draft_prompt,
                "prompt_cells": self.spec_stats.prompt_cells, "prompt_ms": self.spec_stats.prompt_ms,
                "last_prompt_chunks": [{"cells": c, "ms": ms} for c, ms in self.draft_chunks]}

    def speculate(self, token: int, params, sampler, left: int) -> list[int]:
        """One verify window after `token`, with at most left - 1 drafts (left: tokens still wanted);
        -> the tokens it emits after `token`."""
        want = self.spec_auto.choose() if self.spec_auto else self.spec
        n = max(0, min(want, left - 1, self.max_context - 1 - len(self.cached_ids)))
        if n == 0:     # a plain step; the draft layer's K/V catches up in the next window that drafts
            t0 = time.perf_counter()
            self.decode(token, logits=False)
            nxt = self.pick(params, sampler.draw())
            if self.spec_auto:
                self.spec_auto.observe(0, 0, (time.perf_counter() - t0) * 1e3)
            return [nxt]
        return speculative_step(self, self.drafter, self.spec_stats, token, n, params, sampler.draw,
                                self.spec_auto)
