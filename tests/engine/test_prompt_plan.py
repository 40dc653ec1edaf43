"""strata._ext.prompt_plan, the prompt path's and the decode step's pool in closed form, against their
oracle: the dry run of the forward on a null runtime (strata.engine.memory_model.dry_run_prompt,
dry_run_decode_step), over shapes that take every branch, a sweep of T around the tile, GEMV and
stream-all edges, every KV format and both ends of the KV size; and the planner's plans with the
closed form against its plans without it."""
import dataclasses

import pytest

from strata import synthetic
from strata.config import EngineConfig
from strata.engine import memory_model, planner
from strata.engine.llm import demo_model_path
from strata.engine.planner import PackSizes, make_plan
from strata.pack import open_pack
from strata.plan import plan_sizes
from strata.quant.kv import KV_FORMATS

pytest.importorskip("strata._ext.prompt_plan")

# T just past the GEMV path, around stream_all_tokens (32 on the 30B shape, 103 on the 80B), the
# 128-row tile, the 256 grid, and large chunks (odd ones leave the logits row off 16 bytes on D = 90)
SWEEP = (9, 10, 13, 31, 32, 33, 102, 103, 127, 128, 129, 255, 256, 257, 1000, 4095, 4096, 4097)
CONFIGS = ((1, 1, False), (3, 1, False), (3, 40960, False), (1, 5000, True))  # (chunks, max_cells, resident)
SHORT_SWEEP = (9, 13, 33, 129, 257, 4097)
BIG_SWEEP = (9, 33, 4097)                      # the 48-layer shapes: a dry run is 0.1 s


def _branchy():
    """D = 90 (no K-quant, no tensor-core K for the projections: dequantized scratch; the logits row
    of odd T - 1 off 16 bytes), head dim 25 (the unfused QK-norm and RoPE), F16 experts whose gate
    and up take scratch and whose down (K = 40) takes the tensor-core table, grouped on the host."""
    args = synthetic._args(vocab_size=301, hidden_size=90, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=25, num_experts=6, num_experts_per_tok=2,
                           moe_intermediate_size=40, max_position_embeddings=4096)
    return args, {"experts": "F16", "attn": "F16", "embd": "F16", "output": "F16"}


def _sizes(name: str, monkeypatch) -> PackSizes:
    if name == "demo":
        meta = open_pack(demo_model_path()).meta
        return PackSizes.from_meta(meta, meta["files"]["dense.bin"]["bytes"])
    if name == "branchy":
        monkeypatch.setitem(synthetic.SHAPES, "branchy", _branchy())
    return plan_sizes(None, name)[1]


def _formats(sizes) -> tuple:
    return KV_FORMATS if sizes.args.head_dim % 32 == 0 else ("f16",)


def _assert_equal(sizes, Ts, configs=CONFIGS, steps=range(1, 9)) -> None:
    """Prompt chunks of each T and config, and decode steps / verify windows of each size in steps
    (over 1 to 100,000 cells, 1 to 132 multiprocessors: the split-K partials' sizes), in every format."""
    for kv in _formats(sizes):
        for T in Ts:
            for chunks, cells, resident in configs:
                want = memory_model.dry_run_prompt(sizes, T, chunks, cells, 8, resident, kv)
                got = memory_model._prompt(sizes, T, chunks, cells, 8, resident, kv)
                assert got == want, (kv, T, chunks, cells, resident)
        for T in steps:
            for cells, num_sms in ((1, 132), (4096, 132), (100_000, 1)):
                want = memory_model.dry_run_decode_step(sizes, T, cells, num_sms, kv)
                assert memory_model.decode_step_bytes(sizes, T, cells, num_sms, kv) == want, (kv, T, cells, num_sms)


@pytest.mark.parametrize("name", ["demo", "branchy", "tiny"])
def test_closed_form_is_the_dry_run(name, monkeypatch):
    sizes = _sizes(name, monkeypatch)
    assert memory_model.closed_form(SWEEP[0]) and not memory_model.closed_form(8)
    _assert_equal(sizes, SWEEP)


@pytest.mark.parametrize("name", ["small", "qwen3-30b-a3b", "qwen3-next-80b-a3b"])
def test_closed_form_is_the_dry_run_at_full_size(name, monkeypatch):
    sizes = _sizes(name, monkeypatch)
    if name == "small":
        _assert_equal(sizes, SHORT_SWEEP)
    else:
        _assert_equal(sizes, BIG_SWEEP, CONFIGS[2:3], steps=(1, 2, 8))


def test_closed_form_on_converted_packs(tmp_path):
    """F32 weights with head dim 24; K-quants mixed per layer with gate and up of different types."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from tests.fixtures import SHAPES, make_gguf_pack, make_pack
    odd, _ = make_pack(tmp_path, SHAPES["odd"], seed=2, name="odd")
    qtypes = {"attn": ["F32", "Q8_0"], "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q6_K",
              "ffn_down_exps": ["Q8_0", "Q4_K"], "norm": "F16", "embd": "Q4_K", "output": "Q8_0"}
    mixed, _ = make_gguf_pack(tmp_path, SHAPES["kquant"], qtypes, seed=3, name="mixed")
    for path in (odd, mixed):
        meta = open_pack(path).meta
        _assert_equal(PackSizes.from_meta(meta, meta["files"]["dense.bin"]["bytes"]), SHORT_SWEEP[:5])


def test_bytes_needed_is_the_dry_runs():
    sizes = plan_sizes(None, "qwen3-30b-a3b")[1]
    for T, cells, kv in ((256, 40960, "f16"), (7168, 40960, "int8"), (20992, 1, "k8v4"), (300, 9000, "q4_0")):
        _, arena, zeros = memory_model.dry_run_prompt(sizes, T, memory_model.PROMPT_CHUNKS_SIMULATED, cells, 1,
                                                      kv=kv)
        one = memory_model.dry_run_prompt(sizes, T, 1, T, 1)[2]
        assert planner.bytes_needed(sizes, T, cells, kv=kv) == arena + one - memory_model.ZEROS_MIN_BYTES
        assert zeros == one


@pytest.mark.parametrize("gib, kv, prefill", [(5, "f16", "auto"), (8, "f16", "auto"), (12, "int8", "auto"),
                                              (24, "k8v4", "auto:4096")])
def test_plans_are_the_dry_runs(gib, kv, prefill, monkeypatch):
    """The bisections in Cython over the closed form choose what the Python ones over the dry run do
    (at 5 GiB fit_context lowers the context too, pricing decode steps at each context it tries)."""
    sizes = plan_sizes(None, "qwen3-30b-a3b")[1]
    cfg = EngineConfig(prefill=prefill, expert_cache="auto")
    plan = make_plan(sizes, cfg, gib << 30, what_if={"kv": kv}).to_dict()
    monkeypatch.setattr(memory_model, "prompt_plan", None)
    assert memory_model.chunk_search(sizes, [256], 4096, 1) is None
    assert make_plan(sizes, cfg, gib << 30, what_if={"kv": kv}).to_dict() == plan


def test_qwen3next_plan_is_the_dry_runs(monkeypatch):
    sizes = plan_sizes(None, "qwen3-next-80b-a3b")[1]
    plan = make_plan(sizes, EngineConfig(), 8 << 30).to_dict()
    assert plan["max_context"] < sizes.args.max_position_embeddings       # lowered to fit
    monkeypatch.setattr(memory_model, "prompt_plan", None)
    assert make_plan(sizes, EngineConfig(), 8 << 30).to_dict() == plan


def test_tables_follow_the_pack():
    """prompt_tables is keyed by the sizes' digest: a pack of other qtypes gets its own."""
    sizes = plan_sizes(None, "tiny")[1]
    layers = [dict(lay) for lay in sizes.layers]
    layers[0] = {**layers[0], "parts": {**layers[0]["parts"], "down": {**layers[0]["parts"]["down"], "qtype": "F32"}}}
    other = dataclasses.replace(sizes, layers=tuple(layers))
    assert other.key != sizes.key
    assert (memory_model.prompt_tables(other)[1] != memory_model.prompt_tables(sizes)[1]).any()


def test_the_arena_of_chunks_holds_the_first_chunks_over_a_quantized_cache():
    """A quantized cache's prompt scratch is the cache's size, so the chunks the arena simulates must
    run over the cache's own cells: over more (as many as the simulated chunks' positions), the
    first-fit placed the 30B shape's blocks otherwise and priced 5.03 GB for a 16,384-token prompt
    in one chunk that took 5.18 GB (the H200 run stopped: 'device pool ... may not grow')."""
    _, sizes = plan_sizes(None, "qwen3-30b-a3b-mtp")
    for kv in KV_FORMATS:
        one = memory_model._prompt(sizes, 16384, 1, 16448, 132, kv=kv)[1]
        assert memory_model.prompt_arena_bytes(sizes, 16384, 16448, 132, kv) >= one, kv
