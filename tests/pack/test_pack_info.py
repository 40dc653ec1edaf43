"""`strata info`: hyperparameters, quant types with runs of layers compressed, blob sizes, totals;
the same text for a GGUF read directly as for its pack; and conversion progress output."""
import io

from strata.pack import convert, info_text
from strata.pack.progress import Progress
from tests.fixtures import SHAPES, make_gguf


def test_info_of_pack_and_gguf(tmp_path):
    qtypes = {"experts": ["Q4_0", "Q8_0", "Q4_0"], "attn_q": "Q5_0", "embd": "Q4_1"}
    src = make_gguf(tmp_path, SHAPES["odd"], qtypes, seed=1)[0][0]
    pack = convert(src, tmp_path / "pack", progress=False)
    text = info_text(pack)
    for part in ("architecture: qwen3moe", "layers 3", "hidden 96", "vocab 300", "4 query heads, 2 KV heads",
                 "head dim 24", "experts: 6, top-3", "expert width 64", "attn_q: Q5_0 (layers 0-2)",
                 "attn_norm: F32 (layers 0-2)", "ffn_down_exps: Q4_0 (layers 0, 2), Q8_0 (layer 1)",
                 "token_embd: Q4_1 [300, 96]", "max_blob: ", "dense: ", "experts: ", "total: "):
        assert part in text, (part, text)
    assert info_text(src).splitlines()[1:] == text.splitlines()[1:]


def test_progress_lines():
    out = io.StringIO()
    p = Progress("converting x", enabled=True, stream=out, log_interval_s=0.0)
    p.start(3000)
    p.advance(1000, "a")
    p.advance(2000, "b")
    p.finish()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "33.3%" in lines[0] and lines[-1].startswith("converting x: 100.0%")
    quiet = io.StringIO()
    p = Progress("x", enabled=False, stream=quiet, log_interval_s=0.0)
    p.start(10)
    p.advance(10)
    p.finish()
    assert quiet.getvalue() == ""


def test_convert_progress_flag(tmp_path, capsys):
    src = make_gguf(tmp_path, SHAPES["tiny"], seed=2)[0][0]
    capsys.readouterr()
    convert(src, tmp_path / "a", progress=False)
    assert capsys.readouterr().err == ""
    convert(src, tmp_path / "b", progress=True)
    assert "100.0%" in capsys.readouterr().err
