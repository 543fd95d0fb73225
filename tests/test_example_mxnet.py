"""examples/movielens_mxnet.py under `kvsparse launch` (2 servers, 2 workers) learns."""

from __future__ import annotations

import re

import numpy as np
import pytest

if "bool" not in vars(np):
    np.bool = bool  # MXNet 1.9.1 needs it to import; the example gets it from the adapter
pytest.importorskip("mxnet")

from example_runs import held_out_auc, launch_example  # noqa: E402

TIMEOUT = 280


def test_gluon_deepfm_on_movielens_reaches_auc_075_with_two_servers_and_two_workers():
    code, out, err = launch_example("movielens_mxnet.py", TIMEOUT)
    assert held_out_auc(code, out, err) >= 0.75, out[-4000:]
    assert re.search(r"\[worker 0\] epoch 2/2: .*100%", out), out[-4000:]
    assert "kvsparse dist_sparse: 2 worker(s), 2 server(s)" in out, out[-4000:]


def test_the_same_model_with_float16_tables_on_the_servers_learns_as_well():
    # The two tables stored in float16 (half the bytes), Gluon in float32. One
    # epoch keeps it short; the float32 run of the same epoch reaches about 0.77.
    code, out, err = launch_example(
        "movielens_mxnet.py", TIMEOUT, args=("--table-dtype", "float16", "--epochs", "1")
    )
    assert held_out_auc(code, out, err) >= 0.74, out[-4000:]
