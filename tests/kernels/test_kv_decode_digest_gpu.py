"""The quantized split-K decode's outputs pinned bit for bit on sm_90 (tools/kv_decode_digest.py --quick).

A change to cuda/kv_quant.cu or to the planes' layout that must keep the sums (a new load path, a
byte order) leaves every digest as tests/kernels/data/kv_decode_digest_sm90.txt has it: the lines an
H100 and an H200 gave at 32e889e, before the plain-cache loop and q4r's lane order, which kept them.
A change that means to alter the arithmetic regenerates that file
(`python tools/kv_decode_digest.py --quick > tests/kernels/data/kv_decode_digest_sm90.txt`) and
says why in its commit. Other archs may round inside an MMA differently and are skipped.
"""
from pathlib import Path

import pytest

from tests.fixtures import load_tool

REFERENCE = Path(__file__).parent / "data" / "kv_decode_digest_sm90.txt"


@pytest.mark.gpu
def test_quick_digests_equal_the_sm90_reference():
    from strata.backends.cuda.kv import KVQuantOps
    from strata.backends.cuda.testing import CudaOps
    ops = CudaOps()
    if tuple(ops.device.compute_capability) != (9, 0):
        cc = "".join(map(str, ops.device.compute_capability))
        pytest.skip(f"the reference digests are sm_90's; this GPU is sm_{cc}")
    tool = load_tool("kv_decode_digest")
    want = REFERENCE.read_text()
    got = list(tool.lines(KVQuantOps(ops), full=False))
    bad = tool.differences(got, want)
    assert len(got) == len(want.splitlines())
    assert not bad, f"{len(bad)} of {len(got)} cases differ, first: {bad[0]}"


def test_differences_name_changed_and_missing_cases():
    """On the CPU: a case whose digest changed, or which the reference lacks, is a difference."""
    tool = load_tool("kv_decode_digest")
    want = "fmt=int8 dh=64 a\nfmt=q4_0 dh=64 b\n"
    assert tool.differences(["fmt=int8 dh=64 a", "fmt=q4_0 dh=64 b"], want) == []
    assert tool.differences(["fmt=int8 dh=64 c"], want) == ["fmt=int8 dh=64 c"]
    assert tool.differences(["fmt=k8v4 dh=64 a"], want) == ["fmt=k8v4 dh=64 a"]
