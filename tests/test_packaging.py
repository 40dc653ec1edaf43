"""The build's choices (which archs, what it prints, where it prints), the package metadata and the
wheel checker, tested without a GPU and without the real nvcc (a fake nvcc stands in)."""

import hashlib
import importlib.util
import io
import json
import struct
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parent.parent


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def build(monkeypatch):
    """setup.py as a module (it calls setup() only as __main__), its notes captured."""
    module = load("strata_setup", ROOT / "setup.py")
    out = io.StringIO()
    monkeypatch.setattr(module, "build_output", lambda: out)
    module.out = out
    return module


@pytest.fixture
def checker():
    return load("check_wheel", ROOT / "ci" / "check_wheel.py")


def no_gpu_query():
    raise AssertionError("the GPUs present were asked although STRATA_CUDA_ARCHS names the archs")


def test_archs_named_or_all_or_none(build):
    assert build.choose_archs("all", no_gpu_query)[0] == list(build.SASS_ARCHS)
    assert build.choose_archs(" none ", no_gpu_query)[0] == []
    assert build.choose_archs("sm_90, 80,90", no_gpu_query) == (["90", "80"], "STRATA_CUDA_ARCHS=sm_90, 80,90")
    assert build.choose_archs("90a", no_gpu_query)[0] == ["90a"]
    with pytest.raises(SystemExit, match=r"STRATA_CUDA_ARCHS='90,ampere': 'ampere' is not an arch"):
        build.choose_archs("90,ampere", no_gpu_query)


@pytest.mark.parametrize("env", [None, "", "auto", " AUTO "])
def test_default_builds_for_the_gpus_present(build, env):
    assert build.choose_archs(env, lambda: ["86", "90"]) == (["86", "90"], "the GPUs present")
    archs, why = build.choose_archs(env, lambda: [])
    assert archs == [] and "no NVIDIA GPU found" in why and "STRATA_CUDA_ARCHS=all" in why


def test_gpus_older_than_the_kernels_are_left_out(build):
    assert build.choose_archs(None, lambda: ["75", "90"])[0] == ["90"]
    archs, why = build.choose_archs(None, lambda: ["75"])
    assert archs == [] and "sm_75" in why and "older than sm_80" in why


def test_nvidia_smi_output_parsed(build):
    assert build.parse_compute_caps("9.0\n8.6\n9.0\n12.0\n") == ["86", "90", "120"]
    assert build.parse_compute_caps("[N/A]\n\nNo devices were found\n") == []


def test_no_driver_means_no_gpu(build, monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(build.subprocess, "run", missing)
    monkeypatch.setattr(build.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(name)))
    assert build.gpu_archs_present() == []


def test_nvcc_fits_a_newer_gpu_and_refuses_an_unknown_named_arch(build):
    known = {"75", "80", "86", "89", "90", "100", "120"}
    assert build.fit_to_nvcc(["90a", "120"], known, asked=True) == ["90a", "120"]
    assert build.fit_to_nvcc(["121"], known, asked=False) == ["120"]
    assert "building sm_120" in build.out.getvalue()
    with pytest.raises(SystemExit, match="nvcc cannot compile for sm_121"):
        build.fit_to_nvcc(["121"], known, asked=True)
    with pytest.raises(SystemExit, match="nvcc cannot compile for sm_130"):
        build.fit_to_nvcc(["130"], known, asked=False)  # no same-major SASS would run there
    assert build.fit_to_nvcc(["130"], set(), asked=True) == ["130"]  # nvcc lists none: nvcc judges


def test_all_is_sm80_to_sm120_with_ptx_for_the_oldest(build):
    flags, names = build.gencode_flags(list(build.SASS_ARCHS))
    assert names == ["sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "compute_80"]
    assert flags[-1] == "-gencode=arch=compute_80,code=compute_80"


def test_notes_go_to_the_terminal_when_one_opens(monkeypatch):
    module = load("strata_setup_tty", ROOT / "setup.py")
    opened = []

    def fake_open(path, *args, **kwargs):
        opened.append(path)
        if path == "/dev/tty":
            return io.StringIO()
        raise AssertionError(path)

    monkeypatch.setattr("builtins.open", fake_open)
    assert isinstance(module.build_output.__wrapped__(), io.StringIO) and opened == ["/dev/tty"]

    def no_tty(path, *args, **kwargs):
        raise OSError(6, "No such device or address", path)

    monkeypatch.setattr("builtins.open", no_tty)
    assert module.build_output.__wrapped__() is sys.stderr


FAKE_NVCC = """#!/usr/bin/env python3
import sys
from pathlib import Path
args = sys.argv[1:]
log = Path(__file__).with_name("calls.log")
if args == ["--version"]:
    print("Cuda compilation tools, release 13.0, V13.0.88")
elif args == ["--list-gpu-code"]:
    print("\\n".join(["sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"]))
else:
    out = Path(args[args.index("-o") + 1])
    with log.open("a") as f:
        f.write(Path(args[-1]).name + "\\n")
    out.write_bytes(" ".join(a for a in args if a.startswith("-gencode")).encode() + Path(args[-1]).read_bytes())
"""


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    return bin_dir / "calls.log"


def calls(log: Path) -> list[str]:
    return log.read_text().split() if log.is_file() else []


def test_build_says_what_it_compiles_and_keeps_unchanged_kernels(build, fake_nvcc, tmp_path, monkeypatch):
    sources = sorted(p.name for p in (ROOT / "cuda").glob("*.cu"))
    out_dir = tmp_path / "kernels"
    monkeypatch.setenv("STRATA_CUDA_ARCHS", "80,90")
    build.build_kernels(out_dir)
    notes = build.out.getvalue()
    assert f"compiling {len(sources)} CUDA kernel libraries for sm_80, sm_90, compute_80" in notes
    assert "(STRATA_CUDA_ARCHS=80,90) with nvcc 13.0.88" in notes and "about " in notes
    assert f"[{len(sources)}/{len(sources)}]" in notes
    assert sorted(calls(fake_nvcc)) == sources
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert sorted(manifest["kernels"]) == [s.removesuffix(".cu") for s in sources]
    for lib, entry in manifest["kernels"].items():      # an arch-specific library: its one target
        special = lib in build.ARCH_SPECIFIC
        assert entry["archs"] == ([f"sm_{build.ARCH_SPECIFIC[lib]}"] if special else ["sm_80", "sm_90", "compute_80"])
        assert entry.get("optional", False) == special
        assert hashlib.sha256((out_dir / entry["file"]).read_bytes()).hexdigest() == entry["sha256"]

    build.build_kernels(out_dir)  # nothing changed: nothing compiled again
    assert len(calls(fake_nvcc)) == len(sources)
    monkeypatch.setenv("STRATA_CUDA_ARCHS", "90")
    build.build_kernels(out_dir)  # other archs: every kernel again, but the arch-specific ones (the same target)
    assert len(calls(fake_nvcc)) == 2 * len(sources) - len(build.ARCH_SPECIFIC)
    assert json.loads((out_dir / "manifest.json").read_text())["kernels"]["add"]["archs"] == ["sm_90", "compute_90"]
    monkeypatch.setenv("STRATA_CUDA_ARCHS", "80")
    build.build_kernels(out_dir)  # no sm_90: no arch-specific library, and no stale fatbin of one
    kept = json.loads((out_dir / "manifest.json").read_text())["kernels"]
    assert not set(build.ARCH_SPECIFIC) & set(kept)
    assert not [lib for lib in build.ARCH_SPECIFIC if (out_dir / f"{lib}.fatbin").exists()]


def test_arch_specific_libraries_need_their_arch_and_a_new_enough_nvcc(build):
    lib, target = next(iter(build.ARCH_SPECIFIC.items()))
    assert build.library_archs("add", ["80", "90"], "13.0.88") == ["80", "90"]
    assert build.library_archs(lib, ["80", "90"], "13.0.88") == [target]
    assert build.library_archs(lib, ["90a"], "12.4.131") == [target]
    assert build.library_archs(lib, ["80", "120"], "13.0.88") is None
    assert build.library_archs(lib, ["90"], "11.8.89") is None     # sm_90a came with CUDA 12


def test_no_gpu_builds_no_kernels_and_says_so(build, fake_nvcc, tmp_path, monkeypatch):
    out_dir = tmp_path / "kernels"
    out_dir.mkdir()
    (out_dir / "manifest.json").write_text("{}")  # an earlier build's
    (out_dir / "add.fatbin").write_bytes(b"old")
    monkeypatch.delenv("STRATA_CUDA_ARCHS", raising=False)
    monkeypatch.setattr(build, "gpu_archs_present", lambda: [])
    build.build_kernels(out_dir)
    assert calls(fake_nvcc) == [] and list(out_dir.iterdir()) == []
    assert "no NVIDIA GPU found" in build.out.getvalue() and "this install is CPU-only" in build.out.getvalue()


def test_estimate_scales_with_targets_and_cores(build):
    assert build.estimate_s(7, 2) == pytest.approx(573, rel=0.05)  # the all-arch build measured
    assert build.estimate_s(2, 16) < build.estimate_s(2, 2) < build.estimate_s(7, 2)
    assert build.estimate_s(2, 64) == build.LONGEST_TARGET_S  # many cores: the slowest kernel bounds it
    assert build.minutes(45) == "45 s" and build.minutes(600) == "10 min"


def test_metadata_makes_pip_install_complete():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bindings = [d for d in project["dependencies"] if d.startswith("cuda-bindings")]
    assert bindings and "sys_platform == 'linux'" in bindings[0]  # not only in an extra
    assert project["license"] == "MIT" and project["readme"] == "README.md"
    assert "Copyright (c) " in (ROOT / "LICENSE").read_text() and "the Strata authors" in (ROOT / "LICENSE").read_text()
    assert "urls" not in project  # no public home yet
    versions = {c.rsplit(":: ", 1)[1] for c in project["classifiers"] if c.startswith("Programming Language :: Python :: 3.")}
    cibw = tomllib.loads((ROOT / "ci" / "cibuildwheel.toml").read_text())["tool"]["cibuildwheel"]
    assert {f"cp{v.replace('.', '')}-*" for v in versions} == set(cibw["build"].split())
    assert set(cibw["linux"]["archs"]) == {"x86_64", "aarch64"}
    assert cibw["linux"]["environment"]["STRATA_CUDA_ARCHS"] == "all"
    assert "--exclude 'libcuda.so*'" in cibw["linux"]["repair-wheel-command"]


# --- the wheel checker, on synthetic wheels ---------------------------------------------------------

def fatbin(targets: list[tuple[int, int]]) -> bytes:
    """A container in nvcc's layout: (kind, arch) entries with 32-byte headers and small payloads."""
    body = b""
    for kind, arch in targets:
        payload = bytes(range(kind, kind + 40))
        body += struct.pack("<HHIQIIHHI", kind, 0x101, 32, len(payload), 0, 0, 0, 0, arch) + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def make_wheel(tmp_path: Path, archs=((2, 80), (2, 90), (1, 80)), tag="manylinux_2_28_x86_64", **edits) -> Path:
    names = {(2, a): f"sm_{a}" for _, a in archs} | {(1, a): f"compute_{a}" for _, a in archs}
    files, kernels = {}, {}
    special = load("check_wheel", ROOT / "ci" / "check_wheel.py").arch_specific(ROOT)
    for cu in sorted((ROOT / "cuda").glob("*.cu")):
        entry = {"file": f"{cu.stem}.fatbin"}
        if cu.stem in special:          # setup.library_archs: its one target, when its plain arch is built
            target = special[cu.stem]
            if (2, int(target.rstrip("af"))) not in archs:
                continue
            image = fatbin([(2, int(target.rstrip("af")))])
            entry.update(archs=[f"sm_{target}"], optional=True)
        else:
            image = fatbin(list(archs))
            entry["archs"] = [names[t] for t in archs]
        files[f"strata/kernels/{cu.stem}.fatbin"] = image
        kernels[cu.stem] = {**entry, "sha256": hashlib.sha256(image).hexdigest()}
    files["strata/kernels/manifest.json"] = json.dumps({"format": 1, "kernels": kernels})
    for pyx in (ROOT / "strata" / "_ext").glob("*.pyx"):
        files[f"strata/_ext/{pyx.stem}.cpython-311-x86_64-linux-gnu.so"] = b"\x7fELF"
    for path in (ROOT / "strata" / "demo").iterdir():
        if path.suffix in (".json", ".bin"):
            files[f"strata/demo/{path.name}"] = path.read_bytes()
    static = ROOT / "strata" / "server" / "static"
    for path in static.rglob("*"):
        if path.is_file():
            files[f"strata/server/{path.relative_to(static.parent).as_posix()}"] = path.read_bytes()
    files["strata_moe-0.1.0.dist-info/METADATA"] = (
        "Name: strata-moe\nLicense-Expression: MIT\n"
        "Requires-Dist: cuda-bindings<14,>=13.0; sys_platform == \"linux\"\n")
    files["strata_moe-0.1.0.dist-info/licenses/LICENSE"] = "MIT"
    files.update(edits.get("extra", {}))
    for name in edits.get("drop", ()):
        del files[name]
    path = tmp_path / f"strata_moe-0.1.0-cp311-cp311-{tag}.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return path


def test_checker_passes_a_good_wheel(checker, tmp_path):
    assert checker.fatbin_targets(fatbin([(2, 80), (2, 90), (1, 80)])) == {"sm_80", "sm_90", "compute_80"}
    assert checker.check_wheel(make_wheel(tmp_path), "80,90", ROOT) == []
    assert checker.main([str(make_wheel(tmp_path)), "--archs", "80,90", "--source", str(ROOT)]) == 0


def test_checker_finds_what_is_wrong(checker, tmp_path):
    def problems(**kwargs):
        sub = tmp_path / str(len(list(tmp_path.iterdir())))
        sub.mkdir()
        return " | ".join(checker.check_wheel(make_wheel(sub, **kwargs), "80,90", ROOT))

    assert "is not manylinux" in problems(tag="linux_x86_64")
    assert "holds ['compute_80', 'sm_80'], expected" in problems(archs=((2, 80), (1, 80)))
    assert "sha256 differs from manifest.json's" in problems(extra={"strata/kernels/add.fatbin": fatbin([(2, 80)])})
    assert "strata/kernels/manifest.json missing" in problems(drop=["strata/kernels/manifest.json"])
    assert "strata/_ext/runtime: no compiled module" in problems(drop=["strata/_ext/runtime.cpython-311-x86_64-linux-gnu.so"])
    assert "a grafted library" in problems(extra={"strata_moe.libs/libcuda-1234.so.1": b""})
    assert "strata/demo/experts.bin (in the demo pack.json) missing" in problems(drop=["strata/demo/experts.bin"])
    assert "static/index.html missing" in problems(drop=["strata/server/static/index.html"])
    assert "not a readable fatbin" in problems(extra={"strata/kernels/add.fatbin": b"junk" * 8})
    sub = tmp_path / "all"
    sub.mkdir()
    assert any("manifest archs" in p for p in checker.check_wheel(make_wheel(sub), "all", ROOT))  # 80,90 only


def test_checker_reads_the_archs_of_all_from_setup(checker, build):
    assert checker.all_archs(ROOT) == list(build.SASS_ARCHS)
    assert checker.expected_targets(checker.all_archs(ROOT)) == set(build.gencode_flags(list(build.SASS_ARCHS))[1])
