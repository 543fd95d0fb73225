"""Benchmark W1: row_sparse_pull + push of one Zipf-distributed embedding table, against peers.

Workload W1: 1 worker, 2 servers on loopback; one table of dim 64, float32, Adagrad;
batches of 65,536 ids drawn Zipf(1.1) over 10^8 ids; a step is row_sparse_pull + push of
the batch. The figure of merit is unique rows per second (the batch's distinct ids / step
time). In the same run, side by side:

- numpy:        the in-process NumPy limit: np.take for the pull; np.unique, np.add.at and
                fancy-index Adagrad on a dense array for the push (ids mapped to dense
                indices beforehand, untimed).
- local:        kvsparse.create('local').
- raw_zmq:      the raw transport: the same request and reply bytes over ZeroMQ DEALER ->
                ROUTER sockets to 2 server processes that answer with a preallocated buffer.
- torch_rpc:    a torch.distributed.rpc parameter server, one owner process per shard.
- mxnet_pslite: MXNet 1.9.1's dist_sync KVStore (ps-lite), row_sparse_pull + push.
- dist_sparse:  kvsparse.create('dist_sparse') with 2 `python -m kvsparse.server` processes;
                also the pieces of its step timed alone (client C++ planning, gather, sum;
                server table lookup and Adagrad), and with --profile cProfile of the worker
                and of both servers.
- dist_sparse_unique: the same store fed exactly what the peers get (below).
- dist_sparse_ipc_prefetch: dist_sparse_ipc in the torch adapter's loop: a step's push
                with wait=False and the next batch's pull sent right behind it
                (wait=False), read by the next step; the same pushes and pulls in the same
                order, overlapped with the servers' work. The peers' loops wait for each
                call, so this row is compared with dist_sparse_ipc, not with them.
- dist_sparse_fp16, dist_sparse_bf16: dist_sparse over tcp with
                ``wire_dtype='float16'`` / ``'bfloat16'``: pulled rows and pushed
                gradients travel as 16-bit values; the tables stay float32.
- adapter_*:    W1 through kvsparse's PyTorch / TensorFlow / MXNet adapters
                (benchmarks/peers/adapters.py), each in its own process on 2 fresh servers,
                as a ratio to the same process driving the store with NumPy first.
- dist_sparse_2w, colocated_2w: W1 with 2 workers under BSP, each on its own batches
                (benchmarks/colocated.py's jobs): 2 workers + 2 servers, against 2
                colocated workers hosting a shard each; rows/s per worker (the mean of
                the two), the ratio colocated_2w / dist_sparse_2w, and the share of each
                colocated worker's rows served in process. Their tables use
                colocated.py's settings (the default Uniform initializer, cold).

Peers with fixed-size tables (torch_rpc, mxnet_pslite) get the ids folded into a 2M-row
table (distinct ids -> distinct rows), and get each batch already deduplicated with its
gradient rows summed (outside the timing, as a framework's sparse backward hands them
over); kvsparse is timed from the raw ids and per-position gradient rows.

Each phase runs on fresh batches: warmup steps, then timed steps (pull + push), then pull
only, then push only. Every subprocess is stopped at the end, also on errors and Ctrl-C.

Usage:
    python benchmarks/pull_push.py            # full run (a few minutes on 2 cores)
    python benchmarks/pull_push.py --quick    # a check that all runs: 4 steps, 500k-row fold
    python benchmarks/pull_push.py --systems numpy,local,dist_sparse --steps 50
    python benchmarks/pull_push.py --profile  # also cProfile the dist_sparse steps
    python benchmarks/pull_push.py --warm     # every id stored before the timing
    python benchmarks/pull_push.py --initializer zeros   # default: normal (Normal(0, 0.01))

Writes benchmarks/results/pull_push.json (raw per-batch seconds, rows/s, ratios).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(0, REPO)

import common  # noqa: E402
import procs  # noqa: E402
import raw_zmq  # noqa: E402
import workload as wl  # noqa: E402

import kvsparse  # noqa: E402
from kvsparse import _core  # noqa: E402

NUM_SERVERS = 2
# dist_sparse variants with 16-bit rows on the wire, and their wire_dtype.
WIRE_SYSTEMS = {"dist_sparse_fp16": "float16", "dist_sparse_bf16": "bfloat16"}
FOLD_ROWS = 2_000_000
ALL_SYSTEMS = (
    "numpy",
    "local",
    "raw_zmq",
    "torch_rpc",
    "mxnet_pslite",
    "dist_sparse",
    "dist_sparse_nofast",
    "dist_sparse_ipc",
    "dist_sparse_ipc_socket",
    "dist_sparse_ipc_prefetch",
    "dist_sparse_unique",
    "dist_sparse_fp16",
    "dist_sparse_bf16",
    "adapter_torch",
    "adapter_tensorflow",
    "adapter_mxnet",
    "dist_sparse_2w",
    "colocated_2w",
)
DESCRIPTIONS = {
    "numpy": "in-process NumPy limit (dense array, known indices)",
    "local": "kvsparse local store (in process)",
    "raw_zmq": "raw ZeroMQ transport, same bytes, no table work",
    "torch_rpc": "torch.distributed.rpc parameter server ({fold}-row folded table)",
    "mxnet_pslite": "MXNet 1.9.1 dist_sync ps-lite ({fold}-row folded table)",
    "dist_sparse": "kvsparse dist_sparse, driven with NumPy",
    "dist_sparse_nofast": "dist_sparse, servers with --no-fast-path (all in Python)",
    "dist_sparse_ipc": "dist_sparse with its servers on ipc:// sockets (same host): rows "
    "through the worker's shared memory",
    "dist_sparse_ipc_socket": "dist_sparse_ipc with shared_memory=False (rows on the socket)",
    "dist_sparse_ipc_prefetch": "dist_sparse_ipc, a step's push not waited for and the next "
    "batch's pull sent behind it (the torch adapter's loop)",
    "dist_sparse_unique": "dist_sparse fed the peers' deduplicated ids + summed gradients",
    "dist_sparse_fp16": "dist_sparse, float16 rows and gradients on the wire (tcp)",
    "dist_sparse_bf16": "dist_sparse, bfloat16 rows and gradients on the wire (tcp)",
    "adapter_torch": "kvsparse.adapters.torch.Embedding forward+backward",
    "adapter_tensorflow": "kvsparse.adapters.tensorflow.Embedding forward+backward",
    "adapter_mxnet": "mx.kv.create('dist_sparse') row_sparse_pull + push, row_sparse",
    "dist_sparse_2w": "2 workers (BSP, own batches) + 2 servers; rows/s per worker",
    "colocated_2w": "2 colocated workers, a shard in each; rows/s per worker",
}
SERVER_LINE = r"kvsparse server listening on ((?:tcp|ipc)://\S+)"
RAW_LINE = r"raw zmq server listening on (tcp://\S+)"


# -- in-process systems ----------------------------------------------------------------------


def run_numpy(work: wl.Workload, args) -> dict:
    """The NumPy limit: a dense table indexed by precomputed dense indices."""
    distinct, inverse = np.unique(work.batches, return_inverse=True)
    dense_ids = inverse.reshape(work.batches.shape).astype(np.int64)
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((distinct.size, wl.DIM)) * 0.01).astype(np.float32)
    state_sum = np.zeros_like(table)
    out = np.empty((work.batch_size, wl.DIM), np.float32)
    grads = work.grads

    def pull(b):
        np.take(table, dense_ids[b], axis=0, out=out)

    def push(b):
        unique, inv = np.unique(dense_ids[b], return_inverse=True)
        summed = np.zeros((unique.size, wl.DIM), np.float32)
        np.add.at(summed, inv, grads)
        state = state_sum[unique]
        state += summed * summed
        state_sum[unique] = state
        table[unique] -= wl.LEARNING_RATE * summed / (np.sqrt(state) + wl.EPS)

    return {
        "times": common.run_phases(args.warmup, args.steps, pull, push),
        "table_rows": int(distinct.size),
    }


INITIALIZERS = {
    # Normal(0, 0.01) is what users set for embeddings (and the default here): generating
    # it is the cost of every new row, so a benchmark with Zeros flatters a hash table.
    "normal": lambda: kvsparse.initializers.Normal(0.0, 0.01),
    "uniform": lambda: kvsparse.initializers.Uniform(-0.05, 0.05),
    "zeros": lambda: kvsparse.initializers.Zeros(),
}


def make_table_spec(args):
    return kvsparse.SparseTable(dim=wl.DIM, initializer=INITIALIZERS[args.initializer](), seed=0)


def drive_store(
    kv,
    work: wl.Workload,
    args,
    profile_path: str | None = None,
    unique_inputs: bool = False,
    server_pids: tuple = (),
    prefetch: bool = False,
) -> dict:
    """W1 on a kvsparse store through its NumPy API (row_sparse_pull with out=, push).

    unique_inputs: feed it what the peers get instead (each batch's sorted unique ids and
    the summed gradient rows, prepared untimed; the pull returns one row per unique id).
    prefetch: in the timed steps, push with wait=False and send the next step's pull
    right behind it (wait=False), read by that step; the last step's push waits, so
    every push of the phase is applied within its timing.
    """
    kv.init("embedding", make_table_spec(args))
    kv.set_optimizer(kvsparse.optimizers.Adagrad(learning_rate=wl.LEARNING_RATE, eps=wl.EPS))
    out = np.empty((work.batch_size, wl.DIM), np.float32)
    if args.warm:
        # Every id of the run stored before the timing (a zero gradient leaves Adagrad's
        # rows at their initial values): the peers' fixed-size tables are always warm.
        zeros = np.zeros_like(work.grads)
        for b in range(work.batches.shape[0]):
            kv.push("embedding", (work.batches[b], zeros))
    if unique_inputs:
        prepared = [
            common.presummed(work.batches[b], work.grads)
            for b in range(common.num_batches(args.warmup, args.steps))
        ]

        def pull(b):
            ids = prepared[b][0]
            kv.row_sparse_pull("embedding", out=out[: ids.size], row_ids=ids)

        def push(b):
            kv.push("embedding", prepared[b])

    elif prefetch:
        steps = common.phase_batches(args.warmup, args.steps)["step"]
        ahead: dict = {}

        def pull(b):
            pending = ahead.pop(b, None)
            if pending is None:
                kv.row_sparse_pull("embedding", out=out, row_ids=work.batches[b])
            else:
                pending.wait()

        def push(b):
            overlap = b in steps and b != steps[-1]
            kv.push("embedding", (work.batches[b], work.grads), wait=not overlap)
            if overlap:
                ahead[b + 1] = kv.row_sparse_pull(
                    "embedding", out=out, row_ids=work.batches[b + 1], wait=False
                )

    else:

        def pull(b):
            kv.row_sparse_pull("embedding", out=out, row_ids=work.batches[b])

        def push(b):
            kv.push("embedding", (work.batches[b], work.grads))

    def probe():
        counts = {"client": resource.getrusage(resource.RUSAGE_SELF).ru_minflt}
        if server_pids:
            counts["servers"] = sum(minor_faults(pid) for pid in server_pids)
        return counts

    faults: dict = {}
    profiler = cProfile.Profile() if profile_path else None
    with profiler if profiler else contextlib.nullcontext():
        times = common.run_phases(args.warmup, args.steps, pull, push, probe, faults)
    # Fresh memory costs a page fault per 4 KiB (~3 us on this VM, more when the host
    # reclaimed the page): buffers allocated per request show up here.
    result = {"times": times, "minor_faults_per_batch": faults}
    stats = kv.stats()
    result["rows_stored"] = int(stats["tables"]["embedding"]["rows"])
    if profiler:
        profiler.dump_stats(profile_path)
        result["profile"] = profile_path
    return result


def minor_faults(pid: int) -> int:
    """Minor page faults of a process so far (field 10 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def run_local(work: wl.Workload, args) -> dict:
    with kvsparse.create("local") as kv:
        return drive_store(kv, work, args)


# -- subprocess systems ------------------------------------------------------------------------


def start_kvsparse_servers(
    processes: procs.Processes,
    count: int,
    profile_paths: list | None = None,
    socket_dir: str | None = None,
    extra_args: tuple = (),
) -> tuple[list, list]:
    """Starts `count` servers on free ports; (their addresses, their pids).

    profile_paths: run server i under cProfile writing profile_paths[i] (the servers stop
    cleanly on SIGTERM, so the file is written when they are stopped).
    socket_dir: bind ``ipc://socket_dir/server-i`` instead of a tcp port.
    extra_args: more ``kvsparse server`` flags (``--no-fast-path``).
    """
    servers = []
    for i in range(count):
        bind = f"ipc://{socket_dir}/server-{i}" if socket_dir else "tcp://127.0.0.1:0"
        argv = [sys.executable, "-m", "kvsparse.server", "--bind", bind, *extra_args]
        if profile_paths:
            argv[1:1] = ["-m", "cProfile", "-o", profile_paths[i]]
        servers.append(processes.start(f"kvsparse_server{i}", argv))
    addresses = [processes.wait_for_line(s, SERVER_LINE, timeout=60) for s in servers]
    return addresses, [s.pid for s in servers]


def run_raw_zmq(work: wl.Workload, args, log_dir: str) -> dict:
    """The same bytes as dist_sparse's requests and replies, no table work on either side."""
    with procs.Processes(log_dir) as processes:
        max_bytes = work.batch_size * wl.DIM * 4
        servers = [
            processes.start(
                f"raw_zmq{i}",
                [
                    sys.executable,
                    os.path.join(HERE, "peers", "raw_zmq.py"),
                    "serve",
                    "--max-bytes",
                    str(max_bytes),
                ],
            )
            for i in range(NUM_SERVERS)
        ]
        addresses = [processes.wait_for_line(s, RAW_LINE, timeout=60) for s in servers]
        client = raw_zmq.RawClient(addresses, wl.DIM)
        try:
            # The per-server keys are those dist_sparse sends (unique ids grouped by shard);
            # gradient rows of the same size come from one buffer, without a copy.
            payload = np.zeros((work.batch_size, wl.DIM), np.float32)
            prepared = {}
            for b in range(common.num_batches(args.warmup, args.steps)):
                keys, offsets, _ = _core.plan_batch(work.batches[b], NUM_SERVERS, None)
                per_server = [keys[offsets[s] : offsets[s + 1]] for s in range(NUM_SERVERS)]
                rows = [payload[: k.size] for k in per_server]
                prepared[b] = (per_server, rows)

            def pull(b):
                client.pull(prepared[b][0])

            def push(b):
                client.push(*prepared[b])

            times = common.run_phases(args.warmup, args.steps, pull, push)
        finally:
            client.close()
    return {"times": times}


def run_worker_peer(
    name: str, processes: procs.Processes, argv: list, env: dict, result_path: str, timeout: float
) -> dict:
    worker = processes.start(f"{name}_worker", argv, env=env)
    status = processes.wait(worker, timeout=timeout)
    if status != 0 or not os.path.exists(result_path):
        raise RuntimeError(
            f"{name} worker failed (exit {status}):\n" + processes.log_of(worker)[-3000:]
        )
    with open(result_path) as f:
        result = json.load(f)
    result["worker_log_tail"] = processes.log_of(worker)[-2000:]
    return result


def run_torch_rpc(work_path: str, args, log_dir: str) -> dict:
    port = procs.free_port()
    world = NUM_SERVERS + 1
    result_path = os.path.join(log_dir, "torch_rpc.json")
    base = [
        sys.executable,
        os.path.join(HERE, "peers", "torch_rpc.py"),
        "--world-size",
        str(world),
        "--port",
        str(port),
        "--threads",
        str(args.torch_threads),
    ]
    with procs.Processes(log_dir) as processes:
        for rank in range(1, world):
            processes.start(
                f"torch_rpc_owner{rank}", base + ["--rank", str(rank)], env=procs.child_env()
            )
        argv = base + [
            "--rank",
            "0",
            "--workload",
            work_path,
            "--result",
            result_path,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ]
        return run_worker_peer(
            "torch_rpc", processes, argv, procs.child_env(), result_path, args.peer_timeout
        )


def run_mxnet_pslite(work_path: str, args, log_dir: str) -> dict:
    result_path = os.path.join(log_dir, "mxnet_pslite.json")
    script = os.path.join(HERE, "peers", "mxnet_pslite.py")
    dmlc = {
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": str(procs.free_port()),
        "DMLC_NODE_HOST": "127.0.0.1",
        "DMLC_NUM_SERVER": str(NUM_SERVERS),
        "DMLC_NUM_WORKER": "1",
        "OMP_NUM_THREADS": str(args.mxnet_threads),
    }

    def env(role):
        # PORT would become ps-lite's own port: it is dropped from these processes only.
        return procs.child_env({**dmlc, "DMLC_ROLE": role}, drop=("PORT",))

    with procs.Processes(log_dir) as processes:
        processes.start("mxnet_scheduler", [sys.executable, script], env=env("scheduler"))
        for i in range(NUM_SERVERS):
            processes.start(f"mxnet_server{i}", [sys.executable, script], env=env("server"))
        argv = [
            sys.executable,
            script,
            "--workload",
            work_path,
            "--result",
            result_path,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ]
        return run_worker_peer(
            "mxnet_pslite", processes, argv, env("worker"), result_path, args.peer_timeout
        )


def run_dist_sparse_unique(work: wl.Workload, args, log_dir: str) -> dict:
    """dist_sparse on the peers' inputs: deduplicated ids, summed gradients (untimed)."""
    with procs.Processes(log_dir) as processes:
        addresses, pids = start_kvsparse_servers(processes, NUM_SERVERS)
        with kvsparse.create("dist_sparse", servers=addresses, rank=0, num_workers=1) as kv:
            return drive_store(kv, work, args, unique_inputs=True, server_pids=pids)


def run_dist_sparse_nofast(work: wl.Workload, args, log_dir: str) -> dict:
    """dist_sparse with servers that serve every request in Python (no C++ fast path)."""
    with procs.Processes(log_dir) as processes:
        addresses, pids = start_kvsparse_servers(
            processes, NUM_SERVERS, extra_args=("--no-fast-path",)
        )
        with kvsparse.create("dist_sparse", servers=addresses, rank=0, num_workers=1) as kv:
            return drive_store(kv, work, args, server_pids=pids)


def run_dist_sparse_ipc(
    work: wl.Workload,
    args,
    log_dir: str,
    shared_memory: bool | None = None,
    prefetch: bool = False,
) -> dict:
    """dist_sparse with its servers bound on ipc:// sockets (the same-host fast path):
    rows through the worker's shared memory (shared_memory=None, the default for ipc
    servers), or on the sockets (False); prefetch: `drive_store`'s."""
    socket_dir = tempfile.mkdtemp(prefix="kvs", dir="/tmp")  # short: a socket path <= 107 B
    try:
        with procs.Processes(log_dir) as processes:
            addresses, pids = start_kvsparse_servers(processes, NUM_SERVERS, socket_dir=socket_dir)
            store = kvsparse.create(
                "dist_sparse",
                servers=addresses,
                rank=0,
                num_workers=1,
                shared_memory=shared_memory,
            )
            with store as kv:
                return drive_store(kv, work, args, server_pids=pids, prefetch=prefetch)
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)


def run_dist_sparse_wire(work: wl.Workload, args, log_dir: str, wire_dtype: str) -> dict:
    """dist_sparse over tcp, its pulled rows and pushed gradients as 16-bit wire_dtype values."""
    with procs.Processes(log_dir) as processes:
        addresses, pids = start_kvsparse_servers(processes, NUM_SERVERS)
        store = kvsparse.create(
            "dist_sparse", servers=addresses, rank=0, num_workers=1, wire_dtype=wire_dtype
        )
        with store as kv:
            return drive_store(kv, work, args, server_pids=pids)


def run_dist_sparse(work: wl.Workload, args, log_dir: str) -> dict:
    server_profiles = []
    if args.profile:
        server_profiles = [os.path.join(log_dir, f"server{i}.prof") for i in range(NUM_SERVERS)]
    with procs.Processes(log_dir) as processes:
        addresses, pids = start_kvsparse_servers(processes, NUM_SERVERS, server_profiles)
        with kvsparse.create("dist_sparse", servers=addresses, rank=0, num_workers=1) as kv:
            profile = os.path.join(log_dir, "dist_sparse.prof") if args.profile else None
            result = drive_store(kv, work, args, profile, server_pids=pids)
    for index, path in enumerate(server_profiles):
        if os.path.exists(path):
            result[f"server{index}_profile_top"] = profile_text(path)
    result["breakdown_ms"] = breakdown(work, args)
    return result


def breakdown(work: wl.Workload, args) -> dict:
    """Median ms per batch of each piece of a dist_sparse step, timed alone in this process.

    Client: plan_batch (unique + group by shard), gather of the replies into the batch x 64
    output, sum_rows of duplicate gradients and the NaN/inf check. Servers: table lookup
    and Adagrad apply of each shard's keys, both shards added up (in the real run they run
    in parallel, one process each). Outputs go to reused buffers: this is the compute, not
    the page faults of fresh buffers (see minor_faults_per_batch of the real run). What a
    dist_sparse phase takes beyond these and the raw transport is Python per request, the
    wait for the other processes, and allocating and copying the messages.
    """
    spec = make_table_spec(args).to_dict()
    optimizer = kvsparse.optimizers.Adagrad(learning_rate=wl.LEARNING_RATE, eps=wl.EPS)
    tables = [
        _core.Table(wl.DIM, spec["initializer"], optimizer.to_dict(), spec["seed"])
        for _ in range(NUM_SERVERS)
    ]
    out = np.empty((work.batch_size, wl.DIM), np.float32)
    reply_rows = np.empty((work.batch_size, wl.DIM), np.float32)
    summed_rows = np.empty((work.batch_size, wl.DIM), np.float32)
    plan = common.phase_batches(args.warmup, args.steps)
    pieces: dict[str, list] = {}

    def timed(name, fn, *a):
        start = time.perf_counter()
        value = fn(*a)
        pieces.setdefault(name, []).append(time.perf_counter() - start)
        return value

    for b in list(plan["warmup"]) + list(plan["step"]):
        ids = work.batches[b]
        keys, offsets, slot = timed(
            "client: plan_batch (pull)", _core.plan_batch, ids, NUM_SERVERS, None
        )
        bounds = [(offsets[s], offsets[s + 1]) for s in range(NUM_SERVERS)]
        start = time.perf_counter()
        rows = [table.lookup(keys[a:z], reply_rows[a:z]) for table, (a, z) in zip(tables, bounds)]
        pieces.setdefault("servers: lookup", []).append(time.perf_counter() - start)
        timed(
            "client: gather into batch x 64 out", _core.gather_from_shards, rows, offsets, slot, out
        )
        keys, offsets, slot = timed(
            "client: plan_batch (push)", _core.plan_batch, ids, NUM_SERVERS, None
        )
        summed = timed(
            "client: sum_rows",
            _core.sum_rows,
            work.grads,
            slot,
            keys.size,
            summed_rows[: keys.size],
        )
        timed("client: NaN/inf check", _core.first_nonfinite_row, summed)
        start = time.perf_counter()
        for table, (a, z) in zip(tables, bounds):
            _core.first_nonfinite_row(summed[a:z])  # the server checks again
            table.apply_gradients(keys[a:z], summed[a:z])
        pieces.setdefault("servers: check + Adagrad apply", []).append(time.perf_counter() - start)
    skip = len(plan["warmup"])
    return {name: float(np.median(values[skip:])) * 1e3 for name, values in pieces.items()}


def run_adapter(framework: str, work_path: str, args, log_dir: str) -> dict:
    """W1 through one adapter and through NumPy, in one process on 2 fresh servers."""
    module = os.path.join(REPO, "adapters", f"{framework}.py")
    if not os.path.exists(module):
        return {"status": "skipped", "reason": f"{os.path.relpath(module, REPO)} does not exist"}
    result_path = os.path.join(log_dir, f"adapter_{framework}.json")
    with procs.Processes(log_dir) as processes:
        addresses, _ = start_kvsparse_servers(processes, NUM_SERVERS)
        env = procs.child_env(
            {
                "KVSPARSE_SERVERS": ",".join(addresses),
                "KVSPARSE_RANK": "0",
                "KVSPARSE_NUM_WORKERS": "1",
                "OMP_NUM_THREADS": "1",
                "TF_CPP_MIN_LOG_LEVEL": "2",
            },
            drop=("PORT", "DMLC_ROLE"),
        )
        argv = [
            sys.executable,
            os.path.join(HERE, "peers", "adapters.py"),
            "--framework",
            framework,
            "--workload",
            work_path,
            "--result",
            result_path,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ]
        return run_worker_peer(
            f"adapter_{framework}", processes, argv, env, result_path, args.peer_timeout
        )


# -- report -------------------------------------------------------------------------------------

RATIOS = (
    # (name, numerator system, numerator phase, denominator system, denominator phase, target)
    ("dist_sparse / mxnet_pslite", "dist_sparse", "step", "mxnet_pslite", "step", 3.0),
    ("dist_sparse / torch_rpc", "dist_sparse", "step", "torch_rpc", "step", 10.0),
    ("dist_sparse pull / raw_zmq pull", "dist_sparse", "pull", "raw_zmq", "pull", 0.7),
    ("dist_sparse push / raw_zmq push", "dist_sparse", "push", "raw_zmq", "push", None),
    ("dist_sparse / raw_zmq", "dist_sparse", "step", "raw_zmq", "step", None),
    ("dist_sparse_ipc / mxnet_pslite", "dist_sparse_ipc", "step", "mxnet_pslite", "step", 5.0),
    ("dist_sparse_ipc / dist_sparse", "dist_sparse_ipc", "step", "dist_sparse", "step", None),
    (
        "dist_sparse_ipc / dist_sparse_ipc_socket",
        "dist_sparse_ipc",
        "step",
        "dist_sparse_ipc_socket",
        "step",
        None,
    ),
    ("dist_sparse_ipc / raw_zmq", "dist_sparse_ipc", "step", "raw_zmq", "step", None),
    (
        "dist_sparse_ipc_prefetch / dist_sparse_ipc",
        "dist_sparse_ipc_prefetch",
        "step",
        "dist_sparse_ipc",
        "step",
        None,
    ),
    ("dist_sparse / dist_sparse_nofast", "dist_sparse", "step", "dist_sparse_nofast", "step", None),
    ("fast push / nofast push", "dist_sparse", "push", "dist_sparse_nofast", "push", None),
    ("dist_sparse_fp16 / mxnet_pslite", "dist_sparse_fp16", "step", "mxnet_pslite", "step", 5.0),
    ("dist_sparse_fp16 / dist_sparse", "dist_sparse_fp16", "step", "dist_sparse", "step", None),
    ("dist_sparse_fp16 / raw_zmq", "dist_sparse_fp16", "step", "raw_zmq", "step", None),
    ("dist_sparse_bf16 / mxnet_pslite", "dist_sparse_bf16", "step", "mxnet_pslite", "step", None),
    ("dist_sparse_bf16 / dist_sparse", "dist_sparse_bf16", "step", "dist_sparse", "step", None),
    (
        "dist_sparse_unique pull / raw_zmq pull",
        "dist_sparse_unique",
        "pull",
        "raw_zmq",
        "pull",
        None,
    ),
    ("dist_sparse / numpy", "dist_sparse", "step", "numpy", "step", None),
    ("colocated_2w / dist_sparse_2w", "colocated_2w", "step", "dist_sparse_2w", "step", None),
    (
        "colocated_2w pull / dist_sparse_2w pull",
        "colocated_2w",
        "pull",
        "dist_sparse_2w",
        "pull",
        None,
    ),
    (
        "colocated_2w push / dist_sparse_2w push",
        "colocated_2w",
        "push",
        "dist_sparse_2w",
        "push",
        None,
    ),
    ("local / numpy", "local", "step", "numpy", "step", None),
    (
        "dist_sparse_unique / mxnet_pslite",
        "dist_sparse_unique",
        "step",
        "mxnet_pslite",
        "step",
        None,
    ),
    ("dist_sparse_unique / torch_rpc", "dist_sparse_unique", "step", "torch_rpc", "step", None),
    ("dist_sparse pull / mxnet_pslite pull", "dist_sparse", "pull", "mxnet_pslite", "pull", None),
    ("dist_sparse push / mxnet_pslite push", "dist_sparse", "push", "mxnet_pslite", "push", None),
    ("dist_sparse pull / torch_rpc pull", "dist_sparse", "pull", "torch_rpc", "pull", None),
    ("dist_sparse push / torch_rpc push", "dist_sparse", "push", "torch_rpc", "push", None),
    # Each adapter process also drives the same servers with NumPy: "<row>:baseline".
    (
        "adapter_torch / NumPy-driven",
        "adapter_torch",
        "step",
        "adapter_torch:baseline",
        "step",
        0.9,
    ),
    (
        "adapter_torch pull / NumPy-driven pull",
        "adapter_torch",
        "pull",
        "adapter_torch:baseline",
        "pull",
        None,
    ),
    (
        "adapter_tensorflow / NumPy-driven",
        "adapter_tensorflow",
        "step",
        "adapter_tensorflow:baseline",
        "step",
        0.9,
    ),
    (
        "adapter_tensorflow pull / NumPy-driven pull",
        "adapter_tensorflow",
        "pull",
        "adapter_tensorflow:baseline",
        "pull",
        None,
    ),
    (
        "adapter_mxnet / NumPy-driven",
        "adapter_mxnet",
        "step",
        "adapter_mxnet:baseline",
        "step",
        0.9,
    ),
    (
        "adapter_mxnet pull / NumPy-driven pull",
        "adapter_mxnet",
        "pull",
        "adapter_mxnet:baseline",
        "pull",
        None,
    ),
)


def summarize(times: dict, unique: np.ndarray, args) -> dict:
    plan = common.phase_batches(args.warmup, args.steps)
    summary = {}
    for phase in (p for p in common.PHASES if p in times):
        seconds = np.asarray(times[phase], np.float64)
        rows = int(unique[list(plan[phase])].sum())
        summary[phase] = {
            "unique_rows_per_s": rows / float(seconds.sum()),
            # Robust to the odd stall when other work shares the machine.
            "unique_rows_per_s_p50": rows / seconds.size / float(np.median(seconds)),
            "ms_p50": float(np.median(seconds)) * 1e3,
            "ms_mean": float(seconds.mean()) * 1e3,
            "ms_min": float(seconds.min()) * 1e3,
            "unique_rows": rows,
        }
    return summary


def _rows_per_s(systems: dict, name: str, phase: str, field: str) -> float | None:
    system, _, part = name.partition(":")
    summary = systems.get(system, {}).get("baseline_summary" if part else "summary", {})
    return summary.get(phase, {}).get(field)


def ratios(systems: dict) -> dict:
    found = {}
    for name, num, num_phase, den, den_phase, target in RATIOS:
        values = []
        for field in ("unique_rows_per_s", "unique_rows_per_s_p50"):
            numerator = _rows_per_s(systems, num, num_phase, field)
            denominator = _rows_per_s(systems, den, den_phase, field)
            if numerator is not None and denominator is not None:
                values.append(numerator / denominator)
        if not values:
            continue
        value = values[0]
        found[name] = {
            "value": value,
            "value_p50": values[-1],
            "target": target,
            "met": None if target is None else bool(value >= target),
        }
    return found


def print_table(systems: dict, found: dict, out=sys.stdout) -> None:
    print(file=out)
    header = (
        f"{'system':<30}{'step rows/s':>13}{'step ms':>9}{'pull rows/s':>13}"
        f"{'pull ms':>9}{'push rows/s':>13}{'push ms':>9}  description"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for name, entry in systems.items():
        if "summary" not in entry:
            print(
                f"{name:<30}{'(' + entry.get('status', 'failed') + ')':>13}  "
                f"{entry.get('reason', '')[:200]}",
                file=out,
            )
            continue
        rows = [(name, entry["summary"], entry["description"])]
        if "baseline_summary" in entry:
            rows.append(
                (
                    f"  {name}:baseline",
                    entry["baseline_summary"],
                    "dist_sparse driven with NumPy in the same process",
                )
            )
        for label, summary, description in rows:
            cells = "".join(
                f"{summary[p]['unique_rows_per_s']:>13,.0f}{summary[p]['ms_p50']:>9.1f}"
                if p in summary
                else f"{'-':>13}{'-':>9}"
                for p in common.PHASES
            )
            print(f"{label:<30}{cells}  {description}", file=out)
    print(
        "(rows/s: the batches' unique rows / total time; ms: median per batch; ratios of "
        "rows/s, and in brackets of median-based rows/s)",
        file=out,
    )
    print(file=out)
    for name, r in found.items():
        target = (
            ""
            if r["target"] is None
            else (f"  target >= {r['target']:g}: {'met' if r['met'] else 'NOT met'}")
        )
        print(f"{name:<44}{r['value']:>#7.3g}x  (p50 {r['value_p50']:#.3g}x){target}", file=out)


def machine() -> dict:
    import zmq

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "numpy": np.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "kvsparse": kvsparse.__version__,
    }
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), ""
            )
    return info


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="W1: row_sparse_pull + push of a Zipf(1.1) table, kvsparse against peers."
    )
    parser.add_argument("--steps", type=int, default=30, help="timed batches per phase")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=65536)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="few steps (a check that everything runs, under a minute)",
    )
    parser.add_argument(
        "--systems",
        default=",".join(ALL_SYSTEMS),
        help=f"comma-separated subset of {','.join(ALL_SYSTEMS)}",
    )
    parser.add_argument(
        "--fold-rows",
        type=int,
        default=FOLD_ROWS,
        help="row count of the fixed-size tables of torch_rpc and mxnet_pslite",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--initializer",
        choices=sorted(INITIALIZERS),
        default="normal",
        help="kvsparse table initializer (default: Normal(0, 0.01), what users set)",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="store every id of the run in the kvsparse tables before the timing "
        "(the peers' fixed-size tables are always warm)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every system this many times (round-robin) and keep each one's best "
        "round: use 2-3 on a machine that other work shares",
    )
    parser.add_argument(
        "--peer-timeout",
        type=float,
        default=240,
        help="seconds a peer's worker may run before it is stopped",
    )
    # Defaults: the faster setting of each peer on this 2-core machine (MXNet's server-side
    # AdaGrad gains from a second OpenMP thread; torch RPC loses with it).
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="torch threads of the torch_rpc processes"
    )
    parser.add_argument(
        "--mxnet-threads", type=int, default=2, help="OMP_NUM_THREADS of the ps-lite processes"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the dist_sparse worker and print where the time goes",
    )
    parser.add_argument("--output", default=os.path.join(HERE, "results", "pull_push.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = min(args.steps, 4), min(args.warmup, 1)
        if args.fold_rows == FOLD_ROWS:
            # Initializing ps-lite's materialized table dominates a quick run; 13 batches
            # hold ~220k distinct ids, which a 500k-row table still keeps apart.
            args.fold_rows = 500_000
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(ALL_SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {list(ALL_SYSTEMS)}")
    if args.steps < 1 or args.warmup < 0 or args.batch_size < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1, --warmup >= 0, --batch-size >= 1")
    return args


# W1 with 2 workers: benchmarks/colocated.py's jobs, each worker on its own batches (worker
# r takes batches r, r + 2, ...) of a workload twice as long as the others'.
TWO_WORKER_SYSTEMS = {"dist_sparse_2w": "dist_sparse", "colocated_2w": "colocated"}


def run_two_workers(name: str, args, log_dir: str) -> dict:
    """W1 with 2 workers, colocated or + 2 servers: mean per-worker summary, in-process share."""
    import colocated

    path = os.path.join(log_dir, "workload-2w.npz")
    if not os.path.exists(path):  # one workload for both systems and every round
        count = colocated.NUM_WORKERS * common.num_batches(args.warmup, args.steps)
        wl.make(count, args.batch_size, 2, seed=args.seed).save(path)
    options = argparse.Namespace(steps=args.steps, warmup=args.warmup, timeout=args.peer_timeout)
    results = colocated.run_job(TWO_WORKER_SYSTEMS[name], path, options, log_dir)
    per_worker = [summarize(r["times"], np.array(r["unique"]), args) for r in results]
    summary = {
        phase: {
            field: float(np.mean([w[phase][field] for w in per_worker]))
            for field in per_worker[0][phase]
        }
        for phase in per_worker[0]
    }
    result = {"summary": summary, "per_worker_summary": per_worker, "workers": len(results)}
    if all(r.get("rows_total") for r in results):
        result["in_process_share"] = [r["rows_in_process"] / r["rows_total"] for r in results]
    return result


def run_system(name: str, work: wl.Workload, work_path: str, args, log_dir: str) -> dict:
    if name == "numpy":
        return run_numpy(work, args)
    if name == "local":
        return run_local(work, args)
    if name == "raw_zmq":
        return run_raw_zmq(work, args, log_dir)
    if name == "torch_rpc":
        return run_torch_rpc(work_path, args, log_dir)
    if name == "mxnet_pslite":
        return run_mxnet_pslite(work_path, args, log_dir)
    if name == "dist_sparse":
        return run_dist_sparse(work, args, log_dir)
    if name == "dist_sparse_unique":
        return run_dist_sparse_unique(work, args, log_dir)
    if name == "dist_sparse_ipc":
        return run_dist_sparse_ipc(work, args, log_dir)
    if name == "dist_sparse_ipc_socket":
        return run_dist_sparse_ipc(work, args, log_dir, shared_memory=False)
    if name == "dist_sparse_ipc_prefetch":
        return run_dist_sparse_ipc(work, args, log_dir, prefetch=True)
    if name == "dist_sparse_nofast":
        return run_dist_sparse_nofast(work, args, log_dir)
    if name in WIRE_SYSTEMS:
        return run_dist_sparse_wire(work, args, log_dir, WIRE_SYSTEMS[name])
    if name in TWO_WORKER_SYSTEMS:
        return run_two_workers(name, args, log_dir)
    if name.startswith("adapter_"):
        return run_adapter(name[len("adapter_") :], work_path, args, log_dir)
    raise ValueError(name)


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every `with procs.Processes` stops its subprocesses.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    count = common.num_batches(args.warmup, args.steps)
    work = wl.make(count, args.batch_size, args.fold_rows, seed=args.seed)
    unique = work.unique_counts()
    print(
        f"W1: {count} batches of {args.batch_size:,} ids, Zipf(1.1) over 10^8, dim {wl.DIM}, "
        f"Adagrad; mean {unique.mean():,.0f} unique ids per batch; {NUM_SERVERS} servers; "
        f"{args.warmup} warmup + {args.steps} steps per phase"
    )
    print(
        f"torch_rpc and mxnet_pslite: ids folded into a {args.fold_rows:,}-row table "
        + ("(with collisions)" if work.fold_collisions else "(distinct ids keep distinct rows)")
        + "; batches handed to them deduplicated with summed gradients (untimed)"
    )
    systems: dict = {}
    rounds: dict = {name: [] for name in args.systems}
    with tempfile.TemporaryDirectory(prefix="kvsparse_bench_") as log_dir:
        work_path = os.path.join(log_dir, "workload.npz")
        work.save(work_path)
        for round_index in range(args.rounds):
            for name in args.systems:
                if systems.get(name, {}).get("status") in ("failed", "skipped"):
                    continue
                label = f" round {round_index + 1}/{args.rounds}" if args.rounds > 1 else ""
                result = run_and_report(name, label, work, work_path, unique, args, log_dir)
                if "summary" in result:
                    rounds[name].append(result["summary"]["step"]["unique_rows_per_s"])
                best = systems.get(name)
                if (
                    best is None
                    or "summary" not in best
                    or (
                        "summary" in result
                        and result["summary"]["step"]["unique_rows_per_s"]
                        > best["summary"]["step"]["unique_rows_per_s"]
                    )
                ):
                    systems[name] = result
        for name, values in rounds.items():
            if name in systems and len(values) > 1:
                # The best round is kept: other work on this machine only ever slows a round.
                systems[name]["step_rows_per_s_of_each_round"] = values
    found = ratios(systems)
    print_table(systems, found)
    report = {
        "benchmark": "W1 pull_push",
        "command": " ".join([os.path.relpath(__file__, REPO)] + (argv or sys.argv[1:])),
        "workload": {
            "batch_size": args.batch_size,
            "warmup": args.warmup,
            "steps": args.steps,
            "id_space": wl.ID_SPACE,
            "zipf_exponent": 1.1,
            "dim": wl.DIM,
            "optimizer": "adagrad",
            "learning_rate": wl.LEARNING_RATE,
            "servers": NUM_SERVERS,
            "workers": 1,
            "seed": args.seed,
            "initializer": args.initializer,
            "warm": args.warm,
            "unique_per_batch": unique.tolist(),
            "fold_rows": args.fold_rows,
            "fold_collisions": work.fold_collisions,
            "rounds": args.rounds,
            "torch_threads": args.torch_threads,
            "mxnet_threads": args.mxnet_threads,
        },
        "notes": [
            "rows/s = the phase's batches' unique ids / the phase's total seconds",
            f"torch_rpc and mxnet_pslite use ids folded into a {args.fold_rows}-row table "
            "(distinct ids -> distinct rows unless fold_collisions) and get batches "
            "deduplicated with summed gradients, prepared outside the timing",
            "kvsparse systems and numpy are timed from raw ids and per-position gradients, "
            "and their pulls return one row per position (batch x 64); dist_sparse_unique "
            "is kvsparse fed the peers' inputs",
            "adapter rows: ratio to the same process driving the same servers with NumPy "
            "(<row>:baseline); the MXNet adapter and its baseline use the peers' inputs",
            "with rounds > 1 each system keeps its best round (step rows/s)",
        ],
        "machine": machine(),
        "total_s": time.monotonic() - started,
        "systems": systems,
        "ratios": found,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {os.path.relpath(args.output)} in {report['total_s']:.0f} s total")
    return 0


def profile_text(path: str, top: int = 25) -> str:
    stream = io.StringIO()
    stats = pstats.Stats(path, stream=stream)
    stats.sort_stats("tottime").print_stats(top)
    return stream.getvalue()


def run_and_report(name: str, label: str, work, work_path: str, unique, args, log_dir: str) -> dict:
    """Runs one system once and prints its line; a failure is returned, not raised."""
    begin = time.monotonic()
    load = os.getloadavg()
    print(f"running {name}{label} (load average {load[0]:.2f}) ...", flush=True)
    try:
        result = run_system(name, work, work_path, args, log_dir)
    except Exception as exc:  # a failing peer is reported, the others still run
        reason = f"{type(exc).__name__}: {exc}"
        print(f"  {name} failed: {reason[:2000]}", flush=True)
        return {"status": "failed", "reason": reason, "traceback": traceback.format_exc()}
    if result.get("status") == "skipped":
        print(f"  {name} skipped: {result['reason']}", flush=True)
        return result
    if "summary" not in result:  # the 2-worker systems summarize their workers themselves
        result["summary"] = summarize(result["times"], unique, args)
    if "baseline_times" in result:
        result["baseline_summary"] = summarize(result["baseline_times"], unique, args)
    result["description"] = DESCRIPTIONS[name].format(fold=f"{args.fold_rows:,}")
    result["wall_s"] = time.monotonic() - begin
    # Other work on the machine skews every figure: the loads say how quiet it was.
    result["load_average_before"] = load[0]
    result["load_average_after"] = os.getloadavg()[0]
    s = result["summary"]
    if "in_process_share" in result:
        shares = ", ".join(f"{share:.1%}" for share in result["in_process_share"])
        print(f"  rows served in process, per worker: {shares}", flush=True)
    phases = ", ".join(f"{p} {s[p]['ms_p50']:.1f} ms" for p in ("pull", "push") if p in s)
    print(
        f"  {s['step']['unique_rows_per_s']:,.0f} unique rows/s per step "
        f"({s['step']['ms_p50']:.1f} ms; {phases}) in {result['wall_s']:.0f} s",
        flush=True,
    )
    if result.get("profile"):
        report_profile(result)
        del result["profile"]  # the file lives in the temporary folder
    faults = result.get("minor_faults_per_batch", {}).get("step")
    if faults:
        text = ", ".join(f"{k} {v:,.0f}" for k, v in faults.items())
        print(f"  minor page faults per step: {text}")
    if result.get("breakdown_ms"):
        print("  pieces of a dist_sparse step timed alone (median ms per batch):")
        for piece, ms in result["breakdown_ms"].items():
            print(f"    {piece:<40}{ms:>8.2f}")
    return result


def report_profile(result: dict) -> None:
    result["profile_top"] = profile_text(result["profile"])
    print("worker profile (dist_sparse phases):")
    print(result["profile_top"])
    for index in range(NUM_SERVERS):
        if f"server{index}_profile_top" in result:
            print(f"server {index} profile (whole life):")
            print(result[f"server{index}_profile_top"])


if __name__ == "__main__":
    sys.exit(main())
