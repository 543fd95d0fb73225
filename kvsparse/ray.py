"""Run kvsparse servers on a Ray cluster: ``pip install kvsparse[ray]``.

`start_servers` starts one Ray actor per shard. Each actor starts the same
server binary as ``kvsparse launch`` (``python -m kvsparse.server``) as its
child process and reports the address it printed, so no user code ever runs
in a server process. The actors are named (``kvsparse-server-0``, ... in the
namespace ``kvsparse``), so any driver, task or actor of the cluster can find
the servers with `find_servers`, and they are placed by a placement group
(one bundle per shard, spread over the nodes by default).

Workers are ordinary Ray tasks or actors, or processes outside Ray, given a
`kvsparse.config.ClusterConfig` (`ServerGroup.config`) or its ``KVSPARSE_*``
variables (`ServerGroup.environment`)::

    import ray, kvsparse, kvsparse.ray

    ray.init()
    servers = kvsparse.ray.start_servers(2)

    @ray.remote
    def train(arguments):
        kv = kvsparse.create('dist_sparse', **arguments)
        ...

    ray.get([train.remote(servers.store_arguments(rank, 2)) for rank in range(2)])
    servers.shutdown()

Transport. By default (``transport='tcp'``) each server listens on a port of
its node, for workers anywhere in the cluster. With ``transport='ipc'`` the
servers run on the driver's node (each bundle asks for that node's
``node:IP`` resource) and listen on Unix sockets there, each in a private
directory (mode 0700) of that node's temporary directory: only processes of
the same node and user can reach them, so use it when the workers run on
the driver's node too (a one-node cluster, or tasks pinned to it). The
workers' rows then go through shared memory (`kvsparse.client.remote`),
retry window and all.

Failures. A shard's actor is restarted by Ray (``max_restarts``) when its
process dies, and the actor exits (to be restarted) when its server process
dies. A restarted shard binds the same host and port (or ipc socket path)
again (kept in Ray's GCS key-value store), so the workers' ZeroMQ sockets
reconnect to it by themselves. With ``checkpoint_dir``, a restarted server
is started with ``--restore checkpoint_dir --shard-index I --num-shards N``
to reload the latest complete checkpoint written there (``kv.save(checkpoint_dir)``);
without one it comes back empty. Workers whose stores have a
``retry_window`` (`ServerGroup.store_arguments` and
`ServerGroup.environment` set it) say HELLO again to the restarted shard,
declare their tables again and resend the request in flight: training goes
on from the checkpoint (pushes after it are lost). A shard whose actor ran
out of restarts is started again by `ServerGroup.restart_dead`.

Colocated workers (issue 14). `start_colocated` is ``kvsparse launch
--colocated`` on Ray: one `ColocatedWorker` actor per worker, whose shard
address (a free port of its node) is kept in the same registry; its
`ColocatedGroup.submit` runs the training code in every actor with the
``KVSPARSE_*`` variables of a launched colocated worker, so that the code's
``kvsparse.create('dist_sparse')`` hosts the actor's shard. With
``max_restarts``, an actor that Ray restarts runs its call again, binds the
same address and restores its shard from ``checkpoint_dir`` (as
``--restart-workers``)::

    results = kvsparse.ray.run_colocated(train, 2, args=(epochs,))

The server process is tied to its actor: it gets SIGKILL when the actor's
process dies (Linux ``PR_SET_PDEATHSIG``), and `ServerGroup.shutdown` stops
the servers, then the actors, then frees the placement group. It is started
as ``kvsparse launch`` starts its servers (`kvsparse.cluster.process`): the
same command line, bind retries, and environment rule (no ``DMLC_ROLE``,
``PORT``, ``TF_CONFIG``, nor the actor's own cluster placement variables).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import ray  # the Ray package (this module is kvsparse.ray; imports are absolute)
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvsparse import config as cluster_config
from kvsparse import errors
from kvsparse.cluster import process as server_process

NAMESPACE = "kvsparse"
NAME_PREFIX = "kvsparse-server"
START_TIMEOUT = 60.0
DEFAULT_RETRY_WINDOW = cluster_config.DEFAULT_RETRY_WINDOW  # as `kvsparse launch`
# A port just given up by a killed server may still be held for a moment; retry the bind.
_BIND_RETRY_SECONDS = 10.0


def actor_name(index: int, name_prefix: str = NAME_PREFIX) -> str:
    """The Ray actor name of shard `index`: ``kvsparse-server-{index}``. Thread-safe.

    Example:
        >>> actor_name(1)
        'kvsparse-server-1'
    """
    return f"{name_prefix}-{index}"


def _registry_key(name: str) -> str:
    return f"kvsparse.ray/{name}"


def _registry_get(name: str, namespace: str) -> Optional[dict]:
    # Ray's GCS key-value store outlives any actor: a restarted shard finds its port there.
    from ray.experimental import internal_kv

    value = internal_kv._internal_kv_get(_registry_key(name), namespace=namespace)
    return None if value is None else json.loads(value)


def _registry_put(name: str, namespace: str, record: dict) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(_registry_key(name), json.dumps(record), namespace=namespace)


def _registry_delete(name: str, namespace: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(_registry_key(name), namespace=namespace)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _same_server(pid: int, record: dict) -> bool:
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


def _ipc_bind(record: Optional[dict], index: int) -> str:
    """The socket path of shard index: its last server's if that one's directory is here."""
    if record is not None:
        path = cluster_config.ipc_path(record["address"])
        if path is not None and os.path.isdir(os.path.dirname(path)):
            return record["address"]
    return server_process.ipc_bind_address(server_process.socket_directory(), f"server-{index}")


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
        record = _registry_get(name, namespace)
        self.restarts = 0 if record is None else record["restarts"] + 1
        if record is not None:
            # A server left over from a dead actor (no PDEATHSIG on this OS) holds the port.
            if _pid_alive(record["pid"]) and _same_server(record["pid"], record):
                os.kill(record["pid"], signal.SIGKILL)
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
        _registry_put(
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


def _actor_info(actor, deadline: float) -> dict:
    """actor.info(), waiting while Ray restarts the actor (calls then fail at once)."""
    while True:
        try:
            return ray.get(actor.info.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@dataclass
class _Shard:
    actor: object
    address: str
    options: dict
    arguments: dict


def _refuse_running_group(count: int, name_prefix: str, namespace: str) -> None:
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


def _wait_gone(actors: list, timeout: float = 30.0) -> None:
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
        return [_actor_info(s.actor, deadline) for s in self._shards]

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
                _actor_info(shard.actor, time.monotonic() + timeout)
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
            _registry_delete(actor_name(index, self.name_prefix), self.namespace)
        # ray.kill is asynchronous: wait until the actors are gone before the bundles go.
        _wait_gone([shard.actor for shard in self._shards])
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
    if transport == "ipc" and host is not None:
        raise errors.InvalidArgument(
            "host is the interface of tcp servers; with transport 'ipc' the servers listen on "
            "Unix sockets of the driver's node (give one of the two)"
        )
    if not ray.is_initialized():
        ray.init()
    _refuse_running_group(num_servers, name_prefix, namespace)
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
            _registry_delete(name, namespace)  # a record left by a group that was not shut down
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
                "server_args": tuple(server_args),
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
            _registry_delete(actor_name(index, name_prefix), namespace)
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


# -- colocated workers: each worker actor hosts its shard (issue 14) ------------------------

WORKER_NAME_PREFIX = "kvsparse-worker"


class ColocatedWorker:
    """A Ray actor (see `start_colocated`): colocated worker `rank`, its shard's address, its code.

    Its address (``tcp://host:port``, a free port of its node, or of host)
    is chosen when the actor first starts and kept in Ray's GCS key-value
    store, so that an actor that Ray restarts binds the same address. `run`
    runs the training code in this process, with the environment a worker of
    ``kvsparse launch --colocated`` gets, so that the code's
    ``kvsparse.create('dist_sparse')`` hosts this worker's shard.

    Args:
        rank: the worker's rank.
        num_workers: how many workers the group has.
        name: the actor's name (the key of its registry record).
        namespace: the Ray namespace of the group.
        host: interface to bind and to advertise; None: this node's IP.

    Thread safety: a Ray actor runs one method call at a time (the code of
    `run` runs on the actor's main thread, as a worker's in its process).
    """

    def __init__(
        self, rank: int, num_workers: int, name: str, namespace: str, host: Optional[str] = None
    ):
        self.rank = rank
        self.num_workers = num_workers
        self.name = name
        self.namespace = namespace
        record = _registry_get(name, namespace)
        if record is None:
            host = host or ray.util.get_node_ip_address()
            # Held from now on, and served by this rank's shard (KVSPARSE_SHARD_FD): no other
            # process can take the port between the choice and the bind.
            self._listener = _listen(host, 0)
            self.address = cluster_config.format_address(host, self._listener.getsockname()[1])
            self.restarts = 0
            record = {"rank": rank, "address": self.address}
        else:
            # Restarted by Ray: the same address, which the other workers know as this
            # rank's shard (on another node, its host is not ours: the bind fails, and says so).
            self.address = record["address"]
            self.restarts = record["restarts"] + 1
            host, port = self.address[len("tcp://") :].rsplit(":", 1)
            try:
                self._listener = _listen(host.strip("[]"), int(port))
            except OSError:
                self._listener = None  # the store's own bind says why it cannot have it
        record.update(
            restarts=self.restarts,
            actor_pid=os.getpid(),
            node_id=ray.get_runtime_context().get_node_id(),
        )
        _registry_put(name, namespace, record)

    def info(self) -> dict:
        """{'rank', 'address', 'actor_pid', 'node_id', 'restarts'}."""
        return {
            "rank": self.rank,
            "address": self.address,
            "actor_pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "restarts": self.restarts,
        }

    def run(self, job: str, function, args: tuple, kwargs: dict, environment: dict):
        """Runs function(*args, **kwargs) as this rank's worker of job; its return value.

        environment: the job's ``KVSPARSE_*`` variables and the user's (see
        `ColocatedGroup.environment`). When Ray runs this call again on a
        restarted actor (the first one died with its process),
        ``KVSPARSE_RESTARTED`` says how often this rank restarted during the
        job: its store restores the shard and resumes as under ``kvsparse
        launch --colocated --restart-workers``. When function returns, the
        colocated stores it left open close as at a worker process's exit
        (a barrier with the other workers); when it raises, they close
        without the barrier, and the other workers' requests that wait for
        this rank fail at once.
        """
        from kvsparse.store import colocated

        record = _registry_get(self.name, self.namespace) or {}
        if record.get("job") != job:
            record.update(job=job, job_start=self.restarts)
            _registry_put(self.name, self.namespace, record)
        restarted = self.restarts - record["job_start"]
        variables = dict(environment)
        if restarted:
            variables[cluster_config.RESTARTED] = str(restarted)
        if self._listener is not None:
            variables[cluster_config.SHARD_FD] = str(self._listener.fileno())
        server_process.enter_worker_environment(variables)
        try:
            result = function(*args, **kwargs)
        except BaseException:
            colocated.close_open_stores(crashed=True)
            raise
        colocated.close_open_stores()
        return result


def _listen(host: str, port: int) -> socket.socket:
    """A tcp socket listening at host:port (port 0: a free one). Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=128)


_ColocatedWorkerActor = ray.remote(ColocatedWorker)


class ColocatedGroup:
    """The colocated worker actors started by `start_colocated`; `shutdown` (or ``with``) ends them.

    Attributes:
        addresses: each worker's shard address (``tcp://host:port``), in rank
            order: the job's ``KVSPARSE_PEERS``.
        namespace: the Ray namespace of the actors.
        name_prefix: actor r is named ``{name_prefix}-{r}``.
        placement_group: the Ray placement group (one bundle per worker).
        checkpoint_dir: where checkpoints go (``KVSPARSE_CHECKPOINT_DIR``), or None.
        retry_window: seconds the workers keep retrying a restarted worker's
            shard (0: no retry, when the actors are not restarted).

    Thread safety: `addresses`, `environment` and `info` may be called from
    several threads at once; `submit`, `run` and `shutdown` from one thread
    at a time.
    """

    def __init__(self, actors, addresses, options, group, settings):
        self.actors = actors
        self.addresses = addresses
        self.namespace = options["namespace"]
        self.name_prefix = options["name_prefix"]
        self.placement_group = group
        self.checkpoint_dir = settings["checkpoint_dir"]
        self.retry_window = settings["retry_window"]
        self.timeout = options["timeout"]
        self._settings = settings
        self._jobs = 0
        self._running: list = []
        self._closed = False

    @property
    def num_workers(self) -> int:
        """How many workers (and shards)."""
        return len(self.actors)

    def environment(self, rank: int) -> dict:
        """The variables worker rank's code runs with (``KVSPARSE_PEERS``, rank, ...).

        Those of a worker of ``kvsparse launch --colocated`` (with
        ``--restart-workers`` when the actors are restarted by Ray), and the
        group's env.

        Raises:
            InvalidArgument: rank out of range.

        Example:
            >>> group.environment(1)['KVSPARSE_RANK']  # doctest: +SKIP
            '1'
        """
        settings = self._settings
        worker_config = cluster_config.ClusterConfig(
            servers=self.addresses,
            rank=rank,
            num_workers=self.num_workers,
            timeout=settings["timeout"],
            staleness=settings["staleness"],
        )
        # KVSPARSE_SERVERS too (to_environment), as under kvsparse launch --colocated:
        # `kvsparse stats` finds the shards.
        env = dict(settings["env"])
        env.update(worker_config.to_environment())
        env[cluster_config.PEERS] = ",".join(self.addresses)
        if self.checkpoint_dir is not None:
            env[cluster_config.CHECKPOINT_DIR] = self.checkpoint_dir
        if self.retry_window:
            env[cluster_config.RETRY_WINDOW] = repr(float(self.retry_window))
            if settings["restartable"]:
                env[cluster_config.REJOIN_WINDOW] = repr(float(self.retry_window))
        return env

    def submit(self, function, *args, **kwargs) -> list:
        """Runs function(*args, **kwargs) on every worker; one Ray ObjectRef per rank.

        ``ray.get`` of them gives each worker's return value, in rank order,
        or raises the first worker's error (a ``ray.exceptions.RayTaskError``
        of it; `ColocatedWorker.run` says what the other workers see). The
        function and its arguments must pickle (cloudpickle, as for any Ray
        task). One job at a time: submit again once its refs are done.

        Raises:
            InvalidArgument: the group is shut down, or its last job still runs.

        Example:
            >>> results = ray.get(group.submit(train, epochs=2))  # doctest: +SKIP
        """
        if self._closed:
            raise errors.InvalidArgument("this colocated group is shut down")
        if self._running:
            done, _ = ray.wait(self._running, num_returns=len(self._running), timeout=0)
            if len(done) != len(self._running):
                raise errors.InvalidArgument(
                    "the group's last job still runs: ray.get its refs before submitting another"
                )
        self._jobs += 1
        job = f"{self.name_prefix}/{os.getpid()}/{time.time_ns()}/{self._jobs}"
        self._running = [
            actor.run.remote(job, function, args, kwargs, self.environment(rank))
            for rank, actor in enumerate(self.actors)
        ]
        return list(self._running)

    def run(self, function, *args, timeout: Optional[float] = None, **kwargs) -> list:
        """`submit`, then ``ray.get``: each worker's return value, in rank order.

        Raises:
            ray.exceptions.RayTaskError: a worker's function raised.
            ray.exceptions.RayActorError: a worker's actor died for good
                (out of restarts).
            ray.exceptions.GetTimeoutError: not done within timeout seconds.
        """
        return ray.get(self.submit(function, *args, **kwargs), timeout=timeout)

    def info(self) -> list:
        """Each worker's record: {'rank', 'address', 'actor_pid', 'node_id', 'restarts', ...}.

        Read from the GCS key-value store, so it answers while the workers
        run (an actor runs one call at a time). 'restarts': how often Ray
        restarted the actor so far.
        """
        return [
            _registry_get(actor_name(rank, self.name_prefix), self.namespace)
            for rank in range(self.num_workers)
        ]

    def shutdown(self) -> None:
        """Ends every worker actor (their shards go with them), then frees the placement group.

        Idempotent. A job still running fails (its refs raise RayActorError).
        """
        if self._closed:
            return
        self._closed = True
        for rank, actor in enumerate(self.actors):
            ray.kill(actor, no_restart=True)
            _registry_delete(actor_name(rank, self.name_prefix), self.namespace)
        # ray.kill is asynchronous: wait until the actors are gone before the bundles go.
        _wait_gone(self.actors)
        remove_placement_group(self.placement_group)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.shutdown()


def start_colocated(
    num_workers: int,
    resources: Optional[dict] = None,
    checkpoint_dir: Optional[str] = None,
    host: Optional[str] = None,
    strategy: str = "SPREAD",
    max_restarts: int = 0,
    namespace: str = NAMESPACE,
    name_prefix: str = WORKER_NAME_PREFIX,
    timeout: float = START_TIMEOUT,
    retry_window: Optional[float] = None,
    worker_timeout: Optional[float] = None,
    staleness: Optional[int] = None,
    env: Optional[dict] = None,
) -> ColocatedGroup:
    """Starts num_workers colocated worker actors (``kvsparse launch --colocated`` on Ray).

    Worker r is a named Ray actor (``kvsparse-worker-r`` in namespace
    ``kvsparse``, placed by a placement group, one bundle per worker) that
    hosts shard r of every table: `ColocatedGroup.submit` runs the training
    code in each actor with ``KVSPARSE_PEERS`` (every actor's shard address),
    ``KVSPARSE_RANK`` and ``KVSPARSE_NUM_WORKERS`` set, so that the code's
    ``kvsparse.create('dist_sparse')`` is colocated, unchanged.

    With max_restarts (and checkpoint_dir), an actor whose process dies is
    restarted by Ray and its call runs again there: its store binds the
    shard's address again, restores shard r of the latest complete
    checkpoint in checkpoint_dir and resumes this rank's clock (``kv.clock``),
    as ``kvsparse launch --colocated --restart-workers`` does; the other
    workers wait for it (``KVSPARSE_RETRY_WINDOW``, ``KVSPARSE_REJOIN_WINDOW``).
    Updates acknowledged after the checkpoint are lost from that shard.

    Args:
        num_workers: how many workers (and shards).
        resources: what each worker's bundle (and actor) asks for, in Ray's
            terms, e.g. ``{'CPU': 4, 'GPU': 1}``; default 1 CPU.
        checkpoint_dir: ``KVSPARSE_CHECKPOINT_DIR`` of the workers (where
            ``kv.save()`` writes) and what a restarted worker restores.
        host: the interface to bind and advertise (e.g. '127.0.0.1' for a
            one-machine cluster); None: each node's IP address.
        strategy: the placement group's strategy ('SPREAD', 'STRICT_SPREAD',
            'PACK', 'STRICT_PACK').
        max_restarts: how often Ray restarts a worker's actor (-1: forever;
            0, the default: a worker that dies ends the job, as without
            ``--restart-workers``).
        namespace: the Ray namespace of the named actors.
        name_prefix: actor r is named ``{name_prefix}-{r}``.
        timeout: seconds to wait for the placement group and the actors.
        retry_window: ``KVSPARSE_RETRY_WINDOW`` of the workers; default
            with max_restarts: 120 s (as ``kvsparse launch``), else unset.
        worker_timeout: ``KVSPARSE_TIMEOUT`` of the workers (seconds), or None.
        staleness: ``KVSPARSE_STALENESS`` of the workers (SSP), or None.
        env: more variables for the workers' code (not the ``KVSPARSE_*``
            ones set from these options).

    Returns:
        A `ColocatedGroup` (addresses, submit(fn, ...), run(fn, ...), shutdown()).

    Raises:
        InvalidArgument: num_workers < 1, a bad option or variable, or actors
            of that name exist.
        ray.exceptions.GetTimeoutError: the cluster cannot fit the bundles.

    Thread safety: calls from several threads at once start separate groups
    (each needs its own name_prefix).

    Example:
        >>> def train():                                             # doctest: +SKIP
        ...     kv = kvsparse.create('dist_sparse')
        ...     ...
        ...     return kv.rank
        >>> with kvsparse.ray.start_colocated(2) as group:            # doctest: +SKIP
        ...     group.run(train)
        [0, 1]
    """
    from kvsparse.cluster.launch import check_worker_variables

    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise errors.InvalidArgument(f"num_workers must be an integer >= 1, got {num_workers!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < -1:
        raise errors.InvalidArgument(
            f"max_restarts must be an integer >= 0, or -1 (forever), got {max_restarts!r}"
        )
    extra = check_worker_variables(env)
    # Checked now, with a placeholder address, so a bad value fails before anything starts.
    cluster_config.ClusterConfig(["tcp://127.0.0.1:1"], 0, num_workers, worker_timeout, staleness)
    if retry_window is None and max_restarts != 0:
        retry_window = DEFAULT_RETRY_WINDOW
    if retry_window is not None and (
        isinstance(retry_window, bool)
        or not isinstance(retry_window, (int, float))
        or not 0 <= retry_window < float("inf")
    ):
        raise errors.InvalidArgument(
            f"retry_window must be a number of seconds >= 0, got {retry_window!r}"
        )
    if checkpoint_dir is not None:
        checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir))
        os.makedirs(checkpoint_dir, exist_ok=True)
    if not ray.is_initialized():
        ray.init()
    _refuse_running_group(num_workers, name_prefix, namespace)
    bundle = dict(resources) if resources else {"CPU": 1}
    group = placement_group([dict(bundle) for _ in range(num_workers)], strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout)
    except BaseException:
        remove_placement_group(group)
        raise
    actors = []
    try:
        for rank in range(num_workers):
            name = actor_name(rank, name_prefix)
            _registry_delete(name, namespace)  # a record left by a group that was not shut down
            actor_resources = dict(bundle)
            actor = _ColocatedWorkerActor.options(
                name=name,
                namespace=namespace,
                max_restarts=max_restarts,
                # The call that ran on a dead actor runs again on the restarted one.
                max_task_retries=max_restarts,
                num_cpus=actor_resources.pop("CPU", 0),
                num_gpus=actor_resources.pop("GPU", 0),
                memory=actor_resources.pop("memory", None),
                resources=actor_resources or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=rank
                ),
            ).remote(rank, num_workers, name, namespace, host)
            actors.append(actor)
        infos = ray.get([actor.info.remote() for actor in actors], timeout=timeout)
        settings = {
            "checkpoint_dir": checkpoint_dir,
            "retry_window": retry_window or 0.0,
            "restartable": max_restarts != 0,
            "timeout": worker_timeout,
            "staleness": staleness,
            "env": extra,
        }
        options = {"namespace": namespace, "name_prefix": name_prefix, "timeout": timeout}
        return ColocatedGroup(actors, [i["address"] for i in infos], options, group, settings)
    except BaseException:
        for rank, actor in enumerate(actors):
            ray.kill(actor, no_restart=True)
            _registry_delete(actor_name(rank, name_prefix), namespace)
        remove_placement_group(group)
        raise


def run_colocated(
    function, num_workers: int, args: tuple = (), kwargs: Optional[dict] = None, **options
) -> list:
    """Runs function(*args, **kwargs) as a colocated job of num_workers Ray actors; their results.

    `start_colocated` (options are its keyword arguments), `ColocatedGroup.run`,
    then `ColocatedGroup.shutdown`, whatever happens.

    Raises:
        What `start_colocated` and `ColocatedGroup.run` raise.

    Thread safety: as `start_colocated`.

    Example:
        >>> def train(steps):                                       # doctest: +SKIP
        ...     kv = kvsparse.create('dist_sparse')  # colocated: KVSPARSE_PEERS is set
        ...     ...
        >>> kvsparse.ray.run_colocated(train, 2, args=(100,))       # doctest: +SKIP
    """
    with start_colocated(num_workers, **options) as group:
        return group.run(function, *args, **(kwargs or {}))


__all__ = [
    "NAMESPACE",
    "NAME_PREFIX",
    "WORKER_NAME_PREFIX",
    "ColocatedGroup",
    "ColocatedWorker",
    "ServerGroup",
    "ServerShard",
    "actor_name",
    "find_servers",
    "run_colocated",
    "start_colocated",
    "start_servers",
]
