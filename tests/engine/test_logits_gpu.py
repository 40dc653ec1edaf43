"""Penalties, logit_bias and logprobs on a real GPU (strata.engine.logits): the demo model on CUDA
brings each pick's logits row to the host; its picks are the penalised argmax of that row's
reference adjustment, and its logprobs are the log-softmax of the GPU's own logits for the sequence
within the one-row step's rounding; prompt logprobs equal the GPU's logits_all rows."""
import numpy as np
import pytest

from strata.config import SamplingParams
from strata.engine.logits import log_softmax

pytestmark = pytest.mark.gpu

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"


def test_adjusted_picks_and_logprobs_on_the_gpu():
    import strata
    from tests.engine.test_logits_host import reference_adjusted
    llm = strata.LLM(device="cuda")
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(20, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3,
                            logit_bias=((ids[-1], -2.0),), logprobs=3)
    gen = llm.begin(ids, params)
    for _ in gen:
        pass
    got = gen.completion
    assert got.token_ids != llm.generate(ids, max_tokens=20).token_ids      # the adjustment mattered
    for i, (token, entry) in enumerate(zip(got.token_ids, got.logprobs)):
        raw = llm.logits(ids + got.token_ids[:i])[-1]
        adjusted = reference_adjusted(raw, ids, got.token_ids[:i], params)
        assert adjusted[token] >= adjusted.max() - 5e-2, (i, token)          # prompt path vs step rounding
        assert abs(entry.logprob - log_softmax(raw)[token]) < 5e-2
    prompt_lp = llm.generate(ids, max_tokens=0, prompt_logprobs=1).prompt_logprobs
    own = log_softmax(llm.logits(ids))
    assert np.allclose([e.logprob for e in prompt_lp[1:]], own[np.arange(len(ids) - 1), ids[1:]], atol=1e-6)
