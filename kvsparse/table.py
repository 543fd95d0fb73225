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

MAX_DIM = 4096
_NONFINITE_POLICIES = ("raise", "skip")


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
    """A sparse table: any int64 id -> a row of `dim` float32 values.

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

    Raises:
        kvsparse.errors.InvalidArgument: a bad dim or setting.
    """

    dim: int
    initializer: initializers.Initializer = field(default_factory=initializers.Uniform)
    optimizer: optimizers.Optimizer | None = None
    seed: int = 0
    partitioner: RangePartitioner | None = None
    nonfinite: str = "raise"

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

    def to_dict(self) -> dict:
        """The wire/config form (plain types only)."""
        return {
            "dim": self.dim,
            "initializer": self.initializer.to_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.to_dict(),
            "seed": int(self.seed),
            "boundaries": None if self.partitioner is None else list(self.partitioner.boundaries),
            "nonfinite": self.nonfinite,
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
        )
