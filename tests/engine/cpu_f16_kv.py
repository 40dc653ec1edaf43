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

from strata.backends.cpu import CpuOps, causal_attention, swiglu
from strata.backends.cuda.ops import GEMV_MAX_T
from strata.backends.cuda.moe import tensor_core_gemm
from strata.backends.cpu_rows import RowOps
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

    def moe(self, x, layer, expert_ids, expert_weights, plan=None):
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


class FormatKVOps(F16KVOps):
    """The oracle of a GPU runner with a quantized KV format (the CpuRunner's KVCache of that format
    holds the cells): a decode step reads the cells as decoded, in f32, as the format's split-K
    kernel does; a prompt chunk (more than one query) reads them rounded to f16, as the GPU's f16
    scratch of the layer's cells holds them for the prompt attention.

    With `cells_from` (gpu_cells(runner)), the cells the oracle just encoded are replaced by the GPU
    runner's own cells for those positions, counting the values that differ (mismatched, of
    compared). A K or V a rounding away from a quantization boundary on the two sides lands one
    level apart, and one level of a 4-bit block is 1/8 of its largest value: without the swap those
    flips, not the engine, would set the bound. Swapped, what is left is the f16 path's difference."""

    cells_from = None
    mismatched = compared = 0

    def attention(self, q, k, v, layer, kv, positions):
        kv.write(layer, positions, k, v)
        if self.cells_from is not None:
            theirs = self.cells_from(layer, positions)
            mine = [a for plane in kv.planes[layer] for a in plane]
            for i, (a, b) in enumerate(zip(mine, theirs)):
                if i % 2 == 0:
                    self.mismatched += int((a[positions] != b).sum())
                    self.compared += b.size
                a[positions] = b
        keys, values = kv.read(layer, int(positions.max()) + 1)
        if q.shape[0] > 1:
            keys, values = f16(keys), f16(values)
        return kv.output(causal_attention(kv.query(q), keys, values, positions))


def gpu_cells(runner):
    """(layer, positions) -> the GPU runner's cells at those positions, [K values, K scales, V values,
    V scales] as numpy planes [len(positions), Hk, ...] (strata.quant.kv's layout), copied to the host."""
    kv = runner.kv
    planes = [p for codec in kv.codecs for p in codec.empty((kv.num_kv_heads,), kv.head_dim)]

    def read(layer, positions):
        out = []
        for (buf, cell), plane in zip(kv.buffers, planes):
            n = int(np.max(positions)) + 1
            host = np.empty((n, *plane.shape), plane.dtype)
            buf.copy_to_host(host, runner.stream, layer * kv.max_cells * cell)
            runner.stream.synchronize()
            out.append(host[np.asarray(positions)])
        return out
    return read


def cpu_runner_f16_kv(pack, max_context: int, kv: str = "f16") -> CpuRunner:
    """The GPU runner's oracle for KV format kv (f16: the cells rounded through float16, in an exact
    f32 cache; else the format's cells, FormatKVOps)."""
    ops = F16KVOps if kv == "f16" else FormatKVOps
    if pack.args.architecture == "qwen3next":       # the same roundings over qwen3next's numpy ops
        from strata.backends.cpu_linear_attn import Qwen3NextCpuOps
        ops = type(f"Next{ops.__name__}", (ops, Qwen3NextCpuOps), {})
    runner = CpuRunner(pack, max_context, kv="f32" if kv == "f16" else kv)
    runner.ops = runner.model.ops = ops(pack, pack.args)
    if runner.step_model is not runner.model:     # decode steps run the same ops, row by row
        runner.step_model.ops = RowOps(runner.ops)
    return runner


def oracle_ids(pack, rng, n: int, chunk: int = 16, gap: float = 1e-3, tries: int = 40, kv: str = "f16",
               then=None) -> list[int]:
    """n random token ids whose oracle run (read in chunks of `chunk`) routes every token with a
    top-k margin of at least `gap` in router logit (F16KVOps.min_router_gap). Rounding differences
    that a correct engine may have (summation order; an f16 rounding tipped by the last f32 bit)
    reach ~3e-4 in a router logit on these random models, and a top-k decided by less flips with
    them and moves the logits by 10-100x any bound: such draws say nothing about the engine, so
    they are drawn again (about half are, at 20 tokens; after `tries`, the widest margin drawn).
    On the GPU (tensor-core attention with f16 Q and P besides) the margin asked is larger.
    then: ids -> the tokens a test's run goes on with after them (its greedy steps): the oracle
    routes those too, and their margins count as well; the n ids alone are returned."""
    best, best_gap = None, -1.0
    for _ in range(tries):
        ids = rng.integers(0, pack.args.vocab_size, n).tolist()
        run = ids + (list(then(ids)) if then is not None else [])
        oracle = cpu_runner_f16_kv(pack, len(run) + 1, kv)
        oracle.prefill_chunk = chunk
        oracle.logits_all(run)
        if oracle.ops.min_router_gap >= gap:
            return ids
        if oracle.ops.min_router_gap > best_gap:
            best, best_gap = ids, oracle.ops.min_router_gap
    return best
