"""What the GPU engine's forward allocates, found by running it with no device behind it.

The functions here run the real model (strata.model.qwen3moe.Qwen3Moe.forward, or for qwen3next
strata.model.qwen3next.Qwen3Next.forward over Qwen3NextDeviceOps and a DeviceHybridCache) over the
real strata.backends.cuda.ops.DeviceOps and its Pool, on a null runtime: buffers have addresses
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

The planner asks again and again (a bisection per plan, a plan per KV format, a decode step per
context fit_context tries, a loan per request), and a dry run of a 48-layer forward is a tenth of
a second. strata._ext.prompt_plan answers instead, in a tenth of a millisecond: the same pool
blocks in the same order, replayed through the same first-fit in typed Cython from a table of the
pack's shapes and kernel paths (prompt_tables), for prompt chunks of T > GEMV_MAX_T tokens and
decode steps of T <= GEMV_MAX_T, of qwen3moe packs (a qwen3next pack's DeltaNet layers are not in
its tables: the dry run answers for it, 0.06 s a prompt chunk at Qwen3-Next-80B's shape, memoized).
The dry run stays as the oracle (tests/engine/test_prompt_plan.py
keeps the two equal), for prompt chunks of T <= GEMV_MAX_T (the decode-shaped path; only tiny
contexts plan them) and for a build without the extension.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from ..backends.cuda.kernels import (ATTENTION_HEAD_DIMS, KernelPaths, decode_splits, max_decode_group,
                                     split_k_takes)
from ..backends.cuda.moe_decode import MAX_ACTIVE as MOE_DECODE_MAX_ACTIVE
from ..backends.cuda.memory import ALIGN_BYTES, DeviceKV, DeviceTensor, ExpertLayer, Pool, Weight
from ..backends.cuda.moe import tensor_core_gemm
from ..backends.cuda.moe_gemm import BM as GEMM_BM
from ..backends.cuda.moe_plan import MoePlan
from ..backends.cuda.ops import GEMV_MAX_T, QK_NORM_ROPE_MAX_PAIRS, WEIGHT_SCRATCH_BYTES, DeviceOps
from ..quant import kv as kv_formats
from ..errors import InvalidArgument

try:
    from .._ext import prompt_plan
except ImportError:         # built without the extensions: the dry run answers every T
    prompt_plan = None

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

    @staticmethod
    def read_manifest(directory=None) -> dict:
        """No kernel libraries: the paths that need an arch-specific one (tma-attention) stay off, as
        they allocate nothing the dry run has to count."""
        return {}

    HostBuffer = _NullBuffer


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


HEAD_NAMES = ("token_embd.weight", "output.weight", "output_norm.weight")


class _SizesWeights:
    """DeviceWeights from pack sizes alone: tensors at null addresses."""

    def __init__(self, sizes):
        self.dense_meta = sizes.dense
        self.vocab, self.hidden = sizes.args.vocab_size, sizes.args.hidden_size
        self.layers = [ExpertLayer.from_meta(l, lay, 0) for l, lay in enumerate(sizes.layers)]

    def tensor(self, name: str) -> Weight:
        t = self.dense_meta.get(name)
        if t is None and name in HEAD_NAMES:
            # a layer split's card without the embedding or the head (strata.engine.layer_split):
            # the dry run still runs them, as f32 (no dequant scratch); hand_in allocates what the
            # embedding and its norm do, and a card without the head allocates less
            return Weight(1 << 36, "F32", (self.vocab, self.hidden))
        if t is None:
            raise InvalidArgument(f"no dense tensor {name!r} in the pack's sizes")
        return Weight(1 << 36, t["qtype"], tuple(t["shape"]))

    def has(self, name: str) -> bool:
        return name in self.dense_meta


def _ops(sizes, max_cells: int, num_sms: int, kv: str = "f16"):
    """(ops, model, cache) of the GPU runner over null buffers: DeviceOps and Qwen3Moe over a DeviceKV,
    or for qwen3next its own Qwen3NextDeviceOps and Qwen3Next over a DeviceHybridCache."""
    from ..model import build
    rt = _NullRuntime()
    device = SimpleNamespace(multiprocessor_count=num_sms)
    stream = SimpleNamespace(synchronize=lambda: None)
    a = sizes.args
    fmt, on_host = kv_key_format(kv)
    if a.architecture == "qwen3next":
        from ..backends.cuda.ops_next import DeviceHybridCache, Qwen3NextDeviceOps
        ops = Qwen3NextDeviceOps(rt, device, stream, _SizesWeights(sizes), a)
        cache = DeviceHybridCache(rt, device, stream, a, a.num_hidden_layers + a.num_mtp_layers, max(1, max_cells), fmt)
    else:
        ops = DeviceOps(rt, device, stream, _SizesWeights(sizes), a)
        cache = DeviceKV(rt, device, stream, a.num_hidden_layers + a.num_mtp_layers, max(1, max_cells),
                         a.num_key_value_heads, a.head_dim, fmt, on_host=on_host)
    ops.pool = _TracingPool(rt, device)     # after the RoPE tables: what the engine's pool holds beyond them
    return ops, build(a, ops), cache


_MEMO: dict = {}        # (sizes.key, T, ..., kv format) -> a dry run's answer: the planner asks again and again
_MEMO_MAX = 4096


def _memo(key, run):
    hit = _MEMO.get(key)
    if hit is None:
        if len(_MEMO) >= _MEMO_MAX:
            _MEMO.clear()
        hit = _MEMO[key] = run()
    return hit


def _prompt(sizes, T: int, chunks: int, max_cells: int, num_sms: int,
            resident: bool = False, kv: str = "f16") -> tuple[int, int, int]:
    """(live peak, address high-water mark, zeros buffer bytes) of `chunks` prompt chunks of T tokens."""
    if closed_form(T, sizes):
        peak, arena = prompt_plan.prompt_pool(T, chunks, max_cells, *_kv_path(sizes, kv), resident, *prompt_tables(sizes))
        return peak, arena, max(ZEROS_MIN_BYTES, 4 * T * sizes.args.hidden_size)   # every layer's combine asks T x D
    return _memo((sizes.key, T, chunks, max_cells, num_sms, resident, kv),
                 lambda: dry_run_prompt(sizes, T, chunks, max_cells, num_sms, resident, kv))


def dry_run_prompt(sizes, T: int, chunks: int, max_cells: int, num_sms: int, resident: bool = False,
                   kv: str = "f16") -> tuple[int, int, int]:
    """_prompt's answer by running the forward (the oracle the closed form is tested against)."""
    ops = _run_prompt(sizes, T, chunks, max_cells, num_sms, resident, kv)
    return ops.pool.peak_bytes, ops.pool.arena, ops._zeros.nbytes if ops._zeros is not None else ZEROS_MIN_BYTES


def _run_prompt(sizes, T: int, chunks: int, max_cells: int, num_sms: int, resident: bool = False,
                kv: str = "f16"):
    """Run `chunks` prompt chunks of T tokens as CudaRunner.prefill does; -> the ops."""
    # the cache's own cells (a quantized cache's prompt scratch has its size): later chunks'
    # positions may run past them here, where nothing is written
    ops, model, kv = _ops(sizes, max(max_cells, T), num_sms, kv)
    plan = _chunk_plan(T, sizes.args, resident)
    for c in range(chunks):
        positions = ops.upload_positions(np.arange(c * T, (c + 1) * T))
        logits, hidden = model.forward(np.zeros(T, np.int64), positions, kv, logits_rows=slice(-1, None), plan=plan)
        ops.to_host(logits)
        del logits, hidden, positions   # as CudaRunner's prompt chunk lets them go before the next one
    return ops


def closed_form(T: int, sizes=None) -> bool:
    """Whether strata._ext.prompt_plan answers chunks of T tokens (the prompt path's GEMM shapes) of
    this pack: it replays qwen3moe's layers only; a qwen3next pack (DeltaNet layers, gated attention,
    a shared expert) is priced by the dry run of its own forward (0.06 s at Qwen3-Next-80B's shape)."""
    return prompt_plan is not None and T > GEMV_MAX_T and (sizes is None or not _hybrid(sizes))


def _hybrid(sizes) -> bool:
    return sizes.args.architecture == "qwen3next"


def _gemm_borrow(paths: KernelPaths, qtype: str, rows: int, n: int, offset: int = 0) -> tuple[int, int]:
    """(prompt_plan GEMM_*, scratch bytes): what DeviceOps._gemm_weight borrows for a [rows, n] weight
    at a 16-aligned address (offset: the part's offset in its blob, 0 for a dense tensor)."""
    if qtype == "F32":
        return prompt_plan.GEMM_NONE, 0
    if tensor_core_gemm(qtype, n, paths.tensor_core_prompt) and offset % 16 == 0:
        return prompt_plan.GEMM_TABLE, 0
    chunk = min(rows, max(16, WEIGHT_SCRATCH_BYTES // (4 * n) // 16 * 16))
    return prompt_plan.GEMM_SCRATCH, 4 * chunk * n


def _layer_row(sizes, paths: KernelPaths, l: int) -> dict:
    """One layer's LAYER_FIELDS: each projection's rows and borrowing, the MoE's path and borrowing."""
    row = {}
    for tag, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output"), ("r", "ffn_gate_inp")):
        t = sizes.dense[f"blk.{l}.{name}.weight"]
        rows, n = math.prod(t["shape"][:-1]), t["shape"][-1]
        row[f"{tag}_rows"] = rows
        row[f"{tag}_gemm"], row[f"{tag}_scratch"] = _gemm_borrow(paths, t["qtype"], rows, n)
    lay = ExpertLayer.from_meta(l, sizes.layers[l], 0)
    gate, up, down = lay.parts["gate"], lay.parts["up"], lay.parts["down"]
    I, D = gate.rows, gate.shape[-1]
    row.update(inter=I, gate_up_fused=int(lay.contiguous_gate_up),
               tensor_core=int(all(tensor_core_gemm(p.qtype, p.shape[-1], paths.tensor_core_prompt)
                                   for p in (gate, up, down))))
    row["gate_gemm"], row["gate_scratch"] = _gemm_borrow(paths, gate.qtype, 2 * I if lay.contiguous_gate_up else I,
                                                         D, gate.ptr)
    row["up_gemm"], row["up_scratch"] = _gemm_borrow(paths, up.qtype, I, D, up.ptr)
    row["down_gemm"], row["down_scratch"] = _gemm_borrow(paths, down.qtype, down.rows, I, down.ptr)
    row["decode_fused"] = int(paths.fused_decode and gate.qtype == up.qtype
                              and sizes.args.num_experts_per_tok <= MOE_DECODE_MAX_ACTIVE)
    return row


_TABLES: dict = {}      # sizes.key -> prompt_tables(sizes)


def _vocab(sizes) -> int:
    """The head's rows; a layer split's card without the head prices one as the dry run runs it."""
    head = sizes.dense.get("token_embd.weight" if sizes.args.tie_word_embeddings else "output.weight")
    return math.prod(head["shape"][:-1]) if head is not None else sizes.args.vocab_size


def prompt_tables(sizes) -> tuple[np.ndarray, np.ndarray]:
    """(model [MODEL_FIELDS], layers [L, LAYER_FIELDS]) int64: what strata._ext.prompt_plan replays
    the prompt path from, for the default KernelPaths (the dry run's)."""
    hit = _TABLES.get(sizes.key)
    if hit is not None:
        return hit
    if _hybrid(sizes):
        raise InvalidArgument("prompt_tables: the closed form replays qwen3moe's layers only (qwen3next is dry-run)")
    paths, a = KernelPaths(), sizes.args
    model = dict(hidden=a.hidden_size, heads=a.num_attention_heads, kv_heads=a.num_key_value_heads,
                 head_dim=a.head_dim, experts=a.num_experts, top_k=a.num_experts_per_tok,
                 vocab=_vocab(sizes),
                 layers=a.num_hidden_layers, align=ALIGN_BYTES, tile_rows=GEMM_BM,
                 stream_all_tokens=stream_all_tokens(a), group_on_device=int(paths.group_on_device))
    rows = [_layer_row(sizes, paths, l) for l in range(a.num_hidden_layers)]
    tables = (np.array([model[f] for f in prompt_plan.MODEL_FIELDS], np.int64),
              np.array([[r[f] for f in prompt_plan.LAYER_FIELDS] for r in rows], np.int64).reshape(-1, len(prompt_plan.LAYER_FIELDS)))
    _TABLES[sizes.key] = tables
    return tables


HOST_SUFFIX = "+host"     # a KV key's mark: the cells live in pinned host memory (--kv-resident)


def kv_key_format(kv: str) -> tuple[str, bool]:
    """(KV format, cells on the host) of a KV key: a format, or a format + HOST_SUFFIX."""
    return (kv[:-len(HOST_SUFFIX)], True) if kv.endswith(HOST_SUFFIX) else (kv, False)


def _kv_path(sizes, kv: str, prompt: bool = True) -> tuple[int, bool]:
    """(prompt_plan ATTN_*, K stored rotated) of DeviceOps.qk_norm_rope_attention over a KV of key kv
    (kv_key_format), for a prompt chunk or (prompt False) a decode step. f16 cells on the host take a
    staged copy of the layer in a prompt chunk (DeviceOps._stages): after the fused launch
    ATTN_STAGED, after the unfused chain the quantized path's f16 scratch (K not rotated)."""
    kv, on_host = kv_key_format(kv)
    a = sizes.args
    dh = a.head_dim
    k_rotated = kv_formats.codecs(kv)[0].rotated
    if kv != "f16":
        return prompt_plan.ATTN_QUANTIZED, k_rotated
    staged = prompt and on_host and split_k_takes(a.num_attention_heads, a.num_key_value_heads, dh)
    if dh % 2 or dh // 2 > QK_NORM_ROPE_MAX_PAIRS:
        return (prompt_plan.ATTN_QUANTIZED if staged else prompt_plan.ATTN_UNFUSED), k_rotated
    return (prompt_plan.ATTN_STAGED if staged else prompt_plan.ATTN_FUSED), k_rotated


def chunk_search(sizes, candidates: list[int], max_context: int, max_cells: int, kv: str = "f16"):
    """search(limit, extra) -> the largest of the ascending candidates T with planner.bytes_needed(
    min(T, max_context)) + extra <= limit, bisected in strata._ext.prompt_plan; None when the closed
    form does not answer every candidate (then the planner bisects over the dry run)."""
    if not candidates or not closed_form(min(candidates[0], max_context), sizes):
        return None
    cands = np.asarray(candidates, np.int64)
    path, k_rotated = _kv_path(sizes, kv)
    model, layers = prompt_tables(sizes)

    def search(limit: int, extra: int) -> int | None:
        return prompt_plan.largest_chunk(cands, max_context, limit, extra, PROMPT_CHUNKS_SIMULATED, max_cells,
                                         path, k_rotated, model, layers, ZEROS_MIN_BYTES)
    return search


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
    if prompt_plan is not None and 1 <= T <= GEMV_MAX_T and not _hybrid(sizes):
        a = sizes.args
        H, Hk, dh = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        splits = decode_splits(1, Hk, max(1, max_cells), dh, num_sms)
        return prompt_plan.decode_step(T, max_cells, *_kv_path(sizes, kv, prompt=False), splits, H // Hk <= max_decode_group(dh),
                                       dh in ATTENTION_HEAD_DIMS, *prompt_tables(sizes))
    return _memo(("decode", sizes.key, T, max_cells, num_sms, kv),      # fit_context and make_plan ask the same
                 lambda: dry_run_decode_step(sizes, T, max_cells, num_sms, kv))


def dry_run_decode_step(sizes, T: int, max_cells: int, num_sms: int, kv: str = "f16") -> tuple[int, int]:
    """decode_step_bytes by running the forward (the closed form's oracle)."""
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


_F32_COPIED = ("norm.weight", "ssm_conv1d.weight", "ssm_a", "ssm_dt.bias")   # DeviceOps._f32_weight's


def norm_copies_bytes(sizes) -> int:
    """f32 copies DeviceOps keeps of norm weights (and qwen3next's conv taps, ssm_a and dt bias)
    stored in another type (outside the pool)."""
    return sum(4 * math.prod(t["shape"]) for n, t in sizes.dense.items()
               if n.endswith(_F32_COPIED) and t["qtype"] != "F32")
