"""A/B of the causal prompt attention's builds: cuda/attention_tc.cu (mma.sync) against cuda/attention_wg.cu
(Hopper's wgmma), from fatbins built here with nvcc, in one process and without the package build
(tools/fatbin_driver.py loads them; torch gives buffers and timing).

    tools/variants/make_wgmma.sh            -> also .whl/attention_{tc,wg}.fatbin
    python3 tools/attention_wg_ab.py --arm tc:.whl/attention_tc.fatbin:strata_attention_prefill_tc_f16 \\
        --arm wg:.whl/attention_wg.fatbin:strata_attention_prefill_wg_f16 [--arm ...] [--json F]

An arm is NAME:FATBIN:PREFIX[:ROWS:THREADS:SHARED[:tma[CELLS]]]; PREFIX_d<Dh> are its entry points
(attention_tc.cu's contract; grid (ceil(T * G / ROWS), Hk) of THREADS threads with SHARED bytes of dynamic
shared memory, default 64, 128 and 0 as attention_tc.cu, whose Dh-256 kernel takes 256 threads; tma: two
tensor maps follow, of K and V as cuda/attention_ws.cu's TMA build reads them, boxes of CELLS cells,
default ROWS). A case whose head dim an arm has no entry point for is
skipped for that arm (cuda/attention_ws.cu is built for Dh 128 only).

    --arm ws:.whl/attention_ws.fatbin:strata_attention_prefill_ws128_f16:128:384:163968
    --arm wst:.whl/attention_ws.fatbin:strata_attention_prefill_wst128_f16:128:384:164928:tma
    --arm wst64:.whl/attention_ws.fatbin:strata_attention_prefill_wst64_f16:128:384:197696:tma64 --shape 80b

1. Checks (CASES): head dims 64 and 128, groups of 1 to 8 query heads per KV head, chunks after earlier
   cells; the cache cells past the chunk's last position hold NaN (never read). Each (token, head)
   within attention_tc.cu's bound of a float64 softmax over the same f16 K/V: max |out - ref| <=
   2e-3 max |ref|; and the largest difference from the first arm.
2. Times, the Qwen3-30B-A3B shape (H 32, Hk 4, Dh 128; --shape 80b: Qwen3-Next-80B's H 16, Hk 2, Dh 256)
   at tools/attention_tc_bench.py's chunks: CUDA-event medians, TFLOP/s of the causal work.

Exit status 1 when an arm fails a check.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]
from fatbin_driver import Arm, finish  # noqa: E402

ROWS = 64                   # query rows a block (attention_tc.cu kRows)
BLOCK = 128
BOUND = 2e-3
# (label, Dh, H, Hk, T, offset)
CASES = [("d128 G8", 128, 32, 4, 100, 37), ("d128 G1", 128, 8, 8, 70, 0), ("d64 G8", 64, 16, 2, 130, 200),
         ("d128 G4 one row", 128, 8, 2, 1, 5), ("d256 G8", 256, 16, 2, 90, 40)]
TIMED = [(512, 0), (4096, 0), (4096, 12288), (4096, 28672), (4096, 126976)]   # the last: a 131,072-token prompt's
H30, HK30, DH30 = 32, 4, 128
SHAPES = {"30b": (H30, HK30, DH30), "80b": (16, 2, 256)}     # --shape: (H, Hk, Dh) the chunks are timed at


def causal_flops(T: int, offset: int, H: int = H30, dh: int = DH30) -> float:
    return 4.0 * dh * H * (T * offset + T * (T + 1) / 2)


def make_case(rng, dh, H, Hk, T, offset, pad=5):
    """(q [T, H, Dh] f32, K, V [S + pad, Hk, Dh] f16 with NaN past S = offset + T, positions)."""
    S = offset + T
    q = rng.standard_normal((T, H, dh)).astype(np.float32)
    k = rng.standard_normal((S + pad, Hk, dh)).astype(np.float16)
    v = rng.standard_normal((S + pad, Hk, dh)).astype(np.float16)
    k[S:], v[S:] = np.nan, np.nan
    return q, k, v, np.arange(offset, S, dtype=np.int32)


def reference(q, k, v, positions) -> np.ndarray:
    """float64 softmax(scale q . k) v over cells 0..position of each token: [T, H * Dh]."""
    T, H, dh = q.shape
    G = H // k.shape[1]
    out = np.empty((T, H, dh))
    for t, p in enumerate(positions):
        kk, vv = k[:p + 1].astype(np.float64), v[:p + 1].astype(np.float64)
        for h in range(H):
            s = kk[:, h // G] @ q[t, h].astype(np.float64) / math.sqrt(dh)
            w = np.exp(s - s.max())
            out[t, h] = w @ vv[:, h // G] / w.sum()
    return out.reshape(T, H * dh)


def judge(out: np.ndarray, ref: np.ndarray, H: int) -> dict:
    T = ref.shape[0]
    o, r = out.reshape(T, H, -1).astype(np.float64), ref.reshape(T, H, -1)
    finite = bool(np.isfinite(o).all())
    worst = float(np.max(np.abs(o - r).max(-1) / (BOUND * np.abs(r).max(-1) + 1e-30))) if finite else math.inf
    return {"ok": finite and worst <= 1.0, "worst_over_bound": worst}


class AttentionArm(Arm):
    """One build's entry points on the device (PREFIX_d<Dh>): run a case, time a chunk."""

    def __init__(self, dev, name, fatbin, prefix, rows=ROWS, threads=BLOCK, shared=0, tma=""):
        super().__init__(dev, name, fatbin, prefix)
        self.rows, self.threads, self.shared = int(rows), int(threads), int(shared)
        if not (tma == "" or (tma.startswith("tma") and (tma[3:] == "" or tma[3:].isdigit()))):
            raise SystemExit(f"arm {name}: the 7th field is 'tma', 'tma<cells>' or nothing, not {tma!r}")
        self.tma, self._maps = tma.startswith("tma"), {}
        self.box_cells = int(tma[3:] or self.rows) if self.tma else 0

    def tensor_maps(self, dh, Hk, cells, k, v) -> list:
        """K's and V's tensor maps (dims (Dh, Hk, cells), boxes of 64 dims x 1 head x the arm's cells)."""
        key = (k.data_ptr(), v.data_ptr(), dh, Hk, cells)
        if key not in self._maps:
            make = lambda t: self.dev.tensor_map_f16(t.data_ptr(), (dh, Hk, cells), (dh * 2, Hk * dh * 2),
                                                     (64, 1, self.box_cells))
            self._maps = {key: [("B", make(k)), ("B", make(v))]}
        return self._maps[key]

    def has(self, dh) -> bool:
        try:
            self.fn(f"d{dh}")
        except RuntimeError:                # no such entry point: the lookup fails, the context is fine
            return False
        return True

    def launch(self, dh, T, H, Hk, q, k, v, pos, out, cells):
        """cells: the chunk's last position + 1 (the cells the tensor maps cover)."""
        grid = (-(-T * (H // Hk) // self.rows), Hk)
        maps = self.tensor_maps(dh, Hk, cells, k, v) if self.tma else []
        pairs = dh == 256 and (self.rows, self.threads) == (ROWS, BLOCK)   # attention_tc.cu's Dh 256: warp pairs
        self.dev.launch(self.fn(f"d{dh}"), grid, 2 * BLOCK if pairs else self.threads,
                        [("P", q.data_ptr()), ("P", k.data_ptr()), ("P", v.data_ptr()), ("P", pos.data_ptr()),
                         ("P", out.data_ptr()), ("i", T), ("i", H), ("i", Hk), ("f", 1.0 / math.sqrt(dh))] + maps,
                        shared=self.shared)

    def run(self, q, k, v, pos) -> np.ndarray:
        dev = self.dev
        T, H, dh = q.shape
        out = dev.full((T, H * dh), float("nan"))
        self.launch(dh, T, H, k.shape[1], dev.upload(q), dev.upload(k), dev.upload(v), dev.upload(pos), out,
                    int(pos.max()) + 1)
        return dev.download(out)


def run_checks(arms, rng) -> dict:
    report = {a.name: {} for a in arms}
    for label, dh, H, Hk, T, offset in CASES:
        q, k, v, pos = make_case(rng, dh, H, Hk, T, offset)
        ref = reference(q, k, v, pos)
        first = None
        for arm in arms:
            if not arm.has(dh):
                print(f"  {arm.name:>10} {label:<16} skipped: no d{dh} entry point", flush=True)
                continue
            try:
                out = arm.run(q, k, v, pos)
            except Exception as e:      # a fault poisons the context: report it
                report[arm.name][label] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                print(f"  {arm.name} {label}: {e}", flush=True)
                continue
            r = judge(out, ref, H)
            first = out if first is None else first
            r["max_diff_from_first"] = float(np.nanmax(np.abs(out - first))) if np.isfinite(out).all() else math.inf
            report[arm.name][label] = r
            print(f"  {arm.name:>10} {label:<16} {'ok  ' if r['ok'] else 'FAIL'} error/bound "
                  f"{r['worst_over_bound']:.3g}, max diff from {arms[0].name}: {r['max_diff_from_first']:.3g}",
                  flush=True)
    return report


def time_chunk(dev, arms, rng, T, offset, repeats, shape=SHAPES["30b"]) -> dict:
    H, Hk, dh = shape
    q, k, v, pos = make_case(rng, dh, H, Hk, T, offset, pad=0)
    qd, kd, vd, pd = dev.upload(q), dev.upload(k), dev.upload(v), dev.upload(pos)
    out = dev.full((T, H * dh), 0.0)
    flops, res = causal_flops(T, offset, H, dh), {}
    for arm in arms:
        ms = float(np.median(dev.time_ms(lambda: arm.launch(dh, T, H, Hk, qd, kd, vd, pd, out, offset + T),
                                         repeats)))
        res[arm.name] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
    return {"T": T, "offset": offset, "arms": res}


def main(argv=None, make_driver=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", required=True, help="NAME:FATBIN:PREFIX")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--chunks", default=",".join(f"{t}@{o}" for t, o in TIMED),
                    help="timed chunks, T@offset comma-separated ('' for none)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="30b", help="the (H, Hk, Dh) chunks are timed at")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if make_driver is None:
        from fatbin_driver import Driver as make_driver
    dev = make_driver()
    arms = [AttentionArm(dev, *spec.split(":")) for spec in args.arm]
    rng = np.random.default_rng(0)
    print("checks:", flush=True)
    report = {"checks": run_checks(arms, rng), "times": []}
    ok = {a.name: all(r["ok"] for r in report["checks"][a.name].values()) for a in arms}
    chunks = [tuple(int(x) for x in c.split("@")) for c in args.chunks.split(",") if c.strip()]
    shape = SHAPES[args.shape]
    timed = [a for a in arms if a.has(shape[2])]        # the arms with an entry point at the shape's head dim
    if chunks:
        print(f"{args.shape}: H {shape[0]}, Hk {shape[1]}, Dh {shape[2]}")
        print(f"{'T':>6} {'offset':>7} " + "".join(f"{a.name + ' ms':>14}{'TF/s':>7}" for a in timed))
    for T, offset in chunks:
        t = time_chunk(dev, timed, rng, T, offset, args.repeats, shape)
        report["times"].append(t)
        print(f"{T:>6} {offset:>7} " + "".join(f"{t['arms'][a.name]['ms']:>14.3f}{t['arms'][a.name]['tflops']:>7.0f}"
                                               for a in timed), flush=True)
    return finish(report, ok, args.json)


if __name__ == "__main__":
    sys.exit(main())
