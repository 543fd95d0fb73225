"""One handler per op: each decodes its request's payload, acts on the shard, encodes the reply.

A handler takes ``(header, payload, pending)`` and returns the reply (a
`kvsparse.wire.ops.Reply`, or a list of payload frames), or `DEFERRED` when
the reply comes later (a coordination object or the checkpoint writer holds
``pending`` and answers it). Any exception becomes an error reply
(`kvsparse.server.dispatch`). Each op's layout is decoded and encoded through
its codec in `kvsparse.wire.ops`, the one the client uses too; what is left
here are the checks that need the shard's state.

Ops (`kvsparse.wire.protocol.Op`) and their coordination
(`kvsparse.server.coordination`):

- HELLO: the job's configuration (the first client's; later ones must agree).
- INIT_SPARSE, INIT_DENSE: create a table (a FLAG_DECLARE INIT_DENSE waits for rank 0's).
- SET_OPTIMIZER: rank 0 sets it (store-wide, or some tables' own), or only its learning
  rate (slots kept); the others' calls wait for rank 0's and must agree.
- ASSIGN_SPARSE: rows written verbatim, at once (no optimizer, no BSP round).
- PULL_SPARSE, PULL_DENSE: rows / the dense slice (held by the SSP gate when too far ahead).
- PUSH_SPARSE, PUSH_DENSE: applied now (ASP, SSP) or once the BSP round is full.
- PREFETCH_SPARSE: ids a pull will name soon; their rows on disk come into memory now,
  never held (not by the SSP gate either: it changes no row, and its point is to start
  the disk reads before the pull arrives).
- BARRIER: answered when every worker sent one; meanwhile the BSP rounds and SSP pulls
  do not wait for the ranks at the barrier (`Coordination.arrive_at_barrier`).
- GET/LOAD_OPTIMIZER_STATES, STATS, EVICT, CHECKPOINT (`kvsparse.shard.checkpoint`).
- PING and a monitor's STATS belong to no client session (`answer_outside_session`).
"""

from __future__ import annotations

import os

import numpy as np

from kvsparse import errors
from kvsparse.server import restart
from kvsparse.server.coordination import PushKind, apply_tables
from kvsparse.server.dispatch import DEFERRED
from kvsparse.server.limits import RequestLimits
from kvsparse.server.metrics import table_names
from kvsparse.wire import ops, protocol
from kvsparse.wire.ops import check_int
from kvsparse.wire.protocol import FLAG_MONITOR, Op


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
        limits: its `kvsparse.server.limits.RequestLimits` (default: the default limits,
            unread replies not counted).
        checkpoint_paths: its `kvsparse.server.paths.CheckpointPaths` (default: any path).
        segments: its `kvsparse.server.shared.SharedSegments` (workers' shared memory on
            this host); None: shared memory offered in a HELLO is declined.

    Threads: not thread-safe; the server's event loop thread only.
    """

    def __init__(
        self,
        state,
        coordination,
        writer,
        resend,
        metrics,
        *,
        address,
        incarnation,
        limits=None,
        checkpoint_paths=None,
        segments=None,
        max_message_size=-1,
    ):
        self._state = state
        self._coordination = coordination
        self._job = coordination.job
        self._writer = writer
        self._resend = resend
        self._metrics = metrics
        self._address = address
        self._incarnation = incarnation
        self._limits = limits if limits is not None else RequestLimits()
        self._checkpoint_paths = checkpoint_paths
        self._segments = segments
        self._max_message_size = int(max_message_size)  # told to workers in HELLO replies
        self._table = {
            Op.HELLO: self._hello,
            Op.INIT_SPARSE: self._init_sparse,
            Op.INIT_DENSE: self._init_dense,
            Op.SET_OPTIMIZER: self._set_optimizer,
            Op.PULL_SPARSE: self._pull_sparse,
            Op.PUSH_SPARSE: self._push_sparse,
            Op.PREFETCH_SPARSE: self._prefetch_sparse,
            Op.PULL_DENSE: self._pull_dense,
            Op.PUSH_DENSE: self._push_dense,
            Op.ASSIGN_SPARSE: self._assign_sparse,
            Op.BARRIER: self._barrier,
            Op.GOODBYE: self._goodbye,
            Op.GET_OPTIMIZER_STATES: self._get_optimizer_states,
            Op.LOAD_OPTIMIZER_STATES: self._load_optimizer_states,
            Op.STATS: self._stats,
            Op.EVICT: self._evict,
            Op.CHECKPOINT: self._checkpoint_request,
        }

    def run(self, header: protocol.Header, payload: list, pending):
        """Runs the op's handler (after HELLO, for a rank in range); raises what it raises."""
        handler = self._table.get(header.op)
        if handler is None:  # LOOKUP, SERVING_STATUS: a serving replica's
            raise errors.ProtocolError(
                f"op {Op(header.op).name} is answered by a serving replica (kvsparse serve), "
                "not by a training server"
            )
        if header.op != Op.HELLO:
            self._check_configured(header)
        return handler(header, payload, pending)

    def answer_outside_session(self, header: protocol.Header) -> list | None:
        """The reply frames of a request outside any client session, else None.

        PING: the last request id this client's record holds, and what its held
        requests wait for (`Coordination.describe`). STATS with
        FLAG_MONITOR: a monitor is no worker: no HELLO, no client record.
        """
        if header.op == Op.PING:
            last = self._resend.last_request_id(header.client_id)
            held = self._coordination.describe(header.client_id)
            return ops.Ping.encode_reply(last, held).frames
        if header.op == Op.STATS and header.flags & FLAG_MONITOR:
            return self._stats_reply().frames
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
        hello = ops.Hello.decode_request(header, payload)
        if self._job.adopt(hello.settings()):
            self._coordination.ssp.start(hello.num_workers, hello.staleness)
        self._check_configured(header)
        shared, why = None, ""
        if hello.shared is not None:
            if self._segments is None:
                shared, why = False, "this server takes no shared memory"
            else:
                shared, why = self._segments.attach(header.client_id, hello.shared)
        return ops.Hello.encode_reply(
            self._address, self._incarnation, shared, why, self._max_message_size
        )

    def _segment(self, header):
        """The client's shared segment, for a FLAG_SHARED request.

        Raises:
            SharedMemoryMissing: the server holds none of the client's (it restarted
                since the client's HELLO; the client greets it again).
        """
        segment = None if self._segments is None else self._segments.get(header.client_id)
        if segment is None:
            raise errors.SharedMemoryMissing(
                f"{Op(header.op).name} with FLAG_SHARED, but this server holds no shared "
                "segment of the client's (HELLO offers one)"
            )
        return segment

    def _init_sparse(self, header, payload, pending):
        from kvsparse.table import SparseTable

        table_id, name, spec = ops.InitSparse.decode_request(header, payload)
        try:
            spec = SparseTable.from_dict(spec).to_dict()
        except errors.KVSparseError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise errors.InvalidArgument(f"key {name!r}: bad table spec ({exc!r})") from None
        if table_id not in self._state.sparse:
            self._check_new_table(name, spec["dim"])
        return ops.InitSparse.encode_reply(self._state.create_sparse(table_id, name, spec))

    def _check_new_table(self, name: str, dim: int | None = None) -> None:
        existing = len(self._state.sparse) + len(self._state.dense)
        self._limits.check_new_table(existing, name, dim)

    def _init_dense(self, header, payload, pending):
        table_id, name, size, values, dtype = ops.InitDense.decode_request(header, payload)
        waiters = self._coordination.dense_init
        if values is not None:
            if table_id not in self._state.dense:
                self._check_new_table(name)
            self._state.create_dense(table_id, name, values, dtype)
            waiters.release(table_id, self._state.dense[table_id].values.size)
            return ops.InitDense.encode_reply()
        entry = self._state.dense.get(table_id)
        if entry is not None:
            waiters.check_size(name, entry.values.size, size)
            return ops.InitDense.encode_reply()
        if table_id in self._state.sparse:
            raise errors.DuplicateKey(f"key {name!r} is already initialized as a sparse table")
        waiters.wait(table_id, pending, name, size)
        return DEFERRED

    def _set_optimizer(self, header, payload, pending):
        request = ops.SetOptimizer.decode_request(header, payload)
        spec, epoch, replay, table_ids, learning_rate = request
        epochs = self._coordination.optimizer
        # What followers must agree on: the spec, and the tables it is for.
        agreed = spec if table_ids is None else {"spec": spec, "table_ids": table_ids}
        if learning_rate is not None:
            agreed = {"learning_rate": learning_rate, "table_ids": table_ids}
        if header.rank == 0:
            restored = table_ids is None and self._state.default_optimizer == spec
            restored = restored and learning_rate is None
            if replay and (epochs.recorded(epoch) or restored):
                # Sent again to a restarted server: what it restored stays (its slots).
                epochs.lead(agreed, epoch, replay=True)
                return ops.SetOptimizer.encode_reply()
            try:
                if learning_rate is not None:
                    # A learning-rate change keeps every slot; sent again, it changes nothing.
                    self._state.set_learning_rate(learning_rate, table_ids)
                elif table_ids is None:
                    self._state.set_optimizer(spec)
                else:
                    self._state.set_table_optimizers(table_ids, spec)
            except errors.KVSparseError:
                raise
            except (KeyError, TypeError, ValueError) as exc:
                raise errors.InvalidArgument(f"bad optimizer spec ({exc!r})") from None
            epochs.lead(agreed, epoch)
            return ops.SetOptimizer.encode_reply()
        if epochs.follow(pending, epoch, agreed):
            return ops.SetOptimizer.encode_reply()
        return DEFERRED

    # -- table operations ---------------------------------------------------------------------

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
        items, keys, offsets = ops.PullSparse.decode_request(header, payload)
        segment = None if offsets is None else self._segment(header)
        if self._held_by_ssp(header, pending):
            return DEFERRED
        described = items.tolist()  # [(table_id, count, dim, flags)]: Python ints, read once
        count_table = self._metrics.count_table
        for table_id, count, _, _ in described:
            count_table("pull_sparse", table_id, count)
        entries = [self._state.sparse_entry(t) for t, _, _, _ in described]  # all exist first
        targets = None
        if segment is None:
            # The reply's size is known before any row is made, in the dtype each item's rows
            # travel in (2 bytes an element with a 16-bit wire_dtype).
            self._limits.check_pull(
                pending.routing,
                [
                    (k.size, e.table.dim * protocol.item_element_bytes(flags))
                    for e, k, (_, _, _, flags) in zip(entries, keys, described)
                ],
            )
        else:
            # The rows go into the client's memory, not through ZeroMQ: only the id count.
            self._limits.check_rows(sum(k.size for k in keys), "a pull")
            dims = [e.table.dim for e in entries]
            targets = ops.PullSparse.shared_targets(items, offsets, dims, segment)
        # Fresh arrays: safe to hand to ZeroMQ uncopied.
        rows = [self._state.pull_sparse(t, k) for (t, _, _, _), k in zip(described, keys)]
        return ops.PullSparse.encode_reply(items, rows, targets)

    def _prefetch_sparse(self, header, payload, pending):
        items, keys = ops.PrefetchSparse.decode_request(header, payload)
        described = items.tolist()
        self._limits.check_rows(sum(k.size for k in keys), "a prefetch")
        for table_id, _, _, _ in described:
            self._state.sparse_entry(table_id)  # every table exists before any row moves
        read = [
            self._state.prefetch_sparse(table_id, k)
            for (table_id, _, _, _), k in zip(described, keys)
        ]
        return ops.PrefetchSparse.encode_reply(read)

    def _push_sparse(self, header, payload, pending):
        segment = self._segment(header) if header.flags & protocol.FLAG_SHARED else None
        items, entries, _ = ops.PushSparse.decode_request(header, payload, segment)
        self._limits.check_rows(sum(entry.keys.size for entry in entries), "a push")
        for entry in entries:
            self._state.check_sparse_push(entry.table_id, entry.keys, entry.rows)
        self._count_items("push_sparse", items)
        return self._push(header, pending, PushKind.SPARSE, entries)

    def _pull_dense(self, header, payload, pending):
        items = ops.PullDense.decode_request(header, payload)
        if self._held_by_ssp(header, pending):
            return DEFERRED
        self._count_items("pull_dense", items, dense=True)
        reply_bytes = 0
        for table_id, count, _, _ in items.tolist():
            entry = self._state.dense_entry(table_id)
            entry.check_size(count, f"the pull asks for {count}")
            reply_bytes += entry.values.size * 4  # float32 on the wire, whatever it stores
        self._limits.check_reply(pending.routing, reply_bytes, "a pull of dense keys")
        # Copied: ZeroMQ sends asynchronously and a later push changes the live slice.
        values = [
            self._state.pull_dense(table_id).copy() for table_id in items["table_id"].tolist()
        ]
        return ops.PullDense.encode_reply(items, values)

    def _push_dense(self, header, payload, pending):
        items, entries = ops.PushDense.decode_request(header, payload)
        for table_id, grad in entries:
            self._state.check_dense_push(table_id, grad)
        self._count_items("push_dense", items, dense=True)
        return self._push(header, pending, PushKind.DENSE, entries)

    def _assign_sparse(self, header, payload, pending):
        items, entries = ops.AssignSparse.decode_request(header, payload)
        for table_id, keys, rows in entries:
            self._state.check_sparse_assign(table_id, keys, rows)
        self._count_items("assign_sparse", items)
        for table_id, keys, rows in entries:
            self._state.assign_sparse(table_id, keys, rows)
        return ops.AssignSparse.encode_reply()

    def _push(self, header, pending, kind: PushKind, parsed: list):
        """Applies validated pushes now, or (BSP) hands them to their rounds."""
        if self._job.mode == ops.Mode.BSP:
            held = self._coordination.bsp.contribute(
                pending, header.rank, header.clock, kind, parsed, self._job.num_workers
            )
            return DEFERRED if held else []
        # All the request's tables or none.
        apply_tables(self._state, kind, [(table_id, [part]) for table_id, *part in parsed])
        return []

    def _barrier(self, header, payload, pending):
        ops.Barrier.decode_request(header, payload)
        self._coordination.arrive_at_barrier(header.rank, pending, self._job.num_workers)
        return DEFERRED

    def _goodbye(self, header, payload, pending):
        # What it means for the rank is the liveness tracker's (`Dispatcher.run` tells it).
        ops.Goodbye.decode_request(header, payload)
        return ops.Goodbye.encode_reply()

    # -- optimizer state, eviction and stats ------------------------------------------------------

    def _get_optimizer_states(self, header, payload, pending):
        ops.GetOptimizerStates.decode_request(header, payload)
        # Bounded like a pull: checked before the arrays are built.
        self._limits.check_reply(
            pending.routing,
            self._state.optimizer_state_bytes(),
            "the optimizer states of this shard",
            hint="save them on the servers instead (kv.save(path) keeps every slot)",
        )
        return ops.GetOptimizerStates.encode_reply(self._state.optimizer_state())

    def _load_optimizer_states(self, header, payload, pending):
        states = ops.LoadOptimizerStates.decode_request(header, payload)
        for table_id, state in states:
            self._check_state(table_id, state)
        for table_id, state in states:
            self._state.load_optimizer_state(table_id, state)
        return ops.LoadOptimizerStates.encode_reply()

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
            check_int(state.get("table_step", 0), "table_step", 0)
            return
        dense = self._state.dense_entry(table_id)
        slots = state.get("slots")
        if not isinstance(slots, np.ndarray):
            raise errors.ProtocolError("dense optimizer state needs slots")
        if dense.slots is None or slots.shape != dense.slots.shape:
            raise errors.ShapeError(f"key {dense.name!r}: saved slots do not match the optimizer")
        check_int(state.get("step"), "step", 0)

    def _evict(self, header, payload, pending):
        ops.Evict.decode_request(header, payload)
        return ops.Evict.encode_reply(self._state.evict())

    def _stats(self, header, payload, pending):
        ops.Stats.decode_request(header, payload)
        return self._stats_reply()

    def _stats_reply(self) -> ops.Reply:
        stats = {
            **self._state.stats(),
            "address": self._address,
            "waiting": self._coordination.waiting(),
            "incarnation": self._incarnation,
            # Per rank (kvsparse.store.colocated: where a restarted worker resumes).
            "clocks": self._coordination.ssp.clocks(),
            "pushes": self._resend.pushes,
            "duplicate_pushes": self._resend.duplicate_pushes,
            "clients": len(self._resend),
        }
        stats["table_ops"] = self._metrics.per_table(table_names(self._state))
        return ops.Stats.encode_reply(stats)

    # -- checkpoints (kvsparse.shard.checkpoint) -------------------------------------------

    def _checkpoint_request(self, header, payload, pending):
        """CHECKPOINT; a file system error (a path under a file, no permission, a full disk)
        is the request's problem: CheckpointError, not a ServerError with a traceback."""
        try:
            return self._checkpoint(header, payload, pending)
        except OSError as exc:
            raise errors.CheckpointError(f"checkpoint: {exc}") from None

    def _checkpoint(self, header, payload, pending):
        from kvsparse.shard import checkpoint

        body = ops.Checkpoint.decode_request(header, payload)
        if self._checkpoint_paths is not None:  # confined to the root
            body["path"] = self._checkpoint_paths.resolve(body.get("path"))
        shard_index, num_shards = self._job.server_index, self._job.num_servers
        action = body.get("action")
        save, export = checkpoint.CheckpointAction.SAVE, checkpoint.CheckpointAction.EXPORT
        if action not in (save, export):
            # prepare / commit / describe are small; a load replaces the tables, so it runs
            # inline: no request can see a half-loaded shard.
            reply = checkpoint.handle(self._state, body, shard_index, num_shards)
            return ops.Checkpoint.encode_reply(reply)
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
            # Rows on disk enter a full save by reference: their files are linked now, before
            # the fork (a merge here may remove one the moment after); the writer finishes.
            disk = {}
            if since is None:
                disk = checkpoint.link_disk_rows(state, path, seq, shard_index, num_shards)
            # Taken at the moment of the tables' snapshot.
            server = restart.snapshot(self._resend, self._coordination)
            job = lambda: checkpoint.save_shard(  # noqa: E731
                state, path, seq, shard_index, num_shards, since, parent, server, disk
            )
            done = lambda: checkpoint.end_save(state, path, seq, epoch)  # noqa: E731

        def on_done(reply, error):
            if error is not None:
                pending.fail(error)
                return
            if done is not None:
                done()
            pending.finish(ops.Checkpoint.encode_reply(reply))

        def cleanup(pid):
            # A writer that died leaves its temporary file: removed (it never got a
            # manifest), and the rows on disk it linked unless its shard file is there.
            checkpoint.remove_temporary_files(path, pid)
            if action == save:
                name = checkpoint.shard_file_name(seq, shard_index, num_shards)
                if not os.path.exists(os.path.join(path, name)):
                    checkpoint.remove_disk_dir(path, seq, shard_index, num_shards)

        self._writer.start(job, on_done, cleanup)
        return DEFERRED
