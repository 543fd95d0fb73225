"""Hardening of the C++ core, through kvsparse._core (and the stores).

- A finite gradient whose optimizer update overflows a row (inf/NaN in its values or
  slots) is refused as UpdateOverflow and nothing of the push is applied; with
  skip_nonfinite, only the overflowing rows are left alone.
- A push that runs out of memory changes nothing (no admission, eviction or candidate
  count before the failure); ParallelFor carries a worker's exception to the calling
  thread and runs a range inline when a thread cannot be started.
- A table of a few rows costs a few KiB, not megabytes.
Each test failed before its fix (see the report of the commit that added it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest

import kvsparse
from kvsparse import _core, errors, initializers, optimizers

REPO = Path(__file__).resolve().parent.parent
BIG = np.float32(3e38)

# Optimizers and a (row, gradient) that overflow under each: in the values, or only in a
# slot (Adagrad's sum of squares), where inf would silently freeze the row from then on.
OVERFLOWS = {
    "sgd": ({"kind": "sgd", "learning_rate": 1.0}, BIG, -BIG),
    "sgd_momentum": ({"kind": "sgd", "learning_rate": 1.0, "momentum": 0.9}, BIG, -BIG),
    "adagrad_slot": ({"kind": "adagrad", "learning_rate": 0.1}, 1.0, 1e20),
    "adam": ({"kind": "adam", "learning_rate": 3e37}, 3.3e38, -1.0),
    "rmsprop_slot": ({"kind": "rmsprop", "learning_rate": 0.01}, 1.0, 1e30),
    "ftrl_slot": ({"kind": "ftrl", "learning_rate": 0.1}, 1.0, 1e20),
}


def ids(values):
    return np.array(values, dtype=np.int64)


def snapshot(table: _core.Table) -> dict:
    """Everything a push may change: rows with slots and steps, stats, steps, stamps."""
    keys = np.sort(np.concatenate([c[0] for c in table.iter_chunks()] or [ids([])]))
    values, slots, steps = table.read_state(keys)
    return {
        "keys": keys.tolist(),
        "values": values.tolist(),
        "slots": slots.tolist(),
        "steps": steps.tolist(),
        "table_step": table.table_step,
        "stats": table.policy_stats(),
        "changed": [k.tolist() for k in table.changed_keys(0)],
    }


def table_with_rows(optimizer, row_value, **policy):
    table = _core.Table(2, {"kind": "constant", "a": 0.5}, optimizer, policy=policy or None)
    table.apply_gradients(ids([1, 2, 3]), np.full((3, 2), 0.25, np.float32))  # slots, steps
    table.assign(ids([1]), np.array([[row_value, 0.0]], np.float32))
    return table


@pytest.mark.parametrize("name", sorted(OVERFLOWS))
def test_an_update_that_overflows_a_stored_row_is_refused_and_changes_nothing(name):
    optimizer, row_value, grad = OVERFLOWS[name]
    table = table_with_rows(optimizer, row_value)
    before = snapshot(table)
    # Id 1 overflows; ids 2 (stored) and 4 (new) alone would be fine.
    grads = np.array([[0.5, 0.5], [grad, 0.0], [0.5, 0.5]], np.float32)
    with pytest.raises(errors.UpdateOverflow, match="id 1 overflows") as raised:
        table.apply_gradients(ids([2, 1, 4]), grads)
    assert isinstance(raised.value, errors.InvalidArgument)
    assert isinstance(raised.value, FloatingPointError)
    assert isinstance(raised.value, ArithmeticError)
    assert snapshot(table) == before
    assert np.isfinite(table.read_state(ids([1, 2, 3]))[1]).all()
    # The same push without the overflowing id goes through.
    assert table.apply_gradients(ids([2, 4]), grads[[0, 2]]) == 2


@pytest.mark.parametrize("name", ["sgd_momentum", "adagrad_slot", "adam"])
@pytest.mark.parametrize("skip", [False, True])
def test_a_large_push_overflowing_late_puts_every_streamed_save_back(name, skip):
    """Rows of whole cache lines (dim 16) are saved with streaming stores, by 2 threads for
    a push this large (csrc/table.cc): a refused push puts every row back bit for bit;
    with skip, only the overflowing row is put back and the rest is updated."""
    optimizer, row_value, grad = OVERFLOWS[name]
    rng = np.random.default_rng(len(name))
    n, dim = 12_000, 16
    keys = np.unique(rng.integers(0, 2**62, size=n + 100))[:n]
    rng.shuffle(keys)
    table = _core.Table(dim, {"kind": "normal", "b": 0.1}, optimizer, seed=3)
    table.apply_gradients(keys, rng.standard_normal((n, dim)).astype(np.float32))
    late = n - 3  # in the second thread's range
    table.assign(keys[late : late + 1], np.full((1, dim), row_value, np.float32))
    before = snapshot(table)
    grads = rng.standard_normal((n, dim)).astype(np.float32) * 0.01
    grads[late, 5] = grad
    if not skip:
        with pytest.raises(errors.UpdateOverflow, match=f"id {keys[late]} overflows"):
            table.apply_gradients(keys, grads)
        assert snapshot(table) == before
        return
    assert table.apply_gradients(keys, grads, skip_nonfinite=True) == n - 1
    after = snapshot(table)
    position = {key: i for i, key in enumerate(before["keys"])}
    for key in keys[[0, late - 1, late, n - 1]].tolist():
        i = position[key]
        unchanged = key == keys[late]
        assert (after["values"][i] == before["values"][i]) == unchanged
        assert (after["slots"][i] == before["slots"][i]) == unchanged
        assert np.isfinite(after["slots"][i]).all()


@pytest.mark.parametrize("name", ["sgd", "adagrad_slot", "adam"])
def test_an_update_that_overflows_a_new_row_is_refused(name):
    optimizer, _, grad = OVERFLOWS[name]
    table = _core.Table(2, {"kind": "constant", "a": 3.3e38}, optimizer)
    table.apply_gradients(ids([7]), np.zeros((1, 2), np.float32))
    before = snapshot(table)
    with pytest.raises(errors.UpdateOverflow, match="id 9 overflows"):
        table.apply_gradients(ids([7, 9]), np.array([[0, 0], [grad, 0]], np.float32))
    assert snapshot(table) == before and len(table) == 1


def test_duplicate_ids_that_overflow_only_once_summed_are_refused():
    table = _core.Table(1, None, {"kind": "sgd", "learning_rate": 1e30})
    with pytest.raises(errors.UpdateOverflow, match="id 3"):
        table.apply_gradients(ids([3, 3]), np.full((2, 1), 3e8, np.float32))  # each 3e38, 6e38
    assert len(table) == 0


def test_skip_nonfinite_leaves_only_the_overflowing_rows_alone():
    table = table_with_rows({"kind": "sgd", "learning_rate": 2.0}, BIG)
    before = table.read_state(ids([1]))
    grads = np.array([[-BIG, 0], [1, 1], [1, 1], [-BIG, 0]], np.float32)
    applied = table.apply_gradients(ids([1, 2, 5, 6]), grads, skip_nonfinite=True)
    assert applied == 2  # 2 and 5
    for got, want in zip(table.read_state(ids([1])), before, strict=True):
        np.testing.assert_array_equal(got, want)
    assert 6 not in set(np.concatenate([c[0] for c in table.iter_chunks()]).tolist())
    np.testing.assert_array_equal(table.lookup(ids([5])), [[-1.5, -1.5]])


def test_an_overflowing_push_neither_counts_candidates_nor_evicts():
    sgd = {"kind": "sgd", "learning_rate": 1.0}
    counted = table_with_rows(sgd, BIG, min_count=2)
    bounded = table_with_rows(sgd, BIG, max_rows=3)
    for table in (counted, bounded):
        before = snapshot(table)
        grads = np.array([[-BIG, 0], [1, 1], [1, 1]], np.float32)
        with pytest.raises(errors.UpdateOverflow):
            table.apply_gradients(ids([1, 10, 11]), grads)
        assert snapshot(table) == before
    assert counted.policy_stats()["candidates"] == 3  # 1, 2, 3 were seen once each


@pytest.mark.parametrize("store", ["local", "dist_sparse"])
def test_stores_refuse_an_overflowing_push_with_the_same_class(store, server_factory):
    if store == "local":
        kv = kvsparse.create("local")
    else:
        kv = kvsparse.create("dist_sparse", servers=server_factory(1), rank=0, num_workers=1)
    try:
        kv.init("w", kvsparse.SparseTable(dim=2, initializer=initializers.Constant(3e38)))
        kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
        with pytest.raises(errors.UpdateOverflow, match="id 4"):
            kv.push("w", (ids([4, 5]), np.array([[-3e38, 0], [1, 1]], np.float32)))
        assert kv.stats()["tables"]["w"]["rows"] == 0
        out = kv.row_sparse_pull("w", row_ids=ids([4]))
        np.testing.assert_array_equal(out, np.full((1, 2), 3e38, np.float32))
    finally:
        kv.close()


# -- 8. out of memory halfway, ParallelFor ---------------------------------------------------

_PUSH_OUT_OF_MEMORY = """
import json, resource, sys
import numpy as np
from kvsparse import _core

def state(table):
    keys = np.sort(np.concatenate([c[0] for c in table.iter_chunks()]))
    return [keys.tolist(), table.read_state(keys)[0].sum().item(), table.policy_stats(),
            table.table_step]

# dim 512: 1024 rows per 2 MiB chunk. 2048 stored rows, room for 3000: a push of 1500 new
# ids evicts 548 rows, reuses their rows and needs a third chunk.
table = _core.Table(512, {"kind": "constant", "a": 1.0}, {"kind": "adam"},
                    policy={"max_rows": 3000})
# Stored without a push, so that the push below finds no scratch kept from an earlier one
# (pushes reuse theirs) and must allocate.
table.lookup_or_insert(np.arange(2048))
keys = np.arange(10_000, 11_500)
grads = np.ones((1500, 512), np.float32)
before = state(table)
with open("/proc/self/statm") as f:
    used = int(f.read().split()[0]) * resource.getpagesize()
# No room left: the push's first large allocation fails (before, it was the third chunk,
# after the evictions; with some room left the old code found memory and applied it).
resource.setrlimit(resource.RLIMIT_AS, (used, resource.RLIM_INFINITY))
try:
    table.apply_gradients(keys, grads)
    outcome = "applied"
except MemoryError:
    outcome = "MemoryError"
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
after = state(table)
applied = table.apply_gradients(keys, grads)
print(json.dumps({"outcome": outcome, "unchanged": after == before, "applied": applied,
                  "stats": table.policy_stats()}))
"""


def run_python(script: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", script], env=full_env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_push_that_runs_out_of_memory_changes_nothing():
    # Before: rows were evicted for room, then the new chunk failed: MemoryError with 548
    # rows gone (the header promised all-or-nothing).
    result = run_python(_PUSH_OUT_OF_MEMORY, KVSPARSE_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["outcome"] == "MemoryError"
    assert report["unchanged"], report
    assert report["applied"] == 1500 and report["stats"]["evicted_capacity"] == 548


_LOOKUP_WITHOUT_THREADS = """
import resource, sys
import numpy as np
from kvsparse import _core

table = _core.Table(1, {"kind": "zeros"})
keys = np.arange(200_000)
table.assign(keys, keys.astype(np.float32)[:, None])
out = np.empty((keys.size, 1), np.float32)
with open("/proc/self/statm") as f:
    used = int(f.read().split()[0]) * resource.getpagesize()
# A thread's stack is 8 MiB of address space: no worker can start under this limit.
resource.setrlimit(resource.RLIMIT_AS, (used + (2 << 20), resource.RLIM_INFINITY))
out[:] = -1
table.lookup(keys, out)
assert (out[:, 0] == keys).all(), "wrong rows"
print("ok")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_batch_runs_inline_when_no_thread_can_start():
    # Before: std::thread's std::system_error left Lookup (RuntimeError).
    result = run_python(_LOOKUP_WITHOUT_THREADS, KVSPARSE_NUM_THREADS="4")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


_PARALLEL_FOR_TEST = r"""
#include <atomic>
#include <cstdio>
#include <stdexcept>
#include <vector>

#include "parallel.h"

int main() {
  // A range that throws, in a worker (the last range) and on the calling thread (the first).
  for (const int64_t bad : {int64_t{999999}, int64_t{0}}) {
    std::vector<std::atomic<int>> done(1000000);
    try {
      kvsparse::ParallelFor(1000000, 1000, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) done[i] = 1;
        if (begin <= bad && bad < end) throw std::runtime_error("range failed");
      });
      std::puts("no exception");
      return 1;
    } catch (const std::runtime_error& e) {
      for (const auto& d : done) {
        if (d != 1) {
          std::puts("a range did not run");
          return 1;
        }
      }
    }
  }
  std::puts("ok");
  return 0;
}
"""


def test_an_exception_in_a_parallel_for_worker_reaches_the_caller(tmp_path):
    # Before: the exception left the std::thread's function: std::terminate (SIGABRT).
    compiler = (sysconfig.get_config_var("CXX") or "c++").split()[0]
    source = tmp_path / "parallel_test.cc"
    source.write_text(textwrap.dedent(_PARALLEL_FOR_TEST))
    binary = tmp_path / "parallel_test"
    subprocess.run(
        [
            compiler,
            "-std=c++17",
            "-O1",
            "-pthread",
            f"-I{REPO / 'csrc'}",
            str(source),
            "-o",
            str(binary),
        ],
        check=True,
        timeout=120,
    )
    result = subprocess.run(
        [str(binary)],
        env={**os.environ, "KVSPARSE_NUM_THREADS": "4"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", (
        result.returncode,
        result.stdout,
        result.stderr,
    )


# -- 17. small tables cost little --------------------------------------------------------------

_MANY_SMALL_TABLES = """
import json
import numpy as np
import kvsparse
from kvsparse import initializers, optimizers

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

kv = kvsparse.create("local")
kv.set_optimizer(optimizers.Adam(learning_rate=0.01))
start = rss()
for i in range(200):
    kv.init(f"t{i}", kvsparse.SparseTable(dim=16, initializer=initializers.Normal(0.0, 0.01)))
    kv.push(f"t{i}", (np.array([i]), np.ones((1, 16), np.float32)))
grown = rss() - start
tables = kv.stats()["tables"]
print(json.dumps({"rss_growth": grown, "rows": sum(t["rows"] for t in tables.values()),
                  "tables": len(tables)}))
"""


def test_a_table_of_one_row_costs_a_few_kib():
    # Before: a full chunk (about 2 MiB) per row array: 6.8 MB counted per one-row table.
    tables = [_core.Table(16, {"kind": "normal", "b": 0.01}, {"kind": "adam"}) for _ in range(200)]
    for i, table in enumerate(tables):
        table.apply_gradients(ids([i]), np.ones((1, 16), np.float32))
    per_table = sum(table.memory_bytes() for table in tables) / len(tables)
    assert per_table < 8 * 1024, per_table


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_two_hundred_one_row_tables_grow_rss_by_megabytes_not_gigabytes():
    # Before: 200 one-row tables cost 805 MiB.
    result = run_python(_MANY_SMALL_TABLES)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tables"] == 200 and report["rows"] == 200
    assert report["rss_growth"] < 32 * 2**20, report


def test_a_table_grown_row_by_row_keeps_every_row():
    # The first chunk grows by doubling and moves its rows: they must survive every move.
    table = _core.Table(3, {"kind": "uniform", "a": -1.0, "b": 1.0}, {"kind": "adagrad"})
    keys = np.arange(5000) * 7919
    expected = np.empty((keys.size, 3), np.float32)
    for start in range(0, keys.size, 37):
        part = keys[start : start + 37]
        table.apply_gradients(part, np.ones((part.size, 3), np.float32))
        expected[start : start + 37] = table.lookup(part)
    np.testing.assert_array_equal(table.lookup(keys), expected)
    assert table.read_state(keys)[2].tolist() == [1] * keys.size
