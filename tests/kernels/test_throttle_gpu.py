"""cuda/throttle.cu through BusCap on a GPU: a paced batch of host->device copies takes bytes / cap
(within timer slack), an unpaced one runs at the bus's own rate, and the sleep holds a stream."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

NBYTES = 64 << 20


@pytest.fixture(scope="module")
def gpu():
    from strata._ext import runtime as rt
    dev = rt.Device(0)
    return rt, dev, rt.Stream(dev)


def _timed(rt, dev, stream, queue) -> float:
    start, end = rt.Event(dev, timing=True), rt.Event(dev, timing=True)
    start.record(stream)
    queue()
    end.record(stream)
    end.synchronize()
    return start.elapsed_ms(end) * 1e-3


@pytest.mark.parametrize("cap_gbs", [5.0, 25.0])
def test_paced_copies_run_at_the_cap(gpu, cap_gbs):
    from strata.engine.experts.bus_cap import BusCap
    rt, dev, stream = gpu
    host, dst = rt.HostBuffer(dev, NBYTES), rt.DeviceBuffer(dev, NBYTES)
    np.frombuffer(host, np.uint8)[:] = 7
    cap = BusCap(rt, dev, cap_gbs, bus_gbs=50.0)

    def paced():
        cap.before(stream)
        for off in range(0, NBYTES, NBYTES // 8):      # a batch of blobs, as the store queues them
            rt.copy_h2d(dst.ptr + off, host.ptr + off, NBYTES // 8, stream)
        cap.after(stream, NBYTES)

    free = NBYTES / _timed(rt, dev, stream, lambda: rt.copy_h2d(dst.ptr, host.ptr, NBYTES, stream)) / 1e9
    if free < 1.2 * cap_gbs:
        pytest.skip(f"the bus runs at {free:.1f} GB/s here, too near a {cap_gbs} GB/s cap to tell them apart")
    _timed(rt, dev, stream, paced)                     # load the library, warm the path
    rate = NBYTES / _timed(rt, dev, stream, paced) / 1e9
    assert 0.9 * cap_gbs <= rate <= 1.02 * cap_gbs, f"paced at {rate:.2f} GB/s for a {cap_gbs} GB/s cap (free {free:.1f})"
    out = np.zeros(NBYTES, np.uint8)
    dst.copy_to_host(out, stream)
    stream.synchronize()
    assert (out == 7).all()


def test_sleep_holds_the_stream(gpu):
    from strata.engine.experts.bus_cap import BusCap
    rt, dev, stream = gpu
    cap = BusCap(rt, dev, 10.0, bus_gbs=50.0)
    nbytes = 40_000_000          # (1/10 - 1/50) ns per byte: 3.2 ms
    _timed(rt, dev, stream, lambda: cap.zero_copy(stream, 1000))
    seconds = _timed(rt, dev, stream, lambda: cap.zero_copy(stream, nbytes))
    assert 3.2e-3 <= seconds <= 3.2e-3 * 1.1 + 2e-4
