"""numpy-in/out wrappers of cuda/gated_delta.cu (Qwen3-Next's DeltaNet decode step) over a CudaOps:
what the kernel tests call. The state arrays are uploaded, updated in VRAM by the kernel, and
returned; the engine will keep them on the device."""
from __future__ import annotations

import numpy as np

from ...errors import InvalidArgument

GDN_MAX_DK = 256            # cuda/gated_delta.cu keeps q and k of a key head in shared memory
GDN_MAX_K = 8               # and a prompt conv's window in registers
GDN_STEP_COLS = 32          # state columns a gdn_step / gdn_prompt block owns (one a lane, 8 warps of rows)
GDN_CHUNK = 64              # cuda/gated_delta_chunk.cu: tokens per chunk
GDN_CHUNK_MAX_DK = 128      # its scan keeps a [Dk, 16] state tile in shared memory
GDN_CHUNK_SCRATCH = 8448    # its scratch floats per (chunk, value head): M, P, row scales
GDN_SCAN_COLS = 16          # state columns per scan block
# prompts shorter than this run the token loop: on the H200 at 80B's DeltaNet shape the chunked
# kernels took 0.089 ms at T 16 against the loop's 0.113 (0.0066 ms a token), 4.6x at 64, 14.7x at
# 16,384 (tools/gdn_chunk_bench.py --sweep, ninth session)
GDN_CHUNK_MIN_T = 16


def gdn_step_grid(Dv: int, Hv: int) -> tuple[int, int]:
    """strata_gdn_step_f32's and strata_gdn_prompt_f32's grid: 32 columns of one value head a block."""
    return -(-Dv // GDN_STEP_COLS), Hv


def gdn_chunked_takes(T: int, Dk: int) -> bool:
    """Whether a prompt of T tokens runs the chunked kernels, else the token loop (strata_gdn_prompt_f32):
    the one place that says which."""
    return T >= GDN_CHUNK_MIN_T and Dk <= GDN_CHUNK_MAX_DK


def gdn_chunk_scratch_bytes(T: int, Hv: int) -> int:
    return 4 * -(-T // GDN_CHUNK) * Hv * GDN_CHUNK_SCRATCH


def gdn_chunk_launches(q, k, v, g, beta, state, out, scratch, T, Hv, Hg, Dk, Dv, qk_ld, v_ld) -> list:
    """The chunked delta rule's two launches, (table op, grid, args), over device pointers with
    gdn_prompt's meaning; scratch holds gdn_chunk_scratch_bytes(T, Hv)."""
    return [("gdn_chunk_prep", (-(-T // GDN_CHUNK), Hv),
             (q, k, g, beta, scratch, T, Hv, Hg, Dk, float(Dk ** -0.5), qk_ld)),
            ("gdn_chunk_scan", (-(-Dv // GDN_SCAN_COLS), Hv),
             (q, k, v, scratch, state, out, T, Hv, Hg, Dk, Dv, qk_ld, v_ld))]


def _f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def gdn_conv1d_step(ops, x: np.ndarray, state: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One token's causal depthwise conv1d + SiLU: x [C], state [K-1, C], w [C, K] -> (out [C], new state)."""
    x, state, w = _f32(x), _f32(state), _f32(w)
    if x.ndim != 1 or w.ndim != 2 or w.shape[0] != x.shape[0] or state.shape != (w.shape[1] - 1, x.shape[0]):
        raise InvalidArgument(f"gdn_conv1d_step: x {x.shape}, state {state.shape}, w {w.shape} are not "
                              f"[C], [K-1, C], [C, K]")
    C, K = w.shape
    if C == 0:
        return x.copy(), state.copy()
    s_dev, out = ops._upload(state), ops._output(C * 4)
    x_dev, w_dev = ops._upload(x), ops._upload(w)       # named: the buffers must outlive the launch
    ops._launch("gdn_conv1d_step", -(-C // 256), (x_dev, s_dev, w_dev, out, C, K))
    return ops._download(out, (C,), np.float32), ops._download(s_dev, state.shape, np.float32)


def gdn_conv1d(ops, x: np.ndarray, state: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A prompt's causal depthwise conv1d + SiLU: x [T, C], state [K-1, C], w [C, K] -> (out [T, C], new state)."""
    x, state, w = _f32(x), _f32(state), _f32(w)
    if x.ndim != 2 or w.ndim != 2 or w.shape[0] != x.shape[1] or state.shape != (w.shape[1] - 1, x.shape[1]) \
            or not 1 <= w.shape[1] <= GDN_MAX_K:
        raise InvalidArgument(f"gdn_conv1d: x {x.shape}, state {state.shape}, w {w.shape} are not [T, C], "
                              f"[K-1, C], [C, K] with K <= {GDN_MAX_K}")
    (T, C), K = x.shape, w.shape[1]
    if T == 0 or C == 0:
        return np.empty((T, C), np.float32), state.copy()
    s_dev, out = ops._upload(state), ops._output(T * C * 4)
    x_dev, w_dev = ops._upload(x), ops._upload(w)
    ops._launch("gdn_conv1d", -(-C // 256), (x_dev, s_dev, w_dev, out, T, C, K, C))
    return ops._download(out, (T, C), np.float32), ops._download(s_dev, state.shape, np.float32)


def gdn_step(ops, q, k, v, g, beta, state) -> tuple[np.ndarray, np.ndarray]:
    """One token's gated delta rule: q, k [Hg, Dk] (raw), v [Hv, Dv], g, beta [Hv], state [Hv, Dk, Dv]
    -> (out [Hv, Dv], new state); q and k are L2-normalized in the kernel, q scaled by 1/sqrt(Dk)."""
    q, k, v, g, beta, state = (_f32(a) for a in (q, k, v, g, beta, state))
    Hg, Dk = q.shape
    Hv, Dv = v.shape
    if (k.shape != q.shape or g.shape != (Hv,) or beta.shape != (Hv,) or state.shape != (Hv, Dk, Dv)
            or not 0 < Dk <= GDN_MAX_DK or Hv % Hg):
        raise InvalidArgument(f"gdn_step: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}, "
                              f"state {state.shape} are not [Hg, Dk], [Hv, Dv], [Hv], [Hv, Dk, Dv] with "
                              f"Hv a multiple of Hg and Dk <= {GDN_MAX_DK}")
    s_dev, out = ops._upload(state), ops._output(Hv * Dv * 4)
    ins = [ops._upload(a) for a in (q, k, v, g, beta)]
    ops._launch("gdn_step", gdn_step_grid(Dv, Hv), (*ins, s_dev, out, Hv, Hg, Dk, Dv, float(Dk ** -0.5)))
    return ops._download(out, (Hv, Dv), np.float32), ops._download(s_dev, state.shape, np.float32)


def _rows_states(ops, states: np.ndarray, off: int):
    """Rows' states [R, ...] uploaded as the row kernels find them: each after `off` bytes of its own
    block of one buffer, the blocks in reverse row order (so an address taken by row index, not from
    row_states, reads another row's). -> (buffer, row_states [R] uint64 on the device, read back)."""
    R, n = states.shape[0], states[0].nbytes
    block = off + n
    host = np.zeros(R * block, np.uint8)
    for r in range(R):
        at = (R - 1 - r) * block + off
        host[at:at + n] = states[r].reshape(-1).view(np.uint8)
    buf = ops._upload(host)
    addrs = ops._upload(np.array([buf.ptr + (R - 1 - r) * block for r in range(R)], np.uint64))

    def read_back() -> np.ndarray:
        got = ops._download(buf, (R * block,), np.uint8)
        return np.stack([got[(R - 1 - r) * block + off:(R - 1 - r) * block + off + n].view(np.float32)
                         .reshape(states.shape[1:]) for r in range(R)])
    return buf, addrs, read_back


def gdn_conv1d_rows(ops, x, states, w, off: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """One token of each of R sequences (strata_gdn_conv1d_rows_f32): x [R, C], states [R, K-1, C]
    (each at its own address, `off` bytes into its block), w [C, K] -> (out [R, C], new states)."""
    x, states, w = _f32(x), _f32(states), _f32(w)
    R, C = x.shape
    if w.ndim != 2 or w.shape[0] != C or states.shape != (R, w.shape[1] - 1, C) or R < 1 or off % 16:
        raise InvalidArgument(f"gdn_conv1d_rows: x {x.shape}, states {states.shape}, w {w.shape} are not "
                              f"[R, C], [R, K-1, C], [C, K] (off {off} a multiple of 16)")
    K = w.shape[1]
    buf, addrs, read_back = _rows_states(ops, states, off)
    x_dev, w_dev, out = ops._upload(x), ops._upload(w), ops._output(R * C * 4)
    ops._launch("gdn_conv1d_rows", (-(-C // 256), R), (x_dev, addrs, off, w_dev, out, C, K))
    return ops._download(out, (R, C), np.float32), read_back()


def gdn_step_rows(ops, q, k, v, g, beta, states, off: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """One token's gated delta rule for each of R sequences (strata_gdn_step_rows_f32): q, k [R, Hg, Dk],
    v [R, Hv, Dv], g, beta [R, Hv], states [R, Hv, Dk, Dv] (each at its own address) -> (out [R, Hv, Dv],
    new states)."""
    q, k, v, g, beta, states = (_f32(a) for a in (q, k, v, g, beta, states))
    R, Hg, Dk = q.shape
    Hv, Dv = v.shape[1:]
    if (k.shape != q.shape or v.shape[0] != R or g.shape != (R, Hv) or beta.shape != (R, Hv)
            or states.shape != (R, Hv, Dk, Dv) or not 0 < Dk <= GDN_MAX_DK or Hv % Hg or off % 16):
        raise InvalidArgument(f"gdn_step_rows: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}, "
                              f"states {states.shape} are not [R, Hg, Dk], [R, Hv, Dv], [R, Hv], [R, Hv, Dk, Dv] "
                              f"with Hv a multiple of Hg and Dk <= {GDN_MAX_DK}")
    buf, addrs, read_back = _rows_states(ops, states, off)
    ins, out = [ops._upload(a) for a in (q, k, v, g, beta)], ops._output(R * Hv * Dv * 4)
    ops._launch("gdn_step_rows", (*gdn_step_grid(Dv, Hv), R),
                (*ins, addrs, off, out, Hv, Hg, Dk, Dv, float(Dk ** -0.5)))
    return ops._download(out, (R, Hv, Dv), np.float32), read_back()


def _prompt_args(name: str, max_dk: int, q, k, v, g, beta, state) -> list[np.ndarray]:
    q, k, v, g, beta, state = (_f32(a) for a in (q, k, v, g, beta, state))
    T, Hg, Dk = q.shape
    Hv, Dv = v.shape[1:]
    if (k.shape != q.shape or v.shape[0] != T or g.shape != (T, Hv) or beta.shape != (T, Hv)
            or state.shape != (Hv, Dk, Dv) or not 0 < Dk <= max_dk or Hv % Hg):
        raise InvalidArgument(f"{name}: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}, "
                              f"state {state.shape} are not [T, Hg, Dk], [T, Hv, Dv], [T, Hv], [Hv, Dk, Dv] with "
                              f"Hv a multiple of Hg and Dk <= {max_dk}")
    return [q, k, v, g, beta, state]


def gdn_prompt(ops, q, k, v, g, beta, state) -> tuple[np.ndarray, np.ndarray]:
    """A prompt's gated delta rule in one launch: q, k [T, Hg, Dk], v [T, Hv, Dv], g, beta [T, Hv],
    state [Hv, Dk, Dv] -> (out [T, Hv, Dv], new state)."""
    def launches(ins, s_dev, out, T, Hv, Hg, Dk, Dv):
        return [("gdn_prompt", gdn_step_grid(Dv, Hv),
                 (*ins, s_dev, out, T, Hv, Hg, Dk, Dv, float(Dk ** -0.5), Hg * Dk, Hv * Dv))]
    return _prompt_run(ops, "gdn_prompt", GDN_MAX_DK, launches, q, k, v, g, beta, state)


def gdn_prompt_chunked(ops, q, k, v, g, beta, state) -> tuple[np.ndarray, np.ndarray]:
    """gdn_prompt's contract over cuda/gated_delta_chunk.cu (the chunked WY / UT form), at any T >= 1."""
    def launches(ins, s_dev, out, T, Hv, Hg, Dk, Dv):
        scratch = ops._output(gdn_chunk_scratch_bytes(T, Hv))      # held by the launches' args
        return gdn_chunk_launches(*ins, s_dev, out, scratch, T, Hv, Hg, Dk, Dv, Hg * Dk, Hv * Dv)
    return _prompt_run(ops, "gdn_prompt_chunked", GDN_CHUNK_MAX_DK, launches, q, k, v, g, beta, state)


def _prompt_run(ops, name: str, max_dk: int, launches, q, k, v, g, beta, state) -> tuple[np.ndarray, np.ndarray]:
    """Both prompt forms' wrapper: the arrays checked and uploaded, launches(ins, state, out, T, Hv,
    Hg, Dk, Dv)'s (op, grid, args) run, the output and the new state downloaded."""
    q, k, v, g, beta, state = _prompt_args(name, max_dk, q, k, v, g, beta, state)
    T, Hg, Dk = q.shape
    Hv, Dv = v.shape[1:]
    if T == 0:
        return np.empty((0, Hv, Dv), np.float32), state.copy()
    s_dev, out = ops._upload(state), ops._output(T * Hv * Dv * 4)
    ins = [ops._upload(a) for a in (q, k, v, g, beta)]
    steps = launches(ins, s_dev, out, T, Hv, Hg, Dk, Dv)     # kept until the downloads: its buffers
    for op, grid, args in steps:
        ops._launch(op, grid, args)
    return ops._download(out, (T, Hv, Dv), np.float32), ops._download(s_dev, state.shape, np.float32)
