"""The GPU runner's prompt chunks: each chunk's expert plan (ExpertStore.chunk_plan: the ring's
batches of that chunk), its positions uploaded once, the model's launches from Python, and the
loan: while a prompt of more than a decode step's tokens runs, the cache's tail slots are lent to
the ring and the activation pool (ExpertStore.lend) and given back after it.
"""
from __future__ import annotations

import contextlib

import numpy as np

from ..backends.cuda.memory import PromptSegments, StepRows
from ..errors import InvalidArgument
from . import memory_model
from .cuda_decode import stage_rows
from .memory_model import STEP_MAX_TOKENS


class PromptChunks:
    """Prompt chunks of one runner's model on its ops and expert store (module doc). step_plan:
    the plan of a chunk of a decode step's size or less, which takes the decode path."""

    def __init__(self, ops, model, store, args, step_plan, vram, kv_format: str, max_context: int):
        self.ops, self.model, self.store, self.args = ops, model, store, args
        self.step_plan = step_plan
        self._sizes, self._cells = vram.sizes, vram.cells      # the loan of each prompt (loan_pool_bytes)
        self.kv_format, self.max_context = kv_format, max_context
        # pick() reads the last logits row a chunk left here: the chunk's memory may be lent back
        # to the expert cache before then
        self.last_row = ops.rt.DeviceBuffer(ops.device, 4 * args.vocab_size)

    def forward(self, ids: list[int], lo: int, kv, last_only: bool, download: bool = True,
                hidden: bool = False, hand=None) -> np.ndarray | None:
        """Logits of ids read at positions lo.. ([1, V] for the last token only, else [T, V]); without
        `download` only the last row stays, copied to last_row for pick(). hidden: the chunk's last
        hidden states [T, D] also come to the host, as self.hidden (the drafter's input)."""
        ops, a = self.ops, self.args
        rows = slice(-1, None) if last_only else None
        logits, h = self._forward(ids, lo, kv, rows, hand)
        self.hidden = ops.to_host(h) if hidden else None
        V = a.vocab_size
        ops._copy_rows(logits.ptr + (logits.shape[0] - 1) * V * 4, 0, self.last_row.ptr, 1, V, 0, 0)
        return ops.to_host(logits) if download else None

    def forward_segments(self, segments, kv):
        """Several slots' prompts in one forward (CudaRunner.prefill_batch): segments [(ids, lo, base,
        kv_view)], each ids read at positions lo.. of the sequence whose cell 0 is cell `base` of kv
        (the whole cache; kv_view that slot's view of it) -> the logits of each prompt's last row
        [len(segments), V] on the device. One pass over the weights and experts for all of them."""
        ops = self.ops
        for ids, lo, _, _ in segments:
            self._check_context(lo, len(ids))
        ids = [t for seg in segments for t in seg[0]]
        T = len(ids)
        # the rows as a decode step stages them (each row's position, length, cell and sequence), in
        # one upload, and each prompt's positions as it uploads them read alone
        host = np.empty(4 * T + 1, np.int32)
        stage_rows(host, 0, T + 1, 2 * T + 1, 3 * T + 1,
                   np.concatenate([np.arange(lo, lo + len(seg)) for seg, lo, _, _ in segments]),
                   np.concatenate([np.full(len(seg), base, np.int64) for seg, _, base, _ in segments]))
        t = ops.upload(host)
        rows = StepRows(t.buf, t.offset, T, t.keep, t.ptr + 4 * (T + 1), t.ptr + 4 * (2 * T + 1),
                        t.ptr + 4 * (3 * T + 1), kv.num_slots)
        parts, r0 = [], 0
        for seg, lo, _, view in segments:
            parts.append((r0, r0 + len(seg), view, ops.upload_positions(np.arange(lo, lo + len(seg)))))
            r0 += len(seg)
        ends = np.cumsum([len(seg[0]) for seg in segments]) - 1
        logits, _ = self.model.forward(np.asarray(ids, dtype=np.int64), PromptSegments(rows, tuple(parts)), kv,
                                       logits_rows=[int(e) for e in ends], plan=self._plan(T))
        return logits

    def forward_rows(self, ids: list[int], lo: int, kv, hand=None):
        """A layer split's card before the last (its model has no head): the chunk's rows as the next
        card's hand_in takes them -> (normed [T, D], x [T, D]) on the device, in this pool. hand: a
        later card's input (backends.cuda.memory.HandOff), passed to the model in place of the ids."""
        return self._forward(ids, lo, kv, None, hand)

    def _forward(self, ids: list[int], lo: int, kv, rows, hand=None):
        self._check_context(lo, len(ids))
        positions = self.ops.upload_positions(np.arange(lo, lo + len(ids)))
        return self.model.forward(np.asarray(ids, dtype=np.int64) if hand is None else hand, positions, kv,
                                  logits_rows=rows, plan=self._plan(len(ids)))

    def _check_context(self, lo: int, n: int) -> None:
        if lo + n > self.max_context:
            raise InvalidArgument(f"positions up to {lo + n - 1} do not fit the context of {self.max_context}")

    def _plan(self, T: int):
        """The expert plan of a forward of T tokens: a decode step's, or the store's for a chunk."""
        if T <= STEP_MAX_TOKENS:
            return self.step_plan
        a = self.args
        return self.store.chunk_plan(T, memory_model.stream_all_tokens(a), a.num_hidden_layers)

    @contextlib.contextmanager
    def loan(self, tokens: int, chunk: int, pool: bool = True):
        """While a prompt of `tokens` (more than a decode step's) in chunks of `chunk` runs, the
        cache's tail slots are lent to the ring and (pool) the activation pool, and given back after
        it. logits_all keeps its own pool: every row's logits are more than the plan's loan holds."""
        from ..backends.cuda.memory import Pool
        ops, store = self.ops, self.store
        region = store.lend(self.loan_pool_bytes(tokens, chunk) if pool else 0) if tokens > STEP_MAX_TOKENS else None
        saved = ops.pool
        if region is not None and pool:
            pool = Pool(ops.rt, ops.device)
            pool.segments.append(region)
            pool.free.append([[0, region.nbytes]])
            pool.frozen = True
            ops.pool = pool
        try:
            yield
        finally:
            ops.pool = saved
            if store.lent:
                store.give_back()

    def loan_pool_bytes(self, tokens: int, chunk: int) -> int:
        """The pool a prompt of `tokens` tokens needs: bytes_needed of its largest chunk (`chunk`, or
        the prompt rounded up to a power of two, so few sizes are ever computed; bytes_needed is
        monotone), so a short prompt leaves more of the cache in place."""
        from .planner import bytes_needed
        if self.store.resident:
            return 0
        T = min(chunk, 1 << max(4, (tokens - 1).bit_length()))
        return bytes_needed(self._sizes, T, self._cells, self.ops.num_sms, self.kv_format)
