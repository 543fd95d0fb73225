"""The stress harness, short version (issue 32; the long one: ``benchmarks/soak.py stress``).

Real ``kvsparse launch`` jobs, one per mode, run the scenario that hung (every
worker pushes for a fixed time, so push counts differ, then meets a barrier)
beside a CPU hog, with random SIGSTOP pauses of servers and workers; every
worker checks every row exactly. A hang, a wrong row or an error fails the
test with the job's output (the hung workers' stacks included). CI runs every
mode of the harness too (`.ci/run`).
"""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("stress", REPO_ROOT / "benchmarks" / "stress.py")
stress = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stress)


@pytest.fixture(scope="module")
def cpu_hog():
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield hog
    hog.kill()
    hog.wait()


@pytest.mark.parametrize(
    "mode", ["ipc-bsp", "tcp-ssp-threads", "colocated-bsp", "ipc-bsp-save", "colocated-asp"]
)
def test_a_launch_under_load_and_pauses_ends_with_every_row_exact(cpu_hog, mode):
    result = stress.run_once(
        mode, seconds=2.0, hang_seconds=60.0, pauses=True, rng=random.Random(mode)
    )
    assert result["outcome"] == "ok", result["detail"]


def test_the_harness_counts_a_job_that_never_ends_as_a_hang():
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    result = stress.run_once(
        "ipc-bsp", seconds=0.0, hang_seconds=3.0, pauses=False, rng=None, worker_argv=sleeper
    )
    assert result["outcome"] == "hang"


def test_the_harness_counts_a_wrong_row_or_a_missing_report_as_a_failure():
    good = '[worker 0] {"failures": []}\n[worker 1] {"failures": []}\n'
    assert stress.parse_outcome(0, good) == "ok"
    assert stress.parse_outcome(1, good) == "fail"
    assert stress.parse_outcome(0, good.replace("[]", '["shared rows -3 != -4"]', 1)) == "fail"
    assert stress.parse_outcome(0, '[worker 0] {"failures": []}\n') == "fail"
