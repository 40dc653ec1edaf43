"""The Monitor's static files ship inside the package (no build step), so they must be package data."""
import fnmatch
from pathlib import Path

import pytest

import strata.server.app as app_module

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parents[2]


def test_static_files_are_package_data():
    static = app_module.STATIC_DIR
    files = sorted(p.relative_to(static.parent).as_posix() for p in static.rglob("*") if p.is_file())
    assert {"static/index.html", "static/monitor.css", "static/monitor.js"} <= set(files)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = config.get("package-data", {}).get("strata.server", [])
    missing = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert not missing, f"pyproject.toml [tool.setuptools.package-data] 'strata.server' misses {missing}"
