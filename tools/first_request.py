"""The first request's latency against the next ones, with and without LLM.warm_up() (issue #11 item 7).

    python tools/first_request.py [MODEL] [--device cuda] [--warm both|on|off] [--turns 4]
                                  [--prompt-tokens 19] [--max-tokens 8] [--temperature 0.7]
                                  [--expert-cache auto] [--reuse] [--json PATH]

Each mode runs in a fresh process (a kernel library, once loaded, stays loaded for the process, so
one process would flatter the second mode): load the model (the demo without MODEL), warm up or
not, then `--turns` chat turns of exactly `--prompt-tokens` tokens, each a different user message
through the chat template, each generating `--max-tokens` tokens. Every turn reads its whole
prompt (the runner's prefix is dropped before each) unless --reuse; prompt and cached token counts
are printed. Per turn: time to the first token (prompt read + first pick) and to the last, from
perf_counter around LLM.begin(). The line per mode ends with the first turn's time to first token
over the median of the later turns'.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

MESSAGES = ["Write a haiku about the sea.", "Name three rivers in Europe.", "What is a prime number?",
            "Tell me a fact about owls.", "Give me a word that rhymes with moon.", "How far away is the Moon?"]


def chat_ids(llm, message: str, n: int) -> list[int]:
    """Exactly n tokens: the chat turn of `message`, padded with more words or cut at n."""
    text = message
    while True:
        ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        if len(ids) >= n:
            return ids[:n]
        text += " Please answer briefly."


def one_mode(args, warm: bool) -> dict:
    from strata import LLM
    from strata.config import SamplingParams
    kwargs = {"device": args.device}
    if args.expert_cache:
        kwargs["expert_cache"] = args.expert_cache
    t0 = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    load_s = time.perf_counter() - t0
    warm_s = llm.warm_up() if warm else None
    turns = []
    for i in range(args.turns):
        ids = chat_ids(llm, MESSAGES[i % len(MESSAGES)], args.prompt_tokens)
        if not args.reuse:
            llm.runner.reset()
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i)
        t0 = time.perf_counter()
        gen = llm.begin(ids, params)
        first_ms = None
        for _ in gen:
            if first_ms is None:
                first_ms = (time.perf_counter() - t0) * 1e3
        total_ms = (time.perf_counter() - t0) * 1e3
        c = gen.completion
        turns.append({"prompt_tokens": len(ids), "cached_tokens": c.usage.cached_tokens,
                      "completion_tokens": len(c.token_ids), "first_token_ms": first_ms, "total_ms": total_ms,
                      "prompt_ms": c.timings.prompt_ms})
    status = llm.status()
    decode = status.get("decode") or {}
    return {"warm": warm, "device": llm.device, "model": llm.model_name, "load_s": load_s, "warm_up_s": warm_s,
            "turns": turns, "graphs": sorted((decode.get("graphs") or {}).keys()),
            "decode_steps_by_mode": {m: t["steps"] for m, t in (decode.get("host_ms") or {}).items()}}


def report(row: dict) -> str:
    lines = [f"warm_up {'on' if row['warm'] else 'off'} ({row['model']} on {row['device']}): load "
             f"{row['load_s']:.2f} s" + (f", warm-up {row['warm_up_s'] * 1e3:.0f} ms" if row["warm"] else "")]
    for i, t in enumerate(row["turns"]):
        first = "-" if t["first_token_ms"] is None else f"{t['first_token_ms']:8.1f}"
        lines.append(f"  turn {i + 1}: {t['prompt_tokens']} prompt tokens ({t['cached_tokens']} cached), first "
                     f"token {first} ms, {t['completion_tokens']} tokens in {t['total_ms']:8.1f} ms")
    firsts = [t["first_token_ms"] for t in row["turns"] if t["first_token_ms"] is not None]
    if len(firsts) >= 2:
        later = statistics.median(firsts[1:])
        lines.append(f"  first turn / median later turn, time to first token: {firsts[0] / later:.2f}x "
                     f"({firsts[0]:.1f} / {later:.1f} ms)")
    lines.append(f"  decode steps by mode: {row['decode_steps_by_mode']}, graphs held: {row['graphs']}")
    return "\n".join(lines)


def _child_args(args) -> list[str]:
    out = [args.model] if args.model else []
    out += ["--device", args.device, "--turns", str(args.turns), "--prompt-tokens", str(args.prompt_tokens),
            "--max-tokens", str(args.max_tokens), "--temperature", str(args.temperature)]
    out += ["--expert-cache", args.expert_cache] if args.expert_cache else []
    return out + (["--reuse"] if args.reuse else [])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None, help="pack dir or .gguf (default: the demo model)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warm", choices=("both", "on", "off"), default="both")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=19)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--expert-cache", default=None, help="passed to the engine (e.g. 20 to stream experts)")
    p.add_argument("--reuse", action="store_true", help="keep the prefix between turns (as a server does)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--one", choices=("on", "off"), help=argparse.SUPPRESS)     # a child process: one mode
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one_mode(args, args.one == "on")))
        return 0
    rows = []
    for mode in (("off", "on") if args.warm == "both" else (args.warm,)):
        run = subprocess.run([sys.executable, __file__, *_child_args(args), "--one", mode], capture_output=True,
                             text=True)
        if run.returncode != 0:
            sys.stderr.write(run.stderr)
            return run.returncode
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(report(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
