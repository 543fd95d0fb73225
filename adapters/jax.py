"""JAX adapter: an embedding lookup whose table lives on kvsparse servers.

`embedding_lookup(kv, key, ids)` pulls the rows of `ids`; its custom VJP
pushes the gradient of those rows to the store, where the table's own
optimizer (``SparseTable(optimizer=...)``) updates them. Dense parameters stay
with your JAX optimizer.

jax.grad only differentiates values that depend on an argument it
differentiates, and ids are integers. So that a gradient reaches the table,
pass ``anchor=``: a float32 array (zero-size: `make_anchor()`) kept among the
parameters you differentiate. Its own gradient is an empty array; the push is
the side effect. Without an anchor the lookup is a plain read.

What works where:

- Eager (``jax.grad`` without jit): pull and push run when called.
- ``jax.jit``: works. The pull is a ``jax.pure_callback`` and the push an
  ``io_callback`` (an effect jit keeps), run each time the compiled function
  runs. Only ids passed through JAX are traced.
- 64-bit ids: with jax_enable_x64 off (JAX's default) JAX holds integers as
  int32 and wraps larger ones silently (``jnp.asarray``, a jit argument:
  ``2**40 + 3`` becomes ``3``), before kvsparse sees them. NumPy ids given to
  `embedding_lookup` never pass through JAX: they stay int64 on the host, in
  eager code, under jax.grad and closed over by a jitted function. To hand
  ids to JAX, convert them with `jax_ids`: it refuses ids that int32 cannot
  hold while x64 is off, naming ``jax.config.update("jax_enable_x64", True)``.
  JAX integer ids reaching `embedding_lookup` with x64 off get an
  `Int32IdsWarning` once per process (they may have been wrapped already).
  Exact 64-bit ids through ``jax.jit`` with x64 off: carry each id as two
  32-bit words. `split_ids` (in the input pipeline, on the host) turns int64
  ids of shape S into uint32 of shape S + (2,) (low word, high word), which
  JAX holds exactly; ``embedding_lookup(..., split=True)`` takes them and
  joins them back on the host inside its callbacks, so pulls and pushes see
  the exact ids (``2**62``, ``-5``, ``-(2**63)``); `join_ids` is the inverse::

      def loss(anchor, words):
          return embedding_lookup(kv, "item", words, anchor=anchor, split=True).sum()

      step = jax.jit(jax.grad(loss))
      step(make_anchor(), split_ids(np.array([2**40 + 3, -5])))  # uint32 (2, 2): exact

- ``jax.vmap`` works, of the lookup and of its gradient (the pushes of the
  batch are applied one after another).
- The push runs as a host callback, possibly after jax.grad has returned
  (asynchronous dispatch). Computations run in dispatch order, each with its
  callbacks, so a step pulls what the step before pushed (tested); but call
  ``jax.effects_barrier()`` before reading the table yourself
  (kv.row_sparse_pull) right after a step. Callbacks call the store under
  `kvsparse.adapters._common.store_lock`, so they never overlap another
  adapter's call.
- Rows cross host <-> JAX by copy (JAX callbacks copy their operands and
  results); the PyTorch adapter is the zero-copy one.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np, kvsparse
    >>> from kvsparse.adapters.jax import embedding_lookup, make_anchor
    >>> kv = kvsparse.create('local')
    >>> params = {'user': make_anchor(), 'w': jnp.ones(4)}
    >>> def loss(params, ids):
    ...     rows = embedding_lookup(kv, 'user', ids, embedding_dim=4, anchor=params['user'],
    ...                             optimizer=kvsparse.optimizers.SGD(learning_rate=0.1))
    ...     return (rows @ params['w']).sum()
    >>> grads = jax.grad(loss)(params, np.array([3, 7, 3]))  # SGD ran on rows 3 and 7
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from kvsparse.adapters._common import TableOptions, check_trainable, ensure_table, store_lock

from kvsparse import errors


class Int32IdsWarning(UserWarning):
    """JAX ids reached embedding_lookup as 32-bit integers while jax_enable_x64 is off:
    JAX wraps larger ids silently before kvsparse sees them (see `jax_ids`)."""


_X64_HINT = (
    'enable 64-bit integers in JAX (jax.config.update("jax_enable_x64", True), before any '
    "array is made) or pass the ids to embedding_lookup as a NumPy int64 array (it stays "
    "on the host, never narrowed)"
)
_warned_int32 = False


def x64_enabled() -> bool:
    """Whether JAX holds int64 values as int64 (jax_enable_x64 on). Thread-safe."""
    return jax.dtypes.canonicalize_dtype(np.int64) == np.dtype(np.int64)


def jax_ids(ids):
    """ids (any integer array-like) as a JAX array, never silently narrowed.

    With jax_enable_x64 on: an int64 JAX array. With it off (JAX's default),
    JAX would hold them as int32 and wrap every id outside int32's range
    (``2**40 + 3`` -> ``3``): this refuses such ids instead, and converts the
    others. Use it where ids must be JAX values (a jitted function's argument,
    vmap); NumPy ids given straight to `embedding_lookup` need no conversion.

    Safe to call from several threads at once.

    Raises:
        kvsparse.errors.DTypeError: non-integer ids.
        kvsparse.errors.InvalidArgument: an id outside int32 while x64 is off
            (the message says how to enable x64, or to keep the ids in NumPy).

    Example:
        >>> ids = jax_ids(np.array([3, 2**40]))  # doctest: +SKIP
        InvalidArgument: ... jax.config.update("jax_enable_x64", True) ...
    """
    if isinstance(ids, jax.Array):
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise errors.DTypeError(f"ids must be integers, got {ids.dtype}")
        return ids
    host = np.asarray(ids)
    if host.dtype.kind not in "iu":
        raise errors.DTypeError(f"ids must be integers, got {host.dtype}")
    if x64_enabled():
        return jnp.asarray(host.astype(np.int64, copy=False))
    info = np.iinfo(np.int32)
    if host.size and (host.min() < info.min or host.max() > info.max):
        outside = host[(host < info.min) | (host > info.max)].reshape(-1)[0]
        raise errors.InvalidArgument(
            f"id {int(outside)} does not fit in int32, and JAX (jax_enable_x64 off) would "
            f"wrap it to {int(np.asarray(outside).astype(np.int32))}: {_X64_HINT}"
        )
    return jnp.asarray(host.astype(np.int32))


def split_ids(ids) -> np.ndarray:
    """int64 ids of shape S as uint32 words of shape S + (2,): [..., 0] low, [..., 1] high.

    For ids that must pass through JAX with jax_enable_x64 off (a jitted
    function's argument): JAX holds uint32 exactly, and
    ``embedding_lookup(..., split=True)`` joins the words back on the host.
    Exact for every int64: the low word is the id's low 32 bits, the high word
    its high 32 bits (the sign bit on top). A new array, never a view of `ids`,
    so an input pipeline may refill its id buffer at once. Host-side NumPy;
    safe from several threads at once.

    Raises:
        kvsparse.errors.DTypeError: non-integer ids, or unsigned ids above int64.

    Example:
        >>> split_ids(np.array([2**40 + 3, -1]))
        array([[         3,        256],
               [4294967295, 4294967295]], dtype=uint32)
    """
    host = np.asarray(ids)
    if host.dtype.kind not in "iu":
        raise errors.DTypeError(f"ids must be integers, got {host.dtype}")
    if host.dtype == np.uint64 and host.size and host.max() > np.iinfo(np.int64).max:
        raise errors.DTypeError("uint64 ids above 2**63 - 1 are not int64 ids")
    # A little-endian copy read as 32-bit words: low word first on any host, and
    # never the caller's memory. (Shifts and masks give the same words 20x slower.)
    little = np.array(host, dtype="<i8").reshape(-1)
    return little.view("<u4").astype(np.uint32, copy=False).reshape(host.shape + (2,))


def _check_words(shape, dtype) -> None:
    """Refuses what `join_ids` cannot read as split ids; takes the shape and dtype
    only, so that traced JAX words are checked when jit traces them."""
    if np.dtype(dtype) not in (np.uint32, np.int32):
        raise errors.DTypeError(
            "split ids must be uint32 words (or int32 ones of the same bits: "
            f"kvsparse.adapters.jax.split_ids), got {np.dtype(dtype)}"
        )
    if len(shape) == 0 or shape[-1] != 2:
        raise errors.ShapeError(
            "split ids must have a last axis of 2 (low word, high word: "
            f"kvsparse.adapters.jax.split_ids), got shape {tuple(shape)}"
        )


def join_ids(words) -> np.ndarray:
    """The inverse of `split_ids`: uint32 words of shape S + (2,) -> int64 ids of shape S.

    int32 words of the same bits are read alike (the low word as unsigned,
    the high word as signed). A new array, never a view of `words`. Host-side
    NumPy; safe from several threads at once.

    Raises:
        kvsparse.errors.DTypeError: words that are not 32-bit integers.
        kvsparse.errors.ShapeError: a last axis other than 2 (low word, high word).

    Example:
        >>> join_ids(np.array([[3, 256], [4294967291, 4294967295]], np.uint32))
        array([1099511627779,            -5])
    """
    host = np.asarray(words)
    _check_words(host.shape, host.dtype)
    # A little-endian copy of the words' bits read as int64: the low word's bits
    # as unsigned, the high word's as signed (its top bit is the id's sign).
    little = np.array(host.view(np.uint32), dtype="<u4").reshape(-1)
    return little.view("<i8").astype(np.int64, copy=False).reshape(host.shape[:-1])


def _warn_if_narrowed(ids) -> None:
    """Warns once per process of JAX ids that JAX holds as int32 (x64 off)."""
    global _warned_int32
    if _warned_int32 or jnp.dtype(ids.dtype).itemsize >= 8 or x64_enabled():
        return
    _warned_int32 = True
    warnings.warn(
        f"embedding_lookup got JAX {ids.dtype} ids while jax_enable_x64 is off: JAX wraps "
        "ids outside int32 silently (2**40 + 3 becomes 3) before kvsparse sees them. For "
        f"64-bit ids, {_X64_HINT}; kvsparse.adapters.jax.jax_ids converts ids and refuses "
        "the ones int32 cannot hold",
        Int32IdsWarning,
        stacklevel=3,
    )


def make_anchor():
    """A zero-size float32 array to pass as ``anchor=`` and differentiate with respect to.

    Safe to call from several threads at once.
    """
    return jnp.zeros((0,), jnp.float32)


class _Table:
    """What the callbacks need: the store, the key, the row width (static to JAX)."""

    def __init__(self, kv, key, dim: int, split: bool = False):
        self.kv = kv
        self.key = key
        self.dim = dim
        self.split = split  # ids come as split_ids' words, joined here on the host
        # The table's dtype: jnp.float32, float16 or bfloat16 rows.
        self.dtype = jnp.dtype(kv.key_info(key).dtype)

    # JAX may run callbacks on a thread of its own, while the caller's thread
    # goes on (asynchronous dispatch): the store is only called under its lock.
    def host_ids(self, ids) -> np.ndarray:
        return join_ids(ids) if self.split else np.asarray(ids)

    def pull(self, ids) -> np.ndarray:
        ids = self.host_ids(ids)
        with store_lock(self.kv):
            return self.kv.row_sparse_pull(self.key, row_ids=ids)

    def push(self, ids, grad) -> None:
        ids = self.host_ids(ids)
        with store_lock(self.kv):
            check_trainable(self.kv, self.key)
            self.kv.push(self.key, (ids, np.asarray(grad, np.float32)))


def _pull_callback(table: _Table, ids):
    id_shape = tuple(ids.shape)[:-1] if table.split else tuple(ids.shape)
    shape = jax.ShapeDtypeStruct(id_shape + (table.dim,), table.dtype)
    return jax.pure_callback(table.pull, shape, ids, vmap_method="expand_dims")


# ids passed through JAX (traced under jit).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(table, anchor, ids):
    del anchor
    return _pull_callback(table, ids)


def _lookup_forward(table, anchor, ids):
    return _lookup(table, anchor, ids), (anchor, ids)


def _lookup_backward(table, residuals, grad):
    anchor, ids = residuals
    io_callback(table.push, None, ids, grad)
    return jnp.zeros_like(anchor), None


_lookup.defvjp(_lookup_forward, _lookup_backward)


class _HostIds:
    """NumPy ids kept on the host, so JAX never narrows them to int32."""

    def __init__(self, ids: np.ndarray):
        self.ids = ids


# ids held on the host (NumPy), closed over by the callbacks.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _lookup_host(table, host, anchor):
    del anchor
    shape = jax.ShapeDtypeStruct(host.ids.shape + (table.dim,), table.dtype)
    return jax.pure_callback(lambda: table.pull(host.ids), shape)


def _lookup_host_forward(table, host, anchor):
    return _lookup_host(table, host, anchor), anchor


def _lookup_host_backward(table, host, anchor, grad):
    io_callback(lambda g: table.push(host.ids, g), None, grad)
    return (jnp.zeros_like(anchor),)


_lookup_host.defvjp(_lookup_host_forward, _lookup_host_backward)


def embedding_lookup(
    kv,
    key,
    ids,
    embedding_dim=None,
    *,
    anchor=None,
    initializer=None,
    optimizer=None,
    seed: int = 0,
    partitioner=None,
    nonfinite: str = "raise",
    dtype=None,
    split: bool = False,
):
    """The rows of `ids` in table `key`; differentiating pushes their gradient.

    Args:
        kv: a kvsparse.KVStore.
        key: the table's key; created if missing and embedding_dim is given.
        ids: integer ids of any shape: a NumPy array (stays int64 on the
            host) or a JAX array (traced under jit; int32 unless x64 is on:
            make it with `jax_ids`, which refuses ids int32 cannot hold, and
            see `Int32IdsWarning`).
        embedding_dim: row width (needed to create the table; checked otherwise).
        anchor: a float32 array you differentiate with respect to (see
            `make_anchor`); without it no gradient is pushed.
        initializer, optimizer, seed, partitioner, nonfinite: the table's
            settings (kvsparse.SparseTable) when this creates it.
        dtype: the table's storage dtype when this creates it: jnp.float32
            (default), jnp.float16 or jnp.bfloat16 (an existing table of another
            dtype is refused).
        split: ids are `split_ids` words (uint32, last axis 2), NumPy or JAX:
            the exact way to pass 64-bit ids through jax.jit with x64 off. The
            rows then have shape ids.shape[:-1] + (dim,). A keyword, not
            guessed from the dtype and shape: uint32 ids of shape (n, 2) may
            as well be two plain ids per example, and only the caller knows.

    Safe to call from several threads at once: the pull and push callbacks
    call the store under `store_lock(kv)`.

    Returns:
        array of the table's dtype, shape ids.shape + (dim,).

    Raises:
        kvsparse.errors.UnknownKey: no table and no embedding_dim.
        kvsparse.errors.ShapeError: embedding_dim differs from the table's.
        kvsparse.errors.DTypeError: non-integer ids, or a non-float32 anchor;
            with split, words that are not uint32 (or int32).
        kvsparse.errors.ShapeError: with split, a last axis other than 2.

    Example:
        >>> rows = embedding_lookup(kv, 'item', np.array([[1, 2], [3, 4]]), embedding_dim=8)
        >>> rows.shape
        (2, 2, 8)
    """
    options = TableOptions(initializer, optimizer, seed, partitioner, nonfinite, dtype)
    dim = options.ensure(kv, key, embedding_dim)
    if anchor is None:
        anchor = make_anchor()
    elif jnp.result_type(anchor) != jnp.float32:
        raise errors.DTypeError(f"anchor must be float32, got {jnp.result_type(anchor)}")
    if split:
        if isinstance(ids, jax.Array):  # traced under jit: joined in the callbacks
            _check_words(ids.shape, ids.dtype)
            return _lookup(_Table(kv, key, dim, split=True), anchor, ids)
        # join_ids makes a new array: the push sees the ids the forward saw.
        return _lookup_host(_Table(kv, key, dim), _HostIds(join_ids(ids)), anchor)
    table = _Table(kv, key, dim)
    if isinstance(ids, jax.Array):
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise errors.DTypeError(f"ids of table {key!r} must be integers, got {ids.dtype}")
        _warn_if_narrowed(ids)
        return _lookup(table, anchor, ids)
    # A copy: the push runs at backward, and must see the ids the forward saw.
    host = np.array(ids)
    if host.dtype.kind not in "iu":
        raise errors.DTypeError(f"ids of table {key!r} must be integers, got {host.dtype}")
    return _lookup_host(table, _HostIds(host), anchor)


__all__ = [
    "Int32IdsWarning",
    "embedding_lookup",
    "ensure_table",
    "jax_ids",
    "join_ids",
    "make_anchor",
    "split_ids",
    "x64_enabled",
]
