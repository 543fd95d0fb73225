"""The README's main command, end to end: DeepFM on MovieLens-100k with PyTorch.

Runs ``python -m kvsparse launch -s 2 -n 2 -- python examples/movielens_torch.py``
(two real servers, two workers) and checks the held-out AUC it prints.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("tqdm")

from example_runs import held_out_auc, launch_example  # noqa: E402

TIMEOUT = 420  # seconds; the run takes about 35 s on 2 loaded cores


def test_movielens_torch_example_under_the_launcher_reaches_auc_075():
    code, out, err = launch_example("movielens_torch.py", TIMEOUT)
    assert held_out_auc(code, out, err) >= 0.75, out
    assert "[worker 0] epoch 1/" in out  # the progress bar, one line per update
    assert "[worker 1] epoch" not in out  # only rank 0 reports
