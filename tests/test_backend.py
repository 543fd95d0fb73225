"""Both backends implement every member of kvsparse.store.backend.Backend, with its signature.

An operation added to one backend only (or to the Protocol only) fails here.
"""

from __future__ import annotations

import inspect

import pytest

from kvsparse.client.remote import RemoteBackend
from kvsparse.store.backend import Backend
from kvsparse.store.local import LocalBackend

BACKENDS = [LocalBackend, RemoteBackend]
METHODS = sorted(
    name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")
)
ATTRIBUTES = sorted(Backend.__annotations__)
# Public methods a backend may have beyond the Protocol (not called by KVStore).
BACKEND_EXTRAS = {LocalBackend: set(), RemoteBackend: {"ping"}}


def _parameters(function) -> list:
    """(name, kind, default) of each parameter; annotations are documentation only."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_protocol_holds_every_operation_of_the_store():
    assert METHODS == sorted(
        [
            "assign_sparse",
            "barrier",
            "checkpoint",
            "close",
            "evict",
            "init_dense",
            "init_sparse",
            "load_optimizer_states",
            "optimizer_states",
            "prefetch_sparse",
            "pull_dense",
            "pull_sparse",
            "push_dense",
            "push_sparse",
            "rows_buffer",
            "set_learning_rate",
            "set_optimizer",
            "stats",
        ]
    )
    assert ATTRIBUTES == ["clock", "defers_pulls", "num_shards", "num_workers", "rank"]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
@pytest.mark.parametrize("name", METHODS)
def test_each_backend_has_each_method_with_the_protocol_signature(backend, name):
    implementation = getattr(backend, name, None)
    assert callable(implementation), f"{backend.__name__} has no {name}"
    wanted = _parameters(getattr(Backend, name))
    got = _parameters(implementation)
    shown = f"{backend.__name__}.{name}{inspect.signature(implementation)}"
    assert got[: len(wanted)] == wanted, shown
    extra = got[len(wanted) :]
    assert all(default is not inspect.Parameter.empty for _, _, default in extra), (
        f"{backend.__name__}.{name} has required parameters the Protocol lacks: {extra}"
    )


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
def test_no_backend_has_an_operation_the_protocol_lacks(backend):
    public = {
        name
        for name, value in vars(backend).items()
        if callable(value) and not name.startswith("_")
    }
    assert public - set(METHODS) - BACKEND_EXTRAS[backend] == set()


def test_local_backend_is_a_backend():
    backend = LocalBackend()
    assert isinstance(backend, Backend)
    assert (backend.num_shards, backend.rank, backend.num_workers) == (1, 0, 1)


def test_remote_backend_is_a_backend(server_factory):
    backend = RemoteBackend(server_factory(1), rank=0, num_workers=1, timeout=30)
    try:
        assert isinstance(backend, Backend)
        assert (backend.num_shards, backend.rank, backend.num_workers) == (1, 0, 1)
    finally:
        backend.close()
