"""Qwen3-MoE forward, and the MTP draft layer, as pure math over an ops interface.

The model never allocates caches, schedules or touches files: token ids, positions, a KV cache
(owned by the runner) and the step's expert plan (the backend's value, passed through to ops.moe) go
in; logits and the final hidden states (which the MTP head needs) come out.
`ops` is a backend (strata.backends.cpu.CpuOps, or the GPU engine's
strata.backends.cuda.ops.DeviceOps) that resolves weight names and computes each op.
`record(name, layer, array)` may watch every named intermediate, so a GPU run can be diffed against
the CPU run layer by layer.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..config import ModelArgs

Recorder = Callable[[str, int, np.ndarray], None]


def _no_record(name: str, layer: int, value) -> None:
    pass


def draft_layer(model, hidden, next_ids: np.ndarray, positions: np.ndarray, kv, record: Recorder = _no_record,
                plan=None):
    """The MTP draft layer of `model` (Qwen3Moe or Qwen3Next: both keep its weights under
    blk.L.nextn. and run it as their layer L): hidden [T, D] at positions t and the tokens at t+1 ->
    (the layer's output before its final norm, that output normed with model.mtp_norm)."""
    x, attn_norm = _draft_input(model, hidden, next_ids)
    return model.layer(model.args.num_hidden_layers, x, attn_norm, positions, kv, model.mtp_norm, record, plan)


def _draft_input(model, hidden, next_ids: np.ndarray):
    """The draft layer's input x = eh_proj(enorm(embed(next_ids)) | hnorm(hidden)) and its attention
    norm -> (x, attn_norm)."""
    a, ops = model.args, model.ops
    L = a.num_hidden_layers
    p = f"blk.{L}.nextn."
    emb = ops.rms_norm(ops.embed("token_embd.weight", next_ids), p + "enorm.weight", a.rms_norm_eps)
    hid = ops.rms_norm(hidden, p + "hnorm.weight", a.rms_norm_eps)
    both = ops.concat([emb, hid], axis=-1)
    del emb, hid                # a backend's memory for them is free again before the layer runs
    x = ops.linear(both, p + "eh_proj.weight")
    del both
    return x, ops.rms_norm(x, f"blk.{L}.attn_norm.weight", a.rms_norm_eps)


def stack_forward(model, ids, positions: np.ndarray, cache, record: Recorder = _no_record,
                  logits_rows: slice | list[int] | None = None, plan=None):
    """The decoder stack of `model` (Qwen3Moe or Qwen3Next, each with first, last, head and layer())
    over ids [T] at positions [T] -> (logits [T', V] for logits_rows, hidden [T, D]); a layer split's
    card that is not the last -> (normed [T, D], hidden [T, D]) of every row (Qwen3Moe's doc)."""
    a, ops = model.args, model.ops
    L = a.num_hidden_layers
    if model.first:
        x = ops.embed("token_embd.weight", ids)
        normed = ops.rms_norm(x, "blk.0.attn_norm.weight", a.rms_norm_eps)
    else:               # ids: what the card before hands on (the runner's value, ops.hand_in's)
        x, normed = ops.hand_in(ids)
    for l in range(L):
        next_norm = f"blk.{l + 1}.attn_norm.weight" if l + 1 < L or not model.last else "output_norm.weight"
        x, normed = model.layer(l, x, normed, positions, cache, next_norm, record, plan)
    if not model.last:
        return normed, x
    if logits_rows is None:
        rows = normed
    elif isinstance(logits_rows, slice):
        rows = normed[logits_rows]                                      # the norm is per row
    else:                                       # rows apart (several prompts' last rows): a copy
        rows = ops.take_rows(normed, list(logits_rows))
    return ops.linear(rows, model.head), x


class Qwen3Moe:
    """Decoder stack of `args.num_hidden_layers` layers: GQA attention with QK-norm, routed SwiGLU experts.

    One stage of a layer split (strata.engine.layer_split) is this stack over its own layers,
    renumbered from 0: a stage that is not the first (first=False) takes its input rows from
    ops.hand_in(ids) instead of the embedding (ids then the runner's hand-off value), and one that
    is not the last (last=False) ends with its last layer's output and that output normed with the
    next stage's first attention norm (blk.N.attn_norm, N its layer count), which its forward
    returns in place of logits."""

    def __init__(self, args: ModelArgs, ops, first: bool = True, last: bool = True):
        self.args = args
        self.ops = ops
        self.first, self.last = first, last
        self.head = "token_embd.weight" if args.tie_word_embeddings else "output.weight"
        # Qwen3-Next gives the draft layer its own final norm; DeepSeek-style packs share the main one.
        own = f"blk.{args.num_hidden_layers}.nextn.shared_head_norm.weight"
        self.mtp_norm = own if args.num_mtp_layers and ops.has_weight(own) else "output_norm.weight"

    def layer(self, l: int, x, attn_norm, positions: np.ndarray, kv, next_norm: str,
              record: Recorder = _no_record, plan=None):
        """One decoder layer over x [T, D] at these positions; K/V are appended to kv's layer l.

        attn_norm is this layer's input norm of x (the previous layer computed it with its residual
        add); returns (layer_out, rms_norm(layer_out) with the weight next_norm): the residual adds
        and the norms after them are composite ops, so a backend can fuse each pair. plan: the
        step's expert plan, handed to ops.moe as it is (the backend's; None where it needs none).
        """
        a, ops = self.args, self.ops
        T = x.shape[0]
        H, Hk, Dh, eps = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps
        p = f"blk.{l}."

        q, k, v = ops.qkv(attn_norm, p)                                      # attn_q/k/v projections
        q, k, v = ops.reshape(q, (T, H, Dh)), ops.reshape(k, (T, Hk, Dh)), ops.reshape(v, (T, Hk, Dh))
        attn = ops.qk_norm_rope_attention(q, k, v, p + "attn_q_norm.weight", p + "attn_k_norm.weight", eps,
                                          l, kv, positions)              # [T, H*Dh]
        attn_out = ops.linear(attn, p + "attn_output.weight")
        router = p + "ffn_gate_inp.weight"
        x, ffn_norm, router_logits = ops.add_rms_norm_router(x, attn_out, p + "ffn_norm.weight", eps, router)
        record("attn_norm", l, attn_norm)
        record("attn_out", l, attn_out)

        # ids [T, A] and weights [T, A] kept to the layer's end: the memory plan replays these lifetimes
        router_logits, expert_ids, expert_weights, moe_out = ops.routed_moe(    # [T, E], ids, weights, [T, D]
            ffn_norm, l, router, a.num_experts_per_tok, a.norm_topk_prob, plan, logits=router_logits)
        x, normed = ops.add_rms_norm(x, moe_out, next_norm, eps)
        record("router_logits", l, router_logits)
        record("moe_out", l, moe_out)
        record("layer_out", l, x)
        return x, normed

    def attention_cells(self, l: int, attn_norm, positions: np.ndarray, kv) -> None:
        """Layer l's K/V cells of attn_norm's rows, as layer() appends them, and nothing else."""
        a, ops = self.args, self.ops
        T = attn_norm.shape[0]
        p = f"blk.{l}."
        q, k, v = ops.qkv(attn_norm, p)
        q = ops.reshape(q, (T, a.num_attention_heads, a.head_dim))
        k = ops.reshape(k, (T, a.num_key_value_heads, a.head_dim))
        v = ops.reshape(v, (T, a.num_key_value_heads, a.head_dim))
        ops.qk_norm_rope_append(q, k, v, p + "attn_q_norm.weight", p + "attn_k_norm.weight", a.rms_norm_eps,
                                l, kv, positions)

    def forward(self, ids: np.ndarray, positions: np.ndarray, kv, record: Recorder = _no_record,
                logits_rows: slice | None = None, plan=None):
        """ids [T] at positions [T] -> (logits [T', V] for logits_rows (default all), hidden [T, D]).

        hidden is the last layer's output before the final norm: the MTP draft layer's input. plan:
        the runner's expert plan of this step (strata.backends.cuda.moe_plan on the GPU), passed to
        every layer's ops.moe. A stage that is not the last returns (normed [T, D], hidden [T, D]):
        every row, whatever logits_rows says, for the next stage's hand_in (class doc).
        """
        return stack_forward(self, ids, positions, kv, record, logits_rows, plan)

    def mtp_forward(self, hidden, next_ids: np.ndarray, positions: np.ndarray, kv,
                    record: Recorder = _no_record):
        """The MTP draft layer: hidden [T, D] at position t and the token at t+1 -> logits for t+2.

        positions are those of the hidden states (t); the draft layer keeps its own K/V at layer L.
        """
        return self.mtp_step(hidden, next_ids, positions, kv, record)[0]

    def mtp_step(self, hidden, next_ids: np.ndarray, positions: np.ndarray, kv,
                 record: Recorder = _no_record, logits_rows: slice | None = slice(None), plan=None):
        """mtp_forward for logits_rows (None: no logits, only the K/V written), also returning the
        draft layer's output before its final norm [T, D]: the hidden state a chained draft feeds
        back in (draft k's state is draft k+1's input). plan: how the MoE op reaches the layer's
        experts (the GPU's MoePlan; None on the CPU)."""
        out, normed = draft_layer(self, hidden, next_ids, positions, kv, record, plan)
        return (None if logits_rows is None else self.ops.linear(normed[logits_rows], self.head)), out

    def mtp_cells(self, hidden, next_ids: np.ndarray, positions: np.ndarray, kv) -> None:
        """The draft layer's K/V cells of these rows, bit for bit those mtp_step writes, without its
        attention, routed experts or head: a cell depends only on the layer's attention input (a
        prompt's draft rows need nothing else, so no routed expert of the draft layer is read)."""
        x, attn_norm = _draft_input(self, hidden, next_ids)
        del x
        self.attention_cells(self.args.num_hidden_layers, attn_norm, positions, kv)
