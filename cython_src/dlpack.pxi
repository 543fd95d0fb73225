# The one DLPack module of kvsparse (included at the end of _core.pyx).
#
# Import (from_dlpack): a producer's capsule -> a NumPy view of the same memory, owned by a
# DLPackOwner that calls the producer's deleter once, when the last view is gone.
# Export (to_dlpack, DLPackExporter): a NumPy array -> a capsule whose managed tensor keeps
# the array alive until the consumer calls our deleter (or the unconsumed capsule dies).
#
# The structs mirror dlpack.h 1.1 (github.com/dmlc/dlpack include/dlpack/dlpack.h) field for
# field; 0.x producers (MXNet 1.9.1) use the same DLTensor layout, only without
# DLManagedTensorVersioned.
cimport numpy as cnp
from cpython.exc cimport PyErr_Fetch, PyErr_Restore
from cpython.object cimport PyTypeObject
from cpython.pycapsule cimport (PyCapsule_CheckExact, PyCapsule_Destructor, PyCapsule_GetPointer,
                                PyCapsule_IsValid, PyCapsule_New, PyCapsule_SetName)
from cpython.ref cimport Py_INCREF, Py_XDECREF, PyObject
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libcpp.vector cimport vector

cdef extern from "numpy/arrayobject.h":
    PyTypeObject PyArray_Type
    # Steals a reference to descr, hence not declared in NumPy's own .pxd.
    object PyArray_NewFromDescr(PyTypeObject* subtype, cnp.PyArray_Descr* descr, int nd,
                                cnp.npy_intp* dims, cnp.npy_intp* strides, void* data,
                                int flags, PyObject* obj)

cnp.import_array()

cdef extern from *:
    """
    static int kvsparse_python_is_shutting_down(void) {
    #if PY_VERSION_HEX >= 0x030D0000
        return !Py_IsInitialized() || Py_IsFinalizing();
    #else
        return !Py_IsInitialized() || _Py_IsFinalizing();
    #endif
    }
    """
    int kvsparse_python_is_shutting_down() nogil


# ---- dlpack.h ----------------------------------------------------------------------------

cdef enum:
    DLPACK_MAJOR_VERSION = 1
    DLPACK_MINOR_VERSION = 1

cdef enum:
    DLPACK_FLAG_BITMASK_READ_ONLY = 1 << 0
    DLPACK_FLAG_BITMASK_IS_COPIED = 1 << 1
    DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED = 1 << 2

ctypedef enum DLDeviceType:
    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3
    kDLOpenCL = 4
    kDLVulkan = 7
    kDLMetal = 8
    kDLVPI = 9
    kDLROCM = 10
    kDLROCMHost = 11
    kDLExtDev = 12
    kDLCUDAManaged = 13
    kDLOneAPI = 14
    kDLWebGPU = 15
    kDLHexagon = 16
    kDLMAIA = 17

ctypedef enum DLDataTypeCode:
    kDLInt = 0
    kDLUInt = 1
    kDLFloat = 2
    kDLOpaqueHandle = 3
    kDLBfloat = 4
    kDLComplex = 5
    kDLBool = 6
    kDLFloat8_e3m4 = 7
    kDLFloat8_e4m3 = 8
    kDLFloat8_e4m3b11fnuz = 9
    kDLFloat8_e4m3fn = 10
    kDLFloat8_e4m3fnuz = 11
    kDLFloat8_e5m2 = 12
    kDLFloat8_e5m2fnuz = 13
    kDLFloat8_e8m0fnu = 14
    kDLFloat6_e2m3fn = 15
    kDLFloat6_e3m2fn = 16
    kDLFloat4_e2m1fn = 17

ctypedef struct DLPackVersion:
    uint32_t major
    uint32_t minor

ctypedef struct DLDevice:
    # DLDeviceType in the C header: an enum, so a 4-byte int on every ABI DLPack targets.
    int32_t device_type
    int32_t device_id

ctypedef struct DLDataType:
    uint8_t code
    uint8_t bits
    uint16_t lanes

ctypedef struct DLTensor:
    void* data
    DLDevice device
    int32_t ndim
    DLDataType dtype
    int64_t* shape
    int64_t* strides  # in elements, not bytes; NULL means compact row-major
    uint64_t byte_offset

cdef struct DLManagedTensor:
    DLTensor dl_tensor
    void* manager_ctx
    void (*deleter)(DLManagedTensor* self) noexcept nogil

cdef struct DLManagedTensorVersioned:
    DLPackVersion version
    void* manager_ctx
    void (*deleter)(DLManagedTensorVersioned* self) noexcept nogil
    uint64_t flags
    DLTensor dl_tensor


# ---- dtype and device tables -------------------------------------------------------------

# (code << 8 | bits) -> NumPy dtype, lanes == 1 only. bfloat16 has no NumPy dtype, so it comes
# out as its raw bits in uint16 (DLPackOwner.dlpack_dtype says "bfloat16"; view it with
# ml_dtypes.bfloat16 if that is installed).
_NUMPY_DTYPE_OF_DLPACK = {
    kDLInt << 8 | 8: np.dtype(np.int8), kDLInt << 8 | 16: np.dtype(np.int16),
    kDLInt << 8 | 32: np.dtype(np.int32), kDLInt << 8 | 64: np.dtype(np.int64),
    kDLUInt << 8 | 8: np.dtype(np.uint8), kDLUInt << 8 | 16: np.dtype(np.uint16),
    kDLUInt << 8 | 32: np.dtype(np.uint32), kDLUInt << 8 | 64: np.dtype(np.uint64),
    kDLFloat << 8 | 16: np.dtype(np.float16), kDLFloat << 8 | 32: np.dtype(np.float32),
    kDLFloat << 8 | 64: np.dtype(np.float64),
    kDLBfloat << 8 | 16: np.dtype(np.uint16),
    kDLComplex << 8 | 64: np.dtype(np.complex64), kDLComplex << 8 | 128: np.dtype(np.complex128),
    kDLBool << 8 | 8: np.dtype(np.bool_),
}
_DTYPE_CODE_NAMES = {kDLInt: "int", kDLUInt: "uint", kDLFloat: "float", kDLBfloat: "bfloat",
                     kDLComplex: "complex", kDLBool: "bool", kDLOpaqueHandle: "opaque_handle"}
_SMALL_FLOAT_NAMES = {  # their bits are part of the name
    kDLFloat8_e3m4: "float8_e3m4", kDLFloat8_e4m3: "float8_e4m3",
    kDLFloat8_e4m3b11fnuz: "float8_e4m3b11fnuz", kDLFloat8_e4m3fn: "float8_e4m3fn",
    kDLFloat8_e4m3fnuz: "float8_e4m3fnuz", kDLFloat8_e5m2: "float8_e5m2",
    kDLFloat8_e5m2fnuz: "float8_e5m2fnuz", kDLFloat8_e8m0fnu: "float8_e8m0fnu",
    kDLFloat6_e2m3fn: "float6_e2m3fn", kDLFloat6_e3m2fn: "float6_e3m2fn",
    kDLFloat4_e2m1fn: "float4_e2m1fn",
}
_DEVICE_NAMES = {
    kDLCPU: "kDLCPU", kDLCUDA: "kDLCUDA", kDLCUDAHost: "kDLCUDAHost", kDLOpenCL: "kDLOpenCL",
    kDLVulkan: "kDLVulkan", kDLMetal: "kDLMetal", kDLVPI: "kDLVPI", kDLROCM: "kDLROCM",
    kDLROCMHost: "kDLROCMHost", kDLExtDev: "kDLExtDev", kDLCUDAManaged: "kDLCUDAManaged",
    kDLOneAPI: "kDLOneAPI", kDLWebGPU: "kDLWebGPU", kDLHexagon: "kDLHexagon",
    kDLMAIA: "kDLMAIA",
}

# Non-NULL address for empty tensors whose producer passes data == NULL (NumPy would allocate
# for NULL). Never read or written.
cdef int64_t _empty_buffer[8]


cdef str _dtype_name(DLDataType c_dtype):
    if c_dtype.code == kDLBool and c_dtype.bits == 8:
        name = "bool"
    elif c_dtype.code in _SMALL_FLOAT_NAMES:
        name = _SMALL_FLOAT_NAMES[c_dtype.code]
    elif c_dtype.code in _DTYPE_CODE_NAMES:
        name = f"{_DTYPE_CODE_NAMES[c_dtype.code]}{c_dtype.bits}"
    else:
        name = f"(type code {c_dtype.code}, {c_dtype.bits} bits)"
    return name if c_dtype.lanes == 1 else f"{name}x{c_dtype.lanes}"


cdef str _device_name(DLDevice c_device):
    name = _DEVICE_NAMES.get(c_device.device_type, "unknown")
    return f"{name} (device_type={c_device.device_type}, device_id={c_device.device_id})"


# ---- import ------------------------------------------------------------------------------

cdef class DLPackOwner:
    """Owns a consumed DLPack tensor; the base of the array that from_dlpack returns.

    It calls the producer's deleter exactly once, when the last NumPy view of the
    memory is garbage-collected.

    Attributes:
        dlpack_dtype: the DLPack dtype, e.g. "float32"; "bfloat16" marks a uint16 array that
            holds bfloat16 bits.
        device: (device_type, device_id) as DLPack numbers them (kDLCPU is 1).
        versioned: the tensor came in a "dltensor_versioned" capsule (DLPack >= 1.0).
        read_only: the producer set DLPACK_FLAG_BITMASK_READ_ONLY.

    Example:
        >>> x = from_dlpack(torch.zeros(2, dtype=torch.bfloat16))
        >>> x.dtype, x.base.dlpack_dtype
        (dtype('uint16'), 'bfloat16')
    """

    cdef void* c_managed
    cdef bint c_versioned
    cdef bint c_read_only
    cdef DLDevice c_device
    cdef DLDataType c_dtype

    def __dealloc__(self):
        cdef DLManagedTensor* c_legacy
        cdef DLManagedTensorVersioned* c_versioned
        if self.c_managed == NULL:
            return
        # The producer's deleter runs with the GIL held, as NumPy and PyTorch call theirs.
        if self.c_versioned:
            c_versioned = <DLManagedTensorVersioned*>self.c_managed
            if c_versioned.deleter != NULL:
                c_versioned.deleter(c_versioned)
        else:
            c_legacy = <DLManagedTensor*>self.c_managed
            if c_legacy.deleter != NULL:
                c_legacy.deleter(c_legacy)
        self.c_managed = NULL

    @property
    def dlpack_dtype(self):
        return _dtype_name(self.c_dtype)

    @property
    def device(self):
        return (self.c_device.device_type, self.c_device.device_id)

    @property
    def versioned(self):
        return self.c_versioned

    @property
    def read_only(self):
        return self.c_read_only


cdef object _capsule_of(obj):
    """A DLPack capsule from obj: obj itself, or what its __dlpack__ returns."""
    if PyCapsule_CheckExact(obj):
        return obj
    export = getattr(obj, "__dlpack__", None)
    if export is None:
        raise errors.InvalidArgument(
            f"expected a DLPack capsule or an object with __dlpack__, got {type(obj).__name__}"
            " (MXNet 1.x: pass nd.to_dlpack_for_read(x) or nd.to_dlpack_for_write(x))")
    try:
        return export(max_version=(DLPACK_MAJOR_VERSION, 0))
    except TypeError:
        # Producers older than the array API 2023 standard (NumPy 1.26) take no max_version.
        return export()


def from_dlpack(obj, *, bint writable=False):
    """A NumPy array viewing the memory of a DLPack tensor, without a copy.

    The producer's deleter runs exactly once, when the array and every view of it are
    garbage-collected (the array's base is a DLPackOwner).

    Args:
        obj: a PyCapsule named "dltensor" or "dltensor_versioned" (it is renamed
            "used_dltensor" / "used_dltensor_versioned"), or any object with __dlpack__
            (called with max_version=(1, 0), or plainly if it does not take that).
        writable: False (default): the array is read-only, so nothing scribbles over a tensor
            its framework treats as immutable (TF, JAX, MXNet's to_dlpack_for_read).
            True: the array is writeable and writes show in the producer's tensor; refused
            if a versioned producer flagged the tensor read-only.

    Returns:
        numpy.ndarray of the tensor's shape, with its strides (a strided view for
        non-contiguous tensors). Dtypes: int8..64, uint8..64, float16/32/64, complex64/128,
        bool, and bfloat16 as uint16 holding the raw bits (base.dlpack_dtype == "bfloat16").

    Raises:
        kvsparse.errors.InvalidArgument: not a capsule nor a producer, a capsule already
            consumed or wrongly named, an unsupported DLPack major version, a device other
            than host memory (kDLCPU, kDLCUDAHost, kDLROCMHost), a negative dimension, or
            writable=True on a read-only tensor.
        kvsparse.errors.DTypeError: a dtype NumPy cannot view (float8, lanes > 1...).
        On an error the capsule is left unconsumed, so its producer still frees it.

    Example:
        >>> t = torch.zeros(2, 3)
        >>> rows = from_dlpack(t, writable=True)
        >>> rows[0, 0] = 1.0
        >>> float(t[0, 0])
        1.0
    """
    capsule = _capsule_of(obj)
    try:
        return _view_of_capsule(capsule, writable)
    except BaseException as exc:
        error = exc
    # A capsule from __dlpack__ dies here and its producer's destructor frees the tensor:
    # let that run before the error is raised, not while it propagates (a ctypes or Python
    # destructor fails when it starts with an exception set).
    del capsule
    raise error


cdef object _view_of_capsule(capsule, bint writable):
    cdef bint c_versioned
    cdef void* c_managed
    cdef DLTensor* c_tensor
    cdef DLManagedTensorVersioned* c_managed_versioned = NULL
    cdef bint c_read_only = False
    cdef int32_t i
    cdef int32_t c_ndim
    cdef int64_t c_itemsize
    cdef bint c_empty = False
    cdef char* c_data
    cdef vector[cnp.npy_intp] c_dims  # shape, then strides in bytes

    if PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        c_versioned = True
    elif PyCapsule_IsValid(capsule, b"dltensor"):
        c_versioned = False
    elif PyCapsule_IsValid(capsule, b"used_dltensor_versioned") or PyCapsule_IsValid(
            capsule, b"used_dltensor"):
        raise errors.InvalidArgument(
            "this DLPack capsule was already consumed (it is named 'used_...'); a capsule "
            "can be imported once, ask the producer for a new one")
    else:
        raise errors.InvalidArgument(
            f"not a DLPack capsule: expected the name 'dltensor' or 'dltensor_versioned', "
            f"got {capsule!r}")

    if c_versioned:
        c_managed = PyCapsule_GetPointer(capsule, b"dltensor_versioned")
        c_managed_versioned = <DLManagedTensorVersioned*>c_managed
        if c_managed_versioned.version.major != DLPACK_MAJOR_VERSION:
            raise errors.InvalidArgument(
                f"DLPack version {c_managed_versioned.version.major}."
                f"{c_managed_versioned.version.minor} is not supported "
                f"(kvsparse reads major version {DLPACK_MAJOR_VERSION})")
        c_tensor = &c_managed_versioned.dl_tensor
        c_read_only = (c_managed_versioned.flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0
    else:
        c_managed = PyCapsule_GetPointer(capsule, b"dltensor")
        c_tensor = &(<DLManagedTensor*>c_managed).dl_tensor

    # Host memory only: pinned CUDA/ROCm host memory is plain CPU memory (NumPy accepts it
    # too); device and managed memory may not be touched from here.
    if c_tensor.device.device_type not in (kDLCPU, kDLCUDAHost, kDLROCMHost):
        raise errors.InvalidArgument(
            f"kvsparse reads tensors in CPU memory only; this one is on "
            f"{_device_name(c_tensor.device)}: copy it to the CPU first (e.g. tensor.cpu())")
    if c_read_only and writable:
        raise errors.InvalidArgument(
            "writable=True, but the producer marked this DLPack tensor read-only "
            "(DLPACK_FLAG_BITMASK_READ_ONLY); copy it or import it with writable=False")
    descr = None
    if c_tensor.dtype.lanes == 1:
        descr = _NUMPY_DTYPE_OF_DLPACK.get(c_tensor.dtype.code << 8 | c_tensor.dtype.bits)
    if descr is None:
        raise errors.DTypeError(
            f"DLPack dtype {_dtype_name(c_tensor.dtype)} has no NumPy equivalent kvsparse "
            f"reads (int, uint, float16/32/64, bfloat16, complex, bool with one lane)")
    c_ndim = c_tensor.ndim
    if c_ndim < 0 or c_ndim > cnp.NPY_MAXDIMS:
        raise errors.InvalidArgument(
            f"DLPack tensor with {c_ndim} dimensions; NumPy takes 0 to {cnp.NPY_MAXDIMS}")
    c_itemsize = c_tensor.dtype.bits // 8
    c_dims.resize(2 * c_ndim)
    for i in range(c_ndim):
        if c_tensor.shape[i] < 0:
            raise errors.InvalidArgument(
                f"DLPack tensor with a negative dimension: "
                f"{[c_tensor.shape[i] for i in range(c_ndim)]}")
        c_empty = c_empty or c_tensor.shape[i] == 0
        c_dims[i] = c_tensor.shape[i]
        if c_tensor.strides != NULL:
            c_dims[c_ndim + i] = c_tensor.strides[i] * c_itemsize
    c_data = <char*>c_tensor.data
    if c_data == NULL:
        if not c_empty:
            raise errors.InvalidArgument("DLPack tensor with elements but a NULL data pointer")
        c_data = <char*>_empty_buffer
    else:
        c_data += c_tensor.byte_offset

    cdef DLPackOwner owner = DLPackOwner.__new__(DLPackOwner)
    owner.c_versioned = c_versioned
    owner.c_read_only = c_read_only
    owner.c_device = c_tensor.device
    owner.c_dtype = c_tensor.dtype
    # Consume: from here on the owner, not the capsule, releases the tensor (also if the
    # array below cannot be made: the owner dies with the exception).
    PyCapsule_SetName(capsule, b"used_dltensor_versioned" if c_versioned else b"used_dltensor")
    owner.c_managed = c_managed

    Py_INCREF(descr)  # PyArray_NewFromDescr steals it
    cdef cnp.ndarray array = PyArray_NewFromDescr(
        &PyArray_Type, <cnp.PyArray_Descr*>descr, c_ndim, c_dims.data(),
        c_dims.data() + c_ndim if c_tensor.strides != NULL else NULL,  # NULL: row-major
        c_data, cnp.NPY_ARRAY_WRITEABLE if writable else 0, NULL)
    cnp.set_array_base(array, owner)
    return array


# ---- export ------------------------------------------------------------------------------

# One malloc per export: the managed tensor, then shape and strides (2 * ndim int64).
# manager_ctx holds a strong reference to the NumPy array.

cdef void _release_array(void* c_array) noexcept nogil:
    # Consumers may call the deleter from any thread, without the GIL. During interpreter
    # shutdown the GIL cannot be taken safely (a thread would hang): leak the reference.
    if c_array == NULL or kvsparse_python_is_shutting_down():
        return
    cdef PyObject* c_type
    cdef PyObject* c_value
    cdef PyObject* c_traceback
    with gil:
        # A capsule may die while an exception propagates; keep that exception intact.
        PyErr_Fetch(&c_type, &c_value, &c_traceback)
        Py_XDECREF(<PyObject*>c_array)
        PyErr_Restore(c_type, c_value, c_traceback)


cdef void _delete_legacy(DLManagedTensor* c_self) noexcept nogil:
    _release_array(c_self.manager_ctx)
    free(c_self)


cdef void _delete_versioned(DLManagedTensorVersioned* c_self) noexcept nogil:
    _release_array(c_self.manager_ctx)
    free(c_self)


cdef void _legacy_capsule_destructor(object capsule) noexcept:
    # A consumer renames the capsule to "used_dltensor" and calls the deleter itself.
    if not PyCapsule_IsValid(capsule, b"dltensor"):
        return
    cdef DLManagedTensor* c_managed = <DLManagedTensor*>PyCapsule_GetPointer(
        capsule, b"dltensor")
    c_managed.deleter(c_managed)


cdef void _versioned_capsule_destructor(object capsule) noexcept:
    if not PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        return
    cdef DLManagedTensorVersioned* c_managed = <DLManagedTensorVersioned*>PyCapsule_GetPointer(
        capsule, b"dltensor_versioned")
    c_managed.deleter(c_managed)


cdef int _fill_tensor(DLTensor* c_tensor, cnp.ndarray array, int64_t* c_dims) except -1:
    """Describes array in c_tensor; c_dims has room for 2 * ndim entries."""
    cdef int32_t i
    cdef int32_t c_ndim = cnp.PyArray_NDIM(array)
    cdef int64_t c_itemsize = cnp.PyArray_ITEMSIZE(array)
    cdef int64_t c_stride = 1
    c_tensor.data = cnp.PyArray_DATA(array)
    c_tensor.device.device_type = kDLCPU
    c_tensor.device.device_id = 0
    c_tensor.ndim = c_ndim
    c_tensor.dtype = _dlpack_dtype_of(array)
    c_tensor.shape = c_dims
    c_tensor.strides = c_dims + c_ndim
    c_tensor.byte_offset = 0
    for i in range(c_ndim):
        c_dims[i] = cnp.PyArray_DIMS(array)[i]
    if cnp.PyArray_IS_C_CONTIGUOUS(array):
        # NumPy gives dims of extent 0 or 1 any stride (np.zeros((0, 3)) has strides (0, 0));
        # MXNet 1.9 accepts exactly stride[i] == product of shape[i+1:], even for those.
        for i in range(c_ndim - 1, -1, -1):
            c_dims[c_ndim + i] = c_stride
            c_stride *= c_dims[i]
    else:
        for i in range(c_ndim):
            c_dims[c_ndim + i] = cnp.PyArray_STRIDES(array)[i] // c_itemsize
    return 0


cdef DLDataType _dlpack_dtype_of(cnp.ndarray array) except *:
    cdef DLDataType c_dtype
    cdef char c_kind = array.descr.kind
    c_dtype.lanes = 1
    c_dtype.bits = cnp.PyArray_ITEMSIZE(array) * 8
    if c_kind == b"i" or c_kind == b"u":
        c_dtype.code = kDLInt if c_kind == b"i" else kDLUInt
        if c_dtype.bits in (8, 16, 32, 64):
            return c_dtype
    elif c_kind == b"f":
        c_dtype.code = kDLFloat
        if c_dtype.bits in (16, 32, 64):
            return c_dtype
    elif c_kind == b"c":
        c_dtype.code = kDLComplex
        if c_dtype.bits in (64, 128):
            return c_dtype
    elif c_kind == b"b":
        c_dtype.code = kDLBool
        return c_dtype
    elif c_kind == b"V" and c_dtype.bits == 16 and array.dtype.name == "bfloat16":
        c_dtype.code = kDLBfloat  # ml_dtypes.bfloat16, a user-defined NumPy dtype
        return c_dtype
    raise errors.DTypeError(f"cannot export dtype {array.dtype} through DLPack")


cdef cnp.ndarray _check_exportable(array, bint allow_read_only):
    if not isinstance(array, np.ndarray):
        raise errors.InvalidArgument(
            f"to_dlpack exports NumPy arrays, got {type(array).__name__}")
    cdef cnp.ndarray c_array = array
    cdef int32_t i
    cdef cnp.npy_intp c_itemsize = cnp.PyArray_ITEMSIZE(c_array)
    if cnp.PyArray_ISBYTESWAPPED(c_array):
        raise errors.DTypeError(f"cannot export non-native byte order {array.dtype}")
    _dlpack_dtype_of(c_array)
    for i in range(cnp.PyArray_NDIM(c_array)):
        if cnp.PyArray_STRIDES(c_array)[i] % c_itemsize:
            raise errors.InvalidArgument(
                f"strides {array.strides} are not multiples of the item size "
                f"{c_itemsize}; DLPack counts strides in elements")
    if not allow_read_only and not cnp.PyArray_ISWRITEABLE(c_array):
        raise errors.InvalidArgument(
            "a legacy 'dltensor' capsule cannot mark an array read-only; export a writeable "
            "array, a copy, or use DLPackExporter with a consumer that asks for DLPack 1.x")
    return c_array


cdef object _export_legacy(cnp.ndarray array):
    cdef size_t c_bytes = sizeof(DLManagedTensor) + 2 * cnp.PyArray_NDIM(array) * sizeof(int64_t)
    cdef DLManagedTensor* c_managed = <DLManagedTensor*>malloc(c_bytes)
    if c_managed == NULL:
        raise MemoryError()
    try:
        _fill_tensor(&c_managed.dl_tensor, array, <int64_t*>(c_managed + 1))
        c_managed.manager_ctx = NULL
        c_managed.deleter = _delete_legacy
        capsule = PyCapsule_New(c_managed, b"dltensor",
                                <PyCapsule_Destructor>_legacy_capsule_destructor)
    except BaseException:
        free(c_managed)
        raise
    # Only now does the capsule own the struct, and its deleter the reference.
    Py_INCREF(array)
    c_managed.manager_ctx = <void*>array
    return capsule


cdef object _export_versioned(cnp.ndarray array, uint32_t c_minor, bint copied):
    cdef size_t c_bytes = (sizeof(DLManagedTensorVersioned)
                           + 2 * cnp.PyArray_NDIM(array) * sizeof(int64_t))
    cdef DLManagedTensorVersioned* c_managed = <DLManagedTensorVersioned*>malloc(c_bytes)
    if c_managed == NULL:
        raise MemoryError()
    try:
        _fill_tensor(&c_managed.dl_tensor, array, <int64_t*>(c_managed + 1))
        c_managed.version.major = DLPACK_MAJOR_VERSION
        c_managed.version.minor = c_minor
        c_managed.flags = 0 if cnp.PyArray_ISWRITEABLE(array) else DLPACK_FLAG_BITMASK_READ_ONLY
        if copied:
            c_managed.flags |= DLPACK_FLAG_BITMASK_IS_COPIED
        c_managed.manager_ctx = NULL
        c_managed.deleter = _delete_versioned
        capsule = PyCapsule_New(c_managed, b"dltensor_versioned",
                                <PyCapsule_Destructor>_versioned_capsule_destructor)
    except BaseException:
        free(c_managed)
        raise
    Py_INCREF(array)
    c_managed.manager_ctx = <void*>array
    return capsule


def to_dlpack(array):
    """A legacy "dltensor" capsule exporting a NumPy array without a copy.

    The capsule's managed tensor keeps the array alive until the consumer calls its deleter
    (when the consumer's tensor dies); a capsule nobody consumed frees itself.

    Args:
        array: a writeable numpy.ndarray in native byte order, of dtype int8..64,
            uint8..64, float16/32/64, complex64/128, bool or ml_dtypes.bfloat16, any strides
            that are multiples of the item size.

    Returns:
        A PyCapsule named "dltensor" for torch.utils.dlpack.from_dlpack,
        tf.experimental.dlpack.from_dlpack or mx.nd.from_dlpack. JAX and NumPy take objects
        with __dlpack__ instead: pass them DLPackExporter(array).

    Raises:
        kvsparse.errors.InvalidArgument: not an ndarray, a read-only array (a legacy
            capsule cannot say read-only), or strides that are not whole elements.
        kvsparse.errors.DTypeError: a dtype DLPack cannot carry (object, str, datetime...).

    Example:
        >>> rows = np.zeros((2, 4), np.float32)
        >>> t = torch.utils.dlpack.from_dlpack(to_dlpack(rows))
        >>> t[0, 0] = 1.0; rows[0, 0]
        1.0
    """
    return _export_legacy(_check_exportable(array, False))


cdef class DLPackExporter:
    """Wraps a NumPy array in the __dlpack__ protocol, for consumers that take no capsule.

    jax.dlpack.from_dlpack, np.from_dlpack and torch.from_dlpack call __dlpack__; torch
    asks for max_version=(1, 0) and gets a "dltensor_versioned" capsule, which can also say
    read-only, so read-only arrays export this way (to consumers that accept that flag).

    Args:
        array: a numpy.ndarray, as for to_dlpack (but it may be read-only).

    Raises:
        kvsparse.errors.InvalidArgument, kvsparse.errors.DTypeError: as to_dlpack.

    Example:
        >>> rows = np.zeros((2, 4), np.float32)
        >>> y = jax.dlpack.from_dlpack(DLPackExporter(rows))  # shares rows' memory
    """

    cdef readonly object array

    def __init__(self, array):
        self.array = _check_exportable(array, True)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A capsule of the array: "dltensor_versioned" if max_version >= (1, 0).

        stream is ignored (CPU memory needs no synchronization); dl_device must be the CPU;
        copy=True exports a copy, False and None export the array itself.
        """
        if dl_device is not None and tuple(dl_device) != (kDLCPU, 0):
            raise BufferError(f"kvsparse exports CPU arrays only, dl_device={dl_device!r}")
        array = self.array.copy() if copy else self.array
        if max_version is None or max_version[0] < DLPACK_MAJOR_VERSION:
            return _export_legacy(_check_exportable(array, False))
        minor = DLPACK_MINOR_VERSION
        if max_version[0] == DLPACK_MAJOR_VERSION:
            minor = min(minor, max_version[1])
        return _export_versioned(array, minor, bool(copy))

    def __dlpack_device__(self):
        return (kDLCPU, 0)
