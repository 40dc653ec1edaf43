"""The GPU runner's decode steps: a step's token ids, positions and KV length staged in one fixed
device buffer (one small host->device copy per step), the model run eagerly or as a CUDA graph
(strata.engine.graphs: the first step of a shape eager, measuring its memory; the second captured;
every later one a replay), and, when experts stream, the step's routing written to a fixed log
that comes back with the logits for the cache's admissions (ExpertStore.after_step).

Every step carries the same expert plan (ExpertStore.step_plan: the table, the routing log, staged
misses where decode runs staged), so a captured graph serves every later step. The exception is
--cpu-experts' decode split (strata.engine.expert_split.split_decode; forced by a share, or taken by
auto when priced faster, repriced every PRICE_EVERY steps): a one-token step of one sequence then
runs eagerly with a plan whose host share (DecodeStepSplit) reads each layer's routing on the host
and computes some of its misses there (strata.backends.cuda.moe.moe_decode_split). Steps of several
rows (speculation windows, batched slots) and staged decode never split.
"""
from __future__ import annotations

import sys
import time
from collections import deque
from contextlib import contextmanager

import numpy as np

from ..backends.cuda.memory import DeviceTensor, StepRows
from ..errors import DeviceError, InvalidArgument
from .memory_model import STEP_MAX_TOKENS

STEP_TIMES_KEPT = 4096              # decode steps whose host times status() summarizes
PRICE_EVERY = 32                    # decode steps between two pricings of the decode split (auto)
# byte offset in DecodeSteps.step_in of the rows' state addresses [STEP_MAX_TOKENS] uint64 (a hybrid's
# batched step of distinct slots): past the int32 inputs of the largest step, so at one address
# whatever the row count (a view of the cache that names it serves every step's graph)
ROW_STATES_AT = -(-4 * (5 * STEP_MAX_TOKENS + 1) // 16) * 16


def stage_rows(host: np.ndarray, pos: int, length: int, cell: int, base: int, positions: np.ndarray, bases,
               ring: int = 0) -> None:
    """StepRows' host form at these int32 offsets of host: positions [T] then max + 1, each row's
    attention length (position + 1), its cell (base + position; base + position % ring in a K/V
    ring of that many cells) and its sequence's first cell (bases: one per row, or one for all)."""
    T = len(positions)
    host[pos:pos + T] = positions
    host[pos + T] = positions.max() + 1
    host[length:length + T] = positions + 1
    host[cell:cell + T] = bases + (positions % ring if ring else positions)
    host[base:base + T] = bases


def row_lengths(positions) -> tuple[int, int]:
    """(shortest, longest) of the lengths (position + 1) of rows at these positions: which f16 decode
    attention kernels they take (DecodeSteps.rows_of, ops.decode_rule)."""
    p = np.asarray(positions, np.int64).reshape(-1)
    return int(p.min()) + 1, int(p.max()) + 1


def last_row_of(logits: DeviceTensor) -> DeviceTensor:
    """The last row [1, V] of device logits [T, V], a view that keeps their memory alive."""
    T, V = logits.shape
    return DeviceTensor(logits.buf, logits.offset + (T - 1) * V * 4, (1, V), np.float32, logits)


class DecodeSteps:
    """Decode steps of one runner's model on its ops and expert store (module doc)."""

    def __init__(self, ops, model, store, weights, args, use_graphs: bool, graph_error: str | None):
        from ..backends.cuda.ops import GEMV_MAX_T
        rt, dev = ops.rt, ops.device
        self.ops, self.model, self.store, self.weights, self.args = ops, model, store, weights, args
        self.stream = ops.stream
        num_layers = args.num_hidden_layers + args.num_mtp_layers
        self.route_log = None
        if not store.resident:
            # one row per main layer: a decode step runs those (an MTP layer only under speculation,
            # which reads no row here; the rows past them would be whatever the memory held)
            self.route_log = rt.DeviceBuffer(dev, num_layers * GEMV_MAX_T * args.num_experts_per_tok * 4)
            self.route_log.fill_bytes(0, self.stream)
            self._route_host = np.frombuffer(rt.HostBuffer(dev, self.route_log.nbytes), np.int32).reshape(
                num_layers, GEMV_MAX_T * args.num_experts_per_tok)
        # recorded after each routing log's copy to the host: that copy writes the pinned buffer when
        # it runs, so the host reads it, or lets the next step's copy overwrite it, only after (_route_copy)
        self._routed = rt.Event(dev)
        self.plan = store.step_plan(0 if self.route_log is None else self.route_log.ptr)
        # [ids T | positions T | max + 1 | lengths T | cells T | bases T] int32 on the device, staged
        # in pinned memory (memory.StepRows); at ROW_STATES_AT, a step of distinct sequences' rows
        # with states of their own has each row's state address (uint64, row_states)
        self.step_in = rt.DeviceBuffer(dev, ROW_STATES_AT + 8 * STEP_MAX_TOKENS)
        self._step_host = np.frombuffer(rt.HostBuffer(dev, self.step_in.nbytes), np.int32)
        # recorded after each staging copy: the copy engine reads the pinned bytes when the copy runs,
        # so the next step's inputs may go there only once it has (stage_inputs)
        self._staged = rt.Event(dev)
        self._logits_host = np.frombuffer(rt.HostBuffer(dev, 4 * STEP_MAX_TOKENS * args.vocab_size), np.float32)
        self._route_pending = 0      # tokens of a step whose routing log is on its way to the host
        self._step_timing = None     # (mode, start, submit seconds) of a step whose pick() is to come
        self.use_graphs = use_graphs
        self.graph_error = graph_error     # why graphs are off in this runner
        self.graphs: dict = {}             # T -> DecodeGraph
        self.step_bytes: dict[int, int] = {}   # T -> pool bytes the eager step allocated (a graph's reserve)
        self.step_times = {m: deque(maxlen=STEP_TIMES_KEPT) for m in ("eager", "capture", "graph", "split")}
        self.hidden = None                 # the last step's hidden states [T, D] on the device
        # --cpu-experts: the plan of a split decode step (None: decode never splits), its pricing
        host = store.host_experts
        self.split_plan = None
        if host is not None and not store.staged_decode:
            from dataclasses import replace

            from .experts.host_compute import DecodeStepSplit
            self.split_plan = replace(self.plan, host=DecodeStepSplit(host))
        self._priced_at = None             # (step count, decode hits, decode misses) of the last pricing
        self._steps = 0                    # one-sequence one-token steps so far
        self._split_keys = np.zeros(0, np.int64)     # (layer, expert) keys the host took in the last step
        self._route_keys = self._split_keys          # ... of the step whose routing is on its way

    def step(self, ids: list[int], lo: int, kv, download: bool = True, ids_from: int | None = None):
        """Logits of ids at positions lo.. of kv's sequence (T <= STEP_MAX_TOKENS; kv a slot's view
        of the runner's cache, or the cache): step_rows of one sequence. ids_from: the device address
        the step's T int32 ids are copied from instead (a pick's output, queued before: ids is then
        T placeholders)."""
        T = len(ids)
        out, logits = self.step_rows(ids, list(range(lo, lo + T)), [kv.base] * T, kv.whole, download,
                                     ids_from=ids_from)
        return out, last_row_of(logits)

    @property
    def row_states_ptr(self) -> int:
        """Device address of the rows' state addresses [T] uint64 a step_rows(row_states=...) stages
        (the same for every step: what a hybrid cache's rows view reads, DeviceHybridCache.rows_view)."""
        return self.step_in.ptr + ROW_STATES_AT

    def step_rows(self, ids: list[int], positions: list[int], bases: list[int], kv, download: bool = True,
                  row_states: list[int] | None = None, ids_from: int | None = None):
        """Logits of ids [T] (T <= STEP_MAX_TOKENS), row t at positions[t] of the sequence whose
        cell 0 is cache cell bases[t] of kv (the whole cache: rows of one sequence, or of several
        parallel slots): a graph replay where one is captured for T, else the model's launches from
        Python (capturing them on the second step). -> (logits [T, V] on the host, or None without
        `download`; the logits [T, V] on the device).

        row_states: rows of distinct sequences with recurrent states of their own (a hybrid's parallel
        slots): row t's states at device address row_states[t], staged at row_states_ptr for kv, the
        cache's view that reads them there (DeviceHybridCache.rows_view). Its graphs are "rows{T}", apart
        from the one-sequence steps' (whose launches read one sequence's states at a fixed address)."""
        T = len(ids)
        t0 = time.perf_counter()
        split = T == 1 and row_states is None and self._splits()
        if ids_from is not None and split:
            raise InvalidArgument("a step whose ids stay on the device cannot split with the host (--cpu-experts)")
        ids_dev, pos_dev = self.stage_inputs(ids, positions, bases, kv.num_slots, row_states, ids_from)
        key = T if row_states is None else f"rows{T}"
        lengths = row_lengths(positions)
        if split:       # eager, never captured: each layer reads its routing on the host
            with self.rows_of(lengths):
                logits, self.hidden = self.model.forward(ids_dev, pos_dev, kv, plan=self.split_plan)
            self._split_keys, mode = self.split_plan.host.end_step(), "split"
        else:
            logits, self.hidden, mode = self.launch(
                key, lambda: self.model.forward(ids_dev, pos_dev, kv, plan=self.plan), kv,
                (self.step_in, self.route_log, self.weights), lengths=lengths)
        t1 = time.perf_counter()
        if download:
            out = self.download(logits)
            self.step_times[mode].append((t1 - t0, time.perf_counter() - t0))
        else:                   # the step's host time ends when pick() has the token
            out = None
            self._route_copy(T)
            self._step_timing = (mode, t0, t1 - t0)
        return out, logits

    def _splits(self) -> bool:
        """Whether this one-token step splits its misses with the host (--cpu-experts; module doc):
        never without a split plan, always under a forced share, else (auto) as the last pricing
        said, repriced every PRICE_EVERY steps from the decode hit rate measured since the last
        (the cache's cached share before any) and the eager step's host time measured so far
        (expert_split.EAGER_LAYER_S a layer before any)."""
        if self.split_plan is None:
            return False
        self._steps += 1
        host, st = self.split_plan.host.host, self.store.stats
        last = self._priced_at
        if last is None or self._steps - last[0] >= PRICE_EVERY:
            from .expert_split import EAGER_LAYER_S
            hits, misses = st.decode_hits - (last[1] if last else 0), st.decode_misses - (last[2] if last else 0)
            miss_rate = misses / (hits + misses) if hits + misses else 1.0 - self.store.cached / self.store.total
            eager = self.step_times["eager"]
            eager_s = (float(np.median([t[0] for t in eager])) if eager
                       else EAGER_LAYER_S * self.args.num_hidden_layers)
            host.price_decode(miss_rate * self.args.num_experts_per_tok, self.args.num_hidden_layers, eager_s)
            self._priced_at = (self._steps, st.decode_hits, st.decode_misses)
        return host.decode.taken

    def stage_inputs(self, ids: list[int], positions: list[int], bases: list[int], num_slots: int = 1,
                     row_states: list[int] | None = None, ids_from: int | None = None):
        """One host->device copy of [ids | positions | max + 1 | lengths | cells | bases] into
        step_in; -> (ids [T], StepRows [T + 1]). Row t attends to cells 0..positions[t] of its
        sequence, whose cell 0 is bases[t], and appends its K/V at cell bases[t] + positions[t].
        row_states [T] (device addresses): go with them, in the same copy, to row_states_ptr.
        ids_from: a device address whose T int32 then overwrite the ids (a device-to-device copy
        queued after the staging one)."""
        T = len(ids)
        if not 1 <= T <= STEP_MAX_TOKENS:
            raise InvalidArgument(f"a decode step takes 1 to {STEP_MAX_TOKENS} tokens, got {T}")
        # The last step's copy may still be queued behind work the device has not reached (steps
        # queued without a pick in between: a hybrid's slots in turn, decode(logits=False) in a
        # row): rewriting the pinned buffer before it runs would send this step's inputs to that
        # one. Usually long done (a pick synchronized the stream); else the host waits for it.
        self._staged.synchronize()
        host = self._step_host[:5 * T + 1]
        host[:T] = ids
        stage_rows(host, T, 2 * T + 1, 3 * T + 1, 4 * T + 1, np.asarray(positions, np.int64),
                   np.asarray(bases, np.int64))
        if row_states is not None:          # (the padding before them goes along: one copy)
            if len(row_states) != T:
                raise InvalidArgument(f"a step of {T} rows takes {T} state addresses, got {len(row_states)}")
            at = ROW_STATES_AT // 4
            self._step_host[at:at + 2 * T].view(np.uint64)[:] = row_states
            host = self._step_host[:at + 2 * T]
        self.step_in.copy_from_host(host, self.stream)
        if ids_from is not None:
            self.ops.rt.copy_d2d(self.step_in.ptr, ids_from, 4 * T, self.stream)
        self._staged.record(self.stream)
        self.ops.bytes_h2d += host.nbytes
        buf, p = self.step_in, self.step_in.ptr
        return (DeviceTensor(buf, 0, (T,), np.int32, buf),
                StepRows(buf, 4 * T, T, buf, p + 4 * (2 * T + 1), p + 4 * (3 * T + 1), p + 4 * (4 * T + 1), num_slots))

    def launch(self, key, launches, kv, owned: tuple, pool_for=None, lengths: tuple[int, int] | None = None):
        """launches() -> (logits, hidden) as the graph of `key` (a step's row count, or a speculation
        window's name): eager the first time (measuring the pool it takes), captured the second,
        replayed after (graphs off: eager always). owned: the buffers the launches read, kept with
        the graph; pool_for(bytes): a frozen pool to capture into instead of one of the graph's own
        (None: its own); lengths: (shortest, longest) of the rows' lengths, which name the f16 decode
        attention kernels they take (ops.decode_rule: a key's suffix, graphs apart). -> (logits,
        hidden, "eager" | "capture" | "graph")."""
        key = self.graph_key(key, lengths)
        with self.rows_of(lengths):
            graph = self._graph(key, launches, kv, owned, pool_for)
            if graph is None:
                before = self.ops.pool.allocated_bytes
                logits, hidden = launches()
                self.step_bytes[key] = self.ops.pool.allocated_bytes - before
                return logits, hidden, "eager"
        mode = "graph" if graph.launches else "capture"
        graph.launch(self.stream)
        if mode == "graph":             # a capture counted its step while the launches ran
            self.ops.expert_uses += graph.expert_uses
        return graph.logits, graph.hidden, mode

    def graph_key(self, key, lengths: tuple[int, int] | None):
        """The key launch() files `key`'s graph under for rows of these lengths: with the f16 decode
        kernels' rule as a suffix ("1+tc"), or `key` as it is (an int where a row count) where the rule
        is "" or the lengths are not known."""
        rule = self.ops.decode_rule(*lengths) if lengths is not None else ""
        return f"{key}{rule}" if rule else key

    def captured(self, key) -> bool:
        """Whether a graph of `key` is captured, for any of the f16 decode kernels' rules."""
        return any(k == key or str(k).startswith(f"{key}+") for k in self.graphs)

    @contextmanager
    def rows_of(self, lengths: tuple[int, int] | None):
        """ops.decode_lengths = lengths (None: not known, both f16 decode kernels launch) while the
        step's launches are made."""
        before, self.ops.decode_lengths = self.ops.decode_lengths, lengths
        try:
            yield
        finally:
            self.ops.decode_lengths = before

    def _graph(self, key, launches, kv, owned: tuple, pool_for):
        """The graph to replay for `key`: captured now on its second run; None for an eager run
        (graphs off, first run, or a failed capture)."""
        if not self.use_graphs:
            return None
        graph = self.graphs.get(key)
        if graph is not None and not graph.valid_for(kv):
            self.drop_graphs()
            graph = None
        if graph is None and key in self.step_bytes:
            from ..backends.cuda import _graphs
            from .graphs import capture
            reserve = self.step_bytes[key]
            try:
                graph = self.graphs[key] = capture(_graphs(), self.ops, launches, reserve, owned, kv, key,
                                                   pool_for(reserve) if pool_for else None)
            except (DeviceError, ImportError) as exc:
                self._graphs_off(f"{type(exc).__name__}: {exc}")
        return graph

    def _graphs_off(self, why: str) -> None:
        self.use_graphs, self.graph_error = False, why
        sys.stderr.write(f"strata: CUDA graph capture failed ({why}); decoding without graphs\n")

    def drop_graphs(self) -> None:
        """Forget every captured decode graph (the next steps run eagerly, then capture again)."""
        self.stream.synchronize()   # no replay may still read the memory the graphs hold
        for graph in self.graphs.values():
            graph.destroy()
        self.graphs.clear()

    def download(self, logits) -> np.ndarray:
        """logits [T, V] through the pinned buffer, after the stream is done with them; with experts
        streaming, the step's routing comes along for the cache."""
        host = self._logits_host[:logits.size]
        logits.buf.copy_to_host(host, self.stream, logits.offset)
        self._route_copy(logits.shape[0])
        self.stream.synchronize()
        self._after_route()
        return host.reshape(logits.shape).copy()

    def _route_copy(self, T: int) -> None:
        """Queue the step's routing log to the host (experts streaming); _after_route() reads it
        once the stream has been synchronized."""
        if self.route_log is not None:
            if self._route_pending:
                # A step queued before with no pick since (decode(logits=False) in a row, a hybrid's
                # slots in turn): its routing, not read yet, goes to the cache before this step's
                # copy lands on it. The host waits for that step (this one is queued behind it); with
                # a pick after every step nothing is pending here.
                self._routed.synchronize()
                self._after_route()
            self.route_log.copy_to_host(self._route_host, self.stream)
            self._routed.record(self.stream)
            self._route_pending = T
            self._route_keys, self._split_keys = self._split_keys, np.zeros(0, np.int64)

    def _after_route(self) -> None:
        if self._route_pending:
            self.store.after_step(self._route_host[:self.args.num_hidden_layers,
                                                   :self._route_pending * self.args.num_experts_per_tok],
                                  self._route_keys)
            self._route_pending = 0

    def picked(self) -> None:
        """pick() has its token (the stream is synchronized): the step's host time ends, and its
        routing, queued with it, goes to the cache."""
        self.end_timing(self.take_timing())
        self._after_route()

    def take_timing(self):
        """The timing of the step whose pick is to come, handed over (None: none): a step queued before
        that pick has the token (CudaRunner.pick's step) must not take its place."""
        timing, self._step_timing = self._step_timing, None
        return timing

    def end_timing(self, timing) -> None:
        """take_timing()'s step has its token now (picked()'s bookkeeping of a step without routing)."""
        if timing is not None:
            mode, t0, submit = timing
            self.step_times[mode].append((submit, time.perf_counter() - t0))

    def forget_pending(self) -> None:
        """No step's timing or routing is on its way any more (warm_up restores the store)."""
        self._route_pending, self._step_timing = 0, None

    def status(self) -> dict:
        """Graphs on or off (and why), the graphs held, and host time per decode step by mode:
        submit = staging copy + launches queued; step = until the logits (or, for a step that
        keeps them on the device, pick()'s token) are on the host."""
        times = {}
        for mode, steps in self.step_times.items():
            if steps:
                a = np.asarray(steps) * 1e3
                times[mode] = {"steps": len(a), "host_submit_ms": float(np.median(a[:, 0])),
                               "host_step_ms": float(np.median(a[:, 1]))}
        host = None if self.split_plan is None else self.split_plan.host.host
        return {"cuda_graphs": self.use_graphs, "graph_error": self.graph_error,
                # --cpu-experts on decode steps: whether they split and the pricing that said so
                "cpu_experts_split": None if host is None else
                {"mode": "auto" if host.share is None else host.share, "steps": host.stats.decode_steps,
                 "experts": host.stats.decode_experts,
                 "pricing": None if host.decode is None else host.decode.to_dict()},
                "graphs": {T: {"nodes": g.num_nodes, "capture_ms": g.capture_ms, "pool_bytes": g.keep[0].capacity_bytes}
                           for T, g in self.graphs.items()},
                "host_ms": times}
