# A serving replica's writes (included at the end of _core.pyx).
from serving_apply cimport AssignMarkedRows


def assign_marked_rows(Table table, keys_arg, values_arg, float marker=1.0):
    """Sets the rows of keys in table to values plus a last column of marker.

    For a serving replica's tables (`kvsparse.serving.state`), one column
    wider than the rows they hold. The widening and the writes run in one
    call without the GIL, so a delta being applied does not hold up lookups
    in other threads.

    Args:
        table: a Table whose dim is values.shape[1] + 1.
        keys_arg: int64 ids, 1-D (read-only buffers are fine).
        values_arg: float32 (len(keys), dim) rows (read-only buffers are fine).
        marker: the value of the added last column.

    Raises:
        DTypeError, ShapeError: keys or values of the wrong dtype or shape.
        InvalidArgument: table.dim is not values.shape[1] + 1.
        MemoryError: out of memory (rows before it may be written).

    Not thread-safe for one table: nothing else may use it meanwhile.

    Example:
        >>> t = Table(3, {"kind": "zeros"})
        >>> assign_marked_rows(t, np.array([7]), np.ones((1, 2), np.float32))
        >>> t.lookup(np.array([7])).tolist()
        [[1.0, 1.0, 1.0]]
    """
    cdef EmbeddingTable* c_table = table._table()
    cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
    cdef const float[:, ::1] values = _arg(values_arg, np.float32, 2, "values")
    cdef int64_t c_n = keys.shape[0]
    cdef int64_t c_dim = values.shape[1]
    if values.shape[0] != c_n:
        raise errors.ShapeError(
            f"values must have {c_n} rows (one per key), got {values.shape[0]}")
    cdef Status c_status
    if c_n == 0:
        return
    with nogil:
        c_status = AssignMarkedRows(c_table, &keys[0], c_n, &values[0, 0], c_dim, marker)
    _check(c_status)
