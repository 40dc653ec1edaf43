"""MTP speculation on the GPU (#13): verify-window rows bit for bit the one-row steps, and greedy
output with --spec 1..4 exactly plain greedy, on the demo model.

Why bits: every op of a step of up to 8 rows is row-invariant on the device (strata_gemv_rows_*,
strata_gemv3_rows_*, split-K decode attention over one sequence's cells with lengths per row,
moe_decode, per-row norms, routing and RoPE), so a row computes the same floats whatever the window
holds (tests/kernels/test_row_invariant_gpu.py checks the kernels one by one)."""
import numpy as np
import pytest

from strata.engine.llm import LLM

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time, in a quiet village,"]


@pytest.fixture(scope="module")
def plain():
    return LLM(device="cuda")


@pytest.fixture(scope="module")
def spec():
    return LLM(device="cuda", mtp=True, spec=4)


def test_verify_rows_are_one_row_steps_bit_for_bit(spec):
    r = spec.runner
    r.reset()
    ids = spec.tokenizer.encode(PROMPTS[2])
    r.prefill(ids, 0)
    start = len(r.cached_ids)
    window = [11, 220, 3555, 42, 7, 1000, 5]
    for T in range(2, 8):
        rows, _ = r.verify(window[:T], start)
        singles = np.stack([r.verify([t], start + i)[0][0] for i, t in enumerate(window[:T])])
        assert np.array_equal(rows.view(np.uint32), singles.view(np.uint32)), f"window of {T} rows"
    r.reset()


def test_greedy_256_with_spec_1_to_4_equals_plain(plain, spec):
    r = spec.runner
    for prompt in PROMPTS:
        plain.runner.reset()
        want = plain.generate(prompt, max_tokens=256)
        for n in (1, 2, 3, 4):
            r.spec = n
            r.reset()
            got = spec.generate(prompt, max_tokens=256)
            assert got.token_ids == want.token_ids, f"--spec {n} on {prompt!r}"
            assert got.timings.draft_n > 0
    r.spec = 4
    st = spec.status()["speculation"]
    assert st["draft_n"] > 0 and 0 < st["acceptance"] <= 1
    # the windows ran as the device's window graphs (strata.engine.cuda_window), one per N
    assert st["device_windows"] > 0.9 * st["verify_passes"]
    assert {"spec1", "spec2", "spec3", "spec4"} <= set(r.steps.graphs)


@pytest.mark.parametrize("cfg", [dict(expert_cache="20"), dict(kv="int8"), dict(kv="q4_0"),
                                 dict(expert_cache="20", kv="k8v4")])
def test_greedy_with_spec_equals_plain_streamed_and_quantized(cfg):
    """Experts streaming (20 cache slots: misses read in place, the verify rows' routing admitted,
    the draft layer's experts cached for good) and quantized K/V (row-invariant appends and split-K
    attention): greedy with --spec 3 gives plain greedy's 128 tokens."""
    plain, spec = LLM(device="cuda", **cfg), LLM(device="cuda", mtp=True, spec=3, **cfg)
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_tokens=128)
        got = spec.generate(prompt, max_tokens=128)
        assert got.token_ids == want.token_ids, (cfg, prompt)
    st = spec.status()["speculation"]
    assert st["device_windows"] > 0.9 * st["verify_passes"] and st["acceptance"] > 0.5
