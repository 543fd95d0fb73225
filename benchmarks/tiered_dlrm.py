"""The torch DLRM at Criteo-Kaggle cardinalities: servers with a quarter of their shard in RAM.

A DLRM (bottom MLP 13-512-256-64-16 over 13 dense features; 26 embedding tables of dim 16
through the kvsparse torch adapter, Adagrad on the servers; pairwise dot interaction; top
MLP 512-256-1; BCE loss; torch.optim.Adam for the dense layers) trains on synthetic data:
dense features N(0, 1), labels Bernoulli(0.25), ids per table Zipf(1.1) over the table's
cardinality (the 26 published per-feature cardinalities of the Kaggle Display
Advertising Challenge dataset, 33.76M rows in all, each divided by --scale), ranks
scattered by a fixed permutation. One worker; the step is DLRM's usual one with the
adapter's prefetch: forward on the prefetched rows, backward pushes (push_together,
wait=False), prefetch of the next batch after it, dense update.

In one run, each configuration against its own --servers real `kvsparse server` processes,
all of them up at once:
- all_ram:       no budget. Its table memory per server (kv.stats(), every row populated)
                 sets the tiered servers' budget: --budget-fraction (a quarter) of it.
- tiered:        --memory-budget B --spill-dir D on each server, same steps.
- tiered_ahead:  the same budget on servers of its own, the next batch's ids also sent
                 before backward (`warm_together`: PREFETCH_SPARSE), so the servers read
                 the rows on disk while the worker runs backward.

Every id of every table is pushed once with a zero gradient first (untimed, populate_s):
the tables hold their full cardinality and, tiered, most rows are on disk. Then --warmup
untimed steps (the tier's LFU settles on the hot rows). The --steps timed steps of each
configuration run interleaved, --round-steps of each in turn: what else runs on the
machine weighs on all of them alike (run one after the other on a shared 2-core machine,
all_ram alone varied 2-10x within the hour and the ratios with it). Reported:
examples/s, the ratio to all_ram (target >= 0.7: TorchRec's SSD/KV offload runs at ~0.5x
of all-HBM) and the quartiles of the per-round ratios, the worker's and each server's CPU
time per step, tier counters per step (row lookups, disk hits, rows read and of those the
rows warm_together read, evictions, bytes read and written, bytes merges moved and of those
the ones moved in the servers' idle time; summed over tables and servers), rows in
memory and on disk, server RSS. The page cache is not bounded: the spill files may sit in
it (this measures the tier's own costs, not the disk; benchmarks/tiered.py bounds it).

Usage:
    python benchmarks/tiered_dlrm.py --scale 4 --torch-threads 1   # 8.4M rows, ~2.5 min here
    python benchmarks/tiered_dlrm.py --scale 16       # 2.1M rows
    python benchmarks/tiered_dlrm.py                  # 33.8M rows
    python benchmarks/tiered.py dlrm --scale 16       # the same, through tiered.py

Writes benchmarks/results/tiered_dlrm.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

import engine_compare  # noqa: E402
import procs  # noqa: E402
import tiered  # noqa: E402

import kvsparse  # noqa: E402

# Criteo Kaggle (Display Advertising Challenge) categorical features C1..C26: distinct
# values per feature, as TorchRec's and DLRM's Kaggle configurations list them.
KAGGLE_CARDINALITIES = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip
DIM = 16
DENSE_FEATURES = 13
TABLE_COUNTERS = (
    "row_lookups",
    "disk_hits",
    "rows_read",
    "evictions",
    "bytes_read",
    "bytes_written",
    "gc_bytes_moved",
    "idle_bytes_moved",
)
RATIO_TARGET = 0.7


def build_model(torch, kv, cardinalities, sparse_lr: float):
    """The DLRM: 26 kvsparse Embedding modules and the dense layers (torch.nn)."""
    from kvsparse.adapters.torch import Embedding
    from torch import nn

    def mlp(sizes, last_relu=False):
        layers = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*(layers if last_relu else layers[:-1]))

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            self.bottom = mlp([DENSE_FEATURES, 512, 256, 64, DIM], last_relu=True)
            self.embeddings = nn.ModuleList(
                Embedding(
                    kv,
                    f"C{i + 1}",
                    DIM,
                    initializer=kvsparse.initializers.Normal(0.0, 0.01),
                    optimizer=kvsparse.optimizers.Adagrad(sparse_lr),
                )
                for i in range(len(cardinalities))
            )
            fields = len(cardinalities) + 1
            self.pairs = torch.triu_indices(fields, fields, offset=1)
            self.top = mlp([DIM + fields * (fields - 1) // 2, 512, 256, 1])

        def forward(self, dense, ids):
            x = self.bottom(dense)
            vectors = torch.stack([x] + [e(i) for e, i in zip(self.embeddings, ids)], dim=1)
            dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
            return self.top(torch.cat([x, dots], dim=1)).squeeze(1)

    return DLRM()


def make_batches(args, cardinalities):
    """--batches synthetic batches: (dense, [ids per table], labels), fixed by --seed."""
    rng = np.random.default_rng(args.seed)
    permutations = [rng.permutation(rows).astype(np.int64) for rows in cardinalities]
    batches = []
    for _ in range(args.batches):
        dense = rng.standard_normal((args.batch_size, DENSE_FEATURES)).astype(np.float32)
        ids = [
            engine_compare.zipf_ids(rng, args.batch_size, rows, perm)
            for rows, perm in zip(cardinalities, permutations)
        ]
        labels = (rng.random(args.batch_size) < 0.25).astype(np.float32)
        batches.append((dense, ids, labels))
    return batches


def populate(kv, cardinalities, block: int) -> float:
    """Every id of every table pushed once with a zero gradient; seconds."""
    zeros = np.zeros((block, DIM), np.float32)
    start = time.perf_counter()
    for index, rows in enumerate(cardinalities):
        for begin in range(0, rows, block):
            ids = np.arange(begin, min(rows, begin + block), dtype=np.int64)
            kv.push(f"C{index + 1}", (ids, zeros[: ids.size]))
    return time.perf_counter() - start


def table_totals(kv, names) -> dict:
    """Rows, bytes and tier counters summed over the tables and servers; bytes per shard."""
    stats = kv.stats()
    out = {"rows": 0, "bytes": 0, "rows_in_memory": 0, "rows_on_disk": 0}
    out.update(dict.fromkeys(TABLE_COUNTERS, 0))
    for name in names:
        table = stats["tables"][name]
        out["rows"] += table["rows"]
        out["bytes"] += table["bytes"]
        tier = table.get("tier")
        if tier:
            for field in TABLE_COUNTERS + ("rows_in_memory", "rows_on_disk"):
                out[field] += tier.get(field, 0)
    out["shard_bytes"] = [
        sum(shard["tables"][n]["bytes"] for n in names if n in shard["tables"])
        for shard in stats["shards"]
    ]
    return out


def run_steps(torch, kv, model, optimizer, batches, count: int, start: int, ahead: bool):
    """count training steps from batch start on; (seconds of each step, batches used)."""
    from kvsparse.adapters.torch import prefetch_together, push_together, warm_together

    loss_function = torch.nn.BCEWithLogitsLoss()
    embeddings = list(model.embeddings)
    tensors = lambda b: (  # noqa: E731
        torch.from_numpy(b[0]),
        [torch.from_numpy(i) for i in b[1]],
        torch.from_numpy(b[2]),
    )
    seconds = []
    current = tensors(batches[start % len(batches)])
    for step in range(start, start + count):
        began = time.perf_counter()
        dense, ids, labels = current
        following = tensors(batches[(step + 1) % len(batches)])
        loss = loss_function(model(dense, ids), labels)
        optimizer.zero_grad()
        if ahead:
            warm_together(embeddings, following[1])
        with push_together(kv, wait=False):
            loss.backward()
        prefetch_together(embeddings, following[1])
        optimizer.step()
        seconds.append(time.perf_counter() - began)
        current = following
    # The last prefetch is read by the next call (or dropped with the store).
    return seconds


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) pid has used; 0.0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_config(stack, torch, args, name, cardinalities, batches, budget, log_dir) -> dict:
    """Servers (each with its budget, or none), a store and a DLRM for one configuration,
    populated and warmed up; they stay up until stack closes."""
    names = [f"C{i + 1}" for i in range(len(cardinalities))]
    processes = stack.enter_context(procs.Processes(log_dir))
    spill_root = tempfile.mkdtemp(prefix=f"kvsparse_dlrm_{name}_", dir=args.spill_root)
    stack.callback(shutil.rmtree, spill_root, True)
    addresses, pids = [], []
    for s in range(args.servers):
        extra = []
        if budget is not None:
            spill = os.path.join(spill_root, f"server-{s}")
            extra = ["--memory-budget", str(budget[s]), "--spill-dir", spill]
        address, pid = tiered.start_server(processes, f"{name}_server_{s}", extra, None)
        addresses.append(address)
        pids.append(pid)
    kv = stack.enter_context(
        kvsparse.create("dist_sparse", servers=addresses, rank=0, num_workers=1)
    )
    torch.manual_seed(args.seed)
    model = build_model(torch, kv, cardinalities, args.sparse_lr)
    optimizer = torch.optim.Adam(
        [p for n, p in model.named_parameters() if not n.startswith("embeddings")], lr=1e-3
    )
    ahead = name == "tiered_ahead"
    print(f"  {name}: populating {sum(cardinalities):,} rows ...", flush=True)
    populate_s = populate(kv, cardinalities, args.populate_block)
    run_steps(torch, kv, model, optimizer, batches, args.warmup, 0, ahead)
    settled = table_totals(kv, names)
    print(
        f"  {name}: populated in {populate_s:.0f} s; {settled['rows_in_memory']:,} rows in "
        f"memory, {settled['rows_on_disk']:,} on disk",
        flush=True,
    )
    return {
        "name": name,
        "kv": kv,
        "model": model,
        "optimizer": optimizer,
        "pids": pids,
        "names": names,
        "ahead": ahead,
        "budget": budget,
        "populate_s": populate_s,
        "next_step": args.warmup,
        "seconds": [],
        "round_s": [],
        "worker_cpu_s": 0.0,
        "server_cpu_s": [0.0] * len(pids),
        "before": settled,
        "warmed_before": sum(e.warmed_rows for e in model.embeddings),
    }


def run_round(torch, batches, config: dict, steps: int) -> None:
    """steps timed steps of one configuration, from where it stopped; its counters grow."""
    worker = time.process_time()
    servers = [process_cpu_s(pid) for pid in config["pids"]]
    seconds = run_steps(
        torch,
        config["kv"],
        config["model"],
        config["optimizer"],
        batches,
        steps,
        config["next_step"],
        config["ahead"],
    )
    config["worker_cpu_s"] += time.process_time() - worker
    config["server_cpu_s"] = [
        total + process_cpu_s(pid) - before
        for total, pid, before in zip(config["server_cpu_s"], config["pids"], servers)
    ]
    config["next_step"] += steps
    config["seconds"] += seconds
    config["round_s"].append(float(np.sum(seconds)))


def config_result(args, config: dict) -> dict:
    """The JSON record of one configuration after its timed steps."""
    after = table_totals(config["kv"], config["names"])
    before = config["before"]
    seconds = config["seconds"]
    steps = len(seconds)
    return {
        "config": config["name"],
        "populate_s": config["populate_s"],
        "steps": steps,
        "examples_per_s": steps * args.batch_size / float(np.sum(seconds)),
        "ms_per_step_p50": float(np.median(seconds) * 1e3),
        "step_ms": [round(s * 1e3, 1) for s in seconds],
        "round_s": config["round_s"],
        "worker_cpu_ms_per_step": config["worker_cpu_s"] * 1e3 / steps,
        "server_cpu_ms_per_step": [c * 1e3 / steps for c in config["server_cpu_s"]],
        "rows": after["rows"],
        "table_bytes": after["bytes"],
        "shard_table_bytes": after["shard_bytes"],
        "rows_in_memory": after["rows_in_memory"],
        "rows_on_disk": after["rows_on_disk"],
        "per_step": {f: (after[f] - before[f]) / steps for f in TABLE_COUNTERS},
        # Rows the servers read for warm_together, and the rest of the reads (those of the
        # pulls and pushes themselves: rows a warm did not bring, or that went out again).
        "per_step_warmed_rows": (
            sum(e.warmed_rows for e in config["model"].embeddings) - config["warmed_before"]
        )
        / steps,
        "server_rss": [tiered.vm_rss(pid) for pid in config["pids"]],
        "memory_budget": None if config["budget"] is None else list(config["budget"]),
    }


def print_row(result: dict, base: dict) -> None:
    per = result["per_step"]
    ratio = result["examples_per_s"] / base["examples_per_s"]
    print(
        f"  {result['config']:<13} {result['examples_per_s']:>9,.0f} ex/s  {ratio:5.2f}x  "
        f"p50 {result['ms_per_step_p50']:6.1f} ms  mem {result['rows_in_memory']:>11,}  "
        f"disk {result['rows_on_disk']:>11,}  per step: hits {per['disk_hits']:>8,.0f} "
        f"read {per['rows_read']:>8,.0f} (warm {result['per_step_warmed_rows']:>7,.0f}) "
        f"evict {per['evictions']:>8,.0f}  CPU ms/step worker "
        f"{result['worker_cpu_ms_per_step']:.0f} servers "
        + "/".join(f"{c:.0f}" for c in result["server_cpu_ms_per_step"])
        + "  RSS "
        + "/".join(f"{(r or 0) / 2**20:,.0f}" for r in result["server_rss"])
        + " MiB",
        flush=True,
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=int, default=1, help="divide every cardinality by it")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=40, help="untimed steps after populate")
    parser.add_argument("--batches", type=int, default=64, help="distinct batches (cycled)")
    parser.add_argument("--round-steps", type=int, default=5, help="steps per turn, interleaved")
    parser.add_argument("--budget-fraction", type=float, default=0.25)
    parser.add_argument("--populate-block", type=int, default=16384)
    parser.add_argument("--sparse-lr", type=float, default=0.01)
    parser.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--no-ahead", action="store_true", help="skip tiered_ahead")
    parser.add_argument("--spill-root", default=None, help="where spill dirs go (default: /tmp)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=os.path.join(HERE, "results", "tiered_dlrm.json"), help="JSON path"
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    cardinalities = [max(1, c // args.scale) for c in KAGGLE_CARDINALITIES]
    started = time.perf_counter()
    report = {
        "benchmark": "tiered_dlrm",
        "command": " ".join(["python", os.path.relpath(__file__, REPO)] + sys.argv[1:]),
        "workload": {
            "cardinalities": cardinalities,
            "rows": sum(cardinalities),
            "scale": args.scale,
            "batch_size": args.batch_size,
            "dim": DIM,
            "servers": args.servers,
            "workers": 1,
            "steps": args.steps,
            "warmup": args.warmup,
            "round_steps": args.round_steps,
            "budget_fraction": args.budget_fraction,
            "ids": "zipf1.1 per table, ranks permuted",
            "sparse_optimizer": f"Adagrad({args.sparse_lr})",
        },
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "configs": [],
    }
    print(f"DLRM, {sum(cardinalities):,} rows (scale 1/{args.scale}), batch {args.batch_size}")
    batches = make_batches(args, cardinalities)
    names = ["all_ram", "tiered"] + ([] if args.no_ahead else ["tiered_ahead"])
    with tempfile.TemporaryDirectory(prefix="kvsparse_dlrm_logs_") as log_dir:
        with contextlib.ExitStack() as stack:
            configs = [
                open_config(stack, torch, args, "all_ram", cardinalities, batches, None, log_dir)
            ]
            shard_bytes = table_totals(configs[0]["kv"], configs[0]["names"])["shard_bytes"]
            budget = [max(1 << 20, int(b * args.budget_fraction)) for b in shard_bytes]
            report["workload"]["memory_budget"] = budget
            print(f"  budget per server: {[f'{b / 2**20:,.0f} MiB' for b in budget]}", flush=True)
            for name in names[1:]:
                configs.append(
                    open_config(stack, torch, args, name, cardinalities, batches, budget, log_dir)
                )
            # Interleaved: --round-steps of each in turn (the order rotating), so that what
            # else runs on the machine meanwhile weighs on every configuration alike.
            rounds = -(-args.steps // args.round_steps)
            for r in range(rounds):
                steps = min(args.round_steps, args.steps - r * args.round_steps)
                for config in configs[r % len(configs) :] + configs[: r % len(configs)]:
                    run_round(torch, batches, config, steps)
            report["load_average"] = os.getloadavg()
            for config in configs:
                report["configs"].append(config_result(args, config))
                print_row(report["configs"][-1], report["configs"][0])
            base_rounds = np.array(configs[0]["round_s"])
            report["round_ratio_quartiles"] = {
                c["name"]: np.percentile(
                    base_rounds / np.array(c["round_s"]), [25, 50, 75]
                ).tolist()
                for c in configs
            }
    base = report["configs"][0]["examples_per_s"]
    report["ratios"] = {c["config"]: c["examples_per_s"] / base for c in report["configs"]}
    report["target"] = {"tiered_over_all_ram": RATIO_TARGET}
    report["total_s"] = time.perf_counter() - started
    print("ratios to all_ram: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["ratios"].items()))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out} in {report['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
