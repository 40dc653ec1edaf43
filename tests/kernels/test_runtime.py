"""strata._ext.runtime on a GPU: memory, streams, events, library load, typed launches, errors."""

import numpy as np
import pytest

from strata.errors import DeviceError, InvalidArgument

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def rt():
    from strata._ext import runtime

    return runtime


@pytest.fixture(scope="module")
def dev(rt):
    return rt.Device(0)


@pytest.fixture(scope="module")
def rms_norm(rt, dev):
    return rt.load_library("rms_norm").kernel(dev, "strata_rms_norm_f32", "PPPiif")


def rms_norm_ref(x, w, eps):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w


def test_device_info(rt):
    from strata.backends.cuda import device_info

    info = device_info()
    assert info["name"] and info["multiprocessor_count"] > 0
    assert 0 < info["free_memory_bytes"] <= info["total_memory_bytes"]
    assert rt.driver_version() >= 12040 and rt.device_count() >= 1


def test_device_buffer_round_trip(rt, dev, rng):
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    stream = rt.Stream(dev)
    buf = rt.DeviceBuffer(dev, data.nbytes + 64)
    buf.copy_from_host(data, offset=64)  # synchronous
    back = np.empty_like(data)
    buf.copy_to_host(back, stream, offset=64)  # queued on a stream
    stream.synchronize()
    np.testing.assert_array_equal(back, data)
    with pytest.raises(InvalidArgument, match="exceed"):
        buf.copy_to_host(np.empty(data.nbytes + 1, np.uint8), offset=64)
    buf.free()
    with pytest.raises(InvalidArgument, match="freed"):
        buf.copy_from_host(data)


def test_pinned_host_buffer(rt, dev, rng):
    data = rng.standard_normal(4096).astype(np.float32)
    pinned = rt.HostBuffer(dev, data.nbytes)
    view = np.frombuffer(pinned, dtype=np.float32)
    view[:] = data
    stream = rt.Stream(dev)
    buf = rt.DeviceBuffer(dev, data.nbytes)
    buf.copy_from_host(pinned, stream)
    out = rt.HostBuffer(dev, data.nbytes)
    buf.copy_to_host(out, stream)
    stream.synchronize()
    np.testing.assert_array_equal(np.frombuffer(out, dtype=np.float32), data)
    with pytest.raises(InvalidArgument, match="still alive"):
        pinned.free()
    del view
    pinned.free()


def test_events_time_a_launch(rt, dev, rms_norm, rng):
    rows, n = 1024, 4096
    x = rng.standard_normal((rows, n)).astype(np.float32)
    stream = rt.Stream(dev)
    xb, yb, wb = rt.DeviceBuffer(dev, x.nbytes), rt.DeviceBuffer(dev, x.nbytes), rt.DeviceBuffer(dev, n * 4)
    xb.copy_from_host(x, stream)
    wb.copy_from_host(x[0], stream)
    start, end = rt.Event(dev, timing=True), rt.Event(dev, timing=True)
    start.record(stream)
    rms_norm.launch(rows, 256, (xb, wb, yb, rows, n, 1e-6), stream=stream)
    end.record(stream)
    end.synchronize()
    assert end.query() and start.elapsed_ms(end) > 0


@pytest.mark.parametrize("block", [32, 256, 1024])
def test_rms_norm_in_place_and_misaligned(rt, dev, rms_norm, rng, block):
    # y aliases x, and pointers 4 bytes past alignment force the scalar path with n % 4 == 0
    rows, n = 9, 1024
    x = rng.standard_normal((rows, n)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    xb, wb = rt.DeviceBuffer(dev, x.nbytes + 4), rt.DeviceBuffer(dev, w.nbytes + 4)
    xb.fill_bytes(0xFF)  # NaN poison: an unwritten element fails the comparison
    xb.copy_from_host(x, offset=4)
    wb.copy_from_host(w, offset=4)
    rms_norm.launch(rows, block, (xb.ptr + 4, wb.ptr + 4, xb.ptr + 4, rows, n, 1e-6))
    y = np.empty_like(x)
    xb.copy_to_host(y, offset=4)
    np.testing.assert_allclose(y, rms_norm_ref(x, w, 1e-6), rtol=1e-5, atol=0)


def test_driver_errors_name_the_call(rt, dev, rms_norm):
    buf = rt.DeviceBuffer(dev, 4096)
    with pytest.raises(DeviceError, match=r"cuLaunchKernel: CUDA_ERROR_INVALID_VALUE"):
        rms_norm.launch(1, 2048, (buf, buf, buf, 1, 16, 1e-6))  # blocks hold at most 1024 threads
    with pytest.raises(DeviceError, match=r"cuLibraryGetKernel: CUDA_ERROR_NOT_FOUND"):
        rt.load_library("rms_norm").kernel(dev, "strata_no_such_kernel", "P")


def test_kernel_signature_is_checked(rt, dev, rms_norm):
    lib = rt.load_library("rms_norm")
    assert rt.load_library("rms_norm") is lib  # loaded once
    with pytest.raises(InvalidArgument, match="more parameters"):
        lib.kernel(dev, "strata_rms_norm_f32", "PPPii")
    with pytest.raises(InvalidArgument, match="parameter 5 has 4 bytes"):
        lib.kernel(dev, "strata_rms_norm_f32", "PPPiid")
    with pytest.raises(InvalidArgument, match="takes 6 arguments"):
        rms_norm.launch(1, 32, (0, 0, 0, 1, 1))
    with pytest.raises(InvalidArgument, match="does not fit"):
        rms_norm.launch(1, 32, (0, 0, 0, 2**40, 1, 1e-6))
