"""Issue #20, the server side: hostile bodies are 400s, a web page cannot drive a keyless loopback
server, idle and slow sockets cannot starve it, a runaway chat template is a 400, and a shutdown ends
open requests within a second."""
import json
import socket
import threading
import time

import httpx
import pytest

from strata.chat_template import compile_template
from strata.server import create_app
from tests.server.helpers import LiveServer, SlowLLM, endless_llm, tiny_pack
from tests.server.test_server_errors import assert_error
from tests.server.test_server_startup import assert_one_line, busy_port, serve  # noqa: F401 (a fixture)

CHAT = "/v1/chat/completions"
JSON = {"content-type": "application/json"}
MSGS = b'[{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize("raw, param, match", [
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content", "lone surrogate"),
    (b'{"messages": ' + MSGS + b', "x": {"\\udfff": 1}}', "x.\\udfff", "lone surrogate"),
    (b"[" * 2000 + b"]" * 2000, None, "nested deeper than 32"),
    (b'{"a":' * 100 + b"1" + b"}" * 100, None, "nested deeper than 32"),
    (b'{"messages": ' + MSGS + b', "seed": ' + b"9" * 5000 + b"}", None, "integer literal of 5000 digits"),
    (b'{"prompt": [' + b"7" * 4400 + b"]}", None, "integer literal"),
    (b'{"messages": ' + MSGS + b', "top_p": 0.' + b"1" * 1000 + b"}", None, "out of range"),
    (b'{"messages": ' + MSGS + b', "temperature": 1e999}', None, "out of range"),
    (b'{"messages": ' + MSGS + b', "temperature": NaN}', None, "NaN is not JSON"),
])
def test_hostile_body_is_a_400(server, raw, param, match):
    err = assert_error(httpx.post(server.url + CHAT, content=raw, headers=JSON), 400)
    assert match in err["message"] and err["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_post_needs_a_json_content_type(server, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    body = b'{"prompt": "hi", "max_tokens": 1}'
    err = assert_error(httpx.post(server.url + "/v1/completions", content=body, headers=headers), 415,
                       code="unsupported_media_type")
    assert "application/json" in err["message"]
    ok = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_host_allow_list(llm):
    live = LiveServer(create_app(llm, allowed_hosts=["localhost", "127.0.0.1", "[::1]", "box.lan"]))
    try:
        for host in ("localhost", "127.0.0.1:9", "[::1]:8080", "BOX.lan:1", f"127.0.0.1:{live.port}"):
            assert httpx.get(live.url + "/v1/models", headers={"host": host}).status_code == 200, host
        for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example", "localhost.", ""):
            for r in (httpx.get(live.url + "/v1/status", headers={"host": host}),
                      httpx.post(live.url + CHAT, json={"messages": [{"role": "user", "content": "x"}]},
                                 headers={"host": host})):
                assert_error(r, 400, "Host", "invalid_host")
    finally:
        live.close()


def test_empty_api_key_is_refused_at_start(busy_port):  # noqa: F811
    assert_one_line(serve("--port", str(busy_port), "--api-key", ""), "--api-key is empty")


def test_openapi_describes_the_request_bodies(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    for path, required in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert required in body["required"] and "max_tokens" in body["properties"]
        assert "415" in doc["paths"][path]["post"]["responses"]
    assert {"/v1/models", "/v1/status", "/health", "/metrics"} <= set(doc["paths"])


def test_runaway_chat_template_is_a_400(tmp_path):
    llm = endless_llm(tiny_pack(tmp_path))
    llm.tokenizer._template = compile_template(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    live = LiveServer(create_app(llm))
    try:
        t0 = time.monotonic()
        r = httpx.post(live.url + CHAT, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
                       timeout=30)
        assert time.monotonic() - t0 < 5
        err = assert_error(r, 400, "messages", "chat_template_error")
        assert "chat template" in err["message"] and "steps" in err["message"]
        assert httpx.post(live.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        live.close()


def _open(port: int, first_bytes: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    if first_bytes:
        s.sendall(first_bytes)
    return s


def _closed(s: socket.socket, wait_s: float) -> bool:
    """Whether the server closes `s` within wait_s (whatever it still had to say read first)."""
    deadline = time.monotonic() + wait_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            if s.recv(1 << 16) == b"":
                return True
        return False
    except socket.timeout:
        return False
    except OSError:
        return True


def test_idle_and_slow_header_sockets_are_bounded(llm):
    live = LiveServer(create_app(llm), header_timeout_s=1.0, max_connections=20)
    socks = []
    try:
        silent = _open(live.port)
        slow = _open(live.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")   # never ends its headers
        keep = _open(live.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert keep.recv(4096).startswith(b"HTTP/1.1 200")
        keep.sendall(b"GET /he")                # a second request, as slow: the timer runs again
        for s in (silent, slow, keep):
            assert _closed(s, 3.0)
        # past the cap, the oldest sockets still waiting for headers make room: normal requests get through
        socks = [_open(live.port) for _ in range(60)]
        for _ in range(3):
            assert httpx.get(live.url + "/health", timeout=5).status_code == 200
        time.sleep(0.3)
        still_open = sum(not _closed(s, 0.01) for s in socks)
        assert still_open <= 20
    finally:
        for s in socks:
            s.close()
        live.close()


def test_shutdown_ends_open_requests_within_a_second(tmp_path):
    llm = SlowLLM(endless_llm(tiny_pack(tmp_path)), token_s=0.02)
    live = LiveServer(create_app(llm, queue_size=4))
    got = {}

    def plain():
        got["plain"] = httpx.post(live.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 500}, timeout=30)

    lines = []
    with httpx.stream("POST", live.url + "/v1/completions", timeout=30,
                      json={"prompt": "once", "max_tokens": 500, "stream": True}) as r:
        it = r.iter_lines()
        while not lines:
            lines.extend(line for line in [next(it)] if line)
        waiter = threading.Thread(target=plain)
        waiter.start()
        time.sleep(0.3)     # the second request is queued behind the stream
        t0 = time.monotonic()
        live.server.should_exit = True
        lines.extend(line for line in it if line)
    live.thread.join(5)
    waiter.join(5)
    took_s = time.monotonic() - t0
    assert not live.thread.is_alive() and took_s < 1.5, took_s
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert err["code"] == "server_shutting_down" and err["type"] == "server_error"
    assert_error(got["plain"], 503, code="server_shutting_down")
