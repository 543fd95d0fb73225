"""Colocated workers on Ray: `start_colocated`, `run_colocated` (see `kvsparse.ray`)."""

from __future__ import annotations

import os
import socket
import time
from typing import Optional

import ray  # the Ray package (imports are absolute)
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvsparse import config as cluster_config
from kvsparse import errors
from kvsparse.cluster import process as server_process
from kvsparse.ray import registry
from kvsparse.ray.registry import DEFAULT_RETRY_WINDOW, NAMESPACE, START_TIMEOUT, actor_name

# -- colocated workers: each worker actor hosts its shard -----------------------------------

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
        record = registry.get_record(name, namespace)
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
        registry.put_record(name, namespace, record)

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

        record = registry.get_record(self.name, self.namespace) or {}
        if record.get("job") != job:
            record.update(job=job, job_start=self.restarts)
            registry.put_record(self.name, self.namespace, record)
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
        if settings.get("memory_budget"):
            env[cluster_config.MEMORY_BUDGET] = str(settings["memory_budget"])
            if settings.get("spill_dir") is not None:
                spill_dir = os.path.join(settings["spill_dir"], f"worker-{rank}")
                env[cluster_config.SPILL_DIR] = spill_dir
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
            registry.get_record(actor_name(rank, self.name_prefix), self.namespace)
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
            registry.delete_record(actor_name(rank, self.name_prefix), self.namespace)
        # ray.kill is asynchronous: wait until the actors are gone before the bundles go.
        registry.wait_gone(self.actors)
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
    memory_budget=0,
    spill_dir: Optional[str] = None,
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
        memory_budget: bytes (or a size, '8GiB') each worker's shard may hold
            in memory (``KVSPARSE_MEMORY_BUDGET`` of the workers); 0: none.
        spill_dir: the disk tier's directory on each node (needs
            memory_budget): worker r's shard spills under ``spill_dir/worker-r``.

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
    memory_budget, spill_dir = cluster_config.memory_tier({}, memory_budget, spill_dir)
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
    registry.refuse_running_group(num_workers, name_prefix, namespace)
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
            # A record left by a group that was not shut down.
            registry.delete_record(name, namespace)
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
            "memory_budget": memory_budget,
            "spill_dir": spill_dir,
        }
        options = {"namespace": namespace, "name_prefix": name_prefix, "timeout": timeout}
        return ColocatedGroup(actors, [i["address"] for i in infos], options, group, settings)
    except BaseException:
        for rank, actor in enumerate(actors):
            ray.kill(actor, no_restart=True)
            registry.delete_record(actor_name(rank, name_prefix), namespace)
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
