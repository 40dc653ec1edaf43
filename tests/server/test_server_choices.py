"""n choices and a completions batch of prompts: each choice is the request it stands for sent alone
(choice i of a seeded request draws from seed + i), in index order, streamed interleaved with one
usage frame and one [DONE], and a request whose choices do not all fit the queue queues none."""
import json
import threading
import time

import httpx
import pytest

from strata.server import create_app
from tests.server.helpers import GatedLLM, LiveServer

CHAT = "/v1/chat/completions"
COMPLETE = "/v1/completions"
MSGS = [{"role": "user", "content": "Write one line about the sea."}]


def _post(server, route, body):
    r = httpx.post(server.url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _sse(server, route, body) -> list[dict]:
    with httpx.stream("POST", server.url + route, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines.count("[DONE]") == 1 and lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_n_seeded_choices_are_the_seeds_alone(server):
    body = {"messages": MSGS, "max_tokens": 6, "temperature": 1.0, "seed": 40}
    many = _post(server, CHAT, {**body, "n": 3})
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    alone = [_post(server, CHAT, {**body, "seed": 40 + i}) for i in range(3)]
    assert [c["message"]["content"] for c in many["choices"]] == [a["choices"][0]["message"]["content"] for a in alone]
    assert many["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]       # the prompt counts once
    assert many["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)


def test_a_batch_of_prompts_times_n(server, llm):
    prompts = ["The cat", "A dog ran", [5, 6, 7, 8]]
    body = {"prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 0, "logprobs": 1, "echo": True}
    many = _post(server, COMPLETE, body)
    assert [c["index"] for c in many["choices"]] == list(range(6))
    for i, p in enumerate(prompts):
        alone = _post(server, COMPLETE, {**body, "prompt": p, "n": 1})["choices"][0]
        for choice in many["choices"][2 * i:2 * i + 2]:
            assert choice["text"] == alone["text"] and choice["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
    lengths = [len(p) if isinstance(p, list) else len(llm.tokenizer.encode(p)) for p in prompts]
    assert many["usage"]["prompt_tokens"] == sum(lengths)


def test_choices_stream_interleaved_with_one_end(server):
    body = {"prompt": ["The cat", "A dog ran"], "n": 2, "max_tokens": 5, "temperature": 0.9, "seed": 3,
            "stream_options": {"include_usage": True}}
    _post(server, COMPLETE, body)      # primes the prefix cache: the two compared below read the prompts alike
    whole = _post(server, COMPLETE, body)
    frames = _sse(server, COMPLETE, body)
    texts, finishes = {}, {}
    for f in frames:
        for c in f["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                assert c["index"] not in finishes
                finishes[c["index"]] = c["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]} and len(finishes) == 4
    usage = [f["usage"] for f in frames if f.get("usage")]
    assert usage == [whole["usage"]] and frames[-1]["choices"] == []
    chat = _sse(server, CHAT, {"messages": MSGS, "n": 2, "max_tokens": 4, "temperature": 0})
    roles = [c["index"] for f in chat for c in f["choices"] if c["delta"].get("role")]
    assert sorted(roles) == [0, 1]


def test_choices_that_do_not_fit_the_queue_queue_none(llm):
    """A queue of 3 with one request running and one waiting: 3 choices find 2 places (503, and the
    ones queued are taken back); 4 could never wait whole (400 naming n)."""
    gated = GatedLLM(llm)
    live = LiveServer(create_app(gated, queue_size=3, warm_up=False))
    try:
        with httpx.Client(base_url=live.url, timeout=60) as client:
            held = [threading.Thread(target=client.post, args=(COMPLETE,),
                                     kwargs={"json": {"prompt": "hold", "max_tokens": 2}}) for _ in range(2)]
            held[0].start()
            deadline = time.monotonic() + 10
            while client.get("/v1/status").json()["slots"]["busy"] == 0:       # the engine holds it
                assert time.monotonic() < deadline
            held[1].start()
            while client.get("/v1/status").json()["queue"]["depth"] == 0:      # the second waits
                assert time.monotonic() < deadline
            r = client.post(COMPLETE, json={"prompt": "x", "n": 3, "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
            assert client.get("/v1/status").json()["queue"]["depth"] == 1
            r = client.post(COMPLETE, json={"prompt": "x", "n": 4, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n"
            gated.gate.set()
            for t in held:
                t.join(30)
            assert _post(live, COMPLETE, {"prompt": "x", "n": 2, "max_tokens": 2})["usage"]["completion_tokens"] == 4
    finally:
        gated.gate.set()
        live.close()


@pytest.mark.parametrize("n", [1, 2])
def test_structured_choices_each_get_their_own_grammar(server, n):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}},
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = _post(server, CHAT, {"messages": MSGS, "n": n, "max_tokens": 32, "temperature": 1.0, "seed": 5,
                             "response_format": fmt})
    for c in r["choices"]:          # a grammar shared by two replies would refuse the second's first token
        text = c["message"]["content"]
        assert text.startswith('{"a":'), text
        if c["finish_reason"] == "stop":
            assert set(json.loads(text)) == {"a"}


def test_best_of_returns_the_likeliest_replies(server):
    """best_of 3, n 2 (seeded): the two of the three replies the seeds give alone with the highest mean
    log-probability per token, likeliest first; every reply's tokens counted in usage."""
    body = {"prompt": "The cat", "max_tokens": 6, "temperature": 1.0, "seed": 7}
    alone = [_post(server, COMPLETE, {**body, "seed": 7 + i, "logprobs": 0})["choices"][0] for i in range(3)]
    mean = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"]) for c in alone]
    order = sorted(range(3), key=lambda i: (-mean[i], i))[:2]
    got = _post(server, COMPLETE, {**body, "best_of": 3, "n": 2})
    assert [c["text"] for c in got["choices"]] == [alone[i]["text"] for i in order]
    assert [c["index"] for c in got["choices"]] == [0, 1] and all(c["logprobs"] is None for c in got["choices"])
    assert got["usage"]["completion_tokens"] == 18

