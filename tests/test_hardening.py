"""Hardening: threads, half-precision and other dtypes, exact shapes, no silent row
replacement by an adapter. Each test failed on main before the fix.

Threads: 4 threads call one store (local, and dist_sparse over two real servers), and the
final table is compared with a NumPy reference (SGD's updates are sums, so they commute).
Every refused call is checked to change nothing.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvsparse
from kvsparse import errors, initializers, optimizers

torch = pytest.importorskip("torch")

DIM = 4
THREADS = 4


def zeros_table(dim=DIM, **settings):
    return kvsparse.SparseTable(dim=dim, initializer=initializers.Zeros(), **settings)


@pytest.fixture
def kv():
    store = kvsparse.create("local")
    store.init("user", zeros_table())
    store.set_optimizer(optimizers.SGD(learning_rate=1.0))
    yield store
    store.close()


def rows_of(kv, ids, key="user"):
    return kv.row_sparse_pull(key, row_ids=np.asarray(ids, np.int64))


# -- 1. threads ------------------------------------------------------------------------------


def _thread_ids(thread: int, steps: int, ids_per_step: int, id_range: int) -> np.ndarray:
    """The ids one thread pushes, step by step: (steps, ids_per_step)."""
    return np.random.default_rng(thread).integers(0, id_range, (steps, ids_per_step))


def _hammer(kv, thread: int, batches: np.ndarray, errors_seen: list) -> None:
    """One thread's work: pulls and pushes on the shared table, and its own dense key."""
    try:
        dense_key = f"dense{thread}"
        kv.init(dense_key, np.zeros((2, 3), np.float32))
        out = np.empty((batches.shape[1], DIM), np.float32)
        for step, ids in enumerate(batches):
            kv.row_sparse_pull("shared", row_ids=ids, out=out)
            kv.push("shared", (ids, np.ones((ids.size, DIM), np.float32)))
            value = kv.pushpull(dense_key, np.ones((2, 3), np.float32))
            assert value[0, 0] == -(step + 1)  # its own key: no other thread touches it
    except BaseException as exc:  # noqa: BLE001 - reported by the main thread
        errors_seen.append(exc)


def _run_threads(kv, steps: int, ids_per_step: int, id_range: int) -> None:
    """THREADS threads hammer kv; the table must equal the NumPy reference after."""
    kv.init("shared", zeros_table())
    kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
    batches = [_thread_ids(t, steps, ids_per_step, id_range) for t in range(THREADS)]
    errors_seen: list = []
    threads = [
        threading.Thread(target=_hammer, args=(kv, t, batches[t], errors_seen))
        for t in range(THREADS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "a thread hung"
    assert not errors_seen, errors_seen
    # Every push applied exactly once: SGD(lr=1) of ones subtracts each id's push count.
    ids, counts = np.unique(np.concatenate(batches, axis=None), return_counts=True)
    expected = np.repeat(-counts[:, None].astype(np.float32), DIM, axis=1)
    np.testing.assert_array_equal(rows_of(kv, ids, "shared"), expected)
    table = kv.stats()["tables"]["shared"]
    assert table["rows"] == ids.size
    for thread in range(THREADS):
        np.testing.assert_array_equal(kv.pull(f"dense{thread}"), np.full((2, 3), -steps))


def test_threads_share_one_local_store():
    # Ids from a wide range keep the C++ table growing while other threads read it: on
    # main this crashed (SIGSEGV) or hung in most runs.
    kv = kvsparse.create("local")
    try:
        _run_threads(kv, steps=150, ids_per_step=512, id_range=10**7)
        table = kv.stats()["tables"]["shared"]
        assert table["admissions"] == table["rows"]
    finally:
        kv.close()


def test_threads_share_one_dist_store(server_factory):
    kv = kvsparse.create("dist_sparse", servers=server_factory(2), rank=0, num_workers=1)
    try:
        _run_threads(kv, steps=40, ids_per_step=256, id_range=10**6)
    finally:
        kv.close()


def test_threads_racing_to_init_one_key_create_it_once():
    # The same spec from every thread: an identical init is a no-op, so all succeed and the
    # table is made once (a push through it is applied once). Different specs: exactly one
    # thread's table is made and the others get DuplicateKey.
    for same in (True, False):
        kv = kvsparse.create("local")
        outcomes: list = []
        barrier = threading.Barrier(THREADS)

        def init(index, kv=kv, outcomes=outcomes, barrier=barrier, same=same):
            barrier.wait()
            try:
                kv.init("raced", zeros_table(dim=DIM if same else DIM + index))
                outcomes.append("created")
            except errors.DuplicateKey:
                outcomes.append("duplicate")

        threads = [threading.Thread(target=init, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if same:
            assert outcomes == ["created"] * THREADS
        else:
            assert sorted(outcomes) == ["created"] + ["duplicate"] * (THREADS - 1)
        dim = kv.row_sparse_pull("raced", row_ids=np.array([7])).shape[1]
        kv.push("raced", (np.array([7]), np.ones((1, dim), np.float32)))
        row = kv.row_sparse_pull("raced", row_ids=np.array([7]))
        np.testing.assert_array_equal(row, np.ones((1, dim), np.float32))
        kv.close()


# -- 2 and 4. dtypes -----------------------------------------------------------------------

TORCH_FLOATS = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


@pytest.mark.parametrize("dtype", sorted(TORCH_FLOATS))
def test_torch_float_gradients_are_converted_not_read_as_integers(kv, dtype):
    grads = torch.full((2, DIM), 1.5, dtype=TORCH_FLOATS[dtype])
    grads[1] = -0.25
    kv.push("user", (torch.tensor([1, 2]), grads))
    np.testing.assert_array_equal(rows_of(kv, [1, 2]), [[-1.5] * DIM, [0.25] * DIM])


@pytest.mark.parametrize("dtype", sorted(TORCH_FLOATS))
def test_torch_float_gradients_of_a_non_contiguous_view(kv, dtype):
    grads = torch.full((DIM, 2), 1.5, dtype=TORCH_FLOATS[dtype]).t()  # (2, DIM), strided
    kv.push("user", (torch.tensor([1, 2]), grads))
    np.testing.assert_array_equal(rows_of(kv, [1, 2]), np.full((2, DIM), -1.5))


@pytest.mark.parametrize("framework", ["jax", "tensorflow"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_jax_and_tensorflow_half_gradients_are_converted(kv, framework, dtype):
    if framework == "jax":
        jnp = pytest.importorskip("jax.numpy")
        grads = jnp.full((1, DIM), 1.5, getattr(jnp, dtype))
    else:
        tf = pytest.importorskip("tensorflow")
        grads = tf.fill((1, DIM), tf.constant(1.5, getattr(tf, dtype)))
    kv.push("user", (np.array([3]), grads))
    np.testing.assert_array_equal(rows_of(kv, [3]), np.full((1, DIM), -1.5))


@pytest.mark.parametrize("dtype", ["float16", "float64", "bfloat16"])
def test_numpy_float_gradients_are_converted(kv, dtype):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    kv.push("user", (np.array([3]), np.full((1, DIM), 1.5, dtype)))
    np.testing.assert_array_equal(rows_of(kv, [3]), np.full((1, DIM), -1.5))


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_dense_values_of_other_float_dtypes_are_converted(kv, dtype):
    kv.init("w", np.ones((2, 3), dtype))
    kv.push("w", np.full((2, 3), 0.5, dtype))
    np.testing.assert_array_equal(kv.pull("w"), np.full((2, 3), 0.5, np.float32))


@pytest.mark.parametrize(
    "grads",
    [
        np.ones((1, DIM), bool),
        np.ones((1, DIM), np.int64),
        np.ones((1, DIM), np.int32),
        np.ones((1, DIM), np.uint8),
        np.ones((1, DIM), np.complex64),
        torch.ones((1, DIM), dtype=torch.bool),
        torch.ones((1, DIM), dtype=torch.int64),
    ],
    ids=["bool", "int64", "int32", "uint8", "complex64", "torch-bool", "torch-int64"],
)
def test_non_float_gradients_are_refused_and_change_nothing(kv, grads):
    with pytest.raises(errors.DTypeError, match="got dtype"):
        kv.push("user", (np.array([1]), grads))
    assert kv.stats()["tables"]["user"]["rows"] == 0
    kv.init("w", np.zeros((1, DIM), np.float32))
    with pytest.raises(errors.DTypeError, match="got dtype"):
        kv.push("w", grads)
    np.testing.assert_array_equal(kv.pull("w"), np.zeros((1, DIM)))


def test_bfloat16_ids_and_outputs_are_refused_by_name(kv):
    with pytest.raises(errors.DTypeError, match="bfloat16"):
        kv.row_sparse_pull("user", row_ids=torch.tensor([1.0], dtype=torch.bfloat16))
    out = torch.empty((1, DIM), dtype=torch.bfloat16)
    with pytest.raises(errors.DTypeError, match="bfloat16"):
        kv.row_sparse_pull("user", row_ids=np.array([1]), out=out)


def test_float64_beyond_the_float32_range_is_refused(kv):
    with pytest.raises(errors.InvalidArgument, match="float32 range"):
        kv.push("user", (np.array([1]), np.full((1, DIM), 1e300)))
    assert kv.stats()["tables"]["user"]["rows"] == 0


def test_finite_gradients_whose_sum_overflows_are_refused(kv):
    big = np.full((2, DIM), 3e38, np.float32)  # each finite; their sum for id 5 is inf
    with pytest.raises(errors.NonFiniteGradient, match="id 5"):
        kv.push("user", (np.array([5, 5]), big))
    assert kv.stats()["tables"]["user"]["rows"] == 0


# -- 3. shapes ------------------------------------------------------------------------------


def test_rows_of_another_shape_than_the_ids_are_refused(kv):
    ids = np.arange(6).reshape(2, 3)
    with pytest.raises(errors.ShapeError, match=r"\(2, 3, 4\) or \(6, 4\).*\(2, 3\).*\(3, 2, 4\)"):
        kv.push("user", (ids, np.ones((3, 2, DIM), np.float32)))
    with pytest.raises(errors.ShapeError):
        kv.push("user", (ids, np.ones((2, 3 * DIM), np.float32)))
    with pytest.raises(errors.ShapeError):
        kv.push("user", (ids, np.ones(6 * DIM, np.float32)))
    assert kv.stats()["tables"]["user"]["rows"] == 0


def test_rows_in_the_ids_shape_or_flat_are_the_same_push(kv):
    ids = np.arange(6).reshape(2, 3)
    grads = np.arange(6 * DIM, dtype=np.float32).reshape(2, 3, DIM)
    kv.push("user", (ids, grads))
    kv.push("user", (ids, grads.reshape(6, DIM)))
    np.testing.assert_array_equal(rows_of(kv, ids), -2 * grads)
    kv.push("user", (np.int64(9), np.ones(DIM, np.float32)))  # 0-d ids: rows of shape (dim,)
    kv.push("user", (np.int64(9), np.ones((1, DIM), np.float32)))
    np.testing.assert_array_equal(rows_of(kv, [9]), np.full((1, DIM), -2.0))


def test_sparse_out_must_be_the_ids_shape_or_flat(kv):
    ids = np.arange(6).reshape(2, 3)
    with pytest.raises(errors.ShapeError, match=r"\(3, 2, 4\)"):
        kv.row_sparse_pull("user", row_ids=ids, out=np.empty((3, 2, DIM), np.float32))
    flat = np.empty((6, DIM), np.float32)
    assert kv.row_sparse_pull("user", row_ids=ids, out=flat) is flat


def test_dense_values_and_outs_must_have_the_key_shape(kv):
    kv.init("w", np.zeros((2, 3), np.float32))
    for bad in (
        np.ones((3, 2), np.float32),
        np.ones(6, np.float32),
        np.ones((1, 2, 3), np.float32),
    ):
        with pytest.raises(errors.ShapeError, match=r"\(2, 3\)") as refused:
            kv.push("w", bad)
        assert str(bad.shape) in str(refused.value)
        with pytest.raises(errors.ShapeError):
            kv.pull("w", out=np.empty(bad.shape, np.float32))
        with pytest.raises(errors.ShapeError):
            kv.pushpull("w", np.ones((2, 3), np.float32), out=np.empty(bad.shape, np.float32))
    with pytest.raises(errors.ShapeError):  # one bad value of a list: nothing applied
        kv.push("w", [np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)])
    np.testing.assert_array_equal(kv.pull("w"), np.zeros((2, 3)))  # out checked before the push


# -- 5. the torch Embedding with no optimizer ------------------------------------------------


def test_torch_embedding_without_an_optimizer_refuses_to_replace_rows():
    from kvsparse.adapters.torch import Embedding

    kv = kvsparse.create("local")
    emb = Embedding(kv, "item", embedding_dim=2, initializer=initializers.Constant(5.0))
    ids = torch.tensor([1, 2])
    with pytest.raises(errors.InvalidArgument, match="set_optimizer"):
        emb(ids).sum().backward()
    np.testing.assert_array_equal(rows_of(kv, [1, 2], "item"), np.full((2, 2), 5.0))
    assert kv.stats()["tables"]["item"]["rows"] == 0
    kv.set_optimizer(optimizers.SGD(learning_rate=1.0))  # the store-wide optimizer counts
    emb(ids).sum().backward()
    np.testing.assert_array_equal(rows_of(kv, [1, 2], "item"), np.full((2, 2), 4.0))
    kv.close()


def test_torch_embedding_with_its_own_optimizer_trains_under_bfloat16_autocast():
    from kvsparse.adapters.torch import Embedding

    kv = kvsparse.create("local")
    emb = Embedding(
        kv,
        "item",
        embedding_dim=DIM,
        initializer=initializers.Constant(1.0),
        optimizer=optimizers.SGD(learning_rate=1.0),
    )
    linear = torch.nn.Linear(DIM, 1, bias=False)
    torch.nn.init.constant_(linear.weight, 1.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear(emb(torch.tensor([3]))).sum()
    assert loss.dtype == torch.bfloat16
    loss.backward()
    np.testing.assert_array_equal(rows_of(kv, [3], "item"), np.full((1, DIM), -0.5))
    kv.close()


# -- property: any dtype, shape, layout and tensor type --------------------------------------

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
ml_dtypes = pytest.importorskip("ml_dtypes")

ACCEPTED = {"float16", "bfloat16", "float32", "float64"}
NUMPY_DTYPES = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "float64": np.float64,
    "int32": np.int32,
    "int64": np.int64,
    "bool": np.bool_,
}


def _as_tensor(array: np.ndarray, kind: str, dtype: str):
    if kind == "numpy":
        return array
    if dtype == "bfloat16":
        return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(array)  # keeps a non-contiguous layout


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(
    dtype=st.sampled_from(sorted(NUMPY_DTYPES)),
    kind=st.sampled_from(["numpy", "torch"]),
    ids_shape=st.sampled_from([(), (3,), (2, 3), (0,), (2, 0, 2)]),
    layout=st.sampled_from(["exact", "flat", "transposed", "wrong"]),
    seed=st.integers(0, 2**16),
)
def test_a_push_matches_the_reference_or_changes_nothing(dtype, kind, ids_shape, layout, seed):
    rng = np.random.default_rng(seed)
    kv = kvsparse.create("local")
    kv.init("user", zeros_table())
    kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
    ids = rng.integers(0, 5, ids_shape)
    # Values exact in every accepted dtype (small multiples of 1/4), so the reference is exact.
    values = rng.integers(-8, 8, ids_shape + (DIM,)).astype(np.float32) / 4
    if dtype == "bool":
        values = values > 0
    rows = values.astype(NUMPY_DTYPES[dtype])
    if layout == "flat":
        rows = rows.reshape(-1, DIM)
    elif layout == "transposed":  # the same values, through a non-contiguous view
        rows = np.ascontiguousarray(np.swapaxes(rows, 0, -1)).swapaxes(0, -1)
    elif layout == "wrong":  # never ids.shape + (dim,) nor (ids.size, dim)
        rows = rows[..., None]
    tensor = _as_tensor(rows, kind, dtype)
    before = rows_of(kv, np.arange(5))
    if dtype not in ACCEPTED or layout == "wrong":
        with pytest.raises(errors.KVSparseError):
            kv.push("user", (ids, tensor))
        np.testing.assert_array_equal(rows_of(kv, np.arange(5)), before)
        assert kv.stats()["tables"]["user"]["rows"] == 0
        kv.close()
        return
    kv.push("user", (ids, tensor))
    expected = np.zeros((5, DIM), np.float32)
    np.subtract.at(expected, ids.reshape(-1), values.astype(np.float32).reshape(-1, DIM))
    np.testing.assert_array_equal(rows_of(kv, np.arange(5)), expected)
    kv.close()
