"""Build steps pyproject.toml cannot express: nvcc fatbins for cuda/*.cu and the Cython runtime.

Kernels: every cuda/<op>.cu becomes strata/kernels/<op>.fatbin (SASS for each chosen arch, PTX for
the lowest), recorded in strata/kernels/manifest.json with its sha256, archs, nvcc flags and nvcc
version; the runtime refuses a fatbin whose hash differs. Which archs: STRATA_CUDA_ARCHS unset (or
"auto") = the GPUs present at build time (nvidia-smi, else the driver API), none present = no
kernels; "all" = every arch in SASS_ARCHS (distribution wheels); "90", "80,90", "90a" = those;
"none" = no kernels. Without nvcc the package builds CPU-only.

Runtime: strata/_ext/*.pyx (runtime; graphs, which cimports runtime.pxd) compile as C++ against
cuda.bindings.cydriver, which needs cuda.h (CUDA toolkit, or the nvidia-cuda-runtime wheel) but never
libcuda: cydriver finds the driver at run time. Without cuda.h, or if the compile fails, the package
still installs CPU-only.

pip hides a build backend's stdout and stderr, so what the build is doing (and how long it should
take) goes to the terminal (/dev/tty) when one can be opened, else to stderr.
"""

import ctypes
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CUDA_SRC = ROOT / "cuda"
SASS_ARCHS = ("80", "86", "89", "90", "100", "120")  # STRATA_CUDA_ARCHS=all
OLDEST_ARCH = 80  # the kernels use sm_80 instructions (attention_tc.cu: cp.async)
# Libraries built for one arch-specific target only (SASS, no PTX), when the build's archs include
# its plain arch, and left out of other builds: wgmma needs sm_90a, whose code runs on sm_90 alone.
# The manifest marks them optional (strata.system does not refuse a GPU they do not run on).
ARCH_SPECIFIC = {"moe_gemm_ws": "90a", "attention_wg": "90a", "attention_ws": "90a"}
ARCH_SPECIFIC_NVCC = 12  # the oldest nvcc major that compiles sm_90a (wgmma came with PTX ISA 8.0)
NVCC_FLAGS = ("-fatbin", "-O3", "-std=c++17", "--threads=0")
MANIFEST_FORMAT = 1
# Core-seconds one nvcc target (every kernel for one SASS arch, or the PTX) took on a 2-core build
# machine: STRATA_CUDA_ARCHS=all (7 targets) ran 573 s there with nvcc 13.0. The build prints
# its estimate from this; moe_decode.cu alone is about a third of it. The Cython runtime took 35 s.
CPU_S_PER_TARGET = 164
LONGEST_TARGET_S = 60  # moe_decode.cu for one target: nvcc runs a file's targets on one thread each
CYTHON_ESTIMATE_S = 40


@functools.cache
def build_output():
    """The terminal when one can be opened (pip shows the backend's own output only on failure),
    else stderr."""
    try:
        return open("/dev/tty", "w", buffering=1)
    except OSError:
        return sys.stderr


def note(msg: str) -> None:
    out = build_output()
    out.write(f"strata build: {msg}\n")
    out.flush()


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


def requested_archs(text: str | None) -> list[str] | None:
    """STRATA_CUDA_ARCHS -> SASS archs: None = the GPUs present (unset, "" or "auto"), every arch
    for "all", [] for "none"."""
    word = (text or "").strip().lower()
    if word in ("", "auto"):
        return None
    if word == "all":
        return list(SASS_ARCHS)
    if word in ("none", "off", "0"):
        return []
    archs = [a.strip().removeprefix("sm_") for a in word.split(",") if a.strip()]
    bad = [a for a in archs if not re.fullmatch(r"\d{2,3}[af]?", a)]
    if bad:
        raise SystemExit(f"strata build: STRATA_CUDA_ARCHS={text!r}: {bad[0]!r} is not an arch "
                         f"like 90 or 90a (or all, auto, none)")
    return list(dict.fromkeys(archs))


def parse_compute_caps(text: str) -> list[str]:
    """nvidia-smi --query-gpu=compute_cap output ("9.0" a line) -> archs ("90"), sorted, unique."""
    caps = {f"{m.group(1)}{m.group(2)}" for m in re.finditer(r"^\s*(\d+)\.(\d+)\s*$", text, re.M)}
    return sorted(caps, key=int)


def smi_compute_caps() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_compute_caps(out.stdout) if out.returncode == 0 else []


def driver_compute_caps() -> list[str]:
    """The driver API's answer, for machines with a driver but no nvidia-smi (some containers)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return []
    count, major, minor, dev = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return []
    caps = set()
    for i in range(count.value):  # attributes 75, 76: CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, _MINOR
        if (cuda.cuDeviceGet(ctypes.byref(dev), i) == 0
                and cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) == 0
                and cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) == 0):
            caps.add(f"{major.value}{minor.value}")
    return sorted(caps, key=int)


def gpu_archs_present() -> list[str]:
    return smi_compute_caps() or driver_compute_caps()


def choose_archs(text: str | None, present=None) -> tuple[list[str], str]:
    """(SASS archs to build, why: a few words for the build's notes); present() lists the GPUs'
    archs (default: gpu_archs_present, asked only when STRATA_CUDA_ARCHS leaves it to them)."""
    archs = requested_archs(text)
    if archs is not None:
        return archs, f"STRATA_CUDA_ARCHS={text.strip()}"
    found = (present or gpu_archs_present)()
    usable = [a for a in found if int(a) >= OLDEST_ARCH]
    if found and not usable:
        return [], (f"the GPUs present ({', '.join('sm_' + a for a in found)}) are older than "
                    f"sm_{OLDEST_ARCH}, the oldest the kernels support")
    if not usable:
        return [], "no NVIDIA GPU found (set STRATA_CUDA_ARCHS=all, or e.g. 90, to build the kernels)"
    return usable, "the GPUs present"


def fit_to_nvcc(archs: list[str], known: set[str], asked: bool) -> list[str]:
    """A GPU newer than nvcc builds for the newest arch nvcc knows of the same major (its SASS runs
    there); an arch asked for by name that nvcc does not know is an error."""
    if not known:  # nvcc too old to list its archs: let nvcc itself judge
        return archs
    fitted = []
    for arch in archs:
        if arch.rstrip("af") in known:  # nvcc lists sm_90, not sm_90a
            fitted.append(arch)
            continue
        plain = arch.rstrip("af")
        same_major = [k for k in known if k.isdigit() and k[:-1] == plain[:-1] and int(k) <= int(plain)]
        if asked or not same_major:
            raise SystemExit(f"strata build: nvcc cannot compile for sm_{arch} (it knows "
                             f"{', '.join('sm_' + k for k in sorted(known, key=lambda k: int(k.rstrip('af'))))}); "
                             f"install a newer CUDA toolkit or set STRATA_CUDA_ARCHS")
        fitted.append(max(same_major, key=int))
        note(f"nvcc does not know sm_{arch}: building sm_{fitted[-1]}, which runs there")
    return list(dict.fromkeys(fitted))


def nvcc_known_archs(nvcc: str) -> set[str]:
    try:
        out = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return set()
    return set(re.findall(r"^sm_(\d+[af]?)\s*$", out.stdout, re.M)) if out.returncode == 0 else set()


def estimate_s(num_targets: int, num_cpus: int) -> float:
    num_cpus = max(1, num_cpus)
    return max(CPU_S_PER_TARGET * num_targets / num_cpus, LONGEST_TARGET_S * -(-num_targets // num_cpus))


def minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


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


def library_archs(stem: str, archs: list[str], nvcc_version_text: str = "") -> list[str] | None:
    """The archs to build cuda/<stem>.cu for: the build's, or the one target ARCH_SPECIFIC names
    for it; None when that target's plain arch is not among the build's, or nvcc is too old for it."""
    target = ARCH_SPECIFIC.get(stem)
    if target is None:
        return archs
    major = re.match(r"(\d+)\.", nvcc_version_text)
    if major and int(major.group(1)) < ARCH_SPECIFIC_NVCC:
        return None
    return [target] if target.rstrip("af") in {a.rstrip("af") for a in archs} else None


def compile_kernel(nvcc: str, version: str, cu: Path, out_dir: Path, archs: list[str], old: dict) -> dict:
    gencode, arch_names = gencode_flags(archs)
    flags = list(NVCC_FLAGS) + gencode
    out = out_dir / f"{cu.stem}.fatbin"
    entry = {"file": out.name, "archs": arch_names, "nvcc_flags": flags, "nvcc_version": version,
             "source_sha256": source_sha256(cu)}
    if cu.stem in ARCH_SPECIFIC:
        entry["optional"] = True
    if out.is_file() and old.get("sha256") == file_sha256(out) and all(old.get(k) == v for k, v in entry.items()):
        return old  # unchanged source, flags and compiler: keep the fatbin
    cmd = [nvcc, *flags, "-o", str(out), str(cu)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"strata build: nvcc failed on {cu.relative_to(ROOT)}:\n{proc.stderr}")
    entry["sha256"] = file_sha256(out)
    return entry


def build_kernels(out_dir: Path) -> None:
    """cuda/*.cu -> out_dir/<op>.fatbin + manifest.json; with no archs or no nvcc, out_dir is left
    with no kernels."""
    sources = sorted(CUDA_SRC.glob("*.cu"))
    env = os.environ.get("STRATA_CUDA_ARCHS")
    archs, why = choose_archs(env)
    nvcc = find_nvcc() if archs else None
    if archs and nvcc is None:
        why = "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    manifest_path = out_dir / "manifest.json"
    if not sources or nvcc is None:
        if sources:
            note(f"{why}: GPU kernels not built, this install is CPU-only")
        for stale in [manifest_path, *out_dir.glob("*.fatbin")]:  # what an earlier build left
            stale.unlink(missing_ok=True)
        return
    archs = fit_to_nvcc(archs, nvcc_known_archs(nvcc), asked=requested_archs(env) is not None)
    version, t0 = nvcc_version(nvcc), time.perf_counter()
    plan = {cu: library_archs(cu.stem, archs, version) for cu in sources}
    sources = [cu for cu in sources if plan[cu] is not None]
    out_dir.mkdir(parents=True, exist_ok=True)
    old = json.loads(manifest_path.read_text()).get("kernels", {}) if manifest_path.is_file() else {}
    targets = gencode_flags(archs)[1]
    workers = min(len(sources), os.cpu_count() or 1)
    note(f"compiling {len(sources)} CUDA kernel libraries for {', '.join(targets)} ({why}) with nvcc "
         f"{version} on {os.cpu_count()} cores: about {minutes(estimate_s(len(targets), os.cpu_count() or 1))}"
         f" (a rebuild keeps unchanged ones)")
    kernels = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        # the biggest sources first (the slowest to compile), so none starts last and runs alone
        jobs = {pool.submit(compile_kernel, nvcc, version, cu, out_dir, plan[cu], old.get(cu.stem, {})): cu
                for cu in sorted(sources, key=lambda cu: cu.stat().st_size, reverse=True)}
        for done in as_completed(jobs):
            cu = jobs[done]
            kernels[cu.stem] = done.result()
            note(f"  [{len(kernels)}/{len(sources)}] {cu.name} ({time.perf_counter() - t0:.0f} s)")
    kernels = dict(sorted(kernels.items()))
    for stale in set(p.stem for p in out_dir.glob("*.fatbin")) - set(kernels):
        (out_dir / f"{stale}.fatbin").unlink()
    manifest = {"format": MANIFEST_FORMAT, "kernels": kernels}
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    note(f"{len(kernels)} fatbin(s) for {', '.join(targets)} with nvcc {version} "
         f"in {time.perf_counter() - t0:.1f} s")


class BuildPyWithKernels(build_py):
    """Compile the kernels into the package: the source tree's strata/kernels for an editable
    install; for a wheel, build/kernels (kept, so cibuildwheel's builds for each Python version
    compile them once; compile_kernel reuses a fatbin only when its hash, source hash, flags and
    nvcc match) copied into the build directory, so a wheel never picks up the editable build's."""

    def run(self):
        if self.editable_mode:
            build_kernels(ROOT / "strata" / "kernels")
        else:
            cache = ROOT / "build" / "kernels"
            build_kernels(cache)
            out_dir = Path(self.build_lib) / "strata" / "kernels"
            for stale in [out_dir / "manifest.json", *out_dir.glob("*.fatbin")]:
                stale.unlink(missing_ok=True)
            if (cache / "manifest.json").is_file():
                out_dir.mkdir(parents=True, exist_ok=True)
                for path in [cache / "manifest.json", *cache.glob("*.fatbin")]:
                    shutil.copy2(path, out_dir / path.name)
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
        if self.extensions:
            note(f"compiling strata._ext ({', '.join(e.name.rsplit('.', 1)[1] for e in self.extensions)}: "
                 f"Cython C++ against cuda.h in {include_dirs[0]}): about {minutes(CYTHON_ESTIMATE_S)}")
        t0 = time.perf_counter()
        super().run()
        if self.extensions:
            note(f"strata._ext build finished in {time.perf_counter() - t0:.0f} s")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # compiler errors come as several distutils/setuptools types
            first = str(exc).splitlines()[0][:160] if str(exc) else ""
            note(f"{ext.name} not built ({type(exc).__name__}: {first}): this install is CPU-only")


CUDA_PYX = {"runtime", "graphs"}     # the modules that cimport cuda.bindings; the others build without it


def extensions() -> list[Extension]:
    try:
        from Cython.Build import cythonize
    except ImportError:
        note("Cython not found: strata._ext not built, this install is CPU-only")
        return []
    pyxs = sorted((ROOT / "strata" / "_ext").glob("*.pyx"))
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        note("cuda-bindings not found: strata._ext's GPU runtime not built, this install is CPU-only")
        pyxs = [p for p in pyxs if p.stem not in CUDA_PYX]
    exts = [Extension(f"strata._ext.{pyx.stem}", [str(pyx.relative_to(ROOT))], language="c++",
                      extra_compile_args=["-std=c++17", "-O2"], optional=True)
            for pyx in pyxs]
    directives = {"language_level": 3, "boundscheck": False, "wraparound": False, "embedsignature": True}
    try:
        exts = cythonize(exts, compiler_directives=directives, quiet=True)
    except Exception as exc:  # Cython.Compiler.Errors.CompileError; Cython has printed the details
        note(f"Cython failed on {exc}: strata._ext not built, this install is CPU-only")
        return []
    for ext in exts:
        ext.optional = True  # cythonize drops it; setuptools then skips copying a failed module in place
    return exts


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import its functions
    setup(
        ext_modules=extensions(),
        cmdclass={"build_py": BuildPyWithKernels, "build_ext": OptionalBuildExt},
    )
