"""#16's question outside the engine: can a chain of decode GEMVs, each its own kernel, read W nearer the
copy rate if each kernel's block moves its share of W into shared memory before griddepcontrol.wait,
beside the previous kernel's still-running block? (tools/variants/pdl_stage.cu says why and how.)

Chains of Q8_0 GEMVs at Qwen3-30B-A3B's decode shapes, each GEMV reading the previous one's output and a
W of its own (48 copies a shape, past the L2), captured in a CUDA graph with programmatic dependent
launches as a decode step is; the time is the median graph replay:
  qkv     48 x fused q|k|v (5,120 x 2,048, 11.1 MB)
  o       48 x attention output (2,048 x 4,096, 8.9 MB)
  alt     48 x (q|k|v, output): 96 GEMVs
  small   48 x (q|k|v, 2 small steps, output, 2 small steps): what the norms/ropes between do to it
  smallE  the same, the small steps letting their dependents launch before their own wait
  layer   48 x (q|k|v, 2 small, output, small, the 8 routed experts' gate|up 12,288 x 2,048, small, their down
          8 x 2,048 x 768 each reading its own x, small): a decode layer's weight phases, Q8_0 throughout
          (arms plain1 and persist*: the others have no segmented GEMV); layerE with the small steps early
Arms: plain (the engine's shape: 2 blocks an SM, 4 rows a warp, W from global memory), plain1 (1 row a
warp), stage (a block an SM's half, its rows into shared memory after the wait), early (the same copies
asked before the wait), plain1 over segments for the MoE down shape, persist (the whole chain in ONE launch: every block resident, 4 an SM, the phases
separated by a grid barrier, each warp asking for its next GEMV's first row before it arrives), persistL
(the same, the row asked for after the barrier), persist3 (persist at 3 blocks an SM). Every arm's outputs equal plain's bit for bit (same lane order, same sums), and
one GEMV of each shape is checked against numpy. Prints us a GEMV and GB/s of W, beside the device
copy rate measured in the same process.

    python tools/pdl_chain_bench.py --fatbin .whl/pdl_stage.fatbin [--reps 7] [--carveout PCT] [--json F]
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

# rows, n, seg_rows (0: one x; else row r reads x + (r / seg_rows) * n: the MoE down projection's experts)
SHAPES = {"qkv": (5120, 2048, 0), "o": (2048, 4096, 0), "gu": (12288, 2048, 0), "dn": (16384, 768, 2048)}
BUF = 16384                 # floats of each activation buffer
CHAINS = {"qkv": ["qkv"], "o": ["o"], "alt": ["qkv", "o"], "small": ["qkv", "s", "s", "o", "s", "s"],
          "smallE": ["qkv", "e", "e", "o", "e", "e"],
          # a decode layer's four weight phases, Q8_0 throughout, with its small steps' places
          "layer": ["qkv", "s5120", "s5120", "o", "s2048", "gu", "s12288", "dn", "s16384"],
          "layerE": ["qkv", "e5120", "e5120", "o", "e2048", "gu", "e12288", "dn", "e16384"]}
SEG_ARMS = ("plain1", "persist", "persistL", "persist3")     # the arms with a segmented GEMV


def small_count(step: str) -> int:
    """A small step's element count ("s", "e": 4096; "s5120": 5120), 0 for a GEMV."""
    return (int(step[1:]) if len(step) > 1 else 4096) if step[0] in "se" and step not in SHAPES else 0
COPIES = 48                 # of each shape's W: 48 layers, past the L2


def q8_0(rows: int, n: int, rng) -> np.ndarray:
    """Random Q8_0 rows whose products keep |x| near 1 along a chain: scale ~ 1 / (sqrt(n) * 74)."""
    nb = n // 32
    blocks = np.empty((rows, nb, 34), np.uint8)
    d = (rng.uniform(0.8, 1.2, (rows, nb)) / (np.sqrt(n) * 74.0)).astype(np.float16)
    blocks[:, :, :2] = d.view(np.uint8).reshape(rows, nb, 2)
    blocks[:, :, 2:] = rng.integers(0, 256, (rows, nb, 32), dtype=np.uint8)
    return blocks.reshape(rows, nb * 34)


def dequant(w: np.ndarray, n: int) -> np.ndarray:
    rows, nb = w.shape[0], n // 32
    b = w.reshape(rows, nb, 34)
    d = b[:, :, :2].copy().view(np.float16).astype(np.float64)
    q = b[:, :, 2:].view(np.int8).astype(np.float64)
    return (q * d).reshape(rows, n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fatbin", default=".whl/pdl_stage.fatbin")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--chains", default="qkv,o,alt,small,smallE,layer,layerE")
    ap.add_argument("--arms", default="plain,plain1,stage,early,persist,persistL,persist3")
    ap.add_argument("--carveout", type=int, default=-1,
                    help="every kernel's preferred shared-memory carveout, percent (-1: the driver's choice)")
    ap.add_argument("--copies", type=int, default=COPIES, help="copies of each shape's W (48: a layer's each)")
    ap.add_argument("--shrink", type=int, choices=(1, 2, 4, 8), default=1,
                    help="rows, columns and small steps divided by this (the host test's small run)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    copies = args.copies
    shapes = {name: (rows // args.shrink, n // args.shrink, seg // args.shrink) for name, (rows, n, seg) in SHAPES.items()}

    def count(step):
        return small_count(step) // args.shrink
    from strata._ext import graphs, runtime as rt

    rt.init()
    dev = rt.Device(0)
    st = rt.Stream(dev)
    sms = dev.multiprocessor_count
    lib = rt.Library("pdl_stage", open(args.fatbin, "rb").read())
    k = {"plain": lib.kernel(dev, "bench_plain_q8", "PPPii"), "plain1": lib.kernel(dev, "bench_plain1_q8", "PPPii"),
         "stage": lib.kernel(dev, "bench_stage_q8", "PPPiiii"), "small": lib.kernel(dev, "bench_small", "PPi"),
         "small_early": lib.kernel(dev, "bench_small_early", "PPi"),
         "plain1s": lib.kernel(dev, "bench_plain1s_q8", "PPPiii"),
         "persist": lib.kernel(dev, "bench_persist_q8", "PiPiP"), "persist3": lib.kernel(dev, "bench_persist3_q8", "PiPiP")}
    if args.carveout >= 0:      # an SM changes its L1/shared split only when idle: one split for all
        for kern in k.values():
            kern.prefer_shared(args.carveout)
    rng = np.random.default_rng(0)

    W, host = {}, {}
    for name, (rows, n, _) in shapes.items():
        host[name] = q8_0(rows, n, rng)
        first = rt.DeviceBuffer(dev, host[name].nbytes)
        first.copy_from_host(host[name], st)
        W[name] = [first] + [rt.DeviceBuffer(dev, host[name].nbytes) for _ in range(copies - 1)]
        for b in W[name][1:]:
            rt.copy_d2d(b.ptr, first.ptr, host[name].nbytes, st)
    x0 = rng.standard_normal(BUF).astype(np.float32)
    bufs = [rt.DeviceBuffer(dev, BUF * 4) for _ in range(2)]
    start = rt.DeviceBuffer(dev, BUF * 4)
    start.copy_from_host(x0, st)
    bar = rt.DeviceBuffer(dev, 256)            # the grid barrier's count and generation, and its error flag
    bar.copy_from_host(np.zeros(64, np.uint32), st)
    bar_err = rt.DeviceBuffer(dev, 4)          # set where a barrier timed out
    bar_err.copy_from_host(np.zeros(1, np.int32), st)
    phase_bufs = []                            # each persistent chain's phase table, kept alive
    st.synchronize()

    def upload(table):
        """A persistent chain's phase table [(W or 0, src, dst, rows or n, n, seg_rows)] on the device (before
        any capture)."""
        t = np.asarray(table, np.int64)
        buf = rt.DeviceBuffer(dev, t.nbytes)
        buf.copy_from_host(t, st)
        st.synchronize()
        phase_bufs.append(buf)
        return buf, len(t)

    def persist(arm, uploaded, stream):
        """The uploaded chain as one launch of a persistent kernel."""
        buf, phases = uploaded
        kern = k["persist3" if arm == "persist3" else "persist"]
        kern.launch(sms * (3 if arm == "persist3" else 4), 256, (buf, phases, bar, int(arm != "persistL"), bar_err),
                    4096 // 32 * 36 * 4, stream=stream)

    def gemv(arm, name, w, src, dst, stream):
        rows, n, seg = shapes[name]
        xs = n // 32 * 36 * 4
        if seg:
            assert arm == "plain1", arm
            k["plain1s"].launch(-(-rows // 8), 256, (w, src, dst, rows, n, seg), xs, stream=stream, pdl=True)
        elif arm in ("plain", "plain1"):
            per = 32 if arm == "plain" else 8
            grid = min(-(-rows // per), 2 * sms) if arm == "plain" else -(-rows // per)
            k[arm].launch(grid, 256, (w, src, dst, rows, n), xs, stream=stream, pdl=True)
        else:
            rpb = -(-rows // sms)
            k["stage"].launch(-(-rows // rpb), 256, (w, src, dst, rows, n, rpb, int(arm == "early")),
                              64 + xs + rpb * n // 32 * 34, stream=stream, pdl=True)

    def chain(arm, pattern):
        seq = CHAINS[pattern]

        uploaded = None
        if arm.startswith("persist"):
            table, cur = [], 0
            for i in range(copies):
                for step in seq:
                    src, dst = bufs[cur], bufs[1 - cur]
                    c = count(step)
                    table.append((0, src.ptr, dst.ptr, c, c, 0) if c
                                 else (W[step][i].ptr, src.ptr, dst.ptr, *shapes[step]))
                    cur = 1 - cur
            uploaded = upload(table)

        def record(stream):
            rt.copy_d2d(bufs[0].ptr, start.ptr, BUF * 4, stream)
            if uploaded is not None:        # the table alternates the buffers as the loop below does
                persist(arm, uploaded, stream)
                return copies * len(seq) % 2
            cur = 0
            for i in range(copies):
                for step in seq:
                    src, dst = bufs[cur], bufs[1 - cur]
                    if count(step):
                        k["small" if step[0] == "s" else "small_early"].launch(32, 256, (src, dst, count(step)), 0,
                                                                               stream=stream, pdl=True)
                    else:
                        gemv(arm, step, W[step][i], src, dst, stream)
                    cur = 1 - cur
            return cur
        gemvs = copies * sum(s in shapes for s in seq)
        wbytes = copies * sum(host[s].nbytes for s in seq if s in shapes)
        return record, gemvs, wbytes

    def replay_ms(record) -> tuple[float, int]:
        graphs.begin_capture(st)
        try:
            last = record(st)
        finally:
            g = graphs.end_capture(st)
        exe = g.instantiate()
        exe.upload(st)
        exe.launch(st)
        e0, e1 = rt.Event(dev, timing=True), rt.Event(dev, timing=True)
        times = []
        for _ in range(args.reps):
            e0.record(st)
            exe.launch(st)
            e1.record(st)
            e1.synchronize()
            times.append(e0.elapsed_ms(e1))
        exe.destroy()
        g.destroy()
        return float(np.median(times)), last

    from strata.backends.cuda.bandwidth import copy_rates
    copy_gbs = copy_rates(rt, dev, st, 1 << 30)[1]   # read + written bytes a second, as strata bench counts it
    print(f"device copy {copy_gbs:,.0f} GB/s (read + written), {sms} SMs, carveout "
          f"{'driver' if args.carveout < 0 else f'{args.carveout}%'}")

    ok = True
    # one GEMV of each shape against numpy, every arm
    for name, (rows, n, seg) in shapes.items():
        w = dequant(host[name], n)
        if seg:     # row r against x0's segment r // seg
            ref = np.einsum("srn,sn->sr", w.reshape(rows // seg, seg, n),
                            x0[:rows // seg * n].reshape(rows // seg, n).astype(np.float64)).reshape(rows)
        else:
            ref = w @ x0[:n].astype(np.float64)
        outs = {}
        for arm in args.arms.split(","):
            if seg and arm not in SEG_ARMS:
                continue
            out = rt.DeviceBuffer(dev, BUF * 4)
            if arm.startswith("persist"):
                persist(arm, upload([(W[name][0].ptr, start.ptr, out.ptr, rows, n, seg)]), st)
            else:
                gemv(arm, name, W[name][0], start, out, st)
            y = np.empty(BUF, np.float32)
            out.copy_to_host(y, st)
            st.synchronize()
            outs[arm] = y[:rows]
            err = float(np.max(np.abs(y[:rows] - ref)) / (np.max(np.abs(ref)) + 1e-30))
            same = bool(np.array_equal(outs[arm], next(iter(outs.values()))))
            ok &= err < 1e-4 and same
            print(f"check {name:4s} {arm:7s} max rel err {err:.2e} {'== first arm' if same else '!= FIRST ARM'}")

    report = {"copy_gbs": copy_gbs, "sms": sms, "chains": {}}
    print(f"{'chain':6s} {'arm':7s} {'us/GEMV':>8s} {'GB/s W':>8s} {'% copy':>7s}  graph ms")
    for pattern in args.chains.split(","):
        finals = {}
        for arm in args.arms.split(","):
            if any(shapes.get(step, (0, 0, 0))[2] for step in CHAINS[pattern]) and arm not in SEG_ARMS:
                continue
            record, gemvs, wbytes = chain(arm, pattern)
            ms, last = replay_ms(record)
            y = np.empty(BUF, np.float32)
            bufs[last].copy_to_host(y, st)
            st.synchronize()
            finals[arm] = y
            same = bool(np.array_equal(y, next(iter(finals.values()))))
            ok &= same
            gbs = wbytes / (ms * 1e-3) / 1e9
            report["chains"].setdefault(pattern, {})[arm] = {"ms": ms, "us_per_gemv": 1e3 * ms / gemvs, "gbs": gbs}
            print(f"{pattern:6s} {arm:7s} {1e3 * ms / gemvs:8.2f} {gbs:8.0f} {100 * gbs / copy_gbs:6.1f}%  "
                  f"{ms:.3f}{'' if same else '  OUTPUT != FIRST ARM'}")
    flag = np.zeros(1, np.int32)
    bar_err.copy_to_host(flag, st)
    st.synchronize()
    if flag[0]:
        ok = False
        print("a persistent chain's grid barrier timed out: not every block was resident")
    print("ok" if ok else "FAILED")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
