"""tools/decode_profile.py on the emulated device: its launch wrappers keep ops.launch's signature (a
stale one broke the tool on the H200), and --rows times a batched step of parallel slots; past
TC_DECODE_FROM the step's graph is keyed "1+tc" (a KeyError at 16,384 cells on an H100)."""
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


def test_graph_breakdown_past_the_tensor_core_cut(fake, tmp_path, monkeypatch):
    """Rows of tc_from cells or more take attention_dec_tc.cu's kernel and the engine keys their step's graph
    with that rule: the in-graph breakdown captures the same kernels under that key."""
    from strata.backends.cuda.ops_attention import AttentionOps
    monkeypatch.setattr(AttentionOps, "tc_from", 16)
    out = tmp_path / "p.json"
    assert _tool().main(["--synthetic", "tiny", "--context", "24", "--steps", "1", "--blocker-mib", "1",
                         "--graphs-only", "--json", str(out)]) == 0
    kernels = json.loads(out.read_text())["in_graphs"]["kernels"]
    assert any(n.startswith("strata_attention_decode_tc_") for n in kernels)
    assert not any(n.startswith("strata_attention_decode_f16_") for n in kernels)
