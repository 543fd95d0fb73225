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

In one run, each against its own --servers real `kvsparse server` processes:
- all_ram:       no budget. Its table memory per server (kv.stats(), every row populated)
                 sets the tiered servers' budget: --budget-fraction (a quarter) of it.
- tiered:        --memory-budget B --spill-dir D on each server, same steps.
- tiered_ahead:  the same servers, the next batch's ids also sent before backward
                 (`warm_together`: PREFETCH_SPARSE), so the servers read the rows on
                 disk while the worker runs backward.

Every id of every table is pushed once with a zero gradient first (untimed, populate_s):
the tables hold their full cardinality and, tiered, most rows are on disk. Then --warmup
untimed steps (the tier's LFU settles on the hot rows), then --steps timed steps per
configuration. Reported: examples/s, the ratio to all_ram (target >= 0.7: TorchRec's
SSD/KV offload runs at ~0.5x of all-HBM), tier counters per step (row lookups, disk hits,
rows read, evictions, bytes read; summed over tables and servers), rows in memory and on
disk, server RSS. The page cache is not bounded: the spill files may sit in it (this
measures the tier's own costs, not the disk; benchmarks/tiered.py bounds it).

Usage:
    python benchmarks/tiered_dlrm.py --scale 16       # 2.1M rows, ~2 min here
    python benchmarks/tiered_dlrm.py                  # 33.8M rows
    python benchmarks/tiered.py dlrm --scale 16       # the same, through tiered.py

Writes benchmarks/results/tiered_dlrm.json.
"""

from __future__ import annotations

import argparse
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
TABLE_COUNTERS = ("row_lookups", "disk_hits", "rows_read", "evictions", "bytes_read")
RATIO_TARGET = 0.7


def build_model(torch, kv, cardinalities, sparse_lr: float):
    """The DLRM: 26 kvsparse Embedding modules and the dense layers (torch.nn)."""
    from torch import nn

    from kvsparse.adapters.torch import Embedding

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


def run_config(torch, args, cardinalities, batches, budget, log_dir, report) -> None:
    """One set of servers: populate, warm up, time; all_ram, or tiered and tiered_ahead."""
    names = [f"C{i + 1}" for i in range(len(cardinalities))]
    spill_root = tempfile.mkdtemp(prefix="kvsparse_dlrm_spill_", dir=args.spill_root)
    try:
        with procs.Processes(log_dir) as processes:
            addresses, pids = [], []
            for s in range(args.servers):
                extra = []
                if budget is not None:
                    spill = os.path.join(spill_root, f"server-{s}")
                    extra = ["--memory-budget", str(budget[s]), "--spill-dir", spill]
                address, pid = tiered.start_server(processes, f"server_{s}", extra, None)
                addresses.append(address)
                pids.append(pid)
            with kvsparse.create("dist_sparse", servers=addresses, rank=0, num_workers=1) as kv:
                torch.manual_seed(args.seed)
                model = build_model(torch, kv, cardinalities, args.sparse_lr)
                optimizer = torch.optim.Adam(
                    [p for n, p in model.named_parameters() if not n.startswith("embeddings")],
                    lr=1e-3,
                )
                name = "all_ram" if budget is None else "tiered"
                print(f"  {name}: populating {sum(cardinalities):,} rows ...", flush=True)
                populate_s = populate(kv, cardinalities, args.populate_block)
                run_steps(torch, kv, model, optimizer, batches, args.warmup, 0, ahead=False)
                settled = table_totals(kv, names)
                print(
                    f"  {name}: populated in {populate_s:.0f} s; {settled['rows_in_memory']:,} "
                    f"rows in memory, {settled['rows_on_disk']:,} on disk",
                    flush=True,
                )
                configs = [("all_ram", False)] if budget is None else [("tiered", False)]
                if budget is not None and not args.no_ahead:
                    configs.append(("tiered_ahead", True))
                start = args.warmup
                for config, ahead in configs:
                    before = table_totals(kv, names)
                    seconds = run_steps(
                        torch, kv, model, optimizer, batches, args.steps, start, ahead
                    )
                    after = table_totals(kv, names)
                    start += args.steps
                    warmed = sum(e.warmed_rows for e in model.embeddings)
                    total = float(np.sum(seconds))
                    result = {
                        "config": config,
                        "populate_s": populate_s,
                        "steps": args.steps,
                        "examples_per_s": args.steps * args.batch_size / total,
                        "ms_per_step_p50": float(np.median(seconds) * 1e3),
                        "step_ms": [round(s * 1e3, 1) for s in seconds],
                        "rows": after["rows"],
                        "table_bytes": after["bytes"],
                        "shard_table_bytes": after["shard_bytes"],
                        "rows_in_memory": after["rows_in_memory"],
                        "rows_on_disk": after["rows_on_disk"],
                        "per_step": {
                            f: (after[f] - before[f]) / args.steps for f in TABLE_COUNTERS
                        },
                        "warmed_rows_total": warmed,
                        "server_rss": [tiered.vm_rss(pid) for pid in pids],
                        "memory_budget": None if budget is None else list(budget),
                        "load_average": os.getloadavg()[0],
                    }
                    report["configs"].append(result)
                    print_row(result, report["configs"][0])
    finally:
        shutil.rmtree(spill_root, ignore_errors=True)


def print_row(result: dict, base: dict) -> None:
    per = result["per_step"]
    ratio = result["examples_per_s"] / base["examples_per_s"]
    print(
        f"  {result['config']:<13} {result['examples_per_s']:>9,.0f} ex/s  {ratio:5.2f}x  "
        f"p50 {result['ms_per_step_p50']:6.1f} ms  mem {result['rows_in_memory']:>11,}  "
        f"disk {result['rows_on_disk']:>11,}  per step: hits {per['disk_hits']:>8,.0f} "
        f"read {per['rows_read']:>8,.0f} evict {per['evictions']:>8,.0f}  RSS "
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
            "budget_fraction": args.budget_fraction,
            "ids": "zipf1.1 per table, ranks permuted",
            "sparse_optimizer": f"Adagrad({args.sparse_lr})",
        },
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "configs": [],
    }
    print(f"DLRM, {sum(cardinalities):,} rows (scale 1/{args.scale}), batch {args.batch_size}")
    batches = make_batches(args, cardinalities)
    with tempfile.TemporaryDirectory(prefix="kvsparse_dlrm_logs_") as log_dir:
        run_config(torch, args, cardinalities, batches, None, log_dir, report)
        shard_bytes = report["configs"][0]["shard_table_bytes"]
        budget = [max(1 << 20, int(b * args.budget_fraction)) for b in shard_bytes]
        print(f"  budget per server: {[f'{b / 2**20:,.0f} MiB' for b in budget]}", flush=True)
        run_config(torch, args, cardinalities, batches, budget, log_dir, report)
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
