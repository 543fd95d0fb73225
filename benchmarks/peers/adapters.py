"""W1 through a kvsparse framework adapter, against the same store driven with NumPy.

Run by benchmarks/pull_push.py in its own process (one per framework, so the frameworks
never share a process), with 2 fresh `kvsparse.server` processes named by KVSPARSE_SERVERS
(kvsparse.create('dist_sparse') with no arguments reads it). The process drives one table
with NumPy (row_sparse_pull into a preallocated out, push of (ids, rows)) and a second
one, on the same servers, through the adapter, alternating batch by batch, and writes
both timings. Each runner returns the adapter's (step(b), pull(b)):

- torch:      kvsparse.adapters.torch.Embedding; a step is forward + backward(grad rows)
              (the backward pushes); the pull phase is a forward under torch.no_grad().
- tensorflow: kvsparse.adapters.tensorflow.Embedding, eager; a step is the layer call under
              a GradientTape + tape.gradient(rows, [push_trigger], output_gradients=grad).
- mxnet:      ``import kvsparse.adapters.mxnet`` then mx.kv.create('dist_sparse'), the
              MXNet way: row_sparse_pull(out=row_sparse NDArray, row_ids=NDArray of the
              batch's unique ids, folded as for the MXNet peer) + push of the summed
              gradient as a row_sparse NDArray (as a Gluon Trainer with a sparse
              Embedding hands it over; both NDArrays built untimed). Its baseline is fed
              the same unique ids and summed rows.

    python adapters.py --framework torch --workload W.npz --result R.json --steps S --warmup W
"""

from __future__ import annotations

import argparse
import sys
import time

import common
import numpy as np
import workload as wl

import kvsparse


def optimizer():
    return kvsparse.optimizers.Adagrad(learning_rate=wl.LEARNING_RATE, eps=wl.EPS)


def numpy_driven(work, args, unique_inputs: bool) -> tuple:
    """The baseline: the same servers driven through the NumPy API, on a table of its own.

    unique_inputs: pull the batch's sorted unique ids (one row each) and push them with
    the summed gradient rows, prepared untimed (the MXNet row's inputs); otherwise pull
    and push the raw batch (the torch and TensorFlow rows' inputs).
    Returns (pull(b), push(b), close()).
    """
    kv = kvsparse.create("dist_sparse")  # servers, rank, workers from KVSPARSE_* variables
    # The MXNet adapter's tables start at zero (MXNet's init value): so does its baseline's.
    initializer = (
        kvsparse.initializers.Zeros() if unique_inputs else kvsparse.initializers.Uniform()
    )
    table = kvsparse.SparseTable(dim=wl.DIM, initializer=initializer, optimizer=optimizer(), seed=0)
    kv.init("numpy_embedding", table)
    out = np.empty((work.batch_size, wl.DIM), np.float32)
    if unique_inputs:
        prepared = presummed_batches(work, args)

        def pull(b):
            ids = prepared[b][0]
            kv.row_sparse_pull("numpy_embedding", out=out[: ids.size], row_ids=ids)

        def push(b):
            kv.push("numpy_embedding", prepared[b])

    else:

        def pull(b):
            kv.row_sparse_pull("numpy_embedding", out=out, row_ids=work.batches[b])

        def push(b):
            kv.push("numpy_embedding", (work.batches[b], work.grads))

    return pull, push, kv.close


def presummed_batches(work, args) -> list:
    """Per batch: (sorted unique folded ids, summed gradient rows).

    Folded ids (as the MXNet peer gets): MXNet's NDArrays cap rows x dim below 2^31, so a
    RowSparseNDArray cannot span 10^8 rows of dim 64.
    """
    return [
        common.presummed(work.folded[b], work.grads)
        for b in range(common.num_batches(args.warmup, args.steps))
    ]


def interleaved(args, adapter: tuple, baseline: tuple) -> tuple[dict, dict]:
    """Times the adapter's and the baseline's step and pull, alternating batch by batch.

    adapter: (step(b), pull(b)); baseline: (pull(b), push(b)). Alternating puts both under
    the same load from whatever else runs on the machine, so their ratio stays meaningful
    where their absolute times do not. The baseline's push alone is timed after.
    Returns (adapter times, baseline times), {phase: [seconds per batch]} each.
    """
    adapter_step, adapter_pull = adapter
    base_pull, base_push = baseline

    def base_step(b):
        base_pull(b)
        base_push(b)

    plan = common.phase_batches(args.warmup, args.steps)
    for b in plan["warmup"]:
        base_step(b)
        adapter_step(b)
    times: dict = {}
    base_times: dict = {}
    for phase, ours, theirs in (
        ("step", adapter_step, base_step),
        ("pull", adapter_pull, base_pull),
    ):
        times[phase], base_times[phase] = [], []
        for b in plan[phase]:
            for run, into in ((theirs, base_times[phase]), (ours, times[phase])):
                start = time.perf_counter()
                run(b)
                into.append(time.perf_counter() - start)
    base_times["push"] = []
    for b in plan["push"]:
        start = time.perf_counter()
        base_push(b)
        base_times["push"].append(time.perf_counter() - start)
    return times, base_times


def run_torch(work, args) -> tuple:
    import torch
    from kvsparse.adapters.torch import Embedding

    torch.set_num_threads(1)
    kv = kvsparse.create("dist_sparse")
    embedding = Embedding(kv, "embedding", embedding_dim=wl.DIM, optimizer=optimizer(), seed=0)
    ids = [torch.from_numpy(b) for b in work.batches]
    grad = torch.from_numpy(work.grads)

    def step(b):
        embedding(ids[b]).backward(grad)

    def pull(b):
        with torch.no_grad():
            embedding(ids[b])

    return step, pull


def run_tensorflow(work, args) -> tuple:
    import tensorflow as tf
    from kvsparse.adapters.tensorflow import Embedding

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    kv = kvsparse.create("dist_sparse")
    layer = Embedding(kv, "embedding", embedding_dim=wl.DIM, optimizer=optimizer(), seed=0)
    ids = [tf.constant(b) for b in work.batches]
    grad = tf.constant(work.grads)

    def step(b):
        with tf.GradientTape() as tape:
            rows = layer(ids[b])
        tape.gradient(rows, [layer.push_trigger], output_gradients=grad)

    def pull(b):
        layer(ids[b])

    return step, pull


def run_mxnet(work, args) -> tuple:
    np.bool = bool  # MXNet 1.9.1 still uses the alias NumPy 1.24 removed
    import kvsparse.adapters.mxnet  # noqa: F401  (registers the kvsparse store types)
    import mxnet as mx

    kv = mx.kv.create("dist_sparse")
    shape = (work.fold_rows, wl.DIM)
    kv.init("embedding", mx.nd.sparse.zeros("row_sparse", shape))
    kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=wl.LEARNING_RATE, eps=wl.EPS))
    prepared = {}
    for b, (unique, summed) in enumerate(presummed_batches(work, args)):
        prepared[b] = (
            mx.nd.array(unique, dtype="int64"),
            mx.nd.sparse.row_sparse_array((summed, unique), shape=shape),
        )
    mx.nd.waitall()
    out = mx.nd.sparse.zeros("row_sparse", shape)

    def pull(b):
        kv.row_sparse_pull("embedding", out=out, row_ids=prepared[b][0])
        out.wait_to_read()

    def step(b):
        pull(b)
        kv.push("embedding", prepared[b][1])

    return step, pull


RUNNERS = {"torch": run_torch, "tensorflow": run_tensorflow, "mxnet": run_mxnet}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--framework", choices=sorted(RUNNERS), required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    args = parser.parse_args(argv)
    work = wl.Workload.load(args.workload)
    base_pull, base_push, close = numpy_driven(work, args, unique_inputs=args.framework == "mxnet")
    adapter = RUNNERS[args.framework](work, args)
    times, baseline = interleaved(args, adapter, (base_pull, base_push))
    close()
    common.write_result(args.result, times, baseline_times=baseline)


if __name__ == "__main__":
    sys.exit(main())
