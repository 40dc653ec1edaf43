"""python -m strata bench on a synthetic shape, on the CPU; synthetic packs are real packs."""
import json
import subprocess
import sys

import numpy as np
import pytest

from strata import bench, cli
from strata.bench import clip_lengths
from strata.errors import InvalidArgument
from strata.pack import open_pack
from strata.synthetic import SHAPES, synthetic_pack


def test_synthetic_pack_has_the_shape_and_quant_types(tmp_path):
    path = synthetic_pack("tiny", str(tmp_path), progress=False)
    pack = open_pack(path)
    args, qtypes = SHAPES["tiny"]
    assert pack.args == args
    assert pack.meta["dense"]["blk.0.attn_q.weight"]["qtype"] == qtypes["attn"]
    assert pack.meta["dense"]["blk.1.ffn_gate_inp.weight"]["qtype"] == "F32"
    parts = pack.expert(1, 3)
    assert {p.qtype for p in parts.values()} == {qtypes["experts"]}
    w = parts["down"].dequantize()
    assert np.isfinite(w).all() and 0.005 < w.std() < 0.08
    assert synthetic_pack("tiny", str(tmp_path), progress=False) == path     # reused, not rebuilt


def test_qwen3_30b_shape_matches_the_anchor_numbers():
    from strata.pack.format import layout
    from strata.synthetic import synthetic_source
    src = synthetic_source("qwen3-30b-a3b")
    plan = layout(src.dense, src.experts, src.args.num_experts)
    assert plan["max_blob"] == 2_654_208                      # 3 x 768 x 2048 weights in Q4_K
    total = plan["_sizes"]["dense.bin"] + plan["_sizes"]["experts.bin"]
    assert abs(total / 2**30 - 16.75) < 0.1                   # docs/PERF.md: 16.75 GiB in all


def test_bench_cli_reports_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "strata", "bench", "--synthetic", "tiny", "--prompt", "8,24",
                        "--decode", "3", "--device", "cpu", "--cache-dir", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert set(res["prompt"]) == {"8", "24"} and res["decode"]["24"]["tokens"] == 3
    assert res["bytes_per_token"] > 0 and all(v["tok_s"] > 0 for v in res["prompt"].values())
    assert "decode after 24" in r.stdout
    # the untimed steps before each decode's clock: the context was sized for them
    assert res["decode"]["24"]["warm_steps"] == bench.WARM_DECODE_STEPS and res["decode"]["24"]["warm_s"] > 0
    assert "decode timed after untimed steps" in r.stdout and "24 2 in" in r.stdout


@pytest.mark.parametrize("argv, match", [(["--synthetic", "nope"], "unknown synthetic shape"),
                                         (["--synthetic", "tiny", "--prompt", "0"], "positive")])
def test_bench_bad_arguments(tmp_path, argv, match):
    r = subprocess.run([sys.executable, "-m", "strata", "bench", *argv, "--device", "cpu", "--cache-dir",
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr


def test_clip_lengths_keeps_room_for_the_decoded_tokens():
    assert clip_lengths([512, 4096, 16384], 4096, 128) == ([512, 3968], [
        "prompt 4096 clipped to 3968 tokens: the context holds 4096 and 128 decoded tokens follow the prompt",
        "prompt 16384 clipped to 3968 tokens: the context holds 4096 and 128 decoded tokens follow the prompt"])
    assert clip_lengths([7, 3], 100, 0) == ([3, 7], [])
    assert clip_lengths([100], 100, 0) == ([100], [])
    with pytest.raises(InvalidArgument, match="--decode 100 leaves no room"):
        clip_lengths([8], 100, 100)


@pytest.mark.parametrize("model", [[], ["--synthetic", "tiny"]], ids=["demo", "tiny"])
def test_bench_clips_prompts_to_the_context_and_exits_0(tmp_path, model):
    """The defaults' shape (a prompt past the context) kept fast: a small context stands in for 4096."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "strata", "bench", *model, "--prompt", "8,500", "--decode", "3",
                        "--max-context", "96", "--device", "cpu", "--cache-dir", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "prompt 500 clipped to 93 tokens" in r.stderr and "note: prompt 500 clipped" in r.stdout
    res = json.loads(out.read_text())
    assert set(res["prompt"]) == {"8", "93"} and set(res["decode"]) == {"8", "93"}
    assert res["max_context"] == 96 and res["error"] is None
    # a full context leaves no room for untimed steps: the 93-token prompt's decode is timed from its first step
    assert res["decode"]["93"]["warm_steps"] == 0 and res["decode"]["8"]["warm_steps"] == bench.WARM_DECODE_STEPS


def test_bench_context_defaults_to_what_the_run_needs_up_to_the_trained_one(tmp_path, monkeypatch):
    import strata.engine.llm as llm_module
    seen = []

    class Stop(Exception):
        pass

    def fake_llm(model, **kw):
        seen.append(kw["max_context"])
        raise Stop()
    monkeypatch.setattr(llm_module, "LLM", fake_llm)
    # the longest prompt, the decoded tokens and the untimed steps before them; the demo is trained for 4096
    for prompt, want in (("8,100", 104 + bench.WARM_DECODE_STEPS), ("512,4096,16384", 4096)):
        with pytest.raises(Stop):
            cli.main(["bench", "--prompt", prompt, "--decode", "4", "--device", "cpu"])
        assert seen[-1] == want


def test_a_failure_prints_what_was_measured_before_it(monkeypatch, capsys, tmp_path):
    from strata.engine.runner import CpuRunner
    real = CpuRunner.prefill

    def prefill(self, ids, start, *a, **kw):
        if len(ids) == 40:
            raise RuntimeError("boom\nsecond line")
        return real(self, ids, start, *a, **kw)
    monkeypatch.setattr(CpuRunner, "prefill", prefill)
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--synthetic", "tiny", "--prompt", "8,40", "--decode", "2", "--device", "cpu",
                   "--cache-dir", str(tmp_path), "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 1
    assert "prompt 8 " in captured.out and "decode after 8" in captured.out and "stopped at prompt 40" in captured.out
    assert captured.err.strip().splitlines()[-1] == "strata: error: bench stopped at prompt 40: RuntimeError: boom"
    res = json.loads(out.read_text())
    assert set(res["prompt"]) == {"8"} and res["error"] == "prompt 40: RuntimeError: boom"


def test_bench_spec_arm_reports_window_costs_and_drafts(tmp_path, capsys):
    """--mtp --spec 2 on the synthetic shape with an MTP layer: decode runs through verify windows,
    and the JSON holds the times of windows of 1..5 rows and of a draft step after each prompt."""
    from strata import cli
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--synthetic", "tiny-mtp", "--prompt", "8,24", "--decode", "6", "--device", "cpu",
                   "--mtp", "--spec", "2", "--cache-dir", str(tmp_path), "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    res = json.loads(out.read_text())
    assert res["config"]["spec"] == "2" and res["config"]["mtp"] is True
    for ctx in ("8", "24"):
        w = res["spec"]["windows"][ctx]
        assert sorted(w["verify_ms"]) == ["1", "2", "3", "4", "5"] and all(v > 0 for v in w["verify_ms"].values())
        assert w["draft_step_ms"] > 0
        d = res["decode"][ctx]
        assert d["tokens"] == 6 and d["draft_n"] > 0 and d["tokens_per_verify"] >= 1
    assert "verify window after 24" in captured.out and "speculation after 8" in captured.out


def test_synthetic_mtp_shape_is_the_30b_shape_plus_one_layer():
    a, q = SHAPES["qwen3-30b-a3b-mtp"]
    b, r = SHAPES["qwen3-30b-a3b"]
    import dataclasses
    assert a.num_mtp_layers == 1 and dataclasses.replace(a, num_mtp_layers=0) == b and q == r
    from strata.synthetic import synthetic_source
    src = synthetic_source("qwen3-30b-a3b-mtp")
    assert len(src.experts) == 49 and any(t.name == "blk.48.nextn.eh_proj.weight" for t in src.dense)


@pytest.mark.parametrize("mode", ["batched", "own"])
def test_bench_draft_window_ab_reports_the_draft_layer_after_each_chunk(tmp_path, capsys, monkeypatch, mode):
    """Seed 003's A/B on the CPU: --draft-window with either --draft-prompt pass prints the draft
    layer's cells and time after each prompt chunk; the JSON holds them, the window and the ring."""
    from strata import cli, config as strata_config
    monkeypatch.setattr(strata_config, "DRAFT_RING_PAGE_CELLS", 8)
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--synthetic", "tiny-mtp", "--prompt", "40", "--decode", "0", "--device", "cpu",
                   "--mtp", "--spec", "2", "--draft-window", "16", "--draft-prompt", mode,
                   "--cache-dir", str(tmp_path), "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    res = json.loads(out.read_text())
    d = res["prompt"]["40"]["draft"]
    assert d["mode"] == mode and d["window"] == 16 and d["ring_cells"] == 24
    # one chunk on the CPU (512 tokens): the 16 cells the window reaches of its 39
    assert [c["cells"] for c in d["chunks"]] == [16] and d["chunks"][0]["ms"] > 0 and d["ms"] > 0
    assert res["plan"]["draft_window"] == 16 and res["plan"]["draft_prompt"] == mode
    assert f"draft layer after each chunk of prompt 40 ({mode}, window 16, ring 24)" in captured.out


def test_report_names_the_kernel_paths_an_arm_ran_with():
    """An A/B arm's log says which kernel paths it turned on or off (the JSON has the whole config)."""
    from strata.bench import BenchResult, report
    arm = report(BenchResult("m", "cuda", config={"kernels_on": "wgmma-gemm", "kernels_off": "pdl"}))
    assert "kernel paths: on wgmma-gemm; off pdl" in arm
    assert "kernel paths" not in report(BenchResult("m", "cuda", config={"kernels_on": "", "kernels_off": ""}))
