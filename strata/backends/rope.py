"""Rotary position embedding tables (NEOX style: the two halves of each head rotate together).

Here, with the backends, because the ops apply RoPE (ops.rope); the model only calls them, and
the model and the backends never import each other (docs/DESIGN.md, Layering).
"""
from __future__ import annotations

import math

import numpy as np


def _yarn(rs: dict, dim: int, base: float, max_pos: int) -> tuple[np.ndarray, float]:
    factor = float(rs["factor"])
    orig = int(rs.get("original_max_position_embeddings") or max_pos)
    beta_fast, beta_slow = float(rs.get("beta_fast", 32.0)), float(rs.get("beta_slow", 1.0))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rs.get("attention_factor")
    if attn is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extra = 1.0 - ramp                       # share of each frequency kept unscaled
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1.0 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(attn)


def inv_freq(dim: int, base: float, scaling: dict | None, max_pos: int) -> tuple[np.ndarray, float]:
    """Per-pair inverse frequencies [Dh/2] (float64) and the attention scale applied to cos/sin."""
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind == "yarn":
        return _yarn(scaling, dim, base, max_pos)
    inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    return inv, 1.0


def cos_sin(positions: np.ndarray, inv: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables [T, Dh] in float32 for these positions (halves repeated, NEOX layout)."""
    ang = positions.astype(np.float32)[:, None] * inv.astype(np.float32)[None, :]
    ang = np.concatenate([ang, ang], axis=-1)
    return (np.cos(ang) * scale).astype(np.float32), (np.sin(ang) * scale).astype(np.float32)


def apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, Dh] rotated: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]
