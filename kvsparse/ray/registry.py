"""The kvsparse actors' names, and what a restarted actor finds again.

An actor's record (its address, its server's pid) lives in Ray's GCS key-value
store, which outlives any actor: a restarted shard binds the address it had.
The helpers below wait for, refuse and find actors by name.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import ray  # the Ray package (imports are absolute)

from kvsparse import config as cluster_config
from kvsparse import errors

NAMESPACE = "kvsparse"
NAME_PREFIX = "kvsparse-server"
START_TIMEOUT = 60.0
DEFAULT_RETRY_WINDOW = cluster_config.DEFAULT_RETRY_WINDOW  # as `kvsparse launch`


def actor_name(index: int, name_prefix: str = NAME_PREFIX) -> str:
    """The Ray actor name of shard `index`: ``kvsparse-server-{index}``. Thread-safe.

    Example:
        >>> actor_name(1)
        'kvsparse-server-1'
    """
    return f"{name_prefix}-{index}"


def _key(name: str) -> str:
    return f"kvsparse.ray/{name}"


def get_record(name: str, namespace: str) -> Optional[dict]:
    # Ray's GCS key-value store outlives any actor: a restarted shard finds its port there.
    from ray.experimental import internal_kv

    value = internal_kv._internal_kv_get(_key(name), namespace=namespace)
    return None if value is None else json.loads(value)


def put_record(name: str, namespace: str, record: dict) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(_key(name), json.dumps(record), namespace=namespace)


def delete_record(name: str, namespace: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(_key(name), namespace=namespace)


def same_server(pid: int, record: dict) -> bool:
    """True if pid is still the kvsparse server of record (not a recycled pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    if b"kvsparse.server" not in argv:
        return False
    if record.get("port") is None:  # an ipc server: bound to its socket path
        return os.fsencode(record["address"]) in argv
    return any(a.endswith(b":%d" % record["port"]) for a in argv)


def actor_info(actor, deadline: float) -> dict:
    """actor.info(), waiting while Ray restarts the actor (calls then fail at once)."""
    while True:
        try:
            return ray.get(actor.info.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def refuse_running_group(count: int, name_prefix: str, namespace: str) -> None:
    """InvalidArgument if an actor named like one of count new ones already runs."""
    for index in range(count):
        name = actor_name(index, name_prefix)
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            continue
        raise errors.InvalidArgument(
            f"a Ray actor {name!r} already runs in namespace {namespace!r}: shut that group "
            "down first, or use another name_prefix"
        )


def wait_gone(actors: list, timeout: float = 30.0) -> None:
    """Waits (at most timeout seconds in all) until every actor's `info` call fails: gone."""
    deadline = time.monotonic() + timeout
    for actor in actors:
        while time.monotonic() < deadline:
            try:
                ray.get(actor.info.remote(), timeout=1.0)
            except ray.exceptions.RayActorError:
                break
            except ray.exceptions.GetTimeoutError:
                continue
            time.sleep(0.1)
