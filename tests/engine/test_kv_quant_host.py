"""cuda/kv_quant.cu's launches (strata.backends.cuda.kv) on the emulated runtime: the signatures, grids
and plane shapes the kernels take, the rotation of q and the un-rotation of the output around the
decode, and refusals. The same checks run on the GPU in tests/kernels/test_kv_quant_gpu.py."""
import numpy as np
import pytest

from strata.errors import InvalidArgument
from strata.quant import kv as kvq
from tests.kernels.test_kv_quant_gpu import (check_append, check_combine_rot, check_decode, check_dequant,
                                            check_fused_append, check_hadamard)


@pytest.fixture
def kvops(fake):
    from strata.backends.cuda.testing import CudaOps
    from strata.backends.cuda.kv import KVQuantOps
    return KVQuantOps(CudaOps())


@pytest.mark.parametrize("codec", ["int8", "q4r"])
def test_append_launches(kvops, fake, rng, codec):
    check_append(kvops, rng, codec, 5, 2, 128)
    assert fake.launches == [f"strata_kv_append_{codec}"]


@pytest.mark.parametrize("codec", ["int8", "q4r"])
def test_dequant_launches(kvops, fake, rng, codec):
    check_dequant(kvops, rng, codec, 6, 2, 128)
    assert fake.launches == [f"strata_kv_dequant_{codec}_f16"]


def test_hadamard_launches(kvops, fake, rng):
    check_hadamard(kvops, rng, 3, 64)
    assert fake.launches == ["strata_hadamard_f32"]


@pytest.mark.parametrize("fmt, rotations", [("int8", 0), ("q4_0", 2), ("k8v4", 1)])
def test_decode_launches(kvops, fake, rng, fmt, rotations):
    check_decode(kvops, rng, fmt, 1, 8, 2, 64, 23, 2)
    names = fake.launches
    assert f"strata_attention_decode_{fmt}_d64_g4" in names and "strata_attention_decode_combine_f32" in names
    assert names.count("strata_hadamard_f32") == rotations
    if fmt == "q4_0":   # q rotated before the split-K pass, the output un-rotated after the combine
        assert names == ["strata_hadamard_f32", "strata_attention_decode_q4_0_d64_g4",
                         "strata_attention_decode_combine_f32", "strata_hadamard_f32"]


def test_refusals(kvops, rng):
    codec = kvq.CODECS["int8"]
    values, scales = codec.empty((4, 2), 64)
    with pytest.raises(InvalidArgument, match="cells outside"):
        kvops.append("int8", rng.standard_normal((1, 2, 64)), np.array([4]), values, scales)
    with pytest.raises(InvalidArgument, match="planes"):
        kvops.append("int8", rng.standard_normal((1, 2, 128)), np.array([0]), values, scales)
    with pytest.raises(InvalidArgument, match="head dim"):
        kvops.hadamard(np.zeros((2, 32), np.float32))
    kp = codec.empty((1, 8, 2), 64)
    with pytest.raises(InvalidArgument, match="format"):
        kvops.attention_decode("f16", np.zeros((1, 4, 64), np.float32), kp, kp, np.array([8]))
    with pytest.raises(InvalidArgument, match="lengths"):
        kvops.attention_decode("int8", np.zeros((1, 4, 64), np.float32), kp, kp, np.array([9]))


@pytest.mark.parametrize("fmt", ["int8", "q4_0", "k8v4"])
@pytest.mark.parametrize("with_cells", [True, False])
def test_fused_append_launches(kvops, fake, rng, fmt, with_cells):
    check_fused_append(kvops, rng, fmt, 3, 8, 2, 64, with_cells=with_cells)
    assert f"strata_qk_norm_rope_kv_{fmt}" in fake.launches


def test_combine_rot_launches(kvops, fake, rng):
    check_combine_rot(kvops, rng, 2, 4, 64, 5)
    assert fake.launches[-1] == "strata_attention_decode_combine_rot_f32"
