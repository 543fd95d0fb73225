"""A plain NumPy reference model of the kvsparse C++ core.

Everything here is written from the formulas documented in ``csrc/*.h``
(torch.optim for SGD/Adagrad/Adam/AdamW/RMSprop, TF/Keras for FTRL, MXNet's
rescale-then-clip order) and never calls ``kvsparse._core``. Tests run the
same operations on a ``kvsparse._core.Table`` and on a ``ReferenceTable`` and
compare the results; the distributed-store tests build their reference model
of the whole KVStore from the same pieces.

Arithmetic is float32 element-wise, in the operand order of the reference
formulas; scalar hyperparameter expressions (``1 - beta2``, ``1 - lr * wd``,
bias corrections, Adagrad's decayed rate) are computed in float64 and then
rounded to float32, as torch.optim does them in Python. FTRL runs in float64
like TF's double-precision path. Tests compare with a tight tolerance
(rtol ~1e-5), not equality: ``log``/``cos``/``pow`` may differ in the last ulp
between NumPy and libm, and operand order may differ in the last bit.

Public API:

* Hashing and placement: ``mix64``, ``hash_shard_of``, ``range_shard_of``,
  ``shard_of``, ``unique_inverse``, ``plan_batch``.
* Initializers: ``philox4x32``, ``initial_row``, ``initial_rows``,
  ``normalize_initializer``, ``validate_initializer``; the version-1 streams'
  ``uniform_at``, ``normal_at``.
* Optimizers: ``OPTIMIZER_DEFAULTS``, ``normalize_optimizer``,
  ``validate_optimizer``, ``ReferenceOptimizer`` (the flat-span
  ``Optimizer.update`` of the core).
* ``ReferenceTable``: the semantics of ``kvsparse._core.Table``.

Example:
    >>> import numpy as np
    >>> from reference import ReferenceTable
    >>> ref = ReferenceTable(4, {"kind": "constant", "a": 1.0},
    ...                      {"kind": "sgd", "learning_rate": 0.5})
    >>> ref.apply_gradients(np.array([7]), np.ones((1, 4), np.float32))
    1
    >>> float(ref.lookup(np.array([7]))[0, 0])
    0.5
"""

from __future__ import annotations

import bisect
import functools
import math
from typing import Any, Optional

import numpy as np

from kvsparse import errors

MASK64 = (1 << 64) - 1
MAX_DIM = 4096
# Largest row step counter write_state accepts (the core stores 32-bit counters).
MAX_STEP = 2**32 - 1

# Constants of csrc/hash.h and csrc/initializer.cc (part of the on-disk and
# on-wire contract: a change here means a change of every shard and row).
_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX_MULTIPLIER_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_MULTIPLIER_2 = np.uint64(0x94D049BB133111EB)
_SHARD_SALT = np.uint64(0x5851F42D4C957F2D)
_COUNTER_MULTIPLIER = np.uint64(0xD1B54A32D192ED03)
_TWO_PI = 6.283185307179586476925286766559
_REDRAW_STRIDE = 1 << 32
_TRUNCATION_STDDEVS = 2.0
# Initializer stream versions (csrc/initializer.h kInitializerVersion).
INITIALIZER_VERSION = 2
# Philox4x32-10 (csrc/philox.h).
_PHILOX_M0 = np.uint64(0xD2511F53)
_PHILOX_M1 = np.uint64(0xCD9E8D57)
_PHILOX_W0 = np.uint64(0x9E3779B9)
_PHILOX_W1 = np.uint64(0xBB67AE85)
_PHILOX_ROUNDS = 10


# --------------------------------------------------------------------------
# 64-bit hashing
# --------------------------------------------------------------------------


def as_uint64(values: Any) -> np.ndarray:
    """Reinterprets integers (int64 ids, Python ints of any sign) as uint64 bits.

    Negative ids become their two's-complement bit pattern, as a C++
    ``static_cast<uint64_t>(int64_t)`` does. Always returns an array (0-d for
    a scalar input).

    Example:
        >>> int(as_uint64(-1))
        18446744073709551615
    """
    array = np.asarray(values)
    if array.dtype.kind == "i":
        return array.astype(np.int64).view(np.uint64)
    if array.dtype.kind == "u":
        return array.astype(np.uint64)
    if array.dtype.kind == "b":
        return array.astype(np.uint64)
    if array.dtype == object:
        flat = [int(v) & MASK64 for v in array.ravel()]
        return np.array(flat, dtype=np.uint64).reshape(array.shape)
    raise errors.DTypeError(f"expected integer ids, got dtype {array.dtype}")


def mix64(values: Any) -> np.ndarray:
    """splitmix64's finalizer (csrc/hash.h ``Mix64``) on uint64 arrays, wrapping mod 2**64.

    Args:
        values: ints or an integer array (negative values are taken as their
            64-bit two's complement).

    Returns:
        A uint64 array of the same shape (0-d for a scalar).

    Example:
        >>> hex(int(mix64(0)))
        '0xe220a8397b1dcdaf'
    """
    x = as_uint64(values).copy()
    with np.errstate(over="ignore"):
        x = x + _GOLDEN_GAMMA
        x = (x ^ (x >> np.uint64(30))) * _MIX_MULTIPLIER_1
        x = (x ^ (x >> np.uint64(27))) * _MIX_MULTIPLIER_2
        return x ^ (x >> np.uint64(31))


def hash_shard_of(keys: Any, num_shards: int) -> Any:
    """Shard of ids under hash partitioning (csrc/hash.h ``HashShardOf``).

    ``(Mix64(key ^ salt) * num_shards) >> 64`` with the 128-bit product done in
    Python ints, so it is exact for any number of shards.

    Args:
        keys: one int (returns an int) or an array of ids (returns int64 array).
        num_shards: >= 1.

    Example:
        >>> 0 <= hash_shard_of(42, 8) < 8
        True
    """
    if num_shards < 1:
        raise errors.InvalidArgument("num_shards must be >= 1")
    hashed = mix64(as_uint64(keys) ^ _SHARD_SALT)
    if hashed.ndim == 0:
        return (int(hashed) * num_shards) >> 64
    shards = [(h * num_shards) >> 64 for h in hashed.ravel().tolist()]
    return np.array(shards, dtype=np.int64).reshape(hashed.shape)


def range_shard_of(keys: Any, boundaries: list[int]) -> Any:
    """Shard of ids under range partitioning: shard s holds [boundaries[s-1], boundaries[s])."""
    if np.ndim(keys) == 0:
        return bisect.bisect_right(boundaries, int(keys))
    array = np.asarray(keys, dtype=np.int64)
    return np.array(
        [bisect.bisect_right(boundaries, k) for k in array.ravel().tolist()], dtype=np.int64
    ).reshape(array.shape)


def validate_partitioner(num_shards: int, boundaries: Optional[list[int]] = None) -> None:
    """Raises InvalidArgument for a partitioner that csrc/batch.cc would refuse."""
    if num_shards < 1:
        raise errors.InvalidArgument("num_shards must be >= 1")
    if boundaries:
        if len(boundaries) != num_shards - 1:
            raise errors.InvalidArgument("a range partitioner needs num_shards - 1 boundaries")
        if any(a >= b for a, b in zip(boundaries, boundaries[1:])):
            raise errors.InvalidArgument("range partitioner boundaries must be strictly ascending")


def shard_of(keys: Any, num_shards: int, boundaries: Optional[list[int]] = None) -> Any:
    """Shard of ids: hash partitioning, or range partitioning when boundaries are given."""
    validate_partitioner(num_shards, boundaries)
    if boundaries:
        return range_shard_of(keys, list(boundaries))
    return hash_shard_of(keys, num_shards)


# --------------------------------------------------------------------------
# Batch planning
# --------------------------------------------------------------------------


def unique_inverse(ids: Any) -> tuple[np.ndarray, np.ndarray]:
    """(unique ids in order of first appearance, inverse) with ``ids == unique[inverse]``.

    Example:
        >>> u, inv = unique_inverse([5, 3, 5, 9])
        >>> u.tolist(), inv.tolist()
        ([5, 3, 9], [0, 1, 0, 2])
    """
    positions: dict[int, int] = {}
    inverse = []
    for key in np.asarray(ids, dtype=np.int64).ravel().tolist():
        inverse.append(positions.setdefault(key, len(positions)))
    unique = np.array(list(positions), dtype=np.int64)
    return unique, np.array(inverse, dtype=np.int64)


def plan_batch(
    ids: Any, num_shards: int, boundaries: Optional[list[int]] = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups a batch by shard, as csrc/batch.cc ``PlanBatch`` does.

    Returns:
        (keys, offsets, slot): the unique ids grouped by shard, each shard's
        keys in order of first appearance; shard s owns
        ``keys[offsets[s]:offsets[s + 1]]``; ``ids[i] == keys[slot[i]]``.
    """
    unique, inverse = unique_inverse(ids)
    shards = shard_of(unique, num_shards, boundaries) if len(unique) else np.zeros(0, np.int64)
    # A stable sort by shard keeps the first-appearance order within a shard.
    order = np.argsort(shards, kind="stable")
    keys = unique[order]
    position = np.empty(len(unique), dtype=np.int64)
    position[order] = np.arange(len(unique), dtype=np.int64)
    counts = np.bincount(shards, minlength=num_shards) if len(unique) else np.zeros(num_shards)
    offsets = np.zeros(num_shards + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(counts)
    return keys, offsets, position[inverse]


def sum_rows(rows: np.ndarray, index: Any, num_unique: int) -> np.ndarray:
    """out[u] = float32 sum of rows[i] with index[i] == u, added in input order."""
    rows = np.asarray(rows, dtype=np.float32)
    out = np.zeros((num_unique, rows.shape[1]), dtype=np.float32)
    for i, u in enumerate(np.asarray(index, dtype=np.int64).tolist()):
        out[u] += rows[i]
    return out


def first_nonfinite_row(rows: np.ndarray) -> int:
    """Index of the first row holding a NaN or inf, or -1."""
    bad = np.flatnonzero(~np.isfinite(np.asarray(rows)).all(axis=1))
    return int(bad[0]) if len(bad) else -1


# --------------------------------------------------------------------------
# Initializers
# --------------------------------------------------------------------------

INITIALIZER_KINDS = ("zeros", "constant", "uniform", "normal", "truncated_normal")


def normalize_initializer(spec: Optional[dict]) -> dict:
    """The initializer dict with defaults filled in: {"kind", "a", "b", "version"}."""
    spec = dict(spec or {"kind": "zeros"})
    kind = spec.get("kind", "zeros")
    if kind not in INITIALIZER_KINDS:
        raise errors.InvalidArgument(f"unknown initializer kind {kind!r}")
    return {
        "kind": kind,
        "a": float(spec.get("a", 0.0)),
        "b": float(spec.get("b", 0.0)),
        "version": int(spec.get("version", INITIALIZER_VERSION)),
    }


def validate_initializer(spec: Optional[dict]) -> dict:
    """Returns the normalized initializer, or raises InvalidArgument like the core."""
    spec = normalize_initializer(spec)
    if spec["version"] not in (1, INITIALIZER_VERSION):
        raise errors.InvalidArgument("initializer stream version must be 1 or 2")
    if spec["kind"] == "uniform" and not spec["a"] <= spec["b"]:
        raise errors.InvalidArgument("uniform initializer needs low <= high")
    if spec["kind"] in ("normal", "truncated_normal") and not spec["b"] >= 0.0:
        raise errors.InvalidArgument("normal initializer needs stddev >= 0")
    return spec


def uniform_at(seed: int, key: Any, counter: Any) -> np.ndarray:
    """Uniform doubles in [0, 1) from counter(s) of the stream of (seed, key).

    Bit-exact with csrc/initializer.cc ``UniformAt``: 53 random bits of
    ``Mix64(Mix64(seed ^ Mix64(key)) + counter * 0xD1B54A32D192ED03)``.
    key and counter broadcast against each other.
    """
    with np.errstate(over="ignore"):
        stream = mix64(as_uint64(seed) ^ mix64(key))
        bits = mix64(stream + as_uint64(counter) * _COUNTER_MULTIPLIER)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def normal_at(seed: int, key: Any, counter: Any) -> np.ndarray:
    """Standard normals by Box-Muller from counters (2c, 2c + 1); u1 mapped to (0, 1]."""
    counter = as_uint64(counter)
    with np.errstate(over="ignore"):
        first = counter * np.uint64(2)
        u1 = 1.0 - uniform_at(seed, key, first)
        u2 = uniform_at(seed, key, first + np.uint64(1))
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(_TWO_PI * u2)


def _initial_rows_v1(spec: dict, keys: Any, dim: int, seed: int) -> np.ndarray:
    """Version-1 rows: a truncated normal redraws element j beyond 2 stddev
    from counter ``j + attempt * 2**32``."""
    key_array = np.asarray(keys, dtype=np.int64).reshape(-1, 1)
    columns = np.arange(dim, dtype=np.uint64).reshape(1, -1)
    kind, a, b = spec["kind"], spec["a"], spec["b"]
    if kind == "uniform":
        u = uniform_at(seed, key_array, columns)
        return (a + (b - a) * u).astype(np.float32)
    z = normal_at(seed, key_array, columns)
    if kind == "truncated_normal":
        key_grid = np.broadcast_to(key_array, z.shape)
        column_grid = np.broadcast_to(columns, z.shape)
        attempt = 1
        bad = np.abs(z) > _TRUNCATION_STDDEVS
        while bad.any():
            counters = column_grid[bad] + np.uint64(attempt * _REDRAW_STRIDE)
            z[bad] = normal_at(seed, key_grid[bad], counters)
            attempt += 1
            bad = np.abs(z) > _TRUNCATION_STDDEVS
    return (a + b * z).astype(np.float32)


# --------------------------------------------------------------------------
# Version-2 streams (csrc/philox.h, csrc/initializer.cc): Philox4x32-10 and
# float32 Box-Muller with Cephes polynomials, in the core's operation order.
# --------------------------------------------------------------------------


def philox4x32(counter: Any, key0: Any, key1: Any) -> tuple:
    """Philox4x32-10 (Salmon et al. 2011; Random123's ``philox4x32_10``).

    Args:
        counter: 4 uint32 arrays (or ints), broadcast together with the keys.
        key0, key1: the two key words.

    Returns:
        The 4 output words as uint32 arrays.

    Example (Random123 tests/kat_vectors):
        >>> [hex(int(w)) for w in philox4x32((0, 0, 0, 0), 0, 0)]
        ['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
    """
    # uint64 arrays holding 32-bit words: the products fit, no casts per round.
    mask = np.uint64(0xFFFFFFFF)
    words = [np.asarray(w, dtype=np.uint64) & mask for w in (*counter, key0, key1)]
    c0, c1, c2, c3, k0, k1 = np.broadcast_arrays(*words)
    thirty_two = np.uint64(32)
    with np.errstate(over="ignore"):
        for _ in range(_PHILOX_ROUNDS):
            p0 = _PHILOX_M0 * c0
            p1 = _PHILOX_M1 * c2
            c0, c1, c2, c3 = (
                (p1 >> thirty_two) ^ c1 ^ k0,
                p1 & mask,
                (p0 >> thirty_two) ^ c3 ^ k1,
                p0 & mask,
            )
            k0 = (k0 + _PHILOX_W0) & mask
            k1 = (k1 + _PHILOX_W1) & mask
    c0, c1, c2, c3 = (w.astype(np.uint32) for w in (c0, c1, c2, c3))
    return c0, c1, c2, c3


def _f32(value: float) -> np.float32:
    return np.float32(value)


def _log_positive_f32(x: np.ndarray) -> np.ndarray:
    """Cephes logf with musl's integer range reduction (initializer.cc LogPositive)."""
    ix = x.view(np.uint32) + np.uint32(0x3F800000 - 0x3F3504F3)
    e = ((ix >> np.uint32(23)).astype(np.int32) - np.int32(0x7F)).astype(np.float32)
    ix = (ix & np.uint32(0x007FFFFF)) + np.uint32(0x3F3504F3)
    f = ix.view(np.float32) - _f32(1.0)
    z = f * f
    y = np.full_like(f, _f32(7.0376836292e-2))
    for coefficient in (
        -1.1514610310e-1,
        1.1676998740e-1,
        -1.2420140846e-1,
        1.4249322787e-1,
        -1.6668057665e-1,
        2.0000714765e-1,
        -2.4999993993e-1,
        3.3333331174e-1,
    ):
        y = y * f + _f32(coefficient)
    y = y * f * z
    y = y + _f32(-2.12194440e-4) * e
    y = y - _f32(0.5) * z
    r = f + y
    return r + _f32(0.693359375) * e


def _box_muller_f32(radius_bits: np.ndarray, angle_bits: np.ndarray) -> tuple:
    """(z_cos, z_sin) float32 standard normals (initializer.cc BoxMuller)."""
    radius_bits = radius_bits.astype(np.uint32)
    angle_bits = angle_bits.astype(np.uint32)
    u1 = (radius_bits >> np.uint32(1)).astype(np.int32).astype(np.float32) * _f32(
        4.656612873e-10
    ) + _f32(2.0**-32)
    radius = np.sqrt(np.maximum(_f32(-2.0) * _log_positive_f32(u1), _f32(0.0)))
    quadrant = angle_bits >> np.uint32(30)
    t = (angle_bits << np.uint32(2)).view(np.int32).astype(np.float32) * (
        _f32(2.0**-32) * _f32(1.5707963268)
    )
    t2 = t * t
    s = np.full_like(t, _f32(-1.9515295891e-4))
    s = s * t2 + _f32(8.3321608736e-3)
    s = s * t2 - _f32(1.6666654611e-1)
    s = s * t2 * t + t
    c = np.full_like(t, _f32(2.443315711809948e-5))
    c = c * t2 - _f32(1.388731625493765e-3)
    c = c * t2 + _f32(4.166664568298827e-2)
    c = c * t2 * t2 - _f32(0.5) * t2 + _f32(1.0)
    swap = (quadrant & np.uint32(1)).astype(bool)
    cos_v = np.where(swap, s, c).view(np.uint32) ^ (
        ((quadrant + np.uint32(1)) & np.uint32(2)) << np.uint32(30)
    )
    sin_v = np.where(swap, c, s).view(np.uint32) ^ ((quadrant & np.uint32(2)) << np.uint32(30))
    return radius * cos_v.view(np.float32), radius * sin_v.view(np.float32)


def row_stream_keys(seed: int, keys: Any) -> tuple:
    """Philox key words (low, high 32 bits of Mix64(seed ^ Mix64(key))) of ids."""
    h = mix64(as_uint64(seed) ^ mix64(keys))
    return (h & np.uint64(0xFFFFFFFF)).astype(np.uint32), (h >> np.uint64(32)).astype(np.uint32)


def normal_blocks_v2(seed: int, keys: Any, blocks: Any, attempt: int = 0) -> np.ndarray:
    """Standard normals (..., 4) of blocks (elements 4b..4b+3) of ids, one attempt."""
    k0, k1 = row_stream_keys(seed, keys)
    x0, x1, x2, x3 = philox4x32((blocks, attempt, 0, 0), k0, k1)
    z0, z1 = _box_muller_f32(x0, x1)
    z2, z3 = _box_muller_f32(x2, x3)
    return np.stack([z0, z1, z2, z3], axis=-1)


def _initial_rows_v2(spec: dict, keys: Any, dim: int, seed: int) -> np.ndarray:
    key_array = np.asarray(keys, dtype=np.int64).reshape(-1, 1)
    n = key_array.shape[0]
    blocks = np.arange((dim + 3) // 4, dtype=np.uint32).reshape(1, -1)
    kind, a, b = spec["kind"], spec["a"], spec["b"]
    if kind == "uniform":
        k0, k1 = row_stream_keys(seed, key_array)
        words = np.stack(philox4x32((blocks, 0, 0, 0), k0, k1), axis=-1)
        u = (words >> np.uint32(8)).astype(np.int32).astype(np.float32) * _f32(2.0**-24)
        standard = u.reshape(n, 4 * blocks.size)[:, :dim]
        return _f32(a) + _f32(b - a) * standard
    z = normal_blocks_v2(seed, key_array, blocks).reshape(n, 4 * blocks.size)[:, :dim]
    if kind == "truncated_normal":
        attempt = 1
        bad = np.abs(z) > _f32(_TRUNCATION_STDDEVS)
        while bad.any():
            rows, columns = np.nonzero(bad)
            redraw = normal_blocks_v2(seed, key_array[rows, 0], columns // 4, attempt)
            z[rows, columns] = redraw[np.arange(rows.size), columns % 4]
            attempt += 1
            bad = np.abs(z) > _f32(_TRUNCATION_STDDEVS)
    return _f32(a) + _f32(b) * z


def initial_rows(initializer: Optional[dict], keys: Any, dim: int, seed: int = 0) -> np.ndarray:
    """Initial values (n x dim float32) of ids under a table's initializer and seed.

    A pure function of (seed, key, element index), as csrc/initializer.cc
    ``FillInitialRows``, for the initializer's stream "version" (default 2).
    """
    spec = normalize_initializer(initializer)
    n = np.asarray(keys, dtype=np.int64).reshape(-1).shape[0]
    kind, a = spec["kind"], spec["a"]
    if kind == "zeros":
        return np.zeros((n, dim), dtype=np.float32)
    if kind == "constant":
        return np.full((n, dim), np.float32(a), dtype=np.float32)
    if spec["version"] == 1:
        return _initial_rows_v1(spec, keys, dim, seed)
    return np.ascontiguousarray(_initial_rows_v2(spec, keys, dim, seed), dtype=np.float32)


def initial_row(initializer: Optional[dict], key: int, dim: int, seed: int = 0) -> np.ndarray:
    """Initial value (dim float32) of one id; see ``initial_rows``."""
    spec = normalize_initializer(initializer)
    frozen = (spec["kind"], spec["a"], spec["b"], spec["version"])
    return _cached_initial_row(frozen, int(key), int(dim), int(seed)).copy()


@functools.lru_cache(maxsize=1 << 16)
def _cached_initial_row(frozen: tuple, key: int, dim: int, seed: int) -> np.ndarray:
    # The reference tables insert one id at a time and tests reuse ids a lot.
    kind, a, b, version = frozen
    spec = {"kind": kind, "a": a, "b": b, "version": version}
    return initial_rows(spec, [key], dim, seed)[0]


# --------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------

OPTIMIZER_KINDS = (None, "sgd", "adagrad", "adam", "adamw", "ftrl", "rmsprop")

# csrc/optimizer.h OptimizerConfig defaults.
OPTIMIZER_DEFAULTS: dict[str, Any] = {
    "kind": None,
    "learning_rate": 0.01,
    "weight_decay": 0.0,
    "rescale_grad": 1.0,
    "clip_gradient": -1.0,
    "momentum": 0.0,
    "nesterov": False,
    "lr_decay": 0.0,
    "epsilon": 1e-8,
    "initial_accumulator_value": 0.0,
    "beta1": 0.9,
    "beta2": 0.999,
    "lr_power": -0.5,
    "l1": 0.0,
    "l2": 0.0,
    "beta": 0.0,
    "alpha": 0.99,
    "centered": False,
    "step_mode": "row",
    # "torch" (the default) or "mxnet": MXNet 1.x's Adam / AdaGrad / RMSProp.
    "formula": "torch",
    # A float32 master copy of 16-bit rows (ReferenceHalfTable); nothing to the formulas.
    "multi_precision": False,
}


def normalize_optimizer(spec: Optional[dict]) -> dict:
    """The optimizer dict with every field present (defaults of csrc/optimizer.h).

    ``kind`` "none" becomes None; ``clip_gradient`` None becomes -1 (off).
    """
    spec = dict(spec or {})
    unknown = set(spec) - set(OPTIMIZER_DEFAULTS)
    if unknown:
        raise errors.InvalidArgument(f"unknown optimizer settings {sorted(unknown)}")
    full = dict(OPTIMIZER_DEFAULTS)
    full.update(spec)
    if full["kind"] == "none":
        full["kind"] = None
    if full["kind"] not in OPTIMIZER_KINDS:
        raise errors.InvalidArgument(f"unknown optimizer {full['kind']!r}")
    if full["clip_gradient"] is None:
        full["clip_gradient"] = -1.0
    if full["step_mode"] not in ("row", "table"):
        raise errors.InvalidArgument("step_mode must be 'row' or 'table'")
    if full["formula"] not in ("torch", "mxnet"):
        raise errors.InvalidArgument("formula must be 'torch' or 'mxnet'")
    for name, value in full.items():
        if name not in ("kind", "nesterov", "centered", "step_mode", "formula", "multi_precision"):
            full[name] = float(value)
    full["multi_precision"] = bool(full["multi_precision"])
    full["nesterov"] = bool(full["nesterov"])
    full["centered"] = bool(full["centered"])
    return full


def validate_optimizer(spec: Optional[dict]) -> dict:
    """Returns the normalized optimizer, or raises InvalidArgument as ValidateOptimizer does."""
    c = normalize_optimizer(spec)

    def invalid(message: str) -> None:
        raise errors.InvalidArgument(message)

    if not (c["learning_rate"] >= 0.0 and math.isfinite(c["learning_rate"])):
        invalid("learning_rate must be a finite number >= 0")
    if not c["weight_decay"] >= 0.0:
        invalid("weight_decay must be >= 0")
    if not math.isfinite(c["rescale_grad"]):
        invalid("rescale_grad must be finite")
    if not c["momentum"] >= 0.0:
        invalid("momentum must be >= 0")
    if c["nesterov"] and not c["momentum"] > 0.0:
        invalid("nesterov needs momentum > 0")
    if not c["epsilon"] >= 0.0:
        invalid("epsilon must be >= 0")
    if not 0.0 <= c["beta1"] < 1.0:
        invalid("beta1 must be in [0, 1)")
    if not 0.0 <= c["beta2"] < 1.0:
        invalid("beta2 must be in [0, 1)")
    if not c["alpha"] >= 0.0:
        invalid("alpha must be >= 0")
    if not c["initial_accumulator_value"] >= 0.0:
        invalid("initial_accumulator_value must be >= 0")
    if c["formula"] == "mxnet":
        if c["kind"] not in ("adam", "adagrad", "rmsprop"):
            invalid("formula 'mxnet' exists for adam, adagrad and rmsprop only")
        if c["kind"] == "adagrad" and c["lr_decay"] != 0.0:
            invalid("MXNet's AdaGrad has no lr_decay")
    if c["kind"] == "ftrl":
        if not c["lr_power"] <= 0.0:
            invalid("FTRL lr_power must be <= 0")
        if not (c["l1"] >= 0.0 and c["l2"] >= 0.0):
            invalid("FTRL l1 and l2 must be >= 0")
        if not c["learning_rate"] > 0.0:
            invalid("FTRL learning_rate must be > 0")
        if c["weight_decay"] != 0.0:
            invalid("FTRL has no weight_decay; use l2")
        if c["lr_power"] < 0.0 and c["initial_accumulator_value"] == 0.0 and c["lr_power"] != -0.5:
            invalid("FTRL with lr_power other than -0.5 needs initial_accumulator_value > 0")
    return c


def _f32(value: float) -> np.float32:
    return np.float32(value)


class ReferenceOptimizer:
    """One optimizer applied to a flat span of float32 weights, with its own slots.

    The semantics of ``kvsparse._core.Optimizer``: ``update`` works in place
    on ``weights`` (n,) and ``slots`` (num_slots, n) float32 arrays. The
    gradient is first rescaled and clipped (MXNet order), then L2 weight decay
    is added for SGD/Adagrad/Adam/RMSprop, then the reference formula runs:

    * sgd: torch.optim.SGD (momentum, nesterov, dampening 0)
    * adagrad: torch.optim.Adagrad (lr_decay, initial_accumulator_value)
    * adam / adamw: torch.optim.Adam / AdamW (amsgrad off)
    * rmsprop: torch.optim.RMSprop (alpha, centered, momentum)
    * ftrl: TF ApplyFtrl / Keras Ftrl (lr_power, l1, l2, beta), in float64
    * None: the (rescaled, clipped) pushed value replaces the weights

    With ``formula="mxnet"``, Adam / Adagrad / RMSprop follow MXNet 1.x
    instead (csrc/optimizer.h): Adam and RMSprop add weight decay to the
    rescaled gradient *before* clipping; Adam folds both bias corrections
    into the learning rate and adds eps to sqrt(v) uncorrected; AdaGrad
    computes ``w -= lr * (g / sqrt(h + eps) + wd * w)``; RMSprop puts eps
    inside the square root. MXNet's kernels take beta1/beta2/alpha as float32
    and form ``1 - beta`` in float32, and so does this model.

    Slot layout (slot-major, as the core): sgd [momentum_buffer if momentum];
    adagrad [state_sum]; adam(w) [exp_avg, exp_avg_sq]; ftrl [z, accumulator];
    rmsprop [square_avg, momentum_buffer if momentum, grad_avg if centered].

    Example:
        >>> opt = ReferenceOptimizer({"kind": "sgd", "learning_rate": 0.5})
        >>> w = np.ones(2, np.float32)
        >>> opt.update(w, opt.initial_slots(2), np.ones(2, np.float32), step=1)
        >>> w.tolist()
        [0.5, 0.5]
    """

    def __init__(self, spec: Optional[dict]):
        self.config = validate_optimizer(spec)

    @property
    def kind(self) -> Optional[str]:
        return self.config["kind"]

    @property
    def num_slots(self) -> int:
        c = self.config
        if c["kind"] is None:
            return 0
        if c["kind"] == "sgd":
            return 1 if c["momentum"] > 0.0 else 0
        if c["kind"] == "adagrad":
            return 1
        if c["kind"] in ("adam", "adamw", "ftrl"):
            return 2
        return 1 + int(c["momentum"] > 0.0) + int(c["centered"])  # rmsprop

    def initial_slots(self, n: int) -> np.ndarray:
        """Slot arrays (num_slots x n float32) at their initial values."""
        slots = np.zeros((self.num_slots, n), dtype=np.float32)
        accumulator = _f32(self.config["initial_accumulator_value"])
        if self.kind == "adagrad":
            slots[0] = accumulator
        elif self.kind == "ftrl":
            slots[1] = accumulator
        return slots

    def update(self, weights: np.ndarray, slots: np.ndarray, grad: np.ndarray, step: int) -> None:
        """Applies one step in place. step is 1 on the span's first update."""
        c = self.config
        w = weights
        kind = c["kind"]
        mxnet = c["formula"] == "mxnet"
        lr = _f32(c["learning_rate"])
        wd = _f32(c["weight_decay"])
        g = np.asarray(grad, dtype=np.float32) * _f32(c["rescale_grad"])
        if mxnet and kind in ("adam", "rmsprop"):
            g = g + wd * w  # MXNet: weight decay before clipping
        clip = _f32(c["clip_gradient"])
        if clip > 0:
            g = np.minimum(np.maximum(g, -clip), clip)
        if not mxnet and kind in ("sgd", "adagrad", "adam", "rmsprop") and wd != 0:
            g = g + wd * w
        if kind is None:
            w[...] = g
        elif kind == "sgd":
            self._sgd(w, slots, g, lr)
        elif kind == "adagrad":
            clr = _f32(c["learning_rate"] / (1.0 + float(step - 1) * c["lr_decay"]))
            eps = _f32(c["epsilon"])
            slots[0] += g * g
            if mxnet:
                w -= clr * (g / np.sqrt(slots[0] + eps) + wd * w)
            else:
                w -= clr * g / (np.sqrt(slots[0]) + eps)
        elif kind == "adam" and mxnet:
            self._adam_mxnet(w, slots, g, step)
        elif kind in ("adam", "adamw"):
            self._adam(w, slots, g, lr, wd, step)
        elif kind == "rmsprop":
            self._rmsprop(w, slots, g, lr)
        else:
            self._ftrl(w, slots, g)

    def _sgd(self, w, slots, g, lr):
        momentum = self.config["momentum"]
        if momentum > 0.0:
            m = _f32(momentum)
            buf = slots[0]
            buf[...] = m * buf + g
            direction = g + m * buf if self.config["nesterov"] else buf
            w -= lr * direction
        else:
            w -= lr * g

    def _adam(self, w, slots, g, lr, wd, step):
        c = self.config
        # Scalars in float64 as torch computes them in Python, then used in float32.
        if self.kind == "adamw" and wd != 0:
            w *= _f32(1.0 - c["learning_rate"] * c["weight_decay"])
        b2 = _f32(c["beta2"])
        step_size = _f32(c["learning_rate"] / (1.0 - math.pow(c["beta1"], float(step))))
        bc2_sqrt = _f32(math.sqrt(1.0 - math.pow(c["beta2"], float(step))))
        m, v = slots[0], slots[1]
        m += (g - m) * _f32(1.0 - c["beta1"])  # exp_avg.lerp_(grad, 1 - beta1)
        v[...] = v * b2 + _f32(1.0 - c["beta2"]) * g * g
        denom = np.sqrt(v) / bc2_sqrt + _f32(c["epsilon"])
        w -= step_size * m / denom

    def _adam_mxnet(self, w, slots, g, step):
        c = self.config
        b1 = _f32(c["beta1"])
        b2 = _f32(c["beta2"])
        step_size = _f32(c["learning_rate"] / (1.0 - math.pow(c["beta1"], float(step))))
        bc2_sqrt = _f32(math.sqrt(1.0 - math.pow(c["beta2"], float(step))))
        corrected_lr = step_size * bc2_sqrt
        m, v = slots[0], slots[1]
        m[...] = b1 * m + (_f32(1) - b1) * g
        v[...] = b2 * v + (_f32(1) - b2) * g * g
        w -= corrected_lr * m / (np.sqrt(v) + _f32(c["epsilon"]))

    def _rmsprop(self, w, slots, g, lr):
        c = self.config
        alpha = _f32(c["alpha"])
        eps = _f32(c["epsilon"])
        square_avg = slots[0]
        index = 1
        buf = None
        grad_avg = None
        if c["momentum"] > 0.0:
            buf = slots[index]
            index += 1
        if c["centered"]:
            grad_avg = slots[index]
        mxnet = c["formula"] == "mxnet"
        if mxnet:
            one_minus_alpha = _f32(1) - alpha  # MXNet's kernel: float32 gamma1
        else:
            one_minus_alpha = _f32(1.0 - c["alpha"])  # torch: float64, as in Python
        square_avg[...] = square_avg * alpha + one_minus_alpha * g * g
        if grad_avg is not None:
            grad_avg += (g - grad_avg) * one_minus_alpha
            variance = square_avg - grad_avg * grad_avg
        else:
            variance = square_avg
        avg = np.sqrt(variance + eps) if mxnet else np.sqrt(variance) + eps
        if buf is not None:
            buf[...] = buf * _f32(c["momentum"]) + g / avg
            w -= lr * buf
        else:
            w -= lr * g / avg

    def _ftrl(self, w, slots, g):
        # TF ApplyFtrl in float64, the accumulator before and after the step.
        c = self.config
        p = -c["lr_power"]
        eta = c["learning_rate"]
        z, acc = slots[0], slots[1]
        gi = g.astype(np.float64)
        acc_old = acc.astype(np.float64)
        acc_new = acc_old + gi * gi
        pow_new = np.sqrt(acc_new) if p == 0.5 else np.power(acc_new, p)
        pow_old = np.sqrt(acc_old) if p == 0.5 else np.power(acc_old, p)
        sigma = (pow_new - pow_old) / eta
        zi = z.astype(np.float64) + gi - sigma * w.astype(np.float64)
        z[...] = zi.astype(np.float32)
        acc[...] = acc_new.astype(np.float32)
        quadratic = (c["beta"] + pow_new) / eta + 2.0 * c["l2"]
        shrunk = (np.where(zi > 0, 1.0, -1.0) * c["l1"] - zi) / quadratic
        w[...] = np.where(np.abs(zi) > c["l1"], shrunk, 0.0).astype(np.float32)


# --------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------


def _keys_list(keys: Any) -> list[int]:
    array = np.asarray(keys)
    if array.dtype.kind not in "iu" and array.size:
        raise errors.DTypeError(f"ids must be integers, got dtype {array.dtype}")
    return [int(k) for k in array.astype(np.int64).ravel().tolist()]


class ReferenceTable:
    """A dict-based model of ``kvsparse._core.Table`` (one shard's table).

    State: ``rows[key]`` (dim float32), ``slots[key]`` (num_slots x dim
    float32), ``steps[key]`` (int, the row's update count) and
    ``table_step`` (non-empty pushes applied to the table).

    Semantics mirrored from csrc/table.h:

    * ``lookup`` returns stored rows and initial values for missing ids,
      without inserting; ``lookup_or_insert`` inserts missing ids.
    * ``apply_gradients`` sums duplicate ids' gradients (float32, in input
      order), then checks them: a NaN/inf rejects the whole batch
      (NonFiniteGradient, nothing changed) or, with ``skip_nonfinite``, leaves
      those ids untouched (not even inserted). Otherwise the table step is
      bumped once, and each distinct id is inserted if missing, its step
      counter bumped and the optimizer applied with that step (or the table
      step in step_mode "table"). An empty batch changes nothing.
    * ``assign`` sets rows (last duplicate wins); slots and steps are kept,
      inserted rows get initial slots and step 0.
    * ``remove`` forgets ids; a re-inserted id starts again from its initial
      value, initial slots and step 0.
    * ``set_optimizer`` resets every row's slots and step and the table step.

    Example:
        >>> ref = ReferenceTable(2, {"kind": "zeros"}, {"kind": "adagrad"})
        >>> ref.apply_gradients(np.array([1, 1]), np.ones((2, 2), np.float32))
        1
        >>> ref.steps[1], ref.table_step
        (1, 1)
    """

    def __init__(
        self,
        dim: int,
        initializer: Optional[dict] = None,
        optimizer: Optional[dict] = None,
        seed: int = 0,
    ):
        if not 1 <= dim <= MAX_DIM:
            raise errors.InvalidArgument(f"dim must be in [1, {MAX_DIM}], got {dim}")
        self.dim = dim
        self.initializer = validate_initializer(initializer)
        self.seed = seed
        self.optimizer = ReferenceOptimizer(optimizer)
        self.rows: dict[int, np.ndarray] = {}
        self.slots: dict[int, np.ndarray] = {}
        self.steps: dict[int, int] = {}
        self.table_step = 0

    # -- inspection --------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.optimizer.num_slots

    def size(self) -> int:
        """Number of rows stored."""
        return len(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, key: int) -> bool:
        return int(key) in self.rows

    def keys(self) -> np.ndarray:
        """Stored ids, sorted (int64)."""
        return np.array(sorted(self.rows), dtype=np.int64)

    def state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(keys sorted, values n x dim, slots n x num_slots x dim, steps n) of every row."""
        keys = self.keys()
        values, slots, steps = self.read_state(keys)
        return keys, values, slots, steps

    def copy(self) -> ReferenceTable:
        """A deep copy."""
        other = ReferenceTable.__new__(ReferenceTable)
        other.dim = self.dim
        other.initializer = dict(self.initializer)
        other.seed = self.seed
        other.optimizer = self.optimizer
        other.rows = {k: v.copy() for k, v in self.rows.items()}
        other.slots = {k: v.copy() for k, v in self.slots.items()}
        other.steps = dict(self.steps)
        other.table_step = self.table_step
        return other

    # -- helpers -----------------------------------------------------------

    def _check_rows(self, rows: Any, n: int, what: str) -> np.ndarray:
        array = np.asarray(rows)
        if array.dtype != np.float32:
            raise errors.DTypeError(f"{what} must be float32, got {array.dtype}")
        if array.shape != (n, self.dim):
            raise errors.ShapeError(f"{what} must have shape ({n}, {self.dim}), got {array.shape}")
        return array

    def initial_values(self, keys: Any) -> np.ndarray:
        """Initial rows of ids (n x dim), without touching the table."""
        return initial_rows(self.initializer, _keys_list(keys), self.dim, self.seed)

    def _insert(self, key: int) -> None:
        self.rows[key] = initial_row(self.initializer, key, self.dim, self.seed)
        self.slots[key] = self.optimizer.initial_slots(self.dim)
        self.steps[key] = 0

    # -- operations --------------------------------------------------------

    def lookup(self, keys: Any) -> np.ndarray:
        """Rows of ids (n x dim); missing ids get their initial value and are not stored."""
        key_list = _keys_list(keys)
        out = self.initial_values(key_list)
        for i, key in enumerate(key_list):
            if key in self.rows:
                out[i] = self.rows[key]
        return out

    def lookup_or_insert(self, keys: Any) -> np.ndarray:
        """Like lookup, but missing ids are inserted with their initial value."""
        key_list = _keys_list(keys)
        for key in key_list:
            if key not in self.rows:
                self._insert(key)
        return self.lookup(key_list)

    def apply_gradients(self, keys: Any, grads: Any, skip_nonfinite: bool = False) -> int:
        """Applies the optimizer to ids' rows; returns the number of distinct rows updated.

        Raises:
            kvsparse.errors.NonFiniteGradient: a summed gradient holds NaN/inf
                and skip_nonfinite is False (nothing changed).
        """
        key_list = _keys_list(keys)
        grads = self._check_rows(grads, len(key_list), "gradients")
        if not key_list:
            return 0
        unique, inverse = unique_inverse(key_list)
        summed = sum_rows(grads, inverse, len(unique)) if len(unique) != len(key_list) else grads
        finite = np.isfinite(summed).all(axis=1)
        if not finite.all() and not skip_nonfinite:
            bad = int(unique[np.flatnonzero(~finite)[0]])
            raise errors.NonFiniteGradient(f"gradient for id {bad} has a NaN or inf value")
        snapshot = (
            {k: v.copy() for k, v in self.rows.items()},
            {k: v.copy() for k, v in self.slots.items()},
            dict(self.steps),
            self.table_step,
        )
        self.table_step += 1
        per_table = self.optimizer.config["step_mode"] == "table"
        applied = 0
        for j, key in enumerate(unique.tolist()):
            if not finite[j]:
                continue
            fresh = key not in self.rows
            if fresh:
                self._insert(key)
            before = (self.rows[key].copy(), self.slots[key].copy(), self.steps[key])
            self.steps[key] += 1
            step = self.table_step if per_table else self.steps[key]
            with np.errstate(all="ignore"):
                self.optimizer.update(self.rows[key], self.slots[key], summed[j], step)
            if np.isfinite(self.rows[key]).all() and np.isfinite(self.slots[key]).all():
                applied += 1
                continue
            # An update that overflows (inf/NaN from finite values) changes nothing: the
            # row is put back (skip_nonfinite), or the whole push is undone.
            if fresh:
                del self.rows[key], self.slots[key], self.steps[key]
            else:
                self.rows[key], self.slots[key], self.steps[key] = before
            if not skip_nonfinite:
                self.rows, self.slots, self.steps, self.table_step = snapshot
                raise errors.UpdateOverflow(f"the update of id {key} overflows float32")
        return applied

    def assign(self, keys: Any, values: Any) -> None:
        """Sets ids' rows to values (last duplicate wins), inserting missing ids."""
        key_list = _keys_list(keys)
        values = self._check_rows(values, len(key_list), "values")
        for i, key in enumerate(key_list):
            if key not in self.rows:
                self._insert(key)
            self.rows[key] = values[i].copy()

    def remove(self, keys: Any) -> int:
        """Removes the ids that exist; returns how many were removed."""
        removed = 0
        for key in _keys_list(keys):
            if key in self.rows:
                del self.rows[key], self.slots[key], self.steps[key]
                removed += 1
        return removed

    def read_state(self, keys: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(values n x dim, slots n x num_slots x dim, steps n) of existing ids.

        Raises:
            kvsparse.errors.InvalidArgument: an id is not in the table.
        """
        key_list = _keys_list(keys)
        n = len(key_list)
        values = np.empty((n, self.dim), dtype=np.float32)
        slots = np.empty((n, self.num_slots, self.dim), dtype=np.float32)
        steps = np.empty(n, dtype=np.int64)
        for i, key in enumerate(key_list):
            if key not in self.rows:
                raise errors.InvalidArgument(f"id {key} is not in the table")
            values[i] = self.rows[key]
            slots[i] = self.slots[key]
            steps[i] = self.steps[key]
        return values, slots, steps

    def write_state(self, keys: Any, values: Any, slots: Any, steps: Any) -> None:
        """Sets values, slots and step counters of ids, inserting them."""
        key_list = _keys_list(keys)
        values = self._check_rows(values, len(key_list), "values")
        slots = np.asarray(slots, dtype=np.float32)
        if slots.shape != (len(key_list), self.num_slots, self.dim):
            raise errors.ShapeError(
                f"slots must have shape ({len(key_list)}, {self.num_slots}, {self.dim}), "
                f"got {slots.shape}"
            )
        steps = np.asarray(steps, dtype=np.int64)
        if steps.shape != (len(key_list),):
            raise errors.ShapeError(f"steps must have {len(key_list)} entries, got {steps.shape}")
        if len(steps) and (steps.min() < 0 or steps.max() > MAX_STEP):
            raise errors.InvalidArgument(f"step counters must be in [0, {MAX_STEP}]")
        for i, key in enumerate(key_list):
            self.rows[key] = values[i].copy()
            self.slots[key] = slots[i].copy()
            self.steps[key] = int(steps[i])

    def set_optimizer(self, optimizer: Optional[dict]) -> None:
        """Replaces the optimizer: every row's slots and step restart; the table step is 0."""
        self.optimizer = ReferenceOptimizer(optimizer)
        self.table_step = 0
        for key in self.rows:
            self.slots[key] = self.optimizer.initial_slots(self.dim)
            self.steps[key] = 0


class ReferencePolicyTable(ReferenceTable):
    """``ReferenceTable`` plus feature admission and eviction.

    ``policy`` is the dict ``kvsparse._core.Table`` takes (``min_count``,
    ``ttl_steps``, ``max_rows``, ``eviction``, ``evict_every``; 0 means "none"
    for the last four numbers). Semantics, written from csrc/table.h
    (PolicyConfig) and kvsparse.SparseTable's docstring:

    * An id is seen once per ``apply_gradients`` containing it (after dedup,
      finite gradient); ``lookup`` never counts. A missing id is a candidate
      until its min_count-th sighting; that push inserts it and applies its
      gradient.
    * A step is ``table_step`` (bumped by every non-empty push, and by
      ``advance_step``). ``touches[k]`` counts the pushes that updated row k
      since its insertion, ``last[k]`` is the step of the last one.
    * Capacity: when the admitted ids would make the table exceed max_rows,
      rows not in the push are evicted first, the smallest (touches, key)
      for "lfu", the smallest (last step, key) for "lru"; if still too
      little room, new ids are admitted in ascending order up to max_rows
      and the rest are rejected (their candidate count is dropped).
    * TTL: ``evict_expired`` drops rows and candidates with
      ``table_step - last >= ttl_steps``; it runs after every push (and
      ``advance_step``) whose table step is a multiple of evict_every.

    Example:
        >>> ref = ReferencePolicyTable(1, {"kind": "zeros"}, None, 0, {"min_count": 2})
        >>> ref.apply_gradients(np.array([4]), np.ones((1, 1), np.float32))
        0
        >>> ref.apply_gradients(np.array([4]), np.ones((1, 1), np.float32))
        1
    """

    def __init__(self, dim, initializer=None, optimizer=None, seed=0, policy=None):
        super().__init__(dim, initializer, optimizer, seed)
        policy = dict(policy or {})
        self.min_count = int(policy.get("min_count") or 1)
        self.ttl_steps = int(policy.get("ttl_steps") or 0)
        self.max_rows = int(policy.get("max_rows") or 0)
        self.eviction = policy.get("eviction", "lfu")
        self.evict_every = int(policy.get("evict_every") or 0)
        self.touches: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.candidates: dict[int, list[int]] = {}  # key -> [count, last step]
        self.counters = dict.fromkeys(
            ("admissions", "evicted_ttl", "evicted_capacity", "rejected"), 0
        )

    def policy_stats(self) -> dict:
        """The counters of ``kvsparse._core.Table.policy_stats``."""
        return {**self.counters, "candidates": len(self.candidates)}

    def _insert(self, key: int) -> None:
        super()._insert(key)
        self.touches[key] = 0
        self.last[key] = self.table_step

    def write_state(self, keys, values, slots, steps) -> None:
        new = [k for k in _keys_list(keys) if k not in self.rows]
        super().write_state(keys, values, slots, steps)
        for key in new:
            self.touches[key] = 0
            self.last[key] = self.table_step

    def _drop(self, keys) -> int:
        for key in keys:
            del self.rows[key], self.slots[key], self.steps[key]
            del self.touches[key], self.last[key]
        return len(keys)

    def evict_expired(self) -> int:
        """Drops rows and candidates untouched for ttl_steps; returns the rows dropped."""
        if not self.ttl_steps:
            return 0
        now = self.table_step
        self.candidates = {k: c for k, c in self.candidates.items() if now - c[1] < self.ttl_steps}
        removed = self._drop([k for k in self.rows if now - self.last[k] >= self.ttl_steps])
        self.counters["evicted_ttl"] += removed
        return removed

    def _auto_evict(self) -> None:
        if self.ttl_steps and self.evict_every and self.table_step % self.evict_every == 0:
            self.evict_expired()

    def advance_step(self) -> None:
        """A push of the table with none of its ids on this shard."""
        self.table_step += 1
        self._auto_evict()

    def set_optimizer(self, optimizer) -> None:
        super().set_optimizer(optimizer)
        self.last = dict.fromkeys(self.rows, 0)
        for candidate in self.candidates.values():
            candidate[1] = 0

    def apply_gradients(self, keys, grads, skip_nonfinite: bool = False) -> int:
        key_list = _keys_list(keys)
        grads = self._check_rows(grads, len(key_list), "gradients")
        if not key_list:
            return 0
        unique, inverse = unique_inverse(key_list)
        summed = sum_rows(grads, inverse, len(unique)) if len(unique) != len(key_list) else grads
        finite = np.isfinite(summed).all(axis=1)
        if not finite.all() and not skip_nonfinite:
            bad = int(unique[np.flatnonzero(~finite)[0]])
            raise errors.NonFiniteGradient(f"gradient for id {bad} has a NaN or inf value")
        unique = unique.tolist()
        push_step = self.table_step + 1
        fresh = []
        for j, key in enumerate(unique):
            if key in self.rows or not finite[j]:
                continue
            if self.min_count > 1:
                candidate = self.candidates.setdefault(key, [0, push_step])
                candidate[0] += 1
                candidate[1] = push_step
                if candidate[0] < self.min_count:
                    continue
            fresh.append(key)
        if self.max_rows and len(self.rows) + len(fresh) > self.max_rows:
            present = set(unique)
            if self.eviction == "lfu":
                order = sorted((self.touches[k], k) for k in self.rows if k not in present)
            else:
                order = sorted((self.last[k], k) for k in self.rows if k not in present)
            need = len(self.rows) + len(fresh) - self.max_rows
            self.counters["evicted_capacity"] += self._drop([k for _, k in order[:need]])
            room = max(0, self.max_rows - len(self.rows))
            if len(fresh) > room:
                fresh.sort()
                for key in fresh[room:]:
                    self.candidates.pop(key, None)
                self.counters["rejected"] += len(fresh) - room
                fresh = fresh[:room]
        for key in fresh:
            self.candidates.pop(key, None)
            self._insert(key)
            self.counters["admissions"] += 1
        self.table_step += 1
        per_table = self.optimizer.config["step_mode"] == "table"
        applied = 0
        for j, key in enumerate(unique):
            if not finite[j] or key not in self.rows:
                continue
            self.steps[key] += 1
            self.touches[key] += 1
            self.last[key] = self.table_step
            step = self.table_step if per_table else self.steps[key]
            self.optimizer.update(self.rows[key], self.slots[key], summed[j], step)
            applied += 1
        self._auto_evict()
        return applied


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to dtype ('float32', 'float16', 'bfloat16'), as float32.

    Nearest, ties to even: NumPy's float16 cast, and a bit-level bfloat16
    rounding (ml_dtypes' rule) so that the model needs no ml_dtypes.
    """
    values = np.asarray(values, np.float32)
    if dtype == "float32":
        return values.copy()
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return values.astype(np.float16).astype(np.float32)
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    out = rounded.astype(np.uint32).view(np.float32).copy()
    nan = np.isnan(values)
    out[nan] = values[nan]
    return out


class _RoundingOptimizer(ReferenceOptimizer):
    """ReferenceOptimizer whose update rounds weights and slots once, as a 16-bit table writes.

    With ``master`` (multi_precision on a 16-bit table), the last slot is the row's
    float32 master copy: the optimizer updates it (with the other slots) and the
    weights become it rounded.
    """

    def __init__(self, spec, dtype: str, slot_dtype: str):
        super().__init__(spec)
        self.dtype, self.slot_dtype = dtype, slot_dtype
        self.master = bool(self.config["multi_precision"]) and dtype != "float32"

    @property
    def num_slots(self) -> int:
        return super().num_slots + int(self.master)

    def initial_slots(self, n: int) -> np.ndarray:
        # The master slot (last) is set by the table: it is the row's value.
        return round_to(super().initial_slots(n), self.slot_dtype)

    def update(self, weights, slots, grad, step) -> None:
        if not self.master:
            super().update(weights, slots, grad, step)
            with np.errstate(all="ignore"):
                weights[...] = round_to(weights, self.dtype)
                slots[...] = round_to(slots, self.slot_dtype)
            return
        master, optimizer_slots = slots[-1], slots[:-1]
        super().update(master, optimizer_slots, grad, step)
        with np.errstate(all="ignore"):
            weights[...] = round_to(master, self.dtype)
            optimizer_slots[...] = round_to(optimizer_slots, self.slot_dtype)


class ReferenceHalfTable(ReferenceTable):
    """ReferenceTable of a table storing float16 / bfloat16 values (and slots).

    The rule of csrc/table.h (StorageType): values and slots are widened
    exactly, the optimizer runs in float32, and every write rounds to nearest,
    ties to even, once: initial values and slots, each update's result,
    assigned rows, written state. A result that rounds to inf overflows.

    With multi_precision in the optimizer, each row also keeps a float32
    master copy, its last slot: a new row's is its float32 initial value, an
    assigned row's the given values, and set_optimizer makes one from the
    stored values (keeping one the table had). Updates run on the master and
    store it rounded.
    """

    def __init__(
        self, dim, initializer=None, optimizer=None, seed=0, dtype="float16", slot_dtype="float32"
    ):
        super().__init__(dim, initializer, optimizer, seed)
        self.dtype, self.slot_dtype = dtype, slot_dtype
        self.optimizer = _RoundingOptimizer(optimizer, dtype, slot_dtype)

    def set_optimizer(self, optimizer) -> None:
        had_master = self.optimizer.master
        masters = {key: (slots[-1] if had_master else row) for key, slots, row in self._rows()}
        super().set_optimizer(optimizer)
        self.optimizer = _RoundingOptimizer(optimizer, self.dtype, self.slot_dtype)
        for key in self.slots:
            self.slots[key] = self.optimizer.initial_slots(self.dim)
            if self.optimizer.master:
                self.slots[key][-1] = masters[key]

    def _rows(self):
        return [(key, self.slots[key], self.rows[key]) for key in self.rows]

    def initial_values(self, keys):
        return round_to(super().initial_values(keys), self.dtype)

    def _insert(self, key: int) -> None:
        super()._insert(key)
        if self.optimizer.master:
            self.slots[key][-1] = self.rows[key]
        self.rows[key] = round_to(self.rows[key], self.dtype)

    def assign(self, keys, values) -> None:
        values = np.asarray(values, np.float32)
        super().assign(keys, round_to(values, self.dtype))
        if self.optimizer.master:
            for key, row in zip(_keys_list(keys), values):
                self.slots[key][-1] = row

    def write_state(self, keys, values, slots, steps) -> None:
        super().write_state(
            keys, round_to(np.asarray(values, np.float32), self.dtype), slots, steps
        )
        for key in _keys_list(keys):
            n = self.optimizer.num_slots - int(self.optimizer.master)
            self.slots[key][:n] = round_to(self.slots[key][:n], self.slot_dtype)
