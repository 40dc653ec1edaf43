"""The numpy engine with the GPU engine's declared precision, the oracle of the GPU runner's tests:

- K and V rounded through float16 before they are cached (the f16 KV cache; alone it moves the
  logits of the tiny random models by up to 1e-3 of the largest one);
- prompt GEMMs that the GPU runs on tensor cores (cuda/moe_gemm.cu: more than GEMV_MAX_T rows and a
  weight type it takes) with X and the exactly decoded W rounded to float16, products summed in
  float32, as the kernel does: the dense projections, and the routed experts' gate/up (on the
  gathered rows) and down (on the SwiGLU output).

With both modeled, what is left between GPU and oracle is summation order and ~1 ulp transcendental
differences, so a bound can stay tight, and a router whose top-k is decided by a hair sees the same
inputs on both sides (without the f16 GEMMs in the oracle, such ties flip on random models and move
logits by 10x the bound)."""
import numpy as np

from strata.backends.cpu import CpuOps, swiglu
from strata.backends.cuda.ops import GEMV_MAX_T
from strata.backends.cuda.moe import tensor_core_gemm
from strata.engine.runner import CpuRunner


def f16(a):
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


class F16KVOps(CpuOps):
    """Also records the router's smallest top-k margin seen (min_router_gap: the gap between the
    k-th and the (k+1)-th largest router logit of any token in any layer), so a test can tell a
    near-tied routing, which a rounding difference may flip, from an engine error."""

    min_router_gap = np.inf

    def moe_route(self, router_logits, top_k, norm_topk):
        z = np.sort(np.asarray(router_logits, np.float32), axis=-1)[:, ::-1]
        if z.shape[-1] > top_k:
            self.min_router_gap = min(self.min_router_gap, float((z[:, top_k - 1] - z[:, top_k]).min()))
        return super().moe_route(router_logits, top_k, norm_topk)

    def attention(self, q, k, v, layer, kv, positions):
        return super().attention(q, f16(k), f16(v), layer, kv, positions)

    def linear(self, x, name):
        t = self.pack.meta["dense"][name]
        rows = int(np.prod(x.shape[:-1]))
        # DeviceOps._gemm_weight: the tensor-core path when the weight starts 16-byte aligned
        if rows > GEMV_MAX_T and tensor_core_gemm(t["qtype"], t["shape"][-1]) and t["offset"] % 16 == 0:
            return f16(x) @ f16(self.weight(name)).T
        return super().linear(x, name)

    def moe(self, x, layer, expert_ids, expert_weights):
        parts = self.pack.meta["experts"]["layers"][layer]["parts"]
        tc = x.shape[0] > GEMV_MAX_T and all(tensor_core_gemm(p["qtype"], p["shape"][-1]) for p in parts.values())
        if not tc:
            return super().moe(x, layer, expert_ids, expert_weights)
        out = np.zeros_like(x)
        for e in np.unique(expert_ids):
            rows, slot = np.nonzero(expert_ids == e)
            gate, up, down = (f16(w) for w in self.expert_weights(layer, int(e)))
            h = f16(x[rows])
            y = f16(swiglu(h @ gate.T, h @ up.T)) @ down.T
            np.add.at(out, rows, y * expert_weights[rows, slot][:, None])
        return out


def cpu_runner_f16_kv(pack, max_context: int) -> CpuRunner:
    runner = CpuRunner(pack, max_context)
    runner.ops = runner.model.ops = F16KVOps(pack, pack.args)
    return runner


def oracle_ids(pack, rng, n: int, chunk: int = 16, gap: float = 1e-3, tries: int = 40) -> list[int]:
    """n random token ids whose oracle run (read in chunks of `chunk`) routes every token with a
    top-k margin of at least `gap` in router logit (F16KVOps.min_router_gap). Rounding differences
    that a correct engine may have (summation order; an f16 rounding tipped by the last f32 bit)
    reach ~3e-4 in a router logit on these random models, and a top-k decided by less flips with
    them and moves the logits by 10-100x any bound: such draws say nothing about the engine, so
    they are drawn again (about half are, at 20 tokens; after `tries`, the widest margin drawn).
    On the GPU (tensor-core attention with f16 Q and P besides) the margin asked is larger.""" 
    best, best_gap = None, -1.0
    for _ in range(tries):
        ids = rng.integers(0, pack.args.vocab_size, n).tolist()
        oracle = cpu_runner_f16_kv(pack, n + 1)
        oracle.prefill_chunk = chunk
        oracle.logits_all(ids)
        if oracle.ops.min_router_gap >= gap:
            return ids
        if oracle.ops.min_router_gap > best_gap:
            best, best_gap = ids, oracle.ops.min_router_gap
    return best
