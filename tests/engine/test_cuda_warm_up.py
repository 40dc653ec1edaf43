"""CudaRunner.warm_up: it runs what a first chat turn runs (a prompt, decode steps through the CUDA
graph, pick) and leaves nothing a request can observe: KV bytes, cached prefix, the expert cache's
placement, bytes and counters, the routing profile, the byte counters, the decode timings. The
first request after it looks up no kernel, loads no library and captures no graph: every decode
step is a replay. Emulated here (tests/engine/fake_cuda) over the store's layouts: resident,
streamed, a prompt that borrows the cache's tail, part of experts.bin unpinned; the same checks on
the device in the tests marked gpu."""
import dataclasses

import numpy as np
import pytest

from strata.config import EngineConfig
from strata.engine import memory_model
from strata.engine.cuda_runner import CudaRunner
from strata.engine.llm import LLM, demo_model_path
from strata.errors import InvalidArgument
from strata.pack import open_pack

DEMO = demo_model_path()
# The pool warm-up grew stays, as after any request; the budget is read off the device's free memory
# when a runner starts, so a second runner on the same GPU (the cold twin) sees less.
MEMORY_FIGURES = ("vram_used_bytes", "prompt_bytes", "vram_budget_bytes")


def _configs(pack):
    """EngineConfig kwargs of each store layout (the loan's budget as test_expert_streaming_host's)."""
    mandatory = CudaRunner(pack, 96, EngineConfig(device="cuda", prefill="24")).plan.mandatory_bytes
    experts = pack.meta["files"]["experts.bin"]["bytes"]
    return {"resident": {}, "streamed": {"expert_cache": "20"},
            "lfu": {"expert_cache": "9", "expert_policy": "lfu"},
            "loan": {"vram_budget_gib": (mandatory + 15_000_000) / 2**30},
            "part-pinned": {"expert_cache": "20", "pin_limit_gib": 0.6 * experts / 2**30}}


def _device_bytes(runner, buf, nbytes=None) -> np.ndarray:
    out = np.empty(buf.nbytes if nbytes is None else nbytes, np.uint8)
    buf.copy_to_host(out, runner.stream)
    runner.stream.synchronize()
    return out


def observable(runner, addresses: bool = True) -> dict:
    """Everything of the runner a later request (or the Monitor) can see, as plain values; without
    `addresses`, less the expert table (its entries are this runner's addresses), to compare two."""
    store = runner.store
    status = runner.status()
    gpu = {k: v for k, v in status.pop("gpu").items() if k not in MEMORY_FIGURES}
    # a quarter of the host memory available when the runner started: two runners made a moment
    # apart read two figures (seen when other processes ran beside the tests)
    status["kept_conversations"].pop("budget_bytes", None)
    decode = status.pop("decode")
    seen = {"status": status, "gpu": gpu, "host_ms": decode["host_ms"], "cuda_graphs": decode["cuda_graphs"],
            "cached_ids": list(runner.cached_ids), "no_logits": runner._last is None,
            "uses": runner.ops.expert_uses, "ops_h2d": runner.ops.bytes_h2d, "tick": store.tick,
            "stats": dataclasses.replace(store.stats), "k": _device_bytes(runner, runner.kv.k), "v": _device_bytes(runner, runner.kv.v)}
    for name in ("uses", "last_use", "freq", "slot_of") + (("table_host",) if addresses else ()):
        seen[name] = getattr(store, name).copy()
    if addresses:
        seen["table"] = _device_bytes(runner, store.table)
        assert np.array_equal(seen["table"].view(np.uint64), store.table_host.reshape(-1)), "table differs from its host copy"
    if not store.resident:
        seen["slot_owner"] = store.slot_owner.copy()
        seen["slots"] = _slot_bytes(runner)
    return seen


def _slot_bytes(runner) -> list:
    """The bytes of every cache slot's expert blob, and (checked here) that they are its blob in experts.bin."""
    store = runner.store
    blobs = np.memmap(store.path, np.uint8, mode="r")
    held = _device_bytes(runner, store.slots)
    out = []
    for slot, key in enumerate(store.slot_owner.tolist()):
        if key < 0:
            continue
        l, e = divmod(key, store.num_experts)
        n, off = int(store._blob[l]), int(store._offsets[l, e])
        got = held[slot * store.slot_bytes:slot * store.slot_bytes + n]
        assert np.array_equal(got, blobs[off:off + n]), f"cache slot {slot} does not hold expert {(l, e)}"
        out.append(got.copy())
    return out


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key in before:
        a, b = before[key], after[key]
        if isinstance(a, np.ndarray):
            assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), key
        elif key == "slots":
            assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b)), key
        else:
            assert a == b, (key, a, b)


@pytest.mark.parametrize("layout", ["resident", "streamed", "lfu", "loan", "part-pinned"])
def test_emulated_warm_up_leaves_nothing_observable(fake, rng, layout):
    pack = open_pack(DEMO)
    config = EngineConfig(device="cuda", prefill="24", **_configs(pack)[layout])
    warm, cold = CudaRunner(pack, 96, config), CudaRunner(pack, 96, config)
    before = observable(warm)
    fake.launches.clear()
    warm.warm_up()
    assert fake.launches, "the warm-up ran nothing"
    if warm.use_graphs:
        assert 1 in warm.graphs and warm.graphs[1].launches >= 1     # captured and replayed
    assert_same(before, observable(warm))
    assert warm.reusable_prefix([0, 1, 2, 3]) == 0
    with pytest.raises(InvalidArgument, match="needs the logits"):
        warm.pick(None, 0.5)
    # the same request on the warmed runner and a cold one: the same logits, bit for bit, and the
    # same counters after it (the warm-up's show nowhere)
    ids = rng.integers(0, pack.args.vocab_size, 30).tolist()
    np.testing.assert_array_equal(warm.prefill(ids[:20], 0), cold.prefill(ids[:20], 0))
    for t in ids[20:]:
        np.testing.assert_array_equal(warm.decode(t), cold.decode(t))
    w, c = observable(warm, addresses=False), observable(cold, addresses=False)
    for seen in (w, c):
        del seen["host_ms"]             # the warmed runner's steps are replays, the cold one's are not all
    assert_same(c, w)


def test_emulated_warm_up_keeps_a_cached_prefix(fake, rng):
    """Called after a request, the warm-up overwrites the prefix's first cells and gives them back:
    the next turn reuses the prefix and decodes what a runner that never warmed up decodes."""
    pack = open_pack(DEMO)
    warm, cold = CudaRunner(pack, 96), CudaRunner(pack, 96)
    ids = rng.integers(0, pack.args.vocab_size, 40).tolist()
    for r in (warm, cold):
        r.prefill(ids[:30], 0)
        r.decode(ids[30])
    warm.warm_up()
    assert warm.cached_ids == ids[:31] and warm.reusable_prefix(ids) == 31
    np.testing.assert_array_equal(warm.prefill(ids[:36], 31), cold.prefill(ids[:36], 31))
    for t in ids[36:]:
        np.testing.assert_array_equal(warm.decode(t), cold.decode(t))


def test_emulated_warm_up_fits_a_tiny_context(fake):
    runner = CudaRunner(open_pack(DEMO), 6)
    before = observable(runner)
    runner.warm_up()                    # a 3-token prompt and 3 steps: every cell of the context
    assert_same(before, observable(runner))
    assert 1 in runner.graphs


class Spy:
    """Counts what a first request should no longer pay: library loads, kernel lookups, graph
    captures, driver allocations (device and pinned)."""

    def __init__(self, monkeypatch, rt, graphs, runner):
        from strata.engine import memory_model
        self.rt, self.runner, self.loads, self.captures, self.allocs, self.replays = rt, runner, [], [], [], []
        replay = memory_model._run_prompt
        monkeypatch.setattr(memory_model, "_run_prompt", lambda *a, **k: self.replays.append(a[1]) or replay(*a, **k))
        load, begin = rt.load_library, graphs.begin_capture
        monkeypatch.setattr(rt, "load_library", lambda name: self.loads.append(name) or load(name))
        monkeypatch.setattr(graphs, "begin_capture", lambda stream: self.captures.append(1) or begin(stream))
        for cls in (rt.DeviceBuffer, rt.HostBuffer):
            if isinstance(cls.__init__, type(object.__init__)):
                continue                # a compiled type: not counted
            init = cls.__init__

            def counting(obj, *args, _init=init, **kwargs):
                self.allocs.append(type(obj).__name__)
                _init(obj, *args, **kwargs)
            monkeypatch.setattr(cls, "__init__", counting)
        self.mark()

    def mark(self):
        self.loads.clear(), self.captures.clear(), self.allocs.clear(), self.replays.clear()
        self.libraries = set(getattr(self.rt, "_libraries", ()))      # the runtime's loaded libraries
        self.kernels = set(self.runner.ops._kernels)
        self.graphs = dict(self.runner.graphs)
        self.pool_bytes = self.runner.ops.pool.capacity_bytes

    def new(self) -> dict:
        r = self.runner
        return {"loads": list(self.loads) + sorted(set(getattr(self.rt, "_libraries", ())) - self.libraries),
                "captures": len(self.captures), "allocs": list(self.allocs),
                "kernels": sorted(set(r.ops._kernels) - self.kernels),
                "graphs": [T for T, g in r.graphs.items() if self.graphs.get(T) is not g],
                "pool_bytes": r.ops.pool.capacity_bytes - self.pool_bytes, "loan_replays": list(self.replays)}


def chat_turn(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def first_request_pays_nothing(llm, spy, warm: bool) -> dict:
    """A sampled, a greedy and a longer chat turn after (or without) the warm-up; -> what each one paid."""
    if warm:
        llm.warm_up()
    spy.mark()
    paid = []
    for text, params in (("Write a haiku about the sea, please.", dict(temperature=0.7, top_k=40, seed=1)),
                         ("Now one about the mountains.", dict(temperature=0.0)),
                         ("A longer turn: " + "tell me more about the mountains and the sea. " * 8, {})):
        ids = chat_turn(llm, text)
        out = llm.generate(ids, max_tokens=4, **params)
        assert len(out.token_ids) >= 1
        paid.append(spy.new())
        spy.mark()
    return paid


NOTHING = {"loads": [], "captures": 0, "allocs": [], "kernels": [], "graphs": [], "pool_bytes": 0, "loan_replays": []}


@pytest.mark.parametrize("layout", ["resident", "streamed"])
def test_emulated_first_request_after_warm_up_loads_and_captures_nothing(fake, monkeypatch, layout):
    pack = open_pack(DEMO)
    kwargs = _configs(pack)[layout]
    cold = LLM(device="cuda", max_context=256, **kwargs)
    paid = first_request_pays_nothing(cold, Spy(monkeypatch, fake, fake, cold.runner), warm=False)
    # the spies see what a cold first request pays; the greedy second turn its argmax kernel; a
    # streamed prompt's loan is priced in closed form (strata._ext.prompt_plan), no dry run
    assert paid[0]["loads"] and paid[0]["kernels"] and paid[0]["captures"] == 1 and paid[0]["graphs"] == [1]
    assert {**paid[1], "loan_replays": []} == {**NOTHING, "loads": ["argmax"], "kernels": ["strata_argmax_f32"]}
    assert bool(paid[2]["loan_replays"]) == (layout == "streamed" and memory_model.prompt_plan is None)
    warm = LLM(device="cuda", max_context=256, **kwargs)
    spy = Spy(monkeypatch, fake, fake, warm.runner)
    assert warm.runner.status()["decode"]["graphs"] == {}
    paid = first_request_pays_nothing(warm, spy, warm=True)
    assert paid == [NOTHING] * 3
    host_ms = warm.status()["decode"]["host_ms"]
    assert list(host_ms) == ["graph"] and host_ms["graph"]["steps"] >= 2      # every step a replay


# ---- on the device ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["resident", "streamed", "loan"])
def test_warm_up_leaves_nothing_observable_on_the_device(rng, layout):
    pack = open_pack(DEMO)
    config = EngineConfig(device="cuda", prefill="24", **_configs(pack)[layout])
    warm, cold = CudaRunner(pack, 96, config), CudaRunner(pack, 96, config)
    before = observable(warm)
    warm.warm_up()
    assert 1 in warm.graphs and warm.graphs[1].launches >= 1
    assert_same(before, observable(warm))
    ids = rng.integers(0, pack.args.vocab_size, 30).tolist()
    np.testing.assert_array_equal(warm.prefill(ids[:20], 0), cold.prefill(ids[:20], 0))
    for t in ids[20:]:              # graph replays against the cold runner's eager step and capture: bitwise
        np.testing.assert_array_equal(warm.decode(t), cold.decode(t))
    w, c = observable(warm, addresses=False), observable(cold, addresses=False)
    # on the device an admission lands when its copy has (an event query), so with experts streaming
    # the placement (and the hits and ring uploads it makes) may differ between two runs: compare what
    # the routing decides
    keep = None if warm.store.resident else ("cached_ids", "uses", "freq", "tick", "k", "v")
    for seen in (w, c):
        del seen["host_ms"]
        for key in set(seen) - set(keep or seen):
            del seen[key]
    assert_same(c, w)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["resident", "streamed"])
def test_first_request_after_warm_up_loads_and_captures_nothing_on_the_device(monkeypatch, layout):
    from strata._ext import graphs, runtime
    kwargs = _configs(open_pack(DEMO))[layout]
    llm = LLM(device="cuda", max_context=256, **kwargs)
    spy = Spy(monkeypatch, runtime, graphs, llm.runner)     # compiled buffers: allocations not counted
    paid = first_request_pays_nothing(llm, spy, warm=True)
    assert paid == [NOTHING] * 3
    host_ms = llm.status()["decode"]["host_ms"]
    assert list(host_ms) == ["graph"] and host_ms["graph"]["steps"] >= 2


class _Draws:
    def draw(self) -> float:
        return 0.5


def _greedy_spec(runner, ids: list, k: int) -> list:
    from strata.config import SamplingParams
    runner.reset()
    runner.prefill(ids, 0, logits=False)
    out = [runner.pick(SamplingParams(), 0.5)]
    while len(out) < k:
        out += runner.speculate(out[-1], SamplingParams(), _Draws(), k - len(out))
    return out[:k]


@pytest.mark.parametrize("spec,layout", [("2", {}), ("auto", {}), ("2", {"expert_cache": "20"}),
                                         ("3", {"draft_window": 8})])
def test_emulated_warm_up_captures_the_speculation_windows(fake, rng, monkeypatch, spec, layout):
    """With --mtp --spec the warm-up also captures the greedy window graph of each draft count the
    runner may run (strata.engine.cuda_window), and still leaves nothing observable: the first
    request's windows are replays, and its tokens are a cold runner's. With --draft-window 8 (pages
    of 8: a ring of 16 cells) the warm-up's draft cells go back into the ring as well."""
    from strata import config as strata_config
    from strata.config import spec_max_drafts
    monkeypatch.setattr(strata_config, "DRAFT_RING_PAGE_CELLS", 8)
    pack = open_pack(DEMO)
    config = EngineConfig(device="cuda", prefill="24", mtp=True, spec=spec, **layout)
    warm, cold = CudaRunner(pack, 96, config), CudaRunner(pack, 96, config)
    before = observable(warm)
    warm.warm_up()
    assert_same(before, observable(warm))
    drafts = range(1 if spec == "auto" else int(spec), spec_max_drafts(spec) + 1)
    assert {f"spec{n}" for n in drafts} <= set(warm.graphs)
    captured = dict(warm.graphs)
    ids = rng.integers(0, pack.args.vocab_size, 20).tolist()
    assert _greedy_spec(warm, ids, 24) == _greedy_spec(cold, ids, 24)
    assert all(warm.graphs[k] is g for k, g in captured.items())      # nothing captured again
    assert warm.device_windows > 0
