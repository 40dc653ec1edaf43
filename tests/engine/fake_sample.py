"""numpy emulation of cuda/sample.cu and cuda/mask_logits.cu for tests/engine/fake_cuda.py (the fake runtime).

Runs strata.backends.cuda.sample.sample_reference on the fake device memory and checks what a real
launch needs: grid (B, 1, 1), block exactly (1024, 1, 1), V >= 1, u in [0, 1). Wiring, in fake_cuda.py:

    _EMULATE["sample_f32"] = fake_sample.emulate_sample   (Kernel.run passes (grid, *args); block
    is not passed to run(), so check_block() is for Kernel.launch)
"""
from __future__ import annotations

import numpy as np

from strata.backends.cuda.sample import SAMPLE_THREADS, sample_reference
from tests.engine import fake_cuda


def check_block(block) -> None:
    dims = fake_cuda._dims(block)
    assert dims == (SAMPLE_THREADS, 1, 1), f"fake_cuda: sample block {dims} must be ({SAMPLE_THREADS}, 1, 1)"


def emulate_sample(grid, logits, temperature, top_k, top_p, u, token, prob, V):
    """token[b] (and prob[b] unless prob is 0) = one draw from row b of logits [B, V]."""
    B = grid[0]
    assert B >= 1 and grid[1] == 1 and grid[2] == 1, f"fake_cuda: sample grid {grid} must be (B, 1, 1)"
    assert V >= 1, f"fake_cuda: sample V = {V}"
    x = fake_cuda.view(logits, B * V).reshape(B, V)
    uu = fake_cuda.view(u, B, np.float64)
    assert np.all((uu >= 0) & (uu < 1)), f"fake_cuda: sample u {uu} outside [0, 1)"
    tok, pr = sample_reference(x, fake_cuda.view(temperature, B), fake_cuda.view(top_k, B, np.int32),
                               fake_cuda.view(top_p, B), uu)
    fake_cuda.view(token, B, np.int32)[:] = tok
    if prob:
        fake_cuda.view(prob, B)[:] = pr


def emulate_mask_logits(grid, logits, mask, V):
    """logits[b, i] = -inf where bit i % 32 of mask[b, i // 32] is 0 (strata.engine.sampler.mask_logits)."""
    from strata.engine.sampler import mask_logits
    W = (V + 31) // 32
    assert V >= 1 and grid[0] == (V + 255) // 256 and grid[2] == 1, f"fake_cuda: mask_logits grid {grid} for V = {V}"
    B = grid[1]
    x = fake_cuda.view(logits, B * V).reshape(B, V)
    m = fake_cuda.view(mask, B * W, np.int32).reshape(B, W)
    for b in range(B):
        x[b] = mask_logits(x[b], m[b])
