"""Where the servers are and who this worker is: `ClusterConfig` and `from_environment`."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

from kvsparse.config.addresses import (
    _address_list,
    _bind_address_for,
    parse_bind_address,
    parse_server_address,
)
from kvsparse.config.launchers import (
    _dmlc_servers,
    _dmlc_source,
    _kvsparse_source,
    _load_tf_config,
    _tf_config_source,
    _torchrun_source,
)
from kvsparse.config.names import (
    BIND,
    NUM_WORKERS,
    PEERS,
    RANK,
    SERVER_ID,
    SERVERS,
    STALENESS,
    TIMEOUT,
)
from kvsparse.config.values import _check_int, _get, _parse_int
from kvsparse.errors import InvalidArgument


@dataclass(frozen=True)
class ClusterConfig:
    """What a worker needs to reach the servers: an explicit, validated object.

    Attributes:
        servers: server addresses, ``tcp://host:port`` (or ``ipc:///path``
            for a server on this host), one per shard, in shard order (every
            worker must list them in the same order).
        rank: this worker's rank, ``0 <= rank < num_workers``.
        num_workers: how many workers share the servers.
        timeout: seconds to wait for a server's answer, or None for the
            client's default.
        staleness: bounded staleness in steps (SSP), or None for the store
            kind's default.
        origin: for each field set from the environment, the variable(s) it
            came from (for messages; not compared).

    Raises:
        InvalidArgument: an empty server list, a malformed address, a rank
            out of range, a non-positive timeout or a negative staleness.

    Immutable (frozen): safe to share between threads.

    Example:
        >>> ClusterConfig(servers=['127.0.0.1:7000'], rank=0, num_workers=2).servers
        ['tcp://127.0.0.1:7000']
    """

    servers: list
    rank: int = 0
    num_workers: int = 1
    timeout: Optional[float] = None
    staleness: Optional[int] = None
    origin: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        origin = self.origin
        servers = self.servers
        if isinstance(servers, str) or not isinstance(servers, (list, tuple)):
            raise InvalidArgument(
                "servers must be a list of 'tcp://host:port' (or 'ipc:///path') addresses, "
                f"got {servers!r}"
            )
        what = origin.get("servers", "servers")
        if not servers:
            raise InvalidArgument(f"{what}: the server list is empty")
        normalized = [parse_server_address(a, what) for a in servers]
        if len(set(normalized)) != len(normalized):
            raise InvalidArgument(f"{what}: a server is listed twice in {normalized}")
        object.__setattr__(self, "servers", normalized)
        num_workers = _check_int(self.num_workers, origin.get("num_workers", "num_workers"))
        rank = _check_int(self.rank, origin.get("rank", "rank"))
        if num_workers < 1:
            raise InvalidArgument(
                f"{origin.get('num_workers', 'num_workers')}: the number of workers must be "
                f">= 1, got {num_workers}"
            )
        if not 0 <= rank < num_workers:
            raise InvalidArgument(
                f"rank {rank} (from {origin.get('rank', 'rank')}) must be in "
                f"[0, {num_workers}) for {num_workers} workers "
                f"(from {origin.get('num_workers', 'num_workers')})"
            )
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "num_workers", num_workers)
        if self.timeout is not None:
            what = origin.get("timeout", "timeout")
            if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)):
                raise InvalidArgument(f"{what} must be a number of seconds, got {self.timeout!r}")
            if not (math.isfinite(self.timeout) and self.timeout > 0):
                raise InvalidArgument(
                    f"{what} must be a positive number of seconds, got {self.timeout!r}"
                )
            object.__setattr__(self, "timeout", float(self.timeout))
        if self.staleness is not None:
            what = origin.get("staleness", "staleness")
            staleness = _check_int(self.staleness, what)
            if staleness < 0:
                raise InvalidArgument(f"{what} must be >= 0 steps, got {staleness}")
            object.__setattr__(self, "staleness", staleness)

    @property
    def num_servers(self) -> int:
        """How many servers (shards) there are."""
        return len(self.servers)

    def to_environment(self) -> dict:
        """The ``KVSPARSE_*`` variables that make `from_environment` return this config.

        Example:
            >>> env = ClusterConfig(['127.0.0.1:7000'], rank=1, num_workers=2).to_environment()
            >>> env['KVSPARSE_SERVERS'], env['KVSPARSE_RANK'], env['KVSPARSE_NUM_WORKERS']
            ('tcp://127.0.0.1:7000', '1', '2')
        """
        env = {
            SERVERS: ",".join(self.servers),
            RANK: str(self.rank),
            NUM_WORKERS: str(self.num_workers),
        }
        if self.timeout is not None:
            env[TIMEOUT] = repr(self.timeout)
        if self.staleness is not None:
            env[STALENESS] = str(self.staleness)
        return env


def from_environment(environ: Optional[Mapping] = None) -> ClusterConfig:
    """Reads the cluster configuration from environment variables.

    See the module docstring for the variables and their precedence
    (``KVSPARSE_*``, then ``TF_CONFIG``, then ``DMLC_*``, then torchrun's).

    Args:
        environ: the variables to read (default: ``os.environ``).

    Returns:
        A validated `ClusterConfig`.

    Raises:
        InvalidArgument: no server list in any convention, or a malformed
            value (the message names the variable).

    Thread-safe: it only reads the variables.

    Example:
        >>> from_environment({'KVSPARSE_SERVERS': 'tcp://127.0.0.1:7000'}).num_workers
        1
    """
    env = os.environ if environ is None else environ
    sources = [
        _kvsparse_source(env),
        _tf_config_source(env),
        _dmlc_source(env),
        _torchrun_source(env),
    ]
    values: dict = {}
    origin: dict = {}
    for name in ("servers", "rank", "num_workers", "timeout", "staleness"):
        for source in sources:
            getter = source.get(name)
            found = getter() if getter is not None else None
            if found is not None:
                values[name], origin[name] = found
                break
    if "servers" not in values:
        raise InvalidArgument(
            "no kvsparse servers configured: set KVSPARSE_SERVERS=tcp://host:port,... (or "
            "TF_CONFIG with 'ps' tasks, or DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT/DMLC_NUM_SERVER), "
            "pass servers=[...], or start the job with `kvsparse launch`"
        )
    if "num_workers" not in values:
        if values.get("rank", 0) != 0:
            raise InvalidArgument(
                f"rank {values['rank']} (from {origin['rank']}) is set but not the number of "
                f"workers: set {NUM_WORKERS}"
            )
        values["num_workers"], origin["num_workers"] = 1, "default (one worker)"
    if "rank" not in values:
        if values["num_workers"] != 1:
            raise InvalidArgument(
                f"{values['num_workers']} workers (from {origin['num_workers']}) but no rank "
                f"for this one: set {RANK}"
            )
        values["rank"], origin["rank"] = 0, "default (one worker)"
    return ClusterConfig(origin=origin, **values)


def monitor_config(environ: Optional[Mapping] = None) -> ClusterConfig:
    """The servers a monitor (``kvsparse stats``) talks to, from the same sources as a worker.

    A monitor is no worker: it may run in a server's pod, or anywhere the
    rank is unset, so only the variables that name the servers are read
    (``KVSPARSE_SERVERS``, TF_CONFIG's ``ps`` tasks, ``DMLC_PS_ROOT_*`` and
    ``DMLC_NUM_SERVER``); the rank and worker count are those of a lone worker.

    Raises InvalidArgument for no server list or a malformed one.

    Example:
        >>> monitor_config({"KVSPARSE_SERVERS": "tcp://127.0.0.1:7000", "RANK": "3"}).servers
        ['tcp://127.0.0.1:7000']
    """
    environ = os.environ if environ is None else environ
    keep = (SERVERS, PEERS, "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_SERVER")
    env = {name: environ[name] for name in keep if name in environ}
    if environ.get("TF_CONFIG"):
        try:
            cluster = json.loads(environ["TF_CONFIG"]).get("cluster", {})
            env["TF_CONFIG"] = json.dumps({"cluster": {"ps": cluster.get("ps", [])}})
        except (ValueError, AttributeError):
            env["TF_CONFIG"] = environ["TF_CONFIG"]  # malformed: from_environment says why
    return from_environment(env)


def server_bind_address(environ: Optional[Mapping] = None) -> Optional[str]:
    """The address a server process should bind, from the environment.

    Sources, highest precedence first:

    1. ``KVSPARSE_BIND``: used as given (``tcp://host:port``, port 0 picks a
       free one; or ``ipc:///absolute/path``).
    2. ``KVSPARSE_SERVER_ID`` = i with ``KVSPARSE_SERVERS``: entry i.
    3. ``TF_CONFIG`` with task type ``ps``: ``cluster['ps'][index]``.
    4. ``DMLC_ROLE=server``: server ``DMLC_SERVER_ID`` (or ``DMLC_TASK_ID -
       DMLC_NUM_WORKER`` when the task id counts workers first, as
       dmlc-tracker does; 0 if there is only one server) at port
       ``DMLC_PS_ROOT_PORT + 1 + id`` (see `from_environment`).

    A host name that is neither ``localhost`` nor an IP literal is bound on
    all interfaces (``tcp://*:port``); an ``ipc://`` entry is bound as is.

    Args:
        environ: the variables to read (default: ``os.environ``).

    Returns:
        The ``tcp://`` (or ``ipc://``) bind address, or None if nothing says
        this process is a server.

    Raises:
        InvalidArgument: a malformed or inconsistent value (named).

    Thread-safe: it only reads the variables.

    Example:
        >>> server_bind_address({'DMLC_ROLE': 'server', 'DMLC_SERVER_ID': '1',
        ...                      'DMLC_NUM_SERVER': '2', 'DMLC_PS_ROOT_URI': '127.0.0.1',
        ...                      'DMLC_PS_ROOT_PORT': '9000'})
        'tcp://127.0.0.1:9002'
    """
    env = os.environ if environ is None else environ
    bind = _get(env, BIND)
    if bind is not None:
        return parse_bind_address(bind, BIND)
    server_id = _get(env, SERVER_ID)
    if server_id is not None:
        index = _parse_int(server_id, SERVER_ID)
        servers = _kvsparse_source(env)["servers"]()
        if servers is None:
            raise InvalidArgument(f"{SERVER_ID} is set but {SERVERS} is not")
        if index >= len(servers[0]):
            raise InvalidArgument(
                f"{SERVER_ID}={index} but {SERVERS} lists {len(servers[0])} servers"
            )
        return _bind_address_for(servers[0][index])
    tf_config = _load_tf_config(env)
    task = tf_config.get("task") if tf_config else None
    if task is not None and task.get("type") == "ps":
        ps = tf_config.get("cluster", {}).get("ps", [])
        index = task.get("index", 0)
        if index >= len(ps):
            raise InvalidArgument(
                f"TF_CONFIG: task ps:{index} but cluster['ps'] has {len(ps)} entries"
            )
        return _bind_address_for(parse_server_address(ps[index], "TF_CONFIG cluster['ps']"))
    role = _get(env, "DMLC_ROLE")
    if role is not None and role.strip().lower() == "server":
        servers = _dmlc_servers(env)
        if _get(env, "DMLC_SERVER_ID") is not None:
            index, variable = _parse_int(env["DMLC_SERVER_ID"], "DMLC_SERVER_ID"), "DMLC_SERVER_ID"
        elif _get(env, "DMLC_TASK_ID") is not None and _get(env, "DMLC_NUM_WORKER") is not None:
            task_id = _parse_int(env["DMLC_TASK_ID"], "DMLC_TASK_ID")
            index = task_id - _parse_int(env["DMLC_NUM_WORKER"], "DMLC_NUM_WORKER", 1)
            variable = "DMLC_TASK_ID - DMLC_NUM_WORKER"
        elif len(servers) == 1:
            index, variable = 0, "DMLC_NUM_SERVER=1"
        else:
            raise InvalidArgument(
                "DMLC_ROLE=server with several servers needs DMLC_SERVER_ID to know which one "
                "this is"
            )
        if not 0 <= index < len(servers):
            raise InvalidArgument(
                f"server id {index} (from {variable}) must be in [0, {len(servers)}) "
                f"for DMLC_NUM_SERVER={len(servers)}"
            )
        return _bind_address_for(servers[index])
    return None


def colocated_peers(environ: Optional[Mapping] = None) -> Optional[list]:
    """The colocated workers' shard addresses (``KVSPARSE_PEERS``), or None when unset.

    Set by ``kvsparse launch --colocated``: then ``kvsparse.create('dist_sparse')``
    (and the other dist kinds) give a colocated store (`kvsparse.store.colocated`).

    Raises InvalidArgument for a malformed list. Thread-safe.

    Example:
        >>> colocated_peers({"KVSPARSE_PEERS": "127.0.0.1:7000,127.0.0.1:7001"})
        ['tcp://127.0.0.1:7000', 'tcp://127.0.0.1:7001']
    """
    environ = os.environ if environ is None else environ
    found = _address_list(environ, PEERS)
    return None if found is None else found[0]
