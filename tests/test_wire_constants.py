"""The wire layout has one source of truth: kvsparse/wire/protocol.py.

The C++ fast path (csrc/serve_loop.cc) takes every wire constant from csrc/wire_constants.h,
which kvsparse/wire/generate_cpp.py writes from the Python definitions. These tests fail when
the committed header is stale, when the compiled module was built with other values, and when
a wire constant is declared by hand in csrc/ again.
"""

from __future__ import annotations

import pathlib
import re

import numpy as np

from kvsparse import _core
from kvsparse.wire import generate_cpp, protocol

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"


def test_the_committed_header_is_what_protocol_py_generates():
    assert generate_cpp.HEADER_PATH.read_text() == generate_cpp.render(), (
        "csrc/wire_constants.h is stale: run python -m kvsparse.wire.generate_cpp and rebuild"
    )


def test_the_compiled_fast_path_has_pythons_wire_constants():
    compiled = _core.wire_constants()
    expected = {"MAGIC": protocol.MAGIC}
    expected.update({c.python: c.value for c in generate_cpp.constants()})
    differing = {
        name: (compiled.get(name), expected.get(name))
        for name in compiled.keys() | expected.keys()
        if compiled.get(name) != expected.get(name)
    }
    assert not differing, f"C++ and Python disagree (C++, Python): {differing}"


def test_every_python_wire_constant_reaches_the_cpp_side():
    compiled = _core.wire_constants()
    assert compiled["MAGIC"] == protocol.MAGIC
    assert compiled["VERSION"] == protocol.VERSION
    assert compiled["HEADER_SIZE"] == protocol.HEADER.size == protocol.HEADER_SIZE
    assert compiled["ITEM_DTYPE.itemsize"] == protocol.ITEM_DTYPE.itemsize
    for op in protocol.Op:
        assert compiled[f"Op.{op.name}"] == int(op)
    for name in dir(protocol):
        if name.startswith("FLAG_") or name in (
            "KNOWN_FLAGS",
            "ITEM_FLAG_STEP",
            "ITEM_DTYPE_SHIFT",
            "ITEM_DTYPE_MASK",
            "KNOWN_ITEM_FLAGS",
            "MAX_ITEMS",
            "MAX_FRAMES",
            "MAX_DIM",
        ):
            assert compiled[name] == getattr(protocol, name), name
    for dtype_name, code in protocol.WIRE_DTYPE_CODES.items():
        assert compiled[f"WIRE_DTYPE_CODES.{dtype_name}"] == code
    for cls, code in protocol.ERROR_CODES.items():
        assert compiled[f"ERROR_CODES.{cls.__name__}"] == code


def test_the_cpp_header_offsets_read_the_fields_python_packs():
    # Distinct values in every field, read back at the offsets and widths the C++ side uses.
    header = protocol.Header(
        op=7,
        flags=4,
        status=3,
        request_id=0x0102030405060708,
        client_id=0x1112131415161718,
        rank=-5,
        num_items=9,
        clock=1 << 40,
        num_frames=11,
        incarnation=0xDEADBEEF,
    )
    frame = header.pack()
    compiled = _core.wire_constants()
    signed = {"rank", "clock"}
    read = {}
    for name in generate_cpp.HEADER_FIELDS:
        offset = compiled[f"HEADER.{name}.offset"]
        size = compiled[f"HEADER.{name}.size"]
        raw = frame[offset : offset + size]
        read[name] = (
            raw if name == "magic" else int.from_bytes(raw, "little", signed=name in signed)
        )
    assert read == {"magic": protocol.MAGIC, "version": protocol.VERSION, **header._asdict()}
    items = np.zeros(1, protocol.ITEM_DTYPE)
    items[0] = (0xA1A2A3A4A5A6A7A8, -123456789, 64, 0x0201)
    raw = items.tobytes()
    for name, expected in zip(protocol.ITEM_DTYPE.names, items[0].tolist(), strict=True):
        offset = compiled[f"ITEM_DTYPE.{name}.offset"]
        size = compiled[f"ITEM_DTYPE.{name}.size"]
        signed_field = protocol.ITEM_DTYPE.fields[name][0].kind == "i"
        value = int.from_bytes(raw[offset : offset + size], "little", signed=signed_field)
        assert value == expected, name


def test_no_wire_constant_is_declared_by_hand_in_csrc():
    # A hand-written copy is what drifted before: only the generated header may declare these.
    declared = re.compile(
        r"constexpr\s+\w+\s+k(?:HeaderSize|ItemSize|Version|WireVersion|Op[A-Z]\w*|Flag[A-Z]\w*"
        r"|KnownFlags|KnownItemFlags|ItemFlag\w*|ItemDtype\w*|MaxItems|MaxFrames|MaxWireDim"
        r"|MaxDtypeCode|Error[A-Z]\w*)\s*="
    )
    offenders = []
    for path in sorted(CSRC.glob("*.[ch]*")):
        if path.name == "wire_constants.h":
            continue
        text = path.read_text()
        offenders += [f"{path.name}: {m.group(0)}" for m in declared.finditer(text)]
        if '"KVSP"' in text:
            offenders.append(f"{path.name}: the magic as a literal")
    assert not offenders, offenders


def test_the_generator_check_mode_tells_a_stale_header(tmp_path):
    path = tmp_path / "wire_constants.h"
    path.write_text(generate_cpp.render().replace("kFlagShared = 4", "kFlagShared = 8"))
    assert generate_cpp.main(["--check", "--path", str(path)]) == 1
    assert generate_cpp.main(["--path", str(path)]) == 0
    assert path.read_text() == generate_cpp.render()
    assert generate_cpp.main(["--check", "--path", str(path)]) == 0
