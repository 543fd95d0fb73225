"""``kvsparse server`` / ``python -m kvsparse.server``: the command line of one server process.

It prints exactly one line, ``kvsparse server listening on tcp://HOST:PORT``
(or ``... on ipc:///PATH``), once it is bound, then serves until SIGTERM or
SIGINT. Without ``--bind`` it binds what the environment says
(`kvsparse.config.server_bind_address`), else ``tcp://127.0.0.1:0``.

An ``ipc:///PATH`` server owns the socket file at PATH. ZeroMQ binds over a
stale file (left by a server that was killed), but it would as silently bind
over the file of a server that still runs and take its workers: so the
server first checks that nothing answers at PATH (exit 1, "cannot bind",
otherwise). ZeroMQ does not remove the file when the socket closes; the
server does, when it stops, unless another server has replaced it since.

``--max-reply-bytes``, ``--max-unread-reply-bytes``, ``--max-tables``,
``--max-dim``, ``--max-rows-per-request`` and ``--checkpoint-root`` bound
what one peer may make the server do (`kvsparse.config.ServerLimits`; each
defaults to its ``KVSPARSE_*`` variable, else the documented default; see
docs/operations.md "Server limits"). ``--memory-budget`` and ``--spill-dir``
bound the shard's memory and give it a disk tier (`kvsparse.shard.tier`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import stat
import sys
from typing import Optional

import zmq

from kvsparse import config, errors
from kvsparse.server.limits import human_bytes
from kvsparse.server.listening import LISTENING_PREFIX
from kvsparse.server.loop import DEFAULT_MAX_MESSAGE_SIZE
from kvsparse.server.server import Server


def _port(text: str) -> int:
    try:
        port = int(text, 10)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in 0..65535, got {text!r}")
    return port


def _count(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvsparse.config.ServerLimits` (unset: the environment, else the default)."""
    defaults = config.ServerLimits()
    limits = parser.add_argument_group(
        "limits",
        "What one peer may make this server do; a request beyond a limit gets a LimitExceeded "
        "error naming it and the server goes on serving. Each defaults to its KVSPARSE_* "
        "variable, else the value shown. Sizes take suffixes: 512MiB, 1GiB.",
    )
    config.SETTINGS["max_reply_bytes"].add_argument(
        limits,
        "largest reply one request may ask for, checked before any work (a pull of N ids "
        f"of dim D is N*D*4 bytes) (KVSPARSE_MAX_REPLY_BYTES; default: "
        f"{human_bytes(defaults.max_reply_bytes)})",
    )
    config.SETTINGS["max_unread_reply_bytes"].add_argument(
        limits,
        "replies one connection may leave unread in the server; further pulls are refused "
        f"until it reads (KVSPARSE_MAX_UNREAD_REPLY_BYTES; default: "
        f"{human_bytes(defaults.max_unread_reply_bytes)})",
    )
    limits.add_argument(
        "--max-tables",
        type=_count,
        metavar="N",
        help="sparse tables and dense keys this server holds (KVSPARSE_MAX_TABLES; default: "
        f"{defaults.max_tables})",
    )
    limits.add_argument(
        "--max-dim",
        type=_count,
        metavar="N",
        help=f"widest sparse table (KVSPARSE_MAX_DIM; default and most: {defaults.max_dim})",
    )
    limits.add_argument(
        "--max-rows-per-request",
        type=_count,
        metavar="N",
        help="ids in one pull or push, summed over its tables (KVSPARSE_MAX_ROWS_PER_REQUEST; "
        f"default: {defaults.max_rows_per_request:,})",
    )
    limits.add_argument(
        "--checkpoint-root",
        metavar="DIR",
        help="saves, loads and exports requested by clients must lie in DIR (after symlinks "
        "and '..'); relative paths are taken inside it (KVSPARSE_CHECKPOINT_ROOT). Without "
        "one, a server reachable from other hosts without --keys refuses checkpoint requests; "
        "one bound to loopback or ipc://, or with --keys, accepts any path",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsparse server",
        description="Serve one shard of kvsparse tables over ZeroMQ.",
    )
    parser.add_argument(
        "--bind",
        default=None,
        help="ZeroMQ endpoint to bind, e.g. tcp://127.0.0.1:5701 (port 0: a free port) or "
        "ipc:///absolute/path (a Unix socket, for workers on this host). "
        "Default: KVSPARSE_BIND or this process's entry of the cluster configuration, "
        "else tcp://127.0.0.1:0.",
    )
    parser.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="CurveZMQ key directory made by `kvsparse keys DIR`: encrypt all traffic and "
        "accept only clients whose public key is in DIR (default: KVSPARSE_KEYS, else none)",
    )
    parser.add_argument(
        "--restarted",
        action="store_true",
        help="this server replaces one that died (kvsparse launch --restart-servers sets it): "
        "pushes of a BSP step the dead server completed are applied alone",
    )
    parser.add_argument(
        "--no-fast-path",
        action="store_true",
        help="serve every request in Python: no C++ thread answering pulls and pushes "
        "without the GIL (also KVSPARSE_FAST_PATH=0; for comparisons, or to fall back)",
    )
    config.SETTINGS["max_message_size"].add_argument(
        parser,
        "largest message frame accepted; a bigger one drops the sender's connection "
        f"(default: {DEFAULT_MAX_MESSAGE_SIZE}; -1: no limit)",
        default=DEFAULT_MAX_MESSAGE_SIZE,
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (0: a free port, printed; "
        "default: no metrics endpoint; needs prometheus-client)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="interface of the metrics endpoint (default: 127.0.0.1; 0.0.0.0 in a container)",
    )
    parser.add_argument(
        "--restore",
        default=None,
        metavar="PATH",
        help="before serving, load the latest complete checkpoint in PATH (base + deltas) "
        "for this shard (needs --shard-index and --num-shards)",
    )
    parser.add_argument("--shard-index", type=int, default=None, metavar="I")
    parser.add_argument("--num-shards", type=int, default=None, metavar="N")
    _limit_arguments(parser)
    tier_arguments(parser)
    return parser


def tier_arguments(parser: argparse.ArgumentParser) -> None:
    """``--memory-budget`` and ``--spill-dir`` (unset: their KVSPARSE_* variables)."""
    tier = parser.add_argument_group(
        "memory",
        "How much memory the shard may use, and where rows beyond it go (docs/operations.md, "
        '"Memory budget and disk tier").',
    )
    config.SETTINGS["memory_budget"].add_argument(
        tier,
        "memory the shard's tables, optimizer slots and dense keys may hold, e.g. 512MiB, "
        "8GiB (KVSPARSE_MEMORY_BUDGET; default: none). Without --spill-dir an insert past it "
        "is refused with LimitExceeded and the server goes on serving",
    )
    tier.add_argument(
        "--spill-dir",
        default=None,
        metavar="DIR",
        help="disk tier: with --memory-budget, the coldest rows move to files under DIR "
        "(the server's own subdirectory, removed when it stops) (KVSPARSE_SPILL_DIR)",
    )


def _socket_in_use(path: str) -> bool:
    """True if a process accepts connections on the Unix socket at path."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if not stat.S_ISSOCK(mode):
        return False  # not a socket: ZeroMQ's bind reports what is wrong
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return False  # ECONNREFUSED: a stale file, which ZeroMQ's bind replaces
    finally:
        probe.close()
    return True


def _file_identity(path: Optional[str]) -> Optional[tuple]:
    if path is None:
        return None
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _remove_socket_file(path: Optional[str], identity: Optional[tuple]) -> None:
    """Removes the socket file this server bound, unless another one has replaced it."""
    if identity is not None and _file_identity(path) == identity:
        with contextlib.suppress(OSError):
            os.unlink(path)


def main(argv=None) -> int:
    """``kvsparse server``: serve one shard until SIGTERM/SIGINT.

    Args:
        argv: command-line arguments (default: sys.argv[1:]); ``--bind ADDRESS``.

    Returns:
        The exit status (0 after a clean stop, 1 if the address cannot be bound,
        2 for a usage error such as a malformed address).

    Example:
        $ kvsparse server --bind tcp://127.0.0.1:0
        kvsparse server listening on tcp://127.0.0.1:40123
    """
    args = _parser().parse_args(argv)
    if args.restore is not None and (
        args.shard_index is None
        or args.num_shards is None
        or not 0 <= args.shard_index < args.num_shards
    ):
        print("kvsparse server: --restore needs --shard-index I --num-shards N", file=sys.stderr)
        return 2
    try:
        # The one place a server process reads its environment: flags first.
        settings = config.ServerSettings.from_environment(
            keys=args.keys,
            fast_path=False if args.no_fast_path else None,
            max_reply_bytes=args.max_reply_bytes,
            max_unread_reply_bytes=args.max_unread_reply_bytes,
            max_tables=args.max_tables,
            max_dim=args.max_dim,
            max_rows_per_request=args.max_rows_per_request,
            checkpoint_root=args.checkpoint_root,
            memory_budget=args.memory_budget,
            spill_dir=args.spill_dir,
        )
        if args.bind is not None:
            bind = config.parse_bind_address(args.bind, "--bind")
        else:
            bind = config.server_bind_address() or "tcp://127.0.0.1:0"
    except errors.InvalidArgument as exc:
        print(f"kvsparse server: {exc}", file=sys.stderr)
        return 2
    socket_file = config.ipc_path(bind)
    if socket_file is not None and _socket_in_use(socket_file):
        print(
            f"kvsparse server: cannot bind {bind}: a server already listens on that socket",
            file=sys.stderr,
        )
        return 1
    try:
        server = Server(
            bind,
            keys=settings.keys,
            max_message_size=args.max_message_size,
            restarted=args.restarted,
            limits=settings.limits,
            heartbeat_timeout=settings.heartbeat_timeout,
            fast_path=settings.fast_path,
            memory_budget=settings.memory_budget,
            spill_dir=settings.spill_dir,
        )
    except zmq.ZMQError as exc:
        print(f"kvsparse server: cannot bind {bind}: {exc}", file=sys.stderr)
        return 1
    except errors.KVSparseError as exc:
        print(f"kvsparse server: {exc}", file=sys.stderr)
        return 2
    socket_identity = _file_identity(socket_file)
    try:
        return _serve(server, args)
    finally:
        _remove_socket_file(socket_file, socket_identity)


def _serve(server: Server, args: argparse.Namespace) -> int:
    """Restores, starts the metrics endpoint, prints the listening line and serves; closes."""
    if args.restore is not None:
        try:
            server.restore(args.restore, args.shard_index, args.num_shards)
        except errors.KVSparseError as exc:
            server.close()
            print(f"kvsparse server: cannot restore: {exc}", file=sys.stderr)
            return 2

    httpd = None
    if args.metrics_port is not None:
        from kvsparse.server import metrics

        try:
            httpd, _, metrics_port = metrics.start_http_server(
                server.metrics_channel, args.metrics_port, args.metrics_host
            )
        except (ImportError, OSError) as exc:
            server.close()
            print(f"kvsparse server: cannot serve metrics: {exc}", file=sys.stderr)
            return 1

    def stop(signum, frame):
        server.stop()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    # The C-level handler may run on a thread other than the one blocked in zmq_poll
    # (OpenBLAS, ZeroMQ's own); the wakeup fd wakes the poll wherever it lands.
    previous_wakeup = signal.set_wakeup_fd(server.wakeup_fd)
    try:
        print(f"{LISTENING_PREFIX}{server.address}", flush=True)
        if httpd is not None:
            host = args.metrics_host if ":" not in args.metrics_host else f"[{args.metrics_host}]"
            print(f"kvsparse metrics on http://{host}:{metrics_port}/metrics", flush=True)
        server.serve()
    finally:
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        signal.set_wakeup_fd(previous_wakeup)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
