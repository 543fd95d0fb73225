"""kvsparse stores behind MXNet 1.9's KVStore API, for Gluon's Trainer.

Importing this module registers two store types with MXNet's KVStore registry,
so that ``mx.kv.create('dist_sparse')`` and ``mx.kv.create('dist_sparse_async')``
return kvsparse stores (`Dist_Sparse`, `Dist_Sparse_Async`; MXNet names a
registered store by its lower-cased class name and looks the registry up before
its own C++ stores). With no arguments they connect to the servers that
``kvsparse launch`` (or the ``KVSPARSE_*`` / ``DMLC_*`` variables) describe;
`create` takes the configuration explicitly, and ``create('local')`` serves the
same API from one in-process shard.

A Gluon ``Trainer(params, optimizer, kvstore='dist_sparse')`` trains through
them: ``row_sparse`` parameters (``Parameter(stype='row_sparse',
grad_stype='row_sparse')``) and dense-weight embeddings with sparse gradients
(``gluon.nn.Embedding(..., sparse_grad=True)``) become kvsparse sparse tables
(``dim = shape[1]``); every other parameter becomes a dense key. The optimizer
the Trainer hands to `set_optimizer` runs on the servers (`optimizer_from_mxnet`
maps it; see there what maps exactly and what differs).

Semantics (MXNet's, with the differences said):
- ``init``: a table's rows start as the value MXNet gives (all rows of a dense
  value, the stored rows of a row_sparse one); with several workers rank 0's value
  wins. Rows never given start at zero (a row_sparse array's missing rows are
  zero). A table grows past the Parameter's declared rows when ids beyond them are
  pushed or pulled with dense outputs or ``(ids, rows)`` pairs: the declared shape
  only bounds what fits in a RowSparseNDArray.
- ``push``: a pushed list is summed; with an optimizer the sum is a gradient and
  only the rows it touches are updated (lazy, as MXNet's ``lazy_update=True``);
  without one it replaces those rows. (MXNet's own store without an updater
  replaces the whole row_sparse value, dropping rows not pushed; kvsparse keeps
  them: a table has no "whole value".)
- ``row_sparse_pull``: row_ids of any shape, int or float (whole numbers; float32
  holds ids exactly only below 2**24), unsorted, duplicated. A RowSparseNDArray
  ``out`` receives the unique sorted rows (MXNet); a dense ``out`` of shape
  ``row_ids.shape + (dim,)`` receives one row per id, written in place (kvsparse).
- Keys are all int or all str. Writes into outputs happen under
  ``mx.autograd.pause()``.

Zero-copy: NDArrays cross through DLPack (``to_dlpack_for_read/for_write`` ->
``kvsparse._core.from_dlpack``): pushed gradients (dense arrays, and the stored
rows of a RowSparseNDArray) are read where MXNet keeps them, and dense outputs
are filled where MXNet keeps them. Not zero-copy: a RowSparseNDArray's indices
(MXNet only hands out a copy, 8 bytes per row), and a RowSparseNDArray ``out``:
the rows land in a fresh row_sparse buffer that MXNet then copies into ``out``
(MXNet offers no way to resize ``out``'s storage in place). CPU NDArrays only.

Example:
    >>> import mxnet as mx
    >>> import kvsparse.adapters.mxnet  # registers 'dist_sparse'
    >>> kv = kvsparse.adapters.mxnet.create('local')
    >>> kv.init(0, mx.nd.ones((10, 4)).tostype('row_sparse'))
    >>> kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
    >>> grad = mx.nd.sparse.row_sparse_array(
    ...     (mx.nd.ones((1, 4)), mx.nd.array([3], dtype='int64')), shape=(10, 4))
    >>> kv.push(0, grad)
    >>> out = mx.nd.sparse.zeros('row_sparse', (10, 4))
    >>> kv.row_sparse_pull(0, out=out, row_ids=mx.nd.array([3, 3, 1]))
    >>> out.indices.asnumpy(), out.data.asnumpy()[:, 0]
    (array([1, 3]), array([1. , 0.5], dtype=float32))
"""

from __future__ import annotations

import ctypes
import functools
import warnings

import numpy as np

import kvsparse
from kvsparse import _core, arrays, config, errors, initializers, optimizers
from kvsparse.store.compression import GradientCompression
from kvsparse.store.kvstore import StoreFront

if "bool" not in vars(np):
    # MXNet 1.9.1 still says np.bool, which NumPy 1.24 removed (2.0 brought it back).
    # vars(), not hasattr(): NumPy 1.24-1.26 warn on any attempt to read np.bool.
    np.bool = bool

_ROLE = config.mxnet_role()
if _ROLE in ("server", "scheduler"):
    # With this variable `import mxnet` turns the process into a ps-lite node and never
    # returns control to the caller; say why instead of hanging.
    raise ImportError(
        f"DMLC_ROLE={_ROLE} makes `import mxnet` start an MXNet ps-lite "
        "node; kvsparse servers are `kvsparse server` processes. Unset DMLC_ROLE (and PORT) "
        "for processes that run training code."
    )

import mxnet as mx  # noqa: E402 - needs np.bool first
from mxnet.base import _LIB, check_call  # noqa: E402
from mxnet.kvstore import KVStore as _NativeKVStore  # noqa: E402
from mxnet.kvstore import KVStoreBase  # noqa: E402
from mxnet.ndarray.sparse import RowSparseNDArray, _new_alloc_handle  # noqa: E402

__all__ = [
    "Dist_Sparse",
    "Dist_Sparse_Async",
    "KVSparseStore",
    "as_numpy",
    "create",
    "mxnet_error_class",
    "optimizer_from_mxnet",
]


# -- errors ------------------------------------------------------------------------------------

_MXNET_ERROR_CLASSES: dict = {}


def mxnet_error_class(cls: type) -> type:
    """The class an MXNet store raises for kvsparse error class `cls`.

    It derives from `cls` and from ``mx.base.MXNetError``, and has the same
    name: ``except kvsparse.errors.UnknownKey``, ``except KeyError`` and
    ``except mx.base.MXNetError`` all catch a pull of an unknown key, as
    MXNet's own stores raise MXNetError. Plain ``kvsparse.create`` stores
    keep raising `cls` itself. Safe to call from several threads at once (a
    race makes two equal classes, one of which is kept).

    Example:
        >>> issubclass(mxnet_error_class(errors.UnknownKey), mx.base.MXNetError)
        True
    """
    mapped = _MXNET_ERROR_CLASSES.get(cls)
    if mapped is None:
        doc = f"{cls.__doc__ or cls.__name__} (raised by an MXNet store: also an MXNetError)"
        attributes = {"__module__": __name__, "__doc__": doc, "__qualname__": cls.__name__}
        mapped = _MXNET_ERROR_CLASSES.setdefault(
            cls, type(cls.__name__, (cls, mx.base.MXNetError), attributes)
        )
    return mapped


# What a pull of a key of each table dtype gives in MXNet (NumPy dtypes).
_MX_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.float32}


def _as_mxnet_error(exc: errors.KVSparseError) -> errors.KVSparseError:
    """exc as an instance of its `mxnet_error_class` (same args and attributes)."""
    cls = mxnet_error_class(type(exc))
    converted = cls.__new__(cls, *exc.args)
    converted.args = exc.args
    converted.__dict__.update(vars(exc))
    return converted


def _raises_mxnet_errors(method):
    """Wraps a store method so that the kvsparse errors it raises are also MXNetErrors."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except errors.KVSparseError as exc:
            if isinstance(exc, mx.base.MXNetError):
                raise
            raise _as_mxnet_error(exc).with_traceback(exc.__traceback__) from None

    return wrapper


# -- arrays ------------------------------------------------------------------------------------


def as_numpy(array, *, writable: bool = False) -> np.ndarray:
    """A NumPy view of a CPU NDArray's memory, through DLPack (no copy).

    For a RowSparseNDArray the view covers its stored rows, shape (nnz, dim).

    Args:
        array: an mx.nd.NDArray on the CPU.
        writable: False waits for pending writes and gives a read-only view
            (``to_dlpack_for_read``); True also waits for pending reads and
            gives a writeable view whose writes show in ``array``.

    Safe to call from several threads at once (MXNet's engine orders the waits).

    Raises:
        kvsparse.errors.DTypeError: not an NDArray.
        kvsparse.errors.InvalidArgument: an NDArray on a GPU.

    Example:
        >>> a = mx.nd.zeros((2, 3))
        >>> as_numpy(a, writable=True)[0, 0] = 5.0
        >>> a[0, 0].asscalar()
        5.0
    """
    if not isinstance(array, mx.nd.NDArray):
        raise errors.DTypeError(f"expected an mx.nd.NDArray, got {type(array).__name__}")
    capsule = array.to_dlpack_for_write() if writable else array.to_dlpack_for_read()
    return arrays.as_numpy(capsule, what="the NDArray", writable=writable)


def _row_ids(array, *, key) -> np.ndarray:
    """Row ids as an int64 NumPy array (any shape); float ids must be whole numbers.

    Integer ids are `kvsparse.arrays.as_ids`'; floats are accepted here because
    MXNet's default dtype is float32.
    """
    if isinstance(array, mx.nd.NDArray):
        if array.stype != "default":
            raise errors.DTypeError(f"row ids of key {key!r} must be a dense NDArray")
        ids = as_numpy(array)
    else:
        ids = arrays.as_numpy(array, what=f"row ids of key {key!r}")
    if ids.dtype.kind == "f":
        # MXNet's default dtype is float32, so Gluon code passes float ids.
        if ids.size and (
            not np.isfinite(ids).all()
            or (ids != np.trunc(ids)).any()
            or np.abs(ids).max() >= 2.0**63
        ):
            raise errors.InvalidArgument(
                f"row ids of key {key!r} must be whole numbers within int64, got {ids.dtype} "
                "values that are not"
            )
        return ids.astype(np.int64)
    return arrays.as_ids(ids, key=key)


def _is_sparse_value(value) -> bool:
    """Whether MXNet treats this value as a row_sparse weight or a weight with sparse grads."""
    if value.stype == "row_sparse":
        return True
    grad = value.grad
    return grad is not None and grad.stype == "row_sparse"


def _ndarray_of(array: np.ndarray, ctx):
    """An NDArray over a NumPy array's memory (no copy), for MXNet calls that need one."""
    if ctx.device_type != "cpu":
        raise errors.InvalidArgument(f"kvsparse's MXNet adapter works on CPU arrays, got {ctx}")
    return mx.nd.from_dlpack(_core.to_dlpack(np.ascontiguousarray(array)))


def _new_row_sparse(shape, num_rows: int, ctx) -> RowSparseNDArray:
    """A RowSparseNDArray with storage for num_rows rows (values and indices not set)."""
    handle = _new_alloc_handle(
        "row_sparse", shape, ctx, False, np.float32, [np.int64], [(num_rows,)]
    )
    return RowSparseNDArray(handle)


def _set_indices(target: RowSparseNDArray, unique_ids: np.ndarray) -> None:
    source = _ndarray_of(unique_ids, target.context)
    # Copies into the aux (indices) array allocated by _new_row_sparse; same size, no realloc.
    check_call(_LIB.MXNDArraySyncCopyFromNDArray(target.handle, source.handle, ctypes.c_int(0)))


def _check_finite(key, values: np.ndarray) -> None:
    """Raises NonFiniteGradient before a NaN or inf reaches a quantizer's residual."""
    if not np.isfinite(values).all():
        raise errors.NonFiniteGradient(
            f"key {key!r}: gradient has a NaN or inf value; nothing was applied"
        )


def _values_of(value) -> list:
    """One key's values: a list (of devices' values, summed) or a single value."""
    return list(value) if isinstance(value, list) else [value]


# -- optimizers --------------------------------------------------------------------------------

# MXNet 1.9.1's registered optimizers (mx.optimizer.Optimizer.opt_registry) that have no
# kvsparse server formula; tests/test_mxnet_semantics.py checks this list against the registry.
UNSUPPORTED_MXNET_OPTIMIZERS = (
    "adadelta",
    "adamax",
    "dcasgd",
    "ftml",
    "groupadagrad",
    "lamb",
    "lars",
    "lbsgd",
    "nadam",
    "sgld",
    "signum",
)
SUPPORTED_MXNET_OPTIMIZERS = ("adagrad", "adam", "ccsgd", "ftrl", "nag", "rmsprop", "sgd", "test")


def _clip(optimizer) -> float | None:
    clip = optimizer.clip_gradient
    return float(clip) if clip and clip > 0 else None  # MXNet: falsy or negative = no clipping


def optimizer_from_mxnet(optimizer, *, lr: float | None = None, wd: float | None = None):
    """The kvsparse server optimizer for an MXNet optimizer (same name, same settings).

    ============  ==========================================================  ===============
    MXNet         kvsparse                                                    formula
    ============  ==========================================================  ===============
    SGD, ccSGD    SGD(learning_rate, momentum, weight_decay=wd)               MXNet's
    NAG           SGD(..., nesterov=True) (plain SGD when momentum is 0);     MXNet's
                  wd must be 0 (see below)
    Adam          Adam(beta1, beta2, eps=epsilon, weight_decay=wd,            MXNet's
                  step_mode='table', formula='mxnet')
    AdaGrad       Adagrad(eps=eps, weight_decay=wd, formula='mxnet')          MXNet's
    RMSProp       RMSProp(alpha=gamma1, eps=epsilon, weight_decay=wd,         MXNet's
                  centered, momentum=gamma2 if centered, formula='mxnet')
    Ftrl          Ftrl(lr_power=-0.5, initial_accumulator_value=0,            MXNet's
                  l1=lamda1, l2=wd/2, beta)
    Test          SGD(learning_rate=1, rescale_grad=-rescale_grad): the       MXNet's
                  ``weight += rescale_grad * grad`` of MXNet's own tests
                  (no lr, wd or clipping, as MXNet's Test)
    ============  ==========================================================  ===============

    Every one also gets learning_rate, rescale_grad and clip_gradient (a falsy or
    negative clip_gradient means none, as in MXNet). "MXNet's" means MXNet 1.9's update
    rule, equal up to float32 rounding: the tests run MXNet's own updaters next to the
    store. kvsparse's defaults are torch.optim's formulas; ``formula='mxnet'`` selects
    MXNet's where they differ (Adam: epsilon outside the bias correction; AdaGrad and
    RMSProp: epsilon inside the square root; AdaGrad: wd outside the history; Adam and
    RMSProp: wd added before clipping). Adam's ``t`` counts updates of the key in both
    (``step_mode='table'``). ``multi_precision=True`` is honoured as MXNet does for
    float16 (and bfloat16) weights, dense keys and row_sparse tables alike: the servers
    keep a float32 master copy (of each row of a table) that the optimizer updates, and
    the stored value is that copy rounded once; pulls return the rounded value. It costs
    4 bytes a value more (a float16 table then takes 2 + 4 bytes a value plus slots).
    float32 keys ignore it.

    Refused, with an error naming them: the registered MXNet optimizers with no server
    formula (`UNSUPPORTED_MXNET_OPTIMIZERS`: AdaDelta, Adamax, DCASGD, FTML,
    GroupAdaGrad, LAMB, LARS, LBSGD, Nadam, SGLD, Signum), NAG with wd != 0 (MXNet's
    in-place kernel takes the momentum's decay term from the weight it has just
    updated, a rule no kvsparse formula follows), ``clip_weights``, Adam's
    ``begin_num_update``. A learning-rate scheduler's rate is the one the optimizer
    has now; the store then follows it, and any later learning rate, before each push
    (``kv.set_learning_rate``: slots kept). Other settings changed later (another
    rescale_grad, wd, clipping) are not seen by the servers, as on MXNet's dist
    stores, and the store warns when it notices one.

    Laziness: kvsparse updates only the rows a push touches, always. MXNet does the
    same (its ``lazy_update=True``) for SGD, Adam, AdaGrad and, on row_sparse weights,
    Ftrl; it has no sparse kernels for NAG and RMSProp, nor Ftrl on a dense weight
    with sparse gradients (``Embedding(sparse_grad=True)``): there it updates every
    row, so momentum moves rows absent from the batch and Ftrl zeroes them.
    ``lazy_update=False`` gets a warning.

    Safe to call from several threads at once (it only reads the optimizer).

    Args:
        optimizer: an mx.optimizer.Optimizer, or a kvsparse.optimizers.Optimizer
            (returned as is).
        lr, wd: the learning rate and weight decay to use instead of the
            optimizer's own (one key's, with its lr_mult / wd_mult applied).

    Raises:
        kvsparse.errors.InvalidArgument: an optimizer or setting kvsparse cannot run.

    Example:
        >>> optimizer_from_mxnet(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
        SGD(rescale_grad=1.0, clip_gradient=None, learning_rate=0.1, momentum=0.9, ...)
    """
    return _map_optimizer(optimizer, warn=True, lr=lr, wd=wd)


def _map_optimizer(optimizer, *, warn: bool, lr=None, wd=None) -> optimizers.Optimizer:
    if isinstance(optimizer, optimizers.Optimizer):
        return optimizer
    if not isinstance(optimizer, mx.optimizer.Optimizer):
        raise errors.InvalidArgument(
            f"set_optimizer takes an mx.optimizer.Optimizer, got {type(optimizer).__name__}"
        )
    name = type(optimizer).__name__
    kind = name.lower()
    if kind not in SUPPORTED_MXNET_OPTIMIZERS:
        raise errors.InvalidArgument(
            f"optimizer {name} cannot run on kvsparse servers; they run MXNet's "
            f"{', '.join(SUPPORTED_MXNET_OPTIMIZERS)} (not "
            f"{', '.join(UNSUPPORTED_MXNET_OPTIMIZERS)})"
        )
    if kind == "test":
        # MXNet's Test: weight += rescale_grad * grad. The servers' SGD computes
        # w -= 1 * (grad * -rescale_grad): the same float32 result (negation is exact).
        return optimizers.SGD(
            learning_rate=1.0,
            rescale_grad=-float(optimizer.rescale_grad),
            **({"multi_precision": True} if getattr(optimizer, "multi_precision", False) else {}),
        )
    common = {
        "rescale_grad": float(optimizer.rescale_grad),
        "clip_gradient": _clip(optimizer),
    }
    if getattr(optimizer, "multi_precision", False):
        # A float32 master copy of float16 / bfloat16 dense keys on the servers.
        common["multi_precision"] = True
    # learning_rate: the lr_scheduler's rate at the optimizer's num_update, if it has one.
    lr = float(optimizer.learning_rate if lr is None else lr)
    wd = float(optimizer.wd if wd is None else wd)
    if warn and getattr(optimizer, "lazy_update", True) is False:
        warnings.warn(
            f"{name}(lazy_update=False): kvsparse updates only the rows a push touches "
            "(lazy updates) on sparse tables",
            stacklevel=3,
        )
    if kind in ("sgd", "ccsgd"):
        return optimizers.SGD(
            learning_rate=lr, momentum=float(optimizer.momentum), weight_decay=wd, **common
        )
    if kind == "nag":
        if wd != 0.0:
            raise errors.InvalidArgument(
                f"NAG with wd={wd} cannot run on kvsparse servers: MXNet's kernel takes the "
                "momentum's decay term from the weight it has just updated; use wd=0 "
                "(or wd_mult=0 on this parameter) or SGD(momentum=...)"
            )
        momentum = float(optimizer.momentum)
        return optimizers.SGD(learning_rate=lr, momentum=momentum, nesterov=momentum > 0, **common)
    if kind == "adam":
        if optimizer.begin_num_update:
            raise errors.InvalidArgument(
                "Adam(begin_num_update != 0): kvsparse counts Adam's steps from 1"
            )
        return optimizers.Adam(
            learning_rate=lr,
            beta1=float(optimizer.beta1),
            beta2=float(optimizer.beta2),
            eps=float(optimizer.epsilon),
            weight_decay=wd,
            step_mode="table",
            formula="mxnet",
            **common,
        )
    if kind == "adagrad":
        return optimizers.Adagrad(
            learning_rate=lr,
            eps=float(optimizer.float_stable_eps),
            weight_decay=wd,
            formula="mxnet",
            **common,
        )
    if kind == "rmsprop":
        if optimizer.clip_weights:
            raise errors.InvalidArgument("RMSProp(clip_weights=...) is not supported by kvsparse")
        centered = bool(optimizer.centered)
        return optimizers.RMSProp(
            learning_rate=lr,
            alpha=float(optimizer.gamma1),
            eps=float(optimizer.epsilon),
            weight_decay=wd,
            centered=centered,
            momentum=float(optimizer.gamma2) if centered else 0.0,
            formula="mxnet",
            **common,
        )
    if kind == "ftrl":
        return optimizers.Ftrl(
            learning_rate=lr,
            lr_power=-0.5,
            initial_accumulator_value=0.0,
            l1=float(optimizer.lamda1),
            l2=wd / 2.0,  # MXNet adds wd to the denominator; TF's FTRL adds 2 * l2
            beta=float(optimizer.beta),
            **common,
        )
    raise AssertionError(
        f"unreachable: {kind} is in SUPPORTED_MXNET_OPTIMIZERS"
    )  # pragma: no cover


def _settings_of(optimizer) -> tuple:
    """What the servers were told besides the learning rate, to notice later changes on the
    worker (a learning rate is followed: `_ServerOptimizer.follow_learning_rate`)."""
    return (optimizer.wd, optimizer.rescale_grad, optimizer.clip_gradient)


def _from_store(name: str, doc: str) -> property:
    """A read-only property: the kvsparse store's attribute `name`."""
    return property(lambda self: getattr(self._store, name), doc=doc)


class _Updater:
    """What Gluon's Trainer.load_states reads back: ``kvstore._updater.optimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


class _ServerOptimizer:
    """The MXNet store's optimizers, on their way to the servers.

    MXNet sets the optimizer before init sets the tables' rows, and Gluon's
    Trainer changes rescale_grad after handing the optimizer over: so it is
    mapped and sent at the first push (at once when pushes happened already),
    and a change of its settings after that gets a warning. A key whose
    learning rate or weight decay differs from the optimizer's (Gluon's
    ``lr_mult`` / ``wd_mult``, MXNet's ``wd_mult`` 0 for biases) gets its own
    optimizer on the servers, with its own lr and wd; a key initialized later gets
    its own when it is initialized. A change of the learning rate
    (``Trainer.set_learning_rate``, ``optimizer.set_learning_rate``, an
    ``lr_scheduler``, which counts the pushes of each key as MXNet's updater
    counts its updates) reaches the servers before the next push as
    ``kv.set_learning_rate``: every optimizer state stays. Not safe to call from
    several threads at once (its store is not).

    Args:
        store: the kvsparse.KVStore underneath.
    """

    def __init__(self, store):
        self._store = store
        self._mx_optimizer = None  # the MXNet optimizer set, if it was one
        self._pending = None  # set, not yet sent to the servers
        self._sent_settings = None
        self._warned_change = False
        self._started = False  # a push happened: the store's optimizer is in force
        self._own: dict = {}  # key -> (lr, wd) of the optimizer the servers run for it
        self._sent_lr = None  # the store-wide learning rate the servers run

    def set(self, optimizer, keys) -> None:
        """Takes `optimizer` (checked already) for every key; sent now if pushes happened."""
        self._mx_optimizer = optimizer if isinstance(optimizer, mx.optimizer.Optimizer) else None
        self._pending = optimizer
        self._sent_settings = None
        if optimizer is None:
            self._store.set_optimizer(None)
            self._release_own(list(self._own))
            return
        if self._started:
            self.send(keys)

    def _release_own(self, keys) -> None:
        if keys:
            self._store.set_optimizer(None, key=keys)
            for k in keys:
                del self._own[k]

    def added(self, keys) -> None:
        """Called after keys are initialized: their own optimizers, if the optimizer is sent."""
        if self._mx_optimizer is not None and self._pending is None:
            self._send_own(keys)

    def _send_own(self, keys) -> None:
        """Gives each of keys with its own lr or wd its own optimizer (grouped by settings)."""
        optimizer = self._mx_optimizer
        groups: dict = {}
        back = []
        for k in keys:
            settings = (optimizer._get_lr(k), optimizer._get_wd(k))
            if settings != (optimizer.lr, optimizer.wd):
                if self._own.get(k) != settings:
                    groups.setdefault(settings, []).append(k)
            elif k in self._own:
                back.append(k)
        # Every mapping first: an optimizer the servers cannot run changes nothing.
        mapped = {
            settings: _map_optimizer(optimizer, warn=False, lr=settings[0], wd=settings[1])
            for settings in groups
        }
        self._release_own(back)
        for settings, group in groups.items():
            self._store.set_optimizer(mapped[settings], key=group)
            self._own.update(dict.fromkeys(group, settings))

    def send(self, keys) -> None:
        """Sends the pending optimizer, if any, to the servers (keys: every key of the store)."""
        if self._pending is None:
            return
        # Mapped now, not in set_optimizer: Gluon's Trainer sets rescale_grad = 1/batch_size
        # after handing the optimizer over and before the first push.
        self._store.set_optimizer(_map_optimizer(self._pending, warn=False))
        mx_optimizer = self._mx_optimizer
        # The MXNet optimizer's rate the servers run (MXNet's Test optimizer has none).
        follows = mx_optimizer is not None and type(mx_optimizer).__name__.lower() != "test"
        self._sent_lr = float(mx_optimizer.learning_rate) if follows else None
        previous = list(self._own)
        self._own.clear()  # a new optimizer: every key's own is sent again
        if self._mx_optimizer is not None:
            self._send_own(keys)
            self._sent_settings = _settings_of(self._mx_optimizer)
        stale = [k for k in previous if k not in self._own]
        if stale:
            self._store.set_optimizer(None, key=stale)
        self._pending = None
        if self._store.num_workers > 1:
            self._store.barrier()  # no worker pushes a gradient before all have set it

    def follow_learning_rate(self, keys) -> None:
        """Sends the MXNet optimizer's learning rate (and each key's, with its lr_mult) to
        the servers if it changed since it was sent; slots stay (kv.set_learning_rate)."""
        optimizer = self._mx_optimizer
        if optimizer is None or self._pending is not None or self._sent_lr is None:
            return
        lr = float(optimizer.learning_rate)
        if lr == self._sent_lr:
            return
        # Every table's rate, then the keys whose lr_mult gives them another one.
        self._store.set_learning_rate(lr)
        self._sent_lr = lr
        groups: dict = {}
        for k in list(self._own):
            own_lr = float(optimizer._get_lr(k))
            if own_lr != lr:
                groups.setdefault(own_lr, []).append(k)
            self._own[k] = (own_lr, self._own[k][1])
        for own_lr, group in groups.items():
            self._store.set_learning_rate(own_lr, key=group)

    def before_push(self, keys, pushed=()) -> None:
        """Called before every push of the keys pushed (keys: every key of the store): sends
        what is pending and a changed learning rate, warns of other changed settings."""
        if self._mx_optimizer is not None and self._mx_optimizer.lr_scheduler is not None:
            # MXNet's updater counts an update of each key before asking the scheduler.
            self._mx_optimizer._update_count(list(pushed))
        if not self._started:
            self.send(keys)
            self._started = True
        elif self._pending is not None:
            self.send(keys)
        self.follow_learning_rate(keys)
        if (
            self._sent_settings is not None
            and not self._warned_change
            and _settings_of(self._mx_optimizer) != self._sent_settings
        ):
            self._warned_change = True
            warnings.warn(
                "the MXNet optimizer changed (wd, rescale_grad or clipping) "
                "after it was sent to the kvsparse servers; they keep the settings they got "
                "(call kv.set_optimizer again to send new ones; slots restart)",
                stacklevel=3,
            )


# -- the store ---------------------------------------------------------------------------------


class KVSparseStore(StoreFront, _NativeKVStore):
    """MXNet's KVStore API over a kvsparse store.

    It derives from MXNet's native ``KVStore`` class (without its C++ handle)
    because Gluon's Trainer only accepts a store object with row_sparse weights, and
    only trains sparse-gradient embeddings, when ``isinstance(kv, mx.kv.KVStore)``.
    Not safe to call from several threads at once (as the kvsparse store under it).

    Args:
        store: a kvsparse.KVStore (``kvsparse.create(...)``).
        kind: what ``type`` reports: the registered name ('dist_sparse',
            'dist_sparse_async') or 'local'.

    Example:
        >>> kv = KVSparseStore(kvsparse.create('local'), 'local')
        >>> kv.is_capable('optimizer')
        True
    """

    _repr_name = "kvsparse.adapters.mxnet store"

    def __init__(self, store, kind: str):
        # MXNet's KVStore.__init__ wants a C++ handle; there is none.
        self.handle = None
        self._store = store
        self._kind = kind
        self._async = "async" in kind
        self._updater = None
        self._updater_func = None
        self._str_updater_func = None
        self._is_p3 = False
        self._server_optimizer = _ServerOptimizer(store)
        self._keys: list = []  # in init order
        self._compression = None  # a GradientCompression, after set_gradient_compression
        # Storage dtype of the sparse tables init() makes from now on; None:
        # the weight's own (float16 weights make float16 tables).
        self.table_dtype = None

    def __del__(self):
        pass  # no native handle to free; close() releases the kvsparse store

    # -- properties -------------------------------------------------------------------

    @property
    def type(self) -> str:
        """'dist_sparse', 'dist_sparse_async' or 'local'."""
        return self._kind

    # MXNet's KVStore reads these through its C++ handle; here they are the kvsparse store's.
    rank = _from_store("rank", "This worker's rank.")
    num_workers = _from_store("num_workers", "How many workers share the store.")
    num_servers = _from_store("num_servers", "How many servers (shards) hold the tables.")

    @property
    def store(self):
        """The kvsparse.KVStore underneath."""
        return self._store

    def is_capable(self, capability: str) -> bool:
        """MXNet's query: the optimizer runs on the servers ('optimizer' -> True).

        Raises:
            ValueError: an unknown capability (as MXNet).
        """
        if capability.lower() == KVStoreBase.OPTIMIZER:
            return True
        raise ValueError(f"Unknown capability: {capability}")

    # -- keys -----------------------------------------------------------------------------

    def _pairs(self, key, value, what: str) -> list:
        """[(key, [values])] in MXNet's forms; int and str keys are never mixed."""
        if isinstance(key, (list, tuple)):
            if not isinstance(value, (list, tuple)) or len(value) != len(key):
                raise errors.InvalidArgument(f"{what}: {len(key)} keys need as many values")
            pairs = [(k, _values_of(v)) for k, v in zip(key, value)]
        else:
            pairs = [(key, _values_of(value))]
        kinds = set()
        for k, _ in pairs:
            if isinstance(k, bool) or not isinstance(k, (int, str, np.integer)):
                raise errors.KeyTypeError(f"keys must be int or str, got {type(k).__name__}")
            kinds.add(str if isinstance(k, str) else int)
        if len(kinds) > 1:
            raise errors.KeyTypeError(f"{what}: int and str keys cannot be mixed")
        return [(k if isinstance(k, str) else int(k), v) for k, v in pairs]

    # -- init -------------------------------------------------------------------------------

    @_raises_mxnet_errors
    def init(self, key, value):
        """Initializes key(s) from NDArrays; with several workers rank 0's value wins.

        A row_sparse value, or a dense one whose attached gradient is row_sparse,
        makes a sparse table of ``dim = shape[1]`` holding the value's rows
        (written verbatim, so at any time: before or after pushes and
        set_optimizer); anything else makes a dense key. Never compressed.

        Raises:
            DuplicateKey: the key exists. KeyTypeError: int and str keys mixed.
        """
        pairs = self._pairs(key, value, "init")
        for k, values in pairs:
            if len(values) != 1:
                raise errors.InvalidArgument(f"init of key {k!r} takes one value")
            if k in self._store:
                raise errors.DuplicateKey(f"key {k!r} is already initialized")
            if not isinstance(values[0], mx.nd.NDArray):
                raise errors.DTypeError(f"init of key {k!r} takes an NDArray")
        for k, values in pairs:
            self._init_one(k, values[0])

    def _init_one(self, k, value) -> None:
        if _is_sparse_value(value):
            if len(value.shape) != 2:
                raise errors.ShapeError(
                    f"key {k!r}: a sparse weight must be 2-D (rows, dim), got {value.shape}"
                )
            # A float16 weight makes a float16 table, as MXNet keeps its dtype;
            # kv.table_dtype = 'float16' stores float32 weights' tables in float16 (pulls
            # into the float32 weights widen, exactly).
            dtype = np.dtype(value.dtype).name
            if self.table_dtype is not None:
                dtype = arrays.table_dtype(self.table_dtype, "table_dtype")
            table = kvsparse.SparseTable(
                dim=int(value.shape[1]),
                initializer=initializers.Zeros(),
                dtype=dtype if dtype in ("float16", "bfloat16") else "float32",
            )
            self._store.init(k, table)
            self._keys.append(k)
            if value.stype == "row_sparse":
                ids = as_numpy(value.indices).astype(np.int64)
            else:
                ids = np.arange(value.shape[0], dtype=np.int64)
            self._set_rows(k, ids, as_numpy(value))  # the stored rows, where MXNet keeps them
        else:
            if value.stype != "default":
                raise errors.DTypeError(f"key {k!r}: {value.stype} values are not supported")
            # kvsparse keeps rank 0's values of a dense key; a float16 one stays float16.
            self._store.init(k, as_numpy(value))
            self._keys.append(k)
        self._server_optimizer.added([k])

    def _set_rows(self, k, ids, rows) -> None:
        """Writes rank 0's rows of table k verbatim (ASSIGN_SPARSE: any time, no optimizer).

        The other workers wait at a barrier until they are in place, as for a
        dense key's init.
        """
        if self.rank == 0 and ids.size:
            self._store.assign(k, (ids, rows))
        if self.num_workers > 1:
            self._store.barrier()

    # -- optimizer ----------------------------------------------------------------------

    @_raises_mxnet_errors
    def set_optimizer(self, optimizer):
        """Runs `optimizer` (MXNet's, or a kvsparse one) on the servers for every key.

        It is sent at the first push (so that init can still set rows), or at once
        when pushes happened already; slots then restart from zero. See
        `optimizer_from_mxnet` for the mapping.

        Raises:
            kvsparse.errors.InvalidArgument: an optimizer kvsparse cannot run.
        """
        if optimizer is not None:
            optimizer_from_mxnet(optimizer)  # refuse what cannot run before anything changes
        self._updater = _Updater(optimizer)
        self._server_optimizer.set(optimizer, self._keys)

    # -- push ---------------------------------------------------------------------------

    def _sparse_part(self, k, value, dim):
        """(ids, rows) of one value pushed to a sparse key."""
        if isinstance(value, tuple):
            if len(value) != 2:
                raise errors.InvalidArgument(f"a push to key {k!r} takes (ids, rows) pairs")
            rows = as_numpy(value[1]) if isinstance(value[1], mx.nd.NDArray) else value[1]
            return (_row_ids(value[0], key=k), rows)
        if not isinstance(value, mx.nd.NDArray):
            raise errors.DTypeError(
                f"a push to key {k!r} takes NDArrays, got {type(value).__name__}"
            )
        if len(value.shape) != 2 or value.shape[1] != dim:
            raise errors.ShapeError(
                f"a push to key {k!r} needs shape (rows, {dim}), got {value.shape}"
            )
        if value.stype == "row_sparse":
            return (as_numpy(value.indices).astype(np.int64), as_numpy(value))
        if value.stype != "default":
            raise errors.DTypeError(f"key {k!r}: {value.stype} values are not supported")
        return (np.arange(value.shape[0], dtype=np.int64), as_numpy(value))

    def _dense_part(self, k, value):
        if not isinstance(value, mx.nd.NDArray):
            raise errors.DTypeError(
                f"a push to key {k!r} takes NDArrays, got {type(value).__name__}"
            )
        if value.stype != "default":
            value = value.tostype("default")
        return as_numpy(value)

    def _prepare_push(self, pairs):
        keys, values = [], []
        for k, vals in pairs:
            info = self._store.key_info(k)
            if info.sparse:
                parts = [self._sparse_part(k, v, info.dim) for v in vals]
            else:
                parts = [self._dense_part(k, v) for v in vals]
            keys.append(k)
            if self._compression is not None and self._compression.type != "none":
                values.append(self._compressed(info, parts))
            else:
                values.append(parts[0] if len(parts) == 1 else parts)
        return keys, values

    def _compressed(self, info, parts):
        """What a push of parts (summed) to a key sends under the gradient compression.

        2bit / 1bit: MXNet's quantized values of the sum, this worker's residual
        carried (`kvsparse.store.compression`); a sparse key's rows are summed per
        id first. fp16 / bf16: a sparse key's rows travel in that dtype (the
        store's wire dtype); a dense key's sum is rounded to it here.
        """
        compression = self._compression
        k = info.key
        if info.sparse:
            if not compression.quantizes:
                return parts[0] if len(parts) == 1 else parts
            ids = np.concatenate([arrays.flat_ids(p[0]) for p in parts])
            what = f"rows pushed to key {k!r}"
            rows = np.concatenate(
                [
                    arrays.rows_view(
                        arrays.as_float32(p[1], what=what), p[0].shape, info.dim, what=what
                    )
                    for p in parts
                ]
            )
            unique, inverse = np.unique(ids, return_inverse=True)
            summed = _core.sum_rows(rows, inverse.astype(np.int64).reshape(-1), unique.size)
            _check_finite(k, summed)
            return (unique, compression.sparse(k, unique, summed))
        total = None
        for part in parts:
            if part.shape != info.shape:
                raise errors.ShapeError(
                    f"value pushed to key {k!r} must have shape {info.shape}, got {part.shape}"
                )
            total = np.array(part, np.float32) if total is None else total + part
        _check_finite(k, total)
        if compression.quantizes:
            return compression.dense(k, total)
        wire = compression.wire_dtype
        return _core.widen(_core.narrow(total, wire), wire)

    @_raises_mxnet_errors
    def push(self, key, value, priority=0):
        """Pushes gradients (values, without an optimizer); a pushed list is summed.

        Args:
            key: a key or a list of keys (all go out in one request per server).
            value: per key an NDArray, a RowSparseNDArray, a list of them (summed), or
                a kvsparse ``(ids, rows)`` pair (any int64 ids; rows ids.shape + (dim,)).
            priority: accepted for MXNet compatibility; requests go out in call order.

        Raises:
            UnknownKey, ShapeError, DTypeError, NonFiniteGradient (nothing applied).
        """
        del priority
        pairs = self._pairs(key, value, "push")
        keys, values = self._prepare_push(pairs)  # all checks before anything is sent
        self._server_optimizer.before_push(self._keys, [k for k, _ in pairs])
        self._store.push(keys, values)

    # -- pull ----------------------------------------------------------------------------

    @_raises_mxnet_errors
    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Pulls dense keys into out; sparse keys fill a dense (rows, dim) out with rows
        0..rows-1 and, with ignore_sparse=False, a RowSparseNDArray out with all rows.

        Raises:
            UnknownKey, ShapeError.
        """
        del priority
        if out is None:
            raise errors.InvalidArgument("pull needs out (an NDArray or a list of them)")
        targets = self._pairs(key, out, "pull")

        def rows_of(index, target):
            if target.stype == "row_sparse" and ignore_sparse:
                return None
            return np.arange(target.shape[0], dtype=np.int64)

        self._pull_into(targets, rows_of)

    @_raises_mxnet_errors
    def pushpull(self, key, value, out=None, priority=0):
        """push(key, value), then pull the result into out (or into value when out is None).

        For a sparse key a RowSparseNDArray target receives the rows this push touched,
        a dense (rows, dim) target all its rows.
        """
        del priority
        pairs = self._pairs(key, value, "pushpull")
        keys, values = self._prepare_push(pairs)
        targets = pairs if out is None else self._pairs(key, out, "pushpull")
        self._server_optimizer.before_push(self._keys, [k for k, _ in pairs])
        self._store.push(keys, values)

        touched = {}  # index of a sparse key -> the ids this push touched

        def rows_of(index, target):
            if target.stype != "row_sparse":
                return np.arange(target.shape[0], dtype=np.int64)
            if index not in touched:
                pushed = values[index]
                parts = pushed if isinstance(pushed, list) else [pushed]
                touched[index] = np.unique(np.concatenate([p[0].reshape(-1) for p in parts]))
            return touched[index]

        self._pull_into(targets, rows_of)

    def _pull_into(self, targets, rows_of) -> None:
        """Fills each (key, [outs]) of targets in one pull per kind of key.

        A dense key's outs get its value; an out of a sparse key gets the rows
        ``rows_of(index of the key in targets, out)`` names (None: left alone).
        """
        with mx.autograd.pause():
            dense_keys, dense_outs, sparse_requests = [], [], []
            for index, (k, outs) in enumerate(targets):
                if not self._store.key_info(k).sparse:
                    dense_keys.append(k)
                    dense_outs.append([as_numpy(o, writable=True) for o in outs])
                    continue
                for o in outs:
                    ids = rows_of(index, o)
                    if ids is not None:
                        sparse_requests.append((k, ids, [o]))
            if dense_keys:
                self._store.pull(dense_keys, out=dense_outs)
            if sparse_requests:
                self._row_sparse_requests(sparse_requests)

    @_raises_mxnet_errors
    def broadcast(self, key, value, out, priority=0):
        """init(key, value) (rank 0's value wins), then pull(key, out).

        Raises:
            DuplicateKey: the key was initialized already (as MXNet's stores).
        """
        self.init(key, value)
        self.pull(key, out=out, priority=priority, ignore_sparse=False)

    @_raises_mxnet_errors
    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        """Pulls the rows of row_ids from sparse key(s).

        Args:
            key: a key or a list of keys (one request per server for all of them).
            out: per key a RowSparseNDArray (gets the unique sorted rows, MXNet), a
                dense NDArray of shape row_ids.shape + (dim,) (filled in place, one row
                per id), a list of those, or None (a new dense NDArray is returned).
            row_ids: an NDArray (int or float, any shape, duplicates allowed) or a list
                of them, one per key; one NDArray serves every out of a single key.

        Returns:
            The filled out (or list of them, for a list of keys).

        Raises:
            UnknownKey, ShapeError, InvalidArgument (ids outside a RowSparseNDArray's
            rows, fractional ids), DTypeError.
        """
        del priority
        if row_ids is None:
            raise errors.InvalidArgument("row_sparse_pull needs row_ids")
        single = not isinstance(key, (list, tuple))
        keys = arrays.as_list(key)
        id_list = arrays.per_key(row_ids, single)
        outs_list = arrays.outputs_per_key(out, single, len(keys))
        if len(id_list) != len(keys) or len(outs_list) != len(keys):
            raise errors.InvalidArgument("row_sparse_pull: keys, row_ids and out differ in length")
        self._pairs(keys, [None] * len(keys), "row_sparse_pull")  # key types
        requests, results = [], []
        for k, ids, outs in zip(keys, id_list, outs_list):
            info = self._store.key_info(k)
            if not info.sparse:
                raise errors.InvalidArgument(f"key {k!r} is dense; use pull")
            ids = _row_ids(ids, key=k)
            if outs is None:
                outs = mx.nd.empty(ids.shape + (info.dim,), dtype=_MX_DTYPES[info.dtype])
            results.append(outs)
            requests.append((k, ids, _values_of(outs)))
        with mx.autograd.pause():
            self._row_sparse_requests(requests)
        return results[0] if single else results

    def _row_sparse_requests(self, requests) -> None:
        """requests: [(key, int64 ids, [outs])] -> one row_sparse_pull for all of them."""
        keys, ids_list, buffers, finish = [], [], [], []
        for k, ids, outs in requests:
            dim = self._store.key_info(k).dim
            sparse_outs = [o for o in outs if o.stype == "row_sparse"]
            for o in outs:
                if o.stype == "row_sparse":
                    continue
                if o.stype != "default":
                    raise errors.DTypeError(f"out of key {k!r}: {o.stype} is not supported")
                if tuple(o.shape) != ids.shape + (dim,):
                    raise errors.ShapeError(
                        f"a dense out of key {k!r} must have shape row_ids.shape + ({dim},) "
                        f"= {ids.shape + (dim,)}, got {o.shape}"
                    )
                keys.append(k)
                ids_list.append(ids)
                buffers.append(as_numpy(o, writable=True))  # rows land in MXNet's memory
            if not sparse_outs:
                continue
            first = sparse_outs[0]
            for o in sparse_outs:
                if len(o.shape) != 2 or o.shape[1] != dim or o.shape != first.shape:
                    raise errors.ShapeError(
                        f"a RowSparseNDArray out of key {k!r} must have shape (rows, {dim}), "
                        f"got {o.shape}"
                    )
            unique = np.unique(ids)
            if unique.size and (unique[0] < 0 or unique[-1] >= first.shape[0]):
                raise errors.InvalidArgument(
                    f"row ids of key {k!r} must lie in [0, {first.shape[0]}) for a "
                    f"RowSparseNDArray out of shape {first.shape}; use a dense out of shape "
                    "row_ids.shape + (dim,) for ids beyond the declared rows"
                )
            staging = _new_row_sparse(first.shape, unique.size, first.context)
            keys.append(k)
            ids_list.append(unique)
            buffers.append(as_numpy(staging, writable=True))
            finish.append((staging, unique, sparse_outs))
        if keys:
            self._store.row_sparse_pull(keys, out=buffers, row_ids=ids_list)
        for staging, unique, sparse_outs in finish:
            _set_indices(staging, unique)
            for o in sparse_outs:
                staging.copyto(o)

    # -- the rest of MXNet's API ----------------------------------------------------------

    @_raises_mxnet_errors
    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Writes every key's optimizer slots (kvsparse's .npz format)."""
        self._server_optimizer.send(self._keys)
        self._store.save_optimizer_states(fname, dump_optimizer=dump_optimizer)

    @_raises_mxnet_errors
    def load_optimizer_states(self, fname):
        """Restores what save_optimizer_states wrote."""
        self._server_optimizer.send(self._keys)
        self._store.load_optimizer_states(fname)

    @_raises_mxnet_errors
    def set_gradient_compression(self, compression_params):
        """Compresses later pushes as MXNet's dist stores do (never init).

        ``{'type': '2bit', 'threshold': t}`` and ``{'type': '1bit', 'threshold': t}``:
        each push sends MXNet 1.9.1's quantized values of the (summed) gradient,
        this worker keeping the quantization error as a residual per key, added
        to the next push of the key (`kvsparse.store.compression`: the exact
        rules). Dense keys as MXNet; sparse tables too (MXNet refuses row_sparse),
        with a residual per row pushed. The values travel as float32.
        ``{'type': 'fp16'}`` / ``{'type': 'bf16'}``: sparse tables' rows travel
        as float16 / bfloat16 both ways (the store's wire_dtype, rounded once per
        push after summing); dense gradients are rounded to that dtype on the
        worker (the servers get the rounded values; dense values travel as
        float32). ``{'type': 'none'}`` turns compression off (residuals dropped).

        Raises:
            kvsparse.errors.InvalidArgument: an unknown type or setting, a 2bit
                threshold <= 0.
        """
        compression = GradientCompression(compression_params)
        self._store.wire_dtype = compression.wire_dtype or "float32"
        self._compression = compression

    @_raises_mxnet_errors
    def _set_updater(self, updater):
        raise errors.InvalidArgument(
            "kvsparse runs optimizers on its servers; a Python updater cannot run there: "
            "use set_optimizer"
        )

    @_raises_mxnet_errors
    def _send_command_to_servers(self, head, body):
        raise errors.InvalidArgument("kvsparse servers take no MXNet commands")

    @_raises_mxnet_errors
    def _barrier(self):
        self._store.barrier()

    @_raises_mxnet_errors
    def barrier(self):
        """Blocks until every worker reaches the barrier."""
        self._store.barrier()

    @_raises_mxnet_errors
    def close(self):
        """Releases the kvsparse store (connections, or the local tables)."""
        self._store.close()


@KVStoreBase.register
class Dist_Sparse(KVSparseStore):  # noqa: N801 - MXNet's registry key is the lower-cased name
    """``mx.kv.create('dist_sparse')``: kvsparse servers, BSP (a step's pushes summed).

    Not safe to call from several threads at once (a `KVSparseStore`).

    Args:
        **kwargs: kvsparse.create's dist options (servers=, rank=, num_workers=,
            timeout=); none: the launcher's or the environment's configuration.
    """

    @_raises_mxnet_errors
    def __init__(self, **kwargs):
        super().__init__(kvsparse.create("dist_sparse", **kwargs), "dist_sparse")


@KVStoreBase.register
class Dist_Sparse_Async(KVSparseStore):  # noqa: N801
    """``mx.kv.create('dist_sparse_async')``: kvsparse servers, pushes applied on arrival.

    Not safe to call from several threads at once (a `KVSparseStore`).
    """

    @_raises_mxnet_errors
    def __init__(self, **kwargs):
        super().__init__(kvsparse.create("dist_sparse_async", **kwargs), "dist_sparse_async")


@_raises_mxnet_errors
def create(name: str = "dist_sparse", **kwargs) -> KVSparseStore:
    """A kvsparse store with MXNet's KVStore API, with explicit configuration.

    Args:
        name: 'dist_sparse', 'dist_sparse_async', or 'local' (one in-process shard).
        **kwargs: for dist kinds, kvsparse.create's options (servers=, rank=,
            num_workers=, timeout=).

    Safe to call from several threads at once (each call makes a new store).

    Raises:
        kvsparse.errors.InvalidArgument: an unknown name.

    Example:
        >>> kv = create('dist_sparse', servers=['tcp://127.0.0.1:7000'])  # doctest: +SKIP
        >>> trainer = mx.gluon.Trainer(params, 'adam', kvstore=kv)  # doctest: +SKIP
    """
    kind = name.lower()
    if kind == "local":
        return KVSparseStore(kvsparse.create("local", **kwargs), "local")
    if kind == "dist_sparse":
        return Dist_Sparse(**kwargs)
    if kind == "dist_sparse_async":
        return Dist_Sparse_Async(**kwargs)
    raise errors.InvalidArgument(
        f"unknown store {name!r}; use 'dist_sparse', 'dist_sparse_async' or 'local'"
    )
