"""Aggregate decode speed of 1, 2, 4 and 8 concurrent requests in --parallel slots (#19), and a short
request's time to its first token while a long prompt is being read in another slot.

    python tools/parallel_bench.py [--synthetic qwen3-30b-a3b] [--budget-gib 12] [--clients 1,2,4,8]
                                   [--prompt 64] [--decode 128] [--long 16384] [--long-chunk 2048] [--json F]

Each round submits N requests of random prompts at once (greedy, no end-of-sequence: each runs
--decode tokens) and steps the scheduler until all are done. Aggregate decode tok/s = every
request's tokens after its first / (the last finish - the first first token). The long-prompt round
reads --long tokens in chunks of --long-chunk (an LLM of its own) and submits a 19-token request
after the first chunk: its first-token time, beside the same request alone.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import numpy as np


def _llm(args, parallel: int, context: int, prefill: str):
    from strata import LLM
    from strata.synthetic import synthetic_pack
    source = str(synthetic_pack(args.synthetic)) if args.synthetic else args.model
    kw = {"vram_budget_gib": args.budget_gib} if args.budget_gib else {}
    llm = LLM(source, device=args.device, parallel=parallel, max_context=context, prefill=prefill, **kw)
    llm.tokenizer.eos_token_ids = []
    llm.warm_up()
    return llm


def clients_round(llm, n: int, prompt: int, decode: int, rng) -> dict:
    from strata.config import SamplingParams
    from strata.engine.scheduler import Request
    V = llm.args.vocab_size
    params = SamplingParams(max_tokens=decode)
    t0 = time.monotonic()
    reqs = [llm.scheduler.submit(Request(rng.integers(0, V, prompt).tolist(), params)) for _ in range(n)]
    while llm.scheduler.step():
        pass
    first = min(r.first_token for r in reqs)
    last = max(r.finished for r in reqs)
    tokens = sum(r.num_tokens - 1 for r in reqs)
    return {"clients": n, "aggregate_decode_tok_s": tokens / (last - first), "tokens": tokens,
            "wall_s": last - t0, "per_client_tok_s": [round((r.num_tokens - 1) / (r.finished - r.first_token), 1)
                                                      for r in reqs]}


def long_prompt_round(args, rng) -> dict:
    from strata.config import SamplingParams
    from strata.engine.scheduler import Request
    llm = _llm(args, 2, args.long + 64, str(args.long_chunk))
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
    return {"long_prompt": args.long, "long_chunk": args.long_chunk, "interleaves": llm.runner.interleaves,
            "short_alone_first_token_ms": ms(alone.created, alone.first_token),
            "short_beside_long_first_token_ms": ms(short.created, short.first_token),
            "long_first_token_ms": ms(long.created, long.first_token),
            "short_done_before_long_prompt": short.finished < long.first_token}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", default="qwen3-30b-a3b")
    ap.add_argument("--model", help="a pack or GGUF instead of --synthetic")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget-gib", type=float, default=0.0)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--long", type=int, default=16384, help="0: no long-prompt round")
    ap.add_argument("--long-chunk", type=int, default=2048)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.model:
        args.synthetic = None
    rng = np.random.default_rng(0)
    clients = [int(c) for c in args.clients.split(",")]
    out = {"budget_gib": args.budget_gib, "rounds": []}
    llm = _llm(args, max(clients), args.prompt + args.decode + 8, "auto")
    print(f"plan: {llm.status().get('prefill_chunk')} chunk, parallel {llm.config.parallel}, "
          f"context {llm.max_context} a slot", flush=True)
    for n in clients:
        clients_round(llm, n, args.prompt, 8, rng)        # its batch's first steps: eager, then the capture
        r = clients_round(llm, n, args.prompt, args.decode, rng)
        out["rounds"].append(r)
        print(f"{n} clients: aggregate decode {r['aggregate_decode_tok_s']:,.1f} tok/s "
              f"(per client {r['per_client_tok_s']})", flush=True)
    one = out["rounds"][0]["aggregate_decode_tok_s"]
    for r in out["rounds"]:
        r["x_one_client"] = round(r["aggregate_decode_tok_s"] / one, 2)
    print("x one client:", {r["clients"]: r["x_one_client"] for r in out["rounds"]}, flush=True)
    del llm
    gc.collect()                        # its VRAM back before the next engine loads
    if args.long:
        out["long"] = long_prompt_round(args, rng)
        print(json.dumps(out["long"]), flush=True)
    if args.json:
        open(args.json, "w").write(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
