"""logprobs, echo, logit_bias and the penalties through the OpenAI routes on the demo model: the
bodies' shapes as the openai client parses them, their values against a second copy of the model
driven through strata.LLM, and the streamed entries equal to the whole reply's."""
import json
import math

import httpx
import pytest

import strata
from strata.engine.logits import log_softmax

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
CHAT = [{"role": "user", "content": "Write one line about the sea."}]


@pytest.fixture(scope="module")
def ref():
    """The demo model again, for expected values (the served one is the server's thread's)."""
    return strata.LLM(device="cpu")


def _sse(server, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + route, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_chat_logprobs_are_the_models(demo_client, demo_llm, ref):
    r = demo_client.chat.completions.create(model=demo_llm.model_name, messages=CHAT, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens > 0
    assert b"".join(bytes(e.bytes) for e in content).decode() == choice.message.content
    ids = ref.tokenizer.encode(ref.tokenizer.apply_chat_template(CHAT))
    want = ref.generate(ids, max_tokens=12, logprobs=3)
    # the served model may reuse a cached prefix of the template (other tests' chats): rounding apart
    assert [e.logprob for e in content] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    for e, w in zip(content, want.logprobs):
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert [bytes(t.bytes) for t in e.top_logprobs] == [ref.tokenizer.token_bytes(t) for t, _ in w.top]
    plain = demo_client.chat.completions.create(model=demo_llm.model_name, messages=CHAT, max_tokens=12, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content


def test_streamed_chat_logprobs_equal_the_whole_replys(demo_server, demo_client, demo_llm):
    body = {"model": demo_llm.model_name, "messages": CHAT, "max_tokens": 16, "temperature": 0.8, "seed": 11,
            "logprobs": True, "top_logprobs": 2}
    # The first request primes the server's prefix cache, so the two compared below read the prompt alike: a
    # prompt read whole and one read from a cached prefix round apart (1e-6), and which the first request
    # meets depends on the tests that ran before it on this server (under pytest-xdist, on which worker).
    httpx.post(demo_server.url + "/v1/chat/completions", json=body, timeout=120).raise_for_status()
    whole = httpx.post(demo_server.url + "/v1/chat/completions", json=body, timeout=120).json()
    frames = _sse(demo_server, "/v1/chat/completions", body)
    streamed = [e for f in frames for c in f["choices"] if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert streamed == whole["choices"][0]["logprobs"]["content"]
    text = "".join(c["delta"].get("content") or "" for f in frames for c in f["choices"])
    assert text == whole["choices"][0]["message"]["content"]


def test_echo_scores_the_prompt(demo_server, demo_client, demo_llm, ref):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0."""
    r = demo_client.completions.create(model=demo_llm.model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    ids = ref.tokenizer.encode(PROMPT)
    assert r.choices[0].text == PROMPT and len(lp.tokens) == len(ids) and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = log_softmax(ref.logits(ids))
    for i in range(1, len(ids)):
        assert math.isclose(lp.token_logprobs[i], want[i - 1, ids[i]], abs_tol=1e-6)
        assert len(lp.top_logprobs[i]) == 1 and max(lp.top_logprobs[i].values()) >= lp.token_logprobs[i] - 1e-9
    assert all(PROMPT[o:o + len(t)] == t for o, t in zip(lp.text_offset, lp.tokens))
    # with a reply: the prompt's entries, then the reply's, the text the prompt's and the reply's
    r2 = demo_client.completions.create(model=demo_llm.model_name, prompt=PROMPT, max_tokens=4, echo=True,
                                        logprobs=2, temperature=0)
    lp2 = r2.choices[0].logprobs
    assert r2.choices[0].text.startswith(PROMPT) and len(lp2.tokens) == len(ids) + r2.usage.completion_tokens
    assert lp2.token_logprobs[:len(ids)] == lp.token_logprobs
    assert "".join(lp2.tokens) == r2.choices[0].text
    streamed = _sse(demo_server, "/v1/completions", {"model": demo_llm.model_name, "prompt": PROMPT, "max_tokens": 4,
                                                     "echo": True, "logprobs": 2, "temperature": 0})
    assert streamed[0]["choices"][0]["text"] == PROMPT
    joined = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for f in streamed:
        for c in f["choices"]:
            for k in joined:
                joined[k] += (c.get("logprobs") or {}).get(k, [])
    assert joined == {k: getattr(lp2, k) for k in joined}
    text_only = demo_client.completions.create(model=demo_llm.model_name, prompt=PROMPT, max_tokens=2, echo=True,
                                               temperature=0)
    assert text_only.choices[0].text.startswith(PROMPT) and text_only.choices[0].logprobs is None


def test_bias_and_penalties_reach_the_engine(demo_client, demo_llm, ref):
    ids = ref.tokenizer.encode(PROMPT)
    forced = next(t for t in range(300, 400) if t not in ref.tokenizer.eos_token_ids)
    r = demo_client.completions.create(model=demo_llm.model_name, prompt=ids, max_tokens=4, temperature=1.0, seed=1,
                                       logit_bias={str(forced): 100}, logprobs=0)
    assert r.choices[0].text == ref.tokenizer.decode([forced] * 4)
    kw = {"frequency_penalty": 1.5, "presence_penalty": 0.5}
    r = demo_client.completions.create(model=demo_llm.model_name, prompt=ids, max_tokens=16, temperature=0, **kw)
    want = ref.generate(ids, max_tokens=16, **kw)
    assert r.choices[0].text == want.text != ref.generate(ids, max_tokens=16).text
    r = demo_client.completions.create(model=demo_llm.model_name, prompt=ids, max_tokens=16, temperature=0,
                                       extra_body={"repeat_penalty": 1.5})
    assert r.choices[0].text == ref.generate(ids, max_tokens=16, repetition_penalty=1.5).text
