"""kvsparse.config: every environment convention, their precedence, and clear errors."""

import json

import pytest

from kvsparse import errors
from kvsparse.config import (
    ClusterConfig,
    format_address,
    from_environment,
    ipc_path,
    monitor_config,
    parse_server_address,
    server_bind_address,
)

S2 = "tcp://127.0.0.1:7000,tcp://127.0.0.1:7001"


def tf_config(task_type=None, index=0, chief=1, workers=2, ps=2, **extra):
    cluster = {}
    if chief:
        cluster["chief"] = [f"chief{i}:2222" for i in range(chief)]
    if workers:
        cluster["worker"] = [f"worker{i}:2222" for i in range(workers)]
    if ps:
        cluster["ps"] = [f"ps{i}:2222" for i in range(ps)]
    cluster.update(extra)
    body = {"cluster": cluster}
    if task_type is not None:
        body["task"] = {"type": task_type, "index": index}
    return json.dumps(body)


def dmlc(role="worker", **extra):
    env = {
        "DMLC_ROLE": role,
        "DMLC_NUM_SERVER": "2",
        "DMLC_NUM_WORKER": "3",
        "DMLC_PS_ROOT_URI": "10.0.0.5",
        "DMLC_PS_ROOT_PORT": "9000",
    }
    env.update(extra)
    return env


# -- KVSPARSE_* ---------------------------------------------------------------------------


def test_kvsparse_variables():
    config = from_environment(
        {
            "KVSPARSE_SERVERS": " tcp://127.0.0.1:7000 , 127.0.0.1:7001",
            "KVSPARSE_RANK": "2",
            "KVSPARSE_NUM_WORKERS": "3",
            "KVSPARSE_TIMEOUT": "2.5",
            "KVSPARSE_STALENESS": "4",
        }
    )
    assert config.servers == ["tcp://127.0.0.1:7000", "tcp://127.0.0.1:7001"]
    assert (config.rank, config.num_workers, config.num_servers) == (2, 3, 2)
    assert config.timeout == 2.5 and config.staleness == 4
    assert config.origin["servers"] == "KVSPARSE_SERVERS"
    assert config.origin["rank"] == "KVSPARSE_RANK"


def test_servers_only_means_one_worker_and_default_options():
    config = from_environment({"KVSPARSE_SERVERS": "tcp://localhost:7000"})
    assert (config.rank, config.num_workers) == (0, 1)
    assert config.timeout is None and config.staleness is None


def test_ipv6_and_hostnames():
    config = from_environment({"KVSPARSE_SERVERS": "tcp://[::1]:7000,[fe80::1]:7001,ps-0.svc:7002"})
    assert config.servers == ["tcp://[::1]:7000", "tcp://[fe80::1]:7001", "tcp://ps-0.svc:7002"]


def test_empty_variables_count_as_unset():
    env = {
        "KVSPARSE_SERVERS": S2,
        "KVSPARSE_RANK": "",
        "KVSPARSE_TIMEOUT": " ",
        "RANK": "1",
        "WORLD_SIZE": "2",
    }
    config = from_environment(env)
    assert (config.rank, config.num_workers, config.timeout) == (1, 2, None)


def test_reads_os_environ_by_default(monkeypatch):
    for name in (
        "TF_CONFIG",
        "DMLC_ROLE",
        "DMLC_NUM_SERVER",
        "DMLC_NUM_WORKER",
        "DMLC_PS_ROOT_URI",
        "DMLC_PS_ROOT_PORT",
        "RANK",
        "WORLD_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVSPARSE_SERVERS", S2)
    monkeypatch.setenv("KVSPARSE_RANK", "1")
    monkeypatch.setenv("KVSPARSE_NUM_WORKERS", "2")
    config = from_environment()
    assert (config.num_servers, config.rank, config.num_workers) == (2, 1, 2)


def test_to_environment_round_trips():
    config = ClusterConfig(
        ["127.0.0.1:7000", "tcp://[::1]:7001"], rank=3, num_workers=4, timeout=1.5, staleness=0
    )
    again = from_environment(config.to_environment())
    assert again == config
    assert again.servers == ["tcp://127.0.0.1:7000", "tcp://[::1]:7001"]


# -- TF_CONFIG ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "task_type, index, rank",
    [("chief", 0, 0), ("worker", 0, 1), ("worker", 1, 2)],
)
def test_tf_config_chief_then_workers(task_type, index, rank):
    config = from_environment({"TF_CONFIG": tf_config(task_type, index)})
    assert config.servers == ["tcp://ps0:2222", "tcp://ps1:2222"]
    assert (config.rank, config.num_workers) == (rank, 3)
    assert config.origin["servers"] == "TF_CONFIG cluster['ps']"


def test_tf_config_without_chief_worker_zero_is_rank_zero():
    config = from_environment({"TF_CONFIG": tf_config("worker", 1, chief=0, workers=3)})
    assert (config.rank, config.num_workers) == (1, 3)


def test_tf_config_master_is_the_chief():
    env = {"TF_CONFIG": tf_config("worker", 0, chief=0, workers=1, master=["m:1"])}
    config = from_environment(env)
    assert (config.rank, config.num_workers) == (1, 2)


def test_tf_config_without_ps_takes_servers_from_kvsparse():
    env = {"TF_CONFIG": tf_config("worker", 1, ps=0), "KVSPARSE_SERVERS": S2}
    config = from_environment(env)
    assert config.num_servers == 2 and (config.rank, config.num_workers) == (2, 3)


@pytest.mark.parametrize("task_type", ["ps", "evaluator"])
def test_tf_config_non_worker_task_is_an_error(task_type):
    env = {"TF_CONFIG": tf_config(task_type, 0, evaluator=["e:1"])}
    with pytest.raises(errors.InvalidArgument, match="TF_CONFIG: task .* not a training worker"):
        from_environment(env)


def test_tf_config_non_worker_task_with_explicit_rank_is_fine():
    env = {"TF_CONFIG": tf_config("evaluator", 0, evaluator=["e:1"]), "KVSPARSE_RANK": "0"}
    assert from_environment(env).rank == 0


# -- DMLC_* ------------------------------------------------------------------------------------


def test_dmlc_servers_follow_the_root_port():
    config = from_environment(dmlc(DMLC_WORKER_ID="2"))
    assert config.servers == ["tcp://10.0.0.5:9001", "tcp://10.0.0.5:9002"]
    assert (config.rank, config.num_workers) == (2, 3)
    assert config.origin["rank"] == "DMLC_WORKER_ID"


def test_dmlc_task_id_gives_the_rank_when_worker_id_is_absent():
    config = from_environment(dmlc(DMLC_TASK_ID="1"))
    assert config.rank == 1 and config.origin["rank"] == "DMLC_TASK_ID"
    both = from_environment(dmlc(DMLC_TASK_ID="1", DMLC_WORKER_ID="0"))
    assert both.rank == 0


def test_dmlc_single_worker_needs_no_id():
    config = from_environment(dmlc(DMLC_NUM_WORKER="1"))
    assert (config.rank, config.num_workers) == (0, 1)


def test_dmlc_several_workers_without_id_is_an_error():
    with pytest.raises(errors.InvalidArgument, match="3 workers .*DMLC_NUM_WORKER.* KVSPARSE_RANK"):
        from_environment(dmlc())


@pytest.mark.parametrize("role", ["server", "scheduler"])
def test_dmlc_server_role_is_not_a_worker(role):
    with pytest.raises(errors.InvalidArgument, match=f"DMLC_ROLE='{role}'.*not a worker"):
        from_environment(dmlc(role, DMLC_TASK_ID="0"))


@pytest.mark.parametrize("missing", ["DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_SERVER"])
def test_dmlc_incomplete_names_the_missing_variable(missing):
    env = dmlc(DMLC_WORKER_ID="0")
    del env[missing]
    with pytest.raises(errors.InvalidArgument, match=f"incomplete: {missing} not set"):
        from_environment(env)


def test_dmlc_ipv6_root():
    config = from_environment(dmlc(DMLC_PS_ROOT_URI="::1", DMLC_NUM_WORKER="1"))
    assert config.servers == ["tcp://[::1]:9001", "tcp://[::1]:9002"]


# -- torchrun ------------------------------------------------------------------------------


def test_torchrun_rank_and_world_size_with_kvsparse_servers():
    config = from_environment(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "KVSPARSE_SERVERS": S2}
    )
    assert (config.rank, config.num_workers, config.num_servers) == (3, 4, 2)
    assert config.origin["rank"] == "RANK" and config.origin["num_workers"] == "WORLD_SIZE"


def test_torchrun_without_servers_says_what_to_set():
    with pytest.raises(
        errors.InvalidArgument, match="no kvsparse servers configured.*KVSPARSE_SERVERS"
    ):
        from_environment({"RANK": "0", "WORLD_SIZE": "2"})


@pytest.mark.parametrize("present, missing", [("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")])
def test_torchrun_half_set_names_the_other(present, missing):
    with pytest.raises(errors.InvalidArgument, match=f"torchrun's {missing} is not set"):
        from_environment({present: "1", "KVSPARSE_SERVERS": S2})


# -- precedence ------------------------------------------------------------------------------


def test_kvsparse_beats_every_other_convention():
    env = {
        "KVSPARSE_SERVERS": "tcp://127.0.0.1:7000",
        "KVSPARSE_RANK": "0",
        "KVSPARSE_NUM_WORKERS": "5",
        "TF_CONFIG": tf_config("worker", 1),
        **dmlc(DMLC_WORKER_ID="2"),
        "RANK": "3",
        "WORLD_SIZE": "4",
    }
    config = from_environment(env)
    assert config.servers == ["tcp://127.0.0.1:7000"]
    assert (config.rank, config.num_workers) == (0, 5)


def test_tf_config_beats_dmlc_and_torchrun():
    env = {
        "TF_CONFIG": tf_config("worker", 1),
        **dmlc(DMLC_WORKER_ID="0"),
        "RANK": "3",
        "WORLD_SIZE": "4",
    }
    config = from_environment(env)
    assert config.servers == ["tcp://ps0:2222", "tcp://ps1:2222"]
    assert (config.rank, config.num_workers) == (2, 3)


def test_dmlc_beats_torchrun():
    env = {**dmlc(DMLC_WORKER_ID="1"), "RANK": "3", "WORLD_SIZE": "4"}
    config = from_environment(env)
    assert config.servers[0] == "tcp://10.0.0.5:9001"
    assert (config.rank, config.num_workers) == (1, 3)


def test_precedence_is_per_field():
    # Servers from TF_CONFIG, the worker count from DMLC, the rank from torchrun.
    env = {
        "TF_CONFIG": tf_config(chief=0, workers=0),
        "DMLC_NUM_WORKER": "4",
        "RANK": "3",
        "WORLD_SIZE": "9",
    }
    config = from_environment(env)
    assert (config.num_servers, config.rank, config.num_workers) == (2, 3, 4)
    assert config.origin == {
        "servers": "TF_CONFIG cluster['ps']",
        "rank": "RANK",
        "num_workers": "DMLC_NUM_WORKER",
    }


def test_overridden_malformed_values_are_not_read():
    env = {
        "KVSPARSE_SERVERS": S2,
        "KVSPARSE_RANK": "1",
        "KVSPARSE_NUM_WORKERS": "2",
        "DMLC_ROLE": "worker",
        "DMLC_WORKER_ID": "x",
        "DMLC_NUM_WORKER": "y",
        "RANK": "z",
        "WORLD_SIZE": "w",
    }
    assert from_environment(env).rank == 1


# -- errors --------------------------------------------------------------------------------


def test_no_configuration_at_all():
    with pytest.raises(errors.InvalidArgument, match="no kvsparse servers configured") as info:
        from_environment({"HOME": "/root"})
    assert "kvsparse launch" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "variable, value, message",
    [
        (
            "KVSPARSE_SERVERS",
            "tcp://127.0.0.1",
            "KVSPARSE_SERVERS: 'tcp://127.0.0.1' is not 'host:port'",
        ),
        ("KVSPARSE_SERVERS", "tcp://127.0.0.1:7000,,tcp://h:1", "KVSPARSE_SERVERS=.* empty entry"),
        (
            "KVSPARSE_SERVERS",
            "udp://h:7000",
            "KVSPARSE_SERVERS: 'udp://h:7000' has an unknown scheme 'udp'",
        ),
        (
            "KVSPARSE_SERVERS",
            "tcp://h:port",
            "KVSPARSE_SERVERS: 'tcp://h:port' has no valid TCP port",
        ),
        ("KVSPARSE_SERVERS", "tcp://h:70000", "'tcp://h:70000' has no valid TCP port"),
        ("KVSPARSE_SERVERS", "tcp://h:0", "'tcp://h:0' has no valid TCP port"),
        ("KVSPARSE_SERVERS", "tcp://a b:1", "has a malformed host 'a b'"),
        ("KVSPARSE_SERVERS", "tcp://*:1", "has a malformed host '\\*'"),
        ("KVSPARSE_SERVERS", "tcp://::1:7000", r"write IPv6 hosts as '\[::1\]:port'"),
        ("KVSPARSE_SERVERS", "tcp://h:1,tcp://h:1", "KVSPARSE_SERVERS: a server is listed twice"),
        ("KVSPARSE_RANK", "one", "KVSPARSE_RANK='one' is not an integer"),
        ("KVSPARSE_RANK", "-1", "KVSPARSE_RANK='-1' must be >= 0"),
        ("KVSPARSE_RANK", "4", r"rank 4 \(from KVSPARSE_RANK\) must be in \[0, 2\)"),
        ("KVSPARSE_NUM_WORKERS", "0", "KVSPARSE_NUM_WORKERS='0' must be >= 1"),
        ("KVSPARSE_NUM_WORKERS", "2.5", "KVSPARSE_NUM_WORKERS='2.5' is not an integer"),
        ("KVSPARSE_TIMEOUT", "soon", "KVSPARSE_TIMEOUT='soon' is not a number of seconds"),
        ("KVSPARSE_TIMEOUT", "0", "KVSPARSE_TIMEOUT='0' is not a number of seconds > 0"),
        ("KVSPARSE_TIMEOUT", "inf", "KVSPARSE_TIMEOUT='inf' is not a number of seconds > 0"),
        ("KVSPARSE_TIMEOUT", "nan", "KVSPARSE_TIMEOUT='nan' is not a number of seconds > 0"),
        ("KVSPARSE_STALENESS", "-2", "KVSPARSE_STALENESS='-2' must be >= 0"),
        ("KVSPARSE_STALENESS", "1.5", "KVSPARSE_STALENESS='1.5' is not an integer"),
        ("TF_CONFIG", "{not json", "TF_CONFIG is not valid JSON"),
        ("TF_CONFIG", "[1, 2]", "TF_CONFIG must be a JSON object"),
        ("TF_CONFIG", '{"cluster": {"ps": "h:1"}}', r"cluster\['ps'\] must be a list"),
        (
            "TF_CONFIG",
            '{"cluster": {"ps": ["h:1"]}, "task": {"type": "ps", "index": 3}}',
            r"task ps:3 but cluster\['ps'\] has 1 entries",
        ),
        (
            "TF_CONFIG",
            '{"cluster": {"ps": ["h:1"]}, "task": {"type": "worker", "index": -1}}',
            "task index must be an integer >= 0",
        ),
        ("TF_CONFIG", '{"cluster": {"ps": ["nohost"]}}', r"TF_CONFIG cluster\['ps'\]: 'nohost'"),
        ("DMLC_PS_ROOT_PORT", "http", "DMLC_PS_ROOT_PORT='http' is not an integer"),
        ("DMLC_PS_ROOT_PORT", "65535", "runs past port 65535"),
        ("DMLC_NUM_SERVER", "0", "DMLC_NUM_SERVER='0' must be >= 1"),
        ("DMLC_NUM_WORKER", "many", "DMLC_NUM_WORKER='many' is not an integer"),
        ("DMLC_WORKER_ID", "first", "DMLC_WORKER_ID='first' is not an integer"),
        ("DMLC_WORKER_ID", "3", r"rank 3 \(from DMLC_WORKER_ID\) must be in \[0, 3\)"),
        ("RANK", "r0", "RANK='r0' is not an integer"),
        ("WORLD_SIZE", "0", "WORLD_SIZE='0' must be >= 1"),
    ],
)
def test_malformed_values_name_the_variable(variable, value, message):
    if variable.startswith("KVSPARSE_"):
        env = {"KVSPARSE_SERVERS": S2, "KVSPARSE_NUM_WORKERS": "2", "KVSPARSE_RANK": "0"}
    elif variable == "TF_CONFIG":
        env = {}
    elif variable.startswith("DMLC_"):
        env = dmlc(DMLC_WORKER_ID="0")
    else:
        env = {"KVSPARSE_SERVERS": S2, "RANK": "0", "WORLD_SIZE": "2"}
    env[variable] = value
    with pytest.raises(errors.InvalidArgument, match=message):
        from_environment(env)


def test_rank_without_worker_count_is_an_error():
    with pytest.raises(errors.InvalidArgument, match="rank 2 .* not the number of workers"):
        from_environment({"KVSPARSE_SERVERS": S2, "KVSPARSE_RANK": "2"})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"servers": []}, "the server list is empty"),
        ({"servers": "tcp://h:1"}, "servers must be a list"),
        ({"servers": [7000]}, "must be a str"),
        ({"servers": ["h:1"], "rank": 1}, r"rank 1 \(from rank\) must be in \[0, 1\)"),
        ({"servers": ["h:1"], "rank": True}, "rank must be an integer"),
        ({"servers": ["h:1"], "num_workers": 0}, "number of workers must be >= 1"),
        ({"servers": ["h:1"], "timeout": -1}, "timeout must be a positive number"),
        ({"servers": ["h:1"], "timeout": "5"}, "timeout must be a number of seconds"),
        ({"servers": ["h:1"], "staleness": -1}, "staleness must be >= 0"),
    ],
)
def test_cluster_config_validates_explicit_values(kwargs, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        ClusterConfig(**kwargs)


def test_address_helpers():
    assert parse_server_address(" localhost:1 ") == "tcp://localhost:1"
    assert parse_server_address("TCP://h:2") == "tcp://h:2"
    assert format_address("::1", 3) == "tcp://[::1]:3"
    assert parse_server_address(" ipc:///tmp/x ") == "ipc:///tmp/x"
    assert parse_server_address("IPC:///tmp/x") == "ipc:///tmp/x"
    assert ipc_path("ipc:///tmp/x") == "/tmp/x" and ipc_path("tcp://h:1") is None
    with pytest.raises(errors.InvalidArgument, match="unknown scheme 'inproc'"):
        parse_server_address("inproc://x")


# -- server bind addresses ---------------------------------------------------------------


def test_server_bind_address_is_none_for_a_worker():
    assert server_bind_address({}) is None
    assert (
        server_bind_address({"KVSPARSE_SERVERS": S2, "TF_CONFIG": tf_config("worker", 0)}) is None
    )
    assert server_bind_address(dmlc("worker", DMLC_WORKER_ID="0")) is None


def test_server_bind_address_explicit():
    assert server_bind_address({"KVSPARSE_BIND": "tcp://127.0.0.1:0"}) == "tcp://127.0.0.1:0"
    assert server_bind_address({"KVSPARSE_BIND": "tcp://*:7000"}) == "tcp://*:7000"
    assert server_bind_address({"KVSPARSE_BIND": "[::1]:0"}) == "tcp://[::1]:0"
    with pytest.raises(errors.InvalidArgument, match="KVSPARSE_BIND"):
        server_bind_address({"KVSPARSE_BIND": "tcp://*:x"})


def test_server_bind_address_from_kvsparse_servers():
    env = {
        "KVSPARSE_SERVERS": "tcp://127.0.0.1:7000,tcp://ps-1.svc:7001",
        "KVSPARSE_SERVER_ID": "1",
    }
    assert server_bind_address(env) == "tcp://*:7001"
    env["KVSPARSE_SERVER_ID"] = "0"
    assert server_bind_address(env) == "tcp://127.0.0.1:7000"
    env["KVSPARSE_SERVER_ID"] = "2"
    with pytest.raises(
        errors.InvalidArgument, match="KVSPARSE_SERVER_ID=2 but KVSPARSE_SERVERS lists 2"
    ):
        server_bind_address(env)
    with pytest.raises(errors.InvalidArgument, match="KVSPARSE_SERVERS is not"):
        server_bind_address({"KVSPARSE_SERVER_ID": "0"})


def test_server_bind_address_from_tf_config():
    env = {
        "TF_CONFIG": json.dumps(
            {
                "cluster": {"ps": ["localhost:2222", "10.1.2.3:2223"]},
                "task": {"type": "ps", "index": 1},
            }
        )
    }
    assert server_bind_address(env) == "tcp://10.1.2.3:2223"
    assert server_bind_address({"TF_CONFIG": tf_config("ps", 0)}) == "tcp://*:2222"
    env["TF_CONFIG"] = env["TF_CONFIG"].replace('"index": 1', '"index": 0')
    assert server_bind_address(env) == "tcp://127.0.0.1:2222"


def test_server_bind_address_from_dmlc():
    assert server_bind_address(dmlc("server", DMLC_SERVER_ID="1")) == "tcp://10.0.0.5:9002"
    # dmlc-tracker numbers the 3 workers first: task 3 is server 0.
    assert server_bind_address(dmlc("server", DMLC_TASK_ID="3")) == "tcp://10.0.0.5:9001"
    assert server_bind_address(dmlc("server", DMLC_NUM_SERVER="1")) == "tcp://10.0.0.5:9001"
    named = dmlc("server", DMLC_PS_ROOT_URI="scheduler.local", DMLC_SERVER_ID="0")
    assert server_bind_address(named) == "tcp://*:9001"


@pytest.mark.parametrize(
    "extra, message",
    [
        ({}, "needs DMLC_SERVER_ID"),
        ({"DMLC_SERVER_ID": "2"}, r"server id 2 \(from DMLC_SERVER_ID\) must be in \[0, 2\)"),
        ({"DMLC_TASK_ID": "1"}, r"server id -2 \(from DMLC_TASK_ID - DMLC_NUM_WORKER\)"),
        ({"DMLC_SERVER_ID": "zero"}, "DMLC_SERVER_ID='zero' is not an integer"),
        ({"DMLC_SERVER_ID": "0", "DMLC_PS_ROOT_PORT": ""}, "DMLC_PS_ROOT_PORT not set"),
    ],
)
def test_server_bind_address_dmlc_errors(extra, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        server_bind_address(dmlc("server", **extra))


def test_server_bind_address_precedence():
    env = {
        "KVSPARSE_BIND": "tcp://127.0.0.1:5",
        "TF_CONFIG": tf_config("ps", 0),
        **dmlc("server", DMLC_SERVER_ID="0"),
    }
    assert server_bind_address(env) == "tcp://127.0.0.1:5"
    del env["KVSPARSE_BIND"]
    assert server_bind_address(env) == "tcp://*:2222"
    del env["TF_CONFIG"]
    assert server_bind_address(env) == "tcp://10.0.0.5:9001"


def test_monitor_reads_only_the_server_list():
    # A monitor in a worker's environment: the worker's rank and TF task are not its own.
    tf_config = {
        "cluster": {"ps": ["10.0.0.1:2222", "10.0.0.2:2222"], "worker": ["10.0.0.3:2222"]},
        "task": {"type": "worker", "index": 7},  # out of range for one worker: ignored
    }
    found = monitor_config({"TF_CONFIG": json.dumps(tf_config), "RANK": "5"})
    assert found.servers == ["tcp://10.0.0.1:2222", "tcp://10.0.0.2:2222"]
    assert (found.rank, found.num_workers) == (0, 1)
    with pytest.raises(errors.InvalidArgument, match="TF_CONFIG"):
        monitor_config({"TF_CONFIG": "{not json"})
