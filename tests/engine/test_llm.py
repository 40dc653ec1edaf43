"""strata.LLM on a tiny pack: generation contract, prefix reuse, bad input, CLI errors."""
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")

import strata  # noqa: E402
from strata import LLM, InvalidArgument  # noqa: E402
from tests.fixtures import SHAPES, make_pack  # noqa: E402


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    path, _ = make_pack(tmp_path_factory.mktemp("llm"), SHAPES["tiny"], seed=9)
    return path


@pytest.fixture(scope="module")
def llm(pack):
    return LLM(pack, device="cpu")


def test_generate_stream_and_usage_agree(llm):
    c = llm.generate("def add(a, b):", max_tokens=12)
    streamed = "".join(llm.stream("def add(a, b):", max_tokens=12))
    assert streamed == c.text
    assert c.usage.prompt_tokens == len(llm.tokenizer.encode("def add(a, b):"))
    assert c.usage.completion_tokens == len(c.token_ids) <= 12
    assert c.finish_reason in ("length", "stop")
    assert llm.tokenizer.decode(c.token_ids) == c.text


def test_text_equals_decoded_tokens_even_for_invalid_utf8(llm):
    c = llm.generate("def f", max_tokens=16)      # this tiny model emits stray byte tokens here
    assert c.text == llm.tokenizer.decode(c.token_ids) == "".join(llm.stream("def f", max_tokens=16))


def test_prefix_reuse_reads_only_new_tokens_and_changes_nothing(llm):
    first = llm.generate("import os\nimport sys\n", max_tokens=6)
    follow = "import os\nimport sys\n" + first.text + "\nprint(1)"
    again = llm.generate(follow, max_tokens=6)
    assert again.usage.cached_tokens > 0
    assert again.timings.prompt_n == again.usage.prompt_tokens - again.usage.cached_tokens
    llm.runner.reset()
    fresh = llm.generate(follow, max_tokens=6)
    assert fresh.usage.cached_tokens == 0 and fresh.token_ids == again.token_ids


def test_stop_string_ends_generation(llm):
    full = llm.generate("hello", max_tokens=16)
    if len(full.text) < 3:
        pytest.skip("the tiny model's reply is too short to cut")
    stop = full.text[1:3]
    c = llm.generate("hello", max_tokens=16, stop=[stop])
    assert c.finish_reason == "stop" and c.text == full.text[:full.text.find(stop)]


def test_seeded_sampling_is_reproducible(llm):
    a = llm.generate("hello", max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=123)
    b = llm.generate("hello", max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=123)
    assert a.token_ids == b.token_ids


def test_cancel_stops_at_the_next_token(llm):
    gen = llm.begin("count:", strata.SamplingParams(max_tokens=20))
    next(gen)
    gen.cancel()
    assert list(gen) == [] and gen.completion.finish_reason == "cancelled"


@pytest.mark.parametrize("call, match", [
    (lambda m: m.generate("", max_tokens=4), "empty"),
    (lambda m: m.generate([], max_tokens=4), "empty"),
    (lambda m: m.generate("hi", max_tokens=-1), "max_tokens"),
    (lambda m: m.logits([10**6]), "vocabulary"),
    (lambda m: m.generate("hi " * 3000, max_tokens=1), "context"),
    (lambda m: m.logits([1] * (m.max_context + 1)), "context"),
])
def test_bad_input_raises_one_clear_error(llm, call, match):
    with pytest.raises(InvalidArgument, match=match) as info:
        call(llm)
    assert "\n" not in str(info.value)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "strata", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, match", [
    (["generate", "{pack}", "-p", "", "-n", "4", "--device", "cpu"], "empty"),
    (["generate", "{pack}", "-p", "hi", "-n", "-1", "--device", "cpu"], "max_tokens"),
    (["generate", "{missing}", "-p", "hi"], "missing"),
    (["info", "{missing}"], "missing"),
])
def test_cli_bad_input_exits_2_with_one_line(pack, tmp_path, args, match):
    args = [a.format(pack=pack, missing=tmp_path / "missing") for a in args]
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and match in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_generate_prints_text(pack):
    r = run_cli("generate", str(pack), "-p", "def f(x):", "-n", "5", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "generated" in r.stderr


@pytest.mark.parametrize("setting,chunk", [("32", 32), ("auto:64", 64), ("auto:4096", 512), ("auto", 512)])
def test_the_cpu_reads_prompts_in_the_chunks_prefill_asks(setting, chunk):
    """--prefill on the CPU: N as given, auto:N a ceiling on 512 (it was ignored: always 512)."""
    llm = LLM(device="cpu", prefill=setting, max_context=256)
    assert llm.status()["prefill_chunk"] == chunk
    ids = llm.tokenizer.encode("one two three four five six seven eight nine ten " * 8)
    assert len(ids) > chunk or chunk == 512
    assert llm.generate(ids, max_tokens=3).token_ids == LLM(device="cpu", max_context=256).generate(
        ids, max_tokens=3).token_ids


def test_a_prefill_of_no_tokens_is_refused():
    from strata.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match="positive"):
        LLM(device="cpu", prefill="0")
