"""The GPU backend: strata._ext.runtime (the CUDA driver API in typed Cython) and the kernels of cuda/.

- kernels.py: KERNELS, the table of every entry point the host launches (library, entry pattern,
  signature, block), and limits
- memory.py: the device pool, device tensors, weights and the KV cache
- ops.py: DeviceOps, the model's ops interface over device tensors (what the engine runs), with
  ops_dense.py and ops_attention.py
- moe.py, moe_decode.py, moe_gemm.py, attention_tc.py, sample.py: launch shapes and tables of the
  bigger kernels
- testing.py: CudaOps, numpy-in/out wrappers of single kernels for tests and tools, with
  testing_attention.py and testing_quant.py

Importing this package touches no CUDA library; the runtime extension is imported on first use, so
the package works (CPU-only) where it was built without the extension, the driver or a GPU.
"""

from __future__ import annotations

from strata.errors import DeviceError


def _runtime():
    try:
        from strata._ext import runtime
    except ImportError as exc:
        hint = " (pip install cuda-bindings)" if (exc.name or "").startswith("cuda") else ""
        raise DeviceError(f"strata._ext.runtime not available ({exc}){hint}; this install is CPU-only") from None
    return runtime


def _graphs():
    """strata._ext.graphs (stream capture, CUDA graphs), imported on first use like the runtime."""
    try:
        from strata._ext import graphs
    except ImportError as exc:
        raise DeviceError(f"strata._ext.graphs not available ({exc}); rebuild the package for CUDA graphs") from None
    return graphs


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
