"""kv.set_learning_rate: the optimizers' rate changes on the servers, every slot stays.

An Adagrad table whose rate drops mid-training is compared with the reference
formula (tests/reference.py's ReferenceOptimizer) run with the accumulator kept
across the change, on every store kind: local, dist_sparse / dist_async on two
real servers, and a colocated worker hosting its own shard. Checkpoints record
the new rate.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from reference import ReferenceOptimizer

import kvsparse
from kvsparse import errors, initializers, optimizers
from kvsparse.store.factory import create_colocated_store

DIM = 3
IDS = np.array([4, 2**40 + 7, -9])
FIRST_RATE, SECOND_RATE = 0.5, 0.05
_names = itertools.count()


@pytest.fixture(scope="module")
def servers(module_server_factory):
    """Two servers per mode (a server keeps the mode of its first client)."""
    started = {}

    def of(mode: str) -> list:
        if mode not in started:
            started[mode] = module_server_factory(2)
        return started[mode]

    return of


@pytest.fixture(params=["local", "dist_sparse", "dist_async", "colocated"])
def store(request, servers, tmp_path):
    if request.param == "local":
        kv = kvsparse.create("local")
    elif request.param == "colocated":
        kv = create_colocated_store("dist_sparse", [f"ipc://{tmp_path}/w0"], 0, timeout=60)
    else:
        kv = kvsparse.create(request.param, servers=servers(request.param), rank=0, num_workers=1)
    yield kv
    kv.close()


def fresh(stem: str) -> str:
    """A key no other test uses (the module's servers keep their tables)."""
    return f"{stem}_{next(_names)}"


def gradients(step: int) -> np.ndarray:
    return np.random.default_rng(step).normal(size=(IDS.size, DIM)).astype(np.float32)


def adagrad_spec(rate: float) -> dict:
    return optimizers.Adagrad(learning_rate=rate, eps=1e-10).to_dict()


def expected_rows(initial: np.ndarray, steps: list) -> np.ndarray:
    """Each row under the reference Adagrad: one accumulator for all steps, each step at
    its own rate. steps: [(rate, gradient rows)]."""
    rows = initial.copy()
    slots = [ReferenceOptimizer(adagrad_spec(FIRST_RATE)).initial_slots(DIM) for _ in IDS]
    for step, (rate, grads) in enumerate(steps, start=1):
        reference = ReferenceOptimizer(adagrad_spec(rate))
        for i in range(IDS.size):
            reference.update(rows[i], slots[i], grads[i], step)
    return rows


def test_a_dropped_rate_keeps_the_accumulator_store_wide(store):
    kv = store
    key = fresh("adagrad")
    kv.init(key, kvsparse.SparseTable(dim=DIM, initializer=initializers.Uniform(-1, 1), seed=3))
    kv.set_optimizer(optimizers.Adagrad(learning_rate=FIRST_RATE, eps=1e-10))
    initial = kv.row_sparse_pull(key, row_ids=IDS).copy()
    steps = [(FIRST_RATE, gradients(s)) for s in range(3)]
    steps += [(SECOND_RATE, gradients(s)) for s in range(3, 6)]
    for step, (_, grads) in enumerate(steps):
        if step == 3:
            kv.set_learning_rate(SECOND_RATE)
        kv.push(key, (IDS, grads))
    np.testing.assert_allclose(
        kv.row_sparse_pull(key, row_ids=IDS), expected_rows(initial, steps), rtol=2e-5, atol=1e-6
    )
    # Restarting the slots (set_optimizer) would have given other rows.
    restarted = expected_rows(initial, steps[:3])
    restarted = expected_rows(restarted, steps[3:])
    assert not np.allclose(kv.row_sparse_pull(key, row_ids=IDS), restarted, rtol=1e-4)
    assert kv.optimizer.learning_rate == SECOND_RATE
    assert kv.optimizer.to_dict() == adagrad_spec(SECOND_RATE)


def test_one_table_s_rate_changes_and_the_others_stay(store):
    kv = store
    slow, steady = fresh("slow"), fresh("steady")
    for key in (slow, steady):
        kv.init(key, kvsparse.SparseTable(dim=DIM, initializer=initializers.Uniform(-1, 1)))
    kv.set_optimizer(optimizers.Adagrad(learning_rate=FIRST_RATE, eps=1e-10))
    initial = {key: kv.row_sparse_pull(key, row_ids=IDS).copy() for key in (slow, steady)}
    first, second = gradients(10), gradients(11)
    kv.push([slow, steady], [(IDS, first), (IDS, first)])
    kv.set_learning_rate(SECOND_RATE, key=slow)
    kv.push([slow, steady], [(IDS, second), (IDS, second)])
    np.testing.assert_allclose(
        kv.row_sparse_pull(slow, row_ids=IDS),
        expected_rows(initial[slow], [(FIRST_RATE, first), (SECOND_RATE, second)]),
        rtol=2e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        kv.row_sparse_pull(steady, row_ids=IDS),
        expected_rows(initial[steady], [(FIRST_RATE, first), (FIRST_RATE, second)]),
        rtol=2e-5,
        atol=1e-6,
    )
    assert kv.optimizer.learning_rate == FIRST_RATE  # the store-wide one stays


def test_a_table_s_own_optimizer_and_a_dense_key_follow_a_store_wide_change(store):
    kv = store
    own, dense = fresh("own"), fresh("dense")
    optimizer = optimizers.Adagrad(learning_rate=FIRST_RATE, eps=1e-10)
    kv.init(own, kvsparse.SparseTable(dim=DIM, optimizer=optimizer))
    kv.init(dense, np.ones(DIM, np.float32))
    kv.set_optimizer(optimizer)
    initial = kv.row_sparse_pull(own, row_ids=IDS).copy()
    first, second = gradients(20), gradients(21)
    kv.push([own, dense], [(IDS, first), first[0]])
    kv.set_learning_rate(SECOND_RATE)
    kv.push([own, dense], [(IDS, second), second[0]])
    np.testing.assert_allclose(
        kv.row_sparse_pull(own, row_ids=IDS),
        expected_rows(initial, [(FIRST_RATE, first), (SECOND_RATE, second)]),
        rtol=2e-5,
        atol=1e-6,
    )
    out = np.empty(DIM, np.float32)
    kv.pull(dense, out=out)
    expected = expected_rows(
        np.ones((3, DIM), np.float32), [(FIRST_RATE, first), (SECOND_RATE, second)]
    )
    np.testing.assert_allclose(out, expected[0], rtol=2e-5, atol=1e-6)


def test_bad_rates_and_keys_are_refused_and_nothing_changes(store):
    kv = store
    bare, key = fresh("bare"), fresh("trained")
    kv.set_optimizer(None)  # the module's servers keep the last test's
    kv.init(bare, kvsparse.SparseTable(dim=DIM))
    with kvsparse.create("local") as empty:  # (the module's servers hold other tables)
        empty.init(bare, kvsparse.SparseTable(dim=DIM))
        with pytest.raises(errors.InvalidArgument, match="no optimizer"):
            empty.set_learning_rate(0.1)
    with pytest.raises(errors.InvalidArgument, match="no optimizer"):
        kv.set_learning_rate(0.1, key=bare)
    kv.init(key, kvsparse.SparseTable(dim=DIM, optimizer=optimizers.Adagrad(learning_rate=0.5)))
    for rate in (-1.0, float("nan"), float("inf"), "0.1", True):
        with pytest.raises(errors.InvalidArgument):
            kv.set_learning_rate(rate, key=key)
    with pytest.raises(errors.UnknownKey):
        kv.set_learning_rate(0.1, key=fresh("missing"))
    with pytest.raises(errors.InvalidArgument, match="no optimizer"):
        kv.set_learning_rate(0.1, key=[key, bare])  # checked before anything changes
    grads = gradients(30)
    initial = kv.row_sparse_pull(key, row_ids=IDS).copy()
    kv.push(key, (IDS, grads))  # the store still serves, at the first rate
    expected = initial.copy()
    reference = ReferenceOptimizer(optimizers.Adagrad(learning_rate=0.5).to_dict())
    for i in range(IDS.size):
        reference.update(expected[i], reference.initial_slots(DIM), grads[i], 1)
    np.testing.assert_allclose(kv.row_sparse_pull(key, row_ids=IDS), expected, rtol=2e-5)


def test_a_checkpoint_records_the_new_rate_and_the_kept_accumulator(store, tmp_path):
    kv = store
    key = fresh("saved")
    optimizer = optimizers.Adagrad(learning_rate=FIRST_RATE, eps=1e-10)
    kv.init(key, kvsparse.SparseTable(dim=DIM, optimizer=optimizer, seed=9))
    initial = kv.row_sparse_pull(key, row_ids=IDS).copy()
    first, second = gradients(40), gradients(41)
    kv.push(key, (IDS, first))
    kv.set_learning_rate(SECOND_RATE, key=key)
    kv.save(tmp_path / "ckpt")
    restored = kvsparse.create("local")
    try:
        restored.load(tmp_path / "ckpt")
        restored.push(key, (IDS, second))
        np.testing.assert_allclose(
            restored.row_sparse_pull(key, row_ids=IDS),
            expected_rows(initial, [(FIRST_RATE, first), (SECOND_RATE, second)]),
            rtol=2e-5,
            atol=1e-6,
        )
    finally:
        restored.close()


def test_the_core_table_changes_only_its_rate():
    from kvsparse import _core

    table = _core.Table(DIM, None, adagrad_spec(FIRST_RATE), 0)
    table.apply_gradients(IDS, gradients(50))
    step = table.table_step
    table.set_learning_rate(SECOND_RATE)
    assert table.table_step == step
    with pytest.raises(errors.InvalidArgument, match="learning_rate"):
        table.set_learning_rate(-1.0)


def _two_workers(servers: list, work) -> list:
    """Runs work(kv, rank) for ranks 0 and 1 of a dist_sparse job, one thread each;
    returns what each returned or raised."""
    import threading

    results: list = [None, None]

    def run(rank: int) -> None:
        try:
            kv = kvsparse.create(
                "dist_sparse", servers=servers, rank=rank, num_workers=2, timeout=60
            )
            try:
                results[rank] = work(kv, rank)
            finally:
                kv.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a worker did not finish"
    return results


def test_every_worker_s_call_agrees_with_rank_0_s_and_the_bsp_sum_follows_the_rate(
    server_factory,
):
    key = fresh("bsp")
    grads = [[gradients(60 + 2 * step + rank) for rank in range(2)] for step in range(2)]

    def work(kv, rank):
        kv.init(key, kvsparse.SparseTable(dim=DIM, initializer=initializers.Uniform(-1, 1)))
        kv.set_optimizer(optimizers.Adagrad(learning_rate=FIRST_RATE, eps=1e-10))
        initial = kv.row_sparse_pull(key, row_ids=IDS).copy()
        kv.push(key, (IDS, grads[0][rank]))
        kv.set_learning_rate(SECOND_RATE)
        kv.push(key, (IDS, grads[1][rank]))
        kv.barrier()
        return initial, kv.row_sparse_pull(key, row_ids=IDS)

    results = _two_workers(server_factory(2), work)
    for result in results:
        assert not isinstance(result, BaseException), result
    initial = results[0][0]
    summed = [(FIRST_RATE, grads[0][0] + grads[0][1]), (SECOND_RATE, grads[1][0] + grads[1][1])]
    for _, rows in results:
        np.testing.assert_allclose(rows, expected_rows(initial, summed), rtol=2e-5, atol=1e-6)


def test_a_worker_whose_rate_differs_from_rank_0_s_is_refused(server_factory):
    key = fresh("disagree")

    def work(kv, rank):
        kv.init(key, kvsparse.SparseTable(dim=DIM))
        kv.set_optimizer(optimizers.Adagrad(learning_rate=FIRST_RATE))
        kv.set_learning_rate(SECOND_RATE if rank == 0 else 0.3)
        return "done"

    results = _two_workers(server_factory(1), work)
    assert results[0] == "done"
    assert isinstance(results[1], errors.InvalidArgument), results[1]
    assert "rank 0" in str(results[1])


@pytest.mark.parametrize("kind", ["SGD", "Adagrad", "Adam", "Ftrl"])
def test_the_learning_rate_may_come_first_unnamed_as_keras_takes_it(kind):
    # Issue 32's scenario wrote SGD(0.5) and got "takes 1 positional argument".
    cls = getattr(optimizers, kind)
    assert cls(0.25).to_dict() == cls(learning_rate=0.25).to_dict() == cls(lr=0.25).to_dict()
    with pytest.raises(TypeError, match="given twice"):
        cls(0.25, learning_rate=0.5)
    with pytest.raises(errors.InvalidArgument, match="learning_rate"):
        cls("fast")
