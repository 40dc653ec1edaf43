"""The host side of cuda/attention_ws.cu (the warp-specialized wgmma prompt attention) without a GPU:
which kernel the wgmma path launches at each head dim, its grid, block and dynamic shared memory, and
that the host's shared-memory figure is the kernel's own (WsShape::SMEM_BYTES, from the .cu's constants)."""
import re
from pathlib import Path

import pytest

from strata.backends.cuda.attention_tc import prefill_launch
from strata.backends.cuda.kernels import KERNELS, WS_ATTENTION_CELLS, attention_ws_shared
from strata.errors import InvalidArgument

SRC = (Path(__file__).resolve().parents[2] / "cuda" / "attention_ws.cu").read_text()


def test_the_wgmma_path_takes_the_warp_specialized_kernel_at_head_dim_128():
    op, grid, block, shared, fields = prefill_launch(4096, 32, 4, 128, wgmma=True)
    assert (op, grid, block) == ("attention_prefill_ws", (256, 4), 384)      # 4096 x 8 rows / 128 a block
    assert shared == attention_ws_shared(WS_ATTENTION_CELLS) > 48 * 1024
    assert KERNELS[op].name(**fields) == f"strata_attention_prefill_ws{WS_ATTENTION_CELLS}_f16_d128"
    assert prefill_launch(1, 8, 2, 128, wgmma=True)[1] == (1, 2)
    assert prefill_launch(33, 8, 2, 128, wgmma=True)[1] == (2, 2)            # 132 rows: a block and a part


def test_other_head_dims_keep_their_kernels():
    assert prefill_launch(512, 32, 4, 64, wgmma=True)[:4] == ("attention_prefill_wg", (64, 4), 128, 0)
    assert prefill_launch(512, 32, 4, 128)[:4] == ("attention_prefill_tc", (64, 4), 128, 0)
    assert prefill_launch(512, 16, 2, 256)[:4] == ("attention_prefill_tc_pairs", (64, 2), 256, 0)
    with pytest.raises(InvalidArgument, match="wgmma kernels take Dh"):
        prefill_launch(512, 16, 2, 256, wgmma=True)


@pytest.mark.parametrize("cells", [64, 128])
def test_shared_bytes_are_the_kernels(cells):
    ring_kb = int(re.search(r"#define STRATA_WS_RING_KB (\d+)", SRC).group(1))
    groups = int(re.search(r"constexpr int kWsGroups = (\d+);", SRC).group(1))
    rows, dh, tile = 64 * groups, 128, cells * 128 * 2
    stages = ring_kb * 1024 // (2 * tile)
    assert attention_ws_shared(cells) == rows * dh * 2 + 2 * stages * tile + 4 * stages * 8
    assert f"{attention_ws_shared(cells):,}" in SRC          # the header states it
    assert attention_ws_shared(cells) <= 227 * 1024           # a block's opt-in maximum on Hopper


def test_the_tma_build_takes_its_tensor_maps_and_1024_bytes_more():
    op, grid, block, shared, fields = prefill_launch(4096, 32, 4, 128, wgmma=True, tma=True)
    assert (op, grid, block) == ("attention_prefill_wst", (256, 4), 384)
    assert shared == attention_ws_shared(WS_ATTENTION_CELLS) + 1024 == attention_ws_shared(WS_ATTENTION_CELLS, tma=True)
    assert KERNELS[op].name(**fields) == "strata_attention_prefill_wst128_f16_d128"
    assert KERNELS[op].signature == KERNELS["attention_prefill_ws"].signature + "BB"
    assert re.search(r"SMEM_BYTES_TMA = SMEM_BYTES \+ 1024;", SRC)
    assert prefill_launch(4096, 32, 4, 128, tma=True)[:4] == (op, grid, block, shared)     # wgmma or not
    op, grid, block, shared, fields = prefill_launch(4096, 16, 2, 256, tma=True)    # Dh 256: 64-cell tiles
    assert (op, grid, block, shared) == ("attention_prefill_wst", (256, 2), 384, attention_ws_shared(64, 256, True))
    assert KERNELS[op].name(**fields) == "strata_attention_prefill_wst64_f16_d256"
    with pytest.raises(InvalidArgument, match="TMA build takes Dh"):
        prefill_launch(512, 32, 4, 64, wgmma=True, tma=True)


def test_the_dh256_tma_build_fits_and_the_source_states_its_bytes():
    """Dh 256 on 64-cell tiles: Q 64 KB, two stages of 32 KB K and V, the barriers and the alignment."""
    shared = attention_ws_shared(64, 256, tma=True)
    assert shared == 128 * 256 * 2 + 2 * 2 * 64 * 256 * 2 + 4 * 2 * 8 + 1024 <= 227 * 1024
    assert f"{shared:,}" in SRC
    assert KERNELS["attention_prefill_wst"].name(cells=64, dh=256) == "strata_attention_prefill_wst64_f16_d256"
