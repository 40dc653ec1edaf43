"""The engine thread: the one thread that drives the model, fed by a bounded queue of jobs.

Requests are tokenized on the HTTP side and become Jobs; the engine thread runs them one at a time
and hands text deltas back to the asyncio loop with call_soon_threadsafe. A job whose client went
away is cancelled between tokens (or dropped while still queued).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..config import SamplingParams
from ..errors import StrataError

log = logging.getLogger("strata.server")
RECENT_REQUESTS = 20


class QueueFull(Exception):
    """The wait queue is at its bound; the client should retry after `retry_after_s`."""

    def __init__(self, retry_after_s: int):
        super().__init__(f"the request queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Job:
    """One request on its way through the engine; events go to `events` on `loop`."""
    kind: str
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    stream: bool = False            # only streamed jobs are sent their text deltas
    constraint: Any = None          # a strata.engine.grammar.TokenConstraint (structured output, forced tool calls)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.monotonic)

    def emit(self, kind: str, payload: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:        # the loop is closed: the server is shutting down
            self.cancelled.set()


@dataclass
class Live:
    """What the engine is doing right now (read by /v1/status from the HTTP thread)."""
    job: Job
    state: str = "reading"          # reading | generating
    prompt_done: int = 0
    prompt_total: int = 0
    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    num_tokens: int = 0
    prompt_chunk: int = 0           # largest step between progress reports: the chunk the prompt ran with


class EngineWorker:
    def __init__(self, llm, queue_size: int, metrics=None):
        self.llm = llm
        self.queue_size = queue_size
        self.metrics = metrics
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._live: Live | None = None
        self.recent: collections.deque[dict] = collections.deque(maxlen=RECENT_REQUESTS)
        self.totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
                       "errors": 0, "cancelled": 0, "rejected": 0}
        self.last_error: str | None = None
        self.engine_status: dict = self._llm_status() or {}
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)

    # ---- HTTP side ----

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            for job in self._waiting:
                job.cancelled.set()
            if self._live is not None:
                self._live.job.cancelled.set()
            self._cond.notify_all()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        with self._cond:
            if len(self._waiting) >= self.queue_size:
                self.totals["rejected"] += 1
                raise QueueFull(self._retry_after_s())
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job if it waits, or stop it at the next token."""
        job.cancelled.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self.totals["cancelled"] += 1

    def queue_depth(self) -> int:
        return len(self._waiting)

    def _retry_after_s(self) -> int:
        durations = [r["duration_ms"] for r in self.recent]
        mean_s = sum(durations) / len(durations) / 1e3 if durations else 1.0
        return int(min(60, max(1, round(mean_s * (len(self._waiting) + 1)))))

    # ---- engine thread ----

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._waiting.popleft()
                self._live = Live(job, prompt_total=len(job.prompt_ids))
            try:
                self._run_job(job)
            finally:
                self._live = None

    def _run_job(self, job: Job) -> None:
        live = self._live
        before = self.engine_status
        if job.cancelled.is_set():
            return
        try:
            extra = {} if job.constraint is None else {"constraint": job.constraint}
            gen = self.llm.begin(job.prompt_ids, job.params, on_progress=self._on_progress, **extra)
            for delta in gen:
                if live.first_token is None:
                    live.first_token, live.state = time.monotonic(), "generating"
                live.num_tokens += 1
                if job.cancelled.is_set():
                    gen.cancel()        # the iterator ends at its next step
                elif delta.text and job.stream:
                    job.emit("delta", delta.text)
            completion = gen.completion
        except StrataError as e:
            if self.metrics:
                self.metrics.count_request(job.kind, "invalid")
            job.emit("error", e)        # bad input the HTTP side could not see (answered as 400)
            return
        except Exception as e:     # an engine fault: report it, keep serving
            log.exception("request failed in the engine")
            self.last_error = f"{type(e).__name__}: {e}"
            with self._cond:
                self.totals["errors"] += 1
            if self.metrics:
                self.metrics.count_request(job.kind, "error")
            job.emit("error", e)
            return
        self.last_error = None
        self.engine_status = self._llm_status() or before
        self._record(job, live, completion, before)
        job.emit("done", completion)

    def _on_progress(self, done: int, total: int) -> None:
        live = self._live
        if live is not None:
            live.prompt_chunk = max(live.prompt_chunk, done - live.prompt_done)
            live.prompt_done, live.prompt_total = done, total

    def _record(self, job: Job, live: Live, completion, before: dict) -> None:
        u, t = completion.usage, completion.timings
        end = time.monotonic()
        row = {
            "kind": job.kind, "finished_at": time.time(), "finish_reason": completion.finish_reason,
            "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
            "completion_tokens": u.completion_tokens,
            "prompt_tps": t.prompt_n / (t.prompt_ms / 1e3) if t.prompt_ms > 0 else None,
            "decode_tps": t.predicted_n / (t.predicted_ms / 1e3) if t.predicted_ms > 0 else None,
            "hit_rate": _hit_rate_between(before, self.engine_status),
            "queue_ms": (live.started - job.created) * 1e3, "duration_ms": (end - job.created) * 1e3,
            "prefill_chunk": live.prompt_chunk or self.engine_status.get("prefill_chunk"),
            "prefill_ring": self.engine_status.get("prefill_ring"),
            "draft_n": t.draft_n, "draft_n_accepted": t.draft_n_accepted,
            "draft_acceptance": t.draft_n_accepted / t.draft_n if t.draft_n else None,
        }
        with self._cond:
            self.recent.appendleft(row)
            for k in ("prompt_tokens", "cached_tokens", "completion_tokens"):
                self.totals[k] += row[k]
            self.totals["requests"] += 1
            if completion.finish_reason == "cancelled":
                self.totals["cancelled"] += 1
        if self.metrics:
            self.metrics.observe(job.kind, completion, row, live, self.engine_status)

    # ---- status ----

    def _llm_status(self) -> dict | None:
        try:
            return self.llm.status()
        except Exception:      # status is advisory; a failure must not take a request down
            log.exception("llm.status() failed")
            return None

    def snapshot(self) -> dict:
        """The server's own part of /v1/status (safe to call from any thread)."""
        live, depth = self._live, len(self._waiting)
        state = live.state if live else ("queued" if depth else ("error" if self.last_error else "idle"))
        current = None
        if live is not None:
            now = time.monotonic()
            decoding_s = now - live.first_token if live.first_token else 0.0
            current = {"kind": live.job.kind, "prompt_done": live.prompt_done,
                       "prompt_total": live.prompt_total, "tokens": live.num_tokens,
                       "elapsed_ms": (now - live.started) * 1e3,
                       "decode_tps": (live.num_tokens - 1) / decoding_s if decoding_s > 0 else None}
        with self._cond:
            recent, totals = list(self.recent), dict(self.totals)
        last_tps = next((r["decode_tps"] for r in recent if r["decode_tps"]), None)
        last_prompt = next(({"chunk": r["prefill_chunk"], "ring": r["prefill_ring"], "tokens_read":
                             r["prompt_tokens"] - r["cached_tokens"]} for r in recent), None)
        return {"state": state, "queue": {"depth": depth, "max": self.queue_size}, "current": current,
                "tokens_per_second": (current or {}).get("decode_tps") or last_tps, "last_prompt": last_prompt,
                "totals": totals, "last_error": self.last_error, "requests": recent}

    def live_engine_status(self) -> dict:
        """llm.status() now, or the snapshot the engine thread took after the last request."""
        status = self._llm_status()
        return status if status is not None else dict(self.engine_status)


def _hit_rate_between(before: dict, after: dict) -> float | None:
    """Expert-cache hit rate over one request, from the cache's cumulative hit/miss counters."""
    b, a = (before or {}).get("expert_cache") or {}, (after or {}).get("expert_cache") or {}
    if "hits" in a and "misses" in a:
        hits = a["hits"] - b.get("hits", 0)
        total = hits + a["misses"] - b.get("misses", 0)
        return hits / total if total > 0 else None
    return a.get("hit_rate")
