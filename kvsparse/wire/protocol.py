"""The kvsparse wire protocol: one small header frame plus raw payload frames.

Every message between a worker (ZeroMQ DEALER) and a server (ROUTER) is a
multipart message: a fixed 56-byte header, then ``num_frames`` payload frames.
Keys and values travel as raw little-endian arrays, one frame each, sent with
``copy=False`` and read back with ``np.frombuffer`` over the received frame,
so neither side copies them (ps-lite's layout).

Header (little-endian, `HEADER`):

    ======  ====  ============  =============================================
    offset  size  field         meaning
    ======  ====  ============  =============================================
    0       4     magic         b"KVSP"
    4       2     version       `VERSION` (1); any other value is refused
    6       2     op            an `Op` value
    8       4     flags         `FLAG_*` bits; unknown bits are refused
    12      4     status        requests: 0; replies: 0 ok, else an error code
    16      8     request_id    u64, chosen by the client, increasing
    24      8     client_id     u64, random per client (resend detection)
    32      4     rank          i32, the worker's rank
    36      4     num_items     u32, tables in a fused request (<= MAX_ITEMS)
    40      8     clock         i64, the worker's push count (bounded staleness)
    48      4     num_frames    u32, payload frames after the header
    52      4     incarnation   requests: 0; replies: the server's incarnation
                                (u32, random and nonzero per server start)
    ======  ====  ============  =============================================

A client that sees a server's incarnation change knows that the server
restarted (and lost what it had not checkpointed): it says HELLO again and
resends what was in flight (`kvsparse.client.session`).

Item descriptors (the "items" frame of table operations, `ITEM_DTYPE`, 24
bytes each, ``num_items`` of them): ``table_id`` u64, ``count`` i64 (keys of a
sparse item, values of a dense item), ``dim`` i32 (row width of a sparse
item; 0 where not known), ``flags`` u32: bit 0 `ITEM_FLAG_STEP` on a push
whose table got keys on some server (a shard that got none of them still
counts the push as a step of the table, as the local store does, so Adam's
per-table step agrees); bits 8-15 the *row dtype code* of the item's rows
frames (`WIRE_DTYPE_CODES`: 0 float32, 1 float16, 2 bfloat16, others
refused; PULL_SPARSE and PUSH_SPARSE only, 0 in every other op); every
other bit 0.

Row dtype: a PULL_SPARSE item's code asks for its rows in that
dtype and the reply's item echoes it; a PUSH_SPARSE item's code says what
its rows frame holds. A 16-bit rows frame holds count x dim little-endian
IEEE float16 or bfloat16 values (2 bytes each), rounded to nearest, ties to
even, from the float32 rows by the sender; the receiver widens them exactly.
Tables stay float32 on the servers. Messages with code 0 are byte for byte
those of before, so the version stays 1; a server that predates the codes
refuses a 16-bit item ("unknown item flags") with an error reply.

Payload per op (request -> reply; every reply starts with the header). Each
op's layout is encoded and decoded in one place, `kvsparse.wire.ops`, which
both ends call:

    =====================  ======================================  =====================
    op (value)             request payload                         reply payload
    =====================  ======================================  =====================
    PING (1)               none                                    u64: the last request
                                                                   id of this client the
                                                                   server holds
    HELLO (2)              JSON {num_workers, mode, staleness,     JSON {address,
                           rank, num_servers, server_index}        version, incarnation}
    INIT_SPARSE (3)        JSON {table_id, name, spec}             JSON {created}
    INIT_DENSE (4)         JSON {table_id, name, size}, values     none
                           (f32; none with FLAG_DECLARE)
    SET_OPTIMIZER (5)      JSON {spec, epoch[, table_ids]}: with   none
                           table_ids, those tables' own optimizer
                           (spec null: back to the store-wide one);
                           with learning_rate (spec null), only
                           the optimizers' rate (slots kept)
    PULL_SPARSE (6)        items, keys (i64) per item              items (dim set), rows
                                                                   (count x dim, of the
                                                                   item's row dtype)
    PUSH_SPARSE (7)        items, keys (i64) + rows (count x dim,  none
                           of the item's row dtype) per item
    PULL_DENSE (8)         items (count = slice size)              items, values (f32)
    PUSH_DENSE (9)         items, gradient (f32) per item          none
    BARRIER (10)           none                                    none
    GET_OPTIMIZER_STATES   none                                    tree (see below)
    (11)
    LOAD_OPTIMIZER_STATES  tree                                    none
    (12)
    STATS (13)             none (FLAG_MONITOR from a monitor)      JSON: ShardState.stats
                                                                   + address, waiting
    ASSIGN_SPARSE (14)     items, keys (i64) + rows (count x dim,  none
                           f32) per item: written verbatim (no
                           optimizer, no admission counting)
    GOODBYE (15)           none: the worker closed its store       none
    PREFETCH_SPARSE (16)   items, keys (i64) per item: the rows    i64: rows brought in
                           on disk come into memory now (a later   from disk per item
                           pull finds them there); changes no row
    EVICT (20)             none                                    JSON {table name: rows
                                                                   evicted} (TTL, now)
    CHECKPOINT (30)        JSON {action, path, ...} (the actions   JSON: the action's
                           of kvsparse.shard.checkpoint)           result
    LOOKUP (40)            JSON {table, default, shape}, keys      JSON {dim, version},
                           (i64, prod(shape) of them): a serving   rows (count x dim, f32)
                           replica (`kvsparse serve`), no HELLO
    SERVING_STATUS (41)    none: a serving replica, no HELLO       JSON: its tables,
                                                                   version, freshness
    =====================  ======================================  =====================

Shared memory (the same-host fast path): a worker on a server's host
may offer a segment of its memory in HELLO (``"shared": {pid, fd, bytes,
token}``: a memfd sealed against shrinking that the server opens as
``/proc/<pid>/fd/<fd>``, `bytes` long, its first 16 bytes the hex `token`).
The reply says ``"shared": true`` if the server mapped it, else ``false``
and ``"shared_error"``. A PULL_SPARSE or PUSH_SPARSE with `FLAG_SHARED`
then carries one more frame at the end, ``num_items`` u64 byte offsets
into the segment: where each item's rows go (a pull: the server writes
them there and each rows frame of the reply is empty; each item's dim is
the row width the worker made room for, and a table of another width is a
ShapeError) or are (a push: each item's rows frame is empty). Offsets are
multiples of the row element size and the rows lie within the segment;
anything else is a ProtocolError, as is `FLAG_SHARED` from a client whose
segment the server did not map. The rows are read or written in place,
before the reply: a worker reuses a region only after its reply came.

A *tree* is a JSON frame in which every array is replaced by
``{"__array__": i, "dtype": "float32"|"int64", "shape": [...]}`` followed by
the arrays' raw frames in order (`encode_tree` / `decode_tree`).

An error reply has a nonzero ``status`` and one UTF-8 frame with the
message; the client re-raises it as the matching `kvsparse.errors` class
(`raise_remote_error`). Codes (`ERROR_CODES`): 1 ProtocolError, 2
InvalidArgument, 3 ShapeError, 4 DTypeError, 5 KeyTypeError, 6 UnknownKey, 7
DuplicateKey, 8 NonFiniteGradient, 9 CapacityError (and a server's MemoryError), 10
ServerError (anything else), 11 CheckpointError, 12 LimitExceeded, 13 WorkerLeft, 14
UpdateOverflow, 15 SharedMemoryMissing, 16 CorruptRecord, 17 DiskFull, 18
StorageError (the disk tier's; a client that predates a code raises
ServerError with the message). The reply to a message whose header cannot be read echoes its
request id when the size and magic are right, else 0, with op 0 if the op is
unknown.

Resends: the server remembers each client's last request id. The same id
again is answered from the cached reply (state-changing ops) or run again
(read-only ops), never applied twice; an older id gets a ProtocolError.

Every field and every frame length is checked (`parse_message`,
`parse_items`, `frame_array`) before a payload is used: a malformed message
raises `kvsparse.errors.ProtocolError`, which the server turns into an error
reply.

Every function here is pure and every constant immutable: safe to use from
any thread.

Example:
    >>> header = Header(op=Op.PING, request_id=7, client_id=1)
    >>> parse_message([header.pack()])[0].request_id
    7
"""

from __future__ import annotations

import enum
import json
import struct
from typing import NamedTuple

import numpy as np

from kvsparse import errors

MAGIC = b"KVSP"
VERSION = 1
HEADER = struct.Struct("<4sHHIIQQiIqII")
HEADER_SIZE = HEADER.size  # 56
_INCARNATION = struct.Struct("<I")  # the header's last field
_INCARNATION_OFFSET = HEADER_SIZE - _INCARNATION.size

MAX_ITEMS = 65536
MAX_FRAMES = 2 * MAX_ITEMS + 2
MAX_DIM = 4096
MAX_JSON_BYTES = 64 << 20

FLAG_DECLARE = 1  # INIT_DENSE from a worker other than rank 0: no values, wait for rank 0's
# STATS from a monitor (`kvsparse stats`), not a worker: answered without HELLO, uncounted.
FLAG_MONITOR = 2
# PULL_SPARSE / PUSH_SPARSE whose rows are in the sender's shared-memory segment (the
# same-host fast path; module docstring, "Shared memory").
FLAG_SHARED = 4
KNOWN_FLAGS = FLAG_DECLARE | FLAG_MONITOR | FLAG_SHARED
ITEM_FLAG_STEP = 1  # PUSH_SPARSE item: the push counts as a table step even with no keys here
# Bits 8-15 of an item's flags: the dtype code of its rows frames (module docstring).
ITEM_DTYPE_SHIFT = 8
ITEM_DTYPE_MASK = 0xFF << ITEM_DTYPE_SHIFT
WIRE_DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
WIRE_DTYPE_NAMES = {code: name for name, code in WIRE_DTYPE_CODES.items()}
# The NumPy dtype of a rows frame of each wire dtype (16-bit values as their bit patterns).
WIRE_FRAME_DTYPES = {"float32": np.float32, "float16": np.uint16, "bfloat16": np.uint16}
KNOWN_ITEM_FLAGS = ITEM_FLAG_STEP | ITEM_DTYPE_MASK
_ELEMENT_BYTES = {  # row dtype code -> bytes of one element of its rows frames
    WIRE_DTYPE_CODES[name]: np.dtype(dtype).itemsize for name, dtype in WIRE_FRAME_DTYPES.items()
}

ITEM_DTYPE = np.dtype([("table_id", "<u8"), ("count", "<i8"), ("dim", "<i4"), ("flags", "<u4")])


class Op(enum.IntEnum):
    """The operations (the table in the module docstring; layouts in `kvsparse.wire.ops`)."""

    PING = 1
    HELLO = 2
    INIT_SPARSE = 3
    INIT_DENSE = 4
    SET_OPTIMIZER = 5
    PULL_SPARSE = 6
    PUSH_SPARSE = 7
    PULL_DENSE = 8
    PUSH_DENSE = 9
    BARRIER = 10
    GET_OPTIMIZER_STATES = 11
    LOAD_OPTIMIZER_STATES = 12
    STATS = 13
    # Rows written verbatim, no optimizer (MXNet's init of a key at any time).
    ASSIGN_SPARSE = 14
    # A worker closed its store: a normal end, not a departure to warn about.
    GOODBYE = 15
    # The next batch's ids sent ahead: a tiered shard reads their disk rows now.
    PREFETCH_SPARSE = 16
    # Admission and eviction; 20 leaves room for other new ops.
    EVICT = 20
    # Checkpoints, loads and inference export: a JSON body with an "action".
    CHECKPOINT = 30
    # A serving replica's lookups and status (`kvsparse serve`): answered
    # without HELLO by the serving process; a training server refuses them.
    LOOKUP = 40
    SERVING_STATUS = 41


OP_VALUES = frozenset(int(op) for op in Op)

# Ops that change a shard: a resent copy of one is answered from the reply
# cache instead of being applied again.
MUTATING_OPS = frozenset(
    {
        Op.HELLO,
        Op.INIT_SPARSE,
        Op.INIT_DENSE,
        Op.SET_OPTIMIZER,
        Op.PUSH_SPARSE,
        Op.PUSH_DENSE,
        Op.ASSIGN_SPARSE,
        Op.BARRIER,
        Op.LOAD_OPTIMIZER_STATES,
        Op.EVICT,
        Op.CHECKPOINT,
    }
)

# Error codes on the wire; the order of the checks in `error_code` puts
# subclasses before their bases.
ERROR_CODES = {
    errors.SharedMemoryMissing: 15,
    errors.CorruptRecord: 16,
    errors.DiskFull: 17,
    errors.StorageError: 18,
    errors.ProtocolError: 1,
    errors.NonFiniteGradient: 8,
    errors.UpdateOverflow: 14,
    errors.ShapeError: 3,
    errors.CheckpointError: 11,
    errors.LimitExceeded: 12,
    errors.InvalidArgument: 2,
    errors.DTypeError: 4,
    errors.KeyTypeError: 5,
    errors.UnknownKey: 6,
    errors.DuplicateKey: 7,
    errors.CapacityError: 9,
    errors.ServerError: 10,
    errors.WorkerLeft: 13,
}
ERROR_CLASSES = {code: cls for cls, code in ERROR_CODES.items()}


class Header(NamedTuple):
    """The fields of a header frame (see the module docstring).

    Immutable: safe to share between threads.
    """

    op: int
    flags: int = 0
    status: int = 0
    request_id: int = 0
    client_id: int = 0
    rank: int = 0
    num_items: int = 0
    clock: int = 0
    num_frames: int = 0
    incarnation: int = 0  # replies only: the server's, see the module docstring

    def pack(self) -> bytes:
        """The 56-byte header frame."""
        return HEADER.pack(
            MAGIC,
            VERSION,
            self.op,
            self.flags,
            self.status,
            self.request_id,
            self.client_id,
            self.rank,
            self.num_items,
            self.clock,
            self.num_frames,
            self.incarnation,
        )

    def reply(self, status: int = 0, num_frames: int = 0, num_items: int = 0) -> Header:
        """The header of the reply to this request (the server stamps its incarnation)."""
        return self._replace(status=status, num_frames=num_frames, num_items=num_items, flags=0)


def _buffer(frame) -> memoryview:
    """A memoryview of a zmq.Frame, bytes or any buffer, without copying."""
    buffer = getattr(frame, "buffer", None)
    return buffer if buffer is not None else memoryview(frame)


def unpack_header(frame, *, reply: bool = False) -> Header:
    """Parses and checks a header frame.

    Args:
        frame: a zmq.Frame, bytes or buffer.
        reply: True for a reply (a nonzero status allowed).

    Raises:
        ProtocolError: wrong size, magic, version, op, flags, status or counts.
    """
    view = _buffer(frame)
    if view.nbytes != HEADER_SIZE:
        raise errors.ProtocolError(f"header frame must be {HEADER_SIZE} bytes, got {view.nbytes}")
    (
        magic,
        version,
        op,
        flags,
        status,
        request_id,
        client_id,
        rank,
        num_items,
        clock,
        num_frames,
        incarnation,
    ) = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise errors.ProtocolError(f"bad magic {magic!r}; expected {MAGIC!r}")
    if version != VERSION:
        raise errors.ProtocolError(
            f"protocol version {version} is not supported (this side speaks {VERSION})"
        )
    if op not in OP_VALUES and not (reply and op == 0):
        # op 0 only in the reply to a request too broken to name its op.
        raise errors.ProtocolError(f"unknown op {op}")
    if flags & ~KNOWN_FLAGS:
        raise errors.ProtocolError(f"unknown flags {flags:#x}")
    if flags & FLAG_SHARED and op not in (Op.PULL_SPARSE, Op.PUSH_SPARSE):
        raise errors.ProtocolError("FLAG_SHARED is for PULL_SPARSE and PUSH_SPARSE only")
    if status and not reply:
        raise errors.ProtocolError(f"a request must have status 0, got {status}")
    if incarnation and not reply:
        raise errors.ProtocolError(
            f"the incarnation header field is reserved in requests and must be 0, got {incarnation}"
        )
    if num_items > MAX_ITEMS:
        raise errors.ProtocolError(f"num_items {num_items} exceeds the limit {MAX_ITEMS}")
    if num_frames > MAX_FRAMES:
        raise errors.ProtocolError(f"num_frames {num_frames} exceeds the limit {MAX_FRAMES}")
    if rank < 0:
        raise errors.ProtocolError(f"rank must be >= 0, got {rank}")
    if clock < 0:
        raise errors.ProtocolError(f"clock must be >= 0, got {clock}")
    return Header(
        op, flags, status, request_id, client_id, rank, num_items, clock, num_frames, incarnation
    )


def pack_reply(
    request: Header, num_frames: int, num_items: int, incarnation: int, status: int = 0
) -> bytes:
    """The packed header of the reply to request, stamped with the server's incarnation.

    The same bytes as ``stamp_incarnation(request.reply(...).pack(), incarnation)``, in
    one pack (a successful reply's header, on every request's path).
    """
    return HEADER.pack(
        MAGIC,
        VERSION,
        request.op,
        0,
        status,
        request.request_id,
        request.client_id,
        request.rank,
        num_items,
        request.clock,
        num_frames,
        incarnation,
    )


def stamp_incarnation(header_frame, incarnation: int) -> bytes:
    """A packed reply header with its incarnation field set to the server's.

    The server stamps every reply it sends (fresh, cached for a resend, or
    an error) as it leaves, so no reply can miss it.
    """
    head = bytes(_buffer(header_frame))
    return head[:_INCARNATION_OFFSET] + _INCARNATION.pack(incarnation)


def peek_header(frame) -> Header | None:
    """The request id and op of a header that failed `unpack_header`, for the error reply.

    Returns None when not even the size and the magic are right.
    """
    view = _buffer(frame)
    if view.nbytes != HEADER_SIZE or bytes(view[:4]) != MAGIC:
        return None
    fields = HEADER.unpack_from(view)
    op = fields[2] if fields[2] in OP_VALUES else 0
    return Header(op=op, request_id=fields[5], client_id=fields[6], rank=max(fields[7], 0))


def parse_message(frames, *, reply: bool = False):
    """(Header, payload frames) of a received multipart message.

    Raises:
        ProtocolError: an empty message, a bad header, or a frame count that
            differs from the header's num_frames.
    """
    if not frames:
        raise errors.ProtocolError("empty message")
    header = unpack_header(frames[0], reply=reply)
    payload = frames[1:]
    if len(payload) != header.num_frames:
        raise errors.ProtocolError(
            f"header announces {header.num_frames} payload frames, the message has {len(payload)}"
        )
    return header, payload


def frame_nbytes(frame) -> int:
    """The size in bytes of a zmq.Frame, bytes or buffer."""
    return _buffer(frame).nbytes


def frame_text(frame) -> str:
    """A frame's bytes as UTF-8 text (undecodable bytes replaced: text only informs)."""
    return bytes(_buffer(frame)).decode("utf-8", "replace")


def frame_array(frame, dtype, count: int, *, what: str) -> np.ndarray:
    """A 1-D array of `count` elements viewing a frame (copied only if misaligned).

    Raises:
        ProtocolError: the frame does not hold exactly count elements.
    """
    dtype = np.dtype(dtype)
    view = _buffer(frame)
    expected = count * dtype.itemsize
    if count < 0 or view.nbytes != expected:
        raise errors.ProtocolError(
            f"{what}: frame has {view.nbytes} bytes, expected {expected} ({count} x {dtype.name})"
        )
    array = np.frombuffer(view, dtype=dtype, count=count)
    if not array.flags.aligned:
        # ZeroMQ stores messages under 34 bytes inside the message struct; copy those.
        array = array.copy()
    return array


def parse_items(frame, num_items: int) -> np.ndarray:
    """The item descriptors of a table operation, checked for sane counts and dims.

    Raises:
        ProtocolError: wrong frame size, a negative count or an out-of-range dim.
    """
    items = frame_array(frame, ITEM_DTYPE, num_items, what="items frame")
    # Checked on Python ints: a request carries a few items, and each NumPy reduction over
    # a field of the structured array cost more than the whole loop (the five of them took
    # ~80 us a request).
    for _, count, dim, flags in items.tolist():
        if count < 0:
            raise errors.ProtocolError("items frame: negative count")
        if not 0 <= dim <= MAX_DIM:
            raise errors.ProtocolError(f"items frame: dim outside [0, {MAX_DIM}]")
        if flags & ~KNOWN_ITEM_FLAGS:
            raise errors.ProtocolError("items frame: unknown item flags")
        if flags >> ITEM_DTYPE_SHIFT not in WIRE_DTYPE_NAMES:
            raise errors.ProtocolError(
                f"items frame: unknown row dtype code {flags >> ITEM_DTYPE_SHIFT} "
                f"(known: {WIRE_DTYPE_NAMES})"
            )
    return items


def item_dtype_flags(wire_dtype: str) -> int:
    """The item flags bits that say an item's rows travel as wire_dtype ('float32': 0)."""
    return WIRE_DTYPE_CODES[wire_dtype] << ITEM_DTYPE_SHIFT


def item_element_bytes(flags: int) -> int:
    """The bytes of one row element of an item with these (checked) flags: 4, or 2 (16-bit)."""
    return _ELEMENT_BYTES[flags >> ITEM_DTYPE_SHIFT]


def item_wire_dtypes(items: np.ndarray) -> list:
    """The wire dtype name of each item of a parsed items array (`parse_items` checked them)."""
    return [WIRE_DTYPE_NAMES[flags >> ITEM_DTYPE_SHIFT] for _, _, _, flags in items.tolist()]


def make_items(rows) -> np.ndarray:
    """An items array from (table_id, count, dim) or (table_id, count, dim, flags) tuples."""
    items = np.zeros(len(rows), ITEM_DTYPE)
    for index, row in enumerate(rows):
        items[index] = tuple(row) if len(row) == 4 else (*row, 0)
    return items


# -- JSON and trees ------------------------------------------------------------------------


def encode_json(obj) -> bytes:
    """A compact UTF-8 JSON frame."""
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_json(frame, *, what: str):
    """A JSON payload frame.

    Raises:
        ProtocolError: not UTF-8 JSON, or too large.
    """
    view = _buffer(frame)
    if view.nbytes > MAX_JSON_BYTES:
        raise errors.ProtocolError(f"{what}: JSON frame of {view.nbytes} bytes is too large")
    try:
        return json.loads(bytes(view).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise errors.ProtocolError(f"{what}: not valid JSON ({exc})") from None


_TREE_DTYPES = {"float32": np.float32, "int64": np.int64}


def encode_tree(obj):
    """(JSON bytes, array frames) of a structure of dicts, lists, scalars and arrays."""
    arrays = []

    def walk(node):
        if isinstance(node, np.ndarray):
            if node.dtype.name not in _TREE_DTYPES:
                node = node.astype(np.float32 if node.dtype.kind == "f" else np.int64)
            arrays.append(np.ascontiguousarray(node))
            return {
                "__array__": len(arrays) - 1,
                "dtype": node.dtype.name,
                "shape": list(node.shape),
            }
        if isinstance(node, dict):
            return {str(k): walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [walk(v) for v in node]
        if isinstance(node, np.generic):
            return node.item()
        return node

    return encode_json(walk(obj)), arrays


def decode_tree(frames, *, what: str):
    """Inverse of `encode_tree`: frames[0] is the JSON, the rest the arrays.

    Raises:
        ProtocolError: a bad reference, dtype, shape or frame length.
    """
    if not frames:
        raise errors.ProtocolError(f"{what}: missing JSON frame")
    meta = decode_json(frames[0], what=what)
    arrays = frames[1:]
    used = set()

    def walk(node):
        if isinstance(node, dict):
            if "__array__" in node:
                index, dtype, shape = node.get("__array__"), node.get("dtype"), node.get("shape")
                if (
                    not isinstance(index, int)
                    or not 0 <= index < len(arrays)
                    or index in used
                    or dtype not in _TREE_DTYPES
                    or not isinstance(shape, list)
                    or not all(isinstance(d, int) and d >= 0 for d in shape)
                ):
                    raise errors.ProtocolError(f"{what}: bad array reference {node!r}")
                used.add(index)
                count = int(np.prod(shape, dtype=object)) if shape else 1
                return frame_array(
                    arrays[index], _TREE_DTYPES[dtype], count, what=f"{what} array {index}"
                ).reshape(shape)
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    tree = walk(meta)
    if len(used) != len(arrays):
        raise errors.ProtocolError(f"{what}: {len(arrays) - len(used)} unreferenced array frames")
    return tree


# -- errors ---------------------------------------------------------------------------------


def error_code(exc: BaseException) -> int:
    """The wire code of an exception (ServerError's for anything unexpected).

    A builtin MemoryError (a server out of memory) is CapacityError's: the
    worker gets a MemoryError, as docs/api.md says.
    """
    for cls, code in ERROR_CODES.items():
        if isinstance(exc, cls):
            return code
    if isinstance(exc, MemoryError):
        return ERROR_CODES[errors.CapacityError]
    return ERROR_CODES[errors.ServerError]


def error_reply(request: Header | None, exc: BaseException) -> list:
    """The frames of an error reply to request (None: a request too broken to name)."""
    request = request if request is not None else Header(op=0)
    message = str(exc) if isinstance(exc, errors.KVSparseError) else f"{type(exc).__name__}: {exc}"
    header = request.reply(status=error_code(exc), num_frames=1)
    return [header.pack(), message.encode("utf-8", "replace")]


def raise_remote_error(header: Header, payload, address: str):
    """Raises the kvsparse.errors class of an error reply, naming the server."""
    cls = ERROR_CLASSES.get(header.status, errors.ServerError)
    try:
        message = bytes(_buffer(payload[0])).decode("utf-8", "replace") if payload else ""
    except TypeError:
        message = ""
    raise cls(f"{message} (server {address})")


__all__ = [
    "ERROR_CODES",
    "FLAG_DECLARE",
    "FLAG_MONITOR",
    "HEADER_SIZE",
    "ITEM_DTYPE",
    "ITEM_DTYPE_MASK",
    "ITEM_FLAG_STEP",
    "MAGIC",
    "MUTATING_OPS",
    "VERSION",
    "WIRE_DTYPE_CODES",
    "WIRE_FRAME_DTYPES",
    "Header",
    "Op",
    "decode_json",
    "decode_tree",
    "encode_json",
    "encode_tree",
    "error_reply",
    "frame_array",
    "item_dtype_flags",
    "item_element_bytes",
    "item_wire_dtypes",
    "make_items",
    "parse_items",
    "pack_reply",
    "parse_message",
    "raise_remote_error",
    "stamp_incarnation",
    "unpack_header",
]
