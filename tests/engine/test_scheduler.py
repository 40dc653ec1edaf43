"""The scheduler (strata/engine/scheduler.py): a bounded queue, admission in arrival order, one step
per busy slot per loop iteration, cancellation, per-request events and timings; and strata.LLM
through it (requests back to back, from several threads, give the tokens each gives alone)."""
import threading

import pytest

from strata.config import SamplingParams
from strata.engine.scheduler import QueueFull, Request, Scheduler
from strata.engine.types import Completion, Delta, Usage
from strata.errors import InvalidArgument, StrataError
from tests.engine.threads import in_threads


class FakeWork:
    """A stand-in for strata.LLM's Generation: one Delta per next(), max_tokens of them (token i of a
    prompt [p, ...] is p + i), .cancel() and .completion as the real one has."""

    def __init__(self, ids, params, log):
        self.ids, self.n, self.log = ids, params.max_tokens, log
        self.out, self.cancelled, self.completion = [], False, None

    def __iter__(self):
        return self

    def __next__(self):
        if self.completion is not None:
            raise StopIteration
        if self.cancelled or len(self.out) == self.n:
            reason = "cancelled" if self.cancelled else "length"
            self.completion = Completion("".join(map(str, self.out)), self.out, reason, Usage(len(self.ids),
                                                                                              len(self.out)))
            raise StopIteration
        token = self.ids[0] + len(self.out)
        self.out.append(token)
        self.log.append(("step", self.ids[0], token))
        return Delta(str(token), token)

    def cancel(self):
        self.cancelled = True


def fake_scheduler(queue_size=4, **kwargs):
    log = []

    def begin(ids, params, on_progress=None, **extra):
        log.append(("begin", ids[0], extra))
        return FakeWork(ids, params, log)
    return Scheduler(begin, queue_size, **kwargs), log


def request(first: int, n: int = 3, **kwargs) -> Request:
    return Request([first], SamplingParams(max_tokens=n), **kwargs)


def run_all(s: Scheduler) -> int:
    steps = 0
    while s.step():
        steps += 1
    return steps


def test_full_queue_is_a_clear_error_and_frees_when_admitted():
    s, _ = fake_scheduler(queue_size=2)
    s.submit(request(10)), s.submit(request(20))
    with pytest.raises(QueueFull, match="queue is full") as info:
        s.submit(request(30))
    assert isinstance(info.value, StrataError) and s.queue_depth() == 2
    s.step()                                   # the first is admitted into the one slot...
    s.submit(request(30))                      # ...which leaves room in the queue
    assert s.queue_depth() == 2
    with pytest.raises(ValueError):
        Scheduler(lambda *a, **k: None, queue_size=0)


def test_requests_run_in_arrival_order_one_step_per_iteration():
    s, log = fake_scheduler()
    reqs = [s.submit(request(first)) for first in (10, 20, 30)]
    steps = run_all(s)
    assert [e[1] for e in log if e[0] == "begin"] == [10, 20, 30]
    # one slot: each request's steps run together, 3 tokens + the end step each
    assert [e[1:] for e in log if e[0] == "step"] == [(f, f + i) for f in (10, 20, 30) for i in range(3)]
    assert steps == 12
    for r, first in zip(reqs, (10, 20, 30)):
        kinds = [k for k, _ in r.inbox]
        assert kinds == ["delta"] * 3 + ["done"] and r.state == "done"
        assert r.completion.token_ids == [first, first + 1, first + 2]
        assert [d.token_id for k, d in r.inbox if k == "delta"] == r.completion.token_ids


def test_cancel_while_waiting_leaves_the_queue_without_events():
    s, log = fake_scheduler()
    a, b = s.submit(request(10)), s.submit(request(20))
    assert s.cancel(b) is True and s.queue_depth() == 1 and b.state == "cancelled"
    run_all(s)
    assert not b.inbox and all(e[1] != 20 for e in log)
    assert a.completion.finish_reason == "length"


def test_cancel_while_running_stops_at_the_next_step():
    s, log = fake_scheduler()
    a = s.submit(request(10, n=100))
    s.step(), s.step()                         # two tokens out
    assert s.cancel(a) is False                # not waiting: it stops at its next step
    run_all(s)
    assert a.completion.finish_reason == "cancelled" and a.completion.token_ids == [10, 11]
    assert [k for k, _ in a.inbox][-1] == "done" and s.running() == []


def test_cancel_after_admission_before_the_first_step_begins_nothing():
    s, log = fake_scheduler()
    a = s.submit(request(10))
    s._admit()
    a.cancelled.set()
    run_all(s)
    assert log == [] and not a.inbox and a.state == "cancelled"


def test_an_engine_error_ends_that_request_only():
    calls = []

    def begin(ids, params, on_progress=None, **extra):
        calls.append(ids[0])
        if ids[0] == 20:
            raise InvalidArgument("bad request")
        return FakeWork(ids, params, [])
    seen = []
    s = Scheduler(begin, on_event=lambda r, kind, payload: seen.append((r.prompt_ids[0], kind)))
    a, b, c = (s.submit(request(f)) for f in (10, 20, 30))
    run_all(s)
    assert calls == [10, 20, 30]
    assert b.inbox[-1][0] == "error" and isinstance(b.inbox[-1][1], InvalidArgument) and b.state == "error"
    assert a.completion.token_ids == [10, 11, 12] and c.completion.token_ids == [30, 31, 32]
    assert (20, "error") in seen and seen.count((10, "done")) == 1      # the hook sees every event


def test_constraint_and_speculate_reach_begin():
    s, log = fake_scheduler()
    marker = object()
    s.submit(request(10, constraint=marker, speculate=False))
    s.submit(request(20))
    run_all(s)
    extras = [e[2] for e in log if e[0] == "begin"]
    assert extras == [{"constraint": marker, "speculate": False}, {}]


def test_timings_and_progress_are_recorded():
    def begin(ids, params, on_progress=None, **extra):
        on_progress(2, 5)
        on_progress(5, 5)
        return FakeWork(ids, params, [])
    s = Scheduler(begin)
    r = s.submit(request(10))
    run_all(s)
    assert (r.prompt_done, r.prompt_total, r.prompt_chunk, r.num_tokens) == (5, 5, 3, 3)
    t = r.times_ms()
    assert t["queue_ms"] >= 0 and 0 <= t["first_token_ms"] <= t["duration_ms"]
    assert r.admitted <= r.first_token <= r.finished


def test_run_serves_a_thread_until_stop():
    s, _ = fake_scheduler()
    thread = threading.Thread(target=s.run, daemon=True)
    thread.start()
    reqs = [s.submit(request(f)) for f in (10, 20)]
    for r in reqs:
        assert list(s.drive(r))[-1][0] == "done"       # driving alongside the thread is safe too
    s.stop()
    thread.join(5)
    assert not thread.is_alive()


# ---- strata.LLM through the scheduler, on the tiny model ----

@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    pytest.importorskip("torch")            # tests.fixtures builds the tiny pack with it
    from strata import LLM
    from tests.fixtures import SHAPES, make_pack
    path, _ = make_pack(tmp_path_factory.mktemp("sched"), SHAPES["tiny"], seed=5)
    llm = LLM(path, device="cpu")
    llm.tokenizer.eos_token_ids = []        # every reply runs to max_tokens
    return llm


PROMPTS = ["def add(a, b):", "import os\n", "hello world"]


def test_back_to_back_requests_give_the_tokens_of_one_at_a_time(llm):
    alone = []
    for p in PROMPTS:
        llm.runner.reset()
        alone.append(llm.generate(p, max_tokens=8, temperature=0.8, seed=3).token_ids)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3)
    reqs = [llm.scheduler.submit(Request(llm.tokenizer.encode(p), params)) for p in PROMPTS]
    for r in reversed(reqs):        # driving the last steps the ones before it too, in order
        events = list(llm.scheduler.drive(r))
        assert events[-1][0] == "done"
    assert [r.completion.token_ids for r in reqs] == alone
    for r in reqs:
        t = r.completion.timings
        assert t.prompt_ms > 0 and t.predicted_ms > 0 and t.predicted_n == 8
        assert t.to_dict()["predicted_per_second"] > 0 and (t.draft_n, t.draft_n_accepted) == (0, 0)
        assert r.times_ms()["first_token_ms"] is not None


def test_generate_from_several_threads_queues_them(llm):
    want = {p: llm.generate(p, max_tokens=6).token_ids for p in PROMPTS}
    got, errors = in_threads(lambda p: llm.generate(p, max_tokens=6).token_ids, PROMPTS)
    assert not errors and got == want
    assert llm.scheduler.queue_depth() == 0 and llm.scheduler.running() == []


def test_a_stream_left_early_is_cancelled(llm):
    it = llm.stream("count:", max_tokens=50)
    next(it)
    it.close()
    left = llm.scheduler.running()
    assert [r.cancelled.is_set() for r in left] == [True]     # it ends at the next step, whoever steps
    assert llm.generate("count:", max_tokens=3).usage.completion_tokens == 3
    assert left[0].completion.finish_reason == "cancelled" and left[0].completion.usage.completion_tokens < 50
    assert llm.scheduler.running() == [] and llm.scheduler.queue_depth() == 0


def test_speculation_counts_come_out_and_a_request_may_opt_out():
    from strata import LLM
    llm = LLM(device="cpu", mtp=True, spec=2)      # the demo model has an MTP layer
    plain = llm.scheduler.submit(Request(llm.tokenizer.encode("Once upon a time"),
                                         SamplingParams(max_tokens=16), speculate=False))
    list(llm.scheduler.drive(plain))
    spec = llm.generate("Once upon a time", max_tokens=16)
    assert plain.completion.timings.draft_n == 0 and spec.timings.draft_n > 0
    assert 0 <= spec.timings.draft_n_accepted <= spec.timings.draft_n
    assert spec.token_ids == plain.completion.token_ids          # greedy: drafting changes no token
