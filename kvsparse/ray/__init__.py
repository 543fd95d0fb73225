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

Colocated workers. `start_colocated` is ``kvsparse launch --colocated`` on
Ray: one `ColocatedWorker` actor per worker, whose shard address (a free
port of its node) is kept in the same registry; its `ColocatedGroup.submit`
runs the training code in every actor with the ``KVSPARSE_*`` variables of
a launched colocated worker, so that the code's
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

from kvsparse.ray.colocated import (
    WORKER_NAME_PREFIX,
    ColocatedGroup,
    ColocatedWorker,
    run_colocated,
    start_colocated,
)
from kvsparse.ray.registry import (
    DEFAULT_RETRY_WINDOW,
    NAME_PREFIX,
    NAMESPACE,
    START_TIMEOUT,
    actor_name,
)
from kvsparse.ray.servers import ServerGroup, ServerShard, find_servers, start_servers

__all__ = [
    "DEFAULT_RETRY_WINDOW",
    "NAMESPACE",
    "NAME_PREFIX",
    "WORKER_NAME_PREFIX",
    "ColocatedGroup",
    "ColocatedWorker",
    "ServerGroup",
    "START_TIMEOUT",
    "ServerShard",
    "actor_name",
    "find_servers",
    "run_colocated",
    "start_colocated",
    "start_servers",
]
