"""--parallel N slots (strata/engine/slots.py, the scheduler's batched steps): a sequence's tokens are
the same alone and batched, a request goes to the slot holding its prefix, a long prompt is read a
chunk per iteration while the other slots decode; the GPU runner's batched step on the emulated
runtime (tests/engine/fake_cuda) gives each row its own one-row step's logits (to the emulation's
summation order: numpy sums a batch of rows in another order than one row; bit for bit on the GPU,
test_parallel_gpu.py)."""
import numpy as np
import pytest

from strata.config import EngineConfig, SamplingParams
from strata.engine.batching import split
from strata.engine.scheduler import PROMPT_CHUNK, Request, Scheduler
from strata.engine.types import Completion, Delta, Usage
from strata.errors import InvalidArgument
from tests.engine.threads import in_threads
from tests.fixtures import load_tool


# ---- the scheduler with stand-in works ----

class PendingWork:
    """A stand-in Generation: `chunks` PROMPT_CHUNKs, then n tokens; its next step is a plain decode
    (pending set) after each token but the last. Tokens count the steps it was batched in."""

    def __init__(self, ids, params, log, chunks=0, slot=0):
        self.ids, self.n, self.log, self.chunks, self.slot = ids, params.max_tokens, log, chunks, slot
        self.out, self.completion, self.pending, self.stepped = [], None, None, False
        self.yield_chunks = False

    def __iter__(self):
        return self

    def __next__(self):
        if self.chunks and self.yield_chunks:
            self.chunks -= 1
            self.log.append(("chunk", self.ids[0]))
            return PROMPT_CHUNK
        if len(self.out) == self.n:
            self.completion = Completion("", self.out, "length", Usage(len(self.ids), len(self.out)))
            raise StopIteration
        self.log.append(("token", self.ids[0], self.stepped))
        self.out.append(self.ids[0] + len(self.out))
        self.stepped = False
        self.pending = self.out[-1] if len(self.out) < self.n else None
        return Delta(str(self.out[-1]), self.out[-1])

    def cancel(self):
        pass


def scheduler(num_slots, chunks=None, choose=None, waits=None):
    log, batches = [], []

    def begin(ids, params, on_progress=None, slot=0, **extra):
        log.append(("begin", ids[0], slot))
        return PendingWork(ids, params, log, (chunks or {}).get(ids[0], 0), slot)

    def batch(works):
        batches.append(sorted(w.slot for w in works))
        for w in works:
            w.pending, w.stepped = None, True
    return Scheduler(begin, 8, num_slots=num_slots, choose=choose, batch=batch, waits=waits), log, batches


def test_pending_steps_of_several_slots_run_as_one_batch():
    s, log, batches = scheduler(3)
    reqs = [s.submit(Request([p], SamplingParams(max_tokens=4))) for p in (10, 20, 30)]
    while s.step():
        pass
    assert [r.completion.token_ids for r in reqs] == [[p, p + 1, p + 2, p + 3] for p in (10, 20, 30)]
    assert batches == [[0, 1, 2]] * 3           # every token after the first, all three slots at once
    for p in (10, 20, 30):       # the first token from the prompt, every later one from a batched step
        assert [e[2] for e in log if e[:2] == ("token", p)] == [False, True, True, True]
    assert [r.num_tokens for r in reqs] == [4, 4, 4]


def test_a_long_prompt_is_read_a_chunk_per_iteration_beside_the_others_tokens():
    s, log, _ = scheduler(2, chunks={10: 5})
    long, short = (s.submit(Request([p], SamplingParams(max_tokens=3))) for p in (10, 20))
    while s.step():
        pass
    short_done = max(i for i, e in enumerate(log) if e[:2] == ("token", 20))
    long_chunks = [i for i, e in enumerate(log) if e == ("chunk", 10)]
    assert len(long_chunks) == 5 and short_done < long_chunks[-1]    # the short reply ended meanwhile
    assert long.num_tokens == 3 and short.num_tokens == 3            # chunks are not tokens
    assert long.first_token > short.first_token


def test_requests_go_to_the_slot_choose_names():
    picks = []

    def choose(ids, free):
        picks.append((ids[0], list(free)))
        return free[-1]
    s, log, _ = scheduler(3, choose=choose)
    for p in (10, 20):
        s.submit(Request([p], SamplingParams(max_tokens=1)))
    while s.step():
        pass
    assert picks == [(10, [0, 1, 2]), (20, [0, 1])]
    assert sorted(e for e in log if e[0] == "begin") == [("begin", 10, 2), ("begin", 20, 1)]


def test_a_request_waits_for_the_prompt_another_slot_is_reading_when_it_would_copy_it():
    asked = []

    def waits(slot, ids, reading):
        asked.append((slot, ids[0], reading[0]))
        return ids[0] == 11 and reading[0] == 10            # 11 would copy 10's prefix; 20 would not
    s, log, _ = scheduler(3, chunks={10: 3, 11: 3}, waits=waits)
    first, copier, other = (s.submit(Request([p], SamplingParams(max_tokens=2))) for p in (10, 11, 20))
    while s.step():
        pass
    begins = {e[1]: i for i, e in enumerate(log) if e[0] == "begin"}
    first_token_10 = next(i for i, e in enumerate(log) if e[:2] == ("token", 10))
    assert begins[11] > first_token_10                     # began once 10's prompt was read
    assert begins[20] < first_token_10                     # 20 did not wait
    assert all(r.num_tokens == 2 for r in (first, copier, other))
    assert (1, 11, 10) in asked and not any(r == 11 for _, _, r in asked)   # a waiting slot is never waited on
    assert len(asked) == len(set(asked))                    # once a pair, however many steps the wait takes


def test_a_waiting_request_starts_when_the_one_it_waits_for_ends_without_a_token():
    s, log, _ = scheduler(2, chunks={10: 2}, waits=lambda slot, ids, reading: True)
    first = s.submit(Request([10], SamplingParams(max_tokens=0)))     # a prompt scored, no token (echo)
    second = s.submit(Request([11], SamplingParams(max_tokens=1)))
    while s.step():
        pass
    assert first.state == "done" and first.num_tokens == 0 and second.num_tokens == 1
    begins = [i for i, e in enumerate(log) if e[0] == "begin"]
    assert log[begins[1]] == ("begin", 11, 1) and begins[1] > max(i for i, e in enumerate(log) if e == ("chunk", 10))


# ---- strata.LLM on the CPU, tiny model ----

@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    pytest.importorskip("torch")            # tests.fixtures builds the tiny pack with it
    from tests.fixtures import SHAPES, make_pack
    path, _ = make_pack(tmp_path_factory.mktemp("parallel"), SHAPES["tiny"], seed=5)
    return path


def _llm(path, parallel):
    from strata import LLM
    llm = LLM(path, device="cpu", parallel=parallel)
    llm.tokenizer.eos_token_ids = []        # every reply runs to max_tokens
    return llm


PROMPTS = ["def add(a, b):", "import os\n", "hello world", "the quick brown"]


def test_tokens_alone_equal_tokens_of_parallel_slots(tiny_pack):
    one, par = _llm(tiny_pack, 1), _llm(tiny_pack, 3)
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=7)
    alone = [one.generate(p, max_tokens=10, temperature=0.8, seed=7).token_ids for p in PROMPTS]
    calls = []
    batch = par.runner.decode_batch
    par.runner.decode_batch = lambda slots, tokens: (calls.append(list(slots)), batch(slots, tokens))
    reqs = [par.scheduler.submit(Request(par.tokenizer.encode(p), params)) for p in PROMPTS]
    for r in reqs:
        assert list(par.scheduler.drive(r))[-1][0] == "done"
    assert [r.completion.token_ids for r in reqs] == alone
    assert calls and max(len(c) for c in calls) == 3          # three slots stepped together


@pytest.mark.parametrize("batch_max", [1, 2, 3, 0])
def test_tokens_are_the_same_under_every_grouping(tiny_pack, batch_max):
    # --batch-max N: steps of at most N rows (1: each alone); 0: the auto rule, which tries every
    # grouping early on. A sampled request's tokens are its tokens alone whichever ran.
    from strata import LLM
    one = _llm(tiny_pack, 1)
    par = LLM(tiny_pack, device="cpu", parallel=4, batch_max=batch_max)
    par.tokenizer.eos_token_ids = []
    alone = [one.generate(p, max_tokens=12, temperature=0.8, seed=3).token_ids for p in PROMPTS]
    sizes = []
    batch = par.runner.decode_batch
    par.runner.decode_batch = lambda slots, tokens: (sizes.append(len(slots)), batch(slots, tokens))
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
    reqs = [par.scheduler.submit(Request(par.tokenizer.encode(p), params)) for p in PROMPTS]
    for r in reqs:
        assert list(par.scheduler.drive(r))[-1][0] == "done"
    assert [r.completion.token_ids for r in reqs] == alone
    assert max(sizes, default=1) <= (batch_max or 4)
    assert par.status()["batching"]["batch_max"] == batch_max
    if batch_max == 1:
        assert sizes == []                   # every row stepped alone
    else:                                   # 4 rows under a cap of 3 run as 2 + 2 (batching.split)
        assert max(sizes) == split(4, batch_max or 4)[0]


def test_a_follow_up_turn_goes_to_the_slot_that_holds_its_conversation(tiny_pack):
    llm = _llm(tiny_pack, 3)
    first = [llm.generate(p, max_tokens=4) for p in PROMPTS[:3]]
    slots = {llm.runner.slot_ids(s)[0]: s for s in range(3)}
    follow = llm.tokenizer.encode(PROMPTS[1]) + first[1].token_ids + llm.tokenizer.encode(" more")
    out = llm.generate(follow, max_tokens=2)
    assert out.usage.cached_tokens >= len(llm.tokenizer.encode(PROMPTS[1])) + 3
    assert llm.runner.slot == slots[follow[0]] or llm.runner.slot_ids(slots[follow[0]])[:len(follow)] == follow


def test_threads_share_parallel_slots(tiny_pack):
    llm = _llm(tiny_pack, 2)
    want = {p: _llm(tiny_pack, 1).generate(p, max_tokens=6).token_ids for p in PROMPTS}
    got, errors = in_threads(lambda p: llm.generate(p, max_tokens=6).token_ids, PROMPTS)
    assert not errors and got == want


def test_parallel_is_checked():
    with pytest.raises(InvalidArgument, match="parallel must be"):
        EngineConfig(parallel=0)
    with pytest.raises(InvalidArgument, match="parallel must be"):
        EngineConfig(parallel=9)
    EngineConfig(parallel=2, spec="1", mtp=True)          # speculation in parallel slots: test_spec_parallel
    with pytest.raises(InvalidArgument, match="--parallel 2 with --draft-window 64"):
        EngineConfig(parallel=2, spec="1", mtp=True, draft_window=64)


# ---- the GPU runner's batched step, emulated ----

def test_emulated_batched_step_rows_equal_each_slots_own_steps(fake, rng):
    from strata.engine.cuda_runner import CudaRunner
    from strata.engine.llm import demo_model_path
    from strata.pack import open_pack
    pack = open_pack(demo_model_path())
    V = pack.args.vocab_size
    prompts = [rng.integers(0, V, n).tolist() for n in (9, 14, 5)]
    par = CudaRunner(pack, 48, EngineConfig(device="cuda", parallel=3))
    one = CudaRunner(pack, 48, EngineConfig(device="cuda"))
    for slot, ids in enumerate(prompts):
        par.use(slot)
        par.prefill(ids, 0, logits=False)
    tokens = [rng.integers(0, V, 3).tolist() for _ in prompts]
    want = []
    for ids, more in zip(prompts, tokens):
        one.reset()
        one.prefill(ids, 0, logits=False)
        want.append([one.decode(t) for t in more])
    for step in range(3):                      # eager, captured, replayed: the graph serves every slot
        order = [2, 0, 1] if step % 2 else [0, 1, 2]
        par.decode_batch(order, [tokens[s][step] for s in order])
        for s in order:
            par.use(s)
            got = par.ops.to_host(par._last)[0]
            np.testing.assert_allclose(got, want[s][step], rtol=0, atol=1e-4 * np.abs(got).max(),
                                       err_msg=f"step {step}, slot {s}")
    assert [len(par.slot_ids(s)) for s in range(3)] == [len(p) + 3 for p in prompts]
    assert par.graphs and 3 in par.graphs


def test_emulated_slots_keep_their_own_cells(fake, rng):
    from strata.engine.cuda_runner import CudaRunner
    from strata.engine.llm import demo_model_path
    from strata.pack import open_pack
    pack = open_pack(demo_model_path())
    ids = rng.integers(0, pack.args.vocab_size, 12).tolist()
    par = CudaRunner(pack, 32, EngineConfig(device="cuda", parallel=2))
    par.use(1)
    a = par.prefill(ids, 0)
    par.use(0)
    par.prefill(ids[::-1], 0)       # slot 0's prompt writes only slot 0's cells
    par.use(1)
    assert par.reusable_prefix(ids + [1]) == len(ids)
    b = par.decode(ids[0])
    one = CudaRunner(pack, 32, EngineConfig(device="cuda"))
    assert np.array_equal(one.prefill(ids, 0), a) and np.array_equal(one.decode(ids[0]), b)    # one-row steps
    with pytest.raises(InvalidArgument, match="slot 2 out of range"):
        par.use(2)


# ---- conversations kept in host RAM ----

def test_a_conversation_pushed_out_of_its_slot_comes_back_from_host_ram(tiny_pack):
    from strata import LLM
    llm = LLM(tiny_pack, device="cpu", keep_conversations_gib=0.5)
    llm.tokenizer.eos_token_ids = []
    fresh = _llm(tiny_pack, 1)
    a = llm.tokenizer.encode(" ".join(PROMPTS) * 6)
    b = llm.tokenizer.encode("something else entirely, " * 8)
    first = llm.generate(a, max_tokens=4)
    llm.generate(b, max_tokens=4)                   # pushes conversation a out of the one slot
    assert llm.runner.kept.status()["conversations"] == 1
    follow = a + first.token_ids + llm.tokenizer.encode(" and then")
    out = llm.generate(follow, max_tokens=6, temperature=0.7, seed=2)
    assert out.usage.cached_tokens == len(a) + 3    # a's cells came back: only the new tokens are read
    assert llm.runner.kept.restored == 1
    assert out.token_ids == fresh.generate(follow, max_tokens=6, temperature=0.7, seed=2).token_ids
    assert llm.runner.kept.status()["conversations"] == 1      # b's turn, kept when a came back


def test_keep_is_off_at_zero_and_bounded(tiny_pack):
    from strata import LLM
    llm = LLM(tiny_pack, device="cpu", keep_conversations_gib=0)
    llm.generate(llm.tokenizer.encode("x y z " * 30), max_tokens=2)
    llm.generate(llm.tokenizer.encode("q r s " * 30), max_tokens=2)
    assert llm.runner.kept.status()["conversations"] == 0
    with pytest.raises(InvalidArgument, match="keep_conversations_gib"):
        EngineConfig(keep_conversations_gib=-1)


def test_emulated_kept_cells_come_back_bit_for_bit(fake, rng):
    from strata.engine.cuda_runner import CudaRunner
    from strata.engine.llm import demo_model_path
    from strata.pack import open_pack
    pack = open_pack(demo_model_path())
    V = pack.args.vocab_size
    a, b = rng.integers(0, V, 50).tolist(), rng.integers(0, V, 40).tolist()
    runner = CudaRunner(pack, 128, EngineConfig(device="cuda", parallel=2))
    runner.kept.budget_bytes = 1 << 30
    steady = CudaRunner(pack, 128, EngineConfig(device="cuda"))
    runner.use(1)
    runner.prefill(a, runner.reusable_prefix(a))
    runner.prefill(b, runner.reusable_prefix(b))     # slot 1's a pushed out, into host RAM
    assert runner.kept.status()["conversations"] == 1
    more = a + [7, 8]
    start = runner.reusable_prefix(more)
    assert start == len(a) and runner.slot_ids(1) == a
    got = runner.prefill(more, start)
    steady.prefill(a, 0)
    assert np.array_equal(got, steady.prefill(more, len(a)))


# ---- tools/parallel_bench.py's A/B, on the CPU ----

def test_parallel_bench_runs_the_rule_and_rows_in_line_on_the_same_prompts(tmp_path):
    import json
    bench = load_tool("parallel_bench")
    out = tmp_path / "pb.json"
    assert bench.main(["--device", "cpu", "--synthetic", "tiny", "--batch-max", "0,1", "--clients", "1,2",
                       "--prompt", "8", "--decode", "6", "--warm", "4", "--long", "0", "--json", str(out)]) == 0
    arms = json.loads(out.read_text())["arms"]
    assert [(a["budget_gib"], a["batch_max"]) for a in arms] == [(0.0, 0), (0.0, 1)]
    for a in arms:
        assert [r["clients"] for r in a["rounds"]] == [1, 2] and all(r["tokens"] > 0 for r in a["rounds"])
    assert arms[0]["rounds"][-1]["batching"]["auto"] and arms[1]["rounds"][-1]["batching"]["cap"] == 1


@pytest.mark.parametrize("batch_max", [2, 0])
def test_emulated_groupings_give_each_sequence_its_greedy_tokens_alone(fake, batch_max):
    # the GPU runner through the scheduler: groups of one row count share a graph and its logits
    # buffer, so each group's picks must come before the next group's step (the emulation's rows are
    # not bitwise its one-row steps, but greedy picks of the demo model are far from ties)
    from strata import LLM
    one = LLM(device="cuda", max_context=96)
    want = []
    for p in PROMPTS:
        one.runner.reset()
        want.append(one.generate(p, max_tokens=8).token_ids)
    par = LLM(device="cuda", parallel=4, max_context=96, batch_max=batch_max)
    sizes = []
    batch = par.runner.decode_batch
    par.runner.decode_batch = lambda slots, tokens: (sizes.append(len(slots)), batch(slots, tokens))
    reqs = [par.scheduler.submit(Request(par.tokenizer.encode(p), SamplingParams(max_tokens=8))) for p in PROMPTS]
    for r in reqs:
        assert list(par.scheduler.drive(r))[-1][0] == "done"
    assert [r.completion.token_ids for r in reqs] == want
    assert sizes and max(sizes) == (batch_max or 4) and (batch_max == 0 or sizes.count(2) >= 2)
