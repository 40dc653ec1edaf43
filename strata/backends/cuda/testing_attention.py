"""CudaOps' numpy-in/out wrappers of the RoPE, KV append and attention kernels (cuda/rope.cu,
cuda/attention.cu): upload, one launch (two for split-K decode), download into a poisoned output."""

from __future__ import annotations

import numpy as np

from strata.errors import InvalidArgument

from .kernels import (ATTENTION_HEAD_DIMS, ATTENTION_MAX_SPLITS, CLUSTER_SPLITS, INT32_MAX, TC_DECODE_HEAD_DIMS,
                      decode_splits)


class AttentionWrappers:
    """Mixed into CudaOps (strata.backends.cuda.testing), whose _upload, _output, _download and
    _launch these use."""

    ATTENTION_HEAD_DIMS = ATTENTION_HEAD_DIMS
    ATTENTION_MAX_SPLITS = ATTENTION_MAX_SPLITS

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
        self._launch("rope", T, (x_dev, self._upload(pos), self._upload(inv), T, heads, dh, float(scale)))
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
            self._launch("kv_append_f16", T, (self._upload(k), self._upload(v), self._upload(cells), kc_dev, vc_dev, T,
                                              k.shape[1] * k.shape[2]))
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
        return decode_splits(num_seqs, num_kv_heads, max_cells, head_dim,
                                     self.device.multiprocessor_count, blocks_per_sm)

    def attention_decode(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, lengths: np.ndarray,
                         num_splits: int | None = None, scale: float | None = None,
                         bases: np.ndarray | None = None, window: int = 0, ring: int = 0,
                         vram: tuple | None = None, tc: bool = False, cluster: bool = False) -> np.ndarray:
        """One query per row: q [B, H, Dh] over f16 caches [B, S, Hk, Dh], row b reading cells
        0..lengths[b]-1 of sequence b -> [B, H*Dh] (split-K kernel, then the combine kernel).
        window > 0: row b reads only its last `window` positions; ring = S: position p is cell p % S
        (a K/V ring: lengths may then pass S, the window may not). With
        bases [B], the caches are [N, S, Hk, Dh] of any N, read as N * S cells back to back, and row b's
        cells start at cell bases[b] (parallel slots' rows in one cache). vram (K, V) [R, Hk, Dh]:
        --kv-resident's VRAM window of the B rows' one sequence, position p at p % R, which the
        kernel reads the newest cells from (cuda/kv_codec.cuh VramWindow). tc: cuda/attention_dec_tc.cu's
        kernel of the same contract (Dh 64, 128) instead of cuda/attention.cu's. cluster: the split-K over
        CLUSTER_SPLITS splits and its combine in one launch (strata_attention_decode_cl_*, sm_90+; num_splits
        must then be None or CLUSTER_SPLITS)."""
        q = np.ascontiguousarray(q, dtype=np.float32)
        kc = np.ascontiguousarray(k_cache, dtype=np.float16)
        vc = np.ascontiguousarray(v_cache, dtype=np.float16)
        lengths = np.ascontiguousarray(lengths, dtype=np.int32)
        if q.ndim != 3 or kc.ndim != 4 or vc.shape != kc.shape or (bases is None and kc.shape[0] != q.shape[0]) \
                or kc.shape[3] != q.shape[2] or lengths.shape != q.shape[:1]:
            raise InvalidArgument(f"attention_decode: q {q.shape} [B, H, Dh], caches {kc.shape} [B, S, Hk, Dh] "
                                  f"and lengths {lengths.shape} [B] do not match")
        B, H, dh = q.shape
        S, Hk = kc.shape[1], kc.shape[2]
        G = self._check_attention("attention_decode", q, kc, H, Hk, dh)
        if tc and dh not in TC_DECODE_HEAD_DIMS:
            raise InvalidArgument(f"attention_decode: the tensor-core kernel takes head dims {TC_DECODE_HEAD_DIMS}, "
                                  f"not {dh}")
        if ring and not (ring == S and 0 < window <= S):
            raise InvalidArgument(f"attention_decode: a ring must be the cache's {S} cells, its window 1..{S}")
        if B == 0 or lengths.min() < 1 or (not ring and lengths.max() > S):
            raise InvalidArgument(f"attention_decode: lengths must be in 1..{S} (B >= 1)")
        bases_dev = 0
        if bases is not None:
            bases = np.ascontiguousarray(bases, dtype=np.int32)
            if bases.shape != (B,) or bases.min() < 0 or (bases + lengths).max() > kc.shape[0] * S:
                raise InvalidArgument(f"attention_decode: bases must be [B] cells with bases + lengths <= "
                                      f"{kc.shape[0] * S}")
            bases_dev = self._upload(bases)
        splits = num_splits or self.decode_splits(B, Hk, S, dh)
        if not 1 <= splits <= self.ATTENTION_MAX_SPLITS:
            raise InvalidArgument(f"attention_decode: num_splits {splits} not in 1..{self.ATTENTION_MAX_SPLITS}")
        scale = 1.0 / np.sqrt(dh) if scale is None else scale
        part_acc = self._output(B * H * splits * dh * 4)
        part_ml = self._output(B * H * splits * 2 * 4)
        out = self._output(B * H * dh * 4)
        gp = 1 << (G - 1).bit_length()
        vram_planes, vram_cells = (0, 0), 0
        if vram is not None:
            kr, vr = (np.ascontiguousarray(r, dtype=np.float16) for r in vram)
            if kr.ndim != 3 or kr.shape != vr.shape or kr.shape[1:] != (Hk, dh):
                raise InvalidArgument(f"attention_decode: VRAM window {kr.shape} / {vr.shape}, want [R, {Hk}, {dh}]")
            vram_planes, vram_cells = (self._upload(kr), self._upload(vr)), kr.shape[0]
        if cluster:
            if tc or num_splits not in (None, CLUSTER_SPLITS):
                raise InvalidArgument(f"attention_decode: the cluster kernel takes {CLUSTER_SPLITS} splits on CUDA cores")
            self._launch("attention_decode_cl", (CLUSTER_SPLITS, Hk, B),
                         (self._upload(q), self._upload(kc), self._upload(vc), self._upload(lengths), bases_dev, out,
                          H, Hk, S, float(scale), window, ring, *vram_planes, vram_cells, INT32_MAX), dh=dh, g=gp)
            return self._download(out, (B, H * dh), np.float32)
        self._launch("attention_decode_tc" if tc else "attention_decode", (splits, Hk, B),
                     (self._upload(q), self._upload(kc), self._upload(vc), self._upload(lengths), bases_dev,
                      part_acc, part_ml, H, Hk, S, splits, float(scale), window, ring, *vram_planes, vram_cells,
                      0 if tc else INT32_MAX), dh=dh, g=gp)     # tc_from: every row this kernel's
        self._launch("attention_combine", (H, B), (part_acc, part_ml, out, H, dh, splits))
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
        self._launch("attention_prefill", (-(-T * G // rows), Hk), (self._upload(q), self._upload(kc), self._upload(vc),
                     self._upload(pos), out, T, H, Hk, float(scale)), dh=dh)
        return self._download(out, (T, H * dh), np.float32)

