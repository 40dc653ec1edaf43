"""A layer split over several cards (--gpus 0,1 --layer-split auto|A,B --vram-budget-gib 8,12): which
main layers each card runs, and each card's view of the pack.

Card k runs a contiguous range lo..hi of the main layers; the first card also embeds the tokens,
the last runs the output head and the MTP layer. A card is planned and run as a model of its own
(stage_meta): its layers renumbered from 0, its dense tensors packed anew, its part of experts.bin a
file slice, so the planner, the expert store and the runner need no notion of a split. What crosses
from one card to the next is two rows of hidden_size floats per token (the last layer's output and
that output normed with the next card's first attention norm): 16 KiB a token at hidden size 2048.

`auto` (choose_split) tries every split of the layers (two cards: each boundary; more: a local
search from the split proportional to the budgets) and keeps the one whose cards hold the longest
common context, then the most cached experts; among splits within NEAR_TIE of that many (which
decode alike: a token's misses cross the cards' buses in turn), the one whose pipelined prompt
waits least for its busiest bus, then the fastest predicted decode step. Pure host
logic over pack.json's sizes, tested on the CPU; strata.engine.cuda_split runs it.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..config import EngineConfig, split_counts
from ..errors import InvalidArgument
from ..pack.source import FileSlice
from ..pack.validate import DENSE_ALIGN, round_up
from .memory_model import VRAM_RESERVE_BYTES
from .planner import DEFAULT_BANDWIDTHS, DEFAULT_NUM_SMS, Bandwidths, PackSizes, fit_context, make_plan

NEAR_TIE = 0.01                 # auto: splits caching within 1% of the most experts count as tied
HANDOFF_LATENCY_S = 20e-6       # a peer copy's fixed cost, and the wait between the cards' streams (estimate)
HANDOFF_GB_S = 20.0             # the hand-off's rate where the cards are two GPUs (through host memory at worst)


def _layer_of(name: str) -> int | None:
    """The layer of a "blk.L.*" tensor; None for any other name (a pack's names are a stranger's:
    one like "blk.x.w" is no layer's, and stays on every card)."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() else None


def stage_tensors(args: dict, dense: dict, lo: int, hi: int, first: bool, last: bool, mtp: bool = False) -> dict:
    """{name in the stage: name in the pack} of the dense tensors the card running main layers
    lo..hi needs: its layers' (the MTP layers' too on the last card), the next card's first
    attention norm (not on the last), the embedding (first; last too with tied embeddings, or when
    the MTP layer drafts: mtp, its input embeds the next token), the final norm and head (last).
    Tensors of no layer that none of these names stay on every card."""
    top = hi + (int(args.get("num_mtp_layers", 0)) if last else 0)
    out = {}
    for name in dense:
        l = _layer_of(name)
        if l is not None:
            keep = lo <= l < top or (not last and l == hi and name == f"blk.{hi}.attn_norm.weight")
            if keep:
                out[f"blk.{l - lo}." + name.split(".", 2)[2]] = name
        elif name == "token_embd.weight":
            if first or (last and (args.get("tie_word_embeddings") or (mtp and args.get("num_mtp_layers")))):
                out[name] = name
        elif name in ("output_norm.weight", "output.weight"):
            if last:
                out[name] = name
        else:
            out[name] = name
    return out


def stage_meta(meta: dict, lo: int, hi: int, first: bool, last: bool, mtp: bool = False) -> tuple[dict, list]:
    """(pack.json of the card running main layers lo..hi, as its own model, and the pieces of the
    pack's dense.bin it packs anew: [(pack offset, bytes, stage offset)]). Its experts.bin is bytes
    meta["experts_base"].. + files["experts.bin"]["bytes"] of the pack's."""
    args = meta["model_args"]
    L, M = int(args["num_hidden_layers"]), int(args.get("num_mtp_layers", 0))
    if not (0 <= lo < hi <= L) or first != (lo == 0) or last != (hi == L):
        raise InvalidArgument(f"a stage of layers {lo}..{hi} of {L} (first={first}, last={last}) is not a split's")
    names = stage_tensors(args, meta["dense"], lo, hi, first, last, mtp)
    dense, pieces, off = {}, [], 0
    for new, old in sorted(names.items(), key=lambda kv: meta["dense"][kv[1]]["offset"]):
        t = meta["dense"][old]
        off = round_up(off, DENSE_ALIGN)
        dense[new] = {**t, "offset": off}
        if pieces and pieces[-1][0] + pieces[-1][1] == t["offset"] and pieces[-1][2] + pieces[-1][1] == off:
            pieces[-1] = (pieces[-1][0], pieces[-1][1] + t["nbytes"], pieces[-1][2])    # adjacent in both
        else:
            pieces.append((int(t["offset"]), int(t["nbytes"]), off))
        off += int(t["nbytes"])
    top = hi + (M if last else 0)
    layers = meta["experts"]["layers"]
    E = int(args["num_experts"])
    base = int(layers[lo]["offset"])
    end = max(int(lay["offset"]) + E * int(lay["stride"]) for lay in layers[lo:top])
    stage_layers = [{**copy.deepcopy(lay), "layer": i, "offset": int(lay["offset"]) - base}
                    for i, lay in enumerate(layers[lo:top])]
    out = {k: v for k, v in meta.items() if k not in ("dense", "experts", "files", "max_blob", "model_args", "_sizes")}
    out.update(model_args={**args, "num_hidden_layers": hi - lo, "num_mtp_layers": M if last else 0},
               dense=dense, experts={"layers": stage_layers},
               max_blob=max(int(lay["blob_bytes"]) for lay in stage_layers),
               files={"dense.bin": {"bytes": off}, "experts.bin": {"bytes": end - base}},
               experts_base=base, stage={"layers": [lo, hi], "first": first, "last": last})
    return out, pieces


def stage_sizes(sizes: PackSizes, lo: int, hi: int, mtp: bool = False) -> PackSizes:
    """The planner's sizes of the card running main layers lo..hi of sizes' model (mtp: the last
    card's draft layer drafts, stage_tensors)."""
    meta = {"model_args": sizes.args.to_dict(), "dense": sizes.dense, "experts": {"layers": list(sizes.layers)},
            "max_blob": sizes.max_blob}
    L = sizes.args.num_hidden_layers
    m, _ = stage_meta(meta, lo, hi, lo == 0, hi == L, mtp)
    return PackSizes.from_meta(m, m["files"]["dense.bin"]["bytes"])


class StagePack:
    """A pack as the card running main layers lo..hi sees it (stage_meta): the runner's Pack
    interface (args, meta, path, max_blob, tokenizer, dense(), expert_blob()) over the whole pack's
    files, plus dense_pieces (what strata.backends.cuda.memory.DeviceWeights uploads) and
    experts_file (what the expert store pins, uploads or stages)."""

    def __init__(self, pack, lo: int, hi: int, mtp: bool = False):
        from ..config import ModelArgs
        L = pack.args.num_hidden_layers
        self.whole, self.lo, self.hi = pack, lo, hi
        self.first, self.last = lo == 0, hi == L
        self.meta, pieces = stage_meta(pack.meta, lo, hi, self.first, self.last, mtp)
        self.args = ModelArgs.from_dict(self.meta["model_args"])
        self.path: Path = pack.path
        self.max_blob = int(self.meta["max_blob"])
        self.tokenizer_meta, self.tokenizer_path = pack.tokenizer_meta, pack.tokenizer_path
        dense_path = pack.path / "dense.bin"
        self.dense_pieces = [(FileSlice(dense_path, src, n), n, dst) for src, n, dst in pieces]
        self.experts_file = FileSlice(pack.path / "experts.bin", int(self.meta["experts_base"]),
                                      int(self.meta["files"]["experts.bin"]["bytes"]))
        self._names = stage_tensors(pack.meta["model_args"], pack.meta["dense"], lo, hi, self.first, self.last, mtp)

    def dense_names(self) -> list[str]:
        return list(self.meta["dense"])

    def has_dense(self, name: str) -> bool:
        return name in self.meta["dense"]

    def dense(self, name: str):
        if name not in self._names:
            raise InvalidArgument(f"{self.path}: no dense tensor {name!r} on the card of layers {self.lo}..{self.hi}")
        return self.whole.dense(self._names[name])

    def expert_layout(self, layer: int) -> dict:
        return self.meta["experts"]["layers"][layer]

    def expert_blob(self, layer: int, e: int):
        return self.whole.expert_blob(self.lo + layer, e)

    def expert(self, layer: int, e: int) -> dict:
        return self.whole.expert(self.lo + layer, e)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Card:
    ordinal: int            # the GPU
    budget_bytes: int       # its VRAM budget (for logical cards on one GPU, that GPU's share)
    bandwidths: Bandwidths = DEFAULT_BANDWIDTHS
    num_sms: int = DEFAULT_NUM_SMS


def card_name(k: int, card: Card, lo: int, hi: int) -> str:
    """How messages and `plan` name card k, running main layers lo..hi."""
    return f"card {k} (GPU {card.ordinal}, layers {lo}..{hi - 1})"


def ranges_of(counts) -> list[tuple[int, int]]:
    """(lo, hi) of each card's main layers, from their counts in order."""
    out, lo = [], 0
    for n in counts:
        out.append((lo, lo + n))
        lo += n
    return out


@dataclass(frozen=True)
class SplitPlan:
    counts: tuple           # main layers of each card, in order
    source: str             # "auto" or "given"
    max_context: int
    context_source: str
    plans: tuple            # planner.Plan of each card
    handoff_bytes_per_token: int
    decode_tok_s: float     # bandwidth ceiling of a token through every card, hand-offs included
    prompt_tok_s: float | None   # PCIe ceiling, chunks pipelined: the slowest card's bus a chunk; None: nothing streams
    cached_experts: int     # cache slots over the cards (main layers)
    total_experts: int

    def ranges(self) -> list[tuple[int, int]]:
        return ranges_of(self.counts)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["plans"] = [p.to_dict() for p in self.plans]
        return d


def handoff_seconds(args, cards: list[Card]) -> tuple[int, float]:
    """(bytes a token hands from each card to the next, seconds of those hand-offs a decode step):
    two rows of hidden_size floats, a fixed latency each, over the peer link where two GPUs differ
    (on one GPU a device copy)."""
    nbytes = 2 * args.hidden_size * 4
    seconds = 0.0
    for a, b in zip(cards, cards[1:]):
        rate = a.bandwidths.device_copy_gb_s if a.ordinal == b.ordinal else HANDOFF_GB_S
        seconds += HANDOFF_LATENCY_S + nbytes / (rate * 1e9)
    return nbytes, seconds


def plan_split(sizes: PackSizes, config: EngineConfig, cards: list[Card], counts: list[int],
               source: str = "given") -> SplitPlan:
    """The plan of each card for this split, at the longest context every card holds (at most
    --max-context's, as planner.fit_context fits one card); InvalidArgument naming the card whose
    budget is too small."""
    L, step = sizes.args.num_hidden_layers, layer_step(sizes.args)
    if len(counts) != len(cards) or sum(counts) != L or min(counts) < 1:
        raise InvalidArgument(f"--layer-split {','.join(map(str, counts))}: give {len(cards)} counts >= 1 summing to "
                              f"the model's {L} layers")
    if any(n % step for n in counts[:-1]):
        raise InvalidArgument(f"--layer-split {','.join(map(str, counts))}: {sizes.args.architecture}'s cards start at "
                              f"multiples of its full-attention interval ({step}), so each card's layers keep "
                              f"their kinds")
    ranges = ranges_of(counts)
    staged = [stage_sizes(sizes, a, b, config.mtp) for a, b in ranges]
    single = dataclasses.replace(config, gpus="0", vram_budget_gib=0.0, layer_split="auto")

    def each_card(plan_one) -> list:
        """plan_one(sizes, card) for every card; InvalidArgument names the card that refused."""
        out = []
        for k, (s, card) in enumerate(zip(staged, cards)):
            try:
                out.append(plan_one(s, card))
            except InvalidArgument as exc:
                raise InvalidArgument(f"{card_name(k, card, *ranges[k])}: {exc}") from None
        return out
    max_context, why = min(each_card(lambda s, card: fit_context(s, single, card.budget_bytes, card.num_sms)))
    fixed = dataclasses.replace(single, max_context=max_context)
    plans = each_card(lambda s, card: make_plan(s, fixed, card.budget_bytes, "given", card.bandwidths,
                                                card.num_sms))
    nbytes, hand_s = handoff_seconds(sizes.args, cards)
    decode_s = sum(1.0 / p.decode_tok_s for p in plans) + hand_s
    # a prompt reads every card in the smallest card's chunk; pipelined, each card streams its own
    # misses over its own bus at once, so a chunk takes the slowest card's bus time (a large chunk
    # touches every expert: a card's bytes per chunk hardly depend on the chunk's size)
    chunk = min(p.prefill_chunk for p in plans)
    bus_s = max(p.pcie_bytes_per_chunk / (p.h2d_gb_s * 1e9) for p in plans)
    main = [min(p.cache_slots, p.total_experts) for p in plans]
    return SplitPlan(tuple(counts), source, max_context, why, tuple(plans), nbytes, 1.0 / decode_s,
                     chunk / bus_s if bus_s else None, sum(main), sum(p.total_experts for p in plans))


def layer_step(args) -> int:
    """What a card's first layer must be a multiple of: qwen3next's full-attention interval (a
    card's layers, renumbered from 0, keep their kinds), else 1."""
    return args.full_attention_interval if args.architecture == "qwen3next" else 1


def _score(p: SplitPlan) -> tuple:
    return (p.max_context, p.cached_experts, p.decode_tok_s)


def choose_split(sizes: PackSizes, config: EngineConfig, cards: list[Card]) -> SplitPlan:
    """--layer-split's plan: the counts given, or (auto) the split with the longest common context,
    then the most cached experts, near-ties going to the least busy bus (module doc)."""
    counts = split_counts(config.layer_split)
    if counts is not None:
        return plan_split(sizes, config, cards, counts, "given")
    L, n, step = sizes.args.num_hidden_layers, len(cards), layer_step(sizes.args)
    if -(-L // step) < n:
        raise InvalidArgument(f"--gpus {config.gpus}: {n} cards for a model of {L} layers"
                              + (f" in groups of {step}" if step > 1 else "") + f"; give at most {-(-L // step)}")
    tried: dict[tuple, SplitPlan | None] = {}
    errors: list[str] = []

    def plan(c: tuple) -> SplitPlan | None:
        if c not in tried:
            try:
                tried[c] = plan_split(sizes, config, cards, list(c), "auto")
            except InvalidArgument as exc:
                tried[c], _ = None, errors.append(str(exc))
        return tried[c]

    if n == 2:
        cands = [(a, L - a) for a in range(step, L, step)]
    else:       # from the budgets' proportions, boundaries moved one step at a time while that helps
        G = -(-L // step)           # groups of `step` layers (the last may be short)
        weights = [max(c.budget_bytes, 1) for c in cards]
        bounds = [round(G * sum(weights[:k + 1]) / sum(weights)) for k in range(n - 1)]
        bounds = [min(max(b, k + 1), G - n + k + 1) for k, b in enumerate(bounds)]
        for k in range(1, n - 1):
            bounds[k] = max(bounds[k], bounds[k - 1] + 1)
        cands = [_counts([b * step for b in bounds], L)]
        best = None
        while True:
            around = [cands[-1]] + _neighbours(cands[-1], step)
            ranked = [(p, c) for c in around if (p := plan(c)) is not None]
            if not ranked:
                break
            p, c = max(ranked, key=lambda pc: _score(pc[0]))
            if best is not None and _score(p) <= _score(best):
                break
            best, cands = p, cands + [c]
    found = [p for c in cands if (p := plan(c)) is not None]
    if not found:
        raise InvalidArgument(f"no split of {L} layers over --gpus {config.gpus} fits: {errors[-1] if errors else ''}")
    best = max(found, key=_score)
    # near-ties: splits caching within NEAR_TIE of the most experts (at the same context) decode alike
    # (a token's misses cross the buses in turn), but a pipelined prompt waits for the busiest bus:
    # the one whose prompt ceiling is highest among them
    near = [p for p in found if p.max_context == best.max_context
            and p.cached_experts >= (1 - NEAR_TIE) * best.cached_experts]
    return max(near, key=lambda p: (p.prompt_tok_s or float("inf"), _score(p)))


def _counts(bounds: list[int], L: int) -> tuple:
    edges = [0, *bounds, L]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


def _neighbours(counts: tuple, step: int = 1) -> list[tuple]:
    """Splits with one boundary moved by one step of layers."""
    out = []
    for k in range(len(counts) - 1):
        for d in (-step, step):
            c = list(counts)
            c[k] += d
            c[k + 1] -= d
            if min(c) >= 1:
                out.append(tuple(c))
    return out


def split_text(p: SplitPlan, cards: list[Card]) -> str:
    """The split as `plan` prints it: each card's layers, budget, cached experts and predicted speeds."""
    gib = 2 ** 30
    lines = [f"layer split ({p.source}) over {len(cards)} cards, context {p.max_context} tokens ({p.context_source}):"]
    for k, ((lo, hi), card, plan) in enumerate(zip(p.ranges(), cards, p.plans)):
        what = ["embedding"] if lo == 0 else []
        what += ["head, MTP layer"] if k == len(cards) - 1 else []
        cached = min(plan.cache_slots, plan.total_experts)
        lines.append(f"  card {k}: GPU {card.ordinal}, layers {lo}..{hi - 1}"
                     + (f" + {', '.join(what)}" if what else "")
                     + f"; budget {card.budget_bytes / gib:.2f} GiB: dense {plan.mandatory.get('dense', 0) / gib:.2f}, "
                       f"KV {plan.mandatory.get('kv', 0) / gib:.2f}, experts cached {cached} of {plan.total_experts}; "
                       f"decode ceiling {plan.decode_tok_s:.1f} tok/s alone")
    prompt = f"{p.prompt_tok_s:,.0f} tok/s (PCIe, the slowest card, chunks pipelined)" if p.prompt_tok_s else \
        "every expert cached"
    lines.append(f"  hand-off {p.handoff_bytes_per_token} bytes a token per boundary; predicted decode "
                 f"{p.decode_tok_s:.1f} tok/s (every card in turn, hand-offs included), prompt {prompt}; "
                 f"experts cached {p.cached_experts} of {p.total_experts}")
    return "\n".join(lines)


def split_cards(config: EngineConfig) -> list[Card]:
    """The cards of --gpus with their budgets: --vram-budget-gib's, capped by the GPU's free VRAM less
    the reserve; logical cards on one GPU (an ordinal repeated) share its free VRAM, those without
    a budget evenly what the others leave."""
    from ..backends.cuda import device_info
    cards = config.cards()
    info = {o: device_info(o) for o in {o for o, _ in cards}}
    free = {o: max(0, d["free_memory_bytes"] - VRAM_RESERVE_BYTES) for o, d in info.items()}
    out = []
    for o, gib in cards:
        mates = [g for oo, g in cards if oo == o]
        given = sum(int(g * 2**30) for g in mates if g)
        share = max(0, free[o] - given) // max(1, sum(1 for g in mates if not g))
        budget = min(int(gib * 2**30), free[o]) if gib else share
        out.append(Card(o, budget, num_sms=info[o]["multiprocessor_count"]))
    for o in info:
        if sum(c.budget_bytes for c in out if c.ordinal == o) > free[o]:
            raise InvalidArgument(f"--vram-budget-gib {config.vram_budget_gib}: the cards on GPU {o} ask more than "
                                  f"its {free[o] / 2**30:.1f} GiB free (less {VRAM_RESERVE_BYTES / 2**30:g} GiB kept "
                                  f"for the driver)")
    return out
