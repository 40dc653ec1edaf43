"""strata._ext.graphs on a GPU: capture, instantiate, replay reading new inputs, and a capture that an
unsupported call invalidates."""
import numpy as np
import pytest

from strata.errors import DeviceError

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def rt():
    from strata._ext import runtime
    return runtime


@pytest.fixture(scope="module")
def graphs():
    from strata._ext import graphs
    return graphs


def test_replay_reads_the_inputs_of_the_moment(rt, graphs, rng):
    dev = rt.Device(0)
    stream = rt.Stream(dev)
    kernel = rt.load_library("rms_norm").kernel(dev, "strata_rms_norm_f32", "PPPiif")
    rows, n = 37, 1000
    x, w = rng.standard_normal((rows, n)).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    xb, wb, yb, zb = (rt.DeviceBuffer(dev, a.nbytes) for a in (x, w, x, x))
    xb.copy_from_host(x, stream)
    wb.copy_from_host(w, stream)
    stream.synchronize()

    def two_norms():        # z = norm(norm(x)): two dependent launches
        kernel.launch(rows, 256, (xb, wb, yb, rows, n, 1e-6), stream=stream)
        kernel.launch(rows, 256, (yb, wb, zb, rows, n, 1e-6), stream=stream)

    graphs.begin_capture(stream)
    assert graphs.is_capturing(stream)
    two_norms()
    graph = graphs.end_capture(stream)
    assert not graphs.is_capturing(stream) and graph.num_nodes == 2
    exec_ = graph.instantiate()
    graph.destroy()
    for _ in range(3):
        x = rng.standard_normal((rows, n)).astype(np.float32)
        xb.copy_from_host(x, stream)
        zb.fill_bytes(0xFF, stream)
        exec_.launch(stream)
        got = np.empty_like(x)
        zb.copy_to_host(got, stream)
        two_norms()                                     # the same work, launched eagerly
        want = np.empty_like(x)
        zb.copy_to_host(want, stream)
        stream.synchronize()
        assert np.isfinite(got).all() and np.array_equal(got, want)
    exec_.destroy()
    with pytest.raises(Exception, match="destroyed"):
        exec_.launch(stream)


def test_a_synchronize_inside_a_capture_invalidates_it(rt, graphs):
    dev = rt.Device(0)
    stream = rt.Stream(dev)
    buf = rt.DeviceBuffer(dev, 1024)
    graphs.begin_capture(stream)
    buf.fill_bytes(1, stream)
    with pytest.raises(DeviceError, match="cuStreamSynchronize"):
        stream.synchronize()
    with pytest.raises(DeviceError, match="cuStreamEndCapture"):
        graphs.end_capture(stream)
    assert not graphs.is_capturing(stream)
    buf.fill_bytes(2, stream)                           # the stream works as before
    out = np.empty(1024, np.uint8)
    buf.copy_to_host(out, stream)
    stream.synchronize()
    assert (out == 2).all()
