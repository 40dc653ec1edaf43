"""Decode attention over each KV format at Qwen3-30B-A3B's shape (H 32, Hk 4, Dh 128), one sequence:
the f16 split-K kernel (cuda/attention.cu) and the quantized ones (cuda/kv_quant.cu: the q rotation,
split-K over the planes, the combine, the output un-rotation), against the device copy rate.

    python tools/kv_attention_bench.py [--cells 16384,32768,131072] [--reps N] [--json PATH]

Times are CUDA-event medians of back-to-back launch sequences after a warm-up. GB/s counts the K/V
plane bytes of the cells read (values and scales); "of copy" divides it by the device copy rate
(bytes read + written) measured in the same run (strata.plan.measure_bandwidths). The issue's bar:
int8 and q4_0 at 32K cells at 60% of the copy rate or more.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from strata.backends.cuda.testing import CudaOps
from strata.backends.cuda.kv import rot_scale
from strata.plan import measure_bandwidths
from strata.quant import kv as kvq

H, HK, DH = 32, 4, 128


def time_ms(ops, launch, reps: int) -> float:
    rt, stream = ops._rt, ops.stream
    launch()
    stream.synchronize()
    times = []
    for _ in range(reps):
        start, end = rt.Event(ops.device, timing=True), rt.Event(ops.device, timing=True)
        start.record(stream)
        launch()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_ms(end))
    return float(np.median(times))


def bench(ops, rng, fmt: str, S: int, reps: int) -> dict:
    rt, dev, stream = ops._rt, ops.device, ops.stream
    splits = ops.decode_splits(1, HK, S, DH)
    q = ops._upload(rng.standard_normal((1, H, DH)).astype(np.float32))
    lengths = ops._upload(np.array([S], np.int32))
    acc, ml = rt.DeviceBuffer(dev, H * splits * DH * 4), rt.DeviceBuffer(dev, H * splits * 8)
    out = rt.DeviceBuffer(dev, H * DH * 4)
    combine = ops._kernel("attention_combine")
    gp = H // HK
    x = rng.standard_normal((S, HK, DH)).astype(np.float32)
    if fmt == "f16":
        planes = [ops._upload(x.astype(np.float16)), ops._upload(x.astype(np.float16))]
        nbytes = sum(p.nbytes for p in planes)
        split = ops._kernel("attention_decode", dh=DH, g=gp)
        k_rot = v_rot = False
    else:
        kc, vc = kvq.codecs(fmt)
        planes = [ops._upload(np.ascontiguousarray(a)) for c in (kc, vc) for a in c.encode(x)]
        nbytes = sum(p.nbytes for p in planes)
        split = ops._kernel("attention_decode_quant", fmt=fmt, dh=DH, g=gp)
        k_rot, v_rot = kc.rotated, vc.rotated
    rotate = ops._kernel("hadamard") if (k_rot or v_rot) else None

    def launch():
        if k_rot:
            rotate.launch(H, 32, (q, H, DH, rot_scale(DH)), stream=stream)
        split.launch((splits, HK, 1), 128, (q, *planes, lengths, 0, acc, ml, H, HK, S, splits, DH ** -0.5),
                     stream=stream)
        combine.launch((H, 1), 128, (acc, ml, out, H, DH, splits), stream=stream)
        if v_rot:
            rotate.launch(H, 32, (out, H, DH, rot_scale(DH)), stream=stream)
    ms = time_ms(ops, launch, reps)
    return {"kv": fmt, "cells": S, "splits": splits, "us": ms * 1e3, "kv_bytes": nbytes, "gb_s": nbytes / ms / 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="16384,32768,131072")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    ops, rng = CudaOps(), np.random.default_rng(0)
    copy = measure_bandwidths(ops._rt, ops.device, 256 << 20).device_copy_gb_s
    rows = []
    for S in (int(c) for c in args.cells.split(",")):
        for fmt in ("f16", "int8", "k8v4", "q4_0"):
            r = bench(ops, rng, fmt, S, args.reps)
            r["of_copy"] = r["gb_s"] / copy
            rows.append(r)
            print(f"{fmt:>5} {S:>7} cells  {r['us']:8.1f} us  {r['kv_bytes'] / 2**20:7.1f} MiB  "
                  f"{r['gb_s']:7.0f} GB/s  {r['of_copy']:6.1%} of the {copy:,.0f} GB/s copy rate")
    if args.json:
        Path(args.json).write_text(json.dumps({"device_copy_gb_s": copy, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
