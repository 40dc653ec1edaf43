"""The engine thread: it runs the scheduler's step loop (strata.engine.scheduler) over the bounded
queue of jobs, and keeps the server's record of what ran.

Requests are tokenized on the HTTP side and become Jobs; the engine thread runs them through the
scheduler's slots and hands their events back to the asyncio loop with call_soon_threadsafe. A job
whose client went away is cancelled between tokens (or dropped while still queued).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine.scheduler import QueueFull, Request, Scheduler
from ..errors import StrataError

log = logging.getLogger("strata.server")
RECENT_REQUESTS = 20


@dataclass(eq=False)
class Job(Request):
    """One HTTP request in the scheduler; its events go to `events` on `loop`."""
    kind: str = "completion"
    loop: asyncio.AbstractEventLoop | None = None
    stream: bool = False            # only streamed jobs are sent their text deltas
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def emit(self, kind: str, payload: Any = None) -> None:
        if kind == "delta":
            wants_entries = self.params.logprobs is not None or self.params.prompt_logprobs is not None
            if not self.stream or not (payload.text or wants_entries and payload.logprob is not None):
                return
            if not wants_entries:       # the writers take text; a Delta where it carries logprobs
                payload = payload.text
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:        # the loop is closed: the server is shutting down
            self.cancelled.set()


class EngineWorker:
    def __init__(self, llm, queue_size: int, metrics=None):
        self.llm = llm
        self.queue_size = queue_size
        self.metrics = metrics
        new = getattr(llm, "new_scheduler", None)    # the model's --parallel slots (a stand-in may have none)
        self.scheduler = (new(queue_size, on_event=self._on_event, begin=llm.begin) if new is not None
                          else Scheduler(llm.begin, queue_size, on_event=self._on_event))
        self._lock = threading.Lock()
        self.recent: collections.deque[dict] = collections.deque(maxlen=RECENT_REQUESTS)
        self.totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
                       "errors": 0, "cancelled": 0, "rejected": 0}
        self.last_error: str | None = None
        self.engine_status: dict = self._llm_status() or {}
        self._thread = threading.Thread(target=self.scheduler.run, name="strata-engine", daemon=True)

    # ---- HTTP side ----

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.scheduler.stop()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        """Queue the job; QueueFull when the queue is at its bound (retry_after_s() says when to come back)."""
        try:
            self.scheduler.submit(job)
        except QueueFull:
            with self._lock:
                self.totals["rejected"] += 1
            raise

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job if it waits, or stop it at the next token."""
        if self.scheduler.cancel(job):
            with self._lock:
                self.totals["cancelled"] += 1

    def queue_depth(self) -> int:
        return self.scheduler.queue_depth()

    def retry_after_s(self) -> int:
        durations = [r["duration_ms"] for r in self.recent]
        mean_s = sum(durations) / len(durations) / 1e3 if durations else 1.0
        return int(min(60, max(1, round(mean_s * (self.queue_depth() + 1)))))

    # ---- engine thread ----

    def _on_event(self, job: Job, kind: str, payload: Any) -> None:
        """Before the job hears of its end: the record, the counters and the metrics."""
        if kind == "done":
            before, self.last_error = self.engine_status, None
            self.engine_status = self._llm_status() or before
            self._record(job, payload, before)
        elif kind == "error" and isinstance(payload, StrataError):
            if self.metrics:       # bad input the HTTP side could not see (answered as 400)
                self.metrics.count_request(job.kind, "invalid")
        elif kind == "error":      # an engine fault: report it, keep serving
            log.error("request failed in the engine", exc_info=payload)
            self.last_error = f"{type(payload).__name__}: {payload}"
            with self._lock:
                self.totals["errors"] += 1
            if self.metrics:
                self.metrics.count_request(job.kind, "error")

    def _record(self, job: Job, completion, before: dict) -> None:
        u, t = completion.usage, completion.timings
        times = job.times_ms()
        row = {
            "kind": job.kind, "finished_at": time.time(), "finish_reason": completion.finish_reason,
            "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
            "completion_tokens": u.completion_tokens,
            "prompt_tps": t.prompt_n / (t.prompt_ms / 1e3) if t.prompt_ms > 0 else None,
            "decode_tps": t.predicted_n / (t.predicted_ms / 1e3) if t.predicted_ms > 0 else None,
            "hit_rate": _hit_rate_between(before, self.engine_status),
            "queue_ms": times["queue_ms"], "duration_ms": times["duration_ms"],
            "prefill_chunk": job.prompt_chunk or self.engine_status.get("prefill_chunk"),
            "prefill_ring": self.engine_status.get("prefill_ring"),
            "draft_n": t.draft_n, "draft_n_accepted": t.draft_n_accepted,
            "draft_acceptance": t.draft_n_accepted / t.draft_n if t.draft_n else None,
            "draft_room": t.draft_room,
        }
        with self._lock:
            self.recent.appendleft(row)
            for k in ("prompt_tokens", "cached_tokens", "completion_tokens"):
                self.totals[k] += row[k]
            self.totals["requests"] += 1
            if completion.finish_reason == "cancelled":
                self.totals["cancelled"] += 1
        if self.metrics:
            self.metrics.observe(job.kind, completion, row, job, self.engine_status)

    # ---- status ----

    def _llm_status(self) -> dict | None:
        try:
            return self.llm.status()
        except Exception:      # status is advisory; a failure must not take a request down
            log.exception("llm.status() failed")
            return None

    def snapshot(self) -> dict:
        """The server's own part of /v1/status (safe to call from any thread)."""
        running, depth = self.scheduler.running(), self.queue_depth()
        live = next((r for r in running if r.state in ("reading", "generating")), None)
        state = live.state if live else ("queued" if depth else ("error" if self.last_error else "idle"))
        current = None
        if live is not None:
            now = time.monotonic()
            decoding_s = now - live.first_token if live.first_token else 0.0
            current = {"kind": live.kind, "prompt_done": live.prompt_done,
                       "prompt_total": live.prompt_total, "tokens": live.num_tokens,
                       "elapsed_ms": (now - (live.admitted or now)) * 1e3,
                       "decode_tps": (live.num_tokens - 1) / decoding_s if decoding_s > 0 else None}
        with self._lock:
            recent, totals = list(self.recent), dict(self.totals)
        last_tps = next((r["decode_tps"] for r in recent if r["decode_tps"]), None)
        last_prompt = next(({"chunk": r["prefill_chunk"], "ring": r["prefill_ring"], "tokens_read":
                             r["prompt_tokens"] - r["cached_tokens"]} for r in recent), None)
        return {"state": state, "queue": {"depth": depth, "max": self.queue_size}, "current": current,
                "slots": {"busy": len(running), "total": len(self.scheduler.slots)},
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
