"""The host side of cuda/moe_gemm_ws.cu (the warp-specialized wgmma prompt GEMM) without a GPU: its block
and dynamic shared memory are the kernel's own (from the .cu's default build constants), and its grid is
one block a multiprocessor, fewer where there are fewer work items."""
import re
from pathlib import Path

from strata.backends.cuda.kernels import KERNELS
from strata.backends.cuda.moe_gemm import BN, WS_BLOCK, WS_SHARED_BYTES, ws_grid

SRC = (Path(__file__).resolve().parents[2] / "cuda" / "moe_gemm_ws.cu").read_text()


def default(macro: str) -> int:
    return int(re.search(rf"#define {macro} (\d+)", SRC).group(1))


def test_block_and_shared_bytes_are_the_default_builds():
    threads = 256 + 128 * default("STRATA_WS_GEMM_PRODUCERS")        # two consumer warpgroups and the producers
    stages = default("STRATA_WS_GEMM_STAGES")
    assert WS_BLOCK == threads == KERNELS["moe_gemm_ws"].block
    assert WS_SHARED_BYTES == stages * 2 * (128 * 64 * 2) + 2 * stages * 8   # A and B stages, full and empty bars
    assert f"{WS_SHARED_BYTES:,}" in SRC                                   # the header states it
    assert 48 * 1024 < WS_SHARED_BYTES <= 227 * 1024
    assert KERNELS["moe_gemm_ws"].signature == KERNELS["moe_gemm"].signature + "i"   # the tile count last


def test_one_block_a_multiprocessor_over_the_work_items():
    assert ws_grid(2048, 300, 132) == 132
    assert ws_grid(2048, 3, 132) == 3 * 2048 // BN
    assert ws_grid(100, 1, 132) == 1
    assert ws_grid(100, 0, 132) == 1          # never an empty grid (an empty table's launch is skipped earlier)
