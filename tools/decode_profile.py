"""Where a decode step's GPU time goes, kernel by kernel, on a loaded model.

    python tools/decode_profile.py [--synthetic qwen3-30b-a3b] [--context 4096] [--steps 4] [--rows N] [--json PATH]

One eager decode step is launched with a timing event before and after every kernel, all queued
behind long memsets so the GPU runs the kernels back to back (as a CUDA graph would) and no host
gap lands inside an event pair. The table sums each kernel's time over the step (median of
--steps steps) and compares the total with a graph step's time measured in the same run.

--rows N (2..8): the batched step of N parallel slots (each slot holding --context cells), as
`--parallel N` runs it: the same table for N rows, to say which kernels grow with the rows (the
in-graph breakdown is for one row only, so it is left out).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from strata.backends.cuda.kernels import KERNELS  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", default="qwen3-30b-a3b")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget-gib", type=float, default=0.0)
    ap.add_argument("--rows", type=int, default=1, help="rows of the batched step (parallel slots), 1..8")
    ap.add_argument("--json")
    ap.add_argument("--blocker-mib", type=int, default=8 << 10,
                    help="the device memset each step is queued behind (8 GiB: ~10 ms of GPU work)")
    ap.add_argument("--graphs-only", action="store_true", help="only the in-graph breakdown")
    ap.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launches")
    ap.add_argument("--kernels-off", default="", help="kernel paths to turn off (EngineConfig.kernels_off)")
    ap.add_argument("--kernels-on", default="", help="trial kernel paths to turn on (EngineConfig.kernels_on)")
    args = ap.parse_args(argv)
    from strata import LLM
    from strata.synthetic import synthetic_pack
    if not 1 <= args.rows <= 8:
        ap.error(f"--rows must be 1..8, got {args.rows}")
    llm = LLM(str(synthetic_pack(args.synthetic)), device="cuda", max_context=args.context + 64,
              vram_budget_gib=args.budget_gib, kernels_off=args.kernels_off, kernels_on=args.kernels_on,
              parallel=args.rows)
    runner, rt = llm.runner, llm.runner.rt
    rng = np.random.default_rng(0)
    for slot in reversed(range(args.rows)):             # slot 0 last: the one-row steps below run on it
        runner.use(slot)
        runner.prefill(rng.integers(0, 1000, args.context).tolist(), 0)
    for _ in range(8):                                  # eager, capture, graph steps
        runner.decode(int(rng.integers(0, 1000)))
    t0 = time.perf_counter()
    for _ in range(16):
        runner.decode(int(rng.integers(0, 1000)))
    graph_ms = (time.perf_counter() - t0) / 16 * 1e3
    if args.no_pdl:
        runner.ops.pdl = False
        runner.drop_graphs()
    if args.rows > 1:
        slots = list(range(args.rows))
        for _ in range(8):                              # the rows' eager step, capture, replays
            runner.decode_batch(slots, rng.integers(0, 1000, args.rows).tolist())
        t0 = time.perf_counter()
        for _ in range(16):
            runner.decode_batch(slots, rng.integers(0, 1000, args.rows).tolist())
            runner.stream.synchronize()
        graph_ms = (time.perf_counter() - t0) / 16 * 1e3
    if args.graphs_only:
        print(f"decode step at context {args.context}: graph step {graph_ms:.3f} ms (host, logits on the host)")
        in_graphs = graph_breakdown(runner, rng)
        if args.json:
            Path(args.json).write_text(json.dumps({"graph_ms": graph_ms, "in_graphs": in_graphs}, indent=1))
        return 0

    ops = runner.ops
    launch = ops.launch
    pending = []

    def timed(op, grid, a, shared_bytes=0, **fields):       # ops.launch's signature
        start, end = rt.Event(runner.dev, timing=True), rt.Event(runner.dev, timing=True)
        start.record(runner.stream)
        launch(op, grid, a, shared_bytes, **fields)
        end.record(runner.stream)
        pending.append((KERNELS[op].name(**fields), start, end))
    blocker = rt.DeviceBuffer(runner.dev, args.blocker_mib << 20)
    per_step = []
    for _ in range(args.steps):
        for _ in range(4):
            blocker.fill_bytes(0, runner.stream)      # ~10 ms of GPU work while the step is queued
        ops.launch = timed
        if args.rows > 1:                               # as batch_rows stages them: row i in slot i's cells
            ids, pos = runner.steps.stage_inputs(rng.integers(0, 1000, args.rows).tolist(),
                                                 [len(runner.slot_ids(s)) for s in range(args.rows)],
                                                 [s * runner.max_context for s in range(args.rows)],
                                                 runner.kv_all.num_slots)
            kv = runner.kv_all
        else:
            ids, pos = runner.steps.stage_inputs([int(rng.integers(0, 1000))], [len(runner.cached_ids)], [0])
            kv = runner.kv
        logits, _ = runner.model.forward(ids, pos, kv, plan=runner.steps.plan)
        ops.launch = launch
        runner.stream.synchronize()
        totals = defaultdict(lambda: [0, 0.0])
        for name, start, end in pending:
            totals[name][0] += 1
            totals[name][1] += start.elapsed_ms(end)
        span = pending[0][1].elapsed_ms(pending[-1][2])
        per_step.append((dict(totals), span))
        pending.clear()
    spans = [s for _, s in per_step]
    med = per_step[int(np.argsort(spans)[len(spans) // 2])][0]
    busy = sum(t for _, t in med.values())
    print(f"decode step of {args.rows} row(s) at context {args.context}: graph step {graph_ms:.3f} ms "
          f"(host, {'logits on the device' if args.rows > 1 else 'logits on the host'}); "
          f"eager kernels back to back: span {np.median(spans):.3f} ms, kernels {busy:.3f} ms, "
          f"{sum(c for c, _ in med.values())} launches")
    print(f"{'kernel':<46}{'count':>6}{'total us':>10}{'us each':>9}{'share':>8}")
    rows = sorted(med.items(), key=lambda kv: -kv[1][1])
    for name, (count, ms) in rows:
        print(f"{name:<46}{count:>6}{ms * 1e3:>10.1f}{ms * 1e3 / count:>9.2f}{ms / busy:>8.1%}")
    in_graphs = graph_breakdown(runner, rng) if args.rows == 1 else None
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": args.rows, "graph_ms": graph_ms, "span_ms": float(np.median(spans)),
                                               "kernels": {k: v for k, v in rows}, "in_graphs": in_graphs},
                                              indent=1))
    return 0


def graph_breakdown(runner, rng, replays: int = 20) -> dict:
    """Each kernel's share of a graph step, measured in graphs: the step is captured as the engine
    captures it (strata.engine.graphs.capture_step, PDL as the engine launches), once whole and
    once per kernel name with every other kernel left out, and each graph is timed over replays.
    The kernels' sum against the whole step says what the split misses (overlap across kernels)."""
    from strata.backends.cuda import _graphs
    from strata.engine.cuda_decode import row_lengths
    from strata.engine.graphs import capture_step
    ops, rt, stream = runner.ops, runner.rt, runner.stream
    launch, names = ops.launch, []

    def note(op, grid, a, shared_bytes=0, **fields):
        names.append(KERNELS[op].name(**fields))
        launch(op, grid, a, shared_bytes, **fields)
    ops.launch = note
    runner.decode(int(rng.integers(0, 1000)))           # eager or replayed: the names of one step
    ops.launch = launch
    if not names:                                        # a replayed graph launched nothing from Python
        runner.drop_graphs()
        ops.launch = note
        runner.decode(int(rng.integers(0, 1000)))
        ops.launch = launch
    position = len(runner.cached_ids)
    ids, pos = runner.steps.stage_inputs([int(rng.integers(0, 1000))], [position], [0])
    # the engine's key for a one-row step at this length ("1+tc" from TC_DECODE_FROM cells on); the captures
    # below take the same kernels (steps.rows_of)
    lengths = row_lengths([position])
    key = runner.steps.graph_key(1, lengths)

    # The routing kernels always run: the expert kernels index the expert table with their ids (a
    # graph without them would read ids from whatever the pool block held before).
    base = {n for n in names if n.startswith(("strata_moe_route", "strata_router_"))}   # fused-route: the router routes
    base |= {n for n in names if n.startswith("strata_gemv") and n.endswith("_f32")}     # the F32 router
    # route-in-moe: gate|up routes (and writes the ids); norm-in-router: the router makes the post-attention norm
    base |= {n for n in names if n.startswith(("strata_moe_gate_up_route_", "strata_add_norm_router_"))}

    def time_step(only) -> float:
        def filtered(op, grid, a, shared_bytes=0, **fields):
            if only is None or KERNELS[op].name(**fields) in only:
                launch(op, grid, a, shared_bytes, **fields)
        ops.launch = filtered
        try:
            steps = runner.steps
            with steps.rows_of(lengths):
                graph = capture_step(_graphs(), ops, runner.model, runner.kv, steps.plan, 1, ids, pos,
                                     steps.step_bytes[key], (steps.step_in, steps.route_log, runner.weights))
        finally:
            ops.launch = launch
        start, end = rt.Event(runner.dev, timing=True), rt.Event(runner.dev, timing=True)
        graph.launch(stream)
        start.record(stream)
        for _ in range(replays):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
        graph.destroy()
        return start.elapsed_ms(end) / replays * 1e3
    whole = time_step(None)
    routing = time_step(base)
    per = {"routing (" + " + ".join(sorted(base)) + ")": (sum(names.count(n) for n in base), routing)}
    for n in sorted(set(names) - base):
        print(f"  timing {n} ...", file=sys.stderr, flush=True)
        per[n] = (names.count(n), time_step(base | {n}) - routing)
    total = sum(us for _, us in per.values())
    print(f"in graphs (PDL {'on' if ops.pdl else 'off'}): whole step {whole:.1f} us, {len(names)} kernels; "
          f"sum of the kernels' own graphs {total:.1f} us (each kernel: its graph with the routing, less the "
          f"routing's)")
    print(f"{'kernel':<46}{'count':>6}{'total us':>10}{'us each':>9}{'share':>8}")
    for name, (count, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:<46}{count:>6}{us:>10.1f}{us / max(count, 1):>9.2f}{us / total:>8.1%}")
    return {"whole_us": whole, "kernels": {n: list(v) for n, v in per.items()}}


if __name__ == "__main__":
    sys.exit(main())
