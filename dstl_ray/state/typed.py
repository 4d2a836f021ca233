"""The encoding of a typed state's values (:mod:`dstl_ray.state.schema`): compact bytes laid
out by the value's Arrow type, decoded back to the Python values Spark's Arrow conversion
gives (int, float, str, bytes, bool, ``datetime.date``, ``datetime.datetime``,
``decimal.Decimal``, lists, dicts for maps and for structs).

Layout, after a leading format byte ``0x01`` (a tagged value never starts with it, so bytes
of the wrong encoding fail loudly); little-endian::

    boolean 1 | tinyint/smallint/int/bigint 1/2/4/8 | float/double 4/8
    string/binary: varint length, bytes | date: i32 days since 1970-01-01
    timestamp, timestamp_ntz: i64 microseconds since the epoch (UTC)
    decimal(p,s): varint length, the unscaled integer (two's complement, big-endian)
    array: varint count, null bitmap, the non-null items
    map: varint count, the keys, null bitmap of the values, the non-null values
    struct: null bitmap of the fields, the non-null fields in order

A value that does not fit its type raises :class:`~dstl_ray.errors.InvalidValueError` naming
the type and what is wrong; malformed bytes raise :class:`~dstl_ray.errors.FormatError`.
"""

from __future__ import annotations

import datetime as dt
import decimal
import functools
import operator
import struct
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow as pa

from ..errors import FormatError, InvalidValueError
from .schema import to_ddl

MARK = b"\x01"
# an integer at the top of a typed state (a count, a sum), zigzag varint after this mark: a
# count of 7 is 2 bytes, not 9, and so is each change the changelog carries of it. Values
# under MARK (the fixed form) stay readable; varints are the same at every width, so int ->
# bigint evolution reads them as they are
MARK_VARINT = b"\x02"
_INT_BITS = {pa.int8(): 8, pa.int16(): 16, pa.int32(): 32, pa.int64(): 64}
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_EPOCH_DATE = dt.date(1970, 1, 1)
_FIXED = {pa.bool_(): "?", pa.int8(): "b", pa.int16(): "h", pa.int32(): "i", pa.int64(): "q",
          pa.float32(): "f", pa.float64(): "d"}

Enc = Callable[[Any, list[bytes]], None]
Dec = Callable[[memoryview, int], tuple[Any, int]]


def _varint(n: int, out: list[bytes]) -> None:
    b = bytearray()
    while n >= 0x80:
        b.append((n & 0x7F) | 0x80)
        n >>= 7
    b.append(n)
    out.append(bytes(b))


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise FormatError("truncated or malformed length in a typed state value")
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, pos
        shift += 7


def _bitmap(flags: list[bool]) -> bytes:
    out = bytearray((len(flags) + 7) // 8)
    for i, f in enumerate(flags):
        if f:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def _nulls(buf: memoryview, pos: int, n: int) -> tuple[list[bool], int]:
    size = (n + 7) // 8
    if pos + size > len(buf):
        raise FormatError("truncated null bitmap in a typed state value")
    return [bool(buf[pos + (i >> 3)] & (1 << (i & 7))) for i in range(n)], pos + size


def _present(buf: memoryview, pos: int, decs: list[tuple[Any, Dec]], null: list[bool]
             ) -> tuple[dict[Any, Any], int]:
    """{label: value} of a map's or struct's items, in order: None where ``null`` says so,
    else decoded by its decoder from ``pos`` on."""
    out: dict[Any, Any] = {}
    for (label, dec), isnull in zip(decs, null, strict=True):
        if isnull:
            out[label] = None
        else:
            out[label], pos = dec(buf, pos)
    return out, pos


def _bad(t: pa.DataType, v: Any, why: str = "") -> InvalidValueError:
    return InvalidValueError(f"{v!r} ({type(v).__name__}) is not a {to_ddl(t)}"
                             + (f": {why}" if why else ""))


def _date(t: pa.DataType) -> tuple[Enc, Dec]:
    i32 = struct.Struct("<i")

    def enc(v: Any, out: list[bytes]) -> None:
        if not isinstance(v, dt.date):
            raise _bad(t, v)
        d = v.date() if isinstance(v, dt.datetime) else v
        out.append(i32.pack((d - _EPOCH_DATE).days))

    def dec(buf: memoryview, pos: int) -> tuple[Any, int]:
        return _EPOCH_DATE + dt.timedelta(days=_unpack(i32.unpack_from, buf, pos, 4)), pos + 4
    return enc, dec


def _fixed(t: pa.DataType) -> tuple[Enc, Dec]:
    s = struct.Struct("<" + _FIXED[t])
    pack, unpack, size = s.pack, s.unpack_from, s.size
    floats = pa.types.is_floating(t)
    boolean = t == pa.bool_()

    def enc(v: Any, out: list[bytes]) -> None:
        try:
            if boolean:
                if not isinstance(v, (bool, int)) or v not in (0, 1):
                    raise _bad(t, v)
                out.append(pack(bool(v)))
            elif floats:
                if isinstance(v, (str, bytes, bool)):
                    raise _bad(t, v)
                out.append(pack(float(v)))
            else:
                if isinstance(v, bool):
                    raise _bad(t, v)
                out.append(pack(operator.index(v)))
        except (TypeError, ValueError, struct.error, OverflowError) as e:
            raise _bad(t, v, str(e)) from None

    def dec(buf: memoryview, pos: int) -> tuple[Any, int]:
        return _unpack(unpack, buf, pos, size), pos + size
    return enc, dec


def _unpack(unpack: Any, buf: memoryview, pos: int, size: int) -> Any:
    if pos + size > len(buf):
        raise FormatError("truncated typed state value")
    return unpack(buf, pos)[0]


def _bytes_like(t: pa.DataType) -> tuple[Enc, Dec]:
    text = t == pa.string()

    def enc(v: Any, out: list[bytes]) -> None:
        if text:
            if not isinstance(v, str):
                raise _bad(t, v)
            b = v.encode("utf-8")
        elif isinstance(v, (bytes, bytearray, memoryview)):
            b = bytes(v)
        else:
            raise _bad(t, v)
        _varint(len(b), out)
        out.append(b)

    def dec(buf: memoryview, pos: int) -> tuple[Any, int]:
        n, pos = _read_varint(buf, pos)
        if pos + n > len(buf):
            raise FormatError("truncated string or binary in a typed state value")
        raw = bytes(buf[pos:pos + n])
        try:
            return (raw.decode("utf-8") if text else raw), pos + n
        except UnicodeDecodeError as e:
            raise FormatError(f"a typed state's string is not UTF-8: {e}") from None
    return enc, dec


def _timestamp(t: pa.DataType) -> tuple[Enc, Dec]:
    q = struct.Struct("<q")
    aware = t.tz is not None

    def enc(v: Any, out: list[bytes]) -> None:
        if not isinstance(v, dt.datetime):
            raise _bad(t, v)
        if v.tzinfo is None:
            v = v.replace(tzinfo=dt.UTC)  # naive: UTC (as Spark's TimestampNTZ is read)
        d = v - _EPOCH
        out.append(q.pack((d.days * 86_400 + d.seconds) * 1_000_000 + d.microseconds))

    def dec(buf: memoryview, pos: int) -> tuple[Any, int]:
        us = _unpack(q.unpack_from, buf, pos, 8)
        when = _EPOCH + dt.timedelta(microseconds=us)
        return (when if aware else when.replace(tzinfo=None)), pos + 8
    return enc, dec


def _decimal(t: pa.DataType) -> tuple[Enc, Dec]:
    scale, precision = t.scale, t.precision
    quantum = decimal.Decimal(1).scaleb(-scale)
    ctx = decimal.Context(prec=80, rounding=decimal.ROUND_HALF_UP)

    def enc(v: Any, out: list[bytes]) -> None:
        if isinstance(v, bool) or not isinstance(v, (decimal.Decimal, int)):
            raise _bad(t, v)
        d = decimal.Decimal(v)
        if not d.is_finite():
            raise _bad(t, v, "not finite")
        try:
            unscaled = int(d.quantize(quantum, context=ctx).scaleb(scale, context=ctx))
        except decimal.InvalidOperation:
            raise _bad(t, v, f"more than {precision} digits") from None
        if len(str(abs(unscaled))) > precision:
            raise _bad(t, v, f"more than {precision} digits")
        b = unscaled.to_bytes((unscaled.bit_length() + 8) // 8, "big", signed=True)
        _varint(len(b), out)
        out.append(b)

    def dec(buf: memoryview, pos: int) -> tuple[Any, int]:
        n, pos = _read_varint(buf, pos)
        if pos + n > len(buf):
            raise FormatError("truncated decimal in a typed state value")
        unscaled = int.from_bytes(buf[pos:pos + n], "big", signed=True)
        return decimal.Decimal(unscaled).scaleb(-scale, context=ctx), pos + n
    return enc, dec


def _list(t: pa.DataType) -> tuple[Enc, Dec]:
    ienc, idec = codec_parts(t.value_type)

    def enc(v: Any, out: list[bytes]) -> None:
        if isinstance(v, (str, bytes, Mapping)) or not hasattr(v, "__iter__"):
            raise _bad(t, v)
        items = list(v)
        _varint(len(items), out)
        out.append(_bitmap([x is None for x in items]))
        for x in items:
            if x is not None:
                ienc(x, out)

    def dec(buf: memoryview, pos: int) -> tuple[Any, int]:
        n, pos = _read_varint(buf, pos)
        null, pos = _nulls(buf, pos, n)
        items = []
        for isnull in null:
            if isnull:
                items.append(None)
            else:
                x, pos = idec(buf, pos)
                items.append(x)
        return items, pos
    return enc, dec


def _map(t: pa.DataType) -> tuple[Enc, Dec]:
    kenc, kdec = codec_parts(t.key_type)
    venc, vdec = codec_parts(t.item_type)

    def enc(v: Any, out: list[bytes]) -> None:
        if isinstance(v, Mapping):
            pairs = list(v.items())
        elif isinstance(v, (list, tuple)) and all(
                isinstance(p, (list, tuple)) and len(p) == 2 for p in v):
            pairs = [tuple(p) for p in v]  # as Arrow gives a map: its (key, value) pairs
        else:
            raise _bad(t, v, "a map is a dict (or a list of key, value pairs)")
        _varint(len(pairs), out)
        for k, _ in pairs:
            if k is None:
                raise _bad(t, v, "a map key is None")
            kenc(k, out)
        out.append(_bitmap([x is None for _, x in pairs]))
        for _, x in pairs:
            if x is not None:
                venc(x, out)

    def dec(buf: memoryview, pos: int) -> tuple[Any, int]:
        n, pos = _read_varint(buf, pos)
        keys = []
        for _ in range(n):
            k, pos = kdec(buf, pos)
            keys.append(k)
        null, pos = _nulls(buf, pos, n)
        return _present(buf, pos, [(k, vdec) for k in keys], null)
    return enc, dec


def _struct(t: pa.DataType) -> tuple[Enc, Dec]:
    fields = [(f.name, f.nullable, *codec_parts(f.type)) for f in t]
    names = [f[0] for f in fields]
    known = set(names)

    def enc(v: Any, out: list[bytes]) -> None:
        if hasattr(v, "asDict") and not isinstance(v, Mapping):
            v = v.asDict()  # a pyspark Row
        if isinstance(v, Mapping):
            extra = set(v) - known
            if extra:
                raise _bad(t, v, f"no field {sorted(map(str, extra))[0]!r}")
            vals = [v.get(n) for n in names]
        elif isinstance(v, (tuple, list)) and len(v) == len(names):
            vals = list(v)
        else:
            raise _bad(t, v, f"a struct is a dict of {names} (or a tuple of them)")
        for (name, nullable, *_), x in zip(fields, vals, strict=True):
            if x is None and not nullable:
                raise _bad(t, v, f"field {name!r} is NOT NULL")
        out.append(_bitmap([x is None for x in vals]))
        for (_n, _nl, fenc, _d), x in zip(fields, vals, strict=True):
            if x is not None:
                fenc(x, out)

    decs = [(name, fdec) for name, _nl, _e, fdec in fields]

    def dec(buf: memoryview, pos: int) -> tuple[Any, int]:
        null, pos = _nulls(buf, pos, len(fields))
        return _present(buf, pos, decs, null)
    return enc, dec


def codec_parts(t: pa.DataType) -> tuple[Enc, Dec]:
    """The encoder and decoder of a normalized type (:func:`~dstl_ray.state.schema.normalize`)."""
    if t in _FIXED:
        return _fixed(t)
    if t == pa.date32():
        return _date(t)
    if t in (pa.string(), pa.binary()):
        return _bytes_like(t)
    if pa.types.is_timestamp(t):
        return _timestamp(t)
    if pa.types.is_decimal(t):
        return _decimal(t)
    if pa.types.is_list(t):
        return _list(t)
    if pa.types.is_map(t):
        return _map(t)
    if pa.types.is_struct(t):
        return _struct(t)
    raise InvalidValueError(f"no encoding for type {t}")


@functools.lru_cache(maxsize=256)
def serializer_for(ddl: str) -> TypedSerializer:
    """The (shared, stateless) serializer of a canonical DDL type."""
    from .schema import parse_schema

    return TypedSerializer(parse_schema(ddl))


_SHORT = [MARK + bytes((n,)) for n in range(0x80)]  # the mark and a one-byte length


class TypedSerializer:
    """:class:`~dstl_ray.state.records.Serializer` of one declared type: ``serialize`` and
    ``deserialize`` of values (never None: a typed state stores no null at the top)."""

    def __init__(self, t: pa.DataType) -> None:
        self.type = t
        self.ddl = to_ddl(t)
        self._enc, self._dec = codec_parts(t)
        # a number at the top (a count, a sum), of exactly the type's Python kind (the
        # per-key API's hot path): an integer as a varint (MARK_VARINT), a float as the mark
        # and the value in one struct (the general path's bytes); everything else takes the
        # general path, which names what is wrong
        code = _FIXED.get(t) if pa.types.is_floating(t) else None
        self._whole = struct.Struct("<c" + code) if code else None
        bits = _INT_BITS.get(t)
        self._range = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if bits else None
        # bytes or a str at the top (a payload, a name: the vectorized API's column sets):
        # the general path's bytes without its calls when the length is one varint byte
        self._plain = bytes if t == pa.binary() else str if t == pa.string() else None

    def serialize(self, value: Any) -> bytes:
        plain = self._plain
        if plain is not None and type(value) is plain:
            b = value if plain is bytes else value.encode("utf-8")
            if len(b) < 0x80:
                return _SHORT[len(b)] + b
        whole, rng = self._whole, self._range
        if rng is not None and type(value) is int and rng[0] <= value <= rng[1]:
            # (inline, not _varint: a call and a join cost this path ~4% of its rate)
            z = value << 1 if value >= 0 else ((-value) << 1) - 1  # zigzag
            out = bytearray(MARK_VARINT)
            while z >= 0x80:
                out.append((z & 0x7F) | 0x80)
                z >>= 7
            out.append(z)
            return bytes(out)
        if whole is not None and type(value) is float:
            return whole.pack(MARK, value)
        if value is None:
            raise InvalidValueError(f"a {self.ddl} state stores no None (clear the key)")
        out = [MARK]
        self._enc(value, out)
        return b"".join(out)

    def deserialize(self, data: bytes) -> Any:
        whole, rng = self._whole, self._range
        if rng is not None and data[:1] == MARK_VARINT:
            return self._varint_value(data, rng)
        if whole is not None and len(data) == whole.size and data[:1] == MARK:
            return whole.unpack(data)[1]
        buf = memoryview(data)
        if buf[:1] != MARK:
            raise FormatError(f"a {self.ddl} state value does not start with the typed "
                              f"encoding's mark (written by another encoding?)")
        try:
            value, pos = self._dec(buf, 1)
        except (struct.error, IndexError, ValueError, OverflowError) as e:
            raise FormatError(f"malformed {self.ddl} state value: {e}") from None
        if pos != len(buf):
            raise FormatError(f"malformed {self.ddl} state value: {len(buf) - pos} bytes "
                              f"after the value")
        return value

    def _varint_value(self, data: bytes, rng: tuple[int, int]) -> int:
        """An integer written under :data:`MARK_VARINT`, checked against this type's range
        (a value too wide for it, or trailing bytes, is a corrupt value, not a number)."""
        z, pos = _read_varint(memoryview(data), 1)
        if pos != len(data):
            raise FormatError(f"malformed {self.ddl} state value: {len(data) - pos} bytes "
                              f"after the value")
        value = (z >> 1) ^ -(z & 1)
        if not rng[0] <= value <= rng[1]:
            raise FormatError(f"malformed {self.ddl} state value: {value} is out of its range")
        return value
