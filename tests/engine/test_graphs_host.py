"""Graph capture on the emulated runtime: no garbage collection runs while a decode step is being
captured (a collection could free another object's device memory, which invalidates a capture in
the capturing thread), and collection is on again after it, as it was before."""
import gc

import numpy as np

from strata.config import EngineConfig
from strata.engine.cuda_runner import CudaRunner
from strata.engine.llm import demo_model_path
from strata.pack import open_pack


def test_capture_runs_with_the_collector_off_and_restores_it(fake, rng):
    pack = open_pack(demo_model_path())
    runner = CudaRunner(pack, 64, EngineConfig(device="cuda", prefill="24"))
    seen = []
    forward = runner.model.forward

    def watched(*args, **kwargs):
        seen.append(gc.isenabled())
        return forward(*args, **kwargs)

    runner.model.forward = watched
    ids = rng.integers(0, pack.args.vocab_size, 12).tolist()
    runner.prefill(ids[:8], 0)
    assert gc.isenabled()
    for t in ids[8:]:
        runner.decode(t)                       # eager, captured, then replayed
    assert runner.graphs and True in seen and False in seen    # eager steps with it on, the capture off
    assert gc.isenabled()
    gc.disable()
    try:
        runner.drop_graphs()
        runner.decode(int(ids[0]))
        runner.decode(int(ids[1]))
        assert not gc.isenabled()              # left as the caller had it
    finally:
        gc.enable()
    assert np.isfinite(runner.decode(int(ids[2]))).all()
