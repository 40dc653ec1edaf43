"""Bad input gets a 4xx with an OpenAI-style error naming the field, and the server keeps serving."""
import json
import threading
import time

import httpx
import pytest

from strata.server import create_app
from tests.server.helpers import GatedLLM, LiveServer

CHAT = "/v1/chat/completions"
COMPLETE = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]

# (route, body, status, param, code)
CASES = [
    (CHAT, {"messages": "hello"}, 400, "messages", "invalid_type"),
    (CHAT, {"messages": []}, 400, "messages", "invalid_type"),
    (CHAT, {}, 400, "messages", "missing_required_parameter"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": 42}]}, 400, "messages[0].content", "invalid_type"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0].type", "unsupported_parameter"),
    (CHAT, {"messages": MSGS, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    (CHAT, {"messages": MSGS, "temperature": 7}, 400, "temperature", "invalid_value"),
    (CHAT, {"messages": MSGS, "top_p": 1.5}, 400, "top_p", "invalid_value"),
    (CHAT, {"messages": MSGS, "top_k": 2.5}, 400, "top_k", "invalid_type"),
    (CHAT, {"messages": MSGS, "seed": "abc"}, 400, "seed", "invalid_type"),
    (CHAT, {"messages": MSGS, "stream": "yes"}, 400, "stream", "invalid_type"),
    (CHAT, {"messages": MSGS, "stop": 5}, 400, "stop", "invalid_type"),
    (CHAT, {"messages": MSGS, "stop": [""]}, 400, "stop", "invalid_value"),
    (CHAT, {"messages": MSGS, "max_tokens": "10"}, 400, "max_tokens", "invalid_type"),
    (CHAT, {"messages": MSGS, "max_tokens": -5}, 400, "max_tokens", "invalid_value"),
    (CHAT, {"messages": MSGS, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    (CHAT, {"messages": MSGS, "max_tokens": 10**12}, 400, "max_tokens", "invalid_value"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": -1}, 400, "max_completion_tokens", "invalid_value"),
    (CHAT, {"messages": MSGS, "model": "gpt-9"}, 404, "model", "model_not_found"),
    (CHAT, {"messages": MSGS, "n": 17}, 400, "n", "invalid_value"),
    (CHAT, {"messages": MSGS, "n": 0}, 400, "n", "invalid_value"),
    (CHAT, {"messages": MSGS, "logprobs": "yes"}, 400, "logprobs", "invalid_type"),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
    (CHAT, {"messages": MSGS, "tools": {"name": "f"}}, 400, "tools", "invalid_type"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, 400,
     "tools[0].function.name", "invalid_value"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, 400,
     "tools[0].function.parameters", "invalid_type"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, 400,
     "tools[1].function.name", "invalid_value"),
    (CHAT, {"messages": MSGS, "tool_choice": "required"}, 400, "tool_choice", "invalid_value"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice", "invalid_value"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}], "tool_choice": "required"}, 400,
     "tools", "invalid_schema"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]}, 400,
     "messages[0].tool_calls[0]", "invalid_type"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "xml"}}, 400, "response_format.type", "invalid_value"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}, 400,
     "response_format.json_schema", "invalid_type"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, 400, "response_format", "invalid_schema"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "enum": ["x" * 70000]}}}}, 400, "response_format", "invalid_schema"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_object"}, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, 400, "response_format",
     "invalid_value"),
    (CHAT, {"messages": MSGS, "frequency_penalty": 2.5}, 400, "frequency_penalty", "invalid_value"),
    (CHAT, {"messages": MSGS, "presence_penalty": "a"}, 400, "presence_penalty", "invalid_type"),
    (CHAT, {"messages": MSGS, "repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value"),
    (CHAT, {"messages": MSGS, "repetition_penalty": 1.1, "repeat_penalty": 1.2}, 400, "repeat_penalty",
     "invalid_value"),
    (CHAT, {"messages": MSGS, "logit_bias": [5]}, 400, "logit_bias", "invalid_type"),
    (CHAT, {"messages": MSGS, "logit_bias": {"x5": 10}}, 400, "logit_bias", "invalid_value"),
    (CHAT, {"messages": MSGS, "logit_bias": {"99999999": 10}}, 400, "logit_bias", "invalid_value"),
    (CHAT, {"messages": MSGS, "logit_bias": {"5": 101}}, 400, "logit_bias", "invalid_value"),
    (CHAT, {"messages": MSGS, "logit_bias": {"5": "up"}}, 400, "logit_bias", "invalid_value"),
    (CHAT, {"messages": MSGS, "logit_bias": {str(i): 1 for i in range(1025)}}, 400, "logit_bias", "invalid_value"),
    (CHAT, {"messages": MSGS, "stream": False, "stream_options": 3}, 400, "stream_options", "invalid_type"),
    (COMPLETE, {"prompt": ""}, 400, "prompt", "invalid_value"),
    (COMPLETE, {"prompt": {"text": "x"}}, 400, "prompt", "invalid_type"),
    (COMPLETE, {"prompt": [1, "a"]}, 400, "prompt", "invalid_type"),
    (COMPLETE, {"prompt": [10**9]}, 400, "prompt", "invalid_value"),
    (COMPLETE, {"prompt": ["one", ""]}, 400, "prompt", "invalid_value"),
    (COMPLETE, {"prompt": ["one", {"a": 1}]}, 400, "prompt", "invalid_type"),
    (COMPLETE, {"prompt": ["one", [10**9]]}, 400, "prompt", "invalid_value"),
    (COMPLETE, {"prompt": ["x"] * 9, "n": 2}, 400, "prompt", "invalid_value"),
    (COMPLETE, {"prompt": "x", "echo": 1}, 400, "echo", "invalid_type"),
    (COMPLETE, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    (COMPLETE, {"prompt": "x", "best_of": 2, "n": 3}, 400, "best_of", "invalid_value"),
    (COMPLETE, {"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of", "invalid_value"),
    (COMPLETE, {"prompt": "x", "best_of": 17}, 400, "best_of", "invalid_value"),
    (COMPLETE, {"prompt": ["x", "y"], "best_of": 9}, 400, "prompt", "invalid_value"),
    (COMPLETE, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    (COMPLETE, {"prompt": "x", "logprobs": True}, 400, "logprobs", "invalid_type"),
    (COMPLETE, {"prompt": "x", "suffix": "tail"}, 400, "suffix", "unsupported_parameter"),   # no FIM tokens
    (COMPLETE, {"prompt": "x", "suffix": 5}, 400, "suffix", "invalid_type"),
    (COMPLETE, {"prompt": "x", "suffix": "tail", "echo": True}, 400, "suffix", "invalid_value"),
    (COMPLETE, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    (COMPLETE, {"prompt": "x", "model": "nope"}, 404, "model", "model_not_found"),
]


def assert_error(r: httpx.Response, status: int, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param and param.split("[")[0].split(".")[0] in err["message"]
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize("route,body,status,param,code", CASES)
def test_bad_field_is_named(server, route, body, status, param, code):
    r = httpx.post(server.url + route, json=body)
    assert_error(r, status, param, code)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_body(server, raw):
    r = httpx.post(server.url + CHAT, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, code="invalid_json")


def test_prompt_longer_than_the_context(server, llm):
    ids = [7] * llm.max_context
    assert_error(httpx.post(server.url + COMPLETE, json={"prompt": ids, "max_tokens": 4}), 400, "prompt",
                 "context_length_exceeded")
    long_text = "lorem ipsum dolor " * llm.max_context
    assert_error(httpx.post(server.url + CHAT, json={"messages": [{"role": "user", "content": long_text}]}),
                 400, "messages", "context_length_exceeded")


def test_body_size_limit(server):
    big = json.dumps({"prompt": "x" * (5 << 20)}).encode()
    json_type = {"content-type": "application/json"}
    assert_error(httpx.post(server.url + COMPLETE, content=big, headers=json_type), 413, code="request_too_large")

    def chunks():      # no Content-Length: the limit is enforced while reading
        for _ in range(6):
            yield b" " * (1 << 20)
    assert_error(httpx.post(server.url + COMPLETE, content=chunks(), headers=json_type), 413,
                 code="request_too_large")


def test_unknown_fields_are_ignored_and_server_keeps_serving(server, llm):
    body = {"model": llm.model_name, "messages": MSGS, "max_tokens": 3, "temperature": 0, "user": "u1",
            "vendor_extension": {"a": 1}, "repetition_penalty": 1.1, "frequency_penalty": 0, "n": 1,
            "tool_choice": "none", "parallel_tool_calls": False, "store": False}
    r = httpx.post(server.url + CHAT, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_unknown_route_and_method(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404, code="not_found")
    assert_error(httpx.get(server.url + CHAT), 405, code="method_not_allowed")


def test_api_key_required_on_v1_routes(llm):
    from openai import AuthenticationError, OpenAI
    live = LiveServer(create_app(llm, api_key="s3cret"))
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            for route in ("/v1/models", "/v1/status", "/metrics"):
                assert_error(httpx.get(live.url + route, headers=headers), 401, code="invalid_api_key")
            assert_error(httpx.post(live.url + COMPLETE, json={"prompt": "x"}, headers=headers), 401)
        assert httpx.get(live.url + "/health").status_code == 200
        key = {"Authorization": "Bearer s3cret"}
        assert httpx.get(live.url + "/metrics", headers=key).text.startswith("# HELP")
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=live.url + "/v1", api_key="nope", max_retries=0).models.list()
        good = OpenAI(base_url=live.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=llm.model_name, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        live.close()


def wait_for(url, predicate, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = httpx.get(url + "/v1/status").json()
        if predicate(status):
            return status
        time.sleep(0.02)
    raise AssertionError("the server never reached the expected state")


def test_full_queue_answers_503_with_retry_after(llm):
    gated = GatedLLM(llm)
    live = LiveServer(create_app(gated, queue_size=1))
    results = []
    body = {"prompt": "queued", "max_tokens": 3, "temperature": 0}
    post = lambda: results.append(httpx.post(live.url + COMPLETE, json=body, timeout=60))  # noqa: E731
    try:
        first = threading.Thread(target=post)
        first.start()
        wait_for(live.url, lambda s: s["current"] is not None)      # the engine holds the first
        second = threading.Thread(target=post)
        second.start()
        status = wait_for(live.url, lambda s: s["queue"]["depth"] == 1)
        assert status["state"] in ("reading", "queued")
        r = httpx.post(live.url + COMPLETE, json=body)
        assert_error(r, 503, code="queue_full")
        assert int(r.headers["retry-after"]) >= 1
        gated.gate.set()
        first.join(30), second.join(30)
        assert [x.status_code for x in results] == [200, 200]
        assert httpx.post(live.url + COMPLETE, json=body).status_code == 200
    finally:
        gated.gate.set()
        live.close()


class FaultyLLM:
    """An LLM whose generations fail after their first token while `fail` is set."""

    def __init__(self, llm):
        self._llm, self.fail = llm, True

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def begin(self, *args, **kwargs):
        gen = self._llm.begin(*args, **kwargs)
        if not self.fail:
            return gen

        def broken():
            yield next(gen)
            raise RuntimeError("simulated engine fault")
        return broken()


def test_engine_fault_is_reported_and_serving_continues(llm):
    faulty = FaultyLLM(llm)
    live = LiveServer(create_app(faulty))
    body = {"prompt": "fault", "max_tokens": 4, "temperature": 0}
    try:
        err = assert_error(httpx.post(live.url + COMPLETE, json=body), 500, code="engine_error")
        assert "simulated engine fault" in err["message"] and err["type"] == "server_error"
        with httpx.stream("POST", live.url + COMPLETE, json={**body, "stream": True}) as r:
            frames = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert '"engine_error"' in frames[-2] and frames[-1] == "data: [DONE]"
        status = httpx.get(live.url + "/v1/status").json()
        assert status["state"] == "error" and "simulated engine fault" in status["last_error"]
        assert status["totals"]["errors"] == 2
        faulty.fail = False
        assert httpx.post(live.url + COMPLETE, json=body).json()["usage"]["completion_tokens"] == 4
        assert httpx.get(live.url + "/v1/status").json()["state"] == "idle"
        assert httpx.get(live.url + "/health").json()["status"] == "ok"
    finally:
        live.close()


def test_streamed_request_dropped_while_queued_leaves_the_queue(llm):
    gated = GatedLLM(llm)
    live = LiveServer(create_app(gated, queue_size=4))
    body = {"prompt": "waiting", "max_tokens": 3, "temperature": 0}
    results = []
    try:
        first = threading.Thread(target=lambda: results.append(httpx.post(live.url + COMPLETE, json=body, timeout=60)))
        first.start()
        wait_for(live.url, lambda s: s["current"] is not None)
        with httpx.stream("POST", live.url + COMPLETE, json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            wait_for(live.url, lambda s: s["queue"]["depth"] == 1)
        status = wait_for(live.url, lambda s: s["queue"]["depth"] == 0)   # the hang-up took it off the queue
        assert status["totals"]["cancelled"] == 1
        gated.gate.set()
        first.join(30)
        assert results[0].status_code == 200
        assert httpx.get(live.url + "/v1/status").json()["totals"]["requests"] == 1
    finally:
        gated.gate.set()
        live.close()
