"""Streamed logits against resident logits, bit for bit, on a real-sized model (expert streaming's
must-show): the same prompt read resident and under a VRAM budget, then the same greedy decode.

    python tools/stream_check.py [--synthetic qwen3-30b-a3b] [--budget-gib 8] [--prompt 4096]
                                 [--decode 64] [--prefill 4096] [--json PATH]

Both runs use the same prompt chunk (--prefill), so every kernel sees the same shapes; only where
the experts live differs (VRAM resident copy, or pinned host arena + VRAM cache + prompt ring).
Prints one line per run and the verdict; exits 1 when any logit differs.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(model: str, ids: list, decode: int, **engine) -> dict:
    from strata import LLM
    t0 = time.perf_counter()
    llm = LLM(model, device="cuda", **engine)
    runner = llm.runner
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits = [runner.prefill(ids, 0)]
    prompt_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(decode):
        logits.append(runner.decode(int(np.argmax(logits[-1]))))
    decode_s = time.perf_counter() - t0
    status = runner.status()
    out = {"logits": np.stack(logits), "load_s": load_s, "prompt_tok_s": len(ids) / prompt_s,
           "decode_tok_s": decode / decode_s if decode else None, "prefill_chunk": status["prefill_chunk"],
           "prefill_ring": status["prefill_ring"], "cache": status["expert_cache"],
           "vram_used_bytes": status["gpu"]["vram_used_bytes"]}
    del llm, runner
    gc.collect()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", default="qwen3-30b-a3b")
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prefill", default="4096")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from strata.synthetic import synthetic_pack
    model = str(synthetic_pack(args.synthetic))
    ctx = args.prompt + args.decode + 1
    ids = np.random.default_rng(0).integers(0, 1000, args.prompt).tolist()
    results = {}
    for name, extra in (("resident", {}), (f"budget {args.budget_gib:g} GiB", {"vram_budget_gib": args.budget_gib})):
        r = run(model, ids, args.decode, max_context=ctx, prefill=args.prefill, **extra)
        digest = hashlib.sha256(r["logits"].tobytes()).hexdigest()[:16]
        c = r["cache"]
        print(f"{name:>16}: logits sha256 {digest} | load {r['load_s']:.1f} s | prompt {r['prompt_tok_s']:,.1f} tok/s | "
              f"decode {r['decode_tok_s'] or 0:,.1f} tok/s | chunk {r['prefill_chunk']} ring {r['prefill_ring']} | "
              f"cache {c['slots']} slots, hit rate {c['hit_rate']:.3f}, streamed {c.get('prompt_streamed', 0)} | "
              f"VRAM {r['vram_used_bytes'] / 2**30:.2f} GiB", flush=True)
        results[name] = r
    (a, ra), (b, rb) = results.items()
    same = np.array_equal(ra["logits"], rb["logits"])
    diff = float(np.abs(ra["logits"] - rb["logits"]).max())
    print(f"logits over a {args.prompt}-token prompt and {args.decode} decoded tokens: "
          f"{'bit-identical' if same else f'DIFFER (max |diff| {diff:.3g})'}")
    if args.json:
        Path(args.json).write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "logits"}
                                               for k, v in results.items()} | {"identical": same}, indent=1,
                                              default=float))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
