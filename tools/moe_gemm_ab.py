"""A/B of the prompt GEMM's builds: cuda/moe_gemm.cu (mma.sync) against cuda/moe_gemm_ws.cu (Hopper's
wgmma, warp-specialized) or another commit's build, from fatbins built here with nvcc, in one process and
without the package build: each arm's fatbin is loaded through the driver API (tools/fatbin_driver.py),
buffers and timing come from torch.

    tools/variants/make_wgmma.sh            -> .whl/moe_gemm_{mma,ws}.fatbin (sm_90 / sm_90a), ...
    python3 tools/moe_gemm_ab.py --arm mma:.whl/moe_gemm_mma.fatbin:strata_moe_gemm \\
        --arm ws:.whl/moe_gemm_ws.fatbin:strata_moe_gemm_ws:ws [--arm ...] [--tokens 4096] [--json F]

An arm is NAME:FATBIN:PREFIX[:ws[:BLOCK[:SHARED]]] or NAME:FATBIN:PREFIX:ws16[:BLOCK[:SHARED]] (the build
taking X as f16), or NAME:FATBIN:strata_moe_gemm_wst:wst[:BLOCK[:SHARED]] (the TMA build over f16 weights and
f16 X: checked and timed on the F16 shapes only, the groups' matrices back to back in one block that
its weight map covers, SHARED default WST_SHARED_BYTES); PREFIX_<type> are its entry points (one contract: cuda/moe_gemm.cu's). `:ws` marks cuda/moe_gemm_ws.cu's launch: one block a multiprocessor over every work
item (BLOCK threads, default WS_BLOCK; a build with other producer warpgroups needs its own), its opt-in
shared memory (SHARED bytes, default WS_SHARED_BYTES; a build with other stages needs its own), and the
tile count as a tenth argument.

1. Checks, every type of strata.backends.cuda.moe_gemm.QTYPE_NAMES: three groups of random weights
   (N = 200: a partial 128-row tile; K two blocks, 520 for the float types: a partial k step), token
   rows 77 / 1 / 130 (tiles of 1 to 128 rows), a row between them that no tile covers and a group
   whose blob address is 0 (both must stay NaN). Each output within cuda/moe_gemm.cu's stated bound
   of the float64 product; the largest error over the bound, and how many outputs equal the first
   arm's bit for bit.
2. Times, the Qwen3-30B-A3B prompt shapes of tools/moe_gemm_bench.py at --tokens: CUDA-event medians
   of --repeats launches per arm, TFLOP/s and the weights' read rate.

3. With --retype TYPE, each shape timed again with TYPE weights (F16: the chunk's weights dequantized
   once, then multiplied as f16 rows; a ws16 arm's strata_moe_gemm_ws16_f16 copies both operands by
   cp.async). With --dequant FATBIN (cuda/dequant.cu's build), each shape's dequantization to f16
   rows (strata_dequant_h_<type> over all its groups' weights) timed too: the price of that path. A
   "+ dequant" line then gives each arm's dequantization + f16 GEMM and its speedup over that arm's
   own decoding GEMM of the shape (above 1x: the dequantize-first path pays at these rows).

Exit status 1 when an arm fails a check (its times are still printed: a failed layout still times).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]     # tools/ and the repository (strata's pure-Python parts)
from fatbin_driver import Arm, finish  # noqa: E402
from moe_gemm_bench import shapes  # noqa: E402
from strata.backends.cuda.kernels import dequant_grid  # noqa: E402
from strata.backends.cuda.moe_gemm import (BLOCK, QTYPE_NAMES, WS_BLOCK, WS_SHARED_BYTES,  # noqa: E402
                                           WST_SHARED_BYTES, grid_for, tiles_for, ws_grid, wst_maps)
from strata.quant import QTYPES  # noqa: E402
from strata.quant.dequant import dequantize  # noqa: E402
from strata.quant.random import random_qtensor_bytes  # noqa: E402

CHECK_N = 200
CHECK_ROWS = (77, 1, 130)


def case_k(name: str) -> int:
    bs = QTYPES[name].block_size
    return 520 if bs == 1 else 2 * max(bs, 256)


def check_case(name: str, rng) -> tuple[list[np.ndarray], list[tuple[int, int, int]], np.ndarray]:
    """(weights, ranges (group, s0, rows), X): groups 0..2 at rows 0.., a skipped row, and group 3
    (its address will be 0) over one more row."""
    K = case_k(name)
    weights = [random_qtensor_bytes(name, (CHECK_N, K), rng, std=float(rng.uniform(0.01, 0.5))) for _ in range(4)]
    ranges, s = [], 0
    for g, rows in enumerate(CHECK_ROWS):
        ranges.append((g, s, rows))
        s += rows + (g == 0)                     # row 77: in no tile
    ranges.append((3, s, 1))
    X = (rng.standard_normal((s + 1, K)) * rng.uniform(0.1, 4.0)).astype(np.float32)
    return weights, ranges, X


def judge(name: str, Y: np.ndarray, weights, ranges, X, null_groups=(3,)) -> dict:
    """Each covered output against cuda/moe_gemm.cu's bound on the float64 product,
    (2^-10 + K 2^-22) P + 2^-25 (sum |x| + sum |w|); uncovered rows and null groups' rows NaN."""
    S, K = X.shape
    N = Y.shape[1]
    x64 = X.astype(np.float64)
    covered = np.zeros(S, bool)
    worst, finite = 0.0, True
    for g, s0, rows in ranges:
        if g in null_groups:
            continue
        sl = slice(s0, s0 + rows)
        covered[sl] = True
        w64 = dequantize(name, weights[g], (N, K)).astype(np.float64)
        ref = x64[sl] @ w64.T
        P = np.abs(x64[sl]) @ np.abs(w64).T
        bound = ((2.0**-10 + K * 2.0**-22) * P
                 + 2.0**-25 * (np.abs(x64[sl]).sum(1)[:, None] + np.abs(w64).sum(1)[None, :]) + 1e-30)
        y = Y[sl].astype(np.float64)
        finite &= bool(np.isfinite(y).all())
        worst = max(worst, float(np.nanmax(np.abs(y - ref) / bound)) if finite else np.inf)
    untouched = bool(np.isnan(Y[~covered]).all())
    return {"ok": finite and worst <= 1.0 and untouched, "worst_over_bound": worst, "untouched_nan": untouched}


class GemmArm(Arm):
    """One build's entry points on the device: run a case, time a shape."""

    ws = 0              # cuda/moe_gemm_ws.cu's launch: its block size (0: moe_gemm.cu's launch)
    shared = WS_SHARED_BYTES
    x16 = False         # its STRATA_WS_GEMM_X16 build: X given as f16 (the arm's X is f16(X), ldx in halves)
    tma = False         # strata_moe_gemm_wst_f16: f16 weights in one block, both operands through tensor maps

    def takes(self, qtype: str) -> bool:
        return not self.tma or qtype == "F16"

    def launch(self, qtype, ptrs, tiles, X, Y, N, K, w_block=None):
        """w_block: (first address, rows) of the one block of f16 rows holding every group's matrix (tma)."""
        args = [("P", ptrs.data_ptr()), ("q", 0), ("P", tiles.data_ptr()), ("P", X.data_ptr()),
                ("q", X.shape[1]), ("P", Y.data_ptr()), ("q", Y.shape[1]), ("i", N), ("i", K)]
        n_tiles = tiles.shape[0]
        if self.tma:
            w_base, w_rows = w_block
            maps = wst_maps(self.dev, X.data_ptr(), X.shape[0], X.shape[1], w_base, w_rows, K)   # the driver's encoder
            self.dev.launch(self.fn("f16"), ws_grid(N, n_tiles, self.dev.num_sms()), self.ws,
                            args + [("i", n_tiles), ("Q", w_base), ("B", maps[0]), ("B", maps[1])], self.shared)
        elif self.ws:
            self.dev.launch(self.fn(qtype.lower()), ws_grid(N, n_tiles, self.dev.num_sms()), self.ws,
                            args + [("i", n_tiles)], self.shared)
        else:
            self.dev.launch(self.fn(qtype.lower()), grid_for(N, n_tiles), BLOCK, args)

    def run(self, qtype: str, weights, ranges, X, null_groups=(3,)) -> np.ndarray:
        dev = self.dev
        N = weights[0].size // QTYPES[qtype].row_bytes(X.shape[1])
        X = X.astype(np.float16) if self.x16 else X
        w_block = None
        if self.tma:        # the groups back to back in one block, as the dq scratch holds them
            block = dev.upload(np.concatenate(weights))
            addrs = [block.data_ptr() + g * weights[0].size for g in range(len(weights))]
            blobs, w_block = [block], (block.data_ptr(), len(weights) * N)
        else:
            blobs = [dev.upload(np.concatenate([w, np.zeros(64, np.uint8)])) for w in weights]
            addrs = [b.data_ptr() for b in blobs]
        ptrs = dev.upload(np.array([0 if g in null_groups else a for g, a in enumerate(addrs)], np.int64))
        tiles = dev.upload(tiles_for(ranges))
        Y = dev.full((X.shape[0], N), float("nan"))
        self.launch(qtype, ptrs, tiles, dev.upload(X), Y, N, X.shape[1], w_block)
        del blobs
        return dev.download(Y)


def time_shape(dev, arms, rng, qtype, N, K, rows, repeats) -> dict:
    """Median ms a launch per arm over one buffer of groups (one random matrix copied to each)."""
    row_bytes = QTYPES[qtype].row_bytes(K)
    # F16 matrices back to back (a whole number of rows apart, as the TMA build's weight map needs)
    stride = N * row_bytes if qtype == "F16" else -(-N * row_bytes // 256) * 256
    one = random_qtensor_bytes(qtype, (N, K), rng)
    host = np.zeros((len(rows), stride), np.uint8)
    host[:, :one.size] = one
    blob = dev.upload(host)
    ranges, s = [], 0
    for g, r in enumerate(rows):
        ranges.append((g, s, r))
        s += r
    tiles = dev.upload(tiles_for(ranges))
    ptrs = dev.upload(np.array([blob.data_ptr() + g * stride for g in range(len(rows))], np.int64))
    X, Y = dev.randn((s, K)), dev.full((s, N), 0.0)
    X16 = dev.upload(dev.download(X).astype(np.float16)) if any(a.x16 for a in arms) else None
    out = {}
    for arm in (a for a in arms if a.takes(qtype)):
        x = X16 if arm.x16 else X
        w_block = (blob.data_ptr(), len(rows) * N)
        ms = float(np.median(dev.time_ms(lambda: arm.launch(qtype, ptrs, tiles, x, Y, N, K, w_block), repeats)))
        out[arm.name] = {"ms": round(ms, 4), "tflops": round(2.0 * s * N * K / ms / 1e9, 1),
                         "weight_gbps": round(len(rows) * N * row_bytes / ms / 1e6, 1)}
    return {"qtype": qtype, "N": N, "K": K, "groups": len(rows), "rows": s, "arms": out}


def time_dequant(dev, mod, qtype, N, K, groups, repeats) -> float:
    """Median ms of cuda/dequant.cu's strata_dequant_h_<qtype> over `groups` matrices of N x K
    (contiguous: one launch, as a chunk's dequantization of its experts would be, on ops._dequant's
    grid), after checking its first matrix against f16(strata.quant's dequantize) bit for bit
    (RuntimeError where it differs)."""
    qt = QTYPES[qtype]
    n_blocks = groups * N * K // qt.block_size
    one = random_qtensor_bytes(qtype, (N, K), np.random.default_rng(2))
    src = dev.upload(np.resize(one, groups * one.size))
    out = dev.upload(np.zeros(groups * N * K // 2, np.float32))        # f16 halves
    fn = dev.function(mod, f"strata_dequant_h_{qtype.lower()}")
    grid = dequant_grid(qt.block_size, groups * N * K, dev.num_sms())
    run = lambda: dev.launch(fn, grid, 256, [("P", src.data_ptr()), ("P", out.data_ptr()), ("q", n_blocks)])  # noqa: E731
    run()
    got = dev.download(out).view(np.uint16)[:N * K]
    want = dequantize(qtype, one, (N, K)).astype(np.float16).reshape(-1).view(np.uint16)
    if not np.array_equal(got, want):
        raise RuntimeError(f"strata_dequant_h_{qtype.lower()}: {int(np.sum(got != want))} of {N * K} halves "
                           "differ from f16(dequantize)")
    return round(float(np.median(dev.time_ms(run, repeats))), 4)


def run_checks(arms, rng) -> dict:
    """{arm: {qtype: judge's dict + equal_to_first}} over every type."""
    report = {a.name: {} for a in arms}
    for qtype in QTYPE_NAMES:
        weights, ranges, X = check_case(qtype, rng)
        first = None
        for arm in (a for a in arms if a.takes(qtype)):
            try:
                Y = arm.run(qtype, weights, ranges, X)
            except Exception as e:          # a fault poisons the context: report it, stop this arm's checks
                report[arm.name][qtype] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                print(f"  {arm.name} {qtype}: {e}", flush=True)
                continue
            r = judge(qtype, Y, weights, ranges, X)
            if first is None:
                first, first_name = Y, arm.name
            covered = ~np.isnan(first)
            same = Y[covered].view(np.uint32) == first[covered].view(np.uint32)
            r["equal_to_first"] = round(float(np.mean(same)), 4)
            report[arm.name][qtype] = r
            print(f"  {arm.name:>8} {qtype:<6} {'ok  ' if r['ok'] else 'FAIL'} error/bound "
                  f"{r['worst_over_bound']:.3g}, equal to {first_name}: {r['equal_to_first']:.1%}", flush=True)
    return report


def main(argv=None, make_driver=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", required=True, help="NAME:FATBIN:PREFIX")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--only", metavar="TEXT", help="time only shapes whose label or type contains TEXT")
    ap.add_argument("--no-times", action="store_true", help="checks only")
    ap.add_argument("--retype", metavar="TYPE", help="time each shape again with TYPE weights (e.g. F16)")
    ap.add_argument("--dequant", metavar="FATBIN", help="time each shape's dequantization to f16 (cuda/dequant.cu)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if make_driver is None:
        from fatbin_driver import Driver as make_driver
    dev = make_driver()
    arms = []
    for spec in args.arm:
        name, fatbin, prefix, *mode = spec.split(":")
        arm = GemmArm(dev, name, fatbin, prefix)
        if mode and mode[0] in ("ws", "ws16", "wst"):
            arm.ws = int(mode[1]) if len(mode) > 1 else WS_BLOCK
            arm.shared = int(mode[2]) if len(mode) > 2 else WST_SHARED_BYTES if mode[0] == "wst" else WS_SHARED_BYTES
            arm.x16 = mode[0] in ("ws16", "wst")
            arm.tma = mode[0] == "wst"
        arms.append(arm)
    rng = np.random.default_rng(0)
    print("checks (every type):", flush=True)
    report = {"checks": run_checks(arms, rng), "times": []}
    ok = {a.name: bool(report["checks"][a.name]) and all(r["ok"] for r in report["checks"][a.name].values())
          for a in arms}
    if not args.no_times:
        names = [a.name for a in arms]
        print(f"{'shape':<16} {'type':<5} {'N':>7} {'K':>5} {'rows':>6} "
              + "".join(f"{n + ' ms':>12}{'TF/s':>7}" for n in names))
        dq = dev.module(args.dequant) if args.dequant else None
        for label, qtype, N, K, rows in shapes(args.tokens, np.random.default_rng(1)):
            if args.only and args.only not in f"{label} {qtype}":
                continue
            own = None
            for qt in [qtype] + ([args.retype] if args.retype and args.retype != qtype else []):
                t = {"shape": label, **time_shape(dev, arms, rng, qt, N, K, rows, args.repeats)}
                if dq is not None and qt == qtype:
                    t["dequant_ms"] = time_dequant(dev, dq, qtype, N, K, len(rows), args.repeats)
                if own is None:
                    own = t
                elif "dequant_ms" in own:     # the dequantize-first price: dequantization + the f16 GEMM, per arm
                    t["dq_total_ms"] = {n: round(own["dequant_ms"] + t["arms"][n]["ms"], 4) for n in t["arms"]}
                report["times"].append(t)
                cells = {n: f"{t['arms'][n]['ms']:>12.3f}{t['arms'][n]['tflops']:>7.0f}" for n in t["arms"]}
                print(f"{label:<16} {qt:<5} {N:>7} {K:>5} {t['rows']:>6} "
                      + "".join(cells.get(n, f"{'-':>12}{'':>7}") for n in names)
                      + (f"   dequant {t['dequant_ms']:.3f} ms" if "dequant_ms" in t else ""), flush=True)
                if "dq_total_ms" in t:
                    # each arm's own decoding GEMM of the shape, or (the TMA build, f16 only) the first arm's
                    base = {n: own["arms"].get(n, own["arms"][names[0]])["ms"] for n in t["dq_total_ms"]}
                    print(f"{'  + dequant':<36} {t['rows']:>6} "
                          + "".join(f"{t['dq_total_ms'][n]:>12.3f}{base[n] / t['dq_total_ms'][n]:>6.2f}x"
                                    if n in t["dq_total_ms"] else f"{'-':>12}{'':>7}" for n in names), flush=True)
    return finish(report, ok, args.json)


if __name__ == "__main__":
    sys.exit(main())
