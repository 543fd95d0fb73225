"""PyTorch adapter: embedding modules whose tables live on kvsparse servers.

`Embedding` and `EmbeddingBag` are `torch.nn.Module`s that hold no table:
on forward they pull the rows of the batch's ids into a fresh tensor, on
backward they push the gradient of those rows to the store, where the table's
own optimizer (``SparseTable(optimizer=...)``) updates them. Dense parameters
stay with `torch.optim`; `DenseGradientSync` averages their gradients over the
workers through the store, the MXNet way.

Tensors cross without copies on the CPU: rows are pulled straight into the
output tensor through DLPack (``row_sparse_pull(..., out=tensor)``), and a
contiguous gradient is handed to the store as it is (the store then sums the
rows of duplicate ids in C++, into a buffer of its own).

Rules worth knowing:

- One backward = one push. Calling a module twice in one step (two fields
  sharing a table) pushes twice; a table whose optimizer counts pushes
  (Adam ``step_mode='table'``) then counts two steps. Look up both fields in
  one call (ids of shape (batch, fields)) to push once.
- ``backward(retain_graph=True)`` followed by a second backward pushes again.
- With several workers on a synchronous store (dist_sparse), a push waits for
  every worker's push of that table: every worker must run backward through
  each module once per step (an empty batch pushes nothing, and still counts).
- Ids are any int64 values (hashed ids welcome); ``padding_idx`` is an id
  value, not an index into a vocabulary.
- ``module.prefetch(next_ids)`` pulls the next batch's rows ahead; the next
  forward uses them if its ids are equal. Called after this step's backward,
  the prefetched rows include this step's update. Where the store defers
  pulls (``kv.defers_pulls``: a dist store whose servers answer a push once
  applied) the requests are sent at once and the next forward reads the
  replies; otherwise one background thread per store runs its prefetches, in
  order. An error of the pull is raised by the next forward.
- ``warm_together(modules, next_ids)`` (or ``module.warm(next_ids)``), called
  before this step's backward, tells the servers the next batch's ids at once:
  a server with a disk tier reads their rows on disk into memory while the
  worker runs backward, so the prefetch after backward finds them in memory.
  It changes no row and no result (the prefetch still reads the table after
  this step's push); only where ``kv.defers_pulls`` (elsewhere it does nothing).
- ``push_together(kv, wait=False)`` sends a step's push without waiting for
  the servers' acknowledgements; the next prefetch (or any store call)
  collects them, and raises a failure then.
- The adapters call a store under `store_lock(kv)`; take it too if you call
  the store from another thread while a prefetch may be in flight.
- ``torch.compile`` works: the pull runs eagerly (a graph break), the layers
  around it compile.
- CUDA ids and gradients are moved to the CPU for the store (a copy); the
  output goes to the ids' device. The zero-copy path is the CPU one.

Example:
    >>> import torch, kvsparse
    >>> from kvsparse.adapters.torch import Embedding
    >>> kv = kvsparse.create('local')
    >>> emb = Embedding(kv, 'user', embedding_dim=4,
    ...                 optimizer=kvsparse.optimizers.SGD(learning_rate=0.1))
    >>> out = emb(torch.tensor([[3, 7], [7, 9]]))
    >>> out.shape
    torch.Size([2, 2, 4])
    >>> out.sum().backward()  # pushes the gradient of ids 3, 7, 9; SGD runs on the store
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import weakref

import torch
import torch.nn.functional as functional
from kvsparse.adapters._common import TableOptions, check_trainable, ensure_table, store_lock
from torch import nn

from kvsparse import errors

_BAG_MODES = ("sum", "mean", "max")


def _check_ids(ids) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise errors.KeyTypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise errors.DTypeError(f"ids must be an integer tensor, got {ids.dtype}")
    return ids


class _PrefetchThread:
    """The thread that runs one store's background pulls, one at a time, in order.

    One per store, started by its first prefetch and ended when the store is
    garbage-collected: a thread started per prefetch cost the training thread
    about 0.4 ms a step (benchmarks/end_to_end.py's profile).
    """

    def __init__(self):
        self.pid = os.getpid()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="kvsparse-prefetch", daemon=True)
        self._thread.start()

    def submit(self, job) -> None:
        """Runs job() on the thread after the jobs before it; job must not raise."""
        self._jobs.put(job)

    def stop(self) -> None:
        """Ends the thread once the jobs before are done."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()
            # Hold nothing while idle: a tensor freed by this thread during interpreter
            # shutdown ends in std::terminate (torch drops the GIL in its dealloc).
            del job


_prefetch_threads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_prefetch_threads_guard = threading.Lock()


def _prefetch_thread(kv) -> _PrefetchThread:
    """kv's prefetch thread (a new one in a forked child: threads do not survive a fork)."""
    with _prefetch_threads_guard:
        worker = _prefetch_threads.get(kv)
        if worker is None or worker.pid != os.getpid():
            worker = _prefetch_threads[kv] = _PrefetchThread()
            # Not at exit: the daemon thread then just stays blocked until the process ends.
            weakref.finalize(kv, worker.stop).atexit = False
        return worker


class _PullOutcome:
    """The rows of a pull of one or more tables, or its error, which is reported once."""

    def __init__(self):
        self.rows = None
        self.error = None
        self.error_reported = False

    def _outcome(self) -> list | None:
        """The rows; raises the pull's error, if any, in the caller's thread.

        The error is raised once, to the first table that waits; the other
        tables of the pull then get None (no rows: they pull again).
        """
        if self.error is not None:
            if self.error_reported:
                return None
            self.error_reported = True
            raise self.error
        return self.rows


class _BackgroundPull(_PullOutcome):
    """One background pull of one or more tables; keeps its rows or its error, never raises."""

    def __init__(self, pull, lookups: list, ids: list):
        super().__init__()
        self._pull = pull
        self._args = (lookups, ids)
        self._done = threading.Event()
        _prefetch_thread(lookups[0].kv).submit(self._run)

    def _run(self):
        try:
            self.rows = self._pull(*self._args)
        except BaseException as exc:  # noqa: BLE001 - stored for the caller, see wait()
            self.error = exc
        finally:
            self._args = None
            self._done.set()

    def wait(self) -> list | None:
        """Waits for the pull; its rows, or its error raised once (`_PullOutcome`)."""
        self._done.wait()
        return self._outcome()


class _DeferredPull(_PullOutcome):
    """A pull sent from the calling thread and read when its rows are wanted.

    Where the store defers pulls (`kvsparse.KVStore.defers_pulls`): the
    requests go out now, behind the step's push, and the servers answer while
    the training thread does its dense update; the next forward reads the
    replies. No thread holds the GIL meanwhile: a prefetch thread's Python
    (encode, decode, gather calls) slowed the training thread's dense Adam
    about twofold (benchmarks/end_to_end.py). Waited on as a _BackgroundPull.
    """

    def __init__(self, lookups: list, ids: list):
        super().__init__()
        try:
            self._rows = _send_pull(lookups, ids, wait=False)
        except BaseException as exc:  # noqa: BLE001 - raised by wait(), as a thread's would be
            self._rows = None
            self.error = exc

    def wait(self) -> list | None:
        """Reads the replies; the rows, or the pull's error raised once (`_PullOutcome`)."""
        if self._rows is not None:
            rows, self._rows = self._rows, None
            try:
                self.rows = rows()
            except BaseException as exc:  # noqa: BLE001 - reported by _outcome, once
                self.error = exc
        return self._outcome()


class _Prefetch:
    """One table's share of a background pull: the ids it was for, and where its rows are."""

    def __init__(self, pull: _BackgroundPull, index: int, ids: torch.Tensor):
        self.ids = ids
        self._pull = pull
        self._index = index

    def wait(self):
        """The rows (None if the pull failed and another table reported it); raises the
        pull's error, if not reported yet, in the caller's thread."""
        rows = self._pull.wait()
        return None if rows is None else rows[self._index]

    def matches(self, ids: torch.Tensor) -> bool:
        return (
            ids.shape == self.ids.shape
            and ids.device == self.ids.device
            and torch.equal(ids, self.ids)
        )


def _pull_tables(lookups: list, ids: list) -> list:
    """table[ids] for each (lookup, ids): one row_sparse_pull, one request per server for all."""
    return _send_pull(lookups, ids, wait=True)()


def _send_pull(lookups: list, ids: list, wait: bool):
    """Sends the pull of table[ids] for each (lookup, ids); returns a callable giving the rows.

    wait=False on a store that defers pulls: the requests are out when this
    returns, and the callable reads the replies (`kvsparse.KVStore.row_sparse_pull`).
    """
    kv = lookups[0].kv
    host_ids = [i if i.device.type == "cpu" else i.cpu() for i in ids]
    outs = [
        torch.empty(tuple(i.shape) + (lookup.dim,), dtype=lookup.dtype)
        for lookup, i in zip(lookups, host_ids)
    ]
    keys = [lookup.key for lookup in lookups]
    with store_lock(kv):
        if wait:
            kv.row_sparse_pull(keys, out=outs, row_ids=host_ids)
        else:
            pending = kv.row_sparse_pull(keys, out=outs, row_ids=host_ids, wait=False)

    def rows() -> list:
        if not wait:
            with store_lock(kv):
                pending.wait()
        result = []
        for lookup, i, host, out in zip(lookups, ids, host_ids, outs):
            if lookup.padding_idx is not None:
                out[host == lookup.padding_idx] = 0.0
            result.append(out if i.device.type == "cpu" else out.to(i.device, non_blocking=True))
        return result

    return rows


class _SparseRows(torch.autograd.Function):
    """rows = table[ids] on forward; pushes (ids, d loss / d rows) on backward.

    `anchor` is an empty tensor that requires grad: autograd calls backward
    only for functions with a differentiable input, and ids are integers.
    """

    @staticmethod
    def forward(ctx, anchor, lookup, ids):
        del anchor
        ctx.lookup = lookup
        # Saved as nn.Embedding saves its indices: ids changed in place before
        # backward make autograd raise instead of pushing to the wrong rows.
        ctx.save_for_backward(ids)
        return lookup.rows_for(ids)

    @staticmethod
    def backward(ctx, grad_rows):
        (ids,) = ctx.saved_tensors
        ctx.lookup.push(ids, grad_rows)
        return None, None, None


# The torch dtype of each table dtype, and back (`torch_dtype`, `TORCH_DTYPES`).
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(kv, key) -> torch.dtype:
    """The torch dtype of the values of `key` on kv (what its pulls give)."""
    return TORCH_DTYPES[kv.key_info(key).dtype]


class _Lookup:
    """Pull/push of one table, shared by Embedding and EmbeddingBag."""

    def __init__(self, kv, key, dim: int, padding_idx, dtype: torch.dtype = torch.float32):
        self.kv = kv
        self.key = key
        self.dim = dim
        self.padding_idx = padding_idx
        self.dtype = dtype  # the table's: rows come out in it
        self.prefetched: _Prefetch | None = None
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        # A warm_together not read yet: (its PendingPull, this table's index in it).
        self.warming: tuple | None = None
        self.warmed_rows = 0  # rows the servers brought in from disk for warm_together

    def __deepcopy__(self, memo):
        # A copied module (an EMA copy, say) uses the same table on the same store.
        return _Lookup(self.kv, self.key, self.dim, self.padding_idx, self.dtype)

    def __reduce__(self):
        # Pickled (torch.save of a whole model) as the table's key and shape, without the
        # store: it holds sockets and C++ tables, and the rows live on the servers. The
        # unpickled layer is bound to a store by `bind` before its first forward.
        return (_Lookup, (None, self.key, self.dim, self.padding_idx, self.dtype))

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        """table[ids] as a new tensor of the table's dtype, shape ids.shape + (dim,), on
        ids' device."""
        return _pull_tables([self], [ids])[0]

    def rows_for(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ids: the prefetched ones if they were for these ids, else a pull."""
        pending, self.prefetched = self.prefetched, None
        if pending is not None:
            rows = pending.wait()
            if rows is not None and pending.matches(ids):
                self.prefetch_hits += 1
                return rows
            self.prefetch_misses += 1
        return self.pull(ids)

    def drop_prefetch(self) -> None:
        """Forgets an unused prefetch; its error still reaches the caller."""
        pending, self.prefetched = self.prefetched, None
        if pending is not None:
            pending.wait()

    def prefetch(self, ids: torch.Tensor) -> None:
        _prefetch_together([self], [ids])

    def finish_warming(self) -> None:
        """Reads the servers' answer to the last warm (long there: they answered it before
        this step's push); counts its rows, raises its failure."""
        warming, self.warming = self.warming, None
        if warming is not None:
            pending, index = warming
            with store_lock(self.kv):
                self.warmed_rows += pending.wait()[index]

    def push(self, ids: torch.Tensor, grad_rows: torch.Tensor) -> None:
        grad = grad_rows.detach()
        if grad.device.type != "cpu":
            grad = grad.cpu()
        if ids.device.type != "cpu":
            ids = ids.cpu()
        if grad.dtype != torch.float32:
            grad = grad.float()
        # A contiguous gradient reaches the store as the same memory (DLPack);
        # only an odd layout (an expanded or transposed gradient) is copied.
        grad = grad.contiguous()
        # The ids the forward pulled: the store reuses that pull's plan,
        # unless padding ids are dropped here, which makes them another batch.
        if self.padding_idx is not None:
            keep = ids != self.padding_idx
            if not bool(keep.all()):
                ids, grad = ids[keep], grad[keep]
        batch = _PushBatch.active(self.kv)
        if batch is not None:
            batch.add(self.key, ids, grad)
            return
        _sync_learning_rates(self.kv)
        with store_lock(self.kv):
            check_trainable(self.kv, self.key)
            self.kv.push(self.key, (ids, grad))


class LearningRateFollower:
    """Drives the servers' learning rate from a torch optimizer's param group.

    Made by `follow_learning_rate`. Before each push of the store's modules
    (backward, `push_together`) it reads the group's ``lr`` (which a
    ``torch.optim.lr_scheduler`` sets) and, when it changed, calls
    ``kv.set_learning_rate`` (every slot on the servers stays). Call `sync`
    to send it at once. Not safe to use from several threads at once (it
    follows one training loop).
    """

    def __init__(self, kv, optimizer, key=None, learning_rate=None, param_group: int = 0):
        self.kv = kv
        self.optimizer = optimizer
        self.key = key
        self.param_group = int(param_group)
        group = self._group()
        # The schedule's start: torch's schedulers record it as initial_lr.
        self._start = float(group.get("initial_lr", group["lr"]))
        self._server_start = None if learning_rate is None else float(learning_rate)
        self._sent = None

    def _group(self) -> dict:
        groups = self.optimizer.param_groups
        if not 0 <= self.param_group < len(groups):
            raise errors.InvalidArgument(
                f"param_group {self.param_group}: the optimizer has {len(groups)} groups"
            )
        return groups[self.param_group]

    def learning_rate(self) -> float:
        """The rate the servers should run now: the group's lr, or learning_rate scaled
        by the group's lr over its initial lr."""
        lr = float(self._group()["lr"])
        if self._server_start is None:
            return lr
        if self._start == 0.0:
            return self._server_start
        return self._server_start * lr / self._start

    def sync(self) -> bool:
        """Sends the rate if it changed since the last one sent; True if it sent one."""
        lr = self.learning_rate()
        if lr == self._sent:
            return False
        with store_lock(self.kv):
            self.kv.set_learning_rate(lr, key=self.key)
        self._sent = lr
        return True

    def remove(self) -> None:
        """Stops following (the servers keep the last rate sent)."""
        with _followers_guard:
            followers = _followers.get(self.kv, [])
            if self in followers:
                followers.remove(self)


# kv -> its LearningRateFollowers; weak, so a closed store's entries go with it.
_followers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_followers_guard = threading.Lock()


def follow_learning_rate(kv, optimizer, key=None, *, learning_rate=None, param_group: int = 0):
    """Makes a torch optimizer's learning rate (and its scheduler) drive the servers' rate.

    Schedulers (``torch.optim.lr_scheduler.StepLR`` ...) set the ``lr`` of
    the torch optimizer's param groups; the tables' optimizers run on the
    servers. With this, the modules of kv send that ``lr`` to the servers
    (``kv.set_learning_rate``, which keeps every slot and step) before their
    first push after it changed, so one scheduler drives both. On a
    synchronous store every worker must follow the same schedule. Safe to
    call from several threads at once; the follower it returns follows one
    training loop (`LearningRateFollower`).

    Args:
        kv: the store of the modules.
        optimizer: a torch.optim.Optimizer (the dense one, typically).
        key: the tables to change (a key or a list); None: every table and
            the store-wide optimizer (`kvsparse.KVStore.set_learning_rate`).
        learning_rate: None: the servers run the group's lr itself. A number:
            the servers' rate at the schedule's start, scaled as the group's lr
            is scaled from its initial lr (sparse and dense rates often differ).
        param_group: which param group's lr to follow.

    Returns:
        the `LearningRateFollower` (``remove()`` stops it; ``sync()`` sends now).

    Raises:
        kvsparse.errors.InvalidArgument: no such param group.

    Example:
        >>> dense = torch.optim.SGD(model.dense_parameters(), lr=0.1)
        >>> scheduler = torch.optim.lr_scheduler.StepLR(dense, step_size=10, gamma=0.5)
        >>> follow_learning_rate(kv, dense, learning_rate=0.05)  # tables: 0.05, 0.025, ...
    """
    follower = LearningRateFollower(kv, optimizer, key, learning_rate, param_group)
    with _followers_guard:
        _followers.setdefault(kv, []).append(follower)
    return follower


def _sync_learning_rates(kv) -> None:
    """Sends each follower's changed learning rate before a push to kv."""
    with _followers_guard:
        followers = list(_followers.get(kv, ()))
    for follower in followers:
        follower.sync()


def _prefetch_together(lookups: list, ids: list) -> None:
    """Starts one pull for every lookup (ids copied: the caller may refill them): sent now
    and read by the next forward where the store defers pulls, else on the store's
    prefetch thread."""
    for lookup in lookups:
        lookup.drop_prefetch()
        lookup.finish_warming()
    ids = [i.detach().clone() for i in ids]
    if getattr(lookups[0].kv, "defers_pulls", False):
        pull = _DeferredPull(lookups, ids)
    else:
        pull = _BackgroundPull(_pull_tables, lookups, ids)
    for index, (lookup, i) in enumerate(zip(lookups, ids)):
        lookup.prefetched = _Prefetch(pull, index, i)


def _warm_together(lookups: list, ids: list) -> None:
    """Sends the ids of every lookup to the servers ahead of their pull (`warm_together`)."""
    kv = lookups[0].kv
    host_ids = [i if i.device.type == "cpu" else i.cpu() for i in ids]
    # Planned from copies: the caller may refill its ids before the pull.
    host_ids = [i.detach().clone() for i in host_ids]
    with store_lock(kv):
        pending = kv.row_sparse_prefetch(
            [lookup.key for lookup in lookups], [i.numpy() for i in host_ids]
        )
    for index, lookup in enumerate(lookups):
        lookup.warming = None if pending is None else (pending, index)


def _lookups_and_ids(what: str, modules, ids) -> tuple[list, list]:
    """(the modules' bound lookups, their flat ids) for warm_together / prefetch_together:
    one ids tensor for every module, or one per module; the modules on one store."""
    modules = list(modules)
    if not modules:
        raise errors.InvalidArgument(f"{what} needs at least one module")
    ids_list = list(ids) if isinstance(ids, (list, tuple)) else [ids] * len(modules)
    if len(ids_list) != len(modules):
        raise errors.InvalidArgument(
            f"{what}: {len(modules)} modules but {len(ids_list)} ids tensors"
        )
    kv = modules[0].kv
    if any(m.kv is not kv for m in modules):
        raise errors.InvalidArgument(f"{what}: the modules use different stores")
    lookups = [m._bound() for m in modules]
    return lookups, [m._flat_ids(_check_ids(i)) for m, i in zip(modules, ids_list)]


def warm_together(modules, ids) -> None:
    """Tells the servers now which rows the next batch will pull, so they read them from disk.

    Call it before this step's backward with the ids that the next `prefetch`
    (or forward) will pull: a server with a disk tier (``--memory-budget``
    with ``--spill-dir``) brings those of their rows that are on disk into
    memory while this worker runs backward, and the pull after the push finds
    them there. Nothing else changes: the rows that pull returns include this
    step's update, as without it. Where the store does not defer pulls
    (``kv.defers_pulls`` False: a local store, BSP with several workers) it
    sends nothing. `ids` is one tensor for every module, or one per module;
    the modules must share one store.

    Raises:
        kvsparse.errors.InvalidArgument: no modules, modules of different
            stores, or a different number of ids tensors than modules.
        kvsparse.errors.DTypeError: non-integer ids.
        A failure of the servers is raised by the next `prefetch` of these modules.

    Example:
        >>> logits = model(batch)
        >>> warm_together(model.embeddings, next_ids)   # disk reads start now
        >>> with push_together(kv, wait=False):
        ...     loss_function(logits, labels).backward()
        >>> prefetch_together(model.embeddings, next_ids)
    """
    _warm_together(*_lookups_and_ids("warm_together", modules, ids))


class _PushBatch:
    """The backward pushes of one `push_together` block, sent as one push at its end."""

    _active: dict = {}  # id(kv) -> the store's open batch
    _guard = threading.Lock()

    def __init__(self, kv, wait: bool = True):
        self.kv = kv
        self.wait = wait
        self.pushes: dict = {}  # key -> [(ids, grad)], in the order backward produced them

    @classmethod
    def active(cls, kv):
        with cls._guard:
            return cls._active.get(id(kv))

    def open(self) -> None:
        with self._guard:
            if id(self.kv) in self._active:
                raise errors.InvalidArgument(
                    "push_together: a block for this store is already open (blocks do not nest, "
                    "and one store's blocks do not run in two threads at once)"
                )
            self._active[id(self.kv)] = self

    def close(self) -> None:
        with self._guard:
            self._active.pop(id(self.kv), None)

    def add(self, key, ids: torch.Tensor, grad: torch.Tensor) -> None:
        with store_lock(self.kv):
            check_trainable(self.kv, key)
        self.pushes.setdefault(key, []).append((ids, grad))

    def send(self) -> None:
        """One push of every table's gradients (a table pushed twice: its parts summed)."""
        if not self.pushes:
            return
        keys = list(self.pushes)
        values = [parts[0] if len(parts) == 1 else parts for parts in self.pushes.values()]
        _sync_learning_rates(self.kv)
        with store_lock(self.kv):
            self.kv.push(keys, values, wait=self.wait)


@contextlib.contextmanager
def push_together(kv, wait: bool = True):
    """Within the block, the modules' backward pushes to kv go out as one push at its end.

    A step's tables then cost one request per server instead of one per table
    (the DeepFM example's two tables, 4 exchanges a step -> 2 with
    `prefetch_together`). A table pushed twice in the block (a module called
    twice) gets one push of the summed gradients. If the block raises, nothing
    is pushed. On a synchronous store every worker must use the same blocks.
    Blocks do not nest; one store's block is open in one thread at a time.

    wait=False: the block ends once the push is sent (``kv.push(...,
    wait=False)``); the servers' acknowledgements are collected by the
    store's next call, typically the `prefetch` of the next batch, which then
    pulls rows that include this push. The training thread no longer waits
    for them (about 0.8 ms a step of the MovieLens DeepFM). A failure the
    servers report (a worker that left, a server gone) is then raised by
    that next call: with a prefetch, by the next forward.

    Raises:
        kvsparse.errors.InvalidArgument: a block for kv is already open, or a
            table without optimizer (raised in the backward, as without the block).
        what `kv.push` raises, at the end of the block.

    Example:
        >>> with push_together(kv, wait=False):
        ...     loss.backward()  # both tables' gradients: one request per server
        >>> model.prefetch(next_ids)  # collects the push's acknowledgements, then pulls
    """
    batch = _PushBatch(kv, wait)
    batch.open()
    try:
        yield
    except BaseException:
        batch.close()
        raise
    batch.close()
    batch.send()


def prefetch_together(modules, ids) -> None:
    """Starts one background pull of the next batch's rows for several modules at once.

    As each module's `prefetch(ids)`, but their tables go out in one request
    per server. `ids` is one tensor for every module, or one per
    module. The modules must share one store.

    Raises:
        kvsparse.errors.InvalidArgument: no modules, modules of different
            stores, or a different number of ids tensors than modules.
        kvsparse.errors.DTypeError: non-integer ids.

    Example:
        >>> loss.backward()
        >>> prefetch_together([model.first_order, model.embedding], next_ids)
    """
    _prefetch_together(*_lookups_and_ids("prefetch_together", modules, ids))


class _TableModule(nn.Module):
    def __init__(self, kv, key, embedding_dim, padding_idx, options: TableOptions):
        super().__init__()
        dim = options.ensure(kv, key, embedding_dim)
        if padding_idx is not None:
            padding_idx = int(padding_idx)
        self.key = key
        self.embedding_dim = dim
        self.padding_idx = padding_idx
        # Not a submodule or buffer: the store travels with the module, no table does.
        self._lookup = _Lookup(kv, key, dim, padding_idx, torch_dtype(kv, key))
        # The table is not an nn.Parameter, so nn.Module.requires_grad_ cannot reach it:
        # the module keeps the flag itself (see `requires_grad`).
        self._requires_grad = True

    @property
    def requires_grad(self) -> bool:
        """Whether backward pushes the table's gradients (False: a frozen table).

        A frozen module (``requires_grad = False``, ``requires_grad_(False)``)
        and a module in eval mode (``eval()``) only look rows up: their output
        does not require grad, and backward pushes nothing to the store, so the
        table's rows, slots and steps stay as they are while the layers around
        it train. Freeze a table on every worker alike (a synchronous push waits
        for the workers that push the table).
        """
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self._requires_grad = bool(value)

    def requires_grad_(self, requires_grad: bool = True):
        """As nn.Module.requires_grad_, and sets `requires_grad` for the table: False
        freezes it (backward pushes nothing). Returns self.

        Example:
            >>> model.embedding.requires_grad_(False)  # fine-tune the rest only
        """
        super().requires_grad_(requires_grad)
        self._requires_grad = bool(requires_grad)
        return self

    @property
    def trains_table(self) -> bool:
        """Whether a forward now records the pull for a push on backward: in training
        mode, not frozen, with grad enabled."""
        return self.training and self._requires_grad and torch.is_grad_enabled()

    @property
    def kv(self):
        """The store holding the table (None in a layer unpickled and not bound yet)."""
        return self._lookup.kv

    def bind(self, kv):
        """Binds this layer to the table `key` on kv; returns the layer.

        For a layer unpickled by ``torch.load`` of a whole saved model (the
        pickle keeps the key, width and padding, not the store: the rows are
        on the servers, saved with ``kv.save``). `bind` (module function)
        binds every kvsparse layer of a model. Not thread-safe with the
        layer's own forward.

        Raises:
            UnknownKey: kv has no table `key`.
            ShapeError: its rows are not embedding_dim wide.

        Example:
            >>> model = torch.load("model.pt", weights_only=False)  # doctest: +SKIP
            >>> model.embedding.bind(kv)                            # doctest: +SKIP
        """
        info = kv.key_info(self.key)
        if not info.sparse or info.dim != self.embedding_dim:
            raise errors.ShapeError(
                f"key {self.key!r} on this store is not a sparse table of width "
                f"{self.embedding_dim}, which this {type(self).__name__} was saved with"
            )
        dtype = torch_dtype(kv, self.key)
        self._lookup = _Lookup(kv, self.key, self.embedding_dim, self.padding_idx, dtype)
        return self

    def _bound(self) -> _Lookup:
        """The lookup, refusing a layer unpickled without its store (InvalidArgument)."""
        if self._lookup.kv is None:
            raise errors.InvalidArgument(
                f"this {type(self).__name__} (key {self.key!r}) was loaded without its store "
                "(torch.load of a saved model): call layer.bind(kv), or "
                "kvsparse.adapters.torch.bind(model, kv), before using it"
            )
        return self._lookup

    @property
    def prefetch_hits(self) -> int:
        """How many forwards used a prefetched pull."""
        return self._lookup.prefetch_hits

    @property
    def prefetch_misses(self) -> int:
        """How many prefetched pulls were thrown away (the ids differed)."""
        return self._lookup.prefetch_misses

    # torch.compile runs this part eagerly (a graph break): the store is called
    # from Python, with NumPy views dynamo cannot trace; the layers around it compile.
    @torch.compiler.disable
    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.trains_table:
            anchor = torch.empty(0, requires_grad=True)
            return _SparseRows.apply(anchor, self._bound(), ids)
        return self._bound().rows_for(ids)

    @torch.compiler.disable
    def prefetch(self, ids: torch.Tensor) -> None:
        """Starts pulling the rows of the next batch's ids on a background thread.

        The next forward uses those rows if its ids are equal to `ids` (same
        shape and values); otherwise it pulls again. The rows are the table as
        it is when the pull runs: call prefetch after this step's backward for
        rows that include this step's update (before it, ids shared by both
        batches see the table one step stale). An error of the background pull
        is raised by the next forward (or prefetch), never in the thread.
        """
        self._bound().prefetch(self._flat_ids(_check_ids(ids)))

    @torch.compiler.disable
    def warm(self, ids: torch.Tensor) -> None:
        """Tells the servers now that the next batch pulls the rows of ids (`warm_together`)."""
        _warm_together([self._bound()], [self._flat_ids(_check_ids(ids))])

    @property
    def warmed_rows(self) -> int:
        """Rows the servers read from disk for this module's `warm` calls (counted by the
        prefetch that follows each)."""
        return self._lookup.warmed_rows

    def _flat_ids(self, ids):
        return ids

    def extra_repr(self) -> str:
        text = f"key={self.key!r}, embedding_dim={self.embedding_dim}"
        if self.padding_idx is not None:
            text += f", padding_idx={self.padding_idx}"
        return text


class Embedding(_TableModule):
    """Like torch.nn.Embedding(sparse=True), with the table on a kvsparse store.

    Args:
        kv: a kvsparse.KVStore.
        key: the table's key; created on the store if missing.
        embedding_dim: row width (needed to create the table).
        padding_idx: an id whose output is all zeros and whose gradient is
            never pushed (nn.Embedding's padding row, never stored).
        dtype: the table's storage dtype when this creates it: torch.float32
            (default), torch.half or torch.bfloat16 (kvsparse.SparseTable's
            dtype; an existing table of another dtype is refused). Rows come
            out in the table's dtype, as nn.Embedding(dtype=...) gives them;
            gradients of any float dtype are pushed (summed in float32).
        initializer, optimizer, seed, partitioner, nonfinite: the table's
            settings (kvsparse.SparseTable) when this creates it. Give the
            table its optimizer here: it runs on the servers. A table with
            no optimizer (none here, none in SparseTable, no
            kv.set_optimizer) refuses the backward's push with
            InvalidArgument instead of replacing rows by gradients.

    forward(ids): ids is an integer tensor of any shape (int64 values of any
    size); returns the table's dtype, shape ids.shape + (embedding_dim,).

    Freezing: ``emb.requires_grad_(False)`` (or ``emb.requires_grad = False``)
    and ``emb.eval()`` make the module look rows up only; backward then pushes
    nothing and the table stays as it is (`requires_grad`). The table is no
    nn.Parameter: freeze the module itself, a parent's ``requires_grad_`` does
    not reach it (``eval()`` does).

    Threads: one module is not meant to run forward from several threads at
    once (its prefetch slot is its own); modules of one store may run in
    different threads, as every store call takes `store_lock(kv)`.

    Raises:
        kvsparse.errors.UnknownKey: no table and no embedding_dim.
        kvsparse.errors.DTypeError: non-integer ids.
        kvsparse.errors.InvalidArgument: on backward, the table has no optimizer.

    Example:
        >>> emb = Embedding(kv, 'item', embedding_dim=8,
        ...                 optimizer=kvsparse.optimizers.Adagrad(learning_rate=0.05))
        >>> loss = emb(torch.tensor([1, 2, 1])).pow(2).sum()
        >>> loss.backward()  # Adagrad updates rows 1 and 2 on the store
    """

    def __init__(
        self,
        kv,
        key,
        embedding_dim=None,
        *,
        padding_idx=None,
        initializer=None,
        optimizer=None,
        seed: int = 0,
        partitioner=None,
        nonfinite: str = "raise",
        dtype=None,
    ):
        options = TableOptions(initializer, optimizer, seed, partitioner, nonfinite, dtype)
        super().__init__(kv, key, embedding_dim, padding_idx, options)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._rows(_check_ids(ids))


class EmbeddingBag(_TableModule):
    """Like torch.nn.EmbeddingBag(sparse=True), with the table on a kvsparse store.

    Args:
        kv, key, embedding_dim, initializer, optimizer, seed, partitioner,
            nonfinite, dtype: as for `Embedding`.
        mode: 'sum', 'mean' or 'max' reduction of each bag.
        padding_idx: an id left out of every bag (and of a mean's count);
            its gradient is never pushed.
        include_last_offset: as nn.EmbeddingBag.

    forward(input, offsets=None, per_sample_weights=None): as
    nn.EmbeddingBag: `input` (batch, bag) holds fixed-length bags, or a 1-D
    `input` with the start `offsets` of each bag; `per_sample_weights` (same
    shape as input, mode 'sum' only) scales each row. Returns
    (batch, embedding_dim) in the table's dtype; an empty bag gives zeros.

    Threads: as `Embedding`.

    Example:
        >>> bag = EmbeddingBag(kv, 'genre', embedding_dim=8, mode='mean')
        >>> bag(torch.tensor([4, 5, 6]), offsets=torch.tensor([0, 2])).shape
        torch.Size([2, 8])
    """

    def __init__(
        self,
        kv,
        key,
        embedding_dim=None,
        mode: str = "mean",
        *,
        padding_idx=None,
        include_last_offset: bool = False,
        initializer=None,
        optimizer=None,
        seed: int = 0,
        partitioner=None,
        nonfinite: str = "raise",
        dtype=None,
    ):
        if mode not in _BAG_MODES:
            raise errors.InvalidArgument(f"mode must be one of {_BAG_MODES}, got {mode!r}")
        options = TableOptions(initializer, optimizer, seed, partitioner, nonfinite, dtype)
        super().__init__(kv, key, embedding_dim, padding_idx, options)
        self.mode = mode
        self.include_last_offset = include_last_offset

    def _flat_ids(self, ids):
        return ids.reshape(-1)

    def forward(self, input, offsets=None, per_sample_weights=None):  # noqa: A002 - torch's name
        ids = _check_ids(input)
        if ids.dim() == 2:
            if offsets is not None:
                raise errors.InvalidArgument("offsets must be None when input is 2-D")
        elif ids.dim() == 1:
            if offsets is None:
                raise errors.InvalidArgument("a 1-D input needs offsets")
        else:
            raise errors.ShapeError(f"input must be 1-D or 2-D, got shape {tuple(ids.shape)}")
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise errors.InvalidArgument("per_sample_weights needs mode='sum'")
            if per_sample_weights.shape != ids.shape:
                raise errors.ShapeError(
                    f"per_sample_weights must have the shape of input {tuple(ids.shape)}, "
                    f"got {tuple(per_sample_weights.shape)}"
                )
        flat = ids.reshape(-1)
        rows = self._rows(flat)
        # Reduce with torch's own kernel over the pulled rows: position i of
        # the batch looks up row i. Padding positions all point at the first
        # of them, which embedding_bag then leaves out as its padding row.
        positions = torch.arange(flat.numel(), device=rows.device)
        padding_position = None
        if self.padding_idx is not None:
            is_padding = (flat == self.padding_idx).to(rows.device)
            if bool(is_padding.any()):
                padding_position = int(torch.nonzero(is_padding)[0, 0])
                positions[is_padding] = padding_position
        return functional.embedding_bag(
            positions.view(ids.shape),
            rows,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
            padding_idx=padding_position,
        )


class DenseGradientSync:
    """Averages dense gradients over the workers through the store.

    MXNet's way: one dense key holds all the parameters, flattened. The store
    has no optimizer for it (give sparse tables their own optimizer; never
    call kv.set_optimizer), so in a synchronous step a push makes its value
    the sum of every worker's gradient and a pull reads that sum. Creating the
    object also makes every worker start from the same weights: the key is
    initialized with this worker's values (the store keeps one set: rank
    0's on a distributed store) and pulled back into the parameters.

    Args:
        kv: a kvsparse.KVStore.
        parameters: the dense parameters (e.g. model.parameters()); those not
            requiring grad are left out.
        key: the dense key to use (str, like the tables' keys).
        broadcast: pull the initial weights from the store (default True).

    Not safe to call from several threads at once (one flat buffer holds the
    gradients); its store calls take `store_lock(kv)`.

    Raises:
        kvsparse.errors.InvalidArgument: the store has a store-wide optimizer
            (it would run on this key), or no parameters.

    Example:
        >>> sync = DenseGradientSync(kv, model.parameters(), key='deepfm/dense')
        >>> loss.backward(); sync.synchronize(); dense_optimizer.step()
    """

    def __init__(self, kv, parameters, key: str = "dense", *, broadcast: bool = True):
        if kv.optimizer is not None:
            raise errors.InvalidArgument(
                "DenseGradientSync needs a store without a store-wide optimizer "
                "(kv.set_optimizer would treat the summed gradients as gradients to apply); "
                "give sparse tables their own optimizer with SparseTable(optimizer=...)"
            )
        self.kv = kv
        self.key = key
        self.parameters = [p for p in parameters if p.requires_grad]
        if not self.parameters:
            raise errors.InvalidArgument("DenseGradientSync got no parameters that require grad")
        self._sizes = [p.numel() for p in self.parameters]
        with torch.no_grad():
            values = torch.cat([p.detach().reshape(-1).cpu().float() for p in self.parameters])
        self._flat = values.contiguous()
        with store_lock(kv):
            if key not in kv:
                kv.init(key, self._flat)
            if broadcast:
                kv.pull(key, out=self._flat)
        if broadcast:
            self._scatter(into_grads=False)

    def _scatter(self, into_grads: bool) -> None:
        with torch.no_grad():
            for p, part in zip(self.parameters, torch.split(self._flat, self._sizes)):
                part = part.view(p.shape).to(device=p.device, dtype=p.dtype)
                if not into_grads:
                    p.copy_(part)
                elif p.grad is None:
                    p.grad = part.clone()
                else:
                    p.grad.copy_(part)

    def synchronize(self) -> None:
        """Replaces each parameter's .grad by the mean over all workers' .grad.

        Every worker must call it once per step (a parameter without a
        gradient counts as zeros). Call it after backward, before the dense
        optimizer's step.
        """
        if self.kv.num_workers == 1:
            # The mean over one worker is its own gradient: the push and pull would only
            # send it to the servers and back (2 of the 6 round trips of a MovieLens step,
            # benchmarks/end_to_end.py profile).
            with torch.no_grad():
                for p in self.parameters:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            return
        with torch.no_grad():
            offset = 0
            for p, size in zip(self.parameters, self._sizes):
                part = self._flat[offset : offset + size]
                if p.grad is None:
                    part.zero_()
                else:
                    part.copy_(p.grad.reshape(-1))
                offset += size
        with store_lock(self.kv):
            self.kv.push(self.key, self._flat)
            self.kv.pull(self.key, out=self._flat)
        if self.kv.num_workers > 1:
            self._flat.div_(self.kv.num_workers)
        self._scatter(into_grads=True)


def bind(model: nn.Module, kv) -> nn.Module:
    """Binds every kvsparse layer of model (Embedding, EmbeddingBag) to kv; returns model.

    What a model unpickled by ``torch.load`` needs before its first forward
    (see `Embedding.bind`). ``model.state_dict()`` holds the dense weights
    only: with ``kv.save``/``kv.load`` for the tables, that is the usual way
    to checkpoint; pickling the whole model works too, then this.

    Raises:
        what `Embedding.bind` raises.

    Example:
        >>> torch.save(model, "model.pt")                               # doctest: +SKIP
        >>> model = bind(torch.load("model.pt", weights_only=False), kv)  # doctest: +SKIP
    """
    for module in model.modules():
        if isinstance(module, _TableModule):
            module.bind(kv)
    return model


__all__ = [
    "DenseGradientSync",
    "bind",
    "Embedding",
    "EmbeddingBag",
    "LearningRateFollower",
    "ensure_table",
    "follow_learning_rate",
    "prefetch_together",
    "push_together",
    "store_lock",
    "warm_together",
]
