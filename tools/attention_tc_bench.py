"""Causal prompt attention, the tensor-core kernel (cuda/attention_tc.cu) against the FFMA one.

At Qwen3-30B-A3B's shape (H 32, Hk 4, Dh 128) or Qwen3-Next-80B's (--shape 80b: H 16, Hk 2, Dh 256,
12 full-attention layers of 48); the FFMA kernel is strata_attention_prefill_f16_d<Dh> in attention.cu.

    python tools/attention_tc_bench.py [--shape 30b|80b] [--json PATH] [--reps N]

For each (T, offset) chunk: T queries at positions offset..offset+T-1 over offset+T cached cells.
Times are CUDA-event medians of back-to-back launches after a warm-up; TFLOP/s counts the causal
work only, 2 * 2 * Dh * H * sum over queries of (position + 1) (Q K^T and P V). The last line
projects the 48 layers of a 16K-token prompt from the tensor-core kernel's rate at the longest chunk.
Also checks that both kernels agree (max relative difference per head).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from strata.backends.cuda.testing import CudaOps, time_launches
from strata.backends.cuda.attention_tc import prefill_tc_launch_shape, table_op

# (H, Hk, Dh, layers with softmax attention)
SHAPES = {"30b": (32, 4, 128, 48), "80b": (16, 2, 256, 12)}
H, HK, DH, LAYERS = SHAPES["30b"]
PROMPT = 16384
CHUNKS = [(512, 0), (4096, 0), (4096, 12288)]


def causal_flops(T: int, offset: int) -> float:
    return 4.0 * DH * H * (T * offset + T * (T + 1) / 2)



def bench_chunk(ops: CudaOps, rng, T: int, offset: int, reps: int) -> dict:
    rt, dev, stream = ops._rt, ops.device, ops.stream
    S = offset + T
    q = ops._upload(rng.standard_normal((T, H, DH)).astype(np.float32))
    kc = ops._upload(rng.standard_normal((S, HK, DH)).astype(np.float16))
    vc = ops._upload(rng.standard_normal((S, HK, DH)).astype(np.float16))
    pos = ops._upload(np.arange(offset, S, dtype=np.int32))
    outs = {name: rt.DeviceBuffer(dev, T * H * DH * 4) for name in ("tc", "ffma")}
    args = (q, kc, vc, pos)
    scale = 1 / math.sqrt(DH)
    tc = ops._kernel(table_op(DH), dh=DH)
    grid, block = prefill_tc_launch_shape(T, H, HK, DH)
    ffma = ops._kernel("attention_prefill", dh=DH)
    ffma_grid = (-(-T * (H // HK) // (16 if DH == 256 else 32)), HK)      # its rows a block
    tc_ms = time_launches(ops, lambda: tc.launch(grid, block, (*args, outs["tc"], T, H, HK, scale), stream=stream), reps)
    ffma_ms = time_launches(
        ops, lambda: ffma.launch(ffma_grid, 128, (*args, outs["ffma"], T, H, HK, scale), stream=stream), reps)
    got = {name: ops._download(buf, (T, H, DH), np.float32).astype(np.float64) for name, buf in outs.items()}
    diff = np.abs(got["tc"] - got["ffma"]).max(-1) / np.abs(got["ffma"]).max(-1)
    flops = causal_flops(T, offset)
    return {"T": T, "offset": offset, "flops": flops, "tc_ms": tc_ms, "tc_tflops": flops / tc_ms / 1e9,
            "ffma_ms": ffma_ms, "ffma_tflops": flops / ffma_ms / 1e9, "max_rel_diff": float(diff.max())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--reps", type=int, default=10, help="timed launches per kernel and chunk")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="30b", help="the model's attention heads")
    args = parser.parse_args()
    global H, HK, DH, LAYERS
    H, HK, DH, LAYERS = SHAPES[args.shape]
    rng = np.random.default_rng()
    ops = CudaOps()
    rows = [bench_chunk(ops, rng, T, offset, args.reps) for T, offset in CHUNKS]
    prompt_s = LAYERS * causal_flops(PROMPT, 0) / (rows[-1]["tc_tflops"] * 1e12)
    print(f"H {H}, Hk {HK}, Dh {DH}; {ops.device.name}")
    print(f"{'T':>6} {'offset':>7} {'GFLOP':>8} {'tc ms':>8} {'TFLOP/s':>8} {'ffma ms':>8} {'TFLOP/s':>8} "
          f"{'speedup':>8} {'rel diff':>9}")
    for r in rows:
        print(f"{r['T']:>6} {r['offset']:>7} {r['flops'] / 1e9:>8.1f} {r['tc_ms']:>8.3f} {r['tc_tflops']:>8.1f} "
              f"{r['ffma_ms']:>8.3f} {r['ffma_tflops']:>8.1f} {r['ffma_ms'] / r['tc_ms']:>7.1f}x {r['max_rel_diff']:>9.2e}")
    print(f"projected attention time of a {PROMPT}-token prompt over {LAYERS} layers at "
          f"{rows[-1]['tc_tflops']:.0f} TFLOP/s: {prompt_s:.3f} s")
    if args.json:
        args.json.write_text(json.dumps({"shape": {"H": H, "Hk": HK, "Dh": DH}, "chunks": rows,
                                         "projected_prompt_s": prompt_s}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
