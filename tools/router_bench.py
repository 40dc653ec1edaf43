"""A decode step's routers alone: 48 layers' F32 routers (E x D, default Qwen3-30B-A3B's 128 x 2048,
top 8) launched back to back from a CUDA graph with programmatic dependent launches, as a step runs
them, in two arms: the router GEMV that routes in its last block (strata_router_*, the fused-route
path) and the GEMV followed by strata_moe_route_f32. Prints us a layer for each token count and the
sha256 of the last launch's ids and weights (the same seed gives the same inputs, so builds compare).

    python tools/router_bench.py [--tokens 1,4] [--layers 48] [--E 128] [--D 2048] [--A 8] [--router-grid N]
                                 [--json F]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np

from strata.backends.cuda.memory import gemv_grid, router_grid
from strata.backends.cuda.testing import CudaOps
from moe_decode_bench import graph_ms  # tools/ is on sys.path when run as a script


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--E", type=int, default=128)
    p.add_argument("--D", type=int, default=2048)
    p.add_argument("--A", type=int, default=8)
    p.add_argument("--router-grid", type=int, default=0, help="blocks of the fusing router (0: memory.router_grid)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    ops = CudaOps()
    pdl = tuple(getattr(ops.device, "compute_capability", (0, 0))) >= (9, 0)
    rng = np.random.default_rng(0)
    E, D, A, L = args.E, args.D, args.A, args.layers
    W = [ops._upload((rng.standard_normal((E, D)) * 0.05).astype(np.float32)) for _ in range(L)]
    grid, grid_gemv = args.router_grid or router_grid(E, D), 4 * gemv_grid("F32", E, D)
    counter = ops._upload(np.zeros(64, np.int32))
    k_split, k_rows = ops._kernel("router_split"), ops._kernel("router_rows_split")
    g_split, g_rows = ops._kernel("gemv_split", qtype="F32"), ops._kernel("gemv_rows_split", qtype="F32")
    route = ops._kernel("moe_route")
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        x = ops._upload(rng.standard_normal((T, D)).astype(np.float32))
        y = ops._rt.DeviceBuffer(ops.device, T * E * 4)
        ids, wts = ops._rt.DeviceBuffer(ops.device, T * A * 4), ops._rt.DeviceBuffer(ops.device, T * A * 4)

        def fused(st):
            for w in W:
                if T == 1:
                    k_split.launch(grid, 128, (w, x, y, E, D, ids, wts, counter, A, 1), 0, stream=st, pdl=pdl)
                else:
                    k_rows.launch(grid, 128, (w, x, y, E, D, T, ids, wts, counter, A, 1), 0, stream=st, pdl=pdl)

        def apart(st):
            for w in W:
                if T == 1:
                    g_split.launch(grid_gemv, 128, (w, x, y, E, D), 0, stream=st, pdl=pdl)
                else:
                    g_rows.launch(grid_gemv, 128, (w, x, y, E, D, T), 0, stream=st, pdl=pdl)
                route.launch(max(1, -(-T // 4)), 128, (y, ids, wts, T, E, A, 1), 0, stream=st, pdl=pdl)
        for name, fn in (("fused", fused), ("apart", apart), ("fused", fused), ("apart", apart)):
            us = 1e3 * graph_ms(ops._rt, ops.device, ops.stream, fn, reps=7) / L
            got_i, got_w = np.empty((T, A), np.int32), np.empty((T, A), np.float32)
            ids.copy_to_host(got_i, ops.stream)
            wts.copy_to_host(got_w, ops.stream)
            ops.stream.synchronize()
            digest = hashlib.sha256(got_i.tobytes() + got_w.tobytes()).hexdigest()[:16]
            rows.append({"T": T, "arm": name, "us_per_layer": us, "digest": digest})
            print(f"T {T} {name:6s} {us:7.2f} us a layer   ids+weights {digest}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
