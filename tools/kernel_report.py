"""Accuracy and speed of the non-GEMM CUDA kernels at Qwen3-30B-A3B's sizes, as one table.

    python tools/kernel_report.py [--json PATH]

Run on a GPU machine after the build (tools/device_check.sh does the build). Each op gets fresh
random inputs and is compared with the numpy reference: `err` is max|gpu - ref| / max|ref| (per head
for attention), or the count of mismatches for integer outputs. Decode attention (H 32, Hk 4,
Dh 128, f16 K/V) is timed with launches queued behind a long memset, so the GPU runs them back to
back as a CUDA graph would, rotating through enough caches that K/V never sit in L2; its GB/s is the
K/V bytes read over the time, beside the device-to-device copy rate measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from strata.backends import cpu, rope
from strata.backends.cuda.kernels import INT32_MAX
from strata.backends.cuda.testing import CudaOps
from strata.quant.dequant import dequantize_rows
from strata.quant.random import random_qtensor_bytes

from quant_kernel_report import copy_rate_gbps  # tools/ is on sys.path when run as a script

H, HK, DH, D, E, A, I, V = 32, 4, 128, 2048, 128, 8, 768, 151936


def rel(out, ref) -> float:
    return float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())


def head_rel(out, ref) -> float:
    err = np.abs(out.astype(np.float64) - ref).reshape(out.shape[0], H, DH).max(-1)
    return float((err / np.abs(ref).reshape(out.shape[0], H, DH).max(-1)).max())


def attention_ref(q, keys, values, positions):
    f64 = np.float64
    return cpu.causal_attention(q.astype(f64), keys.astype(f64), values.astype(f64), positions)


def accuracy(ops: CudaOps, rng) -> list[tuple[str, str, str]]:
    rows = []
    T = 512
    inv, scale = rope.inv_freq(DH, 1e6, None, 40960)
    x = rng.standard_normal((T, H, DH)).astype(np.float32)
    pos = np.arange(1024, 1024 + T)
    cos, sin = rope.cos_sin(pos, inv, scale)
    rows.append(("rope", f"T {T} x H {H} x Dh {DH}", f"{rel(ops.rope(x, pos, inv, scale), rope.apply(x, cos, sin)):.2e}"))
    w = rng.uniform(-2, 2, DH).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + 1e-6) * w
    rows.append(("rms_norm (qk)", f"[T*H {T * H}, Dh {DH}]", f"{rel(ops.rms_norm(x, w, 1e-6), ref):.2e}"))

    k = rng.standard_normal((T, HK, DH)).astype(np.float32)
    cells = rng.permutation(4096)[:T]
    cache = rng.standard_normal((4096, HK, DH)).astype(np.float16)
    new_k, _ = ops.kv_append(k, k, cells, cache, cache)
    want = cache.copy()
    want[cells] = k.astype(np.float16)
    rows.append(("kv_append", f"T {T} x Hk {HK} x Dh {DH}", f"{int((new_k.view(np.uint16) != want.view(np.uint16)).sum())} diff"))

    for S in (4096, 16384):
        q = rng.standard_normal((1, H, DH)).astype(np.float32)
        kc, vc = (rng.standard_normal((1, S, HK, DH)).astype(np.float16) for _ in range(2))
        out = ops.attention_decode(q, kc, vc, np.array([S]))
        rows.append(("attention decode", f"S {S}, H {H}/Hk {HK}, Dh {DH}",
                     f"{head_rel(out, attention_ref(q, kc[0], vc[0], np.array([S - 1]))):.2e}"))
    p0 = 1024
    q = rng.standard_normal((T, H, DH)).astype(np.float32)
    kc, vc = (rng.standard_normal((p0 + T, HK, DH)).astype(np.float16) for _ in range(2))
    out = ops.attention_prefill(q, kc, vc, np.arange(p0, p0 + T))
    rows.append(("attention prefill", f"T {T} after {p0}, H {H}/Hk {HK}",
                 f"{head_rel(out, attention_ref(q, kc, vc, np.arange(p0, p0 + T))):.2e}"))

    for e, a in ((E, A), (512, 10)):
        logits = (rng.standard_normal((T, e)) * 2).astype(np.float32)
        ids, wts = ops.moe_route(logits, a, True)
        ref_ids, ref_w = cpu.moe_route(logits, a, True)
        rows.append(("moe_route", f"T {T}, E {e}, A {a}",
                     f"{int((ids != ref_ids).sum())} id diff, w {float(np.abs(wts / ref_w - 1).max()):.1e}"))
    gate_up = (rng.standard_normal((T, 2 * I)) * 3).astype(np.float32)
    g = gate_up[:, :I].astype(np.float64)
    rows.append(("swiglu (fused)", f"T {T} x 2I {2 * I}",
                 f"{rel(ops.swiglu(gate_up), g / (1 + np.exp(-g)) * gate_up[:, I:]):.2e}"))
    for qt, n_rows in (("Q8_0", V), ("Q6_K", 4096), ("BF16", 4096)):
        table = random_qtensor_bytes(qt, (n_rows, D), rng)
        ids = rng.integers(0, n_rows, 64)
        out = ops.embed(qt, table, D, ids)
        rows.append((f"embed {qt}", f"{n_rows} x {D}, T 64",
                     f"{int((out != dequantize_rows(qt, table, D, ids)).sum())} diff"))
    logits = rng.standard_normal((4, V)).astype(np.float32)
    rows.append(("argmax", f"B 4 x V {V}", f"{int((ops.argmax(logits) != logits.argmax(1)).sum())} diff"))
    res = rng.standard_normal((T, D)).astype(np.float32)
    y = rng.standard_normal((T, A, D)).astype(np.float32)
    wts = rng.dirichlet(np.ones(A), T).astype(np.float32)
    ref = res + np.einsum("ta,tad->td", wts.astype(np.float64), y.astype(np.float64))
    rows.append(("moe_combine", f"T {T}, A {A}, D {D}", f"{rel(ops.moe_combine(res, y, wts), ref):.2e}"))
    return rows


def time_decode(ops: CudaOps, rng, S: int, blocks_per_sm: int, reps: int = 100) -> dict:
    rt, dev, stream = ops._rt, ops.device, ops.stream
    kv_bytes = S * HK * DH * 2                                  # one of K or V
    sets = max(2, math.ceil(256e6 / (2 * kv_bytes)))            # K+V of all sets >> 60 MB of L2
    one = rng.standard_normal((S, HK, DH)).astype(np.float16)
    kbuf, vbuf = rt.DeviceBuffer(dev, sets * kv_bytes), rt.DeviceBuffer(dev, sets * kv_bytes)
    for s in range(sets):
        kbuf.copy_from_host(one, offset=s * kv_bytes)
        vbuf.copy_from_host(one[::-1].copy(), offset=s * kv_bytes)
    splits = ops.decode_splits(1, HK, S, DH, blocks_per_sm)
    q = ops._upload(rng.standard_normal((1, H, DH)).astype(np.float32))
    lengths = ops._upload(np.array([S], np.int32))
    part_acc, part_ml = rt.DeviceBuffer(dev, H * splits * DH * 4), rt.DeviceBuffer(dev, H * splits * 8)
    out = rt.DeviceBuffer(dev, H * DH * 4)
    decode = ops._kernel("attention_decode", dh=DH, g=H // HK)
    combine = ops._kernel("attention_combine")
    busy = rt.DeviceBuffer(dev, 6 << 30)
    scale = 1 / math.sqrt(DH)

    def run(with_combine: bool) -> float:
        start, end = rt.Event(dev, timing=True), rt.Event(dev, timing=True)
        busy.fill_bytes(0x11, stream)                           # keeps the GPU busy while launches queue
        start.record(stream)
        for i in range(reps):
            s = i % sets
            decode.launch((splits, HK, 1), 128, (q, kbuf.ptr + s * kv_bytes, vbuf.ptr + s * kv_bytes, lengths, 0,
                                                 part_acc, part_ml, H, HK, S, splits, scale, 0, 0, 0, 0, 0,
                                                 INT32_MAX),
                          stream=stream)
            if with_combine:
                combine.launch((H, 1), 128, (part_acc, part_ml, out, H, DH, splits), stream=stream)
        end.record(stream)
        end.synchronize()
        return start.elapsed_ms(end) * 1e3 / reps

    run(True)
    step_us = float(np.median([run(True) for _ in range(3)]))
    kernel_us = float(np.median([run(False) for _ in range(3)]))
    return {"S": S, "blocks_per_sm": blocks_per_sm, "splits": splits, "kv_bytes": 2 * kv_bytes,
            "step_us": step_us, "kernel_us": kernel_us}


def time_prefill(ops: CudaOps, rng, T: int, p0: int) -> dict:
    rt, dev, stream = ops._rt, ops.device, ops.stream
    S = p0 + T
    q = ops._upload(rng.standard_normal((T, H, DH)).astype(np.float32))
    kc = ops._upload(rng.standard_normal((S, HK, DH)).astype(np.float16))
    vc = ops._upload(rng.standard_normal((S, HK, DH)).astype(np.float16))
    pos = ops._upload(np.arange(p0, S, dtype=np.int32))
    out = rt.DeviceBuffer(dev, T * H * DH * 4)
    prefill = ops._kernel("attention_prefill", dh=DH)
    grid = (-(-T * (H // HK) // 32), HK)
    times = []
    for _ in range(6):
        start, end = rt.Event(dev, timing=True), rt.Event(dev, timing=True)
        start.record(stream)
        prefill.launch(grid, 128, (q, kc, vc, pos, out, T, H, HK, 1 / math.sqrt(DH)), stream=stream)
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_ms(end))
    ms = float(np.median(times[1:]))
    flops = 4.0 * H * DH * sum(p0 + t + 1 for t in range(T))   # QK^T and PV over the visible cells
    return {"T": T, "p0": p0, "ms": ms, "tflops": flops / ms / 1e9}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    rng = np.random.default_rng()
    ops = CudaOps()
    rows = accuracy(ops, rng)
    copy = copy_rate_gbps()
    ceiling = copy or 4300.0
    decode = [time_decode(ops, rng, S, per_sm) for S in (4096, 16384) for per_sm in (4, 2)]
    prefill = [time_prefill(ops, rng, 512, 1024), time_prefill(ops, rng, 4096, 0)]
    if args.json:
        args.json.write_text(json.dumps({"accuracy": rows, "copy_gbps": copy, "decode": decode,
                                         "prefill": prefill}, indent=1))
    print(f"\n{'op':<18} {'sizes':<30} {'max rel err':>28}")
    for op, sizes, err in rows:
        print(f"{op:<18} {sizes:<30} {err:>28}")
    print(f"\ndevice copy: {'%.0f GB/s (torch, read + write)' % copy if copy else 'n/a (no torch): 4300 GB/s assumed'}")
    print(f"{'decode attention':<18} {'splits':>6} {'KV MB':>7} {'kernel us':>10} {'GB/s':>7} {'of copy':>8} "
          f"{'+combine us':>12} {'GB/s':>7}")
    for d in decode:
        k_gbps, s_gbps = d["kv_bytes"] / d["kernel_us"] / 1e3, d["kv_bytes"] / d["step_us"] / 1e3
        print(f"{'S %d (%d/SM)' % (d['S'], d['blocks_per_sm']):<18} {d['splits']:>6} {d['kv_bytes'] / 1e6:>7.1f} {d['kernel_us']:>10.2f} "
              f"{k_gbps:>7.0f} {k_gbps / ceiling:>7.0%} {d['step_us']:>12.2f} {s_gbps:>7.0f}")
    for p in prefill:
        print(f"prefill T {p['T']} after {p['p0']}: {p['ms']:.3f} ms, {p['tflops']:.1f} TFLOP/s (FFMA)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
