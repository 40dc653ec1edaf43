"""What this machine offers Strata: NVIDIA driver, GPUs, the archs of the installed kernels, pinned
memory, CPU features, and whether the GPU path is usable (`python -m strata info --system`).

Probing only reads files and asks the CUDA runtime extension what it already knows; it never
compiles or loads a kernel. `gpu_unusable_reason()` is what device=auto and device=cuda decide on:
backends.cuda.unavailable_reason() (extension, driver, GPU, manifest) and, past it, whether the
installed fatbins hold code this GPU can run, each reason with its fix.
"""
from __future__ import annotations

import ctypes.util
import json
import os
import platform
import resource
import sys
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
NVIDIA_PROC_VERSION = Path("/proc/driver/nvidia/version")
_noted: set[str] = set()        # fallback reasons already said on stderr in this process


def nvidia_driver() -> str | None:
    """The NVIDIA kernel driver's version line, 'present' when only its library is found, or None."""
    try:
        line = NVIDIA_PROC_VERSION.read_text().splitlines()[0]
        words = line.split()
        return next((w for w in words if w[:1].isdigit() and "." in w), line.strip())
    except (OSError, IndexError):
        pass
    return "present (libcuda found)" if ctypes.util.find_library("cuda") else None


def read_kernel_manifest(directory: Path = KERNELS_DIR) -> dict | None:
    """manifest.json of the installed kernels, or None when this install has none."""
    try:
        return json.loads((directory / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def manifest_archs(manifest: dict | None) -> list[str]:
    """Every arch any installed fatbin holds (sm_XY SASS, compute_XY PTX), in order."""
    seen: dict[str, None] = {}
    for entry in (manifest or {}).get("kernels", {}).values():
        for arch in entry.get("archs", []):
            seen.setdefault(arch)
    return sorted(seen, key=lambda a: (int("".join(c for c in a if c.isdigit())), a))


def arch_runs_on(arch: str, major: int, minor: int) -> bool:
    """Whether code built for `arch` runs on a GPU of compute capability major.minor: SASS sm_XY on
    X.Y' with Y' >= Y (sm_XYa only on X.Y itself), PTX compute_XY on anything at or above X.Y."""
    kind, _, num = arch.partition("_")
    suffix = num[-1] if num and num[-1].isalpha() else ""
    digits = num.rstrip("af")
    if not digits.isdigit() or len(digits) < 2:
        return False
    a_major, a_minor = int(digits[:-1]), int(digits[-1])
    if kind == "compute":
        return (major, minor) >= (a_major, a_minor) and not suffix
    if suffix == "a":
        return (major, minor) == (a_major, a_minor)
    return major == a_major and minor >= a_minor


def kernels_reason(manifest: dict | None, major: int, minor: int, gpu_name: str = "this GPU") -> str | None:
    """Why the installed kernels cannot run on a GPU of compute capability major.minor (with the
    fix), or None when every fatbin holds code for it."""
    arch = f"{major}{minor}"
    fix = (f"reinstall with STRATA_CUDA_ARCHS={arch} (or STRATA_CUDA_ARCHS=all), e.g. "
           f"STRATA_CUDA_ARCHS={arch} pip install --force-reinstall .")
    if manifest is None:
        return f"this install has no GPU kernels (built without nvcc or for no arch); {fix}"
    kernels = manifest.get("kernels", {})      # a build that compiled nothing writes no manifest at all
    missing = sorted(n for n, e in kernels.items() if not e.get("optional")   # an arch-specific extra (setup.py)
                     and not any(arch_runs_on(a, major, minor) for a in e.get("archs", [])))
    if not missing:
        return None
    built = ", ".join(manifest_archs(manifest)) or "no arch"
    return (f"{gpu_name} is sm_{arch}, but the installed kernels ({len(missing)} of {len(kernels)}, e.g. "
            f"{missing[0]}) are built for {built} only; {fix}")


def _fix_for(reason: str) -> str:
    """The fix to add to a backends.cuda.unavailable_reason() text that names none."""
    if "not available" in reason or "pip install" in reason:
        return ""                                 # the extension's own message names the fix
    if "built without nvcc" in reason:
        return "; reinstall with nvcc on PATH and STRATA_CUDA_ARCHS=<your GPU's arch, like 90> (or =all)"
    if "cuInit" in reason or "driver" in reason:
        return "; install or repair the NVIDIA driver (nvidia-smi must work)"
    if "not found" in reason:
        return "; check --gpus and CUDA_VISIBLE_DEVICES"
    return ""


def gpu_unusable_reason(ordinal: int = 0) -> str | None:
    """Why the GPU path cannot run on GPU `ordinal` here, with the fix; None when it can."""
    from .backends import cuda
    reason = cuda.unavailable_reason(ordinal)
    if reason is not None:
        return reason + _fix_for(reason)
    try:
        info = cuda.device_info(ordinal)
    except Exception:       # unavailable_reason's verdict stands; the runner's own open says what fails
        return None
    major, minor = (int(x) for x in info["compute_capability"].split("."))
    manifest = cuda._runtime().read_manifest()      # the manifest unavailable_reason() just read
    return kernels_reason(manifest, major, minor, info["name"])


def note_cpu_fallback(reason: str) -> None:
    """device=auto chose the CPU: where an NVIDIA driver is present that is likely a surprise, so say
    why (and the fix) on stderr, once per process."""
    if reason in _noted or nvidia_driver() is None:
        return
    _noted.add(reason)
    print(f"strata: device auto: an NVIDIA driver is present but the GPU path is not usable, so the CPU "
          f"runs the model: {reason}", file=sys.stderr, flush=True)


# ---- the report --------------------------------------------------------------------------------

def host_memory() -> tuple[int | None, int | None]:
    """(total, available) host memory in bytes from /proc/meminfo (None where unknown)."""
    values = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return values.get("MemTotal"), values.get("MemAvailable")


def cpu_features() -> list[str]:
    """The SIMD features numpy detected on this CPU (its own dispatch list)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as found
    except ImportError:
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as found
        except ImportError:
            return []
    return [k for k, v in found.items() if v]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:.1f} GiB"


def _memlock() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:,.0f} MiB"


def _gpu_lines() -> tuple[list[str], str | None]:
    """(one line per visible GPU, why none can be listed or None)."""
    from .backends import cuda
    try:
        rt = cuda._runtime()
        count = rt.device_count()
    except Exception as exc:      # DeviceError, or the bindings' own errors without a driver
        return [], str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    lines = []
    for i in range(count):
        try:
            d = cuda.device_info(i)
            lines.append(f"GPU {i}: {d['name']}, sm_{d['compute_capability'].replace('.', '')}, "
                         f"{_gib(d['total_memory_bytes'])} ({_gib(d['free_memory_bytes'])} free), "
                         f"{d['multiprocessor_count']} SMs, driver CUDA {d['driver_cuda_version']}")
        except Exception as exc:
            lines.append(f"GPU {i}: cannot be queried ({exc})")
    return lines, None if lines else "no GPU visible (CUDA_VISIBLE_DEVICES?)"


def system_report(ordinal: int | list = 0, pin_limit_gib: float = 0.0) -> str:
    """What this machine offers Strata; ordinal: the GPU (or GPUs of a layer split) --gpus names."""
    import numpy as np

    manifest = read_kernel_manifest()
    driver = nvidia_driver()
    gpus, no_gpus = _gpu_lines()
    archs = manifest_archs(manifest)
    nvcc = sorted({e.get("nvcc_version", "?") for e in (manifest or {}).get("kernels", {}).values()})
    total, avail = host_memory()
    ordinals = sorted(set(ordinal)) if isinstance(ordinal, (list, tuple)) else [ordinal]
    rows = [
        f"strata at {Path(__file__).parent} (Python {platform.python_version()}, numpy {np.__version__}, "
        f"{platform.system()} {platform.machine()})",
        f"NVIDIA driver: {driver or 'not found (no /proc/driver/nvidia/version, no libcuda)'}",
        *(gpus or [f"GPUs: none ({no_gpus})"]),
        (f"installed kernels: {len((manifest or {}).get('kernels', {}))} fatbins for {', '.join(archs)} "
         f"(nvcc {', '.join(nvcc)})" if archs else "installed kernels: none in this install"),
        f"pinned memory: locked-memory limit (ulimit -l) {_memlock()}; --pin-limit-gib "
        f"{pin_limit_gib:g} ({'all the system allows' if not pin_limit_gib else 'the cap on pinned experts'})",
        f"host memory: {_gib(total)} ({_gib(avail)} available)",
        f"CPU: {_cpu_name()}, {os.cpu_count()} logical cores; SIMD: {' '.join(cpu_features()) or 'unknown'}",
    ]
    for o in ordinals:
        reason = gpu_unusable_reason(o)
        rows.append(f"GPU path: usable on GPU {o}" if reason is None else f"GPU path: not usable on GPU {o}: {reason}")
    return "\n".join(rows)
