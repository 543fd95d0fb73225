"""The core's optimizers match torch.optim step for step.

Each optimizer that torch has is fed dense gradients on every row of a small
kvsparse._core.Table and on a torch parameter holding the same initial rows;
after every step the weights and every optimizer slot (momentum buffer,
state sum, exp_avg, exp_avg_sq, square_avg, grad_avg) must agree with the
torch.optim state (rtol 1e-5, atol 1e-6). step_mode="table"
Adam is checked against torch.optim.SparseAdam on an nn.Embedding(sparse=True)
where each step touches only some rows.
"""

import numpy as np
import pytest

from kvsparse import _core

torch = pytest.importorskip("torch")

RTOL = 1e-5
ATOL = 1e-6
STEPS = 20
DIM = 6
ROWS = 5
KEYS = np.array([-(2**63), -7, 0, 11, 2**63 - 1], dtype=np.int64)


def torch_sgd(params, spec):
    return torch.optim.SGD(
        params,
        lr=spec["learning_rate"],
        momentum=spec.get("momentum", 0.0),
        nesterov=spec.get("nesterov", False),
        weight_decay=spec.get("weight_decay", 0.0),
        foreach=False,
    )


def torch_adagrad(params, spec):
    return torch.optim.Adagrad(
        params,
        lr=spec["learning_rate"],
        lr_decay=spec.get("lr_decay", 0.0),
        weight_decay=spec.get("weight_decay", 0.0),
        initial_accumulator_value=spec.get("initial_accumulator_value", 0.0),
        eps=spec["epsilon"],
        foreach=False,
    )


def torch_adam(params, spec):
    optimizer_class = torch.optim.AdamW if spec["kind"] == "adamw" else torch.optim.Adam
    return optimizer_class(
        params,
        lr=spec["learning_rate"],
        betas=(spec.get("beta1", 0.9), spec.get("beta2", 0.999)),
        eps=spec.get("epsilon", 1e-8),
        weight_decay=spec.get("weight_decay", 0.0),
        foreach=False,
    )


def torch_rmsprop(params, spec):
    return torch.optim.RMSprop(
        params,
        lr=spec["learning_rate"],
        alpha=spec.get("alpha", 0.99),
        eps=spec.get("epsilon", 1e-8),
        weight_decay=spec.get("weight_decay", 0.0),
        momentum=spec.get("momentum", 0.0),
        centered=spec.get("centered", False),
        foreach=False,
    )


TORCH_OPTIMIZERS = {
    "sgd": torch_sgd,
    "adagrad": torch_adagrad,
    "adam": torch_adam,
    "adamw": torch_adam,
    "rmsprop": torch_rmsprop,
}

CASES = {
    "sgd": {"kind": "sgd", "learning_rate": 0.1},
    "sgd_momentum": {"kind": "sgd", "learning_rate": 0.05, "momentum": 0.9},
    "sgd_nesterov": {"kind": "sgd", "learning_rate": 0.05, "momentum": 0.9, "nesterov": True},
    "sgd_weight_decay": {"kind": "sgd", "learning_rate": 0.1, "weight_decay": 0.05},
    "sgd_momentum_weight_decay": {
        "kind": "sgd",
        "learning_rate": 0.05,
        "momentum": 0.5,
        "weight_decay": 0.01,
    },
    "adagrad": {"kind": "adagrad", "learning_rate": 0.1, "epsilon": 1e-10},
    "adagrad_lr_decay": {
        "kind": "adagrad",
        "learning_rate": 0.2,
        "lr_decay": 0.05,
        "epsilon": 1e-10,
    },
    "adagrad_weight_decay_accumulator": {
        "kind": "adagrad",
        "learning_rate": 0.1,
        "lr_decay": 0.01,
        "weight_decay": 0.02,
        "initial_accumulator_value": 0.1,
        "epsilon": 1e-10,
    },
    "adam": {"kind": "adam", "learning_rate": 0.01},
    "adam_betas_eps": {
        "kind": "adam",
        "learning_rate": 0.05,
        "beta1": 0.5,
        "beta2": 0.9,
        "epsilon": 1e-6,
    },
    "adam_beta2_0.9999": {"kind": "adam", "learning_rate": 0.01, "beta2": 0.9999},
    "adam_weight_decay": {"kind": "adam", "learning_rate": 0.01, "weight_decay": 0.05},
    "adamw": {"kind": "adamw", "learning_rate": 0.01, "weight_decay": 0.01},
    "adamw_strong_decay": {
        "kind": "adamw",
        "learning_rate": 0.05,
        "weight_decay": 0.5,
        "beta1": 0.8,
        "beta2": 0.99,
    },
    "rmsprop": {"kind": "rmsprop", "learning_rate": 0.01},
    "rmsprop_alpha_0.999": {"kind": "rmsprop", "learning_rate": 0.01, "alpha": 0.999},
    "rmsprop_centered": {"kind": "rmsprop", "learning_rate": 0.01, "centered": True},
    "rmsprop_momentum": {"kind": "rmsprop", "learning_rate": 0.01, "momentum": 0.9},
    "rmsprop_centered_momentum_decay": {
        "kind": "rmsprop",
        "learning_rate": 0.005,
        "alpha": 0.9,
        "centered": True,
        "momentum": 0.5,
        "weight_decay": 0.01,
        "epsilon": 1e-6,
    },
}


def torch_slot_names(spec):
    """torch.optim state names in the order of the core's slots (csrc/optimizer.cc)."""
    kind = spec["kind"]
    if kind == "sgd":
        return ["momentum_buffer"] if spec.get("momentum", 0.0) > 0 else []
    if kind == "adagrad":
        return ["sum"]
    if kind in ("adam", "adamw"):
        return ["exp_avg", "exp_avg_sq"]
    names = ["square_avg"]  # rmsprop
    if spec.get("momentum", 0.0) > 0:
        names.append("momentum_buffer")
    if spec.get("centered", False):
        names.append("grad_avg")
    return names


def new_table(spec):
    return _core.Table(DIM, {"kind": "uniform", "a": -1.0, "b": 1.0}, spec, seed=2024)


def check_parity(spec, transform_grad=lambda g: g, steps=STEPS):
    """Runs the same gradients through a kvsparse table and torch.optim; compares each step."""
    table = new_table(spec)
    initial = table.lookup_or_insert(KEYS)
    weight = torch.nn.Parameter(torch.from_numpy(initial.copy()))
    optimizer = TORCH_OPTIMIZERS[spec["kind"]]([weight], spec)
    rng = np.random.default_rng(len(str(spec)))
    for step in range(1, steps + 1):
        grads = rng.standard_normal((ROWS, DIM)).astype(np.float32)
        table.apply_gradients(KEYS, grads)
        optimizer.zero_grad()
        weight.grad = torch.from_numpy(transform_grad(grads).copy())
        optimizer.step()
        values, slots, _ = table.read_state(KEYS)
        np.testing.assert_allclose(
            values,
            weight.detach().numpy(),
            rtol=RTOL,
            atol=ATOL,
            err_msg=f"{spec}: weights diverged from torch at step {step}",
        )
        state = optimizer.state[weight]
        for index, name in enumerate(torch_slot_names(spec)):
            expected = state[name].numpy()
            # Momentum buffers reach ~10 and cross zero: absolute error there is
            # measured against the buffer's own scale, not against 1.
            np.testing.assert_allclose(
                slots[:, index, :],
                expected,
                rtol=RTOL,
                atol=ATOL * max(1.0, float(np.abs(expected).max())),
                err_msg=f"{spec}: slot {name} diverged from torch at step {step}",
            )
    _, _, row_steps = table.read_state(KEYS)
    assert row_steps.tolist() == [steps] * ROWS


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_optim(case):
    check_parity(CASES[case])


@pytest.mark.parametrize("case", ["sgd_momentum", "adagrad", "adam", "rmsprop_centered"])
@pytest.mark.parametrize("step_mode", ["table"])
def test_table_step_mode_with_dense_pushes_matches_torch(case, step_mode):
    """When every push touches every row, the table step equals each row's step."""
    check_parity(dict(CASES[case], step_mode=step_mode))


@pytest.mark.parametrize("case", ["sgd_momentum", "adam", "adagrad_lr_decay", "rmsprop"])
def test_rescale_then_clip_matches_torch_on_transformed_gradient(case):
    """MXNet order: g = clip(rescale_grad * g, +-clip_gradient), before weight decay."""
    rescale, clip = 0.5, 0.3
    spec = dict(CASES[case], rescale_grad=rescale, clip_gradient=clip)

    def transform(grads):
        scaled = grads * np.float32(rescale)
        return np.clip(scaled, -np.float32(clip), np.float32(clip)).astype(np.float32)

    check_parity(spec, transform_grad=transform)


def run_sparse_adam_comparison(step_mode, steps=STEPS):
    """Lazy Adam on a table vs torch.optim.SparseAdam on nn.Embedding(sparse=True).

    Each step looks up a random subset of rows (with duplicates); only those
    rows' moments and values change. Returns (max abs difference, table step).
    """
    # SparseAdam adds eps to sqrt(v) before the bias correction, Adam after it: the
    # effective eps differs by 1/sqrt(1 - beta2**t) (x31.6 at t=1), so with the usual
    # eps=1e-8 a gradient element near 0.01 already drifts by ~1e-6. A tiny eps
    # makes the two formulas agree to float32 rounding.
    spec = {"kind": "adam", "learning_rate": 0.05, "epsilon": 1e-12, "step_mode": step_mode}
    num_rows = 12
    keys = np.arange(num_rows, dtype=np.int64) * 1000 - 5000
    table = new_table(spec)
    initial = table.lookup_or_insert(keys)
    embedding = torch.nn.Embedding(num_rows, DIM, sparse=True)
    with torch.no_grad():
        embedding.weight.copy_(torch.from_numpy(initial))
    optimizer = torch.optim.SparseAdam(
        embedding.parameters(), lr=spec["learning_rate"], eps=spec["epsilon"]
    )
    rng = np.random.default_rng(7)
    worst = 0.0
    for step in range(1, steps + 1):
        # Rows 0..2 are touched every step, the others now and then (and with duplicates).
        occasional = rng.choice(np.arange(3, num_rows), size=rng.integers(0, 6), replace=True)
        rows = np.concatenate([[0, 1, 2], occasional, [1]]).astype(np.int64)
        coefficients = rng.standard_normal((len(rows), DIM)).astype(np.float32)
        optimizer.zero_grad()
        output = embedding(torch.from_numpy(rows))
        (output * torch.from_numpy(coefficients)).sum().backward()
        optimizer.step()
        # d(sum(out * c))/d(out) = c: the pushed gradient of each looked-up row.
        table.apply_gradients(keys[rows], coefficients)
        expected = embedding.weight.detach().numpy()
        got = table.lookup(keys)
        worst = max(worst, float(np.max(np.abs(got - expected) / (ATOL + RTOL * np.abs(expected)))))
        if step_mode == "table":
            np.testing.assert_allclose(
                got, expected, rtol=RTOL, atol=ATOL, err_msg=f"SparseAdam step {step}"
            )
            assert table.table_step == step
    return worst, table.table_step


def test_table_step_mode_adam_matches_sparse_adam():
    """torch.optim.SparseAdam counts one step per optimizer.step(), for every row."""
    worst, table_step = run_sparse_adam_comparison("table")
    assert worst <= 1.0
    assert table_step == STEPS


def test_row_step_mode_adam_differs_from_sparse_adam():
    """The control: per-row bias correction is not SparseAdam's once rows are touched unevenly."""
    worst, _ = run_sparse_adam_comparison("row")
    assert worst > 10.0
