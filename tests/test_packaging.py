"""Packaging: what a wheel holds; an unbuilt tree says how to build; the debug switch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADAPTERS = ("__init__", "_common", "torch", "tensorflow", "mxnet", "jax")


def _copy_sources(tree: Path, folders=("kvsparse",)) -> None:
    """The Python sources of folders under tree, without the compiled core or caches."""
    for folder in folders:
        shutil.copytree(
            os.path.join(ROOT, folder),
            tree / folder,
            ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info"),
        )


def _packages(top: Path) -> set:
    """Dotted names of top (a kvsparse folder) and every folder in it holding Python files."""
    return {
        ".".join(folder.relative_to(top.parent).parts)
        for folder in [top, *top.rglob("*")]
        if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py"))
    }


def test_built_package_holds_the_adapters_and_every_subpackage(tmp_path):
    # build_py of a copy: the pure-Python part of a wheel, without touching the
    # checkout (no egg-info, no build/). cythonize is stubbed: build_py compiles
    # nothing, and the real one would write C++ sources.
    tree, lib = tmp_path / "src", tmp_path / "lib"
    _copy_sources(tree, ("kvsparse", "adapters"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(os.path.join(ROOT, name), tree / name)
    code = (
        "import runpy, sys, Cython.Build;"
        "Cython.Build.cythonize = lambda modules, **kw: modules;"
        "sys.argv = ['setup.py', '-q', 'build_py', '--build-lib', sys.argv[1]];"
        "runpy.run_path('setup.py', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(lib)],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    adapters = lib / "kvsparse" / "adapters"
    for name in ADAPTERS:
        path = adapters / f"{name}.py"
        assert path.is_file() and not path.is_symlink(), f"{path} missing from the build"
    assert not (lib / "adapters").exists()
    # A wing added to kvsparse/ but not to pyproject.toml's packages would be left out.
    in_tree = _packages(tree / "kvsparse") | {"kvsparse.adapters"}
    built = _packages(lib / "kvsparse")
    assert not in_tree - built, f"add to pyproject.toml's packages: {sorted(in_tree - built)}"
    assert built == in_tree
    for name in ("py.typed", "_core.pyi"):
        assert (lib / "kvsparse" / name).is_file(), f"package data {name} missing"


def test_source_tree_has_no_adapters_symlink():
    assert not os.path.lexists(os.path.join(ROOT, "kvsparse", "adapters"))


def test_unbuilt_source_tree_says_how_to_build(tmp_path):
    tree = tmp_path / "src"
    _copy_sources(tree)
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


def test_sdist_holds_every_source_the_wheel_is_built_from(tmp_path):
    # .ci/wheel builds its wheel from the sdist; here, only the listing (no compile): every
    # file of csrc/ and cython_src/ (headers, .pxd and .pxi included), no build output.
    tree = tmp_path / "src"
    shutil.copytree(
        ROOT,
        tree,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.so", "*.egg-info", "__pycache__", "*.cpp"
        ),
    )
    result = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--skip-dependency-check"]
        + ["--outdir", str(tmp_path / "dist"), str(tree)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (sdist,) = (tmp_path / "dist").glob("kvsparse-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for folder in ("csrc", "cython_src"):
        for path in (Path(ROOT) / folder).iterdir():
            if path.is_file() and path.suffix != ".cpp":
                assert f"{folder}/{path.name}" in names, f"the sdist lacks {folder}/{path.name}"
    assert not [name for name in names if name.endswith((".so", ".o", ".cpp"))]
