"""Aggregate decode speed of 1, 2, 4 and 8 concurrent requests in --parallel slots (#19), and a short
request's time to its first token while a long prompt is being read in another slot.

    python tools/parallel_bench.py [--synthetic qwen3-30b-a3b] [--budget-gib 0,12] [--batch-max 0,1]
                                   [--clients 1,2,4,8] [--prompt 64] [--decode 128] [--warm 8]
                                   [--context N] [--prompts-apart] [--trace]
                                   [--long 16384] [--long-chunk 2048] [--json F]

Each round submits N requests of random prompts at once (greedy, no end-of-sequence: each runs
--decode tokens) and steps the scheduler until all are done, after a warm round of the same N
(--warm tokens each: new step shapes' graphs, and the auto batch rule's first measurements).
Aggregate decode tok/s = every request's tokens after its first / (the last finish - the first
first token). --budget-gib and --batch-max take lists: every budget (0: resident) runs every
--batch-max (0: the auto rule; 1: each sequence steps alone, the rows-in-line baseline; N: steps of
up to N rows), one engine each, on the same prompts; the table at the end puts the arms side by
side, and each round reports the rule's cap and its measured step ms per row count. The long-prompt
round (the first budget and --batch-max; --long 0: none) reads --long tokens in chunks of
--long-chunk (N, or auto: the plan's; an LLM of its own; under a budget each chunk takes its own loan) and submits a 19-token request after the first chunk: its
first-token time, beside the same request alone.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import numpy as np


def _llm(args, parallel: int, context: int, prefill: str, budget_gib: float = 0.0, batch_max: int = 0):
    from strata import LLM
    from strata.synthetic import synthetic_pack
    source = str(synthetic_pack(args.synthetic)) if args.synthetic else args.model
    kw = {"vram_budget_gib": budget_gib} if budget_gib else {}
    llm = LLM(source, device=args.device, parallel=parallel, max_context=context, prefill=prefill,
              batch_max=min(batch_max, parallel), **kw)
    llm.tokenizer.eos_token_ids = []
    llm.warm_up()
    return llm


def trace_summary(trace) -> dict:
    """Scheduler.trace of a round -> per grouping of the iteration's batched steps (e.g. "4" or "2+2";
    "-" for iterations with none): iterations, median ms of the iteration, of its steps, and outside
    them (rows stepping alone, prompts read, the loop's own host work), the iteration's mean, 90th
    percentile and largest ms (under a budget a few slow steps, the misses after the prompts, can
    hold most of the time while the median stays low), and the first 16 iterations' ms in order; and
    the round's totals."""
    by: dict[str, list] = {}
    for total, groups, alone, prompts in trace:
        key = "+".join(str(rows) for rows, _ in groups) or "-"
        steps = sum(sec for _, sec in groups)
        by.setdefault(key, []).append((total, steps, total - steps))
    out = {"iterations": len(trace), "total_ms": round(1e3 * sum(t[0] for t in trace), 1),
           "in_steps_ms": round(1e3 * sum(sec for t in trace for _, sec in t[1]), 1),
           "alone_ms": round(1e3 * sum(t[2] for t in trace), 1), "prompts_ms": round(1e3 * sum(t[3] for t in trace), 1),
           "groupings": {}}
    for key, rows in sorted(by.items(), key=lambda kv: -len(kv[1])):
        a = np.array(rows) * 1e3
        out["groupings"][key] = {"iterations": len(rows), "median_ms": round(float(np.median(a[:, 0])), 3),
                                 "median_steps_ms": round(float(np.median(a[:, 1])), 3),
                                 "median_outside_ms": round(float(np.median(a[:, 2])), 3),
                                 "mean_ms": round(float(a[:, 0].mean()), 3),
                                 "p90_ms": round(float(np.percentile(a[:, 0], 90)), 3),
                                 "max_ms": round(float(a[:, 0].max()), 3)}
    out["first_ms"] = [round(1e3 * t[0], 2) for t in list(trace)[:16]]
    return out


def clients_round(llm, n: int, prompt: int, decode: int, rng, trace: bool = False) -> dict:
    from collections import deque

    from strata.config import SamplingParams
    from strata.engine.scheduler import Request
    V = llm.args.vocab_size
    params = SamplingParams(max_tokens=decode)
    llm.scheduler.trace = deque() if trace else None
    t0 = time.monotonic()
    reqs = [llm.scheduler.submit(Request(rng.integers(0, V, prompt).tolist(), params)) for _ in range(n)]
    while llm.scheduler.step():
        pass
    recorded, llm.scheduler.trace = llm.scheduler.trace, None
    first = min(r.first_token for r in reqs)
    last = max(r.finished for r in reqs)
    tokens = sum(r.num_tokens - 1 for r in reqs)
    return {"clients": n, "aggregate_decode_tok_s": tokens / (last - first), "tokens": tokens,
            "first_tokens_ms": [round((r.first_token - t0) * 1e3, 1) for r in reqs],
            "prompt_batches": (llm.status().get("prompt_batches") or {}).get("forwards"),
            "wall_s": last - t0, "per_client_tok_s": [round((r.num_tokens - 1) / (r.finished - r.first_token), 1)
                                                      for r in reqs],
            "batching": llm.batching.to_dict(), **({"trace": trace_summary(recorded)} if trace else {})}


def long_prompt_round(args, rng) -> dict:
    from strata.config import SamplingParams
    from strata.engine.scheduler import Request
    llm = _llm(args, 2, args.long + 64, args.long_chunk, args.budgets[0], args.batch_maxes[0])
    V = llm.args.vocab_size
    short_ids = rng.integers(0, V, 19).tolist()
    alone = llm.scheduler.submit(Request(short_ids, SamplingParams(max_tokens=4)))
    while llm.scheduler.step():
        pass
    llm.runner.use(0)
    llm.runner.reset()
    llm.runner.use(1)
    llm.runner.reset()
    long = llm.scheduler.submit(Request(rng.integers(0, V, args.long).tolist(), SamplingParams(max_tokens=4)))
    llm.scheduler.step()                 # the long prompt's first chunk
    short = llm.scheduler.submit(Request(rng.integers(0, V, 19).tolist(), SamplingParams(max_tokens=4)))
    while llm.scheduler.step():
        pass
    ms = lambda a, b: round((b - a) * 1e3, 1)      # noqa: E731
    store = getattr(llm.runner, "store", None)
    return {"long_prompt": args.long, "long_chunk": args.long_chunk, "prompt_chunk": llm.status().get("prefill_chunk"),
            "streamed": bool(store is not None and not store.resident),
            "short_alone_first_token_ms": ms(alone.created, alone.first_token),
            "short_beside_long_first_token_ms": ms(short.created, short.first_token),
            "long_first_token_ms": ms(long.created, long.first_token),
            "short_done_before_long_prompt": short.finished < long.first_token}


def arm(args, budget_gib: float, batch_max: int, clients: list[int]) -> dict:
    """The clients rounds of one engine: --vram-budget-gib budget_gib (0: resident), --batch-max."""
    rng = np.random.default_rng(0)          # every arm the same prompts
    out = {"budget_gib": budget_gib, "batch_max": batch_max, "rounds": []}
    context = max(args.context, args.prompt + max(args.warm, args.decode) + 8)
    llm = _llm(args, max(clients), context, "auto", budget_gib, batch_max)
    if args.prompts_apart:              # the A/B of prompts read together (LLM._prompt_batch)
        llm.scheduler.batch_prompts = None
    name = f"{budget_gib:g} GiB" if budget_gib else "resident"
    print(f"{name}, --batch-max {batch_max}: plan {llm.status().get('prefill_chunk')} chunk, parallel "
          f"{llm.config.parallel}, context {llm.max_context} a slot", flush=True)
    for n in clients:
        clients_round(llm, n, args.prompt, args.warm, rng)   # new shapes: eager, capture; the rule's first steps
        r = clients_round(llm, n, args.prompt, args.decode, rng, trace=args.trace)
        out["rounds"].append(r)
        b = r["batching"]
        print(f"  {n} clients: aggregate decode {r['aggregate_decode_tok_s']:,.1f} tok/s (per client "
              f"{r['per_client_tok_s']}); steps of up to {b['cap']} rows, step ms by rows {b['step_ms']}; first "
              f"tokens at {r['first_tokens_ms']} ms, prompt forwards so far {r['prompt_batches']}", flush=True)
        if args.trace:
            t = r["trace"]
            print(f"    trace: {t['iterations']} iterations, {t['total_ms']:,.1f} ms: batched steps {t['in_steps_ms']:,.1f}, "
                  f"rows alone {t['alone_ms']:,.1f}, prompts {t['prompts_ms']:,.1f}; by grouping "
                  + "; ".join(f"{k} x{g['iterations']}: {g['median_ms']} ms ({g['median_steps_ms']} in steps, "
                              f"{g['median_outside_ms']} outside; mean {g['mean_ms']}, p90 {g['p90_ms']}, "
                              f"max {g['max_ms']})" for k, g in t["groupings"].items())
                  + f"; first iterations (ms) {t['first_ms']}", flush=True)
    one = out["rounds"][0]["aggregate_decode_tok_s"]
    for r in out["rounds"]:
        r["x_one_client"] = round(r["aggregate_decode_tok_s"] / one, 2)
    del llm
    gc.collect()                        # its VRAM back before the next engine loads
    return out


def table(arms: list[dict]) -> str:
    """clients down, one column per arm: aggregate tok/s (x one client)."""
    head = ["clients"] + [f"{a['budget_gib']:g} GiB" if a["budget_gib"] else "resident" for a in arms]
    sub = [""] + [f"batch-max {a['batch_max'] or 'auto'}" for a in arms]
    rows = [head, sub]
    for i, r0 in enumerate(arms[0]["rounds"]):
        rows.append([str(r0["clients"])] + [f"{a['rounds'][i]['aggregate_decode_tok_s']:,.1f} "
                                            f"({a['rounds'][i]['x_one_client']:.2f}x)" for a in arms])
    width = [max(len(r[j]) for r in rows) for j in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, width)) for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", default="qwen3-30b-a3b")
    ap.add_argument("--model", help="a pack or GGUF instead of --synthetic")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget-gib", default="0", help="VRAM budgets, comma-separated (0: resident)")
    ap.add_argument("--batch-max", default="0", help="--batch-max values, comma-separated (0: auto)")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--warm", type=int, default=8, help="tokens a request of each warm round")
    ap.add_argument("--long", type=int, default=16384, help="0: no long-prompt round")
    ap.add_argument("--long-chunk", default="2048", help="the long round's --prefill (N, auto or auto:N)")
    ap.add_argument("--context", type=int, default=1024,
                    help="each slot's context (raised to what a request needs; it bounds the prompt chunk, "
                         "and so how many prompts one forward reads: below 8 x 64 tokens, 8 clients' "
                         "prompts take more than one)")
    ap.add_argument("--prompts-apart", action="store_true",
                    help="each request's prompt read alone (not with the others waiting: the A/B)")
    ap.add_argument("--trace", action="store_true",
                    help="each measured round's iterations timed (Scheduler.trace): per grouping of the batched "
                         "steps, the median iteration, the steps' share and the time outside them")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.model:
        args.synthetic = None
    args.budgets = [float(b) for b in args.budget_gib.split(",")]
    args.batch_maxes = [int(b) for b in args.batch_max.split(",")]
    clients = [int(c) for c in args.clients.split(",")]
    out = {"arms": [arm(args, b, m, clients) for b in args.budgets for m in args.batch_maxes]}
    print(table(out["arms"]), flush=True)
    if args.long:
        out["long"] = long_prompt_round(args, np.random.default_rng(1))
        print(json.dumps(out["long"]), flush=True)
    if args.json:
        open(args.json, "w").write(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
