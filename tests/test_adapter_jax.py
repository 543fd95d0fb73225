"""The JAX adapter: embedding_lookup reads the store's rows; its VJP pushes their gradient.

Expected tables are computed by hand from the loss (SGD: row -= lr * the sum
of the gradients of the row's occurrences), never read back from the adapter.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
from conftest import REPO_ROOT, subprocess_env

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from kvsparse.adapters.jax import (  # noqa: E402
    embedding_lookup,
    jax_ids,
    join_ids,
    make_anchor,
    split_ids,
    x64_enabled,
)

import kvsparse  # noqa: E402
from kvsparse import errors, initializers, optimizers  # noqa: E402

LR = 0.5


@pytest.fixture
def kv():
    store = kvsparse.create("local")
    yield store
    store.close()


@pytest.fixture
def two_servers(server_factory):
    """A worker (rank 0 of 1) of a store whose tables are split over two real servers."""
    store = kvsparse.create("dist_sparse", servers=server_factory(2), rank=0, num_workers=1)
    yield store
    store.close()


def sgd_table(kv, key="user", dim=4, seed=5):
    kv.init(
        key,
        kvsparse.SparseTable(
            dim=dim,
            initializer=initializers.Uniform(-1, 1),
            optimizer=optimizers.SGD(learning_rate=LR),
            seed=seed,
        ),
    )


def expected_after_sgd(initial_rows, ids, grad_rows):
    """{id: row} after one SGD step whose gradient for position i is grad_rows[i]."""
    rows = {}
    for position, i in enumerate(np.asarray(ids).reshape(-1).tolist()):
        start = rows.get(i, initial_rows[i])
        rows[i] = start - LR * grad_rows.reshape(-1, grad_rows.shape[-1])[position]
    return rows


# -- lookup ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (2, 3, 4), (0,), (3, 0)])
def test_lookup_equals_the_stores_rows(kv, shape):
    ids = np.random.default_rng(0).integers(-(2**62), 2**62, shape)
    rows = embedding_lookup(kv, "user", ids, embedding_dim=6)
    assert rows.shape == shape + (6,) and rows.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(rows), kv.row_sparse_pull("user", row_ids=ids))


def test_lookup_of_jax_ids_eagerly_under_jit_and_vmap(kv):
    sgd_table(kv)
    ids = jnp.array([[3, -7], [7, 3]], dtype=jnp.int32)
    expected = kv.row_sparse_pull("user", row_ids=np.asarray(ids))
    np.testing.assert_array_equal(embedding_lookup(kv, "user", ids), expected)
    jitted = jax.jit(lambda i: embedding_lookup(kv, "user", i))
    np.testing.assert_array_equal(jitted(ids), expected)
    batched = jax.vmap(lambda i: embedding_lookup(kv, "user", i))(ids)
    np.testing.assert_array_equal(batched, expected)


def test_numpy_ids_keep_all_64_bits(kv):
    """JAX without x64 would wrap 2**40 + 3 to 3; NumPy ids never pass through JAX."""
    sgd_table(kv)
    ids = np.array([2**40 + 3, 3, -(2**62)])
    rows = np.asarray(embedding_lookup(kv, "user", ids))
    np.testing.assert_array_equal(rows, kv.row_sparse_pull("user", row_ids=ids))
    assert not np.array_equal(rows[0], rows[1])


# -- 64-bit ids with jax_enable_x64 off (JAX's default, and this process's) ---------------


def test_jax_ids_refuses_ids_int32_cannot_hold_while_x64_is_off():
    assert not x64_enabled()
    for ids in ([2**40 + 3, 3], np.array([-(2**31) - 1]), np.array([[1, 2**32]], np.uint64)):
        with pytest.raises(errors.InvalidArgument, match=r'jax\.config\.update\("jax_enable_x64"'):
            jax_ids(ids)
    small = jax_ids(np.array([3, -7, 2**31 - 1]))
    assert small.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(small), [3, -7, 2**31 - 1])
    with pytest.raises(errors.DTypeError):
        jax_ids(np.array([1.5]))


def test_jax_int32_ids_warn_once_that_jax_may_have_wrapped_them(kv, monkeypatch):
    import kvsparse.adapters.jax as adapter

    sgd_table(kv)
    monkeypatch.setattr(adapter, "_warned_int32", False)
    with pytest.warns(adapter.Int32IdsWarning, match="jax_enable_x64"):
        embedding_lookup(kv, "user", jnp.array([1, 2], dtype=jnp.int32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        embedding_lookup(kv, "user", jnp.array([1, 2], dtype=jnp.int32))  # once only


@pytest.mark.parametrize("how", ["grad", "jit_closure", "value_and_grad"])
def test_numpy_ids_beyond_int32_train_their_own_rows_while_x64_is_off(kv, how):
    assert not x64_enabled()
    sgd_table(kv)
    ids = np.array([2**40 + 1, 2**33 + 2, 2**40 + 1])
    aliases = np.array([1, 2])  # what JAX would wrap them to
    wide = np.unique(ids)
    before = kv.row_sparse_pull("user", row_ids=wide).copy()
    aliases_before = kv.row_sparse_pull("user", row_ids=aliases).copy()

    def loss(params, ids):
        return embedding_lookup(kv, "user", ids, anchor=params).sum()

    if how == "grad":
        jax.grad(loss)(make_anchor(), ids)
    elif how == "jit_closure":
        jax.jit(jax.grad(lambda p: loss(p, ids)))(make_anchor())
    else:
        jax.value_and_grad(loss)(make_anchor(), ids)
    jax.effects_barrier()
    counts = np.array([1, 2])  # 2**33 + 2 once, 2**40 + 1 twice (np.unique's order)
    np.testing.assert_allclose(
        kv.row_sparse_pull("user", row_ids=wide), before - LR * counts[:, None], rtol=1e-6
    )
    np.testing.assert_array_equal(kv.row_sparse_pull("user", row_ids=aliases), aliases_before)


# -- ids as two 32-bit words: exact through jax.jit with x64 off (issue 32) -----------------

EDGE_IDS = np.array([2**40 + 3, -5, 2**62, -(2**63), 2**63 - 1, 0, 3], np.int64)


def test_split_ids_round_trip_every_int64_exactly_through_jit_with_x64_off():
    assert not x64_enabled()
    words = split_ids(EDGE_IDS.reshape(7, 1))
    assert words.dtype == np.uint32 and words.shape == (7, 1, 2)
    through = jax.jit(lambda w: w)(words)  # what a jitted step's argument holds
    assert through.dtype == jnp.uint32
    np.testing.assert_array_equal(join_ids(np.asarray(through)), EDGE_IDS.reshape(7, 1))
    # The bits, not only the values: low word first, the high word's sign kept.
    assert split_ids(np.array([-1]))[0].tolist() == [2**32 - 1, 2**32 - 1]
    assert split_ids(np.array([2**32 + 7]))[0].tolist() == [7, 1]


def test_join_ids_reads_the_high_word_as_signed_and_the_low_word_as_unsigned():
    words = np.array([[0xFFFFFFFB, 0xFFFFFFFF], [0, 0x80000000], [3, 0x40000000]], np.uint32)
    np.testing.assert_array_equal(join_ids(words), [-5, -(2**63), 2**62 + 3])
    # int32 words of the same bits (as tf.bitcast of int64 ids gives) read alike.
    np.testing.assert_array_equal(join_ids(words.view(np.int32)), [-5, -(2**63), 2**62 + 3])
    assert join_ids(split_ids(np.int64(-(2**63)))) == -(2**63)  # 0-d ids: words of shape (2,)
    assert join_ids(np.zeros((0, 2), np.uint32)).shape == (0,)


def test_split_and_join_ids_never_share_the_callers_memory():
    """An input pipeline may refill its buffer while the words are still queued."""
    ids = EDGE_IDS.copy()
    words = split_ids(ids)
    ids[:] = 1
    np.testing.assert_array_equal(join_ids(words), EDGE_IDS)
    joined = join_ids(words)
    words[:] = 0
    np.testing.assert_array_equal(joined, EDGE_IDS)


@pytest.mark.parametrize("split", [False, True])
def test_a_jitted_step_keeps_the_numpy_ids_it_closed_over(kv, split):
    """A closed-over NumPy array is a constant of the trace, split words as int64 ids:
    refilling the caller's buffer afterwards changes neither the pull nor the push."""
    kv.init(
        "user",
        kvsparse.SparseTable(
            dim=1, initializer=initializers.Zeros(), optimizer=optimizers.SGD(learning_rate=1.0)
        ),
    )
    ids = np.array([2**40 + 11, -12])
    buffer = split_ids(ids) if split else ids.copy()
    step = jax.jit(
        jax.grad(lambda a: embedding_lookup(kv, "user", buffer, anchor=a, split=split).sum())
    )
    step(make_anchor())
    buffer[:] = split_ids(np.array([21, 22])) if split else [21, 22]
    step(make_anchor())
    jax.effects_barrier()
    np.testing.assert_array_equal(
        kv.row_sparse_pull("user", row_ids=np.array([2**40 + 11, -12, 21, 22])).ravel(),
        [-2, -2, 0, 0],
    )


def test_vmap_of_a_step_on_split_ids(kv):
    assert not x64_enabled()
    kv.init(
        "user",
        kvsparse.SparseTable(
            dim=2, initializer=initializers.Zeros(), optimizer=optimizers.SGD(learning_rate=1.0)
        ),
    )
    words = jnp.asarray(split_ids(np.array([[2**40, -5], [-5, 2**62]])))

    def loss(anchor, example_words):
        return jnp.sum(embedding_lookup(kv, "user", example_words, anchor=anchor, split=True))

    rows = jax.vmap(lambda w: embedding_lookup(kv, "user", w, split=True))(words)
    assert rows.shape == (2, 2, 2)
    jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(make_anchor(), words)
    jax.effects_barrier()
    np.testing.assert_array_equal(
        kv.row_sparse_pull("user", row_ids=np.array([2**40, -5, 2**62, 0])),
        [[-1, -1], [-2, -2], [-1, -1], [0, 0]],
    )


@pytest.mark.parametrize("where", ["jit", "eager", "numpy"])
def test_a_step_on_split_ids_trains_exactly_the_64_bit_rows_with_x64_off(two_servers, where):
    assert not x64_enabled()
    kv = two_servers
    sgd_table(kv)
    ids = np.array([2**40 + 3, -5, 2**62, -(2**63), 2**40 + 3, 3])
    aliases = ids.astype(np.int32).astype(np.int64)  # what int32 ids would have reached
    pulled = kv.row_sparse_pull("user", row_ids=ids)
    initial = {i: row.copy() for i, row in zip(ids.tolist(), pulled)}
    untouched = np.setdiff1d(aliases, ids)
    untouched_before = kv.row_sparse_pull("user", row_ids=untouched).copy()
    weights = jnp.arange(1.0, 7.0)[:, None] * jnp.ones((6, 4))

    def loss(anchor, words):
        rows = embedding_lookup(kv, "user", words, anchor=anchor, split=True)
        assert rows.shape == (6, 4)
        return (rows * weights).sum()

    words = split_ids(ids)
    if where == "jit":
        rows = jax.jit(lambda w: embedding_lookup(kv, "user", w, split=True))(words)
        np.testing.assert_array_equal(rows, np.stack([initial[i] for i in ids.tolist()]))
        jax.jit(jax.grad(loss))(make_anchor(), words)
    elif where == "eager":
        jax.grad(loss)(make_anchor(), jnp.asarray(words))
    else:
        jax.grad(loss)(make_anchor(), words)
    jax.effects_barrier()
    expected = expected_after_sgd(initial, ids, np.asarray(weights))
    for i, row in expected.items():
        np.testing.assert_allclose(
            kv.row_sparse_pull("user", row_ids=np.array([i]))[0], row, rtol=1e-6
        )
    np.testing.assert_array_equal(kv.row_sparse_pull("user", row_ids=untouched), untouched_before)


def test_malformed_split_ids_are_refused_naming_the_problem(kv):
    sgd_table(kv)
    with pytest.raises(errors.ShapeError, match="last axis of 2"):
        embedding_lookup(kv, "user", np.zeros((4, 3), np.uint32), split=True)
    with pytest.raises(errors.DTypeError, match="uint32 words"):
        embedding_lookup(kv, "user", np.zeros((4, 2), np.int64), split=True)
    with pytest.raises(errors.DTypeError, match="uint32 words"):
        jax.jit(lambda w: embedding_lookup(kv, "user", w, split=True))(jnp.zeros((4, 2)))
    with pytest.raises(errors.DTypeError, match="integers"):
        split_ids(np.array([1.5]))
    with pytest.raises(errors.ShapeError, match="last axis of 2"):
        join_ids(np.uint32(3))


X64_ON = """
import jax
jax.config.update("jax_enable_x64", True)
import numpy as np, kvsparse
from kvsparse import optimizers
from kvsparse.adapters.jax import embedding_lookup, jax_ids, make_anchor, x64_enabled
assert x64_enabled()
kv = kvsparse.create("local")
kv.init("t", kvsparse.SparseTable(dim=2, optimizer=optimizers.SGD(learning_rate=1.0)))
ids = jax_ids(np.array([2**40 + 1]))
assert ids.dtype == np.int64, ids.dtype
step = jax.jit(jax.grad(lambda p, i: embedding_lookup(kv, "t", i, anchor=p).sum()))
before = kv.row_sparse_pull("t", row_ids=np.array([2**40 + 1, 1])).copy()
step(make_anchor(), ids)
jax.effects_barrier()
after = kv.row_sparse_pull("t", row_ids=np.array([2**40 + 1, 1]))
np.testing.assert_allclose(after[0], before[0] - 1.0, rtol=1e-6)
np.testing.assert_array_equal(after[1], before[1])
print("ok")
"""


def test_jax_ids_with_x64_on_keep_64_bits_under_jit():
    result = subprocess.run(
        [sys.executable, "-c", X64_ON],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=str(REPO_ROOT),
        timeout=240,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_table_is_created_with_the_given_settings(kv):
    rows = embedding_lookup(
        kv, "item", np.array([1, 2]), embedding_dim=3, initializer=initializers.Constant(0.25)
    )
    np.testing.assert_array_equal(rows, np.full((2, 3), 0.25))
    assert kv.key_info("item").dim == 3
    embedding_lookup(kv, "item", np.array([1]))  # exists: no dim needed
    with pytest.raises(errors.ShapeError):
        embedding_lookup(kv, "item", np.array([1]), embedding_dim=4)
    with pytest.raises(errors.UnknownKey, match="embedding_dim"):
        embedding_lookup(kv, "missing", np.array([1]))


def test_errors(kv):
    sgd_table(kv)
    with pytest.raises(errors.DTypeError):
        embedding_lookup(kv, "user", np.array([1.5]))
    with pytest.raises(errors.DTypeError):
        embedding_lookup(kv, "user", jnp.array([1.5]))
    with pytest.raises(errors.DTypeError, match="anchor"):
        embedding_lookup(kv, "user", np.array([1]), anchor=jnp.zeros(0, jnp.int32))


# -- gradient -------------------------------------------------------------------------------


def _loss(kv, ids, anchor, weights):
    rows = embedding_lookup(kv, "user", ids, anchor=anchor)
    return jnp.sum(jnp.tanh(rows) * weights)


def _check_one_sgd_step(kv, ids, run_grad):
    """run_grad(params, weights) takes one gradient; the table must equal hand-made SGD."""
    ids_np = np.asarray(ids)
    unique = np.unique(ids_np)
    initial = dict(zip(unique.tolist(), kv.row_sparse_pull("user", row_ids=unique)))
    rows_before = kv.row_sparse_pull("user", row_ids=ids_np)
    weights = jnp.asarray(
        np.random.default_rng(1).normal(size=ids_np.shape + (4,)).astype(np.float32)
    )
    params = {"user": make_anchor(), "scale": jnp.float32(1.0)}
    grads = run_grad(params, weights)
    jax.effects_barrier()  # the push is a host callback: wait for it before reading
    assert grads["user"].shape == (0,)
    # d/d rows of sum(tanh(rows) * w) = (1 - tanh(rows)^2) * w
    grad_rows = (1 - np.tanh(rows_before) ** 2) * np.asarray(weights)
    expected = expected_after_sgd(initial, ids_np, grad_rows)
    got = kv.row_sparse_pull("user", row_ids=unique)
    np.testing.assert_allclose(got, np.stack([expected[i] for i in unique.tolist()]), rtol=1e-5)
    assert not np.allclose(got, np.stack([initial[i] for i in unique.tolist()]))


def test_grad_pushes_the_gradient_eagerly(two_servers):
    sgd_table(two_servers)
    ids = np.array([[3, 2**40], [3, -9]])  # 3 twice: its two gradients are summed

    def run_grad(params, weights):
        def loss(p):
            return _loss(two_servers, ids, p["user"], weights) * p["scale"]

        return jax.grad(loss)(params)

    _check_one_sgd_step(two_servers, ids, run_grad)


def test_grad_under_jit_with_traced_ids(kv):
    sgd_table(kv)
    ids = jnp.array([5, 6, 5, 5], dtype=jnp.int32)

    @jax.jit
    def step(params, weights, ids):
        return jax.grad(lambda p: _loss(kv, ids, p["user"], weights))(params)

    _check_one_sgd_step(kv, ids, lambda params, weights: step(params, weights, ids))
    # A second call of the compiled step pushes again (the callbacks run each time).
    before = kv.row_sparse_pull("user", row_ids=np.array([6]))
    step({"user": make_anchor(), "scale": jnp.float32(1.0)}, jnp.ones((4, 4)), ids)
    jax.effects_barrier()
    assert not np.array_equal(kv.row_sparse_pull("user", row_ids=np.array([6])), before)


def test_grad_under_jit_with_host_ids(kv):
    sgd_table(kv)
    ids = np.array([2**40 + 1, 7, 2**40 + 1])

    def run_grad(params, weights):
        return jax.jit(jax.grad(lambda p: _loss(kv, ids, p["user"], weights)))(params)

    _check_one_sgd_step(kv, ids, run_grad)


def test_value_and_grad_with_dense_parameters(kv):
    """Dense parameters get their ordinary gradient; the table gets its push."""
    sgd_table(kv)
    ids = np.array([1, 2])
    rows_before = kv.row_sparse_pull("user", row_ids=ids)
    params = {"user": make_anchor(), "w": jnp.arange(4, dtype=jnp.float32)}

    def loss(p):
        return jnp.sum(embedding_lookup(kv, "user", ids, anchor=p["user"]) @ p["w"])

    value, grads = jax.value_and_grad(loss)(params)
    jax.effects_barrier()
    np.testing.assert_allclose(value, (rows_before @ np.arange(4)).sum(), rtol=1e-6)
    np.testing.assert_allclose(grads["w"], rows_before.sum(axis=0), rtol=1e-6)
    np.testing.assert_allclose(
        kv.row_sparse_pull("user", row_ids=ids), rows_before - LR * np.arange(4), rtol=1e-6
    )


def test_without_anchor_nothing_is_pushed(kv):
    sgd_table(kv)
    ids = np.array([1, 2])
    before = kv.row_sparse_pull("user", row_ids=ids)
    w = jnp.ones(4)
    grad = jax.grad(lambda w: jnp.sum(embedding_lookup(kv, "user", ids) @ w))(w)
    jax.effects_barrier()
    np.testing.assert_allclose(grad, before.sum(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(kv.row_sparse_pull("user", row_ids=ids), before)
    assert kv.stats()["tables"]["user"]["rows"] == 0  # pulls do not insert; nothing pushed


def test_jitted_steps_see_the_previous_steps_push(two_servers):
    """Asynchronous dispatch keeps the order: each step pulls what the step before pushed."""
    sgd_table(two_servers)
    ids = jnp.array([1, 2, 1], dtype=jnp.int32)

    @jax.jit
    def step(anchor):
        return jax.grad(
            lambda a: jnp.sum(embedding_lookup(two_servers, "user", ids, anchor=a) ** 2)
        )(anchor)

    unique = np.array([1, 2])
    table = dict(
        zip([1, 2], two_servers.row_sparse_pull("user", row_ids=unique).astype(np.float64))
    )
    for _ in range(4):
        step(make_anchor())  # results not awaited: the next call is dispatched at once
        # d/d row of sum(row^2) over its occurrences = 2 * row * count
        table = {1: table[1] - LR * 2 * 2 * table[1], 2: table[2] - LR * 2 * table[2]}
    jax.effects_barrier()
    np.testing.assert_allclose(
        two_servers.row_sparse_pull("user", row_ids=unique),
        np.stack([table[1], table[2]]),
        rtol=1e-5,
    )


def test_vmap_of_the_gradient_pushes_each_example(kv):
    kv.init(
        "user",
        kvsparse.SparseTable(
            dim=2, initializer=initializers.Zeros(), optimizer=optimizers.SGD(learning_rate=1.0)
        ),
    )
    ids = jnp.array([[1, 2], [2, 3]], dtype=jnp.int32)

    def loss(anchor, example_ids):
        return jnp.sum(embedding_lookup(kv, "user", example_ids, anchor=anchor))

    jax.vmap(jax.grad(loss), in_axes=(None, 0))(make_anchor(), ids)
    jax.effects_barrier()
    np.testing.assert_array_equal(
        kv.row_sparse_pull("user", row_ids=np.array([1, 2, 3])), [[-1, -1], [-2, -2], [-1, -1]]
    )
