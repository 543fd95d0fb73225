"""kvsparse._core's DLPack module: zero-copy import and export with every framework.

Zero-copy is proven by data-pointer equality and, where the framework's tensors are
mutable (NumPy, PyTorch, MXNet), by a write through one side read on the other.
DLPack producers that frameworks do not offer (non-CPU devices, the read-only flag,
odd dtypes, a counting deleter) are built by hand with ctypes (FakeTensor).
"""

import ctypes
import gc
import os
import threading
import weakref

import numpy as np
import pytest

from kvsparse import _core, errors

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# ---- DLPack structs through ctypes (dlpack.h 1.1) --------------------------------------

kDLCPU, kDLCUDA, kDLCUDAHost = 1, 2, 3
kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLComplex, kDLBool = 0, 1, 2, 4, 5, 6
kDLFloat8_e4m3fn = 10
READ_ONLY, IS_COPIED = 1, 2

# The capsule keeps the char* of its name: these objects live as long as the module.
LEGACY = b"dltensor"
VERSIONED = b"dltensor_versioned"
USED_LEGACY = b"used_dltensor"


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


# CFUNCTYPE: calling one of these releases the GIL, as a C consumer would.
DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", DELETER),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


# A handle of our own: ctypes.pythonapi's function objects are shared, and MXNet sets
# their argtypes for its own use.
_api = ctypes.PyDLL(None)
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_GetName.restype = ctypes.c_char_p
_api.PyCapsule_GetName.argtypes = [ctypes.py_object]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
# The destructor sees a capsule whose refcount is 0: pass it on as a raw pointer.
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]


def capsule_name(capsule):
    return _api.PyCapsule_GetName(capsule).decode()


def managed_of(capsule):
    """The (unconsumed) capsule's DLManagedTensor or DLManagedTensorVersioned, by ctypes."""
    name = _api.PyCapsule_GetName(capsule)
    address = _api.PyCapsule_GetPointer(capsule, name)
    struct = DLManagedTensorVersioned if name == VERSIONED else DLManagedTensor
    return struct.from_address(address)


def capsule_data_pointer(capsule):
    tensor = managed_of(capsule).dl_tensor
    return (tensor.data or 0) + tensor.byte_offset


_producers = []  # FakeTensors outlive their capsules, whose destructors call into them


class FakeTensor:
    """A DLPack producer built with ctypes over a NumPy array; counts deleter calls.

    Its capsule's destructor calls the deleter unless a consumer renamed the capsule,
    as real producers do.
    """

    def __init__(
        self,
        array,
        *,
        versioned=False,
        device=(kDLCPU, 0),
        flags=0,
        version=(1, 0),
        dtype=None,
        strides=True,
        byte_offset=0,
        data=None,
    ):
        self.array = array
        self.deleted = 0
        self.versioned = versioned
        ndim = array.ndim
        self._shape = (ctypes.c_int64 * max(ndim, 1))(*array.shape)
        self._strides = (ctypes.c_int64 * max(ndim, 1))(
            *[s // array.itemsize for s in array.strides]
        )
        self.managed = DLManagedTensorVersioned() if versioned else DLManagedTensor()
        tensor = self.managed.dl_tensor
        tensor.data = array.ctypes.data - byte_offset if data is None else data
        tensor.byte_offset = byte_offset
        tensor.device = DLDevice(*device)
        tensor.ndim = ndim
        if dtype is None:
            dtype = (_DLPACK_CODE_OF_KIND[array.dtype.kind], array.itemsize * 8, 1)
        tensor.dtype = DLDataType(*dtype)
        tensor.shape = self._shape
        tensor.strides = self._strides if strides else None
        if versioned:
            self.managed.version = DLPackVersion(*version)
            self.managed.flags = flags
        self._deleter = DELETER(self._on_delete)
        self.managed.deleter = self._deleter
        self._destructor = CAPSULE_DESTRUCTOR(self._on_capsule_destroyed)
        _producers.append(self)

    def _on_delete(self, address):
        if address == ctypes.addressof(self.managed):
            self.deleted += 1

    def _on_capsule_destroyed(self, capsule_address):
        if _api.PyCapsule_IsValid(capsule_address, VERSIONED if self.versioned else LEGACY):
            self._on_delete(ctypes.addressof(self.managed))

    def capsule(self):
        return _api.PyCapsule_New(
            ctypes.addressof(self.managed),
            VERSIONED if self.versioned else LEGACY,
            ctypes.cast(self._destructor, ctypes.c_void_p),
        )


_DLPACK_CODE_OF_KIND = {"i": kDLInt, "u": kDLUInt, "f": kDLFloat, "c": kDLComplex, "b": kDLBool}


def collect():
    gc.collect()
    gc.collect()


def aligned_empty(shape, dtype, alignment=64):
    """An uninitialized array whose data address is a multiple of alignment."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


# ---- frameworks --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tf():
    return pytest.importorskip("tensorflow")


@pytest.fixture(scope="module")
def jax():
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax.dlpack")
    return jax


@pytest.fixture(scope="module")
def mx():
    if "bool" not in vars(np):  # hasattr would warn: NumPy 1.26 reserves the name
        np.bool = bool  # MXNet 1.9.1 still reads np.bool, gone since NumPy 1.24
    return pytest.importorskip("mxnet")


ALL_DTYPES = [
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", "bool",
]  # fmt: skip


def sample(shape, dtype):
    values = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) % 7
    return (values % 2).astype(dtype) if dtype == "bool" else values.astype(dtype)


# ---- NumPy ------------------------------------------------------------------------------


def test_numpy_to_kvsparse_zero_copy_and_write_through():
    source = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = _core.from_dlpack(source, writable=True)  # NumPy 1.26: __dlpack__ without max_version
    assert view.ctypes.data == source.ctypes.data
    assert view.shape == (3, 4) and view.dtype == np.float32
    assert isinstance(view.base, _core.DLPackOwner) and not view.base.versioned
    view[1, 2] = -5.0
    assert source[1, 2] == -5.0
    source[0, 0] = 9.0
    assert view[0, 0] == 9.0


def test_kvsparse_to_numpy_zero_copy_and_write_through():
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    imported = np.from_dlpack(_core.DLPackExporter(rows))
    assert imported.__array_interface__["data"][0] == rows.ctypes.data
    rows[0, 0] = -1.0  # NumPy 1.26's from_dlpack always returns a read-only array
    assert imported[0, 0] == -1.0


def test_default_view_is_read_only_and_writable_true_gives_a_writeable_one():
    source = np.zeros(3, np.float32)
    read_view = _core.from_dlpack(source)
    assert not read_view.flags.writeable
    with pytest.raises(ValueError):
        read_view[0] = 1.0
    assert _core.from_dlpack(source, writable=True).flags.writeable


# ---- PyTorch ----------------------------------------------------------------------------


def test_torch_to_kvsparse_versioned_zero_copy_and_write_through(torch):
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = _core.from_dlpack(tensor, writable=True)  # __dlpack__(max_version=(1, 0))
    assert view.base.versioned  # torch 2.13 answers max_version with dltensor_versioned
    assert view.ctypes.data == tensor.data_ptr()
    np.testing.assert_array_equal(view, tensor.numpy())
    view[2, 3] = 100.0
    assert tensor[2, 3].item() == 100.0
    tensor[0, 1] = -7.0
    assert view[0, 1] == -7.0


def test_torch_legacy_capsule_is_consumed_and_renamed(torch):
    tensor = torch.arange(5, dtype=torch.int64)
    capsule = torch.utils.dlpack.to_dlpack(tensor)
    assert capsule_name(capsule) == "dltensor"
    view = _core.from_dlpack(capsule, writable=True)
    assert capsule_name(capsule) == "used_dltensor"
    assert view.ctypes.data == tensor.data_ptr() and not view.base.versioned
    view[4] = 40
    assert tensor[4].item() == 40


def test_kvsparse_to_torch_zero_copy_and_write_through(torch):
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    capsule = _core.to_dlpack(rows)
    tensor = torch.utils.dlpack.from_dlpack(capsule)
    assert capsule_name(capsule) == "used_dltensor"
    assert tensor.data_ptr() == rows.ctypes.data
    tensor[1, 3] = 55.0
    assert rows[1, 3] == 55.0
    rows[0, 0] = -3.0
    assert tensor[0, 0].item() == -3.0


def test_torch_from_dlpack_takes_the_exporter_as_versioned(torch):
    rows = np.arange(4, dtype=np.float64)
    exporter = _core.DLPackExporter(rows)
    tensor = torch.from_dlpack(exporter)
    assert tensor.data_ptr() == rows.ctypes.data and tensor.dtype == torch.float64
    tensor[0] = 8.0
    assert rows[0] == 8.0


def test_torch_lifetime_capsule_keeps_memory_after_the_tensor_dies(torch):
    tensor = torch.arange(1000, dtype=torch.float32)
    view = _core.from_dlpack(tensor)
    del tensor
    collect()
    np.testing.assert_array_equal(view, np.arange(1000, dtype=np.float32))


# A framework's importer of a capsule, by the fixture that imports the framework.
ADOPT = {
    "torch": lambda torch, capsule: torch.utils.dlpack.from_dlpack(capsule),
    "tf": lambda tf, capsule: tf.experimental.dlpack.from_dlpack(capsule),
}


@pytest.mark.parametrize("framework", sorted(ADOPT))
def test_exported_array_lives_until_the_framework_releases_it(framework, request):
    module = request.getfixturevalue(framework)
    rows = np.ones((4, 2), np.float32)
    alive = weakref.ref(rows)
    tensor = ADOPT[framework](module, _core.to_dlpack(rows))
    del rows
    collect()
    assert alive() is not None
    del tensor
    collect()
    assert alive() is None


# ---- TensorFlow (immutable tensors: pointer equality only) --------------------------------


def test_tf_to_kvsparse_zero_copy(tf):
    tensor = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3))
    expected_pointer = capsule_data_pointer(tf.experimental.dlpack.to_dlpack(tensor))
    from_capsule = _core.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))
    from_tensor = _core.from_dlpack(tensor)  # TF 2.21 EagerTensor has __dlpack__ (legacy)
    assert from_capsule.ctypes.data == expected_pointer == from_tensor.ctypes.data
    np.testing.assert_array_equal(from_capsule, tensor.numpy())
    assert not from_capsule.flags.writeable


def test_kvsparse_to_tf_zero_copy(tf):
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensor = tf.experimental.dlpack.from_dlpack(_core.to_dlpack(rows))
    np.testing.assert_array_equal(tensor.numpy(), rows)
    round_trip = _core.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))
    assert round_trip.ctypes.data == rows.ctypes.data


# ---- MXNet ------------------------------------------------------------------------------


def test_mxnet_to_kvsparse_zero_copy_and_write_through(mx):
    array = mx.nd.array(np.arange(6, dtype=np.float32).reshape(2, 3))
    view = _core.from_dlpack(mx.nd.to_dlpack_for_write(array), writable=True)
    read_view = _core.from_dlpack(mx.nd.to_dlpack_for_read(array))
    assert view.ctypes.data == read_view.ctypes.data
    view[1, 2] = 77.0
    assert array.asnumpy()[1, 2] == 77.0
    array[0, 0] = -4.0
    mx.nd.waitall()
    assert view[0, 0] == -4.0


def test_kvsparse_to_mxnet_zero_copy_and_write_through(mx):
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    array = mx.nd.from_dlpack(_core.to_dlpack(rows))
    assert _core.from_dlpack(mx.nd.to_dlpack_for_read(array)).ctypes.data == rows.ctypes.data
    rows[2, 1] = 12.5
    assert array.asnumpy()[2, 1] == 12.5
    array[:] = 3.0  # an in-place MXNet write, run by its engine
    mx.nd.waitall()
    assert (rows == 3.0).all()


def test_exported_array_lives_until_mxnet_releases_it(mx):
    rows = np.ones(8, np.float32)
    alive = weakref.ref(rows)
    array = mx.nd.from_dlpack(_core.to_dlpack(rows))
    del rows
    collect()
    assert alive() is not None
    del array
    mx.nd.waitall()
    collect()
    assert alive() is None


# ---- JAX (immutable arrays: pointer equality only) -----------------------------------------


def test_jax_to_kvsparse_zero_copy(jax):
    array = jax.numpy.arange(12, dtype=jax.numpy.float32).reshape(3, 4)
    view = _core.from_dlpack(array)  # jax 0.7 ignores max_version: a legacy capsule
    assert view.ctypes.data == array.unsafe_buffer_pointer()
    np.testing.assert_array_equal(view, np.asarray(array))
    assert not view.flags.writeable


def test_kvsparse_to_jax_zero_copy(jax):
    # jax 0.7 copies (and logs "DLPack buffer is not aligned") below 64-byte alignment.
    rows = aligned_empty((4, 8), np.float32)
    rows[:] = np.arange(32, dtype=np.float32).reshape(4, 8)
    array = jax.dlpack.from_dlpack(_core.DLPackExporter(rows))
    assert array.unsafe_buffer_pointer() == rows.ctypes.data
    np.testing.assert_array_equal(np.asarray(array), rows)


# ---- shapes: 0-d, empty, 2-D, non-contiguous ------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda t: t.tensor(3.5), id="0-d"),
        pytest.param(lambda t: t.zeros(0), id="empty-1d"),
        pytest.param(lambda t: t.zeros(0, 3), id="empty-2d"),
        pytest.param(lambda t: t.zeros(4, 0, 2), id="empty-middle"),
        pytest.param(lambda t: t.arange(12.0).reshape(3, 4), id="2-D"),
        pytest.param(lambda t: t.arange(12.0).reshape(3, 4).t(), id="transposed"),
        pytest.param(lambda t: t.arange(24.0).reshape(4, 6)[::2, 1::3], id="sliced"),
        pytest.param(lambda t: t.arange(6.0).reshape(1, 6, 1)[:, 2:], id="offset"),
        pytest.param(lambda t: t.arange(5.0).expand(3, 5), id="zero-stride"),
    ],
)
def test_torch_shapes_and_strides_are_honoured(torch, make):
    tensor = make(torch)
    view = _core.from_dlpack(tensor)
    assert view.shape == tuple(tensor.shape)
    assert view.size == tensor.numel()
    np.testing.assert_array_equal(view, tensor.numpy())
    if tensor.numel():
        assert view.ctypes.data == tensor.data_ptr()
        itemsize = tensor.element_size()
        assert view.strides == tuple(s * itemsize for s in tensor.stride())


def test_transposed_torch_tensor_is_a_strided_writeable_view(torch):
    tensor = torch.zeros(3, 4)
    transposed = tensor.t()
    view = _core.from_dlpack(transposed, writable=True)
    assert not view.flags.c_contiguous and view.strides == (4, 16)
    view[3, 1] = 1.0
    assert tensor[1, 3].item() == 1.0


@pytest.mark.parametrize(
    "array",
    [
        pytest.param(np.array(2.5, np.float32), id="0-d"),
        pytest.param(np.zeros((0, 3), np.float32), id="empty"),
        pytest.param(np.arange(12, dtype=np.float32).reshape(3, 4), id="2-D"),
        pytest.param(np.arange(12, dtype=np.float32).reshape(3, 4).T, id="transposed"),
        pytest.param(np.arange(20, dtype=np.int64).reshape(4, 5)[1:, ::2], id="sliced"),
    ],
)
def test_export_round_trip_shapes(torch, array):
    back = _core.from_dlpack(_core.to_dlpack(array))
    assert back.shape == array.shape
    if array.size:  # empty arrays are exported with row-major strides, see the MXNet test
        assert back.strides == array.strides
    np.testing.assert_array_equal(back, array)
    tensor = torch.utils.dlpack.from_dlpack(_core.to_dlpack(array))
    np.testing.assert_array_equal(tensor.numpy(), array)
    if array.size:
        assert back.ctypes.data == array.ctypes.data == tensor.data_ptr()


@pytest.mark.parametrize("shape", [(0,), (0, 3), (2, 0, 3), ()])
def test_empty_and_0d_exports_are_taken_by_tf_and_mxnet(tf, mx, shape):
    # NumPy gives empty arrays strides like (0, 0); MXNet accepts only row-major strides.
    array = np.zeros(shape, np.float32)
    assert tf.experimental.dlpack.from_dlpack(_core.to_dlpack(array)).shape == shape
    assert mx.nd.from_dlpack(_core.to_dlpack(array)).shape == shape


def test_null_strides_mean_row_major_and_byte_offset_is_applied():
    base = np.arange(10, dtype=np.int32)
    producer = FakeTensor(base[2:8].reshape(2, 3), strides=False, byte_offset=8)
    view = _core.from_dlpack(producer.capsule())
    assert view.strides == (12, 4)
    assert view.ctypes.data == base.ctypes.data + 8
    np.testing.assert_array_equal(view, [[2, 3, 4], [5, 6, 7]])


def test_empty_tensor_with_null_data_pointer():
    producer = FakeTensor(np.zeros((0, 4), np.float32), data=0)
    view = _core.from_dlpack(producer.capsule())
    assert view.shape == (0, 4) and view.size == 0
    del view
    collect()
    assert producer.deleted == 1


def test_null_data_pointer_with_elements_is_refused():
    producer = FakeTensor(np.zeros(3, np.float32), data=0)
    # Held in a name: a ctypes capsule destructor cannot run while an exception propagates.
    capsule = producer.capsule()
    with pytest.raises(errors.InvalidArgument, match="NULL data pointer"):
        _core.from_dlpack(capsule)
    del capsule
    collect()
    assert producer.deleted == 1


def test_more_dimensions_than_numpy_takes_are_refused_before_consuming():
    producer = FakeTensor(np.zeros((1,) * 20, np.float32).reshape((1,) * 20))
    producer.managed.dl_tensor.ndim = 65  # past NPY_MAXDIMS (32 in NumPy 1.x, 64 in 2.x)
    producer._shape = (ctypes.c_int64 * 65)(*([1] * 65))
    producer.managed.dl_tensor.shape = producer._shape
    producer.managed.dl_tensor.strides = None
    capsule = producer.capsule()
    with pytest.raises(errors.InvalidArgument, match="65 dimensions"):
        _core.from_dlpack(capsule)
    assert capsule_name(capsule) == "dltensor"


# ---- dtypes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_dtype_round_trips_through_kvsparse(dtype):
    array = sample((3, 2), dtype)
    view = _core.from_dlpack(_core.to_dlpack(array))
    assert view.dtype == array.dtype and view.base.dlpack_dtype == dtype
    assert view.ctypes.data == array.ctypes.data
    np.testing.assert_array_equal(view, array)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_dtype_from_a_hand_built_producer(dtype):
    array = sample((2, 3), dtype)
    producer = FakeTensor(array, versioned=True)
    view = _core.from_dlpack(producer.capsule())
    assert view.dtype == array.dtype
    np.testing.assert_array_equal(view, array)


@pytest.mark.parametrize("dtype", ALL_DTYPES + ["bfloat16"])
def test_every_dtype_both_ways_with_torch(torch, dtype):
    torch_dtype = getattr(torch, dtype)
    tensor = torch.arange(6).reshape(2, 3).to(torch_dtype)
    view = _core.from_dlpack(tensor)
    assert view.ctypes.data == tensor.data_ptr()
    if dtype == "bfloat16":  # no NumPy bfloat16: the raw bits as uint16, marked by the owner
        assert view.dtype == np.uint16 and view.base.dlpack_dtype == "bfloat16"
        bits = tensor.view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(view, bits)
    else:
        np.testing.assert_array_equal(view, tensor.numpy())
        array = sample((3, 2), dtype)
        back = torch.utils.dlpack.from_dlpack(_core.to_dlpack(array))
        assert back.dtype == torch_dtype and back.data_ptr() == array.ctypes.data


def test_ml_dtypes_bfloat16_exports_as_dlpack_bfloat16(torch):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    array = np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16)
    tensor = torch.utils.dlpack.from_dlpack(_core.to_dlpack(array))
    assert tensor.dtype == torch.bfloat16 and tensor.data_ptr() == array.ctypes.data
    assert tensor.tolist() == [1.5, -2.0, 3.25]


@pytest.mark.parametrize("dtype", ["int32", "int64", "float16", "float32", "float64", "uint8"])
def test_dtypes_with_tf_mxnet_and_jax(tf, mx, jax, dtype):
    array = sample((2, 3), dtype)
    assert tf.experimental.dlpack.from_dlpack(_core.to_dlpack(array)).dtype.name == dtype
    assert mx.nd.from_dlpack(_core.to_dlpack(array)).dtype == np.dtype(dtype)
    tf_view = _core.from_dlpack(tf.constant(array))
    assert tf_view.dtype == array.dtype
    jax_view = _core.from_dlpack(jax.numpy.asarray(array))
    assert jax_view.dtype == jax.numpy.asarray(array).dtype  # float64 -> float32 without x64


@pytest.mark.parametrize(
    "dtype,what",
    [
        ((kDLFloat8_e4m3fn, 8, 1), "float8_e4m3fn"),
        ((kDLFloat, 32, 4), "float32x4"),
        ((kDLInt, 24, 1), "int24"),
        ((kDLBfloat, 32, 1), "bfloat32"),
    ],
)
def test_unsupported_dtype_is_refused_and_not_consumed(dtype, what):
    producer = FakeTensor(np.zeros(4, np.float32), dtype=dtype)
    capsule = producer.capsule()
    with pytest.raises(errors.DTypeError, match=what):
        _core.from_dlpack(capsule)
    assert capsule_name(capsule) == "dltensor"
    del capsule
    collect()
    assert producer.deleted == 1  # the producer's capsule destructor freed it


@pytest.mark.parametrize(
    "array,error",
    [
        (np.array(["a"]), errors.DTypeError),
        (np.array([object()]), errors.DTypeError),
        (np.zeros(2, ">f4"), errors.DTypeError),
        (np.zeros(3, "datetime64[s]"), errors.DTypeError),
        ([1.0, 2.0], errors.InvalidArgument),
    ],
)
def test_to_dlpack_refuses_what_dlpack_cannot_carry(array, error):
    with pytest.raises(error):
        _core.to_dlpack(array)


def test_to_dlpack_refuses_strides_that_are_not_whole_elements():
    packed = np.zeros(4, dtype=[("a", np.int8), ("b", np.int32)])
    with pytest.raises(errors.InvalidArgument, match="multiples of the item size"):
        _core.to_dlpack(packed["b"])


# ---- read-only --------------------------------------------------------------------------


def test_versioned_read_only_flag_gives_a_read_only_array():
    producer = FakeTensor(np.arange(4, dtype=np.int64), versioned=True, flags=READ_ONLY)
    view = _core.from_dlpack(producer.capsule())
    assert not view.flags.writeable and view.base.read_only and view.base.versioned
    np.testing.assert_array_equal(view, [0, 1, 2, 3])


def test_writable_true_on_a_read_only_tensor_raises_and_leaves_the_capsule():
    producer = FakeTensor(np.zeros(4, np.float32), versioned=True, flags=READ_ONLY)
    capsule = producer.capsule()
    with pytest.raises(errors.InvalidArgument, match="read-only"):
        _core.from_dlpack(capsule, writable=True)
    assert capsule_name(capsule) == "dltensor_versioned"
    view = _core.from_dlpack(capsule)  # still importable read-only
    assert not view.flags.writeable


def test_read_only_numpy_array_exports_versioned_with_the_flag(torch):
    rows = np.arange(3, dtype=np.float32)
    rows.flags.writeable = False
    exporter = _core.DLPackExporter(rows)
    capsule = exporter.__dlpack__(max_version=(1, 0))
    assert capsule_name(capsule) == "dltensor_versioned"
    assert managed_of(capsule).flags & READ_ONLY
    view = _core.from_dlpack(exporter)
    assert view.base.read_only and not view.flags.writeable
    assert view.ctypes.data == rows.ctypes.data
    with pytest.raises(errors.InvalidArgument, match="read-only"):
        _core.from_dlpack(exporter, writable=True)
    with pytest.raises(errors.InvalidArgument, match="read-only"):
        _core.to_dlpack(rows)  # a legacy capsule cannot say read-only
    with pytest.raises(errors.InvalidArgument, match="read-only"):
        exporter.__dlpack__()


# ---- capsules: names, reuse, versions, devices --------------------------------------------


def test_a_consumed_capsule_cannot_be_imported_again(torch):
    capsule = torch.utils.dlpack.to_dlpack(torch.zeros(3))
    _core.from_dlpack(capsule)
    assert capsule_name(capsule) == "used_dltensor"
    with pytest.raises(errors.InvalidArgument, match="already consumed"):
        _core.from_dlpack(capsule)


def test_a_consumed_versioned_capsule_cannot_be_imported_again():
    producer = FakeTensor(np.zeros(3, np.float32), versioned=True)
    capsule = producer.capsule()
    _core.from_dlpack(capsule)
    assert capsule_name(capsule) == "used_dltensor_versioned"
    with pytest.raises(errors.InvalidArgument, match="already consumed"):
        _core.from_dlpack(capsule)


def test_not_a_dlpack_object_or_capsule_is_refused():
    with pytest.raises(errors.InvalidArgument, match="__dlpack__"):
        _core.from_dlpack([1, 2, 3])
    other = _api.PyCapsule_New(ctypes.addressof(ctypes.c_int(0)), b"other", None)
    with pytest.raises(errors.InvalidArgument, match="not a DLPack capsule"):
        _core.from_dlpack(other)


def test_unknown_major_version_is_refused():
    producer = FakeTensor(np.zeros(2, np.float32), versioned=True, version=(2, 0))
    capsule = producer.capsule()
    with pytest.raises(errors.InvalidArgument, match="version 2.0"):
        _core.from_dlpack(capsule)
    del capsule
    collect()
    assert producer.deleted == 1


def test_newer_minor_version_is_accepted():
    producer = FakeTensor(np.arange(2, dtype=np.float32), versioned=True, version=(1, 7))
    np.testing.assert_array_equal(_core.from_dlpack(producer.capsule()), [0.0, 1.0])


@pytest.mark.parametrize("versioned", [False, True])
def test_non_cpu_device_is_refused_naming_it(versioned):
    producer = FakeTensor(np.zeros(4, np.float32), versioned=versioned, device=(kDLCUDA, 1))
    capsule = producer.capsule()
    with pytest.raises(errors.InvalidArgument, match=r"kDLCUDA \(device_type=2, device_id=1\)"):
        _core.from_dlpack(capsule)
    assert capsule_name(capsule) in ("dltensor", "dltensor_versioned")
    assert producer.deleted == 0
    del capsule
    collect()
    assert producer.deleted == 1


class _Producer:
    """An object with __dlpack__ whose capsule only lives inside from_dlpack."""

    def __init__(self, fake):
        self.fake = fake

    def __dlpack__(self, **kwargs):
        return self.fake.capsule()


def test_refused_capsule_from_dlpack_dunder_is_freed_before_the_error_propagates():
    producer = FakeTensor(np.zeros(4, np.float32), versioned=True, device=(kDLCUDA, 0))
    with pytest.raises(errors.InvalidArgument, match="kDLCUDA"):
        _core.from_dlpack(_Producer(producer))
    # The capsule died inside from_dlpack, before the raise: a destructor that runs while
    # an exception is set (ctypes, Python code) would fail and leak instead.
    assert producer.deleted == 1


def test_pinned_host_memory_is_read_as_cpu_memory():
    producer = FakeTensor(np.arange(3, dtype=np.float32), device=(kDLCUDAHost, 0))
    view = _core.from_dlpack(producer.capsule())
    assert view.base.device == (kDLCUDAHost, 0)
    np.testing.assert_array_equal(view, [0.0, 1.0, 2.0])


# ---- deleters ---------------------------------------------------------------------------


@pytest.mark.parametrize("versioned", [False, True])
def test_producer_deleter_runs_exactly_once_after_the_last_view(versioned):
    producer = FakeTensor(np.arange(10, dtype=np.float32), versioned=versioned)
    capsule = producer.capsule()
    view = _core.from_dlpack(capsule, writable=True)
    del capsule
    collect()
    assert producer.deleted == 0  # consumed: the capsule no longer owns it
    sub_view = view[2:5]
    del view
    collect()
    assert producer.deleted == 0  # a view keeps the owner alive
    np.testing.assert_array_equal(sub_view, [2.0, 3.0, 4.0])
    del sub_view
    collect()
    assert producer.deleted == 1
    collect()
    assert producer.deleted == 1


def test_unconsumed_export_capsule_frees_itself():
    rows = np.ones(5, np.float32)
    alive = weakref.ref(rows)
    capsule = _core.to_dlpack(rows)
    versioned = _core.DLPackExporter(rows).__dlpack__(max_version=(1, 0))
    del rows
    collect()
    assert alive() is not None
    del capsule, versioned
    collect()
    assert alive() is None


def test_export_deleter_takes_the_gil_from_a_foreign_thread():
    rows = np.ones(5, np.float32)
    alive = weakref.ref(rows)
    capsule = _core.to_dlpack(rows)
    del rows
    address = _api.PyCapsule_GetPointer(capsule, LEGACY)
    assert _api.PyCapsule_SetName(capsule, USED_LEGACY) == 0  # consumed by "C code"
    deleter = DLManagedTensor.from_address(address).deleter
    # A CFUNCTYPE call drops the GIL: our deleter must take it to release the array.
    worker = threading.Thread(target=deleter, args=(address,))
    worker.start()
    worker.join()
    del capsule  # renamed "used_dltensor": its destructor must not free it again
    collect()
    assert alive() is None


def test_versioned_export_deleter_runs_once_through_a_consumer():
    rows = np.arange(4, dtype=np.int32)
    alive = weakref.ref(rows)
    view = _core.from_dlpack(_core.DLPackExporter(rows))
    assert view.base.versioned and view.ctypes.data == rows.ctypes.data
    del rows
    collect()
    assert alive() is not None
    del view
    collect()
    assert alive() is None


# ---- DLPackExporter protocol ----------------------------------------------------------------


def test_exporter_protocol_versions_and_device():
    rows = np.zeros((2, 2), np.float32)
    exporter = _core.DLPackExporter(rows)
    assert exporter.__dlpack_device__() == (kDLCPU, 0)
    assert exporter.array is rows
    assert capsule_name(exporter.__dlpack__()) == "dltensor"
    assert capsule_name(exporter.__dlpack__(max_version=(0, 8))) == "dltensor"
    versioned = exporter.__dlpack__(max_version=(1, 0))
    assert capsule_name(versioned) == "dltensor_versioned"
    managed = managed_of(versioned)
    assert (managed.version.major, managed.version.minor) == (1, 0)
    assert managed.flags == 0 and managed.dl_tensor.device.device_type == kDLCPU
    newer_capsule = exporter.__dlpack__(max_version=(1, 9))
    newer = managed_of(newer_capsule)
    assert (newer.version.major, newer.version.minor) == (1, 1)
    cpu_capsule = exporter.__dlpack__(stream=None, dl_device=(kDLCPU, 0))
    assert capsule_data_pointer(cpu_capsule) == rows.ctypes.data


def test_exporter_copy_and_device_requests():
    rows = np.arange(3, dtype=np.float32)
    exporter = _core.DLPackExporter(rows)
    copied = exporter.__dlpack__(max_version=(1, 0), copy=True)
    assert managed_of(copied).flags & IS_COPIED
    view = _core.from_dlpack(copied, writable=True)
    assert view.ctypes.data != rows.ctypes.data
    view[0] = 9.0
    assert rows[0] == 0.0
    with pytest.raises(BufferError):
        exporter.__dlpack__(dl_device=(kDLCUDA, 0))
