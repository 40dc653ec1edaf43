"""Digests of the quantized split-K decode's outputs (cuda/kv_quant.cu's strata_attention_decode_<fmt>_d<Dh>_g<GP>
through strata.backends.cuda.kv.KVQuantOps.attention_decode: the q rotation, the split-K kernel, the
combine, the un-rotation) over fixed inputs: every format, head dim and query group, partial tiles and
one-cell rows, a window over a ring, the --kv-resident VRAM window, 32K cells. A change to the kernels
that must keep their sums bit for bit (a new load path, say) prints the same lines before and after:

    python tools/kv_decode_digest.py > before.txt     # the old build
    python tools/kv_decode_digest.py > after.txt      # the new build
    diff before.txt after.txt                         # empty: bit for bit

Each line: the case, then the sha256 (first 16 hex digits) of the f32 output bytes. Needs a GPU.
`--against FILE` also compares each line with FILE's line of the same case and exits 1 if any differ
(tests/kernels/data/kv_decode_digest_sm90.txt holds the --quick lines an sm_90 GPU gave at 32e889e,
which tests/kernels/test_kv_decode_digest_gpu.py checks).
"""
from __future__ import annotations

import argparse
import hashlib

import numpy as np

from strata.quant import kv as kvq


def heads(rng, shape):
    """K/V-like rows (tests/kernels/test_kv_quant_gpu.py's): normal, one outlier channel, a zero head."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., 5] *= 30.0
    x.reshape(-1, shape[-1])[0] = 0.0
    return x


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, np.float32).tobytes()).hexdigest()[:16]


def cases(full: bool):
    for fmt in ("int8", "q4_0", "k8v4"):
        for dh in (64, 128, 256):
            for G in ((1, 2, 3, 8) if dh == 256 else (1, 2, 3, 8, 16)):
                for splits in (None, 7):
                    yield dict(fmt=fmt, dh=dh, Hk=2, G=G, S=300, lengths=(300, 1, 47, 129), splits=splits)
        yield dict(fmt=fmt, dh=128, Hk=4, G=8, S=256, lengths=(1000,), window=200, ring=256)
        for dh, Hk, G in ((128, 4, 8), (256, 2, 8), (64, 8, 1)):
            yield dict(fmt=fmt, dh=dh, Hk=Hk, G=G, S=5005, lengths=(5000,), vram=1024)
        if full:
            yield dict(fmt=fmt, dh=128, Hk=4, G=8, S=32768, lengths=(32768, 32767))


def run(kvops, case: dict) -> np.ndarray:
    fmt, dh, Hk, G, S = case["fmt"], case["dh"], case["Hk"], case["G"], case["S"]
    lengths = np.array(case["lengths"], np.int32)
    B, H = len(lengths), G * Hk
    rng = np.random.default_rng([dh, Hk, G, S, B, {"int8": 0, "q4_0": 1, "k8v4": 2}[fmt]])
    kc, vc = kvq.codecs(fmt)
    k, v = heads(rng, (B, S, Hk, dh)), rng.standard_normal((B, S, Hk, dh)).astype(np.float32)
    kp, vp = kc.encode(k), vc.encode(v)
    q = rng.standard_normal((B, H, dh)).astype(np.float32)
    if "vram" in case:            # the newest cells in a ring of their own (cell c at c % R), as --kv-resident
        R, n = case["vram"], int(lengths[0])

        def ring(plane):
            r = np.zeros((R,) + plane.shape[2:], plane.dtype)
            for c in range(max(0, n - R), n):
                r[c % R] = plane[0, c]
            return r
        rings = (tuple(ring(p) for p in kp), tuple(ring(p) for p in vp))
        return kvops.attention_decode(fmt, q, kp, vp, lengths, vram=rings)
    return kvops.attention_decode(fmt, q, kp, vp, lengths, num_splits=case.get("splits"),
                                  window=case.get("window", 0), ring=case.get("ring", 0))


def lines(kvops, full: bool):
    """Each case's line: its name, then its output's digest."""
    for case in cases(full):
        name = " ".join(f"{k}={v}" for k, v in case.items() if v is not None)
        yield f"{name:<78} {digest(run(kvops, case))}"


def differences(got: list[str], want_text: str) -> list[str]:
    """The lines of got whose case has another digest in want_text (or none there)."""
    want = dict(line.rsplit(None, 1) for line in want_text.splitlines() if line.strip())
    return [line for line in got if want.get(line.rsplit(None, 1)[0]) != line.rsplit(None, 1)[1]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="without the 32K-cell cases")
    ap.add_argument("--against", metavar="FILE", help="an earlier run's lines: exit 1 where a case differs")
    args = ap.parse_args()
    from strata.backends.cuda.kv import KVQuantOps
    from strata.backends.cuda.testing import CudaOps
    kvops = KVQuantOps(CudaOps())
    got = []
    for line in lines(kvops, not args.quick):
        print(line, flush=True)
        got.append(line)
    if args.against:
        with open(args.against) as f:
            bad = differences(got, f.read())
        print(f"{len(bad)} of {len(got)} cases differ from {args.against}", flush=True)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
