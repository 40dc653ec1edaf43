"""Kernels from fatbin files through the CUDA driver API (cuda.bindings), with torch for buffers,
streams and timing: the A/B tools' way to run kernels built here with nvcc on the GPU machine without
building the package (tools/gemv_rows_ab.py, tools/moe_gemm_ab.py).

    dev = Driver(); f = dev.function(dev.module("x.fatbin"), "strata_...")
    dev.launch(f, (gx, gy), 256, [("P", ptr), ("i", n), ("q", stride)])

Argument kinds as strata._ext.runtime spells them: P a device pointer, i int32, q int64; and B, bytes
passed by value (a CUtensorMap from tensor_map_f16).
"""
from __future__ import annotations

import ctypes

import numpy as np

_CTYPES = {"P": ctypes.c_uint64, "Q": ctypes.c_uint64, "q": ctypes.c_int64, "i": ctypes.c_int32,
           "I": ctypes.c_uint32, "f": ctypes.c_float}


class Driver:
    def __init__(self):
        import torch
        from cuda.bindings import driver as cu
        self.torch, self.cu = torch, cu
        torch.cuda.init()
        torch.zeros(1, device="cuda")              # the primary context, current on this thread
        self.stream = torch.cuda.current_stream()
        self._keep = []
        self._opted = {}                           # id(function) -> dynamic shared bytes opted in

    def check(self, result):
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != 0:
            raise RuntimeError(f"CUDA driver error {err}")
        return result[1:] if isinstance(result, tuple) and len(result) > 1 else None

    def module(self, path: str):
        data = open(path, "rb").read()
        self._keep.append(data)
        (mod,) = self.check(self.cu.cuModuleLoadData(data))
        return mod

    def function(self, mod, name: str):
        (f,) = self.check(self.cu.cuModuleGetFunction(mod, name.encode()))
        return f

    def launch(self, f, grid, block: int, args: list, shared: int = 0) -> None:
        """f over grid (an int or an (x[, y[, z]]) tuple) of `block` threads; args (kind, value); shared:
        dynamic shared memory bytes (the function opted in past 48 KB on its first such launch)."""
        gx, gy, gz = (tuple(grid) + (1, 1))[:3] if isinstance(grid, (tuple, list)) else (grid, 1, 1)
        if shared > 48 * 1024 and self._opted.get(id(f), 0) < shared:
            attr = self.cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            self.check(self.cu.cuFuncSetAttribute(f, attr, shared))
            self._opted[id(f)] = shared
        vals = [(ctypes.c_ubyte * len(value)).from_buffer_copy(value) if kind == "B" else _CTYPES[kind](value)
                for kind, value in args]
        ptrs = np.array([ctypes.addressof(v) for v in vals], np.uint64)
        self.check(self.cu.cuLaunchKernel(f, gx, gy, gz, block, 1, 1, shared,
                                          self.cu.CUstream(self.stream.cuda_stream), int(ptrs.ctypes.data), 0))
        self._vals = (vals, ptrs)                   # alive until the launch has read them (it copies them)

    def num_sms(self) -> int:
        return self.torch.cuda.get_device_properties(0).multi_processor_count

    def tensor_map_f16(self, ptr: int, dims, strides, box) -> bytes:
        """The 128 bytes of a CUtensorMap over f16 elements at ptr: dims innermost first, strides in
        bytes of dims 1.., box the tile a copy moves; 128-byte swizzle, zeros past the end."""
        cu = self.cu
        (tm,) = self.check(cu.cuTensorMapEncodeTiled(
            cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, len(dims), ptr,
            [cu.cuuint64_t(d) for d in dims], [cu.cuuint64_t(s) for s in strides], [cu.cuuint32_t(b) for b in box],
            [cu.cuuint32_t(1)] * len(dims), cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B, cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
        return ctypes.string_at(tm.getPtr(), 128)

    # ---- buffers and timing (torch on the device); tests substitute a CPU double with the same methods

    def upload(self, a: np.ndarray):
        return self.torch.from_numpy(np.ascontiguousarray(a)).to("cuda")

    def full(self, shape, value: float):
        return self.torch.full(shape, value, dtype=self.torch.float32, device="cuda")

    def randn(self, shape):
        return self.torch.randn(shape, dtype=self.torch.float32, device="cuda")

    def download(self, t) -> np.ndarray:
        self.torch.cuda.synchronize()
        return t.cpu().numpy()

    def time_ms(self, fn, repeats: int, warmup: int = 3) -> list[float]:
        """Each of `repeats` calls of fn (after `warmup` untimed ones), timed by CUDA events, in ms."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times


class Arm:
    """One build of a kernel library in an A/B: a name, its fatbin's module, and the entry points
    PREFIX_<suffix> (looked up once each)."""

    def __init__(self, dev, name: str, fatbin: str, prefix: str):
        self.dev, self.name, self.prefix = dev, name, prefix
        self.mod = dev.module(fatbin)
        self._fn = {}

    def fn(self, suffix):
        if suffix not in self._fn:
            self._fn[suffix] = self.dev.function(self.mod, f"{self.prefix}_{suffix}")
        return self._fn[suffix]


def finish(report: dict, ok: dict, json_path: str | None) -> int:
    """An A/B tool's last lines: which arms passed their checks, the JSON report, the exit status
    (1 when any arm failed)."""
    import json
    report["ok"] = ok
    print("checks passed: " + ", ".join(f"{n} {'yes' if v else 'NO'}" for n, v in ok.items()))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(ok.values()) else 1
