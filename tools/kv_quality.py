"""How much each KV format changes the next-token distribution, as llama.cpp's --kl-divergence reports it.

On the demo model (CPU backend, which stores each format exactly as strata.quant.kv defines it) over
held-out text: the demo's validation files (strata/demo/metrics.json corpus.val_files, read from this
Python's standard library), tokenized, cut into windows of --ctx tokens; every window is read from
position 0 with f16 KV (the baseline) and with each format, and the positions of each window's second
half are scored (they attend over at least ctx/2 cells, as llama.cpp scores the second half of each
chunk). Per format: mean KL(p_f16 || p_format) in nats, its 99th percentile, the share of positions
whose top-1 token is the same, and the perplexity of the text under the format.

    python tools/kv_quality.py [--ctx 1024] [--windows 24] [--json out.json] [--markdown]

The table in docs/DESIGN.md ("KV formats") and the auto rule's numbers (strata/engine/kv_choice.py)
come from this tool.
"""
from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import numpy as np

FORMATS = ("f32", "f16", "int8", "k8v4", "q4_0")


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def window_logits(runner, ids: list[int], fmt: str) -> np.ndarray:
    """Logits [T, V] of one window read from position 0 with KV format fmt (one runner: its
    dequantized weights are kept between formats)."""
    runner.kv_format, runner.max_context = fmt, max(runner.max_context, len(ids))
    return runner.logits_all(ids)


def compare(base_logits: np.ndarray, logits: np.ndarray, next_ids: np.ndarray) -> dict:
    """Per-position KL(base || other), top-1 agreement and the other's NLL of the next tokens."""
    lp, lq = log_softmax(base_logits), log_softmax(logits)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    same = np.argmax(base_logits, axis=-1) == np.argmax(logits, axis=-1)
    nll = -lq[np.arange(len(next_ids)), next_ids]
    return {"kl": np.maximum(kl, 0.0), "same": same, "nll": nll}


def kv_quality(pack, windows: list[list[int]], formats=FORMATS, baseline: str = "f16") -> dict:
    """{format: {mean_kl, p99_kl, top1_agree, ppl, positions}} over the scored half of each window."""
    from strata.engine.runner import CpuRunner
    runner = CpuRunner(pack, max(len(w) for w in windows))
    acc = {f: {"kl": [], "same": [], "nll": []} for f in formats}
    for ids in windows:
        half = len(ids) // 2
        next_ids = np.asarray(ids[half + 1:], np.int64)
        base = window_logits(runner, ids, baseline)[half:-1]
        for f in formats:
            other = base if f == baseline else window_logits(runner, ids, f)[half:-1]
            for key, val in compare(base, other, next_ids).items():
                acc[f][key].append(val)
    out = {}
    for f, parts in acc.items():
        kl, same, nll = (np.concatenate(parts[k]) for k in ("kl", "same", "nll"))
        out[f] = {"mean_kl": float(kl.mean()), "p99_kl": float(np.percentile(kl, 99)),
                  "top1_agree": float(same.mean()), "ppl": float(np.exp(nll.mean())), "positions": int(kl.size)}
    return out


def held_out_windows(tokenizer, ctx: int, count: int) -> list[list[int]]:
    """`count` windows of ctx tokens from the demo's validation files, back to back, EOS between files."""
    from strata.engine.llm import DEMO_PACK
    metrics = json.loads((DEMO_PACK / "metrics.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    stream: list[int] = []
    for name in metrics["corpus"]["val_files"]:
        path = stdlib / name
        if path.is_file():
            stream += tokenizer.encode(path.read_text(encoding="utf-8", errors="replace")) + [0]
        if len(stream) >= ctx * count:
            break
    if len(stream) < ctx * count:
        raise SystemExit(f"only {len(stream)} held-out tokens under {stdlib}; asked for {count} x {ctx}")
    return [stream[i * ctx:(i + 1) * ctx] for i in range(count)]


def demo_held_out(ctx: int, count: int):
    """(the demo pack, held_out_windows of it): what this tool and tools/draft_window_acceptance.py read."""
    from strata.engine.llm import DEMO_PACK
    from strata.pack import open_pack
    from strata.tokenizer import Tokenizer
    pack = open_pack(DEMO_PACK)
    return pack, held_out_windows(Tokenizer(pack.tokenizer_path, pack.tokenizer_meta), ctx, count)


def markdown(table: dict, ctx: int, windows: int) -> str:
    rows = ["| KV | bytes per value | mean KL (nats) | 99th pct KL | top-1 same | perplexity |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    from strata.quant.kv import cell_bytes
    for f, r in table.items():
        per_value = cell_bytes(f, 1, 128) / 256
        rows.append(f"| {f} | {per_value:.3f} | {r['mean_kl']:.2e} | {r['p99_kl']:.2e} | {r['top1_agree']:.2%} "
                    f"| {r['ppl']:.4f} |")
    n = next(iter(table.values()))["positions"]
    rows.append(f"\nDemo model, CPU backend, {windows} held-out windows of {ctx} tokens, {n:,} positions scored "
                f"(each window's second half); KL and top-1 against f16 KV.")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--json", default="")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    pack, windows = demo_held_out(args.ctx, args.windows)
    t0 = time.perf_counter()
    table = kv_quality(pack, windows)
    print(markdown(table, args.ctx, args.windows) if args.markdown else json.dumps(table, indent=1))
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"ctx": args.ctx, "windows": args.windows, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
