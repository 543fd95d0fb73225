"""End to end: the torch MovieLens-100k DeepFM's training examples/s, kvsparse against plain torch.

The model is the one of examples/movielens_torch.py (its `DeepFM`, imported from there): a
first-order weight (Zeros) and a 16-wide vector (Normal(0, 0.01), seed 1) per hashed feature
id over the nine fields, FM interactions plus an MLP. Sparse tables train by Adagrad
(lr 0.05), the dense part by Adam (lr 1e-3); batch 512, 3 epochs, one worker. In the same
run, side by side:

- plain_torch:  the same module with both tables as ``nn.Embedding(sparse=True)`` and
                ``torch.optim.Adagrad`` (torch's sparse Adagrad: the same formula) in one
                process. The hashed ids are mapped to rows of a vocabulary (train and
                held-out ids) before timing, as a torch pipeline would; the tables start
                from the very rows kvsparse's initializers give those ids, so all three
                systems start from the same model.
- local:        kvsparse.create('local') through kvsparse.adapters.torch, driven as the
                example drives it (prefetch of the next batch, DenseGradientSync).
- dist_sparse:  kvsparse.create('dist_sparse'), 1 worker (this process) + 2 real
                `python -m kvsparse.server` processes on 127.0.0.1, driven the same way:
                both tables' pushes in one request per server (`push_together`), and
                their prefetch too (`prefetch_together`).
                The pushes are sent without waiting for the servers' acknowledgements
                (``push_together(kv, wait=False)``): the next prefetch collects them.
- dist_sparse_ipc: dist_sparse with the servers on ipc:// sockets (what `kvsparse launch`
                gives on one host): rows through the worker's shared memory.
- dist_sparse_push_wait: the same, but each push waits for its acknowledgements in the
                training thread (``push_together(kv)``, the loop before ``wait=False``).
- dist_sparse_per_table: the same, one push and one prefetch per table (the loop
                before `push_together` / `prefetch_together`: 4 exchanges a step, not 2).
- dist_sparse_nofast: dist_sparse with servers that serve every request in Python
                (``--no-fast-path``: no C++ serving thread, `kvsparse.server.fastpath`).

Every system trains from scratch in every round (fresh tables; fresh servers for
dist_sparse), on the same batches in the same order, with the same dense initial weights;
rounds alternate between the systems so that machine noise falls on all of them, and the
figure is the best round. Timed: the training loop only (not data loading, model
construction or evaluation). examples/s = training ratings x epochs / seconds. The held-out
AUC of each system shows that all three trained the same model.

--profile adds one more dist_sparse run with cProfile on the worker's main thread (the
training loop; the prefetch thread's pulls show as the main thread's wait for them) and on
both servers (their whole life): the top entries go into the JSON.

Usage:
    python benchmarks/end_to_end.py                      # 3 rounds, 3 epochs (a few minutes)
    python benchmarks/end_to_end.py --rounds 1 --epochs 1 --systems plain_torch,local
    python benchmarks/end_to_end.py --profile

Writes benchmarks/results/end_to_end.json (every round's seconds, per epoch and per step,
the ratios to plain torch, AUCs, environment, the command that reproduces it).
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
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import numpy as np
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "examples"))
sys.path.insert(0, REPO)

import movielens  # noqa: E402
from kvsparse.adapters.torch import DenseGradientSync, push_together  # noqa: E402
from movielens_torch import DeepFM, evaluate  # noqa: E402

import kvsparse  # noqa: E402
from kvsparse.server.listening import parse_listening_line, read_first_line  # noqa: E402

NUM_SERVERS = 2
SYSTEMS = (
    "plain_torch",
    "local",
    "dist_sparse",
    "dist_sparse_ipc",
    "dist_sparse_push_wait",
    "dist_sparse_per_table",
    "dist_sparse_nofast",
)
DESCRIPTIONS = {
    "plain_torch": "nn.Embedding(sparse=True) + torch.optim.Adagrad, one process",
    "local": "kvsparse local store via kvsparse.adapters.torch",
    "dist_sparse": f"kvsparse dist_sparse, 1 worker + {NUM_SERVERS} servers on tcp loopback",
    "dist_sparse_ipc": "dist_sparse, servers on ipc:// sockets: rows through shared memory",
    "dist_sparse_push_wait": "dist_sparse, each push waits for its acknowledgements",
    "dist_sparse_per_table": "the same, one push and one prefetch per table",
    "dist_sparse_nofast": "dist_sparse, servers with --no-fast-path (all in Python)",
}
# The example's settings (examples/movielens_torch.py defaults).
EMBEDDING_DIM = 16
SPARSE_LR = 0.05
DENSE_LR = 1e-3
PROFILE_TOP = 15


# -- servers -----------------------------------------------------------------------------------


@contextlib.contextmanager
def kvsparse_servers(
    count: int,
    profile_paths: list | None = None,
    timeout: float = 60.0,
    extra_args: tuple = (),
    socket_dir: str | None = None,
):
    """Starts `count` `python -m kvsparse.server` processes on free ports; yields their addresses.

    socket_dir: bind server i on ``ipc://socket_dir/s<i>`` instead of a tcp port.

    profile_paths: run server i under cProfile, writing profile_paths[i] when it stops (a
    server exits cleanly on SIGTERM). Every server started is stopped on exit, whatever the
    reason: SIGTERM, then SIGKILL after a grace period; by its own pid, nothing by name.
    """
    started: list[subprocess.Popen] = []
    try:
        for index in range(count):
            bind = f"ipc://{socket_dir}/s{index}" if socket_dir else "tcp://127.0.0.1:0"
            argv = [sys.executable, "-m", "kvsparse.server", "--bind", bind]
            argv += extra_args
            if profile_paths:
                argv[1:1] = ["-m", "cProfile", "-o", profile_paths[index]]
            started.append(
                subprocess.Popen(
                    argv,
                    stdout=subprocess.PIPE,
                    stdin=subprocess.DEVNULL,
                    cwd=REPO,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        addresses = []
        for index, proc in enumerate(started):
            line = read_first_line(proc.stdout, deadline)
            address = parse_listening_line(line)
            if address is None:
                raise RuntimeError(
                    f"server {index} (pid {proc.pid}) printed no listening line "
                    f"within {timeout:g} s (got {line!r}; exit code {proc.poll()})"
                )
            addresses.append(address)
            # Keep reading its stdout, so a chatty server never blocks on a full pipe.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield addresses
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.terminate()
        for proc in started:
            try:
                # A server under cProfile writes its profile on the way out.
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- models ------------------------------------------------------------------------------------


def sparse_optimizer():
    return kvsparse.optimizers.Adagrad(learning_rate=SPARSE_LR)


def kvsparse_model(kv, num_fields: int, seed: int) -> DeepFM:
    """The example's DeepFM on store kv; seeding first gives every system the same MLP."""
    torch.manual_seed(seed)
    return DeepFM(kv, num_fields, EMBEDDING_DIM, sparse_optimizer())


def plain_model(num_fields: int, seed: int, vocabulary: np.ndarray) -> DeepFM:
    """The same DeepFM with nn.Embedding(sparse=True) tables indexed by vocabulary position.

    Built as the kvsparse model is (same seed, same MLP), on a throwaway local store whose
    tables then give the initial rows of every id in the vocabulary: kvsparse's initial row
    is a pure function of (table seed, id), so both start from the same embeddings.
    """
    scratch = kvsparse.create("local")
    try:
        model = kvsparse_model(scratch, num_fields, seed)
        ids = torch.from_numpy(vocabulary)
        with torch.no_grad():
            first = model.first_order(ids).reshape(len(vocabulary), 1).clone()
            vectors = model.embedding(ids).reshape(len(vocabulary), EMBEDDING_DIM).clone()
    finally:
        scratch.close()
    model.first_order = nn.Embedding.from_pretrained(first, freeze=False, sparse=True)
    model.embedding = nn.Embedding.from_pretrained(vectors, freeze=False, sparse=True)
    return model


# -- training ----------------------------------------------------------------------------------


class Workload:
    """MovieLens-100k as the example feeds it: every epoch's batches, made before timing."""

    def __init__(self, epochs: int, batch_size: int, seed: int):
        self.data = movielens.load()
        self.epochs = epochs
        self.batch_size = batch_size
        ids, labels = self.data.equal_shard(0, 1)  # one worker: all training ratings
        self.num_examples = len(labels)
        # The example's per-epoch shuffle seed, for rank 0 of 1 worker.
        self.batches = [
            [
                (torch.from_numpy(i), torch.from_numpy(y))
                for i, y in movielens.batches(ids, labels, batch_size, seed * 1000 + epoch)
            ]
            for epoch in range(epochs)
        ]
        # plain torch: the same batches as positions in a vocabulary of every id seen.
        self.vocabulary = np.unique(np.concatenate([ids.ravel(), self.data.test_ids.ravel()]))
        self.batches_as_positions = [
            [(self.positions(i.numpy()), y) for i, y in epoch] for epoch in self.batches
        ]
        self.test_positions = self.positions(self.data.test_ids).numpy()

    def positions(self, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.searchsorted(self.vocabulary, ids).astype(np.int64))


def train_plain(model: DeepFM, batches: list) -> tuple[list, list]:
    """Trains; returns (seconds per epoch, seconds per step)."""
    dense = [p for name, p in model.named_parameters() if not name.startswith(("first", "emb"))]
    dense_optimizer = torch.optim.Adam(dense, lr=DENSE_LR)
    sparse = [model.first_order.weight, model.embedding.weight]
    sparse_optimizer_ = torch.optim.Adagrad(sparse, lr=SPARSE_LR)
    loss_function = nn.BCEWithLogitsLoss()
    epoch_seconds, step_seconds = [], []
    for epoch_batches in batches:
        epoch_start = time.perf_counter()
        for batch_ids, batch_labels in epoch_batches:
            step_start = time.perf_counter()
            loss = loss_function(model(batch_ids), batch_labels)
            dense_optimizer.zero_grad()
            sparse_optimizer_.zero_grad()
            loss.backward()
            dense_optimizer.step()
            sparse_optimizer_.step()
            step_seconds.append(time.perf_counter() - step_start)
        epoch_seconds.append(time.perf_counter() - epoch_start)
    return epoch_seconds, step_seconds


def train_kvsparse(
    kv,
    model: DeepFM,
    batches: list,
    profiler=None,
    per_table: bool = False,
    push_wait: bool = False,
) -> tuple[list, list]:
    """The example's loop for one worker: pull in forward, push in backward, prefetch the
    next batch after the push, average dense gradients through the store, Adam.
    per_table: each table pushes and prefetches on its own (two requests, not one).
    push_wait: each push waits for the servers' acknowledgements (else the prefetch
    collects them)."""
    dense_sync = DenseGradientSync(kv, model.parameters(), key="deepfm_dense")
    dense_optimizer = torch.optim.Adam(model.parameters(), lr=DENSE_LR)
    loss_function = nn.BCEWithLogitsLoss()
    epoch_seconds, step_seconds = [], []
    with profiler if profiler is not None else contextlib.nullcontext():
        for epoch_batches in batches:
            epoch_start = time.perf_counter()
            for step, (batch_ids, batch_labels) in enumerate(epoch_batches):
                step_start = time.perf_counter()
                loss = loss_function(model(batch_ids), batch_labels)
                dense_optimizer.zero_grad()
                together = push_together(kv, wait=push_wait)
                with contextlib.nullcontext() if per_table else together:
                    loss.backward()  # pushes the embedding gradients
                if step + 1 < len(epoch_batches):
                    next_ids = epoch_batches[step + 1][0]
                    if per_table:
                        model.first_order.prefetch(next_ids)
                        model.embedding.prefetch(next_ids)
                    else:
                        model.prefetch(next_ids)
                dense_sync.synchronize()
                dense_optimizer.step()
                step_seconds.append(time.perf_counter() - step_start)
            epoch_seconds.append(time.perf_counter() - epoch_start)
    return epoch_seconds, step_seconds


def run_once(system: str, work: Workload, seed: int, profile_dir: str | None = None) -> dict:
    """Trains one system from scratch; its timings and held-out AUC."""
    num_fields = len(work.data.fields)
    load = os.getloadavg()[0]
    if system == "plain_torch":
        model = plain_model(num_fields, seed, work.vocabulary)
        epoch_seconds, step_seconds = train_plain(model, work.batches_as_positions)
        auc = evaluate(model, work.test_positions, work.data.test_labels)
        result = {}
    else:
        server_profiles = None
        if profile_dir is not None:
            server_profiles = [
                os.path.join(profile_dir, f"server{i}.prof") for i in range(NUM_SERVERS)
            ]
        profiler = cProfile.Profile() if profile_dir is not None else None
        with contextlib.ExitStack() as stack:
            if system == "local":
                kv = kvsparse.create("local")
            else:
                extra = ("--no-fast-path",) if system == "dist_sparse_nofast" else ()
                socket_dir = None
                if system == "dist_sparse_ipc":  # short: a socket path is <= 107 bytes
                    socket_dir = tempfile.mkdtemp(prefix="kvs", dir="/tmp")
                    stack.callback(shutil.rmtree, socket_dir, True)
                servers = stack.enter_context(
                    kvsparse_servers(
                        NUM_SERVERS, server_profiles, extra_args=extra, socket_dir=socket_dir
                    )
                )
                kv = kvsparse.create("dist_sparse", servers=servers, rank=0, num_workers=1)
            stack.callback(kv.close)
            model = kvsparse_model(kv, num_fields, seed)
            epoch_seconds, step_seconds = train_kvsparse(
                kv,
                model,
                work.batches,
                profiler,
                per_table=system == "dist_sparse_per_table",
                push_wait=system == "dist_sparse_push_wait",
            )
            auc = evaluate(model, work.data.test_ids, work.data.test_labels)
            result = {
                "prefetch_hits": model.embedding.prefetch_hits,
                "prefetch_misses": model.embedding.prefetch_misses,
                "rows_stored": {
                    key: int(table["rows"]) for key, table in kv.stats()["tables"].items()
                },
            }
        if profiler is not None:
            result["worker_profile_top_cumulative"] = profile_text(profiler, "cumulative")
            result["worker_profile_top_tottime"] = profile_text(profiler, "tottime")
            for index, path in enumerate(server_profiles or []):
                if os.path.exists(path):
                    result[f"server{index}_profile_top_tottime"] = profile_text(path, "tottime")
    train_seconds = sum(epoch_seconds)
    steps = np.asarray(step_seconds) * 1e3
    result.update(
        {
            "train_s": train_seconds,
            "examples_per_s": work.num_examples * work.epochs / train_seconds,
            "epoch_s": epoch_seconds,
            "step_ms_p50": float(np.percentile(steps, 50)),
            "step_ms_p90": float(np.percentile(steps, 90)),
            "step_ms_max": float(steps.max()),
            "auc": auc,
            "load_average_before": load,
        }
    )
    return result


def profile_text(source, sort: str, top: int = PROFILE_TOP) -> str:
    stream = io.StringIO()
    stats = pstats.Stats(source, stream=stream)
    stats.sort_stats(sort).print_stats(top)
    # The header lines (file name, blank lines) carry nothing; keep the totals and the table.
    lines = [line for line in stream.getvalue().splitlines() if line.strip()]
    return "\n".join(lines)


# -- report ------------------------------------------------------------------------------------


def environment() -> dict:
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    # Other work may be under way in this tree: say which tracked files differ from the commit.
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "kvsparse": kvsparse.__version__,
        "git_commit": commit,
        "git_changed_files": [line[3:] for line in changed],
    }


def summarize(rounds: list) -> dict:
    best = min(rounds, key=lambda r: r["train_s"])
    return {
        "examples_per_s_best": best["examples_per_s"],
        "examples_per_s_median": float(np.median([r["examples_per_s"] for r in rounds])),
        "train_s_best": best["train_s"],
        "auc": best["auc"],
        "auc_all_rounds": [r["auc"] for r in rounds],
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="best of N (the machine is noisy)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more dist_sparse run under cProfile (worker and servers), into the JSON",
    )
    parser.add_argument("--output", default=os.path.join(HERE, "results", "end_to_end.json"))
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {SYSTEMS}")
    return args


def print_table(systems: dict) -> None:
    base = systems.get("plain_torch", {}).get("summary")
    print()
    print(f"{'system':<14}{'examples/s':>12}{'median':>10}{'train s':>9}{'vs torch':>10}{'AUC':>8}")
    for name, entry in systems.items():
        s = entry["summary"]
        ratio = f"{s['examples_per_s_best'] / base['examples_per_s_best']:.2f}x" if base else "-"
        print(
            f"{name:<14}{s['examples_per_s_best']:>12,.0f}{s['examples_per_s_median']:>10,.0f}"
            f"{s['train_s_best']:>9.2f}{ratio:>10}{s['auc']:>8.4f}"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    # As the example: the model is small, and the worker shares the cores with the servers.
    torch.set_num_threads(1)
    # torch's sparse Adagrad warns once that it skips sparse-tensor checks; nothing to act on.
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    begin = time.monotonic()
    print("loading MovieLens-100k ...", flush=True)
    work = Workload(args.epochs, args.batch_size, args.seed)
    print(
        f"{work.num_examples:,} training ratings x {args.epochs} epochs, batch "
        f"{args.batch_size}; {len(work.data.test_labels):,} held out; "
        f"{len(work.vocabulary):,} distinct ids; {os.cpu_count()} cpus",
        flush=True,
    )
    rounds: dict = {name: [] for name in args.systems}
    for round_index in range(args.rounds):
        for name in args.systems:
            result = run_once(name, work, args.seed)
            rounds[name].append(result)
            print(
                f"round {round_index + 1}/{args.rounds} {name:<12} "
                f"{result['examples_per_s']:>9,.0f} examples/s  {result['train_s']:.2f} s  "
                f"step p50 {result['step_ms_p50']:.2f} ms  AUC {result['auc']:.4f}  "
                f"(load {result['load_average_before']:.2f})",
                flush=True,
            )
    systems = {
        name: {"description": DESCRIPTIONS[name], "summary": summarize(rs), "rounds": rs}
        for name, rs in rounds.items()
    }
    ratios, ratios_per_round = {}, {}
    if "plain_torch" in systems:
        base = systems["plain_torch"]["summary"]["examples_per_s_best"]
        for name in systems:
            if name == "plain_torch":
                continue
            best = systems[name]["summary"]["examples_per_s_best"]
            ratios[f"{name}/plain_torch"] = best / base
            # Rounds run back to back, so a round's ratio compares systems under the same
            # load; their median resists a burst of other work better than best / best.
            ratios_per_round[f"{name}/plain_torch"] = [
                r["examples_per_s"] / p["examples_per_s"]
                for r, p in zip(rounds[name], rounds["plain_torch"])
            ]
    print_table(systems)
    for key, value in ratios.items():
        median = float(np.median(ratios_per_round[key]))
        print(f"{key}: {value:.3f}x best/best; {median:.3f}x median of the rounds' ratios")

    profile = None
    if args.profile:
        print("\nprofiling one dist_sparse run (worker and servers under cProfile) ...")
        with tempfile.TemporaryDirectory(prefix="kvsparse-e2e-") as profile_dir:
            profile = run_once("dist_sparse", work, args.seed, profile_dir)
        profile["note"] = (
            "examples_per_s here is slowed by cProfile; the worker profile covers the "
            "training loop of the main thread (the prefetch thread's pulls appear as waits "
            "in rows_for/wait), the servers' their whole life"
        )
        print(f"(profiled run: {profile['examples_per_s']:,.0f} examples/s)")
        print(f"worker, top {PROFILE_TOP} by cumulative time:")
        print(profile["worker_profile_top_cumulative"])
        print(f"worker, top {PROFILE_TOP} by own time:")
        print(profile["worker_profile_top_tottime"])
        for index in range(NUM_SERVERS):
            text = profile.get(f"server{index}_profile_top_tottime")
            if text:
                print(f"server {index}, top {PROFILE_TOP} by own time:")
                print(text)

    report = {
        "benchmark": "end_to_end",
        "description": __doc__.split("\n")[0],
        "command": "python benchmarks/end_to_end.py " + shlex.join(argv or sys.argv[1:]),
        "settings": {
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "rounds": args.rounds,
            "seed": args.seed,
            "embedding_dim": EMBEDDING_DIM,
            "sparse_optimizer": f"Adagrad lr={SPARSE_LR} (torch formula, eps 1e-10)",
            "dense_optimizer": f"Adam lr={DENSE_LR}",
            "initializers": "first order Zeros; vectors Normal(0, 0.01) seed 1 (kvsparse's "
            "rows for plain torch too)",
            "num_servers": NUM_SERVERS,
            "kvsparse_loop": "as examples/movielens_torch.py: prefetch + DenseGradientSync",
            "training_examples": work.num_examples,
            "held_out_examples": len(work.data.test_labels),
            "distinct_ids": len(work.vocabulary),
            "figure": "examples/s = training examples x epochs / training-loop seconds; "
            "best of the rounds (ratios: best / best, and per round)",
        },
        "environment": {**environment(), "load_average_at_end": os.getloadavg()},
        "systems": systems,
        "ratios": ratios,
        "ratios_per_round": ratios_per_round,
        "ratios_median_of_rounds": {k: float(np.median(v)) for k, v in ratios_per_round.items()},
        "targets": {"dist_sparse/plain_torch": 0.8, "local/plain_torch": 1.0},
        "profile": profile,
        "total_s": time.monotonic() - begin,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {os.path.relpath(args.output)} in {report['total_s']:.0f} s total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
