"""The CPU/GPU split of missed experts (--cpu-experts) on the emulated runtime: a streamed runner
whose host computes a share of each prompt chunk's missed experts (strata._ext.cpu_experts over the
pinned arena) against the all-GPU run.

Bounds, per MoE layer (the same x, routing and weights through ops.moe with and without the split):
- the host's FFN swapped for numpy on the emulated GPU's own operands (f16-rounded activations and
  weights, tests/engine/fake_moe_gemm.py): only the order of sums differs, and an f32 difference can
  flip one f16 rounding of h (2^-11 of a value): 1e-3 of max |out| (seen 2e-5 to 1.1e-4);
- cpu_experts against numpy over the same 8-bit activations (its quantize(), float64 sums): f32
  rounding, except where h (f32 in the kernel, float64 here) lands on the other side of an int8
  rounding step, a move of amax / 127 of one value of h: 2e-3 of max |out| (seen 1e-7 to 5e-4);
- cpu_experts against the GPU: the 8-bit activations. Each block of 32 is rounded to int8 with scale
  amax / 127, so a value moves by at most amax / 254 (0.39% of its block's max), twice (x before
  gate/up, h before down); a dot product over such values moves by up to that share of sum |w x|,
  which cancellation makes a larger share of |sum w x|. tests/kernels/test_cpu_experts.py measures
  0.5-0.8% of max |out| per FFN and bounds it at 3%; the same 3% here (seen 0.8-1.0%).
Whole runs: a later layer's routing can flip between two nearly tied experts for a moved input, and
then a token's output moves by the difference of two experts, so no rounding bound holds for single
logits (seen up to 12% of max |logit| at one position). The whole-run tests check the greedy tokens
where the top two logits are apart by more than 10% of max |logit|, and the logits' RMS error within
15% of their RMS (seen 0.3-7.4% over the demo model's 6 layers at host shares of 0.5 and 1).
"""
import numpy as np
import pytest

from strata._ext import cpu_experts
from strata.backends.cpu import swiglu
from strata.config import EngineConfig
from strata.engine import memory_model
from strata.engine.cuda_runner import CudaRunner
from strata.engine.llm import demo_model_path
from strata.errors import InvalidArgument
from strata.pack import open_pack
from strata.quant.dequant import dequantize

DEMO = demo_model_path()
BOUND = 0.15        # RMS error over RMS logit, whole runs (module doc)
MARGIN = 0.1        # greedy tokens compared where the top two are this far apart (of max |logit|)


def _runner(pack, ctx=96, **config):
    return CudaRunner(pack, ctx, EngineConfig(device="cuda", prefill="24", **config))


def _numpy_ffn(operands: str):
    """expert_ffn's signature in numpy over the dequantized weights, the operands (x, h before down,
    and the weights) rounded as `operands` says: "int8" (cpu_experts' own 8-bit quantize() of the
    activations, float64 sums: its reference) or "f16" (activations and weights rounded to f16, f32
    sums: what the emulated tensor-core GEMM, tests/engine/fake_moe_gemm.py, computes)."""
    def act(x):
        if operands == "f16":
            return x.astype(np.float16).astype(np.float32)
        q, s, _ = cpu_experts.quantize(x)
        return (q.reshape(len(x), -1, 32).astype(np.float64) * s[:, :, None]).reshape(x.shape)

    def weight(qt, w, shape):
        W = dequantize(qt, w, shape)
        return W.astype(np.float16).astype(np.float32) if operands == "f16" else W.astype(np.float64)

    def ffn(gq, g, uq, u, dq, d, D, I, x):
        G, U, Dn = weight(gq, g, (I, D)), weight(uq, u, (I, D)), weight(dq, d, (D, I))
        xa = act(np.asarray(x, np.float32))
        h = swiglu(xa @ G.T, xa @ U.T).astype(np.float32)
        return (act(h) @ Dn.T).astype(np.float32)
    return ffn


def _layer_outputs(pack, T, x, ids, weights, share="off", ffn=None):
    """ops.moe of every layer over the same x [T, D], ids and weights in one prompt chunk's plan."""
    r = _runner(pack, expert_cache="6", cpu_experts=share)
    if ffn is not None:
        r.store.host_experts.ffn = ffn
    ops, a = r.ops, pack.args
    outs = []
    with r.prompts.loan(T, T, pool=False):
        plan = r.store.chunk_plan(T, memory_model.stream_all_tokens(a), a.num_hidden_layers)
        for layer in range(a.num_hidden_layers):
            y = ops.moe(ops.upload(x), layer, ops.upload(ids), ops.upload(weights), plan)
            outs.append(ops.to_host(y))
    return np.array(outs), r


@pytest.mark.parametrize("T", [9, 23])          # under and over stream_all_tokens (8 on the demo)
def test_layer_with_the_split_equals_the_gpu(fake, rng, T):
    pack = open_pack(DEMO)
    a = pack.args
    x = rng.standard_normal((T, a.hidden_size)).astype(np.float32)
    ids = np.array([rng.choice(a.num_experts, a.num_experts_per_tok, replace=False) for _ in range(T)], np.int32)
    w = rng.uniform(0.05, 1.0, ids.shape).astype(np.float32)
    gpu, _ = _layer_outputs(pack, T, x, ids, w)
    same_operands, r = _layer_outputs(pack, T, x, ids, w, "0.7", _numpy_ffn("f16"))
    int8_ref, _ = _layer_outputs(pack, T, x, ids, w, "0.7", _numpy_ffn("int8"))
    host, r8 = _layer_outputs(pack, T, x, ids, w, "0.7")
    assert r.store.host_experts.stats.experts > 0 and r8.store.host_experts.stats.experts > 0
    m = np.abs(gpu).max()
    assert np.abs(same_operands - gpu).max() <= 1e-3 * m
    assert np.abs(host - int8_ref).max() <= 2e-3 * m
    assert np.abs(host - gpu).max() <= 3e-2 * m


def _close(got, want):
    err = np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean())
    assert err <= BOUND, f"relative error {err:.2e} over the bound {BOUND}"
    return err


@pytest.mark.parametrize("routed_only", [False, True])
def test_forced_share_equals_all_gpu_within_the_activation_bound(fake, rng, monkeypatch, routed_only):
    if routed_only:        # every chunk stages only its routed experts, choosing the host's per layer
        monkeypatch.setattr(memory_model, "stream_all_tokens", lambda args: 10**9)
    pack = open_pack(DEMO)
    gpu = _runner(pack, expert_cache="10")
    split = _runner(pack, expert_cache="10", cpu_experts="0.5")
    assert split.store.host_experts is not None and gpu.store.host_experts is None
    ids = rng.integers(0, pack.args.vocab_size, 60).tolist()
    _close(split.logits_all(ids), gpu.logits_all(ids))
    host = split.status()["expert_cache"]["host"]
    assert host["experts"] > 0 and host["bytes"] == host["experts"] * pack.meta["max_blob"]
    # the host's experts did not cross the bus
    assert split.store.stats.prompt_streamed < gpu.store.stats.prompt_streamed
    # decode steps split too (tests/engine/test_cpu_experts_decode_split.py checks them closely)
    a, b = split.prefill(ids[:40], 0), gpu.prefill(ids[:40], 0)
    _close(a, b)
    for t in ids[40:44]:
        _close(split.decode(t), gpu.decode(t))


def test_all_missed_on_the_host(fake, rng):
    pack = open_pack(DEMO)
    gpu, split = _runner(pack, expert_cache="0"), _runner(pack, expert_cache="0", cpu_experts="1")
    ids = rng.integers(0, pack.args.vocab_size, 30).tolist()
    _close(split.logits_all(ids), gpu.logits_all(ids))
    assert split.store.stats.prompt_streamed == 0


def test_greedy_tokens_unchanged_on_the_demo(fake, rng):
    pack = open_pack(DEMO)
    gpu, split = _runner(pack, expert_cache="10"), _runner(pack, expert_cache="10", cpu_experts="0.5")
    ids = rng.integers(0, pack.args.vocab_size, 48).tolist()
    want, got = gpu.logits_all(ids), split.logits_all(ids)
    top2 = np.sort(want, axis=1)[:, -2:]
    margin = (top2[:, 1] - top2[:, 0]) > MARGIN * np.abs(want).max()
    assert margin.any()
    np.testing.assert_array_equal(got.argmax(1)[margin], want.argmax(1)[margin])


def test_auto_that_gives_the_host_nothing_is_bit_for_bit(fake, rng):
    pack = open_pack(DEMO)
    off, auto = _runner(pack, expert_cache="10"), _runner(pack, expert_cache="10", cpu_experts="auto")
    h = auto.store.host_experts
    h.rates = type(h.rates)(expert_s=1.0, row_s=1.0, blob_bytes=h.rates.blob_bytes, source="slow")   # never pays
    ids = rng.integers(0, pack.args.vocab_size, 50).tolist()
    np.testing.assert_array_equal(auto.logits_all(ids), off.logits_all(ids))
    assert h.stats.experts == 0


def test_flag_refusals():
    with pytest.raises(InvalidArgument, match="cpu_experts must be off, auto or a share"):
        EngineConfig(cpu_experts="2")
    with pytest.raises(InvalidArgument, match="cpu_experts must be off, auto or a share"):
        EngineConfig(cpu_experts="some")
    with pytest.raises(InvalidArgument, match="on the CPU"):
        EngineConfig(device="cpu", cpu_experts="auto")
    assert EngineConfig(cpu_experts="0.25").cpu_experts == "0.25"


def test_bench_and_status_report_the_hosts_share(fake):
    from types import SimpleNamespace

    from strata.bench import report, run_bench
    pack = open_pack(DEMO)
    cfg = EngineConfig(device="cuda", prefill="24", expert_cache="10", cpu_experts="0.5")
    runner = CudaRunner(pack, 96, cfg)
    runner.measure_limits = lambda: {}
    llm = SimpleNamespace(runner=runner, model_name="demo", device="cuda", config=cfg, pack=pack, max_context=96,
                          args=pack.args)
    res = run_bench(llm, [19, 40], 4)
    assert res.error is None, res.error
    assert res.prompt[19]["host_experts"] > 0 and res.prompt[19]["host_bytes"] > 0
    assert res.decode[19]["host_experts"] > 0              # a forced share splits decode steps too
    split = runner.status()["decode"]["cpu_experts_split"]
    assert split["mode"] == 0.5 and split["steps"] > 0 and split["pricing"]["forced"]
    assert "host_ms" in runner.status()["decode"] and "split" in runner.status()["decode"]["host_ms"]
    text = report(res)
    assert "computed on the host (--cpu-experts 0.5): prompt 19:" in text and "host expert FFN" in text
    host = runner.status()["expert_cache"]["host"]
    assert host["mode"] == 0.5 and host["experts"] >= res.prompt[19]["host_experts"]
    assert "fixed a layer split" in text
    assert "decode split (--cpu-experts 0.5), since load:" in text and "steps split (eager)" in text
    assert "forced" in text
    assert set(host["rates"]["fixed_ms"]) == {"sync", "choose", "host_round_trip", "gpu_resume"}


def test_rates_are_measured_at_load_through_the_path(fake):
    """The runner prices the split with what its own path costs: the rates through the worker
    thread (HostExperts.measure), choosing, and the device reads (cuda_load.measure_sync); the pool
    leaves a core to the engine's thread. Only the GPU's resume stays an estimate."""
    from strata._ext import cpu_experts
    from strata.engine.expert_split import RESUME_S
    from strata.engine.experts.host_compute import host_threads
    r = _runner(open_pack(DEMO), expert_cache="10", cpu_experts="auto")
    rates = r.store.host_experts.rates
    assert "through the engine's path" in rates.source and "measured at load" in rates.fixed_source
    assert rates.expert_s > 0 and rates.row_s > 0 and rates.layer_s > 0 and rates.choose_s > 0
    assert rates.sync_s > 0 and rates.resume_s == RESUME_S
    assert cpu_experts.threads() == host_threads()


def test_qwen3next_streamed_split(fake, rng, tmp_path):
    """The split is the store's and the MoE op's, not the architecture's: Qwen3-Next's routed experts
    (10 of 24 a token, Q8_0; its shared expert stays on the GPU) split the same way."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack
    shape = dict(NEXT_SHAPES["tiny"], num_experts=24, num_experts_per_tok=10)
    pack = open_pack(make_next_pack(tmp_path, shape, seed=3, name="top10", qtype="Q8_0")[0])
    gpu, split = _runner(pack, expert_cache="12"), _runner(pack, expert_cache="12", cpu_experts="0.5")
    ids = rng.integers(0, pack.args.vocab_size, 40).tolist()
    _close(split.logits_all(ids), gpu.logits_all(ids))
    assert split.store.host_experts.stats.experts > 0
