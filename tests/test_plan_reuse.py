"""Plan once per step: a push of the ids just pulled reuses the pull's plan.

Every test counts `_core.plan_batch` calls and compares the store's results with
a store that plans every call afresh (``kv._plans.enabled = False``) or with a
NumPy reference: reuse must change how often ids are planned, never a result.
The adapters' tests show one planning per training step.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvsparse
from kvsparse import _core, initializers, optimizers
from kvsparse.store.plans import PLANS_PER_TABLE, BatchPlan, PlanCache

DIM = 4


class PlanCounter:
    """Stands in for `_core.plan_batch`; counts the calls."""

    def __init__(self, plan_batch):
        self._plan_batch = plan_batch
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, ids, num_shards, boundaries=None):
        with self._lock:
            self.calls += 1
        return self._plan_batch(ids, num_shards, boundaries)


@pytest.fixture
def plans(monkeypatch):
    counter = PlanCounter(_core.plan_batch)
    monkeypatch.setattr(_core, "plan_batch", counter)
    return counter


def adagrad_store(reuse=True, keys=("user",)):
    kv = kvsparse.create("local")
    kv._plans.enabled = reuse
    for key in keys:
        kv.init(
            key,
            kvsparse.SparseTable(
                dim=DIM,
                initializer=initializers.Normal(0, 0.01),
                optimizer=optimizers.Adagrad(learning_rate=0.1),
                seed=3,
            ),
        )
    return kv


@pytest.fixture
def kv():
    store = adagrad_store()
    yield store
    store.close()


@pytest.fixture
def fresh():
    """The same tables, planning every call afresh: what every result must equal."""
    store = adagrad_store(reuse=False)
    yield store
    store.close()


def grads_for(ids, seed=0):
    return np.random.default_rng(seed).standard_normal(np.shape(ids) + (DIM,)).astype(np.float32)


def assert_same_tables(kv, other, ids, key="user"):
    np.testing.assert_array_equal(
        kv.row_sparse_pull(key, row_ids=ids), other.row_sparse_pull(key, row_ids=ids)
    )


# -- reuse ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(12,), (3, 4), (0,)])
def test_a_push_of_the_pulled_ids_reuses_the_plan(kv, fresh, plans, shape):
    ids = np.random.default_rng(1).integers(0, 6, shape)
    grads = grads_for(ids)
    for store in (kv, fresh):
        store.row_sparse_pull("user", row_ids=ids)
    before = plans.calls
    kv.push("user", (ids, grads))
    assert plans.calls == before and kv._plans.reused == 1
    fresh.push("user", (ids, grads))
    assert plans.calls == before + 1
    assert_same_tables(kv, fresh, np.arange(6))


def test_ids_of_another_dtype_or_shape_with_the_same_flat_values_reuse(kv, fresh, plans):
    ids = np.array([[5, 1], [5, 2]], np.int64)
    for store in (kv, fresh):
        store.row_sparse_pull("user", row_ids=ids)
    before = plans.calls
    flat32 = ids.reshape(-1).astype(np.int32)  # what an adapter that flattens pushes
    kv.push("user", (flat32, grads_for(flat32)))
    assert plans.calls == before
    fresh.push("user", (flat32, grads_for(flat32)))
    assert_same_tables(kv, fresh, np.arange(6))


def test_a_second_pull_of_the_same_ids_reuses_the_plan(kv, plans):
    ids = np.array([4, 4, 9])
    first = kv.row_sparse_pull("user", row_ids=ids)
    second = kv.row_sparse_pull("user", row_ids=ids.copy())
    assert plans.calls == 1
    np.testing.assert_array_equal(first, second)


def test_a_step_plans_once_over_many_steps(kv, fresh, plans):
    rng = np.random.default_rng(2)
    for step in range(10):
        ids = rng.integers(0, 30, 16)
        np.testing.assert_array_equal(
            kv.row_sparse_pull("user", row_ids=ids), fresh.row_sparse_pull("user", row_ids=ids)
        )
        kv.push("user", (ids, grads_for(ids, step)))
        fresh.push("user", (ids, grads_for(ids, step)))
    assert kv._plans.planned == 10 and kv._plans.reused == 10
    assert_same_tables(kv, fresh, np.arange(30))


def test_tables_pulled_with_the_same_ids_share_one_plan(plans):
    # The fields of one batch in two tables (the DeepFM example's first order and vectors).
    stores = [adagrad_store(reuse, keys=("user", "item")) for reuse in (True, False)]
    kv, fresh = stores
    try:
        rng = np.random.default_rng(5)
        for step in range(4):
            ids = rng.integers(0, 20, (6, 3))
            other = rng.integers(0, 20, 7)  # "item" alone now and then: its own plan
            for store in stores:
                store.row_sparse_pull(["user", "item"], row_ids=[ids, ids.copy()])
                store.push(["user", "item"], [(ids, grads_for(ids, step))] * 2)
                if step % 2:
                    store.row_sparse_pull("item", row_ids=other)
                    store.push("item", (other, grads_for(other, step + 9)))
        assert plans.calls == 4 + 2 + 4 * 4 + 2 * 2  # reuse: 4 + 2; fresh: 2 per call
        assert (kv._plans.planned, kv._plans.reused) == (6, 4 + 8 + 2)
        for key in ("user", "item"):
            assert_same_tables(kv, fresh, np.arange(20), key)
    finally:
        for store in stores:
            store.close()


# -- anything else plans afresh -------------------------------------------------------------


def _other_values(ids):
    return ids + 1


def _other_size(ids):
    return ids[:-1]


def _permuted(ids):
    return ids[::-1].copy()


def _duplicated_last(ids):
    return np.concatenate([ids[:-1], ids[-2:-1]])


@pytest.mark.parametrize("change", [_other_values, _other_size, _permuted, _duplicated_last])
def test_a_push_of_other_ids_plans_afresh(kv, fresh, plans, change):
    ids = np.array([3, 8, 3, 1, 6, 8])
    pushed = change(ids)
    for store in (kv, fresh):
        store.row_sparse_pull("user", row_ids=ids)
        store.push("user", (pushed, grads_for(pushed)))
    assert kv._plans.reused == 0
    assert_same_tables(kv, fresh, np.arange(10))


def test_ids_refilled_in_place_after_the_pull_are_planned_afresh(kv, fresh, plans):
    for store in (kv, fresh):
        ids = np.array([3, 8, 3, 1])
        store.row_sparse_pull("user", row_ids=ids)
        ids[1] = 5  # the caller's buffer, refilled: the store kept its own copy
        store.push("user", (ids, grads_for(ids)))
    assert kv._plans.reused == 0 and plans.calls == 4
    assert_same_tables(kv, fresh, np.arange(10))


def test_a_pushed_list_of_pairs_plans_afresh(kv, fresh, plans):
    ids = np.array([3, 8, 3, 1])
    for store in (kv, fresh):
        store.row_sparse_pull("user", row_ids=ids)
        store.push("user", [(ids[:2], grads_for(ids[:2])), (ids[2:], grads_for(ids[2:], 1))])
    assert kv._plans.reused == 0
    assert_same_tables(kv, fresh, np.arange(10))


def test_a_push_to_another_table_plans_afresh(plans):
    kv, fresh = adagrad_store(keys=("a", "b")), adagrad_store(False, keys=("a", "b"))
    ids = np.array([2, 7, 2])
    for store in (kv, fresh):
        store.row_sparse_pull("a", row_ids=ids)
        store.push("b", (ids, grads_for(ids)))
    assert kv._plans.reused == 0
    for key in ("a", "b"):
        assert_same_tables(kv, fresh, np.arange(8), key)
    kv.close()
    fresh.close()


def test_a_plan_serves_only_its_shard_count_and_partitioner(plans):
    cache = PlanCache()
    ids = np.array([10, -4, 10, 99], np.int64)
    pulled = cache.for_pull(1, ids, 2, None)
    assert cache.for_push(1, ids.copy(), 2, None) is pulled
    assert cache.for_push(2, ids, 2, None) is not pulled  # another table
    for num_shards, boundaries in [(3, None), (2, [0]), (1, None)]:
        plan = cache.for_push(1, ids, num_shards, boundaries)
        assert plan is not pulled and plan.num_shards == num_shards
        keys, offsets, slot = plans._plan_batch(ids, num_shards, boundaries)
        for got, want in zip((plan.keys, plan.offsets, plan.slot), (keys, offsets, slot)):
            np.testing.assert_array_equal(got, want)
    ranged = cache.for_pull(3, ids, 2, [0])
    assert cache.for_push(3, ids, 2, [50]) is not ranged
    assert cache.for_push(3, ids, 2, [0]) is ranged


def test_plans_are_read_only_and_keep_a_private_copy_of_the_ids():
    ids = np.array([1, 2, 1], np.int64)
    plan = BatchPlan.make(ids, 2, None, keep_ids=True)
    assert not np.shares_memory(plan.ids, ids)
    for array in (plan.ids, plan.keys, plan.offsets, plan.slot):
        assert not array.flags.writeable
    assert BatchPlan.make(ids, 2, None, keep_ids=False).matches(ids, 2, None) is False


# -- bounded memory -------------------------------------------------------------------------


def test_at_most_a_few_plans_per_table_released_on_close(plans):
    kv = adagrad_store(keys=("a", "b"))
    for step in range(3 * PLANS_PER_TABLE):
        kv.row_sparse_pull("a", row_ids=np.arange(step, step + 5))
        kv.row_sparse_pull("b", row_ids=np.arange(step, step + 5))
        assert len(kv._plans) <= 2 * PLANS_PER_TABLE
    assert len(kv._plans) == 2 * PLANS_PER_TABLE
    # The last pulls are kept: the latest batches still reuse.
    before = plans.calls
    last = np.arange(3 * PLANS_PER_TABLE - 1, 3 * PLANS_PER_TABLE + 4)
    kv.push("a", (last, grads_for(last)))
    assert plans.calls == before
    kv.close()
    assert len(kv._plans) == 0


def test_a_load_forgets_the_plans(tmp_path):
    kv = adagrad_store()
    kv.row_sparse_pull("user", row_ids=np.array([1, 2]))
    kv.save(str(tmp_path))
    assert len(kv._plans) == 1
    kv.load(str(tmp_path))
    assert len(kv._plans) == 0
    kv.close()


# -- threads --------------------------------------------------------------------------------


def test_pull_on_one_thread_push_on_another_reuses(kv, fresh, plans):
    """The torch adapter's prefetch pulls on a thread of its own; backward pushes on another."""
    ids = np.array([6, 2, 6, 9])
    thread = threading.Thread(target=kv.row_sparse_pull, args=("user",), kwargs={"row_ids": ids})
    thread.start()
    thread.join()
    kv.push("user", (ids, grads_for(ids)))
    assert plans.calls == 1
    fresh.row_sparse_pull("user", row_ids=ids)
    fresh.push("user", (ids, grads_for(ids)))
    assert_same_tables(kv, fresh, np.arange(10))


THREADS = PLANS_PER_TABLE + 2  # more threads stepping at once than plans kept per table
STEPS = 40
ROWS = 64


def test_threads_interleaving_pulls_and_pushes_match_a_sequential_reference(plans):
    """Each thread steps through batches of its own (some equal to another thread's).

    The store is called under one lock per call, as the adapters do, so a
    thread's pull and push have other threads' calls between them; another
    thread's pull plan must never serve a push of other ids. SGD with lr 1
    and integer gradients makes every sum exact whatever the order, so the
    NumPy reference, updated under the same lock, is exact.
    """
    kv = kvsparse.create("local")
    kv.init(
        "user",
        kvsparse.SparseTable(
            dim=DIM,
            initializer=initializers.Zeros(),
            optimizer=optimizers.SGD(learning_rate=1.0),
        ),
    )
    reference = np.zeros((ROWS, DIM), np.float32)
    shared = [np.random.default_rng(100 + i).integers(0, ROWS, 24) for i in range(3)]
    lock = threading.Lock()
    failures = []
    calls = []  # (thread, 'pull' or 'push'), in the order the store saw them

    def worker(index):
        rng = np.random.default_rng(index)
        chooser = random.Random(index)
        try:
            for _ in range(STEPS):
                if chooser.random() < 0.3:
                    ids = chooser.choice(shared).copy()
                else:
                    ids = rng.integers(0, ROWS, int(rng.integers(1, 40)))
                with lock:
                    rows = kv.row_sparse_pull("user", row_ids=ids)
                    np.testing.assert_array_equal(rows, reference[ids])
                    calls.append((index, "pull"))
                time.sleep(0)  # let another thread's calls come between this pull and push
                if chooser.random() < 0.2:
                    ids[rng.integers(0, ids.size)] = rng.integers(0, ROWS)  # refilled in place
                grads = rng.integers(-3, 4, ids.shape + (DIM,)).astype(np.float32)
                with lock:
                    kv.push("user", (ids, grads))
                    np.add.at(reference, ids, -grads)
                    calls.append((index, "push"))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]
    # Pushes that came right after another thread's call: the interleaving happened.
    pairs = zip(calls, calls[1:])
    assert any(op == "push" and before != thread for (before, _), (thread, op) in pairs)
    np.testing.assert_array_equal(kv.row_sparse_pull("user", row_ids=np.arange(ROWS)), reference)
    assert kv._plans.reused > 0  # pushes did reuse, under interleaving
    assert kv._plans.reused + kv._plans.planned == 2 * THREADS * STEPS + 1
    kv.close()


def test_a_plan_cache_called_from_many_threads_at_once_gives_each_ids_their_plan(plans):
    """PlanCache says it is safe to share between threads: no lock here, only the cache's own."""
    cache = PlanCache()
    pool = [np.random.default_rng(i).integers(0, 50, 32) for i in range(8)]
    expected = [plans._plan_batch(ids, 2, None) for ids in pool]
    failures = []

    def worker(index):
        chooser = random.Random(index)
        try:
            for _ in range(200):
                which = chooser.randrange(len(pool))
                ids = pool[which].copy()
                call = cache.for_pull if chooser.random() < 0.5 else cache.for_push
                plan = call(chooser.randrange(2), ids, 2, None)
                for got, want in zip((plan.keys, plan.offsets, plan.slot), expected[which]):
                    np.testing.assert_array_equal(got, want)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]
    assert cache.reused > 0 and len(cache) <= 2 * PLANS_PER_TABLE
    assert cache.reused + cache.planned == 200 * THREADS


# -- property: any sequence, with or without reuse, the same tables --------------------------

_POOL = [
    np.array(ids, np.int64) for ids in ([1, 2, 3], [3, 2, 1], [1, 1, 1], [7], [2, 9, 2, 9], [])
]
_op = st.tuples(
    st.sampled_from(["pull", "push", "push_pulled", "refill_then_push", "push_list"]),
    st.sampled_from(["a", "b"]),
    st.integers(0, len(_POOL) - 1),
    st.integers(0, 2**16),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.lists(_op, max_size=25))
def test_property_reuse_never_changes_a_result(operations):
    kv, fresh = adagrad_store(keys=("a", "b")), adagrad_store(False, keys=("a", "b"))
    last = {}  # key -> the id buffer last pulled (each store its own)
    try:
        for kind, key, index, seed in operations:
            buffers = [_POOL[index].copy(), _POOL[index].copy()]
            if kind == "pull":
                got = kv.row_sparse_pull(key, row_ids=buffers[0])
                np.testing.assert_array_equal(got, fresh.row_sparse_pull(key, row_ids=buffers[1]))
                last[key] = buffers
                continue
            if kind in ("push_pulled", "refill_then_push") and key in last:
                buffers = last[key]
                if kind == "refill_then_push" and buffers[0].size:
                    for ids in buffers:
                        ids[seed % ids.size] = seed % 11
            grads = grads_for(buffers[0], seed)
            for store, ids in zip((kv, fresh), buffers):
                if kind == "push_list":
                    store.push(key, [(ids, grads), (ids[:1], grads[:1])])
                else:
                    store.push(key, (ids, grads))
        for key in ("a", "b"):
            assert_same_tables(kv, fresh, np.arange(12), key)
    finally:
        kv.close()
        fresh.close()


# -- the adapters: one planning per training step --------------------------------------------


def test_torch_embedding_bag_and_prefetch_plan_once_per_step(plans):
    torch = pytest.importorskip("torch")
    from kvsparse.adapters.torch import Embedding, EmbeddingBag

    kv = kvsparse.create("local")
    emb = Embedding(kv, "emb", DIM, optimizer=optimizers.Adagrad(learning_rate=0.1))
    bag = EmbeddingBag(kv, "bag", DIM, mode="mean", optimizer=optimizers.SGD(learning_rate=0.1))
    batches = [
        torch.randint(0, 50, (8, 3), generator=torch.Generator().manual_seed(s)) for s in range(6)
    ]
    for module in (emb, bag):
        before = plans.calls
        for ids in batches:
            module(ids).sum().backward()
        assert plans.calls - before == len(batches), type(module).__name__
    before = plans.calls
    emb.prefetch(batches[0])
    for step, ids in enumerate(batches):
        rows = emb(ids)
        rows.sum().backward()
        if step + 1 < len(batches):
            emb.prefetch(batches[step + 1])  # pulled on another thread
    assert emb.prefetch_hits == len(batches)
    assert plans.calls - before == len(batches)
    kv.close()


def test_tensorflow_layer_plans_once_per_step_eagerly_and_in_fit(plans):
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    from kvsparse.adapters import tensorflow as kvtf

    kv = kvsparse.create("local")
    emb = kvtf.Embedding(kv, "tf", DIM, optimizer=optimizers.SGD(learning_rate=0.1))
    rng = np.random.default_rng(0)
    before = plans.calls
    for _ in range(4):
        ids = tf.constant(rng.integers(0, 50, (8, 3)))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(emb(ids))
        tape.gradient(loss, emb.trainable_variables)
    assert emb.pushes == 4 and plans.calls - before == 4

    inputs = keras.Input((3,), dtype="int64")
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inputs))))
    model.compile(optimizer="sgd", loss="mse")
    before, pushes = plans.calls, emb.pushes
    model.fit(rng.integers(0, 50, (32, 3)), np.zeros((32, 1)), batch_size=8, epochs=1, verbose=0)
    assert emb.pushes - pushes == 4 and plans.calls - before == 4
    kv.close()


def test_jax_lookup_plans_once_per_step(plans):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from kvsparse.adapters.jax import embedding_lookup, make_anchor

    kv = kvsparse.create("local")
    kv.init("jax", kvsparse.SparseTable(dim=DIM, optimizer=optimizers.SGD(learning_rate=0.1)))
    rng = np.random.default_rng(0)
    anchor = make_anchor()
    for make_ids in (np.asarray, lambda ids: jnp.asarray(ids, jnp.int32)):
        before = plans.calls
        for _ in range(3):
            ids = make_ids(rng.integers(0, 50, (4, 2)))
            jax.grad(lambda a, i=ids: embedding_lookup(kv, "jax", i, anchor=a).sum())(anchor)
        assert plans.calls - before == 3
    kv.close()


# MXNet 1.9.1's nd.array still reaches for scipy.sparse.csr, deprecated by SciPy.
@pytest.mark.filterwarnings("ignore:Please import `csr_matrix`:DeprecationWarning")
def test_mxnet_gluon_trainer_plans_once_per_step(plans):
    kam = pytest.importorskip("kvsparse.adapters.mxnet")
    import mxnet as mx
    from mxnet import autograd, gluon, nd

    rows = 40

    class Net(gluon.Block):
        def __init__(self, **kw):
            super().__init__(**kw)
            with self.name_scope():
                self.table = self.params.get(
                    "table", shape=(rows, DIM), stype="row_sparse", grad_stype="row_sparse"
                )

        def forward(self, ids):
            weight = self.table.row_sparse_data(ids)
            return nd.Embedding(ids, weight, rows, DIM, sparse_grad=True).sum()

    kv = kam.create("local")
    net = Net()
    net.initialize(mx.init.Uniform(0.1))
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kv)
    rng = np.random.default_rng(0)
    steps = 4
    with autograd.record():  # the first step initializes the store
        net(nd.array(rng.integers(0, rows, (8, 2)))).backward()
    trainer.step(1)
    before = plans.calls
    for _ in range(steps):
        ids = nd.array(rng.integers(0, rows, (8, 2)))
        with autograd.record():
            loss = net(ids)
        loss.backward()
        trainer.step(1)
    assert plans.calls - before == steps
    kv.close()
