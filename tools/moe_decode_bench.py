"""GB/s of expert weights read by strata_moe_gate_up_<q> and strata_moe_down_<q> (cuda/moe_decode.cu)
at decode shapes, launched from a CUDA graph as the decode step runs them.

    python tools/moe_decode_bench.py [--types Q4_K,Q6_K] [--tokens 1,4] [--blocks-per-sm 1,2,4,8]
                                     [--host] [--digest] [--json PATH]

Default shape Qwen3-30B-A3B (D 2048, I 768, A 8, gate|up fused). Each timed launch routes its tokens
to distinct experts (T * A of them) drawn from a pool of --experts per type (default 256 Q4_K
experts: 680 MB, ten times the L2), a fresh routing per launch, so weights come from HBM (or, with
--host, from pinned host memory over the bus). A graph of --reps launches is timed with events;
us per launch and GB/s (weight bytes / time) are printed for each gx choice (blocks per SM), with
the device-to-device copy rate (torch, read + write) beside when torch has CUDA.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np

from strata.backends import cuda as cuda_backend
from strata.backends.cuda.moe_decode import MoeDecodeOps, down_launch, gate_up_launch
from strata.quant import qtype
from strata.quant.random import random_qtensor_bytes
from quant_kernel_report import copy_rate_gbps  # tools/ is on sys.path when run as a script


def expert_pool(mo: MoeDecodeOps, q: str, E: int, I: int, D: int, host: bool, rng):
    """E blobs [gate | up | down] of one random expert each (the bytes repeat: speed is all that is
    measured), in device or pinned host memory; (pointer table on the device, offsets, buffers)."""
    qt = qtype(q)
    gate_bytes, down_bytes = I * qt.row_bytes(D), D * qt.row_bytes(I)
    down_off = -(-2 * gate_bytes // 256) * 256
    blob_bytes = -(-(down_off + down_bytes) // 256) * 256
    blob = np.zeros(blob_bytes, np.uint8)
    blob[:2 * gate_bytes] = random_qtensor_bytes(q, (2 * I, D), rng)
    blob[down_off:down_off + down_bytes] = random_qtensor_bytes(q, (D, I), rng)
    rt = mo.rt
    if host:
        buf = rt.HostBuffer(mo.device, E * blob_bytes)
        np.frombuffer(buf, np.uint8).reshape(E, blob_bytes)[:] = blob
    else:
        buf = rt.DeviceBuffer(mo.device, E * blob_bytes)
        for e in range(E):
            buf.copy_from_host(blob, mo.stream, offset=e * blob_bytes)
    ptrs = (buf.ptr + blob_bytes * np.arange(E, dtype=np.uint64)).astype(np.uint64)
    return mo.ops._upload(ptrs), (0, gate_bytes, down_off), buf


def graph_ms(rt, device, stream, launch_all, reps: int = 5) -> float:
    """Milliseconds for one replay of a graph that `launch_all(stream)` records (median of reps, after
    one warm-up replay): the runtime rt's events on `device`."""
    graphs = cuda_backend._graphs()
    graphs.begin_capture(stream)
    try:
        launch_all(stream)
    finally:
        graph = graphs.end_capture(stream)
    exe = graph.instantiate()
    exe.upload(stream)
    exe.launch(stream)  # warm-up
    start, end = rt.Event(device, timing=True), rt.Event(device, timing=True)
    times = []
    for _ in range(reps):
        start.record(stream)
        exe.launch(stream)
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_ms(end))
    exe.destroy()
    graph.destroy()
    return float(np.median(times))


def time_graph(mo: MoeDecodeOps, launch_all) -> float:
    """graph_ms on mo's device and stream."""
    return graph_ms(mo.rt, mo.device, mo.stream, launch_all)


def bench_type(mo: MoeDecodeOps, q: str, args, rng) -> list[dict]:
    I, D, A = args.I, args.D, args.A
    ptrs, (gate_off, up_off, down_off), pool = expert_pool(mo, q, args.experts, I, D, args.host, rng)
    qt, rows = qtype(q), []
    for T in args.tokens:
        S = T * A
        ids = [mo.ops._upload(rng.permutation(args.experts)[:S].astype(np.int32)) for _ in range(args.reps)]
        x = mo.ops._upload(rng.standard_normal((T, D)).astype(np.float32))
        h = mo.ops._upload(rng.standard_normal((S, I)).astype(np.float32))
        w = mo.ops._upload(rng.uniform(0.05, 1, S).astype(np.float32))
        out = mo.rt.DeviceBuffer(mo.device, T * D * 4)
        gu_bytes, down_bytes = S * 2 * I * qt.row_bytes(D), S * D * qt.row_bytes(I)
        for bps in args.blocks_per_sm:
            g = gate_up_launch(q, T, A, I, D, mo.num_sms, bps)
            d = down_launch(q, T, A, D, I, mo.num_sms, bps)
            kg = mo.ops._kernel(g.op, qtype=g.qtype)
            kd = mo.ops._kernel(d.op, qtype=d.qtype)
            run_g = lambda st: [kg.launch(g.grid, g.block, (ptrs, gate_off, up_off, i, x, h, A, I, D),  # noqa: E731
                                          g.shared_bytes, stream=st) for i in ids]
            run_d = lambda st: [kd.launch(d.grid, d.block, (ptrs, down_off, i, h, w, out, A, D, I),  # noqa: E731
                                          d.shared_bytes, stream=st) for i in ids]
            both = lambda st: [(kg.launch(g.grid, g.block, (ptrs, gate_off, up_off, i, x, h, A, I, D),  # noqa: E731
                                          g.shared_bytes, stream=st),
                                kd.launch(d.grid, d.block, (ptrs, down_off, i, h, w, out, A, D, I),
                                          d.shared_bytes, stream=st)) for i in ids]
            us = {k: 1e3 * time_graph(mo, f) / args.reps for k, f in (("gate_up", run_g), ("down", run_d),
                                                                      ("both", both))}
            row = {"qtype": q, "T": T, "blocks_per_sm": bps, "gx_gate_up": g.grid[0], "gx_down": d.grid[0],
                   "gate_up_us": us["gate_up"], "down_us": us["down"], "both_us": us["both"],
                   "gate_up_gbps": gu_bytes / us["gate_up"] / 1e3, "down_gbps": down_bytes / us["down"] / 1e3,
                   "both_gbps": (gu_bytes + down_bytes) / us["both"] / 1e3, "weight_bytes": gu_bytes + down_bytes}
            rows.append(row)
            print(f"{q:7s} T {T} bps {bps} (gx {g.grid[0]:4d}/{d.grid[0]:4d}): gate_up {us['gate_up']:7.2f} us "
                  f"{row['gate_up_gbps']:7.0f} GB/s | down {us['down']:7.2f} us {row['down_gbps']:7.0f} GB/s | "
                  f"both {us['both']:7.2f} us {row['both_gbps']:7.0f} GB/s ({(gu_bytes + down_bytes) / 1e6:.1f} MB)",
                  flush=True)
        if args.digest:         # one eager launch of each (the last grid above) on the first routing: the bits
            kg.launch(g.grid, g.block, (ptrs, gate_off, up_off, ids[0], x, h, A, I, D), g.shared_bytes, stream=mo.stream)
            kd.launch(d.grid, d.block, (ptrs, down_off, ids[0], h, w, out, A, D, I), d.shared_bytes, stream=mo.stream)
            hh, oo = np.empty((S, I), np.float32), np.empty((T, D), np.float32)
            h.copy_to_host(hh, mo.stream)
            out.copy_to_host(oo, mo.stream)
            mo.stream.synchronize()
            print(f"digest {q} T {T}: h {hashlib.sha256(hh.tobytes()).hexdigest()[:16]} "
                  f"out {hashlib.sha256(oo.tobytes()).hexdigest()[:16]} (finite {bool(np.isfinite(oo).all())})", flush=True)
    del pool
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q5_K,IQ4_XS,Q2_K,Q4_0,F16")
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--blocks-per-sm", default="1,2,4,8")
    p.add_argument("--D", type=int, default=2048)
    p.add_argument("--I", type=int, default=768)
    p.add_argument("--A", type=int, default=8)
    p.add_argument("--experts", type=int, default=0, help="pool size per type (default: ~680 MB of it, >= 64)")
    p.add_argument("--reps", type=int, default=50, help="launches per graph, each with its own routing")
    p.add_argument("--host", action="store_true", help="experts in pinned host memory (zero-copy over the bus)")
    p.add_argument("--digest", action="store_true", help="also print sha256 of h and out after one eager launch "
                   "of each kernel per token count (the same seed gives the same inputs: compares builds' bits)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.blocks_per_sm = [int(b) for b in args.blocks_per_sm.split(",")]
    mo = MoeDecodeOps()
    rng = np.random.default_rng(0)
    copy = None if args.host else copy_rate_gbps()
    print(f"{mo.device.name}, {mo.num_sms} SMs; device copy {copy and f'{copy:.0f} GB/s (read + write)'}; "
          f"D {args.D} I {args.I} A {args.A}, weights in {'pinned host' if args.host else 'device'} memory")
    rows = []
    for q in args.types.split(","):
        qt = qtype(q)
        blob = 2 * args.I * qt.row_bytes(args.D) + args.D * qt.row_bytes(args.I)
        want = max(64, max(args.tokens) * args.A, int(680e6 // blob))
        n = args.experts or (min(want, int(4e9 // blob)) if args.host else want)
        rows += bench_type(mo, qt.name, argparse.Namespace(**{**vars(args), "experts": n}), rng)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_rate_gbps": copy, "device": mo.device.name, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
