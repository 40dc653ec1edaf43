"""Sanity of model numbers, shared by the GGUF and HF converters and the pack reader.

ModelArgs checks what its own fields mean alone (positive counts, heads divisible); these are the
numbers the model math needs beyond that: a NaN or zero rope base, a negative or NaN RMS epsilon,
or a bad rope scaling all load fine and then turn every logit into NaN. Each function returns a
problem sentence or None, so each caller raises its own error class with its own file name.
"""
from __future__ import annotations

import math

from ..config import ModelArgs

MAX_POSITIONS = (1 << 31) - 1       # positions are int32 on the device


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _positive_number(rs: dict, key: str, required: bool = False) -> str | None:
    if key not in rs or rs[key] is None:
        return f"rope_scaling.{key} is missing" if required else None
    v = rs[key]
    if not is_number(v) or v <= 0:
        return f"rope_scaling.{key} = {v!r} is not a finite number > 0"
    return None


def rope_scaling_problem(rs) -> str | None:
    if rs is None:
        return None
    if not isinstance(rs, dict):
        return f"rope_scaling = {rs!r} is not an object"
    kind = rs.get("rope_type", rs.get("type"))
    if kind is not None and not isinstance(kind, str):
        return f"rope_scaling type {kind!r} is not a string"
    if kind in (None, "default"):
        return None
    problems = [_positive_number(rs, "factor", required=True)]
    if kind == "yarn":
        problems += [_positive_number(rs, k) for k in ("beta_fast", "beta_slow", "attention_factor",
                                                       "mscale", "mscale_all_dim")]
        orig = rs.get("original_max_position_embeddings")
        if orig is not None and (not is_int(orig) or not 0 < orig <= MAX_POSITIONS):
            problems.append(f"rope_scaling.original_max_position_embeddings = {orig!r} is not a positive integer")
    return next((p for p in problems if p), None)


def model_args_problem(a: ModelArgs) -> str | None:
    """What makes these args unusable for the model math, or None."""
    if not is_number(a.rms_norm_eps) or a.rms_norm_eps <= 0:
        return f"rms_norm_eps = {a.rms_norm_eps!r} is not a finite number > 0"
    if not is_number(a.rope_theta) or a.rope_theta <= 1:
        return f"rope_theta = {a.rope_theta!r} is not a finite number > 1"
    if a.head_dim % 2:
        return f"head_dim = {a.head_dim} is odd (rotary embedding rotates pairs)"
    if a.max_position_embeddings > MAX_POSITIONS:
        return f"max_position_embeddings = {a.max_position_embeddings} is past {MAX_POSITIONS}"
    if a.num_mtp_layers not in (0, 1) or isinstance(a.num_mtp_layers, bool):
        return f"num_mtp_layers = {a.num_mtp_layers!r} (Strata supports 0 or 1)"
    if not isinstance(a.norm_topk_prob, bool) or not isinstance(a.tie_word_embeddings, bool):
        return "norm_topk_prob and tie_word_embeddings must be true or false"
    return rope_scaling_problem(a.rope_scaling)
