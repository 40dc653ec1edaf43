"""strata.LLM's context (the model's trained one by default, --max-context over it, host memory
bounding the CPU's KV), its warm-up (no trace, no change of output), and `info` defaulting to the demo."""
import subprocess
import sys

import numpy as np
import pytest

from strata import LLM
from strata.engine.llm import demo_model_path, host_context
from tests.server.helpers import tiny_pack


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    return tiny_pack(tmp_path_factory.mktemp("ctx"))


def test_context_defaults_to_the_trained_one(pack, capsys):
    llm = LLM(pack, device="cpu")
    assert llm.max_context == llm.args.max_position_embeddings == 4096
    assert llm.context_source == "the model's trained context" and llm.status()["max_context"] == 4096
    assert capsys.readouterr().err == ""
    ids = np.random.default_rng().integers(0, llm.args.vocab_size, 4095).tolist()
    gen = llm.begin(ids)                                 # 4095 prompt tokens fit; the old default refused them
    assert gen.max_tokens == 1


def test_max_context_overrides_and_is_capped_with_a_note(pack, capsys):
    assert LLM(pack, device="cpu", max_context=300).max_context == 300
    assert capsys.readouterr().err == ""
    llm = LLM(pack, device="cpu", max_context=100000)
    assert llm.max_context == 4096
    assert "context 4096 tokens: --max-context 100000 capped at the model's trained context 4096" in \
        capsys.readouterr().err


def test_host_memory_bounds_the_cpu_kv(pack):
    args = LLM(pack, device="cpu").args
    cell = 2 * (args.num_hidden_layers + args.num_mtp_layers) * args.num_key_value_heads * args.head_dim * 4
    assert host_context(args, 4096, None) == (4096, None)
    assert host_context(args, 4096, 2 * 4096 * cell) == (4096, None)
    context, why = host_context(args, 4096, 2 * 1000 * cell + 7)
    assert context == 1000 and "half of the" in why and "available host memory" in why


def test_warm_up_changes_no_output_and_leaves_no_prefix(pack):
    cold, warm = LLM(pack, device="cpu"), LLM(pack, device="cpu")
    assert warm.warm_up() > 0
    cache = warm.runner.ops.cache
    before = (cache.bytes, len(cache._items))
    assert warm.runner.cached_ids == [] and warm.runner._last is None
    a, b = cold.generate("the warm-up", max_tokens=8), warm.generate("the warm-up", max_tokens=8)
    assert a.token_ids == b.token_ids and b.usage.cached_tokens == 0
    assert (cache.bytes, len(cache._items)) == before     # the first request dequantized nothing new
    np.testing.assert_array_equal(cold.logits([5, 6, 7]), warm.logits([5, 6, 7]))


def test_info_defaults_to_the_demo_model():
    r = subprocess.run([sys.executable, "-m", "strata", "info"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{demo_model_path()} (pack)") and "architecture: qwen3moe" in r.stdout
