"""Checks of the GPU runner on qwen3next packs against the numpy runner, shared by the host tests
(tests/engine/test_qwen3next_host.py: the kernels emulated by tests/engine/fake_cuda.py) and the
device tests (tests/engine/test_qwen3next_gpu.py).

Oracle: the numpy runner at the GPU's declared precision (tests/engine/cpu_f16_kv.py: K/V rounded
through f16, tensor-core prompt GEMMs with f16 inputs). What is left between the two is f32
summation order, ~1 ulp of exp/sin/cos/rsqrt, and the delta rule's algorithm: the numpy prompt runs
the chunked WY form, the GPU's prompt kernel the recurrence token by token (two f32 algorithms,
up to 1.2e-5 of max |logit| apart on the CPU: tests/model/test_qwen3next.py). Each check takes a
bound `rel` of max |oracle logit|.
"""
import numpy as np

from strata.config import SamplingParams
from strata.engine.sampler import pick_host


def assert_close(ours, ref, rel, what=""):
    bound = rel * np.abs(ref).max()
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    err = np.abs(ours - ref).max()
    assert err <= bound, f"{what}: max err {err:.3g} > {bound:.3g}"


def check_logits(gpu, cpu, ids, rel, k=3):
    """Every position's logits; then prefill of N - k tokens and k steps against the same rows of
    one read, on each runner and across them."""
    full_gpu, full_cpu = gpu.logits_all(ids), cpu.logits_all(ids)
    assert_close(full_gpu, full_cpu, rel, "logits_all")
    n = len(ids) - k
    rows = [gpu.prefill(ids[:n], 0)] + [gpu.decode(t) for t in ids[n:]]
    ref = [cpu.prefill(ids[:n], 0)] + [cpu.decode(t) for t in ids[n:]]
    assert_close(np.stack(rows), np.stack(ref), rel, "prefill + steps vs the oracle's")
    assert_close(np.stack(rows), full_gpu[n - 1:], rel, "prefill + steps vs one read")


def check_greedy(gpu, cpu, prompt, steps, rel):
    """Greedy tokens in lockstep: the GPU picks on the device (cuda/argmax.cu) from its logits, the
    oracle on the host; both read the oracle's token next. A pick that differs is allowed only where
    the oracle's two candidates are within the bound (a tie the roundings may break either way);
    -> (tokens, ties)."""
    greedy = SamplingParams()
    gpu.prefill(prompt, 0, logits=False)
    logits = cpu.prefill(prompt, 0)
    tokens, ties = [], 0
    for i in range(steps):
        ours, want = gpu.pick(greedy, 0.5), pick_host(logits, greedy, 0.5)
        if ours != want:
            gap = logits[want] - logits[ours]
            assert gap <= rel * np.abs(logits).max(), f"step {i}: GPU picked {ours}, oracle {want} by {gap:.3g}"
            ties += 1
        tokens.append(want)
        gpu.decode(want, logits=False)
        logits = cpu.decode(want)
    return tokens, ties


def check_follow_up(gpu, cpu, rng, rel):
    """A chat's turns on the GPU runner: the next turn resumes from the live state, a turn that drops
    the answer from the prompt's snapshot, one with no snapshot in its prefix from 0; each resumed
    read equal to the oracle's own resumed read and to a fresh read of the whole turn."""
    V = gpu.args.vocab_size
    ids = lambda n: rng.integers(0, V, n).tolist()          # noqa: E731
    turn1 = ids(30)
    for r in (gpu, cpu):
        r.reset()
        assert r.reusable_prefix(turn1) == 0
        r.prefill(turn1, 0)
    answer = ids(6)
    for t in answer:
        gpu.decode(t)
        cpu.decode(t)
    turn2 = turn1 + answer + ids(9)
    turn3 = turn1 + ids(11)
    turn4 = turn1[:10] + ids(5)
    got = []
    for turn, want_start in ((turn2, len(turn1) + len(answer)), (turn3, len(turn1)), (turn4, 0)):
        starts = [r.reusable_prefix(turn) for r in (gpu, cpu)]
        assert starts == [want_start] * 2, (starts, want_start)
        ours, ref = gpu.prefill(turn, want_start), cpu.prefill(turn, want_start)
        assert_close(ours, ref, rel, f"turn resumed at {want_start}")
        got.append((turn, ours))
    for turn, ours in got:
        fresh = gpu.logits_all(turn)[-1]
        assert_close(ours, fresh, rel, "resumed vs fresh")


def check_llm(path, rng, rel, max_tokens):
    """LLM(device="cuda") free-running greedy: each token the oracle, reading the same sequence, ranks
    first or within the bound of first; the next turn resumes after it on the device."""
    from strata import LLM
    from tests.engine.cpu_f16_kv import cpu_runner_f16_kv
    llm = LLM(path, device="cuda", max_context=256)
    assert llm.device == "cuda" and llm.runner.device == "cuda"
    llm.tokenizer.eos_token_ids = []        # a random model may rank EOS first: every reply runs to max_tokens
    prompt = rng.integers(0, llm.args.vocab_size, 12).tolist()
    out = llm.generate(prompt, max_tokens=max_tokens, temperature=0.0)
    assert len(out.token_ids) == max_tokens
    seq = prompt + out.token_ids
    oracle = cpu_runner_f16_kv(llm.pack, len(seq) + 1)
    logits = oracle.logits_all(seq)[len(prompt) - 1:len(seq) - 1]
    for i, (row, t) in enumerate(zip(logits, out.token_ids)):
        gap = row.max() - row[t]
        assert gap <= rel * np.abs(row).max(), f"token {i}: {t} is {gap:.3g} below the oracle's first"
    again = llm.generate(seq + prompt[:3], max_tokens=4, temperature=0.0)
    assert again.usage.cached_tokens >= len(seq) - 1
    return out


def check_parallel_slots(tmp_path, rng, rel):
    """--parallel 2 on the GPU: each slot's prompt, decode steps (one at a time and through
    decode_batch, one batched step whose rows read each slot's states where they are) and follow-up
    turn read what a one-slot runner reads for that sequence alone, while the other slot works in
    between (the states buffer swapped at each use())."""
    from strata.config import EngineConfig, SamplingParams
    from strata.engine.cuda_runner import CudaRunner
    from strata.pack import open_pack
    from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack
    path, _ = make_next_pack(tmp_path, dict(NEXT_SHAPES["tiny"], head_dim=64), seed=13)
    pack = open_pack(path)
    V = pack.args.vocab_size
    par = CudaRunner(pack, 96, EngineConfig(device="cuda", parallel=2))
    alone = [CudaRunner(pack, 96), CudaRunner(pack, 96)]
    for r in (par, *alone):
        r.prefill_chunk = 12
    prompts = [rng.integers(0, V, 29).tolist(), rng.integers(0, V, 17).tolist()]
    for s in (0, 1):
        par.use(s)
        assert_close(par.prefill(prompts[s], 0), alone[s].prefill(prompts[s], 0), rel, f"slot {s} prompt")
    tokens = [[int(t) for t in rng.integers(0, V, 4)] for _ in (0, 1)]
    for i in range(2):                          # one slot at a time, alternating
        for s in (0, 1):
            par.use(s)
            assert_close(par.decode(tokens[s][i]), alone[s].decode(tokens[s][i]), rel, f"slot {s} step {i}")
    greedy = SamplingParams(temperature=0.0)
    for i in range(2, 4):                       # the scheduler's batched step
        par.decode_batch([1, 0], [tokens[1][i], tokens[0][i]])
        for s in (0, 1):
            par.use(s)
            want = alone[s].decode(tokens[s][i])
            assert par.pick(greedy, 0.0) == int(np.argmax(want)), f"slot {s} batched step {i}"
    follow = prompts[0] + tokens[0] + rng.integers(0, V, 5).tolist()
    par.use(0)
    start = par.reusable_prefix(follow)
    assert start == len(prompts[0]) + 4 == alone[0].reusable_prefix(follow)
    assert_close(par.prefill(follow, start), alone[0].prefill(follow, start), rel, "slot 0 follow-up")
    assert par.kv_all.nbytes == alone[0].kv_all.kv.nbytes * 2 + alone[0].kv_all.states.nbytes * 3


# decode_batch's orders for check_batched_rows: every row count 1..4, slots in shuffled orders (each
# shape eager, then captured, then replayed), the slot in use (its states in the states buffer, the
# others' in their homes) among the rows or not; ("decode", s): slot s steps alone in between
BATCH_ORDERS = ([0, 1, 2, 3], [3, 1], [2, 0, 1], ("decode", 2), [1, 3, 0, 2], [0], [3, 2, 1, 0], [2, 3],
                ("decode", 0), [1, 0, 2], [3], [0, 2])


def check_batched_rows(tmp_path, rng, rel=0.0):
    """--parallel 4: decode_batch of a hybrid model is one batched step (the DeltaNet row kernels over
    each row's own slot's states), and each row reads what that slot's own one-row steps read: the
    logits of every step, then every slot's DeltaNet states at the end, against a one-slot runner
    stepping each sequence alone. rel 0: bit for bit (the device, whose kernels are row-invariant);
    else within rel of max |logit| (the emulations' numpy GEMMs may round by row count). Fails
    (AssertionError naming the slot) if a row reads another slot's states."""
    from strata.config import EngineConfig
    from strata.engine.cuda_runner import CudaRunner
    from strata.pack import open_pack
    from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack
    path, _ = make_next_pack(tmp_path, dict(NEXT_SHAPES["tiny"], head_dim=64), seed=17)
    pack = open_pack(path)
    V = pack.args.vocab_size
    par = CudaRunner(pack, 96, EngineConfig(device="cuda", parallel=4))
    one = CudaRunner(pack, 96)
    par.prefill_chunk = one.prefill_chunk = 12
    prompts = [rng.integers(0, V, n).tolist() for n in (19, 9, 26, 14)]
    steps = [sum(s in (o[1:] if isinstance(o, tuple) else o) for o in BATCH_ORDERS) for s in range(4)]
    tokens = [[int(t) for t in rng.integers(0, V, n)] for n in steps]
    want, want_states = [], []
    for ids, more in zip(prompts, tokens):
        one.reset()
        one.prefill(ids, 0, logits=False)
        want.append([one.decode(t) for t in more])
        want_states.append(one.kv.read_states())
    for slot, ids in enumerate(prompts):
        par.use(slot)
        par.prefill(ids, 0, logits=False)

    def same(got, ref, what):
        if rel == 0.0:
            assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), f"{what}: not bit for bit"
        else:
            assert_close(got, ref, rel, what)

    done = [0] * 4
    for order in BATCH_ORDERS:
        if isinstance(order, tuple):
            s = order[1]
            par.use(s)
            same(par.decode(tokens[s][done[s]]), want[s][done[s]], f"slot {s} alone, step {done[s]}")
            done[s] += 1
            continue
        in_use = par.slot
        par.decode_batch(order, [tokens[s][done[s]] for s in order])
        assert par.slot == in_use                   # a hybrid's batched step swaps no states
        for s in order:
            par.use(s)
            got = par.ops.to_host(par._last)[0]
            same(got, want[s][done[s]], f"slot {s} batched in {order}, step {done[s]}")
            done[s] += 1
    assert done == steps and [len(par.slot_ids(s)) for s in range(4)] == [len(p) + n for p, n in zip(prompts, steps)]
    for s in range(4):
        par.use(s)
        got, ref = par.kv.read_states().view(np.float32), want_states[s].view(np.float32)
        same(got, ref, f"slot {s}'s DeltaNet states")
    assert {"rows1", "rows2", "rows3", "rows4"} <= set(par.graphs), sorted(map(str, par.graphs))
    return par
