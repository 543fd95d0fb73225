"""The memory budget's and spill directory's plumbing: settings, where they reach, stats.

What the tier does with them (eviction, reload, exactness) is tested with the core; here a
stand-in MemoryBudget records what the shard hands the C++ tables, so these tests run on a
build without the tier too. The real-process test needs the core's MemoryBudget.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import kvsparse
from kvsparse import _core, config, errors
from kvsparse.cluster import process
from kvsparse.shard import state as state_module
from kvsparse.shard import tier as tier_module
from kvsparse.shard.state import ShardState, tier_stats
from kvsparse.wire import protocol
from tests.conftest import ServerProcess, subprocess_env

HAS_TIER = hasattr(_core, "MemoryBudget")
REAL_TABLE = _core.Table  # fake_core replaces the module's attribute


class FakeBudget:
    """Records what the shard tells the budget (the core's class, minus the counting)."""

    def __init__(self, limit):
        self.limit = limit
        self.other_bytes = 0

    def used(self):
        return 123 + self.other_bytes

    def set_other_bytes(self, n):
        self.other_bytes = n


class RecordingTable:
    """A real table (every call goes to it) that keeps the tier arguments it was made with."""

    made: list = []

    def __init__(self, *args, budget=None, spill_dir=None, name="", **kwargs):
        self._table = REAL_TABLE(*args, **kwargs)
        self.tier_arguments = {"budget": budget, "spill_dir": spill_dir, "name": name}
        RecordingTable.made.append(self)

    def __getattr__(self, name):
        return getattr(self._table, name)

    def __setattr__(self, name, value):
        if name in ("_table", "tier_arguments"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._table, name, value)

    def __len__(self):
        return len(self._table)

    def tier_stats(self):
        return {
            "memory_budget": 1,
            "row_lookups": 10,
            "disk_hits": 2,
            "bytes_written": 30,
            "bytes_updated": 10,
            "rows_on_disk": 5,
        }


@pytest.fixture
def fake_core(monkeypatch):
    RecordingTable.made = []
    monkeypatch.setattr(tier_module._core, "MemoryBudget", FakeBudget, raising=False)
    monkeypatch.setattr(state_module._core, "Table", RecordingTable)
    return RecordingTable


def sparse_spec(dim=4):
    return kvsparse.SparseTable(dim=dim).to_dict()


# -- settings ---------------------------------------------------------------------------------


def test_budget_and_spill_dir_come_from_the_environment(tmp_path):
    env = {config.MEMORY_BUDGET: "512MiB", config.SPILL_DIR: str(tmp_path)}
    settings = config.ServerSettings.from_environment(env)
    assert (settings.memory_budget, settings.spill_dir) == (512 << 20, str(tmp_path))
    assert config.ServerSettings.from_environment({}).memory_budget == 0
    # A given value (the command line's) wins over the variable.
    given = config.ServerSettings.from_environment(env, memory_budget="1GiB")
    assert given.memory_budget == 1 << 30
    assert config.WorkerSettings.from_environment(env).server.memory_budget == 512 << 20


def test_a_relative_spill_dir_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config.memory_tier({config.MEMORY_BUDGET: "1MiB", config.SPILL_DIR: "spill"}) == (
        1 << 20,
        str(tmp_path / "spill"),
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda d: config.ServerSettings.from_environment({config.SPILL_DIR: d}),
        lambda d: config.ServerSettings(spill_dir=d),
        lambda d: config.memory_tier({}, 0, d),
        lambda d: kvsparse.create("local", spill_dir=d),
    ],
)
def test_a_spill_dir_without_a_budget_is_refused_naming_both_flags(make, tmp_path):
    with pytest.raises(errors.InvalidArgument, match="--spill-dir.*--memory-budget"):
        make(str(tmp_path))


def test_a_malformed_budget_names_its_variable():
    with pytest.raises(errors.InvalidArgument, match="KVSPARSE_MEMORY_BUDGET"):
        config.ServerSettings.from_environment({config.MEMORY_BUDGET: "lots"})


@pytest.mark.parametrize(
    "command",
    [
        ["kvsparse.server"],
        ["kvsparse.serving.main", "--checkpoint-dir", "/nonexistent"],
    ],
)
def test_the_commands_refuse_a_spill_dir_without_a_budget(command, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", *command, "--spill-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(),
    )
    assert result.returncode == 2, result.stderr
    assert "--spill-dir" in result.stderr and "--memory-budget" in result.stderr


def test_launch_refuses_a_spill_dir_without_a_budget(tmp_path):
    from kvsparse.cli.main import main

    assert main(["launch", "--spill-dir", str(tmp_path), "--", "true"]) == 1


# -- where they reach -------------------------------------------------------------------------


def test_launch_gives_every_server_its_own_spill_subdirectory():
    assert process.tier_arguments(0, None, "server-0") == []
    assert process.tier_arguments(8 << 20, "/spill", "server-3") == [
        "--memory-budget",
        str(8 << 20),
        "--spill-dir",
        "/spill/server-3",
    ]
    from kvsparse.cluster.launch import _Cluster

    cluster = _Cluster(None, None, 1.0)
    cluster.memory_budget, cluster.spill_dir = 1 << 30, "/spill"
    assert cluster.tier_arguments(1)[-1] == "/spill/server-1"
    assert cluster.tier_environment(2) == {}  # not colocated: the workers hold no shard
    cluster.colocated = True
    assert cluster.tier_environment(2) == {
        config.MEMORY_BUDGET: str(1 << 30),
        config.SPILL_DIR: "/spill/worker-2",
    }


def test_the_launch_flags_reach_launch(monkeypatch, tmp_path):
    from kvsparse.cli import main as cli
    from kvsparse.cluster import launch as launch_module

    seen = {}
    monkeypatch.setattr(launch_module, "launch", lambda command, **kw: seen.update(kw) or 0)
    spill = str(tmp_path / "spill")
    assert cli.main(["launch", "--memory-budget", "64MiB", "--spill-dir", spill, "--", "true"]) == 0
    assert (seen["memory_budget"], seen["spill_dir"]) == (64 << 20, spill)


def test_ray_takes_the_tier_options():
    import inspect

    pytest.importorskip("ray")
    from kvsparse.ray import colocated, servers

    for function in (servers.start_servers, colocated.start_colocated):
        assert {"memory_budget", "spill_dir"} <= set(inspect.signature(function).parameters)


def test_local_store_gets_the_budget(fake_core, tmp_path):
    kv = kvsparse.create("local", memory_budget="8MiB", spill_dir=str(tmp_path))
    kv.init("user", kvsparse.SparseTable(dim=4))
    (table,) = fake_core.made
    assert table.tier_arguments["budget"].limit == 8 << 20
    assert table.tier_arguments["name"] == "user"
    assert os.path.dirname(table.tier_arguments["spill_dir"]).startswith(
        os.path.join(str(tmp_path), f"shard-{os.getpid()}-")
    )
    kv.close()
    assert os.listdir(tmp_path) == []  # the shard's root goes with the store


def test_a_serving_replica_gets_the_budget(fake_core, tmp_path):
    from kvsparse.serving.server import ServingConfig, ServingServer

    server = ServingServer(
        ServingConfig(path=str(tmp_path), bind="tcp://127.0.0.1:0", memory_budget=1 << 20)
    )
    assert server.state.tier.budget.limit == 1 << 20


# -- the shard --------------------------------------------------------------------------------


def test_every_table_shares_one_budget_and_has_its_own_directory(fake_core, tmp_path):
    state = ShardState(64 << 20, str(tmp_path))
    state.create_sparse(1, "user", sparse_spec())
    state.create_sparse(2, "item/v2", sparse_spec())
    loaded = state.like()  # what a checkpoint load builds
    loaded.create_sparse(1, "user", sparse_spec())
    budgets = {id(t.tier_arguments["budget"]) for t in fake_core.made}
    assert len(budgets) == 1
    directories = [t.tier_arguments["spill_dir"] for t in fake_core.made]
    assert len(set(directories)) == 3
    root = state.tier.root
    assert os.path.basename(root).startswith(f"shard-{os.getpid()}-")
    assert all(os.path.dirname(d) == root for d in directories)
    assert "/" not in os.path.basename(directories[1])  # a name is not a path
    assert [t.tier_arguments["name"] for t in fake_core.made] == ["user", "item/v2", "user"]


def test_no_budget_makes_tables_as_before(fake_core):
    state = ShardState()
    state.create_sparse(1, "user", sparse_spec())
    assert state.tier is None
    assert fake_core.made[0].tier_arguments == {"budget": None, "spill_dir": None, "name": ""}


def test_dense_keys_count_against_the_budget(fake_core):
    state = ShardState(64 << 20)
    state.create_dense(1, "bias", np.zeros(1000, np.float32))
    assert state.tier.budget.other_bytes == 4000
    state.set_optimizer({"kind": "adagrad", "learning_rate": 0.1})
    assert state.tier.budget.other_bytes == 8000  # values and one slot
    state.clear()
    assert state.tier.budget.other_bytes == 0


def test_the_spill_roots_of_dead_processes_are_removed(tmp_path, fake_core):
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(done.stdout)
    (tmp_path / f"shard-{dead}-0" / "0-user").mkdir(parents=True)
    (tmp_path / f"shard-{os.getppid()}-0").mkdir()  # a running process's: kept
    (tmp_path / "notes").mkdir()  # not a shard's: kept
    state = ShardState(1 << 20, str(tmp_path))
    left = sorted(os.listdir(tmp_path))
    assert f"shard-{dead}-0" not in left
    assert {f"shard-{os.getppid()}-0", "notes", os.path.basename(state.tier.root)} <= set(left)


def test_an_unusable_spill_dir_is_a_storage_error(tmp_path, fake_core):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(errors.StorageError, match="--spill-dir"):
        ShardState(1 << 20, str(blocked / "spill"))


# -- stats and errors -------------------------------------------------------------------------


def test_tier_stats_compute_the_ratios():
    found = tier_stats({"row_lookups": 8, "disk_hits": 2, "bytes_written": 30, "bytes_updated": 20})
    assert found["hit_rate"] == 0.75 and found["write_amplification"] == 1.5
    empty = tier_stats({})
    assert empty["hit_rate"] == 1.0 and empty["write_amplification"] == 0.0


def test_stats_report_the_tier_per_table_and_the_memory_per_shard(fake_core):
    kv = kvsparse.create("local", memory_budget="8MiB")
    kv.init("user", kvsparse.SparseTable(dim=4))
    stats = kv.stats()
    tier = stats["tables"]["user"]["tier"]
    assert tier["rows_on_disk"] == 5 and tier["hit_rate"] == 0.8
    assert tier["write_amplification"] == 3.0
    assert stats["shards"][0]["memory"]["budget"] == 8 << 20
    from kvsparse.cli.stats import _table_totals

    assert _table_totals(stats["shards"] * 2)["user"]["tier"]["rows_on_disk"] == 10
    assert "tier" not in kvsparse.create("local").stats().get("tables", {}).get("user", {})


def test_prometheus_exports_the_tier():
    pytest.importorskip("prometheus_client")
    from kvsparse.server import metrics

    tables = {"user": {"kind": "sparse", "rows": 1, "tier": tier_stats({"rows_on_disk": 3})}}
    names = {family.name: family for family in metrics._tier_families(tables)}
    assert names["kvsparse_table_tier_rows_on_disk"].samples[0].value == 3
    assert names["kvsparse_table_tier_bytes_written"].type == "counter"


@pytest.mark.parametrize("cls", [errors.DiskFull, errors.CorruptRecord, errors.StorageError])
def test_disk_errors_cross_the_wire_as_themselves(cls):
    header_frame, message = protocol.error_reply(protocol.Header(op=1), cls("table 'user': x"))
    header = protocol.unpack_header(header_frame, reply=True)
    with pytest.raises(cls, match="table 'user'"):
        protocol.raise_remote_error(header, [message], "tcp://127.0.0.1:1")


# -- a real server ----------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_TIER, reason="needs the core's MemoryBudget")
def test_a_server_refuses_an_insert_past_its_budget_and_goes_on_serving():
    server = ServerProcess(extra_args=["--memory-budget", "8MiB"])
    try:
        kv = kvsparse.create("dist_sparse", servers=[server.address], rank=0, num_workers=1)
        kv.init("user", kvsparse.SparseTable(dim=64))
        kv.set_optimizer(kvsparse.optimizers.Adagrad(learning_rate=0.1))
        batch, inserted, refused = 4096, 0, None
        for start in range(0, 1 << 20, batch):  # 512 B a row with its slot: 8 MiB is < 16k
            ids = np.arange(start, start + batch, dtype=np.int64)
            try:
                kv.push("user", (ids, np.ones((batch, 64), np.float32)))
            except errors.LimitExceeded as exc:
                refused = str(exc)
                break
            inserted = start + batch
        assert refused is not None and "user" in refused and "--memory-budget" in refused
        kept = np.arange(inserted, dtype=np.int64)
        before = kv.row_sparse_pull("user", row_ids=kept)
        # Still serving: pulls, and pushes to rows it holds, work.
        kv.push("user", (kept[:10], np.ones((10, 64), np.float32)))
        after = kv.row_sparse_pull("user", row_ids=kept)
        assert not np.array_equal(before[:10], after[:10])
        np.testing.assert_array_equal(before[10:], after[10:])
        assert kv.stats()["tables"]["user"]["rows"] == inserted
        kv.close()
    finally:
        assert server.stop() == 0, server.error_output()


def test_candidates_written_or_cleared_are_counted_in_the_budget_at_once():
    """A restore writes a table's admission candidates (ids seen fewer than min_count
    times): the budget counts them when the call returns, not at the next operation, so
    another table of the shard does not take the room they hold; clearing gives it back."""
    budget = _core.MemoryBudget(256 << 20)
    table = _core.Table(8, policy={"min_count": 3}, budget=budget)
    before = budget.used()
    n = 200_000
    keys = np.arange(n, dtype=np.int64)
    table.write_candidates(keys, np.ones(n, np.int64), np.zeros(n, np.int64))
    grown = budget.used()
    assert grown - before > n * 8, (before, grown)  # at least the keys themselves
    table.clear_candidates()
    assert budget.used() < grown - n * 8, (grown, budget.used())
