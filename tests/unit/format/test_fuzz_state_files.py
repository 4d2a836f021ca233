"""Property tests of materialized state files (``.dstm``), state change records and the
TaggedSerializer (issue 9, a fuzzed reader).

Valid data round trips. A ``.dstm`` file carries CRC32Cs, so any flipped byte or truncation
decodes to the records written or raises FormatError. Records and serialized values have no
checksum of their own (the file around them has): damaged ones must decode to something or
raise dstl-ray's error, never another exception, and the fast replay loop must agree with
record-by-record application.
"""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dstl_ray.errors import DstlError, FormatError, StateError
from dstl_ray.format.materialized import MaterializedHandle, read_sections
from dstl_ray.keygroups import KeyGroupRange
from dstl_ray.state.files import encode_tables
from dstl_ray.state.records import (
    MAX_DEPTH,
    Op,
    StateKind,
    TaggedSerializer,
    apply_record,
    apply_records,
    encode,
    encode_full,
)
from experiments.fuzz_seeds import STATES, BytesStorage

from ..ckpt_util import as_decoded

SER = TaggedSerializer()
KINDS = [StateKind(k) for _, k in STATES]
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------ values

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                    st.text(max_size=8), st.binary(max_size=8))
keys = st.recursive(scalars, lambda c: st.lists(c, max_size=3).map(tuple), max_leaves=6)
values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.tuples(c, c)
                      | st.dictionaries(keys, c, max_size=3), max_leaves=12)


@SETTINGS
@given(values)
def test_values_round_trip(v):
    assert SER.deserialize(SER.serialize(v)) == as_decoded(v)


@SETTINGS
@given(values, st.data())
def test_damaged_values_decode_or_raise_format_error(v, data):
    enc = bytearray(SER.serialize(v))
    if data.draw(st.booleans()):
        enc[data.draw(st.integers(0, len(enc) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    else:
        del enc[data.draw(st.integers(0, len(enc) - 1)):]
    try:
        SER.deserialize(bytes(enc))
    except FormatError:
        pass


@SETTINGS
@given(st.binary(max_size=64))
def test_any_bytes_decode_or_raise_format_error(raw):
    try:
        SER.deserialize(raw)
    except FormatError:
        pass


def test_tuple_keys_holding_tuples_round_trip():
    """Regression: {(1, (2, 3)): x} serialized but its key decoded as (1, [2, 3]) and raised
    TypeError (unhashable)."""
    v = {(1, (2, (3,))): "x", ((), "a"): [1]}
    assert SER.deserialize(SER.serialize(v)) == {(1, (2, (3,))): "x", ((), "a"): [1]}


def nested(depth: int) -> list:
    v: list = []
    for _ in range(depth - 1):
        v = [v]
    return v


def test_nesting_is_bounded_on_write_and_read():
    """Regression: a value nested ~500 deep serialized fine but deserialize raised
    RecursionError (and a forged one of any depth did)."""
    assert SER.deserialize(SER.serialize(nested(MAX_DEPTH))) == nested(MAX_DEPTH)
    with pytest.raises(StateError, match="nests at most"):
        SER.serialize(nested(MAX_DEPTH + 1))
    forged = b"l"
    for _ in range(5000):
        forged = b"l" + struct.pack("<I", len(forged)) + forged
    with pytest.raises(FormatError, match="deeper than"):
        SER.deserialize(forged)


@pytest.mark.parametrize("raw", [
    b"s\xff", b"i\xff", b"i", b"i1_000", b"i 1", b"i+1", b"i1\n", b"i" + b"9" * 5000,
    b"i007", b"i-0", b"f\x00", b"f" + b"\x00" * 9, b"Nx", b"Tx", b"F\x00", b"?", b"",
    b"l\x05\x00\x00\x00N", b"d\x01\x00\x00\x00N", b"d\x01\x00\x00\x00d\x01\x00\x00\x00N"])
def test_malformed_values_raise_format_error(raw):
    """Regression: these raised UnicodeDecodeError, ValueError, struct.error or TypeError,
    or (junk after N/T/F, "1_000", " 1", "007") decoded to a value that was never written."""
    with pytest.raises(FormatError):
        SER.deserialize(raw)


@pytest.mark.parametrize("value", [0, 7, 10, 12345, -1, -907, 10 ** 3998, -(10 ** 3998), "",
                                   "count", "ünï", "0"])
def test_int_and_str_decode_alike_from_bytes_and_views(value):
    """The bytes fast path of ints and strs (the per-key API's reads) decodes as the
    general path does a view of the same bytes."""
    raw = SER.serialize(value)
    assert SER.deserialize(raw) == value
    assert SER.deserialize(memoryview(raw)) == value
    assert type(SER.deserialize(raw)) is type(value)


@pytest.mark.parametrize("raw", [b"i00", b"i01", b"i0" + b"1" * 10, b"i\xd9\xa1", b"s\xc3"])
def test_fast_path_refuses_what_the_general_path_refuses(raw):
    for data in (raw, memoryview(raw)):
        with pytest.raises(FormatError):
            SER.deserialize(data)


# ------------------------------------------------------------------ records

small = st.binary(max_size=6)
ops = st.one_of(
    st.tuples(st.just(0), st.sampled_from([Op.VALUE_SET, Op.VALUE_CLEAR]), small, small, small),
    st.tuples(st.just(1), st.sampled_from([Op.LIST_ADD, Op.LIST_SET, Op.LIST_CLEAR]), small,
              small, small),
    st.tuples(st.just(2), st.sampled_from([Op.MAP_PUT, Op.MAP_REMOVE, Op.MAP_CLEAR]), small,
              small, small))


def record(sid: int, op: Op, key: bytes, value: bytes, ukey: bytes) -> bytes:
    if op in (Op.MAP_PUT, Op.MAP_REMOVE):
        return encode(op, sid, key, value if op == Op.MAP_PUT else b"", ukey)
    if op == Op.LIST_SET:
        return encode_full(sid, StateKind.LIST, key, [value, ukey])[0]
    if op in (Op.VALUE_CLEAR, Op.LIST_CLEAR, Op.MAP_CLEAR):
        return encode(op, sid, key)
    return encode(op, sid, key, value)


def model(changes: list) -> list[dict]:
    """What the tables must hold after ``changes`` (key group 0)."""
    tables: list[dict] = [{}, {}, {}]
    for sid, op, key, value, ukey in changes:
        d = tables[sid].setdefault(0, {})
        if op in (Op.VALUE_CLEAR, Op.LIST_CLEAR, Op.MAP_CLEAR):
            d.pop(key, None)
        elif op == Op.VALUE_SET:
            d[key] = value
        elif op == Op.LIST_ADD:
            d.setdefault(key, []).append(value)
        elif op == Op.LIST_SET:
            d[key] = [value, ukey]
        elif op == Op.MAP_PUT:
            d.setdefault(key, {})[ukey] = value
        elif key in d:
            d[key].pop(ukey, None)
            if not d[key]:
                del d[key]
    return tables


def applied(recs: list[bytes], one_by_one: bool) -> tuple[list[dict], str | None]:
    tables: list[dict] = [{}, {}, {}]
    try:
        if one_by_one:
            for r in recs:
                apply_record(r, tables, KINDS, 0)
        else:
            apply_records(recs, tables, KINDS, 0)
    except DstlError as e:
        return tables, str(e)
    return tables, None


@SETTINGS
@given(st.lists(ops, max_size=20))
def test_records_round_trip(changes):
    recs = [record(*c) for c in changes]
    want = model(changes)
    for one_by_one in (False, True):
        got, err = applied(recs, one_by_one)
        assert err is None
        assert [{kg: d for kg, d in t.items() if d} for t in got] == \
            [{kg: d for kg, d in t.items() if d} for t in want]


@SETTINGS
@given(st.lists(ops, min_size=1, max_size=8), st.data())
def test_damaged_records_apply_or_raise_and_both_loops_agree(changes, data):
    recs = [bytearray(record(*c)) for c in changes]
    r = recs[data.draw(st.integers(0, len(recs) - 1))]
    if data.draw(st.booleans()):
        r[data.draw(st.integers(0, len(r) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    else:
        del r[data.draw(st.integers(0, len(r) - 1)):]
    recs_b = [bytes(x) for x in recs]
    assert applied(recs_b, False) == applied(recs_b, True)


@pytest.mark.parametrize("rec", [
    encode(Op.MAP_PUT, 2, b"k", b"", b"user")[:-2],  # user key runs past the record
    struct.pack("<BBHI", 1, Op.MAP_PUT, 2, 1) + b"k" + struct.pack("<I", 2**31) + b"uv",
    encode(Op.MAP_REMOVE, 2, b"k", b"junk", b"u"),  # bytes after a remove's user key
    encode(Op.VALUE_CLEAR, 0, b"k") + b"x", encode(Op.MAP_CLEAR, 2, b"k") + b"\x00"])
def test_torn_records_raise_format_error(rec):
    """Regression: a map record whose user key ran past its end was applied with a cut key
    and an empty value; trailing bytes after clears and removes were ignored."""
    with pytest.raises(FormatError):
        apply_record(rec, [{}, {}, {}], KINDS, 0)


# ------------------------------------------------------------------ .dstm files

tables_st = st.lists(st.dictionaries(st.integers(0, 7), st.dictionaries(
    small, st.one_of(small, st.lists(small, min_size=1, max_size=3),
                     st.dictionaries(small, small, min_size=1, max_size=3)),
    min_size=1, max_size=3), max_size=4), min_size=3, max_size=3)


def fitting(tables: list[dict]) -> list[dict]:
    """Entries of the right shape per state kind (value: bytes, list: list, map: dict)."""
    types = (bytes, list, dict)
    return [{kg: {k: v for k, v in d.items() if type(v) is types[sid]} for kg, d in t.items()}
            for sid, t in enumerate(tables)]


def read_back(data: bytes, sections: tuple, size: int, key_groups: KeyGroupRange) -> list:
    url = "memory://x/job/mat/f.dstm"
    h = MaterializedHandle("job", "mat/f.dstm", KeyGroupRange(0, 7), STATES, sections, size)
    tables: list[dict] = [{}, {}, {}]
    for kg, recs in read_sections(BytesStorage({url: data}), url, h, key_groups):
        apply_records(recs, tables, KINDS, kg)
    return tables


def nonempty(tables: list[dict], key_groups: KeyGroupRange) -> list[dict]:
    return [{kg: d for kg, d in t.items() if d and kg in key_groups} for t in tables]


@SETTINGS
@given(tables_st)
def test_materialized_files_round_trip(tables):
    tables = fitting(tables)
    data, sections = encode_tables(tables, STATES, KeyGroupRange(0, 7))
    for kgr in (KeyGroupRange(0, 7), KeyGroupRange(3, 3)):
        assert nonempty(read_back(data, sections, len(data), kgr), kgr) == nonempty(tables, kgr)


@SETTINGS
@given(tables_st, st.sampled_from([KeyGroupRange(0, 7), KeyGroupRange(3, 3)]), st.data())
def test_damaged_materialized_files_decode_equal_or_raise(tables, kgr, data):
    tables = fitting(tables)
    raw, sections = encode_tables(tables, STATES, KeyGroupRange(0, 7))
    bad = bytearray(raw)
    if data.draw(st.booleans()):
        bad[data.draw(st.integers(0, len(bad) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    else:
        del bad[data.draw(st.integers(0, len(bad) - 1)):]
    try:
        got = read_back(bytes(bad), sections, len(raw), kgr)
    except FormatError as e:
        assert "f.dstm" in str(e)
        return
    assert nonempty(got, kgr) == nonempty(tables, kgr)


def test_materialized_header_of_another_version_is_refused():
    data, sections = encode_tables([{0: {b"k": b"v"}}, {}, {}], STATES, KeyGroupRange(0, 7))
    head = struct.pack("<4sHH", b"DSTM", 2, 0)
    from dstl_ray.format.changelog import crc32c

    forged = head + struct.pack("<I", crc32c(head)) + data[12:]
    with pytest.raises(FormatError, match="version 2"):
        read_back(forged, sections, len(forged), KeyGroupRange(0, 7))


def test_float_edge_values_round_trip():
    for v in (math.inf, -math.inf, -0.0, 5e-324):
        assert SER.deserialize(SER.serialize(v)) == v
