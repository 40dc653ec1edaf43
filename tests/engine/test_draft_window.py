"""--draft-window on the CPU (the oracle): the MTP drafter attends over its last W positions, its K/V a
ring (position p in cell p % slots); its logits equal a plain numpy sliding-window reference, greedy
output with speculation stays plain greedy's, prompts write only the cells the window can reach, in
batches that share no ring slot, and the flags are checked (strata/engine/speculate.py MtpDrafter,
strata/backends/cpu.py KVCache rings). The ring's page is patched small so short prompts wrap it."""
import numpy as np
import pytest

from strata import LLM, config as strata_config
from strata.backends.cpu import CpuOps, KVCache
from strata.config import EngineConfig, draft_ring, draft_ring_cells
from strata.errors import InvalidArgument
from strata.model import build

PROMPTS = ["Once upon a time", "The little robot wanted", "def add(a, b):"]
PAGE = 8


@pytest.fixture
def small_pages(monkeypatch):
    """Ring pages of 8 cells: a window of 16 is a ring of 24, wrapped by any prompt past 24 tokens."""
    monkeypatch.setattr(strata_config, "DRAFT_RING_PAGE_CELLS", PAGE)


@pytest.fixture(scope="module")
def demo():
    return LLM(device="cpu")


def sliding_window_reference(q, keys, values, positions, window):
    """Row by row, head by head: softmax over the cells p - window + 1 .. p (float64)."""
    T, H, Dh = q.shape
    G = H // keys.shape[1]
    out = np.zeros((T, H, Dh))
    for t, p in enumerate(positions):
        lo = max(0, int(p) - window + 1)
        for h in range(H):
            k = keys[lo:p + 1, h // G].astype(np.float64)
            s = k @ q[t, h].astype(np.float64) / np.sqrt(Dh)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ values[lo:p + 1, h // G]
    return out.reshape(T, H * Dh).astype(np.float32)


class WindowReferenceOps(CpuOps):
    """CpuOps whose draft layer (layer L) attends by sliding_window_reference over a full-context cache."""

    def __init__(self, pack, args, window):
        super().__init__(pack, args)
        self.window = window

    def attention(self, q, k, v, layer, kv, positions):
        if layer != self.args.num_hidden_layers:
            return super().attention(q, k, v, layer, kv, positions)
        kv.write(layer, positions, k, v)
        keys, values = kv.read(layer, int(positions.max()) + 1)
        return sliding_window_reference(q, keys, values, positions, self.window)


def reference_draft_logits(llm, ids, token, window):
    """The draft layer's logits after ids and `token` (its row at position len(ids) - 1), from the main
    model's hidden states of the whole sequence and the reference window attention."""
    a = llm.args
    ops = WindowReferenceOps(llm.runner.ops.pack, a, window)
    model = build(a, ops)
    kv = KVCache(a.num_hidden_layers + 1, a.num_key_value_heads, a.head_dim, len(ids) + 1)
    n = len(ids)
    _, hidden = model.forward(np.asarray(ids), np.arange(n), kv)
    logits, _ = model.mtp_step(hidden, np.asarray(ids[1:] + [token]), np.arange(n), kv, logits_rows=slice(-1, None))
    return logits[-1]


@pytest.mark.parametrize("window,chunk", [(5, 7), (16, 5), (16, 64)])
def test_windowed_drafter_logits_equal_a_numpy_sliding_window(small_pages, demo, window, chunk):
    """A prompt of 70 tokens read in chunks (the ring of 16 or 24 cells wraps several times), then the
    drafter's row at its last position: its logits are the reference's, and not the whole context's."""
    llm = LLM(device="cpu", mtp=True, spec=2, draft_window=window)
    runner = llm.runner
    assert (runner.draft_window, runner.draft_slots) == (window, draft_ring_cells(window))
    ids = (demo.tokenizer.encode(" ".join(PROMPTS)) * 8)[:70]
    token = ids[5]
    runner.prefill_chunk = chunk
    runner.reset()
    runner.prefill(ids, 0, logits=False)
    assert runner.drafter.done == len(ids) - 1 and runner.drafter.pending.shape[0] == 1
    got, _ = runner.mtp(runner.drafter.pending, np.asarray([token]), np.asarray([len(ids) - 1]),
                        logits_rows=slice(-1, None))
    want = reference_draft_logits(llm, ids, token, window)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got[-1], want, rtol=0, atol=2e-5 * scale)
    whole = reference_draft_logits(llm, ids, token, len(ids))
    assert np.abs(whole - want).max() > 1e-3 * scale        # the window is in effect


def test_greedy_with_a_draft_window_equals_plain(small_pages, demo):
    """48 greedy tokens per prompt with --spec 1..4 (the drafter's own prompt pass: --spec 3) over a
    window of 16 (ring 24, wrapped) equal plain greedy; drafts are still accepted."""
    for mode, drafts in (("batched", (1, 2, 3, 4)), ("own", (3,))):
        llm = LLM(device="cpu", mtp=True, spec=4, draft_window=16, draft_prompt=mode)
        runner = llm.runner
        for prompt in PROMPTS[1:]:
            ids = demo.tokenizer.encode(prompt * 4)
            want = demo.generate(ids, max_tokens=48)
            for n in drafts:
                runner.spec = n
                runner.reset()
                got = llm.generate(ids, max_tokens=48)
                assert got.token_ids == want.token_ids, f"{mode} --spec {n} on {prompt!r}"
                assert got.timings.draft_n_accepted > 0
        st = llm.status()["draft"]
        assert st["window"] == 16 and st["ring_cells"] == 24 and st["prompt"] == mode and st["prompt_cells"] > 0


def test_greedy_with_a_draft_window_on_a_tiny_random_model(small_pages, tmp_path, rng):
    """A tiny random MTP model (its drafts mostly rejected): windows of 1, 4 and 9 over rings of
    16, 16 and 24 cells, 40 tokens after a 30-token prompt, plain greedy's tokens."""
    pytest.importorskip("torch")
    from tests.fixtures import SHAPES, make_pack
    pack, _ = make_pack(tmp_path, SHAPES["mtp"], seed=int(rng.integers(1 << 16)))
    plain = LLM(pack, device="cpu")
    prompt = rng.integers(0, 300, 30).tolist()
    want = plain.generate(prompt, max_tokens=40).token_ids
    for window in (1, 4, 9):
        spec = LLM(pack, device="cpu", mtp=True, spec=3, draft_window=window)
        assert spec.generate(prompt, max_tokens=40).token_ids == want, f"window {window}"


def test_a_prompt_writes_only_the_cells_the_window_reaches(small_pages, demo):
    """A 100-token prompt with a window of 16: the drafter's cells of positions 83..98 (the window of
    the next query at 99, and one more for a re-read of the last token), nothing below."""
    llm = LLM(device="cpu", mtp=True, spec=2, draft_window=16)
    runner = llm.runner
    runner.draft_timing = True
    ids = (demo.tokenizer.encode(" ".join(PROMPTS)) * 10)[:100]
    runner.reset()
    runner.prefill(ids, 0, logits=False)
    L = llm.args.num_hidden_layers
    held = runner.kv.held[L]
    assert sorted(int(p) for p in held if p >= 0) == list(range(83, 99))
    assert runner.spec_stats.prompt_cells == 16 and sum(c for c, _ in runner.draft_chunks) == 16
    assert runner.drafter.first_held == 83


def test_a_ring_batch_never_shares_a_slot():
    kv = KVCache(2, 2, 16, 1000, rings={1: (4, 8)})
    x = np.ones((9, 2, 16), np.float32)
    with pytest.raises(IndexError, match="shares a slot"):
        kv.write(1, np.arange(9), x, x)
    kv.write(1, np.arange(10, 18), x[:8], x[:8])                   # 8 rows in 8 slots
    keys, _, pos = kv.read_window(1, np.asarray([17]))
    assert list(pos) == [14, 15, 16, 17] and np.isfinite(keys).all()
    keys, _, _ = kv.read_window(1, np.asarray([9]))             # positions 6..9: never written
    assert np.isnan(keys).all()


def test_prefix_reuse_with_a_draft_window(small_pages, demo):
    """A continuation reuses the cached prefix; a prompt that leaves the sequence further back than
    the ring still holds reuses nothing (the drafter's cells there are gone); both give plain greedy's
    tokens."""
    llm = LLM(device="cpu", mtp=True, spec=3, draft_window=16)
    runner = llm.runner
    ids = demo.tokenizer.encode(PROMPTS[2] * 3)
    first = llm.generate(ids, max_tokens=40)
    more = ids + first.token_ids + demo.tokenizer.encode(" and then")
    cont = llm.generate(more, max_tokens=20)
    assert cont.usage.cached_tokens > len(ids) + 30
    assert cont.token_ids == demo.generate(more, max_tokens=20).token_ids
    back = more[:len(ids) + 2] + [t + 1 for t in more[len(ids) + 2:len(ids) + 5]]
    assert runner.reusable_prefix(back) == 0           # cells around len(ids) + 2 were overwritten or skipped
    assert llm.generate(back, max_tokens=20).token_ids == demo.generate(back, max_tokens=20).token_ids


def test_draft_window_flags_are_checked():
    for bad in (-1, True, 2.5):
        with pytest.raises(InvalidArgument, match="draft_window must be a number of cells"):
            EngineConfig(draft_window=bad)
    with pytest.raises(InvalidArgument, match="draft_prompt must be one of batched, own"):
        EngineConfig(draft_prompt="fast")
    with pytest.raises(InvalidArgument, match="--draft-window 64 needs --mtp"):
        EngineConfig(draft_window=64)
    with pytest.raises(InvalidArgument, match="--kv-resident"):
        EngineConfig(device="cuda", mtp=True, spec="2", draft_window=64, kv_resident=1024, max_context=4096)
    assert EngineConfig().draft_window == 0 and EngineConfig().draft_prompt == "batched"
    assert draft_ring(0, 4096) == (0, 0) and draft_ring(4096, 4096) == (0, 0)    # no ring: the whole context
    assert draft_ring(4096, 32768) == (4096, 4352) and draft_ring(4000, 32768) == (4000, 4352)


def test_draft_window_cli_flags():
    from strata.cli import build_parser
    args = build_parser().parse_args(["bench", "--mtp", "--spec", "2", "--draft-window", "4096",
                                      "--draft-prompt", "own"])
    assert args.draft_window == 4096 and args.draft_prompt == "own"


def test_a_window_as_wide_as_the_context_keeps_the_whole_context(demo):
    llm = LLM(device="cpu", mtp=True, spec=2, draft_window=1 << 20)
    assert llm.runner.draft_window == 0 and llm.runner.draft_slots == 0 and not llm.runner.kv.rings
