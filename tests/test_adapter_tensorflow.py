"""The TensorFlow adapter: a Keras layer whose table lives on the store.

Parity: the layer with a server-side optimizer against tf.keras.layers.Embedding
with the same Keras optimizer, on the same data and initial values, eagerly, in
tf.function and in model.fit, with the table on two real servers. Zero-copy is
checked by data pointers, eagerly and through tf.py_function.
"""

from __future__ import annotations

import itertools
import os
import textwrap

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from conftest import run_workers  # noqa: E402
from kvsparse.adapters import tensorflow as kvtf  # noqa: E402

import kvsparse  # noqa: E402
from kvsparse import _core, errors, initializers, optimizers  # noqa: E402


@pytest.fixture
def kv():
    store = kvsparse.create("local")
    yield store
    store.close()


@pytest.fixture(scope="module")
def servers(module_server_factory):
    """Two real servers shared by this module's tests (each test uses its own keys)."""
    return module_server_factory(2)


@pytest.fixture
def two_servers(servers):
    """A worker (rank 0 of 1) of a store whose tables are split over two real servers."""
    store = kvsparse.create("dist_sparse", servers=servers, rank=0, num_workers=1)
    yield store
    store.close()


_fresh = itertools.count()


def fresh_key(stem: str) -> str:
    """A key no other test used on the shared servers."""
    return f"{stem}_{next(_fresh)}"


def data_pointer(tensor) -> int:
    """Address of an eager CPU tensor's data (through DLPack, which does not copy)."""
    return _core.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor)).ctypes.data


# -- shapes, dtypes, table creation ---------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (2, 3, 4), (0,), (3, 0)])
def test_output_is_ids_shape_plus_dim_and_matches_the_store(kv, shape):
    emb = kvtf.Embedding(kv, "user", embedding_dim=6, seed=3)
    ids = np.random.default_rng(0).integers(-(2**62), 2**62, shape, dtype=np.int64)
    rows = emb(tf.constant(ids))
    assert rows.shape == shape + (6,) and rows.dtype == tf.float32
    np.testing.assert_array_equal(rows.numpy(), kv.row_sparse_pull("user", row_ids=ids))
    traced = tf.function(emb)(tf.constant(ids))
    np.testing.assert_array_equal(traced.numpy(), rows.numpy())


def test_int32_ids_are_cast_and_float_ids_refused(kv):
    emb = kvtf.Embedding(kv, "user", 4)
    ids = np.array([[1, 2], [3, 1]])
    np.testing.assert_array_equal(
        emb(tf.constant(ids, tf.int32)).numpy(), emb(tf.constant(ids, tf.int64)).numpy()
    )
    with pytest.raises(errors.DTypeError, match="integer"):
        emb(tf.constant([1.0, 2.0]))


def test_creates_the_table_once_and_checks_an_existing_one(kv):
    emb = kvtf.Embedding(kv, "item", 8, initializer=initializers.Constant(0.5), seed=1)
    assert "item" in kv and kv.key_info("item").dim == 8
    np.testing.assert_array_equal(emb(tf.constant([7])).numpy(), np.full((1, 8), 0.5))
    # An existing table is used as it is, whatever the other settings say.
    again = kvtf.Embedding(kv, "item", 8, initializer=initializers.Zeros())
    np.testing.assert_array_equal(again(tf.constant([7])).numpy(), np.full((1, 8), 0.5))
    assert kvtf.Embedding(kv, "item").embedding_dim == 8
    with pytest.raises(errors.ShapeError, match="dim 8"):
        kvtf.Embedding(kv, "item", 4)
    with pytest.raises(errors.UnknownKey):
        kvtf.Embedding(kv, "missing")


def test_backward_pushes_the_gradient_and_sums_duplicates(kv):
    emb = kvtf.Embedding(
        kv, "w", 2, initializer=initializers.Zeros(), optimizer=optimizers.SGD(learning_rate=1.0)
    )
    ids = tf.constant([[4, 9], [4, 4]], tf.int64)
    weights = tf.constant([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(emb(ids) * weights)
    (trigger_gradient,) = tape.gradient(loss, emb.trainable_variables)
    assert float(trigger_gradient) == 0.0 and emb.pushes == 1
    np.testing.assert_array_equal(
        kv.row_sparse_pull("w", row_ids=np.array([4, 9])), [[-13.0, -16.0], [-3.0, -4.0]]
    )


@pytest.mark.parametrize("compiled", [False, True])
def test_indexed_slices_gradient(kv, compiled):
    """tf.gather of the rows gives the layer an IndexedSlices gradient (eagerly and in graphs)."""
    emb = kvtf.Embedding(
        kv, "w", 3, initializer=initializers.Zeros(), optimizer=optimizers.SGD(learning_rate=1.0)
    )

    def step(ids):
        with tf.GradientTape() as tape:
            picked = tf.gather(emb(ids), [0, 2, 2])
            loss = tf.reduce_sum(picked)
        return tape.gradient(loss, emb.trainable_variables)

    if compiled:
        step = tf.function(step)
    step(tf.constant([10, 11, 12], tf.int64))
    np.testing.assert_array_equal(
        kv.row_sparse_pull("w", row_ids=np.array([10, 11, 12])),
        [[-1.0] * 3, [0.0] * 3, [-2.0] * 3],
    )
    assert emb.pushes == 1


def test_push_is_not_pruned_when_gradients_are_unused(kv):
    emb = kvtf.Embedding(
        kv, "w", 1, initializer=initializers.Zeros(), optimizer=optimizers.SGD(learning_rate=1.0)
    )

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(emb(ids))
        tape.gradient(loss, emb.trainable_variables)  # result dropped
        return loss

    step(tf.constant([1], tf.int64))
    step(tf.constant([1], tf.int64))
    assert emb.pushes == 2
    assert kv.row_sparse_pull("w", row_ids=np.array([1]))[0, 0] == -2.0


def test_model_with_the_layer_stays_off_xla(kv):
    """py_function cannot be compiled: jit_compile=True falls back to plain tf.function."""
    ids = keras.Input((2,), dtype="int64")
    rows = kvtf.Embedding(kv, "w", 2, optimizer=optimizers.SGD(learning_rate=0.1))(ids)
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(rows)))
    with pytest.warns(UserWarning, match="jit_compile"):
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert model.jit_compile is False
    model.fit(np.array([[1, 2]]), np.ones((1, 1), np.float32), verbose=0)
    assert model.layers[1].pushes == 1


# -- zero-copy ------------------------------------------------------------------------------


class Recorder:
    """Wraps kv.row_sparse_pull / kv.push to note where their arrays live."""

    def __init__(self, kv, monkeypatch):
        self.pulled, self.pushed, self.ids = [], [], []
        pull, push = kv.row_sparse_pull, kv.push

        def recording_pull(key, out=None, priority=0, row_ids=None):
            self.pulled.append(out.ctypes.data)
            self.ids.append(row_ids.ctypes.data)
            return pull(key, out=out, priority=priority, row_ids=row_ids)

        def recording_push(key, value, priority=0):
            self.pushed.append(value[1].ctypes.data)
            return push(key, value, priority)

        monkeypatch.setattr(kv, "row_sparse_pull", recording_pull)
        monkeypatch.setattr(kv, "push", recording_push)


def test_pull_lands_in_the_output_tensor_without_a_copy(kv, monkeypatch):
    emb = kvtf.Embedding(kv, "user", 16)
    recorder = Recorder(kv, monkeypatch)
    ids = tf.constant([[1, 2, 3], [4, 5, 6]], tf.int64)
    rows = emb(ids)
    assert recorder.pulled == [data_pointer(rows)]
    assert recorder.ids == [data_pointer(ids)]  # the store reads the ids in place too
    assert data_pointer(rows) % 64 == 0

    seen = []

    def note(t):
        seen.append(data_pointer(t))
        return tf.zeros(())

    @tf.function
    def graph(ids):
        return tf.py_function(note, [emb(ids)], tf.float32)

    graph(tf.constant([[7, 8]], tf.int64))
    assert seen == [recorder.pulled[-1]]


def test_gradient_reaches_the_store_without_a_copy(kv, monkeypatch):
    emb = kvtf.Embedding(kv, "user", 16, optimizer=optimizers.SGD(learning_rate=0.1))
    recorder = Recorder(kv, monkeypatch)
    ids = tf.constant([[1, 2], [3, 4]], tf.int64)
    values = kvtf.aligned_empty((2, 2, 16))
    values[...] = np.random.default_rng(0).normal(size=values.shape)
    injected = kvtf.numpy_to_tensor(values)
    assert data_pointer(injected) == values.ctypes.data

    @tf.custom_gradient
    def inject(rows):
        return tf.identity(rows), lambda upstream: injected

    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(inject(emb(ids)))
    tape.gradient(loss, emb.trainable_variables)
    assert recorder.pushed == [values.ctypes.data]

    # In a graph the gradient comes out of a py_function; its buffer reaches the store.
    made = []

    def make_gradient():
        array = kvtf.aligned_empty((2, 2, 16))
        array[...] = 1.0
        made.append(array.ctypes.data)
        return kvtf.numpy_to_tensor(array)

    @tf.custom_gradient
    def inject_in_graph(rows):
        def gradient(upstream):
            result = tf.py_function(make_gradient, [], tf.float32)
            result.set_shape(rows.shape)
            return result

        return tf.identity(rows), gradient

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(inject_in_graph(emb(ids)))
        return tape.gradient(loss, emb.trainable_variables)

    step(ids)
    assert recorder.pushed[1:] == made and len(made) == 1


def test_numpy_to_tensor_refuses_unaligned_memory():
    array = kvtf.aligned_empty((17,))[1:]
    with pytest.raises(errors.InvalidArgument, match="aligned"):
        kvtf.numpy_to_tensor(array)


# -- parity with tf.keras.layers.Embedding ------------------------------------------------

VOCAB, DIM, FIELDS, BATCH, STEPS, LR = 64, 8, 3, 16, 6, 0.1


def table_optimizer(kind):
    if kind == "sgd":
        return optimizers.SGD(learning_rate=LR)
    # Keras' Adagrad defaults. Keras 3 divides by sqrt(acc + epsilon), kvsparse
    # (torch) by sqrt(acc) + eps: with acc >= 0.1 the two differ by < 1e-7 relative.
    return optimizers.Adagrad(learning_rate=LR, initial_accumulator_value=0.1, eps=1e-7)


def keras_optimizer(kind):
    if kind == "sgd":
        return keras.optimizers.SGD(learning_rate=LR)
    return keras.optimizers.Adagrad(learning_rate=LR)


def make_data(unique_ids_per_batch, seed=0):
    rng = np.random.default_rng(seed)
    if unique_ids_per_batch:
        batches = [rng.permutation(VOCAB)[: BATCH * FIELDS] for _ in range(STEPS)]
        ids = np.concatenate(batches).reshape(-1, FIELDS)
    else:
        ids = rng.integers(0, VOCAB, (STEPS * BATCH, FIELDS))
    labels = rng.normal(size=(STEPS * BATCH, 1)).astype(np.float32)
    return ids.astype(np.int64), labels


def build_model(table, seed=5):
    keras.utils.set_random_seed(seed)
    ids = keras.Input((FIELDS,), dtype="int64")
    x = keras.layers.Flatten()(table(ids))
    x = keras.layers.Dense(8, activation="tanh")(x)
    return keras.Model(ids, keras.layers.Dense(1)(x))


def dense_weights(model):
    """The trainable weights other than the table (or the kvsparse push trigger)."""
    return [w for w in model.trainable_weights if w.path.split("/")[0] not in TABLE_LAYERS]


TABLE_LAYERS = ("kvsparse_table", "keras_table")


def model_pair(kv, kind, key, dense_start=None):
    """kvsparse model and a tf.keras.layers.Embedding one with the same starting weights.

    Returns (model, its layer, reference model, reference table, initial rows).
    """
    layer = kvtf.Embedding(
        kv, key, DIM, optimizer=table_optimizer(kind), seed=11, name="kvsparse_table"
    )
    initial = kv.row_sparse_pull(key, row_ids=np.arange(VOCAB))
    model = build_model(layer)
    reference_table = keras.layers.Embedding(VOCAB, DIM, name="keras_table")
    reference = build_model(reference_table)
    reference_table.set_weights([initial])
    if dense_start is None:
        dense_start = [w.numpy() for w in dense_weights(model)]
    for m in (model, reference):
        assert len(dense_weights(m)) == len(dense_start)
        for weight, value in zip(dense_weights(m), dense_start):
            weight.assign(value)
    return model, layer, reference, reference_table, initial


def mse(model, ids, labels):
    return tf.reduce_mean(tf.square(model(ids, training=True) - labels))


def train_custom(model, optimizer, ids, labels, compiled, densify=False):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = mse(model, x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        if densify:
            grads = [tf.convert_to_tensor(g) for g in grads]
        optimizer.apply(grads, model.trainable_variables)
        return loss

    if compiled:
        step = tf.function(step)
    losses = []
    for start in range(0, len(labels), BATCH):
        x = tf.constant(ids[start : start + BATCH])
        losses.append(float(step(x, tf.constant(labels[start : start + BATCH]))))
    return losses


def train_fit(model, optimizer, ids, labels):
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(ids, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return history.history["loss"]


def assert_same_training(kv, layer, model, reference, reference_table, initial):
    table = kv.row_sparse_pull(layer.key, row_ids=np.arange(VOCAB))
    assert np.abs(table - initial).max() > 1e-3  # the table did train
    np.testing.assert_allclose(table, reference_table.get_weights()[0], rtol=1e-5, atol=1e-6)
    ours, theirs = dense_weights(model), dense_weights(reference)
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    assert float(layer.push_trigger.numpy()) == 0.0


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
@pytest.mark.parametrize("path", ["eager", "tf.function", "model.fit"])
def test_parity_with_keras_embedding_on_two_servers(two_servers, kind, path):
    """Same data, seeds, initial rows and optimizer: identical tables and dense weights.

    SGD batches repeat ids. Adagrad batches do not: Keras 3 applies Adagrad to
    an IndexedSlices gradient occurrence by occurrence, so an id seen k times
    adds sum(g_i^2) to its accumulator where torch, TF1 and kvsparse add
    (sum g_i)^2 (the next test covers repeated ids against dense gradients).
    """
    kv = two_servers
    assert kv.num_servers == 2
    ids, labels = make_data(unique_ids_per_batch=kind == "adagrad")
    key = fresh_key("emb")
    model, layer, reference, reference_table, initial = model_pair(kv, kind, key)
    if path == "model.fit":
        ours = train_fit(model, keras_optimizer(kind), ids, labels)
        theirs = train_fit(reference, keras_optimizer(kind), ids, labels)
    else:
        compiled = path == "tf.function"
        ours = train_custom(model, keras_optimizer(kind), ids, labels, compiled)
        theirs = train_custom(reference, keras_optimizer(kind), ids, labels, compiled)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert layer.pushes == STEPS
    assert_same_training(kv, layer, model, reference, reference_table, initial)
    stats = kv.stats()["shards"]
    assert all(shard["tables"][key]["rows"] > 0 for shard in stats)  # both servers hold rows


@pytest.mark.parametrize("compiled", [False, True])
def test_adagrad_parity_with_repeated_ids_against_dense_gradients(two_servers, compiled):
    """With repeated ids, kvsparse matches Keras' Adagrad on the summed (dense) gradient."""
    kv = two_servers
    ids, labels = make_data(unique_ids_per_batch=False)
    model, layer, reference, reference_table, initial = model_pair(kv, "adagrad", fresh_key("e"))
    train_custom(model, keras_optimizer("adagrad"), ids, labels, compiled)
    train_custom(reference, keras_optimizer("adagrad"), ids, labels, compiled, densify=True)
    assert_same_training(kv, layer, model, reference, reference_table, initial)


# -- dense gradients over two workers -------------------------------------------------------

WORKER = textwrap.dedent(
    """
    import os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import numpy as np, keras, kvsparse
    from kvsparse import optimizers
    from kvsparse.adapters import tensorflow as kvtf

    kv = kvsparse.create("dist_sparse")
    data = np.load(sys.argv[1])
    rank, workers = kv.rank, kv.num_workers
    # Each worker takes its half of every batch of 16. The table's SGD gets the
    # sum of both workers' gradients: rescale_grad=1/workers makes it the mean.
    mine = np.concatenate([np.arange(s + 8 * rank, s + 8 * rank + 8)
                           for s in range(0, len(data["labels"]), 16)])
    key = sys.argv[3]
    layer = kvtf.Embedding(kv, key, 8, seed=11, name="kvsparse_table",
                           optimizer=optimizers.SGD(learning_rate=0.1, rescale_grad=1 / workers))
    inputs = keras.Input((3,), dtype="int64")
    x = keras.layers.Flatten()(layer(inputs))
    x = keras.layers.Dense(8, activation="tanh")(x)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    dense = [w for w in model.trainable_weights if not w.path.startswith("kvsparse_table")]
    for i, weight in enumerate(dense):
        weight.assign(data[f"start{i}"])
    optimizer = kvtf.DistributedOptimizer(keras.optimizers.SGD(0.1), kv, key=key + "_dense")
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(data["ids"][mine], data["labels"][mine], batch_size=8, epochs=1, shuffle=False,
              verbose=0)
    kv.barrier()
    result = {f"dense{i}": w.numpy() for i, w in enumerate(dense)}
    table = kv.row_sparse_pull(key, row_ids=np.arange(64))
    np.savez(sys.argv[2].format(rank=rank), table=table, **result)
    kv.barrier()
    kv.close()
    """
)


def test_distributed_optimizer_averages_dense_gradients_over_two_workers(server_factory, tmp_path):
    """Two workers, half of each batch each, end where one model on whole batches does."""
    servers = server_factory(2)  # a server keeps the worker count of its first client
    ids, labels = make_data(unique_ids_per_batch=False)
    kv = kvsparse.create("local")
    model, layer, reference, reference_table, initial = model_pair(kv, "sgd", "emb")
    start = {f"start{i}": w.numpy() for i, w in enumerate(dense_weights(reference))}
    np.savez(tmp_path / "data.npz", ids=ids, labels=labels, **start)
    key = "emb"
    run_workers(
        WORKER,
        servers,
        2,
        tmp_path,
        timeout=200,
        args=[tmp_path / "data.npz", tmp_path / "result{rank}.npz", key],
        env={"TF_CPP_MIN_LOG_LEVEL": "2"},
    )

    train_fit(reference, keras.optimizers.SGD(LR), ids, labels)
    for rank in range(2):
        result = np.load(tmp_path / f"result{rank}.npz")
        table = result["table"]
        assert np.abs(table - initial).max() > 1e-3
        np.testing.assert_allclose(table, reference_table.get_weights()[0], rtol=1e-5, atol=1e-6)
        for i, weight in enumerate(dense_weights(reference)):
            np.testing.assert_allclose(result[f"dense{i}"], weight.numpy(), rtol=1e-5, atol=1e-6)


def test_average_gradients_with_one_worker_is_the_identity(kv):
    gradients = [tf.ones((2, 3)), None, tf.IndexedSlices(tf.ones((1, 3)), tf.constant([0]))]
    result = kvtf.average_gradients(kv, gradients)
    assert result[0] is gradients[0] and result[1] is None and result[2] is gradients[2]


# -- saving and loading a Keras model ------------------------------------------------------

LOAD_IN_A_FRESH_PROCESS = textwrap.dedent(
    """
    import sys
    import numpy as np
    import keras
    import kvsparse
    import kvsparse.adapters.tensorflow as kvtf  # registers the layer with Keras

    directory = sys.argv[1]
    data = np.load(directory + "/data.npz")
    ids, labels = data["ids"], data["labels"]

    # Without a store: loads, refuses to look up, then runs once bound.
    unbound = keras.models.load_model(directory + "/m.keras")
    layer = [l for l in unbound.layers if isinstance(l, kvtf.Embedding)][0]
    assert layer.kv is None and layer.key == "saved_emb" and layer.embedding_dim == 3
    try:
        unbound.predict(ids, verbose=0)
    except Exception as exc:
        assert "bind(model, kv)" in str(exc), exc
    else:
        raise AssertionError("an unbound layer looked rows up")

    kv = kvsparse.create("local")
    kv.load(directory + "/store")
    np.testing.assert_array_equal(kvtf.bind(unbound, kv).predict(ids, verbose=0), data["before"])

    # load_model(path, kv), and keras.models.load_model in store_scope: the same rows.
    model = kvtf.load_model(directory + "/m.keras", kv)
    with kvtf.store_scope(kv):
        scoped = keras.models.load_model(directory + "/m.keras")
    for loaded in (model, scoped):
        np.testing.assert_array_equal(loaded.predict(ids, verbose=0), data["before"])

    # A fresh store gets the table from the layer's config (its initializer and seed).
    fresh = kvsparse.create("local")
    kvtf.load_model(directory + "/m.keras", fresh)
    np.testing.assert_array_equal(
        fresh.row_sparse_pull("saved_emb", row_ids=ids[:1]), data["initial_rows"]
    )

    # Training goes on: the table's optimizer (from the store) and the dense weights move.
    rows_before = kv.row_sparse_pull("saved_emb", row_ids=ids.reshape(-1)).copy()
    dense_before = model.layers[-1].get_weights()[0].copy()
    model.fit(ids, labels, batch_size=4, epochs=1, verbose=0)
    assert not np.allclose(kv.row_sparse_pull("saved_emb", row_ids=ids.reshape(-1)), rows_before)
    assert not np.allclose(model.layers[-1].get_weights()[0], dense_before)
    print("ok")
    """
)


def test_a_saved_model_loads_in_a_fresh_process_and_binds_to_a_store(tmp_path):
    import subprocess
    import sys

    from conftest import REPO_ROOT, subprocess_env

    kv = kvsparse.create("local")
    ids = np.array([[1, 2], [2, 3], [5, 1], [7, 9]], np.int64)
    labels = np.array([[1.0], [0.0], [1.0], [0.5]], np.float32)
    table = dict(initializer=initializers.Uniform(-0.5, 0.5), seed=4)
    inputs = keras.Input((2,), dtype="int64")
    layer = kvtf.Embedding(kv, "saved_emb", 3, optimizer=optimizers.SGD(learning_rate=0.2), **table)
    initial_rows = kv.row_sparse_pull("saved_emb", row_ids=ids[:1])
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(layer(inputs)))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(ids, labels, batch_size=4, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    kv.save(tmp_path / "store")
    np.savez(
        tmp_path / "data.npz",
        ids=ids,
        labels=labels,
        before=model.predict(ids, verbose=0),
        initial_rows=initial_rows,
    )
    kv.close()
    result = subprocess.run(
        [sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, str(tmp_path)],
        capture_output=True,
        text=True,
        env=subprocess_env({"TF_CPP_MIN_LOG_LEVEL": "2"}),
        cwd=str(REPO_ROOT),
        timeout=280,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_get_config_names_the_table_and_from_config_binds_in_a_scope(kv):
    layer = kvtf.Embedding(kv, "cfg", 4, optimizer=optimizers.Adagrad(learning_rate=0.1), seed=3)
    config = layer.get_config()
    assert config["key"] == "cfg" and config["embedding_dim"] == 4
    assert config["table"]["optimizer"]["kind"] == "adagrad" and config["table"]["seed"] == 3
    assert kvtf.Embedding.from_config(config).kv is None
    with kvtf.store_scope(kv):
        assert kvtf.Embedding.from_config(config).kv is kv
    other = kvsparse.create("local")
    try:
        kvtf.Embedding.from_config(config).bind(other)
        assert other.key_info("cfg").dim == 4 and other.key_info("cfg").own_optimizer
        with pytest.raises(errors.ShapeError):
            kvtf.Embedding.from_config({**config, "embedding_dim": 5}).bind(other)
    finally:
        other.close()


def test_a_keras_schedule_drives_the_servers_rate_and_keeps_the_accumulator(kv):
    from reference import ReferenceOptimizer

    layer = kvtf.Embedding(kv, "scheduled", 3, optimizer=optimizers.Adagrad(learning_rate=0.5))
    inputs = keras.Input((2,), dtype="int64")
    flat = keras.layers.Flatten()(layer(inputs))
    model = keras.Model(inputs, keras.layers.Add()([flat, keras.layers.Dense(6)(flat)]))
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([2], [0.1, 0.01])
    # d loss / d output = 1 / batch for every element: each row's gradient is 1 + the dense
    # weights' column sums, so the dense layer is frozen to keep it a known constant.
    model.layers[-2].trainable = False
    model.compile(
        optimizer=keras.optimizers.SGD(schedule), loss=lambda y, p: keras.ops.sum(p, axis=-1)
    )
    ids = np.tile(np.array([[1, 2], [3, 4]], np.int64), (4, 1))
    keys = np.array([1, 2, 3, 4])
    rows = kv.row_sparse_pull("scheduled", row_ids=keys).copy()
    kernel = model.layers[-2].get_weights()[0]
    gradient = (1.0 + kernel.sum(axis=1)).reshape(2, 3) / 2  # per row of a sample, per batch
    model.fit(
        ids,
        np.zeros((8, 1), np.float32),
        batch_size=2,
        shuffle=False,
        verbose=0,
        callbacks=[kvtf.FollowLearningRate(kv, learning_rate=0.5)],
    )
    slots = [None] * 4
    # The schedule gives 0.1 up to iteration 2 (Keras' step 3), then 0.01: the servers get
    # 0.5 times that over 0.1, for the step Keras' own update uses it in.
    for step, rate in enumerate([0.5, 0.5, 0.5, 0.05], start=1):
        reference = ReferenceOptimizer(optimizers.Adagrad(learning_rate=rate).to_dict())
        for i in range(4):
            if slots[i] is None:
                slots[i] = reference.initial_slots(3)
            reference.update(rows[i], slots[i], gradient[i % 2], step)
    np.testing.assert_allclose(kv.row_sparse_pull("scheduled", row_ids=keys), rows, rtol=2e-5)
