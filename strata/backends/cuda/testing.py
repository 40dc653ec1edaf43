"""Numpy-in, numpy-out wrappers of the kernels in cuda/, for tests and tools (CudaOps).

The engine never goes through here: it keeps its tensors on the device (strata.backends.cuda.ops).
Each method uploads its inputs, launches one kernel and reads the result back, so every kernel can
be checked against the numpy reference on its own.
"""

from __future__ import annotations

import numpy as np

from strata.errors import DeviceError, FormatError, InvalidArgument
from strata.quant import qtype, tensor_bytes

import strata.backends.cuda as _cuda     # _runtime() looked up per call, as tests patch it there
from . import kernels
from .kernels import EMBED_QTYPES, RMS_NORM_BLOCK


class CudaOps:
    """Ops on one GPU. Each call uploads its inputs and downloads its output: this proves the path
    from numpy to a kernel and back; the engine keeps its tensors on the device."""

    def __init__(self, device: int = 0):
        rt = _cuda._runtime()
        self.device = rt.Device(device)
        self.stream = rt.Stream(self.device)
        self._rt = rt
        self._rms_norm_f32 = rt.load_library("rms_norm").kernel(self.device, "strata_rms_norm_f32", "PPPiif")

    def _upload(self, array: np.ndarray):
        buf = self._rt.DeviceBuffer(self.device, array.nbytes)
        buf.copy_from_host(array, self.stream)
        return buf

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """x * rsqrt(mean(x^2, axis=-1) + eps) * w in float32; x [..., n], w [n]."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if x.ndim < 1 or w.shape != x.shape[-1:]:
            raise InvalidArgument(f"rms_norm: weight shape {w.shape} does not match x shape {x.shape}")
        n = x.shape[-1]
        rows = x.size // n if n else 0
        if not 0 < n < 2**31 or rows >= 2**31:
            raise InvalidArgument(f"rms_norm: x shape {x.shape} needs 1 <= n < 2^31 and rows < 2^31")
        y = np.empty_like(x)
        if rows == 0:
            return y
        x_dev, w_dev = self._upload(x), self._upload(w)
        y_dev = self._rt.DeviceBuffer(self.device, y.nbytes)
        self._rms_norm_f32.launch(rows, RMS_NORM_BLOCK, (x_dev, w_dev, y_dev, rows, n, float(eps)),
                                  stream=self.stream)
        y_dev.copy_to_host(y, self.stream)
        self.stream.synchronize()
        return y

    # ---- non-GEMM kernels: rope, attention, moe_route, swiglu, embed, argmax, moe_combine ----------
    # Thin wrappers (upload, launch, download) that prove each kernel's path from numpy and back.
    # Outputs are poisoned with 0xFF bytes (NaN, id -1) before each launch, so an element a kernel
    # fails to write shows in the result.

    ATTENTION_HEAD_DIMS = kernels.ATTENTION_HEAD_DIMS
    ATTENTION_MAX_SPLITS = kernels.ATTENTION_MAX_SPLITS
    MOE_ROUTE_MAX_EXPERTS = kernels.MOE_ROUTE_MAX_EXPERTS
    EMBED_QTYPES = EMBED_QTYPES

    def _kernel(self, library: str, name: str, signature: str):
        """Kernel `name` of cuda/<library>.cu on this device, looked up once."""
        cache = self.__dict__.setdefault("_kernels", {})
        if name not in cache:
            cache[name] = self._rt.load_library(library).kernel(self.device, name, signature)
        return cache[name]

    def _output(self, nbytes: int):
        buf = self._rt.DeviceBuffer(self.device, nbytes)
        buf.fill_bytes(0xFF, self.stream)
        return buf

    def _download(self, buf, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        buf.copy_to_host(out, self.stream)
        self.stream.synchronize()
        return out

    def rope(self, x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> np.ndarray:
        """NEOX rotation of x [T, heads, Dh] by positions [T] with inv_freq [Dh/2] (strata_rope_f32)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        pos = np.ascontiguousarray(positions, dtype=np.int32)
        inv = np.ascontiguousarray(inv_freq, dtype=np.float32)
        if x.ndim != 3 or x.shape[-1] % 2 or not 0 < x.shape[-1] <= 1024 or pos.shape != x.shape[:1] \
                or inv.shape != (x.shape[-1] // 2,):
            raise InvalidArgument(f"rope: x {x.shape} must be [T, heads, Dh] (Dh even, <= 1024) with "
                                  f"positions [T] and inv_freq [Dh/2]; got {pos.shape}, {inv.shape}")
        T, heads, dh = x.shape
        if x.size == 0:
            return x.copy()
        x_dev = self._upload(x)
        self._kernel("rope", "strata_rope_f32", "PPPiiif").launch(
            T, 128, (x_dev, self._upload(pos), self._upload(inv), T, heads, dh, float(scale)), stream=self.stream)
        return self._download(x_dev, x.shape, np.float32)

    def kv_append(self, k: np.ndarray, v: np.ndarray, cells: np.ndarray, k_cache: np.ndarray,
                  v_cache: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """f16 caches [rows, Hk, Dh] with k, v [T, Hk, Dh] written at rows cells [T] (strata_kv_append_f16)."""
        k = np.ascontiguousarray(k, dtype=np.float32)
        v = np.ascontiguousarray(v, dtype=np.float32)
        cells = np.ascontiguousarray(cells, dtype=np.int32)
        kc = np.ascontiguousarray(k_cache, dtype=np.float16)
        vc = np.ascontiguousarray(v_cache, dtype=np.float16)
        if k.ndim != 3 or v.shape != k.shape or kc.shape[1:] != k.shape[1:] or vc.shape != kc.shape \
                or cells.shape != k.shape[:1] or k.shape[1] * k.shape[2] % 2:
            raise InvalidArgument(f"kv_append: k, v {k.shape} [T, Hk, Dh] (Hk*Dh even), cells {cells.shape} [T] "
                                  f"and caches {kc.shape} [rows, Hk, Dh] do not match")
        if cells.size and (cells.min() < 0 or cells.max() >= kc.shape[0]):
            raise InvalidArgument(f"kv_append: cells outside the cache's {kc.shape[0]} rows")
        T = k.shape[0]
        kc_dev, vc_dev = self._upload(kc), self._upload(vc)
        if T:
            self._kernel("attention", "strata_kv_append_f16", "PPPPPii").launch(
                T, 128, (self._upload(k), self._upload(v), self._upload(cells), kc_dev, vc_dev, T,
                         k.shape[1] * k.shape[2]), stream=self.stream)
        return self._download(kc_dev, kc.shape, np.float16), self._download(vc_dev, vc.shape, np.float16)

    def _check_attention(self, op: str, q, k_cache, H: int, Hk: int, dh: int) -> int:
        G = H // Hk if Hk else 0
        if dh not in self.ATTENTION_HEAD_DIMS or not Hk or H % Hk or not 1 <= G <= (8 if dh == 256 else 16):
            raise InvalidArgument(f"{op}: q {q.shape} and cache {k_cache.shape} need Dh in "
                                  f"{self.ATTENTION_HEAD_DIMS}, H a multiple of Hk and H/Hk <= 16 (8 at Dh 256)")
        return G

    def decode_splits(self, num_seqs: int, num_kv_heads: int, max_cells: int, head_dim: int,
                      blocks_per_sm: int = 2) -> int:
        """kernels.decode_splits on this GPU."""
        return kernels.decode_splits(num_seqs, num_kv_heads, max_cells, head_dim,
                                     self.device.multiprocessor_count, blocks_per_sm)

    def attention_decode(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, lengths: np.ndarray,
                         num_splits: int | None = None, scale: float | None = None) -> np.ndarray:
        """One query per sequence: q [B, H, Dh] over f16 caches [B, S, Hk, Dh], sequence b reading
        cells 0..lengths[b]-1 -> [B, H*Dh] (split-K kernel, then the combine kernel)."""
        q = np.ascontiguousarray(q, dtype=np.float32)
        kc = np.ascontiguousarray(k_cache, dtype=np.float16)
        vc = np.ascontiguousarray(v_cache, dtype=np.float16)
        lengths = np.ascontiguousarray(lengths, dtype=np.int32)
        if q.ndim != 3 or kc.ndim != 4 or vc.shape != kc.shape or kc.shape[0] != q.shape[0] \
                or kc.shape[3] != q.shape[2] or lengths.shape != q.shape[:1]:
            raise InvalidArgument(f"attention_decode: q {q.shape} [B, H, Dh], caches {kc.shape} [B, S, Hk, Dh] "
                                  f"and lengths {lengths.shape} [B] do not match")
        B, H, dh = q.shape
        S, Hk = kc.shape[1], kc.shape[2]
        G = self._check_attention("attention_decode", q, kc, H, Hk, dh)
        if B == 0 or lengths.min() < 1 or lengths.max() > S:
            raise InvalidArgument(f"attention_decode: lengths must be in 1..{S} (B >= 1)")
        splits = num_splits or self.decode_splits(B, Hk, S, dh)
        if not 1 <= splits <= self.ATTENTION_MAX_SPLITS:
            raise InvalidArgument(f"attention_decode: num_splits {splits} not in 1..{self.ATTENTION_MAX_SPLITS}")
        scale = 1.0 / np.sqrt(dh) if scale is None else scale
        part_acc = self._output(B * H * splits * dh * 4)
        part_ml = self._output(B * H * splits * 2 * 4)
        out = self._output(B * H * dh * 4)
        gp = 1 << (G - 1).bit_length()
        self._kernel("attention", f"strata_attention_decode_f16_d{dh}_g{gp}", "PPPPPPiiiif").launch(
            (splits, Hk, B), 128, (self._upload(q), self._upload(kc), self._upload(vc), self._upload(lengths),
                                   part_acc, part_ml, H, Hk, S, splits, float(scale)), stream=self.stream)
        self._kernel("attention", "strata_attention_decode_combine_f32", "PPPiii").launch(
            (H, B), 128, (part_acc, part_ml, out, H, dh, splits), stream=self.stream)
        return self._download(out, (B, H * dh), np.float32)

    def attention_prefill(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, positions: np.ndarray,
                          scale: float | None = None) -> np.ndarray:
        """Causal attention of q [T, H, Dh] at positions [T] over f16 caches [S, Hk, Dh] holding cells
        0..max(positions) -> [T, H*Dh] (strata_attention_prefill_f16_d<Dh>)."""
        q = np.ascontiguousarray(q, dtype=np.float32)
        kc = np.ascontiguousarray(k_cache, dtype=np.float16)
        vc = np.ascontiguousarray(v_cache, dtype=np.float16)
        pos = np.ascontiguousarray(positions, dtype=np.int32)
        if q.ndim != 3 or kc.ndim != 3 or vc.shape != kc.shape or kc.shape[2] != q.shape[2] \
                or pos.shape != q.shape[:1]:
            raise InvalidArgument(f"attention_prefill: q {q.shape} [T, H, Dh], caches {kc.shape} [S, Hk, Dh] "
                                  f"and positions {pos.shape} [T] do not match")
        T, H, dh = q.shape
        Hk = kc.shape[1]
        G = self._check_attention("attention_prefill", q, kc, H, Hk, dh)
        if T == 0:
            return np.empty((0, H * dh), np.float32)
        if pos.min() < 0 or pos.max() >= kc.shape[0]:
            raise InvalidArgument(f"attention_prefill: positions must be in 0..{kc.shape[0] - 1}")
        rows = 16 if dh == 256 else 32
        scale = 1.0 / np.sqrt(dh) if scale is None else scale
        out = self._output(T * H * dh * 4)
        self._kernel("attention", f"strata_attention_prefill_f16_d{dh}", "PPPPPiiif").launch(
            (-(-T * G // rows), Hk), 128, (self._upload(q), self._upload(kc), self._upload(vc), self._upload(pos),
                                          out, T, H, Hk, float(scale)), stream=self.stream)
        return self._download(out, (T, H * dh), np.float32)

    def moe_route(self, router_logits: np.ndarray, top_k: int, norm_topk: bool):
        """Softmax, top-k (ties to the lower id), renormalized if asked: logits [T, E] ->
        (expert_ids [T, A] int32, expert_weights [T, A] f32) (strata_moe_route_f32)."""
        x = np.ascontiguousarray(router_logits, dtype=np.float32)
        if x.ndim != 2 or not 1 <= x.shape[1] <= self.MOE_ROUTE_MAX_EXPERTS or not 1 <= top_k <= min(32, x.shape[1]):
            raise InvalidArgument(f"moe_route: logits {x.shape} must be [T, E] with E <= "
                                  f"{self.MOE_ROUTE_MAX_EXPERTS} and 1 <= top_k {top_k} <= min(E, 32)")
        T, E = x.shape
        if T == 0:
            return np.empty((0, top_k), np.int32), np.empty((0, top_k), np.float32)
        ids, weights = self._output(T * top_k * 4), self._output(T * top_k * 4)
        self._kernel("moe_route", "strata_moe_route_f32", "PPPiiii").launch(
            -(-T // 4), 128, (self._upload(x), ids, weights, T, E, top_k, int(bool(norm_topk))), stream=self.stream)
        return self._download(ids, (T, top_k), np.int32), self._download(weights, (T, top_k), np.float32)

    def swiglu(self, gate: np.ndarray, up: np.ndarray | None = None) -> np.ndarray:
        """silu(gate) * up over [T, I]; with up=None, gate is one fused [T, 2I] buffer (gate | up)."""
        g = np.ascontiguousarray(gate, dtype=np.float32)
        if g.ndim != 2 or (up is None and g.shape[1] % 2):
            raise InvalidArgument(f"swiglu: gate {g.shape} must be [T, I] (or [T, 2I] fused)")
        T = g.shape[0]
        I = g.shape[1] // 2 if up is None else g.shape[1]
        u = None if up is None else np.ascontiguousarray(up, dtype=np.float32)
        if u is not None and u.shape != g.shape:
            raise InvalidArgument(f"swiglu: up {u.shape} differs from gate {g.shape}")
        if T == 0 or I == 0:
            return np.empty((T, I), np.float32)
        g_dev = self._upload(g)
        u_ptr, ld = (g_dev.ptr + I * 4, 2 * I) if u is None else (self._upload(u), I)
        out = self._output(T * I * 4)
        self._kernel("swiglu", "strata_swiglu_f32", "PPPiiqqq").launch(
            (-(-I // 256), min(T, 65535)), 256, (g_dev, u_ptr, out, T, I, ld, ld, I), stream=self.stream)
        return self._download(out, (T, I), np.float32)

    def embed(self, qtype_name: str, table: np.ndarray, n: int, ids: np.ndarray) -> np.ndarray:
        """Rows ids [T] of a [rows, n] table in its block bytes, dequantized to f32 [T, n]."""
        qt = qtype(qtype_name)
        if qt.name not in self.EMBED_QTYPES:
            raise InvalidArgument(f"embed: quant type {qt.name} has no kernel (have {', '.join(self.EMBED_QTYPES)})")
        data = np.ascontiguousarray(table, dtype=np.uint8).reshape(-1)
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        row_bytes = qt.row_bytes(int(n))
        if ids.ndim != 1 or not row_bytes or data.size % row_bytes:
            raise InvalidArgument(f"embed: {data.size} bytes are not whole rows of {n} {qt.name} weights, or ids "
                                  f"{ids.shape} is not [T]")
        if ids.size and (ids.min() < 0 or ids.max() >= data.size // row_bytes):
            raise InvalidArgument(f"embed: ids outside the table's {data.size // row_bytes} rows")
        T = ids.shape[0]
        if T == 0:
            return np.empty((0, n), np.float32)
        out = self._output(T * n * 4)
        self._kernel("embed", f"strata_embed_{qt.name.lower()}", "PPPii").launch(
            T, 256, (self._upload(data), self._upload(ids), out, T, int(n)), stream=self.stream)
        return self._download(out, (T, n), np.float32)

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        """Index of the largest logit of each row [B, V] -> [B] int32, ties to the lowest (strata_argmax_f32)."""
        x = np.ascontiguousarray(logits, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] == 0:
            raise InvalidArgument(f"argmax: logits {x.shape} must be [B, V] with V >= 1")
        B, V = x.shape
        if B == 0:
            return np.empty(0, np.int32)
        out = self._output(B * 4)
        self._kernel("argmax", "strata_argmax_f32", "PPi").launch(B, 1024, (self._upload(x), out, V), stream=self.stream)
        return self._download(out, (B,), np.int32)

    def mask_logits(self, logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """logits [B, V] with -inf where the bitmask [B, ceil(V / 32)] int32 has a 0 bit (strata_mask_logits_f32)."""
        x = np.ascontiguousarray(logits, dtype=np.float32)
        m = np.ascontiguousarray(mask, dtype=np.int32)
        if x.ndim != 2 or x.shape[1] == 0 or m.shape != (x.shape[0], (x.shape[1] + 31) // 32):
            raise InvalidArgument(f"mask_logits: logits {x.shape} must be [B, V >= 1] and mask {m.shape} "
                                  f"[B, ceil(V / 32)]")
        B, V = x.shape
        if B == 0:
            return x.copy()
        buf = self._upload(x)
        kernel = self._kernel("mask_logits", "strata_mask_logits_f32", "PPi")
        kernel.launch(((V + 255) // 256, B, 1), 256, (buf, self._upload(m), V), stream=self.stream)
        return self._download(buf, (B, V), np.float32)

    def moe_combine(self, residual: np.ndarray, expert_out: np.ndarray, weights: np.ndarray,
                    rows: np.ndarray | None = None) -> np.ndarray:
        """residual [T, D] + sum_a weights[t, a] * expert_out row (t, a) -> [T, D]. expert_out is
        [T, A, D], or [R, D] with rows [T, A] naming each (t, a)'s row (strata_moe_combine_f32)."""
        x = np.ascontiguousarray(residual, dtype=np.float32)
        w = np.ascontiguousarray(weights, dtype=np.float32)
        y = np.ascontiguousarray(expert_out, dtype=np.float32)
        if x.ndim != 2 or w.ndim != 2 or w.shape[0] != x.shape[0] or y.shape[-1] != x.shape[1] \
                or (rows is None and y.shape != (*w.shape, x.shape[1])):
            raise InvalidArgument(f"moe_combine: residual {x.shape} [T, D], weights {w.shape} [T, A] and "
                                  f"expert_out {y.shape} [T, A, D] do not match")
        T, D = x.shape
        A = w.shape[1]
        r = None if rows is None else np.ascontiguousarray(rows, dtype=np.int32)
        if r is not None and (r.shape != w.shape or (r.size and (r.min() < 0 or r.max() >= y.size // max(D, 1)))):
            raise InvalidArgument(f"moe_combine: rows {r.shape} must be [T, A] indices into expert_out's rows")
        if T == 0 or D == 0:
            return x.copy()
        out = self._output(T * D * 4)
        self._kernel("moe_combine", "strata_moe_combine_f32", "PPPPPiii").launch(
            (-(-D // 256), min(T, 65535)), 256,
            (self._upload(x), self._upload(y), 0 if r is None else self._upload(r), self._upload(w), out, T, A, D),
            stream=self.stream)
        return self._download(out, (T, D), np.float32)

    # ---- quantized weights: dequantization and decode GEMV (cuda/dequant.cu, cuda/gemv.cu) ---------
    # *_into launch on device addresses (a DeviceBuffer or an int) into the caller's buffers; the
    # numpy-level dequantize and gemv upload, launch into a poisoned output and download.

    DEQUANT_THREADS = 256
    GEMV_THREADS = 128               # cuda/gemv.cu kWarps * 32
    GEMV_MAX_BATCH = 8               # cuda/gemv_rows.cuh kMaxBatch
    GEMV_BATCH_ROWS = 4              # cuda/gemv_rows.cuh kBatchRows: rows per warp of strata_gemv_batch_*
    # (unit block weights, units per block, rows per lane) of each type's unit in cuda/gemv_units*.cuh;
    # float types take 8-weight units when n % 8 == 0, single weights otherwise. They only size the
    # grid (the kernels stride over row sets), so a stale entry costs speed, never correctness.
    GEMV_UNITS = {"Q4_0": (32, 1, 4), "Q4_1": (32, 1, 4), "Q5_0": (32, 1, 4), "Q5_1": (32, 1, 4),
                  "Q8_0": (32, 1, 4), "IQ4_NL": (32, 1, 4), "Q2_K": (256, 4, 4), "Q3_K": (256, 4, 4),
                  "Q4_K": (256, 4, 4), "Q5_K": (256, 4, 2), "Q6_K": (256, 4, 2), "IQ4_XS": (256, 4, 4),
                  "F32": (8, 1, 2), "F16": (8, 1, 2), "BF16": (8, 1, 2)}

    def gemv_rows_per_block(self, qtype_name: str, n: int) -> int:
        """Rows one 128-thread block of strata_gemv_<qtype> covers: (32 / lanes per row) * rows per lane
        per warp, where lanes per row is the power of two >= units per row, at most 32."""
        block, units, rows = self.GEMV_UNITS[qtype_name]
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
            self._kernel("dequant", f"strata_dequant_{qt.name.lower()}", "PPq").launch(
                grid, self.DEQUANT_THREADS, (blocks, out, num_blocks), stream=stream or self.stream)

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
        name = qt.name.lower()
        if batch is None:
            per_block = self.gemv_rows_per_block(qt.name, n) // (self.GEMV_THREADS // 32 if split else 1)
            self._kernel("gemv", f"strata_gemv_{'split_' if split else ''}{name}", "PPPii").launch(
                -(-rows // per_block), self.GEMV_THREADS, (w, x, y, rows, n), stream=stream or self.stream)
        else:
            grid = -(-rows // (self.GEMV_THREADS // 32 * self.GEMV_BATCH_ROWS))
            self._kernel("gemv", f"strata_gemv_batch_{name}", "PPPiii").launch(
                grid, self.GEMV_THREADS, (w, x, y, rows, n, batch), stream=stream or self.stream)

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
