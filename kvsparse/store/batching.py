"""One key's part of a request: user values checked and turned into what a backend takes.

`KVStore` calls these for each key of a push or pull before anything is sent,
so a rejected call changes nothing. Sparse ids are planned by shard in C++
(`_core.plan_batch`: unique ids grouped by shard, ``offsets[s]:offsets[s + 1]``
for shard ``s``, ``slot`` mapping each input id to its unique one), and the
gradient rows of duplicate ids are summed (`_core.sum_rows_checked`). A push of the
ids a pull just planned takes that pull's plan (`plans.PlanCache`).

Every function keeps no state of its own and may be called from several
threads at once (a `PlanCache` passed in may be shared: it takes its own lock).
"""

from __future__ import annotations

import numpy as np

from kvsparse import _core, errors
from kvsparse.arrays import (
    as_float32,
    as_ids,
    as_list,
    as_numpy,
    check_rows_shape,
    dtype_name,
    flat_ids,
    numpy_dtype,
    rows_view,
    table_dtype,
)
from kvsparse.store.keys import KeyInfo
from kvsparse.store.plans import PlanCache


def sparse_push(
    info: KeyInfo,
    value,
    num_shards: int,
    plans: PlanCache | None = None,
    wire_dtype: str = "float32",
    rows_buffer=None,
) -> tuple:
    """(table_id, keys grouped by shard, offsets, summed rows, wire_dtype) of a sparse push.

    Args:
        info: the table's KeyInfo.
        value: (ids, rows) or a list of them (concatenated, then summed per id).
        num_shards: how many shards the store has.
        plans: the store's plans; one (ids, rows) pair whose flat ids equal a
            pulled batch's reuses its plan. None: always plan afresh.
        wire_dtype: how the rows travel: 'float32', or 'float16' / 'bfloat16',
            to which the summed rows are rounded here, once (uint16 bit
            patterns).
        rows_buffer: (count, dim) -> a float32 array to sum float32 rows into, or None
            (the backend's shared memory: `RemoteBackend.rows_buffer`); None: a new array.

    Rows have shape ids.shape + (dim,), or (ids.size, dim) (ids flattened);
    float16, bfloat16 and float64 rows are converted to float32
    (`kvsparse.arrays.as_float32`).

    Raises:
        InvalidArgument: value is not (ids, rows) pairs.
        DTypeError: ids not integers, rows not of a float dtype.
        ShapeError: rows of another shape.
        NonFiniteGradient: NaN/inf in a summed row of a table with nonfinite='raise',
            or a summed row beyond the range of its 16-bit wire dtype.
    """
    pairs = [value] if isinstance(value, tuple) else as_list(value)
    id_parts, grad_parts = [], []
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise errors.InvalidArgument(
                f"a push to sparse key {info.key!r} takes (ids, rows) or a list of them"
            )
        ids = as_ids(pair[0], key=info.key)
        grads = as_float32(pair[1], what=f"rows pushed to key {info.key!r}")
        what = f"rows pushed to key {info.key!r}"
        grad_parts.append(rows_view(grads, ids.shape, info.dim, what=what))
        id_parts.append(flat_ids(ids))
    ids = id_parts[0] if len(id_parts) == 1 else np.concatenate(id_parts)
    grads = grad_parts[0] if len(grad_parts) == 1 else np.concatenate(grad_parts)
    if plans is None:
        keys, offsets, slot = _core.plan_batch(ids, num_shards, info.boundaries)
    else:
        # Only one pair can be the batch a pull planned; a list is concatenated here.
        plan = (
            plans.for_push(info.table_id, ids, num_shards, info.boundaries)
            if len(pairs) == 1
            else plans.fresh(ids, num_shards, info.boundaries)
        )
        keys, offsets, slot = plan.keys, plan.offsets, plan.slot
    # With nonfinite='skip' the shard leaves rows with NaN/inf untouched: no check here.
    out = None
    if rows_buffer is not None and wire_dtype == "float32":
        out = rows_buffer(keys.size, info.dim)
    summed, bad = _core.sum_rows_checked(grads, slot, keys.size, out)
    if info.nonfinite != "skip":
        if bad >= 0:
            raise errors.NonFiniteGradient(
                f"key {info.key!r}: gradient for id {int(keys[bad])} has a NaN or inf value; "
                "nothing was applied (SparseTable(nonfinite='skip') drops such rows instead)"
            )
    if wire_dtype == "float32":
        return info.table_id, keys, offsets, summed, wire_dtype
    narrowed = _core.narrow(summed, wire_dtype)
    if info.nonfinite != "skip":
        bad = _core.first_nonfinite_half_row(narrowed, wire_dtype)
        if bad >= 0:  # finite in float32 (checked above), so it overflowed
            raise errors.NonFiniteGradient(
                f"key {info.key!r}: the summed gradient for id {int(keys[bad])} is beyond the "
                f"range of {wire_dtype}, its wire dtype (it would arrive as inf); nothing was "
                "applied (use wire_dtype='bfloat16' or 'float32', or scale the loss down)"
            )
    return info.table_id, keys, offsets, narrowed, wire_dtype


def sparse_assign(info: KeyInfo, value, num_shards: int) -> tuple:
    """(table_id, unique keys grouped by shard, offsets, float32 rows) of an assign.

    Args:
        info: the table's KeyInfo.
        value: (ids, rows): int ids of any shape, rows ids.shape + (dim,) or
            (ids.size, dim). A duplicated id gets its last row.

    Raises:
        InvalidArgument: value is not an (ids, rows) pair; a NaN or inf row.
        DTypeError, ShapeError: as `sparse_push`.
    """
    if not isinstance(value, tuple) or len(value) != 2:
        raise errors.InvalidArgument(f"an assign to sparse key {info.key!r} takes (ids, rows)")
    ids = as_ids(value[0], key=info.key)
    what = f"rows assigned to key {info.key!r}"
    rows = rows_view(as_float32(value[1], what=what), ids.shape, info.dim, what=what)
    flat = flat_ids(ids)
    # The last of duplicated ids wins: its first position in the reversed ids.
    unique, first_reversed = np.unique(flat[::-1], return_index=True)
    last = flat.size - 1 - first_reversed
    keys, offsets, slot = _core.plan_batch(unique, num_shards, info.boundaries)
    planned = np.empty((keys.size, info.dim), np.float32)
    planned[slot] = rows.reshape(-1, info.dim)[last]
    bad = _core.first_nonfinite_row(planned)
    if bad >= 0:
        raise errors.InvalidArgument(
            f"key {info.key!r}: the row assigned to id {int(keys[bad])} has a NaN or inf value"
        )
    return info.table_id, keys, offsets, planned


def dense_push(info: KeyInfo, value) -> np.ndarray:
    """The flat float32 sum of the values pushed to a dense key (an array or a list).

    Each value has exactly the key's shape (MXNet's rule: no reshaping).

    Raises:
        ShapeError: a value of another shape. InvalidArgument: an empty list.
        DTypeError: a value not of a float dtype.
        NonFiniteGradient: NaN/inf in the sum.
    """
    total = None
    for part in as_list(value):
        array = as_float32(part, what=f"value pushed to key {info.key!r}")
        if array.shape != info.shape:
            raise errors.ShapeError(
                f"value pushed to key {info.key!r} must have shape {info.shape}, got {array.shape}"
            )
        array = array.reshape(-1)
        total = np.array(array, copy=True) if total is None else total + array
    if total is None:
        raise errors.InvalidArgument(f"empty push to key {info.key!r}")
    if not np.isfinite(total).all():
        raise errors.NonFiniteGradient(
            f"key {info.key!r}: gradient has a NaN or inf value; nothing was applied"
        )
    return np.ascontiguousarray(total, np.float32)


def rows_output(info: KeyInfo, ids: np.ndarray, out, dtype=None) -> tuple:
    """(what row_sparse_pull returns, the array the rows land in) for one key.

    A new array when out is None (of dtype, default the table's: float32,
    float16, or ml_dtypes.bfloat16); else out, viewed writable (NumPy or
    DLPack), which is float32 or of the table's dtype.

    Raises:
        DTypeError: out is neither float32 nor the table's dtype.
        InvalidArgument: dtype neither float32 nor the table's.
        ShapeError: out is neither ids.shape + (dim,) nor (ids.size, dim).
    """
    shape = ids.shape + (info.dim,)
    if out is None:
        name = info.dtype if dtype is None else table_dtype(dtype)
        if name not in ("float32", info.dtype):
            raise errors.InvalidArgument(
                f"key {info.key!r} holds {info.dtype}: pull it as {info.dtype} or float32, "
                f"not {name}"
            )
        result = np.empty(shape, numpy_dtype(name))
        return result, result
    target = as_numpy(out, what=f"out of key {info.key!r}", writable=True)
    if dtype_name(target) not in ("float32", info.dtype):
        raise errors.DTypeError(
            f"out of key {info.key!r} must be float32"
            + ("" if info.dtype == "float32" else f" or {info.dtype}")
            + f", got {dtype_name(target)}"
        )
    check_rows_shape(target.shape, ids.shape, info.dim, what=f"out of key {info.key!r}")
    return out, target


def gather_rows(
    shard_rows: list, offsets, slot, target: np.ndarray, dim: int, wire_dtype: str = "float32"
) -> None:
    """Writes the row of each requested id (slot order) from the shards' replies into target.

    Replies of a 16-bit wire_dtype (uint16 bit patterns) are widened straight
    into a float32 target, with no float32 copy of them in between; a 16-bit
    target of the reply's dtype gets the bits as they are.
    """
    if dtype_name(target) != "float32":
        _gather_bits(shard_rows, target, slot, dim, wire_dtype)
        return
    if target.flags.c_contiguous:
        _gather(shard_rows, offsets, slot, target.reshape(-1, dim), wire_dtype)
    else:
        tmp = np.empty((slot.size, dim), np.float32)
        _gather(shard_rows, offsets, slot, tmp, wire_dtype)
        target[...] = tmp.reshape(target.shape)


def _gather_bits(shard_rows: list, target: np.ndarray, slot, dim: int, wire_dtype: str) -> None:
    """16-bit replies gathered into a target of the same 16-bit dtype, bit for bit."""
    if dtype_name(target) != wire_dtype:  # rows_output and the pull's wire agree: a bug if not
        raise errors.DTypeError(f"rows travel as {wire_dtype}, out is {dtype_name(target)}")
    parts = [np.asarray(rows).view(np.uint16).reshape(-1, dim) for rows in shard_rows]
    rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
    bits = target.view(np.uint16)
    if bits.flags.c_contiguous:
        np.take(rows, slot, axis=0, out=bits.reshape(-1, dim))
    else:
        bits[...] = rows[slot].reshape(bits.shape)


def fill_dense(array: np.ndarray, flat: np.ndarray) -> None:
    """array (of a dense key's shape: float32, float16 or bfloat16) = flat float32 values.

    flat holds values of array's dtype (a 16-bit key's), so rounding is exact.
    """
    name = dtype_name(array)
    if name == "float32":
        array[...] = flat.reshape(array.shape)
    else:
        array.view(np.uint16)[...] = _core.narrow(flat, name).reshape(array.shape)


def _gather(shard_rows: list, offsets, slot, out: np.ndarray, wire_dtype: str) -> None:
    if wire_dtype == "float32":
        _core.gather_from_shards(shard_rows, offsets, slot, out)
    else:
        _core.gather_widen_from_shards(shard_rows, offsets, slot, out, wire_dtype)


def dense_outputs(info: KeyInfo, out) -> list:
    """The writable arrays a pull of a dense key fills: out, or each of a list of copies.

    Each is float32 or of the key's dtype (float16 / bfloat16).

    Raises:
        DTypeError: an out neither float32 nor of the key's dtype.
        ShapeError: an out not of the key's exact shape.
    """
    arrays = []
    for target in [] if out is None else as_list(out):  # MXNet: out may be a list of copies
        array = as_numpy(target, what=f"out of key {info.key!r}", writable=True)
        if dtype_name(array) not in ("float32", info.dtype):
            raise errors.DTypeError(
                f"out of key {info.key!r} must be float32"
                + ("" if info.dtype == "float32" else f" or {info.dtype}")
                + f", got {dtype_name(array)}"
            )
        if array.shape != info.shape:
            raise errors.ShapeError(
                f"out of key {info.key!r} must have shape {info.shape}, got {array.shape}"
            )
        arrays.append(array)
    return arrays


__all__ = [
    "dense_outputs",
    "dense_push",
    "fill_dense",
    "numpy_dtype",
    "gather_rows",
    "rows_output",
    "sparse_assign",
    "sparse_push",
]
