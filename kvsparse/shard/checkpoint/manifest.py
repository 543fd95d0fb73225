"""Checkpoint names and manifests: listing, reading, the delta chain, prepare and commit.

Checkpoint ``seq`` of a directory is one shard file per server,
``ckpt-{seq:06d}.shard-{i:05d}-of-{n:05d}.kvs``, and the manifest
``ckpt-{seq:06d}.manifest.json`` that server 0 writes last (`commit`), once
every shard file is in place: a checkpoint without a manifest does not exist.
A delta's manifest names its parent; `chain` follows the parents back to the
full checkpoint.

Every function here is thread-safe in itself (each reads or atomically
writes files); two saves into one directory at once are not supported.
"""

from __future__ import annotations

import json
import os
import re

from kvsparse.shard.checkpoint.files import AtomicFile
from kvsparse.shard.checkpoint.format import FORMAT, READABLE_VERSIONS, VERSION, CheckpointError

_MANIFEST_RE = re.compile(r"^ckpt-(\d{6})\.manifest\.json$")


def shard_file_name(seq: int, shard_index: int, num_shards: int) -> str:
    """The name of shard shard_index's file of checkpoint seq. Thread-safe."""
    return f"ckpt-{seq:06d}.shard-{shard_index:05d}-of-{num_shards:05d}.kvs"


def manifest_name(seq: int) -> str:
    """The name of checkpoint seq's manifest. Thread-safe."""
    return f"ckpt-{seq:06d}.manifest.json"


def list_manifests(path: str) -> list[int]:
    """Sequence numbers of the complete checkpoints in path, ascending. Thread-safe."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_MANIFEST_RE.match, names) if m)


def read_manifest(path: str, seq: int) -> dict:
    """The manifest of checkpoint seq; CheckpointError if unreadable or corrupt. Thread-safe."""
    name = os.path.join(path, manifest_name(seq))
    try:
        with open(name, "rb") as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{name}: cannot read the manifest ({exc})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{name}: unknown manifest format or version")
    return manifest


def latest_manifest(path: str) -> dict | None:
    """The newest complete checkpoint's manifest in path, or None if there is none.

    Thread-safe.
    """
    seqs = list_manifests(path)
    return read_manifest(path, seqs[-1]) if seqs else None


def require_manifest(path: str, seq: int | None = None) -> dict:
    """The manifest of checkpoint seq, or of the latest one when seq is None. Thread-safe.

    Raises:
        CheckpointError: no complete checkpoint in path, or an unreadable manifest.
    """
    if seq is not None:
        return read_manifest(path, int(seq))
    manifest = latest_manifest(path)
    if manifest is None:
        raise CheckpointError(f"{path}: no complete checkpoint found")
    return manifest


def chain(path: str, manifest: dict) -> list[dict]:
    """[full manifest, delta, delta, ...] ending with manifest. Thread-safe."""
    out = [manifest]
    while out[0]["kind"] == "delta":
        out.insert(0, read_manifest(path, int(out[0]["parent"])))
    return out


def prepare(path: str) -> dict:
    """Server 0: creates path if needed; {"seq": next number, "latest": manifest or None}.

    Thread-safe, but two saves into one directory at once may get the same number.
    """
    os.makedirs(path, exist_ok=True)
    latest = latest_manifest(path)
    # Numbers of failed saves are skipped too: their stray files never get reused.
    taken = [int(n[5:11]) for n in os.listdir(path) if n.startswith("ckpt-") and n[5:11].isdigit()]
    return {"seq": max([0, *taken]) + 1, "latest": latest}


def commit(path: str, manifest: dict) -> None:
    """Server 0: checks every shard file of manifest exists with its size, then writes it.

    Thread-safe (the manifest appears whole, by rename).

    Raises:
        CheckpointError: a shard file is missing or has another size than its save reported.
    """
    for shard in manifest["shards"]:
        name = os.path.join(path, shard["file"])
        try:
            size = os.path.getsize(name)
        except OSError:
            raise CheckpointError(f"{name}: shard file missing at commit") from None
        if size != int(shard["bytes"]):
            raise CheckpointError(f"{name}: {size} bytes, the save reported {shard['bytes']}")
    body = json.dumps({"format": FORMAT, "version": VERSION, **manifest}, indent=1).encode()
    with AtomicFile(os.path.join(path, manifest_name(int(manifest["seq"])))) as f:
        f.write(body)
