"""tools/pdl_chain_bench.py on the CPU: a numpy stand-in for the runtime runs each kernel of
tools/variants/pdl_stage.cu from its contract (the header's), so the bench's own work is checked before a
device call spends minutes on it: every arm's chain is laid out as the plain chain is (the persistent
arms' phase tables included: a wrong source, destination, count or segment gives another final
output), the segmented GEMV's reference, the arms a chain skips, and the barrier's error flag."""
import numpy as np
import pytest

import strata._ext
import strata.backends.cuda.bandwidth as bandwidth
from tests.fixtures import load_tool


class Memory:
    """Device memory: buffers by base address (every pointer the bench passes is a buffer's base)."""

    def __init__(self):
        self.blocks, self.next = {}, 1 << 20

    def alloc(self, nbytes: int) -> int:
        ptr, self.next = self.next, self.next + (nbytes + 8191) // 4096 * 4096
        self.blocks[ptr] = np.zeros(nbytes, np.uint8)
        return ptr

    def f32(self, ptr) -> np.ndarray:
        return self.blocks[getattr(ptr, "ptr", ptr)].view(np.float32)

    def u8(self, ptr) -> np.ndarray:
        return self.blocks[getattr(ptr, "ptr", ptr)]


def q8_rows(w: np.ndarray, n: int) -> np.ndarray:
    """Q8_0 rows [rows, n / 32 * 34] -> float64 [rows, n]."""
    b = w.reshape(w.shape[0], n // 32, 34)
    d = b[:, :, :2].copy().view(np.float16).astype(np.float64)
    return (b[:, :, 2:].view(np.int8).astype(np.float64) * d).reshape(w.shape[0], n)


class FakeRuntime:
    """The parts of strata._ext.runtime and .graphs the bench uses; launches run at once, or into the
    capturing stream's list."""

    def __init__(self, persist_fault: str = ""):
        self.mem, self.persist_fault, self.launched = Memory(), persist_fault, []
        rt = self

        class Device:
            multiprocessor_count = 4

            def __init__(self, ordinal):
                pass

        class Stream:
            def __init__(self, dev):
                self.capture = None

            def run(self, fn):
                fn() if self.capture is None else self.capture.append(fn)

            def synchronize(self):
                assert self.capture is None

        class DeviceBuffer:
            def __init__(self, dev, nbytes):
                self.ptr = rt.mem.alloc(nbytes)

            def copy_from_host(self, a, st):
                raw = np.ascontiguousarray(a).view(np.uint8).ravel()
                st.run(lambda: rt.mem.u8(self.ptr).__setitem__(slice(0, raw.size), raw))

            def copy_to_host(self, a, st):
                flat = a.view(np.uint8).reshape(-1)
                st.run(lambda: flat.__setitem__(slice(None), rt.mem.u8(self.ptr)[:flat.size]))

        class Kernel:
            def __init__(self, name):
                self.name = name

            def prefer_shared(self, pct):
                pass

            def launch(self, grid, block, args, shared=0, stream=None, pdl=False):
                rt.launched.append(self.name)
                stream.run(lambda: rt.emulate(self.name, grid, args))

        class Library:
            def __init__(self, name, image):
                pass

            def kernel(self, dev, name, sig):
                return Kernel(name)

        class Event:
            def __init__(self, dev, timing=False):
                pass

            def record(self, st):
                pass

            def synchronize(self):
                pass

            def elapsed_ms(self, other):
                return 1.0

        def copy_d2d(dst, src, nbytes, st):
            st.run(lambda: rt.mem.u8(dst).__setitem__(slice(0, nbytes), rt.mem.u8(src)[:nbytes].copy()))

        self.Device, self.Stream, self.DeviceBuffer, self.Library, self.Event = Device, Stream, DeviceBuffer, Library, Event
        self.copy_d2d = copy_d2d

    def init(self):
        pass

    # strata._ext.graphs
    def begin_capture(self, st):
        st.capture = []

    def end_capture(self, st):
        fns, st.capture = st.capture, None

        class Exe:
            def upload(self, st):
                pass

            def launch(self, st):
                for fn in fns:
                    fn()

            def destroy(self):
                pass

        class Graph:
            def instantiate(self):
                return Exe()

            def destroy(self):
                pass
        return Graph()

    # the kernels' contracts (tools/variants/pdl_stage.cu's header)
    def gemv(self, W, x, y, rows, n, seg=0):
        w = q8_rows(self.mem.u8(W)[:rows * n // 32 * 34].reshape(rows, -1), n)
        xv = self.mem.f32(x).astype(np.float64)
        if seg:
            out = np.einsum("srn,sn->sr", w.reshape(rows // seg, seg, n), xv[:rows // seg * n].reshape(-1, n))
        else:
            out = w @ xv[:n]
        self.mem.f32(y)[:rows] = out.reshape(rows).astype(np.float32)

    def small(self, x, y, count):
        self.mem.f32(y)[:count] = self.mem.f32(x)[:count] * np.float32(1.0001)

    def emulate(self, name, grid, args):
        if name in ("bench_plain_q8", "bench_plain1_q8", "bench_plain1s_q8"):
            self.gemv(*args)
        elif name == "bench_stage_q8":
            self.gemv(*args[:5])
        elif name in ("bench_small", "bench_small_early"):
            self.small(*args)
        elif name in ("bench_persist_q8", "bench_persist3_q8"):
            table, phases, _, _, err = args
            t = self.mem.u8(table).view(np.int64)[:6 * phases].reshape(phases, 6)
            for W, src, dst, rows, n, seg in t.tolist():
                if self.persist_fault == "segment" and seg:
                    seg = 0
                if W == 0:
                    self.small(src, dst, rows)
                else:
                    self.gemv(W, src, dst, rows, n, seg)
            if self.persist_fault == "barrier":
                self.mem.u8(err)[:4] = np.array([1], np.int32).view(np.uint8)
        else:
            raise AssertionError(f"unknown kernel {name}")


@pytest.fixture
def bench(monkeypatch):
    def run(args, fault=""):
        rt = FakeRuntime(fault)
        monkeypatch.setattr(strata._ext, "runtime", rt, raising=False)
        monkeypatch.setattr(strata._ext, "graphs", rt, raising=False)
        monkeypatch.setattr(bandwidth, "copy_rates", lambda rt_, dev, st, n: (1.0e12, 2.0e12))
        tool = load_tool("pdl_chain_bench")
        return tool.main(["--fatbin", __file__, "--copies", "2", "--reps", "1", "--shrink", "8", *args]), rt
    return run


def test_every_arm_of_every_chain_equals_the_plain_chain(bench, capsys):
    rc, rt = bench([])
    out = capsys.readouterr().out
    assert rc == 0 and out.rstrip().endswith("ok"), out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in
            ("qkv", "o", "alt", "small", "smallE", "layer", "layerE")]
    arms = {(r[0], r[1]) for r in rows}
    for chain in ("qkv", "o", "alt", "small", "smallE"):
        assert {a for c, a in arms if c == chain} == {"plain", "plain1", "stage", "early", "persist", "persistL", "persist3"}
    for chain in ("layer", "layerE"):       # the segmented down projection: plain1 and the persistent arms
        assert {a for c, a in arms if c == chain} == {"plain1", "persist", "persistL", "persist3"}
    assert not any("!=" in line or "OUTPUT" in line for line in out.splitlines()), out
    checks = [line for line in out.splitlines() if line.startswith("check dn")]
    assert len(checks) == 4 and all("== first arm" in c for c in checks), checks
    assert "bench_plain1s_q8" in rt.launched and "bench_persist3_q8" in rt.launched


def test_a_persistent_chain_that_drops_the_segments_fails(bench, capsys):
    rc, _ = bench(["--chains", "layer", "--arms", "plain1,persist"], fault="segment")
    out = capsys.readouterr().out
    assert rc == 1 and "FAILED" in out and "!= FIRST ARM" in out, out


def test_a_barrier_that_timed_out_fails_the_run(bench, capsys):
    rc, _ = bench(["--chains", "alt", "--arms", "plain1,persist"], fault="barrier")
    out = capsys.readouterr().out
    assert rc == 1 and "grid barrier timed out" in out, out
