"""Runs an example under ``kvsparse launch -s 2 -n 2`` for the tests/test_example_*.py files.

Example:
    >>> code, out, err = launch_example("movielens_torch.py", timeout=420)  # doctest: +SKIP
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, subprocess_env

# The line rank 0 prints after training (the launcher prefixes each worker's lines).
AUC_LINE = re.compile(r"^\[worker 0\] held-out AUC: (\d\.\d{4})$", re.MULTILINE)


def run_command(command, timeout, extra_env=None):
    """(exit code, stdout, stderr); on timeout the launcher gets SIGTERM and stops its children."""
    process = subprocess.Popen(
        command,
        cwd=str(REPO_ROOT),
        env=subprocess_env(extra_env),
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


def launch_example(script: str, timeout: float, extra_env=None, args=()):
    """Runs examples/<script> [args] with 2 servers and 2 workers: (exit code, stdout, stderr)."""
    command = [
        sys.executable, "-m", "kvsparse", "launch", "-s", "2", "-n", "2", "--",
        sys.executable, f"examples/{script}", *args,
    ]  # fmt: skip
    return run_command(command, timeout, extra_env)


def held_out_auc(code: int, out: str, err: str) -> float:
    """The one AUC worker 0 printed, after checking the run succeeded."""
    assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    found = AUC_LINE.findall(out)
    assert len(found) == 1, f"no single AUC line from worker 0:\n{out}\n{err}"
    return float(found[0])
