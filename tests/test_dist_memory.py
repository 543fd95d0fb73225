"""No local copy: a table grows to >= 500 MB on the servers while the worker's memory does not.

The test process is the worker. It pushes ~1.1M new rows (dim 64, Adagrad:
value + one slot per row) in batches and measures its own resident set
size (psutil) before and after.
"""

from __future__ import annotations

import resource
import sys

import numpy as np
import psutil
import pytest
from conftest import ServerProcess

import kvsparse
from kvsparse import errors, initializers, optimizers

DIM = 64
BATCH = 65536
TARGET_BYTES = 500 * 2**20


def resident_bytes() -> int:
    return psutil.Process().memory_info().rss


def test_the_table_grows_on_the_servers_not_in_the_worker(server_factory):
    servers = server_factory(2)
    kv = kvsparse.create("dist_sparse", servers=servers, timeout=120)
    kv.init("big", kvsparse.SparseTable(dim=DIM, initializer=initializers.Constant(1.0)))
    kv.set_optimizer(optimizers.Adagrad(learning_rate=0.5))
    grads = np.ones((BATCH, DIM), np.float32)
    next_id = 0

    def push_batch():
        nonlocal next_id
        ids = np.arange(next_id, next_id + BATCH, dtype=np.int64)
        next_id += BATCH
        kv.push("big", (ids, grads))

    # Warm-up: the first batches settle the allocator's pools and ZeroMQ's buffers.
    for _ in range(2):
        push_batch()
    before = resident_bytes()
    server_bytes = 0
    batches = 0
    while server_bytes < TARGET_BYTES:
        push_batch()
        batches += 1
        if batches % 4 == 0:
            server_bytes = kv.stats()["tables"]["big"]["bytes"]
        assert batches < 64, "the table stopped growing"
    server_bytes = kv.stats()["tables"]["big"]["bytes"]
    after = resident_bytes()
    stats = kv.stats()
    assert stats["tables"]["big"]["rows"] == next_id
    assert server_bytes >= TARGET_BYTES
    growth = after - before
    print(f"worker RSS growth {growth / 2**20:.1f} MiB, servers {server_bytes / 2**20:.0f} MiB")
    assert growth < 0.05 * server_bytes, (
        f"worker RSS grew by {growth / 2**20:.1f} MiB while the servers grew to "
        f"{server_bytes / 2**20:.0f} MiB"
    )
    # The rows are really there: one Adagrad step of lr 0.5 on a gradient of ones.
    reference = kvsparse.create("local")
    reference.init("big", kvsparse.SparseTable(dim=DIM, initializer=initializers.Constant(1.0)))
    reference.set_optimizer(optimizers.Adagrad(learning_rate=0.5))
    reference.push("big", (np.array([0]), np.ones((1, DIM), np.float32)))
    sample = np.array([0, next_id // 2, next_id - 1])
    np.testing.assert_array_equal(
        kv.row_sparse_pull("big", row_ids=sample),
        np.repeat(reference.row_sparse_pull("big", row_ids=np.array([0])), 3, axis=0),
    )
    kv.close()


def _limit_address_space(pid: int, extra_bytes: int) -> None:
    """Caps pid's address space at what it maps now plus extra_bytes (RLIMIT_AS)."""
    with open(f"/proc/{pid}/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    resource.prlimit(pid, resource.RLIMIT_AS, (mapped + extra_bytes, resource.RLIM_INFINITY))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/statm")
def test_a_server_out_of_memory_answers_memory_error_and_serves_on():
    # Before: the worker got ServerError, and the server printed a traceback.
    server = ServerProcess()
    try:
        kv = kvsparse.create("dist_sparse", servers=[server.address], timeout=60)
        dim = 1024
        kv.init("oom", kvsparse.SparseTable(dim=dim, initializer=initializers.Zeros()))
        kv.set_optimizer(optimizers.Adam(learning_rate=0.1))  # three floats per value
        kv.push("oom", (np.array([0]), np.ones((1, dim), np.float32)))
        _limit_address_space(server.process.pid, 64 * 2**20)
        # A push of 16 MB of rows needs 48 MB of new rows and slots, a pull of 100k new
        # ids 1.2 GB of them (and a 400 MB reply): neither fits, each fails whole.
        ids = np.arange(1, 4097)
        with pytest.raises(MemoryError) as push_error:
            kv.push("oom", (ids, np.ones((ids.size, dim), np.float32)))
        with pytest.raises(MemoryError) as pull_error:
            kv.row_sparse_pull("oom", row_ids=np.arange(10_000, 110_000))
        for error in (push_error.value, pull_error.value):
            assert isinstance(error, errors.CapacityError), repr(error)
            assert server.address in str(error)
        resource.prlimit(server.process.pid, resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)
        # Nothing of the failed push was applied, and the server serves on.
        kv.push("oom", (np.array([0, 1]), np.ones((2, dim), np.float32)))
        rows = kv.row_sparse_pull("oom", row_ids=np.array([0, 1, 2]))
        assert rows[0, 0] < rows[1, 0] < 0 and rows[2, 0] == 0
        kv.close()
    finally:
        server.stop()
    log = server.error_output()
    assert "Traceback" not in log, log
    assert log.count("kvsparse server: out of memory in a") == 2, log
