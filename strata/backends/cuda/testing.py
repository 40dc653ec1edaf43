"""Numpy-in, numpy-out wrappers of the kernels in cuda/, for tests and tools (CudaOps).

The engine never goes through here: it keeps its tensors on the device (strata.backends.cuda.ops).
Each method uploads its inputs, launches one kernel and reads the result back, so every kernel can
be checked against the numpy reference on its own. The attention wrappers are in testing_attention,
the quantized-weight ones in testing_quant; every launch names its kernel in kernels.KERNELS.
"""

from __future__ import annotations

import numpy as np

from strata.errors import InvalidArgument
from strata.quant import qtype

import strata.backends.cuda as _cuda     # _runtime() looked up per call, as tests patch it there
from .kernels import EMBED_QTYPES, KERNELS, MOE_ROUTE_MAX_EXPERTS
from .testing_attention import AttentionWrappers
from .testing_quant import QuantWrappers


class CudaOps(AttentionWrappers, QuantWrappers):
    """Ops on one GPU. Each call uploads its inputs and downloads its output: this proves the path
    from numpy to a kernel and back; the engine keeps its tensors on the device."""

    def __init__(self, device: int = 0):
        rt = _cuda._runtime()
        self.device = rt.Device(device)
        self.stream = rt.Stream(self.device)
        self._rt = rt
        self._kernel("rms_norm")             # the library loads here: a build without kernels fails now

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
        self._launch("rms_norm", rows, (x_dev, w_dev, y_dev, rows, n, float(eps)))
        y_dev.copy_to_host(y, self.stream)
        self.stream.synchronize()
        return y

    # ---- non-GEMM kernels: moe_route, swiglu, embed, argmax, mask_logits, moe_combine ---------------
    # Thin wrappers (upload, launch, download) that prove each kernel's path from numpy and back.
    # Outputs are poisoned with 0xFF bytes (NaN, id -1) before each launch, so an element a kernel
    # fails to write shows in the result.

    MOE_ROUTE_MAX_EXPERTS = MOE_ROUTE_MAX_EXPERTS
    EMBED_QTYPES = EMBED_QTYPES

    def _kernel(self, op: str, **fields):
        """Kernel `op` of kernels.KERNELS (the entry its fields name) on this device, looked up once."""
        k = KERNELS[op]
        name = k.name(**fields)
        cache = self.__dict__.setdefault("_kernels", {})
        if name not in cache:
            cache[name] = k.open(self._rt.load_library(k.library), self.device, name)
        return cache[name]

    def _launch(self, op: str, grid, args, shared_bytes: int = 0, stream=None, **fields) -> None:
        """Queue kernel `op` with the table's block on `stream` (this one's by default)."""
        self._kernel(op, **fields).launch(grid, KERNELS[op].block, args, shared_bytes, stream=stream or self.stream)

    def _output(self, nbytes: int):
        buf = self._rt.DeviceBuffer(self.device, nbytes)
        buf.fill_bytes(0xFF, self.stream)
        return buf

    def _download(self, buf, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        buf.copy_to_host(out, self.stream)
        self.stream.synchronize()
        return out

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
        self._launch("moe_route", -(-T // 4), (self._upload(x), ids, weights, T, E, top_k, int(bool(norm_topk))))
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
        self._launch("swiglu", (-(-I // 256), min(T, 65535)), (g_dev, u_ptr, out, T, I, ld, ld, I))
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
        self._launch("embed", T, (self._upload(data), self._upload(ids), out, T, int(n)), qtype=qt.name)
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
        self._launch("argmax", B, (self._upload(x), out, V))
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
        self._launch("mask_logits", ((V + 255) // 256, B, 1), (buf, self._upload(m), V))
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
        self._launch("moe_combine", (-(-D // 256), min(T, 65535)),
                     (self._upload(x), self._upload(y), 0 if r is None else self._upload(r), self._upload(w), out,
                      T, A, D))
        return self._download(out, (T, D), np.float32)


def time_launches(ops: "CudaOps", launch, reps: int) -> float:
    """Median device milliseconds of `launch()` (queued on ops.stream) over reps runs, each between
    two timing events, after one warm run (the benches' timer)."""
    rt, stream = ops._rt, ops.stream
    launch()
    stream.synchronize()
    times = []
    for _ in range(reps):
        start, end = rt.Event(ops.device, timing=True), rt.Event(ops.device, timing=True)
        start.record(stream)
        launch()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_ms(end))
    return float(np.median(times))
