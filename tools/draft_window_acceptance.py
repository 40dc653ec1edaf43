"""What `--draft-window W` costs in acceptance: the MTP drafter attending over its last W cells
against the whole context, on the demo model (CPU backend) over held-out text.

Each of --windows held-out windows (tools/kv_quality.py's: the demo's validation files) gives a
prompt of its first --prompt tokens; the model then decodes --tokens greedy tokens with `--mtp
--spec N` for each draft window (0: the whole context). The target verifies every draft, so the
tokens are the same in every arm (checked); what changes is how many drafts it accepts. Per window
size: drafts made, drafts accepted, the acceptance rate and the tokens a verify pass emits, with
the change against the whole context.

    python tools/draft_window_acceptance.py [--prompt 768] [--tokens 64] [--windows 8] [--spec 3]
                                            [--draft-windows 0,32,64,128,256] [--json PATH]

The demo's drafter is one layer trained beside a 6-layer model, so the absolute rates say little of a
real model's; the change with W is the question (docs/DESIGN.md, "--draft-window").
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def acceptance(ids_list, draft_window: int, spec: int, tokens: int) -> tuple[dict, list]:
    from strata.engine.llm import LLM
    llm = LLM(device="cpu", mtp=True, spec=spec, draft_window=draft_window)
    drafted = accepted = passes = 0
    outs = []
    for ids in ids_list:
        r = llm.generate(ids, max_tokens=tokens)
        drafted += r.timings.draft_n
        accepted += r.timings.draft_n_accepted
        outs.append(r.token_ids)
    st = llm.status()["speculation"]
    passes = st["verify_passes"]
    emitted = sum(len(o) for o in outs)
    return {"draft_window": draft_window, "drafted": drafted, "accepted": accepted,
            "rate": accepted / max(1, drafted), "tokens_per_pass": emitted / max(1, passes)}, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--spec", type=int, default=3)
    ap.add_argument("--draft-windows", default="0,32,64,128,256")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from kv_quality import demo_held_out
    _, prompts = demo_held_out(args.prompt, args.windows)
    t0 = time.perf_counter()
    rows, base_outs = [], None
    for w in (int(x) for x in args.draft_windows.split(",")):
        row, outs = acceptance(prompts, w, args.spec, args.tokens)
        if base_outs is None:
            base_outs = outs
        elif outs != base_outs:
            raise SystemExit(f"--draft-window {w}: the greedy tokens differ from the first arm's (they must not)")
        rows.append(row)
    base = rows[0]
    print(f"demo model, CPU, {args.windows} held-out prompts of {args.prompt} tokens, {args.tokens} greedy tokens "
          f"each, --spec {args.spec}; tokens equal in every arm")
    print(f"{'draft window':>12} {'drafted':>8} {'accepted':>9} {'rate':>7} {'tokens/pass':>12} {'rate vs W=' + str(base['draft_window']):>14}")
    for r in rows:
        print(f"{r['draft_window'] or 'context':>12} {r['drafted']:>8} {r['accepted']:>9} {r['rate']:>7.1%} "
              f"{r['tokens_per_pass']:>12.2f} {r['rate'] - base['rate']:>+14.1%}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
