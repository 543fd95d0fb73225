"""The raw transport: the same request and reply bytes over ZeroMQ, with no table work.

``python raw_zmq.py serve --max-bytes N`` runs one ROUTER (until SIGTERM) that answers a
pull request with a preallocated buffer of keys * dim float32 (sent without a copy) and a
push request with its header. The frames have kvsparse's sizes (kvsparse.wire.protocol): a
56-byte header, a 24-byte item descriptor, then keys (pull) or keys + rows (push); a pull
reply is header + descriptor + rows. The client side (`RawClient`) holds one DEALER per
server, like a dist_sparse worker: it sends to every server first, then collects every
reply.
"""

from __future__ import annotations

import argparse
import struct
import sys

import numpy as np
import zmq

from kvsparse.wire import protocol

# op, dim, request id, padded to kvsparse's header size.
HEADER = struct.Struct(f"<IIQ{protocol.HEADER_SIZE - 16}x")
ITEMS = bytes(protocol.ITEM_DTYPE.itemsize)
OP_PULL, OP_PUSH = 1, 2


def serve(max_bytes: int) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind("tcp://127.0.0.1:*")
    print(f"raw zmq server listening on {sock.getsockopt_string(zmq.LAST_ENDPOINT)}", flush=True)
    payload = np.random.default_rng(0).random(max_bytes // 4, dtype=np.float32)
    view = memoryview(payload).cast("B")
    while True:
        frames = sock.recv_multipart(copy=False)
        identity, header = frames[0], frames[1]
        op, dim, _ = HEADER.unpack(header.bytes)
        if op == OP_PULL:
            nbytes = len(frames[3]) // 8 * dim * 4
            sock.send_multipart([identity, header, frames[2], view[:nbytes]], copy=False)
        else:
            sock.send_multipart([identity, header], copy=False)


class RawClient:
    """One DEALER per server address; pull/push send to all, then wait for all replies."""

    def __init__(self, addresses: list[str], dim: int):
        self.context = zmq.Context()
        self.dim = dim
        self.sockets = []
        for address in addresses:
            sock = self.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            # A dead server raises zmq.Again instead of hanging the benchmark.
            sock.setsockopt(zmq.RCVTIMEO, 60_000)
            sock.connect(address)
            self.sockets.append(sock)
        self.request_id = 0

    def _round(self, op: int, parts_per_server: list[list]) -> list:
        self.request_id += 1
        header = HEADER.pack(op, self.dim, self.request_id)
        for sock, parts in zip(self.sockets, parts_per_server):
            sock.send_multipart([header, *parts], copy=False)
        return [sock.recv_multipart(copy=False) for sock in self.sockets]

    def pull(self, keys_per_server: list[np.ndarray]) -> list:
        """Sends each server its keys; returns the reply frames (rows not copied anywhere)."""
        return self._round(OP_PULL, [[ITEMS, k] for k in keys_per_server])

    def push(self, keys_per_server: list[np.ndarray], rows_per_server: list[np.ndarray]) -> None:
        self._round(OP_PUSH, [[ITEMS, k, r] for k, r in zip(keys_per_server, rows_per_server)])

    def close(self) -> None:
        """Closes the sockets (the servers are stopped by whoever started them)."""
        for sock in self.sockets:
            sock.close()
        self.context.term()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve")
    serve_parser.add_argument("--max-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.max_bytes)


if __name__ == "__main__":
    sys.exit(main())
