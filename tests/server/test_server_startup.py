"""`serve` start-up: the address is checked before the model loads, every failure is one line on
stderr and exit 2, and the warm-up leaves no trace in the prefix cache, the metrics or the Monitor."""
import socket
import subprocess
import sys

import httpx
import pytest

from strata.errors import InvalidArgument
from strata.server import create_app
from strata.server.cli import bind_address
from tests.server.helpers import LiveServer, endless_llm, tiny_pack


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def serve(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "strata", "serve", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line(r, match):
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata: error: ") and match in lines[0], r.stderr


@pytest.mark.parametrize("flags, match", [
    (["--port", "99999"], "--port 99999: a TCP port is 1 to 65535"),
    (["--port", "-1"], "--port -1"),
    (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid': cannot be resolved"),
    (["--host", "192.0.2.1"], "--host 192.0.2.1: not an address of this machine"),
])
def test_bad_address_fails_before_the_model_loads(tmp_path, flags, match):
    # the model does not exist: had it been loaded first, that would be the error
    assert_one_line(serve(str(tmp_path / "missing"), *flags), match)


def test_port_in_use_fails_before_the_model_loads(tmp_path, busy_port):
    r = serve(str(tmp_path / "missing"), "--port", str(busy_port))
    assert_one_line(r, f"127.0.0.1:{busy_port} is already in use")


@pytest.mark.parametrize("flags, match", [
    (["--port", "abc"], "argument --port: invalid int value: 'abc'"),
    (["--queue-size", "0"], "--queue-size and --max-body-bytes must be positive"),
    (["--spec", "2"], "--spec 2 needs --mtp: the model's MTP layer is the only drafter"),
    (["--device", "tpu"], "device must be cpu, cuda or auto"),
    (["--max-context", "-5"], "max_context"),
])
def test_bad_flags_are_one_line(busy_port, flags, match):
    # the busy port proves the flags are checked before the address
    assert_one_line(serve("--port", str(busy_port), *flags), match)


def test_missing_model_is_one_line(tmp_path):
    with bind_address("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
    assert_one_line(serve(str(tmp_path / "missing"), "--port", str(port)), "missing")


def test_bind_address():
    sock = bind_address("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert port > 0
        sock.listen()
        with pytest.raises(InvalidArgument, match="already in use"):
            bind_address("127.0.0.1", port)
    finally:
        sock.close()
    with pytest.raises(InvalidArgument, match="--port 65536"):
        bind_address("127.0.0.1", 65536)
    bind_address("localhost", 0).close()


def test_warm_up_leaves_no_trace(tmp_path):
    llm = endless_llm(tiny_pack(tmp_path))
    cache = llm.runner.ops.cache
    assert cache.bytes == 0                       # nothing dequantized at load
    live = LiveServer(create_app(llm))
    try:
        warmed = (cache.bytes, len(cache._items))
        assert warmed[0] > 0
        assert llm.runner.cached_ids == [] and llm.runner.reusable_prefix([1, 2, 3]) == 0
        status = httpx.get(live.url + "/v1/status").json()
        assert status["requests"] == [] and status["totals"]["requests"] == 0 and status["totals"]["prompt_tokens"] == 0
        metrics = httpx.get(live.url + "/metrics").text
        assert "strata_prompt_tokens_total 0.0" in metrics and "strata_completion_tokens_total 0.0" in metrics
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # the first request dequantized nothing the warm-up had not
        assert (cache.bytes, len(cache._items)) == warmed
    finally:
        live.close()
