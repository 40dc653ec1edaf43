"""Decode tok/s of the decode variants on one loaded model: programmatic dependent launches on and
off (cuda/pdl.cuh), the fused MoE kernels (cuda/moe_decode.cu) at other blocks-per-SM grid sizes
(any grid gives the same bits), the moe_gemv path, and the one-token GEMVs with and without the
split-K kernel.

    python tools/decode_variants.py [--synthetic qwen3-30b-a3b] [--context 512] [--decode 64] [--json PATH]
    python tools/decode_variants.py --attention --context 512,4096,16384,32768
    python tools/decode_variants.py --route [--context 512]
    python tools/decode_variants.py --route-in-moe [--context 512]
    python tools/decode_variants.py --one-row [--context 512]
    python tools/decode_variants.py --cluster [--context 512] [--decode 96]
    python tools/decode_variants.py --fatbin-arms "plain:attention=.whl/attention_plain.fatbin;pre:attention=.whl/attention_precombine.fatbin"

--attention times the f16 decode attention's two kernels instead (cuda/attention.cu against
cuda/attention_dec_tc.cu, each taking every row: the engine gives rows of TC_DECODE_FROM cells and
more to the second) at each context of the list, on one load whose context grows between them, the
arms alternated (A B A B) so drift shows.

Each variant drops the captured graphs, warms up (eager, capture) and times --decode graph steps
fed random ids. One table, fastest first.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", default="qwen3-30b-a3b")
    ap.add_argument("--context", default="512", help="a context, or with --attention a rising list")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="only PDL on against off")
    ap.add_argument("--attention", action="store_true", help="the f16 decode attention's two kernels, A B A B")
    ap.add_argument("--route", action="store_true", help="only the router's top-k fused (fused-route) against apart, A B A B")
    ap.add_argument("--route-in-moe", action="store_true",
                    help="only the top-k in the MoE gate|up kernel's blocks (route-in-moe) and the post-attention norm in "
                         "the router's (norm-in-router), both, each and neither, A B C D A B C D")
    ap.add_argument("--one-row", action="store_true",
                    help="only the one-token GEMVs one row a warp (one-row-gemv, grids capped at 8 and 4 blocks an SM) "
                         "against 4 rows a warp, A B C A B C")
    ap.add_argument("--cluster", action="store_true",
                    help="only the f16 decode attention of rows under CLUSTER_DECODE_BELOW cells in one cluster launch "
                         "(cluster-decode) against the split-K kernel and the combine, A B A B (keep the context under it)")
    ap.add_argument("--fatbin-arms", default="",
                    help="only variant builds against this one, on one load (DeviceOps.swap_library): arms "
                         "'name:lib=fatbin[,lib=fatbin]' separated by ';', each timed after the tree's, A B C A B C")
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.context.split(",")]
    if contexts != sorted(set(contexts)) or (len(contexts) > 1 and not args.attention):
        ap.error("--context: one context, or with --attention a rising list")
    if args.attention:
        return attention_ab(args, contexts)
    from strata import LLM
    from strata.backends.cuda import memory as cuda_memory, moe as cuda_moe, moe_decode as cuda_moe_decode
    from strata.synthetic import synthetic_pack
    llm = LLM(str(synthetic_pack(args.synthetic)), device="cuda", max_context=contexts[0] + 8 * args.decode + 64)
    runner = llm.runner
    rng = np.random.default_rng(0)
    runner.prefill(rng.integers(0, 1000, contexts[0]).tolist(), 0)
    variants = [("fused, split GEMV, PDL", True, 2, True, True, False),
                ("fused, split GEMV, no PDL", True, 2, True, False, False),
                ("fused, no split, PDL", True, 2, False, True, False), ("fused, 1 block/SM, PDL", True, 1, True, True, False),
                ("moe_gemv path, PDL", False, 2, True, True, False),
                ("top-k in the router (fused-route)", True, 2, True, True, True)]
    if args.quick:
        variants = variants[:2]
    if args.route:          # the router's top-k in its last block against a launch of its own, A B A B
        variants = [("fused route", True, 2, True, True, True), ("top-k apart", True, 2, True, True, False)] * 2
    in_moe, in_router = set(), set()     # variant names with route-in-moe, norm-in-router on
    if args.route_in_moe:   # the top-k in gate|up's blocks, the norm in the router's: both, each, neither
        names = ("both fused", "top-k in gate|up", "norm in router", "neither")
        in_moe, in_router = {names[0], names[1]}, {names[0], names[2]}
        variants = [(n, True, 2, True, True, False) for n in names] * 2
    one_rows = {}           # variant name -> ONE_ROW_BLOCKS_PER_SM (the one-row-gemv arms)
    if args.one_row:
        one_rows = {"one row a warp, 8 blocks/SM": 8, "one row a warp, 4 blocks/SM": 4}
        variants = [("4 rows a warp", True, 2, True, True, False)] + [(n, True, 2, True, True, False) for n in one_rows]
        variants *= 2
    clusters = set()        # variant names with cluster-decode on
    if args.cluster:
        clusters = {"cluster launch"}
        variants = [("cluster launch", True, 2, True, True, False), ("split-K + combine", True, 2, True, True, False)] * 2
    fatbins = {}            # variant name -> {library: fatbin path} (the --fatbin-arms arms; the tree's: {})
    if args.fatbin_arms:
        fatbins = {"tree": {}}
        for arm in filter(None, (a.strip() for a in args.fatbin_arms.split(";"))):
            name, _, libs = arm.partition(":")
            fatbins[name] = dict(lib.split("=", 1) for lib in libs.split(","))
        variants = [(n, True, 2, True, True, False) for n in fatbins] * 2
    rows = []
    for name, fused, bps, split, pdl, route in variants:
        try:
            if fatbins:     # this arm's libraries from its fatbins, every other (and the tree's) from the package
                for lib in {lib for libs in fatbins.values() for lib in libs}:
                    path = fatbins[name].get(lib)
                    runner.ops.swap_library(lib, Path(path).read_bytes() if path else None)
            if name in one_rows:
                cuda_memory.ONE_ROW_BLOCKS_PER_SM = one_rows[name]
            one_row = {"one_row_gemv": name in one_rows} if args.one_row else {}     # else the load's (default on)
            # route-in-moe / norm-in-router: per arm; --route's "apart" arm keeps moe_route's own launch; else the
            # load's (on by default)
            fusions = ({"route_in_moe": name in in_moe, "norm_in_router": name in in_router}
                       if args.route_in_moe or args.route else {})
            cluster = {"cluster_decode": name in clusters} if args.cluster else {}
            runner.ops.paths = dataclasses.replace(runner.ops.paths, fused_decode=fused, split_gemv=split, pdl=pdl,
                                                   fused_route=route, **one_row, **fusions, **cluster)
            runner.ops.pdl = pdl and tuple(runner.dev.compute_capability) >= (9, 0)
            cuda_moe.gate_up_launch = functools.partial(cuda_moe_decode.gate_up_launch, blocks_per_sm=bps)
            cuda_moe.gate_up_route_launch = functools.partial(cuda_moe_decode.gate_up_route_launch, blocks_per_sm=bps)
            cuda_moe.down_launch = functools.partial(cuda_moe_decode.down_launch, blocks_per_sm=bps)
            tok_s, start = timed_steps(runner, rng, args.decode)
            rows.append((name + (" (2)" if any(r[0] == name for r in rows) else ""), tok_s))
            print(f"{name:<32}{tok_s:>10.1f} tok/s  (context {start}..{len(runner.cached_ids)})", flush=True)
        except Exception as exc:       # report and go on: one variant failing says nothing of the others
            print(f"{name:<32} failed: {type(exc).__name__}: {exc}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows), indent=1))
    return 0


def timed_steps(runner, rng, steps: int) -> tuple[float, int]:
    """Drop the graphs, warm up (eager, capture) and time `steps` graph steps: (tok/s, first context)."""
    runner.drop_graphs()
    runner._step_bytes.clear()
    start = len(runner.cached_ids)
    for _ in range(3):
        runner.decode(int(rng.integers(0, 1000)))
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.decode(int(rng.integers(0, 1000)))
    return steps / (time.perf_counter() - t0), start


def attention_ab(args, contexts: list[int]) -> int:
    from strata import LLM
    from strata.synthetic import synthetic_pack
    arms = (("attention.cu", False), ("attention_dec_tc.cu", True))
    steps_per_context = 2 * len(arms) * (args.decode + 3)
    llm = LLM(str(synthetic_pack(args.synthetic)), device="cuda", max_context=contexts[-1] + steps_per_context + 64)
    runner = llm.runner
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'context':>8}  " + "".join(f"{name:>22}" for name, _ in arms) + "   (tok/s, A B A B: the mean of two)")
    for context in contexts:
        have = len(runner.cached_ids)
        if context > have:
            runner.prefill(rng.integers(0, 1000, context - have).tolist(), have, logits=False)
        times = {name: [] for name, _ in arms}
        for _ in range(2):
            for name, tc in arms:
                runner.ops.paths = dataclasses.replace(runner.ops.paths, tc_decode_attention=tc)
                runner.ops.tc_from = 0      # with the path on, every row takes the tensor cores' kernel
                times[name].append(timed_steps(runner, rng, args.decode)[0])
        rows.append({"context": context, **{name: times[name] for name in times}})
        print(f"{context:>8}  " + "".join(f"{np.mean(t):>14.1f} ({min(t):.0f}-{max(t):.0f})" for t in times.values()),
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
