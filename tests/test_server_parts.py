"""The server's parts in process: the resend cache and the coordination objects.

The whole server is tested over real sockets in test_dist_server.py; these
tests pin each small object's own contract, with requests that record how
they were answered.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvsparse import errors
from kvsparse.server.coordination import (
    Barrier,
    BspRounds,
    DenseInitWaiters,
    JobConfig,
    OptimizerEpochs,
    PushKind,
    Round,
    SspGate,
)
from kvsparse.server.resend import ResendCache, Verdict


class Request:
    """A held request: records its one answer."""

    def __init__(self, name=""):
        self.name = name
        self.answers = []

    def finish(self, frames):
        self.answers.append(("finish", frames))

    def fail(self, exc):
        self.answers.append(("fail", exc))

    @property
    def answered(self):
        assert len(self.answers) <= 1, self.answers
        return self.answers[0][0] if self.answers else None


class AppliedState:
    """Records what BspRounds applies (a ShardState's push methods)."""

    def __init__(self, fail=False):
        self.calls = []
        self.fail = fail

    def push_sparse(self, table_id, keys, rows):
        if self.fail:
            raise errors.ShapeError("no")
        self.calls.append(("sparse", table_id, keys.tolist(), rows.tolist()))

    def advance_sparse_step(self, table_id):
        self.calls.append(("step", table_id))

    def push_dense(self, table_id, grad):
        self.calls.append(("dense", table_id, grad.tolist()))

    # One request's (or one BSP wave's) tables, all or nothing.
    def push_sparse_tables(self, pushes):
        for table_id, keys, rows, step in pushes:
            if keys.size:
                self.push_sparse(table_id, keys, rows)
            elif step:
                self.advance_sparse_step(table_id)

    def push_dense_keys(self, pushes):
        for table_id, grad in pushes:
            self.push_dense(table_id, grad)


# -- resend cache ---------------------------------------------------------------------------


def test_resend_cache_verdicts():
    cache = ResendCache()
    assert cache.admit(1, 5, is_push=True) == (Verdict.NEW, None)
    cache.track(1, 5, "first copy")
    assert cache.admit(1, 5, is_push=True) == (Verdict.WAITING, "first copy")
    cache.complete(1, 5, ["reply"])
    assert cache.admit(1, 5, is_push=True) == (Verdict.REPLAY, ["reply"])
    assert cache.admit(1, 4, is_push=False) == (Verdict.STALE, 5)
    assert cache.last_request_id(1) == 5 and cache.last_request_id(2) == 0
    assert cache.pushes == 1 and cache.duplicate_pushes == 0


def test_resend_cache_runs_a_resent_read_again():
    cache = ResendCache()
    cache.admit(1, 7, is_push=False)
    cache.track(1, 7, "pull")
    cache.complete(1, 7, None)  # a read keeps no reply
    assert cache.admit(1, 7, is_push=False) == (Verdict.NEW, None)


def test_resend_cache_evicts_the_least_recently_seen_idle_record():
    cache = ResendCache(max_clients=3)
    for client in (1, 2, 3):
        cache.admit(client, 1, is_push=False)
    cache.track(1, 1, "waiting")  # client 1 waits: its record stays
    cache.admit(2, 2, is_push=False)  # client 2 seen again: 3 is now the oldest idle
    cache.last_request_id(3)  # a PING does not count as seeing the client
    cache.admit(4, 1, is_push=False)
    assert len(cache) == 3
    assert cache.last_request_id(3) == 0
    assert [cache.last_request_id(c) for c in (1, 2, 4)] == [1, 2, 1]


def test_resend_cache_keeps_waiting_records_past_its_bound():
    cache = ResendCache(max_clients=2)
    for client in (1, 2):
        cache.admit(client, 1, is_push=False)
        cache.track(client, 1, f"waiting {client}")
    cache.admit(3, 1, is_push=False)
    assert len(cache) == 3
    assert cache.admit(1, 1, is_push=False) == (Verdict.WAITING, "waiting 1")


# -- coordination ---------------------------------------------------------------------------


def test_round_defers_a_second_contribution_of_one_rank():
    r = Round()
    assert r.add(0, "a1", num_workers=2) == []
    assert r.add(0, "a2", num_workers=2) == []  # waits for the next round
    assert r.add(1, "b1", num_workers=2) == [["a1", "b1"]]
    assert r.values() == ["a2"] and r
    assert r.add(1, "b2", num_workers=2) == [["a2", "b2"]]
    assert not r


def test_job_config_first_hello_wins_and_later_ones_must_agree():
    job = JobConfig()
    config = dict(num_workers=2, mode="bsp", staleness=None, num_servers=1, server_index=0)
    assert not job.configured
    assert job.adopt(config) is True
    assert job.adopt(dict(config)) is False
    assert (job.num_workers, job.mode, job.num_servers, job.server_index) == (2, "bsp", 1, 0)
    with pytest.raises(errors.InvalidArgument, match=r"num_workers=3 \(server has 2\)"):
        job.adopt({**config, "num_workers": 3})


def test_ssp_gate_releases_pulls_once_the_slowest_clock_catches_up():
    gate = SspGate()
    gate.start(num_workers=2, staleness=1)
    gate.advance(0, 3)
    assert gate.blocked(3) and not gate.blocked(1)
    gate.hold(3, "pull at 3")
    assert gate.release() == []  # worker 1 is still at 0
    gate.advance(1, 1)
    assert gate.release() == [] and len(gate) == 1
    gate.advance(1, 2)
    assert gate.release() == ["pull at 3"] and len(gate) == 0


def test_ssp_gate_never_blocks_without_staleness():
    gate = SspGate()
    gate.start(num_workers=2, staleness=None)
    gate.advance(0, 100)
    assert not gate.blocked(100)


def test_bsp_round_sums_in_rank_order_and_answers_every_pusher():
    state = AppliedState()
    rounds = BspRounds(state)
    one, zero = Request("rank 1"), Request("rank 0")
    dense = [(9, np.array([1.0, 2.0], np.float32))]
    assert rounds.contribute(one, 1, 1, PushKind.DENSE, dense, num_workers=2) is True
    assert rounds.waiting() == 1 and one.answered is None
    dense = [(9, np.array([10.0, 20.0], np.float32))]
    rounds.contribute(zero, 0, 1, PushKind.DENSE, dense, num_workers=2)
    assert state.calls == [("dense", 9, [11.0, 22.0])]
    assert one.answered == zero.answered == "finish" and rounds.waiting() == 0


def test_bsp_push_of_two_tables_is_answered_once_both_rounds_applied():
    state = AppliedState()
    rounds = BspRounds(state)
    keys, rows = np.array([3]), np.ones((1, 1), np.float32)
    both, first = Request(), Request()
    parsed = [(1, keys, rows, True), (2, keys, rows, True)]
    rounds.contribute(both, 0, 1, PushKind.SPARSE, parsed, num_workers=2)
    rounds.contribute(first, 1, 1, PushKind.SPARSE, parsed[:1], num_workers=2)
    assert first.answered == "finish" and both.answered is None
    empty = (2, np.array([], np.int64), np.zeros((0, 1), np.float32), True)
    rounds.contribute(Request(), 1, 1, PushKind.SPARSE, [empty], num_workers=2)
    assert both.answered == "finish"
    assert [call[:2] for call in state.calls] == [("sparse", 1), ("sparse", 2)]


def test_bsp_push_without_tables_is_not_held():
    assert BspRounds(AppliedState()).contribute(Request(), 0, 1, PushKind.DENSE, [], 2) is False


def test_bsp_round_error_fails_every_pusher():
    rounds = BspRounds(AppliedState(fail=True))
    requests = [Request(), Request()]
    for rank, request in enumerate(requests):
        parsed = [(4, np.array([rank]), np.ones((1, 1), np.float32), True)]
        rounds.contribute(request, rank, 1, PushKind.SPARSE, parsed, num_workers=2)
    assert [r.answers[0][0] for r in requests] == ["fail", "fail"]
    assert all(isinstance(r.answers[0][1], errors.ShapeError) for r in requests)


def test_restarted_server_applies_an_orphaned_push_alone():
    # Rank 1 got the dead server's reply for step 1 and moved on to step 2; rank 0 resends
    # step 1: applied alone, not summed with rank 1's step 2.
    state = AppliedState()
    rounds = BspRounds(state, restarted=True)
    ahead, orphan = Request("rank 1 step 2"), Request("rank 0 step 1")
    rounds.contribute(ahead, 1, 2, PushKind.DENSE, [(5, np.array([2.0], np.float32))], 2)
    rounds.contribute(orphan, 0, 1, PushKind.DENSE, [(5, np.array([1.0], np.float32))], 2)
    assert orphan.answered == "finish" and ahead.answered is None
    assert state.calls == [("dense", 5, [1.0])]
    rounds.contribute(Request(), 0, 2, PushKind.DENSE, [(5, np.array([4.0], np.float32))], 2)
    assert ahead.answered == "finish" and state.calls[-1] == ("dense", 5, [6.0])


def test_barrier_answers_all_when_the_last_arrives():
    barrier = Barrier()
    first, last = Request(), Request()
    barrier.arrive(1, first, num_workers=2)
    assert len(barrier) == 1 and first.answered is None
    barrier.arrive(0, last, num_workers=2)
    assert first.answered == last.answered == "finish" and len(barrier) == 0


def test_optimizer_epochs_followers_wait_for_rank_0_and_must_agree():
    epochs = OptimizerEpochs()
    agreeing, differing, later = Request(), Request(), Request()
    assert epochs.follow(agreeing, 1, {"name": "sgd"}) is False
    assert epochs.follow(differing, 1, {"name": "adam"}) is False
    assert epochs.follow(later, 2, {"name": "sgd"}) is False
    epochs.lead({"name": "sgd"})
    assert agreeing.answered == "finish" and differing.answered == "fail"
    assert later.answered is None and len(epochs) == 1
    assert epochs.follow(Request(), 1, {"name": "sgd"}) is True
    with pytest.raises(errors.InvalidArgument, match="every worker must set the same"):
        epochs.follow(Request(), 1, None)


def test_dense_init_waiters_answer_once_rank_0_values_are_in():
    waiters = DenseInitWaiters()
    fits, does_not = Request(), Request()
    waiters.wait(3, fits, "w", 4)
    waiters.wait(3, does_not, "w", 5)
    assert len(waiters) == 2
    waiters.release(3, held=4)
    assert fits.answered == "finish" and does_not.answered == "fail"
    assert isinstance(does_not.answers[0][1], errors.DuplicateKey) and len(waiters) == 0
