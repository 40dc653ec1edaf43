"""Parallel slots of one runner (--parallel N): N sequences, each with its own KV cache, its cached
tokens (the conversation whose prefix a later request reuses) and the logits its next pick reads.

The runner's one-sequence interface (reusable_prefix, prefill, decode, pick, reset) acts on the slot
in use; `use(slot)` switches it, so a request's work calls use() before each of its steps and the
rest of the runner does not know about slots. `decode_batch` runs one decode step for several slots
at once (the GPU runner: one batched step whose rows name their slot's cells; the CPU runner: one
step per slot, the same arithmetic). `best_slot` is where a new request goes: the free slot with the
longest reusable prefix, the least recently used among equals.
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


class Slots:
    """Mixed into a runner whose per-sequence state is self.kv, self.cached_ids and self._last."""

    def _init_slots(self, num_slots: int, make_kv) -> None:
        """Slot 0 is the runner's current state; make_kv(slot) gives each other slot's cache."""
        if num_slots < 1:
            raise InvalidArgument(f"parallel slots must be >= 1, got {num_slots}")
        self.num_slots, self.slot = num_slots, 0
        self._parked = [None] + [(make_kv(s), [], None) for s in range(1, num_slots)]
        self._clock = itertools.count(1)
        self._last_used = [0] * num_slots

    def use(self, slot: int) -> None:
        """Make `slot` the sequence the one-sequence interface acts on."""
        if slot == self.slot:
            self._last_used[slot] = next(self._clock)
            return
        if not 0 <= slot < self.num_slots:
            raise InvalidArgument(f"slot {slot} out of range 0..{self.num_slots - 1} (--parallel {self.num_slots})")
        self._parked[self.slot] = (self.kv, self.cached_ids, self._last)
        self.kv, self.cached_ids, self._last = self._parked[slot]
        self._parked[slot] = None
        self.slot = slot
        self._last_used[slot] = next(self._clock)

    def slot_ids(self, slot: int) -> list[int]:
        """The tokens slot `slot` holds K/V for."""
        return self.cached_ids if slot == self.slot else self._parked[slot][1]

    def best_slot(self, ids: list[int], candidates: list[int]) -> int:
        """The candidate slot to read ids in: the longest reusable prefix, then the least recently used."""
        if not candidates:
            raise InvalidArgument("best_slot: no free slot to choose from")
        return max(candidates, key=lambda s: (reusable_prefix(self.slot_ids(s), ids), -self._last_used[s]))

    def decode_batch(self, slots: list[int], tokens: list[int]) -> None:
        """One decode step for each slot (slots distinct), token i appended to slot i's sequence; each
        slot's logits stay for its pick() (after use(slot)). This default steps them one by one."""
        for slot, token in zip(slots, tokens):
            self.use(slot)
            self.decode(token, logits=False)
