"""README.md's two set-up commands are the ones CI and users run."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command_verbatim():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = next(line for line in readme.splitlines() if "pytest" in line and line.startswith("python3 -m venv"))
    tail = test_cmd.split("&& ", 2)[2]           # after creating and activating the venv
    assert tail in ci.splitlines()
    assert any("python -m strata serve" in line for line in readme.splitlines())
