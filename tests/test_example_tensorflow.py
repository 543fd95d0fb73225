"""examples/movielens_tensorflow.py under `kvsparse launch` (2 servers, 2 workers) learns."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("tensorflow")

from example_runs import held_out_auc, launch_example  # noqa: E402

TIMEOUT = 280


def test_deepfm_on_movielens_reaches_auc_075_with_two_servers_and_two_workers():
    code, out, err = launch_example("movielens_tensorflow.py", TIMEOUT, {"TF_CPP_MIN_LOG_LEVEL": 2})
    assert held_out_auc(code, out, err) >= 0.75, out[-4000:]
    assert re.search(r"\[worker 0\] train: .*100%", out), out[-4000:]
