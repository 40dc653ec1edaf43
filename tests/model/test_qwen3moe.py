"""The numpy engine against transformers on tiny random qwen3moe models, HF and GGUF routes."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from strata import LLM  # noqa: E402
from tests.fixtures import SHAPES, make_gguf_pack, make_pack  # noqa: E402


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def assert_close_to_hf(llm, model, ids):
    ours, ref = llm.logits(ids), hf_logits(model, ids)
    assert ours.shape == ref.shape == (len(ids), llm.args.vocab_size)
    bound = 1e-4 * np.abs(ref).max()
    assert np.abs(ours - ref).max() <= bound, f"max err {np.abs(ours - ref).max():.3g} > {bound:.3g}"


def random_ids(rng, n, vocab):
    """n token ids from the test's replayable rng (STRATA_TEST_SEED replays a failure)."""
    return rng.integers(0, vocab, n).tolist()


@pytest.mark.parametrize("shape", ["tiny", "odd", "kquant", "mtp"])
def test_hf_route_f32_matches_transformers(tmp_path, shape, rng):
    pack, model = make_pack(tmp_path, SHAPES[shape], seed=3)
    llm = LLM(pack, device="cpu")
    assert_close_to_hf(llm, model, random_ids(rng, 37, llm.args.vocab_size))


@pytest.mark.parametrize("qtypes", [
    {"attn": "Q8_0", "experts": "Q8_0", "embd": "Q8_0", "output": "Q8_0"},
    {"attn": "Q6_K", "experts": "Q4_K", "embd": "Q6_K", "output": "Q8_0"},
    {"attn": ["Q4_K", "Q8_0"], "experts": ["Q6_K", "Q4_K"], "embd": "Q8_0", "output": "Q6_K"},
], ids=["q8_0", "q4_k+q6_k", "mixed-per-layer"])
def test_gguf_route_matches_transformers_on_dequantized_weights(tmp_path, qtypes, rng):
    pack, model = make_gguf_pack(tmp_path, SHAPES["kquant"], qtypes, seed=5)
    llm = LLM(pack, device="cpu")
    assert_close_to_hf(llm, model, random_ids(rng, 29, llm.args.vocab_size))


def test_greedy_32_tokens_equal_transformers(tmp_path, rng):
    """Greedy tokens equal transformers'. The prompt comes from the replayable rng, the first of a few
    whose greedy run does not end at once (a random tiny model sometimes answers EOS first, and an empty
    run would compare nothing: CI met one)."""
    pack, model = make_pack(tmp_path, SHAPES["odd"], seed=11)
    llm = LLM(pack, device="cpu")
    eos = llm.tokenizer.eos_token_ids
    for _ in range(8):
        prompt = rng.integers(0, llm.args.vocab_size, 9).tolist()
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])[0, len(prompt):].tolist()
        if out and out[0] not in eos:
            break
    ours = llm.generate(prompt, max_tokens=32)
    if out and out[-1] in eos:
        out = out[:-1]
        assert ours.finish_reason == "stop"
    assert ours.token_ids == out and len(out) > 0


def test_prefill_then_steps_equals_one_prefill(tmp_path, rng):
    pack, _ = make_pack(tmp_path, SHAPES["odd"], seed=2)
    llm = LLM(pack, device="cpu")
    ids = random_ids(rng, 40, llm.args.vocab_size)
    full = llm.logits(ids)
    runner = llm.runner
    runner.reset()
    rows = [runner.prefill(ids[:33], 0)]
    rows += [runner.decode(t) for t in ids[33:]]
    np.testing.assert_allclose(np.stack(rows), full[32:], rtol=0, atol=1e-5 * np.abs(full).max())


def test_chunked_prompt_equals_one_chunk(tmp_path, rng):
    pack, _ = make_pack(tmp_path, SHAPES["tiny"], seed=4)
    llm = LLM(pack, device="cpu")
    ids = random_ids(rng, 50, llm.args.vocab_size)
    one = llm.logits(ids)
    llm.runner.prefill_chunk = 7
    np.testing.assert_allclose(llm.logits(ids), one, rtol=0, atol=1e-5 * np.abs(one).max())


def test_mtp_head_runs_on_main_hidden_states(tmp_path, rng):
    pack, _ = make_pack(tmp_path, SHAPES["mtp"], seed=6)
    llm = LLM(pack, device="cpu")
    from strata.backends.cpu import KVCache
    a = llm.args
    ids = np.asarray(random_ids(rng, 12, a.vocab_size))
    kv = KVCache(a.num_hidden_layers + 1, a.num_key_value_heads, a.head_dim, 64)
    _, hidden = llm.runner.model.forward(ids, np.arange(12), kv)
    seen = {}
    draft = llm.runner.model.mtp_forward(hidden[:-1], ids[1:], np.arange(11), kv,
                                         record=lambda name, layer, x: seen.__setitem__((name, layer), x))
    assert draft.shape == (11, a.vocab_size) and np.isfinite(draft).all() and draft.std() > 0
    # the draft layer's own final norm (Qwen3-Next's mtp.norm) is applied before the shared head
    from strata.backends.cpu import rms_norm
    ops, L = llm.runner.ops, a.num_hidden_layers
    own = ops.weight(f"blk.{L}.nextn.shared_head_norm.weight")
    want = rms_norm(seen[("layer_out", L)], own, a.rms_norm_eps) @ ops.weight("output.weight").T
    np.testing.assert_allclose(draft, want, rtol=1e-5, atol=1e-6)
