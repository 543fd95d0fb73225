"""Checkpoints of a store's shards: full and incremental saves, loads with resharding.

A checkpoint directory holds numbered checkpoints. Checkpoint ``seq`` is

- one shard file per server, ``ckpt-{seq:06d}.shard-{i:05d}-of-{n:05d}.kvs``,
  written by that server (see docs/checkpoint-format.md for the layout), and
- ``ckpt-{seq:06d}.manifest.json``, written by server 0 after every shard
  file is in place.

Every file is written to a temporary name, fsynced and renamed, and the
manifest comes last: a checkpoint without a manifest does not exist, so a
crash in the middle of a save leaves the previous checkpoint loadable. A
delta checkpoint (``kind: "delta"``) holds only the rows written since its
parent (plus the ids removed since then); loading it applies the chain
``full, delta, delta, ...`` in order.

Each server's shard file is a snapshot of one moment: the server forks and
the child writes its copy-on-write image while the parent keeps serving
(`kvsparse.server`). The local store writes inline.

Entry points:

- `save_shard` / `load_shard_state` / `restore_shard`: what a server runs.
- `prepare` / `commit`: server 0's part (next sequence number, manifest).
- `latest_manifest`, `read_shard_file`: inspection.
- `export_shard`: the keys and values of sparse tables as NumPy .npz, for
  `kvsparse.serving.EmbeddingLookup`.

Errors: a missing, truncated or corrupt file raises `CheckpointError`
(a `kvsparse.errors.InvalidArgument`, so also a ValueError), naming the file.
"""

from __future__ import annotations

import enum
import json
import mmap
import os
import re
import secrets
import struct
import sys
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

from kvsparse import _core, errors

FORMAT = "kvsparse-checkpoint"
VERSION = 1
MAGIC = b"KVSPCKPT"
END_MAGIC = b"KVSPEND1"
# magic (8) + version (u32) + flags (u32)
_HEAD = struct.Struct("<8sII")
# index length (u64) + index crc32 (u32) + end magic (8)
_TAIL = struct.Struct("<QI8s")
BLOCK_ROWS = 65536
PROGRESS_ROWS = 1_000_000  # a tqdm bar for files with at least this many rows

_MANIFEST_RE = re.compile(r"^ckpt-(\d{6})\.manifest\.json$")
# Test hook (issue 5 crash-during-save test): when the file this names exists,
# its content "sleep" makes a shard writer stop for a minute after its first
# block, "die" makes it exit at once there. Read here, not in config.py: it is
# not a setting.
_TEST_HOOK_ENV = "KVSPARSE_TEST_SAVE_HOOK"


class CheckpointError(errors.InvalidArgument):
    """A checkpoint file is missing, truncated, corrupt or of an unknown version."""


class CheckpointAction(str, enum.Enum):
    """The ``action`` field of a CHECKPOINT request body.

    A ``str`` enum: a member equals (and JSON-encodes as) its value, so bodies
    built with it and bodies decoded from the wire compare the same. Immutable,
    so safe to use from any thread.
    """

    PREPARE = "prepare"  # server 0: next sequence number and the latest manifest
    SAVE = "save"  # every server: write its shard file (full or incremental)
    COMMIT = "commit"  # server 0: check the shard files, write the manifest
    LOAD = "load"  # every server: replace its tables with the checkpoint's
    DESCRIBE = "describe"  # server 0: the manifest a load used (or the latest)
    EXPORT = "export"  # every server: keys and values as .npz for serving


def shard_file_name(seq: int, shard_index: int, num_shards: int) -> str:
    return f"ckpt-{seq:06d}.shard-{shard_index:05d}-of-{num_shards:05d}.kvs"


def manifest_name(seq: int) -> str:
    return f"ckpt-{seq:06d}.manifest.json"


# -- low-level file writing ---------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_temporary_files(path: str, pid: int) -> None:
    """Removes the temporary files a (dead) writer process pid left in path."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        if f".tmp-{pid}-" in name:
            try:
                os.unlink(os.path.join(path, name))
            except OSError:
                pass


def _atomic_write_bytes(final_path: str, data: bytes) -> None:
    tmp = f"{final_path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final_path)
    _fsync_dir(os.path.dirname(final_path) or ".")


class _BlockWriter:
    """Appends checksummed blocks to a temporary file; finish() writes the index and renames."""

    def __init__(self, final_path: str, total_rows: int, desc: str):
        self.final_path = final_path
        self.tmp_path = f"{final_path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        self.file = open(self.tmp_path, "wb")  # noqa: SIM115 - closed in finish/abort
        self.file.write(_HEAD.pack(MAGIC, VERSION, 0))
        self.offset = _HEAD.size
        self.blocks = 0
        self.progress = None
        if total_rows >= PROGRESS_ROWS:
            from tqdm import tqdm

            self.progress = tqdm(
                total=total_rows, unit="rows", desc=desc, file=sys.stderr, mininterval=2.0
            )
        self._hook = os.environ.get(_TEST_HOOK_ENV)

    def block(self, arrays: list[np.ndarray], rows: int = 0) -> dict:
        """Writes arrays back to back; returns their section entry (offset, length, crc32)."""
        start, crc = self.offset, 0
        for array in arrays:
            data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            if not data.nbytes:
                continue
            crc = zlib.crc32(data, crc)
            self.file.write(data)
            self.offset += data.nbytes
        self.blocks += 1
        if self.progress is not None and rows:
            self.progress.update(rows)
        if self._hook and self.blocks == 1 and os.path.exists(self._hook):
            self._run_hook()
        return {"offset": start, "length": self.offset - start, "crc32": crc}

    def _run_hook(self) -> None:
        with open(self._hook) as f:
            action = f.read().strip()
        self.file.flush()
        if action == "sleep":
            time.sleep(60)
        elif action == "die":
            os._exit(3)

    def finish(self, index: dict) -> int:
        body = json.dumps(index, separators=(",", ":")).encode()
        self.file.write(body)
        self.file.write(_TAIL.pack(len(body), zlib.crc32(body), END_MAGIC))
        self.file.flush()
        os.fsync(self.file.fileno())
        size = self.file.tell()
        self.file.close()
        if self.progress is not None:
            self.progress.close()
        os.replace(self.tmp_path, self.final_path)
        _fsync_dir(os.path.dirname(self.final_path) or ".")
        return size

    def abort(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self.file.close()
        try:
            os.unlink(self.tmp_path)
        except OSError:
            pass


# -- writing one shard --------------------------------------------------------------------


def write_shard_file(state, final_path: str, *, since: int | None, info: dict) -> dict:
    """Writes state's tables to final_path (tmp + fsync + rename).

    Args:
        state: a `kvsparse.shard.state.ShardState`; it must not change while this
            runs (a forked child's image, or the caller's own thread).
        final_path: the shard file to create.
        since: None for a full snapshot; else only rows written at a change
            epoch > since, and the ids removed since then.
        info: extra fields for the index (seq, shard_index, num_shards, ...).

    Returns:
        {"file", "bytes", "rows"}.
    """
    total = sum(len(e.table) for e in state.sparse.values())
    writer = _BlockWriter(final_path, total, desc=os.path.basename(final_path))
    try:
        index = {
            "format": FORMAT,
            "version": VERSION,
            **info,
            "kind": "full" if since is None else "delta",
            "default_optimizer": state.default_optimizer,
            "sparse": [],
            "dense": [],
        }
        rows_written = 0
        for table_id, entry in state.sparse.items():
            table = entry.table
            dim, num_slots = table.dim, table.num_slots
            section = {
                "table_id": table_id,
                "name": entry.name,
                "spec": entry.spec,
                "own_optimizer": entry.own_optimizer,
                "optimizer": table_optimizer_spec(state, entry),
                "dim": dim,
                "num_slots": num_slots,
                "table_step": int(table.table_step),
                "blocks": [],
                "removed": None,
            }
            if since is not None:
                removed = table.removed_since(since)
                section["removed"] = {"rows": int(removed.size), **writer.block([removed])}
            # Rows are stamped with epochs >= 1: since 0 is every row.
            # Buffers reused: each block is written out before the next is read.
            for keys, values, slots, steps in table.iter_state(since or 0, BLOCK_ROWS, True):
                block = writer.block([keys, values, slots, steps], rows=keys.size)
                section["blocks"].append({"rows": int(keys.size), **block})
                rows_written += int(keys.size)
            index["sparse"].append(section)
        for table_id, entry in state.dense.items():
            slots = entry.slots if entry.slots is not None else np.empty((0, entry.values.size))
            slots = np.ascontiguousarray(slots, np.float32)
            block = writer.block([entry.values, slots])
            index["dense"].append(
                {
                    "table_id": table_id,
                    "name": entry.name,
                    "size": int(entry.values.size),
                    "num_slots": int(slots.shape[0]),
                    "optimizer": entry.optimizer_spec,
                    "own_optimizer": entry.own_optimizer,
                    "step": int(entry.step),
                    **block,
                }
            )
        size = writer.finish(index)
    except BaseException:
        writer.abort()
        raise
    return {"file": os.path.basename(final_path), "bytes": size, "rows": rows_written}


def table_optimizer_spec(state, entry):
    """The optimizer a sparse table runs: its own, else the store-wide one."""
    return entry.spec.get("optimizer") if entry.own_optimizer else state.default_optimizer


# -- reading one shard --------------------------------------------------------------------


@dataclass
class ShardFile:
    """An opened, validated shard file: its index and raw bytes."""

    path: str
    index: dict
    data: memoryview = field(repr=False)

    def section(self, entry: dict) -> memoryview:
        start, length = int(entry["offset"]), int(entry["length"])
        if start < _HEAD.size or start + length > len(self.data):
            raise CheckpointError(f"{self.path}: a section lies outside the file (corrupt index)")
        view = self.data[start : start + length]
        if zlib.crc32(view) != int(entry["crc32"]):
            raise CheckpointError(
                f"{self.path}: checksum mismatch in the section at byte {start} (corrupt file)"
            )
        return view

    def sparse_blocks(self, section: dict):
        """Yields (keys, values, slots, steps) of each block of a sparse table section."""
        dim, num_slots = int(section["dim"]), int(section["num_slots"])
        for block in section["blocks"]:
            n = int(block["rows"])
            expected = n * (8 + 4 * dim + 4 * num_slots * dim + 8)
            if int(block["length"]) != expected:
                raise CheckpointError(f"{self.path}: block length does not match its row count")
            raw = self.section(block)
            a = 8 * n
            b = a + 4 * n * dim
            c = b + 4 * n * num_slots * dim
            keys = np.frombuffer(raw[:a], np.int64)
            values = np.frombuffer(raw[a:b], np.float32).reshape(n, dim)
            slots = np.frombuffer(raw[b:c], np.float32).reshape(n, num_slots, dim)
            steps = np.frombuffer(raw[c:], np.int64)
            yield keys, values, slots, steps

    def removed(self, section: dict) -> np.ndarray:
        entry = section.get("removed")
        if not entry:
            return np.empty(0, np.int64)
        raw = self.section(entry)
        if len(raw) != 8 * int(entry["rows"]):
            raise CheckpointError(f"{self.path}: removed-ids section has the wrong length")
        return np.frombuffer(raw, np.int64)

    def dense(self, section: dict) -> tuple[np.ndarray, np.ndarray]:
        size, num_slots = int(section["size"]), int(section["num_slots"])
        if int(section["length"]) != 4 * size * (1 + num_slots):
            raise CheckpointError(f"{self.path}: dense section has the wrong length")
        raw = self.section(section)
        values = np.frombuffer(raw[: 4 * size], np.float32)
        slots = np.frombuffer(raw[4 * size :], np.float32).reshape(num_slots, size)
        return values, slots


def read_shard_file(path: str) -> ShardFile:
    """Opens and validates a shard file's framing and index (sections are checked when read).

    Raises:
        CheckpointError: missing, truncated, corrupt, or another format version.

    Example:
        >>> f = read_shard_file("ckpt/ckpt-000001.shard-00000-of-00002.kvs")  # doctest: +SKIP
        >>> [t["name"] for t in f.index["sparse"]]                             # doctest: +SKIP
        ['user']
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # Mapped, not read: sections become arrays without a copy of the file.
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint file ({exc})") from None
    if len(data) < _HEAD.size + _TAIL.size:
        raise CheckpointError(f"{path}: truncated checkpoint file ({len(data)} bytes)")
    magic, version, _ = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise CheckpointError(f"{path}: not a kvsparse checkpoint file (bad magic)")
    if version != VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {version}; this kvsparse reads {VERSION}"
        )
    index_len, index_crc, end = _TAIL.unpack_from(data, len(data) - _TAIL.size)
    if end != END_MAGIC or index_len > len(data) - _HEAD.size - _TAIL.size:
        raise CheckpointError(f"{path}: truncated checkpoint file (no valid index at the end)")
    body = data[len(data) - _TAIL.size - index_len : len(data) - _TAIL.size]
    if zlib.crc32(body) != index_crc:
        raise CheckpointError(f"{path}: checksum mismatch in the index (corrupt file)")
    index = json.loads(body)
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(f"{path}: unknown checkpoint index format")
    return ShardFile(path, index, memoryview(data))


# -- manifests ------------------------------------------------------------------------------


def list_manifests(path: str) -> list[int]:
    """Sequence numbers of the complete checkpoints in path, ascending."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_MANIFEST_RE.match, names) if m)


def read_manifest(path: str, seq: int) -> dict:
    """The manifest of checkpoint seq; CheckpointError if unreadable or corrupt."""
    name = os.path.join(path, manifest_name(seq))
    try:
        with open(name, "rb") as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{name}: cannot read the manifest ({exc})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{name}: unknown manifest format or version")
    return manifest


def latest_manifest(path: str) -> dict | None:
    """The newest complete checkpoint's manifest in path, or None if there is none."""
    seqs = list_manifests(path)
    return read_manifest(path, seqs[-1]) if seqs else None


def chain(path: str, manifest: dict) -> list[dict]:
    """[full manifest, delta, delta, ...] ending with manifest."""
    out = [manifest]
    while out[0]["kind"] == "delta":
        out.insert(0, read_manifest(path, int(out[0]["parent"])))
    return out


def prepare(path: str) -> dict:
    """Server 0: creates path if needed; {"seq": next number, "latest": manifest or None}."""
    os.makedirs(path, exist_ok=True)
    seqs = list_manifests(path)
    latest = read_manifest(path, seqs[-1]) if seqs else None
    # Numbers of failed saves are skipped too: their stray files never get reused.
    taken = [int(n[5:11]) for n in os.listdir(path) if n.startswith("ckpt-") and n[5:11].isdigit()]
    return {"seq": max([0, *taken]) + 1, "latest": latest}


def commit(path: str, manifest: dict) -> None:
    """Server 0: checks every shard file of manifest exists with its size, then writes it."""
    for shard in manifest["shards"]:
        name = os.path.join(path, shard["file"])
        try:
            size = os.path.getsize(name)
        except OSError:
            raise CheckpointError(f"{name}: shard file missing at commit") from None
        if size != int(shard["bytes"]):
            raise CheckpointError(f"{name}: {size} bytes, the save reported {shard['bytes']}")
    body = json.dumps({"format": FORMAT, "version": VERSION, **manifest}, indent=1).encode()
    _atomic_write_bytes(os.path.join(path, manifest_name(int(manifest["seq"]))), body)


# -- saving and restoring a shard -------------------------------------------------------------


def begin_save(state, incremental: bool, path: str, parent: int | None) -> tuple:
    """Runs in the serving process right before the snapshot: (since, snapshot_epoch).

    Advances the change epoch, so that writes after this moment belong to the
    next delta. Raises InvalidArgument for an incremental save whose parent
    is not the checkpoint this shard last saved or loaded.
    """
    since = None
    if incremental:
        base = state.checkpoint_base
        if base is None or base != (os.path.realpath(path), parent):
            raise errors.InvalidArgument(
                f"incremental save: this shard's last checkpoint is {base}, not "
                f"checkpoint {parent} of {path}; make a full save first"
            )
        since = state.saved_epoch
    snapshot_epoch = state.change_epoch
    state.set_change_epoch(snapshot_epoch + 1)
    return since, snapshot_epoch


def end_save(state, path: str, seq: int, snapshot_epoch: int) -> None:
    """Runs in the serving process once its shard file is written."""
    state.saved_epoch = snapshot_epoch
    state.checkpoint_base = (os.path.realpath(path), seq)
    for entry in state.sparse.values():
        entry.table.prune_removed(snapshot_epoch)


def save_shard(state, path, seq, shard_index, num_shards, since, parent) -> dict:
    """Writes this shard's file of checkpoint seq; returns {"file", "bytes", "rows"}."""
    final = os.path.join(path, shard_file_name(seq, shard_index, num_shards))
    info = {"seq": seq, "shard_index": shard_index, "num_shards": num_shards, "parent": parent}
    return write_shard_file(state, final, since=since, info=info)


def _clear(state) -> None:
    state.sparse.clear()
    state.dense.clear()
    state.default_optimizer = None


def load_shard_state(state, path: str, shard_index: int, num_shards: int, seq=None) -> dict:
    """Replaces state's tables with shard shard_index of num_shards of a checkpoint.

    Reads the chain (full + deltas) of checkpoint seq (default: the latest
    complete one). With as many shards as were saved, only this shard's files
    are read; otherwise every old shard file is read and the rows whose
    `_core.shard_of(keys, num_shards)` is shard_index are kept (dense keys are
    re-split by `kvsparse.store.kvstore.dense_ranges`).

    Returns:
        The manifest loaded.

    Raises:
        CheckpointError: no checkpoint, or a missing/corrupt/truncated file.
        InvalidArgument: a range-partitioned table onto another shard count.
    """
    from kvsparse.placement import dense_ranges
    from kvsparse.shard.state import DenseEntry

    if seq is None:
        manifest = latest_manifest(path)
        if manifest is None:
            raise CheckpointError(f"{path}: no complete checkpoint found")
    else:
        manifest = read_manifest(path, int(seq))
    steps = chain(path, manifest)
    for m in steps:
        if int(m["num_shards"]) != int(steps[0]["num_shards"]):
            raise CheckpointError(f"{path}: checkpoint chain mixes shard counts")
    old_n = int(steps[0]["num_shards"])
    same = old_n == num_shards
    _clear(state)
    dense_parts: dict[int, dict] = {}
    read = [shard_index] if same else range(old_n)
    total_rows = sum(int(m["shards"][i].get("rows", 0)) for m in steps for i in read)
    progress = None
    if total_rows >= PROGRESS_ROWS:
        from tqdm import tqdm

        progress = tqdm(
            total=total_rows,
            unit="rows",
            desc=f"load shard {shard_index}",
            file=sys.stderr,
            mininterval=2.0,
        )
    try:
        for m in steps:
            files = read
            state.default_optimizer = m.get("default_optimizer")
            for old_index in files:
                shard = m["shards"][old_index]
                f = read_shard_file(os.path.join(path, shard["file"]))
                if f.index["kind"] != m["kind"] or int(f.index["seq"]) != int(m["seq"]):
                    raise CheckpointError(f"{f.path}: does not belong to checkpoint {m['seq']}")
                for section in f.index["sparse"]:
                    _load_sparse_section(
                        state, f, section, shard_index, num_shards, same, old_n, progress
                    )
                for section in f.index["dense"]:
                    values, slots = f.dense(section)
                    part = dense_parts.setdefault(section["table_id"], {"section": section})
                    part[old_index] = (values, slots)
                    part["section"] = section
            # A delta holds every dense key in full: the newest copy wins.
    finally:
        if progress is not None:
            progress.close()
    for table_id, parts in dense_parts.items():
        section = parts["section"]
        indices = [shard_index] if same else range(old_n)
        values = np.concatenate([parts[i][0] for i in indices])
        slots = np.concatenate([parts[i][1] for i in indices], axis=-1)
        if not same:
            a, b = dense_ranges(values.size, num_shards)[shard_index]
            values, slots = values[a:b], slots[:, a:b]
        entry = DenseEntry(section["name"], values.copy(), None, bool(section["own_optimizer"]))
        entry.set_optimizer(section["optimizer"])
        if entry.slots is not None:
            if entry.slots.shape != slots.shape:
                raise CheckpointError(f"{path}: dense key {section['name']!r} slots do not fit")
            entry.slots[...] = slots
        entry.step = int(section["step"])
        state.dense[table_id] = entry
    state.set_change_epoch(state.change_epoch + 1)
    state.saved_epoch = state.change_epoch - 1
    state.checkpoint_base = (os.path.realpath(path), int(manifest["seq"]))
    return manifest


def _load_sparse_section(state, f, section, shard_index, num_shards, same, old_n, progress) -> None:
    table_id = int(section["table_id"])
    spec = section["spec"]
    entry = state.sparse.get(table_id)
    if entry is None:
        if not same and spec.get("boundaries") is not None:
            raise errors.InvalidArgument(
                f"table {section['name']!r} has a RangePartitioner for {old_n} servers; "
                f"it cannot be loaded onto {num_shards}"
            )
        state.create_sparse(table_id, section["name"], spec)
        entry = state.sparse[table_id]
        if not entry.own_optimizer:
            entry.table.set_optimizer(section["optimizer"])
    table = entry.table
    if table.dim != int(section["dim"]) or table.num_slots != int(section["num_slots"]):
        raise CheckpointError(f"{f.path}: table {section['name']!r} changed shape in the chain")
    removed = f.removed(section)
    if removed.size:
        table.remove(removed)
    blocks = []
    for keys, values, slots, steps in f.sparse_blocks(section):  # views of the file: no copy
        if not same:
            mine = _core.shard_of(keys, num_shards) == shard_index
            keys, values, slots, steps = keys[mine], values[mine], slots[mine], steps[mine]
        blocks.append((keys, values, slots, steps))
    # All at once: rows come in the saved map's bucket order, and a map growing meanwhile
    # would make linear probing cluster (see EmbeddingTable::ReserveRows).
    table.reserve(len(table) + sum(b[0].size for b in blocks))
    for keys, values, slots, steps in blocks:
        table.write_state(keys, values, slots, steps)
        if progress is not None:
            progress.update(int(keys.size) if same else 0)
    if progress is not None and not same:
        progress.update(sum(int(b["rows"]) for b in section["blocks"]))
    table.table_step = int(section["table_step"])


def restore_shard(state, path: str, shard_index: int, num_shards: int) -> None:
    """Loads the latest complete checkpoint in path (base + deltas) into state.

    For a server restarting after a crash (``kvsparse server --restore PATH
    --shard-index I --num-shards N``): the state then holds exactly what
    shard I of N held at that checkpoint, optimizer slots and step counters
    included, resharded by key hash if the checkpoint had another shard count.

    Raises:
        CheckpointError: no complete checkpoint, or a corrupt/truncated file.

    Example:
        >>> state = ShardState()                                   # doctest: +SKIP
        >>> restore_shard(state, "/ckpt", shard_index=1, num_shards=3)  # doctest: +SKIP
    """
    load_shard_state(state, path, shard_index, num_shards)


# -- inference export -------------------------------------------------------------------------


def export_shard(state, path: str, shard_index: int, num_shards: int, table_ids, export_id: str):
    """Writes ``part-{i:05d}-of-{n:05d}.npz``: keys and values of the chosen sparse tables."""
    os.makedirs(path, exist_ok=True)
    arrays, meta = {}, {"format": "kvsparse-export", "version": 1, "export_id": export_id}
    meta.update({"part": shard_index, "num_parts": num_shards, "tables": []})
    for position, table_id in enumerate(table_ids):
        entry = state.sparse_entry(int(table_id))
        chunks = list(entry.table.iter_chunks(BLOCK_ROWS))
        keys = np.concatenate([c[0] for c in chunks]) if chunks else np.empty(0, np.int64)
        values = (
            np.concatenate([c[1] for c in chunks])
            if chunks
            else np.empty((0, entry.table.dim), np.float32)
        )
        order = np.argsort(keys, kind="stable")
        arrays[f"t{position}_keys"] = keys[order]
        arrays[f"t{position}_values"] = values[order]
        meta["tables"].append({"name": entry.name, "dim": entry.table.dim, "spec": entry.spec})
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    final = os.path.join(path, f"part-{shard_index:05d}-of-{num_shards:05d}.npz")
    tmp = f"{final}.tmp-{os.getpid()}-{secrets.token_hex(4)}.npz"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(path)
    rows = sum(int(a.shape[0]) for k, a in arrays.items() if k.endswith("_keys"))
    return {"file": os.path.basename(final), "rows": rows}


# -- one entry point for a shard's checkpoint requests ------------------------------------------


def handle(state, body: dict, shard_index: int, num_shards: int) -> dict:
    """Runs a checkpoint request body in-process (the local store; inline server actions).

    Actions: the `CheckpointAction` members.
    """
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise errors.InvalidArgument("checkpoint path must be a non-empty str")
    try:
        action = CheckpointAction(body.get("action"))
    except ValueError:
        raise errors.InvalidArgument(f"unknown checkpoint action {body.get('action')!r}") from None
    if action is CheckpointAction.PREPARE:
        return prepare(path)
    if action is CheckpointAction.COMMIT:
        commit(path, body["manifest"])
        return {}
    if action is CheckpointAction.LOAD:
        return load_shard_state(state, path, shard_index, num_shards)
    if action is CheckpointAction.DESCRIBE:
        base = state.checkpoint_base
        if base is not None and base[0] == os.path.realpath(path):
            return read_manifest(path, base[1])
        manifest = latest_manifest(path)
        if manifest is None:
            raise CheckpointError(f"{path}: no complete checkpoint found")
        return manifest
    if action is CheckpointAction.SAVE:
        since, epoch = begin_save(state, bool(body.get("incremental")), path, body.get("parent"))
        result = save_shard(
            state, path, int(body["seq"]), shard_index, num_shards, since, body.get("parent")
        )
        end_save(state, path, int(body["seq"]), epoch)
        return result
    return export_shard(state, path, shard_index, num_shards, body["table_ids"], body["export_id"])


__all__ = [
    "CheckpointAction",
    "CheckpointError",
    "FORMAT",
    "VERSION",
    "commit",
    "export_shard",
    "latest_manifest",
    "list_manifests",
    "load_shard_state",
    "prepare",
    "read_manifest",
    "read_shard_file",
    "restore_shard",
    "save_shard",
]
