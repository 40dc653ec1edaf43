"""--cpu-experts on decode steps: the pricing (strata.engine.expert_split.split_decode) on the CPU, and
split decode steps on the emulated runtime against the same runner with the split off.

With the host's FFN swapped for numpy over the same dequantized f32 weights the emulated kernels read
(tests/engine/fake_moe_decode.py), a split step differs from the unsplit one only in the order of f32
sums (the host's sum is added after the GPU's slots): logits within 1e-4 of max |logit| (seen under
1e-6), greedy tokens equal. A GPU that did not skip the host's slots would count their experts twice:
far outside that. With the host's own kernels (strata._ext.cpu_experts, 8-bit activations) the bounds
are tests/engine/test_cpu_experts_split_host.py's: greedy tokens where the top two are apart, RMS.
"""
import numpy as np
import pytest

from strata.backends.cpu import swiglu
from strata.backends.cuda import moe as moe_mod
from strata.config import EngineConfig
from strata.engine.cuda_runner import CudaRunner
from strata.engine.expert_split import (DEFAULT_HOST_RATES, EAGER_LAYER_S, FIXED_MARGIN, HostRates, gain_needed,
                                        in_place_gb_s, split_decode)
from strata.engine.llm import demo_model_path
from strata.pack import open_pack
from strata.quant.dequant import dequantize
from tests.engine.cpu_f16_kv import oracle_ids
from tests.engine.test_cpu_experts_split_host import BOUND, MARGIN

DEMO = demo_model_path()
EXACT = 1e-4        # of max |logit|: the host's numpy FFN over the GPU's own operands (module doc)
BLOB = 3_060_000    # Qwen3-30B-A3B's Q4_K/Q6_K expert
LAYERS = 48


# ---- the pricing ---------------------------------------------------------------------------------
def test_auto_refuses_at_the_h200s_bus():
    """The H200's pinned rate (55.4 GB/s): misses read in place at ~28 GB/s cost 0.11 ms an expert,
    a host expert of one row ~0.38 ms plus the fixed costs: no layer gains, let alone the eager step."""
    d = split_decode(6.0, LAYERS, BLOB, in_place_gb_s(55.4), DEFAULT_HOST_RATES, LAYERS * EAGER_LAYER_S)
    assert not d.taken and d.layer.host == 0 and d.layer.bus == 6
    assert "never beats the bus" in d.why()
    # a consumer bus (--pcie-gbs 25): a layer gains a little, the step loses its graph's worth more
    d = split_decode(6.0, LAYERS, BLOB, in_place_gb_s(55.4, 25.0), DEFAULT_HOST_RATES, LAYERS * EAGER_LAYER_S)
    assert not d.taken and d.layer.best_host > 0 and d.layer.best_seconds < d.layer.bus_seconds
    assert d.seconds > d.bus_seconds and "refused" in d.why()
    # and without the eager step's cost the gain is still under the margin
    d = split_decode(6.0, LAYERS, BLOB, in_place_gb_s(55.4, 25.0), DEFAULT_HOST_RATES, 0.0)
    assert not d.taken and 0 < d.bus_seconds - d.seconds < gain_needed(d.bus_seconds, d.fixed_seconds)


def test_auto_takes_a_slow_bus_and_a_fast_host():
    fast = HostRates(expert_s=20e-6, row_s=5e-6, blob_bytes=BLOB, source="fast", layer_s=20e-6, sync_s=20e-6,
                     choose_s=20e-6, resume_s=20e-6)
    d = split_decode(6.0, LAYERS, BLOB, 4.0, fast, 1e-3)
    assert d.taken and d.layer.host > 0 and d.layer.host + d.layer.bus == 6
    assert d.bus_seconds - d.seconds >= FIXED_MARGIN * d.fixed_seconds and "saves" in d.why()
    # the same step where the graph's loss is larger than what the split saves: refused
    slow_eager = split_decode(6.0, LAYERS, BLOB, 4.0, fast, d.bus_seconds)
    assert not slow_eager.taken and slow_eager.layer.host == 0
    assert split_decode(0.2, LAYERS, BLOB, 4.0, fast, 1e-3).why() == "nothing missed"


def test_a_share_forces_the_split():
    d = split_decode(6.0, LAYERS, BLOB, in_place_gb_s(55.4), DEFAULT_HOST_RATES, LAYERS * EAGER_LAYER_S, share=0.5)
    assert d.taken and d.forced and d.layer.host == 3 and d.seconds > d.bus_seconds      # slower, taken
    assert d.to_dict()["host_a_layer"] == 3 and d.why().startswith("forced")


def test_in_place_rate():
    assert in_place_gb_s(55.4) == pytest.approx(27.7)
    # --pcie-gbs 25: the read at half the bus, then the cap's sleep for the rest of 1/25
    assert 1 / in_place_gb_s(55.4, 25.0) == pytest.approx(1 / 27.7 + 1 / 25.0 - 1 / 55.4)
    assert in_place_gb_s(55.4, 80.0) == in_place_gb_s(55.4)


# ---- split decode steps on the emulated GPU -------------------------------------------------------
def _exact_ffn(gq, g, uq, u, dq, d, D, I, x):
    """expert_ffn's signature in numpy over the f32 dequantized weights the emulated kernels read."""
    G, U, Dn = (dequantize(q, w, s).astype(np.float32) for q, w, s in ((gq, g, (I, D)), (uq, u, (I, D)),
                                                                         (dq, d, (D, I))))
    x = np.asarray(x, np.float32)
    return (swiglu(x @ G.T, x @ U.T).astype(np.float32) @ Dn.T).astype(np.float32)


def _runner(pack, cpu_experts="off", exact=True, **config):
    """A runner at 20 cache slots of the demo's 96 experts; exact: the host's FFN is _exact_ffn, and
    prompt chunks keep their misses on the GPU (their split's bound is f16's, tensor-core operands),
    so the decode steps compare from the same K/V."""
    r = CudaRunner(pack, 96, EngineConfig(device="cuda", prefill="24", expert_cache="20", cpu_experts=cpu_experts,
                                          **config))
    if exact and r.store.host_experts is not None:
        r.store.host_experts.ffn = _exact_ffn
        r.store.host_experts.chunk = lambda *args: None
    return r


def _greedy(r, prompt, n):
    """Greedy decode of n tokens after prompt -> (tokens, each step's logits)."""
    logits = r.prefill(prompt, 0)
    tokens, steps = [], []
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        logits = r.decode(tokens[-1])
        steps.append(logits)
    return tokens, np.array(steps)


def _watch_gpu_slots(monkeypatch, r):
    """-> a list that gets, for every layer of a split step, whether the host's experts were cached
    (never), whether the GPU's stand-in was (always), and the routing the GPU ran in their slots."""
    seen, chosen = [], []
    host, real_choose, real_slots = r.store.host_experts, r.store.host_experts.choose_decode, moe_mod.gpu_slots

    def choose(layer, ids):
        experts, stand_in = real_choose(layer, ids)
        if experts:
            slot_of = r.store.slot_of[layer]
            chosen.append(((slot_of[experts] < 0).all(), slot_of[stand_in] >= 0))
        return experts, stand_in

    def slots(ids, weights, experts, stand_in):
        gpu_ids, gpu_w = real_slots(ids, weights, experts, stand_in)
        mine = np.isin(ids, experts)
        seen.append((*chosen[-1], set(experts) & set(gpu_ids.reshape(-1).tolist()), gpu_ids[mine], gpu_w[mine],
                     stand_in))
        return gpu_ids, gpu_w
    monkeypatch.setattr(host, "choose_decode", choose)
    monkeypatch.setattr(moe_mod, "gpu_slots", slots)
    return seen


def test_forced_share_decodes_the_same_tokens(fake, rng, monkeypatch):
    pack = open_pack(DEMO)
    off, split = _runner(pack), _runner(pack, "0.5")
    # a prompt whose 12 greedy steps route apart too (oracle_ids; seed 2764486470 drew a margin of 3.2e-4
    # at the 11th token, which moved the logits 2e-4, past EXACT), drawn on a runner of its own: off's
    # counts stay this run's
    probe = _runner(pack)
    prompt = oracle_ids(pack, rng, 30, tries=20, then=lambda ids: _greedy(probe, ids, 12)[0])
    want_tokens, want = _greedy(off, prompt, 12)
    seen = _watch_gpu_slots(monkeypatch, split)
    got_tokens, got = _greedy(split, prompt, 12)
    assert got_tokens == want_tokens
    assert np.abs(got - want).max() <= EXACT * np.abs(want).max()
    host = split.store.host_experts.stats
    assert host.decode_steps == 12 and host.decode_experts > 0
    assert host.experts == host.decode_experts and host.layers > 0      # one per layer and expert, decode only
    # the GPU skipped every host expert (all missed), reading a cached one with weight 0 in its slot
    assert len(seen) >= 12
    for missed, cached, both, gpu_ids, gpu_w, stand_in in seen:
        assert missed and cached and not both and (gpu_ids == stand_in).all() and (gpu_w == 0).all()
    # the same routing, so the same cache: the host's experts did not cross the bus
    assert split.store.stats.decode_misses == off.store.stats.decode_misses
    assert split.store.stats.bytes_in_place + host.decode_experts * pack.meta["max_blob"] == \
        off.store.stats.bytes_in_place
    # no graph for a split step, status says so
    status = split.status()["decode"]
    assert status["host_ms"]["split"]["steps"] == 12 and "graph" not in status["host_ms"]
    assert status["cpu_experts_split"]["pricing"]["forced"] and status["cpu_experts_split"]["steps"] == 12


def _forced(r, prompt, tokens):
    """The logits of decode steps fed `tokens` after prompt (the same inputs whatever r computes)."""
    r.prefill(prompt, 0)
    return np.array([r.decode(t) for t in tokens])


def test_a_gpu_that_counts_the_hosts_experts_twice_fails(fake, rng, monkeypatch):
    """The mutation: the GPU runs the routing as it is (the host's experts and weights kept)."""
    pack = open_pack(DEMO)
    off, split = _runner(pack), _runner(pack, "0.5")
    monkeypatch.setattr(moe_mod, "gpu_slots", lambda ids, weights, experts, stand_in: (ids, weights))
    prompt = rng.integers(0, pack.args.vocab_size, 30).tolist()
    tokens = rng.integers(0, pack.args.vocab_size, 6).tolist()
    want, got = _forced(off, prompt, tokens), _forced(split, prompt, tokens)
    assert split.store.host_experts.stats.decode_experts > 0
    assert np.abs(got - want).max() > 100 * EXACT * np.abs(want).max()


def test_host_kernels_keep_the_greedy_tokens(fake, rng):
    """strata._ext.cpu_experts itself (8-bit activations): the bounds of the prompt split's tests."""
    pack = open_pack(DEMO)
    off, split = _runner(pack), _runner(pack, "1", exact=False)
    prompt = rng.integers(0, pack.args.vocab_size, 30).tolist()
    tokens = rng.integers(0, pack.args.vocab_size, 10).tolist()
    want, got = _forced(off, prompt, tokens), _forced(split, prompt, tokens)
    err = np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean())
    assert err <= BOUND
    top2 = np.sort(want, axis=1)[:, -2:]
    margin = (top2[:, 1] - top2[:, 0]) > MARGIN * np.abs(want).max()
    np.testing.assert_array_equal(got.argmax(1)[margin], want.argmax(1)[margin])
    assert split.store.host_experts.stats.decode_experts > 0


def test_auto_that_refuses_keeps_the_graph(fake, rng):
    """auto at the emulated bus with the default costs: decode steps do not split, run as graphs, and
    give the split-off run's logits bit for bit; status gives the pricing's reason."""
    pack = open_pack(DEMO)
    off, auto = _runner(pack), _runner(pack, "auto")
    h = auto.store.host_experts
    h.rates = HostRates(expert_s=1.0, row_s=1.0, blob_bytes=h.rates.blob_bytes, source="slow")    # never pays
    prompt = rng.integers(0, pack.args.vocab_size, 20).tolist()
    want_tokens, want = _greedy(off, prompt, 5)
    got_tokens, got = _greedy(auto, prompt, 5)
    np.testing.assert_array_equal(got, want)
    assert h.stats.decode_steps == 0 and h.stats.decode_experts == 0
    status = auto.status()["decode"]
    assert "split" not in status["host_ms"] and "graph" in status["host_ms"]
    assert status["cpu_experts_split"]["pricing"]["taken"] is False


def test_auto_that_takes_it_splits(fake, rng):
    """auto with a host priced far faster than the bus: the steps split (eagerly), tokens unchanged."""
    pack = open_pack(DEMO)
    off, auto = _runner(pack), _runner(pack, "auto")
    h = auto.store.host_experts
    h.rates = HostRates(expert_s=1e-9, row_s=1e-9, blob_bytes=h.rates.blob_bytes, source="fast", layer_s=1e-9,
                        sync_s=1e-9, choose_s=1e-9, resume_s=1e-9)
    h.in_place_gb_s = 1e-3
    prompt = rng.integers(0, pack.args.vocab_size, 20).tolist()
    want_tokens, want = _greedy(off, prompt, 5)
    got_tokens, got = _greedy(auto, prompt, 5)
    assert got_tokens == want_tokens and np.abs(got - want).max() <= EXACT * np.abs(want).max()
    assert h.stats.decode_steps == 5 and h.decode.taken


def test_batched_and_window_steps_do_not_split(fake, rng):
    """A step of several rows (a verify window, batched slots) runs as before, split share or not."""
    pack = open_pack(DEMO)
    off, split = _runner(pack), _runner(pack, "0.5")
    prompt = rng.integers(0, pack.args.vocab_size, 20).tolist()
    off.prefill(prompt, 0)
    split.prefill(prompt, 0)
    before = split.store.host_experts.stats.decode_experts
    ids = rng.integers(0, pack.args.vocab_size, 3).tolist()
    a, _ = split.steps.step(ids, len(prompt), split.kv)
    b, _ = off.steps.step(ids, len(prompt), off.kv)
    np.testing.assert_array_equal(a, b)
    assert split.store.host_experts.stats.decode_experts == before


def test_speculation_keeps_plain_greedy(fake):
    """--spec with a forced decode share: windows of several rows (eager verify passes and the
    device's window graphs) run as before, steps without drafts split; every token is plain greedy's
    (the host's FFN exact, as above)."""
    from strata.config import SamplingParams
    from strata.engine.llm import LLM

    class Draws:
        def draw(self):
            return 0.5

    plain = LLM(device="cuda", expert_cache="20")
    spec = LLM(device="cuda", mtp=True, spec=3, expert_cache="20", cpu_experts="0.5")
    r, greedy, host = spec.runner, SamplingParams(), spec.runner.store.host_experts
    host.ffn, host.chunk = _exact_ffn, (lambda *args: None)
    for prompt in ("The capital of France is", "Once upon a time, in a quiet village by the sea, there lived"):
        ids = spec.tokenizer.encode(prompt)
        want = plain.generate(ids, max_tokens=24).token_ids
        r.reset()
        r.prefill(ids, 0, logits=False)
        got = [r.pick(greedy, 0.5)]
        for n in [0, 3, 0, 0, 2, 1, 0, 3] * 4:
            if len(got) >= 24:
                break
            r.spec = n
            got += r.speculate(got[-1], greedy, Draws(), 24 - len(got))
        assert got[:24] == want, prompt
    assert host.stats.decode_steps > 0 and spec.status()["speculation"]["verify_passes"] > 0
