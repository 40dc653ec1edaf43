"""The import layers of docs/DESIGN.md hold: `lint-imports` keeps every contract in pyproject.toml
([tool.importlinter]: the layers, the forbidden pairs, no cycles between sibling modules)."""
from __future__ import annotations

import subprocess
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is not installed (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    # the script beside this interpreter, so the contracts are checked against the strata it imports;
    # no cache: a stale one could hide an import added since
    script = Path(sysconfig.get_path("scripts")) / "lint-imports"
    assert script.exists(), f"{script} is missing though importlinter imports: reinstall import-linter"
    done = subprocess.run([str(script), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
