"""The launchers' conventions, one function each: kvsparse's own, TF_CONFIG, DMLC_*, torchrun.

Each ``*_source(environ)`` maps the `ClusterConfig` fields its convention
sets to a getter returning (value, origin) or None; `from_environment`
(`kvsparse.config.cluster`) asks them in precedence order. Getters are only
called when no source before them set the field, so a malformed
lower-precedence variable that is overridden raises nothing.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Optional

from kvsparse.config.addresses import (
    _address_list,
    _parse_port,
    format_address,
    parse_server_address,
    split_tcp_address,
)
from kvsparse.config.names import (
    _DMLC_VARIABLES,
    NUM_WORKERS,
    PEERS,
    RANK,
    SERVERS,
    STALENESS,
    TIMEOUT,
)
from kvsparse.config.values import SETTINGS, _get, _parse_int
from kvsparse.errors import InvalidArgument

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
        return None if text is None else (SETTINGS["timeout"].parse(text), TIMEOUT)

    return {
        "servers": servers,
        "rank": integer(RANK, 0),
        "num_workers": integer(NUM_WORKERS, 1),
        "timeout": timeout,
        "staleness": integer(STALENESS, 0),
    }


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


# -- several hosts (``kvsparse launch --nnodes``): SLURM's variables, ps-lite's root ----------

_NODELIST_GROUP = re.compile(r"([^,\[]+)(?:\[([^\]]*)\])?")


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
