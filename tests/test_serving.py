"""Inference export and `kvsparse.serving.EmbeddingLookup`."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import kvsparse
from kvsparse import errors, initializers, optimizers
from kvsparse.serving import EmbeddingLookup


def _trained(kv):
    kv.init(
        "user",
        kvsparse.SparseTable(
            dim=6,
            initializer=initializers.Normal(0.1),
            optimizer=optimizers.create("adam", learning_rate=0.05),
            seed=11,
        ),
    )
    kv.init("item", kvsparse.SparseTable(dim=3, seed=12))
    kv.init("dense", np.ones(4, np.float32))
    rng = np.random.default_rng(0)
    ids = rng.integers(-(2**62), 2**62, 500)  # any int64, negative ones too
    kv.push("user", (ids, rng.normal(size=(ids.size, 6)).astype(np.float32)))
    kv.push("item", (ids[:50], rng.normal(size=(50, 3)).astype(np.float32)))
    return ids


@pytest.mark.parametrize("num_servers", [0, 2])
def test_export_round_trip(server_factory, tmp_path, num_servers):
    if num_servers:
        kv = kvsparse.create("dist_sparse", servers=server_factory(num_servers))
    else:
        kv = kvsparse.create("local")
    ids = _trained(kv)
    kv.export(tmp_path / "emb")
    parts = sorted(os.listdir(tmp_path / "emb"))
    assert parts == [f"part-{i:05d}-of-{max(num_servers, 1):05d}.npz" for i in range(len(parts))]
    lookup = EmbeddingLookup(tmp_path / "emb")
    assert lookup.tables == ["item", "user"]
    assert len(lookup["user"]) == np.unique(ids).size
    query = ids[:40].reshape(5, 8)
    np.testing.assert_array_equal(
        lookup.lookup("user", query), kv.row_sparse_pull("user", row_ids=query)
    )
    np.testing.assert_array_equal(
        lookup["item"].lookup(ids[:50]), kv.row_sparse_pull("item", row_ids=ids[:50])
    )
    # Missing ids: zeros by default, or the value the store gives an unseen id.
    unseen = np.array([123, 456], np.int64)
    assert not lookup["user"].contains(unseen).any()
    assert lookup["user"].contains(ids[:3]).all()
    np.testing.assert_array_equal(lookup.lookup("user", unseen), np.zeros((2, 6), np.float32))
    with_init = EmbeddingLookup(tmp_path / "emb", default="initializer")
    np.testing.assert_array_equal(
        with_init.lookup("user", unseen), kv.row_sparse_pull("user", row_ids=unseen)
    )
    # Plain NumPy reads the parts too, the arrays named by the table (they were t0_keys...).
    with np.load(tmp_path / "emb" / parts[0]) as part:
        assert {"user_keys", "user_values", "item_keys", "item_values"} <= set(part.files)
        assert part["user_keys"].dtype == np.int64
        assert (np.diff(part["user_keys"]) > 0).all()
    kv.close()


def test_an_export_of_the_older_format_is_still_read(tmp_path):
    # Versions 1 and 2 named the arrays by position (t0_keys, t0_values): rewrite a new
    # export that way and read it back.
    kv = kvsparse.create("local")
    trained = _trained(kv)
    kv.export(tmp_path / "new")
    (tmp_path / "old").mkdir()
    for name in os.listdir(tmp_path / "new"):
        with np.load(tmp_path / "new" / name) as part:
            arrays = {key: part[key] for key in part.files}
        meta = json.loads(bytes(arrays.pop("meta")).decode())
        old = {}
        for position, table in enumerate(meta["tables"]):
            old[f"t{position}_keys"] = arrays.pop(table.pop("keys"))
            old[f"t{position}_values"] = arrays.pop(table.pop("values"))
        assert not arrays
        meta["version"] = 2
        old["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        np.savez(tmp_path / "old" / name, **old)
    new, older = EmbeddingLookup(tmp_path / "new"), EmbeddingLookup(tmp_path / "old")
    assert sorted(older.tables) == sorted(new.tables) == ["item", "user"]
    ids = np.concatenate([trained[:20], [123]])
    for table in new.tables:
        np.testing.assert_array_equal(older.lookup(table, ids), new.lookup(table, ids))
    kv.close()


def test_export_chosen_tables_and_errors(tmp_path):
    kv = kvsparse.create("local")
    _trained(kv)
    kv.export(tmp_path / "only", tables="item")
    assert EmbeddingLookup(tmp_path / "only").tables == ["item"]
    with pytest.raises(errors.UnknownKey):
        EmbeddingLookup(tmp_path / "only")["user"]
    with pytest.raises(errors.InvalidArgument, match="dense"):
        kv.export(tmp_path / "x", tables=["dense"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(errors.InvalidArgument, match="no exported parts"):
        EmbeddingLookup(tmp_path / "empty")
    with pytest.raises(errors.KeyTypeError):
        EmbeddingLookup(tmp_path / "only").lookup("item", [1.5])
    with pytest.raises(errors.InvalidArgument, match="default"):
        EmbeddingLookup(tmp_path / "only", default="random")


def test_incomplete_or_mixed_exports_are_rejected(server_factory, tmp_path):
    kv = kvsparse.create("dist_sparse", servers=server_factory(2))
    _trained(kv)
    kv.export(tmp_path / "a")
    kv.export(tmp_path / "b")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(tmp_path / "a" / "part-00000-of-00002.npz", mixed)
    shutil.copy(tmp_path / "b" / "part-00001-of-00002.npz", mixed)
    with pytest.raises(errors.InvalidArgument, match="different exports"):
        EmbeddingLookup(mixed)
    os.remove(tmp_path / "a" / "part-00001-of-00002.npz")
    with pytest.raises(errors.InvalidArgument, match="missing"):
        EmbeddingLookup(tmp_path / "a")
    kv.close()
