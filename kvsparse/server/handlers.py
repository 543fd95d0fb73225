"""One handler per op: each decodes its request's payload, acts on the shard, encodes the reply.

A handler takes ``(header, payload, pending)`` and returns the reply's payload
frames, ``(frames, num_items)``, or `DEFERRED` when the reply comes later (a
coordination object or the checkpoint writer holds ``pending`` and answers
it). Any exception becomes an error reply (`kvsparse.server.dispatch`). The
per-op decoding is written here, together, and nowhere else in the server.

Ops (`kvsparse.wire.protocol.Op`) and their coordination
(`kvsparse.server.coordination`):

- HELLO: the job's configuration (the first client's; later ones must agree).
- INIT_SPARSE, INIT_DENSE: create a table (a FLAG_DECLARE INIT_DENSE waits for rank 0's).
- SET_OPTIMIZER: rank 0 sets it; the others' calls wait for rank 0's and must agree.
- PULL_SPARSE, PULL_DENSE: rows / the dense slice (held by the SSP gate when too far ahead).
- PUSH_SPARSE, PUSH_DENSE: applied now (ASP, SSP) or once the BSP round is full.
- BARRIER: answered when every worker sent one.
- GET/LOAD_OPTIMIZER_STATES, STATS, EVICT, CHECKPOINT (`kvsparse.shard.checkpoint`).
- PING and a monitor's STATS belong to no client session (`answer_outside_session`).
"""

from __future__ import annotations

import struct

import numpy as np

from kvsparse import errors
from kvsparse.server.coordination import JobConfig, PushKind, apply_pushes
from kvsparse.server.dispatch import DEFERRED
from kvsparse.server.metrics import table_names
from kvsparse.wire import protocol
from kvsparse.wire.protocol import FLAG_DECLARE, FLAG_MONITOR, Op

MODES = ("bsp", "asp", "ssp")
_U64 = struct.Struct("<Q")


def _check_int(value, what, low, high=None):
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise errors.ProtocolError(f"{what} must be an integer {bound}, got {value!r}")
    return value


def _json_payload(payload, what, *, frames=1):
    if len(payload) != frames:
        raise errors.ProtocolError(f"{what} takes {frames} payload frame(s), got {len(payload)}")
    body = protocol.decode_json(payload[0], what=what)
    if not isinstance(body, dict):
        raise errors.ProtocolError(f"{what}: the JSON payload must be an object")
    return body


class Handlers:
    """The op handlers of one server, and the dispatch table from Op to handler.

    Args:
        state: the server's ShardState.
        coordination: its `kvsparse.server.coordination.Coordination`.
        writer: its `kvsparse.server.snapshots.ForkedWriter` (checkpoint saves, exports).
        resend: its `ResendCache` (read for PING and STATS).
        metrics: its `ServerMetrics`.
        address: the bound address (HELLO and STATS replies).
        incarnation: the server's incarnation (HELLO and STATS replies).

    Threads: not thread-safe; the server's event loop thread only.
    """

    def __init__(self, state, coordination, writer, resend, metrics, *, address, incarnation):
        self._state = state
        self._coordination = coordination
        self._job = coordination.job
        self._writer = writer
        self._resend = resend
        self._metrics = metrics
        self._address = address
        self._incarnation = incarnation
        self._table = {
            Op.HELLO: self._hello,
            Op.INIT_SPARSE: self._init_sparse,
            Op.INIT_DENSE: self._init_dense,
            Op.SET_OPTIMIZER: self._set_optimizer,
            Op.PULL_SPARSE: self._pull_sparse,
            Op.PUSH_SPARSE: self._push_sparse,
            Op.PULL_DENSE: self._pull_dense,
            Op.PUSH_DENSE: self._push_dense,
            Op.BARRIER: self._barrier,
            Op.GET_OPTIMIZER_STATES: self._get_optimizer_states,
            Op.LOAD_OPTIMIZER_STATES: self._load_optimizer_states,
            Op.STATS: self._stats,
            Op.EVICT: self._evict,
            Op.CHECKPOINT: self._checkpoint,
        }

    def run(self, header: protocol.Header, payload: list, pending):
        """Runs the op's handler (after HELLO, for a rank in range); raises what it raises."""
        if header.op != Op.HELLO:
            self._check_configured(header)
        return self._table[header.op](header, payload, pending)

    def answer_outside_session(self, header: protocol.Header) -> list | None:
        """The reply frames of a request outside any client session, else None.

        PING: the last request id this client's record holds. STATS with
        FLAG_MONITOR: a monitor is no worker: no HELLO, no client record.
        """
        if header.op == Op.PING:
            return [_U64.pack(self._resend.last_request_id(header.client_id))]
        if header.op == Op.STATS and header.flags & FLAG_MONITOR:
            return self._stats(header, [], None)
        return None

    def released(self) -> list:
        """Held pulls that the last request let go (the SSP gate): to run again."""
        return self._coordination.ssp.release()

    def _check_configured(self, header: protocol.Header) -> None:
        if not self._job.configured:
            raise errors.ProtocolError(f"op {Op(header.op).name} before HELLO: send HELLO first")
        if header.rank >= self._job.num_workers:
            raise errors.ProtocolError(
                f"rank {header.rank} out of range for {self._job.num_workers} workers"
            )
        self._coordination.ssp.advance(header.rank, header.clock)

    # -- configuration ----------------------------------------------------------------------

    def _hello(self, header, payload, pending):
        hello = _json_payload(payload, "HELLO")
        num_workers = _check_int(hello.get("num_workers"), "num_workers", 1, 1 << 20)
        mode = hello.get("mode")
        if mode not in MODES:
            raise errors.ProtocolError(f"mode must be one of {MODES}, got {mode!r}")
        staleness = hello.get("staleness")
        if mode == "ssp":
            _check_int(staleness, "staleness", 0)
        elif staleness is not None:
            raise errors.ProtocolError(f"staleness is only for mode 'ssp', got {staleness!r}")
        num_servers = _check_int(hello.get("num_servers"), "num_servers", 1, 1 << 16)
        _check_int(hello.get("server_index"), "server_index", 0, num_servers - 1)
        rank = _check_int(hello.get("rank"), "rank", 0, num_workers - 1)
        if rank != header.rank:
            raise errors.ProtocolError(f"HELLO says rank {rank}, its header {header.rank}")
        config = {name: hello.get(name) for name in JobConfig.FIELDS}
        if self._job.adopt(config):
            self._coordination.ssp.start(num_workers, staleness)
        self._check_configured(header)
        return [
            protocol.encode_json(
                {
                    "address": self._address,
                    "version": protocol.VERSION,
                    "incarnation": self._incarnation,
                }
            )
        ]

    def _init_sparse(self, header, payload, pending):
        from kvsparse.table import SparseTable

        body = _json_payload(payload, "INIT_SPARSE")
        table_id = _check_int(body.get("table_id"), "table_id", 0, (1 << 64) - 1)
        name, spec = body.get("name"), body.get("spec")
        if not isinstance(name, str) or not isinstance(spec, dict):
            raise errors.ProtocolError("INIT_SPARSE needs a str name and a dict spec")
        try:
            spec = SparseTable.from_dict(spec).to_dict()
        except errors.KVSparseError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise errors.InvalidArgument(f"key {name!r}: bad table spec ({exc!r})") from None
        created = self._state.create_sparse(table_id, name, spec)
        return [protocol.encode_json({"created": created})]

    def _init_dense(self, header, payload, pending):
        declare = bool(header.flags & FLAG_DECLARE)
        if not payload:
            raise errors.ProtocolError("INIT_DENSE needs a JSON frame")
        body = _json_payload(payload[:1], "INIT_DENSE")
        if len(payload) != (1 if declare else 2):
            raise errors.ProtocolError(
                f"INIT_DENSE {'with FLAG_DECLARE ' if declare else ''}takes "
                f"{1 if declare else 2} payload frames, got {len(payload)}"
            )
        table_id = _check_int(body.get("table_id"), "table_id", 0, (1 << 64) - 1)
        size = _check_int(body.get("size"), "size", 0, 1 << 40)
        name = body.get("name")
        if not isinstance(name, str):
            raise errors.ProtocolError("INIT_DENSE needs a str name")
        waiters = self._coordination.dense_init
        if not declare:
            values = protocol.frame_array(payload[1], np.float32, size, what="INIT_DENSE values")
            self._state.create_dense(table_id, name, values)
            waiters.release(table_id, self._state.dense[table_id].values.size)
            return []
        entry = self._state.dense.get(table_id)
        if entry is not None:
            waiters.check_size(name, entry.values.size, size)
            return []
        if table_id in self._state.sparse:
            raise errors.DuplicateKey(f"key {name!r} is already initialized as a sparse table")
        waiters.wait(table_id, pending, name, size)
        return DEFERRED

    def _set_optimizer(self, header, payload, pending):
        body = _json_payload(payload, "SET_OPTIMIZER")
        spec = body.get("spec")
        epoch = _check_int(body.get("epoch"), "epoch", 1)
        if spec is not None and not isinstance(spec, dict):
            raise errors.ProtocolError("SET_OPTIMIZER spec must be an object or null")
        epochs = self._coordination.optimizer
        if header.rank == 0:
            try:
                self._state.set_optimizer(spec)
            except errors.KVSparseError:
                raise
            except (KeyError, TypeError, ValueError) as exc:
                raise errors.InvalidArgument(f"bad optimizer spec ({exc!r})") from None
            epochs.lead(spec)
            return []
        return [] if epochs.follow(pending, epoch, spec) else DEFERRED

    # -- table operations ---------------------------------------------------------------------

    def _items(self, header, payload, frames_per_item, what):
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

    def _count_items(self, op: str, items, dense: bool = False) -> None:
        count_table = self._metrics.count_table
        for table_id, count, _, _ in items.tolist():
            count_table(op, table_id, 1 if dense else count)

    def _held_by_ssp(self, header, pending) -> bool:
        ssp = self._coordination.ssp
        if not ssp.blocked(header.clock):
            return False
        ssp.hold(header.clock, pending)
        return True

    def _pull_sparse(self, header, payload, pending):
        items = self._items(header, payload, 1, "PULL_SPARSE")
        if self._held_by_ssp(header, pending):
            return DEFERRED
        keys = [
            protocol.frame_array(payload[1 + i], np.int64, count, what=f"PULL_SPARSE keys {i}")
            for i, (_, count, _, _) in enumerate(items.tolist())
        ]
        self._count_items("pull_sparse", items)
        for table_id, _, _, _ in items.tolist():
            self._state.sparse_entry(table_id)  # every table exists before any work
        reply_items = items.copy()
        rows_frames = []
        for i, (table_id, _, _, _) in enumerate(items.tolist()):
            rows = self._state.pull_sparse(table_id, keys[i])
            reply_items["dim"][i] = rows.shape[1]
            rows_frames.append(rows)  # a fresh array: safe to hand to ZeroMQ uncopied
        return [reply_items, *rows_frames], header.num_items

    def _push_sparse(self, header, payload, pending):
        items = self._items(header, payload, 2, "PUSH_SPARSE")
        parsed = []
        for i, (table_id, count, dim, item_flags) in enumerate(items.tolist()):
            if dim < 1:
                raise errors.ProtocolError(f"PUSH_SPARSE item {i}: dim must be >= 1")
            keys = protocol.frame_array(
                payload[1 + 2 * i], np.int64, count, what=f"PUSH_SPARSE keys {i}"
            )
            rows = protocol.frame_array(
                payload[2 + 2 * i], np.float32, count * dim, what=f"PUSH_SPARSE rows {i}"
            ).reshape(count, dim)
            self._state.check_sparse_push(table_id, keys, rows)
            parsed.append((table_id, keys, rows, bool(item_flags & protocol.ITEM_FLAG_STEP)))
        self._count_items("push_sparse", items)
        return self._push(header, pending, PushKind.SPARSE, parsed)

    def _pull_dense(self, header, payload, pending):
        items = self._items(header, payload, 0, "PULL_DENSE")
        if self._held_by_ssp(header, pending):
            return DEFERRED
        self._count_items("pull_dense", items, dense=True)
        frames = []
        for table_id, count, _, _ in items.tolist():
            self._state.dense_entry(table_id).check_size(count, f"the pull asks for {count}")
        for table_id, _, _, _ in items.tolist():
            # Copied: ZeroMQ sends asynchronously and a later push changes the live slice.
            frames.append(self._state.pull_dense(table_id).copy())
        return [items.copy(), *frames], header.num_items

    def _push_dense(self, header, payload, pending):
        items = self._items(header, payload, 1, "PUSH_DENSE")
        parsed = []
        for i, (table_id, count, _, _) in enumerate(items.tolist()):
            grad = protocol.frame_array(payload[1 + i], np.float32, count, what=f"PUSH_DENSE {i}")
            self._state.check_dense_push(table_id, grad)
            parsed.append((table_id, grad))
        self._count_items("push_dense", items, dense=True)
        return self._push(header, pending, PushKind.DENSE, parsed)

    def _push(self, header, pending, kind: PushKind, parsed: list):
        """Applies validated pushes now, or (BSP) hands them to their rounds."""
        if self._job.mode == "bsp":
            held = self._coordination.bsp.contribute(
                pending, header.rank, header.clock, kind, parsed, self._job.num_workers
            )
            return DEFERRED if held else []
        for table_id, *part in parsed:
            apply_pushes(self._state, kind, table_id, [part])
        return []

    def _barrier(self, header, payload, pending):
        if payload:
            raise errors.ProtocolError("BARRIER takes no payload")
        self._coordination.barrier.arrive(header.rank, pending, self._job.num_workers)
        return DEFERRED

    # -- optimizer state, eviction and stats ------------------------------------------------------

    def _get_optimizer_states(self, header, payload, pending):
        if payload:
            raise errors.ProtocolError("GET_OPTIMIZER_STATES takes no payload")
        tree = [[table_id, state] for table_id, state in self._state.optimizer_state().items()]
        meta, arrays = protocol.encode_tree(tree)
        return [meta, *arrays]

    def _load_optimizer_states(self, header, payload, pending):
        tree = protocol.decode_tree(payload, what="LOAD_OPTIMIZER_STATES")
        if not isinstance(tree, list) or not all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[1], dict) for e in tree
        ):
            raise errors.ProtocolError("LOAD_OPTIMIZER_STATES: expected [[table_id, state], ...]")
        for table_id, state in tree:
            _check_int(table_id, "table_id", 0, (1 << 64) - 1)
            self._check_state(table_id, state)
        for table_id, state in tree:
            self._state.load_optimizer_state(table_id, state)
        return []

    def _check_state(self, table_id: int, state: dict) -> None:
        """Raises what load_optimizer_state would, before anything is loaded."""
        entry = self._state.sparse.get(table_id)
        if entry is not None:
            keys, slots, steps = state.get("keys"), state.get("slots"), state.get("steps")
            if not all(isinstance(a, np.ndarray) for a in (keys, slots, steps)):
                raise errors.ProtocolError("sparse optimizer state needs keys, slots and steps")
            n = keys.shape[0] if keys.ndim == 1 else -1
            table = entry.table
            if (
                keys.dtype != np.int64
                or steps.dtype != np.int64
                or n < 0
                or steps.shape != (n,)
                or slots.shape != (n, table.num_slots, table.dim)
            ):
                raise errors.ShapeError(
                    f"key {entry.name!r}: saved state shapes keys {keys.shape}, slots "
                    f"{slots.shape}, steps {steps.shape} do not fit {table.num_slots} slots "
                    f"of dim {table.dim}"
                )
            _check_int(state.get("table_step", 0), "table_step", 0)
            return
        dense = self._state.dense_entry(table_id)
        slots = state.get("slots")
        if not isinstance(slots, np.ndarray):
            raise errors.ProtocolError("dense optimizer state needs slots")
        if dense.slots is None or slots.shape != dense.slots.shape:
            raise errors.ShapeError(f"key {dense.name!r}: saved slots do not match the optimizer")
        _check_int(state.get("step"), "step", 0)

    def _evict(self, header, payload, pending):
        if payload:
            raise errors.ProtocolError("EVICT takes no payload")
        return [protocol.encode_json(self._state.evict())]

    def _stats(self, header, payload, pending):
        if payload:
            raise errors.ProtocolError("STATS takes no payload")
        stats = {
            **self._state.stats(),
            "address": self._address,
            "waiting": self._coordination.waiting(),
            "incarnation": self._incarnation,
            "pushes": self._resend.pushes,
            "duplicate_pushes": self._resend.duplicate_pushes,
            "clients": len(self._resend),
        }
        stats["table_ops"] = self._metrics.per_table(table_names(self._state))
        return [protocol.encode_json(stats)]

    # -- checkpoints (kvsparse.shard.checkpoint) -------------------------------------------

    def _checkpoint(self, header, payload, pending):
        from kvsparse.shard import checkpoint

        body = _json_payload(payload, "CHECKPOINT")
        shard_index, num_shards = self._job.server_index, self._job.num_servers
        action = body.get("action")
        save, export = checkpoint.CheckpointAction.SAVE, checkpoint.CheckpointAction.EXPORT
        if action not in (save, export):
            # prepare / commit / describe are small; a load replaces the tables, so it runs
            # inline: no request can see a half-loaded shard.
            reply = checkpoint.handle(self._state, body, shard_index, num_shards)
            return [protocol.encode_json(reply)]
        if self._writer.running:
            raise errors.InvalidArgument("a checkpoint save or export is already running")
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise errors.InvalidArgument("checkpoint path must be a non-empty str")
        state = self._state
        if action == export:
            done = None
            job = lambda: checkpoint.export_shard(  # noqa: E731
                state, path, shard_index, num_shards, body["table_ids"], body["export_id"]
            )
        else:
            seq, parent = int(body["seq"]), body.get("parent")
            since, epoch = checkpoint.begin_save(state, bool(body.get("incremental")), path, parent)
            job = lambda: checkpoint.save_shard(  # noqa: E731
                state, path, seq, shard_index, num_shards, since, parent
            )
            done = lambda: checkpoint.end_save(state, path, seq, epoch)  # noqa: E731

        def on_done(reply, error):
            if error is not None:
                pending.fail(error)
                return
            if done is not None:
                done()
            pending.finish([protocol.encode_json(reply)])

        # A writer that died leaves its temporary file: removed (it never got a manifest).
        cleanup = lambda pid: checkpoint.remove_temporary_files(path, pid)  # noqa: E731
        self._writer.start(job, on_done, cleanup)
        return DEFERRED
