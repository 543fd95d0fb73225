"""Workload W1: batches of ids drawn Zipf(1.1) over 10^8 ids, one table of dim 64.

Every system in benchmarks/pull_push.py reads the same batches from one .npz file, so they
all see the same ids (peers with fixed-size tables get them folded, see `fold`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ID_SPACE = 10**8
DIM = 64
LEARNING_RATE = 0.01
EPS = 1e-10
# A bijection of [0, 10^8) (the multiplier is odd and not a multiple of 5), so the hot
# ids of the Zipf law are spread over the id space instead of sitting at 0, 1, 2...:
# range-partitioned peers (ps-lite, the folded tables) would otherwise put them all on
# server 0.
_SCRAMBLE_MUL = 2654435761
_SCRAMBLE_ADD = 12345


def zipf_ids(rng: np.random.Generator, size: int, exponent: float = 1.1) -> np.ndarray:
    """`size` int64 ids in [0, 10^8) drawn Zipf(exponent), truncated by rejection, scrambled."""
    out = np.empty(0, np.int64)
    while out.size < size:
        draw = rng.zipf(exponent, size=int(size * 1.3) + 16)
        draw = draw[draw <= ID_SPACE] - 1  # ~15% of Zipf(1.1) draws lie beyond 10^8
        out = np.concatenate([out, draw.astype(np.int64)])
    ids = out[:size]
    return (ids * _SCRAMBLE_MUL + _SCRAMBLE_ADD) % ID_SPACE


@dataclass
class Workload:
    """All batches of a run, the gradient rows pushed with each, and the folded ids.

    batches: (num_batches, batch_size) int64 ids in [0, 10^8).
    folded: the same ids mapped into [0, fold_rows) for fixed-size tables.
    fold_collisions: False when every distinct id got its own row (the usual case).
    grads: (batch_size, DIM) float32 gradient rows pushed with every batch.
    """

    batches: np.ndarray
    folded: np.ndarray
    fold_rows: int
    fold_collisions: bool
    grads: np.ndarray

    @property
    def batch_size(self) -> int:
        return int(self.batches.shape[1])

    def unique_counts(self) -> np.ndarray:
        return np.array([np.unique(b).size for b in self.batches], np.int64)

    def save(self, path: str) -> None:
        np.savez(
            path,
            batches=self.batches,
            folded=self.folded,
            fold_rows=self.fold_rows,
            fold_collisions=self.fold_collisions,
            grads=self.grads,
        )

    @classmethod
    def load(cls, path: str) -> Workload:
        with np.load(path) as data:
            return cls(
                data["batches"],
                data["folded"],
                int(data["fold_rows"]),
                bool(data["fold_collisions"]),
                data["grads"],
            )


def fold(batches: np.ndarray, fold_rows: int, seed: int) -> tuple[np.ndarray, bool]:
    """Maps ids into [0, fold_rows): distinct ids to distinct random rows while they fit.

    When there are more distinct ids than rows it falls back to id % fold_rows (then
    distinct ids share rows and the folded batches have fewer unique rows).
    """
    distinct, inverse = np.unique(batches, return_inverse=True)
    if distinct.size > fold_rows:
        return batches % fold_rows, True
    rows = np.random.default_rng(seed).permutation(fold_rows)[: distinct.size]
    return rows[inverse].reshape(batches.shape).astype(np.int64), False


def make(num_batches: int, batch_size: int, fold_rows: int, seed: int = 0) -> Workload:
    """The batches of one run (deterministic for a seed)."""
    rng = np.random.default_rng(seed)
    batches = np.stack([zipf_ids(rng, batch_size) for _ in range(num_batches)])
    folded, collisions = fold(batches, fold_rows, seed + 1)
    grads = (rng.standard_normal((batch_size, DIM), dtype=np.float32) * 0.01).astype(np.float32)
    return Workload(batches, folded, fold_rows, collisions, grads)


def dedup_sum(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted unique ids, inverse, gradient rows summed per unique id) with NumPy.

    np.add.at is the fastest pure-NumPy sum here: 70-90 ms for 65,536 x 64 rows, against
    95-130 ms for sort + np.add.reduceat and 140-170 ms for np.bincount per column.
    """
    unique, inverse = np.unique(ids, return_inverse=True)
    summed = np.zeros((unique.size, grads.shape[1]), np.float32)
    np.add.at(summed, inverse, grads)
    return unique, inverse, summed
