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


def check_parallel_windows(pack, rng, fmt, window) -> None:
    """--kv-resident with --parallel 3: each slot's newest cells in its own VRAM ring. Three sequences
    of different lengths, then batched steps of several subsets of the slots (rings wrapping): every
    row's logits bit for bit those of the same slots all in VRAM. Then garbage in the host copy of
    slot 1's window cells changes nothing (slot 1 reads its ring, not slot 0's or 2's), and garbage in
    slot 2's cells older than its window does (read over the bus)."""
    V = pack.args.vocab_size
    vram, host = kv_runner(pack, 96, fmt, 0, parallel=3), kv_runner(pack, 96, fmt, window, parallel=3)
    assert host.kv_all.vram_bytes == 3 * kv_runner(pack, 96, fmt, window).kv_all.vram_bytes
    assert host.status()["kv"]["cells_vram"] == 3 * window
    prompts = [rng.integers(0, V, n).tolist() for n in (30, 12, 45)]

    def step(slots):
        toks = rng.integers(0, V, len(slots)).tolist()
        rows = []
        for r in (vram, host):
            r.decode_batch(slots, toks)
            got = []
            for s in slots:
                r.use(s)
                got.append(r.ops.to_host(r._last))
            rows.append(got)
        return rows
    for r in (vram, host):
        for slot, ids in enumerate(prompts):
            r.use(slot)
            r.prefill(ids, 0, logits=False)
    for slots in ([0, 1, 2], [2, 0], [1], [0, 1, 2], [1, 2], [2, 1, 0]) * 3:
        for a, b in zip(*step(slots)):
            assert np.array_equal(a, b), slots
    assert host.graphs, host.graph_error
    for slot, older, same in ((1, False, True), (2, True, False)):
        seq = host.kv_all.view(slot)
        n = len(host.slot_ids(slot))
        lo = seq.vram_from(n + 1)
        cells = range(lo - 4, lo) if older else range(lo, n)
        for layer in range(seq.num_layers):
            for (plane, _), (addr, cell) in zip(seq.buffers, seq.cell_ranges(layer)):
                junk = rng.integers(0, 256, cell * len(cells), dtype=np.uint8)
                plane.copy_from_host(junk, host.stream, offset=addr - plane.ptr + cells[0] * cell)
        (want,), (got,) = step([slot])
        assert np.array_equal(got, want) == same, slot


SPEC_PROMPTS = ["The capital of France is", "Once upon a time, in a quiet village by the sea, there lived"]
WINDOW_NS = [0, 0, 3, 1, 0, 3, 2, 0, 2, 1, 3, 3, 2, 1, 0] * 3     # draft counts, plain steps (0) between


def greedy_with_changing_windows(spec, plain, prompt, n=40):
    """(tokens, plain greedy's) of a prompt decoded by verify windows of changing draft counts and
    plain steps between them (as --spec auto runs): a window that follows a larger rejected one
    appends fewer rows than that one left in the ring, so its reads meet the rejected rows' slots."""
    from strata.config import SamplingParams

    class Draws:
        def draw(self):
            return 0.5

    r, greedy = spec.runner, SamplingParams()
    ids = spec.tokenizer.encode(prompt)
    want = plain.generate(ids, max_tokens=n).token_ids
    r.reset()
    r.prefill(ids, 0, logits=False)
    got = [r.pick(greedy, 0.5)]
    for k in WINDOW_NS:
        if len(got) >= n:
            break
        r.spec = k
        got += r.speculate(got[-1], greedy, Draws(), n - len(got))
    return got[:n], want


def check_spec_over_the_window(fmt: str, resident: int) -> None:
    """--mtp --spec 3 over a `resident`-cell VRAM window of host K/V: plain greedy's tokens through
    generate() and through windows of changing draft counts, with drafts both rejected and accepted."""
    from strata.engine.llm import LLM
    plain = LLM(device="cuda", kv=fmt)
    spec = LLM(device="cuda", kv=fmt, mtp=True, spec=3, kv_resident=resident)
    assert spec.runner.kv.on_host and spec.runner.kv.vram_window == resident
    for prompt in SPEC_PROMPTS:
        assert spec.generate(prompt, max_tokens=40).token_ids == plain.generate(prompt, max_tokens=40).token_ids
        got, want = greedy_with_changing_windows(spec, plain, prompt)
        assert got == want, prompt
    st = spec.status()["speculation"]
    assert st["draft_n"] > st["draft_n_accepted"] > 0 and st["verify_passes"] > 0     # both outcomes met
