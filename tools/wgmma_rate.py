"""What one multiprocessor's warpgroup MMAs reach from shared memory, by operand layout (#17): runs
tools/variants/wgmma_rate.cu's kernels (.whl/wgmma_rate.fatbin from tools/variants/make_wgmma.sh) on
one block a multiprocessor, one and two warpgroups, waiting for the MMAs every round (as a kernel that
needs S before its softmax) and every 8, and prints TFLOP/s.

    python3 tools/wgmma_rate.py [--fatbin .whl/wgmma_rate.fatbin] [--iters 4000] [--json F]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]
from fatbin_driver import Arm  # noqa: E402

KERNELS = {"ss64": 64, "ss128": 128, "ss128sw": 128, "rs128": 128}     # name -> N
SHARED = 64 * 1024


def tflops(sms: int, groups: int, iters: int, n: int, ms: float) -> float:
    return sms * groups * iters * 8 * 2 * 64 * n * 16 / ms / 1e9


def main(argv=None, make_driver=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fatbin", default=".whl/wgmma_rate.fatbin")
    ap.add_argument("--iters", type=int, default=4000)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if make_driver is None:
        from fatbin_driver import Driver as make_driver
    dev = make_driver()
    sms = dev.torch.cuda.get_device_properties(0).multi_processor_count
    arm = Arm(dev, "rate", args.fatbin, "strata_wgmma_rate")
    out = dev.full((sms * 256,), 0.0)
    rows = []
    print(f"{'kernel':>8} {'groups':>6} {'wait':>5} {'ms':>8} {'TF/s':>7}")
    for name, n in KERNELS.items():
        for groups in (1, 2):
            for wait in (1, 8):
                def go():
                    dev.launch(arm.fn(name), sms, 128 * groups, [("P", out.data_ptr()), ("i", args.iters),
                                                                ("i", wait)], shared=SHARED)
                ms = sorted(dev.time_ms(go, 5))[2]
                tf = tflops(sms, groups, args.iters, n, ms)
                rows.append({"kernel": name, "groups": groups, "wait_every": wait, "ms": ms, "tflops": tf})
                print(f"{name:>8} {groups:>6} {wait:>5} {ms:>8.3f} {tf:>7.0f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"sms": sms, "iters": args.iters, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
