"""DeviceOps' norms and dense projections (see strata.backends.cuda.ops): RMSNorm, `linear` as
dequant-fused GEMVs for a few tokens or a tensor-core / f32 GEMM for more, and the fused composites
of cuda/decode_fused.cu (a residual add with the norm after it, the q/k/v projections in one GEMV)."""
from __future__ import annotations

import numpy as np

from ...errors import InvalidArgument
from ...quant import qtype as qtype_of
from .kernels import DQ_GROUP_QTYPES, MOE_ROUTE_MAX_EXPERTS, MOE_ROUTE_MAX_TOP_K, ONE_ROW_QTYPES
from .memory import (STAGED_BLOCKS_PER_SM, DeviceTensor, Weight, gemv_grid, gemv_whole_grid, router_grid,
                     split_grid)
from .moe import DQ_MIN_ROWS, GroupTable, grouped_gemm, tensor_core_gemm
from .testing import CudaOps

GEMV_MAX_T = 8                       # the GEMV kernels take up to 8 tokens (a step, a verify window)
WEIGHT_SCRATCH_BYTES = 64 << 20      # dequantized weight rows per GEMM chunk
# strata_add_norm_router_f32's normed rows (dynamic shared memory): what a launch gets without opting in (48 KB)
# less the kernel's static 5 KB (ptxas: 5,168 bytes at sm_90), rounded down
NORM_ROUTER_SHARED_BYTES = 40 << 10


class DenseOps:
    """Mixed into DeviceOps, whose alloc, launch, _aligned, _dequant and _f32_weight these use."""

    def rms_norm(self, x: DeviceTensor, name: str, eps: float) -> DeviceTensor:
        n = x.shape[-1]
        rows = x.size // n
        out = self.alloc(x.shape)
        self.launch("rms_norm", max(rows, 1), (x.ptr, self._f32_weight(name), out.ptr, rows, n, float(eps)))
        return out

    def linear(self, x: DeviceTensor, name: str) -> DeviceTensor:
        w = self.w.tensor(name)
        rows, n = w.rows, w.shape[-1]
        if x.shape[-1] != n:
            raise InvalidArgument(f"linear {name}: input {x.shape} does not end in {n}")
        x = self._aligned(x)
        T = x.size // n
        y = self.alloc((*x.shape[:-1], rows))
        if T <= GEMV_MAX_T:
            self._gemv(w, x.ptr, y.ptr, T)
        else:
            self._gemm_weight(w, x.ptr, y.ptr, T, rows)
        return y

    def moe_router(self, x: DeviceTensor, name: str, top_k: int, norm_topk: bool):
        """(router logits [T, E], expert ids [T, top_k], weights [T, top_k]): linear, then moe_route; with
        --kernels-on fused-route, a decode step's F32 router routes in its GEMV's last block instead
        (strata_router_*: the same logits and picks bit for bit, one launch fewer, measured slower)."""
        w = self.w.tensor(name)
        rows, n = w.rows, w.shape[-1]
        T = x.size // n if x.shape[-1] == n else 0
        if not (self.paths.fused_route and self._takes_split(w) and w.qtype == "F32" and 1 <= T <= GEMV_MAX_T
                and rows <= MOE_ROUTE_MAX_EXPERTS and 1 <= top_k <= min(rows, MOE_ROUTE_MAX_TOP_K)):
            logits = self.linear(x, name)
            return (logits, *self.moe_route(logits, top_k, norm_topk))
        x = self._aligned(x)
        logits = self.alloc((*x.shape[:-1], rows))
        ids, weights = self.alloc((T, top_k), np.int32), self.alloc((T, top_k))
        grid = router_grid(rows, n)
        tail = (ids.ptr, weights.ptr, self._route_counter(), top_k, int(bool(norm_topk)))
        if T > 1:
            self.launch("router_rows_split", grid, (w.ptr, x.ptr, logits.ptr, rows, n, T, *tail))
        else:
            self.launch("router_split", grid, (w.ptr, x.ptr, logits.ptr, rows, n, *tail))
        return logits, ids, weights

    def _route_counter(self) -> int:
        """The int strata_router_* count their blocks on (zero between launches: the last block
        resets it; one is enough, since every launch of these ops goes on one stream, in order)."""
        if self._route_count is None:
            self._route_count = self.rt.DeviceBuffer(self.device, 256)
            self._route_count.fill_bytes(0, self.stream)
        return self._route_count.ptr

    def _one_row(self, qtype: str, rows: int, n: int) -> bool:
        """Whether one-token GEMVs of this matrix run one row a warp (the kernel path one-row-gemv): a type
        of ONE_ROW_QTYPES whose row sets of the 4-row kernel leave the capped grid short (q|k|v and
        the attention output of the 30B shape, not its head)."""
        return (self.paths.one_row_gemv and qtype in ONE_ROW_QTYPES
                and gemv_grid(qtype, rows, n) < STAGED_BLOCKS_PER_SM * self.num_sms)

    def _takes_split(self, w: Weight) -> bool:
        """Whether w's decode GEMVs are the split-K kernels: too few row-set blocks to fill the GPU (with
        one row a warp, where even those are too few). Every batch size decides alike, so a batch's
        rows take the kernels of its one-token launch's sum order."""
        one_row = self._one_row(w.qtype, w.rows, w.shape[-1])
        return self.paths.split_gemv and gemv_grid(w.qtype, w.rows, w.shape[-1], one_row) < 2 * self.num_sms

    def _gemv(self, w: Weight, x: int, y: int, T: int) -> None:
        rows, n, q = w.rows, w.shape[-1], w.qtype
        split = self._takes_split(w)
        if T > 1:       # row-invariant: each row is the one-token launch's (speculation and slots rely on it)
            grid = split_grid(q, rows, n) if split else gemv_whole_grid(q, rows, n, T, self.num_sms)
            self.launch("gemv_rows_split" if split else "gemv_rows", grid, (w.ptr, x, y, rows, n, T), qtype=q)
            return
        if split:
            self.launch("gemv_split", split_grid(q, rows, n), (w.ptr, x, y, rows, n), qtype=q)
        elif self._one_row(q, rows, n):     # gemv's bits, one row a warp
            self.launch("gemv_one", gemv_whole_grid(q, rows, n, 1, self.num_sms, one_row=True), (w.ptr, x, y, rows, n),
                        qtype=q)
        else:
            self.launch("gemv", gemv_whole_grid(q, rows, n, 1, self.num_sms), (w.ptr, x, y, rows, n), qtype=q)

    def _gemm_weight(self, w: Weight, x: int, y: int, T: int, ldc: int) -> None:
        """y[:, :rows] (row stride ldc) = x [T, n] @ w^T; the weight dequantized in chunks of rows."""
        rows, n = w.rows, w.shape[-1]
        if w.qtype == "F32":
            self._gemm(x, w.ptr, y, T, rows, n, n, n, ldc)
            return
        if tensor_core_gemm(w.qtype, n, self.paths.tensor_core_prompt) and x % 16 == 0 and w.ptr % 16 == 0:    # one tensor-core launch
            table = GroupTable(self, 1, T)
            # the f16-X GEMMs: x rounded to f16 once, by a pass of its own
            x16 = self.alloc((T, n), np.float16) if self.gemm_x16 else None
            w16 = None
            if self.gemm_dq and T >= DQ_MIN_ROWS and w.qtype in DQ_GROUP_QTYPES:   # f16 rows first (tma-gemm)
                w16 = self.try_alloc((rows, n), np.float16)     # None: no room, the decoding GEMM
                if w16 is not None and x16 is None:
                    x16 = self.try_alloc((T, n), np.float16)
                    w16 = w16 if x16 is not None else None
            if x16 is not None:
                self._copy_rows(x, 0, x16.ptr, T, n, n, n, f16=True)
                x = x16.ptr
            if w16 is not None:
                self._dequant(w.qtype, w.ptr, w16.ptr, rows * n, f16=True)
                w = Weight(w16.ptr, "F16", w.shape)
            grouped_gemm(self, table.t.ptr, table.tiles_ptr, table.fill([w.ptr], [(0, 0, T)]), Weight(0, w.qtype, w.shape),
                         x, n, y, ldc, rows, tma=(w.ptr, rows, T) if w16 is not None else None, x16=x16 is not None)
            return
        row_bytes = qtype_of(w.qtype).row_bytes(n)
        # Chunks of a multiple of 16 rows start 16-byte aligned whatever the row size.
        chunk = min(rows, max(16, WEIGHT_SCRATCH_BYTES // (4 * n) // 16 * 16))
        scratch = self.alloc((chunk, n))
        for r0 in range(0, rows, chunk):
            r = min(chunk, rows - r0)
            self._dequant(w.qtype, w.ptr + r0 * row_bytes, scratch.ptr, r * n)
            self._gemm(x, scratch.ptr, y + r0 * 4, T, r, n, n, n, ldc)

    def _gemm(self, a: int, b: int, c: int, M: int, N: int, K: int, lda: int, ldb: int, ldc: int) -> None:
        grid = (-(-N // 64), -(-M // 64))
        self.launch("gemm_f32", grid, (a, b, c, M, N, K, lda, ldb, ldc))


    def add_rms_norm(self, x: DeviceTensor, y: DeviceTensor, name: str, eps: float):
        """(x + y, rms_norm(x + y) * w) in one launch: a residual add and the norm after it."""
        if x.shape != y.shape:
            raise InvalidArgument(f"add_rms_norm: shapes {x.shape} and {y.shape} differ")
        n = x.shape[-1]
        rows = x.size // n
        x_out, out = self.alloc(x.shape), self.alloc(x.shape)
        self.launch("add_rms_norm", max(rows, 1),
                    (x.ptr, y.ptr, x_out.ptr, self._f32_weight(name), out.ptr, rows, n, float(eps)))
        return x_out, out

    def add_rms_norm_router(self, x: DeviceTensor, y: DeviceTensor, name: str, eps: float, router: str):
        """(x + y, rms_norm(x + y) * w, the router's logits of that or None) -> add_rms_norm and None (the
        router left to routed_moe); with norm-in-router, a decode step's F32 router whose GEMV takes the
        split kernels makes the add and the norm in its own blocks (strata_add_norm_router_f32: the same
        outputs and logits bit for bit, one launch fewer). The same blocks in the same order either way
        (the memory plan's)."""
        if not self._norm_in_router(x, y, name, router):
            return (*self.add_rms_norm(x, y, name, eps), None)
        w = self.w.tensor(router)
        n = x.shape[-1]
        T = x.size // n
        x_out, normed = self.alloc(x.shape), self.alloc(x.shape)
        logits = self.alloc((*x.shape[:-1], w.rows))
        self.launch("add_norm_router", split_grid(w.qtype, w.rows, n),
                    (x.ptr, y.ptr, x_out.ptr, self._f32_weight(name), normed.ptr, w.ptr, logits.ptr, w.rows, n, T,
                     float(eps)), T * n * 4)
        return x_out, normed, logits

    def _norm_in_router(self, x: DeviceTensor, y: DeviceTensor, name: str, router: str) -> bool:
        """Whether add_rms_norm_router runs as one launch (see there; not beside --kernels-on fused-route, whose
        router kernel routes): a decode step's rows, 16-byte aligned,
        whose normed rows fit NORM_ROUTER_SHARED_BYTES of shared memory, and an F32 router of the split kernels."""
        if not self.paths.norm_in_router or self.paths.fused_route or x.shape != y.shape or x.ndim != 2:
            return False
        w = self.w.tensor(router)
        T, n = x.shape
        return (T <= GEMV_MAX_T and n % 8 == 0 and T * n * 4 <= NORM_ROUTER_SHARED_BYTES and w.qtype == "F32"
                and w.shape[-1] == n and x.ptr % 16 == 0 and y.ptr % 16 == 0 and self._takes_split(w)
                and self._f32_weight(name) % 16 == 0)

    def qkv(self, x: DeviceTensor, prefix: str):
        """The attention projections -> (q, k, v): one strata_gemv3 launch over q and those of k, v
        that share its quant type, where the GEMV path applies (llama-quantize's presets often give
        attn_v a type of its own: it is then a `linear` beside the launch), else three `linear`s.
        Same numbers either way."""
        names = [f"{prefix}attn_{p}.weight" for p in "qkv"]
        ws = [self.w.tensor(name) for name in names]
        n = x.shape[-1]
        T = x.size // n
        q = ws[0].qtype
        fused = [i for i, w in enumerate(ws) if w.qtype == q]
        if T > GEMV_MAX_T or len(fused) == 1 or any(w.shape[-1] != n for w in ws):
            return tuple(self.linear(x, name) for name in names)
        x = self._aligned(x)
        ys = [self.alloc((*x.shape[:-1], ws[i].rows)) for i in fused]
        # a third matrix of no rows has no row sets: the kernel skips it
        mats = [(ws[i].ptr, y.ptr, ws[i].rows) for i, y in zip(fused, ys)]
        mats += [(ws[0].ptr, ys[0].ptr, 0)] * (3 - len(fused))
        per_set = CudaOps.gemv_rows_per_block(CudaOps, q, n) // 4     # rows per warp, as one token's
        sets = sum(-(-rows // per_set) for _, _, rows in mats)
        args = (*(m[0] for m in mats), x.ptr, *(m[1] for m in mats), *(m[2] for m in mats), n, T)
        if T == 1 and self._one_row(q, sets * per_set, n):
            # one row a warp (batch 1's bits), x staged once a block for its rounds: gemv_one's grid over
            # the three matrices' rows
            grid = gemv_whole_grid(q, sum(rows for _, _, rows in mats), n, 1, self.num_sms, one_row=True)
            self.launch("gemv3_one", grid, args, qtype=q)
        else:   # more tokens: the row-invariant kernel, each token's rows those of a one-token launch
            self.launch("gemv3_rows" if T > 1 else "gemv3", max(1, -(-sets // 4)), args, qtype=q)
        out = dict(zip(fused, ys))
        return tuple(out[i] if i in out else self.linear(x, names[i]) for i in range(3))
