"""Peer: MXNet 1.9.1's own dist_sync KVStore (ps-lite), row_sparse_pull + row_sparse push.

One script for all ps-lite roles: with DMLC_ROLE=scheduler or server, ``import mxnet`` runs
that role's loop and exits when the worker finishes; with DMLC_ROLE=worker it runs the
benchmark. ps-lite tables have a fixed row count and servers materialize them, so ids come
folded into a `fold_rows` table (workload.fold); ps-lite splits its rows over the servers
in ranges (the scrambled ids spread the hot rows). The servers run MXNet's AdaGrad on the
pushed rows (set_optimizer pickles it to them).

Pitfalls (seen here): ps-lite reads PORT as its own port (unset it); its server aborts on an
empty row_sparse init and on a push before set_optimizer, and the worker then hangs; so
the table is initialized with every row and the driver runs all roles under a timeout.

Run by benchmarks/pull_push.py (DMLC_* variables set in these processes only):
    DMLC_ROLE=worker ... python mxnet_pslite.py --workload W.npz --result R.json ...
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

np.bool = bool  # MXNet 1.9.1 still uses the alias NumPy 1.24 removed
import common  # noqa: E402
import mxnet as mx  # noqa: E402  (scheduler and server roles never return from this import)
import workload as wl  # noqa: E402

KEY = "embedding"


def run_worker(args) -> None:
    work = wl.Workload.load(args.workload)
    rows = work.fold_rows
    kv = mx.kv.create("dist_sync")
    common.log("ps-lite ready")
    initial = mx.nd.random.uniform(-0.05, 0.05, shape=(rows, wl.DIM)).tostype("row_sparse")
    kv.init(KEY, initial)
    # MXNet's AdaGrad puts eps inside the square root; the cost per row is the same.
    kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=wl.LEARNING_RATE, eps=wl.EPS))
    del initial
    common.log("table initialized, optimizer set")
    prepared = {}
    for b in range(common.num_batches(args.warmup, args.steps)):
        unique, summed = common.presummed(work.folded[b], work.grads)
        prepared[b] = (
            mx.nd.array(unique, dtype="int64"),
            mx.nd.sparse.row_sparse_array((summed, unique), shape=(rows, wl.DIM)),
        )
    mx.nd.waitall()
    common.log("batches prepared")
    out = mx.nd.sparse.zeros("row_sparse", (rows, wl.DIM))

    def pull(b):
        kv.row_sparse_pull(KEY, out=out, row_ids=prepared[b][0])
        out.wait_to_read()

    def push(b):
        kv.push(KEY, prepared[b][1])
        mx.nd.waitall()

    pull(0)
    if out.data.shape[0] != prepared[0][0].shape[0]:
        raise RuntimeError(
            f"row_sparse_pull returned {out.data.shape[0]} rows, expected {prepared[0][0].shape[0]}"
        )
    times = common.run_phases(args.warmup, args.steps, pull, push)
    common.log("phases done")
    common.write_result(args.result, times, mxnet=mx.__version__, rows=rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    args = parser.parse_args(argv)
    if os.environ.get("DMLC_ROLE") != "worker":
        raise SystemExit("only the worker role reaches main()")
    run_worker(args)


if __name__ == "__main__":
    sys.exit(main())
