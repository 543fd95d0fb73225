"""The server wing: a `kvsparse server` process serving one shard over ZeroMQ.

Run it with ``kvsparse server --bind tcp://HOST:PORT`` or ``python -m
kvsparse.server``. User code never runs in a server process.
Arrows: server -> shard, server -> wire; nothing else imports it but the CLI.
"""
