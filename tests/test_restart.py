"""Issue 11, hardening: failed batches change nothing; a restarted server goes on as before.

- A push of several keys to one server is applied all or nothing there: one
  key's update failing (an overflow) leaves every key of the request as it
  was, on the local store and on a real server (ASP and BSP).
- A dense key whose finite gradient overflows raises UpdateOverflow and keeps
  its values, as sparse tables do.

Overflow is made with SGD at learning rate 1e38: a gradient of 10 takes a row
to -1e39, past float32; a gradient of 1e-30 moves it by 1e8, which is finite.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvsparse
from kvsparse import errors
from kvsparse.initializers import Zeros
from kvsparse.optimizers import SGD

HUGE_LR = 1e38
SMALL, OVERFLOWING = 1e-30, 10.0


def _store(kind: str, server_factory, **options):
    if kind == "local":
        return kvsparse.create("local")
    return kvsparse.create(kind, servers=server_factory(1), rank=0, num_workers=1, **options)


def _rows(value: float, n: int = 3, dim: int = 2) -> np.ndarray:
    return np.full((n, dim), value, np.float32)


# -- a push of several keys is all or nothing per server ------------------------------------


@pytest.mark.parametrize("kind", ["local", "dist_async", "dist_sync"])
def test_multi_table_push_with_one_overflowing_table_changes_no_table(kind, server_factory):
    kv = _store(kind, server_factory)
    sgd = SGD(learning_rate=HUGE_LR)
    for name in ("a", "b"):
        kv.init(name, kvsparse.SparseTable(dim=2, initializer=Zeros(), optimizer=sgd))
    ids = np.array([1, 2, 3])
    kv.push(["a", "b"], [(ids, _rows(SMALL)), (ids, _rows(SMALL))])  # stored rows in both
    before = [kv.row_sparse_pull(k, row_ids=np.arange(6)) for k in ("a", "b")]
    stats_before = kv._backend.stats()[0]["tables"]
    # "a": existing rows and a new id 4, all finite; "b": id 2's update overflows.
    grads_a = (np.array([1, 4]), _rows(SMALL, 2))
    grads_b = (ids, np.array([[SMALL] * 2, [OVERFLOWING] * 2, [SMALL] * 2], np.float32))
    with pytest.raises(errors.UpdateOverflow, match="id 2"):
        kv.push(["a", "b"], [grads_a, grads_b])
    after = [kv.row_sparse_pull(k, row_ids=np.arange(6)) for k in ("a", "b")]
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    assert kv._backend.stats()[0]["tables"]["a"]["rows"] == stats_before["a"]["rows"] == 3
    # The same push without the overflow is applied to both.
    kv.push(["a", "b"], [grads_a, (ids, _rows(SMALL))])
    assert kv.row_sparse_pull("a", row_ids=np.array([4]))[0, 0] == np.float32(-HUGE_LR * SMALL)
    assert kv.row_sparse_pull("b", row_ids=np.array([2]))[0, 0] == np.float32(-2 * HUGE_LR * SMALL)
    kv.close()


@pytest.mark.parametrize("kind", ["local", "dist_async", "dist_sync"])
def test_multi_key_dense_push_with_one_overflowing_key_changes_no_key(kind, server_factory):
    kv = _store(kind, server_factory)
    kv.set_optimizer(SGD(learning_rate=HUGE_LR))
    kv.init(["w1", "w2"], [np.ones(4, np.float32), np.ones(3, np.float32)])
    with pytest.raises(errors.UpdateOverflow, match="w2"):
        kv.push(["w1", "w2"], [np.full(4, SMALL, np.float32), np.full(3, OVERFLOWING, np.float32)])
    np.testing.assert_array_equal(kv.pull("w1"), np.ones(4))
    np.testing.assert_array_equal(kv.pull("w2"), np.ones(3))
    kv.push(["w1", "w2"], [np.full(4, SMALL, np.float32), np.full(3, SMALL, np.float32)])
    np.testing.assert_allclose(kv.pull("w1"), 1 - HUGE_LR * SMALL, rtol=1e-6)
    kv.close()


# -- a dense key's overflowing update raises and changes nothing ---------------------------------


@pytest.mark.parametrize("kind", ["local", "dist_async"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_dense_update_overflow_raises_and_keeps_the_values(kind, optimizer, server_factory):
    kv = _store(kind, server_factory)
    if optimizer == "sgd":
        kv.set_optimizer(SGD(learning_rate=HUGE_LR))
        grad = np.full(5, OVERFLOWING, np.float32)
    else:  # Adam's second moment g*g overflows float32 for |g| > 1.8e19
        kv.set_optimizer(kvsparse.optimizers.Adam(learning_rate=0.1))
        grad = np.full(5, 1e30, np.float32)
    start = np.arange(5, dtype=np.float32)
    kv.init("w", start)
    with pytest.raises(errors.UpdateOverflow, match="'w'") as info:
        kv.push("w", grad)
    assert isinstance(info.value, FloatingPointError)
    np.testing.assert_array_equal(kv.pull("w"), start)
    # The optimizer state did not move either: a finite push gives what it gives on a fresh key.
    kv.push("w", np.full(5, 1e-3, np.float32))
    fresh = kvsparse.create("local")
    fresh.set_optimizer(
        SGD(learning_rate=HUGE_LR)
        if optimizer == "sgd"
        else kvsparse.optimizers.Adam(learning_rate=0.1)
    )
    fresh.init("w", start)
    fresh.push("w", np.full(5, 1e-3, np.float32))
    np.testing.assert_array_equal(kv.pull("w"), fresh.pull("w"))
    kv.close()
