"""The server wing: a `kvsparse server` process serving one shard over ZeroMQ.

Run it with ``kvsparse server --bind tcp://HOST:PORT`` or ``python -m
kvsparse.server``. User code never runs in a server process.
Arrows: server -> shard, server -> wire; nothing else imports it but the CLI
(and `kvsparse.cluster`, `kvsparse.ray` and tests read `listening`).

Modules, one concern each (`server.Server` composes them):

- ``main``: the command line (``kvsparse server``).
- ``server``: `Server`, the composition.
- ``loop``: the ROUTER socket, the poll loop, the wake-up socket.
- ``dispatch``: a request's way from parsing to its reply (`InFlightRequest`).
- ``resend``: duplicate-request detection (`ResendCache`).
- ``handlers``: one handler per op, each op's payload decoded there.
- ``coordination``: BSP rounds, SSP gate, barrier, optimizer epochs, dense-init waiters.
- ``snapshots``: checkpoint saves and exports written by a forked child.
- ``metrics``: counters and the Prometheus endpoint.
- ``listening``: the line a server prints once bound, and its reader.
"""
