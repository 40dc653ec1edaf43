"""tools/fatbin_driver.py's launch packing, on the CPU: the driver receives an array of pointers to
the arguments in their kinds' C types (what cuLaunchKernel's kernelParams is), the grid as three
dimensions and the block's threads; a driver error raises with its code."""
import ctypes

import numpy as np
import pytest

from tests.fixtures import load_tool


class StubDriverApi:
    """The few cuda.bindings.driver calls Driver.launch makes; the launch reads its parameters back."""

    def __init__(self, err=0):
        self.err, self.seen = err, None

    @staticmethod
    def CUstream(handle):
        return ("stream", handle)

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        ptrs = np.frombuffer(ctypes.string_at(params, 8 * 4), np.uint64)
        values = (ctypes.c_uint64.from_address(int(ptrs[0])).value, ctypes.c_int32.from_address(int(ptrs[1])).value,
                  ctypes.c_int64.from_address(int(ptrs[2])).value, ctypes.c_float.from_address(int(ptrs[3])).value)
        self.seen = (f, (gx, gy, gz), (bx, by, bz), smem, stream, values, extra)
        return (self.err,)


def _driver(err=0):
    tool = load_tool("fatbin_driver")
    dev = object.__new__(tool.Driver)           # no torch, no GPU: only what launch() reads
    dev.cu = StubDriverApi(err)
    dev.stream = type("S", (), {"cuda_stream": 77})()
    return dev


def test_launch_packs_each_kind_in_its_c_type():
    dev = _driver()
    dev.launch("fn", (3, 2), 256, [("P", 0xDEADBEEF00), ("i", -5), ("q", 1 << 40), ("f", 1.5)])
    f, grid, block, smem, stream, values, extra = dev.cu.seen
    assert (f, grid, block, smem, stream, extra) == ("fn", (3, 2, 1), (256, 1, 1), 0, ("stream", 77), 0)
    assert values == (0xDEADBEEF00, -5, 1 << 40, 1.5)
    dev.launch("fn", 9, 128, [("P", 1), ("i", 2), ("q", 3), ("f", 4.0)])
    assert dev.cu.seen[1] == (9, 1, 1)


def test_a_driver_error_raises_with_its_code():
    with pytest.raises(RuntimeError, match="CUDA driver error 700"):
        _driver(err=700).launch("fn", 1, 32, [("P", 1), ("i", 2), ("q", 3), ("f", 4.0)])
