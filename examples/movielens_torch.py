"""DeepFM click-through-rate model on MovieLens-100k, with PyTorch and kvsparse.

The two embedding tables (a first-order weight per feature id and a 16-wide
vector per feature id, over all nine fields' hashed ids) live on kvsparse
servers and are trained there by Adagrad; the dense part (FM bias and an MLP)
stays with torch.optim.Adam, its gradients averaged over the workers through
the store.

Run (two servers, two workers on this host)::

    python -m kvsparse launch -s 2 -n 2 -- python examples/movielens_torch.py

or without servers, for a quick look::

    python examples/movielens_torch.py --local

Rank 0 prints a progress bar, then ``held-out AUC: 0.xxxx`` on the 20% of
ratings held out (label: rating >= 4).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
from kvsparse.adapters.torch import DenseGradientSync, Embedding, prefetch_together, push_together
from torch import nn

import kvsparse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import movielens  # noqa: E402 - the sibling module, found through the line above


class DeepFM(nn.Module):
    """FM (first order + pairwise interactions) plus an MLP over the field embeddings."""

    def __init__(self, kv, num_fields: int, embedding_dim: int, sparse_optimizer, hidden=(64, 32)):
        super().__init__()
        self.first_order = Embedding(
            kv,
            "fm_first",
            embedding_dim=1,
            initializer=kvsparse.initializers.Zeros(),
            optimizer=sparse_optimizer,
        )
        self.embedding = Embedding(
            kv,
            "fm_embed",
            embedding_dim=embedding_dim,
            initializer=kvsparse.initializers.Normal(0.0, 0.01),
            optimizer=sparse_optimizer,
            seed=1,
        )
        self.bias = nn.Parameter(torch.zeros(1))
        layers, width = [], num_fields * embedding_dim
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of a (batch, fields) tensor of feature ids."""
        first = self.first_order(ids).sum(dim=(1, 2)) + self.bias
        vectors = self.embedding(ids)  # (batch, fields, dim)
        summed = vectors.sum(dim=1)
        pairwise = 0.5 * (summed * summed - (vectors * vectors).sum(dim=1)).sum(dim=1)
        deep = self.mlp(vectors.flatten(1)).squeeze(1)
        return first + pairwise + deep

    def prefetch(self, ids: torch.Tensor) -> None:
        """Starts pulling the next batch's rows of both tables in the background (one
        request per server for both)."""
        prefetch_together([self.first_order, self.embedding], ids)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=512, help="per worker")
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--sparse-lr", type=float, default=0.05, help="Adagrad, on the servers")
    parser.add_argument("--dense-lr", type=float, default=1e-3, help="Adam, on the workers")
    parser.add_argument(
        "--local", action="store_true", help="use kvsparse.create('local'): no servers"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_false",
        help="pull each batch's rows in its forward instead of in the background",
    )
    return parser.parse_args(argv)


def evaluate(model: DeepFM, ids: np.ndarray, labels: np.ndarray, batch_size: int = 4096) -> float:
    """Held-out AUC (pulls only: no gradient, nothing pushed)."""
    scores = []
    with torch.no_grad():
        for start in range(0, len(labels), batch_size):
            scores.append(model(torch.from_numpy(ids[start : start + batch_size])).numpy())
    return movielens.auc(labels, np.concatenate(scores))


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # the same dense initial weights on every worker
    # One thread: the model is small, and workers and servers share the cores
    # (with more, torch threads of two workers contend: ~10x slower steps on 2 cores).
    torch.set_num_threads(1)
    kv = kvsparse.create("local") if args.local else kvsparse.create("dist_sparse")
    rank, num_workers = kv.rank, kv.num_workers
    data = movielens.load()
    train_ids, train_labels = data.equal_shard(rank, num_workers)

    # The servers add the workers' sparse gradients; rescale to their mean,
    # matching the dense side's average.
    sparse_optimizer = kvsparse.optimizers.Adagrad(
        learning_rate=args.sparse_lr, rescale_grad=1.0 / num_workers
    )
    model = DeepFM(kv, len(data.fields), args.embedding_dim, sparse_optimizer)
    dense_sync = DenseGradientSync(kv, model.parameters(), key="deepfm_dense")
    dense_optimizer = torch.optim.Adam(model.parameters(), lr=args.dense_lr)
    loss_function = nn.BCEWithLogitsLoss()

    steps_per_epoch = -(-len(train_labels) // args.batch_size)
    started = time.perf_counter()
    movielens.announce(kv, data)
    for epoch in range(args.epochs):
        progress = movielens.epoch_progress(epoch, args.epochs, steps_per_epoch, rank)
        seed = args.seed * 1000 + epoch * num_workers + rank
        epoch_batches = list(movielens.batches(train_ids, train_labels, args.batch_size, seed))
        for step, (batch_ids, batch_labels) in enumerate(epoch_batches):
            logits = model(torch.from_numpy(batch_ids))
            loss = loss_function(logits, torch.from_numpy(batch_labels))
            dense_optimizer.zero_grad()
            # Both tables' gradients: one request per server, sent without waiting for
            # the servers' acknowledgements (the next store call collects them).
            with push_together(kv, wait=False):
                loss.backward()
            if args.prefetch and step + 1 < len(epoch_batches):
                # After the push, so the rows it pulls include this step's update
                # (BSP: every worker's). With one worker (or ASP/SSP) the pull goes
                # out right behind the push and the next forward reads it; else it
                # runs on a thread. Either way it overlaps the dense update below.
                model.prefetch(torch.from_numpy(epoch_batches[step + 1][0]))
            dense_sync.synchronize()
            dense_optimizer.step()
            progress.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
            progress.update(1)
        progress.close()
    if rank == 0:
        print(
            f"trained in {time.perf_counter() - started:.1f} s; "
            f"{model.embedding.prefetch_hits} batches used prefetched rows",
            flush=True,
        )
        score = evaluate(model, data.test_ids, data.test_labels)
        print(f"held-out AUC: {score:.4f}", flush=True)
    kv.barrier()  # the other workers wait for the evaluation: the servers stay up meanwhile
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
