"""DeviceOps' RoPE and attention (see strata.backends.cuda.ops): the K/V append into the cache's
layer, then prompt attention (tensor-core, tiled or per-row kernels) or split-K decode attention
and its combine; the fused QK-norm + RoPE + append (cuda/decode_fused.cu); a quantized cache's
appends, rotation and attention (cuda/kv_quant.cu)."""
from __future__ import annotations

import math

import numpy as np

from .attention_tc import prefill_launch
from ...errors import InvalidArgument
from .kernels import (ATTENTION_HEAD_DIMS, CLUSTER_DECODE_BELOW, CLUSTER_SPLITS, INT32_MAX, TC_ATTENTION_HEAD_DIMS,
                      TC_DECODE_FROM, TC_DECODE_HEAD_DIMS, TMA_DEFAULT_HEAD_DIMS, WG_ATTENTION_HEAD_DIMS,
                      attention_tensor_maps, decode_quant_shared, decode_splits, split_k_takes)
from .memory import DeviceTensor, PromptSegments, StepRows

DECODE_ROWS_MAX = 8      # query rows the split-K decode kernels take as rows of one sequence (GEMV_MAX_T)


def _row_lengths(pos: DeviceTensor, T: int, max_cells: int) -> tuple[int, int, int]:
    """(lengths address, cache stride in cells, bases address or 0) of T query rows. A decode step's
    StepRows name each row's length and the first cell of its sequence (rows of parallel slots in
    one cache, max_cells apart: the kernels read a row's VRAM ring by its slot). Otherwise the rows are one sequence's at consecutive positions p..p+T-1: row t reads
    cells 0..p+t, its length p+t+1 is positions[t + 1] (positions carry max + 1 last), and every row
    reads the same cache (stride 0); one row: the length after the positions, as before."""
    if isinstance(pos, StepRows):       # the stride names each row's slot for --kv-resident's rings
        return pos.lengths, max_cells, pos.bases
    if T == 1:
        return pos.ptr + 4, max_cells, 0
    return pos.ptr + 4, 0, 0


def _cells(pos: DeviceTensor) -> int:
    """Address of the cache cells the rows' K/V go to: a step's own (StepRows), else the positions."""
    return pos.cells if isinstance(pos, StepRows) else pos.ptr


def _one_sequence(pos: DeviceTensor, what: str) -> None:
    """Kernels that read the cache from cell 0 by the positions take the rows of one sequence only."""
    if isinstance(pos, StepRows) and pos.num_slots > 1:
        raise InvalidArgument(f"{what} reads one sequence's cells; rows of several slots need the split-K "
                              f"decode attention (head dims {ATTENTION_HEAD_DIMS}, H / Hk <= 16)")

def _ring(kv, layer: int, pos=None) -> tuple[int, int]:
    """(window, cells) of kv's layer where it is a K/V ring (DeviceKV.ring: the MTP drafter under
    --draft-window), else (0, 0). Rows writing a ring name their cells (StepRows: position % cells),
    as the positions themselves would land past the ring."""
    ring = kv.ring(layer) if hasattr(kv, "ring") else (0, 0)
    if ring[1] and pos is not None and not isinstance(pos, StepRows):
        raise InvalidArgument(f"KV layer {layer} is a ring of {ring[1]} cells: its rows must name their cells "
                              f"(StepRows), not write at their positions")
    return ring


def _ring_rows(ring: tuple[int, int], T: int, what: str) -> None:
    """A ring's cells are read by the split-K decode kernels only: up to DECODE_ROWS_MAX rows."""
    if ring[1] and T > DECODE_ROWS_MAX:
        raise InvalidArgument(f"{what}: the draft layer's K/V ring is read {DECODE_ROWS_MAX} rows at a time at most "
                              f"(split-K decode), not {T}")


def _cells_read(pos: DeviceTensor, max_cells: int) -> int:
    """The cells 0..n-1 a prompt chunk's attention reads (its kernels load no cell past the largest
    position): n from Positions where the host knows it, else every cell."""
    return min(getattr(pos, "num_cells", max_cells), max_cells)


def _vram(kv, layer: int) -> tuple:
    """(the VRAM window's planes of layer, cells) of kv (--kv-resident; K and V, or a quantized
    format's four planes), or null planes and 0 without one."""
    cells = getattr(kv, "vram_ring_cells", 0)
    return (tuple(kv.vram_planes(layer)) if cells else (0,) * (4 if kv.quantized else 2)), cells


QK_NORM_ROPE_MAX_PAIRS = 512                               # cuda/norm_rope.cuh kMaxPairs


class AttentionOps:
    """Mixed into DeviceOps, whose alloc, copy, launch, _positions and _f32_weight these use.

    The split-K decode over f16 cells takes two kernels by each row's own length (tc-decode-attention):
    rows of tc_from cells or more attention_dec_tc.cu's, shorter ones attention.cu's, each kernel
    skipping the other's rows, so a row's bits never depend on the rows beside it. Both launch unless
    decode_lengths, (shortest, longest) of the rows being launched, says one has no rows: the decode
    step and the speculation window set it (decode_rule names the kernels a graph of theirs holds); a
    prompt chunk of a few rows names its longest (Positions.num_cells)."""

    tc_from = TC_DECODE_FROM
    cluster_below = CLUSTER_DECODE_BELOW
    decode_lengths: tuple[int, int] | None = None

    def tc_decode_from(self, dh: int) -> int:
        """The row length from which f16 split-K decode rows take attention_dec_tc.cu's kernel
        (INT32_MAX: none, the path being off or without a kernel of this head dim)."""
        return self.tc_from if self.paths.tc_decode_attention and dh in TC_DECODE_HEAD_DIMS else INT32_MAX

    def cluster_decode_below(self) -> int:
        """f16 decode rows of fewer cells than this attend in one cluster launch (cluster-decode:
        strata_attention_decode_cl_*); 0: none, the path being off or the GPU older than sm_90."""
        cc = tuple(getattr(self.device, "compute_capability", None) or (0, 0))
        return self.cluster_below if self.paths.cluster_decode and cc >= (9, 0) else 0

    def decode_kernels(self, shortest: int, longest: int, dh: int) -> tuple[bool, bool, bool]:
        """Which f16 decode kernels rows of these lengths launch: (the cluster kernel, attention.cu's
        split-K, attention_dec_tc.cu's); a split-K kernel brings the combine's launch."""
        below, cut = self.cluster_decode_below(), self.tc_decode_from(dh)
        return shortest < below, longest >= below and shortest < cut, cut < INT32_MAX and longest >= cut

    def decode_rule(self, shortest: int, longest: int) -> str:
        """Which f16 decode kernels rows of these lengths take, as a suffix for their graph's key: ""
        attention.cu's alone (the key as it was before the tensor cores' kernel), "+tc" that kernel's
        alone, "+both" both; "+cl" first where the cluster kernel takes rows ("+cl" alone, "+cl+split",
        "+cl+both")."""
        cluster, split, tc = self.decode_kernels(shortest, longest, self.args.head_dim)
        base = ("+both" if split else "+tc") if tc else ""
        return "+cl" + (base or ("+split" if split else "")) if cluster else base

    def rope(self, x: DeviceTensor, positions) -> DeviceTensor:
        T, heads, dh = x.shape
        out = self.copy(x)
        self.launch("rope", max(T, 1),
                    (out.ptr, self._positions(positions).ptr, self.inv_freq.ptr, T, heads, dh, float(self.rope_scale)))
        return out

    def attention(self, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, layer: int, kv, positions) -> DeviceTensor:
        """K/V appended at their positions into kv's layer, then causal attention -> [T, H * Dh]."""
        if getattr(kv, "quantized", False):
            return self._attention_quantized(q, k, v, layer, kv, positions)
        Hk = k.shape[1]
        pos = self._positions(positions)
        kc, vc = kv.layer(layer)
        self._append(k, v, layer, kv, pos)
        return self._attend_cells(q, Hk, kv, layer, pos)

    def _stages(self, kv, T: int, H: int, Hk: int, dh: int) -> bool:
        """Whether T query rows over kv's f16 cells take a copy of the layer staged in VRAM: cells on
        the host (--kv-resident) read by a prompt kernel, whose tiles would each read them over the bus
        again. A step's split-K kernel (and the per-row kernel) read them in place."""
        return getattr(kv, "on_host", False) and T > DECODE_ROWS_MAX and split_k_takes(H, Hk, dh)

    def _attend_cells(self, q: DeviceTensor, Hk: int, kv, layer: int, pos: DeviceTensor) -> DeviceTensor:
        """_attend over kv's f16 cells of the layer, where they are, or staged (_stages): the cells
        the chunk reads (0..max(positions), _cells_read) copied into two f16 [max_cells, Hk, Dh]
        blocks of the pool (the size of a quantized cache's scratch, so a prompt's memory does not
        grow along the context), then the prompt kernels read the copy, bit for bit the same cells."""
        if isinstance(pos, PromptSegments):     # several slots' prompts: each attends as it would alone
            T, H, dh = q.shape
            out = self.alloc((T, H * dh))
            for r0, r1, seg_kv, seg_pos in pos.parts:      # (a cache in VRAM, no ring: prompt_batchable)
                kc, vc = seg_kv.layer(layer)
                self._attend(q[r0:r1], Hk, kc, vc, seg_pos, seg_kv.max_cells, out=out[r0:r1])
            return out
        T, H, dh = q.shape
        kc, vc = kv.layer(layer)
        if not self._stages(kv, T, H, Hk, dh):
            return self._attend(q, Hk, kc, vc, pos, kv.max_cells, _ring(kv, layer, pos), _vram(kv, layer))
        rows = kv.max_cells
        k_stage = self.alloc((rows, Hk, dh), np.float16)
        v_stage = self.alloc((rows, Hk, dh), np.float16)
        nbytes = _cells_read(pos, rows) * Hk * dh * 2
        self.rt.copy_d2d(k_stage.ptr, kc, nbytes, self.stream)
        self.rt.copy_d2d(v_stage.ptr, vc, nbytes, self.stream)
        self.bytes_staged_kv += 2 * nbytes
        out = self._attend(q, Hk, k_stage.ptr, v_stage.ptr, pos, rows)
        del k_stage, v_stage                    # in this order (strata._ext.prompt_plan ATTN_STAGED)
        return out

    def _attend(self, q: DeviceTensor, Hk: int, kc: int, vc: int, pos: DeviceTensor, max_cells: int,
                ring: tuple[int, int] = (0, 0), vram: tuple = ((0, 0), 0), out: DeviceTensor | None = None) -> DeviceTensor:
        """Causal attention of q [T, H, Dh] over the cached cells 0..max(positions) -> [T, H * Dh]
        (over a ring's last `window` positions, ring = (window, cells): split-K decode only). vram:
        ((K, V), cells) of --kv-resident's VRAM window, which the split-K decode reads the newest
        cells from (_vram); the other kernels read every cell at kc, vc. out: where the rows go
        (default: a new tensor)."""
        T, H, dh = q.shape
        out = self.alloc((T, H * dh)) if out is None else out
        G, scale = H // Hk, 1.0 / math.sqrt(dh)
        wgmma = dh in WG_ATTENTION_HEAD_DIMS and self.paths.wgmma_attention  # on trial: attention_ws.cu, _wg.cu
        # attention_ws.cu's TMA build where it runs and the host knows the cells the chunk reads (its
        # tensor maps end there: the cells past it read as zeros, as the cp.async build zero-fills them)
        cells = min(getattr(pos, "num_cells", 0), max_cells)
        tma = cells > 0 and self.tma_attention and dh in TMA_DEFAULT_HEAD_DIMS
        if ring[1] and not (split_k_takes(H, Hk, dh) and T <= DECODE_ROWS_MAX):
            _ring_rows(ring, T, "attention")
            raise InvalidArgument(f"attention: the draft layer's K/V ring needs the split-K decode kernels (head "
                                  f"dims {ATTENTION_HEAD_DIMS}, H / Hk <= 16)")
        if not split_k_takes(H, Hk, dh):
            _one_sequence(pos, "attention_rows")
            self.launch("attention_rows", (H, T),
                        (q.ptr, kc, vc, pos.ptr, out.ptr, T, H, Hk, dh, scale))
        elif T <= DECODE_ROWS_MAX:     # a step or a verify window: each row as a one-token step reads it
            self._attention_decode(q, Hk, kc, vc, pos, out, max_cells, scale, ring, vram)
        elif tma or wgmma or (dh in TC_ATTENTION_HEAD_DIMS and self.paths.tc_attention):  # flash attention
            op, grid, _, shared, fields = prefill_launch(T, H, Hk, dh, wgmma, tma)  # the block: the table op's
            maps = attention_tensor_maps(self.rt, kc, vc, Hk, dh, cells) if tma else ()
            self.launch(op, grid, (q.ptr, kc, vc, pos.ptr, out.ptr, T, H, Hk, scale, *maps), shared_bytes=shared,
                        **fields)
        else:
            rows = 16 if dh == 256 else 32
            self.launch("attention_prefill", (-(-T * G // rows), Hk),
                        (q.ptr, kc, vc, pos.ptr, out.ptr, T, H, Hk, scale), dh=dh)
        return out

    def _append(self, k: DeviceTensor, v: DeviceTensor, layer: int, kv, pos) -> None:
        """K [T, Hk, Dh] and V appended at their cells in kv's layer (in its format)."""
        T, Hk, dh = k.shape
        _ring(kv, layer, pos)
        if not getattr(kv, "quantized", False):
            kc, vc = kv.layer(layer)
            self.launch("kv_append_f16", T, (k.ptr, v.ptr, _cells(pos), kc, vc, T, Hk * dh))
        else:
            (kcodec, vcodec), planes = kv.codecs, kv.planes(layer)
            rot = float(np.float32(1.0 / np.sqrt(dh)))             # strata.backends.cuda.kv.rot_scale
            for x, codec, (values, scales) in ((k, kcodec, planes[:2]), (v, vcodec, planes[2:])):
                extra = (rot,) if codec.rotated else ()
                self.launch(f"kv_append_{codec.name}", (T, Hk),
                            (x.ptr, _cells(pos), values, scales, T, Hk, dh, *extra))
        self._vram_append(kv, layer, pos, T)

    def _vram_append(self, kv, layer: int, pos, T: int) -> None:
        """The T cells just appended to kv's layer copied into its VRAM window (--kv-resident), every
        plane in one launch (strata_kv_ring_append), so the window equals the host cells."""
        cells = getattr(kv, "vram_ring_cells", 0)
        if not cells:
            return
        src, dst = kv.cell_ranges(layer), kv.vram_planes(layer)
        pad = (0,) * (4 - len(src))
        self.launch("kv_ring_append", (T, len(src)),
                    (_cells(pos), *(a for a, _ in src), *pad, *dst, *pad, T, cells, *(c for _, c in src), *pad,
                     kv.max_cells))

    def _attention_quantized(self, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, layer: int, kv,
                             positions) -> DeviceTensor:
        """attention() over a quantized DeviceKV (cuda/kv_quant.cu): K and V quantized into their cells
        at their positions; q rotated where K is stored rotated; up to 8 rows (a decode step) run the
        split-K kernel of the format over the planes and the combine (un-rotating the output in it
        where V is stored rotated), more (a prompt chunk) dequantize the layer's cells into an f16
        scratch the f16 prompt attention reads, then un-rotate the output where V is rotated.
        (qk_norm_rope_attention fuses a step's norms, RoPE, rotation of q and append into one launch.) Every host value here is a shape, or a prompt's positions (already on the host)."""
        T, H, dh = q.shape
        Hk = k.shape[1]
        pos = self._positions(positions)
        kc, vc = kv.codecs
        rot = float(np.float32(1.0 / np.sqrt(dh)))             # strata.backends.cuda.kv.rot_scale
        self._append(k, v, layer, kv, pos)
        if kc.rotated:
            q = self.copy(q)
            self._hadamard(q.ptr, T * H, dh, rot)
        if isinstance(pos, PromptSegments):     # several slots' prompts: each attends as it would alone
            out = self.alloc((T, H * dh))
            for r0, r1, seg_kv, seg_pos in pos.parts:
                self._attend_dequantized(q[r0:r1], Hk, seg_kv, layer, seg_pos, out[r0:r1])
        elif self._quantized_split_k(kv, H, Hk, dh, T):
            return self._attend_quantized(q, Hk, kv, layer, pos)
        else:
            out = self._attend_dequantized(q, Hk, kv, layer, pos)
        if vc.rotated:
            self._hadamard(out.ptr, T * H, dh, rot)
        return out

    def _attend_dequantized(self, q: DeviceTensor, Hk: int, kv, layer: int, pos, out: DeviceTensor | None = None):
        """A prompt's attention over a quantized cache: the layer's cells dequantized into an f16
        scratch, read by the f16 prompt kernels (q already rotated where K is) -> [T, H * Dh], into
        out where given (V's rotation is the caller's to undo)."""
        T = q.shape[0]
        _ring_rows(_ring(kv, layer), T, "a quantized cache's prompt attention")
        _one_sequence(pos, "a quantized cache's prompt attention")
        (kc, vc), planes = kv.codecs, kv.planes(layer)
        dh = q.shape[2]
        # the scratch's size is the cache's, whatever the positions, so a prompt's memory does not
        # grow along it (the planner's dry run prices one chunk for all); only the cells the
        # attention reads (0..max(positions), where the host knows it: _cells_read) are dequantized,
        # every cell for a step whose positions are read on the device
        rows, used = kv.max_cells, _cells_read(pos, kv.max_cells)
        scratch = []
        for codec, (values, scales) in ((kc, planes[:2]), (vc, planes[2:])):
            f16 = self.alloc((rows, Hk, dh), np.float16)
            self.launch("kv_dequant_f16", (used, Hk), (values, scales, f16.ptr, used, Hk, dh), codec=codec.name)
            scratch.append(f16)
        return self._attend(q, Hk, scratch[0].ptr, scratch[1].ptr, pos, rows, out=out)

    @staticmethod
    def _quantized_split_k(kv, H: int, Hk: int, dh: int, T: int) -> bool:
        """Whether T query rows over a quantized cache take the split-K decode kernels (a step or a
        verify window), else the prompt path over an f16 scratch."""
        return T <= DECODE_ROWS_MAX and split_k_takes(H, Hk, dh)

    def _attend_quantized(self, q: DeviceTensor, Hk: int, kv, layer: int, pos: DeviceTensor) -> DeviceTensor:
        """Split-K decode over kv's planes of the layer for q [T, H, Dh] (already rotated where K is
        rotated), then the combine, which un-rotates each head's output in the same launch where V is
        rotated (strata_attention_decode_combine_rot_f32) -> [T, H * Dh]."""
        if isinstance(pos, PromptSegments):
            raise InvalidArgument("attention: several slots' prompts in one forward attend on the prompt path "
                                  f"(each more than {DECODE_ROWS_MAX} rows), not the split-K decode kernels")
        T, H, dh = q.shape
        G, scale = H // Hk, 1.0 / math.sqrt(dh)
        out = self.alloc((T, H * dh))
        ring = _ring(kv, layer, pos)
        splits = self.decode_splits(Hk, ring[0] or kv.max_cells, dh)     # a ring's rows read its window
        part_acc, part_ml = self.alloc((T, H, splits, dh)), self.alloc((T, H, splits, 2))
        gp = 1 << (G - 1).bit_length()
        lengths, stride, bases = _row_lengths(pos, T, kv.max_cells)
        vram, vram_cells = _vram(kv, layer)
        self.launch("attention_decode_quant", (splits, Hk, T),
                    (q.ptr, *kv.planes(layer), lengths, bases, part_acc.ptr, part_ml.ptr, H, Hk, stride, splits,
                     scale, *ring, *vram, vram_cells),
                    decode_quant_shared(kv.fmt, dh, getattr(self.device, "compute_capability", None))
                    if self.paths.kv_ring else 0,
                    fmt=kv.fmt, dh=dh, g=gp)
        if kv.codecs[1].rotated:
            self.launch("attention_combine_rot", (H, T),
                        (part_acc.ptr, part_ml.ptr, out.ptr, H, dh, splits, float(np.float32(1.0 / np.sqrt(dh)))))
        else:
            self.launch("attention_combine", (H, T), (part_acc.ptr, part_ml.ptr, out.ptr, H, dh, splits))
        return out

    def _hadamard(self, ptr: int, rows: int, head_dim: int, rot: float) -> None:
        """H x in place over rows head vectors of f32 at ptr (strata_hadamard_f32)."""
        self.launch("hadamard", rows, (ptr, rows, head_dim, rot))

    def decode_splits(self, num_kv_heads: int, max_cells: int, head_dim: int) -> int:
        """kernels.decode_splits for one sequence on this GPU."""
        return decode_splits(1, num_kv_heads, max_cells, head_dim, self.num_sms)

    def _attention_decode(self, q, Hk: int, kc: int, vc: int, pos: DeviceTensor, out, max_cells: int,
                          scale: float, ring: tuple[int, int] = (0, 0), vram: tuple = ((0, 0), 0)) -> None:
        """Split-K over the cells 0..length-1 (length read on the device; a ring's last window
        positions; the newest from --kv-resident's VRAM window where there is one), then the combine."""
        _, H, dh = q.shape
        G = H // Hk
        T = q.shape[0]
        gp = 1 << (G - 1).bit_length()
        lengths, stride, bases = _row_lengths(pos, T, max_cells)
        (k_vram, v_vram), vram_cells = vram
        # rows of tc_from cells or more on the tensor cores (cuda/attention_dec_tc.cu, the same contract)
        cut = self.tc_decode_from(dh)
        # a few prompt rows (Positions) name their longest: max position + 1
        shortest, longest = self.decode_lengths or (0, getattr(pos, "num_cells", INT32_MAX))
        cluster, split, tc = self.decode_kernels(shortest, longest, dh)
        if split or tc:                 # the split-K kernels' partials, then the combine
            splits = self.decode_splits(Hk, ring[0] or max_cells, dh)
            part_acc, part_ml = self.alloc((T, H, splits, dh)), self.alloc((T, H, splits, 2))
            args = (q.ptr, kc, vc, lengths, bases, part_acc.ptr, part_ml.ptr, H, Hk, stride, splits, scale, *ring,
                    k_vram, v_vram, vram_cells, cut)
            if split:
                self.launch("attention_decode", (splits, Hk, T), args, dh=dh, g=gp)
            if tc:
                self.launch("attention_decode_tc", (splits, Hk, T), args, dh=dh, g=gp)
            self.launch("attention_combine", (H, T), (part_acc.ptr, part_ml.ptr, out.ptr, H, dh, splits))
        if cluster:     # after the combine: it writes the short rows, over what the combine left in theirs
            self.launch("attention_decode_cl", (CLUSTER_SPLITS, Hk, T),
                        (q.ptr, kc, vc, lengths, bases, out.ptr, H, Hk, stride, scale, *ring, k_vram, v_vram,
                         vram_cells, self.cluster_decode_below()), dh=dh, g=gp)


    def qk_norm_rope_attention(self, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, q_norm: str, k_norm: str,
                               eps: float, layer: int, kv, positions) -> DeviceTensor:
        """QK-norm, RoPE and the K/V append in one launch (_fused_append), then attention; the unfused
        chain where no fused kernel takes the head dim or the cache (a quantized cache's prompt chunk)."""
        if not self._fused(q, k, kv):
            q = self.rope(self.rms_norm(q, q_norm, eps), positions)
            k = self.rope(self.rms_norm(k, k_norm, eps), positions)
            return self.attention(q, k, v, layer, kv, positions)
        pos = self._positions(positions)
        q_out = self._fused_append(q, k, v, q_norm, k_norm, eps, layer, kv, pos)
        if getattr(kv, "quantized", False):
            return self._attend_quantized(q_out, k.shape[1], kv, layer, pos)
        return self._attend_cells(q_out, k.shape[1], kv, layer, pos)

    def qk_norm_rope_append(self, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, q_norm: str, k_norm: str,
                            eps: float, layer: int, kv, positions) -> None:
        """The K/V cells qk_norm_rope_attention writes, bit for bit the same launches, without the
        attention (the draft layer's prompt cells: nothing reads their layer's output)."""
        if not self._fused(q, k, kv):
            k = self.rope(self.rms_norm(k, k_norm, eps), positions)
            self._append(k, v, layer, kv, self._positions(positions))
            return
        self._fused_append(q, k, v, q_norm, k_norm, eps, layer, kv, self._positions(positions))

    def _fused(self, q: DeviceTensor, k: DeviceTensor, kv) -> bool:
        """Whether QK-norm, RoPE and the append run as one launch: over f16 cells for any row count
        where the head dim fits strata_qk_norm_rope_kv_f32, over quantized cells for a step's rows
        the split-K kernels take (strata_qk_norm_rope_kv_<fmt>)."""
        T, H, dh = q.shape
        if getattr(kv, "quantized", False):
            return self._quantized_split_k(kv, H, k.shape[1], dh, T)
        return not (dh % 2 or dh // 2 > QK_NORM_ROPE_MAX_PAIRS)

    def _fused_append(self, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, q_norm: str, k_norm: str,
                      eps: float, layer: int, kv, pos) -> DeviceTensor:
        """One launch: QK-norm and RoPE of q and k, the K/V append at each row's cell (quantized where
        the cache is, bit for bit the unfused chain, K rotated where its format is, and q with it)
        -> the normed, roped (rotated) q."""
        T, H, dh = q.shape
        Hk = k.shape[1]
        _ring(kv, layer, pos)
        q_out = self.alloc(q.shape)
        grid = (max(T, 1), -(-(H + 2 * Hk) // 4))                 # one head per warp
        head = (q.ptr, k.ptr, v.ptr, self._f32_weight(q_norm), self._f32_weight(k_norm), pos.ptr,
                pos.cells if isinstance(pos, StepRows) else 0, self.inv_freq.ptr, q_out.ptr)
        tail = (T, H, Hk, dh, float(eps), float(self.rope_scale))
        if getattr(kv, "quantized", False):
            rot = float(np.float32(1.0 / np.sqrt(dh)))         # strata.backends.cuda.kv.rot_scale
            self.launch("qk_norm_rope_kv_quant", grid, (*head, *kv.planes(layer), *tail, rot), fmt=kv.fmt)
        else:
            self.launch("qk_norm_rope_kv", grid, (*head, *kv.layer(layer), *tail))
        self._vram_append(kv, layer, pos, T)
        return q_out
