"""kvsparse.ray on a local Ray cluster: server actors, worker tasks, a restarted shard, shutdown.

One module-scoped Ray instance (``ray.init`` on this machine, 4 logical CPUs:
2 server actors + 2 worker tasks) serves the tests; it is shut down at the
end and the test checks that no process it started is left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from conftest import REPO_ROOT, subprocess_env  # noqa: E402

import kvsparse  # noqa: E402 - after the skips
import kvsparse.ray as kvsparse_ray  # noqa: E402
from kvsparse.client.remote import ping  # noqa: E402

LEARNING_RATE = 0.5
NUM_IDS = 40
BOUNDARY = 20  # RangePartitioner: ids < 20 on shard 0, the rest on shard 1


def _session_processes(session: int) -> list:
    """Pids of the live processes of a session (a child started with start_new_session)."""
    pids = []
    for process in psutil.process_iter(["pid", "status"]):
        try:
            if os.getsid(process.pid) == session and process.status() != psutil.STATUS_ZOMBIE:
                pids.append(process.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return pids


def test_movielens_example_on_ray():
    """examples/movielens_ray.py: its own local Ray, 2 server actors, 2 worker tasks."""
    pytest.importorskip("torch")
    process = subprocess.Popen(
        [sys.executable, "examples/movielens_ray.py", "--num-servers", "2", "--num-workers", "2"],
        cwd=str(REPO_ROOT),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, err[-3000:]
    found = re.search(r"^held-out AUC: (\d\.\d{4})$", out, re.MULTILINE)
    assert found, out[-3000:]
    assert float(found.group(1)) >= 0.75
    # Ray's processes and the servers were all started inside the example's session.
    left = _session_processes(process.pid)
    deadline = time.monotonic() + 30
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _session_processes(process.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"the example left processes behind: {left}"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids, seconds: float = 30.0) -> list:
    """The pids still alive after waiting up to `seconds` for them to exit."""
    deadline = time.monotonic() + seconds
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if _alive(p)]
    return left


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance just for this module; shut down (and checked) at the end."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=80 * 2**20,
        log_to_driver=False,
        # The workers import kvsparse from this checkout, like the test process.
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
    )
    try:
        yield
    finally:
        started = {p.pid for p in psutil.Process().children(recursive=True)} - before
        ray.shutdown()
        left = _wait_gone(started)
        for pid in left:  # only processes this fixture started; reported as a failure below
            os.kill(pid, signal.SIGKILL)
        assert not left, f"ray.shutdown() left processes behind: {left}"


def _train_task():
    """A Ray task: one worker of the job, BSP steps of SGD on table 'emb'.

    It trains `before` steps; rank 0 then checkpoints into save_dir (if given);
    then all train `after` more steps. It returns the rows of all ids.
    """

    @ray.remote(num_cpus=1)
    def train(arguments, before, save_dir=None, after=0):
        import numpy as np

        import kvsparse

        kv = kvsparse.create("dist_sparse", **arguments)
        if "emb" not in kv:
            kv.init(
                "emb",
                kvsparse.SparseTable(
                    dim=4,
                    initializer=kvsparse.initializers.Zeros(),
                    optimizer=kvsparse.optimizers.SGD(learning_rate=0.5),
                    partitioner=kvsparse.table.RangePartitioner([20]),
                ),
            )
        ids = np.arange(40, dtype=np.int64)
        gradient = np.full((40, 4), arguments["rank"] + 1, np.float32)
        for _ in range(before):
            kv.push("emb", (ids, gradient))
        if save_dir is not None and arguments["rank"] == 0:
            kv.save(save_dir)
        kv.barrier()
        for _ in range(after):
            kv.push("emb", (ids, gradient))
        rows = kv.row_sparse_pull("emb", row_ids=ids)
        kv.barrier()
        kv.close()
        return rows

    return train


def _wait_for(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _cmdline(pid: int) -> list:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().split("\0")


def test_servers_workers_restart_from_checkpoint_and_shutdown(ray_cluster, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    group = kvsparse_ray.start_servers(
        2, host="127.0.0.1", max_restarts=3, checkpoint_dir=str(checkpoints)
    )
    try:
        assert len(group.addresses) == 2
        assert all(a.startswith("tcp://127.0.0.1:") for a in group.addresses)
        assert kvsparse_ray.find_servers() == group.addresses
        infos = group.info()
        assert [i["restarts"] for i in infos] == [0, 0]
        # The servers are children of the actors, not of this process.
        for info in infos:
            assert psutil.Process(info["pid"]).ppid() == info["actor_pid"]
        env = group.environment(1, 2)
        assert env["KVSPARSE_SERVERS"] == ",".join(group.addresses)
        assert (env["KVSPARSE_RANK"], env["KVSPARSE_NUM_WORKERS"]) == ("1", "2")
        assert env["KVSPARSE_CHECKPOINT_DIR"] == str(checkpoints)
        assert float(env["KVSPARSE_RETRY_WINDOW"]) > 0

        def run(before, save_dir=None, after=0):
            arguments = [group.store_arguments(r, 2, timeout=30) for r in range(2)]
            tasks = [train.remote(a, before, save_dir, after) for a in arguments]
            return ray.get(tasks, timeout=60)

        # Two worker tasks: 3 steps, a checkpoint, 1 more step.
        train = _train_task()
        step = -LEARNING_RATE * 3  # each step the servers apply the summed gradient 1 + 2
        for rows in run(3, str(checkpoints), after=1):
            np.testing.assert_allclose(rows, np.full((NUM_IDS, 4), 4 * step), rtol=1e-6)

        # Kill shard 1's actor: its server dies with it (PR_SET_PDEATHSIG); Ray restarts
        # the actor, which binds the same address and restores the checkpoint.
        old = infos[1]
        ray.kill(group.actors[1], no_restart=False)
        assert not _wait_gone([old["pid"], old["actor_pid"]]), "the killed shard's processes live"
        group.wait_ready()
        infos = group.info()
        assert [i["restarts"] for i in infos] == [0, 1]
        assert [i["restored"] for i in infos] == [False, True]
        assert [i["address"] for i in infos] == group.addresses
        assert infos[1]["pid"] != old["pid"] and infos[1]["actor_pid"] != old["actor_pid"]
        # The replacement knows it replaces a dead server (its BSP rounds recover).
        assert ["--restarted" in _cmdline(i["pid"]) for i in infos] == [False, True]
        # Shard 1 holds the checkpoint's 3 steps (the 4th came after it; with no
        # checkpoint it would hold zeros); shard 0 kept its 4.
        expected = np.full((NUM_IDS, 4), 3 * step, np.float32)
        expected[:BOUNDARY] = 4 * step
        for rows in run(0):
            np.testing.assert_allclose(rows, expected, rtol=1e-6)

        # Kill the server process alone: its actor exits and Ray restarts the shard,
        # from the same checkpoint; training goes on from there.
        os.kill(infos[1]["pid"], signal.SIGKILL)
        assert _wait_for(lambda: group.info()[1]["restarts"] == 2)
        group.wait_ready()
        assert group.info()[1]["address"] == group.addresses[1]
        assert group.info()[1]["restored"]
        for rows in run(1):
            np.testing.assert_allclose(rows, expected + step, rtol=1e-6)

        final = group.info()
    finally:
        group.shutdown()
    pids = [i["pid"] for i in final] + [i["actor_pid"] for i in final]
    assert not _wait_gone(pids), "shutdown() left a server or actor process"
    with pytest.raises(kvsparse.errors.InvalidArgument):
        kvsparse_ray.find_servers()


def test_start_servers_rejects_a_second_group_of_the_same_name(ray_cluster):
    with kvsparse_ray.start_servers(1, host="127.0.0.1") as group:
        with pytest.raises(kvsparse.errors.InvalidArgument, match="already runs"):
            kvsparse_ray.start_servers(1, host="127.0.0.1")
        assert ping(group.addresses[0], timeout=5.0)
        server_pid = group.info()[0]["pid"]
    assert not _wait_gone([server_pid])
    with pytest.raises(kvsparse.errors.InvalidArgument):
        kvsparse_ray.start_servers(0)


def test_restart_dead_starts_a_shard_out_of_restarts_on_its_address(ray_cluster):
    with kvsparse_ray.start_servers(2, host="127.0.0.1", max_restarts=0) as group:
        addresses = group.addresses
        old = group.info()[0]
        ray.kill(group.actors[0])  # no_restart=True: dead for good, as after max_restarts
        assert not _wait_gone([old["pid"], old["actor_pid"]])
        assert group.restart_dead() == [0]
        assert group.addresses == addresses
        infos = group.info()
        assert [i["restarts"] for i in infos] == [1, 0]
        assert infos[0]["pid"] != old["pid"]
        assert all(ping(a, timeout=5.0) for a in addresses)
        assert group.restart_dead() == []


# -- colocated workers on Ray: each worker actor hosts its shard ---------------------------


def _colocated_job():
    """The training code of a worker, the same for dist_sparse tasks and colocated actors.

    `steps` BSP steps: each rank pushes gradients of its own (seeded by rank
    and step) for overlapping ids of table 'emb' (Adagrad) and for dense key
    'w', fused in one push. It returns the rows of every id, 'w', its
    backend's class and KVSPARSE_RESTARTED.
    """

    def job(arguments, steps):
        import numpy as np

        import kvsparse
        from kvsparse import config

        kv = kvsparse.create("dist_sparse", **arguments)
        kv.init(
            "emb",
            kvsparse.SparseTable(
                dim=3,
                initializer=kvsparse.initializers.Uniform(-1.0, 1.0),
                optimizer=kvsparse.optimizers.Adagrad(learning_rate=0.1),
                seed=7,
            ),
        )
        kv.init("w", np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(2, 3))
        for step in range(kv.clock, steps):
            rng = np.random.default_rng(100 * step + kv.rank)
            ids = rng.integers(-30, 30, size=12)
            kv.push(
                ["emb", "w"],
                [
                    (ids, rng.standard_normal((12, 3)).astype(np.float32)),
                    rng.standard_normal((2, 3)).astype(np.float32),
                ],
            )
        kv.barrier()
        rows = kv.row_sparse_pull("emb", row_ids=np.arange(-30, 30, dtype=np.int64))
        dense = kv.pull("w")
        backend = type(kv._backend).__name__
        kv.close()
        return rows, dense, backend, config.restarted()

    return job


def test_colocated_on_ray_gives_the_tables_of_dist_sparse_with_as_many_servers(ray_cluster):
    job = _colocated_job()
    with kvsparse_ray.start_servers(2, host="127.0.0.1") as servers:
        task = ray.remote(num_cpus=1)(job)
        dist = ray.get(
            [task.remote(servers.store_arguments(rank, 2, timeout=30), 5) for rank in range(2)],
            timeout=120,
        )
    with kvsparse_ray.start_colocated(2, host="127.0.0.1") as group:
        assert len(set(group.addresses)) == 2
        assert all(a.startswith("tcp://127.0.0.1:") for a in group.addresses)
        env = group.environment(1)
        assert env["KVSPARSE_PEERS"] == ",".join(group.addresses)
        assert (env["KVSPARSE_RANK"], env["KVSPARSE_NUM_WORKERS"]) == ("1", "2")
        assert "KVSPARSE_RESTARTED" not in env and "KVSPARSE_REJOIN_WINDOW" not in env
        infos = group.info()
        assert [i["address"] for i in infos] == group.addresses
        # The same code, no arguments: the environment makes it colocated.
        colocated = group.run(job, {}, 5, timeout=120)
        # A second job on the same actors binds the same addresses again.
        again = group.run(job, {}, 5, timeout=120)
        actor_pids = [i["actor_pid"] for i in group.info()]
    assert [r[2] for r in dist] == ["RemoteBackend"] * 2
    assert [r[2] for r in colocated] == ["ColocatedBackend"] * 2
    assert [r[3] for r in colocated] == [0, 0]
    for rows, dense, _, _ in colocated + dist:
        np.testing.assert_array_equal(rows, dist[0][0])
        np.testing.assert_array_equal(dense, dist[0][1])
    # The shards went with the first job's stores: the second job started from nothing
    # (not as a restarted worker) and trained the same tables again.
    assert [r[2:] for r in again] == [("ColocatedBackend", 0)] * 2
    for rows, dense, _, _ in again:
        np.testing.assert_array_equal(rows, dist[0][0])
        np.testing.assert_array_equal(dense, dist[0][1])
    assert not _wait_gone(actor_pids), "shutdown() left a worker actor's process"


def test_start_colocated_rejects_bad_options(ray_cluster):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(kvsparse.errors.InvalidArgument, match="num_workers"):
            kvsparse_ray.start_colocated(bad)
    with pytest.raises(kvsparse.errors.InvalidArgument, match="max_restarts"):
        kvsparse_ray.start_colocated(2, max_restarts=-2)
    with pytest.raises(kvsparse.errors.InvalidArgument, match="KVSPARSE_RANK"):
        kvsparse_ray.start_colocated(2, env={"KVSPARSE_RANK": "1"})
    with pytest.raises(kvsparse.errors.InvalidArgument, match="staleness"):
        kvsparse_ray.start_colocated(2, staleness=-1)


def _checkpointed_job():
    """A worker that checkpoints after `save_at` of `steps` SGD steps and may stop there.

    Rank 1, on its first start, writes `markers`/reached after its push of
    step save_at and waits for `markers`/go (the test kills its actor in
    between); rank 0 saves a checkpoint after that step and writes
    `markers`/saved. A restarted rank resumes at kv.clock.
    """

    def job(steps, save_at, markers):
        import os
        import time

        import numpy as np

        import kvsparse
        from kvsparse import config

        kv = kvsparse.create("dist_sparse", timeout=60)
        kv.init(
            "emb",
            kvsparse.SparseTable(
                dim=4,
                initializer=kvsparse.initializers.Zeros(),
                optimizer=kvsparse.optimizers.SGD(learning_rate=0.5),
                partitioner=kvsparse.table.RangePartitioner([20]),
            ),
        )
        ids = np.arange(40, dtype=np.int64)
        gradient = np.full((40, 4), kv.rank + 1, np.float32)
        resumed = kv.clock
        for step in range(kv.clock, steps):
            kv.push("emb", (ids, gradient))
            if step + 1 != save_at or config.restarted():
                continue
            if kv.rank == 0:
                kv.save()  # into KVSPARSE_CHECKPOINT_DIR
                open(os.path.join(markers, "saved"), "w").close()
            else:
                open(os.path.join(markers, "reached"), "w").close()
                while not os.path.exists(os.path.join(markers, "go")):
                    time.sleep(0.05)
        rows = kv.row_sparse_pull("emb", row_ids=ids)
        kv.close()
        return rows, resumed, config.restarted()

    return job


def test_a_killed_colocated_worker_actor_restarts_on_its_shard_from_the_checkpoint(
    ray_cluster, tmp_path
):
    checkpoints, markers = tmp_path / "checkpoints", tmp_path / "markers"
    markers.mkdir()
    steps, save_at = 6, 3
    group = kvsparse_ray.start_colocated(
        2, host="127.0.0.1", max_restarts=2, checkpoint_dir=str(checkpoints), retry_window=60
    )
    try:
        env = group.environment(0)
        assert env["KVSPARSE_CHECKPOINT_DIR"] == str(checkpoints)
        assert float(env["KVSPARSE_REJOIN_WINDOW"]) == float(env["KVSPARSE_RETRY_WINDOW"]) == 60
        refs = group.submit(_checkpointed_job(), steps, save_at, str(markers))
        assert _wait_for(
            lambda: (markers / "saved").exists() and (markers / "reached").exists(), 120
        ), ray.get(refs, timeout=1)
        old = group.info()[1]
        # Rank 1's actor dies with its shard (steps 1-3 of both ranks); Ray restarts it on
        # the same address and runs its call again, which restores the checkpoint.
        ray.kill(group.actors[1], no_restart=False)
        assert not _wait_gone([old["actor_pid"]]), "the killed worker actor's process lives"
        (markers / "go").touch()
        results = ray.get(refs, timeout=180)
        infos = group.info()
    finally:
        group.shutdown()
    assert [i["restarts"] for i in infos] == [0, 1]
    assert [i["address"] for i in infos] == group.addresses
    assert infos[1]["actor_pid"] != old["actor_pid"]
    # Rank 1 restarted once and resumed at the last step it pushed (redone, to no shard:
    # both held it); rank 0 ran on. Without the checkpoint, shard 1 (ids >= 20) would have
    # lost steps 1-3: every push acknowledged before the checkpoint is applied once.
    assert [(r[1], r[2]) for r in results] == [(0, 0), (save_at - 1, 1)]
    expected = np.full((NUM_IDS, 4), -LEARNING_RATE * 3 * steps, np.float32)
    for rows, _, _ in results:
        np.testing.assert_allclose(rows, expected, rtol=1e-6)


def _failing_job():
    """Rank 1 raises at step 3 of 5; rank 0 pushes on (its push of step 3 waits for rank 1)."""

    def job():
        import numpy as np

        import kvsparse

        kv = kvsparse.create("dist_sparse", timeout=60)
        kv.init("emb", kvsparse.SparseTable(dim=2))
        ids = np.arange(40, dtype=np.int64)
        for step in range(5):
            if kv.rank == 1 and step == 3:
                raise RuntimeError("rank 1 fails")
            kv.push("emb", (ids, np.ones((40, 2), np.float32)))
        return kv.rank

    return job


def test_a_colocated_worker_actor_that_raises_fails_the_others_and_the_job(ray_cluster):
    with kvsparse_ray.start_colocated(2, host="127.0.0.1") as group:
        started = time.monotonic()
        refs = group.submit(_failing_job())
        with pytest.raises(ray.exceptions.RayTaskError, match="rank 1 fails"):
            ray.get(refs[1], timeout=60)
        with pytest.raises(ray.exceptions.RayTaskError) as failed:
            ray.get(refs[0], timeout=60)
        # Rank 1's stores closed without the barrier as its code raised: rank 0 hears it
        # from its own shard (rank 1 left) or from rank 1's (closed), not at its 60 s timeout.
        assert time.monotonic() - started < 30
        error = str(failed.value)
        assert ("WorkerLeft" in error and "rank 1" in error) or (
            "ServerUnavailable" in error and group.addresses[1] in error
        ), error
        # The actors live on (an exception is no process death) and run the next job;
        # one job at a time.
        refs = group.submit(_sleeping_job(), 2.0)
        with pytest.raises(kvsparse.errors.InvalidArgument, match="still runs"):
            group.submit(_sleeping_job(), 0.0)
        assert ray.get(refs, timeout=60) == [2.0, 2.0]


def _sleeping_job():
    def job(seconds):
        import time

        time.sleep(seconds)
        return seconds

    return job


def test_run_colocated_returns_each_ranks_result_and_ends_its_actors(ray_cluster):
    def job(scale):
        import kvsparse
        from kvsparse import config

        kv = kvsparse.create("dist_sparse")
        kv.close()
        return scale * kv.rank, config.colocated_peers()

    results = kvsparse_ray.run_colocated(job, 2, args=(10,), host="127.0.0.1")
    assert [r[0] for r in results] == [0, 10]
    assert results[0][1] == results[1][1] and len(set(results[0][1])) == 2
    with pytest.raises(kvsparse.errors.InvalidArgument):
        kvsparse_ray.find_servers(name_prefix=kvsparse_ray.WORKER_NAME_PREFIX)
