"""Parallel slots of one runner (--parallel N): N sequences, each with its own KV cache, its cached
tokens (the conversation whose prefix a later request reuses) and the logits its next pick reads.

The runner's one-sequence interface (reusable_prefix, prefill, decode, pick, reset) acts on the slot
in use; `use(slot)` switches it, so a request's work calls use() before each of its steps and the
rest of the runner does not know about slots. `decode_batch` runs one decode step for several slots
at once (the GPU runner: one batched step whose rows name their slot's cells; the CPU runner: one
step per slot, the same arithmetic). `best_slot` is where a new request goes: the free slot that would
reuse the most of it (the common prefix; for a hybrid model only what its DeltaNet states can resume
from), the least recently used among equals.

A request whose prompt begins with what another slot holds (agents' requests share a long system
prompt and tool list) gets that slot's cells of the common prefix copied into its own slot (more
than SHARE_MIN_TOKENS beyond what its slot holds) instead of reading them again: a device-to-device
copy of a few hundred MB at most on the GPU, against a prompt's compute. The copied cells are the
source slot's bits, so the reply is what that slot would give for the same prompt. Not for a hybrid
model (its DeltaNet states are not per position) or a drafting runner (its draft layer's cells).

A slot's conversation that a new request would overwrite (more than KEEP_MIN_TOKENS of it past the
reused prefix) is kept in host RAM first, up to --keep-conversations-gib, least recently used out
first; a later request whose prefix a kept conversation holds (by more than KEEP_MIN_TOKENS beyond
what its slot holds) gets those cells copied back instead of reading them again. The cells come back
bit for bit, so the logits are the same as if the conversation had stayed. A hybrid model's
(qwen3next) kept conversation carries its DeltaNet states after the whole conversation and its
snapshots too, so it resumes from the end or from a snapshot, as in its slot.
"""
from __future__ import annotations

import itertools

from ..errors import InvalidArgument


def reusable_prefix(cached_ids: list[int], ids: list[int]) -> int:
    """Length of the common prefix of the cached tokens and ids, less one if it is all of ids: the
    last prompt token is always read, since its logits are what the next step samples from."""
    n = 0
    for a, b in zip(cached_ids, ids):
        if a != b:
            break
        n += 1
    return min(n, len(ids) - 1)


def keep_bytes(config) -> int:
    """Host RAM for kept conversations: --keep-conversations-gib, at most a quarter of the available
    host memory."""
    from ..system import host_memory
    available = host_memory()[1]
    want = int(config.keep_conversations_gib * 2**30)
    return want if available is None else min(want, available // 4)


KEEP_MIN_TOKENS = 32        # shorter tails are cheaper read again than kept and copied back
SHARE_MIN_TOKENS = 16       # a shorter common prefix with another slot is read again, not copied


class Kept:
    """Conversations out of the slots, in host RAM: (ids, payload, nbytes), least recently used first."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = max(0, int(budget_bytes))
        self.items: list[tuple[list[int], object, int]] = []
        self.kept = self.restored = 0           # counts, for status()
        self.shared = self.shared_tokens = 0    # prefixes copied from another slot (Slots._share)

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.items)

    def fits(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.budget_bytes

    def put(self, ids: list[int], payload, nbytes: int) -> None:
        self.items = [it for it in self.items if it[0] != ids]
        while self.items and self.nbytes + nbytes > self.budget_bytes:
            self.items.pop(0)
        self.items.append((list(ids), payload, nbytes))
        self.kept += 1

    def best(self, ids: list[int]) -> tuple[int, int]:
        """(index, reusable prefix) of the kept conversation that holds the longest prefix of ids."""
        best = (-1, 0)
        for i, (kept_ids, _, _) in enumerate(self.items):
            n = reusable_prefix(kept_ids, ids)
            if n > best[1]:
                best = (i, n)
        return best

    def take(self, index: int) -> tuple[list[int], object]:
        ids, payload, _ = self.items.pop(index)
        self.restored += 1
        return ids, payload

    def status(self) -> dict:
        return {"conversations": len(self.items), "bytes": self.nbytes, "budget_bytes": self.budget_bytes,
                "kept": self.kept, "restored": self.restored, "shared_prefixes": self.shared,
                "shared_tokens": self.shared_tokens}


class Slots:
    """Mixed into a runner whose per-sequence state is self.kv, self.cached_ids and self._last."""

    def _init_slots(self, num_slots: int, make_kv, keep_bytes: int = 0) -> None:
        """Slot 0 is the runner's current state; make_kv(slot) gives each other slot's cache;
        keep_bytes: host RAM for conversations out of the slots (0: none kept). The runner gives
        _cells_out(n) -> (payload, nbytes) and _cells_in(payload, n) for cells 0..n-1 of the slot in
        use, when it can keep conversations."""
        self.kept = Kept(keep_bytes)
        if num_slots < 1:
            raise InvalidArgument(f"parallel slots must be >= 1, got {num_slots}")
        self.num_slots, self.slot = num_slots, 0
        self._parked = [None] + [(make_kv(s), [], None, self._new_slot_state()) for s in range(1, num_slots)]
        self._clock = itertools.count(1)
        self._last_used = [0] * num_slots

    def use(self, slot: int) -> None:
        """Make `slot` the sequence the one-sequence interface acts on."""
        if slot == self.slot:
            self._last_used[slot] = next(self._clock)
            return
        if not 0 <= slot < self.num_slots:
            raise InvalidArgument(f"slot {slot} out of range 0..{self.num_slots - 1} (--parallel {self.num_slots})")
        self._parked[self.slot] = (self.kv, self.cached_ids, self._last, self._slot_state())
        self.kv, self.cached_ids, self._last, state = self._parked[slot]
        for name, value in state.items():
            setattr(self, name, value)
        self._parked[slot] = None
        self.slot = slot
        self._last_used[slot] = next(self._clock)

    def _append_to(self, slot: int, token: int, last) -> None:
        """A batched step appended token to slot `slot`'s sequence and left its logits at `last`:
        that slot's state, in use or parked, says so (the slot in use does not change)."""
        if slot == self.slot:
            self.cached_ids.append(token)
            self._last = last
        else:
            kv, ids, _, state = self._parked[slot]
            ids.append(token)
            self._parked[slot] = (kv, ids, last, state)
        self._last_used[slot] = next(self._clock)

    # what else follows a slot besides its KV, tokens and logits: a drafting runner's drafter (its
    # done cells and pending rows are its sequence's) and a hybrid's snapshot rows
    SLOT_STATE = ("drafter", "snapshot_rows")

    def _slot_state(self) -> dict:
        """The slot in use's other per-sequence state (SLOT_STATE attributes the runner has)."""
        return {name: getattr(self, name) for name in self.SLOT_STATE if getattr(self, name, None) is not None}

    def _new_slot_state(self) -> dict:
        """A fresh sequence's SLOT_STATE: a new drafter like the runner's, no snapshot rows."""
        state = {}
        drafter = getattr(self, "drafter", None)
        if drafter is not None:
            state["drafter"] = type(drafter)(drafter.window, drafter.slots, drafter.prompt_mode)
        if getattr(self, "snapshot_rows", None) is not None:
            state["snapshot_rows"] = {}
        return state

    def _extend_drafters(self, slots: list[int], hidden) -> None:
        """A drafting runner's batched step: its main hidden rows [T, D] (host) to each row's slot's drafter."""
        for row, slot in enumerate(slots):
            drafter = self.drafter if slot == self.slot else self._parked[slot][3]["drafter"]
            drafter.extend(hidden[row:row + 1])

    def slot_ids(self, slot: int) -> list[int]:
        """The tokens slot `slot` holds K/V for."""
        return self.cached_ids if slot == self.slot else self._parked[slot][1]

    def slot_reuse(self, slot: int, ids: list[int]) -> int:
        """How much of ids slot `slot` would not read again: the common prefix, or where its cache
        resumes only at some lengths (a hybrid's DeltaNet states: after the whole conversation or at a
        snapshot) the longest of those within it, so a slot that shares a few tokens it could not
        resume from is not taken over for them."""
        held = self.slot_ids(slot)
        n = reusable_prefix(held, ids)
        kv = self.kv if slot == self.slot else self._parked[slot][0]
        resumable = getattr(kv, "resumable", None)
        return resumable(n, len(held)) if resumable is not None else n

    def best_slot(self, ids: list[int], candidates: list[int]) -> int:
        """The candidate slot to read ids in: the most it would reuse (slot_reuse), then the least
        recently used."""
        if not candidates:
            raise InvalidArgument("best_slot: no free slot to choose from")
        return max(candidates, key=lambda s: (self.slot_reuse(s, ids), -self._last_used[s]))

    def _keeps(self) -> bool:
        return self.kept.budget_bytes > 0 and hasattr(self, "_cells_out") and not getattr(self, "spec", 0)

    def _keep_tail(self, start: int) -> None:
        """A prompt is about to overwrite this slot's cells from `start`: keep the conversation in host
        RAM first when more than KEEP_MIN_TOKENS of it would be lost."""
        n = len(self.cached_ids)
        if not self._keeps() or n - start <= KEEP_MIN_TOKENS:
            return
        payload, nbytes = self._cells_out(n)
        if self.kept.fits(nbytes):
            self.kept.put(self.cached_ids, payload, nbytes)

    def _bring_back(self, ids: list[int], own: int) -> int:
        """The reusable prefix of ids after the longest source of more of it than this slot's own
        `own` tokens is copied in: a kept conversation (_from_kept) or another slot (_share)."""
        return self._share(ids, self._from_kept(ids, own))

    def _shares(self) -> bool:
        """Whether prompts' common prefixes are copied between this runner's slots (_share)."""
        return (self.num_slots > 1 and hasattr(self, "_copy_cells") and not getattr(self, "spec", 0)
                and self.args.architecture != "qwen3next")

    def worth_waiting(self, slot: int, ids: list[int], reading: list[int]) -> bool:
        """Whether a request for ids in `slot` should start only once another slot has read the prompt
        `reading` (the scheduler's question): its cells would then be copied (_share) where this slot
        would read them itself, in chunks beside the other's. Only for a common prefix that is most
        of what this request reads (at least half, and more than SHARE_MIN_TOKENS beyond this slot's
        own reusable prefix) of a prompt not much longer (at most twice the common prefix), so the
        wait is never for much more than it saves."""
        if not self._shares():
            return False
        own = reusable_prefix(self.slot_ids(slot), ids)
        common = reusable_prefix(reading, ids)
        return (common > own + SHARE_MIN_TOKENS and 2 * (common - own) >= len(ids) - own
                and len(reading) <= 2 * common)

    def _share(self, ids: list[int], own: int) -> int:
        """Another slot holding more of ids than `own` tokens (by more than SHARE_MIN_TOKENS) has its
        cells of the common prefix copied into this slot (this slot's conversation kept first where
        it fits) -> the new reusable prefix; else own. The runner gives _copy_cells(slot, n)."""
        if not self._shares():
            return own
        best, source = own + SHARE_MIN_TOKENS, None
        for slot in range(self.num_slots):
            if slot != self.slot:
                n = reusable_prefix(self.slot_ids(slot), ids)
                if n > best:
                    best, source = n, slot
        if source is None:
            return own
        self._keep_tail(0)
        self._copy_cells(source, best)
        self.cached_ids = list(ids[:best])
        self.kept.shared += 1
        self.kept.shared_tokens += best - own
        return best

    def _from_kept(self, ids: list[int], own: int) -> int:
        """A kept conversation holding more of ids than this slot's own `own` tokens (by more than
        KEEP_MIN_TOKENS) is copied back into the slot (the slot's own kept first) -> the new reusable
        prefix; else own."""
        if not self._keeps() or not self.kept.items:
            return own
        index, n = self.kept.best(ids)
        if index >= 0:
            kept_ids, payload, _ = self.kept.items[index]
            n = self._kept_resumable(payload, len(kept_ids), n)
        if n <= own + KEEP_MIN_TOKENS:
            return own
        kept_ids, payload = self.kept.take(index)
        self._keep_tail(0)
        self._cells_in(payload, len(kept_ids))
        self.cached_ids = list(kept_ids)
        return n

    def _kept_resumable(self, payload, kept_len: int, n: int) -> int:
        """How much of a common prefix of n tokens with a kept conversation of kept_len tokens its
        payload can resume: all of it (cells), or less for a hybrid model (its DeltaNet states come
        back only as they were after the whole conversation or after a snapshot's tokens)."""
        return n

    def decode_batch(self, slots: list[int], tokens: list[int]) -> None:
        """One decode step for each slot (slots distinct), token i appended to slot i's sequence; each
        slot's logits stay for its pick() (after use(slot)). This default steps them one by one."""
        for slot, token in zip(slots, tokens):
            self.use(slot)
            self.decode(token, logits=False)
