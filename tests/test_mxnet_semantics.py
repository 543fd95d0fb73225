"""MXNet's distributed-store semantics through ``mx.kv.create('dist_sparse')``.

The multi-worker checks run under ``kvsparse launch -s 2 -n 2`` (2 real servers, 2
workers, started by the launcher as a user's job is) and compare with what MXNet's own
dist-kvstore tests expect (its ``test_dist_sync_kvstore.py`` rules: the "test"
optimizer's ``weight += rescale_grad * grad``), with a NumPy model of MXNet's
2-bit quantizer, and with Gluon over MXNet's local store (two CPU contexts
stand in for the two workers). The dense and row_sparse checks run with float32 and
float16 keys (float16 keys are stored as float16 on the servers, their math in float32).
"""

from __future__ import annotations

import numpy as np
import pytest

if "bool" not in vars(np):
    np.bool = bool  # MXNet 1.9.1 needs it to import
mx = pytest.importorskip("mxnet")

import kvsparse.adapters.mxnet as kam  # noqa: E402
from conftest import REPO_ROOT, last_json, launch_workers  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402

import kvsparse  # noqa: E402
from kvsparse import errors  # noqa: E402
from kvsparse.store.compression import GradientCompression, quantize  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Please import `csr_matrix`:DeprecationWarning")
RATE = 2.0
ROWS, DIM = 20, 3
BIG = (1200, 1200)


@pytest.fixture
def kv():
    store = kam.create("local")
    yield store
    store.close()


# -- errors ---------------------------------------------------------------------------------


def test_errors_of_the_mxnet_store_are_mxnet_errors_and_keep_their_kvsparse_class(kv):
    with pytest.raises(mx.base.MXNetError):
        kv.pull(7, out=nd.zeros((2,)))
    with pytest.raises(errors.UnknownKey) as caught:
        kv.pull(7, out=nd.zeros((2,)))
    assert isinstance(caught.value, KeyError) and type(caught.value).__name__ == "UnknownKey"
    assert "not initialized" in str(caught.value)
    kv.init(0, nd.ones((2,)))
    for bad in (lambda: kv.init(0, nd.ones((2,))), lambda: kv.push(0, nd.ones((3,)))):
        with pytest.raises(mx.base.MXNetError):
            bad()
    with pytest.raises(mx.base.MXNetError):
        kv.set_optimizer(mx.optimizer.Signum())
    plain = kvsparse.create("local")  # plain stores keep today's classes
    with pytest.raises(errors.UnknownKey) as caught:
        plain.pull(7)
    assert not isinstance(caught.value, mx.base.MXNetError)
    plain.close()


# -- optimizers ------------------------------------------------------------------------------


def test_every_registered_mxnet_optimizer_is_mapped_or_refused_by_name(kv):
    registered = sorted(mx.optimizer.Optimizer.opt_registry)
    supported, refused = kam.SUPPORTED_MXNET_OPTIMIZERS, kam.UNSUPPORTED_MXNET_OPTIMIZERS
    assert sorted(supported + refused) == registered
    for name in supported:
        kam.optimizer_from_mxnet(mx.optimizer.create(name))
    for name in refused:
        cls = mx.optimizer.Optimizer.opt_registry[name]
        with pytest.raises(errors.InvalidArgument, match=f"optimizer {cls.__name__} cannot run"):
            kv.set_optimizer(mx.optimizer.create(name))


@pytest.mark.parametrize("multi_precision", [False, True])
def test_the_test_optimizer_and_multi_precision_give_mxnets_values(kv, multi_precision):
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(4, 3)).astype(np.float32)
    grads = [rng.normal(size=(4, 3)).astype(np.float32) for _ in range(3)]
    for name, options in (("test", {"rescale_grad": 0.7}), ("sgd", {"momentum": 0.9})):
        options = dict(options, multi_precision=multi_precision, wd=0.01)
        updater = mx.optimizer.get_updater(mx.optimizer.create(name, **options))
        expected = nd.array(w0)
        for g in grads:
            updater(0, nd.array(g), expected)
        store = kam.create("local")
        store.init(0, nd.array(w0))
        store.set_optimizer(mx.optimizer.create(name, **options))
        for g in grads:
            store.push(0, nd.array(g))
        got = nd.zeros((4, 3))
        store.pull(0, out=got)
        np.testing.assert_allclose(got.asnumpy(), expected.asnumpy(), rtol=1e-6, atol=1e-6)
        store.close()


def _float16_row_sparse_run(store, multi_precision):
    """A float16 row_sparse weight after 20 SGD steps below half a float16 ulp of it."""
    ids = nd.arange(ROWS, dtype="int64")
    store.init(0, nd.sparse.row_sparse_array((nd.ones((ROWS, DIM), dtype="float16"), ids)))
    store.set_optimizer(
        mx.optimizer.SGD(learning_rate=1.0, rescale_grad=0.5, multi_precision=multi_precision)
    )
    rng = np.random.default_rng(0)
    for _ in range(20):
        rows = np.sort(rng.choice(ROWS, 5, replace=False))
        grad = rng.uniform(-9e-4, 0, (5, DIM)).astype(np.float16)  # 0.5 * 9e-4 < 2**-11
        store.push(
            0,
            nd.sparse.row_sparse_array((nd.array(grad, dtype="float16"), rows), shape=(ROWS, DIM)),
        )
    out = nd.sparse.zeros("row_sparse", (ROWS, DIM), dtype="float16")
    store.row_sparse_pull(0, out=out, row_ids=ids)
    return out.asnumpy()


def test_multi_precision_float16_row_sparse_weight_gives_mxnets_values(kv):
    # MXNet runs mp_sgd_update on a dense copy of a row_sparse weight (a storage
    # fallback): exact for rows without gradient only without wd and momentum.
    ours = _float16_row_sparse_run(kv, True)
    assert ours.dtype == np.float16
    np.testing.assert_array_equal(ours, _float16_row_sparse_run(mx.kv.create("local"), True))
    plain = kam.create("local")
    without = _float16_row_sparse_run(plain, False)
    plain.close()
    np.testing.assert_array_equal(without, _float16_row_sparse_run(mx.kv.create("local"), False))
    # The steps round away without the float32 master and add up with it.
    assert (without == 1).all() and (ours > 1).sum() > ROWS


# -- init at any time --------------------------------------------------------------------------


def test_tables_and_dense_keys_initialized_after_pushes_and_set_optimizer(kv):
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0))
    kv.init(0, nd.ones((2, 2)))
    kv.push(0, nd.ones((2, 2)))
    first = nd.sparse.row_sparse_array(
        (nd.array([[5, 6, 7]]), nd.array([4], dtype="int64")), shape=(ROWS, DIM)
    )
    kv.init(1, first)  # after a push: rows verbatim, not a gradient
    weight = nd.arange(ROWS * DIM).reshape((ROWS, DIM))
    weight.attach_grad(stype="row_sparse")
    kv.init(2, weight)
    kv.init(3, nd.full((3,), 4.0))
    out = nd.zeros((2, DIM))
    kv.row_sparse_pull(1, out=out, row_ids=nd.array([4, 0]))
    np.testing.assert_array_equal(out.asnumpy(), [[5, 6, 7], [0, 0, 0]])
    kv.row_sparse_pull(2, out=out, row_ids=nd.array([19, 1]))
    np.testing.assert_array_equal(out.asnumpy(), weight.asnumpy()[[19, 1]])
    kv.push([1, 3], [first, nd.ones((3,))])  # the optimizer runs on the new keys
    kv.row_sparse_pull(1, out=out, row_ids=nd.array([4, 4]))
    np.testing.assert_array_equal(out.asnumpy(), [[0, 0, 0]] * 2)
    dense = nd.zeros((3,))
    kv.pull(3, out=dense)
    np.testing.assert_array_equal(dense.asnumpy(), 3.0)


def test_assign_writes_rows_verbatim_at_any_time_in_a_plain_store():
    store = kvsparse.create("local")
    sgd = kvsparse.optimizers.SGD(learning_rate=0.5)
    zeros = kvsparse.initializers.Zeros()
    store.init("t", kvsparse.SparseTable(dim=2, optimizer=sgd, initializer=zeros))
    store.push("t", (np.array([1]), np.ones((1, 2), np.float32)))
    store.assign("t", (np.array([[1, 2], [1, 3]]), np.arange(8, dtype=np.float32).reshape(2, 2, 2)))
    np.testing.assert_array_equal(
        store.row_sparse_pull("t", row_ids=np.array([1, 2, 3])), [[4, 5], [2, 3], [6, 7]]
    )
    with pytest.raises(errors.InvalidArgument, match="NaN or inf"):
        store.assign("t", (np.array([9]), np.full((1, 2), np.nan, np.float32)))
    store.init("d", np.zeros(2, np.float32))
    with pytest.raises(errors.InvalidArgument, match="dense"):
        store.assign("d", (np.array([0]), np.zeros((1, 2), np.float32)))
    np.testing.assert_array_equal(store.row_sparse_pull("t", row_ids=np.array([9])), [[0, 0]])
    store.close()


# -- lr_mult / wd_mult -----------------------------------------------------------------------


def test_per_key_lr_and_wd_run_as_the_keys_own_server_optimizers(kv):
    optimizer = mx.optimizer.SGD(learning_rate=0.5, wd=0.1, momentum=0.9)
    optimizer.set_lr_mult({1: 2.0})
    optimizer.set_wd_mult({2: 0.0})
    reference = mx.optimizer.get_updater(mx.optimizer.SGD(learning_rate=0.5, wd=0.1, momentum=0.9))
    reference.optimizer.set_lr_mult({1: 2.0})
    reference.optimizer.set_wd_mult({2: 0.0})
    weights = {k: nd.full((2,), float(k + 1)) for k in range(3)}
    for k, w in weights.items():
        kv.init(k, w.copy())
    kv.set_optimizer(optimizer)
    for step in range(3):
        for k in range(3):
            grad = nd.full((2,), 0.5 * (step + 1))
            kv.push(k, grad)
            reference(k, grad, weights[k])
        kv.init(10 + step, nd.ones((2,)))  # keys added later get theirs too
    for k in range(3):
        out = nd.zeros((2,))
        kv.pull(k, out=out)
        np.testing.assert_allclose(out.asnumpy(), weights[k].asnumpy(), rtol=1e-6)
    assert kv.store.key_info(1).own_optimizer and not kv.store.key_info(0).own_optimizer


# -- gradient compression: MXNet's quantizer ----------------------------------------------------


def reference_quantize(kind, grads, threshold):
    """MXNet's quantize kernels, one float32 element at a time: the values sent per push."""
    t = np.float32(threshold)
    residual = np.zeros_like(grads[0])
    sent = []
    for grad in grads:
        out = np.zeros_like(grad)
        for i in np.ndindex(grad.shape):
            residual[i] = np.float32(residual[i] + grad[i])
            if kind == "2bit":
                if residual[i] >= t:
                    out[i], residual[i] = t, np.float32(residual[i] - t)
                elif residual[i] <= -t:
                    out[i], residual[i] = -t, np.float32(residual[i] + t)
            elif residual[i] > t:
                out[i], residual[i] = 1, np.float32(residual[i] - 1)
            else:
                out[i], residual[i] = -1, np.float32(residual[i] + 1)
        sent.append(out)
    return sent


def test_two_bit_below_at_and_above_the_threshold_with_the_residual_carried():
    compression = GradientCompression({"type": "2bit", "threshold": 0.5})
    first = compression.dense("k", np.array([0.4, 0.5, -0.5, 0.7, -1.3, 0.0], np.float32))
    np.testing.assert_array_equal(first, [0, 0.5, -0.5, 0.5, -0.5, 0])
    # residuals now 0.4, 0, 0, 0.2, -0.8, 0: 0.4 + 0.1 reaches the threshold exactly
    second = compression.dense("k", np.array([0.1, 0.0, 0.0, 0.0, 0.0, 0.0], np.float32))
    np.testing.assert_array_equal(second, [0.5, 0, 0, 0, -0.5, 0])
    one_bit = GradientCompression({"type": "1bit", "threshold": 0.0})
    # 1bit: above the threshold +1 (residual - 1), else -1 (residual + 1), zero included.
    np.testing.assert_array_equal(one_bit.dense("k", np.array([0.0, 0.3], np.float32)), [-1, 1])
    np.testing.assert_array_equal(one_bit.dense("k", np.array([-0.9, 0.0], np.float32)), [1, -1])


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["2bit", "1bit"]),
    threshold=st.floats(0.01, 2.0),
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(1, 4),
)
def test_quantizer_matches_a_numpy_model_of_mxnets_kernels(kind, threshold, seed, steps):
    rng = np.random.default_rng(seed)
    grads = [rng.normal(scale=threshold, size=(3, 5)).astype(np.float32) for _ in range(steps)]
    expected = reference_quantize(kind, grads, threshold)
    residual = np.zeros((3, 5), np.float32)
    for grad, want in zip(grads, expected):
        np.testing.assert_array_equal(quantize(kind, grad, residual, threshold), want)
    # Row by row for a sparse table: each row's residual is its own.
    compression = GradientCompression({"type": kind, "threshold": threshold})
    for grad, want in zip(grads, expected):
        order = rng.permutation(3)
        got = compression.sparse("t", np.sort(order[:2]), grad[np.sort(order[:2])])
        compression.sparse("t", np.sort(order[2:]), grad[np.sort(order[2:])])
        np.testing.assert_array_equal(got, want[np.sort(order[:2])])


def test_compression_is_not_applied_to_init_and_fp16_narrows_pushes(kv):
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init(0, nd.full((3,), 0.3))  # not quantized
    kv.set_optimizer(mx.optimizer.create("test"))
    out = nd.zeros((3,))
    kv.pull(0, out=out)
    np.testing.assert_allclose(out.asnumpy(), 0.3)
    kv.push(0, nd.array([0.3, 0.6, -0.9]))
    kv.pull(0, out=out)
    np.testing.assert_allclose(out.asnumpy(), [0.3, 0.8, -0.2], rtol=1e-6)
    kv.set_gradient_compression({"type": "fp16"})
    assert kv.store.wire_dtype == "float16"
    kv.push(0, nd.array([1e-4, 0, 0]))
    kv.pull(0, out=out)
    assert out.asnumpy()[0] == np.float32(0.3) + np.float32(np.float16(1e-4))


# -- 2 workers, 2 servers --------------------------------------------------------------------

WORKER = r"""
import json, os, sys
sys.path.insert(0, {tests!r})
import numpy as np
import test_mxnet_semantics as t
print(json.dumps(t.worker_checks()))
"""


def worker_checks() -> dict:
    """What each worker of the dist test checks and reports (runs in the worker processes)."""
    kv = mx.kv.create("dist_sparse")
    rank, workers = kv.rank, kv.num_workers
    result = {"type": type(kv).__name__, "workers": workers, "servers": kv.num_servers}
    kv.set_optimizer(mx.optimizer.create("test", rescale_grad=RATE))
    for dtype in ("float32", "float16"):
        result[dtype] = dense_and_row_sparse_checks(kv, rank, dtype)
    # init of 100 keys of mixed dtypes, after pushes began.
    dtypes = ["float32", "float16", "float64"]
    keys = [f"mixed{i}" for i in range(100)]
    kv.init(keys, [nd.full((2, 2), i, dtype=dtypes[i % 3]) for i in range(100)])
    outs = [nd.zeros((2, 2)) for _ in keys]
    kv.pull(keys, out=outs)
    result["mixed"] = [float(o.asnumpy()[0, 0]) for o in outs]
    # An invalid key.
    try:
        kv.pull("missing", out=nd.zeros((2,)))
    except mx.base.MXNetError as exc:
        result["invalid"] = [type(exc).__name__, isinstance(exc, errors.UnknownKey)]
    # 2-bit compression, dense and row_sparse, on keys initialized after the rest.
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init("c", nd.zeros((4,)))
    kv.init("crsp", nd.zeros((ROWS, DIM)).tostype("row_sparse"))
    for step_grad in compressed_grads(rank):
        kv.push("c", nd.array(step_grad))
        rows = nd.sparse.row_sparse_array(
            (nd.array(np.tile(step_grad[:2, None], (1, DIM))), nd.array([2, 5], dtype="int64")),
            shape=(ROWS, DIM),
        )
        kv.push("crsp", rows)
    dense = nd.zeros((4,))
    kv.pull("c", out=dense)
    result["compressed"] = dense.asnumpy().tolist()
    rsp = nd.zeros((2, DIM))
    kv.row_sparse_pull("crsp", out=rsp, row_ids=nd.array([2, 5]))
    result["compressed_rsp"] = rsp.asnumpy()[:, 0].tolist()
    kv.barrier()
    kv.close()
    return result


def dense_and_row_sparse_checks(kv, rank: int, dtype: str) -> dict:
    """Dense keys small and 1200 x 1200, and a row_sparse key with duplicate float row ids,
    empty row ids and all-zero gradients, all of dtype, under MXNet's test optimizer."""
    result = {}
    small_key, big_key, rsp_key = f"small_{dtype}", f"big_{dtype}", f"rsp_{dtype}"
    kv.init(small_key, nd.ones((3, 2), dtype=dtype))
    kv.init(big_key, nd.ones(BIG, dtype=dtype))
    for _ in range(2):
        kv.push(
            [small_key, big_key],
            [nd.ones((3, 2), dtype=dtype) * (rank + 1), nd.ones(BIG, dtype=dtype) * (rank + 1)],
        )
    small, big = nd.zeros((3, 2), dtype=dtype), nd.zeros(BIG, dtype=dtype)
    kv.pull([small_key, big_key], out=[small, big])
    result["dtypes"] = [str(small.dtype.__name__), str(big.dtype.__name__)]
    result["small"] = float(np.unique(small.asnumpy()).item())
    result["big"] = np.unique(big.asnumpy()).tolist()
    kv.init(rsp_key, nd.ones((ROWS, DIM), dtype=dtype).tostype("row_sparse"))
    grad = nd.sparse.row_sparse_array(
        (nd.ones((2, DIM), dtype=dtype) * (rank + 1), nd.array([1, 3 + rank], dtype="int64")),
        shape=(ROWS, DIM),
    )
    kv.push(rsp_key, grad)
    kv.push(rsp_key, nd.sparse.zeros("row_sparse", (ROWS, DIM), dtype=dtype))
    out = nd.sparse.zeros("row_sparse", (ROWS, DIM), dtype=dtype)
    kv.row_sparse_pull(rsp_key, out=out, row_ids=nd.array([3, 1, 1, 4, 3, 0], dtype="float32"))
    result["rsp_dtype"] = str(out.data.dtype.__name__)
    result["rsp_indices"] = out.indices.asnumpy().tolist()
    result["rsp_rows"] = out.data.asnumpy()[:, 0].astype(float).tolist()
    empty = nd.sparse.zeros("row_sparse", (ROWS, DIM), dtype=dtype)
    kv.row_sparse_pull(rsp_key, out=empty, row_ids=nd.array([], dtype="float32"))
    result["empty_nnz"] = int(empty.indices.shape[0])
    return result


def compressed_grads(rank):
    """Per step, the gradient worker `rank` pushes: below, at and above 0.5, carried residuals."""
    base = np.array([0.4, 0.5, -0.7, 0.2], np.float32) * (rank + 1)
    return [base, base, np.array([0.1, 0.0, 0.0, -0.3], np.float32)]


def test_mxnet_dist_store_semantics_with_two_workers_and_two_servers(tmp_path):
    script = WORKER.format(tests=str(REPO_ROOT / "tests"))
    outputs = launch_workers(script, 2, 2, tmp_path, timeout=300)
    results = [last_json(o) for o in outputs]
    # MXNet's test_dist_sync_kvstore rule: (n + 1) n / 2 * rate * repeats + 1.
    expected = 1 + (2 + 1) * 2 / 2 * RATE * 2
    for result in results:
        assert result["type"] == "Dist_Sparse" and result["workers"] == result["servers"] == 2
        for dtype in ("float32", "float16"):  # every value here is exact in float16
            checks = result[dtype]
            assert checks["dtypes"] == [dtype, dtype] and checks["rsp_dtype"] == dtype
            assert checks["small"] == expected and checks["big"] == [expected]
            # rows 1 (both workers), 3 (rank 0), 4 (rank 1) moved; duplicates and 0 as given.
            assert checks["rsp_indices"] == [0, 1, 3, 4]
            assert checks["rsp_rows"] == [1, 1 + RATE * 3, 1 + RATE, 1 + RATE * 2]
            assert checks["empty_nnz"] == 0
        assert result["mixed"] == [float(i) for i in range(100)]
        assert result["invalid"] == ["UnknownKey", True]
        sent = [reference_quantize("2bit", compressed_grads(rank), 0.5) for rank in range(2)]
        want = RATE * np.sum([np.sum(s, axis=0) for s in sent], axis=0)
        np.testing.assert_allclose(result["compressed"], want, rtol=1e-6)
        np.testing.assert_allclose(result["compressed_rsp"], want[:2], rtol=1e-6)


# -- Gluon's Trainer -------------------------------------------------------------------------

# case: (update_on_kvstore, embedding weight stype, lr_mult of the embedding)
GLUON_CASES = {
    f"{update}_{weights}": (update, weights, 2.0)
    for update in (True, False, None)
    for weights in ("default", "row_sparse")
}


class Net(gluon.Block):
    """An embedding (a default or row_sparse weight) and a Dense layer with a bias."""

    def __init__(self, weights: str, **kw):
        super().__init__(**kw)
        self.weights = weights
        with self.name_scope():
            self.table = self.params.get(
                "table",
                shape=(ROWS, DIM),
                stype=weights,
                grad_stype=weights,
                init=mx.init.Uniform(0.1),
            )
            self.dense = gluon.nn.Dense(1, in_units=2 * DIM)

    def forward(self, ids):
        ctx = ids.context
        table = (
            self.table.row_sparse_data(ids) if self.weights != "default" else self.table.data(ctx)
        )
        rows = nd.Embedding(ids, table, ROWS, DIM, sparse_grad=self.weights != "default")
        return self.dense(rows.reshape((0, -1)))


def batches(seed, steps=4, batch=6):
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, ROWS, size=(batch, 2)), rng.integers(0, 2, size=(batch, 1)))
        for _ in range(steps)
    ]


def train(case, kvstore, contexts, per_context) -> dict:
    """Trains Net under GLUON_CASES[case]; its weights as lists."""
    update_on_kvstore, weights, lr_mult = GLUON_CASES[case]
    mx.random.seed(3)
    net = Net(weights)
    net.initialize(ctx=contexts)
    net.table.lr_mult = lr_mult
    net.dense.bias.wd_mult = 0.0
    trainer = gluon.Trainer(
        net.collect_params(),
        "sgd",
        {"learning_rate": 0.3, "momentum": 0.5, "wd": 0.05, "rescale_grad": 1 / 12},
        kvstore=kvstore,
        update_on_kvstore=update_on_kvstore,
    )
    loss_function = gluon.loss.SigmoidBinaryCrossEntropyLoss()
    for step in range(len(per_context[0])):
        losses = []
        with autograd.record():
            for context, steps in zip(contexts, per_context):
                ids, labels = steps[step]
                ids, labels = nd.array(ids, ctx=context), nd.array(labels, ctx=context)
                losses.append(loss_function(net(ids), labels))
        for loss in losses:
            loss.backward()
        trainer.step(1)
    everything = nd.arange(ROWS, ctx=contexts[0])
    table = net.table.row_sparse_data(everything) if weights != "default" else net.table.data()
    return {
        "table": table.asnumpy().tolist(),
        "dense": net.dense.weight.data(contexts[0]).asnumpy().tolist(),
        "bias": net.dense.bias.data(contexts[0]).asnumpy().tolist(),
    }


def trained(case, rank):
    """A worker's Gluon run of case over dist_sparse ('ValueError' if Gluon refuses it)."""
    try:
        return train(case, "dist_sparse", [mx.cpu()], [batches(rank)])
    except ValueError:
        return "ValueError"


GLUON_WORKER = r"""
import json, os, sys
sys.path.insert(0, {tests!r})
import test_mxnet_semantics as t
print(json.dumps(t.trained({case!r}, int(os.environ["KVSPARSE_RANK"]))))
"""


@pytest.mark.parametrize("case", sorted(GLUON_CASES))
def test_gluon_trainer_over_dist_sparse_matches_mxnets_local_store(case, tmp_path):
    script = GLUON_WORKER.format(tests=str(REPO_ROOT / "tests"), case=case)
    results = [last_json(o) for o in launch_workers(script, 2, 2, tmp_path, timeout=180)]
    update_on_kvstore, weights, _ = GLUON_CASES[case]
    if weights == "row_sparse" and update_on_kvstore is False:
        with pytest.raises(ValueError, match="update_on_kvstore=False"):
            train(case, "local", [mx.cpu(0), mx.cpu(1)], [batches(0), batches(1)])
        assert results == ["ValueError", "ValueError"]  # as MXNet's own store
        return
    reference = train(case, "local", [mx.cpu(0), mx.cpu(1)], [batches(0), batches(1)])
    for result in results:
        for name, values in reference.items():
            np.testing.assert_allclose(result[name], values, rtol=1e-5, atol=1e-6, err_msg=name)


def test_assign_sparse_and_per_table_set_optimizer_on_the_wire():
    from kvsparse.wire import ops, protocol
    from kvsparse.wire.protocol import Header, Op

    keys, rows = np.array([3, 9], np.int64), np.ones((2, 4), np.float32)
    request = ops.AssignSparse.encode_request([(7, keys, rows)])
    header = Header(op=int(Op.ASSIGN_SPARSE), num_items=1, num_frames=3)
    frames = [bytes(memoryview(f)) for f in request.frames]
    _, [(table_id, got_keys, got_rows)] = ops.AssignSparse.decode_request(header, frames)
    assert table_id == 7 and got_keys.tolist() == [3, 9] and got_rows.shape == (2, 4)
    half = protocol.make_items([(7, 2, 4, protocol.item_dtype_flags("float16"))]).tobytes()
    with pytest.raises(errors.ProtocolError, match="assigned rows travel as float32"):
        ops.AssignSparse.decode_request(header, [half, *frames[1:]])
    with pytest.raises(errors.ProtocolError, match="ASSIGN_SPARSE rows 0"):
        ops.AssignSparse.decode_request(header, [frames[0], frames[1], frames[2][:-4]])
    set_one = ops.SetOptimizer.encode_request(None, 3, table_ids=[7, 8])
    decoded = ops.SetOptimizer.decode_request(Header(op=int(Op.SET_OPTIMIZER)), set_one.frames)
    assert decoded.table_ids == [7, 8] and decoded.epoch == 3 and not decoded.replay
    bad = protocol.encode_json({"spec": None, "epoch": 1, "table_ids": []})
    with pytest.raises(errors.ProtocolError, match="table_ids"):
        ops.SetOptimizer.decode_request(Header(op=int(Op.SET_OPTIMIZER)), [bad])


# -- learning-rate changes ------------------------------------------------------------------


def _adagrad(case):
    if case == "lr_scheduler":
        scheduler = mx.lr_scheduler.FactorScheduler(step=2, factor=0.1)
        return mx.optimizer.AdaGrad(learning_rate=0.5, lr_scheduler=scheduler)
    return mx.optimizer.AdaGrad(learning_rate=0.5)


@pytest.mark.parametrize("case", ["set_learning_rate", "lr_scheduler"])
def test_a_changed_learning_rate_reaches_the_servers_and_keeps_the_history(kv, case):
    """MXNet's updater and the store, fed the same pushes: the rate drops after two of
    them (optimizer.set_learning_rate, or the scheduler), AdaGrad's history stays."""
    rng = np.random.default_rng(1)
    w0 = rng.normal(size=(4, 3)).astype(np.float32)
    grads = [rng.normal(size=(4, 3)).astype(np.float32) for _ in range(5)]
    reference, optimizer = _adagrad(case), _adagrad(case)
    updater = mx.optimizer.get_updater(reference)
    expected = nd.array(w0)
    kv.init(0, nd.array(w0))
    kv.set_optimizer(optimizer)
    for step, g in enumerate(grads):
        if case == "set_learning_rate" and step == 2:
            reference.set_learning_rate(0.05)
            optimizer.set_learning_rate(0.05)
        updater(0, nd.array(g), expected)
        kv.push(0, nd.array(g))
    got = nd.zeros((4, 3))
    kv.pull(0, out=got)
    np.testing.assert_allclose(got.asnumpy(), expected.asnumpy(), rtol=1e-5, atol=1e-6)


def test_trainer_set_learning_rate_reaches_the_servers(kv):
    """Gluon's Trainer.set_learning_rate mid-training: the same weights as MXNet's own
    local update, with a parameter whose lr_mult gives it its own rate."""

    def run(kvstore):
        mx.random.seed(3)
        net = gluon.nn.Dense(2, in_units=3)
        net.initialize()
        net.bias.lr_mult = 0.5
        trainer = gluon.Trainer(
            net.collect_params(), "adagrad", {"learning_rate": 0.5}, kvstore=kvstore
        )
        rng = np.random.default_rng(0)
        for step in range(4):
            if step == 2:
                trainer.set_learning_rate(0.05)
            x = nd.array(rng.normal(size=(4, 3)))
            with autograd.record():
                loss = net(x).sum()
            loss.backward()
            trainer.step(4)
        return net.weight.data().asnumpy(), net.bias.data().asnumpy()

    for got, expected in zip(run(kv), run(None)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
