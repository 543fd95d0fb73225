"""The online-serving example, end to end: examples/online_movielens.py, a shortened replay.

The example launches itself (a server, a worker training under ``--save-every``, a
serving replica that follows the checkpoint directory and one frozen at the first
checkpoint), scores every batch through both replicas before training on it, and exits 0
only if the followed replica's prequential AUC beats the frozen one's.
"""

from __future__ import annotations

import re
import sys

import pytest

pytest.importorskip("torch")

from example_runs import run_command  # noqa: E402

FINAL = re.compile(
    r"prequential AUC over (\d+) ratings: followed replica (\d\.\d{4}), frozen replica "
    r"(\d\.\d{4}); freshness p50 ([\d.]+) s, p99 ([\d.]+) s"
)


def test_online_example_followed_replica_beats_the_frozen_one():
    command = [
        sys.executable, "examples/online_movielens.py", "--seconds", "20", "--save-every", "2",
    ]  # fmt: skip
    code, out, err = run_command(command, timeout=420)
    found = FINAL.findall(out)
    assert len(found) == 1, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    ratings, followed, frozen, p50, p99 = found[0]
    assert int(ratings) > 50_000  # the replay scored most of the 100,000 ratings
    assert float(followed) > float(frozen), out
    assert float(followed) > 0.6, out
    # A followed replica serves checkpoints seconds old, not the first one.
    assert float(p50) < 10, out
    assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
