"""Next-token choice from one row of logits: greedy, or temperature with top-k and top-p.

The randomness is one uniform double u per sampled token from the request's seeded generator, drawn
by the generation loop whatever the device: pick_host() turns (logits, params, u) into a token on
the host, cuda/sample.cu does the same on the GPU (integer masses, f32 exp: the two agree on every
draw that does not fall within ~1e-6 of a boundary, tests/kernels/test_sample_gpu.py), so a seed
means the same tokens on either device.
"""
from __future__ import annotations

import numpy as np

from ..config import SamplingParams


def mask_logits(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """logits [V] with every token the bitmask does not allow set to -inf (a copy). mask: int32
    [ceil(V / 32)], bit i % 32 of word i // 32 allows token i (strata.engine.grammar's layout)."""
    allowed = np.unpackbits(np.ascontiguousarray(mask, np.int32).view(np.uint8), bitorder="little")
    return np.where(allowed[: logits.shape[-1]].astype(bool), logits, np.float32(-np.inf)).astype(logits.dtype)


def pick_host(logits: np.ndarray, p: SamplingParams, u: float, mask: np.ndarray | None = None) -> int:
    """The token of logits [V] for params p and the uniform draw u in [0, 1): argmax when greedy,
    else the smallest id whose cumulative probability (ids in order) passes u, numpy's choice rule.
    mask: only the tokens this bitmask allows can be picked (see mask_logits)."""
    if mask is not None:
        logits = mask_logits(logits, mask)
    if p.temperature == 0.0:
        return int(np.argmax(logits))
    return choose(probs_host(logits, p), u)


def probs_host(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution [V] (float64) that pick_host samples for a non-zero temperature: softmax of
    logits / T, restricted to the top-k, then to the smallest set reaching top_p, renormalized."""
    z = logits.astype(np.float64) / p.temperature
    if 0 < p.top_k < z.shape[-1]:
        kth = np.partition(z, -p.top_k)[-p.top_k]
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z - np.max(z))
    probs /= probs.sum()
    if p.top_p < 1.0:
        keep = nucleus(probs, p.top_p)
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    return probs


NUCLEUS_FIRST = 1024     # the likeliest ids nucleus() orders first; the whole row only if they fall short


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest set of ids, likeliest first (ties in id order), whose probabilities reach top_p.
    The stable order's first ids are every id at or above the NUCLEUS_FIRST-th largest value, so
    when their running sum reaches top_p the set is found without sorting the whole row (a 152K
    vocabulary's sort costs milliseconds); the sums are the whole order's own, added in its order."""
    n = probs.shape[-1]
    if n > NUCLEUS_FIRST:
        kth = np.partition(probs, n - NUCLEUS_FIRST)[n - NUCLEUS_FIRST]
        ids = np.flatnonzero(probs >= kth)
        ids = ids[np.lexsort((ids, -probs[ids]))]
        cum = np.cumsum(probs[ids])
        if cum[-1] >= top_p:
            return ids[: int(np.searchsorted(cum, top_p)) + 1]
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    return order[: int(np.searchsorted(cum, top_p)) + 1]


def choose(probs: np.ndarray, u: float) -> int:
    """The smallest id whose cumulative probability passes u (probs [V] >= 0, any positive sum)."""
    cdf = np.cumsum(probs)
    cdf /= cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), probs.shape[-1] - 1))


class Sampler:
    """A request's draws: draw() gives the next u; calling it on logits picks on the host."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def draw(self) -> float:
        """The next uniform draw (one per sampled token; greedy steps take one too, unused)."""
        return float(self.rng.random())

    def __call__(self, logits: np.ndarray) -> int:
        return pick_host(logits, self.params, self.draw())
