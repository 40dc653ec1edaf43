"""The KV format's trade against the expert cache, and `--kv auto`.

Each format (strata.quant.kv) is priced by the planner as a plan of its own: the same budget, the
context fit_context gives it (a smaller KV holds a longer default context), and the expert-cache
slots left beside its KV, hence the plan's decode ceiling (strata.engine.planner._speeds, with the
K/V a token reads at half the context: planner.decode_kv_bytes). KV_QUALITY is what each format costs in accuracy, measured by
tools/kv_quality.py on the demo model (the table in docs/DESIGN.md, "KV formats").

--kv auto, on a GPU (and in `strata plan`), among the formats the GPU runs:
  1. the acceptable formats are those whose measured mean KL against f16 is at most AUTO_MAX_KL;
  2. among the acceptable ones that hold the target context (--max-context, else the model's
     trained context, with the expert cache's minimum), the most accurate, unless a less accurate
     one raises the plan's decode ceiling by AUTO_MIN_GAIN or more (more expert-cache slots);
  3. when none holds it: the format, of all that run, whose plan holds the longest context (the
     more accurate on a tie).
On the CPU, auto is f16 (the CPU keeps its cells exact; host memory bounds its context instead).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import InvalidArgument
from .planner import kv_bytes, make_plan

# format -> (mean KL vs f16 in nats, top-1 agreement): tools/kv_quality.py --ctx 1024 --windows 8 on the
# demo model (4,088 positions); AUTO_MAX_KL admits int8 (4.6e-4) and not the 4-bit V formats (5.3e-3, 1.6e-2)
KV_QUALITY = {"f16": (0.0, 1.0), "int8": (4.62e-4, 0.9934), "k8v4": (5.27e-3, 0.9687), "q4_0": (1.60e-2, 0.9423)}
AUTO_MAX_KL = 2e-3
AUTO_MIN_GAIN = 1.05
GPU_KV_FORMATS = ("f16", "int8", "q4_0", "k8v4")    # what CudaRunner runs (the CPU runs them too)


def by_accuracy(formats) -> list[str]:
    return sorted(formats, key=lambda f: KV_QUALITY[f][0])


@dataclass(frozen=True)
class KVOption:
    """One format's plan, as the trade shows it."""
    kv: str
    max_context: int            # 0 when the budget cannot hold this format's plan at all
    context_source: str
    kv_bytes: int
    cache_slots: int
    total_experts: int
    decode_tok_s: float
    mean_kl: float
    top1_agree: float


def kv_trade(sizes, config, budget_bytes: int, bandwidths, num_sms: int, formats=None) -> list[KVOption]:
    """Every format's plan at this budget, most accurate first."""
    out = []
    a = sizes.args
    for f in by_accuracy(formats or KV_QUALITY):
        kl, top1 = KV_QUALITY[f]
        try:
            p = make_plan(sizes, config, budget_bytes, "", bandwidths, num_sms, what_if={"kv": f})
        except InvalidArgument as e:
            out.append(KVOption(f, 0, str(e), 0, 0, 0, 0.0, kl, top1))
            continue
        out.append(KVOption(f, p.max_context, p.context_source,
                            kv_bytes(a, p.kv_cells * p.parallel, f, a.num_hidden_layers + a.num_mtp_layers),
                            p.cache_slots, p.total_experts, p.decode_tok_s, kl, top1))
    return out


def choose_kv(options: list[KVOption], target_context: int) -> tuple[str, str]:
    """(format, why) by the rule of the module doc, from kv_trade's options."""
    options = sorted(options, key=lambda o: o.mean_kl)
    acceptable = [o for o in options if o.mean_kl <= AUTO_MAX_KL and o.max_context >= target_context]
    best = None
    for o in acceptable:
        if best is None or o.decode_tok_s >= AUTO_MIN_GAIN * best.decode_tok_s:
            best = o
    if best is not None:
        gain = "" if best is acceptable[0] else (f", whose {best.cache_slots} expert slots raise the decode ceiling "
                                                 f"by {AUTO_MIN_GAIN - 1:.0%} or more")
        return best.kv, (f"auto: {best.kv}, the most accurate format within {AUTO_MAX_KL} nats of f16 that holds "
                         f"the {target_context}-token context{gain}")
    held = [o for o in options if o.max_context > 0]
    if not held:
        raise InvalidArgument(f"--kv auto: no KV format fits the budget ({options[-1].context_source})")
    best = max(held, key=lambda o: o.max_context)       # the first, most accurate, of the longest
    return best.kv, (f"auto: {best.kv}: no format within {AUTO_MAX_KL} nats of f16 holds the {target_context}-token "
                     f"context; {best.kv} holds the longest, {best.max_context}")


def target_context(sizes, config) -> int:
    trained = sizes.args.max_position_embeddings
    return min(config.max_context, trained) if config.max_context else trained


def resolve(device: str, pack, config):
    """(config with a concrete kv, why or None) for LLM: --kv auto resolved on this device."""
    if config.kv != "auto":
        return config, None
    if device != "cuda":
        return dataclasses.replace(config, kv="f16"), "auto: f16 on the CPU (its cells are exact)"
    from .planner import DEFAULT_BANDWIDTHS, PackSizes, vram_budget
    sizes = PackSizes.of_pack(pack)
    if config.split:        # each format's split over the cards (strata.engine.layer_split)
        from .layer_split import split_cards
        return resolve_split_kv(sizes, config, split_cards(config))
    from ..backends.cuda import device_info
    d = device_info(int(config.gpus.split(",")[0]))
    budget, _ = vram_budget(config, d["free_memory_bytes"])
    fmt, why = resolve_gpu(sizes, config, budget, DEFAULT_BANDWIDTHS, d["multiprocessor_count"])
    return dataclasses.replace(config, kv=fmt), why


def resolve_gpu(sizes, config, budget_bytes: int, bandwidths, num_sms: int) -> tuple[str, str]:
    """(format, why) for --kv auto on a GPU of this budget (the formats it runs)."""
    options = kv_trade(sizes, config, budget_bytes, bandwidths, num_sms, GPU_KV_FORMATS)
    fmt, why = choose_kv(options, target_context(sizes, config))
    if len(GPU_KV_FORMATS) == 1:
        why += f" (the GPU runs {GPU_KV_FORMATS[0]} only so far)"
    return fmt, why


def split_kv_trade(sizes, config, cards: list, formats=None) -> list:
    """kv_trade over a layer split (strata.engine.layer_split): every KV format's split (choose_split
    at that format), most accurate first, as KVOptions (the context every card holds, the experts
    cached over the cards, the split's decode ceiling; max_context 0 where no split fits)."""
    from .layer_split import choose_split
    out = []
    for f in by_accuracy(formats or GPU_KV_FORMATS):
        kl, top1 = KV_QUALITY[f]
        try:
            p = choose_split(sizes, dataclasses.replace(config, kv=f), cards)
        except InvalidArgument as e:
            out.append(KVOption(f, 0, str(e), 0, 0, 0, 0.0, kl, top1))
            continue
        out.append(KVOption(f, p.max_context, p.context_source, sum(q.mandatory["kv"] for q in p.plans),
                            p.cached_experts, p.total_experts, p.decode_tok_s, kl, top1))
    return out


def resolve_split_kv(sizes, config, cards: list):
    """--kv auto over a layer split: choose_kv's rule over split_kv_trade -> (config with that
    format, why)."""
    fmt, why = choose_kv(split_kv_trade(sizes, config, cards), target_context(sizes, config))
    return dataclasses.replace(config, kv=fmt), why + " (over the layer split's cards)"
