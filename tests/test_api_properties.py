"""The public API under any input: each call matches the reference or changes nothing.

A hypothesis property drives one `local` store and a NumPy reference with the same calls:
sparse pushes, `row_sparse_pull` into `out=`, dense pushes and pulls, with random dtypes
(float16, bfloat16, float32, float64, integers of every width, bool), shapes (0-d, empty,
2-D, the flat form, wrong ones), layouts (contiguous, transposed views) and tensor types
(NumPy, torch, TensorFlow). Each call either gives exactly what the reference gives, or
raises a `kvsparse.errors` error and leaves every table as it was. Values are multiples of
1/4 in a small range, exact in every accepted dtype, so the comparison is exact.
(tests/test_hardening.py holds a narrower push-only property of the same kind.)
"""

from __future__ import annotations

import numpy as np
import pytest

import kvsparse
from kvsparse import errors, initializers, optimizers

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
torch = pytest.importorskip("torch")
tf = pytest.importorskip("tensorflow")
ml_dtypes = pytest.importorskip("ml_dtypes")

DIM = 3
IDS = 6  # ids drawn from 0..IDS-1, so that duplicates are common
DENSE_SHAPE = (2, 3)
FLOATS = {"float16", "bfloat16", "float32", "float64"}
INTEGERS = {"int8", "int16", "int32", "int64", "uint8", "uint32", "uint64"}
DTYPES = sorted(FLOATS | INTEGERS | {"bool"})
KINDS = ["numpy", "torch", "tensorflow"]


def _numpy_dtype(name: str):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _contiguous(array, dtype=None) -> np.ndarray:
    """A C-contiguous copy that keeps a 0-d array 0-d (np.ascontiguousarray makes it 1-d:
    a 0-d id then reached the store as shape (1,) while the model expected ())."""
    return np.array(array, dtype=dtype, order="C")


def _tensor(array: np.ndarray, kind: str, dtype: str):
    """array in the given framework and dtype (NumPy keeps a non-contiguous view as it is)."""
    if kind == "numpy":
        return array.astype(_numpy_dtype(dtype), copy=False)
    if kind == "torch":
        if dtype in ("uint32", "uint64"):  # torch has no arithmetic on these: NumPy's own
            return array.astype(dtype)
        if dtype == "bfloat16":
            return torch.from_numpy(_contiguous(array, np.float32)).to(torch.bfloat16)
        return torch.from_numpy(array.astype(dtype, copy=False))
    if dtype == "bfloat16":
        return tf.cast(tf.constant(_contiguous(array, np.float32)), tf.bfloat16)
    return tf.constant(_contiguous(array).astype(dtype))


def _layout(array: np.ndarray, layout: str) -> np.ndarray:
    if layout == "transposed" and array.ndim >= 2:  # the same values through a strided view
        return np.ascontiguousarray(np.swapaxes(array, 0, -1)).swapaxes(0, -1)
    return array


class Model:
    """The store's semantics with SGD(lr=1) over zero rows, in NumPy."""

    def __init__(self):
        self.rows = np.zeros((IDS, DIM), np.float32)
        self.dense = np.zeros(DENSE_SHAPE, np.float32)

    def push_rows(self, ids: np.ndarray, values: np.ndarray) -> None:
        np.subtract.at(self.rows, ids.reshape(-1), values.reshape(-1, DIM))


def _snapshot(kv) -> tuple:
    rows = kv.row_sparse_pull("table", row_ids=np.arange(IDS))
    return rows, kv.pull("dense"), kv.stats()["tables"]["table"]["rows"]


def _assert_unchanged(kv, before: tuple) -> None:
    after = _snapshot(kv)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    assert after[2] == before[2]


@st.composite
def calls(draw):
    """One API call: its op, and how its ids and values (or out buffer) are given."""
    op = draw(st.sampled_from(["push", "pull", "push_dense", "pull_dense"]))
    ids_shape = draw(st.sampled_from([(), (4,), (2, 3), (0,), (2, 0)]))
    return {
        "op": op,
        "ids_shape": ids_shape,
        "ids_dtype": draw(st.sampled_from(DTYPES)),
        "ids_kind": draw(st.sampled_from(KINDS)),
        "dtype": draw(st.sampled_from(DTYPES)),
        "kind": draw(st.sampled_from(KINDS)),
        "shape": draw(st.sampled_from(["exact", "flat", "wrong"])),
        "layout": draw(st.sampled_from(["contiguous", "transposed"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _values_shape(call: dict, exact: tuple, flat: tuple) -> tuple:
    return {"exact": exact, "flat": flat, "wrong": exact + (1,)}[call["shape"]]


def _run(kv, model: Model, call: dict) -> None:
    rng = np.random.default_rng(call["seed"])
    ids = rng.integers(0, IDS, call["ids_shape"])
    ids_in = _tensor(ids, call["ids_kind"], call["ids_dtype"])
    ids_ok = call["ids_dtype"] in INTEGERS
    before = _snapshot(kv)
    op = call["op"]
    if op in ("push", "push_dense"):
        if op == "push":
            shape = _values_shape(call, ids.shape + (DIM,), (ids.size, DIM))
        else:
            shape = _values_shape(call, DENSE_SHAPE, (int(np.prod(DENSE_SHAPE)),))
        values = (rng.integers(-8, 8, shape) / 4).astype(np.float32)
        if call["dtype"] == "bool":
            values = (values > 0).astype(np.float32)
        elif call["dtype"] in INTEGERS:
            values = np.abs(values * 4)  # representable in every integer dtype
        given = _tensor(_layout(values, call["layout"]), call["kind"], call["dtype"])
        accepted = call["dtype"] in FLOATS and (
            call["shape"] == "exact" or (op == "push" and call["shape"] == "flat")
        )
        if op == "push":
            accepted = accepted and ids_ok
            target = lambda: kv.push("table", (ids_in, given))  # noqa: E731
        else:
            target = lambda: kv.push("dense", given)  # noqa: E731
        if not accepted:
            with pytest.raises(errors.KVSparseError):
                target()
            _assert_unchanged(kv, before)
            return
        target()
        if op == "push":
            model.push_rows(ids, values)
        else:
            model.dense -= values.reshape(DENSE_SHAPE)
        return
    # pulls into a caller's buffer: it must be a writable float32 array of the right shape
    if op == "pull":
        shape = _values_shape(call, ids.shape + (DIM,), (ids.size, DIM))
    else:
        shape = _values_shape(call, DENSE_SHAPE, (int(np.prod(DENSE_SHAPE)),))
    out_dtype = call["dtype"]
    if call["kind"] == "tensorflow":  # immutable: can never be an out= buffer
        out = _tensor(np.zeros(shape, np.float32), "tensorflow", out_dtype)
        writable = False
    elif call["kind"] == "torch" and out_dtype not in ("uint32", "uint64"):
        out = _tensor(np.zeros(shape, np.float32), "torch", out_dtype)
        writable = True
    else:
        out = np.zeros(shape, _numpy_dtype(out_dtype))
        writable = True
    accepted = writable and out_dtype == "float32"
    if op == "pull":
        accepted = accepted and ids_ok and call["shape"] in ("exact", "flat")
        target = lambda: kv.row_sparse_pull("table", row_ids=ids_in, out=out)  # noqa: E731
        expected = model.rows[ids.reshape(-1)].reshape(shape) if accepted else None
    else:
        accepted = accepted and call["shape"] == "exact"
        target = lambda: kv.pull("dense", out=out)  # noqa: E731
        expected = model.dense
    if not accepted:
        with pytest.raises(errors.KVSparseError):
            target()
        _assert_unchanged(kv, before)
        return
    target()
    got = out.numpy() if call["kind"] == "torch" else out
    np.testing.assert_array_equal(np.asarray(got).reshape(np.shape(expected)), expected)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(sequence=st.lists(calls(), min_size=1, max_size=6))
@hypothesis.example(  # a 0-d TensorFlow id (once made 1-d by the test's own copy)
    sequence=[
        {
            "op": "push",
            "ids_shape": (),
            "ids_dtype": "int16",
            "ids_kind": "tensorflow",
            "dtype": "bfloat16",
            "kind": "numpy",
            "shape": "exact",
            "layout": "contiguous",
            "seed": 0,
        }
    ]
)
def test_every_call_matches_the_reference_or_changes_nothing(sequence):
    kv = kvsparse.create("local")
    try:
        kv.init("table", kvsparse.SparseTable(dim=DIM, initializer=initializers.Zeros()))
        kv.init("dense", np.zeros(DENSE_SHAPE, np.float32))
        kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
        model = Model()
        for call in sequence:
            _run(kv, model, call)
        rows, dense, _ = _snapshot(kv)
        np.testing.assert_array_equal(rows, model.rows)
        np.testing.assert_array_equal(dense, model.dense)
    finally:
        kv.close()
