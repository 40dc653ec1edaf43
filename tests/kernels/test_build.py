"""The build's outputs and the CPU-only guarantees; these run everywhere, no GPU needed."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from strata.errors import DeviceError


def test_import_touches_no_cuda():
    code = ("import sys, strata, strata.backends.cuda; "
            "print([m for m in sys.modules if m.startswith(('cuda', 'strata._ext.runtime'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cuda_available_never_raises():
    from strata.backends.cuda import cuda_available, unavailable_reason
    from strata.backends.cuda.testing import CudaOps

    available = cuda_available()
    assert isinstance(available, bool) and (unavailable_reason() is None) == available
    if not available:
        with pytest.raises(DeviceError):
            CudaOps()


def test_manifest_describes_the_fatbins():
    from pathlib import Path

    import strata.kernels

    directory = Path(strata.kernels.__file__).parent
    if not (directory / "manifest.json").is_file():
        pytest.skip("built without nvcc: no kernels")
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["format"] == 1 and manifest["kernels"]
    for name, entry in manifest["kernels"].items():
        assert entry["file"] == f"{name}.fatbin"
        assert hashlib.sha256((directory / entry["file"]).read_bytes()).hexdigest() == entry["sha256"]
        assert entry["nvcc_version"] and entry["archs"]
        for arch in entry["archs"]:
            assert any(f"code={arch}" in flag for flag in entry["nvcc_flags"])


def test_fatbin_hash_is_checked(tmp_path, rng):
    runtime = pytest.importorskip("strata._ext.runtime", reason="strata._ext.runtime not built")
    image = rng.integers(0, 256, 1000, dtype="uint8").tobytes()
    with pytest.raises(DeviceError, match="built without nvcc"):
        runtime.read_fatbin("toy", tmp_path)
    entry = {"file": "toy.fatbin", "sha256": hashlib.sha256(image).hexdigest()}
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 1, "kernels": {"toy": entry}}))
    (tmp_path / "toy.fatbin").write_bytes(image)
    assert runtime.read_fatbin("toy", tmp_path) == image
    (tmp_path / "toy.fatbin").write_bytes(image[:-1] + bytes([image[-1] ^ 1]))
    with pytest.raises(DeviceError, match="sha256"):
        runtime.read_fatbin("toy", tmp_path)
    with pytest.raises(DeviceError, match="no kernel library 'other'"):
        runtime.read_fatbin("other", tmp_path)


def test_every_kernel_of_a_pdl_library_waits_for_the_previous_grid_first():
    """A programmatic dependent launch may start before the previous kernel ends: each kernel of
    the libraries launched so must begin with STRATA_PDL_ENTRY() (cuda/pdl.cuh), before any read."""
    import re

    from strata.backends.cuda.ops import PDL_LIBRARIES
    root = Path(__file__).resolve().parents[2] / "cuda"
    for lib in sorted(PDL_LIBRARIES):
        src = (root / f"{lib}.cu").read_text()
        assert '#include "pdl.cuh"' in src, lib
        kernels = [m.start() for m in re.finditer(r"__global__", src)]
        assert kernels, lib
        for at in kernels:
            body = src[src.index("{", at) + 1:]
            # (a kernel a macro defines continues its lines with backslashes)
            assert re.match(r"[\s\\]*STRATA_PDL_ENTRY\(\);", body), f"{lib}.cu: a kernel at offset {at} does not begin with it"


def test_the_decode_ring_bytes_are_the_kernels():
    """kernels.decode_quant_shared gives the quantized split-K decode its cp.async ring's bytes; it
    mirrors cuda/kv_quant.cu's DecodeQ (tiles a warp per format, 32 cells a tile, 4 warps). Less than
    the kernel's RING_BYTES and the kernel quietly keeps to registers, so the two must agree."""
    import re

    from strata.backends.cuda.kernels import decode_quant_shared
    src = (Path(__file__).resolve().parents[2] / "cuda" / "kv_quant.cu").read_text()
    m = re.search(r"static constexpr int NST = \(KQ4 && VQ4\) \? (\d+) : \(!KQ4 && !VQ4\) \? (\d+) : (\d+);", src)
    assert m, "DecodeQ::NST's line changed: update this test and kernels._DECODE_RING"
    nst = {"q4_0": int(m[1]), "int8": int(m[2]), "k8v4": int(m[3])}
    assert "constexpr int kWarps = 4;" in src and "static constexpr int NSUB = DH <= 128 ? 2 : 1;" in src
    rows = {"q4_0": (64, 8, 64, 8), "int8": (128, 4, 128, 4), "k8v4": (128, 4, 64, 8)}   # Dh 128: codes, scales
    for fmt, cell in rows.items():
        assert decode_quant_shared(fmt, 128, (9, 0)) == 4 * nst[fmt] * 32 * sum(cell), fmt
        assert decode_quant_shared(fmt, 128, (10, 0)) == decode_quant_shared(fmt, 128, (9, 0))
        for cc in ((8, 0), (8, 9), (12, 0)):        # 164 or 100 KB a multiprocessor: two blocks would not fit
            assert decode_quant_shared(fmt, 128, cc) == 0, cc
        assert decode_quant_shared(fmt, 64, (9, 0)) == 0
    assert decode_quant_shared("f16", 128, (9, 0)) == 0
