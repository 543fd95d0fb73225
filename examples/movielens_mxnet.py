"""DeepFM click-through-rate model on MovieLens-100k, with MXNet Gluon and kvsparse.

The model is plain Gluon: two ``row_sparse`` Parameters (a first-order weight
and a 16-wide vector per feature id, over all nine fields' ids) and an MLP,
trained by ``gluon.Trainer(..., kvstore=mx.kv.create('dist_sparse'))``. Importing
kvsparse.adapters.mxnet makes that store a kvsparse one: the Trainer's Adam runs on
the kvsparse servers, for the tables (only the rows of each batch travel) and for
the dense weights alike, as with MXNet's own distributed stores.

A Gluon Parameter has a fixed shape, so the hashed feature ids (any int64) are
folded into ``--rows`` rows (2**18 by default: about 2,700 distinct features, so
collisions are rare). The servers only hold the rows MXNet initialized; MXNet
initializes all of them, so the servers hold rows x (16 + 1) floats.

Run (two servers, two workers on this host)::

    python -m kvsparse launch -s 2 -n 2 -- python examples/movielens_mxnet.py

or without servers, for a quick look::

    python examples/movielens_mxnet.py --local

Rank 0 prints a progress bar, then ``held-out AUC: 0.xxxx`` on the 20% of
ratings held out (label: rating >= 4).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Small model, two cores shared by workers and servers: one compute thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MXNET_CPU_WORKER_NTHREADS", "1")
os.environ.setdefault("MXNET_STORAGE_FALLBACK_LOG_VERBOSE", "0")

import kvsparse.adapters.mxnet as kvsparse_mxnet  # noqa: E402 - first: sets np.bool for mxnet

# isort: split
import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import movielens  # noqa: E402 - the sibling module, found through the line above


class DeepFM(gluon.Block):
    """FM (first order + pairwise interactions) plus an MLP over the field embeddings."""

    def __init__(self, rows: int, num_fields: int, embedding_dim: int, hidden=(64, 32), **kw):
        super().__init__(**kw)
        self.rows, self.embedding_dim = rows, embedding_dim
        with self.name_scope():
            self.fm_first = self.params.get(
                "fm_first",
                shape=(rows, 1),
                stype="row_sparse",
                grad_stype="row_sparse",
                init=mx.init.Zero(),
            )
            self.fm_embed = self.params.get(
                "fm_embed",
                shape=(rows, embedding_dim),
                stype="row_sparse",
                grad_stype="row_sparse",
                init=mx.init.Normal(0.01),
            )
            self.bias = self.params.get("bias", shape=(1,), init=mx.init.Zero())
            self.mlp = gluon.nn.Sequential()
            width = num_fields * embedding_dim
            for size in hidden:
                self.mlp.add(gluon.nn.Dense(size, activation="relu", in_units=width))
                width = size
            self.mlp.add(gluon.nn.Dense(1, in_units=width))

    def forward(self, rows):
        """Logits of a (batch, fields) NDArray of row numbers."""
        # row_sparse_data pulls exactly the rows of this batch from the servers.
        first = nd.Embedding(
            rows, self.fm_first.row_sparse_data(rows), self.rows, 1, sparse_grad=True
        ).sum(axis=(1, 2))
        vectors = nd.Embedding(
            rows,
            self.fm_embed.row_sparse_data(rows),
            self.rows,
            self.embedding_dim,
            sparse_grad=True,
        )  # (batch, fields, dim)
        summed = vectors.sum(axis=1)
        pairwise = 0.5 * (summed * summed - (vectors * vectors).sum(axis=1)).sum(axis=1)
        deep = self.mlp(vectors.reshape((0, -1))).reshape((-1,))
        return first + pairwise + deep + self.bias.data()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=512, help="per worker")
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--rows", type=int, default=2**18, help="rows of each Gluon table")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam, on the servers")
    parser.add_argument("--local", action="store_true", help="kvsparse's local store: no servers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--table-dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16"],
        help="how the servers store the two tables; Gluon computes in float32",
    )
    return parser.parse_args(argv)


def to_rows(ids: np.ndarray, rows: int):
    """Hashed int64 feature ids -> row numbers of the Gluon tables (float32 holds them exactly)."""
    return nd.array(np.mod(ids, rows), dtype=np.float32)


def evaluate(model: DeepFM, ids: np.ndarray, labels: np.ndarray, batch_size: int = 4096) -> float:
    """Held-out AUC (pulls only: nothing pushed)."""
    scores = []
    for start in range(0, len(labels), batch_size):
        scores.append(model(to_rows(ids[start : start + batch_size], model.rows)).asnumpy())
    return movielens.auc(labels, np.concatenate(scores))


def main(argv=None) -> int:
    args = parse_args(argv)
    mx.random.seed(args.seed)  # the same initial weights everywhere (rank 0's are used anyway)
    kv = kvsparse_mxnet.create("local") if args.local else mx.kv.create("dist_sparse")
    kv.table_dtype = args.table_dtype  # the tables' storage on the servers
    rank, num_workers = kv.rank, kv.num_workers
    data = movielens.load()
    train_ids, train_labels = data.equal_shard(rank, num_workers)

    model = DeepFM(args.rows, len(data.fields), args.embedding_dim)
    model.initialize()
    # The servers add the workers' gradients: normalize by the global batch. Gluon hands
    # the optimizer to a distributed store at the first row_sparse_data() and refuses to
    # change its rescale_grad later, so it is fixed here and every step() passes 1.
    trainer = gluon.Trainer(
        model.collect_params(),
        "adam",
        {"learning_rate": args.lr, "rescale_grad": 1.0 / (args.batch_size * num_workers)},
        kvstore=kv,
    )
    loss_function = gluon.loss.SigmoidBinaryCrossEntropyLoss()

    steps_per_epoch = -(-len(train_labels) // args.batch_size)
    started = time.perf_counter()
    movielens.announce(kv, data)
    for epoch in range(args.epochs):
        progress = movielens.epoch_progress(epoch, args.epochs, steps_per_epoch, rank)
        seed = args.seed * 1000 + epoch * num_workers + rank
        for batch_ids, batch_labels in movielens.batches(
            train_ids, train_labels, args.batch_size, seed
        ):
            rows = to_rows(batch_ids, args.rows)
            labels = nd.array(batch_labels)
            with autograd.record():
                loss = loss_function(model(rows), labels)
            loss.backward()
            trainer.step(1)  # rescale_grad is set above (a short last batch weighs less)
            progress.set_postfix(loss=f"{loss.mean().asscalar():.4f}", refresh=False)
            progress.update(1)
        progress.close()
    if rank == 0:
        score = evaluate(model, data.test_ids, data.test_labels)
        print(f"trained in {time.perf_counter() - started:.1f} s", flush=True)
        print(f"held-out AUC: {score:.4f}", flush=True)
    kv.barrier()  # the other workers wait for the evaluation: the servers stay up meanwhile
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
