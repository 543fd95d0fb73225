"""The ``kvsparse`` command (also ``python -m kvsparse``).

Usage::

    kvsparse launch -s 2 -n 2 -- python train.py   # servers + workers on this host
    kvsparse launch --transport ipc -s 2 -n 2 -- python train.py   # over Unix sockets
    kvsparse launch --nnodes 2 --node-rank 0 --rendezvous tcp://node0:29400 \
        -s 2 -n 4 -- python train.py                # this host's part of a 2-host job
    kvsparse server --bind tcp://0.0.0.0:7000       # one server (shard)
    kvsparse server                                 # bind address from the environment
    kvsparse stats --once                           # every shard's tables and traffic
    kvsparse serve --checkpoint-dir DIR --follow --http-port 8080   # a serving replica

``kvsparse server`` with no ``--bind`` takes its address from
`kvsparse.config.server_bind_address` (``KVSPARSE_BIND``,
``KVSPARSE_SERVER_ID``, ``TF_CONFIG`` task ``ps``, ``DMLC_ROLE=server``).

Exit codes: ``launch`` returns the job's code (see `kvsparse.cluster.launch.launch`);
1 for an error of the launcher itself; 2 for a usage error; ``stats`` returns 1
when a server does not answer; ``keys DIR`` returns 1 if the keys cannot be written.
Errors are one line on stderr, without a traceback; output into a pipe that
closes early (``kvsparse stats --json | head``) ends the command quietly with 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from kvsparse import config, errors

_COMMANDS = {
    "launch": "start servers and workers on this host and run a training job",
    "server": "run one server (shard); options are those of python -m kvsparse.server",
    "serve": "serve lookups from a checkpoint directory over ZeroMQ and HTTP (--follow)",
    "stats": "show a live table of every server's tables and traffic (--once: one snapshot)",
    "keys": "make CurveZMQ key pairs in DIR for --keys (kvsparse keys DIR)",
}


def _main_parser() -> argparse.ArgumentParser:
    import kvsparse

    width = max(len(name) for name in _COMMANDS)
    commands = "\n".join(f"  {name:<{width}}  {text}" for name, text in _COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="kvsparse",
        usage="kvsparse [-h] [--version] COMMAND [ARGS...]",
        description="kvsparse: a parameter server for huge sparse embedding tables.",
        epilog=f"commands:\n{commands}\n\nRun `kvsparse COMMAND --help` for a command's options.",
        # One command a line, as written: the default formatter ran them into one paragraph.
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvsparse {kvsparse.__version__}")
    parser.add_argument(
        "command", choices=sorted(_COMMANDS), metavar="COMMAND", help="one of the commands below"
    )
    return parser


def _environment_pair(text: str) -> tuple:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsparse launch",
        usage="kvsparse launch [options] -- COMMAND [ARGS...]",
        description=(
            "Start servers and workers on this host. Each worker runs COMMAND with "
            "KVSPARSE_SERVERS, KVSPARSE_RANK and KVSPARSE_NUM_WORKERS set, so that "
            "kvsparse.create('dist_sparse') needs no arguments. Output is prefixed with "
            "[worker R] / [server S]. The exit code is the first failing worker's (0 if all "
            "succeed); Ctrl-C stops everything."
        ),
    )
    parser.add_argument(
        "-s",
        "--servers",
        type=_positive_int,
        default=1,
        metavar="S",
        help="number of servers (default: 1)",
    )
    parser.add_argument(
        "-n",
        "--workers",
        type=_positive_int,
        default=1,
        metavar="N",
        help="number of workers (default: 1)",
    )
    parser.add_argument(
        "--host",
        default=None,
        metavar="ADDRESS",
        help="interface tcp servers listen on (default: 127.0.0.1; not with --transport ipc); "
        "with --nnodes: the address this host is reached at (default: the source address of "
        "its route to the rendezvous host)",
    )
    parser.add_argument(
        "--transport",
        choices=("tcp", "ipc"),
        default=None,
        help="how workers reach the servers: ipc (the default without --host and "
        "--colocated: Unix sockets in a private temporary directory, removed at the end, and "
        "rows through shared memory; the workers are on this host anyway) or tcp (free ports "
        "on --host; the default with --host or --colocated). See docs/operations.md",
    )
    config.SETTINGS["timeout"].add_argument(
        parser,
        "KVSPARSE_TIMEOUT for the workers: seconds to wait for a server",
    )
    parser.add_argument(
        "--staleness",
        type=int,
        default=None,
        metavar="STEPS",
        help="KVSPARSE_STALENESS for the workers (bounded staleness, SSP)",
    )
    parser.add_argument(
        "--env",
        action="append",
        type=_environment_pair,
        default=[],
        metavar="KEY=VALUE",
        help="set a variable for the workers (repeatable)",
    )
    config.SETTINGS["startup_timeout"].add_argument(
        parser,
        "seconds to wait for the servers to answer (default: 60)",
        default=60.0,
    )
    config.SETTINGS["grace_period"].add_argument(
        parser,
        "seconds between SIGTERM and SIGKILL when stopping (default: 5)",
        default=5.0,
    )
    parser.add_argument(
        "--restart-servers",
        action="store_true",
        help="restart a server that dies, on its address, from the last checkpoint in "
        "--checkpoint-dir; workers retry their requests (without it a dead server ends the job)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="K",
        help="restarts allowed per server with --restart-servers, per worker with "
        "--restart-workers (default: 3)",
    )
    config.SETTINGS["retry_window"].add_argument(
        parser,
        "KVSPARSE_RETRY_WINDOW for the workers: how long they retry a restarted server "
        "(default with --restart-servers or --restart-workers: 120)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="KVSPARSE_CHECKPOINT_DIR for the workers (kv.save() with no path writes there); "
        "restarted servers restore from it",
    )
    config.SETTINGS["memory_budget"].add_argument(
        parser,
        "memory each shard may hold, e.g. 8GiB: --memory-budget of every server (with "
        "--colocated: of every worker's shard) (default: KVSPARSE_MEMORY_BUDGET, else none)",
    )
    parser.add_argument(
        "--spill-dir",
        default=None,
        metavar="DIR",
        help="with --memory-budget: the disk tier's directory; server I spills under "
        "DIR/server-I (colocated worker R: DIR/worker-R) (default: KVSPARSE_SPILL_DIR)",
    )
    config.SETTINGS["save_every"].add_argument(
        parser,
        "rank 0 saves into --checkpoint-dir on this interval while training runs (full "
        "first, then deltas), for serving replicas (kvsparse serve --follow)",
    )
    parser.add_argument(
        "--keep",
        type=int,
        default=None,
        metavar="N",
        help="with --save-every: at most N deltas on a full checkpoint, then a full one; "
        "older checkpoints are deleted",
    )
    parser.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="CurveZMQ key directory (kvsparse keys DIR): servers encrypt and accept only its "
        "clients; workers get KVSPARSE_KEYS",
    )
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="no server processes: worker R hosts shard R itself and serves it to the others "
        "(KVSPARSE_PEERS); kvsparse.create('dist_sparse') is then colocated (not with -s)",
    )
    parser.add_argument(
        "--restart-workers",
        action="store_true",
        help="with --colocated: restart a worker that dies (with its shard, on its address, "
        "restored from the last checkpoint in --checkpoint-dir, KVSPARSE_RESTARTED set; it "
        "resumes at kv.clock); the other workers wait for it (at most --max-restarts times each)",
    )
    hosts = parser.add_argument_group(
        "several hosts",
        "One launcher on each host, each with the same -s/-n, --nnodes and --rendezvous: the "
        "job has NNODES * S servers and NNODES * N workers, ranked node by node. Node 0's "
        "launcher serves the rendezvous. Under SLURM (srun, one task per node) --nnodes, "
        "--node-rank and the rendezvous host come from SLURM_NNODES, SLURM_NODEID and "
        "SLURM_JOB_NODELIST: --rendezvous :PORT is enough. See docs/operations.md, "
        "'Several hosts'.",
    )
    hosts.add_argument(
        "--nnodes",
        type=_positive_int,
        default=None,
        metavar="N",
        help="number of hosts (launchers) in the job (default: 1, or SLURM_NNODES)",
    )
    hosts.add_argument(
        "--node-rank",
        type=int,
        default=None,
        metavar="R",
        help="this host's rank, 0..N-1 (default: SLURM_NODEID); node 0 serves the rendezvous",
    )
    hosts.add_argument(
        "--rendezvous",
        default=None,
        metavar="tcp://HOST:PORT",
        help="where the launchers meet: node 0's host and a free port (:PORT takes the host "
        "from SLURM_JOB_NODELIST; default: DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT if set)",
    )
    config.SETTINGS["rendezvous_wait"].add_argument(
        hosts,
        "how long node 0 waits for every launcher to join; one that has not is named "
        "and the job ends on every host (default: 300)",
    )
    return parser


def _launch(argv: list) -> int:
    from kvsparse.cluster.launch import launch

    parser = _launch_parser()
    if "--" in argv:
        split = argv.index("--")
        options, command = argv[:split], argv[split + 1 :]
    else:
        # Without "--", the command starts at the first argument that is not an option.
        options, command = _split_without_separator(parser, argv)
    args = parser.parse_args(options)
    if not command:
        parser.error("no worker command; e.g. kvsparse launch -n 2 -- python train.py")
    from kvsparse import config

    try:
        # SLURM's and ps-lite's variables are read here; launch() takes explicit values.
        placement = config.node_placement(args.nnodes, args.node_rank, args.rendezvous)
        memory_budget, spill_dir = config.memory_tier(None, args.memory_budget, args.spill_dir)
        return launch(
            command,
            num_servers=args.servers,
            num_workers=args.workers,
            host=args.host,
            transport=args.transport,
            timeout=args.timeout,
            staleness=args.staleness,
            env=dict(args.env),
            startup_timeout=args.startup_timeout,
            grace_period=args.grace_period,
            restart_servers=args.restart_servers,
            max_restarts=args.max_restarts,
            retry_window=args.retry_window,
            checkpoint_dir=args.checkpoint_dir,
            keys=args.keys,
            save_every=args.save_every,
            keep=args.keep,
            colocated=args.colocated,
            restart_workers=args.restart_workers,
            nnodes=None if placement is None else placement.nnodes,
            node_rank=None if placement is None else placement.node_rank,
            rendezvous=None if placement is None else placement.rendezvous,
            rendezvous_wait=args.rendezvous_wait,
            memory_budget=memory_budget,
            spill_dir=spill_dir,
        )
    except errors.KVSparseError as exc:
        print(f"kvsparse launch: error: {exc}", file=sys.stderr)
        return 1


def _split_without_separator(parser: argparse.ArgumentParser, argv: list) -> tuple:
    """Splits `-n 2 python train.py --lr 1` at the first positional argument."""
    takes_value = {
        option
        for action in parser._actions
        if action.nargs != 0
        for option in action.option_strings
    }
    index = 0
    while index < len(argv):
        arg = argv[index]
        if not arg.startswith("-") or arg == "-":
            break
        index += 1
        if arg in takes_value:
            index += 1  # its value
    return argv[:index], argv[index:]


def _server(argv: list) -> int:
    # kvsparse.server.main reads the bind address from the environment when no --bind is
    # given (kvsparse.config.server_bind_address), so the command delegates as is.
    from kvsparse.server import main as server

    result = server.main(argv)
    return 0 if result is None else int(result)


def _keys(argv: list) -> int:
    parser = argparse.ArgumentParser(
        prog="kvsparse keys",
        description="Write a server and a client CurveZMQ key pair into DIR (server.key, "
        "server.key_secret, client.key, client.key_secret) for `kvsparse server --keys DIR`, "
        "`kvsparse launch --keys DIR` and KVSPARSE_KEYS=DIR.",
    )
    parser.add_argument("directory", metavar="DIR")
    parser.add_argument("--force", action="store_true", help="replace existing key files")
    args = parser.parse_args(argv)
    from kvsparse.wire import security

    try:
        paths = security.make_keys(args.directory, overwrite=args.force)
    except errors.KVSparseError as exc:
        print(f"kvsparse keys: error: {exc}", file=sys.stderr)
        return 1
    for name in sorted(paths):
        print(f"{name}: {paths[name]}")
    return 0


def main(argv: Optional[list] = None) -> int:
    """Runs the ``kvsparse`` command line.

    Args:
        argv: the arguments after the program name (default: sys.argv[1:]).

    Returns:
        The exit code.

    Thread safety: meant for a process's main thread, one call at a time
    (``launch`` installs its SIGINT/SIGTERM handlers only there).

    Example:
        >>> main(['launch', '-s', '2', '-n', '2', '--', 'python', 'train.py'])  # doctest: +SKIP
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _run(argv)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
        return code
    except BrokenPipeError:
        # The reader left (`kvsparse stats --json | head`): nothing more to say to it, and
        # Python would print a traceback at exit flushing stdout; point stdout at devnull.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1


def _run(argv: list) -> int:
    parser = _main_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    if argv[0] not in _COMMANDS:
        parser.parse_args(argv[:1])  # prints help, the version or an error, and exits
    command, rest = argv[0], argv[1:]
    if command == "launch":
        return _launch(rest)
    if command == "server":
        return _server(rest)
    if command == "keys":
        return _keys(rest)
    if command == "serve":
        from kvsparse.serving import main as serve

        return serve.main(rest)
    from kvsparse.cli import stats as stats_cli  # the one command left: stats

    return stats_cli.main(rest)
