"""The wire wing: what travels between a worker and a server, written once for both ends.

- `kvsparse.wire.protocol`: the header, its fields and flags, payload frames,
  JSON and tree frames, error replies.
- `kvsparse.wire.ops`: each operation's request and reply layout, encoded and
  decoded in one place that the client and the server both call.
- `kvsparse.wire.security`: CurveZMQ keys and secured sockets.

Imports only the errors (and zmq for the security).
"""
