"""Checks of --kv-resident shared by the emulated runtime's tests (test_kv_resident_host.py) and the
device's (test_kv_resident_gpu.py)."""
import numpy as np

from strata.config import EngineConfig
from strata.engine.cuda_runner import CudaRunner


def kv_runner(pack, max_context, fmt, resident=0, **kw):
    return CudaRunner(pack, max_context, EngineConfig(device="cuda", kv=fmt, kv_resident=resident, **kw))


def assert_same_cells(a, b) -> None:
    """Every plane of KV a's and b's cells bit for bit (the host copy against the VRAM one)."""
    for (x, _), (y, _) in zip(a.kv.buffers, b.kv.buffers):
        got, want = np.empty(x.nbytes, np.uint8), np.empty(y.nbytes, np.uint8)
        x.copy_to_host(got, a.stream)
        y.copy_to_host(want, b.stream)
        assert np.array_equal(got, want)


def check_windows_equal_all_resident(pack, rng, fmt, max_context, chunk, prompt_len, steps, windows) -> None:
    """A prompt of prompt_len random ids in chunks of `chunk`, then `steps` decode steps, with the newest
    `window` cells in VRAM for each window: every logit and cell bit for bit the runner's with all its
    cells in VRAM, and decode captured as graphs."""
    V = pack.args.vocab_size
    ids, toks = rng.integers(0, V, prompt_len).tolist(), rng.integers(0, V, steps).tolist()
    vram = kv_runner(pack, max_context, fmt)
    vram.prefill_chunk = chunk
    want = [vram.prefill(ids, 0)] + [vram.decode(t) for t in toks]
    for window in windows:
        host = kv_runner(pack, max_context, fmt, window)
        host.prefill_chunk = chunk
        assert host.kv.vram_window == window and host.plan.kv_cells == window
        assert host.status()["kv"]["cells_vram"] == window
        got = [host.prefill(ids, 0)] + [host.decode(t) for t in toks]
        for i, (g, w) in enumerate(zip(got, want)):
            assert np.array_equal(g, w), (window, i)
        assert_same_cells(host, vram)
        assert host.graphs, host.graph_error
