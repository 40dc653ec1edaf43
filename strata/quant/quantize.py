"""Quantize float32 weights into ggml block bytes (the HF -> pack path).

gguf-py's numpy quantizers are bit-exact with ggml's reference quantizers for the simple block
types, so we call them rather than keep a second copy; K-quants and IQ types need ggml's search-based
quantizers and are not offered.
"""
from __future__ import annotations

import gguf
import numpy as np
from gguf.quants import quantize as _gguf_quantize

from ..errors import InvalidArgument, UnsupportedError
from . import qtype

QUANTIZABLE: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def quantize(qtype_name: str, x: np.ndarray) -> np.ndarray:
    """Flat uint8 block bytes of `x` [..., n] (rows of n weights) in quant type `qtype_name`.

    The bytes are laid out as `dequantize(qtype_name, data, x.shape)` reads them.
    """
    qt = qtype(qtype_name)
    if qt.name not in QUANTIZABLE:
        raise UnsupportedError(f"quantize: cannot quantize to {qt.name} "
                               f"(quantizable types: {', '.join(QUANTIZABLE)})")
    x = np.asarray(x)
    if x.ndim == 0 or x.dtype.kind != "f":
        raise InvalidArgument(f"quantize {qt.name}: x must be a floating array [..., n], "
                              f"got {x.dtype} of shape {x.shape}")
    qt.row_bytes(x.shape[-1])  # raises when a row is not whole blocks
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise InvalidArgument(f"quantize {qt.name}: x holds NaN or infinite values")
    if x.size == 0:
        return np.zeros(0, dtype=np.uint8)
    data = _gguf_quantize(x, gguf.GGMLQuantizationType(qt.ggml_id))
    return np.ascontiguousarray(data).view(np.uint8).reshape(-1)
