"""GGUFs with the per-tensor quant types of llama-quantize's presets (tests/pack/quant_presets.py:
embedding, attention, experts with ffn_down in another type than gate/up, output head), converted
and run by the GPU engine against the numpy engine: logits of a prompt and of greedy steps within
REL, and the same greedy tokens, picked on the device.

Runs on the emulated runtime (tests/engine/fake_cuda, in CI) and on a real GPU (marked gpu). The
model: D = 256 (K-quant rows; a Q3_K embedding row is 110 bytes, so rows start only 2-byte aligned:
the load-time failure of issue #11), H/Hk = 4 (as Qwen3-MoE's GQA >= 4, which the presets' attn_v
rules read), 4 experts top-2, 2 layers (use_more_bits picks layer 1; the first-eighth rules pick
no layer of 2). A 21-token prompt in chunks of 16 and 5 takes the tensor-core and GEMV paths and the
grouped and fused MoE; the decode steps run through CUDA graphs, the embedding from device-side ids.

Bound: max |GPU - oracle| <= REL * max |oracle logit| for every preset, where the oracle is
tests/engine/cpu_f16_kv.py (f16 K/V and the tensor-core GEMMs' f16 inputs). The bound is the same for
every type: each dequantization on the device is bit-exact with strata.quant.dequant, and the one
type-dependent rounding (f16 of a decoded weight in a prompt GEMM) is in the oracle too, so what is
left is summation order and the f16 roundings it tips (2e-3 emulated, from the measurements at REL;
3e-3 on the device, as test_cuda_runner.py). Draws keep a router top-k margin of GAP and a greedy top-2 logit margin of
MARGIN * max |logit| in the oracle (a legitimate rounding flips a nearer tie).
"""
import numpy as np
import pytest

from strata.config import SamplingParams
from strata.engine.cuda_runner import CudaRunner
from strata.pack import open_pack
from tests.engine.cpu_f16_kv import cpu_runner_f16_kv
from tests.pack.quant_presets import OTHER_PRESETS, PRESETS, preset_qtypes

pytest.importorskip("torch")
pytest.importorskip("gguf")

PROMPT, CHUNK, STEPS = 21, 16, 4
# emulated: 24 draws of the Q4_K_M presets measured 5.3e-4..6.9e-4, and seed 3873993080 1.27e-3 (a
# draw with router and greedy margins 3x the GAP and MARGIN: summation order, no flip; at aba964e too)
REL = {"emulated": 2e-3, "gpu": 3e-3}
# Router margins: the oracle leaves out the prompt attention's f16 Q and P, which moved a router logit
# by 1.9e-3 (emulated, seed 545365389, an F16 router) and by more than 3.8e-3 on the H200 (seed
# 3765260694, IQ4_NL); a top-k decided by less flips and moves one row by 10-100x the bound.
GAP = {"emulated": 5e-3, "gpu": 1e-2}
MARGIN = 1e-2
TRIES = 40


def _shape():
    from tests.fixtures import SHAPES
    return dict(SHAPES["kquant"], num_key_value_heads=1, num_hidden_layers=2)


def _cases():
    """Every preset, then the `--pure` files whose types no earlier case has (the head in the
    default type too: Q2_K, Q3_K, Q4_0, Q4_K, Q5_K, IQ4_NL, IQ4_XS), then the other types' --pure
    files (Q4_1, Q5_0, Q5_1, F16, BF16 in every tensor kind but the router and norms)."""
    seen, cases = [], []
    for presets, pure in ((PRESETS, False), (PRESETS, True), (OTHER_PRESETS, True)):
        for preset in presets:
            q = preset_qtypes(preset, _shape(), pure)
            if q not in seen:
                seen.append(q)
                cases.append(f"{preset}{'-pure' if pure else ''}")
    return cases + ["Q4_K_M-tensor-type"]


# `llama-quantize --tensor-type ffn_up_exps=q6_k --tensor-type ffn_down_exps=q8_0 ... Q4_K_M` of an
# F16 file, whose router stays F16: gate, up and down of one expert in three types, two block sizes
TENSOR_TYPE = ("Q4_K_M", {"ffn_up_exps": "Q6_K", "ffn_down_exps": "Q8_0", "ffn_gate_inp": "F16"})


def _qtypes(case):
    if case == "Q4_K_M-tensor-type":
        return {**preset_qtypes(TENSOR_TYPE[0], _shape()), **TENSOR_TYPE[1]}
    return preset_qtypes(case.removesuffix("-pure"), _shape(), case.endswith("-pure"))


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    from tests.fixtures import make_gguf_pack
    built = {}

    def get(case):
        if case not in built:
            qtypes = _qtypes(case)
            path, _ = make_gguf_pack(tmp_path_factory.mktemp(case), _shape(), qtypes, seed=11)
            built[case] = (open_pack(path), qtypes)
        return built[case]
    return get


@pytest.fixture(params=["emulated", pytest.param("gpu", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "emulated":
        request.getfixturevalue("fake")
    return request.param


def _run(runner, ids, forced=None):
    """(logits of every prompt position, greedy tokens, each greedy step's logits), the tokens
    picked by runner.pick: on the device for the GPU runner, after a prefill of its own (its
    prompt's last logits stay on the device); the oracle decodes on from logits_all's cache.
    forced: decode these tokens instead of the picks (the oracle's), so a pick that a near tie
    flips does not carry on into every later step's logits."""
    runner.prefill_chunk = CHUNK
    every = runner.logits_all(ids)
    if isinstance(runner, CudaRunner):
        runner.reset()
        steps = [runner.prefill(ids, 0)]
        pick = lambda: runner.pick(SamplingParams(temperature=0.0), 0.0)      # noqa: E731
    else:
        steps = [every[-1]]
        pick = lambda: int(np.argmax(steps[-1]))                              # noqa: E731
    tokens = []
    for i in range(STEPS):
        tokens.append(pick())
        steps.append(runner.decode(tokens[-1] if forced is None else forced[i]))
    return every, tokens, np.stack(steps)


def _margin(logits):
    top = np.sort(logits, axis=-1)[:, -2:]
    return float(((top[:, 1] - top[:, 0]) / np.abs(logits).max()).min())


def _draw(pack, rng, gap):
    """Prompt ids whose oracle run keeps the router and greedy margins (the widest after TRIES),
    and that run's results."""
    best = None
    for _ in range(TRIES):
        ids = rng.integers(0, pack.args.vocab_size, PROMPT).tolist()
        oracle = cpu_runner_f16_kv(pack, PROMPT + STEPS + 1)
        ref = _run(oracle, ids)
        score = min(oracle.ops.min_router_gap / gap, _margin(ref[2]) / MARGIN)   # steps' routing included
        if best is None or score > best[0]:
            best = (score, ids, ref)
        if score >= 1:
            break
    return best[1], best[2]


def _assert_close(ours, ref, rel, what):
    bound = rel * np.abs(ref).max()
    err = np.abs(ours - ref).max()
    assert ours.shape == ref.shape and np.isfinite(ours).all(), what
    assert err <= bound, f"{what}: max err {err:.3g} > {bound:.3g}"


def _assert_types(pack, qtypes):
    """The pack holds each tensor in the preset's type (the GGUF's, copied unchanged)."""
    from tests.fixtures import pick_qtype
    dense = pack.meta["dense"]
    assert dense["token_embd.weight"]["qtype"] == qtypes["token_embd"]
    assert dense["output.weight"]["qtype"] == qtypes["output"]
    for layer, lay in enumerate(pack.meta["experts"]["layers"]):
        for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp"):
            assert dense[f"blk.{layer}.{kind}.weight"]["qtype"] == pick_qtype(qtypes, kind, layer)
        for part, p in lay["parts"].items():
            assert p["qtype"] == pick_qtype(qtypes, f"ffn_{part}_exps", layer)


@pytest.mark.parametrize("case", _cases())
def test_preset_gpu_matches_cpu(packs, device, case, rng):
    pack, qtypes = packs(case)
    _assert_types(pack, qtypes)
    ids, (ref_all, ref_tokens, ref_steps) = _draw(pack, rng, GAP[device])
    gpu = CudaRunner(pack, 32)
    every, tokens, steps = _run(gpu, ids, forced=ref_tokens)
    _assert_close(every, ref_all, REL[device], "prompt logits")
    _assert_close(steps, ref_steps, REL[device], "greedy step logits")
    # the same picks wherever the oracle's step was not a near tie (a draw may keep one: _draw)
    clear = [i for i in range(STEPS) if _margin(ref_steps[i:i + 1]) >= MARGIN]
    assert [tokens[i] for i in clear] == [ref_tokens[i] for i in clear]
    assert len(clear) >= STEPS // 2
    assert gpu.decode_status()["cuda_graphs"]
    if device == "emulated":
        from tests.engine import fake_cuda
        used = set(fake_cuda.launches)
        assert f"strata_embed_{qtypes['token_embd'].lower()}" in used
        q = qtypes['attn_q'][0].lower()     # q and k in one launch, whatever v is (one row a warp: one-row-gemv)
        assert {f"strata_gemv3_{q}", f"strata_gemv3_one_{q}"} & used
        assert not {k for k in used if k.startswith("strata_dequant_")}  # no weight leaves the tensor-core GEMMs
        assert fake_cuda.graph_launches       # the steps after the first replay a graph
