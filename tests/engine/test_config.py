import pytest

from strata.config import EngineConfig, ModelArgs, env_overrides
from strata.errors import InvalidArgument


def test_env_overrides_win_and_are_typed(monkeypatch):
    monkeypatch.setenv("STRATA_VRAM_BUDGET_GIB", "12.5")
    monkeypatch.setenv("STRATA_MTP", "1")
    cfg = EngineConfig.from_kwargs(vram_budget_gib=8)
    assert cfg.vram_budget_gib == 12.5 and cfg.mtp is True


def test_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("STRATA_MAX_CONTEXT", "lots")
    with pytest.raises(InvalidArgument, match="STRATA_MAX_CONTEXT"):
        env_overrides()


@pytest.mark.parametrize("kw", [{"device": "tpu"}, {"prefill": "big"}, {"expert_cache": "many"},
                                {"max_context": 0}, {"kv": "fp8"}, {"no_such_flag": 1}])
def test_bad_engine_options(kw):
    with pytest.raises(InvalidArgument):
        EngineConfig.from_kwargs(**kw)


def test_model_args_reject_unsupported_architecture():
    with pytest.raises(InvalidArgument, match="llama"):
        ModelArgs("llama", 10, 8, 1, 2, 1, 4, 4, 2, 8)
