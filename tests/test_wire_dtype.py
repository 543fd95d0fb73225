"""Half-precision on the wire: ``wire_dtype='float16'|'bfloat16'``.

Layers, each against a reference that does not use kvsparse's conversions:

- the C++ conversions (`_core.narrow` / `widen` / `gather_widen_from_shards`),
  bit for bit against NumPy's float16 casts and ml_dtypes' bfloat16 (or a
  NumPy bit-twiddling bfloat16 where ml_dtypes is missing), over random bit
  patterns, every tie, subnormals, the overflow edge, inf and NaN, and a
  hypothesis property;
- the wire codecs (row dtype codes in the items, 16-bit frames, refusals);
- a real server refusing a malformed 16-bit frame and serving on;
- ``dist_sparse`` on 2 real servers: pulled rows are the float32 rows rounded,
  and after SGD / Adagrad pushes the table equals a NumPy reference
  (`reference.ReferenceTable`) fed per-id sums rounded to the wire dtype;
  ``local`` with the same option gives the same numbers bit for bit;
- the option's validation and precedence (a table's setting wins).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import ReferenceTable

import kvsparse
from kvsparse import _core, errors
from kvsparse.store.keys import KeyRegistry
from kvsparse.wire import ops, protocol
from kvsparse.wire.protocol import ITEM_FLAG_STEP, Header, Op

try:
    import ml_dtypes
except ImportError:  # the NumPy reference below stands in
    ml_dtypes = None

HALF_DTYPES = ("float16", "bfloat16")


# -- references ----------------------------------------------------------------------------


def bfloat16_bits_numpy(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns of float32 values: round to nearest, ties to even (non-NaN)."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def reference_bits(values: np.ndarray, dtype: str) -> np.ndarray:
    """The bit patterns NumPy (float16) or ml_dtypes (bfloat16) give values."""
    values = np.ascontiguousarray(values, np.float32)
    with np.errstate(all="ignore"):
        if dtype == "float16":
            return values.astype(np.float16).view(np.uint16)
        if ml_dtypes is not None:
            return values.astype(ml_dtypes.bfloat16).view(np.uint16)
    return bfloat16_bits_numpy(values)


def reference_widen(bits: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of 16-bit patterns, widened by NumPy (not by kvsparse)."""
    bits = np.ascontiguousarray(bits, np.uint16)
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to dtype and back, by the references."""
    return reference_widen(reference_bits(values, dtype), dtype)


def floats_of(bits) -> np.ndarray:
    return np.asarray(bits, np.uint64).astype(np.uint32).view(np.float32)


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    mismatch = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    assert mismatch.size == 0, (
        f"{mismatch.size} mismatches, first at {mismatch[:5]}: "
        f"got {got.reshape(-1)[mismatch[:5]]}, want {want.reshape(-1)[mismatch[:5]]}"
    )


# -- the C++ conversions ----------------------------------------------------------------------


@pytest.fixture(params=["x86", "portable"])
def kernels(request):
    """Runs a test with the x86 F16C/AVX2 kernels, then with the portable loops."""
    if request.param == "x86" and not _core.use_half_hardware(True):
        pytest.skip("this CPU has no F16C/AVX2: the portable kernels are the only ones")
    _core.use_half_hardware(request.param == "x86")
    try:
        yield request.param
    finally:
        _core.use_half_hardware(True)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_narrowing_random_bit_patterns_matches_the_reference_bit_for_bit(dtype, kernels):
    rng = np.random.default_rng(10)
    values = floats_of(rng.integers(0, 2**32, (1 << 21) + 13, dtype=np.uint64))
    finite_or_inf = ~np.isnan(values)
    assert_same_bits(
        _core.narrow(values, dtype)[finite_or_inf], reference_bits(values, dtype)[finite_or_inf]
    )


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_every_tie_rounds_to_even(dtype, kernels):
    # Midpoints of every pair of neighbouring finite 16-bit values (exact in float32).
    patterns = np.arange(0x7C00 if dtype == "float16" else 0x7F80, dtype=np.uint16)
    low, high = reference_widen(patterns[:-1], dtype), reference_widen(patterns[1:], dtype)
    ties = ((low.astype(np.float64) + high) / 2).astype(np.float32)
    assert (ties.astype(np.float64) == (low.astype(np.float64) + high) / 2).all()
    ties = np.concatenate([ties, -ties])
    got = _core.narrow(ties, dtype)
    assert_same_bits(got, reference_bits(ties, dtype))
    assert (got & 1 == 0).all()  # to even, every one of them


def test_float16_special_values(kernels):
    specials = np.array(
        [
            0.0,
            -0.0,
            2.0**-24,  # smallest subnormal
            2.0**-25,  # a tie with 0: to even, 0
            3 * 2.0**-25,  # a tie between 1 and 2 ulps: 2
            2.0**-14 - 2.0**-25,  # largest subnormal's upper tie: the smallest normal
            2.0**-30,  # far below: 0
            1e-40,  # a float32 subnormal
            65504.0,  # the largest float16
            65519.996,  # just below the overflow tie: 65504
            65520.0,  # the tie: overflows to inf, as IEEE rounding does
            65536.0,
            3.4028235e38,
            np.inf,
            -np.inf,
            -65520.0,
            1.0 + 2.0**-11,  # a tie: to even, 1
            1.0 + 3 * 2.0**-11,  # a tie: to even, 1 + 2**-9
        ],
        np.float32,
    )
    got = _core.narrow(specials, "float16")
    assert_same_bits(got, reference_bits(specials, "float16"))
    assert got[10] == 0x7C00 and got[15] == 0xFC00 and got[8] == 0x7BFF and got[9] == 0x7BFF


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_nan_stays_a_nan_of_the_same_sign_and_quiet(dtype, kernels):
    nans = floats_of([0x7FC00000, 0xFFC00000, 0x7FC01234, 0x7F800001, 0xFF800001, 0x7FFFFFFF])
    got = _core.narrow(nans, dtype)
    back = _core.widen(got, dtype)
    assert np.isnan(back).all()
    np.testing.assert_array_equal(np.signbit(back), np.signbit(nans))
    quiet = 0x0200 if dtype == "float16" else 0x0040
    assert (got & quiet == quiet).all()
    # Quiet NaNs keep the top of their payload, as NumPy's float16 cast does.
    if dtype == "float16":
        assert_same_bits(got[:3], reference_bits(nans[:3], dtype))


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_widening_every_16_bit_pattern_is_exact(dtype, kernels):
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = _core.widen(patterns, dtype)
    want = reference_widen(patterns, dtype).view(np.uint32)
    # A NaN keeps its sign and payload and comes out quiet (IEEE: a signaling NaN is quieted).
    want = np.where(np.isnan(want.view(np.float32)), want | 0x00400000, want)
    assert_same_bits(got.view(np.uint32), want)
    # Narrowing a widened value gives the pattern back (NaNs aside): nothing is lost.
    finite = ~np.isnan(got)
    assert_same_bits(_core.narrow(got, dtype)[finite], patterns[finite])


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_the_x86_and_portable_kernels_give_the_same_bits_nans_included(dtype):
    if not _core.use_half_hardware(True):
        pytest.skip("this CPU has no F16C/AVX2: the portable kernels are the only ones")
    rng = np.random.default_rng(13)
    values = floats_of(rng.integers(0, 2**32, (1 << 20) + 7, dtype=np.uint64))
    values[::97] = floats_of(rng.integers(0x7F800001, 0x7FFFFFFF, values[::97].size))
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    try:
        results = []
        for hardware in (True, False):
            _core.use_half_hardware(hardware)
            widened = _core.widen(patterns, dtype).view(np.uint32)
            results.append((_core.narrow(values, dtype), widened))
    finally:
        _core.use_half_hardware(True)
    for x86, portable in zip(*results):
        assert_same_bits(x86, portable)


def test_the_numpy_bfloat16_reference_agrees_with_ml_dtypes():
    if ml_dtypes is None:
        pytest.skip("ml_dtypes is not installed: the NumPy reference is the only one")
    rng = np.random.default_rng(11)
    values = floats_of(rng.integers(0, 2**32, 1 << 18, dtype=np.uint64))
    values = values[~np.isnan(values)]
    with np.errstate(all="ignore"):
        want = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert_same_bits(bfloat16_bits_numpy(values), want)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    values=st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64),
    dtype=st.sampled_from(HALF_DTYPES),
)
def test_property_narrowing_is_the_references_rounding_and_idempotent(values, dtype, kernels):
    array = np.array(values, np.float32)
    bits = _core.narrow(array, dtype)
    assert_same_bits(bits, reference_bits(array, dtype))
    widened = _core.widen(bits, dtype)
    assert_same_bits(_core.narrow(widened, dtype), bits)
    finite = np.isfinite(widened)
    # The nearest value: no 16-bit value is closer to the input than the result.
    error = np.abs(widened[finite].astype(np.float64) - array[finite])
    for step in (-1, 1):
        neighbour = _core.widen((bits[finite].astype(np.int32) + step).astype(np.uint16), dtype)
        ok = np.isfinite(neighbour)
        assert (error[ok] <= np.abs(neighbour[ok].astype(np.float64) - array[finite][ok])).all()


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_shapes_read_only_input_and_out(dtype):
    values = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
    values.flags.writeable = False
    bits = _core.narrow(values, dtype)
    assert bits.shape == (2, 3, 4) and bits.dtype == np.uint16
    out = np.empty((2, 3, 4), np.float32)
    assert _core.widen(bits, dtype, out=out) is out
    np.testing.assert_array_equal(out, rounded(values, dtype))
    assert _core.narrow(np.empty((0, 5), np.float32), dtype).shape == (0, 5)


def test_conversion_errors_name_the_problem():
    with pytest.raises(errors.InvalidArgument, match="'float16' or 'bfloat16', got 'half'"):
        _core.narrow(np.zeros(3, np.float32), "half")
    with pytest.raises(errors.InvalidArgument, match="got 'float32'"):
        _core.widen(np.zeros(3, np.uint16), "float32")
    with pytest.raises(errors.DTypeError, match="float32"):
        _core.narrow(np.zeros(3, np.float64), "float16")
    with pytest.raises(errors.DTypeError, match="uint16"):
        _core.widen(np.zeros(3, np.int16), "float16")
    with pytest.raises(errors.ShapeError):
        _core.narrow(np.zeros(3, np.float32), "float16", out=np.empty(4, np.uint16))


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_gather_widens_reply_rows_straight_into_the_output(dtype, kernels):
    rng = np.random.default_rng(12)
    dim, offsets = 21, np.array([0, 3, 3, 7], np.int64)  # 21: vector width plus a tail
    replies = [rng.standard_normal((n, dim)).astype(np.float32) for n in (3, 0, 4)]
    slot = rng.integers(0, 7, 40).astype(np.int64)
    out = np.full((40, dim), np.nan, np.float32)
    bits = [_core.narrow(rows, dtype) for rows in replies]
    _core.gather_widen_from_shards(bits, offsets, slot, out, dtype)
    np.testing.assert_array_equal(out, rounded(np.concatenate(replies), dtype)[slot])
    with pytest.raises(errors.ShapeError, match="shard 2"):
        _core.gather_widen_from_shards(bits[:2] + [bits[2][:3]], offsets, slot, out, dtype)
    with pytest.raises(errors.InvalidArgument, match="slot"):
        _core.gather_widen_from_shards(bits, offsets, slot + 7, out, dtype)
    with pytest.raises(errors.DTypeError):
        _core.gather_widen_from_shards(replies, offsets, slot, out, dtype)


def test_nonfinite_half_rows_are_found():
    rows = np.zeros((4, 3), np.float32)
    rows[2, 1] = 70000.0  # beyond float16, finite in bfloat16
    assert _core.first_nonfinite_half_row(_core.narrow(rows, "float16"), "float16") == 2
    assert _core.first_nonfinite_half_row(_core.narrow(rows, "bfloat16"), "bfloat16") == -1
    rows[1, 0] = np.nan
    assert _core.first_nonfinite_half_row(_core.narrow(rows, "bfloat16"), "bfloat16") == 1


# -- the option: validation, precedence, what servers get ---------------------------------------


def test_bad_wire_dtype_names_are_refused_everywhere():
    for bad in ("fp16", "half", "float64", None, 16, np.float16):
        with pytest.raises(errors.InvalidArgument, match="wire_dtype must be one of"):
            kvsparse.create("local", wire_dtype=bad)
    with pytest.raises(errors.InvalidArgument, match="SparseTable wire_dtype .* got 'fp16'"):
        kvsparse.SparseTable(dim=4, wire_dtype="fp16")
    # Checked before any connection is tried (nothing listens on port 1).
    with pytest.raises(errors.InvalidArgument, match="wire_dtype"):
        kvsparse.create("dist_sparse", servers=["tcp://127.0.0.1:1"], wire_dtype="bf16")
    with pytest.raises(errors.InvalidArgument, match="no options but wire_dtype"):
        kvsparse.create("local", wire_dtype="float16", servers=["x"])


def test_a_tables_wire_dtype_round_trips_its_spec_and_stays_off_the_servers():
    table = kvsparse.SparseTable(dim=4, wire_dtype="bfloat16")
    assert kvsparse.SparseTable.from_dict(table.to_dict()) == table
    assert "wire_dtype" not in kvsparse.SparseTable(dim=4).to_dict()
    info, server_spec = KeyRegistry.sparse_info("k", table, num_shards=2)
    assert info.wire_dtype == "bfloat16" and "wire_dtype" not in server_spec
    assert info.to_record()["wire_dtype"] == "bfloat16"
    assert type(info).from_record(info.to_record()).wire_dtype == "bfloat16"
    old_record = {k: v for k, v in info.to_record().items() if k != "wire_dtype"}
    assert type(info).from_record(old_record).wire_dtype is None
    with pytest.raises(errors.InvalidArgument, match="manifest's wire_dtype"):
        type(info).from_record({**old_record, "wire_dtype": "fp8"})


def test_a_tables_setting_wins_over_the_stores():
    kv = kvsparse.create("local", wire_dtype="float16")
    kv.init("own", kvsparse.SparseTable(dim=4, wire_dtype="bfloat16"))
    kv.init("exact", kvsparse.SparseTable(dim=4, wire_dtype="float32"))
    kv.init("default", kvsparse.SparseTable(dim=4))
    kv.init("dense", np.zeros(3, np.float32))
    assert kv.wire_dtype == "float16" and kv.wire_dtype_of("dense") == "float32"
    assert [kv.wire_dtype_of(k) for k in ("own", "exact", "default")] == [
        "bfloat16",
        "float32",
        "float16",
    ]
    assert kvsparse.create("local").wire_dtype == "float32"


# -- the local store: the numbers dist_sparse gives -----------------------------------------------


def _uniform(scale=1.0):
    return kvsparse.initializers.Uniform(-scale, scale)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_local_pulls_are_the_float32_rows_rounded(dtype):
    ids = np.array([[3, 9, 3], [100, -7, 2**40]])
    exact, half = kvsparse.create("local"), kvsparse.create("local", wire_dtype=dtype)
    for kv in (exact, half):
        kv.init("emb", kvsparse.SparseTable(dim=6, initializer=_uniform(), seed=4))
    want = rounded(exact.row_sparse_pull("emb", row_ids=ids), dtype)
    assert not np.array_equal(want, exact.row_sparse_pull("emb", row_ids=ids))
    np.testing.assert_array_equal(half.row_sparse_pull("emb", row_ids=ids), want)
    # Into a caller's non-contiguous out too.
    out = np.zeros((2, 3, 12), np.float32)[:, :, ::2]
    half.row_sparse_pull("emb", row_ids=ids, out=out)
    np.testing.assert_array_equal(out, want)


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=40),
    repeat=st.integers(1, 3),
    dim=st.integers(1, 40),
    scale=st.sampled_from([1e-6, 1.0, 1e5]),
    dtype=st.sampled_from(HALF_DTYPES),
)
def test_property_local_pulls_are_the_float32_pulls_rounded(ids, repeat, dim, scale, dtype):
    row_ids = np.array(ids * repeat, np.int64)
    table = kvsparse.SparseTable(dim=dim, initializer=_uniform(scale), seed=len(ids))
    exact, half = kvsparse.create("local"), kvsparse.create("local", wire_dtype=dtype)
    exact.init("emb", table)
    half.init("emb", table)
    want = rounded(exact.row_sparse_pull("emb", row_ids=row_ids), dtype)
    np.testing.assert_array_equal(half.row_sparse_pull("emb", row_ids=row_ids), want)


def test_a_float16_overflow_is_refused_before_anything_is_sent():
    kv = kvsparse.create("local", wire_dtype="float16")
    kv.init("emb", kvsparse.SparseTable(dim=2, initializer=kvsparse.initializers.Zeros()))
    kv.set_optimizer(kvsparse.optimizers.SGD(learning_rate=1.0))
    ids = np.array([1, 2, 2])
    # Each row fits float16; their sum for id 2 does not.
    grads = np.array([[1, 1], [40000, 0], [40000, 0]], np.float32)
    with pytest.raises(errors.NonFiniteGradient, match="id 2 is beyond the range of float16"):
        kv.push("emb", (ids, grads))
    np.testing.assert_array_equal(kv.row_sparse_pull("emb", row_ids=np.array([1, 2])), 0)
    # bfloat16 has float32's range; nonfinite='skip' drops the row as a server would.
    skip = kvsparse.create("local", wire_dtype="float16")
    skip.init("emb", kvsparse.SparseTable(dim=2, nonfinite="skip", initializer=_uniform(0)))
    skip.set_optimizer(kvsparse.optimizers.SGD(learning_rate=1.0))
    skip.push("emb", (ids, grads))
    np.testing.assert_array_equal(
        skip.row_sparse_pull("emb", row_ids=np.array([1, 2])), [[-1, -1], [0, 0]]
    )


# -- the wire codecs ------------------------------------------------------------------------------


def _decode_request(request: ops.Request, codec):
    header = Header(
        op=int(request.op),
        num_items=request.num_items,
        flags=request.flags,
        num_frames=len(request.frames),
    )
    frames = [
        bytes(np.ascontiguousarray(f).data) if isinstance(f, np.ndarray) else f
        for f in request.frames
    ]
    return codec.decode_request(header, frames)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_pull_codec_carries_the_row_dtype_and_narrows_the_reply(dtype):
    keys = np.array([4, 5, 6], np.int64)
    request = ops.PullSparse.encode_request([(7, keys, dtype), (8, keys[:1])])
    decoded = _decode_request(request, ops.PullSparse)
    assert protocol.item_wire_dtypes(decoded.items) == [dtype, "float32"]
    rows = [np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), np.ones((1, 2), np.float32)]
    reply = ops.PullSparse.encode_reply(decoded.items, rows)
    assert reply.frames[1].dtype == np.uint16 and reply.frames[1].nbytes == 3 * 4 * 2
    assert reply.frames[2] is rows[1]  # float32 rows go uncopied, as before
    header = Header(op=int(Op.PULL_SPARSE), num_items=2)
    frames = [bytes(np.ascontiguousarray(f).data) for f in reply.frames]
    got = ops.PullSparse.decode_reply(header, frames, [(7, 3, dtype), (8, 1)])
    assert got[0].dtype == np.uint16 and got[0].shape == (3, 4)
    np.testing.assert_array_equal(reference_widen(got[0], dtype), rounded(rows[0], dtype))
    with pytest.raises(errors.ProtocolError, match=f"came as {dtype}, asked for float32"):
        ops.PullSparse.decode_reply(header, frames, [(7, 3), (8, 1)])


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_push_codec_sends_16_bit_rows_and_the_server_side_widens_them(dtype):
    rows = np.array([[0.1, -2.5, 70000.0], [1e-6, 3.0, -0.0]], np.float32)
    entries = [
        ops.SparsePush(7, np.array([1, 2], np.int64), _core.narrow(rows, dtype), True, dtype),
        ops.SparsePush(8, np.array([9], np.int64), rows[:1], True),
    ]
    request = ops.PushSparse.encode_request(entries)
    assert request.frames[0]["flags"].tolist() == [
        ITEM_FLAG_STEP | protocol.item_dtype_flags(dtype),
        ITEM_FLAG_STEP,
    ]
    decoded = _decode_request(request, ops.PushSparse)
    first, second = decoded.entries
    assert first.rows.dtype == np.float32 and first.wire_dtype == dtype
    np.testing.assert_array_equal(first.rows, rounded(rows, dtype))
    np.testing.assert_array_equal(second.rows, rows[:1])
    with pytest.raises(errors.DTypeError, match="uint16"):
        ops.PushSparse.encode_request([(7, np.array([1], np.int64), rows[:1], True, dtype)])


def test_float32_messages_are_unchanged_and_bad_codes_refused():
    keys, rows = np.array([1, 2], np.int64), np.ones((2, 4), np.float32)
    # A float32 item's flags are those from before half-precision wire dtypes existed.
    push = ops.PushSparse.encode_request([(5, keys, rows, True)])
    assert push.frames[0].tolist() == [(5, 2, 4, ITEM_FLAG_STEP)]
    pull = ops.PullSparse.encode_request([(5, keys)])
    assert pull.frames[0].tolist() == [(5, 2, 0, 0)]
    header = Header(op=int(Op.PUSH_SPARSE), num_items=1, num_frames=3)
    unknown = protocol.make_items([(5, 2, 4, 3 << protocol.ITEM_DTYPE_SHIFT)]).tobytes()
    with pytest.raises(errors.ProtocolError, match="unknown row dtype code 3"):
        ops.PushSparse.decode_request(header, [unknown, keys.tobytes(), b"\0" * 16])
    # Dense values always travel as float32.
    half = protocol.make_items([(5, 2, 0, protocol.item_dtype_flags("float16"))]).tobytes()
    for op, codec, frames in (
        (Op.PULL_DENSE, ops.PullDense, [half]),
        (Op.PUSH_DENSE, ops.PushDense, [half, b"\0" * 8]),
    ):
        header = Header(op=int(op), num_items=1, num_frames=len(frames))
        with pytest.raises(errors.ProtocolError, match="dense values travel as float32"):
            codec.decode_request(header, frames)


# -- real servers -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(module_server_factory):
    return module_server_factory(2)


def _store(servers, wire_dtype="float32"):
    return kvsparse.create(
        "dist_sparse", servers=servers, rank=0, num_workers=1, wire_dtype=wire_dtype
    )


def _raw_request(address, op, frames, num_items, request_id, client_id):
    """One hand-built request on a fresh DEALER socket -> (reply header, payload)."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(address)
        header = Header(
            op=int(op),
            request_id=request_id,
            client_id=client_id,
            num_items=num_items,
            num_frames=len(frames),
        )
        socket.send_multipart([header.pack(), *frames])
        assert socket.poll(10_000), "no reply from the server"
        return protocol.parse_message(socket.recv_multipart(), reply=True)
    finally:
        socket.close(0)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_a_server_refuses_a_malformed_16_bit_frame_and_serves_on(servers, dtype):
    key = f"malformed_{dtype}"
    with _store(servers) as kv:
        kv.init(key, kvsparse.SparseTable(dim=4, initializer=kvsparse.initializers.Zeros()))
        table_id = kv.key_info(key).table_id
        client_id = int.from_bytes(os.urandom(8), "little")
        hello = ops.Hello.encode_request(ops.HelloRequest(1, ops.Mode.BSP, None, 0, 2, 0))
        header, _ = _raw_request(servers[0], Op.HELLO, hello.frames, 0, 1, client_id)
        assert header.status == 0
        keys = np.array([1, 2], np.int64).tobytes()
        items = protocol.make_items([(table_id, 2, 4, protocol.item_dtype_flags(dtype))])
        for request_id, rows in ((2, b"\0" * 32), (3, b"\0" * 15)):  # float32-sized; odd
            header, payload = _raw_request(
                servers[0], Op.PUSH_SPARSE, [items.tobytes(), keys, rows], 1, request_id, client_id
            )
            assert header.status == protocol.ERROR_CODES[errors.ProtocolError]
            assert "expected 16 (8 x uint16)" in bytes(payload[0]).decode()
        # Nothing was applied, and the server goes on serving this client and the others.
        kv.set_optimizer(kvsparse.optimizers.SGD(learning_rate=1.0))
        kv.push(key, (np.array([1]), np.ones((1, 4), np.float32)))
        np.testing.assert_array_equal(
            kv.row_sparse_pull(key, row_ids=np.array([1, 2])), [[-1] * 4, [0] * 4]
        )


def _step_batches(seed, steps=3, batch=300, dim=8):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.zipf(1.3, batch).astype(np.int64) % 500
        grads = rng.standard_normal((batch, dim)) * rng.choice([1e-3, 1.0, 30.0], (batch, 1))
        yield ids, grads.astype(np.float32)


def _reference_push(reference: ReferenceTable, ids, grads, dtype):
    """The per-id float32 sums (input order, as the worker sums), rounded once to dtype."""
    unique, inverse = np.unique(ids, return_inverse=True)
    summed = np.zeros((unique.size, grads.shape[1]), np.float32)
    np.add.at(summed, inverse, grads)
    reference.apply_gradients(unique, rounded(summed, dtype))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_dist_sparse_with_a_16_bit_wire_matches_the_numpy_reference(servers, dtype, optimizer):
    key, dim = f"emb_{dtype}_{optimizer}", 8
    opt = (
        kvsparse.optimizers.SGD(learning_rate=0.1)
        if optimizer == "sgd"
        else kvsparse.optimizers.Adagrad(learning_rate=0.1)
    )
    table = kvsparse.SparseTable(dim=dim, initializer=_uniform(0.5), optimizer=opt, seed=3)
    reference = ReferenceTable(dim, table.to_dict()["initializer"], opt.to_dict(), seed=3)
    local = kvsparse.create("local", wire_dtype=dtype)
    local.init(key, table)
    probe = np.arange(-5, 520, dtype=np.int64)
    with _store(servers, dtype) as half, _store(servers) as exact:
        half.init(key, table)
        exact.init(key, table)  # the same spec: the servers' table, read in float32
        for ids, grads in _step_batches(seed=len(key)):
            pulled = half.row_sparse_pull(key, row_ids=ids)
            exact_rows = exact.row_sparse_pull(key, row_ids=ids)
            np.testing.assert_array_equal(pulled, rounded(exact_rows, dtype))
            np.testing.assert_array_equal(local.row_sparse_pull(key, row_ids=ids), pulled)
            half.push(key, (ids, grads))
            local.push(key, (ids, grads))
            _reference_push(reference, ids, grads, dtype)
        table_now = exact.row_sparse_pull(key, row_ids=probe)
        np.testing.assert_allclose(table_now, reference.lookup(probe), rtol=2e-6, atol=1e-7)
        # local, with the same option, holds the same table bit for bit.
        np.testing.assert_array_equal(
            half.row_sparse_pull(key, row_ids=probe), local.row_sparse_pull(key, row_ids=probe)
        )


def test_the_reference_tells_a_rounded_push_from_an_exact_one(servers):
    # The test above can fail: the same pushes without rounding give another table.
    dim, opt = 8, kvsparse.optimizers.SGD(learning_rate=0.1)
    table = kvsparse.SparseTable(dim=dim, initializer=_uniform(0.5), optimizer=opt, seed=3)
    rounded_ref = ReferenceTable(dim, table.to_dict()["initializer"], opt.to_dict(), seed=3)
    with _store(servers) as exact:
        exact.init("emb_exact", table)
        for ids, grads in _step_batches(seed=1):
            exact.push("emb_exact", (ids, grads))
            _reference_push(rounded_ref, ids, grads, "float16")
        probe = np.arange(0, 500, dtype=np.int64)
        got = exact.row_sparse_pull("emb_exact", row_ids=probe)
    assert not np.allclose(got, rounded_ref.lookup(probe), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_dense_keys_stay_float32_on_a_16_bit_store(servers, dtype):
    value = np.array([1.0 + 2.0**-20, 1e-9, 70000.5], np.float32)
    with _store(servers, dtype) as kv:
        kv.init(f"dense_{dtype}", value)
        np.testing.assert_array_equal(kv.pull(f"dense_{dtype}"), value)


def test_one_fused_request_carries_each_tables_own_wire_dtype(servers):
    names = {"fused_default": None, "fused_bf16": "bfloat16", "fused_f32": "float32"}
    ids = np.array([5, 6, 5, 123456789])
    grads = np.linspace(-3, 3, 4 * 6, dtype=np.float32).reshape(4, 6) / 7
    sgd = kvsparse.optimizers.SGD(learning_rate=1.0)
    with _store(servers, "float16") as kv, _store(servers) as exact:
        for name, wire in names.items():
            table = kvsparse.SparseTable(dim=6, initializer=_uniform(), optimizer=sgd, seed=9)
            kv.init(name, kvsparse.SparseTable(**{**vars(table), "wire_dtype": wire}))
            exact.init(name, table)
        keys = list(names)
        before = exact.row_sparse_pull(keys, row_ids=[ids] * 3)
        pulled = kv.row_sparse_pull(keys, row_ids=[ids] * 3)
        for got, want, wire in zip(pulled, before, ["float16", "bfloat16", "float32"]):
            np.testing.assert_array_equal(got, want if wire == "float32" else rounded(want, wire))
        kv.push(keys, [(ids, grads)] * 3)
        after = exact.row_sparse_pull(keys, row_ids=[ids] * 3)
        summed = grads.copy()
        summed[0] += grads[2]
        for got, old, wire in zip(after, before, ["float16", "bfloat16", "float32"]):
            step = summed if wire == "float32" else rounded(summed, wire)
            np.testing.assert_array_equal(got[[0, 1, 3]], old[[0, 1, 3]] - step[[0, 1, 3]])
