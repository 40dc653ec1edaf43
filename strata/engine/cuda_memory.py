"""What the GPU engine's forward allocates, computed on the host from a pack's sizes (no device).

The functions here replay, block by block, what the CURRENT prompt and decode paths take from the
activation pool and when they let go: strata.model.qwen3moe.Qwen3Moe.forward over
strata.backends.cuda_device_ops.DeviceOps, with the resident grouped MoE of strata.backends.cuda_moe
(every expert in VRAM, dequantized per expert into f32 scratch). The blocks go through a real Pool
(first-fit, 256-byte blocks) with no memory behind it, so the allocator cannot drift either.

- prompt_pool_bytes(T): the live high-water mark (Pool.peak_bytes) of a prompt's first chunk of T
  tokens. A later chunk frees the previous chunk's positions block while it runs, so its peak is
  at most this.
- prompt_arena_bytes(T): the smallest reserved (frozen) pool that reads a prompt in chunks of T
  tokens, i.e. the address high-water mark of first-fit. Holes between blocks of different
  lifetimes (scratch freed between longer-lived activations) put it 3-8% above the live mark: a
  loan of the live mark alone would not hold the prompt path.
- decode_step_bytes(T): a decode step's live mark and the sum of its blocks (its graph's reserve).
- Outside the pool: moe_combine's zeros buffer (zeros_bytes) and the f32 copies of norm weights
  stored in another type (norm_copies_bytes). Not modeled: the growing pool's 64 MiB segments.

THIS FOLLOWS THE PROMPT PATH AND MUST CHANGE WITH IT: a new buffer, a buffer held longer or another
scratch size there is another number here. tests/engine/test_planner.py runs the real CudaRunner on
the emulated runtime (tests/engine/fake_cuda.py) and asserts that the pool's peak equals
prompt_pool_bytes, that a pool reserved at prompt_arena_bytes reads a prompt and 256 bytes less
does not, and that a decode step's blocks sum to decode_step_bytes, so a drift fails the suite.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

from ..backends.cuda_device import Pool
from ..backends.cuda_device_ops import (ATTENTION_HEAD_DIMS, EMBED_QTYPES, GEMV_MAX_T, WEIGHT_SCRATCH_BYTES,
                                        DeviceOps)

ZEROS_MIN_BYTES = 1 << 20       # DeviceOps._zeros_ptr never allocates less
PROMPT_CHUNKS_SIMULATED = 3    # the first chunk, then two that start beside a stale positions block
_UNBOUNDED = 1 << 60
_NO_DEVICE = SimpleNamespace(DeviceBuffer=lambda device, nbytes: SimpleNamespace(nbytes=nbytes, ptr=0))


class _Blocks:
    """The path's blocks, taken and dropped in the order it does, in a real Pool (first-fit over one
    unbounded segment, no device memory behind it): the live high-water mark (Pool.peak_bytes),
    the address high-water mark (the arena a reserved pool needs for the same sequence) and the
    sum of every block handed out (Pool.allocated_bytes)."""

    def __init__(self):
        self.pool = Pool(_NO_DEVICE, None, reserve_bytes=_UNBOUNDED)
        self.live: dict = {}
        self.arena = 0

    def take(self, name: str, nbytes: int) -> None:
        block, _ = self.pool.alloc(max(1, nbytes))     # DeviceOps.alloc asks for one element at least
        assert name not in self.live, name
        self.live[name] = block
        self.arena = max(self.arena, block.offset + block.size)

    def drop(self, *names: str) -> None:
        for name in names:
            del self.live[name]                        # the block goes back to the pool, as in the engine

    def scratch(self, nbytes: int) -> None:
        """A block taken and released inside one call."""
        if nbytes:
            self.take("scratch", nbytes)
            self.drop("scratch")

    @property
    def peak(self) -> int:
        return self.pool.peak_bytes

    @property
    def total(self) -> int:
        return self.pool.allocated_bytes


def weight_scratch_bytes(qtype: str, rows: int, n: int) -> int:
    """DeviceOps._gemm_weight's dequantized row chunk for a [rows, n] weight (none for F32)."""
    if qtype == "F32":
        return 0
    chunk = min(rows, max(16, WEIGHT_SCRATCH_BYTES // (4 * n) // 16 * 16))
    return 4 * chunk * n


def decode_splits(args, max_cells: int, num_sms: int) -> int:
    """DeviceOps.decode_splits for a device of num_sms multiprocessors."""
    return DeviceOps.decode_splits(SimpleNamespace(num_sms=num_sms), args.num_key_value_heads, max_cells,
                                   args.head_dim)


def _linear(b: _Blocks, dense: dict, out: str, name: str, T: int) -> None:
    t = dense[name]
    rows, n = math.prod(t["shape"][:-1]), t["shape"][-1]
    b.take(out, 4 * T * rows)
    if T > GEMV_MAX_T:
        b.scratch(weight_scratch_bytes(t["qtype"], rows, n))


def _attention(b: _Blocks, args, T: int, max_cells: int, num_sms: int) -> None:
    H, Hk, Dh = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    b.take("attn", 4 * T * H * Dh)
    G = H // Hk
    if T == 1 and Dh in ATTENTION_HEAD_DIMS and G <= (8 if Dh == 256 else 16):    # split-K decode
        splits = decode_splits(args, max_cells, num_sms)
        b.take("part_acc", 4 * H * splits * Dh)
        b.take("part_ml", 4 * H * splits * 2)
        b.drop("part_acc", "part_ml")


def _moe(b: _Blocks, args, lay: dict, T: int) -> None:
    """cuda_moe.moe_grouped (T > GEMV_MAX_T) or moe_decode; leaves "moe_out" alive."""
    D, I, A = args.hidden_size, args.moe_intermediate_size, args.num_experts_per_tok
    S = T * A
    g, u, d = lay["parts"]["gate"], lay["parts"]["up"], lay["parts"]["down"]
    fused = g["qtype"] == u["qtype"] and u["offset"] == g["offset"] + g["nbytes"] and g["shape"] == u["shape"]
    grouped = T > GEMV_MAX_T
    inner = ["h", "gu"] if fused else ["h", "g", "u"]
    if grouped:
        inner = ["index", "xs"] + inner
        b.take("index", 8 * S)
        b.take("xs", 4 * S * D)
    b.take("h", 4 * S * I)
    if fused:
        b.take("gu", 8 * S * I)
    else:
        b.take("g", 4 * S * I)
        b.take("u", 4 * S * I)
    if grouped:
        b.scratch(weight_scratch_bytes(g["qtype"], 2 * I, D) if fused else
                  max(weight_scratch_bytes(g["qtype"], I, D), weight_scratch_bytes(u["qtype"], I, D)))
    b.take("y", 4 * S * D)
    if grouped:
        b.scratch(weight_scratch_bytes(d["qtype"], D, I))
    b.take("moe_out", 4 * T * D)
    b.drop(*inner, "y")


def _layer(b: _Blocks, sizes, l: int, T: int, positions, max_cells: int, num_sms: int) -> None:
    """Qwen3Moe.layer: "x" (held by the caller) in, "x" out."""
    a, dense = sizes.args, sizes.dense
    D, H, Hk, Dh, A = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.num_experts_per_tok
    p = f"blk.{l}."
    b.take("attn_norm", 4 * T * D)
    _linear(b, dense, "q", p + "attn_q.weight", T)
    _linear(b, dense, "k", p + "attn_k.weight", T)
    _linear(b, dense, "v", p + "attn_v.weight", T)
    b.take("q_norm", 4 * T * H * Dh)
    b.take("q_rope", 4 * T * H * Dh)
    positions(b)                                    # rope's copy first, then the positions upload
    b.drop("q_norm", "q")
    b.take("k_norm", 4 * T * Hk * Dh)
    b.take("k_rope", 4 * T * Hk * Dh)
    b.drop("k_norm", "k")
    _attention(b, a, T, max_cells, num_sms)
    _linear(b, dense, "attn_out", p + "attn_output.weight", T)
    b.take("x1", 4 * T * D)
    b.take("ffn_norm", 4 * T * D)
    _linear(b, dense, "router_logits", p + "ffn_gate_inp.weight", T)
    b.take("expert_ids", 4 * T * A)
    b.take("expert_weights", 4 * T * A)
    _moe(b, a, sizes.layers[l], T)
    b.take("x2", 4 * T * D)
    b.drop("x1", "x", "attn_norm", "q_rope", "k_rope", "v", "attn", "attn_out", "ffn_norm", "router_logits",
           "expert_ids", "expert_weights", "moe_out")
    b.live["x"] = b.live.pop("x2")


def _forward(b: _Blocks, sizes, T: int, prompt: bool, max_cells: int, num_sms: int) -> None:
    """Qwen3Moe.forward of T tokens, then what CudaRunner drops after it. prompt: ids and
    positions come from the host (uploaded here; the positions stay until the next chunk's replace
    them) and only the last row's logits are computed (CudaRunner.prefill); else a decode step,
    ids and positions already on the device, logits for every row."""
    a = sizes.args
    b.take("x", 4 * T * a.hidden_size)
    if prompt and sizes.dense["token_embd.weight"]["qtype"] in EMBED_QTYPES:
        b.scratch(4 * T)                            # the ids, uploaded for the embed kernel
    uploaded = []

    def positions(blocks: _Blocks) -> None:         # DeviceOps._positions: once a chunk, by the first rope
        if prompt and not uploaded:
            blocks.take("positions_new", 4 * (T + 1))
            if "positions" in blocks.live:
                blocks.drop("positions")            # the previous chunk's, released once replaced
            blocks.live["positions"] = blocks.live.pop("positions_new")
            uploaded.append(T)
    for l in range(a.num_hidden_layers):
        _layer(b, sizes, l, T, positions, max_cells, num_sms)
    rows = 1 if prompt else T
    b.take("head_norm", 4 * rows * a.hidden_size)
    head = "token_embd.weight" if a.tie_word_embeddings else "output.weight"
    _linear(b, sizes.dense, "logits", head, rows)
    b.drop("x", "head_norm", "logits")


def prompt_pool_bytes(sizes, T: int, max_cells: int = 1, num_sms: int = 1) -> int:
    """Live high-water mark (Pool.peak_bytes) of the first prompt chunk of T tokens. For T >
    GEMV_MAX_T (the grouped path, every real chunk) it is a max over phases of sums of blocks
    linear in T, so it never falls as T grows; max_cells and num_sms matter only to a 1-token chunk
    (split-K attention)."""
    b = _Blocks()
    _forward(b, sizes, T, True, max_cells, num_sms)
    return b.peak


def prompt_arena_bytes(sizes, T: int, max_cells: int = 1, num_sms: int = 1) -> int:
    """The smallest reserved (frozen) pool that reads a prompt in chunks of T tokens: the address
    high-water mark of Pool's first-fit over PROMPT_CHUNKS_SIMULATED chunks, the later ones starting
    beside the previous chunk's positions block. Above prompt_pool_bytes by the holes first-fit
    leaves (scratch blocks freed between longer-lived ones)."""
    b = _Blocks()
    for _ in range(PROMPT_CHUNKS_SIMULATED):
        _forward(b, sizes, T, True, max_cells, num_sms)
    return b.arena


def decode_step_bytes(sizes, T: int, max_cells: int, num_sms: int) -> tuple[int, int]:
    """(pool high-water mark, sum of every block) of one decode step of T <= 8 tokens; the sum is
    what CudaRunner reserves for the step's CUDA graph (cuda_graph.capture_step)."""
    b = _Blocks()
    _forward(b, sizes, T, False, max_cells, num_sms)
    return b.peak, b.total


def zeros_bytes(sizes, T: int) -> int:
    """moe_combine's zeros buffer after a step of T tokens (outside the pool; it only grows)."""
    return max(4 * T * sizes.args.hidden_size, ZEROS_MIN_BYTES)


def norm_copies_bytes(sizes) -> int:
    """f32 copies DeviceOps keeps of norm weights stored in another type (outside the pool)."""
    return sum(4 * math.prod(t["shape"]) for n, t in sizes.dense.items()
               if n.endswith("norm.weight") and t["qtype"] != "F32")
