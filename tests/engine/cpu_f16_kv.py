"""The numpy engine with the GPU engine's cache precision: K and V rounded through float16 before
they are cached. The GPU runner's tests compare with it, so the f16 cache's own rounding (up to
1e-3 of the largest logit on the tiny random models) does not hide behind the bound."""
import numpy as np

from strata.backends.cpu import CpuOps
from strata.engine.runner import CpuRunner


class F16KVOps(CpuOps):
    def attention(self, q, k, v, layer, kv, positions):
        def f16(a):
            return a.astype(np.float16).astype(np.float32)
        return super().attention(q, f16(k), f16(v), layer, kv, positions)


def cpu_runner_f16_kv(pack, max_context: int) -> CpuRunner:
    runner = CpuRunner(pack, max_context)
    runner.ops = runner.model.ops = F16KVOps(pack, pack.args)
    return runner
