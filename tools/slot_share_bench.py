"""Time to first token of a request whose prompt shares a long prefix with another slot's: with the
prefix's cells copied from that slot (strata.engine.slots: Slots._share) and read again (sharing off),
in one process, the replies compared.

    python tools/slot_share_bench.py [MODEL] [--prefix 2048] [--rounds 3] [engine flags, e.g. --device cuda]

Each round: slot 0 reads prefix + task A (and 4 tokens), then slot 1 reads prefix + task B; slot 1's
prompt time and first-token time are what is reported, sharing on and off alternating per round.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.cli import add_engine_flags, engine_kwargs  # noqa: E402
from strata.config import SamplingParams  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--prefix", type=int, default=2048, help="tokens of the shared prefix")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    add_engine_flags(ap)
    args = ap.parse_args(argv)
    import numpy as np

    import strata
    from strata.engine import slots
    kw = engine_kwargs(args)
    asked = kw.get("parallel")
    kw["parallel"] = max(2, int(asked)) if str(asked).strip().isdigit() else 2   # the flag's text; auto: two
    llm = strata.LLM(args.model, **kw)
    rng = np.random.default_rng(0)
    V = llm.tokenizer.vocab_size
    prefix = [int(t) for t in rng.integers(10, V, args.prefix)]
    keep = slots.SHARE_MIN_TOKENS
    rows = {"copied": [], "read": []}
    for r in range(args.rounds):
        for mode in (("copied", "read") if r % 2 == 0 else ("read", "copied")):
            slots.SHARE_MIN_TOKENS = keep if mode == "copied" else 1 << 40
            task_a = [int(t) for t in rng.integers(10, V, 16)]
            task_b = [int(t) for t in rng.integers(10, V, 16)]
            for slot, task in ((0, task_a), (1, task_b)):
                if slot == 1:
                    llm.runner.use(1)
                    llm.runner.reset()       # slot 1 holds nothing of the prefix itself
                t0 = time.perf_counter()
                gen = llm.begin(prefix + task, SamplingParams(max_tokens=4), slot=slot)
                first = None
                for _ in gen:
                    first = first or time.perf_counter() - t0
                if slot == 1:
                    c = gen.completion
                    rows[mode].append({"first_token_ms": first * 1e3, "prompt_ms": c.timings.prompt_ms,
                                       "cached": c.usage.cached_tokens})
    slots.SHARE_MIN_TOKENS = keep
    out = {"model": llm.model_name, "device": llm.device, "prefix": args.prefix, "rounds": args.rounds}
    for mode, rs in rows.items():
        out[mode] = {"first_token_ms": statistics.median(x["first_token_ms"] for x in rs),
                     "prompt_ms": statistics.median(x["prompt_ms"] for x in rs),
                     "cached_tokens": rs[-1]["cached"]}
    print(f"{out['device']} prefix {args.prefix}: slot 1's first token {out['copied']['first_token_ms']:.1f} ms "
          f"with the prefix copied ({out['copied']['cached_tokens']} tokens), "
          f"{out['read']['first_token_ms']:.1f} ms read again ({out['read']['cached_tokens']} cached)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
