"""The CPU runner: owns the model, its ops and one sequence's KV cache, and runs prompt chunks and steps."""
from __future__ import annotations

import numpy as np

from ..backends.cpu import CpuOps, KVCache
from ..backends.cpu_linear_attn import HybridCache, Qwen3NextCpuOps
from ..backends.cpu_rows import RowOps
from ..config import SamplingParams
from ..model import build
from .sampler import pick_host
from .slots import Slots, reusable_prefix
from .speculate import Speculating


class CpuRunner(Speculating, Slots):
    device = "cpu"

    def __init__(self, pack, max_context: int, prefill_chunk: int = 512, kv: str = "f32", spec: int | str = 0,
                 parallel: int = 1, keep_bytes: int = 0, draft_window: int = 0, draft_prompt: str = "batched"):
        self.args = pack.args
        self.kv_format = kv                  # strata.quant.kv: f32 (exact), or a --kv format
        self.ops = (Qwen3NextCpuOps if self.args.architecture == "qwen3next" else CpuOps)(pack, self.args)
        self.model = build(self.args, self.ops)
        # decode steps and verify windows: every row computes what a one-row step does (cpu_rows);
        # qwen3next steps one token at a time, and verifies a window as one-row steps (verify)
        hybrid = self.args.architecture == "qwen3next"
        self.step_model = self.model if hybrid else build(self.args, RowOps(self.ops))
        self.max_context = max_context
        self._init_spec(spec, draft_window, draft_prompt)
        self.prefill_chunk = prefill_chunk
        self.kv = self._new_kv()
        self.cached_ids: list[int] = []      # tokens whose K/V the cache holds, from position 0
        self._last = None                    # logits [V] of the last prefill or decode
        # strata.engine.slots: one sequence each (a drafter each where drafting); conversations kept in
        # host RAM (a hybrid's with its states)
        self._init_slots(parallel, lambda slot: self._new_kv(), keep_bytes)

    def _new_kv(self) -> KVCache:
        a = self.args
        # --draft-window: the draft layer's cells a ring of its window (Speculating._init_spec)
        rings = {a.num_hidden_layers: (self.draft_window, self.draft_slots)} if self.draft_window else None
        kv = KVCache(a.num_hidden_layers + a.num_mtp_layers, a.num_key_value_heads, a.head_dim,
                     self.max_context, self.kv_format, rings)
        return HybridCache(kv, a) if a.architecture == "qwen3next" else kv

    def warm_up(self, num_tokens: int = 16) -> None:
        """Dequantize the weights while the ops' cache can keep them all, then read a few tokens
        through a scratch KV cache, so the first request pays neither (numpy's first calls, the
        allocator); nothing of it stays: the KV, the cached prefix and the last logits are as before."""
        a, ops = self.args, self.ops
        mtp = tuple(f"blk.{l}." for l in range(a.num_hidden_layers, a.num_hidden_layers + a.num_mtp_layers))
        names = [n for n in ops.pack.meta["dense"] if self.spec or not n.startswith(mtp)]  # drafting or not
        if self._weights_f32_bytes(names) <= ops.cache.max_bytes:
            for name in names:
                ops.weight(name)
            for layer in range(a.num_hidden_layers):
                for e in range(a.num_experts):
                    ops.expert_weights(layer, e)
        saved = self.kv, self.cached_ids, self._last
        try:
            self.kv, self.cached_ids = self._new_kv(), []
            ids = np.arange(num_tokens, dtype=np.int64) % a.vocab_size
            self.model.forward(ids, np.arange(num_tokens), self.kv, logits_rows=slice(-1, None))
            out, _ = self.model.forward(ids[:1], np.asarray([num_tokens]), self.kv)
            pick_host(out[-1], SamplingParams(temperature=0.8, top_p=0.9, top_k=40), 0.5)
        finally:
            self.kv, self.cached_ids, self._last = saved

    def _weights_f32_bytes(self, dense_names: list[str]) -> int:
        """Bytes of every weight dequantized to float32 (what warm_up would put in the ops' cache)."""
        meta, a = self.ops.pack.meta, self.args
        dense = sum(4 * int(np.prod(meta["dense"][n]["shape"])) for n in dense_names)
        per_expert = 4 * 3 * a.moe_intermediate_size * a.hidden_size
        return dense + per_expert * a.num_experts * a.num_hidden_layers

    def reset(self) -> None:
        self.kv = self._new_kv()
        self.cached_ids = []
        if self.drafter:
            self.drafter.reset()

    def reusable_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of ids already have K/V here (at least one token is always read);
        a hybrid model resumes its DeltaNet states only from the live state or a snapshot (HybridCache)."""
        n = reusable_prefix(self.cached_ids, ids)
        if not isinstance(self.kv, HybridCache):
            return self.drafter.reusable(self.cached_ids, ids, n) if self.drafter else self._bring_back(ids, n)
        n = self.kv.resumable(n, len(self.cached_ids))
        return self._hybrid_reusable(ids, n) if self.drafter else self._bring_back(ids, n)

    def _cells_out(self, n: int):
        """(a copy of cells 0..n-1 of this slot's KV, its bytes) for a kept conversation (slots.Kept);
        a hybrid's copy holds its DeltaNet states and snapshots as well."""
        if not isinstance(self.kv, HybridCache):
            return self._kv_copy(self.kv, n)
        hybrid = self.kv
        cells, nbytes = self._kv_copy(hybrid.kv, n)
        out = HybridCache(cells, self.args, hybrid.max_snapshots)
        out.conv = {l: a.copy() for l, a in hybrid.conv.items()}
        out.ssm = {l: a.copy() for l, a in hybrid.ssm.items()}
        out.snapshots = list(hybrid.snapshots)      # snapshot()/rewind() never change one in place
        return out, nbytes + hybrid.state_bytes() * (1 + len(out.snapshots))

    def _kept_resumable(self, payload, kept_len: int, n: int) -> int:
        return payload.resumable(n, kept_len) if isinstance(payload, HybridCache) else n

    @staticmethod
    def _kv_copy(kv: KVCache, n: int):
        out = KVCache(len(kv.planes), *kv.shape, kv.max_len, kv.fmt)
        nbytes = 0
        for layer, planes in enumerate(kv.planes):
            if planes is None:
                continue
            out.planes[layer] = [tuple(None if a is None else a[:n].copy() for a in pair) for pair in planes]
            out.cells[layer] = min(n, kv.cells[layer])
            nbytes += sum(a.nbytes for pair in out.planes[layer] for a in pair if a is not None)
        return out, nbytes

    def _cells_in(self, payload, n: int) -> None:
        self.kv = payload

    def _copy_cells(self, slot: int, n: int) -> None:
        """Cells 0..n-1 of slot `slot`'s KV copied in as this slot's (Slots._share)."""
        self.kv = self._kv_copy(self._parked[slot][0], n)[0]

    interleaves = True      # prefill_steps may pause between chunks while other slots step

    def prefill(self, ids: list[int], start: int, on_progress=None, logits: bool = True) -> np.ndarray | None:
        """Read ids[start:] at positions start.. (K/V of ids[:start] must be cached); -> last logits [V]
        (None without `logits`: pick() reads them)."""
        for _ in self.prefill_steps(ids, start, on_progress):
            pass
        return self._last if logits else None

    def prefill_steps(self, ids: list[int], start: int, on_progress=None):
        """prefill() as a generator that pauses between chunks: meanwhile the caller may step other
        slots (then use() this slot again); the last logits stay for pick()."""
        self._keep_tail(start)                               # (a hybrid's live states with it)
        if isinstance(self.kv, HybridCache):
            self.kv.rewind(start, len(self.cached_ids))      # start came from reusable_prefix
        self.cached_ids = self.cached_ids[:start]
        if self.drafter:
            self._truncate_drafter(start)
            self.draft_chunks = []
        out = None
        for lo in range(start, len(ids), self.prefill_chunk):
            hi = min(len(ids), lo + self.prefill_chunk)
            chunk = np.asarray(ids[lo:hi], dtype=np.int64)
            out, hidden = self.model.forward(chunk, np.arange(lo, hi), self.kv, logits_rows=slice(-1, None))
            self.cached_ids.extend(ids[lo:hi])
            if self.drafter:                 # the draft layer's K/V of this chunk, batched
                self.drafter.extend(hidden)
                self._flush_drafter()
            if on_progress is not None:
                on_progress(hi - start, len(ids) - start)
            if hi < len(ids):
                yield
        if isinstance(self.kv, HybridCache):
            self.kv.snapshot(len(ids))                      # a follow-up turn resumes from here
            if self.drafter:
                self._snapshot_row(len(ids))
        self._last = out[-1]

    def decode(self, token: int, logits: bool = True) -> np.ndarray | None:
        """Append one token at the next position; -> its logits [V] (None without `logits`)."""
        pos = len(self.cached_ids)
        out, hidden = self.step_model.forward(np.asarray([token]), np.asarray([pos]), self.kv)
        self.cached_ids.append(token)
        if self.drafter:
            self.drafter.extend(hidden)
        self._last = out[-1]
        return self._last if logits else None

    def pick(self, params, u: float, mask=None, host=None, step: bool = False, feed: int | None = None) -> int:
        """The next token from the last prefill's or decode's logits (strata.engine.sampler); mask:
        an allowed-token bitmask (strata.engine.grammar) or None; host: row -> row, the request's
        adjustment of the logits before the mask and the pick (strata.engine.logits). step: then
        decode the token too, as decode(token, logits=False) (CudaRunner.pick queues it early), or
        feed instead of it."""
        token = pick_host(self._last if host is None else host(self._last), params, u, mask)
        if step:
            self.decode(token if feed is None else feed, logits=False)
        return token

    # speculation (strata.engine.speculate.Speculating drives these) ---------------------------------
    def verify(self, ids: list[int], start: int):
        """The main model over ids at start.. with row-invariant ops -> (logits [T, V], hidden [T, D]).
        A hybrid reads the window as one-row steps, keeping the DeltaNet states after each row
        (HybridCache.window_row), so forget() rolls them back to the last accepted row's."""
        if not isinstance(self.kv, HybridCache):
            return self.step_model.forward(np.asarray(ids, np.int64), np.arange(start, start + len(ids)), self.kv)
        self.kv.window_begin(start)
        rows = []
        for i, t in enumerate(ids):
            rows.append(self.step_model.forward(np.asarray([t]), np.asarray([start + i]), self.kv))
            self.kv.window_row()
        return np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])

    def mtp(self, hidden, next_ids, positions, logits_rows=slice(None)):
        return self.model.mtp_step(hidden, next_ids, positions, self.kv, logits_rows=logits_rows)

    @property
    def mtp_cells(self):
        """The draft layer's K/V cells alone (strata.model.qwen3moe.Qwen3Moe.mtp_cells), where the
        model has that pass."""
        cells = getattr(self.model, "mtp_cells", None)
        if cells is None:
            raise AttributeError("mtp_cells")
        return lambda hidden, next_ids, positions: cells(hidden, next_ids, positions, self.kv)

    def forget(self, layers, start: int, stop: int) -> None:
        for layer in layers:
            self.kv.forget(layer, start, stop)

    def logits_all(self, ids: list[int]) -> np.ndarray:
        """Logits at every position of one prompt, read from position 0 [T, V]."""
        return np.concatenate([logits for _, logits in self.logits_chunks(ids)]).astype(np.float32)

    def logits_chunks(self, ids: list[int], chunk: int | None = None):
        """(lo, logits [T, V] of ids[lo:lo + T]) for one prompt read from position 0 in chunks of
        `chunk` tokens (default the prefill chunk); the last row stays for pick()."""
        self.reset()
        chunk = chunk or self.prefill_chunk
        for lo in range(0, len(ids), chunk):
            hi = min(len(ids), lo + chunk)
            logits, _ = self.model.forward(np.asarray(ids[lo:hi], dtype=np.int64), np.arange(lo, hi), self.kv)
            self.cached_ids.extend(ids[lo:hi])
            self._last = logits[-1]
            yield lo, logits

    def status(self) -> dict:
        return {"device": "cpu", "gpu": None, "prefill_chunk": self.prefill_chunk, "prefill_ring": 0,
                "expert_cache": None, "bytes_h2d": 0, "spec": self.spec,
                "speculation": ({**self.spec_stats.to_dict(),
                                 "auto": self.spec_auto.to_dict() if self.spec_auto else None}
                                if self.spec else None),
                "draft": self.draft_status() if self.spec else None,
                # the CPU's KV is all host memory: cells written so far, nothing crosses a bus
                "kv": {"format": self.kv_format, "cells_vram": 0, "cells_host": len(self.cached_ids),
                       "bus_bytes_per_token": 0},
                "parallel": self.num_slots, "kept_conversations": self.kept.status()}
