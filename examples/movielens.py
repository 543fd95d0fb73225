"""MovieLens-100k as a CTR task, shared by the framework examples.

The data ships inside the `recbole` wheel (`pip install --no-deps recbole`);
we locate its `dataset_example/ml-100k` folder without importing recbole
(importing it would pull its many dependencies). Set KVSPARSE_ML100K_DIR to
use another copy.

Task: label = rating >= 4. Each rating becomes one row of sparse feature ids,
one per field (user, item, user attributes, item attributes). An id is a
fixed 64-bit hash of (field, value): any int64, so the kvsparse tables grow
as ids appear and nobody guesses a vocabulary size.

Example:
    >>> data = load()
    >>> data.train_ids.shape[1] == len(data.fields)
    True
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import os
import sys
from dataclasses import dataclass

import numpy as np

FIELDS = ("user", "item", "age", "gender", "occupation", "zip", "year", "genre1", "genre2")


def find_ml100k() -> str:
    """The folder holding ml-100k.inter/.user/.item.

    Raises:
        FileNotFoundError: with the command that installs the data.
    """
    override = os.environ.get("KVSPARSE_ML100K_DIR")
    if override:
        return override
    spec = importlib.util.find_spec("recbole")  # locates, does not import
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "MovieLens-100k not found: install it with `pip install --no-deps recbole` "
            "or set KVSPARSE_ML100K_DIR to a folder holding ml-100k.inter"
        )
    folder = os.path.join(os.path.dirname(spec.origin), "dataset_example", "ml-100k")
    if not os.path.exists(os.path.join(folder, "ml-100k.inter")):
        raise FileNotFoundError(f"{folder} has no ml-100k.inter")
    return folder


def feature_id(field: str, value: str) -> int:
    """A signed int64 id for (field, value): a fixed hash, stable across runs and workers."""
    digest = hashlib.blake2b(f"{field}={value}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _read(path):
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.reader(f, delimiter="\t")
        header = [h.split(":")[0] for h in next(reader)]
        return [dict(zip(header, row)) for row in reader]


@dataclass
class MovieLens:
    fields: tuple
    train_ids: np.ndarray  # (n_train, len(fields)) int64
    train_labels: np.ndarray  # (n_train,) float32, 1.0 when rating >= 4
    test_ids: np.ndarray
    test_labels: np.ndarray

    def shard(self, rank: int, num_workers: int):
        """This worker's share of the training rows: (ids, labels)."""
        return self.train_ids[rank::num_workers], self.train_labels[rank::num_workers]

    def equal_shard(self, rank: int, num_workers: int):
        """`shard`, cut so that every worker gets as many rows (a BSP step waits for all)."""
        per_worker = len(self.train_labels) // num_workers
        ids, labels = self.shard(rank, num_workers)
        return ids[:per_worker], labels[:per_worker]


def load(test_fraction: float = 0.2, seed: int = 0) -> MovieLens:
    """Loads ml-100k as (ids, labels) with a random held-out split."""
    folder = find_ml100k()
    users = {u["user_id"]: u for u in _read(os.path.join(folder, "ml-100k.user"))}
    items = {i["item_id"]: i for i in _read(os.path.join(folder, "ml-100k.item"))}
    ratings = _read(os.path.join(folder, "ml-100k.inter"))
    cache: dict = {}

    def fid(field, value):
        key = (field, value)
        if key not in cache:
            cache[key] = feature_id(field, value)
        return cache[key]

    ids = np.empty((len(ratings), len(FIELDS)), np.int64)
    labels = np.empty(len(ratings), np.float32)
    for n, r in enumerate(ratings):
        user = users.get(r["user_id"], {})
        item = items.get(r["item_id"], {})
        age = user.get("age", "")
        age_bucket = str(int(age) // 10) if age.isdigit() else "?"
        year = item.get("release_year", "")
        year_bucket = str(int(year) // 5) if year.isdigit() else "?"
        genres = (item.get("class", "") or "").split() + ["none", "none"]
        values = (
            r["user_id"],
            r["item_id"],
            age_bucket,
            user.get("gender", "?"),
            user.get("occupation", "?"),
            user.get("zip_code", "?")[:3],
            year_bucket,
            genres[0],
            genres[1],
        )
        ids[n] = [fid(f, v) for f, v in zip(FIELDS, values)]
        labels[n] = 1.0 if float(r["rating"]) >= 4 else 0.0
    order = np.random.default_rng(seed).permutation(len(ratings))
    n_test = int(len(ratings) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return MovieLens(FIELDS, ids[train], labels[train], ids[test], labels[test])


def batches(ids: np.ndarray, labels: np.ndarray, batch_size: int, seed: int):
    """Shuffled (ids, labels) mini-batches of one epoch."""
    order = np.random.default_rng(seed).permutation(len(labels))
    for start in range(0, len(order), batch_size):
        take = order[start : start + batch_size]
        yield ids[take], labels[take]


class LineWriter:
    """Turns tqdm's carriage-return redraws into one line per update.

    Under `kvsparse launch` (or any log file) stdout is not a terminal and
    output is relayed line by line: a bar redrawn with '\\r' would show only
    when the epoch ends.
    """

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").rstrip()
        if text:
            self._stream.write(text + "\n")

    def flush(self) -> None:
        self._stream.flush()


def progress_stream(stream=None):
    """Where the examples' tqdm bars write: the terminal as is, else one line per update."""
    stream = sys.stdout if stream is None else stream
    return stream if stream.isatty() else LineWriter(stream)


def announce(kv, data: MovieLens) -> None:
    """Rank 0 prints what trains: the store, its workers and servers, the ratings."""
    if kv.rank == 0:
        print(
            f"kvsparse {kv.type}: {kv.num_workers} worker(s), {kv.num_servers} server(s); "
            f"{len(data.train_labels)} training ratings, {len(data.test_labels)} held out",
            flush=True,
        )


def epoch_progress(epoch: int, epochs: int, steps: int, rank: int):
    """The tqdm bar of one epoch; only rank 0 shows it (one line per update in logs)."""
    from tqdm import tqdm

    return tqdm(
        total=steps,
        desc=f"epoch {epoch + 1}/{epochs}",
        file=progress_stream(),
        mininterval=3.0,
        ascii=True,
        disable=rank != 0,
    )


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney U) statistic, ties averaged."""
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, np.float64)
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), np.float64)
    sorted_scores = scores[order]
    # Average ranks over ties.
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [len(scores)]])
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + e + 1) / 2.0
    n_pos = labels.sum()
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
