"""Tables larger than their memory budget: the disk tier keeps every operation exact.

A tiered table (``_core.Table(..., budget=MemoryBudget(...), spill_dir=...)``) moves its
coldest rows to disk when the shard's budget is reached and reads them back when a pull or
a push touches them. Nothing of that may show: every test here runs the same operations on
a tiered table and on the same table with no budget (all in RAM) and requires the same
bytes from both (rows, optimizer slots, step counters, the table step), and checks a sample
of rows against the NumPy reference model (tests/reference.py): bit for bit where the
optimizer's formula is only arithmetic and sqrt, else to the reference's documented
tolerance (libm's last ulp in pow).

Layers: the core through its Cython wrapper (eviction and reload cycles under every
optimizer, random operation sequences, admission/eviction policies, 16-bit tables, the
budget's accounting and tier_stats, a full disk, a corrupted record, the budget without a
disk tier); the store (``kvsparse.create('local', memory_budget=, spill_dir=)``: save,
restore, reshard 2 -> 3, export); real servers (``--memory-budget`` refusing and serving
on, ``kvsparse launch --restart-servers`` after a kill -9 of a tiered server).
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import reference
from conftest import REPO_ROOT, ServerProcess, subprocess_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvsparse
from kvsparse import _core, errors, optimizers

KiB = 1 << 10
MiB = 1 << 20

# The eviction/reload test: a budget of a few MiB, rows wide enough that the in-RAM index of
# every id (about 27 bytes per id on disk) takes a small part of it, and a table 50 times
# the budget.
BUDGET = 2 * MiB
WIDE_DIM = 1024
BATCH = 24  # ids per push: its rows, scratch and records in transit (3 x 24 x 16 KiB for
# centered RMSProp with momentum) stay inside the budget
SIZE_FACTOR = 50
# What budget.used() may exceed the limit by after an operation. The contract allows none.
BUDGET_SLACK = 0
# Against the NumPy reference: bit for bit where an optimizer's formula is only +, -, *, /
# and sqrt (IEEE rounds those exactly, in NumPy as in C++); elsewhere (pow in Adam's bias
# corrections and FTRL's lr_power) the reference's documented tolerance for libm's last ulp.
EXACT_KINDS = (None, "sgd", "adagrad", "rmsprop")
RTOL = 1e-5
ATOL = 1e-6

# The run files of the disk tier (csrc/run_store_internal.h): a 64-byte header holding
# record_bytes, page_bytes and records per page at offset 8, then pages of
# crc32c | count | count x (key | record).
RUN_HEADER_BYTES = 64  # csrc/run_store_internal.h: the run file format
PAGE_HEADER_BYTES = 8

NORMAL = {"kind": "normal", "a": 0.0, "b": 0.1}

# Every optimizer the core has (tests/reference.py covers each), with their options on.
OPTIMIZERS = {
    "none": None,  # no optimizer: a push replaces the row
    "sgd": {"kind": "sgd", "learning_rate": 0.1},
    "sgd-nesterov": {
        "kind": "sgd",
        "learning_rate": 0.05,
        "momentum": 0.9,
        "nesterov": True,
        "weight_decay": 0.01,
    },
    "adagrad": {
        "kind": "adagrad",
        "learning_rate": 0.1,
        "initial_accumulator_value": 0.1,
        "lr_decay": 0.01,
    },
    "adagrad-mxnet": {"kind": "adagrad", "learning_rate": 0.1, "formula": "mxnet"},
    "adam": {"kind": "adam", "learning_rate": 0.01, "weight_decay": 0.01},
    "adam-mxnet-table-step": {
        "kind": "adam",
        "learning_rate": 0.01,
        "formula": "mxnet",
        "step_mode": "table",
    },
    "adamw": {"kind": "adamw", "learning_rate": 0.01, "weight_decay": 0.1, "clip_gradient": 1.0},
    "rmsprop": {"kind": "rmsprop", "learning_rate": 0.01, "centered": True, "momentum": 0.5},
    "ftrl": {"kind": "ftrl", "learning_rate": 0.1, "l1": 0.01, "l2": 0.01, "beta": 0.5},
}


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def num_slots_of(optimizer) -> int:
    return _core.Optimizer(optimizer).num_slots


def row_bytes_of(dim: int, optimizer) -> int:
    """Bytes of one float32 row and its optimizer slots."""
    return 4 * dim * (1 + num_slots_of(optimizer))


def make_pair(tmp_path, dim, optimizer, limit, *, initializer=NORMAL, seed=7, name="emb", **kw):
    """(tiered table, its budget, the same table all in RAM)."""
    budget = _core.MemoryBudget(limit)
    tiered = _core.Table(
        dim,
        initializer,
        optimizer,
        seed,
        budget=budget,
        spill_dir=str(tmp_path / f"spill-{name}"),
        name=name,
        **kw,
    )
    in_ram = _core.Table(dim, initializer, optimizer, seed, **kw)
    return tiered, budget, in_ram


def full_state(table):
    """(keys, values, slots, steps) of every row, sorted by key, through the checkpoint scan."""
    chunks = list(table.iter_chunks(997))
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


def assert_equal(got, want, context=""):
    """np.testing.assert_array_equal, its slow report only for a difference."""
    if not np.array_equal(got, want):
        np.testing.assert_array_equal(got, want, err_msg=context)


def assert_same_tables(tiered, in_ram, context=""):
    """Exact equality of every row, slot and step, the table step and the change tracking.

    The tiered table's checkpoint scan (both tiers) is compared chunk by chunk with the RAM
    table's point reads, so that a table of a few hundred MiB is never held twice.
    """
    assert len(tiered) == len(in_ram), context
    assert tiered.table_step == in_ram.table_step, context
    scanned = []
    for keys, values, slots, steps in tiered.iter_chunks(4096):
        scanned.append(keys)
        ram_values, ram_slots, ram_steps = in_ram.read_state(keys)  # raises for a stray key
        assert_equal(values, ram_values, context)
        assert_equal(slots, ram_slots, context)
        assert_equal(steps, ram_steps, context)
    # And the pull path, on a part of each chunk: after the scan, since a pull brings rows
    # back from disk (the table must not change while a scan runs).
    for keys in scanned:
        sample = keys[::7]
        assert_equal(tiered.lookup(sample), in_ram.lookup(sample), context)
    scanned = np.sort(np.concatenate([np.zeros(0, np.int64), *scanned]))
    assert_equal(scanned, np.unique(scanned), f"{context}: twice")
    assert len(scanned) == len(in_ram), context
    changed = np.sort(np.concatenate([np.zeros(0, np.int64), *tiered.changed_keys(0)]))
    ram_changed = np.sort(np.concatenate([np.zeros(0, np.int64), *in_ram.changed_keys(0)]))
    assert_equal(changed, ram_changed, context)


def check_budget(tiered, budget, context=""):
    """The budget holds and tier_stats adds up; returns tier_stats."""
    stats = tiered.tier_stats()
    assert budget.used() <= budget.limit + BUDGET_SLACK, (context, budget.used(), stats)
    assert stats["memory_budget"] == budget.limit, context
    assert stats["memory_bytes"] <= budget.used(), (context, stats)
    assert stats["rows_in_memory"] + stats["rows_on_disk"] == len(tiered), (context, stats)
    assert stats["disk_hits"] <= stats["row_lookups"], (context, stats)
    assert stats["rows_on_disk"] <= stats["evictions"], (context, stats)
    return stats


class SampledReference:
    """The NumPy reference model of a sample of a table's ids.

    Rows are independent of one another, so the sample's rows evolve as they do in the
    whole table; only the table step (step_mode "table") depends on the pushes that hold
    none of them, and it is counted here.
    """

    def __init__(self, sample, dim, initializer, optimizer, seed):
        self.sample = np.array(sorted(set(int(k) for k in sample)), dtype=np.int64)
        self.table = reference.ReferenceTable(dim, initializer, optimizer, seed)
        exact = (optimizer or {}).get("kind") in EXACT_KINDS
        self.rtol, self.atol = (0.0, 0.0) if exact else (RTOL, ATOL)

    def _mask(self, keys):
        return (np.asarray(keys)[:, None] == self.sample[None, :]).any(axis=1)

    def apply_gradients(self, keys, grads):
        mask = self._mask(keys)
        if mask.any():
            self.table.apply_gradients(keys[mask], grads[mask])
        elif len(keys):
            self.table.table_step += 1

    def assign(self, keys, values):
        mask = self._mask(keys)
        self.table.assign(keys[mask], values[mask])

    def remove(self, keys):
        self.table.remove(keys[self._mask(keys)])

    def lookup_or_insert(self, keys):
        self.table.lookup_or_insert(keys[self._mask(keys)])

    def write_state(self, keys, values, slots, steps):
        mask = self._mask(keys)
        self.table.write_state(keys[mask], values[mask], slots[mask], steps[mask])

    def check(self, table, context=""):
        np.testing.assert_allclose(
            table.lookup(self.sample),
            self.table.lookup(self.sample),
            rtol=self.rtol,
            atol=self.atol,
            err_msg=context,
        )
        stored = self.table.keys()
        values, slots, steps = table.read_state(stored)
        ref_values, ref_slots, ref_steps = self.table.read_state(stored)
        tolerance = {"rtol": self.rtol, "atol": self.atol, "err_msg": context}
        np.testing.assert_allclose(values, ref_values, **tolerance)
        np.testing.assert_allclose(slots, ref_slots, **tolerance)
        np.testing.assert_array_equal(steps, ref_steps, err_msg=context)
        assert table.table_step == self.table.table_step, context


def run_files(spill_dir) -> list[Path]:
    return sorted(Path(spill_dir).rglob("run-*.kvr"))


def run_pages(path: Path):
    """(page offset, [(key, entry offset)...]) of every page of a run file."""
    data = path.read_bytes()
    record_bytes, page_bytes, _ = struct.unpack_from("<QQQ", data, 8)
    entry_bytes = 8 + record_bytes
    for offset in range(RUN_HEADER_BYTES, len(data) - page_bytes + 1, page_bytes):
        (count,) = struct.unpack_from("<I", data, offset + 4)
        entries = []
        for e in range(count):
            at = offset + PAGE_HEADER_BYTES + e * entry_bytes
            entries.append((struct.unpack_from("<q", data, at)[0], at))
        yield offset, entries


def records_of(key: int, spill_dir) -> list[tuple[Path, int, int]]:
    """(file, page offset, entry offset) of every copy of key in the run files (a row
    taken back into memory leaves a dead copy until a merge drops it)."""
    found = []
    for path in run_files(spill_dir):
        for page, entries in run_pages(path):
            found.extend((path, page, at) for stored, at in entries if stored == key)
    return found


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x40]))


def spread_ids(rng, n):
    """n distinct ids over the whole int64 range (negative ones too)."""
    ids = rng.choice(np.iinfo(np.int64).max // 2, size=n, replace=False).astype(np.int64)
    return ids * np.where(rng.random(n) < 0.5, -2, 2) + 1


# ---------------------------------------------------------------------------
# Eviction and reload cycles under every optimizer, against the RAM table and the
# reference; the budget and tier_stats after every step
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_table_fifty_times_its_budget_is_exact_under_every_optimizer(tmp_path, name):
    optimizer = OPTIMIZERS[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    dim = WIDE_DIM
    row_bytes = row_bytes_of(dim, optimizer)
    n = math.ceil(SIZE_FACTOR * BUDGET / row_bytes)
    tiered, budget, in_ram = make_pair(tmp_path, dim, optimizer, BUDGET)
    ids = spread_ids(rng, n)
    never_stored = spread_ids(rng, 2 * BATCH)
    never_stored = never_stored[~np.isin(never_stored, ids)]
    sample = np.concatenate([ids[:8], ids[n // 2 : n // 2 + 8], ids[-8:], never_stored[:4]])
    ref = SampledReference(sample, dim, NORMAL, optimizer, 7)
    gradient_pool = rng.standard_normal((256, dim), np.float32)  # rows drawn from it per push

    def push(keys, scale=1.0):
        grads = gradient_pool[rng.integers(0, len(gradient_pool), len(keys))] * np.float32(scale)
        try:
            applied = in_ram.apply_gradients(keys, grads)
        except errors.UpdateOverflow:
            # A push whose update overflows float32 applies nothing, in either tier.
            with pytest.raises(errors.UpdateOverflow):
                tiered.apply_gradients(keys, grads)
            return
        assert tiered.apply_gradients(keys, grads) == applied
        ref.apply_gradients(keys, grads)

    # Insert every id, oldest first: all but the last few MiB go to disk.
    for start in range(0, n, BATCH):
        push(ids[start : start + BATCH])
        check_budget(tiered, budget, f"insert at {start}")
    stats = check_budget(tiered, budget)
    assert stats["rows_on_disk"] > 0.9 * n, stats
    assert stats["rows_in_memory"] * row_bytes <= BUDGET, stats
    assert stats["disk_bytes"] >= stats["rows_on_disk"] * row_bytes, stats
    assert stats["bytes_written"] >= stats["evictions"] * row_bytes, stats
    ref.check(tiered, "after the inserts")

    # Reload cycles: Zipf-hot and uniform ids (duplicates included), pulls of stored and
    # never stored ids, assign / remove / lookup_or_insert / write_state on both tiers.
    for step in range(40):
        hot = ids[np.minimum(rng.zipf(1.1, BATCH // 2) - 1, n - 1)]
        cold = ids[rng.integers(0, n, BATCH // 2)]
        keys = np.concatenate([hot, cold, sample[rng.integers(0, len(sample), 2)]])
        push(keys, scale=[0.01, 1.0, 30.0][step % 3])
        pulled = np.concatenate([ids[rng.integers(0, n, BATCH)], never_stored[:3]])
        np.testing.assert_array_equal(tiered.lookup(pulled), in_ram.lookup(pulled))
        if step % 4 == 1:
            chosen = np.concatenate([ids[rng.integers(0, n, 8)], sample[:2], never_stored[4:6]])
            values = rng.uniform(-3, 3, size=(len(chosen), dim)).astype(np.float32)
            tiered.assign(chosen, values)
            in_ram.assign(chosen, values)
            ref.assign(chosen, values)
        if step % 4 == 2:
            chosen = np.concatenate([ids[rng.integers(0, n, 8)], sample[8:10], never_stored[6:8]])
            assert tiered.remove(chosen) == in_ram.remove(chosen)
            ref.remove(chosen)
            chosen = np.concatenate([chosen[:4], ids[rng.integers(0, n, 4)], never_stored[8:10]])
            np.testing.assert_array_equal(
                tiered.lookup_or_insert(chosen), in_ram.lookup_or_insert(chosen)
            )
            ref.lookup_or_insert(chosen)
        if step % 4 == 3:
            chosen = np.unique(np.concatenate([ids[rng.integers(0, n, 8)], sample[16:18]]))
            values = rng.uniform(-3, 3, size=(len(chosen), dim)).astype(np.float32)
            slots = rng.uniform(0, 2, size=(len(chosen), in_ram.num_slots, dim))
            steps = rng.integers(0, 1000, size=len(chosen))
            tiered.write_state(chosen, values, slots.astype(np.float32), steps)
            in_ram.write_state(chosen, values, slots.astype(np.float32), steps)
            ref.write_state(chosen, values, slots.astype(np.float32), steps)
        check_budget(tiered, budget, f"step {step}")
        if step % 10 == 9:
            ref.check(tiered, f"step {step}")
    stats = check_budget(tiered, budget)
    assert stats["rows_read"] > 0 and stats["disk_hits"] > 0, stats
    assert stats["rows_on_disk"] > 0.9 * len(tiered), stats
    ref.check(tiered, "at the end")
    assert_same_tables(tiered, in_ram)


@st.composite
def small_optimizers(draw):
    return draw(st.sampled_from([v for k, v in OPTIMIZERS.items() if k != "adagrad-mxnet"]))


# Ids 0..599 and a few far ones: 300 KiB (no optimizer) to 1.2 MiB (two slots) at dim 128,
# against a budget of 192 KiB; requests of up to 24 ids.
POOL = 600
# 24 rows of dim 128 with three slots (RMSprop, centered, momentum) need ~180 KiB; the
# disk tier keeps its read buffer and a run's index beside them (~16 KiB here).
SMALL_BUDGET = 224 * KiB
POOL_KEYS = st.integers(0, POOL - 1) | st.sampled_from([-(2**63), -1, 2**40, 2**63 - 1])
KEY_LISTS = st.lists(POOL_KEYS, max_size=24)
SMALL_OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), KEY_LISTS, st.booleans()),
        st.tuples(st.just("insert_range"), st.integers(0, POOL - 24), st.booleans()),
        st.tuples(st.just("lookup"), KEY_LISTS),
        st.tuples(st.just("lookup_or_insert"), KEY_LISTS),
        st.tuples(st.just("assign"), KEY_LISTS),
        st.tuples(st.just("remove"), KEY_LISTS),
        st.tuples(st.just("write_state"), KEY_LISTS),
        st.tuples(st.just("read_state"), KEY_LISTS),
        st.tuples(st.just("set_optimizer"), small_optimizers()),
    ),
    min_size=1,
    max_size=30,
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(optimizer=small_optimizers(), operations=SMALL_OPERATIONS, seed=st.integers(0, 2**32 - 1))
def test_random_operations_on_a_tiered_table_equal_the_ram_table(
    tmp_path_factory, optimizer, operations, seed
):
    dim = 128
    rng = np.random.default_rng(seed)
    spill = tmp_path_factory.mktemp("tiny")
    tiered, budget, in_ram = make_pair(spill, dim, optimizer, SMALL_BUDGET)
    # Fill the budget first, so that every operation below meets both tiers.
    fill = np.arange(POOL, dtype=np.int64)
    for start in range(0, POOL, 20):
        grads = rng.standard_normal((20, dim)).astype(np.float32)
        tiered.apply_gradients(fill[start : start + 20], grads)
        in_ram.apply_gradients(fill[start : start + 20], grads)
    assert check_budget(tiered, budget)["rows_on_disk"] > 0
    for index, operation in enumerate(operations):
        context = f"operation {index}: {operation[0]}"
        name = operation[0]
        if name == "insert_range":
            keys = np.arange(operation[1], operation[1] + 24, dtype=np.int64) + POOL
        elif name != "set_optimizer":
            keys = np.array(operation[1], dtype=np.int64)
        if name in ("push", "insert_range"):
            grads = rng.standard_normal((len(keys), dim)).astype(np.float32)
            skip = operation[2]
            if skip and len(keys):
                grads[rng.integers(len(keys)), rng.integers(dim)] = np.nan
            try:
                expected = in_ram.apply_gradients(keys, grads, skip_nonfinite=skip)
            except (errors.NonFiniteGradient, errors.UpdateOverflow) as refused:
                # Refused as a whole (a NaN, or an update that overflows float32 from
                # written state): the tiered table refuses it too and applies nothing.
                with pytest.raises(type(refused)):
                    tiered.apply_gradients(keys, grads, skip_nonfinite=skip)
            else:
                assert tiered.apply_gradients(keys, grads, skip_nonfinite=skip) == expected
        elif name == "lookup":
            np.testing.assert_array_equal(tiered.lookup(keys), in_ram.lookup(keys), context)
        elif name == "lookup_or_insert":
            np.testing.assert_array_equal(
                tiered.lookup_or_insert(keys), in_ram.lookup_or_insert(keys), context
            )
        elif name == "assign":
            values = rng.uniform(-3, 3, size=(len(keys), dim)).astype(np.float32)
            tiered.assign(keys, values)
            in_ram.assign(keys, values)
        elif name == "remove":
            assert tiered.remove(keys) == in_ram.remove(keys), context
        elif name == "write_state":
            values = rng.uniform(-3, 3, size=(len(keys), dim)).astype(np.float32)
            slots = rng.uniform(0, 2, size=(len(keys), in_ram.num_slots, dim)).astype(np.float32)
            steps = rng.integers(0, 100, size=len(keys)).astype(np.int64)
            tiered.write_state(keys, values, slots, steps)
            in_ram.write_state(keys, values, slots, steps)
        elif name == "read_state":
            held = set(full_state(in_ram)[0].tolist())
            stored = np.array([k for k in keys.tolist() if k in held], dtype=np.int64)
            for got, want in zip(tiered.read_state(stored), in_ram.read_state(stored)):
                np.testing.assert_array_equal(got, want, context)
        elif name == "set_optimizer":
            # Resets the slots and steps of every row, those on disk too.
            tiered.set_optimizer(operation[1])
            in_ram.set_optimizer(operation[1])
        check_budget(tiered, budget, context)
    assert_same_tables(tiered, in_ram)


POLICIES = {
    "lru-max-rows": {"max_rows": 900, "eviction": "lru"},
    "lfu-max-rows": {"max_rows": 900, "eviction": "lfu"},
    "ttl": {"ttl_steps": 12, "evict_every": 5},
    "admission": {"min_count": 2},
}
# Tables their policy bounds (max_rows, ttl_steps) keep every row in memory: the policy is
# their limit, and they count against the budget like any table.
BOUNDED = {"lru-max-rows", "lfu-max-rows", "ttl"}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_admission_and_eviction_policies_with_a_disk_tier(tmp_path, policy):
    """The policy's own eviction (max_rows, TTL) and admission (min_count) decide which
    rows exist; the disk tier only where they live: the same rows, counters and candidates.
    A table bounded by its policy never spills."""
    dim = 256
    optimizer = OPTIMIZERS["adagrad"]
    limit = 4 * MiB if policy in BOUNDED else 512 * KiB
    tiered, budget, in_ram = make_pair(tmp_path, dim, optimizer, limit, policy=POLICIES[policy])
    rng = np.random.default_rng(5)
    for step in range(60):
        keys = np.concatenate([rng.integers(0, 3000, 40), rng.zipf(1.2, 24) - 1])
        grads = rng.standard_normal((len(keys), dim)).astype(np.float32)
        assert tiered.apply_gradients(keys, grads) == in_ram.apply_gradients(keys, grads)
        if step % 7 == 0:
            pulled = rng.integers(0, 3000, 64)
            np.testing.assert_array_equal(tiered.lookup(pulled), in_ram.lookup(pulled))
        if step == 30:
            assert tiered.evict_expired() == in_ram.evict_expired()
        check_budget(tiered, budget, f"step {step}")
    if policy in BOUNDED:
        assert tiered.tier_stats()["rows_on_disk"] == 0
    else:
        assert tiered.tier_stats()["rows_on_disk"] > 0
    assert_same_tables(tiered, in_ram)
    assert tiered.policy_stats() == in_ram.policy_stats()
    for got, want in zip(tiered.candidates(), in_ram.candidates()):
        np.testing.assert_array_equal(np.sort(got), np.sort(want))
    if in_ram.tracks_row_meta:
        keys = full_state(in_ram)[0]
        for got, want in zip(tiered.read_row_meta(keys), in_ram.read_row_meta(keys)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sixteen_bit_tables_spill_and_come_back_bit_for_bit(tmp_path, dtype):
    dim = 512
    optimizer = OPTIMIZERS["adam"]
    tiered, budget, in_ram = make_pair(
        tmp_path, dim, optimizer, 1 * MiB, dtype=dtype, slot_dtype=dtype
    )
    rng = np.random.default_rng(11)
    for step in range(80):
        keys = np.concatenate([np.arange(step * 24, step * 24 + 24), rng.integers(0, 2000, 8)])
        grads = rng.standard_normal((len(keys), dim)).astype(np.float32)
        assert tiered.apply_gradients(keys, grads) == in_ram.apply_gradients(keys, grads)
        check_budget(tiered, budget, f"step {step}")
    assert tiered.tier_stats()["rows_on_disk"] > 0
    assert_same_tables(tiered, in_ram)


def test_tier_stats_count_what_moved(tmp_path):
    dim = 512
    optimizer = OPTIMIZERS["adagrad"]
    row_bytes = row_bytes_of(dim, optimizer)
    tiered, budget, in_ram = make_pair(tmp_path, dim, optimizer, 1 * MiB)
    empty = tiered.tier_stats()
    assert empty["rows_in_memory"] == empty["rows_on_disk"] == 0
    assert empty["evictions"] == empty["bytes_written"] == empty["bytes_read"] == 0
    n = 2000  # ~8 MiB of rows and slots
    keys = np.arange(n, dtype=np.int64)
    rng = np.random.default_rng(3)
    for start in range(0, n, 50):
        grads = rng.standard_normal((50, dim)).astype(np.float32)
        tiered.apply_gradients(keys[start : start + 50], grads)
        in_ram.apply_gradients(keys[start : start + 50], grads)
    before = check_budget(tiered, budget)
    assert before["rows_on_disk"] > 0 and before["rows_in_memory"] > 0, before
    assert before["evictions"] >= before["rows_on_disk"], before
    assert before["bytes_written"] >= before["rows_on_disk"] * row_bytes, before
    assert before["disk_index_bytes"] > 0, before
    assert before["row_lookups"] == 0 or before["disk_hits"] <= before["row_lookups"], before
    # One pull of every id, each once: each is a lookup of a stored id; every row on disk
    # when it is asked for (at least those on disk now) is a disk hit, and read (a pull
    # reads through: it need not bring the row back into memory).
    for start in range(0, n, 50):
        part = keys[start : start + 50]
        np.testing.assert_array_equal(tiered.lookup(part), in_ram.lookup(part))
        check_budget(tiered, budget)
    after = check_budget(tiered, budget)
    assert after["row_lookups"] - before["row_lookups"] == n, (before, after)
    hits = after["disk_hits"] - before["disk_hits"]
    assert before["rows_on_disk"] <= hits <= n, (before, after)
    assert after["rows_read"] - before["rows_read"] <= hits, (before, after)
    assert after["bytes_read"] - before["bytes_read"] >= hits * row_bytes, (before, after)
    assert len(tiered) == n


# ---------------------------------------------------------------------------
# Ids never stored cost no disk read
# ---------------------------------------------------------------------------


def test_lookups_of_ids_never_stored_read_nothing_from_disk(tmp_path):
    dim = 512
    optimizer = OPTIMIZERS["adam"]
    tiered, budget, in_ram = make_pair(tmp_path, dim, optimizer, 1 * MiB)
    rng = np.random.default_rng(8)
    stored = np.arange(0, 3000, 3, dtype=np.int64)  # 1000 rows, ~6 MiB
    for start in range(0, len(stored), 40):
        grads = rng.standard_normal((40, dim)).astype(np.float32)
        tiered.apply_gradients(stored[start : start + 40], grads)
        in_ram.apply_gradients(stored[start : start + 40], grads)
    before = check_budget(tiered, budget)
    assert before["rows_on_disk"] > 0, before
    never = np.concatenate([np.arange(1, 3000, 3), [-5, 2**62, -(2**63)]]).astype(np.int64)
    for start in range(0, len(never), 100):
        part = never[start : start + 100]
        np.testing.assert_array_equal(tiered.lookup(part), tiered.initial_values(part))
    after = check_budget(tiered, budget)
    for counter in ("bytes_read", "rows_read", "disk_hits", "row_lookups", "rows_on_disk"):
        assert after[counter] == before[counter], (counter, before, after)
    assert len(tiered) == len(stored)
    assert_same_tables(tiered, in_ram)


# ---------------------------------------------------------------------------
# A budget without a disk tier refuses the insert that would pass it
# ---------------------------------------------------------------------------


def test_a_budget_without_spill_dir_refuses_the_insert_that_would_pass_it():
    dim = 256
    optimizer = OPTIMIZERS["adam"]
    limit = 1 * MiB
    budget = _core.MemoryBudget(limit)
    table = _core.Table(dim, NORMAL, optimizer, 3, budget=budget, name="user")
    in_ram = _core.Table(dim, NORMAL, optimizer, 3)
    rng = np.random.default_rng(1)
    refused_batch = None
    for batch in range(200):
        keys = np.arange(batch * 20, batch * 20 + 20, dtype=np.int64)
        grads = rng.standard_normal((20, dim)).astype(np.float32)
        try:
            table.apply_gradients(keys, grads)
        except errors.LimitExceeded as error:
            refused_batch, refused = (keys, grads), error
            break
        in_ram.apply_gradients(keys, grads)
        assert budget.used() <= limit + BUDGET_SLACK
    assert refused_batch is not None, "1 MiB held 200 batches of 20 Adam rows of dim 256"
    message = str(refused)
    assert "user" in message, message
    assert "--memory-budget" in message and "--spill-dir" in message, message
    assert str(limit) in message or "1.0 MiB" in message or "1 MiB" in message, message
    assert isinstance(refused, errors.KVSparseError)
    # Nothing of the refused batch is applied; every row admitted before is intact.
    assert_same_tables(table, in_ram)
    assert budget.used() <= limit + BUDGET_SLACK
    # The other ways of inserting are refused the same way (200 new rows: more than the
    # refused push needed), and apply nothing either.
    keys, grads = refused_batch
    many = np.arange(-200, 0, dtype=np.int64)
    values = rng.uniform(-1, 1, (len(many), dim)).astype(np.float32)
    slots = np.zeros((len(many), table.num_slots, dim), np.float32)
    for insert in (
        lambda: table.lookup_or_insert(many),
        lambda: table.assign(many, values),
        lambda: table.write_state(many, values, slots, np.ones(len(many), np.int64)),
    ):
        with pytest.raises(errors.LimitExceeded):
            insert()
        assert_same_tables(table, in_ram)
    # The table goes on: pulls, and pushes to rows it holds (their scratch is there).
    old = np.arange(0, 4, dtype=np.int64)
    np.testing.assert_array_equal(table.lookup(keys), in_ram.lookup(keys))
    old_grads = rng.standard_normal((4, dim)).astype(np.float32)
    table.apply_gradients(old, old_grads)
    in_ram.apply_gradients(old, old_grads)
    # Room made by removing rows (100 rows; the refused push needed 20) lets it in.
    assert table.remove(np.arange(0, 100)) == in_ram.remove(np.arange(0, 100)) == 100
    table.apply_gradients(keys, grads)
    in_ram.apply_gradients(keys, grads)
    assert_same_tables(table, in_ram)
    assert budget.used() <= limit + BUDGET_SLACK


def test_one_budget_is_shared_by_a_shards_tables_and_its_other_memory():
    budget = _core.MemoryBudget(1 * MiB)
    first = _core.Table(256, NORMAL, None, 0, budget=budget, name="first")
    second = _core.Table(256, NORMAL, None, 0, budget=budget, name="second")
    ones = np.ones((100, 256), np.float32)
    first.apply_gradients(np.arange(100), ones)  # ~100 KiB
    budget.set_other_bytes(budget.limit - budget.used() - 50 * KiB)
    with pytest.raises(errors.LimitExceeded, match="second"):
        second.apply_gradients(np.arange(100), ones)
    assert len(second) == 0 and second.table_step == 0
    assert budget.used() <= budget.limit + BUDGET_SLACK
    budget.set_other_bytes(0)
    second.apply_gradients(np.arange(100), ones)
    assert len(second) == 100
    del first
    # A freed table gives its share back.
    assert budget.used() == second.tier_stats()["memory_bytes"]


def test_a_single_batch_larger_than_the_budget_is_refused_even_with_a_disk_tier(tmp_path):
    tiered, budget, in_ram = make_pair(tmp_path, 1024, OPTIMIZERS["adam"], 1 * MiB)
    keys = np.arange(200, dtype=np.int64)  # 2.4 MiB of rows and slots in one push
    with pytest.raises(errors.LimitExceeded):
        tiered.apply_gradients(keys, np.ones((200, 1024), np.float32))
    assert len(tiered) == 0 and tiered.table_step == 0
    # Smaller batches of the same ids go through, most of them to disk.
    for start in range(0, 200, 20):
        grads = np.ones((20, 1024), np.float32)
        tiered.apply_gradients(keys[start : start + 20], grads)
        in_ram.apply_gradients(keys[start : start + 20], grads)
    assert tiered.tier_stats()["rows_on_disk"] > 0
    assert_same_tables(tiered, in_ram)


# ---------------------------------------------------------------------------
# The budget's count after every operation, refused and failed ones included
# ---------------------------------------------------------------------------


def assert_count_exact(budget, *tables, context=""):
    """The budget counts what the tables hold now, to the byte: no operation left it stale."""
    held = sum(table.tier_stats()["memory_bytes"] for table in tables)
    assert budget.used() == held, (context, budget.used(), held)


def _write_state(table, keys, values):
    slots = np.zeros((len(keys), table.num_slots, table.dim), np.float32)
    table.write_state(keys, values, slots, np.ones(len(keys), np.int64))


INSERTS = {
    "apply_gradients": lambda table, keys, values: table.apply_gradients(keys, values),
    "begin_push": lambda table, keys, values: table.begin_push(keys, values),
    "lookup_or_insert": lambda table, keys, values: table.lookup_or_insert(keys),
    "assign": lambda table, keys, values: table.assign(keys, values),
    "write_state": _write_state,
}


@pytest.mark.parametrize("operation", list(INSERTS))
def test_a_refused_insert_leaves_the_budgets_count_exact(operation):
    """Before refusing, the insert gives the push scratch back (its first try at making
    room): the budget must then count what the table holds, not what it held before (a
    refusal while bringing rows in used to return without reporting)."""
    dim = 256
    budget = _core.MemoryBudget(1 * MiB)
    table = _core.Table(dim, NORMAL, OPTIMIZERS["adam"], 3, budget=budget, name="user")
    in_ram = _core.Table(dim, NORMAL, OPTIMIZERS["adam"], 3)
    rng = np.random.default_rng(2)
    for batch in range(200):
        keys = np.arange(batch * 20, batch * 20 + 20, dtype=np.int64)
        grads = rng.standard_normal((20, dim)).astype(np.float32)
        try:
            table.apply_gradients(keys, grads)
        except errors.LimitExceeded:
            break
        in_ram.apply_gradients(keys, grads)
    else:
        raise AssertionError("1 MiB held 200 batches of 20 Adam rows of dim 256")
    held = np.arange(4, dtype=np.int64)  # rows it holds: the push keeps its scratch
    grads = rng.standard_normal((4, dim)).astype(np.float32)
    table.apply_gradients(held, grads)
    in_ram.apply_gradients(held, grads)
    assert table.scratch_bytes() > 0
    assert_count_exact(budget, table)
    many = np.arange(-200, 0, dtype=np.int64)
    with pytest.raises(errors.LimitExceeded):
        INSERTS[operation](table, many, rng.uniform(-1, 1, (200, dim)).astype(np.float32))
    assert_count_exact(budget, table, context=operation)
    assert_same_tables(table, in_ram)


def test_moving_rows_in_and_failing_after_moving_rows_out_leave_the_count_exact(tmp_path):
    """write_row_meta brings rows back from disk (it never settled the budget); a pull and
    a push that meet a corrupted record after making room (rows moved out) fail with it:
    the budget counts what the table holds after each."""
    dim = 256
    tiered, budget, in_ram = make_pair(tmp_path, dim, OPTIMIZERS["adagrad"], 256 * KiB)
    rng = np.random.default_rng(6)
    for start in range(0, 1000, 20):
        keys = np.arange(start, start + 20, dtype=np.int64)
        grads = rng.standard_normal((20, dim)).astype(np.float32)
        tiered.apply_gradients(keys, grads)
        in_ram.apply_gradients(keys, grads)
    assert_count_exact(budget, tiered)
    before = tiered.tier_stats()
    cold = np.arange(20, dtype=np.int64)  # pushed first, touched since never: on disk
    tiered.write_row_meta(cold, np.zeros(20, np.int64), np.zeros(20, np.int64))
    assert tiered.tier_stats()["rows_read"] > before["rows_read"]
    assert_count_exact(budget, tiered, context="write_row_meta")
    for path, _, at in records_of(25, tmp_path / "spill-emb"):
        flip_byte(path, at + 8 + 17)
    pushed = np.array([24, 25, *range(2000, 2008)], dtype=np.int64)  # and 8 new ids
    for name, fail in (
        ("lookup", lambda: tiered.lookup(np.array([24, 25, 900, 901, 902]))),
        ("push", lambda: tiered.apply_gradients(pushed, np.ones((len(pushed), dim), np.float32))),
    ):
        before = tiered.tier_stats()
        with pytest.raises(errors.CorruptRecord, match="key 25"):
            fail()
        assert tiered.tier_stats()["evictions"] > before["evictions"], name
        assert_count_exact(budget, tiered, context=name)
        assert budget.used() <= budget.limit + BUDGET_SLACK
    others = np.array([k for k in range(1000) if k != 25], dtype=np.int64)
    for start in range(0, len(others), 20):
        part = others[start : start + 20]
        np.testing.assert_array_equal(tiered.lookup(part), in_ram.lookup(part))


def test_a_push_begun_on_two_tables_of_a_budget_settles_when_finished_or_cancelled(tmp_path):
    """A request's push to two tiered tables of one shard (begin both, then finish or cancel
    both, as a server does): the budget holds and counts both tables exactly after each."""
    dim = 64
    budget = _core.MemoryBudget(512 * KiB)
    tables, twins = [], []
    for name in ("user", "item"):
        tables.append(
            _core.Table(
                dim,
                NORMAL,
                OPTIMIZERS["adagrad"],
                1,
                budget=budget,
                spill_dir=str(tmp_path / name),
                name=name,
            )
        )
        twins.append(_core.Table(dim, NORMAL, OPTIMIZERS["adagrad"], 1))
    rng = np.random.default_rng(11)
    for step in range(60):
        keys = rng.integers(0, 3000, 32)
        grads = rng.standard_normal((32, dim)).astype(np.float32)
        for table in tables:
            table.begin_push(keys, grads)
        for table, twin in zip(tables, twins):
            if step % 4 == 3:
                table.cancel_push()
            else:
                assert table.finish_push() == twin.apply_gradients(keys, grads)
        assert_count_exact(budget, *tables, context=f"step {step}")
        assert budget.used() <= budget.limit + BUDGET_SLACK, step
    for table, twin in zip(tables, twins):
        assert table.tier_stats()["rows_on_disk"] > 0
        assert_same_tables(table, twin)


# ---------------------------------------------------------------------------
# A full disk during write-back
# ---------------------------------------------------------------------------


def fill_until_disk_full(tiered, in_ram, budget, dim, rng, max_batches=2000):
    """Pushes new ids until the tiered table's write-back fails; returns the refused push."""
    for batch in range(max_batches):
        keys = np.arange(batch * 16, batch * 16 + 16, dtype=np.int64)
        grads = rng.standard_normal((16, dim)).astype(np.float32)
        try:
            tiered.apply_gradients(keys, grads)
        except errors.DiskFull as error:
            return keys, grads, error
        in_ram.apply_gradients(keys, grads)
        check_budget(tiered, budget, f"batch {batch}")
    raise AssertionError("the disk never filled up")


def assert_serves_every_row(tiered, in_ram):
    keys = full_state(in_ram)[0]
    for start in range(0, len(keys), 8):  # small batches: little to bring back at once
        part = keys[start : start + 8]
        np.testing.assert_array_equal(tiered.lookup(part), in_ram.lookup(part))


def test_a_full_disk_during_write_back_is_named_and_loses_nothing(tmp_path):
    """RLIMIT_FSIZE stands for the full disk (no root needed): a run file written past
    it fails with EFBIG (SIGXFSZ ignored), as ENOSPC would on a full file system. The
    limit is below one write-back's run (16 rows of 4 KiB), so the first fails."""
    dim = 512
    tiered, budget, in_ram = make_pair(tmp_path, dim, OPTIMIZERS["adagrad"], 1 * MiB)
    rng = np.random.default_rng(4)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (32 * KiB, hard))
    try:
        keys, grads, error = fill_until_disk_full(tiered, in_ram, budget, dim, rng)
        assert isinstance(error, errors.StorageError) and isinstance(error, OSError)
        assert "disk full" in str(error).lower() or "File too large" in str(error), str(error)
        # Nothing of the refused push applied; every row still served, exactly.
        assert len(tiered) == len(in_ram) and tiered.table_step == in_ram.table_step
        assert_serves_every_row(tiered, in_ram)
        assert_same_tables(tiered, in_ram)
        # Pushes to rows held in memory still work with the disk full.
        resident = full_state(in_ram)[0][-4:]
        small = rng.standard_normal((len(resident), dim)).astype(np.float32)
        try:
            tiered.apply_gradients(resident, small)
        except errors.DiskFull:
            pass  # a push may need to write back to make room: then it applies nothing
        else:
            in_ram.apply_gradients(resident, small)
        assert_same_tables(tiered, in_ram)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)
    # With room again, the refused push goes through.
    tiered.apply_gradients(keys, grads)
    in_ram.apply_gradients(keys, grads)
    check_budget(tiered, budget)
    assert_same_tables(tiered, in_ram)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_real_full_file_system_under_the_spill_dir(tmp_path):
    """ENOSPC from a 1 MiB tmpfs under the spill directory; remounted larger, it goes on."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
        check=True,
        timeout=30,
    )
    tiered = None
    try:
        dim = 256
        tiered, budget, in_ram = make_pair(mount_point, dim, OPTIMIZERS["adam"], 512 * KiB)
        rng = np.random.default_rng(9)
        keys, grads, error = fill_until_disk_full(tiered, in_ram, budget, dim, rng)
        assert "No space left on device" in str(error), str(error)
        assert_serves_every_row(tiered, in_ram)
        assert_same_tables(tiered, in_ram)
        subprocess.run(["mount", "-o", "remount,size=8m", str(mount_point)], check=True, timeout=30)
        tiered.apply_gradients(keys, grads)
        in_ram.apply_gradients(keys, grads)
        assert_same_tables(tiered, in_ram)
    finally:
        error = tiered = None  # the table's open files would keep the mount busy
        subprocess.run(["umount", "-l", str(mount_point)], check=True, timeout=30)


# ---------------------------------------------------------------------------
# A corrupted record is detected and named, never served
# ---------------------------------------------------------------------------


def test_a_corrupted_record_is_named_and_never_served(tmp_path):
    dim = 256
    optimizer = OPTIMIZERS["adagrad"]
    tiered, budget, in_ram = make_pair(tmp_path, dim, optimizer, 256 * KiB)
    rng = np.random.default_rng(6)
    n = 1000  # ~2 MiB of rows and slots
    for start in range(0, n, 20):
        keys = np.arange(start, start + 20, dtype=np.int64)
        grads = rng.standard_normal((20, dim)).astype(np.float32)
        tiered.apply_gradients(keys, grads)
        in_ram.apply_gradients(keys, grads)
    assert tiered.tier_stats()["rows_on_disk"] > n // 2
    # Key 5 was pushed once and never touched again: its record is on disk (one live
    # copy; a merge in progress may hold a dead one too). A byte of each copy flipped.
    records = records_of(5, tmp_path / "spill-emb")
    assert records, records
    for path, _, at in records:
        flip_byte(path, at + 8 + 17)
    names = {path.name for path, _, _ in records}
    offsets = {page for _, page, _ in records}

    with pytest.raises(errors.CorruptRecord) as raised:
        tiered.lookup(np.array([4, 5, 900], dtype=np.int64))
    message = str(raised.value)
    assert any(name in message for name in names), message
    assert any(f"offset {offset}" in message for offset in offsets), message
    assert "key 5" in message, message
    assert isinstance(raised.value, errors.StorageError) and isinstance(raised.value, OSError)
    for read in (
        lambda: tiered.read_state(np.array([5])),
        lambda: list(tiered.iter_chunks(100)),  # a checkpoint scan never writes it out
        lambda: tiered.apply_gradients(
            np.array([3, 5, 950]), np.ones((3, dim), np.float32)
        ),  # nothing of the push applied
    ):
        with pytest.raises(errors.CorruptRecord, match="key 5"):
            read()
    # Every other row is served as it was, from either tier.
    others = np.array([k for k in range(n) if k != 5], dtype=np.int64)
    for start in range(0, len(others), 20):
        part = others[start : start + 20]
        np.testing.assert_array_equal(tiered.lookup(part), in_ram.lookup(part))
        for got, want in zip(tiered.read_state(part), in_ram.read_state(part)):
            np.testing.assert_array_equal(got, want)
    assert tiered.table_step == in_ram.table_step


def test_corruption_anywhere_is_never_served(tmp_path):
    """A byte flipped in every record on disk: each id's pull gives its exact row (those in
    memory) or CorruptRecord naming it (those on disk), never other numbers."""
    dim = 128
    tiered, budget, in_ram = make_pair(tmp_path, dim, OPTIMIZERS["sgd"], 128 * KiB)
    rng = np.random.default_rng(12)
    keys = np.arange(600, dtype=np.int64)
    for start in range(0, len(keys), 30):
        grads = rng.standard_normal((30, dim)).astype(np.float32)
        tiered.apply_gradients(keys[start : start + 30], grads)
        in_ram.apply_gradients(keys[start : start + 30], grads)
    flipped = 0
    for path in run_files(tmp_path / "spill-emb"):
        data = bytearray(path.read_bytes())
        record_bytes = struct.unpack_from("<Q", data, 8)[0]
        for _, entries in run_pages(path):
            for _, at in entries:
                data[at + 8 + int(rng.integers(record_bytes))] ^= 0x01
                flipped += 1
        path.write_bytes(bytes(data))
    assert flipped > 0
    corrupt = 0
    for key in keys.tolist():
        try:
            row = tiered.lookup(np.array([key]))
        except errors.CorruptRecord as error:
            assert f"key {key}" in str(error), str(error)
            corrupt += 1
        else:
            np.testing.assert_array_equal(row, in_ram.lookup(np.array([key])), str(key))
    assert corrupt > 0


# ---------------------------------------------------------------------------
# The spill directory's life
# ---------------------------------------------------------------------------


def test_the_spill_dir_is_emptied_at_open_and_removed_with_the_table(tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    (spill / "run-00000001.kvr").write_bytes(b"left over by a killed server")
    budget = _core.MemoryBudget(256 * KiB)
    table = _core.Table(256, NORMAL, None, 0, budget=budget, spill_dir=str(spill))
    assert not (spill / "run-00000001.kvr").exists()
    for start in range(0, 1000, 50):
        table.apply_gradients(np.arange(start, start + 50), np.ones((50, 256), np.float32))
    assert run_files(spill)
    del table
    assert not spill.exists()
    assert budget.used() == 0


# ---------------------------------------------------------------------------
# The store: save / restore / reshard 2 -> 3 / export of a tiered table
# ---------------------------------------------------------------------------

STORE_DIM = 256
STORE_IDS = np.arange(-3000, 3000, 2, dtype=np.int64)  # 3000 Adam rows of dim 256: ~9 MiB


def _train_store(kv, steps, seed):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = np.concatenate([rng.choice(STORE_IDS, 48), STORE_IDS[rng.zipf(1.3, 16) % 3000]])
        kv.push("emb", (ids, rng.normal(size=(len(ids), STORE_DIM)).astype(np.float32)))
        kv.push("w", rng.normal(size=10).astype(np.float32))


def _init_store(kv):
    kv.set_optimizer(optimizers.create("adagrad", learning_rate=0.1))
    adam = optimizers.create("adam", learning_rate=0.05)
    kv.init("emb", kvsparse.SparseTable(dim=STORE_DIM, optimizer=adam, seed=3))
    kv.init("w", np.linspace(-1, 1, 10).astype(np.float32))
    # Every id once, so that most rows live on disk.
    for start in range(0, len(STORE_IDS), 100):
        ids = STORE_IDS[start : start + 100]
        kv.push("emb", (ids, np.full((len(ids), STORE_DIM), 0.5, np.float32)))


def _store_state(kv):
    out = {"emb": kv.row_sparse_pull("emb", row_ids=STORE_IDS), "w": kv.pull("w")}
    for shard in kv._backend.optimizer_states():
        for table_id, state in shard.items():
            if "keys" in state:
                order = np.argsort(state["keys"])
                for name in ("keys", "slots", "steps"):
                    out.setdefault((table_id, name), []).append(state[name][order])
            else:
                out[(table_id, "slots")] = state["slots"]
    return {k: np.concatenate(v) if isinstance(v, list) else v for k, v in out.items()}


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=str(key))


def _tier_of(kv, name="emb"):
    return kv.stats()["tables"][name]["tier"]


def test_local_store_save_restore_and_export_of_a_tiered_table(tmp_path):
    tiered = kvsparse.create("local", memory_budget=2 * MiB, spill_dir=str(tmp_path / "spill"))
    in_ram = kvsparse.create("local")
    for kv in (tiered, in_ram):
        _init_store(kv)
        _train_store(kv, 6, seed=1)
    assert _tier_of(tiered)["rows_on_disk"] > 0, _tier_of(tiered)
    _assert_same_state(_store_state(tiered), _store_state(in_ram))
    tiered.save(tmp_path / "tiered")
    in_ram.save(tmp_path / "ram")
    tiered.export(tmp_path / "tiered-export")
    in_ram.export(tmp_path / "ram-export")
    for a, b in zip(
        sorted((tmp_path / "tiered-export").glob("*.npz")),
        sorted((tmp_path / "ram-export").glob("*.npz")),
    ):
        with np.load(a) as x, np.load(b) as y:
            assert sorted(x.files) == sorted(y.files)
            meta_x, meta_y = (json.loads(bytes(m["meta"]).decode()) for m in (x, y))
            meta_x.pop("export_id"), meta_y.pop("export_id")  # drawn at random per export
            assert meta_x == meta_y
            for name in set(x.files) - {"meta"}:
                np.testing.assert_array_equal(x[name], y[name], err_msg=name)
    # Incremental saves hold the same deltas.
    for kv in (tiered, in_ram):
        _train_store(kv, 3, seed=2)
    tiered.save(tmp_path / "tiered", incremental=True)
    in_ram.save(tmp_path / "ram", incremental=True)
    # A tiered store loads either checkpoint; the result trains on like the RAM store.
    for source in ("tiered", "ram"):
        loaded = kvsparse.create(
            "local", memory_budget=2 * MiB, spill_dir=str(tmp_path / f"spill-{source}")
        )
        loaded.load(tmp_path / source)
        _assert_same_state(_store_state(loaded), _store_state(in_ram))
        assert _tier_of(loaded)["rows_on_disk"] > 0
        fresh = kvsparse.create("local")
        fresh.load(tmp_path / source)
        for kv in (loaded, fresh):
            _train_store(kv, 2, seed=3)
        _assert_same_state(_store_state(loaded), _store_state(fresh))


def test_a_tiered_shard_restores_its_part_of_a_checkpoint_by_key_hash(tmp_path):
    """One tiered shard's checkpoint restored onto three tiered shards (ShardState, in
    process): each holds the rows of its hash, most on disk, as the RAM table had them."""
    from kvsparse.placement import table_id_of
    from kvsparse.shard import checkpoint
    from kvsparse.shard.state import ShardState

    path = str(tmp_path / "ckpt")
    in_ram = kvsparse.create("local")
    tiered = kvsparse.create("local", memory_budget=2 * MiB, spill_dir=str(tmp_path / "spill"))
    for kv in (tiered, in_ram):
        _init_store(kv)
        _train_store(kv, 4, seed=6)
    tiered.save(path)
    expected = in_ram.row_sparse_pull("emb", row_ids=STORE_IDS)
    position = {int(k): i for i, k in enumerate(STORE_IDS)}  # an id's row in `expected`
    ram_table = in_ram._backend.state.sparse[table_id_of("emb")].table
    rows_seen = 0
    for index in range(3):
        state = ShardState(memory_budget=1 * MiB, spill_dir=str(tmp_path / f"spill3-{index}"))
        checkpoint.restore_shard(state, path, index, 3)
        table = state.sparse[table_id_of("emb")].table
        assert table.tier_stats()["rows_on_disk"] > 0, table.tier_stats()
        keys = full_state(table)[0]
        assert (_core.shard_of(keys, 3) == index).all()
        rows = expected[[position[int(k)] for k in keys]]
        np.testing.assert_array_equal(table.lookup(keys), rows)
        for got, want in zip(table.read_state(keys), ram_table.read_state(keys)):
            np.testing.assert_array_equal(got, want)
        rows_seen += len(keys)
    assert rows_seen == len(ram_table)


def _tiered_servers(factory, n, tmp_path, budget="2MiB"):
    """n real servers with a memory budget and each its own spill directory."""
    servers = []
    for _ in range(n):
        spill = tmp_path / f"spill-server-{len(factory.processes)}"
        server = ServerProcess(extra_args=["--memory-budget", budget, "--spill-dir", str(spill)])
        factory.processes.append(server)  # stopped at teardown
        servers.append(server.address)
    return servers


def _export_rows(path):
    """{key: (keys, values)} of every table in an export directory, parts joined, by key."""
    parts: dict = {}
    for part in sorted(Path(path).glob("*.npz")):
        with np.load(part) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            for table in meta["tables"]:
                keys, values = data[table["keys"]], data[table["values"]]
                parts.setdefault(table["name"], []).append((keys, values))
    out = {}
    for name, chunks in parts.items():
        keys = np.concatenate([k for k, _ in chunks])
        values = np.concatenate([v for _, v in chunks])
        order = np.argsort(keys)
        out[name] = (keys[order], values[order])
    return out


def test_two_tiered_servers_save_and_three_tiered_servers_load_and_export(server_factory, tmp_path):
    """Two servers with a budget of a fifth of their shard save while most rows are on disk;
    the checkpoint loads onto three such servers (resharded by key hash) and gives what the
    same training gives all in RAM (a local store): rows and, through two more steps of
    Adam, their slots and step counters; the export of the three equals the RAM one's."""
    path = str(tmp_path / "ckpt")
    in_ram = kvsparse.create("local")
    two = kvsparse.create("dist_sparse", servers=_tiered_servers(server_factory, 2, tmp_path))
    try:
        for kv in (two, in_ram):
            _init_store(kv)
            _train_store(kv, 4, seed=6)
        tiers = two.stats()["tables"]["emb"]["tier"]
        assert tiers["rows_on_disk"] > len(STORE_IDS) // 2, tiers
        np.testing.assert_array_equal(
            two.row_sparse_pull("emb", row_ids=STORE_IDS),
            in_ram.row_sparse_pull("emb", row_ids=STORE_IDS),
        )
        assert two.save(path) == 1
    finally:
        two.close()
    for process in server_factory.processes:
        process.kill()  # kill -9: the checkpoint is all that is left
    three = kvsparse.create("dist_sparse", servers=_tiered_servers(server_factory, 3, tmp_path))
    try:
        assert three.load(path) == 1
        assert three.stats()["tables"]["emb"]["tier"]["rows_on_disk"] > 0
        np.testing.assert_array_equal(
            three.row_sparse_pull("emb", row_ids=STORE_IDS),
            in_ram.row_sparse_pull("emb", row_ids=STORE_IDS),
        )
        np.testing.assert_array_equal(three.pull("w"), in_ram.pull("w"))
        for kv in (three, in_ram):
            _train_store(kv, 2, seed=7)  # Adam's next steps use the restored slots and steps
        np.testing.assert_array_equal(
            three.row_sparse_pull("emb", row_ids=STORE_IDS),
            in_ram.row_sparse_pull("emb", row_ids=STORE_IDS),
        )
        three.export(str(tmp_path / "export-three"))
        in_ram.export(str(tmp_path / "export-ram"))
        exported, expected = (
            _export_rows(tmp_path / name) for name in ("export-three", "export-ram")
        )
        assert exported.keys() == expected.keys()
        for name in expected:
            for got, want in zip(exported[name], expected[name]):
                np.testing.assert_array_equal(got, want, err_msg=name)
    finally:
        three.close()


# ---------------------------------------------------------------------------
# Real servers: --memory-budget refusing and serving on; kill -9 under --restart-servers
# ---------------------------------------------------------------------------


def test_a_server_with_a_budget_and_no_spill_dir_refuses_and_goes_on_serving():
    server = ServerProcess(extra_args=["--memory-budget", "8MiB"])
    kv = kvsparse.create("dist_sparse", servers=[server.address], timeout=30)
    try:
        kv.init("emb", kvsparse.SparseTable(dim=512, optimizer=optimizers.create("adam")))
        rng = np.random.default_rng(0)
        pushed = 0
        with pytest.raises(errors.LimitExceeded, match="--memory-budget") as raised:
            for batch in range(100):  # 100 x 50 Adam rows of dim 512: 30 MiB
                ids = np.arange(batch * 50, batch * 50 + 50)
                kv.push("emb", (ids, rng.normal(size=(50, 512)).astype(np.float32)))
                pushed = batch * 50 + 50
        assert "--spill-dir" in str(raised.value)
        assert 0 < pushed < 5000
        # The rows admitted before are intact, nothing of the refused push is stored, and
        # the server goes on serving.
        assert kv.stats()["tables"]["emb"]["rows"] == pushed
        rows = kv.row_sparse_pull("emb", row_ids=np.arange(pushed + 50))
        assert rows.shape == (pushed + 50, 512)
        kv.push("emb", (np.arange(10), np.ones((10, 512), np.float32)))
        other = kvsparse.create("dist_sparse", servers=[server.address], timeout=30)
        other.init("emb", kvsparse.SparseTable(dim=512, optimizer=optimizers.create("adam")))
        assert other.row_sparse_pull("emb", row_ids=np.arange(3)).shape == (3, 512)
        other.close()
    finally:
        kv.close()
        server.stop()


def test_a_server_with_a_spill_dir_serves_a_table_larger_than_its_budget(tmp_path):
    server = ServerProcess(
        extra_args=["--memory-budget", "4MiB", "--spill-dir", str(tmp_path / "spill")]
    )
    kv = kvsparse.create("dist_sparse", servers=[server.address], timeout=30)
    local = kvsparse.create("local")
    try:
        for store in (kv, local):
            store.init("emb", kvsparse.SparseTable(dim=512, optimizer=optimizers.create("adam")))
        rng = np.random.default_rng(0)
        for batch in range(40):  # 40 x 50 Adam rows of dim 512: 12 MiB
            ids = np.arange(batch * 50, batch * 50 + 50)
            grads = rng.normal(size=(50, 512)).astype(np.float32)
            kv.push("emb", (ids, grads))
            local.push("emb", (ids, grads))
        ids = np.arange(2000)
        np.testing.assert_array_equal(
            kv.row_sparse_pull("emb", row_ids=ids), local.row_sparse_pull("emb", row_ids=ids)
        )
        tier = kv.stats()["tables"]["emb"]["tier"]
        assert tier["rows_on_disk"] > 0 and tier["disk_hits"] > 0, tier
        assert tier["hit_rate"] == pytest.approx(1 - tier["disk_hits"] / tier["row_lookups"])
    finally:
        kv.close()
        server.stop()
    assert not any((tmp_path / "spill").rglob("run-*")), "a stopped server left its rows"


TRACE_WORKER = r"""
import json, os, sys, time
import numpy as np
import kvsparse
from kvsparse.initializers import Zeros
from kvsparse.optimizers import SGD

steps, every, width, dim = (int(a) for a in sys.argv[1:5])
kv = kvsparse.create("dist_sparse")
rank, n = kv.rank, kv.num_workers
path = os.environ["KVSPARSE_CHECKPOINT_DIR"]
sgd = SGD(learning_rate=1.0)
kv.init("trace", kvsparse.SparseTable(dim=dim, initializer=Zeros(), optimizer=sgd))
minus_one = -np.ones((width, dim), np.float32)
for step in range(steps):
    first = (step * n + rank) * width
    kv.push("trace", (np.arange(first, first + width), minus_one))
    if rank == 0 and (step + 1) % every == 0:
        seq = kv.save(path)
        print(json.dumps({"checkpoint": step, "seq": seq}), flush=True)
    print(f"step {step}", flush=True)
    time.sleep(0.05)  # paced, so that the kill lands mid-training
kv.barrier()
if rank == 0:
    rows = kv.row_sparse_pull("trace", row_ids=np.arange(steps * n * width))
    stats = kv.stats()["tables"]["trace"]["tier"]
    print(json.dumps({
        "values": rows[:, 0].tolist(),
        "uniform": bool((rows == rows[:, :1]).all()),
        "rows_on_disk": stats["rows_on_disk"],
        "restarts": kv._backend.restarts,
    }), flush=True)
"""


class _Job:
    """`kvsparse launch` in a subprocess, its output lines collected as they come."""

    def __init__(self, argv):
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=subprocess_env(),
            cwd=str(REPO_ROOT),
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for raw in iter(self.process.stdout.readline, b""):
            with self.changed:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self.changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.changed:
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    match = regex.search(line)
                    if match:
                        return match
                seen = len(self.lines)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.process.poll() is not None and not self.reader.is_alive():
                    raise AssertionError(f"no line matching {pattern!r}:\n" + self.output())
                self.changed.wait(min(remaining, 0.5))

    def finish(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise AssertionError("the job did not finish:\n" + self.output()) from None
        self.reader.join(10)
        return code

    def stop(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def output(self) -> str:
        return "\n".join(self.lines)


def test_a_killed_tiered_server_loses_nothing_a_checkpoint_covered(tmp_path):
    """SGD with lr=1 on zeros, a gradient of -1 once per id: an id holds 1 where its push
    was applied once. Each server holds ~2x its budget (most rows on disk) when server 1 is
    killed with SIGKILL; restarted from the last checkpoint, every id that checkpoint
    covered holds 1, no push was applied twice, and its rows spill to disk again."""
    steps, every, width, dim, kill_at = 50, 5, 32, 1024, 23
    script = tmp_path / "trace_worker.py"
    script.write_text(TRACE_WORKER)
    argv = [
        sys.executable,
        "-m",
        "kvsparse",
        "launch",
        "-s",
        "2",
        "-n",
        "2",
        "--timeout",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--memory-budget",
        "2MiB",
        "--spill-dir",
        str(tmp_path / "spill"),
        "--restart-servers",
        "--retry-window",
        "60",
        "--",
        sys.executable,
        str(script),
        *map(str, (steps, every, width, dim)),
    ]
    job = _Job(argv)
    try:
        pid = int(job.wait_for(r"server 1 \(pid (\d+)\) listening", 60).group(1))
        job.wait_for(rf"\[worker 0\] step {kill_at}$", 90)
        os.kill(pid, signal.SIGKILL)
        code = job.finish(240)
    finally:
        job.stop()
    output = job.output()
    assert code == 0, output
    assert re.search(r"server 1 \(pid \d+\) restarted on \S+ from ", output), output
    restart_line = next(i for i, x in enumerate(job.lines) if "restarted on" in x)
    checkpoints = [
        json.loads(line.split("] ", 1)[1])["checkpoint"]
        for line in job.lines[:restart_line]
        if line.startswith("[worker 0] {")
    ]
    assert checkpoints, "no checkpoint before the kill:\n" + output
    result = json.loads(
        job.lines[[i for i, x in enumerate(job.lines) if '"values"' in x][-1]].split("] ", 1)[1]
    )
    values = np.array(result["values"])
    assert result["uniform"], "a row's columns differ"
    assert set(np.unique(values)) <= {0.0, 1.0}, values  # no push applied twice
    assert result["restarts"] >= 1
    assert result["rows_on_disk"] > 0, result
    covered = (checkpoints[-1] + 1) * 2 * width
    assert (values[:covered] == 1).all(), np.flatnonzero(values[:covered] != 1)
    later = (kill_at + every + 2) * 2 * width
    assert (values[later:] == 1).all(), np.flatnonzero(values[later:] != 1)


def test_a_large_move_to_disk_goes_in_pieces_and_stays_exact(tmp_path):
    """set_optimizer widening 1.55M narrow rows past the budget moves ~600k rows out at
    once: in 16 MiB pieces with the row arrays compacted between them (rows change slots
    mid-move), and every row, slot and step still equals the all-RAM table's."""
    adagrad = {"kind": "adagrad", "learning_rate": 0.1}
    rmsprop = {"kind": "rmsprop", "learning_rate": 0.01, "centered": True, "momentum": 0.5}
    tiered, budget, in_ram = make_pair(tmp_path, 8, adagrad, 150 * MiB)
    rng = np.random.default_rng(1)
    n = 1_550_000

    def push_all():
        for start in range(0, n, 65536):
            keys = np.arange(start, min(n, start + 65536), dtype=np.int64)
            grads = rng.standard_normal((keys.size, 8)).astype(np.float32)
            assert tiered.apply_gradients(keys, grads) == in_ram.apply_gradients(keys, grads)

    push_all()
    assert tiered.tier_stats()["rows_on_disk"] == 0
    tiered.set_optimizer(rmsprop)
    in_ram.set_optimizer(rmsprop)
    stats = tiered.tier_stats()
    assert stats["rows_on_disk"] > 400_000 and stats["compactions"] > 2, stats
    push_all()
    keys = np.arange(n, dtype=np.int64)
    for start in range(0, n, 200_000):
        part = keys[start : start + 200_000]
        for got, want in zip(tiered.read_state(part), in_ram.read_state(part)):
            np.testing.assert_array_equal(got, want)
    assert budget.used() <= budget.limit


def test_room_for_one_table_is_taken_from_the_largest_other_table_first(tmp_path):
    """A table that needs room asks the shard's other tables, the largest holder first:
    small tables (all of whose rows a DLRM reads every step) keep their rows in memory
    while a large one spills. (In the hash order of the tables' addresses, a small table
    was asked before the large one in most processes, and gave up its rows.)"""
    budget = _core.MemoryBudget(4 << 20)

    def table(name):
        return _core.Table(
            8,
            {"kind": "zeros"},
            OPTIMIZERS["sgd"],
            budget=budget,
            spill_dir=str(tmp_path / name),
            name=name,
        )

    def fill(grown, rows):
        for begin in range(0, rows, 4_000):
            ids = np.arange(begin, min(rows, begin + 4_000), dtype=np.int64)
            grown.assign(ids, np.ones((ids.size, 8), np.float32))

    smalls = [table(f"small-{i}") for i in range(8)]
    large, other = table("large"), table("other")
    fill(large, 80_000)
    for small in smalls:
        fill(small, 200)
    spilled = large.tier_stats()["evictions"]
    fill(other, 20_000)  # its room: from the large table, every time
    assert large.tier_stats()["evictions"] > spilled
    assert [s.tier_stats()["evictions"] for s in smalls] == [0] * 8
    assert [s.tier_stats()["rows_in_memory"] for s in smalls] == [200] * 8


# ---------------------------------------------------------------------------
# Merges in a server's idle time (IdleMaintenance)
# ---------------------------------------------------------------------------


def _run_files(tmp_path, name="emb") -> int:
    """Run files of the table's disk tier (one per WriteBatch or merge output)."""
    return sum(1 for path in (tmp_path / f"spill-{name}").rglob("*.kvr") if path.is_file())


def _fill(tiered, in_ram, budget, batches, idle_calls, rng):
    """Pushes batches of 500 new Adagrad rows to both tables; between them, what an idle
    server does: idle_calls(tiered)."""
    for batch in range(batches):
        keys = np.arange(batch * 500, batch * 500 + 500, dtype=np.int64)
        grads = rng.standard_normal((500, 16)).astype(np.float32)
        tiered.apply_gradients(keys, grads)
        in_ram.apply_gradients(keys, grads)
        check_budget(tiered, budget, f"batch {batch}")
        idle_calls(tiered)
        check_budget(tiered, budget, f"batch {batch}, idle")


def test_merges_wait_for_a_servers_idle_time_and_run_there(tmp_path):
    tiered, budget, in_ram = make_pair(tmp_path, 16, OPTIMIZERS["adagrad"], 1 * MiB)
    files = []

    def busy_server(table):  # idle between requests, but with no time for merges yet
        assert not table.idle_maintenance(0)
        files.append(_run_files(tmp_path))

    _fill(tiered, in_ram, budget, 25, busy_server, np.random.default_rng(3))
    deferred = tiered.tier_stats()
    assert deferred["rows_on_disk"] > 0
    # The operations left their merges to the idle time (below 20 runs, past which they
    # would run them all the same).
    assert deferred["gc_bytes_moved"] == 0, deferred
    assert 12 < files[-1] <= 20, files
    steps = 0
    while tiered.idle_maintenance(1 * MiB):
        steps += 1
        check_budget(tiered, budget, f"idle step {steps}")
        assert steps < 10_000
    merged = tiered.tier_stats()
    assert steps > 0 and merged["gc_bytes_moved"] > 0
    assert _run_files(tmp_path) < files[-1] / 2, (_run_files(tmp_path), files)
    assert not tiered.idle_maintenance(1 * MiB)  # nothing earned since
    assert_same_tables(tiered, in_ram, "after the idle merges")


def test_without_idle_calls_the_operations_merge_as_before(tmp_path):
    tiered, budget, in_ram = make_pair(tmp_path, 16, OPTIMIZERS["adagrad"], 1 * MiB)
    files = []
    _fill(tiered, in_ram, budget, 25, lambda table: files.append(_run_files(tmp_path)),
          np.random.default_rng(3))  # fmt: skip
    assert tiered.tier_stats()["gc_bytes_moved"] > 0
    assert max(files) <= 10, files
    assert_same_tables(tiered, in_ram, "merged in the operations")


def test_eviction_moves_the_rows_with_fewest_updates_and_never_the_operations_own(tmp_path):
    """Victims are the coldest eligible rows: 100 rows pushed 20 times stay in memory while
    20,000 rows pushed once pass through a budget of a few thousand, and each push's own
    rows are in memory after it (a lookup of them reads nothing)."""
    dim = 64
    tiered, budget, in_ram = make_pair(tmp_path, dim, OPTIMIZERS["sgd"], 1 * MiB)
    rng = np.random.default_rng(3)
    hot = np.arange(1_000_000, 1_000_100, dtype=np.int64)
    for _ in range(20):
        grads = rng.standard_normal((hot.size, dim)).astype(np.float32)
        tiered.apply_gradients(hot, grads)
        in_ram.apply_gradients(hot, grads)
    for start in range(0, 20_000, 500):
        cold = np.arange(start, start + 500, dtype=np.int64)
        grads = rng.standard_normal((cold.size, dim)).astype(np.float32)
        tiered.apply_gradients(cold, grads)
        in_ram.apply_gradients(cold, grads)
        before = check_budget(tiered, budget, f"after the push at {start}")
        np.testing.assert_array_equal(tiered.lookup(cold), in_ram.lookup(cold))
        assert tiered.tier_stats()["rows_read"] == before["rows_read"], start
    stats = check_budget(tiered, budget)
    assert stats["rows_on_disk"] > 15_000 and stats["rows_in_memory"] < 5_000, stats
    np.testing.assert_array_equal(tiered.lookup(hot), in_ram.lookup(hot))
    assert tiered.tier_stats()["rows_read"] == stats["rows_read"] == 0, stats
    assert_same_tables(tiered, in_ram)
