"""Time strata_moe_gemm_<q> (cuda/moe_gemm.cu) on Qwen3-30B-A3B prompt shapes.

    python tools/moe_gemm_bench.py [--repeats 20] [--tokens 4096] [--only TEXT] [--op moe_gemm_ws] [--json PATH]

--op moe_gemm_ws times cuda/moe_gemm_ws.cu (the same products on Hopper's wgmma; sm_90 builds only);
moe_gemm_ws16 its entry points taking X as f16; moe_gemm_wst its TMA build over f16 weights (tma-gemm's
GEMM: every shape taken as F16, the groups' matrices back to back as the dq scratch holds them). --f16
takes every shape as F16 with the other ops too. --ws-build 256 launches the wgmma library as its 256-row
trial build (STRATA_WS_GEMM_BN=256, one producer warpgroup: 384 threads, 48 KB stages), for a run where
that build's fatbin stands in for the package's (tools/device_deadline.sh with_fatbin).

Each shape's weights are random valid blocks in one device buffer (groups at a fixed stride, as in
an expert blob); X is random. Times are CUDA-event medians over the repeats after warm-up
launches. Prints TFLOP/s (2 * rows * N * K per launch) and the effective weight read rate (every
group's weight bytes once per launch, whatever L2 saves).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from strata.backends.cuda.testing import CudaOps
from strata.backends.cuda.kernels import KERNELS
from strata.backends.cuda.moe_gemm import launch_for, tiles_for, wst_launch_for
from strata.quant import qtype
from strata.quant.random import random_qtensor_bytes

NUM_EXPERTS, TOP_K = 128, 8


def shapes(tokens: int, rng: np.random.Generator) -> list[tuple[str, str, int, int, list[int]]]:
    """(label, qtype, N, K, rows per group). Expert rows: tokens * TOP_K spread unevenly over the
    experts (a Dirichlet draw, each group clipped to 32..512 rows as the prompt's chunks give)."""
    share = rng.dirichlet(np.full(NUM_EXPERTS, 4.0))
    experts = [int(r) for r in np.clip(np.round(share * tokens * TOP_K), 32, 512)]
    return [
        ("experts gate|up", "Q4_K", 1536, 2048, experts),
        ("experts down", "Q4_K", 2048, 768, experts),
        ("experts down", "Q6_K", 2048, 768, experts),
        ("dense q", "Q8_0", 4096, 2048, [tokens]),
        ("dense k/v", "Q8_0", 512, 2048, [tokens]),
        ("dense o", "Q8_0", 2048, 4096, [tokens]),
        ("head", "Q8_0", 151936, 2048, [16]),
    ]


def bench_shape(ops, rng, name, N, K, rows, repeats, op="moe_gemm", ws_build=128):
    rt = ops._rt
    row_bytes = qtype(name).row_bytes(K)
    # the TMA build's groups a whole number of rows apart (the dq scratch: back to back)
    stride = N * row_bytes if op == "moe_gemm_wst" else -(-N * row_bytes // 256) * 256
    G = len(rows)
    blob = rt.DeviceBuffer(ops.device, G * stride)
    one = random_qtensor_bytes(name, (N, K), rng)   # one matrix, copied to every group's place
    for g in range(G):
        blob.copy_from_host(one, ops.stream, offset=g * stride)
    ranges, s = [], 0
    for g, r in enumerate(rows):
        ranges.append((g, s, r))
        s += r
    tiles = tiles_for(ranges)
    X = rng.standard_normal((s, K)).astype(np.float16 if op in ("moe_gemm_ws16", "moe_gemm_wst") else np.float32)
    ptrs = np.array([blob.ptr + g * stride for g in range(G)], np.uint64)
    y = ops._output(s * N * 4)
    x_dev = ops._upload(X)
    args = (ops._upload(ptrs), 0, ops._upload(tiles), x_dev, K, y, N, N, K)
    if op == "moe_gemm_wst":
        kernel = ops._kernel(op)
        grid, tail, shared = wst_launch_for(rt, N, len(tiles), ops.device.multiprocessor_count, x_dev.ptr, s, K,
                                            blob.ptr, G * N, K)
    else:
        kernel = ops._kernel(op, qtype=name)
        grid, tail, shared = launch_for(op, N, len(tiles), ops.device.multiprocessor_count)
    args, block = (*args, *tail), KERNELS[op].block
    if ws_build == 256 and op != "moe_gemm":     # the 256-row build: 384 threads, 4 stages of 48 KB (+ 1024 for wst)
        block, shared = 384, shared + 4 * 16384
    start, end = rt.Event(ops.device, timing=True), rt.Event(ops.device, timing=True)
    times = []
    for i in range(repeats + 3):
        start.record(ops.stream)
        kernel.launch(grid, block, args, shared, stream=ops.stream)
        end.record(ops.stream)
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_ms(end))
    ms = float(np.median(times))
    flops = 2.0 * s * N * K
    return {"qtype": name, "N": N, "K": K, "groups": G, "rows": s, "tiles": len(tiles), "ms": ms,
            "tflops": flops / ms / 1e9, "weight_gbps": G * N * row_bytes / ms / 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens (dense rows; experts get tokens * 8)")
    ap.add_argument("--only", metavar="TEXT", help="only shapes whose label or type contains TEXT")
    ap.add_argument("--op", default="moe_gemm", choices=("moe_gemm", "moe_gemm_ws", "moe_gemm_ws16", "moe_gemm_wst"),
                    help="the kernel library (and entry family)")
    ap.add_argument("--f16", action="store_true", help="every shape's weights as F16 (moe_gemm_wst: always)")
    ap.add_argument("--ws-build", type=int, default=128, choices=(128, 256),
                    help="the wgmma library's build: 128 (the package's) or 256 weight rows an item (a trial fatbin)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    ops = CudaOps()
    rng = np.random.default_rng(0)
    results = []
    print(f"{'shape':<16} {'type':<5} {'N':>7} {'K':>5} {'groups':>6} {'rows':>6} {'ms':>8} {'TFLOP/s':>8} {'W GB/s':>7}")
    for label, name, N, K, rows in shapes(args.tokens, rng):
        if args.only and args.only not in f"{label} {name}":
            continue
        if args.f16 or args.op == "moe_gemm_wst":
            name = "F16"
        r = {"shape": label, **bench_shape(ops, rng, name, N, K, rows, args.repeats, args.op, args.ws_build)}
        results.append(r)
        print(f"{label:<16} {name:<5} {N:>7} {K:>5} {r['groups']:>6} {r['rows']:>6} {r['ms']:>8.3f} "
              f"{r['tflops']:>8.1f} {r['weight_gbps']:>7.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": ops.device.name, "tokens": args.tokens, "op": args.op, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
