"""Where a resident prompt's time goes, kernel by kernel, and the tensor cores' share of it (#17).

    python tools/prompt_profile.py [--synthetic qwen3-30b-a3b] [--prompt 4096,16384] [--kernels-off tma-gemm]
                                   [--json PATH]

One loaded model; each prompt is read once to warm up, then once under PyTorch's profiler (CUPTI
records every kernel of the process, the engine's driver-API launches included). Kernels are summed by
entry point (the qtype suffix kept), and by the families #17 asks about: the expert and dense GEMMs
(strata_moe_gemm_*), the f16 dequantization feeding tma-gemm (strata_dequant_h_*), prompt attention
(strata_attention_prefill_*), and the rest. The GEMMs' TFLOP/s are the linear layers' flops of the
prompt (2 x rows x weights: the dense projections per token, the experts per routed slot; the head on
the last row only) over their kernels' time; attention's the causal QK^T and PV flops (2 x 2 x heads x
head_dim a query and earlier key) over its kernels'. Both against the tensor cores' rate measured in
the same run: a bf16 8192^3 torch.matmul, the best of 20 (KINDS.md: 769-798 TFLOP/s on an H100).
Needs torch (the device image has it); prints a table, --json writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FAMILIES = (("gemm", r"^strata_moe_gemm"), ("dequant f16", r"^strata_dequant_h"),
            ("attention", r"^strata_attention_prefill"), ("other", r""))


def matmul_peak(torch) -> float:
    """bf16 TFLOP/s of an 8192^3 product, the best of 20 (after 3 to warm up)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    best = np.inf
    for i in range(23):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        if i >= 3:
            best = min(best, s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / best / 1e12


def prompt_flops(args, sizes, N: int) -> tuple[float, float]:
    """(linear flops, attention flops) of a resident prompt of N tokens on this pack."""
    dense = sum(t["shape"][0] * t["shape"][1] for n, t in sizes.dense.items()
                if n.startswith("blk.") and len(t["shape"]) == 2)
    experts = 0
    for lay in sizes.layers:
        experts += args.num_experts_per_tok * sum(p["shape"][0] * p["shape"][1] for p in lay["parts"].values())
    head = sizes.dense["output.weight"]["shape"] if "output.weight" in sizes.dense else (0, 0)
    linear = 2.0 * N * (dense + experts) + 2.0 * head[0] * head[1]
    full = sum(1 for l in range(args.num_hidden_layers)
               if not hasattr(args, "is_full_attention") or args.is_full_attention(l))
    attention = full * 2.0 * 2 * args.num_attention_heads * args.head_dim * N * (N + 1) / 2
    return linear, attention


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", default="qwen3-30b-a3b")
    ap.add_argument("--prompt", default="4096,16384")
    ap.add_argument("--kernels-off", default="")
    ap.add_argument("--top", type=int, default=12, help="entry points shown per prompt")
    ap.add_argument("--json")
    opts = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile
    from strata import LLM
    from strata.engine.planner import PackSizes
    from strata.pack import open_pack
    from strata.synthetic import synthetic_pack
    lengths = [int(n) for n in opts.prompt.split(",")]
    path = synthetic_pack(opts.synthetic)
    peak = matmul_peak(torch)
    print(f"tensor cores, measured now: {peak:.0f} TFLOP/s (bf16 8192^3 torch.matmul)", flush=True)
    llm = LLM(str(path), device="cuda", max_context=max(lengths) + 64, kernels_off=opts.kernels_off)
    runner = llm.runner
    sizes = PackSizes.of_pack(open_pack(path))
    rng = np.random.default_rng(0)
    out = {"peak_tflops": peak, "kernels_off": opts.kernels_off, "prompts": {}}
    for N in lengths:
        ids = rng.integers(0, 1000, N).tolist()
        runner.reset()
        runner.prefill(ids, 0)              # kernels loaded, pool grown
        runner.reset()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.prefill(ids, 0)
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        by_name: dict = defaultdict(lambda: [0, 0.0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA and ev.name.startswith("strata_"):
                by_name[ev.name][0] += 1
                by_name[ev.name][1] += ev.device_time_total / 1e6     # us -> s
        total = sum(s for _, s in by_name.values())
        fam: dict = defaultdict(float)
        for name, (_, s) in by_name.items():
            fam[next(f for f, pat in FAMILIES if re.search(pat, name))] += s
        linear, attention = prompt_flops(sizes.args, sizes, N)
        rates = {"gemm": linear / fam["gemm"] / 1e12 if fam["gemm"] else 0.0,
                 "attention": attention / fam["attention"] / 1e12 if fam["attention"] else 0.0}
        print(f"\nprompt {N}: {N / wall:,.0f} tok/s under the profiler ({wall * 1e3:.1f} ms; kernels "
              f"{total * 1e3:.1f} ms)", flush=True)
        print(f"{'family':<14}{'ms':>9}{'share':>8}{'TFLOP/s':>10}{'of peak':>9}")
        for f, _ in FAMILIES:
            r = rates.get(f)
            print(f"{f:<14}{fam[f] * 1e3:>9.2f}{fam[f] / total:>8.1%}"
                  + (f"{r:>10.0f}{r / peak:>9.1%}" if r else ""))
        print(f"{'entry point':<44}{'calls':>7}{'ms':>9}{'share':>8}")
        for name, (calls, s) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:opts.top]:
            print(f"{name[:43]:<44}{calls:>7}{s * 1e3:>9.2f}{s / total:>8.1%}")
        out["prompts"][N] = {"wall_s": wall, "kernels_s": total, "families_s": dict(fam), "tflops": rates,
                             "linear_flops": linear, "attention_flops": attention,
                             "kernels": {n: {"calls": c, "s": s} for n, (c, s) in by_name.items()}}
    if opts.json:
        Path(opts.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
