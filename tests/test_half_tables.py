"""Half-precision tables and dense keys: float16 / bfloat16 storage, float32 math.

- The core's 16-bit tables against tests/reference.py's ReferenceHalfTable (the
  rounding rule: widen exactly, update in float32, round to nearest even once
  per write) and against the float32 table (within that rounding), hypothesis.
- Stores: pulls in the table's dtype or float32, pushes of f16/bf16/f32
  gradients, local and dist alike; fp16/bf16 dense keys (small, 1200 x 1200),
  multi_precision's float32 master copy; checkpoints and exports keep the dtype.
- torch: Embedding(dtype=torch.half) against nn.Embedding(dtype=torch.half).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvsparse
from kvsparse import _core, errors, initializers, optimizers
from kvsparse.serving import EmbeddingLookup

HALF = ["float16", "bfloat16"]
# Relative spacing of each dtype (one ulp at 1.0) and its smallest step near 0.
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23}
TINY = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149}
NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def as_dtype(values, dtype):
    return np.asarray(values, np.float32).astype(NUMPY[dtype])


# ---------------------------------------------------------------------------
# Core, hypothesis
# ---------------------------------------------------------------------------


@st.composite
def optimizer_specs(draw):
    kind = draw(st.sampled_from([None, "sgd", "adagrad", "adam", "rmsprop"]))
    spec = {"kind": kind, "learning_rate": draw(st.floats(1e-3, 0.1))}
    if kind == "sgd":
        spec["momentum"] = draw(st.sampled_from([0.0, 0.9]))
    if kind == "adam":
        spec["step_mode"] = draw(st.sampled_from(["row", "table"]))
    if draw(st.booleans()):
        spec["multi_precision"] = True
    return spec


@st.composite
def half_cases(draw):
    dim = draw(st.sampled_from([1, 3, 8, 17]))
    n_ops = draw(st.integers(1, 6))
    ops = []
    for _ in range(n_ops):
        kind = draw(st.sampled_from(["push", "push", "push", "assign", "lookup"]))
        ids = draw(st.lists(st.integers(-4, 12), min_size=1, max_size=6))
        rows = draw(
            st.lists(
                st.lists(st.floats(-2, 2, width=32), min_size=dim, max_size=dim),
                min_size=len(ids),
                max_size=len(ids),
            )
        )
        ops.append(
            (kind, ids, np.array(rows, np.float32), draw(st.sampled_from(HALF + ["float32"])))
        )
    return {
        "dim": dim,
        "dtype": draw(st.sampled_from(HALF)),
        "slot_dtype": draw(st.sampled_from(["float32", "float32", "bfloat16", "float16"])),
        "optimizer": draw(optimizer_specs()),
        "initializer": draw(
            st.sampled_from(
                [{"kind": "uniform", "a": -1.0, "b": 1.0}, {"kind": "normal", "b": 0.5}]
            )
        ),
        "ops": ops,
    }


def _bound(dtype, scale, writes):
    """What `writes` roundings to dtype can move a value of magnitude <= scale by."""
    return writes * (EPS[dtype] * scale + TINY[dtype])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(half_cases())
def test_half_table_matches_the_reference_and_the_float32_table(case):
    dim, dtype, slot_dtype = case["dim"], case["dtype"], case["slot_dtype"]
    args = (dim, case["initializer"], case["optimizer"], 7)
    table = _core.Table(*args, dtype=dtype, slot_dtype=slot_dtype)
    ref = reference.ReferenceHalfTable(*args, dtype=dtype, slot_dtype=slot_dtype)
    wide = _core.Table(*args)  # the float32 table it approximates
    writes = 1  # the initial value's rounding
    scale = 1.0
    for kind, ids, rows, grad_dtype in case["ops"]:
        keys = np.array(ids, np.int64)
        if kind == "push":
            # Pushed in grad_dtype, summed in float32 by the store: the core takes float32.
            grads = as_dtype(rows, grad_dtype).astype(np.float32)
            for t in (table, ref, wide):
                t.apply_gradients(keys, grads)
            writes += 1
        elif kind == "assign":
            for t in (table, ref, wide):
                t.assign(keys, rows)
            writes += 1
        got = table.lookup(keys)
        # Every value a 16-bit table gives is of its dtype.
        np.testing.assert_array_equal(got, as_dtype(got, dtype).astype(np.float32))
        scale = max(scale, float(np.abs(wide.lookup(keys)).max()))
        # The model rounds like the core; the float32 math of both agrees to ~1e-6
        # (test_core_properties), which may flip one rounding: a few ulps at most.
        np.testing.assert_allclose(got, ref.lookup(keys), rtol=0, atol=_bound(dtype, scale, 2))
    keys = np.arange(-4, 13, dtype=np.int64)
    got, ref_rows = table.lookup(keys), ref.lookup(keys)
    np.testing.assert_allclose(got, ref_rows, rtol=0, atol=_bound(dtype, scale, 2))
    if case["optimizer"].get("multi_precision"):
        # The master copy is the float32 table's row (the same math from the same start,
        # slots aside), and the 16-bit value is it rounded once.
        assert table.num_slots == ref.num_slots == wide.num_slots + 1
        stored = np.array(sorted(ref.rows), np.int64)
        master = table.read_state(stored)[1][:, -1]
        np.testing.assert_array_equal(table.lookup(stored), reference.round_to(master, dtype))
        np.testing.assert_allclose(
            master, ref.read_state(stored)[1][:, -1], rtol=0, atol=_bound(dtype, scale, 2)
        )
        if slot_dtype == "float32":
            np.testing.assert_array_equal(master, wide.lookup(stored))
    elif slot_dtype == "float32" and case["optimizer"]["kind"] in (None, "sgd", "adagrad", "adam"):
        # Their slots depend on the gradients only, so the 16-bit table is the float32 one
        # up to one rounding of the value per write.
        np.testing.assert_allclose(
            got, wide.lookup(keys), rtol=0, atol=_bound(dtype, scale, writes)
        )


@pytest.mark.parametrize("dtype", HALF)
def test_half_table_bytes_and_state_round_trip(dtype):
    f32 = _core.Table(64, {"kind": "uniform", "a": -1, "b": 1}, {"kind": "adagrad"}, 1)
    half = _core.Table(
        64, {"kind": "uniform", "a": -1, "b": 1}, {"kind": "adagrad"}, 1, dtype=dtype
    )
    both = _core.Table(
        64,
        {"kind": "uniform", "a": -1, "b": 1},
        {"kind": "adagrad"},
        1,
        dtype=dtype,
        slot_dtype=dtype,
    )
    keys = np.arange(12 * 8192, dtype=np.int64)  # whole chunks (8192 rows of dim 64)
    grads = np.full((keys.size, 64), 0.25, np.float32)
    for t in (f32, half, both):
        t.apply_gradients(keys, grads)
    rows = lambda t: t.memory_bytes() - t.scratch_bytes()  # noqa: E731
    # Values halve; with f32 slots the rest stays: (2 + 4) / (4 + 4) of the row bytes.
    # With 16-bit slots too: (128 + 128 + ~25 bytes of map and counters) / (512 + ~25).
    assert rows(half) < 0.8 * rows(f32)
    assert rows(both) <= 0.55 * rows(f32)
    values, slots, steps = half.read_state(keys[:10])
    other = _core.Table(64, {"kind": "zeros"}, {"kind": "adagrad"}, 0, dtype=dtype)
    other.write_state(keys[:10], values, slots, steps)
    np.testing.assert_array_equal(other.lookup(keys[:10]), half.lookup(keys[:10]))


def test_float16_overflow_is_refused_and_changes_nothing():
    table = _core.Table(
        2,
        {"kind": "constant", "a": 60000.0},
        {"kind": "sgd", "learning_rate": 1.0},
        0,
        dtype="float16",
    )
    keys = np.array([1], np.int64)
    table.lookup_or_insert(keys)
    before = table.lookup(keys)
    with pytest.raises(errors.UpdateOverflow, match="float16"):
        table.apply_gradients(keys, np.full((1, 2), -10000.0, np.float32))
    np.testing.assert_array_equal(table.lookup(keys), before)
    with pytest.raises(errors.InvalidArgument, match="dtype"):
        _core.Table(2, dtype="int8")


# ---------------------------------------------------------------------------
# Stores: local and dist
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_servers(module_server_factory):
    return module_server_factory(2)


@pytest.fixture(params=["local", "dist"])
def kv(request, two_servers):
    if request.param == "local":
        store = kvsparse.create("local")
    else:
        store = kvsparse.create(
            "dist_sparse", servers=two_servers, rank=0, num_workers=1, timeout=60
        )
        store.set_optimizer(None)
    yield store
    store.close()


_names = iter(range(10**9))


def fresh(prefix="h"):
    return f"{prefix}{next(_names)}"


@pytest.mark.parametrize("dtype", HALF)
def test_sparse_pull_push_in_the_table_dtype(kv, dtype):
    key, wide_key = fresh(), fresh()
    opt = optimizers.Adagrad(learning_rate=0.1)
    init = initializers.Normal(0, 0.5)
    kv.init(key, kvsparse.SparseTable(8, initializer=init, optimizer=opt, seed=3, dtype=dtype))
    kv.init(wide_key, kvsparse.SparseTable(8, initializer=init, optimizer=opt, seed=3))
    ref = reference.ReferenceHalfTable(8, init.to_dict(), opt.to_dict(), 3, dtype=dtype)
    ids = np.array([[5, -2], [5, 2**40]])
    rows = kv.row_sparse_pull(key, row_ids=ids)
    assert rows.dtype == NUMPY[dtype] and rows.shape == (2, 2, 8)
    rng = np.random.default_rng(0)
    for grad_dtype in ("float16", "bfloat16", "float32"):
        grads = as_dtype(rng.standard_normal((2, 2, 8)), grad_dtype)
        kv.push([key, wide_key], [(ids, grads), (ids, grads)])
        flat = grads.astype(np.float32).reshape(4, 8)
        ref.apply_gradients(ids.reshape(-1), flat)
    got = kv.row_sparse_pull(key, row_ids=ids, dtype="float32")
    assert got.dtype == np.float32
    np.testing.assert_allclose(got.reshape(4, 8), ref.lookup(ids.reshape(-1)), rtol=0, atol=1e-2)
    wide = kv.row_sparse_pull(wide_key, row_ids=ids)
    np.testing.assert_allclose(got, wide, rtol=0, atol=_bound(dtype, 2.0, 4))
    # An out of the table's dtype gets the bits; a float32 out widens.
    out16 = np.empty((2, 2, 8), NUMPY[dtype])
    kv.row_sparse_pull(key, row_ids=ids, out=out16)
    np.testing.assert_array_equal(out16.astype(np.float32), got)
    with pytest.raises(errors.DTypeError):
        kv.row_sparse_pull(key, row_ids=ids, out=np.empty((2, 2, 8), np.float64))
    assert kv.key_info(key).dtype == dtype


@pytest.mark.parametrize("shape", [(3,), (1200, 1200)], ids=["small", "1200x1200"])
@pytest.mark.parametrize("dtype", HALF)
def test_dense_half_keys_push_pull(kv, shape, dtype):
    key = fresh("d")
    rng = np.random.default_rng(1)
    start = as_dtype(rng.standard_normal(shape), dtype)
    kv.init(key, start)
    assert kv.pull(key).dtype == NUMPY[dtype]
    np.testing.assert_array_equal(kv.pull(key), start)
    opt = optimizers.SGD(learning_rate=0.1, rescale_grad=0.5)
    kv.set_optimizer(opt, key=key)
    expected = start.astype(np.float32)
    for _ in range(2):
        grad = as_dtype(rng.standard_normal(shape), dtype)
        kv.push(key, grad)
        # float32 math, one rounding per update (the master is the rounded value).
        expected = reference.round_to(
            expected - np.float32(0.1) * (np.float32(0.5) * grad.astype(np.float32)), dtype
        )
    got = kv.pull(key)
    assert got.dtype == NUMPY[dtype] and got.shape == shape
    np.testing.assert_allclose(got.astype(np.float32), expected, rtol=EPS[dtype], atol=TINY[dtype])
    out = np.empty(shape, np.float32)
    kv.pull(key, out=out)
    np.testing.assert_array_equal(out, got.astype(np.float32))
    assert kv.stats()["tables"][key]["bytes"] == int(np.prod(shape)) * 2


def test_multi_precision_keeps_a_float32_master(kv):
    key, plain = fresh("m"), fresh("m")
    kv.init([key, plain], [np.zeros(4, np.float16), np.zeros(4, np.float16)])
    kv.set_optimizer(optimizers.SGD(learning_rate=1.0, multi_precision=True), key=key)
    kv.set_optimizer(optimizers.SGD(learning_rate=1.0), key=plain)
    tiny = np.full(4, -1e-4, np.float16)  # far below half an ulp of 1.0 in float16
    kv.push([key, plain], [np.full(4, -1.0, np.float16)] * 2)
    for _ in range(10):
        kv.push([key, plain], [tiny, tiny])
    # Without a master the tiny steps round away; with one they add up (1 + 1e-3).
    np.testing.assert_array_equal(kv.pull(plain), np.ones(4, np.float16))
    assert float(kv.pull(key)[0]) == float(np.float16(np.float32(1) + np.float32(1e-4) * 10))


@pytest.mark.parametrize("dtype", HALF)
def test_multi_precision_sparse_rows_keep_a_float32_master(dtype):
    """Ten steps of 1e-4 add up on a 16-bit table with multi_precision, and round away
    without (MXNet's float16 row_sparse weights), in the core as in the NumPy model."""
    sgd = {"kind": "sgd", "learning_rate": 1.0}
    tables = {}
    for multi in (False, True):
        spec = dict(sgd, multi_precision=True) if multi else sgd
        args = (4, {"kind": "zeros"}, spec, 0)
        tables[multi] = (
            _core.Table(*args, dtype=dtype),
            reference.ReferenceHalfTable(*args, dtype=dtype),
        )
    keys = np.array([3, -7], np.int64)
    for table, ref in tables.values():
        for grad in [-1.0] + [-1e-4] * 10:
            for t in (table, ref):
                t.apply_gradients(keys, np.full((2, 4), grad, np.float32))
        np.testing.assert_array_equal(table.lookup(keys), ref.lookup(keys))
    total = np.float32(1)
    for _ in range(10):
        total = total + np.float32(1e-4)
    plain, multi = tables[False][0], tables[True][0]
    assert plain.num_slots == 0 and multi.num_slots == 1
    np.testing.assert_array_equal(plain.lookup(keys), np.ones((2, 4), np.float32))
    np.testing.assert_array_equal(
        multi.lookup(keys), reference.round_to(np.full((2, 4), total), dtype)
    )
    if dtype == "float16":
        assert multi.lookup(keys)[0, 0] > 1  # bfloat16's ulp (2**-7) is too coarse for 1e-3
    # The master is the last slot of the state: read, written, and a float32 table has none.
    values, slots, steps = multi.read_state(keys)
    np.testing.assert_array_equal(slots[:, -1], np.full((2, 4), total))
    other = _core.Table(4, {"kind": "zeros"}, dict(sgd, multi_precision=True), 0, dtype=dtype)
    other.write_state(keys, values, slots, steps)
    for t in (multi, other):
        t.apply_gradients(keys, np.full((2, 4), -1e-4, np.float32))
    np.testing.assert_array_equal(other.read_state(keys)[1], multi.read_state(keys)[1])
    np.testing.assert_array_equal(other.lookup(keys), multi.lookup(keys))
    # The two-step push of multi-table requests: a cancel puts the masters back too.
    before = multi.read_state(keys)
    multi.begin_push(np.append(keys, 11), np.full((3, 4), -1e-4, np.float32))
    multi.cancel_push()
    for got, was in zip(multi.read_state(keys), before):
        np.testing.assert_array_equal(got, was)
    assert len(multi) == 2
    multi.begin_push(np.append(keys, 11), np.full((3, 4), -1e-4, np.float32))
    multi.finish_push()
    other.apply_gradients(np.append(keys, 11), np.full((3, 4), -1e-4, np.float32))
    all_keys = np.append(keys, 11)
    for got, want in zip(multi.read_state(all_keys), other.read_state(all_keys)):
        np.testing.assert_array_equal(got, want)
    wide = _core.Table(4, {"kind": "zeros"}, dict(sgd, multi_precision=True), 0)
    assert wide.num_slots == 0


@pytest.mark.parametrize("dtype", HALF)
def test_multi_precision_master_of_new_assigned_and_reoptimized_rows(dtype):
    init = {"kind": "uniform", "a": -1.0, "b": 1.0}
    adam = {"kind": "adam", "learning_rate": 1e-3, "multi_precision": True}
    table = _core.Table(8, init, adam, 5, dtype=dtype)
    ref = reference.ReferenceHalfTable(8, init, adam, 5, dtype=dtype)
    wide = _core.Table(8, init, adam, 5)
    rng = np.random.default_rng(2)
    keys = np.arange(6, dtype=np.int64)
    assigned = rng.standard_normal((2, 8)).astype(np.float32)
    for t in (table, ref, wide):
        t.lookup_or_insert(keys[:2])  # a new row's master: its float32 initial value
        t.assign(keys[2:4], assigned)  # an assigned row's: the values given
    for _ in range(5):
        grads = rng.standard_normal((6, 8)).astype(np.float32)
        for t in (table, ref, wide):
            t.apply_gradients(keys, grads)  # rows 4 and 5 are new in the push
    # The master runs the float32 table's math exactly; the value is it rounded once.
    master = table.read_state(keys)[1][:, -1]
    np.testing.assert_array_equal(master, wide.lookup(keys))
    np.testing.assert_array_equal(table.lookup(keys), reference.round_to(master, dtype))
    np.testing.assert_allclose(master, ref.read_state(keys)[1][:, -1], rtol=1e-6, atol=1e-7)
    # set_optimizer keeps a master it has; turning multi_precision on makes one from the
    # stored values, and off drops it.
    table.set_optimizer(dict(adam, learning_rate=0.5))
    np.testing.assert_array_equal(table.read_state(keys)[1][:, -1], master)
    table.set_optimizer({"kind": "sgd", "learning_rate": 1.0})
    assert table.num_slots == 0
    stored = table.lookup(keys)
    table.set_optimizer({"kind": "sgd", "learning_rate": 1.0, "multi_precision": True})
    np.testing.assert_array_equal(table.read_state(keys)[1][:, 0], stored)
    # An update that rounds to inf overflows, with the master put back too.
    if dtype == "float16":
        before = table.read_state(keys)
        with pytest.raises(errors.UpdateOverflow, match="float16"):
            table.apply_gradients(keys[:1], np.full((1, 8), -70000.0, np.float32))
        for got, was in zip(table.read_state(keys), before):
            np.testing.assert_array_equal(got, was)


@pytest.mark.parametrize("dtype", HALF)
def test_multi_precision_sparse_table_in_stores(kv, dtype, tmp_path):
    key, plain = fresh("ms"), fresh("ms")
    sgd = optimizers.SGD(learning_rate=1.0, multi_precision=True)
    zeros = initializers.Zeros()
    kv.init(key, kvsparse.SparseTable(4, initializer=zeros, optimizer=sgd, dtype=dtype))
    kv.init(
        plain,
        kvsparse.SparseTable(
            4, initializer=zeros, optimizer=optimizers.SGD(learning_rate=1.0), dtype=dtype
        ),
    )
    ids = np.array([1, 2**40, -5])
    tiny = np.full((3, 4), -1e-4, np.float32)
    kv.push([key, plain], [(ids, np.full((3, 4), -1.0, np.float16))] * 2)
    for _ in range(5):
        kv.push([key, plain], [(ids, tiny)] * 2)
    np.testing.assert_array_equal(kv.row_sparse_pull(plain, row_ids=ids), np.ones((3, 4)))
    kv.save(str(tmp_path / "ckpt"))
    states = str(tmp_path / "states.npz")
    kv.save_optimizer_states(states)
    for _ in range(5):
        kv.push(key, (ids, tiny))
    after = kv.row_sparse_pull(key, row_ids=ids)
    total = np.float32(1)
    for _ in range(10):
        total = total + np.float32(1e-4)
    np.testing.assert_array_equal(
        after.astype(np.float32), reference.round_to(np.full((3, 4), total), dtype)
    )
    # A checkpoint keeps the master: the five steps after a load land where they did.
    kv.load(str(tmp_path / "ckpt"))
    for _ in range(5):
        kv.push(key, (ids, tiny))
    np.testing.assert_array_equal(kv.row_sparse_pull(key, row_ids=ids), after)
    # So do the optimizer states (MXNet keeps its float32 copy there too).
    kv.load_optimizer_states(states)
    for _ in range(5):
        kv.push(key, (ids, tiny))
    np.testing.assert_array_equal(kv.row_sparse_pull(key, row_ids=ids), after)


def test_checkpoint_and_export_keep_the_dtype(kv, tmp_path):
    sparse, bf, dense = fresh(), fresh(), fresh("d")
    kv.init(sparse, kvsparse.SparseTable(4, seed=1, dtype="float16"))
    kv.init(bf, kvsparse.SparseTable(4, seed=1, dtype="bfloat16", slot_dtype="bfloat16"))
    kv.init(dense, np.linspace(-1, 1, 6).astype(ml_dtypes.bfloat16))
    kv.set_optimizer(optimizers.Adam(learning_rate=0.01), key=[sparse, bf, dense])
    ids = np.arange(10)
    kv.push([sparse, bf], [(ids, np.ones((10, 4), np.float16))] * 2)
    kv.push(dense, np.ones(6, np.float32))
    kv.save(str(tmp_path / "ckpt"))
    before = [kv.row_sparse_pull(k, row_ids=ids) for k in (sparse, bf)], kv.pull(dense)
    kv.push([sparse, bf], [(ids, np.ones((10, 4), np.float16))] * 2)
    kv.load(str(tmp_path / "ckpt"))
    assert [kv.key_info(k).dtype for k in (sparse, bf, dense)] == [
        "float16",
        "bfloat16",
        "bfloat16",
    ]
    for k, rows in zip((sparse, bf), before[0]):
        got = kv.row_sparse_pull(k, row_ids=ids)
        assert got.dtype == rows.dtype
        np.testing.assert_array_equal(got, rows)
    np.testing.assert_array_equal(kv.pull(dense), before[1])
    kv.export(str(tmp_path / "export"), tables=[sparse, bf])
    served = EmbeddingLookup(str(tmp_path / "export"), default="initializer")
    for k, rows in zip((sparse, bf), before[0]):
        got = served.lookup(k, ids)
        assert got.dtype == rows.dtype
        np.testing.assert_array_equal(got, rows)
    # An id never stored: the table's initial value, rounded as the table rounds it.
    np.testing.assert_array_equal(
        served.lookup(sparse, [999]), kv.row_sparse_pull(sparse, row_ids=np.array([999]))
    )


# ---------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------


def test_torch_embedding_half_matches_nn_embedding_half():
    torch = pytest.importorskip("torch")
    from kvsparse.adapters.torch import Embedding

    kv = kvsparse.create("local")
    emb = Embedding(
        kv,
        "e",
        8,
        dtype=torch.half,
        initializer=initializers.Uniform(-1, 1),
        seed=5,
        optimizer=optimizers.SGD(learning_rate=0.5),
    )
    ref = torch.nn.Embedding(20, 8, dtype=torch.half, sparse=True)
    with torch.no_grad():
        ref.weight[:] = torch.from_numpy(kv.row_sparse_pull("e", row_ids=np.arange(20)))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        # Distinct ids: torch adds a duplicated id's gradients to a float16 weight one at a
        # time (a rounding each); the store sums them in float32 and rounds once.
        ids = torch.randperm(20, generator=gen)[:12].view(4, 3)
        target = torch.randn(4, 3, 8, generator=gen)
        ours, theirs = emb(ids), ref(ids)
        assert ours.dtype == torch.half
        assert torch.equal(ours, theirs)
        ((ours.float() - target) ** 2).sum().backward()
        opt.zero_grad()
        ((theirs.float() - target) ** 2).sum().backward()
        opt.step()
    stored = torch.from_numpy(kv.row_sparse_pull("e", row_ids=np.arange(20)))
    # torch's CPU half SGD computes w - lr * g in float32 and rounds once, as the servers do.
    assert torch.equal(stored, ref.weight.detach())
