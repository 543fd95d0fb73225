"""Optional dependencies: imported where a feature needs one, or named in one line.

The core (stores, servers, ``kvsparse serve`` over ZeroMQ) needs only numpy,
pyzmq and tqdm. HTTP and metrics need the ``serve`` extra (pyproject.toml's
``[project.optional-dependencies]``): ``kvsparse serve --http-port``
(aiohttp) and its ``/metrics``, ``kvsparse server --metrics-port``
(prometheus-client), ``kvsparse stats``' table (rich). (``monitor`` is the
older name of its last two.)

`require` imports such a module, or raises `kvsparse.errors.MissingDependency`
whose message says what to install, so a command prints one line instead of
a traceback.

Safe to call from several threads at once (Python's import lock).

Example:
    >>> from kvsparse import extras
    >>> web = extras.require("aiohttp.web", "kvsparse serve --http-port")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib

from kvsparse import errors

# The pip name of each optional top-level module.
PACKAGES = {"aiohttp": "aiohttp", "prometheus_client": "prometheus-client", "rich": "rich"}


def install_hint(extra: str) -> str:
    """The command that installs an extra: ``pip install 'kvsparse[serve]'``."""
    return f"pip install 'kvsparse[{extra}]'"


def require(module: str, feature: str, extra: str = "serve"):
    """Imports module (dotted) for feature, which the extra provides.

    Raises:
        MissingDependency: the module's package is not installed; the message
            names the feature, the package and ``pip install 'kvsparse[extra]'``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        missing = getattr(exc, "name", None) or top
        package = PACKAGES.get(missing.split(".")[0], missing.split(".")[0])
        raise errors.MissingDependency(
            f"{feature} needs the {package} package, which is not installed: {install_hint(extra)}"
        ) from None


def available(module: str) -> bool:
    """Whether module (dotted) can be imported."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


__all__ = ["PACKAGES", "available", "install_hint", "require"]
