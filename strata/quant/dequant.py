"""Reference dequantizers: ggml block bytes -> float32, one readable numpy function per type.

Each `_dequant_<type>(blocks)` takes the blocks of a tensor as a [B, type_size] uint8 array and
returns [B, block_size] float32. Its docstring states the block layout; CUDA kernels follow these
functions. All multi-byte fields are little-endian. The float arithmetic (which products are formed,
in which order, all in float32) is ggml's, so results match ggml bit for bit: scale products such
as `d * sc` are rounded to float32 before they multiply the quant.
"""
from __future__ import annotations

import numpy as np

from ..errors import FormatError, InvalidArgument
from . import QType, qtype

QK_K = 256  # weights per K-quant super-block

# IQ4_NL / IQ4_XS non-linear 4-bit codebook (ggml's kvalues_iq4nl)
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.int8)

_CHUNK_BLOCKS = 1 << 15  # blocks per numpy pass: bounds the temporaries of big tensors


def dequantize(qtype_name: str, data: np.ndarray, shape: tuple) -> np.ndarray:
    """Float32 array of `shape` from the flat uint8 block bytes `data` of quant type `qtype_name`."""
    qt = qtype(qtype_name)
    shape = tuple(int(d) for d in shape)
    data = _flat_bytes(qt, data)
    if not shape or min(shape) < 0:
        raise InvalidArgument(f"dequantize {qt.name}: shape {shape} must be non-empty and non-negative")
    num_rows = int(np.prod(shape[:-1], dtype=np.int64))
    expected = num_rows * qt.row_bytes(shape[-1])
    if data.size != expected:
        raise FormatError(f"dequantize {qt.name}: {data.size} bytes of data, but shape {shape} "
                          f"needs {expected}")
    return _dequant_flat(qt, data).reshape(shape)


def dequantize_rows(qtype_name: str, data: np.ndarray, n: int, rows) -> np.ndarray:
    """Float32 [len(rows), n] from rows of a [R, n] matrix stored as flat block bytes `data`.

    `rows` is a slice or an array of row indices; only the selected rows' bytes are read (for
    embedding lookups in large vocabularies).
    """
    qt = qtype(qtype_name)
    data = _flat_bytes(qt, data)
    row_bytes = qt.row_bytes(int(n))
    if row_bytes == 0 or data.size % row_bytes:
        raise FormatError(f"dequantize_rows {qt.name}: {data.size} bytes of data is not a whole "
                          f"number of rows of {n} weights ({row_bytes} bytes each)")
    num_rows = data.size // row_bytes
    matrix = data.reshape(num_rows, row_bytes)
    if isinstance(rows, slice):
        picked = matrix[rows]
    else:
        index = np.asarray(rows)
        if index.dtype.kind not in "iu" or index.ndim != 1:
            raise InvalidArgument(f"dequantize_rows {qt.name}: rows must be a slice or a 1-D integer "
                                  f"array, got {index.dtype} of shape {index.shape}")
        if index.size and (index.min() < -num_rows or index.max() >= num_rows):
            raise InvalidArgument(f"dequantize_rows {qt.name}: row index out of range for "
                                  f"{num_rows} rows")
        picked = matrix[index]
    return _dequant_flat(qt, picked.reshape(-1)).reshape(-1, int(n))


def _flat_bytes(qt: QType, data) -> np.ndarray:
    data = np.asarray(data)
    if data.dtype != np.uint8:
        raise InvalidArgument(f"dequantize {qt.name}: data must be uint8 block bytes, got {data.dtype}")
    return data.reshape(-1)


def _dequant_flat(qt: QType, data: np.ndarray) -> np.ndarray:
    """Flat float32 weights of flat block bytes whose size is already checked."""
    if qt.block_size == 1:
        return _FLOAT_DECODERS[qt.name](data)
    blocks = data.reshape(-1, qt.type_size)
    out = np.empty((len(blocks), qt.block_size), dtype=np.float32)
    decode = _BLOCK_DECODERS[qt.name]
    for start in range(0, len(blocks), _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        out[start:stop] = decode(blocks[start:stop])
    return out.reshape(-1)


# ---- field readers ------------------------------------------------------------------------------

def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The f16 field at byte `offset` of every block, as float32 [B, 1]."""
    raw = np.ascontiguousarray(blocks[:, offset:offset + 2])
    return raw.view(np.float16).astype(np.float32)


def _nibbles_halves(qs: np.ndarray) -> np.ndarray:
    """[B, k] bytes -> [B, 2k]: the k low nibbles, then the k high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _bit_planes(bits: np.ndarray, planes: int, width: int) -> np.ndarray:
    """[B, k] bytes -> [B, planes*k]: plane p is the `width`-bit field at bit p*width of every byte.

    Output element p*k + l is byte l's field p, the order in which ggml K-quants spread the
    2-bit quants and high bits of one byte across sub-blocks 32 (or 16) weights apart.
    """
    shifts = (np.arange(planes, dtype=np.uint8) * width).reshape(1, planes, 1)
    mask = np.uint8((1 << width) - 1)
    return ((bits[:, None, :] >> shifts) & mask).reshape(len(bits), -1)


def _low_bits32(bits: np.ndarray) -> np.ndarray:
    """[B, 4] bytes of a little-endian uint32 -> [B, 32] bits, bit j at column j."""
    return np.unpackbits(bits, axis=1, bitorder="little")


def unpack_k4_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes [B, 12] -> (sc [B, 8], m [B, 8]), six-bit values as uint8.

    Bytes 0-3: sc[0:4] low 6 bits, top 2 bits of sc[4:8] in bits 6-7; bytes 4-7: the same for m;
    bytes 8-11: low 4 bits of sc[4:8] | low 4 bits of m[4:8] << 4.
    """
    lo_sc, lo_m, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([lo_sc & 0x3F, (mixed & 0x0F) | ((lo_sc >> 6) << 4)], axis=1)
    m = np.concatenate([lo_m & 0x3F, (mixed >> 4) | ((lo_m >> 6) << 4)], axis=1)
    return sc, m


# ---- float types --------------------------------------------------------------------------------

def _decode_f32(data: np.ndarray) -> np.ndarray:
    return data.view(np.float32).copy()


def _decode_f16(data: np.ndarray) -> np.ndarray:
    return data.view(np.float16).astype(np.float32)


def _decode_bf16(data: np.ndarray) -> np.ndarray:
    """bfloat16 is the top half of a float32."""
    return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


_FLOAT_DECODERS = {"F32": _decode_f32, "F16": _decode_f16, "BF16": _decode_bf16}


# ---- 32-weight block types ----------------------------------------------------------------------

def _dequant_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_0, 18 bytes / 32 weights: d f16 | qs[16].

    Weight l < 16 is the low nibble of qs[l], weight 16 + l its high nibble; w = d * (q - 8).
    """
    d = _f16(blocks, 0)
    q = _nibbles_halves(blocks[:, 2:18]).astype(np.float32)
    return d * (q - np.float32(8))


def _dequant_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_1, 20 bytes / 32 weights: d f16 | m f16 | qs[16] (nibbles as Q4_0); w = d * q + m."""
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles_halves(blocks[:, 4:20]).astype(np.float32)
    return d * q + m


def _dequant_q5_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0, 22 bytes / 32 weights: d f16 | qh u32 | qs[16].

    Low 4 bits as Q4_0; bit j of qh is weight j's fifth bit; w = d * (q - 16).
    """
    d = _f16(blocks, 0)
    q = _nibbles_halves(blocks[:, 6:22]) | (_low_bits32(blocks[:, 2:6]) << 4)
    return d * (q.astype(np.float32) - np.float32(16))


def _dequant_q5_1(blocks: np.ndarray) -> np.ndarray:
    """Q5_1, 24 bytes / 32 weights: d f16 | m f16 | qh u32 | qs[16] (bits as Q5_0); w = d * q + m."""
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles_halves(blocks[:, 8:24]) | (_low_bits32(blocks[:, 4:8]) << 4)
    return d * q.astype(np.float32) + m


def _dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0, 34 bytes / 32 weights: d f16 | qs int8[32]; w = d * q."""
    d = _f16(blocks, 0)
    q = np.ascontiguousarray(blocks[:, 2:34]).view(np.int8).astype(np.float32)
    return d * q


def _dequant_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL, 18 bytes / 32 weights: d f16 | qs[16] (nibbles as Q4_0); w = d * IQ4_NL_VALUES[q]."""
    d = _f16(blocks, 0)
    q = _nibbles_halves(blocks[:, 2:18])
    return d * IQ4_NL_VALUES[q].astype(np.float32)


# ---- 256-weight K-quant super-blocks ------------------------------------------------------------

def _dequant_q2_k(blocks: np.ndarray) -> np.ndarray:
    """Q2_K, 84 bytes / 256 weights: scales[16] | qs[64] | d f16 | dmin f16.

    16 sub-blocks of 16 weights; scales[j] = sc | m << 4 (4 bits each) for sub-block j.
    2-bit quants: half h (128 weights) uses qs[32h : 32h+32]; weight 128h + 32p + l is bits 2p..2p+1
    of qs[32h + l]. w = (d * sc) * q - (dmin * m).
    """
    num_blocks = len(blocks)
    scales = blocks[:, 0:16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    q = _bit_planes(blocks[:, 16:80].reshape(-1, 32), 4, 2).reshape(num_blocks, 16, 16)
    dl = (d * (scales & 0x0F).astype(np.float32))[:, :, None]
    ml = (dmin * (scales >> 4).astype(np.float32))[:, :, None]
    return (dl * q.astype(np.float32) - ml).reshape(num_blocks, QK_K)


def _dequant_q3_k(blocks: np.ndarray) -> np.ndarray:
    """Q3_K, 110 bytes / 256 weights: hmask[32] | qs[64] | scales[12] | d f16.

    Low 2 bits of each quant as in Q2_K; bit j of hmask[l] belongs to weight 32j + l, and a CLEAR
    bit subtracts 4: q = low - 4 * (1 - hbit), in -4..3.
    16 six-bit sub-scales (sub-blocks of 16): sub-block i < 8 takes the low nibble of scales[i],
    i >= 8 the high nibble of scales[i - 8]; its top 2 bits are bits 2p..2p+1 of scales[8 + i % 4]
    with p = i // 4. w = (d * (sc - 32)) * q.
    """
    num_blocks = len(blocks)
    hbit = _bit_planes(blocks[:, 0:32], 8, 1)
    low = _bit_planes(blocks[:, 32:96].reshape(-1, 32), 4, 2).reshape(num_blocks, QK_K)
    q = low.astype(np.int16) - 4 * (1 - hbit.astype(np.int16))
    packed = blocks[:, 96:108]
    sc = _nibbles_halves(packed[:, 0:8]) | (_bit_planes(packed[:, 8:12], 4, 2) << 4)
    d = _f16(blocks, 108)
    dl = (d * (sc.astype(np.float32) - np.float32(32)))[:, :, None]
    return (dl * q.reshape(num_blocks, 16, 16).astype(np.float32)).reshape(num_blocks, QK_K)


def _k4_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K quants [B, 128] -> [B, 256]: chunk c of 32 bytes holds weights 64c..64c+31 in its
    low nibbles and 64c+32..64c+63 in its high nibbles."""
    return _nibbles_halves(qs.reshape(-1, 32)).reshape(len(qs), QK_K)


def _k4_weights(blocks: np.ndarray, q: np.ndarray) -> np.ndarray:
    """w = (d * sc) * q - (dmin * m) over 8 sub-blocks of 32, with Q4_K's d, dmin and scales."""
    num_blocks = len(blocks)
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = unpack_k4_scales(blocks[:, 4:16])
    dl = (d * sc.astype(np.float32))[:, :, None]
    ml = (dmin * m.astype(np.float32))[:, :, None]
    return (dl * q.reshape(num_blocks, 8, 32).astype(np.float32) - ml).reshape(num_blocks, QK_K)


def _dequant_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K, 144 bytes / 256 weights: d f16 | dmin f16 | scales[12] | qs[128].

    8 sub-blocks of 32 with six-bit sc and m packed as `unpack_k4_scales` says; 4-bit quants as
    `_k4_nibbles` says. w = (d * sc) * q - (dmin * m).
    """
    return _k4_weights(blocks, _k4_nibbles(blocks[:, 16:144]))


def _dequant_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q5_K, 176 bytes / 256 weights: d f16 | dmin f16 | scales[12] | qh[32] | qs[128].

    As Q4_K, plus a fifth bit: bit j of qh[l] is weight 32j + l's bit 4.
    """
    q = _k4_nibbles(blocks[:, 48:176]) | (_bit_planes(blocks[:, 16:48], 8, 1) << 4)
    return _k4_weights(blocks, q)


def _dequant_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K, 210 bytes / 256 weights: ql[128] | qh[64] | scales int8[16] | d f16.

    Two halves of 128 weights; half h uses ql[64h : 64h+64] and qh[32h : 32h+32]. Within a half,
    weight l < 64 is the low nibble of ql[l], weight 64 + l the high nibble; the top 2 bits of
    weight 32p + l are bits 2p..2p+1 of qh[l]. q = low | top << 4, minus 32.
    16 sub-blocks of 16 with int8 scales: w = (d * sc) * (q - 32).
    """
    num_blocks = len(blocks)
    low = _nibbles_halves(blocks[:, 0:128].reshape(-1, 64))
    top = _bit_planes(blocks[:, 128:192].reshape(-1, 32), 4, 2)
    q = (low | (top << 4)).astype(np.int16) - 32
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks, 208)
    dl = (d * sc)[:, :, None]
    return (dl * q.reshape(num_blocks, 16, 16).astype(np.float32)).reshape(num_blocks, QK_K)


def _dequant_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS, 136 bytes / 256 weights: d f16 | scales_h u16 | scales_l[4] | qs[128].

    8 sub-blocks of 32. Sub-block j's six-bit scale: low 4 bits are nibble j % 2 of scales_l[j // 2],
    top 2 bits are bits 2j..2j+1 of scales_h. Its quants are qs[16j : 16j+16]: low nibbles are
    weights 0..15, high nibbles 16..31. w = (d * (sc - 32)) * IQ4_NL_VALUES[q].
    """
    num_blocks = len(blocks)
    d = _f16(blocks, 0)
    scales_h = np.ascontiguousarray(blocks[:, 2:4]).view(np.uint16)
    top = (scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 0x3
    low = _bit_planes(blocks[:, 4:8], 2, 4).reshape(num_blocks, 2, 4).transpose(0, 2, 1)
    sc = low.reshape(num_blocks, 8) | (top.astype(np.uint8) << 4)
    dl = (d * (sc.astype(np.float32) - np.float32(32)))[:, :, None]
    q = _nibbles_halves(blocks[:, 8:136].reshape(-1, 16)).reshape(num_blocks, 8, 32)
    return (dl * IQ4_NL_VALUES[q].astype(np.float32)).reshape(num_blocks, QK_K)


_BLOCK_DECODERS = {
    "Q4_0": _dequant_q4_0, "Q4_1": _dequant_q4_1, "Q5_0": _dequant_q5_0, "Q5_1": _dequant_q5_1,
    "Q8_0": _dequant_q8_0, "Q2_K": _dequant_q2_k, "Q3_K": _dequant_q3_k, "Q4_K": _dequant_q4_k,
    "Q5_K": _dequant_q5_k, "Q6_K": _dequant_q6_k, "IQ4_NL": _dequant_iq4_nl, "IQ4_XS": _dequant_iq4_xs,
}
