"""Plan once per step: a local-store step with and without plan reuse.

A step is row_sparse_pull(key, row_ids=ids) then push(key, (ids, grads)) of the same
batch: W1's table (dim 64, Adagrad, Normal(0, 0.01)) on kvsparse.create('local'), batches
of 65,536 ids drawn Zipf(1.1) over 10^8 (benchmarks/peers/workload.py). Two stores get the
same batches, steps alternating between them (which one goes first alternates too):

- reuse:    the push takes the plan its pull made (the default).
- no_reuse: every call plans afresh (the store's private switch, ``kv._plans.enabled``).

Also timed alone: `_core.plan_batch` of one batch, and comparing two batches
(`np.array_equal`, what the push pays to find the pull's plan). Ratios > 1: reuse is
faster. Figures are medians over the timed steps; the paired figures are medians over steps
of (no_reuse step / reuse step) and of their difference, the two steps of a batch run back
to back, which cancels most of a shared machine's drift.

Run: python benchmarks/plan_reuse.py [--steps 30] [--warmup 3] [--batch-size 65536]
         [--initializer normal|zeros] [--warm]
--warm stores every id of the timed batches before the timing (one untimed step each), so
the step does no row generation. Writes benchmarks/results/plan_reuse.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(0, REPO)

import workload as wl  # noqa: E402

import kvsparse  # noqa: E402
from kvsparse import _core, initializers, optimizers  # noqa: E402

VARIANTS = ("reuse", "no_reuse")


INITIALIZERS = {"normal": lambda: initializers.Normal(0, 0.01), "zeros": initializers.Zeros}


def make_store(reuse: bool, initializer: str):
    kv = kvsparse.create("local")
    kv._plans.enabled = reuse
    kv.init(
        "w1",
        kvsparse.SparseTable(
            dim=wl.DIM,
            initializer=INITIALIZERS[initializer](),
            optimizer=optimizers.Adagrad(learning_rate=wl.LEARNING_RATE, eps=wl.EPS),
            seed=1,
        ),
    )
    return kv


def step(kv, ids: np.ndarray, grads: np.ndarray, out: np.ndarray) -> tuple:
    """(pull seconds, push seconds) of one step."""
    start = time.perf_counter()
    kv.row_sparse_pull("w1", out=out, row_ids=ids)
    middle = time.perf_counter()
    kv.push("w1", (ids, grads))
    return middle - start, time.perf_counter() - middle


def median_ms(values) -> float:
    return float(np.median(values) * 1e3)


def time_alone(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median_ms(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=65_536)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--initializer", choices=sorted(INITIALIZERS), default="normal")
    parser.add_argument("--warm", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "plan_reuse.json"))
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    batches = [wl.zipf_ids(rng, args.batch_size) for _ in range(args.warmup + args.steps)]
    grads = (rng.standard_normal((args.batch_size, wl.DIM)) * 0.01).astype(np.float32)
    out = np.empty((args.batch_size, wl.DIM), np.float32)
    stores = {name: make_store(name == "reuse", args.initializer) for name in VARIANTS}
    if args.warm:
        for ids in batches:
            for kv in stores.values():
                step(kv, ids, grads, out)
    times = {name: {"pull": [], "push": []} for name in VARIANTS}
    for index, ids in enumerate(batches):
        order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]
        for name in order:
            pull, push = step(stores[name], ids, grads, out)
            if index >= args.warmup:
                times[name]["pull"].append(pull)
                times[name]["push"].append(push)
    counters = {
        name: {"planned": kv._plans.planned, "reused": kv._plans.reused}
        for name, kv in stores.items()
    }
    check = batches[-1][:1000]
    same = np.array_equal(*(kv.row_sparse_pull("w1", row_ids=check) for kv in stores.values()))
    for kv in stores.values():
        kv.close()

    ids = batches[-1]
    plan_ms = time_alone(lambda: _core.plan_batch(ids, 1, None), 20)
    copy = ids.copy()
    compare_ms = time_alone(lambda: np.array_equal(ids, copy), 20)
    figures = {}
    for name in VARIANTS:
        pulls, pushes = np.array(times[name]["pull"]), np.array(times[name]["push"])
        figures[name] = {
            "pull_ms": median_ms(pulls),
            "push_ms": median_ms(pushes),
            "step_ms": median_ms(pulls + pushes),
            **counters[name],
        }
    ratio = figures["no_reuse"]["step_ms"] / figures["reuse"]["step_ms"]
    steps = {name: np.add(times[name]["pull"], times[name]["push"]) for name in VARIANTS}
    paired_ratio = float(np.median(steps["no_reuse"] / steps["reuse"]))
    paired_saved_ms = median_ms(steps["no_reuse"] - steps["reuse"])
    unique = float(np.mean([np.unique(b).size for b in batches[args.warmup :]]))

    table = "warm table" if args.warm else "new rows generated"
    print(
        f"local store, {args.steps} steps of {args.batch_size:,} Zipf(1.1) ids over 10^8 "
        f"(~{unique:,.0f} unique), dim {wl.DIM}, Adagrad, {args.initializer} init, {table}"
    )
    print(f"{'variant':<10} {'pull ms':>9} {'push ms':>9} {'step ms':>9} {'plans':>7}")
    for name in VARIANTS:
        f = figures[name]
        print(
            f"{name:<10} {f['pull_ms']:9.2f} {f['push_ms']:9.2f} {f['step_ms']:9.2f} "
            f"{f['planned']:7d}"
        )
    print(f"plan_batch alone {plan_ms:.2f} ms; comparing two batches {compare_ms:.3f} ms")
    print(
        f"step no_reuse / reuse = {ratio:.3f}x (medians), {paired_ratio:.3f}x paired, "
        f"{paired_saved_ms:.2f} ms saved per step; same tables: {same}"
    )

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "benchmark": "plan_reuse",
                "command": "python benchmarks/plan_reuse.py " + " ".join(sys.argv[1:]),
                "store": "local",
                "batch_size": args.batch_size,
                "steps": args.steps,
                "warmup": args.warmup,
                "dim": wl.DIM,
                "zipf_exponent": 1.1,
                "id_space": wl.ID_SPACE,
                "mean_unique_ids": unique,
                "initializer": args.initializer,
                "warm": args.warm,
                "variants": figures,
                "plan_batch_ms": plan_ms,
                "compare_ms": compare_ms,
                "step_ratio_no_reuse_over_reuse": ratio,
                "paired_step_ratio": paired_ratio,
                "paired_saved_ms": paired_saved_ms,
                "same_tables": bool(same),
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
