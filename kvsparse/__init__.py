"""kvsparse: a parameter server for huge sparse embedding tables."""
try:
    from kvsparse import _core  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised by hand on an unbuilt tree
    raise ImportError(
        "kvsparse's compiled core (kvsparse._core) is not built. Build it from the "
        "source tree with `pip install -e .` (or `python setup.py build_ext --inplace`); "
        f"original error: {exc}"
    ) from exc
