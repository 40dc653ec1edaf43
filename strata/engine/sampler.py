"""Next-token choice from one row of logits: greedy, or temperature with top-k and top-p."""
from __future__ import annotations

import numpy as np

from ..config import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / p.temperature
        if 0 < p.top_k < z.shape[-1]:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            z = np.where(z < kth, -np.inf, z)
        probs = np.exp(z - np.max(z))
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cum, p.top_p)) + 1]   # smallest set reaching top_p
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        return int(self.rng.choice(probs.shape[-1], p=probs))
