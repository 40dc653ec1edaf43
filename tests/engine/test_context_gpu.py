"""On the GPU: the system report says the GPU path runs, and the default context is the model's
trained one, lowered to what the VRAM budget holds exactly as the planner computed on the CPU."""
import numpy as np
import pytest

import strata
from strata import system
from strata.config import EngineConfig
from strata.engine.planner import PackSizes, fit_context, vram_budget
from strata.synthetic import synthetic_pack

pytestmark = pytest.mark.gpu


def test_system_report_says_the_gpu_path_is_usable():
    assert system.gpu_unusable_reason(0) is None
    report = system.system_report(0)
    assert "GPU path: usable on GPU 0" in report and "\nGPU 0: " in report and "NVIDIA driver: not" not in report


def test_demo_default_context_is_its_trained_one():
    llm = strata.LLM(device="cuda")
    assert llm.max_context == llm.args.max_position_embeddings and llm.context_source == "the model's trained context"


@pytest.mark.parametrize("budget_mib", [256, 384])
def test_context_fitted_to_the_budget_and_a_prompt_that_long_runs(tmp_path_factory, rng, budget_mib):
    """The small shape (trained for 40960): 256 MiB lowers the context, 384 MiB holds all of it."""
    path = synthetic_pack("small", str(tmp_path_factory.getbasetemp() / "synthetic"), progress=False)
    llm = strata.LLM(path, device="cuda", vram_budget_gib=budget_mib / 1024)
    from strata.backends.cuda import device_info
    d = device_info(0)
    config = EngineConfig(vram_budget_gib=budget_mib / 1024)
    sizes = PackSizes.from_meta(llm.pack.meta, int(llm.pack.meta["files"]["dense.bin"]["bytes"]))
    want, _ = fit_context(sizes, config, vram_budget(config, d["free_memory_bytes"])[0], d["multiprocessor_count"])
    assert llm.max_context == want and (want < 40960) == (budget_mib == 256)
    ids = rng.integers(0, llm.args.vocab_size, llm.max_context - 4).tolist()
    out = llm.generate(ids, max_tokens=3)
    assert out.usage.prompt_tokens == len(ids) and len(out.token_ids) + len(ids) <= llm.max_context
    assert np.isfinite(llm.logits(ids[:64])).all()
