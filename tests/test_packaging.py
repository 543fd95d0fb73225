"""Packaging: an unbuilt tree says how to build; the debug switch reaches the build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_unbuilt_source_tree_says_how_to_build(tmp_path):
    tree = tmp_path / "src"
    shutil.copytree(
        os.path.join(ROOT, "kvsparse"),
        tree / "kvsparse",
        symlinks=True,
        ignore=shutil.ignore_patterns("*.so", "__pycache__"),
    )
    # -S: no site-packages, so an editable install's finder cannot supply the
    # built kvsparse instead of the unbuilt copy.
    result = subprocess.run(
        [sys.executable, "-S", "-c", "import kvsparse"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "pip install -e ." in result.stderr
    assert "not built" in result.stderr


def test_debug_switch_turns_checks_on():
    # The build reads KVSPARSE_DEBUG once; evaluate setup.py's settings without building.
    code = (
        "import runpy, sys, setuptools, Cython.Build;"
        "setuptools.setup = lambda **kw: None;"
        "Cython.Build.cythonize = lambda modules, **kw: modules;"
        "g = runpy.run_path('setup.py');"
        "print(g['DEBUG'], g['directives']['boundscheck'], '-O0' in g['compile_args'])"
    )
    for value, expected in (("1", "True True True"), ("", "False False False")):
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={**os.environ, "KVSPARSE_DEBUG": value},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == expected
