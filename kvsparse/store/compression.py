"""MXNet's gradient compression on the worker: threshold quantization with error feedback.

`GradientCompression` gives, for each push, the values MXNet 1.9.1's
``set_gradient_compression({'type': '2bit' | '1bit', 'threshold': t})`` makes
reach the servers (its ``src/kvstore/gradient_compression-inl.h``), with a
residual per key kept on this worker and carried from push to push. All
arithmetic is float32, element by element, as MXNet's kernels:

- 2bit: ``r += g``; ``r >= t``: send ``t``, ``r -= t``; ``r <= -t``: send
  ``-t``, ``r += t``; else send 0 (r keeps the value).
- 1bit: ``r += g``; ``r > t``: send 1, ``r -= 1``; else send -1, ``r += 1``
  (the threshold only picks the sign; the values sent are always +-1).

MXNet packs the signs into bits and the servers unpack them; the numbers the
servers' optimizer sees are the dequantized ones, so kvsparse sends those
(as float32: the payload is not smaller). MXNet refuses compression of
row_sparse pushes; here a sparse table keeps a residual per row it was pushed
(`SparseResiduals`), so the same rule applies row by row.

Threads: a GradientCompression is not safe to use from several threads at
once (its residuals change on every call); its store serializes its calls.

Example:
    >>> c = GradientCompression({"type": "2bit", "threshold": 0.5})
    >>> c.dense("w", np.array([0.3, 0.6, -0.7], np.float32))
    array([ 0. ,  0.5, -0.5], dtype=float32)
    >>> c.dense("w", np.array([0.3, 0.0, 0.0], np.float32))  # 0.3 + 0.3 crosses 0.5
    array([0.5, 0. , 0. ], dtype=float32)
"""

from __future__ import annotations

import numpy as np

from kvsparse import errors

QUANTIZED_TYPES = ("2bit", "1bit")
HALF_TYPES = {"fp16": "float16", "bf16": "bfloat16"}
DEFAULT_THRESHOLD = 0.5  # MXNet's GradientCompressionParam default


def quantize(kind: str, grad: np.ndarray, residual: np.ndarray, threshold) -> np.ndarray:
    """The values MXNet's `kind` quantizer sends for grad; updates residual in place.

    Args:
        kind: '2bit' or '1bit'.
        grad: float32 gradient values (any shape).
        residual: float32 array of grad's shape, the error carried from earlier pushes.
        threshold: the threshold (rounded to float32, as MXNet's C++ float).

    Returns:
        The dequantized float32 values, grad's shape.
    """
    t = np.float32(threshold)
    residual += grad
    if kind == "2bit":
        sent = np.where(residual >= t, t, np.where(residual <= -t, -t, np.float32(0)))
    else:
        sent = np.where(residual > t, np.float32(1), np.float32(-1))
    sent = sent.astype(np.float32, copy=False)
    residual -= sent
    return sent


class SparseResiduals:
    """One sparse table's residuals: the rows of the ids pushed so far (sorted by id).

    Grows with the distinct ids pushed (dim float32 values each). Not thread-safe.
    """

    def __init__(self, dim: int):
        self.ids = np.empty(0, np.int64)
        self.rows = np.empty((0, dim), np.float32)

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """Positions in `rows` of unique ids, adding zero rows for ids not seen before."""
        position = np.searchsorted(self.ids, ids)
        known = position < self.ids.size
        known[known] = self.ids[position[known]] == ids[known]
        if not known.all():
            merged = np.union1d(self.ids, ids[~known])
            rows = np.zeros((merged.size, self.rows.shape[1]), np.float32)
            rows[np.searchsorted(merged, self.ids)] = self.rows
            self.ids, self.rows = merged, rows
            position = np.searchsorted(self.ids, ids)
        return position


class GradientCompression:
    """MXNet's compression settings and this worker's residuals, per key.

    Args:
        params: MXNet's dict: {'type': '2bit' | '1bit' | 'fp16' | 'bf16' | 'none',
            'threshold': t (2bit and 1bit; default 0.5)}.

    Raises:
        InvalidArgument: an unknown type or key, a 2bit threshold <= 0 (MXNet's
            check), a threshold that is not a finite number.
    """

    def __init__(self, params: dict):
        if not isinstance(params, dict) or "type" not in params:
            raise errors.InvalidArgument(
                f"gradient compression takes a dict with a 'type', got {params!r}"
            )
        unknown = set(params) - {"type", "threshold"}
        if unknown:
            raise errors.InvalidArgument(f"unknown gradient compression settings {sorted(unknown)}")
        self.type = str(params["type"]).lower()
        known = (*QUANTIZED_TYPES, *HALF_TYPES, "none")
        if self.type not in known:
            raise errors.InvalidArgument(
                f"unknown gradient compression type {params['type']!r}; kvsparse takes {known}"
            )
        try:
            threshold = float(params.get("threshold", DEFAULT_THRESHOLD))
        except (TypeError, ValueError):
            threshold = float("nan")
        if not np.isfinite(threshold):
            raise errors.InvalidArgument(
                f"gradient compression threshold must be a number, got {params['threshold']!r}"
            )
        if self.type == "2bit" and not threshold > 0:
            raise errors.InvalidArgument(
                f"threshold must be greater than 0 for two bit compression, got {threshold}"
            )
        self.threshold = np.float32(threshold)
        self._dense: dict = {}
        self._sparse: dict = {}

    @property
    def quantizes(self) -> bool:
        """Whether pushes are quantized (2bit, 1bit) with residuals."""
        return self.type in QUANTIZED_TYPES

    @property
    def wire_dtype(self) -> str | None:
        """'float16' / 'bfloat16' for 'fp16' / 'bf16', else None."""
        return HALF_TYPES.get(self.type)

    def dense(self, key, grad: np.ndarray) -> np.ndarray:
        """The values sent for a push of dense gradient grad (float32) to key."""
        residual = self._dense.get(key)
        if residual is None or residual.shape != grad.shape:
            residual = self._dense[key] = np.zeros(grad.shape, np.float32)
        return quantize(self.type, grad, residual, self.threshold)

    def sparse(self, key, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The rows sent for a push of (unique ids, float32 rows (n, dim)) to sparse key."""
        residuals = self._sparse.get(key)
        if residuals is None:
            residuals = self._sparse[key] = SparseResiduals(rows.shape[1])
        position = residuals.rows_of(ids)
        residual = residuals.rows[position]
        sent = quantize(self.type, rows, residual, self.threshold)
        residuals.rows[position] = residual
        return sent


__all__ = ["GradientCompression", "SparseResiduals", "quantize"]
