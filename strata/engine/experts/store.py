"""Where the GPU engine's routed experts live, and how they move: the expert table, the host arena,
the VRAM expert cache with its decode admissions, and the streamed prompt ring.

- The table: one device array [layers, E] of blob addresses, read by every expert kernel (decode
  GEMVs and CUDA graphs included) instead of base + e * stride. An entry points at the expert's
  blob in VRAM (the resident copy of experts.bin, or a cache slot) or at its bytes in the host
  arena, which kernels read in place over the bus (zero-copy). Entries change only between steps,
  on the compute stream, so a step never reads a half-written slot and a graph needs no recapture.
- Resident (the budget holds every expert): experts.bin is uploaded once; the table points into it.
- Streaming: the host arena holds experts.bin in mapped pinned memory; `cache_slots` slots of
  max_blob bytes in VRAM hold the experts the policy keeps. A decode step reads a missed expert
  zero-copy; after it, `after_step` admits misses for later tokens (strata.engine.experts.admissions).
- Prompt chunks (`chunk_plan`): experts not in the cache go through a ring of `ring_slots` slots
  (strata.engine.experts.ring). While a prompt runs, the cache's tail slots may be lent to the ring
  and the activation pool (`lend`, `give_back`).
- The ops never see the store: `chunk_plan` and `step_plan` give the MoePlan
  (strata.backends.cuda.moe_plan) a forward carries to DeviceOps.moe, which asks it for the
  chunk's batches, the staged table rows and where the routing log goes.
- The unpinned share (strata.engine.experts.host): where the system refuses or --pin-limit-gib
  limits pinning, the arena holds a prefix of whole layers and the rest is read from a memmap of
  experts.bin. Their table entries are 0 (nothing may read them in place). Every copy of one (cache
  fill, admission, ring, staged miss) goes through a ring of pinned staging buffers that helper
  threads fill ahead of use, the ring's copies announced in its fixed order, so the same bytes land
  in the same slots. Decode steps then run staged (the runner turns graphs off): each layer's
  routing is read on the host and its unpinned misses copied into staging slots first
  (strata.engine.experts.staged); pinned misses are still read zero-copy (unless --decode-misses
  staged asks to copy them too).

ExpertStore holds the table, the slots and their owners, and what lies behind them (resident copy,
arena, staging ring); the admissions, the prompt ring and the staged misses are parts it owns, each
working on those.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from ...backends.cuda.moe_plan import MoePlan
from ...errors import InvalidArgument, PackError
from .admissions import Admissions
from .ring import PromptRing
from .staged import MissStager

SLOT_ALIGN = 256                  # a slot starts on this (kernels need 16)


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
    bytes_in_place: int = 0       # decode misses read in place over the bus (zero-copy), each missed blob once a step
    decode_hits: int = 0          # of hits and misses, a decode step's (the decode split's pricing reads them)
    decode_misses: int = 0
    prompt_streamed: int = 0      # blobs copied into the ring
    room_lends: int = 0           # prompts that borrowed the draft layer's experts as ring slots



class ExpertStore:
    """The expert table and the memory behind it (see the module doc)."""

    def __init__(self, rt, device, stream, pack, cache_slots: int | None = None, ring_slots: int = 0,
                 policy: str = "lru", progress: bool = True, profile: np.ndarray | None = None,
                 kept_slots: int | None = None, pool_bytes: int = 0, pin_limit_bytes: int = 0,
                 bus_cap=None, fixed_layers: tuple = ()):
        """kept_slots: cache slots kept while the plan's largest prompt chunk runs. The memory after
        them (the other cache slots, and beyond them what the plan left beside the cache) is lent
        to the prompt: the ring at its end, and before the ring up to pool_bytes for its activation
        pool (a shorter prompt takes less, lend(), and keeps more slots); the slots come back empty
        after it. None: the ring is a buffer of its own and nothing is lent. pin_limit_bytes: most
        of experts.bin to pin (0: all the system allows). bus_cap: a BusCap pacing the copies and the
        zero-copy reads (--pcie-gbs), or None. fixed_layers: layers whose every expert is cached
        for good (the MTP draft layer under --mtp: the plan prices it apart, "mtp"), in cache slots
        0.. of their own beside cache_slots, never evicted nor lent."""
        if policy not in ("lru", "lfu"):
            raise InvalidArgument(f"expert cache policy must be lru or lfu, got {policy!r}")
        self.rt, self.device, self.stream = rt, device, stream
        self.path = getattr(pack, "experts_file", None) or pack.path / "experts.bin"   # a stage's: a FileSlice
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
        # The table goes to the device whole from this one pinned buffer, so a copy still queued when
        # the host writes it again sends the newer table early. Harmless, as every write leaves
        # entries any step may read from then on: an eviction points back at the arena (an unpinned
        # expert's 0 is read by no kernel: decode runs staged), a placement comes once the slot's
        # copy has landed (Admissions.land) or, after a stream sync, behind the slot's copies
        # (restore, close_room); and a slot is refilled only after the table copy that evicted it
        # has run (the events of Admissions.after_step and lend), which sends that eviction or newer.
        self._table_host_buf = rt.HostBuffer(device, L * E * 8)
        self.table_host = np.frombuffer(self._table_host_buf, np.uint64).reshape(L, E)
        self.table = rt.DeviceBuffer(device, L * E * 8)
        self.resident = cache_slots is None or cache_slots >= self.total
        self.fixed_layers, self.fixed_slots, self.room_slots = (), 0, 0
        self.slot_of = np.full((L, E), -1, np.int64)        # cache slot of (l, e), -1 when not cached
        self.copy_stream = None
        self.ring_slots = 0
        self.kept_slots, self.loan_pool_bytes, self.lent = None, 0, False
        self.lent_from = None                # the first slot lent to the prompt running now
        self.staged_decode = False                          # set by the runner: decode misses staged
        self.host_experts = None                            # set by the runner: the host's share (HostExperts)
        self.stage_pinned_misses = True                     # staged: pinned misses copied too (else zero-copy)
        self.pinned = np.ones((L, E), bool)                 # (l, e) in the pinned arena (or resident)
        self.pinned_bytes, self.pin_reason, self.staging = self.file_bytes, None, None
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
            self.fixed_layers = tuple(fixed_layers)
            self.fixed_slots = len(self.fixed_layers) * E
            self.room_slots = 0                 # of the ring's, the fixed layers' slots lent to a prompt
            self.cache_slots = int(cache_slots) + self.fixed_slots
            self.ring_slots = int(ring_slots)
            lending = kept_slots is not None
            self.kept_slots = (min(int(kept_slots) + self.fixed_slots, self.cache_slots) if lending
                               else self.cache_slots)
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
        self.admissions = Admissions(self, profile)        # decode: the policy and its copies in flight
        self.prompts = PromptRing(self)                    # prompt chunks: the ring's batches
        self.stager = MissStager(self)                     # staged misses
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
        order = order[~np.isin(order // E, np.asarray(self.fixed_layers, np.int64))]
        chosen = np.concatenate([self._fixed_keys(), order[:self.cache_slots - self.fixed_slots]])   # fixed: slots 0..
        self._fill_slots(chosen, np.arange(len(chosen)))
        self.stream.synchronize()
        self.upload_bytes, self.stats.bytes_h2d = self.stats.bytes_h2d, 0   # the initial fill is setup, not traffic
        if self.bus_cap is not None:
            self.bus_cap.paced_bytes = 0

    def _fixed_keys(self) -> np.ndarray:
        """The keys l * E + e of every expert of the fixed layers, in their slots' order."""
        E = self.num_experts
        return (np.asarray(self.fixed_layers, np.int64)[:, None] * E + np.arange(E)[None, :]).reshape(-1)

    def _fill_slots(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Experts keys (l * E + e) into cache slots `slots`: the table points there, their blobs are
        copied on the stream (the caller uploads the table)."""
        E = self.num_experts
        for slot, key in zip(slots.tolist(), keys.tolist()):
            self._place(key // E, key % E, slot)
        self._copy_into_slots(keys // E, keys % E, slots, self.stream)

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
        return {"slots": self.cache_slots, "resident": self.cached, "admitting": self.admissions.admitting,
                "total_experts": self.total,
                "policy": self.policy, "hits": s.hits, "misses": s.misses, "hit_rate": s.hits / uses if uses else 0.0,
                "admitted": s.admitted, "evicted": s.evicted, "prompt_streamed": s.prompt_streamed,
                "arena_pinned_bytes": 0 if self.resident else self.pinned_bytes,
                "arena_pinned_share": None if self.resident else self.pinned_bytes / max(1, self.file_bytes),
                "staged_blobs": 0 if self.staging is None else self.staging.staged_blobs,
                "bytes_h2d": s.bytes_h2d, "bus_cap": None if self.bus_cap is None else self.bus_cap.status(),
                "host": None if self.host_experts is None else self.host_experts.status()}

    # ---- a run that leaves no trace (CudaRunner.warm_up) -------------------------------------------
    def snapshot(self) -> dict:
        """What a request changes that a later one could observe: the counters, the routing profile,
        the policy's scores and where every expert lives (restore() puts them back)."""
        staging = self.staging
        return {"stats": replace(self.stats), "lent_from": self.lent_from, "policy": self.admissions.snapshot(),
                "host": None if self.host_experts is None else replace(self.host_experts.stats),
                "arrays": {"slot_of": self.slot_of.copy(), "table_host": self.table_host.copy()},
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
        self.admissions.restore(saved["policy"])
        self.prompts.reset()
        self.lent, self.lent_from = False, saved["lent_from"]
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
        self.stats = replace(saved["stats"])
        if self.host_experts is not None and saved.get("host") is not None:
            self.host_experts.stats = replace(saved["host"])
        if self.staging is not None:
            self.staging.staged_blobs, self.staging.late_fills, self.staging.wait_seconds = saved["staging"]
        self.table.copy_from_host(self.table_host, self.stream)

    # ---- prompts: the ring's slots, and the draft layer's room (seed 001) --------------------------
    def ring_addresses(self, positions: np.ndarray) -> np.ndarray:
        """Device addresses of ring positions (uint64, unbounded: taken modulo the ring): the ring's own
        slots, then, while the room is open, the fixed layers' cache slots 0..room_slots-1."""
        idx = positions % np.uint64(self.ring_slots)
        own = np.uint64(self.ring_slots - self.room_slots)
        slot = np.uint64(self.slot_bytes)
        return np.where(idx < own, np.uint64(self.ring.ptr) + idx * slot,
                        np.uint64(self.slots.ptr) + (idx - own) * slot).astype(np.uint64)

    def open_room(self) -> bool:
        """A long prompt borrows the fixed (draft) layers' cached experts as more ring slots, in place:
        nothing is freed or allocated, so captured graphs stay valid. Nothing reads those experts while
        a prompt runs (the draft layer's prompt pass writes its K/V alone). -> whether it opened."""
        if self.resident or self.room_slots or not self.fixed_slots or self.ring_slots == 0:
            return False
        self.admissions.land_sync()
        self.stream.synchronize()                  # no step still reads the draft layer's experts
        self.copy_stream.synchronize()
        self.prompts.reset()                       # ring positions start again over the larger ring
        for l in self.fixed_layers:
            self.slot_of[l] = -1
            self.table_host[l] = self._home(np.full(self.num_experts, l), np.arange(self.num_experts))
        self.table.copy_from_host(self.table_host, self.stream)
        self.room_slots = self.fixed_slots
        self.ring_slots += self.room_slots
        self.stats.room_lends += 1
        return True

    def close_room(self) -> None:
        """The room comes back before the next decode step: the fixed layers' experts are copied into
        their slots again (from the arena) and the table points there."""
        if not self.room_slots:
            return
        self.prompts.retire()
        self.stream.synchronize()                  # the prompt's compute is done with the ring
        self.copy_stream.synchronize()
        self.prompts.reset()
        self.ring_slots -= self.room_slots
        self.room_slots = 0
        self._fill_slots(self._fixed_keys(), np.arange(self.fixed_slots))
        self.table.copy_from_host(self.table_host, self.stream)

    # ---- prompts: the loan -----------------------------------------------------------------------
    def lend(self, pool_bytes: int | None = None):
        """A prompt starts: the cache slots that overlap the ring and a pool of pool_bytes before it
        (None: the most the plan allows, loan_pool_bytes) are emptied (their experts read from the
        arena again) and lent. -> the pool's region (a BufferView) or None when no pool is lent."""
        if self.resident or self.lent or not isinstance(self.ring, BufferView):
            return None
        self.admissions.land_sync()
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
        self.prompts.retire()
        self.lent = False

    def _free_slots(self) -> np.ndarray:
        usable = self.cache_slots if not self.lent else self.lent_from
        return np.flatnonzero(self.slot_owner[:usable] < 0)

    # ---- what the runner calls, done by the parts: the plans a forward carries to the ops ----------
    def after_step(self, routed: np.ndarray, host_keys=()) -> None:
        """A decode step's routing [layers, T * A] (the step is done): Admissions.after_step;
        host_keys: the (layer * E + expert) misses the host computed (--cpu-experts), not read in place."""
        self.admissions.after_step(routed, host_keys)

    def step_plan(self, route_log: int = 0) -> MoePlan:
        """The plan of every decode step (and prompt chunk of a step's size): read the table, write
        the routing to route_log (a device address, 0 for none), misses staged where decode runs
        staged (MissStager.stage_layer). The same value serves every step, graphs included."""
        return MoePlan(resident=self.resident, route_log=route_log,
                       stage=self.stager.stage_layer if self.staged_decode else None)

    def chunk_plan(self, T: int, stream_all_tokens: int, layers) -> MoePlan:
        """A prompt chunk of more than a decode step's T tokens starts (PromptRing.begin): its plan,
        whose batches are this chunk's (PromptRing.layer), valid until the next chunk begins."""
        split = None
        if self.host_experts is not None:     # the host's share of the misses (--cpu-experts)
            self.admissions.land_sync()       # the split reads where experts are after admissions land
            split = self.host_experts.chunk(T, self.prompts.streams_all(T, stream_all_tokens), layers)
        chunk = self.prompts.begin(T, stream_all_tokens, layers, None if split is None else split.skipped)
        return MoePlan(resident=self.resident, stream_all=chunk.stream_all, batches=partial(self.prompts.layer, chunk),
                       host=split)

    # the policy's state and the routing profile (the runner writes `uses` out; tests compare them)
    @property
    def uses(self) -> np.ndarray:
        return self.admissions.uses

    @property
    def last_use(self) -> np.ndarray:
        return self.admissions.last_use

    @property
    def freq(self) -> np.ndarray:
        return self.admissions.freq

    @property
    def tick(self) -> int:
        return self.admissions.tick
