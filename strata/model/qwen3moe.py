"""Qwen3-MoE forward, and the MTP draft layer, as pure math over an ops interface.

The model never allocates caches, schedules or touches files: token ids, positions and a KV cache
(owned by the runner) go in; logits and the final hidden states (which the MTP head needs) come out.
`ops` is a backend (strata.backends.cpu.CpuOps, later the CUDA one) that resolves weight names and
computes each op. `record(name, layer, array)` may watch every named intermediate, so a GPU run can
be diffed against the CPU run layer by layer.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..config import ModelArgs

Recorder = Callable[[str, int, np.ndarray], None]


def _no_record(name: str, layer: int, value) -> None:
    pass


class Qwen3Moe:
    """Decoder stack of `args.num_hidden_layers` layers: GQA attention with QK-norm, routed SwiGLU experts."""

    def __init__(self, args: ModelArgs, ops):
        self.args = args
        self.ops = ops
        self.head = "token_embd.weight" if args.tie_word_embeddings else "output.weight"
        # Qwen3-Next gives the draft layer its own final norm; DeepSeek-style packs share the main one.
        own = f"blk.{args.num_hidden_layers}.nextn.shared_head_norm.weight"
        self.mtp_norm = own if args.num_mtp_layers and ops.has_weight(own) else "output_norm.weight"

    def layer(self, l: int, x, positions: np.ndarray, kv, record: Recorder = _no_record):
        """One decoder layer over x [T, D] at these positions; K/V are appended to kv's layer l."""
        a, ops = self.args, self.ops
        T = x.shape[0]
        H, Hk, Dh = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        p = f"blk.{l}."

        attn_norm = ops.rms_norm(x, p + "attn_norm.weight", a.rms_norm_eps)
        q = ops.reshape(ops.linear(attn_norm, p + "attn_q.weight"), (T, H, Dh))
        k = ops.reshape(ops.linear(attn_norm, p + "attn_k.weight"), (T, Hk, Dh))
        v = ops.reshape(ops.linear(attn_norm, p + "attn_v.weight"), (T, Hk, Dh))
        q = ops.rope(ops.rms_norm(q, p + "attn_q_norm.weight", a.rms_norm_eps), positions)
        k = ops.rope(ops.rms_norm(k, p + "attn_k_norm.weight", a.rms_norm_eps), positions)
        attn = ops.attention(q, k, v, l, kv, positions)                     # [T, H*Dh]
        attn_out = ops.linear(attn, p + "attn_output.weight")
        x = ops.add(x, attn_out)
        record("attn_norm", l, attn_norm)
        record("attn_out", l, attn_out)

        ffn_norm = ops.rms_norm(x, p + "ffn_norm.weight", a.rms_norm_eps)
        router_logits = ops.linear(ffn_norm, p + "ffn_gate_inp.weight")     # [T, E]
        expert_ids, expert_weights = ops.moe_route(router_logits, a.num_experts_per_tok, a.norm_topk_prob)
        moe_out = ops.moe(ffn_norm, l, expert_ids, expert_weights)          # [T, D]
        x = ops.add(x, moe_out)
        record("router_logits", l, router_logits)
        record("moe_out", l, moe_out)
        record("layer_out", l, x)
        return x

    def forward(self, ids: np.ndarray, positions: np.ndarray, kv, record: Recorder = _no_record,
                logits_rows: slice | None = None):
        """ids [T] at positions [T] -> (logits [T', V] for logits_rows (default all), hidden [T, D]).

        hidden is the last layer's output before the final norm: the MTP draft layer's input.
        """
        a, ops = self.args, self.ops
        x = ops.embed("token_embd.weight", ids)
        for l in range(a.num_hidden_layers):
            x = self.layer(l, x, positions, kv, record)
        rows = x if logits_rows is None else x[logits_rows]
        logits = ops.linear(ops.rms_norm(rows, "output_norm.weight", a.rms_norm_eps), self.head)
        return logits, x

    def mtp_forward(self, hidden, next_ids: np.ndarray, positions: np.ndarray, kv,
                    record: Recorder = _no_record):
        """The MTP draft layer: hidden [T, D] at position t and the token at t+1 -> logits for t+2.

        positions are those of the hidden states (t); the draft layer keeps its own K/V at layer L.
        """
        a, ops = self.args, self.ops
        L = a.num_hidden_layers
        p = f"blk.{L}.nextn."
        emb = ops.rms_norm(ops.embed("token_embd.weight", next_ids), p + "enorm.weight", a.rms_norm_eps)
        hid = ops.rms_norm(hidden, p + "hnorm.weight", a.rms_norm_eps)
        x = ops.linear(ops.concat([emb, hid], axis=-1), p + "eh_proj.weight")
        x = self.layer(L, x, positions, kv, record)
        logits = ops.linear(ops.rms_norm(x, self.mtp_norm, a.rms_norm_eps), self.head)
        return logits
