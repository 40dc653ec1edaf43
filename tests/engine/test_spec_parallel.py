"""Speculation in parallel slots (--mtp --spec with --parallel): each slot keeps its own drafter (its
final draft cells and pending rows follow the slot, Slots.SLOT_STATE), so requests speculating side by
side in several slots, and plain steps of drafting slots batched together (a request with
log-probabilities does not draft), give each request its greedy tokens alone; on the CPU, the
emulated GPU and a two-card split."""
import pytest

from strata import LLM
from strata.config import EngineConfig, SamplingParams
from strata.engine.scheduler import Request
from strata.errors import InvalidArgument

PROMPTS = ["the cat sat on the mat. the cat sat on the", "Write one line about the sea.",
           "def add(a, b):\n    return", "Once upon a time there was"]


def _side_by_side(llm, prompts, kws):
    ids = [p if isinstance(p, list) else llm.tokenizer.encode(p) for p in prompts]
    reqs = [llm.scheduler.submit(Request(i, SamplingParams(max_tokens=16, **kw)))
            for i, kw in zip(ids, kws)]
    for r in reqs:
        assert list(llm.scheduler.drive(r))[-1][0] == "done"
    return [r.completion for r in reqs]


@pytest.mark.parametrize("engine", [dict(device="cpu"), dict(device="cuda"),
                                    dict(device="cuda", gpus="0,0", layer_split="2,4")])
def test_slots_speculate_side_by_side(engine, request):
    if engine["device"] == "cuda":
        request.getfixturevalue("fake")
    plain = LLM(max_context=160, **engine)
    spec = LLM(max_context=160, parallel=3, mtp=True, spec=3, **engine)
    kws = [{}, {}, {"logprobs": 1}, {}]        # the third does not draft: its plain steps batch with none
    want = []
    for p, kw in zip(PROMPTS, kws):
        plain.runner.reset()
        want.append(plain.generate(p, max_tokens=16, **kw).token_ids)
    got = _side_by_side(spec, PROMPTS, kws)
    assert [c.token_ids for c in got] == want
    drafted = [c.timings.draft_n for c in got]
    assert drafted[2] == 0 and all(n > 0 for i, n in enumerate(drafted) if i != 2)
    # a follow-up turn in its slot reuses the conversation, the slot's drafter included (the last
    # request's: the first ones' slots took the later requests)
    follow = spec.tokenizer.encode(PROMPTS[3]) + want[3] + spec.tokenizer.encode(" and then")
    plain.runner.reset()
    again = _side_by_side(spec, [follow], [{}])[0]
    assert again.token_ids == plain.generate(follow, max_tokens=16).token_ids
    assert again.usage.cached_tokens >= len(spec.tokenizer.encode(PROMPTS[3])) and again.timings.draft_n > 0


def test_two_non_drafting_requests_batch_and_keep_their_slots_drafters():
    """Two logprobs requests of a drafting runner decode in batched steps; each slot's drafter still
    covers its sequence after them, so a drafting follow-up in either slot goes on from there."""
    spec = LLM(device="cpu", max_context=160, parallel=2, mtp=True, spec=2)
    plain = LLM(device="cpu", max_context=160)
    got = _side_by_side(spec, PROMPTS[:2], [{"logprobs": 0}, {"logprobs": 0}])
    for slot, (p, c) in enumerate(zip(PROMPTS, got)):
        spec.runner.use(slot)
        assert spec.runner.drafter.covered == len(spec.runner.cached_ids) == len(spec.tokenizer.encode(p)) + 15
        follow = spec.tokenizer.encode(p) + c.token_ids + spec.tokenizer.encode(" next")
        plain.runner.reset()
        assert _side_by_side(spec, [follow], [{}])[0].token_ids == plain.generate(follow, max_tokens=16).token_ids
    assert spec.runner.spec_stats.draft_n > 0


def test_each_slot_has_its_own_drafter():
    spec = LLM(device="cpu", max_context=96, parallel=3, mtp=True, spec=2)
    seen = set()
    for slot in (0, 1, 2, 0):
        spec.runner.use(slot)
        seen.add(id(spec.runner.drafter))
    assert len(seen) == 3


def test_a_draft_window_with_parallel_is_refused():
    with pytest.raises(InvalidArgument, match="--draft-window"):
        EngineConfig.from_kwargs(parallel=2, mtp=True, spec="2", draft_window=64)
