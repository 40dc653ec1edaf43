"""DeviceOps for Qwen3-Next (qwen3next): the ops strata.model.qwen3next calls beyond qwen3moe's, over
device tensors, and the per-sequence cache they read and advance (DeviceHybridCache).

Each op computes what strata.backends.cpu_linear_attn.Qwen3NextCpuOps' op of the same name does:

- gated attention: attn_q's per-head query and gate halves split by two strided row copies
  (gather_rows); the sigmoid output gate (cuda/gated_delta.cu strata_sigmoid_mul_f32); QK-norm and
  partial RoPE unfused (rms_norm, then cuda/rope.cu strata_rope_partial_f32 over the first
  rotary_dim dims) where rotary_dim < head_dim, else qwen3moe's fused launch. The zero-centred
  norms arrive stored as 1 + w, so the plain rms_norm applies.
- Gated DeltaNet: conv1d + SiLU over [q k v] with the layer's conv state (strata_gdn_conv1d_step_f32
  for one token, strata_gdn_conv1d_f32 for a chunk); the decay g and beta from ssm_ba
  (strata_gdn_gates_f32); the gated delta rule with L2-normed q, k in the kernel (strata_gdn_step_f32
  for one token; over a prompt chunk, cuda/gated_delta_chunk.cu's chunked WY / UT form where
  linear_attn.gdn_chunked_takes says so, else strata_gdn_prompt_f32 token by token); the gated RMSNorm
  as rms_norm then swiglu(z, normed) (= normed * silu(z)).
- the shared expert: gate and up projections, swiglu, down, times sigmoid(x . ffn_gate_inp_shexp)
  per row (strata_sigmoid_mul_f32 with gate_step 0).

The states live in one device buffer of fixed address (DeviceHybridCache.states), so decode steps
that read and write them can be CUDA graphs. A step of 2..8 rows (a verify window, a prompt's short
tail) runs the DeltaNet one row at a time through the one-token kernels, so each row is bit for bit
the one-row step's, and, where the cache keeps a window's rows (speculation), each layer's states
after row t are copied into the cache's row t, from which a rollback makes the last accepted row's
live (DeviceHybridCache.keep_rows / window_begin / roll_back). A batched step of distinct
sequences (--parallel slots) gets the cache as HybridRows instead: its DeltaNet layers run every row
in one launch of the row kernels (strata_gdn_conv1d_rows_f32, strata_gdn_step_rows_f32), each row
over its own slot's states wherever they are.
"""
from __future__ import annotations

import numpy as np

from ...errors import InvalidArgument, UnsupportedError
from .. import rope
from .linear_attn import (GDN_MAX_DK, GDN_MAX_K, gdn_chunk_launches, gdn_chunk_scratch_bytes, gdn_chunked_takes,
                          gdn_step_grid)
from .memory import DeviceKV, DeviceTensor
from .ops_attention import DECODE_ROWS_MAX
from .ops import DeviceOps


class DeviceHybridCache:
    """One sequence's caches for qwen3next in VRAM: K/V of the full-attention layers only (a DeviceKV
    of those layers, in order; layer() and planes() take the model's layer index) and each DeltaNet
    layer's conv state [K-1, C] and recurrent state [Hv, Dk, Dv], f32, in one zeroed buffer.

    The recurrent state cannot be rewound like K/V cells, so, as the CPU's HybridCache does, it is
    checkpointed: snapshot(n) copies every layer's state after n tokens to host memory (the runner
    takes one at the end of each prompt, keeping the newest max_snapshots), resumable(n, live) says
    how much of a common prefix of n tokens can be resumed (all of it from the live state, else the
    longest snapshot within it, else 0), and rewind() copies a snapshot back (or zeroes the states).
    Everything else (max_cells, fmt, quantized, codecs, buffers, cell_ranges, ...) is the attention
    layers' DeviceKV's.

    num_slots > 1 (--parallel): the attention layers' K/V has a slot's cells each (view(s), as
    DeviceKV's), and the states buffer is the slot in use's: the decode graphs read it at its one
    address. Each slot also has a home buffer; swap(old, new) parks the states of the slot leaving
    and brings the next one's in (two device copies of the states' bytes). A view shares the buffers
    and keeps its own snapshots."""

    def __init__(self, rt, device, stream, args, num_layers: int, max_cells: int, fmt: str = "f16",
                 max_snapshots: int = 4, num_slots: int = 1):
        self.args, self.stream, self.max_snapshots, self.rt, self.dev = args, stream, max_snapshots, rt, device
        attn = [l for l in range(num_layers) if args.is_full_attention(l)]
        self.index = {l: i for i, l in enumerate(attn)}
        self.kv = DeviceKV(rt, device, stream, max(1, len(attn)), max_cells, args.num_key_value_heads,
                           args.head_dim, fmt, num_slots=num_slots)
        Hg, Hv = args.linear_num_key_heads, args.linear_num_value_heads
        Dk, Dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.channels = 2 * Hg * Dk + Hv * Dv
        self.conv_floats = (args.linear_conv_kernel_dim - 1) * self.channels
        self.ssm_floats = Hv * Dk * Dv
        self.linear_layers = [l for l in range(args.num_hidden_layers) if not args.is_full_attention(l)]
        per = self.conv_floats + self.ssm_floats
        self._offsets = {l: i * per * 4 for i, l in enumerate(self.linear_layers)}
        self.states = rt.DeviceBuffer(device, max(4, len(self.linear_layers) * per * 4))
        self.states.fill_bytes(0, stream)
        self.snapshots: list[tuple[int, np.ndarray]] = []
        self.whole, self.base, self.num_slots = self, 0, num_slots
        self.rows, self.num_rows, self.window_start = None, 0, None      # keep_rows
        self.homes = []
        if num_slots > 1:
            self.homes = [rt.DeviceBuffer(device, self.states.nbytes) for _ in range(num_slots)]
            for home in self.homes:
                home.fill_bytes(0, stream)

    def __getattr__(self, name):            # the attention layers' DeviceKV for the rest
        if name == "kv":
            raise AttributeError(name)
        return getattr(self.kv, name)

    # K/V of the attention layers, by the model's layer index
    def _kv_layer(self, layer: int) -> int:
        if layer not in self.index:
            raise InvalidArgument(f"layer {layer} is a DeltaNet layer: it has no K/V cells")
        return self.index[layer]

    def layer(self, layer: int):
        return self.kv.layer(self._kv_layer(layer))

    def planes(self, layer: int):
        return self.kv.planes(self._kv_layer(layer))

    def view(self, slot: int):
        """Slot `slot`'s cache: its K/V cells, the states buffer (valid while the slot is in use) and
        snapshots of its own (slot 0 of a one-slot cache is the cache)."""
        if self.num_slots == 1 and slot == 0:
            return self
        kv = self.kv.view(slot)                       # InvalidArgument out of range
        v = object.__new__(DeviceHybridCache)
        v.__dict__.update(self.__dict__)
        v.kv, v.base, v.whole, v.snapshots = kv, kv.base, self, []
        return v

    def slot_states_ptr(self, slot: int, in_use: int) -> int:
        """Where slot `slot`'s states are now, `in_use` being the slot in use: the states buffer for
        that one, its home for any other (what swap() keeps true)."""
        if slot == in_use or not self.homes:
            return self.states.ptr
        return self.homes[slot].ptr

    def rows_view(self, row_states: int) -> "HybridRows":
        """This cache for a batched step of distinct slots' rows, each row's states at the device
        address that row_states[row] (uint64 [rows] in device memory) holds (HybridRows)."""
        return HybridRows(self.whole, row_states)

    def swap(self, old: int, new: int) -> None:
        """Slot `old` leaves, slot `new` comes in: the states buffer's bytes to old's home, new's home
        into the buffer (queued on the stream, in order with the steps)."""
        if old == new or not self.homes:
            return
        n = self.states.nbytes
        self.rt.copy_d2d(self.homes[old].ptr, self.states.ptr, n, self.stream)
        self.rt.copy_d2d(self.states.ptr, self.homes[new].ptr, n, self.stream)

    # a verify window's rows (speculation): the states before it and after each of its rows
    def keep_rows(self, num_rows: int) -> None:
        """Keep the states of verify windows of up to num_rows rows: a buffer [1 + num_rows, states
        bytes] whose row 0 holds the states before the window and row 1 + t those after its row t
        (the ops copy each DeltaNet layer's states there as a step of several rows reads them)."""
        whole = self.whole          # one buffer for every slot's view (a window runs in one slot at a time)
        whole.num_rows = num_rows
        whole.rows = self.rt.DeviceBuffer(self.dev, (1 + num_rows) * self.states.nbytes)

    def row_state_ptrs(self, layer: int, row: int):
        """(conv, recurrent) destinations of this layer's states after the window's row `row`, or
        None where no window keeps that row."""
        if self.whole.rows is None or row >= self.whole.num_rows:
            return None
        at = self.whole.rows.ptr + (1 + row) * self.states.nbytes + self._offsets[layer]
        return at, at + self.conv_floats * 4

    def window_begin(self, start: int) -> None:
        """A verify window reads tokens from position `start`: its row 0 holds the states now."""
        self.rt.copy_d2d(self.whole.rows.ptr, self.states.ptr, self.states.nbytes, self.stream)
        self.window_start = start

    def roll_back(self, length: int) -> None:
        """Make live the states after `length` tokens, kept by the last verify window (queued on the
        stream: the next step reads them in order)."""
        row = length - (self.window_start if self.window_start is not None else length + 1)
        if not 0 <= row <= self.whole.num_rows:
            raise KeyError(f"no DeltaNet states after {length} tokens in the verify window")
        n = self.states.nbytes
        self.rt.copy_d2d(self.states.ptr, self.whole.rows.ptr + row * n, n, self.stream)

    @property
    def nbytes(self) -> int:
        rows = self.whole.rows.nbytes if self.whole.rows is not None else 0
        return self.kv.whole.nbytes + self.states.nbytes * (1 + len(self.homes)) + rows

    @property
    def vram_bytes(self) -> int:
        return self.nbytes

    # the DeltaNet states
    def conv_ptr(self, layer: int) -> int:
        return self.states.ptr + self._offsets[layer]

    def ssm_ptr(self, layer: int) -> int:
        return self.states.ptr + self._offsets[layer] + self.conv_floats * 4

    def state_bytes(self) -> int:
        return self.states.nbytes

    def reset_states(self) -> None:
        self.states.fill_bytes(0, self.stream)

    def read_states(self) -> np.ndarray:
        """Every layer's states, copied to host memory (the stream synchronized)."""
        host = np.empty(self.states.nbytes, np.uint8)
        self.states.copy_to_host(host, self.stream)
        self.stream.synchronize()
        return host

    def write_states(self, host: np.ndarray) -> None:
        self.states.copy_from_host(host, self.stream)
        self.stream.synchronize()         # the host array may go once this returns

    def snapshot(self, length: int) -> None:
        self.snapshots = [s for s in self.snapshots if s[0] != length][-(self.max_snapshots - 1):]
        self.snapshots.append((length, self.read_states()))

    def resumable(self, common: int, live: int) -> int:
        if common >= live:
            return live
        return max([n for n, _ in self.snapshots if n <= common], default=0)

    def rewind(self, length: int, live: int) -> None:
        """Make the states those after `length` tokens (the live ones, a snapshot's, or zeros at 0).
        The sequence is read anew from there, so snapshots past it go: they hold another sequence's
        states, which a later turn sharing that many tokens with the new one would resume from."""
        self.snapshots = [s for s in self.snapshots if s[0] <= length]
        if length == live:
            return
        if length == 0:
            self.reset_states()
            return
        for n, host in self.snapshots:
            if n == length:
                self.write_states(host)
                return
        raise KeyError(f"no DeltaNet state snapshot after {length} tokens (have {[s[0] for s in self.snapshots]})")


class HybridRows:
    """The whole DeviceHybridCache for a decode step whose rows are distinct sequences (--parallel
    slots), each row's DeltaNet states wherever they are: row r's layer l states at the device
    address row_states[r] (a uint64 in device memory, staged with the step's other inputs) plus the
    layer's offset. The ops launch the row kernels (cuda/gated_delta.cu strata_gdn_conv1d_rows_f32,
    strata_gdn_step_rows_f32: all rows in one launch, each row the one-row kernel's arithmetic), so a
    CUDA graph captured once serves every later step of that row count, whatever slots are in it
    and wherever their states are. The attention layers' K/V are the cache's, through the step's
    StepRows. One object per runner: a decode graph is valid for the cache object it captured."""

    def __init__(self, cache: DeviceHybridCache, row_states: int):
        self.cache, self.row_states = cache, row_states

    def __getattr__(self, name):            # the cache's for the rest (K/V layers, slots, offsets)
        if name == "cache":
            raise AttributeError(name)
        return getattr(self.cache, name)

    def conv_offset(self, layer: int) -> int:
        """Byte offset of the layer's conv state from a row's states address."""
        return self.cache._offsets[layer]

    def ssm_offset(self, layer: int) -> int:
        """Byte offset of the layer's recurrent state from a row's states address."""
        return self.cache._offsets[layer] + self.cache.conv_floats * 4


class Qwen3NextDeviceOps(DeviceOps):
    """DeviceOps plus the ops of strata.model.qwen3next (module doc)."""

    def __init__(self, rt, device, stream, weights, args, paths=None):
        super().__init__(rt, device, stream, weights, args, *(() if paths is None else (paths,)))
        a = args
        if a.linear_key_head_dim > GDN_MAX_DK or not 1 <= a.linear_conv_kernel_dim <= GDN_MAX_K:
            raise UnsupportedError(f"qwen3next on the GPU: cuda/gated_delta.cu takes key head dims <= {GDN_MAX_DK} "
                                   f"and conv kernels <= {GDN_MAX_K}; this model has {a.linear_key_head_dim} and "
                                   f"{a.linear_conv_kernel_dim}")
        if a.linear_num_value_heads % a.linear_num_key_heads:
            raise UnsupportedError("qwen3next on the GPU: value heads must be a multiple of key heads")
        self.rot = a.rotary_dim
        if self.rot < a.head_dim:
            inv, _ = rope.inv_freq(self.rot, a.rope_theta, a.rope_scaling, a.max_position_embeddings)
            self.rot_inv_freq = self.upload(inv.astype(np.float32))

    # ---- gated attention ---------------------------------------------------------------------
    def rope(self, x: DeviceTensor, positions) -> DeviceTensor:
        T, heads, dh = x.shape
        if self.rot >= dh:
            return super().rope(x, positions)
        out = self.copy(x)
        self.launch("rope_partial", max(T, 1), (out.ptr, self._positions(positions).ptr, self.rot_inv_freq.ptr, T,
                                                heads, dh, self.rot, float(self.rope_scale)))
        return out

    def qk_norm_rope_attention(self, q, k, v, q_norm: str, k_norm: str, eps: float, layer: int, kv, positions):
        if self.rot >= q.shape[-1]:
            return super().qk_norm_rope_attention(q, k, v, q_norm, k_norm, eps, layer, kv, positions)
        q = self.rope(self.rms_norm(q, q_norm, eps), positions)
        k = self.rope(self.rms_norm(k, k_norm, eps), positions)
        return self.attention(q, k, v, layer, kv, positions)

    def qk_norm_rope_append(self, q, k, v, q_norm: str, k_norm: str, eps: float, layer: int, kv, positions) -> None:
        """The K/V cells qk_norm_rope_attention writes (the draft layer's prompt cells); with partial
        RoPE the whole unfused op, its output unread, so the cells are the full path's bit for bit."""
        if self.rot >= q.shape[-1]:
            return super().qk_norm_rope_append(q, k, v, q_norm, k_norm, eps, layer, kv, positions)
        self.qk_norm_rope_attention(q, k, v, q_norm, k_norm, eps, layer, kv, positions)

    def attn_q_gate(self, x: DeviceTensor, prefix: str):
        """attn_q holds each head's query rows then its gate rows -> (q [T, H, Dh], gate [T, H*Dh])."""
        a = self.args
        T, H, Dh = x.shape[0], a.num_attention_heads, a.head_dim
        qg = self.linear(x, prefix + "attn_q.weight")                    # [T, H * 2Dh]
        q, gate = self.alloc((T, H, Dh)), self.alloc((T, H * Dh))
        self._copy_rows(qg.ptr, 0, q.ptr, T * H, Dh, 2 * Dh, Dh)
        self._copy_rows(qg.ptr + Dh * 4, 0, gate.ptr, T * H, Dh, 2 * Dh, Dh)
        return q, gate

    def _sigmoid_mul(self, x: DeviceTensor, gate_ptr: int, gate_ld: int, gate_step: int) -> DeviceTensor:
        rows, n = x.shape[0], x.size // max(1, x.shape[0])
        out = self.alloc(x.shape)
        self.launch("sigmoid_mul", (-(-n // 256), max(1, min(rows, 65535))),
                    (x.ptr, gate_ptr, out.ptr, rows, n, gate_ld, gate_step))
        return out

    def sigmoid_gate(self, x: DeviceTensor, gate: DeviceTensor) -> DeviceTensor:
        if x.shape != gate.shape:
            raise InvalidArgument(f"sigmoid_gate: shapes {x.shape} and {gate.shape} differ")
        return self._sigmoid_mul(x, gate.ptr, x.shape[-1], 1)

    # ---- Gated DeltaNet ----------------------------------------------------------------------
    def split(self, x: DeviceTensor, sizes) -> list:
        """Columns of x [T, sum(sizes)] in consecutive groups, each a contiguous [T, size] copy."""
        T, C = x.shape
        if sum(sizes) != C:
            raise InvalidArgument(f"split: {x.shape} into columns {sizes}")
        out, col = [], 0
        for n in sizes:
            part = self.alloc((T, n))
            self._copy_rows(x.ptr + col * 4, 0, part.ptr, T, n, C, n)
            out.append(part)
            col += n
        return out

    def conv1d_silu(self, x: DeviceTensor, name: str, layer: int, cache) -> DeviceTensor:
        T, C = x.shape
        K = self.args.linear_conv_kernel_dim
        w = self._f32_weight(name)
        out = self.alloc((T, C))
        if isinstance(cache, HybridRows):     # distinct sequences' rows, each with its own states
            self.launch("gdn_conv1d_rows", (-(-C // 256), T),
                        (x.ptr, cache.row_states, cache.conv_offset(layer), w, out.ptr, C, K))
            return out
        state = cache.conv_ptr(layer)
        if T <= DECODE_ROWS_MAX:        # a step's rows one at a time, each as a one-row step
            for t in range(T):
                self.launch("gdn_conv1d_step", -(-C // 256), (x.ptr + t * C * 4, state, w, out.ptr + t * C * 4, C, K))
                self._keep_row(cache, layer, t, 0, state, (K - 1) * C)
        else:
            self.launch("gdn_conv1d", -(-C // 256), (x.ptr, state, w, out.ptr, T, C, K, C))
        return out

    def gdn_gates(self, ba: DeviceTensor, prefix: str):
        a = self.args
        Hg, Hv = a.linear_num_key_heads, a.linear_num_value_heads
        T = ba.shape[0]
        g, beta = self.alloc((T, Hv)), self.alloc((T, Hv))
        self.launch("gdn_gates", max(1, -(-T * Hv // 256)),
                    (ba.ptr, self._f32_weight(prefix + "ssm_a"), self._f32_weight(prefix + "ssm_dt.bias"),
                     g.ptr, beta.ptr, T, Hg, Hv // Hg))
        return g, beta

    def gated_delta_rule(self, q, k, v, g, beta, layer: int, cache) -> DeviceTensor:
        """q, k [T, Hg, Dk] (raw), v [T, Hv, Dv] -> o [T, Hv, Dv]; the layer's state advances in VRAM."""
        T, Hg, Dk = q.shape
        Hv, Dv = v.shape[1:]
        out = self.alloc((T, Hv, Dv))
        grid = gdn_step_grid(Dv, Hv)
        if isinstance(cache, HybridRows):     # distinct sequences' rows, each with its own states
            self.launch("gdn_step_rows", (*grid, T), (q.ptr, k.ptr, v.ptr, g.ptr, beta.ptr, cache.row_states,
                                                      cache.ssm_offset(layer), out.ptr, Hv, Hg, Dk, Dv,
                                                      float(Dk ** -0.5)))
            return out
        args = (q.ptr, k.ptr, v.ptr, g.ptr, beta.ptr, cache.ssm_ptr(layer), out.ptr)
        if T <= DECODE_ROWS_MAX:        # a step's rows one at a time, each as a one-row step
            qk, vo = Hg * Dk * 4, Hv * Dv * 4
            for t in range(T):
                self.launch("gdn_step", grid, (q.ptr + t * qk, k.ptr + t * qk, v.ptr + t * vo, g.ptr + t * Hv * 4,
                                               beta.ptr + t * Hv * 4, cache.ssm_ptr(layer), out.ptr + t * vo,
                                               Hv, Hg, Dk, Dv, float(Dk ** -0.5)))
                self._keep_row(cache, layer, t, 1, cache.ssm_ptr(layer), Hv * Dk * Dv)
        elif gdn_chunked_takes(T, Dk):
            scratch = self.alloc((gdn_chunk_scratch_bytes(T, Hv) // 4,))
            for op, chunk_grid, chunk_args in gdn_chunk_launches(*args, scratch.ptr, T, Hv, Hg, Dk, Dv, Hg * Dk,
                                                                 Hv * Dv):
                self.launch(op, chunk_grid, chunk_args)
        else:
            self.launch("gdn_prompt", grid, (*args, T, Hv, Hg, Dk, Dv, float(Dk ** -0.5), Hg * Dk, Hv * Dv))
        return out

    def _keep_row(self, cache, layer: int, row: int, which: int, src: int, floats: int) -> None:
        """A state (which: 0 conv, 1 recurrent) of this layer after a step's row `row`, copied into
        the cache's verify-window row where it keeps one."""
        dst = cache.row_state_ptrs(layer, row) if hasattr(cache, "row_state_ptrs") else None
        if dst is not None:
            self.rt.copy_d2d(dst[which], src, floats * 4, self.stream)

    def _swiglu(self, gate: DeviceTensor, up: DeviceTensor) -> DeviceTensor:
        """silu(gate) * up over [rows, n] (cuda/swiglu.cu)."""
        rows, n = gate.shape[0], gate.size // max(1, gate.shape[0])
        out = self.alloc(gate.shape)
        self.launch("swiglu", (-(-n // 256), max(1, min(rows, 65535))), (gate.ptr, up.ptr, out.ptr, rows, n, n, n, n))
        return out

    def gated_rms_norm(self, x: DeviceTensor, z: DeviceTensor, name: str, eps: float) -> DeviceTensor:
        """rms_norm(x) * w * silu(z), per head [T, Hv, Dv]."""
        return self._swiglu(z, self.rms_norm(x, name, eps))

    def shared_expert(self, x: DeviceTensor, prefix: str) -> DeviceTensor:
        """sigmoid(x . gate_inp_shexp) * down(silu(gate(x)) * up(x))."""
        h = self._swiglu(self.linear(x, prefix + "ffn_gate_shexp.weight"), self.linear(x, prefix + "ffn_up_shexp.weight"))
        y = self.linear(h, prefix + "ffn_down_shexp.weight")
        s = self.linear(x, prefix + "ffn_gate_inp_shexp.weight")           # [T, 1]
        return self._sigmoid_mul(y, s.ptr, 1, 0)
