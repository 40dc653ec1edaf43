"""Build steps pyproject.toml cannot express: nvcc fatbins for cuda/*.cu and the Cython runtime.

Kernels: every cuda/<op>.cu becomes strata/kernels/<op>.fatbin (SASS for each arch in SASS_ARCHS,
PTX for the lowest), recorded in strata/kernels/manifest.json with its sha256, archs, nvcc flags and
nvcc version; the runtime refuses a fatbin whose hash differs. STRATA_CUDA_ARCHS narrows the archs
("90", "80,90", "90a"; "none" skips the kernels). Without nvcc the package builds CPU-only.

Runtime: strata/_ext/*.pyx (runtime; graphs, which cimports runtime.pxd) compile as C++ against
cuda.bindings.cydriver, which needs cuda.h (CUDA toolkit, or the nvidia-cuda-runtime wheel) but never
libcuda: cydriver finds the driver at run time. Without cuda.h, or if the compile fails, the package
still installs CPU-only.
"""

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CUDA_SRC = ROOT / "cuda"
SASS_ARCHS = ("80", "86", "89", "90", "100", "120")
NVCC_FLAGS = ("-fatbin", "-O3", "-std=c++17", "--threads=0")
MANIFEST_FORMAT = 1


def note(msg: str) -> None:
    print(f"strata build: {msg}", file=sys.stderr, flush=True)


def cuda_home_candidates() -> list[Path]:
    roots = [os.environ.get(k) for k in ("CUDA_HOME", "CUDA_PATH")]
    return [Path(r) for r in roots if r] or [Path("/usr/local/cuda")]


def find_nvcc() -> str | None:
    """CUDA_HOME/CUDA_PATH's nvcc when either is set (CUDA_HOME=/none builds without kernels),
    else nvcc on PATH, else /usr/local/cuda's."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        nvcc = cuda_home_candidates()[0] / "bin" / "nvcc"
        return str(nvcc) if nvcc.is_file() else None
    default = Path("/usr/local/cuda/bin/nvcc")
    return shutil.which("nvcc") or (str(default) if default.is_file() else None)


def find_cuda_include() -> tuple[list[str], str]:
    """(include dirs holding cuda.h, newest first; or [] and why none fits). Searched: CUDA_HOME or
    CUDA_PATH, nvcc's toolkit, pip's nvidia-cuda-runtime wheels. Cython writes out every typedef of
    cydriver.pxd, so the newest cuda.h must be at least as new as cuda-bindings; the older dirs
    still serve headers the wheel lacks (cudaProfiler.h, for older cuda-bindings)."""
    dirs = [root / "include" for root in cuda_home_candidates()]
    nvcc = find_nvcc()
    if nvcc:  # /usr/local/bin/nvcc may be a wrapper script: ask nvcc where its headers are
        dirs.extend(nvcc_include_dirs(nvcc))
    for entry in sys.path:
        dirs.extend(Path(entry or ".") / "nvidia" / sub / "include" for sub in ("cu13", "cu14", "cuda_runtime"))
    found = {d.resolve(): v for d in dirs if (v := cuda_h_version(d))}
    if not found:
        return [], "cuda.h not found (no CUDA toolkit, no nvidia-cuda-runtime wheel)"
    ordered = sorted(found, key=found.get, reverse=True)
    newest, need = found[ordered[0]], bindings_version()
    if need and newest < need:
        return [], (f"newest cuda.h ({ordered[0]}) is CUDA {newest // 1000}.{newest % 1000 // 10}, "
                    f"older than cuda-bindings {need // 1000}.{need % 1000 // 10} "
                    f"(pip install 'nvidia-cuda-runtime=={need // 1000}.{need % 1000 // 10}.*')")
    return [str(d) for d in ordered], ""


def cuda_h_version(include: Path) -> int:
    try:
        m = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", (include / "cuda.h").read_text(errors="replace"))
    except OSError:
        return 0
    return int(m.group(1)) if m else 0


def bindings_version() -> int:
    """cuda-bindings' version in CUDA_VERSION form (13.5.0 -> 13050); 0 if unknown."""
    try:
        from cuda.bindings import __version__
    except ImportError:
        return 0
    m = re.match(r"(\d+)\.(\d+)", __version__)
    return int(m.group(1)) * 1000 + int(m.group(2)) * 10 if m else 0


def nvcc_include_dirs(nvcc: str) -> list[Path]:
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60).stderr
    except (OSError, subprocess.SubprocessError):
        return []
    return [Path(p) for p in re.findall(r'-I"?([^"\s]+)', out)]


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def parse_archs(text: str | None) -> list[str]:
    """STRATA_CUDA_ARCHS -> SASS archs; empty = the full list, [] for 'none'."""
    if not text or not text.strip():
        return list(SASS_ARCHS)
    if text.strip().lower() in ("none", "off", "0"):
        return []
    archs = [a.strip().removeprefix("sm_") for a in text.split(",") if a.strip()]
    bad = [a for a in archs if not re.fullmatch(r"\d{2,3}[af]?", a)]
    if bad:
        raise SystemExit(f"strata build: STRATA_CUDA_ARCHS={text!r}: {bad[0]!r} is not an arch like 90 or 90a")
    return archs


def gencode_flags(archs: list[str]) -> tuple[list[str], list[str]]:
    """nvcc -gencode flags and the manifest's arch names: SASS for each, PTX for the lowest plain arch."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    names = [f"sm_{a}" for a in archs]
    plain = sorted((a for a in archs if a.isdigit()), key=int)
    if plain:  # PTX of the oldest arch lets a newer GPU JIT the kernel
        flags.append(f"-gencode=arch=compute_{plain[0]},code=compute_{plain[0]}")
        names.append(f"compute_{plain[0]}")
    return flags, names


def source_sha256(cu: Path) -> str:
    """Hash of the .cu and every header beside it: a header change rebuilds all kernels."""
    h = hashlib.sha256()
    for path in [cu] + sorted(p for p in CUDA_SRC.iterdir() if p.suffix in (".h", ".cuh")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compile_kernel(nvcc: str, version: str, cu: Path, out_dir: Path, archs: list[str], old: dict) -> dict:
    gencode, arch_names = gencode_flags(archs)
    flags = list(NVCC_FLAGS) + gencode
    out = out_dir / f"{cu.stem}.fatbin"
    entry = {"file": out.name, "archs": arch_names, "nvcc_flags": flags, "nvcc_version": version,
             "source_sha256": source_sha256(cu)}
    if out.is_file() and old.get("sha256") == file_sha256(out) and all(old.get(k) == v for k, v in entry.items()):
        return old  # unchanged source, flags and compiler: keep the fatbin
    cmd = [nvcc, *flags, "-o", str(out), str(cu)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"strata build: nvcc failed on {cu.relative_to(ROOT)}:\n{proc.stderr}")
    entry["sha256"] = file_sha256(out)
    return entry


def build_kernels(out_dir: Path) -> None:
    """cuda/*.cu -> out_dir/<op>.fatbin + manifest.json; without nvcc, out_dir is left with no kernels."""
    sources = sorted(CUDA_SRC.glob("*.cu"))
    archs = parse_archs(os.environ.get("STRATA_CUDA_ARCHS"))
    nvcc = find_nvcc()
    manifest_path = out_dir / "manifest.json"
    if not sources or not archs or nvcc is None:
        why = "STRATA_CUDA_ARCHS=none" if not archs else "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
        if sources:
            note(f"{why}: GPU kernels not built, this install is CPU-only")
        for stale in [manifest_path, *out_dir.glob("*.fatbin")]:  # what an earlier build left
            stale.unlink(missing_ok=True)
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    old = json.loads(manifest_path.read_text()).get("kernels", {}) if manifest_path.is_file() else {}
    version, t0 = nvcc_version(nvcc), time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(len(sources), os.cpu_count() or 1)) as pool:
        entries = pool.map(lambda cu: compile_kernel(nvcc, version, cu, out_dir, archs, old.get(cu.stem, {})),
                           sources)
        kernels = dict(zip((cu.stem for cu in sources), entries))
    for stale in set(p.stem for p in out_dir.glob("*.fatbin")) - set(kernels):
        (out_dir / f"{stale}.fatbin").unlink()
    manifest = {"format": MANIFEST_FORMAT, "kernels": kernels}
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    note(f"{len(kernels)} fatbin(s) for {','.join(archs)} with nvcc {version} "
         f"in {time.perf_counter() - t0:.1f} s")


class BuildPyWithKernels(build_py):
    """Compile the kernels into the package: the source tree's strata/kernels for an editable
    install, the build directory otherwise (so a wheel never picks up a stale local build)."""

    def run(self):
        if self.editable_mode:
            out_dir = ROOT / "strata" / "kernels"
        else:
            out_dir = Path(self.build_lib) / "strata" / "kernels"
        build_kernels(out_dir)
        super().run()


class OptionalBuildExt(build_ext):
    """A runtime that cannot compile leaves a CPU-only install, with one line saying why."""

    def run(self):
        include_dirs, why = find_cuda_include()
        if not include_dirs:
            note(f"{why}: strata._ext not built, this install is CPU-only")
            return
        for ext in self.extensions:
            ext.include_dirs.extend(include_dirs)
        super().run()

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # compiler errors come as several distutils/setuptools types
            first = str(exc).splitlines()[0][:160] if str(exc) else ""
            note(f"{ext.name} not built ({type(exc).__name__}: {first}): this install is CPU-only")


def extensions() -> list[Extension]:
    try:
        from Cython.Build import cythonize
    except ImportError:
        note("Cython not found: strata._ext not built, this install is CPU-only")
        return []
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        note("cuda-bindings not found: strata._ext not built, this install is CPU-only")
        return []
    exts = [Extension(f"strata._ext.{pyx.stem}", [str(pyx.relative_to(ROOT))], language="c++",
                      extra_compile_args=["-std=c++17", "-O2"], optional=True)
            for pyx in sorted((ROOT / "strata" / "_ext").glob("*.pyx"))]
    directives = {"language_level": 3, "boundscheck": False, "wraparound": False, "embedsignature": True}
    try:
        exts = cythonize(exts, compiler_directives=directives, quiet=True)
    except Exception as exc:  # Cython.Compiler.Errors.CompileError; Cython has printed the details
        note(f"Cython failed on {exc}: strata._ext not built, this install is CPU-only")
        return []
    for ext in exts:
        ext.optional = True  # cythonize drops it; setuptools then skips copying a failed module in place
    return exts


setup(
    ext_modules=extensions(),
    cmdclass={"build_py": BuildPyWithKernels, "build_ext": OptionalBuildExt},
)
