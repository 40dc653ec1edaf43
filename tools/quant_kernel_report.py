"""Dequantization exactness, GEMV accuracy and GEMV bandwidth of every quant type, as one table.

    python tools/quant_kernel_report.py [--json PATH] [--types Q4_K,Q6_K,...]

Run on a GPU machine after the build (tools/device_check.sh does both). Per type, on fresh random
blocks (strata.quant.random): whether strata_dequant_<qtype> equals strata.quant.dequant bit for bit
at 4096 x 2048; ||y - ref|| / ||ref|| of strata_gemv_<qtype> (and of the batched kernel at B = 8)
against float64 there; and GB/s = bytes of W read / kernel time at 768 x 2048, 4096 x 2048 and
151936 x 2048 (an output head), and for the batched kernel at B = 8. Launches are queued behind a
long memset, so the GPU runs them back to back as a CUDA graph would, and rotate through enough
copies of W that it never sits in the 60 MB L2. The device-to-device copy rate measured in the same
run (torch, bytes read + written) is printed beside.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from strata.backends.cuda.testing import CudaOps
from strata.quant import QTYPES
from strata.quant.dequant import dequantize
from strata.quant.random import random_qtensor_bytes

CHECK_SHAPE = (4096, 2048)
TIMED_SHAPES = [(768, 2048), (4096, 2048), (151936, 2048)]
HEAD_SKIP = {"F32"}            # a float32 output head (1.2 GB) is not a shape anyone ships
ROTATE_BYTES = 256e6           # copies of W per timing: several times the L2


def copy_rate_gbps() -> float | None:
    """Device-to-device copy GB/s (bytes read + written) through torch, if the machine has it."""
    try:
        import torch

        src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    except (ImportError, RuntimeError, AssertionError):  # no torch, or a CPU-only build of it
        return None
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(8):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * src.numel() / float(np.median(times[2:])) / 1e6


def accuracy(ops: CudaOps, name: str, rng) -> dict:
    data = random_qtensor_bytes(name, CHECK_SHAPE, rng)
    w = dequantize(name, data, CHECK_SHAPE)
    exact = bool(np.array_equal(ops.dequantize(name, data, CHECK_SHAPE).view(np.uint32), w.view(np.uint32)))
    x = rng.standard_normal((8, CHECK_SHAPE[1])).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    err = lambda y, r: float(np.linalg.norm(y - r) / np.linalg.norm(r))  # noqa: E731
    return {"dequant_exact": exact, "gemv_rel_err": err(ops.gemv(name, data, CHECK_SHAPE, x[0]), ref[0]),
            "batch8_rel_err": err(ops.gemv(name, data, CHECK_SHAPE, x), ref)}


def time_gemv(ops: CudaOps, busy, name: str, shape: tuple, rng, batch: int | None = None) -> dict:
    """Median microseconds per launch over back-to-back launches, and GB/s of W read."""
    rt, dev, stream = ops._rt, ops.device, ops.stream
    rows, n = shape
    data = random_qtensor_bytes(name, shape, rng)
    stride = -(-data.size // 256) * 256
    copies = max(2, math.ceil(ROTATE_BYTES / stride))
    wbuf = rt.DeviceBuffer(dev, copies * stride)
    for c in range(copies):
        wbuf.copy_from_host(data, offset=c * stride)
    x = ops._upload(rng.standard_normal((batch or 1, n)).astype(np.float32))
    y = rt.DeviceBuffer(dev, (batch or 1) * rows * 4)
    reps = max(10, min(200, int(400e6 / data.size)))
    ops.gemv_into(name, wbuf, x, y, rows, n, batch=batch)  # checks the arguments once
    kernel, grid, args = launch_shape(ops, name, rows, n, batch)

    def run() -> float:
        start, end = rt.Event(dev, timing=True), rt.Event(dev, timing=True)
        busy.fill_bytes(0x11, stream)  # keeps the GPU busy while the launches queue
        start.record(stream)
        for i in range(reps):
            kernel.launch(grid, ops.GEMV_THREADS, (wbuf.ptr + (i % copies) * stride, x, y, *args), stream=stream)
        end.record(stream)
        end.synchronize()
        return start.elapsed_ms(end) * 1e3 / reps

    run()
    us = float(np.median([run() for _ in range(3)]))
    wbuf.free()
    return {"shape": list(shape), "batch": batch, "bytes": int(data.size), "us": us, "gbps": data.size / us / 1e3}


def launch_shape(ops: CudaOps, name: str, rows: int, n: int, batch: int | None):
    """The kernel, grid and trailing arguments CudaOps.gemv_into would launch, for a tight loop."""
    if batch is None:
        grid = -(-rows // ops.gemv_rows_per_block(name, n))
        return ops._kernel("gemv", qtype=name), grid, (rows, n)
    grid = -(-rows // (ops.GEMV_THREADS // 32 * ops.GEMV_BATCH_ROWS))
    return ops._kernel("gemv_batch", qtype=name), grid, (rows, n, batch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--types", help="comma-separated quant types (default: all)")
    args = parser.parse_args()
    names = args.types.upper().split(",") if args.types else list(QTYPES)
    rng = np.random.default_rng()
    ops = CudaOps()
    busy = ops._rt.DeviceBuffer(ops.device, 8 << 30)  # ~2.5 ms of memset
    results = {}
    for name in names:
        res = accuracy(ops, name, rng)
        res["timings"] = [time_gemv(ops, busy, name, s, rng) for s in TIMED_SHAPES
                          if not (s[0] > 100000 and name in HEAD_SKIP)]
        res["timings"].append(time_gemv(ops, busy, name, CHECK_SHAPE, rng, batch=8))
        results[name] = res
        print(f"{name}: done", flush=True)
    busy.free()
    copy = copy_rate_gbps()
    if args.json:
        args.json.write_text(json.dumps({"copy_gbps": copy, "types": results}, indent=1))
    print_table(results, copy)
    return 0 if all(r["dequant_exact"] and r["gemv_rel_err"] < 1e-5 and r["batch8_rel_err"] < 1e-5
                    for r in results.values()) else 1


def print_table(results: dict, copy: float | None) -> None:
    ceiling = copy or 4300.0
    print(f"\ndevice copy: {'%.0f GB/s (torch, read + write)' % copy if copy else 'n/a (no torch): 4300 GB/s assumed'}")
    print("GEMV GB/s = bytes of W read / kernel time, (% of the copy rate); errors at 4096 x 2048")
    print(f"{'type':<7} {'dequant':>7} {'gemv err':>9} {'B=8 err':>8} {'768x2048':>14} {'4096x2048':>14} "
          f"{'151936x2048':>14} {'B=8 4096x2048':>14}")
    for name, r in results.items():
        cells = {(tuple(t["shape"]), t["batch"]): f"{t['gbps']:.0f} ({t['gbps'] / ceiling:.0%})" for t in r["timings"]}
        row = [cells.get((s, None), "-") for s in TIMED_SHAPES] + [cells.get((CHECK_SHAPE, 8), "-")]
        print(f"{name:<7} {'yes' if r['dequant_exact'] else 'NO':>7} {r['gemv_rel_err']:>9.1e} "
              f"{r['batch8_rel_err']:>8.1e} " + " ".join(f"{c:>14}" for c in row))


if __name__ == "__main__":
    sys.exit(main())
