"""Online learning on MovieLens-100k: train on a stream, serve fresh embeddings.

The 100,000 ratings are replayed in timestamp order as a stream of batches.
A torch DeepFM (`movielens_torch.DeepFM`: its embedding tables on a kvsparse
server) trains on each batch under ``kvsparse launch --save-every 5``, which
saves a checkpoint (full, then deltas) every 5 seconds while it trains. Two
serving replicas read the checkpoint directory:

- *followed*: ``kvsparse serve --follow``, which applies each new checkpoint;
- *frozen*: ``kvsparse serve`` started on the first checkpoint and never updated.

Before a batch is trained on, it is scored through each replica
(prequential evaluation: every rating is predicted before the model learns
from it), with the embeddings looked up over ZeroMQ and the dense part of
the model (bias and MLP) as deployed beside them: the trainer's current one
for the followed replica, the one of the first checkpoint for the frozen one.
The example prints the running AUC of both and the followed replica's
freshness (now minus the newest push in the checkpoint it serves), and at
the end both AUCs: the followed replica's must be higher.

Run::

    python examples/online_movielens.py               # launches itself: 1 server, 1 worker
    python examples/online_movielens.py --seconds 30  # a faster replay

The data: see `movielens.find_ml100k` (``pip install --no-deps recbole``).
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import movielens  # noqa: E402 - the sibling module, found through the line above


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="how long the replay of the stream lasts"
    )
    parser.add_argument("--save-every", type=float, default=5.0)
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--sparse-lr", type=float, default=0.05)
    parser.add_argument("--dense-lr", type=float, default=1e-3)
    parser.add_argument("--checkpoint-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def stream(batch_size: int):
    """(ids, labels, timestamps) batches of every rating, in timestamp order."""
    data = movielens.load(test_fraction=0.0)
    # load() permuted the ratings with default_rng(0): undo it to meet their timestamps.
    order = np.random.default_rng(0).permutation(len(data.train_labels))
    ids = np.empty_like(data.train_ids)
    labels = np.empty_like(data.train_labels)
    ids[order], labels[order] = data.train_ids, data.train_labels
    inter = os.path.join(movielens.find_ml100k(), "ml-100k.inter")
    times = np.array([float(r["timestamp"]) for r in movielens._read(inter)])
    by_time = np.argsort(times, kind="stable")
    ids, labels, times = ids[by_time], labels[by_time], times[by_time]
    for start in range(0, len(labels), batch_size):
        end = start + batch_size
        yield ids[start:end], labels[start:end], times[start:end]


class Replica:
    """A ``kvsparse serve`` process on a free port."""

    def __init__(self, checkpoint_dir: str, follow: bool):
        from kvsparse.server.listening import read_first_line
        from kvsparse.serving.server import LISTENING_PREFIX

        argv = [sys.executable, "-m", "kvsparse", "serve", "--checkpoint-dir", checkpoint_dir]
        argv += ["--bind", "tcp://127.0.0.1:0", "--poll-interval", "0.1"]
        if follow:
            argv.append("--follow")
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE)
        line = read_first_line(self.process.stdout, time.monotonic() + 60).decode()
        if not line.startswith(LISTENING_PREFIX):
            self.process.kill()
            raise RuntimeError(f"kvsparse serve did not start: {line!r}")
        self.address = line[len(LISTENING_PREFIX) :].strip()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def score(client, head, ids: np.ndarray):
    """Logits of a batch from a replica's embeddings and a deployed dense head (bias, mlp)."""
    import torch

    first = client.lookup("fm_first", ids, default="initializer")  # (batch, fields, 1)
    vectors = client.lookup("fm_embed", ids, default="initializer")  # (batch, fields, dim)
    summed = vectors.sum(axis=1)
    pairwise = 0.5 * (summed * summed - (vectors * vectors).sum(axis=1)).sum(axis=1)
    bias, mlp = head
    with torch.no_grad():
        deep = mlp(torch.from_numpy(vectors.reshape(len(ids), -1))).squeeze(1).numpy()
    return first.sum(axis=(1, 2)) + float(bias) + pairwise + deep


def worker(args) -> int:
    import torch
    from kvsparse.adapters.torch import push_together
    from movielens_torch import DeepFM
    from torch import nn

    import kvsparse
    from kvsparse import config
    from kvsparse.serving import Client
    from kvsparse.shard.checkpoint import list_manifests

    torch.manual_seed(0)
    torch.set_num_threads(1)
    kv = kvsparse.create("dist_sparse")
    checkpoint_dir = config.checkpoint_dir()
    sparse_optimizer = kvsparse.optimizers.Adagrad(learning_rate=args.sparse_lr)
    model = DeepFM(kv, len(movielens.FIELDS), args.embedding_dim, sparse_optimizer)
    dense_optimizer = torch.optim.Adam(model.parameters(), lr=args.dense_lr)
    loss_function = nn.BCEWithLogitsLoss()
    followed = Replica(checkpoint_dir, follow=True)
    frozen = frozen_client = frozen_head = None
    followed_client = Client([followed.address])
    batches = list(stream(args.batch_size))
    pace = args.seconds / len(batches)
    scored = {"followed": [], "frozen": []}
    labels_seen, freshness = [], []
    print(
        f"{sum(len(b[1]) for b in batches)} ratings in {len(batches)} batches over "
        f"~{args.seconds:g} s; a checkpoint every {args.save_every:g} s into {checkpoint_dir}",
        flush=True,
    )
    try:
        for step, (ids, labels, _) in enumerate(batches):
            started = time.monotonic()
            if frozen is None and list_manifests(checkpoint_dir):
                # The first checkpoint exists: deploy it, with the dense head of now, for good.
                frozen = Replica(checkpoint_dir, follow=False)
                frozen_client = Client([frozen.address])
                frozen_head = (model.bias.detach().clone(), copy.deepcopy(model.mlp))
            served = followed_client.status()[0]
            if frozen is not None and served["version"] is not None:
                head = (model.bias.detach().clone(), model.mlp)
                scored["followed"].append(score(followed_client, head, ids))
                scored["frozen"].append(score(frozen_client, frozen_head, ids))
                labels_seen.append(labels)
                freshness.append(served["freshness_seconds"])
            logits = model(torch.from_numpy(ids))
            loss = loss_function(logits, torch.from_numpy(labels))
            dense_optimizer.zero_grad()
            with push_together(kv):  # the push saves a checkpoint when one is due
                loss.backward()
            dense_optimizer.step()
            if labels_seen and (step % 20 == 0 or step == len(batches) - 1):
                seen = np.concatenate(labels_seen)
                aucs = {k: movielens.auc(seen, np.concatenate(v)) for k, v in scored.items()}
                print(
                    f"batch {step + 1}/{len(batches)}: prequential AUC followed "
                    f"{aucs['followed']:.4f}, frozen {aucs['frozen']:.4f}; serving checkpoint "
                    f"{served['version']['seq']}, freshness {served['freshness_seconds']:.1f} s",
                    flush=True,
                )
            time.sleep(max(0.0, pace - (time.monotonic() - started)))
    finally:
        followed_client.close()
        followed.stop()
        if frozen is not None:
            frozen_client.close()
            frozen.stop()
    seen = np.concatenate(labels_seen)
    aucs = {k: movielens.auc(seen, np.concatenate(v)) for k, v in scored.items()}
    p50, p99 = np.percentile(freshness, [50, 99])
    print(
        f"prequential AUC over {seen.size} ratings: followed replica {aucs['followed']:.4f}, "
        f"frozen replica {aucs['frozen']:.4f}; freshness p50 {p50:.1f} s, p99 {p99:.1f} s",
        flush=True,
    )
    kv.close()
    return 0 if aucs["followed"] > aucs["frozen"] else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    from kvsparse.cluster.launch import launch

    checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="kvsparse-online-")
    command = [sys.executable, os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    return launch(
        command,
        num_servers=1,
        num_workers=1,
        checkpoint_dir=checkpoint_dir,
        save_every=args.save_every,
    )


if __name__ == "__main__":
    sys.exit(main())
