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
