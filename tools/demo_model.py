"""The demo model in torch: Qwen3-MoE (the math of transformers' Qwen3MoeForCausalLM) plus one MTP draft layer.

Development tool only (tools/train_demo.py trains it, tests/model/test_demo.py checks the numpy engine
against it); the strata package never imports torch. Experts are stored stacked ([E, I, D] gate/up,
[E, D, I] down) for training speed and saved in the classic per-expert HF layout.

MTP draft layer (Qwen3-Next / DeepSeek-V3 style): at position t it takes the last decoder layer's output
h_t (before the final norm) and the embedding of token t+1, RMS-normalizes each, projects
concat(embedding, hidden) [2D] -> [D], runs one decoder layer of its own (RoPE at position t, its own
attention and experts) and predicts token t+2 through the shared final norm and output head.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_tables(positions, head_dim: int, theta: float):
    """cos, sin [T, Dh] (NEOX layout: the two halves share frequencies)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    ang = positions.float()[:, None] * inv.to(positions.device)[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    """x [B, heads, T, Dh]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        D, H, Hk, Dh = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.H, self.Hk, self.Dh = H, Hk, Dh
        self.q_proj = nn.Linear(D, H * Dh, bias=False)
        self.k_proj = nn.Linear(D, Hk * Dh, bias=False)
        self.v_proj = nn.Linear(D, Hk * Dh, bias=False)
        self.o_proj = nn.Linear(H * Dh, D, bias=False)
        self.q_norm = RMSNorm(Dh, c["rms_norm_eps"])
        self.k_norm = RMSNorm(Dh, c["rms_norm_eps"])

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.H, self.Dh)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.Hk, self.Dh)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.Hk, self.Dh).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.H != self.Hk)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.H * self.Dh))


class MoE(nn.Module):
    """Softmax router, top-A, renormalized weights; SwiGLU experts; tokens grouped by expert."""

    def __init__(self, c: dict):
        super().__init__()
        D, E, I = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
        self.E, self.A, self.norm_topk = E, c["num_experts_per_tok"], c["norm_topk_prob"]
        self.gate = nn.Linear(D, E, bias=False)
        self.w_gate = nn.Parameter(torch.empty(E, I, D))
        self.w_up = nn.Parameter(torch.empty(E, I, D))
        self.w_down = nn.Parameter(torch.empty(E, D, I))
        self.stats = None           # when a dict, eval accumulates routing mass here

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                     # [N, D]
        router_logits = self.gate(x)                                     # [N, E]
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.A, dim=-1)                 # [N, A]
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(router_logits.dtype)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.E)
        tok = order // self.A
        xs = x[tok]
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                seg = xs[start:start + n]
                h = F.silu(seg @ self.w_gate[e].t()) * (seg @ self.w_up[e].t())
                outs.append(h @ self.w_down[e].t())
                start += n
        ys = torch.cat(outs) * weights.reshape(-1)[order, None]
        out = torch.zeros_like(x).index_add_(0, tok, ys.to(x.dtype))
        # Switch-style balance loss: E * sum_e (share of assignments to e) * (mean router prob of e).
        aux = self.E * torch.sum(counts.float() / flat.numel() * probs.mean(0))
        if self.stats is not None:
            self.stats["mass"] += torch.zeros(self.E, device=x.device).index_add_(
                0, flat, weights.reshape(-1).float())
            self.stats["count"] += counts.float()
        return out.reshape(shape), aux


class DecoderLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MoE(c)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        moe_out, aux = self.mlp(self.post_attention_layernorm(x))
        return x + moe_out, aux


class MTP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        D = c["hidden_size"]
        self.pre_fc_norm_embedding = RMSNorm(D, c["rms_norm_eps"])
        self.pre_fc_norm_hidden = RMSNorm(D, c["rms_norm_eps"])
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(c)])


class DemoModel(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        c = self.config = dict(config)
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([DecoderLayer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        self.mtp = MTP(c) if c.get("num_nextn_predict_layers", 0) else None

    def init_weights(self, seed: int, std: float = 0.02):
        """GPT-style init: N(0, std), output projections scaled by 1/sqrt(2 * layers), norms one."""
        g = torch.Generator().manual_seed(seed)
        out_std = std / math.sqrt(2 * (self.config["num_hidden_layers"] + 1))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or "_norm" in name:
                    p.fill_(1.0)
                else:
                    s = out_std if name.endswith(("o_proj.weight", "w_down")) else std
                    p.copy_(torch.randn(p.shape, generator=g) * s)

    def rope(self, T: int, device):
        return rope_tables(torch.arange(T, device=device), self.config["head_dim"], self.config["rope_theta"])

    def forward_main(self, ids):
        """ids [B, T] -> (logits [B, T, V], hidden [B, T, D] before the final norm, aux loss)."""
        cos, sin = self.rope(ids.shape[1], ids.device)
        x = self.embed_tokens(ids)
        aux = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x, a = layer(x, cos, sin)
            aux = aux + a
        return self.lm_head(self.norm(x)), x, aux / len(self.layers)

    def forward_mtp(self, hidden, next_ids):
        """hidden [B, T, D] at positions 0..T-1 and the tokens at 1..T -> (logits for 2..T+1, aux loss)."""
        m = self.mtp
        cos, sin = self.rope(hidden.shape[1], hidden.device)
        e = m.pre_fc_norm_embedding(self.embed_tokens(next_ids))
        h = m.pre_fc_norm_hidden(hidden)
        x, aux = m.layers[0](m.fc(torch.cat([e, h], dim=-1)), cos, sin)
        return self.lm_head(self.norm(x)), aux

    # --- HF checkpoint layout -------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under transformers' Qwen3Moe names, experts split one per expert, plus mtp.*."""
        out = {}
        for name, p in self.state_dict().items():
            hf = "model." + name if not name.startswith(("lm_head", "mtp.")) else name
            for part, key in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
                if name.endswith("mlp." + part):
                    base = hf[:-len(part)]
                    for e in range(p.shape[0]):
                        out[f"{base}experts.{e}.{key}.weight"] = p[e]
                    break
            else:
                out[hf] = p
        return out

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]):
        E = self.config["num_experts"]
        own = {}
        for name, p in self.state_dict().items():
            hf = "model." + name if not name.startswith(("lm_head", "mtp.")) else name
            for part, key in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
                if name.endswith("mlp." + part):
                    base = hf[:-len(part)]
                    own[name] = torch.stack([sd[f"{base}experts.{e}.{key}.weight"] for e in range(E)])
                    break
            else:
                own[name] = sd[hf]
        self.load_state_dict({k: v.to(torch.float32) for k, v in own.items()})


def hf_config(c: dict) -> dict:
    """config.json of Qwen3MoeForCausalLM for these hyperparameters."""
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
            "rms_norm_eps", "max_position_embeddings", "num_nextn_predict_layers",
            "bos_token_id", "eos_token_id", "pad_token_id")
    out = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    out.update({k: c[k] for k in keys if k in c})
    out.update({"rope_theta": c["rope_theta"],
                "rope_parameters": {"rope_type": "default", "rope_theta": c["rope_theta"]},
                "intermediate_size": 4 * c["moe_intermediate_size"], "decoder_sparse_step": 1,
                "mlp_only_layers": [], "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
                "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
                "router_aux_loss_coef": c.get("router_aux_loss_coef", 0.001), "output_router_logits": False,
                "initializer_range": 0.02, "use_cache": True, "dtype": c.get("dtype", "bfloat16")})
    return out


def save_hf(model: DemoModel, out: Path, dtype=torch.bfloat16, max_shard_bytes: int = 15 << 20) -> list[str]:
    """config.json plus safetensors shards of at most max_shard_bytes and their index; returns the file names."""
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.hf_state_dict().items()}
    shards, cur, size = [], {}, 0
    for name in sorted(sd):
        n = sd[name].numel() * sd[name].element_size()
        if cur and size + n > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = sd[name]
        size += n
    shards.append(cur)
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({k: fname for k in shard})
    total = sum(v.numel() * v.element_size() for v in sd.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    cfg = dict(model.config, dtype=str(dtype).replace("torch.", ""))
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    return files + ["model.safetensors.index.json", "config.json"]


def load_hf(path: Path, device="cpu") -> DemoModel:
    """A DemoModel (float32) from an HF-format directory written by save_hf."""
    from safetensors.torch import load_file
    path = Path(path)
    c = json.loads((path / "config.json").read_text())
    c.setdefault("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 1e6))
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    model = DemoModel(c)
    model.load_hf_state_dict(sd)
    return model.to(device).eval()


def model_from_pack(path) -> DemoModel:
    """A DemoModel (float32) holding a strata pack's weights, dequantized: the same numbers the engine uses."""
    from strata.pack import open_pack
    from strata.pack.hf_source import hf_name
    with open_pack(path) as pack:
        a = pack.args
        L = a.num_hidden_layers
        sd = {hf_name(n, L): torch.from_numpy(pack.dense(n).dequantize().copy()) for n in pack.dense_names()}
        for l in range(L + a.num_mtp_layers):
            prefix = f"model.layers.{l}" if l < L else "mtp.layers.0"
            for e in range(a.num_experts):
                for part, q in pack.expert(l, e).items():
                    sd[f"{prefix}.mlp.experts.{e}.{part}_proj.weight"] = torch.from_numpy(q.dequantize().copy())
        c = {k: getattr(a, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                                        "moe_intermediate_size", "norm_topk_prob", "rms_norm_eps", "rope_theta",
                                        "max_position_embeddings")}
        c["num_nextn_predict_layers"] = a.num_mtp_layers
    model = DemoModel(c)
    model.load_hf_state_dict(sd)
    return model.eval()
