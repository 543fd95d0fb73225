"""Writes csrc/wire_constants.h, the C++ side of the wire layout, from `kvsparse.wire.protocol`.

The Python definitions (the header `struct` format, the item dtype, op codes, flags,
row dtype codes, limits, error codes) are the one source of truth; the C++ fast path
(csrc/serve_loop.cc) reads the generated header and declares none of these by hand.
The generated file is committed, so a build needs no Python step; tests/test_wire_constants.py
fails when regenerating it would change it, and when the compiled module's values
(`kvsparse._core.wire_constants()`) differ from Python's.

Adding a header flag: define ``FLAG_X`` in protocol.py and add it to ``KNOWN_FLAGS``, then
run::

    python -m kvsparse.wire.generate_cpp          # rewrites csrc/wire_constants.h
    python -m kvsparse.wire.generate_cpp --check  # exit status 1 if it is stale

Pure functions over immutable constants: safe to call from any thread.
"""

from __future__ import annotations

import argparse
import pathlib
import struct
import sys
from typing import NamedTuple

from kvsparse.wire import protocol

HEADER_PATH = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "wire_constants.h"

# The header's fields in `protocol.HEADER` order: the magic and version, then `Header`'s.
HEADER_FIELDS = ("magic", "version", *protocol.Header._fields)


class Constant(NamedTuple):
    """One integer constant of the generated header.

    python: the name `kvsparse._core.wire_constants()` reports it under (the Python
    name, ``Op.PULL_SPARSE`` style for enum members); cpp: its C++ name; ctype: its type.
    """

    python: str
    cpp: str
    ctype: str
    value: int


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.lower().split("_"))


def _field_layout(fmt: str, names: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """(name, offset, size) of each field of a `struct` format without padding."""
    # "4s" is one field: a repeat count belongs to the code after it.
    fields: list[str] = []
    number = ""
    for char in fmt.lstrip("<"):
        if char.isdigit():
            number += char
        else:
            fields.append(number + char)
            number = ""
    if len(fields) != len(names):
        raise ValueError(f"{len(fields)} fields in {fmt!r}, {len(names)} names: {names}")
    layout = []
    offset = 0
    for name, code in zip(names, fields, strict=True):
        size = struct.calcsize("<" + code)
        layout.append((name, offset, size))
        offset += size
    return layout


def constants() -> list[Constant]:
    """Every integer wire constant the C++ side gets, read from `kvsparse.wire.protocol`.

    Example:
        >>> {c.cpp: c.value for c in constants()}["kHeaderSize"]
        56
    """
    p = protocol
    out = [
        Constant("VERSION", "kWireVersion", "uint16_t", p.VERSION),
        Constant("HEADER_SIZE", "kHeaderSize", "size_t", p.HEADER_SIZE),
    ]
    for name, offset, size in _field_layout(p.HEADER.format, HEADER_FIELDS):
        field = _camel(name)
        out.append(Constant(f"HEADER.{name}.offset", f"kHeader{field}Offset", "size_t", offset))
        out.append(Constant(f"HEADER.{name}.size", f"kHeader{field}Bytes", "size_t", size))
    out.append(Constant("ITEM_DTYPE.itemsize", "kItemSize", "size_t", p.ITEM_DTYPE.itemsize))
    for name in p.ITEM_DTYPE.names:
        dtype, offset = p.ITEM_DTYPE.fields[name][:2]
        field = _camel(name)
        out.append(Constant(f"ITEM_DTYPE.{name}.offset", f"kItem{field}Offset", "size_t", offset))
        out.append(
            Constant(f"ITEM_DTYPE.{name}.size", f"kItem{field}Bytes", "size_t", dtype.itemsize)
        )
    for op in p.Op:
        out.append(Constant(f"Op.{op.name}", f"kOp{_camel(op.name)}", "uint16_t", int(op)))
    flags = sorted(
        (name for name in vars(p) if name.startswith("FLAG_")), key=lambda n: getattr(p, n)
    )
    for name in flags:
        out.append(Constant(name, f"k{_camel(name)}", "uint32_t", getattr(p, name)))
    out.append(Constant("KNOWN_FLAGS", "kKnownFlags", "uint32_t", p.KNOWN_FLAGS))
    for name in ("ITEM_FLAG_STEP", "ITEM_DTYPE_SHIFT", "ITEM_DTYPE_MASK", "KNOWN_ITEM_FLAGS"):
        out.append(Constant(name, f"k{_camel(name)}", "uint32_t", getattr(p, name)))
    for dtype_name, code in sorted(p.WIRE_DTYPE_CODES.items(), key=lambda item: item[1]):
        out.append(
            Constant(
                f"WIRE_DTYPE_CODES.{dtype_name}",
                f"kWireDtype{_camel(dtype_name)}",
                "uint32_t",
                code,
            )
        )
    out.append(
        Constant(
            "max(WIRE_DTYPE_CODES)",
            "kMaxWireDtypeCode",
            "uint32_t",
            max(p.WIRE_DTYPE_CODES.values()),
        )
    )
    out.append(Constant("MAX_ITEMS", "kMaxItems", "uint32_t", p.MAX_ITEMS))
    out.append(Constant("MAX_FRAMES", "kMaxFrames", "uint32_t", p.MAX_FRAMES))
    out.append(Constant("MAX_DIM", "kWireMaxDim", "int32_t", p.MAX_DIM))
    for cls, code in sorted(p.ERROR_CODES.items(), key=lambda item: item[1]):
        out.append(
            Constant(f"ERROR_CODES.{cls.__name__}", f"kError{cls.__name__}", "uint32_t", code)
        )
    return out


def render() -> str:
    """The text of csrc/wire_constants.h for the current Python definitions."""
    magic = protocol.MAGIC.decode("ascii")
    lines = [
        "// GENERATED by `python -m kvsparse.wire.generate_cpp` from kvsparse/wire/protocol.py:",
        "// do not edit. The wire layout's one source of truth is the Python module; this",
        "// header gives the C++ fast path (serve_loop.cc) the same values, and",
        "// tests/test_wire_constants.py fails when it is stale or the build disagrees.",
        "// Constants only: safe to use from any thread.",
        "#ifndef KVSPARSE_WIRE_CONSTANTS_H_",
        "#define KVSPARSE_WIRE_CONSTANTS_H_",
        "",
        "#include <cstddef>",
        "#include <cstdint>",
        "",
        "namespace kvsparse {",
        "namespace wire {",
        "",
        f'constexpr char kWireMagic[] = "{magic}";',
        f"constexpr size_t kWireMagicSize = {len(protocol.MAGIC)};",
    ]
    for c in constants():
        lines.append(f"constexpr {c.ctype} {c.cpp} = {c.value};")
    lines += [
        "",
        "// Every constant above by its Python name, for kvsparse._core.wire_constants().",
        "struct WireConstant {",
        "  const char* name;",
        "  int64_t value;",
        "};",
        "constexpr WireConstant kWireConstants[] = {",
    ]
    for c in constants():
        lines.append(f'    {{"{c.python}", static_cast<int64_t>({c.cpp})}},')
    lines += [
        "};",
        "constexpr int kWireConstantCount = sizeof(kWireConstants) / sizeof(kWireConstants[0]);",
        "",
        "}  // namespace wire",
        "}  // namespace kvsparse",
        "",
        "#endif  // KVSPARSE_WIRE_CONSTANTS_H_",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Writes (or with --check, compares) csrc/wire_constants.h; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the header is stale")
    parser.add_argument("--path", type=pathlib.Path, default=HEADER_PATH)
    args = parser.parse_args(argv)
    text = render()
    current = args.path.read_text() if args.path.exists() else None
    if args.check:
        if current != text:
            print(
                f"{args.path} is stale: run python -m kvsparse.wire.generate_cpp", file=sys.stderr
            )
            return 1
        return 0
    if current != text:
        args.path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
