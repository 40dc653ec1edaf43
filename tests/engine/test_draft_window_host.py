"""--draft-window on the GPU runner's host side, over tests/engine/fake_cuda: the split-K decode
launches take the window and the ring (their emulation mirrors the kernels' arguments), the draft
layer's K/V is a ring after the main layers (the plan prices what DeviceKV allocates), every draft
row names its ring cell (eager passes and the window graph), and greedy output with speculation is
plain greedy's, the ring wrapped. tests/engine/test_spec_gpu.py runs the same on a device."""
import numpy as np
import pytest

from strata import config as strata_config
from strata.engine.llm import LLM
from strata.errors import InvalidArgument
from tests.engine.test_spec_gpu import check_drafter_over_the_ring, check_windowed_decode

PAGE = 8
PROMPT = "Once upon a time, in a quiet village by the sea, there lived an old fisherman and his cat"


@pytest.fixture
def small_pages(monkeypatch):
    """Ring pages of 8 cells: a window of 16 is a ring of 24 cells, wrapped by a 60-token sequence."""
    monkeypatch.setattr(strata_config, "DRAFT_RING_PAGE_CELLS", PAGE)


@pytest.mark.parametrize("fmt", ["f16", "q4_0", "k8v4"])
def test_windowed_ring_decode_launches(fake, rng, fmt):
    from strata.backends.cuda.kv import KVQuantOps
    from strata.backends.cuda.testing import CudaOps
    ops = CudaOps()
    check_windowed_decode(ops, KVQuantOps(ops), rng, fmt, H=4, Hk=2, dh=64, S=24, window=16)
    assert any(n.startswith("strata_attention_decode_") for n in fake.launches)


@pytest.mark.parametrize("cfg", [dict(), dict(kv="q4_0"), dict(expert_cache="20", prefill="24"),
                                 dict(draft_prompt="own"), dict(draft_prompt="own", expert_cache="20", prefill="24")])
def test_greedy_with_a_draft_window_equals_plain_on_the_emulated_gpu(fake, small_pages, cfg):
    plain = LLM(device="cuda", **{k: v for k, v in cfg.items() if k != "draft_prompt"})
    spec = LLM(device="cuda", mtp=True, spec=3, draft_window=16, **cfg)
    r = spec.runner
    assert (r.draft_window, r.draft_slots) == (16, 24) and r.kv_all.ring(spec.args.num_hidden_layers) == (16, 24)
    ids = spec.tokenizer.encode(PROMPT)
    want = plain.generate(ids, max_tokens=40)
    got = spec.generate(ids, max_tokens=40)
    assert len(ids) + 40 > 2 * 24 and got.token_ids == want.token_ids, cfg
    st = spec.status()
    assert st["speculation"]["device_windows"] > 0 and st["speculation"]["draft_n"] > 0
    if "kv" not in cfg:             # (q4_0 cells: the demo keeps 2 of 9 drafts here, 0 with the window, as the CPU)
        assert st["speculation"]["draft_n_accepted"] > 0
    assert st["draft"]["window"] == 16 and st["draft"]["ring_cells"] == 24
    assert st["draft"]["kv_bytes"] == 24 * r.kv_all.cell_bytes


def test_the_plan_prices_the_ring_that_the_runner_allocates(fake, small_pages):
    """The draft layer's K/V is a ring of 24 cells instead of the context's 256: DeviceKV's bytes are
    the plan's "kv", which is the whole context's less (256 - 24) cells of one layer; the cache gets
    the difference."""
    whole = LLM(device="cuda", mtp=True, spec=2, max_context=256).runner
    ring = LLM(device="cuda", mtp=True, spec=2, max_context=256, draft_window=16).runner
    saved = (256 - 24) * ring.kv_all.cell_bytes
    assert ring.kv_all.nbytes == ring.plan.mandatory["kv"] == whole.plan.mandatory["kv"] - saved
    assert whole.kv_all.nbytes == whole.plan.mandatory["kv"]
    assert (ring.plan.draft_window, ring.plan.draft_ring_cells) == (16, 24)
    assert (whole.plan.draft_window, whole.plan.draft_ring_cells) == (0, 0)


def test_drafter_logits_over_the_ring_equal_the_cpu_oracle(fake, small_pages):
    """After a 60-token prompt (the 24-cell ring wrapped twice), the drafter's row at the last position:
    the emulated GPU's logits are the CPU oracle's windowed drafter's (f16 cells against f32)."""
    check_drafter_over_the_ring(16, PROMPT, 60)


def test_a_ring_layer_refuses_rows_without_their_cells(fake, small_pages):
    """The draft layer's rows write a ring only through StepRows' cells; positions alone would land
    past it."""
    llm = LLM(device="cuda", mtp=True, spec=2, draft_window=16)
    r, a = llm.runner, llm.args
    h = r.ops.upload(np.zeros((2, a.hidden_size), np.float32))
    with pytest.raises(InvalidArgument, match="must name their cells"):
        r.model.mtp_cells(h, np.asarray([1, 2]), r.ops.upload_positions(np.asarray([30, 31])), r.kv)


def test_the_drafters_own_prompt_pass_lends_no_room(fake):
    """--draft-prompt own reads the draft layer's experts while a prompt runs, so seed 001's room (on
    from --mtp-room-min tokens) is not lent; batched lends it; both give plain greedy's tokens."""
    plain = LLM(device="cuda", expert_cache="20")
    want = plain.generate(PROMPT, max_tokens=16).token_ids
    for mode, lent in (("batched", True), ("own", False)):
        spec = LLM(device="cuda", mtp=True, spec=3, expert_cache="20", mtp_room_min=0, draft_prompt=mode)
        assert spec.generate(PROMPT, max_tokens=16).token_ids == want, mode
        assert spec.runner.room_lent is lent, mode
