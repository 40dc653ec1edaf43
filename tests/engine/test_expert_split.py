"""The CPU/GPU split's cost model (strata.engine.expert_split) under injected rates, on the CPU."""
import numpy as np
import pytest

from dataclasses import replace

from strata.engine.expert_split import (BENCH_HOST_RATES, DEFAULT_HOST_RATES, FIXED_MARGIN, MIN_GAIN, HostRates,
                                        expected_rows, gain_needed, host_computable, parse_mode, split_chunk,
                                        split_layer)
from strata.errors import InvalidArgument

BLOB = 3_000_000
NO_FIXED = dict(layer_s=0.0, sync_s=0.0, choose_s=0.0, resume_s=0.0)
# an expert over a 30 GB/s bus: 0.1 ms; on the host 0.2 ms + 0.1 ms a row; no fixed costs
RATES = HostRates(expert_s=0.2e-3, row_s=0.1e-3, blob_bytes=BLOB, source="test", **NO_FIXED)


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
    costly = replace(RATES, layer_s=1e-3)
    assert split_layer(np.ones(4, int), BLOB, 30.0, costly).host == 0
    assert split_layer(np.ones(60, int), BLOB, 30.0, costly).host > 0


def test_a_slower_bus_gives_the_host_more():
    fast = split_chunk(19, 128, 8, 0.2, BLOB, 55.4, DEFAULT_HOST_RATES)
    slow = split_chunk(19, 128, 8, 0.2, BLOB, 25.0, DEFAULT_HOST_RATES)
    assert fast.host == 0 < slow.host           # the H200's bus: the gain does not clear the fixed costs
    assert slow.speedup > fast.speedup == 1.0
    assert split_chunk(512, 128, 8, 0.2, BLOB, 25.0, DEFAULT_HOST_RATES).host == 0


def test_every_fixed_cost_is_on_the_split_path():
    """A split layer pays sync + choose + max(bus, round trip + host) + resume; the bus alone pays none."""
    m, k, bus = 40, 10, BLOB / 30e9
    rates = HostRates(expert_s=0.2e-3, row_s=0.1e-3, blob_bytes=BLOB, source="test",
                      layer_s=1e-4, sync_s=2e-5, choose_s=3e-5, resume_s=4e-5)
    assert rates.fixed_s == pytest.approx(1.9e-4)
    s = split_layer(np.ones(m, int), BLOB, 30.0, rates, share=k / m)
    assert s.host == k and s.fixed_seconds == pytest.approx(rates.fixed_s)
    assert s.seconds == pytest.approx(2e-5 + 3e-5 + max((m - k) * bus, 1e-4 + k * 0.3e-3) + 4e-5)
    assert s.bus_seconds == pytest.approx(m * bus)
    # a chunk routed on the device brings its routing down too: more sync, the same split otherwise
    on_device = split_chunk(64, 128, 8, 0.0, BLOB, 30.0, rates, share=0.25, stream_all_tokens=32)
    routed = split_chunk(64, 128, 8, 0.0, BLOB, 30.0, rates, share=0.25)
    assert on_device.seconds == pytest.approx(routed.seconds + 300e-6)


def test_auto_needs_a_net_gain_that_clears_the_fixed_costs():
    """The best split is taken only when it saves its fixed costs again (FIXED_MARGIN) and MIN_GAIN of
    the layer, net; just under that it is refused (and says so), just over it taken."""
    rows = np.ones(40, int)
    free = split_layer(rows, BLOB, 30.0, RATES)
    gross = free.bus_seconds - free.seconds     # the gain with no fixed costs
    assert free.host > 0 and gross > MIN_GAIN * free.bus_seconds
    for fixed, taken in ((0.95 * gross / (1 + FIXED_MARGIN), True), (1.05 * gross / (1 + FIXED_MARGIN), False)):
        s = split_layer(rows, BLOB, 30.0, replace(RATES, resume_s=fixed))
        assert (s.host > 0) is taken, (fixed, s)
        assert s.best_host == free.host and s.bus_seconds - s.best_seconds == pytest.approx(gross - fixed)
        assert (s.bus_seconds - s.best_seconds >= gain_needed(s.bus_seconds, fixed)) is taken
        assert s.why().startswith("refused") is not taken
    assert split_layer(rows, BLOB, 30.0, replace(RATES, resume_s=gross), share=0.25).host == 10    # forced


# The H200 run (docs/PERF.md, ninth session): 8 GiB, the bench's context 544, a 19-token prompt, the
# pinned bus at 55.4 GB/s, the host's 16 cores at 0.29 ms an expert of 1 row and 0.77 of 8 (the kernel
# bench): auto split, predicted x1.14, and the prompt took 0.083 s against 0.070 off.
H200_BUS = 55.4
BUS_25 = 25.0


def _plan_share(budget_gib: float, h2d: float):
    """(the kept share of the cache during a short prompt, the max blob) of the 30B shape's plan at
    budget_gib with the bench's context, as `plan` prices the split."""
    from strata.config import EngineConfig
    from strata.engine.planner import Bandwidths, make_plan
    from strata.plan import plan_sizes
    sizes = plan_sizes(None, "qwen3-30b-a3b")[1]
    config = EngineConfig(device="cuda", max_context=544)
    p = make_plan(sizes, config, int(budget_gib * 2**30), "test", Bandwidths(h2d, 4267.0, "test"), 132)
    kept = max(p.prompt_cache_slots, p.cache_slots - p.prefill_ring)
    return kept / p.total_experts, max(sizes.blob(l) for l in range(sizes.args.num_hidden_layers))


def test_the_h200_19_token_split_is_refused():
    share, blob = _plan_share(8, H200_BUS)
    for rates in (DEFAULT_HOST_RATES, replace(BENCH_HOST_RATES)):     # the path's rates, and the bench's own
        s = split_chunk(19, 128, 8, share, blob, H200_BUS, rates, stream_all_tokens=32)
        assert s.host + s.bus > 40 and s.host == 0, (rates.source, s)
        assert s.best_host > 0 and s.why().startswith("refused")
        # the first model (60 us a layer, nothing else fixed, the bench's rates) took it: the A/B's loss
        old = replace(BENCH_HOST_RATES, layer_s=60e-6, sync_s=0.0, choose_s=0.0, resume_s=0.0)
        assert split_layer(np.full(s.host + s.bus, 2), blob, H200_BUS, old).host > 0
    # refused at any cached share, so whatever the run's misses were
    for cached in np.linspace(0.0, 0.9, 10):
        assert split_chunk(19, 128, 8, cached, blob, H200_BUS, DEFAULT_HOST_RATES).host == 0, cached


def test_a_capped_bus_with_fast_host_cores_still_splits():
    share, blob = _plan_share(8, BUS_25)
    fast = replace(DEFAULT_HOST_RATES, expert_s=0.1e-3, row_s=0.03e-3)
    for T in (8, 12, 19):
        s = split_chunk(T, 128, 8, share, blob, BUS_25, fast, stream_all_tokens=32)
        assert s.host > 0 and s.speedup > 1.1, (T, s)
        assert s.bus_seconds - s.seconds >= gain_needed(s.bus_seconds, s.fixed_seconds)
    # the H200's own cores at 25 GB/s: a 19-token turn still gains
    assert split_chunk(19, 128, 8, share, blob, BUS_25, DEFAULT_HOST_RATES).host > 0
    # a 512-token chunk never (32 rows an expert), nor a 64-token one on the H200's bus
    assert split_chunk(512, 128, 8, share, blob, BUS_25, fast, stream_all_tokens=32).host == 0
    assert split_chunk(64, 128, 8, share, blob, H200_BUS, DEFAULT_HOST_RATES, stream_all_tokens=32).host == 0


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
    assert "fixed a layer" in text and "host round trip" in text and "gpu resume" in text
    for case in ("a 19-token turn", "a 512-token chunk", "a decode step"):
        assert case in text
    assert cli.main([*argv, "--json"]) == 0
    cases = json.loads(capsys.readouterr().out)["cpu_experts"]["cases"]
    assert [c["tokens"] for c in cases] == [19, 512, 1]
    for c in cases:
        s = c["split"]
        assert s["host"] + s["bus"] > 0 and c["split_tok_s"] >= c["bus_tok_s"] > 0


def _host_experts_stub(h2d_gb_s: float, rates, layers: int = 4, E: int = 128, A: int = 8, blob: int = 2_654_208):
    """A HostExperts whose store has no expert cached and every expert pinned (chunk() reads no more)."""
    from types import SimpleNamespace

    from strata.engine.experts.host_compute import HostExperts
    h = object.__new__(HostExperts)
    h.store = SimpleNamespace(num_experts=E, slot_of=np.full((layers, E), -1), pinned=np.ones((layers, E), bool),
                              layers_meta=[{"blob_bytes": blob}] * layers)
    h.A, h.h2d_gb_s, h.share, h.rates = A, h2d_gb_s, None, rates
    return h


def test_routed_only_chunk_skips_the_host_path_when_no_layer_is_expected_to_split():
    """Choosing costs a routing read and the split's Python a layer: on the H200's bus a 19-token
    chunk ran 30% slower with auto choosing nothing (tenth session), so a routed-only chunk whose
    expected split (uniform routing) gives the host nothing gets no host share at all; a capped bus
    with fast host cores still lets every layer choose from its routing."""
    assert _host_experts_stub(H200_BUS, DEFAULT_HOST_RATES).chunk(19, False, 4) is None
    assert _host_experts_stub(H200_BUS, DEFAULT_HOST_RATES).chunk(19, True, 4) is None
    split = _host_experts_stub(BUS_25, DEFAULT_HOST_RATES).chunk(19, False, 4)
    assert split is not None and split.sets is None and all(split.may_take(l) for l in range(4))
    assert not split.may_take(4)
