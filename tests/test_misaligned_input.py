"""Arrays that are C-contiguous but not aligned to their dtype (a view at an odd offset
of a byte buffer, as np.frombuffer gives over a file or a frame) reach the C++ core as
aligned copies: reading an int64 or float at a misaligned address is undefined behaviour
in C++ (UBSan's "load of misaligned address"; .ci/sanitize runs this file)."""

from __future__ import annotations

import numpy as np

from kvsparse import _core


def _misaligned(array: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of array that starts 4 bytes past an 8-byte boundary."""
    raw = np.zeros(array.nbytes + 16, np.uint8)
    start = (-raw.ctypes.data) % 8 + 4
    data = raw[start : start + array.nbytes]
    data[:] = np.ascontiguousarray(array).view(np.uint8).ravel()
    view = data.view(array.dtype).reshape(array.shape)
    assert view.flags.c_contiguous and not view.flags.aligned
    return view


def test_write_state_takes_misaligned_keys_values_and_steps():
    optimizer = {"kind": "adagrad", "learning_rate": 0.1}
    source = _core.Table(4, {"kind": "normal", "b": 0.01}, optimizer)
    keys = np.arange(100, dtype=np.int64) * 31
    source.apply_gradients(keys, np.ones((100, 4), np.float32))
    values, slots, steps = source.read_state(keys)
    target = _core.Table(4, {"kind": "normal", "b": 0.01}, optimizer)
    target.write_state(_misaligned(keys), values, slots, _misaligned(steps))
    got_values, got_slots, got_steps = target.read_state(keys)
    np.testing.assert_array_equal(got_values, values)
    np.testing.assert_array_equal(got_slots, slots)
    np.testing.assert_array_equal(got_steps, steps)


def test_lookup_and_push_take_misaligned_keys():
    table = _core.Table(8, {"kind": "normal", "b": 0.01}, {"kind": "sgd", "learning_rate": 1.0})
    keys = np.arange(64, dtype=np.int64) * 7
    expected = table.lookup(keys)
    np.testing.assert_array_equal(table.lookup(_misaligned(keys)), expected)
    table.apply_gradients(_misaligned(keys), np.ones((64, 8), np.float32))
    np.testing.assert_allclose(table.lookup(keys), expected - 1.0, rtol=1e-6)
