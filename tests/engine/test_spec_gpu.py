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


# ---- --draft-window: the drafter's K/V ring (#14 item 5, seed 003) ------------------------------------

def check_windowed_decode(ops, kvops, rng, fmt: str, B: int = 3, H: int = 8, Hk: int = 2, dh: int = 128,
                          S: int = 48, window: int = 40) -> None:
    """The split-K decode kernel of format fmt with a window and a ring: row b, its sequence's positions
    0..lengths[b]-1 written in order into a ring of S cells (position p in cell p % S; later positions
    overwrite), reads its last `window` positions; against float64 sliding-window attention on the
    cells as stored (q rotated / output un-rotated where the format rotates). Lengths below the
    window, between window and ring, and several times round the ring. Tolerance as the plain
    decode's: per head max|out - ref| <= 1e-5 max|ref| (f32 scores and sums only)."""
    from strata.backends.cpu import window_attention
    from strata.quant import kv as kvq
    lengths = np.asarray([5, 45, 3 * S + 7][:B], np.int32)
    n_max = int(lengths.max())
    k = rng.standard_normal((B, n_max, Hk, dh)).astype(np.float32)
    v = rng.standard_normal((B, n_max, Hk, dh)).astype(np.float32)
    k[..., 3] *= 20.0
    ring_k, ring_v = np.zeros((B, S, Hk, dh), np.float32), np.zeros((B, S, Hk, dh), np.float32)
    for b, n in enumerate(lengths):
        for p in range(n):
            ring_k[b, p % S], ring_v[b, p % S] = k[b, p], v[b, p]
    q = rng.standard_normal((B, H, dh)).astype(np.float32)
    if fmt in ("f16", "f16tc"):     # f16tc: cuda/attention_dec_tc.cu's kernel
        got = ops.attention_decode(q, ring_k.astype(np.float16), ring_v.astype(np.float16), lengths,
                                   window=window, ring=S, tc=fmt == "f16tc")
        kc = vc = None
        stored_k, stored_v = ring_k.astype(np.float16).astype(np.float64), ring_v.astype(np.float16).astype(np.float64)
    else:
        kc, vc = kvq.codecs(fmt)
        kp, vp = kc.encode(ring_k), vc.encode(ring_v)
        got = kvops.attention_decode(fmt, q, kp, vp, lengths, window=window, ring=S)
        stored_k, stored_v = kc.decode(*kp).astype(np.float64), vc.decode(*vp).astype(np.float64)
    for b, n in enumerate(lengths):
        pos = np.arange(max(0, n - window), n)
        qb = kvq.rotate(q[b]) if kc is not None and kc.rotated else q[b]
        ref = window_attention(qb[None].astype(np.float64), stored_k[b, pos % S], stored_v[b, pos % S], pos,
                               np.asarray([n - 1]), window)[0].reshape(H, dh)
        if vc is not None and vc.rotated:
            ref = kvq.rotate(ref.astype(np.float32)).astype(np.float64)
        err = np.abs(got[b].reshape(H, dh) - ref).max(axis=-1)
        assert np.all(err <= 1e-5 * np.abs(ref).max(axis=-1) + 1e-6), (fmt, b, n, err.max())


@pytest.mark.parametrize("fmt", ["f16", "f16tc", "int8", "q4_0", "k8v4"])
def test_windowed_ring_decode_kernels(rng, fmt):
    from strata.backends.cuda.kv import KVQuantOps
    from strata.backends.cuda.testing import CudaOps
    ops = CudaOps()
    check_windowed_decode(ops, KVQuantOps(ops), rng, fmt)


@pytest.mark.parametrize("cfg", [dict(), dict(kv="q4_0"), dict(expert_cache="20", prefill="64"),
                                 dict(draft_prompt="own")])
def test_greedy_with_a_draft_window_equals_plain(plain, cfg):
    """--draft-window 64 (a ring of 512 cells) under prompts and outputs of about 600 tokens, so the
    ring wraps: greedy with --spec 3 gives plain greedy's tokens, the windows run as graphs, and the
    prompt wrote only the window's cells."""
    base = {k: v for k, v in cfg.items() if k != "draft_prompt"}
    plain_cfg = LLM(device="cuda", **base) if base else plain
    spec = LLM(device="cuda", mtp=True, spec=3, draft_window=64, **cfg)
    assert spec.runner.draft_slots == 512
    for prompt in PROMPTS[:2]:
        ids = (spec.tokenizer.encode(" ".join(PROMPTS)) * 40)[:400] + spec.tokenizer.encode(prompt)
        plain_cfg.runner.reset()
        want = plain_cfg.generate(ids, max_tokens=200)
        got = spec.generate(ids, max_tokens=200)
        assert got.token_ids == want.token_ids, (cfg, prompt)
    st = spec.status()
    assert st["speculation"]["device_windows"] > 0.9 * st["speculation"]["verify_passes"]
    assert st["draft"]["window"] == 64
    if "prefill" not in cfg:        # one chunk a prompt: its last 64 cells only (each prompt read whole)
        assert st["draft"]["prompt_cells"] <= 2 * 64


def check_drafter_over_the_ring(window: int, text: str, n: int) -> None:
    """After a prompt of n tokens (text repeated), the drafter's row at the last position with
    --draft-window `window`: the GPU's logits within 2e-3 of the largest of the CPU runner's windowed
    drafter's (the oracle; f16 cells against f32). Also run on the emulated GPU
    (test_draft_window_host.py)."""
    cpu = LLM(device="cpu", mtp=True, spec=2, draft_window=window)
    gpu = LLM(device="cuda", mtp=True, spec=2, draft_window=window)
    ids = cpu.tokenizer.encode(text)
    ids = (ids * -(-n // len(ids)))[:n]
    out = []
    for llm in (cpu, gpu):
        r = llm.runner
        r.reset()
        r.prefill(ids, 0, logits=False)
        logits, _ = r.mtp(r.drafter.pending, np.asarray([ids[3]]), np.asarray([len(ids) - 1]),
                          logits_rows=slice(-1, None))
        out.append(logits[-1])
    np.testing.assert_allclose(out[1], out[0], rtol=0, atol=2e-3 * np.abs(out[0]).max())


def test_draft_window_drafter_logits_equal_the_cpu_oracle():
    """The drafter's logits over a 64-cell ring wrapped many times, against the CPU oracle."""
    check_drafter_over_the_ring(64, " ".join(PROMPTS), 700)
