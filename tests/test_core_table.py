"""Layer tests of the C++ core (csrc/) through its Cython wrapper kvsparse._core.

Expected values come from tests/reference.py (plain NumPy, written from the
documented formulas) or from NumPy itself, never from the core.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import reference
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsparse import _core, errors

INT64_MIN = np.iinfo(np.int64).min
INT64_MAX = np.iinfo(np.int64).max
EXTREME_KEYS = [INT64_MIN, INT64_MIN + 1, -(2**32), -1, 0, 1, 2**32, INT64_MAX - 1, INT64_MAX]

INITIALIZERS = [
    {"kind": "zeros"},
    {"kind": "constant", "a": 0.25},
    {"kind": "uniform", "a": -0.5, "b": 1.5},
    {"kind": "normal", "a": 0.1, "b": 0.02},
    {"kind": "truncated_normal", "a": -1.0, "b": 3.0},
]


def ids(values):
    return np.array(values, dtype=np.int64)


def rows_for(keys, dim, salt=0.0):
    """Distinct float32 rows derived from the keys (exactly representable)."""
    keys = np.asarray(keys, dtype=np.int64)
    base = (keys % 100003).astype(np.float32) + np.float32(salt)
    return (base[:, None] + np.arange(dim, dtype=np.float32)[None, :] / 8).astype(np.float32)


def table_state(table):
    """Every row of a core table, sorted by key: (keys, values, slots, steps)."""
    chunks = list(table.iter_chunks())
    if not chunks:
        return (
            np.zeros(0, np.int64),
            np.zeros((0, table.dim), np.float32),
            np.zeros((0, table.num_slots, table.dim), np.float32),
            np.zeros(0, np.int64),
        )
    keys, values, slots, steps = (np.concatenate(parts) for parts in zip(*chunks))
    order = np.argsort(keys, kind="stable")
    return keys[order], values[order], slots[order], steps[order]


def assert_same_state(table, ref, rtol=1e-5, atol=1e-6):
    keys, values, slots, steps = table_state(table)
    ref_keys, ref_values, ref_slots, ref_steps = ref.state()
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_allclose(values, ref_values, rtol=rtol, atol=atol)
    np.testing.assert_allclose(slots, ref_slots, rtol=rtol, atol=atol)
    np.testing.assert_array_equal(steps, ref_steps)
    assert table.table_step == ref.table_step
    assert table.size() == len(table) == ref.size()


def readonly(array):
    array = np.array(array)
    array.setflags(write=False)
    return array


# --------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------


@pytest.mark.parametrize("initializer", INITIALIZERS, ids=lambda s: s["kind"])
def test_extreme_keys_are_distinct_rows(initializer):
    dim = 5
    keys = ids(EXTREME_KEYS)
    table = _core.Table(dim, initializer, {"kind": "sgd", "learning_rate": 0.5}, seed=99)
    expected_initial = reference.initial_rows(initializer, keys, dim, seed=99)
    np.testing.assert_allclose(table.initial_values(keys), expected_initial, rtol=1e-6)
    np.testing.assert_allclose(table.lookup_or_insert(keys), expected_initial, rtol=1e-6)
    assert table.size() == len(EXTREME_KEYS)

    values = rows_for(keys, dim)
    table.assign(keys, values)
    np.testing.assert_array_equal(table.lookup(keys), values)
    grads = rows_for(keys[::-1], dim, salt=1.0)
    assert table.apply_gradients(keys, grads) == len(keys)
    np.testing.assert_allclose(table.lookup(keys), values - np.float32(0.5) * grads, rtol=1e-6)

    # Removing the extremes one at a time leaves every other key intact.
    current = table.lookup(keys)
    for i, key in enumerate(EXTREME_KEYS):
        assert table.remove(ids([key])) == 1
        assert table.size() == len(EXTREME_KEYS) - i - 1
        np.testing.assert_array_equal(table.lookup(keys[i + 1 :]), current[i + 1 :])
        np.testing.assert_allclose(table.lookup(ids([key])), expected_initial[i : i + 1], rtol=1e-6)


def test_lookup_does_not_insert():
    initializer = {"kind": "uniform", "a": -1, "b": 1}
    table = _core.Table(3, initializer, {"kind": "adagrad"}, seed=5)
    keys = ids([3, -7, 3, INT64_MAX])
    first = table.lookup(keys)
    assert table.size() == 0
    assert list(table.iter_chunks()) == []
    np.testing.assert_array_equal(first, reference.initial_rows(initializer, keys, 3, 5))
    np.testing.assert_array_equal(table.lookup(keys), first)
    assert table.size() == 0
    np.testing.assert_array_equal(table.lookup_or_insert(keys), first)
    assert table.size() == 3
    with pytest.raises(errors.InvalidArgument):
        table.read_state(ids([12345]))


@pytest.mark.parametrize("initializer", INITIALIZERS, ids=lambda s: s["kind"])
@pytest.mark.parametrize("dim", [5, 64])
def test_push_after_lookup_gives_the_same_bits_as_without(initializer, dim):
    """A lookup keeps the initial rows it generated for unstored ids, and the push that
    follows copies them instead of generating them again. The cache is direct-mapped and
    bounded: ids it lost are generated again. Either way, every bit is as without it."""
    rng = np.random.default_rng(dim)
    optimizer = {"kind": "adagrad", "learning_rate": 0.1}
    pulled = _core.Table(dim, initializer, optimizer, seed=7)
    plain = _core.Table(dim, initializer, optimizer, seed=7)
    for step in range(4):
        keys = np.unique(rng.integers(-(2**62), 2**62, 3000 * (step + 1)))
        rng.shuffle(keys)
        # Several lookups before the push: the later ones overwrite cache slots.
        for part in np.array_split(keys, 3):
            np.testing.assert_array_equal(
                pulled.lookup(part), reference.initial_rows(initializer, part, dim, 7)
            )
        pulled.lookup(rng.integers(0, 2**62, 20000))  # ids never pushed
        grads = rng.standard_normal((keys.size, dim)).astype(np.float32)
        assert pulled.apply_gradients(keys, grads) == plain.apply_gradients(keys, grads)
        for got, expected in zip(pulled.read_state(keys), plain.read_state(keys)):
            np.testing.assert_array_equal(got, expected)
    assert pulled.size() == plain.size()
    if initializer["kind"] in ("zeros", "constant"):
        assert pulled.scratch_bytes() == plain.scratch_bytes()
    else:  # the cache is counted, and bounded (16 MiB)
        assert plain.scratch_bytes() < pulled.scratch_bytes() <= plain.scratch_bytes() + (16 << 20)


def test_lookup_into_out_buffer():
    table = _core.Table(4, {"kind": "constant", "a": 2.0})
    out = np.full((3, 4), -1.0, np.float32)
    result = table.lookup(ids([1, 2, 3]), out=out)
    assert result is out
    np.testing.assert_array_equal(out, 2.0)
    assert table.lookup(ids([])).shape == (0, 4)
    assert table.lookup_or_insert(ids([])).shape == (0, 4)


def test_duplicate_keys_are_summed_and_counted_once():
    dim = 4
    table = _core.Table(dim, {"kind": "zeros"}, {"kind": "sgd", "learning_rate": 1.0})
    ref = reference.ReferenceTable(dim, {"kind": "zeros"}, {"kind": "sgd", "learning_rate": 1.0})
    keys = ids([5, 9, 5, 5, INT64_MIN, 9])
    grads = np.arange(len(keys) * dim, dtype=np.float32).reshape(len(keys), dim)
    assert table.apply_gradients(keys, grads) == 3
    assert ref.apply_gradients(keys, grads) == 3
    expected = -(grads[0] + grads[2] + grads[3])
    np.testing.assert_array_equal(table.lookup(ids([5]))[0], expected)
    assert_same_state(table, ref)
    _, _, steps = table.read_state(ids([5, 9, INT64_MIN]))
    assert steps.tolist() == [1, 1, 1]
    assert table.table_step == 1

    # lookup_or_insert with duplicates inserts each id once.
    table.lookup_or_insert(ids([77, 77, 78, 77]))
    assert table.size() == 5
    # assign with duplicates: the last value wins.
    values = rows_for(ids([1, 2, 3]), dim)
    table.assign(ids([1000, 1000, 1000]), values)
    np.testing.assert_array_equal(table.lookup(ids([1000]))[0], values[2])
    assert table.size() == 6


def test_kind_none_push_replaces_row():
    table = _core.Table(3, {"kind": "constant", "a": 7.0}, None)
    keys = ids([4, 4, 8])
    grads = np.array([[1, 2, 3], [10, 20, 30], [-1, -2, -3]], np.float32)
    assert table.apply_gradients(keys, grads) == 2
    np.testing.assert_array_equal(table.lookup(ids([4, 8])), [[11, 22, 33], [-1, -2, -3]])
    assert table.num_slots == 0


# --------------------------------------------------------------------------
# Growth and removal
# --------------------------------------------------------------------------


def test_growth_to_300k_rows_preserves_every_value():
    dim = 4
    rng = np.random.default_rng(0)
    random_keys = rng.integers(INT64_MIN, INT64_MAX, size=150_000, endpoint=True, dtype=np.int64)
    sequential = np.arange(-75_000, 75_000, dtype=np.int64) * 3
    keys = np.unique(np.concatenate([random_keys, sequential]))
    rng.shuffle(keys)
    assert len(keys) > 299_000
    values = rows_for(keys, dim)
    table = _core.Table(dim, {"kind": "normal", "b": 1.0}, {"kind": "adagrad"}, seed=3)
    batch = 9_999
    for start in range(0, len(keys), batch):
        stop = min(start + batch, len(keys))
        table.assign(keys[start:stop], values[start:stop])
        # Rows written before every rehash so far are still where they were.
        probe = rng.integers(0, stop, size=500)
        np.testing.assert_array_equal(table.lookup(keys[probe]), values[probe])
        assert table.size() == stop
    np.testing.assert_array_equal(table.lookup(keys), values)
    stored_keys, stored_values, stored_slots, stored_steps = table_state(table)
    np.testing.assert_array_equal(stored_keys, np.sort(keys))
    np.testing.assert_array_equal(stored_values, values[np.argsort(keys)])
    assert (stored_slots == 0).all() and (stored_steps == 0).all()


def colliding_keys(count, home_buckets, capacity=16, start=0):
    """Keys whose home bucket (Mix64(key) * capacity >> 64) is in home_buckets."""
    candidates = np.arange(start, start + 4000 * count, dtype=np.int64)
    homes = np.array([(int(h) * capacity) >> 64 for h in reference.mix64(candidates)])
    chosen = candidates[np.isin(homes, home_buckets)]
    assert len(chosen) >= count
    return chosen[:count]


@pytest.mark.parametrize("homes", [[15], [14, 15, 0], [0], [7, 8]], ids=str)
def test_backward_shift_removal_in_one_cluster(homes):
    """Removes from a probe cluster (wrapping around the 16-bucket array) in every order."""
    dim = 2
    keys = colliding_keys(12, homes)  # 12 rows keep the 16 buckets (load <= 3/4)
    values = rows_for(keys, dim)
    rng = np.random.default_rng(len(homes))
    for trial in range(60):
        table = _core.Table(dim, {"kind": "constant", "a": -5.0})
        for i in range(len(keys)):  # one at a time: no rehash beyond 16 buckets
            table.assign(keys[i : i + 1], values[i : i + 1])
        present = set(range(len(keys)))
        for _ in range(40):
            i = int(rng.integers(len(keys)))
            if i in present and rng.random() < 0.6:
                assert table.remove(keys[i : i + 1]) == 1
                present.discard(i)
            elif i not in present:
                table.assign(keys[i : i + 1], values[i : i + 1])
                present.add(i)
            else:
                assert table.remove(ids([keys[i] + (1 << 40)])) == 0
            expected = np.where(
                np.isin(np.arange(len(keys)), list(present))[:, None], values, np.float32(-5)
            )
            np.testing.assert_array_equal(table.lookup(keys), expected, err_msg=f"trial {trial}")
            assert table.size() == len(present)
        assert sorted(table_state(table)[0].tolist()) == sorted(keys[list(present)].tolist())


def keys_homed_on(count, lines, line_count=4, start=0):
    """Keys whose home line (Mix64(key) * line_count >> 64) is in `lines`.

    A new table's map has 4 lines of 5 slots (csrc/table.h, BucketLine)."""
    candidates = np.arange(start, start + 4000 * count, dtype=np.int64)
    homes = np.array([(int(h) * line_count) >> 64 for h in reference.mix64(candidates)])
    chosen = candidates[np.isin(homes, lines)]
    assert len(chosen) >= count
    return chosen[:count]


@pytest.mark.parametrize("lines", [[3], [0], [2, 3]], ids=str)
def test_lines_full_from_home_lose_no_key_to_removes(lines):
    """15 keys (load 3/4 of a new table's 20 slots) homed on one or two lines fill
    three lines, wrapping around the map; removes (backward shifts across lines)
    and re-inserts in random order, with lookups of every key after each step:
    keys past their home line take the slow probe, and a removed key's stale copy
    in its home line must neither be found nor hide the key re-inserted elsewhere."""
    dim = 2
    keys = keys_homed_on(15, lines)
    absent = keys_homed_on(5, lines, start=int(keys[-1]) + 1)  # never stored
    values = rows_for(keys, dim)
    rng = np.random.default_rng(sum(lines))
    for trial in range(40):
        table = _core.Table(dim, {"kind": "constant", "a": -5.0})
        order = rng.permutation(len(keys))
        for i in order:  # one at a time: no growth past the 4 lines
            table.assign(keys[i : i + 1], values[i : i + 1])
        present = set(range(len(keys)))
        for _ in range(40):
            i = int(rng.integers(len(keys)))
            if i in present:
                assert table.remove(keys[i : i + 1]) == 1
                present.discard(i)
            else:
                table.assign(keys[i : i + 1], values[i : i + 1])
                present.add(i)
            expected = np.where(
                np.isin(np.arange(len(keys)), list(present))[:, None], values, np.float32(-5)
            )
            np.testing.assert_array_equal(table.lookup(keys), expected, err_msg=f"trial {trial}")
            np.testing.assert_array_equal(table.lookup(absent), np.full((5, dim), -5, np.float32))
            assert table.size() == len(present)
        assert table.memory_bytes() < 8 * 1024  # still the 4 lines: no growth happened
        assert sorted(table_state(table)[0].tolist()) == sorted(keys[list(present)].tolist())


@pytest.mark.parametrize("dim,dtype", [(8, "float32"), (5, "float32"), (8, "bfloat16")])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 48, 49, 63, 64, 65, 97, 20000])
def test_lookup_batches_around_the_pipeline_stages(n, dim, dtype):
    """The lookup probes key i's line 16 keys after prefetching it and copies its
    row 32 keys later (csrc/table.cc, LookupRangeFor): batch sizes around those
    distances, stored and unstored keys mixed, give each key its row or its
    initial value; 20000 keys are split over threads."""
    rng = np.random.default_rng(n)
    table = _core.Table(dim, {"kind": "uniform", "a": -1, "b": 1}, seed=3, dtype=dtype)
    stored = rng.integers(INT64_MIN, INT64_MAX, size=max(n, 64), dtype=np.int64)
    table.assign(stored, rows_for(stored, dim))
    expected_stored = table.lookup(stored)  # the stored (rounded) rows, row by row below
    unstored = rng.integers(INT64_MIN, INT64_MAX, size=n, dtype=np.int64)
    unstored = unstored[~np.isin(unstored, stored)]
    take_stored = rng.random(len(unstored)) < 0.5
    picked = rng.integers(0, len(stored), size=len(unstored))
    keys = np.where(take_stored, stored[picked], unstored)
    expected = np.where(
        take_stored[:, None], expected_stored[picked], table.initial_values(unstored)
    )
    np.testing.assert_array_equal(table.lookup(keys), expected)
    for i in range(min(len(stored), 64)):
        np.testing.assert_array_equal(
            expected_stored[i], table.lookup(stored[i : i + 1])[0], err_msg=str(i)
        )
    if dtype == "float32":
        np.testing.assert_array_equal(expected_stored, rows_for(stored, dim))


def test_many_removes_and_reinserts_match_a_dict():
    dim = 3
    rng = np.random.default_rng(11)
    universe = np.concatenate(
        [
            rng.integers(INT64_MIN, INT64_MAX, size=3000, endpoint=True, dtype=np.int64),
            np.arange(3000, dtype=np.int64),
            ids(EXTREME_KEYS),
        ]
    )
    universe = np.unique(universe)
    optimizer = {"kind": "adagrad", "initial_accumulator_value": 0.5, "learning_rate": 0.1}
    table = _core.Table(dim, {"kind": "uniform", "a": 0, "b": 1}, optimizer, seed=8)
    ref = reference.ReferenceTable(dim, {"kind": "uniform", "a": 0, "b": 1}, optimizer, seed=8)
    for round_number in range(12):
        inserted = rng.choice(universe, size=1500)
        values = rng.standard_normal((len(inserted), dim)).astype(np.float32)
        table.assign(inserted, values)
        ref.assign(inserted, values)
        pushed = rng.choice(universe, size=800)
        grads = rng.standard_normal((len(pushed), dim)).astype(np.float32)
        assert table.apply_gradients(pushed, grads) == ref.apply_gradients(pushed, grads)
        removed = rng.choice(universe, size=2000)
        assert table.remove(removed) == ref.remove(removed)
        np.testing.assert_allclose(
            table.lookup(universe), ref.lookup(universe), rtol=1e-6, err_msg=str(round_number)
        )
        assert_same_state(table, ref)
    # A removed and re-inserted row starts over: initial value, slots, step 0.
    key = ids([universe[0]])
    table.remove(key)
    table.lookup_or_insert(key)
    values, slots, steps = table.read_state(key)
    np.testing.assert_array_equal(values, ref.initial_values(key))
    np.testing.assert_array_equal(slots, np.full((1, 1, dim), 0.5, np.float32))
    assert steps.tolist() == [0]


def test_remove_counts_only_existing_keys():
    table = _core.Table(2)
    table.lookup_or_insert(ids([1, 2, 3]))
    assert table.remove(ids([])) == 0
    assert table.remove(ids([4, 5])) == 0
    assert table.remove(ids([2, 2, 4])) == 1
    assert table.size() == 2
    assert table.remove(ids([1, 3, INT64_MIN])) == 2
    assert table.size() == 0


# --------------------------------------------------------------------------
# Inputs: read-only buffers, dims, shapes and dtypes
# --------------------------------------------------------------------------


def test_read_only_inputs_are_accepted():
    dim = 3
    keys = readonly(ids([4, -4, 4, INT64_MAX]))
    grads = readonly(np.ones((4, dim), np.float32))
    table = _core.Table(dim, {"kind": "zeros"}, {"kind": "adam", "learning_rate": 0.1})
    table.lookup(keys)
    table.lookup_or_insert(keys)
    table.initial_values(keys)
    assert table.apply_gradients(keys, grads) == 3
    assert table.apply_gradients(keys, grads, skip_nonfinite=True) == 3
    table.assign(keys, grads)
    values, slots, steps = table.read_state(keys)
    table.write_state(keys, readonly(values), readonly(slots), readonly(steps))
    assert table.remove(keys) == 3

    unique, inverse = _core.unique_inverse(keys)
    np.testing.assert_array_equal(unique[inverse], keys)
    _core.plan_batch(keys, 3)
    _core.shard_of(keys, 3)
    _core.sum_rows(grads, readonly(inverse), len(unique))
    assert _core.first_nonfinite_row(grads) == -1
    plan_keys, offsets, slot = _core.plan_batch(keys, 2)
    shard_rows = [
        readonly(np.zeros((offsets[s + 1] - offsets[s], dim), np.float32)) for s in range(2)
    ]
    out = np.empty((len(keys), dim), np.float32)
    _core.gather_from_shards(shard_rows, readonly(offsets), readonly(slot), out)

    optimizer = _core.Optimizer({"kind": "sgd", "learning_rate": 0.5})
    weights = np.ones(dim, np.float32)
    optimizer.update(weights, optimizer.initial_slots(dim), readonly(np.ones(dim, np.float32)), 1)
    np.testing.assert_array_equal(weights, 0.5)


@pytest.mark.parametrize("dim", [1, 4096])
def test_dim_bounds_work(dim):
    keys = ids([1, INT64_MIN, 1])
    optimizer = {"kind": "adamw", "learning_rate": 0.01, "weight_decay": 0.1}
    table = _core.Table(dim, {"kind": "normal", "b": 0.1}, optimizer, seed=1)
    ref = reference.ReferenceTable(dim, {"kind": "normal", "b": 0.1}, optimizer, seed=1)
    grads = np.random.default_rng(dim).standard_normal((3, dim)).astype(np.float32)
    for _ in range(3):
        assert table.apply_gradients(keys, grads) == ref.apply_gradients(keys, grads) == 2
    np.testing.assert_allclose(table.lookup(keys), ref.lookup(keys), rtol=1e-5, atol=1e-6)
    assert_same_state(table, ref)
    assert table.dim == dim


@pytest.mark.parametrize("dim", [0, -1, 4097, 1 << 40])
def test_dim_out_of_bounds_raises(dim):
    with pytest.raises(errors.InvalidArgument) as info:
        _core.Table(dim)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "initializer",
    [
        {"kind": "uniform", "a": 1.0, "b": 0.0},
        {"kind": "normal", "b": -1.0},
        {"kind": "truncated_normal", "b": float("nan")},
        {"kind": "glorot"},
    ],
    ids=str,
)
def test_bad_initializer_raises(initializer):
    with pytest.raises(errors.InvalidArgument):
        _core.Table(4, initializer)
    with pytest.raises(errors.InvalidArgument):
        reference.ReferenceTable(4, initializer)


@pytest.mark.parametrize(
    "optimizer",
    [
        {"kind": "lamb"},
        {"kind": "sgd", "learnig_rate": 0.1},
        {"kind": "sgd", "learning_rate": -0.1},
        {"kind": "sgd", "learning_rate": float("inf")},
        {"kind": "sgd", "nesterov": True},
        {"kind": "sgd", "momentum": -0.5},
        {"kind": "adam", "beta1": 1.0},
        {"kind": "adam", "beta2": -0.1},
        {"kind": "adam", "epsilon": -1e-8},
        {"kind": "adagrad", "weight_decay": -1.0},
        {"kind": "adagrad", "initial_accumulator_value": -0.1},
        {"kind": "rmsprop", "alpha": -0.5},
        {"kind": "sgd", "rescale_grad": float("nan")},
        {"kind": "ftrl", "weight_decay": 0.1},
        {"kind": "ftrl", "lr_power": 0.5},
        {"kind": "ftrl", "l1": -1.0},
        {"kind": "ftrl", "learning_rate": 0.0},
        {"kind": "ftrl", "lr_power": -0.7},
        {"kind": "adam", "step_mode": "global"},
        {"kind": "sgd", "formula": "mxnet"},
        {"kind": "adamw", "formula": "mxnet"},
        {"kind": "adagrad", "formula": "mxnet", "lr_decay": 0.1},
        {"kind": "adam", "formula": "keras"},
    ],
    ids=str,
)
def test_bad_optimizer_raises(optimizer):
    with pytest.raises(errors.InvalidArgument) as info:
        _core.Table(4, None, optimizer)
    assert isinstance(info.value, ValueError)
    with pytest.raises(errors.InvalidArgument):
        _core.Optimizer(optimizer)
    with pytest.raises(errors.InvalidArgument):
        reference.ReferenceOptimizer(optimizer)
    table = _core.Table(4, None, {"kind": "sgd"})
    with pytest.raises(errors.InvalidArgument):
        table.set_optimizer(optimizer)


def shape_error_calls(table):
    dim = table.dim
    keys = ids([1, 2])
    good_rows = np.zeros((2, dim), np.float32)
    slots = np.zeros((2, table.num_slots, dim), np.float32)
    steps = np.zeros(2, np.int64)
    return {
        "grads rows": lambda: table.apply_gradients(keys, np.zeros((3, dim), np.float32)),
        "grads cols": lambda: table.apply_gradients(keys, np.zeros((2, dim + 1), np.float32)),
        "grads 1-D": lambda: table.apply_gradients(ids([1]), np.zeros(dim, np.float32)),
        "grads 3-D": lambda: table.apply_gradients(keys, np.zeros((2, dim, 1), np.float32)),
        "assign rows": lambda: table.assign(keys, np.zeros((1, dim), np.float32)),
        "assign 1-D": lambda: table.assign(ids([1]), np.zeros(dim, np.float32)),
        "keys 2-D": lambda: table.lookup(np.zeros((2, 1), np.int64)),
        "out rows": lambda: table.lookup(keys, out=np.zeros((3, dim), np.float32)),
        "out cols": lambda: table.lookup_or_insert(keys, out=np.zeros((2, dim + 1), np.float32)),
        "slots": lambda: table.write_state(
            keys, good_rows, np.zeros((2, table.num_slots + 1, dim), np.float32), steps
        ),
        "steps": lambda: table.write_state(keys, good_rows, slots, np.zeros(3, np.int64)),
    }


SHAPE_CASES = list(shape_error_calls(_core.Table(3, None, {"kind": "adam"})))


@pytest.mark.parametrize("case", SHAPE_CASES)
def test_wrong_shapes_raise_shape_error(case):
    table = _core.Table(3, None, {"kind": "adam"})
    with pytest.raises(errors.ShapeError) as info:
        shape_error_calls(table)[case]()
    assert isinstance(info.value, ValueError)
    assert table.size() == 0


def dtype_error_calls(table):
    dim = table.dim
    keys = ids([1, 2])
    rows = np.zeros((2, dim), np.float32)
    return {
        "float ids lookup": lambda: table.lookup(keys.astype(np.float64)),
        "float ids push": lambda: table.apply_gradients(keys.astype(np.float64), rows),
        "int32 ids": lambda: table.lookup_or_insert(keys.astype(np.int32)),
        "uint64 ids remove": lambda: table.remove(keys.astype(np.uint64)),
        "float64 grads": lambda: table.apply_gradients(keys, rows.astype(np.float64)),
        "float16 values": lambda: table.assign(keys, rows.astype(np.float16)),
        "int out": lambda: table.lookup(keys, out=np.zeros((2, dim), np.int32)),
        "float64 out": lambda: table.lookup(keys, out=np.zeros((2, dim), np.float64)),
        "float ids shard_of": lambda: _core.shard_of(keys.astype(np.float64), 2),
        "float ids plan_batch": lambda: _core.plan_batch(keys.astype(np.float32), 2),
    }


DTYPE_CASES = list(dtype_error_calls(_core.Table(3)))


@pytest.mark.parametrize("case", DTYPE_CASES)
def test_wrong_dtypes_raise_dtype_error(case):
    """A dtype the core does not take raises kvsparse.errors.DTypeError (a TypeError).

    errors.DTypeError exists for exactly this ("e.g. float ids"); habit 3 of
    CONTRIBUTING.md: errors cross the boundary as kvsparse.errors classes.
    """
    table = _core.Table(3)
    with pytest.raises(errors.DTypeError) as info:
        dtype_error_calls(table)[case]()
    assert isinstance(info.value, TypeError)
    assert table.size() == 0


def test_non_contiguous_input_is_read_correctly_or_refused_as_kvsparse_error():
    table = _core.Table(2, {"kind": "constant", "a": 1.0}, {"kind": "sgd", "learning_rate": 1})
    keys = np.arange(10, dtype=np.int64)[::2]
    try:
        table.lookup_or_insert(keys)
    except errors.KVSparseError as exc:
        assert isinstance(exc, (TypeError, ValueError))
    except Exception as exc:  # noqa: BLE001 - the point of the test
        pytest.fail(f"non-contiguous ids raised {type(exc).__name__}, not a kvsparse error: {exc}")
    else:
        assert sorted(table_state(table)[0].tolist()) == [0, 2, 4, 6, 8]


# --------------------------------------------------------------------------
# Non-finite gradients
# --------------------------------------------------------------------------

BAD_VALUES = {
    "nan": np.nan,
    "inf": np.inf,
    "-inf": -np.inf,
}


def populated_pair(optimizer, dim=4):
    table = _core.Table(dim, {"kind": "uniform", "a": -1, "b": 1}, optimizer, seed=4)
    ref = reference.ReferenceTable(dim, {"kind": "uniform", "a": -1, "b": 1}, optimizer, seed=4)
    keys = ids([1, 2, 3, INT64_MIN])
    grads = np.random.default_rng(0).standard_normal((4, dim)).astype(np.float32)
    for pair in (table, ref):
        pair.apply_gradients(keys, grads)
    return table, ref


@pytest.mark.parametrize("bad", list(BAD_VALUES))
@pytest.mark.parametrize("optimizer", [None, {"kind": "adam"}, {"kind": "ftrl"}], ids=str)
def test_nonfinite_gradient_rejects_whole_batch(bad, optimizer):
    dim = 4
    table, ref = populated_pair(optimizer, dim)
    before = table_state(table)
    step_before = table.table_step
    keys = ids([1, 999, 2, 3, 1000])  # 999 and 1000 are new ids
    grads = np.ones((5, dim), np.float32)
    grads[3, 2] = BAD_VALUES[bad]
    with pytest.raises(errors.NonFiniteGradient) as info:
        table.apply_gradients(keys, grads)
    assert isinstance(info.value, ValueError)
    assert "3" in str(info.value)
    with pytest.raises(errors.NonFiniteGradient):
        ref.apply_gradients(keys, grads)
    after = table_state(table)
    for part_before, part_after in zip(before, after):
        np.testing.assert_array_equal(part_before, part_after)
    assert table.table_step == step_before
    assert table.size() == 4
    assert_same_state(table, ref)


def test_gradients_overflowing_when_summed_are_rejected():
    table = _core.Table(2, None, {"kind": "sgd"})
    keys = ids([7, 7])
    grads = np.full((2, 2), 3e38, np.float32)
    with pytest.raises(errors.NonFiniteGradient):
        table.apply_gradients(keys, grads)
    assert table.size() == 0 and table.table_step == 0
    # inf + -inf of duplicates is NaN: rejected too.
    grads = np.array([[np.inf, 0], [-np.inf, 0]], np.float32)
    with pytest.raises(errors.NonFiniteGradient):
        table.apply_gradients(keys, grads)


@pytest.mark.parametrize("bad", list(BAD_VALUES))
@pytest.mark.parametrize("optimizer", [None, {"kind": "adagrad"}, {"kind": "rmsprop"}], ids=str)
def test_nonfinite_gradient_skip_leaves_only_those_rows(bad, optimizer):
    dim = 4
    table, ref = populated_pair(optimizer, dim)
    keys = ids([1, 999, 2, 3, 1000, 3])
    grads = np.random.default_rng(1).standard_normal((6, dim)).astype(np.float32)
    grads[3, 0] = BAD_VALUES[bad]  # id 3: bad in one of its duplicates
    grads[4, dim - 1] = BAD_VALUES[bad]  # id 1000: a new id, bad
    row3_before = table.read_state(ids([3]))
    applied = table.apply_gradients(keys, grads, skip_nonfinite=True)
    assert applied == 3  # 1, 999, 2
    assert ref.apply_gradients(keys, grads, skip_nonfinite=True) == 3
    for part_before, part_after in zip(row3_before, table.read_state(ids([3]))):
        np.testing.assert_array_equal(part_before, part_after)
    assert 1000 not in table_state(table)[0].tolist()
    assert 999 in table_state(table)[0].tolist()
    assert_same_state(table, ref)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_a_stored_rows_nonfinite_gradient_late_in_a_large_push_changes_nothing(clip):
    # A stored row's gradient is checked as the row is updated, thousands of rows into the
    # push here: the rows updated before it are put back, the error names the first bad id
    # in the push's order (the stored 4000, not the new id after it), and clipping does not
    # let an inf through.
    dim = 8
    table = _core.Table(
        dim, {"kind": "uniform", "a": -1, "b": 1}, {"kind": "adagrad", "clip_gradient": clip}
    )
    stored = np.arange(6000, dtype=np.int64)
    table.lookup_or_insert(stored, np.empty((stored.size, dim), np.float32))
    table.apply_gradients(stored, np.ones((stored.size, dim), np.float32))
    before = table_state(table)
    step_before = table.table_step
    keys = np.append(stored, 10**12)
    grads = np.full((keys.size, dim), 0.25, np.float32)
    grads[4000, 3] = np.inf
    grads[-1, 0] = np.nan
    with pytest.raises(errors.NonFiniteGradient, match="id 4000 "):
        table.apply_gradients(keys, grads)
    for part_before, part_after in zip(before, table_state(table)):
        np.testing.assert_array_equal(part_before, part_after)
    assert table.table_step == step_before


def test_a_stored_rows_nonfinite_gradient_is_named_before_a_new_rows_overflow():
    # The new id 77's update overflows (found first: new rows are computed before stored
    # rows are updated); the stored id 5's gradient is NaN: that is the error, as when
    # every gradient was checked before anything else.
    table = _core.Table(2, {"kind": "zeros"}, {"kind": "sgd", "learning_rate": 1e30})
    table.apply_gradients(ids([5]), np.zeros((1, 2), np.float32))
    before = table_state(table)
    grads = np.array([[1e10, 0.0], [np.nan, 0.0]], np.float32)
    with pytest.raises(errors.NonFiniteGradient, match="id 5 "):
        table.apply_gradients(ids([77, 5]), grads)
    with pytest.raises(errors.UpdateOverflow, match="id 77 "):
        table.apply_gradients(ids([77, 5]), np.array([[1e10, 0.0], [1.0, 0.0]], np.float32))
    for part_before, part_after in zip(before, table_state(table)):
        np.testing.assert_array_equal(part_before, part_after)


def test_first_nonfinite_row_and_sum_rows_match_numpy():
    rng = np.random.default_rng(2)
    rows = rng.standard_normal((50, 7)).astype(np.float32)
    assert _core.first_nonfinite_row(rows) == -1
    for bad_row, value in [(49, np.nan), (13, np.inf), (0, -np.inf)]:
        rows[bad_row, 3] = value
        assert _core.first_nonfinite_row(rows) == reference.first_nonfinite_row(rows) == bad_row
    rows = rng.standard_normal((200, 5)).astype(np.float32)
    index = rng.integers(0, 17, size=200)
    expected = np.zeros((17, 5), np.float32)
    np.add.at(expected, index, rows)
    np.testing.assert_allclose(_core.sum_rows(rows, index, 17), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(
        _core.sum_rows(rows, index, 17), reference.sum_rows(rows, index, 17)
    )
    with pytest.raises(errors.InvalidArgument):
        _core.sum_rows(rows, index, 16)


# Values that make sums of a few rows overflow, or sit at the edge of the bound
# sum_rows_checked uses to skip looking at the sums (csrc/batch.cc).
_EDGE_FLOATS = [0.0, -0.0, 1.0, -2.5, 1e-40, 3e38, -3e38, 1.7e38, 2.0**126, 2.0**120, 2.0**100]


@given(
    data=st.data(),
    dim=st.integers(1, 9),
    n=st.integers(0, 40),
    spare=st.integers(0, 3),
    special=st.sampled_from(["none", "edge", "nan", "inf"]),
)
@settings(max_examples=300, deadline=None)
def test_sum_rows_checked_is_sum_rows_then_first_nonfinite_row(data, dim, n, spare, special):
    """The fused check finds exactly what a check of the sums finds (no overflow missed)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    num_unique = max(1, data.draw(st.integers(1, 12))) + spare  # some rows get no input
    index = rng.integers(0, num_unique - spare, size=n)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    if special != "none" and n:
        picks = {"edge": _EDGE_FLOATS, "nan": [np.nan], "inf": [np.inf, -np.inf]}[special]
        for _ in range(data.draw(st.integers(1, 4))):
            value = data.draw(st.sampled_from(_EDGE_FLOATS + picks))
            rows[rng.integers(n), rng.integers(dim)] = value
    expected = reference.sum_rows(rows, index, num_unique)
    summed, bad = _core.sum_rows_checked(rows, index, num_unique)
    np.testing.assert_array_equal(summed, expected)
    assert not np.signbit(summed[expected == 0]).any()  # -0.0 rows sum to +0.0, as zeros + rows
    assert bad == _core.first_nonfinite_row(expected) == reference.first_nonfinite_row(expected)
    np.testing.assert_array_equal(_core.sum_rows(rows, index, num_unique), expected)


def test_sum_rows_checked_finds_an_overflow_of_finite_rows():
    rows = np.full((3, 4), 3e38, np.float32)  # each finite; any two of them sum to inf
    summed, bad = _core.sum_rows_checked(rows, ids([1, 0, 1]), 2)
    assert bad == 1 and np.isinf(summed[1]).all() and np.isfinite(summed[0]).all()
    assert _core.sum_rows_checked(rows, ids([1, 0, 2]), 3)[1] == -1


# --------------------------------------------------------------------------
# Iteration, state and optimizer changes
# --------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_rows", [1, 7, 1000, 65536])
def test_iter_chunks_covers_every_row_exactly_once(chunk_rows):
    dim = 3
    optimizer = {"kind": "rmsprop", "momentum": 0.9, "centered": True}
    table = _core.Table(dim, {"kind": "normal", "b": 1}, optimizer, seed=2)
    ref = reference.ReferenceTable(dim, {"kind": "normal", "b": 1}, optimizer, seed=2)
    rng = np.random.default_rng(chunk_rows)
    keys = np.concatenate([ids(EXTREME_KEYS), rng.integers(-5000, 5000, size=4000)])
    grads = rng.standard_normal((len(keys), dim)).astype(np.float32)
    table.apply_gradients(keys, grads)
    ref.apply_gradients(keys, grads)
    removed = np.ascontiguousarray(keys[::3])
    table.remove(removed)
    ref.remove(removed)
    seen = []
    for chunk_keys, values, slots, steps in table.iter_chunks(chunk_rows):
        assert 0 < len(chunk_keys) <= chunk_rows
        assert values.shape == (len(chunk_keys), dim)
        assert slots.shape == (len(chunk_keys), 3, dim)
        assert steps.shape == (len(chunk_keys),)
        seen.extend(chunk_keys.tolist())
    assert len(seen) == len(set(seen)) == table.size() == ref.size()
    assert set(seen) == set(ref.rows)
    assert_same_state(table, ref)


LARGE_PUSH_OPTIMIZERS = [
    {"kind": "sgd", "learning_rate": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"kind": "adagrad", "learning_rate": 0.1, "lr_decay": 0.01},
    {"kind": "ftrl", "learning_rate": 0.1, "l1": 0.01, "l2": 0.01},
    {"kind": "adam", "learning_rate": 0.01, "step_mode": "table"},
]


@pytest.mark.parametrize("optimizer", LARGE_PUSH_OPTIMIZERS, ids=lambda s: s["kind"])
def test_large_push_with_duplicates_matches_reference_on_every_row(optimizer):
    """A push big enough to be split over threads updates every row exactly once."""
    dim = 8
    n = 60_000
    rng = np.random.default_rng(21)
    keys = np.unique(rng.integers(INT64_MIN, INT64_MAX, size=n, endpoint=True, dtype=np.int64))
    n = len(keys)
    rng.shuffle(keys)
    initializer = {"kind": "uniform", "a": -1, "b": 1}
    table = _core.Table(dim, initializer, optimizer, seed=21)
    # Every row gets the same number of updates, so one flat span models them all.
    ref_optimizer = reference.ReferenceOptimizer(optimizer)
    ref_weights = reference.initial_rows(initializer, keys, dim, seed=21).ravel()
    ref_slots = ref_optimizer.initial_slots(n * dim)
    for step in range(1, 4):
        # Every key twice, the second time in another order: summed before the update.
        permutation = rng.permutation(n)
        batch_keys = np.concatenate([keys, keys[permutation]])
        grads = rng.standard_normal((2 * n, dim)).astype(np.float32)
        summed = grads[:n].copy()
        summed[permutation] += grads[n:]
        assert table.apply_gradients(batch_keys, grads) == n
        ref_optimizer.update(ref_weights, ref_slots, summed.ravel(), step)
    values, slots, steps = table.read_state(keys)
    np.testing.assert_allclose(values, ref_weights.reshape(n, dim), rtol=1e-5, atol=1e-6)
    expected_slots = ref_slots.reshape(-1, n, dim).transpose(1, 0, 2)
    np.testing.assert_allclose(slots, expected_slots, rtol=1e-5, atol=1e-6)
    assert (steps == 3).all() and table.table_step == 3 and table.size() == n


def test_negative_step_counters_are_refused():
    table = _core.Table(2, None, {"kind": "adam"})
    keys = ids([1])
    values = np.zeros((1, 2), np.float32)
    slots = np.zeros((1, 2, 2), np.float32)
    with pytest.raises(errors.InvalidArgument):
        table.write_state(keys, values, slots, ids([-1]))
    assert table.size() == 0


def test_step_counter_does_not_wrap_at_its_largest_stored_value():
    """A row restored with the largest step the table accepts can still be updated.

    If the counter wrapped to 0, Adam's bias correction 1 - beta1**0 would be
    0 and the row would turn into NaN.
    """
    table = _core.Table(2, None, {"kind": "adam", "learning_rate": 0.1})
    keys = ids([1])
    values = np.ones((1, 2), np.float32)
    slots = np.zeros((1, 2, 2), np.float32)
    largest = None
    for candidate in (2**63 - 2, 2**32 - 1, 2**31 - 1):
        try:
            table.write_state(keys, values, slots, ids([candidate]))
        except errors.InvalidArgument:
            continue
        largest = candidate
        break
    assert largest is not None, "write_state refused every large step counter"
    table.apply_gradients(keys, np.ones((1, 2), np.float32))
    new_values, _, steps = table.read_state(keys)
    assert np.isfinite(new_values).all(), (largest, new_values)
    assert steps[0] > largest or steps[0] == largest, (largest, steps)


def test_read_state_write_state_round_trip():
    dim = 5
    optimizer = {"kind": "adam", "learning_rate": 0.05}
    source = _core.Table(dim, {"kind": "uniform", "a": -1, "b": 1}, optimizer, seed=6)
    keys = ids([3, INT64_MAX, -8, 0])
    rng = np.random.default_rng(6)
    for _ in range(4):
        source.apply_gradients(keys, rng.standard_normal((4, dim)).astype(np.float32))
    values, slots, steps = source.read_state(keys)
    assert steps.tolist() == [4, 4, 4, 4]
    target = _core.Table(dim, {"kind": "zeros"}, optimizer)
    target.write_state(keys, values, slots, steps)
    for part, expected in zip(target.read_state(keys), (values, slots, steps)):
        np.testing.assert_array_equal(part, expected)
    grads = rng.standard_normal((4, dim)).astype(np.float32)
    source.apply_gradients(keys, grads)
    target.apply_gradients(keys, grads)
    np.testing.assert_array_equal(source.lookup(keys), target.lookup(keys))


def test_set_optimizer_resets_slots_steps_and_table_step():
    dim = 2
    table = _core.Table(dim, {"kind": "constant", "a": 1}, {"kind": "adam", "step_mode": "table"})
    keys = ids([1, 2])
    table.apply_gradients(keys, np.ones((2, dim), np.float32))
    table.apply_gradients(keys, np.ones((2, dim), np.float32))
    assert table.table_step == 2
    values_before = table.lookup(keys)
    new_optimizer = {"kind": "adagrad", "initial_accumulator_value": 0.25}
    table.set_optimizer(new_optimizer)
    values, slots, steps = table.read_state(keys)
    np.testing.assert_array_equal(values, values_before)
    np.testing.assert_array_equal(slots, np.full((2, 1, dim), 0.25, np.float32))
    assert steps.tolist() == [0, 0] and table.table_step == 0 and table.num_slots == 1
    table.set_optimizer({"kind": "sgd", "momentum": 0.9})
    assert table.num_slots == 1
    table.set_optimizer(None)
    assert table.num_slots == 0
    table.table_step = 41
    assert table.table_step == 41


def test_flat_span_optimizer_matches_reference():
    spec = {"kind": "rmsprop", "momentum": 0.5, "centered": True, "weight_decay": 0.01}
    core_optimizer = _core.Optimizer(spec)
    ref_optimizer = reference.ReferenceOptimizer(spec)
    assert core_optimizer.num_slots == ref_optimizer.num_slots == 3
    rng = np.random.default_rng(3)
    weights = rng.standard_normal(33).astype(np.float32)
    ref_weights = weights.copy()
    slots = core_optimizer.initial_slots(33)
    ref_slots = ref_optimizer.initial_slots(33)
    for step in range(1, 6):
        grad = rng.standard_normal(33).astype(np.float32)
        core_optimizer.update(weights, slots, grad, step)
        ref_optimizer.update(ref_weights, ref_slots, grad, step)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(slots, ref_slots, rtol=1e-5, atol=1e-6)
    with pytest.raises(errors.ShapeError):
        core_optimizer.update(weights, slots, grad[:5], 1)


# --------------------------------------------------------------------------
# Batch planning and hashing
# --------------------------------------------------------------------------


def batch_ids(seed, n=3000):
    rng = np.random.default_rng(seed)
    return np.concatenate(
        [
            rng.integers(INT64_MIN, INT64_MAX, size=n // 3, endpoint=True, dtype=np.int64),
            rng.integers(-50, 50, size=n // 3),
            ids(EXTREME_KEYS * 3),
            rng.integers(0, 1 << 20, size=n // 3),
        ]
    ).astype(np.int64)


def test_unique_inverse_matches_numpy():
    for seed in range(5):
        values = batch_ids(seed)
        unique, inverse = _core.unique_inverse(values)
        np.testing.assert_array_equal(unique[inverse], values)
        numpy_unique, first_index = np.unique(values, return_index=True)
        # Order of first appearance.
        np.testing.assert_array_equal(unique, values[np.sort(first_index)])
        assert len(unique) == len(numpy_unique)
        ref_unique, ref_inverse = reference.unique_inverse(values)
        np.testing.assert_array_equal(unique, ref_unique)
        np.testing.assert_array_equal(inverse, ref_inverse)
    unique, inverse = _core.unique_inverse(ids([]))
    assert unique.shape == (0,) and inverse.shape == (0,)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 8, 64, 1000])
def test_shard_of_matches_reference_hash(num_shards):
    values = batch_ids(num_shards)
    shards = _core.shard_of(values, num_shards)
    np.testing.assert_array_equal(shards, reference.hash_shard_of(values, num_shards))
    assert shards.min() >= 0 and shards.max() < num_shards
    for key in EXTREME_KEYS:
        assert _core.shard_of(ids([key]), num_shards)[0] == reference.hash_shard_of(key, num_shards)


def test_shard_of_huge_shard_count_uses_full_128_bit_product():
    values = batch_ids(9, n=300)
    for num_shards in [(1 << 33) + 7, INT64_MAX]:
        np.testing.assert_array_equal(
            _core.shard_of(values, num_shards), reference.hash_shard_of(values, num_shards)
        )


@pytest.mark.parametrize(
    "boundaries",
    [[0], [-100, 0, 100], [INT64_MIN + 1, INT64_MAX], [-(2**40), 2**40, 2**62]],
    ids=str,
)
def test_range_shard_of_and_plan(boundaries):
    values = np.concatenate([batch_ids(1), ids(boundaries), ids(boundaries) - 1])
    num_shards = len(boundaries) + 1
    shards = _core.shard_of(values, num_shards, boundaries)
    np.testing.assert_array_equal(shards, np.searchsorted(boundaries, values, side="right"))
    np.testing.assert_array_equal(shards, reference.shard_of(values, num_shards, boundaries))
    check_plan(values, num_shards, boundaries)


@pytest.mark.parametrize("boundaries", [[5, 5], [3, 1], [1]], ids=str)
def test_bad_range_partitioner_raises(boundaries):
    with pytest.raises(errors.InvalidArgument):
        _core.shard_of(ids([1]), 3, boundaries)
    with pytest.raises(errors.InvalidArgument):
        _core.plan_batch(ids([1]), 3, boundaries)
    with pytest.raises(errors.InvalidArgument):
        _core.shard_of(ids([1]), 0)


def check_plan(values, num_shards, boundaries=None):
    keys, offsets, slot = _core.plan_batch(values, num_shards, boundaries)
    ref_keys, ref_offsets, ref_slot = reference.plan_batch(values, num_shards, boundaries)
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_array_equal(offsets, ref_offsets)
    np.testing.assert_array_equal(slot, ref_slot)
    # Independent of the reference: the plan's invariants.
    assert offsets[0] == 0 and offsets[-1] == len(keys) == len(np.unique(values))
    assert (np.diff(offsets) >= 0).all()
    np.testing.assert_array_equal(keys[slot], values)
    expected_shards = reference.shard_of(keys, num_shards, boundaries)
    for s in range(num_shards):
        assert (expected_shards[offsets[s] : offsets[s + 1]] == s).all()
    return keys, offsets, slot


@pytest.mark.parametrize("num_shards", [1, 2, 5, 16])
def test_plan_batch_and_gather_from_shards(num_shards):
    dim = 6
    values = batch_ids(num_shards + 100)
    keys, offsets, slot = check_plan(values, num_shards)
    # Each shard "replies" rows derived from its keys; gather puts them back in input order.
    shard_rows = [rows_for(keys[offsets[s] : offsets[s + 1]], dim) for s in range(num_shards)]
    out = np.empty((len(values), dim), np.float32)
    _core.gather_from_shards(shard_rows, offsets, slot, out)
    np.testing.assert_array_equal(out, rows_for(values, dim))

    with pytest.raises(errors.ShapeError):
        _core.gather_from_shards(shard_rows[:-1], offsets, slot, out)
    with pytest.raises(errors.ShapeError):
        _core.gather_from_shards(shard_rows, offsets, slot, out[:-1])
    with pytest.raises(errors.InvalidArgument):
        _core.gather_from_shards(shard_rows, offsets, slot + len(keys), out)


@pytest.mark.parametrize(
    "num_shards,boundaries", [(2, None), (3, None), (16, None), (3, [0, 5000])]
)
def test_plan_batch_of_a_large_batch(num_shards, boundaries):
    """A batch of W1's size, Zipf ids and wide ones, hash and range partitioned."""
    rng = np.random.default_rng(num_shards)
    values = np.concatenate(
        [rng.zipf(1.2, size=70_000) - 3, rng.integers(-(2**62), 2**62, size=30_000)]
    ).astype(np.int64)
    rng.shuffle(values)
    keys, offsets, slot = check_plan(values, num_shards, boundaries)
    dim = 4
    shard_rows = [rows_for(keys[offsets[s] : offsets[s + 1]], dim) for s in range(num_shards)]
    out = np.empty((len(values), dim), np.float32)
    _core.gather_from_shards(shard_rows, offsets, slot, out)
    np.testing.assert_array_equal(out, rows_for(values, dim))


def test_plans_of_batches_in_turn_large_and_small_forget_each_other():
    """The deduplication's scratch set is kept per thread between calls (its slots
    outlived by a generation number), except for a batch of over 2^19 ids, which gets
    its own: batches in turn, sharing ids, each planned as if alone."""
    rng = np.random.default_rng(5)
    pool = rng.integers(-(2**40), 2**40, size=400_000)
    for size in (600_000, 3, 65_536, 1_200_000, 5, 65_536, 0, 17):
        values = rng.choice(pool, size=size)
        check_plan(values, 2, None)


@pytest.mark.parametrize("dim,offset", [(64, 0), (64, 1), (8, 0), (6, 0)])
def test_gather_from_shards_into_a_large_output(dim, offset):
    """An out of 4 MiB and more is written with streaming stores where it is 16-byte
    aligned and rows are whole vectors; misaligned outs and odd dims take the plain copy."""
    n = (5 << 20) // (4 * dim) + 3
    values = np.random.default_rng(dim).integers(0, n // 3, size=n)
    keys, offsets, slot = check_plan(values, 3)
    shard_rows = [rows_for(keys[offsets[s] : offsets[s + 1]], dim) for s in range(3)]
    buffer = np.full(n * dim + 4, -1.0, np.float32)
    out = buffer[offset : offset + n * dim].reshape(n, dim)
    assert (out.ctypes.data % 16 == 0) == (offset == 0)
    _core.gather_from_shards(shard_rows, offsets, slot, out)
    np.testing.assert_array_equal(out, rows_for(values, dim))
    assert (buffer[:offset] == -1).all() and (buffer[offset + n * dim :] == -1).all()


def test_plan_batch_empty_and_all_in_one_shard():
    keys, offsets, slot = _core.plan_batch(ids([]), 4)
    assert keys.shape == (0,) and slot.shape == (0,) and offsets.tolist() == [0] * 5
    # Every id in one shard: the other shards get empty ranges and gather still works.
    values = ids([-3, -2, -3, -1])
    keys, offsets, slot = check_plan(values, 3, [100, 200])
    out = np.empty((4, 2), np.float32)
    shard_rows = [rows_for(keys, 2), np.zeros((0, 2), np.float32), np.zeros((0, 2), np.float32)]
    _core.gather_from_shards(shard_rows, offsets, slot, out)
    np.testing.assert_array_equal(out, rows_for(values, 2))


@pytest.mark.parametrize("num_shards", [2, 3, 7, 16, 64])
@pytest.mark.parametrize(
    "pattern", ["sequential", "negative", "stride_2_32", "stride_1024"], ids=str
)
def test_hash_shards_spread_evenly_over_sequential_ids(num_shards, pattern):
    n = 200_000
    base = np.arange(n, dtype=np.int64)
    values = {
        "sequential": base,
        "negative": -base - 1,
        "stride_2_32": base << 32,
        "stride_1024": base * 1024,
    }[pattern]
    counts = np.bincount(_core.shard_of(values, num_shards), minlength=num_shards)
    expected = n / num_shards
    # A fair hash is within ~6 binomial stddevs; the chi-square stays near its dof.
    stddev = np.sqrt(n * (1 / num_shards) * (1 - 1 / num_shards))
    assert np.abs(counts - expected).max() < 6 * stddev, counts
    chi_square = ((counts - expected) ** 2 / expected).sum()
    assert chi_square < (num_shards - 1) + 6 * np.sqrt(2 * (num_shards - 1)), chi_square


# --------------------------------------------------------------------------
# Memory accounting
# --------------------------------------------------------------------------


MEMORY_SCRIPT = """
import json, os, sys
import numpy as np
from kvsparse import _core


def resident_bytes():
    try:
        import psutil
    except ImportError:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return psutil.Process().memory_info().rss


dim, rows, batch = 64, 420_000, 20_000
out = np.empty((batch, dim), np.float32)
batch_keys = np.empty(batch, np.int64)
rss_before = resident_bytes()
table = _core.Table(dim, {"kind": "constant", "a": 1.0}, {"kind": "adam"})
empty_bytes = table.memory_bytes()
for start in range(0, rows, batch):
    batch_keys[:] = np.arange(start, start + batch, dtype=np.int64) * 7919
    table.lookup_or_insert(batch_keys, out=out)
print(json.dumps({
    "rows": table.size(),
    "dim": dim,
    "counted": table.memory_bytes() - empty_bytes,
    "rss_growth": resident_bytes() - rss_before,
}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS accounting needs Linux")
def test_memory_bytes_matches_resident_growth():
    """memory_bytes() of a table grown to ~340 MB is within 10% of the process's RSS growth.

    Measured in a fresh interpreter, so memory freed by earlier tests (and kept
    by the allocator) cannot hide the table's growth.
    """
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(_core.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    counted, rss_growth = report["counted"], report["rss_growth"]
    # values + exp_avg + exp_avg_sq (float32) + a step counter per row, before buckets.
    lower_bound = report["rows"] * (3 * report["dim"] * 4 + 4)
    assert report["rows"] == 420_000
    assert counted >= lower_bound
    assert counted > 250 * 2**20
    assert abs(rss_growth - counted) <= 0.10 * counted, report


def test_every_table_object_has_its_cpp_table():
    # The C++ table is built in __cinit__, which Table.__new__ runs too (once built in
    # __init__, Table.__new__(Table) had none and len() of it segfaulted). There is no way
    # left to get a Table without one.
    with pytest.raises(TypeError):
        _core.Table.__new__(_core.Table)
    with pytest.raises(errors.InvalidArgument, match="dim"):
        _core.Table.__new__(_core.Table, 0)
    table = _core.Table.__new__(_core.Table, 2)
    assert len(table) == 0
    table.assign(ids([1]), np.ones((1, 2), np.float32))
    np.testing.assert_array_equal(table.lookup(ids([1])), np.ones((1, 2), np.float32))

    class Skipping(_core.Table):
        def __init__(self, dim):  # never calls Table.__init__
            pass

    skipping = Skipping(3)
    assert len(skipping) == 0 and skipping.dim == 3
    assert skipping.memory_bytes() > 0


_OUT_OF_MEMORY = """
import resource, sys
import numpy as np
from kvsparse import _core
ids = np.arange(40_000_000, dtype=np.int64)  # 320 MB, allocated before the limit
with open("/proc/self/statm") as f:
    used = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + (64 << 20), resource.RLIM_INFINITY))
try:
    _core.plan_batch(ids, 2, None)  # its vectors need ~1 GB more: std::bad_alloc
except MemoryError:
    sys.exit(0)
sys.exit(3)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_cpp_allocation_failure_is_a_memory_error_not_an_abort():
    # A C++ exception crossing the Cython boundary without `except +` is std::terminate:
    # the whole process (a server) aborts.
    env = {**os.environ, "KVSPARSE_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _OUT_OF_MEMORY], env=env, capture_output=True, timeout=120
    )
    assert result.returncode == 0, (result.returncode, result.stderr.decode()[-2000:])


def test_push_scratch_is_reused_and_counted():
    """Pushes reuse one scratch buffer (a fresh mapping each push cost ~20% of a warm
    Adagrad push); its bytes are part of memory_bytes()."""
    table = _core.Table(16, {"kind": "zeros"}, {"kind": "adagrad", "learning_rate": 0.1})
    assert table.scratch_bytes() == 0
    keys = np.arange(1000, dtype=np.int64)
    grads = np.ones((1000, 16), np.float32)
    table.apply_gradients(keys, grads)  # all fresh rows
    table.apply_gradients(keys, grads)  # all stored rows
    after_two = table.scratch_bytes()
    assert after_two >= 1000 * 16 * 2 * 4  # the saved values and slots of 1000 rows
    before = table.memory_bytes()
    for _ in range(3):
        table.apply_gradients(keys[:500], grads[:500])
        table.apply_gradients(keys, grads)
    assert table.scratch_bytes() == after_two and table.memory_bytes() == before
    table.apply_gradients(np.arange(5000, dtype=np.int64), np.ones((5000, 16), np.float32))
    assert table.scratch_bytes() > after_two
    assert table.memory_bytes() - table.scratch_bytes() >= 5000 * 16 * 2 * 4
    np.testing.assert_allclose(table.lookup(keys[:1]), table.lookup(keys[1:2]))


def test_prefault_ahead_backs_the_next_inserts_memory_and_changes_nothing():
    """A server's idle-time work: after a push that inserted rows, the rows
    the next inserts will write are backed with memory (the kernel's zeroing done now,
    not in the next push), at most one chunk past the end; no row changes, and the
    tables go on equal to one that never prefaulted. (That it saves time is the
    benchmarks' to show: the resident memory it adds depends on what the allocator
    reuses, so it is not asserted here.)"""
    dim = 64
    optimizer = {"kind": "adagrad", "learning_rate": 0.1}
    init = {"kind": "normal", "a": 0.0, "b": 0.01}
    table, plain = (_core.Table(dim, init, optimizer, seed=3) for _ in range(2))
    rng = np.random.default_rng(0)
    # Past the first chunk (2 MiB of values: 8,192 rows), which still moves as it grows.
    first = rng.integers(0, 2**62, size=20_000)
    grads = rng.standard_normal((first.size, dim)).astype(np.float32)
    for t in (table, plain):
        t.apply_gradients(first, grads)
    state, memory = table_state(table), table.memory_bytes()
    kernel = tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2])
    slices = 0
    while table.prefault_ahead(1 << 20):
        slices += 1
        assert slices < 100
    if kernel >= (5, 14):  # MADV_POPULATE_WRITE
        # Up to 2 x 20,000 new rows, capped at one chunk (8,192 rows) of values and slots.
        assert slices >= 2
    else:
        assert slices == 0  # the kernel refuses: nothing done, nothing changed
    assert table.memory_bytes() - memory <= 2 * (2 << 20) + (1 << 20)
    for before, after in zip(state, table_state(table)):
        np.testing.assert_array_equal(before, after)
    assert not table.prefault_ahead(1 << 20)  # done until the next push inserts rows
    second = np.concatenate([first[:5000], rng.integers(0, 2**62, size=30_000)])
    grads = rng.standard_normal((second.size, dim)).astype(np.float32)
    for t in (table, plain):
        t.apply_gradients(second, grads)
    while table.prefault_ahead(1 << 20):
        pass
    third = rng.integers(0, 2**62, size=9_000)
    for t in (table, plain):
        t.apply_gradients(third, np.ones((third.size, dim), np.float32))
    for mine, theirs in zip(table_state(table), table_state(plain)):
        np.testing.assert_array_equal(mine, theirs)


def test_prefault_ahead_leaves_a_table_within_its_first_chunk_alone():
    """A table of fewer rows than a chunk (8,192 at dim 64) keeps its small first chunk:
    nothing is backed ahead, and its memory does not grow."""
    table = _core.Table(64, {"kind": "zeros"}, {"kind": "adagrad", "learning_rate": 0.1})
    keys = np.arange(5000, dtype=np.int64)
    table.apply_gradients(keys, np.ones((keys.size, 64), np.float32))
    memory = table.memory_bytes()
    assert not table.prefault_ahead(1 << 20)
    assert table.memory_bytes() == memory
