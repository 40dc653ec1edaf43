"""pick(step=True) on the emulated device: the picked token's decode step queued behind the pick, its id
copied on the device from the pick's output, before the host has the token. It must leave the runner
exactly as pick() then decode(token, logits=False) does (the same tokens, cells and next logits), take
the early path only where nothing the host does between steps depends on them (one slot, resident
experts, no drafter), and keep the plain order everywhere else. STRATA_FAKE_LAG=1 runs these on a
device that lags the host as far as it can: a token read before its copy lands shows there."""
import numpy as np
import pytest

from strata.config import EngineConfig, SamplingParams
from strata.engine.cuda_runner import CudaRunner
from strata.engine.llm import demo_model_path
from strata.pack import open_pack

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.9, top_k=20, top_p=0.9)


def _run(runner, prompt, params, n, ahead, draws, feeds=None):
    """n tokens after prompt, each pick then its decode (ahead: in one pick(step=True)); -> (tokens,
    the logits the last step left for the next pick)."""
    runner.reset()
    runner.prefill(prompt, 0)
    tokens = []
    for i in range(n):
        feed = None if feeds is None else feeds[i]
        if ahead:
            tokens.append(runner.pick(params, draws[i], step=True, feed=feed))
        else:
            tokens.append(runner.pick(params, draws[i]))
            runner.decode(tokens[-1] if feed is None else feed, logits=False)
    return tokens, runner.ops.to_host(runner._last).reshape(-1).copy()


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_pick_and_step_equals_pick_then_decode(fake, rng, params):
    pack = open_pack(demo_model_path())
    runner = CudaRunner(pack, 96)
    prompt = rng.integers(0, pack.args.vocab_size, 9).tolist()
    draws = rng.random(12).tolist()
    plain, plain_logits = _run(runner, prompt, params, 12, False, draws)
    plain_ids = list(runner.cached_ids)
    assert runner.steps_ahead == 0
    ahead, ahead_logits = _run(runner, prompt, params, 12, True, draws)
    assert runner.steps_ahead == 12            # every step went ahead of its token's copy
    assert runner.decode_status()["steps_ahead"] == 12
    assert ahead == plain
    assert runner.cached_ids == plain_ids == prompt + plain
    np.testing.assert_array_equal(ahead_logits, plain_logits)
    # the next pick after either reads the same logits
    assert runner.pick(GREEDY, 0.0) == int(np.argmax(plain_logits))


def test_fed_ids_are_decoded_instead_of_the_picks(fake, rng):
    """The bench's random-weight mode: the step decodes the fed id; the pick is still returned."""
    pack = open_pack(demo_model_path())
    runner = CudaRunner(pack, 64)
    prompt = rng.integers(0, pack.args.vocab_size, 5).tolist()
    feeds = rng.integers(0, pack.args.vocab_size, 6).tolist()
    draws = [0.0] * 6
    plain, plain_logits = _run(runner, prompt, GREEDY, 6, False, draws, feeds)
    ahead, ahead_logits = _run(runner, prompt, GREEDY, 6, True, draws, feeds)
    assert ahead == plain and runner.cached_ids == prompt + feeds
    np.testing.assert_array_equal(ahead_logits, plain_logits)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_streamed_experts_step_ahead_with_the_same_logits(fake, rng, policy):
    """Under a budget each step's routing goes to the cache once the step after it is queued, so each
    admission lands a step later; misses are read in place from the same bytes, so the logits are
    the plain loop's bit for bit, and the cache still sees every step's routing (as many decode
    lookups as the plain loop's; whether they admit more depends on the policy and the prompt: an
    LFU cache the plain run warmed may admit none)."""
    pack = open_pack(demo_model_path())
    runner = CudaRunner(pack, 64, EngineConfig(device="cuda", prefill="24", expert_cache="20", expert_policy=policy))
    assert runner.steps.route_log is not None
    prompt = rng.integers(0, pack.args.vocab_size, 6).tolist()
    draws = [0.0] * 10

    def lookups():
        st = runner.store.stats
        return st.decode_hits + st.decode_misses

    before = lookups()
    plain, plain_logits = _run(runner, prompt, GREEDY, 10, False, draws)
    runner.pick(GREEDY, 0.0)            # as below: the last step's routing handed over
    plain_lookups, admitted = lookups() - before, runner.store.stats.admitted
    assert plain_lookups > 0
    before = lookups()
    ahead, ahead_logits = _run(runner, prompt, GREEDY, 10, True, draws)
    assert runner.steps_ahead == 10
    assert ahead == plain
    np.testing.assert_array_equal(ahead_logits, plain_logits)
    runner.pick(GREEDY, 0.0)            # a plain pick hands the last step's routing over
    assert lookups() - before == plain_lookups
    assert runner.store.stats.admitted >= admitted


def test_a_drafter_keeps_the_plain_order(fake, rng):
    """A runner that drafts (MTP) takes each step's hidden rows on the host: pick(step=True) picks,
    then decodes, as before."""
    from strata.engine.llm import LLM
    runner = LLM(device="cuda", mtp=True, spec=2).runner
    pack = runner.pack if hasattr(runner, "pack") else open_pack(demo_model_path())
    assert runner.drafter is not None
    prompt = rng.integers(0, pack.args.vocab_size, 6).tolist()
    plain, plain_logits = _run(runner, prompt, GREEDY, 4, False, [0.0] * 4)
    ahead, ahead_logits = _run(runner, prompt, GREEDY, 4, True, [0.0] * 4)
    assert runner.steps_ahead == 0 and ahead == plain
    np.testing.assert_array_equal(ahead_logits, plain_logits)


def test_generation_steps_ahead_with_one_slot_only(fake):
    """LLM.generate on one slot decodes each token in its pick (the same reply as the CPU's); a
    request's last token is not decoded (nothing follows it)."""
    from strata.engine import llm as llm_module
    outs = {}
    for device in ("cuda", "cpu"):
        llm = llm_module.LLM(device=device)
        done = llm.generate("Tell me about the sea.", max_tokens=12)
        outs[device] = done.token_ids
        if device == "cuda":
            runner = llm.runner
            n = len(done.token_ids)
            # one step per token that another followed (an end-of-sequence pick was decoded ahead too)
            assert runner.steps_ahead in (n - 1, n)
    assert outs["cuda"] == outs["cpu"]
