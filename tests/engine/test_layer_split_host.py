"""A layer split (strata.engine.layer_split, strata.engine.cuda_split) on the CPU: the cards' views of
the pack, the split's plan, and SplitRunner over tests/engine/fake_cuda with two logical cards on
one emulated GPU (--gpus 0,0). The emulated kernels are the same numpy on the same rows split or not,
so the split's logits must equal the unsplit runner's bit for bit; on a GPU test_layer_split_gpu.py
checks the same with the real kernels."""
import contextlib

import numpy as np
import pytest

import strata
from strata.config import EngineConfig
from strata.engine.cuda_runner import CudaRunner
from strata.engine.cuda_split import SplitRunner
from strata.engine.layer_split import Card, StagePack, choose_split, split_text, stage_meta, stage_sizes
from strata.engine.llm import demo_model_path
from strata.engine.planner import PackSizes
from strata.errors import InvalidArgument
from strata.pack import open_pack
from strata.plan import plan_sizes
from tests.engine.layer_split_checks import same_parallel_slots

DEMO = demo_model_path()


def _cfg(**kw):
    return EngineConfig(**{"device": "cuda", "prefill": "24", **kw})


def _same(a, b):
    np.testing.assert_array_equal(a, b)


# ---- the cards' views of the pack ------------------------------------------------------------------
@pytest.mark.parametrize("counts", [(1, 5), (3, 3), (5, 1), (2, 2, 2)])
def test_stage_views_cover_the_pack(counts):
    pack = open_pack(DEMO)
    M = pack.args.num_mtp_layers
    seen, expert_bytes, lo = set(), 0, 0
    for n in counts:
        s = StagePack(pack, lo, lo + n)
        assert s.args.num_hidden_layers == n and s.args.num_mtp_layers == (M if s.last else 0)
        for name in s.dense_names():                 # each tensor's bytes are the pack's, renamed
            t, l = s.dense(name), name.split(".")
            whole = f"blk.{int(l[1]) + lo}.{'.'.join(l[2:])}" if name.startswith("blk.") else name
            _same(t.data, pack.dense(whole).data)
            seen.add(whole)
        if not s.last:      # the next card's first attention norm, for the normed rows it hands on
            assert s.has_dense(f"blk.{n}.attn_norm.weight") and not s.has_dense("output.weight")
        assert s.has_dense("token_embd.weight") == s.first
        for layer in range(n + (M if s.last else 0)):
            _same(s.expert_blob(layer, 3), pack.expert_blob(lo + layer, 3))
            lay = s.meta["experts"]["layers"][layer]        # and where the store reads them: the file slice
            start = s.experts_file.start + lay["offset"] + 3 * lay["stride"]
            _same(np.fromfile(pack.path / "experts.bin", np.uint8, lay["blob_bytes"], offset=start),
                  pack.expert_blob(lo + layer, 3))
        expert_bytes += s.experts_file.nbytes
        assert sum(n for _, n, _ in s.dense_pieces) == sum(t["nbytes"] for t in s.meta["dense"].values())
        lo += n
    assert seen == set(pack.dense_names())
    assert expert_bytes == pack.meta["files"]["experts.bin"]["bytes"]      # the slices tile experts.bin


def test_stage_meta_refuses_a_range_that_is_not_a_split():
    meta = open_pack(DEMO).meta
    with pytest.raises(InvalidArgument, match="is not a split's"):
        stage_meta(meta, 2, 4, True, False)
    with pytest.raises(InvalidArgument, match="is not a split's"):
        stage_meta(meta, 0, 7, True, True)


# ---- the plan --------------------------------------------------------------------------------------
def test_auto_split_caches_the_most_experts():
    _, sizes = plan_sizes(None, "qwen3-30b-a3b")
    cfg = EngineConfig(device="cuda", gpus="0,1", vram_budget_gib="8,12")
    cards = [Card(0, 8 << 30), Card(1, 12 << 30)]
    p = choose_split(sizes, cfg, cards)
    assert sum(p.counts) == 48 and p.source == "auto"
    for a in (p.counts[0] - 1, p.counts[0] + 1):        # its neighbours cache no more
        q = choose_split(sizes, EngineConfig(device="cuda", gpus="0,1", vram_budget_gib="8,12",
                                             layer_split=f"{a},{48 - a}"), cards)
        assert (q.max_context, q.cached_experts) <= (p.max_context, p.cached_experts)
    assert p.counts[0] < p.counts[1]                    # the bigger card takes more layers
    text = split_text(p, cards)
    assert "card 0: GPU 0, layers 0.." in text and "+ head, MTP layer" in text and "hand-off 16384 bytes" in text


def test_split_plan_errors_name_the_card():
    _, sizes = plan_sizes(None, "qwen3-30b-a3b")
    with pytest.raises(InvalidArgument, match=r"card 0 \(GPU 0, layers 0..39\)"):
        choose_split(sizes, EngineConfig(device="cuda", gpus="0,1", layer_split="40,8"),
                     [Card(0, 1 << 30), Card(1, 12 << 30)])
    with pytest.raises(InvalidArgument, match="summing to the model's 48 layers"):
        choose_split(sizes, EngineConfig(device="cuda", gpus="0,1", layer_split="20,20"),
                     [Card(0, 8 << 30), Card(1, 8 << 30)])


def test_stage_sizes_price_a_card_as_its_own_model():
    pack = open_pack(DEMO)
    sizes = PackSizes.from_meta(pack.meta, pack.meta["files"]["dense.bin"]["bytes"])
    a, b = stage_sizes(sizes, 0, 2), stage_sizes(sizes, 2, 6)
    assert a.args.num_hidden_layers == 2 and b.args.num_mtp_layers == 1
    # every byte of dense.bin on exactly one card, but the next card's first norm on both sides
    norm = pack.meta["dense"]["blk.2.attn_norm.weight"]["nbytes"]
    assert sum(t["nbytes"] for t in a.dense.values()) + sum(t["nbytes"] for t in b.dense.values()) == \
        sum(t["nbytes"] for t in sizes.dense.values()) + norm


# ---- the runner over two logical cards --------------------------------------------------------------
@pytest.mark.parametrize("cache", [None, "20"])
@pytest.mark.parametrize("lag", [None, "apart", "oldest"])
def test_split_logits_equal_unsplit(fake, rng, cache, lag):
    """Resident, and streamed through a cache of 20 slots on each card: prompts of three chunks (of
    24, the grouped path, and a decode-path tail), logits_all, then decode steps eager, captured and
    replayed. lag: each stream's work in a queue of its own (fake_cuda.lagging's apart), so a
    hand-off without its events reads rows not yet written ("apart") or rewritten by the card
    before, running ahead ("oldest")."""
    pack = open_pack(DEMO)
    extra = {} if cache is None else {"expert_cache": cache}
    one = CudaRunner(pack, 96, _cfg(**extra))
    with contextlib.ExitStack() as stack:
        if lag:
            stack.enter_context(fake.lagging(apart=lag if lag == "oldest" else True))
        two = SplitRunner(pack, 96, _cfg(gpus="0,0", layer_split="2,4", **extra))
        assert [s.args.num_hidden_layers for s in two.stages] == [2, 4]
        assert two.stages[0].store.resident == (cache is None)
        ids = rng.integers(0, pack.args.vocab_size, 70).tolist()
        _same(two.logits_all(ids), one.logits_all(ids))
        _same(two.prefill(ids[:60], 0), one.prefill(ids[:60], 0))
        for t in ids[60:66]:
            _same(two.decode(t), one.decode(t))
    assert set(two.last.steps.graphs) == {1} and set(two.stages[0].steps.graphs) == {1}
    assert two.last.steps.step_times["graph"] and two.stages[0].steps.step_times["graph"]
    st = two.status()["layer_split"]
    assert st["counts"] == [2, 4] and st["handoff_bytes_per_token"] == 2 * 4 * pack.args.hidden_size
    assert st["handoff_ms_per_step"] is not None and len(st["cards"]) == 2
    assert st["peer_access"] == [None]                  # one GPU: a device copy
    if cache is not None:           # each card's cache admitted its own misses
        assert all(c["expert_cache"]["misses"] > 0 for c in st["cards"])
    summed = two.status()["expert_cache"]          # the Monitor's view: every card's cache
    assert summed["slots"] == sum(c["expert_cache"]["slots"] for c in st["cards"])
    assert summed["misses"] == sum(c["expert_cache"]["misses"] for c in st["cards"])


def test_split_three_cards_and_a_reused_prefix(fake, rng):
    pack = open_pack(DEMO)
    one = CudaRunner(pack, 96, _cfg())
    three = SplitRunner(pack, 96, _cfg(gpus="0,0,0", layer_split="1,3,2"))
    ids = rng.integers(0, pack.args.vocab_size, 30).tolist()
    _same(three.prefill(ids, 0), one.prefill(ids, 0))
    more = ids[:20] + rng.integers(0, pack.args.vocab_size, 12).tolist()
    n = three.reusable_prefix(more)
    assert n == 20 and one.reusable_prefix(more) == 20
    _same(three.prefill(more, n), one.prefill(more, n))
    _same(three.decode(more[-1]), one.decode(more[-1]))


def test_split_warm_up_leaves_nothing(fake, rng):
    pack = open_pack(DEMO)
    one = CudaRunner(pack, 96, _cfg(expert_cache="20"))
    two = SplitRunner(pack, 96, _cfg(gpus="0,0", layer_split="3,3", expert_cache="20"))
    before = [s.store.snapshot() for s in two.stages]
    two.warm_up()
    for s, snap in zip(two.stages, before):
        assert s.cached_ids == [] and s._last is None
        _same(s.store.slot_of, snap["arrays"]["slot_of"])        # the cache holds what it held
        assert s.store.stats == snap["stats"] and not s.steps.step_times["graph"]
    assert two.cached_ids == [] and two.status()["layer_split"]["handoff_ms_per_step"] is None
    assert all(1 in s.steps.graphs for s in two.stages)     # captured in the warm-up
    ids = rng.integers(0, pack.args.vocab_size, 30).tolist()
    _same(two.prefill(ids, 0), one.prefill(ids, 0))
    _same(two.decode(ids[0]), one.decode(ids[0]))


def test_llm_over_a_split_generates_what_one_card_does(fake):
    one = strata.LLM(device="cuda")
    two = strata.LLM(device="cuda", gpus="0,0", vram_budget_gib="3,3")
    assert type(two.runner).__name__ == "SplitRunner"
    assert two.generate("Once upon a time", max_tokens=12).text == one.generate("Once upon a time", max_tokens=12).text
    status = two.status()
    assert status["layer_split"]["source"] == "auto" and sum(status["layer_split"]["counts"]) == 6


def test_split_refuses_a_budget_the_gpu_has_not(fake):
    with pytest.raises(InvalidArgument, match="ask more than its"):
        SplitRunner(open_pack(DEMO), 96, _cfg(gpus="0,0", vram_budget_gib="6,6"))


def test_bench_over_a_split_reports_the_cards_and_the_hand_off(fake):
    from strata.bench import run_bench
    llm = strata.LLM(device="cuda", gpus="0,0", layer_split="2,4", expert_cache="20", max_context=256)
    res = run_bench(llm, [32], 6)
    assert res.error is None, res.error
    split = res.plan["layer_split"]
    assert split["counts"] == [2, 4] and split["cache_slots"] == [20, 20]
    assert split["handoff_ms_per_step"] is not None and split["host_step_ms"] is not None
    assert res.decode[32]["hit_rate"] is not None and res.decode[32]["tok_s"] > 0     # both cards' counters, summed
    from strata.bench import report
    line = next(r for r in report(res).splitlines() if r.startswith("layer split 2,4"))
    assert "cache slots 20/20" in line and "ms a decode step" in line


def test_qwen3next_split_keeps_layer_kinds_and_equals_one_card(fake, tmp_path, rng):
    """A hybrid's cards start at multiples of its full-attention interval (2 here), each keeps its
    DeltaNet states, and a follow-up turn resumes from the prompt's snapshot on every card."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack
    path, _ = make_next_pack(tmp_path, NEXT_SHAPES["tiny"], seed=3)
    pack = open_pack(path)
    with pytest.raises(InvalidArgument, match="multiples of its full-attention interval"):
        SplitRunner(pack, 96, _cfg(gpus="0,0", layer_split="1,3"))
    one = CudaRunner(pack, 96, _cfg(prefill="12"))
    two = SplitRunner(pack, 96, _cfg(prefill="12", gpus="0,0", layer_split="2,2"))
    assert [s.hybrid for s in two.stages] == [True, True]
    assert [[s.args.is_full_attention(l) for l in range(2)] for s in two.stages] == [[False, True]] * 2
    ids = rng.integers(0, pack.args.vocab_size, 30).tolist()
    _same(two.prefill(ids[:25], 0), one.prefill(ids[:25], 0))
    for t in ids[25:29]:
        _same(two.decode(t), one.decode(t))
    follow = ids[:25] + rng.integers(0, pack.args.vocab_size, 9).tolist()      # resumes from the snapshot at 25
    n = two.reusable_prefix(follow)
    assert n == one.reusable_prefix(follow) == 25
    _same(two.prefill(follow, n), one.prefill(follow, n))
    _same(two.decode(follow[-1]), one.decode(follow[-1]))


@pytest.mark.parametrize("cache", [None, "20"])
def test_parallel_slots_over_a_split_equal_one_card(fake, rng, cache):
    """--parallel 3 over two logical cards: each card's slots in lockstep, batched steps of any
    subset of slots (eager, captured, replayed) equal one card's batched steps, slot by slot."""
    pack = open_pack(DEMO)
    extra = {} if cache is None else {"expert_cache": cache}
    one = CudaRunner(pack, 96, _cfg(parallel=3, **extra))
    two = SplitRunner(pack, 96, _cfg(parallel=3, gpus="0,0", layer_split="3,3", **extra))
    same_parallel_slots(one, two, rng)
    assert {2, 3} <= set(two.last.steps.graphs) and {2, 3} <= set(two.stages[0].steps.graphs)
    two.use(1)
    assert two.best_slot(two.cached_ids[:5] + [1], [0, 1, 2]) == 1       # the slot holding the prefix


def test_parallel_slots_over_a_qwen3next_split(fake, rng, tmp_path):
    """A hybrid's batched rows name each slot's DeltaNet states on every card (CudaRunner.batch_rows)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack
    pack = open_pack(make_next_pack(tmp_path, dict(NEXT_SHAPES["tiny"], head_dim=64), seed=13)[0])
    one = CudaRunner(pack, 96, _cfg(parallel=3, prefill="12"))
    two = SplitRunner(pack, 96, _cfg(parallel=3, prefill="12", gpus="0,0", layer_split="2,2"))
    same_parallel_slots(one, two, rng)


def test_llm_parallel_over_a_split_serves_threads_as_one_card(fake):
    from tests.engine.threads import in_threads
    prompts = ["Once upon a time", "def fib(n):", "The capital of France is"]
    one = strata.LLM(device="cuda", parallel=3)
    two = strata.LLM(device="cuda", parallel=3, gpus="0,0", layer_split="2,4")
    want = {p: one.generate(p, max_tokens=10).text for p in prompts}
    got, errors = in_threads(lambda p: two.generate(p, max_tokens=10).text, prompts)
    assert not errors and got == want


@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_kv_resident_over_a_split_equals_one_card(fake, rng, fmt):
    """--kv-resident 16: each card's K/V on the host with its newest 16 cells in VRAM, logits and a
    reused prefix (the window refilled from the host) as one card's with the same setting."""
    pack = open_pack(DEMO)
    one = CudaRunner(pack, 96, _cfg(kv=fmt, kv_resident=16, prefill="12"))
    two = SplitRunner(pack, 96, _cfg(kv=fmt, kv_resident=16, prefill="12", gpus="0,0", layer_split="4,2"))
    assert all(s.kv.on_host and s.kv.vram_window == 16 for s in two.stages)
    V = pack.args.vocab_size
    ids = rng.integers(0, V, 40).tolist()
    _same(two.prefill(ids, 0), one.prefill(ids, 0))
    for t in rng.integers(0, V, 5).tolist():
        _same(two.decode(t), one.decode(t))
    # a prefix reused by a prompt shorter than the window: the ring's slots of the reused cells held
    # the longer sequence's newer cells until refilled from the host
    back = ids[:20] + rng.integers(0, V, 3).tolist()
    n = two.reusable_prefix(back)
    assert n == one.reusable_prefix(back)
    _same(two.prefill(back, n), one.prefill(back, n))
    _same(two.decode(back[-1]), one.decode(back[-1]))


def test_cpu_experts_over_a_split_equal_one_card(fake, rng):
    """--cpu-experts 1 with no expert cached: each card's host computes every routed expert of its
    layers, in prompt chunks and one-token decode steps, as one card's host does (the same experts
    on the host, so the same bits; a partial share splits each card's own misses, which a split
    changes, and test_cpu_experts_split_host.py bounds that arithmetic)."""
    pack = open_pack(DEMO)
    one = CudaRunner(pack, 96, _cfg(expert_cache="0", cpu_experts="1"))
    two = SplitRunner(pack, 96, _cfg(expert_cache="0", cpu_experts="1", gpus="0,0", layer_split="3,3"))
    assert all(s.store.host_experts is not None for s in two.stages)
    ids = rng.integers(0, pack.args.vocab_size, 50).tolist()
    _same(two.prefill(ids[:44], 0), one.prefill(ids[:44], 0))
    for t in ids[44:]:
        _same(two.decode(t), one.decode(t))
    assert all(s.status()["expert_cache"]["host"]["experts"] > 0 for s in two.stages)


@pytest.mark.parametrize("spec", ["2", "auto"])
def test_speculation_over_a_split_emits_plain_greedy(fake, spec):
    """--mtp --spec over two logical cards: verify windows through both cards, the draft layer on
    the last; greedy output equals plain greedy's (row-invariant steps), and the drafts ran."""
    plain = strata.LLM(device="cuda", max_context=512)
    two = strata.LLM(device="cuda", max_context=512, gpus="0,0", layer_split="2,4", mtp=True, spec=spec)
    assert two.runner.spec and two.runner.last.drafter is not None
    assert two.runner.stages[0].drafter is None          # the first card has no draft layer
    for prompt in ("Once upon a time", "def fibonacci(n):"):
        assert two.generate(prompt, max_tokens=20).text == plain.generate(prompt, max_tokens=20).text
    st = two.status()["speculation"]
    assert st["verify_passes"] > 0 and st["draft_n"] > 0
    # the cards' tokens are the split's after windows that accepted some drafts
    r = two.runner
    assert all(s.cached_ids == r.cached_ids for s in r.stages)


def test_sampled_speculation_over_a_split_equals_one_card(fake):
    """Sampled windows (the drafts' and the target's distributions on the host): the same seed gives
    one card's tokens, window for window."""
    one = strata.LLM(device="cuda", max_context=512, mtp=True, spec=3)
    two = strata.LLM(device="cuda", max_context=512, gpus="0,0", layer_split="3,3", mtp=True, spec=3)
    for seed in (1, 2):
        a = one.generate("The capital of France is", max_tokens=24, temperature=0.9, seed=seed).text
        b = two.generate("The capital of France is", max_tokens=24, temperature=0.9, seed=seed).text
        assert a == b
    assert two.status()["speculation"]["verify_passes"] > 0


def test_speculation_over_a_qwen3next_split_emits_plain_greedy(fake, tmp_path, rng):
    """Each card keeps its DeltaNet states after each row of a verify window and rolls back to the
    last accepted one: greedy output with --spec 1..4, and with drafts forced to keep 0..N of a
    window, is plain greedy's; a follow-up turn resumes from a snapshot with the draft layer's row."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.engine.next_spec_checks import check_spec_is_plain_greedy, generate
    from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack
    pack = open_pack(make_next_pack(tmp_path, NEXT_SHAPES["tiny"], seed=21, mtp=True)[0])
    plain = CudaRunner(pack, 128, _cfg(prefill="12"))
    two = SplitRunner(pack, 128, _cfg(prefill="12", gpus="0,0", layer_split="2,2", mtp=True, spec=4))
    prompt = rng.integers(0, pack.args.vocab_size, 14).tolist()
    want, kept = check_spec_is_plain_greedy(plain, two, prompt, 24, wrong=[-1, 0, 2, 1, -1])
    assert kept > 0 and two.spec_stats.draft_n > 0
    assert all(s.cached_ids == two.cached_ids for s in two.stages)
    follow = prompt + want[:6] + rng.integers(0, pack.args.vocab_size, 5).tolist()
    plain.reset()
    plain.prefill(prompt, 0, logits=False)
    assert generate(plain, follow, 8) == generate(two, follow, 8)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_kept_conversations_over_a_split_equal_one_card(fake, rng, tmp_path, arch):
    """A conversation pushed out of the only slot is kept in host RAM (every card's cells, a hybrid's
    states) and copied back when a request resumes it: the same prefix and logits as one card's."""
    if arch == "qwen3next":
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
        from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack
        pack, counts = open_pack(make_next_pack(tmp_path, NEXT_SHAPES["tiny"], seed=3)[0]), "2,2"
    else:
        pack, counts = open_pack(DEMO), "2,4"
    one = CudaRunner(pack, 128, _cfg(prefill="12"))
    two = SplitRunner(pack, 128, _cfg(prefill="12", gpus="0,0", layer_split=counts))
    V = pack.args.vocab_size
    a, b = rng.integers(0, V, 60).tolist(), rng.integers(0, V, 50).tolist()
    for r in (one, two):
        r.prefill(a, r.reusable_prefix(a))
        r.prefill(b, r.reusable_prefix(b))         # pushes a out: kept
    assert two.kept.status()["conversations"] == one.kept.status()["conversations"] == 1
    more = a + rng.integers(0, V, 6).tolist()
    n = two.reusable_prefix(more)
    assert n == one.reusable_prefix(more) == 60
    assert two.status()["kept_conversations"]["restored"] == 1
    assert all(s.cached_ids == a for s in two.stages)
    _same(two.prefill(more, n), one.prefill(more, n))
    _same(two.decode(more[-1]), one.decode(more[-1]))


def test_plan_cli_prints_the_split_without_a_gpu():
    import json
    import subprocess
    import sys
    base = [sys.executable, "-m", "strata", "plan", "--synthetic", "qwen3-30b-a3b", "--gpus", "0,1"]
    r = subprocess.run(base + ["--vram-budget-gib", "8,12"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "layer split (auto) over 2 cards" in r.stdout and "plan for card 1 (GPU 1, layers" in r.stdout
    r = subprocess.run(base + ["--vram-budget-gib", "8,12", "--layer-split", "20,28", "--json"], capture_output=True,
                       text=True, timeout=120)
    got = json.loads(r.stdout)["layer_split"]
    assert got["counts"] == [20, 28] and got["source"] == "given" and len(got["plans"]) == 2
    r = subprocess.run(base, capture_output=True, text=True, timeout=120)      # no GPU to read budgets from
    assert r.returncode != 0 and "give each card's budget" in r.stderr and "Traceback" not in r.stderr


def test_kv_auto_over_a_split_prices_every_format_per_card(fake):
    """--kv auto over a split: each format's split (the context every card holds, the experts cached
    over the cards), and kv_choice's rule over them; a tight pair of cards takes a smaller format."""
    from strata.engine.kv_choice import GPU_KV_FORMATS
    from strata.engine.kv_choice import resolve_split_kv, split_kv_trade
    _, sizes = plan_sizes(None, "qwen3-30b-a3b")
    cfg = EngineConfig(device="cuda", gpus="0,1", vram_budget_gib="6,6", kv="auto")
    cards = [Card(0, 6 << 30), Card(1, 6 << 30)]
    options = split_kv_trade(sizes, cfg, cards)
    assert [o.kv for o in options][0] == "f16" and {o.kv for o in options} == set(GPU_KV_FORMATS)
    f16 = options[0]
    # a smaller K/V leaves the cards more room for experts
    assert all(o.cache_slots >= f16.cache_slots for o in options[1:] if o.max_context >= f16.max_context)
    chosen, why = resolve_split_kv(sizes, cfg, cards)
    assert chosen.kv in GPU_KV_FORMATS and chosen.kv != "auto" and "over the layer split" in why
    llm = strata.LLM(device="cuda", gpus="0,0", layer_split="3,3", kv="auto")
    assert llm.config.kv != "auto" and all(s.kv_format == llm.config.kv for s in llm.runner.stages)
    assert "over the layer split" in llm.kv_source


def test_auto_split_breaks_near_ties_by_the_prompts_busiest_bus():
    """Splits caching within 1% of the most experts decode alike; auto takes the one whose pipelined
    prompt waits least for its busiest card's bus (int8 K/V at 6+6 GiB: an even split, where the
    most cached experts alone took an uneven one, one expert more)."""
    from strata.engine.layer_split import NEAR_TIE, plan_split
    _, sizes = plan_sizes(None, "qwen3-30b-a3b")
    cfg = EngineConfig(device="cuda", gpus="0,1", vram_budget_gib="6,6", kv="int8")
    cards = [Card(0, 6 << 30), Card(1, 6 << 30)]
    p = choose_split(sizes, cfg, cards)
    every = [plan_split(sizes, cfg, cards, [a, 48 - a]) for a in range(1, 48)]
    most = max(q.cached_experts for q in every)
    near = [q for q in every if q.max_context == p.max_context and q.cached_experts >= (1 - NEAR_TIE) * most]
    assert p.counts in [q.counts for q in near]
    assert p.prompt_tok_s == max(q.prompt_tok_s for q in near)
    assert p.cached_experts < most          # the tie-break did choose: the most-cached split is another


def test_stage_tensors_take_strange_names_calmly():
    """Names from a stranger's pack.json: only blk.<digits>.* is a layer's; the rest stays on every card."""
    from strata.engine.layer_split import stage_tensors
    args = {"num_mtp_layers": 0, "tie_word_embeddings": False}
    dense = {n: {} for n in ("blk.0.attn_norm.weight", "blk.1.attn_norm.weight", "blk.x.w", "blk.", "blk.-1.w",
                             "rope_freqs", "token_embd.weight", "output.weight")}
    first = stage_tensors(args, dense, 0, 1, True, False)
    last = stage_tensors(args, dense, 1, 2, False, True)
    assert set(first) == {"blk.0.attn_norm.weight", "blk.1.attn_norm.weight", "blk.x.w", "blk.", "blk.-1.w",
                          "rope_freqs", "token_embd.weight"}
    assert set(last) == {"blk.0.attn_norm.weight", "blk.x.w", "blk.", "blk.-1.w", "rope_freqs", "output.weight"}
