"""Throughput of the host's expert kernels (strata._ext.cpu_experts) at one expert shape: weight GB/s
and integer Gop/s per thread count and row count, against the host's memory copy rate measured in the
same run (numpy copy of a 1 GiB buffer), so the split of #18 can price the host cores.

    python tools/cpu_expert_bench.py [--shape qwen3-30b-a3b] [--threads 1,4,16] [--rows 1,8,64] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

SHAPES = {  # hidden, expert intermediate, (gate, up, down) types of the anchor's Q4_K_M mix
    "qwen3-30b-a3b": (2048, 768, ("Q4_K", "Q4_K", "Q6_K")),
    "qwen3-next-80b-a3b": (2048, 512, ("Q4_K", "Q4_K", "Q6_K")),
}


def _time(fn, seconds=0.4):
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--threads", default=f"1,{min(4, os.cpu_count())},{os.cpu_count()}")
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--experts", type=int, default=8, help="distinct experts cycled, so weights come from RAM")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from strata._ext import cpu_experts as ce
    from strata.quant.random import random_qtensor_bytes

    D, I, (tg, tu, td) = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    experts = [(random_qtensor_bytes(tg, (I, D), rng), random_qtensor_bytes(tu, (I, D), rng),
                random_qtensor_bytes(td, (D, I), rng)) for _ in range(args.experts)]
    nbytes = sum(a.nbytes for a in experts[0])
    big = np.ones(1 << 28, np.float32)
    copy_gb_s = 2 * big.nbytes / _time(lambda: big.copy(), 1.0) / 1e9
    print(f"{args.shape}: expert {nbytes / 1e6:.2f} MB ({tg}/{tu}/{td}), simd {ce.simd()}, "
          f"host copy {copy_gb_s:.1f} GB/s (read + write)")
    rows = []
    for threads in sorted({int(t) for t in args.threads.split(",")}):
        ce.set_threads(threads)
        for T in (int(t) for t in args.rows.split(",")):
            x = rng.standard_normal((T, D)).astype(np.float32)
            k = [0]

            def one():
                g, u, d = experts[k[0] % len(experts)]
                k[0] += 1
                ce.expert_ffn(tg, g, tu, u, td, d, D, I, x)
            dt = _time(one)
            gb_s, gops = nbytes / dt / 1e9, 6 * D * I * T / dt / 1e9
            rows.append({"threads": threads, "rows": T, "ms": dt * 1e3, "weights_gb_s": gb_s, "gop_s": gops})
            print(f"threads {threads:>3} rows {T:>4}: {dt * 1e3:8.3f} ms an expert, weights {gb_s:6.2f} GB/s "
                  f"({gb_s / copy_gb_s:5.1%} of copy), {gops:7.1f} Gop/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "simd": ce.simd(), "copy_gb_s": copy_gb_s, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
