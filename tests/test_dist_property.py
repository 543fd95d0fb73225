"""Property: any sequence of store operations gives the same tables on `local` and `dist_sparse`.

`dist_sparse` moves its rows through the sockets or through the worker's shared memory.

The servers (sets of 1, 2 and 3) are started once for the module and reused
by every example; each example uses fresh key names and starts both stores
from no optimizer. The shards run the same C++ code on the same summed
gradients, so results are compared bit for bit for SGD and no optimizer and
with a tight tolerance otherwise (float rounding inside the optimizers'
pow/sqrt is the same code, but a tolerance keeps the property about
semantics, not libm).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvsparse
from kvsparse import initializers, optimizers
from kvsparse.client import remote

SERVER_COUNTS = (1, 2, 3)
_example_ids = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def every_size_shared():
    """Shared memory for these small tables too (else only from SHARED_MIN_BYTES of rows)."""
    default, remote.SHARED_MIN_BYTES = remote.SHARED_MIN_BYTES, 0
    try:
        yield
    finally:
        remote.SHARED_MIN_BYTES = default


@pytest.fixture(scope="module")
def server_sets(module_server_factory):
    return {n: module_server_factory(n) for n in SERVER_COUNTS}


INITIALIZERS = st.sampled_from(
    [
        initializers.Zeros(),
        initializers.Constant(0.25),
        initializers.Uniform(-1.0, 1.0),
        initializers.Normal(0.0, 0.1),
    ]
)

OPTIMIZERS = st.sampled_from(
    [
        None,
        optimizers.SGD(learning_rate=0.5),
        optimizers.SGD(learning_rate=0.1, momentum=0.9),
        optimizers.Adagrad(learning_rate=0.1),
        optimizers.Adam(learning_rate=0.01),
        optimizers.Adam(learning_rate=0.01, step_mode="table"),
        optimizers.RMSProp(learning_rate=0.01),
        optimizers.Ftrl(learning_rate=0.1),
    ]
)

ID_VALUES = st.one_of(st.integers(-20, 20), st.sampled_from([-(2**63), 2**63 - 1, 2**40, -(2**33)]))


@st.composite
def sparse_tables(draw):
    return kvsparse.SparseTable(
        dim=draw(st.integers(1, 6)),
        initializer=draw(INITIALIZERS),
        optimizer=draw(st.one_of(st.none(), OPTIMIZERS)),
        seed=draw(st.integers(0, 5)),
    )


def exact_kind(optimizer) -> bool:
    return optimizer is None or isinstance(optimizer, optimizers.SGD)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data(), num_servers=st.sampled_from(SERVER_COUNTS))
def test_any_operation_sequence_gives_the_same_tables(server_sets, data, num_servers):
    prefix = f"p{next(_example_ids)}_"
    local = kvsparse.create("local")
    # Rows through the sockets, or through this worker's shared memory (the servers are
    # on this host: the same-host path).
    shared = data.draw(st.booleans(), "shared_memory")
    dist = kvsparse.create(
        "dist_sparse", servers=server_sets[num_servers], timeout=30, shared_memory=shared
    )
    assert dist._backend.shared_servers == (frozenset(range(num_servers)) if shared else set())
    try:
        dist.set_optimizer(None)  # shared servers: an earlier example may have set one
        stores = (local, dist)
        tables = {
            prefix + f"s{i}": draw_table
            for i, draw_table in enumerate(
                data.draw(st.lists(sparse_tables(), min_size=1, max_size=3), "tables")
            )
        }
        dense = {
            prefix + f"d{i}": shape
            for i, shape in enumerate(
                data.draw(
                    st.lists(st.sampled_from([(1,), (5,), (2, 3), (7,)]), max_size=2), "dense"
                )
            )
        }
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), "seed"))
        for store in stores:
            store.init(list(tables), list(tables.values()))
        for key, shape in dense.items():
            value = rng.standard_normal(shape).astype(np.float32)
            for store in stores:
                store.init(key, value)
        exact = all(exact_kind(t.optimizer) for t in tables.values())
        store_optimizer_exact = True
        touched = {key: set() for key in tables}

        def compare(a, b):
            if exact and store_optimizer_exact:
                np.testing.assert_array_equal(b, a)
            else:
                np.testing.assert_allclose(b, a, rtol=2e-5, atol=1e-6)

        def sparse_push_value(key):
            pairs = []
            for _ in range(data.draw(st.integers(1, 2), "pairs")):
                ids = np.array(data.draw(st.lists(ID_VALUES, max_size=6), "ids"), np.int64)
                touched[key].update(ids.tolist())
                grads = rng.standard_normal((ids.size, tables[key].dim)).astype(np.float32)
                pairs.append((ids, grads))
            return pairs[0] if len(pairs) == 1 else pairs

        operations = [
            "push_sparse",
            "push_dense",
            "fused_push",
            "set_optimizer",
            "pull",
            "deferred_pull",
            "pushpull",
        ]
        # Pulls sent with wait=False, read after later operations: (local's, dist's).
        deferred: list = []

        def read_deferred():
            for pendings in deferred:
                for a, b in zip(*(pending.wait() for pending in pendings)):
                    compare(a, b)
            deferred.clear()

        def pull_request():
            keys = data.draw(
                st.lists(st.sampled_from(sorted(tables)), min_size=1, max_size=3, unique=True),
                "pull keys",
            )
            ids = [
                np.array(data.draw(st.lists(ID_VALUES, max_size=10), "pull ids"), np.int64)
                for _ in keys
            ]
            return keys, ids

        for _ in range(data.draw(st.integers(1, 8), "length")):
            if deferred and data.draw(st.booleans(), "read deferred pulls"):
                read_deferred()
            op = data.draw(st.sampled_from(operations), "op")
            if op == "push_sparse":
                key = data.draw(st.sampled_from(sorted(tables)), "key")
                value = sparse_push_value(key)
                # wait=False: the next operation collects the acknowledgements first.
                wait = data.draw(st.booleans(), "wait")
                for store in stores:
                    store.push(key, value, wait=wait)
            elif op == "push_dense" and dense:
                key = data.draw(st.sampled_from(sorted(dense)), "key")
                grad = rng.standard_normal(dense[key]).astype(np.float32)
                wait = data.draw(st.booleans(), "wait")
                for store in stores:
                    store.push(key, grad, wait=wait)
            elif op == "fused_push":
                keys = data.draw(
                    st.lists(
                        st.sampled_from(sorted(tables) + sorted(dense)),
                        min_size=1,
                        max_size=3,
                        unique=True,
                    ),
                    "keys",
                )
                values = [
                    sparse_push_value(k)
                    if k in tables
                    else rng.standard_normal(dense[k]).astype(np.float32)
                    for k in keys
                ]
                wait = data.draw(st.booleans(), "wait")
                for store in stores:
                    store.push(keys, values, wait=wait)
            elif op == "set_optimizer":
                optimizer = data.draw(OPTIMIZERS, "optimizer")
                store_optimizer_exact = store_optimizer_exact and exact_kind(optimizer)
                for store in stores:
                    store.set_optimizer(optimizer)
            elif op == "deferred_pull":
                # Sent now, read later: both stores give the rows as of now, whatever runs
                # in between (dist: the servers serve a client's requests in order).
                keys, ids = pull_request()
                deferred.append([s.row_sparse_pull(keys, row_ids=ids, wait=False) for s in stores])
            elif op == "pull":
                keys, ids = pull_request()
                for a, b in zip(*(s.row_sparse_pull(keys, row_ids=ids) for s in stores)):
                    compare(a, b)
                if dense:
                    for a, b in zip(*(s.pull(sorted(dense)) for s in stores)):
                        compare(a, b)
            elif op == "pushpull" and dense:
                key = data.draw(st.sampled_from(sorted(dense)), "key")
                grad = rng.standard_normal(dense[key]).astype(np.float32)
                compare(*(s.pushpull(key, grad) for s in stores))

        read_deferred()
        # The final tables: every id ever pushed, plus ids never seen.
        for key in tables:
            ids = np.array(sorted(touched[key] | {-3, 0, 999}), np.int64)
            compare(*(s.row_sparse_pull(key, row_ids=ids) for s in stores))
        for key in dense:
            compare(*(s.pull(key) for s in stores))
        rows = {key: table["rows"] for key, table in dist.stats()["tables"].items()}
        local_rows = {key: table["rows"] for key, table in local.stats()["tables"].items()}
        for key in list(tables) + list(dense):
            assert rows[key] == local_rows[key]
    finally:
        dist.close()
