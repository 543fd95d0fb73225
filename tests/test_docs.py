"""docs/: every ```python block of the quickstart and the README runs; doc links resolve."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from conftest import REPO_ROOT, subprocess_env

DOCS = REPO_ROOT / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)

# Runs the blocks in order in one namespace, as a reader pasting them into one session would.
RUNNER = r"""
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__quickstart__"}
for index, block in enumerate(blocks):
    try:
        exec(compile(block, f"<quickstart block {index + 1}>", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"QUICKSTART BLOCK {index + 1} FAILED", file=sys.stderr)
        sys.exit(1)
print(f"QUICKSTART OK {len(blocks)}")
"""


def python_blocks(path) -> list[str]:
    return FENCE.findall(path.read_text())


def test_every_quickstart_block_runs(tmp_path):
    blocks = python_blocks(DOCS / "quickstart.md")
    assert len(blocks) >= 5
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "runner.py").write_text(RUNNER)
    result = subprocess.run(
        [sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=str(tmp_path),  # not the checkout: the blocks must not rely on its files
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert f"QUICKSTART OK {len(blocks)}" in result.stdout


def test_the_readme_example_runs(tmp_path):
    """The README's ten-line example is the first code a newcomer pastes: it must run as is."""
    blocks = python_blocks(REPO_ROOT / "README.md")
    assert len(blocks) == 1 and len(blocks[0].splitlines()) <= 12
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "runner.py").write_text(RUNNER)
    result = subprocess.run(
        [sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "QUICKSTART OK 1" in result.stdout


def test_the_runner_reports_a_failing_block(tmp_path):
    (tmp_path / "blocks.json").write_text(json.dumps(["x = 1", "assert x == 2"]))
    (tmp_path / "runner.py").write_text(RUNNER)
    result = subprocess.run(
        [sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "QUICKSTART BLOCK 2 FAILED" in result.stderr


def test_every_python_block_in_the_docs_compiles():
    for path in sorted(DOCS.glob("*.md")):
        for index, block in enumerate(python_blocks(path)):
            compile(block, f"{path.name} block {index + 1}", "exec")


def test_relative_links_resolve():
    link = re.compile(r"\]\(([^)#:]+\.(?:md|py|yaml))(?:#[^)]*)?\)")
    for path in sorted(DOCS.glob("*.md")) + [
        REPO_ROOT / "README.md",
        REPO_ROOT / "CONTRIBUTING.md",
    ]:
        for target in link.findall(path.read_text()):
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_documented_cli_options_exist():
    operations = (DOCS / "operations.md").read_text()
    for option in ("--metrics-port", "--metrics-host"):
        assert option in operations
    help_text = subprocess.run(
        [sys.executable, "-m", "kvsparse.server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(),
        cwd=str(REPO_ROOT),
    ).stdout
    for option in re.findall(r"`kvsparse server [^`]*?(--[a-z-]+)", operations):
        assert option in help_text, option
