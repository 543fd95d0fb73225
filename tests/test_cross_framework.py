"""One table, two frameworks: a PyTorch worker trains it while a TensorFlow worker reads it.

Two worker processes share two real servers (ASP: the reader never pushes, so
no synchronous round could complete). They advance in lockstep with barriers:
after each PyTorch training step the TensorFlow worker reads the same rows
through kvsparse.adapters.tensorflow. Both views must equal, at every step,
the rows computed here in NumPy from the loss (SGD on the servers).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("tensorflow")

from conftest import last_json, run_workers  # noqa: E402

STEPS = 5
BATCH = 16
DIM = 8
LR = 0.3

SCRIPT = r"""
import json, os, sys
import numpy as np
import kvsparse

data = np.load(sys.argv[1])
ids, coefficients, watched = data["ids"], data["coefficients"], data["watched"]
kv = kvsparse.create("dist_async")
settings = dict(
    embedding_dim=int(data["dim"]),
    initializer=kvsparse.initializers.Uniform(-1.0, 1.0),
    optimizer=kvsparse.optimizers.SGD(learning_rate=float(data["lr"])),
    seed=11,
)
views = []
if kv.rank == 0:
    import torch
    from kvsparse.adapters.torch import Embedding

    emb = Embedding(kv, "shared", **settings)
    kv.barrier()  # both workers have the table
    kv.barrier()  # the reader saw the initial rows
    for step in range(len(ids)):
        rows = emb(torch.from_numpy(ids[step]))
        (torch.tanh(rows) * torch.from_numpy(coefficients[step])).sum().backward()  # pushes
        with torch.no_grad():
            views.append(emb(torch.from_numpy(watched)).numpy().tolist())
        kv.barrier()  # step done: the reader may read
        kv.barrier()  # the reader has read
    framework = "torch " + torch.__version__
else:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    from kvsparse.adapters.tensorflow import Embedding

    emb = Embedding(kv, "shared", **settings)
    kv.barrier()
    views.append(emb(tf.constant(watched)).numpy().tolist())
    kv.barrier()
    for step in range(len(ids)):
        kv.barrier()
        views.append(emb(tf.constant(watched)).numpy().tolist())
        kv.barrier()
    assert emb.pushes == 0
    framework = "tensorflow " + tf.__version__
kv.close()
print(json.dumps({"framework": framework, "views": views}))
"""


def expected_views(initial: dict, ids, coefficients, watched):
    """The watched rows after each step of SGD on sum(tanh(rows) * coefficients)."""
    table = {i: row.astype(np.float64) for i, row in initial.items()}
    views = []
    for step_ids, step_coefficients in zip(ids, coefficients):
        gradient = {}
        for i, c in zip(step_ids.tolist(), step_coefficients):
            gradient[i] = gradient.get(i, 0.0) + (1 - np.tanh(table[i]) ** 2) * c
        for i, g in gradient.items():
            table[i] = table[i] - LR * g
        views.append(np.stack([table[i] for i in watched.tolist()]))
    return views


def test_torch_trains_while_tensorflow_reads_the_same_rows(server_factory, tmp_path):
    rng = np.random.default_rng(3)
    vocabulary = rng.integers(-(2**62), 2**62, 12)
    ids = rng.choice(vocabulary, (STEPS, BATCH))  # duplicates within a step on purpose
    coefficients = rng.normal(size=(STEPS, BATCH, DIM)).astype(np.float32)
    never_trained = np.array([7])
    watched = np.concatenate([np.unique(ids), never_trained])
    data = tmp_path / "data.npz"
    np.savez(data, ids=ids, coefficients=coefficients, watched=watched, dim=DIM, lr=LR)

    outputs = run_workers(
        SCRIPT,
        server_factory(2),
        2,
        tmp_path,
        timeout=240,
        args=[data],
        env={"TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    torch_worker, tf_worker = (last_json(out) for out in outputs)
    assert torch_worker["framework"].startswith("torch")
    assert tf_worker["framework"].startswith("tensorflow")

    tf_views = [np.array(v, np.float32) for v in tf_worker["views"]]
    torch_views = [np.array(v, np.float32) for v in torch_worker["views"]]
    assert len(tf_views) == STEPS + 1 and len(torch_views) == STEPS
    initial = dict(zip(watched.tolist(), tf_views[0]))
    expected = expected_views(initial, ids, coefficients, watched)
    for step in range(STEPS):
        np.testing.assert_array_equal(tf_views[step + 1], torch_views[step], err_msg=f"{step}")
        np.testing.assert_allclose(tf_views[step + 1], expected[step], rtol=1e-4, atol=1e-5)
    trained = np.abs(tf_views[-1][:-1] - tf_views[0][:-1]).max(axis=1)
    assert (trained > 1e-3).all(), "every trained row moved"
    np.testing.assert_array_equal(tf_views[-1][-1], tf_views[0][-1])  # the untrained row
