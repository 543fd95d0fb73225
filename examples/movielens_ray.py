"""The MovieLens DeepFM model (examples/movielens_torch.py) trained on Ray.

The kvsparse servers run as Ray actors (`kvsparse.ray.start_servers`: one per
shard, placed by a placement group), the workers as Ray tasks; each task runs
the PyTorch example's ``main`` with its rank's cluster configuration. Needs
``pip install kvsparse[ray] torch``.

Run (a local Ray instance on this machine)::

    python examples/movielens_ray.py --num-servers 2 --num-workers 2

or on a running cluster (every node must be able to import kvsparse, torch and
the examples folder)::

    python examples/movielens_ray.py --address auto

It prints rank 0's progress (through Ray's log forwarding) and finally
``held-out AUC: 0.xxxx``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time

import ray

import kvsparse.ray

EXAMPLES = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(EXAMPLES)


@ray.remote(num_cpus=1)
def train(environment: dict, argv: list) -> str:
    """One worker: movielens_torch.main(argv) with this rank's KVSPARSE_* variables.

    Returns what it printed (rank 0 prints the held-out AUC).
    """
    sys.path.insert(0, EXAMPLES)
    import movielens_torch

    # kvsparse.create('dist_sparse') in main() reads the configuration from the environment.
    saved = {k: os.environ.get(k) for k in environment}
    os.environ.update(environment)
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(_Tee(sys.stdout, output)):
            movielens_torch.main(argv)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return output.getvalue()


class _Tee:
    """Writes to two streams: Ray forwards the first to the driver, the second is returned."""

    def __init__(self, *streams):
        self._streams = streams

    def write(self, text: str) -> int:
        for stream in self._streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self._streams:
            stream.flush()

    def isatty(self) -> bool:
        return False


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-servers", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument(
        "--address", default=None, help="Ray cluster to join (e.g. 'auto'); default: start one"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface the servers bind and advertise; '' for each node's IP (multi-node)",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=512, help="per worker")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # The workers import kvsparse and the example modules from this checkout.
    path = os.pathsep.join([REPO_ROOT, EXAMPLES, os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    runtime_env = {"env_vars": {"PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}}
    if args.address is None:
        ray.init(
            num_cpus=args.num_servers + args.num_workers,
            include_dashboard=False,
            object_store_memory=100 * 2**20,
            runtime_env=runtime_env,
        )
    else:
        ray.init(address=args.address, runtime_env=runtime_env)
    started = time.perf_counter()
    servers = kvsparse.ray.start_servers(args.num_servers, host=args.host or None)
    try:
        print(f"servers (Ray actors): {servers.addresses}", flush=True)
        worker_argv = ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size)]
        outputs = ray.get(
            [
                train.remote(servers.environment(rank, args.num_workers), worker_argv)
                for rank in range(args.num_workers)
            ]
        )
    finally:
        servers.shutdown()
        ray.shutdown()
    lines = [line for line in outputs[0].splitlines() if line.startswith("held-out AUC:")]
    print(f"done in {time.perf_counter() - started:.1f} s", flush=True)
    if not lines:
        print("rank 0 printed no held-out AUC", file=sys.stderr)
        return 1
    print(lines[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
