"""Prompt tok/s of the prompt variants on one loaded, resident model: routing grouped on the device
(cuda/moe_group.cu, one launch per matrix over every expert of a layer, nothing read back) against
grouped on the host (the routing downloaded per layer, numpy argsort, per-batch tables uploaded).

    python tools/prompt_variants.py [--synthetic qwen3-30b-a3b] [--prompt 4096,16384] [--repeats 2]

Each (variant, length) reads a fresh random prompt --repeats times; the best time counts.
Logits of the two variants are compared (they must be bit-identical: see cuda/moe_gemm.cu).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", default="qwen3-30b-a3b")
    ap.add_argument("--prompt", default="4096,16384")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    from strata import LLM
    from strata.synthetic import synthetic_pack
    lengths = [int(n) for n in args.prompt.split(",")]
    llm = LLM(str(synthetic_pack(args.synthetic)), device="cuda", max_context=max(lengths) + 64)
    runner = llm.runner
    rng = np.random.default_rng(0)
    runner.prefill(rng.integers(0, 1000, 64).tolist(), 0)          # kernels loaded, pool grown
    for n in lengths:
        ids = rng.integers(0, 1000, n).tolist()
        logits = {}
        for name, flag in (("host grouping", False), ("device grouping", True)):
            runner.ops.paths = dataclasses.replace(runner.ops.paths, group_on_device=flag)
            best = np.inf
            for _ in range(args.repeats):
                runner.reset()
                t0 = time.perf_counter()
                logits[name] = runner.prefill(ids, 0)
                best = min(best, time.perf_counter() - t0)
            print(f"prompt {n:>6}  {name:<16}{n / best:>10,.1f} tok/s  ({best:.3f} s)", flush=True)
        same = np.array_equal(logits["host grouping"], logits["device grouping"])
        print(f"prompt {n:>6}  logits bit-identical: {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
