"""Frozen configuration records: the model's hyperparameters, the engine's knobs, sampling.

EngineConfig's fields are the engine flags: the CLI generates one flag per field, and
`env_overrides()` is the one place that reads STRATA_<FIELD> environment variables.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidArgument

SUPPORTED_ARCHITECTURES = ("qwen3moe", "qwen3next")
# The GPU ops' alternative kernel paths (strata.backends.cuda.kernels.KernelPaths), each on by default;
# --kernels-off names those to turn off, for A/B runs of one path against its fallback. tc-decode-attention:
# the split-K decode attention of f16 rows of at least TC_DECODE_FROM cells (strata.backends.cuda.kernels) on
# the tensor cores (cuda/attention_dec_tc.cu, head dims 64 and 128); shorter rows and other shapes take
# cuda/attention.cu's kernel. kv-ring: the quantized split-K decode (cuda/kv_quant.cu) at head dim 128 on
# sm_90 / sm_100 copies its tiles through a cp.async ring in shared memory, several tiles a warp in flight (off: one
# tile a warp in registers; the same bits). tma-attention: the prompt attention at head dim 128 on sm_90
# (a build with the sm_90a libraries) takes cuda/attention_ws.cu's TMA build, warp-specialized on wgmma
# (off, or elsewhere: cuda/attention_tc.cu's mma.sync kernel); at head dim 256 (Qwen3-Next) its 64-cell build.
# one-row-gemv: one-token GEMVs (the fused q|k|v and the attention output) of the types of one 32-weight
# block a unit (Q8_0, Q4_0, ...) one row a warp, four times the warps of the 4-row kernels, the same bits;
# a matrix then takes the split-K kernel only where one row a warp leaves it under 2 blocks an SM (off: the
# 4-row kernels, the 30B's attention output split-K). tma-gemm: on sm_90 (a build with the sm_90a libraries),
# a prompt chunk with rows enough to pay for it (strata.backends.cuda.moe.DQ_MIN_ROWS a weight matrix: a
# layer's experts on average, a dense projection's tokens) has its weights dequantized to f16 rows first
# (cuda/dequant.cu; the experts group by group in a scratch of at most DQ_SCRATCH_BYTES, taken only where the
# pool has room) and multiplied by cuda/moe_gemm_ws.cu's TMA build, both operands moved by the TMA and
# nothing decoded in the GEMM (strata_moe_gemm_wst_f16); the same bits as the decoding GEMMs (off, smaller
# chunks, no room, or elsewhere: cuda/moe_gemm.cu's mma.sync GEMMs).
# route-in-moe: a decode step's top-k routing runs in the MoE gate|up kernel's blocks (each routes its token
# from the router's logits, cuda/route.cuh's code, so the same ids and weights; block 0 of a token writes
# them for the down kernel and the host), one launch fewer a layer (strata_moe_gate_up_route_*), where the
# fused MoE kernels read every expert through the table (not a staged or host-split step) and the model
# routes at most 512 experts, 8 a token. norm-in-router: a decode step's post-attention residual add and
# RMSNorm run in the F32 router GEMV's blocks (each normalizes the rows itself, in strata_add_rms_norm_f32's
# order, while its share of the router streams in; block 0 writes both outputs), one launch fewer a layer
# (strata_add_norm_router_f32), where the router is F32 on the split GEMV and the rows fit its shared memory.
# Both give the same bits as off; --kernels-on fused-route turns both off (it makes the router and top-k
# its own way).
KERNEL_PATHS = ("fused-decode", "tensor-core-prompt", "group-on-device", "split-gemv", "pdl", "tc-attention",
                "tc-decode-attention", "kv-ring", "tma-attention", "one-row-gemv", "tma-gemm", "route-in-moe",
                "norm-in-router")
# Paths on trial: off unless --kernels-on names them, until the device has measured them faster and
# their GPU tests have passed. On Hopper's warpgroup MMA (sm_90 GPUs, a build that made the sm_90a
# libraries): wgmma-gemm the prompt GEMMs (cuda/moe_gemm_ws.cu, decoding the weights as they load);
# wgmma-gemm-f16x the same GEMMs reading X as f16 (cuda/moe_gemm_ws.cu's ws16 entry points: the expert rows
# gathered and SwiGLU's output written as f16, the dense projections' inputs rounded by a pass of their
# own), wgmma-attention the prompt attention at head dims 128 (cuda/attention_ws.cu, warp-specialized: its
# TMA build while tma-attention is on, its cp.async build with --kernels-off tma-attention) and 64
# (cuda/attention_wg.cu).
# fused-route: a decode step's F32 router routes in its GEMV's last block (cuda/gemv.cu's
# strata_router_*), one launch fewer a layer, the same bits; measured 0.2-0.4 us a layer slower than the
# router and moe_route apart (H100, both with PDL).
# cluster-decode: an f16 decode row of fewer than CLUSTER_DECODE_BELOW cells (strata.backends.cuda.kernels)
# attends in one launch on sm_90 (cuda/attention.cu strata_attention_decode_cl_*: a cluster of 16 blocks a KV
# head, the split-K's partials combined through the cluster's shared memory) instead of the split-K kernel and
# the combine's launch; longer rows, and other GPUs, as before. Measured on an H200: the attention's graph at
# 512 cells 7.9 against 9.6 us a layer, the whole decode step within 1% either way.
KERNEL_TRIAL_PATHS = ("wgmma-gemm", "wgmma-gemm-f16x", "wgmma-attention", "fused-route", "cluster-decode")
KV_CHOICES = ("f16", "int8", "q4_0", "k8v4", "auto")     # strata.quant.kv's formats, and auto
SPEC_MAX_DRAFTS = 7                 # a verify window of N + 1 rows fits the batched decode kernels (T <= 8)
# cells a --kv-resident VRAM ring holds past its window (cuda/kv_codec.cuh kVramSlack), where a
# speculation window's rejected rows land (strata.backends.cuda.memory.DeviceKV); > SPEC_MAX_DRAFTS + 1
KV_VRAM_SLACK = 16
PARALLEL_MAX = 8                    # --parallel: a batched decode step takes up to 8 rows (GEMV_MAX_T)
SPEC_AUTO_MAX_DRAFTS = 4            # --spec auto chooses N in 0..4 (windows of 1..5 rows)
DRAFT_RING_PAGE_CELLS = 256         # the draft ring's page: its slots are the window rounded up to pages,
                                    # plus one page (rows written ahead of the window: a verify window's
                                    # chain, a prompt batch straddling a page)
DRAFT_PROMPT_MODES = ("batched", "own")


def draft_ring_cells(window: int) -> int:
    """Slots of the draft layer's K/V ring for a --draft-window of `window` cells (0: no ring)."""
    if window <= 0:
        return 0
    page = DRAFT_RING_PAGE_CELLS
    return -(-window // page) * page + page


def draft_ring(window: int, max_context: int) -> tuple[int, int]:
    """(window, ring cells) of the draft layer's K/V under --draft-window `window` at this context;
    (0, 0), the whole context's cells, where there is no window or the ring would not be smaller."""
    cells = draft_ring_cells(window)
    return (window, cells) if 0 < cells < max_context else (0, 0)


def spec_max_drafts(spec) -> int:
    """Drafts per verify window at most for an EngineConfig.spec value: N, or auto's ceiling."""
    return SPEC_AUTO_MAX_DRAFTS if str(spec) == "auto" else int(spec)


def _positive(obj, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise InvalidArgument(f"{type(obj).__name__}.{n} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class ModelArgs:
    """Hyperparameters of a qwen3moe or qwen3next model (names follow HF's Qwen3MoeConfig / Qwen3NextConfig).

    The fields after num_mtp_layers are qwen3next's (0 where unused): layer l is gated full attention
    when (l + 1) % full_attention_interval == 0 and a Gated DeltaNet layer otherwise.
    """
    architecture: str
    vocab_size: int                 # V
    hidden_size: int                # D
    num_hidden_layers: int
    num_attention_heads: int        # H
    num_key_value_heads: int        # Hk
    head_dim: int                   # Dh
    num_experts: int                # E
    num_experts_per_tok: int        # A
    moe_intermediate_size: int      # I
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    norm_topk_prob: bool = True
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    num_mtp_layers: int = 0         # MTP draft layers after the main stack (0 or 1)
    full_attention_interval: int = 0
    partial_rotary_factor: float = 1.0          # RoPE on the first head_dim * factor dims of each head
    linear_num_key_heads: int = 0               # Hg: q/k heads of a Gated DeltaNet layer
    linear_num_value_heads: int = 0             # Hv
    linear_key_head_dim: int = 0                # Dk
    linear_value_head_dim: int = 0              # Dv
    linear_conv_kernel_dim: int = 0             # K of the causal depthwise conv1d
    shared_expert_intermediate_size: int = 0    # Is; 0 = no shared expert

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise InvalidArgument(f"architecture {self.architecture!r} is not supported "
                                  f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        _positive(self, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "max_position_embeddings")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgument(f"ModelArgs: {self.num_attention_heads} query heads are not a multiple "
                                  f"of {self.num_key_value_heads} KV heads")
        if self.num_experts_per_tok > self.num_experts:
            raise InvalidArgument(f"ModelArgs: top-{self.num_experts_per_tok} routing over only "
                                  f"{self.num_experts} experts")
        if self.architecture == "qwen3next":
            _positive(self, "full_attention_interval", "linear_num_key_heads", "linear_num_value_heads",
                      "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise InvalidArgument(f"ModelArgs: {self.linear_num_value_heads} linear-attention value heads are "
                                      f"not a multiple of {self.linear_num_key_heads} key heads")
            if not 0.0 < self.partial_rotary_factor <= 1.0 or int(self.head_dim * self.partial_rotary_factor) % 2:
                raise InvalidArgument(f"ModelArgs: partial_rotary_factor {self.partial_rotary_factor} must give an "
                                      f"even number of rotary dims of the {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in (None, "default", "linear", "yarn"):
                raise InvalidArgument(f"ModelArgs: rope scaling {kind!r} is not supported")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def is_full_attention(self, layer: int) -> bool:
        """Whether layer l (an MTP layer too) is softmax attention rather than a Gated DeltaNet layer."""
        if self.architecture != "qwen3next" or layer >= self.num_hidden_layers:
            return True
        return (layer + 1) % self.full_attention_interval == 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs; each field is a CLI flag (--vram-budget-gib) and an env var (STRATA_VRAM_BUDGET_GIB)."""
    device: str = field(default="auto", metadata={"help": "cpu, cuda or auto (the GPU when one is present)"})
    gpus: str = field(default="0", metadata={"help": "GPU ordinals to use, comma-separated; two or more split the "
                                                     "layers over them (--layer-split), and an ordinal may repeat "
                                                     "(0,0: two logical cards on one GPU)"})
    vram_budget_gib: float | str = field(default=0.0, metadata={
        "help": "cap on VRAM Strata uses; 0 = all free VRAM; with several --gpus one cap for each (8,12) or one "
                "for all"})
    expert_cache: str = field(default="auto", metadata={"help": "expert cache slots: auto or N"})
    expert_policy: str = field(default="lru", metadata={"help": "expert cache admission: lru (every miss, over the "
                                                                   "least recently used) or lfu (over a colder expert)"})
    decode_misses: str = field(default="zero-copy", metadata={"help": "how a decode step reads experts not in VRAM: "
                                                                       "zero-copy (in place over the bus, routing stays "
                                                                       "on the device, CUDA graphs) or staged (each "
                                                                       "layer's routing read on the host, missed experts "
                                                                       "copied first; eager; for comparison)"})
    pcie_gbs: float = field(default=0.0, metadata={
        "help": "cap host->device expert traffic at this many GB/s (0: the bus as it is), so a fast bus "
                "stands in for a slower one (a PCIe 4.0 x16 slot moves about 25)"})
    pin_limit_gib: float = field(default=0.0, metadata={"help": "cap on the host memory pinned for streamed experts "
                                                                 "(a prefix of whole layers of experts.bin); the rest "
                                                                 "is staged through small pinned buffers, decode "
                                                                 "misses staged, no CUDA graphs; 0 = all the system "
                                                                 "allows"})
    cpu_experts: str = field(default="off", metadata={
        "help": "the host's cores compute part of each prompt chunk's missed experts (from the pinned arena, "
                "while the GPU computes the rest), GPU only: off, auto (the share a cost model of the measured "
                "bus and host rates finds faster; nothing where it does not pay, as for long chunks) or a "
                "share of the missed experts in (0, 1] for A/B runs; off by default until the device A/B "
                "has run"})
    expert_profile: str = field(default="", metadata={"help": "routing profile (.npy) to start the expert cache "
                                                                 "warm from; written back when the engine closes"})
    prefill: str = field(default="auto", metadata={"help": "prompt chunk: auto, N or auto:N (a ceiling)"})
    prefill_rule: str = field(default="auto", metadata={"help": "prompt chunk, ring and kept cache rule under "
                                                                "--prefill auto: auto (the plan the prompt cost model "
                                                                "predicts fastest, the byte-budget ring its floor), "
                                                                "bytes (the ring a byte budget, the largest chunk that "
                                                                "leaves it full) or slots (the older rule: 384 slots, "
                                                                "the first chunk of a fixed list that fits); bytes and "
                                                                "slots for A/B runs"})
    kernels_off: str = field(default="", metadata={
        "help": "GPU kernel paths to turn off for A/B runs, comma-separated: " + ", ".join(KERNEL_PATHS)})
    kernels_on: str = field(default="", metadata={
        "help": "GPU kernel paths on trial to turn on for A/B runs, comma-separated: " + ", ".join(KERNEL_TRIAL_PATHS)
                + " (the wgmma ones: Hopper's warpgroup MMA, sm_90 GPUs only)"})
    kv: str = field(default="f16", metadata={"help": "KV cache format: f16, int8 (a scale per 64 values), q4_0 "
                                                     "(Hadamard-rotated 4-bit), k8v4 (int8 K, rotated 4-bit V) "
                                                     "or auto (from the measured accuracy and the plan; "
                                                     "docs/DESIGN.md)"})
    kv_resident: int = field(default=0, metadata={"help": "N below the context: every KV cell in pinned host memory and "
                                                          "the newest N of each layer also in a VRAM window; decode "
                                                          "reads the older cells over the bus (GPU); 0 = all in VRAM"})
    max_context: int = field(default=0, metadata={"help": "longest sequence (prompt + output) in tokens; 0 = the "
                                                          "model's trained context, lowered to what VRAM (or host "
                                                          "memory) holds beside the expert cache's minimum"})
    spec: str = field(default="0", metadata={"help": "speculative decoding: N tokens drafted per verify window of "
                                                      "N + 1 rows, or auto (N from measured acceptance and step "
                                                      "costs, drafting off where it does not pay); needs --mtp; "
                                                      "0 = off"})
    mtp: bool = field(default=False, metadata={"help": "draft with the model's MTP layer (with --spec N)"})
    draft_window: int = field(default=0, metadata={
        "help": "with --mtp: the draft layer attends over its last W cells only, its K/V a ring of W cells "
                "(rounded up to 256-cell pages, plus one page) in VRAM instead of the whole context's; the "
                "VRAM saved goes to the expert cache; 0 = the whole context"})
    draft_prompt: str = field(default="batched", metadata={
        "help": "how a prompt writes the draft layer's K/V: batched (each chunk's cells with the prompt "
                "path's GEMMs, K/V only) or own (the drafter's own pass, the whole layer a few rows at a "
                "time, so its experts are not lent to the prompt: --mtp-room-min does not apply; for A/B "
                "runs)"})
    mtp_room_min: int = field(default=1024, metadata={
        "help": "with --mtp under a VRAM budget: a request that reads at least this many prompt tokens lends "
                "the draft layer's cached experts to the prompt's expert ring while it reads (copied back "
                "before its first decode step; on the 30B shape at 8 GiB it read 4K prompts 1.38x as fast, "
                "32K ones 1.04x); -1 = never"})
    keep_conversations_gib: float = field(default=4.0, metadata={
        "help": "host RAM for the K/V of conversations a new request pushes out of a slot, so a returning "
                "one is copied back instead of read again (at most a quarter of the available host "
                "memory); 0 = none kept"})
    parallel: int | str = field(default=1, metadata={"help": "sequences served at once (1..8, or auto: as many "
                                                              "of 4 or 2 as the plan holds without a shorter context "
                                                              "or fewer cached experts; serve's default): each has "
                                                              "its own KV of --max-context cells and its own cached "
                                                              "conversation, and their decode steps run batched"})
    batch_max: int = field(default=0, metadata={"help": "rows of one batched decode step of --parallel slots "
                                                         "(1..--parallel; 1: each sequence steps alone); 0 = auto: "
                                                         "the grouping whose measured step times cost least, so a "
                                                         "budget where each extra row's experts come over the bus "
                                                         "runs smaller steps"})
    layer_split: str = field(default="auto", metadata={
        "help": "with several --gpus, the main layers each card runs, in order: auto (the split that caches "
                "the most experts within each card's budget) or counts like 20,28 summing to the model's layers"})
    cuda_graphs: bool = field(default=True, metadata={"help": "decode as one CUDA graph per step shape, replayed "
                                                                "every token (STRATA_CUDA_GRAPHS=0: launch each "
                                                                "kernel from Python)"})
    cache_dir: str = field(default="", metadata={"help": "where GGUF sources are converted to packs "
                                                          "(default ~/.cache/strata)"})

    def __post_init__(self):
        if self.device not in ("cpu", "cuda", "auto"):
            raise InvalidArgument(f"device must be cpu, cuda or auto, got {self.device!r}")
        budgets = _budgets(self.vram_budget_gib)
        cards = _gpu_ordinals(self.gpus)
        if len(budgets) not in (1, len(cards)):
            raise InvalidArgument(f"--vram-budget-gib {self.vram_budget_gib}: give one budget, or one for each of "
                                  f"the {len(cards)} --gpus {self.gpus}")
        if len(budgets) == 1:       # one number, as given before a split existed: a float
            object.__setattr__(self, "vram_budget_gib", budgets[0])
        _check_split(self.layer_split, len(cards))
        if not 0 <= self.pcie_gbs < 1e6:
            raise InvalidArgument(f"pcie_gbs must be >= 0 (0: no cap) and finite, got {self.pcie_gbs}")
        if not 0 <= self.pin_limit_gib < 1 << 20:
            raise InvalidArgument(f"pin_limit_gib must be >= 0 and finite, got {self.pin_limit_gib}")
        if self.kv not in KV_CHOICES:
            raise InvalidArgument(f"kv must be one of {', '.join(KV_CHOICES)}, got {self.kv!r}")
        if isinstance(self.max_context, bool) or not isinstance(self.max_context, int) or self.max_context < 0:
            raise InvalidArgument(f"max_context must be a number of tokens (0 = the model's trained context), "
                                  f"got {self.max_context!r}")
        spec = str(self.spec).strip()
        if isinstance(self.spec, bool) or not (spec == "auto" or spec.isdigit()):
            raise InvalidArgument(f"spec must be a number of drafts (0 = off) or auto, got {self.spec!r}")
        object.__setattr__(self, "spec", spec if spec == "auto" else str(int(spec)))
        if self.kv_resident < 0:
            raise InvalidArgument("kv_resident must be >= 0")
        if isinstance(self.draft_window, bool) or not isinstance(self.draft_window, int) or self.draft_window < 0:
            raise InvalidArgument(f"draft_window must be a number of cells (0 = the whole context), "
                                  f"got {self.draft_window!r}")
        if self.draft_prompt not in DRAFT_PROMPT_MODES:
            raise InvalidArgument(f"draft_prompt must be one of {', '.join(DRAFT_PROMPT_MODES)}, "
                                  f"got {self.draft_prompt!r}")
        if isinstance(self.mtp_room_min, bool) or not isinstance(self.mtp_room_min, int) or self.mtp_room_min < -1:
            raise InvalidArgument(f"mtp_room_min must be a number of prompt tokens (-1: never), got {self.mtp_room_min!r}")
        if not 0 <= self.keep_conversations_gib < 1 << 20:
            raise InvalidArgument(f"keep_conversations_gib must be >= 0 (0: none kept) and finite, got "
                                  f"{self.keep_conversations_gib}")
        if isinstance(self.parallel, str) and self.parallel.strip().isdigit():     # a flag's or STRATA_PARALLEL's text
            object.__setattr__(self, "parallel", int(self.parallel))
        if isinstance(self.parallel, str) and self.parallel.strip().lower() == "auto":
            object.__setattr__(self, "parallel", "auto")       # strata.engine.parallel_choice resolves it at load
        elif isinstance(self.parallel, bool) or not isinstance(self.parallel, int) \
                or not 1 <= self.parallel <= PARALLEL_MAX:
            raise InvalidArgument(f"parallel must be auto or a number of sequences from 1 to {PARALLEL_MAX} (the rows "
                                  f"of one batched decode step), got {self.parallel!r}")
        slots = PARALLEL_MAX if self.parallel == "auto" else self.parallel
        if isinstance(self.batch_max, bool) or not isinstance(self.batch_max, int) \
                or not 0 <= self.batch_max <= slots:
            raise InvalidArgument(f"batch_max must be 0 (auto) or a number of rows from 1 to --parallel "
                                  f"({self.parallel}), got {self.batch_max!r}")
        _refuse_not_implemented(self)
        for what, known in (("kernels_off", KERNEL_PATHS), ("kernels_on", KERNEL_TRIAL_PATHS)):
            unknown = [n for n in getattr(self, what).split(",") if n.strip() and n.strip() not in known]
            if unknown and what == "kernels_on" and unknown[0].strip() in KERNEL_PATHS:
                raise InvalidArgument(f"kernels_on: kernel path {unknown[0].strip()!r} is on by default "
                                      f"(--kernels-off {unknown[0].strip()} turns it off)")
            if unknown:
                raise InvalidArgument(f"{what}: unknown kernel path {unknown[0].strip()!r} "
                                      f"(known: {', '.join(known)})")
        if self.decode_misses not in ("zero-copy", "staged"):
            raise InvalidArgument(f"decode_misses must be zero-copy or staged, got {self.decode_misses!r}")
        if self.prefill_rule not in ("auto", "bytes", "slots"):
            raise InvalidArgument(f"prefill_rule must be auto, bytes or slots, got {self.prefill_rule!r}")
        if str(self.cpu_experts).strip().lower() not in ("off", "auto"):
            try:
                share = float(self.cpu_experts)
            except ValueError:
                share = -1.0
            if not 0.0 < share <= 1.0:
                raise InvalidArgument(f"cpu_experts must be off, auto or a share of the missed experts in (0, 1], "
                                      f"got {self.cpu_experts!r}")
        if self.expert_policy not in ("lru", "lfu"):
            raise InvalidArgument(f"expert_policy must be lru or lfu, got {self.expert_policy!r}")
        if self.expert_cache != "auto" and not self.expert_cache.isdigit():
            raise InvalidArgument(f"expert_cache must be auto or a number of slots, got {self.expert_cache!r}")
        p = self.prefill
        if not (p == "auto" or p.isdigit() or (p.startswith("auto:") and p[5:].isdigit())):
            raise InvalidArgument(f"prefill must be auto, N or auto:N, got {p!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from keyword arguments, then apply STRATA_<FIELD> environment overrides."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidArgument(f"unknown engine option {unknown[0]!r} (known: {', '.join(sorted(names))})")
        return cls(**{**kwargs, **env_overrides(cls)})


    def cards(self) -> list[tuple[int, float]]:
        """(GPU ordinal, VRAM budget in GiB, 0 = all free) of each card of --gpus, in order."""
        ordinals, budgets = _gpu_ordinals(self.gpus), _budgets(self.vram_budget_gib)
        return [(o, budgets[min(i, len(budgets) - 1)]) for i, o in enumerate(ordinals)]

    @property
    def split(self) -> bool:
        """Whether the layers are split over several cards (two or more --gpus)."""
        return len(_gpu_ordinals(self.gpus)) > 1


def _gpu_ordinals(text: str) -> list[int]:
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or not all(p.isdigit() for p in parts):
        raise InvalidArgument(f"--gpus must be GPU ordinals, comma-separated (like 0 or 0,1), got {text!r}")
    return [int(p) for p in parts]


def _budgets(value) -> list[float]:
    """--vram-budget-gib's budgets in GiB: one number, or several comma-separated (one per card)."""
    if isinstance(value, bool):
        raise InvalidArgument(f"vram_budget_gib must be a number of GiB, got {value!r}")
    parts = [value] if isinstance(value, (int, float)) else str(value).split(",")
    out = []
    for p in parts:
        try:
            out.append(float(p))
        except ValueError:
            raise InvalidArgument(f"--vram-budget-gib must be GiB (8) or one per card (8,12), got {value!r}") from None
    if any(not 0 <= b < 1 << 20 for b in out):      # (no inf or nan: a budget becomes bytes)
        raise InvalidArgument(f"vram_budget_gib must be >= 0 and finite, got {value}")
    return out


def split_counts(text: str) -> list[int] | None:
    """--layer-split's counts (None for auto); InvalidArgument where they are not counts."""
    if text == "auto":
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) < 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise InvalidArgument(f"--layer-split must be auto or two or more layer counts >= 1 (like 20,28), got {text!r}")
    return [int(p) for p in parts]


def _check_split(text: str, num_cards: int) -> None:
    counts = split_counts(text)
    if counts is not None and len(counts) != num_cards:
        raise InvalidArgument(f"--layer-split {text}: {len(counts)} ranges for {num_cards} card(s) of --gpus; give one "
                              f"count per card (--gpus 0,1 --layer-split 20,28; 0,0 for two logical cards on one GPU)")


def refuse_gpu_kernel_paths(cfg: "EngineConfig") -> None:
    """--kernels-on / --kernels-off on an engine that runs on the CPU (asked for, or what auto found):
    refused, as they would do nothing there."""
    if cfg.kernels_on.strip() or cfg.kernels_off.strip():
        flag = "--kernels-on " + cfg.kernels_on if cfg.kernels_on.strip() else "--kernels-off " + cfg.kernels_off
        raise InvalidArgument(f"{flag}: kernel paths are the GPU's; the CPU backend has one path")


def _refuse_not_implemented(cfg: "EngineConfig") -> None:
    """Flags the engine accepts in form but does not run yet: refused here, one line each, so none
    silently does nothing. The issue that builds a feature lifts its own refusal."""
    if cfg.kv_resident and cfg.device == "cpu":
        raise InvalidArgument(f"--kv-resident {cfg.kv_resident}: the CPU's KV is in host memory already; the flag "
                              f"is the GPU's")
    if cfg.device == "cpu":
        refuse_gpu_kernel_paths(cfg)
    if cfg.device == "cpu" and str(cfg.cpu_experts).strip().lower() != "off":
        raise InvalidArgument(f"--cpu-experts {cfg.cpu_experts}: on the CPU every expert runs on the host already; "
                              f"the flag splits the GPU's missed experts")
    if cfg.kv_resident and cfg.draft_window:
        raise InvalidArgument(f"--kv-resident {cfg.kv_resident} with --draft-window {cfg.draft_window}: the draft "
                              f"layer's K/V ring is VRAM-only, and with --kv-resident it keeps the host copy and the "
                              f"window every layer has (use one of them)")
    if cfg.spec != "0" and not cfg.mtp:
        raise InvalidArgument(f"--spec {cfg.spec} needs --mtp: the model's MTP layer is the only drafter")
    if cfg.mtp and cfg.spec == "0":
        raise InvalidArgument("--mtp drafts only under --spec N or --spec auto")
    if cfg.draft_window and not cfg.mtp:
        raise InvalidArgument(f"--draft-window {cfg.draft_window} needs --mtp --spec N: it is the draft layer's "
                              f"K/V window")
    if spec_max_drafts(cfg.spec) > SPEC_MAX_DRAFTS:
        raise InvalidArgument(f"--spec {cfg.spec}: at most {SPEC_MAX_DRAFTS} drafts per verify window")
    if cfg.parallel != "auto" and cfg.parallel > 1 and cfg.draft_window:
        raise InvalidArgument(f"--parallel {cfg.parallel} with --draft-window {cfg.draft_window}: the draft layer's "
                              f"K/V ring holds one sequence (use one of them)")
    if cfg.split:
        _refuse_with_split(cfg)


def _refuse_with_split(cfg: "EngineConfig") -> None:
    """A layer split over several cards (strata.engine.layer_split) is the GPU's."""
    if cfg.device == "cpu":
        raise InvalidArgument(f"--gpus {cfg.gpus}: a layer split is over GPUs; the CPU runs every layer already")


def _parse_field(f: dataclasses.Field, text: str) -> Any:
    if f.type in (bool, "bool"):
        return text.strip().lower() in ("1", "true", "yes", "on")
    for t in (int, float):
        if f.type in (t, t.__name__):
            return t(text)
    return text


def env_overrides(cls=EngineConfig, environ=None) -> dict[str, Any]:
    """STRATA_<FIELD> values for the fields of `cls`; the only reader of Strata's environment."""
    environ = os.environ if environ is None else environ
    out = {}
    for f in dataclasses.fields(cls):
        key = "STRATA_" + f.name.upper()
        if key in environ:
            try:
                out[f.name] = _parse_field(f, environ[key])
            except ValueError:
                raise InvalidArgument(f"{key}={environ[key]!r} is not a valid {f.type}") from None
    return out


def engine_kwargs(args) -> dict[str, Any]:
    """The EngineConfig fields set on parsed flags (`args`; an unset flag is None). Here, beside
    EngineConfig, so that strata.cli and strata.server.cli both read it and neither imports the other."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
            if getattr(args, f.name, None) is not None}


def env_value(name: str, default: str | None = None) -> str | None:
    """A non-field STRATA_<NAME> setting (paths, debug switches), read through the same one place."""
    return os.environ.get("STRATA_" + name.upper(), default)


MAX_LOGIT_BIAS = 1024          # tokens one request may bias
MAX_TOP_LOGPROBS = 20          # rivals reported per token
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0     # (1 is none) finite logits either way


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None   # None: the rest of the context
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # strata.engine.logits: the logits adjusted on the host before the pick (any of these set)
    presence_penalty: float = 0.0           # subtracted once from each token the reply has used
    frequency_penalty: float = 0.0          # subtracted per use of the token in the reply
    repetition_penalty: float = 1.0         # prompt and reply tokens: a logit > 0 divided by it, < 0 times it
    logit_bias: tuple[tuple[int, float], ...] = ()     # (token id, added to its logit)
    logprobs: int | None = None             # each picked token's log-probability and its k likeliest rivals
    prompt_logprobs: int | None = None      # the same for every prompt token after the first (echo)

    def __post_init__(self):
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 0):
            raise InvalidArgument(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0):
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgument(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidArgument("stop must be a non-empty string or a list of them")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidArgument(f"{name} must be between -2 and 2, got {getattr(self, name)!r}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidArgument(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                                  f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}")
        try:
            bias = tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items())
        except (TypeError, ValueError):
            raise InvalidArgument(f"logit_bias must map token ids to numbers, got {str(self.logit_bias)[:80]}") from None
        if len(bias) > MAX_LOGIT_BIAS or any(not -100.0 <= b <= 100.0 for _, b in bias):
            raise InvalidArgument(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, each biased by -100..100")
        object.__setattr__(self, "logit_bias", bias)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS):
                raise InvalidArgument(f"{name} must be an integer 0..{MAX_TOP_LOGPROBS} or None, got {k!r}")

    @property
    def on_host(self) -> bool:
        """Whether the picks need the logits on the host (penalties, a bias or log-probabilities):
        strata.engine.logits adjusts them there; otherwise the GPU picks on the device."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.logprobs is not None)
