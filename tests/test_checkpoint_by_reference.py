"""Checkpoints by reference: a tiered table's rows on disk enter a full save as hard links.

A full save of a table with a disk tier writes its rows in memory into the shard file and
links the disk tier's immutable run files, with a MANIFEST of their index, into
``ckpt-*.disk/table-*`` (kvsparse.shard.checkpoint.disk). Every reader stays exact:
a load into a tiered store adopts the files (no row read), a load into an all-RAM store,
onto another shard count or into a serving replica reads them in place, deltas apply on
top, and the checkpoint outlives the store that wrote it and the one that adopted it.
The bytes a save writes are the budget's rows and the manifests: <= 15% of a table thirty
times its budget. A writer killed with SIGKILL mid-save leaves the previous checkpoint
loadable and exact.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT, subprocess_env

import kvsparse
from kvsparse import errors, optimizers
from kvsparse.initializers import Normal
from kvsparse.serving.state import read_checkpoint
from kvsparse.shard import checkpoint
from kvsparse.shard.state import ShardState
from kvsparse.store.periodic import PeriodicSaver

MiB = 1 << 20
DIM = 16
BUDGET = 1 * MiB
# dim 16 + 16 Adagrad slots, float32: what the table's rows weigh (the "table bytes").
ROW_BYTES = DIM * 4 * 2
ROWS = 30 * BUDGET // ROW_BYTES  # a table thirty times its budget: 245,760 rows
BATCH = 2048


def _ids(rows: int) -> np.ndarray:
    # Scattered over the int64 range, negative ones among them.
    return (np.arange(rows, dtype=np.int64) - rows // 3) * 0x9E3779B1


def _fill(kv, ids: np.ndarray, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for start in range(0, ids.size, BATCH):
        block = ids[start : start + BATCH]
        kv.push("emb", (block, rng.normal(size=(block.size, DIM)).astype(np.float32)))


def _train(kv, ids: np.ndarray, steps: int, seed: int) -> None:
    """Zipf pushes: hot rows come back from disk, cold ones go out again."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        block = ids[np.unique(rng.zipf(1.2, BATCH) % ids.size)]
        kv.push("emb", (block, rng.normal(size=(block.size, DIM)).astype(np.float32)))


def _init(kv) -> None:
    kv.init(
        "emb",
        kvsparse.SparseTable(
            dim=DIM,
            initializer=Normal(0.0, 0.01),
            optimizer=optimizers.create("adagrad", learning_rate=0.1),
            seed=5,
        ),
    )


def _tiered(tmp_path: Path, name: str):
    return kvsparse.create("local", memory_budget=BUDGET, spill_dir=str(tmp_path / name))


def _state(kv, ids: np.ndarray) -> dict:
    """Every row, its Adagrad slots and step counter, sorted by id (one scan of the
    table: a pull of every id of a table 30x its budget reads a page per id); and a
    pull of a sample of ids, which must agree with the scan."""
    (entry,) = kv._backend.state.sparse.values()
    parts = [tuple(np.array(a) for a in chunk) for chunk in entry.table.iter_state(0)]
    keys, values, slots, steps = (np.concatenate(p) for p in zip(*parts))
    order = np.argsort(keys)
    out = {"keys": keys[order], "values": values[order], "slots": slots[order]}
    out["steps"] = steps[order]
    np.testing.assert_array_equal(out["keys"], np.sort(ids))
    sample = np.random.default_rng(0).choice(ids, min(1000, ids.size), replace=False)
    pulled = kv.row_sparse_pull("emb", row_ids=sample)
    np.testing.assert_array_equal(pulled, out["values"][np.searchsorted(out["keys"], sample)])
    return out


def _assert_same(got: dict, want: dict, context: str) -> None:
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{context}: {name}")


def _tier(kv) -> dict:
    return kv.stats()["tables"]["emb"]["tier"]


def _section(path: Path, seq: int) -> tuple[checkpoint.ShardFile, dict]:
    manifest = checkpoint.read_manifest(str(path), seq)
    f = checkpoint.read_shard_file(str(path / manifest["shards"][0]["file"]))
    (section,) = f.index["sparse"]
    return f, section


def test_a_full_save_links_the_rows_on_disk_and_every_reader_stays_exact(tmp_path):
    ids = _ids(ROWS)
    kv = _tiered(tmp_path, "spill")
    _init(kv)
    _fill(kv, ids)
    _train(kv, ids, 20, seed=1)
    before = _tier(kv)
    assert before["rows_on_disk"] > 0.9 * ROWS, before
    want = _state(kv, ids)
    path = tmp_path / "ckpt"
    assert kv.save(path) == 1

    # The shard file holds the rows in memory; the rows on disk are links and a manifest.
    f, section = _section(path, 1)
    assert f.version == checkpoint.VERSION
    disk = section["disk"]
    assert disk["rows"] == _tier(kv)["rows_on_disk"]
    assert sum(int(b["rows"]) for b in section["blocks"]) == _tier(kv)["rows_in_memory"]
    linked = path / disk["dir"]
    runs = sorted(linked.glob("run-*.kvr"))
    assert runs and all(os.stat(r).st_nlink >= 2 for r in runs), "run files not hard links"
    written = os.path.getsize(f.path) + os.path.getsize(linked / "MANIFEST")
    table_bytes = ROWS * ROW_BYTES
    assert written <= 0.15 * table_bytes, (written, table_bytes)

    # A tiered store adopts the files: no row read, same rows on disk, exact.
    copy = tmp_path / "ckpt-copy"  # its own chain of deltas, below
    shutil.copytree(path, copy)
    adopted = _tiered(tmp_path, "spill-adopted")
    adopted.load(copy)
    tier = _tier(adopted)
    assert tier["rows_on_disk"] == disk["rows"], tier
    # No row came back from disk; what was read is the filters' false positives for the
    # rows in memory written after the adoption, and a merge or two.
    assert tier["rows_read"] == 0, tier
    assert tier["bytes_read"] < 0.25 * before["disk_bytes"], tier
    _assert_same(_state(adopted, ids), want, "adopted")

    # An all-RAM store reads them in place; two tiered shards take their parts.
    in_ram = kvsparse.create("local")
    in_ram.load(path)
    _assert_same(_state(in_ram, ids), want, "all-RAM")
    parts = []
    for index in range(2):
        state = ShardState(memory_budget=BUDGET, spill_dir=str(tmp_path / f"spill-part{index}"))
        checkpoint.load_shard_state(state, str(path), index, 2)
        parts.append(state.sparse[next(iter(state.sparse))].table)
    assert sum(len(t) for t in parts) == ROWS
    for index, table in enumerate(parts):
        mine = ids[kvsparse._core.shard_of(ids, 2) == index]
        values, slots, steps = table.read_state(mine)
        rows = np.searchsorted(want["keys"], mine)
        np.testing.assert_array_equal(values, want["values"][rows])
        np.testing.assert_array_equal(slots, want["slots"][rows])
        np.testing.assert_array_equal(steps, want["steps"][rows])

    # A serving replica reads the same values.
    update, _ = read_checkpoint(str(path))
    (change,) = update.changes
    keys = np.concatenate([k for k, _ in change.blocks])
    values = np.concatenate([v for _, v in change.blocks])
    order = np.argsort(keys)
    np.testing.assert_array_equal(keys[order], want["keys"])
    np.testing.assert_array_equal(values[order], want["values"])

    # Deltas on a checkpoint by reference; the adopted store's next delta holds only what
    # changed after its load (the adopted rows keep stamps below the load's epoch).
    _train(kv, ids, 10, seed=2)
    assert kv.save(path, incremental=True) == 2
    want2 = _state(kv, ids)
    for name, fresh in (("tiered", _tiered(tmp_path, "spill-chain")), ("ram", None)):
        fresh = fresh or kvsparse.create("local")
        fresh.load(path)
        _assert_same(_state(fresh, ids), want2, f"chain into {name}")
    rng = np.random.default_rng(3)
    touched = np.unique(ids[rng.integers(0, ids.size, 500)])
    adopted.push("emb", (touched, np.ones((touched.size, DIM), np.float32)))
    assert adopted.save(copy, incremental=True) == 2
    _, delta = _section(copy, 2)
    assert sum(int(b["rows"]) for b in delta["blocks"]) == touched.size, delta
    chained = kvsparse.create("local")
    chained.load(copy)
    _assert_same(_state(chained, ids), _state(adopted, ids), "the adopted store's delta")

    # Exports agree.
    kv2 = _tiered(tmp_path, "spill-export")
    kv2.load(path)
    kv2.export(tmp_path / "export-a")
    in_ram.load(path)
    in_ram.export(tmp_path / "export-b")
    for a, b in zip(
        sorted((tmp_path / "export-a").glob("*.npz")), sorted((tmp_path / "export-b").glob("*.npz"))
    ):
        with np.load(a) as x, np.load(b) as y:
            for name in set(x.files) - {"meta"}:
                np.testing.assert_array_equal(x[name], y[name], err_msg=name)

    # The checkpoint outlives the store that wrote it and the one that adopted it, after
    # both went on merging and moving rows (their own names of the files go).
    _train(adopted, ids, 30, seed=4)
    for store in (kv, adopted, kv2):
        store.close()
    again = _tiered(tmp_path, "spill-again")
    again.load(path)
    _assert_same(_state(again, ids), want2, "after the writers closed")


def test_a_damaged_disk_checkpoint_is_named_and_the_store_keeps_its_tables(tmp_path):
    ids = _ids(ROWS // 4)
    kv = _tiered(tmp_path, "spill")
    _init(kv)
    _fill(kv, ids)
    path = tmp_path / "ckpt"
    kv.save(path)
    _, section = _section(path, 1)
    kv.close()
    linked = path / section["disk"]["dir"]
    survivor = _tiered(tmp_path, "spill-survivor")
    _init(survivor)
    _fill(survivor, ids[:100], seed=9)
    keep = _state(survivor, ids[:100])
    manifest = bytearray((linked / "MANIFEST").read_bytes())
    (linked / "MANIFEST").write_bytes(bytes(manifest[:-3]))  # truncated
    with pytest.raises(errors.CheckpointError, match="MANIFEST"):
        survivor.load(path)
    _assert_same(_state(survivor, ids[:100]), keep, "after a refused load")
    (linked / "MANIFEST").write_bytes(bytes(manifest))
    # A page of a run file flipped: a reader that reads in place names the file and page.
    run = max(linked.glob("run-*.kvr"), key=os.path.getsize)
    data = bytearray(run.read_bytes())
    data[64 + 4096 + 100] ^= 0xFF
    run.write_bytes(bytes(data))
    in_ram = kvsparse.create("local")
    with pytest.raises(errors.CheckpointError, match=r"page \d+ of \S+run-\d+\.kvr"):
        in_ram.load(path)


def test_periodic_saves_remove_old_checkpoints_with_their_linked_rows(tmp_path):
    ids = _ids(ROWS // 8)
    kv = _tiered(tmp_path, "spill")
    _init(kv)
    _fill(kv, ids)
    path = tmp_path / "ckpt"
    saver = PeriodicSaver(kv, every=1.0, keep=0, path=str(path))
    for step in range(3):
        _train(kv, ids, 2, seed=step)
        saver.save()
    names = sorted(os.listdir(path))
    assert not [n for n in names if n.startswith("ckpt-000001.")], names
    assert [n for n in names if n.endswith(".disk")], names
    fresh = _tiered(tmp_path, "spill-fresh")
    fresh.load(path)
    _assert_same(_state(fresh, ids), _state(kv, ids), "latest")


KILL_WORKER = """
import json, sys
import numpy as np
import kvsparse
from kvsparse import optimizers
from kvsparse.initializers import Normal
sys.path.insert(0, sys.argv[3])
import test_checkpoint_by_reference as t

kv = kvsparse.create("local", memory_budget=t.BUDGET, spill_dir=sys.argv[1])
t._init(kv)
ids = t._ids(t.ROWS // 4)
for step in range(1000):
    t._train(kv, ids, 1, seed=step) if step else t._fill(kv, ids)
    seq = kv.save(sys.argv[2])
    print(json.dumps({"step": step, "seq": seq}), flush=True)
"""


@pytest.mark.parametrize("delay", [0.0, 0.04, 0.12])
def test_a_saver_killed_mid_save_leaves_the_last_checkpoint_exact(tmp_path, delay):
    script = tmp_path / "saver.py"
    script.write_text(KILL_WORKER)
    path = tmp_path / "ckpt"
    process = subprocess.Popen(
        [
            sys.executable,
            str(script),
            str(tmp_path / "spill"),
            str(path),
            str(Path(__file__).parent),
        ],
        stdout=subprocess.PIPE,
        env=subprocess_env(),
        cwd=str(REPO_ROOT),
    )
    saved = []
    try:
        deadline = time.monotonic() + 120
        while len(saved) < 3 and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            saved.append(json.loads(line))
        assert len(saved) == 3, saved
        time.sleep(delay)  # somewhere in the next push or save (a save takes ~0.1 s)
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    latest = checkpoint.latest_manifest(str(path))
    assert latest is not None and latest["seq"] >= saved[-1]["seq"]
    # The same pushes replayed in RAM up to the step the latest checkpoint holds: one save
    # per step, numbered from 1 (the saver may have gone on past the lines read).
    ids = _ids(ROWS // 4)
    want = kvsparse.create("local")
    _init(want)
    for step in range(latest["seq"]):
        _train(want, ids, 1, seed=step) if step else _fill(want, ids)
    loaded = _tiered(tmp_path, "spill-loaded")
    loaded.load(path)
    _assert_same(_state(loaded, ids), _state(want, ids), f"checkpoint {latest['seq']}")
    # A new save after the crash takes the killed one's number and leaves no stray links.
    seq = loaded.save(path)
    disks = sorted(n for n in os.listdir(path) if n.endswith(".disk"))
    assert disks[-1].startswith(f"ckpt-{seq:06d}."), disks
    again = kvsparse.create("local")
    again.load(path)
    _assert_same(_state(again, ids), _state(want, ids), "the save after the crash")
