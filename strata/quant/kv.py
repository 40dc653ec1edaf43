"""KV cache formats: the numpy reference of how K and V cells are stored, and the CPU backend's codec.

A format pairs a codec for K with one for V (`KV_FORMATS`). Each codec stores a head vector of Dh
values as a `values` plane and, when quantized, a `scales` plane, both [..., Dh-derived] numpy arrays
(planar, so a GPU reads aligned 16-byte values and scales separately; these are not ggml file bytes):

- f32:  float32 values, no scales (the CPU oracle's exact cells; never a GPU format).
- f16:  float16 values (round to nearest even), no scales.
- int8: int8 values [..., Dh], float16 scales [..., Dh / 64]: one scale per 64 values,
        d = f16(amax / 127), q = clip(rint(x / d), -127, 127) (quantized against the stored d;
        rint rounds half to even, as CUDA's __float2int_rn), x ~ q * d. |error| <= d / 2.
- q4r:  q4_0's value rule on a Hadamard-rotated head vector. y = H x (H the normalized Walsh-Hadamard
        matrix of order Dh, symmetric and orthonormal: H H = I), then per block of 32: m = the y of
        largest |y| (the first on ties), d = f16(m / -8), q = min(15, floor(y / d + 8.5)), y ~ (q - 8) d.
        uint8 values [..., Dh / 2] (value 2i in the low nibble of logical byte i, 2i + 1 in the high
        one; block b is logical bytes 16b .. 16b + 15), float16 scales [..., Dh / 32]. The logical
        bytes are stored in the decode kernel's lane order (`q4_byte_pos`): the 4-byte pieces
        16b + 4t .. + 3 go to (t * Dh / 32 + b) * 4, so each of a quad's four lanes t reads its share of
        every block as one contiguous load (16 bytes at Dh 128) instead of one load a block.
        |error| <= |d| / 2, |d| where q clips at 15 (the value opposite in sign to m, as q4_0). The
        rotation spreads an outlier dimension over the whole head, so one channel no longer sets
        every block's scale.

Attention over a rotated codec: scores q . k = (H q) . (H k), so the query is rotated once and dotted
with the stored rotated keys (K is never un-rotated); the output sum_c p_c v_c = H sum_c p_c (H v_c),
so the weighted sum of the stored rotated values is un-rotated once per head (`rotate` is its own
inverse). The rotation is the fast transform with a fixed butterfly order in float32, then one
multiply by f32(1 / sqrt(Dh)), so a GPU kernel doing the same steps matches it bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument

KV_FORMATS = ("f16", "int8", "q4_0", "k8v4")
INT8_BLOCK = 64
Q4_BLOCK = 32


def rotate(x: np.ndarray) -> np.ndarray:
    """H x over the last axis (a power of two): the Walsh-Hadamard transform, normalized, in float32.
    Stage h (1, 2, 4, ...) maps each pair (i, i + h) of every 2h-block to (a + b, a - b)."""
    x = np.asarray(x, np.float32)
    n = x.shape[-1]
    if n & (n - 1):
        raise InvalidArgument(f"a Hadamard rotation needs a power-of-two head dim, got {n}")
    lead = x.shape[:-1]
    h = 1
    while h < n:
        y = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = np.stack([a + b, a - b], axis=-2).reshape(*lead, n)
        h *= 2
    return x * np.float32(1.0 / np.sqrt(n))


@dataclass(frozen=True)
class Codec:
    """How one of K or V is stored; see the module doc."""
    name: str               # f32, f16, int8, q4r
    block: int              # values per scale (1: no scales)
    block_bytes: int        # bytes of one block (values + its scale)
    rotated: bool

    def check(self, head_dim: int) -> None:
        if head_dim % self.block:
            raise InvalidArgument(f"KV codec {self.name}: head dim {head_dim} is not a multiple of {self.block}")
        if self.rotated and head_dim & (head_dim - 1):
            raise InvalidArgument(f"KV codec {self.name}: the rotation needs a power-of-two head dim, got {head_dim}")

    def row_bytes(self, n: int) -> int:
        """Bytes of n values (a multiple of the block)."""
        return n // self.block * self.block_bytes

    def empty(self, lead: tuple, head_dim: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Zeroed (values, scales) planes for cells of shape lead + (head_dim,)."""
        if self.name in ("f32", "f16"):
            return np.zeros((*lead, head_dim), self.name.replace("f", "float")), None
        dtype, width = (np.int8, head_dim) if self.name == "int8" else (np.uint8, head_dim // 2)
        return np.zeros((*lead, width), dtype), np.zeros((*lead, head_dim // self.block), np.float16)

    def encode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """x [..., Dh] float32 -> (values, scales)."""
        x = np.asarray(x, np.float32)
        if self.name == "f32":
            return x.copy(), None
        if self.name == "f16":
            return x.astype(np.float16), None
        if self.name == "int8":
            return _encode_int8(x)
        return _encode_q4(rotate(x))

    def decode(self, values: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
        """(values, scales) -> float32 [..., Dh]; a rotated codec's in the rotated domain."""
        if scales is None:
            return values.astype(np.float32)
        d = np.repeat(scales.astype(np.float32), self.block, axis=-1)
        if self.name == "int8":
            return values.astype(np.float32) * d
        values = values[..., q4_byte_pos(values.shape[-1])]       # stored -> logical byte order
        q = np.stack([values & 0xF, values >> 4], axis=-1).reshape(*values.shape[:-1], 2 * values.shape[-1])
        return (q.astype(np.float32) - np.float32(8)) * d


CODECS = {c.name: c for c in (Codec("f32", 1, 4, False), Codec("f16", 1, 2, False),
                              Codec("int8", INT8_BLOCK, INT8_BLOCK + 2, False),
                              Codec("q4r", Q4_BLOCK, Q4_BLOCK // 2 + 2, True))}
# a format's (K codec, V codec); "f32" is the CPU oracle's exact cells, not a --kv choice
FORMAT_CODECS = {"f32": ("f32", "f32"), "f16": ("f16", "f16"), "int8": ("int8", "int8"),
                 "q4_0": ("q4r", "q4r"), "k8v4": ("int8", "q4r")}


def codecs(fmt: str) -> tuple[Codec, Codec]:
    """(K codec, V codec) of a KV format."""
    if fmt not in FORMAT_CODECS:
        raise InvalidArgument(f"KV format must be one of {', '.join(KV_FORMATS)}, got {fmt!r}")
    k, v = FORMAT_CODECS[fmt]
    return CODECS[k], CODECS[v]


def cell_bytes(fmt: str, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one cell (K and V of every KV head) of one layer in this format."""
    k, v = codecs(fmt)
    return num_kv_heads * (k.row_bytes(head_dim) + v.row_bytes(head_dim))


def q4_byte_pos(nbytes: int) -> np.ndarray:
    """Where each logical byte p of a q4r head vector's nbytes (Dh / 2) value bytes is stored:
    piece t = (p % 16) / 4 of block b = p / 16 goes to (t * nb + b) * 4 (nb = nbytes / 16 blocks), its
    bytes kept in order (cuda/kv_codec.cuh's q4_byte_pos). stored[..., pos] = logical; logical =
    stored[..., pos]."""
    p = np.arange(nbytes)
    return (((p % 16) // 4) * (nbytes // 16) + p // 16) * 4 + p % 4


def _blocks(x: np.ndarray, n: int) -> np.ndarray:
    return x.reshape(*x.shape[:-1], x.shape[-1] // n, n)


def _encode_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xb = _blocks(x, INT8_BLOCK)
    d = (np.abs(xb).max(axis=-1) / np.float32(127)).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(df > 0, np.rint(xb / np.where(df > 0, df, 1)), 0)
    return np.clip(q, -127, 127).astype(np.int8).reshape(x.shape), d


def _encode_q4(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    yb = _blocks(y, Q4_BLOCK)
    idx = np.abs(yb).argmax(axis=-1)[..., None]
    m = np.take_along_axis(yb, idx, axis=-1)[..., 0]
    d = (m / np.float32(-8)).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(df != 0, np.floor(yb / np.where(df != 0, df, 1) + np.float32(8.5)), 8)
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(y.shape)
    logical = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    stored = np.empty_like(logical)
    stored[..., q4_byte_pos(logical.shape[-1])] = logical
    return stored, d
