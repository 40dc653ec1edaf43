"""python -m strata plan: the VRAM plan for a model, budget and engine flags (strata.engine.planner).

Sizes come from the pack, or from a GGUF / Hugging Face source or a synthetic shape without
writing any weights. With a GPU, the budget is min(free VRAM - 1 GiB, --vram-budget-gib) and the
pinned host->device and device copy rates are measured now; without one, --vram-budget-gib is the
budget and the rates are the H200 figures recorded in docs/PERF.md (the output says which).
`--device cpu` plans without touching a GPU even where there is one. The context is --max-context, or by default the model's
trained context lowered to what the budget holds beside the expert cache's minimum (the plan's first
line says which, and why).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .backends.cuda.kernels import KernelPaths, tma_attention_runs, tma_gemm_runs
from .config import EngineConfig
from .engine.planner import (DEFAULT_BANDWIDTHS, DEFAULT_NUM_SMS, RING_BUDGET_BYTES, Bandwidths, PackSizes,
                             make_plan, vram_budget)
from .engine.kv_choice import kv_trade, resolve_gpu, resolve_split_kv
from .engine.parallel_choice import choose_parallel
from .errors import DeviceError, InvalidArgument

MEASURE_BYTES = 256 << 20
MEASURE_REPEATS = 5


def plan_sizes(model: str | None, synthetic: str | None) -> tuple[str, PackSizes]:
    """(a name for the output, the sizes) of a pack dir, GGUF, HF dir, the demo model or a synthetic shape."""
    if model and synthetic:
        raise InvalidArgument("give a MODEL or --synthetic SHAPE, not both")
    if synthetic:
        from .pack.format import layout
        from .synthetic import synthetic_source
        source = synthetic_source(synthetic)
        table = layout(source.dense, source.experts, source.args.num_experts)
        meta = {**table, "model_args": source.args.to_dict()}
        return f"synthetic {synthetic}", PackSizes.from_meta(meta, table["_sizes"]["dense.bin"])
    from .engine.llm import demo_model_path
    from .pack.info import _load
    path = Path(model) if model else demo_model_path()
    _, meta, files = _load(path)
    return str(path), PackSizes.from_meta(meta, files["dense.bin"])


def measure_bandwidths(rt, dev, nbytes: int, repeats: int = MEASURE_REPEATS) -> Bandwidths:
    """Pinned host->device and device copy rates (strata.backends.cuda.bandwidth), measured now."""
    from .backends.cuda.bandwidth import copy_rates
    h2d, d2d = copy_rates(rt, dev, rt.Stream(dev), nbytes, repeats)
    return Bandwidths(h2d, d2d, f"measured now on {dev.name}")


def _gpu(config: EngineConfig):
    """(free VRAM bytes, multiprocessors, bandwidths, (the install's kernel manifest, compute capability))
    of the first GPU of --gpus, or None without one."""
    if config.device == "cpu":
        return None
    from .backends import cuda
    ordinal = int(config.gpus.split(",")[0])
    if cuda.unavailable_reason(ordinal) is not None:
        return None
    rt = cuda._runtime()
    dev = rt.Device(ordinal)
    return (dev.memory_info()[0], dev.multiprocessor_count, measure_bandwidths(rt, dev, MEASURE_BYTES),
            (rt.read_manifest(), dev.compute_capability))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan_text(name: str, p) -> str:
    m = p.mandatory
    share = p.cache_slots / p.total_experts
    prompt = (f"{p.prompt_tok_s:,.0f} tok/s (PCIe-bound ceiling of a chunk; compute in the prompt plans above)" if p.prompt_tok_s
              else "nothing streams (every expert cached); compute-bound, not modeled")
    rows = [
        f"plan for {name}: VRAM budget {_gib(p.vram_budget_bytes)} ({p.budget_source})",
        f"  context             {p.max_context:,} tokens ({p.context_source}; --max-context N sets it)",
        f"  mandatory           {_gib(p.mandatory_bytes)}: dense {_gib(m['dense'])}, KV {_gib(m['kv'])} "
        f"({p.kv_cells} cells{f' x {p.parallel} slots' if p.parallel > 1 else ''}, {p.kv}), decode scratch {_gib(m['decode'])}, CUDA graphs {_gib(m['graphs'])}, "
        f"MTP layer {_gib(m['mtp'])}",
        *([f"  draft K/V ring      {p.draft_ring_cells:,} cells for a --draft-window of {p.draft_window:,} (instead "
           f"of {p.max_context:,}: the rest of the draft layer's K/V goes to the expert cache)"]
          if p.draft_ring_cells else []),
        *([f"  KV on the host      {_gib(p.kv_host_bytes)} pinned ({p.max_context:,} cells, --kv-resident; the newest "
           f"{p.kv_cells:,} also in the VRAM window above); decode reads up to {p.kv_bus_bytes_per_token / 1e6:.1f} MB "
           f"of it over the bus a token"]
          if p.kv_host_bytes else []),
        f"  expert cache        {p.cache_slots} of {p.total_experts} slots ({share:.1%}), {_gib(p.cache_bytes)}; "
        f"max_blob {p.max_blob:,} B",
        f"  prompt chunk        {p.prefill_chunk} tokens ({p.prefill_rule})",
        f"  prompt buffers      {_gib(p.bytes_needed)} reserved (live peak {_gib(p.prompt_pool_peak_bytes)})",
        f"  streamed ring       {p.prefill_ring} slots, {p.ring_bytes / 2**20:.1f} MiB (a full ring: "
        f"{p.ring_full_slots} slots, from a {RING_BUDGET_BYTES / 2**20:.2f} MiB byte budget)",
        f"  during a prompt     {_gib(p.prompt_loan_bytes)} lent; {p.cache_slots - p.prompt_cache_slots} cache "
        f"slots lent, {p.prompt_cache_slots} kept",
        *prompt_options_text(p),
        f"  over PCIe a chunk   {p.pcie_bytes_per_chunk / 1e9:.2f} GB",
        f"  prompt              {prompt}",
        f"  decode              {p.decode_tok_s:,.1f} tok/s (bandwidth ceiling at a {p.decode_hit_rate:.1%} "
        f"hit rate, uniform routing)",
        f"  bandwidths          {p.h2d_gb_s:,.1f} GB/s pinned host->device, {p.device_copy_gb_s:,.0f} GB/s "
        f"device copy: {p.bandwidth_source}",
        *([batch_text(p)] if p.parallel > 1 else []),
    ]
    return "\n".join(rows)


def prompt_options_text(p) -> list[str]:
    """--prefill auto's candidates (Plan.prompt_options): the chosen one (*), the two rules' plans and
    the best others, with the prompt seconds and tok/s strata.engine.prompt_cost predicts for each."""
    if not p.prompt_options:
        return []
    from .engine.prompt_cost import DEFAULT_PROMPT_RATES, PROMPT_BUS_EFFICIENCY
    lengths = p.prompt_lengths
    rows = [f"  prompt plans        predicted at prompts of {' / '.join(f'{N:,}' for N in lengths)} tokens "
            f"(compute {DEFAULT_PROMPT_RATES.source}; copies at {PROMPT_BUS_EFFICIENCY:.0%} of "
            f"{p.h2d_gb_s:,.1f} GB/s; the ring's stalls counted):"]
    for o in p.prompt_options:
        secs = " / ".join(f"{x:.3f}" for x in o.seconds)
        tps = " / ".join(f"{x:,.0f}" for x in o.tok_s(lengths))
        rows.append(f"    {'*' if o.chosen else ' '} chunk {o.chunk:>6}, ring {o.ring:>3}, kept {o.kept:>5} "
                    f"({o.rule:<5}) {secs} s, {tps} tok/s")
    return rows


def batch_text(p) -> str:
    """--parallel's batched steps: the rule, each row count's ceiling and the bus bytes an extra row adds."""
    rule = (f"--batch-max {p.batch_max}: steps of up to {p.batch_max} rows" if p.batch_max else
            "--batch-max auto: the grouping whose measured step times cost least")
    ceilings = " / ".join(f"{t:,.0f}" for t in p.batch_tok_s)
    extra = (p.batch_bus_bytes[-1] - p.batch_bus_bytes[0]) / max(1, len(p.batch_bus_bytes) - 1)
    return (f"  batched decode      {rule}; ceilings {ceilings} tok/s at 1..{p.parallel} rows a step; "
            f"over PCIe a row alone "
            f"{p.batch_bus_bytes[0] / 1e6:,.1f} MB, each extra row {extra / 1e6:,.1f} MB")


def trade_text(options, kv_why: str | None) -> str:
    """The KV trade: each format's default context, KV bytes and the expert slots left beside it."""
    rows = ["  KV trade            format  context  KV GiB  cache slots  decode ceiling  mean KL  top-1 (demo)"]
    for o in options:
        if not o.max_context:
            rows.append(f"                      {o.kv:<6}  does not fit")
            continue
        rows.append(f"                      {o.kv:<6} {o.max_context:>8,} {o.kv_bytes / 2**30:>7.2f} "
                    f"{o.cache_slots:>6} ({o.cache_slots / o.total_experts:>4.0%}) {o.decode_tok_s:>9,.1f} tok/s "
                    f"{o.mean_kl:>8.1e} {o.top1_agree:>7.1%}")
    if kv_why:
        rows.append(f"  --kv auto           {kv_why}")
    return "\n".join(rows)


def split_cases(sizes: PackSizes, p, config: EngineConfig, bus_gb_s: float | None = None):
    """(the host's rates, strata.engine.expert_split's PlanCases at this plan) or (None, why not).
    bus_gb_s: the pinned copy rate before --pcie-gbs (decode's in-place reads are paced to the cap
    after they ran at half of it: expert_split.in_place_gb_s); None: the plan's."""
    from .engine.expert_split import host_computable, in_place_gb_s, parse_mode, plan_cases, random_blob_rates
    if p.cache_slots >= p.total_experts:
        return None, "every expert cached: nothing is missed"
    why = host_computable(sizes.layers)
    if why is not None:
        return None, why
    try:
        from ._ext import cpu_experts
    except ImportError as exc:
        return None, f"strata._ext.cpu_experts is not built ({exc})"
    a = sizes.args
    big = max(range(a.num_hidden_layers), key=sizes.blob)
    rates = random_blob_rates(cpu_experts, sizes.layers[big], a.hidden_size)
    mode = parse_mode(config.cpu_experts)
    # a short prompt's loan is its ring and a small pool (the loan is sized by the prompt), not the
    # plan's largest chunk's: it keeps about the cache less the ring
    kept = max(p.prompt_cache_slots, p.cache_slots - p.prefill_ring)
    capped = bool(config.pcie_gbs) and bus_gb_s is not None and config.pcie_gbs < bus_gb_s
    return rates, plan_cases(a, sizes.blob(big), a.num_hidden_layers, kept / p.total_experts,
                             p.cache_slots / p.total_experts, p.h2d_gb_s, rates,
                             mode if isinstance(mode, float) else None,
                             in_place_gb_s(bus_gb_s, config.pcie_gbs) if capped else None)


def split_text(config: EngineConfig, rates, cases) -> str:
    """The CPU/GPU split of missed experts, per case: experts to each side and the speeds predicted."""
    if rates is None:
        return f"  CPU/GPU split       none ({cases})"
    runs = {"off": "off (auto would split as below)", "auto": "auto"}.get(config.cpu_experts, f"share {config.cpu_experts}")
    from .engine.expert_split import FIXED_MARGIN, MIN_GAIN, STREAM_ALL_SYNC_S
    parts = ", ".join(f"{name.replace('_', ' ')} {sec * 1e3:.3f}" for name, sec in rates.fixed_parts().items())
    rows = [f"  CPU/GPU split       --cpu-experts {runs}; host {rates.expert_s * 1e3:.3f} ms an expert + "
            f"{rates.row_s * 1e3:.3f} ms a row ({rates.source})",
            f"    fixed a layer      {rates.fixed_s * 1e3:.3f} ms counted where the host takes part ({parts} ms; "
            f"+{STREAM_ALL_SYNC_S * 1e3:.3f} ms sync for a chunk routed on the device; {rates.fixed_source}); "
            f"auto splits when it saves that x{FIXED_MARGIN:g} and {MIN_GAIN:.0%} of the layer net"]
    for c in cases:
        s = c.split
        if c.decode is not None:
            d = c.decode
            rows.append(f"    {c.name:<20} {s.host + s.bus:>4} missed a layer: {s.host} on the host, {s.bus} read "
                        f"in place ({d.in_place_gb_s:.1f} GB/s); {c.bus_tok_s:,.1f} -> {c.split_tok_s:,.1f} tok/s "
                        f"(PCIe-bound; a split step runs eagerly, {d.eager_s * 1e3:.2f} ms counted); {d.why()}")
            continue
        rows.append(f"    {c.name:<20} {s.host + s.bus:>4} missed a layer: {s.host} on the host, {s.bus} over "
                    f"the bus; {c.bus_tok_s:,.1f} -> {c.split_tok_s:,.1f} tok/s (x{s.speedup:.2f}, PCIe-bound); "
                    + s.why())
    return "\n".join(rows)


def layer_split_main(args, config: EngineConfig, name: str, sizes: PackSizes) -> int:
    """`plan --gpus 0,1 [--layer-split A,B] [--vram-budget-gib 8,12]`: the layer split's plan (the
    cards' budgets from their GPUs where there are GPUs, else from --vram-budget-gib alone)."""
    from .engine.layer_split import Card, card_name, choose_split, split_cards
    from .engine.layer_split import split_text as layer_split_text
    try:
        cards = split_cards(config)
    except (DeviceError, ImportError):
        missing = [o for o, gib in config.cards() if not gib]
        if missing:
            raise InvalidArgument(f"--gpus {config.gpus}: no GPU here to measure; give each card's budget "
                                  f"(--vram-budget-gib 8,12)") from None
        cards = [Card(o, int(gib * 2**30)) for o, gib in config.cards()]
    kv_why = None
    if config.kv == "auto":
        config, kv_why = resolve_split_kv(sizes, config, cards)
    p = choose_split(sizes, config, cards)
    if args.json:
        print(json.dumps({"model": name, "layer_split": p.to_dict(), "kv_auto": kv_why,
                          "cards": [dataclasses.asdict(c) for c in cards]}, indent=1, default=str))
    else:
        print(f"{name}")
        print(layer_split_text(p, cards))
        if kv_why:
            print(f"  --kv auto           {kv_why}")
        for k, ((lo, hi), card, plan) in enumerate(zip(p.ranges(), cards, p.plans)):
            print(plan_text(card_name(k, card, lo, hi), plan))
    return 0


def plan_main(args, engine_kwargs: dict) -> int:
    config = EngineConfig.from_kwargs(**engine_kwargs)
    name, sizes = plan_sizes(args.model, args.synthetic)
    if config.split:            # --parallel auto over a split: 1 (strata.engine.parallel_choice)
        return layer_split_main(args, dataclasses.replace(config, parallel=1) if config.parallel == "auto" else config,
                                name, sizes)
    gpu = _gpu(config)
    free, num_sms, bandwidths, build = gpu if gpu else (None, DEFAULT_NUM_SMS, DEFAULT_BANDWIDTHS, None)
    # the prompt plans price tma-attention's attention and tma-gemm's GEMMs where this GPU and install run
    # them (not without a GPU)
    paths = KernelPaths.without(config.kernels_off, config.kernels_on)
    tma = build is not None and tma_attention_runs(paths, *build, sizes.args.head_dim)
    tma_gemm = build is not None and tma_gemm_runs(paths, *build)
    bus_gb_s = bandwidths.h2d_gb_s
    if config.pcie_gbs and config.pcie_gbs < bandwidths.h2d_gb_s:
        bandwidths = Bandwidths(config.pcie_gbs, bandwidths.device_copy_gb_s,
                                f"{bandwidths.source}; host->device capped by --pcie-gbs")
    budget, source = vram_budget(config, free)
    kv_why = parallel_why = None
    slots = config.parallel
    if slots == "auto":                 # as a load resolves it: the format for one slot, then the slots
        config = dataclasses.replace(config, parallel=1)
    if config.kv == "auto":
        kv, kv_why = resolve_gpu(sizes, config, budget, bandwidths, num_sms)
        config = dataclasses.replace(config, kv=kv)
    if slots == "auto":
        n, parallel_why = choose_parallel(sizes, config, budget, bandwidths, num_sms) if not config.draft_window \
            else (1, "auto: 1 (the draft layer's --draft-window ring holds one sequence)")
        config = dataclasses.replace(config, parallel=n)
    show = tuple(int(n) for n in str(args.prompt or "").split(",") if n.strip())
    plan = make_plan(sizes, config, budget, source, bandwidths, num_sms, show_prompts=show, tma_attention=tma,
                     tma_gemm=tma_gemm)
    options = kv_trade(sizes, config, budget, bandwidths, num_sms)
    rates, cases = split_cases(sizes, plan, config, bus_gb_s)
    if args.json:
        print(json.dumps({"model": name, **plan.to_dict(), "kv_auto": kv_why, "parallel_auto": parallel_why,
                          "kv_trade": [dataclasses.asdict(o) for o in options],
                          "cpu_experts": None if rates is None else
                          {"host_rates": dataclasses.asdict(rates), "cases": [dataclasses.asdict(c) for c in cases]}},
                         indent=1))
    else:
        print(plan_text(name, plan))
        if parallel_why:
            print(f"  --parallel auto     {parallel_why}")
        print(split_text(config, rates, cases))
        print(trade_text(options, kv_why))
    return 0
