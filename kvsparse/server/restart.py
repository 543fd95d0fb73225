"""What a server keeps in its checkpoint besides the tables, to go on after a restart.

A server restored from a checkpoint (``kvsparse server --restore``) holds
the tables as they were at the save. So that it also answers its clients as
the server it replaces would have, each shard file of a server's save
carries a ``server`` section, taken at the same moment as the tables:

- ``resend``: the resend records of answered requests that changed the shard
  (`kvsparse.server.resend.ResendCache.answered`): a push applied before the
  save whose reply was lost is answered from its record when the client
  resends it, not applied a second time. A push after the save is not in
  the checkpoint, and its resend is applied once.
- ``optimizer_calls``: rank 0's SET_OPTIMIZER calls (`OptimizerEpochs`): rank
  0's replay of one keeps the restored slots, and another rank's call of one
  is answered at once (checked) instead of waiting for a call that comes
  only when rank 0 notices the restart.
- ``job``: the job's configuration (`JobConfig`), so that a client whose
  resend is answered from a record can go on without greeting again.
- ``clocks``: each rank's clock at the save (`SspGate.clocks`): a colocated
  worker restarted with its shard (``launch --colocated --restart-workers``)
  does not redo a push that the checkpoint already holds.

Example:
    >>> section = snapshot(resend, coordination)          # doctest: +SKIP
    >>> restore(section, other_resend, other_coordination)  # doctest: +SKIP

Threads: the server's event loop thread only (it reads and writes the
objects given).
"""

from __future__ import annotations

import base64

import numpy as np

from kvsparse import errors
from kvsparse.wire.protocol import MUTATING_OPS, Op, unpack_header

# Replies worth keeping: those of the requests that change a shard (`MUTATING_OPS`, the
# resend cache's), but for a HELLO (sent again anyway), a BARRIER or an EVICT (nothing to
# redo wrongly), and a CHECKPOINT (its reply, a manifest, can be large). A reply over
# _MAX_REPLY_BYTES is left out (the client's resend then runs again).
_KEPT_OPS = MUTATING_OPS - {Op.HELLO, Op.BARRIER, Op.EVICT, Op.CHECKPOINT}
_MAX_REPLY_BYTES = 64 * 1024


def _frame_bytes(frame) -> bytes:
    if hasattr(frame, "bytes"):  # a zmq.Frame
        return frame.bytes
    if isinstance(frame, np.ndarray):
        return frame.tobytes()
    return bytes(frame)


def snapshot(resend, coordination) -> dict:
    """The ``server`` section of this moment's shard file (JSON-able).

    resend: the server's `ResendCache`; coordination: its `Coordination`.
    """
    records = []
    for client_id, request_id, last_push, reply in resend.answered():
        frames = [_frame_bytes(frame) for frame in reply]
        try:
            op = unpack_header(frames[0], reply=True).op if frames else None
        except errors.ProtocolError:
            continue
        if op not in _KEPT_OPS:
            continue
        if sum(len(f) for f in frames) > _MAX_REPLY_BYTES:
            continue
        encoded = [base64.b64encode(f).decode("ascii") for f in frames]
        records.append([str(client_id), int(request_id), int(last_push), encoded])
    return {
        "clocks": coordination.ssp.clocks(),
        "job": coordination.job.saved(),
        "optimizer_calls": coordination.optimizer.saved(),
        "resend": records,
    }


def restore(section: dict | None, resend, coordination) -> None:
    """Takes a restored shard file's ``server`` section (None: nothing to take)."""
    if not section:
        return
    job = section.get("job")
    if coordination.job.restore(job):
        coordination.ssp.start(job["num_workers"], job["staleness"])
        for rank, clock in enumerate(section.get("clocks") or []):
            if rank < job["num_workers"]:
                coordination.ssp.advance(rank, int(clock))
    coordination.optimizer.restore(section.get("optimizer_calls") or [])
    resend.restore(
        (int(client_id), request_id, last_push, [base64.b64decode(f) for f in frames])
        for client_id, request_id, last_push, frames in section.get("resend") or []
    )


__all__ = ["restore", "snapshot"]
