"""What the host knows of the kernel libraries in cuda/: the table of every entry point it launches
(KERNELS), limits, the types each entry point reads, and which alternative paths the ops take.

DeviceOps.launch, the numpy-in/out wrappers (CudaOps and the modules beside it) and the tests' fake
runtime all read KERNELS; tests/kernels/test_kernel_table.py checks it against cuda/*.cu.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, fields
from itertools import product

from strata.config import KERNEL_PATHS, KERNEL_TRIAL_PATHS
from strata.errors import InvalidArgument, UnsupportedError

RMS_NORM_BLOCK = 256  # threads per row; cuda/rms_norm.cu accepts any multiple of 32 up to 1024
# cuda/embed.cu's strata_embed_<type>: every type strata.quant reads, so every pack's embedding is
# read on the device from device-side ids (tests/kernels/test_embed_gpu.py checks the source's list)
EMBED_QTYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K", "IQ4_NL", "IQ4_XS")

ATTENTION_HEAD_DIMS = (64, 128, 256)        # cuda/attention.cu's tiled kernels
TC_ATTENTION_HEAD_DIMS = (64, 128, 256)     # cuda/attention_tc.cu's prompt kernels
TC_ATTENTION_PAIR_HEAD_DIMS = (256,)        # of them, those on warp pairs: table op "attention_prefill_tc_pairs"
WG_ATTENTION_HEAD_DIMS = (64, 128)          # the wgmma (sm_90a) prompt kernels' (--kernels-on wgmma-attention)
WS_ATTENTION_HEAD_DIMS = (128,)             # of them, cuda/attention_ws.cu's; the others cuda/attention_wg.cu's
WS_ATTENTION_CELLS = 128                    # the K/V tile attention_ws.cu's kernel the host takes has (64 or 128):
                                            # 128 was at or above 64 at every chunk timed (an H100, 24th session)
WS_ATTENTION_ROWS = 128                     # query rows a block of it (two consumer warpgroups)
# Its TMA build's tile by head dim, both on by default (tma-attention). Dh 256 on 64-cell tiles ran 508-632
# TFLOP/s against attention_tc.cu's 156-166 at Qwen3-Next-80B's shape (an H100, 27th session)
TMA_ATTENTION_CELLS = {128: 128, 256: 64}
TMA_DEFAULT_HEAD_DIMS = (128, 256)
_WS_RING_BYTES = 128 * 1024                 # cuda/attention_ws.cu STRATA_WS_RING_KB
TC_DECODE_HEAD_DIMS = (64, 128)             # cuda/attention_dec_tc.cu's f16 split-K decode kernels
# A decode row of at least this many cells takes cuda/attention_dec_tc.cu's kernel, a shorter one
# attention.cu's (tc-decode-attention; each kernel skips the other's rows, so a row's bits depend on its
# own length alone, in any batch or verify window). Measured on H100s, synthetic qwen3-30b-a3b, the
# kernels alternated on one load (tools/decode_variants.py --attention), tok/s of the tensor cores'
# against attention.cu's: 312.4 / 322.1 after 512 cells, 302.6 / 309.8 after 4096 (another machine:
# 299.6 / 298.1), 298.2 / 297.4 after 8192, 289.3 / 285.9 after 12288, 275.0 / 265.0 and 285.8 / 278.4
# after 16384, 261.0 / 242.5 after 32768.
TC_DECODE_FROM = 8192
# cluster-decode (cuda/attention.cu strata_attention_decode_cl_*): f16 decode rows of fewer cells than this take
# the split-K over CLUSTER_SPLITS splits and its combine in one launch (kClusterSplits); from it on, the split-K
# kernels over decode_splits' splits and the combine's launch
CLUSTER_SPLITS = 16
CLUSTER_DECODE_BELOW = 1024
INT32_MAX = 2**31 - 1
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


# cuda/kv_quant.cu's cp.async ring (DecodeQ: NST tiles of 32 cells a warp, 4 warps) at Dh 128, per format:
# (bytes of a cell's K codes + K scales + V codes + V scales, tiles in the ring)
_DECODE_RING = {"q4_0": (64 + 8 + 64 + 8, 4), "int8": (128 + 4 + 128 + 4, 2), "k8v4": (128 + 4 + 64 + 8, 3)}


# GPU generations with 228 KB of shared memory a multiprocessor (Hopper, datacenter Blackwell), where two
# blocks of the ring (67-79 KB) and the kernel's static 20 KB fit beside each other; sm_80 has 164 KB and
# the consumer cards (sm_86, sm_89, sm_120) 100 KB, where the ring would leave one block a multiprocessor
_RING_MAJORS = (9, 10)


def decode_quant_shared(fmt: str, head_dim: int, compute_capability) -> int:
    """Dynamic shared memory for strata_attention_decode_<fmt>: its cp.async ring (DecodeQ::RING_BYTES) at
    head dim 128 on a GPU of _RING_MAJORS, else 0, and the kernel keeps a tile a warp in registers. The
    sums are the same bits either way (a test compares them); only how many bytes a warp has in flight
    changes."""
    major = tuple(compute_capability or (0, 0))[0]
    if head_dim != 128 or fmt not in _DECODE_RING or major not in _RING_MAJORS:
        return 0
    cell, stages = _DECODE_RING[fmt]
    return 4 * stages * 32 * cell


def attention_ws_shared(cells: int = WS_ATTENTION_CELLS, head_dim: int = 128, tma: bool = False) -> int:
    """Dynamic shared memory of strata_attention_prefill_ws<cells>_f16_d<head_dim> (WsShape::SMEM_BYTES):
    the block's Q, the K/V ring, and its stages' four mbarriers; tma: of the TMA build
    strata_attention_prefill_wst<cells>_f16_d<head_dim> (SMEM_BYTES_TMA: 1024 bytes more, which it
    skips to align its tiles to the 128-byte swizzle's 1024-byte atoms)."""
    stages = _WS_RING_BYTES // (2 * cells * head_dim * 2)
    return WS_ATTENTION_ROWS * head_dim * 2 + 2 * stages * cells * head_dim * 2 + 4 * stages * 8 + 1024 * tma


def attention_tensor_maps(rt, k_cache: int, v_cache: int, Hk: int, head_dim: int, cells: int) -> tuple[bytes, bytes]:
    """The TMA build's two tensor maps (its "B" parameters): K's and V's f16 caches [cells, Hk, head_dim]
    at k_cache and v_cache, boxes of 64 dims x 1 head x the head dim's tile (TMA_ATTENTION_CELLS),
    cells past `cells` (the chunk's last position + 1) read as zeros."""
    return tuple(rt.tensor_map_f16(c, (head_dim, Hk, cells), (head_dim * 2, Hk * head_dim * 2),
                                   (64, 1, TMA_ATTENTION_CELLS[head_dim])) for c in (k_cache, v_cache))


@dataclass(frozen=True)
class KernelPaths:
    """Which of the alternative kernel paths DeviceOps takes. Those of KERNEL_PATHS are on by default
    (each measured faster on the H200) and EngineConfig.kernels_off turns some off, so tools and tests
    A/B a path against its fallback without touching module state; those of KERNEL_TRIAL_PATHS are off
    until EngineConfig.kernels_on turns them on. The planner's dry run prices the defaults."""

    fused_decode: bool = True        # cuda/moe_decode.cu for decode steps (off: moe_gemv + swiglu + combine)
    tensor_core_prompt: bool = True  # cuda/moe_gemm.cu for prompt GEMMs of non-f32 weights (off: dequant + f32 GEMM)
    group_on_device: bool = True     # cuda/moe_group.cu groups a chunk's slots when every expert is readable (off: on the host)
    split_gemv: bool = True          # strata_gemv_split_* for one-token GEMVs of fewer than 2 blocks per SM
    pdl: bool = True                 # programmatic dependent launches (sm_90+) for the decode libraries
    tc_attention: bool = True        # cuda/attention_tc.cu for prompt attention (off: attention.cu's CUDA-core kernel)
    tc_decode_attention: bool = True  # cuda/attention_dec_tc.cu for f16 decode rows of TC_DECODE_FROM cells and up
    kv_ring: bool = True             # cuda/kv_quant.cu's split-K decode stages tiles in a cp.async ring (Dh 128, sm_90)
    tma_attention: bool = True       # cuda/attention_ws.cu's TMA build for prompt attention (Dh 128, 256; sm_90a libraries)
    one_row_gemv: bool = True        # one-token GEMVs of ONE_ROW_QTYPES one row a warp where rows are few (strata_gemv_one_*)
    tma_gemm: bool = True            # prompt GEMMs of many rows over weights dequantized to f16, by the TMA (sm_90a libraries)
    route_in_moe: bool = True        # decode steps route in the MoE gate|up kernel's blocks (strata_moe_gate_up_route_*)
    norm_in_router: bool = True      # decode steps' post-attention add + RMSNorm in the F32 router's blocks
    wgmma_gemm: bool = False         # on trial: cuda/moe_gemm_ws.cu for the prompt GEMMs (sm_90; off: moe_gemm.cu)
    wgmma_gemm_f16x: bool = False    # on trial: its f16-X entry points, X made f16 by its producers (sm_90)
    wgmma_attention: bool = False    # on trial: prompt attention on wgmma (sm_90; attention_ws.cu, attention_wg.cu)
    fused_route: bool = False        # on trial: decode routers route in the GEMV's last block (strata_router_*)
    cluster_decode: bool = False     # on trial: f16 decode rows under CLUSTER_DECODE_BELOW cells in one cluster launch (sm_90+)

    @classmethod
    def without(cls, names: str, on: str = "") -> "KernelPaths":
        """The defaults less the comma-separated paths in `names` (KERNEL_PATHS' spelling), plus the
        trial paths in `on` (KERNEL_TRIAL_PATHS')."""
        change = {}
        for text, known, value in ((names, KERNEL_PATHS, False), (on, KERNEL_TRIAL_PATHS, True)):
            for n in (n.strip() for n in text.split(",")):
                if n and n not in known:
                    raise InvalidArgument(f"kernel path {n!r} is not one of {', '.join(known)}")
                if n:
                    change[n.replace("-", "_")] = value
        return cls(**change)


assert [f.name for f in fields(KernelPaths)] == [n.replace("-", "_") for n in KERNEL_PATHS + KERNEL_TRIAL_PATHS]


# ---- the kernel table --------------------------------------------------------------------------------

# Libraries whose every kernel begins with STRATA_PDL_ENTRY() (cuda/pdl.cuh; tests/kernels/test_build.py
# checks): the decode path's. A kernel launched so may start while the one before it runs.
PDL_LIBRARIES = frozenset({"decode_fused", "attention", "attention_dec_tc", "kv_quant", "embed", "gemv",
                           "moe_decode", "moe_route", "rms_norm", "argmax", "sample"})


def _each(**axes) -> tuple:
    """Every combination of the axes' values, as field dicts (a Kernel's `over`)."""
    return tuple(dict(zip(axes, values)) for values in product(*axes.values()))


# The entry-name fields the host asks for; tests expand every table entry over them.
ALL_QTYPES = _each(qtype=EMBED_QTYPES)                    # every type strata.quant reads
def dequant_grid(block_size: int, num_weights: int, num_sms: int, per_sm: int = 32) -> int:
    """Blocks of a cuda/dequant.cu launch over num_weights weights of a type of block_size: a thread
    per 8 weights (per element for the float types), 256 a block, capped at per_sm a multiprocessor
    (the threads stride over the rest)."""
    threads = num_weights if block_size == 1 else num_weights // 8
    return max(1, min(-(-threads // 256), per_sm * num_sms))


# Block types (cuda/dequant.cu's strata_dequant_h_groups_*: the float types are elements, not blocks)
DQ_GROUP_QTYPES = tuple(q for q in EMBED_QTYPES if q not in ("F32", "F16", "BF16"))
# The types of one 32-weight block a unit (cuda/gemv_rows.cuh's Stageable): the one-row-a-warp GEMVs'
ONE_ROW_QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")


def max_decode_group(head_dim: int) -> int:
    """The most query heads per KV head the tiled split-K decode kernels take at this head dim."""
    return 8 if head_dim == 256 else 16


def split_k_takes(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the tiled split-K decode kernels (f16 and quantized) take this head layout: a head dim of
    ATTENTION_HEAD_DIMS and at most max_decode_group query heads per KV head."""
    return head_dim in ATTENTION_HEAD_DIMS and num_heads // num_kv_heads <= max_decode_group(head_dim)


DECODE_GROUPS = tuple({"dh": dh, "g": g} for dh in ATTENTION_HEAD_DIMS for g in (1, 2, 4, 8, 16)
                      if g <= max_decode_group(dh))      # G = H / Hk rounded up to a power of two
KV_DECODE_FORMATS = ("int8", "q4_0", "k8v4")             # cuda/kv_quant.cu's split-K decode formats


@dataclass(frozen=True)
class Kernel:
    """One entry point of cuda/<library>.cu. `entry` names it, with fields filled by name(): {qtype} a
    strata.quant type (lower case in the name), {dh} the head dim, {g} the query heads per KV head
    rounded up to a power of two, {fmt} a KV format, {codec} a KV codec; `over` lists the field
    values that exist. `signature`: one strata._ext.runtime letter per parameter (P pointer, i int32,
    I uint32, q int64, Q uint64, f float32, d float64). `block`: threads per block, the same at
    every launch. `grid`: what the launches cover (each site computes it)."""

    library: str
    entry: str
    signature: str
    block: int
    grid: str
    over: tuple = ({},)
    cluster: int = 0      # blocks of a compiled-in cluster (__cluster_dims__); past 8 the host allows it first

    def __post_init__(self):
        object.__setattr__(self, "over", tuple(_lower(f) for f in self.over))

    def name(self, **fields) -> str:
        """The entry point's name for these field values, which must be among `over`."""
        fields = _lower(fields)
        if fields not in self.over:
            raise UnsupportedError(f"cuda/{self.library}.cu has no {self.entry} for {fields}")
        return self.entry.format(**fields)

    def names(self) -> list[str]:
        """Every name of this entry point."""
        return [self.entry.format(**f) for f in self.over]

    def open(self, library, device, name: str):
        """Entry `name` of a loaded library as a runtime kernel, ready to launch: past the portable cluster
        size (8 blocks) it is allowed its compiled-in one first."""
        kernel = library.kernel(device, name, self.signature)
        if self.cluster > 8:
            kernel.allow_wide_clusters()
        return kernel

    @property
    def field_names(self) -> set:
        return {f for _, f, _, _ in string.Formatter().parse(self.entry) if f}


def _lower(fields: dict) -> dict:
    """Field values as entry names spell them: strings (quant types) in lower case."""
    return {k: v.lower() if isinstance(v, str) else v for k, v in fields.items()}


_K = Kernel
KERNELS = {
    # op: Kernel(library, entry, signature, block, grid[, over])
    "gather_rows_f16":  _K("gather_rows", "strata_gather_rows_f16", "PPPiqqq", 256,
                           "(any, min(R, 65535)): it strides; f32 rows in, f16 rows out"),
    "gather_rows":      _K("gather_rows", "strata_gather_rows_f32", "PPPiqqq", 256,
                           "(min(ceil(n / 1024), 8 per SM), min(rows, 65535)): it strides"),
    "add":              _K("add", "strata_add_f32", "PPPq", 256, "min(ceil(n / 1024), 8 per SM): it strides"),
    "dequant":          _K("dequant", "strata_dequant_{qtype}", "PPq", 256, "ceil(units / 256), capped: it strides",
                           ALL_QTYPES),
    # the same, rounded to f16 (out of halves): the dequantize-then-f16 prompt GEMMs (tma-gemm)
    "dequant_h":        _K("dequant", "strata_dequant_h_{qtype}", "PPq", 256, "ceil(units / 256), capped: it strides",
                           ALL_QTYPES),
    # one matrix of each of a layer's expert blobs (ptrs [G], a part's offset) to out + g * out_stride halves
    "dequant_h_groups": _K("dequant", "strata_dequant_h_groups_{qtype}", "PqqPq", 256,
                           "(x, G): x blocks stride over a group's weights", _each(qtype=DQ_GROUP_QTYPES)),
    "embed":            _K("embed", "strata_embed_{qtype}", "PPPii", 256, "T: a block per token", ALL_QTYPES),
    "rms_norm":         _K("rms_norm", "strata_rms_norm_f32", "PPPiif", RMS_NORM_BLOCK, "rows: a block per row"),
    "gemv":             _K("gemv", "strata_gemv_{qtype}", "PPPii", 128, "ceil(rows / rows per block)", ALL_QTYPES),
    "gemv_split":       _K("gemv", "strata_gemv_split_{qtype}", "PPPii", 128, "4x gemv's: the warps split K",
                           ALL_QTYPES),
    "gemv_batch":       _K("gemv", "strata_gemv_batch_{qtype}", "PPPiii", 128, "ceil(rows / 16)", ALL_QTYPES),
    # gemv's bits with one row a warp (the kernel path one-row-gemv; memory.gemv_whole_grid(one_row=True))
    "gemv_one":         _K("gemv", "strata_gemv_one_{qtype}", "PPPii", 128, "ceil(rows / 4), capped: it strides",
                           _each(qtype=ONE_ROW_QTYPES)),
    # row-invariant batches: row b is bit for bit gemv (gemv_split, gemv3 at batch 1) on x[b]
    "gemv_rows":        _K("gemv", "strata_gemv_rows_{qtype}", "PPPiii", 128, "gemv's", ALL_QTYPES),
    "gemv_rows_split":  _K("gemv", "strata_gemv_rows_split_{qtype}", "PPPiii", 128, "gemv_split's", ALL_QTYPES),
    # the F32 router GEMV whose last block routes (cuda/route.cuh): y as gemv_split / gemv_rows_split
    "router_split":     _K("gemv", "strata_router_split_f32", "PPPiiPPPii", 128, "gemv_split's"),
    "router_rows_split": _K("gemv", "strata_router_rows_split_f32", "PPPiiiPPPii", 128, "gemv_split's"),
    # the residual add and RMSNorm of a decode step's rows made in the F32 router GEMV's blocks (norm-in-router)
    "add_norm_router":  _K("gemv", "strata_add_norm_router_f32", "PPPPPPPiiif", 128,
                           "gemv_split's; dynamic shared memory rows * n * 4"),
    "gemm_f32":         _K("gemm_f32", "strata_gemm_f32_nt", "PPPiiiqqq", 256, "(ceil(N / 64), ceil(M / 64))"),
    "rope":             _K("rope", "strata_rope_f32", "PPPiiif", 128, "T: a block per token"),
    "rope_partial":     _K("rope", "strata_rope_partial_f32", "PPPiiiif", 128, "T: a block per token"),
    "kv_append_f16":    _K("attention", "strata_kv_append_f16", "PPPPPii", 128, "T: a block per token"),
    # appended cells (every plane of any format) copied into --kv-resident's VRAM window
    "kv_ring_append":   _K("attention", "strata_kv_ring_append", "PPPPPPPPPiiiiiii", 128, "(T, planes)"),
    "attention_decode": _K("attention", "strata_attention_decode_f16_d{dh}_g{g}", "PPPPPPPiiiifiiPPii", 128,
                           "(splits, Hk, B)", DECODE_GROUPS),
    # the same contract, grid and block on the tensor cores (Dh 64, 128; rows of TC_DECODE_FROM cells or more)
    "attention_decode_tc": _K("attention_dec_tc", "strata_attention_decode_tc_f16_d{dh}_g{g}", "PPPPPPPiiiifiiPPii",
                              128, "attention_decode's", tuple(d for d in DECODE_GROUPS
                                                               if d["dh"] in TC_DECODE_HEAD_DIMS)),
    "attention_combine": _K("attention", "strata_attention_decode_combine_f32", "PPPiii", 128, "(H, B)"),
    # rows of fewer than cluster_decode_below cells: the split-K over CLUSTER_SPLITS splits and its combine in one
    # launch, a cluster of CLUSTER_SPLITS blocks a KV head (sm_90+; the trial path cluster-decode)
    "attention_decode_cl": _K("attention", "strata_attention_decode_cl_f16_d{dh}_g{g}", "PPPPPPiiifiiPPii", 128,
                              "(CLUSTER_SPLITS, Hk, B), clusters along x", DECODE_GROUPS, cluster=16),
    # the combine, then each head's output Hadamard-rotated (a q4r V's un-rotation)
    "attention_combine_rot": _K("attention", "strata_attention_decode_combine_rot_f32", "PPPiiif", 128, "(H, B)"),
    "attention_prefill": _K("attention", "strata_attention_prefill_f16_d{dh}", "PPPPPiiif", 128,
                            "(ceil(T G / rows), Hk), rows 32 (16 at Dh 256)", _each(dh=ATTENTION_HEAD_DIMS)),
    "attention_rows":   _K("attention_rows", "strata_attention_rows_f16", "PPPPPiiiif", 128, "(H, T)"),
    "attention_prefill_tc": _K("attention_tc", "strata_attention_prefill_tc_f16_d{dh}", "PPPPPiiif", 128,
                               "(ceil(T G / 64), Hk)",
                               _each(dh=[d for d in TC_ATTENTION_HEAD_DIMS if d not in TC_ATTENTION_PAIR_HEAD_DIMS])),
    # the same contract, grid and block on Hopper's wgmma; a library built for sm_90a only (WGMMA_LIBRARIES)
    "attention_prefill_wg": _K("attention_wg", "strata_attention_prefill_wg_f16_d{dh}", "PPPPPiiif", 128,
                               "attention_prefill_tc's", _each(dh=WG_ATTENTION_HEAD_DIMS)),
    # the same contract, warp-specialized on wgmma (sm_90a only): 128 rows a block, attention_ws_shared bytes
    "attention_prefill_ws": _K("attention_ws", "strata_attention_prefill_ws{cells}_f16_d{dh}", "PPPPPiiif", 384,
                               "(ceil(T G / 128), Hk)", _each(cells=(64, 128), dh=WS_ATTENTION_HEAD_DIMS)),
    # its TMA build: K/V tiles by the tensor memory accelerator, through attention_tensor_maps' two maps
    # (and at Dh 256 on 64-cell tiles)
    "attention_prefill_wst": _K("attention_ws", "strata_attention_prefill_wst{cells}_f16_d{dh}", "PPPPPiiifBB", 384,
                                "(ceil(T G / 128), Hk)", tuple({"cells": c, "dh": d} for d, c in TMA_ATTENTION_CELLS.items())),
    # head dim 256: the same contract and grid, 64 rows a block on 8 warps (two per 16 rows)
    "attention_prefill_tc_pairs": _K("attention_tc", "strata_attention_prefill_tc_f16_d{dh}", "PPPPPiiif", 256,
                                     "(ceil(T G / 64), Hk)", _each(dh=TC_ATTENTION_PAIR_HEAD_DIMS)),
    "kv_append_int8":   _K("kv_quant", "strata_kv_append_int8", "PPPPiii", 32, "(T, Hk)"),
    "kv_append_q4r":    _K("kv_quant", "strata_kv_append_q4r", "PPPPiiif", 32, "(T, Hk)"),
    "hadamard":         _K("kv_quant", "strata_hadamard_f32", "Piif", 32, "rows: a warp per head vector"),
    "attention_decode_quant": _K("kv_quant", "strata_attention_decode_{fmt}_d{dh}_g{g}", "PPPPPPPPPiiiifiiPPPPi",
                                 128,
                                 "(splits, Hk, B)",
                                 tuple({"fmt": f, **d} for f in KV_DECODE_FORMATS for d in DECODE_GROUPS)),
    "kv_dequant_f16":   _K("kv_quant", "strata_kv_dequant_{codec}_f16", "PPPiii", 32, "(rows, Hk)",
                           _each(codec=("int8", "q4r"))),
    "add_rms_norm":     _K("decode_fused", "strata_add_rms_norm_f32", "PPPPPiif", 256, "rows: a block per row"),
    "gemv3":            _K("decode_fused", "strata_gemv3_{qtype}", "PPPPPPPiiiii", 128, "ceil(row sets / 4)",
                           ALL_QTYPES),
    "gemv3_rows":       _K("decode_fused", "strata_gemv3_rows_{qtype}", "PPPPPPPiiiii", 128,
                           "gemv3's at batch 1", ALL_QTYPES),
    # gemv3's at batch 1 with one row a warp, x staged once a block (the kernel path one-row-gemv)
    "gemv3_one":        _K("decode_fused", "strata_gemv3_one_{qtype}", "PPPPPPPiiiii", 128,
                           "gemv_one's over the three matrices' rows: it strides", _each(qtype=ONE_ROW_QTYPES)),
    "qk_norm_rope_kv":  _K("decode_fused", "strata_qk_norm_rope_kv_f32", "PPPPPPPPPPPiiiiff", 128,
                           "(T, ceil((H + 2 Hk) / 4)): a warp per head"),
    # the same into a quantized cache's planes (cuda/kv_quant.cu's formats), q rotated where K is
    "qk_norm_rope_kv_quant": _K("decode_fused", "strata_qk_norm_rope_kv_{fmt}", "PPPPPPPPPPPPPiiiifff", 128,
                                "(T, ceil((H + 2 Hk) / 4)): a warp per head", _each(fmt=KV_DECODE_FORMATS)),
    "moe_route":        _K("moe_route", "strata_moe_route_f32", "PPPiiii", 128, "ceil(T / 4): a warp per token"),
    "moe_gemv":         _K("moe_gemv", "strata_moe_gemv_{qtype}", "PqPPiPii", 128, "(gemv's, slots)", ALL_QTYPES),
    "swiglu":           _K("swiglu", "strata_swiglu_f32", "PPPiiqqq", 256, "(ceil(I / 256), min(T, 65535))"),
    "swiglu_rows":      _K("swiglu", "strata_swiglu_rows_f32", "PPPPiiiqqq", 256, "(ceil(I / 256), any): it strides"),
    # the same two writing f16 (out_ld in halves): the down GEMM's X under wgmma-gemm-f16x
    "swiglu_f16":       _K("swiglu", "strata_swiglu_f16", "PPPiiqqq", 256, "(ceil(I / 256), min(T, 65535))"),
    "swiglu_rows_f16":  _K("swiglu", "strata_swiglu_rows_f16", "PPPPiiiqqq", 256, "(ceil(I / 256), any): it strides"),
    "moe_combine":      _K("moe_combine", "strata_moe_combine_f32", "PPPPPiii", 256, "(ceil(D / 256), min(T, 65535))"),
    "moe_group":        _K("moe_group", "strata_moe_group", "PiiiPPPPii", 256, "E + 1"),
    "moe_gemm":         _K("moe_gemm", "strata_moe_gemm_{qtype}", "PqPPqPqii", 256, "(ceil(N / 128), tiles)",
                           ALL_QTYPES),
    # the same products on Hopper's warpgroup MMA, warp-specialized and persistent, the tile count last; a
    # library built for sm_90a only (WGMMA_LIBRARIES); WS_SHARED_BYTES of dynamic shared memory
    "moe_gemm_ws":      _K("moe_gemm_ws", "strata_moe_gemm_ws_{qtype}", "PqPPqPqiii", 512,
                           "min(ceil(N / 128) x tiles, SMs): moe_gemm.ws_grid", ALL_QTYPES),
    # the same with X given as f16 (ldx in halves), copied into the stages (the trial path wgmma-gemm-f16x)
    "moe_gemm_ws16":    _K("moe_gemm_ws", "strata_moe_gemm_ws16_{qtype}", "PqPPqPqiii", 512,
                           "min(ceil(N / 128) x tiles, SMs): moe_gemm.ws_grid", ALL_QTYPES),
    # the same over f16 weights and f16 X with both operands moved by the TMA (the dq path's): two tensor maps
    "moe_gemm_wst":     _K("moe_gemm_ws", "strata_moe_gemm_wst_f16", "PqPPqPqiiiQBB", 512,
                           "min(ceil(N / 128) x tiles, SMs): moe_gemm.ws_grid; moe_gemm.wst_maps"),
    "moe_gate_up":      _K("moe_decode", "strata_moe_gate_up_{qtype}", "PqqPPPiii", 256,
                           "(gx, T, 1) and dynamic shared memory: moe_decode.gate_up_launch", ALL_QTYPES),
    # the same gate|up with the routing in its blocks (route-in-moe): each block routes its token from the
    # router's logits as strata_moe_route_f32 does, block (0, t) writes the ids and weights
    "moe_gate_up_route": _K("moe_decode", "strata_moe_gate_up_route_{qtype}", "PqqPPPiiiPPii", 256,
                            "(gx, T, 1) and dynamic shared memory: moe_decode.gate_up_launch", ALL_QTYPES),
    "moe_down":         _K("moe_decode", "strata_moe_down_{qtype}", "PqPPPPiii", 256,
                           "(gx, T, 1) and dynamic shared memory: moe_decode.down_launch", ALL_QTYPES),
    "argmax":           _K("argmax", "strata_argmax_f32", "PPi", 1024, "B: a block per row"),
    "sample":           _K("sample", "strata_sample_f32", "PPPPPPPi", 1024, "(B, 1, 1); the block must be 1024"),
    "mask_logits":      _K("mask_logits", "strata_mask_logits_f32", "PPi", 256, "(ceil(V / 256), B, 1)"),
    "gdn_conv1d_step":  _K("gated_delta", "strata_gdn_conv1d_step_f32", "PPPPii", 256, "ceil(C / 256)"),
    # a batched step's rows of distinct sequences, each with its own states (row_states [rows] on the device)
    "gdn_conv1d_rows":  _K("gated_delta", "strata_gdn_conv1d_rows_f32", "PPqPPii", 256, "(ceil(C / 256), rows)"),
    "gdn_conv1d":       _K("gated_delta", "strata_gdn_conv1d_f32", "PPPPiiiq", 256, "ceil(C / 256)"),
    "gdn_step":         _K("gated_delta", "strata_gdn_step_f32", "PPPPPPPiiiif", 256, "(ceil(Dv / 32), Hv)"),
    "gdn_step_rows":    _K("gated_delta", "strata_gdn_step_rows_f32", "PPPPPPqPiiiif", 256,
                           "(ceil(Dv / 32), Hv, rows)"),
    "gdn_prompt":       _K("gated_delta", "strata_gdn_prompt_f32", "PPPPPPPiiiiifqq", 256, "(ceil(Dv / 32), Hv)"),
    # the chunked (WY / UT) form of gdn_prompt: prep per (chunk, head), then the scan over the chunks
    "gdn_chunk_prep":   _K("gated_delta_chunk", "strata_gdn_chunk_prep_f32", "PPPPPiiiifq", 256, "(ceil(T / 64), Hv)"),
    "gdn_chunk_scan":   _K("gated_delta_chunk", "strata_gdn_chunk_scan_f32", "PPPPPPiiiiiqq", 256,
                           "(ceil(Dv / 16), Hv)"),
    "gdn_gates":        _K("gated_delta", "strata_gdn_gates_f32", "PPPPPiii", 256, "ceil(T Hv / 256)"),
    "sigmoid_mul":      _K("gated_delta", "strata_sigmoid_mul_f32", "PPPiiqi", 256,
                           "(ceil(n / 256), min(rows, 65535)): it strides"),
    "bus_stamp":        _K("throttle", "strata_bus_stamp", "P", 1, "(1, 1)"),
    "bus_wait":         _K("throttle", "strata_bus_wait", "PQ", 1, "(1, 1)"),
    "bus_sleep":        _K("throttle", "strata_bus_sleep", "Q", 1, "(1, 1)"),
}
del _K


# Libraries built for one arch-specific target only, when the build's archs include its plain arch
# (setup.py ARCH_SPECIFIC): absent from other builds, and no reason to refuse a GPU they do not run on.
# The trial path each serves (KERNEL_TRIAL_PATHS), its library:
WGMMA_LIBRARIES = {"wgmma-gemm": ("moe_gemm_ws",), "wgmma-gemm-f16x": ("moe_gemm_ws",),
                   "wgmma-attention": ("attention_wg", "attention_ws")}
WGMMA_ARCH = "sm_90a"


def tma_attention_runs(paths: "KernelPaths", manifest: dict | None, compute_capability, head_dim: int | None = None) -> bool:
    """Whether prompt attention takes tma-attention's kernel (cuda/attention_ws.cu's TMA build) here:
    the path on, an sm_90 GPU, an install with the sm_90a library, and (given) a head dim it takes by
    default (TMA_DEFAULT_HEAD_DIMS)."""
    return (paths.tma_attention and (head_dim is None or head_dim in TMA_DEFAULT_HEAD_DIMS)
            and wgmma_unavailable(manifest, compute_capability, "attention_ws") is None)


def tma_gemm_runs(paths: "KernelPaths", manifest: dict | None, compute_capability) -> bool:
    """Whether prompt GEMMs of many rows take tma-gemm's f16 path here: the path on, an sm_90 GPU, an
    install with moe_gemm_ws.cu's sm_90a library (strata_moe_gemm_wst_f16 and its f16-X fallback)."""
    return paths.tma_gemm and wgmma_unavailable(manifest, compute_capability, "moe_gemm_ws") is None


def wgmma_unavailable(manifest: dict | None, compute_capability, library: str = "moe_gemm_ws") -> str | None:
    """Why a wgmma library cannot run here (this GPU's compute capability, the install's manifest),
    or None when it can."""
    cc = tuple(compute_capability or (0, 0))
    if cc != (9, 0):
        return f"it needs an sm_90 GPU (Hopper: H100, H200), and this one is sm_{cc[0]}{cc[1]}"
    entry = (manifest or {}).get("kernels", {}).get(library)
    if entry is None or WGMMA_ARCH not in entry.get("archs", []):
        return (f"this install has no {library} library for {WGMMA_ARCH} (build with "
                f"STRATA_CUDA_ARCHS=90 or on the sm_90 GPU)")
    return None


def cluster_unavailable(manifest: dict | None, compute_capability) -> str | None:
    """Why the cluster decode kernel (cuda/attention.cu strata_attention_decode_cl_*, the trial path
    cluster-decode) cannot run here, or None when it can: it needs an sm_90+ GPU and SASS built for this GPU's
    arch (code JIT-compiled from the install's lowest-arch PTX has no clusters, and the kernel traps there)."""
    cc = tuple(compute_capability or (0, 0))
    if cc < (9, 0):
        return f"thread block clusters need an sm_90 GPU or newer, and this one is sm_{cc[0]}{cc[1]}"
    arch = cc[0] * 10 + cc[1]
    archs = ((manifest or {}).get("kernels", {}).get("attention") or {}).get("archs", [])
    # SASS for this arch, or PTX of an arch from 90 to this one (setup.py gencode_flags' names)
    if f"sm_{arch}" not in archs and not any(a.startswith("compute_") and a[8:].isdigit() and 90 <= int(a[8:]) <= arch
                                             for a in archs):
        return (f"this install's attention library has no code for sm_{arch} with clusters (built for "
                f"{', '.join(archs) or 'nothing'}; build with STRATA_CUDA_ARCHS={arch} or on this GPU)")
    return None


def kernel_name(op: str, **fields) -> str:
    """The entry point's name of table op `op` for these field values."""
    return KERNELS[op].name(**fields)


def load_kernel(rt, device, op: str, **fields):
    """The runtime kernel of table op `op` (its library loaded by rt, which caches libraries)."""
    k = KERNELS[op]
    return k.open(rt.load_library(k.library), device, k.name(**fields))
