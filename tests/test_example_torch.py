"""The README's main command, end to end: DeepFM on MovieLens-100k with PyTorch.

Runs ``python -m kvsparse launch -s 2 -n 2 -- python examples/movielens_torch.py``
(two real servers, two workers) and checks the held-out AUC it prints.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("tqdm")

from conftest import REPO_ROOT, subprocess_env  # noqa: E402

TIMEOUT = 420  # seconds; the run takes about 35 s on 2 loaded cores
AUC_LINE = re.compile(r"^\[worker 0\] held-out AUC: (\d\.\d{4})$", re.MULTILINE)


def run_command(command, timeout):
    """(exit code, stdout, stderr); on timeout the launcher gets SIGTERM and stops its children."""
    process = subprocess.Popen(
        command,
        cwd=str(REPO_ROOT),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()  # the launcher stops workers and servers on SIGTERM
        try:
            out, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        pytest.fail(f"{' '.join(command)} ran past {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return process.returncode, out, err


def test_movielens_torch_example_under_the_launcher_reaches_auc_075():
    command = [
        sys.executable, "-m", "kvsparse", "launch", "-s", "2", "-n", "2", "--",
        sys.executable, "examples/movielens_torch.py",
    ]  # fmt: skip
    code, out, err = run_command(command, TIMEOUT)
    assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    found = AUC_LINE.findall(out)
    assert len(found) == 1, f"no single AUC line from worker 0:\n{out}\n{err}"
    assert float(found[0]) >= 0.75, out
    assert "[worker 0] epoch 1/" in out  # the progress bar, one line per update
    assert "[worker 1] epoch" not in out  # only rank 0 reports
