"""The CPU/GPU split's cost model (strata.engine.expert_split) under injected rates, on the CPU."""
import numpy as np
import pytest

from strata.engine.expert_split import (DEFAULT_HOST_RATES, HostRates, expected_rows, host_computable, parse_mode,
                                        split_chunk, split_layer)
from strata.errors import InvalidArgument

BLOB = 3_000_000
# an expert over a 30 GB/s bus: 0.1 ms; on the host 0.2 ms + 0.1 ms a row
RATES = HostRates(expert_s=0.2e-3, row_s=0.1e-3, blob_bytes=BLOB, source="test", layer_s=0.0)


def test_equal_rows_give_the_host_the_seeds_share():
    g, c = BLOB / 30e9, 0.3e-3                 # bus and host seconds of one expert of one row
    for m in (10, 40, 121):
        s = split_layer(np.ones(m, int), BLOB, 30.0, RATES)
        want = m * g / (c + g)                  # both finish together: (m - k) g = k c
        assert abs(s.host - want) <= 1, (m, s.host, want)
        assert s.seconds <= s.bus_seconds and s.speedup > 1.2
        assert s.seconds == pytest.approx(max((m - s.host) * g, s.host * c))


def test_the_host_takes_the_experts_with_fewest_rows():
    rows = np.array([9, 1, 7, 1, 30, 2, 1, 5, 12, 1, 1, 1])
    s = split_layer(rows, BLOB, 30.0, RATES)
    assert s.host > 0
    assert sorted(rows[list(s.chosen)]) == sorted(rows)[:s.host]


def test_many_rows_per_expert_give_the_host_nothing():
    s = split_layer(np.full(120, 32), BLOB, 55.4, DEFAULT_HOST_RATES)      # a 512-token chunk's ~32 rows
    assert s.host <= 2                          # under 2% of the layer: worth nothing
    assert split_layer(np.full(120, 300), BLOB, 55.4, DEFAULT_HOST_RATES).host == 0
    # a slow host never pays, a fixed cost above the gain neither
    slow = HostRates(expert_s=1.0, row_s=1.0, blob_bytes=BLOB, source="slow")
    assert split_layer(np.ones(50, int), BLOB, 30.0, slow).host == 0
    costly = HostRates(expert_s=0.2e-3, row_s=0.1e-3, blob_bytes=BLOB, source="test", layer_s=1e-3)
    assert split_layer(np.ones(4, int), BLOB, 30.0, costly).host == 0
    assert split_layer(np.ones(60, int), BLOB, 30.0, costly).host > 0


def test_a_slower_bus_gives_the_host_more():
    fast = split_chunk(19, 128, 8, 0.2, BLOB, 55.4, DEFAULT_HOST_RATES)
    slow = split_chunk(19, 128, 8, 0.2, BLOB, 25.0, DEFAULT_HOST_RATES)
    assert 0 < fast.host < slow.host
    assert slow.speedup > fast.speedup > 1.0
    assert split_chunk(512, 128, 8, 0.2, BLOB, 55.4, DEFAULT_HOST_RATES).host <= 2


def test_forced_share_and_no_misses():
    s = split_layer(np.ones(10, int), BLOB, 30.0, RATES, share=0.5)
    assert s.host == 5 and s.bus == 5
    assert split_layer(np.ones(10, int), BLOB, 30.0, RATES, share=1.0).bus == 0
    empty = split_layer(np.zeros(0, int), BLOB, 30.0, RATES)
    assert empty.host == 0 and empty.seconds == 0.0 and empty.speedup == 1.0


def test_expected_rows_under_uniform_routing():
    touched, rows = expected_rows(1, 128, 8)
    assert touched == pytest.approx(8) and rows == pytest.approx(1)
    touched, rows = expected_rows(512, 128, 8)
    assert 127 < touched <= 128 and rows == pytest.approx(512 * 8 / touched)


def test_rates_follow_measurements():
    r = RATES.updated(rows=10, experts=5, blob_bytes=BLOB, seconds=2 * (5 * 0.2e-3 + 10 * 0.1e-3))
    assert r.expert_s > RATES.expert_s and r.row_s > RATES.row_s
    for _ in range(40):
        r = r.updated(rows=10, experts=5, blob_bytes=BLOB, seconds=2 * (5 * 0.2e-3 + 10 * 0.1e-3))
    assert r.expert_s == pytest.approx(2 * RATES.expert_s, rel=1e-2)
    assert RATES.seconds(4, 2 * BLOB) == pytest.approx(2 * (0.2e-3 + 4 * 0.1e-3))


def test_parse_mode_and_what_the_host_reads():
    assert parse_mode("off") == "off" and parse_mode("auto") is None and parse_mode("0.25") == 0.25
    for bad in ("1.5", "-1", "x", "0", "0.0"):
        with pytest.raises(InvalidArgument):
            parse_mode(bad)
    part = {"qtype": "Q4_K", "shape": [768, 2048]}
    assert host_computable([{"layer": 0, "parts": {"gate": part, "up": part, "down": part}}]) is None
    f32 = {"qtype": "F32", "shape": [8, 16]}
    assert "F32" in host_computable([{"layer": 0, "parts": {"gate": f32, "up": f32, "down": f32}}])


def test_plan_shows_the_split_and_its_speeds(capsys):
    import json

    from strata import cli
    argv = ["plan", "--synthetic", "qwen3-30b-a3b", "--vram-budget-gib", "8", "--device", "cpu", "--max-context", "4096"]
    assert cli.main([*argv, "--cpu-experts", "0.5"]) == 2            # refused on the CPU device
    assert "--cpu-experts 0.5" in capsys.readouterr().err
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "CPU/GPU split       --cpu-experts off (auto would split as below)" in text
    for case in ("a 19-token turn", "a 512-token chunk", "a decode step"):
        assert case in text
    assert cli.main([*argv, "--json"]) == 0
    cases = json.loads(capsys.readouterr().out)["cpu_experts"]["cases"]
    assert [c["tokens"] for c in cases] == [19, 512, 1]
    for c in cases:
        s = c["split"]
        assert s["host"] + s["bus"] > 0 and c["split_tok_s"] >= c["bus_tok_s"] > 0
