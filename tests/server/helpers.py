"""Test helpers: a live uvicorn server on 127.0.0.1, the tiny model, and wrappers that hold the engine."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import numpy as np


class LiveServer:
    """The app under real uvicorn on a free loopback port, in a thread."""

    def __init__(self, app):
        import uvicorn
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
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


def tiny_llm(tmp_path: Path, max_context: int = 1024):
    """The tiny test model as a strata.LLM on the CPU."""
    try:
        from strata.pack import convert  # noqa: F401
    except ImportError:
        return _stand_in_llm(tmp_path, max_context)
    import strata
    from tests.fixtures import SHAPES, make_pack
    path, _ = make_pack(tmp_path, SHAPES["tiny"], seed=int(np.random.default_rng().integers(1 << 30)))
    return strata.LLM(str(path), device="cpu", max_context=max_context)


# ---- until strata.pack lands: the real LLM, Generation and tokenizer over a table-lookup "model" ----

class _TableRunner:
    """CpuRunner's interface; next-token logits are a random table lookup on the last two tokens."""
    device = "cpu"

    def __init__(self, vocab_size: int, eos: list[int], max_context: int, seed: int):
        rng = np.random.default_rng(seed)
        self.w1 = rng.standard_normal((vocab_size, vocab_size)).astype(np.float32) * 3
        self.w2 = rng.standard_normal((vocab_size, vocab_size)).astype(np.float32)
        self.w1[:, eos] -= 20.0          # replies run to max_tokens unless a stop string ends them
        self.max_context, self.cached_ids, self.prefill_chunk = max_context, [], 512

    def _logits(self) -> np.ndarray:
        ids = self.cached_ids
        return self.w1[ids[-1]] + (self.w2[ids[-2]] if len(ids) > 1 else 0)

    def reusable_prefix(self, ids):
        n = 0
        for a, b in zip(self.cached_ids, ids):
            if a != b:
                break
            n += 1
        return min(n, len(ids) - 1)

    def prefill(self, ids, start, on_progress=None):
        self.cached_ids = list(ids)
        if on_progress:
            on_progress(len(ids) - start, len(ids) - start)
        self.last_chunk = len(ids) - start
        return self._logits()

    def decode(self, token):
        self.cached_ids.append(token)
        return self._logits()

    def status(self):
        return {"device": "cpu", "gpu": None, "prefill_chunk": getattr(self, "last_chunk", 0), "prefill_ring": 0,
                "expert_cache": None, "bytes_h2d": 0}


def _stand_in_llm(tmp_path: Path, max_context: int):
    from strata.config import EngineConfig
    from strata.engine.llm import LLM
    from strata.tokenizer import Tokenizer
    from tests.fixtures import CHAT_TEMPLATE, make_tokenizer
    tok = make_tokenizer(300)
    tok.save(str(tmp_path / "tokenizer.json"))
    eos = [tok.token_to_id("<|im_end|>")]
    llm = LLM.__new__(LLM)
    llm.config = EngineConfig(device="cpu", max_context=max_context)
    llm.model_name, llm.device, llm.state, llm.max_context = "tiny-stand-in", "cpu", "idle", max_context
    llm.tokenizer = Tokenizer(tmp_path / "tokenizer.json", {"eos_token_ids": eos, "chat_template": CHAT_TEMPLATE})
    llm.runner = _TableRunner(300, eos, max_context, seed=int(np.random.default_rng().integers(1 << 30)))
    llm.args = type("Args", (), {"vocab_size": 300})()
    return llm
