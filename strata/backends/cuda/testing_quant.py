"""CudaOps' wrappers of the quantized-weight kernels (cuda/dequant.cu, cuda/gemv.cu). *_into launch
on device addresses (a DeviceBuffer or an int) into the caller's buffers; the numpy-level dequantize
and gemv upload, launch into a poisoned output and download."""

from __future__ import annotations

import numpy as np

from strata.errors import FormatError, InvalidArgument
from strata.quant import qtype, tensor_bytes

from .kernels import KERNELS


class QuantWrappers:
    """Mixed into CudaOps (strata.backends.cuda.testing), whose _upload, _output, _download and
    _launch these use."""

    DEQUANT_THREADS = KERNELS["dequant"].block
    GEMV_THREADS = KERNELS["gemv"].block    # cuda/gemv.cu kWarps * 32
    GEMV_MAX_BATCH = 8               # cuda/gemv_rows.cuh kMaxBatch
    GEMV_BATCH_ROWS = 4              # cuda/gemv_rows.cuh kBatchRows: rows per warp of strata_gemv_batch_*
    # (unit block weights, units per block, rows per lane) of each type's unit in cuda/gemv_units*.cuh;
    # float types take 8-weight units when n % 8 == 0, single weights otherwise. They only size the
    # grid (the kernels stride over row sets), so a stale entry costs speed, never correctness.
    GEMV_UNITS = {"Q4_0": (32, 1, 4), "Q4_1": (32, 1, 4), "Q5_0": (32, 1, 4), "Q5_1": (32, 1, 4),
                  "Q8_0": (32, 1, 4), "IQ4_NL": (32, 1, 4), "Q2_K": (256, 4, 4), "Q3_K": (256, 4, 4),
                  "Q4_K": (256, 4, 4), "Q5_K": (256, 4, 2), "Q6_K": (256, 4, 2), "IQ4_XS": (256, 4, 4),
                  "F32": (8, 1, 2), "F16": (8, 1, 2), "BF16": (8, 1, 2)}

    def gemv_rows_per_block(self, qtype_name: str, n: int, one_row: bool = False) -> int:
        """Rows one 128-thread block of strata_gemv_<qtype> covers: (32 / lanes per row) * rows per lane
        per warp, where lanes per row is the power of two >= units per row, at most 32. one_row: those
        of strata_gemv_one_<qtype> (one row a lane)."""
        block, units, rows = self.GEMV_UNITS[qtype_name]
        if one_row:
            rows = 1
        if block == 8 and n % 8:
            block, units, rows = 1, 1, 1
        lanes = min(32, 1 << max(n // block * units - 1, 0).bit_length())
        return self.GEMV_THREADS // 32 * (32 // lanes) * rows

    def dequantize_into(self, qtype_name: str, blocks, out, num_blocks: int, stream=None) -> None:
        """Queue strata_dequant_<qtype>: num_blocks blocks at `blocks` -> num_blocks * block_size
        float32 at `out`, bit-exact with strata.quant.dequant. Both 16-byte aligned."""
        qt = qtype(qtype_name)
        _check_aligned(f"dequantize_into {qt.name}", 16, blocks=blocks, out=out)
        if not 0 <= num_blocks < 2**62:
            raise InvalidArgument(f"dequantize_into {qt.name}: num_blocks {num_blocks} out of range")
        work = num_blocks if qt.block_size == 1 else num_blocks * (qt.block_size // 8)  # threads' items
        if work:
            grid = min(-(-work // self.DEQUANT_THREADS), 1 << 20)
            self._launch("dequant", grid, (blocks, out, num_blocks), stream=stream, qtype=qt.name)

    def gemv_into(self, qtype_name: str, w, x, y, rows: int, n: int, batch: int | None = None,
                  stream=None, split: bool = False) -> None:
        """Queue y = W x with W [rows, n] in its block bytes at `w` (16-byte aligned): x [n] -> y [rows]
        (strata_gemv_<qtype>, or with split strata_gemv_split_<qtype>: the block's warps split each
        row's units, for matrices of few rows); with batch B in 1..8, x [B, n] -> y [B, rows]
        (strata_gemv_batch_<qtype>, n % 8 == 0). x is 16-byte aligned (4 for a float type with
        n % 8 != 0), y 4-byte aligned."""
        qt = qtype(qtype_name)
        if not (0 < rows < 2**31 and 0 < n < 2**31 and n % qt.block_size == 0) or \
                (batch is not None and not (1 <= batch <= self.GEMV_MAX_BATCH and n % 8 == 0)):
            raise InvalidArgument(f"gemv_into {qt.name}: rows {rows}, n {n}, batch {batch}: needs rows, n >= 1, "
                                  f"n a multiple of {qt.block_size}, batch in 1..{self.GEMV_MAX_BATCH} with n % 8 == 0")
        _check_aligned(f"gemv_into {qt.name}", 16, w=w)
        _check_aligned(f"gemv_into {qt.name}", 16 if n % 8 == 0 or qt.block_size > 1 else 4, x=x)
        _check_aligned(f"gemv_into {qt.name}", 4, y=y)
        if batch is None:
            per_block = self.gemv_rows_per_block(qt.name, n) // (self.GEMV_THREADS // 32 if split else 1)
            self._launch("gemv_split" if split else "gemv", -(-rows // per_block), (w, x, y, rows, n), stream=stream,
                         qtype=qt.name)
        else:
            grid = -(-rows // (self.GEMV_THREADS // 32 * self.GEMV_BATCH_ROWS))
            self._launch("gemv_batch", grid, (w, x, y, rows, n, batch), stream=stream, qtype=qt.name)

    def dequantize(self, qtype_name: str, data: np.ndarray, shape: tuple) -> np.ndarray:
        """strata.quant.dequant.dequantize on the GPU: flat block bytes -> float32 of `shape`, bit-exact."""
        qt, shape, data = _quant_tensor("dequantize", qtype_name, data, shape)
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:
            return np.empty(shape, np.float32)
        out = self._output(count * 4)
        self.dequantize_into(qt.name, self._upload(data), out, data.size // qt.type_size)
        return self._download(out, shape, np.float32)

    def gemv(self, qtype_name: str, data: np.ndarray, shape: tuple, x: np.ndarray, split: bool = False) -> np.ndarray:
        """W x in float32, W [rows, n] given as flat block bytes: x [n] -> [rows] (split: the split-K
        kernel); x [B, n] (B <= 8, the batched kernel) -> [B, rows]."""
        qt, shape, data = _quant_tensor("gemv", qtype_name, data, shape)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if len(shape) != 2 or x.ndim not in (1, 2) or x.shape[-1] != shape[1] or \
                (x.ndim == 2 and not 1 <= x.shape[0] <= self.GEMV_MAX_BATCH):
            raise InvalidArgument(f"gemv {qt.name}: W {shape} must be [rows, n] and x {x.shape} [n] or "
                                  f"[B <= {self.GEMV_MAX_BATCH}, n]")
        rows, n = shape
        out_shape = (*x.shape[:-1], rows)
        if rows == 0 or n == 0:
            return np.zeros(out_shape, np.float32)
        w_dev, x_dev, y = self._upload(data), self._upload(x), self._output(x.size // n * rows * 4)
        if x.ndim == 1:
            self.gemv_into(qt.name, w_dev, x_dev, y, rows, n, split=split)
        elif n % 8 == 0:
            self.gemv_into(qt.name, w_dev, x_dev, y, rows, n, batch=x.shape[0])
        else:  # float types with odd rows have no batched kernel: one launch per token
            for b in range(x.shape[0]):
                self.gemv_into(qt.name, w_dev, x_dev.ptr + 4 * b * n, y.ptr + 4 * b * rows, rows, n)
        return self._download(y, out_shape, np.float32)


def _check_aligned(op: str, alignment: int, **buffers) -> None:
    for name, buf in buffers.items():
        address = int(getattr(buf, "ptr", buf))
        if address % alignment:
            raise InvalidArgument(f"{op}: {name} at {address:#x} is not {alignment}-byte aligned")


def _quant_tensor(op: str, qtype_name: str, data, shape):
    """(QType, shape, flat uint8 data) checked as strata.quant.dequant.dequantize checks them."""
    qt = qtype(qtype_name)
    shape = tuple(int(d) for d in shape)
    data = np.asarray(data)
    if data.dtype != np.uint8:
        raise InvalidArgument(f"{op} {qt.name}: data must be uint8 block bytes, got {data.dtype}")
    if not shape or min(shape) < 0:
        raise InvalidArgument(f"{op} {qt.name}: shape {shape} must be non-empty and non-negative")
    data = np.ascontiguousarray(data).reshape(-1)
    expected = tensor_bytes(qt.name, shape)
    if data.size != expected:
        raise FormatError(f"{op} {qt.name}: {data.size} bytes of data, but shape {shape} needs {expected}")
    return qt, shape, data
