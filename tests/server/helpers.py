"""Test helpers: a live uvicorn server on 127.0.0.1, the tiny model, and wrappers that hold the engine."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np


class LiveServer:
    """The app under real uvicorn on a free loopback port, in a thread, as serve runs it (the guarded
    protocol, the drain at shutdown); kwargs go to strata.server.http.server_config."""

    def __init__(self, app, **kwargs):
        from strata.server.http import StrataServer, server_config
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = StrataServer(server_config(app, port=self.port, log_level="warning", **kwargs),
                                   getattr(app.state, "drain", None))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class GatedLLM:
    """An LLM whose next begin() waits for `gate`, so a test can hold the engine busy."""

    def __init__(self, llm):
        self._llm = llm
        self.gate = threading.Event()

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def begin(self, *args, **kwargs):
        self.gate.wait(60)
        return self._llm.begin(*args, **kwargs)


class SlowLLM:
    """An LLM that sleeps after each token, so a reply lasts long enough to be cut off mid-stream."""

    def __init__(self, llm, token_s: float):
        self._llm, self.token_s = llm, token_s

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def begin(self, *args, **kwargs):
        gen = self._llm.begin(*args, **kwargs)
        slow = _SlowGeneration(gen, self.token_s)
        return slow


class _SlowGeneration:
    def __init__(self, gen, token_s):
        self._gen, self.token_s = gen, token_s

    def __iter__(self):
        return self

    def __next__(self):
        delta = next(self._gen)
        time.sleep(self.token_s)
        return delta

    def cancel(self):
        self._gen.cancel()

    @property
    def completion(self):
        return self._gen.completion


def tiny_pack(tmp_path: Path) -> Path:
    """The tiny test model (fresh random weights) as a pack."""
    from tests.fixtures import SHAPES, make_pack
    path, _ = make_pack(tmp_path, SHAPES["tiny"], seed=int(np.random.default_rng().integers(1 << 30)))
    return path


def endless_llm(pack_path: Path, max_context: int = 1024, **engine):
    """A strata.LLM on the CPU that never stops at an end-of-sequence token.

    A random tiny model may pick EOS at any step; with EOS off every reply runs to max_tokens (or a
    stop string), so the tests know its length. EOS handling itself is the engine's, tested there.
    """
    import strata
    llm = strata.LLM(str(pack_path), device="cpu", max_context=max_context, **engine)
    llm.tokenizer.eos_token_ids = []
    return llm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(args: list[str], log: Path, env=None, wait_s: float = 60.0):
    """`python -m strata serve ARGS --port P` as a user runs it, its output in `log`; yields (proc, url)
    once /health answers 200, and terminates it after."""
    import httpx
    port = free_port()
    with open(log, "ab") as out:        # the child's own file offset; reading here must not move it
        proc = subprocess.Popen([sys.executable, "-m", "strata", "serve", *args, "--port", str(port)], env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield proc, url
    finally:
        proc.terminate()
        proc.wait(10)
