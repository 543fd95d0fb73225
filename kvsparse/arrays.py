"""Turning user inputs (NumPy, anything with __dlpack__, DLPack capsules) into arrays.

Inputs cross without a copy where their layout allows it: DLPack objects are
viewed through kvsparse._core.from_dlpack, NumPy arrays are used as they are.
Every function here keeps no state and may be called from several threads at once.
"""

from __future__ import annotations

import math

import numpy as np

from kvsparse import _core, errors


def is_capsule(obj) -> bool:
    """Whether obj is a DLPack capsule (or any other PyCapsule)."""
    return type(obj).__name__ == "PyCapsule"


def as_list(obj) -> list:
    """The items of a list or tuple, or [obj] for anything else (MXNet's key/value forms)."""
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def per_key(value, single: bool) -> list:
    """One item per key of a call: [value] for a single key, else value's items."""
    return [value] if single else as_list(value)


def outputs_per_key(out, single: bool, count: int) -> list:
    """One output (or None) per key: like per_key, with out=None meaning None for each of count."""
    return per_key(out, single) if single or out is not None else [None] * count


# Tensor types that are immutable values although DLPack hands out their memory: writing a
# pull into one would change a constant that TensorFlow or JAX may share or cache (tf.zeros
# of one shape can return one tensor). DLPack before 1.0 has no read-only flag to say so.
_IMMUTABLE_TENSOR_MODULES = ("tensorflow", "jax", "jaxlib")


def _immutable_tensor(obj) -> bool:
    return type(obj).__module__.split(".")[0] in _IMMUTABLE_TENSOR_MODULES


def as_numpy(obj, *, what: str, writable: bool = False) -> np.ndarray:
    """A NumPy view of obj (ndarray, __dlpack__ object or DLPack capsule).

    Raises:
        InvalidArgument: writable and obj is read-only, or a TensorFlow/JAX tensor
            (immutable values: pull into a NumPy array or torch tensor instead).
    """
    if writable and _immutable_tensor(obj):
        raise errors.InvalidArgument(
            f"{what} is a TensorFlow or JAX tensor ({type(obj).__name__}), immutable; kvsparse "
            "must write into it: pass a NumPy array (or a torch tensor) and convert after"
        )
    if isinstance(obj, np.ndarray):
        if writable and not obj.flags.writeable:
            raise errors.InvalidArgument(f"{what} is read-only; kvsparse must write into it")
        return obj
    if hasattr(obj, "__dlpack__") or is_capsule(obj):
        from_dlpack = getattr(_core, "from_dlpack", None)
        if from_dlpack is not None:
            return from_dlpack(obj, writable=writable)
        array = np.from_dlpack(obj)
        if writable and not array.flags.writeable:
            raise errors.InvalidArgument(f"{what} is read-only; kvsparse must write into it")
        return array
    if writable:
        raise errors.DTypeError(
            f"{what} must be a NumPy array or a DLPack tensor, got {type(obj).__name__}"
        )
    try:
        return np.asarray(obj)
    except Exception as exc:  # noqa: BLE001 - any conversion failure is the user's input
        raise errors.DTypeError(f"{what}: cannot read {type(obj).__name__} as an array") from exc


# str(dtype) per dtype: NumPy computes a dtype's name in Python (6-8 us a call, several
# calls per pull and push). Few distinct dtypes ever reach the store.
_dtype_texts: dict = {}


def _dtype_text(dtype: np.dtype) -> str:
    text = _dtype_texts.get(dtype)
    if text is None:
        text = _dtype_texts[dtype] = str(dtype)
    return text


def _is_bfloat16(array: np.ndarray) -> bool:
    """Whether array holds bfloat16 values: ml_dtypes' dtype, or DLPack's raw bits.

    `_core.from_dlpack` gives a bfloat16 tensor as uint16 bits (NumPy has no
    bfloat16) with ``base.dlpack_dtype == "bfloat16"``; those bits must never
    be read as integers (1.5 pushed in bfloat16 became -16320).
    """
    dtype = array.dtype
    if _dtype_text(dtype) == "bfloat16":
        return True
    return dtype.char == "H" and getattr(array.base, "dlpack_dtype", "") == "bfloat16"


def dtype_name(array: np.ndarray) -> str:
    """The dtype of array as a user named it ("bfloat16" for DLPack bfloat16 bits)."""
    return "bfloat16" if _is_bfloat16(array) else _dtype_text(array.dtype)


def as_ids(obj, *, key) -> np.ndarray:
    """Ids of any shape as int64 (integer dtypes only; no silent float truncation)."""
    array = as_numpy(obj, what=f"row ids of key {key!r}")
    if array.dtype == np.int64:
        return array
    if _is_bfloat16(array):
        raise errors.DTypeError(f"row ids of key {key!r} must be integers, got dtype bfloat16")
    if array.dtype.kind == "u":
        if array.size and array.max() > np.iinfo(np.int64).max:
            raise errors.InvalidArgument(f"row ids of key {key!r} exceed the int64 range")
        return array.astype(np.int64)
    if array.dtype.kind == "i":
        return array.astype(np.int64)
    if array.size == 0 and (array.dtype.kind == "O" or isinstance(obj, (list, tuple))):
        # NumPy makes [] float64; a Python sequence with no ids holds no float to truncate.
        return np.empty(array.shape, np.int64)
    raise errors.DTypeError(f"row ids of key {key!r} must be integers, got dtype {array.dtype}")


# The float dtypes values are converted from (docs/api.md "Dtypes"); the rest are refused.
_CONVERTED_FLOATS = ("float16", "bfloat16", "float64")
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def as_float32(obj, *, what: str) -> np.ndarray:
    """Values (gradients, dense values) as float32.

    float32 is used as it is (no copy); float16, bfloat16 (NumPy with
    ml_dtypes, or any DLPack producer: torch, TF, JAX) and float64 are
    converted exactly or rounded to nearest. A Python int or float is taken as
    a float32 scalar. bool, integer, complex and other dtypes are refused
    rather than cast silently.

    Raises:
        DTypeError: a dtype that is not a float one.
        InvalidArgument: a finite float64 value beyond the float32 range.
    """
    if type(obj) in (int, float):  # a Python scalar, e.g. kv.push('lr', 1)
        return np.asarray(obj, np.float32)
    array = as_numpy(obj, what=what)
    if array.dtype == np.float32:
        return array
    name = dtype_name(array)
    if name not in _CONVERTED_FLOATS:
        raise errors.DTypeError(
            f"{what} must be float32 (or float16, bfloat16, float64, converted), got dtype {name}"
        )
    if array.dtype == np.uint16:  # bfloat16 bits: the high half of a float32
        return (array.astype(np.uint32) << 16).view(np.float32)
    if array.dtype == np.float64 and array.size:
        finite = array[np.isfinite(array)]
        if finite.size and np.abs(finite).max() > _FLOAT32_MAX:
            raise errors.InvalidArgument(
                f"{what}: a float64 value beyond the float32 range ({_FLOAT32_MAX:.3g})"
            )
    return array.astype(np.float32)


# The dtypes a table or dense key stores; the first is the default.
TABLE_DTYPES = ("float32", "float16", "bfloat16")
_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32"}


def table_dtype(obj, what: str = "dtype") -> str:
    """The name ('float32', 'float16' or 'bfloat16') of a storage dtype given in any form.

    Takes those names (and 'half', 'fp16', 'bf16'), NumPy dtypes (ml_dtypes'
    bfloat16 included: MXNet and JAX use them), torch dtypes (torch.half,
    torch.bfloat16) and TensorFlow DTypes (tf.float16, tf.bfloat16).

    Raises:
        InvalidArgument: any other dtype, naming what was given.

    Example:
        >>> table_dtype(np.float16)
        'float16'
    """
    name = None
    if isinstance(obj, str):
        name = _DTYPE_ALIASES.get(obj, obj)
    elif type(obj).__module__.startswith("torch"):
        name = str(obj).removeprefix("torch.")
    elif isinstance(getattr(obj, "name", None), str) and not isinstance(obj, type):
        name = obj.name  # np.dtype, tf.DType
    else:
        try:
            name = np.dtype(obj).name
        except TypeError:
            name = None
    if name not in TABLE_DTYPES:
        raise errors.InvalidArgument(
            f"{what} must be float32, float16 or bfloat16 (a name, NumPy, torch or TF "
            f"dtype), got {obj!r}"
        )
    return name


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a table dtype name (ml_dtypes.bfloat16 for 'bfloat16').

    Raises:
        InvalidArgument: 'bfloat16' without the ml_dtypes package (pull in float32 instead).
    """
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise errors.InvalidArgument(
                "bfloat16 NumPy arrays need the ml_dtypes package (pip install ml_dtypes); "
                "or pull with dtype='float32'"
            ) from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def to_table_dtype(values: np.ndarray, name: str) -> np.ndarray:
    """float32 values rounded to table dtype `name` (nearest, ties to even); as is for float32."""
    if name == "float32":
        return values
    return _core.narrow(np.ascontiguousarray(values, np.float32), name).view(numpy_dtype(name))


def flat_ids(ids: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(ids.reshape(-1))


def check_rows_shape(shape: tuple, ids_shape: tuple, dim: int, *, what: str) -> None:
    """Raises ShapeError unless shape is ids_shape + (dim,) or (ids.size, dim).

    The two shapes rows of ids may have (pushed, or an ``out=`` pulled into):
    one row per id in the ids' own shape, or the ids flattened (what adapters
    send after dropping padding ids). Checking only the size let rows of shape
    (3, 2, 4) for ids of shape (2, 3) land on the wrong ids.
    """
    shape, ids_shape = tuple(shape), tuple(ids_shape)
    exact = ids_shape + (dim,)
    flat = (math.prod(ids_shape), dim)
    if shape != exact and shape != flat:
        allowed = f"{exact}" if exact == flat else f"{exact} or {flat}"
        raise errors.ShapeError(
            f"{what} must have shape {allowed} for ids of shape {ids_shape}, got {shape}"
        )


def rows_view(values: np.ndarray, ids_shape: tuple, dim: int, *, what: str) -> np.ndarray:
    """values as a C-contiguous (ids.size, dim) float32 array (a view when possible).

    Raises:
        ShapeError: values is neither ids_shape + (dim,) nor (ids.size, dim).
    """
    check_rows_shape(values.shape, ids_shape, dim, what=what)
    return np.ascontiguousarray(values.reshape(-1, dim))
