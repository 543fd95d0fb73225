"""``kvsparse serve``: a read-only lookup replica over a checkpoint (or export) directory.

Usage::

    kvsparse serve --checkpoint-dir DIR --bind tcp://127.0.0.1:7100 \\
        [--http-port 8080] [--follow] [--tables user,item] [--shard 0/2]

It loads the newest complete checkpoint in DIR (or the export there),
prints ``kvsparse serve listening on ADDRESS`` (and ``kvsparse serve http on
URL`` with --http-port) on stdout, and answers lookups until SIGINT or
SIGTERM. With --follow it polls DIR and applies each new checkpoint
atomically (`kvsparse.serving.follow`); it may then start before the first
checkpoint exists. Log lines (each checkpoint applied or refused) go to stderr.

Exit codes: 0 after a signal; 1 if nothing could be loaded or bound; 2 for
a usage error.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Optional

from kvsparse import config as cluster_config
from kvsparse import errors
from kvsparse.serving.server import (
    DEFAULT_APPLY_NICENESS,
    DEFAULT_MAX_BATCH,
    DEFAULT_WORKERS,
    HTTP_PREFIX,
    LISTENING_PREFIX,
    ServingConfig,
    ServingServer,
)
from kvsparse.serving.state import Selection


def _shard(text: str) -> tuple:
    index, sep, count = text.partition("/")
    try:
        index, count = int(index), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N (e.g. 0/2), got {text!r}") from None
    if not sep or count < 1 or not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N, got {text!r}")
    return index, count


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvsparse serve``."""
    p = argparse.ArgumentParser(
        prog="kvsparse serve",
        description="Serve lookups from a checkpoint (or export) directory over ZeroMQ "
        "(kvsparse.serving.Client) and HTTP (POST /v1/lookup, GET /healthz, GET /metrics).",
    )
    p.add_argument("--checkpoint-dir", required=True, metavar="DIR")
    p.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ address (port 0: free)")
    p.add_argument("--http-port", type=int, default=None, metavar="P", help="HTTP port (0: free)")
    p.add_argument("--http-host", default=None, help="HTTP interface (default: --bind's host)")
    p.add_argument("--follow", action="store_true", help="apply each new checkpoint in DIR")
    p.add_argument("--poll-interval", type=float, default=0.2, metavar="SECONDS")
    p.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="CurveZMQ key directory (kvsparse keys DIR): lookups over ZeroMQ are encrypted and "
        "only its clients are served (default: KVSPARSE_KEYS, else none); give clients "
        "kvsparse.serving.Client(addresses, keys=DIR)",
    )
    p.add_argument("--tables", default=None, help="serve only these tables (comma-separated)")
    p.add_argument(
        "--shard",
        type=_shard,
        default=None,
        metavar="I/N",
        help="serve only the ids of hash shard I of N (as training places them)",
    )
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, metavar="IDS")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="ZeroMQ worker threads")
    p.add_argument(
        "--apply-niceness",
        type=int,
        default=DEFAULT_APPLY_NICENESS,
        metavar="N",
        help="lower the CPU priority of the thread applying checkpoints by N, so that "
        "lookups go first on busy cores (Linux; 0: don't)",
    )
    cluster_config.SETTINGS["memory_budget"].add_argument(
        p,
        "memory the served tables may hold, e.g. 8GiB; each of the two copies of the "
        "tables (the one served and the one a new checkpoint is applied to) gets half "
        "(KVSPARSE_MEMORY_BUDGET; default: none)",
    )
    p.add_argument(
        "--spill-dir",
        default=None,
        metavar="DIR",
        help="with --memory-budget: rows beyond it move to files under DIR, so that a table "
        "larger than memory is served (KVSPARSE_SPILL_DIR)",
    )
    return p


def main(argv: Optional[list] = None) -> int:
    """Runs ``kvsparse serve`` until SIGINT/SIGTERM; returns the exit code.

    Main thread only (it installs the signal handlers).
    """
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s kvsparse serve: %(message)s"
    )
    tables = None
    if args.tables:
        tables = frozenset(t for t in args.tables.split(",") if t)
    try:
        memory_budget, spill_dir = cluster_config.memory_tier(
            None, args.memory_budget, args.spill_dir
        )
    except errors.InvalidArgument as exc:
        print(f"kvsparse serve: error: {exc}", file=sys.stderr)
        return 2
    config = ServingConfig(
        path=args.checkpoint_dir,
        bind=args.bind,
        http_port=args.http_port,
        http_host=args.http_host,
        follow=args.follow,
        selection=Selection(tables, args.shard),
        poll_interval=args.poll_interval,
        max_batch=args.max_batch,
        workers=args.workers,
        apply_niceness=args.apply_niceness,
        keys=args.keys if args.keys is not None else cluster_config.curve_keys(),
        memory_budget=memory_budget,
        spill_dir=spill_dir,
    )
    try:
        server = ServingServer(config)
    except (errors.MissingDependency, errors.StorageError) as exc:
        print(f"kvsparse serve: error: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        server.start()
    except (errors.KVSparseError, OSError, Exception) as exc:  # noqa: BLE001 - one line out
        print(f"kvsparse serve: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        server.stop()
        return 1
    print(LISTENING_PREFIX + server.address, flush=True)
    if server.http_url is not None:
        print(HTTP_PREFIX + server.http_url, flush=True)
    while not stop.wait(1.0):
        pass
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
