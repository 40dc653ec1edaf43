"""cuda/kv_quant.cu's launches: quantized KV appends, the head-vector rotation, split-K decode
attention over quantized planes (then attention.cu's combine) and the cells' dequantize to f16, as numpy-in/out calls over a CudaOps
(strata.backends.cuda): the kernels' tests, and the launch shapes the runner will use.

The planes are strata.quant.kv's: per codec (int8 or q4r) a values array and an f16 scales array,
[rows, Hk, ...] for appends and [B, S, Hk, ...] (sequences back to back) for decode.
"""
from __future__ import annotations

import numpy as np

from ...errors import InvalidArgument
from ...quant import kv as kv_formats
from .kernels import KV_DECODE_FORMATS as DECODE_FORMATS, decode_quant_shared


def rot_scale(head_dim: int) -> float:
    """f32(1 / sqrt(Dh)), as strata.quant.kv.rotate multiplies by it."""
    return float(np.float32(1.0 / np.sqrt(head_dim)))


def _planes_shape(codec, lead: tuple, head_dim: int):
    values, scales = codec.empty(lead, head_dim)
    return values.shape, values.dtype, scales.shape


class KVQuantOps:
    """Quantized KV kernels on the device of `ops` (a strata.backends.cuda.CudaOps)."""

    def __init__(self, ops):
        self.ops = ops

    def _check_dh(self, op: str, head_dim: int) -> None:
        if head_dim not in self.ops.ATTENTION_HEAD_DIMS:
            raise InvalidArgument(f"{op}: head dim {head_dim} not in {self.ops.ATTENTION_HEAD_DIMS}")

    def append(self, codec_name: str, x: np.ndarray, cells: np.ndarray, values: np.ndarray,
               scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Planes [rows, Hk, ...] with x [T, Hk, Dh] quantized into rows cells [T]
        (strata_kv_append_int8 / strata_kv_append_q4r)."""
        ops, codec = self.ops, kv_formats.CODECS[codec_name]
        x = np.ascontiguousarray(x, np.float32)
        cells = np.ascontiguousarray(cells, np.int32)
        T, Hk, dh = x.shape
        self._check_dh("kv_append", dh)
        vshape, vdtype, sshape = _planes_shape(codec, (values.shape[0], Hk), dh)
        if values.shape != vshape or scales.shape != sshape or cells.shape != (T,):
            raise InvalidArgument(f"kv_append_{codec_name}: x {x.shape}, cells {cells.shape}, planes "
                                  f"{values.shape} / {scales.shape} (want {vshape} / {sshape})")
        if T and (cells.min() < 0 or cells.max() >= values.shape[0]):
            raise InvalidArgument(f"kv_append_{codec_name}: cells outside the cache's {values.shape[0]} rows")
        v_dev = ops._upload(np.ascontiguousarray(values, vdtype))
        s_dev = ops._upload(np.ascontiguousarray(scales, np.float16))
        x_dev, cells_dev = ops._upload(x), ops._upload(cells)
        if T:
            args = (x_dev, cells_dev, v_dev, s_dev, T, Hk, dh)
            if codec_name == "int8":
                ops._launch("kv_append_int8", (T, Hk), args)
            else:
                ops._launch("kv_append_q4r", (T, Hk), (*args, rot_scale(dh)))
        return ops._download(v_dev, vshape, vdtype), ops._download(s_dev, sshape, np.float16)

    def dequant_f16(self, codec_name: str, values: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """Planes [rows, Hk, ...] of codec int8 or q4r -> their cells as f16 [rows, Hk, Dh], a q4r's still
        rotated (strata_kv_dequant_int8_f16 / strata_kv_dequant_q4r_f16: the prompt path's scratch)."""
        ops, codec = self.ops, kv_formats.CODECS[codec_name]
        rows, Hk = values.shape[:2]
        dh = scales.shape[-1] * codec.block
        self._check_dh("kv_dequant", dh)
        vshape, vdtype, sshape = _planes_shape(codec, (rows, Hk), dh)
        if values.shape != vshape or scales.shape != sshape:
            raise InvalidArgument(f"kv_dequant_{codec_name}: planes {values.shape} / {scales.shape}, "
                                  f"want {vshape} / {sshape}")
        v_dev = ops._upload(np.ascontiguousarray(values, vdtype))
        s_dev = ops._upload(np.ascontiguousarray(scales, np.float16))
        out = ops._output(rows * Hk * dh * 2)
        if rows:
            ops._launch("kv_dequant_f16", (rows, Hk), (v_dev, s_dev, out, rows, Hk, dh), codec=codec_name)
        return ops._download(out, (rows, Hk, dh), np.float16)

    def _hadamard(self, buf, rows: int, head_dim: int) -> None:
        self.ops._launch("hadamard", rows, (buf, rows, head_dim, rot_scale(head_dim)))

    def hadamard(self, x: np.ndarray) -> np.ndarray:
        """H x over the last axis (strata_hadamard_f32), x [..., Dh]."""
        x = np.ascontiguousarray(x, np.float32)
        self._check_dh("hadamard", x.shape[-1])
        rows = x.size // x.shape[-1]
        buf = self.ops._upload(x)
        if rows:
            self._hadamard(buf, rows, x.shape[-1])
        return self.ops._download(buf, x.shape, np.float32)

    def attention_decode(self, fmt: str, q: np.ndarray, k_planes, v_planes, lengths: np.ndarray,
                         num_splits: int | None = None, scale: float | None = None, window: int = 0,
                         ring: int = 0, vram=None, staged: bool = True) -> np.ndarray:
        """One query per sequence, q [B, H, Dh], over quantized planes [B, S, Hk, ...] of format fmt,
        sequence b reading cells 0..lengths[b]-1 -> [B, H*Dh]: q rotated where K is, the split-K
        kernel, attention.cu's combine, the output un-rotated where V is rotated. vram (K planes,
        V planes) [R, Hk, ...]: --kv-resident's VRAM window of one sequence (B 1), position p at
        p % R, which the kernel reads the newest cells from (cuda/kv_codec.cuh VramWindow). staged:
        the kernel's cp.async ring where the engine gives it one (kernels.decode_quant_shared), else
        a tile a warp in registers (the same bits)."""
        ops = self.ops
        if fmt not in DECODE_FORMATS:
            raise InvalidArgument(f"attention_decode: format {fmt!r} not in {DECODE_FORMATS}")
        kc, vc = kv_formats.codecs(fmt)
        q = np.ascontiguousarray(q, np.float32)
        lengths = np.ascontiguousarray(lengths, np.int32)
        B, H, dh = q.shape
        S, Hk = k_planes[0].shape[1], k_planes[0].shape[2]
        G = ops._check_attention("attention_decode", q, k_planes[0], H, Hk, dh)
        for codec, (values, scales) in ((kc, k_planes), (vc, v_planes)):
            vshape, _, sshape = _planes_shape(codec, (B, S, Hk), dh)
            if values.shape != vshape or scales.shape != sshape:
                raise InvalidArgument(f"attention_decode: {codec.name} planes {values.shape} / {scales.shape}, "
                                      f"want {vshape} / {sshape}")
        if ring and not (ring == S and 0 < window <= S):
            raise InvalidArgument(f"attention_decode: a ring must be the planes' {S} cells, its window 1..{S}")
        if lengths.shape != (B,) or B == 0 or lengths.min() < 1 or (not ring and lengths.max() > S):
            raise InvalidArgument(f"attention_decode: lengths must be [B] in 1..{S} (B >= 1)")
        splits = num_splits or ops.decode_splits(B, Hk, S, dh)
        if not 1 <= splits <= ops.ATTENTION_MAX_SPLITS:
            raise InvalidArgument(f"attention_decode: num_splits {splits} not in 1..{ops.ATTENTION_MAX_SPLITS}")
        scale = 1.0 / np.sqrt(dh) if scale is None else scale
        q_dev = ops._upload(q)
        if kc.rotated:
            self._hadamard(q_dev, B * H, dh)
        part_acc, part_ml = ops._output(B * H * splits * dh * 4), ops._output(B * H * splits * 2 * 4)
        out = ops._output(B * H * dh * 4)
        gp = 1 << (G - 1).bit_length()
        # every buffer held in a local until the launches are queued
        planes = [ops._upload(np.ascontiguousarray(a)) for a in (*k_planes, *v_planes)]
        lengths_dev = ops._upload(lengths)
        vram_planes, vram_cells = [0] * 4, 0
        if vram is not None:
            vram_cells = vram[0][0].shape[0]
            for codec, (values, scales) in zip((kc, vc), vram):
                vshape, _, sshape = _planes_shape(codec, (vram_cells, Hk), dh)
                if values.shape != vshape or scales.shape != sshape:
                    raise InvalidArgument(f"attention_decode: {codec.name} VRAM window {values.shape} / "
                                          f"{scales.shape}, want {vshape} / {sshape}")
            vram_planes = [ops._upload(np.ascontiguousarray(a)) for a in (*vram[0], *vram[1])]
        shared = decode_quant_shared(fmt, dh, getattr(ops.device, "compute_capability", None)) if staged else 0
        ops._launch("attention_decode_quant", (splits, Hk, B),
                    (q_dev, *planes, lengths_dev, 0, part_acc, part_ml, H, Hk, S, splits, float(scale), window, ring,
                     *vram_planes, vram_cells), shared, fmt=fmt, dh=dh, g=gp)
        ops._launch("attention_combine", (H, B), (part_acc, part_ml, out, H, dh, splits))
        if vc.rotated:
            self._hadamard(out, B * H, dh)
        return ops._download(out, (B, H * dh), np.float32)
