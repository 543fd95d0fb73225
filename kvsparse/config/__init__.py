"""Configuration: where the servers are, who this worker is, and every setting.

This package is the one reader of environment variables (CONTRIBUTING.md,
"Style"), and the entry points (``kvsparse.create``, ``kvsparse server``, the
CLI) are the only callers of its readers: they resolve a `WorkerSettings` or a
`ServerSettings` once and pass it down. The one other module that touches
``os.environ``, `kvsparse.cluster.process`, copies it into the processes it
starts and reads no setting from it; ``tests/test_layout.py`` checks both rules.

The modules:

- `kvsparse.config.values`: the typed reader (durations, sizes, counts,
  switches), one parser per kind, shared by every setting and flag;
- `kvsparse.config.names`: the variables' names and defaults;
- `kvsparse.config.addresses`: server addresses and bind addresses;
- `kvsparse.config.launchers`: the conventions of kvsparse, TF_CONFIG,
  DMLC_* and torchrun, one function each;
- `kvsparse.config.cluster`: `ClusterConfig`, `from_environment`;
- `kvsparse.config.limits`: `ServerLimits`;
- `kvsparse.config.settings`: `SETTINGS` (every duration and size, declared
  once), `WorkerSettings`, `ServerSettings` and the single-value readers.

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

from kvsparse.config.addresses import (
    format_address,
    ipc_path,
    parse_bind_address,
    parse_server_address,
    peer_bind_address,
    reachable_only_locally,
    split_tcp_address,
)
from kvsparse.config.cluster import (
    ClusterConfig,
    colocated_peers,
    from_environment,
    monitor_config,
    server_bind_address,
)
from kvsparse.config.launchers import (
    NodePlacement,
    first_slurm_host,
    mxnet_role,
    node_placement,
)
from kvsparse.config.limits import ServerLimits, server_limits
from kvsparse.config.names import (
    BIND,
    CHECKPOINT_DIR,
    CHECKPOINT_ROOT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_RENDEZVOUS_WAIT,
    DEFAULT_RETRY_WINDOW,
    FAST_PATH,
    FOREIGN_ROLE_VARIABLES,
    HEARTBEAT_TIMEOUT,
    IPC_PATH_MAX_BYTES,
    IPC_PREFIX,
    KEYS,
    MAX_DIM,
    MAX_REPLY_BYTES,
    MAX_ROWS_PER_REQUEST,
    MAX_TABLES,
    MAX_UNREAD_REPLY_BYTES,
    MEMORY_BUDGET,
    NUM_THREADS,
    NUM_WORKERS,
    PEERS,
    RANK,
    REJOIN_WINDOW,
    RESTARTED,
    RETRY_WINDOW,
    SAVE_EVERY,
    SAVE_KEEP,
    SERVER_ID,
    SERVERS,
    SHARD_FD,
    SPILL_DIR,
    STALENESS,
    TIMEOUT,
)
from kvsparse.config.settings import (
    ServerSettings,
    WorkerSettings,
    checkpoint_dir,
    curve_keys,
    fast_path,
    heartbeat_timeout,
    memory_tier,
    periodic_save,
    rejoin_window,
    restarted,
    retry_window,
    shard_fd,
)
from kvsparse.config.values import (
    SETTINGS,
    Setting,
    parse_bytes,
    parse_count,
    parse_seconds,
    parse_switch,
)

__all__ = [
    "BIND",
    "CHECKPOINT_DIR",
    "CHECKPOINT_ROOT",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_RENDEZVOUS_WAIT",
    "DEFAULT_RETRY_WINDOW",
    "FAST_PATH",
    "FOREIGN_ROLE_VARIABLES",
    "HEARTBEAT_TIMEOUT",
    "IPC_PATH_MAX_BYTES",
    "IPC_PREFIX",
    "KEYS",
    "MAX_DIM",
    "MAX_REPLY_BYTES",
    "MAX_ROWS_PER_REQUEST",
    "MAX_TABLES",
    "MAX_UNREAD_REPLY_BYTES",
    "MEMORY_BUDGET",
    "NUM_THREADS",
    "NUM_WORKERS",
    "PEERS",
    "RANK",
    "REJOIN_WINDOW",
    "RESTARTED",
    "RETRY_WINDOW",
    "SAVE_EVERY",
    "SAVE_KEEP",
    "SERVERS",
    "SERVER_ID",
    "SETTINGS",
    "SHARD_FD",
    "SPILL_DIR",
    "STALENESS",
    "TIMEOUT",
    "ClusterConfig",
    "NodePlacement",
    "ServerLimits",
    "ServerSettings",
    "Setting",
    "WorkerSettings",
    "checkpoint_dir",
    "colocated_peers",
    "curve_keys",
    "fast_path",
    "first_slurm_host",
    "format_address",
    "from_environment",
    "heartbeat_timeout",
    "ipc_path",
    "memory_tier",
    "monitor_config",
    "node_placement",
    "mxnet_role",
    "parse_bind_address",
    "parse_bytes",
    "parse_count",
    "parse_seconds",
    "parse_server_address",
    "parse_switch",
    "peer_bind_address",
    "periodic_save",
    "reachable_only_locally",
    "rejoin_window",
    "restarted",
    "retry_window",
    "server_bind_address",
    "server_limits",
    "shard_fd",
    "split_tcp_address",
]
