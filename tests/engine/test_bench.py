"""python -m strata bench on a synthetic shape, on the CPU; synthetic packs are real packs."""
import json
import subprocess
import sys

import numpy as np
import pytest

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


@pytest.mark.parametrize("argv, match", [(["--synthetic", "nope"], "unknown synthetic shape"),
                                         (["--synthetic", "tiny", "--prompt", "0"], "positive")])
def test_bench_bad_arguments(tmp_path, argv, match):
    r = subprocess.run([sys.executable, "-m", "strata", "bench", *argv, "--device", "cpu", "--cache-dir",
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr
