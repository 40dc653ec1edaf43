"""What the host knows of the kernel libraries in cuda/: limits, the types each entry point reads, and
which alternative paths the ops take."""

from __future__ import annotations

from dataclasses import dataclass, fields

from strata.config import KERNEL_PATHS
from strata.errors import InvalidArgument

RMS_NORM_BLOCK = 256  # threads per row; cuda/rms_norm.cu accepts any multiple of 32 up to 1024
# cuda/embed.cu's strata_embed_<type>: every type strata.quant reads, so every pack's embedding is
# read on the device from device-side ids (tests/kernels/test_embed_gpu.py checks the source's list)
EMBED_QTYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K", "IQ4_NL", "IQ4_XS")

ATTENTION_HEAD_DIMS = (64, 128, 256)        # cuda/attention.cu's tiled kernels
TC_ATTENTION_HEAD_DIMS = (64, 128)          # cuda/attention_tc.cu's prompt kernels
ATTENTION_MAX_SPLITS = 1024                 # cuda/attention.cu kMaxSplits
MOE_ROUTE_MAX_EXPERTS = 512                 # cuda/moe_route.cu: 16 logits per lane
MOE_ROUTE_MAX_TOP_K = 32


def decode_splits(num_seqs: int, num_kv_heads: int, max_cells: int, head_dim: int, num_sms: int,
                  blocks_per_sm: int = 2) -> int:
    """Splits per (sequence, KV head) of cuda/attention.cu's split-K decode attention: about
    `blocks_per_sm` blocks per multiprocessor, never more than the tiles of max_cells. Sized for the
    cache, not the length, so every decode step launches the same grid (the kernel sizes each split
    from the device-side length; splits past the end are empty). 2 beat 4 on an H200 (Hk 4, Dh 128:
    16.0 vs 18.5 us a step at 4096 cells, 27.7 vs 29.6 at 16384, the combine included)."""
    tiles = -(-max_cells // (4096 // head_dim))
    want = -(-blocks_per_sm * num_sms // max(1, num_seqs * num_kv_heads))
    return max(1, min(tiles, want, ATTENTION_MAX_SPLITS))


@dataclass(frozen=True)
class KernelPaths:
    """Which of the alternative kernel paths DeviceOps takes. All are on by default (each measured
    faster on the H200); EngineConfig.kernels_off turns some off, so tools and tests A/B a path
    against its fallback without touching module state. The planner's dry run prices the defaults."""

    fused_decode: bool = True        # cuda/moe_decode.cu for decode steps (off: moe_gemv + swiglu + combine)
    tensor_core_prompt: bool = True  # cuda/moe_gemm.cu for prompt GEMMs of non-f32 weights (off: dequant + f32 GEMM)
    group_on_device: bool = True     # cuda/moe_group.cu groups a chunk's slots when every expert is readable (off: on the host)
    split_gemv: bool = True          # strata_gemv_split_* for one-token GEMVs of fewer than 2 blocks per SM
    pdl: bool = True                 # programmatic dependent launches (sm_90+) for the decode libraries

    @classmethod
    def without(cls, names: str) -> "KernelPaths":
        """The defaults less the comma-separated paths in `names` (KERNEL_PATHS' spelling)."""
        off = [n.strip() for n in names.split(",") if n.strip()]
        for n in off:
            if n not in KERNEL_PATHS:
                raise InvalidArgument(f"kernel path {n!r} is not one of {', '.join(KERNEL_PATHS)}")
        return cls(**{n.replace("-", "_"): False for n in off})


assert [f.name for f in fields(KernelPaths)] == [n.replace("-", "_") for n in KERNEL_PATHS]
