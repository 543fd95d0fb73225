"""Checkpoints: full and incremental saves, loads with resharding, crashes, corruption.

Layers: the C++ change tracking through `_core.Table`; the file format and
the local store in-process; real servers (fork-based saves, kill -9, loading
onto another number of servers, the ``--restore`` flag).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import psutil
import pytest
from conftest import (
    LISTENING,
    SERVER_START_TIMEOUT,
    ServerProcess,
    last_json,
    run_workers,
    subprocess_env,
)

import kvsparse
from kvsparse import _core, errors, optimizers
from kvsparse.placement import table_id_of
from kvsparse.server.listening import read_first_line
from kvsparse.shard import checkpoint

IDS = np.arange(400, dtype=np.int64)


def _adam():
    return optimizers.create("adam", learning_rate=0.05)


def _local_store():
    kv = kvsparse.create("local")
    kv.set_optimizer(optimizers.create("adagrad", learning_rate=0.1))
    kv.init("emb", kvsparse.SparseTable(dim=4, optimizer=_adam(), seed=3))
    kv.init("lin", kvsparse.SparseTable(dim=1, seed=4))  # the store-wide Adagrad
    kv.init("w", np.linspace(-1, 1, 10).astype(np.float32))
    return kv


def _train(kv, steps, seed):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.integers(0, IDS.size, 48)
        kv.push("emb", (ids, rng.normal(size=(48, 4)).astype(np.float32)))
        kv.push("lin", (ids, rng.normal(size=(48, 1)).astype(np.float32)))
        kv.push("w", rng.normal(size=10).astype(np.float32))


def _full_state(kv):
    """Every row's value, slots and step and every dense value, slot and step, sorted by key."""
    out = {
        "emb": kv.row_sparse_pull("emb", row_ids=IDS),
        "lin": kv.row_sparse_pull("lin", row_ids=IDS),
        "w": kv.pull("w"),
    }
    for shard in kv._backend.optimizer_states():
        for table_id, state in shard.items():
            if "keys" in state:
                order = np.argsort(state["keys"])
                for name in ("keys", "slots", "steps"):
                    out.setdefault((table_id, name), []).append(state[name][order])
                out[(table_id, "table_step")] = state["table_step"]
            else:
                out[(table_id, "slots")] = state["slots"]
                out[(table_id, "step")] = state["step"]
    return out


def _key_set(table):
    return {int(k) for chunk in table.iter_chunks() for k in chunk[0]}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, list):
            x, y = np.concatenate(x), np.concatenate(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(key))


# -- the C++ change tracking ----------------------------------------------------------------


def test_table_tracks_changed_rows_and_removals():
    table = _core.Table(2, None, {"kind": "sgd", "learning_rate": 0.1}, 0)
    ones = np.ones((3, 2), np.float32)
    table.assign(np.array([1, 2, 3]), ones)
    assert sorted(np.concatenate(list(table.changed_keys(0))).tolist()) == [1, 2, 3]
    table.change_epoch = 2
    assert list(table.changed_keys(1)) == []
    table.apply_gradients(np.array([2]), np.ones((1, 2), np.float32))
    table.lookup_or_insert(np.array([7]))  # an insert is a change too
    table.remove(np.array([3]))
    changed = np.concatenate(list(table.changed_keys(1)))
    assert sorted(changed.tolist()) == [2, 7]
    assert table.removed_since(1).tolist() == [3]
    assert table.removed_since(2).tolist() == []
    table.prune_removed(2)
    assert table.removed_since(0).tolist() == []
    table.change_epoch = 3
    table.write_state(
        np.array([1]),
        np.zeros((1, 2), np.float32),
        np.zeros((1, 0, 2), np.float32),
        np.ones(1, np.int64),
    )
    assert np.concatenate(list(table.changed_keys(2))).tolist() == [1]


# -- local store: formats, deltas, errors ------------------------------------------------------


def test_base_plus_two_deltas_equals_a_full_save(tmp_path):
    kv = _local_store()
    _train(kv, 6, seed=1)
    assert kv.save(tmp_path / "chain") == 1
    _train(kv, 4, seed=2)
    # A removal (what eviction does) must travel in the delta too.
    table = kv._backend.state.sparse[table_id_of("emb")].table
    removed = np.array([0, 1, 2, 3, 4], np.int64)
    table.remove(removed)
    assert kv.save(tmp_path / "chain", incremental=True) == 2
    at_delta = kvsparse.create("local")
    at_delta.load(tmp_path / "chain")
    assert _key_set(at_delta._backend.state.sparse[table_id_of("emb")].table) == _key_set(table)
    assert not _key_set(table) & set(removed.tolist())
    kv.init("late", kvsparse.SparseTable(dim=2))  # a table born after the base
    kv.push("late", (np.array([5, 6]), np.ones((2, 2), np.float32)))
    _train(kv, 3, seed=3)
    assert kv.save(tmp_path / "chain", incremental=True) == 3
    manifest = checkpoint.latest_manifest(str(tmp_path / "chain"))
    assert manifest["kind"] == "delta" and manifest["parent"] == 2
    # The deltas are small: only changed rows.
    delta_rows = manifest["shards"][0]["rows"]
    assert 0 < delta_rows < len(table) + len(kv._backend.state.sparse[table_id_of("lin")].table)
    assert kv.save(tmp_path / "full") == 1
    expected = _full_state(kv)
    late = kv.row_sparse_pull("late", row_ids=np.array([5, 6, 9]))

    from_chain = kvsparse.create("local")
    assert from_chain.load(tmp_path / "chain") == 3
    from_full = kvsparse.create("local")
    from_full.load(tmp_path / "full")
    _assert_same(_full_state(from_chain), expected)
    _assert_same(_full_state(from_full), expected)
    np.testing.assert_array_equal(from_chain.row_sparse_pull("late", row_ids=[5, 6, 9]), late)
    restored = from_chain._backend.state.sparse[table_id_of("emb")].table
    assert _key_set(restored) == _key_set(table)
    # Training continues identically from the loaded store and from the original.
    _train(kv, 3, seed=4)
    _train(from_chain, 3, seed=4)
    _assert_same(_full_state(from_chain), _full_state(kv))


def test_incremental_needs_a_base(tmp_path):
    kv = _local_store()
    with pytest.raises(errors.InvalidArgument, match="full save first"):
        kv.save(tmp_path / "c", incremental=True)
    kv.save(tmp_path / "c")
    other = _local_store()  # never saved or loaded there
    with pytest.raises(errors.InvalidArgument, match="full save first"):
        other.save(tmp_path / "c", incremental=True)


def _saved_shard_file(tmp_path):
    kv = _local_store()
    _train(kv, 3, seed=5)
    kv.save(tmp_path / "c")
    return tmp_path / "c" / checkpoint.shard_file_name(1, 0, 1)


@pytest.mark.parametrize("damage", ["truncate", "flip_block", "flip_index", "version", "empty"])
def test_corrupt_or_truncated_files_are_a_clear_error(tmp_path, damage):
    path = _saved_shard_file(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip_block":
        data[checkpoint.format.HEADER.size + 10] ^= 0xFF
    elif damage == "flip_index":
        data[-checkpoint.format.TRAILER.size - 5] ^= 0xFF
    elif damage == "version":
        data[8] = 99
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    kv = kvsparse.create("local")
    with pytest.raises(checkpoint.CheckpointError, match=str(path.name)):
        kv.load(tmp_path / "c")
    assert isinstance(checkpoint.CheckpointError("x"), ValueError)


def test_missing_shard_file_or_manifest(tmp_path):
    path = _saved_shard_file(tmp_path)
    path.unlink()
    with pytest.raises(checkpoint.CheckpointError, match="cannot read"):
        kvsparse.create("local").load(tmp_path / "c")
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint"):
        kvsparse.create("local").load(tmp_path / "nothing")
    manifest = tmp_path / "c" / checkpoint.manifest_name(1)
    manifest.write_text(manifest.read_text()[:20])
    with pytest.raises(checkpoint.CheckpointError, match="manifest"):
        kvsparse.create("local").load(tmp_path / "c")


def test_restore_shard_reshards_by_key_hash(tmp_path):
    kv = _local_store()
    _train(kv, 4, seed=6)
    kv.save(tmp_path / "c")
    expected = kv.row_sparse_pull("emb", row_ids=IDS)
    dense = kv.pull("w")
    from kvsparse.placement import dense_ranges
    from kvsparse.shard.state import ShardState

    rows_seen = 0
    for index in range(3):
        state = ShardState()
        checkpoint.restore_shard(state, str(tmp_path / "c"), index, 3)
        table = state.sparse[table_id_of("emb")].table
        keys = np.concatenate([c[0] for c in table.iter_chunks()])
        assert (_core.shard_of(keys, 3) == index).all()
        np.testing.assert_array_equal(table.lookup(keys), expected[keys])
        rows_seen += keys.size
        a, b = dense_ranges(dense.size, 3)[index]
        np.testing.assert_array_equal(state.dense[table_id_of("w")].values, dense[a:b])
    assert rows_seen == len(kv._backend.state.sparse[table_id_of("emb")].table)


# -- real servers ------------------------------------------------------------------------------

WORKER = r"""
import json, sys
import numpy as np
import kvsparse
from kvsparse import optimizers

phase, path, steps, save_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
kv = kvsparse.create("dist_sparse")
ids_all = np.arange(300, dtype=np.int64)

def grads(step):
    rng = np.random.default_rng(1000 * step + kv.rank)
    ids = rng.integers(0, 300, 40)
    return ids, rng.normal(size=(40, 8)).astype(np.float32), rng.normal(size=12).astype(np.float32)

def snapshot(name):
    kv.save_optimizer_states(name)
    return {
        "emb": kv.row_sparse_pull("emb", row_ids=ids_all).tolist(),
        "w": kv.pull("w").tolist(),
        "states": name,
    }

out = {}
if phase == "train":
    kv.set_optimizer(optimizers.create("adagrad", learning_rate=0.1))
    adam = optimizers.create("adam", learning_rate=0.05)
    kv.init("emb", kvsparse.SparseTable(dim=8, optimizer=adam))
    kv.init("w", np.zeros(12, np.float32))
    first = 0
else:
    out["seq"] = kv.load(path)
    if kv.rank == 0:
        out["at_load"] = snapshot(path + "/states-loaded.npz")
    first = save_at
for step in range(first, steps):
    ids, rows, dense = grads(step)
    kv.push("emb", (ids, rows))
    kv.push("w", dense)
    if phase == "train" and step + 1 == save_at and kv.rank == 0:
        # Worker 1 keeps pushing meanwhile; its pushes wait for this worker's (BSP).
        out["at_save"] = snapshot(path + "/states-at-save.npz")
        out["seq"] = kv.save(path)
if kv.rank == 0:
    out["final"] = snapshot(path + f"/states-{phase}-final.npz")
print(json.dumps(out))
"""


def _states(name):
    with np.load(name) as data:
        meta = json.loads(bytes(data["meta"]).decode())
        out = {}
        for index, entry in enumerate(meta["keys"]):
            if entry["sparse"]:
                keys = data[f"k{index}_keys"]
                order = np.argsort(keys)
                out[entry["key"]] = (
                    keys[order],
                    data[f"k{index}_slots"][order],
                    data[f"k{index}_steps"][order],
                )
            else:
                out[entry["key"]] = (data[f"k{index}_slots"],)
        return out


def _same_states(a, b):
    a, b = _states(a), _states(b)
    assert a.keys() == b.keys()
    for key in a:
        for x, y in zip(a[key], b[key]):
            np.testing.assert_array_equal(x, y, err_msg=key)


def test_save_while_training_kill_all_servers_load_onto_three(server_factory, tmp_path):
    path = str(tmp_path / "ckpt")
    os.makedirs(path)
    servers = server_factory(2)
    outputs = run_workers(WORKER, servers, 2, tmp_path, args=("train", path, 8, 4))
    trained = last_json(outputs[0])
    assert trained["seq"] == 1
    for process in server_factory.processes:
        process.kill()  # kill -9: nothing flushed, nothing closed
    new_servers = server_factory(3)
    outputs = run_workers(WORKER, new_servers, 2, tmp_path, args=("resume", path, 8, 4))
    resumed = last_json(outputs[0])
    assert resumed["seq"] == 1 and last_json(outputs[1])["seq"] == 1
    # The rows, slots and step counters loaded are those of the moment of the save.
    np.testing.assert_array_equal(resumed["at_load"]["emb"], trained["at_save"]["emb"])
    np.testing.assert_array_equal(resumed["at_load"]["w"], trained["at_save"]["w"])
    _same_states(path + "/states-loaded.npz", path + "/states-at-save.npz")
    # The next steps on 3 servers give what the uninterrupted run on 2 gave.
    np.testing.assert_allclose(resumed["final"]["emb"], trained["final"]["emb"], rtol=1e-6)
    np.testing.assert_allclose(resumed["final"]["w"], trained["final"]["w"], rtol=1e-6)
    _same_states(path + "/states-resume-final.npz", path + "/states-train-final.npz")


# `python -m kvsparse.server` whose shard writers obey a hook file: after a writer's first
# block, the file's content "sleep" stops it for a minute, "die" makes it exit at once (a
# crash mid-write). The patch is made before the server starts, so its forked writers
# inherit it. Usage: python -c HOOKED_SERVER HOOK_FILE [server args...]
HOOKED_SERVER = r"""
import os, runpy, sys, time
from kvsparse.shard.checkpoint.format import BlockWriter

hook = sys.argv.pop(1)
plain_block = BlockWriter.block

def block(self, arrays, rows=0):
    entry = plain_block(self, arrays, rows)
    if self.blocks == 1 and os.path.exists(hook):
        with open(hook) as f:
            action = f.read().strip()
        if action == "sleep":
            time.sleep(60)
        elif action == "die":
            os._exit(3)
    return entry

BlockWriter.block = block
runpy.run_module("kvsparse.server", run_name="__main__", alter_sys=True)
"""


class _HookedServer(ServerProcess):
    """A server whose checkpoint writer obeys the test hook file (HOOKED_SERVER)."""

    def __init__(self, hook):
        import tempfile

        self.stderr = tempfile.TemporaryFile()
        self.later_output = b""
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOOKED_SERVER, str(hook), "--bind", "tcp://127.0.0.1:0"],
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=subprocess_env(),
        )
        line = read_first_line(self.process.stdout, time.monotonic() + SERVER_START_TIMEOUT)
        self.first_line = line.decode(errors="replace")
        if not self.first_line.startswith(LISTENING):
            self.stop()
            raise RuntimeError(f"server did not start: {self.error_output()!r}")
        self.address = self.first_line[len(LISTENING) :].strip()


def test_crash_during_save_leaves_the_previous_checkpoint(server_factory, tmp_path):
    hook = tmp_path / "hook"
    path = tmp_path / "ckpt"
    servers = [_HookedServer(hook) for _ in range(2)]
    server_factory.processes.extend(servers)  # stopped at teardown
    kv = kvsparse.create("dist_sparse", servers=[s.address for s in servers], timeout=5)
    kv.init("emb", kvsparse.SparseTable(dim=4, optimizer=_adam()))
    rng = np.random.default_rng(0)
    kv.push("emb", (IDS, rng.normal(size=(IDS.size, 4)).astype(np.float32)))
    assert kv.save(path) == 1
    saved = kv.row_sparse_pull("emb", row_ids=IDS)
    kv.push("emb", (IDS, rng.normal(size=(IDS.size, 4)).astype(np.float32)))

    # A writer that dies mid-file: the save fails, the servers go on.
    hook.write_text("die")
    with pytest.raises(errors.ServerError, match="writer died"):
        kv.save(path)
    assert checkpoint.list_manifests(str(path)) == [1]
    # The client hears the first failure; each server removes its dead writer's file.
    deadline = time.monotonic() + 30
    while [name for name in os.listdir(path) if ".tmp-" in name]:
        assert time.monotonic() < deadline, "a dead writer's temporary file was left behind"
        time.sleep(0.05)

    # A server killed (-9) in the middle of writing its file.
    hook.write_text("sleep")
    failure = []
    saver = threading.Thread(target=lambda: failure.append(_try(kv.save, path)))
    saver.start()
    deadline = time.monotonic() + 30
    while len([name for name in os.listdir(path) if ".tmp-" in name]) < len(servers):
        assert time.monotonic() < deadline, "the writer never started its file"
        time.sleep(0.05)
    for server in servers:
        children = psutil.Process(server.process.pid).children()
        server.kill()
        for child in children:  # the forked writers this test's servers started
            child.kill()
    saver.join(60)
    assert not saver.is_alive() and isinstance(failure[0], errors.KVSparseError)
    kv.close()
    assert checkpoint.list_manifests(str(path)) == [1]

    fresh = kvsparse.create("dist_sparse", servers=server_factory(3))
    assert fresh.load(path) == 1
    np.testing.assert_array_equal(fresh.row_sparse_pull("emb", row_ids=IDS), saved)
    # The killed writers' stray files (checkpoint 2) keep their number from being reused.
    assert any(name.startswith("ckpt-000002.") for name in os.listdir(path))
    assert fresh.save(path) == 3
    again = kvsparse.create("dist_sparse", servers=server_factory(2))
    assert again.load(path) == 3
    np.testing.assert_array_equal(again.row_sparse_pull("emb", row_ids=IDS), saved)


def _try(function, *args):
    try:
        function(*args)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None


def test_server_restore_flag(tmp_path):
    kv = _local_store()
    _train(kv, 3, seed=7)
    kv.save(tmp_path / "c")
    expected = kv.row_sparse_pull("emb", row_ids=IDS)
    server = ServerProcess(
        extra_args=("--restore", str(tmp_path / "c"), "--shard-index", "0", "--num-shards", "1")
    )
    try:
        remote = kvsparse.create("dist_sparse", servers=[server.address])
        offsets = np.array([0, IDS.size], np.int64)
        rows = remote._backend.pull_sparse([(table_id_of("emb"), IDS, offsets)])[0][0]
        np.testing.assert_array_equal(rows, expected)
        remote.close()
    finally:
        server.stop()
    bad = subprocess.run(
        [sys.executable, "-m", "kvsparse.server", "--restore", str(tmp_path / "none")],
        env=subprocess_env(),
        capture_output=True,
        timeout=60,
    )
    assert bad.returncode == 2 and b"--shard-index" in bad.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "kvsparse.server", "--restore", str(tmp_path / "none")]
        + ["--shard-index", "0", "--num-shards", "1"],
        env=subprocess_env(),
        capture_output=True,
        timeout=60,
    )
    assert missing.returncode == 2 and b"no complete checkpoint" in missing.stderr


def test_save_and_load_without_a_path_use_the_launchers_checkpoint_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("KVSPARSE_CHECKPOINT_DIR", raising=False)
    without = kvsparse.create("local")
    without.init("t", kvsparse.SparseTable(dim=2))
    with pytest.raises(kvsparse.errors.InvalidArgument, match="KVSPARSE_CHECKPOINT_DIR"):
        without.save()
    # The directory is settled when the store is made (kvsparse.create reads the environment).
    monkeypatch.setenv("KVSPARSE_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    kv = kvsparse.create("local")
    kv.init("t", kvsparse.SparseTable(dim=2, initializer=kvsparse.initializers.Zeros()))
    kv.push("t", (np.array([3]), np.ones((1, 2), np.float32)))
    kv.save()
    other = kvsparse.create("local")
    other.load()
    np.testing.assert_array_equal(other.row_sparse_pull("t", row_ids=np.array([3])), [[1, 1]])


def test_checkpoint_actions_travel_as_plain_strings(tmp_path):
    action = checkpoint.CheckpointAction.PREPARE
    assert action == "prepare" and json.dumps({"action": action}) == '{"action": "prepare"}'
    assert {a.value for a in checkpoint.CheckpointAction} == {
        "prepare",
        "save",
        "commit",
        "load",
        "activate",
        "discard",
        "abort",
        "describe",
        "export",
    }
    state = kvsparse.create("local")._backend.state
    reply = checkpoint.handle(state, {"action": "prepare", "path": str(tmp_path / "c")}, 0, 1)
    assert reply == {"seq": 1, "latest": None}
    with pytest.raises(errors.InvalidArgument, match="unknown checkpoint action 'rename'"):
        checkpoint.handle(state, {"action": "rename", "path": str(tmp_path)}, 0, 1)
    with pytest.raises(errors.InvalidArgument, match="non-empty str"):
        checkpoint.handle(state, {"action": action}, 0, 1)


def _rewrite_as_format_1(path) -> None:
    """Turns a saved checkpoint into what kvsparse 0.1.0 wrote: format 1, specs without a
    stream version (the index is rewritten and its crc32 recomputed)."""
    _rewrite_as_format(path, 1)


def _rewrite_as_format(path, version: int) -> None:
    """Turns a saved checkpoint into what an older kvsparse wrote (the index is rewritten
    and its crc32 recomputed): format 3 has no rows' eviction metadata, no INIT_SPARSE spec
    and no server section, format 2 no admission candidates either, and format 1 (kvsparse
    0.1.0) no initializer stream version either. Their bytes stay, unreferenced."""
    from kvsparse.shard.checkpoint.format import HEADER, TRAILER

    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name.endswith(".manifest.json"):
            with open(full) as f:
                manifest = json.load(f)
            manifest["version"] = version
            with open(full, "w") as f:
                json.dump(manifest, f)
            continue
        if not name.endswith(".kvs"):
            continue
        with open(full, "rb") as f:
            data = f.read()
        index_len, _, end = TRAILER.unpack_from(data, len(data) - TRAILER.size)
        body_end = len(data) - TRAILER.size
        index = json.loads(data[body_end - index_len : body_end])
        index["version"] = version
        if version < 4:
            index.pop("server", None)
        for section in index["sparse"]:
            if version < 4:
                section.pop("init_spec", None)
                for block in section["blocks"]:
                    block.pop("meta", None)
            if version < 3:
                section.pop("candidates", None)
            if version < 2:
                section["spec"]["initializer"].pop("version")
        new_index = json.dumps(index).encode()
        magic, _, flags = HEADER.unpack_from(data, 0)
        rewritten = (
            HEADER.pack(magic, version, flags)
            + data[HEADER.size : body_end - index_len]
            + new_index
            + TRAILER.pack(len(new_index), zlib.crc32(new_index), end)
        )
        with open(full, "wb") as f:
            f.write(rewritten)


def test_a_format_1_checkpoint_keeps_its_initializer_streams(tmp_path):
    # Files of kvsparse 0.1.0 were written with the v1 streams: after loading one, an id
    # never stored must still get its v1 row, and the stored rows come back unchanged.
    kv = _local_store()
    _train(kv, 3, seed=1)
    assert kv.save(tmp_path / "old") == 1
    stored_ids = {
        name: np.array(sorted(_key_set(kv._backend.state.sparse[table_id_of(name)].table)))
        for name in ("emb", "lin")
    }

    def stored_state(store):
        state = _full_state(store)  # optimizer slots and steps of the stored rows, dense key
        for name, ids in stored_ids.items():
            state[name] = store.row_sparse_pull(name, row_ids=ids)
        return state

    stored = stored_state(kv)
    _rewrite_as_format_1(tmp_path / "old")
    assert (
        checkpoint.read_shard_file(
            str(tmp_path / "old" / checkpoint.shard_file_name(1, 0, 1))
        ).version
        == 1
    )

    loaded = kvsparse.create("local")
    assert loaded.load(tmp_path / "old") == 1
    _assert_same(stored_state(loaded), stored)
    spec = loaded._backend.state.sparse[table_id_of("emb")].spec
    assert spec["initializer"]["version"] == 1
    unseen = np.array([10**15 + 7], np.int64)
    v1 = _core.Table(spec["dim"], spec["initializer"], None, spec["seed"]).initial_values(unseen)
    v2_spec = {**spec["initializer"], "version": _core.INITIALIZER_VERSION}
    v2 = _core.Table(spec["dim"], v2_spec, None, spec["seed"]).initial_values(unseen)
    assert not np.array_equal(v1, v2)  # the streams differ, so the check below means something
    np.testing.assert_array_equal(loaded.row_sparse_pull("emb", row_ids=unseen), v1)
    # A new save records the version (format 2 and later), read back with the same streams.
    assert loaded.save(tmp_path / "new") == 1
    again = kvsparse.create("local")
    again.load(tmp_path / "new")
    np.testing.assert_array_equal(again.row_sparse_pull("emb", row_ids=unseen), v1)


def test_a_loaded_store_saves_what_loads_again(tmp_path):
    # A table of the store-wide optimizer: the loaded shard must know that optimizer again,
    # or its next save records none and cannot be loaded ("changed shape").
    kv = _local_store()
    _train(kv, 3, seed=1)
    kv.save(tmp_path / "a")
    loaded = kvsparse.create("local")
    loaded.load(tmp_path / "a")
    loaded.save(tmp_path / "b")
    again = kvsparse.create("local")
    again.load(tmp_path / "b")
    _assert_same(_full_state(again), _full_state(loaded))
    _train(loaded, 2, seed=2)
    _train(again, 2, seed=2)
    _assert_same(_full_state(again), _full_state(loaded))
