"""The gated delta rule over a prompt at Qwen3-Next-80B's DeltaNet shape (Hv 32, Hg 16, Dk = Dv 128):
the chunked kernels (cuda/gated_delta_chunk.cu, prep + scan) against the token loop
(cuda/gated_delta.cu strata_gdn_prompt_f32), per layer.

    python tools/gdn_chunk_bench.py [--json PATH] [--reps N] [--sweep] [--decode [--parent FATBIN]]

Times are CUDA-event medians of back-to-back launches after a warm-up (the state is advanced by each
launch; the decays keep it bounded). GFLOP counts each form's own multiply-adds (2 flops each): the
chunked form 2 C^2 Dk (Gram) + C^3 / 6 (the inverse) + 3 C Dk Dv + 2 C^2 Dv a chunk and head, the token
loop 3 Dk Dv a token and head. GB/s counts the compulsory bytes (q, k, v, g, beta, out, the state read
and written), the chunked form's scratch (written once, read once per 16 columns) on its own line.
Shares are of the H200's 67 TFLOP/s f32 (FFMA; the scan's 3xTF32 products count once, as f32 work) and
4.8 TB/s. --sweep adds short prompts,
to place linear_attn.GDN_CHUNK_MIN_T where the chunked form starts to win. Also checks the two forms
agree (max |difference| over max |out|).

--decode adds a decoded token's DeltaNet kernels of one layer (cuda/gated_delta.cu strata_gdn_step_f32
and strata_gdn_conv1d_step_f32, conv channels 2 Hg Dk + Hv Dv, kernel 4): their compulsory bytes (the
recurrent state read and written, the conv state and taps, the token's inputs and outputs) per
microsecond against the device copy rate (read + write) measured in the same run, and what the 36
DeltaNet layers of a token cost together. Each kernel is timed two ways: alone between two events
(which counts the host's launch latency, as an eager step pays it) and as one of GRAPH_LAUNCHES
launches captured in a CUDA graph (the device time a captured decode step pays; the figure the
GB/s are of). --parent FATBIN times that fatbin's strata_gdn_step_f32 the same way, launched as the
one-thread-a-column form before 2026-12-04 was (grid (ceil(Dv / 128), Hv), 128 threads), on the same
state: build it from that commit's cuda/gated_delta.cu with setup.py's NVCC_FLAGS.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from strata.backends.cuda.linear_attn import (GDN_CHUNK, GDN_CHUNK_SCRATCH, GDN_SCAN_COLS, gdn_chunk_launches,
                                              gdn_chunk_scratch_bytes, gdn_step_grid)
from strata.backends.cuda.testing import CudaOps, time_launches

HV, HG, DK, DV = 32, 16, 128, 128
LENGTHS, SWEEP = [512, 4096, 16384], [16, 32, 48, 64, 96, 128, 256]
PEAK_F32_TFLOPS, PEAK_GBPS = 67.0, 4800.0



def flops(T: int) -> tuple[float, float]:
    """(chunked, token loop) flops of one layer over T tokens."""
    C, nc = GDN_CHUNK, -(-T // GDN_CHUNK)
    chunked = 2 * nc * HV * (2 * C * C * DK + C ** 3 / 6 + 3 * C * DK * DV + 2 * C * C * DV)
    return chunked, 2.0 * T * HV * 3 * DK * DV


def compulsory_bytes(T: int) -> int:
    return 4 * (2 * T * HG * DK + 2 * T * HV * DV + 2 * T * HV + 2 * HV * DK * DV)


def bench(ops: CudaOps, rng, T: int, reps: int) -> dict:
    q, k = (ops._upload(a) for a in rng.standard_normal((2, T, HG, DK)).astype(np.float32))
    v = ops._upload(rng.standard_normal((T, HV, DV)).astype(np.float32))
    g = ops._upload(-rng.uniform(0.001, 0.06, (T, HV)).astype(np.float32))
    beta = ops._upload(rng.uniform(0.05, 1, (T, HV)).astype(np.float32))
    S0 = rng.standard_normal((HV, DK, DV)).astype(np.float32)
    states = {name: ops._upload(S0) for name in ("chunk", "token")}
    outs = {name: ops._output(T * HV * DV * 4) for name in ("chunk", "token")}
    scratch = ops._output(gdn_chunk_scratch_bytes(T, HV))
    launches = gdn_chunk_launches(q, k, v, g, beta, states["chunk"], outs["chunk"], scratch, T, HV, HG, DK, DV,
                                  HG * DK, HV * DV)
    token_args = (q, k, v, g, beta, states["token"], outs["token"], T, HV, HG, DK, DV, float(DK ** -0.5),
                  HG * DK, HV * DV)

    def chunked():
        for op, grid, args in launches:
            ops._launch(op, grid, args)

    chunk_ms = time_launches(ops, chunked, reps)
    token_ms = time_launches(ops, lambda: ops._launch("gdn_prompt", gdn_step_grid(DV, HV), token_args),
                             max(1, reps if T <= 4096 else 2))
    for name in states:                        # one more launch of each from the same state, to compare
        states[name].copy_from_host(S0, ops.stream)
    chunked()
    ops._launch("gdn_prompt", gdn_step_grid(DV, HV), token_args)
    got = {name: ops._download(outs[name], (T, HV, DV), np.float32) for name in outs}
    diff = float(np.abs(got["chunk"] - got["token"]).max() / np.abs(got["token"]).max())
    f_chunk, f_token = flops(T)
    nbytes = compulsory_bytes(T)
    scratch_bytes = gdn_chunk_scratch_bytes(T, HV) * (1 + -(-DV // GDN_SCAN_COLS))
    return {"T": T, "chunk_ms": chunk_ms, "token_ms": token_ms, "chunk_gflop": f_chunk / 1e9,
            "token_gflop": f_token / 1e9, "chunk_tflops": f_chunk / chunk_ms / 1e9,
            "token_tflops": f_token / token_ms / 1e9, "bytes": nbytes, "scratch_bytes": scratch_bytes,
            "chunk_gbps": nbytes / chunk_ms / 1e6, "token_gbps": nbytes / token_ms / 1e6, "max_rel_diff": diff}


CONV_K, DELTANET_LAYERS = 4, 36
GRAPH_LAUNCHES = 100        # launches of one kernel a timed graph holds


def time_in_graph(ops: CudaOps, launch, reps: int) -> float:
    """Median device milliseconds of one `launch()` among GRAPH_LAUNCHES captured back to back in a
    CUDA graph (no host latency between them, as in a captured decode step)."""
    from strata._ext import graphs
    graphs.begin_capture(ops.stream)
    for _ in range(GRAPH_LAUNCHES):
        launch()
    graph = graphs.end_capture(ops.stream)
    exe = graph.instantiate()
    try:
        return time_launches(ops, lambda: exe.launch(ops.stream), reps) / GRAPH_LAUNCHES
    finally:
        exe.destroy()
        graph.destroy()


def bench_decode(ops: CudaOps, rng, reps: int, parent: Path | None = None) -> dict:
    """One token's gdn_step and conv1d_step at this shape: device ms and compulsory GB/s."""
    from strata.backends.cuda.bandwidth import copy_rates
    C = 2 * HG * DK + HV * DV
    q, k = (ops._upload(a) for a in rng.standard_normal((2, HG, DK)).astype(np.float32))
    v = ops._upload(rng.standard_normal((HV, DV)).astype(np.float32))
    g = ops._upload(-rng.uniform(0.001, 0.06, HV).astype(np.float32))
    beta = ops._upload(rng.uniform(0.05, 1, HV).astype(np.float32))
    state, out = ops._upload(rng.standard_normal((HV, DK, DV)).astype(np.float32)), ops._output(HV * DV * 4)
    x = ops._upload(rng.standard_normal(C).astype(np.float32))
    conv_state = ops._upload(rng.standard_normal((CONV_K - 1, C)).astype(np.float32))
    taps = ops._upload(rng.standard_normal((C, CONV_K)).astype(np.float32))
    conv_out = ops._output(C * 4)
    step = lambda: ops._launch("gdn_step", gdn_step_grid(DV, HV), (q, k, v, g, beta, state, out, HV, HG, DK, DV,  # noqa: E731
                                                                   float(DK ** -0.5)))
    conv = lambda: ops._launch("gdn_conv1d_step", -(-C // 256), (x, conv_state, taps, conv_out, C, CONV_K))  # noqa: E731
    step_alone_ms, conv_alone_ms = time_launches(ops, step, reps), time_launches(ops, conv, reps)
    step_ms, conv_ms = time_in_graph(ops, step, reps), time_in_graph(ops, conv, reps)
    parent_ms = None
    if parent is not None:
        lib = ops._rt.Library("gated_delta_parent", parent.read_bytes())
        old = lib.kernel(ops.device, "strata_gdn_step_f32", "PPPPPPPiiiif")
        parent_ms = time_in_graph(ops, lambda: old.launch((-(-DV // 128), HV), 128, (q, k, v, g, beta, state, out, HV,
                                                                                   HG, DK, DV, float(DK ** -0.5)),
                                                          0, stream=ops.stream), reps)
    step_bytes = 4 * (2 * HV * DK * DV + 2 * HG * DK + 2 * HV * DV + 2 * HV)
    conv_bytes = 4 * (2 * (CONV_K - 1) * C + C * CONV_K + 2 * C)
    _, copy = copy_rates(ops._rt, ops.device, ops.stream, 256 << 20)
    return {"step_ms": step_ms, "parent_step_ms": parent_ms, "step_alone_ms": step_alone_ms, "conv_alone_ms": conv_alone_ms,
            "step_bytes": step_bytes, "step_gbps": step_bytes / step_ms / 1e6,
            "conv_ms": conv_ms, "conv_bytes": conv_bytes, "conv_gbps": conv_bytes / conv_ms / 1e6,
            "copy_gbps": copy, "token_ms": DELTANET_LAYERS * (step_ms + conv_ms)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--reps", type=int, default=10, help="timed launches per form and length")
    parser.add_argument("--sweep", action="store_true", help=f"also the short prompts {SWEEP}")
    parser.add_argument("--decode", action="store_true", help="also one decoded token's DeltaNet kernels")
    parser.add_argument("--parent", type=Path, help="with --decode: an earlier gated_delta fatbin's gdn_step, for the A/B")
    args = parser.parse_args()
    rng = np.random.default_rng()
    ops = CudaOps()
    rows = [bench(ops, rng, T, args.reps) for T in (SWEEP if args.sweep else []) + LENGTHS]
    print(f"Hv {HV}, Hg {HG}, Dk {DK}, Dv {DV}, chunks of {GDN_CHUNK}, scratch {GDN_CHUNK_SCRATCH * 4} B a chunk "
          f"and head; {ops.device.name}; shares of {PEAK_F32_TFLOPS:.0f} TFLOP/s f32 and {PEAK_GBPS:.0f} GB/s")
    print(f"{'T':>6} {'chunk ms':>9} {'TFLOP/s':>8} {'share':>6} {'GB/s':>7} {'token ms':>9} {'TFLOP/s':>8} "
          f"{'share':>6} {'GB/s':>7} {'speedup':>8} {'scratch MB':>10} {'rel diff':>9}")
    for r in rows:
        print(f"{r['T']:>6} {r['chunk_ms']:>9.3f} {r['chunk_tflops']:>8.2f} "
              f"{r['chunk_tflops'] / PEAK_F32_TFLOPS:>6.1%} {r['chunk_gbps']:>7.0f} {r['token_ms']:>9.3f} "
              f"{r['token_tflops']:>8.2f} {r['token_tflops'] / PEAK_F32_TFLOPS:>6.1%} {r['token_gbps']:>7.0f} "
              f"{r['token_ms'] / r['chunk_ms']:>7.1f}x {r['scratch_bytes'] / 1e6:>10.1f} {r['max_rel_diff']:>9.2e}")
    dec = bench_decode(ops, rng, max(args.reps, 50), args.parent) if args.decode else None
    if dec:
        print(f"decode step, one layer, alone between events (host launch latency in): gdn_step "
              f"{dec['step_alone_ms'] * 1e3:.1f} us, conv1d_step {dec['conv_alone_ms'] * 1e3:.1f} us")
        print(f"decode step, one layer, in a graph of {GRAPH_LAUNCHES}: gdn_step {dec['step_ms'] * 1e3:.1f} us for {dec['step_bytes'] / 1e6:.2f} MB "
              f"({dec['step_gbps']:.0f} GB/s, {dec['step_gbps'] / dec['copy_gbps']:.1%} of the {dec['copy_gbps']:.0f} "
              f"GB/s device copy measured now); conv1d_step {dec['conv_ms'] * 1e3:.1f} us for "
              f"{dec['conv_bytes'] / 1e6:.2f} MB ({dec['conv_gbps']:.0f} GB/s, {dec['conv_gbps'] / dec['copy_gbps']:.1%}); "
              f"{DELTANET_LAYERS} layers: {dec['token_ms']:.3f} ms a token")
        if dec["parent_step_ms"] is not None:
            pg = dec["step_bytes"] / dec["parent_step_ms"] / 1e6
            print(f"parent's gdn_step in a graph of {GRAPH_LAUNCHES}: {dec['parent_step_ms'] * 1e3:.1f} us ({pg:.0f} GB/s, "
                  f"{pg / dec['copy_gbps']:.1%}); this one {dec['parent_step_ms'] / dec['step_ms']:.2f}x as fast")
    if args.json:
        args.json.write_text(json.dumps({"shape": {"Hv": HV, "Hg": HG, "Dk": DK, "Dv": DV}, "lengths": rows,
                                         "decode": dec}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
