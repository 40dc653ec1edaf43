"""The GPU engine over a layer split (--gpus 0,1): one CudaRunner per card, each on its StagePack
(strata.engine.layer_split), and the hand-off of hidden rows from each card to the next.

Every card is a whole runner of its own layers: its dense weights, its K/V, its expert cache or
resident experts, its prompt ring and loan, its decode graphs, planned within its own budget. The
first card embeds the tokens; each card but the last ends a forward with its last layer's output and
that output normed (two [T, D] f32 tensors), which the next card's first op (DeviceOps.hand_in)
takes in place of the embedding. The last card runs the head, pick() and the MTP layer's weights.

A hand-off: the card before records an event after its forward; the next card's stream waits for
it, copies the two tensors (cuMemcpyPeerAsync between two GPUs, peer to peer where they allow it and
through host memory otherwise; a device copy where both cards are one GPU: --gpus 0,0), and records
an event that the card before waits for before it writes those tensors again. A decode step copies
into the next card's fixed hand_buf before that card's step, so each card's step stays one CUDA
graph. A prompt chunk is handed over in the next card's pool (a HandOff passed through
model.forward); the card before only waits for the copies, not for the next card's chunk, so on two
GPUs the cards work on consecutive resident chunks at once. Every card reads a prompt in the same
chunk (the smallest of the cards' planned chunks).

--parallel N: every card has the N slots, used in lockstep; a batched step's rows go through each
card's batched step (CudaRunner.batch_rows) and are handed on together. --kv-resident and
--cpu-experts act on each card's own layers (its host KV and VRAM window, its host share of the
misses, priced per card). Speculation (--mtp --spec N|auto): the drafter's bookkeeping is the split's
(strata.engine.speculate's target: verify runs every card in turn, the draft layer is the last
card's); windows run the eager way (no one-graph windows over a split), so greedy output equals
plain greedy's. A qwen3next card keeps its DeltaNet states after each row of a window and rolls
back to the last accepted one (CudaSpeculation.forget on each card). A qwen3next split starts each
card at a multiple of the model's full-attention interval (strata.engine.layer_split.layer_step),
and each card keeps its DeltaNet layers' states and snapshots. A conversation pushed out of a slot
is kept in host RAM by the split (--keep-conversations-gib), every card's cells in one payload, and
copied back into every card. --expert-profile keeps a profile per card (PATH.cardK).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque

import numpy as np

from ..config import EngineConfig
from ..errors import InvalidArgument
from .layer_split import StagePack, card_name, choose_split, split_cards
from ..backends.cuda.memory import DeviceTensor, HandOff
from .planner import PackSizes
from .slots import Slots, keep_bytes, reusable_prefix
from .speculate import Speculating

STEP_TIMES_KEPT = 4096


def split_plan(pack, config: EngineConfig, max_context: int | None = None):
    """(the split's plan, its cards) for this pack and --gpus / --layer-split / --vram-budget-gib, at
    most max_context tokens of context (or --max-context's)."""
    sizes = PackSizes.of_pack(pack)
    cards = split_cards(config)
    if max_context:
        config = dataclasses.replace(config, max_context=max_context)
    return choose_split(sizes, config, cards), cards


class SplitRunner(Slots, Speculating):
    """The runner interface (reset, reusable_prefix, prefill, prefill_steps, decode, pick, logits_all,
    status, warm_up, measure_limits; use, best_slot and decode_batch of --parallel slots) over one
    CudaRunner per card (module doc). Every card's runner has the same slots, used in lockstep: use()
    switches each card's; the split's own per-slot state is the tokens each slot holds."""

    device = "cuda"

    def __init__(self, pack, max_context: int, config: EngineConfig):
        from ..backends.cuda import _runtime
        from .cuda_runner import CudaRunner
        self.rt = rt = _runtime()
        self.args = pack.args
        self.max_context = max_context
        self.split, self.cards = split_plan(pack, config, max_context)
        self.stages = []
        for k, ((lo, hi), card) in enumerate(zip(self.split.ranges(), self.cards)):
            stage_pack = StagePack(pack, lo, hi, mtp=config.mtp)
            # conversations are kept by the split, each card's part in one payload (_cells_out)
            cfg = dataclasses.replace(config, gpus=str(card.ordinal), vram_budget_gib=card.budget_bytes / 2**30,
                                      layer_split="auto", max_context=max_context, keep_conversations_gib=0.0,
                                      expert_profile=f"{config.expert_profile}.card{k}" if config.expert_profile
                                      else "")
            try:
                self.stages.append(CudaRunner(stage_pack, max_context, cfg, stage=(stage_pack.first, stage_pack.last)))
            except InvalidArgument as exc:
                raise InvalidArgument(f"{card_name(k, card, lo, hi)}: {exc}") from None
        self.last = self.stages[-1]
        # each boundary between two GPUs: their copies peer to peer where the GPUs allow it (else the
        # driver stages them through host memory)
        self.peer = [a.dev.enable_peer_access(b.dev) and b.dev.enable_peer_access(a.dev)
                     if a.dev.ordinal != b.dev.ordinal else None for a, b in zip(self.stages, self.stages[1:])]
        self.prefill_chunk = min(s.prefill_chunk for s in self.stages)
        self.cached_ids: list[int] = []     # the slot in use's tokens (strata.engine.slots.Slots)
        self._last = None                   # Slots' other per-slot state (and kv): the cards hold it
        # speculation: the drafter's bookkeeping here (a slot's with the slot), its draft layer on the
        # last card (its own drafter unused); verify windows run through every card
        self._init_spec(config.spec if config.mtp else "0", config.draft_window, config.draft_prompt)
        self._init_slots(config.parallel, lambda slot: None, keep_bytes(config))
        self.mtp_room_min = config.mtp_room_min
        self.room_lent = False
        self.stream = self.last.stream      # what Speculating._sync waits for (the last card's, after every card's)
        # per boundary: the card before's rows are ready (sent), the next card has copied them (taken),
        # and timing events around the copies (the hand-off's time, read once a step is picked)
        self._sent = [rt.Event(s.dev) for s in self.stages[:-1]]
        self._taken = [rt.Event(s.dev) for s in self.stages[1:]]
        self._timing = [(rt.Event(s.dev, True), rt.Event(s.dev, True)) for s in self.stages[1:]]
        self._copy = [self._copier(k) for k in range(len(self.stages) - 1)]
        self._timed = False              # a decode step's hand-offs are timed and not yet read
        self.handoff_ms: deque = deque(maxlen=STEP_TIMES_KEPT)     # a decode step's hand-offs, all boundaries
        self.step_ms: deque = deque(maxlen=STEP_TIMES_KEPT)        # a decode step on the host, every card
        self._step_t0 = None

    @property
    def hybrid(self) -> bool:
        return self.last.hybrid

    @property
    def kv(self):
        """The last card's cache of the slot in use: what Speculating reads of a hybrid's snapshots
        (every card snapshots at the same lengths). Slots' per-slot kv is each card's own."""
        return self.last.kv

    @kv.setter
    def kv(self, value) -> None:
        pass

    @property
    def store(self) -> "_Stores":
        """The cards' expert stores as one for the bench's counters (stats summed)."""
        return _Stores([s.store for s in self.stages])

    # ---- the hand-off --------------------------------------------------------------------------
    def _copier(self, k: int):
        """copy(dst, src, nbytes) on card k + 1's stream from card k's memory, each copy followed by
        the event card k waits for before it writes that memory again."""
        src, dst = self.stages[k], self.stages[k + 1]
        rt, taken = self.rt, self._taken[k]
        if src.dev.ordinal == dst.dev.ordinal:
            def copy(d, s, n):
                rt.copy_d2d(d, s, n, dst.stream)
                taken.record(dst.stream)
        else:
            def copy(d, s, n):
                rt.copy_peer(d, dst.dev, s, src.dev, n, dst.stream)
                taken.record(dst.stream)
        return copy

    def _send(self, k: int) -> None:
        """Card k + 1's stream waits for card k's forward so far."""
        self._sent[k].record(self.stages[k].stream)
        self.stages[k + 1].stream.wait_event(self._sent[k])

    def _handed(self, k: int) -> None:
        """Card k's next work waits for card k + 1's copies of its rows."""
        self.stages[k].stream.wait_event(self._taken[k])

    def _hand_step(self, k: int, normed, x) -> None:
        """A decode step's rows from card k into card k + 1's hand_buf (x, then normed at its half)."""
        self._send(k)
        dst = self.stages[k + 1]
        buf, copy = dst.ops.hand_buf, self._copy[k]
        start, end = self._timing[k]
        start.record(dst.stream)
        copy(buf.ptr, x.ptr, x.nbytes)
        copy(buf.ptr + buf.nbytes // 2, normed.ptr, normed.nbytes)
        end.record(dst.stream)
        self._handed(k)

    # ---- the runner interface ------------------------------------------------------------------
    def reset(self) -> None:
        self.cached_ids = []
        for s in self.stages:
            s.reset()
        if self.drafter:
            self.drafter.reset()

    @property
    def interleaves(self) -> bool:
        """Whether prefill_steps pauses between chunks (CudaRunner.interleaves): every card resident."""
        return all(s.interleaves for s in self.stages)

    def use(self, slot: int) -> None:
        """Slots.use, on every card too."""
        super().use(slot)
        for s in self.stages:
            s.use(slot)

    def reusable_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of ids every card already has K/V for (at least one is read); a
        hybrid model's cards resume their DeltaNet states only from the live state or a snapshot
        taken at the end of a prompt (CudaRunner.reusable_prefix), the same on every card."""
        n = reusable_prefix(self.cached_ids, ids)
        for s in self.stages:
            if s.hybrid:
                n = min(n, s.kv.resumable(n, len(s.cached_ids)))
        if self.drafter:
            return self._hybrid_reusable(ids, n) if self.hybrid else self.drafter.reusable(self.cached_ids, ids, n)
        n = self._bring_back(ids, n)            # a kept conversation copied back into every card
        for s in self.stages:
            if s.cached_ids != self.cached_ids:
                s.cached_ids = list(self.cached_ids)
        return n

    # a conversation kept in host RAM (strata.engine.slots): every card's cells (and a hybrid's states)
    def _cells_out(self, n: int):
        parts = [s._cells_out(n) for s in self.stages]
        return [p for p, _ in parts], sum(nbytes for _, nbytes in parts)

    def _cells_in(self, payload, n: int) -> None:
        for s, part in zip(self.stages, payload):
            s._cells_in(part, n)

    def _kept_resumable(self, payload, kept_len: int, n: int) -> int:
        return min(s._kept_resumable(part, kept_len, n) for s, part in zip(self.stages, payload))

    def _copy_cells(self, slot: int, n: int) -> None:
        for s in self.stages:
            s._copy_cells(slot, n)

    def prefill(self, ids: list[int], start: int, on_progress=None, logits: bool = True) -> np.ndarray | None:
        steps = self.prefill_steps(ids, start, on_progress, logits)
        for _ in steps:
            pass
        return steps.out[-1] if logits else None

    def prefill_steps(self, ids: list[int], start: int, on_progress=None, logits: bool = False):
        from .cuda_runner import _PrefillSteps
        return _PrefillSteps(self._prefill_chunks(ids, start, on_progress, logits))

    def _prefill_chunks(self, ids: list[int], start: int, on_progress, logits: bool):
        if not 0 <= start <= len(self.cached_ids):
            raise InvalidArgument(f"prefill from {start}: only {len(self.cached_ids)} tokens are cached")
        self._keep_tail(start)                   # the conversation about to be overwritten, kept first
        self.cached_ids = self.cached_ids[:start]
        if self.drafter:
            self._truncate_drafter(start)
            self.draft_chunks = []
        for s in self.stages:
            if s.hybrid:        # start came from reusable_prefix: the states at a snapshot or live
                s.kv.rewind(start, len(s.cached_ids))
            s.cached_ids = s.cached_ids[:start]
            if start and getattr(s.kv, "vram_window", 0):   # --kv-resident: the reused cells' newest into VRAM
                for dst, src, nbytes in s.kv.vram_refill(start):
                    self.rt.copy_d2d(dst, src, nbytes, s.stream)
        out = None
        pause = self.interleaves
        # seed 001 (CudaRunner._prefill_chunks): a long prompt borrows the draft layer's cached experts
        # on the last card for its ring
        room = self.room_lent = (self.drafter is not None and self.draft_prompt != "own"
                                 and 0 <= self.mtp_room_min <= len(ids) - start and self.last.store.open_room())
        with contextlib.ExitStack() as loans:
            if room:
                loans.callback(self.last.store.close_room)      # back before the first decode step
            for s in self.stages:
                loans.enter_context(s.prompts.loan(len(ids) - start, self.prefill_chunk))
            for lo in range(start, len(ids), self.prefill_chunk):
                hi = min(len(ids), lo + self.prefill_chunk)
                # no chunk but the last waits for the host (the drafter's rows aside): card 0 may run
                # ahead into the next chunk
                out = self._chunk(ids[lo:hi], lo, last_only=True, download=logits and hi == len(ids))
                if self.drafter:                # the draft layer's K/V of this chunk, batched
                    self.drafter.extend(self.last.prompts.hidden)
                    self.last.prompts.hidden = None
                    self._flush_drafter()
                if on_progress is not None:
                    on_progress(hi - start, len(ids) - start)
                if pause and hi < len(ids):
                    yield None          # other slots may step; the caller use()s this slot again
        for s in self.stages:
            if s.hybrid:
                s.kv.snapshot(len(ids))             # a follow-up turn resumes from here
        if self.hybrid and self.drafter:
            self._snapshot_row(len(ids))
        return out

    def _chunk(self, chunk: list[int], lo: int, last_only: bool, download: bool):
        """One prompt chunk through every card; -> the last card's host logits (or None)."""
        hand = None
        for k, s in enumerate(self.stages):
            if k:
                self._send(k - 1)
            if s is self.last:
                out = s.prompts.forward(chunk, lo, s.kv, last_only=last_only, download=download,
                                        hidden=self.drafter is not None, hand=hand)
                s._last = s.prompts.last_row
            else:
                normed, x = s.prompts.forward_rows(chunk, lo, s.kv, hand)
            if k:
                self._handed(k - 1)
            if s is not self.last:
                hand = HandOff(normed, x, self._copy[k])
            s.cached_ids.extend(chunk)
        self.cached_ids.extend(chunk)
        return out

    def decode(self, token: int, logits: bool = True) -> np.ndarray | None:
        """Append one token at the next position, through every card; -> its logits [V] (None
        without `logits`: they stay on the last card for pick())."""
        lo = len(self.cached_ids)
        self._step_t0 = time.perf_counter()
        self._through([token], lo, window=False)
        out, self.last._last = self.last.steps.step([token], lo, self.last.kv, download=logits)
        for s in self.stages:
            s.cached_ids.append(token)
        self.cached_ids.append(token)
        self._timed = True
        if self.drafter is not None:        # the draft layer reads this step's main hidden state
            self.drafter.extend(self.last.ops.to_host(self.last.steps.hidden))
        if logits:
            self._picked()
            return out[-1]
        return None

    # ---- speculation (strata.engine.speculate's target) ------------------------------------------
    def _through(self, ids: list[int], start: int, window: bool = True) -> None:
        """Every card but the last over ids at start.. as one step of len(ids) rows, each card's
        rows handed to the next: the last card's step then reads them from its hand_buf. window: a
        verify window's rows (a hybrid card keeps its states row by row: CudaSpeculation)."""
        T = len(ids)
        if start + T > self.max_context:
            raise InvalidArgument(f"positions up to {start + T - 1} do not fit the context of {self.max_context}")
        for k, s in enumerate(self.stages[:-1]):
            if window:
                s._window_begin(start)
            _, normed = s.steps.step_rows(list(ids), list(range(start, start + T)), [s.kv.base] * T, s.kv.whole,
                                          download=False)
            self._hand_step(k, normed, s.steps.hidden)

    def verify(self, ids: list[int], start: int):
        """The main model over ids at start.. through every card -> (logits [T, V], hidden [T, D])
        on the host (CudaSpeculation.verify)."""
        self._through(ids, start)
        out = self.last.verify(ids, start)
        self._picked()
        return out

    def verify_next(self, ids: list[int], start: int):
        """verify() for greedy windows -> (each row's argmax, hidden [T, D] on the host)."""
        self._through(ids, start)
        out = self.last.verify_next(ids, start)
        self._picked()
        return out

    def mtp(self, hidden, next_ids, positions, logits_rows=slice(None)):
        return self.last.mtp(hidden, next_ids, positions, logits_rows)

    def mtp_next(self, hidden, next_ids, positions):
        return self.last.mtp_next(hidden, next_ids, positions)

    def mtp_cells(self, hidden, next_ids, positions) -> None:
        self.last.mtp_cells(hidden, next_ids, positions)

    def forget(self, layers, start: int, stop: int) -> None:
        """Cells start..stop-1 of these layers (the whole model's numbering: main layers, and L for
        the draft layer) forgotten on the cards that hold them (CudaSpeculation.forget)."""
        L = self.args.num_hidden_layers
        layers = list(layers)
        for k, ((lo, hi), s) in enumerate(zip(self.split.ranges(), self.stages)):
            mine = [l - lo for l in layers if lo <= l < hi or (s is self.last and l >= L)]
            if mine:
                s.forget(mine, start, stop)

    def speculate(self, token: int, params, sampler, left: int) -> list[int]:
        """Speculating.speculate, then every card's tokens as the split's (a window appends the
        accepted tokens to the split's cached_ids only)."""
        out = super().speculate(token, params, sampler, left)
        n = len(self.cached_ids)
        for s in self.stages:
            del s.cached_ids[n:]
            s.cached_ids.extend(self.cached_ids[len(s.cached_ids):])
        return out

    def decode_batch(self, slots: list[int], tokens: list[int]) -> None:
        """One batched decode step of several slots through every card (CudaRunner.decode_batch on
        each, the rows handed on between them); row i's logits stay on the last card for slot
        slots[i]'s pick(). The slot in use stays in use."""
        if len(set(slots)) != len(slots):
            raise InvalidArgument(f"decode_batch: slots {slots} repeat")
        positions = [len(self.slot_ids(s)) for s in slots]
        if max(positions) + 1 > self.max_context:
            raise InvalidArgument(f"positions up to {max(positions)} do not fit the context of {self.max_context}")
        self._step_t0 = time.perf_counter()
        for k, s in enumerate(self.stages):
            out = s.batch_rows(slots, tokens, positions)
            if s is not self.last:
                self._hand_step(k, out, s.steps.hidden)
        V = self.args.vocab_size
        for row, (slot, token) in enumerate(zip(slots, tokens)):
            for s in self.stages:
                last = (DeviceTensor(out.buf, out.offset + row * V * 4, (1, V), np.float32, out) if s is self.last
                        else None)
                s._append_to(slot, token, last)
            self._append_to(slot, token, None)
        if self.drafter is not None:     # drafting slots' plain steps (a constrained request's, say)
            self._extend_drafters(slots, self.last.ops.to_host(self.last.steps.hidden))
        self._timed = True

    def pick(self, params, u: float, mask=None, host=None, step: bool = False, feed: int | None = None) -> int:
        """The next token from the last card's logits (CudaRunner.pick); the earlier cards' routing
        then goes to their caches. step: then decode the token (or feed) too, as decode(token,
        logits=False)."""
        token = self.last.pick(params, u, mask, host)
        self._picked()
        if step:
            self.decode(token if feed is None else feed, logits=False)
        return token

    def _picked(self) -> None:
        for s in self.stages[:-1]:
            s.steps.picked()
        if self._timed:
            self._timed = False
            self.handoff_ms.append(sum(a.elapsed_ms(b) for a, b in self._timing))
            if self._step_t0 is not None:
                self.step_ms.append((time.perf_counter() - self._step_t0) * 1e3)
                self._step_t0 = None

    def logits_all(self, ids: list[int]) -> np.ndarray:
        """Logits at every position of one prompt, read from position 0 [T, V]."""
        return np.concatenate([logits for _, logits in self.logits_chunks(ids)]).astype(np.float32)

    def logits_chunks(self, ids: list[int], chunk: int | None = None):
        """CudaRunner.logits_chunks through every card."""
        self.reset()
        chunk = min(chunk or self.prefill_chunk, self.prefill_chunk)
        with contextlib.ExitStack() as loans:
            for s in self.stages:
                loans.enter_context(s.prompts.loan(len(ids), chunk, pool=False))
            for lo in range(0, len(ids), chunk):
                yield lo, self._chunk(ids[lo:lo + chunk], lo, last_only=False, download=True)

    def warm_up(self, num_tokens: int = 19, steps: int = 3) -> None:
        """CudaRunner.warm_up over the split: a short prompt, `steps` decode steps (each card's graph
        captured) and both picks, leaving nothing a request can observe on any card."""
        from ..config import SamplingParams
        n = max(1, min(num_tokens, self.max_context - steps))
        steps = max(0, min(steps, self.max_context - n))
        params = (SamplingParams(temperature=0.8, top_p=0.9, top_k=40), SamplingParams())
        saved = (self.cached_ids, list(self.handoff_ms), list(self.step_ms))
        drafter = ((self.drafter.done, self.drafter.pending, self.drafter.first_held,
                    self.spec_stats.prompt_cells, self.spec_stats.prompt_ms, self.draft_chunks,
                    dict(self.snapshot_rows)) if self.drafter else None)
        with contextlib.ExitStack() as scratch:
            for s in self.stages:
                s.warm_loans()
                scratch.enter_context(s.scratch(n + steps))
            try:
                self.cached_ids = []
                self.prefill([t % self.args.vocab_size for t in range(n)], 0, logits=False)
                token = self.pick(params[0], 0.5)
                for i in range(steps):
                    self.decode(token, logits=False)
                    token = self.pick(params[(i + 1) % 2], 0.5)
            finally:
                self.cached_ids = saved[0]
                self.handoff_ms.clear()
                self.handoff_ms.extend(saved[1])
                self.step_ms.clear()
                self.step_ms.extend(saved[2])
                self._timed, self._step_t0 = False, None
                if drafter is not None:
                    self.drafter.done, self.drafter.pending, self.drafter.first_held = drafter[:3]
                    self.spec_stats.prompt_cells, self.spec_stats.prompt_ms, self.draft_chunks = drafter[3:6]
                    self.snapshot_rows = drafter[6]

    def save_profile(self) -> None:
        for s in self.stages:
            s.save_profile()

    def status(self) -> dict:
        """The last card's status (its decode graphs, K/V), the VRAM and the expert caches of every
        card summed under "gpu" and "expert_cache", and "layer_split": each card's layers, VRAM, expert cache and decode
        graphs, the hand-off's bytes and measured time per decode step, the plan's predicted speeds."""
        cards = [s.status() for s in self.stages]
        out = dict(cards[-1])
        gpu = {k: sum(c["gpu"][k] for c in cards) for k in cards[-1]["gpu"] if k != "name"}
        gpu["name"] = " + ".join(c["gpu"]["name"] for c in cards)
        out["gpu"] = gpu
        out["bytes_h2d"] = sum(c["bytes_h2d"] for c in cards)
        out["expert_cache"] = _summed_cache([c["expert_cache"] for c in cards])
        out["prefill_chunk"] = self.prefill_chunk
        out["kept_conversations"] = self.kept.status()
        out["spec"] = self.spec
        out["speculation"] = ({**self.spec_stats.to_dict(),
                               "auto": self.spec_auto.to_dict() if self.spec_auto else None, "device_windows": 0,
                               "room_lent": self.room_lent, "room_lends": self.last.store.stats.room_lends}
                              if self.spec else None)
        if self.spec:
            out["draft"] = {**self.draft_status(), "kv_bytes": (out.get("draft") or {}).get("kv_bytes")}
        hand = np.asarray(self.handoff_ms, np.float64)
        steps = np.asarray(self.step_ms, np.float64)
        out["layer_split"] = {
            "counts": list(self.split.counts), "source": self.split.source,
            "handoff_bytes_per_token": self.split.handoff_bytes_per_token,
            "peer_access": self.peer,         # per boundary: None within one GPU
            "handoff_ms_per_step": float(np.median(hand)) if hand.size else None,
            "host_step_ms": float(np.median(steps)) if steps.size else None,
            "predicted_decode_tok_s": round(self.split.decode_tok_s, 1),
            "cards": [{"gpu": card.ordinal, "layers": [lo, hi], "vram": c["gpu"], "expert_cache": c["expert_cache"],
                       "decode": c["decode"]}
                      for card, (lo, hi), c in zip(self.cards, self.split.ranges(), cards)],
        }
        return out

    def measure_limits(self, nbytes: int = 1 << 30, repeats: int = 10) -> dict:
        """The last card's copy rates (CudaRunner.measure_limits)."""
        return self.last.measure_limits(nbytes, repeats)

    def vram_used_bytes(self) -> int:
        """VRAM in use on the cards' GPUs now (each GPU once)."""
        seen, used = set(), 0
        for s in self.stages:
            if s.dev.ordinal not in seen:
                seen.add(s.dev.ordinal)
                used += s.vram_used_bytes()
        return used


class _Stores:
    """What the bench reads of an expert store (stats, host_experts), over every card's store."""

    host_experts = None

    def __init__(self, stores):
        self.stores = stores

    @property
    def stats(self):
        from .experts.store import StoreStats
        return StoreStats(**{f.name: sum(getattr(s.stats, f.name) for s in self.stores)
                             for f in dataclasses.fields(StoreStats)})


SUMMED_CACHE_KEYS = ("slots", "resident", "admitting", "total_experts", "hits", "misses", "admitted", "evicted",
                     "prompt_streamed", "arena_pinned_bytes", "staged_blobs", "bytes_h2d")


def _summed_cache(caches: list[dict]) -> dict:
    """The cards' expert cache statuses as one (the Monitor's and bench's view): counts summed, the hit
    rate over all, the rest the last card's (each card's own is under layer_split's cards)."""
    out = dict(caches[-1])
    out.update({k: sum(c[k] for c in caches) for k in SUMMED_CACHE_KEYS if all(k in c for c in caches)})
    uses = out["hits"] + out["misses"]
    out["hit_rate"] = out["hits"] / uses if uses else 0.0
    return out
