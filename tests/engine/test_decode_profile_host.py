"""tools/decode_profile.py on the emulated device: its launch wrappers keep ops.launch's signature (a
stale one broke the tool on the H200), and --rows times a batched step of parallel slots."""
import json

import pytest

from tests.fixtures import load_tool


def _tool():
    return load_tool("decode_profile")


@pytest.mark.parametrize("rows", [1, 2])
def test_profile_tables_name_every_kernel_of_the_step(fake, tmp_path, rows, capsys):
    out = tmp_path / "p.json"
    argv = ["--synthetic", "tiny", "--context", "24", "--steps", "1", "--rows", str(rows), "--blocker-mib", "1",
            "--json", str(out)]
    assert _tool().main(argv) == 0
    report = json.loads(out.read_text())
    assert report["rows"] == rows
    names = set(report["kernels"])
    assert any(n.startswith("strata_embed") for n in names)
    assert any(n.startswith("strata_moe") for n in names)
    assert f"decode step of {rows} row(s)" in capsys.readouterr().out
    assert (report["in_graphs"] is None) == (rows > 1)


def test_rows_out_of_range_is_refused(fake):
    with pytest.raises(SystemExit):
        _tool().main(["--synthetic", "tiny", "--rows", "9"])
