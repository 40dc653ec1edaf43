"""Every kernel variant under tools/variants still applies to this tree's CUDA sources.

A variant is a patch kept out of the package until a device call measures it (its make_*.sh applies
it and builds the fatbins). A patch that no longer applies would cost that call, so the tree's edits
are checked against each of them here, on the CPU.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ROOT / "tools" / "variants"
# variants written over another variant, as their make_*.sh applies them
OVER = {"moe_decode_xsd.patch": "moe_decode_xs.patch"}

pytestmark = pytest.mark.skipif(shutil.which("patch") is None, reason="needs patch(1)")


def patch_args(patch: Path, root: Path) -> list[str]:
    """How to apply `patch` in `root`: git's a/ b/ paths from the root; otherwise (diff -u of one file,
    whose header names may carry notes after the path) to the file its +++ line names."""
    for line in patch.read_text().splitlines():
        if line.startswith("+++ "):
            path = line[4:].split()[0]
            return ["-p1", "-d", str(root)] if path.startswith("b/") else [str(root / path)]
    raise AssertionError(f"{patch.name}: no +++ line, not a patch")


@pytest.mark.parametrize("name", sorted(p.name for p in VARIANTS.glob("*.patch")))
def test_variant_patch_applies(tmp_path: Path, name: str) -> None:
    shutil.copytree(ROOT / "cuda", tmp_path / "cuda")
    chain = [name]
    while chain[0] in OVER:
        chain.insert(0, OVER[chain[0]])
    for p in chain:
        patch = VARIANTS / p
        r = subprocess.run(["patch", "-s", "--batch", "--forward", *patch_args(patch, tmp_path)],
                           input=patch.read_bytes(), capture_output=True, timeout=60)
        assert r.returncode == 0, f"{p} does not apply: {r.stdout.decode()}{r.stderr.decode()}"
    assert not list(tmp_path.rglob("*.rej"))
