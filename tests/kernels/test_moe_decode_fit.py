"""tools/moe_decode_fit.py on the CPU: rows of a known fixed cost and rate, as tools/moe_decode_bench.py
--json writes them, give that cost and rate back; rows at one byte count are refused in one line."""
import json
from pathlib import Path

import pytest

from tests.fixtures import load_tool


def _tool():
    return load_tool("moe_decode_fit")


def _doc(A: int, fixed_us: float, gbps: float) -> dict:
    rows = []
    for bps in (2, 4):
        row = {"qtype": "Q4_K", "T": 1, "blocks_per_sm": bps}
        for k, mb in (("gate_up", 2.8 * A), ("down", 1.4 * A), ("both", 4.2 * A)):
            us = fixed_us * (2 if k == "both" else 1) + mb * 1e6 / (gbps * 1e3)
            row[f"{k}_us"], row[f"{k}_gbps"] = us, mb * 1e6 / us / 1e3
        rows.append(row)
    return {"copy_rate_gbps": 3700.0, "device": "test", "rows": rows}


def test_fit_gives_back_the_fixed_cost_and_the_rate(tmp_path, capsys):
    tool = _tool()
    files = []
    for A in (1, 2, 4, 8):
        path = tmp_path / f"fit_{A}.json"
        path.write_text(json.dumps(_doc(A, 6.0, 2200.0)))
        files.append(str(path))
    assert tool.main(files) == 0
    rows = tool.fits([json.loads(Path(f).read_text()) for f in files])
    assert len(rows) == 2 * 3
    for r in rows:
        assert r["fixed_us"] == pytest.approx(12.0 if r["kernel"] == "both" else 6.0, abs=1e-6)
        assert r["gbps"] == pytest.approx(2200.0, rel=1e-6) and r["points"] == 4
    out = capsys.readouterr().out
    assert "6.00 us fixed + bytes at 2,200 GB/s (59% of the 3,700 GB/s copy rate)" in out


def test_fit_refuses_one_byte_count(tmp_path, capsys):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(_doc(4, 6.0, 2200.0)))
    assert _tool().main([str(path)]) == 2
    assert "two or more byte counts" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert _tool().main([str(bad)]) == 2
