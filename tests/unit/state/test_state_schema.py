"""Declared state types (dstl_ray.state.schema) and their encoding (dstl_ray.state.typed),
without a backend: Spark DDL strings and pyarrow types parse to one canonical DDL; every
value of every supported type round-trips through the encoding (hypothesis, nested types
included), values that do not fit fail naming the type, malformed bytes fail as FormatError;
the evolution rules accept exactly the changes stored values can follow and name the state
and both schemas otherwise."""

from __future__ import annotations

import datetime as dt
import decimal

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dstl_ray.errors import ConfigError, FormatError, InvalidValueError, SchemaError
from dstl_ray.format.materialized import DROPPED, parse_states, states_json
from dstl_ray.state.records import TaggedSerializer
from dstl_ray.state.schema import canonical, check_evolution, parse_schema, resolver
from dstl_ray.state.typed import TypedSerializer


@pytest.mark.parametrize(("spec", "ddl"), [
    ("BIGINT", "bigint"),
    ("long", "bigint"),
    ("Integer", "int"),
    ("decimal(12, 3)", "decimal(12,3)"),
    ("decimal", "decimal(10,0)"),
    ("array<struct<a: int, b: string>>", "array<struct<a:int,b:string>>"),
    ("map<string, array<double>>", "map<string,array<double>>"),
    ("struct<start: timestamp, n: int not null>", "struct<start:timestamp,n:int not null>"),
    ("start TIMESTAMP, n INT", "struct<start:timestamp,n:int>"),
    ("`odd name` string, d date", "struct<`odd name`:string,d:date>"),
    ("timestamp_ntz", "timestamp_ntz"),
    (pa.int64(), "bigint"),
    (pa.large_string(), "string"),
    (pa.timestamp("ns", tz="Europe/Berlin"), "timestamp"),
    (pa.timestamp("ms"), "timestamp_ntz"),
    (pa.struct([("a", pa.list_(pa.float32())), pa.field("b", pa.bool_(), False)]),
     "struct<a:array<float>,b:boolean not null>"),
    (pa.schema([("x", pa.int16())]), "struct<x:smallint>"),
])
def test_ddl_strings_and_pyarrow_types_have_one_canonical_form(spec, ddl):
    assert canonical(spec) == ddl
    assert canonical(ddl) == ddl  # the canonical form parses to itself


@pytest.mark.parametrize(("spec", "match"), [
    ("bigintt", "unknown type 'bigintt'"),
    ("array<int", "expected >"),
    ("decimal(40,2)", "precision <= 38"),
    ("a int, a string", "field 'a' twice"),
    (pa.uint32(), "no Spark counterpart"),
    (pa.duration("s"), "no Spark counterpart"),
    (17, "must be a Spark DDL string or a pyarrow type"),
])
def test_bad_schemas_are_refused_naming_what_is_wrong(spec, match):
    with pytest.raises(ConfigError, match=match):
        canonical(spec)


# ------------------------------------------------------------------ round trips (hypothesis)

_SCALARS = {
    "boolean": st.booleans(),
    "tinyint": st.integers(-128, 127),
    "smallint": st.integers(-2**15, 2**15 - 1),
    "int": st.integers(-2**31, 2**31 - 1),
    "bigint": st.integers(-2**63, 2**63 - 1),
    "double": st.floats(allow_nan=False),
    "float": st.floats(width=32, allow_nan=False),
    "string": st.text(max_size=20),
    "binary": st.binary(max_size=20),
    "date": st.dates(),
    "timestamp": st.datetimes(timezones=st.just(dt.UTC)),
    "timestamp_ntz": st.datetimes(),
    "decimal(9,2)": st.decimals(min_value=-10**6, max_value=10**6, places=2),
}


def _typed(depth: int) -> st.SearchStrategy:
    """(DDL, values strategy) pairs, nested up to ``depth``."""
    scalars = st.sampled_from(sorted(_SCALARS)).map(lambda t: (t, _SCALARS[t]))
    if depth == 0:
        return scalars
    inner = _typed(depth - 1)

    def array(x):
        return f"array<{x[0]}>", st.lists(st.none() | x[1], max_size=4)

    def mapping(x):
        return f"map<string,{x[0]}>", st.dictionaries(st.text(max_size=5), st.none() | x[1],
                                                        max_size=4)

    def struct(xs):
        fields = [(f"f{i}", t, v) for i, (t, v) in enumerate(xs)]
        ddl = "struct<" + ",".join(f"{n}:{t}" for n, t, _ in fields) + ">"
        return ddl, st.fixed_dictionaries({n: st.none() | v for n, _, v in fields})

    return st.one_of(scalars, inner.map(array), inner.map(mapping),
                     st.lists(inner, min_size=1, max_size=3).map(struct))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_value_of_every_type_round_trips(data):
    ddl, values = data.draw(_typed(2))
    value = data.draw(values)
    ser = TypedSerializer(parse_schema(ddl))
    back = ser.deserialize(ser.serialize(value))
    want = value
    if ddl == "timestamp_ntz":
        want = value.replace(tzinfo=None)
    if ddl == "float":
        want = float(pa.scalar(value, pa.float32()).as_py())
    assert back == want, (ddl, value, back)


def test_a_value_comes_back_as_sparks_arrow_conversion_gives_it():
    ser = TypedSerializer(parse_schema(
        "struct<when: timestamp, day: date, amount: decimal(10,2), tags: array<string>, "
        "attrs: map<string, bigint>, ntz: timestamp_ntz>"))
    naive = dt.datetime(2026, 11, 26, 7, 30)
    v = {"when": dt.datetime(2026, 11, 26, 8, 0, tzinfo=dt.timezone(dt.timedelta(hours=1))),
         "day": dt.date(2026, 11, 26), "amount": decimal.Decimal("12.345"),
         "tags": ("a", None), "attrs": {"x": 1}, "ntz": naive}
    back = ser.deserialize(ser.serialize(v))
    assert back == {"when": dt.datetime(2026, 11, 26, 7, 0, tzinfo=dt.UTC),  # as UTC
                    "day": dt.date(2026, 11, 26),
                    "amount": decimal.Decimal("12.35"),  # to the scale, half up
                    "tags": ["a", None], "attrs": {"x": 1}, "ntz": naive}
    # compact: a small bigint is its mark and a zigzag varint
    assert len(TypedSerializer(pa.int64()).serialize(7)) == 2


@given(st.sampled_from([(pa.int8(), 8), (pa.int16(), 16), (pa.int32(), 32), (pa.int64(), 64)]),
       st.data())
def test_integers_round_trip_as_varints_and_the_fixed_form_still_reads(width, data):
    """A typed integer is written as a zigzag varint (MARK_VARINT), the same at every width
    (an int -> bigint evolution reads it as it is); the fixed form written before reads as
    it did, and a varint out of the type's range, or with bytes after it, is refused."""
    import struct

    from dstl_ray.state.typed import MARK, MARK_VARINT

    t, bits = width
    v = data.draw(st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1))
    ser = TypedSerializer(t)
    enc = ser.serialize(v)
    assert enc[:1] == MARK_VARINT and ser.deserialize(enc) == v
    assert TypedSerializer(pa.int64()).deserialize(enc) == v  # widened
    code = {8: "b", 16: "h", 32: "i", 64: "q"}[bits]
    assert ser.deserialize(MARK + struct.pack("<" + code, v)) == v  # the fixed form
    with pytest.raises(FormatError):
        ser.deserialize(enc + b"\x00")
    if bits < 64:
        with pytest.raises(FormatError, match="out of its range"):
            ser.deserialize(TypedSerializer(pa.int64()).serialize(1 << bits))


@given(st.one_of(st.binary(max_size=300), st.text(max_size=200)))
def test_short_bytes_and_strings_take_the_fast_path_to_the_same_bytes(v):
    """bytes and str at the top are encoded without the general path's calls when their
    length fits one varint byte: the bytes are the general path's (a nested field's), and
    they read back."""
    from dstl_ray.state.typed import MARK

    t = pa.binary() if isinstance(v, bytes) else pa.string()
    ser = TypedSerializer(t)
    enc = ser.serialize(v)
    field = TypedSerializer(pa.struct([pa.field("x", t)])).serialize({"x": v})
    assert enc == MARK + field[2:]  # (the struct's mark, then its field's null flag)
    assert ser.deserialize(enc) == v


@pytest.mark.parametrize(("ddl", "value", "match"), [
    ("int", 2**31, "is not a int"),
    ("int", 1.5, "is not a int"),
    ("bigint", True, "is not a bigint"),
    ("string", b"x", "is not a string"),
    ("decimal(4,2)", decimal.Decimal("123.4"), "more than 4 digits"),
    ("struct<a:int not null>", {"a": None}, "field 'a' is NOT NULL"),
    ("struct<a:int>", {"b": 1}, "no field 'b'"),
    ("map<string,int>", [1, 2], "a map is a dict"),
    ("date", "2026-01-01", "is not a date"),
    ("bigint", None, "stores no None"),
])
def test_a_value_that_does_not_fit_fails_naming_the_type(ddl, value, match):
    with pytest.raises(InvalidValueError, match=match):
        TypedSerializer(parse_schema(ddl)).serialize(value)


def test_malformed_bytes_fail_as_format_errors():
    ser = TypedSerializer(parse_schema("struct<a:string,b:bigint>"))
    good = ser.serialize({"a": "hello", "b": 5})
    for bad in (good[:-1], good + b"\x00", TaggedSerializer().serialize({"a": "hello"}),
                good[:3]):
        with pytest.raises(FormatError):
            ser.deserialize(bad)


# ------------------------------------------------------------------ evolution


@pytest.mark.parametrize(("old", "new"), [
    ("int", "bigint"),
    ("tinyint", "int"),
    ("float", "double"),
    ("decimal(5,2)", "decimal(9,2)"),
    ("struct<a:int>", "struct<a:bigint,b:string>"),  # widened, a nullable field added
    ("struct<a:int,b:string>", "struct<a:int>"),  # a field removed
    ("struct<a:int not null>", "struct<a:int>"),  # NOT NULL relaxed
    ("array<struct<a:float>>", "array<struct<a:double,c:date>>"),
    ("map<string,int>", "map<string,bigint>"),
])
def test_compatible_changes_are_accepted_and_old_values_read_in_the_new_shape(old, new):
    check_evolution("s", old, new)
    told, tnew = parse_schema(old), parse_schema(new)
    conv = resolver(told, tnew)
    samples = {"struct<a:int>": {"a": 3}, "struct<a:int,b:string>": {"a": 3, "b": "x"},
               "struct<a:int not null>": {"a": 3},
               "array<struct<a:float>>": [{"a": 0.5}, None],
               "map<string,int>": {"k": 1}}
    if old in samples:
        value = TypedSerializer(told).deserialize(TypedSerializer(told).serialize(samples[old]))
        again = TypedSerializer(tnew).deserialize(TypedSerializer(tnew).serialize(conv(value)))
        assert again == conv(value)
        if new == "struct<a:bigint,b:string>":
            assert again == {"a": 3, "b": None}
        if new == "struct<a:int>" and old == "struct<a:int,b:string>":
            assert again == {"a": 3}


@pytest.mark.parametrize(("old", "new", "why"), [
    ("bigint", "int", "narrows bigint to int"),
    ("string", "bigint", "changes string to bigint"),
    ("double", "float", "changes double to float"),
    ("struct<a:int>", "struct<a:int,b:string not null>", "field b is added NOT NULL"),
    ("struct<a:int>", "struct<a:int not null>", "field a becomes NOT NULL"),
    ("struct<a:struct<x:int>>", "struct<a:struct<x:string>>", "a.x changes int to string"),
    ("map<string,int>", "map<int,int>", "keys change string to int"),
    ("decimal(5,2)", "decimal(9,3)", "changes decimal(5,2) to decimal(9,3)"),
])
def test_incompatible_changes_name_the_state_and_both_schemas(old, new, why):
    with pytest.raises(SchemaError) as e:
        check_evolution("session", old, new)
    msg = str(e.value)
    assert "'session'" in msg and old in msg and new in msg and why in msg


def test_a_state_spec_carries_schema_and_dropped_places_and_round_trips():
    states = (("a", "value"), ("b", "map", 1500), ("c", "list", None, "struct<x:int>"),
              ("d", "value", 2000, "bigint"), ("a", "value", None, DROPPED))
    js = states_json(states)
    assert js[2] == ["c", "list", {"schema": "struct<x:int>"}]
    assert js[4] == ["a", "value", {"dropped": True}]
    assert parse_states(js) == states
    from dstl_ray.errors import HandleError

    with pytest.raises(HandleError, match="listed twice"):
        parse_states([["a", "value"], ["a", "value", {"schema": "int"}]])
    with pytest.raises(HandleError, match="dropped state has"):
        parse_states([["a", "value", {"dropped": True, "ttl_ms": 5}]])


def test_map_keys_are_scalars_and_a_map_may_come_as_arrow_gives_it():
    with pytest.raises(ConfigError, match="a map's keys must be of a scalar type"):
        canonical("map<array<int>,int>")
    with pytest.raises(ConfigError, match="a map's keys must be of a scalar type"):
        canonical(pa.map_(pa.struct([("a", pa.int8())]), pa.int8()))
    ser = TypedSerializer(parse_schema("map<string,bigint>"))
    assert ser.deserialize(ser.serialize([("a", 1), ("b", None)])) == {"a": 1, "b": None}
    with pytest.raises(InvalidValueError, match="more than 3 digits"):
        TypedSerializer(parse_schema("decimal(3,0)")).serialize(decimal.Decimal("1E+90"))
