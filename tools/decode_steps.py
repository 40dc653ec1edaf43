"""The time of each greedy decode step after a prompt, as tools/stream_check.py decodes (logits to the
host, argmax there): shows a one-time cost (a graph capture, a first-step copy) apart from the steady
per-token time that an average over a few dozen tokens mixes in.

    python tools/decode_steps.py [--synthetic qwen3-30b-a3b] [--budget-gib 8] [--prompt 16384] [--decode 64]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", default="qwen3-30b-a3b")
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--prompt", type=int, default=16384)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prefill", default="4096")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from strata import LLM
    from strata.synthetic import synthetic_pack
    import strata
    ids = np.random.default_rng(0).integers(0, 1000, args.prompt).tolist()
    llm = LLM(str(synthetic_pack(args.synthetic)), device=args.device, max_context=args.prompt + args.decode + 1,
              prefill=args.prefill, **({"vram_budget_gib": args.budget_gib} if args.budget_gib else {}))
    runner = llm.runner
    t0 = time.perf_counter()
    logits = runner.prefill(ids, 0)
    prompt_s = time.perf_counter() - t0
    steps = []
    for _ in range(args.decode):
        t0 = time.perf_counter()
        logits = runner.decode(int(np.argmax(logits)))
        steps.append(time.perf_counter() - t0)
    ms = np.array(steps) * 1e3
    out = {"tree": strata.__file__, "prompt_tok_s": args.prompt / prompt_s, "first_ms": ms[:6].round(2).tolist(),
           "median_ms": float(np.median(ms)), "sum_ms": float(ms.sum()), "steady_tok_s": 1e3 / float(np.median(ms[8:])),
           "avg_tok_s": len(ms) / ms.sum() * 1e3, "hit_rate": (runner.status().get("expert_cache") or {}).get("hit_rate")}
    print(json.dumps(out))
    if args.json:
        open(args.json, "w").write(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
