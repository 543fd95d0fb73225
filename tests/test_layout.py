"""Rules of the layout that no single file shows: who may read the environment.

`kvsparse.config` is the one reader of environment variables (CONVENTIONS
habit 6). The process-environment builders of `kvsparse.cluster.process`
touch ``os.environ`` too, but only to copy it into the processes they start.
This test parses every Python source of kvsparse/ and adapters/ and fails on
any other ``os.environ``, ``os.getenv`` or ``environ.get``, listing them.
"""

from __future__ import annotations

import ast

from conftest import REPO_ROOT

SOURCE_DIRECTORIES = ("kvsparse", "adapters")
# path -> the functions in it that may touch the environment (None: the whole module).
ALLOWED = {
    "kvsparse/config.py": None,
    "kvsparse/cluster/process.py": {"worker_environment", "server_environment"},
}


class _EnvironmentReads(ast.NodeVisitor):
    """Collects (line, enclosing function, what) for each read of the environment."""

    def __init__(self):
        self.found: list[tuple[int, str | None, str]] = []
        self._functions: list[str] = []
        self._os_names = {"os"}  # `import os as something` adds its alias

    def _add(self, node: ast.AST, what: str) -> None:
        function = self._functions[-1] if self._functions else None
        self.found.append((node.lineno, function, what))

    def _function(self, node) -> None:
        self._functions.append(node.name)
        self.generic_visit(node)
        self._functions.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "os" and alias.asname:
                self._os_names.add(alias.asname)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module == "os":
            for alias in node.names:
                if alias.name in ("environ", "environb", "getenv", "getenvb"):
                    self._add(node, f"from os import {alias.name}")

    def _is_os(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in self._os_names

    def visit_Attribute(self, node: ast.Attribute) -> None:
        value = node.value
        if self._is_os(value) and node.attr in ("environ", "environb", "getenv", "getenvb"):
            self._add(node, f"os.{node.attr}")
        elif node.attr == "get" and (
            (isinstance(value, ast.Name) and value.id == "environ")
            # os.environ.get is reported once, as os.environ (below)
            or (
                isinstance(value, ast.Attribute)
                and value.attr == "environ"
                and not self._is_os(value.value)
            )
        ):
            self._add(node, "environ.get")
        self.generic_visit(node)


def environment_reads(path) -> list[tuple[int, str | None, str]]:
    """Every read of the environment in one Python file: (line, function, what)."""
    visitor = _EnvironmentReads()
    visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return visitor.found


def test_only_config_reads_the_environment():
    offenders = []
    for directory in SOURCE_DIRECTORIES:
        for path in sorted((REPO_ROOT / directory).rglob("*.py")):
            name = path.relative_to(REPO_ROOT).as_posix()
            if name in ALLOWED and ALLOWED[name] is None:
                continue
            allowed_functions = ALLOWED.get(name) or set()
            for line, function, what in environment_reads(path):
                if function not in allowed_functions:
                    where = f" in {function}()" if function else ""
                    offenders.append(f"{name}:{line}{where}: {what}")
    assert not offenders, (
        "read the environment through kvsparse.config (add a reader there) instead of:\n"
        + "\n".join(offenders)
    )


def test_the_checker_sees_every_form(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "import os\n"
        "import os as system\n"
        "from os import getenv\n"
        "A = os.environ['A'], os.environ.get('A')\n"
        "def f(environ):\n"
        "    return environ.get('B'), system.getenv('C')\n"
        "class K:\n"
        "    def g(self):\n"
        "        return self.environ.get('D')\n"
        "# os.environ in a comment, and 'os.environ' in a string, are not reads\n"
        "S = 'os.environ'\n"
    )
    assert environment_reads(source) == [
        (3, None, "from os import getenv"),
        (4, None, "os.environ"),
        (4, None, "os.environ"),
        (6, "f", "environ.get"),
        (6, "f", "os.getenv"),
        (9, "g", "environ.get"),
    ]
