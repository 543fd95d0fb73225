"""Turning user inputs (NumPy, anything with __dlpack__, DLPack capsules) into arrays.

Inputs cross without a copy where their layout allows it: DLPack objects are
viewed through kvsparse._core.from_dlpack, NumPy arrays are used as they are.
Every function here keeps no state and may be called from several threads at once.
"""

from __future__ import annotations

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


def as_numpy(obj, *, what: str, writable: bool = False) -> np.ndarray:
    """A NumPy view of obj (ndarray, __dlpack__ object or DLPack capsule)."""
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


def as_ids(obj, *, key) -> np.ndarray:
    """Ids of any shape as int64 (integer dtypes only; no silent float truncation)."""
    array = as_numpy(obj, what=f"row ids of key {key!r}")
    if array.dtype == np.int64:
        return array
    if array.dtype.kind == "u":
        if array.size and array.max() > np.iinfo(np.int64).max:
            raise errors.InvalidArgument(f"row ids of key {key!r} exceed the int64 range")
        return array.astype(np.int64)
    if array.dtype.kind == "i":
        return array.astype(np.int64)
    if array.dtype.kind == "O" and array.size == 0:
        return np.empty(array.shape, np.int64)
    raise errors.DTypeError(f"row ids of key {key!r} must be integers, got dtype {array.dtype}")


def as_float32(obj, *, what: str) -> np.ndarray:
    """Values as float32; other dtypes are refused rather than silently cast."""
    array = as_numpy(obj, what=what)
    if array.dtype != np.float32:
        if array.dtype.kind in "iub" or array.dtype == np.float64 and array.ndim == 0:
            return array.astype(np.float32)
        raise errors.DTypeError(f"{what} must be float32, got dtype {array.dtype}")
    return array


def flat_ids(ids: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(ids.reshape(-1))


def rows_view(values: np.ndarray, n: int, dim: int, *, what: str) -> np.ndarray:
    """values as a C-contiguous (n, dim) float32 array (a view when possible)."""
    if values.size != n * dim or (values.ndim >= 1 and values.shape[-1] != dim and n):
        raise errors.ShapeError(
            f"{what} must hold {n} rows of {dim} values (shape ids.shape + ({dim},)), "
            f"got shape {values.shape}"
        )
    return np.ascontiguousarray(values.reshape(n, dim))
