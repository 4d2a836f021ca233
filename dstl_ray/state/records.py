"""Keyed state descriptors, the value serializer and the state change record format.

FLIP-158 "StateBackend / Tracking the changes": every change made through ValueState,
ListState or MapState is applied to the backend's tables AND appended to the changelog as a
record. "File contents layout": changes are serialized by the backend and opaque to the
changelog. The same records, restricted to "set" operations, form materialized state files
(a materialization is a compacted changelog), so recovery applies one format.

Record format, version 1 (stable, little-endian, never pickle)::

    u8 version=1 | u8 op | u16 state id | u32 key length | key bytes
    [ u32 user-key length | user-key bytes ]        (MAP_PUT, MAP_REMOVE only)
    [ value bytes to the end of the record ]         (VALUE_SET, LIST_ADD, MAP_PUT)
    [ u32 length | item ... to the end ]             (LIST_SET: the whole list)

Values of a state with a TTL carry an 8-byte write timestamp before the serialized value
(:mod:`dstl_ray.state.ttl`); the record layout is the same.

Keys and values are bytes produced by a pluggable :class:`Serializer`; the default
:class:`TaggedSerializer` is a simple, safe tagged binary encoding of None, bool, int, float,
str, bytes, lists (tuples decode as lists) and dicts.
"""

from __future__ import annotations

import enum
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..errors import FormatError, StateError
from ..format.materialized import StateKind
from .ttl import STAMP_SIZE, StateTtlConfig

RECORD_VERSION = 1
HDR = struct.Struct("<BBHI")
U32 = struct.Struct("<I")
_F64 = struct.Struct("<d")
_INT = re.compile(rb"0|-?[1-9][0-9]*")  # as str(int) writes it: no sign on 0, no leading zeros
MAX_DEPTH = 100  # lists/dicts nested in one TaggedSerializer value (bounds decoding recursion)


class Op(enum.IntEnum):
    VALUE_SET = 1
    VALUE_CLEAR = 2
    LIST_ADD = 3
    LIST_SET = 4
    LIST_CLEAR = 5
    MAP_PUT = 6
    MAP_REMOVE = 7
    MAP_CLEAR = 8


@dataclass(frozen=True)
class StateDescriptor:
    """Names one keyed state of a backend (Flink's StateDescriptor). ``ttl`` (seconds or a
    :class:`~dstl_ray.state.ttl.StateTtlConfig`; Flink's ``enableTimeToLive``) lets its
    entries expire (:mod:`dstl_ray.state.ttl`); None keeps them until cleared. ``schema``
    (a Spark DDL string or a pyarrow type, :mod:`dstl_ray.state.schema`) declares the type
    of its values (a list's elements, a map's values); None leaves them untyped
    (:class:`TaggedSerializer`), or keeps the type a restored state has."""

    name: str
    kind: StateKind
    ttl: StateTtlConfig | None = None
    schema: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > 200:
            raise StateError(f"state name must be a non-empty str of <= 200 chars, "
                             f"got {self.name!r}")
        object.__setattr__(self, "kind", StateKind(self.kind))
        object.__setattr__(self, "ttl", StateTtlConfig.of(self.ttl))
        if self.schema is not None:  # canonical DDL from here on
            from .schema import canonical  # (pyarrow: loaded only where types are declared)

            object.__setattr__(self, "schema",
                               canonical(self.schema, f"schema of state {self.name!r}"))


def ValueStateDescriptor(name: str, ttl: StateTtlConfig | float | None = None,  # noqa: N802
                         schema: Any = None
                         ) -> StateDescriptor:  # Flink's name
    return StateDescriptor(name, StateKind.VALUE, ttl, schema)  # type: ignore[arg-type]


def ListStateDescriptor(name: str, ttl: StateTtlConfig | float | None = None,  # noqa: N802
                        schema: Any = None
                        ) -> StateDescriptor:
    return StateDescriptor(name, StateKind.LIST, ttl, schema)  # type: ignore[arg-type]


def MapStateDescriptor(name: str, ttl: StateTtlConfig | float | None = None,  # noqa: N802
                       schema: Any = None
                       ) -> StateDescriptor:
    return StateDescriptor(name, StateKind.MAP, ttl, schema)  # type: ignore[arg-type]


@runtime_checkable
class Serializer(Protocol):
    """Turns user keys and values into bytes and back; must be deterministic for keys."""

    def serialize(self, obj: Any) -> bytes: ...

    def deserialize(self, data: bytes) -> Any: ...


class TaggedSerializer:
    """Safe tagged binary encoding: ``N`` None, ``T``/``F`` bool, ``i`` int (decimal),
    ``f`` float (f64), ``s`` str (UTF-8), ``b`` bytes, ``l`` list, ``d`` dict; nested items
    are u32-length prefixed, at most :data:`MAX_DEPTH` levels deep. Decoding never executes
    code, and any malformed input raises :class:`FormatError` (values come back from shared
    storage)."""

    def serialize(self, obj: Any, _depth: int = 0) -> bytes:
        t = type(obj)
        if t is bytes:
            return b"b" + obj
        if t is str:
            return b"s" + obj.encode("utf-8")
        if t is int:
            return b"i" + str(obj).encode("ascii")
        if obj is None:
            return b"N"
        if t is bool:
            return b"T" if obj else b"F"
        if t is float:
            return b"f" + _F64.pack(obj)
        if t in (list, tuple, dict) and _depth >= MAX_DEPTH:
            raise StateError(f"TaggedSerializer nests at most {MAX_DEPTH} lists/dicts deep")
        if t in (list, tuple):
            parts = [b"l"]
            for item in obj:
                enc = self.serialize(item, _depth + 1)
                parts += (U32.pack(len(enc)), enc)
            return b"".join(parts)
        if t is dict:
            parts = [b"d"]
            for k, v in obj.items():
                ek, ev = self.serialize(k, _depth + 1), self.serialize(v, _depth + 1)
                parts += (U32.pack(len(ek)), ek, U32.pack(len(ev)), ev)
            return b"".join(parts)
        raise StateError(f"TaggedSerializer cannot encode {t.__name__}; plug in a Serializer")

    def deserialize(self, data: bytes, _depth: int = 0) -> Any:
        if type(data) is bytes:  # the per-key API's hot path: a counter, a name
            tag = data[:1]
            if tag == b"i":
                body = data[1:]
                # str(int) of a non-negative int: ASCII digits, no leading zero
                if body.isdigit() and (body[0] != 48 or len(body) == 1) and len(body) < 4000:
                    return int(body)
            elif tag == b"s":
                try:
                    return data[1:].decode("utf-8")
                except UnicodeDecodeError as e:
                    raise FormatError(f"bad serialized value (tag {tag!r}): {e}") from None
        if not data:
            raise FormatError("empty serialized value")
        tag, body = data[:1], bytes(data[1:])
        try:
            if tag == b"b":
                return body
            if tag == b"s":
                return body.decode("utf-8")
            if tag == b"i":
                if not _INT.fullmatch(body):
                    raise FormatError(f"bad serialized int {body[:40]!r}")
                return int(body)  # ValueError beyond sys.get_int_max_str_digits()
            if tag in (b"N", b"T", b"F"):
                if body:
                    raise FormatError(f"{len(body)} trailing bytes after value tag {tag!r}")
                return None if tag == b"N" else tag == b"T"
            if tag == b"f":
                if len(body) != _F64.size:
                    raise FormatError(f"serialized float has {len(body)} bytes, not 8")
                return _F64.unpack(body)[0]
        except (UnicodeDecodeError, ValueError) as e:
            raise FormatError(f"bad serialized value (tag {tag!r}): {e}") from None
        if tag in (b"l", b"d") and _depth >= MAX_DEPTH:
            raise FormatError(f"serialized value nests deeper than {MAX_DEPTH} levels")
        if tag == b"l":
            return [self.deserialize(x, _depth + 1) for x in split_items(body)]
        if tag == b"d":
            items = split_items(body)
            if len(items) % 2:
                raise FormatError("dict with an odd number of items")
            return {hashable(self.deserialize(items[i], _depth + 1)):
                    self.deserialize(items[i + 1], _depth + 1)
                    for i in range(0, len(items), 2)}
        raise FormatError(f"unknown value tag {tag!r}")


def hashable(key: Any) -> Any:
    """A decoded dict key as it was written: lists (tuples on the way in) back to tuples, at
    every level; a dict, which cannot have been a key, raises :class:`FormatError`."""
    if isinstance(key, list):
        return tuple(hashable(x) for x in key)
    if isinstance(key, dict):
        raise FormatError("serialized dict key is a dict")
    return key


def split_items(body: bytes) -> list[bytes]:
    """Split a run of u32-length-prefixed items; raises :class:`FormatError` if torn."""
    out, pos, end = [], 0, len(body)
    while pos < end:
        if end - pos < 4:
            raise FormatError("torn item length")
        (n,) = U32.unpack_from(body, pos)
        pos += 4
        if n > end - pos:
            raise FormatError("item runs past its record")
        out.append(body[pos:pos + n])
        pos += n
    return out


def join_items(items: list[bytes]) -> bytes:
    return b"".join(U32.pack(len(x)) + x for x in items)


# ------------------------------------------------------------------ record encoding

# plain ints on the replay path (enum attribute lookups cost more than the work)
_VSET, _LADD, _LSET, _MPUT, _MREM = (int(Op.VALUE_SET), int(Op.LIST_ADD), int(Op.LIST_SET),
                                     int(Op.MAP_PUT), int(Op.MAP_REMOVE))
_CLEARS = frozenset((int(Op.VALUE_CLEAR), int(Op.LIST_CLEAR), int(Op.MAP_CLEAR)))
_HSIZE, _HUNPACK = HDR.size, HDR.unpack_from
_OPS = {StateKind.VALUE: frozenset((Op.VALUE_SET, Op.VALUE_CLEAR)),
        StateKind.LIST: frozenset((Op.LIST_ADD, Op.LIST_SET, Op.LIST_CLEAR)),
        StateKind.MAP: frozenset((Op.MAP_PUT, Op.MAP_REMOVE, Op.MAP_CLEAR))}


def encode(op: int, sid: int, key: bytes, value: bytes = b"", ukey: bytes | None = None) -> bytes:
    head = HDR.pack(RECORD_VERSION, op, sid, len(key))
    if ukey is not None:
        return b"".join((head, key, U32.pack(len(ukey)), ukey, value))
    return b"".join((head, key, value))


def encode_value_set(sid: int, key: bytes, value: bytes) -> bytes:
    """:func:`encode` of a VALUE_SET record (a per-key update's, the hot path)."""
    return HDR.pack(RECORD_VERSION, _VSET, sid, len(key)) + key + value


def encode_value_changes(sid: int, entries: Sequence[tuple[int, bytes, bytes | None]]
                         ) -> list[tuple[int, bytes]]:
    """``(key group, record)`` of each ``(key group, key, value)`` of value state ``sid``:
    :func:`encode` of a VALUE_SET, or of a VALUE_CLEAR where the value is None (the changes of
    a columnar update, encoded in one pass)."""
    pack, ver, vset, vclear = HDR.pack, RECORD_VERSION, _VSET, int(Op.VALUE_CLEAR)
    return [(kg, pack(ver, vset, sid, len(k)) + k + v) if v is not None
            else (kg, pack(ver, vclear, sid, len(k)) + k) for kg, k, v in entries]


def check_stamps(recs: list[bytes], stamped: frozenset[int]) -> None:
    """Every value that a record of a state in ``stamped`` (the writer's ids of its TTL
    states) writes carries a TTL timestamp (:mod:`dstl_ray.state.ttl`): a checkpoint whose
    spec promises stamps its values lack is corrupt, and raises :class:`FormatError` here
    rather than a read failing later. Malformed records are left to the apply step."""
    for rec in recs:
        if len(rec) < _HSIZE:
            continue
        _ver, op, sid, klen = _HUNPACK(rec)
        if sid not in stamped:
            continue
        p = _HSIZE + klen
        if op in (_VSET, _LADD):
            values = [rec[p:]]
        elif op == _LSET:
            values = split_items(rec[p:])
        elif op == _MPUT and p + 4 <= len(rec):
            values = [rec[p + 4 + U32.unpack_from(rec, p)[0]:]]
        else:
            continue
        for v in values:
            if len(v) < STAMP_SIZE:
                raise FormatError(f"a value of TTL state id {sid} has {len(v)} bytes, less "
                                  f"than its {STAMP_SIZE}-byte timestamp")


def decode_record(rec: bytes, kinds: list[StateKind], sid_map: list[int] | None = None
                  ) -> tuple[int, int, bytes, bytes | None, bytes]:
    """Split one change record into ``(op, local state id, key, user key, payload)``.

    The user key is set for MAP_PUT and MAP_REMOVE only; the payload is the value (VALUE_SET,
    LIST_ADD, MAP_PUT), the u32-prefixed items (LIST_SET) or empty. ``sid_map`` translates the
    record's state id (of the log that wrote it) into a local one. Every table applies
    records through this one check: a torn or unknown record raises :class:`FormatError`.
    """
    if len(rec) < _HSIZE:
        raise FormatError("torn state change record")
    ver, op, sid, klen = _HUNPACK(rec)
    if ver != RECORD_VERSION:
        raise FormatError(f"unknown state change record version {ver}")
    p = _HSIZE + klen
    if p > len(rec):
        raise FormatError("state change key runs past its record")
    key = rec[_HSIZE:p]
    try:
        local = sid_map[sid] if sid_map is not None else sid
        kind = kinds[local]
    except IndexError:
        raise FormatError(f"state change names unknown state id {sid}") from None
    if op not in _OPS[kind]:
        raise FormatError(f"op {op} does not fit state kind {kind.value}")
    if op in (_MPUT, _MREM):
        if p + 4 > len(rec):
            raise FormatError("torn map record")
        (ulen,) = U32.unpack_from(rec, p)
        end = p + 4 + ulen
        if end > len(rec) or (op == _MREM and end != len(rec)):
            raise FormatError(f"map user key of {ulen} bytes does not fit its record of "
                              f"{len(rec)} bytes")
        return op, local, key, rec[p + 4:end], rec[end:]
    if op in _CLEARS and p != len(rec):
        raise FormatError(f"clear record has {len(rec) - p} trailing bytes")
    return op, local, key, None, rec[p:]


def apply_record(rec: bytes, tables: list[dict[int, dict]], kinds: list[StateKind], kg: int,
                 sid_map: list[int] | None = None) -> None:
    """Apply one change record of key group ``kg`` to ``tables[local sid][kg]`` (the heap
    table's dicts, :mod:`dstl_ray.state.heap`).

    ``sid_map`` translates the record's state ids (of the log that wrote it) into local ones.
    Raises :class:`FormatError` on a torn or unknown record.
    """
    op, local, key, ukey, payload = decode_record(rec, kinds, sid_map)
    per_kg = tables[local]
    d = per_kg.get(kg)
    if d is None:
        d = per_kg[kg] = {}
    if op == _VSET:
        d[key] = payload
    elif op == _MPUT:
        m = d.get(key)
        if m is None:
            m = d[key] = {}
        m[ukey] = payload
    elif op == _MREM:
        m = d.get(key)
        if m is not None:
            m.pop(ukey, None)
            if not m:
                del d[key]
    elif op == _LADD:
        lst = d.get(key)
        if lst is None:
            d[key] = [payload]
        else:
            lst.append(payload)
    elif op == _LSET:
        items = split_items(payload)
        if items:
            d[key] = items
        else:
            d.pop(key, None)
    else:  # a clear (decode_record knows no other op)
        d.pop(key, None)


def encode_full(sid: int, kind: StateKind, key: bytes, value: Any) -> list[bytes]:
    """Records that recreate one entry of a table (used by materialization)."""
    if kind is StateKind.VALUE:
        return [encode(Op.VALUE_SET, sid, key, value)]
    if kind is StateKind.LIST:
        return [encode(Op.LIST_SET, sid, key, join_items(value))]
    return [encode(Op.MAP_PUT, sid, key, v, uk) for uk, v in value.items()]


def local_value_sid(sid: int, kinds: list[StateKind], sid_map: list[int] | None) -> int:
    """The local id of a record's state ``sid`` (translated by ``sid_map``) if it is a known
    value state, else -1: the check of the replay loops' inline value-set path (anything
    else goes through :func:`decode_record`, which raises the error)."""
    local = sid if sid_map is None else sid_map[sid] if sid < len(sid_map) else -1
    return local if 0 <= local < len(kinds) and kinds[local] is StateKind.VALUE else -1


def apply_records(recs: list[bytes], tables: list[dict[int, dict]], kinds: list[StateKind],
                  kg: int, sid_map: list[int] | None = None) -> None:
    """:func:`apply_record` over many records of key group ``kg`` (the replay loop of
    FLIP-158 "Recovery and rescaling"): value sets, the bulk of a changelog, are applied
    inline with the same checks; every other op goes through :func:`apply_record`."""
    hsize, hunpack, vset, version = _HSIZE, _HUNPACK, _VSET, RECORD_VERSION
    value_tables: dict[int, dict | None] = {}  # record sid -> this kg's value table, or None
    for rec in recs:
        if len(rec) >= hsize:
            ver, op, sid, klen = hunpack(rec)
            if op == vset and ver == version and hsize + klen <= len(rec):
                d = value_tables.get(sid, False)
                if d is False:
                    d = None
                    local = local_value_sid(sid, kinds, sid_map)
                    if local >= 0:
                        per_kg = tables[local]
                        d = per_kg.get(kg)
                        if d is None:
                            d = per_kg[kg] = {}
                    value_tables[sid] = d
                if d is not None:
                    p = hsize + klen
                    d[rec[hsize:p]] = rec[p:]
                    continue
        apply_record(rec, tables, kinds, kg, sid_map)  # other ops, and every error
