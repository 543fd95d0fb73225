"""Issue 32: a push that never returned. A barrier excuses the workers waiting at it.

The hang: ``kvsparse launch -s 2 -n 2`` with a training loop that runs for a
fixed time pushed one time more on one worker than on the other (in about a
third of the runs, by the offset of their start times). Under BSP that last
push waits for the other worker's push of the same round, and the other
worker waits in ``kv.barrier()`` for the first: each waited for the other,
the servers idle, until WaitTimeout ten timeouts later. Made deterministic
here: rank 1 pushes once more than rank 0 on purpose.

Now a rank waiting at a barrier is excused from the BSP rounds and the SSP
clocks until the barrier completes (`kvsparse.server.coordination`, "Barrier
as join"): the extra push is applied alone (as if the others pushed zeros),
every call returns, and the rows are exact.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import last_json, run_workers

from kvsparse.server.coordination import BspRounds, Coordination, PushKind, Round, SspGate

# Each rank pushes PUSHES + rank times: ones on the shared ids, and on its own ids; then
# a barrier, then every worker checks every row against the pushes counted.
UNEVEN = r"""
import json, sys
import numpy as np
import kvsparse
from kvsparse.initializers import Zeros
from kvsparse.optimizers import SGD

mode, pushes = sys.argv[1], int(sys.argv[2])
kwargs = {"staleness": 0} if mode == "ssp" else {}
kind = "dist_async" if mode == "asp" else "dist_sparse"
kv = kvsparse.create(kind, timeout=1, **kwargs)  # unfixed: WaitTimeout after 10 s
kv.init("t", kvsparse.SparseTable(dim=4, initializer=Zeros(), optimizer=SGD(learning_rate=0.5)))
kv.init("u", kvsparse.SparseTable(dim=2, initializer=Zeros(), optimizer=SGD(learning_rate=1.0)))
shared = np.arange(50, dtype=np.int64)
own = 1000 + 100 * kv.rank + np.arange(50, dtype=np.int64)
ids = np.concatenate([shared, own])
mine = pushes + kv.rank
grads = [(ids, np.ones((100, 4), np.float32)), (ids, np.ones((100, 2), np.float32))]
for step in range(mine):
    kv.push(["t", "u"], grads)
    kv.row_sparse_pull("t", row_ids=shared)  # held by the SSP gate when too far ahead
kv.barrier()
total = sum(pushes + r for r in range(kv.num_workers))
t_rows = kv.row_sparse_pull("t", row_ids=shared)
u_rows = kv.row_sparse_pull("u", row_ids=shared)
others = [1000 + 100 * r + np.arange(50) for r in range(kv.num_workers)]
own_rows = [kv.row_sparse_pull("t", row_ids=o) for o in others]
kv.barrier()
print(json.dumps({
    "shared_t": bool(np.all(t_rows == -0.5 * total)),
    "shared_u": bool(np.all(u_rows == -1.0 * total)),
    "own": [bool(np.all(rows == -0.5 * (pushes + r))) for r, rows in enumerate(own_rows)],
}))
kv.close()
"""


@pytest.mark.parametrize("mode", ["bsp", "ssp", "asp"])
def test_a_worker_with_one_push_more_than_the_others_does_not_hang_at_the_barrier(
    server_factory, tmp_path, mode
):
    servers = server_factory(2)
    outputs = run_workers(UNEVEN, servers, 2, tmp_path, timeout=60, args=(mode, 5))
    for out in outputs:
        assert last_json(out) == {"shared_t": True, "shared_u": True, "own": [True, True]}, out


def test_three_workers_two_of_them_short(server_factory, tmp_path):
    # Ranks 0 and 1 reach the barrier with fewer pushes than rank 2 (4, 5, 6): each of rank
    # 2's last pushes waits for ranks at the barrier only, and is applied as it arrives.
    servers = server_factory(1)
    outputs = run_workers(UNEVEN, servers, 3, tmp_path, timeout=60, args=("bsp", 4))
    for out in outputs:
        assert json.loads(out.splitlines()[-1])["own"] == [True, True, True], out


# -- the coordination objects ---------------------------------------------------------------


class _Held:
    def __init__(self):
        self.answered = None

    def finish(self, frames):
        self.answered = "finish"

    def fail(self, exc):
        self.answered = exc


class _State:
    """A ShardState stand-in that records what BspRounds applies."""

    def __init__(self):
        self.applied = []

    def push_sparse_tables(self, pushes):
        self.applied.append([(table_id, keys.tolist()) for table_id, keys, _, _ in pushes])


def test_round_completes_without_the_excused_ranks_only_when_it_has_a_contribution():
    r = Round()
    assert r.complete(3, excused={0, 1}) == []  # empty: nothing to apply
    assert r.add(2, "c", num_workers=3, excused={0}) == []  # rank 1 still awaited
    assert r.complete(3, excused={0, 1}) == [["c"]]
    assert not r


def test_bsp_rounds_apply_a_push_waiting_only_for_ranks_at_the_barrier():
    state = _State()
    rounds = BspRounds(state)
    push = _Held()
    parts = [(7, np.array([1, 2]), np.ones((2, 2), np.float32), True)]
    parts += [(8, np.array([3]), np.ones((1, 2), np.float32), True)]
    assert rounds.contribute(push, 1, 5, PushKind.SPARSE, parts, num_workers=2)
    assert push.answered is None and rounds.waiting() == 1
    rounds.excuse({0}, num_workers=2)
    assert push.answered == "finish" and rounds.waiting() == 0
    # Both tables of the push in one application: all or nothing.
    assert state.applied == [[(7, [1, 2]), (8, [3])]]
    # While rank 0 waits at the barrier, a new push of rank 1 is applied at once.
    later = _Held()
    rounds.contribute(later, 1, 6, PushKind.SPARSE, parts[:1], num_workers=2)
    assert later.answered == "finish"
    rounds.excuse(set(), num_workers=2)  # the barrier completed: rounds wait for all again
    last = _Held()
    rounds.contribute(last, 1, 7, PushKind.SPARSE, parts[:1], num_workers=2)
    assert last.answered is None


def test_ssp_gate_does_not_wait_for_the_clock_of_a_rank_at_the_barrier():
    gate = SspGate()
    gate.start(2, staleness=1)
    gate.advance(1, 5)
    pull = _Held()
    assert gate.blocked(5)
    gate.hold(5, pull)
    gate.excuse({0})
    assert gate.release() == [pull]
    assert not gate.blocked(6) and gate.blocked(7)  # rank 1's own clock still counts
    gate.excuse(set())
    assert gate.blocked(6)


def test_coordination_barrier_excuses_only_until_it_completes():
    coordination = Coordination(_State())
    coordination.job.adopt(
        dict(num_workers=2, mode="bsp", staleness=None, num_servers=1, server_index=0)
    )
    coordination.ssp.start(2, None)
    push = _Held()
    parts = [(7, np.array([1]), np.ones((1, 2), np.float32), True)]
    coordination.bsp.contribute(push, 1, 3, PushKind.SPARSE, parts, num_workers=2)
    first, second = _Held(), _Held()
    coordination.arrive_at_barrier(0, first, num_workers=2)
    assert push.answered == "finish" and first.answered is None
    coordination.arrive_at_barrier(1, second, num_workers=2)
    assert first.answered == second.answered == "finish"
    held = _Held()
    coordination.bsp.contribute(held, 1, 4, PushKind.SPARSE, parts, num_workers=2)
    assert held.answered is None  # no barrier now: the round waits for rank 0


# -- a wait past its deadline says what the server waited for --------------------------------

NEVER_PUSHES = r"""
import json, time
import numpy as np
import kvsparse

kv = kvsparse.create("dist_sparse", timeout=0.5)
kv.init("t", kvsparse.SparseTable(dim=2))
if kv.rank == 0:
    time.sleep(6)  # connected, alive, and never pushing: rank 1's push can only time out
    print(json.dumps("slept"))
else:
    try:
        kv.push("t", (np.array([1, 2]), np.ones((2, 2), np.float32)))
        print(json.dumps("returned"))
    except kvsparse.errors.WaitTimeout as exc:
        print(json.dumps(str(exc)))
"""


def test_a_wait_timeout_names_the_request_and_what_the_server_said_it_waits_for(
    server_factory, tmp_path
):
    servers = server_factory(1)
    outputs = run_workers(NEVER_PUSHES, servers, 2, tmp_path, timeout=60)
    message = last_json(outputs[1])
    assert message.startswith("PUSH_SPARSE request "), message
    assert servers[0] in message
    assert "the server said: a BSP round of sparse table" in message, message
    assert "waits for the pushes of ranks [0] (it has ranks [1])" in message, message


def test_coordination_describes_each_held_request_of_a_client():
    class _Header:
        def __init__(self, client_id):
            self.client_id = client_id

    coordination = Coordination(_State())
    coordination.job.adopt(
        dict(num_workers=3, mode="bsp", staleness=None, num_servers=1, server_index=0)
    )
    coordination.ssp.start(3, None)
    push, barrier = _Held(), _Held()
    push.header, barrier.header = _Header(11), _Header(22)
    parts = [(7, np.array([1]), np.ones((1, 2), np.float32), True)]
    coordination.bsp.contribute(push, 1, 3, PushKind.SPARSE, parts, num_workers=3)
    coordination.arrive_at_barrier(2, barrier, num_workers=3)
    assert coordination.describe(11) == (
        "a BSP round of sparse table 7 waits for the pushes of ranks [0] (it has ranks [1])"
    )
    assert coordination.describe(22) == "a barrier waits for ranks [0, 1]"
    assert coordination.describe(33) == ""
    follower, declaring = _Held(), _Held()
    follower.header = declaring.header = _Header(44)
    assert not coordination.optimizer.follow(follower, 1, {"kind": "sgd"})
    coordination.dense_init.wait(5, declaring, "bias", 8)
    assert coordination.describe(44) == (
        "set_optimizer call 1 waits for rank 0's call 1; "
        "the init of dense key 'bias' waits for rank 0's values"
    )


def test_the_liveness_probe_is_a_well_formed_ping_reply():
    # Found by the stress harness: PING replies grew a frame, the probe's header still said
    # one, and a colocated worker that read the probe failed its push with ProtocolError.
    from kvsparse.server.liveness import Liveness
    from kvsparse.wire import protocol

    sent, later = [], []
    liveness = Liveness(
        Coordination(_State()),
        lambda routing, frames: sent.append(frames) or True,
        lambda seconds, callback: later.append(callback),
        incarnation=5,
    )
    liveness.joined(client_id=9, rank=0, routing=b"r")
    liveness.disconnected()
    for callback in later:
        callback()
    assert sent, "no probe sent"
    header, payload = protocol.parse_message(sent[0], reply=True)
    assert header.client_id == 9 and len(payload) == header.num_frames
