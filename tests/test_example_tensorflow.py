"""examples/movielens_tensorflow.py under `kvsparse launch` (2 servers, 2 workers) learns."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_deepfm_on_movielens_reaches_auc_075_with_two_servers_and_two_workers():
    command = [
        sys.executable,
        "-m",
        "kvsparse",
        "launch",
        "-s",
        "2",
        "-n",
        "2",
        "--",
        sys.executable,
        "examples/movielens_tensorflow.py",
    ]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert re.search(r"\[worker 0\] train: .*100%", result.stdout), output[-4000:]
    scores = re.findall(r"\[worker 0\] held-out AUC: (\d\.\d{4})", result.stdout)
    assert len(scores) == 1, output[-4000:]
    assert float(scores[0]) >= 0.75, output[-4000:]
