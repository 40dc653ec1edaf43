"""numpy ops of Qwen3-Next (qwen3next): Gated DeltaNet layers, gated attention, the shared expert.

The Gated DeltaNet of a layer keeps, per sequence, a conv state (the last K-1 inputs of its causal
depthwise conv1d, [K-1, C]) and a recurrent state S [Hv, Dk, Dv]. Per token t and value head h:

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

with q, k L2-normalized (q also scaled by 1/sqrt(Dk)), g_t = -exp(A_log) softplus(a_t + dt_bias) and
beta_t = sigmoid(b_t). A prompt runs the chunked (WY / UT transform) form of the same rule, one matmul
pass per chunk of 64 tokens; a decode step runs the recurrence. Both are here, and tests hold them
equal. Norm weights arrive as stored by llama.cpp's converter (1 + w for the zero-centred norms), so
the plain rms_norm of CpuOps applies; only the gated norm of the DeltaNet output (ssm_norm) is w.
"""
from __future__ import annotations

import numpy as np

from . import rope
from .cpu import CpuOps, KVCache, rms_norm, silu, swiglu

CHUNK = 64


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(np.float32(0.0), x)


def l2_normalize(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis (the eps as flash-linear-attention places it)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps))


def causal_conv1d(x: np.ndarray, state: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv of x [T, C] after the state [K-1, C] (earlier inputs), weights w [C, K],
    then SiLU -> (out [T, C], the new state: the last K-1 inputs)."""
    T, K = x.shape[0], w.shape[1]
    xx = np.concatenate([state, x], axis=0)                             # [K-1+T, C]
    out = np.zeros_like(x)
    for j in range(K):
        out += xx[j:j + T] * w[:, j]
    return silu(out), xx[T:].copy()


def gated_delta_recurrent(q, k, v, g, beta, state):
    """The gated delta rule token by token. q, k [T, Hv, Dk] (normalized, q scaled), v [T, Hv, Dv],
    g, beta [T, Hv], state [Hv, Dk, Dv] -> (o [T, Hv, Dv], final state)."""
    S = state.astype(np.float32, copy=True)
    out = np.empty_like(v)
    for t in range(q.shape[0]):
        S *= np.exp(g[t])[:, None, None]
        pred = np.einsum("hkv,hk->hv", S, k[t])
        delta = (v[t] - pred) * beta[t][:, None]
        S += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    return out, S


def _unit_lower_inverse(A: np.ndarray) -> np.ndarray:
    """(I + A)^-1 for A [H, C, C] strictly lower triangular, by forward substitution over rows."""
    C = A.shape[-1]
    inv = np.zeros_like(A)
    for i in range(C):
        inv[:, i, i] = 1.0
        if i:
            inv[:, i, :i] = -np.einsum("hj,hjc->hc", A[:, i, :i], inv[:, :i, :i])
    return inv


def gated_delta_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The gated delta rule over a prompt, chunk by chunk (the WY / UT form); same contract as
    gated_delta_recurrent. Within a chunk of C tokens, with c the cumulative log decay and
    G_ij = exp(c_i - c_j) (i >= j): the C delta updates collapse to one triangular system
    T = (I + strictly_lower(diag(beta) K K^T * G))^-1, U = T diag(beta) V, W = T diag(beta e^c) K;
    the chunk reads new values V' = U - W S, outputs (Q e^c) S + tril(Q K^T * G) V', and leaves
    S' = e^{c_last} S + (K e^{c_last - c})^T V'."""
    q, k, v = (np.ascontiguousarray(a.transpose(1, 0, 2)) for a in (q, k, v))   # [Hv, T, *]: BLAS-ready
    g, beta = np.ascontiguousarray(g.T), np.ascontiguousarray(beta.T)            # [Hv, T]
    S = state.astype(np.float32, copy=True)
    out = np.empty_like(v)
    for lo in range(0, q.shape[1], chunk):
        hi = min(q.shape[1], lo + chunk)
        qc, kc, vc, bc = q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], beta[:, lo:hi]
        kt = np.ascontiguousarray(kc.transpose(0, 2, 1))                # [Hv, Dk, C]
        c = np.cumsum(g[:, lo:hi], axis=-1)                              # [Hv, C]
        n = hi - lo
        lower = np.tril(np.ones((n, n), dtype=bool))
        decay = np.where(lower, np.exp(np.where(lower, c[:, :, None] - c[:, None, :], 0.0)), 0.0)
        A = np.tril((bc[:, :, None] * (kc @ kt)) * decay, -1)
        Tinv = _unit_lower_inverse(A)
        U = Tinv @ (vc * bc[:, :, None])
        W = Tinv @ (kc * (bc * np.exp(c))[:, :, None])
        v_new = U - W @ S
        attn = (qc @ kt) * decay
        out[:, lo:hi] = (qc * np.exp(c)[:, :, None]) @ S + attn @ v_new
        tail = np.exp(c[:, -1:] - c)[:, :, None]                        # decay from each token to the chunk end
        S = S * np.exp(c[:, -1])[:, None, None] + np.ascontiguousarray((kc * tail).transpose(0, 2, 1)) @ v_new
    return out.transpose(1, 0, 2).astype(np.float32), S.astype(np.float32)


class HybridCache:
    """One sequence's caches for qwen3next: K/V of the full-attention layers (a KVCache, indexed by
    layer) and each DeltaNet layer's conv and recurrent state, which are fixed size.

    The recurrent state cannot be rewound like K/V cells, so it is checkpointed: `snapshot(n)` keeps
    a copy of every layer's state after n tokens (the runner takes one at the end of each prompt,
    keeping the newest `max_snapshots`), and `resumable(n, live)` says how much of a common prefix of
    n tokens can be resumed: all of it from the live state (n == live), else the longest snapshot
    within it (0 when none is)."""

    def __init__(self, kv: KVCache, args, max_snapshots: int = 4):
        self.kv, self.args, self.max_snapshots = kv, args, max_snapshots
        C = 2 * args.linear_num_key_heads * args.linear_key_head_dim + \
            args.linear_num_value_heads * args.linear_value_head_dim
        self.conv_shape = (args.linear_conv_kernel_dim - 1, C)
        self.ssm_shape = (args.linear_num_value_heads, args.linear_key_head_dim, args.linear_value_head_dim)
        self.layers = [l for l in range(args.num_hidden_layers) if not args.is_full_attention(l)]
        self.conv: dict[int, np.ndarray] = {}
        self.ssm: dict[int, np.ndarray] = {}
        self.snapshots: list[tuple[int, dict, dict]] = []
        self.reset_states()

    def reset_states(self) -> None:
        self.conv = {l: np.zeros(self.conv_shape, np.float32) for l in self.layers}
        self.ssm = {l: np.zeros(self.ssm_shape, np.float32) for l in self.layers}
        self.verify_rows = None     # a verify window's states: (its start, [states before it, after row 0, ...])

    # a verify window (speculation): the states after each of its rows, so rejected rows roll back
    def window_begin(self, start: int) -> None:
        """A verify window reads tokens from position `start`: keep the states before it (row -1)."""
        self.verify_rows = (start, [self._states()])

    def window_row(self) -> None:
        """The window's next row was read: keep the states after it."""
        self.verify_rows[1].append(self._states())

    def _states(self) -> tuple[dict, dict]:
        return {l: a.copy() for l, a in self.conv.items()}, {l: a.copy() for l, a in self.ssm.items()}

    def forget(self, layer: int, start: int, stop: int) -> None:
        """Cells start..stop-1 are rejected: an attention layer's K/V cells are forgotten (KVCache),
        a DeltaNet layer's states become those after `start` tokens, kept by the verify window."""
        if layer not in self.conv:
            self.kv.forget(layer, start, stop)
            return
        if stop <= start:
            return
        first, rows = self.verify_rows or (start + 1, [])
        if not 0 <= start - first < len(rows):
            raise KeyError(f"no DeltaNet states after {start} tokens in the verify window")
        conv, ssm = rows[start - first]
        self.conv[layer], self.ssm[layer] = conv[layer].copy(), ssm[layer].copy()

    # K/V of the attention layers: as a KVCache
    def write(self, layer, positions, k, v) -> None:
        self.kv.write(layer, positions, k, v)

    def read(self, layer, length):
        return self.kv.read(layer, length)

    def query(self, q):
        return self.kv.query(q)       # the KV format's view of q (rotated where its K is)

    def window(self, layer):
        return self.kv.window(layer)  # the draft layer's attention window under --draft-window (a ring)

    def read_window(self, layer, positions):
        return self.kv.read_window(layer, positions)

    def output(self, out):
        return self.kv.output(out)    # and of the attention output (V un-rotated)

    def state_bytes(self) -> int:
        return 4 * len(self.layers) * (int(np.prod(self.conv_shape)) + int(np.prod(self.ssm_shape)))

    def snapshot(self, length: int) -> None:
        self.snapshots = [s for s in self.snapshots if s[0] != length][-(self.max_snapshots - 1):]
        self.snapshots.append((length, {l: a.copy() for l, a in self.conv.items()},
                               {l: a.copy() for l, a in self.ssm.items()}))

    def resumable(self, common: int, live: int) -> int:
        if common >= live:
            return live
        return max([n for n, _, _ in self.snapshots if n <= common], default=0)

    def rewind(self, length: int, live: int) -> None:
        """Make the states those after `length` tokens (the live ones, a snapshot's, or zeros at 0).
        The sequence is read anew from there, so snapshots past it go: they hold another sequence's
        states, which a later turn sharing that many tokens with the new one would resume from."""
        self.snapshots = [s for s in self.snapshots if s[0] <= length]
        if length == live:
            return
        self.verify_rows = None
        if length == 0:
            self.reset_states()
            return
        for n, conv, ssm in self.snapshots:
            if n == length:
                self.conv = {l: a.copy() for l, a in conv.items()}
                self.ssm = {l: a.copy() for l, a in ssm.items()}
                return
        raise KeyError(f"no DeltaNet state snapshot after {length} tokens (have {[s[0] for s in self.snapshots]})")


class Qwen3NextCpuOps(CpuOps):
    """CpuOps plus the ops of strata.model.qwen3next; RoPE rotates the first rotary_dim dims only."""

    def __init__(self, pack, args, cache_bytes: int = 2 << 30):
        super().__init__(pack, args, cache_bytes)
        self.inv_freq, self.rope_scale = rope.inv_freq(args.rotary_dim, args.rope_theta, args.rope_scaling,
                                                       args.max_position_embeddings)

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        r = self.args.rotary_dim
        cos, sin = rope.cos_sin(positions, self.inv_freq, self.rope_scale)
        return np.concatenate([rope.apply(x[..., :r], cos, sin), x[..., r:]], axis=-1).astype(np.float32)

    # gated attention ---------------------------------------------------------------------------
    def attn_q_gate(self, x: np.ndarray, prefix: str):
        """attn_q holds each head's query rows then its gate rows -> (q [T, H, Dh], gate [T, H*Dh])."""
        a = self.args
        qg = self.linear(x, prefix + "attn_q.weight").reshape(x.shape[0], a.num_attention_heads, 2 * a.head_dim)
        return qg[..., :a.head_dim], qg[..., a.head_dim:].reshape(x.shape[0], -1)

    @staticmethod
    def sigmoid_gate(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
        return (x * sigmoid(gate)).astype(np.float32)

    # Gated DeltaNet ----------------------------------------------------------------------------
    @staticmethod
    def split(x: np.ndarray, sizes) -> list:
        """Columns of x [T, sum(sizes)] in consecutive groups."""
        return np.split(x, np.cumsum(sizes)[:-1], axis=-1)

    def conv1d_silu(self, x: np.ndarray, name: str, layer: int, cache: HybridCache) -> np.ndarray:
        out, cache.conv[layer] = causal_conv1d(x, cache.conv[layer], self.weight(name))
        return out

    def gdn_gates(self, ba: np.ndarray, prefix: str):
        """ssm_ba's rows, per key head: its value heads' b then their a -> (g, beta) [T, Hv]."""
        a = self.args
        Hg, r = a.linear_num_key_heads, a.linear_num_value_heads // a.linear_num_key_heads
        ba = ba.reshape(ba.shape[0], Hg, 2 * r)
        b, alpha = ba[..., :r].reshape(ba.shape[0], -1), ba[..., r:].reshape(ba.shape[0], -1)
        g = self.weight(prefix + "ssm_a") * softplus(alpha + self.weight(prefix + "ssm_dt.bias"))
        return g.astype(np.float32), sigmoid(b).astype(np.float32)

    def gated_delta_rule(self, q, k, v, g, beta, layer: int, cache: HybridCache) -> np.ndarray:
        """q, k [T, Hg, Dk] (raw), v [T, Hv, Dv] -> o [T, Hv, Dv]; cache's state of this layer advances."""
        r = v.shape[1] // q.shape[1]
        q = np.repeat(l2_normalize(q), r, axis=1) * np.float32(q.shape[-1] ** -0.5)
        k = np.repeat(l2_normalize(k), r, axis=1)
        # chunked from 2 tokens: at 80B's heads 0.68 vs 0.80 ms at T 2, 0.9 vs 3.0 at 8, 96 vs 139 at 256
        # (2 cores); at the tests' tiny heads the recurrence wins below 8 tokens, by microseconds
        step = gated_delta_recurrent if q.shape[0] == 1 else gated_delta_chunked
        out, cache.ssm[layer] = step(q, k, v, g, beta, cache.ssm[layer])
        return out

    def gated_rms_norm(self, x: np.ndarray, z: np.ndarray, name: str, eps: float) -> np.ndarray:
        """rms_norm(x) * w * silu(z), per head [T, Hv, Dv]."""
        return (rms_norm(x, self.weight(name), eps) * silu(z)).astype(np.float32)

    def shared_expert(self, x: np.ndarray, prefix: str) -> np.ndarray:
        """sigmoid(x . gate_inp_shexp) * down(silu(gate(x)) * up(x))."""
        h = swiglu(self.linear(x, prefix + "ffn_gate_shexp.weight"), self.linear(x, prefix + "ffn_up_shexp.weight"))
        y = self.linear(h, prefix + "ffn_down_shexp.weight")
        return (y * sigmoid(self.linear(x, prefix + "ffn_gate_inp_shexp.weight"))).astype(np.float32)
