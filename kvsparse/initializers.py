"""Row initializers for sparse tables.

A new row's value is a pure function of (table seed, id): the same id gets the
same vector whatever the insertion order or the number of servers.

Example:
    >>> import kvsparse
    >>> table = kvsparse.SparseTable(dim=8, initializer=kvsparse.initializers.Normal(0, 0.01))
"""

from __future__ import annotations

import math
import numbers

from kvsparse import errors


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise errors.InvalidArgument(f"{what} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise errors.InvalidArgument(f"{what} must be finite, got {value!r}")
    return value


class Initializer:
    """Base class: a named initializer with up to two parameters (a, b).

    Parameters are checked when the initializer is made: a number, finite, and
    in range for the kind (the core's rules, csrc/initializer.cc).

    Raises:
        InvalidArgument: a parameter that is not a finite number, or out of range.

    Immutable once made: safe to share between threads.
    """

    kind = "zeros"
    names = ("a", "b")  # the parameters as the subclass's constructor calls them

    def __init__(self, a: float = 0.0, b: float = 0.0):
        self.a = _number(a, f"{type(self).__name__}: {self.names[0]}")
        self.b = _number(b, f"{type(self).__name__}: {self.names[1]}")
        self._check_range()

    def _check_range(self) -> None:
        """Subclasses refuse parameters out of range."""

    def to_dict(self) -> dict:
        """The wire/config form understood by the C++ core."""
        return {"kind": self.kind, "a": self.a, "b": self.b}

    def __eq__(self, other):
        return isinstance(other, Initializer) and self.to_dict() == other.to_dict()

    def __repr__(self):
        return f"{type(self).__name__}(a={self.a}, b={self.b})"


class Zeros(Initializer):
    """Every element 0."""

    kind = "zeros"

    def __init__(self):
        super().__init__()


class Constant(Initializer):
    """Every element `value`."""

    kind = "constant"
    names = ("value", "b")

    def __init__(self, value: float = 0.0):
        super().__init__(value)


class Uniform(Initializer):
    """Uniform in [low, high) (Keras' RandomUniform default range)."""

    kind = "uniform"
    names = ("low", "high")

    def __init__(self, low: float = -0.05, high: float = 0.05):
        super().__init__(low, high)

    def _check_range(self) -> None:
        if not self.a <= self.b:
            raise errors.InvalidArgument(
                f"Uniform needs low <= high, got low={self.a!r} high={self.b!r}"
            )


class Normal(Initializer):
    """Normal(mean, std)."""

    kind = "normal"
    names = ("mean", "std")

    def __init__(self, mean: float = 0.0, std: float = 0.01):
        super().__init__(mean, std)

    def _check_range(self) -> None:
        if not self.b >= 0:
            raise errors.InvalidArgument(f"{type(self).__name__} needs std >= 0, got {self.b!r}")


class TruncatedNormal(Initializer):
    """Normal(mean, std) redrawn beyond 2 std, like TF's truncated_normal."""

    kind = "truncated_normal"
    names = ("mean", "std")
    _check_range = Normal._check_range

    def __init__(self, mean: float = 0.0, std: float = 0.05):
        super().__init__(mean, std)


_KINDS = {cls.kind: cls for cls in (Zeros, Constant, Uniform, Normal, TruncatedNormal)}


def from_dict(spec: dict) -> Initializer:
    """Inverse of Initializer.to_dict()."""
    cls = _KINDS[spec["kind"]]
    init = cls.__new__(cls)
    Initializer.__init__(init, spec.get("a", 0.0), spec.get("b", 0.0))  # checked as made
    return init
