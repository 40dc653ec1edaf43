"""Incremental detokenization: whole characters only, stop strings never leak into the stream."""
import numpy as np
import pytest

from strata.engine.textstream import TextStream


class ByteTokenizer:
    """Token id = one byte, so multi-byte characters span tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def run(text: str, stop=()):
    ts = TextStream(ByteTokenizer(), tuple(stop))
    pieces = []
    for b in text.encode():
        pieces.append(ts.push(b))
        if ts.stopped:
            break
    if not ts.stopped:
        pieces.append(ts.finish())
    return pieces, ts


def test_multibyte_characters_are_released_whole():
    pieces, ts = run("héllo → wörld ✓")
    assert "".join(pieces) == "héllo → wörld ✓" == ts.text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("stop", [["wor"], ["xyz", "lo w"], ["d"]])
def test_stop_strings_cut_and_never_stream(stop):
    pieces, ts = run("hello world and more", stop)
    joined = "".join(pieces)
    cut = min(("hello world and more".find(s) for s in stop if s in "hello world and more"))
    assert ts.stopped and joined == ts.text == "hello world and more"[:cut]


def test_partial_stop_prefix_is_released_at_the_end():
    pieces, ts = run("the end is wo", ["world"])
    assert not ts.stopped and "".join(pieces) == "the end is wo"


def test_random_text_roundtrip():
    rng = np.random.default_rng()
    alphabet = list("ab ✓é\n→")
    text = "".join(rng.choice(alphabet, 200))
    pieces, ts = run(text)
    assert "".join(pieces) == text


def test_invalid_utf8_tail_is_flushed_at_the_end():
    ts = TextStream(ByteTokenizer())
    pieces = [ts.push(b) for b in b"ok\xe2\x82"]
    pieces.append(ts.finish())
    assert "".join(pieces) == ts.text == b"ok\xe2\x82".decode("utf-8", errors="replace")


def test_stream_equals_whole_decode_on_random_byte_tokens():
    ts_inputs = np.random.default_rng().integers(0, 256, (200, 12))
    for ids in ts_inputs.tolist():
        ts = TextStream(ByteTokenizer())
        out = "".join(ts.push(i) for i in ids) + ts.finish()
        assert out == ts.text == ByteTokenizer().decode(ids)


def test_text_after_an_invalid_byte_streams_without_waiting_for_the_end():
    ts = TextStream(ByteTokenizer())
    pieces = [ts.push(b) for b in b"a\xffbc"]
    assert "".join(pieces) == "a\ufffdbc"
