# The only bridge between Python and the C++ core in csrc/.
#
# Every call takes contiguous NumPy-compatible buffers (typed memoryviews,
# `const` so read-only inputs work), releases the GIL for the whole batch and
# turns a C++ Status into a kvsparse.errors exception in one place (_check).
from cython.operator cimport dereference as deref
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libcpp.memory cimport make_shared, shared_ptr, unique_ptr
from libcpp.string cimport string
from libcpp.vector cimport vector

import os

import numpy as np

from kvsparse import errors

from batch cimport (BatchPlan, FirstNonFiniteRow, GatherFromShards, Partitioner, PlanBatch,
                    SumRowsByIndex, UniqueWithInverse, ValidatePartitioner)
from half cimport (FirstNonFiniteHalfRow, GatherWidenFromShards, HalfKind, NarrowFloats,
                  UseHalfHardware, WidenHalves)
from initializer cimport InitializerConfig, InitializerKind, ValidateInitializer, kInitializerVersion
from optimizer cimport Optimizer as COptimizer
from optimizer cimport OptimizerConfig, OptimizerKind, StepMode, ValidateOptimizer
from status cimport Status, StatusCode
from table cimport EmbeddingTable, NonFinitePolicy, StorageType, TableConfig, kMaxDim
from table cimport MemoryBudget as CMemoryBudget, TierConfig, TierStats
from table cimport EvictionKind, PolicyConfig, PolicyStats, ValidatePolicy
from table cimport DiskCheckpointReader

MAX_DIM = kMaxDim
# Version of the initializer streams (the initial row each (seed, id) gets; see
# csrc/initializer.h). 1: kvsparse 0.1.0's; 2: Philox/float32, the default.
# Checkpoints record it so that a resumed table keeps its stream.
INITIALIZER_VERSION = kInitializerVersion

_INITIALIZER_KINDS = {
    "zeros": InitializerKind.kZeros,
    "constant": InitializerKind.kConstant,
    "uniform": InitializerKind.kUniform,
    "normal": InitializerKind.kNormal,
    "truncated_normal": InitializerKind.kTruncatedNormal,
}

_OPTIMIZER_KINDS = {
    None: OptimizerKind.kNone,
    "none": OptimizerKind.kNone,
    "sgd": OptimizerKind.kSgd,
    "adagrad": OptimizerKind.kAdagrad,
    "adam": OptimizerKind.kAdam,
    "adamw": OptimizerKind.kAdamW,
    "ftrl": OptimizerKind.kFtrl,
    "rmsprop": OptimizerKind.kRmsProp,
}

_OPTIMIZER_FIELDS = (
    "learning_rate", "weight_decay", "rescale_grad", "clip_gradient", "momentum", "nesterov",
    "lr_decay", "epsilon", "initial_accumulator_value", "beta1", "beta2", "lr_power", "l1",
    "l2", "beta", "alpha", "centered", "step_mode", "kind", "formula",
    # A float32 master copy of 16-bit rows (the table) and dense keys (the shard).
    "multi_precision",
)


cdef int _check(const Status& c_status) except -1:
    """Raises the kvsparse.errors class for a failed C++ Status."""
    if c_status.ok():
        return 0
    message = c_status.message().decode("utf-8", "replace")
    code = c_status.code()
    if code == StatusCode.kInvalidArgument:
        raise errors.InvalidArgument(message)
    if code == StatusCode.kNonFinite:
        raise errors.NonFiniteGradient(message)
    if code == StatusCode.kOutOfMemory:
        raise MemoryError(message)
    if code == StatusCode.kCapacity:
        raise errors.CapacityError(message)
    if code == StatusCode.kOverflow:
        raise errors.UpdateOverflow(message)
    if code == StatusCode.kLimitExceeded:
        raise errors.LimitExceeded(message)
    if code == StatusCode.kCorruption:
        raise errors.CorruptRecord(message)
    if code == StatusCode.kDiskFull:
        raise errors.DiskFull(message)
    if code == StatusCode.kIoError:
        raise errors.StorageError(message)
    raise errors.KVSparseError(message)


cdef InitializerConfig _initializer_config(dict spec, uint64_t seed) except *:
    cdef InitializerConfig c_config
    kind = spec.get("kind", "zeros")
    if kind not in _INITIALIZER_KINDS:
        raise errors.InvalidArgument(f"unknown initializer kind {kind!r}")
    c_config.kind = _INITIALIZER_KINDS[kind]
    c_config.a = float(spec.get("a", 0.0))
    c_config.b = float(spec.get("b", 0.0))
    c_config.seed = seed
    c_config.version = int(spec.get("version", kInitializerVersion))
    _check(ValidateInitializer(c_config))
    return c_config


cdef OptimizerConfig _optimizer_config(spec) except *:
    cdef OptimizerConfig c_config
    if spec is None:
        spec = {}
    unknown = set(spec) - set(_OPTIMIZER_FIELDS)
    if unknown:
        raise errors.InvalidArgument(f"unknown optimizer settings {sorted(unknown)}")
    kind = spec.get("kind")
    if kind not in _OPTIMIZER_KINDS:
        raise errors.InvalidArgument(f"unknown optimizer {kind!r}")
    c_config.kind = _OPTIMIZER_KINDS[kind]
    if "learning_rate" in spec: c_config.learning_rate = spec["learning_rate"]
    if "weight_decay" in spec: c_config.weight_decay = spec["weight_decay"]
    if "rescale_grad" in spec: c_config.rescale_grad = spec["rescale_grad"]
    if "clip_gradient" in spec:
        c_config.clip_gradient = -1.0 if spec["clip_gradient"] is None else spec["clip_gradient"]
    if "momentum" in spec: c_config.momentum = spec["momentum"]
    if "nesterov" in spec: c_config.nesterov = bool(spec["nesterov"])
    if "lr_decay" in spec: c_config.lr_decay = spec["lr_decay"]
    if "epsilon" in spec: c_config.epsilon = spec["epsilon"]
    if "initial_accumulator_value" in spec:
        c_config.initial_accumulator_value = spec["initial_accumulator_value"]
    if "beta1" in spec: c_config.beta1 = spec["beta1"]
    if "beta2" in spec: c_config.beta2 = spec["beta2"]
    if "lr_power" in spec: c_config.lr_power = spec["lr_power"]
    if "l1" in spec: c_config.l1 = spec["l1"]
    if "l2" in spec: c_config.l2 = spec["l2"]
    if "beta" in spec: c_config.beta = spec["beta"]
    if "alpha" in spec: c_config.alpha = spec["alpha"]
    if "centered" in spec: c_config.centered = bool(spec["centered"])
    step_mode = spec.get("step_mode", "row")
    if step_mode == "row":
        c_config.step_mode = StepMode.kPerRow
    elif step_mode == "table":
        c_config.step_mode = StepMode.kPerTable
    else:
        raise errors.InvalidArgument(f"step_mode must be 'row' or 'table', got {step_mode!r}")
    formula = spec.get("formula", "torch")
    if formula not in ("torch", "mxnet"):
        raise errors.InvalidArgument(f"formula must be 'torch' or 'mxnet', got {formula!r}")
    c_config.mxnet_formula = formula == "mxnet"
    c_config.multi_precision = bool(spec.get("multi_precision", False))
    _check(ValidateOptimizer(c_config))
    return c_config


_POLICY_FIELDS = ("min_count", "ttl_steps", "max_rows", "eviction", "evict_every")


cdef PolicyConfig _policy_config(policy) except *:
    """Admission/eviction settings (see kvsparse.SparseTable); None means none."""
    cdef PolicyConfig c_config
    if not policy:
        return c_config
    unknown = set(policy) - set(_POLICY_FIELDS)
    if unknown:
        raise errors.InvalidArgument(f"unknown policy settings {sorted(unknown)}")
    c_config.min_count = int(policy.get("min_count") or 1)
    c_config.ttl_steps = int(policy.get("ttl_steps") or 0)
    c_config.max_rows = int(policy.get("max_rows") or 0)
    c_config.evict_every = int(policy.get("evict_every") or 0)
    eviction = policy.get("eviction", "lfu")
    if eviction == "lfu":
        c_config.eviction = EvictionKind.kLfu
    elif eviction == "lru":
        c_config.eviction = EvictionKind.kLru
    else:
        raise errors.InvalidArgument(f"eviction must be 'lfu' or 'lru', got {eviction!r}")
    _check(ValidatePolicy(c_config))
    return c_config


cdef object _arg(obj, dtype, int ndim, str name, bint output=False):
    """obj as a C-contiguous ndarray of dtype and ndim, or a kvsparse error naming it.

    Inputs that are not contiguous or not aligned are copied; outputs must be
    contiguous, aligned and writable, since a copy would silently drop the results.
    """
    if not isinstance(obj, np.ndarray):
        if output:
            raise errors.DTypeError(f"{name} must be a NumPy array, got {type(obj).__name__}")
        obj = np.asarray(obj)
    if obj.dtype != dtype:
        raise errors.DTypeError(f"{name} must have dtype {np.dtype(dtype).name}, got {obj.dtype}")
    if obj.ndim != ndim:
        raise errors.ShapeError(f"{name} must be {ndim}-D, got shape {obj.shape}")
    if not obj.flags.c_contiguous:
        if output:
            raise errors.ShapeError(f"{name} must be C-contiguous")
        obj = np.ascontiguousarray(obj)
    if not obj.flags.aligned:
        # The core reads and writes the elements in place, and a misaligned int64 or float
        # is undefined behaviour in C++ (np.frombuffer at an odd offset makes one).
        if output:
            raise errors.InvalidArgument(f"{name} is not aligned to its dtype")
        obj = obj.copy()
    if output and not obj.flags.writeable:
        raise errors.InvalidArgument(f"{name} is read-only")
    return obj


_STORAGE_TYPES = {
    "float32": StorageType.kFloat32,
    "float16": StorageType.kFloat16,
    "bfloat16": StorageType.kBFloat16,
}


cdef StorageType _storage_type(dtype, str what) except *:
    kind = _STORAGE_TYPES.get(dtype) if isinstance(dtype, str) else None
    if kind is None:
        raise errors.InvalidArgument(
            f"{what} must be 'float32', 'float16' or 'bfloat16', got {dtype!r}")
    return kind


def _rows_out(out, int64_t n, int64_t dim):
    if out is None:
        return np.empty((n, dim), dtype=np.float32)
    return _arg(out, np.float32, 2, "out", output=True)


cdef class MemoryBudget:
    """The bytes one shard's tables may hold together (csrc/disk_tier.h).

    One per shard (a server, a local store), given to each of its Tables. A table
    reports what it holds after every operation: index, rows, slots, scratch and
    its disk tier's in-memory index. Thread-safe.

    Example:
        >>> budget = MemoryBudget(64 << 20)
        >>> t = Table(4, budget=budget)
        >>> budget.limit, 0 < budget.used() < budget.limit
        (67108864, True)
    """

    cdef shared_ptr[CMemoryBudget] c_budget

    def __cinit__(self, int64_t limit):
        if limit <= 0:
            raise errors.InvalidArgument(f"a memory budget must be a positive byte count, got {limit}")
        self.c_budget = make_shared[CMemoryBudget](limit)

    @property
    def limit(self):
        return self.c_budget.get().limit()

    def used(self):
        """Bytes the shard's tables (and set_other_bytes) hold now."""
        return self.c_budget.get().Used()

    def set_other_bytes(self, int64_t nbytes):
        """Memory the shard holds outside its tables (dense keys), counted in the budget."""
        self.c_budget.get().Report(<void*>self, nbytes)


cdef class Table:
    """One shard's embedding table: int64 id -> float32 row (+ optimizer slots).

    Args:
        dim: row width, 1..4096.
        initializer: dict with "kind" (zeros, constant, uniform, normal,
            truncated_normal), parameters "a", "b" and optionally the stream
            "version" (1 or INITIALIZER_VERSION, the default; see
            csrc/initializer.h).
        optimizer: dict as produced by kvsparse.optimizers.*.to_dict(), or
            None for "a push replaces the row".
        seed: the table seed of the deterministic initializer.
        policy: admission/eviction settings (kvsparse.table.policy_of), or None.
        dtype: how values are stored: 'float32' (default), 'float16' or
            'bfloat16'. The interface stays float32: 16-bit rows are widened
            exactly when read, updated in float32 and rounded to nearest, ties
            to even, once per write.
        slot_dtype: how optimizer slots are stored (same choices); None: float32.
        budget: the shard's MemoryBudget, or None (no limit).
        spill_dir: with a budget, a directory of this table's own for the rows that do
            not fit (emptied now, removed with the table); None: an insert past the
            budget raises LimitExceeded.
        name: the table's name, for messages.
        concurrent_lookups: lookups may run on several threads at once (a serving
            replica): they read disk rows through instead of bringing them back into
            memory, and the table gives no memory to the budget's other tables.

    Raises:
        kvsparse.errors.InvalidArgument: a bad dim, initializer, optimizer or dtype.

    Example:
        >>> t = Table(4, {"kind": "constant", "a": 1.0}, {"kind": "sgd", "learning_rate": 0.5})
        >>> t.apply_gradients(np.array([7], np.int64), np.ones((1, 4), np.float32))
        1
        >>> t.lookup(np.array([7], np.int64))[0, 0]
        0.5
    """

    cdef unique_ptr[EmbeddingTable] c_table
    cdef int64_t c_dim
    cdef readonly str dtype
    cdef readonly str slot_dtype

    cdef EmbeddingTable* _table(self) except NULL:
        # __cinit__ builds the C++ table or raises, so every Table has one: Table.__new__
        # runs __cinit__ too (when it was built in __init__, a Table.__new__(Table) had none
        # and len() segfaulted). Kept as a cheap guard.
        if self.c_table.get() == NULL:
            raise errors.InvalidArgument(
                "this Table was not initialized: create it as Table(dim, ...)"
            )
        return self.c_table.get()

    def __cinit__(self, int64_t dim, dict initializer=None, optimizer=None, uint64_t seed=0,
                  dict policy=None, str dtype="float32", slot_dtype=None,
                  MemoryBudget budget=None, spill_dir=None, str name="",
                  bint concurrent_lookups=False):
        cdef TableConfig c_config
        cdef TierConfig c_tier
        if dim < 1 or dim > kMaxDim:
            raise errors.InvalidArgument(f"dim must be in [1, {kMaxDim}], got {dim}")
        slot_dtype = "float32" if slot_dtype is None else slot_dtype
        c_config.value_type = _storage_type(dtype, "dtype")
        c_config.slot_type = _storage_type(slot_dtype, "slot_dtype")
        self.dtype = dtype
        self.slot_dtype = slot_dtype
        c_config.dim = dim
        c_config.initializer = _initializer_config(initializer or {"kind": "zeros"}, seed)
        c_config.optimizer = _optimizer_config(optimizer)
        c_config.policy = _policy_config(policy)
        _check(EmbeddingTable.Create(c_config, &self.c_table))
        self.c_dim = dim
        if spill_dir is not None and budget is None:
            raise errors.InvalidArgument("a spill directory needs a memory budget")
        if budget is not None:
            c_tier.budget = budget.c_budget
            c_tier.spill_dir = os.fsencode(spill_dir) if spill_dir is not None else b""
            c_tier.name = name.encode()
            c_tier.concurrent_lookups = concurrent_lookups
            _check(self.c_table.get().EnableTier(c_tier))

    def tier_stats(self):
        """What the table's tiers hold and did: rows in memory and on disk, bytes, hits.

        Keys: memory_budget (0: none), rows_in_memory, rows_on_disk, memory_bytes (the
        disk index included), disk_bytes, disk_index_bytes, row_lookups (ids named that
        the table stores), disk_hits (of those, on disk), rows_read (brought back),
        evictions (moved to disk), disk_reads (read calls: one page per row looked
        up, plus the filters' false positives), bytes_read, bytes_written, bytes_updated,
        gc_segments_freed, gc_bytes_moved (idle_bytes_moved of it in a server's idle
        time), compactions.
        """
        cdef EmbeddingTable* c_table = self._table()
        cdef TierStats c = c_table.tier_stats()
        return {
            "memory_budget": c.memory_budget, "rows_in_memory": c.rows_in_memory,
            "rows_on_disk": c.rows_on_disk, "memory_bytes": c.memory_bytes,
            "disk_bytes": c.disk_bytes, "disk_index_bytes": c.disk_index_bytes,
            "row_lookups": c.row_lookups, "disk_hits": c.disk_hits, "rows_read": c.rows_read,
            "evictions": c.evictions, "disk_reads": c.disk_reads, "bytes_read": c.bytes_read,
            "bytes_written": c.bytes_written, "bytes_updated": c.bytes_updated,
            "gc_segments_freed": c.gc_segments_freed, "gc_bytes_moved": c.gc_bytes_moved,
            "idle_bytes_moved": c.idle_bytes_moved,
            "compactions": c.compactions,
        }

    @property
    def dim(self):
        return self.c_dim

    @property
    def num_slots(self):
        cdef EmbeddingTable* c_table = self._table()
        return c_table.num_slots()

    @property
    def table_step(self):
        cdef EmbeddingTable* c_table = self._table()
        return c_table.table_step()

    @table_step.setter
    def table_step(self, int64_t step):
        cdef EmbeddingTable* c_table = self._table()
        c_table.set_table_step(step)

    def __len__(self):
        cdef EmbeddingTable* c_table = self._table()
        return c_table.Size()

    def size(self):
        """Number of rows stored."""
        cdef EmbeddingTable* c_table = self._table()
        return c_table.Size()

    def memory_bytes(self):
        """Bytes held by this table (buckets, rows, slots, step counters, push scratch)."""
        cdef EmbeddingTable* c_table = self._table()
        return c_table.MemoryBytes()

    def prefault_ahead(self, int64_t max_bytes):
        """One slice of a server's idle-time work (EmbeddingTable::PrefaultAhead): backs
        up to max_bytes of the rows the next inserts will write with memory. Returns
        whether it did any; changes no row."""
        cdef EmbeddingTable* c_table = self._table()
        cdef bint done
        with nogil:
            done = c_table.PrefaultAhead(max_bytes)
        return bool(done)

    def idle_maintenance(self, int64_t max_bytes):
        """One slice of a server's idle-time work (EmbeddingTable::IdleMaintenance): a
        step of the disk tier's merges, about max_bytes. Returns whether it did any.
        While it is called, operations leave their merges to it (0: only says so)."""
        cdef EmbeddingTable* c_table = self._table()
        cdef bint done
        with nogil:
            done = c_table.IdleMaintenance(max_bytes)
        return bool(done)

    def scratch_bytes(self):
        """The part of memory_bytes() that pushes reuse as scratch (sized by the largest push)."""
        cdef EmbeddingTable* c_table = self._table()
        return c_table.ScratchBytes()

    def set_optimizer(self, optimizer):
        """Replaces the optimizer; every row's slots restart from their initial values."""
        cdef EmbeddingTable* c_table = self._table()
        cdef OptimizerConfig c_config = _optimizer_config(optimizer)
        _check(c_table.SetOptimizer(c_config))

    def set_learning_rate(self, double learning_rate):
        """Changes only the optimizer's learning rate: slots, steps and rows stay.

        Raises:
            kvsparse.errors.InvalidArgument: a rate the optimizer refuses (not
                finite, negative; FTRL: not positive); the table is unchanged.
        """
        cdef EmbeddingTable* c_table = self._table()
        _check(c_table.SetLearningRate(learning_rate))

    cdef _check_rows(self, const float[:, ::1] rows, int64_t n, str what):
        if rows.shape[0] != n or rows.shape[1] != self.c_dim:
            raise errors.ShapeError(
                f"{what} must have shape ({n}, {self.c_dim}), got "
                f"({rows.shape[0]}, {rows.shape[1]})")

    def lookup(self, keys_arg, out=None):
        """Rows of keys into out (n x dim); missing ids get their initial value, not stored."""
        cdef EmbeddingTable* c_table = self._table()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef int64_t c_n = keys.shape[0]
        out = _rows_out(out, c_n, self.c_dim)
        cdef float[:, ::1] c_out = out
        self._check_rows(c_out, c_n, "out")
        cdef Status c_status
        with nogil:
            c_status = c_table.Lookup(&keys[0] if c_n else NULL, c_n,
                                                  &c_out[0, 0] if c_n else NULL)
        _check(c_status)
        return out

    def prefetch_rows(self, keys_arg):
        """Brings the rows of keys that are on disk into memory now; returns how many.

        For a pull or push that will name them soon (the next batch's ids sent
        ahead): it then finds them in memory. Changes no row (values, slots,
        steps and stamps stay); ids stored nowhere are not inserted. 0 on a
        table with no rows on disk.

        Raises:
            kvsparse.errors.LimitExceeded: the rows do not fit the memory budget
                (nothing moved); CorruptRecord, StorageError: as a lookup.

        Example:
            >>> table.prefetch_rows(np.array([3, 7], np.int64))  # doctest: +SKIP
            2
        """
        cdef EmbeddingTable* c_table = self._table()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef int64_t c_n = keys.shape[0]
        cdef int64_t c_read = 0
        cdef Status c_status
        with nogil:
            c_status = c_table.PrefetchRows(&keys[0] if c_n else NULL, c_n, &c_read)
        _check(c_status)
        return c_read

    def lookup_or_insert(self, keys_arg, out=None):
        """Like lookup, but missing ids are inserted with their initial value."""
        cdef EmbeddingTable* c_table = self._table()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef int64_t c_n = keys.shape[0]
        out = _rows_out(out, c_n, self.c_dim)
        cdef float[:, ::1] c_out = out
        self._check_rows(c_out, c_n, "out")
        cdef Status c_status
        with nogil:
            c_status = c_table.LookupOrInsert(&keys[0] if c_n else NULL, c_n,
                                                          &c_out[0, 0] if c_n else NULL)
        _check(c_status)
        return out

    def initial_values(self, keys_arg, out=None):
        """The initial rows of keys, without touching the table."""
        cdef EmbeddingTable* c_table = self._table()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef int64_t c_n = keys.shape[0]
        out = _rows_out(out, c_n, self.c_dim)
        cdef float[:, ::1] c_out = out
        self._check_rows(c_out, c_n, "out")
        if c_n:
            with nogil:
                c_table.InitialValues(&keys[0], c_n, &c_out[0, 0])
        return out

    def apply_gradients(self, keys_arg, grads_arg,
                        bint skip_nonfinite=False):
        """Applies the optimizer to the rows of keys (duplicates summed first).

        Returns the number of distinct rows updated. Raises NonFiniteGradient
        (and changes nothing) on a NaN/inf unless skip_nonfinite, which leaves
        such rows untouched instead.
        """
        cdef EmbeddingTable* c_table = self._table()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef const float[:, ::1] grads = _arg(grads_arg, np.float32, 2, "grads")
        cdef int64_t c_n = keys.shape[0]
        self._check_rows(grads, c_n, "gradients")
        cdef int64_t c_applied = 0
        cdef Status c_status
        cdef NonFinitePolicy c_policy = (NonFinitePolicy.kSkip if skip_nonfinite
                                         else NonFinitePolicy.kReject)
        if c_n == 0:
            return 0
        with nogil:
            c_status = c_table.ApplyGradients(&keys[0], c_n, &grads[0, 0], c_policy,
                                                          &c_applied)
        _check(c_status)
        return c_applied

    def begin_push(self, keys_arg, grads_arg, bint skip_nonfinite=False):
        """First half of apply_gradients: checks the push and updates the stored rows.

        Raises what apply_gradients raises, and then changes nothing. After
        it, finish_push() applies the rest or cancel_push() puts every row
        back; nothing else may touch the table in between. One request's
        pushes to several tables are applied all or nothing this way (issue
        11): begin each, cancel the begun ones if one fails, else finish all.

        Example:
            >>> t = Table(1, {"kind": "zeros"}, {"kind": "sgd", "learning_rate": 1.0})
            >>> t.begin_push(np.array([3], np.int64), np.ones((1, 1), np.float32))
            >>> t.cancel_push(); len(t)
            0
        """
        cdef EmbeddingTable* c_table = self._table()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef const float[:, ::1] grads = _arg(grads_arg, np.float32, 2, "grads")
        cdef int64_t c_n = keys.shape[0]
        self._check_rows(grads, c_n, "gradients")
        cdef Status c_status
        cdef NonFinitePolicy c_policy = (NonFinitePolicy.kSkip if skip_nonfinite
                                         else NonFinitePolicy.kReject)
        cdef const int64_t* c_keys = &keys[0] if c_n else NULL
        cdef const float* c_grads = &grads[0, 0] if c_n else NULL
        with nogil:
            c_status = c_table.BeginPush(c_keys, c_n, c_grads, c_policy)
        _check(c_status)

    def finish_push(self):
        """Second half of apply_gradients (after begin_push): returns the rows updated.

        Raises MemoryError (and puts this table back) only for lack of memory.
        """
        cdef EmbeddingTable* c_table = self._table()
        cdef int64_t c_applied = 0
        cdef Status c_status
        with nogil:
            c_status = c_table.FinishPush(&c_applied)
        _check(c_status)
        return c_applied

    def cancel_push(self):
        """Puts back every row begin_push changed (no push begun: nothing)."""
        cdef EmbeddingTable* c_table = self._table()
        with nogil:
            c_table.CancelPush()

    def assign(self, keys_arg, values_arg):
        """Sets the rows of keys to values, inserting missing ids."""
        cdef EmbeddingTable* c_table = self._table()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef const float[:, ::1] values = _arg(values_arg, np.float32, 2, "values")
        cdef int64_t c_n = keys.shape[0]
        self._check_rows(values, c_n, "values")
        cdef Status c_status
        if c_n == 0:
            return
        with nogil:
            c_status = c_table.Assign(&keys[0], c_n, &values[0, 0])
        _check(c_status)

    def remove(self, keys_arg):
        """Removes the ids that exist; returns how many were removed."""
        cdef EmbeddingTable* c_table = self._table()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef int64_t c_n = keys.shape[0]
        cdef int64_t c_removed = 0
        if c_n:
            with nogil:
                c_removed = c_table.Remove(&keys[0], c_n)
        return c_removed

    def read_state(self, keys_arg):
        """(values n x dim, slots n x num_slots x dim, steps n) of existing ids."""
        cdef EmbeddingTable* c_table = self._table()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef int64_t c_n = keys.shape[0]
        cdef int c_slots = c_table.num_slots()
        values = np.empty((c_n, self.c_dim), np.float32)
        slots = np.empty((c_n, c_slots, self.c_dim), np.float32)
        steps = np.empty(c_n, np.int64)
        cdef float[:, ::1] c_values = values
        cdef float[:, :, ::1] c_slot_view = slots
        cdef int64_t[::1] c_steps = steps
        cdef float* c_slot_ptr = &c_slot_view[0, 0, 0] if (c_n and c_slots) else NULL
        cdef Status c_status
        if c_n:
            with nogil:
                c_status = c_table.ReadState(&keys[0], c_n, &c_values[0, 0],
                                                         c_slot_ptr, &c_steps[0])
            _check(c_status)
        return values, slots, steps

    def write_state(self, keys_arg, values_arg,
                    slots_arg, steps_arg):
        """Sets values, slots and step counters of ids (inserting them)."""
        cdef EmbeddingTable* c_table = self._table()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef const float[:, ::1] values = _arg(values_arg, np.float32, 2, "values")
        cdef const float[:, :, ::1] slots = _arg(slots_arg, np.float32, 3, "slots")
        cdef const int64_t[::1] steps = _arg(steps_arg, np.int64, 1, "steps")
        cdef int64_t c_n = keys.shape[0]
        cdef int c_slots = c_table.num_slots()
        self._check_rows(values, c_n, "values")
        if (slots.shape[0] != c_n or slots.shape[1] != c_slots or
                (c_slots and slots.shape[2] != self.c_dim)):
            raise errors.ShapeError(
                f"slots must have shape ({c_n}, {c_slots}, {self.c_dim}), got "
                f"({slots.shape[0]}, {slots.shape[1]}, {slots.shape[2]})")
        if steps.shape[0] != c_n:
            raise errors.ShapeError(f"steps must have {c_n} entries, got {steps.shape[0]}")
        cdef const float* c_slot_ptr = &slots[0, 0, 0] if (c_n and c_slots) else NULL
        cdef Status c_status
        if c_n:
            with nogil:
                c_status = c_table.WriteState(&keys[0], c_n, &values[0, 0],
                                                          c_slot_ptr, &steps[0])
            _check(c_status)

    def iter_chunks(self, int64_t chunk_rows=65536):
        """Yields (keys, values, slots, steps) chunks covering every row once.

        The table must not change while the iteration runs.
        """
        cdef EmbeddingTable* c_table = self._table()
        cdef int64_t c_cursor = 0
        cdef int64_t c_count
        buffer = np.empty(chunk_rows, np.int64)
        cdef int64_t[::1] c_buffer = buffer
        while True:
            with nogil:
                c_count = c_table.NextKeys(&c_cursor, chunk_rows, &c_buffer[0])
            if c_count == 0:
                _check(c_table.scan_status())
                return
            keys = buffer[:c_count].copy()
            values, slots, steps = self.read_state(keys)
            yield keys, values, slots, steps

    # -- change tracking for incremental checkpoints ----------------------------------------

    @property
    def change_epoch(self):
        """The epoch stamped on rows written now (starts at 1; a checkpoint advances it)."""
        cdef EmbeddingTable* c_table = self._table()
        return c_table.change_epoch()

    @change_epoch.setter
    def change_epoch(self, uint32_t epoch):
        cdef EmbeddingTable* c_table = self._table()
        c_table.set_change_epoch(epoch)

    def changed_keys(self, uint32_t since, int64_t chunk_rows=65536):
        """Yields arrays of the ids whose rows were written at an epoch > since.

        Example:
            >>> t = Table(2); t.assign([5], np.ones((1, 2), np.float32))
            >>> t.change_epoch = 2; t.assign([6], np.ones((1, 2), np.float32))
            >>> [k.tolist() for k in t.changed_keys(1)]
            [[6]]
        """
        cdef EmbeddingTable* c_table = self._table()
        cdef int64_t c_cursor = 0
        cdef int64_t c_count
        cdef uint32_t c_since = since
        buffer = np.empty(max(chunk_rows, 1), np.int64)
        cdef int64_t[::1] c_buffer = buffer
        while True:
            with nogil:
                c_count = c_table.NextChangedKeys(&c_cursor, chunk_rows, c_since,
                                                             &c_buffer[0])
            if c_count == 0:
                _check(c_table.scan_status())
                return
            yield buffer[:c_count].copy()

    def iter_state(self, uint32_t since=0, int64_t chunk_rows=65536, bint reuse=False,
                   bint memory_only=False):
        """Yields (keys, values, slots, steps) of the rows written at an epoch > since.

        since=0: every row. One scan of the map, rows copied as found (no
        probe per key). The table must not change while the iteration runs.
        reuse: every chunk is written into the same buffers (valid until the
        next one), which saves the page faults of fresh memory per chunk.
        memory_only: the rows in memory alone, not the disk tier's (a
        checkpoint that takes those by reference: link_disk_checkpoint).
        """
        cdef EmbeddingTable* c_table = self._table()
        cdef int64_t c_cursor = 0
        cdef int64_t c_count
        cdef uint32_t c_since = since
        cdef int c_slots = c_table.num_slots()
        cdef int64_t c_rows = max(chunk_rows, 1)
        cdef int64_t[::1] c_keys
        cdef float[:, ::1] c_values
        cdef float[:, :, ::1] c_slot_view
        cdef int64_t[::1] c_steps
        cdef float* c_slot_ptr
        keys = None
        while True:
            if keys is None or not reuse:
                keys = np.empty(c_rows, np.int64)
                values = np.empty((c_rows, self.c_dim), np.float32)
                slots = np.empty((c_rows, c_slots, self.c_dim), np.float32)
                steps = np.empty(c_rows, np.int64)
            c_keys, c_values, c_slot_view, c_steps = keys, values, slots, steps
            c_slot_ptr = &c_slot_view[0, 0, 0] if c_slots else NULL
            with nogil:
                c_count = c_table.NextChangedRows(
                    &c_cursor, c_rows, c_since, &c_keys[0], &c_values[0, 0], c_slot_ptr,
                    &c_steps[0], memory_only)
            if c_count == 0:
                _check(c_table.scan_status())
                return
            yield keys[:c_count], values[:c_count], slots[:c_count], steps[:c_count]

    # -- checkpoints by reference of the disk tier (csrc/table.h) -----------------------------

    @property
    def has_disk_store(self):
        """True if rows that do not fit the budget go to a disk tier (a spill directory)."""
        cdef EmbeddingTable* c_table = self._table()
        return c_table.HasDiskStore()

    def link_disk_checkpoint(self, directory):
        """Hard-links the disk tier's run files into directory (missing or empty).

        The first half of a checkpoint by reference, run by the process that owns the
        table right before the snapshot (fork) whose finish_disk_checkpoint completes it.
        Raises InvalidArgument without a disk tier, StorageError if a link fails (another
        file system among the causes).
        """
        cdef EmbeddingTable* c_table = self._table()
        cdef string c_dir = os.fsencode(directory)
        cdef Status c_status
        with nogil:
            c_status = c_table.LinkDiskCheckpoint(c_dir)
        _check(c_status)

    def finish_disk_checkpoint(self, directory):
        """Syncs the linked run files and writes directory's MANIFEST; returns the rows
        on disk it holds. The second half (in the snapshot)."""
        cdef EmbeddingTable* c_table = self._table()
        cdef string c_dir = os.fsencode(directory)
        cdef int64_t c_rows = 0
        cdef Status c_status
        with nogil:
            c_status = c_table.FinishDiskCheckpoint(c_dir, &c_rows)
        _check(c_status)
        return c_rows

    def adopt_disk_checkpoint(self, directory):
        """Makes a checkpoint by reference (finish_disk_checkpoint's directory) this empty
        table's disk tier without reading a row: its files are linked into the tier's own
        directory, so the checkpoint stays as it is.

        Raises InvalidArgument (no disk tier, a table not empty, records of another width),
        LimitExceeded (the index alone passes the budget), CorruptRecord (no or a damaged
        MANIFEST); the table is then as it was.
        """
        cdef EmbeddingTable* c_table = self._table()
        cdef string c_dir = os.fsencode(directory)
        cdef Status c_status
        with nogil:
            c_status = c_table.AdoptDiskCheckpoint(c_dir)
        _check(c_status)

    def removed_since(self, uint32_t since):
        """Ids removed at an epoch > since (oldest first; an id may repeat)."""
        cdef EmbeddingTable* c_table = self._table()
        cdef int64_t c_total = c_table.RemovedSince(since, NULL, 0)
        out = np.empty(c_total, np.int64)
        cdef int64_t[::1] c_out = out
        if c_total:
            c_table.RemovedSince(since, &c_out[0], c_total)
        return out

    def reserve(self, int64_t rows):
        """Grows the map to hold rows rows without rehashing (before a bulk load)."""
        cdef EmbeddingTable* c_table = self._table()
        cdef Status c_status
        with nogil:
            c_status = c_table.ReserveRows(rows)
        _check(c_status)

    def prune_removed(self, uint32_t through):
        """Forgets removals recorded at epochs <= through."""
        cdef EmbeddingTable* c_table = self._table()
        c_table.PruneRemoved(through)

    # -- admission and eviction (semantics in csrc/table.h) ---------------------------------

    def evict_expired(self):
        """Drops rows (and candidates) untouched for ttl_steps; returns the rows dropped.

        Example:
            >>> t = Table(1, policy={"ttl_steps": 1})
            >>> t.apply_gradients(np.array([3], np.int64), np.ones((1, 1), np.float32))
            1
            >>> t.advance_step(); t.evict_expired(), len(t)
            (1, 0)
        """
        cdef EmbeddingTable* c_table = self._table()
        cdef int64_t c_removed
        with nogil:
            c_removed = c_table.EvictExpired()
        return c_removed

    def advance_step(self):
        """Counts a push of the table that brought this shard no ids (may evict by TTL)."""
        cdef EmbeddingTable* c_table = self._table()
        with nogil:
            c_table.AdvanceStep()

    def policy_stats(self):
        """{"admissions", "evicted_ttl", "evicted_capacity", "rejected", "candidates"}."""
        cdef EmbeddingTable* c_table = self._table()
        cdef PolicyStats c_stats = c_table.policy_stats()
        return {
            "admissions": c_stats.admissions,
            "evicted_ttl": c_stats.evicted_ttl,
            "evicted_capacity": c_stats.evicted_capacity,
            "rejected": c_stats.rejected,
            "candidates": c_stats.candidates,
        }

    def candidates(self):
        """(keys, counts, last_steps), int64: the ids seen fewer than min_count times.

        For checkpoints (a restarted server that lost them would drop the push
        that admits an id); in no particular order.

        Example:
            >>> t = Table(1, policy={"min_count": 3})
            >>> t.apply_gradients(np.array([5], np.int64), np.ones((1, 1), np.float32))
            0
            >>> [a.tolist() for a in t.candidates()]
            [[5], [1], [1]]
        """
        cdef EmbeddingTable* c_table = self._table()
        cdef int64_t c_n = c_table.CandidateCount()
        keys = np.empty(c_n, np.int64)
        counts = np.empty(c_n, np.int64)
        last_steps = np.empty(c_n, np.int64)
        cdef int64_t[::1] c_keys = keys
        cdef int64_t[::1] c_counts = counts
        cdef int64_t[::1] c_steps = last_steps
        if c_n:
            with nogil:
                c_n = c_table.ReadCandidates(&c_keys[0], &c_counts[0], &c_steps[0], c_n)
        return keys[:c_n], counts[:c_n], last_steps[:c_n]

    def write_candidates(self, keys_arg, counts_arg, last_steps_arg):
        """Sets the sighting count and last step of ids (stored ids are skipped).

        Raises InvalidArgument (nothing written) for a count outside [1, 2^32)
        or a step outside [0, 2^32); ShapeError for arrays of other lengths.
        """
        cdef EmbeddingTable* c_table = self._table()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef const int64_t[::1] counts = _arg(counts_arg, np.int64, 1, "counts")
        cdef const int64_t[::1] steps = _arg(last_steps_arg, np.int64, 1, "last_steps")
        cdef int64_t c_n = keys.shape[0]
        if counts.shape[0] != c_n or steps.shape[0] != c_n:
            raise errors.ShapeError(
                f"counts and last_steps must have {c_n} entries, got {counts.shape[0]} "
                f"and {steps.shape[0]}")
        cdef Status c_status
        if c_n:
            with nogil:
                c_status = c_table.WriteCandidates(&keys[0], &counts[0], &steps[0], c_n)
            _check(c_status)

    @property
    def tracks_row_meta(self):
        """True if the policy keeps per-row touch counts or last steps (read_row_meta)."""
        cdef EmbeddingTable* c_table = self._table()
        return c_table.TracksRowMeta()

    def read_row_meta(self, keys_arg):
        """(touches, last_steps), int64, of stored ids: what eviction ranks rows by.

        Zeros where the policy keeps none. For checkpoints (so that a
        restarted server evicts the rows it would have evicted). Raises
        InvalidArgument for an id that is not stored.

        Example:
            >>> t = Table(1, policy={"ttl_steps": 5})
            >>> t.apply_gradients(np.array([4], np.int64), np.ones((1, 1), np.float32))
            1
            >>> [a.tolist() for a in t.read_row_meta(np.array([4], np.int64))]
            [[0], [1]]
        """
        cdef EmbeddingTable* c_table = self._table()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef int64_t c_n = keys.shape[0]
        touches = np.zeros(c_n, np.int64)
        last_steps = np.zeros(c_n, np.int64)
        cdef int64_t[::1] c_touches = touches
        cdef int64_t[::1] c_steps = last_steps
        cdef Status c_status
        if c_n:
            with nogil:
                c_status = c_table.ReadRowMeta(&keys[0], c_n, &c_touches[0], &c_steps[0])
            _check(c_status)
        return touches, last_steps

    def write_row_meta(self, keys_arg, touches_arg, last_steps_arg):
        """Sets the touch counts and last steps of stored ids (read_row_meta's form).

        Raises InvalidArgument (nothing written) for an id not stored or a
        value outside [0, 2^32); ShapeError for arrays of other lengths.
        """
        cdef EmbeddingTable* c_table = self._table()
        cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
        cdef const int64_t[::1] touches = _arg(touches_arg, np.int64, 1, "touches")
        cdef const int64_t[::1] steps = _arg(last_steps_arg, np.int64, 1, "last_steps")
        cdef int64_t c_n = keys.shape[0]
        if touches.shape[0] != c_n or steps.shape[0] != c_n:
            raise errors.ShapeError(
                f"touches and last_steps must have {c_n} entries, got {touches.shape[0]} "
                f"and {steps.shape[0]}")
        cdef Status c_status
        if c_n:
            with nogil:
                c_status = c_table.WriteRowMeta(&keys[0], c_n, &touches[0], &steps[0])
            _check(c_status)

    def clear_candidates(self):
        """Forgets every admission candidate (before a checkpoint's are written)."""
        cdef EmbeddingTable* c_table = self._table()
        c_table.ClearCandidates()


cdef class Optimizer:
    """The server optimizer applied to a flat span (a dense key's slice).

    Example:
        >>> opt = Optimizer({"kind": "sgd", "learning_rate": 0.1})
        >>> w = np.ones(3, np.float32); slots = opt.initial_slots(3)
        >>> opt.update(w, slots, np.ones(3, np.float32), step=1); w[0]
        0.9
    """

    cdef COptimizer* c_optimizer

    def __cinit__(self, spec):
        cdef OptimizerConfig c_config = _optimizer_config(spec)
        self.c_optimizer = new COptimizer(c_config)

    def __dealloc__(self):
        del self.c_optimizer

    @property
    def num_slots(self):
        return self.c_optimizer.num_slots()

    def initial_slots(self, int64_t n):
        """Slot arrays (num_slots x n) at their initial values."""
        slots = np.empty((self.c_optimizer.num_slots(), n), np.float32)
        cdef float[:, ::1] c_slots = slots
        if n and self.c_optimizer.num_slots():
            self.c_optimizer.InitSlots(&c_slots[0, 0], n)
        return slots

    def update(self, weights_arg, slots_arg, grad_arg,
               int64_t step):
        """Applies one step to weights in place (slots: num_slots x n)."""
        cdef float[::1] weights = _arg(weights_arg, np.float32, 1, "weights", output=True)
        cdef float[:, ::1] slots = _arg(slots_arg, np.float32, 2, "slots", output=True)
        cdef const float[::1] grad = _arg(grad_arg, np.float32, 1, "grad")
        cdef int64_t c_n = weights.shape[0]
        if grad.shape[0] != c_n:
            raise errors.ShapeError(f"gradient has {grad.shape[0]} values, weights have {c_n}")
        if slots.shape[0] != self.c_optimizer.num_slots() or (
                slots.shape[0] and slots.shape[1] != c_n):
            raise errors.ShapeError("slots do not match the optimizer and the weights")
        if c_n == 0:
            return
        scratch = np.empty(c_n, np.float32)
        cdef float[::1] c_scratch = scratch
        cdef float* c_slot_ptr = &slots[0, 0] if slots.shape[0] else NULL
        with nogil:
            self.c_optimizer.Update(&weights[0], c_slot_ptr, &grad[0], c_n, step,
                                    &c_scratch[0])


def unique_inverse(ids_arg):
    """(unique ids in order of first appearance, inverse) with ids == unique[inverse]."""
    cdef const int64_t[::1] ids = _arg(ids_arg, np.int64, 1, "ids")
    cdef int64_t c_n = ids.shape[0]
    cdef vector[int64_t] c_unique
    inverse = np.empty(c_n, np.int64)
    cdef int64_t[::1] c_inverse = inverse
    if c_n:
        with nogil:
            UniqueWithInverse(&ids[0], c_n, &c_unique, &c_inverse[0])
    unique = np.empty(c_unique.size(), np.int64)
    cdef int64_t[::1] c_unique_view = unique
    cdef size_t i
    for i in range(c_unique.size()):
        c_unique_view[i] = c_unique[i]
    return unique, inverse


cdef Partitioner _partitioner(int64_t num_shards, boundaries) except *:
    cdef Partitioner c_partitioner
    c_partitioner.num_shards = num_shards
    if boundaries is not None:
        for b in boundaries:
            c_partitioner.boundaries.push_back(b)
    _check(ValidatePartitioner(c_partitioner))
    return c_partitioner


def plan_batch(ids_arg, int64_t num_shards, boundaries=None):
    """Groups a batch of ids by shard.

    Returns (keys, offsets, slot): the unique ids grouped by shard (shard s
    gets keys[offsets[s]:offsets[s+1]]) and, per input position i, the index
    of ids[i] in keys.
    """
    cdef const int64_t[::1] ids = _arg(ids_arg, np.int64, 1, "ids")
    cdef Partitioner c_partitioner = _partitioner(num_shards, boundaries)
    cdef BatchPlan c_plan
    cdef int64_t c_n = ids.shape[0]
    # The slots are written straight into the returned array (a W1 batch: 512 KB).
    slot = np.empty(c_n, np.int64)
    cdef int64_t[::1] c_slot = slot
    with nogil:
        PlanBatch(&ids[0] if c_n else NULL, c_n, c_partitioner, &c_plan,
                  &c_slot[0] if c_n else NULL)
    keys = np.asarray(<int64_t[:c_plan.keys.size()]> c_plan.keys.data()).copy() \
        if c_plan.keys.size() else np.empty(0, np.int64)
    offsets = np.asarray(<int64_t[:c_plan.offsets.size()]> c_plan.offsets.data()).copy()
    return keys, offsets, slot


def shard_of(keys_arg, int64_t num_shards, boundaries=None):
    """Shard index of each key under hash (or range) partitioning."""
    cdef const int64_t[::1] keys = _arg(keys_arg, np.int64, 1, "keys")
    cdef Partitioner c_partitioner = _partitioner(num_shards, boundaries)
    cdef int64_t c_n = keys.shape[0]
    out = np.empty(c_n, np.int64)
    cdef int64_t[::1] c_out = out
    cdef int64_t i
    with nogil:
        for i in range(c_n):
            c_out[i] = c_partitioner.ShardOf(keys[i])
    return out


def sum_rows(rows_arg, index_arg, int64_t num_unique, out=None):
    """out[u] = sum of rows[i] with index[i] == u (num_unique x dim)."""
    return _sum_rows(rows_arg, index_arg, num_unique, out, False)[0]


def sum_rows_checked(rows_arg, index_arg, int64_t num_unique, out=None):
    """(sum_rows(...), the index of its first row holding a NaN or inf, or -1).

    The same as sum_rows then first_nonfinite_row, in about the time of sum_rows
    alone: the inputs are checked as they are added, and the sums are looked at
    only when one could have overflowed.
    """
    return _sum_rows(rows_arg, index_arg, num_unique, out, True)


cdef tuple _sum_rows(rows_arg, index_arg, int64_t num_unique, out, bint check):
    cdef const float[:, ::1] rows = _arg(rows_arg, np.float32, 2, "rows")
    cdef const int64_t[::1] index = _arg(index_arg, np.int64, 1, "index")
    cdef int64_t c_n = rows.shape[0]
    cdef int64_t c_dim = rows.shape[1]
    if index.shape[0] != c_n:
        raise errors.ShapeError(f"index has {index.shape[0]} entries, rows {c_n}")
    cdef int64_t i
    for i in range(c_n):
        if index[i] < 0 or index[i] >= num_unique:
            raise errors.InvalidArgument("index out of range")
    out = _rows_out(out, num_unique, c_dim)
    cdef float[:, ::1] c_out = out
    cdef bint c_maybe = False
    cdef int64_t c_bad = -1
    if num_unique and c_dim:
        with nogil:
            c_maybe = SumRowsByIndex(&rows[0, 0] if c_n else NULL, &index[0] if c_n else NULL,
                                     c_n, c_dim, num_unique, &c_out[0, 0])
            if check and c_maybe:
                c_bad = FirstNonFiniteRow(&c_out[0, 0], num_unique, c_dim)
    return out, c_bad


def first_nonfinite_row(rows_arg):
    """Index of the first row holding a NaN or inf, or -1."""
    cdef const float[:, ::1] rows = _arg(rows_arg, np.float32, 2, "rows")
    cdef int64_t c_n = rows.shape[0]
    cdef int64_t c_result = -1
    if c_n and rows.shape[1]:
        with nogil:
            c_result = FirstNonFiniteRow(&rows[0, 0], c_n, rows.shape[1])
    return c_result


def gather_from_shards(list shard_rows, offsets_arg, slot_arg,
                       out_arg):
    """out[i] = the reply row for slot[i]; shard_rows[s] holds shard s's rows."""
    cdef const int64_t[::1] offsets = _arg(offsets_arg, np.int64, 1, "offsets")
    cdef const int64_t[::1] slot = _arg(slot_arg, np.int64, 1, "slot")
    cdef float[:, ::1] out = _arg(out_arg, np.float32, 2, "out", output=True)
    cdef int64_t c_shards = len(shard_rows)
    cdef int64_t c_n = slot.shape[0]
    cdef int64_t c_dim = out.shape[1]
    cdef int64_t s
    cdef vector[const float*] c_ptrs
    cdef const float[:, ::1] c_rows
    if offsets.shape[0] != c_shards + 1:
        raise errors.ShapeError("offsets must have one entry per shard plus one")
    if out.shape[0] != c_n:
        raise errors.ShapeError(f"out has {out.shape[0]} rows, slot {c_n}")
    keep = []
    for s in range(c_shards):
        rows = shard_rows[s]
        count = offsets[s + 1] - offsets[s]
        c_rows = rows
        if c_rows.shape[0] != count or (count and c_rows.shape[1] != c_dim):
            raise errors.ShapeError(
                f"shard {s} replied {c_rows.shape[0]} rows of width "
                f"{c_rows.shape[1]}, expected {count} of width {c_dim}")
        keep.append(rows)
        c_ptrs.push_back(&c_rows[0, 0] if count else NULL)
    for s in range(c_n):
        if slot[s] < 0 or slot[s] >= offsets[c_shards]:
            raise errors.InvalidArgument("slot out of range")
    if c_n:
        with nogil:
            GatherFromShards(c_ptrs.data(), &offsets[0], c_shards, &slot[0], c_n, c_dim,
                             &out[0, 0])


# -- 16-bit rows on the wire (csrc/half.h) ----------------------------------------------------
#
# A table's wire dtype says how its pulled rows and pushed gradients travel: float32, or
# 16-bit values as uint16 bit patterns. Tables stay float32.

WIRE_DTYPES = ("float32", "float16", "bfloat16")
_HALF_KINDS = {"float16": HalfKind.kFloat16, "bfloat16": HalfKind.kBFloat16}


cdef HalfKind _half_kind(dtype) except *:
    kind = _HALF_KINDS.get(dtype) if isinstance(dtype, str) else None
    if kind is None:
        raise errors.InvalidArgument(
            f"a 16-bit wire dtype is 'float16' or 'bfloat16', got {dtype!r}")
    return kind


cdef object _same_shape_out(out, shape, dtype):
    """A new C-contiguous array of shape and dtype, or out checked to be one (writable)."""
    if out is None:
        return np.empty(shape, dtype)
    out = _arg(out, dtype, len(shape), "out", output=True)
    if out.shape != shape:
        raise errors.ShapeError(f"out has shape {out.shape}, expected {shape}")
    return out


def use_half_hardware(bint enable):
    """Uses the x86 F16C/AVX2 conversions (enable, where the CPU has them; the default)
    or the portable loops from now on; returns whether the x86 ones are in use.

    Both give the same bits: for tests and benchmarks comparing them. Not to
    be called while another thread converts.
    """
    return UseHalfHardware(enable)


def narrow(values_arg, dtype, out=None):
    """values (float32, any shape) rounded to dtype, as uint16 bit patterns of the same shape.

    dtype: 'float16' or 'bfloat16'. Rounds to nearest, ties to even; float16
    overflows to inf from 65520 up; NaN stays NaN (quiet, same sign).
    Releases the GIL for the whole array; safe from several threads at once.
    """
    cdef HalfKind c_kind = _half_kind(dtype)
    values = np.asarray(values_arg)
    values = _arg(values, np.float32, values.ndim, "values")
    out = _same_shape_out(out, values.shape, np.uint16)
    cdef const float[::1] c_values = values.reshape(-1)
    cdef uint16_t[::1] c_out = out.reshape(-1)
    cdef int64_t c_n = c_values.shape[0]
    if c_n:
        with nogil:
            NarrowFloats(c_kind, &c_values[0], c_n, &c_out[0])
    return out


def widen(halves_arg, dtype, out=None):
    """The float32 values (same shape) of uint16 bit patterns of dtype; exact.

    dtype: 'float16' or 'bfloat16'. Releases the GIL for the whole array;
    safe from several threads at once.
    """
    cdef HalfKind c_kind = _half_kind(dtype)
    halves = np.asarray(halves_arg)
    halves = _arg(halves, np.uint16, halves.ndim, "halves")
    out = _same_shape_out(out, halves.shape, np.float32)
    cdef const uint16_t[::1] c_halves = halves.reshape(-1)
    cdef float[::1] c_out = out.reshape(-1)
    cdef int64_t c_n = c_halves.shape[0]
    if c_n:
        with nogil:
            WidenHalves(c_kind, &c_halves[0], c_n, &c_out[0])
    return out


def first_nonfinite_half_row(rows_arg, dtype):
    """Index of the first row of 16-bit rows (uint16, n x dim) holding an inf or NaN, or -1."""
    cdef HalfKind c_kind = _half_kind(dtype)
    cdef const uint16_t[:, ::1] rows = _arg(rows_arg, np.uint16, 2, "rows")
    cdef int64_t c_result = -1
    if rows.shape[0] and rows.shape[1]:
        with nogil:
            c_result = FirstNonFiniteHalfRow(c_kind, &rows[0, 0], rows.shape[0], rows.shape[1])
    return c_result


def gather_widen_from_shards(list shard_rows, offsets_arg, slot_arg, out_arg, dtype):
    """gather_from_shards over 16-bit replies: out[i] = the widened reply row for slot[i].

    shard_rows[s]: shard s's rows as uint16 bit patterns of dtype
    ((offsets[s + 1] - offsets[s]) x dim); out: float32 (len(slot) x dim),
    written in place: the replies are widened straight into it.
    """
    cdef HalfKind c_kind = _half_kind(dtype)
    cdef const int64_t[::1] offsets = _arg(offsets_arg, np.int64, 1, "offsets")
    cdef const int64_t[::1] slot = _arg(slot_arg, np.int64, 1, "slot")
    cdef float[:, ::1] out = _arg(out_arg, np.float32, 2, "out", output=True)
    cdef int64_t c_n = slot.shape[0]
    cdef int64_t c_dim = out.shape[1]
    cdef int64_t s
    cdef vector[const uint16_t*] c_ptrs
    cdef const uint16_t[:, ::1] c_rows
    if offsets.shape[0] != len(shard_rows) + 1 or out.shape[0] != c_n:
        raise errors.ShapeError(
            f"{len(shard_rows)} shards need {len(shard_rows) + 1} offsets (got "
            f"{offsets.shape[0]}), and out needs {c_n} rows (has {out.shape[0]})")
    keep = [_arg(rows, np.uint16, 2, f"shard {s} rows") for s, rows in enumerate(shard_rows)]
    for s, rows in enumerate(keep):
        count = offsets[s + 1] - offsets[s]
        if rows.shape[0] != count or (count and rows.shape[1] != c_dim):
            raise errors.ShapeError(
                f"shard {s} replied {rows.shape} 16-bit rows, expected ({count}, {c_dim})")
        c_rows = rows
        c_ptrs.push_back(&c_rows[0, 0] if count else NULL)
    cdef int64_t c_shards = len(keep)
    if c_n and (np.min(slot) < 0 or np.max(slot) >= offsets[c_shards]):
        raise errors.InvalidArgument("slot out of range")
    if c_n and c_dim:
        with nogil:
            GatherWidenFromShards(c_kind, c_ptrs.data(), &offsets[0], c_shards, &slot[0], c_n,
                                  c_dim, &out[0, 0])


include "dlpack.pxi"
include "serving_apply.pxi"
include "serve_loop.pxi"
include "segment_store.pxi"
include "disk_checkpoint.pxi"
