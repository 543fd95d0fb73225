"""Layer tests of the wire protocol (kvsparse/wire/protocol.py), without sockets."""

import struct

import numpy as np
import pytest
import zmq

from kvsparse import errors
from kvsparse.wire import protocol
from kvsparse.wire.protocol import HEADER, HEADER_SIZE, Header, Op


def raw_header(**fields):
    values = {
        "magic": protocol.MAGIC,
        "version": protocol.VERSION,
        "op": int(Op.PULL_SPARSE),
        "flags": 0,
        "status": 0,
        "request_id": 5,
        "client_id": 9,
        "rank": 0,
        "num_items": 1,
        "clock": 0,
        "num_frames": 2,
        "incarnation": 0,
    }
    values.update(fields)
    return HEADER.pack(*values.values())


def test_header_is_56_bytes_and_round_trips_every_field():
    header = Header(
        op=Op.PUSH_SPARSE,
        flags=protocol.FLAG_DECLARE,
        request_id=2**64 - 1,
        client_id=2**63 + 5,
        rank=3,
        num_items=17,
        clock=2**40,
        num_frames=35,
    )
    packed = header.pack()
    assert len(packed) == HEADER_SIZE == 56
    assert packed[:4] == b"KVSP"
    assert protocol.unpack_header(packed) == header
    # Also from a zmq.Frame and a memoryview, the receive paths.
    assert protocol.unpack_header(zmq.Frame(packed)) == header
    assert protocol.unpack_header(memoryview(packed)) == header


def test_incarnation_is_a_reply_field_stamped_by_the_server():
    request = Header(op=Op.PING, request_id=3, client_id=4)
    assert request.incarnation == 0
    stamped = protocol.stamp_incarnation(request.reply(num_frames=0).pack(), 0xDEADBEEF)
    assert len(stamped) == HEADER_SIZE
    assert struct.unpack_from("<I", stamped, 52)[0] == 0xDEADBEEF
    reply = protocol.unpack_header(stamped, reply=True)
    assert reply.incarnation == 0xDEADBEEF and reply.request_id == 3
    # Also from a zmq.Frame (what the server's cached replies may be).
    assert protocol.stamp_incarnation(zmq.Frame(request.pack()), 7)[-4:] == struct.pack("<I", 7)
    # A request must leave the field 0.
    with pytest.raises(errors.ProtocolError, match="reserved in requests"):
        protocol.unpack_header(stamped)
    assert Header(op=Op.PING, incarnation=9).pack() == raw_header(
        op=int(Op.PING), request_id=0, client_id=0, num_items=0, num_frames=0, incarnation=9
    )


def test_reply_header_keeps_ids_and_sets_status():
    request = Header(op=Op.STATS, request_id=11, client_id=12, rank=1, clock=4, flags=1)
    reply = request.reply(status=6, num_frames=1)
    assert (reply.request_id, reply.client_id, reply.op, reply.status) == (11, 12, Op.STATS, 6)
    assert reply.flags == 0
    with pytest.raises(errors.ProtocolError, match="status"):
        protocol.unpack_header(reply.pack())
    assert protocol.unpack_header(reply.pack(), reply=True).status == 6


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"magic": b"XXXX"}, "magic"),
        ({"version": 2}, "version 2"),
        ({"version": 0}, "version 0"),
        ({"op": 0}, "unknown op 0"),
        ({"op": 999}, "unknown op 999"),
        ({"flags": 0x80}, "flags"),
        ({"status": 3}, "status"),
        ({"incarnation": 1}, "incarnation header field is reserved in requests"),
        ({"num_items": protocol.MAX_ITEMS + 1}, "num_items"),
        ({"num_frames": 2**32 - 1}, "num_frames"),
        ({"rank": -1}, "rank"),
        ({"clock": -5}, "clock"),
    ],
)
def test_bad_header_fields_are_refused_by_name(fields, message):
    with pytest.raises(errors.ProtocolError, match=message):
        protocol.unpack_header(raw_header(**fields))


@pytest.mark.parametrize("size", [0, 1, 55, 57, 200])
def test_header_of_wrong_size_is_refused(size):
    data = (raw_header() * 4)[:size]
    with pytest.raises(errors.ProtocolError, match="56 bytes"):
        protocol.unpack_header(data)
    assert protocol.peek_header(data) is None


def test_peek_header_recovers_the_request_id_of_a_bad_header():
    peeked = protocol.peek_header(raw_header(version=7, request_id=42, client_id=3))
    assert (peeked.request_id, peeked.client_id, peeked.op) == (42, 3, Op.PULL_SPARSE)
    assert protocol.peek_header(raw_header(op=4242)).op == 0
    assert protocol.peek_header(b"NOPE" + raw_header()[4:]) is None


def test_parse_message_checks_the_frame_count():
    header = Header(op=Op.PING, num_frames=2).pack()
    with pytest.raises(errors.ProtocolError, match="announces 2 payload frames, the message has 1"):
        protocol.parse_message([header, b"x"])
    with pytest.raises(errors.ProtocolError, match="empty"):
        protocol.parse_message([])
    parsed, payload = protocol.parse_message([header, b"a", b"b"])
    assert parsed.num_frames == 2 and [bytes(p) for p in payload] == [b"a", b"b"]


def test_items_round_trip_and_validation():
    items = protocol.make_items([(2**64 - 1, 3, 8), (7, 0, 0)])
    assert items.dtype.itemsize == 24
    parsed = protocol.parse_items(items.tobytes(), 2)
    assert parsed.tolist() == [(2**64 - 1, 3, 8, 0), (7, 0, 0, 0)]
    with pytest.raises(errors.ProtocolError, match="items frame"):
        protocol.parse_items(items.tobytes()[:-1], 2)
    with pytest.raises(errors.ProtocolError, match="items frame"):
        protocol.parse_items(items.tobytes(), 3)
    bad = items.copy()
    bad["count"][0] = -1
    with pytest.raises(errors.ProtocolError, match="negative count"):
        protocol.parse_items(bad.tobytes(), 2)
    bad = items.copy()
    bad["dim"][1] = protocol.MAX_DIM + 1
    with pytest.raises(errors.ProtocolError, match="dim"):
        protocol.parse_items(bad.tobytes(), 2)
    bad = items.copy()
    bad["flags"][1] = 2
    with pytest.raises(errors.ProtocolError, match="flags"):
        protocol.parse_items(bad.tobytes(), 2)


def test_frame_array_views_the_frame_without_copying():
    keys = np.arange(1000, dtype=np.int64)
    frame = zmq.Frame(keys.tobytes())
    array = protocol.frame_array(frame, np.int64, 1000, what="keys")
    np.testing.assert_array_equal(array, keys)
    # A view of the received frame, not a copy.
    assert np.shares_memory(array, np.frombuffer(frame.buffer, np.uint8))
    with pytest.raises(errors.ProtocolError, match="keys: frame has 8000 bytes, expected 8008"):
        protocol.frame_array(frame, np.int64, 1001, what="keys")
    with pytest.raises(errors.ProtocolError):
        protocol.frame_array(frame, np.int64, 2**62, what="keys")
    assert protocol.frame_array(b"", np.float32, 0, what="rows").shape == (0,)


def test_frame_array_copies_misaligned_small_frames():
    data = bytearray(17)
    view = memoryview(data)[1:]
    array = protocol.frame_array(view, np.int64, 2, what="keys")
    assert array.flags.aligned


def test_tree_round_trip():
    tree = [
        [
            2**64 - 1,
            {
                "keys": np.arange(3, dtype=np.int64),
                "slots": np.ones((3, 2, 4), np.float32),
                "table_step": 7,
            },
        ],
        [5, {"slots": np.empty((0, 6)), "step": 0}],
    ]
    meta, arrays = protocol.encode_tree(tree)
    back = protocol.decode_tree([meta, *[a.tobytes() for a in arrays]], what="t")
    assert back[0][0] == 2**64 - 1 and back[0][1]["table_step"] == 7
    np.testing.assert_array_equal(back[0][1]["keys"], np.arange(3))
    assert back[0][1]["slots"].shape == (3, 2, 4) and back[0][1]["slots"].dtype == np.float32
    assert back[1][1]["slots"].shape == (0, 6) and back[1][1]["slots"].dtype == np.float32


@pytest.mark.parametrize(
    "meta, frames, message",
    [
        (b"{not json", [], "not valid JSON"),
        (b'{"__array__": 0, "dtype": "float32", "shape": [2]}', [], "bad array reference"),
        (b'{"__array__": 0, "dtype": "float64", "shape": [1]}', [b"\0" * 8], "bad array"),
        (b'{"__array__": 0, "dtype": "int64", "shape": [-1]}', [b""], "bad array"),
        (b'{"__array__": 0, "dtype": "int64", "shape": [2]}', [b"\0" * 8], "expected 16"),
        (b"[1, 2]", [b"\0"], "unreferenced"),
    ],
)
def test_malformed_trees_are_refused(meta, frames, message):
    with pytest.raises(errors.ProtocolError, match=message):
        protocol.decode_tree([meta, *frames], what="t")


def test_json_frames():
    assert protocol.decode_json(protocol.encode_json({"a": [1, None]}), what="x") == {
        "a": [1, None]
    }
    with pytest.raises(errors.ProtocolError, match="x: not valid JSON"):
        protocol.decode_json(b"\xff\xfe", what="x")


@pytest.mark.parametrize(
    "cls",
    [
        errors.ProtocolError,
        errors.InvalidArgument,
        errors.ShapeError,
        errors.DTypeError,
        errors.KeyTypeError,
        errors.UnknownKey,
        errors.DuplicateKey,
        errors.NonFiniteGradient,
        errors.CapacityError,
        errors.ServerError,
    ],
)
def test_errors_travel_as_their_class(cls):
    request = Header(op=Op.PUSH_SPARSE, request_id=3, client_id=4)
    frames = protocol.error_reply(request, cls("it went wrong"))
    header, payload = protocol.parse_message(frames, reply=True)
    assert header.request_id == 3 and header.status != 0
    with pytest.raises(cls, match=r"it went wrong \(server tcp://h:1\)") as info:
        protocol.raise_remote_error(header, payload, "tcp://h:1")
    assert type(info.value) is cls


def test_unexpected_exceptions_travel_as_server_errors():
    frames = protocol.error_reply(None, RuntimeError("boom"))
    header, payload = protocol.parse_message(frames, reply=True)
    assert header.request_id == 0
    with pytest.raises(errors.ServerError, match="RuntimeError: boom"):
        protocol.raise_remote_error(header, payload, "tcp://h:1")


def test_error_codes_are_distinct():
    assert len(set(protocol.ERROR_CODES.values())) == len(protocol.ERROR_CODES)
    assert 0 not in protocol.ERROR_CODES.values()


def test_header_layout_is_the_documented_one():
    packed = Header(
        op=Op.HELLO,
        flags=1,
        request_id=0x0102,
        client_id=0x0304,
        rank=5,
        num_items=6,
        clock=7,
        num_frames=8,
    ).pack()
    assert struct.unpack_from("<H", packed, 6)[0] == Op.HELLO
    assert struct.unpack_from("<I", packed, 8)[0] == 1
    assert struct.unpack_from("<Q", packed, 16)[0] == 0x0102
    assert struct.unpack_from("<Q", packed, 24)[0] == 0x0304
    assert struct.unpack_from("<i", packed, 32)[0] == 5
    assert struct.unpack_from("<I", packed, 36)[0] == 6
    assert struct.unpack_from("<q", packed, 40)[0] == 7
    assert struct.unpack_from("<I", packed, 48)[0] == 8
    assert struct.unpack_from("<I", packed, 52)[0] == 0  # incarnation: replies only


def test_the_docstring_table_lists_every_op():
    lines = protocol.__doc__.splitlines()
    for op in Op:
        (row,) = [i for i, line in enumerate(lines) if line.strip().startswith(op.name + " ")]
        # "NAME (value)", or a long name with "(value)" on the next line.
        assert f"({op.value})" in lines[row].split()[1] + lines[row + 1].split()[0], op
