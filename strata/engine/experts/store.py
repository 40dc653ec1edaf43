"""Where the GPU engine's routed experts live, and how they move: the expert table, the host arena,
the VRAM expert cache with its decode admissions, and the streamed prompt ring.

- The table: one device array [layers, E] of blob addresses, read by every expert kernel (decode
  GEMVs and CUDA graphs included) instead of base + e * stride. An entry points at the expert's
  blob in VRAM (the resident copy of experts.bin, or a cache slot) or at its bytes in the host
  arena, which kernels read in place over the bus (zero-copy). Entries change only between steps,
  on the compute stream, so a step never reads a half-written slot and a graph needs no recapture.
- Resident (the budget holds every expert): experts.bin is uploaded once; the table points into it.
- Streaming: the host arena holds experts.bin in mapped pinned memory; `cache_slots` slots of
  max_blob bytes in VRAM hold the experts the policy keeps. A decode step never waits for the host
  to learn its routing: a missed expert is read zero-copy. After the step the routing comes back
  with the logits (a [layers, T * A] log the step writes), and `after_step` admits misses for later
  tokens: victims are pointed back at the arena at once, the copy-engine stream fills their slots
  while the next step runs, and the entries move to the slots once those copies have landed.
  Policies: "lru" admits every miss over the least recently used; "lfu" keeps a decayed use count
  per expert and admits a miss only over a colder victim.
- Prompt chunks (`prompt_layer`): experts not in the cache go through a ring of `ring_slots` slots.
  A chunk of at least `stream_all_tokens` tokens streams every non-cached expert of every layer
  in a fixed order (layer by layer, ascending expert), issued as far ahead as free slots allow, so
  layer l + 1's copies run while layer l computes; a smaller chunk stages only the experts its
  routing names, layer by layer. Events order it: compute waits for a batch's copy before reading
  its slots, and a copy waits for the compute that last read the slots it overwrites.
- The unpinned share (strata.engine.experts.host): where the system refuses or --pin-limit-gib
  limits pinning, the arena holds a prefix of whole layers and the rest is read from a memmap of
  experts.bin. Their table entries are 0 (nothing may read them in place). Every copy of one (cache
  fill, admission, ring, staged miss) goes through a ring of pinned staging buffers that helper
  threads fill ahead of use, the ring's copies announced in its fixed order, so the same bytes land
  in the same slots. Decode steps then run staged (the runner turns graphs off): each layer's
  routing is read on the host and its unpinned misses copied into staging slots first; pinned
  misses are still read zero-copy (unless --decode-misses staged asks to copy them too).
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field, replace

import numpy as np

from ...errors import InvalidArgument, PackError

SLOT_ALIGN = 256                  # a slot starts on this (kernels need 16)
ADMIT_PER_STEP = 16               # cache admissions queued after one decode step
LFU_DECAY = 0.98                  # per decode step


def slot_bytes(max_blob: int) -> int:
    return -(-max_blob // SLOT_ALIGN) * SLOT_ALIGN


class BufferView:
    """nbytes of a device buffer from offset: what DeviceTensor and Pool need of a buffer."""

    def __init__(self, parent, offset: int, nbytes: int):
        self.parent, self.offset, self.nbytes = parent, offset, nbytes

    @property
    def ptr(self) -> int:
        return self.parent.ptr + self.offset

    def copy_from_host(self, src, stream=None, offset: int = 0):
        self.parent.copy_from_host(src, stream, self.offset + offset)

    def copy_to_host(self, dst, stream=None, offset: int = 0):
        self.parent.copy_to_host(dst, stream, self.offset + offset)


@dataclass
class StoreStats:
    hits: int = 0                 # routed experts found in VRAM (decode and prompt)
    misses: int = 0               # decode: read zero-copy; prompt: streamed through the ring
    admitted: int = 0
    evicted: int = 0
    bytes_h2d: int = 0            # copied host -> device (arena fill excluded)
    prompt_streamed: int = 0      # blobs copied into the ring


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


class ExpertStore:
    """The expert table and the memory behind it (see the module doc)."""

    def __init__(self, rt, device, stream, pack, cache_slots: int | None = None, ring_slots: int = 0,
                 policy: str = "lru", progress: bool = True, profile: np.ndarray | None = None,
                 kept_slots: int | None = None, pool_bytes: int = 0, pin_limit_bytes: int = 0,
                 bus_cap=None):
        """kept_slots: cache slots kept while the plan's largest prompt chunk runs. The memory after
        them (the other cache slots, and beyond them what the plan left beside the cache) is lent
        to the prompt: the ring at its end, and before the ring up to pool_bytes for its activation
        pool (a shorter prompt takes less, lend(), and keeps more slots); the slots come back empty
        after it. None: the ring is a buffer of its own and nothing is lent. pin_limit_bytes: most
        of experts.bin to pin (0: all the system allows). bus_cap: a BusCap pacing the copies and the
        zero-copy reads (--pcie-gbs), or None."""
        if policy not in ("lru", "lfu"):
            raise InvalidArgument(f"expert cache policy must be lru or lfu, got {policy!r}")
        self.rt, self.device, self.stream = rt, device, stream
        self.path = pack.path / "experts.bin"
        self.layers_meta = pack.meta["experts"]["layers"]
        self.num_layers = len(self.layers_meta)
        self.num_experts = int(pack.args.num_experts)
        self.max_blob = int(pack.meta["max_blob"])
        self.slot_bytes = slot_bytes(self.max_blob)
        self.policy = policy
        self.stats = StoreStats()
        self.bus_cap = bus_cap
        self.total = self.num_layers * self.num_experts
        self.file_bytes = int(pack.meta["files"]["experts.bin"]["bytes"])
        L, E = self.num_layers, self.num_experts
        self._offsets = np.array([[lay["offset"] + e * lay["stride"] for e in range(E)] for lay in self.layers_meta],
                                 np.uint64)
        self._blob = np.array([lay["blob_bytes"] for lay in self.layers_meta], np.uint64)
        self._table_host_buf = rt.HostBuffer(device, L * E * 8)
        self.table_host = np.frombuffer(self._table_host_buf, np.uint64).reshape(L, E)
        self.table = rt.DeviceBuffer(device, L * E * 8)
        self.resident = cache_slots is None or cache_slots >= self.total
        self.slot_of = np.full((L, E), -1, np.int64)        # cache slot of (l, e), -1 when not cached
        self.copy_stream = None
        self.ring_slots = 0
        self.kept_slots, self.loan_pool_bytes, self.lent = None, 0, False
        self.lent_from = None                # the first slot lent to the prompt running now
        self.staged_decode = False                          # set by the runner: decode misses staged
        self.stage_pinned_misses = True                     # staged: pinned misses copied too (else zero-copy)
        self.pinned = np.ones((L, E), bool)                 # (l, e) in the pinned arena (or resident)
        self.pinned_bytes, self.pin_reason, self.staging = self.file_bytes, None, None
        self._stage_row = self._stage_slots = None
        if self.resident:
            from ...backends.cuda.memory import upload_file
            self.arena = None
            self.resident_buf = rt.DeviceBuffer(device, self.file_bytes)
            upload_file(rt, device, stream, self.path, self.resident_buf, progress)
            self.upload_bytes = self.file_bytes
            self.table_host[:] = self.resident_buf.ptr + self._offsets
            self.slot_of[:] = np.arange(self.total).reshape(L, E)
            self.cache_slots = self.total
        else:
            self._host_setup(rt, device, progress, pin_limit_bytes)
            self.table_host[:] = self._home(np.arange(L)[:, None], np.arange(E)[None, :])
            self.cache_slots = int(cache_slots)
            self.ring_slots = int(ring_slots)
            lending = kept_slots is not None
            self.kept_slots = min(int(kept_slots), self.cache_slots) if lending else self.cache_slots
            loan = self.ring_slots * self.slot_bytes + pool_bytes if lending else 0
            self.slots = rt.DeviceBuffer(device, -(-max(1, self.cache_slots * self.slot_bytes,
                                                        self.kept_slots * self.slot_bytes + loan) // 256) * 256)
            self.slot_owner = np.full(self.cache_slots, -1, np.int64)   # l * E + e in each slot
            self.copy_stream = rt.Stream(device)
            if lending:
                ring_bytes = self.ring_slots * self.slot_bytes
                self.ring = BufferView(self.slots, (self.slots.nbytes - ring_bytes) // 256 * 256, ring_bytes)
                self.loan_pool_bytes = self.ring.offset - self.kept_slots * self.slot_bytes   # the most a pool may take
            else:
                self.ring = rt.DeviceBuffer(device, max(1, self.ring_slots) * self.slot_bytes)
            self.lent = False
            self._fill_cache(profile)
        self.last_use = np.zeros((L, E), np.int64)
        self.freq = np.zeros((L, E), np.float64) if profile is None else profile.astype(np.float64).copy()
        self.uses = np.zeros((L, E), np.int64)              # routing profile: uses since load
        self.tick = 0
        self._pending: list = []                           # [(l, e, slot)] copies in flight
        self._pending_event = None
        self._ring_pos = 0
        self._ring_batches: list[_Batch] = []              # every batch the ring has held, oldest first
        self._ring_starts: list[int] = []
        self._computed_end = 0                             # ring positions whose compute has been queued
        self._chunk: _Chunk | None = None
        self.table.copy_from_host(self.table_host, stream)

    # ---- setup ---------------------------------------------------------------------------------
    def _host_setup(self, rt, device, progress: bool, pin_limit_bytes: int) -> None:
        """The pinned arena (a prefix of whole layers, all of experts.bin where allowed) and, for
        the rest, a memmap of the file and the staging ring."""
        from ...pack.source import memmap
        from .host import StagingRing, pin_arena
        t0 = time.perf_counter()
        starts = sorted(int(lay["offset"]) for lay in self.layers_meta)
        self.arena, self.pinned_bytes, self.pin_reason = pin_arena(
            rt, device, self.path, starts[1:] + [self.file_bytes], self.file_bytes, pin_limit_bytes, progress)
        self.arena_seconds = time.perf_counter() - t0
        self.host_read = self.arena.device_ptr if self.arena is not None else 0   # what kernels read (zero-copy)
        self.host_copy = self.arena.ptr if self.arena is not None else 0          # what copies read
        self.pinned = self._offsets + self._blob[:, None] <= np.uint64(self.pinned_bytes)
        if self.pinned.all():
            return
        source = memmap(self.path)
        if source.size < self.file_bytes:
            raise PackError(f"{self.path}: ends at byte {source.size}, pack.json says {self.file_bytes}")
        self.staging = StagingRing(rt, device, source, self._offsets, self._blob, self.slot_bytes)

    def _home(self, ls, es):
        """Table entries of experts not in VRAM: their arena bytes (read zero-copy), 0 when unpinned."""
        return np.where(self.pinned[ls, es], np.uint64(self.host_read) + self._offsets[ls, es], np.uint64(0))

    def _fill_cache(self, profile: np.ndarray | None) -> None:
        """The first residents: the most used experts of a loaded routing profile, else the same
        number of experts from every layer (round-robin over the layers)."""
        L, E = self.num_layers, self.num_experts
        if profile is not None:
            order = np.argsort(-profile.reshape(-1), kind="stable")
        else:
            order = (np.arange(E)[:, None] + np.arange(L)[None, :] * E).reshape(-1)   # e-major: layer by layer
        chosen = order[:self.cache_slots]
        for slot, key in enumerate(chosen.tolist()):
            self._place(key // E, key % E, slot)
        self._copy_into_slots(chosen // E, chosen % E, np.arange(len(chosen)), self.stream)
        self.stream.synchronize()
        self.upload_bytes, self.stats.bytes_h2d = self.stats.bytes_h2d, 0   # the initial fill is setup, not traffic
        if self.bus_cap is not None:
            self.bus_cap.paced_bytes = 0

    def _place(self, l: int, e: int, slot: int) -> None:
        self.slot_of[l, e] = slot
        self.slot_owner[slot] = l * self.num_experts + e
        self.table_host[l, e] = self.slots.ptr + slot * self.slot_bytes

    def _evict(self, slot: int) -> None:
        """Empty a slot: its expert is read from its home (the arena, or staged) again."""
        l, e = divmod(int(self.slot_owner[slot]), self.num_experts)
        self.slot_of[l, e] = -1
        self.table_host[l, e] = self._home(l, e)
        self.slot_owner[slot] = -1

    def _copy_into_slots(self, ls, es, slots, stream) -> None:
        ls, es = np.asarray(ls, np.int64), np.asarray(es, np.int64)
        dst = (self.slots.ptr + np.asarray(slots, np.uint64) * np.uint64(self.slot_bytes)).astype(np.uint64)
        self._copy(dst, ls, es, stream)

    def _copy(self, dst: np.ndarray, ls: np.ndarray, es: np.ndarray, stream, expected: bool = False) -> None:
        """Blobs (ls, es) to device addresses dst on stream: from the arena, or (unpinned) through
        the staging ring; expected: the ring was told of the unpinned ones in this order."""
        dst, ls, es = np.asarray(dst, np.uint64), np.asarray(ls, np.int64), np.asarray(es, np.int64)
        sizes = self._blob[ls].astype(np.uint64)
        pinned = self.pinned[ls, es]
        if self.bus_cap is not None:
            self.bus_cap.before(stream)
        if pinned.any():
            src = (np.uint64(self.host_copy) + self._offsets[ls[pinned], es[pinned]]).astype(np.uint64)
            self.rt.copy_h2d_batch(np.ascontiguousarray(dst[pinned]), np.ascontiguousarray(src),
                                   np.ascontiguousarray(sizes[pinned]), stream)
        if not pinned.all():
            self.staging.copy(dst[~pinned], ls[~pinned], es[~pinned], stream, expected)
        self.stats.bytes_h2d += int(sizes.sum())
        if self.bus_cap is not None:
            self.bus_cap.after(stream, int(sizes.sum()))

    # ---- what kernels read -----------------------------------------------------------------------
    def table_row(self, layer: int) -> int:
        """Device address of layer's [E] row of blob addresses."""
        return self.table.ptr + layer * self.num_experts * 8

    @property
    def cached(self) -> int:
        return int((self.slot_of >= 0).sum())

    def status(self) -> dict:
        s = self.stats
        uses = s.hits + s.misses
        return {"slots": self.cache_slots, "resident": self.cached, "admitting": len(self._pending),
                "total_experts": self.total,
                "policy": self.policy, "hits": s.hits, "misses": s.misses, "hit_rate": s.hits / uses if uses else 0.0,
                "admitted": s.admitted, "evicted": s.evicted, "prompt_streamed": s.prompt_streamed,
                "arena_pinned_bytes": 0 if self.resident else self.pinned_bytes,
                "arena_pinned_share": None if self.resident else self.pinned_bytes / max(1, self.file_bytes),
                "staged_blobs": 0 if self.staging is None else self.staging.staged_blobs,
                "bytes_h2d": s.bytes_h2d, "bus_cap": None if self.bus_cap is None else self.bus_cap.status()}

    # ---- a run that leaves no trace (CudaRunner.warm_up) -------------------------------------------
    _KEPT = ("uses", "last_use", "freq", "slot_of", "table_host")

    def snapshot(self) -> dict:
        """What a request changes that a later one could observe: the counters, the routing profile,
        the policy's scores and where every expert lives (restore() puts them back)."""
        staging = self.staging
        return {"stats": replace(self.stats), "tick": self.tick, "lent_from": self.lent_from,
                "arrays": {n: getattr(self, n).copy() for n in self._KEPT},
                "slot_owner": None if self.resident else self.slot_owner.copy(),
                "staging": None if staging is None else (staging.staged_blobs, staging.late_fills,
                                                         staging.wait_seconds)}

    def restore(self, saved: dict) -> None:
        """Back to a snapshot(), no prompt running: admissions in flight are dropped, every cache slot
        whose expert changed gets the snapshot's expert copied back (a slot a prompt lent comes back
        empty, an admission may have put another expert there), and the table, counters, routing
        profile and policy scores read as they did. The copies are queued on the compute stream."""
        self.stream.synchronize()
        if self.copy_stream is not None:    # admissions and the ring's copies land before any slot is refilled
            self.copy_stream.synchronize()
        self._pending, self._pending_event = [], None
        self._ring_pos, self._ring_batches, self._ring_starts, self._computed_end = 0, [], [], 0
        self._chunk, self.lent, self.lent_from = None, False, saved["lent_from"]
        if not self.resident:
            owner = saved["slot_owner"]
            # a slot that still holds its snapshot expert holds its bytes: only the loan and admission
            # copies write slots, and an admission's slot gets its owner once the copy has landed
            back = np.flatnonzero((self.slot_owner != owner) & (owner >= 0))
            self.slot_owner[:] = owner
            if back.size:
                self._copy_into_slots(owner[back] // self.num_experts, owner[back] % self.num_experts, back,
                                      self.stream)
        for name, array in saved["arrays"].items():
            getattr(self, name)[:] = array
        self.tick, self.stats = saved["tick"], replace(saved["stats"])
        if self.staging is not None:
            self.staging.staged_blobs, self.staging.late_fills, self.staging.wait_seconds = saved["staging"]
        self.table.copy_from_host(self.table_host, self.stream)

    # ---- decode: admissions ----------------------------------------------------------------------
    def after_step(self, routed: np.ndarray) -> None:
        """A decode step's routing [layers, T * A] (the step is done): count hits and misses, queue
        admissions of missed experts for later steps (see the module doc)."""
        self.tick += 1
        L = routed.shape[0]
        ls = np.repeat(np.arange(L), routed.shape[1])
        es = routed.reshape(-1).astype(np.int64)
        np.add.at(self.uses, (ls, es), 1)
        if self.resident:
            self.stats.hits += es.size
            return
        cached = self.slot_of[ls, es] >= 0
        self.stats.hits += int(cached.sum())
        self.stats.misses += int((~cached).sum())
        if self.bus_cap is not None and not self.staged_decode:     # staged misses were paced as copies
            read = np.unique(ls[~cached] * self.num_experts + es[~cached]) // self.num_experts
            self.bus_cap.zero_copy(self.stream, int(self._blob[read].sum()))
        self.last_use[ls, es] = self.tick
        self.freq *= LFU_DECAY
        np.add.at(self.freq, (ls, es), 1.0)
        dirty = self._land_pending()
        if self._pending or self.cache_slots == 0:
            if dirty:
                self.table.copy_from_host(self.table_host, self.stream)
            return
        keys = np.unique(ls[~cached] * self.num_experts + es[~cached])
        keys = keys[self.slot_of.reshape(-1)[keys] < 0]     # not landed by _land_pending just now
        dirty |= self._admit(keys, np.unique(ls * self.num_experts + es))
        if dirty:
            self.table.copy_from_host(self.table_host, self.stream)
        if self._pending:
            ready = self.rt.Event(self.device)
            ready.record(self.stream)               # victims no longer in the table
            self.copy_stream.wait_event(ready)
            pl, pe, ps = (np.array(v) for v in zip(*self._pending))
            self._copy_into_slots(pl, pe, ps, self.copy_stream)
            self._pending_event = self.rt.Event(self.device)
            self._pending_event.record(self.copy_stream)

    def _land_pending(self) -> bool:
        """Point the table at slots whose copies have landed; True when the table changed."""
        if not self._pending or not self._pending_event.query():
            return False
        for l, e, slot in self._pending:
            self._place(l, e, slot)
        self.stats.admitted += len(self._pending)
        self._pending, self._pending_event = [], None
        return True

    def _admit(self, keys: np.ndarray, used_now: np.ndarray) -> bool:
        """Queue up to ADMIT_PER_STEP missed keys (nothing is pending when this runs): empty slots
        first, then victims not routed in this step (used_now: its keys); True when the table changed
        (a victim pointed back at the arena; an empty slot changes nothing yet)."""
        E = self.num_experts
        if keys.size == 0:
            return False
        score = (self.last_use if self.policy == "lru" else self.freq).reshape(-1)
        owners = self.slot_owner
        free = self._free_slots()[:min(ADMIT_PER_STEP, keys.size)].tolist()
        for key, slot in zip(keys[:len(free)].tolist(), free):      # empty slots (given back by a prompt) first
            self._pending.append((key // E, key % E, slot))
        keys = keys[len(free):]
        candidates = np.flatnonzero(owners >= 0)
        candidates = candidates[~np.isin(owners[candidates], used_now)]
        changed = False
        if keys.size == 0 or candidates.size == 0:
            return changed
        if self.policy == "lfu":
            keys = keys[np.argsort(-score[keys], kind="stable")]
        keys = keys[:ADMIT_PER_STEP - len(free)]
        n = min(keys.size, candidates.size)
        victims = candidates[np.argsort(score[owners[candidates]], kind="stable")[:n]]
        for key, slot in zip(keys[:n].tolist(), victims.tolist()):
            if self.policy == "lfu" and score[key] <= score[owners[slot]]:
                continue
            self._evict(slot)
            self.stats.evicted += 1
            self._pending.append((key // E, key % E, slot))
            changed = True
        return changed

    # ---- decode: staged misses (the comparison arm of zero-copy) ---------------------------------
    def stage_layer(self, layer: int, routed: np.ndarray) -> int:
        """A decode step's routing at `layer` (read on the host): copy the missed experts (the
        unpinned ones only, unless stage_pinned_misses) into staging slots on the compute stream
        and -> the device address of a table row [E] that points them there (the others as the
        table does)."""
        E = self.num_experts
        if self._stage_row is None:
            self._stage_row = self.rt.DeviceBuffer(self.device, self.num_layers * E * 8)
        row = self.table_host[layer].copy()
        experts = np.unique(routed).tolist()
        for e, addr in self._stage_misses(layer, experts, self.stage_pinned_misses, routed.size).items():
            row[e] = addr
        self._stage_row.copy_from_host(row, self.stream, layer * E * 8)
        return self._stage_row.ptr + layer * E * 8

    def _stage_misses(self, layer: int, experts: list, pinned_too: bool, reserve: int = 0) -> dict:
        """Copy the experts of `layer` not in VRAM (pinned ones only if pinned_too) into staging
        slots (at least `reserve` of them) on the compute stream, where their last readers are
        too; -> {e: address}."""
        missed = [e for e in experts if self.slot_of[layer, e] < 0 and (pinned_too or not self.pinned[layer, e])]
        if not missed:
            return {}
        if self._stage_slots is None or self._stage_slots.nbytes < len(missed) * self.slot_bytes:
            self.stream.synchronize()
            self._stage_slots = self.rt.DeviceBuffer(self.device, max(len(missed), reserve) * self.slot_bytes)
        dst = self._stage_slots.ptr + np.arange(len(missed), dtype=np.uint64) * np.uint64(self.slot_bytes)
        dst = dst.astype(np.uint64)
        self._copy(dst, np.full(len(missed), layer), np.asarray(missed), self.stream)
        return dict(zip(missed, dst.tolist()))

    # ---- prompts: the loan -----------------------------------------------------------------------
    def lend(self, pool_bytes: int | None = None):
        """A prompt starts: the cache slots that overlap the ring and a pool of pool_bytes before it
        (None: the most the plan allows, loan_pool_bytes) are emptied (their experts read from the
        arena again) and lent. -> the pool's region (a BufferView) or None when no pool is lent."""
        if self.resident or self.lent or not isinstance(self.ring, BufferView):
            return None
        self._land_pending_sync()
        pool_bytes = self.loan_pool_bytes if pool_bytes is None else min(max(0, int(pool_bytes)), self.loan_pool_bytes)
        start = (self.ring.offset - pool_bytes) // 256 * 256
        self.lent_from = min(self.cache_slots, start // self.slot_bytes)
        for slot in range(self.lent_from, self.cache_slots):
            if self.slot_owner[slot] >= 0:
                self._evict(slot)
        self.table.copy_from_host(self.table_host, self.stream)
        ready = self.rt.Event(self.device)
        ready.record(self.stream)                 # decode steps done with the lent slots
        self.copy_stream.wait_event(ready)        # before any ring copy lands in them
        self.lent = True
        if not pool_bytes:
            return None
        return BufferView(self.slots, start, self.ring.offset - start)

    def give_back(self) -> None:
        """The prompt is done: the lent slots are empty cache slots again (admissions fill them)."""
        self._retire_chunk()
        self.lent = False

    def _free_slots(self) -> np.ndarray:
        usable = self.cache_slots if not self.lent else self.lent_from
        return np.flatnonzero(self.slot_owner[:usable] < 0)

    # ---- prompts: the ring ---------------------------------------------------------------------
    def prompt_begin(self, T: int, stream_all_tokens: int, layers: int) -> None:
        """A chunk of T tokens through `layers` layers starts: in streaming mode with a big enough
        chunk, queue every non-cached expert of those layers through the ring (copies start as
        slots allow)."""
        self._land_pending_sync()
        self._retire_chunk()
        self._chunk = _Chunk(stream_all=not self.resident and self.ring_slots > 0 and T >= stream_all_tokens)
        if self._chunk.stream_all:
            for l in range(layers):
                missing = np.flatnonzero(self.slot_of[l] < 0).tolist()
                self._add_batches(l, missing)
            self._pump()

    def _retire_chunk(self) -> None:
        """Batches the last chunk queued but never computed (it stopped early) give their slots back."""
        if self._chunk is None:
            return
        leftover = [b for b in self._chunk.batches if b.done is None]
        if leftover:
            for b in leftover:
                b.done = self.rt.Event(self.device)
                b.done.record(self.stream)
            self._computed_end = self._ring_pos
            self._pump()
        self._chunk = None

    def _land_pending_sync(self) -> None:
        if self._pending:
            self._pending_event.synchronize()
            if self._land_pending():
                self.table.copy_from_host(self.table_host, self.stream)

    def _add_batches(self, layer: int, experts: list) -> None:
        chunk = self._chunk
        for i in range(0, len(experts), self.ring_slots):
            part = experts[i:i + self.ring_slots]
            chunk.by_layer.setdefault(layer, []).append(len(chunk.batches))
            batch = _Batch(layer, part, self._ring_pos)
            if self.staging is not None:        # helpers read them ahead, in the order _pump copies them
                self.staging.expect([(layer, e) for e in part if not self.pinned[layer, e]])
            self._ring_pos += len(part)
            chunk.batches.append(batch)
            self._ring_batches.append(batch)
            self._ring_starts.append(batch.start)

    def _pump(self) -> None:
        """Queue the copies of every batch whose slots are free of queued compute."""
        R = self.ring_slots
        for batch in self._chunk.batches:
            if batch.issued:
                continue
            end = batch.start + len(batch.experts)
            if end - R > self._computed_end:
                return                                  # its slots still hold experts compute has yet to read
            last_reader = end - R - 1
            if last_reader >= 0:
                owner = self._ring_batches[bisect.bisect_right(self._ring_starts, last_reader) - 1]
                if owner.done is not None:
                    self.copy_stream.wait_event(owner.done)
            ls = np.full(len(batch.experts), batch.layer)
            dst = self.ring.ptr + (np.arange(batch.start, end, dtype=np.uint64) % np.uint64(R)) * np.uint64(
                self.slot_bytes)
            self._copy(dst.astype(np.uint64), ls, np.asarray(batch.experts), self.copy_stream, expected=True)
            batch.copied = self.rt.Event(self.device)
            batch.copied.record(self.copy_stream)
            batch.issued = True
            self.stats.prompt_streamed += len(batch.experts)
        self._prune()

    def _prune(self) -> None:
        """Forget the batches no later copy can wait for (and their events): those ending a whole ring
        before the first batch not yet copied, once computed. A later batch's copy waits for the
        batch holding its position minus the ring size, which is never before that point."""
        first = next((b.start for b in self._chunk.batches if not b.issued), self._ring_pos)
        floor, k = first - self.ring_slots, 0
        for b in self._ring_batches:
            if b.done is None or b.start + len(b.experts) > floor:
                break
            k += 1
        if k:
            del self._ring_batches[:k], self._ring_starts[:k]

    def streams_all(self) -> bool:
        """Whether the chunk now running streams every non-cached expert through the ring, so its
        batches do not depend on the routing (the prompt path may then group on the device)."""
        return self._chunk is not None and self._chunk.stream_all

    def prompt_layer(self, layer: int, active: list[int]):
        """Yield (experts, addresses) batches that together cover `active` (ascending expert ids
        of a chunk's routing at this layer), each after the compute stream waits for its copies.
        The caller queues its kernels for a batch before asking for the next."""
        self.stats.hits += int(sum(self.slot_of[layer, e] >= 0 for e in active))
        if self.resident or self.ring_slots == 0:
            if not self.resident:
                self.stats.misses += int(sum(self.slot_of[layer, e] < 0 for e in active))
            staged = self._stage_misses(layer, active, False, len(active)) if self.staging is not None else {}
            yield active, [staged.get(e, int(self.table_host[layer, e])) for e in active]
            return
        chunk = self._chunk
        if not chunk.stream_all:
            missing = [e for e in active if self.slot_of[layer, e] < 0]
            self._add_batches(layer, missing)
            self._pump()
        self.stats.misses += int(sum(self.slot_of[layer, e] < 0 for e in active))
        batches = [chunk.batches[i] for i in chunk.by_layer.get(layer, [])]
        if not batches:
            yield active, [int(self.table_host[layer, e]) for e in active]
            return
        where = {}
        for b in batches:
            for i, e in enumerate(b.experts):
                where[e] = self.ring.ptr + ((b.start + i) % self.ring_slots) * self.slot_bytes
        bounds = [b.experts[-1] for b in batches]
        bounds[-1] = self.num_experts
        lo = 0
        for b, bound in zip(batches, bounds):
            mine = [e for e in active[lo:] if e <= bound]
            lo += len(mine)
            if mine:
                if not b.issued:
                    self._pump()
                if not b.issued:
                    raise AssertionError("expert ring: a batch's copies could not be queued before its compute")
                self.stream.wait_event(b.copied)
                yield mine, [where[e] if e in where else int(self.table_host[layer, e]) for e in mine]
            b.done = self.rt.Event(self.device)
            b.done.record(self.stream)
            self._computed_end = max(self._computed_end, b.start + len(b.experts))
            self._pump()
