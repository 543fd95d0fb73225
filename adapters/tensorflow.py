"""TensorFlow adapter: a Keras embedding layer whose table lives on kvsparse servers.

`Embedding` is a Keras layer that holds no table. Its forward pulls the rows of
the batch's ids from the store; its gradient function pushes (ids, d loss /
d rows) back, and the table's own optimizer (``SparseTable(optimizer=...)``)
updates those rows on the servers. The Keras optimizer only sees the dense
weights. It works eagerly, inside `tf.function` and in `model.fit`.

How the gradient reaches the store: TensorFlow never differentiates through
integer ids, so each layer owns one float32 scalar weight, ``push_trigger``, fed
to a `tf.custom_gradient` lookup. Asking the tape for the gradient of the
layer's trainable weights (``model.trainable_variables`` does) runs the gradient
function, which pushes and returns the push's result (a zero) as the trigger's
gradient: the push is a data dependency of the optimizer step, so graph pruning
cannot drop it. The trigger is created with ``overwrite_with_gradient=True``:
Keras optimizers assign it that zero, keep no slots for it and never decay it.
In graph mode (tf.function, model.fit) pull and push run inside
`tf.py_function`; TensorFlow runs stateful ops without resource inputs in
program order, so pulls and pushes reach the store in the same order on every
worker.

Zero-copy (CPU tensors), checked by pointer in tests/test_adapter_tensorflow.py:

- Pull: the store gathers the rows straight into a fresh 64-byte-aligned NumPy
  buffer (``row_sparse_pull(..., out=buffer)``), which TensorFlow adopts through
  a DLPack capsule (``_core.to_dlpack`` -> ``tf.experimental.dlpack.from_dlpack``);
  the layer's output tensor is that buffer, eagerly and through py_function.
  The alignment matters: TensorFlow kernels abort on a tensor whose data is not
  aligned to 64 bytes, and DLPack import does not realign.
- Push: the gradient tensor (and the ids) are viewed read-only through DLPack
  (``tf.experimental.dlpack.to_dlpack`` -> ``_core.from_dlpack``); the store
  reads them in place and sums the rows of duplicate ids into its own buffer.
- Copies that do happen: a gradient that arrives as `tf.IndexedSlices` is made
  dense; ids of another integer dtype are cast to int64; `average_gradients`
  packs the dense gradients into one buffer for a single push (the pulled
  average comes back zero-copy).

Dense weights with several workers: wrap the Keras optimizer in
`DistributedOptimizer` (or call `average_gradients` in a custom loop). It sums
the dense gradients over workers through one dense key of the store (no
optimizer on it, so a BSP push leaves the sum of all workers' pushes), divides
by ``kv.num_workers`` and lets the Keras optimizer step locally. Start every
worker from the same dense weights (same seed).

Rules worth knowing:

- One gradient computation = one push per layer call. A second
  ``tape.gradient`` on a persistent tape pushes again; a layer called twice in
  one step pushes twice (look up all fields in one call to push once).
- The tape's sources must include the layer's ``push_trigger`` (they do when
  you pass ``model.trainable_variables``), or nothing is pushed.
- With several workers every worker must run the same number of steps: a BSP
  step waits for all of them.
- Gradient clipping by the Keras optimizer (``clipnorm`` ...) does not reach
  the table; use the table optimizer's ``clip_gradient``.
- ``jit_compile`` (XLA) cannot run py_function: the layer sets
  ``supports_jit = False``, so ``model.compile(jit_compile='auto')`` stays off XLA.
- Saving a Keras model does not save the table: save the store. The layer is
  registered with Keras (``kvsparse>Embedding``) and its config names the table
  and the settings it creates it with, so a model saved with ``model.save``
  loads in a fresh process (after ``import kvsparse.adapters.tensorflow``):
  ``load_model(path, kv)`` here, or ``keras.models.load_model`` inside
  ``with store_scope(kv):``, or with no store and `bind` afterwards (an
  unbound layer refuses to look rows up). Binding creates a missing table
  from the config, or checks an existing one's dim and dtype.

Matching a Keras optimizer on the table (tests/test_adapter_tensorflow.py checks
these against tf.keras.layers.Embedding, which is Keras 3 in TF >= 2.16):

- ``keras.optimizers.SGD(lr)`` = ``kvsparse.optimizers.SGD(learning_rate=lr)``.
- ``keras.optimizers.Adagrad(lr)`` ~ ``kvsparse.optimizers.Adagrad(learning_rate=lr,
  initial_accumulator_value=0.1, eps=1e-7)`` (Keras' defaults). Keras 3 divides by
  ``sqrt(acc + epsilon)``, kvsparse (like torch and Keras 2 / TF's ApplyAdagradV2)
  by ``sqrt(acc) + eps``; with acc >= 0.1 the two differ by under 2e-7 relative.
  Keras 3 also applies Adagrad to an IndexedSlices gradient occurrence by
  occurrence: an id seen k times in a batch adds sum(g_i^2) to its accumulator,
  where kvsparse (and torch, TF1) first sums the rows and adds (sum g_i)^2.
  The two agree on batches without repeated ids, and on repeated ids when the
  Keras side is given the dense gradient.
- With several workers, a BSP push applies the sum of the workers' gradients:
  ``rescale_grad=1/num_workers`` on the table optimizer makes it their mean, as
  `average_gradients` does for the dense weights.

Example:
    >>> import numpy as np, tensorflow as tf, kvsparse
    >>> from kvsparse.adapters.tensorflow import Embedding
    >>> kv = kvsparse.create('local')
    >>> emb = Embedding(kv, 'user', embedding_dim=4,
    ...                 optimizer=kvsparse.optimizers.SGD(learning_rate=0.1))
    >>> ids = tf.constant([[3, 7], [7, 9]], tf.int64)
    >>> with tf.GradientTape() as tape:
    ...     loss = tf.reduce_sum(emb(ids))
    >>> _ = tape.gradient(loss, emb.trainable_variables)  # pushes; SGD runs on the store
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref

import keras
import numpy as np
import tensorflow as tf
from kvsparse.adapters._common import TableOptions, check_trainable, ensure_table, store_lock

from kvsparse import _core, errors
from kvsparse.arrays import table_dtype as table_dtype_name
from kvsparse.table import SparseTable

# TensorFlow's CPU kernels check that tensor data is aligned to
# EIGEN_MAX_ALIGN_BYTES (64 with AVX-512) and abort otherwise; NumPy only
# aligns to 16.
_ALIGNMENT = 64
_FLOATS_PER_ALIGNMENT = _ALIGNMENT // 4


# -- tensors <-> arrays ---------------------------------------------------------------------


def aligned_empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialized C-contiguous array whose data is 64-byte aligned.

    TensorFlow can adopt it through DLPack without a copy (see module docstring).
    Safe to call from several threads at once, as are the two functions below.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % _ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def tensor_to_numpy(tensor: tf.Tensor) -> np.ndarray:
    """A read-only NumPy view of an eager CPU tensor, through DLPack (no copy).

    Tensors on another device, and empty ones, are copied (DLPack export would
    refuse them or hand out no buffer).
    """
    if tensor.shape.num_elements() == 0:
        return np.empty(tuple(tensor.shape), tensor.dtype.as_numpy_dtype)
    if "CPU" not in tensor.device.upper():
        with tf.device("CPU:0"):
            tensor = tf.identity(tensor)
    return _core.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))


def numpy_to_tensor(array: np.ndarray) -> tf.Tensor:
    """An eager tensor adopting `array`'s buffer through DLPack (no copy).

    The array must be writeable and 64-byte aligned (`aligned_empty`); TF then
    owns a reference to it. Never write to the array afterwards: TF tensors are
    immutable.
    """
    if array.size == 0:
        return tf.zeros(array.shape, tf.as_dtype(array.dtype))
    if array.ctypes.data % _ALIGNMENT or not array.flags.c_contiguous:
        raise errors.InvalidArgument(
            "numpy_to_tensor needs a C-contiguous, 64-byte aligned array (use aligned_empty)"
        )
    return tf.experimental.dlpack.from_dlpack(_core.to_dlpack(array))


def _dense(gradient) -> tf.Tensor:
    if isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient


# -- the embedding layer --------------------------------------------------------------------


# The store `store_scope` gives the layers Keras makes from a config (load_model), per thread.
_scope = threading.local()


@contextlib.contextmanager
def store_scope(kv):
    """Within the block, `Embedding` layers made from a config (``keras.models.load_model``,
    ``from_config``, ``clone_model``) are bound to kv.

    Per thread (a load in another thread does not see it); blocks nest.

    Example:
        >>> with store_scope(kv):
        ...     model = keras.models.load_model('m.keras')
    """
    previous = getattr(_scope, "kv", None)
    _scope.kv = kv
    try:
        yield kv
    finally:
        _scope.kv = previous


def bind(model, kv):
    """Binds every kvsparse `Embedding` in model (a layer or a model, nested ones
    included) to kv: a missing table is created from the layer's config, an
    existing one is checked. Returns model.

    Use it for a model loaded without a store (``keras.models.load_model`` outside
    `store_scope`), or to move a model to another store. Not safe to call while the
    model runs.

    Raises:
        kvsparse.errors.ShapeError / InvalidArgument: a table of kv with another dim
            or dtype than a layer's.

    Example:
        >>> model = bind(keras.models.load_model('m.keras'), kv)
    """
    layers = [model] if isinstance(model, Embedding) else []
    if hasattr(model, "_flatten_layers"):
        layers += [layer for layer in model._flatten_layers(include_self=False, recursive=True)]
    for layer in layers:
        if isinstance(layer, Embedding):
            layer.bind(kv)
    return model


def load_model(path, kv, **kwargs):
    """``keras.models.load_model(path, **kwargs)`` with its kvsparse layers bound to kv.

    The table's rows are the store's: restore them first (``kv.load``), or
    connect to the servers that hold them. Safe to call from several threads at
    once (`store_scope` is per thread).

    Example:
        >>> kv = kvsparse.create('local'); kv.load('ckpt')
        >>> model = load_model('m.keras', kv)
    """
    with store_scope(kv):
        return bind(keras.models.load_model(path, **kwargs), kv)


@keras.saving.register_keras_serializable(package="kvsparse")
class Embedding(keras.layers.Layer):
    """A Keras embedding layer backed by a kvsparse table: output ids.shape + (dim,).

    Args:
        kv: a kvsparse.KVStore ('local' or 'dist_sparse' ...), or None: an
            unbound layer (it needs embedding_dim; `bind` it before use).
        key: the table's key on the store (str or int).
        embedding_dim: row width; the table is created with it if `key` does
            not exist yet (checked against the table otherwise).
        initializer, optimizer, seed, partitioner, nonfinite: settings of the
            kvsparse.SparseTable created when the table does not exist yet;
            `optimizer` (a kvsparse.optimizers object) runs on the servers.
            Ignored for an existing table.
        table_dtype: the table's storage dtype when this creates it: tf.float32
            (default), tf.float16 or tf.bfloat16 (kvsparse.SparseTable's dtype;
            an existing table of another dtype is refused). Pulled rows are
            cast to the layer's compute dtype (Keras' dtype policy).
        **kwargs: keras.layers.Layer arguments (name, dtype policy, ...).

    Call:
        ids: an integer tensor of any shape (int64 is used as it is, other
        integer dtypes are cast). Floating-point ids are refused: a float
        cannot hold 64-bit hashed ids (use ``keras.Input(..., dtype='int64')``).

    Saving: registered with Keras; ``get_config`` names the table (``key``,
    ``embedding_dim``, ``table_dtype``) and the SparseTable settings (``table``)
    that `bind` creates a missing table with. See `load_model`.

    Raises:
        kvsparse.errors.ShapeError: an existing table with another dim.
        kvsparse.errors.DTypeError: non-integer ids.
        kvsparse.errors.InvalidArgument: called while unbound (no store).

    Threads: layers of one store may run in different threads (every store
    call, eager or in a py_function, takes `store_lock(kv)`); one layer's
    ``pushes`` counter is not meant for concurrent calls of that layer.

    Example:
        >>> ids = keras.Input((9,), dtype='int64')
        >>> rows = Embedding(kv, 'fm_embed', 16, optimizer=kvsparse.optimizers.Adagrad(0.05))(ids)
        >>> model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(rows)))
        >>> model.compile(optimizer='adam', loss='mse')  # the table's Adagrad runs on the store
    """

    def __init__(
        self,
        kv,
        key,
        embedding_dim=None,
        *,
        initializer=None,
        optimizer=None,
        seed: int = 0,
        partitioner=None,
        nonfinite: str = "raise",
        table_dtype=None,
        **kwargs,
    ):
        table = kwargs.pop("table", None)  # a config's table settings (get_config)
        super().__init__(**kwargs)
        if table is not None:
            spec = SparseTable.from_dict(table)
            initializer, optimizer, seed = spec.initializer, spec.optimizer, spec.seed
            partitioner, nonfinite = spec.partitioner, spec.nonfinite
            table_dtype = table_dtype if table_dtype is not None else spec.dtype
        self.key = key
        self._options = TableOptions(
            initializer, optimizer, seed, partitioner, nonfinite, table_dtype
        )
        self.kv = None
        if kv is None:
            if embedding_dim is None:
                raise errors.InvalidArgument(
                    f"Embedding {key!r} without a store needs embedding_dim"
                )
            self.embedding_dim = int(embedding_dim)
            # The table's storage dtype; rows come out in it.
            self.table_dtype = tf.as_dtype(table_dtype_name(table_dtype or "float32"))
        else:
            self.embedding_dim = int(embedding_dim) if embedding_dim is not None else None
            self.bind(kv)
        # py_function cannot be compiled by XLA.
        self.supports_jit = False
        self.push_trigger = self.add_weight(
            shape=(),
            initializer="zeros",
            dtype="float32",
            trainable=True,
            overwrite_with_gradient=True,
            name="push_trigger",
        )
        self.built = True
        self.pushes = 0  # counted in Python, so graph-mode pushes count too

    def bind(self, kv) -> None:
        """Uses kv's table `key` from now on: created with the layer's settings if
        missing, else checked (its dim and dtype must be the layer's). Not safe to call
        while the layer runs.

        Raises:
            kvsparse.errors.ShapeError / InvalidArgument: another dim or dtype.
        """
        options = self._options
        if getattr(self, "table_dtype", None) is not None and options.dtype is None:
            options = dataclasses.replace(options, dtype=self.table_dtype.name)
        dim = options.ensure(kv, self.key, self.embedding_dim)
        self.embedding_dim = dim
        # The table's storage dtype; rows come out in it (bfloat16 is pulled as float32
        # and cast, exactly: NumPy has no bfloat16 TF could adopt through DLPack).
        self.table_dtype = tf.as_dtype(kv.key_info(self.key).dtype)
        self.kv = kv

    def _store(self):
        if self.kv is None:
            raise errors.InvalidArgument(
                f"{self.name}: the layer is not bound to a kvsparse store (a model loaded "
                "without one); call kvsparse.adapters.tensorflow.bind(model, kv), or load "
                "it with kvsparse.adapters.tensorflow.load_model(path, kv)"
            )
        return self.kv

    # The store-facing halves; they take and return eager tensors.

    def _pull_eager(self, ids: tf.Tensor) -> tf.Tensor:
        kv = self._store()
        host_ids = tensor_to_numpy(ids)
        half = self.table_dtype == tf.float16
        out = aligned_empty(
            host_ids.shape + (self.embedding_dim,), np.float16 if half else np.float32
        )
        with store_lock(kv):
            kv.row_sparse_pull(self.key, out=out, row_ids=host_ids)
        rows = numpy_to_tensor(out)
        return tf.cast(rows, tf.bfloat16) if self.table_dtype == tf.bfloat16 else rows

    def _push_eager(self, ids: tf.Tensor, gradient: tf.Tensor) -> tf.Tensor:
        kv = self._store()
        host_ids = tensor_to_numpy(ids)
        rows = tensor_to_numpy(gradient)
        with store_lock(kv):
            check_trainable(kv, self.key)
            kv.push(self.key, (host_ids, rows))
        self.pushes += 1
        return tf.zeros((), tf.float32)

    def call(self, ids):
        ids = tf.convert_to_tensor(ids)
        if not ids.dtype.is_integer:
            raise errors.DTypeError(
                f"{self.name}: ids must be an integer tensor, got {ids.dtype.name} "
                "(declare inputs with keras.Input(..., dtype='int64'))"
            )
        if ids.dtype != tf.int64:
            ids = tf.cast(ids, tf.int64)
        out_shape = ids.shape.concatenate([self.embedding_dim])

        @tf.custom_gradient
        def lookup(trigger):
            del trigger  # only carries the gradient to the push
            if tf.executing_eagerly():
                rows = self._pull_eager(ids)
            else:
                rows = tf.py_function(
                    self._pull_eager, [ids], self.table_dtype, name="kvsparse_pull"
                )
                rows.set_shape(out_shape)

            def push(upstream):
                upstream = tf.cast(_dense(upstream), tf.float32)
                if tf.executing_eagerly():
                    return self._push_eager(ids, upstream)
                done = tf.py_function(
                    self._push_eager, [ids, upstream], tf.float32, name="kvsparse_push"
                )
                done.set_shape(())
                return done

            return rows, push

        rows = lookup(tf.convert_to_tensor(self.push_trigger))
        if self.compute_dtype != self.table_dtype.name:
            rows = tf.cast(rows, self.compute_dtype)
        return rows

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.embedding_dim,)

    def get_config(self):
        """Keras' config: the layer's, the table's key, dim, dtype and the SparseTable
        settings that `bind` creates a missing table with (no store: see `load_model`)."""
        config = super().get_config()
        options = self._options
        settings = {"dim": self.embedding_dim, "optimizer": options.optimizer}
        settings["seed"] = options.seed
        if options.initializer is not None:
            settings["initializer"] = options.initializer
        table = SparseTable(
            partitioner=options.partitioner, nonfinite=options.nonfinite, **settings
        )
        config.update(
            {
                "key": self.key,
                "embedding_dim": self.embedding_dim,
                "table_dtype": self.table_dtype.name,
                "table": table.to_dict(),
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        """A layer from `get_config`'s config, bound to the `store_scope` store if any."""
        return cls(getattr(_scope, "kv", None), **config)


# -- learning rate ---------------------------------------------------------------------------


class FollowLearningRate(keras.callbacks.Callback):
    """A Keras callback: the servers' learning rate follows the Keras optimizer's.

    Before each training batch it reads ``model.optimizer.learning_rate`` (a
    ``keras.optimizers.schedules`` schedule's value at the current step, or a
    rate set with ``optimizer.learning_rate = ...``) and, when it changed,
    calls ``kv.set_learning_rate`` (every slot on the servers stays).

    Args:
        kv: the store of the model's kvsparse layers.
        key: the tables to change (a key or a list); None: every table and the
            store-wide optimizer.
        learning_rate: None: the servers run the Keras rate itself. A number:
            the servers' rate at the start of training, scaled as the Keras rate
            is scaled from its value then (sparse and dense rates often differ).

    Not safe to share between models trained at once. On a synchronous store
    every worker must use the same schedule.

    Example:
        >>> schedule = keras.optimizers.schedules.ExponentialDecay(0.01, 100, 0.5)
        >>> model.compile(optimizer=keras.optimizers.Adam(schedule), loss='mse')
        >>> model.fit(x, y, callbacks=[FollowLearningRate(kv, learning_rate=0.05)])
    """

    def __init__(self, kv, key=None, learning_rate=None):
        super().__init__()
        self.kv = kv
        self.key = key
        self.server_learning_rate = None if learning_rate is None else float(learning_rate)
        self._start = None
        self._sent = None

    def _keras_rate(self) -> float:
        return float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

    def on_train_begin(self, logs=None):
        if self._start is None:
            self._start = self._keras_rate()

    def on_train_batch_begin(self, batch, logs=None):
        rate = self._keras_rate()
        if self.server_learning_rate is not None:
            scale = rate / self._start if self._start else 1.0
            rate = self.server_learning_rate * scale
        if rate != self._sent:
            with store_lock(self.kv):
                self.kv.set_learning_rate(rate, key=self.key)
            self._sent = rate


# -- dense gradients over workers ------------------------------------------------------------


class _GradientAverager:
    """Sums a fixed list of dense gradients over workers through one dense store key."""

    def __init__(self, key):
        self.key = key
        self.layout = None  # [(offset, shape)], offsets 64-byte aligned in the flat buffer
        self.size = 0

    def _plan(self, shapes):
        layout, offset = [], 0
        for shape in shapes:
            layout.append((offset, shape))
            count = int(np.prod(shape, dtype=np.int64))
            offset += -(-count // _FLOATS_PER_ALIGNMENT) * _FLOATS_PER_ALIGNMENT
        return layout, offset

    def average_eager(self, kv, *gradients):
        shapes = [tuple(g.shape) for g in gradients]
        if self.layout is None:
            self.layout, self.size = self._plan(shapes)
            with store_lock(kv):
                if self.key not in kv:
                    kv.init(self.key, np.zeros(max(self.size, 1), np.float32))
                elif kv.key_info(self.key).size != max(self.size, 1):
                    raise errors.ShapeError(
                        f"dense key {self.key!r} exists with another size; "
                        "use one key per optimizer"
                    )
        elif shapes != [shape for _, shape in self.layout]:
            raise errors.ShapeError(
                f"gradients changed shape: {shapes} after {[s for _, s in self.layout]}"
            )
        total = np.zeros(max(self.size, 1), np.float32)
        for (offset, shape), gradient in zip(self.layout, gradients):
            count = int(np.prod(shape, dtype=np.int64))
            total[offset : offset + count] = tensor_to_numpy(gradient).reshape(-1)
        summed = aligned_empty(total.shape)
        with store_lock(kv):
            kv.push(self.key, total)
            kv.pull(self.key, out=summed)
        summed /= kv.num_workers
        results = []
        for offset, shape in self.layout:
            count = int(np.prod(shape, dtype=np.int64))
            results.append(numpy_to_tensor(summed[offset : offset + count].reshape(shape)))
        return results

    def __call__(self, kv, gradients):
        gradients = [tf.cast(_dense(g), tf.float32) for g in gradients]
        if tf.executing_eagerly():
            return self.average_eager(kv, *gradients)
        results = tf.py_function(
            lambda *g: self.average_eager(kv, *g),
            gradients,
            [tf.float32] * len(gradients),
            name="kvsparse_average",
        )
        for result, gradient in zip(results, gradients):
            result.set_shape(gradient.shape)
        return list(results)


# kv -> {key: _GradientAverager}; weak, so a closed store's entries go with it.
_averagers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def average_gradients(kv, gradients, key: str = "kvsparse_tf_dense_gradients"):
    """The mean of each dense gradient over all workers, through the store.

    All workers must call it at the same step with gradients of the same
    shapes; each push to the dense `key` (which has no optimizer) leaves the
    sum of the workers' pushes, which is divided by ``kv.num_workers``. With
    one worker the gradients are returned unchanged. None entries stay None;
    `tf.IndexedSlices` are made dense. Works eagerly and in graph mode. Not
    safe to call for one store from several threads at once (every worker
    must call it in step order anyway).

    Args:
        kv: a kvsparse.KVStore.
        gradients: a list of gradient tensors (or None).
        key: the dense key holding the packed gradients; created on first use.
            Use one key per list of variables.

    Returns:
        A list like `gradients`, float32.

    Raises:
        kvsparse.errors.ShapeError: shapes changed since the first call for `key`.

    Example:
        >>> grads = tape.gradient(loss, dense_variables)
        >>> optimizer.apply(average_gradients(kv, grads), dense_variables)
    """
    if kv.num_workers == 1:
        return list(gradients)
    present = [i for i, g in enumerate(gradients) if g is not None]
    if not present:
        return list(gradients)
    per_store = _averagers.setdefault(kv, {})
    averager = per_store.get(key)
    if averager is None:
        averager = per_store[key] = _GradientAverager(key)
    averaged = averager(kv, [gradients[i] for i in present])
    result = list(gradients)
    for i, gradient in zip(present, averaged):
        result[i] = gradient
    return result


def DistributedOptimizer(optimizer, kv, key: str = "kvsparse_tf_dense_gradients"):  # noqa: N802
    """A copy of a Keras optimizer that averages dense gradients over workers first.

    Like Horovod's: the returned optimizer is an instance of a subclass of
    ``type(optimizer)`` built from ``optimizer.get_config()``, whose ``apply``
    passes the gradients through `average_gradients` (except those of
    `Embedding` push triggers, which must stay as they are). Use it in
    ``model.compile`` or a custom loop; with one worker it changes nothing.
    Safe to call from several threads; the optimizer it returns is as
    thread-safe as a Keras optimizer, and averages as `average_gradients`.

    Args:
        optimizer: a keras.optimizers.Optimizer, not yet used.
        kv: the kvsparse.KVStore the workers share.
        key: the dense store key for the packed gradients.

    Example:
        >>> model.compile(optimizer=DistributedOptimizer(keras.optimizers.Adam(1e-3), kv),
        ...               loss='binary_crossentropy')
    """
    base = type(optimizer)

    class _Distributed(base):
        def apply(self, grads, trainable_variables=None):
            variables = (
                list(trainable_variables)
                if trainable_variables is not None
                else list(getattr(self, "_trainable_variables", []))
            )
            grads = list(grads)
            dense = [
                i
                for i, v in enumerate(variables)
                if not getattr(v, "overwrite_with_gradient", False)
            ]
            averaged = average_gradients(kv, [grads[i] for i in dense], key=key)
            for i, gradient in zip(dense, averaged):
                grads[i] = gradient
            return super().apply(grads, trainable_variables)

    _Distributed.__name__ = base.__name__
    _Distributed.__qualname__ = base.__qualname__
    return _Distributed.from_config(optimizer.get_config())


__all__ = [
    "DistributedOptimizer",
    "Embedding",
    "FollowLearningRate",
    "aligned_empty",
    "average_gradients",
    "bind",
    "ensure_table",
    "load_model",
    "numpy_to_tensor",
    "store_lock",
    "store_scope",
    "tensor_to_numpy",
]
