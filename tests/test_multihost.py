"""Jobs over several hosts: ``kvsparse launch --nnodes N``, hosts as network namespaces.

Every host is a network namespace on a private bridge (tests/netns.py), with
an address of 198.18.0.0/24 that exists nowhere else; each runs its own
``kvsparse launch --nnodes N --node-rank R --rendezvous tcp://198.18.0.1:PORT``.
The workers train marker rows: at step s, worker r pushes a gradient of -1
(SGD, lr 1, zeros) to its own marker id ``s * n + r``, so a marker ends
holding how many times its push was applied: 1 exactly, or the test fails
(0 = lost, 2 = applied twice). Each worker also reports the server
addresses it was given and the servers it shares memory with.

Skipped, saying why, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from conftest import subprocess_env
from netns import SUBNET, Network, unavailable

from kvsparse import config, errors
from kvsparse.cluster.launch import launch

JOB_TIMEOUT = 90.0
# Inside the test's own namespaces nothing else listens: a fixed port cannot collide.
RENDEZVOUS_PORT = 29400
RENDEZVOUS = f"tcp://{SUBNET}.1:{RENDEZVOUS_PORT}"
PID_LINE = re.compile(r"kvsparse launch: (server|worker) (\d+) \(pid (\d+)\)")

MARKER_WORKER = r"""
import json, os, sys, time
import numpy as np
import kvsparse
from kvsparse.initializers import Zeros
from kvsparse.optimizers import SGD

kind, steps, pace = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
kv = kvsparse.create(kind)
rank, n = kv.rank, kv.num_workers
sgd = SGD(learning_rate=1.0)
kv.init("marker", kvsparse.SparseTable(dim=1, initializer=Zeros(), optimizer=sgd))
for step in range(steps):
    kv.push("marker", (np.array([step * n + rank]), np.full((1, 1), -1.0, np.float32)))
    print(f"step {step}", flush=True)
    time.sleep(pace)
kv.barrier()
report = {
    "rank": rank,
    "num_workers": n,
    "servers": os.environ.get("KVSPARSE_SERVERS", "").split(","),
    "peers": [p for p in os.environ.get("KVSPARSE_PEERS", "").split(",") if p],
    "shared": sorted(getattr(getattr(kv, "_backend", None), "shared_servers", ())),
}
if rank == 0:
    rows = kv.row_sparse_pull("marker", row_ids=np.arange(steps * n))
    report["markers"] = rows.ravel().tolist()
    report["rows_per_shard"] = [s["tables"]["marker"]["rows"] for s in kv.stats()["shards"]]
kv.barrier()
print("REPORT " + json.dumps(report), flush=True)
kv.close()
"""


@pytest.fixture
def hosts(request):
    """`hosts(n, rate=None)` makes a Network of n hosts, torn down after the test."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"hosts as network namespaces: {reason}")
    made = []

    def make(count, rate=None):
        network = Network(count, rate=rate)
        made.append(network)
        return network

    yield make
    for network in made:
        network.close()


def host_env(extra=None):
    """subprocess_env without this machine's own SLURM placement, then extra."""
    env = subprocess_env()
    for name in list(env):
        if name.startswith("SLURM_"):
            del env[name]
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


class Node:
    """One host's ``kvsparse launch`` in a namespace, its output in files."""

    def __init__(self, network, index, args, command, tmp_path, env=None):
        self.index = index
        self.out_path = tmp_path / f"node{index}.out"
        self.err_path = tmp_path / f"node{index}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.process = network.popen(
                index,
                [sys.executable, "-m", "kvsparse", "launch", *args, "--", *command],
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=host_env(env),
                cwd=str(tmp_path),
            )

    def wait(self, timeout=JOB_TIMEOUT):
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {self.index} did not end within {timeout} s:\n{self.output()}")

    @property
    def stdout(self):
        return self.out_path.read_text()

    @property
    def stderr(self):
        return self.err_path.read_text()

    def output(self):
        return f"--- node {self.index} stdout\n{self.stdout}\n--- stderr\n{self.stderr}"

    def reports(self):
        return [
            json.loads(line.split("REPORT ", 1)[1])
            for line in self.stdout.splitlines()
            if "REPORT " in line
        ]


def start_job(
    network,
    tmp_path,
    nodes,
    options,
    kind="dist_sparse",
    steps=6,
    pace=0.0,
    env=None,
    placement=None,
):
    """Starts node ranks `nodes`' launchers; placement(rank) gives the placement flags."""
    if placement is None:

        def placement(rank):
            nnodes = str(len(network.hosts))
            return ["--nnodes", nnodes, "--node-rank", str(rank), "--rendezvous", RENDEZVOUS]

    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(MARKER_WORKER))
    command = [sys.executable, str(script), kind, str(steps), str(pace)]
    return [
        Node(
            network,
            rank,
            [*placement(rank), *options],
            command,
            tmp_path,
            env(rank) if callable(env) else env,
        )
        for rank in nodes
    ]


def finish(nodes):
    """Waits for every launcher; checks that none left a server or worker running."""
    codes = [node.wait() for node in nodes]
    output = "\n".join(node.output() for node in nodes)
    for node in nodes:
        for role, index, pid in PID_LINE.findall(node.stderr):
            try:
                alive = psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            assert not alive, f"node {node.index}'s {role} {index} (pid {pid}) still runs\n{output}"
    return codes, output


def check_markers(nodes, num_workers, steps, output):
    reports = [r for node in nodes for r in node.reports()]
    assert sorted(r["rank"] for r in reports) == list(range(num_workers)), output
    markers = next(r["markers"] for r in reports if r["rank"] == 0)
    assert markers == [1.0] * (steps * num_workers), output
    return reports


def host_of(address):
    return address.partition("://")[2].rpartition(":")[0]


@pytest.mark.parametrize("colocated", [False, True], ids=["dist", "colocated"])
def test_two_hosts_train_exact_markers_over_tcp_only(hosts, tmp_path, colocated):
    network = hosts(2)
    options = ["--colocated", "-n", "2"] if colocated else ["-s", "2", "-n", "2"]
    nodes = start_job(network, tmp_path, [0, 1], options, steps=6)
    codes, output = finish(nodes)
    assert codes == [0, 0], output
    reports = check_markers(nodes, 4, 6, output)
    # Node-major: node 0's workers are ranks 0, 1, on host 198.18.0.1; node 1's are 2, 3.
    for node in nodes:
        assert sorted(r["rank"] for r in node.reports()) == [2 * node.index, 2 * node.index + 1]
    shards = reports[0]["peers"] if colocated else reports[0]["servers"]
    assert [host_of(a) for a in shards] == [f"{SUBNET}.1"] * 2 + [f"{SUBNET}.2"] * 2, output
    rank0 = next(r for r in reports if r["rank"] == 0)
    assert all(rows > 0 for rows in rank0["rows_per_shard"]), output
    for report in reports:
        assert report["servers"] == reports[0]["servers"], output
        # No ipc:// path nor loopback address for a peer on another host, and so no shared
        # memory: every shard is reached at its host's bridge address.
        for address in report["servers"] + report["peers"]:
            assert address.startswith(f"tcp://{SUBNET}."), (address, output)
        assert report["shared"] == [], output


def test_launcher_that_never_joins_is_named_within_the_wait(hosts, tmp_path):
    network = hosts(3)
    nodes = start_job(network, tmp_path, [0, 1], ["-s", "1", "-n", "1", "--rendezvous-wait", "4"])
    codes, output = finish(nodes)
    assert codes == [1, 1], output
    for node in nodes:
        assert "node rank 2 did not join the rendezvous" in node.stderr, output
        assert "within 4 s" in node.stderr, output
    assert "REPORT" not in output  # no worker ran


def test_curve_keys_across_hosts(hosts, tmp_path):
    network = hosts(2)
    keys = tmp_path / "keys"
    made = subprocess.run(
        [sys.executable, "-m", "kvsparse", "keys", str(keys)],
        capture_output=True, text=True, env=host_env(), timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    nodes = start_job(network, tmp_path, [0, 1], ["-s", "1", "-n", "1", "--keys", str(keys)])
    codes, output = finish(nodes)
    assert codes == [0, 0], output
    check_markers(nodes, 2, 6, output)
    # A worker on host 1 without the keys is refused by host 0's server (no data either way).
    servers = nodes[0].reports()[0]["servers"]
    probe = (
        "import kvsparse, numpy as np\n"
        "from kvsparse import errors\n"
        "try:\n"
        f"    kvsparse.create('dist_sparse', servers={servers!r}, timeout=3.0)\n"
        "    print('ANSWERED')\n"
        "except errors.ServerUnavailable as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    result = subprocess.run(
        network.command(1, [sys.executable, "-c", probe]),
        capture_output=True, text=True, env=host_env(), timeout=60,
    )  # fmt: skip
    assert "REFUSED" in result.stdout, result.stdout + result.stderr


def test_nodes_with_different_keys_are_refused(hosts, tmp_path):
    network = hosts(2)
    for name in ("keys0", "keys1"):
        subprocess.run(
            [sys.executable, "-m", "kvsparse", "keys", str(tmp_path / name)],
            check=True, capture_output=True, env=host_env(), timeout=60,
        )  # fmt: skip
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(MARKER_WORKER))
    nodes = [
        Node(
            network,
            rank,
            ["--nnodes", "2", "--node-rank", str(rank), "--rendezvous", RENDEZVOUS,
             "--rendezvous-wait", "5", "--keys", str(tmp_path / f"keys{rank}")],
            [sys.executable, str(script), "dist_sparse", "2", "0"],
            tmp_path,
        )
        for rank in (0, 1)
    ]  # fmt: skip
    codes, output = finish(nodes)
    assert codes == [1, 1], output
    assert "differs from node 0 in --keys" in nodes[1].stderr, output
    assert "node rank 1 did not join" in nodes[0].stderr, output


def wait_for_line(node, text, timeout=JOB_TIMEOUT):
    deadline = time.monotonic() + timeout
    while text not in node.stdout:
        if node.process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"never saw {text!r}:\n{node.output()}")
        time.sleep(0.05)


@pytest.mark.parametrize("window", [True, False], ids=["retry-window", "no-window"])
def test_link_cut_for_5_s(hosts, tmp_path, window):
    network = hosts(2)
    options = ["-s", "1", "-n", "1", "--timeout", "2"]
    if window:
        options += ["--retry-window", "30"]
    steps = 80
    nodes = start_job(network, tmp_path, [0, 1], options, kind="dist_async", steps=steps, pace=0.05)
    wait_for_line(nodes[0], "step 10")
    network.cut(1)
    try:
        time.sleep(5.0)
    finally:
        network.restore(1)
    codes, output = finish(nodes)
    server_1 = f"tcp://{SUBNET}.2:"
    if window:
        assert codes == [0, 0], output
        # Nothing lost, nothing applied twice: every marker holds exactly 1.
        check_markers(nodes, 2, steps, output)
    else:
        assert codes[0] != 0 and codes[1] != 0, output
        # Node 0's worker names the server it lost, on the cut host; node 1 hears it stopped.
        assert server_1 in nodes[0].stderr, output
        assert "stopping the job" in nodes[1].stderr, output


@pytest.mark.parametrize("dying", [1, 0], ids=["node-1", "node-0-the-rendezvous"])
def test_launcher_that_dies_is_named_and_the_job_ends_everywhere(hosts, tmp_path, dying):
    network = hosts(2)
    nodes = start_job(network, tmp_path, [0, 1], ["-s", "1", "-n", "1"], steps=400, pace=0.02)
    wait_for_line(nodes[dying], "step 5")
    nodes[dying].process.kill()  # SIGKILL: no goodbye; its children get SIGTERM (die_with_parent)
    other = nodes[1 - dying]
    codes, output = finish(nodes)
    assert codes[1 - dying] == 1, output
    if dying == 1:
        assert f"node 1's launcher ({SUBNET}.2) is gone" in other.stderr, output
    else:
        assert f"the rendezvous at {RENDEZVOUS} (node 0's launcher) closed" in other.stderr, output


def test_placement_from_slurm_variables(hosts, tmp_path):
    network = hosts(2)

    def slurm(rank):
        # The node list's first host is the rendezvous host (here an address, not a name).
        return {
            "SLURM_JOB_ID": "7",
            "SLURM_NNODES": "2",
            "SLURM_NODEID": str(rank),
            "SLURM_JOB_NODELIST": f"{SUBNET}.[1-2]",
        }

    nodes = start_job(
        network,
        tmp_path,
        [0, 1],
        ["-s", "1", "-n", "1"],
        env=slurm,
        placement=lambda rank: ["--rendezvous", f":{RENDEZVOUS_PORT}"],
    )
    codes, output = finish(nodes)
    assert codes == [0, 0], output
    reports = check_markers(nodes, 2, 6, output)
    assert [host_of(a) for a in reports[0]["servers"]] == [f"{SUBNET}.1", f"{SUBNET}.2"]


def test_dmlc_scheduler_address_is_the_rendezvous_servers_on_every_host(hosts, tmp_path):
    network = hosts(2)
    dmlc = {
        "DMLC_PS_ROOT_URI": f"{SUBNET}.1",
        "DMLC_PS_ROOT_PORT": str(RENDEZVOUS_PORT),
        "DMLC_NUM_SERVER": "2",
        "DMLC_NUM_WORKER": "2",
    }
    nodes = start_job(
        network,
        tmp_path,
        [0, 1],
        ["-s", "1", "-n", "1"],
        env=dmlc,
        placement=lambda rank: ["--nnodes", "2", "--node-rank", str(rank)],
    )
    codes, output = finish(nodes)
    assert codes == [0, 0], output
    reports = check_markers(nodes, 2, 6, output)
    # ps-lite's own mapping would put both servers on the root host; these are on both.
    assert [host_of(a) for a in reports[0]["servers"]] == [f"{SUBNET}.1", f"{SUBNET}.2"]


@pytest.mark.parametrize(
    "nodelist, first",
    [("node[01-04,07]", "node01"), ("gpu3,gpu4", "gpu3"), ("a[7]", "a7"), ("solo", "solo")],
)
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert config.first_slurm_host(nodelist) == first


def test_node_placement_sources_and_errors():
    slurm = {"SLURM_NNODES": "4", "SLURM_NODEID": "3", "SLURM_JOB_NODELIST": "n[10-13]"}
    placement = config.node_placement(rendezvous="29400", environ=slurm)
    assert (placement.nnodes, placement.node_rank) == (4, 3)
    assert placement.rendezvous == "tcp://n10:29400"
    # Flags win over the variables.
    placement = config.node_placement(2, 0, "tcp://h:1", environ=slurm)
    assert (placement.nnodes, placement.node_rank, placement.rendezvous) == (2, 0, "tcp://h:1")
    assert config.node_placement(environ={}) is None
    assert config.node_placement(1, environ={}) is None
    with pytest.raises(errors.InvalidArgument, match="--node-rank"):
        config.node_placement(2, rendezvous="tcp://h:1", environ={})
    with pytest.raises(errors.InvalidArgument, match="--rendezvous"):
        config.node_placement(2, 1, environ={})
    with pytest.raises(errors.InvalidArgument, match=r"not in \[0, 2\)"):
        config.node_placement(2, 2, "tcp://h:1", environ={})
    with pytest.raises(errors.InvalidArgument, match="no host"):
        config.node_placement(2, 1, ":29400", environ={})
    with pytest.raises(errors.InvalidArgument, match="SLURM_NODEID"):
        config.node_placement(rendezvous=":1", environ=dict(slurm, SLURM_NODEID="x"))


def test_launch_over_hosts_refuses_ipc(tmp_path):
    with pytest.raises(errors.InvalidArgument, match="ipc"):
        launch([sys.executable, "-c", "pass"], nnodes=2, node_rank=0,
               rendezvous="tcp://127.0.0.1:1", transport="ipc")  # fmt: skip


RESTART_WORKER = r"""
import json, os, sys, time
import numpy as np
import kvsparse
from kvsparse.initializers import Zeros
from kvsparse.optimizers import SGD

steps, markers = int(sys.argv[1]), sys.argv[2]
kv = kvsparse.create("dist_sparse")
rank, n = kv.rank, kv.num_workers
sgd = SGD(learning_rate=1.0)
kv.init("marker", kvsparse.SparseTable(dim=1, initializer=Zeros(), optimizer=sgd))
for step in range(steps):
    kv.push("marker", (np.array([step * n + rank]), np.full((1, 1), -1.0, np.float32)))
kv.barrier()
if rank == 0:
    kv.save()  # into KVSPARSE_CHECKPOINT_DIR: every push is in it
    print("SAVED", flush=True)
while not os.path.exists(os.path.join(markers, "go")):
    time.sleep(0.05)
rows = kv.row_sparse_pull("marker", row_ids=np.arange(steps * n))
print("REPORT " + json.dumps({"rank": rank, "markers": rows.ravel().tolist()}), flush=True)
kv.barrier()
kv.close()
"""


def test_server_restarted_on_another_host_restores_its_own_shard(hosts, tmp_path):
    network = hosts(2)
    script = tmp_path / "restart_worker.py"
    script.write_text(RESTART_WORKER)
    markers = tmp_path / "markers"
    markers.mkdir()
    checkpoints = tmp_path / "checkpoints"  # one directory both hosts see, as on NFS
    options = ["-s", "1", "-n", "1", "--restart-servers", "--retry-window", "60",
               "--checkpoint-dir", str(checkpoints)]  # fmt: skip
    nodes = [
        Node(
            network,
            rank,
            ["--nnodes", "2", "--node-rank", str(rank), "--rendezvous", RENDEZVOUS, *options],
            [sys.executable, str(script), "8", str(markers)],
            tmp_path,
        )
        for rank in (0, 1)
    ]
    wait_for_line(nodes[0], "SAVED")
    listening = re.search(r"server 0 \(pid (\d+)\) listening", nodes[1].stderr)
    assert listening, nodes[1].output()
    os.kill(int(listening.group(1)), signal.SIGKILL)
    deadline = time.monotonic() + JOB_TIMEOUT
    while (restarted := re.search(r"server 0 \(pid (\d+)\) restarted", nodes[1].stderr)) is None:
        assert time.monotonic() < deadline and nodes[1].process.poll() is None, nodes[1].output()
        time.sleep(0.05)
    with open(f"/proc/{restarted.group(1)}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    (markers / "go").touch()
    codes, output = finish(nodes)
    # Node 1's server is shard 1 of 2, not shard 0 of its host's 1.
    assert argv[argv.index("--shard-index") + 1] == "1", argv
    assert argv[argv.index("--num-shards") + 1] == "2", argv
    assert codes == [0, 0], output
    for report in (r for node in nodes for r in node.reports()):
        assert report["markers"] == [1.0] * 16, output


# -- the rendezvous alone, on 127.0.0.1 (no namespaces needed) ---------------------------------


def test_rendezvous_refuses_bad_input_and_goes_on(tmp_path):
    from kvsparse.cluster import rendezvous
    from kvsparse.cluster.launch import free_port

    address = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    lines = []
    server = rendezvous.RendezvousServer(address, 2, 30.0, lines.append)
    try:
        host, port = config.split_tcp_address(address, "test")
        for garbage in (b"not json\n", b"[1, 2]\n", b'{"protocol": 1, "offer": {"x": 1}}\n'):
            with socket.create_connection((host, port), timeout=10) as bad:
                bad.sendall(garbage)
                reply = json.loads(bad.makefile("rb").readline())
                assert "error" in reply, reply
        offers = [
            rendezvous.NodeOffer(r, 2, "127.0.0.1", servers=[f"tcp://127.0.0.1:{7000 + r}"])
            for r in (0, 1)
        ]
        with pytest.raises(errors.NodeUnavailable, match="expects --nnodes 3"):
            rendezvous.join(address, rendezvous.NodeOffer(1, 3, "127.0.0.1"), 10.0)
        result = {}
        thread = threading.Thread(
            target=lambda: result.update(m0=rendezvous.join(address, offers[0], 30))
        )
        thread.start()
        member1 = rendezvous.join(address, offers[1], 30.0)
        thread.join(30)
        member0 = result["m0"]
        assert (
            member0.plan.servers
            == member1.plan.servers
            == [
                "tcp://127.0.0.1:7000",
                "tcp://127.0.0.1:7001",
            ]
        )
        assert (member0.plan.first_rank, member1.plan.first_rank) == (0, 1)
        assert member1.plan.num_workers == 2
        # A launcher that comes after the plan is refused, saying so.
        with pytest.raises(errors.NodeUnavailable, match="after the job was planned"):
            rendezvous.join(address, offers[1], 10.0)
        heard = []
        member0.watch(heard.append)
        member1.finished(3, "worker 1 exited with code 3")
        deadline = time.monotonic() + 10
        while not heard and time.monotonic() < deadline:
            time.sleep(0.05)
        assert heard and "node 1's job ended with code 3" in heard[0]["stop"], heard
        member0.close()
        member1.close()
    finally:
        server.close(1.0)


def test_two_launchers_on_loopback(tmp_path):
    """Where namespaces cannot be made: two launchers of one job on 127.0.0.1 (ports differ)."""
    from kvsparse.cluster.launch import free_port

    rendezvous = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(MARKER_WORKER))
    launchers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvsparse",
                "launch",
                "--nnodes",
                "2",
                "--node-rank",
                str(r),
                "--rendezvous",
                rendezvous,
                "-s",
                "1",
                "-n",
                "1",
                "--",
                sys.executable,
                str(script),
                "dist_sparse",
                "4",
                "0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=host_env(),
            cwd=str(tmp_path),
        )  # fmt: skip
        for r in (0, 1)
    ]
    outputs = [p.communicate(timeout=JOB_TIMEOUT) for p in launchers]
    text = "\n".join(out + err for out, err in outputs)
    assert [p.returncode for p in launchers] == [0, 0], text
    reports = [
        json.loads(line.split("REPORT ", 1)[1]) for line in text.splitlines() if "REPORT " in line
    ]
    rank0 = next(r for r in reports if r["rank"] == 0)
    assert rank0["markers"] == [1.0] * 8, text
    assert all(a.startswith("tcp://127.0.0.1:") for a in rank0["servers"]), text
