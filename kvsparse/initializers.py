"""Row initializers for sparse tables.

A new row's value is a pure function of (table seed, id): the same id gets the
same vector whatever the insertion order or the number of servers.

Example:
    >>> import kvsparse
    >>> table = kvsparse.SparseTable(dim=8, initializer=kvsparse.initializers.Normal(0, 0.01))
"""

from __future__ import annotations


class Initializer:
    """Base class: a named initializer with up to two parameters (a, b)."""

    kind = "zeros"

    def __init__(self, a: float = 0.0, b: float = 0.0):
        self.a = float(a)
        self.b = float(b)

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

    def __init__(self, value: float = 0.0):
        super().__init__(value)


class Uniform(Initializer):
    """Uniform in [low, high) (Keras' RandomUniform default range)."""

    kind = "uniform"

    def __init__(self, low: float = -0.05, high: float = 0.05):
        super().__init__(low, high)


class Normal(Initializer):
    """Normal(mean, std)."""

    kind = "normal"

    def __init__(self, mean: float = 0.0, std: float = 0.01):
        super().__init__(mean, std)


class TruncatedNormal(Initializer):
    """Normal(mean, std) redrawn beyond 2 std, like TF's truncated_normal."""

    kind = "truncated_normal"

    def __init__(self, mean: float = 0.0, std: float = 0.05):
        super().__init__(mean, std)


_KINDS = {cls.kind: cls for cls in (Zeros, Constant, Uniform, Normal, TruncatedNormal)}


def from_dict(spec: dict) -> Initializer:
    """Inverse of Initializer.to_dict()."""
    cls = _KINDS[spec["kind"]]
    init = cls.__new__(cls)
    Initializer.__init__(init, spec.get("a", 0.0), spec.get("b", 0.0))
    return init
