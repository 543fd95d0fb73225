"""The client wing: a worker's connection to the servers.

- `kvsparse.client.session`: sockets, request ids, the one exchange loop with
  its liveness pings, retries and recovery of restarted servers.
- `kvsparse.client.remote`: the remote backend, which turns store calls into
  wire operations (`kvsparse.wire.ops`) over a session; `ping`.

Arrows: client -> wire; the store imports the client, never the reverse.
"""
