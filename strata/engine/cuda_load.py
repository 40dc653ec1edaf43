"""What the GPU runner decides once, at load: whether the GPU runs this pack and config, the VRAM
budget and plan (strata.engine.planner, from copy rates measured here), the routing profile, the
expert store the plan asks for, and how decode reads its misses (zero-copy, or staged with graphs
off). strata.engine.cuda_runner.CudaRunner calls these in its constructor.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..config import EngineConfig
from ..errors import InvalidArgument, UnsupportedError
from .kv_choice import GPU_KV_FORMATS
from .memory_model import VRAM_RESERVE_BYTES

PLAN_MEASURE_BYTES = 32 << 20      # the copy rates the plan's predicted speeds use, measured at load (a few ms)


def check_config(pack, config: EngineConfig) -> None:
    """UnsupportedError / InvalidArgument for what the GPU runner does not run (yet)."""
    if pack.args.architecture not in ("qwen3moe", "qwen3next"):
        raise UnsupportedError(f"{pack.args.architecture} runs on the CPU backend only so far (--device cpu)")
    if pack.args.architecture == "qwen3next":
        if config.kv_resident:
            raise UnsupportedError(f"--kv-resident {config.kv_resident}: qwen3next's KV on the host is not built yet "
                                   "(its attention layers' cache is its own; 0 runs it)")
    if config.kv not in GPU_KV_FORMATS:
        raise InvalidArgument(f"--kv {config.kv}: the GPU runs {', '.join(GPU_KV_FORMATS)}")
    if config.kv != "f16":              # cuda/kv_quant.cu's kernels and the format's blocks
        from ..backends.cuda.kernels import ATTENTION_HEAD_DIMS
        from ..quant import kv as kv_formats
        if pack.args.head_dim not in ATTENTION_HEAD_DIMS:
            raise UnsupportedError(f"--kv {config.kv}: the GPU's quantized KV kernels take head dims "
                                   f"{ATTENTION_HEAD_DIMS}, this model's is {pack.args.head_dim} (--kv f16 runs it)")
        for codec in kv_formats.codecs(config.kv):
            codec.check(pack.args.head_dim)


def draft_ring(config: EngineConfig, args, max_context: int) -> tuple[int, int] | None:
    """The draft layer's K/V ring (window, cells) under --draft-window with --mtp --spec, None where
    it keeps the whole context (config.draft_ring); UnsupportedError where the split-K decode kernels,
    the only ones that read a ring, do not take the head layout."""
    from ..backends.cuda.kernels import split_k_takes
    from ..config import draft_ring as ring_of
    if not (config.mtp and str(config.spec) != "0" and args.num_mtp_layers):
        return None
    window, cells = ring_of(config.draft_window, max_context)
    if not cells:
        return None
    if not split_k_takes(args.num_attention_heads, args.num_key_value_heads, args.head_dim):
        raise UnsupportedError(f"--draft-window {window}: the draft layer's K/V ring is read by the split-K decode "
                               f"kernels, which do not take {args.num_attention_heads} query heads over "
                               f"{args.num_key_value_heads} KV heads of {args.head_dim} (0 runs it)")
    return window, cells


def check_parallel(config: EngineConfig, args) -> None:
    """--parallel N > 1: the batched step's rows read their slots' cells through the split-K decode
    attention, which takes head dims ATTENTION_HEAD_DIMS and up to 16 query heads per KV head (8 at
    Dh 256); other shapes read one sequence from cell 0 (UnsupportedError)."""
    from ..backends.cuda.kernels import ATTENTION_HEAD_DIMS, split_k_takes
    if config.parallel > 1 and not split_k_takes(args.num_attention_heads, args.num_key_value_heads, args.head_dim):
        raise UnsupportedError(f"--parallel {config.parallel}: batched slots on the GPU need head dim in "
                               f"{ATTENTION_HEAD_DIMS} and at most 16 query heads per KV head (8 at 256); this "
                               f"model has {args.head_dim} and {args.num_attention_heads // args.num_key_value_heads} "
                               f"(--parallel 1 runs it)")


def check_trial_paths(paths, args, dense: dict | None = None) -> None:
    """A trial kernel path (--kernels-on) this model would never take is refused in one line:
    wgmma-attention has kernels for head dims 64 and 128 only; fused-route for F32 routers of at most
    MOE_ROUTE_MAX_EXPERTS experts, top-k <= MOE_ROUTE_MAX_TOP_K. dense: the pack's dense tensor table
    (name -> {"qtype", ...}), where the routers' types are read."""
    from ..backends.cuda.kernels import MOE_ROUTE_MAX_EXPERTS, MOE_ROUTE_MAX_TOP_K, WG_ATTENTION_HEAD_DIMS
    dh = args.head_dim
    dims = sorted(WG_ATTENTION_HEAD_DIMS)    # Dh 256's TMA build is tma-attention's (on by default)
    if paths.wgmma_attention and dh not in dims:
        raise UnsupportedError(f"kernel path wgmma-attention (--kernels-on): this model's head dim is {dh}; the "
                               f"path's kernels take {', '.join(map(str, dims))}")
    if paths.fused_route:
        types = sorted({t["qtype"] for name, t in (dense or {}).items() if name.endswith("ffn_gate_inp.weight")})
        E, k = args.num_experts, args.num_experts_per_tok
        why = (f"its routers are {', '.join(types) or 'absent'}, not F32" if types != ["F32"] else
               f"it routes {E} experts top-{k}, past the kernel's {MOE_ROUTE_MAX_EXPERTS} and top-{MOE_ROUTE_MAX_TOP_K}"
               if E > MOE_ROUTE_MAX_EXPERTS or k > MOE_ROUTE_MAX_TOP_K else None)
        if why:
            raise UnsupportedError(f"kernel path fused-route (--kernels-on): this model never takes it: {why}")


def vram_budget(dev, config: EngineConfig) -> int:
    """Free VRAM less the reserve, capped by --vram-budget-gib."""
    free, _ = dev.memory_info()
    budget = max(0, free - VRAM_RESERVE_BYTES)
    if config.vram_budget_gib:
        budget = min(budget, int(config.vram_budget_gib * 2**30))
    return budget


class VramPlan(NamedTuple):
    plan: object                 # strata.engine.planner's plan
    sizes: object                # PackSizes, for the loan of each prompt
    cells: int                   # KV cells a prompt's attention spans (the context), wherever they live
    bandwidths: object           # Bandwidths the plan's predicted speeds use
    measured_h2d_gb_s: float     # the pinned copy rate measured here (before --pcie-gbs)


def vram_plan(rt, dev, stream, pack, config: EngineConfig, budget_bytes: int, max_context: int) -> VramPlan:
    """The VRAM plan for this pack and budget (InvalidArgument naming the bytes needed when the
    budget is too small)."""
    from ..backends.cuda.bandwidth import copy_rates
    from ..backends.cuda.kernels import KernelPaths, tma_attention_runs, tma_gemm_runs
    from .planner import Bandwidths, PackSizes, make_plan
    sizes = PackSizes.of_pack(pack)
    cfg = dataclasses.replace(config, max_context=max_context)
    h2d, d2d = copy_rates(rt, dev, stream, PLAN_MEASURE_BYTES, repeats=3)
    measured = h2d
    if config.pcie_gbs:
        h2d = min(h2d, config.pcie_gbs)          # what the plan's predicted speeds see
    bandwidths = Bandwidths(h2d, d2d, f"measured at load on {dev.name}")
    paths, manifest = KernelPaths.without(config.kernels_off, config.kernels_on), rt.read_manifest()
    tma = tma_attention_runs(paths, manifest, dev.compute_capability, pack.args.head_dim)
    plan = make_plan(sizes, cfg, budget_bytes, "runner", bandwidths, dev.multiprocessor_count, tma_attention=tma,
                     tma_gemm=tma_gemm_runs(paths, manifest, dev.compute_capability))
    return VramPlan(plan, sizes, max_context, bandwidths, measured)


def load_profile(path: Path | None, num_layers: int, num_experts: int):
    """The routing profile [layers, E] at --expert-profile, or None where there is none yet."""
    if path is None or not path.exists():
        return None
    try:
        profile = np.load(path)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{path}: not a routing profile ({exc})") from None
    if profile.shape != (num_layers, num_experts):
        raise InvalidArgument(f"{path}: routing profile of shape {profile.shape}, this model has "
                              f"{(num_layers, num_experts)} (layers, experts)")
    return profile


def write_profile(path: Path, uses: np.ndarray, base: np.ndarray | None) -> None:
    """Routing counts since load (plus the profile the run started from) to path, atomically."""
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, uses + (0 if base is None else base))
    tmp.replace(path)


def open_store(rt, dev, stream, pack, vram: VramPlan, config: EngineConfig, profile):
    """The ExpertStore the plan asks for: everything resident, or a cache of the plan's slots, the
    prompt ring and its loan over the pinned arena (the bus capped at --pcie-gbs)."""
    from .experts.bus_cap import BusCap
    from .experts.store import ExpertStore
    plan, a = vram.plan, pack.args
    resident = plan.cache_slots >= plan.total_experts and plan.prefill_ring == 0
    return ExpertStore(rt, dev, stream, pack,
                       cache_slots=None if resident else plan.cache_slots,
                       ring_slots=0 if resident else plan.prefill_ring,
                       policy=config.expert_policy, profile=profile,
                       kept_slots=None if resident else plan.prompt_cache_slots,
                       pool_bytes=plan.bytes_needed,
                       pin_limit_bytes=int(config.pin_limit_gib * 2**30),
                       bus_cap=None if resident or not config.pcie_gbs else
                       BusCap(rt, dev, config.pcie_gbs, vram.measured_h2d_gb_s),
                       # the draft layer's experts stay cached under --mtp (the plan's "mtp" bytes)
                       fixed_layers=tuple(range(a.num_hidden_layers, a.num_hidden_layers + a.num_mtp_layers))
                       if config.mtp else ())


def decode_misses(store, config: EngineConfig) -> tuple[str, str | None]:
    """How decode reads missed experts -> (mode, why graphs are off or None); sets the store's
    staging: --decode-misses staged, or staged because part of experts.bin is unpinned (nothing may
    read it in place). Staged decode reads each layer's routing on the host: no CUDA graphs."""
    if store.resident:
        return "resident", None
    if config.decode_misses == "staged":
        store.staged_decode = True
        return "staged", "--decode-misses staged reads each layer's routing on the host"
    if not store.pinned.all():
        store.staged_decode, store.stage_pinned_misses = True, False
        return "staged", (f"{store.pinned_bytes / store.file_bytes:.0%} of experts.bin is pinned "
                          f"({store.pin_reason}): decode misses of the rest are staged, each "
                          f"layer's routing read on the host")
    return config.decode_misses, None


def host_experts(rt, dev, stream, store, args, config: EngineConfig, bandwidths):
    """The host's share of prompt chunks' and decode steps' missed experts (--cpu-experts;
    strata.engine.expert_split), priced with rates measured now through the engine's own path
    (HostExperts.measure: tens of ms), the device reads a split adds to a layer (measure_sync) and
    the rate decode misses are read in place at (expert_split.in_place_gb_s), or None: off, every
    expert resident, or (auto) a pack whose experts the host's kernels do not read."""
    from .expert_split import host_computable, in_place_gb_s, parse_mode
    mode = parse_mode(config.cpu_experts)
    if mode == "off" or store.resident:
        return None
    why = host_computable(store.layers_meta)
    if why is None and not store.pinned[0, 0]:
        why = "the arena pinned none of experts.bin"
    if why is not None:
        if mode is None:
            sys.stderr.write(f"strata: --cpu-experts auto: every missed expert goes over the bus ({why})\n")
            return None
        raise InvalidArgument(f"--cpu-experts {config.cpu_experts}: {why}")
    from .experts.host_compute import HostExperts
    host = HostExperts(rt, dev, store, args, None, bandwidths.h2d_gb_s, mode)
    sync = measure_sync(rt, dev, stream, int(args.hidden_size), int(args.num_experts_per_tok))
    host.rates = dataclasses.replace(host.rates, sync_s=sync, fixed_source=(
        "the device reads, the host round trip and choosing measured at load; the GPU's resume as "
        "estimated for the H200 machine"))
    if store.bus_cap is not None:           # decode misses read in place, then paced to --pcie-gbs
        host.in_place_gb_s = in_place_gb_s(store.bus_cap.bus_gbs, store.bus_cap.gbs)
    return host


def measure_sync(rt, dev, stream, D: int, A: int, T: int = 19, repeats: int = 5) -> float:
    """What a split adds to a layer on the device side: the chunk's input rows [T, D] and routing
    weights [T, A] read to the host as ops.to_host reads them (a copy, then a stream sync), the
    median of `repeats`."""
    buf = rt.DeviceBuffer(dev, T * D * 4)
    x, w = np.empty((T, D), np.float32), np.empty((T, A), np.float32)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for out in (x, w):
            buf.copy_to_host(out, stream)
            stream.synchronize()
        times.append(time.perf_counter() - t0)
    buf.free()
    return float(np.median(times[1:]))
