"""strata_moe_group (cuda/moe_group.cu): a prompt chunk's slots grouped by expert on the device.

Exact: the tables must equal a stable numpy sort (strata.backends.cuda.moe.group_by_expert) and the
tile layout the kernel's header states, for routings as the router gives them (A distinct experts a
token) and for arbitrary ids (repeats, experts never used, one expert taking everything)."""
import numpy as np
import pytest

from strata.backends.cuda.moe import GROUP_SIGNATURE, group_by_expert

pytestmark = pytest.mark.gpu
BM = 128


@pytest.fixture(scope="module")
def gpu():
    from strata.backends.cuda import _runtime

    rt = _runtime()
    dev = rt.Device(0)
    stream = rt.Stream(dev)
    return rt, dev, stream, rt.load_library("moe_group").kernel(dev, "strata_moe_group", GROUP_SIGNATURE)


def run(gpu, ids: np.ndarray, E: int, extra_tiles: int = 0, timed: bool = False):
    rt, dev, stream, kernel = gpu
    S, A = ids.size, ids.shape[1]
    n = E + S // BM + extra_tiles
    d_ids, out, tiles = rt.DeviceBuffer(dev, 4 * S), rt.DeviceBuffer(dev, 4 * (2 * S + E + 1)), rt.DeviceBuffer(dev, 16 * n)
    d_ids.copy_from_host(np.ascontiguousarray(ids, np.int32), stream)
    out.fill_bytes(0xAB, stream)
    tiles.fill_bytes(0xAB, stream)           # every tile must be written, the unused ones as zeros
    args = (d_ids, S, A, E, out, out.ptr + 4 * S, out.ptr + 8 * S, tiles, n, BM)
    kernel.launch(E + 1, 256, args, stream=stream)
    ms = None
    if timed:
        start, end = rt.Event(dev, timing=True), rt.Event(dev, timing=True)
        start.record(stream)
        for _ in range(20):
            kernel.launch(E + 1, 256, args, stream=stream)
        end.record(stream)
        end.synchronize()
        ms = start.elapsed_ms(end) / 20
    host, host_tiles = np.empty(2 * S + E + 1, np.int32), np.empty((n, 4), np.int32)
    out.copy_to_host(host, stream)
    tiles.copy_to_host(host_tiles, stream)
    stream.synchronize()
    return host[:S], host[S:2 * S], host[2 * S:], host_tiles, ms


def check(gpu, ids, E, extra_tiles=0):
    tokens, rows, bounds, tiles, _ = run(gpu, ids, E, extra_tiles)
    order, experts, starts, counts, want_rows = group_by_expert(ids)
    A = ids.shape[1]
    np.testing.assert_array_equal(tokens, order // A)
    np.testing.assert_array_equal(rows, want_rows)
    per_expert = np.bincount(ids.reshape(-1), minlength=E)
    np.testing.assert_array_equal(bounds, np.r_[0, np.cumsum(per_expert)])
    want = np.zeros_like(tiles)
    for e, s0, c in zip(experts.tolist(), starts.tolist(), counts.tolist()):
        for j in range(-(-c // BM)):
            want[e + s0 // BM + j] = (e, s0 + j * BM, min(BM, c - j * BM), 0)
    np.testing.assert_array_equal(tiles, want)
    covered = sorted((s0, m) for _, s0, m, _ in tiles.tolist() if m)
    assert sum(m for _, m in covered) == ids.size       # every sorted row in exactly one tile


@pytest.mark.parametrize("T,A,E", [(1, 1, 1), (1, 8, 128), (3, 2, 5), (17, 8, 128), (130, 4, 16),
                                   (257, 8, 128), (1000, 10, 512), (4096, 8, 128)])
def test_routing_like_ids(gpu, rng, T, A, E):
    ids = np.stack([rng.choice(E, A, replace=False) for _ in range(T)]).astype(np.int32)
    check(gpu, ids, E)


@pytest.mark.parametrize("case", ["one expert", "skewed", "uniform repeats"])
def test_arbitrary_ids(gpu, rng, case):
    T, A, E = 777, 6, 64
    if case == "one expert":
        ids = np.full((T, A), 37, np.int32)
    elif case == "skewed":
        ids = np.minimum(rng.geometric(0.3, (T, A)) - 1, E - 1).astype(np.int32)
    else:
        ids = rng.integers(0, E, (T, A)).astype(np.int32)
    check(gpu, ids, E, extra_tiles=int(rng.integers(0, 300)))


def test_timing(gpu, rng):
    """Time of one grouping at Qwen3-30B-A3B's routing (A 8 of E 128), chunks of 4096 and 16384."""
    for T in (4096, 16384):
        ids = np.argsort(rng.random((T, 128)), axis=1)[:, :8].astype(np.int32)
        ms = run(gpu, ids, 128, timed=True)[4]
        print(f"moe_group T={T} A=8 E=128: {ms * 1e3:.1f} us")
        assert ms < 2.0
