"""Tensor-core causal prompt attention (cuda/attention_tc.cu): the launch shape the engine uses and
a numpy-in, numpy-out wrapper for tests and benchmarks.

The kernels keep the contract of strata_attention_prefill_f16_d<Dh> (attention.cu), so a caller
switches by changing the library, the kernel name and the launch shape.
"""

from __future__ import annotations

import numpy as np

from strata.errors import InvalidArgument

from .kernels import (KERNELS, TC_ATTENTION_HEAD_DIMS, TC_ATTENTION_PAIR_HEAD_DIMS, WG_ATTENTION_HEAD_DIMS,
                      TMA_ATTENTION_CELLS, WS_ATTENTION_CELLS, WS_ATTENTION_HEAD_DIMS, WS_ATTENTION_ROWS,
                      attention_tensor_maps, attention_ws_shared, load_kernel)

LIBRARY = KERNELS["attention_prefill_tc"].library
SIGNATURE = KERNELS["attention_prefill_tc"].signature
HEAD_DIMS = TC_ATTENTION_HEAD_DIMS
MAX_GROUP = 16        # G = H / Hk tested up to here (any G works)
ROWS_PER_BLOCK = 64   # cuda/attention_tc.cu kRows: 4 warps (8 at Dh 256, two per 16 rows) x 16 query rows


def table_op(head_dim: int, wgmma: bool = False) -> str:
    """The KERNELS op of the head dim's kernel: Dh 256 runs on warp pairs, 256 threads a block; wgmma:
    a kernel of the same contract on Hopper's warpgroup MMA, cuda/attention_ws.cu's at Dh 128 and
    cuda/attention_wg.cu's at Dh 64."""
    if wgmma:
        return "attention_prefill_ws" if head_dim in WS_ATTENTION_HEAD_DIMS else "attention_prefill_wg"
    return "attention_prefill_tc_pairs" if head_dim in TC_ATTENTION_PAIR_HEAD_DIMS else "attention_prefill_tc"


def prefill_launch(T: int, H: int, Hk: int, Dh: int, wgmma: bool = False,
                   tma: bool = False) -> tuple[str, tuple, int, int, dict]:
    """(table op, grid, block, dynamic shared bytes, entry-name fields) of the prompt attention kernel
    for T queries of H heads over Hk KV heads: prefill_tc_launch_shape's, or attention_ws.cu's (128
    rows a block, its ring in dynamic shared memory) where wgmma takes it; tma: its TMA build
    (attention_prefill_wst: two tensor maps follow the contract's arguments, attention_tensor_maps),
    which needs the cells the chunk reads known on the host."""
    grid, block = prefill_tc_launch_shape(T, H, Hk, Dh)
    if tma:
        if Dh not in TMA_ATTENTION_CELLS:
            raise InvalidArgument(f"attention_prefill_tc: attention_ws.cu's TMA build takes Dh "
                                  f"{tuple(TMA_ATTENTION_CELLS)}, not {Dh}")
        op, cells = "attention_prefill_wst", TMA_ATTENTION_CELLS[Dh]
    else:
        if wgmma and Dh not in WG_ATTENTION_HEAD_DIMS:
            raise InvalidArgument(f"attention_prefill_tc: the wgmma kernels take Dh {WG_ATTENTION_HEAD_DIMS}, not {Dh}")
        op, cells = table_op(Dh, wgmma), WS_ATTENTION_CELLS
        if op != "attention_prefill_ws":
            return op, grid, KERNELS[op].block, 0, {"dh": Dh}
    grid = (-(-T * (H // Hk) // WS_ATTENTION_ROWS), Hk)
    return op, grid, KERNELS[op].block, attention_ws_shared(cells, Dh, tma), {"cells": cells, "dh": Dh}


def kernel_name(head_dim: int) -> str:
    return KERNELS[table_op(head_dim)].name(dh=head_dim)


def prefill_tc_launch_shape(T: int, H: int, Hk: int, Dh: int) -> tuple[tuple[int, int], int]:
    """(grid, block) of strata_attention_prefill_tc_f16_d<Dh> for T queries of H heads over Hk KV
    heads: one block per 64 (token, head-in-group) rows of one KV head; 128 threads, 256 at Dh 256."""
    if Dh not in HEAD_DIMS or T < 1 or Hk < 1 or H % Hk or not 1 <= H // Hk <= MAX_GROUP:
        raise InvalidArgument(f"attention_prefill_tc: T {T}, H {H}, Hk {Hk}, Dh {Dh}: needs T >= 1, "
                              f"Dh in {HEAD_DIMS} and H a multiple of Hk with H / Hk <= {MAX_GROUP}")
    return (-(-T * (H // Hk) // ROWS_PER_BLOCK), Hk), KERNELS[table_op(Dh)].block


def attention_prefill_tc(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, positions: np.ndarray,
                         scale: float | None = None, device: int = 0, wgmma: bool = False,
                         tma: bool = False) -> np.ndarray:
    """Causal attention of q [T, H, Dh] at positions [T] over f16 caches [S, Hk, Dh] holding cells
    0..max(positions) -> out [T, H * Dh] f32 (strata_attention_prefill_tc_f16_d<Dh>; wgmma: the same
    contract's kernel of cuda/attention_ws.cu at Dh 128, of cuda/attention_wg.cu at Dh 64, sm_90; tma:
    attention_ws.cu's TMA build, its tensor maps over cells 0..max(positions)).
    The output is poisoned (NaN) before the launch, so an element the kernel misses shows."""
    from strata.backends.cuda import _runtime

    q = np.ascontiguousarray(q, dtype=np.float32)
    kc = np.ascontiguousarray(k_cache, dtype=np.float16)
    vc = np.ascontiguousarray(v_cache, dtype=np.float16)
    pos = np.ascontiguousarray(positions, dtype=np.int32)
    if q.ndim != 3 or kc.ndim != 3 or vc.shape != kc.shape or kc.shape[2] != q.shape[2] or pos.shape != q.shape[:1]:
        raise InvalidArgument(f"attention_prefill_tc: q {q.shape} [T, H, Dh], caches {kc.shape} [S, Hk, Dh] "
                              f"and positions {pos.shape} [T] do not match")
    T, H, dh = q.shape
    if T == 0:
        return np.empty((0, H * dh), np.float32)
    op, grid, block, shared, fields = prefill_launch(T, H, kc.shape[1], dh, wgmma, tma)
    if pos.min() < 0 or pos.max() >= kc.shape[0]:
        raise InvalidArgument(f"attention_prefill_tc: positions must be in 0..{kc.shape[0] - 1}")
    scale = 1.0 / np.sqrt(dh) if scale is None else scale

    rt = _runtime()
    dev = rt.Device(device)
    stream = rt.Stream(dev)
    bufs = []
    for array in (q, kc, vc, pos):
        buf = rt.DeviceBuffer(dev, array.nbytes)
        buf.copy_from_host(array, stream)
        bufs.append(buf)
    out_dev = rt.DeviceBuffer(dev, T * H * dh * 4)
    out_dev.fill_bytes(0xFF, stream)
    kernel = load_kernel(rt, dev, op, **fields)
    maps = attention_tensor_maps(rt, bufs[1].ptr, bufs[2].ptr, kc.shape[1], dh, int(pos.max()) + 1) if tma else ()
    kernel.launch(grid, block, (*bufs, out_dev, T, H, kc.shape[1], float(scale), *maps), shared_bytes=shared,
                  stream=stream)
    out = np.empty((T, H * dh), np.float32)
    out_dev.copy_to_host(out, stream)
    stream.synchronize()
    return out
