"""The PyTorch adapter: Embedding / EmbeddingBag modules whose table lives on the store.

Parity: each module with a server-side optimizer against torch's own
nn.Embedding(sparse=True) / nn.EmbeddingBag(sparse=True) with the matching
torch.optim optimizer, on the same data and initial rows, with the table on
two real servers: outputs equal at every step, tables equal after training.
Zero-copy is checked by data pointers: the buffer kvsparse fills is the
forward's output, the array kvsparse reads a gradient from is autograd's
gradient tensor.
"""

from __future__ import annotations

import copy
import threading
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import last_json, run_workers  # noqa: E402
from kvsparse.adapters.torch import (  # noqa: E402
    DenseGradientSync,
    Embedding,
    EmbeddingBag,
    follow_learning_rate,
    prefetch_together,
    push_together,
)

import kvsparse  # noqa: E402
import kvsparse.store.batching  # noqa: E402
from kvsparse import errors, initializers, optimizers  # noqa: E402
from kvsparse.wire import ops  # noqa: E402

VOCAB = 40
DIM = 6
STEPS = 8
BATCH = 12
RTOL = 1e-5
ATOL = 1e-6
# The store's ids for torch's indices 0..VOCAB-1: any int64, hashed-looking.
KEYS = np.unique(
    np.random.default_rng(42).integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 10 * VOCAB)
)[:VOCAB]
np.random.default_rng(7).shuffle(KEYS)


@pytest.fixture(scope="module")
def servers(module_server_factory):
    return module_server_factory(2)


@pytest.fixture
def two_servers(servers):
    """A worker (rank 0 of 1) of a store whose tables are split over two real servers."""
    store = kvsparse.create("dist_sparse", servers=servers, rank=0, num_workers=1)
    yield store
    store.close()


@pytest.fixture
def kv():
    store = kvsparse.create("local")
    yield store
    store.close()


@pytest.fixture(params=["local", "dist"])
def any_store(request, servers):
    if request.param == "local":
        store = kvsparse.create("local")
    else:
        store = kvsparse.create("dist_sparse", servers=servers, rank=0, num_workers=1)
    yield store
    store.close()


_table_counter = iter(range(10**6))


def fresh_key(prefix: str) -> str:
    """A table name no other test of this module uses (the module shares its servers)."""
    return f"{prefix}_{next(_table_counter)}"


# -- parity with torch.nn + torch.optim ----------------------------------------------------

OPTIMIZERS = {
    "sgd": (
        lambda: optimizers.SGD(learning_rate=0.5),
        lambda params: torch.optim.SGD(params, lr=0.5),
        ATOL,
    ),
    "adagrad": (
        lambda: optimizers.Adagrad(learning_rate=0.3),
        lambda params: torch.optim.Adagrad(params, lr=0.3),
        ATOL,
    ),
    # torch.optim.SparseAdam counts steps per parameter, as step_mode='table' does.
    # It adds eps to sqrt(v) before the bias correction; torch.optim.Adam (the
    # store's formula) adds it after: with eps=1e-8 a gradient element of 1e-5 moves
    # 3% less in SparseAdam at step 1. A tiny eps leaves only float rounding.
    "adam": (
        lambda: optimizers.Adam(learning_rate=0.05, step_mode="table", eps=1e-12),
        lambda params: torch.optim.SparseAdam(params, lr=0.05, eps=1e-12),
        # m / sqrt(v) turns the rounding of gradients summed in another order
        # into differences of a few 1e-6 after 8 steps (measured: up to 2e-6).
        1e-5,
    ),
    # MXNet's Adam formula is SparseAdam's (eps outside the bias correction):
    # equal at the default eps.
    "adam_mxnet_formula": (
        lambda: optimizers.Adam(learning_rate=0.05, step_mode="table", formula="mxnet"),
        lambda params: torch.optim.SparseAdam(params, lr=0.05),
        1e-5,
    ),
}


class Variant:
    """One module configuration: how to build both sides and make a batch."""

    def __init__(
        self, name, make_ours, make_torch, make_batch, padding=None, dense_reference=False
    ):
        self.name = name
        self.dense_reference = dense_reference
        self.make_ours = make_ours
        self.make_torch = make_torch
        self.make_batch = make_batch  # rng -> (torch-index input, extra kwargs without ids)
        self.padding = padding  # torch index of the padding row, or None


def _indices(rng, shape, padding=None):
    values = rng.integers(0, VOCAB, shape)
    if padding is not None:
        values[rng.random(shape) < 0.3] = padding
    return values


def _bags(rng, count, weights=False):
    lengths = rng.integers(0, 5, count)
    lengths[1] = 0  # an empty bag
    flat = rng.integers(0, VOCAB, int(lengths.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    extra = {"offsets": torch.from_numpy(offsets)}
    if weights:
        extra["per_sample_weights"] = torch.from_numpy(rng.uniform(0.5, 2.0, flat.size)).float()
    return flat, extra


VARIANTS = [
    Variant(
        "embedding",
        lambda kv, key, opt: Embedding(kv, key, DIM, optimizer=opt, initializer=_INIT, seed=3),
        lambda: torch.nn.Embedding(VOCAB, DIM, sparse=True),
        lambda rng: (_indices(rng, (BATCH, 3)), {}),
    ),
    Variant(
        "embedding_padding",
        lambda kv, key, opt: Embedding(
            kv, key, DIM, padding_idx=int(KEYS[0]), optimizer=opt, initializer=_INIT, seed=3
        ),
        lambda: torch.nn.Embedding(VOCAB, DIM, padding_idx=0, sparse=True),
        lambda rng: (_indices(rng, (BATCH, 3), padding=0), {}),
        padding=0,
    ),
    Variant(
        "bag_sum",
        lambda kv, key, opt: EmbeddingBag(
            kv, key, DIM, mode="sum", optimizer=opt, initializer=_INIT, seed=3
        ),
        lambda: torch.nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True),
        lambda rng: (_indices(rng, (BATCH, 4)), {}),
    ),
    Variant(
        "bag_mean_offsets",
        lambda kv, key, opt: EmbeddingBag(
            kv, key, DIM, mode="mean", optimizer=opt, initializer=_INIT, seed=3
        ),
        lambda: torch.nn.EmbeddingBag(VOCAB, DIM, mode="mean", sparse=True),
        lambda rng: _bags(rng, BATCH),
    ),
    Variant(
        "bag_sum_per_sample_weights",
        lambda kv, key, opt: EmbeddingBag(
            kv, key, DIM, mode="sum", optimizer=opt, initializer=_INIT, seed=3
        ),
        lambda: torch.nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True),
        lambda rng: _bags(rng, BATCH, weights=True),
    ),
    Variant(
        "bag_mean_padding",
        lambda kv, key, opt: EmbeddingBag(
            kv,
            key,
            DIM,
            mode="mean",
            padding_idx=int(KEYS[0]),
            optimizer=opt,
            initializer=_INIT,
            seed=3,
        ),
        lambda: torch.nn.EmbeddingBag(VOCAB, DIM, mode="mean", padding_idx=0, sparse=True),
        lambda rng: (_indices(rng, (BATCH, 4), padding=0), {}),
        padding=0,
    ),
    Variant(
        "bag_max",
        lambda kv, key, opt: EmbeddingBag(
            kv, key, DIM, mode="max", optimizer=opt, initializer=_INIT, seed=3
        ),
        # torch has no sparse gradient for max bags: the dense one is made sparse
        # over the batch's rows (see _sparse_over_batch).
        lambda: torch.nn.EmbeddingBag(VOCAB, DIM, mode="max"),
        lambda rng: (_indices(rng, (BATCH, 4)), {}),
        dense_reference=True,
    ),
]
_INIT = initializers.Uniform(-0.5, 0.5)


def _loss(out, projection, target):
    return ((out * projection).sum(-1) - target).pow(2).mean()


def _sparse_over_batch(weight, indices):
    """weight.grad as a sparse gradient of every row in the batch (as the store gets it)."""
    rows = torch.from_numpy(np.unique(indices))
    weight.grad = torch.sparse_coo_tensor(rows[None], weight.grad[rows], weight.shape)


def _run_parity(kv, variant, optimizer_name):
    make_ours, make_torch_optimizer, atol = OPTIMIZERS[optimizer_name]
    key = fresh_key(f"{variant.name}_{optimizer_name}")
    ours = variant.make_ours(kv, key, make_ours())
    reference = variant.make_torch()
    initial = kv.row_sparse_pull(key, row_ids=KEYS)
    with torch.no_grad():
        reference.weight.copy_(torch.from_numpy(initial))
        if variant.padding is not None and isinstance(reference, torch.nn.Embedding):
            reference.weight[variant.padding] = 0.0  # nn.Embedding's padding row is zeros
    torch_optimizer = make_torch_optimizer(reference.parameters())
    rng = np.random.default_rng(zlib.crc32(variant.name.encode()))
    projection = torch.from_numpy(rng.normal(size=DIM)).float()
    for step in range(STEPS):
        indices, extra = variant.make_batch(rng)
        weights = extra.get("per_sample_weights")
        extra_ours = dict(extra)
        if weights is not None:
            extra["per_sample_weights"] = weights.clone().requires_grad_()
            extra_ours["per_sample_weights"] = weights.clone().requires_grad_()

        out = ours(torch.from_numpy(KEYS[indices]), **extra_ours)
        expected = reference(torch.from_numpy(indices), **extra)
        torch.testing.assert_close(
            out,
            expected,
            rtol=RTOL,
            atol=atol,
            msg=lambda m, step=step: f"{variant.name}, step {step}: {m}",
        )
        target = torch.from_numpy(rng.normal(size=tuple(out.shape[:-1]))).float()

        _loss(out, projection, target).backward()  # pushes; the store's optimizer steps
        torch_optimizer.zero_grad()
        _loss(expected, projection, target).backward()
        if variant.dense_reference:
            _sparse_over_batch(reference.weight, indices)
        torch_optimizer.step()
        if weights is not None:
            torch.testing.assert_close(
                extra_ours["per_sample_weights"].grad,
                extra["per_sample_weights"].grad,
                rtol=RTOL,
                atol=atol,
            )

    rows = kv.row_sparse_pull(key, row_ids=KEYS)
    trained = reference.weight.detach().numpy()
    compared = np.arange(VOCAB) != (-1 if variant.padding is None else variant.padding)
    np.testing.assert_allclose(
        rows[compared], trained[compared], rtol=RTOL, atol=atol, err_msg=variant.name
    )
    # Not vacuous: training moved most rows.
    moved = np.abs(rows - initial).max(axis=1) > 1e-3
    assert moved.sum() >= VOCAB // 2, f"only {moved.sum()} rows changed"
    if variant.padding is not None:
        # The padding row was never pushed: the store holds its initial value.
        np.testing.assert_array_equal(rows[variant.padding], initial[variant.padding])
    return float(np.abs(rows[compared] - trained[compared]).max())


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_parity_with_torch_nn_on_two_servers(two_servers, optimizer_name):
    differences = {v.name: _run_parity(two_servers, v, optimizer_name) for v in VARIANTS}
    print(f"{optimizer_name}: largest |table - torch| after {STEPS} steps: {differences}")


# -- shapes, dtypes, table creation ---------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (2, 3, 4), (0,), (3, 0)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_output_is_ids_shape_plus_dim_and_matches_the_store(kv, shape, dtype):
    emb = Embedding(
        kv, "user", embedding_dim=5, seed=3, optimizer=optimizers.SGD(learning_rate=0.1)
    )
    high = 2**62 if dtype == torch.int64 else 2**31 - 1
    ids = torch.from_numpy(np.random.default_rng(0).integers(-high, high, shape)).to(dtype)
    out = emb(ids)
    assert out.shape == shape + (5,) and out.dtype == torch.float32
    np.testing.assert_array_equal(out.detach().numpy(), kv.row_sparse_pull("user", row_ids=ids))
    out.sum().backward()  # an empty batch pushes nothing and fails nothing


def test_module_creates_the_table_with_its_settings_and_holds_none_of_it(kv):
    emb = Embedding(
        kv,
        "item",
        embedding_dim=3,
        initializer=initializers.Constant(0.5),
        optimizer=optimizers.SGD(learning_rate=1.0),
    )
    assert "item" in kv and kv.key_info("item").dim == 3
    assert list(emb.parameters()) == [] and list(emb.buffers()) == []
    assert emb.state_dict() == {}
    ids = torch.arange(1000)
    emb(ids).sum().backward()
    assert kv.stats()["tables"]["item"]["rows"] == 1000  # the rows are on the store
    np.testing.assert_array_equal(kv.row_sparse_pull("item", row_ids=np.array([7])), [[-0.5] * 3])
    copied = copy.deepcopy(emb)  # refers to the same table, copies none of it
    np.testing.assert_array_equal(copied(torch.tensor([7])).detach().numpy(), [[-0.5] * 3])
    # A second module on the same table shares it; the dim is checked.
    again = Embedding(kv, "item")
    assert again.embedding_dim == 3
    with pytest.raises(errors.ShapeError):
        Embedding(kv, "item", embedding_dim=4)


def test_errors(kv):
    with pytest.raises(errors.UnknownKey, match="embedding_dim"):
        Embedding(kv, "missing")
    emb = Embedding(kv, "user", embedding_dim=2)
    with pytest.raises(errors.DTypeError):
        emb(torch.tensor([1.0, 2.0]))
    with pytest.raises(errors.KeyTypeError):
        emb([1, 2])
    kv.init("dense", np.zeros(3, np.float32))
    with pytest.raises(errors.InvalidArgument, match="dense"):
        Embedding(kv, "dense", embedding_dim=3)
    with pytest.raises(errors.InvalidArgument, match="mode"):
        EmbeddingBag(kv, "user", mode="median")
    bag = EmbeddingBag(kv, "user", mode="mean")
    with pytest.raises(errors.InvalidArgument, match="mode='sum'"):
        bag(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(1, 2))
    with pytest.raises(errors.InvalidArgument, match="offsets"):
        bag(torch.tensor([1, 2]))


def test_gradient_of_any_layout_is_pushed_exactly(kv):
    """A non-contiguous gradient (here from a transpose) reaches the store intact."""
    emb = Embedding(
        kv,
        "user",
        embedding_dim=3,
        initializer=initializers.Zeros(),
        optimizer=optimizers.SGD(learning_rate=1.0),
    )
    ids = torch.tensor([[4, 5], [6, 4]])
    weight = torch.arange(12.0).reshape(3, 2, 2)  # (dim, 2, 2)
    out = emb(ids)  # (2, 2, 3)
    (out.permute(2, 0, 1) * weight).sum().backward()
    grad = weight.permute(1, 2, 0).numpy()  # d loss / d out
    expected = {4: -(grad[0, 0] + grad[1, 1]), 5: -grad[0, 1], 6: -grad[1, 0]}
    rows = kv.row_sparse_pull("user", row_ids=np.array([4, 5, 6]))
    np.testing.assert_array_equal(rows, np.stack([expected[4], expected[5], expected[6]]))


def test_no_grad_forward_pushes_nothing(kv):
    emb = Embedding(kv, "user", embedding_dim=2, optimizer=optimizers.SGD(learning_rate=1.0))
    with torch.no_grad():
        out = emb(torch.tensor([1, 2]))
    assert not out.requires_grad
    assert kv.stats()["tables"]["user"]["rows"] == 0


# -- freezing ---------------------------------------------------------------------------------


def _freeze_requires_grad(module):
    module.requires_grad_(False)


def _freeze_flag(module):
    module.requires_grad = False


def _freeze_eval(module):
    module.eval()


@pytest.mark.parametrize("freeze", [_freeze_requires_grad, _freeze_flag, _freeze_eval])
@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "bag"])
def test_a_frozen_table_stays_while_the_other_layers_train(any_store, freeze, bag):
    kv = any_store
    ids = torch.tensor([[1, 5], [5, 9]])
    sgd = optimizers.SGD(learning_rate=0.5)
    if bag:
        frozen = EmbeddingBag(kv, fresh_key("frozen"), embedding_dim=3, mode="sum", optimizer=sgd)
        trained = EmbeddingBag(kv, fresh_key("trained"), embedding_dim=3, mode="sum", optimizer=sgd)
    else:
        frozen = Embedding(kv, fresh_key("frozen"), embedding_dim=3, optimizer=sgd)
        trained = Embedding(kv, fresh_key("trained"), embedding_dim=3, optimizer=sgd)
    dense = torch.nn.Linear(3, 1)
    dense_before = dense.weight.detach().clone()
    keys = np.array([1, 5, 9])
    frozen_before = kv.row_sparse_pull(frozen.key, row_ids=keys).copy()
    trained_before = kv.row_sparse_pull(trained.key, row_ids=keys).copy()
    freeze(frozen)
    assert not frozen.requires_grad or not frozen.training
    dense_optimizer = torch.optim.SGD(dense.parameters(), lr=0.5)
    for _ in range(2):
        out = frozen(ids)
        assert not out.requires_grad
        loss = dense(out + trained(ids)).pow(2).sum()
        dense_optimizer.zero_grad()
        loss.backward()
        dense_optimizer.step()
    np.testing.assert_array_equal(kv.row_sparse_pull(frozen.key, row_ids=keys), frozen_before)
    assert not np.allclose(kv.row_sparse_pull(trained.key, row_ids=keys), trained_before)
    assert not torch.equal(dense.weight.detach(), dense_before)
    # Unfrozen again, it trains.
    frozen.requires_grad_(True)
    frozen.train()
    frozen(ids).pow(2).sum().backward()
    assert not np.allclose(kv.row_sparse_pull(frozen.key, row_ids=keys), frozen_before)


# -- learning-rate schedules -------------------------------------------------------------------


@pytest.mark.parametrize("together", [False, True], ids=["backward", "push_together"])
def test_a_torch_scheduler_drives_the_servers_rate_and_keeps_the_accumulator(any_store, together):
    from reference import ReferenceOptimizer

    kv = any_store
    emb = Embedding(
        kv, fresh_key("scheduled"), embedding_dim=3, optimizer=optimizers.Adagrad(learning_rate=0.5)
    )
    dense = torch.nn.Linear(2, 1)
    dense_optimizer = torch.optim.SGD(dense.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(dense_optimizer, step_size=2, gamma=0.1)
    follower = follow_learning_rate(kv, dense_optimizer, learning_rate=0.5)
    ids = torch.tensor([3, 8])
    scale = torch.tensor([[1.0, -2.0, 0.5], [0.25, 1.5, -1.0]])
    keys = ids.numpy()
    rows = kv.row_sparse_pull(emb.key, row_ids=keys).copy()
    try:
        for _ in range(4):
            dense_optimizer.zero_grad()
            loss = (emb(ids) * scale).sum() + dense(torch.ones(1, 2)).sum()
            if together:
                with push_together(kv):
                    loss.backward()
            else:
                loss.backward()
            dense_optimizer.step()
            scheduler.step()
    finally:
        follower.remove()
    # Server rates: 0.5 for two steps, then 0.5 * 0.1, as the dense group's lr.
    slots = [None, None]
    for step, rate in enumerate([0.5, 0.5, 0.05, 0.05], start=1):
        reference = ReferenceOptimizer(optimizers.Adagrad(learning_rate=rate).to_dict())
        for i in range(2):
            if slots[i] is None:
                slots[i] = reference.initial_slots(3)
            reference.update(rows[i], slots[i], scale[i].numpy(), step)
    np.testing.assert_allclose(kv.row_sparse_pull(emb.key, row_ids=keys), rows, rtol=2e-5)


# -- zero copy -------------------------------------------------------------------------------


class CoreSpy:
    """Stands in for kvsparse._core in kvsparse.store.batching; records the memory it is given."""

    def __init__(self, core):
        self._core = core
        self.filled = []  # address of each array gather_from_shards wrote
        self.summed = []  # address of each gradient array sum_rows_checked read

    def __getattr__(self, name):
        return getattr(self._core, name)

    def gather_from_shards(self, rows, offsets, slot, target):
        self.filled.append(target.ctypes.data)
        return self._core.gather_from_shards(rows, offsets, slot, target)

    def sum_rows_checked(self, grads, slot, count, out=None):
        self.summed.append(grads.ctypes.data)
        return self._core.sum_rows_checked(grads, slot, count, out)


@pytest.fixture
def core_spy(monkeypatch):
    spy = CoreSpy(kvsparse.store.batching._core)
    monkeypatch.setattr(kvsparse.store.batching, "_core", spy)
    return spy


def test_forward_output_is_the_buffer_kvsparse_fills(any_store, core_spy):
    emb = Embedding(any_store, fresh_key("zero_copy"), embedding_dim=8)
    out = emb(torch.tensor([[3, 1], [4, 1]]))
    assert core_spy.filled == [out.data_ptr()]
    with torch.no_grad():
        out = emb(torch.tensor([5, 9, 2]))
    assert core_spy.filled[-1] == out.data_ptr()


def test_push_hands_kvsparse_autograds_gradient_memory(any_store, core_spy):
    emb = Embedding(
        any_store,
        fresh_key("zero_copy_push"),
        embedding_dim=8,
        optimizer=optimizers.SGD(learning_rate=0.1),
    )
    out = emb(torch.tensor([[3, 1], [4, 1]]))
    seen = []
    out.register_hook(seen.append)  # the gradient tensor autograd hands the module's backward
    (out * torch.arange(8.0)).sum().backward()
    assert len(seen) == 1 and seen[0].is_contiguous()
    assert core_spy.summed == [seen[0].data_ptr()]


def test_bag_pulls_into_one_buffer_and_pushes_autograds_gradient(kv, core_spy):
    bag = EmbeddingBag(
        kv, "bag", embedding_dim=4, mode="sum", optimizer=optimizers.SGD(learning_rate=0.1)
    )
    bag(torch.tensor([[1, 2, 3], [3, 2, 1]])).sum().backward()
    assert len(core_spy.filled) == 1 and len(core_spy.summed) == 1


# -- prefetch -------------------------------------------------------------------------------


def test_prefetch_is_used_when_the_ids_match(kv):
    emb = Embedding(kv, "user", embedding_dim=4, optimizer=optimizers.SGD(learning_rate=1.0))
    ids = torch.tensor([[1, 2], [2, 3]])
    emb.prefetch(ids)
    ids[0, 0] = 99  # the caller reuses its buffer: the prefetch kept the ids it was given
    out = emb(torch.tensor([[1, 2], [2, 3]]))
    assert (emb.prefetch_hits, emb.prefetch_misses) == (1, 0)
    np.testing.assert_array_equal(
        out.detach().numpy(), kv.row_sparse_pull("user", row_ids=np.array([[1, 2], [2, 3]]))
    )
    out.sum().backward()  # a prefetched forward pushes like any other
    np.testing.assert_allclose(
        kv.row_sparse_pull("user", row_ids=np.array([1, 2])),
        out.detach().numpy()[0] - np.array([[1.0], [2.0]]),
        rtol=1e-6,
    )


def test_prefetch_after_backward_sees_the_update_and_mismatch_pulls_again(kv):
    emb = Embedding(
        kv,
        "user",
        embedding_dim=2,
        initializer=initializers.Zeros(),
        optimizer=optimizers.SGD(learning_rate=1.0),
    )
    ids = torch.tensor([5, 6])
    emb(ids).sum().backward()
    emb.prefetch(ids)
    np.testing.assert_array_equal(emb(ids).detach().numpy(), -np.ones((2, 2)))
    emb.prefetch(torch.tensor([7]))
    out = emb(torch.tensor([5]))
    assert (emb.prefetch_hits, emb.prefetch_misses) == (1, 1)
    np.testing.assert_array_equal(out.detach().numpy(), -np.ones((1, 2)))


def test_bag_prefetch_matches_the_flattened_input(kv):
    bag = EmbeddingBag(kv, "user", embedding_dim=2, mode="sum")
    ids = torch.tensor([[1, 2], [3, 4]])
    bag.prefetch(ids)
    bag(ids)
    assert bag.prefetch_hits == 1


def test_prefetch_error_is_raised_by_the_next_forward_not_in_the_thread(kv, monkeypatch):
    emb = Embedding(kv, "user", embedding_dim=2)
    real_pull = kv.row_sparse_pull
    failing_threads = []

    def pull_failing_for_666(key, out=None, priority=0, row_ids=None):
        if 666 in np.asarray(row_ids):
            failing_threads.append(threading.get_ident())
            raise errors.ServerUnavailable("server gone", address="tcp://127.0.0.1:1")
        return real_pull(key, out=out, row_ids=row_ids)

    monkeypatch.setattr(kv, "row_sparse_pull", pull_failing_for_666)
    emb.prefetch(torch.tensor([666]))  # returns: the failure happens on the thread
    with pytest.raises(errors.ServerUnavailable, match="server gone"):
        emb(torch.tensor([1, 2]))  # other ids, but the caller still learns of the failure
    assert failing_threads and failing_threads[0] != threading.get_ident()
    emb(torch.tensor([1, 2]))  # the error was reported once; the module works again
    # A prefetch that is never used still reports its error, at the next prefetch.
    emb.prefetch(torch.tensor([666]))
    with pytest.raises(errors.ServerUnavailable):
        emb.prefetch(torch.tensor([4]))
    assert len(failing_threads) == 2


# -- one request per server for several tables ---------------------------------------------


def _two_tables(kv, prefix=""):
    """Two fresh tables ("first", "vectors"); prefix keeps them apart on shared servers."""
    settings = {"initializer": initializers.Zeros(), "optimizer": optimizers.SGD(learning_rate=1.0)}
    return Embedding(kv, prefix + "first", embedding_dim=1, **settings), Embedding(
        kv, prefix + "vectors", embedding_dim=3, **settings
    )


def _count_calls(monkeypatch, target, name: str) -> list:
    calls = []
    real = getattr(target, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, counted)
    return calls


def _two_table_loss(first, vectors, ids):
    return first(ids).sum() + (vectors(ids) * torch.tensor([1.0, 2.0, 3.0])).sum()


@pytest.mark.parametrize("store", ["kv", "two_servers"])
def test_push_together_sends_one_push_with_the_same_result(request, store, monkeypatch):
    kv = request.getfixturevalue(store)
    first, vectors = _two_tables(kv, "push_together_")
    ids = torch.tensor([[1, 2], [2, 9]])
    pushes = _count_calls(monkeypatch, kv._backend, "push_sparse")
    with push_together(kv):
        loss = _two_table_loss(first, vectors, ids)
        loss = loss + first(torch.tensor([9])).sum()  # a table used twice: summed, one push
        loss.backward()
        assert pushes == []  # nothing sent before the block ends
    assert len(pushes) == 1 and len(pushes[0][0]) == 2  # one call, both tables in it
    np.testing.assert_array_equal(
        kv.row_sparse_pull(first.key, row_ids=np.array([1, 2, 9]))[:, 0], [-1, -2, -2]
    )
    np.testing.assert_array_equal(
        kv.row_sparse_pull(vectors.key, row_ids=np.array([1, 2, 9])),
        -np.outer([1, 2, 1], [1.0, 2.0, 3.0]),
    )


def test_push_together_pushes_nothing_when_the_block_raises(kv):
    first, vectors = _two_tables(kv)
    with pytest.raises(RuntimeError, match="after backward"):
        with push_together(kv):
            _two_table_loss(first, vectors, torch.tensor([4])).backward()
            raise RuntimeError("after backward")
    assert kv.stats()["tables"]["first"]["rows"] == 0
    assert kv.stats()["tables"]["vectors"]["rows"] == 0
    with push_together(kv):  # the store's block was closed: a new one opens
        with pytest.raises(errors.InvalidArgument, match="already open"):
            with push_together(kv):
                pass


def test_push_together_refuses_a_table_without_optimizer_in_the_backward(kv):
    emb = Embedding(kv, "bare", embedding_dim=2)
    with pytest.raises(errors.InvalidArgument, match="no optimizer"):
        with push_together(kv):
            emb(torch.tensor([1])).sum().backward()
    assert kv.stats()["tables"]["bare"]["rows"] == 0


@pytest.mark.parametrize("store", ["kv", "two_servers"])
def test_prefetch_together_pulls_both_tables_in_one_call(request, store, monkeypatch):
    kv = request.getfixturevalue(store)
    first, vectors = _two_tables(kv, "prefetch_together_")
    ids = torch.tensor([[1, 2], [2, 9]])
    with push_together(kv):
        _two_table_loss(first, vectors, ids).backward()
    pulls = _count_calls(monkeypatch, kv._backend, "pull_sparse")
    prefetch_together([first, vectors], ids)
    ids[0, 0] = 77  # the caller refills its buffer: the prefetch kept a copy
    expected_ids = torch.tensor([[1, 2], [2, 9]])
    out_first, out_vectors = first(expected_ids), vectors(expected_ids)
    assert len(pulls) == 1 and len(pulls[0][0]) == 2
    assert (first.prefetch_hits, vectors.prefetch_hits) == (1, 1)
    np.testing.assert_array_equal(
        out_vectors.detach().numpy(), kv.row_sparse_pull(vectors.key, row_ids=expected_ids.numpy())
    )
    np.testing.assert_array_equal(out_first.detach().numpy()[0, :, 0], [-1, -2])


def test_prefetch_together_reports_a_failed_pull_once(kv, monkeypatch):
    first, vectors = _two_tables(kv)

    def failing(*args, **kwargs):
        raise errors.ServerUnavailable("server gone", address="tcp://127.0.0.1:1")

    monkeypatch.setattr(kv, "row_sparse_pull", failing)
    prefetch_together([first, vectors], torch.tensor([3]))
    with pytest.raises(errors.ServerUnavailable, match="server gone"):
        first(torch.tensor([3]))
    monkeypatch.undo()
    vectors(torch.tensor([3]))  # the other table pulls again instead of raising twice
    assert vectors.prefetch_misses == 1


def test_prefetch_together_checks_its_arguments(kv):
    first, vectors = _two_tables(kv)
    other = kvsparse.create("local")
    try:
        stranger = Embedding(other, "first", embedding_dim=1)
        with pytest.raises(errors.InvalidArgument, match="different stores"):
            prefetch_together([first, stranger], torch.tensor([1]))
    finally:
        other.close()
    with pytest.raises(errors.InvalidArgument, match="2 modules but 3"):
        prefetch_together([first, vectors], [torch.tensor([1])] * 3)
    with pytest.raises(errors.DTypeError):
        prefetch_together([first, vectors], torch.tensor([1.5]))


def _train_steps(kv, prefix: str, wait: bool) -> list:
    """Four steps of the example's loop (push_together, then prefetch of the next batch)."""
    first, vectors = _two_tables(kv, prefix)
    batches = [torch.tensor([[1, 2], [2, 9]]), torch.tensor([[9, 4]]), torch.tensor([[1, 1]])]
    batches.append(batches[0])
    for step, ids in enumerate(batches):
        with push_together(kv, wait=wait):
            _two_table_loss(first, vectors, ids).backward()
        if step + 1 < len(batches):
            prefetch_together([first, vectors], batches[step + 1])
    assert (first.prefetch_hits, vectors.prefetch_hits) == (3, 3)
    ids = torch.tensor([1, 2, 4, 9])
    return [first(ids).detach().numpy(), vectors(ids).detach().numpy()]


def test_push_together_without_waiting_trains_the_same_rows(two_servers):
    waited = _train_steps(two_servers, "push_waited_", wait=True)
    sent = _train_steps(two_servers, "push_sent_", wait=False)
    local = _train_steps(kvsparse.create("local"), "", wait=False)
    for a, b, c in zip(waited, sent, local):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_a_push_sent_without_waiting_fails_in_the_next_forward(two_servers):
    emb = Embedding(
        two_servers,
        "push_overflow",
        embedding_dim=2,
        initializer=initializers.Zeros(),
        optimizer=optimizers.SGD(learning_rate=1e30),
    )
    ids = torch.tensor([3])
    with push_together(two_servers, wait=False):
        (emb(ids) * 1e10).sum().backward()  # the servers refuse the update: it overflows
    emb.prefetch(ids)
    with pytest.raises(errors.UpdateOverflow, match="id 3"):
        emb(ids)
    np.testing.assert_array_equal(emb(ids).detach().numpy(), np.zeros((1, 2)))


def test_one_prefetch_thread_per_store_runs_every_prefetch(kv):
    def prefetch_threads():
        return [t for t in threading.enumerate() if t.name == "kvsparse-prefetch"]

    before = set(prefetch_threads())  # other stores' (a collected store's ends)
    emb = Embedding(kv, "user", embedding_dim=2)
    for step in range(5):
        emb.prefetch(torch.tensor([step]))
        emb(torch.tensor([step]))
    assert emb.prefetch_hits == 5
    assert len(set(prefetch_threads()) - before) == 1


def test_a_dist_prefetch_is_sent_at_once_and_read_by_the_next_forward(two_servers, monkeypatch):
    """Where the store defers pulls, the prefetch sends its requests from the calling
    thread and the next forward reads the replies: no prefetch thread."""
    assert two_servers.defers_pulls
    first, vectors = _two_tables(two_servers, "deferred_prefetch_")
    session = two_servers._backend.session
    sent, send = [], session._send

    def spied_send(server, request, request_id=None):
        sent.append((ops.Op(request.op).name, threading.get_ident()))
        return send(server, request, request_id)

    monkeypatch.setattr(session, "_send", spied_send)
    threads_before = {t.name for t in threading.enumerate()}
    ids = torch.tensor([[1, 2], [2, 9]])
    loss = _two_table_loss(first, vectors, ids)  # pulls
    sent.clear()
    with push_together(two_servers, wait=False):
        loss.backward()
    prefetch_together([first, vectors], ids)
    assert [op for op, _ in sent] == ["PUSH_SPARSE"] * 2 + ["PULL_SPARSE"] * 2
    assert {thread for _, thread in sent} == {threading.get_ident()}
    out_first, out_vectors = first(ids), vectors(ids)
    assert (first.prefetch_hits, vectors.prefetch_hits) == (1, 1)
    assert len(sent) == 4  # the forwards read the replies; nothing sent again
    np.testing.assert_array_equal(out_first.detach().numpy()[0, :, 0], [-1, -2])
    np.testing.assert_array_equal(
        out_vectors.detach().numpy(), two_servers.row_sparse_pull(vectors.key, row_ids=ids.numpy())
    )
    assert {t.name for t in threading.enumerate()} - threads_before <= {"ZMQbg/IO/0"}


def test_a_deferred_prefetch_that_fails_to_send_fails_the_next_forward(two_servers, monkeypatch):
    emb = Embedding(two_servers, "deferred_prefetch_failure", embedding_dim=2)
    real_pull = two_servers.row_sparse_pull

    def failing_unwaited(key, out=None, priority=0, row_ids=None, dtype=None, wait=True):
        if not wait:
            raise errors.ServerUnavailable("server gone", address="tcp://127.0.0.1:1")
        return real_pull(key, out=out, row_ids=row_ids, dtype=dtype)

    monkeypatch.setattr(two_servers, "row_sparse_pull", failing_unwaited)
    emb.prefetch(torch.tensor([5]))  # returns: the failure is kept for the forward
    with pytest.raises(errors.ServerUnavailable, match="server gone"):
        emb(torch.tensor([5]))
    assert emb(torch.tensor([5])).shape == (1, 2)  # reported once; the module works again


# -- several workers -------------------------------------------------------------------------

WORKER = r"""
import json, numpy as np, torch, kvsparse
from kvsparse.adapters.torch import DenseGradientSync, Embedding

kv = kvsparse.create("dist_sparse")
rank = kv.rank
torch.manual_seed(100 + rank)  # different initial weights on purpose
model = torch.nn.Linear(3, 2)
initial = [p.detach().clone() for p in model.parameters()]
sync = DenseGradientSync(kv, model.parameters(), key="linear")
after_broadcast = [p.detach().clone() for p in model.parameters()]
model(torch.full((1, 3), float(rank + 1))).sum().backward()
local = [p.grad.clone() for p in model.parameters()]
sync.synchronize()

emb = Embedding(kv, "user", embedding_dim=2, initializer=kvsparse.initializers.Zeros(),
                optimizer=kvsparse.optimizers.SGD(learning_rate=1.0))
(emb(torch.tensor([7, 8 + rank])) * (rank + 1)).sum().backward()  # BSP: both pushes applied
rows = kv.row_sparse_pull("user", row_ids=np.array([7, 8, 9]))
kv.barrier()
print(json.dumps({
    "initial": [p.tolist() for p in initial],
    "after_broadcast": [p.tolist() for p in after_broadcast],
    "local": [g.tolist() for g in local],
    "synced": [p.grad.tolist() for p in model.parameters()],
    "rows": rows.tolist(),
}))
"""


def test_two_workers_share_dense_weights_average_gradients_and_sum_sparse_pushes(
    server_factory, tmp_path
):
    outputs = run_workers(WORKER, server_factory(2), 2, tmp_path, timeout=120)
    results = [last_json(out) for out in outputs]
    for r in results:
        for got, rank0 in zip(r["after_broadcast"], results[0]["initial"]):
            np.testing.assert_array_equal(got, rank0)
        for synced, g0, g1 in zip(r["synced"], results[0]["local"], results[1]["local"]):
            np.testing.assert_allclose(synced, (np.array(g0) + np.array(g1)) / 2, rtol=1e-6)
        # id 7: pushed by both (1 + 2); id 8 by rank 0 (1); id 9 by rank 1 (2).
        np.testing.assert_array_equal(r["rows"], [[-3, -3], [-1, -1], [-2, -2]])
    assert results[0]["initial"] != results[1]["initial"]
    assert results[0]["local"] != results[1]["local"]


def test_dense_gradient_sync_refuses_a_store_wide_optimizer(kv):
    kv.set_optimizer(optimizers.SGD())
    with pytest.raises(errors.InvalidArgument, match="store-wide optimizer"):
        DenseGradientSync(kv, torch.nn.Linear(2, 2).parameters())


def test_dense_gradient_sync_single_worker_keeps_gradients(kv, monkeypatch):
    model = torch.nn.Linear(4, 3)
    sync = DenseGradientSync(kv, model.parameters(), key="dense")
    model(torch.ones(2, 4)).pow(2).sum().backward()
    local = [p.grad.clone() for p in model.parameters()]
    calls = []
    for name in ("push", "pull"):
        monkeypatch.setattr(kv, name, lambda *a, _name=name, **k: calls.append(_name))
    sync.synchronize()
    assert calls == []  # one worker: nothing to average, no round trip
    for p, g in zip(model.parameters(), local):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    assert kv.key_info("dense").shape == (4 * 3 + 3,)  # one flat dense key for all parameters


def test_dense_gradient_sync_single_worker_gives_missing_gradients_zeros(kv):
    used, unused = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    sync = DenseGradientSync(kv, [*used.parameters(), *unused.parameters()], key="dense")
    used(torch.ones(1, 2)).sum().backward()
    sync.synchronize()
    for p in unused.parameters():  # as with several workers: a missing gradient is zeros
        torch.testing.assert_close(p.grad, torch.zeros_like(p), rtol=0, atol=0)


def test_ids_changed_in_place_before_backward_are_refused(kv):
    emb = Embedding(kv, "user", embedding_dim=2, optimizer=optimizers.SGD(learning_rate=1.0))
    ids = torch.tensor([1, 2])
    out = emb(ids)
    ids[0] = 5
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    assert kv.stats()["tables"]["user"]["rows"] == 0  # nothing was pushed


def test_torch_compile_trains_like_eager(kv):
    def train(compiled: bool):
        torch.manual_seed(0)
        key = "compiled" if compiled else "eager"
        emb = Embedding(
            kv, key, embedding_dim=4, seed=1, optimizer=optimizers.Adagrad(learning_rate=0.1)
        )
        linear = torch.nn.Linear(4, 1)

        def loss(ids):
            return linear(torch.relu(emb(ids))).pow(2).sum()

        step = torch.compile(loss) if compiled else loss
        initial = kv.row_sparse_pull(key, row_ids=np.arange(1, 5))
        for ids in ([1, 2, 2], [2, 3, 4]):
            linear.zero_grad()
            step(torch.tensor(ids)).backward()
        rows = kv.row_sparse_pull(key, row_ids=np.arange(1, 5))
        assert not np.allclose(rows, initial)
        return rows, linear.weight.grad.clone()

    eager_rows, eager_grad = train(compiled=False)
    compiled_rows, compiled_grad = train(compiled=True)
    np.testing.assert_allclose(compiled_rows, eager_rows, rtol=1e-6)
    torch.testing.assert_close(compiled_grad, eager_grad)


class _SavedModel(torch.nn.Module):
    def __init__(self, kv):
        super().__init__()
        self.embedding = Embedding(
            kv, "saved", embedding_dim=4, initializer=initializers.Normal(0.0, 0.1), seed=5
        )
        self.bag = EmbeddingBag(kv, "saved_bag", embedding_dim=4, mode="sum")
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, ids):
        return self.linear(torch.cat([self.embedding(ids).sum(1), self.bag(ids)], 1))


def test_a_model_holding_kvsparse_layers_can_be_saved_and_loaded(tmp_path):
    # torch.save(model) failed: pickling the store failed in a C++ object's __cinit__.
    import kvsparse.adapters.torch as kvtorch

    kv = kvsparse.create("local")
    kv.set_optimizer(optimizers.SGD(learning_rate=0.1))
    torch.manual_seed(0)
    model = _SavedModel(kv)
    ids = torch.tensor([[1, 2], [3, 1]])
    expected = model(ids).detach()
    # The state_dict holds the dense weights (the rows are the store's, saved by kv.save).
    torch.save(model.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt")
    assert sorted(state) == ["linear.bias", "linear.weight"]
    again = _SavedModel(kv)
    again.load_state_dict(state)
    torch.testing.assert_close(again(ids), expected)
    # The whole model: pickled with the tables' keys, and bound to a store once loaded.
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert loaded.embedding.kv is None and loaded.embedding.key == "saved"
    with pytest.raises(errors.InvalidArgument, match=r"bind\(kv\)"):
        loaded(ids)
    assert kvtorch.bind(loaded, kv) is loaded
    torch.testing.assert_close(loaded(ids), expected)
    loaded(ids).sum().backward()  # trains the same table
    assert not torch.equal(model(ids).detach(), expected)
    with pytest.raises(errors.UnknownKey):
        kvtorch.bind(
            torch.load(tmp_path / "model.pt", weights_only=False), kvsparse.create("local")
        )
    kv.close()
