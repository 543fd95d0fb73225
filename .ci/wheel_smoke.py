"""Smoke test of an installed kvsparse wheel, run by `.ci/wheel` in a venv holding only the
wheel and its dependencies, with no C/C++ compiler on PATH.

    python wheel_smoke.py local                                  # the in-process store
    kvsparse launch -s 1 -n 1 -- python wheel_smoke.py dist_sparse   # one real server

Each run trains marker rows with SGD and checks every value exactly (the learning rate and
gradients are powers of two, so float32 arithmetic is exact), then saves, trains on, loads
the checkpoint and checks that the saved rows return. Prints one line ending in "ok"; any
failure exits nonzero.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile

import numpy as np

import kvsparse

COMPILERS = ("gcc", "g++", "cc", "c++", "clang")
MARKERS = np.array([7, 2**40 + 3, -9, 2**62], dtype=np.int64)
GRADIENT_SCALES = np.array([1.0, 2.0, 4.0, 0.5], dtype=np.float32)
DIM = 4
START = 0.5
LEARNING_RATE = 0.25
STEPS = 2


def check_environment() -> None:
    """The wheel, not a source tree, and no compiler that could have built anything."""
    found = {name: shutil.which(name) for name in COMPILERS if shutil.which(name)}
    assert not found, f"a compiler is on PATH, the smoke must run without one: {found}"
    assert shutil.which("gcc") is None
    installed = os.path.realpath(kvsparse.__file__)
    site = os.path.realpath(sys.prefix)
    assert installed.startswith(site + os.sep), f"kvsparse from {installed}, not {site}"
    core = importlib.import_module("kvsparse._core")  # compiled, loads without a build step
    assert os.path.realpath(core.__file__).startswith(site + os.sep), core.__file__


def expected_rows() -> np.ndarray:
    """The rows after STEPS SGD steps of gradient GRADIENT_SCALES[i] on every element."""
    rows = np.full((len(MARKERS), DIM), START, dtype=np.float32)
    for _ in range(STEPS):
        rows -= np.float32(LEARNING_RATE) * GRADIENT_SCALES[:, None]
    return rows


def train_and_check(kind: str, directory: str) -> None:
    """Trains the marker rows on a kind store and checks them; saves, trains on, loads the
    checkpoint back and checks that the saved rows return."""
    table = kvsparse.SparseTable(dim=DIM, initializer=kvsparse.initializers.Constant(START))
    with kvsparse.create(kind) as kv:
        kv.init("emb", table)
        kv.set_optimizer(kvsparse.optimizers.SGD(learning_rate=LEARNING_RATE))
        first = kv.row_sparse_pull("emb", row_ids=MARKERS)
        assert np.array_equal(first, np.full((len(MARKERS), DIM), START, np.float32)), first
        gradients = np.repeat(GRADIENT_SCALES[:, None], DIM, axis=1)
        for _ in range(STEPS):
            kv.push("emb", (MARKERS, gradients))
        trained = kv.row_sparse_pull("emb", row_ids=MARKERS)
        assert np.array_equal(trained, expected_rows()), (trained, expected_rows())
        kv.save(directory)
        kv.push("emb", (MARKERS, gradients))
        moved = kv.row_sparse_pull("emb", row_ids=MARKERS)
        assert not np.array_equal(moved, expected_rows()), "a push after the save changed nothing"
        kv.load(directory)
        loaded = kv.row_sparse_pull("emb", row_ids=MARKERS)
        assert np.array_equal(loaded, expected_rows()), (loaded, expected_rows())


def main() -> None:
    """Runs the smoke on the store kind named by the one argument."""
    kind = sys.argv[1] if len(sys.argv) > 1 else "local"
    check_environment()
    with tempfile.TemporaryDirectory(prefix="kvsparse-wheel-smoke") as directory:
        train_and_check(kind, os.path.join(directory, "checkpoint"))
    print(f"wheel smoke {kind}: kvsparse {kvsparse.__version__} from {kvsparse.__file__} ok")


if __name__ == "__main__":
    main()
