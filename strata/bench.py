"""python -m strata bench: prompt and decode speed of a model, with the limits they are measured against.

Prompt tok/s for each --prompt length (read from scratch), decode tok/s over --decode tokens after
the shortest prompt and after the longest one, the bytes a decoded token reads and the rate that
implies, peak memory, and a JSON record. A progress line on stderr while it works.

Prompt lengths past the context (less the decoded tokens that follow) are clipped to it, with a
note. A failure part way prints what was measured before it, then one line naming the phase.
"""
from __future__ import annotations

import hashlib
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .config import SamplingParams
from .errors import InvalidArgument


@dataclass
class BenchResult:
    model: str
    device: str
    prompt: dict = field(default_factory=dict)      # length -> {"tok_s", "seconds"}
    decode: dict = field(default_factory=dict)      # context -> {"tok_s", "tokens", "seconds", "gb_s"}
    bytes_per_token: int = 0                        # weight bytes one decoded token reads
    peak_host_bytes: int = 0
    limits: dict = field(default_factory=dict)      # measured ceilings (GPU: device copy GB/s, ...)
    config: dict = field(default_factory=dict)
    vram_peak_bytes: int = 0                        # the device's used VRAM at its highest (GPU)
    plan: dict = field(default_factory=dict)        # prefill_chunk, prefill_ring, cache slots (GPU)
    max_context: int = 0
    notes: list = field(default_factory=list)       # prompt lengths clipped to the context
    spec: dict = field(default_factory=dict)        # --mtp --spec: window costs, acceptance (speculate)
    error: str | None = None                        # the phase that failed and why; results before it stand


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgument(f"--prompt must be comma-separated token counts, got {text!r}") from None
    if not lengths or min(lengths) <= 0:
        raise InvalidArgument(f"--prompt needs positive token counts, got {text!r}")
    return lengths


def clip_lengths(lengths: list[int], max_context: int, decode_tokens: int) -> tuple[list[int], list[str]]:
    """(prompt lengths that fit, a note per clipped one): a prompt and the decode_tokens after it
    take at most max_context positions, so longer prompts are clipped to max_context - decode_tokens."""
    room = max_context - decode_tokens
    if room < 1:
        raise InvalidArgument(f"--decode {decode_tokens} leaves no room for a prompt in the context of "
                              f"{max_context} tokens")
    notes = [f"prompt {n} clipped to {room} tokens: the context holds {max_context} and {decode_tokens} decoded "
             f"tokens follow the prompt" for n in sorted(set(lengths)) if n > room]
    return sorted({min(n, room) for n in lengths}), notes


class _Line:
    """One progress line on stderr (rewritten in place on a terminal)."""

    def __init__(self):
        self.tty = sys.stderr.isatty()

    def __call__(self, text: str) -> None:
        sys.stderr.write(("\r\x1b[2K" + text) if self.tty else text + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


SPEC_WINDOW_ROWS = 5         # verify windows of 1..5 rows are timed (drafts 0..4, --spec auto's range)


def _window_costs(runner, repeats: int = 3) -> dict:
    """After a prompt: the best of `repeats` times of a verify window of T rows for T = 1..5 and of
    one chained draft step (the MTP layer over one row), each rolled back after (K/V forgotten)."""
    from .engine.speculate import time_windows
    return time_windows(runner, SPEC_WINDOW_ROWS, repeats)


def _decode_spec(runner, logits, n_tokens: int, bytes_per_token: int, line, context: int) -> dict:
    """Greedy decode through verify windows (random ids would reject every draft): tokens per
    second, acceptance and tokens per verify pass over this phase."""
    from .engine.sampler import Sampler
    greedy = SamplingParams()
    sampler = Sampler(greedy)
    stats = runner.spec_stats
    d0, a0, v0, h0 = stats.draft_n, stats.draft_n_accepted, stats.verify_passes, stats.host_ms
    store = getattr(runner, "store", None)
    s0 = None if store is None or store.resident else (store.stats.misses, store.stats.admitted, store.stats.bytes_h2d)
    token = int(np.argmax(logits))
    done = 0
    t0 = time.perf_counter()
    while done < n_tokens:
        out = runner.speculate(token, greedy, sampler, n_tokens - done)[: n_tokens - done]
        if done // 8 != (done + len(out)) // 8:
            line(f"bench: decode at {context}: {done + len(out)}/{n_tokens} tokens")
        done += len(out)
        token = out[-1]
    dt = time.perf_counter() - t0
    drafts, kept, passes = stats.draft_n - d0, stats.draft_n_accepted - a0, stats.verify_passes - v0
    out = {"tok_s": n_tokens / dt, "tokens": n_tokens, "seconds": dt, "gb_s": bytes_per_token * n_tokens / dt / 1e9,
           "draft_n": drafts, "draft_n_accepted": kept, "acceptance": kept / drafts if drafts else None,
           "tokens_per_verify": (kept + passes) / passes if passes else None,
           "host_ms_per_verify": (stats.host_ms - h0) / passes if passes else None}
    if s0 is not None:      # experts streaming: what the windows' misses cost on the bus, per emitted token
        misses, admitted, h2d = (a - b for a, b in zip((store.stats.misses, store.stats.admitted,
                                                        store.stats.bytes_h2d), s0))
        blob = float(np.mean(store._blob[:runner.args.num_hidden_layers]))
        out.update(admitted=admitted, pcie_bytes_per_token=(misses * blob + h2d) / n_tokens)
    return out


def run_bench(llm, prompt_lengths: list[int], decode_tokens: int, seed: int = 0,
              random_tokens: bool = False) -> BenchResult:
    """random_tokens: decode feeds random token ids instead of the greedy choice (for random-weight
    models, whose greedy output soon repeats one token: the same experts every step would flatter
    an expert cache). An exception in a phase ends the run: res.error names the phase, the phases
    before it keep their numbers."""
    from .engine.planner import decode_bytes_per_token
    runner, line = llm.runner, _Line()
    rng = np.random.default_rng(seed)
    res = BenchResult(model=llm.model_name, device=llm.device, config=asdict(llm.config),
                      bytes_per_token=decode_bytes_per_token(llm.pack), max_context=llm.max_context)
    phase = "measuring limits"
    try:
        res.limits = runner.measure_limits() if hasattr(runner, "measure_limits") else {}
        phase = "warm-up"
        V = llm.args.vocab_size
        runner.reset()                  # warm-up: module loads, weight caches, allocator
        n_warm = min(getattr(runner, "warm_prompt_tokens", 16), max(1, llm.max_context - 1))
        runner.decode(int(np.argmax(runner.prefill(rng.integers(0, V, n_warm).tolist(), 0))))
        for n in sorted(set(prompt_lengths)):
            phase = f"prompt {n}"
            _prompt_phase(runner, res, n, rng.integers(0, V, n).tolist(), line)
            if decode_tokens and n in (min(prompt_lengths), max(prompt_lengths)):
                phase = f"decode after {n}"
                before = _stream_counters(runner)
                if getattr(runner, "spec", 0):
                    res.spec.setdefault("windows", {})[n] = _window_costs(runner)
                    res.decode[n] = _decode_spec(runner, res.prompt[n].pop("_logits"), decode_tokens,
                                                 res.bytes_per_token, line, n)
                else:
                    room = llm.max_context - n - decode_tokens
                    res.decode[n] = _decode(runner, res.prompt[n].pop("_logits"), decode_tokens,
                                            res.bytes_per_token, line, n, rng if random_tokens else None,
                                            warm=max(0, min(WARM_DECODE_STEPS, room)))
                res.decode[n].update(_stream_delta(runner, before, res.decode[n]["seconds"]))
                _vram_peak(runner, res)
            res.prompt[n].pop("_logits", None)
    except (Exception, KeyboardInterrupt) as exc:
        text = str(exc).splitlines()[0] if str(exc) else ""
        res.error = f"{phase}: {type(exc).__name__}{': ' + text if text else ''}"
        for r in res.prompt.values():
            r.pop("_logits", None)
    line.done()
    _finish(runner, res)
    return res


def _prompt_phase(runner, res: BenchResult, n: int, ids: list[int], line) -> None:
    """One prompt of n tokens read from scratch; its logits stay in the row for the decode after it."""
    runner.reset()
    drafting = getattr(runner, "drafter", None) is not None
    if drafting:                # the draft layer's pass after each chunk, timed (the device synced around it)
        runner.draft_timing = True
    t0 = time.perf_counter()
    before = _stream_counters(runner)
    logits = runner.prefill(ids, 0, lambda done, total: line(f"bench: prompt {n}: {done}/{total} tokens"))
    dt = time.perf_counter() - t0
    res.prompt[n] = {"tok_s": n / dt, "seconds": dt, **_stream_delta(runner, before, dt), "_logits": logits,
                     "logits_sha256": hashlib.sha256(np.ascontiguousarray(logits).tobytes()).hexdigest()[:16]}
    if getattr(runner, "room_lent", None) is not None:      # seed 001: whether the draft layer's room was lent
        res.prompt[n]["room_lent"] = bool(runner.room_lent)
    if drafting:                # seed 003: the draft layer's cells after each chunk and their time
        res.prompt[n]["draft"] = {"mode": runner.draft_prompt, "window": runner.draft_window,
                                  "ring_cells": runner.draft_slots,
                                  "chunks": [{"cells": c, "ms": ms} for c, ms in runner.draft_chunks],
                                  "ms": sum(ms for _, ms in runner.draft_chunks)}
    _vram_peak(runner, res)
    line(f"bench: prompt {n}: {n / dt:,.1f} tok/s")


def _finish(runner, res: BenchResult) -> None:
    """The plan, host step times and peak memory, as far as the runner can still tell them."""
    try:
        status = runner.status()
    except Exception:           # after a failure the numbers measured so far still count
        status = {}
    res.plan = {k: status[k] for k in ("prefill_chunk", "prefill_ring", "prefill_kept", "prefill_rule") if k in status}
    options = getattr(getattr(runner, "plan", None), "prompt_options", ())
    chosen = next((o for o in options if o.chosen), None)
    if chosen is not None:          # --prefill auto: what the cost model predicted for the plan it took
        res.plan["prefill_predicted_tok_s"] = {N: round(t) for N, t in zip(runner.plan.prompt_lengths,
                                                                        chosen.tok_s(runner.plan.prompt_lengths))}
    if isinstance(status.get("kv"), dict):
        kv = status["kv"]
        res.plan.update(kv=kv["format"], kv_cells_vram=kv["cells_vram"], kv_cells_host=kv["cells_host"],
                        kv_bus_bytes_per_token=kv["bus_bytes_per_token"])
    host = (status.get("decode") or {}).get("host_ms", {}).get("graph")
    if host:
        res.limits["host_ms_per_token"] = host
    split = (status.get("decode") or {}).get("cpu_experts_split")
    if split:               # --cpu-experts on decode steps: the steps split, their host time, the pricing
        res.limits["decode_split"] = {**split, "host_ms": (status["decode"].get("host_ms") or {}).get("split")}
    if isinstance(status.get("layer_split"), dict):  # --gpus 0,1: the cards' layers and the hand-off
        res.plan["layer_split"] = {k: v for k, v in status["layer_split"].items() if k != "cards"}
        res.plan["layer_split"]["cache_slots"] = [c["expert_cache"]["slots"] for c in status["layer_split"]["cards"]]
    if isinstance(status.get("draft"), dict):       # --draft-window and --draft-prompt
        res.plan.update(draft_window=status["draft"]["window"], draft_ring_cells=status["draft"]["ring_cells"],
                        draft_prompt=status["draft"]["prompt"])
    if isinstance(status.get("expert_cache"), dict):
        res.plan["cache_slots"] = status["expert_cache"]["slots"]
        res.plan["policy"] = status["expert_cache"].get("policy")
        host = status["expert_cache"].get("host")
        if host:            # --cpu-experts: the host's rates as the run left them
            r = host["rates"]
            res.limits["host_expert_ms"] = {"expert": r["expert_ms"], "row": r["row_ms"], "blob_bytes": r["blob_bytes"],
                                            "fixed": r.get("fixed_ms", {})}
    res.peak_host_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _stream_counters(runner) -> tuple:
    """(hits, misses, bytes copied host -> device, bytes of decode misses read in place, experts and
    blob bytes the host computed) of the GPU runner's expert store so far; None on the CPU."""
    store = getattr(runner, "store", None)
    if store is None:
        return None
    host = getattr(store, "host_experts", None)
    return (store.stats.hits, store.stats.misses, store.stats.bytes_h2d, store.stats.bytes_in_place,
            host.stats.experts if host else 0, host.stats.bytes if host else 0)


def _stream_delta(runner, before, seconds: float) -> dict:
    """Hit rate, host -> device traffic and the host's share (--cpu-experts) of one bench phase (GPU)."""
    if before is None:
        return {}
    hits, misses, h2d, in_place, host_experts, host_bytes = (a - b for a, b in zip(_stream_counters(runner), before))
    # the bus's traffic: copies, and decode misses the kernels read in place (zero-copy)
    out = {"hit_rate": hits / (hits + misses) if hits + misses else None, "bytes_h2d": h2d,
           "bytes_in_place": in_place, "h2d_gb_s": (h2d + in_place) / seconds / 1e9}
    if getattr(runner.store, "host_experts", None) is not None:
        out.update(host_experts=host_experts, host_bytes=host_bytes)
    return out


def _vram_peak(runner, res) -> None:
    if hasattr(runner, "vram_used_bytes"):
        res.vram_peak_bytes = max(res.vram_peak_bytes, runner.vram_used_bytes())


WARM_DECODE_STEPS = 2


def _decode(runner, logits, n_tokens: int, bytes_per_token: int, line, context: int, rng=None,
            warm: int = WARM_DECODE_STEPS) -> dict:
    """Greedy decode as a generation runs it: the step's logits stay where they are, the runner
    picks the token (on the GPU: 4 bytes come back); random-weight models then get a random id.
    The first `warm` steps at this context (WARM_DECODE_STEPS where the context has room) run untimed,
    their time reported apart: a step's first run of a shape is eager and its second captures the
    step's CUDA graph, one-off costs a server pays once per shape, not per token (llama-bench warms up
    as well)."""
    greedy = SamplingParams()
    token = int(np.argmax(logits))
    V = logits.shape[-1]
    t_warm = time.perf_counter()
    for _ in range(warm):                   # each pick waits for its step: the device is idle after the last
        runner.decode(token, logits=False)
        token = runner.pick(greedy, 0.0)
        if rng is not None:
            token = int(rng.integers(0, V))
    warm_s = time.perf_counter() - t_warm
    t0 = time.perf_counter()
    # each pick decodes the next token too, as a generation's picks do (pick(step=True): the runner may
    # queue that step before the host has the token); a random-weight model's picks feed random ids
    runner.decode(token, logits=False)
    for i in range(n_tokens):
        feed = None if rng is None else int(rng.integers(0, V))
        runner.pick(greedy, 0.0, step=i + 1 < n_tokens, feed=feed)
        if i % 8 == 0:
            line(f"bench: decode at {context}: {i + 1}/{n_tokens} tokens")
    dt = time.perf_counter() - t0
    return {"tok_s": n_tokens / dt, "tokens": n_tokens, "seconds": dt,
            "gb_s": bytes_per_token * n_tokens / dt / 1e9, "warm_steps": warm, "warm_s": warm_s}


def report(res: BenchResult) -> str:
    lim = res.limits.get("device_copy_gb_s")
    rows = [f"model {res.model} on {res.device}, context {res.max_context}; a decoded token reads "
            f"{res.bytes_per_token / 1e9:.3f} GB of weights", *(f"note: {n}" for n in res.notes)]
    if lim:
        rows.append(f"device copy (read + write), measured now: {lim:,.0f} GB/s")
    h2d = res.limits.get("h2d_gb_s")
    if h2d:
        rows.append(f"pinned host -> device copy, measured now: {h2d:,.1f} GB/s")
    if res.config.get("decode_tokens"):
        rows.append(f"decode feeds {res.config['decode_tokens']}")
    paths = [f"{what} {res.config[key]}" for what, key in (("on", "kernels_on"), ("off", "kernels_off"))
             if str(res.config.get(key, "")).strip()]
    if paths:       # an A/B arm says which it is in its own log
        rows.append("kernel paths: " + "; ".join(paths))
    if res.plan:
        rows.append("plan: " + ", ".join(f"{k} {v}" for k, v in res.plan.items()))
    rows.append(f"{'what':<26}{'tok/s':>12}{'seconds':>10}{'weights GB/s':>14}{'of copy rate':>14}"
                f"{'hit rate':>10}{'PCIe GB/s':>11}{'of pinned':>11}")
    for n, r in res.prompt.items():
        rows.append(f"{'prompt ' + str(n):<26}{r['tok_s']:>12,.1f}{r['seconds']:>10.2f}{'':>28}{_stream_cols(r, h2d)}")
    for n, r in res.prompt.items():
        d = r.get("draft")
        if d:
            rows.append(f"draft layer after each chunk of prompt {n} ({d['mode']}, window "
                        f"{d['window'] or 'whole context'}{', ring ' + str(d['ring_cells']) if d['ring_cells'] else ''}):"
                        f" {d['ms']:.1f} ms in all; " + ", ".join(f"{c['cells']:,} cells {c['ms']:.1f} ms"
                                                                   for c in d["chunks"]))
    if res.prompt:
        rows.append("prompt logits sha256: " + ", ".join(
            f"{n} {r['logits_sha256']}" + (" (room lent)" if r.get("room_lent") else "") for n, r in res.prompt.items()))
    for ctx, r in res.decode.items():
        share = f"{r['gb_s'] / lim:>14.1%}" if lim else f"{'n/a':>14}"
        rows.append(f"{'decode after ' + str(ctx):<26}{r['tok_s']:>12,.1f}{r['seconds']:>10.2f}{r['gb_s']:>14.1f}{share}"
                    f"{_stream_cols(r, h2d)}")
    warm = [f"{ctx} {r['warm_steps']} in {r['warm_s'] * 1e3:.1f} ms" for ctx, r in res.decode.items()
            if r.get("warm_steps")]
    if warm:
        rows.append("decode timed after untimed steps at each context (a step's first run is eager, its second "
                    "captures the step's graph): " + ", ".join(warm))
    host_rows = [f"{what} {n}: {r['host_experts']:,} experts, {r['host_bytes'] / 1e9:.2f} GB"
                 for what, d in (("prompt", res.prompt), ("decode after", res.decode)) for n, r in d.items()
                 if "host_experts" in r]
    if host_rows:
        rows.append("computed on the host (--cpu-experts " + str(res.config.get("cpu_experts")) + "): "
                    + "; ".join(host_rows))
    for ctx, r in res.decode.items():
        if r.get("draft_n"):
            rows.append(f"speculation after {ctx}: {r['draft_n_accepted']} of {r['draft_n']} drafts kept "
                        f"({r['acceptance']:.1%}), {r['tokens_per_verify']:.2f} tokens per verify pass, "
                        f"{r['host_ms_per_verify']:.3f} ms host bookkeeping per pass"
                        + (f"; {r['admitted']} experts admitted, {r['pcie_bytes_per_token'] / 1e6:.1f} MB over PCIe "
                           f"per token (misses read in place + admissions)" if "admitted" in r else ""))
    for ctx, w in (res.spec.get("windows") or {}).items():
        one = w["verify_ms"][1]
        rows.append(f"verify window after {ctx} (ms, x one row): " + ", ".join(
            f"{T} rows {ms:.2f} ({ms / one:.2f}x)" for T, ms in w["verify_ms"].items())
            + f"; draft step {w['draft_step_ms']:.2f} ms")
    ls = res.plan.get("layer_split")
    if ls:
        hand, step = ls.get("handoff_ms_per_step"), ls.get("host_step_ms")
        rows.append(f"layer split {','.join(map(str, ls['counts']))} ({ls['source']}): cache slots "
                    f"{'/'.join(map(str, ls['cache_slots']))}, hand-off {ls['handoff_bytes_per_token']:,} B a token"
                    + (f", {hand:.3f} ms a decode step" if hand is not None else "")
                    + (f"; {step:.3f} ms a step on the host through every card" if step is not None else "")
                    + f"; peer access {ls.get('peer_access')}; predicted {ls['predicted_decode_tok_s']} tok/s")
    host = res.limits.get("host_ms_per_token")
    if host:
        rows.append(f"host time per decoded token (CUDA graph): {host['host_submit_ms']:.3f} ms to submit, "
                    f"{host['host_step_ms']:.3f} ms until the token is on the host")
    split = res.limits.get("decode_split")
    if split:
        p = split.get("pricing") or {}
        rows.append(f"decode split (--cpu-experts {split['mode']}), since load: {split['steps']} steps split (eager), "
                    f"{split['experts']:,} experts on the host"
                    + (f", {split['host_ms']['host_step_ms']:.3f} ms a split step on the host"
                       if split.get("host_ms") else "")
                    + (f"; last pricing: {p['why']} (misses read in place at {p['in_place_gb_s']:.1f} GB/s, the "
                       f"eager step counted at {p['eager_ms']:.2f} ms)" if p else ""))
    rates = res.limits.get("host_expert_ms")
    if rates:
        fixed = rates.get("fixed") or {}
        rows.append(f"host expert FFN (cpu_experts, as the run left its rates): {rates['expert']:.3f} ms an "
                    f"expert of {rates['blob_bytes'] / 1e6:.2f} MB + {rates['row']:.3f} ms a token row"
                    + (f"; fixed a layer split {sum(fixed.values()):.3f} ms ("
                       + ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in fixed.items()) + ")" if fixed else ""))
    if res.vram_peak_bytes:
        rows.append(f"peak VRAM in use on the device {res.vram_peak_bytes / 2**30:.2f} GiB")
    rows.append(f"peak host memory {res.peak_host_bytes / 2**30:.2f} GiB")
    if res.error:
        rows.append(f"stopped at {res.error}")
    return "\n".join(rows)


def _stream_cols(r: dict, h2d: float | None) -> str:
    if "h2d_gb_s" not in r:
        return ""
    hit = f"{r['hit_rate']:>10.1%}" if r.get("hit_rate") is not None else f"{'-':>10}"
    share = f"{r['h2d_gb_s'] / h2d:>11.1%}" if h2d else f"{'n/a':>11}"
    return f"{hit}{r['h2d_gb_s']:>11.2f}{share}"


def _trained_context(model, cache_dir: str | None) -> int:
    """The model's trained context, read from its pack.json before the model loads."""
    from .engine.llm import demo_model_path
    from .pack import resolve_model
    path = demo_model_path() if model is None else resolve_model(model, cache_dir or None)
    meta = json.loads((Path(path) / "pack.json").read_text())
    return int(meta["model_args"].get("max_position_embeddings", 32768))


def bench_main(args, engine_kwargs: dict) -> int:
    from .engine.llm import LLM
    from .synthetic import synthetic_pack
    if args.model and args.synthetic:
        raise InvalidArgument("give a MODEL or --synthetic SHAPE, not both")
    lengths = parse_lengths(args.prompt)
    if args.decode < 0:
        raise InvalidArgument(f"--decode must be >= 0, got {args.decode}")
    model = synthetic_pack(args.synthetic, engine_kwargs.get("cache_dir")) if args.synthetic else args.model
    if not engine_kwargs.get("max_context"):     # a KV no bigger than the longest run needs: more cache
        trained = _trained_context(model, engine_kwargs.get("cache_dir"))
        engine_kwargs["max_context"] = min(trained, max(lengths) + args.decode
                                           + (WARM_DECODE_STEPS if args.decode else 0))
    llm = LLM(model, **engine_kwargs)
    if args.synthetic:
        llm.model_name = f"synthetic {args.synthetic}"
    lengths, notes = clip_lengths(lengths, llm.max_context, args.decode)
    for note in notes:
        print(f"strata: bench: {note}", file=sys.stderr)
    res = run_bench(llm, lengths, args.decode, random_tokens=bool(args.synthetic))
    res.notes = notes
    res.config["decode_tokens"] = ("greedy, through verify windows" if getattr(llm.runner, "spec", 0) else
                                   "random ids (random weights)" if args.synthetic else "greedy")
    print(report(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(res), f, indent=1)
    if res.error:
        print(f"strata: error: bench stopped at {res.error}", file=sys.stderr)
        return 130 if res.error.split(": ")[1].startswith("KeyboardInterrupt") else 1
    return 0
