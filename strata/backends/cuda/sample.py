"""Device sampling (cuda/sample.cu): launch shape, a numpy-in/out wrapper, and the numpy reference.

The kernel's exact semantics are in cuda/sample.cu's header; sample_reference() is the same rule in
numpy (float32 expf aside: the device's expf may differ by an ulp or two, so a draw whose u lies
within ~1e-6 of a boundary can differ; sample_margins() says how close each draw was).
"""
from __future__ import annotations

import numpy as np

from strata.errors import InvalidArgument

from .kernels import KERNELS, load_kernel

SAMPLE_THREADS = KERNELS["sample"].block          # cuda/sample.cu kThreads: the block must be exactly this
SAMPLE_SIGNATURE = KERNELS["sample"].signature    # logits, temperature, top_k, top_p, u, token, prob, V
MASS_ONE = float(1 << 40)      # fixed-point mass of the largest entry


def launch_shape(B: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of strata_sample_f32 for B rows: one block of SAMPLE_THREADS per row."""
    if B < 1:
        raise InvalidArgument(f"sample: B = {B} rows, need >= 1")
    return (B, 1, 1), (SAMPLE_THREADS, 1, 1)


def _rows(logits, temperature, top_k, top_p, u):
    x = np.ascontiguousarray(logits, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] == 0 or x.shape[1] >= 2**31 - 1:
        raise InvalidArgument(f"sample: logits {x.shape} must be [B, V] with 1 <= V < 2^31 - 1")
    B = x.shape[0]

    def per_row(v, dtype):
        return np.ascontiguousarray(np.broadcast_to(np.asarray(v, dtype=dtype), (B,)))

    try:
        params = (per_row(temperature, np.float32), per_row(top_k, np.int32), per_row(top_p, np.float32),
                  per_row(u, np.float64))
    except ValueError as exc:
        raise InvalidArgument(f"sample: a parameter does not broadcast to the {B} rows ({exc})") from None
    uu = params[3]
    if not np.all((uu >= 0.0) & (uu < 1.0)):
        raise InvalidArgument("sample: u must lie in [0, 1)")
    return (x, *params)


def _masses(row: np.ndarray, temperature: np.float32):
    """(keys as float32 with NaN -> -inf and -0 -> +0, uint64 masses) of one row."""
    x = np.where(np.isnan(row), np.float32(-np.inf), row).astype(np.float32)
    x[x == 0] = np.float32(0.0)
    vmax = x.max()
    with np.errstate(invalid="ignore", over="ignore", divide="ignore", under="ignore"):
        e = np.exp((x - vmax) / temperature).astype(np.float32)
    e = np.where(x == vmax, np.float32(1.0), e)
    return x, np.rint(e.astype(np.float64) * MASS_ONE).astype(np.uint64)


def _row_reference(row, temperature, top_k, top_p, u):
    """(token, prob, margin) of one row; margin: how near u and top_p fell to a decision boundary."""
    x, m = _masses(row, temperature)
    V = x.shape[0]
    if not temperature > 0:
        return int(np.argmax(x)), 1.0, np.inf
    if 0 < top_k < V:
        kth = np.partition(x, V - top_k)[V - top_k]
        m = np.where(x >= kth, m, np.uint64(0))
    margin = np.inf
    if top_p < 1.0:
        S = int(m.sum())
        target = min(S, max(1, int(np.ceil(np.float64(max(top_p, 0.0)) * np.float64(S)))))
        order = np.lexsort((np.arange(V), -x))          # value descending, id ascending
        order = order[m[order] > 0]
        cum = np.cumsum(m[order])
        cut = int(np.searchsorted(cum, np.uint64(target), side="left"))
        keep = np.zeros(V, bool)
        keep[order[:cut + 1]] = True
        m = np.where(keep, m, np.uint64(0))
        margin = abs(float(cum[cut]) - top_p * S) / S
        if cut:                                         # the first entry is always kept: no lower boundary
            margin = min(margin, abs(top_p * S - float(cum[cut - 1])) / S)
    SN = int(m.sum())
    thr = min(int(np.floor(np.float64(u) * np.float64(SN))), SN - 1)
    cum = np.cumsum(m)
    tok = int(np.searchsorted(cum, np.uint64(thr), side="right"))
    draw = u * SN
    margin = min(margin, (float(cum[tok]) - draw) / SN, (draw - (float(cum[tok - 1]) if tok else 0.0)) / SN)
    return tok, float(m[tok]) / SN, margin


def sample_reference(logits, temperature, top_k, top_p, u, margins: bool = False):
    """numpy version of strata_sample_f32: (tokens [B] int32, probs [B] float32[, margins [B]])."""
    x, T, k, p, uu = _rows(logits, temperature, top_k, top_p, u)
    rows = [_row_reference(x[b], T[b], int(k[b]), float(p[b]), float(uu[b])) for b in range(x.shape[0])]
    tokens = np.array([r[0] for r in rows], np.int32)
    probs = np.array([r[1] for r in rows], np.float32)
    return (tokens, probs, np.array([r[2] for r in rows])) if margins else (tokens, probs)


class CudaSampler:
    """strata_sample_f32 on one GPU, numpy in and out (uploads, one launch, downloads)."""

    def __init__(self, device: int = 0):
        from strata.backends.cuda import _runtime

        rt = _runtime()
        self._rt = rt
        self.device = rt.Device(device)
        self.stream = rt.Stream(self.device)
        self._kernel = load_kernel(rt, self.device, "sample")

    def _upload(self, array: np.ndarray):
        buf = self._rt.DeviceBuffer(self.device, array.nbytes)
        buf.copy_from_host(array, self.stream)
        return buf

    def sample(self, logits, temperature, top_k, top_p, u) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [B] int32, probs [B] float32); scalars broadcast over the rows."""
        x, T, k, p, uu = _rows(logits, temperature, top_k, top_p, u)
        B, V = x.shape
        if B == 0:
            return np.empty(0, np.int32), np.empty(0, np.float32)
        tok, prob = self._rt.DeviceBuffer(self.device, 4 * B), self._rt.DeviceBuffer(self.device, 4 * B)
        tok.fill_bytes(0xFF, self.stream)
        prob.fill_bytes(0xFF, self.stream)
        grid, block = launch_shape(B)
        bufs = [self._upload(a) for a in (x, T, k, p, uu)]
        self._kernel.launch(grid, block, (*bufs, tok, prob, V), stream=self.stream)
        tokens, probs = np.empty(B, np.int32), np.empty(B, np.float32)
        tok.copy_to_host(tokens, self.stream)
        prob.copy_to_host(probs, self.stream)
        self.stream.synchronize()
        return tokens, probs

