"""The request queue and step loop that strata.LLM and the server share.

Requests wait in a bounded queue (a full one raises QueueFull), are admitted in arrival order into
free slots, and every loop iteration advances each busy slot by one step: its first step reads the
prompt and picks the first token, each later one gives the next token (a decode step, or the next of
a speculative window's tokens). A slot's work is what `begin` returns for the request (strata.LLM's
Generation: an iterator of Deltas with .cancel() and .completion), so the scheduler never touches the
device and is tested on a CPU with a stand-in.

With `--parallel N` there are N slots (strata.engine.slots: each keeps its own KV and cached
conversation). A request goes to the free slot `choose` names (the longest reusable prefix, the
least recently used among equals). Each iteration first gathers the slots whose next step is a
plain decode step (their work's `pending` token: "ready") and runs them in batched steps (`batch`)
grouped by the batch rule (strata.engine.batching: --batch-max N, or 0 for the grouping whose
measured steps cost least): a group's step runs, then its slots pick their tokens from that step's
logits, then the next group's; a group of one row steps itself. Every ready row steps once an
iteration whatever the grouping, and the groups start at a slot that turns each iteration, so no
slot always waits for the others. The rule is told each group's time (the clock, from the step to
its rows' picks). Then every other busy slot advances. A prompt is read a chunk per iteration (the
work yields PROMPT_CHUNK between chunks), so a long prompt in one slot does not hold up the other
slots' tokens. Prompts that wait to be read together are read in one forward: a work that would
read its whole prompt in one pass yields PROMPT_READY instead (when told `batch_prompt`), and at
the end of the iteration `batch_prompts` reads the waiting ones together (strata.LLM: the runner's
prefill_batch, every weight and expert read once for all of them: several agents' short turns,
or clients that arrive at once); then each picks its first token. One waiting alone reads itself.

Events go to `Request.emit` (kind, payload): "delta" (a Delta), then "done" (the Completion) or
"error" (the exception); a request cancelled while it waits leaves the queue with no event.
"""
from __future__ import annotations

import collections
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..config import SamplingParams
from ..errors import StrataError
from .batching import FixedBatch

DEFAULT_QUEUE_SIZE = 64


class _PromptChunk:
    def __repr__(self):
        return "PROMPT_CHUNK"


PROMPT_CHUNK = _PromptChunk()   # a work's next() that read a prompt chunk and has no token yet


class _PromptReady:
    def __repr__(self):
        return "PROMPT_READY"


PROMPT_READY = _PromptReady()   # a work's next() whose prompt waits to be read (its prompt_start set)


class QueueFull(StrataError):
    """The wait queue is at its bound: retry once a request has finished."""

    def __init__(self, queue_size: int):
        super().__init__(f"the request queue is full ({queue_size} requests waiting)")
        self.queue_size = queue_size


@dataclass(eq=False)
class Request:
    """One request: what to generate, and what the scheduler records as it runs."""
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    constraint: Any = None          # a strata.engine.grammar.TokenConstraint: every pick obeys its mask
    speculate: bool = True          # False: plain decode steps even where the runner drafts (--spec)
    created: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # written by the scheduler
    state: str = "queued"           # queued | reading | generating, then done | cancelled | error
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    prompt_done: int = 0
    prompt_total: int = 0
    prompt_chunk: int = 0           # largest step between progress reports: the chunk the prompt ran with
    num_tokens: int = 0
    completion: Any = None
    inbox: collections.deque = field(default_factory=collections.deque)
    # the scheduler's answers to waits() while this request waits to begin, per request it could wait for
    waits_on: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.prompt_total = self.prompt_total or len(self.prompt_ids)

    def emit(self, kind: str, payload: Any = None) -> None:
        """Where events go (on the stepping thread); the server's Job sends them to its event loop."""
        self.inbox.append((kind, payload))

    def times_ms(self) -> dict:
        """Wall times of the request so far: queued, to the first token, in all (None: not reached)."""
        now = time.monotonic()
        ms = lambda a, b: None if a is None or b is None else (b - a) * 1e3     # noqa: E731
        return {"queue_ms": ms(self.created, self.admitted or now),
                "first_token_ms": ms(self.created, self.first_token),
                "duration_ms": ms(self.created, self.finished or now)}


@dataclass(eq=False)
class Slot:
    """A sequence being generated: its request and its work (None until its first step begins it)."""
    index: int = 0
    request: Request | None = None
    work: Iterator | None = None

    @property
    def free(self) -> bool:
        return self.request is None


class Scheduler:
    """begin(prompt_ids, params, on_progress=..., constraint=..., speculate=..., slot=...) starts a
    slot's work (strata.LLM.begin; slot only with more than one). on_event(request, kind, payload),
    if given, sees every event before the request does, on the stepping thread (the server's
    bookkeeping). choose(prompt_ids, free slot indices) -> the slot a request goes to (default: the
    first free one). batch(works) runs one decode step for the works whose `pending` token is set
    and clears it (strata.LLM: the runner's decode_batch); without it each work steps alone.
    batch_rule groups the ready rows (strata.engine.batching; default: all in one step); clock()
    -> seconds, what the rule's step times are read from (a test's fake clock). waits(slot index,
    prompt_ids, prompt_ids another slot is reading) -> whether an admitted request should start only
    once that slot has read its prompt (its prefix then copied between the slots: n choices of one
    prompt, agents' requests of one long system prompt); default: never. batch_prompts(works) reads
    the prompts of the works whose `prompt_start` is set (they yielded PROMPT_READY), together where
    it can, marking those it read (strata.LLM: the runner's prefill_batch); without it each reads alone."""

    def __init__(self, begin: Callable[..., Iterator], queue_size: int = DEFAULT_QUEUE_SIZE, num_slots: int = 1,
                 on_event: Callable[[Request, str, Any], None] | None = None,
                 choose: Callable[[list[int], list[int]], int] | None = None,
                 batch: Callable[[list], None] | None = None, batch_rule: FixedBatch | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 waits: Callable[[int, list[int], list[int]], bool] | None = None,
                 batch_prompts: Callable[[list], None] | None = None):
        if queue_size < 1 or num_slots < 1:
            raise ValueError(f"queue_size and num_slots must be >= 1, got {queue_size} and {num_slots}")
        self.begin, self.queue_size, self.on_event = begin, queue_size, on_event
        self.choose, self.batch, self.clock, self.waits = choose, batch, clock, waits
        self.batch_prompts = batch_prompts
        self.batch_rule = batch_rule or FixedBatch(num_slots)
        self._turn = 0                          # where this iteration's groups start among the ready slots
        self.slots = [Slot(i) for i in range(num_slots)]
        self._waiting: collections.deque[Request] = collections.deque()
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()      # one stepping thread at a time
        self._stopping = False
        # set to a deque to record each iteration: (seconds in all, [(rows, seconds) of each batched
        # group's step], seconds of the slots that stepped alone, of prompts read together); None: off
        self.trace: collections.deque | None = None

    # ---- any thread ----

    def submit(self, request: Request) -> Request:
        with self._cond:
            if len(self._waiting) >= self.queue_size:
                raise QueueFull(self.queue_size)
            self._waiting.append(request)
            self._cond.notify_all()
        return request

    def cancel(self, request: Request) -> bool:
        """Stop a request: one still waiting leaves the queue (-> True); a running one ends at its next
        step with finish_reason "cancelled"."""
        request.cancelled.set()
        with self._cond:
            if request not in self._waiting:
                return False
            self._waiting.remove(request)
            request.state, request.finished = "cancelled", time.monotonic()
            return True

    def queue_depth(self) -> int:
        return len(self._waiting)

    def running(self) -> list[Request]:
        return [r for r in (s.request for s in self.slots) if r is not None]

    def stop(self) -> None:
        """Cancel everything; `run` returns once the running requests have ended."""
        with self._cond:
            self._stopping = True
            now = time.monotonic()
            for request in self._waiting:
                request.cancelled.set()
                request.state, request.finished = "cancelled", now
            self._waiting.clear()
            for request in self.running():
                request.cancelled.set()
            self._cond.notify_all()

    # ---- the step loop ----

    def step(self) -> bool:
        """One loop iteration: admit waiting requests into free slots, then advance every busy slot
        by one step. -> whether any slot ran."""
        with self._step_lock:
            tracing = self.trace is not None
            t0 = self.clock() if tracing else 0.0
            self._admit()
            busy = [s for s in self.slots if not s.free]
            ready = self._ready(busy)
            start, groups = 0, []
            for size in self.batch_rule.groups(len(ready)) if ready else ():
                groups.append((size, self._step_group(ready[start:start + size])))
                start += size
            t1 = self.clock() if tracing else 0.0
            for slot in busy:
                if slot not in ready and not slot.free:
                    self._advance(slot)
            t2 = self.clock() if tracing else 0.0
            self._read_prompts(busy)
            if tracing and busy:
                t3 = self.clock()
                self.trace.append((t3 - t0, groups, t2 - t1, t3 - t2))
            return bool(busy)

    def run(self) -> None:
        """Step until stop() (the server's engine thread), sleeping while there is nothing to do."""
        while True:
            with self._cond:
                while not self._waiting and not self.running() and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self.running():
                    return
            self.step()

    def drive(self, request: Request) -> Iterator[tuple[str, Any]]:
        """The request's events, stepping the loop on this thread whenever none is ready (strata.LLM's
        way: whoever waits steps, so calls from several threads share the queue). Leaving early
        cancels the request."""
        try:
            while True:
                ended = request.finished is not None     # read first: its last event is in the inbox by then
                while request.inbox:
                    yield request.inbox.popleft()
                if ended:
                    return
                self.step()
        finally:
            if request.finished is None:
                self.cancel(request)

    def _admit(self) -> None:
        with self._cond:
            while self._waiting and not self._stopping:
                free = [s.index for s in self.slots if s.free]
                if not free:
                    return
                request = self._waiting.popleft()
                index = free[0] if self.choose is None or len(free) == 1 else self.choose(request.prompt_ids, free)
                request.state, request.admitted = "reading", time.monotonic()
                self.slots[index].request = request

    def _ready(self, busy: list[Slot]) -> list[Slot]:
        """The busy slots whose next step is a plain decode step, from a slot that turns each
        iteration (none without `batch`: each work then steps alone)."""
        if self.batch is None:
            return []
        ready = [s for s in busy if s.work is not None and getattr(s.work, "pending", None) is not None
                 and not s.request.cancelled.is_set()]
        if not ready:
            return ready
        self._turn = (self._turn + 1) % len(self.slots)
        k = next((i for i, s in enumerate(ready) if s.index >= self._turn), 0)
        return ready[k:] + ready[:k]

    def _step_group(self, group: list[Slot]) -> float:
        """One batched decode step for the group's rows (a lone row steps itself), then their picks,
        before the next group's step (a row count's graph writes every step's logits to one buffer);
        the rule is told its time. An engine fault in the batched step ends the group's requests.
        -> its seconds (the iteration trace's)."""
        t0 = self.clock()
        if len(group) > 1:
            try:
                self.batch([s.work for s in group])
            except BaseException as e:
                self._fail(group, e)
                return self.clock() - t0
        for slot in group:
            self._advance(slot)
        seconds = self.clock() - t0
        self.batch_rule.observe(len(group), seconds * 1e3)
        return seconds

    def _read_prompts(self, busy: list[Slot]) -> None:
        """The slots whose prompts wait to be read (PROMPT_READY this iteration): read together where
        batch_prompts can, an engine fault there ending their requests; then each slot advances to its
        first token (a prompt left unread reads itself alone then)."""
        waiting = [s for s in busy if not s.free and getattr(s.work, "prompt_start", None) is not None]
        live = [s for s in waiting if not s.request.cancelled.is_set()]
        if self.batch_prompts is not None and len(live) > 1:
            try:
                self.batch_prompts([s.work for s in live])
            except BaseException as e:
                self._fail(live, e)
        for slot in waiting:
            if not slot.free:
                self._advance(slot)

    def _fail(self, slots: list[Slot], e: BaseException) -> None:
        """An engine fault in a step the slots shared ends their requests (an interrupt goes on up)."""
        for slot in slots:
            self._emit(slot.request, "error", e)
            self._free(slot, "error")
        if not isinstance(e, Exception):
            raise e

    def _advance(self, slot: Slot) -> None:
        request = slot.request
        try:
            if slot.work is None:
                if request.cancelled.is_set():          # dropped between admission and its first step
                    return self._free(slot, "cancelled")
                if self._waiting_for_prefix(slot):
                    return
                slot.work = self._begin(request)
            elif request.cancelled.is_set():
                slot.work.cancel()                      # its iterator ends at this step
            delta = next(slot.work)
        except StopIteration:
            request.completion = slot.work.completion
            self._emit(request, "done", request.completion)
            return self._free(slot, "done")
        except BaseException as e:                       # an engine fault ends this request only
            return self._fail([slot], e)
        if delta is PROMPT_CHUNK or delta is PROMPT_READY:      # a chunk read, or a prompt waiting: no token yet
            return
        if request.first_token is None:
            request.first_token, request.state = time.monotonic(), "generating"
        request.num_tokens += 1
        self._emit(request, "delta", delta)

    def _waiting_for_prefix(self, slot: Slot) -> bool:
        """Whether slot's request waits for another slot that is reading a prompt (begun, no token yet)
        whose prefix it would copy (self.waits). The slots waited for have begun, so waits never
        form a cycle; each ends when that prompt is read or its request ends."""
        if self.waits is None:
            return False
        request = slot.request
        for other in self.slots:
            theirs = other.request
            if (other is slot or other.work is None or theirs is None or theirs.first_token is not None
                    or getattr(theirs.params, "prompt_logprobs", None) is not None):   # a scoring pass keeps
                continue                                                             # no cells to copy
            key = (id(theirs), theirs.admitted)      # asked once a pair: a prompt's comparison is O(its length)
            if key not in request.waits_on:
                request.waits_on[key] = self.waits(slot.index, request.prompt_ids, theirs.prompt_ids)
            if request.waits_on[key]:
                return True
        return False

    def _begin(self, request: Request) -> Iterator:
        extra = {} if request.constraint is None else {"constraint": request.constraint}
        if not request.speculate:
            extra["speculate"] = False
        if len(self.slots) > 1:
            extra["slot"] = next(s.index for s in self.slots if s.request is request)
        work = self.begin(request.prompt_ids, request.params, on_progress=functools.partial(_progress, request),
                          **extra)
        if hasattr(work, "yield_chunks"):
            work.yield_chunks = True     # PROMPT_CHUNK between a prompt's chunks: other slots step meanwhile
        if self.batch_prompts is not None and hasattr(work, "batch_prompt"):
            work.batch_prompt = True     # PROMPT_READY before a prompt read in one pass: read with others
        return work

    def _emit(self, request: Request, kind: str, payload: Any) -> None:
        if self.on_event is not None:
            self.on_event(request, kind, payload)
        request.emit(kind, payload)

    def _free(self, slot: Slot, state: str) -> None:
        request = slot.request
        slot.request = slot.work = None
        request.state, request.finished = state, time.monotonic()   # finished last: drive() reads it first
        with self._cond:
            self._cond.notify_all()


def _progress(request: Request, done: int, total: int) -> None:
    request.prompt_chunk = max(request.prompt_chunk, done - request.prompt_done)
    request.prompt_done, request.prompt_total = done, total
