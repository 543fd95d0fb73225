"""``kvsparse stats``: a live table of every shard's tables and traffic.

Usage::

    kvsparse stats                                  # servers from KVSPARSE_SERVERS (etc.)
    kvsparse stats --servers tcp://10.0.0.1:7000,tcp://10.0.0.2:7000
    kvsparse stats --once                           # one snapshot, then exit
    kvsparse stats --once --json                    # the raw per-server statistics

The servers come from ``--servers`` or else from the cluster configuration
(`kvsparse.config.from_environment`: ``KVSPARSE_SERVERS``, ``TF_CONFIG``,
``DMLC_*``). Each refresh sends every server one STATS request marked
`kvsparse.wire.protocol.FLAG_MONITOR` (`kvsparse.wire.ops.Stats`): the servers
answer it without a HELLO and do not count it as traffic, so watching a job
does not change it.

Two tables are printed: one row per shard (rows, bytes, requests, keys, keys/s)
and one row per table summed over the shards (rows, bytes, table operations,
keys pulled and pushed, keys/s); servers with a memory budget add a third, the
disk tier per table (rows in memory and on disk, hit rate, disk bytes, bytes
read and written, write amplification, rows evicted to disk, segments freed
by GC). keys/s is the rate between the last two
refreshes; on the first snapshot (and with ``--once``) it is the average since
each server started. On a terminal the view is redrawn in place; into a pipe
or a file each refresh is printed in full as it comes, as plain lines.

A server that does not answer is shown with the reason when one connection
attempt tells it: ``needs keys`` (it speaks CurveZMQ and no ``--keys`` was
given), ``no keys`` (``--keys`` given, the server has none), ``key refused``,
or ``unreachable`` (connection refused, or no answer in time). The table
totals then cover the shards that answered only: they are marked partial
(``"partial": true`` and ``"missing"`` in ``--json``).

Exit codes: 0 when every server answered, 1 when one did not, 2 for a usage
or configuration error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional, TextIO

import zmq

from kvsparse import config, errors, extras
from kvsparse.client.session import NoAnswer, Session
from kvsparse.table import TIER_COUNTERS, tier_stats
from kvsparse.wire import ops


def fetch_stats(servers: list, timeout: float = 5.0, keys: Optional[str] = None) -> list:
    """One monitoring STATS request to each server, sent together.

    A monitor's session (`kvsparse.client.session.Session`): the exchange loop
    the workers use, without HELLO, liveness pings or retries. Safe to call
    from several threads at once (each call has its own session).

    Args:
        servers: ``tcp://host:port`` addresses.
        timeout: seconds to wait for all the answers.
        keys: a ``kvsparse keys`` directory when the servers use CurveZMQ.

    Returns:
        One dict per server, in order: the server's statistics (as in
        `kvsparse.KVStore.stats` ``["shards"]``), or ``{"address": ...,
        "problem": ..., "error": "..."}`` for a server that did not answer
        ("unreachable", "needs keys", "no keys", "key refused") or answered an
        error ("error").

    Example:
        >>> fetch_stats(['tcp://127.0.0.1:1'], timeout=0.1)[0]['error']
        'no answer within 0.1 s'
    """
    session = Session(servers, timeout=timeout, keys=keys, monitor=True)
    try:
        request = ops.Stats.encode_request(monitor=True)
        outcomes = session.exchange(dict.fromkeys(range(len(servers)), request), gather=True)
    finally:
        session.close()
    return [
        _shard_stats(address, outcomes[index], timeout, keys)
        for index, address in enumerate(servers)
    ]


def _shard_stats(address: str, outcome, timeout: float, keys: Optional[str]) -> dict:
    """One server's statistics from its exchange outcome, or why there are none."""
    if isinstance(outcome, errors.ServerUnavailable):  # no answer, or a refused connection
        found = _why_no_answer(address, keys, min(timeout, 2.0))
        if found is None:
            why = f"no answer within {timeout:g} s" if isinstance(outcome, NoAnswer) else outcome
            found = ("unreachable", str(why))
        return {"address": address, "problem": found[0], "error": found[1]}
    try:
        if isinstance(outcome, errors.KVSparseError):
            raise outcome
        stats = ops.Stats.decode_reply(*outcome)
    except errors.KVSparseError as exc:
        return {"address": address, "problem": "error", "error": f"{type(exc).__name__}: {exc}"}
    stats["address"] = address  # the address we reach it by, not the one it bound
    return stats


def _why_no_answer(address: str, keys: Optional[str], wait: float) -> Optional[tuple]:
    """(problem, message) for a server that did not answer, from one connection's events,
    or None if they do not tell (it connected, or nothing happened within `wait` s).

    ZeroMQ retries a refused connection and drops a failed CurveZMQ handshake
    without a word to the sender; its socket monitor tells them apart. The
    messages name this command's own flag (--keys).
    """
    from kvsparse.wire import security

    context = zmq.Context()
    probe = context.socket(zmq.DEALER)
    try:
        if keys is not None:
            security.secure_client_socket(probe, keys)
        monitor = probe.get_monitor_socket()
        probe.connect(address)
        seen = _monitor_events(monitor, time.monotonic() + wait)
    except errors.KVSparseError as exc:
        return "error", str(exc)
    finally:
        context.destroy(linger=0)
    mismatch = seen.get(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    # The side that sees the mechanisms differ first closes: the other sees NO_DETAIL.
    failed = mismatch is not None or zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL in seen
    if keys is None and failed:
        return "needs keys", (
            "the security handshake failed: the server speaks CurveZMQ; pass --keys DIR (or "
            "set KVSPARSE_KEYS) with the directory of its keys"
        )
    if mismatch == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "no keys", (
            "the server does not use CurveZMQ (started without --keys): run stats without "
            "--keys and KVSPARSE_KEYS"
        )
    if failed or zmq.EVENT_HANDSHAKE_FAILED_AUTH in seen:
        return "key refused", (
            f"the CurveZMQ handshake failed: the server uses no keys, or not those in {keys}"
        )
    if zmq.EVENT_CONNECTED not in seen and zmq.EVENT_CONNECT_RETRIED in seen:
        return "unreachable", "connection refused (no server listens there)"
    return None


def _monitor_events(monitor: zmq.Socket, deadline: float) -> dict:
    """{event: value} seen until a decisive one (handshake done or failed, or refused)."""
    from zmq.utils.monitor import recv_monitor_message

    decisive = (
        zmq.EVENT_HANDSHAKE_SUCCEEDED,
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
        zmq.EVENT_HANDSHAKE_FAILED_AUTH,
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
        zmq.EVENT_CONNECT_RETRIED,
    )
    seen: dict = {}
    while not any(event in seen for event in decisive):
        left = deadline - time.monotonic()
        if left <= 0 or not monitor.poll(int(left * 1000) + 1):
            break
        message = recv_monitor_message(monitor)
        seen[message["event"]] = message["value"]
    return seen


def _elapsed(shard: dict) -> Optional[float]:
    """Seconds the server has counted keys for, from its keys and average keys/s."""
    rate = shard.get("keys_per_second") or 0.0
    return shard["keys"] / rate if rate > 0 else None


def _table_totals(shards: list) -> dict:
    """{name: {"kind", "rows", "bytes", "requests", "pull_keys", "push_keys", "keys"}}.

    Sums over the shards that answered only (see `_missing`). A table of shards
    with a memory budget also has "tier": its tier counters summed, with the hit
    rate and write amplification of the sums (`kvsparse.shard.state.tier_stats`).
    """
    totals: dict = {}
    for shard in shards:
        if "error" in shard:
            continue
        for name, table in shard.get("tables", {}).items():
            total = totals.setdefault(name, _empty_total(table.get("kind", "?")))
            total["rows"] += table.get("rows", 0)
            total["bytes"] += table.get("bytes", 0)
            if isinstance(table.get("tier"), dict):
                tier = total.setdefault("tier", dict.fromkeys(TIER_COUNTERS, 0))
                for field in TIER_COUNTERS:
                    tier[field] += table["tier"].get(field, 0)
        for name, table_ops in shard.get("table_ops", {}).items():
            total = totals.setdefault(name, _empty_total("?"))
            for op, counts in table_ops.items():
                total["requests"] += counts["requests"]
                total["keys"] += counts["keys"]
                if op.startswith("pull"):
                    total["pull_keys"] += counts["keys"]
                else:
                    total["push_keys"] += counts["keys"]
    for total in totals.values():
        if "tier" in total:
            total["tier"] = tier_stats(total["tier"])
    return totals


def _missing(shards: list) -> list:
    """Addresses of the shards that did not answer: the totals leave them out."""
    return [shard["address"] for shard in shards if "error" in shard]


def _empty_total(kind: str) -> dict:
    return {
        "kind": kind,
        "rows": 0,
        "bytes": 0,
        "requests": 0,
        "keys": 0,
        "pull_keys": 0,
        "push_keys": 0,
    }


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'.

    Example:
        >>> human_bytes(1536), human_bytes(12)
        ('1.5 KiB', '12 B')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class _Rates:
    """keys/s between consecutive snapshots (per shard and per table)."""

    def __init__(self):
        self.previous: Optional[tuple[float, list, dict]] = None

    def update(self, shards: list, tables: dict) -> tuple[list, dict]:
        now = time.monotonic()
        shard_rates = []
        table_rates = {}
        if self.previous is None:
            for shard in shards:
                shard_rates.append(shard.get("keys_per_second") if "error" not in shard else None)
            elapsed = [e for e in (_elapsed(s) for s in shards if "error" not in s) if e]
            longest = max(elapsed, default=None)
            for name, total in tables.items():
                table_rates[name] = total["keys"] / longest if longest else 0.0
        else:
            then, old_shards, old_tables = self.previous
            dt = max(now - then, 1e-9)
            for shard, old in zip(shards, old_shards):
                if "error" in shard or "error" in old:
                    shard_rates.append(None)
                else:
                    shard_rates.append(max(shard["keys"] - old["keys"], 0) / dt)
            for name, total in tables.items():
                old = old_tables.get(name, {"keys": 0})
                table_rates[name] = max(total["keys"] - old["keys"], 0) / dt
        self.previous = (now, shards, tables)
        return shard_rates, table_rates


def render(shards: list, tables: dict, shard_rates: list, table_rates: dict):
    """The two rich tables (shards, then tables) as one renderable."""
    from rich.console import Group
    from rich.table import Table

    shard_table = Table(title="kvsparse shards", title_justify="left")
    for column in ("shard", "address", "tables", "rows", "bytes", "requests", "keys", "keys/s"):
        shard_table.add_column(column, justify="left" if column == "address" else "right")
    for index, (shard, rate) in enumerate(zip(shards, shard_rates)):
        if "error" in shard:
            problem = shard.get("problem", "unreachable")
            shard_table.add_row(
                str(index), shard["address"], "", "", "", "", "", f"{problem}: {shard['error']}"
            )
            continue
        shard_tables = shard.get("tables", {})
        shard_table.add_row(
            str(index),
            shard["address"],
            str(len(shard_tables)),
            f"{sum(t.get('rows', 0) for t in shard_tables.values()):,}",
            human_bytes(sum(t.get("bytes", 0) for t in shard_tables.values())),
            f"{shard.get('requests', 0):,}",
            f"{shard.get('keys', 0):,}",
            f"{rate or 0.0:,.1f}",
        )
    missing = _missing(shards)
    title = "kvsparse tables (summed over shards)"
    if missing:
        title = (
            f"kvsparse tables (PARTIAL: summed over {len(shards) - len(missing)} of "
            f"{len(shards)} shards; missing {', '.join(missing)})"
        )
    table_table = Table(title=title, title_justify="left")
    columns = ("table", "kind", "rows", "bytes", "requests", "keys pulled", "keys pushed", "keys/s")
    for column in columns:
        table_table.add_column(column, justify="left" if column in ("table", "kind") else "right")
    for name in sorted(tables):
        total = tables[name]
        table_table.add_row(
            name,
            total["kind"],
            f"{total['rows']:,}",
            human_bytes(total["bytes"]),
            f"{total['requests']:,}",
            f"{total['pull_keys']:,}",
            f"{total['push_keys']:,}",
            f"{table_rates.get(name, 0.0):,.1f}",
        )
    tiered = sorted(name for name, total in tables.items() if "tier" in total)
    if not tiered:
        return Group(shard_table, table_table)
    tier_table = Table(title="kvsparse disk tier (summed over shards)", title_justify="left")
    columns = (
        "table",
        "in memory",
        "on disk",
        "hit rate",
        "disk bytes",
        "read",
        "written",
        "write amp",
        "evicted",
        "gc segments",
    )
    for column in columns:
        tier_table.add_column(column, justify="left" if column == "table" else "right")
    for name in tiered:
        tier = tables[name]["tier"]
        tier_table.add_row(
            name,
            f"{tier['rows_in_memory']:,}",
            f"{tier['rows_on_disk']:,}",
            f"{tier['hit_rate']:.1%}",
            human_bytes(tier["disk_bytes"]),
            human_bytes(tier["bytes_read"]),
            human_bytes(tier["bytes_written"]),
            f"{tier['write_amplification']:.2f}",
            f"{tier['evictions']:,}",
            f"{tier['gc_segments_freed']:,}",
        )
    return Group(shard_table, table_table, tier_table)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsparse stats",
        description="Show a live table of every server's tables and traffic.",
    )
    parser.add_argument(
        "--servers",
        default=None,
        metavar="ADDRESSES",
        help="comma-separated server addresses (default: the cluster configuration, "
        "e.g. KVSPARSE_SERVERS)",
    )
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument(
        "--interval", type=float, default=2.0, metavar="SECONDS", help="refresh interval"
    )
    parser.add_argument(
        "--count", type=int, default=None, metavar="N", help="stop after N refreshes"
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="wait per refresh"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the raw statistics as JSON (with --once)"
    )
    parser.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="CurveZMQ key directory when the servers use one (default: KVSPARSE_KEYS)",
    )
    return parser


def main(argv: Optional[list] = None, stdout: Optional[TextIO] = None) -> int:
    """Runs ``kvsparse stats``.

    Args:
        argv: arguments after ``stats``.
        stdout: where to print (default: sys.stdout).

    Returns:
        0 if every server answered, 1 if one did not, 2 for a usage error.

    Example:
        >>> main(['--servers', 'tcp://127.0.0.1:5701', '--once'])  # doctest: +SKIP
        0
    """
    args = _parser().parse_args(argv)
    out = stdout or sys.stdout
    try:
        if args.servers is not None:
            found = config.ClusterConfig(servers=[s for s in args.servers.split(",") if s.strip()])
        else:
            found = config.monitor_config()
    except errors.InvalidArgument as exc:
        print(f"kvsparse stats: {exc}", file=sys.stderr)
        return 2
    if args.interval <= 0 or args.timeout <= 0 or (args.count is not None and args.count < 1):
        print("kvsparse stats: --interval, --timeout and --count must be positive", file=sys.stderr)
        return 2
    keys = config.curve_keys() if args.keys is None else args.keys
    servers = found.servers
    count = 1 if args.once else args.count

    if args.json:
        shards = fetch_stats(servers, args.timeout, keys)
        missing = _missing(shards)
        report = {
            "shards": shards,
            "tables": _table_totals(shards),
            "partial": bool(missing),
            "missing": missing,
        }
        json.dump(report, out, indent=2)
        out.write("\n")
        return 1 if any("error" in s for s in shards) else 0

    try:
        Console = extras.require("rich.console", "kvsparse stats' table").Console  # noqa: N806
    except errors.MissingDependency as exc:
        print(f"kvsparse stats: {exc} (--json works without it)", file=sys.stderr)
        return 2
    console = Console(file=out, width=None if out.isatty() else 160)
    rates = _Rates()

    def snapshot():
        shards = fetch_stats(servers, args.timeout, keys)
        tables = _table_totals(shards)
        shard_rates, table_rates = rates.update(shards, tables)
        return shards, render(shards, tables, shard_rates, table_rates)

    if count == 1:
        shards, view = snapshot()
        console.print(view)
        return 1 if any("error" in s for s in shards) else 0

    shards, view = snapshot()
    done = 1
    if not out.isatty():
        # A pipe or a log file: rich's live view redraws in place with terminal codes and
        # wrote nothing until it ended. Each refresh is printed in full, as plain lines.
        try:
            while True:
                console.print(view)
                out.flush()
                if count is not None and done >= count:
                    break
                time.sleep(args.interval)
                shards, view = snapshot()
                done += 1
        except (KeyboardInterrupt, BrokenPipeError):
            pass
        return 1 if any("error" in s for s in shards) else 0

    from rich.live import Live

    try:
        with Live(view, console=console, auto_refresh=False) as live:
            while count is None or done < count:
                time.sleep(args.interval)
                shards, view = snapshot()
                live.update(view, refresh=True)
                done += 1
    except KeyboardInterrupt:
        pass
    return 1 if any("error" in s for s in shards) else 0


__all__ = ["fetch_stats", "human_bytes", "main", "render"]
