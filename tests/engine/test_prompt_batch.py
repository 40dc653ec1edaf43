"""Prompts of several slots read in one forward (#19): the scheduler's PROMPT_READY hand-off with a
stand-in work, and the GPU runner's prefill_batch on the emulated runtime (tests/engine/fake_cuda):
each prompt's cells and logits are what reading it alone gives, and the slots decode on from there
as they would alone. tests/engine/test_parallel_gpu.py checks the bits on a GPU."""
import numpy as np
import pytest

from strata.config import SamplingParams
from strata.engine.scheduler import PROMPT_READY, Request, Scheduler
from strata.engine.types import Completion, Delta, Usage
from strata.errors import InvalidArgument


class ReadyWork:
    """A stand-in for Generation whose prompt is read in one pass: with batch_prompt set, its first
    next() yields PROMPT_READY with prompt_start set; the next reads the prompt alone unless a batch
    read it (prompt_read), then gives token ids[0] + i for i < max_tokens."""

    def __init__(self, ids, params, log):
        self.ids, self.n, self.log = ids, params.max_tokens, log
        self.batch_prompt, self.prompt_start, self.prompt_read = False, None, False
        self.out, self.cancelled, self.completion, self.waited = [], False, None, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.batch_prompt and not self.waited:
            self.waited, self.prompt_start = True, 0
            return PROMPT_READY
        if self.prompt_start is not None:
            self.prompt_start = None
            if not self.prompt_read and not self.cancelled:
                self.log.append(("alone", self.ids[0]))
        if self.cancelled or len(self.out) == self.n:
            self.completion = Completion("", self.out, "cancelled" if self.cancelled else "length",
                                         Usage(len(self.ids), len(self.out)))
            raise StopIteration
        token = self.ids[0] + len(self.out)
        self.out.append(token)
        return Delta(str(token), token)

    def cancel(self):
        self.cancelled = True


def ready_scheduler(batch_prompts, num_slots=4):
    log = []

    def begin(ids, params, on_progress=None, **extra):
        return ReadyWork(ids, params, log)
    return Scheduler(begin, 8, num_slots=num_slots, batch_prompts=batch_prompts), log


def test_prompts_admitted_together_are_read_in_one_call_then_each_picks():
    calls = []

    def read(works):
        calls.append([w.ids[0] for w in works])
        for w in works:
            w.prompt_read = True
    s, log = ready_scheduler(read)
    reqs = [s.submit(Request([first], SamplingParams(max_tokens=3))) for first in (10, 20, 30)]
    s.step()
    assert calls == [[10, 20, 30]] and log == []
    assert all(r.num_tokens == 1 and r.first_token is not None for r in reqs)    # in the same iteration
    while s.step():
        pass
    assert [r.completion.token_ids for r in reqs] == [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    late = s.submit(Request([40], SamplingParams(max_tokens=2)))      # alone: read by itself, no call
    while s.step():
        pass
    assert calls == [[10, 20, 30]] and log == [("alone", 40)] and late.completion.token_ids == [40, 41]


def test_a_prompt_the_batch_left_reads_alone_and_a_cancelled_one_is_not_read():
    calls = []

    def read(works):            # as LLM._prompt_batch: a group of one is left to the work
        calls.append([w.ids[0] for w in works])
        for w in works[:-1]:
            w.prompt_read = True
    s, log = ready_scheduler(read)
    reqs = [s.submit(Request([first], SamplingParams(max_tokens=2))) for first in (10, 20, 30)]
    s.step()
    assert calls == [[10, 20, 30]] and log == [("alone", 30)]
    while s.step():
        pass
    assert [r.completion.token_ids for r in reqs] == [[10, 11], [20, 21], [30, 31]]
    calls.clear()
    log2, holder = [], {}

    def begin(ids, params, on_progress=None, **extra):      # b is cancelled once its prompt waits
        if ids[0] == 20:
            holder["s"].cancel(holder["b"])
        return ReadyWork(ids, params, log2)
    s2 = holder["s"] = Scheduler(begin, 8, num_slots=4, batch_prompts=read)
    a = s2.submit(Request([10], SamplingParams(max_tokens=2)))
    b = holder["b"] = s2.submit(Request([20], SamplingParams(max_tokens=2)))
    while s2.step():
        pass
    assert calls == [] and log2 == [("alone", 10)]        # one live prompt: no batch; b's never read
    assert a.completion.token_ids == [10, 11] and b.completion.finish_reason == "cancelled"


def test_a_fault_in_the_batched_read_ends_only_its_requests():
    def read(works):
        raise RuntimeError("device fault")
    s, _ = ready_scheduler(read)
    reqs = [s.submit(Request([first], SamplingParams(max_tokens=2))) for first in (10, 20)]
    events = {id(r): [] for r in reqs}
    for r in reqs:
        r.emit = lambda kind, payload, r=r: events[id(r)].append(kind)
    s.step()
    assert all(events[id(r)] == ["error"] and r.state == "error" for r in reqs)
    after = s.submit(Request([30], SamplingParams(max_tokens=1)))
    while s.step():
        pass
    assert after.completion.token_ids == [30]


# ---- the GPU runner on the emulated runtime -------------------------------------------------------

def _runner(fake, parallel=3, **config):
    from strata.config import EngineConfig
    from strata.engine.cuda_runner import CudaRunner
    from strata.engine.llm import demo_model_path
    from strata.pack import open_pack
    return CudaRunner(open_pack(demo_model_path()), 64, EngineConfig(parallel=parallel, **config))


def _greedy(runner, slot, n):
    runner.use(slot)
    out = [runner.pick(SamplingParams(temperature=0.0), 0.5)]
    for _ in range(n - 1):
        runner.decode(out[-1], logits=False)
        out.append(runner.pick(SamplingParams(temperature=0.0), 0.5))
    return out


def test_prefill_batch_gives_each_slot_what_reading_alone_gives(fake, rng):
    prompts = [rng.integers(0, 200, n).tolist() for n in (12, 20, 15)]
    alone = _runner(fake)
    want, tokens = [], []
    for slot, ids in enumerate(prompts):     # each read, then decoded on (the prompt's row is shared)
        alone.use(slot)
        want.append(alone.prefill(ids, 0))
        tokens.append(_greedy(alone, slot, 4))
    together = _runner(fake)
    assert all(together.prompt_batchable(ids, 0) for ids in prompts)
    fake.launches.clear()
    together.prefill_batch([(slot, ids, 0) for slot, ids in enumerate(prompts)])
    assert fake.launches.count("strata_embed_q8_0") == 1                # one forward for the three
    assert together.status()["prompt_batches"] == {"forwards": 1, "prompts": 3}
    for slot, ids in enumerate(prompts):
        together.use(slot)
        assert together.cached_ids == ids
        got = together.ops.to_host(together._last).reshape(-1)
        np.testing.assert_allclose(got, want[slot], rtol=0, atol=2e-5 * np.abs(want[slot]).max())
    # the cells each slot holds are its own: decoding on gives the tokens decoding on alone gives
    assert [_greedy(together, slot, 4) for slot in range(3)] == tokens


def test_prefill_batch_after_a_cached_prefix_and_its_refusals(fake, rng):
    runner = _runner(fake)
    first = rng.integers(0, 200, 16).tolist()
    runner.use(0)
    runner.prefill(first, 0)
    turn = first + rng.integers(0, 200, 12).tolist()           # slot 0 goes on from its cached prefix
    other = rng.integers(0, 200, 10).tolist()
    runner.use(0)
    start = runner.reusable_prefix(turn)
    assert start == 16
    ref = _runner(fake)
    ref.use(0)
    ref.prefill(first, 0)
    want = ref.prefill(turn, 16)
    runner.prefill_batch([(0, turn, start), (1, other, 0)])
    runner.use(0)
    got = runner.ops.to_host(runner._last).reshape(-1)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    assert not runner.prompt_batchable(other[:8], 0)           # a decode step's tokens: the step path
    assert not runner.prompt_batchable(other, 0) or runner.prefill_chunk >= 10
    with pytest.raises(InvalidArgument, match="repeat"):
        runner.prefill_batch([(1, other, 0), (1, other, 0)])
    with pytest.raises(InvalidArgument, match="not one this runner reads"):
        runner.prefill_batch([(1, other[:5], 0), (2, other, 0)])
    assert not _runner(fake, parallel=1).prompt_batchable(other, 0)


@pytest.mark.parametrize("kv", ["int8", "q4_0", "k8v4"])
def test_prompts_read_together_over_a_quantized_cache(fake, rng, kv):
    """Over a quantized cache each prompt's K/V is quantized into its slot's cells in one append, and
    each prompt attends over its own slot's cells dequantized, as it does alone; the rotations of q
    and of the output are per row."""
    prompts = [rng.integers(0, 200, n).tolist() for n in (13, 10, 17)]
    alone = _runner(fake, kv=kv)
    want, tokens = [], []
    for slot, ids in enumerate(prompts):
        alone.use(slot)
        want.append(alone.prefill(ids, 0))
        tokens.append(_greedy(alone, slot, 3))
    together = _runner(fake, kv=kv)
    assert together.kv_all.quantized and all(together.prompt_batchable(ids, 0) for ids in prompts)
    together.prefill_batch([(slot, ids, 0) for slot, ids in enumerate(prompts)])
    for slot in range(3):
        together.use(slot)
        np.testing.assert_array_equal(together.ops.to_host(together._last).reshape(-1), want[slot])
    assert [_greedy(together, slot, 3) for slot in range(3)] == tokens


def test_llm_reads_prompts_that_arrive_together_in_one_forward(fake, rng):
    from strata import LLM
    from strata.config import SamplingParams as P
    prompts = [rng.integers(0, 200, n).tolist() for n in (14, 22, 11)]
    one_by_one = LLM(device="cuda", parallel=3, max_context=128)
    one_by_one.tokenizer.eos_token_ids = []
    alone = [one_by_one.generate(p, max_tokens=5).token_ids for p in prompts]
    assert one_by_one.runner.status()["prompt_batches"]["forwards"] == 0
    llm = LLM(device="cuda", parallel=3, max_context=128)
    llm.tokenizer.eos_token_ids = []
    before = llm.runner.status()["prompt_batches"]["forwards"]
    reqs = [llm.scheduler.submit(Request(p, P(max_tokens=5))) for p in prompts]
    while llm.scheduler.step():
        pass
    assert [r.completion.token_ids for r in reqs] == alone
    assert llm.runner.status()["prompt_batches"]["forwards"] == before + 1
    one = LLM(device="cuda", parallel=3, max_context=128, batch_max=1)      # rows apart: prompts apart too
    assert one.scheduler.batch_prompts is None


def test_prompts_read_together_with_experts_streamed_equal_resident_alone(fake, rng):
    """Under a budget the forward streams the chunk's missed experts once for all its prompts, under
    one loan; each slot's logits (copied out of the loan before it goes back) and next steps are a
    resident runner's that read the prompt alone, bit for bit."""
    prompts = [rng.integers(0, 200, n).tolist() for n in (12, 9, 10)]
    resident = _runner(fake, prefill="64")
    want, tokens = [], []
    for slot, ids in enumerate(prompts):
        resident.use(slot)
        want.append(resident.prefill(ids, 0))
        tokens.append(_greedy(resident, slot, 3))
    streamed = _runner(fake, prefill="64", expert_cache="20")
    assert not streamed.store.resident and all(streamed.prompt_batchable(ids, 0) for ids in prompts)
    assert streamed.prompt_batch_tokens == 32 and not streamed.prompt_batchable(list(range(40)), 0)
    with pytest.raises(InvalidArgument, match="it takes 32"):
        streamed.prefill_batch([(0, prompts[0] * 2, 0), (1, prompts[1] * 2, 0)])
    streamed.prefill_batch([(slot, ids, 0) for slot, ids in enumerate(prompts)])
    assert not streamed.store.lent                     # the loan went back
    for slot in range(3):
        streamed.use(slot)
        np.testing.assert_array_equal(streamed.ops.to_host(streamed._last).reshape(-1), want[slot])
    assert [_greedy(streamed, slot, 3) for slot in range(3)] == tokens


def test_waiting_prompts_join_the_first_forward_they_fit_in():
    """LLM._prompt_batch packs the waiting prompts first-fit, in their order, into forwards of at most
    runner.prompt_batch_tokens tokens; a forward of one is left to its work (read alone)."""
    from types import SimpleNamespace
    from strata.engine.llm import LLM
    calls = []
    runner = SimpleNamespace(prompt_batch_tokens=512, prefill_batch=lambda jobs: calls.append([j[0] for j in jobs]))
    progress = []
    works = [SimpleNamespace(slot=i, ids=[0] * n, prompt_start=1, prompt_read=False,
                             on_progress=lambda done, total, i=i: progress.append((i, done, total)))
             for i, n in enumerate((101, 451, 101, 600, 31))]
    LLM._prompt_batch(SimpleNamespace(runner=runner), works)
    assert calls == [[0, 2, 4]]                        # 100 + 100 + 30 tokens; 450 and 599 go alone
    assert [w.prompt_read for w in works] == [True, False, True, False, True]
    assert progress == [(0, 100, 100), (2, 100, 100), (4, 30, 30)]
