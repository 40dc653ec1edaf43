"""The residual add + RMSNorm and the QK-norm + RoPE + K/V append of a decode step (strata_add_rms_norm_f32,
strata_qk_norm_rope_kv_f32: cuda/decode_fused.cu) timed from CUDA graphs with programmatic dependent
launches, as a step runs them, for two or more builds of decode_fused.cu: #16's question whether a small
kernel's memory round trips are its time.

Chains (one row, the norm's n):
  norm   96 add + RMSNorms in a row, each reading the one before
  qkv    48 x (the fused q|k|v GEMV, Q8_0 5,120 x n, then add + RMSNorm of its first n outputs)
  rope   48 QK-norm + RoPE + f16 K/V appends at the 30B's heads (32 / 4, Dh 128), q in place, each
         reading the q the one before wrote
  ropeq  the same with q4_0 K/V appends (strata_qk_norm_rope_kv_q4_0: q rotated, K and V quantized)
Every arm's final outputs must equal the first arm's bit for bit (the same sums in the same order;
rope's within 1e-4 of the largest, as a build may contract its head sums otherwise), and one norm is
checked against numpy. Prints us a chain step and the graph's time, the median of --reps.

    python tools/norm_chain_bench.py --arm new:strata/kernels/decode_fused.fatbin \
        --arm parent:.whl/decode_fused_parent.fatbin [--n 2048] [--reps 9] [--json F]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))     # the other tools' helpers

STEPS = 96          # norms a chain (a decode step of the 30B shape has 96)
QKV_ROWS = 5120


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", required=True, help="NAME:PATH of a decode_fused fatbin")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=2, help="arms alternated this many times (drift shows)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from strata._ext import runtime as rt
    from moe_decode_bench import graph_ms
    from pdl_chain_bench import q8_0

    rt.init()
    dev = rt.Device(0)
    st = rt.Stream(dev)
    n = args.n
    arms = {}
    for spec in args.arm:
        name, _, path = spec.partition(":")
        lib = rt.Library(f"decode_fused_{name}", Path(path).read_bytes())
        arms[name] = (lib.kernel(dev, "strata_add_rms_norm_f32", "PPPPPiif"),
                      lib.kernel(dev, "strata_gemv3_q8_0", "PPPPPPPiiiii"),
                      lib.kernel(dev, "strata_qk_norm_rope_kv_f32", "PPPPPPPPPPPiiiiff"),
                      lib.kernel(dev, "strata_qk_norm_rope_kv_q4_0", "PPPPPPPPPPPPPiiiifff"))
    rng = np.random.default_rng(0)
    w_host = rng.uniform(0.5, 1.5, n).astype(np.float32)
    x_host = rng.standard_normal(n).astype(np.float32)
    w, x0 = rt.DeviceBuffer(dev, n * 4), rt.DeviceBuffer(dev, n * 4)
    w.copy_from_host(w_host, st)
    x0.copy_from_host(x_host, st)
    wq_host = q8_0(QKV_ROWS, n, rng)
    wq = [rt.DeviceBuffer(dev, wq_host.nbytes) for _ in range(STEPS // 2)]
    for b in wq:
        b.copy_from_host(wq_host, st)
    resid = rt.DeviceBuffer(dev, n * 4)
    bufs = [rt.DeviceBuffer(dev, QKV_ROWS * 4) for _ in range(2)]
    normed = rt.DeviceBuffer(dev, n * 4)
    H, Hk, dh = 32, 4, 128
    qk_host = rng.standard_normal((H + 2 * Hk) * dh).astype(np.float32)
    qk = rt.DeviceBuffer(dev, qk_host.nbytes)          # q [H, dh], then k and v [Hk, dh]
    q0 = rt.DeviceBuffer(dev, qk_host.nbytes)
    q0.copy_from_host(qk_host, st)
    norm_w = rt.DeviceBuffer(dev, dh * 4)
    norm_w.copy_from_host(rng.uniform(0.5, 1.5, dh).astype(np.float32), st)
    inv = rt.DeviceBuffer(dev, dh // 2 * 4)
    inv.copy_from_host((1e6 ** (-np.arange(0, dh, 2) / dh)).astype(np.float32), st)
    pos = rt.DeviceBuffer(dev, 4)
    pos.copy_from_host(np.array([511], np.int32), st)
    cache = rt.DeviceBuffer(dev, 1024 * Hk * dh * 2 * 2)      # k then v, 1,024 cells of f16
    # q4_0 planes (ropeq): k values, k scales, v values, v scales of 1,024 cells
    plane_bytes = [1024 * Hk * dh // 2, 1024 * Hk * dh // 32 * 2] * 2
    planes = [rt.DeviceBuffer(dev, b) for b in plane_bytes]
    st.synchronize()

    # one norm against numpy (x + x, then the norm), every arm
    ok = True
    ref_sum = x_host + x_host
    ref = ref_sum / np.sqrt(np.mean(ref_sum.astype(np.float64) ** 2) + 1e-6) * w_host
    for name, (norm, *_) in arms.items():
        norm.launch(1, 256, (x0.ptr, x0.ptr, resid.ptr, w.ptr, normed.ptr, 1, n, 1e-6), stream=st)
        got = np.empty(n, np.float32)
        normed.copy_to_host(got, st)
        st.synchronize()
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        ok &= err < 1e-5
        print(f"check {name}: max rel err {err:.2e}")

    def record(name, chain):
        norm, gemv3, rope, ropeq = arms[name]

        def rec(stream):
            rt.copy_d2d(resid.ptr, x0.ptr, n * 4, stream)
            rt.copy_d2d(normed.ptr, x0.ptr, n * 4, stream)
            rt.copy_d2d(qk.ptr, q0.ptr, qk_host.nbytes, stream)
            if chain == "rope":
                kc, vc = cache.ptr, cache.ptr + 1024 * Hk * dh * 2
                for _ in range(STEPS // 2):
                    rope.launch((1, -(-(H + 2 * Hk) // 4)), 128,
                                (qk.ptr, qk.ptr + H * dh * 4, qk.ptr + (H + Hk) * dh * 4, norm_w.ptr, norm_w.ptr,
                                 pos.ptr, 0, inv.ptr, qk.ptr, kc, vc, 1, H, Hk, dh, 1e-6, 1.0),
                                stream=stream, pdl=True)
                return
            if chain == "ropeq":
                for _ in range(STEPS // 2):
                    ropeq.launch((1, -(-(H + 2 * Hk) // 4)), 128,
                                 (qk.ptr, qk.ptr + H * dh * 4, qk.ptr + (H + Hk) * dh * 4, norm_w.ptr, norm_w.ptr,
                                  pos.ptr, 0, inv.ptr, qk.ptr, *(p.ptr for p in planes), 1, H, Hk, dh, 1e-6, 1.0,
                                  float(np.float32(1.0 / np.sqrt(dh)))), stream=stream, pdl=True)
                return
            for i in range(STEPS if chain == "norm" else STEPS // 2):
                if chain == "qkv":
                    # q|k|v of the normed row (k, v: no rows), then the residual add of q's first n outputs
                    gemv3.launch(-(-QKV_ROWS // 16), 128, (wq[i].ptr, wq[i].ptr, wq[i].ptr, normed.ptr, bufs[0].ptr,
                                                           bufs[1].ptr, bufs[1].ptr, QKV_ROWS, 0, 0, n, 1),
                                 stream=stream, pdl=True)
                    y = bufs[0].ptr
                else:
                    y = normed.ptr
                norm.launch(1, 256, (resid.ptr, y, resid.ptr, w.ptr, normed.ptr, 1, n, 1e-6), stream=stream, pdl=True)
        return rec

    def replay(rec, chain) -> tuple[float, np.ndarray]:
        ms = graph_ms(rt, dev, st, rec, args.reps)       # the outputs are then one chain's
        if chain == "rope":     # q after the chain and the cache's k / v rows at cell 511
            out = np.empty(H * dh + 2 * Hk * dh // 2, np.float32)
            qk.copy_to_host(out[:H * dh], st)
            st.synchronize()
            cells = np.empty(1024 * Hk * dh * 2, np.float16)
            cache.copy_to_host(cells, st)
            st.synchronize()
            kv = cells.reshape(2, 1024, Hk * dh)[:, 511].reshape(-1)
            out[H * dh:] = kv.view(np.float32)
        elif chain == "ropeq":  # q after the chain and every plane's bytes
            out = np.empty(H * dh, np.float32)
            qk.copy_to_host(out, st)
            st.synchronize()
            for p, b in zip(planes, plane_bytes):
                raw = np.empty(b // 4, np.float32)
                p.copy_to_host(raw, st)
                st.synchronize()
                out = np.concatenate([out, raw])
        else:
            out = np.empty(n, np.float32)
            normed.copy_to_host(out, st)
            st.synchronize()
        return ms, out

    report = {}
    print(f"{'chain':6s} {'arm':10s} {'us a step':>10s}  graph ms (rounds)")
    for chain in ("norm", "qkv", "rope", "ropeq"):
        steps = STEPS if chain == "norm" else STEPS // 2
        times, finals = {a: [] for a in arms}, {}
        for _ in range(args.rounds):
            for name in arms:
                ms, out = replay(record(name, chain), chain)
                times[name].append(ms)
                finals[name] = out
        first = next(iter(finals.values()))
        for name in arms:
            same = bool(np.array_equal(finals[name].view(np.uint32), first.view(np.uint32)))
            if chain == "rope":     # a build may round the head's sum of squares in another order: close
                a, b = finals[name][:H * dh], first[:H * dh]
                ok &= bool(np.isfinite(a).all()) and bool(np.abs(a - b).max() <= 1e-4 * np.abs(b).max())
            elif chain == "ropeq":  # q, then the planes' raw bytes (not floats)
                ok &= same and bool(np.isfinite(finals[name][:H * dh]).all())
            else:
                ok &= same and bool(np.isfinite(finals[name]).all())
            ms = float(np.median(times[name]))
            print(f"{chain:6s} {name:10s} {1000 * ms / steps:10.2f}  {' '.join(f'{t:.3f}' for t in times[name])}"
                  f"{'' if same else '  != FIRST ARM'}")
            report.setdefault(chain, {})[name] = {"us_step": 1000 * ms / steps, "graph_ms": times[name]}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print("checks:", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
