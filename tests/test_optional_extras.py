"""Optional packages (the ``serve`` extra): the core CLI runs without them, and what needs
one says in one line what to install, no traceback.

Each command runs in a subprocess whose import system refuses prometheus_client,
aiohttp and rich (a meta-path finder installed before kvsparse is imported), as
after a plain ``pip install kvsparse``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from conftest import REPO_ROOT, subprocess_env

import kvsparse
from kvsparse.server.listening import read_first_line
from kvsparse.serving import Client
from kvsparse.serving.server import LISTENING_PREFIX

START_TIMEOUT = 60.0
HINT = "pip install 'kvsparse[serve]'"
# Runs `kvsparse ARGS...` as if prometheus_client, aiohttp and rich were not installed.
WITHOUT_EXTRAS = """
import sys

class RefuseExtras:
    BLOCKED = {"prometheus_client", "aiohttp", "rich"}

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, RefuseExtras())
from kvsparse.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def without_extras(*args) -> list:
    return [sys.executable, "-c", WITHOUT_EXTRAS, *map(str, args)]


def run_without_extras(*args, timeout=120):
    return subprocess.run(
        without_extras(*args),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=str(REPO_ROOT),
        timeout=timeout,
    )


def assert_one_line_hint(result, code: int, *words):
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in (HINT, *words):
        assert word in lines[0], lines[0]


def test_the_blocker_really_refuses_the_extras():
    probe = WITHOUT_EXTRAS.replace(
        "from kvsparse.cli.main import main\nsys.exit(main(sys.argv[1:]))",
        "import importlib\nfor name in sys.argv[1:]:\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except ImportError:\n        print(name)",
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, "prometheus_client", "aiohttp.web", "rich.console"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert result.stdout.split() == ["prometheus_client", "aiohttp.web", "rich.console"]


@pytest.mark.parametrize("command", ["serve", "server", "stats"])
def test_help_works_without_the_extras(command):
    result = run_without_extras(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "usage:" in result.stdout


@pytest.fixture
def checkpoint(tmp_path):
    kv = kvsparse.create("local")
    kv.init("user", kvsparse.SparseTable(dim=4, seed=3))
    ids = np.array([2**40 + 1, -5, 7], np.int64)
    kv.push("user", (ids, np.ones((3, 4), np.float32)))
    kv.save(tmp_path / "ckpt")
    rows = kv.row_sparse_pull("user", row_ids=ids)
    kv.close()
    return tmp_path / "ckpt", ids, rows


def test_serve_answers_zeromq_lookups_without_the_extras(checkpoint):
    path, ids, rows = checkpoint
    stderr = tempfile.TemporaryFile()
    process = subprocess.Popen(
        without_extras("serve", "--checkpoint-dir", path, "--bind", "tcp://127.0.0.1:0"),
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=subprocess_env(),
        cwd=str(REPO_ROOT),
    )
    try:
        line = read_first_line(process.stdout, time.monotonic() + START_TIMEOUT).decode()
        stderr.seek(0)
        assert line.startswith(LISTENING_PREFIX), (line, stderr.read())
        with Client([line[len(LISTENING_PREFIX) :].strip()]) as client:
            np.testing.assert_array_equal(client.lookup("user", ids), rows)
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()
        stderr.seek(0)
        log = stderr.read().decode(errors="replace")
        stderr.close()
    assert process.returncode == 0, log
    assert "Traceback" not in log, log


def test_serve_http_names_the_extra(checkpoint):
    path, _, _ = checkpoint
    result = run_without_extras("serve", "--checkpoint-dir", path, "--http-port", 0)
    assert_one_line_hint(result, 1, "kvsparse serve: error:", "--http-port", "aiohttp")


def test_server_metrics_port_names_the_extra():
    result = run_without_extras("server", "--bind", "tcp://127.0.0.1:0", "--metrics-port", 0)
    assert_one_line_hint(result, 1, "--metrics-port", "prometheus-client")


def test_stats_table_names_the_extra():
    # No server is asked: the table's library is checked first (--json needs none).
    result = run_without_extras("stats", "--servers", "tcp://127.0.0.1:9", "--once")
    assert_one_line_hint(result, 2, "kvsparse stats", "rich", "--json")
