"""The `local` KVStore: the API contract, its errors, and a property against the NumPy model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_store import ReferenceStore

import kvsparse
from kvsparse import errors, initializers, optimizers

EXTREME_IDS = [0, 1, -1, 2**63 - 1, -(2**63), 2**40 + 3, -12345]


@pytest.fixture
def kv():
    store = kvsparse.create("local")
    yield store
    store.close()


def sparse(dim=4, **kw):
    kw.setdefault("initializer", initializers.Zeros())
    return kvsparse.SparseTable(dim=dim, **kw)


# -- the API contract, line by line -----------------------------------------------------------


def test_contract_example_runs(kv, tmp_path):
    ids = np.array([[1, 5], [2**62, -7]])
    kv.init("user", kvsparse.SparseTable(dim=64, initializer=initializers.Normal(0, 0.01), seed=7))
    kv.set_optimizer(optimizers.Adagrad(learning_rate=0.1))
    rows = kv.row_sparse_pull("user", row_ids=ids)
    assert rows.shape == (2, 2, 64) and rows.dtype == np.float32
    out = np.zeros_like(rows)
    assert kv.row_sparse_pull("user", row_ids=ids, out=out) is out
    np.testing.assert_array_equal(out, rows)
    kv.push("user", (ids, np.ones_like(rows)))
    after = kv.row_sparse_pull("user", row_ids=ids)
    # Adagrad's first step moves every element by exactly -lr * g / |g| = -0.1.
    np.testing.assert_allclose(after - rows, -0.1, rtol=1e-5)
    assert kv.rank == 0 and kv.num_workers == 1 and kv.type == "local"
    kv.barrier()
    stats = kv.stats()
    assert stats["tables"]["user"]["rows"] == 4
    assert stats["tables"]["user"]["bytes"] > 4 * 64 * 4 * 2
    path = tmp_path / "opt.npz"
    kv.save_optimizer_states(str(path))
    kv.load_optimizer_states(str(path))


def test_dense_key_push_pull_pushpull_broadcast(kv):
    kv.init(3, np.zeros((4, 4), np.float32))
    g0, g1 = np.ones((4, 4), np.float32), np.full((4, 4), 2, np.float32)
    kv.push(3, [g0, g1])  # no optimizer: the value becomes the sum (MXNet)
    w = np.empty((4, 4), np.float32)
    kv.pull(3, out=w)
    np.testing.assert_array_equal(w, 3)
    kv.set_optimizer(optimizers.SGD(learning_rate=0.5))
    kv.pushpull(3, g0, out=w)
    np.testing.assert_array_equal(w, 2.5)
    v = np.arange(6, dtype=np.float32)
    out = np.empty(6, np.float32)
    kv.broadcast(4, v, out=out)  # a new key: init then pull
    np.testing.assert_array_equal(out, v)


def test_push_without_optimizer_replaces_rows(kv):
    kv.init("t", sparse(2))
    kv.push(
        "t",
        [
            (np.array([5, 5]), np.ones((2, 2), np.float32)),
            (np.array([5]), np.ones((1, 2), np.float32)),
        ],
    )
    np.testing.assert_array_equal(kv.row_sparse_pull("t", row_ids=np.array([5])), [[3, 3]])
    kv.push("t", (np.array([5]), np.full((1, 2), 7, np.float32)))
    np.testing.assert_array_equal(kv.row_sparse_pull("t", row_ids=np.array([5])), [[7, 7]])


def test_extreme_ids_and_any_shape(kv):
    kv.init("t", sparse(3, optimizer=optimizers.SGD(learning_rate=1.0)))
    ids = np.array(EXTREME_IDS * 2).reshape(2, 1, -1)
    grads = np.ones(ids.shape + (3,), np.float32)
    kv.push("t", (ids, grads))
    rows = kv.row_sparse_pull("t", row_ids=ids)
    np.testing.assert_array_equal(rows, -2.0)  # each id appears twice: summed
    assert kv.stats()["tables"]["t"]["rows"] == len(EXTREME_IDS)


def test_pull_of_unseen_ids_does_not_store(kv):
    kv.init("t", kvsparse.SparseTable(dim=8, initializer=initializers.Uniform(-1, 1), seed=3))
    first = kv.row_sparse_pull("t", row_ids=np.arange(1000))
    assert kv.stats()["tables"]["t"]["rows"] == 0
    np.testing.assert_array_equal(first, kv.row_sparse_pull("t", row_ids=np.arange(1000)))
    assert np.abs(first).max() <= 1 and first.std() > 0.3


def test_initial_value_depends_only_on_seed_and_id():
    a, b = kvsparse.create("local"), kvsparse.create("local")
    for store in (a, b):
        store.init(
            "t", kvsparse.SparseTable(dim=16, initializer=initializers.Normal(0, 1), seed=11)
        )
    ids = np.array([9, -4, 2**60])
    a.row_sparse_pull("t", row_ids=ids[::-1])
    b.push("t", (np.array([777]), np.zeros((1, 16), np.float32)))
    np.testing.assert_array_equal(
        a.row_sparse_pull("t", row_ids=ids), b.row_sparse_pull("t", row_ids=ids)
    )


def test_fused_multi_key_calls(kv):
    kv.init(["a", "b"], [sparse(2), sparse(5)])
    kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
    kv.push(
        ["a", "b"],
        [
            (np.array([1]), np.ones((1, 2), np.float32)),
            (np.array([1, 2]), np.ones((2, 5), np.float32)),
        ],
    )
    ra, rb = kv.row_sparse_pull(["a", "b"], row_ids=[np.array([1]), np.array([2, 1, 3])])
    np.testing.assert_array_equal(ra, [[-1, -1]])
    np.testing.assert_array_equal(rb, [[-1] * 5, [-1] * 5, [0] * 5])


def test_dlpack_inputs_and_outputs(kv):
    torch = pytest.importorskip("torch")
    kv.init("t", sparse(4, optimizer=optimizers.SGD(learning_rate=1.0)))
    ids = torch.tensor([3, 4, 3])
    kv.push("t", (ids, torch.ones(3, 4)))
    out = torch.zeros(3, 4)
    kv.row_sparse_pull("t", row_ids=ids, out=out)
    assert out.tolist() == [[-2.0] * 4, [-1.0] * 4, [-2.0] * 4]


# -- errors: the right class, a message naming the key and problem, nothing changed ---------


def test_error_classes_and_messages(kv):
    kv.init("user", sparse(4))
    with pytest.raises(errors.KeyTypeError, match="mixed") as e:
        kv.init(3, np.zeros(2, np.float32))
    assert isinstance(e.value, TypeError)
    with pytest.raises(errors.DuplicateKey, match="'user'"):
        kv.init("user", sparse(5))
    with pytest.raises(KeyError, match="'nope'"):
        kv.row_sparse_pull("nope", row_ids=np.array([1]))
    with pytest.raises(errors.ShapeError, match="'user'") as e:
        kv.push("user", (np.array([1, 2]), np.ones((2, 5), np.float32)))
    assert isinstance(e.value, ValueError)
    with pytest.raises(errors.DTypeError, match="integers") as e:
        kv.row_sparse_pull("user", row_ids=np.array([1.5]))
    assert isinstance(e.value, TypeError)
    with pytest.raises(errors.DTypeError, match="got dtype bool"):  # float64 is converted
        kv.push("user", (np.array([1]), np.ones((1, 4), bool)))
    with pytest.raises(errors.InvalidArgument, match="dim"):
        kvsparse.SparseTable(dim=0)
    with pytest.raises(errors.InvalidArgument, match="dim"):
        kvsparse.SparseTable(dim=4097)
    with pytest.raises(errors.InvalidArgument, match="dense"):
        kv.init("w", np.zeros(3, np.float32))
        kv.row_sparse_pull("w", row_ids=np.array([1]))
    with pytest.raises(errors.InvalidArgument, match="row_sparse_pull"):
        kv.pull("user")
    with pytest.raises(ValueError, match="unknown store kind"):
        kvsparse.create("nonsense")
    assert kv.stats()["tables"]["user"]["rows"] == 0


def test_nonfinite_rejected_atomically_across_keys(kv):
    kv.init(["a", "b"], [sparse(2), sparse(2)])
    kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
    good = (np.array([1]), np.ones((1, 2), np.float32))
    bad = (np.array([7, 8]), np.array([[1, 1], [np.inf, 0]], np.float32))
    with pytest.raises(errors.NonFiniteGradient, match=r"key 'b'.*id 8"):
        kv.push(["a", "b"], [good, bad])
    assert kv.stats()["tables"]["a"]["rows"] == 0  # 'a' was not applied either
    kv.init(
        5 if False else "c",
        sparse(2, nonfinite="skip", optimizer=optimizers.SGD(learning_rate=1.0)),
    )
    kv.push("c", bad)
    np.testing.assert_array_equal(
        kv.row_sparse_pull("c", row_ids=np.array([7, 8])), [[-1, -1], [0, 0]]
    )
    assert kv.stats()["tables"]["c"]["rows"] == 1


def test_shape_error_in_one_key_changes_no_key(kv):
    kv.init(["a", "b"], [sparse(2), sparse(3)])
    with pytest.raises(errors.ShapeError):
        kv.push(
            ["a", "b"],
            [
                (np.array([1]), np.ones((1, 2), np.float32)),
                (np.array([1]), np.ones((1, 2), np.float32)),
            ],
        )
    assert kv.stats()["tables"]["a"]["rows"] == 0


def test_read_only_inputs(kv):
    kv.init("t", sparse(2))
    ids = np.array([1, 2])
    grads = np.ones((2, 2), np.float32)
    ids.setflags(write=False)
    grads.setflags(write=False)
    kv.push("t", (ids, grads))
    out = np.empty((2, 2), np.float32)
    out.setflags(write=False)
    with pytest.raises(errors.InvalidArgument, match="read-only"):
        kv.row_sparse_pull("t", row_ids=ids, out=out)


def test_optimizer_states_roundtrip_without_optimizer(kv, tmp_path):
    # A dense key with no optimizer has no slots; saving and loading must still work.
    kv.init("w", np.zeros(5, np.float32))
    kv.init("t", sparse(3))
    kv.push("t", (np.array([4]), np.ones((1, 3), np.float32)))
    path = str(tmp_path / "none.npz")
    kv.save_optimizer_states(path)
    kv.load_optimizer_states(path)
    np.testing.assert_array_equal(kv.row_sparse_pull("t", row_ids=np.array([4])), [[1, 1, 1]])


def test_optimizer_states_roundtrip(kv, tmp_path):
    kv.init("t", sparse(3))
    kv.init("w", np.zeros(5, np.float32))
    kv.set_optimizer(optimizers.Adam(learning_rate=0.1))
    for step in range(3):
        kv.push("t", (np.array([1, 2 + step]), np.ones((2, 3), np.float32)))
        kv.push("w", np.ones(5, np.float32))
    saved = tmp_path / "saved.npz"
    kv.save_optimizer_states(str(saved))
    kv.push("t", (np.array([1, 9]), np.ones((2, 3), np.float32)))  # moves slots and steps on
    kv.push("w", np.ones(5, np.float32))
    kv.load_optimizer_states(str(saved))
    again = tmp_path / "again.npz"
    kv.save_optimizer_states(str(again))
    with np.load(saved) as a, np.load(again) as b:
        assert set(a.files) == set(b.files)
        for name in a.files:
            if name.endswith("_keys") or name == "meta":
                continue
            # Row 9 was inserted after the save: its state is new, the rest restored.
            if name.endswith("_slots") and a[name].ndim == 3:
                keys_a, keys_b = (
                    a[name.replace("_slots", "_keys")],
                    b[name.replace("_slots", "_keys")],
                )
                pos = {int(k): i for i, k in enumerate(keys_b)}
                np.testing.assert_array_equal(a[name], b[name][[pos[int(k)] for k in keys_a]])
            elif name.endswith("_steps"):
                keys_a, keys_b = (
                    a[name.replace("_steps", "_keys")],
                    b[name.replace("_steps", "_keys")],
                )
                pos = {int(k): i for i, k in enumerate(keys_b)}
                np.testing.assert_array_equal(a[name], b[name][[pos[int(k)] for k in keys_a]])
            else:
                np.testing.assert_array_equal(a[name], b[name])
    with pytest.raises(KeyError, match="'t'"):
        fresh = kvsparse.create("local")
        fresh.load_optimizer_states(str(saved))


# -- property: the local store equals the NumPy model of the store ----------------------------

OPTIMIZER_SPECS = [
    None,
    optimizers.SGD(learning_rate=0.5),
    optimizers.SGD(learning_rate=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    optimizers.Adagrad(learning_rate=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    optimizers.Adam(learning_rate=0.01, weight_decay=0.001),
    optimizers.Adam(learning_rate=0.01, step_mode="table"),
    optimizers.AdamW(learning_rate=0.01, clip_gradient=0.5),
    optimizers.RMSProp(learning_rate=0.01, centered=True, momentum=0.5),
    optimizers.Ftrl(learning_rate=0.1, l1=0.01, l2=0.1, rescale_grad=0.5),
]

ids_strategy = st.lists(st.sampled_from(EXTREME_IDS + list(range(2, 12))), min_size=0, max_size=12)


@st.composite
def operations(draw):
    ops = []
    dims = {"a": draw(st.sampled_from([1, 3, 8])), "b": draw(st.sampled_from([2, 16]))}
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["push", "push", "push", "pull", "dense", "opt"]))
        if kind in ("push", "pull"):
            key = draw(st.sampled_from(["a", "b"]))
            ids = draw(ids_strategy)
            scale = draw(st.sampled_from([0.5, 1.0, -2.0]))
            ops.append((kind, key, ids, scale))
        elif kind == "dense":
            ops.append((kind, draw(st.floats(-2, 2, width=32))))
        else:
            ops.append((kind, draw(st.integers(0, len(OPTIMIZER_SPECS) - 1))))
    return dims, draw(st.integers(0, len(OPTIMIZER_SPECS) - 1)), ops


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations())
def test_local_store_matches_numpy_model(case):
    dims, first_optimizer, ops = case
    kv, ref = kvsparse.create("local"), ReferenceStore()
    tables = {
        "a": kvsparse.SparseTable(dim=dims["a"], initializer=initializers.Uniform(-1, 1), seed=5),
        "b": kvsparse.SparseTable(
            dim=dims["b"],
            initializer=initializers.TruncatedNormal(0, 0.5),
            seed=9,
            optimizer=optimizers.Adagrad(learning_rate=0.2),
        ),
    }
    for store in (kv, ref):
        opt = OPTIMIZER_SPECS[first_optimizer]
        if opt is not None:
            store.set_optimizer(opt if store is kv else opt.to_dict())
        for name, table in tables.items():
            store.init(name, table)
        store.init("w", np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3))
    seen = {"a": set(), "b": set()}
    rng = np.random.default_rng(0)
    for op in ops:
        if op[0] == "push":
            _, key, ids, scale = op
            dim = dims[key]
            grads = (rng.standard_normal((len(ids), dim)) * scale).astype(np.float32)
            value = (np.array(ids, np.int64), grads)
            kv.push(key, value)
            ref.push(key, value)
            seen[key].update(ids)
        elif op[0] == "pull":
            _, key, ids, _ = op
            ids = np.array(ids, np.int64)
            np.testing.assert_allclose(
                kv.row_sparse_pull(key, row_ids=ids),
                ref.row_sparse_pull(key, ids),
                rtol=1e-5,
                atol=1e-6,
            )
        elif op[0] == "dense":
            grads = [np.full((2, 3), op[1], np.float32), np.ones((2, 3), np.float32)]
            kv.push("w", grads)
            ref.push("w", grads)
        else:
            opt = OPTIMIZER_SPECS[op[1]]
            kv.set_optimizer(opt)
            ref.set_optimizer(None if opt is None else opt.to_dict())
    for key in ("a", "b"):
        ids = np.array(sorted(seen[key]) + [424242], np.int64)
        np.testing.assert_allclose(
            kv.row_sparse_pull(key, row_ids=ids),
            ref.row_sparse_pull(key, ids),
            rtol=1e-5,
            atol=1e-6,
        )
        assert kv.stats()["tables"][key]["rows"] == len(ref.tables[key][0])
    np.testing.assert_allclose(kv.pull("w"), ref.pull("w"), rtol=1e-5, atol=1e-6)
    # Slots and step counters too, through the public optimizer-state file.
    state = kv._backend.state.optimizer_state()  # noqa: SLF001 - white-box check of slots
    from kvsparse.placement import table_id_of

    for key in ("a", "b"):
        table, _ = ref.tables[key]
        entry = state[table_id_of(key)]
        for k, slots, step in zip(entry["keys"], entry["slots"], entry["steps"]):
            np.testing.assert_allclose(slots, table.slots[int(k)], rtol=1e-5, atol=1e-6)
            assert step == table.steps[int(k)]


@pytest.mark.parametrize("call", ["save", "export"])
def test_a_local_save_to_an_unusable_path_is_a_checkpoint_error_and_loses_nothing(
    kv, tmp_path, call
):
    """As a server answers it: a path under a regular file is the request's problem
    (CheckpointError naming the path), not a raw OSError; the store goes on, and a save to
    a good path afterwards restores every row."""
    kv.init("t", kvsparse.SparseTable(dim=2, initializer=initializers.Zeros()))
    kv.push("t", (np.array([1, 2]), np.ones((2, 2), np.float32)))
    (tmp_path / "file").write_text("not a directory")
    bad = tmp_path / "file" / "ckpt"
    with pytest.raises(errors.CheckpointError, match=str(tmp_path / "file")):
        getattr(kv, call)(bad)
    rows = kv.row_sparse_pull("t", row_ids=np.array([1, 2]))
    kv.save(tmp_path / "good")
    kv.push("t", (np.array([1]), np.ones((1, 2), np.float32)))
    kv.load(tmp_path / "good")
    np.testing.assert_array_equal(kv.row_sparse_pull("t", row_ids=np.array([1, 2])), rows)


def test_a_closed_local_store_refuses_every_call(tmp_path):
    # A closed store that took init and save wrote a manifest listing an empty table.
    kv = kvsparse.create("local")
    kv.init("t", sparse(2))
    kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
    kv.push("t", (np.array([1]), np.ones((1, 2), np.float32)))
    kv.close()
    kv.close()  # idempotent
    calls = {
        "init": lambda: kv.init("u", sparse(2)),
        "save": lambda: kv.save(str(tmp_path / "ckpt")),
        "pull": lambda: kv.row_sparse_pull("t", row_ids=np.array([1])),
        "push": lambda: kv.push("t", (np.array([1]), np.ones((1, 2), np.float32))),
        "set_optimizer": lambda: kv.set_optimizer(optimizers.SGD(learning_rate=0.5)),
        "stats": kv.stats,
        "barrier": kv.barrier,
        "export": lambda: kv.export(str(tmp_path / "export")),
    }
    for name, call in calls.items():
        with pytest.raises(errors.InvalidArgument, match="this store is closed"):
            call()
            pytest.fail(f"{name} worked on a closed store")
    assert not (tmp_path / "ckpt").exists()


def test_init_twice_identically_is_a_no_op(kv):
    kv.init("t", sparse(2, seed=3))
    kv.init("w", np.ones(3, np.float32))
    kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
    kv.push("t", (np.array([1]), np.ones((1, 2), np.float32)))
    kv.init("t", sparse(2, seed=3))  # identical: the rows stay
    kv.init(["t", "w"], [sparse(2, seed=3), np.ones(3, np.float32)])
    assert kv.row_sparse_pull("t", row_ids=np.array([1])).tolist() == [[-1.0, -1.0]]
    for different in (sparse(3, seed=3), sparse(2, seed=4), np.ones(2, np.float32)):
        with pytest.raises(errors.DuplicateKey, match="'t'"):
            kv.init("t", different)
    with pytest.raises(errors.DuplicateKey, match="'w'"):
        kv.init("w", np.ones(4, np.float32))
    with pytest.raises(errors.DuplicateKey, match="twice"):
        kv.init(["v", "v"], [sparse(2), sparse(2)])
    assert "v" not in kv


def test_stats_names_int_keys_by_the_int_every_call_takes(kv):
    # stats() named them '7', which row_sparse_pull refuses (KeyTypeError: str key).
    kv.init([7, 8], [sparse(2), np.ones(3, np.float32)])
    kv.set_optimizer(optimizers.SGD(learning_rate=1.0))
    kv.push(7, (np.array([1, 2]), np.ones((2, 2), np.float32)))
    stats = kv.stats()
    assert sorted(stats["tables"]) == [7, 8]
    assert sorted(stats["shards"][0]["tables"]) == [7, 8]
    for name, table in stats["tables"].items():
        if table["kind"] == "sparse":
            assert table["rows"] == 2
            assert kv.row_sparse_pull(name, row_ids=np.array([1])).tolist() == [[-1.0, -1.0]]
        else:
            assert kv.pull(name).tolist() == [1.0] * 3
