"""Decode steps as CUDA graphs: one step of T tokens captured once, replayed for every later step.

A decode step's launches depend on no host value but T and the KV cache's size: DeviceOps reads the
token ids, positions and KV length from the runner's step-input buffer on the device, and sizes the
attention splits for the cache; the step's expert plan (the same MoePlan every step) reads the
expert table and writes the routing to a fixed log. So the launches of one step, captured, serve every position.

A graph keeps the addresses its kernels were given. The holder here keeps everything they point
into alive, unmoved and unshared for as long as the graph exists:
- the step's activations (the logits among them) come from a pool of the graph's own, reserved
  before the capture and frozen. Its size is what the eager step of the same shape allocated,
  summed over every block: the capture replays that allocation sequence, so the sum bounds it
  whatever the reuse, and nothing in the capture asks the driver for memory. No other tensor is
  ever handed that memory: the pool belongs to this graph alone.
- the step-input buffer, the routing log, the KV cache, the zeros moe_combine reads, the f32 norm
  copies, the weights: owned by the runner and its ops, referenced here as well, so a runner that replaces one
  (a new KV cache, a larger zeros buffer) cannot free what the graph still reads.

Measured on an H200, synthetic qwen3-30b-a3b (tools/decode_graph_check.sh, 2026-11-30): one step is
1,107 nodes, captured in 21 ms into a 66 MB pool. Host time to submit a token: 14.6-21.1 ms eager,
0.03-0.04 ms as a replay (one 12-byte copy and one launch); a whole step, logits on the host, 5.4-5.6
ms: decode 69.7 -> 175.4 tok/s after a 512-token prompt, 69.0 -> 181.2 after 4,096. Graph and eager
logits are bitwise equal. What is left is device time: ~5 us a kernel, 11% of the copy rate.
"""
from __future__ import annotations

import gc
import time

from ..backends.cuda.memory import Pool


class DecodeGraph:
    """One captured decode step of T tokens and everything its addresses point into."""

    def __init__(self, T: int, exec_, logits, keep: tuple, kv, expert_uses: int, num_nodes: int,
                 capture_ms: float, hidden=None):
        self.T, self.exec, self.logits, self.keep, self.kv = T, exec_, logits, keep, kv
        self.hidden = hidden                # the step's last hidden states [T, D] (the drafter's input)
        self.expert_uses = expert_uses      # what one step adds to ops.expert_uses (Python no longer counts)
        self.num_nodes, self.capture_ms = num_nodes, capture_ms
        self.launches = 0

    def valid_for(self, kv) -> bool:
        """False once the runner's KV cache is another one (a new max_context): other addresses."""
        return self.kv is kv

    def launch(self, stream) -> None:
        self.exec.launch(stream)
        self.launches += 1

    def destroy(self) -> None:
        """Free the executable graph now; the memory goes when the last reference to this goes."""
        self.exec.destroy()


def capture_step(graphs, ops, model, kv, plan, T: int, ids, positions, reserve_bytes: int,
                 owned: tuple = ()) -> DecodeGraph:
    """Capture model over device-side ids [T] / positions [T + 1] with the decode step's expert
    plan into a graph; owned: the caller's buffers the step reads (its step-input buffer, the
    weights), kept with the graph.

    Nothing runs on the device: the caller launches the graph to compute this step. Raises
    DeviceError when the capture fails (the stream has then left capture mode)."""
    return capture(graphs, ops, lambda: model.forward(ids, positions, kv, plan=plan), reserve_bytes, owned, kv, T)


def capture(graphs, ops, launches, reserve_bytes: int, owned: tuple, kv, T: int, pool: Pool | None = None) -> DecodeGraph:
    """Capture launches() -> (logits, hidden), the device tensors a replay leaves its results in,
    into a graph with a pool of its own of reserve_bytes (what the same launches allocated when run
    eagerly), or `pool` (frozen, over memory the caller shares between graphs that never run at
    once); owned and kv: what the launches read, kept with the graph. Raises DeviceError when the
    capture fails (the stream has then left capture mode)."""
    t0 = time.perf_counter()
    pool = pool or Pool(ops.rt, ops.device, reserve_bytes=reserve_bytes)
    main_pool, ops.pool = ops.pool, pool
    uses = ops.expert_uses
    # No collection while capturing: the cyclic GC may free another object's device memory here
    # (a dropped runner's buffers: cuMemFree), which in this thread invalidates the capture; that
    # failed warm-up captures at random on the H200 and left decoding without graphs.
    collect = gc.isenabled()
    gc.disable()
    try:
        graphs.begin_capture(ops.stream)
        try:
            logits, hidden = launches()
        except BaseException:
            _abandon(graphs, ops.stream)
            raise
        finally:
            ops.pool = main_pool
        graph = graphs.end_capture(ops.stream)
    finally:
        if collect:
            gc.enable()
    try:
        exec_ = graph.instantiate()
        num_nodes = graph.num_nodes
    finally:
        graph.destroy()         # the executable copy is all a replay needs
    keep = (pool, *owned, kv, ops._zeros, dict(ops._f32_weights), ops.inv_freq)
    return DecodeGraph(T, exec_, logits, keep, kv, ops.expert_uses - uses, num_nodes,
                       (time.perf_counter() - t0) * 1e3, hidden)


def _abandon(graphs, stream) -> None:
    """Leave capture mode after a failure inside it; the partial graph is dropped."""
    try:
        graphs.end_capture(stream).destroy()
    except Exception:       # an invalidated capture reports its own error here; the first one matters
        pass
