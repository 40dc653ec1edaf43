"""A/B of the decode GEMVs of several builds of cuda/gemv.cu and cuda/decode_fused.cu, in one process
and without the package: each arm's fatbins are loaded with the driver API (cuda.bindings), buffers
and timing come from torch. So it needs no build on the GPU machine, only the fatbins (built here
with nvcc, e.g. tools/variants/make_gemv_parent.sh) and a few seconds.

    python tools/gemv_rows_ab.py --arm NAME:GEMV.fatbin:DECODE_FUSED.fatbin [--arm ...] [--json F]

The 30B shape's Q8_0 matrices, as a decode step launches them (grids as strata/backends/cuda/ops_dense.py
picks them): the output head 151936 x 2048 (strata_gemv_q8_0 / strata_gemv_rows_q8_0), the attention
output 2048 x 4096 (the split kernels), the fused q|k|v 4096 + 512 + 512 x 2048 (strata_gemv3_q8_0 /
strata_gemv3_rows_q8_0). For one token (the one-token kernel) and batches 2, 4 and 8 (the row-invariant
kernel): us a launch, the median of 5 rounds of back-to-back launches queued behind a memset, with W
rotated through copies that together outgrow the 60 MB L2; GB/s of W read. Checks, per arm: every
batch's rows equal one-token launches bit for bit; and every arm's outputs equal the first arm's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fatbin_driver import Driver  # noqa: E402

HEAD, OPROJ = (151936, 2048), (2048, 4096)
QKV = ((4096, 2048), (512, 2048), (512, 2048))
BATCHES = (1, 2, 4, 8)
ROWS_PER_BLOCK = 16          # Q8_0 at n >= 1024: 4 warps x 4 rows (CudaOps.gemv_rows_per_block)


def q8_0_bytes(rows: int, n: int, rng) -> np.ndarray:
    """Random Q8_0 blocks [rows, n / 32 * 34]: an f16 scale, then 32 int8 weights."""
    nb = n // 32
    blocks = np.empty((rows, nb, 34), np.uint8)
    d = rng.uniform(0.002, 0.02, (rows, nb)).astype(np.float16)
    blocks[:, :, :2] = d.view(np.uint8).reshape(rows, nb, 2)
    blocks[:, :, 2:] = rng.integers(0, 256, (rows, nb, 32), dtype=np.uint8)
    return blocks.reshape(rows, nb * 34)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", required=True,
                    help="NAME:GEMV.fatbin:DECODE_FUSED.fatbin[:CAP[:SPLIT_CAP]] (most blocks of the whole-matrix and of the split kernels; 0: none)")
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--hot", action="store_true",
                    help="every launch reads the first copy of W (L2-resident where it fits): what a weight prefetch into the L2 could reach")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dev = Driver()
    torch = dev.torch
    rng = np.random.default_rng(0)

    def put(a: np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(a)).to("cuda")

    head = [put(q8_0_bytes(*HEAD, rng))]                                  # 311 MB: past the L2 alone
    oproj = [put(q8_0_bytes(*OPROJ, rng)) for _ in range(12)]
    qkv = [[put(q8_0_bytes(r, n, rng)) for r, n in QKV] for _ in range(8)]
    xs = {n: put(rng.standard_normal((8, n)).astype(np.float32)) for n in (2048, 4096)}
    blocker = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")

    bufs = {}

    def out(key, *shape):
        """An output buffer kept per key (allocated once: no allocation or fill among the timed launches)."""
        if key not in bufs:
            bufs[key] = torch.full(shape, float("nan"), device="cuda")
        return bufs[key]

    cases = {   # name -> (shape, the copies of W rotated through)
        "head": (HEAD, head),
        "oproj": (OPROJ, oproj),
        "qkv": (None, qkv),
    }
    report = {"arms": {}}
    first_digests = None
    for spec in args.arm:
        name, gemv_path, fused_path, *rest = spec.split(":")
        cap = int(rest[0]) if rest else 0      # a cap on the whole-matrix kernels' grid (0: none)
        split_cap = int(rest[1]) if len(rest) > 1 else 0     # and on the split kernels' (0: none)

        def capped(grid: int) -> int:
            return min(grid, cap) if cap else grid

        def split_capped(grid: int) -> int:
            return min(grid, split_cap) if split_cap else grid
        g, fz = dev.module(gemv_path), dev.module(fused_path)
        fn = {k: dev.function(g, f"strata_{k}_q8_0") for k in ("gemv", "gemv_rows", "gemv_split", "gemv_rows_split")}
        fn.update({k: dev.function(fz, f"strata_{k}_q8_0") for k in ("gemv3", "gemv3_rows")})

        def run(case: str, batch: int, copy: int, x_row: int = 0, tag: str = "timed"):
            """One launch of case at this batch (1: the one-token kernel over x row x_row) -> outputs
            (buffers kept per tag: the checks' own are fresh, NaN-filled first)."""
            x = xs[4096 if case == "oproj" else 2048]
            xp = x.data_ptr() + 4 * x.shape[1] * x_row
            if case in ("head", "oproj"):
                W = (head if case == "head" else oproj)[copy]
                rows, n = HEAD if case == "head" else OPROJ
                grid = -(-rows // ROWS_PER_BLOCK)
                split = grid < 2 * 132
                y = out((name, case, batch, tag), batch, rows)
                if batch == 1:
                    f = fn["gemv_split" if split else "gemv"]
                    dev.launch(f, split_capped(grid * 4) if split else capped(grid), 128,
                               [("P", W.data_ptr()), ("P", xp), ("P", y.data_ptr()), ("i", rows), ("i", n)])
                else:
                    f = fn["gemv_rows_split" if split else "gemv_rows"]
                    dev.launch(f, split_capped(grid * 4) if split else capped(grid), 128,
                               [("P", W.data_ptr()), ("P", xp), ("P", y.data_ptr()), ("i", rows), ("i", n),
                                ("i", batch)])
                return [y]
            Ws = qkv[copy]
            ys = [out((name, case, batch, tag, i), batch, r) for i, (r, _) in enumerate(QKV)]
            sets = sum(-(-r // 4) for r, _ in QKV)
            dev.launch(fn["gemv3" if batch == 1 else "gemv3_rows"], capped(max(1, -(-sets // 4))), 128,
                       [("P", w.data_ptr()) for w in Ws] + [("P", xp)] + [("P", y.data_ptr()) for y in ys]
                       + [("i", r) for r, _ in QKV] + [("i", 2048), ("i", batch)])
            return ys

        arm = {"us": {}, "gbs": {}, "rows_equal_one_token": True}
        digests = {}
        for case, (_, copies) in cases.items():
            w_bytes = (sum(r * n // 32 * 34 for r, n in QKV) if case == "qkv"
                       else (HEAD if case == "head" else OPROJ)[0] * (HEAD if case == "head" else OPROJ)[1] // 32 * 34)
            one = [run(case, 1, 0, b, tag=f"one{b}") for b in range(8)]
            torch.cuda.synchronize()
            for batch in BATCHES:
                got = run(case, batch, 0, tag="check")
                torch.cuda.synchronize()
                h = hashlib.sha256()
                for i, y in enumerate(got):
                    yb = y.cpu().numpy()
                    h.update(yb.tobytes())
                    ref = np.stack([one[b][i].cpu().numpy()[0] for b in range(batch)])
                    if not np.array_equal(yb.view(np.uint32), ref.view(np.uint32)):
                        arm["rows_equal_one_token"] = False
                        print(f"  {name}: {case} batch {batch} output {i}: rows differ from one-token launches")
                digests[f"{case}/{batch}"] = h.hexdigest()[:16]
                times = []
                for _ in range(5):
                    blocker.fill_(0)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for i in range(args.launches):
                        run(case, batch, 0 if args.hot else i % len(copies))
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1e3 / args.launches)
                us = float(np.median(times))
                arm["us"][f"{case}/{batch}"] = round(us, 2)
                arm["gbs"][f"{case}/{batch}"] = round(w_bytes / us / 1e3, 1)
                print(f"{name:>8} {case:>6} batch {batch}: {us:8.2f} us, W at {w_bytes / us / 1e3:7.1f} GB/s", flush=True)
        if first_digests is None:
            first_digests = digests
        arm["equal_to_first_arm"] = digests == first_digests
        arm["digests"] = digests
        report["arms"][name] = arm
        print(f"{name}: rows equal one-token launches: {arm['rows_equal_one_token']}; outputs equal the first "
              f"arm's: {arm['equal_to_first_arm']}", flush=True)
    names = list(report["arms"])
    print(f"{'case/batch':<12}" + "".join(f"{n:>12}" for n in names) + "   (us a launch)")
    for key in report["arms"][names[0]]["us"]:
        print(f"{key:<12}" + "".join(f"{report['arms'][n]['us'][key]:>12.2f}" for n in names))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    ok = all(a["rows_equal_one_token"] and a["equal_to_first_arm"] for a in report["arms"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
