"""Layer tests of the op codecs (kvsparse/wire/ops.py): every op's request and reply
round-trips through the bytes on the wire, and malformed payloads raise ProtocolError."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import zmq

from kvsparse import errors
from kvsparse.wire import ops, protocol
from kvsparse.wire.protocol import FLAG_DECLARE, FLAG_MONITOR, ITEM_FLAG_STEP, Header, Op

_CONTEXT = zmq.Context.instance()
_ENDPOINTS = (f"inproc://test-wire-ops-{n}" for n in itertools.count())


def on_the_wire(frames, header: Header, *, reply: bool):
    """(header, payload) as the other end parses them, after a real ZeroMQ send (inproc)."""
    sender, receiver = _CONTEXT.socket(zmq.PAIR), _CONTEXT.socket(zmq.PAIR)
    endpoint = next(_ENDPOINTS)
    try:
        receiver.bind(endpoint)
        sender.connect(endpoint)
        # As the session and the server send: the arrays themselves, uncopied.
        sender.send_multipart([header._replace(num_frames=len(frames)).pack(), *frames], copy=False)
        assert receiver.poll(5000)
        return protocol.parse_message(receiver.recv_multipart(copy=False), reply=reply)
    finally:
        sender.close(0)
        receiver.close(0)


def send_request(request: ops.Request, rank: int = 0):
    header = Header(
        op=int(request.op),
        flags=request.flags,
        request_id=5,
        client_id=6,
        rank=rank,
        num_items=request.num_items,
    )
    return on_the_wire(request.frames, header, reply=False)


def send_reply(reply: ops.Reply, op: Op):
    header = Header(op=int(op), request_id=5, client_id=6).reply(num_items=reply.num_items)
    return on_the_wire(reply.frames, header._replace(incarnation=77), reply=True)


def round_trip_request(request: ops.Request, rank: int = 0):
    header, payload = send_request(request, rank)
    assert header.op == request.op
    return ops.CODECS[request.op].decode_request(header, payload)


def round_trip_reply(reply: ops.Reply, op: Op, *args):
    header, payload = send_reply(reply, op)
    return ops.CODECS[op].decode_reply(header, payload, *args)


def test_every_op_has_a_codec():
    assert set(ops.CODECS) == set(Op)
    for op, codec in ops.CODECS.items():
        assert codec.op is op


# -- round trips, op by op ------------------------------------------------------------------


def test_ping():
    assert round_trip_request(ops.Ping.encode_request()) is None
    assert round_trip_reply(ops.Ping.encode_reply(2**64 - 1), Op.PING) == 2**64 - 1
    # A reply that does not say (an older or foreign server) is None, not an error.
    assert round_trip_reply(ops.Reply([]), Op.PING) is None


@pytest.mark.parametrize(
    "hello",
    [
        ops.HelloRequest(4, ops.Mode.BSP, None, 2, 3, 1),
        ops.HelloRequest(1, ops.Mode.ASP, None, 0, 1, 0),
        ops.HelloRequest(8, ops.Mode.SSP, 3, 7, 2, 1),
    ],
)
def test_hello(hello):
    decoded = round_trip_request(ops.Hello.encode_request(hello), rank=hello.rank)
    assert decoded == hello and type(decoded.mode) is ops.Mode
    assert decoded.settings() == {
        "num_workers": hello.num_workers,
        "mode": hello.mode.value,
        "staleness": hello.staleness,
        "num_servers": hello.num_servers,
        "server_index": hello.server_index,
    }
    assert type(decoded.settings()["mode"]) is str
    reply = round_trip_reply(ops.Hello.encode_reply("tcp://h:1", 99), Op.HELLO)
    assert reply == ops.HelloReply("tcp://h:1", protocol.VERSION, 99)


def test_hello_body_is_the_documented_json():
    request = ops.Hello.encode_request(ops.HelloRequest(2, ops.Mode.SSP, 1, 0, 3, 2))
    assert json.loads(request.frames[0]) == {
        "num_workers": 2,
        "mode": "ssp",
        "staleness": 1,
        "rank": 0,
        "num_servers": 3,
        "server_index": 2,
    }


def test_init_sparse():
    spec = {"dim": 8, "optimizer": None}
    request = ops.InitSparse.encode_request(np.uint64(2**64 - 1), "user", spec)
    assert round_trip_request(request) == ops.InitSparseRequest(2**64 - 1, "user", spec)
    assert round_trip_reply(ops.InitSparse.encode_reply(True), Op.INIT_SPARSE) is True
    assert round_trip_reply(ops.InitSparse.encode_reply(False), Op.INIT_SPARSE) is False


def test_init_dense_values_and_declaration():
    values = np.arange(5, dtype=np.float32)
    request = ops.InitDense.encode_request(9, "bias", 5, values)
    assert request.flags == 0
    decoded = round_trip_request(request)
    assert decoded[:3] == (9, "bias", 5)
    np.testing.assert_array_equal(decoded.values, values)
    declaration = ops.InitDense.encode_request(9, "bias", 5)
    assert declaration.flags == FLAG_DECLARE and len(declaration.frames) == 1
    assert round_trip_request(declaration) == ops.InitDenseRequest(9, "bias", 5, None)
    assert round_trip_reply(ops.InitDense.encode_reply(), Op.INIT_DENSE) is None


@pytest.mark.parametrize("spec", [None, {"kind": "sgd", "learning_rate": 0.1}])
def test_set_optimizer(spec):
    request = ops.SetOptimizer.encode_request(spec, 3)
    assert round_trip_request(request) == ops.SetOptimizerRequest(spec, 3)
    assert round_trip_reply(ops.SetOptimizer.encode_reply(), Op.SET_OPTIMIZER) is None


def test_pull_sparse():
    keys = [np.array([3, 1, 2], np.int64), np.array([], np.int64), np.array([7], np.int64)]
    request = ops.PullSparse.encode_request([(10, keys[0]), (11, keys[1]), (2**63, keys[2])])
    assert request.num_items == 3 and len(request.frames) == 4
    decoded = round_trip_request(request)
    assert decoded.items.tolist() == [(10, 3, 0, 0), (11, 0, 0, 0), (2**63, 1, 0, 0)]
    for got, sent in zip(decoded.keys, keys):
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, sent)
    rows = [np.ones((3, 4), np.float32), np.empty((0, 2), np.float32), np.full((1, 8), 2.5, "f4")]
    reply = ops.PullSparse.encode_reply(decoded.items, rows)
    assert reply.num_items == 3
    assert decoded.items["dim"].tolist() == [0, 0, 0]  # the request's items are left alone
    requested = [(10, 3), (11, 0), (2**63, 1)]
    for got, sent in zip(round_trip_reply(reply, Op.PULL_SPARSE, requested), rows):
        assert got.shape == sent.shape
        np.testing.assert_array_equal(got, sent)


def test_push_sparse():
    entries = [
        ops.SparsePush(10, np.array([1, 2], np.int64), np.ones((2, 4), np.float32), True),
        ops.SparsePush(11, np.array([], np.int64), np.empty((0, 3), np.float32), True),
        ops.SparsePush(12, np.array([], np.int64), np.empty((0, 3), np.float32), False),
    ]
    request = ops.PushSparse.encode_request(entries)
    assert request.num_items == 3 and len(request.frames) == 7
    decoded = round_trip_request(request)
    assert decoded.items.tolist() == [
        (10, 2, 4, ITEM_FLAG_STEP),
        (11, 0, 3, ITEM_FLAG_STEP),
        (12, 0, 3, 0),
    ]
    for got, sent in zip(decoded.entries, entries):
        assert (got.table_id, got.step) == (sent.table_id, sent.step)
        np.testing.assert_array_equal(got.keys, sent.keys)
        assert got.rows.shape == sent.rows.shape
        np.testing.assert_array_equal(got.rows, sent.rows)
    assert round_trip_reply(ops.PushSparse.encode_reply(), Op.PUSH_SPARSE) is None


def test_pull_dense():
    request = ops.PullDense.encode_request([(5, 3), (6, 0)])
    items = round_trip_request(request)
    assert items.tolist() == [(5, 3, 0, 0), (6, 0, 0, 0)]
    values = [np.array([1, 2, 3], np.float32), np.empty(0, np.float32)]
    got = round_trip_reply(
        ops.PullDense.encode_reply(items, values), Op.PULL_DENSE, [(5, 3), (6, 0)]
    )
    for a, b in zip(got, values):
        np.testing.assert_array_equal(a, b)


def test_push_dense():
    grads = [(5, np.array([0.5, -1.0], np.float32)), (6, np.empty(0, np.float32))]
    decoded = round_trip_request(ops.PushDense.encode_request(grads))
    assert decoded.items.tolist() == [(5, 2, 0, 0), (6, 0, 0, 0)]
    for (table_id, grad), (sent_id, sent) in zip(decoded.entries, grads):
        assert table_id == sent_id
        np.testing.assert_array_equal(grad, sent)
    assert round_trip_reply(ops.PushDense.encode_reply(), Op.PUSH_DENSE) is None


def test_barrier():
    assert round_trip_request(ops.Barrier.encode_request()) is None
    assert round_trip_reply(ops.Barrier.encode_reply(), Op.BARRIER) is None


def optimizer_states():
    return {
        2**64 - 1: {
            "keys": np.arange(3, dtype=np.int64),
            "slots": np.ones((3, 1, 4), np.float32),
            "steps": np.zeros(3, np.int64),
            "table_step": 7,
        },
        5: {"slots": np.zeros((1, 6), np.float32), "step": 2},
    }


def assert_states_equal(got: dict, sent: dict):
    assert set(got) == set(sent)
    for table_id, state in sent.items():
        assert set(got[table_id]) == set(state)
        for name, value in state.items():
            np.testing.assert_array_equal(got[table_id][name], value)


def test_optimizer_states_both_ways():
    states = optimizer_states()
    assert round_trip_request(ops.GetOptimizerStates.encode_request()) is None
    reply = ops.GetOptimizerStates.encode_reply(states)
    assert_states_equal(round_trip_reply(reply, Op.GET_OPTIMIZER_STATES), states)
    request = ops.LoadOptimizerStates.encode_request(list(states.items()))
    assert_states_equal(dict(round_trip_request(request)), states)
    assert (
        round_trip_reply(ops.LoadOptimizerStates.encode_reply(), Op.LOAD_OPTIMIZER_STATES) is None
    )


def test_stats():
    assert round_trip_request(ops.Stats.encode_request()) is False
    monitor = ops.Stats.encode_request(monitor=True)
    assert monitor.flags == FLAG_MONITOR and round_trip_request(monitor) is True
    stats = {"tables": {"user": {"rows": 3}}, "address": "tcp://h:1", "requests": 4}
    assert round_trip_reply(ops.Stats.encode_reply(stats), Op.STATS) == stats


def test_evict():
    assert round_trip_request(ops.Evict.encode_request()) is None
    assert round_trip_reply(ops.Evict.encode_reply({"user": 5}), Op.EVICT) == {"user": 5}


def test_checkpoint():
    body = {"action": "save", "path": "/ckpt", "seq": 3, "incremental": True, "parent": None}
    assert round_trip_request(ops.Checkpoint.encode_request(body)) == body
    result = {"file": "ckpt-000003.shard-00000-of-00001.kvs", "rows": 12}
    assert round_trip_reply(ops.Checkpoint.encode_reply(result), Op.CHECKPOINT) == result


def test_modes_are_str_enums():
    assert ops.MODES == ("bsp", "asp", "ssp")
    assert ops.Mode.SSP == "ssp" and json.dumps(ops.Mode.ASP) == '"asp"'
    assert ops.Mode("bsp") is ops.Mode.BSP


# -- malformed requests -----------------------------------------------------------------------


def decode(op: Op, frames, *, num_items=0, flags=0, rank=0):
    header = Header(op=int(op), flags=flags, num_items=num_items, rank=rank, num_frames=len(frames))
    return ops.CODECS[op].decode_request(header, frames)


def hello_body(**fields):
    body = {
        "num_workers": 2,
        "mode": "bsp",
        "staleness": None,
        "rank": 0,
        "num_servers": 1,
        "server_index": 0,
    }
    body.update(fields)
    return protocol.encode_json(body)


KEYS = np.array([1, 2], np.int64).tobytes()
ITEMS = protocol.make_items([(5, 2, 0)]).tobytes()
PUSH_ITEMS = protocol.make_items([(5, 2, 4)]).tobytes()


@pytest.mark.parametrize(
    "op, frames, kwargs, message",
    [
        (Op.PING, [b"x"], {}, "PING takes no payload"),
        (Op.BARRIER, [b"x"], {}, "BARRIER takes no payload"),
        (Op.GET_OPTIMIZER_STATES, [b""], {}, "takes no payload"),
        (Op.STATS, [b"x"], {}, "STATS takes no payload"),
        (Op.EVICT, [b"x"], {}, "EVICT takes no payload"),
        (Op.HELLO, [], {}, "takes 1 payload frame"),
        (Op.HELLO, [b"{oops"], {}, "not valid JSON"),
        (Op.HELLO, [b"[1]"], {}, "must be an object"),
        (Op.HELLO, [hello_body(num_workers=0)], {}, "num_workers"),
        (Op.HELLO, [hello_body(num_workers=True)], {}, "num_workers"),
        (Op.HELLO, [hello_body(mode="bulk")], {}, "mode must be one of"),
        (Op.HELLO, [hello_body(mode=["bsp"])], {}, "mode must be one of"),
        (Op.HELLO, [hello_body(mode="ssp")], {}, "staleness"),
        (Op.HELLO, [hello_body(staleness=2)], {}, "only for mode 'ssp'"),
        (Op.HELLO, [hello_body(server_index=1)], {}, "server_index"),
        (Op.HELLO, [hello_body(rank=2)], {}, "rank"),
        (Op.HELLO, [hello_body(rank=1)], {}, "HELLO says rank 1, its header 0"),
        (Op.INIT_SPARSE, [protocol.encode_json({"table_id": -1})], {}, "table_id"),
        (Op.INIT_SPARSE, [protocol.encode_json({"table_id": 2**64})], {}, "table_id"),
        (
            Op.INIT_SPARSE,
            [protocol.encode_json({"table_id": 1, "name": 3, "spec": {}})],
            {},
            "str name and a dict spec",
        ),
        (Op.INIT_DENSE, [], {}, "needs a JSON frame"),
        (
            Op.INIT_DENSE,
            [protocol.encode_json({"table_id": 5, "name": "x", "size": 4})],
            {},
            "takes 2 payload frames",
        ),
        (
            Op.INIT_DENSE,
            [protocol.encode_json({"table_id": 5, "name": "x", "size": 4}), b""],
            {"flags": FLAG_DECLARE},
            "with FLAG_DECLARE takes 1",
        ),
        (
            Op.INIT_DENSE,
            [protocol.encode_json({"table_id": 5, "name": "x", "size": 4}), b"\0" * 15],
            {},
            "expected 16",
        ),
        (
            Op.INIT_DENSE,
            [protocol.encode_json({"table_id": 5, "name": "x", "size": -1}), b""],
            {},
            "size",
        ),
        (
            Op.INIT_DENSE,
            [protocol.encode_json({"table_id": 5, "size": 0}), b""],
            {},
            "str name",
        ),
        (Op.SET_OPTIMIZER, [protocol.encode_json({"spec": None, "epoch": 0})], {}, "epoch"),
        (Op.SET_OPTIMIZER, [protocol.encode_json({"spec": [], "epoch": 1})], {}, "object or null"),
        (Op.PULL_SPARSE, [], {"num_items": 1}, "needs an items frame"),
        (Op.PULL_SPARSE, [ITEMS[:-1], KEYS], {"num_items": 1}, "items frame"),
        (Op.PULL_SPARSE, [ITEMS, KEYS[:-3]], {"num_items": 1}, "expected 16"),
        (Op.PULL_SPARSE, [ITEMS, KEYS, KEYS], {"num_items": 1}, "takes 2 payload frames"),
        (Op.PUSH_SPARSE, [PUSH_ITEMS, KEYS, b"\0" * 31], {"num_items": 1}, "expected 32"),
        (Op.PUSH_SPARSE, [ITEMS, KEYS, b""], {"num_items": 1}, "dim must be >= 1"),
        (Op.PUSH_SPARSE, [PUSH_ITEMS, KEYS], {"num_items": 1}, "takes 3 payload frames"),
        (Op.PULL_DENSE, [ITEMS, b""], {"num_items": 1}, "takes 1 payload frames"),
        (Op.PUSH_DENSE, [ITEMS, b"\0" * 7], {"num_items": 1}, "expected 8"),
        (Op.LOAD_OPTIMIZER_STATES, [b'{"__array__": 3}'], {}, "bad array"),
        (Op.LOAD_OPTIMIZER_STATES, [b"[[1, 2]]"], {}, r"expected \[\[table_id, state\]"),
        (Op.LOAD_OPTIMIZER_STATES, [b'[[-1, {"step": 0}]]'], {}, "table_id"),
        (Op.CHECKPOINT, [b"[]"], {}, "must be an object"),
        (Op.CHECKPOINT, [], {}, "takes 1 payload frame"),
    ],
)
def test_malformed_requests_are_protocol_errors(op, frames, kwargs, message):
    with pytest.raises(errors.ProtocolError, match=message):
        decode(op, frames, **kwargs)


def test_a_push_with_an_unknown_item_flag_is_refused():
    items = protocol.make_items([(5, 2, 4, 2)]).tobytes()
    with pytest.raises(errors.ProtocolError, match="item flags"):
        decode(Op.PUSH_SPARSE, [items, KEYS, b"\0" * 32], num_items=1)


# -- malformed replies ------------------------------------------------------------------------


def reply_header(op: Op, num_items=0):
    return Header(op=int(op), num_items=num_items)


def test_pull_replies_must_answer_the_items_requested():
    rows = np.ones((2, 4), np.float32)
    items = protocol.make_items([(5, 2, 4)])
    requested = [(5, 2)]
    header = reply_header(Op.PULL_SPARSE, num_items=1)
    decoded = ops.PullSparse.decode_reply(header, [items.tobytes(), rows.tobytes()], requested)
    np.testing.assert_array_equal(decoded[0], rows)
    with pytest.raises(errors.ProtocolError, match="1 items and 1 frames for 1 items"):
        ops.PullSparse.decode_reply(header, [items.tobytes()], requested)
    with pytest.raises(errors.ProtocolError, match="0 items"):
        ops.PullSparse.decode_reply(reply_header(Op.PULL_SPARSE), [items, rows], requested)
    with pytest.raises(errors.ProtocolError, match="answers a pull of 3 keys of table 0x5"):
        ops.PullSparse.decode_reply(header, [items.tobytes(), rows.tobytes()], [(5, 3)])
    with pytest.raises(errors.ProtocolError, match="answers a pull"):
        ops.PullSparse.decode_reply(header, [items.tobytes(), rows.tobytes()], [(6, 2)])
    no_dim = protocol.make_items([(5, 2, 0)])
    with pytest.raises(errors.ProtocolError, match="answers a pull"):
        ops.PullSparse.decode_reply(header, [no_dim.tobytes(), b""], requested)
    with pytest.raises(errors.ProtocolError, match="PULL_SPARSE rows"):
        ops.PullSparse.decode_reply(header, [items.tobytes(), rows.tobytes()[:-4]], requested)
    dense = protocol.make_items([(5, 3, 0)])
    header = reply_header(Op.PULL_DENSE, num_items=1)
    with pytest.raises(errors.ProtocolError, match="answers a pull of 2 values of key 0x5"):
        ops.PullDense.decode_reply(header, [dense.tobytes(), b"\0" * 12], [(5, 2)])
    with pytest.raises(errors.ProtocolError, match="PULL_DENSE values"):
        ops.PullDense.decode_reply(header, [dense.tobytes(), b"\0" * 8], [(5, 3)])


@pytest.mark.parametrize(
    "op, payload, message",
    [
        (Op.PUSH_SPARSE, [b""], "PUSH_SPARSE reply takes no payload"),
        (Op.BARRIER, [b"x"], "takes no payload"),
        (Op.HELLO, [], "takes 1 payload frame"),
        (Op.HELLO, [b"[]"], "must be an object"),
        (Op.INIT_SPARSE, [b'{"created": 1}'], "created must be a bool"),
        (Op.STATS, [b"{bad"], "not valid JSON"),
        (Op.STATS, [], "takes 1 payload frame"),
        (Op.EVICT, [b"[]"], "must be an object"),
        (Op.CHECKPOINT, [b"", b""], "takes 1 payload frame"),
        (Op.GET_OPTIMIZER_STATES, [b"{}"], "expected"),
        (Op.GET_OPTIMIZER_STATES, [], "missing JSON frame"),
    ],
)
def test_malformed_replies_are_protocol_errors(op, payload, message):
    with pytest.raises(errors.ProtocolError, match=message):
        ops.CODECS[op].decode_reply(reply_header(op), payload)


def test_check_int():
    assert ops.check_int(5, "x", 0, 5) == 5
    for bad in (True, 1.0, "1", None, -1, 6):
        with pytest.raises(errors.ProtocolError, match=r"x must be an integer \[0, 5\]"):
            ops.check_int(bad, "x", 0, 5)
    with pytest.raises(errors.ProtocolError, match=">= 1"):
        ops.check_int(0, "epoch", 1)


def test_goodbye_and_the_frame_limit_in_hello():
    assert round_trip_request(ops.Goodbye.encode_request()) is None
    assert round_trip_reply(ops.Goodbye.encode_reply(), Op.GOODBYE) is None
    reply = round_trip_reply(
        ops.Hello.encode_reply("tcp://a:1", 7, max_message_size=4096), Op.HELLO
    )
    assert reply.max_message_size == 4096 and reply.incarnation == 7
    # -1: no limit (also what a reply of an older server, which does not say, decodes to).
    assert round_trip_reply(ops.Hello.encode_reply("tcp://a:1", 7), Op.HELLO).max_message_size == -1
