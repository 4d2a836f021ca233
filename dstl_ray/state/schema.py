"""Declared types of keyed state, and how they may change between versions of a job.

A state may declare the type of its values (a ValueState's value, a ListState's element, a
MapState's value; map keys stay untyped): a Spark DDL string (``"bigint"``,
``"struct<start: timestamp, n: int>"``, or a column list ``"start TIMESTAMP, n INT"``, a
struct) or a pyarrow type. Values are then encoded by that type
(:mod:`dstl_ray.state.typed`), and the type, as canonical DDL, is part of the state's spec in
every checkpoint (``[name, kind, {"schema": ddl}]``), so readers know it.

Evolution (the rules of Avro's and Spark's schema resolution that keep every stored value
readable): a struct may gain fields that are nullable (old values read them as None) and
lose fields; integers widen (tinyint, smallint, int, bigint), float widens to double, a
decimal's precision grows at the same scale, a NOT NULL field may become nullable; lists and
maps evolve by their elements and values. Anything else, a declared type removed or added
included, is migrated only where every stored value converts (:func:`check_evolution`
refuses the rest with the state and both schemas named).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from ..errors import ConfigError, SchemaError

_SIMPLE: dict[str, pa.DataType] = {
    "boolean": pa.bool_(), "tinyint": pa.int8(), "smallint": pa.int16(), "int": pa.int32(),
    "bigint": pa.int64(), "float": pa.float32(), "double": pa.float64(),
    "string": pa.string(), "binary": pa.binary(), "date": pa.date32(),
    "timestamp": pa.timestamp("us", tz="UTC"), "timestamp_ntz": pa.timestamp("us"),
}
_ALIASES = {"bool": "boolean", "byte": "tinyint", "short": "smallint", "integer": "int",
            "long": "bigint", "real": "float", "timestamp_ltz": "timestamp",
            "dec": "decimal", "numeric": "decimal"}
_INT_RANK = {pa.int8(): 0, pa.int16(): 1, pa.int32(): 2, pa.int64(): 3}
_TOKEN = re.compile(r"\s*(?:(`(?:[^`]|``)+`)|([A-Za-z_][A-Za-z0-9_]*)|(\d+)|([<>(),:]))")
_PLAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Tokens:
    def __init__(self, text: str) -> None:
        self.text, self.items, pos = text, [], 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            m = _TOKEN.match(text, pos)
            if m is None:
                raise ConfigError(f"state schema {text!r}: unexpected {text[pos:].strip()!r}")
            quoted, word, num, punct = m.groups()
            self.items.append(quoted[1:-1].replace("``", "`") if quoted else
                              word or num or punct)
            pos = m.end()
        self.i = 0

    def peek(self) -> str | None:
        return self.items[self.i] if self.i < len(self.items) else None

    def take(self, want: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (want is not None and tok.lower() != want):
            raise ConfigError(f"state schema {self.text!r}: expected "
                              f"{want or 'more'}, got {tok or 'the end'}")
        self.i += 1
        return tok


def _parse_type(t: _Tokens) -> pa.DataType:
    word = t.take().lower()
    word = _ALIASES.get(word, word)
    if word in _SIMPLE:
        return _SIMPLE[word]
    if word == "decimal":
        p, s = 10, 0
        if t.peek() == "(":
            t.take("(")
            p = int(t.take())
            if t.peek() == ",":
                t.take(",")
                s = int(t.take())
            t.take(")")
        if not 0 < p <= 38 or not 0 <= s <= p:
            raise ConfigError(f"state schema {t.text!r}: decimal({p},{s}) needs "
                              f"1 <= precision <= 38 and 0 <= scale <= precision")
        return pa.decimal128(p, s)
    if word == "array":
        t.take("<")
        item = _parse_type(t)
        t.take(">")
        return pa.list_(item)
    if word == "map":
        t.take("<")
        k = _map_key(_parse_type(t), t.text)
        t.take(",")
        v = _parse_type(t)
        t.take(">")
        return pa.map_(k, v)
    if word == "struct":
        t.take("<")
        fields = [] if t.peek() == ">" else _parse_fields(t, ">")
        t.take(">")
        return pa.struct(fields)
    raise ConfigError(f"state schema {t.text!r}: unknown type {word!r} (types: "
                      f"{', '.join(sorted(_SIMPLE))}, decimal(p,s), array<t>, map<k,v>, "
                      f"struct<name: t, ...>)")


def _map_key(k: pa.DataType, where: str) -> pa.DataType:
    """A map's key type: a scalar (a list or struct key would come back unhashable)."""
    if pa.types.is_nested(k):
        raise ConfigError(f"{where}: a map's keys must be of a scalar type, not {k}")
    return k


def _parse_fields(t: _Tokens, end: str | None) -> list[pa.Field]:
    fields: list[pa.Field] = []
    while True:
        name = t.take()
        if t.peek() == ":":
            t.take(":")
        typ = _parse_type(t)
        nullable = True
        if t.peek() is not None and t.peek().lower() == "not":  # type: ignore[union-attr]
            t.take("not")
            t.take("null")
            nullable = False
        if any(f.name == name for f in fields):
            raise ConfigError(f"state schema {t.text!r}: field {name!r} twice")
        fields.append(pa.field(name, typ, nullable))
        if t.peek() != ",":
            return fields
        t.take(",")
        if t.peek() == end:
            return fields


def normalize(t: pa.DataType, where: str = "state schema") -> pa.DataType:
    """``t`` as a state stores it: a Spark type's Arrow form (large strings and lists as
    plain ones, timestamps in microseconds, UTC or naive); types Spark has not (unsigned
    integers, half floats, durations, dictionaries) are refused."""
    if t in _INT_RANK or t in (pa.bool_(), pa.float32(), pa.float64(), pa.string(),
                              pa.binary(), pa.date32()):
        return t
    if t in (pa.large_string(), pa.string_view()):
        return pa.string()
    if t in (pa.large_binary(), pa.binary_view()):
        return pa.binary()
    if pa.types.is_date64(t):
        return pa.date32()
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz="UTC" if t.tz is not None else None)
    if pa.types.is_decimal(t) and t.precision <= 38:
        return pa.decimal128(t.precision, t.scale)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(normalize(t.value_type, where))
    if pa.types.is_map(t):
        return pa.map_(_map_key(normalize(t.key_type, where), where),
                       normalize(t.item_type, where))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, normalize(f.type, where), f.nullable) for f in t])
    raise ConfigError(f"{where}: type {t} has no Spark counterpart (use a Spark DDL type: "
                      f"{', '.join(sorted(_SIMPLE))}, decimal, array, map, struct)")


def parse_schema(spec: Any, where: str = "state schema") -> pa.DataType:
    """A declared type: a pyarrow type or field-less schema, or a Spark DDL string (a type,
    or ``"name TYPE, ..."``, a struct of those fields)."""
    if isinstance(spec, pa.DataType):
        return normalize(spec, where)
    if isinstance(spec, pa.Schema):
        return normalize(pa.struct(list(spec)), where)
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{where} must be a Spark DDL string or a pyarrow type, got "
                          f"{spec!r}")
    t = _Tokens(spec)
    try:
        typ = _parse_type(t)
        if t.peek() is None:
            return typ
        as_type: ConfigError = ConfigError(f"{where} {spec!r}: unexpected {t.peek()!r}")
    except ConfigError as e:
        as_type = e
    reached = t.i
    t.i = 0  # a column list: "name TYPE, name TYPE"
    try:
        fields = _parse_fields(t, None)
        if t.peek() is not None:
            raise ConfigError(f"{where} {spec!r}: unexpected {t.peek()!r}")
    except ConfigError as e:
        raise (e if t.i > reached else as_type) from None  # the reading that got further
    return pa.struct(fields)


def _name(n: str) -> str:
    return n if _PLAIN_NAME.match(n) else "`" + n.replace("`", "``") + "`"


def to_ddl(t: pa.DataType) -> str:
    """The canonical DDL of a normalized type (what checkpoints record)."""
    for name, typ in _SIMPLE.items():
        if t == typ:
            return name
    if pa.types.is_decimal(t):
        return f"decimal({t.precision},{t.scale})"
    if pa.types.is_list(t):
        return f"array<{to_ddl(t.value_type)}>"
    if pa.types.is_map(t):
        return f"map<{to_ddl(t.key_type)},{to_ddl(t.item_type)}>"
    if pa.types.is_struct(t):
        return "struct<" + ",".join(
            f"{_name(f.name)}:{to_ddl(f.type)}{'' if f.nullable else ' not null'}"
            for f in t) + ">"
    raise ConfigError(f"type {t} is not a state type")  # (normalize refused it first)


def canonical(spec: Any, where: str = "state schema") -> str:
    """The canonical DDL of a declared type (:func:`parse_schema` then :func:`to_ddl`)."""
    return to_ddl(parse_schema(spec, where))


def _why_not(old: pa.DataType, new: pa.DataType, path: str) -> str | None:
    """Why values of ``old`` cannot be read as ``new`` (None: they can)."""
    if old == new:
        return None
    if old in _INT_RANK and new in _INT_RANK:
        return None if _INT_RANK[new] >= _INT_RANK[old] else \
            f"{path or 'the value'} narrows {to_ddl(old)} to {to_ddl(new)}"
    if old == pa.float32() and new == pa.float64():
        return None
    if pa.types.is_decimal(old) and pa.types.is_decimal(new):
        if new.scale == old.scale and new.precision >= old.precision:
            return None
        return f"{path or 'the value'} changes {to_ddl(old)} to {to_ddl(new)}"
    if pa.types.is_list(old) and pa.types.is_list(new):
        return _why_not(old.value_type, new.value_type, f"{path}[]")
    if pa.types.is_map(old) and pa.types.is_map(new):
        if old.key_type != new.key_type:
            return f"{path or 'the map'}'s keys change {to_ddl(old.key_type)} to " \
                   f"{to_ddl(new.key_type)}"
        return _why_not(old.item_type, new.item_type, f"{path}{{}}")
    if pa.types.is_struct(old) and pa.types.is_struct(new):
        before = {f.name: f for f in old}
        for f in new:
            at = f"{path}.{f.name}" if path else f.name
            was = before.get(f.name)
            if was is None:
                if not f.nullable:
                    return f"field {at} is added NOT NULL (old values have none)"
                continue
            if was.nullable and not f.nullable:
                return f"field {at} becomes NOT NULL"
            why = _why_not(was.type, f.type, at)
            if why:
                return why
        return None
    return f"{path or 'the value'} changes {to_ddl(old)} to {to_ddl(new)}"


def check_evolution(state: str, old: str, new: str) -> None:
    """Refuse a change of state ``state``'s declared type from DDL ``old`` to ``new`` that
    stored values cannot follow, with a :class:`SchemaError` naming the state, both
    schemas and what breaks."""
    why = _why_not(parse_schema(old), parse_schema(new), "")
    if why:
        raise SchemaError(f"state {state!r}: its stored schema {old} cannot change to {new}: "
                          f"{why}")


def resolver(old: pa.DataType, new: pa.DataType) -> Callable[[Any], Any]:
    """Converts a value decoded by ``old`` to ``new``'s shape (``check_evolution`` allowed
    the change): removed struct fields go, added ones are None; numbers stay as they are."""
    if old == new or not (pa.types.is_struct(new) or pa.types.is_list(new)
                          or pa.types.is_map(new)):
        return lambda v: v
    if pa.types.is_list(new):
        item = resolver(old.value_type, new.value_type)
        return lambda v: None if v is None else [item(x) for x in v]
    if pa.types.is_map(new):
        val = resolver(old.item_type, new.item_type)
        return lambda v: None if v is None else {k: val(x) for k, x in v.items()}
    before = {f.name: f.type for f in old}
    conv = [(f.name, resolver(before[f.name], f.type) if f.name in before else None)
            for f in new]

    def struct(v: Any) -> Any:
        if v is None:
            return None
        return {name: (c(v.get(name)) if c is not None else None) for name, c in conv}

    return struct
