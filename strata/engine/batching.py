"""How the ready decode rows of --parallel slots are grouped into batched steps (--batch-max).

Each scheduler iteration, every slot whose next step is a plain decode step is "ready", and each
ready row steps exactly once per iteration whatever the grouping: the rule only decides whether R
ready rows run as one step of R rows or as several smaller steps (R = 5 under a cap of 2: steps of
2, 2 and 1), one after the other. A step of b rows under a cap is `split(R, b)`: ceil(R / b) groups
of near-equal size, largest first. A sequence's tokens do not depend on the grouping: every batched
kernel computes each row as the one-row step does (row-invariant kernels, docs/DESIGN.md).

`FixedBatch(n)` is --batch-max N: steps of at most N rows (N = --parallel: every ready row in one
step; 1: each row alone). `AutoBatch` is --batch-max 0: it measures the wall time of steps of each
row count (from the batched launch to the last of its rows' picks, the work a grouping changes) and
runs the grouping of the R ready rows whose measured steps add up to the least time. Where each
extra row's experts come over the bus (a small VRAM budget) a step of 4 rows costs more than four
steps of one and it runs rows apart; where every expert is resident the step of 4 rows costs much
less than four of one and it batches. The ideas are `--spec auto`'s (speculate.AutoDraftsPy):
- the first WARM_STEPS steps of a row count are not counted (the GPU runner's first run of a shape
  is eager and its second captures the shape's graph);
- a grouping that would run a row count not yet measured (NEED_SAMPLES counted steps) is run first,
  so every grouping the ready rows allow is measured before the rule trusts its costs (the climb);
- then the cheapest grouping runs, and now and then a probe runs the neighbouring grouping measured
  longest ago, so costs that move (the expert cache warming, contexts growing) are followed: probes
  come `probe` iterations apart, twice as far after one that left the choice as it was (up to
  max_probe), `probe` again after one that changed it;
- a row count's cost is the median of its last `keep` steps (one slow step, a page fault or a
  collection, does not move it);
- but a row count not stepped for more than `keep` iterations starts its samples afresh: what it
  cost then was measured in another state (under a budget the first steps after the prompts miss
  most experts: a 2-row step measured at 25 ms in a cold cache took 4.5 ms once it was warm, and the
  two cold samples held the median for hundreds of iterations). A probe is then two steps of its
  grouping (NEED_SAMPLES), the second confirming the first;
- and where the chosen grouping's own cost has moved by 2x since it was judged (the cache refilling
  after the prompts: a 4 + 4 step fell from 60 ms to 14 over some 50 iterations at 12 GiB), every
  other cost is of the old state too: they are dropped, the choice's cut to its last NEED_SAMPLES,
  and the climb measures the groupings again (at 8 clients the rule ran 4 + 4 for 97 iterations
  before a probe found 8 rows cheaper warm).
"""
from __future__ import annotations

import collections
import statistics

WARM_STEPS = 2              # eager, then the graph's capture: not the step's steady cost
NEED_SAMPLES = 2            # counted steps of a row count before its cost is trusted
KEEP_STEPS = 16             # a row count's cost is the median of its last KEEP_STEPS steps


def split(rows: int, cap: int) -> tuple[int, ...]:
    """Group sizes for `rows` ready rows under `cap` rows a step: ceil(rows / cap) groups of
    near-equal size, largest first (5 under 2: 2, 2, 1; 8 under 3: 3, 3, 2)."""
    if rows <= 0:
        return ()
    groups = -(-rows // max(1, min(cap, rows)))
    return tuple(rows // groups + (1 if i < rows % groups else 0) for i in range(groups))


class FixedBatch:
    """--batch-max N: steps of at most max_rows rows; it records step times for status() all the same."""

    auto = False

    def __init__(self, max_rows: int):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.cap = max_rows
        self.keep = KEEP_STEPS
        self.step_ms: dict[int, collections.deque] = {}
        self.seen_steps: dict[int, int] = {}       # row count -> steps of it seen, counted or not
        self.iterations = 0

    def groups(self, rows: int) -> tuple[int, ...]:
        """The sizes of this iteration's batched steps for `rows` ready rows (summing to rows)."""
        self.iterations += 1
        return split(rows, self.max_rows)

    def observe(self, rows: int, ms: float) -> None:
        """A step of `rows` rows took `ms` (its launch to its rows' picks)."""
        seen = self.seen_steps.get(rows, 0)
        self.seen_steps[rows] = seen + 1
        if seen >= WARM_STEPS:
            self.step_ms.setdefault(rows, collections.deque(maxlen=self.keep)).append(ms)

    def cost_ms(self, rows: int) -> float | None:
        """The median of the last counted steps of `rows` rows (None: fewer than NEED_SAMPLES)."""
        times = self.step_ms.get(rows)
        return statistics.median(times) if times is not None and len(times) >= NEED_SAMPLES else None

    def to_dict(self) -> dict:
        costs = {r: self.cost_ms(r) for r in sorted(self.step_ms)}
        costs = {r: ms for r, ms in costs.items() if ms is not None}
        return {"batch_max": self.max_rows if not self.auto else 0, "auto": self.auto, "cap": self.cap,
                "step_ms": {r: round(ms, 3) for r, ms in costs.items()},
                "row_ms": {r: round(ms / r, 3) for r, ms in costs.items()}}


class AutoBatch(FixedBatch):
    """--batch-max 0: the grouping whose measured steps take the least time (module doc)."""

    auto = True

    def __init__(self, max_rows: int, probe: int = 32, max_probe: int = 1024, keep: int = KEEP_STEPS):
        super().__init__(max_rows)
        self.probe, self.max_probe, self.keep = probe, max_probe, keep
        self.gap = self.next_probe = probe
        self.probing: tuple[int, ...] | None = None     # the choice when a probe ran, judged next iteration
        self.last_measured: dict[int, int] = {}         # row count -> iteration of its last step
        self.judged: tuple[tuple[int, ...], float] | None = None   # the choice and its cost when last judged

    def observe(self, rows: int, ms: float) -> None:
        last = self.last_measured.get(rows)
        if last is not None and self.iterations - last > self.keep and rows in self.step_ms:
            self.step_ms[rows].clear()              # stale: measured in another state (module doc)
        super().observe(rows, ms)
        self.last_measured[rows] = self.iterations

    def groups(self, rows: int) -> tuple[int, ...]:
        self.iterations += 1
        options = self._options(rows)
        if len(options) == 1:
            return options[0]
        new = self._unmeasured(options)
        if not new:
            best = min(options, key=self._total_ms)
            self.cap = best[0]
            if self._restated(best):                # a new state: every grouping measured again
                new = self._unmeasured(options)
        if new:                                     # the climb: measure what these rows allow first
            return new[-1]                          # the largest steps first: resident, that is the choice
        if self.probing is not None:                # the last iteration probed: did it move the choice?
            moved = best != self.probing
            self.gap = self.probe if moved else min(2 * self.gap, self.max_probe)
            self.next_probe = self.iterations + self.gap
            self.probing = None
        if self.iterations >= self.next_probe:
            i = options.index(best)
            near = [options[j] for j in (i - 1, i + 1) if 0 <= j < len(options)]
            self.probing = best
            return min(near, key=lambda g: min(self.last_measured.get(r, -1) for r in g))
        return best

    def _restated(self, best: tuple[int, ...]) -> bool:
        """Whether the choice's own cost has moved 2x since it was judged (module doc); if so, the
        other row counts' samples are dropped (every other grouping is then unmeasured) and the
        choice's cut to its last NEED_SAMPLES."""
        total = self._total_ms(best)[0]
        if self.judged is None or self.judged[0] != best:
            self.judged = (best, total)
            return False
        if 0.5 * self.judged[1] <= total <= 2.0 * self.judged[1]:
            return False
        self.judged = None
        for r in list(self.step_ms):
            if r in best:
                kept = list(self.step_ms[r])[-NEED_SAMPLES:]
                self.step_ms[r].clear()
                self.step_ms[r].extend(kept)
            else:
                del self.step_ms[r]
        self.probing, self.gap, self.next_probe = None, self.probe, self.iterations + self.probe
        return True

    def _unmeasured(self, options: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """The groupings that use a row count without a trusted cost yet (cost_ms None)."""
        return [g for g in options if any(self.cost_ms(r) is None for r in g)]

    def _options(self, rows: int) -> list[tuple[int, ...]]:
        """The distinct groupings of `rows` rows under caps 1..max_rows, fewest steps last."""
        out: list[tuple[int, ...]] = []
        for cap in range(1, min(rows, self.max_rows) + 1):
            g = split(rows, cap)
            if g not in out:
                out.append(g)
        return out

    def _total_ms(self, groups: tuple[int, ...]) -> tuple[float, int]:
        """Measured time of the grouping's steps; among equal times the fewer steps."""
        return sum(self.cost_ms(r) for r in groups), len(groups)


def batch_rule(batch_max: int, parallel: int) -> FixedBatch:
    """The rule for --batch-max (0: AutoBatch over 1..parallel rows) and --parallel."""
    return AutoBatch(parallel) if batch_max == 0 else FixedBatch(min(batch_max, parallel))
