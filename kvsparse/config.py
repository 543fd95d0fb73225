"""Cluster configuration: where the servers are, and who this worker is.

This is the one module that reads environment variables (CONVENTIONS habit 6).
Everything else takes a `ClusterConfig` (or plain arguments) explicitly. The
one other module that touches ``os.environ``, `kvsparse.cluster.process`,
copies it into the processes it starts and reads no setting from it;
``tests/test_layout.py`` checks that no other module reads the environment.

`from_environment()` fills a `ClusterConfig` from the conventions users
already have. Each field is taken from the first of these sources that sets
it (precedence, highest first):

1. ``KVSPARSE_*`` (what ``kvsparse launch`` sets):
   ``KVSPARSE_SERVERS`` (comma-separated ``tcp://host:port``; ``host:port`` is
   accepted too, and ``ipc:///absolute/path`` for a server on this host),
   ``KVSPARSE_RANK``, ``KVSPARSE_NUM_WORKERS``,
   ``KVSPARSE_TIMEOUT`` (seconds), ``KVSPARSE_STALENESS`` (steps).
   ``KVSPARSE_PEERS`` (colocated mode, ``kvsparse launch --colocated``): the
   workers' own shard addresses, in rank order; they are the server list
   when ``KVSPARSE_SERVERS`` is unset (see `colocated_peers`).
2. ``TF_CONFIG`` (TensorFlow's JSON): the ``ps`` tasks are the servers, in
   order; the workers are ``chief`` (or the old name ``master``) followed by
   ``worker``: the chief is rank 0 and worker ``i`` is rank ``1 + i`` (rank
   ``i`` when there is no chief, as in TensorFlow where worker 0 is then the
   chief). ``task.type``/``task.index`` give this process's rank.
3. ``DMLC_*`` (MXNet / ps-lite): ``DMLC_NUM_WORKER`` workers, rank from
   ``DMLC_WORKER_ID`` or else ``DMLC_TASK_ID`` (dmlc-tracker numbers the
   workers first). kvsparse has no scheduler, so the ``DMLC_NUM_SERVER``
   servers are derived from the scheduler's address: server ``i`` listens on
   ``tcp://DMLC_PS_ROOT_URI:(DMLC_PS_ROOT_PORT + 1 + i)``, i.e. all servers
   run on the root host, on the ports right after the root port.
4. torchrun's ``RANK`` / ``WORLD_SIZE`` (rank and number of workers only:
   torchrun knows of no parameter servers, so set ``KVSPARSE_SERVERS`` too).

``timeout`` and ``staleness`` come only from ``KVSPARSE_*``. When no source
gives the number of workers (nor a rank), the process is the only worker
(rank 0 of 1). An empty variable counts as unset. A malformed value, or no
server list anywhere, raises `kvsparse.errors.InvalidArgument` naming the
variable.

`server_bind_address()` answers the same question for a server process
(used by ``kvsparse server`` when no ``--bind`` is given).

Example:
    >>> from kvsparse.config import from_environment
    >>> env = {'KVSPARSE_SERVERS': 'tcp://127.0.0.1:7000,127.0.0.1:7001',
    ...        'RANK': '1', 'WORLD_SIZE': '2'}
    >>> config = from_environment(env)
    >>> config.servers, config.rank, config.num_workers
    (['tcp://127.0.0.1:7000', 'tcp://127.0.0.1:7001'], 1, 2)
"""

from __future__ import annotations

import ipaddress
import json
import math
import operator
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Optional

from kvsparse.errors import InvalidArgument

# What `kvsparse launch` sets for its workers; read first.
SERVERS = "KVSPARSE_SERVERS"
RANK = "KVSPARSE_RANK"
NUM_WORKERS = "KVSPARSE_NUM_WORKERS"
TIMEOUT = "KVSPARSE_TIMEOUT"
STALENESS = "KVSPARSE_STALENESS"
# Colocated mode (issue 14, `kvsparse launch --colocated`): every worker's shard address,
# in rank order; worker r binds the r-th and the workers are the servers.
PEERS = "KVSPARSE_PEERS"
# `kvsparse launch --colocated --restart-workers`: how many times this worker process was
# started again after it died (unset or 0: its first start); a restarted worker restores its
# shard from KVSPARSE_CHECKPOINT_DIR and resumes (`kvsparse.store.colocated`).
RESTARTED = "KVSPARSE_RESTARTED"
# Seconds a colocated shard holds the requests that wait for a worker that left, for it
# to come back restarted, before they fail with WorkerLeft (0: fail as soon as it left).
REJOIN_WINDOW = "KVSPARSE_REJOIN_WINDOW"
# `kvsparse launch --colocated` over tcp: the number of an inherited file descriptor, a tcp
# socket the launcher bound and listens on at this worker's shard address, which the
# worker's shard serves (ZMQ_USE_FD) instead of binding the port again: the port is held
# from before the job starts to its end, restarts included, so no other process can take it.
SHARD_FD = "KVSPARSE_SHARD_FD"
# For server processes only.
BIND = "KVSPARSE_BIND"
SERVER_ID = "KVSPARSE_SERVER_ID"
# For workers and servers alike.
KEYS = "KVSPARSE_KEYS"  # CurveZMQ key directory (`kvsparse keys DIR`)
RETRY_WINDOW = "KVSPARSE_RETRY_WINDOW"  # seconds a worker keeps retrying a restarted server
CHECKPOINT_DIR = "KVSPARSE_CHECKPOINT_DIR"
# kvsparse launch --save-every / --keep (issue 13): rank 0 saves into CHECKPOINT_DIR.
SAVE_EVERY = "KVSPARSE_SAVE_EVERY"
SAVE_KEEP = "KVSPARSE_SAVE_KEEP"
NUM_THREADS = "KVSPARSE_NUM_THREADS"  # threads a batch of the C++ core may use
# What one peer may make a server do (`ServerLimits`, `kvsparse server --max-*`).
MAX_REPLY_BYTES = "KVSPARSE_MAX_REPLY_BYTES"
MAX_UNREAD_REPLY_BYTES = "KVSPARSE_MAX_UNREAD_REPLY_BYTES"
MAX_TABLES = "KVSPARSE_MAX_TABLES"
MAX_DIM = "KVSPARSE_MAX_DIM"
MAX_ROWS_PER_REQUEST = "KVSPARSE_MAX_ROWS_PER_REQUEST"
CHECKPOINT_ROOT = "KVSPARSE_CHECKPOINT_ROOT"
# Seconds workers retry a restarted server when `kvsparse launch --restart-servers`
# or `kvsparse.ray` start them and the user gives no --retry-window.
DEFAULT_RETRY_WINDOW = 120.0

# ipc:// addresses: a Unix socket's path fits in sockaddr_un.sun_path with its NUL
# (108 bytes on Linux, 104 on macOS and the BSDs).
IPC_PREFIX = "ipc://"
IPC_PATH_MAX_BYTES = 107 if sys.platform.startswith("linux") else 103

# Variables that make MXNet's ps-lite start (DMLC_ROLE, PORT) or that tell
# TensorFlow to build a cluster (TF_CONFIG): no process that kvsparse starts
# inherits them (kvsparse.cluster.process).
FOREIGN_ROLE_VARIABLES = ("DMLC_ROLE", "PORT", "TF_CONFIG")

_DMLC_VARIABLES = (
    "DMLC_ROLE",
    "DMLC_NUM_SERVER",
    "DMLC_NUM_WORKER",
    "DMLC_PS_ROOT_URI",
    "DMLC_PS_ROOT_PORT",
    "DMLC_WORKER_ID",
    "DMLC_SERVER_ID",
    "DMLC_TASK_ID",
)


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


# -- parsing helpers --------------------------------------------------------------------------


def _check_int(value, what: str) -> int:
    # operator.index takes int and NumPy integers, and refuses floats and strings.
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{what} must be an integer, got {value!r}") from None


def _parse_int(text: str, variable: str, minimum: int = 0) -> int:
    try:
        value = int(text.strip(), 10)
    except ValueError:
        raise InvalidArgument(f"{variable}={text!r} is not an integer") from None
    if value < minimum:
        raise InvalidArgument(f"{variable}={text!r} must be >= {minimum}")
    return value


def _parse_port(text: str, variable: str) -> int:
    port = _parse_int(text, variable, minimum=1)
    if port > 65535:
        raise InvalidArgument(f"{variable}={text!r} is not a TCP port (1..65535)")
    return port


def _split_host_port(text: str, variable: str, shown: str) -> tuple[str, str]:
    """'host:port' or '[v6]:port' -> (host, port text); errors quote `shown`."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1 : end + 2] != ":":
            raise InvalidArgument(f"{variable}: {shown!r} is not 'host:port'")
        return text[1:end], text[end + 2 :]
    host, sep, port = text.rpartition(":")
    if not sep or not host or ":" in host:
        raise InvalidArgument(
            f"{variable}: {shown!r} is not 'host:port' (write IPv6 hosts as '[::1]:port')"
        )
    return host, port


def format_address(host: str, port: int) -> str:
    """``tcp://host:port``, with brackets around an IPv6 host. Thread-safe.

    Example:
        >>> format_address('::1', 7000)
        'tcp://[::1]:7000'
    """
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def parse_server_address(text, variable: str = "server address") -> str:
    """Checks a server address and returns it as ``tcp://host:port`` or ``ipc:///path``.

    Args:
        text: ``tcp://host:port``, ``host:port``, ``tcp://[v6]:port``, or
            ``ipc:///absolute/path`` (a Unix socket: a server on this host).
        variable: what to name in the error (an environment variable, say).

    Raises:
        InvalidArgument: not a str, another scheme, no host or a bad port; for
            ipc, a path that is empty, relative, holds a comma or a NUL, or is
            longer than a Unix socket path may be (`IPC_PATH_MAX_BYTES`).

    Thread-safe.

    Example:
        >>> parse_server_address('localhost:7000')
        'tcp://localhost:7000'
        >>> parse_server_address('ipc:///tmp/kvsparse/server-0')
        'ipc:///tmp/kvsparse/server-0'
    """
    return _parse_address(text, variable, bind=False)


def parse_bind_address(text, variable: str = "bind address") -> str:
    """Checks an address a server may bind and returns it normalized.

    As `parse_server_address`, and also ``tcp://*:port`` (every interface)
    and port 0 (a free port, printed by the server once bound).

    Raises:
        InvalidArgument: as `parse_server_address`.

    Thread-safe.

    Example:
        >>> parse_bind_address('*:0')
        'tcp://*:0'
    """
    return _parse_address(text, variable, bind=True)


def ipc_path(address: str) -> Optional[str]:
    """The socket file of an ``ipc://`` address (as normalized here), None for tcp.

    Thread-safe.

    Example:
        >>> ipc_path('ipc:///tmp/kvsparse/server-0'), ipc_path('tcp://h:1')
        ('/tmp/kvsparse/server-0', None)
    """
    return address[len(IPC_PREFIX) :] if address.startswith(IPC_PREFIX) else None


def reachable_only_locally(address: str) -> bool:
    """True for an ``ipc://`` address or a tcp one bound to a loopback interface. Thread-safe.

    Example:
        >>> reachable_only_locally("tcp://127.0.0.1:7000"), reachable_only_locally("tcp://*:1")
        (True, False)
    """
    if ipc_path(address) is not None:
        return True
    host = address.partition("://")[2].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parse_address(text, variable: str, bind: bool) -> str:
    """A connect address, or with bind=True a bind address (host '*' and port 0 allowed)."""
    if not isinstance(text, str):
        raise InvalidArgument(f"{variable}: a server address must be a str, got {text!r}")
    address = text.strip()
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "tcp", address
    if scheme.lower() == "ipc":
        return IPC_PREFIX + _parse_ipc_path(rest, variable, text)
    if scheme.lower() != "tcp":
        raise InvalidArgument(
            f"{variable}: {text!r} has an unknown scheme {scheme!r}: kvsparse servers speak "
            "tcp://host:port, or ipc:///absolute/path between processes of one host"
        )
    if not rest:
        raise InvalidArgument(f"{variable}: {text!r} has no host:port")
    host, port_text = _split_host_port(rest, variable, text)
    if any(c.isspace() for c in host) or "/" in host or (host == "*" and not bind):
        raise InvalidArgument(f"{variable}: {text!r} has a malformed host {host!r}")
    try:
        port = int(port_text, 10)
    except ValueError:
        port = -1
    if not (0 if bind else 1) <= port <= 65535:
        raise InvalidArgument(f"{variable}: {text!r} has no valid TCP port (1..65535)")
    return f"tcp://*:{port}" if host == "*" else format_address(host, port)


def _parse_ipc_path(path: str, variable: str, shown: str) -> str:
    """The path of an ipc:// address, checked before ZeroMQ sees it; errors quote `shown`."""
    if not path:
        raise InvalidArgument(
            f"{variable}: {shown!r} has no socket path (write ipc:///absolute/path)"
        )
    if not path.startswith("/"):
        # ZeroMQ would take a relative path against each process's working directory,
        # and '@name' (Linux's abstract namespace) or '*' (a random file) would differ
        # between the server and its workers.
        raise InvalidArgument(
            f"{variable}: {shown!r} has a relative socket path {path!r}; write an absolute "
            "one, ipc:///absolute/path (three slashes)"
        )
    if "," in path or "\0" in path:
        raise InvalidArgument(
            f"{variable}: {shown!r}: a socket path may not hold a comma (it separates the "
            f"addresses in {SERVERS}) nor a NUL character"
        )
    size = len(path.encode("utf-8", "surrogateescape"))
    if size > IPC_PATH_MAX_BYTES:
        raise InvalidArgument(
            f"{variable}: {shown!r}: the socket path is {size} bytes, longer than the "
            f"{IPC_PATH_MAX_BYTES} bytes a Unix socket path may have (sun_path); use a "
            "shorter directory, e.g. under /tmp"
        )
    return path


def _get(environ: Mapping, name: str) -> Optional[str]:
    value = environ.get(name)
    if value is None or not value.strip():
        return None
    return value


def _count(environ: Mapping, name: str, what: str) -> Optional[int]:
    """Variable name as an integer >= 0 (None when unset); InvalidArgument naming it else."""
    text = _get(environ, name)
    if text is None:
        return None
    try:
        value = int(text, 10)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidArgument(f"{name} must be {what} >= 0, got {text!r}")
    return value


# -- the sources, in precedence order -----------------------------------------------------
#
# Each source maps a field name to a getter returning (value, origin) or None.
# Getters are only called when no source before them set the field, so a
# malformed lower-precedence variable that is overridden raises nothing.

_Getter = Callable[[], Optional[tuple]]


def _kvsparse_source(environ: Mapping) -> dict[str, _Getter]:
    def servers():
        return _address_list(environ, SERVERS) or _address_list(environ, PEERS)

    def integer(name, minimum):
        def getter():
            text = _get(environ, name)
            return None if text is None else (_parse_int(text, name, minimum), name)

        return getter

    def timeout():
        text = _get(environ, TIMEOUT)
        if text is None:
            return None
        try:
            value = float(text)
        except ValueError:
            raise InvalidArgument(f"{TIMEOUT}={text!r} is not a number of seconds") from None
        if not (math.isfinite(value) and value > 0):
            raise InvalidArgument(f"{TIMEOUT}={text!r} must be a positive number of seconds")
        return value, TIMEOUT

    return {
        "servers": servers,
        "rank": integer(RANK, 0),
        "num_workers": integer(NUM_WORKERS, 1),
        "timeout": timeout,
        "staleness": integer(STALENESS, 0),
    }


def _address_list(environ: Mapping, name: str) -> Optional[tuple]:
    """(addresses, name) from the comma-separated variable name, or None if unset."""
    text = _get(environ, name)
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if any(not p for p in parts):
        raise InvalidArgument(f"{name}={text!r} has an empty entry")
    return [parse_server_address(p, name) for p in parts], name


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


def restarted(environ: Optional[Mapping] = None) -> int:
    """How many times this worker was started again after dying (``KVSPARSE_RESTARTED``).

    0 when unset (a first start). Set by ``kvsparse launch --colocated
    --restart-workers`` for a worker it starts again. Raises InvalidArgument
    for a value that is not an integer >= 0. Thread-safe.

    Example:
        >>> restarted({"KVSPARSE_RESTARTED": "2"})
        2
        >>> restarted({})
        0
    """
    value = _count(os.environ if environ is None else environ, RESTARTED, "an integer")
    return 0 if value is None else value


def shard_fd(environ: Optional[Mapping] = None) -> Optional[int]:
    """The inherited listening socket of this worker's shard (``KVSPARSE_SHARD_FD``), or None.

    Set by ``kvsparse launch --colocated`` over tcp. Raises InvalidArgument
    for a value that is not an integer >= 0. Thread-safe.

    Example:
        >>> shard_fd({"KVSPARSE_SHARD_FD": "5"})
        5
        >>> shard_fd({}) is None
        True
    """
    return _count(os.environ if environ is None else environ, SHARD_FD, "a file descriptor number")


def rejoin_window(environ: Optional[Mapping] = None) -> float:
    """Seconds a colocated shard waits for a worker that left (``KVSPARSE_REJOIN_WINDOW``).

    0 when unset: requests waiting for a worker that left fail at once
    (`kvsparse.server.liveness`). ``kvsparse launch --colocated
    --restart-workers`` sets it to the workers' retry window. Raises
    InvalidArgument for a value that is not a number >= 0. Thread-safe.

    Example:
        >>> rejoin_window({"KVSPARSE_REJOIN_WINDOW": "60"})
        60.0
    """
    environ = os.environ if environ is None else environ
    text = _get(environ, REJOIN_WINDOW)
    if text is None:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise InvalidArgument(f"{REJOIN_WINDOW} must be a number of seconds >= 0, got {text!r}")
    return value


def _load_tf_config(environ: Mapping) -> Optional[dict]:
    text = _get(environ, "TF_CONFIG")
    if text is None:
        return None
    try:
        tf_config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"TF_CONFIG is not valid JSON: {exc}") from None
    if not isinstance(tf_config, dict):
        raise InvalidArgument(f"TF_CONFIG must be a JSON object, got {type(tf_config).__name__}")
    cluster = tf_config.get("cluster", {})
    if not isinstance(cluster, dict):
        raise InvalidArgument("TF_CONFIG: 'cluster' must be an object of task type -> addresses")
    for task_type, addresses in cluster.items():
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            # TF also allows {index: address} dicts for sparse clusters; kvsparse needs all tasks.
            raise InvalidArgument(
                f"TF_CONFIG: cluster[{task_type!r}] must be a list of 'host:port' strings"
            )
    task = tf_config.get("task")
    if task is not None:
        if not isinstance(task, dict):
            raise InvalidArgument("TF_CONFIG: 'task' must be an object with 'type' and 'index'")
        task_type, index = task.get("type"), task.get("index", 0)
        if not isinstance(task_type, str):
            raise InvalidArgument(f"TF_CONFIG: task type must be a str, got {task_type!r}")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise InvalidArgument(f"TF_CONFIG: task index must be an integer >= 0, got {index!r}")
        members = cluster.get(task_type)
        if members is not None and index >= len(members):
            raise InvalidArgument(
                f"TF_CONFIG: task {task_type}:{index} but cluster[{task_type!r}] has "
                f"{len(members)} entries"
            )
    return tf_config


def _tf_workers(cluster: dict) -> list[tuple[str, int]]:
    """(task type, index) of every training worker, in rank order."""
    order = []
    for task_type in ("chief", "master", "worker"):
        order += [(task_type, i) for i in range(len(cluster.get(task_type, [])))]
    return order


def _tf_config_source(environ: Mapping) -> dict[str, _Getter]:
    tf_config = _load_tf_config(environ)
    if tf_config is None:
        return {}
    cluster = tf_config.get("cluster", {})
    task = tf_config.get("task")
    workers = _tf_workers(cluster)
    getters: dict[str, _Getter] = {}
    if cluster.get("ps"):
        getters["servers"] = lambda: (
            [parse_server_address(a, "TF_CONFIG cluster['ps']") for a in cluster["ps"]],
            "TF_CONFIG cluster['ps']",
        )
    if workers:
        getters["num_workers"] = lambda: (len(workers), "TF_CONFIG cluster chief+worker")
    if task is not None:

        def rank():
            me = (task["type"], task.get("index", 0))
            if me not in workers:
                raise InvalidArgument(
                    f"TF_CONFIG: task {me[0]}:{me[1]} is not a training worker (chief, master "
                    "or worker); a 'ps' task runs `kvsparse server`, and another task that "
                    f"uses a store needs {RANK} and {NUM_WORKERS}"
                )
            return workers.index(me), "TF_CONFIG task"

        getters["rank"] = rank
    return getters


def _dmlc_source(environ: Mapping) -> dict[str, _Getter]:
    if not any(_get(environ, name) for name in _DMLC_VARIABLES):
        return {}
    getters: dict[str, _Getter] = {}
    if any(_get(environ, n) for n in ("DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT")):

        def servers():
            return _dmlc_servers(environ), "DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT/DMLC_NUM_SERVER"

        getters["servers"] = servers
    if _get(environ, "DMLC_NUM_WORKER"):
        getters["num_workers"] = lambda: (
            _parse_int(environ["DMLC_NUM_WORKER"], "DMLC_NUM_WORKER", 1),
            "DMLC_NUM_WORKER",
        )
    role = _get(environ, "DMLC_ROLE")
    rank_variable = next((n for n in ("DMLC_WORKER_ID", "DMLC_TASK_ID") if _get(environ, n)), None)
    if role is not None or rank_variable is not None:

        def rank():
            if role is not None and role.strip().lower() != "worker":
                raise InvalidArgument(
                    f"DMLC_ROLE={role!r}: this process is not a worker; a server runs "
                    "`kvsparse server`, and kvsparse needs no scheduler"
                )
            if rank_variable is None:
                return None
            return _parse_int(environ[rank_variable], rank_variable), rank_variable

        getters["rank"] = rank
    return getters


def _dmlc_servers(environ: Mapping) -> list[str]:
    required = ("DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_SERVER")
    missing = [n for n in required if not _get(environ, n)]
    if missing:
        raise InvalidArgument(
            f"DMLC_* configuration is incomplete: {', '.join(missing)} not set (kvsparse derives "
            "server i's address as DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT+1+i)"
        )
    host = environ["DMLC_PS_ROOT_URI"].strip()
    root_port = _parse_port(environ["DMLC_PS_ROOT_PORT"], "DMLC_PS_ROOT_PORT")
    count = _parse_int(environ["DMLC_NUM_SERVER"], "DMLC_NUM_SERVER", 1)
    if root_port + count > 65535:
        raise InvalidArgument(
            f"DMLC_PS_ROOT_PORT={root_port} + DMLC_NUM_SERVER={count} runs past port 65535"
        )
    return [
        parse_server_address(format_address(host, root_port + 1 + i), "DMLC_PS_ROOT_URI")
        for i in range(count)
    ]


def _torchrun_source(environ: Mapping) -> dict[str, _Getter]:
    rank, world = _get(environ, "RANK"), _get(environ, "WORLD_SIZE")
    if rank is None and world is None:
        return {}

    def pair():
        if rank is None or world is None:
            raise InvalidArgument(
                f"torchrun's {'RANK' if rank is None else 'WORLD_SIZE'} is not set but "
                f"{'WORLD_SIZE' if rank is None else 'RANK'} is; set both (or {RANK} and "
                f"{NUM_WORKERS})"
            )
        return _parse_int(rank, "RANK"), _parse_int(world, "WORLD_SIZE", 1)

    return {
        "rank": lambda: (pair()[0], "RANK"),
        "num_workers": lambda: (pair()[1], "WORLD_SIZE"),
    }


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


# -- servers ------------------------------------------------------------------------------


def _bind_host(host: str) -> str:
    """The interface a server binds for an address that workers connect to.

    A loopback or IP literal is bound as is. Any other host name is bound on
    all interfaces, as TensorFlow's gRPC servers and ps-lite do: the name
    workers use (a DNS or Kubernetes service name) need not be an address of
    this machine's interfaces.
    """
    if host == "localhost":
        return "127.0.0.1"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return "*"
    return host


def _bind_address_for(address: str) -> str:
    if ipc_path(address) is not None:
        return address  # a socket file: the server binds the very path its workers use
    rest = address[len("tcp://") :]
    host, port = _split_host_port(rest, "address", address)
    host = _bind_host(host)
    return f"tcp://{host}:{port}" if host == "*" else format_address(host, int(port))


def peer_bind_address(address: str) -> str:
    """The address a colocated worker binds for its shard at address (a peer's address).

    As for a server (`server_bind_address`): a loopback or IP literal as is,
    another host name on all interfaces, an ipc path as is. Thread-safe.

    Example:
        >>> peer_bind_address("tcp://localhost:7001")
        'tcp://127.0.0.1:7001'
    """
    return _bind_address_for(parse_server_address(address, "peer address"))


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


def checkpoint_dir(environ: Optional[Mapping] = None) -> Optional[str]:
    """The checkpoint directory set by ``kvsparse launch --checkpoint-dir`` (or None).

    Read from ``KVSPARSE_CHECKPOINT_DIR``; ``kv.save()`` and ``kv.load()``
    use it when called without a path. Thread-safe.

    Example:
        >>> checkpoint_dir({"KVSPARSE_CHECKPOINT_DIR": "/ckpt"})
        '/ckpt'
    """
    environ = os.environ if environ is None else environ
    return _get(environ, CHECKPOINT_DIR)


def periodic_save(environ: Optional[Mapping] = None) -> Optional[tuple]:
    """(seconds, keep or None) of ``kvsparse launch --save-every S [--keep N]``, or None.

    Read from ``KVSPARSE_SAVE_EVERY`` (seconds, > 0) and ``KVSPARSE_SAVE_KEEP``
    (deltas at most on a full checkpoint, >= 0). Thread-safe.

    Raises:
        InvalidArgument: a value that is not a number in range.

    Example:
        >>> periodic_save({"KVSPARSE_SAVE_EVERY": "5", "KVSPARSE_SAVE_KEEP": "10"})
        (5.0, 10)
    """
    environ = os.environ if environ is None else environ
    text = _get(environ, SAVE_EVERY)
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise InvalidArgument(f"{SAVE_EVERY}={text!r} is not a number of seconds") from None
    if not seconds > 0 or seconds == float("inf"):
        raise InvalidArgument(f"{SAVE_EVERY}={text!r} must be a number of seconds > 0")
    keep = _get(environ, SAVE_KEEP)
    return seconds, None if keep is None else _parse_int(keep, SAVE_KEEP, minimum=0)


# -- server limits ----------------------------------------------------------------------------

_BYTE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_BYTES_PATTERN = re.compile(r"(\d+)\s*([kmgt]?)(?:i?b)?")


def parse_bytes(text: str, what: str = "size") -> int:
    """A byte count written as ``1073741824``, ``512MiB``, ``1G`` or ``64k`` (powers of 1024).

    Raises:
        InvalidArgument: not a whole number of bytes >= 1, naming `what`.

    Thread-safe.

    Example:
        >>> parse_bytes('1GiB'), parse_bytes('64k'), parse_bytes('100')
        (1073741824, 65536, 100)
    """
    if not isinstance(text, str):
        raise InvalidArgument(f"{what} must be a number of bytes, got {text!r}")
    match = _BYTES_PATTERN.fullmatch(text.strip().lower())
    if match is None or int(match.group(1)) < 1:
        raise InvalidArgument(
            f"{what}={text!r} is not a number of bytes >= 1 (e.g. 1073741824, 512MiB, 1GiB)"
        )
    return int(match.group(1)) * _BYTE_UNITS[match.group(2)]


@dataclass(frozen=True)
class ServerLimits:
    """What one peer may make a server do: bounds on memory per request and per connection.

    A server checks each request against them before doing any work, and
    refuses one that exceeds a limit with `kvsparse.errors.LimitExceeded`
    naming the limit and the ``kvsparse server`` flag that raises it; the
    server goes on serving. The defaults fit training jobs (a step's pull is
    far below them) while keeping a careless or hostile peer from making a
    server allocate gigabytes (issue 11, defect 16: two pulls of 200,000 ids
    of a 4096-wide table once grew a server from 44 MiB to 6.3 GiB).

    Attributes:
        max_reply_bytes: the largest reply one request may ask for (a pull of
            n ids of a table of dim d is n * d * 4 bytes; known, and refused,
            before any row is made). Default 1 GiB, the default
            ``--max-message-size``: a bigger reply could not be received anyway.
        max_unread_reply_bytes: replies one connection may leave unread in the
            server (sent but not yet taken by the peer's socket); a pull that
            would go past it is refused until the peer reads. At least
            max_reply_bytes. Default 2 GiB: a worker that reads each reply
            before its next request never comes near it.
        max_tables: sparse tables and dense keys one server holds (each costs
            memory even when empty). Default 1024.
        max_dim: the widest sparse table a peer may create, <= 4096. Default 4096.
        max_rows_per_request: ids in one pull or push, summed over its tables.
            Default 16,777,216.
        checkpoint_root: the directory every CHECKPOINT path (save, load,
            export) must lie in, after following symlinks; a relative path is
            taken inside it. None: no root (see `kvsparse.server.paths`).

    Raises:
        InvalidArgument: a limit that is not an int >= 1, max_dim above 4096,
            max_unread_reply_bytes below max_reply_bytes, or a relative or
            empty checkpoint_root.

    Immutable (frozen): safe to share between threads.

    Example:
        >>> ServerLimits(max_reply_bytes=1 << 20, max_unread_reply_bytes=4 << 20).max_tables
        1024
    """

    max_reply_bytes: int = 1 << 30
    max_unread_reply_bytes: int = 2 << 30
    max_tables: int = 1024
    max_dim: int = 4096  # kvsparse.table.MAX_DIM (tests/test_limits.py checks they agree)
    max_rows_per_request: int = 1 << 24
    checkpoint_root: Optional[str] = None

    def __post_init__(self):
        for name in (
            "max_reply_bytes",
            "max_unread_reply_bytes",
            "max_tables",
            "max_dim",
            "max_rows_per_request",
        ):
            value = _check_int(getattr(self, name), name)
            if value < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {value}")
            object.__setattr__(self, name, value)
        if self.max_dim > 4096:
            raise InvalidArgument(f"max_dim must be <= 4096 (the widest table), got {self.max_dim}")
        if self.max_unread_reply_bytes < self.max_reply_bytes:
            raise InvalidArgument(
                f"max_unread_reply_bytes ({self.max_unread_reply_bytes}) must be >= "
                f"max_reply_bytes ({self.max_reply_bytes}): a reply allowed alone must fit"
            )
        root = self.checkpoint_root
        if root is not None:
            if not isinstance(root, str) or not root.strip() or not os.path.isabs(root):
                raise InvalidArgument(f"checkpoint_root must be an absolute path, got {root!r}")
            object.__setattr__(self, "checkpoint_root", os.path.normpath(root))


def server_limits(environ: Optional[Mapping] = None, **given) -> ServerLimits:
    """A server's `ServerLimits`: each from `given` (the command line), else the environment.

    Variables: ``KVSPARSE_MAX_REPLY_BYTES``, ``KVSPARSE_MAX_UNREAD_REPLY_BYTES``
    (byte counts such as ``512MiB``), ``KVSPARSE_MAX_TABLES``, ``KVSPARSE_MAX_DIM``,
    ``KVSPARSE_MAX_ROWS_PER_REQUEST``, ``KVSPARSE_CHECKPOINT_ROOT``; unset ones
    keep the defaults. A relative root is taken from the current directory.

    Args:
        environ: the variables to read (default: ``os.environ``).
        given: `ServerLimits` fields; None counts as not given.

    Raises:
        InvalidArgument: a malformed value (the message names the variable).

    Thread-safe: it only reads the variables.

    Example:
        >>> server_limits({"KVSPARSE_MAX_REPLY_BYTES": "256MiB"}).max_reply_bytes
        268435456
    """
    env = os.environ if environ is None else environ

    def count(text: str, variable: str) -> int:
        return _parse_int(text, variable, 1)

    values = {}
    for name, variable, parse in (
        ("max_reply_bytes", MAX_REPLY_BYTES, parse_bytes),
        ("max_unread_reply_bytes", MAX_UNREAD_REPLY_BYTES, parse_bytes),
        ("max_tables", MAX_TABLES, count),
        ("max_dim", MAX_DIM, count),
        ("max_rows_per_request", MAX_ROWS_PER_REQUEST, count),
        ("checkpoint_root", CHECKPOINT_ROOT, lambda text, variable: text.strip()),
    ):
        if given.get(name) is not None:
            values[name] = given[name]
        elif _get(env, variable) is not None:
            values[name] = parse(env[variable], variable)
    unknown = set(given) - set(ServerLimits.__dataclass_fields__)
    if unknown:
        raise TypeError(f"server_limits() got unknown fields {sorted(unknown)}")
    if values.get("checkpoint_root") is not None:
        values["checkpoint_root"] = os.path.abspath(values["checkpoint_root"])
    return ServerLimits(**values)


def curve_keys(environ: Optional[Mapping] = None) -> Optional[str]:
    """The CurveZMQ key directory (``KVSPARSE_KEYS``, set by ``kvsparse launch --keys``), or None.

    Thread-safe.

    Example:
        >>> curve_keys({"KVSPARSE_KEYS": "/keys"})
        '/keys'
    """
    environ = os.environ if environ is None else environ
    return _get(environ, KEYS)


def retry_window(environ: Optional[Mapping] = None) -> float:
    """Seconds a worker keeps retrying a restarted or silent server (``KVSPARSE_RETRY_WINDOW``).

    0 (no retry) when unset. Raises InvalidArgument for a value that is not
    a number >= 0. Thread-safe.

    Example:
        >>> retry_window({"KVSPARSE_RETRY_WINDOW": "120"})
        120.0
    """
    environ = os.environ if environ is None else environ
    text = _get(environ, RETRY_WINDOW)
    if text is None:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise InvalidArgument(f"{RETRY_WINDOW} must be a number of seconds, got {text!r}") from None
    if not value >= 0:
        raise InvalidArgument(f"{RETRY_WINDOW} must be >= 0, got {text!r}")
    return value


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


def mxnet_role(environ: Optional[Mapping] = None) -> Optional[str]:
    """``DMLC_ROLE``, which makes ``import mxnet`` start a ps-lite node, or None.

    The MXNet adapter reads it before importing MXNet, to refuse a server or
    scheduler role with a message instead of hanging. Safe from any thread.

    Example:
        >>> mxnet_role({"DMLC_ROLE": "server"})
        'server'
    """
    environ = os.environ if environ is None else environ
    return _get(environ, "DMLC_ROLE")


__all__ = [
    "ClusterConfig",
    "ServerLimits",
    "checkpoint_dir",
    "colocated_peers",
    "curve_keys",
    "monitor_config",
    "mxnet_role",
    "retry_window",
    "DEFAULT_RETRY_WINDOW",
    "FOREIGN_ROLE_VARIABLES",
    "IPC_PATH_MAX_BYTES",
    "IPC_PREFIX",
    "format_address",
    "from_environment",
    "ipc_path",
    "parse_bind_address",
    "parse_bytes",
    "parse_server_address",
    "peer_bind_address",
    "server_bind_address",
    "server_limits",
]


HEARTBEAT_TIMEOUT = "KVSPARSE_HEARTBEAT_TIMEOUT"
# 30 s, not less: a server's heartbeat queued behind a big reply (1 GiB at ~1 Gbit/s is
# ~10 s) is answered only once the reply arrived (any traffic from the peer counts).
DEFAULT_HEARTBEAT_TIMEOUT = 30.0


def heartbeat_timeout(environ: Optional[Mapping] = None) -> float:
    """Seconds a server lets a silent peer live (``KVSPARSE_HEARTBEAT_TIMEOUT``, default 30).

    A server sends ZeroMQ heartbeats to its peers and closes the connection
    of one that answers nothing for this long; a worker whose connections
    all closed has left the job (issue 11, defect 9). 0: no heartbeats (a
    worker then counts as gone only when its connection closes). Raises
    InvalidArgument for a value that is not a number >= 0. Thread-safe.

    Example:
        >>> heartbeat_timeout({"KVSPARSE_HEARTBEAT_TIMEOUT": "5"})
        5.0
    """
    environ = os.environ if environ is None else environ
    text = _get(environ, HEARTBEAT_TIMEOUT)
    if text is None:
        return DEFAULT_HEARTBEAT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        raise InvalidArgument(
            f"{HEARTBEAT_TIMEOUT} must be a number of seconds, got {text!r}"
        ) from None
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgument(f"{HEARTBEAT_TIMEOUT} must be >= 0, got {text!r}")
    return value


__all__ += ["DEFAULT_HEARTBEAT_TIMEOUT", "HEARTBEAT_TIMEOUT", "heartbeat_timeout"]
__all__ += ["REJOIN_WINDOW", "RESTARTED", "rejoin_window", "restarted"]


FAST_PATH = "KVSPARSE_FAST_PATH"


def fast_path(environ: Optional[Mapping] = None) -> bool:
    """Whether servers answer pulls and pushes on their C++ thread (``KVSPARSE_FAST_PATH``).

    On by default (unset, or ``1``); ``0`` serves every request in Python, as
    before the fast path (`kvsparse.server.fastpath`): for benchmarks that compare
    the two, or to fall back. Raises InvalidArgument for any other value. Thread-safe.

    Example:
        >>> fast_path({"KVSPARSE_FAST_PATH": "0"})
        False
    """
    environ = os.environ if environ is None else environ
    text = _get(environ, FAST_PATH)
    if text is None or text.strip() in ("", "1"):
        return True
    if text.strip() == "0":
        return False
    raise InvalidArgument(f"{FAST_PATH} must be 0 or 1, got {text!r}")


__all__ += ["FAST_PATH", "fast_path"]


# -- several hosts (``kvsparse launch --nnodes``) ---------------------------------------------

# Seconds node 0's rendezvous waits for every launcher to join (``--rendezvous-wait``): hosts
# of a batch job start within seconds of each other, but an image pull or a slow NFS mount
# can take minutes; torchrun waits 600 s.
DEFAULT_RENDEZVOUS_WAIT = 300.0
_NODELIST_GROUP = re.compile(r"([^,\[]+)(?:\[([^\]]*)\])?")


def split_tcp_address(address: str, what: str) -> tuple[str, int]:
    """(host, port) of ``tcp://host:port`` (or ``host:port``); errors name `what`. Thread-safe.

    Example:
        >>> split_tcp_address('tcp://[::1]:29400', '--rendezvous')
        ('::1', 29400)
    """
    text = address[len("tcp://") :] if address.startswith("tcp://") else address
    host, port = _split_host_port(text, what, address)
    return host, _parse_port(port, what)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[01-04,07],gpu3`` -> ``node01``. Thread-safe.

    Raises:
        InvalidArgument: an empty or malformed list (names SLURM_JOB_NODELIST).

    Example:
        >>> first_slurm_host('node[01-04,07],gpu3'), first_slurm_host('a1,a2')
        ('node01', 'a1')
    """
    match = _NODELIST_GROUP.match(nodelist.strip())
    if not match:
        raise InvalidArgument(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0].strip()
    if not first.isdigit():
        raise InvalidArgument(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read the range {ranges!r}")
    return prefix + first


@dataclass(frozen=True)
class NodePlacement:
    """Where one launcher stands in a job over several hosts.

    Attributes:
        nnodes: the number of hosts (launchers).
        node_rank: this launcher's, ``0 <= node_rank < nnodes``.
        rendezvous: ``tcp://HOST:PORT`` that node 0's launcher serves.
        origin: where the values came from (for messages).

    Immutable: safe to share between threads.
    """

    nnodes: int
    node_rank: int
    rendezvous: str
    origin: str = "flags"


def node_placement(
    nnodes: Optional[int] = None,
    node_rank: Optional[int] = None,
    rendezvous: Optional[str] = None,
    environ: Optional[Mapping] = None,
) -> Optional[NodePlacement]:
    """The placement of ``kvsparse launch`` on several hosts, or None for one host.

    Each value comes from the flag when given, else from SLURM: ``SLURM_NNODES``,
    ``SLURM_NODEID``, and the first host of ``SLURM_JOB_NODELIST`` as the
    rendezvous host, so that ``srun kvsparse launch --rendezvous :PORT ...``
    needs nothing else. Without a rendezvous flag, ps-lite's scheduler
    address (``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``) is the rendezvous:
    the launchers meet there as ps-lite's servers and workers meet at its
    scheduler, and the servers may then be on every host. ``rendezvous`` may
    be ``tcp://HOST:PORT``, ``HOST:PORT``, ``:PORT`` or ``PORT`` (the host
    then from SLURM's node list, else ``DMLC_PS_ROOT_URI``). No node count
    (or one node and no rendezvous) is a job on one host: None.

    Raises:
        InvalidArgument: a missing or malformed value, naming the flag or variable.

    Thread-safe: it only reads the variables.

    Example:
        >>> env = {'SLURM_NNODES': '2', 'SLURM_NODEID': '1',
        ...        'SLURM_JOB_NODELIST': 'node[07-08]'}
        >>> node_placement(rendezvous=':29400', environ=env).rendezvous
        'tcp://node07:29400'
    """
    env = os.environ if environ is None else environ
    origin = []
    if nnodes is None and _get(env, "SLURM_NNODES") is not None:
        nnodes = _parse_int(env["SLURM_NNODES"], "SLURM_NNODES", 1)
        origin.append("SLURM_NNODES")
    if nnodes is None or (nnodes == 1 and rendezvous is None):
        return None
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise InvalidArgument(f"--nnodes must be an integer >= 1, got {nnodes!r}")
    if node_rank is None:
        if _get(env, "SLURM_NODEID") is not None:
            node_rank = _parse_int(env["SLURM_NODEID"], "SLURM_NODEID")
            origin.append("SLURM_NODEID")
        else:
            raise InvalidArgument(
                f"--nnodes {nnodes} needs --node-rank R (or SLURM_NODEID under srun)"
            )
    if isinstance(node_rank, bool) or not isinstance(node_rank, int):
        raise InvalidArgument(f"--node-rank must be an integer, got {node_rank!r}")
    if not 0 <= node_rank < nnodes:
        raise InvalidArgument(f"node rank {node_rank} is not in [0, {nnodes}) (--nnodes)")
    if rendezvous is None and _get(env, "DMLC_PS_ROOT_URI") and _get(env, "DMLC_PS_ROOT_PORT"):
        rendezvous = f"{env['DMLC_PS_ROOT_URI'].strip()}:{env['DMLC_PS_ROOT_PORT'].strip()}"
        origin.append("DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT")
    if rendezvous is None:
        raise InvalidArgument(
            f"--nnodes {nnodes} needs --rendezvous tcp://HOST:PORT (node 0's host and a free "
            "port; under SLURM --rendezvous :PORT)"
        )
    text = str(rendezvous).strip()
    text = text[len("tcp://") :] if text.startswith("tcp://") else text
    if text.isdigit():
        text = ":" + text
    if text.startswith(":"):
        if _get(env, "SLURM_JOB_NODELIST"):
            host = first_slurm_host(env["SLURM_JOB_NODELIST"])
            origin.append("SLURM_JOB_NODELIST")
        elif _get(env, "DMLC_PS_ROOT_URI"):
            host = env["DMLC_PS_ROOT_URI"].strip()
        else:
            raise InvalidArgument(
                f"--rendezvous {rendezvous!r} has no host, and no SLURM_JOB_NODELIST says "
                "which is node 0's: give tcp://HOST:PORT"
            )
        text = host + text
    host, port = split_tcp_address(text, "--rendezvous")
    return NodePlacement(nnodes, node_rank, format_address(host, port), "+".join(origin) or "flags")
