"""A request whose prompt begins with what another slot holds gets those cells copied into its own
slot (Slots._share) instead of reading them again: its reply and log-probabilities are bit for bit
what it gets in the slot that read the prefix itself, on the CPU, the emulated GPU and a two-card
split; short common prefixes and hybrid models read the prompt as before."""
import numpy as np
import pytest

from strata import LLM
from strata.config import SamplingParams
from strata.engine.slots import SHARE_MIN_TOKENS
from tests.fixtures import load_tool

SYSTEM = ("You are a careful coding agent. Tools: read_file(path), write_file(path, text), run(cmd). "
          "Answer with one tool call at a time and explain nothing. ") * 3


def _run(llm, prompt, slot, k=2):
    gen = llm.begin(prompt, SamplingParams(max_tokens=10, logprobs=k), slot=slot)
    for _ in gen:
        pass
    return gen.completion


def _same(a, b):
    assert a.token_ids == b.token_ids
    assert [e.logprob for e in a.logprobs] == [e.logprob for e in b.logprobs]       # bit for bit
    assert [e.top for e in a.logprobs] == [e.top for e in b.logprobs]


@pytest.mark.parametrize("engine", [dict(device="cpu"), dict(device="cuda"),
                                    dict(device="cuda", gpus="0,0", layer_split="2,4")])
def test_a_prefix_copied_from_another_slot_gives_the_same_reply(engine, request):
    if engine["device"] == "cuda":
        request.getfixturevalue("fake")
    a, b = SYSTEM + "Task: list the files.", SYSTEM + "Task: run the tests."
    two = LLM(parallel=2, max_context=256, **engine)
    one = LLM(parallel=1, max_context=256, **engine)
    _run(two, a, 0)
    _run(one, a, 0)
    shared, own = _run(two, b, 1), _run(one, b, 0)       # slot 1 copies slot 0's cells; one reuses its own
    common = len(two.tokenizer.encode(SYSTEM)) - 1
    assert shared.usage.cached_tokens == own.usage.cached_tokens >= common
    _same(shared, own)
    status = two.status()["kept_conversations"]
    assert status["shared_prefixes"] == 1 and status["shared_tokens"] == shared.usage.cached_tokens
    # slot 0 is untouched by the copy: a follow-up there still reuses its own conversation
    again = _run(two, a + " Then read setup.py.", 0)
    assert again.usage.cached_tokens >= len(two.tokenizer.encode(a)) - 1
    assert two.status()["kept_conversations"]["shared_prefixes"] == 1


def test_short_prefixes_are_read_again():
    two = LLM(device="cpu", parallel=2, max_context=256)
    _run(two, SYSTEM, 0)
    short = two.tokenizer.decode(two.tokenizer.encode(SYSTEM)[:SHARE_MIN_TOKENS]) + " something else entirely"
    got = _run(two, short, 1)
    assert got.usage.cached_tokens == 0 and two.status()["kept_conversations"]["shared_prefixes"] == 0


def test_a_hybrid_model_does_not_share(tmp_path):
    from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack
    path, _ = make_next_pack(tmp_path, NEXT_SHAPES["tiny"], seed=5)
    two = LLM(str(path), device="cpu", parallel=2, max_context=256)
    ids = list(np.random.default_rng(0).integers(5, 200, 80))
    two.generate(ids, max_tokens=2)
    gen = two.begin(ids + [7, 8, 9], SamplingParams(max_tokens=2), slot=1)
    for _ in gen:
        pass
    assert gen.completion.usage.cached_tokens == 0


def test_the_share_bench_runs_both_arms(tmp_path):
    import json
    slot_share_bench = load_tool("slot_share_bench")
    out = tmp_path / "share.json"
    assert slot_share_bench.main(["--prefix", "64", "--rounds", "2", "--device", "cpu", "--max-context", "256",
                                  "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["copied"]["cached_tokens"] == 64 and got["read"]["cached_tokens"] == 0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_requests_of_one_prompt_at_once_read_it_once(device, request):
    """n choices of one prompt (or agents' requests of one system prompt) admitted together: the
    others wait for the slot that reads it, then copy its cells, and reply as they would alone (the
    CPU, and the GPU runner emulated)."""
    from strata.engine.scheduler import Request
    if device == "cuda":
        request.getfixturevalue("fake")
    prompt = SYSTEM + "Task: list the files."
    three = LLM(device=device, parallel=3, max_context=256, prefill="32")     # a prompt of several chunks
    one = LLM(device=device, parallel=1, max_context=256, prefill="32")
    three.tokenizer.eos_token_ids = one.tokenizer.eos_token_ids = []
    ids = three._prompt_ids(prompt)
    params = [SamplingParams(max_tokens=6, temperature=0.8, seed=s) for s in (1, 2, 3)]
    reqs = [three.scheduler.submit(Request(list(ids), p)) for p in params]
    while three.scheduler.step():
        pass
    cached = sorted(r.completion.usage.cached_tokens for r in reqs)
    assert cached[0] == 0 and cached[1:] == [len(ids) - 1] * 2          # read once, copied twice
    assert three.status()["kept_conversations"]["shared_prefixes"] == 2
    for r, p in zip(reqs, params):
        alone = one.generate(prompt, max_tokens=6, temperature=0.8, seed=p.seed)
        assert r.completion.token_ids == alone.token_ids


def test_a_request_does_not_wait_for_a_much_longer_prompt():
    runner = LLM(device="cpu", parallel=2, max_context=256).runner
    ids = list(range(100, 160))
    assert runner.worth_waiting(1, ids, ids + [7])
    assert not runner.worth_waiting(1, ids, ids[:40] + list(range(300, 400)))     # 140 tokens for 40 shared
    assert not runner.worth_waiting(1, ids[:10] + list(range(500, 600)), ids)     # 10 of 110 shared
