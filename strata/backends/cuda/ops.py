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
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ...errors import InvalidArgument, UnsupportedError
from ...quant import qtype as qtype_of
from .. import rope
from .kernels import (ATTENTION_HEAD_DIMS, EMBED_QTYPES, MOE_ROUTE_MAX_EXPERTS, MOE_ROUTE_MAX_TOP_K,
                      TC_ATTENTION_HEAD_DIMS, KernelPaths, decode_splits)
from .testing import CudaOps
from .memory import DeviceTensor, Pool, Weight, gemv_grid
from .attention_tc import LIBRARY as TC_LIBRARY
from .attention_tc import SIGNATURE as TC_SIGNATURE
from .attention_tc import kernel_name as tc_kernel_name
from .attention_tc import prefill_tc_launch_shape
from .moe import GroupTable, grouped_gemm, moe_decode, moe_grouped, tensor_core_gemm
from .moe_plan import RESIDENT, MoePlan

GEMV_MAX_T = 8                       # strata_gemv_batch_* takes up to 8 tokens
WEIGHT_SCRATCH_BYTES = 64 << 20      # dequantized weight rows per GEMM chunk
QK_NORM_ROPE_MAX_PAIRS = 512                               # cuda/norm_rope.cuh kMaxPairs
# Libraries whose every kernel begins with STRATA_PDL_ENTRY() (cuda/pdl.cuh; tests/kernels/test_build.py
# checks): the decode path's. A kernel launched so may start while the one before it runs.
PDL_LIBRARIES = frozenset({"decode_fused", "attention", "embed", "gemv", "moe_decode", "moe_route", "rms_norm",
                           "argmax", "sample"})

class DeviceOps:
    """Ops of one model on one GPU (see the module doc). Counters: expert_uses, bytes_h2d."""

    name = "cuda"

    def __init__(self, rt, device, stream, weights, args, paths: KernelPaths = KernelPaths()):
        self.rt, self.device, self.stream, self.w, self.args = rt, device, stream, weights, args
        self.pool = Pool(rt, device)
        self.num_sms = device.multiprocessor_count
        self.paths = paths
        self.pdl = paths.pdl and tuple(getattr(device, "compute_capability", (0, 0))) >= (9, 0)
        self._kernels: dict = {}
        self._f32_weights: dict = {}
        self._zeros = None
        self.expert_uses = 0
        self.bytes_h2d = 0
        inv, self.rope_scale = rope.inv_freq(args.head_dim, args.rope_theta, args.rope_scaling,
                                             args.max_position_embeddings)
        self.inv_freq = self.upload(inv.astype(np.float32))

    # ---- plumbing ----------------------------------------------------------------------------
    def launch(self, library: str, name: str, signature: str, grid, block, args, shared_bytes: int = 0) -> None:
        kernel = self._kernels.get(name)
        if kernel is None:
            kernel = self._kernels[name] = self.rt.load_library(library).kernel(self.device, name, signature)
        kernel.launch(grid, block, args, shared_bytes, stream=self.stream, pdl=self.pdl and library in PDL_LIBRARIES)

    def alloc(self, shape, dtype=np.float32) -> DeviceTensor:
        shape = tuple(int(s) for s in shape)
        block, buf = self.pool.alloc(max(1, math.prod(shape)) * np.dtype(dtype).itemsize)
        return DeviceTensor(buf, block.offset, shape, dtype, block)

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

    def _copy_rows(self, src: int, rows: int, dst: int, R: int, n: int, src_ld: int, dst_ld: int) -> None:
        """dst row i = src row rows[i] (rows a device int32 pointer, or 0 for i), n 4-byte elements each."""
        grid = (max(1, min(-(-n // 1024), 8 * self.num_sms)), min(R, 65535))
        self.launch("gather_rows", "strata_gather_rows_f32", "PPPiqqq", grid, 256, (src, rows, dst, R, n, src_ld, dst_ld))

    def _aligned(self, x: DeviceTensor) -> DeviceTensor:
        """x itself, or a copy when a row slice left it off the 16-byte alignment the kernels read with."""
        return x if x.ptr % 16 == 0 else self.copy(x)

    def upload_positions(self, positions: np.ndarray) -> DeviceTensor:
        """Positions [T] -> [T + 1] int32 on the device: the positions, then max + 1 (the decode
        length), the form every op takes. The caller uploads once per forward and passes it down."""
        p = np.asarray(positions, dtype=np.int64).reshape(-1)
        return self.upload(np.append(p, p.max() + 1).astype(np.int32))

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

    def _dequant(self, qtype: str, src: int, dst: int, num_weights: int) -> None:
        qt = qtype_of(qtype)
        n_blocks = num_weights // qt.block_size
        threads = num_weights if qt.block_size == 1 else num_weights // 8
        grid = max(1, min(-(-threads // 256), 32 * self.num_sms))
        self.launch("dequant", f"strata_dequant_{qt.name.lower()}", "PPq", grid, 256, (src, dst, n_blocks))

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
        self.launch("add", "strata_add_f32", "PPPq", grid, 256, (x.ptr, y.ptr, out.ptr, x.size))
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
        self.launch("embed", f"strata_embed_{w.qtype.lower()}", "PPPii", T, 256, (w.ptr, ids.ptr, out.ptr, T, n))
        return out

    def rms_norm(self, x: DeviceTensor, name: str, eps: float) -> DeviceTensor:
        n = x.shape[-1]
        rows = x.size // n
        out = self.alloc(x.shape)
        self.launch("rms_norm", "strata_rms_norm_f32", "PPPiif", max(rows, 1), 256,
                    (x.ptr, self._f32_weight(name), out.ptr, rows, n, float(eps)))
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

    def _gemv(self, w: Weight, x: int, y: int, T: int) -> None:
        rows, n, q = w.rows, w.shape[-1], w.qtype.lower()
        if T > 1 and n % 8 == 0:
            grid = max(1, -(-rows // 16))          # 4 rows per warp, 4 warps per block
            self.launch("gemv", f"strata_gemv_batch_{q}", "PPPiii", grid, 128, (w.ptr, x, y, rows, n, T))
            return
        grid = gemv_grid(w.qtype, rows, n)
        split = self.paths.split_gemv and grid < 2 * self.num_sms       # too few blocks to fill the GPU: split K
        name = f"strata_gemv_split_{q}" if split else f"strata_gemv_{q}"
        for t in range(T):
            self.launch("gemv", name, "PPPii", grid * 4 if split else grid, 128,
                        (w.ptr, x + t * n * 4, y + t * rows * 4, rows, n))

    def _gemm_weight(self, w: Weight, x: int, y: int, T: int, ldc: int) -> None:
        """y[:, :rows] (row stride ldc) = x [T, n] @ w^T; the weight dequantized in chunks of rows."""
        rows, n = w.rows, w.shape[-1]
        if w.qtype == "F32":
            self._gemm(x, w.ptr, y, T, rows, n, n, n, ldc)
            return
        if tensor_core_gemm(w.qtype, n, self.paths.tensor_core_prompt) and x % 16 == 0 and w.ptr % 16 == 0:    # one tensor-core launch
            table = GroupTable(self, 1, T)
            grouped_gemm(self, table.t.ptr, table.tiles_ptr, table.fill([w.ptr], [(0, 0, T)]), Weight(0, w.qtype, w.shape),
                         x, n, y, ldc, rows)
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
        self.launch("gemm_f32", "strata_gemm_f32_nt", "PPPiiiqqq", grid, 256, (a, b, c, M, N, K, lda, ldb, ldc))

    def rope(self, x: DeviceTensor, positions) -> DeviceTensor:
        T, heads, dh = x.shape
        out = self.copy(x)
        self.launch("rope", "strata_rope_f32", "PPPiiif", max(T, 1), 128,
                    (out.ptr, self._positions(positions).ptr, self.inv_freq.ptr, T, heads, dh, float(self.rope_scale)))
        return out

    def attention(self, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, layer: int, kv, positions) -> DeviceTensor:
        """K/V appended at their positions into kv's layer, then causal attention -> [T, H * Dh]."""
        if getattr(kv, "quantized", False):
            return self._attention_quantized(q, k, v, layer, kv, positions)
        T, _, dh = q.shape
        Hk = k.shape[1]
        pos = self._positions(positions)
        kc, vc = kv.layer(layer)
        self.launch("attention", "strata_kv_append_f16", "PPPPPii", T, 128, (k.ptr, v.ptr, pos.ptr, kc, vc, T, Hk * dh))
        return self._attend(q, Hk, kc, vc, pos, kv.max_cells)

    def _attend(self, q: DeviceTensor, Hk: int, kc: int, vc: int, pos: DeviceTensor, max_cells: int) -> DeviceTensor:
        """Causal attention of q [T, H, Dh] over the cached cells 0..max(positions) -> [T, H * Dh]."""
        T, H, dh = q.shape
        out = self.alloc((T, H * dh))
        G, scale = H // Hk, 1.0 / math.sqrt(dh)
        if dh not in ATTENTION_HEAD_DIMS or G > (8 if dh == 256 else 16):
            self.launch("attention_rows", "strata_attention_rows_f16", "PPPPPiiiif", (H, T), 128,
                        (q.ptr, kc, vc, pos.ptr, out.ptr, T, H, Hk, dh, scale))
        elif T == 1:
            self._attention_decode(q, Hk, kc, vc, pos, out, max_cells, scale)
        elif dh in TC_ATTENTION_HEAD_DIMS:     # tensor-core flash attention (cuda/attention_tc.cu)
            grid, block = prefill_tc_launch_shape(T, H, Hk, dh)
            self.launch(TC_LIBRARY, tc_kernel_name(dh), TC_SIGNATURE, grid, block,
                        (q.ptr, kc, vc, pos.ptr, out.ptr, T, H, Hk, scale))
        else:
            rows = 16 if dh == 256 else 32
            self.launch("attention", f"strata_attention_prefill_f16_d{dh}", "PPPPPiiif", (-(-T * G // rows), Hk), 128,
                        (q.ptr, kc, vc, pos.ptr, out.ptr, T, H, Hk, scale))
        return out

    def _attention_quantized(self, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, layer: int, kv,
                             positions) -> DeviceTensor:
        """attention() over a quantized DeviceKV (cuda/kv_quant.cu): K and V quantized into their cells
        at their positions; q rotated where K is stored rotated; one query (a decode step) runs the
        split-K kernel of the format over the planes, more (a prompt chunk) dequantize the layer's
        cells into an f16 scratch the f16 prompt attention reads; the output un-rotated where V is
        stored rotated. Every host value here is a shape, or a prompt's positions (already on the host)."""
        T, H, dh = q.shape
        Hk = k.shape[1]
        pos = self._positions(positions)
        (kc, vc), planes = kv.codecs, kv.planes(layer)
        rot = float(np.float32(1.0 / np.sqrt(dh)))             # strata.backends.cuda.kv.rot_scale
        for x, codec, (values, scales) in ((k, kc, planes[:2]), (v, vc, planes[2:])):
            extra = (rot,) if codec.rotated else ()
            self.launch("kv_quant", f"strata_kv_append_{codec.name}", "PPPPiii" + "f" * len(extra), (T, Hk), 32,
                        (x.ptr, pos.ptr, values, scales, T, Hk, dh, *extra))
        if kc.rotated:
            q = self.copy(q)
            self._hadamard(q.ptr, T * H, dh, rot)
        G, scale = H // Hk, 1.0 / math.sqrt(dh)
        if T == 1 and G <= (8 if dh == 256 else 16):
            out = self.alloc((T, H * dh))
            splits = self.decode_splits(Hk, kv.max_cells, dh)
            part_acc, part_ml = self.alloc((H, splits, dh)), self.alloc((H, splits, 2))
            gp = 1 << (G - 1).bit_length()
            lengths = pos.ptr + 4 * T               # max(positions) + 1, after the positions
            self.launch("kv_quant", f"strata_attention_decode_{kv.fmt}_d{dh}_g{gp}", "PPPPPPPPiiiif", (splits, Hk, 1),
                        128, (q.ptr, *planes, lengths, part_acc.ptr, part_ml.ptr, H, Hk, kv.max_cells, splits, scale))
            self.launch("attention", "strata_attention_decode_combine_f32", "PPPiii", (H, 1), 128,
                        (part_acc.ptr, part_ml.ptr, out.ptr, H, dh, splits))
        else:
            # every cell of the layer, whatever the positions: the scratch's size is the cache's, so
            # a prompt's memory does not grow along it (the planner's dry run prices one chunk for
            # all) and a step reading its positions on the device takes it too; the attention reads
            # cells 0..max(positions) of it, and cells never written decode to zeros (zeroed planes)
            rows = kv.max_cells
            scratch = []
            for codec, (values, scales) in ((kc, planes[:2]), (vc, planes[2:])):
                f16 = self.alloc((rows, Hk, dh), np.float16)
                self.launch("kv_quant", f"strata_kv_dequant_{codec.name}_f16", "PPPiii", (rows, Hk), 32,
                            (values, scales, f16.ptr, rows, Hk, dh))
                scratch.append(f16)
            out = self._attend(q, Hk, scratch[0].ptr, scratch[1].ptr, pos, rows)
        if vc.rotated:
            self._hadamard(out.ptr, T * H, dh, rot)
        return out

    def _hadamard(self, ptr: int, rows: int, head_dim: int, rot: float) -> None:
        """H x in place over rows head vectors of f32 at ptr (strata_hadamard_f32)."""
        self.launch("kv_quant", "strata_hadamard_f32", "Piif", rows, 32, (ptr, rows, head_dim, rot))

    def decode_splits(self, num_kv_heads: int, max_cells: int, head_dim: int) -> int:
        """kernels.decode_splits for one sequence on this GPU."""
        return decode_splits(1, num_kv_heads, max_cells, head_dim, self.num_sms)

    def _attention_decode(self, q, Hk: int, kc: int, vc: int, pos: DeviceTensor, out, max_cells: int,
                          scale: float) -> None:
        """Split-K over the cells 0..length-1 (length read on the device), then the combine."""
        _, H, dh = q.shape
        G = H // Hk
        splits = self.decode_splits(Hk, max_cells, dh)
        part_acc, part_ml = self.alloc((H, splits, dh)), self.alloc((H, splits, 2))
        gp = 1 << (G - 1).bit_length()
        lengths = pos.ptr + 4 * q.shape[0]          # max(positions) + 1, after the positions
        self.launch("attention", f"strata_attention_decode_f16_d{dh}_g{gp}", "PPPPPPiiiif", (splits, Hk, 1), 128,
                    (q.ptr, kc, vc, lengths, part_acc.ptr, part_ml.ptr, H, Hk, max_cells, splits, scale))
        self.launch("attention", "strata_attention_decode_combine_f32", "PPPiii", (H, 1), 128,
                    (part_acc.ptr, part_ml.ptr, out.ptr, H, dh, splits))

    # ---- composites, fused (cuda/decode_fused.cu) ---------------------------------------------
    def add_rms_norm(self, x: DeviceTensor, y: DeviceTensor, name: str, eps: float):
        """(x + y, rms_norm(x + y) * w) in one launch: a residual add and the norm after it."""
        if x.shape != y.shape:
            raise InvalidArgument(f"add_rms_norm: shapes {x.shape} and {y.shape} differ")
        n = x.shape[-1]
        rows = x.size // n
        x_out, out = self.alloc(x.shape), self.alloc(x.shape)
        self.launch("decode_fused", "strata_add_rms_norm_f32", "PPPPPiif", max(rows, 1), 256,
                    (x.ptr, y.ptr, x_out.ptr, self._f32_weight(name), out.ptr, rows, n, float(eps)))
        return x_out, out

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
        if T > GEMV_MAX_T or len(fused) == 1 or any(w.shape[-1] != n for w in ws) or (T > 1 and n % 8):
            return tuple(self.linear(x, name) for name in names)
        x = self._aligned(x)
        ys = [self.alloc((*x.shape[:-1], ws[i].rows)) for i in fused]
        # a third matrix of no rows has no row sets: the kernel skips it
        mats = [(ws[i].ptr, y.ptr, ws[i].rows) for i, y in zip(fused, ys)]
        mats += [(ws[0].ptr, ys[0].ptr, 0)] * (3 - len(fused))
        per_set = 4 if T > 1 else CudaOps.gemv_rows_per_block(CudaOps, q, n) // 4     # rows per warp
        sets = sum(-(-rows // per_set) for _, _, rows in mats)
        self.launch("decode_fused", f"strata_gemv3_{q.lower()}", "PPPPPPPiiiii", max(1, -(-sets // 4)), 128,
                    (*(m[0] for m in mats), x.ptr, *(m[1] for m in mats), *(m[2] for m in mats), n, T))
        out = dict(zip(fused, ys))
        return tuple(out[i] if i in out else self.linear(x, names[i]) for i in range(3))

    def qk_norm_rope_attention(self, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, q_norm: str, k_norm: str,
                               eps: float, layer: int, kv, positions) -> DeviceTensor:
        """QK-norm, RoPE and the K/V append in one launch (strata_qk_norm_rope_kv_f32), then attention."""
        T, H, dh = q.shape
        Hk = k.shape[1]
        # the fused launch writes f16 cells; a quantized cache's append follows the unfused norm and RoPE
        if dh % 2 or dh // 2 > QK_NORM_ROPE_MAX_PAIRS or getattr(kv, "quantized", False):
            q = self.rope(self.rms_norm(q, q_norm, eps), positions)
            k = self.rope(self.rms_norm(k, k_norm, eps), positions)
            return self.attention(q, k, v, layer, kv, positions)
        pos = self._positions(positions)
        kc, vc = kv.layer(layer)
        q_out = self.alloc(q.shape)
        grid = (max(T, 1), -(-(H + 2 * Hk) // 4))                 # one head per warp
        self.launch("decode_fused", "strata_qk_norm_rope_kv_f32", "PPPPPPPPPPiiiiff", grid, 128,
                    (q.ptr, k.ptr, v.ptr, self._f32_weight(q_norm), self._f32_weight(k_norm), pos.ptr,
                     self.inv_freq.ptr, q_out.ptr, kc, vc, T, H, Hk, dh, float(eps), float(self.rope_scale)))
        return self._attend(q_out, Hk, kc, vc, pos, kv.max_cells)

    def moe_route(self, router_logits: DeviceTensor, top_k: int, norm_topk: bool):
        T, E = router_logits.shape
        if E > MOE_ROUTE_MAX_EXPERTS or not 1 <= top_k <= min(E, MOE_ROUTE_MAX_TOP_K):
            raise UnsupportedError(f"moe_route: {E} experts top-{top_k}; the kernel takes E <= "
                                   f"{MOE_ROUTE_MAX_EXPERTS} and top_k <= {MOE_ROUTE_MAX_TOP_K}")
        ids, weights = self.alloc((T, top_k), np.int32), self.alloc((T, top_k))
        self.launch("moe_route", "strata_moe_route_f32", "PPPiiii", max(1, -(-T // 4)), 128,
                    (router_logits.ptr, ids.ptr, weights.ptr, T, E, top_k, int(bool(norm_topk))))
        return ids, weights

    def moe(self, x: DeviceTensor, layer: int, expert_ids: DeviceTensor, expert_weights: DeviceTensor,
            plan: MoePlan | None = None) -> DeviceTensor:
        """Routed experts of `layer`, reached as the forward's plan says (strata.backends.cuda.moe_plan;
        None: every expert resident, no routing log)."""
        plan = plan or RESIDENT
        self.expert_uses += expert_ids.size
        if x.shape[0] <= GEMV_MAX_T:
            if plan.route_log:               # the step's routing goes back to the host with the logits
                row = plan.route_log + layer * GEMV_MAX_T * expert_ids.shape[1] * 4
                self.rt.copy_d2d(row, expert_ids.ptr, expert_ids.nbytes, self.stream)
            lay = self.w.layers[layer]
            if plan.stage is not None:       # routing to the host: staged, or unpinned
                lay = dataclasses.replace(lay, table=plan.stage(layer, self.to_host(expert_ids)))
            return moe_decode(self, x, lay, expert_ids, expert_weights)
        return moe_grouped(self, x, self.w.layers[layer], expert_ids, expert_weights, plan)
