"""Feature admission (min_count) and eviction (ttl_steps, max_rows LFU/LRU), per table.

The semantics are documented in csrc/table.h (PolicyConfig) and
kvsparse.SparseTable; tests/reference.py's ReferencePolicyTable models them
in plain Python. The property tests run random push/pull/evict sequences on
a bare `_core.Table`, on the `local` store and on a 2-server `dist_sparse`
store (one reference table per shard, since max_rows is per shard) and
compare every pulled value and every counter with the model. The examples
below pin down each rule with hand-computed expectations.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import ReferencePolicyTable, shard_of

import kvsparse
from kvsparse import _core, errors, initializers, optimizers
from kvsparse.table import policy_of

SGD = {"kind": "sgd", "learning_rate": 1.0}
ONE = {"kind": "constant", "a": 1.0}
_names = itertools.count()


def ids(*values):
    return np.array(values, np.int64)


def ones(n, dim=1, value=1.0):
    return np.full((n, dim), value, np.float32)


def table(policy, dim=1, optimizer=SGD):
    return _core.Table(dim, {"kind": "zeros"}, optimizer, 0, policy)


def stored(t, universe=range(64)):
    """Ids of `universe` holding a row (zeros init + SGD lr 1 on gradient 1: row != 0)."""
    values = t.lookup(np.array(list(universe), np.int64))
    return sorted(k for k, v in zip(universe, values[:, 0]) if v != 0.0)


# -- admission ------------------------------------------------------------------------------------


def test_min_count_admits_at_kth_push_and_counts_each_push_once():
    t = table({"min_count": 3})
    # Duplicates in one push are one sighting; the gradient is dropped until admission.
    assert t.apply_gradients(ids(5, 5, 5), ones(3)) == 0
    t.lookup(ids(5))  # pulls never count
    assert t.apply_gradients(ids(5), ones(1)) == 0
    assert len(t) == 0 and t.policy_stats()["candidates"] == 1
    assert t.lookup(ids(5))[0, 0] == 0.0  # its initial value meanwhile
    assert t.apply_gradients(ids(5), ones(1)) == 1  # third push: admitted and updated
    assert len(t) == 1 and t.lookup(ids(5))[0, 0] == -1.0
    assert t.policy_stats() == {
        "admissions": 1,
        "evicted_ttl": 0,
        "evicted_capacity": 0,
        "rejected": 0,
        "candidates": 0,
    }
    _, _, steps = t.read_state(ids(5))
    assert steps.tolist() == [1]  # the optimizer saw one update, not three


def test_nonfinite_skipped_ids_are_not_seen():
    t = table({"min_count": 2})
    bad = np.array([[np.nan], [1.0]], np.float32)
    t.apply_gradients(ids(1, 2), bad, skip_nonfinite=True)
    assert t.policy_stats()["candidates"] == 1  # only id 2
    with pytest.raises(errors.NonFiniteGradient):
        t.apply_gradients(ids(2), np.array([[np.inf]], np.float32))
    assert t.policy_stats()["candidates"] == 1  # a rejected push changes nothing
    assert t.apply_gradients(ids(1, 2), ones(2)) == 1  # 2 admitted, 1 seen once
    assert stored(t) == [2]


def test_candidates_count_in_memory_bytes():
    t = table({"min_count": 2})
    before = t.memory_bytes()
    t.apply_gradients(np.arange(1000, dtype=np.int64), ones(1000))
    assert len(t) == 0 and t.policy_stats()["candidates"] == 1000
    assert t.memory_bytes() >= before + 1000 * 32


# -- TTL --------------------------------------------------------------------------------------


def test_ttl_evicts_untouched_rows_on_request():
    t = table({"ttl_steps": 2})  # evict_every 0: only on request
    t.apply_gradients(ids(1, 2), ones(2))  # step 1
    t.apply_gradients(ids(2), ones(1))  # step 2: row 1 is 1 step old
    assert t.evict_expired() == 0
    t.apply_gradients(ids(3), ones(1))  # step 3: row 1 is 2 steps old, row 2 one
    assert t.evict_expired() == 1
    assert stored(t) == [2, 3]
    assert t.policy_stats()["evicted_ttl"] == 1


def test_ttl_runs_automatically_every_n_steps_and_on_empty_shard_steps():
    t = table({"ttl_steps": 1, "evict_every": 3})
    t.apply_gradients(ids(1), ones(1))  # step 1
    t.advance_step()  # step 2 (a push with no ids here): not due
    assert len(t) == 1
    t.advance_step()  # step 3: due, row 1 is 2 steps old
    assert len(t) == 0 and t.policy_stats()["evicted_ttl"] == 1


def test_evicted_row_restarts_from_initial_value_and_state():
    t = _core.Table(2, ONE, {"kind": "adam", "learning_rate": 0.1}, 0, {"ttl_steps": 1})
    t.apply_gradients(ids(7), ones(1, 2))
    t.advance_step()
    assert t.evict_expired() == 1
    np.testing.assert_array_equal(t.lookup(ids(7)), ones(1, 2))
    t.apply_gradients(ids(7), ones(1, 2))
    _, slots, steps = t.read_state(ids(7))
    assert steps.tolist() == [1]  # Adam's bias correction starts over
    fresh = _core.Table(2, ONE, {"kind": "adam", "learning_rate": 0.1})
    fresh.apply_gradients(ids(7), ones(1, 2))
    np.testing.assert_array_equal(t.lookup(ids(7)), fresh.lookup(ids(7)))
    np.testing.assert_array_equal(slots, fresh.read_state(ids(7))[1])


def test_ttl_drops_stale_candidates():
    t = table({"min_count": 2, "ttl_steps": 2})
    t.apply_gradients(ids(1), ones(1))
    t.advance_step()
    t.advance_step()
    t.evict_expired()
    assert t.policy_stats()["candidates"] == 0
    assert t.apply_gradients(ids(1), ones(1)) == 0  # counting starts over


# -- capacity -----------------------------------------------------------------------------------


def test_lfu_evicts_fewest_touches_lower_key_first():
    t = table({"max_rows": 3, "eviction": "lfu"})
    t.apply_gradients(ids(10, 20, 30), ones(3))
    t.apply_gradients(ids(10), ones(1))  # touches: 10 -> 2, 20 -> 1, 30 -> 1
    t.apply_gradients(ids(40), ones(1))  # tie 20/30: the lower key goes
    assert stored(t, range(50)) == [10, 30, 40]
    t.apply_gradients(ids(30, 50), ones(2))  # 30 is in the push: 40 (1 touch) goes
    assert stored(t, range(60)) == [10, 30, 50]
    assert t.policy_stats()["evicted_capacity"] == 2


def test_lru_evicts_oldest_last_touch_lower_key_first():
    t = table({"max_rows": 3, "eviction": "lru"})
    t.apply_gradients(ids(30, 20), ones(2))  # step 1
    t.apply_gradients(ids(10), ones(1))  # step 2
    t.apply_gradients(ids(20), ones(1))  # step 3: 20 is the most recent
    t.apply_gradients(ids(40, 50), ones(2))  # two go: 30 (step 1), then 10 (step 2)
    assert stored(t, range(60)) == [20, 40, 50]


def test_push_larger_than_capacity_admits_lowest_ids_and_rejects_the_rest():
    t = table({"max_rows": 2, "min_count": 1})
    t.apply_gradients(ids(5), ones(1))
    # 5 is in the push and cannot be evicted by it: room for one new id, the lowest.
    assert t.apply_gradients(ids(9, 5, 3, 7), ones(4)) == 2
    assert stored(t) == [3, 5]
    assert t.policy_stats()["rejected"] == 2


def test_rows_of_current_push_are_never_evicted_by_it():
    t = table({"max_rows": 2, "eviction": "lfu"})
    t.apply_gradients(ids(1, 2), ones(2))
    t.apply_gradients(ids(1, 2), ones(2))
    assert t.apply_gradients(ids(1, 2, 3), ones(3)) == 2
    assert stored(t) == [1, 2] and t.policy_stats()["rejected"] == 1


# -- metadata memory --------------------------------------------------------------------------


def test_metadata_costs_memory_only_when_a_policy_needs_it():
    keys = np.arange(5000, dtype=np.int64)

    def bytes_with(policy):
        t = table(policy, dim=8)
        t.apply_gradients(keys, ones(keys.size, 8))
        return t.memory_bytes()

    plain = bytes_with(None)
    assert bytes_with({"min_count": 1}) == plain
    assert bytes_with({"min_count": 2, "max_rows": 0}) < plain  # nothing stored yet
    one_field = bytes_with({"ttl_steps": 100})
    assert one_field >= plain + 4 * keys.size
    assert bytes_with({"max_rows": 10**6, "eviction": "lru"}) == one_field
    assert bytes_with({"ttl_steps": 100, "max_rows": 10**6}) >= one_field + 4 * keys.size


# -- API: SparseTable, kv.evict, kv.stats ----------------------------------------------------


def test_sparse_table_validation_and_spec():
    for bad in (
        {"min_count": 0},
        {"ttl_steps": 0},
        {"max_rows": -1},
        {"eviction": "fifo"},
        {"evict_every": -1},
        {"min_count": 1.5},
    ):
        with pytest.raises(errors.InvalidArgument):
            kvsparse.SparseTable(4, **bad)
    # Tables without a policy keep their old spec exactly.
    assert "min_count" not in kvsparse.SparseTable(4).to_dict()
    assert policy_of(kvsparse.SparseTable(4).to_dict()) is None
    spec = kvsparse.SparseTable(4, min_count=3, ttl_steps=9, max_rows=100, eviction="lru")
    again = kvsparse.SparseTable.from_dict(spec.to_dict())
    assert again == spec
    assert again.policy() == {
        "min_count": 3,
        "ttl_steps": 9,
        "max_rows": 100,
        "eviction": "lru",
        "evict_every": 9,
    }
    assert kvsparse.SparseTable(4, ttl_steps=9, evict_every=0).policy()["evict_every"] == 0
    with pytest.raises(errors.InvalidArgument):
        _core.Table(4, policy={"min_count": 2, "bogus": 1})


def test_local_store_evict_and_stats():
    kv = kvsparse.create("local")
    kv.init(
        "user",
        kvsparse.SparseTable(
            1,
            initializer=initializers.Zeros(),
            optimizer=optimizers.SGD(learning_rate=1.0),
            ttl_steps=2,
            evict_every=0,
            min_count=2,
        ),
    )
    kv.init("plain", kvsparse.SparseTable(1))
    for _ in range(2):
        kv.push("user", (ids(1, 2, 3), ones(3)))
    kv.push("user", (ids(1, 4), ones(2)))
    kv.push("user", (ids(1), ones(1)))
    user = kv.stats()["tables"]["user"]
    assert (user["rows"], user["admissions"], user["candidates"]) == (3, 3, 1)
    assert kv.evict() == {"user": 2, "plain": 0}  # 2 and 3 last touched at step 2
    user = kv.stats()["tables"]["user"]
    assert (user["rows"], user["evictions"], user["evicted_ttl"]) == (1, 2, 2)
    assert kv.stats()["tables"]["plain"]["evictions"] == 0
    np.testing.assert_array_equal(kv.row_sparse_pull("user", row_ids=ids(1, 2))[:, 0], [-3, 0])


# -- properties against the reference model ---------------------------------------------------

UNIVERSE = 12

POLICIES = st.fixed_dictionaries(
    {
        "min_count": st.integers(1, 3),
        "ttl_steps": st.sampled_from([0, 1, 2, 4]),
        "max_rows": st.sampled_from([0, 1, 3, 6]),
        "eviction": st.sampled_from(["lfu", "lru"]),
        "evict_every": st.sampled_from([0, 1, 3]),
    }
)

OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("push"),
            st.lists(st.integers(0, UNIVERSE - 1), min_size=0, max_size=6),
            st.integers(0, 2**31 - 1),
        ),
        st.tuples(st.just("evict"), st.just([]), st.just(0)),
        st.tuples(st.just("pull"), st.lists(st.integers(0, UNIVERSE - 1), max_size=6), st.just(0)),
    ),
    min_size=1,
    max_size=25,
)


def _grads(n, seed, dim):
    return np.random.default_rng(seed).uniform(-1, 1, (n, dim)).astype(np.float32)


@settings(max_examples=150, deadline=None)
@given(policy=POLICIES, ops=OPS, skip=st.booleans())
def test_core_table_matches_reference(policy, ops, skip):
    dim = 2
    optimizer = {"kind": "adagrad", "learning_rate": 0.5}
    t = _core.Table(dim, ONE, optimizer, 3, policy)
    ref = ReferencePolicyTable(dim, ONE, optimizer, 3, policy)
    everything = np.arange(UNIVERSE, dtype=np.int64)
    for op, keys, seed in ops:
        if op == "push":
            grads = _grads(len(keys), seed, dim)
            if skip and keys and seed % 3 == 0:
                grads[0, 0] = np.nan
            applied = t.apply_gradients(ids(*keys), grads, skip_nonfinite=skip)
            assert applied == ref.apply_gradients(ids(*keys), grads, skip_nonfinite=skip)
        elif op == "evict":
            assert t.evict_expired() == ref.evict_expired()
        else:
            np.testing.assert_allclose(t.lookup(ids(*keys)), ref.lookup(ids(*keys)), rtol=1e-6)
        assert len(t) == len(ref)
        assert t.policy_stats() == ref.policy_stats()
    keys, values, slots, steps = ref.state()
    got = t.read_state(keys)
    np.testing.assert_allclose(got[0], values, rtol=1e-6)
    np.testing.assert_allclose(got[1], slots, rtol=1e-6)
    np.testing.assert_array_equal(got[2], steps)
    np.testing.assert_allclose(t.lookup(everything), ref.lookup(everything), rtol=1e-6)


class ShardedReference:
    """One ReferencePolicyTable per shard, fed the way the store feeds its shards."""

    def __init__(self, num_shards, spec):
        self.num_shards = num_shards
        optimizer = None if spec["optimizer"] is None else spec["optimizer"]
        self.shards = [
            ReferencePolicyTable(
                spec["dim"], spec["initializer"], optimizer, spec["seed"], policy_of(spec)
            )
            for _ in range(num_shards)
        ]

    def push(self, keys, grads):
        if keys.size == 0:
            return
        owner = np.asarray(shard_of(keys, self.num_shards))
        for s, shard in enumerate(self.shards):
            mask = owner == s
            if mask.any():
                shard.apply_gradients(keys[mask], grads[mask])
            else:
                shard.advance_step()

    def evict(self):
        return sum(shard.evict_expired() for shard in self.shards)

    def pull(self, keys):
        out = np.empty((keys.size, self.shards[0].dim), np.float32)
        owner = np.asarray(shard_of(keys, self.num_shards))
        for s, shard in enumerate(self.shards):
            mask = owner == s
            if mask.any():
                out[mask] = shard.lookup(keys[mask])
        return out


def _run_store(kv, num_shards, policy, ops):
    name = f"t{next(_names)}"
    table_spec = kvsparse.SparseTable(
        2,
        initializer=initializers.Constant(1.0),
        optimizer=optimizers.SGD(learning_rate=0.5),
        seed=11,
        **{k: (v or None) if k in ("ttl_steps", "max_rows") else v for k, v in policy.items()},
    )
    kv.init(name, table_spec)
    ref = ShardedReference(num_shards, table_spec.to_dict())
    everything = np.arange(UNIVERSE, dtype=np.int64)
    for op, keys, seed in ops:
        keys = ids(*keys)
        if op == "push":
            grads = _grads(keys.size, seed, 2)
            if keys.size:
                kv.push(name, (keys, grads))
            ref.push(keys, grads)
        elif op == "evict":
            assert kv.evict()[name] == ref.evict()
        else:
            np.testing.assert_allclose(
                kv.row_sparse_pull(name, row_ids=keys), ref.pull(keys), rtol=1e-6
            )
    np.testing.assert_allclose(
        kv.row_sparse_pull(name, row_ids=everything), ref.pull(everything), rtol=1e-6
    )
    shards = kv.stats()["shards"]
    for s, shard in enumerate(ref.shards):
        got = shards[s]["tables"][name]
        expected = shard.policy_stats()
        assert got["rows"] == len(shard)
        for field in ("admissions", "evicted_ttl", "evicted_capacity", "rejected", "candidates"):
            assert got[field] == expected[field], field


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=POLICIES, ops=OPS)
def test_local_store_matches_reference(policy, ops):
    kv = kvsparse.create("local")
    _run_store(kv, 1, policy, ops)


@pytest.fixture(scope="module")
def two_servers(module_server_factory):
    servers = module_server_factory(2)
    kv = kvsparse.create("dist_sparse", servers=servers, rank=0, num_workers=1)
    yield kv
    kv.close()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(policy=POLICIES, ops=OPS)
def test_dist_store_matches_sharded_reference(two_servers, policy, ops):
    _run_store(two_servers, 2, policy, ops)


def test_dist_evict_and_stats_sum_over_shards(two_servers):
    kv = two_servers
    kv.init(
        "capped",
        kvsparse.SparseTable(
            1, optimizer=optimizers.SGD(learning_rate=1.0), max_rows=2, ttl_steps=3
        ),
    )
    keys = np.arange(40, dtype=np.int64)
    kv.push("capped", (keys, ones(40)))
    stats = kv.stats()["tables"]["capped"]
    # max_rows is per shard: two shards hold at most 4 rows.
    assert stats["rows"] == 4 and stats["admissions"] == 4 and stats["rejected"] == 36
    for _ in range(3):
        kv.push("capped", (keys[:1], ones(1)))
    evicted = kv.evict()["capped"]
    assert evicted == 3  # every row but id 0's
    assert kv.stats()["tables"]["capped"]["rows"] == 1


def test_incremental_checkpoint_records_evictions(tmp_path):
    # Evictions go through the table's Remove, so an incremental save drops them too.
    kv = kvsparse.create("local")
    spec = kvsparse.SparseTable(
        1, optimizer=optimizers.SGD(learning_rate=1.0), ttl_steps=1, evict_every=0
    )
    kv.init("u", spec)
    kv.push("u", (ids(1, 2, 3), ones(3)))
    kv.save(tmp_path / "ckpt")
    kv.push("u", (ids(3), ones(1)))
    assert kv.evict() == {"u": 2}
    kv.save(tmp_path / "ckpt", incremental=True)
    restored = kvsparse.create("local")
    restored.load(tmp_path / "ckpt")
    assert restored.stats()["tables"]["u"]["rows"] == 1
    np.testing.assert_array_equal(
        restored.row_sparse_pull("u", row_ids=ids(1, 2, 3)),
        kv.row_sparse_pull("u", row_ids=ids(1, 2, 3)),
    )
