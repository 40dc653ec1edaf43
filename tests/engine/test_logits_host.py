"""Penalties, logit_bias and log-probabilities (strata.engine.logits) on the demo model: each pick
against a reference that reads the whole sequence again with LLM.logits and applies the rules in
plain Python; the GPU runner (emulated) and a two-card split give the CPU's tokens."""
import math

import numpy as np
import pytest

from strata import LLM
from strata.config import SamplingParams
from strata.engine.logits import HostLogits, _top_ids, entries, log_softmax
from strata.errors import InvalidArgument

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
TOL = 2e-3      # the logits of a one-row step against the same position read as a prompt


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu")


def reference_adjusted(raw: np.ndarray, prompt: list[int], reply: list[int], p: SamplingParams) -> np.ndarray:
    """The rules of strata.engine.logits' doc, token by token in Python floats."""
    out = [float(v) for v in raw]
    counts: dict[int, int] = {}
    for t in reply:
        counts[t] = counts.get(t, 0) + 1
    for t in set(prompt) | set(reply):
        if p.repetition_penalty != 1.0:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, n in counts.items():
        out[t] -= p.frequency_penalty * n + p.presence_penalty
    for t, b in p.logit_bias:
        out[t] += b
    return np.asarray(out)


def test_penalised_greedy_picks_are_the_reference_argmax(llm):
    ids = llm.tokenizer.encode(PROMPT)
    plain = llm.generate(ids, max_tokens=24).token_ids
    bias = ((plain[0], -4.0), (plain[1], 2.5))
    params = SamplingParams(24, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3, logit_bias=bias)
    got = llm.generate(ids, max_tokens=24, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3,
                       logit_bias=dict(bias)).token_ids
    assert got != plain                   # the rules changed the reply: the check below is not vacuous
    assert len(set(got)) > len(set(plain))
    for i, token in enumerate(got):
        adjusted = reference_adjusted(llm.logits(ids + got[:i])[-1], ids, got[:i], params)
        assert adjusted[token] >= adjusted.max() - TOL, (i, token, int(np.argmax(adjusted)))


def test_logprobs_are_the_models_log_softmax(llm):
    ids = llm.tokenizer.encode("Write a short poem about the sea.")
    c = llm.generate(ids, max_tokens=16, temperature=0.9, seed=7, logprobs=5)
    assert len(c.logprobs) == len(c.token_ids) > 0
    for i, (token, e) in enumerate(zip(c.token_ids, c.logprobs)):
        lp = log_softmax(llm.logits(ids + c.token_ids[:i])[-1])
        assert e.token == token and abs(e.logprob - lp[token]) < TOL
        assert [t for t, _ in e.top] == [int(t) for t in np.argsort(-lp, kind="stable")[:5]] or \
            np.allclose([v for _, v in e.top], np.sort(lp)[::-1][:5], atol=TOL)
        values = [v for _, v in e.top]
        assert values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1 + 1e-9
        if token in dict(e.top):
            assert dict(e.top)[token] == e.logprob


def test_prompt_logprobs_are_every_positions_next_token(llm):
    ids = llm.tokenizer.encode(PROMPT)
    c = llm.generate(ids, max_tokens=0, prompt_logprobs=3)
    assert c.token_ids == [] and c.prompt_logprobs[0] is None and len(c.prompt_logprobs) == len(ids)
    lp = log_softmax(llm.logits(ids))
    for i in range(1, len(ids)):
        e = c.prompt_logprobs[i]
        assert e.token == ids[i] and abs(e.logprob - lp[i - 1, ids[i]]) < TOL and len(e.top) == 3
    # with a reply too, the reply is what a plain request gives (the slot was read again)
    plain = llm.generate(ids, max_tokens=6)
    both = llm.generate(ids, max_tokens=6, prompt_logprobs=0)
    assert both.token_ids == plain.token_ids and all(e.top == () for e in both.prompt_logprobs[1:])


def test_prompt_logprobs_in_small_chunks_equal_one_chunk(llm, monkeypatch):
    from strata.engine import logits as logits_mod
    ids = llm.tokenizer.encode(PROMPT * 3)
    whole = llm.generate(ids, max_tokens=0, prompt_logprobs=2).prompt_logprobs
    monkeypatch.setattr(logits_mod, "PROMPT_LOGITS_BYTES", 4 * llm.args.vocab_size * 7)    # 7 rows a chunk
    chunked = llm.generate(ids, max_tokens=0, prompt_logprobs=2).prompt_logprobs
    assert [e and e.token for e in chunked] == [e and e.token for e in whole]
    assert np.allclose([e.logprob for e in chunked[1:]], [e.logprob for e in whole[1:]], atol=TOL)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_scoring_pass_lets_other_slots_step_between_its_chunks(monkeypatch, device, request):
    """echo + logprobs over a long prompt (lm-evaluation-harness's request) in one slot: a short request
    in another slot gets its tokens meanwhile, and the scores equal those of the pass alone (the CPU,
    and the GPU runner emulated with every expert resident)."""
    from strata.engine import logits as logits_mod
    from strata.engine.scheduler import Request
    if device == "cuda":
        request.getfixturevalue("fake")
    monkeypatch.setattr(logits_mod, "PROMPT_LOGITS_BYTES", 4 * 4096 * 8)       # a few rows a chunk
    two = LLM(device=device, parallel=2)
    assert two.runner.interleaves
    two.tokenizer.eos_token_ids = []
    ids = two.tokenizer.encode(PROMPT * 6)
    alone = two.generate(ids, max_tokens=0, prompt_logprobs=1).prompt_logprobs
    scoring = two.scheduler.submit(Request(list(ids), SamplingParams(max_tokens=0, prompt_logprobs=1)))
    short = two.scheduler.submit(Request(two.tokenizer.encode("hello"), SamplingParams(max_tokens=3)))
    while two.scheduler.step():
        pass
    assert short.completion.usage.completion_tokens == 3
    assert short.finished < scoring.finished                  # not held behind the whole pass
    got = scoring.completion.prompt_logprobs
    assert [e and e.token for e in got] == [e and e.token for e in alone]
    assert [e.logprob for e in got[1:]] == [e.logprob for e in alone[1:]]


def test_a_large_bias_forces_its_token(llm):
    forced = next(t for t in range(100, 200) if t not in llm.tokenizer.eos_token_ids)
    c = llm.generate("Hello", max_tokens=5, temperature=1.0, seed=3, logit_bias={forced: 100})
    assert c.token_ids == [forced] * 5
    c = llm.generate("Hello", max_tokens=5, logit_bias={t: -100 for t in range(0, 1000)})
    assert all(t >= 1000 for t in c.token_ids)


def test_speculation_is_off_for_adjusted_requests():
    llm = LLM(device="cpu", mtp=True, spec=3)
    ids = llm.tokenizer.encode(PROMPT)
    plain = LLM(device="cpu").generate(ids, max_tokens=12, logprobs=1)
    drafted = llm.generate(ids, max_tokens=12, logprobs=1)
    assert drafted.token_ids == plain.token_ids and len(drafted.logprobs) == 12
    assert drafted.timings.draft_n == 0
    assert [e.token for e in drafted.logprobs] == drafted.token_ids


def test_bad_adjustments_are_refused_in_one_line(llm):
    for kw, match in (({"repetition_penalty": 0.0}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence"),
                      ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
                      ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {5: 101}}, "logit_bias"),
                      ({"logit_bias": {5: float("nan")}}, "logit_bias"), ({"top_n": 3}, "unknown sampling")):
        with pytest.raises(InvalidArgument, match=match):
            llm.generate("Hi", max_tokens=2, **kw)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        llm.generate("Hi", max_tokens=2, logit_bias={llm.args.vocab_size: 1.0})


def test_entries_and_ties():
    rows = np.asarray([[0.0, 1.0, 1.0, -np.inf], [np.nan, 2.0, 0.0, 2.0]], np.float32)
    lp = log_softmax(rows)
    assert np.allclose(np.exp(lp).sum(axis=1), 1.0) and lp[0, 3] == -np.inf and lp[1, 0] == -np.inf
    assert _top_ids(lp, 2)[0] == [1, 2]            # ties in id order
    assert _top_ids(lp, 3)[1] == [1, 3, 2]
    e = entries(rows, [0, 2], 0)
    assert e[0].top == () and e[1].token == 2 and abs(e[1].logprob - lp[1, 2]) < 1e-6
    dead = log_softmax(np.full((1, 4), -np.inf, np.float32))
    assert np.all(dead == -np.inf)


def test_host_logits_counts_its_picks():
    p = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, logprobs=1)
    h = HostLogits(p, [0], 4)
    row = np.zeros(4, np.float32)
    assert np.array_equal(h.adjust(row), row)
    assert h.picked(2).token == 2
    h.adjust(row)
    h.picked(2)
    assert np.allclose(h.adjust(row), [0, 0, -2.5, 0])
    with pytest.raises(InvalidArgument, match="vocabulary of 4"):
        h.adjust(np.zeros(5, np.float32))


@pytest.mark.parametrize("gpus", ["0", "0,0"])
def test_the_gpu_runner_picks_on_the_host_as_the_cpu_does(fake, llm, gpus):
    """CudaRunner.pick(host=...) (emulated) and a two-card split: the CPU's greedy tokens, logprobs within
    TOL, the logits row downloaded (no device pick launched for those requests) and prompt logprobs."""
    gpu = LLM(device="cuda", gpus=gpus, **({"layer_split": "2,4"} if "," in gpus else {}))
    ids = llm.tokenizer.encode(PROMPT)
    kw = dict(max_tokens=16, frequency_penalty=1.0, repetition_penalty=1.2, logit_bias={ids[-1]: -3.0}, logprobs=2)
    want, fake.launches[:] = llm.generate(ids, **kw), []
    got = gpu.generate(ids, **kw)
    assert got.token_ids == want.token_ids
    assert np.allclose([e.logprob for e in got.logprobs], [e.logprob for e in want.logprobs], atol=TOL)
    assert not any(k in fake.launches for k in ("strata_argmax_f32", "strata_sample_f32"))
    p_want = llm.generate(ids, max_tokens=0, prompt_logprobs=1).prompt_logprobs
    p_got = gpu.generate(ids, max_tokens=0, prompt_logprobs=1).prompt_logprobs
    assert [e and e.token for e in p_got] == [e and e.token for e in p_want]
    # the prompt path's GEMMs round otherwise than the CPU's: exact against the GPU's own logits
    own = log_softmax(gpu.logits(ids))
    assert np.allclose([e.logprob for e in p_got[1:]], own[np.arange(len(ids) - 1), ids[1:]], atol=1e-6)
    assert np.allclose([e.logprob for e in p_got[1:]], [e.logprob for e in p_want[1:]], atol=1e-2)
    # and a plain request after them still picks on the device, the tokens unchanged
    assert gpu.generate(ids, max_tokens=6).token_ids == llm.generate(ids, max_tokens=6).token_ids


def test_batched_slots_pick_on_the_host_from_their_own_rows(fake):
    """--parallel 3 on the emulated GPU: slots whose requests adjust their logits and slots that pick
    on the device share batched steps; each request's tokens and logprobs are its own alone."""
    from strata.engine.scheduler import Request
    prompts = ["the cat sat on the mat.", "Write one line about the sea.", "def add(a, b):"]
    kws = [dict(logprobs=2, frequency_penalty=1.0), {}, dict(logit_bias=((5, 3.0),), logprobs=0)]
    one = LLM(device="cuda", max_context=96)
    want = []
    for p, kw in zip(prompts, kws):
        one.runner.reset()
        want.append(one.generate(p, max_tokens=8, **kw))
    par = LLM(device="cuda", parallel=3, max_context=96)
    sizes = []
    batch = par.runner.decode_batch
    par.runner.decode_batch = lambda slots, tokens: (sizes.append(len(slots)), batch(slots, tokens))
    reqs = [par.scheduler.submit(Request(par.tokenizer.encode(p), SamplingParams(max_tokens=8, **kw)))
            for p, kw in zip(prompts, kws)]
    for r in reqs:
        assert list(par.scheduler.drive(r))[-1][0] == "done"
    assert max(sizes) == 3
    for r, w in zip(reqs, want):
        assert r.completion.token_ids == w.token_ids
        if w.logprobs is not None:
            assert np.allclose([e.logprob for e in r.completion.logprobs], [e.logprob for e in w.logprobs], atol=TOL)


def test_top_ids_are_a_stable_sorts_first_k():
    """_top_ids's k argmax passes give the k largest, ties in id order, as a whole stable sort would:
    rows with ties, -inf entries and rows of nothing else."""
    rng = np.random.default_rng(5)
    for trial in range(200):
        V, k = int(rng.choice([3, 7, 50, 1000])), int(rng.integers(0, 25))
        x = np.round(rng.standard_normal((4, V)), 1).astype(np.float32)
        if trial % 5 == 0:
            x[:, ::2] = -np.inf
        if trial % 7 == 0:
            x[:] = -np.inf
        got = _top_ids(x, k)
        for r in range(4):
            assert got[r] == [int(t) for t in np.lexsort((np.arange(V), -x[r]))[:min(k, V)]], (trial, r)

