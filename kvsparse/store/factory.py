"""Which store `kvsparse.create(name)` builds: a backend behind the KVStore API.

``'local'`` is one shard in this process (`kvsparse.store.local`); the dist
kinds talk to `kvsparse server` processes through `kvsparse.client`;
``'colocated'`` hosts one shard in each worker (`kvsparse.store.colocated`),
and so do the dist kinds when ``kvsparse launch --colocated`` set
``KVSPARSE_PEERS`` (training code does not change). The environment is read
here, through `kvsparse.config`, never below.

Safe to call from several threads (each call builds a new store).

Example:
    >>> import kvsparse
    >>> kvsparse.create("local").type
    'local'
"""

from __future__ import annotations

from kvsparse import config as cluster_config
from kvsparse import errors
from kvsparse.store.kvstore import KVStore
from kvsparse.table import check_wire_dtype

LOCAL_KINDS = ("local", "device", "local_update_cpu", "local_allreduce_cpu")
# A dist kind and the consistency mode its servers run.
_KIND_MODES = {
    "dist_sparse": "bsp",
    "dist_sync": "bsp",
    "dist": "bsp",
    "dist_async": "asp",
    "dist_sparse_async": "asp",
}


def create(name: str = "local", **kwargs) -> KVStore:
    """Creates a KVStore.

    Args:
        name: 'local' (one in-process shard), or 'dist_sparse' / 'dist_sync'
            (BSP), 'dist_async' (ASP) for the ZeroMQ servers; ``staleness=k``
            gives SSP. 'colocated': a shard in every worker
            (`create_colocated_store`); the dist kinds give it too when
            ``KVSPARSE_PEERS`` is set and no servers are given.
        **kwargs: for dist kinds: servers=[addresses], rank=, num_workers=,
            timeout=, staleness=, retry_window=, keys=, shared_memory=
            (default: what the launcher or the environment set; see
            `create_remote_store`).
            For 'local': memory_budget= (bytes, or a size such as '512MiB';
            0: none) and spill_dir= (the disk tier's directory; needs a
            budget) bound the store's memory as ``kvsparse server
            --memory-budget/--spill-dir`` bound a server's (default:
            ``KVSPARSE_MEMORY_BUDGET`` / ``KVSPARSE_SPILL_DIR``).
            For every kind: wire_dtype= 'float32' (default), 'float16' or
            'bfloat16': how sparse tables' pulled rows and pushed gradients
            travel, unless a table sets its own (`SparseTable.wire_dtype`).
            'local' rounds them the same way, so it gives the numbers
            'dist_sparse' gives with the same setting.
            settings: a `kvsparse.config.WorkerSettings` to use instead of
            the environment's (which is read here, once, and nowhere below).

    Raises:
        InvalidArgument (a ValueError): an unknown kind, a bad wire_dtype, a
            spill_dir without memory_budget, or options other than wire_dtype,
            memory_budget and spill_dir for 'local'.

    Example:
        >>> kv = kvsparse.create('local', memory_budget='64MiB')   # doctest: +SKIP
    """
    if not isinstance(name, str):
        raise errors.InvalidArgument(f"store kind must be a str, got {name!r}")
    kind = name.lower()
    settings = kwargs.pop("settings", None)
    if kind not in LOCAL_KINDS and kind != "colocated" and kind not in _KIND_MODES:
        raise errors.InvalidArgument(
            f"unknown store kind {name!r}; use 'local', 'dist_sparse', 'dist_sync', "
            "'dist_async' or 'colocated'"
        )
    if settings is None:
        settings = cluster_config.WorkerSettings.from_environment()
    if kind in LOCAL_KINDS:
        wire_dtype = kwargs.pop("wire_dtype", "float32")
        memory_budget = kwargs.pop("memory_budget", None)
        spill_dir = kwargs.pop("spill_dir", None)
        if kwargs:
            raise errors.InvalidArgument(
                "the local store takes no options but wire_dtype, memory_budget and "
                f"spill_dir, got {sorted(kwargs)}"
            )
        from kvsparse.store.local import LocalBackend

        check_wire_dtype(wire_dtype, "kvsparse.create wire_dtype")
        # Given ones win; what is not given comes from the settings (the environment's).
        budget, spill_dir = cluster_config.memory_tier(
            {},
            settings.server.memory_budget if memory_budget is None else memory_budget,
            settings.server.spill_dir if spill_dir is None else spill_dir,
        )
        backend = LocalBackend(budget, spill_dir)
        return KVStore(backend, "local", wire_dtype, settings.checkpoint_dir)
    if kind == "colocated" or (kwargs.get("servers") is None and settings.peers is not None):
        # Under `kvsparse launch --colocated` the dist kinds give the colocated store too:
        # the same training code.
        return create_colocated_store(kind, settings=settings, **kwargs)
    return create_remote_store(kind, settings=settings, **kwargs)


def _launched_store(store: KVStore, settings, rank: int) -> KVStore:
    """What every launched store gets alike, whichever backend it has.

    ``kvsparse launch --save-every S [--keep N]``: rank 0 saves into the
    checkpoint directory on that interval.
    """
    if settings.periodic_save is not None and rank == 0:
        store.save_every(*settings.periodic_save)
    return store


def create_colocated_store(
    kind: str = "colocated",
    peers=None,
    rank=None,
    num_workers=None,
    timeout=None,
    staleness=None,
    retry_window=None,
    keys=None,
    wire_dtype="float32",
    startup_timeout=None,
    servers=None,
    settings=None,
) -> KVStore:
    """A KVStore whose worker r hosts shard r of every table (colocated mode).

    Args:
        kind: 'colocated' (BSP, as 'dist_sparse'), or a dist kind whose
            consistency mode it takes ('dist_async': ASP); ``staleness=k``: SSP.
        peers: every worker's shard address (``tcp://host:port`` or
            ``ipc:///path``), in rank order; this worker binds peers[rank].
            None: ``KVSPARSE_PEERS`` (set by ``kvsparse launch --colocated``),
            and the other None arguments from the environment too. Given
            explicitly, rank defaults to 0 and num_workers to len(peers).
        rank, num_workers, timeout, staleness, retry_window, keys, wire_dtype:
            as for `create_remote_store`; num_workers must be len(peers).
        startup_timeout: seconds to wait for the other workers' shards
            (default 60).
        servers: not taken (the peers are the servers); given, InvalidArgument.
        settings: a `kvsparse.config.WorkerSettings`; None: the environment's.

    Raises:
        InvalidArgument: a bad configuration, servers given, or no peers.
        ServerUnavailable: this worker's shard cannot be bound, or another
            worker's did not answer in time.

    Example:
        >>> kv = create_colocated_store(peers=['tcp://127.0.0.1:7001'])  # doctest: +SKIP
    """
    from kvsparse.store.colocated import DEFAULT_STARTUP_TIMEOUT, create_colocated_backend

    kind = kind.lower()
    check_wire_dtype(wire_dtype, "kvsparse.create wire_dtype")
    if kind != "colocated" and kind not in _KIND_MODES:
        raise errors.InvalidArgument(f"unknown store kind {kind!r} for colocated mode")
    if servers is not None:
        raise errors.InvalidArgument(
            "a colocated store has no separate servers: give peers=[...] (every worker's "
            "shard address), not servers"
        )
    if settings is None:
        settings = cluster_config.WorkerSettings.from_environment()
    if peers is None:
        peers = settings.peers
        if peers is None:
            raise errors.InvalidArgument(
                f"no colocated peers configured: set {cluster_config.PEERS}=addr,... (one per "
                "worker), pass peers=[...], or start the job with `kvsparse launch --colocated`"
            )
        found = settings.cluster
        if found is None:
            found = cluster_config.WorkerSettings.from_environment(cluster=True).cluster
        rank = found.rank if rank is None else rank
        num_workers = found.num_workers if num_workers is None else num_workers
        timeout = found.timeout if timeout is None else timeout
        staleness = found.staleness if staleness is None else staleness
    else:
        if isinstance(peers, str) or not isinstance(peers, (list, tuple)):
            raise errors.InvalidArgument(f"peers must be a list of addresses, got {peers!r}")
        peers = list(peers)
        rank = 0 if rank is None else rank
        num_workers = len(peers) if num_workers is None else num_workers
    mode = "ssp" if staleness is not None else _KIND_MODES.get(kind, "bsp")
    backend = create_colocated_backend(
        peers,
        rank,
        num_workers,
        mode=mode,
        staleness=staleness,
        timeout=timeout,
        retry_window=settings.retry_window if retry_window is None else retry_window,
        keys=keys,
        startup_timeout=DEFAULT_STARTUP_TIMEOUT if startup_timeout is None else startup_timeout,
        # `kvsparse launch --colocated --restart-workers` (kvsparse.store.colocated).
        restarted=settings.restarted > 0,
        checkpoint_dir=settings.checkpoint_dir,
        rejoin_window=settings.rejoin_window,
        listener_fd=settings.shard_fd,
        server=settings.server,
    )
    store = KVStore(backend, kind, wire_dtype, settings.checkpoint_dir)
    return _launched_store(store, settings, backend.rank)


def create_remote_store(
    kind: str = "dist_sparse",
    servers=None,
    rank=None,
    num_workers=None,
    timeout=None,
    staleness=None,
    retry_window=None,
    keys=None,
    wire_dtype="float32",
    shared_memory=None,
    settings=None,
) -> KVStore:
    """A KVStore whose tables live on `kvsparse server` processes.

    Args:
        kind: 'dist_sparse', 'dist_sync' or 'dist' (BSP), 'dist_async' or
            'dist_sparse_async' (ASP).
        servers: server addresses; None reads the configuration
            (`kvsparse.config.from_environment`: KVSPARSE_*, TF_CONFIG,
            DMLC_*, torchrun), and the other None arguments come from it too.
            Given explicitly, rank defaults to 0 and num_workers to 1.
        rank: this worker's rank.
        num_workers: how many workers share the store.
        timeout: seconds without an answer from a server before
            ServerUnavailable (default 60).
        staleness: k for SSP (a worker runs at most k pushes ahead); None
            keeps the kind's mode.
        retry_window: seconds to keep trying a restarted or silent server
            before ServerUnavailable (see `RemoteBackend`); None:
            ``KVSPARSE_RETRY_WINDOW`` or 0 (no retry).
        keys: CurveZMQ key directory; None: ``KVSPARSE_KEYS`` or none.
        wire_dtype: 'float32', 'float16' or 'bfloat16': how sparse tables'
            rows travel unless a table sets its own (see `create`).
        shared_memory: whether float32 rows to and from servers on this host go
            through a shared-memory segment instead of the socket: None (default)
            for servers on ``ipc://`` addresses, True for any server that can map
            it, False never; an int: True with a segment of that many bytes
            (`kvsparse.client.remote.RemoteBackend`), with or without a retry
            window.
        settings: a `kvsparse.config.WorkerSettings`; None: the environment's.

    Raises:
        InvalidArgument: an unknown kind or a bad configuration.
        ServerUnavailable: a server did not answer.

    Example:
        >>> kv = create_remote_store('dist_sync', servers=['tcp://127.0.0.1:5701'],
        ...                        rank=0, num_workers=1)      # doctest: +SKIP
    """
    kind = kind.lower()
    check_wire_dtype(wire_dtype, "kvsparse.create wire_dtype")
    if kind not in _KIND_MODES:
        raise errors.InvalidArgument(
            f"unknown dist store kind {kind!r}; use one of {sorted(_KIND_MODES)}"
        )
    if settings is None:
        settings = cluster_config.WorkerSettings.from_environment(cluster=servers is None)
    if servers is None:
        found = settings.cluster
        if found is None:
            found = cluster_config.WorkerSettings.from_environment(cluster=True).cluster
        given = {
            "servers": found.servers,
            "rank": found.rank if rank is None else rank,
            "num_workers": found.num_workers if num_workers is None else num_workers,
            "timeout": found.timeout if timeout is None else timeout,
            "staleness": found.staleness if staleness is None else staleness,
        }
    else:
        given = {
            "servers": list(servers) if isinstance(servers, (list, tuple)) else servers,
            "rank": 0 if rank is None else rank,
            "num_workers": 1 if num_workers is None else num_workers,
            "timeout": timeout,
            "staleness": staleness,
        }
    config = cluster_config.ClusterConfig(**given)
    mode = "ssp" if config.staleness is not None else _KIND_MODES[kind]
    from kvsparse.client.remote import RemoteBackend

    backend = RemoteBackend(
        config.servers,
        config.rank,
        config.num_workers,
        mode=mode,
        staleness=config.staleness,
        timeout=config.timeout,
        retry_window=settings.retry_window if retry_window is None else retry_window,
        keys=settings.keys if keys is None else keys,
        shared_memory=shared_memory,
    )
    store = KVStore(backend, kind, wire_dtype, settings.checkpoint_dir)
    return _launched_store(store, settings, config.rank)


__all__ = ["LOCAL_KINDS", "create", "create_colocated_store", "create_remote_store"]
