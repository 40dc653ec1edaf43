"""Random but valid block bytes of any supported quant type, for tests and synthetic models.

Quant fields (nibbles, high bits, int8 values) are uniform random bytes; the scale fields are then
overwritten with sane values: f16 block scales near `std / rms(unit block)` (jittered per block so
blocks differ), and for the min-offset formats a min that centres the block on zero. Everything is
vectorized over blocks: generating a tensor costs about one random byte per stored byte.
"""
from __future__ import annotations

import functools
import statistics

import numpy as np

from ..errors import InvalidArgument
from . import qtype, tensor_bytes
from .dequant import IQ4_NL_VALUES


def random_qtensor_bytes(qtype_name: str, shape: tuple, rng: np.random.Generator,
                         std: float = 0.02) -> np.ndarray:
    """Flat uint8 bytes of a random tensor of `shape` (numpy order) in quant type `qtype_name`.

    Dequantized values are finite, roughly zero-mean, with a standard deviation near `std`.
    """
    qt = qtype(qtype_name)
    shape = tuple(int(d) for d in shape)
    if not shape or min(shape) < 0:
        raise InvalidArgument(f"random_qtensor_bytes: shape {shape} must be non-empty and non-negative")
    if not (np.isfinite(std) and std > 0):
        raise InvalidArgument(f"random_qtensor_bytes: std {std!r} must be finite and positive")
    nbytes = tensor_bytes(qt.name, shape)
    if qt.block_size == 1:
        return _random_float_bytes(qt.name, nbytes // qt.type_size, rng, std)
    num_blocks = nbytes // qt.type_size
    blocks = rng.integers(0, 256, size=(num_blocks, qt.type_size), dtype=np.uint8)
    _FILL_SCALES[qt.name](blocks, rng, std)
    return blocks.reshape(-1)


def _random_float_bytes(name: str, count: int, rng: np.random.Generator, std: float) -> np.ndarray:
    if name == "F32":
        x = rng.standard_normal(count, dtype=np.float32)
        x *= np.float32(std)
        return x.view(np.uint8)
    # 16-bit types: look uniform 16-bit draws up in a table of normal quantiles (3x faster than
    # drawing normals, and already at the output precision)
    table = _normal_quantiles() * np.float32(std)
    if name == "F16":
        table16 = table.astype(np.float16).view(np.uint16)
    else:  # BF16: the top half of each float32 (truncation is fine for random data)
        table16 = (table.view(np.uint32) >> 16).astype(np.uint16)
    return table16[rng.integers(0, 1 << 16, size=count, dtype=np.uint16)].view(np.uint8)


@functools.cache
def _normal_quantiles() -> np.ndarray:
    """The 65536 standard-normal quantiles at (i + 0.5) / 65536, float32."""
    inv_cdf = statistics.NormalDist().inv_cdf
    return np.array([inv_cdf((i + 0.5) / 65536) for i in range(65536)], dtype=np.float32)


def pack_k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and 8 six-bit mins per block [B, 8] into Q4_K/Q5_K's 12 bytes [B, 12]
    (the inverse of dequant.unpack_k4_scales).

    Bytes 0-3: sc[0:4] low 6 bits, sc[4:8] top 2 bits in bits 6-7; bytes 4-7: the same for m;
    bytes 8-11: sc[4:8] low 4 bits | m[4:8] low 4 bits << 4.
    """
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return out


def _rms(values) -> float:
    """Root mean square of a uniform draw from `values`."""
    v = np.asarray(values, dtype=np.float64)
    return float(np.sqrt(np.mean(v * v)))


def _block_scales(rng: np.random.Generator, num_blocks: int, target: float) -> np.ndarray:
    """Per-block float32 scales around `target`, jittered by up to ±25% so blocks differ."""
    jitter = np.exp(rng.uniform(-0.25, 0.25, num_blocks))
    return (target * jitter).astype(np.float32)


def _put_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _fill_symmetric(offset: int, unit_rms: float):
    """Formats whose only scale field is one f16 `d` at `offset` (Q4_0, Q5_0, Q8_0, IQ4_NL, ...)."""
    def fill(blocks, rng, std):
        _put_f16(blocks, offset, _block_scales(rng, len(blocks), std / unit_rms))
    return fill


def _fill_min_offset(q_max: int):
    """Q4_1 / Q5_1: x = d*q + m with q uniform in [0, q_max]; m = -d*q_max/2 centres the block."""
    unit_rms = _rms(np.arange(q_max + 1) - q_max / 2)

    def fill(blocks, rng, std):
        d = _block_scales(rng, len(blocks), std / unit_rms)
        d16 = d.astype(np.float16)
        _put_f16(blocks, 0, d16)
        _put_f16(blocks, 2, -d16.astype(np.float32) * np.float32(q_max / 2))
    return fill


def _fill_q2_k(blocks, rng, std):
    """16 sub-blocks: x = d*sc*q - dmin*m, q in 0..3. dmin = 1.5 d and m ≈ sc centre each sub-block;
    m is jittered away from sc so a kernel that swaps the two fields cannot pass."""
    num_blocks = len(blocks)
    sc = rng.integers(0, 16, size=(num_blocks, 16), dtype=np.int16)
    m = np.clip(sc + rng.integers(-1, 2, size=sc.shape, dtype=np.int16), 0, 15)
    blocks[:, 0:16] = (sc | (m << 4)).astype(np.uint8)
    unit_rms = _rms(np.arange(16)) * _rms(np.arange(4) - 1.5)
    d = _block_scales(rng, num_blocks, std / unit_rms)
    _put_f16(blocks, 80, d)
    _put_f16(blocks, 82, d * np.float32(1.5))


def _fill_k4(q_max: int, dmin_offset: int):
    """Q4_K / Q5_K: 8 sub-blocks, x = d*sc*q - dmin*m with 6-bit sc, m; q uniform in [0, q_max]."""
    unit_rms = _rms(np.arange(64)) * _rms(np.arange(q_max + 1) - q_max / 2)

    def fill(blocks, rng, std):
        num_blocks = len(blocks)
        sc = rng.integers(0, 64, size=(num_blocks, 8), dtype=np.int16)
        m = np.clip(sc + rng.integers(-2, 3, size=sc.shape, dtype=np.int16), 0, 63)
        blocks[:, 4:16] = pack_k4_scales(sc.astype(np.uint8), m.astype(np.uint8))
        d = _block_scales(rng, num_blocks, std / unit_rms)
        _put_f16(blocks, 0, d)
        _put_f16(blocks, dmin_offset, d * np.float32(q_max / 2))
    return fill


# Formats with signed 6-bit sub-scales (Q3_K, IQ4_XS) or int8 sub-scales (Q6_K) keep their random
# sub-scale bytes: every bit pattern is a valid sub-scale.
_SIGNED6 = np.arange(-32, 32)
_FILL_SCALES = {
    "Q4_0": _fill_symmetric(0, _rms(np.arange(16) - 8)),
    "Q4_1": _fill_min_offset(15),
    "Q5_0": _fill_symmetric(0, _rms(np.arange(32) - 16)),
    "Q5_1": _fill_min_offset(31),
    "Q8_0": _fill_symmetric(0, _rms(np.arange(-128, 128))),
    "Q2_K": _fill_q2_k,
    "Q3_K": _fill_symmetric(108, _rms(_SIGNED6) * _rms(np.arange(-4, 4))),
    "Q4_K": _fill_k4(15, 2),
    "Q5_K": _fill_k4(31, 2),
    "Q6_K": _fill_symmetric(208, _rms(np.arange(-128, 128)) * _rms(np.arange(-32, 32))),
    "IQ4_NL": _fill_symmetric(0, _rms(IQ4_NL_VALUES)),
    "IQ4_XS": _fill_symmetric(0, _rms(_SIGNED6) * _rms(IQ4_NL_VALUES)),
}
