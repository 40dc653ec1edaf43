"""Seeded fuzz of untrusted model files (issue #20): only StrataError comes out, in bounded time and memory.

A few thousand mutations of a tiny GGUF (bit flips, truncation, integer and float fields set to
extremes, type tags changed, metadata retyped, tensor dims and offsets changed) and of the pack
converted from it (pack.json fields changed, swapped, deleted; data files truncated) run through
convert, load and the first logits in two worker processes capped at 2 GiB of address space each
(tests/pack/fuzz.py). The seeds are fresh each run (STRATA_TEST_SEED replays); every failure
message names the case's seed so `run_case` replays it alone. tools/fuzz_models.py runs more.
"""
from __future__ import annotations

import time
from pathlib import Path

from tests.pack.fuzz import make_bases, run_cases, scratch_dir

NUM_CASES = {"gguf": 1200, "pack": 1200}
CASE_LIMIT_S = 5.0          # the slowest clean case takes well under 0.2 s
TOTAL_LIMIT_S = 180.0      # about 25 s on 2 idle cores; loose, since CI machines are shared


def test_mutated_models_fail_cleanly(rng):
    first = int(rng.integers(1 << 30))
    cases = [(kind, first + i) for kind, n in NUM_CASES.items() for i in range(n)]
    with scratch_dir() as tmp:
        bases = make_bases(Path(tmp))
        t0 = time.monotonic()
        rows = list(run_cases(bases, cases, Path(tmp), num_workers=2, case_timeout_s=CASE_LIMIT_S,
                              mem_bytes=2 << 30))
        wall = time.monotonic() - t0
    assert len(rows) == len(cases)
    bad = [f"{kind} seed {seed}: {outcome}: {what} => {detail[:200]}"
           for kind, seed, outcome, what, detail, _ in rows if outcome not in ("ok", "clean")]
    assert not bad, f"{len(bad)} of {len(rows)} cases escaped:\n" + "\n".join(bad[:20])
    outcomes = {o for _, _, o, *_ in rows}
    assert outcomes == {"ok", "clean"}, outcomes     # both kinds of outcome happen: the mutations bite, not all
    assert wall < TOTAL_LIMIT_S, f"{len(rows)} cases took {wall:.0f} s"


def test_pack_mutations_share_nothing_with_the_palette():
    """Two mutations of one tree may set the same palette value twice, or one inside the other: each
    is a copy, so the tree stays serializable and the palette (shared by a worker's later cases, which
    must replay alone from their seeds) stays as written. Before the copy, 0.3% of 50,000 pack cases
    of one worker failed in the fuzzer itself ("Circular reference detected")."""
    import copy
    import json

    import numpy as np

    from tests.pack import fuzz
    palette = copy.deepcopy(fuzz._PALETTE)
    for seed in range(400):
        rng = np.random.default_rng(seed)
        meta = {k: [1, 2, {"b": [3]}, {"d": 4, "e": [5, [6]]}] for k in "abcdefgh"}   # 4 deletions leave some
        for _ in range(4):
            fuzz.mutate_pack_meta(meta, rng)
        json.dumps(meta)
    assert repr(fuzz._PALETTE) == repr(palette)
