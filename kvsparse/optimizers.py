"""Optimizers that run on the servers, lazily: only on the rows a push touched.

Each follows one reference formula (see csrc/optimizer.h):

============  ==============================================================
SGD           torch.optim.SGD (momentum, nesterov, weight_decay; dampening 0)
Adagrad       torch.optim.Adagrad (lr_decay, weight_decay, eps,
              initial_accumulator_value)
Adam          torch.optim.Adam (L2 weight decay added to the gradient)
AdamW         torch.optim.AdamW (decoupled weight decay)
RMSProp       torch.optim.RMSprop (alpha, eps, centered, momentum)
Ftrl          tf.keras.optimizers.Ftrl / TF ApplyFtrl (lr_power, l1, l2, beta)
============  ==============================================================

Before the formula the gradient is scaled and clipped as MXNet does:
``g = clip(rescale_grad * g, -clip_gradient, clip_gradient)``.

Adam, Adagrad and RMSProp take ``formula='mxnet'`` for MXNet 1.x's variants
(epsilon inside the square root or outside Adam's bias correction, weight decay
before clipping, outside Adagrad's history; see csrc/optimizer.h), which the MXNet
adapter uses so that MXNet's optimizers give MXNet's results.

Adam/AdamW's bias correction counts each row's own updates
(``step_mode='row'``, the default, truly lazy); ``step_mode='table'`` counts
pushes to the table instead, like torch.optim.SparseAdam and TF's LazyAdam.
To reproduce torch.optim.SparseAdam exactly, use
``Adam(step_mode='table', formula='mxnet')``: SparseAdam adds eps before the
bias correction of the second moment (as MXNet does), torch.optim.Adam after
(tests/test_adapter_torch.py checks both).

Example:
    >>> import kvsparse
    >>> kv = kvsparse.create('local')
    >>> kv.set_optimizer(kvsparse.optimizers.Adagrad(learning_rate=0.1))
"""

from __future__ import annotations

import copy
import math
import numbers

from kvsparse import errors

# Settings that are flags or names; every other one is a real number.
_NON_NUMERIC = {"nesterov", "centered", "formula", "step_mode", "multi_precision"}


class Optimizer:
    """Base class: a named optimizer and its hyperparameters.

    Settings are checked when the optimizer is made, by the same rules the
    core applies (a learning rate that is not a number, or a negative one,
    is refused here, not at the first push). ``lr`` is accepted as another
    name of ``learning_rate``, as torch spells it, and the learning rate may
    come first without its name, as Keras takes it (``SGD(0.5)``).

    Raises:
        TypeError: an unknown setting, or both lr and learning_rate.
        InvalidArgument: a setting of the wrong type or out of range (named).

    Immutable once made (settings are not changed in place): safe to share
    between threads.
    """

    kind: str | None = None
    defaults: dict = {}

    def __init__(self, learning_rate=None, /, **settings):
        if learning_rate is not None:
            if "learning_rate" in settings or "lr" in settings:
                raise TypeError(f"{type(self).__name__}: the learning rate was given twice")
            settings["learning_rate"] = learning_rate
        if "lr" in settings:
            if "learning_rate" in settings:
                raise TypeError(f"{type(self).__name__}: give lr or learning_rate, not both")
            settings["learning_rate"] = settings.pop("lr")
        # multi_precision: float16 / bfloat16 dense keys and sparse tables keep a float32
        # master copy that the optimizer updates (MXNet's multi_precision); not a formula
        # setting.
        unknown = (
            set(settings)
            - set(self.defaults)
            - {"rescale_grad", "clip_gradient", "multi_precision"}
        )
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown settings {sorted(unknown)}")
        self.settings = {"rescale_grad": 1.0, "clip_gradient": None, **self.defaults}
        self.settings.update(settings)
        self._check()

    def _check(self) -> None:
        """Refuses bad settings now, with the core's own rules for ranges."""
        name = type(self).__name__
        for setting, value in self.settings.items():
            if setting in _NON_NUMERIC or (setting == "clip_gradient" and value is None):
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise errors.InvalidArgument(f"{name}: {setting} must be a number, got {value!r}")
            if not isinstance(value, (int, float)):
                self.settings[setting] = value = float(value)  # NumPy scalars: JSON-able
            if not math.isfinite(value):
                raise errors.InvalidArgument(f"{name}: {setting} must be finite, got {value!r}")
        from kvsparse import _core

        try:
            _core.Optimizer(self.to_dict())
        except errors.InvalidArgument as exc:
            raise errors.InvalidArgument(f"{name}: {exc}") from None

    def to_dict(self) -> dict:
        """The wire/config form understood by the C++ core."""
        spec = {"kind": self.kind}
        for name, value in self.settings.items():
            spec[_WIRE_NAMES.get(name, name)] = value
        if spec.get("clip_gradient") is None:
            spec["clip_gradient"] = -1.0
        if spec.get("formula") == "torch":
            del spec["formula"]  # the default: specs without the field mean the same
        if "multi_precision" in spec and not spec["multi_precision"]:
            del spec["multi_precision"]  # likewise: only a True is sent
        elif "multi_precision" in spec:
            spec["multi_precision"] = True
        return spec

    @property
    def learning_rate(self) -> float:
        return self.settings["learning_rate"]

    def __eq__(self, other):
        return isinstance(other, Optimizer) and self.to_dict() == other.to_dict()

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        return f"{type(self).__name__}({args})"

    def copy(self):
        return copy.deepcopy(self)

    def with_learning_rate(self, learning_rate: float) -> Optimizer:
        """A copy whose learning rate is learning_rate (this one stays: immutable).

        Raises:
            InvalidArgument: a learning rate the optimizer refuses (not a finite
                number >= 0; FTRL: > 0).

        Example:
            >>> Adagrad(learning_rate=0.1).with_learning_rate(0.01).learning_rate
            0.01
        """
        settings = {**self.settings, "learning_rate": learning_rate}
        changed = copy.copy(self)
        changed.settings = settings
        changed._check()
        return changed


# Python-facing names that differ from the core's field names.
_WIRE_NAMES = {"eps": "epsilon"}


class SGD(Optimizer):
    """torch.optim.SGD: ``w -= lr * (g + wd*w)``, with momentum/nesterov if set."""

    kind = "sgd"
    defaults = {"learning_rate": 0.01, "momentum": 0.0, "nesterov": False, "weight_decay": 0.0}


class Adagrad(Optimizer):
    """torch.optim.Adagrad (eps added outside the square root, default 1e-10).

    formula='mxnet': MXNet's AdaGrad (eps inside the root, wd outside the history).
    """

    kind = "adagrad"
    defaults = {
        "learning_rate": 0.01,
        "lr_decay": 0.0,
        "weight_decay": 0.0,
        "initial_accumulator_value": 0.0,
        "eps": 1e-10,
        "formula": "torch",
    }


class Adam(Optimizer):
    """torch.optim.Adam (lazy: only touched rows, each with its own step).

    formula='mxnet': MXNet's Adam (eps outside the bias correction, wd before clipping).
    """

    kind = "adam"
    defaults = {
        "learning_rate": 0.001,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "step_mode": "row",
        "formula": "torch",
    }


class AdamW(Adam):
    """torch.optim.AdamW: decoupled weight decay (default 0.01)."""

    kind = "adamw"
    defaults = {**Adam.defaults, "weight_decay": 0.01}


class RMSProp(Optimizer):
    """torch.optim.RMSprop.

    formula='mxnet': MXNet's RMSProp (eps inside the root, wd before clipping).
    """

    kind = "rmsprop"
    defaults = {
        "learning_rate": 0.01,
        "alpha": 0.99,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "momentum": 0.0,
        "centered": False,
        "formula": "torch",
    }


class Ftrl(Optimizer):
    """FTRL-proximal as tf.keras.optimizers.Ftrl (no weight_decay: use l2)."""

    kind = "ftrl"
    defaults = {
        "learning_rate": 0.001,
        "lr_power": -0.5,
        "initial_accumulator_value": 0.1,
        "l1": 0.0,
        "l2": 0.0,
        "beta": 0.0,
    }


RMSprop = RMSProp
FTRL = Ftrl

_BY_NAME = {
    "sgd": SGD,
    "adagrad": Adagrad,
    "adam": Adam,
    "adamw": AdamW,
    "rmsprop": RMSProp,
    "ftrl": Ftrl,
}


def create(name: str, **settings) -> Optimizer:
    """An optimizer by name (case-insensitive), e.g. ``create('adam', learning_rate=0.01)``.

    Raises:
        ValueError: an unknown name.
    """
    cls = _BY_NAME.get(name.lower())
    if cls is None:
        raise ValueError(f"unknown optimizer {name!r}; known: {sorted(_BY_NAME)}")
    return cls(**settings)


def from_dict(spec: dict | None) -> Optimizer | None:
    """Inverse of Optimizer.to_dict()."""
    if spec is None or spec.get("kind") in (None, "none"):
        return None
    cls = _BY_NAME[spec["kind"]]
    inverse = {v: k for k, v in _WIRE_NAMES.items()}
    settings = {inverse.get(k, k): v for k, v in spec.items() if k != "kind"}
    if settings.get("clip_gradient") == -1.0:
        settings["clip_gradient"] = None
    return cls(**settings)
