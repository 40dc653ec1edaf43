"""strata.system: which GPUs the installed kernels run on, why the GPU path is unusable (with the
fix), the CPU fallback note, and `python -m strata info --system` on this (GPU-less) machine."""
import subprocess
import sys

import pytest

import strata.backends.cuda as cuda_backend
from strata import system

SM90_ONLY = {"kernels": {"add": {"archs": ["sm_90", "compute_90"]}, "gemv": {"archs": ["sm_90", "compute_90"]}}}


@pytest.mark.parametrize("arch, cc, runs", [
    ("sm_80", (8, 0), True), ("sm_80", (8, 6), True), ("sm_86", (8, 0), False), ("sm_80", (9, 0), False),
    ("sm_90", (9, 0), True), ("sm_90a", (9, 0), True), ("sm_90a", (10, 0), False), ("sm_120", (12, 0), True),
    ("compute_80", (9, 0), True), ("compute_90", (8, 9), False), ("compute_80", (12, 0), True),
])
def test_arch_runs_on(arch, cc, runs):
    assert system.arch_runs_on(arch, *cc) is runs


def test_kernels_reason_names_the_arch_and_the_fix():
    assert system.kernels_reason(SM90_ONLY, 9, 0) is None
    assert system.kernels_reason(SM90_ONLY, 10, 0) is None            # compute_90 PTX is JIT-compiled
    why = system.kernels_reason(SM90_ONLY, 8, 6, "NVIDIA RTX A4000")
    assert "NVIDIA RTX A4000 is sm_86" in why and "sm_90" in why and "STRATA_CUDA_ARCHS=86" in why
    assert "STRATA_CUDA_ARCHS=all" in why and "\n" not in why
    mixed = {"kernels": {"add": {"archs": ["sm_86"]}, "gemv": {"archs": ["sm_90"]}}}
    assert "1 of 2, e.g. gemv" in system.kernels_reason(mixed, 8, 6)
    assert "no GPU kernels" in system.kernels_reason(None, 9, 0)


def test_gpu_unusable_reason_checks_the_kernels_past_the_runtime(fake, monkeypatch):
    monkeypatch.setattr(cuda_backend, "unavailable_reason", lambda ordinal=0: None)
    monkeypatch.setattr(cuda_backend, "device_info", lambda ordinal=0: {"name": "GPU X", "compute_capability": "8.9"})
    monkeypatch.setattr(fake, "read_manifest", lambda directory=None: SM90_ONLY)
    assert "GPU X is sm_89" in system.gpu_unusable_reason(0)
    monkeypatch.setattr(fake, "read_manifest", lambda directory=None: {"kernels": {"add": {"archs": ["sm_89"]}}})
    assert system.gpu_unusable_reason(0) is None
    monkeypatch.setattr(cuda_backend, "unavailable_reason",
                        lambda ordinal=0: "manifest.json: not found; this install was built without nvcc")
    assert "STRATA_CUDA_ARCHS" in system.gpu_unusable_reason(0)


def test_auto_falls_back_to_the_cpu_saying_why_once_where_a_driver_is(monkeypatch, capsys):
    from strata.engine.llm import _pick_device
    monkeypatch.setattr(system, "gpu_unusable_reason", lambda ordinal=0: "GPU X is sm_89, kernels for sm_90 only")
    monkeypatch.setattr(system, "_noted", set())
    monkeypatch.setattr(system, "nvidia_driver", lambda: None)
    assert _pick_device("auto", 0) == "cpu" and capsys.readouterr().err == ""     # no driver: no surprise
    monkeypatch.setattr(system, "nvidia_driver", lambda: "550.54")
    assert _pick_device("auto", 0) == "cpu" and _pick_device("auto", 0) == "cpu"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the CPU runs the model: GPU X is sm_89" in err[0]
    with pytest.raises(Exception, match="device 'cuda': GPU X is sm_89"):
        _pick_device("cuda", 0)


def test_info_system_on_this_machine():
    r = subprocess.run([sys.executable, "-m", "strata", "info", "--system"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    heads = [line.split(":")[0] for line in r.stdout.splitlines()]
    for head in ("NVIDIA driver", "installed kernels", "pinned memory", "host memory", "CPU", "GPU path"):
        assert head in heads, r.stdout
    assert any(h.startswith(("GPU 0", "GPUs")) for h in heads)
    gpu_path = r.stdout.splitlines()[-1]
    reason = system.gpu_unusable_reason(0)
    assert gpu_path == ("GPU path: usable on GPU 0" if reason is None else f"GPU path: not usable on GPU 0: {reason}")


def test_info_system_names_each_gpu_of_a_split():
    r = subprocess.run([sys.executable, "-m", "strata", "info", "--system", "--gpus", "0,1,0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    paths = [line for line in r.stdout.splitlines() if line.startswith("GPU path")]
    assert [p.split(":")[1].split()[-1] for p in paths] == ["0", "1"]
