"""A layer split on the GPU (#21): two logical cards on one GPU (--gpus 0,0) run the real kernels on
the same rows as one card, so prompt, logits_all and decode logits (eager, captured and replayed)
are equal bit for bit, resident and with experts streaming on both cards; with two GPUs the same
over the peer copy. The host logic is tests/engine/test_layer_split_host.py's."""
import numpy as np
import pytest

from strata.config import EngineConfig
from strata.engine.llm import LLM, demo_model_path
from strata.pack import open_pack
from tests.engine.layer_split_checks import same_parallel_slots

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    from strata.backends.cuda import _runtime
    return _runtime().device_count()


@pytest.mark.parametrize("gpus, cache", [("0,0", None), ("0,0", "40"), ("0,1", None), ("0,1", "40")])
def test_split_logits_equal_one_card_bit_for_bit(gpus, cache):
    from strata.engine.cuda_runner import CudaRunner
    from strata.engine.cuda_split import SplitRunner
    if gpus == "0,1" and _gpus() < 2:
        pytest.skip("needs two GPUs (the nvidia-h200-x2 kind)")
    pack = open_pack(demo_model_path())
    extra = {} if cache is None else {"expert_cache": cache}
    one = CudaRunner(pack, 256, EngineConfig(device="cuda", prefill="64", **extra))
    two = SplitRunner(pack, 256, EngineConfig(device="cuda", prefill="64", gpus=gpus, layer_split="2,4", **extra))
    rng = np.random.default_rng(5)
    ids = rng.integers(0, pack.args.vocab_size, 150).tolist()
    np.testing.assert_array_equal(two.logits_all(ids), one.logits_all(ids))
    np.testing.assert_array_equal(two.prefill(ids[:140], 0), one.prefill(ids[:140], 0))
    for t in ids[140:]:
        np.testing.assert_array_equal(two.decode(t), one.decode(t))
    assert all(s.steps.step_times["graph"] for s in two.stages)       # replayed graphs on both cards
    st = two.status()["layer_split"]
    assert st["handoff_ms_per_step"] > 0
    assert st["peer_access"] == ([None] if gpus == "0,0" else [two.stages[0].dev.enable_peer_access(two.stages[1].dev)])


def test_llm_split_greedy_text_equals_one_card():
    one = LLM(device="cuda", max_context=512)
    two = LLM(device="cuda", gpus="0,0", max_context=512)
    assert type(two.runner).__name__ == "SplitRunner"
    for prompt in ("Once upon a time", "def fibonacci(n):"):
        assert two.generate(prompt, max_tokens=24).text == one.generate(prompt, max_tokens=24).text


def test_qwen3next_split_equals_one_card_bit_for_bit(tmp_path):
    pytest.importorskip("transformers")
    from strata.engine.cuda_runner import CudaRunner
    from strata.engine.cuda_split import SplitRunner
    from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack
    path, _ = make_next_pack(tmp_path, NEXT_SHAPES["tiny"], seed=3)
    pack = open_pack(path)
    one = CudaRunner(pack, 128, EngineConfig(device="cuda", prefill="16"))
    two = SplitRunner(pack, 128, EngineConfig(device="cuda", prefill="16", gpus="0,0", layer_split="2,2"))
    rng = np.random.default_rng(7)
    ids = rng.integers(0, pack.args.vocab_size, 60).tolist()
    np.testing.assert_array_equal(two.prefill(ids[:50], 0), one.prefill(ids[:50], 0))
    for t in ids[50:]:
        np.testing.assert_array_equal(two.decode(t), one.decode(t))


def test_parallel_slots_over_a_split_equal_one_card():
    from strata.engine.cuda_runner import CudaRunner
    from strata.engine.cuda_split import SplitRunner
    pack = open_pack(demo_model_path())
    one = CudaRunner(pack, 256, EngineConfig(device="cuda", parallel=3))
    two = SplitRunner(pack, 256, EngineConfig(device="cuda", parallel=3, gpus="0,0", layer_split="3,3"))
    same_parallel_slots(one, two, np.random.default_rng(9), lengths=(40, 9, 70))


def test_speculation_over_a_split_emits_plain_greedy():
    plain = LLM(device="cuda", max_context=512)
    two = LLM(device="cuda", max_context=512, gpus="0,0", layer_split="2,4", mtp=True, spec=3)
    for prompt in ("Once upon a time", "def fibonacci(n):"):
        assert two.generate(prompt, max_tokens=32).text == plain.generate(prompt, max_tokens=32).text
    assert two.status()["speculation"]["draft_n_accepted"] > 0


def test_qwen3next_speculation_over_a_split_emits_plain_greedy(tmp_path):
    pytest.importorskip("transformers")
    from strata.engine.cuda_runner import CudaRunner
    from strata.engine.cuda_split import SplitRunner
    from tests.engine.next_spec_checks import check_spec_is_plain_greedy
    from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack
    pack = open_pack(make_next_pack(tmp_path, NEXT_SHAPES["tiny"], seed=21, mtp=True)[0])
    plain = CudaRunner(pack, 128, EngineConfig(device="cuda", prefill="16"))
    two = SplitRunner(pack, 128, EngineConfig(device="cuda", prefill="16", gpus="0,0", layer_split="2,2", mtp=True,
                                              spec=4))
    prompt = np.random.default_rng(11).integers(0, pack.args.vocab_size, 14).tolist()
    _, kept = check_spec_is_plain_greedy(plain, two, prompt, 24, wrong=[-1, 0, 2, 1, -1])
    assert kept > 0
