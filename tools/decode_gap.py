"""Where a resident decode token's time goes between the graph and the host (#16): the step's graph
replayed back to back (the device's time alone), the same with the greedy pick and its 4-byte copy
and a synchronize after each (the device idle while the host wakes and launches again), and the
generation loop (runner.decode + runner.pick, each step queued once the host has the token), and the
loop with each step queued behind its pick (pick(step=True), as bench and LLM.generate run now). The
differences are the sync bubble and the Python around a step; random ids are fed, as bench does.

    python tools/decode_gap.py [--synthetic qwen3-30b-a3b] [--context 512] [--steps 128] [--budget-gib G] [--json F]

Under a budget the graph-alone rounds replay one step's graph with the expert table as it is (no
admissions between), so only the two loops compare there.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", default="qwen3-30b-a3b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-gib", type=float, default=0.0, help="--vram-budget-gib (0: resident)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from strata import LLM
    from strata.config import SamplingParams
    from strata.synthetic import synthetic_pack
    n = args.steps
    llm = LLM(str(synthetic_pack(args.synthetic)), device="cuda", vram_budget_gib=args.budget_gib,
              max_context=args.context + (3 * args.rounds + 2) * n + 64)
    runner = llm.runner
    rng = np.random.default_rng(0)
    runner.prefill(rng.integers(0, 1000, args.context).tolist(), 0)
    greedy = SamplingParams()
    for _ in range(4):                          # eager, capture, replays
        runner.decode(int(rng.integers(0, 1000)), logits=False)
        runner.pick(greedy, 0.0)
    steps, stream = runner.steps, runner.stream
    graph = next(g for k, g in steps.graphs.items() if str(k).split("+")[0] == "1")
    V, io = runner.args.vocab_size, runner._pick_io
    host = runner._pick_host
    report = {}
    for r in range(args.rounds):
        t0 = time.perf_counter()                # the graph alone, back to back (same inputs each time)
        for _ in range(n):
            graph.launch(stream)
        stream.synchronize()
        back = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()                # and the pick, its copy and a synchronize after each
        for _ in range(n):
            graph.launch(stream)
            runner.ops.launch("argmax", 1, (graph.logits.ptr, io.ptr + 24, V))
            io.copy_to_host(host[24:28], stream, 24)
            stream.synchronize()
        synced = (time.perf_counter() - t0) / n
        token = int(rng.integers(0, 1000))      # the generation loop, each step after the host has its token
        t0 = time.perf_counter()
        for _ in range(n):
            runner.decode(token, logits=False)
            runner.pick(greedy, 0.0)
            token = int(rng.integers(0, 1000))
        loop = (time.perf_counter() - t0) / n
        before = runner.steps_ahead             # and with each step queued behind its pick (pick(step=True))
        runner.decode(token, logits=False)
        t0 = time.perf_counter()
        for _ in range(n):
            runner.pick(greedy, 0.0, step=True, feed=int(rng.integers(0, 1000)))
        ahead = (time.perf_counter() - t0) / n
        assert runner.steps_ahead - before == n, "pick(step=True) did not step ahead"
        report[r] = {"graph_ms": 1e3 * back, "graph_pick_sync_ms": 1e3 * synced, "loop_ms": 1e3 * loop,
                     "ahead_ms": 1e3 * ahead}
        print(f"round {r}: graph back to back {1e3 * back:.3f} ms, + pick and sync {1e3 * synced:.3f} ms "
              f"(+{1e3 * (synced - back):.3f}), generation loop {1e3 * loop:.3f} ms (+{1e3 * (loop - synced):.3f}), "
              f"steps ahead of the pick {1e3 * ahead:.3f} ms; tok/s {1 / loop:.1f} -> {1 / ahead:.1f} "
              f"against {1 / back:.1f} for the graph alone", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
