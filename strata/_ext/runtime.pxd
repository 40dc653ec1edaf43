# The CUDA driver runtime Strata's GPU code runs on: devices (primary contexts), streams, events,
# device and pinned host memory, kernel libraries from strata/kernels, typed launches.
# Other Cython modules cimport these types to launch without Python overhead.

from cuda.bindings.cydriver cimport (
    CUcontext, CUdevice, CUdevice_attribute, CUdeviceptr, CUevent, CUfunction, CUkernel, CUlibrary, CUresult, CUstream,
)

cdef enum:
    MAX_PARAMS = 32  # kernel parameters per launch
    TENSOR_MAP_BYTES = 128  # a CUtensorMap, passed by value (kind B)

# Raises strata.errors.DeviceError naming `call` and the driver's error name and string.
cdef int check(CUresult err, const char* call) except -1 nogil


cdef class Device:
    cdef readonly int ordinal
    cdef CUdevice dev
    cdef CUcontext ctx
    cdef bint retained
    cdef int activate(self) except -1 nogil
    cdef int _attribute(self, CUdevice_attribute attr) except? -1


cdef class Stream:
    cdef readonly Device device
    cdef CUstream handle


cdef class Event:
    cdef readonly Device device
    cdef CUevent handle


cdef class DeviceBuffer:
    cdef readonly Device device
    cdef CUdeviceptr dptr
    cdef readonly size_t nbytes
    cdef int _range(self, size_t offset, size_t nbytes, str what) except -1


cdef class HostBuffer:
    cdef readonly Device device
    cdef void* hptr
    cdef readonly size_t nbytes
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]
    cdef int num_exports


cdef class Library:
    cdef CUlibrary handle
    cdef readonly str name
    cdef bytes image


cdef class Kernel:
    cdef readonly Device device
    cdef readonly Library library
    cdef readonly str name
    cdef readonly str signature
    cdef CUfunction func
    cdef int num_params
    cdef char kinds[MAX_PARAMS]
    cdef unsigned int shared_opt_in
    cdef int _check_params(self, CUkernel kern) except -1
