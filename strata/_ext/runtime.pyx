"""CUDA driver runtime: devices, streams, events, device and pinned memory, kernel libraries, launches.

Importing this module loads no CUDA library: cuda.bindings finds libcuda at the first driver call
(init). Every driver call goes through check(), which raises strata.errors.DeviceError with the
call's name and the driver's error name and string. The GIL is released around driver calls.
Device work runs in the device's primary context, made current on the calling thread before each
call, so objects can be used from any thread (the server's engine thread, for one).
"""

import hashlib
import json
import operator
import threading
from pathlib import Path

cimport cython
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uintptr_t
from cuda.bindings.cydriver cimport (
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, CU_EVENT_DEFAULT, CU_EVENT_DISABLE_TIMING,
    CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_PORTABLE, CU_STREAM_NON_BLOCKING, CUDA_ERROR_NOT_READY, CUDA_SUCCESS,
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, cuCtxEnablePeerAccess, cuDeviceCanAccessPeer,
    CUdevice_attribute, CUlaunchAttribute, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
    CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
    cuFuncSetAttribute, CUlaunchConfig, CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
    cuCtxGetCurrent, cuCtxSetCurrent, cuCtxSynchronize, cuDeviceGet, cuDeviceGetAttribute,
    cuDeviceGetCount, cuDeviceGetName, cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRetain,
    cuDeviceTotalMem, cuDriverGetVersion, cuEventCreate, cuEventDestroy, cuEventElapsedTime,
    cuEventQuery, cuEventRecord, cuEventSynchronize, cuGetErrorName, cuGetErrorString, cuInit,
    cuKernelGetFunction, cuKernelGetParamInfo, cuLaunchKernel, cuLaunchKernelEx, cuLibraryGetKernel, cuLibraryLoadData,
    cuLibraryUnload, cuMemAlloc, cuMemFree, cuMemFreeHost, cuMemGetInfo, cuMemHostAlloc,
    cuMemHostGetDevicePointer, cuMemcpyDtoDAsync, cuMemcpyDtoH, cuMemcpyPeerAsync, cuMemcpyDtoHAsync, cuMemcpyHtoD, cuMemcpyHtoDAsync, cuMemsetD8, cuMemsetD8Async,
    cuStreamCreateWithPriority, cuStreamDestroy, cuStreamSynchronize, cuStreamWaitEvent,
    CUtensorMap, cuTensorMapEncodeTiled, cuuint32_t, cuuint64_t, CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
)
from libc.string cimport memcpy

from strata.errors import DeviceError, InvalidArgument

__all__ = ["init", "driver_version", "device_count", "Device", "Stream", "Event", "DeviceBuffer",
           "HostBuffer", "copy_h2d", "copy_d2d", "copy_peer", "copy_h2d_batch", "tensor_map_f16", "Library", "Kernel", "kernels_dir", "read_manifest", "read_fatbin", "load_library"]


cdef str _error_text(CUresult err):
    cdef const char* name = NULL
    cdef const char* text = NULL
    if cuGetErrorName(err, &name) != CUDA_SUCCESS or name == NULL:
        return f"CUresult {<int>err}"
    if cuGetErrorString(err, &text) != CUDA_SUCCESS or text == NULL:
        return name.decode()
    return f"{name.decode()} ({text.decode()})"


cdef int check(CUresult err, const char* call) except -1 nogil:
    if err != CUDA_SUCCESS:
        with gil:
            raise DeviceError(f"{call.decode()}: {_error_text(err)}")
    return 0


# ---- driver and devices ------------------------------------------------------------------------

cdef bint _initialized = False


def init():
    """Load the driver and initialize it; idempotent. Raises DeviceError where no driver is found."""
    global _initialized
    cdef CUresult err
    if _initialized:
        return
    try:
        with nogil:
            err = cuInit(0)
    except Exception as exc:  # cuda.bindings raises its own error types when libcuda is missing
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DeviceError(f"cuInit: CUDA driver not loadable ({first})") from None
    check(err, "cuInit")
    _initialized = True


def driver_version() -> int:
    """The driver's CUDA version as 1000 * major + 10 * minor (13000 for 13.0)."""
    cdef int version = 0
    init()
    with nogil:
        check(cuDriverGetVersion(&version), "cuDriverGetVersion")
    return version


def device_count() -> int:
    cdef int count = 0
    init()
    with nogil:
        check(cuDeviceGetCount(&count), "cuDeviceGetCount")
    return count


@cython.no_gc_clear
cdef class Device:
    """One GPU, used through its primary context (shared with any other CUDA user in the process)."""

    def __cinit__(self, int ordinal=0):
        self.retained = False
        count = device_count()
        if not 0 <= ordinal < count:
            raise DeviceError(f"CUDA device {ordinal}: not found ({count} visible)")
        with nogil:
            check(cuDeviceGet(&self.dev, ordinal), "cuDeviceGet")
            check(cuDevicePrimaryCtxRetain(&self.ctx, self.dev), "cuDevicePrimaryCtxRetain")
        self.retained = True
        self.ordinal = ordinal

    def __dealloc__(self):
        if self.retained:
            cuDevicePrimaryCtxRelease(self.dev)  # errors ignored: the process may be shutting down

    cdef int activate(self) except -1 nogil:
        cdef CUcontext current = NULL
        check(cuCtxGetCurrent(&current), "cuCtxGetCurrent")
        if current != self.ctx:
            check(cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        return 0

    cdef int _attribute(self, CUdevice_attribute attr) except? -1:
        cdef int value = 0
        with nogil:
            check(cuDeviceGetAttribute(&value, attr, self.dev), "cuDeviceGetAttribute")
        return value

    @property
    def name(self) -> str:
        cdef char buf[256]
        with nogil:
            check(cuDeviceGetName(buf, sizeof(buf), self.dev), "cuDeviceGetName")
        return buf.decode()

    @property
    def total_memory_bytes(self) -> int:
        cdef size_t total = 0
        with nogil:
            check(cuDeviceTotalMem(&total, self.dev), "cuDeviceTotalMem")
        return total

    @property
    def compute_capability(self) -> tuple:
        return (self._attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                self._attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))

    @property
    def multiprocessor_count(self) -> int:
        return self._attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)

    def memory_info(self) -> tuple:
        """(free_bytes, total_bytes) as the driver sees them now."""
        cdef size_t free = 0, total = 0
        with nogil:
            self.activate()
            check(cuMemGetInfo(&free, &total), "cuMemGetInfo")
        return free, total

    def synchronize(self):
        """Wait for all work on this device; reports errors of earlier asynchronous work."""
        with nogil:
            self.activate()
            check(cuCtxSynchronize(), "cuCtxSynchronize")

    def enable_peer_access(self, Device peer not None) -> bool:
        """Let this device's context read and write peer's memory directly (a layer split's hand-off
        between two GPUs: cuMemcpyPeerAsync then copies over NVLink or PCIe peer to peer). -> whether
        peer access is on; False where the GPUs cannot (the copies then go through host memory)."""
        cdef int can = 0
        cdef CUresult err
        if peer.ordinal == self.ordinal:
            return True
        with nogil:
            check(cuDeviceCanAccessPeer(&can, self.dev, peer.dev), "cuDeviceCanAccessPeer")
            if can:
                self.activate()
                err = cuCtxEnablePeerAccess(peer.ctx, 0)
                if err != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
                    check(err, "cuCtxEnablePeerAccess")
        return bool(can)

    def __repr__(self):
        return f"Device({self.ordinal}, {self.name!r})"


# ---- streams and events ------------------------------------------------------------------------

cdef CUstream _stream_handle(Stream stream, Device device) except? NULL:
    if stream is None:
        return NULL  # the legacy default stream
    if stream.device.ordinal != device.ordinal:
        raise InvalidArgument(f"stream of CUDA device {stream.device.ordinal} used on device {device.ordinal}")
    return stream.handle


@cython.no_gc_clear
cdef class Stream:
    """A non-blocking stream: its work does not wait for the legacy default stream."""

    def __cinit__(self, Device device not None, int priority=0):
        self.handle = NULL
        self.device = device
        with nogil:
            device.activate()
            check(cuStreamCreateWithPriority(&self.handle, CU_STREAM_NON_BLOCKING, priority),
                  "cuStreamCreateWithPriority")

    def __dealloc__(self):
        if self.handle != NULL:
            cuStreamDestroy(self.handle)

    @property
    def address(self) -> int:
        """The CUstream handle as an integer, for other libraries."""
        return <uintptr_t>self.handle

    def synchronize(self):
        with nogil:
            check(cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def wait_event(self, Event event not None):
        """Later work on this stream waits until `event` has completed."""
        with nogil:
            check(cuStreamWaitEvent(self.handle, event.handle, 0), "cuStreamWaitEvent")


@cython.no_gc_clear
cdef class Event:
    """A point in a stream's work; with timing=True two events give the device time between them."""

    def __cinit__(self, Device device not None, bint timing=False):
        self.handle = NULL
        self.device = device
        cdef unsigned int flags = CU_EVENT_DEFAULT if timing else CU_EVENT_DISABLE_TIMING
        with nogil:
            device.activate()
            check(cuEventCreate(&self.handle, flags), "cuEventCreate")

    def __dealloc__(self):
        if self.handle != NULL:
            cuEventDestroy(self.handle)

    def record(self, Stream stream=None):
        cdef CUstream h = _stream_handle(stream, self.device)
        with nogil:
            check(cuEventRecord(self.handle, h), "cuEventRecord")

    def synchronize(self):
        with nogil:
            check(cuEventSynchronize(self.handle), "cuEventSynchronize")

    def query(self) -> bool:
        """True once the work before the last record() has completed."""
        cdef CUresult err
        with nogil:
            err = cuEventQuery(self.handle)
        if err == CUDA_ERROR_NOT_READY:
            return False
        check(err, "cuEventQuery")
        return True

    def elapsed_ms(self, Event end not None) -> float:
        """Milliseconds of device time from this event to `end` (both recorded, timing=True)."""
        cdef float ms = 0
        with nogil:
            check(cuEventElapsedTime(&ms, self.handle, end.handle), "cuEventElapsedTime")
        return ms


# ---- memory ------------------------------------------------------------------------------------

cdef int _get_buffer(object obj, Py_buffer* view, int flags, str what) except -1:
    try:
        PyObject_GetBuffer(obj, view, flags | PyBUF_C_CONTIGUOUS)
    except (BufferError, TypeError) as exc:
        raise InvalidArgument(f"{what}: needs a C-contiguous{' writable' if flags else ''} buffer ({exc})") from None
    return 0


@cython.no_gc_clear
cdef class DeviceBuffer:
    """`nbytes` of device memory (cuMemAlloc: 256-byte aligned). Freed by free() or when collected.

    Copies with stream=None are synchronous. With a stream they are queued on it: a pageable source
    is staged before the call returns, a pinned HostBuffer must stay alive until the stream is done.
    """

    def __cinit__(self, Device device not None, size_t nbytes):
        self.dptr = 0
        self.device = device
        self.nbytes = nbytes
        if nbytes:
            with nogil:
                device.activate()
                check(cuMemAlloc(&self.dptr, nbytes), "cuMemAlloc")

    def __dealloc__(self):
        if self.dptr:
            cuCtxSetCurrent(self.device.ctx)
            cuMemFree(self.dptr)

    @property
    def ptr(self) -> int:
        """The device address, for kernel arguments."""
        return self.dptr

    def free(self):
        if self.dptr:
            with nogil:
                self.device.activate()
                check(cuMemFree(self.dptr), "cuMemFree")
            self.dptr = 0

    cdef int _range(self, size_t offset, size_t nbytes, str what) except -1:
        if self.nbytes and not self.dptr:
            raise InvalidArgument(f"DeviceBuffer.{what}: buffer already freed")
        if offset + nbytes > self.nbytes:
            raise InvalidArgument(f"DeviceBuffer.{what}: {nbytes} bytes at offset {offset} exceed the buffer's {self.nbytes}")
        return 0

    def copy_from_host(self, src, Stream stream=None, size_t offset=0):
        """Copy all bytes of `src` (any C-contiguous buffer: numpy array, bytes, HostBuffer) to ptr + offset."""
        cdef Py_buffer view
        cdef CUstream h = _stream_handle(stream, self.device)
        _get_buffer(src, &view, 0, "DeviceBuffer.copy_from_host")
        try:
            self._range(offset, view.len, "copy_from_host")
            if view.len == 0:
                return
            with nogil:
                self.device.activate()
                if h == NULL:
                    check(cuMemcpyHtoD(self.dptr + offset, view.buf, view.len), "cuMemcpyHtoD")
                else:
                    check(cuMemcpyHtoDAsync(self.dptr + offset, view.buf, view.len, h), "cuMemcpyHtoDAsync")
        finally:
            PyBuffer_Release(&view)

    def copy_to_host(self, dst, Stream stream=None, size_t offset=0):
        """Fill all bytes of the writable C-contiguous buffer `dst` from ptr + offset."""
        cdef Py_buffer view
        cdef CUstream h = _stream_handle(stream, self.device)
        _get_buffer(dst, &view, PyBUF_WRITABLE, "DeviceBuffer.copy_to_host")
        try:
            self._range(offset, view.len, "copy_to_host")
            if view.len == 0:
                return
            with nogil:
                self.device.activate()
                if h == NULL:
                    check(cuMemcpyDtoH(view.buf, self.dptr + offset, view.len), "cuMemcpyDtoH")
                else:
                    check(cuMemcpyDtoHAsync(view.buf, self.dptr + offset, view.len, h), "cuMemcpyDtoHAsync")
        finally:
            PyBuffer_Release(&view)

    def fill_bytes(self, unsigned char value, Stream stream=None):
        """Set every byte to `value` (poison outputs before a test launch)."""
        cdef CUstream h = _stream_handle(stream, self.device)
        self._range(0, self.nbytes, "fill_bytes")
        if not self.nbytes:
            return
        with nogil:
            self.device.activate()
            if h == NULL:
                check(cuMemsetD8(self.dptr, value, self.nbytes), "cuMemsetD8")
            else:
                check(cuMemsetD8Async(self.dptr, value, self.nbytes, h), "cuMemsetD8Async")


@cython.no_gc_clear
cdef class HostBuffer:
    """`nbytes` of page-locked host memory, usable by every context; exposes the buffer protocol,
    so np.frombuffer(buf, dtype) views it without a copy. Copies from it are truly asynchronous.
    With mapped=True kernels can also read it in place over the bus, at device_ptr (zero-copy)."""

    def __cinit__(self, Device device not None, size_t nbytes, bint mapped=False):
        cdef unsigned int flags = CU_MEMHOSTALLOC_PORTABLE | (CU_MEMHOSTALLOC_DEVICEMAP if mapped else 0)
        self.hptr = NULL
        self.device = device
        self.nbytes = nbytes
        self.num_exports = 0
        self.shape[0] = nbytes
        self.strides[0] = 1
        if nbytes:
            with nogil:
                device.activate()
                check(cuMemHostAlloc(&self.hptr, nbytes, flags), "cuMemHostAlloc")

    @property
    def device_ptr(self) -> int:
        """The address kernels read this memory at (a buffer allocated with mapped=True)."""
        cdef CUdeviceptr d = 0
        if self.hptr == NULL:
            raise InvalidArgument("HostBuffer.device_ptr: buffer already freed")
        with nogil:
            self.device.activate()
            check(cuMemHostGetDevicePointer(&d, self.hptr, 0), "cuMemHostGetDevicePointer")
        return d

    def __dealloc__(self):
        if self.hptr != NULL:
            cuMemFreeHost(self.hptr)

    @property
    def ptr(self) -> int:
        return <uintptr_t>self.hptr

    def free(self):
        """Release the memory now; refused while numpy arrays or memoryviews still view it."""
        if self.num_exports:
            raise InvalidArgument(f"HostBuffer.free: {self.num_exports} view(s) of the buffer are still alive")
        if self.hptr != NULL:
            with nogil:
                check(cuMemFreeHost(self.hptr), "cuMemFreeHost")
            self.hptr = NULL
            self.shape[0] = 0

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        if self.nbytes and self.hptr == NULL:
            raise InvalidArgument("HostBuffer: buffer already freed")
        buffer.buf = self.hptr
        buffer.obj = self
        buffer.len = self.shape[0]
        buffer.readonly = 0
        buffer.itemsize = 1
        buffer.format = <char*>"B" if flags & PyBUF_FORMAT else NULL
        buffer.ndim = 1
        buffer.shape = self.shape
        buffer.strides = self.strides
        buffer.suboffsets = NULL
        buffer.internal = NULL
        self.num_exports += 1

    def __releasebuffer__(self, Py_buffer* buffer):
        self.num_exports -= 1


# ---- raw copies (addresses as integers: pool blocks, arena ranges, cache slots) -------------------

def copy_h2d(uint64_t dst, uint64_t src, size_t nbytes, Stream stream not None):
    """Queue nbytes from host address src (pinned memory, for a truly asynchronous copy) to device dst."""
    if nbytes:
        with nogil:
            stream.device.activate()
            check(cuMemcpyHtoDAsync(<CUdeviceptr>dst, <const void*><uintptr_t>src, nbytes, stream.handle),
                  "cuMemcpyHtoDAsync")


def copy_d2d(uint64_t dst, uint64_t src, size_t nbytes, Stream stream not None):
    """Queue a device-to-device copy (a memcpy node when the stream is capturing)."""
    if nbytes:
        with nogil:
            stream.device.activate()
            check(cuMemcpyDtoDAsync(<CUdeviceptr>dst, <CUdeviceptr>src, nbytes, stream.handle), "cuMemcpyDtoDAsync")


def copy_peer(uint64_t dst, Device dst_device not None, uint64_t src, Device src_device not None, size_t nbytes,
              Stream stream not None):
    """Queue a copy from src on src_device to dst on dst_device (a layer split's hand-off between two
    GPUs): peer to peer where the GPUs allow it, else the driver stages it through host memory."""
    if nbytes:
        with nogil:
            stream.device.activate()
            check(cuMemcpyPeerAsync(<CUdeviceptr>dst, dst_device.ctx, <CUdeviceptr>src, src_device.ctx, nbytes,
                                    stream.handle), "cuMemcpyPeerAsync")


@cython.boundscheck(False)
@cython.wraparound(False)
def copy_h2d_batch(const uint64_t[::1] dst, const uint64_t[::1] src, const uint64_t[::1] nbytes,
                   Stream stream not None):
    """Queue len(dst) host->device copies, dst[i] <- src[i] (nbytes[i] each), in one call: the
    expert streamer's hot loop (a ring batch or a cache admission is tens to hundreds of blobs)."""
    cdef Py_ssize_t i, n = dst.shape[0]
    if src.shape[0] != n or nbytes.shape[0] != n:
        raise InvalidArgument(f"copy_h2d_batch: {n} destinations, {src.shape[0]} sources, {nbytes.shape[0]} sizes")
    with nogil:
        stream.device.activate()
        for i in range(n):
            if nbytes[i]:
                check(cuMemcpyHtoDAsync(<CUdeviceptr>dst[i], <const void*><uintptr_t>src[i], nbytes[i],
                                        stream.handle), "cuMemcpyHtoDAsync")


# ---- kernel libraries --------------------------------------------------------------------------

_load_lock = threading.Lock()
_libraries = {}


def tensor_map_f16(uint64_t address, dims, strides, box) -> bytes:
    """The bytes of a CUtensorMap over f16 elements at `address` (a kernel's "B" parameter): dims
    innermost first, strides the bytes between consecutive entries of dims 1.., box the tile one
    copy moves; 128-byte swizzle (box[0] must be 64), zeros past the tensor's end."""
    cdef CUtensorMap tm
    cdef cuuint64_t gdim[5]
    cdef cuuint64_t gstride[4]
    cdef cuuint32_t bdim[5]
    cdef cuuint32_t estride[5]
    cdef unsigned int rank = len(dims)
    if not 1 <= rank <= 5 or len(strides) != rank - 1 or len(box) != rank:
        raise InvalidArgument(f"tensor map: dims {dims!r}, strides {strides!r}, box {box!r} do not agree")
    for i in range(rank):
        gdim[i], bdim[i], estride[i] = dims[i], box[i], 1
        if i:
            gstride[i - 1] = strides[i - 1]
    init()
    check(cuTensorMapEncodeTiled(&tm, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, rank, <void*><uintptr_t>address, gdim,
                                 gstride, bdim, estride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
          "cuTensorMapEncodeTiled")
    return (<char*>&tm)[:TENSOR_MAP_BYTES]


def kernels_dir() -> Path:
    """strata/kernels beside this module: the fatbins and manifest.json the build wrote."""
    return Path(__file__).resolve().parent.parent / "kernels"


def read_manifest(directory=None) -> dict:
    path = Path(directory or kernels_dir()) / "manifest.json"
    if not path.is_file():
        raise DeviceError(f"{path}: not found; this install was built without nvcc, so it has no GPU kernels")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise DeviceError(f"{path}: not valid JSON ({exc})") from None


def read_fatbin(str name, directory=None) -> bytes:
    """The bytes of kernel library `name` (cuda/<name>.cu), checked against the manifest's sha256."""
    directory = Path(directory or kernels_dir())
    entry = read_manifest(directory).get("kernels", {}).get(name)
    if entry is None:
        raise DeviceError(f"{directory / 'manifest.json'}: no kernel library {name!r}")
    path = directory / entry["file"]
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DeviceError(f"{path}: cannot read ({exc.strerror})") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
        raise DeviceError(f"{path}: sha256 {digest[:16]}... differs from manifest.json's "
                          f"{entry['sha256'][:16]}...; rebuild the package")
    return data


def load_library(str name) -> Library:
    """Kernel library `name`, hash-checked and loaded on first use, then shared by the process."""
    with _load_lock:
        library = _libraries.get(name)
        if library is None:
            library = _libraries[name] = Library(name, read_fatbin(name))
        return library


cdef class Library:
    """A fatbin loaded by cuLibraryLoadData: context-independent, the driver picks the device's SASS."""

    def __cinit__(self, str name, bytes image):
        self.handle = NULL
        self.name = name
        self.image = image  # the driver may read the image lazily, at first use of a kernel
        init()
        cdef const char* data = image
        with nogil:
            check(cuLibraryLoadData(&self.handle, data, NULL, NULL, 0, NULL, NULL, 0), "cuLibraryLoadData")

    def __dealloc__(self):
        if self.handle != NULL:
            cuLibraryUnload(self.handle)

    def kernel(self, Device device not None, str name, str signature) -> Kernel:
        """Kernel `name` on `device`; `signature` gives one kind letter per parameter (see Kernel)."""
        return Kernel(self, device, name, signature)


cdef dict _KIND_BYTES = {"P": 8, "i": 4, "I": 4, "q": 8, "Q": 8, "f": 4, "d": 8, "B": TENSOR_MAP_BYTES}

cdef union ArgSlot:
    uint64_t u64
    int64_t i64
    uint32_t u32
    int32_t i32
    float f32
    double f64
    unsigned char blob[TENSOR_MAP_BYTES]


cdef int _pack(char kind, object value, ArgSlot* slot) except -1:
    if kind == c"P":
        slot.u64 = (<DeviceBuffer>value).dptr if isinstance(value, DeviceBuffer) else <uint64_t>value
    elif kind == c"i":
        slot.i32 = value
    elif kind == c"I":
        slot.u32 = value
    elif kind == c"q":
        slot.i64 = value
    elif kind == c"Q":
        slot.u64 = value
    elif kind == c"f":
        slot.f32 = value
    elif kind == c"B":
        if not isinstance(value, bytes) or len(<bytes>value) != TENSOR_MAP_BYTES:
            raise TypeError(f"needs the {TENSOR_MAP_BYTES} bytes of a tensor map (tensor_map_f16)")
        memcpy(slot.blob, <const char*>(<bytes>value), TENSOR_MAP_BYTES)
    else:
        slot.f64 = value
    return 0


cdef int _dims(object value, unsigned int* out, str what) except -1:
    try:
        dims = (operator.index(value),)
    except TypeError:
        dims = tuple(value)
    if not 1 <= len(dims) <= 3 or any(operator.index(d) < 1 for d in dims):
        raise InvalidArgument(f"launch {what} {value!r}: needs 1 to 3 positive sizes")
    out[0] = out[1] = out[2] = 1
    for i, d in enumerate(dims):
        out[i] = d
    return 0


@cython.no_gc_clear
cdef class Kernel:
    """A kernel of a Library, bound to one device, with typed parameters.

    Signature letters, one per parameter: P pointer (DeviceBuffer or int address), i int32,
    I uint32, q int64, Q uint64, f float32, d float64, B a tensor map by value (the bytes
    tensor_map_f16 gives). Their sizes are checked against the
    kernel's own parameter layout (cuKernelGetParamInfo) when the kernel is looked up.
    """

    def __cinit__(self, Library library not None, Device device not None, str name, str signature):
        cdef CUkernel kern = NULL
        cdef bytes bname = name.encode()
        cdef const char* cname = bname
        if len(signature) > MAX_PARAMS or any(k not in _KIND_BYTES for k in signature):
            raise InvalidArgument(f"kernel {name}: signature {signature!r} needs at most {MAX_PARAMS} of the letters PiIqQfdB")
        self.library, self.device, self.name, self.signature = library, device, name, signature
        self.num_params = len(signature)
        for i, k in enumerate(signature.encode()):
            self.kinds[i] = k
        self.shared_opt_in = 48 << 10      # what every launch may ask without opting in
        with nogil:
            device.activate()
            check(cuLibraryGetKernel(&kern, library.handle, cname), "cuLibraryGetKernel")
            check(cuKernelGetFunction(&self.func, kern), "cuKernelGetFunction")
        self._check_params(kern)

    cdef int _check_params(self, CUkernel kern) except -1:
        cdef size_t offset = 0, size = 0
        for i, kind in enumerate(self.signature):
            check(cuKernelGetParamInfo(kern, i, &offset, &size), "cuKernelGetParamInfo")
            if size != _KIND_BYTES[kind]:
                raise InvalidArgument(f"kernel {self.name}: parameter {i} has {size} bytes, "
                                      f"signature {self.signature!r} says {kind!r}")
        if cuKernelGetParamInfo(kern, self.num_params, &offset, &size) == CUDA_SUCCESS:
            raise InvalidArgument(f"kernel {self.name}: has more parameters than signature {self.signature!r}")
        return 0

    def allow_wide_clusters(self):
        """Let this kernel run in clusters of more than the portable 8 blocks (16 on Hopper), as a
        compiled-in __cluster_dims__ past 8 needs (CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED)."""
        with nogil:
            self.device.activate()
            check(cuFuncSetAttribute(self.func, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                  "cuFuncSetAttribute")

    def prefer_shared(self, int percent):
        """Ask the driver for this share (0..100) of each SM's L1/shared memory as shared memory when it
        runs this kernel (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT; a hint). An SM changes its
        split only when idle, so a kernel whose blocks should sit beside another kernel's asks for the
        same split (tools/pdl_chain_bench.py)."""
        if not 0 <= percent <= 100:
            raise InvalidArgument(f"kernel {self.name}: a carveout is 0..100 percent, got {percent}")
        with nogil:
            self.device.activate()
            check(cuFuncSetAttribute(self.func, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, percent),
                  "cuFuncSetAttribute")

    def launch(self, grid, block, args, unsigned int shared_bytes=0, Stream stream=None, bint pdl=False):
        """Queue the kernel on `stream` (None: the legacy default stream). grid and block are an int
        or a tuple of 1 to 3 ints; args has one value per signature letter. shared_bytes: dynamic
        shared memory (past 48 KB the kernel is opted in to it first). pdl: a programmatic
        dependent launch (sm_90+), which may start while the stream's previous kernel runs: only
        for kernels that wait for it first (cuda/pdl.cuh)."""
        cdef unsigned int g[3]
        cdef unsigned int b[3]
        cdef ArgSlot slots[MAX_PARAMS]
        cdef void* params[MAX_PARAMS]
        cdef CUlaunchConfig config
        cdef CUlaunchAttribute attr
        cdef CUstream h = _stream_handle(stream, self.device)
        _dims(grid, g, "grid")
        _dims(block, b, "block")
        if len(args) != self.num_params:
            raise InvalidArgument(f"kernel {self.name}: takes {self.num_params} arguments "
                                  f"({self.signature}), got {len(args)}")
        for i in range(self.num_params):
            try:
                _pack(self.kinds[i], args[i], &slots[i])
            except (OverflowError, TypeError) as exc:
                raise InvalidArgument(f"kernel {self.name}: argument {i} {args[i]!r} does not fit "
                                      f"{self.signature[i]!r} ({exc})") from None
            params[i] = &slots[i]
        if shared_bytes > self.shared_opt_in:      # more dynamic shared memory than 48 KB: opt in once
            with nogil:
                self.device.activate()
                check(cuFuncSetAttribute(self.func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, <int>shared_bytes),
                      "cuFuncSetAttribute")
            self.shared_opt_in = shared_bytes
        if pdl:
            attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            config.gridDimX, config.gridDimY, config.gridDimZ = g[0], g[1], g[2]
            config.blockDimX, config.blockDimY, config.blockDimZ = b[0], b[1], b[2]
            config.sharedMemBytes, config.hStream, config.attrs, config.numAttrs = shared_bytes, h, &attr, 1
            with nogil:
                self.device.activate()
                check(cuLaunchKernelEx(&config, self.func, params, NULL), "cuLaunchKernelEx")
            return
        with nogil:
            self.device.activate()
            check(cuLaunchKernel(self.func, g[0], g[1], g[2], b[0], b[1], b[2], shared_bytes, h, params, NULL),
                  "cuLaunchKernel")
