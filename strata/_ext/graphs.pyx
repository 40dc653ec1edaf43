"""CUDA graphs through the driver API: capture a stream's work into a Graph, instantiate it into a
GraphExec, replay that on a stream with one call.

Capture runs in CU_STREAM_CAPTURE_MODE_THREAD_LOCAL. GLOBAL would also fail other threads' unsafe
calls (a cuMemAlloc in the server's request thread, a second model) for as long as we capture;
RELAXED would let our own thread allocate or synchronize inside the capture, which succeeds at
capture time and leaves a graph that depends on work it never recorded. THREAD_LOCAL makes exactly
the capturing thread's mistakes errors (a pool growth, a download, a synchronize), which is the
guard the engine needs, and leaves everyone else alone.

A graph bakes in every address its kernels were given: whoever holds a GraphExec must keep all
memory it reads or writes alive, unmoved and unshared for as long as it may be launched.
"""

cimport cython
from cuda.bindings.cydriver cimport (
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, CU_STREAM_CAPTURE_STATUS_NONE, CUgraph, CUgraphExec,
    CUstreamCaptureStatus, cuGraphDestroy, cuGraphExecDestroy, cuGraphGetNodes, cuGraphInstantiate,
    cuGraphLaunch, cuGraphUpload, cuStreamBeginCapture, cuStreamEndCapture, cuStreamIsCapturing,
)

from strata._ext.runtime cimport Device, Stream, check

from strata.errors import InvalidArgument

__all__ = ["begin_capture", "end_capture", "is_capturing", "Graph", "GraphExec"]


cdef int _same_device(Device device, Stream stream, str what) except -1:
    if stream.device.ordinal != device.ordinal:
        raise InvalidArgument(f"{what}: stream of CUDA device {stream.device.ordinal} used with a graph of "
                              f"device {device.ordinal}")
    return 0


def begin_capture(Stream stream not None):
    """Work queued on `stream` from now on is recorded, not run, until end_capture(stream)."""
    with nogil:
        stream.device.activate()
        check(cuStreamBeginCapture(stream.handle, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")


def end_capture(Stream stream not None) -> Graph:
    """Stop capturing on `stream`; the recorded work as a Graph. Raises DeviceError if the capture was
    invalidated (an unsupported call while capturing); the stream has left capture mode either way."""
    cdef CUgraph handle = NULL
    with nogil:
        stream.device.activate()
        check(cuStreamEndCapture(stream.handle, &handle), "cuStreamEndCapture")
    graph = Graph.__new__(Graph)
    (<Graph>graph).handle = handle
    (<Graph>graph).device = stream.device
    return graph


def is_capturing(Stream stream not None) -> bool:
    cdef CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE
    with nogil:
        check(cuStreamIsCapturing(stream.handle, &status), "cuStreamIsCapturing")
    return status != CU_STREAM_CAPTURE_STATUS_NONE


@cython.no_gc_clear
cdef class Graph:
    """Captured work (a CUgraph). Made by end_capture; destroyed by destroy() or when collected."""

    cdef CUgraph handle
    cdef readonly Device device

    def __cinit__(self):
        self.handle = NULL

    def __dealloc__(self):
        if self.handle != NULL:
            cuGraphDestroy(self.handle)

    @property
    def num_nodes(self) -> int:
        cdef size_t count = 0
        self._live("num_nodes")
        with nogil:
            check(cuGraphGetNodes(self.handle, NULL, &count), "cuGraphGetNodes")
        return count

    cdef int _live(self, str what) except -1:
        if self.handle == NULL:
            raise InvalidArgument(f"Graph.{what}: the graph was destroyed")
        return 0

    def instantiate(self) -> GraphExec:
        """An executable copy of the graph (the graph itself may be destroyed afterwards)."""
        cdef CUgraphExec exec_handle = NULL
        self._live("instantiate")
        with nogil:
            self.device.activate()
            check(cuGraphInstantiate(&exec_handle, self.handle, 0), "cuGraphInstantiate")
        out = GraphExec.__new__(GraphExec)
        (<GraphExec>out).handle = exec_handle
        (<GraphExec>out).device = self.device
        return out

    def destroy(self):
        if self.handle != NULL:
            with nogil:
                check(cuGraphDestroy(self.handle), "cuGraphDestroy")
            self.handle = NULL


@cython.no_gc_clear
cdef class GraphExec:
    """An instantiated graph: launch() queues all of its work on a stream with one driver call."""

    cdef CUgraphExec handle
    cdef readonly Device device

    def __cinit__(self):
        self.handle = NULL

    def __dealloc__(self):
        if self.handle != NULL:
            cuGraphExecDestroy(self.handle)

    cdef int _live(self, str what) except -1:
        if self.handle == NULL:
            raise InvalidArgument(f"GraphExec.{what}: the graph was destroyed")
        return 0

    def upload(self, Stream stream not None):
        """Move the graph's launch data to the device ahead of the first launch (optional)."""
        self._live("upload")
        _same_device(self.device, stream, "GraphExec.upload")
        with nogil:
            self.device.activate()
            check(cuGraphUpload(self.handle, stream.handle), "cuGraphUpload")

    def launch(self, Stream stream not None):
        """Queue the whole graph on `stream`; ordered after the stream's earlier work, as a kernel is."""
        self._live("launch")
        _same_device(self.device, stream, "GraphExec.launch")
        with nogil:
            self.device.activate()
            check(cuGraphLaunch(self.handle, stream.handle), "cuGraphLaunch")

    def destroy(self):
        if self.handle != NULL:
            with nogil:
                check(cuGraphExecDestroy(self.handle), "cuGraphExecDestroy")
            self.handle = NULL
