"""Mask cost per token of the grammar engines on a pack's tokenizer (default: the demo's 8192 tokens).

Drives each engine along the same valid JSON document (tokenized by the pack's tokenizer), timing the
mask of every step, 20 passes. llguidance is what Strata uses (strata/engine/grammar.py); xgrammar is
measured when it is installed (it needs torch and transformers). The figures in docs/DESIGN.md came
from this script:  PYTHONPATH=. python tools/grammar_mask_bench.py
"""
import argparse
import json
import time
from pathlib import Path

import numpy as np

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "kind"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                         "kind": {"enum": ["module", "class", "function"]}}}
DOC = {"name": "json.dumps serializes obj", "age": 42, "tags": ["a", "bb", "ccc"], "kind": "function"}
PASSES = 20


def report(name: str, setup_s: float, compile_s: float, times: list[float]) -> None:
    us = np.array(times) * 1e6
    print(f"{name}: tokenizer {setup_s * 1e3:.0f} ms, compile {compile_s * 1e3:.1f} ms, mask per token median "
          f"{np.median(us):.1f} us, p90 {np.percentile(us, 90):.1f} us, max {us.max():.0f} us ({len(us)} masks)")


def bench_llguidance(tokenizer_json: str, V: int, ids: list[int], eos: list[int]) -> None:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=V, eos_token=eos)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
    t2 = time.perf_counter()
    mask, times = allocate_token_bitmask(1, V), []
    for _ in range(PASSES):
        matcher.reset()
        for t in ids:
            s = time.perf_counter()
            fill_next_token_bitmask(matcher, mask)
            times.append(time.perf_counter() - s)
            assert (int(mask[0, t // 32]) >> (t % 32)) & 1 and matcher.consume_token(t), matcher.get_error()
    report(f"llguidance {llguidance.get_version() if hasattr(llguidance, 'get_version') else ''}".strip(),
           t1 - t0, t2 - t1, times)


def bench_xgrammar(tokenizer_path: Path, V: int, ids: list[int], eos: list[int]) -> None:
    try:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        print(f"xgrammar: not measured ({e})")
        return
    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path)),
                                                   vocab_size=V, stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    t2 = time.perf_counter()
    matcher, mask, times = xgrammar.GrammarMatcher(compiled), xgrammar.allocate_token_bitmask(1, V), []
    for _ in range(PASSES):
        matcher.reset()
        for t in ids:
            s = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - s)
            assert (int(mask[0, t // 32]) >> (t % 32)) & 1 and matcher.accept_token(t)
    report("xgrammar", t1 - t0, t2 - t1, times)


def main() -> None:
    from tokenizers import Tokenizer

    from strata.engine.llm import DEMO_PACK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, default=DEMO_PACK / "tokenizer.json")
    ap.add_argument("--eos", default="2,0", help="end-of-sequence token ids")
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(args.tokenizer))
    V, eos = tok.get_vocab_size(with_added_tokens=True), [int(x) for x in args.eos.split(",")]
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False).ids
    print(f"vocabulary {V} tokens; the document is {len(ids)} tokens, {PASSES} passes")
    bench_llguidance(args.tokenizer.read_text(), V, ids, eos)
    bench_xgrammar(args.tokenizer, V, ids, eos)


if __name__ == "__main__":
    main()
