"""The deterministic row initializers (csrc/initializer.cc, csrc/philox.cc) through kvsparse._core.

- Bit-exactness with the NumPy reference (tests/reference.py), whose Philox
  passes Random123's known-answer vectors, for both stream versions.
- Purity: a row depends only on (seed, id, element index): not on the batch
  it is generated in, its position there, the order of inserts, the other
  rows of the table, the table's dim or the path (lookup, lookup_or_insert,
  push, initial_values) that generates it.
- Distribution: moments and a Kolmogorov-Smirnov test on about 1e6 samples
  (normal, uniform, truncated normal), Box-Muller pairs independent.
- A pull of unseen ids changes nothing a later push sees (admission included).

Fixed seeds: every statistical check is deterministic, with tolerances of
about 5 standard errors.
"""

import math

import numpy as np
import pytest
import reference

from kvsparse import _core, errors

INT64_MIN = np.iinfo(np.int64).min
INT64_MAX = np.iinfo(np.int64).max
RANDOM_KINDS = ["uniform", "normal", "truncated_normal"]
SAMPLES = 1 << 20


def ids(values):
    return np.array(values, dtype=np.int64)


def random_ids(n, seed=0):
    return np.random.default_rng(seed).integers(INT64_MIN, INT64_MAX, size=n, dtype=np.int64)


def bits(rows):
    return np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32)


def samples(kind, a=0.0, b=1.0, seed=5, version=2):
    """About SAMPLES values of one initializer, from rows of dim 64."""
    spec = {"kind": kind, "a": a, "b": b, "version": version}
    table = _core.Table(64, spec, seed=seed)
    return table.initial_values(ids(np.arange(SAMPLES // 64))).ravel().astype(np.float64)


def standard_normal_cdf(x):
    erf = np.frompyfunc(math.erf, 1, 1)
    return 0.5 * (1.0 + erf(x / math.sqrt(2.0)).astype(np.float64))


def ks_statistic(values, cdf):
    """Kolmogorov-Smirnov distance of the sample from a continuous cdf."""
    x = np.sort(values)
    n = x.size
    f = cdf(x)
    above = np.arange(1, n + 1) / n - f
    below = f - np.arange(0, n) / n
    return max(above.max(), below.max())


def ks_critical(n, alpha=0.001):
    """Asymptotic critical value: sqrt(-ln(alpha / 2) / 2) / sqrt(n)."""
    return math.sqrt(-math.log(alpha / 2) / 2) / math.sqrt(n)


def moments(x):
    mean = x.mean()
    centered = x - mean
    var = (centered**2).mean()
    skew = (centered**3).mean() / var**1.5
    kurtosis = (centered**4).mean() / var**2
    return mean, var, skew, kurtosis


# -- the stream contract ---------------------------------------------------------------------


def test_stream_version_constant():
    assert _core.INITIALIZER_VERSION == 2
    assert reference.INITIALIZER_VERSION == _core.INITIALIZER_VERSION


@pytest.mark.parametrize("version", [0, 3, -1])
def test_unknown_stream_version_raises(version):
    with pytest.raises(errors.InvalidArgument, match="version"):
        _core.Table(4, {"kind": "normal", "b": 1.0, "version": version})


def test_reference_philox_known_answers():
    """Random123 tests/kat_vectors, the three "philox4x32 10" lines."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, expected in cases:
        assert tuple(int(w) for w in reference.philox4x32(counter, *key)) == expected


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("kind", RANDOM_KINDS)
# 60 floats = 15 blocks: the AVX2 (8), SSE2 (4) and scalar (3) Philox paths in one row.
@pytest.mark.parametrize("dim", [1, 3, 4, 7, 8, 60, 64, 129])
def test_rows_are_bit_exact_with_reference(kind, dim, version):
    spec = {"kind": kind, "a": 0.25, "b": 1.5, "version": version}
    keys = np.concatenate([ids([INT64_MIN, -1, 0, 1, INT64_MAX]), random_ids(300, dim)])
    table = _core.Table(dim, spec, seed=12345)
    expected = reference.initial_rows(spec, keys, dim, seed=12345)
    np.testing.assert_array_equal(bits(table.initial_values(keys)), bits(expected))


def test_version_2_is_the_default_and_differs_from_version_1():
    keys = random_ids(100)
    default = _core.Table(8, {"kind": "normal", "b": 1.0}, seed=3).initial_values(keys)
    v2 = _core.Table(8, {"kind": "normal", "b": 1.0, "version": 2}, seed=3).initial_values(keys)
    v1 = _core.Table(8, {"kind": "normal", "b": 1.0, "version": 1}, seed=3).initial_values(keys)
    np.testing.assert_array_equal(bits(default), bits(v2))
    assert not np.any(v1 == v2)


# -- purity: (seed, id, element) only ------------------------------------------------------


@pytest.mark.parametrize("kind", RANDOM_KINDS)
def test_row_alone_equals_row_in_any_batch(kind):
    """Every batch size and position (vector kernels, their tails, chunk edges)."""
    dim = 20
    table = _core.Table(dim, {"kind": kind, "a": 1.0, "b": 2.0}, seed=9)
    keys = random_ids(700, 1)
    alone = np.stack([table.initial_values(keys[i : i + 1])[0] for i in range(keys.size)])
    for start, stop in [(0, 700), (3, 700), (0, 13), (5, 70), (64, 65), (100, 613)]:
        np.testing.assert_array_equal(
            bits(table.initial_values(keys[start:stop])), bits(alone[start:stop])
        )
        np.testing.assert_array_equal(bits(table.lookup(keys[start:stop])), bits(alone[start:stop]))


@pytest.mark.parametrize("kind", RANDOM_KINDS)
def test_rows_do_not_depend_on_insert_order_or_path(kind):
    dim = 9
    spec = {"kind": kind, "a": -0.5, "b": 0.75}
    keys = random_ids(3000, 2)
    expected = _core.Table(dim, spec, seed=4).initial_values(keys)
    rng = np.random.default_rng(0)
    # lookup_or_insert in a shuffled order, in batches of varying size.
    table = _core.Table(dim, spec, seed=4)
    order = rng.permutation(keys.size)
    for part in np.array_split(order, [1, 5, 300, 301, 2500]):
        table.lookup_or_insert(keys[part])
    np.testing.assert_array_equal(bits(table.lookup(keys)), bits(expected))
    # Inserted by a push of zero gradients with SGD (the update keeps the value).
    pushed = _core.Table(dim, spec, {"kind": "sgd", "learning_rate": 1.0}, seed=4)
    for part in np.array_split(rng.permutation(keys.size), 3):
        pushed.apply_gradients(keys[part], np.zeros((part.size, dim), np.float32))
    assert len(pushed) == keys.size
    np.testing.assert_array_equal(bits(pushed.lookup(keys)), bits(expected))


def test_a_row_depends_only_on_seed_and_id():
    """What makes rows independent of the shard count: other ids, dim and table don't matter."""
    keys = random_ids(500, 3)
    spec = {"kind": "normal", "a": 0.0, "b": 0.01}
    wide = _core.Table(64, spec, seed=77).initial_values(keys)
    for dim in (1, 5, 8, 33):
        narrow = _core.Table(dim, spec, seed=77)
        narrow.lookup_or_insert(random_ids(1000, dim))  # unrelated content
        np.testing.assert_array_equal(bits(narrow.lookup(keys)), bits(wide[:, :dim]))
    # As a hash-partitioned store would place them: each "shard" sees a subset.
    for num_shards in (2, 3, 7):
        shard = _core.shard_of(keys, num_shards)
        for s in range(num_shards):
            mine = keys[shard == s]
            table = _core.Table(64, spec, seed=77)
            np.testing.assert_array_equal(
                bits(table.lookup_or_insert(mine)), bits(wide[shard == s])
            )
    other_seed = _core.Table(64, spec, seed=78).initial_values(keys)
    assert np.mean(other_seed == wide) < 1e-3


def test_large_batches_split_over_threads_give_the_same_rows():
    """InitialValues and inserts run ParallelFor above ~64k floats."""
    dim = 8
    keys = random_ids(40_000, 4)
    spec = {"kind": "truncated_normal", "a": 0.0, "b": 0.5}
    expected = reference.initial_rows(spec, keys, dim, seed=6)
    table = _core.Table(dim, spec, {"kind": "sgd", "learning_rate": 0.0}, seed=6)
    np.testing.assert_array_equal(bits(table.initial_values(keys)), bits(expected))
    np.testing.assert_array_equal(bits(table.lookup(keys)), bits(expected))
    table.apply_gradients(keys, np.ones((keys.size, dim), np.float32))
    np.testing.assert_array_equal(bits(table.lookup(keys)), bits(expected))


# -- distribution ----------------------------------------------------------------------------


def test_normal_moments_and_ks():
    z = samples("normal")
    n = z.size
    mean, var, skew, kurtosis = moments(z)
    # Standard errors: 1/sqrt(n), sqrt(2/n), sqrt(6/n), sqrt(24/n); 5 of them.
    assert abs(mean) < 5 / math.sqrt(n)
    assert abs(var - 1.0) < 5 * math.sqrt(2 / n)
    assert abs(skew) < 5 * math.sqrt(6 / n)
    assert abs(kurtosis - 3.0) < 5 * math.sqrt(24 / n)
    assert ks_statistic(z, standard_normal_cdf) < ks_critical(n)
    # The tail reaches past 4.5 sigma (u1 has 31 bits, the log is exact enough).
    assert 4.5 < np.abs(z).max() < 6.7


def test_normal_scale_and_offset():
    z = samples("normal", a=3.0, b=0.01)
    assert abs(z.mean() - 3.0) < 5 * 0.01 / math.sqrt(z.size)
    assert abs(z.std() / 0.01 - 1.0) < 5 * math.sqrt(0.5 / z.size)


def test_box_muller_pairs_are_independent_and_uniform_in_angle():
    """Elements 2k, 2k+1 are the cosine and sine outputs of one Box-Muller pair."""
    z = samples("normal").reshape(-1, 2)
    n = z.shape[0]
    cos_out, sin_out = z[:, 0], z[:, 1]
    assert abs(np.corrcoef(cos_out, sin_out)[0, 1]) < 5 / math.sqrt(n)
    assert abs(np.corrcoef(cos_out**2, sin_out**2)[0, 1]) < 5 / math.sqrt(n)
    # Each quadrant of the angle a quarter of the time (binomial s.e. sqrt(3/16/n)).
    for sign_cos in (1, -1):
        for sign_sin in (1, -1):
            share = np.mean((sign_cos * cos_out > 0) & (sign_sin * sin_out > 0))
            assert abs(share - 0.25) < 5 * math.sqrt(3 / 16 / n)
    # Neighbouring pairs (other Philox words) are independent too.
    assert abs(np.corrcoef(z[:-1, 0], z[1:, 0])[0, 1]) < 5 / math.sqrt(n)


def test_uniform_moments_and_ks():
    u = samples("uniform", a=0.0, b=1.0)
    n = u.size
    assert u.min() >= 0.0 and u.max() < 1.0
    mean, var, skew, kurtosis = moments(u)
    # Uniform on [0, 1): var 1/12 (s.e. sqrt(1/180/n)), kurtosis 1.8 (s.e. ~ sqrt(1.2/n)).
    assert abs(mean - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(var - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    assert abs(skew) < 5 * math.sqrt(1.2 / n)
    assert abs(kurtosis - 1.8) < 5 * math.sqrt(1.2 / n)
    assert ks_statistic(u, lambda x: x) < ks_critical(n)


def test_uniform_bounds():
    u = samples("uniform", a=-2.0, b=-1.5)
    assert u.min() >= -2.0 and u.max() <= -1.5
    assert u.min() < -1.999 and u.max() > -1.501


def test_truncated_normal_bounds_moments_and_ks():
    mean, stddev = 0.5, 0.25
    x = samples("truncated_normal", a=mean, b=stddev)
    n = x.size
    # One float32 ulp of slack: mean + stddev * z is rounded once.
    slack = np.spacing(np.float32(mean + 2 * stddev))
    assert x.min() >= mean - 2 * stddev - slack and x.max() <= mean + 2 * stddev + slack
    z = (x - mean) / stddev
    mass = math.erf(2 / math.sqrt(2))  # P(|z| <= 2)
    density_at_2 = math.exp(-2) / math.sqrt(2 * math.pi)
    expected_var = 1 - 2 * 2 * density_at_2 / mass
    z_mean, z_var, z_skew, _ = moments(z)
    assert abs(z_mean) < 5 * math.sqrt(expected_var / n)
    assert abs(z_var - expected_var) < 5 * math.sqrt(2 / n)
    assert abs(z_skew) < 5 * math.sqrt(6 / n)

    def truncated_cdf(v):
        v = np.clip(v, -2.0, 2.0)
        return (standard_normal_cdf(v) - (1 - mass) / 2) / mass

    assert ks_statistic(z, truncated_cdf) < ks_critical(n)


# -- pull of unseen ids, then push -------------------------------------------------------------


@pytest.mark.parametrize("min_count", [1, 3])
def test_pull_of_unseen_ids_changes_nothing_a_push_sees(min_count):
    dim = 16
    spec = {"kind": "normal", "a": 0.0, "b": 0.01}
    optimizer = {"kind": "adagrad", "learning_rate": 0.1}
    keys = random_ids(5000, 7)
    grads = np.random.default_rng(8).standard_normal((keys.size, dim)).astype(np.float32)
    policy = {"min_count": min_count}
    pulled = _core.Table(dim, spec, optimizer, seed=2, policy=policy)
    fresh = _core.Table(dim, spec, optimizer, seed=2, policy=policy)
    before = pulled.lookup(keys)
    assert len(pulled) == 0  # a pull stores nothing
    for round_number in range(min_count):
        part = slice(0, 3000)
        assert pulled.apply_gradients(keys[part], grads[part]) == fresh.apply_gradients(
            keys[part], grads[part]
        )
        expected_rows = 3000 if round_number + 1 >= min_count else 0
        assert len(pulled) == len(fresh) == expected_rows  # admission as without the pull
        pulled.lookup(keys)
    np.testing.assert_array_equal(bits(pulled.lookup(keys)), bits(fresh.lookup(keys)))
    np.testing.assert_array_equal(bits(pulled.lookup(keys[3000:])), bits(before[3000:]))
    assert pulled.policy_stats()["candidates"] == fresh.policy_stats()["candidates"]
