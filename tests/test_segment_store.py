"""The disk tier's storage engine (csrc/segment_store.h) through kvsparse._core.SegmentStore.

A hypothesis property runs random writes, overwrites, erases, garbage
collection, reopens and checkpoint/restore against a plain dict. The other
tests cover what a dict cannot show: space reclaimed by garbage collection,
recovery after a crash and after a torn write, checkpoints made of hard links,
a flipped byte detected and named, a full disk (RLIMIT_FSIZE, so no root is
needed) that applies nothing, and several threads at once.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import subprocess_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsparse import _core, errors

RECORD_BYTES = 40
SLOT_BYTES = 24 + RECORD_BYTES  # the slot header of csrc/segment_store.h
HEADER_BYTES = 64
SMALL_SEGMENT = HEADER_BYTES + 16 * SLOT_BYTES  # 16 records a file: many files, much GC


def records_for(keys, version: int) -> np.ndarray:
    """A record per key that says which key and which write it came from."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    out = np.empty((len(keys), RECORD_BYTES), dtype=np.uint8)
    out[:, :8] = keys.view(np.uint8).reshape(-1, 8)
    out[:, 8:16] = np.full(len(keys), version, np.int64).view(np.uint8).reshape(-1, 8)
    out[:, 16:] = ((keys[:, None] * 31 + version + np.arange(RECORD_BYTES - 16)) % 251).astype(
        np.uint8
    )
    return out


def open_store(path, **options) -> _core.SegmentStore:
    options.setdefault("segment_bytes", SMALL_SEGMENT)
    options.setdefault("read_threads", 4)
    return _core.SegmentStore(str(path), RECORD_BYTES, **options)


def assert_matches(store: _core.SegmentStore, model: dict[int, np.ndarray], probe=()) -> None:
    keys = np.array(sorted(set(model) | set(probe)), dtype=np.int64)
    records, found = store.read(keys)
    for i, key in enumerate(keys.tolist()):
        assert bool(found[i]) == (key in model), key
        if key in model:
            np.testing.assert_array_equal(records[i], model[key], err_msg=str(key))
        else:
            assert not records[i].any()
    assert store.stats()["live_records"] == len(model)
    np.testing.assert_array_equal(store.contains(keys), [k in model for k in keys.tolist()])


def segment_files(path) -> list[str]:
    return sorted(name for name in os.listdir(path) if name.startswith("segment-"))


# ---------------------------------------------------------------------------
# Against a dict
# ---------------------------------------------------------------------------

KEYS = st.sampled_from([-(2**63), -7, -1, 0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 2**40, 2**63 - 1])
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.lists(KEYS, min_size=1, max_size=40)),
        st.tuples(st.just("erase"), st.lists(KEYS, max_size=6)),
        st.tuples(st.just("gc"), st.sampled_from([1, 500, 5_000, 1 << 20])),
        st.tuples(st.just("reopen"), st.none()),
        st.tuples(st.just("checkpoint_restore"), st.none()),
    ),
    max_size=25,
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(operations=OPERATIONS, stale_fraction=st.sampled_from([0.1, 1 / 3, 1.0]))
def test_behaves_like_a_dict(tmp_path_factory, operations, stale_fraction):
    root = tmp_path_factory.mktemp("store")
    path = root / "live"
    store = open_store(path, gc_stale_fraction=stale_fraction)
    model: dict[int, np.ndarray] = {}
    try:
        for step, (operation, argument) in enumerate(operations):
            if operation == "write":
                records = records_for(argument, step)
                store.write(np.array(argument, dtype=np.int64), records)
                for key, record in zip(argument, records):
                    model[key] = record  # a key given twice keeps its last record
            elif operation == "erase":
                store.erase(np.array(argument, dtype=np.int64))
                for key in argument:
                    model.pop(key, None)
            elif operation == "gc":
                store.maintenance(argument)
            elif operation == "reopen":
                store.close()
                store = open_store(path, gc_stale_fraction=stale_fraction)
            else:
                checkpoint = root / f"checkpoint{step}"
                store.checkpoint(str(checkpoint))
                store.close()
                path = root / f"restored{step}"
                store = _core.SegmentStore.restore(
                    str(checkpoint), str(path), RECORD_BYTES, segment_bytes=SMALL_SEGMENT
                )
            assert_matches(store, model, probe=[4, 2**40])
        # Garbage collection until nothing is left to collect keeps every record.
        while store.maintenance(1 << 20):
            pass
        assert_matches(store, model)
        store.close()
        assert_matches(open_store(path), model)
    finally:
        store.close()


def test_duplicate_keys_in_one_batch_keep_the_last_record(tmp_path):
    with open_store(tmp_path) as store:
        keys = np.array([5, 6, 5, 5], dtype=np.int64)
        records = records_for(keys, 0)
        records[:, 8] = np.arange(4)
        store.write(keys, records)
        got, found = store.read(np.array([5, 6]))
        assert found.all()
        np.testing.assert_array_equal(got, records[[3, 1]])
        assert store.stats()["live_records"] == 2
        # A key asked for several times in one read gets its record each time.
        got, found = store.read(np.array([5, 6, 5, 9, 5]))
        np.testing.assert_array_equal(found, [True, True, True, False, True])
        np.testing.assert_array_equal(got[[0, 2, 4]], records[[3, 3, 3]])
        np.testing.assert_array_equal(got[1], records[1])
        assert not got[3].any()


# ---------------------------------------------------------------------------
# Garbage collection
# ---------------------------------------------------------------------------


def test_garbage_collection_reclaims_space_and_keeps_every_live_record(tmp_path):
    with open_store(tmp_path, segment_bytes=HEADER_BYTES + 64 * SLOT_BYTES) as store:
        keys = np.arange(2_000, dtype=np.int64)
        model = {}
        for version in range(4):
            # Each round rewrites three keys in four: older files go mostly stale.
            chosen = keys if version == 0 else keys[keys % 4 != version]
            records = records_for(chosen, version)
            store.write(chosen, records)
            model.update(zip(chosen.tolist(), records))
        store.erase(keys[:100])
        for key in range(100):
            del model[key]
        before = store.stats()
        assert before["disk_bytes"] > 2.5 * len(model) * SLOT_BYTES

        # Rate-limited: one call moves about its budget, then stops.
        moved = store.maintenance(50_000)
        assert 0 < moved <= 50_000 + 4 * 64 * SLOT_BYTES
        assert_matches(store, model)
        while store.maintenance(200_000):
            assert_matches(store, model, probe=range(100))

        after = store.stats()
        assert after["gc_segments_freed"] > 0
        assert after["gc_records_moved"] > 0
        assert after["disk_bytes"] < before["disk_bytes"] / 2
        assert after["segments"] == len(segment_files(tmp_path))
        # Every file left is at most a third stale (the default threshold).
        assert after["disk_bytes"] <= 1.5 * len(model) * SLOT_BYTES + 4 * 64 * SLOT_BYTES
        assert_matches(store, model, probe=range(100))
    with open_store(tmp_path, segment_bytes=HEADER_BYTES + 64 * SLOT_BYTES) as store:
        assert_matches(store, model, probe=range(100))


def test_tombstones_stop_resurrecting_erased_keys_after_gc_and_reopen(tmp_path):
    with open_store(tmp_path) as store:
        store.write(np.arange(64), records_for(np.arange(64), 0))
        store.erase(np.arange(0, 64, 2))
        store.write(np.arange(64, 200), records_for(np.arange(64, 200), 1))
        while store.maintenance(1 << 20):
            pass
        model = {k: records_for([k], 0 if k < 64 else 1)[0] for k in range(1, 200, 2)}
        model.update({k: records_for([k], 1)[0] for k in range(64, 200)})
    with open_store(tmp_path) as store:
        assert_matches(store, model, probe=range(64))


# ---------------------------------------------------------------------------
# Recovery
# ---------------------------------------------------------------------------

CRASHING_WRITER = """
import os, signal, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from test_segment_store import open_store, records_for
store = open_store(sys.argv[1])
for version in range(5):
    keys = np.arange(version * 50, version * 50 + 300, dtype=np.int64)
    store.write(keys, records_for(keys, version))
os.kill(os.getpid(), signal.SIGKILL)  # no close, no sync
"""


def test_recovers_after_the_writer_is_killed(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", CRASHING_WRITER, str(tmp_path), os.path.dirname(__file__)],
        env=subprocess_env(),
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    model = {}
    for version in range(5):
        keys = np.arange(version * 50, version * 50 + 300, dtype=np.int64)
        model.update(zip(keys.tolist(), records_for(keys, version)))
    with open_store(tmp_path) as store:
        assert_matches(store, model)


def test_a_torn_tail_is_cut_and_the_older_record_comes_back(tmp_path):
    with open_store(tmp_path, segment_bytes=1 << 20) as store:
        store.write(np.arange(10), records_for(np.arange(10), 0))
        store.write(np.array([3, 4]), records_for([3, 4], 1))
    newest = tmp_path / segment_files(tmp_path)[-1]
    size = newest.stat().st_size
    # The crash hit the middle of the last write: key 4's new record is torn.
    os.truncate(newest, size - SLOT_BYTES // 2)
    model = {k: records_for([k], 0)[0] for k in range(10)}
    model[3] = records_for([3], 1)[0]
    with open_store(tmp_path, segment_bytes=1 << 20) as store:
        assert_matches(store, model)
        store.write(np.array([11]), records_for([11], 2))
        model[11] = records_for([11], 2)[0]
    assert newest.stat().st_size == size - SLOT_BYTES  # cut back to whole records
    with open_store(tmp_path, segment_bytes=1 << 20) as store:
        assert_matches(store, model)


def test_reopening_with_another_record_size_is_refused(tmp_path):
    with open_store(tmp_path) as store:
        store.write(np.arange(3), records_for(np.arange(3), 0))
    with pytest.raises(errors.InvalidArgument, match="records of 40 bytes"):
        _core.SegmentStore(str(tmp_path), RECORD_BYTES + 1)


# ---------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------


def test_checkpoint_is_hard_links_and_restores_that_moment(tmp_path):
    live, checkpoint = tmp_path / "live", tmp_path / "checkpoint"
    with open_store(live) as store:
        store.write(np.arange(100), records_for(np.arange(100), 0))
        store.checkpoint(str(checkpoint))
        linked = segment_files(checkpoint)
        assert linked == segment_files(live)
        for name in linked:
            assert os.stat(live / name).st_ino == os.stat(checkpoint / name).st_ino
        assert (checkpoint / "MANIFEST").exists()

        # Later writes, erases and GC leave the checkpoint as it was.
        store.write(np.arange(50), records_for(np.arange(50), 1))
        store.erase(np.arange(90, 100))
        while store.maintenance(1 << 20):
            pass
        model_now = {k: records_for([k], 1 if k < 50 else 0)[0] for k in range(90)}
        assert_matches(store, model_now, probe=range(100))

        with pytest.raises(errors.InvalidArgument, match="not empty"):
            store.checkpoint(str(checkpoint))

    model_then = {k: records_for([k], 0)[0] for k in range(100)}
    for attempt in range(2):  # a checkpoint can be restored more than once
        restored = _core.SegmentStore.restore(
            str(checkpoint),
            str(tmp_path / f"restored{attempt}"),
            RECORD_BYTES,
            segment_bytes=SMALL_SEGMENT,
        )
        with restored:
            assert_matches(restored, model_then)
            restored.write(np.array([7]), records_for([7], 9))
    with open_store(live) as store:
        assert_matches(store, model_now, probe=range(100))


def test_restore_names_a_wrong_record_size_and_a_missing_manifest(tmp_path):
    with open_store(tmp_path / "live") as store:
        store.write(np.arange(3), records_for(np.arange(3), 0))
        store.checkpoint(str(tmp_path / "checkpoint"))
    with pytest.raises(errors.InvalidArgument, match="another size"):
        _core.SegmentStore.restore(str(tmp_path / "checkpoint"), str(tmp_path / "a"), 8)
    with pytest.raises(errors.StorageError, match="MANIFEST"):
        _core.SegmentStore.restore(str(tmp_path / "live"), str(tmp_path / "b"), RECORD_BYTES)


# ---------------------------------------------------------------------------
# Corruption
# ---------------------------------------------------------------------------


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("where", ["payload", "key"])
def test_a_flipped_byte_is_detected_named_and_never_served(tmp_path, where):
    with open_store(tmp_path) as store:
        keys = np.arange(40, dtype=np.int64)
        store.write(keys, records_for(keys, 0))
        first = segment_files(tmp_path)[0]
        slot = 5  # key 5's record, in the first file
        offset = HEADER_BYTES + slot * SLOT_BYTES + (24 + 17 if where == "payload" else 0)
        flip_byte(tmp_path / first, offset)

        with pytest.raises(errors.CorruptRecord) as raised:
            store.read(np.array([4, 5, 6]))
        message = str(raised.value)
        assert first in message
        assert f"offset {HEADER_BYTES + slot * SLOT_BYTES}" in message
        assert "key 5" in message
        assert isinstance(raised.value, OSError)
        # The rest of the store goes on serving.
        model = {k: records_for([k], 0)[0] for k in range(40) if k != 5}
        records, found = store.read(np.array(sorted(model)))
        assert found.all()
        np.testing.assert_array_equal(records, np.stack([model[k] for k in sorted(model)]))
    # A sealed file with a bad record is not opened as if nothing happened.
    with pytest.raises(errors.CorruptRecord, match=first):
        open_store(tmp_path)


def test_a_bad_record_before_good_ones_in_the_newest_file_is_no_torn_tail(tmp_path):
    with open_store(tmp_path, segment_bytes=1 << 20) as store:
        store.write(np.arange(10), records_for(np.arange(10), 0))
    flip_byte(tmp_path / segment_files(tmp_path)[-1], HEADER_BYTES + 2 * SLOT_BYTES + 30)
    with pytest.raises(errors.CorruptRecord, match="not a torn tail"):
        open_store(tmp_path, segment_bytes=1 << 20)


def test_garbage_collection_does_not_copy_a_corrupt_record(tmp_path):
    with open_store(tmp_path) as store:
        store.write(np.arange(16), records_for(np.arange(16), 0))  # fills file 1
        store.write(np.arange(1, 16), records_for(np.arange(1, 16), 1))
        flip_byte(tmp_path / segment_files(tmp_path)[0], HEADER_BYTES + 24 + 3)  # key 0, live
        with pytest.raises(errors.CorruptRecord, match="key 0"):
            store.maintenance(1 << 20)
        with pytest.raises(errors.CorruptRecord):
            store.read(np.array([0]))


# ---------------------------------------------------------------------------
# A full disk
# ---------------------------------------------------------------------------


def test_a_full_disk_is_named_and_applies_nothing(tmp_path):
    """RLIMIT_FSIZE stands for the full disk: a write past it fails with EFBIG
    (SIGXFSZ ignored), as ENOSPC would on a full file system."""
    segment = HEADER_BYTES + 400 * SLOT_BYTES
    store = open_store(tmp_path, segment_bytes=segment)
    keys = np.arange(200, dtype=np.int64)
    store.write(keys, records_for(keys, 0))
    model = dict(zip(keys.tolist(), records_for(keys, 0)))
    sizes = {name: os.path.getsize(tmp_path / name) for name in segment_files(tmp_path)}

    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (HEADER_BYTES + 250 * SLOT_BYTES, hard))
    try:
        # Overwrites and new keys; the batch crosses the limit partway.
        batch = np.arange(100, 400, dtype=np.int64)
        with pytest.raises(errors.DiskFull, match="disk full") as raised:
            store.write(batch, records_for(batch, 1))
        assert isinstance(raised.value, OSError)
        # Nothing of it applied; the files are as they were.
        assert_matches(store, model, probe=batch)
        assert {n: os.path.getsize(tmp_path / n) for n in segment_files(tmp_path)} == sizes
        # An erase that cannot write its tombstones removes nothing.
        store.write(np.arange(400, 450), records_for(np.arange(400, 450), 2))  # fits
        model.update(zip(range(400, 450), records_for(np.arange(400, 450), 2)))
        with pytest.raises(errors.DiskFull):
            store.erase(keys)
        assert_matches(store, model)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)
    # With room again, the caller writes the batch it kept.
    store.write(batch, records_for(batch, 1))
    model.update(zip(batch.tolist(), records_for(batch, 1)))
    assert_matches(store, model)
    store.close()
    with open_store(tmp_path, segment_bytes=segment) as store:
        assert_matches(store, model)


def test_a_full_disk_in_a_file_the_batch_created_removes_that_file(tmp_path):
    segment = HEADER_BYTES + 400 * SLOT_BYTES
    keys = np.arange(40, dtype=np.int64)
    with open_store(tmp_path, segment_bytes=segment) as store:
        store.write(keys, records_for(keys, 0))
    model = dict(zip(keys.tolist(), records_for(keys, 0)))
    files = segment_files(tmp_path)
    # A reopened store never appends to old files: the next batch opens a new one.
    store = open_store(tmp_path, segment_bytes=segment)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (HEADER_BYTES + 100 * SLOT_BYTES, hard))
    try:
        batch = np.arange(20, 220, dtype=np.int64)
        with pytest.raises(errors.DiskFull):
            store.write(batch, records_for(batch, 1))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)
    assert segment_files(tmp_path) == files  # the new file was removed again
    assert_matches(store, model, probe=batch)
    store.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
@pytest.mark.parametrize("slots_per_file", [150, 210])
def test_a_real_full_file_system_is_named_and_applies_nothing(tmp_path, slots_per_file):
    """ENOSPC from a 1 MiB tmpfs. With 210 slots a file, the failing batch (on
    this kernel) wrote its first part to the open file and failed creating the
    next one: the first part is truncated away and the new file removed."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
        check=True,
        timeout=30,
    )
    store = None
    try:
        segment = HEADER_BYTES + slots_per_file * SLOT_BYTES  # batches of 100 span files
        store = open_store(mount_point / "store", segment_bytes=segment)
        model = {}
        failed = None
        for version in range(1000):
            keys = np.arange(version * 100, version * 100 + 100, dtype=np.int64)
            names = segment_files(mount_point / "store")
            sizes = [os.path.getsize(mount_point / "store" / n) for n in names]
            try:
                store.write(keys, records_for(keys, version))
            except errors.DiskFull as error:
                failed = (keys, names, sizes, str(error))
                break
            model.update(zip(keys.tolist(), records_for(keys, version)))
        assert failed is not None, "a 1 MiB tmpfs never filled up"
        keys, names, sizes, message = failed
        assert "No space left on device" in message
        assert segment_files(mount_point / "store") == names
        assert [os.path.getsize(mount_point / "store" / n) for n in names] == sizes
        assert_matches(store, model, probe=keys)
        # The store goes on: erasing frees nothing yet (tombstones need space)
        # but reads keep working, and a reopen sees the same rows.
        store.close()
        store = open_store(mount_point / "store", segment_bytes=segment)
        assert_matches(store, model, probe=keys)
    finally:
        if store is not None:
            store.close()  # open files would keep the mount busy
        subprocess.run(["umount", str(mount_point)], check=True, timeout=30)


# ---------------------------------------------------------------------------
# Input errors and threads
# ---------------------------------------------------------------------------


def test_bad_input_is_named_and_the_store_goes_on(tmp_path):
    with pytest.raises(errors.InvalidArgument, match="record_bytes"):
        _core.SegmentStore(str(tmp_path / "x"), 0)
    with pytest.raises(errors.InvalidArgument, match="gc_stale_fraction"):
        _core.SegmentStore(str(tmp_path / "y"), 8, gc_stale_fraction=0.0)
    store = open_store(tmp_path / "store")
    with pytest.raises(errors.ShapeError, match="records must have shape"):
        store.write(np.arange(2), np.zeros((2, RECORD_BYTES + 1), np.uint8))
    with pytest.raises(errors.DTypeError, match="keys"):
        store.write(np.arange(2.0), np.zeros((2, RECORD_BYTES), np.uint8))
    with pytest.raises(errors.DTypeError, match="records"):
        store.write(np.arange(2), np.zeros((2, RECORD_BYTES), np.float32))
    readonly = records_for([1, 2], 0)
    readonly.flags.writeable = False
    keys = np.array([1, 2])
    keys.flags.writeable = False
    store.write(keys, readonly)
    assert_matches(store, {1: readonly[0], 2: readonly[1]})
    store.close()
    with pytest.raises(errors.InvalidArgument, match="closed"):
        store.read(keys)


def test_several_threads_at_once(tmp_path):
    """The header says SegmentStore may be called from several threads at once."""
    store = open_store(tmp_path, segment_bytes=HEADER_BYTES + 256 * SLOT_BYTES, read_threads=8)
    failures = []

    def worker(base: int) -> None:
        try:
            keys = np.arange(base, base + 500, dtype=np.int64)
            for version in range(6):
                written = keys[version % 2 :: 2]
                store.write(written, records_for(written, version))
                records, found = store.read(written)
                assert found.all()
                np.testing.assert_array_equal(records, records_for(written, version))
                if version % 2:
                    store.maintenance(30_000)
            expected = np.concatenate([records_for(keys[0::2], 4), records_for(keys[1::2], 5)])
            order = np.concatenate([keys[0::2], keys[1::2]])
            records, found = store.read(order)
            assert found.all()
            np.testing.assert_array_equal(records, expected)
        except BaseException as error:  # reported on the main thread
            failures.append(error)

    threads = [threading.Thread(target=worker, args=(base,)) for base in (0, 10_000, 20_000)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert not failures, failures
    assert store.stats()["live_records"] == 1500
    store.close()
