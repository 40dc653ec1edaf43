"""The GPU runner on qwen3next packs, on the device, against the numpy runner at the GPU's declared
precision (tests/engine/qwen3next_checks.py, tests/engine/cpu_f16_kv.py).

Bound REL = 3e-3 of max |oracle logit|, tests/engine/test_cuda_runner.py's on the device (its
reduction orders and FMA contractions differ from numpy's more than the emulations' do); the
emulated runner stays within 1e-5 of the same oracle (tests/engine/test_qwen3next_host.py). The
oracle's prompt runs the chunked WY delta rule, the GPU the same form (cuda/gated_delta_chunk.cu) for chunks
of at least 64 tokens and the recurrence token by token below.

Greedy: 64 tokens in lockstep with the oracle, every GPU pick equal to the oracle's except at a tie
within the bound; and through LLM(device="cuda"), 64 free-running greedy tokens, each of which the
oracle, reading the same sequence, ranks first or within the bound of first.

Streamed (#15): under a small expert cache and under a budget whose prompt borrows the loan, the
logits are the resident runner's bit for bit (the same kernels on the same bytes).
"""
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from strata.engine.cuda_runner import CudaRunner  # noqa: E402
from strata.pack import open_pack  # noqa: E402
from tests.engine.cpu_f16_kv import cpu_runner_f16_kv, oracle_ids  # noqa: E402
from tests.engine.qwen3next_checks import (  # noqa: E402
    check_batched_rows, check_follow_up, check_greedy, check_llm, check_logits, check_parallel_slots)
from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack  # noqa: E402

pytestmark = pytest.mark.gpu

REL = 3e-3
GAP = 2e-3          # router top-k margin of the oracle's draws (test_cuda_runner.py's GAP)
# dh256: Qwen3-Next's own head dim, whose prompt chunks run cuda/attention_tc.cu's warp-pair kernel
SHAPES = {**NEXT_SHAPES, "top10": dict(NEXT_SHAPES["tiny"], num_experts=24, num_experts_per_tok=10),
          "dh256": dict(NEXT_SHAPES["tiny"], head_dim=256)}


def runners(tmp_path, shape, seed, context=160, chunk=12):
    path, _ = make_next_pack(tmp_path, SHAPES[shape], seed=seed)
    pack = open_pack(path)
    gpu, cpu = CudaRunner(pack, context), cpu_runner_f16_kv(pack, context)
    gpu.prefill_chunk = cpu.prefill_chunk = chunk
    return pack, gpu, cpu


@pytest.mark.parametrize("shape", ["tiny", "odd", "wide", "kquant", "top10", "dh256"])
def test_logits_and_steps_match_the_cpu(tmp_path, rng, shape):
    pack, gpu, cpu = runners(tmp_path, shape, seed=3)
    ids = oracle_ids(pack, rng, 40, chunk=12, gap=GAP)
    check_logits(gpu, cpu, ids, REL)


def test_long_prompt_in_the_plans_chunks(tmp_path, rng):
    """A prompt of 300 tokens in the plan's own chunk size (the prompt kernels over long chunks: the
    chunked delta rule over 256 tokens, the token loop over the 44 after; prefill N - 4 and 4 steps
    equal prefill N)."""
    pack, gpu, cpu = runners(tmp_path, "tiny", seed=6, context=400, chunk=256)
    ids = oracle_ids(pack, rng, 300, chunk=256, gap=GAP, tries=10)
    check_logits(gpu, cpu, ids, REL, k=4)


def test_greedy_64_tokens_equal_the_cpu(tmp_path, rng):
    pack, gpu, cpu = runners(tmp_path, "tiny", seed=5)
    prompt = oracle_ids(pack, rng, 20, chunk=12, gap=GAP)
    tokens, ties = check_greedy(gpu, cpu, prompt, 64, REL)
    assert len(tokens) == 64 and ties <= 2, f"{ties} ties in 64 greedy steps"
    assert gpu.graphs and gpu.status()["decode"]["cuda_graphs"]


def test_follow_up_turns_resume_as_on_the_cpu(tmp_path, rng):
    _, gpu, cpu = runners(tmp_path, "tiny", seed=8)
    check_follow_up(gpu, cpu, rng, REL)


def test_llm_generates_on_the_gpu_what_the_cpu_ranks_first(tmp_path, rng):
    path, _ = make_next_pack(tmp_path, SHAPES["wide"], seed=11)
    check_llm(path, rng, REL, 64)


@pytest.mark.parametrize("shape, qtype, cache", [("top10", "Q8_0", "0"), ("top10", "Q8_0", "12"),
                                                 ("tiny", None, "6"), ("kquant", None, "3")])
def test_streamed_experts_give_the_resident_logits_bit_for_bit(tmp_path, rng, shape, qtype, cache):
    """Routed experts in pinned host memory (decode misses read zero-copy, prompt chunks streamed
    through the ring) and a small VRAM cache ("0": every step misses): the same kernels on the same
    bytes as the resident run, prompt and decode (graphs), greedy picks and a follow-up turn; then a
    budget whose prompt borrows the cache's tail (the loan), its pool the plan's bytes_needed.
    top10 is 10 of 24 experts a token (moe_gemv in decode), Q8_0 (prompt chunks grouped on the device)."""
    from strata.config import EngineConfig, SamplingParams
    pack = open_pack(make_next_pack(tmp_path, SHAPES[shape], seed=3, qtype=qtype)[0])
    cfg = dict(device="cuda", prefill="24")
    resident = CudaRunner(pack, 160, EngineConfig(**cfg))
    streamed = CudaRunner(pack, 160, EngineConfig(expert_cache=cache, **cfg))
    mandatory = resident.plan.mandatory_bytes
    loan = None           # top10: 70 of its 96 experts' slots, the ring and the prompt pool lent from the tail
    if shape == "top10":
        loan = CudaRunner(pack, 160, EngineConfig(vram_budget_gib=(mandatory + 70 * pack.meta["max_blob"]) / 2**30,
                                                  **cfg))
        assert not loan.store.resident and loan.store.kept_slots < loan.store.cache_slots
    assert resident.store.resident and not streamed.store.resident and streamed.decode_misses == "zero-copy"
    V = pack.args.vocab_size
    ids = rng.integers(0, V, 70).tolist()
    for other in [streamed] + ([loan] if loan else []):
        np.testing.assert_array_equal(other.logits_all(ids), resident.logits_all(ids))
        np.testing.assert_array_equal(other.prefill(ids[:60], 0), resident.prefill(ids[:60], 0))
        for t in ids[60:]:
            np.testing.assert_array_equal(other.decode(t), resident.decode(t))
    s = streamed.status()["expert_cache"]
    assert s["misses"] > 0 and s["prompt_streamed"] > 0 and streamed.decode_status()["host_ms"]["graph"]["steps"] >= 8
    greedy, picks = SamplingParams(), {}
    for r in (resident, streamed):
        r.prefill(ids[:30], 0, logits=False)
        picks[r] = []
        for _ in range(16):
            picks[r].append(r.pick(greedy, 0.5))
            r.decode(picks[r][-1], logits=False)
    assert picks[streamed] == picks[resident]
    turn = ids[:30] + picks[resident] + rng.integers(0, V, 9).tolist()
    assert streamed.reusable_prefix(turn) == resident.reusable_prefix(turn) == 46
    np.testing.assert_array_equal(streamed.prefill(turn, 46), resident.prefill(turn, 46))
    if loan:
        g = loan.status()["gpu"]
        assert g["vram_used_bytes"] <= g["vram_budget_bytes"]


def test_parallel_slots_keep_their_own_deltanet_states(tmp_path, rng):
    """--parallel 2: each slot reads what a one-slot runner reads for its sequence alone, with the
    other slot working in between (qwen3next_checks.check_parallel_slots)."""
    check_parallel_slots(tmp_path, rng, REL)


def test_batched_slots_are_one_step_whose_rows_are_each_slots_own_bit_for_bit(tmp_path, rng):
    """--parallel 4: decode_batch is one step over the slots' rows (the DeltaNet row kernels over each
    row's own slot's states, graphs rows1..rows4, every row count eager, captured and replayed), and
    each row's logits, and each slot's states at the end, are that slot's own one-row steps' bit for
    bit (qwen3next_checks.check_batched_rows)."""
    par = check_batched_rows(tmp_path, rng)
    assert par.use_graphs and par.graphs["rows4"].launches >= 1


def test_spec_windows_are_one_row_steps_and_greedy_is_plain_greedy(tmp_path, rng):
    """--mtp --spec on the device (#15): a verify window's rows run the DeltaNet through the one-token
    kernels and every other op row-invariantly, so its rows' logits and the states after it are the
    one-row steps' bit for bit; 64 greedy tokens with --spec 1..4, and with forced drafts that windows
    keep 0..3 of (each rollback from another row), are plain greedy's, the states plain decoding's.
    (Once xfail: the reference's decode(logits=False) steps in a row, no pick between, rewrote the
    pinned step inputs under queued copies, so the reference's states were wrong, not spec's;
    DecodeSteps.stage_inputs now waits for the last staging copy. Emulated with a lagging device:
    test_qwen3next_spec.py.)"""
    from strata.config import EngineConfig
    from tests.engine.next_spec_checks import check_spec_is_plain_greedy, check_window_rows, replay_plain, states_of
    path, _ = make_next_pack(tmp_path, SHAPES["tiny"], seed=21, mtp=True)
    pack = open_pack(path)
    plain, spec = CudaRunner(pack, 160), CudaRunner(pack, 160, EngineConfig(device="cuda", mtp=True, spec="4"))
    plain.prefill_chunk = spec.prefill_chunk = 12
    V = pack.args.vocab_size
    for T in (2, 5):
        check_window_rows(spec, rng.integers(0, V, 15).tolist(), rng.integers(0, V, T).tolist(), 0.0)
    prompt = rng.integers(0, V, 17).tolist()
    want, _ = check_spec_is_plain_greedy(plain, spec, prompt, 64, wrong=[-1, 0, 2, 1])
    replay_plain(plain, prompt, prompt + want, len(spec.cached_ids))
    assert np.array_equal(states_of(spec), states_of(plain))
