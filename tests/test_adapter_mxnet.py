"""The MXNet adapter: registered stores, KVStore semantics, zero-copy, optimizers, Gluon parity.

References are MXNet's own: its optimizers' updaters, its `local` KVStore, and
Gluon's Trainer over it (several CPU contexts stand in for dist_sync workers:
MXNet sums their gradients and updates once, as a BSP step does).
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

if "bool" not in vars(np):
    np.bool = bool  # MXNet 1.9.1 needs it to import; the adapter sets it too (tested below)
mx = pytest.importorskip("mxnet")

import kvsparse.adapters.mxnet as kam  # noqa: E402
from conftest import REPO_ROOT, last_json, run_workers, subprocess_env  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402
from mxnet.base import _LIB, check_call  # noqa: E402

from kvsparse import errors, optimizers  # noqa: E402

ROWS, DIM = 40, 4
# MXNet 1.9.1's nd.array still reaches for scipy.sparse.csr, deprecated by SciPy.
pytestmark = pytest.mark.filterwarnings("ignore:Please import `csr_matrix`:DeprecationWarning")


@pytest.fixture(autouse=True)
def _quiet_mxnet(monkeypatch):
    monkeypatch.setenv("MXNET_STORAGE_FALLBACK_LOG_VERBOSE", "0")


@pytest.fixture
def kv():
    store = kam.create("local")
    yield store
    store.close()


@pytest.fixture
def dist_env(server_factory, monkeypatch):
    """Two real servers; `mx.kv.create('dist_sparse')` with no arguments connects to them."""
    servers = server_factory(2)
    monkeypatch.setenv("KVSPARSE_SERVERS", ",".join(servers))
    monkeypatch.setenv("KVSPARSE_RANK", "0")
    monkeypatch.setenv("KVSPARSE_NUM_WORKERS", "1")
    return servers


def data_pointer(array) -> int:
    """Where MXNet keeps an NDArray's values (a RowSparseNDArray's stored rows)."""
    pointer = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(array.handle, ctypes.byref(pointer)))
    return pointer.value


def row_sparse(rows: dict, shape=(ROWS, DIM)):
    ids = np.array(sorted(rows), np.int64)
    values = np.array([rows[i] for i in sorted(rows)], np.float32).reshape(len(ids), shape[1])
    return nd.sparse.row_sparse_array((values, ids), shape=shape)


def dense_rows(kv, key, ids) -> np.ndarray:
    return kv.row_sparse_pull(key, row_ids=nd.array(ids, dtype="int64")).asnumpy()


class Spy:
    """Wraps a kvsparse store, recording what each call received (and autograd's state)."""

    def __init__(self, store):
        self.store = store
        self.calls = []

    def __getattr__(self, name):
        target = getattr(self.store, name)
        if not callable(target) or name.startswith("_"):
            return target

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs, autograd.is_recording()))
            return target(*args, **kwargs)

        return call

    def __contains__(self, key):
        return key in self.store


# -- registration and the store's identity --------------------------------------------------


def test_the_adapter_sets_np_bool_before_importing_mxnet():
    script = "import numpy as np, kvsparse.adapters.mxnet, mxnet; assert np.bool is bool"
    result = subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-c", script],
        env=subprocess_env(),
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("role", ["server", "scheduler"])
def test_a_ps_lite_role_is_refused_before_mxnet_starts_a_node(role):
    # With DMLC_ROLE=server `import mxnet` would start a ps-lite node and never return.
    result = subprocess.run(
        [sys.executable, "-c", "import kvsparse.adapters.mxnet"],
        env=subprocess_env({"DMLC_ROLE": role}),
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert f"ImportError: DMLC_ROLE={role} makes `import mxnet` start" in result.stderr


def test_mx_kv_create_returns_kvsparse_stores_connected_by_the_environment(dist_env):
    kv = mx.kv.create("dist_sparse")
    try:
        assert isinstance(kv, kam.KVSparseStore)
        assert isinstance(kv, mx.kvstore.KVStoreBase) and isinstance(kv, mx.kv.KVStore)
        assert "dist" in kv.type and kv.type == "dist_sparse"
        assert (kv.rank, kv.num_workers, kv.num_servers) == (0, 1, 2)
        assert kv.is_capable("optimizer") and kv.is_capable(mx.kvstore.KVStoreBase.OPTIMIZER)
        with pytest.raises(ValueError, match="Unknown capability"):
            kv.is_capable("compression")
        kv.init(3, row_sparse({1: [1, 2, 3, 4]}))
        np.testing.assert_array_equal(dense_rows(kv, 3, [1, 2]), [[1, 2, 3, 4], [0, 0, 0, 0]])
        assert kv.store.stats()["tables"][3]["rows"] == 1
    finally:
        kv.close()
    # The registry answers only for kvsparse's names; MXNet's own stores stay MXNet's.
    assert type(mx.kv.create("local")) is mx.kv.KVStore
    assert mx.kvstore.KVStoreBase.kv_registry["dist_sparse"] is kam.Dist_Sparse
    assert mx.kvstore.KVStoreBase.kv_registry["dist_sparse_async"] is kam.Dist_Sparse_Async


def test_dist_sparse_async_store(server_factory):
    servers = server_factory(1)
    kv = kam.create("dist_sparse_async", servers=servers, rank=0, num_workers=1)
    try:
        assert kv.type == "dist_sparse_async" and "dist" in kv.type and "async" in kv.type
        kv.init(0, row_sparse({2: [1, 1, 1, 1]}))
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
        kv.push(0, row_sparse({2: [1, 1, 1, 1]}))
        np.testing.assert_allclose(dense_rows(kv, 0, [2]), [[0.5] * 4])
    finally:
        kv.close()


def test_create_refuses_unknown_kinds_and_the_local_store_takes_no_options():
    with pytest.raises(errors.InvalidArgument, match="unknown store"):
        kam.create("dist_sync")
    with pytest.raises(errors.InvalidArgument):
        kam.create("local", servers=["tcp://127.0.0.1:1"])


# -- init --------------------------------------------------------------------------------


def test_init_row_sparse_value_sets_its_rows_and_other_rows_start_at_zero(kv):
    kv.init(0, row_sparse({3: [1, 2, 3, 4], 7: [5, 6, 7, 8]}))
    got = dense_rows(kv, 0, [7, 3, 5, 2**40])
    np.testing.assert_array_equal(got, [[5, 6, 7, 8], [1, 2, 3, 4], [0] * 4, [0] * 4])
    assert kv.store.key_info(0).sparse and kv.store.key_info(0).dim == DIM


def test_init_dense_value_with_sparse_gradient_makes_a_table_of_all_its_rows(kv):
    weight = nd.array(np.arange(12, dtype=np.float32).reshape(3, 4))
    weight.attach_grad(stype="row_sparse")
    plain = nd.ones((2, 5))
    kv.init([0, 1], [weight, plain])
    assert kv.store.key_info(0).sparse and not kv.store.key_info(1).sparse
    np.testing.assert_array_equal(dense_rows(kv, 0, [2, 0]), weight.asnumpy()[[2, 0]])
    out = nd.zeros((2, 5))
    kv.pull(1, out=out)
    np.testing.assert_array_equal(out.asnumpy(), 1)


def test_init_errors(kv):
    kv.init(0, row_sparse({1: [1] * DIM}))
    with pytest.raises(errors.DuplicateKey):
        kv.init(0, row_sparse({1: [1] * DIM}))
    with pytest.raises(errors.ShapeError):
        kv.init(1, nd.ones((ROWS,)).tostype("row_sparse"))
    with pytest.raises(errors.InvalidArgument, match="one value"):
        kv.init(2, [nd.ones((2, 2)), nd.ones((2, 2))])
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    kv.push(0, row_sparse({1: [1] * DIM}))
    # Rows are written verbatim (ASSIGN_SPARSE), so init works once gradients flow.
    kv.init(5, row_sparse({1: [1] * DIM}))
    np.testing.assert_array_equal(dense_rows(kv, 5, [1, 2]), [[1] * DIM, [0] * DIM])


# -- keys ----------------------------------------------------------------------------------


def test_int_and_str_keys_are_never_mixed(kv):
    kv.init(0, nd.ones((2, 2)))
    with pytest.raises(errors.KeyTypeError):
        kv.init("w", nd.ones((2, 2)))
    with pytest.raises(errors.KeyTypeError):
        kv.push([0, "w"], [nd.ones((2, 2)), nd.ones((2, 2))])
    other = kam.create("local")
    other.init("w", nd.ones((2, 2)))
    with pytest.raises(errors.KeyTypeError):
        other.push(0, nd.ones((2, 2)))
    with pytest.raises(errors.KeyTypeError):
        other.row_sparse_pull(["w", 1], row_ids=[nd.array([0]), nd.array([0])])
    other.close()


# -- push: lists are summed -----------------------------------------------------------------


def test_a_pushed_list_is_summed_without_optimizer_it_replaces_pushed_rows(kv):
    kv.init(0, row_sparse({1: [9] * DIM, 2: [9] * DIM}))
    kv.push(0, [row_sparse({1: [1] * DIM}), row_sparse({1: [2] * DIM, 3: [4] * DIM})])
    # Row 2 was not pushed and keeps its value (MXNet's store would drop it).
    np.testing.assert_array_equal(dense_rows(kv, 0, [1, 2, 3]), [[3] * DIM, [9] * DIM, [4] * DIM])


def test_a_pushed_list_is_summed_into_one_gradient(kv):
    kv.init([0, 1], [row_sparse({}), nd.zeros((2, 3))])
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
    kv.push(
        [0, 1],
        [
            [row_sparse({1: [1] * DIM}), row_sparse({1: [3] * DIM, 2: [2] * DIM})],
            [nd.ones((2, 3)), nd.ones((2, 3)) * 3],
        ],
    )
    np.testing.assert_allclose(dense_rows(kv, 0, [1, 2]), [[-2] * DIM, [-1] * DIM])
    out = nd.empty((2, 3))
    kv.pull(1, out=out)
    np.testing.assert_allclose(out.asnumpy(), -2)


def test_a_dense_gradient_updates_every_row_and_pairs_reach_any_int64_id(kv):
    kv.init(0, row_sparse({}))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0))
    kv.push(0, nd.ones((ROWS, DIM)))
    np.testing.assert_allclose(
        dense_rows(kv, 0, [0, ROWS - 1, ROWS]), [[-1] * DIM] * 2 + [[0] * DIM]
    )
    far = np.array([[2**62, -5]], np.int64)
    kv.push(0, (nd.array(far, dtype="int64"), nd.ones((1, 2, DIM))))
    np.testing.assert_allclose(dense_rows(kv, 0, far.reshape(-1)), -1)
    assert kv.store.stats()["tables"][0]["rows"] == ROWS + 2  # grew past the declared rows


def test_push_errors_change_nothing(kv):
    kv.init(0, row_sparse({1: [1] * DIM}))
    with pytest.raises(errors.ShapeError):
        kv.push(0, nd.ones((2, DIM + 1)))
    with pytest.raises(errors.UnknownKey):
        kv.push([0, 9], [row_sparse({1: [5] * DIM}), nd.ones((2, 2))])
    with pytest.raises(errors.DTypeError):
        kv.push(0, np.ones((1, DIM), np.float32))
    np.testing.assert_array_equal(dense_rows(kv, 0, [1]), [[1] * DIM])


# -- row_sparse_pull -----------------------------------------------------------------------


def test_row_sparse_pull_takes_2d_float_unsorted_duplicated_ids(kv):
    table = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)
    kv.init(0, nd.array(table).tostype("row_sparse"))
    ids = nd.array([[7, 3], [7, 12]])  # float32, MXNet's default dtype
    out = nd.sparse.zeros("row_sparse", (ROWS, DIM))
    kv.row_sparse_pull(0, out=out, row_ids=ids)
    assert out.indices.asnumpy().tolist() == [3, 7, 12]  # unique and sorted, as MXNet
    np.testing.assert_array_equal(out.data.asnumpy(), table[[3, 7, 12]])
    dense = nd.zeros((2, 2, DIM))
    assert kv.row_sparse_pull(0, out=dense, row_ids=ids) is dense
    np.testing.assert_array_equal(dense.asnumpy(), table[[[7, 3], [7, 12]]])
    fresh = kv.row_sparse_pull(0, row_ids=nd.array([5, 5], dtype="int64"))
    np.testing.assert_array_equal(fresh.asnumpy(), table[[5, 5]])
    empty = nd.sparse.zeros("row_sparse", (ROWS, DIM))
    kv.row_sparse_pull(0, out=empty, row_ids=nd.array([], dtype="int64"))
    assert empty.indices.shape == (0,) and empty.asnumpy().sum() == 0


def test_row_sparse_pull_many_outs_and_many_keys_in_one_request(kv):
    kv.init([0, 1], [row_sparse({1: [1] * DIM}), row_sparse({2: [2] * 3}, shape=(ROWS, 3))])
    copies = [nd.sparse.zeros("row_sparse", (ROWS, DIM)) for _ in range(2)]
    kv.row_sparse_pull(0, out=copies, row_ids=nd.array([1, 4]))  # one row_ids for every out
    for copy in copies:
        assert copy.indices.asnumpy().tolist() == [1, 4]
    spy = Spy(kv.store)
    kv._store = spy
    a, b = nd.zeros((1, DIM)), nd.sparse.zeros("row_sparse", (ROWS, 3))
    kv.row_sparse_pull([0, 1], out=[a, b], row_ids=[nd.array([1]), nd.array([2, 2])])
    assert [c[0] for c in spy.calls if c[0] != "key_info"] == ["row_sparse_pull"]
    np.testing.assert_array_equal(a.asnumpy(), [[1] * DIM])
    np.testing.assert_array_equal(b.asnumpy()[2], [2] * 3)


def test_row_sparse_pull_errors(kv):
    kv.init([0, 1], [row_sparse({1: [1] * DIM}), nd.ones((2, 2))])
    with pytest.raises(errors.InvalidArgument, match="0, 40"):
        kv.row_sparse_pull(
            0, out=nd.sparse.zeros("row_sparse", (ROWS, DIM)), row_ids=nd.array([ROWS])
        )
    with pytest.raises(errors.InvalidArgument, match="whole numbers"):
        kv.row_sparse_pull(0, row_ids=nd.array([1.5]))
    with pytest.raises(errors.ShapeError):
        kv.row_sparse_pull(0, out=nd.zeros((3, DIM)), row_ids=nd.array([1, 2]))
    with pytest.raises(errors.InvalidArgument, match="dense"):
        kv.row_sparse_pull(1, row_ids=nd.array([0]))
    with pytest.raises(errors.InvalidArgument, match="row_ids"):
        kv.row_sparse_pull(0, out=nd.zeros((1, DIM)))


def test_writes_into_outs_happen_outside_autograd_recording(kv, monkeypatch):
    kv.init(0, row_sparse({1: [1] * DIM}))
    spy = Spy(kv.store)
    kv._store = spy
    copies = []
    original = mx.nd.sparse.RowSparseNDArray.copyto

    def recording_copyto(self, other):
        copies.append(autograd.is_recording())
        return original(self, other)

    monkeypatch.setattr(mx.nd.sparse.RowSparseNDArray, "copyto", recording_copyto)
    weight = nd.sparse.zeros("row_sparse", (ROWS, DIM))
    weight.attach_grad(stype="row_sparse")
    dense = nd.zeros((1, DIM))
    with autograd.record():
        kv.row_sparse_pull(0, out=weight, row_ids=nd.array([1]))
        kv.row_sparse_pull(0, out=dense, row_ids=nd.array([1]))
        kv.pull(0, out=nd.zeros((ROWS, DIM)))
    assert copies == [False]
    pulls = [c for c in spy.calls if c[0] in ("row_sparse_pull", "pull")]
    assert len(pulls) == 3 and not any(c[3] for c in pulls)
    np.testing.assert_array_equal(weight.data.asnumpy(), [[1] * DIM])


# -- pull, pushpull, broadcast ------------------------------------------------------------


def test_pull_of_a_table_fills_dense_outs_and_row_sparse_outs_unless_ignored(kv):
    kv.init(0, row_sparse({1: [1] * DIM, 5: [5] * DIM}))
    dense = nd.zeros((ROWS, DIM))
    kv.pull(0, out=dense)
    assert dense.asnumpy()[[1, 5]].tolist() == [[1] * DIM, [5] * DIM]
    assert dense.asnumpy().sum() == 6 * DIM
    rsp = nd.sparse.zeros("row_sparse", (ROWS, DIM))
    kv.pull(0, out=rsp)  # ignore_sparse=True: left alone, as MXNet
    assert rsp.indices.shape == (0,)
    kv.pull(0, out=rsp, ignore_sparse=False)
    np.testing.assert_array_equal(rsp.asnumpy(), dense.asnumpy())


def test_pushpull_and_broadcast(kv):
    kv.init(1, row_sparse({1: [1] * DIM, 2: [2] * DIM}))
    a, b = nd.zeros((2, 3)), nd.zeros((2, 3))
    kv.broadcast(0, nd.ones((2, 3)) * 4, out=[a, b])
    assert a.asnumpy().tolist() == b.asnumpy().tolist() == [[4] * 3] * 2
    with pytest.raises(errors.DuplicateKey):
        kv.broadcast(0, nd.ones((2, 3)), out=a)  # as MXNet's stores
    values = [nd.ones((2, 3)), nd.ones((2, 3)) * 2]
    kv.pushpull(0, values)  # no optimizer: the value becomes the sum, written into values
    assert values[0].asnumpy().tolist() == values[1].asnumpy().tolist() == [[3] * 3] * 2
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
    out = nd.zeros((2, 3))
    kv.pushpull(0, [nd.ones((2, 3)), nd.ones((2, 3))], out=out)
    np.testing.assert_allclose(out.asnumpy(), 2)
    touched = nd.sparse.zeros("row_sparse", (ROWS, DIM))
    kv.pushpull(1, row_sparse({2: [2] * DIM}), out=touched)
    assert touched.indices.asnumpy().tolist() == [2]
    np.testing.assert_allclose(touched.data.asnumpy(), [[1] * DIM])


# -- zero-copy -------------------------------------------------------------------------------


def test_views_share_mxnet_memory_and_writes_show_through():
    array = nd.zeros((3, 4))
    view = kam.as_numpy(array, writable=True)
    assert view.ctypes.data == data_pointer(array)
    view[1, 2] = 7.0
    assert array.asnumpy()[1, 2] == 7.0
    readonly = kam.as_numpy(array)
    assert readonly.ctypes.data == data_pointer(array) and not readonly.flags.writeable
    sparse = row_sparse({2: [1] * DIM, 9: [2] * DIM})
    rows = kam.as_numpy(sparse)
    assert rows.shape == (2, DIM) and rows.ctypes.data == data_pointer(sparse)


def test_pushed_rows_are_read_and_pulled_rows_written_where_mxnet_keeps_them(kv):
    kv.init([0, 1], [row_sparse({1: [1] * DIM}), nd.ones((2, 3))])
    spy = Spy(kv.store)
    kv._store = spy
    grad = row_sparse({1: [1] * DIM, 3: [1] * DIM})
    dense_grad = nd.ones((2, 3))
    kv.push([0, 1], [grad, dense_grad])
    ((_, (keys, values), _, _),) = [c for c in spy.calls if c[0] == "push"]
    ids, rows = values[0]
    assert rows.ctypes.data == data_pointer(grad)
    assert values[1].ctypes.data == data_pointer(dense_grad)
    out = nd.zeros((2, 2, DIM))
    kv.row_sparse_pull(0, out=out, row_ids=nd.array([[1, 3], [3, 1]]))
    ((_, _, kwargs, _),) = [c for c in spy.calls if c[0] == "row_sparse_pull"]
    assert kwargs["out"][0].ctypes.data == data_pointer(out)
    weight = nd.zeros((2, 3))
    kv.pull(1, out=weight)
    ((_, _, kwargs, _),) = [c for c in spy.calls if c[0] == "pull"]
    assert kwargs["out"][0][0].ctypes.data == data_pointer(weight)


# -- optimizers: mapping and MXNet's own updaters as the reference ------------------------------


def test_optimizer_mapping():
    sgd = kam.optimizer_from_mxnet(
        mx.optimizer.SGD(
            learning_rate=0.3, momentum=0.9, wd=1e-3, rescale_grad=0.5, clip_gradient=2.0
        )
    )
    assert isinstance(sgd, optimizers.SGD) and sgd.settings == {
        "rescale_grad": 0.5,
        "clip_gradient": 2.0,
        "learning_rate": 0.3,
        "momentum": 0.9,
        "nesterov": False,
        "weight_decay": 1e-3,
    }
    nag = kam.optimizer_from_mxnet(mx.optimizer.NAG(momentum=0.8))
    assert nag.settings["nesterov"] and nag.settings["momentum"] == 0.8
    adam = kam.optimizer_from_mxnet(mx.optimizer.Adam(beta1=0.8, epsilon=1e-6))
    assert adam.settings["step_mode"] == "table" and adam.settings["formula"] == "mxnet"
    assert (adam.settings["beta1"], adam.settings["eps"]) == (0.8, 1e-6)
    ftrl = kam.optimizer_from_mxnet(mx.optimizer.Ftrl(lamda1=0.2, beta=0.5, wd=0.3))
    assert (ftrl.settings["l1"], ftrl.settings["l2"], ftrl.settings["beta"]) == (0.2, 0.15, 0.5)
    assert ftrl.settings["initial_accumulator_value"] == 0.0
    rms = kam.optimizer_from_mxnet(mx.optimizer.RMSProp(centered=True, gamma1=0.8, gamma2=0.7))
    assert (rms.settings["alpha"], rms.settings["momentum"], rms.settings["centered"]) == (
        0.8,
        0.7,
        True,
    )
    assert kam.optimizer_from_mxnet(mx.optimizer.AdaGrad(eps=1e-5)).settings["eps"] == 1e-5
    own = optimizers.Adagrad(learning_rate=0.2)
    assert kam.optimizer_from_mxnet(own) is own
    assert (
        kam.optimizer_from_mxnet(mx.optimizer.SGD(clip_gradient=-1.0)).settings["clip_gradient"]
        is None
    )


def test_optimizers_kvsparse_cannot_run_are_refused(kv):
    for optimizer in (
        mx.optimizer.Signum(),
        mx.optimizer.AdaDelta(),
        mx.optimizer.RMSProp(clip_weights=1.0),
        mx.optimizer.Adam(begin_num_update=5),
    ):
        with pytest.raises(errors.InvalidArgument):
            kv.set_optimizer(optimizer)
    with pytest.warns(UserWarning, match="lazy"):
        kam.optimizer_from_mxnet(mx.optimizer.Adam(lazy_update=False))
    with pytest.raises(errors.InvalidArgument, match="NAG with wd"):
        kv.set_optimizer(mx.optimizer.NAG(momentum=0.9, wd=0.1))


def test_a_changed_mxnet_optimizer_is_not_seen_by_the_servers_and_a_warning_says_so(kv):
    # (A changed learning rate is followed: tests/test_mxnet_semantics.py.)
    kv.init(0, nd.zeros((1, 2)))
    optimizer = mx.optimizer.SGD(learning_rate=1.0)
    kv.set_optimizer(optimizer)
    kv.push(0, nd.ones((1, 2)))
    optimizer.rescale_grad = 100.0
    with pytest.warns(UserWarning, match="keep the settings"):
        kv.push(0, nd.ones((1, 2)))
    out = nd.zeros((1, 2))
    kv.pull(0, out=out)
    np.testing.assert_allclose(out.asnumpy(), -2.0)
    kv.set_optimizer(optimizer)  # sends the new settings (slots restart)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kv.push(0, nd.ones((1, 2)))
    kv.pull(0, out=out)
    np.testing.assert_allclose(out.asnumpy(), -102.0)


FULL = {"wd": 0.1, "clip_gradient": 0.3, "rescale_grad": 0.5}
EXACT = {
    "sgd": {"learning_rate": 0.1, "momentum": 0.9, **FULL},
    "sgd_plain": {"learning_rate": 0.1, **FULL},
    "nag_no_wd": {"learning_rate": 0.1, "momentum": 0.9, "clip_gradient": 0.3},
    "adam": {"learning_rate": 0.01, **FULL},
    "adagrad": {"learning_rate": 0.1, "eps": 1e-3, **FULL},
    "rmsprop": {"learning_rate": 0.01, "epsilon": 1e-3, **FULL},
    "rmsprop_centered": {"learning_rate": 0.01, "centered": True, "gamma2": 0.8, **FULL},
    "ftrl": {"learning_rate": 0.1, "lamda1": 0.05, "beta": 0.5, **FULL},
    # MXNet's sparse AdaGrad refuses wd.
    "adagrad_no_wd": {"learning_rate": 0.1, "clip_gradient": 0.3, "rescale_grad": 0.5},
}


def mxnet_optimizer(case):
    name = case.split("_")[0]
    return mx.optimizer.create(name, **EXACT[case])


def run_mxnet_updater(case, weight, grads):
    """MXNet's own update rule (its Updater, as its local store runs it)."""
    updater = mx.optimizer.get_updater(mxnet_optimizer(case))
    weight = weight.copy()
    for grad in grads:
        updater(0, grad, weight)
    return weight.asnumpy()


@pytest.mark.parametrize("case", sorted(EXACT))
def test_optimizers_match_mxnet_on_dense_gradients(kv, case):
    rng = np.random.default_rng(1)
    w0 = rng.normal(size=(5, 3)).astype(np.float32)
    grads = [nd.array(rng.normal(size=(5, 3)).astype(np.float32)) for _ in range(6)]
    expected = run_mxnet_updater(case, nd.array(w0), grads)
    kv.init([0, 1], [nd.array(w0), nd.array(w0).tostype("row_sparse")])
    kv.set_optimizer(mxnet_optimizer(case))
    for grad in grads:
        kv.push([0, 1], [grad, grad])  # a dense key, and a table given every row
    dense = nd.zeros((5, 3))
    kv.pull(0, out=dense)
    np.testing.assert_allclose(dense.asnumpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dense_rows(kv, 1, range(5)), expected, rtol=1e-5, atol=1e-6)


# The optimizers with row_sparse kernels in MXNet, which update only the pushed rows.
LAZY_IN_MXNET = ["sgd", "sgd_plain", "adam", "ftrl", "adagrad_no_wd"]


def sparse_steps(seed=2, rows=8, dim=3, steps=6):
    rng = np.random.default_rng(seed)
    w0 = rng.normal(size=(rows, dim)).astype(np.float32)
    grads = []
    for _ in range(steps):
        ids = np.sort(rng.choice(rows, size=3, replace=False))
        values = rng.normal(size=(3, dim)).astype(np.float32)
        grads.append(nd.sparse.row_sparse_array((values, ids), shape=(rows, dim)))
    return w0, grads


@pytest.mark.parametrize("case", LAZY_IN_MXNET)
def test_lazy_updates_match_mxnet_on_row_sparse_weights(kv, case):
    w0, grads = sparse_steps()
    expected = run_mxnet_updater(case, nd.array(w0).tostype("row_sparse"), grads)
    kv.init(0, nd.array(w0).tostype("row_sparse"))
    kv.set_optimizer(mxnet_optimizer(case))
    for grad in grads:
        kv.push(0, grad)
    np.testing.assert_allclose(dense_rows(kv, 0, range(8)), expected, rtol=1e-5, atol=1e-6)


def test_documented_differences_from_mxnet(kv):
    # (NAG with wd is refused: test_optimizers_kvsparse_cannot_run_are_refused.)
    # RMSProp and NAG have no sparse kernels in MXNet: it updates every row (momentum
    # keeps moving rows absent from the batch). kvsparse updates only the pushed rows.
    w0, grads = sparse_steps(rows=6)
    for name, settings in (("rmsprop", {"learning_rate": 0.01}), ("nag", {"momentum": 0.9})):
        expected = run_mxnet_updater_named(
            name, settings, nd.array(w0).tostype("row_sparse"), grads
        )
        store = kam.create("local")
        store.init(0, nd.array(w0).tostype("row_sparse"))
        store.set_optimizer(mx.optimizer.create(name, **settings))
        for grad in grads:
            store.push(0, grad)
        got = dense_rows(store, 0, range(6))
        # MXNet's own update applied to each step's rows only: the lazy semantics of kvsparse.
        lazy = lazy_reference(name, settings, w0, grads)
        np.testing.assert_allclose(got, lazy, rtol=1e-5, atol=1e-6, err_msg=name)
        assert not np.allclose(got, expected, rtol=1e-5, atol=1e-6), name
        store.close()

    # FTRL on a dense weight with a row_sparse gradient (Embedding(sparse_grad=True)):
    # MXNet densifies the gradient and its update zeroes every row absent from the batch.
    w0, grads = sparse_steps(rows=6, steps=1)
    expected = run_mxnet_updater_named("ftrl", {}, nd.array(w0), grads)
    absent = sorted(set(range(6)) - set(grads[0].indices.asnumpy().tolist()))
    np.testing.assert_array_equal(expected[absent], 0)
    weight = nd.array(w0)
    weight.attach_grad(stype="row_sparse")
    store = kam.create("local")
    store.init(0, weight)
    store.set_optimizer(mx.optimizer.Ftrl())
    store.push(0, grads[0])
    np.testing.assert_array_equal(dense_rows(store, 0, absent), w0[absent])
    store.close()


def lazy_reference(name, settings, w0, grads):
    """MXNet's own update applied to each step's rows only (a dense update of that slice)."""
    updater = mx.optimizer.get_updater(mx.optimizer.create(name, **settings))
    weight = w0.copy()
    state = {}
    for grad in grads:
        ids = grad.indices.asnumpy()
        for position, row in enumerate(ids):
            if row not in state:  # one updater index per row: its own state
                state[row] = len(state) + 1
            piece = nd.array(weight[row : row + 1])
            updater(state[row], nd.array(grad.data.asnumpy()[position : position + 1]), piece)
            weight[row] = piece.asnumpy()[0]
    return weight


def run_mxnet_updater_named(name, settings, weight, grads):
    updater = mx.optimizer.get_updater(mx.optimizer.create(name, **settings))
    weight = weight.copy()
    for grad in grads:
        updater(0, grad, weight)
    return weight.asnumpy()


# -- Gluon's Trainer through the store: parity with MXNet's own local store ------------------


class ParityNet(gluon.Block):
    """A row_sparse table, an Embedding with sparse gradients, and a Dense layer."""

    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.table = self.params.get(
                "table",
                shape=(ROWS, DIM),
                stype="row_sparse",
                grad_stype="row_sparse",
                init=mx.init.Uniform(0.1),
            )
            self.embedding = gluon.nn.Embedding(ROWS, DIM, sparse_grad=True)
            self.dense = gluon.nn.Dense(1, in_units=4 * DIM)

    def forward(self, ids):
        rows = nd.Embedding(ids, self.table.row_sparse_data(ids), ROWS, DIM, sparse_grad=True)
        both = nd.concat(rows, self.embedding(ids), dim=1)
        return self.dense(both.reshape((0, -1)))


BATCH, STEPS = 8, 12
GLUON_CASES = {
    "sgd": {"learning_rate": 0.5},
    "sgd_momentum_wd": {"learning_rate": 0.5, "momentum": 0.9, "wd": 0.01},
    "adam": {"learning_rate": 0.02},
    "adagrad": {"learning_rate": 0.1},
}


def gluon_batches(seed, steps=STEPS, batch=BATCH):
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, ROWS, size=(batch, 2)), rng.integers(0, 2, size=(batch, 1)))
        for _ in range(steps)
    ]


def train_gluon(kvstore, case, contexts=(mx.cpu(),), batches_per_context=None):
    """Trains ParityNet; returns its table, embedding, dense weight and bias as NumPy."""
    mx.random.seed(7)
    net = ParityNet()
    net.initialize(ctx=list(contexts))
    name = case.split("_")[0]
    settings = dict(GLUON_CASES[case], rescale_grad=1.0 / BATCH)
    trainer = gluon.Trainer(net.collect_params(), name, settings, kvstore=kvstore)
    loss_function = gluon.loss.SigmoidBinaryCrossEntropyLoss()
    per_context = batches_per_context or [gluon_batches(0)]
    for step in range(len(per_context[0])):
        losses = []
        with autograd.record():
            for context, batches in zip(contexts, per_context):
                ids, labels = batches[step]
                ids, labels = nd.array(ids, ctx=context), nd.array(labels, ctx=context)
                losses.append(loss_function(net(ids), labels))
        for loss in losses:
            loss.backward()
        trainer.step(1)
    everything = nd.arange(ROWS, ctx=contexts[0])
    return {
        "table": net.table.row_sparse_data(everything).asnumpy(),
        "embedding": net.embedding.weight.data(contexts[0]).asnumpy(),
        "dense": net.dense.weight.data(contexts[0]).asnumpy(),
        "bias": net.dense.bias.data(contexts[0]).asnumpy(),
    }, trainer


def assert_same_model(got, expected):
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("case", sorted(GLUON_CASES))
def test_gluon_trainer_matches_mxnet_local_store(case):
    expected, reference = train_gluon("local", case)
    assert type(reference._kvstore) is mx.kv.KVStore  # MXNet's own store
    store = kam.create("local")
    got, trainer = train_gluon(store, case)
    assert trainer._kvstore is store and trainer._update_on_kvstore
    kinds = {
        p.name.split("_", 1)[1]: store.store.key_info(i).sparse
        for i, p in enumerate(trainer._params)
    }
    assert kinds == {
        "table": True,
        "embedding0_weight": True,
        "dense0_weight": False,
        "dense0_bias": False,
    }
    assert_same_model(got, expected)
    store.close()


@pytest.mark.parametrize("case", ["sgd_momentum_wd", "adam"])
def test_gluon_trainer_with_kvstore_dist_sparse_on_two_servers_matches_mxnet(dist_env, case):
    expected, _ = train_gluon("local", case)
    got, trainer = train_gluon("dist_sparse", case)
    assert isinstance(trainer._kvstore, kam.Dist_Sparse) and trainer._distributed
    assert trainer._kvstore.num_servers == 2
    shards = trainer._kvstore.store.stats()["shards"]
    assert all(shard["tables"] for shard in shards)  # both servers hold rows
    assert_same_model(got, expected)
    trainer._kvstore.close()


WORKER_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, {tests!r})
import test_adapter_mxnet as t
batches = t.gluon_batches(100 + int(os.environ["KVSPARSE_RANK"]), steps=6)
got, trainer = t.train_gluon("dist_sparse", "sgd_momentum_wd", batches_per_context=[batches])
trainer._kvstore.barrier()
trainer._kvstore.close()
print(json.dumps({{k: v.tolist() for k, v in got.items()}}))
"""


def test_two_workers_sum_their_gradients_like_mxnet_devices(server_factory, tmp_path):
    servers = server_factory(2)
    script = WORKER_SCRIPT.format(tests=str(REPO_ROOT / "tests"))
    outputs = run_workers(script, servers, 2, tmp_path, timeout=180)
    results = [{k: np.array(v, np.float32) for k, v in last_json(o).items()} for o in outputs]
    # MXNet's reference: one Trainer over two CPU contexts, one worker's batches each;
    # its local store sums the two gradients and updates once per step, as BSP does.
    expected, _ = train_gluon(
        "local",
        "sgd_momentum_wd",
        contexts=(mx.cpu(0), mx.cpu(1)),
        batches_per_context=[gluon_batches(100, steps=6), gluon_batches(101, steps=6)],
    )
    for result in results:
        assert_same_model(result, expected)


def test_trainer_save_and_load_states_through_the_store(kv, tmp_path):
    mx.random.seed(0)
    net = ParityNet()
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.01}, kvstore=kv)
    ids = nd.array([[1, 2]])
    with autograd.record():
        loss = net(ids).sum()
    loss.backward()
    trainer.step(1)
    path = str(tmp_path / "states.npz")
    trainer.save_states(path)
    trainer.load_states(path)
    assert isinstance(trainer._optimizer, mx.optimizer.Adam)
    with np.load(path) as saved:
        assert json.loads(bytes(saved["meta"]).decode())["optimizer"]["kind"] == "adam"


def test_bad_gradient_compression_and_python_updaters_are_refused(kv):
    with pytest.raises(errors.InvalidArgument, match="greater than 0"):
        kv.set_gradient_compression({"type": "2bit", "threshold": 0})
    with pytest.raises(errors.InvalidArgument, match="unknown gradient compression type"):
        kv.set_gradient_compression({"type": "3bit"})
    with pytest.raises(errors.InvalidArgument):
        kv._set_updater(lambda key, grad, weight: None)
