"""Hypothesis strategies read from protobuf descriptors: any message of any proto, and the bytes a
client could put on the wire for it (valid, or malformed: truncated, bit-flipped, strings that are
not UTF-8, unknown fields, noise).

    messages(pb.GenerateRequest.DESCRIPTOR, hints)  -> strategy of GenerateRequest
    wire(pb.GenerateRequest.DESCRIPTOR, hints)      -> strategy of bytes

Every field is drawn from its type's whole range (the edges of int32/uint64, NaN and infinities,
unknown enum numbers) mixed with small, plausible values so that requests also get past
validation; `hints` (field or message full name -> strategy) adds values a field's meaning makes
likely (a served model's name, a chat role) or whole plausible messages, on top of the type's
range, never instead of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

Hints = Mapping[str, st.SearchStrategy[Any]]
F = FieldDescriptor
_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1), F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}
MAX_REPEATED = 8
MAX_DEPTH = 4


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (lo, hi, -1, 0, 1, -(2**31), 2**31 - 1, 2**32 - 1, -(2**63), 2**63 - 1)
                    if lo <= v <= hi})
    return st.one_of(st.integers(max(lo, -4), min(hi, 64)), st.integers(lo, hi), st.sampled_from(edges))


def _floats(single: bool) -> st.SearchStrategy[float]:
    width = 32 if single else 64
    return st.one_of(st.floats(-2.0, 2.0), st.floats(width=width),
                     st.sampled_from([0.0, -0.0, 5e-324 if not single else 1e-45, 1e-300 if not single else 1e-38]))


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """A value of `field`'s scalar type, anywhere in its range."""
    t = field.type
    if t in _INT_RANGES:
        return _integers(*_INT_RANGES[t])
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return _floats(t == F.TYPE_FLOAT)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return st.text(max_size=64)
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_ENUM:  # proto3 enums are open: a number nobody declared must be handled too
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), _integers(-(2**31), 2**31 - 1))
    raise TypeError(f"field {field.full_name}: unknown type {t}")


def _value(field: FieldDescriptor, hints: Hints, depth: int) -> st.SearchStrategy[Any]:
    base = messages(field.message_type, hints, depth + 1) if field.type == F.TYPE_MESSAGE else scalar(field)
    hint = hints.get(field.full_name)
    return base if hint is None else st.one_of(hint, base)


def _is_repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


@st.composite
def _message(draw: st.DrawFn, descriptor: Descriptor, hints: Hints, depth: int) -> Message:
    msg = GetMessageClass(descriptor)()
    for field in descriptor.fields:
        if depth >= MAX_DEPTH and field.type == F.TYPE_MESSAGE:
            continue
        if draw(st.integers(0, 2)):  # unset, 2 in 3 (a proto3 optional stays absent, a scalar its default)
            continue
        if _is_map(field):  # map<K, V>: a repeated entry message on the wire, a dict in Python
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            entries = draw(st.dictionaries(_value(key, hints, depth), _value(value, hints, depth), max_size=MAX_REPEATED))
            getattr(msg, field.name).update(entries)
        elif _is_repeated(field):
            values = draw(st.lists(_value(field, hints, depth), max_size=MAX_REPEATED))
            target = getattr(msg, field.name)
            if field.type == F.TYPE_MESSAGE:
                for v in values:
                    target.add().CopyFrom(v)
            else:
                target.extend(values)
        elif field.type == F.TYPE_MESSAGE:
            getattr(msg, field.name).CopyFrom(draw(_value(field, hints, depth)))
        else:
            setattr(msg, field.name, draw(_value(field, hints, depth)))
    return msg


def messages(descriptor: Descriptor, hints: Hints | None = None, depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of type `descriptor`, each field set or not, values over the type's range (and,
    when `hints` names the message type itself, also the hint's messages)."""
    hints = hints or {}
    generic = _message(descriptor, hints, depth)
    hint = hints.get(descriptor.full_name)
    return generic if hint is None else st.one_of(hint, generic)


# ---------------------------------------------------------------------- the wire

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _string_fields(descriptor: Descriptor) -> list[int]:
    return [f.number for f in descriptor.fields if f.type == F.TYPE_STRING]


@st.composite
def _malformed(draw: st.DrawFn, valid: bytes, descriptor: Descriptor) -> bytes:
    """`valid` broken one way: cut short, a byte flipped, a non-UTF-8 string, an unknown field,
    a length that runs past the end, or noise."""
    kind = draw(st.sampled_from(["truncate", "flip", "bad_utf8", "unknown_field", "overlong", "noise"]))
    if kind == "truncate" and valid:
        return valid[:draw(st.integers(0, len(valid) - 1))]
    if kind == "flip" and valid:
        i = draw(st.integers(0, len(valid) - 1))
        return valid[:i] + bytes([valid[i] ^ (1 << draw(st.integers(0, 7)))]) + valid[i + 1:]
    if kind == "bad_utf8" and _string_fields(descriptor):
        number = draw(st.sampled_from(_string_fields(descriptor)))
        return valid + _length_delimited(number, draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80",
                                                                      b"ok\xf0\x28\x8c\x28"])))
    if kind == "unknown_field":
        return valid + _length_delimited(draw(st.integers(100, 2**29 - 1)), draw(st.binary(max_size=16)))
    if kind == "overlong":
        return valid + _varint(1 << 3 | 2) + _varint(draw(st.integers(1, 2**32)))
    return draw(st.binary(max_size=128))


def wire(descriptor: Descriptor, hints: Hints | None = None) -> st.SearchStrategy[bytes]:
    """Bytes for a request of type `descriptor`: a serialized message, or one made malformed."""
    valid = messages(descriptor, hints).map(lambda m: m.SerializeToString())
    return st.one_of(valid, valid, valid.flatmap(lambda b: _malformed(b, descriptor)))
