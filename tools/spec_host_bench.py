"""Speculation's host loop alone: SpecStats.host_ms per verify pass of speculative_step over a fake
target whose model calls cost next to nothing, with the Python host loop (strata/engine/speculate.py's
*_py / *Py versions) and with strata._ext.spec_host, and the --spec auto rule's choose + observe.

    python tools/spec_host_bench.py [--windows W] [--repeats R] [--drafts 1,3,7] [--json PATH]

The fake target: verify returns rows of a few fixed logits tables [V] (float32), hidden states
[T, 2048], and picks (argmaxes) for the greedy path with verify_next (the GPU's); the draft layer
returns the target's rows plus noise, so drafts are partly kept. host_ms counts what
speculative_step does besides target.verify / verify_next / drafter.draft: acceptance (for sampled
windows probs_host of each verified row, then the accept test and the residual draw), the
rollback calls (free here), the drafter's extend, the counters. Modes: greedy over logits (the CPU
runner's path: argmax per row), greedy over picks (the GPU's), sampled (temperature 0.8, and
with top-k 40 / top-p 0.95). Each cell is the least of --repeats runs (the machine's noise).
"""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np

from strata.config import SamplingParams
from strata.engine import speculate

D = 2048          # Qwen3-30B-A3B's hidden size: what the drafter copies per kept row
TABLES = 8


class FakeTarget:
    def __init__(self, V: int, picks: bool, rng):
        self.P = rng.normal(0, 3.0, (TABLES, V)).astype(np.float32)
        self.Q = self.P + rng.normal(0, 1.0, (TABLES, V)).astype(np.float32)
        self.args = SimpleNamespace(num_hidden_layers=48)
        self.cached_ids = [0]
        self.hidden = np.zeros((8, D), np.float32)
        self.argmax = np.argmax(self.P, axis=1)
        if picks:
            self.verify_next = lambda ids, start: ([int(self.argmax[i % TABLES]) for i in ids],
                                                   self.hidden[:len(ids)])

    def verify(self, ids, start):
        return self.P[np.asarray(ids) % TABLES], self.hidden[:len(ids)]

    def mtp(self, hidden, next_ids, positions, logits_rows=slice(None)):
        rows = self.Q[np.asarray(next_ids) % TABLES]
        return (None if logits_rows is None else rows[logits_rows]), self.hidden[:len(next_ids)]

    def forget(self, layers, start, stop):
        pass


def host_ms_per_verify(V: int, N: int, params: SamplingParams, picks: bool, python: bool, windows: int) -> float:
    rng = np.random.default_rng(0)
    saved = speculate.accept, speculate.greedy_accept
    if python:
        speculate.accept, speculate.greedy_accept = speculate.accept_py, speculate.greedy_accept_py
        methods = {k: v for k, v in vars(speculate.MtpDrafter).items() if k not in ("__dict__", "__weakref__")}
        drafter = type("PyDrafter", (speculate.DrafterRowsPy,), methods)()
    else:
        drafter = speculate.MtpDrafter()
    try:
        target = FakeTarget(V, picks, rng)
        drafter.extend(np.zeros((1, D), np.float32))
        stats, token = speculate.SpecStats(), 1
        draw = lambda: float(rng.random())                      # noqa: E731
        for w in range(windows + 5):
            if w == 5:                                          # after a warm-up
                stats = speculate.SpecStats()
            out = speculate.speculative_step(target, drafter, stats, token, N, params, draw)
            token = out[-1]
            if len(target.cached_ids) > 4096:
                target.cached_ids = target.cached_ids[-8:]
                drafter.done = len(target.cached_ids) - drafter.pending.shape[0]
        return stats.host_ms / stats.verify_passes
    finally:
        speculate.accept, speculate.greedy_accept = saved


def auto_us_per_window(cls, windows: int = 20000) -> float:
    rng = np.random.default_rng(0)
    auto = cls(7)
    ms = rng.uniform(10, 20, windows).tolist()
    acc = rng.integers(0, 3, windows).tolist()
    t0 = time.perf_counter()
    for w in range(windows):
        n = auto.choose()
        auto.observe(n, min(acc[w], n), ms[w] * (1 + 0.1 * n))
    return (time.perf_counter() - t0) / windows * 1e6


MODES = {"greedy, logits": (SamplingParams(), False),
         "greedy, picks": (SamplingParams(), True),
         "sampled T 0.8": (SamplingParams(temperature=0.8), False),
         "sampled T 0.8 k 40 p 0.95": (SamplingParams(temperature=0.8, top_k=40, top_p=0.95), False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=200, help="verify passes per cell (a quarter at V 151936)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell; the table shows the least")
    ap.add_argument("--drafts", default="1,3,7", help="N values, comma-separated")
    ap.add_argument("--json", help="write the table as JSON")
    args = ap.parse_args()
    if speculate.SPEC_HOST != "cython":
        raise SystemExit("strata._ext.spec_host is not built: setup.py build_ext --inplace")
    drafts = [int(n) for n in args.drafts.split(",")]
    rows = []
    print(f"{'mode':<28}{'V':>8}{'N':>3}{'python ms':>11}{'cython ms':>11}{'speed-up':>10}")
    for V in (8192, 151936):
        windows = args.windows if V < 100000 else max(10, args.windows // 4)
        for mode, (params, picks) in MODES.items():
            for N in drafts:
                py = min(host_ms_per_verify(V, N, params, picks, True, windows) for _ in range(args.repeats))
                cy = min(host_ms_per_verify(V, N, params, picks, False, windows) for _ in range(args.repeats))
                rows.append({"mode": mode, "V": V, "N": N, "python_ms": py, "cython_ms": cy})
                print(f"{mode:<28}{V:>8}{N:>3}{py:>11.4f}{cy:>11.4f}{py / cy:>9.2f}x", flush=True)
    py, cy = auto_us_per_window(speculate.AutoDraftsPy), auto_us_per_window(speculate.AutoDrafts)
    print(f"--spec auto, choose + observe per window (max 7 drafts): python {py:.2f} us, cython {cy:.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "auto_us": {"python": py, "cython": cy}}, f, indent=1)


if __name__ == "__main__":
    main()
