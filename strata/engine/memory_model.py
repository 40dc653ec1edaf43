"""What the GPU engine's forward allocates, found by running it with no device behind it.

The functions here run the real model (strata.model.qwen3moe.Qwen3Moe.forward) over the real
strata.backends.cuda.ops.DeviceOps and its Pool, on a null runtime: buffers have addresses
but no memory, launches and copies do nothing, and a routing read back by the prompt path is all
zeros (the prompt path's allocations do not depend on the routing: its per-expert tables are sized
for the worst case). So whatever the prompt and decode paths allocate, and in which order, is what
is counted here: a change to either needs no change here.

- prompt_pool_bytes(T): the live high-water mark (Pool.peak_bytes) of a prompt's first chunk of T
  tokens. A chunk frees every block it took (its positions among them) before the next begins, so
  a later chunk's peak is this.
- prompt_arena_bytes(T): the smallest reserved (frozen) pool that reads a prompt in chunks of T
  tokens, i.e. the address high-water mark of the pool's first-fit over one unbounded segment.
  Holes between blocks of different lifetimes put it a few percent above the live mark.
- decode_step_bytes(T): a decode step's live mark and the sum of its blocks (its graph's reserve).
- kv: the KV format of the DeviceKV the forward runs over (a quantized one's prompt chunks hold an
  f16 scratch of the layer's max_cells cells, whatever the positions; its decode rotates and unfuses
  the norm and RoPE).
- Outside the pool: moe_combine's zeros buffer (zeros_bytes) and the f32 copies of norm weights
  stored in another type (norm_copies_bytes). Not modeled: the growing pool's 64 MiB segments.

tests/engine/test_planner.py checks these against CudaRunner on the emulated runtime.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from ..backends.cuda.memory import DeviceKV, DeviceTensor, ExpertLayer, Pool, Weight
from ..backends.cuda.moe_plan import MoePlan
from ..backends.cuda.ops import DeviceOps
from .hybrid_sizes import qwen3moe_stand_in

ZEROS_MIN_BYTES = 1 << 20       # DeviceOps._zeros_ptr never allocates less
PROMPT_CHUNKS_SIMULATED = 3    # the first chunk, then two that start from the pool it left
_UNBOUNDED = 1 << 60
# The GPU runner's limits, here (not in cuda_runner.py) so that the planner and this module, which
# the runner imports, read them without importing the runner back.
VRAM_RESERVE_BYTES = 1 << 30        # left free for the driver, other users and the launch overhead
STEP_MAX_TOKENS = 8                 # tokens of a decode step (the GEMV path's limit)


def stream_all_tokens(args) -> int:
    """Prompt chunks of at least this many tokens stream every non-cached expert (they route to
    nearly all: 1 - (1 - A/E)^T of a layer's experts is 86% at T = 2E/A); smaller chunks stage only
    the experts they route to."""
    return max(1, -(-2 * args.num_experts // args.num_experts_per_tok))


class _NullBuffer:
    """Device or pinned memory with an address and no bytes."""
    _next = [1 << 40]

    def __init__(self, device=None, nbytes: int = 0, mapped: bool = False):
        self.nbytes = nbytes
        self.ptr = self.device_ptr = _NullBuffer._next[0]
        _NullBuffer._next[0] += -(-max(nbytes, 1) // 4096) * 4096

    def copy_from_host(self, src, stream=None, offset: int = 0):
        pass

    def copy_to_host(self, dst, stream=None, offset: int = 0):
        np.frombuffer(memoryview(dst).cast("B"), np.uint8)[:] = 0

    def fill_bytes(self, value: int, stream=None):
        pass


class _NullKernel:
    def launch(self, grid, block, args, shared_bytes: int = 0, stream=None, pdl: bool = False):
        pass


class _NullRuntime:
    DeviceBuffer = _NullBuffer

    @staticmethod
    def load_library(name: str):
        return SimpleNamespace(kernel=lambda device, name, signature: _NullKernel())

    @staticmethod
    def copy_d2d(dst, src, nbytes, stream):
        pass


class _TracingPool(Pool):
    """The real pool, over one unbounded segment: also records the address high-water mark."""

    def __init__(self, rt, device):
        self.arena = 0
        super().__init__(rt, device, reserve_bytes=_UNBOUNDED)

    def _take(self, seg: int, off: int, size: int):
        self.arena = max(self.arena, off + size)
        return super()._take(seg, off, size)


def _every_expert_at_no_address(layer: int, active: list):
    """A chunk plan's batches (MoePlan.batches) where every expert is readable at once, at no address."""
    yield active, [0] * len(active)


def _chunk_plan(T: int, args, resident: bool) -> MoePlan:
    """The plan of a prompt chunk of T tokens, as ExpertStore.chunk_plan decides it. Not resident:
    the streamed prompt path, whose memory the planner's loan must hold; resident: the path of a
    runner with every expert in VRAM (grouped on the device)."""
    return MoePlan(resident=resident, stream_all=not resident and T >= stream_all_tokens(args),
                   batches=_every_expert_at_no_address)


class _SizesWeights:
    """DeviceWeights from pack sizes alone: tensors at null addresses."""

    def __init__(self, sizes):
        self.dense_meta = sizes.dense
        self.layers = [ExpertLayer.from_meta(l, lay, 0) for l, lay in enumerate(sizes.layers)]

    def tensor(self, name: str) -> Weight:
        t = self.dense_meta[name]
        return Weight(1 << 36, t["qtype"], tuple(t["shape"]))

    def has(self, name: str) -> bool:
        return name in self.dense_meta


def _ops(sizes, max_cells: int, num_sms: int, kv: str = "f16"):
    from ..model.qwen3moe import Qwen3Moe
    sizes = qwen3moe_stand_in(sizes)        # qwen3next: priced by a stand-in (engine/hybrid_sizes.py)
    rt = _NullRuntime()
    device = SimpleNamespace(multiprocessor_count=num_sms)
    stream = SimpleNamespace(synchronize=lambda: None)
    ops = DeviceOps(rt, device, stream, _SizesWeights(sizes), sizes.args)
    ops.pool = _TracingPool(rt, device)     # after the RoPE table: what the engine's pool holds beyond it
    a = sizes.args
    cache = DeviceKV(rt, device, stream, a.num_hidden_layers + a.num_mtp_layers, max(1, max_cells),
                     a.num_key_value_heads, a.head_dim, kv)
    return ops, Qwen3Moe(a, ops), cache


_MEMO: dict = {}        # (sizes.key, T, chunks, ..., kv format) -> (peak, arena, zeros): the planner asks again and again
_MEMO_MAX = 4096


def _prompt(sizes, T: int, chunks: int, max_cells: int, num_sms: int,
            resident: bool = False, kv: str = "f16") -> tuple[int, int, int]:
    """(live peak, address high-water mark, zeros buffer bytes) of `chunks` prompt chunks of T tokens."""
    key = (sizes.key, T, chunks, max_cells, num_sms, resident, kv)
    hit = _MEMO.get(key)
    if hit is not None:
        return hit
    ops = _run_prompt(sizes, T, chunks, max_cells, num_sms, resident, kv)
    result = (ops.pool.peak_bytes, ops.pool.arena, ops._zeros.nbytes if ops._zeros is not None else ZEROS_MIN_BYTES)
    if len(_MEMO) >= _MEMO_MAX:
        _MEMO.clear()
    _MEMO[key] = result
    return result


def _run_prompt(sizes, T: int, chunks: int, max_cells: int, num_sms: int, resident: bool = False,
                kv: str = "f16"):
    """Run `chunks` prompt chunks of T tokens as CudaRunner.prefill does; -> the ops."""
    ops, model, kv = _ops(sizes, max(max_cells, chunks * T), num_sms, kv)
    plan = _chunk_plan(T, sizes.args, resident)
    for c in range(chunks):
        positions = ops.upload_positions(np.arange(c * T, (c + 1) * T))
        logits, hidden = model.forward(np.zeros(T, np.int64), positions, kv, logits_rows=slice(-1, None), plan=plan)
        ops.to_host(logits)
        del logits, hidden, positions   # as CudaRunner's prompt chunk lets them go before the next one
    return ops


def prompt_pool_bytes(sizes, T: int, max_cells: int = 1, num_sms: int = 1, resident: bool = False,
                      kv: str = "f16") -> int:
    """Live high-water mark (Pool.peak_bytes) of the first prompt chunk of T tokens (module doc);
    resident: of a runner holding every expert in VRAM; kv: the KV format."""
    return _prompt(sizes, T, 1, max_cells, num_sms, resident, kv)[0]


def prompt_arena_bytes(sizes, T: int, max_cells: int = 1, num_sms: int = 1, kv: str = "f16") -> int:
    """The smallest reserved (frozen) pool that reads a prompt in chunks of T tokens (module doc)."""
    return _prompt(sizes, T, PROMPT_CHUNKS_SIMULATED, max_cells, num_sms, kv=kv)[1]


def decode_step_bytes(sizes, T: int, max_cells: int, num_sms: int, kv: str = "f16") -> tuple[int, int]:
    """(pool high-water mark, sum of every block) of one decode step of T <= 8 tokens; the sum is
    what CudaRunner reserves for the step's CUDA graph (graphs.capture_step)."""
    ops, model, kv = _ops(sizes, max_cells, num_sms, kv=kv)
    base_peak, base_total = ops.pool.peak_bytes, ops.pool.allocated_bytes
    buf = _NullBuffer(None, 4 * (2 * 8 + 1))                            # ids and positions read on the device
    ids, pos = DeviceTensor(buf, 0, (T,), np.int32, buf), DeviceTensor(buf, 4 * T, (T + 1,), np.int32, buf)
    logits, _ = model.forward(ids, pos, kv)
    del logits
    return ops.pool.peak_bytes - base_peak, ops.pool.allocated_bytes - base_total


def zeros_bytes(sizes, T: int) -> int:
    """moe_combine's zeros buffer after a prompt chunk of T tokens (outside the pool; it only grows)."""
    return _prompt(sizes, T, 1, T, 1)[2]


def norm_copies_bytes(sizes) -> int:
    """f32 copies DeviceOps keeps of norm weights stored in another type (outside the pool)."""
    return sum(4 * math.prod(t["shape"]) for n, t in sizes.dense.items()
               if n.endswith("norm.weight") and t["qtype"] != "F32")
