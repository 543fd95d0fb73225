"""Colocated mode: a shard inside every worker, against dist_sparse with N servers.

Every test runs real worker processes on 127.0.0.1 (or Unix sockets in a
temporary directory): colocated workers host their shards themselves;
dist_sparse workers use ``kvsparse server`` processes (conftest). The workers
of both kinds run the same code, tests/store_driver.py, with
``kvsparse.create('dist_sparse')``; only the environment makes it colocated
(``KVSPARSE_PEERS``), as ``kvsparse launch --colocated`` does.
"""

from __future__ import annotations

import itertools
import json
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT, run_workers, subprocess_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_driver import INITIALIZERS, OPTIMIZERS

DRIVER = Path(__file__).with_name("store_driver.py")
ANSWER_TIMEOUT = 120.0
_names = itertools.count()


class DrivenJob:
    """num_workers tests/store_driver.py processes, one store each, driven command by command."""

    def __init__(
        self, envs: list, workdir: Path, expected_backend: str, sockets: Path | None = None
    ):
        self.sockets = sockets  # the ipc sockets' directory, removed by close()
        self.processes = []
        self.lines: list[queue.Queue] = []
        self.stderr = []
        for env in envs:
            err = tempfile.TemporaryFile()
            process = subprocess.Popen(
                [sys.executable, str(DRIVER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=subprocess_env(env),
                cwd=str(workdir),
                text=True,
            )
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=_relay, args=(process.stdout, lines), daemon=True).start()
            self.processes.append(process)
            self.lines.append(lines)
            self.stderr.append(err)
        try:
            ready = self._answers()
            assert [r["ready"] for r in ready] == [expected_backend] * len(envs), ready
            assert [r["rank"] for r in ready] == list(range(len(envs)))
        except BaseException:
            self.close()
            raise

    @classmethod
    def colocated(cls, num_workers: int, workdir: Path) -> DrivenJob:
        """Workers hosting their shards on Unix sockets in workdir (ipc: no port to race for)."""
        sockets = Path(tempfile.mkdtemp(prefix="kvcolo-", dir="/tmp"))
        peers = ",".join(f"ipc://{sockets}/w{rank}" for rank in range(num_workers))
        envs = [
            {"KVSPARSE_PEERS": peers, "KVSPARSE_RANK": rank, "KVSPARSE_NUM_WORKERS": num_workers}
            for rank in range(num_workers)
        ]
        return cls(envs, workdir, "ColocatedBackend", sockets)

    @classmethod
    def dist(cls, servers: list, workdir: Path) -> DrivenJob:
        """len(servers) workers of dist_sparse on those servers."""
        envs = [
            {
                "KVSPARSE_SERVERS": ",".join(servers),
                "KVSPARSE_RANK": rank,
                "KVSPARSE_NUM_WORKERS": len(servers),
            }
            for rank in range(len(servers))
        ]
        return cls(envs, workdir, "RemoteBackend")

    def _answers(self) -> list:
        deadline = time.monotonic() + ANSWER_TIMEOUT
        answers = []
        for rank, lines in enumerate(self.lines):
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(f"worker {rank} gave no answer:\n{self._stderr(rank)}")
            answers.append(json.loads(line))
        for rank, found in enumerate(answers):
            if "error" in found:
                raise AssertionError(f"worker {rank} failed:\n{found['error']}")
        return answers

    def _stderr(self, rank: int) -> str:
        self.stderr[rank].seek(0)
        return self.stderr[rank].read().decode(errors="replace")

    def send(self, **command) -> list:
        """Sends command to every worker; returns their answers, by rank."""
        for process in self.processes:
            process.stdin.write(json.dumps(command) + "\n")
            process.stdin.flush()
        return self._answers()

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                try:
                    process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                    process.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + 30
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for err in self.stderr:
            err.close()
        if self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _relay(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def decode_dump(answer: dict) -> dict:
    return {name: np.frombuffer(bytes.fromhex(h), np.float32) for name, h in answer.items()}


ID_VALUES = st.one_of(st.integers(-20, 20), st.sampled_from([-(2**63), 2**63 - 1, 2**40]))


@st.composite
def programs(draw, num_workers: int):
    """A program for tests/store_driver.py: fresh keys, then pushes and optimizer changes."""
    prefix = f"c{next(_names)}_"
    tables = {
        f"{prefix}s{i}": [
            draw(st.integers(1, 4)),
            draw(st.integers(0, len(INITIALIZERS) - 1)),
            draw(st.integers(0, len(OPTIMIZERS) - 1)),
            draw(st.integers(0, 5)),
        ]
        for i in range(draw(st.integers(1, 2)))
    }
    dense = {
        f"{prefix}d{i}": [
            list(draw(st.sampled_from([(1,), (5,), (2, 3)]))),
            draw(st.integers(0, 9)),
        ]
        for i in range(draw(st.integers(0, 1)))
    }
    steps = [{"op": "set_optimizer", "index": 0}]  # the jobs outlive examples: start from none
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["push", "push", "push", "set_optimizer", "barrier"]))
        if op == "push":
            keys = draw(st.lists(st.sampled_from(sorted(tables) + sorted(dense)), min_size=1,
                                 max_size=3, unique=True))  # fmt: skip
            ids = {
                key: [draw(st.lists(ID_VALUES, max_size=6)) for _ in range(num_workers)]
                for key in keys
                if key in tables
            }
            steps.append({"op": "push", "keys": keys, "ids": ids, "seed": draw(st.integers(0, 99))})
        elif op == "set_optimizer":
            steps.append(
                {"op": "set_optimizer", "index": draw(st.integers(0, len(OPTIMIZERS) - 1))}
            )
        else:
            steps.append({"op": "barrier"})
    return {"tables": tables, "dense": dense, "steps": steps}


def touched_ids(program: dict) -> dict:
    """{table: every id pushed to it, plus ids never pushed}."""
    touched = {name: {-3, 0, 999} for name in program["tables"]}
    for step in program["steps"]:
        for name, per_rank in step.get("ids", {}).items():
            for ids in per_rank:
                touched[name].update(ids)
    return {name: sorted(ids) for name, ids in touched.items()}


def assert_same_dumps(first: list, second: list) -> None:
    """Every rank of both jobs holds the same values, bit for bit."""
    reference = decode_dump(first[0])
    for answers in (first, second):
        for answer in answers:
            found = decode_dump(answer)
            assert found.keys() == reference.keys()
            for name in reference:
                np.testing.assert_array_equal(found[name], reference[name], err_msg=name)


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_colocated_gives_the_tables_of_dist_sparse_with_as_many_servers(
    num_workers, tmp_path, server_factory
):
    servers = server_factory(num_workers)
    with (
        DrivenJob.colocated(num_workers, tmp_path) as colocated,
        DrivenJob.dist(servers, tmp_path) as dist,
    ):

        @settings(
            max_examples=10,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(program=programs(num_workers))
        def check(program):
            for job in (colocated, dist):
                job.send(cmd="run", program=program)
            dump = {
                "cmd": "dump",
                "tables": touched_ids(program),
                "dense": sorted(program["dense"]),
            }
            assert_same_dumps(colocated.send(**dump), dist.send(**dump))
            rows = [job.send(cmd="rows")[0] for job in (colocated, dist)]
            for name in list(program["tables"]) + list(program["dense"]):
                assert rows[0][name] == rows[1][name], name

        check()


def test_a_colocated_checkpoint_loads_into_dist_sparse_and_back(tmp_path, server_factory):
    servers = server_factory(2)

    def push(seed):
        ids = {"user": [[1, 2, 3, 40], [2, 5, -7]], "item": [[9, 10], [11, 2**40]]}
        return {"op": "push", "keys": ["user", "item", "w"], "ids": ids, "seed": seed}

    # Adagrad and Adam tables: the checkpoint must carry their slots and step counts.
    first = {
        "tables": {"user": [4, 2, 3, 1], "item": [3, 3, 4, 2]},
        "dense": {"w": [[5], 7]},
        "steps": [{"op": "set_optimizer", "index": 0}] + [push(seed) for seed in range(4)],
    }
    second = dict(first, init=False, steps=[push(seed) for seed in range(10, 13)])
    dump = {"cmd": "dump", "tables": touched_ids(first), "dense": ["w"]}
    with DrivenJob.colocated(2, tmp_path) as colocated:
        colocated.send(cmd="run", program=first)
        assert colocated.send(cmd="save", path=str(tmp_path / "a"))[0]["seq"] == 1
        saved_colocated = colocated.send(**dump)
        with DrivenJob.dist(servers, tmp_path) as dist:
            dist.send(cmd="load", path=str(tmp_path / "a"))
            assert_same_dumps(saved_colocated, dist.send(**dump))
            dist.send(cmd="run", program=second)
            dist.send(cmd="save", path=str(tmp_path / "b"))
            saved_dist = dist.send(**dump)
            # Loading also brings the optimizer slots back: the same pushes on both sides
            # give the same values again.
            colocated.send(cmd="load", path=str(tmp_path / "b"))
            assert_same_dumps(saved_dist, colocated.send(**dump))
            third = dict(second, steps=[push(77)])
            for job in (colocated, dist):
                job.send(cmd="run", program=third)
            assert_same_dumps(colocated.send(**dump), dist.send(**dump))


BSP_SCRIPT = """
import json, os, time
import numpy as np
import kvsparse
kv = kvsparse.create('dist_sparse', timeout=30)
kv.init('emb', kvsparse.SparseTable(dim=2, initializer=kvsparse.initializers.Zeros()))
kv.set_optimizer(kvsparse.optimizers.SGD(learning_rate=1.0))
ids = np.arange(50, dtype=np.int64)
grads = np.full((50, 2), kv.rank + 1, np.float32)
kv.barrier()
if kv.rank == 1:
    time.sleep(1.0)  # rank 0's push must wait for this one (BSP)
start = time.monotonic()
kv.push('emb', (ids, grads))
waited = time.monotonic() - start
rows = kv.row_sparse_pull('emb', row_ids=ids)
backend = kv._backend
print(json.dumps({"waited": waited, "rows": rows.tolist(), "kind": type(backend).__name__,
                  "in_process": backend.rows_in_process, "total": backend.rows_total}))
"""


def test_colocated_bsp_push_waits_for_every_worker_and_applies_the_sum_once(tmp_path):
    from kvsparse.cluster.launch import free_port

    peers = [f"tcp://127.0.0.1:{free_port('127.0.0.1')}" for _ in range(2)]
    outputs = run_workers(
        BSP_SCRIPT, peers, 2, tmp_path, timeout=120, env={"KVSPARSE_PEERS": ",".join(peers)}
    )
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert [r["kind"] for r in results] == ["ColocatedBackend"] * 2
    assert results[0]["waited"] >= 0.8, results[0]["waited"]
    for result in results:
        # SGD with lr 1 on zeros: -(1 + 2), the two workers' gradients summed, applied once.
        np.testing.assert_array_equal(np.array(result["rows"]), np.full((50, 2), -3.0))
        assert 0 < result["in_process"] < result["total"] == 100


def launch_colocated(tmp_path, script_text: str) -> tuple:
    """Runs script_text under `kvsparse launch --colocated -n 2`; (the run, each rank's last
    printed JSON line)."""
    script = tmp_path / "train.py"
    script.write_text(script_text)
    done = subprocess.run(
        [sys.executable, "-m", "kvsparse", "launch", "--colocated", "-n", "2", "--",
         sys.executable, str(script)],
        capture_output=True, text=True, env=subprocess_env(), cwd=str(REPO_ROOT), timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    results = []
    for rank in (0, 1):
        lines = [line for line in done.stdout.splitlines() if line.startswith(f"[worker {rank}] ")]
        results.append(json.loads(lines[-1].split("] ", 1)[1]))
    return done, results


def test_launch_colocated_runs_a_dist_sparse_script_unchanged(tmp_path):
    done, results = launch_colocated(tmp_path, BSP_SCRIPT)
    assert "kvsparse launch: server" not in done.stderr  # no server process was started
    for result in results:
        assert result["kind"] == "ColocatedBackend"
        np.testing.assert_array_equal(np.array(result["rows"]), np.full((50, 2), -3.0))


PORT_HELD_SCRIPT = """
import errno, json, os, socket, time
import numpy as np
import kvsparse

rank = int(os.environ["KVSPARSE_RANK"])
peers = os.environ["KVSPARSE_PEERS"].split(",")
taken = None
if rank == 0:
    # Before worker 1 made its store: its port must already be held for it.
    host, port = peers[1][len("tcp://"):].rsplit(":", 1)
    with socket.socket() as intruder:
        try:
            intruder.bind((host, int(port)))
            taken = False
        except OSError as exc:
            taken = exc.errno == errno.EADDRINUSE
else:
    time.sleep(1.5)
kv = kvsparse.create("dist_sparse")
kv.init("emb", kvsparse.SparseTable(dim=2, initializer=kvsparse.initializers.Zeros()))
kv.set_optimizer(kvsparse.optimizers.SGD(learning_rate=1.0))
ids = np.arange(20, dtype=np.int64)
kv.push("emb", (ids, np.ones((20, 2), np.float32)))
kv.barrier()
rows = kv.row_sparse_pull("emb", row_ids=ids)
print(json.dumps({"taken": taken, "fd": os.environ.get("KVSPARSE_SHARD_FD"),
                  "rows": rows.tolist()}))
"""


def test_launch_colocated_holds_each_shard_port_until_its_worker_serves_it(tmp_path):
    # The launcher listens on every worker's port and the worker's shard serves that very
    # socket (KVSPARSE_SHARD_FD): another process cannot take a port in between.
    done, results = launch_colocated(tmp_path, PORT_HELD_SCRIPT)
    assert results[0]["taken"] is True, done.stdout + done.stderr
    assert all(result["fd"] is not None for result in results)
    for result in results:  # SGD lr 1 on zeros, BSP: both workers' ones summed
        np.testing.assert_array_equal(np.array(result["rows"]), np.full((20, 2), -2.0))


def test_launch_colocated_refuses_server_options():
    for options in (["-s", "2"], ["--restart-servers"]):
        done = subprocess.run(
            [sys.executable, "-m", "kvsparse", "launch", "--colocated", "-n", "2", *options,
             "--", sys.executable, "-c", "pass"],
            capture_output=True, text=True, env=subprocess_env(), timeout=60,
        )  # fmt: skip
        assert done.returncode == 1, done.stderr
        assert "colocated" in done.stderr


def test_movielens_torch_under_launch_colocated_reaches_the_auc_of_dist_sparse():
    pytest.importorskip("torch")
    pytest.importorskip("tqdm")
    from example_runs import held_out_auc, run_command

    aucs = {}
    for name, options in (("dist_sparse", ["-s", "2"]), ("colocated", ["--colocated"])):
        command = [sys.executable, "-m", "kvsparse", "launch", *options, "-n", "2", "--",
                   sys.executable, "examples/movielens_torch.py", "--epochs", "1"]  # fmt: skip
        aucs[name] = held_out_auc(*run_command(command, 300))
    # One epoch: 0.7777 both ways when measured (BSP sums in rank order on both).
    assert aucs["colocated"] >= 0.75, aucs
    assert abs(aucs["colocated"] - aucs["dist_sparse"]) <= 0.005, aucs


def test_two_colocated_workers_as_threads_of_one_process_with_a_monitor_polling(tmp_path):
    """Each shard serves the other worker and a `kvsparse stats` monitor from its thread
    while its own worker reads and updates it in process: the one lock keeps every row right.
    """
    import kvsparse
    from kvsparse.cli import stats as stats_cli
    from kvsparse.store.factory import create_colocated_store

    peers = [f"ipc://{tmp_path}/w{rank}" for rank in range(2)]
    # Batches big enough that the tables grow while the other thread works on them.
    steps, dim, space, size = 30, 3, 200_000, 4096
    rng = np.random.default_rng(5)
    batches = rng.integers(0, space, size=(2, steps, size))
    grads = rng.standard_normal((2, steps, size, dim)).astype(np.float32)
    results, failures = {}, []

    def work(rank):
        try:
            # ASP: pushes apply on arrival, so both threads write the same shard at once.
            with create_colocated_store("dist_async", peers, rank, timeout=60) as kv:
                kv.init(
                    "emb", kvsparse.SparseTable(dim=dim, initializer=kvsparse.initializers.Zeros())
                )
                kv.set_optimizer(kvsparse.optimizers.SGD(learning_rate=1.0))
                for step in range(steps):
                    ids = batches[rank, step]
                    kv.row_sparse_pull("emb", row_ids=ids)
                    kv.push("emb", (ids, grads[rank, step]))
                kv.barrier()
                results[rank] = kv.row_sparse_pull("emb", row_ids=np.arange(space))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    polls = 0
    while any(thread.is_alive() for thread in threads):
        try:
            stats_cli.fetch_stats(peers, timeout=5)
            polls += 1
        except Exception:  # noqa: BLE001 - a shard not bound yet, or already closed
            time.sleep(0.01)
    for thread in threads:
        thread.join()
    assert not failures, failures
    expected = np.zeros((space, dim), np.float32)
    for rank in range(2):
        for step in range(steps):
            np.add.at(expected, batches[rank, step], -grads[rank, step])
    # SGD adds up every gradient, in whatever order they arrived: float rounding only.
    for rank in range(2):
        np.testing.assert_allclose(results[rank], expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(results[0], results[1])
    assert polls > 0


def test_a_worker_dying_of_an_exception_fails_the_others_at_once(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(
        "import numpy as np, kvsparse\n"
        "kv = kvsparse.create('dist_sparse', timeout=60)\n"
        "kv.init('emb', kvsparse.SparseTable(dim=2))\n"
        "ids = np.arange(40, dtype=np.int64)\n"
        "for step in range(5):\n"
        "    if kv.rank == 1 and step == 3:\n"
        "        raise RuntimeError('rank 1 fails')\n"
        "    kv.push('emb', (ids, np.ones((40, 2), np.float32)))\n"
    )
    peers = ",".join(f"ipc://{tmp_path}/w{rank}" for rank in range(2))
    started = time.monotonic()
    workers = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=subprocess_env(
                {"KVSPARSE_PEERS": peers, "KVSPARSE_RANK": rank, "KVSPARSE_NUM_WORKERS": 2}
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [worker.communicate(timeout=60) for worker in workers]
    # Rank 0's push of step 3 waits for rank 1, whose shard fails it as it goes: well
    # before rank 0's 60 s timeout.
    assert time.monotonic() - started < 30
    assert workers[1].returncode == 1 and "rank 1 fails" in outputs[1][1]
    assert workers[0].returncode == 1
    # Whichever rank 0 hears first: its own shard failing the held push (rank 1 left),
    # or rank 1's shard gone (its socket closed with the process). The error is the
    # traceback's last line; its shard's log of the failure may print after it or even
    # inside it (its thread writes to the same stderr): those log lines go first.
    text = re.sub(r"kvsparse server: [^\n]*\n", "", outputs[0][1])
    lines = text.strip().splitlines()
    error = next((line for line in reversed(lines) if line.startswith("kvsparse.errors.")), "")
    assert ("WorkerLeft" in error and "rank 1" in error) or (
        "ServerUnavailable" in error and f"{tmp_path}/w1" in error
    ), outputs[0][1]


# -- launch --colocated --restart-workers (the kill -9 runs are tests/test_faults.py's
# colocated-worker-kill-* scenarios) ------------------------------------------------------


def test_restart_workers_goes_with_colocated_only():
    from kvsparse import errors
    from kvsparse.cluster.launch import launch

    with pytest.raises(errors.InvalidArgument, match="restart_workers goes with colocated"):
        launch([sys.executable, "-c", "pass"], num_workers=2, restart_workers=True)


@pytest.mark.parametrize("window", [6.0, 1.5])
def test_a_shard_holds_a_gone_ranks_round_for_its_rejoin_window(window):
    """A rank whose connection closed is waited for rejoin_window s, then fails the round.

    Within the window a new store of that rank (a restarted worker) completes the round.
    """
    import kvsparse
    from kvsparse import errors
    from kvsparse.server.embedded import EmbeddedServer
    from kvsparse.server.liveness import REJOIN_SECONDS

    shard = EmbeddedServer("tcp://127.0.0.1:0", rejoin_window=window)
    table = kvsparse.SparseTable(dim=1, initializer=kvsparse.initializers.Zeros())
    ones = (np.array([3]), np.ones((1, 1), np.float32))

    def create(rank):
        store = kvsparse.create(
            "dist_sparse", servers=[shard.address], rank=rank, num_workers=2, timeout=30
        )
        store.init("t", table)
        return store

    stores = [create(0), create(1)]
    outcome = {}

    def push():
        try:
            stores[0].push("t", ones)
            outcome["returned"] = time.monotonic()
        except errors.KVSparseError as exc:
            outcome["error"] = exc

    try:
        stores[1].close()  # rank 1 is gone, as a killed colocated worker
        closed = time.monotonic()
        pusher = threading.Thread(target=push, daemon=True)
        pusher.start()
        if window > 3:
            pusher.join(REJOIN_SECONDS + 2.0)  # past the probe that finds rank 1 gone
            assert pusher.is_alive(), f"the round did not wait for rank 1: {outcome}"
            stores[1] = create(1)  # back within the window
            stores[1].push("t", ones)
            pusher.join(30)
            assert "returned" in outcome, outcome
            assert stores[0].row_sparse_pull("t", row_ids=np.array([3])).tolist() == [[2.0]]
        else:
            pusher.join(REJOIN_SECONDS + window + 20)
            assert isinstance(outcome.get("error"), errors.WorkerLeft), outcome
            assert "not back within" in str(outcome["error"])
            assert time.monotonic() - closed >= window
    finally:
        for store in stores:
            closer = threading.Thread(target=store.close, daemon=True)
            closer.start()
            closer.join(10)
        shard.close(linger=0)
