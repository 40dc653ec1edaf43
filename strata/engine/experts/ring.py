"""The streamed prompt ring (strata.engine.experts.store owns one): how a prompt chunk reads the
experts that are not in the VRAM cache.

Experts not in the cache go through a ring of `ring_slots` slots. A chunk of at least
`stream_all_tokens` tokens streams every non-cached expert of every layer in a fixed order (layer
by layer, ascending expert), issued as far ahead as free slots allow, so layer l + 1's copies run
while layer l computes; a smaller chunk stages only the experts its routing names, layer by layer.
Events order it: compute waits for a batch's copy before reading its slots, and a copy waits for
the compute that last read the slots it overwrites. Without a ring (resident, or no ring slots)
every expert is read where the table points, unpinned misses staged first.

`begin` starts a chunk and returns it; the runner puts it in the chunk's MoePlan (as
`batches`, ExpertStore.chunk_plan), so the forward asks that chunk for each layer's batches. The
ring keeps the open chunk only to close it: the next `begin` (or `retire`, when the loan ends)
gives back the slots of batches it queued but never computed.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from ...errors import InvalidArgument


@dataclass
class _Batch:
    """Ring positions [start, start + len(experts)) of one layer's experts, copied together."""
    layer: int
    experts: list
    start: int
    copied: object = None         # Event on the copy stream
    done: object = None           # Event on the compute stream: its slots may be overwritten
    issued: bool = False


@dataclass
class _Chunk:
    batches: list = field(default_factory=list)
    by_layer: dict = field(default_factory=dict)   # layer -> [batch index]
    stream_all: bool = False


class PromptRing:
    """Batches of a prompt chunk's experts through the ring buffer of `store` (store.ring,
    store.ring_slots slots), copied on its copy stream."""

    def __init__(self, store):
        self.store = store
        self.reset()

    def reset(self) -> None:
        """No chunk, no batch in the ring (every copy and compute of the ring has finished)."""
        self._pos = 0
        self._history: list[_Batch] = []               # every batch the ring still remembers, oldest first
        self._starts: list[int] = []
        self._computed_end = 0                         # ring positions whose compute has been queued
        self._open: _Chunk | None = None               # the last chunk begun, until retired

    def streams_all(self, T: int, stream_all_tokens: int) -> bool:
        """Whether a chunk of T tokens streams every non-cached expert (begin)."""
        s = self.store
        return not s.resident and s.ring_slots > 0 and T >= stream_all_tokens

    def begin(self, T: int, stream_all_tokens: int, layers, skipped=None) -> _Chunk:
        """A chunk of T tokens through `layers` layers (a count from layer 0, or a range: the draft
        layer's own chunk) starts: in streaming mode with a big enough chunk, queue every non-cached
        expert of those layers through the ring (copies start as slots allow), but those skipped(l)
        names (the host computes them). -> the chunk, for layer()."""
        s = self.store
        s.admissions.land_sync()
        self.retire()
        chunk = self._open = _Chunk(stream_all=self.streams_all(T, stream_all_tokens))
        if chunk.stream_all:
            for l in (range(layers) if isinstance(layers, int) else layers):
                missing = np.flatnonzero(s.slot_of[l] < 0).tolist()
                if skipped is not None:
                    missing = [e for e in missing if e not in skipped(l)]
                self._add_batches(chunk, l, missing)
            self._pump(chunk)
        return chunk

    def retire(self) -> None:
        """Batches the last chunk queued but never computed (it stopped early) give their slots back."""
        chunk, self._open = self._open, None
        if chunk is None:
            return
        leftover = [b for b in chunk.batches if b.done is None]
        if leftover:
            s = self.store
            for b in leftover:
                b.done = s.rt.Event(s.device)
                b.done.record(s.stream)
            self._computed_end = self._pos
            self._pump(chunk)

    def _add_batches(self, chunk: _Chunk, layer: int, experts: list) -> None:
        s = self.store
        for i in range(0, len(experts), s.ring_slots):
            part = experts[i:i + s.ring_slots]
            chunk.by_layer.setdefault(layer, []).append(len(chunk.batches))
            batch = _Batch(layer, part, self._pos)
            if s.staging is not None:        # helpers read them ahead, in the order _pump copies them
                s.staging.expect([(layer, e) for e in part if not s.pinned[layer, e]])
            self._pos += len(part)
            chunk.batches.append(batch)
            self._history.append(batch)
            self._starts.append(batch.start)

    def _pump(self, chunk: _Chunk) -> None:
        """Queue the copies of every batch of chunk whose slots are free of queued compute."""
        s = self.store
        R = s.ring_slots
        for batch in chunk.batches:
            if batch.issued:
                continue
            end = batch.start + len(batch.experts)
            if end - R > self._computed_end:
                return                                  # its slots still hold experts compute has yet to read
            last_reader = end - R - 1
            if last_reader >= 0:
                owner = self._history[bisect.bisect_right(self._starts, last_reader) - 1]
                if owner.done is not None:
                    s.copy_stream.wait_event(owner.done)
            ls = np.full(len(batch.experts), batch.layer)
            dst = s.ring_addresses(np.arange(batch.start, end, dtype=np.uint64))
            s._copy(dst, ls, np.asarray(batch.experts), s.copy_stream, expected=True)
            batch.copied = s.rt.Event(s.device)
            batch.copied.record(s.copy_stream)
            batch.issued = True
            s.stats.prompt_streamed += len(batch.experts)
        self._prune(chunk)

    def _prune(self, chunk: _Chunk) -> None:
        """Forget the batches no later copy can wait for (and their events): those ending a whole ring
        before the first batch not yet copied, once computed. A later batch's copy waits for the
        batch holding its position minus the ring size, which is never before that point."""
        first = next((b.start for b in chunk.batches if not b.issued), self._pos)
        floor, k = first - self.store.ring_slots, 0
        for b in self._history:
            if b.done is None or b.start + len(b.experts) > floor:
                break
            k += 1
        if k:
            del self._history[:k], self._starts[:k]

    def layer(self, chunk: _Chunk, layer: int, active: list[int]):
        """Yield (experts, addresses) batches of chunk that together cover `active` (ascending
        expert ids of its routing at this layer), each after the compute stream waits for its
        copies. The caller queues its kernels for a batch before asking for the next."""
        if chunk is not self._open:
            raise InvalidArgument("expert ring: a chunk's plan was used after the next chunk began or the loan ended")
        s = self.store
        s.stats.hits += int(sum(s.slot_of[layer, e] >= 0 for e in active))
        if s.resident or s.ring_slots == 0:
            if not s.resident:
                s.stats.misses += int(sum(s.slot_of[layer, e] < 0 for e in active))
            staged = s.stager.misses(layer, active, False, len(active)) if s.staging is not None else {}
            yield active, [staged.get(e, int(s.table_host[layer, e])) for e in active]
            return
        if not chunk.stream_all:
            missing = [e for e in active if s.slot_of[layer, e] < 0]
            self._add_batches(chunk, layer, missing)
            self._pump(chunk)
        s.stats.misses += int(sum(s.slot_of[layer, e] < 0 for e in active))
        batches = [chunk.batches[i] for i in chunk.by_layer.get(layer, [])]
        if not batches:
            yield active, [int(s.table_host[layer, e]) for e in active]
            return
        where = {}
        for b in batches:
            for e, addr in zip(b.experts, s.ring_addresses(np.arange(b.start, b.start + len(b.experts),
                                                                     dtype=np.uint64)).tolist()):
                where[e] = addr
        bounds = [b.experts[-1] for b in batches]
        bounds[-1] = s.num_experts
        lo = 0
        for b, bound in zip(batches, bounds):
            mine = [e for e in active[lo:] if e <= bound]
            lo += len(mine)
            if mine:
                if not b.issued:
                    self._pump(chunk)
                if not b.issued:
                    raise AssertionError("expert ring: a batch's copies could not be queued before its compute")
                s.stream.wait_event(b.copied)
                yield mine, [where[e] if e in where else int(s.table_host[layer, e]) for e in mine]
            b.done = s.rt.Event(s.device)
            b.done.record(s.stream)
            self._computed_end = max(self._computed_end, b.start + len(b.experts))
            self._pump(chunk)
