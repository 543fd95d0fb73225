"""Each operation's payload layout, encoded and decoded in one place for both ends.

One class per op (`CODECS` maps every `Op` to its class), each with four
class methods:

- ``encode_request(...)`` (worker): a `Request`, the payload frames and the
  header fields the op sets; the client session adds the rest of the header.
- ``decode_request(header, payload)`` (server): typed values, every frame
  checked first.
- ``encode_reply(...)`` (server): a `Reply`, the payload frames and num_items.
- ``decode_reply(header, payload, ...)`` (worker): typed values of a
  successful reply (an error reply is raised by the session before).

Sparse rows may travel as 16-bit values (a table's wire dtype;
the layout in `kvsparse.wire.protocol`): the server's codecs convert (a
pull's reply rows are narrowed by ``encode_reply``, a push's rows widened to
float32 by ``decode_request``, so the server's state sees float32 only); the
worker's codecs pass the 16-bit rows as they are (uint16 bit patterns): the
store narrows a push's summed rows once, and widens a pull's reply rows
straight into the caller's output (`_core.gather_widen_from_shards`).

A decoder raises `kvsparse.errors.ProtocolError` for anything malformed: a
missing or extra frame, a frame of the wrong length, bad JSON, a field of the
wrong type or range. Checks that need a shard's state (does the table exist,
is the dim the table's) belong to the server's handlers. The byte layout is
the table in `kvsparse.wire.protocol`'s docstring.

The codecs hold no state: every function here is safe to call from any thread.

Example:
    >>> request = PullSparse.encode_request([(7, np.array([1, 2], np.int64))])
    >>> request.op.name, request.num_items, len(request.frames)
    ('PULL_SPARSE', 1, 2)
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Optional

import numpy as np

from kvsparse import _core, errors
from kvsparse.arrays import TABLE_DTYPES
from kvsparse.wire import protocol
from kvsparse.wire.protocol import (
    FLAG_DECLARE,
    FLAG_MONITOR,
    FLAG_SHARED,
    ITEM_DTYPE_MASK,
    ITEM_DTYPE_SHIFT,
    ITEM_FLAG_STEP,
    WIRE_DTYPE_NAMES,
    WIRE_FRAME_DTYPES,
    Header,
    Op,
    item_dtype_flags,
)

_U64 = struct.Struct("<Q")
_MAX_TABLE_ID = (1 << 64) - 1


class Mode(str, enum.Enum):
    """A store's consistency mode, as HELLO carries it.

    A ``str`` enum: a member equals (and JSON-encodes as) its value. Immutable.
    """

    BSP = "bsp"  # bulk synchronous: a push returns once every worker pushed the table
    ASP = "asp"  # asynchronous: applied on arrival
    SSP = "ssp"  # stale synchronous: applied on arrival, pulls wait for slow workers


MODES = tuple(mode.value for mode in Mode)


class Request(NamedTuple):
    """A request's payload frames and the header fields its op sets (immutable)."""

    op: Op
    frames: list
    num_items: int = 0
    flags: int = 0


class Reply(NamedTuple):
    """A successful reply's payload frames and num_items (immutable).

    A tuple of (frames, num_items): what a server handler returns.
    """

    frames: list
    num_items: int = 0


# -- field and frame checks ------------------------------------------------------------------


def check_int(value, what: str, low: int, high: Optional[int] = None) -> int:
    """value, if it is an int (not a bool) in [low, high].

    Raises:
        ProtocolError: naming `what` and the allowed range.

    Example:
        >>> check_int(3, "epoch", 1)
        3
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise errors.ProtocolError(f"{what} must be an integer {bound}, got {value!r}")
    return value


def _json_object(payload, what: str) -> dict:
    """The JSON object of a payload of exactly one frame."""
    if len(payload) != 1:
        raise errors.ProtocolError(f"{what} takes 1 payload frame(s), got {len(payload)}")
    body = protocol.decode_json(payload[0], what=what)
    if not isinstance(body, dict):
        raise errors.ProtocolError(f"{what}: the JSON payload must be an object")
    return body


def _no_payload(payload, what: str) -> None:
    if payload:
        raise errors.ProtocolError(f"{what} takes no payload")


def _request_items(header: Header, payload, frames_per_item: int, what: str) -> np.ndarray:
    """The items frame of a table request, once the frame count fits num_items."""
    if not payload:
        raise errors.ProtocolError(f"{what} needs an items frame")
    items = protocol.parse_items(payload[0], header.num_items)
    expected = 1 + frames_per_item * header.num_items
    if len(payload) != expected:
        raise errors.ProtocolError(
            f"{what} with {header.num_items} items takes {expected} payload frames, "
            f"got {len(payload)}"
        )
    return items


def _array_per_item_request(op: Op, entries: Sequence) -> Request:
    """entries: [(table_id, 1-D array)] -> an item each (count: the array's size), the arrays."""
    items = protocol.make_items([(table_id, array.size, 0) for table_id, array in entries])
    return Request(op, [items, *(array for _, array in entries)], num_items=len(entries))


def _float32_items(items: np.ndarray, what: str, values: str = "dense values") -> np.ndarray:
    """items, if none names a row dtype: dense values and assigned rows travel as float32.

    Raises:
        ProtocolError: an item with a row dtype code.
    """
    if (items["flags"] & np.uint32(ITEM_DTYPE_MASK)).any():
        raise errors.ProtocolError(f"{what}: {values} travel as float32 (no row dtype code)")
    return items


def _wire_rows(frame, wire_dtype: str, count: int, dim: int, what: str) -> np.ndarray:
    """A (count, dim) rows frame of wire_dtype: float32, or uint16 bit patterns (a view)."""
    rows = protocol.frame_array(frame, WIRE_FRAME_DTYPES[wire_dtype], count * dim, what=what)
    return rows.reshape(count, dim)


def _array_per_item(header: Header, payload, dtype, what: str, frame_what: str) -> tuple:
    """(items, [array of each item's count]) of a request encoded by `_array_per_item_request`."""
    items = _request_items(header, payload, 1, what)
    arrays = [
        protocol.frame_array(payload[1 + i], dtype, count, what=f"{frame_what} {i}")
        for i, (_, count, _, _) in enumerate(items.tolist())
    ]
    return items, arrays


def _reply_items(header: Header, payload, count: int, what: str) -> np.ndarray:
    """The items frame of a pull reply that must answer `count` items."""
    if header.num_items != count or len(payload) != 1 + count:
        raise errors.ProtocolError(
            f"{what} reply has {header.num_items} items and {len(payload)} frames for {count} items"
        )
    return protocol.parse_items(payload[0], count)


def _shared_offsets(header: Header, payload, what: str) -> tuple:
    """(payload without it, u64 offsets per item) of a FLAG_SHARED request; else (payload, None).

    Raises:
        ProtocolError: no offsets frame, or one of another size.
    """
    if not header.flags & FLAG_SHARED:  # (unpack_header refuses it on other ops)
        return payload, None
    if len(payload) < 2:
        raise errors.ProtocolError(f"{what} with FLAG_SHARED needs an offsets frame")
    offsets = protocol.frame_array(
        payload[-1], np.uint64, header.num_items, what=f"{what} shared offsets"
    )
    return payload[:-1], offsets


def shared_rows(
    segment: np.ndarray, offset: int, count: int, dim: int, wire_dtype: str, what: str
) -> np.ndarray:
    """A (count, dim) view of wire_dtype rows at byte offset of a shared segment (uint8).

    Raises:
        ProtocolError: an offset that is not a multiple of the element size, or rows
            that do not lie within the segment.
    """
    dtype = np.dtype(WIRE_FRAME_DTYPES[wire_dtype])
    nbytes = count * dim * dtype.itemsize
    if offset % dtype.itemsize or offset + nbytes > segment.size:
        raise errors.ProtocolError(
            f"{what}: {nbytes} bytes at offset {offset} do not fit a shared segment of "
            f"{segment.size} bytes in {dtype.name} elements"
        )
    return segment[offset : offset + nbytes].view(dtype).reshape(count, dim)


def _table_states(tree, what: str) -> list:
    """[(table_id, state)] from a tree [[table_id, {state}], ...]."""
    if not isinstance(tree, list) or not all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[1], dict) for e in tree
    ):
        raise errors.ProtocolError(f"{what}: expected [[table_id, state], ...]")
    return [(check_int(table_id, "table_id", 0, _MAX_TABLE_ID), state) for table_id, state in tree]


# -- the codecs ---------------------------------------------------------------------------------


class _Codec:
    """The layout of an op with no payload either way; each op's class overrides what it carries."""

    op: Op

    @classmethod
    def encode_request(cls) -> Request:
        """The request (no payload)."""
        return Request(cls.op, [])

    @classmethod
    def decode_request(cls, header: Header, payload) -> None:
        """Checks that the request has no payload.

        Raises:
            ProtocolError: it has one.
        """
        _no_payload(payload, cls.op.name)

    @classmethod
    def encode_reply(cls) -> Reply:
        """The reply (no payload)."""
        return Reply([])

    @classmethod
    def decode_reply(cls, header: Header, payload) -> None:
        """Checks that the reply has no payload.

        Raises:
            ProtocolError: it has one.
        """
        _no_payload(payload, f"{cls.op.name} reply")


class Ping(_Codec):
    """PING: liveness. The reply says the last request id of the sender's client it holds.

    A worker waiting long for a reply pings; a server that holds an older
    request id than the one awaited never got that request.
    """

    op = Op.PING

    @classmethod
    def encode_reply(cls, last_request_id: int, held: str = "") -> Reply:
        """The reply: the last request id of this client the server holds (0: none), and
        what the server holds of the client's requests and for whom, in words ("": none)."""
        return Reply([_U64.pack(last_request_id), held.encode()])

    @classmethod
    def decode_reply(cls, header: Header, payload) -> Optional[int]:
        """The last request id the server holds, or None if the reply does not say."""
        if len(payload) not in (1, 2) or protocol.frame_nbytes(payload[0]) != _U64.size:
            return None
        return int(protocol.frame_array(payload[0], np.uint64, 1, what="PING reply")[0])

    @classmethod
    def decode_held(cls, payload) -> str:
        """What the server said it holds of the client's requests ("": nothing, or not said)."""
        if len(payload) != 2:
            return ""
        return protocol.frame_text(payload[1])


class HelloRequest(NamedTuple):
    """A worker's HELLO: how it sees the cluster (immutable)."""

    num_workers: int
    mode: Mode
    staleness: Optional[int]
    rank: int
    num_servers: int
    server_index: int
    # The worker's shared-memory segment, offered to a server on its host:
    # {"pid", "fd", "bytes", "token"} (protocol module docstring, "Shared memory"); None: none.
    shared: Optional[dict] = None

    def settings(self) -> dict:
        """The fields every client of one server must agree on (all but rank), plain values."""
        return {
            "num_workers": self.num_workers,
            "mode": self.mode.value,
            "staleness": self.staleness,
            "num_servers": self.num_servers,
            "server_index": self.server_index,
        }


class HelloReply(NamedTuple):
    """A server's answer to HELLO (immutable)."""

    address: str
    version: int
    incarnation: int
    shared: bool = False  # the server mapped the worker's shared segment
    shared_error: str = ""  # why it did not, where one was offered
    # The largest frame the server receives (its --max-message-size); -1: no limit, or a
    # server that does not say. A bigger frame would make ZeroMQ drop the connection.
    max_message_size: int = -1


class Hello(_Codec):
    """HELLO: a worker introduces itself; the first one configures the server."""

    op = Op.HELLO

    @classmethod
    def encode_request(cls, hello: HelloRequest) -> Request:
        """The request for hello (`HelloRequest`)."""
        body = hello._asdict()
        body["mode"] = Mode(hello.mode).value
        if hello.shared is None:
            del body["shared"]
        return Request(cls.op, [protocol.encode_json(body)])

    @classmethod
    def without_shared(cls, request: Request) -> Request:
        """A HELLO request (from `encode_request`) without its shared-memory offer.

        What a forked child sends: the segment offered is its parent's.
        """
        body = _json_object(request.frames, "HELLO")
        body.pop("shared", None)
        return Request(cls.op, [protocol.encode_json(body)])

    @classmethod
    def decode_request(cls, header: Header, payload) -> HelloRequest:
        """The HELLO, checked field by field and against the header's rank.

        Raises:
            ProtocolError: a missing or out-of-range field, or a rank other
                than the header's.
        """
        hello = _json_object(payload, "HELLO")
        num_workers = check_int(hello.get("num_workers"), "num_workers", 1, 1 << 20)
        mode = hello.get("mode")
        if not isinstance(mode, str) or mode not in MODES:
            raise errors.ProtocolError(f"mode must be one of {MODES}, got {mode!r}")
        staleness = hello.get("staleness")
        if mode == Mode.SSP:
            check_int(staleness, "staleness", 0)
        elif staleness is not None:
            raise errors.ProtocolError(f"staleness is only for mode 'ssp', got {staleness!r}")
        num_servers = check_int(hello.get("num_servers"), "num_servers", 1, 1 << 16)
        server_index = check_int(hello.get("server_index"), "server_index", 0, num_servers - 1)
        rank = check_int(hello.get("rank"), "rank", 0, num_workers - 1)
        if rank != header.rank:
            raise errors.ProtocolError(f"HELLO says rank {rank}, its header {header.rank}")
        shared = hello.get("shared")
        if shared is not None:
            if not isinstance(shared, dict):
                raise errors.ProtocolError("HELLO shared must be an object")
            token = shared.get("token")
            if not isinstance(token, str) or len(token) != 32:
                raise errors.ProtocolError("HELLO shared token must be 32 hex digits")
            shared = {
                "pid": check_int(shared.get("pid"), "shared pid", 1, (1 << 31) - 1),
                "fd": check_int(shared.get("fd"), "shared fd", 0, (1 << 31) - 1),
                "bytes": check_int(shared.get("bytes"), "shared bytes", 4096, 1 << 40),
                "token": token,
            }
        return HelloRequest(
            num_workers, Mode(mode), staleness, rank, num_servers, server_index, shared
        )

    @classmethod
    def encode_reply(
        cls,
        address: str,
        incarnation: int,
        shared: Optional[bool] = None,
        shared_error: str = "",
        max_message_size: int = -1,
    ) -> Reply:
        """The reply: the server's address, protocol version and incarnation; shared: whether
        it mapped the segment the HELLO offered (None: none was offered), else why not;
        max_message_size: the largest frame it receives (-1: no limit)."""
        body = {
            "address": address,
            "version": protocol.VERSION,
            "incarnation": incarnation,
            "max_message_size": int(max_message_size),
        }
        if shared is not None:
            body["shared"] = bool(shared)
            if not shared:
                body["shared_error"] = str(shared_error)
        return Reply([protocol.encode_json(body)])

    @classmethod
    def decode_reply(cls, header: Header, payload) -> HelloReply:
        """The server's address, version and incarnation (0 where it does not say)."""
        body = _json_object(payload, "HELLO reply")
        incarnation = body.get("incarnation", 0)
        limit = body.get("max_message_size", -1)
        return HelloReply(
            str(body.get("address", "")),
            body.get("version", 0),
            incarnation if isinstance(incarnation, int) else 0,
            body.get("shared") is True,
            str(body.get("shared_error", "")),
            limit if isinstance(limit, int) and not isinstance(limit, bool) else -1,
        )


class InitSparseRequest(NamedTuple):
    """INIT_SPARSE: a table id, its name and its `SparseTable.to_dict()` spec (immutable)."""

    table_id: int
    name: str
    spec: dict


class InitSparse(_Codec):
    """INIT_SPARSE: create a sparse table (an identical existing one is kept)."""

    op = Op.INIT_SPARSE

    @classmethod
    def encode_request(cls, table_id: int, name: str, spec: dict) -> Request:
        """The request creating table_id (named name, for messages) with spec."""
        body = {"table_id": int(table_id), "name": name, "spec": spec}
        return Request(cls.op, [protocol.encode_json(body)])

    @classmethod
    def decode_request(cls, header: Header, payload) -> InitSparseRequest:
        """The table id, name and spec (the spec itself is checked by the server's table)."""
        body = _json_object(payload, "INIT_SPARSE")
        table_id = check_int(body.get("table_id"), "table_id", 0, _MAX_TABLE_ID)
        name, spec = body.get("name"), body.get("spec")
        if not isinstance(name, str) or not isinstance(spec, dict):
            raise errors.ProtocolError("INIT_SPARSE needs a str name and a dict spec")
        return InitSparseRequest(table_id, name, spec)

    @classmethod
    def encode_reply(cls, created: bool) -> Reply:
        """The reply: whether the table was created (False: an identical one existed)."""
        return Reply([protocol.encode_json({"created": bool(created)})])

    @classmethod
    def decode_reply(cls, header: Header, payload) -> bool:
        """Whether the server created the table."""
        created = _json_object(payload, "INIT_SPARSE reply").get("created")
        if not isinstance(created, bool):
            raise errors.ProtocolError(
                f"INIT_SPARSE reply: created must be a bool, got {created!r}"
            )
        return created


class InitDenseRequest(NamedTuple):
    """INIT_DENSE: a dense key's slice on one server (immutable).

    values: the float32 slice, or None for a declaration (FLAG_DECLARE: a
    worker other than rank 0, answered once rank 0's values are in place).
    """

    table_id: int
    name: str
    size: int
    values: Optional[np.ndarray]
    # What the server stores: 'float32', 'float16' or 'bfloat16'.
    dtype: str = "float32"


class InitDense(_Codec):
    """INIT_DENSE: rank 0 sends a dense key's values; the other ranks declare it."""

    op = Op.INIT_DENSE

    @classmethod
    def encode_request(
        cls,
        table_id: int,
        name: str,
        size: int,
        values: Optional[np.ndarray] = None,
        dtype: str = "float32",
    ) -> Request:
        """The request for a slice of size values (None: a declaration, FLAG_DECLARE).

        dtype: how the server stores them; values travel as float32. The JSON
        names it only when not float32 (an older server then refuses nothing
        it knew).
        """
        fields = {"table_id": int(table_id), "name": name, "size": int(size)}
        if dtype != "float32":
            fields["dtype"] = dtype
        body = protocol.encode_json(fields)
        if values is None:
            return Request(cls.op, [body], flags=FLAG_DECLARE)
        return Request(cls.op, [body, values])

    @classmethod
    def decode_request(cls, header: Header, payload) -> InitDenseRequest:
        """The slice (values viewed in the frame, not copied) or the declaration."""
        declare = bool(header.flags & FLAG_DECLARE)
        if not payload:
            raise errors.ProtocolError("INIT_DENSE needs a JSON frame")
        body = _json_object(payload[:1], "INIT_DENSE")
        if len(payload) != (1 if declare else 2):
            raise errors.ProtocolError(
                f"INIT_DENSE {'with FLAG_DECLARE ' if declare else ''}takes "
                f"{1 if declare else 2} payload frames, got {len(payload)}"
            )
        table_id = check_int(body.get("table_id"), "table_id", 0, _MAX_TABLE_ID)
        size = check_int(body.get("size"), "size", 0, 1 << 40)
        name = body.get("name")
        if not isinstance(name, str):
            raise errors.ProtocolError("INIT_DENSE needs a str name")
        dtype = body.get("dtype", "float32")
        if dtype not in TABLE_DTYPES:
            raise errors.ProtocolError(f"INIT_DENSE dtype must be one of {TABLE_DTYPES}")
        values = None
        if not declare:
            values = protocol.frame_array(payload[1], np.float32, size, what="INIT_DENSE values")
        return InitDenseRequest(table_id, name, size, values, dtype)


class SetOptimizerRequest(NamedTuple):
    """SET_OPTIMIZER: an `Optimizer.to_dict()` spec (None: none) and the call's number.

    replay: rank 0 sends its last call again to a restarted server: recorded
    as call ``epoch``, applied only if the server's optimizer differs (a
    restored one keeps its slots).
    """

    spec: Optional[dict]
    epoch: int
    replay: bool = False
    # The tables it is for (None: the store-wide optimizer; else those tables' own).
    table_ids: Optional[list] = None
    # Not None: a learning-rate change (spec None): the optimizers' rate becomes this, and
    # every slot and step stays (`ShardState.set_learning_rate`).
    learning_rate: Optional[float] = None


class SetOptimizer(_Codec):
    """SET_OPTIMIZER: rank 0 sets the optimizer; the others' n-th call checks rank 0's n-th."""

    op = Op.SET_OPTIMIZER

    @classmethod
    def encode_request(
        cls,
        spec: Optional[dict],
        epoch: int,
        replay: bool = False,
        table_ids: Optional[Sequence] = None,
        learning_rate: Optional[float] = None,
    ) -> Request:
        """The request of this worker's epoch-th set_optimizer call (replay: sent again).

        table_ids: the tables whose own optimizer spec becomes (spec None: they
        go back to the store-wide one); None: the store-wide optimizer.
        learning_rate: a set_learning_rate call instead (spec None): the rate of
        the tables' optimizers (table_ids None: every table's and the store-wide
        one) becomes learning_rate, keeping their slots. It counts as a
        set_optimizer call (the same epochs).
        """
        body = {"spec": spec, "epoch": epoch, **({"replay": True} if replay else {})}
        if table_ids is not None:
            body["table_ids"] = [int(table_id) for table_id in table_ids]
        if learning_rate is not None:
            body["learning_rate"] = float(learning_rate)
        return Request(cls.op, [protocol.encode_json(body)])

    @classmethod
    def decode_request(cls, header: Header, payload) -> SetOptimizerRequest:
        """The spec and epoch (the spec itself is checked by the server's state)."""
        body = _json_object(payload, "SET_OPTIMIZER")
        spec = body.get("spec")
        epoch = check_int(body.get("epoch"), "epoch", 1)
        if spec is not None and not isinstance(spec, dict):
            raise errors.ProtocolError("SET_OPTIMIZER spec must be an object or null")
        replay = body.get("replay", False)
        if not isinstance(replay, bool):
            raise errors.ProtocolError("SET_OPTIMIZER replay must be true or false")
        table_ids = body.get("table_ids")
        if table_ids is not None:
            if not isinstance(table_ids, list) or not table_ids:
                raise errors.ProtocolError("SET_OPTIMIZER table_ids must be a non-empty list")
            table_ids = [check_int(t, "table_id", 0, _MAX_TABLE_ID) for t in table_ids]
        learning_rate = body.get("learning_rate")
        if learning_rate is not None:
            if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)):
                raise errors.ProtocolError("SET_OPTIMIZER learning_rate must be a number")
            if spec is not None:
                raise errors.ProtocolError("SET_OPTIMIZER has a spec or a learning_rate, not both")
            learning_rate = float(learning_rate)
        return SetOptimizerRequest(spec, epoch, replay, table_ids, learning_rate)


class PullSparseRequest(NamedTuple):
    """PULL_SPARSE: the items frame as received and each item's keys (views of the frames).

    offsets: with FLAG_SHARED, where each item's rows go in the client's shared segment
    (u64 bytes); else None.
    """

    items: np.ndarray
    keys: list
    offsets: Optional[np.ndarray] = None


class PullSparse(_Codec):
    """PULL_SPARSE: rows of some keys of one or more sparse tables (created if missing)."""

    op = Op.PULL_SPARSE

    @classmethod
    def encode_request(
        cls, entries: Sequence, offsets: Optional[Sequence] = None, dims: Optional[Sequence] = None
    ) -> Request:
        """entries: [(table_id, int64 keys)] or [(table_id, keys, wire_dtype)]; one item each.

        wire_dtype ('float32' when not given): the dtype the rows come back in.
        offsets: byte offsets in this client's shared segment where the server writes
        each item's rows (FLAG_SHARED), and dims the row widths the client made room
        for (the items' dim; a server whose table is another width refuses); None:
        the rows come in the reply.
        """
        dims = [0] * len(entries) if dims is None else list(dims)
        items = protocol.make_items(
            [
                (
                    entry[0],
                    entry[1].size,
                    dim,
                    item_dtype_flags(entry[2] if len(entry) > 2 else "float32"),
                )
                for entry, dim in zip(entries, dims)
            ]
        )
        frames = [items, *(entry[1] for entry in entries)]
        if offsets is None:
            return Request(cls.op, frames, num_items=len(entries))
        frames.append(np.asarray(offsets, np.uint64))
        return Request(cls.op, frames, num_items=len(entries), flags=FLAG_SHARED)

    @classmethod
    def decode_request(cls, header: Header, payload) -> PullSparseRequest:
        """The items (each with its row dtype code), each one's int64 keys, the offsets."""
        payload, offsets = _shared_offsets(header, payload, cls.op.name)
        items, keys = _array_per_item(header, payload, np.int64, cls.op.name, "PULL_SPARSE keys")
        return PullSparseRequest(items, keys, offsets)

    @classmethod
    def shared_targets(
        cls, items: np.ndarray, offsets: np.ndarray, dims: Sequence, segment: np.ndarray
    ) -> list:
        """The (count, dim) views of the client's segment that a FLAG_SHARED pull's rows go to.

        dims: the tables' row widths, which the items' dims (what the client made room
        for) must equal.

        Raises:
            ShapeError: an item's dim is not its table's.
            ProtocolError: rows that do not fit the segment at their offset.
        """
        for (table_id, _, item_dim, _), dim in zip(items.tolist(), dims):
            if item_dim != dim:
                raise errors.ShapeError(
                    f"PULL_SPARSE into shared memory: table {table_id:#x} has rows of dim "
                    f"{dim}, the client made room for dim {item_dim}"
                )
        return [
            shared_rows(segment, offset, count, dim, wire_dtype, f"PULL_SPARSE rows {i}")
            for i, (offset, (_, count, _, _), dim, wire_dtype) in enumerate(
                zip(offsets.tolist(), items.tolist(), dims, protocol.item_wire_dtypes(items))
            )
        ]

    @classmethod
    def encode_reply(
        cls, items: np.ndarray, rows: Sequence, targets: Optional[list] = None
    ) -> Reply:
        """items: the request's; rows: a float32 (count, dim) array per item.

        Rows of an item that asks for a 16-bit dtype are narrowed to it (a new
        array); float32 rows are sent uncopied. targets (FLAG_SHARED,
        `shared_targets`): the rows are written there instead, and the reply's
        rows frames are empty.
        """
        reply_items = items.copy()
        reply_items["dim"] = [item_rows.shape[1] for item_rows in rows]
        frames = [reply_items]
        for i, (item_rows, wire_dtype) in enumerate(zip(rows, protocol.item_wire_dtypes(items))):
            wired = item_rows if wire_dtype == "float32" else _core.narrow(item_rows, wire_dtype)
            if targets is None:
                frames.append(wired)
            else:
                targets[i][...] = wired
                frames.append(b"")
        return Reply(frames, len(rows))

    @classmethod
    def decode_reply(
        cls, header: Header, payload, requested: Sequence, shared: Optional[Sequence] = None
    ) -> list:
        """requested: [(table_id, number of keys[, wire_dtype])] as sent -> rows per item.

        Each item's rows: a (count, dim) view of its frame, float32, or uint16
        bit patterns for a 16-bit wire dtype (widened by the caller). shared: for a
        FLAG_SHARED pull, the (count, dim) views of the segment the server wrote each
        item's rows into (returned, once the reply says they are there).

        Raises:
            ProtocolError: the reply does not answer exactly the items requested
                (their tables, counts and row dtypes).
        """
        reply_items = _reply_items(header, payload, len(requested), "PULL_SPARSE")
        dtypes = protocol.item_wire_dtypes(reply_items)
        out = []
        for position, (entry, item) in enumerate(zip(requested, reply_items.tolist())):
            table_id, count = entry[0], entry[1]
            wire_dtype = entry[2] if len(entry) > 2 else "float32"
            dim = item[2]
            if item[0] != int(table_id) or item[1] != count or not 1 <= dim:
                raise errors.ProtocolError(
                    f"PULL_SPARSE reply: item {item} answers a pull of {count} keys of table "
                    f"{int(table_id):#x}"
                )
            if dtypes[position] != wire_dtype:
                raise errors.ProtocolError(
                    f"PULL_SPARSE reply: rows of table {int(table_id):#x} came as "
                    f"{dtypes[position]}, asked for {wire_dtype}"
                )
            if shared is None:
                out.append(
                    _wire_rows(payload[1 + position], wire_dtype, count, dim, "PULL_SPARSE rows")
                )
                continue
            target = shared[position]
            if protocol.frame_nbytes(payload[1 + position]) or target.shape != (count, dim):
                raise errors.ProtocolError(
                    f"PULL_SPARSE reply: rows of table {int(table_id):#x} ({count} x {dim}) "
                    f"do not answer a pull into shared memory of {target.shape}"
                )
            out.append(target)
        return out


class PrefetchSparse(_Codec):
    """PREFETCH_SPARSE: ids of one or more sparse tables whose rows a pull will ask for soon.

    A shard with a disk tier brings those of their rows that are on disk into
    memory at once; the reply counts them per item. Nothing else changes: the
    pull that follows returns what it would have returned without it.
    """

    op = Op.PREFETCH_SPARSE

    @classmethod
    def encode_request(cls, entries: Sequence) -> Request:
        """entries: [(table_id, int64 keys)]; one item each."""
        return _array_per_item_request(cls.op, entries)

    @classmethod
    def decode_request(cls, header: Header, payload) -> tuple:
        """(items, [each item's int64 keys]) (views of the frames)."""
        return _array_per_item(header, payload, np.int64, cls.op.name, "PREFETCH_SPARSE keys")

    @classmethod
    def encode_reply(cls, read: Sequence) -> Reply:
        """read: the rows each item brought in from disk."""
        return Reply([np.asarray(read, np.int64)])

    @classmethod
    def decode_reply(cls, header: Header, payload, count: int) -> np.ndarray:
        """The rows brought in from disk, one count per item of the `count` requested.

        Raises:
            ProtocolError: the reply does not hold `count` counts.
        """
        if len(payload) != 1:
            raise errors.ProtocolError(f"PREFETCH_SPARSE reply has {len(payload)} frames, not 1")
        return protocol.frame_array(payload[0], np.int64, count, what="PREFETCH_SPARSE reply")


class SparsePush(NamedTuple):
    """One table's part of a PUSH_SPARSE (immutable).

    step: the push had keys of this table on some server, so it counts as a
    step of the table even where it has none (`ITEM_FLAG_STEP`).
    wire_dtype: how the rows travel. To `PushSparse.encode_request` rows are
    in it already (float32, or uint16 bit patterns of 'float16' /
    'bfloat16'); from `PushSparse.decode_request` they are always float32
    (widened), and wire_dtype says what came.
    """

    table_id: int
    keys: np.ndarray
    rows: np.ndarray
    step: bool
    wire_dtype: str = "float32"


class PushSparseRequest(NamedTuple):
    """PUSH_SPARSE: the items frame as received and each item's keys and rows."""

    items: np.ndarray
    entries: list
    shared: bool = False  # the rows are views of the client's shared segment (FLAG_SHARED)


class PushSparse(_Codec):
    """PUSH_SPARSE: summed gradient rows of some keys of one or more sparse tables."""

    op = Op.PUSH_SPARSE

    @classmethod
    def encode_request(cls, entries: Sequence, offsets: Optional[Sequence] = None) -> Request:
        """entries: [`SparsePush`] or (table_id, keys, 2-D rows, step[, wire_dtype]) tuples.

        offsets: the byte offset of each entry's rows in this client's shared segment
        (FLAG_SHARED: the rows frames are empty); None: the rows travel in the request.

        Raises:
            DTypeError: rows not of their wire dtype's frame dtype (float32 or uint16).
        """
        entries = [SparsePush(*entry) for entry in entries]
        for entry in entries:
            if entry.rows.dtype != WIRE_FRAME_DTYPES[entry.wire_dtype]:
                raise errors.DTypeError(
                    f"PUSH_SPARSE rows of wire dtype {entry.wire_dtype} must be "
                    f"{np.dtype(WIRE_FRAME_DTYPES[entry.wire_dtype]).name}, got {entry.rows.dtype}"
                )
        items = protocol.make_items(
            [
                (
                    entry.table_id,
                    entry.keys.size,
                    entry.rows.shape[1],
                    (ITEM_FLAG_STEP if entry.step else 0) | item_dtype_flags(entry.wire_dtype),
                )
                for entry in entries
            ]
        )
        frames = [items]
        for entry in entries:
            frames += [entry.keys, entry.rows if offsets is None else b""]
        if offsets is None:
            return Request(cls.op, frames, num_items=len(entries))
        frames.append(np.asarray(offsets, np.uint64))
        return Request(cls.op, frames, num_items=len(entries), flags=FLAG_SHARED)

    @classmethod
    def decode_request(
        cls, header: Header, payload, segment: Optional[np.ndarray] = None
    ) -> PushSparseRequest:
        """The items and each one's keys and float32 (count, dim) rows.

        float32 rows are views of the frames (FLAG_SHARED: of segment, the client's
        shared segment, uint8); 16-bit rows are widened into new arrays.

        Raises:
            ProtocolError: a malformed request; FLAG_SHARED with no segment, rows
                frames that are not empty, or rows outside the segment.
        """
        payload, offsets = _shared_offsets(header, payload, "PUSH_SPARSE")
        if offsets is not None and segment is None:
            raise errors.ProtocolError(
                "PUSH_SPARSE with FLAG_SHARED, but this server holds no shared segment of the "
                "client's (HELLO offers one)"
            )
        items = _request_items(header, payload, 2, "PUSH_SPARSE")
        entries = []
        for i, (table_id, count, dim, item_flags) in enumerate(items.tolist()):
            wire_dtype = WIRE_DTYPE_NAMES[item_flags >> ITEM_DTYPE_SHIFT]
            if offsets is None:
                keys, rows = _keys_and_rows(payload, i, count, dim, wire_dtype, "PUSH_SPARSE")
            else:
                if dim < 1:
                    raise errors.ProtocolError(f"PUSH_SPARSE item {i}: dim must be >= 1")
                if protocol.frame_nbytes(payload[2 + 2 * i]):
                    raise errors.ProtocolError(
                        f"PUSH_SPARSE item {i}: with FLAG_SHARED its rows frame must be empty"
                    )
                keys = protocol.frame_array(
                    payload[1 + 2 * i], np.int64, count, what=f"PUSH_SPARSE keys {i}"
                )
                rows = shared_rows(
                    segment, int(offsets[i]), count, dim, wire_dtype, f"PUSH_SPARSE rows {i}"
                )
            if wire_dtype != "float32":
                rows = _core.widen(rows, wire_dtype)
            step = bool(item_flags & ITEM_FLAG_STEP)
            entries.append(SparsePush(table_id, keys, rows, step, wire_dtype))
        return PushSparseRequest(items, entries, offsets is not None)


def _keys_and_rows(payload, i: int, count: int, dim: int, wire_dtype: str, what: str) -> tuple:
    """(keys, rows) of item i of a request laid out as items, then keys + rows per item."""
    if dim < 1:
        raise errors.ProtocolError(f"{what} item {i}: dim must be >= 1")
    keys = protocol.frame_array(payload[1 + 2 * i], np.int64, count, what=f"{what} keys {i}")
    rows = _wire_rows(payload[2 + 2 * i], wire_dtype, count, dim, f"{what} rows {i}")
    return keys, rows


class AssignSparseRequest(NamedTuple):
    """ASSIGN_SPARSE: the items frame as received and [(table_id, keys, float32 rows)]."""

    items: np.ndarray
    entries: list


class AssignSparse(_Codec):
    """ASSIGN_SPARSE: rows of some keys of sparse tables, written verbatim.

    No optimizer runs and admission does not count them (`_core.Table.assign`):
    what MXNet's ``init`` of a key does, at any time. Rows travel as float32.
    """

    op = Op.ASSIGN_SPARSE

    @classmethod
    def encode_request(cls, entries: Sequence) -> Request:
        """entries: [(table_id, unique int64 keys, float32 (count, dim) rows)]."""
        items = protocol.make_items(
            [(table_id, keys.size, rows.shape[1]) for table_id, keys, rows in entries]
        )
        frames = [items]
        for _, keys, rows in entries:
            frames += [keys, rows]
        return Request(cls.op, frames, num_items=len(entries))

    @classmethod
    def decode_request(cls, header: Header, payload) -> AssignSparseRequest:
        """The items and each one's keys and float32 rows (views of the frames).

        Raises:
            ProtocolError: a malformed frame, or an item with a row dtype code.
        """
        items = _float32_items(
            _request_items(header, payload, 2, "ASSIGN_SPARSE"), "ASSIGN_SPARSE", "assigned rows"
        )
        entries = []
        for i, (table_id, count, dim, _) in enumerate(items.tolist()):
            keys, rows = _keys_and_rows(payload, i, count, dim, "float32", "ASSIGN_SPARSE")
            entries.append((table_id, keys, rows))
        return AssignSparseRequest(items, entries)


class PullDense(_Codec):
    """PULL_DENSE: one server's slices of one or more dense keys."""

    op = Op.PULL_DENSE

    @classmethod
    def encode_request(cls, entries: Sequence) -> Request:
        """entries: [(table_id, slice size)]."""
        items = protocol.make_items([(table_id, size, 0) for table_id, size in entries])
        return Request(cls.op, [items], num_items=len(entries))

    @classmethod
    def decode_request(cls, header: Header, payload) -> np.ndarray:
        """The items (count: the slice size the worker expects)."""
        return _float32_items(_request_items(header, payload, 0, "PULL_DENSE"), "PULL_DENSE")

    @classmethod
    def encode_reply(cls, items: np.ndarray, values: Sequence) -> Reply:
        """items: the request's; values: a float32 slice each, handed over uncopied."""
        return Reply([items.copy(), *values], len(values))

    @classmethod
    def decode_reply(cls, header: Header, payload, requested: Sequence) -> list:
        """requested: [(table_id, slice size)] as sent -> a float32 slice each.

        Raises:
            ProtocolError: the reply does not answer exactly the items requested.
        """
        reply_items = _reply_items(header, payload, len(requested), "PULL_DENSE")
        out = []
        for position, ((table_id, size), item) in enumerate(zip(requested, reply_items.tolist())):
            if item[0] != int(table_id) or item[1] != size:
                raise errors.ProtocolError(
                    f"PULL_DENSE reply: item {item} answers a pull of {size} values of key "
                    f"{int(table_id):#x}"
                )
            out.append(
                protocol.frame_array(
                    payload[1 + position], np.float32, size, what="PULL_DENSE values"
                )
            )
        return out


class PushDenseRequest(NamedTuple):
    """PUSH_DENSE: the items frame as received and [(table_id, float32 gradient)]."""

    items: np.ndarray
    entries: list


class PushDense(_Codec):
    """PUSH_DENSE: gradients of one server's slices of one or more dense keys."""

    op = Op.PUSH_DENSE

    @classmethod
    def encode_request(cls, entries: Sequence) -> Request:
        """entries: [(table_id, float32 gradient slice)]."""
        return _array_per_item_request(cls.op, entries)

    @classmethod
    def decode_request(cls, header: Header, payload) -> PushDenseRequest:
        """The items and [(table_id, gradient)] (views of the frames)."""
        items, grads = _array_per_item(header, payload, np.float32, cls.op.name, "PUSH_DENSE")
        _float32_items(items, cls.op.name)
        return PushDenseRequest(items, list(zip(items["table_id"].tolist(), grads)))


class Barrier(_Codec):
    """BARRIER (server 0): answered once every worker sent one. No payload either way."""

    op = Op.BARRIER


class Goodbye(_Codec):
    """GOODBYE: a worker closed its store (`kvsparse.server.liveness.Liveness.goodbye`).

    No payload either way. Its rank's later absence is a normal end: the
    server does not warn about it (it still fails what waits for the rank).
    """

    op = Op.GOODBYE


class GetOptimizerStates(_Codec):
    """GET_OPTIMIZER_STATES: every table's optimizer slots and steps on one server."""

    op = Op.GET_OPTIMIZER_STATES

    @classmethod
    def encode_reply(cls, states: Mapping) -> Reply:
        """states: {table_id: state} (`ShardState.optimizer_state`), sent as a tree."""
        meta, arrays = protocol.encode_tree(
            [[table_id, state] for table_id, state in states.items()]
        )
        return Reply([meta, *arrays])

    @classmethod
    def decode_reply(cls, header: Header, payload) -> dict:
        """{table_id: state}, arrays viewing the frames."""
        tree = protocol.decode_tree(payload, what="optimizer states")
        return dict(_table_states(tree, "optimizer states"))


class LoadOptimizerStates(_Codec):
    """LOAD_OPTIMIZER_STATES: restore tables' optimizer slots and steps on one server."""

    op = Op.LOAD_OPTIMIZER_STATES

    @classmethod
    def encode_request(cls, states: Sequence) -> Request:
        """states: [(table_id, state)], sent as a tree."""
        meta, arrays = protocol.encode_tree([[int(table_id), state] for table_id, state in states])
        return Request(cls.op, [meta, *arrays])

    @classmethod
    def decode_request(cls, header: Header, payload) -> list:
        """[(table_id, state)] (the shapes are checked against the tables by the server)."""
        tree = protocol.decode_tree(payload, what="LOAD_OPTIMIZER_STATES")
        return _table_states(tree, "LOAD_OPTIMIZER_STATES")


class Stats(_Codec):
    """STATS: a server's statistics; with FLAG_MONITOR from a monitor, answered without HELLO."""

    op = Op.STATS

    @classmethod
    def encode_request(cls, *, monitor: bool = False) -> Request:
        """The request; monitor: from `kvsparse stats`, not a worker (not counted as traffic)."""
        return Request(cls.op, [], flags=FLAG_MONITOR if monitor else 0)

    @classmethod
    def decode_request(cls, header: Header, payload) -> bool:
        """True if it comes from a monitor."""
        _no_payload(payload, cls.op.name)
        return bool(header.flags & FLAG_MONITOR)

    @classmethod
    def encode_reply(cls, stats: dict) -> Reply:
        """The reply: the statistics as JSON."""
        return Reply([protocol.encode_json(stats)])

    @classmethod
    def decode_reply(cls, header: Header, payload) -> dict:
        """The statistics."""
        return _json_object(payload, "STATS reply")


class Evict(_Codec):
    """EVICT: TTL eviction now; the reply counts the rows evicted per table name."""

    op = Op.EVICT

    @classmethod
    def encode_reply(cls, evicted: dict) -> Reply:
        """The reply: {table name: rows evicted}."""
        return Reply([protocol.encode_json(evicted)])

    @classmethod
    def decode_reply(cls, header: Header, payload) -> dict:
        """{table name: rows evicted}."""
        return _json_object(payload, "EVICT reply")


class Checkpoint(_Codec):
    """CHECKPOINT: a JSON body whose ``action`` (`kvsparse.shard.checkpoint.CheckpointAction`)
    says what to do (save, load, export...); the reply is the action's JSON result."""

    op = Op.CHECKPOINT

    @classmethod
    def encode_request(cls, body: dict) -> Request:
        """The request carrying body ({"action": ..., "path": ..., ...})."""
        return Request(cls.op, [protocol.encode_json(body)])

    @classmethod
    def decode_request(cls, header: Header, payload) -> dict:
        """The body (its action and fields are checked by the shard's checkpoint code)."""
        return _json_object(payload, "CHECKPOINT")

    @classmethod
    def encode_reply(cls, result) -> Reply:
        """The reply: the action's JSON result."""
        return Reply([protocol.encode_json(result)])

    @classmethod
    def decode_reply(cls, header: Header, payload):
        """The action's result."""
        if len(payload) != 1:
            raise errors.ProtocolError(
                f"CHECKPOINT reply takes 1 payload frame, got {len(payload)}"
            )
        return protocol.decode_json(payload[0], what="CHECKPOINT reply")


class LookupRequest(NamedTuple):
    """A decoded LOOKUP request (immutable)."""

    table: str
    default: str  # 'zeros' or 'initializer': what an id the replica does not hold gets
    shape: tuple  # the ids' shape; the reply's rows are shape + (dim,)
    keys: np.ndarray  # int64, flat, prod(shape) of them (a view of the frame)


LOOKUP_DEFAULTS = ("zeros", "initializer")


class Lookup(_Codec):
    """LOOKUP: rows of ids from a serving replica (`kvsparse serve`).

    Request: JSON {"table", "default", "shape"} and the ids, int64, flat.
    Reply: JSON {"dim", "version"} (the checkpoint the rows come from) and
    the rows, float32, prod(shape) x dim. Answered without HELLO.
    """

    op = Op.LOOKUP

    @classmethod
    def encode_request(cls, table: str, keys: np.ndarray, shape, default: str) -> Request:
        """The request for keys (int64, flat) of ids of the given shape."""
        meta = {"table": str(table), "default": default, "shape": [int(d) for d in shape]}
        return Request(cls.op, [protocol.encode_json(meta), np.ascontiguousarray(keys, np.int64)])

    @classmethod
    def decode_request(cls, header: Header, payload) -> LookupRequest:
        """The request's table, default, shape and keys, every field checked."""
        if len(payload) != 2:
            raise errors.ProtocolError(f"LOOKUP takes 2 payload frames, got {len(payload)}")
        meta = protocol.decode_json(payload[0], what="LOOKUP")
        if not isinstance(meta, dict):
            raise errors.ProtocolError("LOOKUP: the JSON frame must be an object")
        table, default, shape = meta.get("table"), meta.get("default"), meta.get("shape")
        if not isinstance(table, str) or not table:
            raise errors.ProtocolError("LOOKUP: table must be a non-empty str")
        if default not in LOOKUP_DEFAULTS:
            raise errors.ProtocolError(f"LOOKUP: default must be one of {LOOKUP_DEFAULTS}")
        if not isinstance(shape, list) or len(shape) > 32:
            raise errors.ProtocolError("LOOKUP: shape must be a list of at most 32 sizes")
        shape = tuple(check_int(d, "LOOKUP shape size", 0, 1 << 40) for d in shape)
        count = int(np.prod(shape, dtype=object)) if shape else 1
        keys = protocol.frame_array(payload[1], np.int64, count, what="LOOKUP keys")
        return LookupRequest(table, default, shape, keys)

    @classmethod
    def encode_reply(cls, rows: np.ndarray, version) -> Reply:
        """The reply: rows (n x dim float32) and the version they come from."""
        meta = {"dim": int(rows.shape[1]), "version": version}
        return Reply([protocol.encode_json(meta), np.ascontiguousarray(rows, np.float32)])

    @classmethod
    def decode_reply(cls, header: Header, payload, count: int) -> tuple:
        """(rows count x dim float32, version) of a reply to a request of count ids."""
        if len(payload) != 2:
            raise errors.ProtocolError(f"LOOKUP reply takes 2 payload frames, got {len(payload)}")
        meta = _json_object(payload[:1], "LOOKUP reply")
        dim = check_int(meta.get("dim"), "LOOKUP reply dim", 1, protocol.MAX_DIM)
        rows = protocol.frame_array(payload[1], np.float32, count * dim, what="LOOKUP rows")
        return rows.reshape(count, dim), meta.get("version")


class ServingStatus(_Codec):
    """SERVING_STATUS: a serving replica's tables, version and freshness (no HELLO)."""

    op = Op.SERVING_STATUS

    @classmethod
    def encode_request(cls) -> Request:
        """The request (no payload)."""
        return Request(cls.op, [])

    @classmethod
    def decode_request(cls, header: Header, payload) -> None:
        """Checks that there is no payload."""
        _no_payload(payload, cls.op.name)

    @classmethod
    def encode_reply(cls, status: dict) -> Reply:
        """The reply: the status as JSON."""
        return Reply([protocol.encode_json(status)])

    @classmethod
    def decode_reply(cls, header: Header, payload) -> dict:
        """The status."""
        return _json_object(payload, "SERVING_STATUS reply")


CODECS = {
    codec.op: codec
    for codec in (
        Ping,
        Hello,
        InitSparse,
        InitDense,
        SetOptimizer,
        PullSparse,
        PrefetchSparse,
        PushSparse,
        PullDense,
        PushDense,
        AssignSparse,
        Barrier,
        Goodbye,
        GetOptimizerStates,
        LoadOptimizerStates,
        Stats,
        Evict,
        Checkpoint,
        Lookup,
        ServingStatus,
    )
}
"""Every op's codec class, by op."""


__all__ = [
    "CODECS",
    "MODES",
    "AssignSparse",
    "AssignSparseRequest",
    "Barrier",
    "Checkpoint",
    "Evict",
    "GetOptimizerStates",
    "Goodbye",
    "Hello",
    "HelloReply",
    "HelloRequest",
    "InitDense",
    "InitDenseRequest",
    "InitSparse",
    "InitSparseRequest",
    "LOOKUP_DEFAULTS",
    "LoadOptimizerStates",
    "Lookup",
    "LookupRequest",
    "Mode",
    "Ping",
    "PullDense",
    "PrefetchSparse",
    "PullSparse",
    "PullSparseRequest",
    "PushDense",
    "PushDenseRequest",
    "PushSparse",
    "PushSparseRequest",
    "Reply",
    "Request",
    "ServingStatus",
    "SetOptimizer",
    "SetOptimizerRequest",
    "SparsePush",
    "Stats",
    "check_int",
]
