"""KV formats through the engine: strata.LLM on the CPU with each --kv, the accuracy tool
(tools/kv_quality.py) on a small slice, --kv auto's rule, and the plan's KV trade."""
import json
from pathlib import Path

import numpy as np
import pytest

from strata import cli
from strata.config import EngineConfig
from strata.engine import kv_choice
from strata.engine.cuda_runner import CudaRunner
from strata.engine.kv_choice import KVOption, choose_kv, kv_trade
from strata.engine.llm import DEMO_PACK, LLM
from strata.engine.planner import DEFAULT_BANDWIDTHS, kv_bytes
from strata.errors import InvalidArgument
from strata.pack import open_pack
from strata.plan import plan_sizes
from tests.fixtures import load_tool


def kv_quality_tool():
    return load_tool("kv_quality")


@pytest.fixture(scope="module")
def demo_text_ids():
    llm = LLM(device="cpu", max_context=256)
    text = (Path(__file__).resolve().parents[2] / "strata" / "quant" / "kv.py").read_text()
    return llm.tokenizer.encode(text)


@pytest.mark.parametrize("kv", ["int8", "q4_0", "k8v4"])
def test_llm_runs_each_format_on_the_cpu(kv, demo_text_ids):
    """End to end through strata.LLM: the cache really holds the format, and the logits stay near
    the exact cells' (the demo model's top-1 agrees on most positions)."""
    ids = demo_text_ids[:96]
    exact = LLM(device="cpu", max_context=128)
    llm = LLM(device="cpu", max_context=128, kv=kv)
    assert llm.runner.kv_format == kv and exact.runner.kv_format == "f32"
    got, want = llm.logits(ids), exact.logits(ids)
    assert not np.array_equal(got, want)
    assert np.mean(np.argmax(got, -1) == np.argmax(want, -1)) >= 0.8
    planes = llm.runner.kv.planes[0]
    assert planes[0][0].dtype == (np.int8 if kv in ("int8", "k8v4") else np.uint8)
    assert planes[1][0].dtype == (np.int8 if kv == "int8" else np.uint8)
    out = llm.generate(ids[:40], max_tokens=8)
    assert len(out.token_ids) == 8


def test_kv_quality_measures_kl_and_top1(demo_text_ids):
    tool = kv_quality_tool()
    # compare() on hand-made logits: identical -> 0; a known two-token KL
    base = np.log(np.array([[0.5, 0.5], [0.9, 0.1]]))
    other = np.log(np.array([[0.5, 0.5], [0.6, 0.4]]))
    r = tool.compare(base, other, np.array([0, 1]))
    assert r["kl"][0] == pytest.approx(0, abs=1e-12)
    assert r["kl"][1] == pytest.approx(0.9 * np.log(0.9 / 0.6) + 0.1 * np.log(0.1 / 0.4))
    assert r["same"].tolist() == [True, True] and r["nll"][1] == pytest.approx(-np.log(0.4))
    windows = [demo_text_ids[:64], demo_text_ids[64:128]]
    table = tool.kv_quality(open_pack(DEMO_PACK), windows, formats=("f16", "int8", "q4_0"))
    assert table["f16"]["mean_kl"] == 0.0 and table["f16"]["top1_agree"] == 1.0
    assert table["f16"]["positions"] == 2 * 31
    assert 0 < table["int8"]["mean_kl"] < table["q4_0"]["mean_kl"]
    assert table["q4_0"]["top1_agree"] < 1.0
    assert "| int8 | 1.031 |" in tool.markdown(table, 64, 2)


def opt(kv, ctx, tps):
    kl, top1 = kv_choice.KV_QUALITY[kv]
    return KVOption(kv, ctx, "", 0, 0, 1, tps, kl, top1)


def test_auto_rule():
    # the most accurate acceptable format that holds the context...
    assert choose_kv([opt("f16", 4096, 100), opt("int8", 4096, 103), opt("q4_0", 4096, 200)], 4096)[0] == "f16"
    # ...unless a less accurate acceptable one buys 5% or more decode ceiling
    fmt, why = choose_kv([opt("f16", 4096, 100), opt("int8", 4096, 106)], 4096)
    assert fmt == "int8" and "expert slots" in why
    # 4-bit formats only when no acceptable one holds the context: then the longest context
    fmt, why = choose_kv([opt("f16", 2048, 100), opt("int8", 3072, 100), opt("k8v4", 4096, 90),
                          opt("q4_0", 4096, 95)], 4096)
    assert fmt == "k8v4" and "longest" in why
    with pytest.raises(InvalidArgument, match="no KV format fits"):
        choose_kv([opt("f16", 0, 0)], 4096)
    assert kv_choice.KV_QUALITY["int8"][0] <= kv_choice.AUTO_MAX_KL < kv_choice.KV_QUALITY["k8v4"][0]


def test_auto_resolves_per_device_and_the_gpu_runs_every_format(fake):
    llm = LLM(device="cpu", max_context=64, kv="auto")
    assert llm.config.kv == "f16" and "CPU" in llm.kv_source
    assert kv_choice.GPU_KV_FORMATS == ("f16", "int8", "q4_0", "k8v4")
    runner = CudaRunner(open_pack(DEMO_PACK), 64, EngineConfig(device="cuda", kv="q4_0"))
    assert runner.kv.fmt == "q4_0" and runner.status()["kv"]["format"] == "q4_0"


def test_plan_trade_prices_each_format():
    sizes = plan_sizes(None, "qwen3-30b-a3b")[1]
    options = kv_trade(sizes, EngineConfig(max_context=32768), 12 << 30, DEFAULT_BANDWIDTHS, 132)
    assert [o.kv for o in options] == ["f16", "int8", "k8v4", "q4_0"]
    for o in options:
        assert o.max_context == 32768 and o.kv_bytes == kv_bytes(sizes.args, 32768, o.kv, 48)
    # a smaller KV leaves more expert-cache slots, so a higher decode ceiling
    slots = [o.cache_slots for o in options]
    assert slots == sorted(slots) and slots[0] < slots[-1]
    assert [o.decode_tok_s for o in options] == sorted(o.decode_tok_s for o in options)
    # on a budget too small for f16's trained context, the smaller formats hold a longer default one
    small = kv_trade(sizes, EngineConfig(), 4 << 30, DEFAULT_BANDWIDTHS, 132)
    assert small[0].max_context < small[-1].max_context


def test_cli_plan_prints_the_trade(capsys):
    args = ["plan", "--synthetic", "qwen3-30b-a3b", "--vram-budget-gib", "12", "--device", "cpu", "--kv", "auto"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "KV trade" in out and "--kv auto" in out
    for kv in ("f16", "int8", "k8v4", "q4_0"):
        assert any(line.split()[:1] == [kv] for line in out.splitlines()), kv
    assert cli.main([*args, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    # the GPU runs int8: its smaller cells leave the expert cache enough slots to raise the ceiling 5%
    assert got["kv"] == "int8" and got["kv_auto"].startswith("auto: int8") and "expert slots" in got["kv_auto"]
    assert [o["kv"] for o in got["kv_trade"]] == ["f16", "int8", "k8v4", "q4_0"]


def test_status_reports_the_kv(fake):
    llm = LLM(device="cpu", max_context=64, kv="k8v4")
    llm.generate([5, 6, 7], max_tokens=2)
    assert llm.runner.status()["kv"] == {"format": "k8v4", "cells_vram": 0, "cells_host": 4,
                                         "bus_bytes_per_token": 0}
    gpu = CudaRunner(open_pack(DEMO_PACK), 64).status()["kv"]
    assert gpu == {"format": "f16", "cells_vram": 64, "cells_host": 0, "bus_bytes_per_token": 0}


def test_host_memory_holds_more_cells_of_a_smaller_format():
    from strata.engine.llm import host_context
    from strata.quant.kv import cell_bytes
    args = open_pack(DEMO_PACK).args
    layers = args.num_hidden_layers + args.num_mtp_layers
    budget = 2 * 1000 * layers * cell_bytes("f32", args.num_key_value_heads, args.head_dim)
    assert host_context(args, 10**6, budget)[0] == 1000
    fit, why = host_context(args, 10**6, budget, "q4_0")
    assert fit == budget // 2 // (layers * cell_bytes("q4_0", args.num_key_value_heads, args.head_dim))
    assert fit > 7 * 1000 and "as q4_0" in why
