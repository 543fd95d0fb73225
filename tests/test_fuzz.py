"""Malformed and random messages against a live server: it stays up, bounded, and correct.

Two fuzzers share one real ``kvsparse server`` process:

- hypothesis builds structured messages (a header with arbitrary fields, then
  arbitrary frames) and checks that each one gets exactly one reply;
- a seeded bulk fuzzer sends ``KVSPARSE_FUZZ_MESSAGES`` (default 100,000)
  messages in batches over one DEALER, with no round trip per message:
  random frames, and valid messages (of the fuzzer's own tables) with
  flipped bytes, truncated or extended frames, dropped or duplicated frames,
  random header fields and random client ids. Between batches a correct
  client trains its own table and checks every value, and the server's RSS
  is sampled: it must stay within a bound of its level after warm-up.
"""

from __future__ import annotations

import os
import struct
import time

import numpy as np
import psutil
import pytest
import zmq
from conftest import ServerProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvsparse
from kvsparse.initializers import Zeros
from kvsparse.optimizers import SGD
from kvsparse.table import SparseTable
from kvsparse.wire import protocol
from kvsparse.wire.protocol import HEADER, Op

FUZZ_MESSAGES = int(os.environ.get("KVSPARSE_FUZZ_MESSAGES", "100000"))
BATCH = 2000
RSS_BOUND = 96 << 20  # growth allowed over the warm-up level
GOOD_KEYS = np.arange(16)
FUZZ_TABLE = 0xF00D
FUZZ_DENSE = 0xD00D
# Ops the bulk fuzzer draws for random headers. EVICT, SET_OPTIMIZER,
# LOAD_OPTIMIZER_STATES and CHECKPOINT are left out on purpose: a well-formed one
# is a legitimate request that changes the whole shard (or writes files), which an
# authenticated client may do (use --keys to keep others out).
FUZZ_OPS = [0, 99, 0xFFFF] + [
    int(op)
    for op in (
        Op.PING,
        Op.HELLO,
        Op.INIT_SPARSE,
        Op.INIT_DENSE,
        Op.PULL_SPARSE,
        Op.PUSH_SPARSE,
        Op.PULL_DENSE,
        Op.PUSH_DENSE,
        Op.STATS,
        Op.GET_OPTIMIZER_STATES,
    )
]


@pytest.fixture(scope="module")
def live():
    """A server, a correct client of it, and the fuzzer's DEALER socket."""
    server = ServerProcess()
    good = kvsparse.create(
        "dist_async", servers=[server.address], rank=0, num_workers=1, timeout=30
    )
    good.init("good", SparseTable(dim=4, initializer=Zeros(), optimizer=SGD(learning_rate=1.0)))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(server.address)
    state = {"server": server, "good": good, "sock": sock, "rounds": 0}
    try:
        yield state
    finally:
        sock.close(0)
        good.close()
        server.stop()
        server.stderr.close()


def _train_and_check(state) -> None:
    """One step of the correct client; every value must be what it pushed."""
    good = state["good"]
    good.push("good", (GOOD_KEYS, -np.ones((GOOD_KEYS.size, 4), np.float32)))
    state["rounds"] += 1
    rows = good.row_sparse_pull("good", row_ids=GOOD_KEYS)
    np.testing.assert_array_equal(rows, np.full((GOOD_KEYS.size, 4), state["rounds"], np.float32))


def _collect(sock, expected: int, timeout: float, statuses=None) -> int:
    """Receives replies until `expected` arrived or timeout; returns how many arrived.

    statuses: a dict counting the replies per status (0: success), if given.
    """
    got = 0
    deadline = time.monotonic() + timeout
    while got < expected:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not sock.poll(remaining * 1000):
            break
        while got < expected:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            header, _ = protocol.parse_message(frames, reply=True)  # every reply is well formed
            if statuses is not None:
                statuses[header.status] = statuses.get(header.status, 0) + 1
            got += 1
    return got


def _header(op, request_id, client_id, num_frames=0, num_items=0, rank=0, clock=0, flags=0):
    return protocol.Header(
        op=op,
        flags=flags,
        request_id=request_id,
        client_id=client_id,
        rank=rank,
        num_items=num_items,
        clock=clock,
        num_frames=num_frames,
    ).pack()


def _templates(client_id: int) -> list[list[bytes]]:
    """Valid messages of the fuzzer's own tables (the raw material of mutations)."""
    hello = protocol.encode_json(
        {
            "num_workers": 1,
            "mode": "asp",
            "staleness": None,
            "rank": 0,
            "num_servers": 1,
            "server_index": 0,
        }
    )
    spec = SparseTable(dim=4).to_dict()
    init_sparse = protocol.encode_json({"table_id": FUZZ_TABLE, "name": "fuzz", "spec": spec})
    init_dense = protocol.encode_json({"table_id": FUZZ_DENSE, "name": "fuzz_dense", "size": 4})
    keys = np.array([1, 2, 3], np.int64).tobytes()
    rows = np.ones((3, 4), np.float32).tobytes()
    sparse_pull = protocol.make_items([(FUZZ_TABLE, 3, 0)]).tobytes()
    sparse_push = protocol.make_items([(FUZZ_TABLE, 3, 4, protocol.ITEM_FLAG_STEP)]).tobytes()
    dense_items = protocol.make_items([(FUZZ_DENSE, 4, 0)]).tobytes()
    dense = np.ones(4, np.float32).tobytes()

    def h(op, frames, items=0):
        return _header(op, 1, client_id, num_frames=frames, num_items=items)

    return [
        [h(Op.PING, 0)],
        [h(Op.HELLO, 1), hello],
        [h(Op.INIT_SPARSE, 1), init_sparse],
        [h(Op.INIT_DENSE, 2), init_dense, dense],
        [h(Op.PULL_SPARSE, 2, 1), sparse_pull, keys],
        [h(Op.PUSH_SPARSE, 3, 1), sparse_push, keys, rows],
        [h(Op.PULL_DENSE, 1, 1), dense_items],
        [h(Op.PUSH_DENSE, 2, 1), dense_items, dense],
        [h(Op.STATS, 0)],
    ]


_FIELDS = [  # (offset, struct format) of header fields worth setting at random
    (6, "<H"),  # op
    (8, "<I"),  # flags
    (12, "<I"),  # status
    (32, "<i"),  # rank
    (36, "<I"),  # num_items
    (40, "<q"),  # clock
    (48, "<I"),  # num_frames
    (52, "<I"),  # reserved
]


def _mutate(rng: np.random.Generator, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    choice = rng.integers(8)
    index = int(rng.integers(len(frames)))
    if choice == 0:  # flip bytes
        data = bytearray(frames[index])
        for _ in range(int(rng.integers(1, 9))):
            if data:
                data[int(rng.integers(len(data)))] ^= int(rng.integers(1, 256))
        frames[index] = bytes(data)
    elif choice == 1:  # truncate
        frames[index] = frames[index][: int(rng.integers(len(frames[index]) + 1))]
    elif choice == 2:  # extend
        frames[index] = frames[index] + rng.bytes(int(rng.integers(1, 64)))
    elif choice == 3:  # drop a frame
        if len(frames) > 1:
            del frames[index]
        else:
            frames = [b""]
    elif choice == 4:  # duplicate a frame
        frames.insert(index, frames[index])
    elif choice == 5:  # a header field at random (any value of its width)
        offset, fmt = _FIELDS[int(rng.integers(len(_FIELDS)))]
        size = struct.calcsize(fmt)
        data = bytearray(frames[0])
        if len(data) >= offset + size:
            data[offset : offset + size] = rng.bytes(size)
        frames[0] = bytes(data)
    elif choice == 6:  # a random header with a random op over the same payload
        frames[0] = _header(
            FUZZ_OPS[int(rng.integers(len(FUZZ_OPS)))],
            int(rng.integers(1 << 62)),
            int(rng.integers(1 << 62)),
            num_frames=len(frames) - 1 if rng.integers(4) else int(rng.integers(1 << 16)),
            num_items=int(rng.integers(4)) if rng.integers(4) else int(rng.integers(1 << 32)),
            rank=int(rng.integers(3)),
            clock=int(rng.integers(1 << 20)),
        )
    else:  # nothing kept: random frames
        frames = [rng.bytes(int(rng.integers(0, 96))) for _ in range(int(rng.integers(1, 5)))]
    return frames


def _with_ids(rng, frames: list[bytes], client_id: int) -> list[bytes]:
    """A fresh request id (and sometimes a made-up client id) on a well-sized header."""
    head = frames[0]
    if len(head) == protocol.HEADER_SIZE and rng.integers(4):
        data = bytearray(head)
        client = client_id if rng.integers(3) else int(rng.integers(1 << 63))
        struct.pack_into("<QQ", data, 16, int(rng.integers(1, 1 << 62)), client)
        frames = [bytes(data), *frames[1:]]
    return frames


def _rss(server) -> int:
    return psutil.Process(server.process.pid).memory_info().rss


def test_bulk_fuzz_server_stays_up_bounded_and_correct(live):
    sock, server = live["sock"], live["server"]
    rng = np.random.default_rng(20260522)
    client_id = int(rng.integers(1 << 62))
    templates = _templates(client_id)
    # The fuzzer's tables exist, so that mutated messages reach the table code too.
    for request_id, frames in enumerate(templates, start=1):
        head = bytearray(frames[0])
        struct.pack_into("<Q", head, 16, request_id)
        sock.send_multipart([bytes(head), *frames[1:]])
    assert _collect(sock, len(templates), 30) == len(templates)

    sent = 0
    baseline = None
    peak = 0
    samples = []
    statuses: dict[int, int] = {}
    started = time.monotonic()
    while sent < FUZZ_MESSAGES:
        count = min(BATCH, FUZZ_MESSAGES - sent)
        for _ in range(count):
            frames = templates[int(rng.integers(len(templates)))]
            frames = _with_ids(rng, _mutate(rng, frames), client_id)
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        sent += count
        # Every message gets exactly one reply (error or not): nothing waits, nothing drops.
        got = _collect(sock, count, 60, statuses)
        assert got == count, f"replies missing after {sent} messages"
        assert server.process.poll() is None, server.error_output()
        _train_and_check(live)
        rss = _rss(server)
        samples.append(rss)
        if baseline is None and sent >= 5 * BATCH:
            baseline = rss  # after warm-up: allocator pools, tables of the fuzzer
        if baseline is not None:
            peak = max(peak, rss)
    elapsed = time.monotonic() - started
    print(
        f"\nfuzz: {sent} messages in {elapsed:.1f} s ({sent / elapsed:,.0f}/s); server RSS "
        f"{samples[0] >> 20} MiB first, {(baseline or samples[-1]) >> 20} MiB after warm-up, "
        f"{max(samples) >> 20} MiB peak, {samples[-1] >> 20} MiB last; replies by status "
        f"{dict(sorted(statuses.items()))}"
    )
    assert statuses.get(0, 0) > 0  # some mutated messages were valid and got through
    assert sent >= FUZZ_MESSAGES
    if baseline is not None:
        assert peak - baseline < RSS_BOUND, samples
    stats = live["good"]._backend.stats()[0]
    assert stats["clients"] <= 4096  # made-up client ids do not grow the server
    assert stats["duplicate_pushes"] == 0
    # No handler failed in an unforeseen way (those print a traceback and reply ServerError).
    assert "Traceback" not in server.error_output(), server.error_output()[-5000:]


_u = st.integers


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    op=st.sampled_from(FUZZ_OPS + [int(Op.BARRIER)]),
    flags=st.one_of(st.just(0), _u(0, 2**32 - 1)),
    rank=st.one_of(st.just(0), _u(-(2**31), 2**31 - 1)),
    num_items=st.one_of(_u(0, 4), _u(0, 2**32 - 1)),
    clock=st.one_of(st.just(0), _u(-(2**63), 2**63 - 1)),
    request_id=_u(0, 2**64 - 1),
    client_id=_u(0, 2**64 - 1),
    payload=st.lists(st.binary(max_size=80), max_size=5),
    frames_delta=st.sampled_from([0, 0, 0, 1, -1, 1000]),
)
def test_structured_messages_each_get_one_reply(
    live, op, flags, rank, num_items, clock, request_id, client_id, payload, frames_delta
):
    sock = live["sock"]
    head = HEADER.pack(
        protocol.MAGIC,
        protocol.VERSION,
        op,
        flags,
        0,
        request_id,
        client_id,
        rank,
        num_items,
        clock,
        max(0, len(payload) + frames_delta),
        0,
    )
    sock.send_multipart([head, *payload])
    assert _collect(sock, 1, 10) == 1
    assert live["server"].process.poll() is None
