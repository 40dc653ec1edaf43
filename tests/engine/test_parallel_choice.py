"""--parallel auto (strata.engine.parallel_choice): the most of 4 or 2 slots whose plan keeps one
slot's context and cached experts; 1 where a slot's KV would cost either, with --draft-window, or
over a split; on the CPU, the most slots whose host KV holds the context."""
import dataclasses

import pytest

from strata import LLM
from strata.config import EngineConfig
from strata.engine import parallel_choice
from strata.engine.parallel_choice import AUTO_MIN_CACHE, choose_parallel
from strata.engine.planner import DEFAULT_BANDWIDTHS, DEFAULT_NUM_SMS, make_plan
from strata.errors import InvalidArgument
from strata.plan import plan_sizes

GIB = 1 << 30


@pytest.mark.parametrize("gib,want", [(80, 4), (24, 1), (12, 1)])
def test_the_rule_on_the_30b_shape(gib, want):
    _, sizes = plan_sizes(None, "qwen3-30b-a3b")
    one = EngineConfig(device="cuda")
    n, why = choose_parallel(sizes, one, gib * GIB, DEFAULT_BANDWIDTHS, DEFAULT_NUM_SMS)
    assert n == want and why.startswith(f"auto: {n}")
    base = make_plan(sizes, one, gib * GIB, "", DEFAULT_BANDWIDTHS, DEFAULT_NUM_SMS)
    got = make_plan(sizes, dataclasses.replace(one, parallel=n), gib * GIB, "", DEFAULT_BANDWIDTHS, DEFAULT_NUM_SMS)
    assert got.max_context == base.max_context and got.cache_slots >= AUTO_MIN_CACHE * base.cache_slots
    if n < 4:           # the next size up would have cost the context or the cache
        more = dataclasses.replace(one, parallel=2 if n == 1 else 4)
        p = make_plan(sizes, more, gib * GIB, "", DEFAULT_BANDWIDTHS, DEFAULT_NUM_SMS)
        assert p.max_context < base.max_context or p.cache_slots < AUTO_MIN_CACHE * base.cache_slots


def test_auto_on_the_cpu_and_its_limits(monkeypatch):
    llm = LLM(device="cpu", parallel="auto")
    assert llm.config.parallel == llm.runner.num_slots == 4 and llm.status()["parallel_source"].startswith("auto: 4")
    assert LLM(device="cpu", parallel="auto", mtp=True, spec=2, draft_window=16).config.parallel == 1
    from strata import system
    monkeypatch.setattr(system, "host_memory", lambda: (1 << 30, 3 * 2 * 48 * 1024 * 4))   # two slots' KV at most
    assert LLM(device="cpu", parallel="auto", max_context=1024).config.parallel == 1
    assert LLM(device="cpu").status()["parallel_source"] is None


def test_the_flag_and_the_environment(monkeypatch):
    assert EngineConfig(parallel="auto").parallel == "auto" and EngineConfig(parallel="3").parallel == 3
    assert EngineConfig(parallel="auto", batch_max=6).batch_max == 6
    for bad in ("many", "0", 9, True):
        with pytest.raises(InvalidArgument, match="parallel must be auto or"):
            EngineConfig(parallel=bad)
    monkeypatch.setenv("STRATA_PARALLEL", "auto")
    assert EngineConfig.from_kwargs().parallel == "auto"
    assert parallel_choice.resolve_parallel("cuda", None, EngineConfig(parallel=2))[0].parallel == 2


def test_plan_prints_the_choice(capsys):
    from strata.cli import main
    assert main(["plan", "--synthetic", "qwen3-30b-a3b", "--vram-budget-gib", "80", "--parallel", "auto"]) == 0
    assert "--parallel auto     auto: 4" in capsys.readouterr().out
