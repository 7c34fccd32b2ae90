"""Protocol Buffers messages read and written field by field (the wire format alone, no schema).

The runtime edits a serialized ONNX graph in a few fields (engines/attention.py) without the `onnx`
package, which only the export stage installs: a message is a run of fields, each a key (field number
and wire type) and a value, length-prefixed where it is a string or a nested message.
"""

from __future__ import annotations

from typing import Any


def varint(data: bytes, at: int) -> tuple[int, int]:
    """The base-128 integer at `at`, and where the next field begins."""
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7


def put_varint(value: int) -> bytes:
    """An unsigned integer in base-128 digits, least significant first (the high bit: more follow)."""
    out = bytearray()
    while True:
        if value < 0x80:
            out.append(value)
            return bytes(out)
        out.append(value & 0x7F | 0x80)
        value >>= 7


def fields(data: bytes) -> list[tuple[int, int, Any, bytes]]:
    """A message's fields in order: (number, wire type, value (int, or bytes of a length-delimited
    field), the field's own bytes)."""
    out: list[tuple[int, int, Any, bytes]] = []
    at = 0
    while at < len(data):
        start = at
        value: Any
        key, at = varint(data, at)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, at = varint(data, at)
        elif kind == 1:
            value, at = int.from_bytes(data[at:at + 8], "little"), at + 8
        elif kind == 2:
            n, at = varint(data, at)
            value, at = data[at:at + n], at + n
        elif kind == 5:
            value, at = int.from_bytes(data[at:at + 4], "little"), at + 4
        else:
            raise ValueError(f"protobuf wire type {kind} (groups or unknown) at byte {start}")
        out.append((number, kind, value, data[start:at]))
    return out


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (a string, or a nested message's bytes)."""
    return put_varint(number << 3 | 2) + put_varint(len(payload)) + payload


def int_field(number: int, value: int) -> bytes:
    """A varint field (an int64 that is not negative)."""
    return put_varint(number << 3) + put_varint(value)
