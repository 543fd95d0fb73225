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
from collections.abc import Mapping
from typing import Callable, Optional

from kvsparse.config.addresses import (
    _address_list,
    _parse_port,
    format_address,
    parse_server_address,
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
