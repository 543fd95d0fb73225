"""Hypothesis properties: the C++ table behaves like the NumPy ReferenceTable.

Random sequences of apply_gradients / assign / lookup / lookup_or_insert /
remove / write_state / set_optimizer, with duplicate and extreme ids, over
every optimizer (torch and MXNet formulas) with randomized (sane)
hyperparameters, dims {1, 3, 8, 64}, every initializer and both step modes.
After every operation the rows, optimizer slots, row step counters and the
table step of kvsparse._core.Table must match tests/reference.py closely
(rtol 1e-5).
"""

import numpy as np
import pytest
import reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsparse import _core, errors

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
RTOL = 1e-5
ATOL = 1e-6

KEY_POOL = [INT64_MIN, INT64_MIN + 1, -(2**40), -3, -1, 0, 1, 2, 3, 5, 8, 13, 2**40, INT64_MAX]

PROPERTY_SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------


def unit_floats(low, high):
    return st.floats(low, high, allow_nan=False, allow_infinity=False)


@st.composite
def optimizers(draw, kinds=(None, "sgd", "adagrad", "adam", "adamw", "ftrl", "rmsprop")):
    kind = draw(st.sampled_from(kinds))
    spec = {"kind": kind, "step_mode": draw(st.sampled_from(["row", "table"]))}
    spec["learning_rate"] = draw(unit_floats(1e-3, 0.5))
    spec["rescale_grad"] = draw(st.sampled_from([1.0, 0.5, 2.0, 1 / 32]) | unit_floats(0.05, 4.0))
    spec["clip_gradient"] = draw(st.sampled_from([-1.0, None]) | unit_floats(0.05, 5.0))
    if kind != "ftrl":
        spec["weight_decay"] = draw(st.just(0.0) | unit_floats(0.0, 0.1))
    if kind == "sgd":
        momentum = draw(st.just(0.0) | unit_floats(0.1, 0.99))
        spec["momentum"] = momentum
        spec["nesterov"] = momentum > 0 and draw(st.booleans())
    elif kind == "adagrad":
        spec["lr_decay"] = draw(st.just(0.0) | unit_floats(0.0, 0.2))
        spec["epsilon"] = draw(st.sampled_from([1e-10, 1e-8, 1e-6]))
        spec["initial_accumulator_value"] = draw(st.just(0.0) | unit_floats(0.0, 1.0))
    elif kind in ("adam", "adamw"):
        spec["beta1"] = draw(st.sampled_from([0.0, 0.9]) | unit_floats(0.0, 0.99))
        spec["beta2"] = draw(st.sampled_from([0.999, 0.5]) | unit_floats(0.5, 0.9999))
        spec["epsilon"] = draw(st.sampled_from([1e-8, 1e-6, 1e-3]))
    elif kind == "rmsprop":
        spec["alpha"] = draw(st.sampled_from([0.99, 0.9]) | unit_floats(0.5, 0.999))
        spec["epsilon"] = draw(st.sampled_from([1e-8, 1e-6, 1e-3]))
        spec["centered"] = draw(st.booleans())
        spec["momentum"] = draw(st.just(0.0) | unit_floats(0.1, 0.95))
    elif kind == "ftrl":
        spec["learning_rate"] = draw(unit_floats(0.01, 0.5))
        lr_power = draw(st.sampled_from([-0.5, 0.0]) | unit_floats(-1.0, 0.0))
        spec["lr_power"] = lr_power
        low = 0.0 if lr_power == -0.5 or lr_power == 0.0 else 0.01
        spec["initial_accumulator_value"] = draw(st.just(max(low, 0.1)) | unit_floats(low, 1.0))
        spec["l1"] = draw(st.just(0.0) | unit_floats(0.0, 0.1))
        spec["l2"] = draw(st.just(0.0) | unit_floats(0.0, 0.1))
        spec["beta"] = draw(st.just(0.0) | unit_floats(0.0, 1.0))
    if kind in ("adam", "adagrad", "rmsprop") and draw(st.booleans()):
        spec["formula"] = "mxnet"
        if kind == "adagrad":
            spec["lr_decay"] = 0.0  # MXNet's AdaGrad has none
    return spec


initializers = st.one_of(
    st.just({"kind": "zeros"}),
    st.builds(lambda a: {"kind": "constant", "a": a}, unit_floats(-2, 2)),
    st.builds(
        lambda a, width: {"kind": "uniform", "a": a, "b": a + width},
        unit_floats(-1, 1),
        unit_floats(0, 2),
    ),
    st.builds(
        lambda a, b: {"kind": "normal", "a": a, "b": b}, unit_floats(-1, 1), unit_floats(0, 1)
    ),
    st.builds(
        lambda a, b: {"kind": "truncated_normal", "a": a, "b": b},
        unit_floats(-1, 1),
        unit_floats(0, 1),
    ),
)

key_lists = st.lists(
    st.sampled_from(KEY_POOL) | st.integers(INT64_MIN, INT64_MAX), min_size=0, max_size=12
)

operations = st.one_of(
    st.tuples(
        st.just("push"),
        key_lists,
        st.sampled_from([0.01, 1.0, 30.0]),  # gradient scale
        st.sampled_from([None, np.nan, np.inf, -np.inf]),  # a poisoned element, maybe
        st.booleans(),  # skip_nonfinite
    ),
    st.tuples(st.just("push"), key_lists, st.just(1.0), st.none(), st.just(False)),
    st.tuples(st.just("assign"), key_lists),
    st.tuples(st.just("lookup"), key_lists),
    st.tuples(st.just("lookup_or_insert"), key_lists),
    st.tuples(st.just("remove"), key_lists),
    st.tuples(st.just("write_state"), key_lists, st.integers(0, 10_000)),
    st.tuples(st.just("set_optimizer"), st.just([]), optimizers()),
)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def core_state(table):
    chunks = list(table.iter_chunks(5))
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


def assert_tables_match(table, ref, context):
    keys, values, slots, steps = core_state(table)
    ref_keys, ref_values, ref_slots, ref_steps = ref.state()
    np.testing.assert_array_equal(keys, ref_keys, err_msg=context)
    np.testing.assert_allclose(values, ref_values, rtol=RTOL, atol=ATOL, err_msg=context)
    np.testing.assert_allclose(slots, ref_slots, rtol=RTOL, atol=ATOL, err_msg=context)
    np.testing.assert_array_equal(steps, ref_steps, err_msg=context)
    assert table.table_step == ref.table_step, context
    assert table.size() == ref.size(), context


def run_operation(table, ref, operation, rng):
    name, key_values = operation[0], operation[1]
    keys = np.array(key_values, dtype=np.int64)
    dim = table.dim
    if name == "push":
        _, _, scale, poison, skip = operation
        grads = (rng.standard_normal((len(keys), dim)) * scale).astype(np.float32)
        if poison is not None and len(keys):
            grads[rng.integers(len(keys)), rng.integers(dim)] = poison
        try:
            expected = ref.apply_gradients(keys, grads, skip_nonfinite=skip)
        except (errors.NonFiniteGradient, errors.UpdateOverflow) as refused:
            with pytest.raises(type(refused)):
                table.apply_gradients(keys, grads, skip_nonfinite=skip)
        else:
            assert table.apply_gradients(keys, grads, skip_nonfinite=skip) == expected
    elif name == "assign":
        values = rng.uniform(-3, 3, size=(len(keys), dim)).astype(np.float32)
        table.assign(keys, values)
        ref.assign(keys, values)
    elif name == "lookup":
        np.testing.assert_allclose(table.lookup(keys), ref.lookup(keys), rtol=RTOL, atol=ATOL)
    elif name == "lookup_or_insert":
        np.testing.assert_allclose(
            table.lookup_or_insert(keys), ref.lookup_or_insert(keys), rtol=RTOL, atol=ATOL
        )
    elif name == "remove":
        assert table.remove(keys) == ref.remove(keys)
    elif name == "write_state":
        values = rng.uniform(-3, 3, size=(len(keys), dim)).astype(np.float32)
        slots = rng.uniform(0, 2, size=(len(keys), table.num_slots, dim)).astype(np.float32)
        steps = rng.integers(0, operation[2] + 1, size=len(keys)).astype(np.int64)
        table.write_state(keys, values, slots, steps)
        ref.write_state(keys, values, slots, steps)
    elif name == "set_optimizer":
        table.set_optimizer(operation[2])
        ref.set_optimizer(operation[2])


# ---------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(
    dim=st.sampled_from([1, 3, 8, 64]),
    initializer=initializers,
    optimizer=optimizers(),
    seed=st.integers(0, 2**64 - 1),
    data_seed=st.integers(0, 2**32 - 1),
    ops=st.lists(operations, min_size=1, max_size=10),
)
def test_table_matches_reference_model(dim, initializer, optimizer, seed, data_seed, ops):
    table = _core.Table(dim, initializer, optimizer, seed)
    ref = reference.ReferenceTable(dim, initializer, optimizer, seed)
    rng = np.random.default_rng(data_seed)
    for index, operation in enumerate(ops):
        run_operation(table, ref, operation, rng)
        assert_tables_match(table, ref, f"after op {index}: {operation[0]}")


@PROPERTY_SETTINGS
@given(
    dim=st.sampled_from([1, 3, 8]),
    optimizer=optimizers(kinds=("sgd", "adagrad", "adam", "adamw", "ftrl", "rmsprop")),
    data_seed=st.integers(0, 2**32 - 1),
    steps=st.integers(1, 25),
)
def test_repeated_pushes_on_few_rows_match_reference(dim, optimizer, data_seed, steps):
    """Long runs of pushes on a handful of rows: slots and bias corrections build up."""
    table = _core.Table(dim, {"kind": "uniform", "a": -1, "b": 1}, optimizer, 3)
    ref = reference.ReferenceTable(dim, {"kind": "uniform", "a": -1, "b": 1}, optimizer, 3)
    rng = np.random.default_rng(data_seed)
    for _ in range(steps):
        keys = rng.choice(np.array([0, -1, INT64_MAX, 7], np.int64), size=rng.integers(1, 6))
        grads = rng.standard_normal((len(keys), dim)).astype(np.float32)
        assert table.apply_gradients(keys, grads) == ref.apply_gradients(keys, grads)
    assert_tables_match(table, ref, f"after {steps} pushes")


@PROPERTY_SETTINGS
@given(
    n=st.integers(1, 40),
    optimizer=optimizers(),
    data_seed=st.integers(0, 2**32 - 1),
    steps=st.lists(st.integers(1, 1000), min_size=1, max_size=6),
)
def test_flat_span_optimizer_matches_reference(n, optimizer, data_seed, steps):
    core_optimizer = _core.Optimizer(optimizer)
    ref_optimizer = reference.ReferenceOptimizer(optimizer)
    assert core_optimizer.num_slots == ref_optimizer.num_slots
    rng = np.random.default_rng(data_seed)
    weights = rng.standard_normal(n).astype(np.float32)
    ref_weights = weights.copy()
    slots = core_optimizer.initial_slots(n)
    ref_slots = ref_optimizer.initial_slots(n)
    np.testing.assert_array_equal(slots, ref_slots)
    for step in steps:
        grad = rng.standard_normal(n).astype(np.float32)
        core_optimizer.update(weights, slots, grad, step)
        ref_optimizer.update(ref_weights, ref_slots, grad, step)
        np.testing.assert_allclose(weights, ref_weights, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(slots, ref_slots, rtol=RTOL, atol=ATOL)


@settings(max_examples=200, deadline=None)
@given(
    initializer=initializers,
    seed=st.integers(0, 2**64 - 1),
    keys=st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=1, max_size=20),
    dim=st.sampled_from([1, 3, 8, 64, 300]),
)
def test_initial_values_match_reference(initializer, seed, keys, dim):
    table = _core.Table(dim, initializer, None, seed)
    keys = np.array(keys, dtype=np.int64)
    got = table.initial_values(keys)
    expected = reference.initial_rows(initializer, keys, dim, seed)
    if initializer["kind"] in ("zeros", "constant", "uniform"):
        np.testing.assert_array_equal(got, expected)
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    if initializer["kind"] == "truncated_normal":
        stddev = np.float32(initializer["b"])
        # Values are float32: allow one float32 ulp of the mean on top of the
        # 2-stddev truncation (a stddev far below that ulp still rounds).
        mean = np.float32(initializer["a"])
        bound = 2 * stddev * (1 + 1e-6) + np.spacing(np.abs(mean))
        assert (np.abs(got - mean) <= bound).all()


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.sampled_from(KEY_POOL) | st.integers(INT64_MIN, INT64_MAX), max_size=60),
    num_shards=st.integers(1, 40),
)
def test_plan_batch_matches_reference(ids, num_shards):
    ids = np.array(ids, dtype=np.int64)
    keys, offsets, slot = _core.plan_batch(ids, num_shards)
    ref_keys, ref_offsets, ref_slot = reference.plan_batch(ids, num_shards)
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_array_equal(offsets, ref_offsets)
    np.testing.assert_array_equal(slot, ref_slot)
    np.testing.assert_array_equal(
        _core.shard_of(ids, num_shards), reference.hash_shard_of(ids, num_shards)
    )
    unique, inverse = _core.unique_inverse(ids)
    ref_unique, ref_inverse = reference.unique_inverse(ids)
    np.testing.assert_array_equal(unique, ref_unique)
    np.testing.assert_array_equal(inverse, ref_inverse)
