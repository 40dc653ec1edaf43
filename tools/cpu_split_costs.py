"""What the host's share of a chunk's misses (--cpu-experts) pays on this machine, part by part, so
the split's cost model (strata/engine/expert_split.py) can be checked against its fixed costs:

- the kernel bench's rates (one expert's blob, back to back from this thread: warm caches, the pool
  never idle: what the first cost model measured at load) against the engine path's
  (host_compute.measure_path: jobs on the worker thread, experts not in the caches, an idle gap
  before each, the submitting thread busy meanwhile): the factors between them;
- the pool's dispatch (cpu_experts runs three per expert: gate, up, down), back to back and after idle;
- the worker's round trip (ThreadPoolExecutor submit -> result), back to back and after idle;
- the worker's Python an expert (ffn_sum with the kernel swapped for a no-op);
- choosing a split at a layer (HostExperts.choose over a 19-token routing, all experts missed);
- the pool sized to every core against one left to the engine's thread, both through the path.
The device reads (ops.to_host of the rows and weights) and the GPU's resume need a GPU: the runner
measures the reads at load (cuda_load.measure_sync).

    python tools/cpu_split_costs.py [--shape qwen3-30b-a3b] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # hidden, expert intermediate, experts, top-k, (gate, up, down) types of the anchor's Q4_K_M mix
    "qwen3-30b-a3b": (2048, 768, 128, 8, ("Q4_K", "Q4_K", "Q6_K")),
    "qwen3-next-80b-a3b": (2048, 512, 512, 10, ("Q4_K", "Q4_K", "Q6_K")),
}


def _median(fn, n: int, gap: float = 0.0) -> float:
    times = []
    for i in range(n):
        if gap:
            time.sleep(gap)
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--repeats", type=int, default=11, help="jobs of each kind through the path (the median counts)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from strata._ext import cpu_experts as ce
    from strata.engine.expert_split import BENCH_HOST_RATES, HostRates
    from strata.engine.experts import host_compute as hc
    from strata.quant.random import random_qtensor_bytes

    D, I, E, A, (tg, tu, td) = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    pieces = [np.frombuffer(random_qtensor_bytes(q, shape, rng), np.uint8)
              for q, shape in ((tg, (I, D)), (tu, (I, D)), (td, (D, I)))]
    parts, at = {}, 0
    for name, q, b, shape in zip(("gate", "up", "down"), (tg, tu, td), pieces, ((I, D), (I, D), (D, I))):
        parts[name] = {"qtype": q, "shape": list(shape), "offset": at, "nbytes": b.size}
        at += b.size
    blob = np.concatenate(pieces)
    n = hc.MEASURE_EXPERTS * args.repeats
    arena = np.tile(blob, n)
    base = np.arange(n, dtype=np.int64) * blob.size
    cores = hc.host_threads() + 1
    out = {"shape": args.shape, "blob_bytes": int(blob.size), "cores": cores, "simd": ce.simd()}
    print(f"{args.shape}: expert {blob.size / 1e6:.2f} MB ({tg}/{tu}/{td}), {cores} cores, simd {ce.simd()}")

    def ffn(e, x):
        b = int(base[e])
        return ce.expert_ffn(tg, arena[b:b + parts["gate"]["nbytes"]], tu,
                             arena[b + parts["up"]["offset"]:b + parts["up"]["offset"] + parts["up"]["nbytes"]], td,
                             arena[b + parts["down"]["offset"]:b + parts["down"]["offset"] + parts["down"]["nbytes"]],
                             D, I, x)

    def bench_rates(threads: int) -> HostRates:
        """measure_host_rates' old way: one blob, best of 3, back to back from this thread."""
        ce.set_threads(threads)
        best = {}
        for T in (1, 8):
            x = rng.standard_normal((T, D)).astype(np.float32)
            ffn(0, x)
            best[T] = min(_median(lambda i: ffn(0, x), 1) for _ in range(3))
        row = (best[8] - best[1]) / 7
        return HostRates(best[1] - row, row, int(blob.size), "bench")

    def path_rates(threads: int) -> HostRates:
        ce.set_threads(threads)
        picks = [(0, [r * hc.MEASURE_EXPERTS + i for i in range(hc.MEASURE_EXPERTS)]) for r in range(args.repeats)]
        with ThreadPoolExecutor(1) as worker:
            return hc.measure_path(lambda layer, experts, x, ids, w, o: hc.ffn_sum(ce.expert_ffn, arena, parts, base, D,
                                                                                 experts, x, ids, w, o),
                                   worker, picks, D, int(blob.size), "path", repeats=args.repeats)

    rows = {}
    for threads in sorted({cores, max(1, cores - 1)}, reverse=True):
        b, p = bench_rates(threads), path_rates(threads)
        rows[threads] = {"bench_expert_ms": b.expert_s * 1e3, "bench_row_ms": b.row_s * 1e3,
                         "path_expert_ms": p.expert_s * 1e3, "path_row_ms": p.row_s * 1e3,
                         "path_round_trip_ms": p.layer_s * 1e3,
                         "expert_factor": p.expert_s / b.expert_s, "row_factor": p.row_s / b.row_s}
        r = rows[threads]
        print(f"{threads:>2} threads: bench {r['bench_expert_ms']:.3f} ms an expert + {r['bench_row_ms']:.3f} a row;"
              f" path {r['path_expert_ms']:.3f} + {r['path_row_ms']:.3f} (x{r['expert_factor']:.2f}, "
              f"x{r['row_factor']:.2f}), round trip {r['path_round_trip_ms']:.3f} ms")
    out["rates"] = rows
    ce.set_threads(cores)       # the pool's dispatch with every core's thread

    w = np.frombuffer(random_qtensor_bytes("Q8_0", (64, 32), rng), np.uint8)
    x1 = rng.standard_normal((1, 32)).astype(np.float32)
    if ce.threads() > 1:
        out["pool_dispatch_ms"] = {
            "back_to_back": _median(lambda i: ce.matmul("Q8_0", w, 64, 32, x1), 200) * 1e3,
            "after_1ms_idle": _median(lambda i: ce.matmul("Q8_0", w, 64, 32, x1), 50, 1e-3) * 1e3}
    ce.set_threads(hc.host_threads())
    with ThreadPoolExecutor(1) as worker:
        worker.submit(lambda: None).result()
        out["worker_round_trip_ms"] = {
            "back_to_back": _median(lambda i: worker.submit(lambda: None).result(), 200) * 1e3,
            "after_1ms_idle": _median(lambda i: worker.submit(lambda: None).result(), 50, 1e-3) * 1e3}
    ids = rng.integers(0, E, (19, A))
    experts = np.unique(ids)[:8].tolist()
    o = np.zeros((19, D), np.float32)
    xs = rng.standard_normal((19, D)).astype(np.float32)
    wts = np.full((19, A), 0.125, np.float32)
    py = _median(lambda i: hc.ffn_sum(lambda *a: np.zeros((len(a[-1]), D), np.float32), arena, parts, base, D,
                                      experts, xs, ids, wts, o), 200)
    out["worker_python_ms_an_expert"] = py / len(experts) * 1e3
    fake = hc.HostExperts.__new__(hc.HostExperts)
    fake.store = SimpleNamespace(slot_of=np.full((1, E), -1), pinned=np.ones((1, E), bool),
                                 layers_meta=[{"blob_bytes": int(blob.size)}])
    fake.rates, fake.h2d_gb_s, fake.share = BENCH_HOST_RATES, 55.4, None
    out["choose_ms"] = _median(lambda i: fake.choose(0, ids, None), 200) * 1e3
    for k in ("pool_dispatch_ms", "worker_round_trip_ms"):
        if k in out:
            print(f"{k}: back to back {out[k]['back_to_back']:.3f}, after 1 ms idle {out[k]['after_1ms_idle']:.3f}")
    print(f"worker Python an expert (no-op kernel) {out['worker_python_ms_an_expert']:.3f} ms; "
          f"choose over a 19-token routing {out['choose_ms']:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
