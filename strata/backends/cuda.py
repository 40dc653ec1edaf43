"""CUDA ops over strata._ext.runtime: device buffers and launches of the kernels in cuda/.

Importing this module touches no CUDA library; the runtime extension is imported on first use, so
the package works (CPU-only) where it was built without the extension, the driver or a GPU.
"""

from __future__ import annotations

import numpy as np

from strata.errors import DeviceError, InvalidArgument

RMS_NORM_BLOCK = 256  # threads per row; cuda/rms_norm.cu accepts any multiple of 32 up to 1024


def _runtime():
    try:
        from strata._ext import runtime
    except ImportError as exc:
        hint = " (pip install cuda-bindings)" if (exc.name or "").startswith("cuda") else ""
        raise DeviceError(f"strata._ext.runtime not available ({exc}){hint}; this install is CPU-only") from None
    return runtime


def unavailable_reason(device: int = 0) -> str | None:
    """Why CudaOps cannot run here (no extension, driver, GPU or built kernels); None when it can."""
    try:
        rt = _runtime()
        count = rt.device_count()
        if device >= count:
            return f"CUDA device {device} not found ({count} visible)"
        rt.read_manifest()
    except (DeviceError, ImportError, OSError, RuntimeError) as exc:
        return str(exc)
    return None


def cuda_available(device: int = 0) -> bool:
    """True when a GPU, its driver, the runtime extension and the kernels are all present."""
    return unavailable_reason(device) is None


def device_info(device: int = 0) -> dict:
    """Name, compute capability, memory and driver version of one GPU; DeviceError if there is none."""
    rt = _runtime()
    dev = rt.Device(device)
    free_bytes, total_bytes = dev.memory_info()
    major, minor = dev.compute_capability
    version = rt.driver_version()
    return {
        "device": device,
        "name": dev.name,
        "compute_capability": f"{major}.{minor}",
        "multiprocessor_count": dev.multiprocessor_count,
        "total_memory_bytes": total_bytes,
        "free_memory_bytes": free_bytes,
        "driver_cuda_version": f"{version // 1000}.{version % 1000 // 10}",
    }


class CudaOps:
    """Ops on one GPU. Each call uploads its inputs and downloads its output: this proves the path
    from numpy to a kernel and back; the engine keeps its tensors on the device."""

    def __init__(self, device: int = 0):
        rt = _runtime()
        self.device = rt.Device(device)
        self.stream = rt.Stream(self.device)
        self._rt = rt
        self._rms_norm_f32 = rt.load_library("rms_norm").kernel(self.device, "strata_rms_norm_f32", "PPPiif")

    def _upload(self, array: np.ndarray):
        buf = self._rt.DeviceBuffer(self.device, array.nbytes)
        buf.copy_from_host(array, self.stream)
        return buf

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """x * rsqrt(mean(x^2, axis=-1) + eps) * w in float32; x [..., n], w [n]."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if x.ndim < 1 or w.shape != x.shape[-1:]:
            raise InvalidArgument(f"rms_norm: weight shape {w.shape} does not match x shape {x.shape}")
        n = x.shape[-1]
        rows = x.size // n if n else 0
        if not 0 < n < 2**31 or rows >= 2**31:
            raise InvalidArgument(f"rms_norm: x shape {x.shape} needs 1 <= n < 2^31 and rows < 2^31")
        y = np.empty_like(x)
        if rows == 0:
            return y
        x_dev, w_dev = self._upload(x), self._upload(w)
        y_dev = self._rt.DeviceBuffer(self.device, y.nbytes)
        self._rms_norm_f32.launch(rows, RMS_NORM_BLOCK, (x_dev, w_dev, y_dev, rows, n, float(eps)),
                                  stream=self.stream)
        y_dev.copy_to_host(y, self.stream)
        self.stream.synchronize()
        return y
