"""DeepFM on MovieLens-100k with TensorFlow (Keras) and kvsparse tables.

The two sparse tables ('fm_first', dim 1, and 'fm_embed', dim 16, over the ids
of all nine fields) live on the kvsparse servers and are trained there by
their own Adagrad; the MLP and the bias are Keras weights, trained by Adam
on every worker after their gradients are averaged over the workers through
the store (`DistributedOptimizer`).

Run (two servers, two workers):
    python -m kvsparse launch -s 2 -n 2 -- python examples/movielens_tensorflow.py
Quick check without servers:
    python examples/movielens_tensorflow.py --local

Prints a progress bar on rank 0, then ``held-out AUC: 0.xxxx``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import movielens  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from kvsparse.adapters import tensorflow as kvtf  # noqa: E402
from tqdm import tqdm  # noqa: E402

import kvsparse  # noqa: E402
from kvsparse import initializers, optimizers  # noqa: E402


class DeepFM(keras.Model):
    """logit = bias + sum of first-order weights + FM pair interactions + MLP(embeddings)."""

    def __init__(self, kv, num_fields: int, dim: int, table_optimizer):
        super().__init__()
        self.num_fields, self.dim = num_fields, dim
        self.first = kvtf.Embedding(
            kv, "fm_first", 1, initializer=initializers.Zeros(), optimizer=table_optimizer
        )
        self.embed = kvtf.Embedding(
            kv,
            "fm_embed",
            dim,
            initializer=initializers.Normal(0.0, 0.01),
            optimizer=table_optimizer,
            seed=1,
        )
        self.mlp = keras.Sequential(
            [
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        self.bias = self.add_weight(shape=(), initializer="zeros", name="bias")

    def call(self, ids, training=False):
        first = tf.reduce_sum(self.first(ids), axis=[1, 2])
        vectors = self.embed(ids)  # (batch, fields, dim)
        summed = tf.reduce_sum(vectors, axis=1)
        pairs = 0.5 * tf.reduce_sum(summed * summed - tf.reduce_sum(vectors * vectors, 1), 1)
        deep = self.mlp(tf.reshape(vectors, [-1, self.num_fields * self.dim]), training=training)
        return self.bias + first + pairs + tf.squeeze(deep, -1)


class _Lines:
    """tqdm output as one line per refresh, for logs that are read line by line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        text = text.replace("\r", "").strip("\n")
        if text.strip():
            self.stream.write(text + "\n")

    def flush(self):
        self.stream.flush()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--local", action="store_true", help="use kvsparse.create('local')")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    kv = kvsparse.create("local") if args.local else kvsparse.create("dist_sparse")
    rank, workers = kv.rank, kv.num_workers
    data = movielens.load(seed=args.seed)
    ids, labels = data.shard(rank, workers)
    # A BSP step waits for every worker: all must run the same number of steps.
    per_worker = len(data.train_labels) // workers
    ids, labels = ids[:per_worker], labels[:per_worker]

    keras.utils.set_random_seed(args.seed)  # the same dense start on every worker
    # Each BSP step applies the sum of the workers' gradients; rescale to their mean.
    table_optimizer = optimizers.Adagrad(learning_rate=0.05, rescale_grad=1.0 / workers)
    model = DeepFM(kv, len(data.fields), args.dim, table_optimizer)
    optimizer = kvtf.DistributedOptimizer(keras.optimizers.Adam(learning_rate=1e-3), kv)

    @tf.function
    def train_step(batch_ids, batch_labels):
        with tf.GradientTape() as tape:
            logits = model(batch_ids, training=True)
            loss = tf.reduce_mean(
                tf.nn.sigmoid_cross_entropy_with_logits(labels=batch_labels, logits=logits)
            )
        variables = model.trainable_variables
        optimizer.apply(tape.gradient(loss, variables), variables)
        return loss

    @tf.function
    def predict(batch_ids):
        return tf.sigmoid(model(batch_ids))

    steps = -(-per_worker // args.batch_size) * args.epochs
    stream = sys.stdout if sys.stdout.isatty() else _Lines(sys.stdout)
    bar = tqdm(total=steps, desc="train", file=stream, mininterval=3.0, disable=rank != 0)
    started = time.perf_counter()
    for epoch in range(args.epochs):
        for batch_ids, batch_labels in movielens.batches(
            ids, labels, args.batch_size, seed=args.seed + epoch
        ):
            loss = train_step(tf.constant(batch_ids), tf.constant(batch_labels))
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{float(loss):.4f}", refresh=False)
    bar.close()
    seconds = time.perf_counter() - started

    scores = np.concatenate(
        [
            predict(tf.constant(data.test_ids[start : start + 4096])).numpy()
            for start in range(0, len(data.test_labels), 4096)
        ]
    )
    score = movielens.auc(data.test_labels, scores)
    if rank == 0:
        print(f"trained {steps} steps on {workers} worker(s) in {seconds:.1f} s")
        print(f"held-out AUC: {score:.4f}", flush=True)
    kv.barrier()
    kv.close()
    return score


if __name__ == "__main__":
    main()
