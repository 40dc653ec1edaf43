"""Probe: many seeded mutations of a tiny GGUF and pack through convert, load and logits.

    python tools/fuzz_models.py --cases 4000 [--seed 0] [--workers 2] [--timeout-s 10] [--json out.json]

Prints the figures of issue #20: cases, clean errors, other exceptions (not a StrataError), late
errors (a healthy load, then a failure at the first use), hangs, crashes, silent wrong outputs
(loads, non-finite logits), plus the first examples of each bad outcome with their replay seed.
The mutations and the worker pool live in tests/pack/fuzz.py (the CI test runs a small share).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/ is not an installed package

from tests.pack.fuzz import make_bases, run_cases, scratch_dir  # noqa: E402

BAD = ("other", "late", "hang", "crash", "nonfinite")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=4000, help="total cases, half GGUF, half pack")
    ap.add_argument("--seed", type=int, default=0, help="first case seed")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=10.0, help="a case over this is a hang")
    ap.add_argument("--mem-gib", type=float, default=4.0, help="address-space cap of each worker")
    ap.add_argument("--examples", type=int, default=3, help="examples printed per bad outcome and kind")
    ap.add_argument("--json", help="write every case's result here")
    a = ap.parse_args()
    with scratch_dir() as tmp:
        root = Path(tmp)
        base = make_bases(root)
        half = a.cases // 2
        cases = [("gguf", a.seed + i) for i in range(half)] + [("pack", a.seed + i) for i in range(a.cases - half)]
        t0, rows = time.monotonic(), []
        for row in run_cases(base, cases, root, a.workers, a.timeout_s, int(a.mem_gib * (1 << 30))):
            rows.append(row)
        wall = time.monotonic() - t0
    counts = collections.Counter((kind, outcome) for kind, _, outcome, *_ in rows)
    print(f"{len(rows)} cases in {wall:.1f} s ({a.workers} workers, {a.timeout_s:g} s limit, "
          f"{a.mem_gib:g} GiB cap); slowest {max(r[5] for r in rows):.2f} s")
    print(f"{'':6} {'cases':>6} {'ok':>6} {'clean':>6} {'other':>6} {'late':>6} {'hang':>6} {'crash':>6} "
          f"{'silent':>6}")
    for kind in ("gguf", "pack", "all"):
        pick = (lambda o: sum(n for (k, oo), n in counts.items() if oo == o and kind in (k, "all")))
        total = sum(n for (k, _), n in counts.items() if kind in (k, "all"))
        print(f"{kind:6} {total:6} " + " ".join(f"{pick(o):6}" for o in ("ok", "clean", *BAD)))
    kinds = collections.Counter(r[4].split(":")[0] for r in rows if r[2] in ("other", "late"))
    if kinds:
        print("exception types:", ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
    for outcome in BAD:
        for kind in ("gguf", "pack"):
            ex = [r for r in rows if r[0] == kind and r[2] == outcome][:a.examples]
            for r in ex:
                print(f"  {outcome} {kind} seed {r[1]}: {r[3]} => {r[4][:200]}")
    if a.json:
        Path(a.json).write_text(json.dumps([dict(zip(("kind", "seed", "outcome", "mutation", "detail", "seconds"), r))
                                            for r in rows], indent=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
