"""The VRAM plan: what stays resident, how big the expert cache is, and the prompt chunk and ring.

Pure host logic from a pack's sizes (never touches a device; tested on the CPU). The rules are
docs/DESIGN.md's "The memory plan" (the ring's byte budget from the earlier design it calls seed 000):

- Mandatory: dense weights, the KV in VRAM (max_context cells, or the window of kv_resident cells
  when --kv-resident below the context puts the authoritative cells in pinned host memory; at the KV format's
  bytes, strata.quant.kv.cell_bytes: f16 2 per value, int8 66 per 64 values, q4_0 18 per 32, k8v4
  int8 K and q4_0 V), decode scratch (the
  activation pool's first 64 MiB segment, or the decode step's peak if bigger, plus the zeros
  buffer and f32 norm copies), one CUDA graph pool per decode step shape, and the MTP draft
  layer's experts when --mtp uses it.
- The context: `--max-context N` (capped at the model's trained context), or by default the
  model's trained context (ModelArgs.max_position_embeddings), lowered on the CHUNK_GRID until the
  mandatory items at that KV size leave room for the expert cache's minimum (a token's experts in
  every layer: `min_cache_slots`, A x L) and the smallest prompt loan (`fit_context`).
- The expert cache: `--expert-cache auto` takes what is left, N is fixed (an error if it does not
  fit). A slot holds one expert blob at its own layer's size, slots filled round-robin over the
  layers; on a pack whose layers share one blob size that is floor(room / max_blob) slots.
- The prompt loan, lent for the length of a prompt from the room beside the cache and then from
  the cache tail: the prompt path's buffers, bytes_needed(T), and the streamed ring of R slots of
  max_blob. The ring is a byte budget: R = floor(RING_BUDGET_BYTES / max_blob) clamped to
  [RING_MIN_SLOTS, RING_CAP_SLOTS] (and to the model's experts), the budget chosen so that Q2_0's
  1,382,400-byte blob gives exactly 384 slots: 384 x 1,382,400 B = 530,841,600 B = 506.25 MiB.
- `--prefill auto` (`--prefill-rule auto`): of candidate (chunk, ring, kept slots) plans, the one
  strata.engine.prompt_cost predicts fastest over prompts of AUTO_PROMPTS tokens (capped at the
  context): rings from the byte budget's (the floor) to RING_CAP_SLOTS, for each the chunk the
  bytes rule would take over it, the older rule's chunks and even splits of those prompts; the two
  rules' own plans always among them, and a plan predicted slower than either of them at any of
  those prompts taken only when none is at least as fast at every one (prompt_plans).
  `--prefill-rule bytes`: the largest chunk on the 256-token grid (up to AUTO_CHUNK_MAX, `auto:N`'s
  N, and the context) that still leaves the ring full, counted in bytes, found by bisection; when
  no chunk can, the largest chunk over a RING_MIN_SLOTS ring, the ring then taking what is left.
  `--prefill-rule slots`: _legacy_choice. `--prefill N` is fixed. A plan that caches every expert
  needs no ring when a chunk fits beside the cache.

bytes_needed(T) follows the CURRENT GPU prompt path (strata.engine.memory_model replays its
allocations in the real Pool, and strata._ext.prompt_plan in closed form, equal to that dry run:
tests/engine/test_prompt_plan.py) and must change with it; tests/engine/test_planner.py checks it
against CudaRunner.prefill on the emulated runtime. The bisections over it run in that extension. It is the reserved pool that path needs, which
first-fit holes put 3-8% above the live high-water mark; the live mark rises with T by
construction, the reserved pool did on the 256 grid of every shape tried (off the grid it can dip
at an exact fit, e.g. T = 2^k - 1 -> 2^k). The bisection's answer always fits; a dip could only
make it a step short.

CudaRunner runs this plan: it keeps every expert resident where the cache holds them all, else
streams them through the cache and the ring, and reads prompts in the plan's chunk.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from types import SimpleNamespace

from ..backends.cuda.memory import SEGMENT_BYTES, Pool
from ..backends.cuda.moe import dq_rows_enough
from ..config import KV_VRAM_SLACK, EngineConfig, ModelArgs, spec_max_drafts
from ..errors import InvalidArgument
from ..quant import kv as kv_formats
from . import memory_model, prompt_cost
from .memory_model import STEP_MAX_TOKENS, VRAM_RESERVE_BYTES
from .hybrid_sizes import attention_layers, linear_state_bytes

Q2_0_BLOB_BYTES = 1_382_400                       # the blob the 384-slot ring was measured on (seed 000)
RING_BUDGET_BYTES = 384 * Q2_0_BLOB_BYTES         # 530,841,600 B = 506.25 MiB
RING_MIN_SLOTS = 16
RING_CAP_SLOTS = 512
CHUNK_GRID = 256
LEGACY_RING_SLOTS = 384                            # --prefill-rule slots: seed 000's "before" arm
LEGACY_CHUNKS = (32768, 16384, 8192, 6144, 4096, 3072, 2048, 1024)
AUTO_CHUNK_MAX = 32768                            # --prefill auto's ceiling
RING_STEP = 64                                    # the cost model's ring candidates: the byte budget's, then every 64
AUTO_SPLITS = 4                                   # ... and chunks that read each AUTO_PROMPTS prompt in 1..4 even parts
PROMPT_OPTIONS_SHOWN = 6                          # candidates a plan keeps for `plan` beside the two rules' plans
DEFAULT_NUM_SMS = 132                             # an H200's, for decode attention splits without a GPU


@dataclass(frozen=True)
class PackSizes:
    """What the planner reads of a pack: pack.json's dense table and expert layers, and file sizes."""
    args: ModelArgs
    dense_bytes: int
    dense: dict             # name -> {"qtype", "shape", "offset", "nbytes"}
    layers: tuple           # experts.layers entries: main layers, then the MTP layer
    max_blob: int

    @classmethod
    def from_meta(cls, meta: dict, dense_bytes: int) -> "PackSizes":
        """From pack.json (or strata.pack.format.layout of a source) and dense.bin's size."""
        return cls(ModelArgs.from_dict(meta["model_args"]), int(dense_bytes), meta["dense"],
                   tuple(meta["experts"]["layers"]), int(meta["max_blob"]))

    @classmethod
    def of_pack(cls, pack) -> "PackSizes":
        """An open pack's sizes (a Pack, or a layer split's StagePack)."""
        return cls.from_meta(pack.meta, int(pack.meta["files"]["dense.bin"]["bytes"]))

    def blob(self, layer: int) -> int:
        return int(self.layers[layer]["blob_bytes"])

    @functools.cached_property
    def key(self) -> str:
        """A digest of everything here: equal sizes, equal keys (memory_model's memo is keyed by it)."""
        text = json.dumps([dataclasses.asdict(self.args), self.dense_bytes, self.max_blob,
                           {n: [t["qtype"], list(t["shape"])] for n, t in self.dense.items()},
                           list(self.layers)], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Bandwidths:
    h2d_gb_s: float             # pinned host -> device copy
    device_copy_gb_s: float     # device copy, bytes read + written
    source: str


DEFAULT_BANDWIDTHS = Bandwidths(55.4, 4267.0, "the H200 figures recorded in docs/PERF.md (no GPU measured)")


def ring_slots(max_blob: int, budget_bytes: int = RING_BUDGET_BYTES, lo: int = RING_MIN_SLOTS,
               hi: int = RING_CAP_SLOTS) -> int:
    """Slots of the streamed ring: a byte budget over max_blob, clamped to [lo, hi]."""
    return min(hi, max(lo, budget_bytes // max_blob))


def kv_bytes(args: ModelArgs, cells: int, kv: str, num_layers: int) -> int:
    """K and V of num_layers layers, cells each, in KV format kv (strata.quant.kv)."""
    cell = kv_formats.cell_bytes(kv, args.num_key_value_heads, args.head_dim)
    if args.architecture == "qwen3next":        # K/V in the attention layers only, plus the fixed DeltaNet states
        return attention_layers(args, num_layers) * cells * cell + linear_state_bytes(args)
    return num_layers * cells * cell


def vram_budget(config: EngineConfig, free_bytes: int | None) -> tuple[int, str]:
    """min(free VRAM - reserve, --vram-budget-gib); the budget alone without a GPU."""
    cap = int(config.vram_budget_gib * 2**30)
    if free_bytes is None:
        if not cap:
            raise InvalidArgument("plan: no GPU here to read free VRAM from; give --vram-budget-gib")
        return cap, "--vram-budget-gib; no GPU read"
    free = max(0, free_bytes - VRAM_RESERVE_BYTES)
    if cap and cap <= free:
        return cap, "--vram-budget-gib, under free VRAM - 1 GiB"
    return free, "free VRAM - 1 GiB reserve"


class ExpertCache:
    """Slot i holds an expert of main layer i % L, at that layer's blob size."""

    def __init__(self, sizes: PackSizes):
        a = sizes.args
        self.num_layers, self.num_experts = a.num_hidden_layers, a.num_experts
        self.blobs = [sizes.blob(l) for l in range(self.num_layers)]
        self.prefix = [0]
        for b in self.blobs:
            self.prefix.append(self.prefix[-1] + b)
        self.total_slots = self.num_layers * self.num_experts

    def per_layer(self, slots: int) -> list[int]:
        q, r = divmod(slots, self.num_layers)
        return [q + (l < r) for l in range(self.num_layers)]

    def nbytes(self, slots: int) -> int:
        q, r = divmod(slots, self.num_layers)
        return q * self.prefix[-1] + self.prefix[r]

    def slots_within(self, nbytes: int) -> int:
        """The most slots whose bytes fit in nbytes (every expert at most)."""
        if nbytes <= 0:
            return 0
        q, rest = divmod(nbytes, self.prefix[-1])
        r = max(i for i in range(self.num_layers + 1) if self.prefix[i] <= rest)
        return min(self.total_slots, q * self.num_layers + r)


def largest_fitting(candidates: list[int], fits) -> int | None:
    """The largest candidate (ascending) for which fits() holds, by bisection; fits must be
    monotone (true up to some point, false after). None when none fits."""
    lo, hi = 0, len(candidates)          # candidates[:lo] fit, candidates[hi:] do not
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            lo = mid + 1
        else:
            hi = mid
    return candidates[lo - 1] if lo else None


def chunk_candidates(setting: str, max_context: int) -> tuple[list[int], bool]:
    """(ascending chunk sizes to try, fixed) for EngineConfig.prefill: the 256 grid up to the
    ceiling (auto's, or auto:N's N, below a context rounded up to the grid); N alone is fixed."""
    n = AUTO_CHUNK_MAX if setting == "auto" else int(setting.removeprefix("auto:"))
    if n <= 0:
        raise InvalidArgument(f"prefill must be a positive number of tokens, got {setting!r}")
    if setting.isdigit():
        return [min(n, max_context)], True
    ceiling = min(n, -(-max_context // CHUNK_GRID) * CHUNK_GRID)
    if ceiling < CHUNK_GRID:
        return [ceiling], False
    return list(range(CHUNK_GRID, ceiling + 1, CHUNK_GRID)), False


def bytes_needed(sizes: PackSizes, T: int, max_cells: int = 1, num_sms: int = DEFAULT_NUM_SMS,
                 kv: str = "f16") -> int:
    """VRAM a prompt read in chunks of T tokens borrows on the current prompt path: the reserved
    pool its blocks need under the pool's first-fit (memory_model.prompt_arena_bytes, a few percent
    above the live high-water mark), plus the growth of moe_combine's zeros buffer past the 1 MiB
    the decode scratch already holds. It follows the prompt path (see strata.engine.memory_model) over
    a KV cache of format kv."""
    return (memory_model.prompt_arena_bytes(sizes, T, max_cells, num_sms, kv)
            + memory_model.zeros_bytes(sizes, T) - memory_model.ZEROS_MIN_BYTES)


def priced(config, what_if: dict | None = None, **fields) -> SimpleNamespace:
    """The engine fields the planner prices, as a namespace: `config`'s, with `fields` (the context
    being tried) and, test-only, `what_if`: values of fields EngineConfig refuses today (kv,
    kv_resident, spec, mtp), so the pricing of features still to come stays tested meanwhile."""
    unknown = set(what_if or ()) - {"kv", "kv_resident", "spec", "mtp"}
    if unknown:
        raise InvalidArgument(f"planner what_if: {sorted(unknown)} are not priced fields")
    base = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(vars(config))
    return SimpleNamespace(**{**base, **(what_if or {}), **fields})


def min_cache_slots(sizes: PackSizes) -> int:
    """The expert cache's minimum for the context fit: one token's experts (A) in every main layer."""
    a = sizes.args
    return min(a.num_hidden_layers * a.num_experts, a.num_hidden_layers * a.num_experts_per_tok)


def asked_context(max_context: int, trained: int) -> tuple[int, str]:
    """(context, why) for a context the user asked for: --max-context, capped at the trained one."""
    if max_context > trained:
        return trained, f"--max-context {max_context} capped at the model's trained context {trained}"
    return max_context, "--max-context"


def fit_context(sizes: PackSizes, config, budget_bytes: int, num_sms: int = DEFAULT_NUM_SMS) -> tuple[int, str]:
    """(max_context, why): --max-context (capped at the trained context), or the model's trained
    context when the plan holds its KV beside the expert cache's minimum (min_cache_slots, or a
    fixed --expert-cache N) and the smallest prompt loan; else the largest context on the
    CHUNK_GRID that does. Below one grid step it answers the grid step and make_plan says why."""
    trained = sizes.args.max_position_embeddings
    if config.max_context:
        return asked_context(config.max_context, trained)
    cache, mb = ExpertCache(sizes), sizes.max_blob
    floor_slots = (min_cache_slots(sizes) if config.expert_cache == "auto"
                   else min(int(config.expert_cache), cache.total_slots))
    floor_bytes = cache.nbytes(floor_slots)

    def fits(c: int) -> bool:
        cfg = priced(config, max_context=c)
        room = budget_bytes - sum(mandatory_items(sizes, cfg, num_sms).values())
        first = chunk_candidates(cfg.prefill, c)[0][0]
        smallest_loan = bytes_needed(sizes, min(first, c), c, num_sms, kv_key(cfg)) + RING_MIN_SLOTS * mb
        return room >= max(floor_bytes, smallest_loan)
    if fits(trained):
        return trained, "the model's trained context"
    c = largest_fitting(list(range(CHUNK_GRID, trained, CHUNK_GRID)), fits) or min(CHUNK_GRID, trained)
    kv = kv_bytes(sizes.args, trained * config.parallel, config.kv,
                  sizes.args.num_hidden_layers + sizes.args.num_mtp_layers)
    slots = f" in each of {config.parallel} slots" if config.parallel > 1 else ""
    return c, (f"lowered from the model's trained {trained}{slots}: its KV ({kv / 2**30:.2f} GiB) does not fit "
               f"in the "
               f"{budget_bytes / 2**30:.2f} GiB budget beside the dense weights, the expert cache's minimum of "
               f"{floor_slots} slots ({floor_bytes / 2**30:.2f} GiB) and the smallest prompt loan")


def mandatory_items(sizes: PackSizes, config: EngineConfig, num_sms: int = DEFAULT_NUM_SMS) -> dict[str, int]:
    """Bytes that must stay resident: dense, kv, decode (scratch), graphs, mtp. The KV covers
    every layer the runners allocate it for (the MTP layer's too, drafting or not)."""
    a = sizes.args
    mtp_layers = range(a.num_hidden_layers, a.num_hidden_layers + (a.num_mtp_layers if config.mtp else 0))
    cells = config.max_context          # the cells attention spans, wherever they live
    # a decode step, a verify window, and the batched steps of 2..parallel slots: a graph each
    windows = min(spec_max_drafts(config.spec) + 1, STEP_MAX_TOKENS)
    # (a hybrid's windows of fewer drafts, near a request's end or under --spec auto, are graphs of their own)
    hybrid_windows = range(2, windows + 1) if a.architecture == "qwen3next" and config.mtp else ()
    steps = sorted({1, windows, *hybrid_windows, *range(1, config.parallel + 1)})
    # a hybrid's batched steps of parallel slots are graphs of their own (rows1..rowsN: the DeltaNet
    # row kernels), beside its one-sequence steps': the same sizes, one more graph of a row
    steps += [1] if a.architecture == "qwen3next" and config.parallel > 1 else []
    step_bytes = [memory_model.decode_step_bytes(sizes, T, cells, num_sms, kv_key(config)) for T in steps]
    graphs = sum(Pool.block_bytes(total) for _, total in step_bytes)
    if config.mtp and str(config.spec) != "0" and a.architecture == "qwen3moe":
        # every window graph (one per draft count) shares one pool's memory: the largest window's
        # (a hybrid's windows are the verify step's graph: cuda_spec.spec_window)
        graphs += Pool.block_bytes(spec_window_bytes(sizes, min(spec_max_drafts(config.spec), STEP_MAX_TOKENS - 1),
                                                     cells, num_sms, config.kv))
    return {
        "dense": sizes.dense_bytes,
        "kv": (vram_kv_bytes(a, config)
               # a hybrid's parallel slots: a home for each slot's DeltaNet states beside the live ones
               + (config.parallel * linear_state_bytes(a) if a.architecture == "qwen3next" and config.parallel > 1
                  else 0)
               # and a verify window's: the states before it and after each of its rows (rollback)
               + ((spec_max_drafts(config.spec) + 2) * linear_state_bytes(a)
                  if a.architecture == "qwen3next" and config.mtp and str(config.spec) != "0" else 0)),
        # the pool's first segment holds the step unless it is bigger; zeros and norm copies sit beside it
        "decode": (max(SEGMENT_BYTES, *(peak for peak, _ in step_bytes)) + memory_model.ZEROS_MIN_BYTES
                   + memory_model.norm_copies_bytes(sizes)),
        "graphs": graphs if config.cuda_graphs else 0,
        "mtp": a.num_experts * sum(sizes.blob(l) for l in mtp_layers),
    }


def spec_window_bytes(sizes: PackSizes, n: int, cells: int, num_sms: int, kv: str) -> int:
    """The pool of one greedy speculation window's graph of n drafts (strata.engine.cuda_window): the
    verify step of n + 1 rows, the draft layer over n + 1 rows and n - 1 chained rows (each about a
    layer's share of a step of as many rows), a head row for each draft and the draft layer's
    inputs. An estimate from decode_step_bytes, on the high side."""
    a = sizes.args
    L = max(1, a.num_hidden_layers)
    rows = min(n + 1, STEP_MAX_TOKENS)
    verify = memory_model.decode_step_bytes(sizes, rows, cells, num_sms, kv)[1]
    one = memory_model.decode_step_bytes(sizes, 1, cells, num_sms, kv)[1]
    return (verify + -(-verify // L) + (n - 1) * -(-one // L) + n * 4 * a.vocab_size
            + rows * 4 * 4 * a.hidden_size)


def kv_on_host(config) -> bool:
    """Whether the KV cells live in pinned host memory: --kv-resident N below the context."""
    return 0 < (config.kv_resident or 0) < config.max_context


def kv_cells(config) -> int:
    """KV cells a slot keeps in VRAM: the whole context, or with the cells on the host (kv_on_host)
    the window of the newest N (DeviceKV's ring, --kv-resident N)."""
    return config.kv_resident if kv_on_host(config) else config.max_context


def kv_key(config) -> str:
    """The KV key the prompt and step pricing take (strata.engine.memory_model.kv_key_format)."""
    return config.kv + (memory_model.HOST_SUFFIX if kv_on_host(config) else "")


def plan_draft_ring(args: ModelArgs, config) -> tuple[int, int]:
    """(window, cells) of the draft layer's K/V ring the GPU runner keeps under --draft-window
    (strata.engine.cuda_load.draft_ring), (0, 0) where the draft layer keeps the whole context."""
    from ..config import draft_ring
    if not (config.mtp and str(config.spec) != "0" and args.num_mtp_layers and args.architecture == "qwen3moe"
            and kv_cells(config)):
        return 0, 0
    return draft_ring(getattr(config, "draft_window", 0), config.max_context)


def vram_kv_bytes(args: ModelArgs, config) -> int:
    """The KV in VRAM: kv_cells per slot of every layer the runner allocates (the MTP layer's too,
    drafting or not; with the cells on the host, the window's ring and its KV_VRAM_SLACK cells), the
    draft layer's ring instead of its context where --draft-window gives one."""
    L = args.num_hidden_layers + args.num_mtp_layers
    _, ring = plan_draft_ring(args, config)
    if not ring:
        slack = KV_VRAM_SLACK if kv_on_host(config) else 0
        return kv_bytes(args, (kv_cells(config) + slack) * config.parallel, config.kv, L)
    return (kv_bytes(args, kv_cells(config) * config.parallel, config.kv, args.num_hidden_layers)
            + kv_bytes(args, ring, config.kv, args.num_mtp_layers))


def kv_bus_bytes_per_token(sizes: PackSizes, config) -> int:
    """KV bytes a decoded token reads over the bus at the full context: the cells older than the
    VRAM window x bytes per cell x layers (decode reads them in place on the host, the newest N from
    the window; none while every cell is in VRAM)."""
    a = sizes.args
    if not kv_on_host(config):
        return 0
    return kv_bytes(a, config.max_context - kv_cells(config), config.kv, a.num_hidden_layers + a.num_mtp_layers)


def kv_host_bytes(sizes: PackSizes, config) -> int:
    """Pinned host bytes of the KV when it lives there: every cell of every slot and layer."""
    a = sizes.args
    if not kv_on_host(config):
        return 0
    return kv_bytes(a, config.max_context * config.parallel, config.kv, a.num_hidden_layers + a.num_mtp_layers)


@dataclass(frozen=True)
class Plan:
    vram_budget_bytes: int
    budget_source: str
    mandatory: dict                 # dense, kv, decode, graphs, mtp -> bytes
    mandatory_bytes: int
    kv: str
    kv_cells: int
    max_blob: int
    total_experts: int              # of the main layers (the MTP layer's are mandatory, not cached)
    cache_slots: int
    cache_bytes: int
    prefill_chunk: int
    prefill_ring: int
    prefill_rule: str
    ring_full_slots: int            # the ring's byte budget in slots of this max_blob
    ring_bytes: int
    bytes_needed: int               # bytes_needed(prefill_chunk)
    prompt_pool_peak_bytes: int     # the live high-water mark under it
    prompt_loan_bytes: int          # bytes_needed + ring_bytes
    prompt_cache_slots: int         # cache slots kept while a prompt runs (the rest are lent)
    pcie_bytes_per_chunk: int
    prompt_tok_s: float | None      # PCIe ceiling; None when nothing streams
    decode_hit_rate: float          # cached share of the experts (uniform routing)
    decode_tok_s: float             # bandwidth ceiling
    h2d_gb_s: float
    device_copy_gb_s: float
    bandwidth_source: str
    max_context: int = 0            # the context the plan holds KV for
    context_source: str = ""        # why that context (fit_context)
    parallel: int = 1               # sequences with a KV of kv_cells each (--parallel)
    kv_host_bytes: int = 0          # the KV in pinned host memory (--kv-resident below the context)
    kv_bus_bytes_per_token: int = 0  # KV bytes a decoded token reads over the bus at the full context
    batch_max: int = 0              # --batch-max: rows of one batched decode step (0: auto, measured while running)
    batch_tok_s: tuple = ()         # bandwidth ceiling of a batched step of 1..parallel rows (batch_speeds)
    batch_bus_bytes: tuple = ()     # expert bytes over the bus of a step of 1..parallel rows
    draft_window: int = 0           # --draft-window's window (0: the draft layer keeps the whole context)
    draft_ring_cells: int = 0       # the draft layer's K/V ring, priced in "kv" instead of its context
    prompt_lengths: tuple = ()      # the prompts prompt_options' seconds are predicted at
    prompt_options: tuple = ()      # PromptOption: the chosen plan, the two rules' and the best others

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PromptOption:
    """A candidate prompt plan: chunk, ring slots, cache slots kept while the plan's largest chunk
    runs, which rule proposed it (bytes, slots, cost), and per prompt of Plan.prompt_lengths the
    predicted seconds and the seconds the compute waited for copies (strata.engine.prompt_cost)."""
    chunk: int
    ring: int
    kept: int
    rule: str
    seconds: tuple
    bus_wait_s: tuple
    chosen: bool = False

    def tok_s(self, lengths) -> tuple:
        return tuple(N / s if s > 0 else 0.0 for N, s in zip(lengths, self.seconds))


def auto_lengths(max_context: int) -> tuple:
    """The prompts --prefill auto weighs: AUTO_PROMPTS capped at the context."""
    return tuple(sorted({min(N, max_context) for N in prompt_cost.AUTO_PROMPTS}))


def prompt_plans(sizes: PackSizes, config, cache: ExpertCache, slots: int, room: int, spare: int, full: int,
                 cands: list[int], need, search, bandwidths: Bandwidths, num_sms: int,
                 show: tuple = (), tma_attention: bool = False,
                 tma_gemm: bool = False) -> tuple[tuple[int, int, str], tuple, tuple]:
    """--prefill auto's choice (module doc) -> ((chunk, ring, rule), the lengths shown, PromptOptions:
    the chosen one first, then the bytes and slots rules' plans, then the best others). A prompt of
    N tokens is priced as the runner reads it: the loan's pool sized by its largest chunk
    (PromptChunks.loan_pool_bytes), so the cache slots it keeps are its own."""
    a, mb = sizes.args, sizes.max_blob
    E, A = a.num_experts, a.num_experts_per_tok
    rates = prompt_cost.DEFAULT_PROMPT_RATES.at(num_sms)
    if tma_attention:       # the GPU runs tma-attention's kernels (head dims 128 and 256 on Hopper)
        rates = rates.with_tma_attention()
    work = prompt_cost.effective_work(prompt_cost.layer_work(sizes, tma_attention), rates)  # once for every candidate
    # tma-gemm (the GPU runs it: tma_gemm_runs) prices the chunks it takes (moe.dq_experts' rows an expert)
    dq_rates = rates.with_tma_gemm(max(w.expert_macs for w in work) / A) if tma_gemm else rates

    def rates_for(T: int, N: int):
        return dq_rates if dq_rows_enough(min(T, N) * A, E) else rates
    stream_all = memory_model.stream_all_tokens(a)
    weigh = auto_lengths(config.max_context)
    lengths = tuple(sorted(set(weigh) | {min(int(N), config.max_context) for N in show if int(N) > 0}))

    def kept_for(T: int, R: int) -> int:
        loan = need(T) + R * mb
        return slots if loan <= spare else min(slots, cache.slots_within(room - loan))

    def costs(T: int, R: int) -> list:
        out = []
        for N in lengths:
            kept = kept_for(min(T, 1 << max(4, (N - 1).bit_length())), R)
            missing = [E - k for k in cache.per_layer(kept)]
            out.append(prompt_cost.prompt_cost(work, missing, N, T, R, bandwidths.h2d_gb_s, rates_for(T, N), E, A,
                                               stream_all))
        return out

    bytes_T, bytes_R, bytes_why = _prompt_choice(cands, False, need, search, room, spare, False, full, mb)
    legacy_T, legacy_R, _ = _legacy_choice(config, need, room, cache.total_slots, mb)
    ctx = config.max_context
    plans = {(min(bytes_T, ctx), bytes_R): "bytes"}
    if legacy_T <= cands[-1]:
        plans.setdefault((min(legacy_T, ctx), legacy_R), "slots")
    top = min(RING_CAP_SLOTS, cache.total_slots)
    rings = sorted({full, *range(-(-full // RING_STEP) * RING_STEP, top + 1, RING_STEP),
                    min(LEGACY_RING_SLOTS, top)} - {0})
    for R in rings:
        if R < full or need(cands[0]) + R * mb > room:
            continue
        chunks = {search(room, R * mb), *LEGACY_CHUNKS,
                  *(-(-(-(-N // k)) // CHUNK_GRID) * CHUNK_GRID for N in weigh for k in range(1, AUTO_SPLITS + 1))}
        for T in sorted({min(c, ctx) for c in chunks if c is not None and cands[0] <= c <= cands[-1]}):
            if need(T) + R * mb <= room:
                plans.setdefault((T, R), "cost")
    options = []
    for (T, R), rule in plans.items():
        c = costs(T, R)
        options.append(PromptOption(T, R, kept_for(T, R), rule, tuple(x.seconds for x in c),
                                    tuple(x.bus_wait_s for x in c)))
    at = [lengths.index(N) for N in weigh]
    rules = [o for o in options if o.rule != "cost"]
    best_each = [min(o.seconds[i] for o in rules) for i in at]

    def score(o):
        return sum(o.seconds[i] / lengths[i] for i in at)
    eligible = [o for o in options if all(o.seconds[i] <= b * (1 + 1e-9) for i, b in zip(at, best_each))]
    best = min(score(o) for o in eligible or options)
    # within 0.1% of the best, the plan that keeps the most cache slots (the decode after the prompt
    # finds more of them); the first of equals, so the rules' plans before the others
    chosen = min(eligible or options, key=lambda o: (round(score(o) / best, 3), -o.kept))
    chosen = dataclasses.replace(chosen, chosen=True)
    others = sorted((o for o in options if (o.chunk, o.ring) != (chosen.chunk, chosen.ring) and o.rule == "cost"),
                    key=score)[:PROMPT_OPTIONS_SHOWN]
    shown = (chosen, *(o for o in rules if (o.chunk, o.ring) != (chosen.chunk, chosen.ring)), *others)
    same = {"bytes": " (the bytes rule's plan)", "slots": " (the slots rule's plan)"}.get(chosen.rule, "")
    why = (f"auto: the fastest predicted of {len(options)} plans at prompts "
           f"{'/'.join(str(N) for N in weigh)}{same}" + ("" if eligible else
                                                        "; none as fast as the better rule at every one"))
    return (chosen.chunk, chosen.ring, why), lengths, shown


def _too_small(budget: int, items: dict, loan: int, chunk: int) -> InvalidArgument:
    need = sum(items.values()) + loan
    parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in items.items())
    return InvalidArgument(f"VRAM budget of {budget} bytes ({budget / 2**30:.2f} GiB) is too small: the plan needs "
                           f"at least {need} bytes ({need / 2**30:.2f} GiB): {parts} GiB, and a {chunk}-token "
                           f"prompt chunk with a {RING_MIN_SLOTS}-slot ring {loan / 2**30:.2f} GiB")


def chunk_search(sizes: PackSizes, cands: list[int], max_context: int, cells: int, kv: str, need):
    """search(limit, extra) -> the largest candidate T with need(T) + extra <= limit (None when none
    does), need(T) being bytes_needed(min(T, max_context)): the bisection in typed Cython over the
    closed form (strata._ext.prompt_plan) where that answers every candidate, else over `need`."""
    native = memory_model.chunk_search(sizes, cands, max_context, cells, kv)
    if native is not None:
        return native
    return lambda limit, extra: largest_fitting(cands, lambda T: need(T) + extra <= limit)


def _prompt_choice(cands, fixed, need, search, room, spare, resident, full, max_blob) -> tuple[int, int, str]:
    """(chunk, ring slots, rule) under the rules of the module doc; search: chunk_search's."""
    if resident:
        T = search(spare, 0)
        if T is not None:
            return T, 0, "every expert cached; the chunk fits beside the cache, no ring"
    if fixed:
        T = cands[0]
        return T, min(full, (room - need(T)) // max_blob), "fixed --prefill"
    T = search(room, full * max_blob)
    if T is not None:
        return T, full, "bytes: the largest chunk that leaves the ring full"
    T = search(room, RING_MIN_SLOTS * max_blob)
    return T, min(full, (room - need(T)) // max_blob), (f"bytes: no chunk leaves the ring full; the largest "
                                                         f"over a {RING_MIN_SLOTS}-slot floor")


def _legacy_choice(config, need, room: int, total_slots: int, max_blob: int) -> tuple[int, int, str]:
    """The rule seed 000 replaced, kept for its A/B: a ring of LEGACY_RING_SLOTS slots whatever the
    blob size, taken off the top, then the first chunk of LEGACY_CHUNKS (capped at the context)
    that fits in what is left (the smallest when none does)."""
    ring = min(LEGACY_RING_SLOTS, total_slots)
    chunks = sorted({min(T, config.max_context) for T in LEGACY_CHUNKS}, reverse=True)
    T = next((T for T in chunks if need(T) + ring * max_blob <= room), chunks[-1])
    ring = min(ring, max(RING_MIN_SLOTS, (room - need(T)) // max_blob))
    return T, ring, f"slots: a {LEGACY_RING_SLOTS}-slot ring, the first of a fixed chunk list that fits"


def make_plan(sizes: PackSizes, config: EngineConfig, budget_bytes: int, budget_source: str = "given",
              bandwidths: Bandwidths = DEFAULT_BANDWIDTHS, num_sms: int = DEFAULT_NUM_SMS,
              what_if: dict | None = None, show_prompts: tuple = (), tma_attention: bool = False,
              tma_gemm: bool = False) -> Plan:
    """The plan for this pack, engine config and VRAM budget, at the context fit_context gives.
    InvalidArgument (naming the bytes needed) when the budget cannot hold the mandatory items and
    the smallest prompt loan, or a fixed --expert-cache N does not fit beside them. what_if: see
    priced() (test-only). show_prompts: prompt lengths whose predicted seconds the plan's
    prompt_options also carry (`plan --prompt`). tma_attention: the GPU runs tma-attention's kernel
    for this model (tma_attention_runs), so the prompt plans price its attention rate; tma_gemm: the GPU
    runs tma-gemm (tma_gemm_runs), so they price its GEMMs on the chunks it takes."""
    config = priced(config, what_if)
    context, context_source = fit_context(sizes, config, budget_bytes, num_sms)
    config = priced(config, max_context=context)
    items = mandatory_items(sizes, config, num_sms)
    mandatory = sum(items.values())
    cache, mb, cells, key = ExpertCache(sizes), sizes.max_blob, config.max_context, kv_key(config)
    cands, fixed = chunk_candidates(config.prefill, config.max_context)
    memo: dict[int, int] = {}

    def need(T: int) -> int:
        if T not in memo:
            memo[T] = bytes_needed(sizes, min(T, config.max_context), cells, num_sms, key)
        return memo[T]
    smallest = need(cands[0]) + RING_MIN_SLOTS * mb
    if budget_bytes < mandatory + smallest:
        raise _too_small(budget_bytes, items, smallest, min(cands[0], config.max_context))
    room = budget_bytes - mandatory
    if config.expert_cache == "auto":
        slots = cache.slots_within(room)
    else:
        slots = min(int(config.expert_cache), cache.total_slots)
        if cache.nbytes(slots) > room:
            raise InvalidArgument(f"--expert-cache {config.expert_cache}: {slots} slots take {cache.nbytes(slots)} "
                                  f"bytes, {room} are left beside the mandatory {mandatory} bytes")
    spare = room - cache.nbytes(slots)
    full = min(ring_slots(mb), cache.total_slots)
    lengths, options = (), ()
    if config.prefill_rule == "slots" and slots < cache.total_slots:
        T, ring, rule = _legacy_choice(config, need, room, cache.total_slots, mb)
    else:
        search = chunk_search(sizes, cands, config.max_context, cells, key, need)
        T, ring, rule = _prompt_choice(cands, fixed, need, search, room, spare, slots == cache.total_slots, full, mb)
        if config.prefill_rule == "auto" and not fixed and ring:        # streaming: the cost model's choice
            (T, ring, rule), lengths, options = prompt_plans(sizes, config, cache, slots, room, spare, full, cands,
                                                             need, search, bandwidths, num_sms, show_prompts,
                                                             tma_attention, tma_gemm)
    loan = need(T) + ring * mb
    kept = slots if loan <= spare else min(slots, cache.slots_within(room - loan))
    chunk = min(T, config.max_context)
    pcie, prompt_tps, hit, decode_tps = _speeds(sizes, cache, slots, kept, chunk, bandwidths,
                                                decode_kv_bytes(sizes, config))
    draft_window, draft_cells = plan_draft_ring(sizes.args, config)
    return Plan(budget_bytes, budget_source, items, mandatory, config.kv, kv_cells(config), mb, cache.total_slots,
                slots, cache.nbytes(slots), chunk, ring, rule, full, ring * mb, need(T),
                memory_model.prompt_pool_bytes(sizes, chunk, cells, num_sms, kv=key), loan, kept, pcie, prompt_tps, hit,
                decode_tps, bandwidths.h2d_gb_s, bandwidths.device_copy_gb_s, bandwidths.source, context,
                context_source, config.parallel, kv_host_bytes(sizes, config),
                kv_bus_bytes_per_token(sizes, config), config.batch_max,
                *batch_speeds(sizes, cache, slots, bandwidths, config.parallel),
                draft_window=draft_window, draft_ring_cells=draft_cells, prompt_lengths=lengths,
                prompt_options=options)


def decode_bytes_per_token(pack) -> int:
    """Weight bytes one decoded token reads: every dense matrix, one embedding row, A experts a layer."""
    args, meta = pack.args, pack.meta
    dense = sum(t["nbytes"] for n, t in meta["dense"].items() if n != "token_embd.weight")
    embd = meta["dense"].get("token_embd.weight")       # absent on a layer split's later cards
    if embd is not None:
        dense += embd["nbytes"] // embd["shape"][0]
        if args.tie_word_embeddings:
            dense += embd["nbytes"]
    layers = meta["experts"]["layers"][: args.num_hidden_layers]
    return int(dense + args.num_experts_per_tok * sum(l["blob_bytes"] for l in layers))


def decode_kv_bytes(sizes: PackSizes, config) -> tuple[int, int]:
    """(K/V bytes a decoded token reads in VRAM, and over the bus) at half the context: the mean
    context of a token in a conversation that grows to fill the window. Every layer's cells up to
    the token's position, in the KV format: with the cells on the host, the newest --kv-resident
    of them from the VRAM window and the older ones in place over the bus."""
    a = sizes.args
    half = max(1, config.max_context // 2)
    near = min(half, kv_cells(config)) if kv_on_host(config) else half
    return (kv_bytes(a, near, config.kv, a.num_hidden_layers), kv_bytes(a, half - near, config.kv, a.num_hidden_layers))


def _speeds(sizes: PackSizes, cache: ExpertCache, slots: int, kept: int, chunk: int, bw: Bandwidths,
            kv_read: tuple[int, int] = (0, 0)):
    """(PCIe bytes per prompt chunk, prompt tok/s, decode hit rate, decode tok/s): bandwidth
    ceilings under uniform routing. A chunk streams every expert it touches that is not cached
    while the prompt runs (1 - (1 - A/E)^T of a layer's experts: all of them for large chunks); a
    decoded token reads the dense weights and A experts a layer, cached ones at the device's copy
    rate and the rest over PCIe, and kv_read's K/V bytes (decode_kv_bytes: in VRAM, on the host).
    Compute is not modeled."""
    a = sizes.args
    E, A = a.num_experts, a.num_experts_per_tok
    touched = 1.0 - (1.0 - A / E) ** chunk
    pcie = int(sum((E - k) * b for k, b in zip(cache.per_layer(kept), cache.blobs)) * touched)
    prompt_tps = chunk / (pcie / (bw.h2d_gb_s * 1e9)) if pcie else None
    seconds, _ = _step_seconds(sizes, cache, slots, bw, 1, kv_read)
    return pcie, prompt_tps, slots / cache.total_slots, 1.0 / seconds


def _step_seconds(sizes: PackSizes, cache: ExpertCache, slots: int, bw: Bandwidths, rows: int,
                  kv_read: tuple[int, int] = (0, 0)) -> tuple[float, float]:
    """(seconds, expert bytes over the bus) of a decode step of `rows` rows under uniform routing:
    the dense weights read once, a layer's experts once each for the distinct ones its rows touch
    (E(1 - (1 - A/E)^rows) of them: A for one row), cached ones at the device's copy rate and the
    rest over PCIe, and kv_read's K/V bytes (in VRAM, on the host)."""
    a = sizes.args
    E, A = a.num_experts, a.num_experts_per_tok
    pack = SimpleNamespace(args=a, meta={"dense": sizes.dense, "experts": {"layers": list(sizes.layers)}})
    dense_read = decode_bytes_per_token(pack) - A * sum(cache.blobs)
    touched = A if rows == 1 else E * (1.0 - (1.0 - A / E) ** rows)
    share = [k / E for k in cache.per_layer(slots)]
    cached = sum(touched * f * b for f, b in zip(share, cache.blobs))
    missed = sum(touched * (1 - f) * b for f, b in zip(share, cache.blobs))
    seconds = ((dense_read + cached + kv_read[0]) / (bw.device_copy_gb_s * 1e9)
               + (missed + kv_read[1]) / (bw.h2d_gb_s * 1e9))
    return seconds, missed


def batch_speeds(sizes: PackSizes, cache: ExpertCache, slots: int, bw: Bandwidths, parallel: int):
    """(tok/s ceilings, expert bytes over the bus) of a batched decode step of 1..parallel rows, under
    uniform routing: the dense weights are read once a step, and a layer's experts once each for the
    distinct ones its rows touch (E(1 - (1 - A/E)^s) of them), cached ones at the device's copy rate
    and the rest over PCIe. Where the cache holds every expert an extra row costs only its experts
    at the device's rate; at a small budget most of them cross the bus, which --batch-max auto's
    measurements then weigh against the dense read they share (the bus bytes say how much)."""
    tok_s, bus = [], []
    for s in range(1, parallel + 1):
        seconds, missed = _step_seconds(sizes, cache, slots, bw, s)
        tok_s.append(round(s / seconds, 1))
        bus.append(int(missed))
    return tuple(tok_s), tuple(bus)
