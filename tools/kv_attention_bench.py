"""Decode attention over each KV format at Qwen3-30B-A3B's shape (H 32, Hk 4, Dh 128), one sequence:
the f16 split-K kernel (cuda/attention.cu; f16tc: cuda/attention_dec_tc.cu's, on the tensor cores, which
the engine gives rows of TC_DECODE_FROM cells and more) and the quantized ones (cuda/kv_quant.cu: the q
rotation, split-K over the planes, the combine, the output un-rotation), against the device copy rate.

    python tools/kv_attention_bench.py [--cells 16384,32768,131072] [--formats f16,f16tc,int8,k8v4,q4_0]
                                       [--blocks-per-sm N] [--reps N] [--json PATH]

Times are CUDA-event medians after a warm-up. Columns:
  eager   the attention sequence as first written (q rotation, split-K, combine, output un-rotation),
          each kernel launched from Python between two events: the launch gaps included
  graph   the same sequence captured 20 times into one CUDA graph, a replay / 20: kernel time without
          Python's gaps (PDL where the engine uses it, strata.backends.cuda.kernels.PDL_LIBRARIES)
  step    the engine's decode step per layer, as a graph / 20: the fused QK-norm + RoPE + append
          (strata_qk_norm_rope_kv_f32 / _<fmt>, q rotated in it), split-K, the combine (un-rotating V
          in it): what a layer's attention costs inside the decode graph
  split   the split-K kernel alone, as a graph of 20 / 20
Each launch reads another copy of the cache (a layer's, as a decode step reads 48 of them), cycling
through enough copies to outgrow the L2 three times (--warm: one copy, so every launch after the first
finds cells of up to ~50 MB in the L2, as this tool measured until the 23rd session).
GB/s counts the K/V plane bytes of the cells read (values and scales) over the eager and the split
times; "of copy" divides it by the device copy rate (bytes read + written) measured in the same run
(strata.plan.measure_bandwidths). The issue's bar: int8 and q4_0 at 32K cells at 60% of the copy rate
or more.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from strata.backends import rope
import strata.backends.cuda as cuda_backend
from strata.backends.cuda.kernels import CLUSTER_SPLITS, INT32_MAX, KERNELS, PDL_LIBRARIES, decode_quant_shared
from strata.backends.cuda.testing import CudaOps, time_launches
from strata.backends.cuda.kv import rot_scale
from strata.plan import measure_bandwidths
from strata.quant import kv as kvq

H, HK, DH = 32, 4, 128
# f16tc: the f16 cache through cuda/attention_dec_tc.cu; f16cl: through cuda/attention.cu's cluster kernel (the
# split-K over 16 splits and its combine in one launch, sm_90+; --kernels-on cluster-decode's rows)
FORMATS = ("f16", "f16tc", "f16cl", "int8", "k8v4", "q4_0")
GRAPH_REPS = 20
L2_BYTES = 50 << 20     # H100 and H200



def graph_ms(ops, launches, reps: int) -> float:
    """A replay of GRAPH_REPS repetitions of launches(i) (each a list of (op, fields, grid, args) tuples; i the
    repetition), / GRAPH_REPS."""
    g, stream = cuda_backend._graphs(), ops.stream
    pdl = tuple(getattr(ops.device, "compute_capability", (0, 0))) >= (9, 0)
    g.begin_capture(stream)
    try:
        for i in range(GRAPH_REPS):
            for op, fields, grid, args, *shared in launches(i):
                ops._kernel(op, **fields).launch(grid, KERNELS[op].block, args, *shared, stream=stream,
                                                 pdl=pdl and KERNELS[op].library in PDL_LIBRARIES)
    finally:
        graph = g.end_capture(stream)
    exec_ = graph.instantiate()
    graph.destroy()
    exec_.upload(stream)
    try:
        return time_launches(ops, lambda: exec_.launch(stream), reps) / GRAPH_REPS
    finally:
        stream.synchronize()
        exec_.destroy()


def bench(ops, rng, fmt: str, S: int, reps: int, blocks_per_sm: int = 2, warm: bool = False,
          ring: bool = True, cache_cells: int = 0) -> dict:
    rt, dev, stream = ops._rt, ops.device, ops.stream
    splits = ops.decode_splits(1, HK, max(S, cache_cells), DH, blocks_per_sm)
    q = ops._upload(rng.standard_normal((1, H, DH)).astype(np.float32))
    lengths = ops._upload(np.array([S], np.int32))
    acc, ml = rt.DeviceBuffer(dev, H * splits * DH * 4), rt.DeviceBuffer(dev, H * splits * 8)
    out = rt.DeviceBuffer(dev, H * DH * 4)
    combine = ops._kernel("attention_combine")
    gp = H // HK
    rot = rot_scale(DH)
    x = rng.standard_normal((S, HK, DH)).astype(np.float32)
    cluster = fmt == "f16cl"            # one launch: the split-K over CLUSTER_SPLITS splits and its combine
    if cluster and tuple(getattr(dev, "compute_capability", (0, 0))) < (9, 0):
        raise SystemExit("kv_attention_bench: f16cl needs an sm_90 GPU (thread block clusters)")
    if fmt in ("f16", "f16tc", "f16cl"):
        host = [x.astype(np.float16), x.astype(np.float16)]
        split_op = {"f16": "attention_decode", "f16tc": "attention_decode_tc", "f16cl": "attention_decode_cl"}[fmt]
        fields = {"dh": DH, "g": gp}
        k_rot = v_rot = False
    else:
        kc, vc = kvq.codecs(fmt)
        host = [np.ascontiguousarray(a) for c in (kc, vc) for a in c.encode(x)]
        split_op, fields = "attention_decode_quant", {"fmt": fmt, "dh": DH, "g": gp}
        k_rot, v_rot = kc.rotated, vc.rotated
    shared = decode_quant_shared(fmt, DH, getattr(dev, "compute_capability", None)) if ring else 0
    nbytes = sum(a.nbytes for a in host)
    layers = 1 if warm else -(-3 * L2_BYTES // nbytes)       # copies of the cache, each launch the next one's
    copies = [[ops._upload(a) for a in host] for _ in range(layers)]
    split = ops._kernel(split_op, **fields)
    rotate = ops._kernel("hadamard") if (k_rot or v_rot) else None
    split_grid = (CLUSTER_SPLITS, HK, 1) if cluster else (splits, HK, 1)

    def split_args(i: int) -> tuple:
        planes = copies[i % layers]
        if cluster:                         # below: every row the kernel's
            return (q, *planes, lengths, 0, out, H, HK, S, DH ** -0.5, 0, 0, 0, 0, 0, INT32_MAX)
        a = (q, *planes, lengths, 0, acc, ml, H, HK, S, splits, DH ** -0.5, 0, 0, *(0,) * len(planes), 0)
        if fmt in ("f16", "f16tc"):         # tc_from: every row the kernel's
            a += (0 if fmt == "f16tc" else INT32_MAX,)
        return a
    turn = [0]

    def launch():
        if k_rot:
            rotate.launch(H, 32, (q, H, DH, rot), stream=stream)
        split.launch(split_grid, 128, split_args(turn[0]), shared, stream=stream)
        turn[0] += 1
        if not cluster:                     # the cluster kernel combines in its own launch
            combine.launch((H, 1), 128, (acc, ml, out, H, DH, splits), stream=stream)
        if v_rot:
            rotate.launch(H, 32, (out, H, DH, rot), stream=stream)
    ms = time_launches(ops, launch, reps)

    # the same sequence as a graph; the split alone; the engine's step (cuda/decode_fused.cu's fused append
    # of the token at cell S - 1, the split, the combine with the un-rotation in it)
    combines = [] if cluster else [("attention_combine", {}, (H, 1), (acc, ml, out, H, DH, splits))]

    def seq(i: int) -> list:
        return ([("hadamard", {}, H, (q.ptr, H, DH, rot))] if k_rot else []) + [
            (split_op, fields, split_grid, split_args(i), shared)] + combines + (
            [("hadamard", {}, H, (out.ptr, H, DH, rot))] if v_rot else [])
    graph = graph_ms(ops, seq, reps)
    split_only = graph_ms(ops, lambda i: [(split_op, fields, split_grid, split_args(i), shared)], reps)
    inv, rscale = rope.inv_freq(DH, 1e6, None, 262144)
    qkv = [ops._upload(rng.standard_normal((1, n, DH)).astype(np.float32)) for n in (H, HK, HK)]
    qw, kw = (ops._upload(rng.uniform(0.5, 1.5, DH).astype(np.float32)) for _ in range(2))
    pos, inv_dev = ops._upload(np.array([S - 1], np.int32)), ops._upload(np.asarray(inv, np.float32))
    norm_args = (*qkv, qw, kw, pos, 0, inv_dev, q)

    def append(i: int) -> tuple:
        planes = copies[i % layers]
        if fmt in ("f16", "f16tc", "f16cl"):
            return ("qk_norm_rope_kv", {}, (1, -(-(H + 2 * HK) // 4)),
                    (*norm_args, *planes, 1, H, HK, DH, 1e-6, float(rscale)))
        return ("qk_norm_rope_kv_quant", {"fmt": fmt}, (1, -(-(H + 2 * HK) // 4)),
                (*norm_args, *planes, 1, H, HK, DH, 1e-6, float(rscale), rot))
    final = ([("attention_combine_rot", {}, (H, 1), (acc, ml, out, H, DH, splits, rot))] if v_rot else combines)
    step = graph_ms(ops, lambda i: [append(i), (split_op, fields, split_grid, split_args(i), shared), *final], reps)
    return {"kv": fmt, "cells": S, "splits": split_grid[0], "layers": layers, "ring_bytes": shared, "us": ms * 1e3, "graph_us": graph * 1e3,
            "step_us": step * 1e3,
            "split_us": split_only * 1e3, "kv_bytes": nbytes, "gb_s": nbytes / ms / 1e6,
            "split_gb_s": nbytes / split_only / 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="16384,32768,131072")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated KV formats")
    ap.add_argument("--blocks-per-sm", type=int, default=2,
                    help="splits sized for this many blocks a multiprocessor (the engine's: 2); for a build whose "
                         "decode kernels fit more (__launch_bounds__)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--registers", action="store_true",
                    help="the quantized kernels without their cp.async ring (no dynamic shared memory): a tile a warp in registers")
    ap.add_argument("--warm", action="store_true",
                    help="one copy of the cache for every launch (cells of up to ~50 MB stay in the L2), not a layer's each")
    ap.add_argument("--cache-cells", type=int, default=0,
                    help="size the split-K kernels' splits for a cache of this many cells (the engine's: the context's), "
                         "not the cells read")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.blocks_per_sm < 1:
        ap.error("--blocks-per-sm: at least 1")
    formats = args.formats.split(",")
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        ap.error(f"--formats: unknown KV format(s) {', '.join(unknown)} ({', '.join(FORMATS)})")
    ops, rng = CudaOps(), np.random.default_rng(0)
    copy = measure_bandwidths(ops._rt, ops.device, 256 << 20).device_copy_gb_s
    rows = []
    for S in (int(c) for c in args.cells.split(",")):
        for fmt in formats:
            r = bench(ops, rng, fmt, S, args.reps, args.blocks_per_sm, args.warm, not args.registers,
                      args.cache_cells)
            r["of_copy"], r["split_of_copy"] = r["gb_s"] / copy, r["split_gb_s"] / copy
            rows.append(r)
            print(f"{fmt:>5} {S:>7} cells x{r['layers']:<3} eager {r['us']:7.1f}  graph {r['graph_us']:7.1f}  step {r['step_us']:7.1f}  "
                  f"split {r['split_us']:7.1f} us  {r['kv_bytes'] / 2**20:7.1f} MiB  of the {copy:,.0f} GB/s "
                  f"copy rate: eager {r['of_copy']:6.1%}, split {r['split_of_copy']:6.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device_copy_gb_s": copy, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
