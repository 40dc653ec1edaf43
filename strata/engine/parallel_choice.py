"""--parallel auto (serve's default): how many sequences to serve at once, from the plan.

More slots let concurrent requests decode in batched steps (a step of 4 rows cost 2.2x one row's
resident on the H200, PERF.md) and let a short request go on beside a long prompt, but each slot
holds a KV of the whole context. So auto takes the most of AUTO_SLOTS whose plan keeps what one slot
would have: the same context and at least AUTO_MIN_CACHE of its cached experts (every expert, where
one slot keeps them all). Under a VRAM budget where the KV competes with the expert cache that is
usually 1: a slot's KV would evict experts that every request's decode reads. On the CPU the KV is
host memory: the most slots whose KV still fits HOST_KV_SHARE of it at the full context. Not with
--draft-window (its ring holds one sequence) or over a layer split (1, until its cards' plans are
weighed together).
"""
from __future__ import annotations

import dataclasses

from ..errors import InvalidArgument

AUTO_SLOTS = (4, 2)
AUTO_MIN_CACHE = 0.98


def resolve_parallel(device: str, pack, config, host_fits=None):
    """(config with a number of slots, why or None) for LLM: --parallel auto resolved on this device
    (config.kv concrete already). host_fits(n): whether n slots' host KV holds the context (the CPU's
    rule; strata.engine.llm.host_context)."""
    if config.parallel != "auto":
        return config, None
    one = dataclasses.replace(config, parallel=1)
    if config.draft_window:
        return one, "auto: 1 (the draft layer's --draft-window ring holds one sequence)"
    if device != "cuda":
        n = next((n for n in AUTO_SLOTS if host_fits(n)), 1)
        return dataclasses.replace(config, parallel=n), (
            f"auto: {n}, the most slots whose host KV holds the context" if n > 1
            else "auto: 1 (two slots' host KV would not hold the context)")
    if config.split:
        return one, "auto: 1 over a layer split"
    from ..backends.cuda import device_info
    from .planner import DEFAULT_BANDWIDTHS, PackSizes, vram_budget
    d = device_info(int(config.gpus.split(",")[0]))
    budget, _ = vram_budget(config, d["free_memory_bytes"])
    n, why = choose_parallel(PackSizes.of_pack(pack), one, budget, DEFAULT_BANDWIDTHS, d["multiprocessor_count"])
    return dataclasses.replace(config, parallel=n), why


def choose_parallel(sizes, one, budget_bytes: int, bandwidths, num_sms: int) -> tuple[int, str]:
    """(slots, why) by the module doc's rule; one: the config with one slot."""
    from .planner import make_plan
    try:
        base = make_plan(sizes, one, budget_bytes, "", bandwidths, num_sms)
    except InvalidArgument:
        return 1, "auto: 1 (one slot's plan does not fit; its load says why)"
    for n in AUTO_SLOTS:
        try:
            p = make_plan(sizes, dataclasses.replace(one, parallel=n), budget_bytes, "", bandwidths, num_sms)
        except InvalidArgument:
            continue
        if p.max_context >= base.max_context and p.cache_slots >= AUTO_MIN_CACHE * base.cache_slots:
            return n, (f"auto: {n}, the most slots whose KV leaves the {base.max_context}-token context and "
                       f"{p.cache_slots} of one slot's {base.cache_slots} cached experts")
    return 1, (f"auto: 1, since 2 slots' KV would cost the {base.max_context}-token context or more than "
               f"{1 - AUTO_MIN_CACHE:.0%} of the {base.cache_slots} cached experts")
