"""Block quant formats with ggml's names and byte layouts.

A quantized row of `n` weights is `n // block_size` blocks of `type_size` bytes. Tensors are stored
row-major with numpy shape [..., rows, n] (the innermost dimension is the input dimension, ggml's ne0).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedError


@dataclass(frozen=True)
class QType:
    name: str
    ggml_id: int        # GGMLQuantizationType value
    block_size: int     # weights per block
    type_size: int      # bytes per block

    def row_bytes(self, n: int) -> int:
        if n % self.block_size:
            raise UnsupportedError(
                f"{self.name}: a row of {n} weights is not a multiple of the block size {self.block_size}")
        return n // self.block_size * self.type_size


QTYPES: dict[str, QType] = {q.name: q for q in [
    QType("F32", 0, 1, 4),
    QType("F16", 1, 1, 2),
    QType("Q4_0", 2, 32, 18),
    QType("Q4_1", 3, 32, 20),
    QType("Q5_0", 6, 32, 22),
    QType("Q5_1", 7, 32, 24),
    QType("Q8_0", 8, 32, 34),
    QType("Q2_K", 10, 256, 84),
    QType("Q3_K", 11, 256, 110),
    QType("Q4_K", 12, 256, 144),
    QType("Q5_K", 13, 256, 176),
    QType("Q6_K", 14, 256, 210),
    QType("IQ4_NL", 20, 32, 18),
    QType("IQ4_XS", 23, 256, 136),
    QType("BF16", 30, 1, 2),
]}
QTYPES_BY_ID: dict[int, QType] = {q.ggml_id: q for q in QTYPES.values()}


def qtype(name_or_id: str | int) -> QType:
    """The QType for a ggml name ('Q4_K') or id (12); UnsupportedError for anything else."""
    table = QTYPES_BY_ID if isinstance(name_or_id, int) else QTYPES
    key = name_or_id if isinstance(name_or_id, int) else str(name_or_id).upper()
    if key not in table:
        raise UnsupportedError(
            f"quant type {name_or_id!r} is not supported (supported: {', '.join(QTYPES)})")
    return table[key]


@dataclass(frozen=True)
class QTensor:
    """A weight tensor in its native block bytes. shape is numpy order; data is a flat uint8 view."""
    qtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def dequantize(self) -> np.ndarray:
        from .dequant import dequantize
        return dequantize(self.qtype, self.data, self.shape)


def tensor_bytes(qtype_name: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of this shape in this quant type (rows of shape[-1] weights)."""
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return rows * qtype(qtype_name).row_bytes(int(shape[-1]))
