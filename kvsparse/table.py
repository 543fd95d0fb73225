"""SparseTable: the configuration of one partitioned, growing embedding table.

Example:
    >>> import kvsparse
    >>> kv = kvsparse.create('local')
    >>> kv.init('user', kvsparse.SparseTable(
    ...     dim=64, initializer=kvsparse.initializers.Normal(0, 0.01), seed=7))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsparse import errors, initializers, optimizers
from kvsparse.arrays import table_dtype

MAX_DIM = 4096
_NONFINITE_POLICIES = ("raise", "skip")
_EVICTIONS = ("lfu", "lru")
# How a sparse table's pulled rows and pushed gradients travel between workers and servers.
# The first is the default.
WIRE_DTYPES = ("float32", "float16", "bfloat16")
_POLICY_DEFAULTS = {
    "min_count": 1,
    "ttl_steps": None,
    "max_rows": None,
    "eviction": "lfu",
    "evict_every": None,
}


@dataclass(frozen=True)
class RangePartitioner:
    """TF-style range partitioning: shard s holds ids in [boundaries[s-1], boundaries[s]).

    Needs exactly (number of servers - 1) ascending boundaries.
    """

    boundaries: tuple = ()

    def __post_init__(self):
        values = tuple(int(b) for b in self.boundaries)
        if any(a >= b for a, b in zip(values, values[1:])):
            raise errors.InvalidArgument("RangePartitioner boundaries must be strictly ascending")
        object.__setattr__(self, "boundaries", values)


@dataclass
class SparseTable:
    """A sparse table: any int64 id -> a row of `dim` values (float32, float16 or bfloat16).

    Args:
        dim: row width, 1..4096.
        initializer: how a new id's row starts (kvsparse.initializers);
            default Uniform(-0.05, 0.05).
        optimizer: this table's own optimizer; None uses the store's
            (``kv.set_optimizer``), and with none at all a push replaces the row.
        seed: seed of the deterministic initializer.
        partitioner: None for hash partitioning over servers, or a
            RangePartitioner.
        nonfinite: 'raise' (default) rejects a push whose gradient holds NaN/inf
            and changes nothing; 'skip' drops those rows and applies the rest.
        min_count: feature admission: an id is stored (and its gradients
            applied) only from the push in which it is seen for the
            min_count-th time; before that, pulls give its initial value and
            its gradients are dropped. Default 1 (admit at once).
        ttl_steps: rows not touched by a push for ttl_steps steps are dropped
            (by ``kv.evict()``, and automatically every evict_every steps).
            None (default): rows never expire.
        max_rows: capacity of ONE shard's part of the table (a table over s
            servers holds up to s * max_rows rows). A push that would exceed it
            first evicts rows it does not touch, chosen by `eviction`.
            None (default): unbounded.
        eviction: 'lfu' (default; evict the rows touched by the fewest pushes)
            or 'lru' (evict the rows whose last touching push is oldest). Ties
            go to the lower id.
        evict_every: run TTL eviction automatically after every evict_every-th
            push of the table; None (default) means every ttl_steps pushes, 0
            only on ``kv.evict()``.
        wire_dtype: how this table's rows travel between workers and servers:
            'float32', 'float16' or 'bfloat16' (see `check_wire_dtype`). None
            (default): the store's (``kvsparse.create(..., wire_dtype=...)``,
            itself 'float32' by default). A worker-side setting: the servers
            never see it. With a 16-bit dtype it governs pushes only: pulls
            travel in the table's dtype (exact).
        dtype: how the servers store the values: 'float32' (default),
            'float16' or 'bfloat16' (also NumPy / torch / TF dtypes, see
            `kvsparse.arrays.table_dtype`). Pulls return this dtype unless asked
            for float32. Optimizer math runs in float32: a row is widened
            (exactly), updated, and rounded to nearest, ties to even, once per
            write; an update that rounds to inf (float16 beyond 65504) is an
            overflow (nothing of the push is applied, or the row is skipped
            with nonfinite='skip'). Initial values are rounded the same way.
        slot_dtype: how the optimizer's slots are stored; None (default):
            float32 whatever dtype is, so the accumulators keep full precision.
            An optimizer with ``multi_precision=True`` gives a 16-bit table a
            float32 master copy of each row that it updates; the stored value
            is the master rounded once (MXNet's float16 row_sparse weights).

    Bytes a row (values + slots, besides about 24 bytes of map and counters):
    dim * (4 or 2) + num_slots * dim * (4 or 2), plus dim * 4 for the master
    copy of a 16-bit table under multi_precision; `kv.stats()` reports them.

    Admission and eviction semantics (exactly; tests/reference.py models them):

    * A *step* is one push of the table (its push counter ``table_step``,
      counted on every shard, even one that got none of the push's ids).
    * An id is *seen* once per push that contains it, however often it
      repeats in the batch; pulls never insert and never count, and an id
      whose gradient is skipped as non-finite is not seen.
    * Ids seen fewer than min_count times are kept in an exact side map of
      candidate counts (about 40-60 bytes each, counted in ``kv.stats()``
      bytes; with a TTL, candidates unseen for ttl_steps are dropped too,
      otherwise the map is unbounded).
    * A row *touched* at step L is expired at step S when S - L >= ttl_steps.
    * A push never evicts rows of ids it contains. If evicting all other rows
      still leaves too little room, it admits its new ids in ascending id
      order up to max_rows and drops the rest ('rejected' in stats).
    * An evicted id loses its row, optimizer slots and step counter: if it
      comes back it starts again from its initial value (and must be seen
      min_count times again).
    * Per-row metadata costs 4 bytes a row for the touch count (max_rows with
      'lfu') and 4 for the last step (ttl_steps, or max_rows with 'lru'),
      nothing without a policy. Touch counts and last steps are not saved in
      checkpoints; the explicit-write paths (init values, checkpoint restore)
      bypass admission and capacity.

    Raises:
        kvsparse.errors.InvalidArgument: a bad dim or setting.
    """

    dim: int
    initializer: initializers.Initializer = field(default_factory=initializers.Uniform)
    optimizer: optimizers.Optimizer | None = None
    seed: int = 0
    partitioner: RangePartitioner | None = None
    nonfinite: str = "raise"
    min_count: int = 1
    ttl_steps: int | None = None
    max_rows: int | None = None
    eviction: str = "lfu"
    evict_every: int | None = None
    wire_dtype: str | None = None
    dtype: str = "float32"
    slot_dtype: str | None = None

    def __post_init__(self):
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise errors.InvalidArgument(f"dim must be an int, got {self.dim!r}")
        if not 1 <= self.dim <= MAX_DIM:
            raise errors.InvalidArgument(f"dim must be in [1, {MAX_DIM}], got {self.dim}")
        if not isinstance(self.initializer, initializers.Initializer):
            raise errors.InvalidArgument(
                f"initializer must be a kvsparse.initializers object, got {self.initializer!r}"
            )
        if self.optimizer is not None and not isinstance(self.optimizer, optimizers.Optimizer):
            raise errors.InvalidArgument(
                f"optimizer must be a kvsparse.optimizers object, got {self.optimizer!r}"
            )
        if self.nonfinite not in _NONFINITE_POLICIES:
            raise errors.InvalidArgument(
                f"nonfinite must be one of {_NONFINITE_POLICIES}, got {self.nonfinite!r}"
            )
        if not 0 <= int(self.seed) < 2**64:
            raise errors.InvalidArgument(f"seed must be in [0, 2**64), got {self.seed}")
        if self.wire_dtype is not None:
            check_wire_dtype(self.wire_dtype, "SparseTable wire_dtype")
        self.dtype = table_dtype(self.dtype, "SparseTable dtype")
        if self.slot_dtype is not None:
            self.slot_dtype = table_dtype(self.slot_dtype, "SparseTable slot_dtype")
        self._check_policy()

    def _check_policy(self) -> None:
        def positive(name, value, allow_none, low=1, high=2**31 - 1):
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise errors.InvalidArgument(
                    f"{name} must be an int in [{low}, {high}]"
                    + (" or None" if allow_none else "")
                    + f", got {value!r}"
                )

        positive("min_count", self.min_count, False, high=2**32 - 1)
        positive("ttl_steps", self.ttl_steps, True)
        positive("max_rows", self.max_rows, True, high=2**32 - 2)
        positive("evict_every", self.evict_every, True, low=0, high=2**62)
        if self.eviction not in _EVICTIONS:
            raise errors.InvalidArgument(
                f"eviction must be one of {_EVICTIONS}, got {self.eviction!r}"
            )

    def policy(self) -> dict | None:
        """The admission/eviction settings for kvsparse._core.Table, or None if none apply."""
        return policy_of(self.to_dict())

    def to_dict(self) -> dict:
        """The wire/config form (plain types only)."""
        return {
            "dim": self.dim,
            "initializer": self.initializer.to_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.to_dict(),
            "seed": int(self.seed),
            "boundaries": None if self.partitioner is None else list(self.partitioner.boundaries),
            "nonfinite": self.nonfinite,
            # Policy fields only when set, so specs of tables without one are unchanged.
            **{
                name: getattr(self, name)
                for name, default in _POLICY_DEFAULTS.items()
                if getattr(self, name) != default
            },
            # Only when set, likewise; the store leaves it out of what servers get.
            **({} if self.wire_dtype is None else {"wire_dtype": self.wire_dtype}),
            # Only when not float32: checkpoints of float32 tables are unchanged.
            **({} if self.dtype == "float32" else {"dtype": self.dtype}),
            **({} if self.slot_dtype in (None, "float32") else {"slot_dtype": self.slot_dtype}),
        }

    @classmethod
    def from_dict(cls, spec: dict) -> SparseTable:
        boundaries = spec.get("boundaries")
        return cls(
            dim=spec["dim"],
            initializer=initializers.from_dict(spec["initializer"]),
            optimizer=optimizers.from_dict(spec.get("optimizer")),
            seed=spec.get("seed", 0),
            partitioner=None if boundaries is None else RangePartitioner(tuple(boundaries)),
            nonfinite=spec.get("nonfinite", "raise"),
            **{name: spec.get(name, default) for name, default in _POLICY_DEFAULTS.items()},
            wire_dtype=spec.get("wire_dtype"),
            dtype=spec.get("dtype", "float32"),
            slot_dtype=spec.get("slot_dtype"),
        )


def check_wire_dtype(wire_dtype, what: str = "wire_dtype") -> str:
    """wire_dtype, if it names a wire dtype: 'float32', 'float16' or 'bfloat16'.

    With 'float16' or 'bfloat16', a sparse table's pulled rows and pushed
    gradients travel as 16-bit values: each value is rounded to that type
    (to nearest, ties to even) once, on the side that sends it; the receiver
    widens it to float32 exactly. A push's gradient rows are first summed per
    id in float32 on the worker, then rounded. float16 keeps 11 significant
    bits and overflows to inf beyond 65504; bfloat16 keeps 8 bits and
    float32's range. Dense keys always travel as float32.

    Raises:
        InvalidArgument: anything else (naming what was given).

    Example:
        >>> check_wire_dtype("bfloat16")
        'bfloat16'
    """
    if not isinstance(wire_dtype, str) or wire_dtype not in WIRE_DTYPES:
        raise errors.InvalidArgument(
            f"{what} must be one of {', '.join(map(repr, WIRE_DTYPES))}, got {wire_dtype!r}"
        )
    return wire_dtype


def policy_of(spec: dict) -> dict | None:
    """The kvsparse._core.Table policy dict of a SparseTable spec, or None (no policy).

    Resolves evict_every=None to ttl_steps.

    Example:
        >>> policy_of(SparseTable(4, ttl_steps=10).to_dict())["evict_every"]
        10
    """
    values = {name: spec.get(name, default) for name, default in _POLICY_DEFAULTS.items()}
    if values["min_count"] == 1 and values["ttl_steps"] is None and values["max_rows"] is None:
        return None
    evict_every = values["evict_every"]
    if evict_every is None:
        evict_every = values["ttl_steps"] or 0
    return {
        "min_count": values["min_count"],
        "ttl_steps": values["ttl_steps"] or 0,
        "max_rows": values["max_rows"] or 0,
        "eviction": values["eviction"],
        "evict_every": evict_every,
    }


# The counters of `_core.Table.tier_stats()`, summed over shards by `kv.stats()`.
TIER_COUNTERS = (
    "memory_budget",
    "rows_in_memory",
    "rows_on_disk",
    "memory_bytes",
    "disk_bytes",
    "disk_index_bytes",
    "rows_read",
    "row_lookups",
    "disk_hits",
    "evictions",
    "disk_reads",
    "bytes_read",
    "bytes_written",
    "bytes_updated",
    "gc_segments_freed",
    "gc_bytes_moved",
    "idle_bytes_moved",
    "compactions",
)


def tier_stats(counters: dict) -> dict:
    """A table's tier counters (`TIER_COUNTERS`) with the two ratios computed from them.

    hit_rate: the share of looked-up or pushed stored ids found in memory,
    ``1 - disk_hits / row_lookups`` (1.0 before any lookup); write_amplification:
    ``bytes_written / bytes_updated``, bytes the disk tier wrote (evictions and
    GC moves) per byte of rows updated (0.0 before any update). Also what
    `kv.stats()` recomputes from counters summed over shards. Thread-safe.

    Example:
        >>> tier_stats({"row_lookups": 10, "disk_hits": 1, "bytes_written": 30,
        ...             "bytes_updated": 20})["hit_rate"]
        0.9
    """
    found = {name: int(counters.get(name, 0)) for name in TIER_COUNTERS}
    lookups, updated = found["row_lookups"], found["bytes_updated"]
    found["hit_rate"] = 1.0 - found["disk_hits"] / lookups if lookups else 1.0
    found["write_amplification"] = found["bytes_written"] / updated if updated else 0.0
    return found
