"""Staged misses (strata.engine.experts.store owns a MissStager): missed experts copied into
staging slots in VRAM on the compute stream before the kernels that read them, instead of being
read zero-copy. Decode runs staged for --decode-misses staged (the comparison arm of zero-copy), or
where part of experts.bin is unpinned (nothing may read those in place); a prompt chunk without a
ring stages its unpinned misses the same way.
"""
from __future__ import annotations

import numpy as np


class MissStager:
    """Staging slots (grown on demand) and the staged table rows of `store`."""

    def __init__(self, store):
        self.store = store
        self._row = self._slots = None      # DeviceBuffers, made on first use

    def stage_layer(self, layer: int, routed: np.ndarray) -> int:
        """A decode step's routing at `layer` (read on the host): copy the missed experts (the
        unpinned ones only, unless store.stage_pinned_misses) into staging slots on the compute
        stream and -> the device address of a table row [E] that points them there (the others as
        the table does)."""
        s = self.store
        E = s.num_experts
        if self._row is None:
            self._row = s.rt.DeviceBuffer(s.device, s.num_layers * E * 8)
        row = s.table_host[layer].copy()
        experts = np.unique(routed).tolist()
        for e, addr in self.misses(layer, experts, s.stage_pinned_misses, routed.size).items():
            row[e] = addr
        self._row.copy_from_host(row, s.stream, layer * E * 8)
        return self._row.ptr + layer * E * 8

    def misses(self, layer: int, experts: list, pinned_too: bool, reserve: int = 0) -> dict:
        """Copy the experts of `layer` not in VRAM (pinned ones only if pinned_too) into staging
        slots (at least `reserve` of them) on the compute stream, where their last readers are
        too; -> {e: address}."""
        s = self.store
        missed = [e for e in experts if s.slot_of[layer, e] < 0 and (pinned_too or not s.pinned[layer, e])]
        if not missed:
            return {}
        if self._slots is None or self._slots.nbytes < len(missed) * s.slot_bytes:
            s.stream.synchronize()
            self._slots = s.rt.DeviceBuffer(s.device, max(len(missed), reserve) * s.slot_bytes)
        dst = self._slots.ptr + np.arange(len(missed), dtype=np.uint64) * np.uint64(s.slot_bytes)
        dst = dst.astype(np.uint64)
        s._copy(dst, np.full(len(missed), layer), np.asarray(missed), s.stream)
        return dict(zip(missed, dst.tolist()))
