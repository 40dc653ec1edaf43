"""The model-ops interface of strata.model over device tensors: the GPU engine's CpuOps.

Same method names and meaning as strata.backends.cpu.CpuOps; inputs and outputs are DeviceTensors
(f32 activations, int32 expert ids), weights stay in their native block bytes in VRAM. Every launch
goes on one stream; nothing waits for the device except where the host needs a value: downloads,
a streamed prompt chunk that stages only the experts it routes to (its routing comes to the host),
and staged decode misses (each layer's routing read on the host).

Token ids come as a numpy array (uploaded here) or already on the device, an int32 DeviceTensor
[T]; positions always on the device, an int32 DeviceTensor [T + 1] (the positions, then the KV
length; upload_positions makes one), uploaded once per forward by the caller. A decode step passes
device tensors, and its launches then depend on no host value but T and the cache's size: the same
launches serve every step, so they can be one CUDA graph. How the MoE layers reach their experts
(resident, cache slots, the prompt ring's batches, staged misses, the routing log) comes with each
forward as a MoePlan (strata.backends.cuda.moe_plan); the ops hold no expert store.

Paths: `linear` with T <= GEMV_MAX_T tokens runs the dequant-fused GEMV kernels (one-token GEMVs of
too few blocks to fill the GPU split K). Larger T runs one tensor-core GEMM launch over the native
blocks (cuda/moe_gemm.cu, a group of one) where that kernel takes the type; F32 weights run the f32
GEMM as they are; any other type is dequantized (bit-exact, in row chunks of at most
WEIGHT_SCRATCH_BYTES) into an f32 GEMM. `moe` with T <= GEMV_MAX_T runs cuda/moe_decode.cu (gate|up
with SwiGLU, then down with the weighted sum: two launches, each slot reading its expert's address
from the table at its device-side id; the moe_gemv path where those kernels do not apply). Prompt
chunks take strata.backends.cuda.moe.moe_grouped: the slots are grouped by expert on the device
(cuda/moe_group.cu) when the layer's matrices take the tensor-core GEMM and the chunk's plan hands
out every expert without the routing (all resident, or a chunk that streams every non-cached expert),
else on the host; the rows are gathered into expert order and each of the plan's batches is one tensor-core
grouped GEMM launch per matrix, SwiGLU over its rows, then one weighted combine back into token
order (per-expert f32 GEMMs over dequantized matrices only for types cuda/moe_gemm.cu does not take).

The model's composites run cuda/decode_fused.cu: `add_rms_norm` (a residual add and the norm after
it), `qkv` (the three projections in one GEMV launch where they share a quant type and T <= 8) and
`qk_norm_rope_attention` (QK-norm, RoPE and the K/V append in one launch, then attention).

A quantized KV cache (DeviceKV of int8, q4_0 or k8v4) takes cuda/kv_quant.cu instead: the norm and
RoPE unfused, the format's append kernels, its split-K decode attention for one query, and for a
prompt chunk the layer's cells dequantized into an f16 scratch that the f16 prompt attention reads.

DeviceOps keeps the plumbing (launch, memory, uploads), the embedding and the MoE dispatch; the
norms, projections and decode_fused composites are ops_dense.DenseOps', RoPE and attention
ops_attention.AttentionOps'. Every launch names an op of kernels.KERNELS.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ...errors import DeviceError, InvalidArgument, UnsupportedError
from ...quant import qtype as qtype_of
from .. import rope
from .kernels import (DQ_GROUP_QTYPES, EMBED_QTYPES, KERNELS, MOE_ROUTE_MAX_EXPERTS, MOE_ROUTE_MAX_TOP_K,
                      PDL_LIBRARIES, WGMMA_LIBRARIES, KernelPaths, cluster_unavailable, dequant_grid,
                      tma_attention_runs, tma_gemm_runs, wgmma_unavailable)
from .memory import DeviceTensor, HandOff, Pool, Positions
from .moe import fused_decode_takes, moe_decode, moe_decode_split, moe_grouped
from .ops_attention import QK_NORM_ROPE_MAX_PAIRS, AttentionOps  # noqa: F401 (importable from here)
from .ops_dense import GEMV_MAX_T, WEIGHT_SCRATCH_BYTES, DenseOps  # noqa: F401 (importable from here)
from .moe_plan import RESIDENT, MoePlan


class DeviceOps(DenseOps, AttentionOps):
    """Ops of one model on one GPU (see the module doc). Counters: expert_uses, bytes_h2d."""

    name = "cuda"

    def __init__(self, rt, device, stream, weights, args, paths: KernelPaths = KernelPaths()):
        self.rt, self.device, self.stream, self.w, self.args = rt, device, stream, weights, args
        self.pool = Pool(rt, device)
        self.num_sms = device.multiprocessor_count
        self.paths = paths
        self.pdl = paths.pdl and tuple(getattr(device, "compute_capability", (0, 0))) >= (9, 0)
        for path, libraries in WGMMA_LIBRARIES.items():   # trial paths: refused in one line where they cannot run
            for library in libraries if getattr(paths, path.replace("-", "_")) else ():
                why = wgmma_unavailable(rt.read_manifest(), getattr(device, "compute_capability", None), library)
                if why:
                    raise UnsupportedError(f"kernel path {path} (--kernels-on): {why}")
        if paths.cluster_decode:
            why = cluster_unavailable(rt.read_manifest(), getattr(device, "compute_capability", None))
            if why:
                raise UnsupportedError(f"kernel path cluster-decode (--kernels-on): {why}")
        # on by default where it can run (an sm_90 GPU, a build with attention_ws.cu's sm_90a library)
        self.tma_attention = tma_attention_runs(paths, rt.read_manifest(), getattr(device, "compute_capability", None))
        # the prompt GEMMs' kernel op; with moe_gemm_ws16 they read X as f16 (gemm_x16: its producers write f16)
        self.gemm_op = ("moe_gemm_ws16" if paths.wgmma_gemm_f16x
                        else "moe_gemm_ws" if paths.wgmma_gemm else "moe_gemm")
        self.gemm_x16 = self.gemm_op == "moe_gemm_ws16"
        # tma-gemm: weights dequantized to f16 rows first where rows are many (moe.DQ_MIN_ROWS), then multiplied
        # with both operands moved by the TMA (moe.grouped_gemm's tma: strata_moe_gemm_wst_f16), X then f16
        self.gemm_dq = tma_gemm_runs(paths, rt.read_manifest(), getattr(device, "compute_capability", None))
        self._kernels: dict = {}             # entry name -> runtime kernel
        self._libraries: dict = {}           # library -> a variant's loaded fatbin (swap_library), else the package's
        self._launches: dict = {}            # (op, field values) -> (kernel, block, pdl)
        self._f32_weights: dict = {}
        self._zeros = None
        self._route_count = None             # strata_router_*'s block counter (ops_dense.moe_router)
        self.expert_uses = 0
        self.bytes_h2d = 0
        self.bytes_staged_kv = 0        # host KV cells copied into VRAM for prompt attention (--kv-resident)
        inv, self.rope_scale = rope.inv_freq(args.head_dim, args.rope_theta, args.rope_scaling,
                                             args.max_position_embeddings)
        self.inv_freq = self.upload(inv.astype(np.float32))

    # ---- plumbing ----------------------------------------------------------------------------
    def launch(self, op: str, grid, args, shared_bytes: int = 0, **fields) -> None:
        """Queue kernel `op` of kernels.KERNELS (the entry its fields name: qtype=, dh=, ...) on the
        stream; library, signature and block come from the table."""
        kernel, block, pdl = self.preload(op, **fields)
        kernel.launch(grid, block, args, shared_bytes, stream=self.stream, pdl=pdl)

    def preload(self, op: str, **fields) -> tuple:
        """Kernel `op`'s entry looked up (its library loaded, its code put in the context), so that its
        first launch costs what the later ones do -> (kernel, block, pdl)."""
        key = (op, *fields.items())
        hit = self._launches.get(key)
        if hit is None:
            k = KERNELS[op]
            name = k.name(**fields)
            kernel = self._kernels.get(name)
            if kernel is None:
                library = self._libraries.get(k.library) or self.rt.load_library(k.library)
                kernel = self._kernels[name] = k.open(library, self.device, name)
            hit = self._launches[key] = (kernel, k.block, self.pdl and k.library in PDL_LIBRARIES)
        return hit

    def swap_library(self, library: str, image: bytes | None = None) -> None:
        """Launch library `library`'s kernels from the fatbin `image` from now on (None: the package's again), for
        an A/B of a variant build on one load (tools/decode_variants.py --fatbin-arms). The image must hold every
        entry of the table's library with the same signatures. Graphs captured before keep the kernels they were
        captured with: the caller drops them."""
        self._libraries.pop(library, None)
        if image is not None:
            self._libraries[library] = self.rt.Library(library, image)
        ops = {op for op, k in KERNELS.items() if k.library == library}
        names = {n for op in ops for n in KERNELS[op].names()}
        self._kernels = {n: k for n, k in self._kernels.items() if n not in names}
        self._launches = {key: v for key, v in self._launches.items() if key[0] not in ops}

    def preload_tma_gemm(self, layers) -> None:
        """tma-gemm's kernels for these expert layers' and the dense weights' types, looked up at load: the
        first prompt long enough to take the path (a dense projection's DQ_MIN_ROWS tokens) would
        otherwise pay their libraries' loads (an H100: a 512-token prompt 27% slower the first time)."""
        if not self.gemm_dq:
            return
        experts = {p.qtype for lay in layers for p in lay.parts.values()}
        dense = {t["qtype"] for t in self.w.pack.meta["dense"].values()} if hasattr(self.w, "pack") else set()
        for op, types in (("dequant_h_groups", experts), ("dequant_h", dense)):
            for q in sorted(types & set(DQ_GROUP_QTYPES)):
                self.preload(op, qtype=q)
        for op in ("moe_gemm_wst", "gather_rows_f16", "swiglu_rows_f16"):
            self.preload(op)

    def alloc(self, shape, dtype=np.float32) -> DeviceTensor:
        shape = tuple(int(s) for s in shape)
        block, buf = self.pool.alloc(max(1, math.prod(shape)) * np.dtype(dtype).itemsize)
        return DeviceTensor(buf, block.offset, shape, dtype, block)

    def try_alloc(self, shape, dtype=np.float32) -> DeviceTensor | None:
        """alloc, or None where the device (or a frozen pool) has no room: for scratch a path can do
        without (wgmma-gemm-dq's f16 weights)."""
        try:
            return self.alloc(shape, dtype)
        except DeviceError:
            return None

    def upload(self, array: np.ndarray) -> DeviceTensor:
        array = np.ascontiguousarray(array)
        t = self.alloc(array.shape, array.dtype)
        t.buf.copy_from_host(array, self.stream, t.offset)
        self.bytes_h2d += array.nbytes
        return t

    def to_host(self, t: DeviceTensor) -> np.ndarray:
        """Wait for the stream and copy t into a new numpy array."""
        out = np.empty(t.shape, t.dtype)
        t.buf.copy_to_host(out, self.stream, t.offset)
        self.stream.synchronize()
        return out

    def copy(self, x: DeviceTensor) -> DeviceTensor:
        out = self.alloc(x.shape, x.dtype)
        self._copy_rows(x.ptr, 0, out.ptr, 1, x.nbytes // 4, 0, 0)
        return out

    def _copy_rows(self, src: int, rows: int, dst: int, R: int, n: int, src_ld: int, dst_ld: int,
                   f16: bool = False) -> None:
        """dst row i = src row rows[i] (rows a device int32 pointer, or 0 for i), n f32 elements each;
        f16: dst rounded to f16 (dst_ld in halves)."""
        grid = (max(1, min(-(-n // 1024), 8 * self.num_sms)), min(R, 65535))
        self.launch("gather_rows_f16" if f16 else "gather_rows", grid, (src, rows, dst, R, n, src_ld, dst_ld))

    def _aligned(self, x: DeviceTensor) -> DeviceTensor:
        """x itself, or a copy when a row slice left it off the 16-byte alignment the kernels read with."""
        return x if x.ptr % 16 == 0 else self.copy(x)

    # ---- a layer split's hand-off (strata.engine.cuda_split) -------------------------------------
    hand_buf = None         # a later card's rows of a decode step: x [STEP rows, D] then normed, f32

    def hand_in(self, src):
        """A later card's input rows (x [T, D], normed [T, D]) in place of the embedding; src is what
        the runner passed model.forward as its ids. A HandOff (a prompt chunk): the card before's
        rows, copied into this pool (what the embedding and its norm allocate). Token ids [T] (a
        decode step, whose rows the split runner put in hand_buf before the step): views of
        hand_buf, so a captured graph reads them at one address."""
        D = self.args.hidden_size
        if isinstance(src, HandOff):
            T = src.x.shape[0]
            if src.normed.shape != (T, D) or src.x.shape != (T, D):
                raise InvalidArgument(f"hand_in: rows of {D} asked, {src.x.shape} and {src.normed.shape} handed")
            x, normed = self.alloc((T, D)), self.alloc((T, D))
            src.copy(x.ptr, src.x.ptr, x.nbytes)
            src.copy(normed.ptr, src.normed.ptr, normed.nbytes)
            return x, normed
        T = src.shape[0]
        if self.hand_buf is None or 2 * T * D * 4 > self.hand_buf.nbytes:
            raise InvalidArgument(f"hand_in: no hand-off of {T} rows here (a layer split's later card only)")
        half = self.hand_buf.nbytes // 2
        return (DeviceTensor(self.hand_buf, 0, (T, D), np.float32, self.hand_buf),
                DeviceTensor(self.hand_buf, half, (T, D), np.float32, self.hand_buf))

    def upload_positions(self, positions: np.ndarray) -> DeviceTensor:
        """Positions [T] -> [T + 1] int32 on the device: the positions, then max + 1 (the decode
        length), the form every op takes. The caller uploads once per forward and passes it down."""
        p = np.asarray(positions, dtype=np.int64).reshape(-1)
        return Positions(self.upload(np.append(p, p.max() + 1).astype(np.int32)), int(p.max()) + 1)

    def take_rows(self, x: DeviceTensor, rows) -> DeviceTensor:
        """Rows `rows` (host ints) of x [T, n] -> [len(rows), n], a copy."""
        n = x.size // x.shape[0]
        out = self.alloc((len(rows), *x.shape[1:]), x.dtype)
        for i, r in enumerate(rows):
            if not 0 <= r < x.shape[0]:
                raise InvalidArgument(f"take_rows: row {r} of {x.shape[0]}")
            self._copy_rows(x.ptr + r * n * 4, 0, out.ptr + i * n * 4, 1, n, 0, 0)
        return out

    @staticmethod
    def _positions(positions) -> DeviceTensor:
        if not isinstance(positions, DeviceTensor):
            raise InvalidArgument("DeviceOps: positions must be on the device, [T + 1] int32 "
                                  "(upload_positions), once per forward")
        return positions

    def _zeros_ptr(self, nbytes: int) -> int:
        """A device range of at least nbytes of zeros (moe_combine's residual when there is none)."""
        if self._zeros is None or self._zeros.nbytes < nbytes:
            self.stream.synchronize()       # the old buffer may still be read by queued kernels
            self._zeros = self.rt.DeviceBuffer(self.device, max(nbytes, 1 << 20))
            self._zeros.fill_bytes(0, self.stream)
        return self._zeros.ptr

    def _f32_weight(self, name: str) -> int:
        """Address of a small weight (a norm) as f32: the tensor itself, or a dequantized copy kept for good."""
        w = self.w.tensor(name)
        if w.qtype == "F32":
            return w.ptr
        if name not in self._f32_weights:
            buf = self.rt.DeviceBuffer(self.device, math.prod(w.shape) * 4)
            self._dequant(w.qtype, w.ptr, buf.ptr, math.prod(w.shape))
            self._f32_weights[name] = buf
        return self._f32_weights[name].ptr

    def _dequant(self, qtype: str, src: int, dst: int, num_weights: int, f16: bool = False) -> None:
        """num_weights weights at src dequantized to dst as f32 (f16: rounded to f16, strata_dequant_h_*)."""
        qt = qtype_of(qtype)
        grid = dequant_grid(qt.block_size, num_weights, self.num_sms)
        self.launch("dequant_h" if f16 else "dequant", grid, (src, dst, num_weights // qt.block_size), qtype=qt.name)

    # ---- weights -----------------------------------------------------------------------------
    def has_weight(self, name: str) -> bool:
        return self.w.has(name)

    # ---- elementwise and shape -----------------------------------------------------------------
    @staticmethod
    def reshape(x: DeviceTensor, shape) -> DeviceTensor:
        return x.reshape(shape)

    def add(self, x: DeviceTensor, y: DeviceTensor) -> DeviceTensor:
        if x.shape != y.shape:
            raise InvalidArgument(f"add: shapes {x.shape} and {y.shape} differ")
        out = self.alloc(x.shape)
        grid = max(1, min(-(-x.size // 1024), 8 * self.num_sms))
        self.launch("add", grid, (x.ptr, y.ptr, out.ptr, x.size))
        return out

    def concat(self, xs: list, axis: int = -1) -> DeviceTensor:
        """Along the last axis: one strided row copy per input."""
        lead = xs[0].shape[:-1]
        if axis not in (-1, len(xs[0].shape) - 1) or any(x.shape[:-1] != lead for x in xs):
            raise InvalidArgument(f"concat: needs the last axis and equal leading shapes, got {[x.shape for x in xs]}")
        total = sum(x.shape[-1] for x in xs)
        out = self.alloc((*lead, total))
        R, col = math.prod(lead), 0
        for x in xs:
            n = x.shape[-1]
            self._copy_rows(x.ptr, 0, out.ptr + col * 4, R, n, n, total)
            col += n
        return out

    # ---- ops ---------------------------------------------------------------------------------
    def embed(self, name: str, ids) -> DeviceTensor:
        """Rows ids of the table; ids numpy (uploaded), or an int32 DeviceTensor [T] (read on the device)."""
        w = self.w.tensor(name)
        if w.qtype not in EMBED_QTYPES:
            raise UnsupportedError(f"embed: {name} is {w.qtype}, which cuda/embed.cu has no kernel for")
        if not isinstance(ids, DeviceTensor):
            ids = self.upload(np.asarray(ids, dtype=np.int32).reshape(-1))
        T, n = ids.shape[0], w.shape[-1]
        out = self.alloc((T, n))
        self.launch("embed", T, (w.ptr, ids.ptr, out.ptr, T, n), qtype=w.qtype)
        return out

    def moe_route(self, router_logits: DeviceTensor, top_k: int, norm_topk: bool):
        T, E = router_logits.shape
        if E > MOE_ROUTE_MAX_EXPERTS or not 1 <= top_k <= min(E, MOE_ROUTE_MAX_TOP_K):
            raise UnsupportedError(f"moe_route: {E} experts top-{top_k}; the kernel takes E <= "
                                   f"{MOE_ROUTE_MAX_EXPERTS} and top_k <= {MOE_ROUTE_MAX_TOP_K}")
        ids, weights = self.alloc((T, top_k), np.int32), self.alloc((T, top_k))
        self.launch("moe_route", max(1, -(-T // 4)),
                    (router_logits.ptr, ids.ptr, weights.ptr, T, E, top_k, int(bool(norm_topk))))
        return ids, weights

    def routed_moe(self, x: DeviceTensor, layer: int, router: str, top_k: int, norm_topk: bool,
                   plan: MoePlan | None = None, logits: DeviceTensor | None = None):
        """The router's logits, their top-k and the routed experts of `layer` -> (logits [T, E], ids [T, A],
        weights [T, A], out [T, D]): moe_router, then moe (logits: the router's, made already, as
        add_rms_norm_router makes them). With route-in-moe, a decode step whose experts the fused kernels
        read through the table (no staging, no host share) routes in the gate|up kernel's blocks instead
        of a launch of its own (moe.moe_decode's `route`): the same bits."""
        plan = plan or RESIDENT
        if not self._routes_in_moe(x, layer, router, top_k, plan):
            if logits is None:
                logits, ids, weights = self.moe_router(x, router, top_k, norm_topk)
            else:
                ids, weights = self.moe_route(logits, top_k, norm_topk)
            return logits, ids, weights, self.moe(x, layer, ids, weights, plan)
        logits = self.linear(x, router) if logits is None else logits
        ids, weights = self.alloc((x.shape[0], top_k), np.int32), self.alloc((x.shape[0], top_k))
        self.expert_uses += ids.size
        out = moe_decode(self, x, self.w.layers[layer], ids, weights, route=(logits, norm_topk))
        self._log_route(plan, layer, ids)
        return logits, ids, weights, out

    def _routes_in_moe(self, x: DeviceTensor, layer: int, router: str, top_k: int, plan: MoePlan) -> bool:
        """Whether routed_moe routes in the gate|up kernel (the route-in-moe path; see routed_moe). Not beside
        --kernels-on fused-route, whose router routes in its last block."""
        if not (self.paths.route_in_moe and not self.paths.fused_route and x.ndim == 2 and x.shape[0] <= GEMV_MAX_T
                and plan.stage is None and plan.host is None):
            return False
        E = self.w.tensor(router).rows
        return (1 <= top_k <= min(E, MOE_ROUTE_MAX_TOP_K) and E <= MOE_ROUTE_MAX_EXPERTS
                and fused_decode_takes(self, self.w.layers[layer], x.shape[0], top_k))

    def _log_route(self, plan: MoePlan, layer: int, ids: DeviceTensor) -> None:
        """A decode step's routing of `layer` into the plan's route log (it goes back to the host with the
        logits), where the plan keeps one."""
        if plan.route_log:
            row = plan.route_log + layer * GEMV_MAX_T * ids.shape[1] * 4
            self.rt.copy_d2d(row, ids.ptr, ids.nbytes, self.stream)

    def moe(self, x: DeviceTensor, layer: int, expert_ids: DeviceTensor, expert_weights: DeviceTensor,
            plan: MoePlan | None = None) -> DeviceTensor:
        """Routed experts of `layer`, reached as the forward's plan says (strata.backends.cuda.moe_plan;
        None: every expert resident, no routing log)."""
        plan = plan or RESIDENT
        self.expert_uses += expert_ids.size
        if x.shape[0] <= GEMV_MAX_T:
            self._log_route(plan, layer, expert_ids)
            lay = self.w.layers[layer]
            if plan.stage is not None:       # routing to the host: staged, or unpinned
                lay = dataclasses.replace(lay, table=plan.stage(layer, self.to_host(expert_ids)))
            elif plan.host is not None:      # a split decode step: the host's share of the misses
                return moe_decode_split(self, x, lay, expert_ids, expert_weights, plan.host)
            return moe_decode(self, x, lay, expert_ids, expert_weights)
        return moe_grouped(self, x, self.w.layers[layer], expert_ids, expert_weights, plan)
