"""Qwen3-Next (qwen3next) forward, and its MTP draft layer, as pure math over an ops interface.

A stack of Gated DeltaNet layers with a gated full-attention layer every `full_attention_interval`
layers; every layer's FFN is routed experts plus a shared expert behind a sigmoid gate. Tensor names
are llama.cpp's for `qwen3next` (the zero-centred norms stored as 1 + w, ssm_a = -exp(A_log)). `cache`
(owned by the runner) holds the attention layers' K/V and the DeltaNet layers' conv and recurrent
states; ops (strata.backends.cpu_linear_attn.Qwen3NextCpuOps) read and advance them.
"""
from __future__ import annotations

import numpy as np

from ..config import ModelArgs
from .qwen3moe import Recorder, _draft_input, _no_record, draft_layer, stack_forward


class Qwen3Next:
    """first/last: a layer split's card (Qwen3Moe's doc); the split's boundaries are multiples of
    full_attention_interval, so a card's layers, renumbered from 0, keep their kinds."""

    def __init__(self, args: ModelArgs, ops, first: bool = True, last: bool = True):
        self.args = args
        self.ops = ops
        self.first, self.last = first, last
        self.head = "token_embd.weight" if args.tie_word_embeddings else "output.weight"
        self.mtp_norm = f"blk.{args.num_hidden_layers}.nextn.shared_head_norm.weight"

    def gated_attention(self, l: int, x, positions: np.ndarray, cache):
        """Softmax attention with QK-norm, partial RoPE and a sigmoid output gate per channel."""
        a, ops = self.args, self.ops
        T, p = x.shape[0], f"blk.{l}."
        q, gate = ops.attn_q_gate(x, p)                                      # [T, H, Dh], [T, H*Dh]
        k = ops.reshape(ops.linear(x, p + "attn_k.weight"), (T, a.num_key_value_heads, a.head_dim))
        v = ops.reshape(ops.linear(x, p + "attn_v.weight"), (T, a.num_key_value_heads, a.head_dim))
        attn = ops.qk_norm_rope_attention(q, k, v, p + "attn_q_norm.weight", p + "attn_k_norm.weight",
                                          a.rms_norm_eps, l, cache, positions)   # [T, H*Dh]
        return ops.linear(ops.sigmoid_gate(attn, gate), p + "attn_output.weight")

    def delta_net(self, l: int, x, cache, record: Recorder):
        """Gated DeltaNet: conv1d over [q k v], L2-normed q and k, the gated delta rule, gated RMSNorm."""
        a, ops = self.args, self.ops
        T, p = x.shape[0], f"blk.{l}."
        Hg, Hv, Dk, Dv = a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim
        qkv = ops.conv1d_silu(ops.linear(x, p + "attn_qkv.weight"), p + "ssm_conv1d.weight", l, cache)
        z = ops.reshape(ops.linear(x, p + "attn_gate.weight"), (T, Hv, Dv))
        g, beta = ops.gdn_gates(ops.linear(x, p + "ssm_ba.weight"), p)       # [T, Hv] each
        q, k, v = ops.split(qkv, (Hg * Dk, Hg * Dk, Hv * Dv))               # column groups of [T, C]
        q, k, v = ops.reshape(q, (T, Hg, Dk)), ops.reshape(k, (T, Hg, Dk)), ops.reshape(v, (T, Hv, Dv))
        o = ops.gated_delta_rule(q, k, v, g, beta, l, cache)                 # [T, Hv, Dv]
        record("delta_out", l, o)
        o = ops.gated_rms_norm(o, z, p + "ssm_norm.weight", a.rms_norm_eps)
        return ops.linear(ops.reshape(o, (T, Hv * Dv)), p + "ssm_out.weight")

    def layer(self, l: int, x, attn_norm, positions: np.ndarray, cache, next_norm: str,
              record: Recorder = _no_record, plan=None):
        """One decoder layer (same contract as Qwen3Moe.layer)."""
        a, ops = self.args, self.ops
        p = f"blk.{l}."
        if a.is_full_attention(l):
            attn_out = self.gated_attention(l, attn_norm, positions, cache)
        else:
            attn_out = self.delta_net(l, attn_norm, cache, record)
        router = p + "ffn_gate_inp.weight"
        x, ffn_norm, router_logits = ops.add_rms_norm_router(x, attn_out, p + "post_attention_norm.weight",
                                                             a.rms_norm_eps, router)
        record("attn_norm", l, attn_norm)
        record("attn_out", l, attn_out)

        # ids [T, A] and weights [T, A] kept to the layer's end: the memory plan replays these lifetimes
        router_logits, expert_ids, expert_weights, moe_out = ops.routed_moe(    # [T, E], ids, weights, [T, D]
            ffn_norm, l, router, a.num_experts_per_tok, a.norm_topk_prob, plan, logits=router_logits)
        if a.shared_expert_intermediate_size:
            moe_out = ops.add(moe_out, ops.shared_expert(ffn_norm, p))
        x, normed = ops.add_rms_norm(x, moe_out, next_norm, a.rms_norm_eps)
        record("router_logits", l, router_logits)
        record("moe_out", l, moe_out)
        record("layer_out", l, x)
        return x, normed

    def forward(self, ids: np.ndarray, positions: np.ndarray, cache, record: Recorder = _no_record,
                logits_rows: slice | None = None, plan=None):
        """ids [T] at positions [T] -> (logits [T', V] for logits_rows (default all), hidden [T, D]).

        positions must continue the sequence the cache's DeltaNet states have read (they have no
        positions of their own: the runner rewinds them to a snapshot before a prompt resumes)."""
        return stack_forward(self, ids, positions, cache, record, logits_rows, plan)

    def mtp_forward(self, hidden, next_ids: np.ndarray, positions: np.ndarray, cache,
                    record: Recorder = _no_record):
        """The MTP draft layer (a gated-attention layer with its own MoE, HF `mtp.*`): hidden [T, D]
        at position t and the token at t+1 -> logits for t+2; its K/V is layer L of the cache."""
        _, normed = draft_layer(self, hidden, next_ids, positions, cache, record)
        return self.ops.linear(normed, self.head)

    def mtp_step(self, hidden, next_ids: np.ndarray, positions: np.ndarray, cache,
                 record: Recorder = _no_record, logits_rows: slice | None = slice(None), plan=None):
        """mtp_forward for logits_rows (None: no logits, only the K/V written), also returning the
        layer's output before its final norm [T, D] (a chained draft's input), as Qwen3Moe.mtp_step."""
        out, normed = draft_layer(self, hidden, next_ids, positions, cache, record, plan)
        return (None if logits_rows is None else self.ops.linear(normed[logits_rows], self.head)), out

    def mtp_cells(self, hidden, next_ids: np.ndarray, positions: np.ndarray, cache) -> None:
        """The draft layer's K/V cells of these rows, bit for bit those mtp_step writes, without its
        output projection, routed experts or head (a prompt's draft rows read no expert)."""
        a, ops = self.args, self.ops
        L = a.num_hidden_layers
        x, attn_norm = _draft_input(self, hidden, next_ids)
        del x
        T, p = attn_norm.shape[0], f"blk.{L}."
        q, _ = ops.attn_q_gate(attn_norm, p)
        k = ops.reshape(ops.linear(attn_norm, p + "attn_k.weight"), (T, a.num_key_value_heads, a.head_dim))
        v = ops.reshape(ops.linear(attn_norm, p + "attn_v.weight"), (T, a.num_key_value_heads, a.head_dim))
        ops.qk_norm_rope_append(q, k, v, p + "attn_q_norm.weight", p + "attn_k_norm.weight", a.rms_norm_eps,
                                L, cache, positions)
