"""Decode with and without CUDA graphs on one loaded model: tok/s, host ms per token, bitwise equality.

    python tools/decode_graph_ab.py [MODEL | --synthetic SHAPE] [--contexts 512,4096] [--decode 64] [--json PATH]

One model load serves both modes. Per context: one prompt of random tokens, then `--decode` greedy
steps eagerly (every kernel launched from Python) and the same steps again from the same KV prefix
and start token through the captured graph. Host submit = staging copy + launches queued (the graph:
one copy and one launch); host step = the whole decode() call, logits on the host (perf_counter,
medians; the capture step is reported apart). The two modes' logits must be bitwise equal.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def decode_run(runner, ctx: int, start: int, n: int, graphs: bool):
    """n greedy steps from the prompt's K/V (ctx cells) and its next token -> (logits [n, V], stats)."""
    runner.cached_ids = runner.cached_ids[:ctx]     # the prompt's cells are untouched; later ones rewritten
    runner.use_graphs = graphs
    for steps in runner.steps.step_times.values():
        steps.clear()
    token, out = start, []
    t0 = time.perf_counter()
    for _ in range(n):
        logits = runner.decode(token)
        out.append(logits)
        token = int(np.argmax(logits))
    seconds = time.perf_counter() - t0
    stats = runner.decode_status()
    row = {"tok_s": n / seconds, "seconds": seconds, **stats["host_ms"].get("graph" if graphs else "eager", {})}
    if graphs and "capture" in stats["host_ms"]:
        row["capture_step_ms"] = stats["host_ms"]["capture"]["host_step_ms"]
    return np.stack(out), row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?")
    p.add_argument("--synthetic", default=None)
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from strata.engine.llm import LLM
    from strata.synthetic import synthetic_pack
    contexts = [int(c) for c in args.contexts.split(",")]
    model = synthetic_pack(args.synthetic) if args.synthetic else args.model
    llm = LLM(model, device="cuda", cuda_graphs=True, max_context=max(contexts) + args.decode + 1)
    runner, rng = llm.runner, np.random.default_rng(0)
    V = llm.args.vocab_size
    runner.decode(int(np.argmax(runner.prefill(rng.integers(0, V, 16).tolist(), 0))))   # kernels, pool
    rows = []
    for ctx in contexts:
        runner.reset()
        t0 = time.perf_counter()
        start = int(np.argmax(runner.prefill(rng.integers(0, V, ctx).tolist(), 0)))
        prompt_s = time.perf_counter() - t0
        eager, e = decode_run(runner, ctx, start, args.decode, graphs=False)
        graph, g = decode_run(runner, ctx, start, args.decode, graphs=True)
        rows.append({"context": ctx, "prompt_tok_s": ctx / prompt_s, "eager": e, "graph": g,
                     "bitwise_equal": bool(np.array_equal(eager, graph)),
                     "max_abs_diff": float(np.abs(eager - graph).max())})
        sys.stderr.write(f"ab: context {ctx} done\n")
    status = runner.decode_status()
    print(f"decode A/B on {llm.model_name}: graphs {status['graphs']}, error {status['graph_error']}")
    print(f"{'context':>8} {'mode':>6} {'tok/s':>8} {'host submit ms':>15} {'host step ms':>13} {'bitwise':>8}")
    for r in rows:
        for mode in ("eager", "graph"):
            m = r[mode]
            print(f"{r['context']:>8} {mode:>6} {m['tok_s']:>8.1f} {m.get('host_submit_ms', float('nan')):>15.3f} "
                  f"{m.get('host_step_ms', float('nan')):>13.3f} {str(r['bitwise_equal']):>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "status": {k: v for k, v in status.items() if k != "graphs"},
                       "graphs": {str(k): v for k, v in status["graphs"].items()}}, f, indent=1)
    return 0 if all(r["bitwise_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
