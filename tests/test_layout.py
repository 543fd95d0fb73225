"""Rules of the layout that no single file shows: who may read the environment, who may import whom.

`kvsparse.config` is the one reader of environment variables
(CONTRIBUTING.md, "Style"). The process-environment builders of `kvsparse.cluster.process`
touch ``os.environ`` too, but only to copy it into the processes they start.
This test parses every Python source of kvsparse/ and adapters/ and fails on
any other ``os.environ``, ``os.getenv`` or ``environ.get``, listing them.

The wings import one way (docs/architecture.md draws it): adapters -> store
-> client -> wire; store -> shard; server -> shard, wire; serving -> shard;
cluster -> server's listening line, client (ping), shard (manifests); cli and
the Ray integration -> anything. Everything may use the base modules. Every
``import`` counts, lazy ones inside functions included.
"""

from __future__ import annotations

import ast

from conftest import REPO_ROOT

SOURCE_DIRECTORIES = ("kvsparse", "adapters")
# path -> the functions in it that may touch the environment (None: the whole module).
ALLOWED = {
    **{
        path.relative_to(REPO_ROOT).as_posix(): None
        for path in (REPO_ROOT / "kvsparse" / "config").glob("*.py")
    },
    # enter_worker_environment: a Ray actor running a colocated worker's code sets its own
    # environment as kvsparse launch sets a worker's (kvsparse.ray.start_colocated).
    "kvsparse/cluster/process.py": {
        "worker_environment",
        "server_environment",
        "enter_worker_environment",
    },
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


# The functions of kvsparse.config that read the environment (a setting's `read` too).
READERS = {
    "from_environment",
    "monitor_config",
    "server_bind_address",
    "colocated_peers",
    "restarted",
    "shard_fd",
    "rejoin_window",
    "checkpoint_dir",
    "periodic_save",
    "curve_keys",
    "retry_window",
    "heartbeat_timeout",
    "fast_path",
    "memory_tier",
    "server_limits",
    "mxnet_role",
    "node_placement",
    "read",
}
# The entry points: they resolve the settings once and pass them down. A module below
# them takes its settings as arguments (a WorkerSettings, a ServerSettings, or values).
ENTRY_POINTS = (
    "kvsparse/store/factory.py",  # kvsparse.create
    "kvsparse/server/main.py",  # kvsparse server
    "kvsparse/serving/main.py",  # kvsparse serve
    "kvsparse/cli/",  # the other commands
    "kvsparse/cluster/launch.py",  # kvsparse launch
    "kvsparse/ray/",  # the Ray actors' own entry
    "adapters/mxnet.py",  # refuses a ps-lite role before MXNet's import can start one
)


def reader_calls(path) -> list[tuple[int, str]]:
    """(line, name) of each call of a kvsparse.config reader in one Python file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    config_names = {"config", "cluster_config"}  # how the package is imported here
    direct = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "kvsparse":
            config_names |= {a.asname or a.name for a in node.names if a.name == "config"}
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvsparse.config"):
            direct |= {a.asname or a.name for a in node.names if a.name in READERS}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        function = node.func
        if isinstance(function, ast.Name) and function.id in direct:
            found.append((node.lineno, function.id))
        elif isinstance(function, ast.Attribute) and function.attr in READERS:
            base = function.value
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                base = base.value
            if isinstance(base, ast.Name) and base.id in config_names:
                found.append((node.lineno, function.attr))
    return found


def test_settings_are_read_at_the_entry_points_only():
    offenders = []
    for directory in SOURCE_DIRECTORIES:
        for path in sorted((REPO_ROOT / directory).rglob("*.py")):
            name = path.relative_to(REPO_ROOT).as_posix()
            if name.startswith("kvsparse/config/") or name.startswith(ENTRY_POINTS):
                continue
            offenders += [f"{name}:{line}: config.{what}()" for line, what in reader_calls(path)]
    assert not offenders, (
        "take the setting as an argument (resolved at an entry point: kvsparse.create, "
        "kvsparse server, the CLI) instead of reading it here:\n" + "\n".join(offenders)
    )


def test_the_reader_checker_sees_every_form(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "from kvsparse import config as cfg\n"
        "from kvsparse.config import retry_window as window\n"
        "a = cfg.curve_keys()\n"
        "b = window()\n"
        "c = cfg.SETTINGS['timeout'].read()\n"
        "d = cfg.WorkerSettings.from_environment()\n"
        "e = cfg.parse_bytes('1GiB')\n"
    )
    assert reader_calls(source) == [
        (3, "curve_keys"),
        (4, "window"),
        (5, "read"),
        (6, "from_environment"),
    ]


# The base: what users configure, the errors, the environment reader, the core.
BASE = {
    "kvsparse.errors",
    "kvsparse.config",
    "kvsparse.arrays",
    "kvsparse.extras",
    "kvsparse.placement",
    "kvsparse.table",
    "kvsparse.optimizers",
    "kvsparse.initializers",
    "kvsparse._core",
}
# wing -> the wings (or single modules) it may import, besides itself and the base.
MAY_IMPORT = {
    "base": set(),
    "wire": set(),
    "client": {"wire"},
    "shard": set(),
    # kvsparse.server.embedded: a colocated worker hosts its shard
    # (kvsparse/store/colocated.py); the rest of the server wing stays out of reach.
    "store": {"client", "shard", "kvsparse.server.embedded"},
    "server": {"shard", "wire"},
    # kvsparse.serving.client is a client: the training client's sockets and exchange.
    "serving": {"shard", "wire", "kvsparse.client.sockets", "kvsparse.client.exchange"},
    # "package": process.py finds the installed kvsparse to put it on a server's PYTHONPATH.
    "cluster": {"kvsparse.server.listening", "client", "shard", "wire", "package"},
    # kvsparse.store.colocated: a colocated worker actor closes the stores its code left
    # open when the code returns, as a worker process's exit does.
    "ray": {"cluster", "client", "kvsparse.server.listening", "kvsparse.store.colocated"},
    "cli": {"kvsparse", "store", "client", "wire", "shard", "server", "cluster", "serving"},
    "package": {"store"},  # kvsparse/__init__.py: create() and the public names
    "main": {"cli"},  # kvsparse/__main__.py
    "adapters": {"kvsparse", "store", "adapters"},
}


def wing_of(module: str) -> str:
    """The wing of a dotted module name inside kvsparse."""
    if module in BASE or module.startswith("kvsparse.config."):
        return "base"
    parts = module.split(".")
    if parts[0] == "adapters" or module.startswith("kvsparse.adapters"):
        return "adapters"
    if module == "kvsparse":
        return "package"
    if module == "kvsparse.__main__":
        return "main"
    return parts[1]


def module_name(path) -> str:
    relative = path.relative_to(REPO_ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] == "adapters":
        parts = ["kvsparse", *parts]
    return ".".join(parts)


def imported_modules(path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module) for every kvsparse import in a file, lazy ones included."""
    found = []
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                # `from kvsparse import errors` imports the module kvsparse.errors.
                candidate = f"{base}.{alias.name}"
                found.append((node.lineno, candidate if _is_module(candidate) else base))
    return [(line, name) for line, name in found if name.split(".")[0] == "kvsparse"]


def _is_module(name: str) -> bool:
    parts = name.split(".")
    if parts[:2] == ["kvsparse", "adapters"]:
        target = REPO_ROOT.joinpath("adapters", *parts[2:])
    else:
        target = REPO_ROOT.joinpath(*parts)
    return (
        target.with_suffix(".py").exists()
        or (target / "__init__.py").exists()
        or (name == "kvsparse._core")
    )


def _allowed(importer: str, imported: str) -> bool:
    source, target = wing_of(importer), wing_of(imported)
    if target in ("base", source):
        return True
    allowed = MAY_IMPORT[source]
    return target in allowed or any(
        imported == entry or imported.startswith(entry + ".") for entry in allowed
    )


def test_wings_import_one_way():
    offenders = []
    for directory in SOURCE_DIRECTORIES:
        for path in sorted((REPO_ROOT / directory).rglob("*.py")):
            importer = module_name(path)
            for line, imported in imported_modules(path, importer):
                if not _allowed(importer, imported):
                    offenders.append(
                        f"{path.relative_to(REPO_ROOT)}:{line}: {wing_of(importer)} -> "
                        f"{imported} ({wing_of(imported)})"
                    )
    assert not offenders, "imports against the direction of the wings:\n" + "\n".join(offenders)


def test_the_arrow_rule_refuses_an_upward_import():
    assert _allowed("kvsparse.store.kvstore", "kvsparse.client.remote")
    assert _allowed("kvsparse.client.session", "kvsparse.wire.ops")
    assert not _allowed("kvsparse.client.remote", "kvsparse.store.kvstore")
    assert not _allowed("kvsparse.wire.ops", "kvsparse.client.session")
    assert not _allowed("kvsparse.server.handlers", "kvsparse.client.remote")
    assert not _allowed("kvsparse.cluster.launch", "kvsparse.server.server")
    assert _allowed("kvsparse.cluster.launch", "kvsparse.server.listening")
