"""Peer: a PyTorch RPC parameter server (torch.distributed.rpc, one owner process per shard).

The pattern of pytorch/examples' distributed/rpc/parameter_server: the worker creates one
`Shard` object on each owner with rpc.remote and calls its methods through the RRef
(``rref.rpc_async().pull(rows)``). A shard is a dense float32 tensor with torch's Adagrad
(state_sum += g^2; w -= lr * g / (sqrt(state_sum) + eps)) applied on the pushed rows.
Dense tensors need a fixed row count, so ids come folded into a `fold_rows` table
(see workload.fold); id f lives on owner f % num_shards at row f // num_shards.

Run by benchmarks/pull_push.py:
    python torch_rpc.py --rank R --world-size S+1 --port P --workload W.npz --result R.json ...
rank 0 is the worker, ranks 1..S the owners.
"""

from __future__ import annotations

import argparse
import sys

import common
import torch
import torch.distributed.rpc as rpc
import workload as wl


class Shard:
    """One owner's slice of the table and its Adagrad state."""

    def __init__(self, rows: int, dim: int, lr: float, eps: float, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.weight = (torch.rand(rows, dim, generator=generator) - 0.5) * 0.1
        self.state_sum = torch.zeros(rows, dim)
        self.lr, self.eps = lr, eps

    def pull(self, rows: torch.Tensor) -> torch.Tensor:
        return self.weight.index_select(0, rows)

    def push(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        state = self.state_sum.index_select(0, rows).addcmul_(grads, grads)
        self.state_sum.index_copy_(0, rows, state)
        self.weight.index_add_(0, rows, grads.div_(state.sqrt_().add_(self.eps)), alpha=-self.lr)


def run_worker(args, num_shards: int) -> None:
    common.log("rpc ready")
    work = wl.Workload.load(args.workload)
    rows_per_shard = -(-work.fold_rows // num_shards)
    shards = [
        rpc.remote(f"owner{s}", Shard, args=(rows_per_shard, wl.DIM, wl.LEARNING_RATE, wl.EPS, s))
        for s in range(num_shards)
    ]
    prepared = {}
    for b in range(common.num_batches(args.warmup, args.steps)):
        unique, summed = common.presummed(work.folded[b], work.grads)
        prepared[b] = (torch.from_numpy(unique), torch.from_numpy(summed))
    common.log("batches prepared")
    out = {}

    def by_owner(unique):
        # Partitioning by owner is the client's work, timed with the requests.
        owner = unique % num_shards
        return [torch.nonzero(owner == s).squeeze(1) for s in range(num_shards)]

    def pull(b):
        unique, _ = prepared[b]
        positions = by_owner(unique)
        futures = [
            shards[s].rpc_async().pull(unique.index_select(0, p) // num_shards)
            for s, p in enumerate(positions)
        ]
        rows = torch.empty(unique.numel(), wl.DIM)
        for p, future in zip(positions, futures):
            rows.index_copy_(0, p, future.wait())
        out["rows"] = rows

    def push(b):
        unique, summed = prepared[b]
        futures = [
            shards[s]
            .rpc_async()
            .push(unique.index_select(0, p) // num_shards, summed.index_select(0, p))
            for s, p in enumerate(by_owner(unique))
        ]
        for future in futures:
            future.wait()

    times = common.run_phases(args.warmup, args.steps, pull, push)
    common.log("phases done")
    common.write_result(args.result, times, threads=torch.get_num_threads())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workload")
    parser.add_argument("--result")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{args.port}", rpc_timeout=300
    )
    name = "worker" if args.rank == 0 else f"owner{args.rank - 1}"
    rpc.init_rpc(name, rank=args.rank, world_size=args.world_size, rpc_backend_options=options)
    if args.rank == 0:
        run_worker(args, args.world_size - 1)
    rpc.shutdown()  # owners serve here until the worker is done
    common.log("rpc shut down")


if __name__ == "__main__":
    sys.exit(main())
