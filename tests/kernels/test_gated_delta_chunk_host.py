"""cuda/gated_delta_chunk.cu's own source run on the host: g++ compiles it over tests/kernels/cuda_host_shim.h
(blocks of 256 threads with real barriers, shared arrays, the warp collectives and mma.sync m16n8k8 tf32
emulated by the PTX ISA's fragment layout), so the kernels' indexing, staging, scratch layout and
synchronization are checked without a GPU. Held to a float64 recurrence with
tests/kernels/test_gated_delta_chunk_gpu.py's bound (the emulated mma sums its 8 products in f32 in order).
Skipped where g++ with C++20 <barrier> is missing."""
import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.kernels.test_gated_delta_chunk_gpu import assert_is_the_recurrence, draw

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ to compile cuda/gated_delta_chunk.cu for the host")
    so = tmp_path_factory.mktemp("gdn") / "gated_delta_chunk_host.so"
    proc = subprocess.run([cxx, "-std=c++20", "-O2", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas", "-o",
                           str(so), str(HERE / "gated_delta_chunk_host.cpp")], capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"g++ could not build the host shim: {proc.stderr[-400:]}")
    lib = ctypes.CDLL(str(so))
    P, i, q = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.run_gdn_chunk_prep.argtypes = [P, P, P, P, P, i, i, i, i, ctypes.c_float, q]
    lib.run_gdn_chunk_scan.argtypes = [P, P, P, P, P, P, i, i, i, i, i, q, q]
    return lib


def run(lib, q, k, v, g, beta, S0):
    from strata.backends.cuda.linear_attn import gdn_chunk_scratch_bytes
    T, Hg, Dk = q.shape
    Hv, Dv = v.shape[1:]
    scratch = np.full(gdn_chunk_scratch_bytes(T, Hv) // 4, np.nan, np.float32)   # stray reads show
    out = np.full((T, Hv, Dv), np.nan, np.float32)
    S = S0.copy()
    ptr = lambda a: a.ctypes.data                                                   # noqa: E731
    lib.run_gdn_chunk_prep(ptr(q), ptr(k), ptr(g), ptr(beta), ptr(scratch), T, Hv, Hg, Dk, Dk ** -0.5, Hg * Dk)
    lib.run_gdn_chunk_scan(ptr(q), ptr(k), ptr(v), ptr(scratch), ptr(S), ptr(out), T, Hv, Hg, Dk, Dv, Hg * Dk,
                           Hv * Dv)
    return out, S


# a chunk less one, one more, a short last chunk; Dk past one 64-wide slice and not a multiple of 32;
# Dv past one 16-column tile; GQA ratios 1..3
@pytest.mark.parametrize("T,Hv,Hg,Dk,Dv", [(1, 1, 1, 16, 8), (63, 2, 1, 33, 20), (65, 3, 3, 128, 16),
                                           (130, 2, 1, 100, 40), (200, 3, 1, 64, 16)])
def test_kernel_source_on_the_host_equals_the_recurrence(lib, rng, T, Hv, Hg, Dk, Dv):
    q, k, v, g, beta, S0 = draw(rng, T, Hv, Hg, Dk, Dv, True)
    out, S = run(lib, q, k, v, g, beta, S0)
    assert_is_the_recurrence(out, S, q, k, v, g, beta, S0)
