"""Prompt tok/s of the prompt variants on one loaded, resident model: routing grouped on the device
(cuda/moe_group.cu, one launch per matrix over every expert of a layer, nothing read back) against
grouped on the host (the routing downloaded per layer, numpy argsort, per-batch tables uploaded);
with --tma-gemm, the prompt GEMMs over f16 weights by the TMA (tma-gemm, on where it runs) against
the decoding GEMMs, the first prompt of each length and variant timed apart (a path's one-time costs).

    python tools/prompt_variants.py [--synthetic qwen3-30b-a3b] [--prompt 4096,16384] [--repeats 2] [--tma-gemm]

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
    ap.add_argument("--tma-gemm", action="store_true", help="tma-gemm on and off instead of the grouping")
    args = ap.parse_args(argv)
    from strata import LLM
    from strata.synthetic import synthetic_pack
    lengths = [int(n) for n in args.prompt.split(",")]
    llm = LLM(str(synthetic_pack(args.synthetic)), device="cuda", max_context=max(lengths) + 64)
    runner = llm.runner
    rng = np.random.default_rng(0)
    runner.prefill(rng.integers(0, 1000, 64).tolist(), 0)          # kernels loaded, pool grown
    tma = runner.ops.gemm_dq
    variants = ((("tma-gemm off", False), ("tma-gemm on", True)) if args.tma_gemm
                else (("host grouping", False), ("device grouping", True)))
    if args.tma_gemm and not tma:
        print("tma-gemm does not run here (an sm_90 GPU and the sm_90a libraries): both arms are the same")
    for n in lengths:
        ids = rng.integers(0, 1000, n).tolist()
        logits = {}
        for name, flag in variants:
            if args.tma_gemm:
                runner.ops.gemm_dq = flag and tma
            else:
                runner.ops.paths = dataclasses.replace(runner.ops.paths, group_on_device=flag)
            times = []
            for _ in range(args.repeats):
                runner.reset()
                t0 = time.perf_counter()
                logits[name] = runner.prefill(ids, 0)
                times.append(time.perf_counter() - t0)
            best = min(times)
            print(f"prompt {n:>6}  {name:<16}{n / best:>10,.1f} tok/s  ({best:.3f} s; first {n / times[0]:,.1f} tok/s)",
                  flush=True)
        a, b = (v[0] for v in variants)
        same = np.array_equal(logits[a], logits[b])
        print(f"prompt {n:>6}  logits bit-identical: {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
