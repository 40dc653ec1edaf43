import subprocess
import sys

import pytest

from strata.config import EngineConfig, ModelArgs, env_overrides
from strata.errors import InvalidArgument


def test_env_overrides_win_and_are_typed(monkeypatch):
    monkeypatch.setenv("STRATA_VRAM_BUDGET_GIB", "12.5")
    monkeypatch.setenv("STRATA_CUDA_GRAPHS", "0")
    cfg = EngineConfig.from_kwargs(vram_budget_gib=8, cuda_graphs=True)
    assert cfg.vram_budget_gib == 12.5 and cfg.cuda_graphs is False


def test_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("STRATA_MAX_CONTEXT", "lots")
    with pytest.raises(InvalidArgument, match="STRATA_MAX_CONTEXT"):
        env_overrides()


@pytest.mark.parametrize("kw", [{"device": "tpu"}, {"prefill": "big"}, {"expert_cache": "many"},
                                {"max_context": -1}, {"kv": "fp8"}, {"no_such_flag": 1}, {"gpus": "x"},
                                {"gpus": ""}])
def test_bad_engine_options(kw):
    with pytest.raises(InvalidArgument):
        EngineConfig.from_kwargs(**kw)


def test_model_args_reject_unsupported_architecture():
    with pytest.raises(InvalidArgument, match="llama"):
        ModelArgs("llama", 10, 8, 1, 2, 1, 4, 4, 2, 8)


# A layer split's flags (strata.engine.layer_split) and the budgets that become bytes: checked in form
# here, each refusal one line.
REFUSED = [
    ({"layer_split": "20,28"}, "--layer-split 20,28: 2 ranges for 1 card(s)"),
    ({"gpus": "0,1", "layer_split": "20,28,4"}, "--layer-split 20,28,4: 3 ranges for 2 card(s)"),
    ({"gpus": "0,1", "layer_split": "20,0"}, "--layer-split must be auto or two or more layer counts"),
    ({"gpus": "0,1", "layer_split": "48"}, "--layer-split must be auto or two or more layer counts"),
    ({"gpus": "0,1", "vram_budget_gib": "8,12,4"}, "--vram-budget-gib 8,12,4: give one budget, or one for each"),
    ({"gpus": "0,1", "vram_budget_gib": "8,x"}, "--vram-budget-gib must be GiB"),
    ({"gpus": "0,1", "vram_budget_gib": "8,-1"}, "vram_budget_gib must be >= 0"),
    ({"vram_budget_gib": "inf"}, "vram_budget_gib must be >= 0 and finite"),
    ({"gpus": "0,1", "vram_budget_gib": "8,nan"}, "vram_budget_gib must be >= 0 and finite"),
    ({"pin_limit_gib": float("inf")}, "pin_limit_gib must be >= 0 and finite"),
    ({"keep_conversations_gib": float("inf")}, "keep_conversations_gib must be >= 0 (0: none kept) and finite"),
    ({"pcie_gbs": float("inf")}, "pcie_gbs must be >= 0 (0: no cap) and finite"),
    ({"gpus": "0,1", "device": "cpu"}, "--gpus 0,1: a layer split is over GPUs"),
]


@pytest.mark.parametrize("kw, match", REFUSED)
def test_split_and_budget_flags_refused_in_one_line(kw, match):
    with pytest.raises(InvalidArgument) as info:
        EngineConfig.from_kwargs(**kw)
    assert str(info.value).startswith(match) and "\n" not in str(info.value)


def test_split_cards_and_budgets():
    cfg = EngineConfig.from_kwargs(gpus="0,1", vram_budget_gib="8,12", layer_split="20,28")
    assert cfg.split and cfg.cards() == [(0, 8.0), (1, 12.0)]
    assert EngineConfig.from_kwargs(gpus="0,0", vram_budget_gib="6").cards() == [(0, 6.0), (0, 6.0)]
    one = EngineConfig.from_kwargs(vram_budget_gib="7.5")
    assert not one.split and one.vram_budget_gib == 7.5 and one.cards() == [(0, 7.5)]


# Speculation runs (strata/engine/speculate.py) but only in its one form: --mtp with --spec N.
SPEC_REFUSED = [({"spec": 2}, "--spec 2 needs --mtp"), ({"mtp": True}, "--mtp drafts only under --spec N"),
                ({"spec": 8, "mtp": True}, "--spec 8: at most 7 drafts"), ({"spec": "auto"}, "--spec auto needs --mtp"),
                ({"spec": "many", "mtp": True}, "spec must be a number of drafts (0 = off) or auto")]


@pytest.mark.parametrize("kw, match", SPEC_REFUSED)
def test_spec_needs_mtp_and_a_window_size(kw, match):
    with pytest.raises(InvalidArgument) as info:
        EngineConfig.from_kwargs(**kw)
    assert str(info.value).startswith(match) and "\n" not in str(info.value)
    assert EngineConfig.from_kwargs(spec=3, mtp=True).spec == "3"
    assert EngineConfig.from_kwargs(spec=" auto", mtp=True).spec == "auto"


def test_their_defaults_are_accepted():
    cfg = EngineConfig.from_kwargs(kv="f16", kv_resident=0, spec=0, mtp=False, layer_split="auto", gpus="1")
    assert (cfg.kv, cfg.kv_resident, cfg.spec, cfg.mtp, cfg.layer_split, cfg.gpus) == ("f16", 0, "0", False, "auto", "1")
    assert EngineConfig().max_context == 0          # 0: the model's trained context, fitted to memory


@pytest.mark.parametrize("kv", ["f16", "int8", "q4_0", "k8v4", "auto"])
def test_kv_formats_are_accepted(kv):
    assert EngineConfig.from_kwargs(kv=kv).kv == kv


def test_refused_through_the_environment_too(monkeypatch):
    monkeypatch.setenv("STRATA_SPEC", "3")
    with pytest.raises(InvalidArgument, match="--spec 3 needs --mtp"):
        EngineConfig.from_kwargs()


@pytest.mark.parametrize("flags, match", [(["--spec", "2"], "--spec 2 needs --mtp"), (["--mtp"], "--mtp"),
                                          (["--kv-resident", "64"], "--kv-resident"), (["--gpus", "0,1"], "--gpus"),
                                          (["--parallel", "4", "--batch-max", "5"], "batch_max must be 0 (auto)")])
def test_cli_refuses_them_in_one_line(flags, match):
    r = subprocess.run([sys.executable, "-m", "strata", "plan", "--synthetic", "tiny", "--device", "cpu",
                        "--vram-budget-gib", "1", *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(f"strata: error: {match}"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_kernel_paths_turn_off_by_name_and_refuse_unknown_ones():
    from strata.backends.cuda.kernels import KernelPaths
    paths = KernelPaths.without(EngineConfig(kernels_off="pdl, split-gemv").kernels_off)
    assert (paths.pdl, paths.split_gemv, paths.fused_decode) == (False, False, True)
    assert KernelPaths.without("") == KernelPaths()
    with pytest.raises(InvalidArgument, match="kernels_off: unknown kernel path 'fast'"):
        EngineConfig(kernels_off="pdl,fast")


def test_trial_kernel_paths_are_off_until_turned_on():
    from strata.backends.cuda.kernels import KernelPaths
    assert KernelPaths().wgmma_gemm is False
    cfg = EngineConfig(kernels_on="wgmma-gemm", kernels_off="pdl")
    paths = KernelPaths.without(cfg.kernels_off, cfg.kernels_on)
    assert (paths.wgmma_gemm, paths.pdl, paths.tensor_core_prompt) == (True, False, True)
    with pytest.raises(InvalidArgument, match=r"kernels_on: kernel path 'pdl' is on by default \(--kernels-off pdl"):
        EngineConfig(kernels_on="pdl")      # a default path is turned off, never on
    with pytest.raises(InvalidArgument, match="kernels_off: unknown kernel path 'wgmma-gemm'"):
        EngineConfig(kernels_off="wgmma-gemm")
    with pytest.raises(InvalidArgument, match="--kernels-on wgmma-gemm: kernel paths are the GPU's"):
        EngineConfig(device="cpu", kernels_on="wgmma-gemm")


def test_kernel_paths_are_refused_where_auto_finds_no_gpu(monkeypatch):
    from strata.engine import llm as llm_module
    monkeypatch.setattr(llm_module, "_pick_device", lambda device, ordinal: "cpu")
    with pytest.raises(InvalidArgument, match="--kernels-off pdl: kernel paths are the GPU's"):
        llm_module.LLM(kernels_off="pdl")


def test_wgmma_needs_sm_90_and_its_library():
    from strata.backends.cuda.kernels import wgmma_unavailable
    built = {"kernels": {"moe_gemm_ws": {"archs": ["sm_90a"], "optional": True}}}
    assert wgmma_unavailable(built, (9, 0)) is None
    assert "this one is sm_89" in wgmma_unavailable(built, (8, 9))
    assert "this one is sm_100" in wgmma_unavailable(built, (10, 0))
    assert "no moe_gemm_ws library" in wgmma_unavailable({"kernels": {}}, (9, 0))
    assert "no moe_gemm_ws library" in wgmma_unavailable(None, (9, 0))


def test_cluster_decode_needs_sm_90_and_code_built_for_this_gpu():
    """The cluster kernel runs from SASS of this GPU's arch or PTX of an arch from sm_90 on: the lowest arch's
    PTX (sm_80) JIT-compiled for a newer GPU has no clusters (the kernel traps there), so that install is refused."""
    from strata.backends.cuda.kernels import cluster_unavailable

    def built(*archs):
        return {"kernels": {"attention": {"archs": list(archs)}}}
    assert cluster_unavailable(built("sm_80", "sm_90", "compute_80"), (9, 0)) is None
    assert cluster_unavailable(built("sm_90", "sm_100", "compute_90"), (12, 0)) is None      # PTX of sm_90, JIT
    assert "this one is sm_89" in cluster_unavailable(built("sm_89", "sm_90", "compute_89"), (8, 9))
    assert "no code for sm_100" in cluster_unavailable(built("sm_80", "sm_90", "compute_80"), (10, 0))
    assert "built for nothing" in cluster_unavailable(None, (9, 0))
