"""Several workers as separate processes against real servers: BSP, ASP, SSP, init, barrier.

Workers are Python scripts run by conftest.run_workers with KVSPARSE_SERVERS,
KVSPARSE_RANK and KVSPARSE_NUM_WORKERS set; ``kvsparse.create(kind)`` with no
arguments reads them. Each prints one JSON line that the test checks.
Orderings between workers are forced with barriers, marker files and the
servers' own count of held requests (stats()['shards'][i]['waiting']), never
with sleeps.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import last_json, run_workers

import kvsparse
from kvsparse import optimizers

PRELUDE = """
import json, sys, time
from pathlib import Path
import numpy as np
import kvsparse
from kvsparse import errors, initializers, optimizers

def wait_until(condition, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)
"""

ENV = {"KVSPARSE_TIMEOUT": "30"}

BSP_SCRIPT = (
    PRELUDE
    + """
kv = kvsparse.create('dist_sync')
rank, n = kv.rank, kv.num_workers
kv.init('emb', kvsparse.SparseTable(dim=3, initializer=initializers.Zeros()))
# Every worker initializes 'w'; rank 0's value is the one everyone sees.
kv.init('w', np.full(5, 100.0 if rank == 0 else -1.0 - rank, np.float32))
w0 = kv.pull('w').tolist()
kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
history = []
for step in range(1, 4):
    ids = np.array([0, 1 + rank, 10 * step])
    grads = np.full((3, 3), (rank + 1) * step, np.float32)
    kv.push(['emb', 'w'], [(ids, grads), np.full(5, float(rank + 1), np.float32)])
    rows = kv.row_sparse_pull('emb', row_ids=np.arange(40))
    history.append({"rows": rows[:, 0].tolist(), "w": kv.pull('w').tolist()})
kv.barrier()
print(json.dumps({"rank": rank, "num_workers": n, "num_servers": kv.num_servers,
                  "type": kv.type, "w0": w0, "history": history}))
"""
)


@pytest.mark.parametrize("num_servers, num_workers", [(1, 1), (2, 2), (3, 4), (1, 3)])
def test_bsp_steps_are_exact_on_every_worker(server_factory, tmp_path, num_servers, num_workers):
    servers = server_factory(num_servers)
    outputs = run_workers(BSP_SCRIPT, servers, num_workers, tmp_path, env=ENV)
    results = [last_json(out) for out in outputs]
    for rank, result in enumerate(results):
        assert result["rank"] == rank and result["num_workers"] == num_workers
        assert result["num_servers"] == num_servers and result["type"] == "dist_sync"
        assert result["w0"] == [100.0] * 5
        for step, seen in enumerate(result["history"], start=1):
            # After a BSP push returns, exactly steps 1..step of every worker are applied.
            expected = np.zeros(40)
            for s in range(1, step + 1):
                for r in range(num_workers):
                    for i in (0, 1 + r, 10 * s):
                        expected[i] -= (r + 1) * s
            np.testing.assert_array_equal(seen["rows"], expected)
            total = sum(r + 1 for r in range(num_workers))
            np.testing.assert_array_equal(seen["w"], [100.0 - step * total] * 5)


ROUND_SCRIPT = (
    PRELUDE
    + """
kv = kvsparse.create('dist_sync')
rank = kv.rank
kv.init('emb', kvsparse.SparseTable(dim=4, initializer=initializers.Constant(0.5)))
kv.init('w', np.full(6, 0.5, np.float32))
kv.set_optimizer(optimizers.Adagrad(learning_rate=0.1))
rng = np.random.default_rng(100 + rank)
for step in range(3):
    ids = rng.choice(50, size=20, replace=False)
    kv.push(['emb', 'w'], [(ids, rng.standard_normal((20, 4)).astype(np.float32)),
                           rng.standard_normal(6).astype(np.float32)])
print(json.dumps({"rows": kv.row_sparse_pull('emb', row_ids=np.arange(50)).tolist(),
                  "w": kv.pull('w').tolist()}))
"""
)


def test_bsp_applies_the_sum_of_each_round_once(server_factory, tmp_path):
    """With Adagrad, one update with the summed gradient differs from one update per worker."""
    num_workers = 3
    outputs = run_workers(ROUND_SCRIPT, server_factory(2), num_workers, tmp_path, env=ENV)
    local = kvsparse.create("local")
    local.init("emb", kvsparse.SparseTable(dim=4, initializer=kvsparse.initializers.Constant(0.5)))
    local.init("w", np.full(6, 0.5, np.float32))
    local.set_optimizer(optimizers.Adagrad(learning_rate=0.1))
    apart = kvsparse.create("local")  # the same gradients applied one worker at a time
    apart.init("emb", kvsparse.SparseTable(dim=4, initializer=kvsparse.initializers.Constant(0.5)))
    apart.set_optimizer(optimizers.Adagrad(learning_rate=0.1))
    rngs = [np.random.default_rng(100 + r) for r in range(num_workers)]
    for _ in range(3):
        pushes = []
        for rng in rngs:
            ids = rng.choice(50, size=20, replace=False)
            pushes.append(
                (
                    ids,
                    rng.standard_normal((20, 4)).astype(np.float32),
                    rng.standard_normal(6).astype(np.float32),
                )
            )
        local.push("emb", [(ids, grads) for ids, grads, _ in pushes])
        local.push("w", [dense for _, _, dense in pushes])
        for ids, grads, _ in pushes:
            apart.push("emb", (ids, grads))
    expected_rows = local.row_sparse_pull("emb", row_ids=np.arange(50))
    for out in outputs:
        result = last_json(out)
        np.testing.assert_allclose(result["rows"], expected_rows, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(result["w"], local.pull("w"), rtol=1e-6, atol=1e-7)
    separate = apart.row_sparse_pull("emb", row_ids=np.arange(50))
    assert not np.allclose(separate, expected_rows, rtol=1e-4)


ASP_SCRIPT = (
    PRELUDE
    + """
kv = kvsparse.create('dist_async')
rank = kv.rank
kv.init(['emb', 'w'], [kvsparse.SparseTable(dim=2, initializer=initializers.Zeros()),
                       np.zeros(3, np.float32)])
kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
kv.barrier()
mine = None
if rank == 0:
    # Worker 1 is waiting in the next barrier: in BSP this push would wait for it forever.
    for _ in range(3):
        kv.push(['emb', 'w'], [(np.array([5]), np.ones((1, 2), np.float32)),
                               np.ones(3, np.float32)])
    mine = [kv.row_sparse_pull('emb', row_ids=np.array([5])).tolist(), kv.pull('w').tolist()]
kv.barrier()
if rank == 1:
    kv.push(['emb', 'w'], [(np.array([5]), np.full((1, 2), 10.0, np.float32)),
                           np.full(3, 10.0, np.float32)])
kv.barrier()
final = [kv.row_sparse_pull('emb', row_ids=np.array([5])).tolist(), kv.pull('w').tolist()]
print(json.dumps({"type": kv.type, "mode": kv._backend.mode, "mine": mine, "final": final}))
"""
)


def test_asp_applies_pushes_on_arrival(server_factory, tmp_path):
    outputs = run_workers(ASP_SCRIPT, server_factory(2), 2, tmp_path, env=ENV)
    first, second = (last_json(out) for out in outputs)
    assert first["mode"] == second["mode"] == "asp"
    assert first["mine"] == [[[-3.0, -3.0]], [-3.0] * 3]
    for result in (first, second):
        assert result["final"] == [[[-13.0, -13.0]], [-13.0] * 3]


SSP_SCRIPT = (
    PRELUDE
    + """
kv = kvsparse.create('dist_async')  # KVSPARSE_STALENESS=1 makes it SSP(1)
rank = kv.rank
markers = Path(sys.argv[1])
kv.init('w', np.zeros(4, np.float32))
kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
kv.barrier()
result = {"mode": kv._backend.mode, "staleness": kv._backend.staleness}
if rank == 0:  # the fast worker
    kv.push('w', np.ones(4, np.float32))            # clock 1, the slow worker is at 0
    result["v1"] = kv.pull('w').tolist()            # 1 step ahead <= k: not held
    (markers / 'pulled1').touch()
    kv.push('w', np.ones(4, np.float32))            # clock 2
    (markers / 'about_to_pull').touch()
    result["v2"] = kv.pull('w').tolist()            # 2 steps ahead > k: held
else:  # the slow worker
    wait_until((markers / 'pulled1').exists, "the fast worker's first pull")
    wait_until((markers / 'about_to_pull').exists, "the fast worker's second pull")
    # Every server holds the fast worker's pull until this worker advances.
    wait_until(lambda: all(s['waiting']['ssp_pulls'] == 1 for s in kv.stats()['shards']),
               "the servers to hold the pull")
    result["held"] = True
    kv.push('w', np.full(4, 10.0, np.float32))      # clock 1: releases it
kv.barrier()
result["final"] = kv.pull('w').tolist()
print(json.dumps(result))
"""
)


def test_ssp_holds_a_worker_more_than_k_steps_ahead(server_factory, tmp_path):
    outputs = run_workers(
        SSP_SCRIPT,
        server_factory(2),
        2,
        tmp_path,
        env={**ENV, "KVSPARSE_STALENESS": "1"},
        args=[tmp_path],
    )
    fast, slow = (last_json(out) for out in outputs)
    assert fast["mode"] == slow["mode"] == "ssp" and fast["staleness"] == 1
    assert fast["v1"] == [-1.0] * 4  # not held at 1 step ahead: the slow worker had not pushed
    assert slow["held"] is True
    # Released only by the slow worker's push, so the held pull sees it.
    assert fast["v2"] == [-12.0] * 4
    assert fast["final"] == slow["final"] == [-12.0] * 4


INIT_SCRIPT = (
    PRELUDE
    + """
kv = kvsparse.create('dist_sync')
rank = kv.rank
result = {}
kv.init('emb', kvsparse.SparseTable(dim=4, seed=9))     # identical everywhere: fine
kv.init('w', np.full((2, 3), 7.0 if rank == 0 else float(rank), np.float32))
result["w"] = kv.pull('w').tolist()                     # rank 0's value, right after init
result["rows"] = kv.row_sparse_pull('emb', row_ids=np.arange(6)).tolist()
if rank == 0:
    kv.init('other', kvsparse.SparseTable(dim=4))
    kv.init('v', np.zeros(4, np.float32))
kv.set_optimizer(optimizers.SGD(learning_rate=0.5))
kv.barrier()
if rank == 1:
    try:
        kv.init('other', kvsparse.SparseTable(dim=8))   # another spec for an existing table
    except errors.DuplicateKey as exc:
        result["other"] = type(exc).__name__
if rank == 2:
    try:
        kv.init('v', np.zeros(5, np.float32))           # another shape than rank 0's
    except errors.DuplicateKey as exc:
        result["v"] = type(exc).__name__
# The second set_optimizer: rank 1 disagrees with rank 0.
try:
    kv.set_optimizer(optimizers.Adagrad() if rank == 1 else optimizers.SGD(learning_rate=0.25))
    result["second_optimizer"] = "ok"
except errors.InvalidArgument as exc:
    result["second_optimizer"] = type(exc).__name__
kv.barrier()
print(json.dumps(result))
"""
)


def test_init_from_several_workers(server_factory, tmp_path):
    outputs = run_workers(INIT_SCRIPT, server_factory(2), 3, tmp_path, env=ENV)
    results = [last_json(out) for out in outputs]
    expected_rows = kvsparse.create("local")
    expected_rows.init("emb", kvsparse.SparseTable(dim=4, seed=9))
    rows = expected_rows.row_sparse_pull("emb", row_ids=np.arange(6))
    for result in results:
        assert result["w"] == [[7.0] * 3] * 2
        np.testing.assert_array_equal(result["rows"], rows)
    assert results[1]["other"] == "DuplicateKey"
    assert results[2]["v"] == "DuplicateKey"
    assert [r["second_optimizer"] for r in results] == ["ok", "InvalidArgument", "ok"]


BARRIER_SCRIPT = (
    PRELUDE
    + """
kv = kvsparse.create('dist_sparse')
rank, n = kv.rank, kv.num_workers
markers = Path(sys.argv[1])
for generation in range(3):
    (markers / f'{generation}-{rank}').touch()
    kv.barrier()
    # Everyone touched its marker before anyone left the barrier.
    missing = [r for r in range(n) if not (markers / f'{generation}-{r}').exists()]
    assert not missing, (generation, missing)
print(json.dumps({"rank": rank, "ok": True}))
"""
)


def test_barrier_waits_for_every_worker(server_factory, tmp_path):
    outputs = run_workers(BARRIER_SCRIPT, server_factory(2), 4, tmp_path, env=ENV, args=[tmp_path])
    assert [last_json(out) for out in outputs] == [{"rank": r, "ok": True} for r in range(4)]


THREADS_BSP_SCRIPT = (
    PRELUDE
    + """
import threading
kv = kvsparse.create('dist_sparse')
rank, n = kv.rank, kv.num_workers
threads, steps = 2, 4
for t in range(threads):
    kv.init(f'emb{t}', kvsparse.SparseTable(dim=2, initializer=initializers.Zeros()))
kv.init('w', np.zeros(3, np.float32))
kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
failures = []

def train(t):
    try:
        for step in range(1, steps + 1):
            ids = np.array([t, 10 + rank, 100 + step])
            grads = np.full((3, 2), (rank + 1) * (t + 1) * step, np.float32)
            # Each thread its own table, and every thread the same dense key.
            kv.push([f'emb{t}', 'w'], [(ids, grads), np.full(3, float(t + 1), np.float32)])
            kv.row_sparse_pull(f'emb{t}', row_ids=ids)
    except BaseException as exc:
        failures.append(repr(exc))

workers = [threading.Thread(target=train, args=(t,)) for t in range(threads)]
for w in workers:
    w.start()
for w in workers:
    w.join()
kv.barrier()
rows = {t: kv.row_sparse_pull(f'emb{t}', row_ids=np.arange(120))[:, 0].tolist()
        for t in range(threads)}
print(json.dumps({"failures": failures, "rows": rows, "w": kv.pull('w').tolist()}))
kv.close()
"""
)


def test_bsp_with_several_threads_per_worker_is_exact(server_factory, tmp_path):
    # Two threads per worker, each pushing its own table (fused with a dense key every
    # thread pushes): a thread waiting for its round must not keep the other thread's push
    # from being sent, or each worker waits for a table the other one never pushes.
    threads, steps, num_workers = 2, 4, 2
    outputs = run_workers(
        THREADS_BSP_SCRIPT, server_factory(1), num_workers, tmp_path, env=ENV, timeout=90
    )
    for result in map(last_json, outputs):
        assert result["failures"] == []
        for t in range(threads):
            expected = np.zeros(120)
            for r in range(num_workers):
                for step in range(1, steps + 1):
                    for i in (t, 10 + r, 100 + step):
                        expected[i] -= (r + 1) * (t + 1) * step
            np.testing.assert_array_equal(result["rows"][str(t)], expected)
        total = num_workers * steps * sum(t + 1 for t in range(threads))
        np.testing.assert_array_equal(result["w"], [-total] * 3)


HELD_SCRIPT = (
    PRELUDE
    + """
kv = kvsparse.create('dist_sparse')
rank = kv.rank
for name in ('a', 'b'):
    kv.init(name, kvsparse.SparseTable(dim=2, initializer=initializers.Zeros()))
kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
kv.barrier()
start = time.monotonic()
try:
    # Each worker pushes a table the other never pushes: neither round can complete.
    kv.push('ab'[rank], (np.array([1]), np.ones((1, 2), np.float32)))
    outcome, is_timeout = "returned", False
except errors.WaitTimeout as exc:
    outcome, is_timeout = f"{type(exc).__name__}: {exc}", isinstance(exc, TimeoutError)
print(json.dumps({"outcome": outcome, "is_timeout": is_timeout,
                  "seconds": time.monotonic() - start}), flush=True)
# Neither exits before both have their outcome: a worker that leaves fails the other's
# held push with WorkerLeft.
Path(f'done{rank}').touch()
wait_until(lambda: Path(f'done{1 - rank}').exists(), "the other worker's outcome")
"""
)


def test_a_bsp_round_that_never_completes_fails_with_a_named_timeout(server_factory, tmp_path):
    # The server holds both pushes and answers pings meanwhile: without a bound on the hold,
    # both workers waited for ever.
    env = {"KVSPARSE_TIMEOUT": "0.5"}  # held requests wait at most HOLD_FACTOR x 0.5 s
    outputs = run_workers(HELD_SCRIPT, server_factory(1), 2, tmp_path, env=env, timeout=60)
    for result in map(last_json, outputs):
        assert result["outcome"].startswith("WaitTimeout: PUSH_SPARSE request"), result
        assert "a BSP round" in result["outcome"] and "KVSPARSE_TIMEOUT" in result["outcome"]
        assert result["is_timeout"]
