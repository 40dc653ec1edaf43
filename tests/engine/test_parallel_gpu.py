"""--parallel slots on the GPU (#19): a batched step's rows are each slot's own one-row steps bit for
bit (any subset of slots, in any order, eager, captured and replayed), with f16 and int8 KV; greedy
replies from several threads in parallel slots equal the replies one at a time, under every
--batch-max grouping and the auto rule."""
import numpy as np
import pytest

from strata.config import EngineConfig
from strata.engine.llm import LLM
from tests.engine.threads import in_threads

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time, in a quiet village,", "import numpy"]


@pytest.mark.parametrize("kv,off,on", [("f16", "", ""), ("int8", "", ""), ("f16", "one-row-gemv", ""),
                                       ("f16", "", "cluster-decode")])
def test_batched_rows_are_each_slots_one_row_steps_bit_for_bit(kv, off, on):
    # one-row-gemv (on by default): the one-row steps' GEMVs one row a warp, the batched rows' four (the same
    # sum order); off, the attention output of both split-K. cluster-decode (on trial, sm_90+): every row here is
    # short, so each batch's attention is one cluster launch over its rows
    from strata.engine.cuda_runner import CudaRunner
    from strata.errors import UnsupportedError
    try:
        llm = LLM(device="cuda", parallel=4, kv=kv, max_context=256, kernels_off=off, kernels_on=on)
    except UnsupportedError as e:       # cluster-decode where it cannot run (before sm_90)
        pytest.skip(str(e))
    assert llm.runner.ops.paths.cluster_decode == (on == "cluster-decode")
    par = llm.runner
    one = CudaRunner(llm.pack, 256, EngineConfig(device="cuda", kv=kv, kernels_off=off, kernels_on=on))
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    rng = np.random.default_rng(1)
    steps = 6
    tokens = [rng.integers(0, llm.args.vocab_size, steps).tolist() for _ in prompts]
    want = []
    for ids, more in zip(prompts, tokens):
        one.reset()
        one.prefill(ids, 0, logits=False)
        want.append([one.decode(t) for t in more])
    for slot, ids in enumerate(prompts):
        par.use(slot)
        par.prefill(ids, 0, logits=False)
    done = [0] * 4
    # every row count 1..4, slots in shuffled orders: each shape eager, then captured, then replayed
    for order in ([0, 1, 2, 3], [3, 1], [2, 0, 1], [1, 3, 0, 2], [0], [3, 2, 1, 0], [2, 3], [1, 0, 2], [3]):
        order = [s for s in order if done[s] < steps]
        par.decode_batch(order, [tokens[s][done[s]] for s in order])
        for s in order:
            par.use(s)
            got = par.ops.to_host(par._last)[0]
            assert np.array_equal(got.view(np.uint32), want[s][done[s]].view(np.uint32)), (order, s, done[s])
            done[s] += 1
    # a graph's key is its row count, with the f16 decode kernels' rule after it where one applies ("2+cl")
    assert par.use_graphs and all(par.steps.captured(n) for n in (1, 2, 3, 4))


@pytest.fixture(scope="module")
def one_at_a_time():
    plain = LLM(device="cuda", max_context=512)
    want = {}
    for p in PROMPTS:
        plain.runner.reset()
        want[p] = plain.generate(p, max_tokens=64).token_ids
    return want


@pytest.mark.parametrize("batch_max", [0, 1, 2, 3, 4])
def test_greedy_replies_in_parallel_slots_equal_one_at_a_time(one_at_a_time, batch_max):
    # every grouping of the rows (--batch-max N: steps of up to N rows; 0: the auto rule, which tries
    # each grouping early on) gives each sequence the tokens it has alone
    par = LLM(device="cuda", parallel=4, max_context=512, batch_max=batch_max)
    calls = []
    batch = par.runner.decode_batch
    par.runner.decode_batch = lambda slots, toks: (calls.append(len(slots)), batch(slots, toks))
    got, errors = in_threads(lambda p: par.generate(p, max_tokens=64).token_ids, PROMPTS, 300)
    assert not errors and got == one_at_a_time
    if batch_max == 1:
        assert not calls                      # each row stepped alone
    else:
        assert calls and 2 <= max(calls) <= (batch_max or 4)     # they did decode together, within the cap
    b = par.status()["batching"]
    assert b["batch_max"] == batch_max and b["step_ms"] and all(ms > 0 for ms in b["step_ms"].values())


@pytest.mark.parametrize("tc_attention, cache, kv", [(True, None, "f16"), (False, None, "f16"), (True, "20", "f16"),
                                                     (True, None, "q4_0")])
def test_prompts_read_together_are_each_prompt_read_alone_bit_for_bit(tc_attention, cache, kv):
    """CudaRunner.prefill_batch (#19: prompts that arrive together read in one forward): each slot's
    last logits, and its next step's, equal a one-sequence resident runner's that read that prompt
    alone, bit for bit; over the tensor-core prompt attention and attention.cu's (each prompt attends
    in its own launch either way), with the experts streamed through a cache of 20 slots, and over a
    q4_0 cache (each prompt attends over its slot's cells dequantized)."""
    from strata.engine.cuda_runner import CudaRunner
    from strata.engine.llm import demo_model_path
    from strata.pack import open_pack
    pack = open_pack(demo_model_path())
    off = {} if tc_attention else {"kernels_off": "tc-attention"}
    streamed = {} if cache is None else {"expert_cache": cache}
    par = CudaRunner(pack, 256, EngineConfig(device="cuda", parallel=4, kv=kv, **off, **streamed))
    assert par.store.resident == (cache is None)
    one = CudaRunner(pack, 256, EngineConfig(device="cuda", kv=kv, **off))
    rng = np.random.default_rng(3)
    V = par.args.vocab_size
    prompts = [rng.integers(0, V, n).tolist() for n in (12, 30, 17, 9)]
    nxt = [int(t) for t in rng.integers(0, V, 4)]
    want = []
    for ids, t in zip(prompts, nxt):
        one.reset()
        first = one.prefill(ids, 0)
        want.append((first, one.decode(t)))
    assert all(par.prompt_batchable(ids, 0) for ids in prompts)
    par.prefill_batch([(slot, ids, 0) for slot, ids in enumerate(prompts)])
    got = []
    for slot in range(4):
        par.use(slot)
        got.append(par.ops.to_host(par._last).reshape(-1))
    par.decode_batch([0, 1, 2, 3], nxt)
    for slot in range(4):
        par.use(slot)
        step = par.ops.to_host(par._last)[0]
        assert np.array_equal(got[slot].view(np.uint32), want[slot][0].view(np.uint32)), slot
        assert np.array_equal(step.view(np.uint32), want[slot][1].view(np.uint32)), slot
