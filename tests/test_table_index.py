"""The key index of a C++ table (csrc/key_index.h) through kvsparse._core.Table."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvsparse import _core

_INDEX_CANNOT_GROW = """
import resource, sys
import numpy as np
from kvsparse import _core
table = _core.Table(8, {"kind": "normal", "b": 0.01}, None)
keys = np.arange(1000, dtype=np.int64) * 7919
before = table.lookup_or_insert(keys).copy()
with open("/proc/self/statm") as f:
    used = int(f.read().split()[0]) * resource.getpagesize()
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (used + (64 << 20), hard))
try:
    table.reserve(400_000_000)  # a bucket array of about 7 GB: refused
except MemoryError:
    pass
else:
    sys.exit(3)
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
assert len(table) == 1000, len(table)
assert np.array_equal(table.lookup(keys), before)
table.lookup_or_insert(np.arange(5000, 9000, dtype=np.int64))  # grows as usual
assert len(table) == 1000 + 4000 - len(set(range(5000, 9000)) & set(keys.tolist()))
assert np.array_equal(table.lookup(keys), before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_table_whose_index_cannot_grow_keeps_every_row():
    # The grown bucket array is allocated before the old one is let go: when it cannot
    # be had, the reserve is a MemoryError and the index is the one it was.
    env = {**os.environ, "KVSPARSE_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _INDEX_CANNOT_GROW], env=env, capture_output=True, timeout=120
    )
    assert result.returncode == 0, (result.returncode, result.stderr.decode()[-2000:])


def test_removed_keys_leave_every_other_key_reachable():
    # Backward-shift removal (KeyIndex::Erase) over a crowded index: after removing
    # every third key, each remaining key still finds its row, and removed keys are gone.
    table = _core.Table(4, {"kind": "zeros"}, None)
    keys = np.arange(20_000, dtype=np.int64) * 1_000_003
    values = np.arange(keys.size * 4, dtype=np.float32).reshape(-1, 4)
    table.assign(keys, values)
    removed = keys[::3]
    assert table.remove(removed) == removed.size
    kept = np.setdiff1d(keys, removed)
    assert len(table) == kept.size
    np.testing.assert_array_equal(table.lookup(kept), values[np.isin(keys, kept)])
    np.testing.assert_array_equal(table.lookup(removed), np.zeros((removed.size, 4), np.float32))
    assert table.remove(removed) == 0
