"""Decode-time admissions to the VRAM expert cache (strata.engine.experts.store owns one).

A decode step never waits for the host to learn its routing: a missed expert is read zero-copy.
After the step the routing comes back with the logits (a [layers, T * A] log the step writes), and
`after_step` admits misses for later tokens: victims are pointed back at the arena at once, the
copy-engine stream fills their slots while the next step runs, and the entries move to the slots
once those copies have landed. Policies: "lru" admits every miss over the least recently used;
"lfu" keeps a decayed use count per expert and admits a miss only over a colder victim.

The routing profile (`uses`, every routed expert since load) is counted here too, resident or not.
"""
from __future__ import annotations

import numpy as np

ADMIT_PER_STEP = 16               # cache admissions queued after one decode step
# ... of which into empty slots (a prompt's loan gives its slots back empty): no victim, so more a step.
# At 12 GiB on qwen3-30b-a3b the first decode steps after a 64-token prompt missed about 100 experts a
# token and took 12.8 ms against 3.3 once warm, falling by ~0.7 ms a step at 16 admissions (H100,
# parallel_bench --trace): the slots the loan emptied refilled at 16 a step. One lease, 1 / 2 / 4 / 8
# clients: 246.8 / 296.5 / 351.3 / 323.6 tok/s at 64 against 225.9 / 268.3 / 254.8 / 269.7 at 16; 128
# was no better than 64 (docs/PERF.md, twenty-second session).
ADMIT_EMPTY_PER_STEP = 64
LFU_DECAY = 0.98                  # per decode step


class Admissions:
    """The policy's state (last_use, freq, tick), the routing profile (uses) and the admissions in
    flight, over the slots and table of `store`."""

    def __init__(self, store, profile: np.ndarray | None):
        L, E = store.num_layers, store.num_experts
        self.store = store
        self.last_use = np.zeros((L, E), np.int64)
        self.freq = np.zeros((L, E), np.float64) if profile is None else profile.astype(np.float64).copy()
        self.uses = np.zeros((L, E), np.int64)              # routing profile: uses since load
        self.tick = 0
        self._pending: list = []                           # [(l, e, slot)] copies in flight
        self._pending_event = None

    @property
    def admitting(self) -> int:
        return len(self._pending)

    def after_step(self, routed: np.ndarray, host_keys=()) -> None:
        """A decode step's routing [layers, T * A] (the step is done): count hits and misses, queue
        admissions of missed experts for later steps (see the module doc). host_keys: misses the
        host computed (--cpu-experts' decode split): missed all the same, but not read over the bus."""
        s = self.store
        self.tick += 1
        L = routed.shape[0]
        ls = np.repeat(np.arange(L), routed.shape[1])
        es = routed.reshape(-1).astype(np.int64)
        np.add.at(self.uses, (ls, es), 1)
        if s.resident:
            s.stats.hits += es.size
            return
        cached = s.slot_of[ls, es] >= 0
        hits = int(cached.sum())
        s.stats.hits += hits
        s.stats.misses += cached.size - hits
        s.stats.decode_hits += hits
        s.stats.decode_misses += cached.size - hits
        missed = np.unique(ls[~cached] * s.num_experts + es[~cached])     # (layer, expert) keys, once each
        if not s.staged_decode:     # zero-copy misses crossed the bus in place (staged ones are copies: bytes_h2d)
            bus = missed[~np.isin(missed, np.asarray(host_keys, np.int64))]
            nbytes = int(s._blob[bus // s.num_experts].sum())
            s.stats.bytes_in_place += nbytes
            if s.bus_cap is not None:
                s.bus_cap.zero_copy(s.stream, nbytes)
        self.last_use[ls, es] = self.tick
        self.freq *= LFU_DECAY
        np.add.at(self.freq, (ls, es), 1.0)
        dirty = self.land()
        if self._pending or s.cache_slots == 0:
            if dirty:
                s.table.copy_from_host(s.table_host, s.stream)
            return
        keys = missed[s.slot_of.reshape(-1)[missed] < 0]     # not landed by land() just now
        dirty |= self._admit(keys, np.unique(ls * s.num_experts + es))
        if dirty:
            s.table.copy_from_host(s.table_host, s.stream)
        if self._pending:
            ready = s.rt.Event(s.device)
            ready.record(s.stream)               # victims no longer in the table
            s.copy_stream.wait_event(ready)
            pl, pe, ps = (np.array(v) for v in zip(*self._pending))
            s._copy_into_slots(pl, pe, ps, s.copy_stream)
            self._pending_event = s.rt.Event(s.device)
            self._pending_event.record(s.copy_stream)

    def land(self) -> bool:
        """Point the table at slots whose copies have landed; True when the table changed."""
        if not self._pending or not self._pending_event.query():
            return False
        for l, e, slot in self._pending:
            self.store._place(l, e, slot)
        self.store.stats.admitted += len(self._pending)
        self._pending, self._pending_event = [], None
        return True

    def land_sync(self) -> None:
        """Wait for the admissions in flight, and point the table (on the device too) at their slots."""
        if self._pending:
            self._pending_event.synchronize()
            if self.land():
                self.store.table.copy_from_host(self.store.table_host, self.store.stream)

    def _admit(self, keys: np.ndarray, used_now: np.ndarray) -> bool:
        """Queue missed keys (nothing is pending when this runs): up to ADMIT_EMPTY_PER_STEP into empty
        slots first, then, up to ADMIT_PER_STEP in all, over victims not routed in this step (used_now:
        its keys); True when the table changed (a victim pointed back at the arena; an empty slot
        changes nothing yet)."""
        s = self.store
        E = s.num_experts
        if keys.size == 0:
            return False
        score = (self.last_use if s.policy == "lru" else self.freq).reshape(-1)
        owners = s.slot_owner
        free = s._free_slots()[:min(ADMIT_EMPTY_PER_STEP, keys.size)].tolist()
        for key, slot in zip(keys[:len(free)].tolist(), free):      # empty slots (given back by a prompt) first
            self._pending.append((key // E, key % E, slot))
        keys = keys[len(free):]
        candidates = np.flatnonzero(owners >= 0)
        candidates = candidates[candidates >= s.fixed_slots]          # a fixed layer's slots stay
        candidates = candidates[~np.isin(owners[candidates], used_now)]
        changed = False
        if keys.size == 0 or candidates.size == 0 or len(free) >= ADMIT_PER_STEP:
            return changed
        if s.policy == "lfu":
            keys = keys[np.argsort(-score[keys], kind="stable")]
        keys = keys[:ADMIT_PER_STEP - len(free)]
        n = min(keys.size, candidates.size)
        victims = candidates[np.argsort(score[owners[candidates]], kind="stable")[:n]]
        for key, slot in zip(keys[:n].tolist(), victims.tolist()):
            if s.policy == "lfu" and score[key] <= score[owners[slot]]:
                continue
            s._evict(slot)
            s.stats.evicted += 1
            self._pending.append((key // E, key % E, slot))
            changed = True
        return changed

    # ---- a run that leaves no trace (ExpertStore.snapshot / restore) ----------------------------
    def snapshot(self) -> dict:
        return {"tick": self.tick, "uses": self.uses.copy(), "last_use": self.last_use.copy(),
                "freq": self.freq.copy()}

    def restore(self, saved: dict) -> None:
        """Back to a snapshot(): admissions in flight dropped (the caller has waited for their copies);
        the arrays are written in place (the runner holds `uses` for the profile it writes)."""
        self._pending, self._pending_event = [], None
        for name in ("uses", "last_use", "freq"):
            getattr(self, name)[:] = saved[name]
        self.tick = saved["tick"]
