"""Server actors: `start_servers`, `find_servers`, `ServerGroup` (see `kvsparse.ray`)."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import ray  # the Ray package (imports are absolute)
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvsparse import config as cluster_config
from kvsparse import errors
from kvsparse.cluster import process as server_process
from kvsparse.ray import registry
from kvsparse.ray.registry import (
    DEFAULT_RETRY_WINDOW,
    NAME_PREFIX,
    NAMESPACE,
    START_TIMEOUT,
    actor_name,
)

# A port just given up by a killed server may still be held for a moment; retry the bind.
_BIND_RETRY_SECONDS = 10.0


def _ipc_bind(record: Optional[dict], index: int) -> str:
    """The socket path of shard index: its last server's if that one's directory is here."""
    if record is not None:
        path = cluster_config.ipc_path(record["address"])
        if path is not None and os.path.isdir(os.path.dirname(path)):
            return record["address"]
    # Not removed with this actor's process: the actor restarted after it dies takes it over.
    directory = server_process.socket_directory(removed_with_maker=False)
    return server_process.ipc_bind_address(directory, f"server-{index}")


class ServerShard:
    """A Ray actor (see `start_servers`) that runs one ``kvsparse server`` child process.

    Args:
        index: the shard's index.
        num_shards: how many shards the group has (for ``--restore``).
        name: the actor's name (the key of its registry record).
        namespace: the Ray namespace of the group.
        host: interface to bind and to advertise; None: this node's IP.
        port: port to bind; None: the port of this shard's last server, if
            any, else a free one.
        transport: 'tcp' (host and port) or 'ipc': a Unix socket in a
            private directory of this node (the last server's path, if any).
        checkpoint_dir: a restarted server restores the latest complete
            checkpoint there (``--restore``), if there is one.
        server_args: more command-line arguments for the server.

    Thread safety: a Ray actor runs one method call at a time.
    """

    def __init__(
        self,
        index: int,
        num_shards: int,
        name: str,
        namespace: str,
        host: Optional[str] = None,
        port: Optional[int] = None,
        checkpoint_dir: Optional[str] = None,
        server_args: tuple = (),
        transport: str = "tcp",
    ):
        self.index = index
        self.name = name
        self.namespace = namespace
        self.host = host or ray.util.get_node_ip_address()
        record = registry.get_record(name, namespace)
        self.restarts = 0 if record is None else record["restarts"] + 1
        if record is not None:
            # A server left over from a dead actor (no PDEATHSIG on this OS) holds the port.
            pid = record["pid"]
            if server_process.pid_alive(pid) and registry.same_server(pid, record):
                os.kill(pid, signal.SIGKILL)
        self.socket_directory: Optional[str] = None
        if transport == "ipc":
            bind = _ipc_bind(record, index)
            self.socket_directory = os.path.dirname(cluster_config.ipc_path(bind))
            port = None
        else:
            if port is None:
                port = 0 if record is None or record.get("port") is None else record["port"]
            bind = f"tcp://{self.host}:{port}"
        restore = []
        if record is not None:
            restore = server_process.restore_arguments(checkpoint_dir, index, num_shards)
        self.restored = bool(restore)
        # A restarted shard replaces a server that died (its BSP rounds recover as under
        # kvsparse launch --restart-servers).
        command = server_process.server_command(
            bind, restarted=record is not None, extra_args=[*restore, *server_args]
        )
        self.stopping = False
        self._server = self._start(command, bind, retry=port != 0)
        self.process = self._server.process
        self.address = self._server.address
        registry.put_record(
            name,
            namespace,
            {
                "index": index,
                "port": None if port is None else int(self.address.rsplit(":", 1)[1]),
                "pid": self.process.pid,
                "address": self.address,
                "restarts": self.restarts,
            },
        )
        threading.Thread(target=self._watch, name="kvsparse-server-watch", daemon=True).start()

    def _start(self, command: list, bind: str, retry: bool) -> server_process.ServerProcess:
        # The server's output goes on to the actor's (Ray's log of the actor, shown by the
        # driver). It stays in the driver's session (tests look for what a job leaves there).
        output = server_process.LineWriter(sys.stderr)
        prefix = f"[{self.name}] "

        def start() -> server_process.ServerProcess:
            return server_process.ServerProcess(
                command,
                server_process.server_environment(),
                label=self.name,
                on_stdout=functools.partial(output.line, prefix),
                on_stderr=functools.partial(output.line, prefix),
                new_session=False,
                preexec_fn=server_process.die_with_parent(signal.SIGKILL),
            )

        # Port 0 picks a free port: a bind failure there is no lingering port, no retry.
        retry_until = time.monotonic() + (_BIND_RETRY_SECONDS if retry else 0.0)
        server = server_process.start_server(
            start, listen_timeout=START_TIMEOUT, retry_until=retry_until
        )
        if server.address is None:
            raise errors.ServerUnavailable(
                f"kvsparse server {self.name} did not start ({' '.join(command)}): "
                f"{server.recent_text() or 'no output'}",
                address=bind,
            )
        return server

    def _watch(self) -> None:
        self.process.wait()
        if not self.stopping:
            # The server died under a live actor: end the actor so that Ray restarts the shard.
            os._exit(1)

    def info(self) -> dict:
        """{'index', 'address', 'pid' (server), 'actor_pid', 'node_id', 'restarts', 'restored'}.

        'restored': this server was started from a checkpoint.
        """
        return {
            "index": self.index,
            "address": self.address,
            "pid": self.process.pid,
            "actor_pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "restarts": self.restarts,
            "restored": self.restored,
        }

    def stop(self, grace_period: float = 5.0) -> Optional[int]:
        """Stops the server (SIGTERM, then SIGKILL after grace_period); its exit status.

        An ipc server's socket directory goes with it.
        """
        self.stopping = True
        code = self._server.stop(grace_period)
        if self.socket_directory is not None:
            shutil.rmtree(self.socket_directory, ignore_errors=True)
        return code


@dataclass
class _Shard:
    actor: object
    address: str
    options: dict
    arguments: dict


class ServerGroup:
    """The server actors started by `start_servers`; use `shutdown` (or ``with``) to stop them.

    Attributes:
        addresses: ``tcp://host:port`` (or ``ipc:///path``) of each shard, in
            shard order.
        namespace: the Ray namespace of the actors.
        name_prefix: actor i is named ``{name_prefix}-{i}``.
        placement_group: the Ray placement group (one bundle per shard).
        retry_window: seconds the workers keep trying to reach a restarted
            shard.
        checkpoint_dir: where checkpoints go, or None.

    Thread safety: `addresses`, `config`, `store_arguments` and `environment`
    may be called from several threads at once; `restart_dead` and
    `shutdown` from one thread at a time.
    """

    def __init__(
        self, shards, namespace, name_prefix, group, timeout, retry_window, checkpoint_dir
    ):
        self._shards = shards
        self.retry_window = retry_window
        self.checkpoint_dir = checkpoint_dir
        self.namespace = namespace
        self.name_prefix = name_prefix
        self.placement_group = group
        self.timeout = timeout
        self._closed = False

    @property
    def addresses(self) -> list:
        """The servers' addresses, in shard order."""
        return [s.address for s in self._shards]

    @property
    def num_servers(self) -> int:
        """How many shards."""
        return len(self._shards)

    @property
    def actors(self) -> list:
        """The Ray actor handles, in shard order."""
        return [s.actor for s in self._shards]

    def config(
        self, rank: int = 0, num_workers: int = 1, timeout=None, staleness=None
    ) -> cluster_config.ClusterConfig:
        """The configuration of worker `rank` of `num_workers`.

        Pass it to ``kvsparse.create('dist_sparse', servers=config.servers,
        rank=config.rank, num_workers=config.num_workers)``, or its
        `environment` to a process that calls ``kvsparse.create('dist_sparse')``.

        Raises:
            InvalidArgument: rank out of range, bad timeout or staleness.

        Example:
            >>> group.config(1, 2).rank  # doctest: +SKIP
            1
        """
        return cluster_config.ClusterConfig(
            servers=self.addresses,
            rank=rank,
            num_workers=num_workers,
            timeout=timeout,
            staleness=staleness,
        )

    def store_arguments(self, rank: int = 0, num_workers: int = 1, **kwargs) -> dict:
        """Keyword arguments of ``kvsparse.create('dist_sparse', **arguments)`` for worker `rank`.

        They include ``retry_window``, so that the worker's store says HELLO
        again to a restarted shard and resends what was in flight. Other
        keyword arguments (timeout, staleness) are passed on.

        Example:
            >>> kv = kvsparse.create('dist_sparse', **group.store_arguments(0, 2))  # doctest: +SKIP
        """
        config = self.config(rank, num_workers, **kwargs)
        return {
            "servers": config.servers,
            "rank": config.rank,
            "num_workers": config.num_workers,
            "timeout": config.timeout,
            "staleness": config.staleness,
            "retry_window": self.retry_window,
        }

    def environment(self, rank: int = 0, num_workers: int = 1, **kwargs) -> dict:
        """The ``KVSPARSE_*`` variables of worker `rank` (see `config`).

        Besides `config`'s, ``KVSPARSE_RETRY_WINDOW`` (see `store_arguments`)
        and, with a checkpoint_dir, ``KVSPARSE_CHECKPOINT_DIR``, as
        ``kvsparse launch`` sets them.

        Example:
            >>> group.environment(0, 2)['KVSPARSE_NUM_WORKERS']  # doctest: +SKIP
            '2'
        """
        env = self.config(rank, num_workers, **kwargs).to_environment()
        env[cluster_config.RETRY_WINDOW] = repr(float(self.retry_window))
        if self.checkpoint_dir is not None:
            env[cluster_config.CHECKPOINT_DIR] = self.checkpoint_dir
        return env

    def info(self, timeout: Optional[float] = None) -> list:
        """Each shard's `ServerShard.info` (address, pids, node, restarts so far).

        Raises:
            ray.exceptions.RayActorError: a shard's actor is dead for good.
            ray.exceptions.GetTimeoutError: an actor did not answer in time.
        """
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        return [registry.actor_info(s.actor, deadline) for s in self._shards]

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Blocks until every shard's actor is up and its server answers a ping.

        A restarted actor is waited for (Ray queues the call until the
        restart is done).

        Raises:
            ServerUnavailable: a server did not answer within timeout.
            ray.exceptions.RayActorError: a shard's actor is dead for good.
        """
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        infos = self.info(timeout)
        for info in infos:
            if not server_process.wait_answering(info["address"], deadline):
                raise errors.ServerUnavailable(
                    f"server {info['index']} at {info['address']} does not answer",
                    address=info["address"],
                )

    def restart_dead(self, timeout: Optional[float] = None) -> list:
        """Starts again each shard whose actor is dead for good (out of restarts).

        The new actor gets the same name, placement-group bundle and port
        (and restores from ``checkpoint_dir`` if there is one). Shards that
        Ray is still restarting are waited for.

        Returns:
            The indices of the shards started again.

        Raises:
            ServerUnavailable: a server did not come back within timeout.
        """
        timeout = self.timeout if timeout is None else timeout
        restarted = []
        for index, shard in enumerate(self._shards):
            try:
                registry.actor_info(shard.actor, time.monotonic() + timeout)
            except ray.exceptions.ActorDiedError:
                shard.actor = _ShardActor.options(**shard.options).remote(**shard.arguments)
                restarted.append(index)
        self.wait_ready(timeout)
        for shard, info in zip(self._shards, self.info(timeout)):
            if info["address"] != shard.address:
                # Another node (the old one is gone): the workers need the new address.
                shard.address = info["address"]
        return restarted

    def shutdown(self, grace_period: float = 5.0) -> None:
        """Stops every server, then its actor, then frees the placement group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        stops = []
        for shard in self._shards:
            try:
                stops.append(shard.actor.stop.remote(grace_period))
            except ray.exceptions.RayActorError:
                pass
        for ref in stops:
            try:
                ray.get(ref, timeout=grace_period + 30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # a dead actor took its server with it (PDEATHSIG)
        for index, shard in enumerate(self._shards):
            ray.kill(shard.actor, no_restart=True)
            registry.delete_record(actor_name(index, self.name_prefix), self.namespace)
        # ray.kill is asynchronous: wait until the actors are gone before the bundles go.
        registry.wait_gone([shard.actor for shard in self._shards])
        remove_placement_group(self.placement_group)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.shutdown()


_ShardActor = ray.remote(ServerShard)


def start_servers(
    num_servers: int,
    resources: Optional[dict] = None,
    checkpoint_dir: Optional[str] = None,
    host: Optional[str] = None,
    strategy: str = "SPREAD",
    max_restarts: int = 5,
    namespace: str = NAMESPACE,
    name_prefix: str = NAME_PREFIX,
    server_args: tuple = (),
    timeout: float = START_TIMEOUT,
    retry_window: Optional[float] = None,
    transport: str = "tcp",
    memory_budget=0,
    spill_dir: Optional[str] = None,
) -> ServerGroup:
    """Starts num_servers kvsparse servers as Ray actors, one per shard, and waits for them.

    Needs ``ray.init()`` first (or starts a local cluster as any Ray call does).

    Args:
        num_servers: how many shards.
        resources: what each shard's bundle (and actor) asks for, in Ray's
            terms, e.g. ``{'CPU': 2, 'memory': 8 * 2**30}``; default 1 CPU.
        checkpoint_dir: where the job writes checkpoints (``kv.save``); a
            restarted server restores the last one. None: it comes back empty.
        host: the interface to bind and advertise (e.g. '127.0.0.1' for a
            one-machine cluster); None: each node's IP address.
        strategy: the placement group's strategy: 'SPREAD' (default: over as
            many nodes as possible), 'STRICT_SPREAD', 'PACK', 'STRICT_PACK'.
        max_restarts: how often Ray restarts a shard's actor (-1: forever).
        namespace: the Ray namespace of the named actors.
        name_prefix: actor i is named ``{name_prefix}-{i}``.
        server_args: more arguments for ``python -m kvsparse.server``.
        timeout: seconds to wait for the placement group and the servers.
        retry_window: seconds the workers' stores keep trying to reach a
            restarted shard (`ServerGroup.store_arguments`/`environment`);
            default 120.
        transport: 'tcp' (default: workers may run on any node) or 'ipc':
            the servers run on the driver's node and listen on Unix sockets
            there, for workers on that node only (not with host).
        memory_budget: bytes (or a size, '8GiB') each server's shard may hold in
            memory (``kvsparse server --memory-budget``); 0: none.
        spill_dir: the disk tier's directory on each node (needs memory_budget):
            shard i spills under ``spill_dir/server-i``.

    Returns:
        A `ServerGroup` (addresses, config(rank, num_workers), shutdown()).

    Raises:
        InvalidArgument: num_servers < 1, actors of that name exist, a bad
            transport, or host with transport 'ipc'.
        ServerUnavailable: a server did not start or answer in time.
        ray.exceptions.GetTimeoutError: the cluster cannot fit the bundles.

    Thread safety: calls from several threads at once start separate groups
    (each needs its own name_prefix).

    Example:
        >>> import ray, kvsparse.ray                                # doctest: +SKIP
        >>> ray.init(num_cpus=4)                                     # doctest: +SKIP
        >>> group = kvsparse.ray.start_servers(2, host='127.0.0.1')  # doctest: +SKIP
        >>> group.addresses                                          # doctest: +SKIP
        ['tcp://127.0.0.1:40123', 'tcp://127.0.0.1:40125']
    """
    if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
        raise errors.InvalidArgument(f"num_servers must be an integer >= 1, got {num_servers!r}")
    server_process.check_transport(transport)
    # The Ray entry's settings: given here, checked before any actor starts.
    memory_budget, spill_dir = cluster_config.memory_tier({}, memory_budget, spill_dir)
    if transport == "ipc" and host is not None:
        raise errors.InvalidArgument(
            "host is the interface of tcp servers; with transport 'ipc' the servers listen on "
            "Unix sockets of the driver's node (give one of the two)"
        )
    if not ray.is_initialized():
        ray.init()
    registry.refuse_running_group(num_servers, name_prefix, namespace)
    if retry_window is None:
        retry_window = DEFAULT_RETRY_WINDOW
    if checkpoint_dir is not None:
        checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir))
    bundle = dict(resources) if resources else {"CPU": 1}
    if transport == "ipc" and not any(name.startswith("node:") for name in bundle):
        # Unix sockets reach no other node: the servers go where the driver (and, the
        # user says so by choosing ipc, its workers) runs.
        bundle[f"node:{ray.util.get_node_ip_address()}"] = 0.001
    group = placement_group([dict(bundle) for _ in range(num_servers)], strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout)
    except BaseException:
        remove_placement_group(group)
        raise
    actor_resources = dict(bundle)
    shards = []
    try:
        for index in range(num_servers):
            name = actor_name(index, name_prefix)
            # A record left by a group that was not shut down.
            registry.delete_record(name, namespace)
            options = {
                "name": name,
                "namespace": namespace,
                "max_restarts": max_restarts,
                "num_cpus": actor_resources.pop("CPU", 0),
                "num_gpus": actor_resources.pop("GPU", 0),
                "memory": actor_resources.pop("memory", None),
                "resources": actor_resources or None,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=index
                ),
            }
            actor_resources = dict(bundle)
            arguments = {
                "index": index,
                "num_shards": num_servers,
                "name": name,
                "namespace": namespace,
                "host": host,
                "checkpoint_dir": checkpoint_dir,
                "server_args": (
                    *server_args,
                    *server_process.tier_arguments(memory_budget, spill_dir, f"server-{index}"),
                ),
                "transport": transport,
            }
            actor = _ShardActor.options(**options).remote(**arguments)
            shards.append(_Shard(actor, "", options, arguments))
        infos = ray.get([s.actor.info.remote() for s in shards], timeout=timeout)
        for shard, info in zip(shards, infos):
            shard.address = info["address"]
        servers = ServerGroup(
            shards, namespace, name_prefix, group, timeout, retry_window, checkpoint_dir
        )
        servers.wait_ready(timeout)
        return servers
    except BaseException:
        for index, shard in enumerate(shards):
            ray.kill(shard.actor, no_restart=True)
            registry.delete_record(actor_name(index, name_prefix), namespace)
        remove_placement_group(group)
        raise


def find_servers(
    namespace: str = NAMESPACE, name_prefix: str = NAME_PREFIX, timeout: float = START_TIMEOUT
) -> list:
    """The addresses of a running group's servers, found through the named actors.

    For a task, actor or driver of the same Ray cluster that did not start
    the servers itself.

    Raises:
        InvalidArgument: no actor ``{name_prefix}-0`` in namespace.

    Thread-safe.

    Example:
        >>> servers = find_servers()                                  # doctest: +SKIP
        >>> kv = kvsparse.create('dist_sparse', servers=servers, rank=0, num_workers=2)
    """
    actors = []
    while True:
        try:
            actors.append(ray.get_actor(actor_name(len(actors), name_prefix), namespace=namespace))
        except ValueError:
            break
    if not actors:
        raise errors.InvalidArgument(
            f"no kvsparse servers ({actor_name(0, name_prefix)!r}) in Ray namespace {namespace!r}"
        )
    return [info["address"] for info in ray.get([a.info.remote() for a in actors], timeout=timeout)]
