"""RunStore (csrc/run_store.h), the disk tier's engine, against a plain dict model.

Tables many times the size of what one write holds, through writes, takes, reads, merges
(maintenance) and checkpoint/restore by reference; the RAM its index holds per record;
a corrupt page named; a checkpoint killed before its MANIFEST refused.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import subprocess_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsparse import errors
from kvsparse._core import RunStore

RECORD = 80  # a dim-16 float32 row under SGD and its 16 bytes of metadata


def records_for(keys, salt):
    keys = np.asarray(keys, dtype=np.int64)
    return ((keys[:, None] * 31 + np.arange(RECORD)[None, :] + salt) % 251).astype(np.uint8)


class DictModel:
    """What the store must hold: key -> record bytes."""

    def __init__(self):
        self.rows = {}

    def write(self, keys, records):
        for key, record in zip(keys.tolist(), records):
            self.rows[key] = record.copy()

    def take(self, keys):
        return [self.rows.pop(key, None) for key in keys.tolist()]

    def check(self, store, keys):
        out, found = store.read(np.asarray(keys, dtype=np.int64))
        for i, key in enumerate(keys):
            want = self.rows.get(int(key))
            assert bool(found[i]) == (want is not None), key
            if want is not None:
                np.testing.assert_array_equal(out[i], want, err_msg=str(key))


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    seed=st.integers(0, 2**32 - 1),
    batches=st.integers(20, 60),
    batch=st.sampled_from([1, 7, 300, 2000]),
    fan_in=st.sampled_from([2, 4]),
)
def test_writes_takes_and_merges_equal_a_dict(tmp_path_factory, seed, batches, batch, fan_in):
    """Rows move out (write) and back (take) as a disk tier moves them; maintenance merges
    between; the table ends up ~30x one write's size; every read equals the model."""
    rng = np.random.default_rng(seed)
    directory = tmp_path_factory.mktemp("runs")
    store = RunStore(str(directory / "s"), RECORD, merge_fan_in=fan_in, check_writes=True)
    model = DictModel()
    universe = batch * 40
    for step in range(batches):
        held = np.fromiter(model.rows.keys(), dtype=np.int64, count=len(model.rows))
        fresh = rng.integers(-universe, universe, batch).astype(np.int64)
        fresh = np.unique(fresh[~np.isin(fresh, held)])
        records = records_for(fresh, step)
        store.write(fresh, records)
        model.write(fresh, records)
        asked = np.concatenate(
            [
                rng.choice(held, min(len(held), batch // 2 + 1))
                if len(held)
                else np.zeros(0, np.int64),
                rng.integers(-universe, universe, 3),
            ]
        )
        out, found = store.take(asked.astype(np.int64))
        seen = set()
        for i, key in enumerate(asked.tolist()):
            want = None if key in seen else model.rows.pop(key, None)
            seen.add(key)
            assert bool(found[i]) == (want is not None) or key in seen, key
            if want is not None:
                assert found[i], key
                np.testing.assert_array_equal(out[i], want)
        store.maintenance(int(rng.integers(1, 4)) * batch * RECORD * 8)
        if step % 10 == 0:
            model.check(store, rng.integers(-universe, universe, 50))
    stats = store.stats()
    assert stats["live_records"] == len(model.rows)
    keys = np.array(sorted(model.rows), dtype=np.int64)
    model.check(store, keys)
    # A write of a key the store holds is refused whole.
    if len(keys):
        with pytest.raises(errors.InvalidArgument, match="already in the run store"):
            store.write(keys[:1], records_for(keys[:1], 0))
    # Checkpoint by reference, restore: the same rows, the index read from the MANIFEST.
    store.checkpoint(str(directory / "ckpt"))
    restored = RunStore.restore(str(directory / "ckpt"), str(directory / "back"), RECORD)
    model.check(restored, keys)
    assert restored.stats()["live_records"] == len(model.rows)
    # The restored store moves on alone: taking from it changes neither the checkpoint
    # nor the original store.
    if len(keys):
        restored.take(keys[: len(keys) // 2])
        model.check(store, keys)
        again = RunStore.restore(str(directory / "ckpt"), str(directory / "again"), RECORD)
        model.check(again, keys)
        again.close()
    restored.close()
    store.close()


def test_ram_per_record_on_disk_is_under_two_bytes_at_scale(tmp_path):
    """A million dim-16 records written as a tier writes them (blocks of 65,536), merged:
    the index holds under 2 bytes per record and never doubles."""
    store = RunStore(str(tmp_path / "s"), RECORD, check_writes=False)
    peak = 0
    block = 65536
    for start in range(0, 1 << 20, block):
        keys = np.arange(start, start + block, dtype=np.int64) * 7919
        store.write(keys, records_for(keys, 1))
        store.maintenance(block * RECORD * 8)
        stats = store.stats()
        peak = max(peak, stats["index_bytes"] / stats["live_records"])
    while store.maintenance(64 << 20):
        pass
    stats = store.stats()
    per_record = stats["index_bytes"] / stats["live_records"]
    assert per_record < 2.0, stats
    assert peak < 3.0, peak
    keys = np.arange(0, 1 << 20, 997, dtype=np.int64) * 7919
    before = stats["reads"]
    out, found = store.read(keys)
    assert found.all()
    np.testing.assert_array_equal(out, records_for(keys, 1))
    reads_per_lookup = (store.stats()["reads"] - before) / len(keys)
    assert reads_per_lookup <= 1.1, reads_per_lookup


def test_a_batch_of_every_key_reads_each_page_once_whatever_the_read_buffer(tmp_path):
    """A batch far larger than a round of reads (a 16 KiB buffer: 4 pages a round) is
    sorted by the page each key needs: every page is read once per run a key passes
    (plus the filters' false positives), not once per round that needs it."""
    store = RunStore(str(tmp_path / "s"), RECORD, check_writes=False, buffer_bytes=16 << 10)
    keys = np.arange(120_000, dtype=np.int64) * 104729 - 5_000_000
    for block in np.array_split(keys, 6):  # six runs, newest last
        store.write(block, records_for(block, 2))
    pages = store.stats()["disk_bytes"] // 4096
    shuffled = np.random.default_rng(0).permutation(keys)
    before = store.stats()["reads"]
    out, found = store.read(shuffled)
    assert found.all()
    np.testing.assert_array_equal(out, records_for(shuffled, 2))
    reads = store.stats()["reads"] - before
    # False positives: ~1% of the keys per newer run, five newer runs at most.
    assert reads <= pages + 0.06 * keys.size, (reads, pages)


def test_a_corrupt_page_is_named_and_never_served(tmp_path):
    store = RunStore(str(tmp_path / "s"), RECORD)
    keys = np.arange(1000, dtype=np.int64)
    store.write(keys, records_for(keys, 3))
    store.close()
    (path,) = (tmp_path / "s").glob("run-*.kvr")
    data = bytearray(path.read_bytes())
    data[64 + 8 + 8 + 5] ^= 0x10  # first page, first record's payload
    path.write_bytes(bytes(data))
    store = RunStore(str(tmp_path / "back"), RECORD)
    store.close()
    # Reopen through a checkpoint of the damaged file: RunStore reads its MANIFEST.
    healthy = RunStore(str(tmp_path / "h"), RECORD)
    healthy.write(keys, records_for(keys, 3))
    healthy.checkpoint(str(tmp_path / "ckpt"))
    healthy.close()
    (linked,) = (tmp_path / "ckpt").glob("run-*.kvr")
    os.unlink(linked)
    linked.write_bytes(bytes(data))
    damaged = RunStore.restore(str(tmp_path / "ckpt"), str(tmp_path / "d"), RECORD)
    count = int.from_bytes(data[64 + 4 : 64 + 8], "little")
    first_page_keys = [
        int.from_bytes(data[64 + 8 + i * (8 + RECORD) :][:8], "little", signed=True)
        for i in range(count)
    ]
    with pytest.raises(errors.CorruptRecord) as raised:
        damaged.read(np.array(first_page_keys[:1], dtype=np.int64))
    message = str(raised.value)
    assert linked.name in message and "offset 64" in message, message
    assert f"key {first_page_keys[0]}" in message, message
    # Keys of other pages are served exactly.
    others = np.array([k for k in range(1000) if k not in first_page_keys], dtype=np.int64)
    out, found = damaged.read(others[-100:])
    assert found.all()
    np.testing.assert_array_equal(out, records_for(others[-100:], 3))


def test_a_checkpoint_killed_before_its_manifest_is_refused(tmp_path):
    """kill -9 of a process in the middle of checkpoints by reference: a checkpoint
    directory without MANIFEST is refused by name; the ones that finished restore."""
    script = f"""
import numpy as np, os, sys
from kvsparse._core import RunStore
store = RunStore({str(tmp_path / "s")!r}, {RECORD}, check_writes=False)
keys = np.arange(200000, dtype=np.int64)
store.write(keys, np.zeros((len(keys), {RECORD}), np.uint8))
i = 0
while True:
    store.checkpoint(os.path.join({str(tmp_path)!r}, f"ckpt-{{i}}"))
    print(i, flush=True)
    i += 1
"""
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, env=subprocess_env(), text=True
    )
    try:
        for _ in range(3):
            line = process.stdout.readline()
            assert line, "the checkpointing process ended"
    finally:
        process.kill()
        process.wait(timeout=30)
    finished = refused = 0
    for directory in sorted(tmp_path.glob("ckpt-*")):
        target = tmp_path / ("restored-" + directory.name)
        if (directory / "MANIFEST").exists():
            store = RunStore.restore(str(directory), str(target), RECORD)
            assert store.stats()["live_records"] == 200000
            store.close()
            finished += 1
        else:
            with pytest.raises(errors.CorruptRecord, match="no MANIFEST"):
                RunStore.restore(str(directory), str(target), RECORD)
            refused += 1
    assert finished >= 3


def _writer(store, model, record_salt=3):
    """write(count): a run of count new keys, in the store and the model."""
    next_key = 0

    def write(count):
        nonlocal next_key
        keys = np.arange(next_key, next_key + count, dtype=np.int64)
        next_key += count
        store.write(keys, records_for(keys, record_salt))
        model.write(keys, records_for(keys, record_salt))
        return keys

    return write


def test_runs_of_one_size_merge_whatever_their_age_and_a_large_young_run_stays(tmp_path):
    """Four small runs between large ones merge (the output goes where the newest was);
    the large runs are not read. Takes and a write back of taken keys in between: every
    key reads as the model says, before and after."""
    store = RunStore(str(tmp_path / "s"), RECORD, check_writes=False)
    model = DictModel()
    write = _writer(store, model)
    large = 40000  # 3.5 MB: above twice the size (1 MiB) under which every run is alike
    write(large)
    small = [write(1000)]
    write(large)
    small += [write(1000), write(1000)]
    write(large)  # the newest large run
    small.append(write(1000))
    taken = small[0][:100]
    out, found = store.take(taken)
    assert found.all()
    for key in taken.tolist():
        model.rows.pop(key)
    again = records_for(taken, 9)
    store.write(taken, again)  # a run of 100, newer than all
    model.write(taken, again)
    every = np.arange(3 * large + 4 * 1000, dtype=np.int64)
    model.check(store, every)
    before = store.stats()
    assert before["segments"] == 8
    while store.maintenance(1):
        pass
    after = store.stats()
    # The four small runs and the run of 100 (all under 1 MiB: one bucket) became one.
    assert after["segments"] == 4, after["segments"]
    moved = after["gc_bytes_moved"] - before["gc_bytes_moved"]
    # ~4,100 records read and written (whole pages), none of the 120,000 in large runs.
    assert moved < 2 * 4100 * (RECORD + 8) * 1.2, moved
    model.check(store, every)
    store.close()


def test_runs_whose_sizes_hover_at_a_power_of_fan_in_merge_about_log_times(tmp_path):
    """Pushes of 16,384 rows write runs of 16,384 give or take a few (4^7: the boundary of
    the old fixed size classes). Runs of two classes alternated, never four of one in a
    row, and past 24 runs any four in a row merged: a 1 GiB fill wrote 35 bytes per byte
    of rows. A record is now rewritten about log4(runs) times and the runs stay few."""
    store = RunStore(str(tmp_path / "s"), RECORD, check_writes=False)
    model = DictModel()
    write = _writer(store, model)
    rng = np.random.default_rng(5)
    batches, most_runs = 48, 0
    for _ in range(batches):
        write(16384 + int(rng.integers(-300, 300)))
        store.maintenance(8 * 16384 * RECORD)  # a disk tier's pace: 8 bytes a byte written
        most_runs = max(most_runs, store.stats()["segments"])
    while store.maintenance(64 << 20):
        pass
    stats = store.stats()
    data = stats["live_records"] * (RECORD + 8)
    # log4(48) = 2.8 merges a record at most, plus its first write; pages' padding.
    assert stats["bytes_written"] / data < 4.5, stats["bytes_written"] / data
    # Three runs of a size at most before four merge: 3 x log4(48) and the one building.
    # (The old classes kept 24 here.)
    assert most_runs <= 12, most_runs
    assert stats["segments"] <= 9, stats["segments"]
    model.check(store, np.arange(0, len(model.rows), 97, dtype=np.int64))
    store.close()


def _allocated(directory) -> int:
    """Bytes the file system holds for the run files in directory (holes excluded)."""
    return sum(os.stat(path).st_blocks * 512 for path in directory.glob("*.kvr"))


@pytest.mark.parametrize("linked", [False, True])
def test_a_merge_gives_back_its_inputs_pages_as_it_passes_them_unless_a_checkpoint_links_them(
    tmp_path, linked
):
    """Without it a merge of the largest runs held its inputs and its output on disk at once:
    twice the store. The pages of a checkpoint's hard-linked file stay: they are its too."""
    store = RunStore(str(tmp_path / "s"), RECORD, check_writes=False)
    model = DictModel()
    for r in range(4):  # four runs of one size: a merge
        keys = np.arange(r * 65536, (r + 1) * 65536, dtype=np.int64)
        store.write(keys, records_for(keys, r))
        model.write(keys, records_for(keys, r))
    if linked:
        store.checkpoint(tmp_path / "ckpt")
    inputs = _allocated(tmp_path / "s")
    before = store.stats()["bytes_written"]
    for _ in range(20):  # a fragment a step: some of the way through the merge
        assert store.maintenance(1)
    assert store.stats()["segments"] == 5  # four inputs and the output being built
    written = store.stats()["bytes_written"] - before
    now = _allocated(tmp_path / "s")
    if linked:
        assert now >= inputs + written, (inputs, written, now)
    else:
        # What the output took, the inputs gave back (give or take a fragment's pages).
        assert now < inputs + written // 4, (inputs, written, now)
    every = np.arange(4 * 65536, dtype=np.int64)
    model.check(store, every)
    while store.maintenance(64 << 20):
        pass
    model.check(store, every)
    if linked:
        restored = RunStore.restore(str(tmp_path / "ckpt"), str(tmp_path / "r"), RECORD)
        model.check(restored, every)
        restored.close()
    store.close()
