# distutils: language = c++
"""Expert FFNs on the host's cores from quantized blobs (cpu_experts.h says how): the GIL is released
for each call, the work spread over a pool of threads.

    from strata._ext import cpu_experts
    out = cpu_experts.expert_ffn("Q4_K", gate, "Q4_K", up, "Q6_K", down, D, I, x)   # x [T, D] float32

gate, up and down are any contiguous bytes (numpy uint8 arrays, views of the pinned arena): [I, D],
[I, D] and [D, I] rows of their quant type.
"""
from libcpp cimport bool as cbool
from libc.stdint cimport int8_t, int32_t, uint8_t

import numpy as np

from strata.errors import InvalidArgument, UnsupportedError

cdef extern from "cpu_experts.h" namespace "strata_cpu" nogil:
    cdef cppclass QRow:
        const int8_t* q
        const float* scale
        const int32_t* sum
    cdef cppclass QBuf:
        void fill(const float* x, int T, int n)
    cdef cppclass Pool:
        @staticmethod
        Pool& get()
        int threads()
        void resize(int n)
    size_t row_bytes(int kind, int n)
    void quantize_row(const float* x, int n, int8_t* q, float* scale, int32_t* sum)
    void c_expert_ffn "strata_cpu::expert_ffn"(int kg, const uint8_t* gate, int ku, const uint8_t* up, int kd, const uint8_t* down,
                    int D, int I, const float* x, int T, float* out, cbool simd)

cdef extern from "cpu_experts.h" nogil:
    """
    namespace strata_cpu {
    static inline bool has_avx2() {
    #if STRATA_X86
        return __builtin_cpu_supports("avx2");
    #else
        return false;
    #endif
    }
    static inline void matmul_buf(int kind, const uint8_t* W, int R, int n, const float* x, int T, float* y,
                                  bool simd) {
        QBuf qx;
        qx.fill(x, T, n);
        matmul_q(kind, W, R, n, qx.rows, y, pick_row_dots(simd));
    }
    }
    """
    cbool has_avx2 "strata_cpu::has_avx2"()
    void matmul_buf "strata_cpu::matmul_buf"(int kind, const uint8_t* W, int R, int n, const float* x, int T,
                                             float* y, cbool simd)

# the weight types these kernels read, with the block each row's length must be a multiple of
KINDS = {"Q8_0": 0, "Q4_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4}
_BLOCK = {"Q8_0": 32, "Q4_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}


def simd() -> str:
    """The inner dot product this CPU runs: 'avx2' or 'scalar'."""
    return "avx2" if has_avx2() else "scalar"


def threads() -> int:
    return Pool.get().threads()


def set_threads(int n) -> None:
    """Size the pool (the calling thread counts as one)."""
    if n < 1:
        raise InvalidArgument(f"set_threads: {n} threads; at least 1")
    with nogil:
        Pool.get().resize(n)


cdef int _kind(str name, int n, str what) except -1:
    name = name.upper()
    if name not in KINDS:
        raise UnsupportedError(f"{what}: quant type {name} has no CPU expert kernel (have: {', '.join(KINDS)})")
    if n <= 0 or n % _BLOCK[name] or n % 32:
        raise InvalidArgument(f"{what}: rows of {n} weights are not a multiple of {name}'s block of {_BLOCK[name]}")
    return KINDS[name]


cdef const uint8_t[::1] _bytes(w, str qt, int rows, int n, str what):
    arr = np.ascontiguousarray(w).reshape(-1).view(np.uint8) if isinstance(w, np.ndarray) else np.frombuffer(w, np.uint8)
    cdef const uint8_t[::1] view = arr
    cdef size_t need = row_bytes(KINDS[qt.upper()], n) * rows
    if <size_t>view.shape[0] < need:
        raise InvalidArgument(f"{what}: {view.shape[0]} bytes for {rows} rows of {n} {qt} weights ({need} needed)")
    return view


def matmul(str qtype, w, int rows, int n, x, bint use_simd=True):
    """y [T, rows] = W · x[t] with x [T, n] quantized to 8 bits per block of 32 (the expert path's product)."""
    cdef int kind = _kind(qtype, n, "matmul")
    cdef const uint8_t[::1] wb = _bytes(w, qtype, rows, n, "matmul")
    cdef float[:, ::1] xv = np.ascontiguousarray(np.atleast_2d(np.asarray(x, np.float32)))
    if xv.shape[1] != n:
        raise InvalidArgument(f"matmul: x has {xv.shape[1]} columns, W rows have {n}")
    out = np.empty((xv.shape[0], rows), np.float32)
    cdef float[:, ::1] ov = out
    cdef int T = xv.shape[0]
    if T:
        with nogil:
            matmul_buf(kind, &wb[0], rows, n, &xv[0, 0], T, &ov[0, 0], use_simd)
    return out


def expert_ffn(str gate_qtype, gate, str up_qtype, up, str down_qtype, down, int D, int I, x, bint use_simd=True):
    """out [T, D] = down · (silu(gate · x) * (up · x)) for x [T, D]: one expert's FFN on the CPU."""
    cdef int kg = _kind(gate_qtype, D, "expert_ffn gate")
    cdef int ku = _kind(up_qtype, D, "expert_ffn up")
    cdef int kd = _kind(down_qtype, I, "expert_ffn down")
    cdef const uint8_t[::1] g = _bytes(gate, gate_qtype, I, D, "expert_ffn gate")
    cdef const uint8_t[::1] u = _bytes(up, up_qtype, I, D, "expert_ffn up")
    cdef const uint8_t[::1] d = _bytes(down, down_qtype, D, I, "expert_ffn down")
    cdef float[:, ::1] xv = np.ascontiguousarray(np.atleast_2d(np.asarray(x, np.float32)))
    if xv.shape[1] != D:
        raise InvalidArgument(f"expert_ffn: x has {xv.shape[1]} columns, the expert's input is {D}")
    out = np.empty((xv.shape[0], D), np.float32)
    cdef float[:, ::1] ov = out
    cdef int T = xv.shape[0]
    if T:
        with nogil:
            c_expert_ffn(kg, &g[0], ku, &u[0], kd, &d[0], D, I, &xv[0, 0], T, &ov[0, 0], use_simd)
    return out


def quantize(x):
    """x [T, n] -> (q int8 [T, n], scale float32 [T, n/32], sum int32 [T, n/32]): the activations' 8 bits."""
    cdef float[:, ::1] xv = np.ascontiguousarray(np.atleast_2d(np.asarray(x, np.float32)))
    cdef int T = xv.shape[0], n = xv.shape[1], t
    if n % 32:
        raise InvalidArgument(f"quantize: rows of {n} are not a multiple of 32")
    q = np.empty((T, n), np.int8)
    s = np.empty((T, n // 32), np.float32)
    c = np.empty((T, n // 32), np.int32)
    cdef int8_t[:, ::1] qv = q
    cdef float[:, ::1] sv = s
    cdef int32_t[:, ::1] cv = c
    for t in range(T):
        quantize_row(&xv[t, 0], n, &qv[t, 0], &sv[t, 0], &cv[t, 0])
    return q, s, c
