"""deploy/k8s: the manifests parse, fit together, and give each pod the configuration
kvsparse.config reads (server_bind_address for servers, from_environment for workers)."""

from __future__ import annotations

import re

import pytest
from conftest import REPO_ROOT

from kvsparse import config

yaml = pytest.importorskip("yaml")

K8S = REPO_ROOT / "deploy" / "k8s"
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"
JOB_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


@pytest.fixture(scope="module")
def objects() -> dict:
    found = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in found, f"{key} defined twice"
            found[key] = doc
    return found


def one(objects: dict, kind: str) -> dict:
    matches = [doc for (k, _), doc in objects.items() if k == kind]
    assert len(matches) == 1, f"expected one {kind}, found {len(matches)}"
    return matches[0]


def pod_environment(objects: dict, container: dict, fields: dict) -> dict:
    """What the kubelet would put in the container's environment (envFrom, then env)."""
    env = {}
    for source in container.get("envFrom", []):
        config_map = objects[("ConfigMap", source["configMapRef"]["name"])]
        env.update({k: str(v) for k, v in config_map["data"].items()})
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        else:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in fields, f"unexpected fieldRef {path}"
            env[entry["name"]] = fields[path]
    return env


def ports(container: dict) -> dict:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_server_pods_bind_their_own_entry_of_the_server_list(objects):
    service = one(objects, "Service")
    sts = one(objects, "StatefulSet")
    spec = sts["spec"]
    assert spec["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = spec["template"]["spec"]["containers"]
    container_ports = ports(container)
    for port in service["spec"]["ports"]:
        assert container_ports[port["targetPort"]] == port["port"]

    servers = None
    for ordinal in range(spec["replicas"]):
        env = pod_environment(objects, container, {POD_INDEX: str(ordinal)})
        assert "KVSPARSE_BIND" not in env
        bind = config.server_bind_address(env)
        assert bind == f"tcp://*:{container_ports['zmq']}"
        servers = config.from_environment({"KVSPARSE_SERVERS": env["KVSPARSE_SERVERS"]}).servers
        name = f"{sts['metadata']['name']}-{ordinal}.{service['metadata']['name']}"
        assert servers[ordinal] == f"tcp://{name}:{container_ports['zmq']}"
    assert len(servers) == spec["replicas"], "KVSPARSE_SERVERS must list every replica"

    command = container["command"] + container.get("args", [])
    assert command[:2] == ["kvsparse", "server"] and "--bind" not in command
    metrics_port = command[command.index("--metrics-port") + 1]
    assert int(metrics_port) == container_ports["metrics"]
    annotations = spec["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == metrics_port


def test_workers_read_the_server_list_rank_and_worker_count(objects):
    sts = one(objects, "StatefulSet")
    job = one(objects, "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    (container,) = spec["template"]["spec"]["containers"]
    (server_container,) = sts["spec"]["template"]["spec"]["containers"]
    server_env = pod_environment(objects, server_container, {POD_INDEX: "0"})
    expected_servers = config.from_environment(
        {"KVSPARSE_SERVERS": server_env["KVSPARSE_SERVERS"]}
    ).servers
    for index in range(spec["completions"]):
        env = pod_environment(objects, container, {JOB_INDEX: str(index)})
        cluster = config.from_environment(env)
        assert cluster.rank == index
        assert cluster.num_workers == spec["completions"]
        assert cluster.servers == expected_servers
        assert cluster.timeout is not None and cluster.timeout > 0


def test_manifests_use_only_documented_names():
    text = "\n".join(p.read_text() for p in K8S.glob("*.yaml"))
    variables = set(re.findall(r"\bKVSPARSE_[A-Z_]+", text))
    source = "".join(p.read_text() for p in (REPO_ROOT / "kvsparse" / "config").glob("*.py"))
    for variable in variables:
        assert f'"{variable}"' in source, f"{variable} is not read by kvsparse.config"
